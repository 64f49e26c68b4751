/*
 * rtp-ring.c - the rtp_comm transport: request pool and front end, the "local" backend,
 * and the "tcp" backend (libuv loop on a comm thread, rendezvous through rank 0,
 * HMAC-authenticated connections, checked frames, ring collectives).
 *
 * Threads. User threads post requests: under c->mu they take a request from the fixed
 * pool, fill it and append it to the submission queue, then wake the loop with
 * uv_async_send. Everything else (sockets, request state machines) lives on the comm
 * thread. A request's completion (done, status, msg) is written under c->mu and
 * signalled on c->cv.
 *
 * Flow control. No data frame is ever sent before its receiver posted the matching
 * request and said so with a ready-to-receive (RTR) frame, so a receiver never buffers
 * or blocks a connection: every byte that arrives has a destination (the user's buffer,
 * or for a reduction a per-connection scratch segment). docs/transport.md has the wire
 * format and the algorithms.
 */
#define _GNU_SOURCE /* process_vm_writev */
#include "rtp-backend.h"
#include "rtp-nccl.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <uv.h>

#define RC_VERSION 2
#define RC_FRAME_MAGIC 0x46505452u /* "RTPF" on the wire (little-endian) */
#define RC_HELLO_MAGIC 0x48505452u /* "RTPH" */
#define RC_HDR_SIZE 48
#define RC_HELLO_SIZE 80
#define RC_HELLO_DIRECT 1 /* HELLO flag: this rank accepts direct writes (RC_T_DONE) */
#define RC_MAC_SIZE 32
#define RC_NONCE_SIZE 32
#define RC_SEGMENT ((uint64_t)1 << 20) /* ring collectives: bytes per pipelined segment */
#define RC_P2P_FRAME ((uint64_t)8 << 20)
#define RC_WINDOW 4 /* data frames in flight per request and direction */
#define RC_MSG 256
#define RC_ADDR_REC 64 /* REGISTER payload and PEERS record: u16 port, address string */
#define RC_MAX_WORLD 65536
#define RC_HANDSHAKE_MS 10000
#define RC_RCVLOWAT (256 << 10) /* bytes a read waits for, at most (link_set_lowat) */

enum rc_type {
  RC_T_DATA = 1,
  RC_T_RTR,       /* ready to receive: (cls, seq) is posted here */
  RC_T_HEARTBEAT, /* keeps a quiet connection provably alive */
  RC_T_BYE,       /* the sender is leaving (rtp_comm_free) */
  RC_T_ABORT,     /* the sender failed; payload: the reason */
  RC_T_REGISTER,  /* rank r > 0 to rank 0: where r listens */
  RC_T_PEERS,     /* rank 0 to every rank: where everyone listens */
  RC_T_DONE,      /* a DATA frame's payload was written into the receiver's memory */
  RC_T_COUNT
};
enum rc_cls { RC_P2P = 0, RC_COLL = 1 };

#define RC_KIND_MAP(XX)                \
  XX(P2P, "send/recv")                 \
  XX(ALLREDUCE, "allreduce")           \
  XX(REDUCE_SCATTER, "reduce_scatter") \
  XX(ALLGATHER, "allgather")           \
  XX(BROADCAST, "broadcast")           \
  XX(BARRIER, "barrier")

enum rc_kind {
  RC_K_NONE = 0,
#define RC_XX(name, text) RC_K_##name,
  RC_KIND_MAP(RC_XX)
#undef RC_XX
      RC_K_COUNT
};

static const char *kind_name(int k) {
  switch (k) {
#define RC_XX(name, text) \
  case RC_K_##name:       \
    return text;
    RC_KIND_MAP(RC_XX)
#undef RC_XX
  }
  return "unknown";
}

/* ---- wire encoding (little-endian) ---------------------------------------------- */

struct rc_hdr {
  uint32_t magic;
  uint8_t version, type, kind, cls;
  uint64_t seq;   /* collective number, or per-pair p2p number */
  uint64_t len;   /* payload bytes that follow this header */
  uint64_t total; /* RTR: bytes the receiver expects in all; DATA: frame index */
  uint64_t arg;   /* RTR: root (broadcast) or element size (allgather) */
  uint64_t addr;  /* RTR: the receive buffer's address for direct writes, or 0 */
};

static void put32(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static void put64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static uint32_t get32(const uint8_t *p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; i++) v |= (uint32_t)p[i] << (8 * i);
  return v;
}
static uint64_t get64(const uint8_t *p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; i++) v |= (uint64_t)p[i] << (8 * i);
  return v;
}

static void hdr_put(uint8_t *p, const struct rc_hdr *h) {
  put32(p, RC_FRAME_MAGIC);
  p[4] = RC_VERSION;
  p[5] = h->type;
  p[6] = h->kind;
  p[7] = h->cls;
  put64(p + 8, h->seq);
  put64(p + 16, h->len);
  put64(p + 24, h->total);
  put64(p + 32, h->arg);
  put64(p + 40, h->addr);
}

static void hdr_get(const uint8_t *p, struct rc_hdr *h) {
  h->magic = get32(p);
  h->version = p[4];
  h->type = p[5];
  h->kind = p[6];
  h->cls = p[7];
  h->seq = get64(p + 8);
  h->len = get64(p + 16);
  h->total = get64(p + 24);
  h->arg = get64(p + 32);
  h->addr = get64(p + 40);
}

/* ---- structures ----------------------------------------------------------------- */

struct rtp_comm;
struct rc_link;

struct rc_wslot {
  uv_write_t w;
  uint8_t hdr[RC_HDR_SIZE];
  struct rc_leg *leg;
};

/* One direction of one request on one connection. */
struct rc_leg {
  struct rtp_comm_req *req;
  struct rc_leg *next, *prev; /* in the link's tx or rx list */
  struct rc_link *link;       /* NULL when not linked */
  int peer;                   /* -1: unused */
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

enum rc_req_state { RQ_FREE = 0, RQ_QUEUED, RQ_ACTIVE, RQ_DONE };

struct rtp_comm_req {
  struct rtp_comm *comm;
  struct rtp_comm_req *qnext;         /* free list or submission queue */
  struct rtp_comm_req *anext, *aprev; /* active list (comm thread) */
  int state;                          /* under c->mu */
  int status;                         /* under c->mu once done */
  char msg[RC_MSG];                   /* under c->mu once done */
  /* the operation, written by the poster, then read by the comm thread */
  int kind, cls;
  uint64_t seq;    /* what this rank sends: collective number or p2p send number */
  uint64_t rx_seq; /* what it receives: the same, or the p2p recv number */
  const uint8_t *sbuf;
  uint8_t *buf;
  uint64_t sbytes, rbytes; /* p2p */
  uint64_t count, esize;   /* collectives (broadcast: count = bytes, esize 1) */
  int root;
  /* comm thread state */
  int T;         /* ring steps */
  uint64_t nseg; /* segments per block */
  int fail;      /* first failure of this request */
  char fail_msg[RC_MSG];
  bool finished; /* on c->done_list, waiting to be published: hands off */
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
  uint64_t seq, total, arg, addr;
};

enum rc_link_state { LS_CONNECTING, LS_HANDSHAKE, LS_UP, LS_CLOSING };
enum rc_read_state { R_HELLO1, R_HELLO2, R_HELLO3, R_HDR, R_PAYLOAD, R_CTRL };

struct rc_link {
  uv_tcp_t tcp;
  uv_timer_t retry;
  struct rtp_comm *comm;
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
  uint8_t hs[RC_HELLO_SIZE * 2 + RC_MAC_SIZE * 2];
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

struct rtp_comm {
  int rank, size;
  bool local;
  struct rtp_comm_params params;
  uint64_t job_id;
  uint64_t host_key; /* this host and its namespaces; 0: direct writes off */

  pthread_mutex_t mu;
  pthread_cond_t cv;
  struct rtp_comm_req *pool, *free_list, *q_head, *q_tail;
  int failed; /* sticky status, under mu */
  char fail_msg[RC_MSG];
  bool fail_told; /* failed by rtp__comm_fail, not yet told to the loop; under mu */
  bool ready, stopping, thread_started;
  uint64_t coll_seq;
  uint64_t *p2p_tx_seq, *p2p_rx_seq;

  /* comm thread */
  pthread_t thread;
  uv_loop_t loop;
  uv_async_t async;
  uv_timer_t timer;
  uv_idle_t idle; /* publishes finished requests */
  struct rtp_comm_req *done_head;
  uv_tcp_t listener;
  bool listener_open, shutting_down, finalized;
  int loop_failed; /* the comm thread's copy of failed */
  uint64_t shutdown_deadline, init_deadline;
  struct rc_link *links_all;
  int n_links_alive;
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
  struct rtp_comm_req *active;

  struct rtp_nccl *nccl; /* backend "nccl": the device communicator (rtp-nccl.c) */
};

/* ---- small helpers -------------------------------------------------------------- */

void rtp_comm_block(size_t count, int n, int i, size_t *first, size_t *len) {
  if (n < 1) n = 1;
  size_t q = count / (size_t)n, rem = count % (size_t)n, ui = (size_t)i;
  if (first) *first = ui * q + (ui < rem ? ui : rem);
  if (len) *len = q + (ui < rem ? 1 : 0);
}

static int imod(int a, int n) {
  int m = a % n;
  return m < 0 ? m + n : m;
}

static uint64_t ceil_div(uint64_t a, uint64_t b) {
  return a / b + (a % b != 0);
}

static void sa_to_str(const struct sockaddr *sa, char *out, size_t n) {
  char ip[64] = "?";
  int port = 0;
  if (sa->sa_family == AF_INET) {
    const struct sockaddr_in *s4 = (const struct sockaddr_in *)sa;
    uv_ip4_name(s4, ip, sizeof(ip));
    port = ntohs(s4->sin_port);
    snprintf(out, n, "%s:%d", ip, port);
  } else if (sa->sa_family == AF_INET6) {
    const struct sockaddr_in6 *s6 = (const struct sockaddr_in6 *)sa;
    uv_ip6_name(s6, ip, sizeof(ip));
    port = ntohs(s6->sin6_port);
    snprintf(out, n, "[%s]:%d", ip, port);
  } else {
    snprintf(out, n, "?");
  }
}

static int parse_ip(const char *s, int port, struct sockaddr_storage *out) {
  memset(out, 0, sizeof(*out));
  if (uv_ip4_addr(s, port, (struct sockaddr_in *)out) == 0) return 0;
  if (uv_ip6_addr(s, port, (struct sockaddr_in6 *)out) == 0) return 0;
  return -1;
}

static void sa_set_port(struct sockaddr_storage *sa, int port) {
  if (sa->ss_family == AF_INET) ((struct sockaddr_in *)sa)->sin_port = htons((uint16_t)port);
  if (sa->ss_family == AF_INET6) ((struct sockaddr_in6 *)sa)->sin6_port = htons((uint16_t)port);
}

static int sa_port(const struct sockaddr_storage *sa) {
  if (sa->ss_family == AF_INET) return ntohs(((const struct sockaddr_in *)sa)->sin_port);
  if (sa->ss_family == AF_INET6) return ntohs(((const struct sockaddr_in6 *)sa)->sin6_port);
  return 0;
}

static void sa_ip(const struct sockaddr_storage *sa, char *out, size_t n) {
  if (sa->ss_family == AF_INET6)
    uv_ip6_name((const struct sockaddr_in6 *)sa, out, n);
  else
    uv_ip4_name((const struct sockaddr_in *)sa, out, n);
}

static void hmac32(const char *token, const char *label, const uint8_t *data, size_t n,
                   uint8_t out[RC_MAC_SIZE]) {
  size_t ll = strlen(label);
  uint8_t buf[512];
  unsigned int outlen = RC_MAC_SIZE;
  RTP_ASSERT(ll + n <= sizeof(buf));
  memcpy(buf, label, ll);
  if (n) memcpy(buf + ll, data, n);
  RTP_ASSERT(HMAC(EVP_sha256(), token, (int)strlen(token), buf, ll + n, out, &outlen) != NULL);
}

/* ---- the request pool and completion ---------------------------------------------- */

static void req_finish_locked(struct rtp_comm *c, struct rtp_comm_req *r, int status,
                              const char *msg) {
  r->status = status;
  snprintf(r->msg, sizeof(r->msg), "%s", msg ? msg : "");
  r->state = RQ_DONE;
  pthread_cond_broadcast(&c->cv);
}

static int req_take(struct rtp_comm *c, struct rtp_comm_req **out) {
  /* under c->mu */
  if (c->failed) return rtp__error(c->failed, "%s", c->fail_msg);
  if (c->stopping) return rtp__error(RTP_ESTATE, "communicator is being freed");
  struct rtp_comm_req *r = c->free_list;
  if (!r)
    return rtp__error(RTP_ESTATE,
                      "too many communication requests in flight (max_requests = %d): "
                      "wait on some first",
                      c->params.max_requests);
  c->free_list = r->qnext;
  struct rtp_comm *comm = r->comm;
  memset(r, 0, sizeof(*r));
  r->comm = comm;
  r->tx.peer = r->rx.peer = -1;
  r->tx.req = r->rx.req = r;
  r->tx.tx = true;
  r->state = RQ_QUEUED;
  *out = r;
  return RTP_OK;
}

static void req_release_locked(struct rtp_comm *c, struct rtp_comm_req *r) {
  r->state = RQ_FREE;
  r->qnext = c->free_list;
  c->free_list = r;
}

static int req_result(struct rtp_comm *c, struct rtp_comm_req *r) {
  /* under c->mu, r done: copies the outcome to the caller and frees r */
  int st = r->status;
  char msg[RC_MSG];
  snprintf(msg, sizeof(msg), "%s", r->msg);
  req_release_locked(c, r);
  pthread_mutex_unlock(&c->mu);
  if (st < 0) rtp__error(st, "%s", msg);
  return st;
}

int rtp_comm_wait_for(struct rtp_comm_req *r, int timeout_ms) {
  if (!r) return rtp__error(RTP_EINVAL, "rtp_comm_wait: NULL request");
  struct rtp_comm *c = r->comm;
  pthread_mutex_lock(&c->mu);
  if (r->state != RQ_QUEUED && r->state != RQ_ACTIVE && r->state != RQ_DONE) {
    pthread_mutex_unlock(&c->mu);
    return rtp__error(RTP_EINVAL, "rtp_comm_wait: request already waited on");
  }
  struct timespec ts;
  if (timeout_ms >= 0) {
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += timeout_ms / 1000;
    ts.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
    if (ts.tv_nsec >= 1000000000L) {
      ts.tv_sec++;
      ts.tv_nsec -= 1000000000L;
    }
  }
  while (r->state != RQ_DONE) {
    if (timeout_ms < 0) {
      pthread_cond_wait(&c->cv, &c->mu);
    } else if (pthread_cond_timedwait(&c->cv, &c->mu, &ts) == ETIMEDOUT &&
               r->state != RQ_DONE) {
      pthread_mutex_unlock(&c->mu);
      return rtp__error(RTP_ETIMEDOUT, "request still pending after %d ms", timeout_ms);
    }
  }
  return req_result(c, r);
}

int rtp_comm_wait(struct rtp_comm_req *r) {
  return rtp_comm_wait_for(r, -1);
}

int rtp_comm_test(struct rtp_comm_req *r, bool *done) {
  if (!r || !done) return rtp__error(RTP_EINVAL, "rtp_comm_test: NULL argument");
  struct rtp_comm *c = r->comm;
  pthread_mutex_lock(&c->mu);
  if (r->state != RQ_DONE) {
    *done = false;
    pthread_mutex_unlock(&c->mu);
    return RTP_OK;
  }
  *done = true;
  return req_result(c, r);
}

/* ---- frame geometry --------------------------------------------------------------- */

/* The block a ring step sends (tx) or receives (rx). Reduce-scatter leaves rank r
 * with block r; all-gather starts from it. */
static int ring_block(const struct rtp_comm_req *r, int rank, int n, bool tx, int s,
                      bool *reduce) {
  bool rs = r->kind == RC_K_REDUCE_SCATTER || (r->kind == RC_K_ALLREDUCE && s < n - 1);
  *reduce = rs && !tx;
  if (rs) return imod(tx ? rank - s - 1 : rank - s - 2, n);
  if (r->kind == RC_K_ALLREDUCE) s -= n - 1;
  return imod(tx ? rank - s : rank - s - 1, n);
}

static void frame_geom(const struct rtp_comm *c, const struct rtp_comm_req *r, bool tx,
                       uint64_t k, uint8_t **ptr, uint64_t *len, bool *reduce) {
  *reduce = false;
  if (r->kind == RC_K_P2P) {
    uint64_t n = tx ? r->sbytes : r->rbytes;
    uint64_t off = k * RC_P2P_FRAME;
    *ptr = (tx ? (uint8_t *)r->sbuf : r->buf) + off;
    *len = n - off < RC_P2P_FRAME ? n - off : RC_P2P_FRAME;
  } else if (r->kind == RC_K_BROADCAST) {
    size_t first, l;
    rtp_comm_block(r->count, (int)r->nseg, (int)k, &first, &l);
    *ptr = r->buf + first;
    *len = l;
  } else {
    int s = (int)(k / r->nseg);
    uint64_t j = k % r->nseg;
    int b = ring_block(r, c->rank, c->size, tx, s, reduce);
    size_t bf, bl, sf, sl;
    rtp_comm_block(r->count, c->size, b, &bf, &bl);
    rtp_comm_block(bl, (int)r->nseg, (int)j, &sf, &sl);
    *ptr = r->buf + (bf + sf) * r->esize;
    *len = sl * r->esize;
  }
}

/* ---- the local backend and posting ------------------------------------------------ */

static void req_wake_loop(struct rtp_comm *c, struct rtp_comm_req *r) {
  /* under c->mu */
  r->qnext = NULL;
  if (c->q_tail)
    c->q_tail->qnext = r;
  else
    c->q_head = r;
  c->q_tail = r;
}

/* Takes a request for r_init to fill, then queues it (or completes it locally). */
static int post(struct rtp_comm *c, struct rtp_comm_req **out, int kind, int cls, int peer_tx,
                int peer_rx, const void *sbuf, uint64_t sbytes, void *buf, uint64_t rbytes,
                uint64_t count, uint64_t esize, int root) {
  struct rtp_comm_req *r = NULL;
  pthread_mutex_lock(&c->mu);
  int st = req_take(c, &r);
  if (st < 0) {
    pthread_mutex_unlock(&c->mu);
    return st;
  }
  r->kind = kind;
  r->cls = cls;
  r->sbuf = sbuf;
  r->buf = buf;
  r->sbytes = sbytes;
  r->rbytes = rbytes;
  r->count = count;
  r->esize = esize;
  r->root = root;
  r->tx.peer = peer_tx;
  r->rx.peer = peer_rx;
  bool local = c->size == 1 || (kind == RC_K_P2P && peer_tx < 0 && peer_rx < 0);
  if (local) {
    /* world size 1, or a rotation onto oneself: nothing to send */
    if (kind == RC_K_P2P && sbytes && buf && sbuf && sbuf != buf) memmove(buf, sbuf, sbytes);
    req_finish_locked(c, r, RTP_OK, NULL);
  } else {
    if (cls == RC_COLL) {
      r->seq = r->rx_seq = c->coll_seq++;
    } else {
      if (peer_tx >= 0) r->seq = c->p2p_tx_seq[peer_tx]++;
      if (peer_rx >= 0) r->rx_seq = c->p2p_rx_seq[peer_rx]++;
    }
    req_wake_loop(c, r);
  }
  pthread_mutex_unlock(&c->mu);
  if (!local) uv_async_send(&c->async);
  if (out) {
    *out = r;
    return RTP_OK;
  }
  return rtp_comm_wait(r);
}

static int check_comm(struct rtp_comm *c, const char *what) {
  if (!c) return rtp__error(RTP_EINVAL, "%s: NULL communicator", what);
  return RTP_OK;
}

static int check_rank(struct rtp_comm *c, int peer, const char *what) {
  if (peer < 0 || peer >= c->size)
    return rtp__error(RTP_EINVAL, "%s: rank %d out of range (world size %d)", what, peer,
                      c->size);
  return RTP_OK;
}

int rtp_comm_send(struct rtp_comm *c, const void *buf, size_t nbytes, int dst,
                  struct rtp_comm_req **req) {
  int st;
  if ((st = check_comm(c, "rtp_comm_send")) < 0) return st;
  if ((st = check_rank(c, dst, "rtp_comm_send")) < 0) return st;
  if (dst == c->rank)
    return rtp__error(RTP_EINVAL, "rtp_comm_send: sending to oneself (use sendrecv)");
  if (!buf && nbytes) return rtp__error(RTP_EINVAL, "rtp_comm_send: NULL buffer");
  return post(c, req, RC_K_P2P, RC_P2P, dst, -1, buf, nbytes, NULL, 0, 0, 1, 0);
}

int rtp_comm_recv(struct rtp_comm *c, void *buf, size_t nbytes, int src,
                  struct rtp_comm_req **req) {
  int st;
  if ((st = check_comm(c, "rtp_comm_recv")) < 0) return st;
  if ((st = check_rank(c, src, "rtp_comm_recv")) < 0) return st;
  if (src == c->rank)
    return rtp__error(RTP_EINVAL, "rtp_comm_recv: receiving from oneself (use sendrecv)");
  if (!buf && nbytes) return rtp__error(RTP_EINVAL, "rtp_comm_recv: NULL buffer");
  return post(c, req, RC_K_P2P, RC_P2P, -1, src, NULL, 0, buf, nbytes, 0, 1, 0);
}

int rtp_comm_sendrecv(struct rtp_comm *c, const void *sendbuf, size_t sendbytes, int dst,
                      void *recvbuf, size_t recvbytes, int src, struct rtp_comm_req **req) {
  int st;
  if ((st = check_comm(c, "rtp_comm_sendrecv")) < 0) return st;
  if ((st = check_rank(c, dst, "rtp_comm_sendrecv")) < 0) return st;
  if ((st = check_rank(c, src, "rtp_comm_sendrecv")) < 0) return st;
  if ((!sendbuf && sendbytes) || (!recvbuf && recvbytes))
    return rtp__error(RTP_EINVAL, "rtp_comm_sendrecv: NULL buffer");
  if ((dst == c->rank) != (src == c->rank))
    return rtp__error(RTP_EINVAL,
                      "rtp_comm_sendrecv: dst %d and src %d must both or neither be this "
                      "rank (%d)",
                      dst, src, c->rank);
  if (dst == c->rank) {
    if (sendbytes != recvbytes)
      return rtp__error(RTP_EINVAL,
                        "rtp_comm_sendrecv: %zu bytes sent to oneself, %zu "
                        "expected",
                        sendbytes, recvbytes);
    return post(c, req, RC_K_P2P, RC_P2P, -1, -1, sendbuf, sendbytes, recvbuf, recvbytes, 0, 1,
                0);
  }
  return post(c, req, RC_K_P2P, RC_P2P, dst, src, sendbuf, sendbytes, recvbuf, recvbytes, 0, 1,
              0);
}

static int post_ring(struct rtp_comm *c, int kind, void *buf, size_t count, size_t esize,
                     int root, struct rtp_comm_req **req) {
  int right = (c->rank + 1) % c->size, left = imod(c->rank - 1, c->size);
  return post(c, req, kind, RC_COLL, right, left, NULL, 0, buf, 0, count, esize, root);
}

int rtp_comm_allreduce(struct rtp_comm *c, float *buf, size_t count,
                       struct rtp_comm_req **req) {
  int st;
  if ((st = check_comm(c, "rtp_comm_allreduce")) < 0) return st;
  if (!buf && count) return rtp__error(RTP_EINVAL, "rtp_comm_allreduce: NULL buffer");
  return post_ring(c, RC_K_ALLREDUCE, buf, count, sizeof(float), 0, req);
}

int rtp_comm_reduce_scatter(struct rtp_comm *c, float *buf, size_t count,
                            struct rtp_comm_req **req) {
  int st;
  if ((st = check_comm(c, "rtp_comm_reduce_scatter")) < 0) return st;
  if (!buf && count) return rtp__error(RTP_EINVAL, "rtp_comm_reduce_scatter: NULL buffer");
  return post_ring(c, RC_K_REDUCE_SCATTER, buf, count, sizeof(float), 0, req);
}

int rtp_comm_allgather(struct rtp_comm *c, void *buf, size_t count, size_t elem_size,
                       struct rtp_comm_req **req) {
  int st;
  if ((st = check_comm(c, "rtp_comm_allgather")) < 0) return st;
  if (!buf && count) return rtp__error(RTP_EINVAL, "rtp_comm_allgather: NULL buffer");
  if (elem_size == 0) return rtp__error(RTP_EINVAL, "rtp_comm_allgather: elem_size 0");
  if (count && elem_size > SIZE_MAX / count)
    return rtp__error(RTP_EINVAL, "rtp_comm_allgather: size overflows");
  return post_ring(c, RC_K_ALLGATHER, buf, count, elem_size, 0, req);
}

int rtp_comm_broadcast(struct rtp_comm *c, void *buf, size_t nbytes, int root,
                       struct rtp_comm_req **req) {
  int st;
  if ((st = check_comm(c, "rtp_comm_broadcast")) < 0) return st;
  if ((st = check_rank(c, root, "rtp_comm_broadcast")) < 0) return st;
  if (!buf && nbytes) return rtp__error(RTP_EINVAL, "rtp_comm_broadcast: NULL buffer");
  return post_ring(c, RC_K_BROADCAST, buf, nbytes, 1, root, req);
}

int rtp_comm_barrier(struct rtp_comm *c, struct rtp_comm_req **req) {
  int st;
  if ((st = check_comm(c, "rtp_comm_barrier")) < 0) return st;
  return post_ring(c, RC_K_BARRIER, NULL, 0, 1, 0, req);
}

int rtp_comm_rank(const struct rtp_comm *c) {
  return c ? c->rank : -1;
}

int rtp_comm_size(const struct rtp_comm *c) {
  return c ? c->size : 0;
}

int rtp_comm_status(struct rtp_comm *c, const char **msg) {
  pthread_mutex_lock(&c->mu);
  int st = c->failed;
  pthread_mutex_unlock(&c->mu);
  if (msg) *msg = st ? c->fail_msg : ""; /* fail_msg is written once, before failed */
  return st;
}

/* ---- the comm thread: failure ------------------------------------------------------ */

static void link_close(struct rc_link *l);
static void req_check(struct rtp_comm_req *r);
static void maybe_finalize(struct rtp_comm *c);
static void link_set_lowat(struct rc_link *l);

static uint64_t now_ms(struct rtp_comm *c) {
  return uv_now(&c->loop);
}

static void shutdown_cb(uv_shutdown_t *req, int status) {
  (void)req;
  (void)status;
}

static void cslot_cb(uv_write_t *w, int status) {
  struct rc_cslot *s = (struct rc_cslot *)w;
  struct rc_link *l = s->link;
  (void)status;
  if (s->heartbeat) l->hb_pending = false;
  s->next = l->cfree;
  l->cfree = s;
  /* after the ABORT, half-close: the peer reads it, then our EOF, and closes */
  if (l->aborting && status == 0 && get32(s->buf) == RC_FRAME_MAGIC &&
      s->buf[5] == RC_T_ABORT && l->state != LS_CLOSING)
    uv_shutdown(&l->shut, (uv_stream_t *)&l->tcp, shutdown_cb);
}

/* Queues a control frame with an optional payload (<= RC_MSG + 96 bytes). */
static int send_ctrl(struct rc_link *l, const struct rc_hdr *h, const void *payload) {
  if (l->state == LS_CLOSING) return UV_ECANCELED;
  struct rc_cslot *s = l->cfree;
  if (!s) return UV_ENOBUFS;
  RTP_ASSERT(h->len <= sizeof(s->buf) - RC_HDR_SIZE);
  l->cfree = s->next;
  s->link = l;
  s->heartbeat = h->type == RC_T_HEARTBEAT;
  hdr_put(s->buf, h);
  if (h->len) memcpy(s->buf + RC_HDR_SIZE, payload, h->len);
  uv_buf_t b = uv_buf_init((char *)s->buf, (unsigned)(RC_HDR_SIZE + h->len));
  int rc = uv_write(&s->w, (uv_stream_t *)&l->tcp, &b, 1, cslot_cb);
  if (rc < 0) {
    s->next = l->cfree;
    l->cfree = s;
    return rc;
  }
  l->last_tx = now_ms(l->comm);
  return 0;
}

/* Sends raw bytes (handshake) through a control slot. */
static int send_raw(struct rc_link *l, const void *p, size_t n) {
  struct rc_cslot *s = l->cfree;
  if (!s || n > sizeof(s->buf)) return UV_ENOBUFS;
  l->cfree = s->next;
  s->link = l;
  s->heartbeat = false;
  memcpy(s->buf, p, n);
  uv_buf_t b = uv_buf_init((char *)s->buf, (unsigned)n);
  int rc = uv_write(&s->w, (uv_stream_t *)&l->tcp, &b, 1, cslot_cb);
  if (rc < 0) {
    s->next = l->cfree;
    l->cfree = s;
  }
  return rc;
}

static void publish_failure(struct rtp_comm *c) {
  pthread_mutex_lock(&c->mu);
  if (!c->failed) c->failed = c->loop_failed;
  pthread_cond_broadcast(&c->cv);
  pthread_mutex_unlock(&c->mu);
}

/*
 * Fails the communicator: logs why, tells every connected peer (ABORT, best effort,
 * without blocking), closes every connection and fails every pending request.
 */
static void comm_fail(struct rtp_comm *c, int status, const char *fmt, ...) RTP_PRINTF(3, 4);
static void comm_fail(struct rtp_comm *c, int status, const char *fmt, ...) {
  if (c->loop_failed) return;
  char msg[RC_MSG];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  pthread_mutex_lock(&c->mu);
  if (!c->failed) { /* else rtp__comm_fail came first: tell its reason */
    snprintf(c->fail_msg, sizeof(c->fail_msg), "%s", msg);
  } else {
    status = c->failed;
    snprintf(msg, sizeof(msg), "%s", c->fail_msg);
  }
  pthread_mutex_unlock(&c->mu);
  c->loop_failed = status;
  if (!c->shutting_down) RTP_LOG_ERROR("comm rank %d: %s", c->rank, msg);
  /* The ABORT goes behind the data already queued; each connection closes when its
     ABORT is written, or a little later if the peer does not read any more. */
  struct rc_hdr h = {.type = RC_T_ABORT, .len = strlen(msg)};
  uint64_t grace = (uint64_t)(c->params.timeout_ms < 1000 ? c->params.timeout_ms : 1000);
  for (struct rc_link *l = c->links_all, *nx; l; l = nx) {
    nx = l->next;
    if (l->state == LS_UP && !l->bye_rx && !l->aborting) {
      l->aborting = true; /* reads are discarded from now on */
      link_set_lowat(l);
      l->close_at = now_ms(c) + grace;
      if (send_ctrl(l, &h, msg) < 0) link_close(l);
    } else if (!l->aborting) {
      link_close(l);
    }
  }
  publish_failure(c);
  for (struct rtp_comm_req *r = c->active, *nx; r; r = nx) {
    nx = r->anext;
    if (!r->fail) {
      r->fail = status;
      snprintf(r->fail_msg, sizeof(r->fail_msg), "%s", c->fail_msg);
    }
    req_check(r);
  }
}

/* Fails one request only (a local mistake that leaves the protocol intact). */
static void req_fail(struct rtp_comm_req *r, int status, const char *fmt, ...) RTP_PRINTF(3, 4);
static void req_fail(struct rtp_comm_req *r, int status, const char *fmt, ...) {
  if (r->fail) return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(r->fail_msg, sizeof(r->fail_msg), fmt, ap);
  va_end(ap);
  r->fail = status;
  req_check(r);
}

/* ---- the comm thread: requests ------------------------------------------------------ */

static void leg_unlink(struct rc_leg *g) {
  struct rc_link *l = g->link;
  if (!l) return;
  struct rc_leg **head = g->tx ? &l->tx_legs : &l->rx_legs;
  if (g->prev)
    g->prev->next = g->next;
  else
    *head = g->next;
  if (g->next) g->next->prev = g->prev;
  g->next = g->prev = NULL;
  g->link = NULL;
  if (l->bye_rx && !l->tx_legs && !l->rx_legs) link_close(l); /* flushed: let it go */
}

static void leg_link(struct rc_leg *g, struct rc_link *l) {
  struct rc_leg **head = g->tx ? &l->tx_legs : &l->rx_legs;
  g->prev = NULL;
  g->next = *head;
  if (*head) (*head)->prev = g;
  *head = g;
  g->link = l;
}

/* Makes finished requests visible to their waiters. Deferred to an idle callback so
 * that no comm-thread code can touch a request after a waiter took it back. */
static void publish_done(struct rtp_comm *c) {
  if (!c->done_head) return;
  pthread_mutex_lock(&c->mu);
  for (struct rtp_comm_req *r = c->done_head, *nx; r; r = nx) {
    nx = r->anext;
    r->anext = NULL;
    req_finish_locked(c, r, r->fail, r->fail ? r->fail_msg : NULL);
  }
  c->done_head = NULL;
  pthread_mutex_unlock(&c->mu);
}

static void on_idle(uv_idle_t *h) {
  struct rtp_comm *c = h->data;
  publish_done(c);
  uv_idle_stop(h);
}

static void req_complete(struct rtp_comm_req *r) {
  struct rtp_comm *c = r->comm;
  r->finished = true;
  leg_unlink(&r->tx);
  leg_unlink(&r->rx);
  if (r->aprev)
    r->aprev->anext = r->anext;
  else if (c->active == r)
    c->active = r->anext;
  if (r->anext) r->anext->aprev = r->aprev;
  r->aprev = NULL;
  r->anext = c->done_head;
  c->done_head = r;
  uv_idle_start(&c->idle, on_idle);
}

static void req_check(struct rtp_comm_req *r) {
  if (r->finished) return;
  if (r->tx.inflight) return; /* the user's buffer is still being written from */
  /* A failed receive that offered direct writes and still expects frames waits until
   * they came or the peer's connection closed (the peer stops writing before it closes):
   * the user may free the buffer as soon as the request is done. */
  if (r->fail && r->rx.offered && r->rx.link && r->rx.next_k < r->rx.nframes) return;
  bool tx_done = r->tx.peer < 0 || (r->tx.ready && r->tx.done == r->tx.nframes);
  bool rx_done = r->rx.peer < 0 || r->rx.next_k == r->rx.nframes;
  if (r->fail || (tx_done && rx_done)) req_complete(r);
}

static void tx_pump(struct rtp_comm_req *r);

static void data_write_cb(uv_write_t *w, int status) {
  struct rc_wslot *s = (struct rc_wslot *)w;
  struct rc_leg *g = s->leg;
  struct rtp_comm_req *r = g->req;
  struct rtp_comm *c = r->comm;
  g->inflight--;
  if (status < 0) {
    if (status != UV_ECANCELED)
      comm_fail(c, RTP_EPEER, "lost rank %d (%s): %s", g->peer, g->link ? g->link->addr : "?",
                uv_strerror(status));
    else if (!r->fail) {
      r->fail = c->loop_failed ? c->loop_failed : RTP_ECOMM;
      snprintf(r->fail_msg, sizeof(r->fail_msg), "%s", c->fail_msg);
    }
    req_check(r);
    return;
  }
  g->done++;
  r->last_progress = now_ms(c);
  tx_pump(r);
  req_check(r);
}

/* Whether the receiver of frame k adds it into its buffer (a reduce-scatter step): such
 * frames need the receiver's scratch and always travel over TCP. */
static bool rx_reduces(const struct rtp_comm *c, const struct rtp_comm_req *r, uint64_t k) {
  if (r->kind == RC_K_REDUCE_SCATTER) return true;
  return r->kind == RC_K_ALLREDUCE && (int)(k / r->nseg) < c->size - 1;
}

/* Frame k's payload straight into the receiver's buffer, where its own receive would put
 * it (both sides lay out the buffer alike). 0, or a negative errno; then the link falls
 * back to TCP for good (e.g. EPERM where ptrace is restricted). */
static int direct_write(struct rc_leg *g, const uint8_t *src, uint64_t len) {
  const struct rtp_comm_req *r = g->req;
  const uint8_t *base = r->kind == RC_K_P2P ? r->sbuf : r->buf;
  uintptr_t dst = (uintptr_t)g->direct + (uintptr_t)(src - base);
  for (uint64_t done = 0; done < len;) {
    struct iovec lo = {(void *)(src + done), (size_t)(len - done)};
    struct iovec re = {(void *)(dst + done), (size_t)(len - done)};
    ssize_t n = process_vm_writev(g->link->peer_pid, &lo, 1, &re, 1, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return n < 0 ? -errno : -EIO;
    done += (uint64_t)n;
  }
  return 0;
}

static void tx_pump(struct rtp_comm_req *r) {
  struct rtp_comm *c = r->comm;
  struct rc_leg *g = &r->tx;
  if (g->peer < 0 || !g->ready || r->fail || c->loop_failed) return;
  struct rc_link *l = g->link;
  if (!l || l->state != LS_UP) return;
  while (g->next_k < g->nframes && g->inflight < RC_WINDOW) {
    uint64_t k = g->next_k;
    if (g->dep >= 0 && k >= (uint64_t)g->dep && r->rx.next_k <= k - (uint64_t)g->dep) break;
    uint8_t *ptr;
    uint64_t len;
    bool reduce;
    frame_geom(c, r, true, k, &ptr, &len, &reduce);
    struct rc_wslot *s = &g->slot[g->slot_i++ % RC_WINDOW];
    s->leg = g;
    bool direct = g->direct && l->direct && len && !rx_reduces(c, r, k);
    if (direct) {
      int err = direct_write(g, ptr, len);
      if (err) {
        RTP_LOG_INFO("comm rank %d: direct writes to rank %d failed (%s); using TCP", c->rank,
                     g->peer, strerror(-err));
        l->direct = false;
        direct = false;
      }
    }
    struct rc_hdr h = {.type = direct ? RC_T_DONE : RC_T_DATA,
                       .kind = (uint8_t)r->kind,
                       .cls = (uint8_t)r->cls,
                       .seq = r->seq,
                       .len = len,
                       .total = k};
    hdr_put(s->hdr, &h);
    uv_buf_t b[2] = {uv_buf_init((char *)s->hdr, RC_HDR_SIZE), uv_buf_init((char *)ptr, 0)};
    b[1].len = (size_t)len;
    int rc = uv_write(&s->w, (uv_stream_t *)&l->tcp, b, len && !direct ? 2 : 1, data_write_cb);
    if (rc < 0) {
      comm_fail(c, RTP_ECOMM, "writing to rank %d failed: %s", g->peer, uv_strerror(rc));
      return;
    }
    g->next_k++;
    g->inflight++;
    l->last_tx = now_ms(c);
  }
}

static uint64_t leg_total(const struct rtp_comm *c, const struct rtp_comm_req *r, bool tx,
                          uint64_t nframes) {
  if (r->kind == RC_K_P2P) return tx ? r->sbytes : r->rbytes;
  if (r->kind == RC_K_BROADCAST) return nframes ? r->count : 0;
  uint64_t total = 0;
  for (int s = 0; s < r->T; s++) {
    bool red;
    size_t bl;
    rtp_comm_block(r->count, c->size, ring_block(r, c->rank, c->size, tx, s, &red), NULL, &bl);
    total += bl * r->esize;
  }
  return total;
}

static const char *peer_addr(struct rtp_comm *c, int rank) {
  struct rc_link *l = rank >= 0 && rank < c->size ? c->links[rank] : NULL;
  return l ? l->addr : "?";
}

/* Checks the receiver's RTR against what this rank is about to send. */
static bool rtr_match(struct rtp_comm *c, struct rtp_comm_req *r, const struct rc_rtr *t) {
  int peer = r->tx.peer;
  const char *what = r->cls == RC_COLL ? "collective" : "message";
  if (t->kind != r->kind) {
    comm_fail(c, RTP_EPEER,
              "rank %d (%s) called %s as %s #%" PRIu64 " where this rank called %s", peer,
              peer_addr(c, peer), kind_name(t->kind), what, r->seq, kind_name(r->kind));
    return false;
  }
  uint64_t arg = r->kind == RC_K_BROADCAST ? (uint64_t)r->root : r->esize;
  if (t->total != r->tx.total || t->arg != arg) {
    comm_fail(c, RTP_EPEER,
              "%s #%" PRIu64 ": rank %d (%s) expects %" PRIu64 " bytes (arg %" PRIu64
              ") from this rank, which sends %" PRIu64 " (arg %" PRIu64
              "): the ranks disagree on sizes, counts or root",
              kind_name(r->kind), r->seq, peer, peer_addr(c, peer), t->total, t->arg,
              r->tx.total, arg);
    return false;
  }
  r->tx.ready = true;
  r->tx.direct = r->tx.link && r->tx.link->direct ? t->addr : 0;
  return true;
}

static void req_start(struct rtp_comm *c, struct rtp_comm_req *r) {
  r->anext = c->active;
  r->aprev = NULL;
  if (c->active) c->active->aprev = r;
  c->active = r;
  r->last_progress = now_ms(c);
  if (c->loop_failed) {
    r->fail = c->loop_failed;
    snprintf(r->fail_msg, sizeof(r->fail_msg), "%s", c->fail_msg);
    req_check(r);
    return;
  }
  if (r->kind == RC_K_P2P) {
    r->tx.nframes = r->tx.peer >= 0 ? (r->sbytes ? ceil_div(r->sbytes, RC_P2P_FRAME) : 1) : 0;
    r->rx.nframes = r->rx.peer >= 0 ? (r->rbytes ? ceil_div(r->rbytes, RC_P2P_FRAME) : 1) : 0;
    r->tx.dep = -1;
  } else if (r->kind == RC_K_BROADCAST) {
    r->nseg = r->count ? ceil_div(r->count, RC_SEGMENT) : 1;
    int right = (c->rank + 1) % c->size;
    r->tx.nframes = right != r->root ? r->nseg : 0;
    r->rx.nframes = c->rank != r->root ? r->nseg : 0;
    r->tx.dep = c->rank == r->root ? -1 : 0;
  } else {
    int n = c->size;
    r->T = r->kind == RC_K_ALLREDUCE ? 2 * (n - 1) : n - 1;
    uint64_t maxblock = ceil_div(r->count, (uint64_t)n) * r->esize;
    r->nseg = maxblock ? ceil_div(maxblock, RC_SEGMENT) : 1;
    r->tx.nframes = r->rx.nframes = (uint64_t)r->T * r->nseg;
    r->tx.dep = (int64_t)r->nseg;
  }
  if (r->kind == RC_K_BROADCAST || r->kind == RC_K_P2P) {
    r->tx.total = leg_total(c, r, true, r->tx.nframes);
    r->rx.total = leg_total(c, r, false, r->rx.nframes);
  } else {
    r->tx.total = leg_total(c, r, true, 0);
    r->rx.total = leg_total(c, r, false, 0);
  }
  /* receive side: register, then tell the sender */
  if (r->rx.peer >= 0) {
    struct rc_link *l = c->links[r->rx.peer];
    if (!l || l->state != LS_UP || l->bye_rx) {
      req_fail(r, RTP_ECOMM, "rank %d is not connected (it left or failed)", r->rx.peer);
      return;
    }
    leg_link(&r->rx, l);
    struct rc_hdr h = {.type = RC_T_RTR,
                       .kind = (uint8_t)r->kind,
                       .cls = (uint8_t)r->cls,
                       .seq = r->rx_seq,
                       .total = r->rx.total,
                       .arg = r->kind == RC_K_BROADCAST ? (uint64_t)r->root : r->esize,
                       .addr = l->direct ? (uint64_t)(uintptr_t)r->buf : 0};
    r->rx.offered = l->direct;
    int rc = send_ctrl(l, &h, NULL);
    if (rc < 0) {
      comm_fail(c, RTP_ECOMM, "sending to rank %d failed: %s", r->rx.peer, uv_strerror(rc));
      return;
    }
  }
  if (r->tx.peer >= 0) {
    struct rc_link *l = c->links[r->tx.peer];
    if (!l || l->state != LS_UP || l->bye_rx) {
      req_fail(r, RTP_ECOMM, "rank %d is not connected (it left or failed)", r->tx.peer);
      return;
    }
    leg_link(&r->tx, l);
    for (int i = 0; i < l->n_rtrs; i++) {
      struct rc_rtr *t = &l->rtrs[i];
      if (t->cls == r->cls && t->seq == r->seq) {
        struct rc_rtr copy = *t;
        l->rtrs[i] = l->rtrs[--l->n_rtrs];
        if (!rtr_match(c, r, &copy)) return;
        break;
      }
    }
  }
  tx_pump(r);
  req_check(r);
}

/* ---- the comm thread: connections --------------------------------------------------- */

static void link_free(struct rc_link *l) {
  struct rtp_comm *c = l->comm;
  if (l->prev)
    l->prev->next = l->next;
  else
    c->links_all = l->next;
  if (l->next) l->next->prev = l->prev;
  c->n_links_alive--;
  free(l->ctrl);
  free(l->scratch);
  free(l->rtrs);
  free(l->cslots);
  free(l);
  maybe_finalize(c);
}

static void link_handle_closed(uv_handle_t *h) {
  struct rc_link *l = h->data;
  if (h == (uv_handle_t *)&l->tcp) l->tcp_open = false;
  if (--l->nhandles == 0) link_free(l);
}

static void link_close(struct rc_link *l) {
  struct rtp_comm *c = l->comm;
  if (l->state == LS_CLOSING) return;
  l->aborting = false;
  l->state = LS_CLOSING;
  if (l->rank >= 0 && l->rank < c->size && c->links[l->rank] == l) {
    c->links[l->rank] = NULL;
    c->n_up--;
  }
  while (l->tx_legs) leg_unlink(l->tx_legs);
  while (l->rx_legs) {
    struct rtp_comm_req *r = l->rx_legs->req;
    leg_unlink(l->rx_legs);
    if (r->rx.offered) req_check(r); /* it may have been waiting for this close */
  }
  if (l->tcp_open && !uv_is_closing((uv_handle_t *)&l->tcp))
    uv_close((uv_handle_t *)&l->tcp, link_handle_closed);
  if (l->has_timer && !uv_is_closing((uv_handle_t *)&l->retry))
    uv_close((uv_handle_t *)&l->retry, link_handle_closed);
}

static struct rc_link *link_new(struct rtp_comm *c, bool connector, int rank) {
  struct rc_link *l = calloc(1, sizeof(*l));
  if (!l) return NULL;
  l->comm = c;
  l->connector = connector;
  l->rank = rank;
  l->state = LS_HANDSHAKE;
  int nslots = 2 * c->params.max_requests + 16;
  l->cslots = calloc((size_t)nslots, sizeof(*l->cslots));
  l->cap_rtrs = 2 * c->params.max_requests + 16;
  l->rtrs = calloc((size_t)l->cap_rtrs, sizeof(*l->rtrs));
  l->ctrl_cap = (size_t)c->size * RC_ADDR_REC + RC_MSG;
  l->ctrl = malloc(l->ctrl_cap);
  if (!l->cslots || !l->rtrs || !l->ctrl) {
    free(l->cslots);
    free(l->rtrs);
    free(l->ctrl);
    free(l->scratch);
    free(l);
    return NULL;
  }
  for (int i = 0; i < nslots; i++) {
    l->cslots[i].next = l->cfree;
    l->cfree = &l->cslots[i];
  }
  l->tcp.data = l;
  l->retry.data = l;
  l->next = c->links_all;
  if (c->links_all) c->links_all->prev = l;
  c->links_all = l;
  c->n_links_alive++;
  l->last_rx = l->last_tx = now_ms(c);
  l->deadline = now_ms(c) + RC_HANDSHAKE_MS;
  snprintf(l->addr, sizeof(l->addr), "?");
  return l;
}

/* The loop wakes for a read only once min(what the reader still expects, RC_RCVLOWAT)
 * bytes have arrived: over Ethernet a payload otherwise comes in one wakeup per packet
 * train, and those interrupt the compute threads on the same cores (docs/transport.md).
 * Never more than the frame still owes, so the wait always ends (EOF and errors wake the
 * loop regardless), nor more than a 1 Mbit/s link brings in an eighth of the timeout, so
 * a slow link is not taken for a silent one. Best effort: a socket that refuses keeps
 * waking per packet train. */
static void link_set_lowat(struct rc_link *l) {
  /* timeout_ms >= 1 (rtp_comm_init), so cap >= 16: 125000 / 8 bytes per ms */
  size_t cap = (size_t)l->comm->params.timeout_ms * 16;
  size_t rest = l->aborting || l->rwant <= l->rhave ? 1 : l->rwant - l->rhave;
  if (cap > RC_RCVLOWAT) cap = RC_RCVLOWAT;
  int v = (int)(rest < cap ? rest : cap);
  uv_os_fd_t fd;
  if (v == l->lowat || !l->tcp_open || uv_fileno((uv_handle_t *)&l->tcp, &fd) != 0) return;
  if (setsockopt(fd, SOL_SOCKET, SO_RCVLOWAT, &v, sizeof(v)) == 0) l->lowat = v;
}

static void reader_expect(struct rc_link *l, int state, void *ptr, size_t n) {
  l->rstate = state;
  l->rptr = ptr;
  l->rwant = n;
  l->rhave = 0;
  link_set_lowat(l);
}

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf) {
  struct rc_link *l = h->data;
  (void)suggested;
  if (l->aborting) {
    buf->base = (char *)l->scratch;
    buf->len = l->scratch_cap;
    return;
  }
  RTP_ASSERT(l->rwant > l->rhave);
  buf->base = (char *)l->rptr + l->rhave;
  size_t n = l->rwant - l->rhave;
  buf->len = n;
}

static void reader_step(struct rc_link *l);

static void link_lost(struct rc_link *l, ssize_t err) {
  struct rtp_comm *c = l->comm;
  const char *why = err == UV_EOF ? "connection closed" : uv_strerror((int)err);
  if (l->state == LS_UP && !l->bye_rx && !c->shutting_down) {
    comm_fail(c, RTP_EPEER, "lost rank %d (%s): %s", l->rank, l->addr, why);
  } else if (l->state == LS_HANDSHAKE && l->connector && !c->ready) {
    comm_fail(c, RTP_EAUTH,
              "rank %d (%s) closed the connection during the handshake: different "
              "RTP_TOKEN, job or world size? (see rank %d's log)",
              l->rank, l->addr, l->rank);
  } else if (l->state == LS_HANDSHAKE && !l->connector) {
    RTP_LOG_WARN("comm rank %d: connection from %s refused: %s during the handshake", c->rank,
                 l->addr, why);
  }
  link_close(l);
}

static void on_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf) {
  struct rc_link *l = s->data;
  (void)buf;
  if (l->state == LS_CLOSING) return;
  if (l->aborting) {
    if (nread < 0) link_close(l);
    return;
  }
  if (nread < 0) {
    link_lost(l, nread);
    return;
  }
  if (nread == 0) return;
  l->last_rx = now_ms(l->comm);
  l->rhave += (size_t)nread;
  if (l->rhave == l->rwant)
    reader_step(l);
  else
    link_set_lowat(l);
}

static void refuse(struct rc_link *l, const char *why) {
  RTP_LOG_WARN("comm rank %d: connection from %s refused: %s", l->comm->rank, l->addr, why);
  link_close(l);
}

static void protocol_error(struct rc_link *l, const char *fmt, ...) RTP_PRINTF(2, 3);
static void protocol_error(struct rc_link *l, const char *fmt, ...) {
  char msg[RC_MSG];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  comm_fail(l->comm, RTP_EFORMAT, "protocol error from rank %d (%s): %s", l->rank, l->addr,
            msg);
  link_close(l);
}

/* HELLO: magic, version u16, reserved u16, job id u64, world size u32, rank u32,
 * nonce[32], zero padding to 64 bytes. */
static void hello_fill(struct rtp_comm *c, uint8_t *p) {
  memset(p, 0, RC_HELLO_SIZE);
  put32(p, RC_HELLO_MAGIC);
  p[4] = RC_VERSION;
  p[5] = c->host_key ? RC_HELLO_DIRECT : 0;
  put64(p + 8, c->job_id);
  put32(p + 16, (uint32_t)c->size);
  put32(p + 20, (uint32_t)c->rank);
  RTP_ASSERT(RAND_bytes(p + 24, RC_NONCE_SIZE) == 1);
  put64(p + 56, c->host_key);
  put32(p + 64, (uint32_t)getpid());
}

/* Direct writes need both sides to offer them from the same host and namespaces. The
 * hello is covered by the handshake's MAC, so no one but the peer can claim this. */
static void hello_note_peer(struct rc_link *l, const uint8_t *p) {
  uint64_t key = get64(p + 56);
  l->direct = l->comm->host_key && (p[5] & RC_HELLO_DIRECT) && key == l->comm->host_key;
  l->peer_pid = (int)get32(p + 64);
}

/* NULL if p is an acceptable hello of this job, else why not. */
static const char *hello_check(struct rtp_comm *c, const uint8_t *p, int *rank) {
  if (get32(p) != RC_HELLO_MAGIC) return "not an rtp handshake (bad magic)";
  if (p[4] != RC_VERSION || (p[5] & ~RC_HELLO_DIRECT) || p[6] || p[7])
    return "protocol version mismatch";
  if (get64(p + 8) != c->job_id) return "different job (wrong RTP_TOKEN?)";
  if (get32(p + 16) != (uint32_t)c->size) return "different world size";
  uint32_t r = get32(p + 20);
  if (r >= (uint32_t)c->size || (int)r == c->rank) return "bad rank";
  *rank = (int)r;
  return NULL;
}

static void link_up(struct rc_link *l);

static void hs_acceptor_hello1(struct rc_link *l) {
  struct rtp_comm *c = l->comm;
  int rank = -1;
  const char *why = hello_check(c, l->hs, &rank);
  if (why) return refuse(l, why);
  /* rank 0 hears from everyone; rank r > 0 only from higher ranks */
  if (c->rank != 0 && rank < c->rank) return refuse(l, "unexpected rank");
  if (c->links[rank]) return refuse(l, "duplicate rank");
  l->rank = rank;
  hello_fill(c, l->hs + RC_HELLO_SIZE);
  hmac32(c->params.token, "rtp-hs-acceptor", l->hs, 2 * RC_HELLO_SIZE,
         l->hs + 2 * RC_HELLO_SIZE);
  if (send_raw(l, l->hs + RC_HELLO_SIZE, RC_HELLO_SIZE + RC_MAC_SIZE) < 0)
    return refuse(l, "write failed");
  reader_expect(l, R_HELLO3, l->hs + 2 * RC_HELLO_SIZE + RC_MAC_SIZE, RC_MAC_SIZE);
}

static void hs_acceptor_hello3(struct rc_link *l) {
  struct rtp_comm *c = l->comm;
  uint8_t mac[RC_MAC_SIZE];
  hmac32(c->params.token, "rtp-hs-connector", l->hs, 2 * RC_HELLO_SIZE + RC_MAC_SIZE, mac);
  if (CRYPTO_memcmp(mac, l->hs + 2 * RC_HELLO_SIZE + RC_MAC_SIZE, RC_MAC_SIZE) != 0)
    return refuse(l, "authentication failed (wrong RTP_TOKEN)");
  if (c->links[l->rank]) return refuse(l, "duplicate rank");
  hello_note_peer(l, l->hs);
  link_up(l);
}

static void hs_connector_hello2(struct rc_link *l) {
  struct rtp_comm *c = l->comm;
  int rank = -1;
  const char *why = hello_check(c, l->hs + RC_HELLO_SIZE, &rank);
  if (!why && rank != l->rank) why = "answered with another rank";
  uint8_t mac[RC_MAC_SIZE];
  hmac32(c->params.token, "rtp-hs-acceptor", l->hs, 2 * RC_HELLO_SIZE, mac);
  if (!why && CRYPTO_memcmp(mac, l->hs + 2 * RC_HELLO_SIZE, RC_MAC_SIZE) != 0)
    why = "authentication failed (wrong RTP_TOKEN)";
  if (why) {
    comm_fail(c, RTP_EAUTH, "handshake with rank %d (%s) failed: %s", l->rank, l->addr, why);
    return;
  }
  hmac32(c->params.token, "rtp-hs-connector", l->hs, 2 * RC_HELLO_SIZE + RC_MAC_SIZE, mac);
  if (send_raw(l, mac, RC_MAC_SIZE) < 0) {
    comm_fail(c, RTP_ECOMM, "handshake with rank %d (%s): write failed", l->rank, l->addr);
    return;
  }
  hello_note_peer(l, l->hs + RC_HELLO_SIZE);
  link_up(l);
}

static void set_ready(struct rtp_comm *c) {
  pthread_mutex_lock(&c->mu);
  c->ready = true;
  pthread_cond_broadcast(&c->cv);
  pthread_mutex_unlock(&c->mu);
}

static void check_ready(struct rtp_comm *c) {
  if (!c->ready && c->n_up == c->size - 1 && (c->rank != 0 || c->n_registered == c->size - 1))
    set_ready(c);
}

static void connect_to(struct rtp_comm *c, int rank, const struct sockaddr_storage *sa);

static void link_up(struct rc_link *l) {
  struct rtp_comm *c = l->comm;
  l->scratch_cap = RC_SEGMENT + 64;
  l->scratch = malloc(l->scratch_cap);
  if (!l->scratch) return comm_fail(c, RTP_ENOMEM, "out of memory");
  l->state = LS_UP;
  c->links[l->rank] = l;
  c->n_up++;
  reader_expect(l, R_HDR, l->hdrbuf, RC_HDR_SIZE);
  if (c->rank > 0 && l->rank == 0) {
    /* register where this rank listens: the bind address, or the local address of
       this connection (the interface that routes to rank 0) */
    uint8_t rec[RC_ADDR_REC] = {0};
    put32(rec, (uint32_t)c->my_port);
    if (c->have_bind) {
      sa_ip(&c->bind_sa, (char *)rec + 4, RC_ADDR_REC - 4);
    } else {
      struct sockaddr_storage ss;
      int n = sizeof(ss);
      uv_tcp_getsockname(&l->tcp, (struct sockaddr *)&ss, &n);
      sa_ip(&ss, (char *)rec + 4, RC_ADDR_REC - 4);
    }
    struct rc_hdr h = {.type = RC_T_REGISTER, .len = RC_ADDR_REC};
    if (send_ctrl(l, &h, rec) < 0) comm_fail(c, RTP_ECOMM, "registering with rank 0 failed");
  }
  check_ready(c);
}

static void on_rtr(struct rc_link *l, const struct rc_hdr *h) {
  struct rtp_comm *c = l->comm;
  struct rc_rtr t = {.kind = h->kind,
                     .cls = h->cls,
                     .seq = h->seq,
                     .total = h->total,
                     .arg = h->arg,
                     .addr = h->addr};
  for (struct rc_leg *g = l->tx_legs; g; g = g->next) {
    struct rtp_comm_req *r = g->req;
    if (r->cls == h->cls && r->seq == h->seq) {
      if (g->ready) return protocol_error(l, "duplicate ready-to-receive");
      if (rtr_match(c, r, &t)) {
        tx_pump(r);
        req_check(r);
      }
      return;
    }
  }
  for (int i = 0; i < l->n_rtrs; i++)
    if (l->rtrs[i].cls == t.cls && l->rtrs[i].seq == t.seq)
      return protocol_error(l, "duplicate ready-to-receive");
  if (l->n_rtrs == l->cap_rtrs) return protocol_error(l, "too many ready-to-receive frames");
  l->rtrs[l->n_rtrs++] = t;
}

static void on_payload(struct rc_link *l);

/* DATA and DONE: the frame this leg expects next. DONE says the sender already wrote the
 * payload into this rank's buffer, which only a same-host peer offered direct writes
 * may do, and never for a frame this rank reduces. */
static void on_data_hdr(struct rc_link *l, const struct rc_hdr *h) {
  struct rtp_comm *c = l->comm;
  struct rc_leg *g = l->rx_legs;
  for (; g; g = g->next)
    if (g->req->cls == h->cls && g->req->rx_seq == h->seq) break;
  if (!g)
    return protocol_error(l, "data for %s #%" PRIu64 " that was not requested",
                          kind_name(h->kind), h->seq);
  struct rtp_comm_req *r = g->req;
  if (h->kind != r->kind)
    return protocol_error(l, "data of %s #%" PRIu64 " for %s", kind_name(h->kind), h->seq,
                          kind_name(r->kind));
  uint64_t k = g->next_k;
  if (k >= g->nframes || h->total != k)
    return protocol_error(l,
                          "frame %" PRIu64 " of %s #%" PRIu64 " out of sequence (%" PRIu64
                          " of %" PRIu64 " expected)",
                          h->total, kind_name(r->kind), h->seq, k, g->nframes);
  uint8_t *ptr;
  uint64_t len;
  bool reduce;
  frame_geom(c, r, false, k, &ptr, &len, &reduce);
  if (h->len != len)
    return protocol_error(l, "frame of %" PRIu64 " bytes where %" PRIu64 " were expected",
                          h->len, len);
  l->rx_leg = g;
  l->rx_dst = ptr;
  l->rx_len = len;
  l->rx_reduce = reduce;
  if (h->type == RC_T_DONE) {
    if (!l->direct || reduce || len == 0)
      return protocol_error(l, "a direct write that was not offered");
    l->rx_reduce = false;
    return on_payload(l);
  }
  if (len == 0) {
    l->rstate = R_PAYLOAD;
    reader_step(l);
    return;
  }
  if (reduce && len > l->scratch_cap) return protocol_error(l, "segment too large");
  reader_expect(l, R_PAYLOAD, reduce ? (void *)l->scratch : ptr, (size_t)len);
}

static void on_payload(struct rc_link *l) {
  struct rtp_comm *c = l->comm;
  struct rc_leg *g = l->rx_leg;
  struct rtp_comm_req *r = g->req;
  if (l->rx_reduce) {
    float *dst = (float *)l->rx_dst;
    const float *src = l->scratch;
    size_t n = (size_t)(l->rx_len / sizeof(float));
    for (size_t i = 0; i < n; i++) dst[i] += src[i];
  }
  l->rx_leg = NULL;
  reader_expect(l, R_HDR, l->hdrbuf, RC_HDR_SIZE);
  g->next_k++;
  r->last_progress = now_ms(c);
  tx_pump(r);
  req_check(r);
}

static void on_peers(struct rtp_comm *c, const uint8_t *p) {
  for (int q = 1; q < c->rank; q++) {
    const uint8_t *rec = p + (size_t)q * RC_ADDR_REC;
    char ip[RC_ADDR_REC];
    memcpy(ip, rec + 4, RC_ADDR_REC - 4);
    ip[RC_ADDR_REC - 5] = 0;
    struct sockaddr_storage sa;
    if (parse_ip(ip, (int)get32(rec), &sa) < 0) {
      comm_fail(c, RTP_EFORMAT, "rank 0 sent a bad address for rank %d", q);
      return;
    }
    connect_to(c, q, &sa);
  }
}

static void free_write_cb(uv_write_t *w, int status) {
  (void)status;
  free(w->data);
}

static void on_ctrl(struct rc_link *l) {
  struct rtp_comm *c = l->comm;
  struct rc_hdr h = l->hdr;
  reader_expect(l, R_HDR, l->hdrbuf, RC_HDR_SIZE);
  if (h.type == RC_T_ABORT) {
    char msg[RC_MSG];
    size_t n = h.len < RC_MSG - 1 ? h.len : RC_MSG - 1;
    memcpy(msg, l->ctrl, n);
    msg[n] = 0;
    for (size_t i = 0; i < n; i++)
      if (msg[i] < 32 || msg[i] > 126) msg[i] = '?';
    comm_fail(c, RTP_EPEER, "rank %d (%s) reported: %s", l->rank, l->addr, msg);
  } else if (h.type == RC_T_REGISTER) {
    struct rc_peer *p = &c->peers[l->rank];
    memcpy(p->addr, l->ctrl + 4, RC_ADDR_REC - 4);
    p->addr[RC_ADDR_REC - 5] = 0;
    p->port = (int)get32(l->ctrl);
    struct sockaddr_storage sa;
    if (p->registered || parse_ip(p->addr, p->port, &sa) < 0)
      return protocol_error(l, "bad registration");
    p->registered = true;
    if (++c->n_registered == c->size - 1) {
      size_t n = (size_t)c->size * RC_ADDR_REC;
      uint8_t *buf = calloc(1, n);
      if (!buf) return comm_fail(c, RTP_ENOMEM, "out of memory");
      for (int q = 1; q < c->size; q++) {
        put32(buf + (size_t)q * RC_ADDR_REC, (uint32_t)c->peers[q].port);
        memcpy(buf + (size_t)q * RC_ADDR_REC + 4, c->peers[q].addr, RC_ADDR_REC - 4);
      }
      /* the table goes out as a few RC_MSG-sized frames would complicate things; it is
         written from a heap copy per peer instead */
      for (int q = 1; q < c->size; q++) {
        struct rc_link *pl = c->links[q];
        if (!pl) continue;
        struct rc_hdr ph = {.type = RC_T_PEERS, .len = n};
        uint8_t *frame = malloc(RC_HDR_SIZE + n + sizeof(uv_write_t));
        if (!frame) {
          free(buf);
          return comm_fail(c, RTP_ENOMEM, "out of memory");
        }
        uv_write_t *w = (uv_write_t *)frame;
        uint8_t *fb = frame + sizeof(uv_write_t);
        hdr_put(fb, &ph);
        memcpy(fb + RC_HDR_SIZE, buf, n);
        uv_buf_t b = uv_buf_init((char *)fb, (unsigned)(RC_HDR_SIZE + n));
        w->data = frame;
        if (uv_write(w, (uv_stream_t *)&pl->tcp, &b, 1, free_write_cb) < 0) free(frame);
      }
      free(buf);
      check_ready(c);
    }
  } else if (h.type == RC_T_PEERS) {
    on_peers(c, l->ctrl);
  }
}

static void on_hdr(struct rc_link *l) {
  struct rtp_comm *c = l->comm;
  struct rc_hdr *h = &l->hdr;
  hdr_get(l->hdrbuf, h);
  if (h->magic != RC_FRAME_MAGIC) return protocol_error(l, "bad frame magic");
  if (h->version != RC_VERSION) return protocol_error(l, "protocol version %d", h->version);
  switch (h->type) {
    case RC_T_DATA:
    case RC_T_DONE:
      if (h->cls > RC_COLL) return protocol_error(l, "bad class");
      return on_data_hdr(l, h);
    case RC_T_RTR:
      if (h->len || h->cls > RC_COLL || h->kind == RC_K_NONE || h->kind >= RC_K_COUNT)
        return protocol_error(l, "bad ready-to-receive frame");
      reader_expect(l, R_HDR, l->hdrbuf, RC_HDR_SIZE);
      return on_rtr(l, h);
    case RC_T_HEARTBEAT:
      if (h->len) return protocol_error(l, "bad heartbeat");
      reader_expect(l, R_HDR, l->hdrbuf, RC_HDR_SIZE);
      return;
    case RC_T_BYE: {
      /* The peer is gone for good once our writes to it are flushed: requests that
         still need anything else from it cannot complete. */
      l->bye_rx = true;
      reader_expect(l, R_HDR, l->hdrbuf, RC_HDR_SIZE);
      bool stuck = false;
      for (struct rc_leg *g = l->rx_legs; g; g = g->next) stuck |= g->next_k < g->nframes;
      for (struct rc_leg *g = l->tx_legs; g; g = g->next)
        stuck |= !g->ready || g->next_k < g->nframes;
      if (stuck && !c->shutting_down)
        return comm_fail(c, RTP_ECOMM,
                         "rank %d (%s) left (rtp_comm_free) with operations "
                         "pending",
                         l->rank, l->addr);
      if (!l->tx_legs && !l->rx_legs) link_close(l);
      return;
    }
    case RC_T_ABORT:
      if (h->len > RC_MSG) return protocol_error(l, "abort message too long");
      break;
    case RC_T_REGISTER:
      if (c->rank != 0 || h->len != RC_ADDR_REC) return protocol_error(l, "bad registration");
      break;
    case RC_T_PEERS:
      if (c->rank == 0 || l->rank != 0 || h->len != (uint64_t)c->size * RC_ADDR_REC)
        return protocol_error(l, "bad peer table");
      break;
    default:
      return protocol_error(l, "unknown frame type %d", h->type);
  }
  if (h->len == 0) return on_ctrl(l);
  RTP_ASSERT(h->len <= l->ctrl_cap);
  reader_expect(l, R_CTRL, l->ctrl, (size_t)h->len);
}

static void reader_step(struct rc_link *l) {
  switch (l->rstate) {
    case R_HELLO1:
      return hs_acceptor_hello1(l);
    case R_HELLO2:
      return hs_connector_hello2(l);
    case R_HELLO3:
      return hs_acceptor_hello3(l);
    case R_HDR:
      return on_hdr(l);
    case R_PAYLOAD:
      return on_payload(l);
    case R_CTRL:
      return on_ctrl(l);
  }
}

static void tune_socket(uv_tcp_t *t) {
  uv_tcp_nodelay(t, 1);
  /* Linux's buffer autotuning does at least as well as fixed sizes on loopback and
     Ethernet; RTP_SOCKET_BUFFER=bytes fixes them (e.g. for a long fat network). */
  const char *e = getenv("RTP_SOCKET_BUFFER");
  int sz = e ? atoi(e) : 0;
  if (sz > 0) {
    uv_send_buffer_size((uv_handle_t *)t, &sz);
    sz = atoi(e);
    uv_recv_buffer_size((uv_handle_t *)t, &sz);
  }
}

static void on_connection(uv_stream_t *server, int status) {
  struct rtp_comm *c = server->data;
  if (status < 0 || c->shutting_down) return;
  struct rc_link *l = link_new(c, false, -1);
  if (!l) return;
  uv_tcp_init(&c->loop, &l->tcp);
  l->tcp_open = true;
  l->nhandles = 1;
  if (uv_accept(server, (uv_stream_t *)&l->tcp) < 0) {
    link_close(l);
    return;
  }
  struct sockaddr_storage ss;
  int n = sizeof(ss);
  if (uv_tcp_getpeername(&l->tcp, (struct sockaddr *)&ss, &n) == 0)
    sa_to_str((struct sockaddr *)&ss, l->addr, sizeof(l->addr));
  if (c->loop_failed) {
    link_close(l);
    return;
  }
  tune_socket(&l->tcp);
  reader_expect(l, R_HELLO1, l->hs, RC_HELLO_SIZE);
  uv_read_start((uv_stream_t *)&l->tcp, on_alloc, on_read);
}

static void connect_attempt(struct rc_link *l);

static void retry_cb(uv_timer_t *t) {
  connect_attempt(t->data);
}

static void retry_closed(uv_handle_t *h) {
  struct rc_link *l = h->data;
  l->tcp_open = false;
  if (--l->nhandles == 0) return link_free(l);
  if (l->state == LS_CLOSING) return;
  uv_timer_start(&l->retry, retry_cb, 100, 0);
}

static void on_connect(uv_connect_t *req, int status) {
  struct rc_link *l = req->data;
  struct rtp_comm *c = l->comm;
  if (l->state == LS_CLOSING) return;
  if (status < 0) {
    if (now_ms(c) > l->deadline || c->loop_failed) {
      comm_fail(c, RTP_ECOMM, "cannot connect to rank %d at %s: %s", l->rank, l->addr,
                uv_strerror(status));
      return;
    }
    uv_close((uv_handle_t *)&l->tcp, retry_closed);
    return;
  }
  tune_socket(&l->tcp);
  l->state = LS_HANDSHAKE;
  hello_fill(c, l->hs);
  if (send_raw(l, l->hs, RC_HELLO_SIZE) < 0) {
    comm_fail(c, RTP_ECOMM, "handshake with rank %d (%s): write failed", l->rank, l->addr);
    return;
  }
  l->deadline = now_ms(c) + RC_HANDSHAKE_MS;
  reader_expect(l, R_HELLO2, l->hs + RC_HELLO_SIZE, RC_HELLO_SIZE + RC_MAC_SIZE);
  uv_read_start((uv_stream_t *)&l->tcp, on_alloc, on_read);
}

static void connect_attempt(struct rc_link *l) {
  struct rtp_comm *c = l->comm;
  if (l->state == LS_CLOSING) return;
  uv_tcp_init(&c->loop, &l->tcp);
  l->tcp_open = true;
  l->nhandles++;
  l->creq.data = l;
  int rc = uv_tcp_connect(&l->creq, &l->tcp, (const struct sockaddr *)&l->target, on_connect);
  if (rc < 0) {
    comm_fail(c, RTP_ECOMM, "cannot connect to rank %d at %s: %s", l->rank, l->addr,
              uv_strerror(rc));
  }
}

static void connect_to(struct rtp_comm *c, int rank, const struct sockaddr_storage *sa) {
  struct rc_link *l = link_new(c, true, rank);
  if (!l) return comm_fail(c, RTP_ENOMEM, "out of memory");
  l->state = LS_CONNECTING;
  l->target = *sa;
  sa_to_str((const struct sockaddr *)sa, l->addr, sizeof(l->addr));
  uv_timer_init(&c->loop, &l->retry);
  l->has_timer = true;
  l->nhandles = 1;
  l->deadline = c->init_deadline;
  connect_attempt(l);
}

/* ---- the comm thread: loop, timer, shutdown ---------------------------------------- */

static void finalize_closed(uv_handle_t *h) {
  (void)h;
}

static void maybe_finalize(struct rtp_comm *c) {
  if (!c->shutting_down || c->finalized || c->n_links_alive > 0) return;
  c->finalized = true;
  publish_done(c);
  uv_close((uv_handle_t *)&c->idle, finalize_closed);
  if (c->listener_open) uv_close((uv_handle_t *)&c->listener, finalize_closed);
  uv_close((uv_handle_t *)&c->timer, finalize_closed);
  uv_close((uv_handle_t *)&c->async, finalize_closed);
}

static void shutdown_begin(struct rtp_comm *c) {
  if (c->shutting_down) return;
  c->shutting_down = true;
  c->shutdown_deadline =
      now_ms(c) + (uint64_t)(c->params.timeout_ms < 5000 ? c->params.timeout_ms : 5000);
  for (struct rtp_comm_req *r = c->active, *nx; r; r = nx) {
    nx = r->anext;
    if (!r->fail) {
      r->fail = RTP_ESTATE;
      snprintf(r->fail_msg, sizeof(r->fail_msg), "communicator freed with the request pending");
    }
    req_check(r);
  }
  if (c->listener_open) {
    uv_close((uv_handle_t *)&c->listener, NULL);
    c->listener_open = false;
  }
  for (struct rc_link *l = c->links_all, *nx; l; l = nx) {
    nx = l->next;
    if (l->state == LS_UP && !l->bye_rx && !c->loop_failed) {
      struct rc_hdr h = {.type = RC_T_BYE};
      l->bye_tx = true;
      if (send_ctrl(l, &h, NULL) < 0) link_close(l);
    } else if (!l->aborting) {
      link_close(l);
    }
  }
  maybe_finalize(c);
}

static void on_async(uv_async_t *a) {
  struct rtp_comm *c = a->data;
  pthread_mutex_lock(&c->mu);
  struct rtp_comm_req *q = c->q_head;
  c->q_head = c->q_tail = NULL;
  bool stop = c->stopping;
  int told = c->fail_told ? c->failed : 0;
  c->fail_told = false;
  for (struct rtp_comm_req *r = q; r; r = r->qnext) r->state = RQ_ACTIVE;
  pthread_mutex_unlock(&c->mu);
  while (q) {
    struct rtp_comm_req *nx = q->qnext;
    req_start(c, q);
    q = nx;
  }
  if (told) comm_fail(c, told, "failed from outside the loop"); /* the message is c's */
  if (stop) shutdown_begin(c);
}

static void on_tick(uv_timer_t *t) {
  struct rtp_comm *c = t->data;
  uint64_t now = now_ms(c);
  uint64_t timeout = (uint64_t)c->params.timeout_ms;
  for (struct rc_link *l = c->links_all, *nx; l; l = nx) {
    nx = l->next;
    if (l->aborting && now > l->close_at) link_close(l);
  }
  if (c->shutting_down) {
    if (now > c->shutdown_deadline)
      for (struct rc_link *l = c->links_all, *nx; l; l = nx) {
        nx = l->next;
        link_close(l);
      }
    return;
  }
  if (c->loop_failed) return;
  if (!c->ready && now > c->init_deadline && !c->loop_failed) {
    char missing[128] = "";
    size_t off = 0;
    for (int q = 0; q < c->size && off < sizeof(missing) - 12; q++)
      if (q != c->rank && !c->links[q])
        off += (size_t)snprintf(missing + off, sizeof(missing) - off, " %d", q);
    comm_fail(c, RTP_ETIMEDOUT,
              "rendezvous timed out after %d ms (master %s); not connected to rank(s)%s%s",
              c->params.timeout_ms, c->master_str, missing,
              c->rank == 0 ? "" : " (or rank 0 still waits for others)");
    return;
  }
  for (struct rc_link *l = c->links_all, *nx; l; l = nx) {
    nx = l->next;
    if (l->state == LS_HANDSHAKE && !l->connector && now > l->deadline) {
      refuse(l, "handshake timed out");
    } else if (l->state == LS_HANDSHAKE && l->connector && now > l->deadline) {
      comm_fail(c, RTP_ETIMEDOUT, "handshake with rank %d (%s) timed out", l->rank, l->addr);
      return;
    } else if (l->state == LS_UP) {
      if (now - l->last_rx > timeout) {
        comm_fail(c, RTP_ETIMEDOUT, "rank %d (%s) silent for %" PRIu64 " ms (timeout %d ms)",
                  l->rank, l->addr, now - l->last_rx, c->params.timeout_ms);
        return;
      }
      if (now - l->last_tx >= timeout / 4 && !l->hb_pending) {
        struct rc_hdr h = {.type = RC_T_HEARTBEAT};
        if (send_ctrl(l, &h, NULL) == 0) l->hb_pending = true;
      }
    }
  }
  for (struct rtp_comm_req *r = c->active; r; r = r->anext) {
    if (!r->fail && now - r->last_progress > timeout) {
      int peer = r->rx.peer >= 0 && r->rx.next_k < r->rx.nframes ? r->rx.peer : r->tx.peer;
      comm_fail(c, RTP_ETIMEDOUT,
                "%s #%" PRIu64
                " made no progress for %d ms: waiting for rank %d (%s) "
                "(did it post the same operations?)",
                kind_name(r->kind), r->seq, c->params.timeout_ms, peer, peer_addr(c, peer));
      return;
    }
  }
}

static int resolve(struct rtp_comm *c, const char *host, int port,
                   struct sockaddr_storage *out) {
  if (parse_ip(host, port, out) == 0) return 0;
  uv_getaddrinfo_t gai;
  struct addrinfo hints;
  memset(&hints, 0, sizeof(hints));
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  char ports[16];
  snprintf(ports, sizeof(ports), "%d", port);
  int rc = uv_getaddrinfo(&c->loop, &gai, NULL, host, ports, &hints);
  if (rc < 0) return rc;
  memset(out, 0, sizeof(*out));
  memcpy(out, gai.addrinfo->ai_addr, gai.addrinfo->ai_addrlen);
  uv_freeaddrinfo(gai.addrinfo);
  return 0;
}

/* The address to bind: params.bind as an address, or the IPv4 (else IPv6) address of
 * the interface it names. */
static int resolve_bind(struct rtp_comm *c) {
  const char *b = c->params.bind;
  if (!b[0]) return 0;
  if (parse_ip(b, 0, &c->bind_sa) == 0) {
    c->have_bind = true;
    return 0;
  }
  uv_interface_address_t *ifs;
  int n;
  if (uv_interface_addresses(&ifs, &n) < 0) return -1;
  int found = 0;
  for (int pass = 0; pass < 2 && !found; pass++)
    for (int i = 0; i < n && !found; i++) {
      if (strcmp(ifs[i].name, b) != 0) continue;
      int fam = ifs[i].address.address4.sin_family;
      if ((pass == 0 && fam == AF_INET) || (pass == 1 && fam == AF_INET6)) {
        memset(&c->bind_sa, 0, sizeof(c->bind_sa));
        memcpy(&c->bind_sa, &ifs[i].address,
               fam == AF_INET ? sizeof(struct sockaddr_in) : sizeof(struct sockaddr_in6));
        found = 1;
      }
    }
  uv_free_interface_addresses(ifs, n);
  if (!found) return -1;
  c->have_bind = true;
  return 0;
}

static void loop_start(struct rtp_comm *c) {
  struct rtp_comm_params *p = &c->params;
  c->init_deadline = now_ms(c) + (uint64_t)p->timeout_ms;
  uint64_t tick = (uint64_t)p->timeout_ms / 8;
  tick = tick < 10 ? 10 : tick > 500 ? 500 : tick;
  uv_timer_start(&c->timer, on_tick, tick, tick);
  int rc = resolve(c, p->master_addr, p->master_port, &c->master);
  if (rc < 0)
    return comm_fail(c, RTP_ECOMM, "cannot resolve master address '%s': %s", p->master_addr,
                     uv_strerror(rc));
  sa_to_str((struct sockaddr *)&c->master, c->master_str, sizeof(c->master_str));
  if (resolve_bind(c) < 0)
    return comm_fail(c, RTP_EINVAL, "bind '%s' is neither an address nor an interface with one",
                     p->bind);
  /* listen: rank 0 on the master port, others on any port */
  struct sockaddr_storage la;
  if (c->have_bind) {
    la = c->bind_sa;
  } else {
    memset(&la, 0, sizeof(la));
    parse_ip(c->master.ss_family == AF_INET6 ? "::" : "0.0.0.0", 0, &la);
  }
  sa_set_port(&la, c->rank == 0 ? p->master_port : 0);
  uv_tcp_init(&c->loop, &c->listener);
  c->listener.data = c;
  c->listener_open = true;
  rc = uv_tcp_bind(&c->listener, (struct sockaddr *)&la, 0);
  if (rc == 0) rc = uv_listen((uv_stream_t *)&c->listener, 128, on_connection);
  if (rc < 0) {
    char s[96];
    sa_to_str((struct sockaddr *)&la, s, sizeof(s));
    return comm_fail(c, RTP_ECOMM, "cannot listen on %s: %s", s, uv_strerror(rc));
  }
  struct sockaddr_storage ss;
  int n = sizeof(ss);
  uv_tcp_getsockname(&c->listener, (struct sockaddr *)&ss, &n);
  c->my_port = sa_port(&ss);
  if (c->rank > 0) connect_to(c, 0, &c->master);
}

static void *comm_thread(void *arg) {
  struct rtp_comm *c = arg;
  loop_start(c);
  uv_run(&c->loop, UV_RUN_DEFAULT);
  return NULL;
}

/* ---- init and free ------------------------------------------------------------------- */

struct rtp_comm_params rtp_comm_params_default(void) {
  struct rtp_comm_params p;
  memset(&p, 0, sizeof(p));
  p.rank = 0;
  p.world_size = 1;
  snprintf(p.master_addr, sizeof(p.master_addr), "127.0.0.1");
  p.master_port = 29500;
  p.timeout_ms = 60000;
  p.max_requests = 128;
  p.device = -1;
  return p;
}

static int env_int(const char *name, int lo, int hi, int *out, bool *found) {
  const char *s = getenv(name);
  if (!s || !*s) return RTP_OK;
  char *end;
  errno = 0;
  long v = strtol(s, &end, 10);
  if (errno || *end || v < lo || v > hi)
    return rtp__error(RTP_EINVAL, "%s='%s' is not an integer in [%d, %d]", name, s, lo, hi);
  *out = (int)v;
  if (found) *found = true;
  return RTP_OK;
}

static int env_str(const char *name, char *dst, size_t n) {
  const char *s = getenv(name);
  if (!s || !*s) return RTP_OK;
  if (strlen(s) >= n) return rtp__error(RTP_EINVAL, "%s is too long (max %zu)", name, n - 1);
  memcpy(dst, s, strlen(s) + 1);
  return RTP_OK;
}

int rtp_comm_params_from_env(struct rtp_comm_params *p) {
  if (!p) return rtp__error(RTP_EINVAL, "rtp_comm_params_from_env: NULL");
  *p = rtp_comm_params_default();
  static const char *const rank_vars[][2] = {{"RTP_RANK", "RTP_WORLD_SIZE"},
                                             {"SLURM_PROCID", "SLURM_NTASKS"},
                                             {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"}};
  int st;
  for (int i = 0; i < 3; i++) {
    bool fr = false, fs = false;
    int rank = 0, size = 1;
    if ((st = env_int(rank_vars[i][0], 0, RC_MAX_WORLD - 1, &rank, &fr)) < 0) return st;
    if ((st = env_int(rank_vars[i][1], 1, RC_MAX_WORLD, &size, &fs)) < 0) return st;
    if (fr || fs) {
      if (rank >= size)
        return rtp__error(RTP_EINVAL, "%s=%d is not below %s=%d", rank_vars[i][0], rank,
                          rank_vars[i][1], size);
      p->rank = rank;
      p->world_size = size;
      break;
    }
  }
  if ((st = env_str("RTP_MASTER_ADDR", p->master_addr, sizeof(p->master_addr))) < 0) return st;
  if ((st = env_int("RTP_MASTER_PORT", 0, 65535, &p->master_port, NULL)) < 0) return st;
  if ((st = env_str("RTP_TOKEN", p->token, sizeof(p->token))) < 0) return st;
  if ((st = env_str("RTP_BIND_ADDR", p->bind, sizeof(p->bind))) < 0) return st;
  if ((st = env_str("RTP_IFNAME", p->bind, sizeof(p->bind))) < 0) return st;
  if ((st = env_int("RTP_TIMEOUT_MS", 1, 86400000, &p->timeout_ms, NULL)) < 0) return st;
  if ((st = env_str("RTP_BACKEND", p->backend, sizeof(p->backend))) < 0) return st;
  if ((st = env_int("RTP_DEVICE", -1, 65535, &p->device, NULL)) < 0) return st;
  return RTP_OK;
}

static void comm_destroy(struct rtp_comm *c) {
  if (c->thread_started) {
    pthread_mutex_lock(&c->mu);
    c->stopping = true;
    pthread_mutex_unlock(&c->mu);
    uv_async_send(&c->async);
    pthread_join(c->thread, NULL);
    uv_loop_close(&c->loop);
  }
  pthread_mutex_destroy(&c->mu);
  pthread_cond_destroy(&c->cv);
  free(c->pool);
  free(c->links);
  free(c->peers);
  free(c->p2p_tx_seq);
  free(c->p2p_rx_seq);
  free(c);
}

static uint64_t fnv1a(uint64_t h, const void *p, size_t n) {
  for (size_t i = 0; i < n; i++) h = (h ^ ((const uint8_t *)p)[i]) * 0x100000001b3ull;
  return h;
}

/* What two ranks must share for one to write into the other's memory: the boot (same
 * kernel), the network namespace (netns "hosts" of the Ethernet emulation must not
 * bypass their links), the pid namespace (pids mean the same) and the user. 0 when
 * unknown or turned off with RTP_DIRECT_COPY=0. */
static uint64_t host_key(void) {
  const char *env = getenv("RTP_DIRECT_COPY");
  if (env && !strcmp(env, "0")) return 0;
  char boot[64] = {0};
  FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
  if (!f) return 0;
  size_t n = fread(boot, 1, sizeof(boot) - 1, f);
  fclose(f);
  struct stat net, pid;
  if (n == 0 || stat("/proc/self/ns/net", &net) || stat("/proc/self/ns/pid", &pid)) return 0;
  uid_t uid = getuid();
  uint64_t h = fnv1a(0xcbf29ce484222325ull, boot, n);
  h = fnv1a(h, &net.st_ino, sizeof(net.st_ino));
  h = fnv1a(h, &net.st_dev, sizeof(net.st_dev));
  h = fnv1a(h, &pid.st_ino, sizeof(pid.st_ino));
  h = fnv1a(h, &pid.st_dev, sizeof(pid.st_dev));
  h = fnv1a(h, &uid, sizeof(uid));
  return h ? h : 1;
}

/* The last step of rtp_comm_init once the TCP part is up: backend "nccl" joins the NCCL
 * communicator through it, unless this rank found no usable device (dev_st, why). On
 * failure every rank's TCP communicator has failed too (so every rank returns an error
 * rather than waiting) and c is freed. */
static int nccl_join(struct rtp_comm *c, int dev_st, const char *why, struct rtp_comm **out) {
#ifdef RTP_HAVE_NCCL
  if (!strcmp(c->params.backend, "nccl")) {
    int st = dev_st;
    if (st < 0)
      rtp__comm_fail(c, st, why);
    else
      st = rtp__nccl_init(c, c->params.device, &c->nccl);
    if (st < 0) {
      comm_destroy(c); /* first: delivers the ABORT to the peers */
      return dev_st < 0 ? rtp__error(dev_st, "%s", why) : st;
    }
  }
#else
  (void)dev_st;
  (void)why;
#endif
  *out = c;
  return RTP_OK;
}

int rtp_comm_init(const struct rtp_comm_params *pin, struct rtp_comm **out) {
  if (!pin || !out) return rtp__error(RTP_EINVAL, "rtp_comm_init: NULL argument");
  *out = NULL;
  struct rtp_comm_params p = *pin;
  p.backend[sizeof(p.backend) - 1] = 0;
  p.token[sizeof(p.token) - 1] = 0;
  p.master_addr[sizeof(p.master_addr) - 1] = 0;
  p.bind[sizeof(p.bind) - 1] = 0;
  if (p.world_size < 1 || p.world_size > RC_MAX_WORLD || p.rank < 0 || p.rank >= p.world_size)
    return rtp__error(RTP_EINVAL, "rtp_comm_init: rank %d of world size %d", p.rank,
                      p.world_size);
  if (p.timeout_ms <= 0) p.timeout_ms = 60000;
  if (p.max_requests <= 0) p.max_requests = 128;
  bool local, nccl = !strcmp(p.backend, "nccl");
  if (!p.backend[0])
    local = p.world_size == 1;
  else if (!strcmp(p.backend, "local"))
    local = true;
  else if (!strcmp(p.backend, "tcp") || nccl)
    local = p.world_size == 1; /* one rank needs no sockets */
  else
    return rtp__error(RTP_EINVAL, "rtp_comm_init: unknown backend '%s' (tcp, nccl or local)",
                      p.backend);
#ifndef RTP_HAVE_NCCL
  if (nccl)
    return rtp__error(RTP_ENOSYS,
                      "rtp_comm_init: this build has no NCCL transport (configure with "
                      "RTP_CUDA=ON)");
#endif
  if (local && p.world_size != 1)
    return rtp__error(RTP_EINVAL, "the local backend has one rank (world size %d asked)",
                      p.world_size);
  if (!local && !p.token[0])
    return rtp__error(RTP_EINVAL,
                      "the tcp backend needs a job token (RTP_TOKEN; rtp-run "
                      "makes one)");
  if (!local && (p.master_port <= 0 || p.master_port > 65535))
    return rtp__error(RTP_EINVAL, "master port %d out of range", p.master_port);
  int dev_st = RTP_OK;
  char why[RC_MSG] = "";
#ifdef RTP_HAVE_NCCL
  if (nccl && p.device < -1)
    return rtp__error(RTP_EINVAL, "rtp_comm_init: device %d (-1: the local rank's)", p.device);
  /* The device before the rendezvous: a rank without one then reports its own reason even
     if a faster peer's failure (told through TCP) cuts its rendezvous short. */
  if (nccl && (dev_st = rtp__nccl_prepare(p.rank, p.device, &p.device)) < 0)
    snprintf(why, sizeof(why), "%s", rtp_last_error());
#endif

  struct rtp_comm *c = calloc(1, sizeof(*c));
  if (!c) return rtp__error(RTP_ENOMEM, "rtp_comm_init: out of memory");
  c->rank = p.rank;
  c->size = p.world_size;
  c->local = local;
  c->params = p;
  pthread_mutex_init(&c->mu, NULL);
  pthread_cond_init(&c->cv, NULL);
  c->pool = calloc((size_t)p.max_requests, sizeof(*c->pool));
  c->links = calloc((size_t)c->size, sizeof(*c->links));
  c->peers = calloc((size_t)c->size, sizeof(*c->peers));
  c->p2p_tx_seq = calloc((size_t)c->size, sizeof(uint64_t));
  c->p2p_rx_seq = calloc((size_t)c->size, sizeof(uint64_t));
  if (!c->pool || !c->links || !c->peers || !c->p2p_tx_seq || !c->p2p_rx_seq) {
    comm_destroy(c);
    return rtp__error(RTP_ENOMEM, "rtp_comm_init: out of memory");
  }
  for (int i = p.max_requests - 1; i >= 0; i--) {
    c->pool[i].comm = c;
    c->pool[i].qnext = c->free_list;
    c->free_list = &c->pool[i];
  }
  if (local) return nccl_join(c, dev_st, why, out);
  uint8_t id[RC_MAC_SIZE];
  hmac32(p.token, "rtp-job-id", NULL, 0, id);
  c->job_id = get64(id);
  c->host_key = host_key();

  int rc = uv_loop_init(&c->loop);
  if (rc < 0) {
    comm_destroy(c);
    return rtp__error(RTP_ECOMM, "uv_loop_init: %s", uv_strerror(rc));
  }
  uv_async_init(&c->loop, &c->async, on_async);
  c->async.data = c;
  uv_timer_init(&c->loop, &c->timer);
  c->timer.data = c;
  uv_idle_init(&c->loop, &c->idle);
  c->idle.data = c;
  /* The comm thread takes no signals: a write to a dead peer gives EPIPE there rather
     than a process-killing SIGPIPE, and SIGINT/SIGTERM reach the user's threads. */
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_BLOCK, &all, &old);
  int prc = pthread_create(&c->thread, NULL, comm_thread, c);
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  if (prc != 0) {
    uv_close((uv_handle_t *)&c->async, NULL);
    uv_close((uv_handle_t *)&c->timer, NULL);
    uv_close((uv_handle_t *)&c->idle, NULL);
    uv_run(&c->loop, UV_RUN_DEFAULT);
    uv_loop_close(&c->loop);
    comm_destroy(c);
    return rtp__error(RTP_ECOMM, "cannot start the comm thread");
  }
  c->thread_started = true;
  pthread_mutex_lock(&c->mu);
  while (!c->ready && !c->failed) pthread_cond_wait(&c->cv, &c->mu);
  int st = c->failed;
  char msg[RC_MSG];
  snprintf(msg, sizeof(msg), "%s", c->fail_msg);
  pthread_mutex_unlock(&c->mu);
  if (st < 0) {
    comm_destroy(c);
    return dev_st < 0 ? rtp__error(dev_st, "%s", why) : rtp__error(st, "%s", msg);
  }
  return nccl_join(c, dev_st, why, out);
}

void rtp_comm_free(struct rtp_comm *c) {
  if (!c) return;
#ifdef RTP_HAVE_NCCL
  rtp__nccl_free(c->nccl); /* first: it may still use the TCP connections */
#endif
  comm_destroy(c);
}

struct rtp_nccl *rtp__comm_nccl(const struct rtp_comm *c) {
  return c ? c->nccl : NULL;
}

int rtp__comm_timeout_ms(const struct rtp_comm *c) {
  return c->params.timeout_ms;
}

void rtp__comm_fail(struct rtp_comm *c, int status, const char *msg) {
  pthread_mutex_lock(&c->mu);
  bool first = !c->failed;
  if (first) {
    snprintf(c->fail_msg, sizeof(c->fail_msg), "%s", msg);
    c->failed = status;
    c->fail_told = true;
    pthread_cond_broadcast(&c->cv);
  }
  pthread_mutex_unlock(&c->mu);
  /* the loop sends ABORT(msg) to every peer and fails the pending requests */
  if (first && c->thread_started) uv_async_send(&c->async);
}
