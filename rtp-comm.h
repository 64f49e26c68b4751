/* rtp-comm.h - the communicator's front end (rtp-comm.c) and the transports behind it:
 * "local" (rtp-local.c), "tcp" (rtp-tcp*.c) and "nccl" (rtp-nccl.c). Internal.
 *
 * The front end owns everything a user sees: parameters, groups, the request pool,
 * argument checks, sequence numbers, waiting, and the job's failure. It describes each
 * operation as a struct rtp_comm_op in world ranks and hands it to a transport through
 * struct rtp_transport_i, as the core reaches devices through rtp_backend_i. Transports
 * know nothing of groups beyond the id each frame carries, nor of graphs or strategies.
 * docs/architecture.md has the layers; docs/transport.md the wire and the algorithms. */
#ifndef RTP_COMM_H
#define RTP_COMM_H

#include <pthread.h>

#ifdef __cplusplus
extern "C" {
#endif

#include "rtp-impl.h"

#define RTP_COMM_MSG 256
#define RTP_COMM_MAX_WORLD 65536

/* What an operation does. The values travel in tcp's frame headers: append only. */
#define RTP_COMM_KIND_MAP(XX)          \
  XX(P2P, "send/recv")                 \
  XX(ALLREDUCE, "allreduce")           \
  XX(REDUCE_SCATTER, "reduce_scatter") \
  XX(ALLGATHER, "allgather")           \
  XX(BROADCAST, "broadcast")           \
  XX(BARRIER, "barrier")

enum rtp_comm_kind {
  RTP_COMM_K_NONE = 0,
#define RTP_XX(name, text) RTP_COMM_K_##name,
  RTP_COMM_KIND_MAP(RTP_XX)
#undef RTP_XX
      RTP_COMM_K_COUNT
};
const char *rtp__comm_kind_name(int kind);

/*
 * One operation of one group. The caller fills the first part (ranks are the group's);
 * rtp__comm_post fills the rest. P2P: send sbytes at sbuf to dst and/or receive rbytes
 * into buf from src (-1: that side is absent; both == rank: a copy). Collectives: buf of
 * count elements of esize bytes, in place (broadcast: count bytes from root).
 */
struct rtp_comm_op {
  int kind; /* enum rtp_comm_kind */
  const uint8_t *sbuf;
  uint8_t *buf;
  uint64_t sbytes, rbytes; /* P2P */
  uint64_t count, esize;   /* collectives */
  int dst, src;            /* P2P, group ranks */
  int root;                /* broadcast, group rank */
  const char *what;        /* a name for messages (a graph node's), or NULL */
  /* filled by the front end */
  uint64_t group;       /* the group's id: frames carry it */
  int rank, size;       /* this rank's place in the group, and its size */
  int tx_peer, rx_peer; /* world ranks sent to / received from; -1: none */
  uint64_t seq, rx_seq; /* collective number, or per-pair message numbers */
};

/* ---- collective geometry (rtp-coll.c): pure functions of an operation ------------ */

/* How an operation is cut into frames: a P2P message into frames of p2p_frame bytes, a
 * ring collective into steps of blocks (rtp_comm_block) of nseg segments each, a
 * broadcast into nseg segments along the chain. Frame k of the sending leg waits for
 * frame k - dep of the receiving one (dep < 0: never). */
struct rtp_coll_plan {
  int steps;     /* ring steps */
  uint64_t nseg; /* segments per block (collectives) */
  uint64_t p2p_frame;
  uint64_t nframes[2], total[2]; /* [0]: what this rank sends, [1]: what it receives */
  int64_t dep;
};
/* The group ranks an operation sends to and receives from (-1: none). */
void rtp__coll_peers(const struct rtp_comm_op *op, int *to, int *from);
void rtp__coll_plan(const struct rtp_comm_op *op, uint64_t segment, uint64_t p2p_frame,
                    struct rtp_coll_plan *plan);
/* Frame k of the sending (tx) or receiving leg: its byte offset in sbuf (P2P tx) or buf,
 * its length, and whether the receiver adds it into buf (a reduce-scatter step). */
void rtp__coll_frame(const struct rtp_comm_op *op, const struct rtp_coll_plan *plan, bool tx,
                     uint64_t k, uint64_t *offset, uint64_t *len, bool *reduce);
/* The block a ring collective's step s sends (tx) or receives, and *reduce as above. */
int rtp__coll_ring_block(int kind, int rank, int n, bool tx, int s, bool *reduce);

/* ---- the front end ------------------------------------------------------------------ */

struct rtp_transport;
struct rtp_comm_world;

enum rtp_comm_req_state { RTP_REQ_FREE = 0, RTP_REQ_POSTED, RTP_REQ_DONE };

struct rtp_comm_req {
  struct rtp_comm_world *w;
  struct rtp_comm_req *next; /* free list */
  int index;                 /* in the pool: transports keep their state by it */
  int state;                 /* under w->mu */
  int status;                /* under w->mu once done */
  char msg[RTP_COMM_MSG];
  struct rtp_comm_op op; /* written before the transport sees it, read-only after */
};

/* Completes r (from any thread; at most once): a waiter may take it back at once, so the
 * transport must not touch r afterwards. */
void rtp__comm_req_done(struct rtp_comm_req *r, int status, const char *msg);

/* Records the job's failure if it is the first (status < 0) and returns the first one,
 * with its message in *msg (valid for the job's life). Every later post fails with it. */
int rtp__comm_world_fail(struct rtp_comm_world *w, int status, const char *msg,
                         const char **first_msg);
const struct rtp_comm_params *rtp__comm_world_params(const struct rtp_comm_world *w);
/* Tells the launcher (rtp-run, through RTP_RUN_BLAME_FD) that world rank `rank` caused
 * this rank's failure (`why`: "silent", "lost"), so that its last line names the rank at
 * fault rather than the one that noticed. Once per process; nothing without a launcher. */
void rtp__comm_blame(struct rtp_comm_world *w, int rank, const char *why);

/* Posts op (group ranks) on c's host transport, as every rtp_comm_* operation does:
 * checks it, numbers it and returns a request (or waits for it when req is NULL). */
int rtp__comm_post(struct rtp_comm *c, struct rtp_comm_op *op, struct rtp_comm_req **req);
/* rtp__comm_post in two halves, for a post that runs later on another thread (a device
 * backend's transfer staged through host memory, run by a stream's host function):
 * number checks op and gives it its sequence numbers now, in the caller's program order,
 * so that whichever thread posts what first, every rank matches the same operations;
 * submit then posts the numbered op from any thread (op's buffers as they are then).
 * A numbered op must be submitted, or the job failed (rtp_comm_abort): its peers wait for
 * it otherwise. number fails at once if the job has failed. */
int rtp__comm_number(struct rtp_comm *c, struct rtp_comm_op *op);
int rtp__comm_submit(struct rtp_comm *c, const struct rtp_comm_op *op,
                     struct rtp_comm_req **req);
/* Enqueues op on device buffers on a device stream through c's device transport (nccl);
 * RTP_ENOSYS when c has none. */
int rtp__comm_post_stream(struct rtp_comm *c, struct rtp_comm_op *op, void *stream);
/* c's device transport, or NULL. */
struct rtp_transport *rtp__comm_device(const struct rtp_comm *c);

/* ---- transports ------------------------------------------------------------------------ */

/* Every function may be called from any thread unless it says otherwise. */
struct rtp_transport_i {
  const char *name;
  /* Starts r, whose op the front end filled. Must not block on the network; completes r
   * later with rtp__comm_req_done. (optional: NULL for transports of device buffers) */
  void (*submit)(struct rtp_transport *t, struct rtp_comm_req *r);
  /* Enqueues op on device buffers on stream. (optional) */
  int (*post_stream)(struct rtp_transport *t, const struct rtp_comm_op *op, void *stream);
  /* The group `id` of members (world ranks, by group rank) exists from now on: frames
   * of it are accepted from its members. (optional) */
  int (*group_add)(struct rtp_transport *t, uint64_t id, const int *members, int n);
  /* The address by which world rank `rank` joined (its host's: ranks that share one
   * share a host), from the rendezvous. (optional: then every rank is its own host) */
  void (*host)(struct rtp_transport *t, int rank, char *out, size_t n);
  /* The job failed from outside this transport (the front end recorded it): tell the
   * peers and fail what is pending. (optional) */
  void (*fail)(struct rtp_transport *t);
  /* Says goodbye to the peers and frees everything; pending requests fail. */
  void (*free)(struct rtp_transport *t);
};

struct rtp_transport {
  const struct rtp_transport_i *i;
  void *impl;
};

/* The transports' constructors. Host transports join the job's world; the device one
 * (nccl) bootstraps through c's public operations and serves c's group. */
struct rtp_transport *rtp__local_transport(void);
struct rtp_transport *rtp__dry_transport(void);

/* A communicator of world_size ranks in which this process is `rank` and no other rank
 * exists: every operation completes at once, moving nothing (rtp-local.c's dry
 * transport). For planning (tools/rtp-plan): rtp_parallel_new builds the exact graph of
 * one rank of a job of any size, with no peers and no sockets; computing that graph
 * would compute garbage. */
int rtp__comm_dry_new(int world_size, int rank, struct rtp_comm **out);
int rtp__tcp_new(struct rtp_comm_world *w, struct rtp_transport **out);
#ifdef RTP_HAVE_NCCL
int rtp__nccl_new(struct rtp_comm *c, int device, int timeout_ms, struct rtp_transport **out);
#endif

#ifdef __cplusplus
}
#endif

#endif /* RTP_COMM_H */
