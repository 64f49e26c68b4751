/*
 * rtp-tcp.c - the "tcp" transport: a libuv loop on a comm thread moves the frames of every
 * group of a job over one authenticated connection per pair of ranks (rtp-tcp-conn.c).
 *
 * Threads. User threads submit requests (rtp-comm.c numbered them): under c->qmu a
 * request joins the submission queue and the loop is woken with uv_async_send.
 * Everything else (sockets, request state machines) lives on the comm thread, which
 * completes a request through rtp__comm_req_done from an idle callback, after which it
 * never touches it again.
 *
 * Flow control. No data frame is ever sent before its receiver posted the matching
 * request and said so with a ready-to-receive (RTR) frame, so a receiver never buffers
 * or blocks a connection: every byte that arrives has a destination (the user's buffer,
 * or for a reduction a per-connection scratch segment). Requests match by (group, class,
 * sequence number); which bytes each frame carries is rtp-coll.c's geometry.
 */
#define _GNU_SOURCE /* process_vm_writev */
#include "rtp-tcp.h"

#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>

static void tx_pump(struct tcp_req *r);

uint64_t rtp__tcp_now_ms(struct tcp *c) {
  return uv_now(&c->loop);
}

const char *rtp__tcp_peer_addr(struct tcp *c, int rank) {
  struct rc_link *l = rank >= 0 && rank < c->size ? c->links[rank] : NULL;
  return l ? l->addr : "?";
}

/* ---- groups ------------------------------------------------------------------------ */

static int group_add(struct tcp *c, uint64_t id, const int *members, int n) {
  struct rc_group *g = calloc(1, sizeof(*g));
  uint8_t *m = g ? calloc((size_t)c->size, 1) : NULL;
  if (!m) {
    free(g);
    return rtp__error(RTP_ENOMEM, "comm rank %d: out of memory for a group", c->rank);
  }
  for (int i = 0; i < n; i++) m[members[i]] = 1;
  g->id = id;
  g->member = m;
  pthread_mutex_lock(&c->gmu);
  g->next = c->groups;
  __atomic_store_n(&c->groups, g, __ATOMIC_RELEASE); /* the comm thread reads without gmu */
  pthread_mutex_unlock(&c->gmu);
  return RTP_OK;
}

bool rtp__tcp_group_has(struct tcp *c, uint64_t group, int rank) {
  for (struct rc_group *g = __atomic_load_n(&c->groups, __ATOMIC_ACQUIRE); g; g = g->next)
    if (g->id == group) return rank >= 0 && rank < c->size && g->member[rank];
  return false;
}

/* ---- failure ------------------------------------------------------------------------- */

/*
 * Fails the job: records it with the front end (unless it failed already: then that
 * reason is told), logs it, tells every connected peer (ABORT, best effort, without
 * blocking), closes every connection and fails every pending request.
 */
void rtp__tcp_comm_fail(struct tcp *c, int status, const char *fmt, ...) {
  if (c->loop_failed) return;
  char msg[RC_MSG];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  c->loop_failed = rtp__comm_world_fail(c->w, status, msg, &c->fail_msg);
  pthread_mutex_lock(&c->qmu);
  c->init_failed = true;
  pthread_cond_broadcast(&c->qcv);
  pthread_mutex_unlock(&c->qmu);
  if (!c->shutting_down) RTP_LOG_ERROR("comm rank %d: %s", c->rank, c->fail_msg);
  /* The ABORT goes behind the data already queued; each connection closes when its
     ABORT is written, or a little later if the peer does not read any more. */
  struct rc_hdr h = {.type = RC_T_ABORT, .len = strlen(c->fail_msg)};
  uint64_t grace = (uint64_t)(c->params.timeout_ms < 1000 ? c->params.timeout_ms : 1000);
  for (struct rc_link *l = c->links_all, *nx; l; l = nx) {
    nx = l->next;
    if (l->state == LS_UP && !l->bye_rx && !l->aborting) {
      l->aborting = true; /* reads are discarded from now on */
      rtp__tcp_link_set_lowat(l);
      l->close_at = rtp__tcp_now_ms(c) + grace;
      if (rtp__tcp_send_ctrl(l, &h, c->fail_msg) < 0) rtp__tcp_link_close(l);
    } else if (!l->aborting) {
      rtp__tcp_link_close(l);
    }
  }
  for (struct tcp_req *r = c->active, *nx; r; r = nx) {
    nx = r->anext;
    if (!r->fail) {
      r->fail = c->loop_failed;
      snprintf(r->fail_msg, sizeof(r->fail_msg), "%s", c->fail_msg);
    }
    rtp__tcp_req_check(r);
  }
}

/* Fails one request only (a local mistake that leaves the protocol intact). */
static void req_fail(struct tcp_req *r, int status, const char *fmt, ...) RTP_PRINTF(3, 4);
static void req_fail(struct tcp_req *r, int status, const char *fmt, ...) {
  if (r->fail) return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(r->fail_msg, sizeof(r->fail_msg), fmt, ap);
  va_end(ap);
  r->fail = status;
  rtp__tcp_req_check(r);
}

/* ---- requests ------------------------------------------------------------------------ */

void rtp__tcp_leg_unlink(struct rc_leg *g) {
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
  if (l->bye_rx && !l->tx_legs && !l->rx_legs) rtp__tcp_link_close(l); /* flushed: let it go */
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
static void publish_done(struct tcp *c) {
  struct tcp_req *r = c->done_head;
  c->done_head = NULL;
  for (struct tcp_req *nx; r; r = nx) {
    nx = r->anext;
    r->anext = NULL;
    rtp__comm_req_done(r->req, r->fail, r->fail ? r->fail_msg : NULL); /* hands off now */
  }
}

static void on_idle(uv_idle_t *h) {
  struct tcp *c = h->data;
  publish_done(c);
  uv_idle_stop(h);
}

static void req_complete(struct tcp_req *r) {
  struct tcp *c = r->comm;
  r->finished = true;
  rtp__tcp_leg_unlink(&r->tx);
  rtp__tcp_leg_unlink(&r->rx);
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

void rtp__tcp_req_check(struct tcp_req *r) {
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

/* Where frame k of a leg lies in the user's memory (rtp-coll.c's geometry). */
static uint8_t *frame_at(const struct tcp_req *r, bool tx, uint64_t k, uint64_t *len,
                         bool *reduce) {
  const struct rtp_comm_op *op = r->op;
  uint64_t off;
  rtp__coll_frame(op, &r->plan, tx, k, &off, len, reduce);
  uint8_t *base = tx && op->kind == RTP_COMM_K_P2P ? (uint8_t *)op->sbuf : op->buf;
  return base + off;
}

static void data_write_cb(uv_write_t *w, int status) {
  struct rc_wslot *s = (struct rc_wslot *)w;
  struct rc_leg *g = s->leg;
  struct tcp_req *r = g->req;
  struct tcp *c = r->comm;
  g->inflight--;
  if (status < 0) {
    if (status != UV_ECANCELED)
      rtp__tcp_comm_fail(c, RTP_EPEER, "lost rank %d (%s): %s", g->peer,
                         g->link ? g->link->addr : "?", uv_strerror(status));
    else if (!r->fail) {
      r->fail = c->loop_failed ? c->loop_failed : RTP_ECOMM;
      snprintf(r->fail_msg, sizeof(r->fail_msg), "%s",
               c->fail_msg ? c->fail_msg : "write cancelled");
    }
    rtp__tcp_req_check(r);
    return;
  }
  g->done++;
  r->last_progress = rtp__tcp_now_ms(c);
  tx_pump(r);
  rtp__tcp_req_check(r);
}

/* Whether the receiver of frame k adds it into its buffer (a reduce-scatter step): such
 * frames need the receiver's scratch and always travel over TCP. */
static bool rx_reduces(const struct tcp_req *r, uint64_t k) {
  if (r->op->kind == RTP_COMM_K_REDUCE_SCATTER) return true;
  return r->op->kind == RTP_COMM_K_ALLREDUCE && (int)(k / r->plan.nseg) < r->op->size - 1;
}

/* Frame k's payload straight into the receiver's buffer, where its own receive would put
 * it (both sides lay out the buffer alike). 0, or a negative errno; then the link falls
 * back to TCP for good (e.g. EPERM where ptrace is restricted). */
static int direct_write(struct rc_leg *g, const uint8_t *src, uint64_t len) {
  const struct rtp_comm_op *op = g->req->op;
  const uint8_t *base = op->kind == RTP_COMM_K_P2P ? op->sbuf : op->buf;
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

static void tx_pump(struct tcp_req *r) {
  struct tcp *c = r->comm;
  struct rc_leg *g = &r->tx;
  if (g->peer < 0 || !g->ready || r->fail || c->loop_failed) return;
  struct rc_link *l = g->link;
  if (!l || l->state != LS_UP) return;
  while (g->next_k < g->nframes && g->inflight < RC_WINDOW) {
    uint64_t k = g->next_k, len;
    if (g->dep >= 0 && k >= (uint64_t)g->dep && r->rx.next_k <= k - (uint64_t)g->dep) break;
    bool reduce;
    uint8_t *ptr = frame_at(r, true, k, &len, &reduce);
    struct rc_wslot *s = &g->slot[g->slot_i++ % RC_WINDOW];
    s->leg = g;
    bool direct = g->direct && l->direct && len && !rx_reduces(r, k);
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
                       .kind = (uint8_t)r->op->kind,
                       .cls = (uint8_t)r->cls,
                       .seq = r->op->seq,
                       .len = len,
                       .total = k,
                       .group = r->op->group};
    rtp__tcp_hdr_put(s->hdr, &h);
    uv_buf_t b[2] = {uv_buf_init((char *)s->hdr, RC_HDR_SIZE), uv_buf_init((char *)ptr, 0)};
    b[1].len = (size_t)len;
    int rc = uv_write(&s->w, (uv_stream_t *)&l->tcp, b, len && !direct ? 2 : 1, data_write_cb);
    if (rc < 0) {
      rtp__tcp_comm_fail(c, RTP_ECOMM, "writing to rank %d failed: %s", g->peer,
                         uv_strerror(rc));
      return;
    }
    g->next_k++;
    g->inflight++;
    l->last_tx = rtp__tcp_now_ms(c);
  }
}

/* The RTR's arg: what else both ends must agree on. */
static uint64_t rtr_arg(const struct rtp_comm_op *op) {
  return op->kind == RTP_COMM_K_BROADCAST ? (uint64_t)op->root : op->esize;
}

/* Checks the receiver's RTR against what this rank is about to send. */
static bool rtr_match(struct tcp *c, struct tcp_req *r, const struct rc_rtr *t) {
  const struct rtp_comm_op *op = r->op;
  int peer = r->tx.peer;
  const char *what = r->cls == RC_COLL ? "collective" : "message";
  if (t->kind != op->kind) {
    rtp__tcp_comm_fail(c, RTP_EPEER,
                       "rank %d (%s) called %s as %s #%" PRIu64 " where this rank called %s",
                       peer, rtp__tcp_peer_addr(c, peer), rtp__comm_kind_name(t->kind), what,
                       op->seq, rtp__comm_kind_name(op->kind));
    return false;
  }
  if (t->total != r->tx.total || t->arg != rtr_arg(op)) {
    rtp__tcp_comm_fail(c, RTP_EPEER,
                       "%s #%" PRIu64 ": rank %d (%s) expects %" PRIu64 " bytes (arg %" PRIu64
                       ") from this rank, which sends %" PRIu64 " (arg %" PRIu64
                       "): the ranks disagree on sizes, counts or root",
                       rtp__comm_kind_name(op->kind), op->seq, peer,
                       rtp__tcp_peer_addr(c, peer), t->total, t->arg, r->tx.total, rtr_arg(op));
    return false;
  }
  r->tx.ready = true;
  r->tx.direct = r->tx.link && r->tx.link->direct ? t->addr : 0;
  return true;
}

/* The connection a leg goes over, or NULL after failing r. */
static struct rc_link *leg_connect(struct tcp *c, struct tcp_req *r, struct rc_leg *g) {
  struct rc_link *l = c->links[g->peer];
  if (!l || l->state != LS_UP || l->bye_rx) {
    req_fail(r, RTP_ECOMM, "rank %d is not connected (it left or failed)", g->peer);
    return NULL;
  }
  leg_link(g, l);
  return l;
}

/* Whether r's send is empty and its receiver, which has left (BYE), was ready for it:
 * then the send is done (ready, no frame) without the connection. Consumes the frame. */
static bool rtr_left_behind(struct tcp *c, struct tcp_req *r) {
  const struct rtp_comm_op *op = r->op;
  struct rc_link *l = c->links[r->tx.peer];
  if (r->tx.nframes || (l && !l->bye_rx)) return false;
  struct rc_rtr *table = l ? l->rtrs : NULL;
  int n = l ? l->n_rtrs : 0;
  for (int i = 0; i < n; i++)
    if (table[i].group == op->group && table[i].cls == r->cls && table[i].seq == op->seq) {
      struct rc_rtr t = table[i];
      table[i] = table[--l->n_rtrs];
      return rtr_match(c, r, &t);
    }
  for (int i = 0; !l && i < c->n_left_rtrs; i++) {
    struct rc_left_rtr *e = &c->left_rtrs[i];
    if (e->rank == r->tx.peer && e->t.group == op->group && e->t.cls == r->cls &&
        e->t.seq == op->seq) {
      struct rc_rtr t = e->t;
      c->left_rtrs[i] = c->left_rtrs[--c->n_left_rtrs];
      return rtr_match(c, r, &t);
    }
  }
  return false;
}

static void req_start(struct tcp *c, struct tcp_req *r) {
  const struct rtp_comm_op *op = r->op;
  r->anext = c->active;
  r->aprev = NULL;
  if (c->active) c->active->aprev = r;
  c->active = r;
  r->last_progress = rtp__tcp_now_ms(c);
  if (c->loop_failed) {
    r->fail = c->loop_failed;
    snprintf(r->fail_msg, sizeof(r->fail_msg), "%s", c->fail_msg);
    rtp__tcp_req_check(r);
    return;
  }
  rtp__coll_plan(op, RC_SEGMENT, RC_P2P_FRAME, &r->plan);
  r->tx.nframes = r->plan.nframes[0];
  r->rx.nframes = r->plan.nframes[1];
  r->tx.total = r->plan.total[0];
  r->rx.total = r->plan.total[1];
  r->tx.dep = r->plan.dep;
  /* receive side: register, then tell the sender */
  struct rc_link *l;
  if (r->rx.peer >= 0) {
    if (!(l = leg_connect(c, r, &r->rx))) return;
    struct rc_hdr h = {.type = RC_T_RTR,
                       .kind = (uint8_t)op->kind,
                       .cls = (uint8_t)r->cls,
                       .seq = op->rx_seq,
                       .total = r->rx.total,
                       .arg = rtr_arg(op),
                       .addr = l->direct ? (uint64_t)(uintptr_t)op->buf : 0,
                       .group = op->group};
    r->rx.offered = l->direct;
    int rc = rtp__tcp_send_ctrl(l, &h, NULL);
    if (rc < 0) {
      rtp__tcp_comm_fail(c, RTP_ECOMM, "sending to rank %d failed: %s", r->rx.peer,
                         uv_strerror(rc));
      return;
    }
  }
  if (r->tx.peer >= 0 && !rtr_left_behind(c, r)) {
    if (!(l = leg_connect(c, r, &r->tx))) return;
    for (int i = 0; i < l->n_rtrs; i++) {
      struct rc_rtr *t = &l->rtrs[i];
      if (t->group == op->group && t->cls == r->cls && t->seq == op->seq) {
        struct rc_rtr copy = *t;
        l->rtrs[i] = l->rtrs[--l->n_rtrs];
        if (!rtr_match(c, r, &copy)) return;
        break;
      }
    }
  }
  tx_pump(r);
  rtp__tcp_req_check(r);
}

void rtp__tcp_on_rtr(struct rc_link *l, const struct rc_hdr *h) {
  struct tcp *c = l->comm;
  struct rc_rtr t = {.kind = h->kind,
                     .cls = h->cls,
                     .group = h->group,
                     .seq = h->seq,
                     .total = h->total,
                     .arg = h->arg,
                     .addr = h->addr};
  for (struct rc_leg *g = l->tx_legs; g; g = g->next) {
    struct tcp_req *r = g->req;
    if (r->op->group == h->group && r->cls == h->cls && r->op->seq == h->seq) {
      if (g->ready) return rtp__tcp_protocol_error(l, "duplicate ready-to-receive");
      if (rtr_match(c, r, &t)) {
        tx_pump(r);
        rtp__tcp_req_check(r);
      }
      return;
    }
  }
  for (int i = 0; i < l->n_rtrs; i++)
    if (l->rtrs[i].group == t.group && l->rtrs[i].cls == t.cls && l->rtrs[i].seq == t.seq)
      return rtp__tcp_protocol_error(l, "duplicate ready-to-receive");
  if (l->n_rtrs == l->cap_rtrs)
    return rtp__tcp_protocol_error(l, "too many ready-to-receive frames");
  l->rtrs[l->n_rtrs++] = t;
}

/* DATA and DONE: the frame this leg expects next. DONE says the sender already wrote the
 * payload into this rank's buffer, which only a same-host peer offered direct writes
 * may do, and never for a frame this rank reduces. */
void rtp__tcp_on_data_hdr(struct rc_link *l, const struct rc_hdr *h) {
  struct rc_leg *g = l->rx_legs;
  for (; g; g = g->next)
    if (g->req->op->group == h->group && g->req->cls == h->cls && g->req->op->rx_seq == h->seq)
      break;
  if (!g)
    return rtp__tcp_protocol_error(l, "data for %s #%" PRIu64 " that was not requested",
                                   rtp__comm_kind_name(h->kind), h->seq);
  struct tcp_req *r = g->req;
  const char *kind = rtp__comm_kind_name(r->op->kind);
  if (h->kind != r->op->kind)
    return rtp__tcp_protocol_error(l, "data of %s #%" PRIu64 " for %s",
                                   rtp__comm_kind_name(h->kind), h->seq, kind);
  uint64_t k = g->next_k, len;
  if (k >= g->nframes || h->total != k)
    return rtp__tcp_protocol_error(l,
                                   "frame %" PRIu64 " of %s #%" PRIu64
                                   " out of sequence (%" PRIu64 " of %" PRIu64 " expected)",
                                   h->total, kind, h->seq, k, g->nframes);
  bool reduce;
  uint8_t *ptr = frame_at(r, false, k, &len, &reduce);
  if (h->len != len)
    return rtp__tcp_protocol_error(
        l, "frame of %" PRIu64 " bytes where %" PRIu64 " were expected", h->len, len);
  l->rx_leg = g;
  l->rx_dst = ptr;
  l->rx_len = len;
  l->rx_reduce = reduce;
  if (h->type == RC_T_DONE) {
    if (!l->direct || reduce || len == 0)
      return rtp__tcp_protocol_error(l, "a direct write that was not offered");
    l->rx_reduce = false;
    return rtp__tcp_on_payload(l);
  }
  if (len == 0) {
    l->rstate = R_PAYLOAD;
    rtp__tcp_reader_step(l);
    return;
  }
  if (reduce && len > l->scratch_cap) return rtp__tcp_protocol_error(l, "segment too large");
  rtp__tcp_reader_expect(l, R_PAYLOAD, reduce ? (void *)l->scratch : ptr, (size_t)len);
}

void rtp__tcp_on_payload(struct rc_link *l) {
  struct tcp *c = l->comm;
  struct rc_leg *g = l->rx_leg;
  struct tcp_req *r = g->req;
  if (l->rx_reduce) {
    float *dst = (float *)l->rx_dst;
    const float *src = l->scratch;
    size_t n = (size_t)(l->rx_len / sizeof(float));
    for (size_t i = 0; i < n; i++) dst[i] += src[i];
  }
  l->rx_leg = NULL;
  rtp__tcp_reader_expect(l, R_HDR, l->hdrbuf, RC_HDR_SIZE);
  g->next_k++;
  r->last_progress = rtp__tcp_now_ms(c);
  tx_pump(r);
  rtp__tcp_req_check(r);
}

/* ---- the loop: readiness, timer, shutdown ---------------------------------------------- */

void rtp__tcp_set_ready(struct tcp *c) {
  pthread_mutex_lock(&c->qmu);
  c->ready = true;
  pthread_cond_broadcast(&c->qcv);
  pthread_mutex_unlock(&c->qmu);
}

static void finalize_closed(uv_handle_t *h) {
  (void)h;
}

void rtp__tcp_maybe_finalize(struct tcp *c) {
  if (!c->shutting_down || c->finalized || c->n_links_alive > 0) return;
  c->finalized = true;
  publish_done(c);
  uv_close((uv_handle_t *)&c->idle, finalize_closed);
  if (c->listener_open) uv_close((uv_handle_t *)&c->listener, finalize_closed);
  uv_close((uv_handle_t *)&c->timer, finalize_closed);
  uv_close((uv_handle_t *)&c->async, finalize_closed);
}

static void shutdown_begin(struct tcp *c) {
  if (c->shutting_down) return;
  c->shutting_down = true;
  c->shutdown_deadline = rtp__tcp_now_ms(c) +
                         (uint64_t)(c->params.timeout_ms < 5000 ? c->params.timeout_ms : 5000);
  for (struct tcp_req *r = c->active, *nx; r; r = nx) {
    nx = r->anext;
    if (!r->fail) {
      r->fail = RTP_ESTATE;
      snprintf(r->fail_msg, sizeof(r->fail_msg), "communicator freed with the request pending");
    }
    rtp__tcp_req_check(r);
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
      if (rtp__tcp_send_ctrl(l, &h, NULL) < 0) rtp__tcp_link_close(l);
    } else if (!l->aborting) {
      rtp__tcp_link_close(l);
    }
  }
  rtp__tcp_maybe_finalize(c);
}

static void on_async(uv_async_t *a) {
  struct tcp *c = a->data;
  pthread_mutex_lock(&c->qmu);
  struct tcp_req *q = c->q_head;
  c->q_head = c->q_tail = NULL;
  bool stop = c->stopping, told = c->fail_told;
  c->fail_told = false;
  pthread_mutex_unlock(&c->qmu);
  while (q) {
    struct tcp_req *nx = q->qnext;
    req_start(c, q);
    q = nx;
  }
  if (told) { /* the front end recorded the failure: tell it */
    const char *msg;
    int st = rtp__comm_world_fail(c->w, 0, NULL, &msg);
    rtp__tcp_comm_fail(c, st, "%s", msg);
  }
  if (stop) shutdown_begin(c);
}

/* "allreduce #7", with the group when it is not the world's. */
static void op_name(const struct rtp_comm_op *op, char *out, size_t n) {
  if (op->group)
    snprintf(out, n, "%s #%" PRIu64 " of group %016" PRIx64, rtp__comm_kind_name(op->kind),
             op->seq, op->group);
  else
    snprintf(out, n, "%s #%" PRIu64, rtp__comm_kind_name(op->kind), op->seq);
}

static void check_progress(struct tcp *c, uint64_t now) {
  for (struct tcp_req *r = c->active; r; r = r->anext) {
    if (r->fail || now - r->last_progress <= (uint64_t)c->params.timeout_ms) continue;
    int peer = r->rx.peer >= 0 && r->rx.next_k < r->rx.nframes ? r->rx.peer : r->tx.peer;
    char what[96];
    op_name(r->op, what, sizeof(what));
    rtp__tcp_comm_fail(c, RTP_ETIMEDOUT,
                       "%s made no progress for %d ms: waiting for rank %d (%s) "
                       "(did it post the same operations?)",
                       what, c->params.timeout_ms, peer, rtp__tcp_peer_addr(c, peer));
    return;
  }
}

static void on_tick(uv_timer_t *t) {
  struct tcp *c = t->data;
  uint64_t now = rtp__tcp_now_ms(c);
  uint64_t timeout = (uint64_t)c->params.timeout_ms;
  for (struct rc_link *l = c->links_all, *nx; l; l = nx) {
    nx = l->next;
    if (l->aborting && now > l->close_at) rtp__tcp_link_close(l);
  }
  if (c->shutting_down) {
    if (now > c->shutdown_deadline)
      for (struct rc_link *l = c->links_all, *nx; l; l = nx) {
        nx = l->next;
        rtp__tcp_link_close(l);
      }
    return;
  }
  if (c->loop_failed) return;
  if (!c->ready && now > c->init_deadline) {
    char missing[128] = "", shed[128] = "";
    size_t off = 0;
    for (int q = 0; q < c->size && off < sizeof(missing) - 12; q++)
      if (q != c->rank && !c->links[q])
        off += (size_t)snprintf(missing + off, sizeof(missing) - off, " %d", q);
    for (struct rc_link *l = c->links_all; l && !shed[0]; l = l->next)
      if (l->connector && l->refusals)
        snprintf(shed, sizeof(shed),
                 "; rank %d closed %d handshakes unanswered (flooded with connections by "
                 "strangers? see its log)",
                 l->rank, l->refusals);
    rtp__tcp_comm_fail(
        c, RTP_ETIMEDOUT,
        "rendezvous timed out after %d ms (master %s); not connected to rank(s)%s%s%s",
        c->params.timeout_ms, c->master_str, missing,
        c->rank == 0 ? "" : " (or rank 0 still waits for others)", shed);
    return;
  }
  for (struct rc_link *l = c->links_all, *nx; l; l = nx) {
    nx = l->next;
    if (l->state == LS_HANDSHAKE && !l->connector && now > l->deadline) {
      rtp__tcp_shed(l, "handshake timed out");
    } else if (l->state == LS_HANDSHAKE && l->connector && now > l->deadline) {
      rtp__tcp_comm_fail(c, RTP_ETIMEDOUT, "handshake with rank %d (%s) timed out", l->rank,
                         l->addr);
      return;
    } else if (l->state == LS_UP) {
      if (now - l->last_rx > timeout) {
        rtp__comm_blame(c->w, l->rank, "silent");
        rtp__tcp_comm_fail(c, RTP_ETIMEDOUT,
                           "rank %d (%s) silent for %" PRIu64 " ms (timeout %d ms)", l->rank,
                           l->addr, now - l->last_rx, c->params.timeout_ms);
        return;
      }
      if (now - l->last_tx >= timeout / 4 && !l->hb_pending) {
        struct rc_hdr h = {.type = RC_T_HEARTBEAT};
        if (rtp__tcp_send_ctrl(l, &h, NULL) == 0) l->hb_pending = true;
      }
    }
  }
  check_progress(c, now);
}

static void *comm_thread(void *arg) {
  struct tcp *c = arg;
  c->init_deadline = rtp__tcp_now_ms(c) + (uint64_t)c->params.timeout_ms;
  uint64_t tick = (uint64_t)c->params.timeout_ms / 8;
  tick = tick < 10 ? 10 : tick > 500 ? 500 : tick;
  uv_timer_start(&c->timer, on_tick, tick, tick);
  rtp__tcp_loop_start(c);
  uv_run(&c->loop, UV_RUN_DEFAULT);
  return NULL;
}

/* ---- the transport interface ---------------------------------------------------------- */

static void tcp_submit(struct rtp_transport *t, struct rtp_comm_req *req) {
  struct tcp *c = t->impl;
  struct tcp_req *r = &c->reqs[req->index];
  memset(r, 0, sizeof(*r)); /* its last use ended before the waiter took req back */
  r->req = req;
  r->op = &req->op;
  r->comm = c;
  r->cls = req->op.kind == RTP_COMM_K_P2P ? RC_P2P : RC_COLL;
  r->tx.peer = req->op.tx_peer;
  r->rx.peer = req->op.rx_peer;
  r->tx.req = r->rx.req = r;
  r->tx.tx = true;
  pthread_mutex_lock(&c->qmu);
  if (c->q_tail)
    c->q_tail->qnext = r;
  else
    c->q_head = r;
  c->q_tail = r;
  pthread_mutex_unlock(&c->qmu);
  uv_async_send(&c->async);
}

static int tcp_group_add(struct rtp_transport *t, uint64_t id, const int *members, int n) {
  return group_add(t->impl, id, members, n);
}

static void tcp_fail(struct rtp_transport *t) {
  struct tcp *c = t->impl;
  pthread_mutex_lock(&c->qmu);
  c->fail_told = true;
  bool started = c->thread_started;
  pthread_mutex_unlock(&c->qmu);
  if (started) uv_async_send(&c->async);
}

static void tcp_destroy(struct tcp *c) {
  if (c->thread_started) {
    pthread_mutex_lock(&c->qmu);
    c->stopping = true;
    pthread_mutex_unlock(&c->qmu);
    uv_async_send(&c->async);
    pthread_join(c->thread, NULL);
    uv_loop_close(&c->loop);
  }
  for (struct rc_group *g = c->groups, *nx; g; g = nx) {
    nx = g->next;
    free(g->member);
    free(g);
  }
  pthread_mutex_destroy(&c->qmu);
  pthread_cond_destroy(&c->qcv);
  pthread_mutex_destroy(&c->gmu);
  free(c->reqs);
  free(c->links);
  free(c->left_rtrs);
  free(c->peers);
  free(c);
}

static void tcp_free(struct rtp_transport *t) {
  tcp_destroy(t->impl);
  free(t);
}

/* Rank 0 listens at the master address; the others registered theirs. Written by the
 * comm thread before the rendezvous completes, read after. */
static void tcp_host(struct rtp_transport *t, int rank, char *out, size_t n) {
  struct tcp *c = t->impl;
  if (rank == 0)
    rtp__tcp_sa_ip(&c->master, out, n);
  else
    snprintf(out, n, "%s", c->peers[rank].addr);
}

static const struct rtp_transport_i tcp_i = {.name = "tcp",
                                             .submit = tcp_submit,
                                             .group_add = tcp_group_add,
                                             .host = tcp_host,
                                             .fail = tcp_fail,
                                             .free = tcp_free};

/* The loop and its comm thread; then waits for the rendezvous. */
static int tcp_start(struct tcp *c) {
  int rc = uv_loop_init(&c->loop);
  if (rc < 0) return rtp__error(RTP_ECOMM, "uv_loop_init: %s", uv_strerror(rc));
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
    return rtp__error(RTP_ECOMM, "cannot start the comm thread");
  }
  pthread_mutex_lock(&c->qmu);
  c->thread_started = true;
  while (!c->ready && !c->init_failed) pthread_cond_wait(&c->qcv, &c->qmu);
  bool failed = c->init_failed;
  pthread_mutex_unlock(&c->qmu);
  if (!failed) return RTP_OK;
  const char *msg;
  int st = rtp__comm_world_fail(c->w, 0, NULL, &msg);
  return rtp__error(st, "%s", msg);
}

int rtp__tcp_new(struct rtp_comm_world *w, struct rtp_transport **out) {
  const struct rtp_comm_params *p = rtp__comm_world_params(w);
  struct tcp *c = calloc(1, sizeof(*c));
  struct rtp_transport *t = malloc(sizeof(*t));
  if (!c || !t) {
    free(c);
    free(t);
    return rtp__error(RTP_ENOMEM, "rtp_comm_init: out of memory");
  }
  c->w = w;
  c->rank = p->rank;
  c->size = p->world_size;
  c->params = *p;
  pthread_mutex_init(&c->qmu, NULL);
  pthread_cond_init(&c->qcv, NULL);
  pthread_mutex_init(&c->gmu, NULL);
  c->reqs = calloc((size_t)p->max_requests, sizeof(*c->reqs));
  c->links = calloc((size_t)c->size, sizeof(*c->links));
  c->peers = calloc((size_t)c->size, sizeof(*c->peers));
  int *all = malloc(sizeof(int) * (size_t)c->size);
  int st = !c->reqs || !c->links || !c->peers || !all
               ? rtp__error(RTP_ENOMEM, "rtp_comm_init: out of memory")
               : RTP_OK;
  for (int q = 0; !st && q < c->size; q++) all[q] = q;
  if (!st) st = group_add(c, 0, all, c->size); /* the world */
  free(all);
  if (!st) {
    c->host_key = rtp__tcp_host_key();
    st = tcp_start(c);
  }
  if (st) {
    char msg[RC_MSG];
    snprintf(msg, sizeof(msg), "%s", rtp_last_error());
    tcp_destroy(c);
    free(t);
    return rtp__error(st, "%s", msg);
  }
  *t = (struct rtp_transport){&tcp_i, c};
  *out = t;
  return RTP_OK;
}
