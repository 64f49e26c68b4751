/*
 * rtp-comm.c - the communicator's front end: parameters and environment, joining a job,
 * groups (rtp_comm_split), the request pool, argument checks, sequence numbers, waiting,
 * and the job's failure. Operations reach a transport only through rtp_transport_i
 * (rtp-comm.h): "tcp" or "local" for host memory, "nccl" for device buffers.
 *
 * A job's groups share one world: the host transport, the request pool and the failure,
 * all under w->mu. A group is a view of the world's ranks with its own id and sequence
 * numbers; its frames travel over the world's connections, tagged with the id.
 */
#include "rtp-comm.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#ifdef RTP_HAVE_NCCL
#include "rtp-nccl.h"
#endif

struct rtp_comm_world {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  struct rtp_comm_req *pool, *free_list;
  int failed;                  /* sticky status */
  char fail_msg[RTP_COMM_MSG]; /* written once, before failed */
  bool stopping;
  int refs; /* communicators (groups) alive */
  struct rtp_comm_params params;
  struct rtp_transport *host;
  uint64_t *groups; /* ids registered by this rank, for collisions */
  int n_groups, cap_groups;
};

struct rtp_comm {
  struct rtp_comm_world *w;
  uint64_t group; /* 0: the world */
  int rank, size;
  int *members; /* world rank of each group rank */
  /* under w->mu */
  uint64_t coll_seq, *p2p_tx_seq, *p2p_rx_seq;
  uint64_t n_splits;            /* splits made of this group: part of the next one's id */
  struct rtp_transport *device; /* nccl, or NULL */
};

const char *rtp__comm_kind_name(int kind) {
  switch (kind) {
#define RTP_XX(name, text) \
  case RTP_COMM_K_##name:  \
    return text;
    RTP_COMM_KIND_MAP(RTP_XX)
#undef RTP_XX
  }
  return "unknown";
}

/* ---- the request pool and completion ---------------------------------------------- */

static int req_take_locked(struct rtp_comm_world *w, struct rtp_comm_req **out) {
  if (w->failed) return rtp__error(w->failed, "%s", w->fail_msg);
  if (w->stopping) return rtp__error(RTP_ESTATE, "communicator is being freed");
  struct rtp_comm_req *r = w->free_list;
  if (!r)
    return rtp__error(RTP_ESTATE,
                      "too many communication requests in flight (max_requests = %d): "
                      "wait on some first",
                      w->params.max_requests);
  w->free_list = r->next;
  r->next = NULL;
  r->status = 0;
  r->msg[0] = 0;
  r->state = RTP_REQ_POSTED;
  *out = r;
  return RTP_OK;
}

void rtp__comm_req_done(struct rtp_comm_req *r, int status, const char *msg) {
  struct rtp_comm_world *w = r->w;
  pthread_mutex_lock(&w->mu);
  r->status = status;
  snprintf(r->msg, sizeof(r->msg), "%s", msg ? msg : "");
  r->state = RTP_REQ_DONE;
  pthread_cond_broadcast(&w->cv);
  pthread_mutex_unlock(&w->mu);
}

/* Under w->mu, r done: gives r back and returns its outcome (message as the error). */
static int req_result_unlock(struct rtp_comm_world *w, struct rtp_comm_req *r) {
  int st = r->status;
  char msg[RTP_COMM_MSG];
  snprintf(msg, sizeof(msg), "%s", r->msg);
  r->state = RTP_REQ_FREE;
  r->next = w->free_list;
  w->free_list = r;
  pthread_mutex_unlock(&w->mu);
  if (st < 0) rtp__error(st, "%s", msg);
  return st;
}

int rtp_comm_wait_for(struct rtp_comm_req *r, int timeout_ms) {
  if (!r) return rtp__error(RTP_EINVAL, "rtp_comm_wait: NULL request");
  struct rtp_comm_world *w = r->w;
  pthread_mutex_lock(&w->mu);
  if (r->state != RTP_REQ_POSTED && r->state != RTP_REQ_DONE) {
    pthread_mutex_unlock(&w->mu);
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
  while (r->state != RTP_REQ_DONE) {
    if (timeout_ms < 0) {
      pthread_cond_wait(&w->cv, &w->mu);
    } else if (pthread_cond_timedwait(&w->cv, &w->mu, &ts) == ETIMEDOUT &&
               r->state != RTP_REQ_DONE) {
      pthread_mutex_unlock(&w->mu);
      return rtp__error(RTP_ETIMEDOUT, "request still pending after %d ms", timeout_ms);
    }
  }
  return req_result_unlock(w, r);
}

int rtp_comm_wait(struct rtp_comm_req *r) {
  return rtp_comm_wait_for(r, -1);
}

int rtp_comm_test(struct rtp_comm_req *r, bool *done) {
  if (!r || !done) return rtp__error(RTP_EINVAL, "rtp_comm_test: NULL argument");
  struct rtp_comm_world *w = r->w;
  pthread_mutex_lock(&w->mu);
  if (r->state != RTP_REQ_DONE) {
    *done = false;
    pthread_mutex_unlock(&w->mu);
    return RTP_OK;
  }
  *done = true;
  return req_result_unlock(w, r);
}

/* ---- failure ----------------------------------------------------------------------- */

/* Records the failure if it is the first; whether it was. */
static bool world_fail_first(struct rtp_comm_world *w, int status, const char *msg) {
  pthread_mutex_lock(&w->mu);
  bool first = !w->failed && status < 0;
  if (first) {
    snprintf(w->fail_msg, sizeof(w->fail_msg), "%s", msg ? msg : "");
    w->failed = status;
    pthread_cond_broadcast(&w->cv);
  }
  pthread_mutex_unlock(&w->mu);
  return first;
}

int rtp__comm_world_fail(struct rtp_comm_world *w, int status, const char *msg,
                         const char **first_msg) {
  world_fail_first(w, status, msg);
  pthread_mutex_lock(&w->mu);
  int st = w->failed;
  pthread_mutex_unlock(&w->mu);
  if (first_msg) *first_msg = w->fail_msg;
  return st;
}

void rtp__comm_blame(struct rtp_comm_world *w, int rank, const char *why) {
  static int told; /* atomic: one line per process, whichever thread comes first */
  const char *env = getenv("RTP_RUN_BLAME_FD");
  char *end;
  long fd = env ? strtol(env, &end, 10) : -1;
  if (!env || *end || fd < 0 || fd > INT_MAX || __atomic_exchange_n(&told, 1, __ATOMIC_RELAXED))
    return;
  char line[96]; /* one write, shorter than PIPE_BUF: lines of the ranks do not mix */
  int n = snprintf(line, sizeof(line), "%d %d %s\n", w->params.rank, rank, why);
  ssize_t wr = n > 0 ? write((int)fd, line, (size_t)n) : 0;
  (void)wr; /* a launcher that is gone has nothing to be told */
}

const struct rtp_comm_params *rtp__comm_world_params(const struct rtp_comm_world *w) {
  return &w->params;
}

void rtp_comm_abort(struct rtp_comm *c, int status, const char *msg) {
  if (!c || status >= 0) return;
  struct rtp_transport *host = c->w->host;
  if (world_fail_first(c->w, status, msg) && host->i->fail) host->i->fail(host);
}

int rtp_comm_status(struct rtp_comm *c, const char **msg) {
  const char *m;
  int st = rtp__comm_world_fail(c->w, 0, NULL, &m);
  if (msg) *msg = st ? m : "";
  return st;
}

/* ---- posting ----------------------------------------------------------------------- */

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

/* Whether op (placed) needs no peer. */
static bool op_local(const struct rtp_comm_op *op) {
  return op->size == 1 || (op->tx_peer < 0 && op->rx_peer < 0);
}

/* Fills op's group part; whether it needs no peer (one rank, or a copy to oneself). */
static bool op_place(const struct rtp_comm *c, struct rtp_comm_op *op) {
  op->group = c->group;
  op->rank = c->rank;
  op->size = c->size;
  int to, from;
  rtp__coll_peers(op, &to, &from);
  op->tx_peer = to >= 0 && to != c->rank ? c->members[to] : -1;
  op->rx_peer = from >= 0 && from != c->rank ? c->members[from] : -1;
  return op_local(op);
}

/* What every operation must satisfy, however it was made (graph nodes too). */
static int op_check(const struct rtp_comm *c, const struct rtp_comm_op *op) {
  const char *what = op->what && op->what[0] ? op->what : rtp__comm_kind_name(op->kind);
  if (op->kind == RTP_COMM_K_P2P) {
    bool self = op->dst == c->rank || op->src == c->rank;
    if (op->dst < -1 || op->dst >= c->size || op->src < -1 || op->src >= c->size)
      return rtp__error(RTP_EINVAL, "%s: dst %d or src %d out of range (group of %d)", what,
                        op->dst, op->src, c->size);
    if (self && (op->dst != c->rank || op->src != c->rank || op->sbytes != op->rbytes))
      return rtp__error(RTP_EINVAL,
                        "%s: dst %d and src %d must both or neither be this rank (%d), with "
                        "as many bytes",
                        what, op->dst, op->src, c->rank);
    if ((!op->sbuf && op->sbytes) || (!op->buf && op->rbytes))
      return rtp__error(RTP_EINVAL, "%s: NULL buffer", what);
    return RTP_OK;
  }
  if (op->kind <= RTP_COMM_K_NONE || op->kind >= RTP_COMM_K_COUNT)
    return rtp__error(RTP_EINVAL, "%s: unknown operation %d", what, op->kind);
  if (!op->buf && op->count) return rtp__error(RTP_EINVAL, "%s: NULL buffer", what);
  if (op->root < 0 || op->root >= c->size)
    return rtp__error(RTP_EINVAL, "%s: root %d out of range (group of %d)", what, op->root,
                      c->size);
  return RTP_OK;
}

/* Under w->mu: op's sequence numbers, in the order the caller numbers operations. */
static void number_locked(struct rtp_comm *c, struct rtp_comm_op *op, bool local) {
  if (local) return;
  if (op->kind != RTP_COMM_K_P2P) {
    op->seq = op->rx_seq = c->coll_seq++;
  } else {
    if (op->dst >= 0) op->seq = c->p2p_tx_seq[op->dst]++;
    if (op->src >= 0) op->rx_seq = c->p2p_rx_seq[op->src]++;
  }
}

/* Hands the request r, taken and filled under w->mu, to its transport. */
static int submit(struct rtp_comm_world *w, struct rtp_comm_req *r, bool local,
                  struct rtp_comm_req **out) {
  struct rtp_transport *t = local ? rtp__local_transport() : w->host;
  t->i->submit(t, r);
  if (out) {
    *out = r;
    return RTP_OK;
  }
  return rtp_comm_wait(r);
}

int rtp__comm_post(struct rtp_comm *c, struct rtp_comm_op *op, struct rtp_comm_req **out) {
  if (!c) return rtp__error(RTP_EINVAL, "%s: NULL communicator", op->what ? op->what : "comm");
  int st = op_check(c, op);
  if (st) return st;
  struct rtp_comm_world *w = c->w;
  bool local = op_place(c, op);
  struct rtp_comm_req *r = NULL;
  pthread_mutex_lock(&w->mu);
  st = req_take_locked(w, &r);
  if (st < 0) {
    pthread_mutex_unlock(&w->mu);
    return st;
  }
  number_locked(c, op, local);
  r->op = *op;
  pthread_mutex_unlock(&w->mu);
  return submit(w, r, local, out);
}

int rtp__comm_number(struct rtp_comm *c, struct rtp_comm_op *op) {
  if (!c) return rtp__error(RTP_EINVAL, "%s: NULL communicator", op->what ? op->what : "comm");
  int st = op_check(c, op);
  if (st) return st;
  struct rtp_comm_world *w = c->w;
  bool local = op_place(c, op);
  pthread_mutex_lock(&w->mu);
  if (w->failed) {
    pthread_mutex_unlock(&w->mu);
    return rtp__error(w->failed, "%s", w->fail_msg);
  }
  number_locked(c, op, local);
  pthread_mutex_unlock(&w->mu);
  return RTP_OK;
}

int rtp__comm_submit(struct rtp_comm *c, const struct rtp_comm_op *op,
                     struct rtp_comm_req **out) {
  if (!c) return rtp__error(RTP_EINVAL, "%s: NULL communicator", op->what ? op->what : "comm");
  struct rtp_comm_world *w = c->w;
  struct rtp_comm_req *r = NULL;
  pthread_mutex_lock(&w->mu);
  int st = req_take_locked(w, &r);
  if (st < 0) {
    pthread_mutex_unlock(&w->mu);
    return st;
  }
  r->op = *op;
  pthread_mutex_unlock(&w->mu);
  return submit(w, r, op_local(op), out);
}

int rtp__comm_post_stream(struct rtp_comm *c, struct rtp_comm_op *op, void *stream) {
  if (!c || !c->device)
    return rtp__error(RTP_ENOSYS, "%s: the communicator has no device transport",
                      op && op->what ? op->what : "comm");
  op_place(c, op);
  return c->device->i->post_stream(c->device, op, stream);
}

struct rtp_transport *rtp__comm_device(const struct rtp_comm *c) {
  return c ? c->device : NULL;
}

int rtp_comm_send(struct rtp_comm *c, const void *buf, size_t nbytes, int dst,
                  struct rtp_comm_req **req) {
  int st;
  if ((st = check_comm(c, "rtp_comm_send")) < 0) return st;
  if ((st = check_rank(c, dst, "rtp_comm_send")) < 0) return st;
  if (dst == c->rank)
    return rtp__error(RTP_EINVAL, "rtp_comm_send: sending to oneself (use sendrecv)");
  if (!buf && nbytes) return rtp__error(RTP_EINVAL, "rtp_comm_send: NULL buffer");
  struct rtp_comm_op op = {
      .kind = RTP_COMM_K_P2P, .sbuf = buf, .sbytes = nbytes, .dst = dst, .src = -1};
  return rtp__comm_post(c, &op, req);
}

int rtp_comm_recv(struct rtp_comm *c, void *buf, size_t nbytes, int src,
                  struct rtp_comm_req **req) {
  int st;
  if ((st = check_comm(c, "rtp_comm_recv")) < 0) return st;
  if ((st = check_rank(c, src, "rtp_comm_recv")) < 0) return st;
  if (src == c->rank)
    return rtp__error(RTP_EINVAL, "rtp_comm_recv: receiving from oneself (use sendrecv)");
  if (!buf && nbytes) return rtp__error(RTP_EINVAL, "rtp_comm_recv: NULL buffer");
  struct rtp_comm_op op = {
      .kind = RTP_COMM_K_P2P, .buf = buf, .rbytes = nbytes, .dst = -1, .src = src};
  return rtp__comm_post(c, &op, req);
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
  if (dst == c->rank && sendbytes != recvbytes)
    return rtp__error(RTP_EINVAL,
                      "rtp_comm_sendrecv: %zu bytes sent to oneself, %zu "
                      "expected",
                      sendbytes, recvbytes);
  struct rtp_comm_op op = {.kind = RTP_COMM_K_P2P,
                           .sbuf = sendbuf,
                           .sbytes = sendbytes,
                           .dst = dst,
                           .buf = recvbuf,
                           .rbytes = recvbytes,
                           .src = src};
  return rtp__comm_post(c, &op, req);
}

static int post_coll(struct rtp_comm *c, int kind, void *buf, size_t count, size_t esize,
                     int root, struct rtp_comm_req **req) {
  struct rtp_comm_op op = {.kind = kind,
                           .buf = buf,
                           .count = count,
                           .esize = esize,
                           .root = root,
                           .dst = -1,
                           .src = -1};
  return rtp__comm_post(c, &op, req);
}

int rtp_comm_allreduce(struct rtp_comm *c, float *buf, size_t count,
                       struct rtp_comm_req **req) {
  int st;
  if ((st = check_comm(c, "rtp_comm_allreduce")) < 0) return st;
  if (!buf && count) return rtp__error(RTP_EINVAL, "rtp_comm_allreduce: NULL buffer");
  return post_coll(c, RTP_COMM_K_ALLREDUCE, buf, count, sizeof(float), 0, req);
}

int rtp_comm_reduce_scatter(struct rtp_comm *c, float *buf, size_t count,
                            struct rtp_comm_req **req) {
  int st;
  if ((st = check_comm(c, "rtp_comm_reduce_scatter")) < 0) return st;
  if (!buf && count) return rtp__error(RTP_EINVAL, "rtp_comm_reduce_scatter: NULL buffer");
  return post_coll(c, RTP_COMM_K_REDUCE_SCATTER, buf, count, sizeof(float), 0, req);
}

int rtp_comm_allgather(struct rtp_comm *c, void *buf, size_t count, size_t elem_size,
                       struct rtp_comm_req **req) {
  int st;
  if ((st = check_comm(c, "rtp_comm_allgather")) < 0) return st;
  if (!buf && count) return rtp__error(RTP_EINVAL, "rtp_comm_allgather: NULL buffer");
  if (elem_size == 0) return rtp__error(RTP_EINVAL, "rtp_comm_allgather: elem_size 0");
  if (count && elem_size > SIZE_MAX / count)
    return rtp__error(RTP_EINVAL, "rtp_comm_allgather: size overflows");
  return post_coll(c, RTP_COMM_K_ALLGATHER, buf, count, elem_size, 0, req);
}

int rtp_comm_broadcast(struct rtp_comm *c, void *buf, size_t nbytes, int root,
                       struct rtp_comm_req **req) {
  int st;
  if ((st = check_comm(c, "rtp_comm_broadcast")) < 0) return st;
  if ((st = check_rank(c, root, "rtp_comm_broadcast")) < 0) return st;
  if (!buf && nbytes) return rtp__error(RTP_EINVAL, "rtp_comm_broadcast: NULL buffer");
  return post_coll(c, RTP_COMM_K_BROADCAST, buf, nbytes, 1, root, req);
}

int rtp_comm_barrier(struct rtp_comm *c, struct rtp_comm_req **req) {
  int st;
  if ((st = check_comm(c, "rtp_comm_barrier")) < 0) return st;
  return post_coll(c, RTP_COMM_K_BARRIER, NULL, 0, 1, 0, req);
}

int rtp_comm_rank(const struct rtp_comm *c) {
  return c ? c->rank : -1;
}

int rtp_comm_size(const struct rtp_comm *c) {
  return c ? c->size : 0;
}

int rtp_comm_world_rank(const struct rtp_comm *c, int rank) {
  return c && rank >= 0 && rank < c->size ? c->members[rank] : -1;
}

int rtp_comm_hosts(const struct rtp_comm *c, int *hosts) {
  if (!c || !hosts) return rtp__error(RTP_EINVAL, "rtp_comm_hosts: NULL communicator or hosts");
  enum { KEY = 80 };
  char(*keys)[KEY] = calloc((size_t)c->size, KEY);
  if (!keys) return rtp__error(RTP_ENOMEM, "rtp_comm_hosts: out of memory");
  struct rtp_transport *t = c->w->host;
  for (int i = 0; i < c->size; i++) {
    if (t->i->host)
      t->i->host(t, c->members[i], keys[i], KEY);
    else
      snprintf(keys[i], KEY, "rank %d", c->members[i]);
  }
  int n = 0;
  for (int i = 0; i < c->size; i++) {
    hosts[i] = -1;
    for (int q = 0; q < i && hosts[i] < 0; q++)
      if (strcmp(keys[q], keys[i]) == 0) hosts[i] = hosts[q];
    if (hosts[i] < 0) hosts[i] = n++;
  }
  free(keys);
  return RTP_OK;
}

/* ---- parameters ---------------------------------------------------------------------- */

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
    if ((st = env_int(rank_vars[i][0], 0, RTP_COMM_MAX_WORLD - 1, &rank, &fr)) < 0) return st;
    if ((st = env_int(rank_vars[i][1], 1, RTP_COMM_MAX_WORLD, &size, &fs)) < 0) return st;
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

/* Checks p and fills its defaults; *local: whether the job needs no sockets. */
/* About how many bits a token carries if it was drawn at random from the characters it
 * uses: 4 a character if they are all hex digits (`openssl rand -hex`), else 6 (base64 and
 * the like), and nothing for a token of fewer than 8 distinct characters ("aaaa...").
 * Guessing is what it guards against: the handshake gives an attacker who joins the
 * network one proof to test guesses against offline (docs/transport.md). */
static int token_bits(const char *t) {
  bool hex = true, seen[256] = {false};
  int distinct = 0, n = 0;
  for (; t[n]; n++) {
    unsigned char ch = (unsigned char)t[n];
    hex &= (ch >= '0' && ch <= '9') || (ch >= 'a' && ch <= 'f') || (ch >= 'A' && ch <= 'F');
    distinct += !seen[ch];
    seen[ch] = true;
  }
  return distinct < 8 ? 0 : n * (hex ? 4 : 6);
}

static int params_check(struct rtp_comm_params *p, bool *local) {
  p->backend[sizeof(p->backend) - 1] = 0;
  p->token[sizeof(p->token) - 1] = 0;
  p->master_addr[sizeof(p->master_addr) - 1] = 0;
  p->bind[sizeof(p->bind) - 1] = 0;
  if (p->world_size < 1 || p->world_size > RTP_COMM_MAX_WORLD || p->rank < 0 ||
      p->rank >= p->world_size)
    return rtp__error(RTP_EINVAL, "rtp_comm_init: rank %d of world size %d", p->rank,
                      p->world_size);
  if (p->timeout_ms <= 0) p->timeout_ms = 60000;
  if (p->max_requests <= 0) p->max_requests = 128;
  bool nccl = !strcmp(p->backend, "nccl");
  if (!p->backend[0] || !strcmp(p->backend, "tcp") || nccl)
    *local = p->world_size == 1; /* one rank needs no sockets */
  else if (!strcmp(p->backend, "local"))
    *local = true;
  else
    return rtp__error(RTP_EINVAL, "rtp_comm_init: unknown backend '%s' (tcp, nccl or local)",
                      p->backend);
#ifndef RTP_HAVE_NCCL
  if (nccl)
    return rtp__error(RTP_ENOSYS,
                      "rtp_comm_init: this build has no NCCL transport (configure with "
                      "RTP_CUDA=ON)");
#else
  if (nccl && p->device < -1)
    return rtp__error(RTP_EINVAL, "rtp_comm_init: device %d (-1: the local rank's)", p->device);
#endif
  if (*local && p->world_size != 1)
    return rtp__error(RTP_EINVAL, "the local backend has one rank (world size %d asked)",
                      p->world_size);
  if (!*local && !p->token[0])
    return rtp__error(RTP_EINVAL,
                      "the tcp backend needs a job token (RTP_TOKEN; rtp-run "
                      "makes one)");
  int bits = token_bits(p->token);
  if (!*local && bits < 128)
    return rtp__error(RTP_EINVAL,
                      "RTP_TOKEN can be guessed: %zu characters give about %d bits, 128 are "
                      "needed; make one with `openssl rand -hex 32` (rtp-run makes one on a "
                      "single host)",
                      strlen(p->token), bits);
  if (!*local && (p->master_port <= 0 || p->master_port > 65535))
    return rtp__error(RTP_EINVAL, "master port %d out of range", p->master_port);
  return RTP_OK;
}

/* ---- joining, groups and freeing --------------------------------------------------------- */

static void world_destroy(struct rtp_comm_world *w) {
  if (w->host) {
    pthread_mutex_lock(&w->mu);
    w->stopping = true;
    pthread_mutex_unlock(&w->mu);
    w->host->i->free(w->host);
  }
  pthread_mutex_destroy(&w->mu);
  pthread_cond_destroy(&w->cv);
  free(w->pool);
  free(w->groups);
  free(w);
}

static struct rtp_comm_world *world_new(const struct rtp_comm_params *p) {
  struct rtp_comm_world *w = calloc(1, sizeof(*w));
  if (!w) return NULL;
  w->params = *p;
  pthread_mutex_init(&w->mu, NULL);
  pthread_cond_init(&w->cv, NULL);
  w->pool = calloc((size_t)p->max_requests, sizeof(*w->pool));
  if (!w->pool) {
    world_destroy(w);
    return NULL;
  }
  for (int i = p->max_requests - 1; i >= 0; i--) {
    w->pool[i].w = w;
    w->pool[i].index = i;
    w->pool[i].next = w->free_list;
    w->free_list = &w->pool[i];
  }
  return w;
}

static void group_free(struct rtp_comm *c) {
  free(c->members);
  free(c->p2p_tx_seq);
  free(c->p2p_rx_seq);
  free(c);
}

/* A group of w with members (world ranks, by group rank); takes a reference on w. */
static struct rtp_comm *group_new(struct rtp_comm_world *w, uint64_t id, const int *members,
                                  int n, int rank) {
  struct rtp_comm *c = calloc(1, sizeof(*c));
  if (!c) return NULL;
  c->w = w;
  c->group = id;
  c->rank = rank;
  c->size = n;
  c->members = malloc(sizeof(int) * (size_t)n);
  c->p2p_tx_seq = calloc((size_t)n, sizeof(uint64_t));
  c->p2p_rx_seq = calloc((size_t)n, sizeof(uint64_t));
  if (!c->members || !c->p2p_tx_seq || !c->p2p_rx_seq) {
    group_free(c);
    return NULL;
  }
  memcpy(c->members, members, sizeof(int) * (size_t)n);
  pthread_mutex_lock(&w->mu);
  w->refs++;
  pthread_mutex_unlock(&w->mu);
  return c;
}

int rtp_comm_init(const struct rtp_comm_params *pin, struct rtp_comm **out) {
  if (!pin || !out) return rtp__error(RTP_EINVAL, "rtp_comm_init: NULL argument");
  *out = NULL;
  struct rtp_comm_params p = *pin;
  bool local = false;
  int st = params_check(&p, &local);
  if (st) return st;
  int dev_st = RTP_OK;
  char why[RTP_COMM_MSG] = "";
#ifdef RTP_HAVE_NCCL
  bool nccl = !strcmp(p.backend, "nccl");
  /* The device before the rendezvous: a rank without one then reports its own reason even
     if a faster peer's failure (told through TCP) cuts its rendezvous short. */
  if (nccl && (dev_st = rtp__nccl_prepare(p.rank, p.device, &p.device)) < 0)
    snprintf(why, sizeof(why), "%s", rtp_last_error());
#endif
  struct rtp_comm_world *w = world_new(&p);
  int *all = malloc(sizeof(int) * (size_t)p.world_size);
  if (!w || !all) {
    if (w) world_destroy(w);
    free(all);
    return rtp__error(RTP_ENOMEM, "rtp_comm_init: out of memory");
  }
  for (int q = 0; q < p.world_size; q++) all[q] = q;
  if (local) {
    w->host = rtp__local_transport();
  } else if ((st = rtp__tcp_new(w, &w->host)) < 0) {
    char msg[RTP_COMM_MSG];
    snprintf(msg, sizeof(msg), "%s", rtp_last_error());
    free(all);
    world_destroy(w);
    return dev_st < 0 ? rtp__error(dev_st, "%s", why) : rtp__error(st, "%s", msg);
  }
  struct rtp_comm *c = group_new(w, 0, all, p.world_size, p.rank);
  free(all);
  if (!c) {
    world_destroy(w);
    return rtp__error(RTP_ENOMEM, "rtp_comm_init: out of memory");
  }
#ifdef RTP_HAVE_NCCL
  /* On failure every rank's TCP part has failed too (so every rank returns an error
     rather than waiting): first freed, it delivers the ABORT to the peers. */
  if (nccl) {
    st = dev_st;
    if (st < 0)
      rtp_comm_abort(c, st, why);
    else
      st = rtp__nccl_new(c, p.device, p.timeout_ms, &c->device);
    if (st < 0) {
      char msg[RTP_COMM_MSG];
      snprintf(msg, sizeof(msg), "%s", dev_st < 0 ? why : rtp_last_error());
      rtp_comm_free(c);
      return rtp__error(st, "%s", msg);
    }
  }
#endif
  (void)dev_st;
  *out = c;
  return RTP_OK;
}

int rtp__comm_dry_new(int world_size, int rank, struct rtp_comm **out) {
  if (!out) return rtp__error(RTP_EINVAL, "rtp__comm_dry_new: NULL out");
  *out = NULL;
  struct rtp_comm_params p = rtp_comm_params_default();
  p.world_size = world_size;
  p.rank = rank;
  snprintf(p.backend, sizeof(p.backend), "dry");
  if (world_size < 1 || world_size > RTP_COMM_MAX_WORLD || rank < 0 || rank >= world_size)
    return rtp__error(RTP_EINVAL, "rtp__comm_dry_new: rank %d of world size %d", rank,
                      world_size);
  struct rtp_comm_world *w = world_new(&p);
  int *all = malloc(sizeof(int) * (size_t)world_size);
  struct rtp_comm *c = NULL;
  if (w && all) {
    w->host = rtp__dry_transport();
    for (int q = 0; q < world_size; q++) all[q] = q;
    c = group_new(w, 0, all, world_size, rank);
  }
  free(all);
  if (!c) {
    if (w) world_destroy(w);
    return rtp__error(RTP_ENOMEM, "rtp__comm_dry_new: out of memory");
  }
  *out = c;
  return RTP_OK;
}

void rtp_comm_free(struct rtp_comm *c) {
  if (!c) return;
  if (c->device) c->device->i->free(c->device); /* first: it may still use the host part */
  struct rtp_comm_world *w = c->w;
  group_free(c);
  pthread_mutex_lock(&w->mu);
  bool last = --w->refs == 0;
  pthread_mutex_unlock(&w->mu);
  if (last) world_destroy(w);
}

static uint64_t mix64(uint64_t h) {
  h ^= h >> 33;
  h *= 0xff51afd7ed558ccdull;
  h ^= h >> 33;
  h *= 0xc4ceb9fe1a85ec53ull;
  return h ^ (h >> 33);
}

/* Every member derives the same id from the parent's, the split's number and the color;
 * 0 is the world's. */
static uint64_t group_id(const struct rtp_comm *parent, int color) {
  uint64_t h = mix64(parent->group ^ mix64(parent->n_splits * 0x9e3779b97f4a7c15ull));
  h = mix64(h ^ (uint64_t)(uint32_t)color);
  return h ? h : 1;
}

static int group_register(struct rtp_comm_world *w, uint64_t id) {
  pthread_mutex_lock(&w->mu);
  int st = RTP_OK;
  for (int i = 0; i < w->n_groups && !st; i++)
    if (w->groups[i] == id) st = RTP_ESTATE;
  if (!st && w->n_groups == w->cap_groups) {
    int cap = w->cap_groups ? 2 * w->cap_groups : 8;
    uint64_t *g = realloc(w->groups, sizeof(uint64_t) * (size_t)cap);
    if (!g) st = RTP_ENOMEM;
    if (g) {
      w->groups = g;
      w->cap_groups = cap;
    }
  }
  if (!st) w->groups[w->n_groups++] = id;
  pthread_mutex_unlock(&w->mu);
  if (st == RTP_ESTATE) return rtp__error(st, "rtp_comm_split: group id collision (retry)");
  return st ? rtp__error(st, "rtp_comm_split: out of memory") : RTP_OK;
}

/* The members of color (by key, then rank in c): world ranks; *rank: this rank's place. */
static int members_of(const struct rtp_comm *c, const int32_t *ck, int color, int *members,
                      int *rank) {
  int n = 0;
  for (int q = 0; q < c->size; q++) {
    if (ck[2 * q] != color) continue;
    int at = n++;
    while (at > 0 && ck[2 * (members[at - 1]) + 1] > ck[2 * q + 1]) {
      members[at] = members[at - 1];
      at--;
    }
    members[at] = q;
  }
  for (int i = 0; i < n; i++) {
    if (members[i] == c->rank) *rank = i;
    members[i] = c->members[members[i]];
  }
  return n;
}

int rtp_comm_split(struct rtp_comm *c, int color, int key, struct rtp_comm **out) {
  if (!c || !out) return rtp__error(RTP_EINVAL, "rtp_comm_split: NULL argument");
  *out = NULL;
  if (color < RTP_COMM_UNDEFINED)
    return rtp__error(RTP_EINVAL, "rtp_comm_split: color %d (>= 0, or RTP_COMM_UNDEFINED)",
                      color);
  int32_t *ck = malloc(sizeof(int32_t) * 2 * (size_t)c->size);
  int *members = malloc(sizeof(int) * (size_t)c->size);
  if (!ck || !members) {
    free(ck);
    free(members);
    return rtp__error(RTP_ENOMEM, "rtp_comm_split: out of memory");
  }
  ck[2 * c->rank] = color;
  ck[2 * c->rank + 1] = key;
  int st = rtp_comm_allgather(c, ck, (size_t)c->size, 2 * sizeof(int32_t), NULL);
  int n = 0, rank = 0;
  uint64_t id = group_id(c, color);
  c->n_splits++;
  if (!st && color >= 0) {
    n = members_of(c, ck, color, members, &rank);
    st = group_register(c->w, id);
    if (!st && c->w->host->i->group_add)
      st = c->w->host->i->group_add(c->w->host, id, members, n);
  }
  /* After the barrier every member has registered the group: no frame of it can come
   * to a rank that does not know it yet. */
  int bst = rtp_comm_barrier(c, NULL);
  if (!st) st = bst;
  if (!st && color >= 0 && !(*out = group_new(c->w, id, members, n, rank)))
    st = rtp__error(RTP_ENOMEM, "rtp_comm_split: out of memory");
  free(ck);
  free(members);
#ifdef RTP_HAVE_NCCL
  if (!st && *out && c->device) {
    st = rtp__nccl_new(*out, c->w->params.device, c->w->params.timeout_ms, &(*out)->device);
    if (st) {
      rtp_comm_free(*out);
      *out = NULL;
    }
  }
#endif
  return st;
}

int rtp_comm_mesh_2d(struct rtp_comm *c, int rows, int cols, struct rtp_comm **row,
                     struct rtp_comm **col) {
  if (!c || !row || !col) return rtp__error(RTP_EINVAL, "rtp_comm_mesh_2d: NULL argument");
  *row = *col = NULL;
  if (rows < 1 || cols < 1 || (int64_t)rows * cols != c->size)
    return rtp__error(RTP_EINVAL, "rtp_comm_mesh_2d: %d x %d ranks in a group of %d", rows,
                      cols, c->size);
  int st = rtp_comm_split(c, c->rank / cols, c->rank, row);
  if (!st) st = rtp_comm_split(c, c->rank % cols, c->rank, col);
  if (st) {
    rtp_comm_free(*row);
    *row = NULL;
  }
  return st;
}
