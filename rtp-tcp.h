/* rtp-tcp.h - what the files of the tcp transport share: the wire format
 * (rtp-tcp-wire.c), connections and the handshake (rtp-tcp-conn.c), and the transport's
 * loop and requests (rtp-tcp.c). Internal. docs/transport.md has the protocol. */
#ifndef RTP_TCP_H
#define RTP_TCP_H

#include "rtp-comm.h"

#include <sys/socket.h>

#include <uv.h>

#define RC_VERSION 4
#define RC_FRAME_MAGIC 0x46505452u /* "RTPF" on the wire (little-endian) */
#define RC_HELLO_MAGIC 0x48505452u /* "RTPH" */
#define RC_HDR_SIZE 56
#define RC_HELLO_SIZE 80
#define RC_HELLO_DIRECT 1  /* HELLO flag: this rank accepts direct writes (RC_T_DONE) */
#define RC_HELLO_REFUSED 2 /* HELLO flag: the acceptor refuses (reason in byte 8) */
#define RC_MAC_SIZE 32
#define RC_NONCE_SIZE 32
#define RC_SEGMENT ((uint64_t)1 << 20) /* ring collectives: bytes per pipelined segment */
#define RC_P2P_FRAME ((uint64_t)8 << 20)
#define RC_WINDOW 4 /* data frames in flight per request and direction */
#define RC_MSG RTP_COMM_MSG
#define RC_ADDR_REC 64        /* REGISTER payload and PEERS record: u16 port, address string */
#define RC_HANDSHAKE_MS 10000 /* a connector's, from its connection to the acceptor's proof */
/* An acceptor's defences against strangers (docs/transport.md, "Strangers"): each
 * connection must prove the token within RC_ACCEPT_MS; at most RC_PENDING_PER_SOURCE
 * unproven connections per address and RC_PENDING_BASE + 2 x world size in all (the oldest
 * goes when a new one comes: a rank's handshake takes a round trip, a flood's lasts); and
 * an address that fails RC_FAILS_MAX handshakes within RC_FAILS_WINDOW_MS is closed on
 * sight for the rest of that window. */
#define RC_ACCEPT_MS 3000
#define RC_PENDING_PER_SOURCE 16
#define RC_PENDING_BASE 32
#define RC_FAILS_MAX 5
#define RC_FAILS_WINDOW_MS 60000
#define RC_SOURCES 32           /* addresses whose failures are remembered */
#define RC_RCVLOWAT (256 << 10) /* bytes a read waits for, at most (link_set_lowat) */

enum rc_type {
  RC_T_DATA = 1,
  RC_T_RTR,       /* ready to receive: (group, cls, seq) is posted here */
  RC_T_HEARTBEAT, /* keeps a quiet connection provably alive */
  RC_T_BYE,       /* the sender is leaving (rtp_comm_free) */
  RC_T_ABORT,     /* the sender failed; payload: the reason */
  RC_T_REGISTER,  /* rank r > 0 to rank 0: where r listens */
  RC_T_PEERS,     /* rank 0 to every rank: where everyone listens */
  RC_T_DONE,      /* a DATA frame's payload was written into the receiver's memory */
  RC_T_COUNT
};
enum rc_cls { RC_P2P = 0, RC_COLL = 1 };

/* ---- the wire (rtp-tcp-wire.c) ------------------------------------------------------- */

struct rc_hdr {
  uint32_t magic;
  uint8_t version, type, kind, cls;
  uint64_t seq;   /* collective number, or per-pair p2p number */
  uint64_t len;   /* payload bytes that follow this header */
  uint64_t total; /* RTR: bytes the receiver expects in all; DATA: frame index */
  uint64_t arg;   /* RTR: root (broadcast) or element size (allgather) */
  uint64_t addr;  /* RTR: the receive buffer's address for direct writes, or 0 */
  uint64_t group; /* the group the operation belongs to (0: the world) */
};

uint32_t rtp__tcp_get32(const uint8_t *p);
uint64_t rtp__tcp_get64(const uint8_t *p);
void rtp__tcp_put32(uint8_t *p, uint32_t v);
void rtp__tcp_put64(uint8_t *p, uint64_t v);
void rtp__tcp_hdr_put(uint8_t *p, const struct rc_hdr *h);
void rtp__tcp_hdr_get(const uint8_t *p, struct rc_hdr *h);
/* HMAC-SHA256(token, label | data). */
void rtp__tcp_hmac(const char *token, const char *label, const uint8_t *data, size_t n,
                   uint8_t out[RC_MAC_SIZE]);
/* This host and its namespaces (docs/transport.md, direct writes); 0: unknown or off. */
uint64_t rtp__tcp_host_key(void);
/* HELLO of (world size, rank), with a fresh nonce. */
void rtp__tcp_hello_fill(uint8_t *p, int size, int rank, uint64_t host_key);
/* A HELLO that refuses, saying why (enum rc_refusal) and what this rank has (its world
 * size). */
void rtp__tcp_hello_refuse(uint8_t *p, int why, uint32_t have);
/* NULL if p is a hello from another rank of a job of this size (in *rank), else why not;
 * *refusal: the rc_refusal to answer with (0: close without answering). */
const char *rtp__tcp_hello_check(const uint8_t *p, int size, int me, int *rank, int *refusal);
/* The reason an acceptor's refusing HELLO gives, as text; NULL if p does not refuse. */
const char *rtp__tcp_hello_refusal(const uint8_t *p, char *buf, size_t n);
void rtp__tcp_sa_to_str(const struct sockaddr *sa, char *out, size_t n);
int rtp__tcp_parse_ip(const char *s, int port, struct sockaddr_storage *out);
void rtp__tcp_sa_set_port(struct sockaddr_storage *sa, int port);
int rtp__tcp_sa_port(const struct sockaddr_storage *sa);
void rtp__tcp_sa_ip(const struct sockaddr_storage *sa, char *out, size_t n);

/* ---- structures ------------------------------------------------------------------------ */

struct tcp;
struct rc_link;
struct tcp_req;

struct rc_wslot {
  uv_write_t w;
  uint8_t hdr[RC_HDR_SIZE];
  struct rc_leg *leg;
};

/* One direction of one request on one connection. */
struct rc_leg {
  struct tcp_req *req;
  struct rc_leg *next, *prev; /* in the link's tx or rx list */
  struct rc_link *link;       /* NULL when not linked */
  int peer;                   /* world rank; -1: unused */
  bool tx;
  uint64_t nframes, total;
  bool ready;      /* tx: the receiver's RTR arrived and matched */
  uint64_t next_k; /* tx: frames issued; rx: frames received */
  uint64_t done;   /* tx: frames whose write completed */
  int inflight;
  int64_t dep;     /* tx: frame k waits for rx frame k - dep (< 0: never waits) */
  uint64_t direct; /* tx: the receiver's buffer address when frames go by direct write */
  bool offered;    /* rx: direct writes were offered, so the peer may write the buffer */
  unsigned slot_i;
  struct rc_wslot slot[RC_WINDOW];
};

/* The transport's side of a front-end request (same index in the pool). */
struct tcp_req {
  struct rtp_comm_req *req;
  const struct rtp_comm_op *op;
  struct tcp *comm;
  struct tcp_req *qnext;         /* submission queue */
  struct tcp_req *anext, *aprev; /* active list (comm thread) */
  int cls;
  struct rtp_coll_plan plan;
  int fail; /* first failure of this request */
  char fail_msg[RC_MSG];
  bool finished; /* on c->done_head, waiting to be published: hands off */
  uint64_t last_progress;
  struct rc_leg tx, rx;
};

struct rc_cslot { /* a control frame being written */
  uv_write_t w;
  struct rc_link *link;
  struct rc_cslot *next;
  bool heartbeat;
  uint8_t buf[RC_HDR_SIZE + RC_MSG + 96];
};

struct rc_rtr {
  uint8_t kind, cls;
  uint64_t group, seq, total, arg, addr;
};

enum rc_link_state { LS_CONNECTING, LS_HANDSHAKE, LS_UP, LS_CLOSING };
/* Why an acceptor refuses a hello, in its refusing HELLO (byte 8). */
enum rc_refusal { RC_REFUSE_SIZE = 1, RC_REFUSE_RANK, RC_REFUSE_DUPLICATE };
/* The handshake's reads: the acceptor's of HELLO_c, then mac_c; the connector's of
 * HELLO_a, then mac_a (docs/transport.md). */
enum rc_read_state { R_HELLO_C, R_HELLO_A, R_MAC_C, R_MAC_A, R_HDR, R_PAYLOAD, R_CTRL };

struct rc_link {
  uv_tcp_t tcp;
  uv_timer_t retry;
  struct tcp *comm;
  struct rc_link *next, *prev; /* comm->links_all */
  int nhandles;
  bool connector, has_timer, tcp_open;
  int state;
  int rank; /* the peer's; for a connector, the expected one */
  char addr[80];
  struct sockaddr_storage target;
  uv_connect_t creq;
  uint64_t deadline; /* handshake or connect deadline */
  /* reader */
  int rstate;
  uint8_t *rptr;
  size_t rwant, rhave;
  int lowat; /* the socket's SO_RCVLOWAT as last set; 0: the default */
  uint8_t hdrbuf[RC_HDR_SIZE];
  struct rc_hdr hdr;
  uint8_t hs[RC_HELLO_SIZE * 2 + RC_MAC_SIZE * 2]; /* HELLO_c, HELLO_a, mac_c, mac_a */
  uv_write_t hs_w[2]; /* the handshake's writes, straight from hs */
  char src[64];       /* an accepted connection's address (no port) */
  bool pending;       /* accepted, still unproven: counted in comm->n_pending */
  int refusals;       /* a connector's: times the acceptor closed before answering */
  uint8_t *ctrl;
  size_t ctrl_cap;
  float *scratch;
  size_t scratch_cap;
  struct rc_leg *rx_leg;
  uint8_t *rx_dst;
  uint64_t rx_len;
  bool rx_reduce;
  /* requests using this link */
  struct rc_leg *tx_legs, *rx_legs;
  struct rc_rtr *rtrs;
  int n_rtrs, cap_rtrs;
  /* control writes */
  struct rc_cslot *cslots, *cfree;
  bool hb_pending, bye_rx, bye_tx, aborting;
  uint64_t close_at; /* aborting: close by then */
  uv_shutdown_t shut;
  uint64_t last_rx, last_tx;
  /* Same host (and network and pid namespaces): payloads go by process_vm_writev into
   * the peer's memory, one copy instead of two through the loopback. */
  bool direct;
  int peer_pid;
};

struct rc_peer {
  char addr[RC_ADDR_REC];
  int port;
  bool registered;
};

/* A group whose frames this rank accepts: pushed onto c->groups by user threads (under
 * gmu, published with a release store), read by the comm thread; freed with the
 * transport. */
struct rc_group {
  uint64_t id;
  uint8_t *member; /* by world rank */
  struct rc_group *next;
};

struct tcp {
  struct rtp_comm_world *w;
  int rank, size; /* in the world */
  struct rtp_comm_params params;
  uint64_t host_key; /* this host and its namespaces; 0: direct writes off */

  pthread_mutex_t qmu; /* the submission queue and the flags below */
  pthread_cond_t qcv;  /* ready */
  struct tcp_req *q_head, *q_tail;
  bool ready, stopping, thread_started, fail_told, init_failed;
  struct tcp_req *reqs; /* by pool index */

  pthread_mutex_t gmu;
  struct rc_group *groups;

  /* comm thread */
  pthread_t thread;
  uv_loop_t loop;
  uv_async_t async;
  uv_timer_t timer;
  uv_idle_t idle; /* publishes finished requests */
  struct tcp_req *done_head;
  uv_tcp_t listener;
  bool listener_open, shutting_down, finalized;
  int loop_failed;      /* the comm thread's copy of the job's failure */
  const char *fail_msg; /* the job's message, once loop_failed */
  uint64_t shutdown_deadline, init_deadline;
  struct rc_link *links_all;
  int n_links_alive;
  /* Ready-to-receive frames of ranks that left (BYE) before this rank posted the
   * operation: a broadcast's last rank owes its root only an empty send, which such a
   * frame completes after the root is gone (rtp__tcp_link_close keeps them). */
  struct rc_left_rtr {
    int rank;
    struct rc_rtr t;
  } * left_rtrs;
  int n_left_rtrs;
  int n_pending; /* accepted connections still in the handshake */
  long n_shed;   /* of them, dropped for room or time (rtp__tcp_shed) */
  struct rc_source {
    char addr[64];
    int fails;
    uint64_t since;
  } sources[RC_SOURCES];  /* failed handshakes by address (RC_FAILS_MAX) */
  struct rc_link **links; /* authenticated, by rank */
  int n_up;
  struct rc_peer *peers;
  int n_registered;
  struct sockaddr_storage master;
  char master_str[RTP_COMM_MAX_ADDR + 16];
  struct sockaddr_storage bind_sa;
  bool have_bind;
  char my_addr[RC_ADDR_REC];
  int my_port;
  struct tcp_req *active;
};

/* ---- rtp-tcp.c: what the connections call back into -------------------------------- */

uint64_t rtp__tcp_now_ms(struct tcp *c);
/* Fails the job from the comm thread: logs, ABORTs every connection, fails the
 * pending requests. */
void rtp__tcp_comm_fail(struct tcp *c, int status, const char *fmt, ...) RTP_PRINTF(3, 4);
void rtp__tcp_maybe_finalize(struct tcp *c);
void rtp__tcp_set_ready(struct tcp *c);
void rtp__tcp_req_check(struct tcp_req *r);
void rtp__tcp_on_rtr(struct rc_link *l, const struct rc_hdr *h);
void rtp__tcp_on_data_hdr(struct rc_link *l, const struct rc_hdr *h);
void rtp__tcp_on_payload(struct rc_link *l);
const char *rtp__tcp_peer_addr(struct tcp *c, int rank);
/* Whether `group` is one of this rank's that world rank `rank` is a member of. */
bool rtp__tcp_group_has(struct tcp *c, uint64_t group, int rank);
void rtp__tcp_leg_unlink(struct rc_leg *g);

/* ---- rtp-tcp-conn.c: connections ----------------------------------------------------- */

int rtp__tcp_send_ctrl(struct rc_link *l, const struct rc_hdr *h, const void *payload);
void rtp__tcp_link_close(struct rc_link *l);
void rtp__tcp_link_set_lowat(struct rc_link *l);
void rtp__tcp_reader_expect(struct rc_link *l, int state, void *ptr, size_t n);
void rtp__tcp_reader_step(struct rc_link *l);
void rtp__tcp_protocol_error(struct rc_link *l, const char *fmt, ...) RTP_PRINTF(2, 3);
void rtp__tcp_refuse(struct rc_link *l, const char *why);
/* Drops an unproven connection that a flood may have opened (evicted, or out of time),
 * logging a sample of them. */
void rtp__tcp_shed(struct rc_link *l, const char *why);
/* Listens, then (rank > 0) connects to rank 0: the rendezvous, on the comm thread. */
void rtp__tcp_loop_start(struct tcp *c);

#endif /* RTP_TCP_H */
