/* rtp-tcp-conn.c - the tcp transport's connections: listening and connecting (with
 * retries: ranks start in any order), the mutual HMAC handshake, the rendezvous through
 * rank 0 (REGISTER, PEERS), reading frames off a socket and dispatching them, and closing.
 * Everything here runs on the comm thread. docs/transport.md, "Rendezvous and
 * connections" and "Handshake". */
#include "rtp-tcp.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <netinet/in.h>
#include <unistd.h>

#include <openssl/crypto.h>

static void link_up(struct rc_link *l);
static void on_connect(uv_connect_t *req, int status);
static void connect_to(struct tcp *c, int rank, const struct sockaddr_storage *sa);

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
  if (l->aborting && status == 0 && rtp__tcp_get32(s->buf) == RC_FRAME_MAGIC &&
      s->buf[5] == RC_T_ABORT && l->state != LS_CLOSING)
    uv_shutdown(&l->shut, (uv_stream_t *)&l->tcp, shutdown_cb);
}

/* Queues a control frame with an optional payload (<= RC_MSG + 96 bytes). */
int rtp__tcp_send_ctrl(struct rc_link *l, const struct rc_hdr *h, const void *payload) {
  if (l->state == LS_CLOSING) return UV_ECANCELED;
  struct rc_cslot *s = l->cfree;
  if (!s) return UV_ENOBUFS;
  RTP_ASSERT(h->len <= sizeof(s->buf) - RC_HDR_SIZE);
  l->cfree = s->next;
  s->link = l;
  s->heartbeat = h->type == RC_T_HEARTBEAT;
  rtp__tcp_hdr_put(s->buf, h);
  if (h->len) memcpy(s->buf + RC_HDR_SIZE, payload, h->len);
  uv_buf_t b = uv_buf_init((char *)s->buf, (unsigned)(RC_HDR_SIZE + h->len));
  int rc = uv_write(&s->w, (uv_stream_t *)&l->tcp, &b, 1, cslot_cb);
  if (rc < 0) {
    s->next = l->cfree;
    l->cfree = s;
    return rc;
  }
  l->last_tx = rtp__tcp_now_ms(l->comm);
  return 0;
}

static void hs_write_cb(uv_write_t *w, int status) {
  (void)w;
  (void)status; /* a failed write shows as the connection's error or close */
}

/* Writes n bytes of the handshake, from l->hs (which outlives the write): write k of the
 * two each side makes. */
static int hs_write(struct rc_link *l, int k, size_t offs, size_t n) {
  uv_buf_t b = uv_buf_init((char *)l->hs + offs, (unsigned)n);
  return uv_write(&l->hs_w[k], (uv_stream_t *)&l->tcp, &b, 1, hs_write_cb);
}

static void link_free(struct rc_link *l) {
  struct tcp *c = l->comm;
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
  rtp__tcp_maybe_finalize(c);
}

static void link_handle_closed(uv_handle_t *h) {
  struct rc_link *l = h->data;
  if (h == (uv_handle_t *)&l->tcp) l->tcp_open = false;
  if (--l->nhandles == 0) link_free(l);
}

void rtp__tcp_link_close(struct rc_link *l) {
  struct tcp *c = l->comm;
  if (l->state == LS_CLOSING) return;
  l->aborting = false;
  l->state = LS_CLOSING;
  if (l->pending) {
    l->pending = false;
    c->n_pending--;
  }
  if (l->rank >= 0 && l->rank < c->size && c->links[l->rank] == l) {
    c->links[l->rank] = NULL;
    c->n_up--;
  }
  if (l->bye_rx && l->n_rtrs) { /* the peer left; what it was ready for may still come */
    struct rc_left_rtr *a =
        realloc(c->left_rtrs, sizeof(*a) * (size_t)(c->n_left_rtrs + l->n_rtrs));
    for (int i = 0; a && i < l->n_rtrs; i++)
      a[c->n_left_rtrs++] = (struct rc_left_rtr){l->rank, l->rtrs[i]};
    if (a) c->left_rtrs = a;
  }
  while (l->tx_legs) rtp__tcp_leg_unlink(l->tx_legs);
  while (l->rx_legs) {
    struct tcp_req *r = l->rx_legs->req;
    rtp__tcp_leg_unlink(l->rx_legs);
    if (r->rx.offered) rtp__tcp_req_check(r); /* it may have been waiting for this close */
  }
  if (l->tcp_open && !uv_is_closing((uv_handle_t *)&l->tcp))
    uv_close((uv_handle_t *)&l->tcp, link_handle_closed);
  if (l->has_timer && !uv_is_closing((uv_handle_t *)&l->retry))
    uv_close((uv_handle_t *)&l->retry, link_handle_closed);
}

/* A connection's control slots, RTR table and control buffer, made once it is
 * authenticated: a stranger's connection costs only the link itself. */
static int link_alloc_buffers(struct rc_link *l) {
  struct tcp *c = l->comm;
  int nslots = 2 * c->params.max_requests + 16;
  l->cslots = calloc((size_t)nslots, sizeof(*l->cslots));
  l->cap_rtrs = 2 * c->params.max_requests + 16;
  l->rtrs = calloc((size_t)l->cap_rtrs, sizeof(*l->rtrs));
  l->ctrl_cap = (size_t)c->size * RC_ADDR_REC + RC_MSG;
  l->ctrl = malloc(l->ctrl_cap);
  l->scratch_cap = RC_SEGMENT + 64;
  l->scratch = malloc(l->scratch_cap);
  if (!l->cslots || !l->rtrs || !l->ctrl || !l->scratch) return -1;
  for (int i = 0; i < nslots; i++) {
    l->cslots[i].next = l->cfree;
    l->cfree = &l->cslots[i];
  }
  return 0;
}

static struct rc_link *link_new(struct tcp *c, bool connector, int rank) {
  struct rc_link *l = calloc(1, sizeof(*l));
  if (!l) return NULL;
  l->comm = c;
  l->connector = connector;
  l->rank = rank;
  l->state = LS_HANDSHAKE;
  l->tcp.data = l;
  l->retry.data = l;
  l->next = c->links_all;
  if (c->links_all) c->links_all->prev = l;
  c->links_all = l;
  c->n_links_alive++;
  l->last_rx = l->last_tx = rtp__tcp_now_ms(c);
  l->deadline = rtp__tcp_now_ms(c) + RC_HANDSHAKE_MS;
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
void rtp__tcp_link_set_lowat(struct rc_link *l) {
  /* timeout_ms >= 1 (rtp_comm_init), so cap >= 16: 125000 / 8 bytes per ms */
  size_t cap = (size_t)l->comm->params.timeout_ms * 16;
  size_t rest = l->aborting || l->rwant <= l->rhave ? 1 : l->rwant - l->rhave;
  if (cap > RC_RCVLOWAT) cap = RC_RCVLOWAT;
  int v = (int)(rest < cap ? rest : cap);
  uv_os_fd_t fd;
  if (v == l->lowat || !l->tcp_open || uv_fileno((uv_handle_t *)&l->tcp, &fd) != 0) return;
  if (setsockopt(fd, SOL_SOCKET, SO_RCVLOWAT, &v, sizeof(v)) == 0) l->lowat = v;
}

void rtp__tcp_reader_expect(struct rc_link *l, int state, void *ptr, size_t n) {
  l->rstate = state;
  l->rptr = ptr;
  l->rwant = n;
  l->rhave = 0;
  rtp__tcp_link_set_lowat(l);
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

static void connect_retry(struct rc_link *l);

static void link_lost(struct rc_link *l, ssize_t err) {
  struct tcp *c = l->comm;
  const char *why = err == UV_EOF ? "connection closed" : uv_strerror((int)err);
  if (l->state == LS_UP && !l->bye_rx && !c->shutting_down) {
    if (!c->loop_failed) rtp__comm_blame(c->w, l->rank, "lost");
    rtp__tcp_comm_fail(c, RTP_EPEER, "lost rank %d (%s): %s", l->rank, l->addr, why);
  } else if (l->state == LS_HANDSHAKE && l->connector && !c->ready) {
    /* Closed before it answered: the acceptor sheds load (strangers' connections), so
     * knock again until the rendezvous's deadline. Closed after our proof: it refused the
     * proof. */
    if (l->rstate == R_HELLO_A) return connect_retry(l);
    rtp__tcp_comm_fail(c, RTP_EAUTH,
                       "rank %d (%s) refused this rank's proof of the job token: different "
                       "RTP_TOKEN? (see rank %d's log)",
                       l->rank, l->addr, l->rank);
  } else if (l->state == LS_HANDSHAKE && !l->connector) {
    RTP_LOG_WARN("comm rank %d: connection from %s refused: %s during the handshake", c->rank,
                 l->addr, why);
  }
  rtp__tcp_link_close(l);
}

static void on_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf) {
  struct rc_link *l = s->data;
  (void)buf;
  if (l->state == LS_CLOSING) return;
  if (l->aborting) {
    if (nread < 0) rtp__tcp_link_close(l);
    return;
  }
  if (nread < 0) {
    link_lost(l, nread);
    return;
  }
  if (nread == 0) return;
  l->last_rx = rtp__tcp_now_ms(l->comm);
  l->rhave += (size_t)nread;
  if (l->rhave == l->rwant)
    rtp__tcp_reader_step(l);
  else
    rtp__tcp_link_set_lowat(l);
}

void rtp__tcp_shed(struct rc_link *l, const char *why) {
  struct tcp *c = l->comm;
  long n = ++c->n_shed;
  while (n % 10 == 0) n /= 10;
  if (n == 1) /* a flood would fill the log: the 1st, 10th, 100th ... */
    RTP_LOG_WARN(
        "comm rank %d: connection from %s dropped: %s (%ld unproven connections "
        "dropped so far)",
        c->rank, l->addr, why, c->n_shed);
  rtp__tcp_link_close(l);
}

void rtp__tcp_refuse(struct rc_link *l, const char *why) {
  RTP_LOG_WARN("comm rank %d: connection from %s refused: %s", l->comm->rank, l->addr, why);
  rtp__tcp_link_close(l);
}

void rtp__tcp_protocol_error(struct rc_link *l, const char *fmt, ...) {
  char msg[RC_MSG];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  rtp__tcp_comm_fail(l->comm, RTP_EFORMAT, "protocol error from rank %d (%s): %s", l->rank,
                     l->addr, msg);
  rtp__tcp_link_close(l);
}

/* Direct writes need both sides to offer them from the same host and namespaces. The
 * hello is covered by the handshake's MACs, so no one but the peer can claim this. */
static void hello_note_peer(struct rc_link *l, const uint8_t *p) {
  uint64_t key = rtp__tcp_get64(p + 56);
  l->direct = l->comm->host_key && (p[5] & RC_HELLO_DIRECT) && key == l->comm->host_key;
  l->peer_pid = (int)rtp__tcp_get32(p + 64);
}

/* The failures remembered for address a, made (or the stalest entry reused) if asked. */
static struct rc_source *source_of(struct tcp *c, const char *a, bool make) {
  struct rc_source *oldest = &c->sources[0];
  uint64_t now = rtp__tcp_now_ms(c);
  for (int i = 0; i < RC_SOURCES; i++) {
    struct rc_source *s = &c->sources[i];
    if (s->addr[0] && now - s->since > RC_FAILS_WINDOW_MS) s->addr[0] = 0; /* forgiven */
    if (s->addr[0] && strcmp(s->addr, a) == 0) return s;
    if (!s->addr[0] || s->since < oldest->since) oldest = s;
  }
  if (!make) return NULL;
  snprintf(oldest->addr, sizeof(oldest->addr), "%s", a);
  oldest->fails = 0;
  oldest->since = now;
  return oldest;
}

/* Refuses an accepted connection whose proof of the token was wrong, counting it against
 * its address: online guessing runs into RC_FAILS_MAX. */
static void refuse_guess(struct rc_link *l, const char *why) {
  source_of(l->comm, l->src, true)->fails++;
  rtp__tcp_refuse(l, why);
}

static void refusal_sent(uv_write_t *w, int status) {
  (void)status;
  rtp__tcp_link_close(((struct rc_link *)w->handle->data));
}

/* The acceptor has HELLO_c: answers with its own hello (or a refusal that says why), and
 * waits for the connector's proof. It proves nothing itself before that. */
static void hs_acceptor_hello_c(struct rc_link *l) {
  struct tcp *c = l->comm;
  int rank = -1, refusal = 0;
  const char *why = rtp__tcp_hello_check(l->hs, c->size, c->rank, &rank, &refusal);
  /* rank 0 hears from everyone; rank r > 0 only from higher ranks */
  if (!why && c->rank != 0 && rank < c->rank) {
    why = "unexpected rank";
    refusal = RC_REFUSE_RANK;
  }
  if (!why && c->links[rank]) {
    why = "duplicate rank";
    refusal = RC_REFUSE_DUPLICATE;
  }
  if (why && refusal) { /* hello-level facts, no secret: say which, then close */
    RTP_LOG_WARN("comm rank %d: connection from %s refused: %s", c->rank, l->addr, why);
    rtp__tcp_hello_refuse(l->hs + RC_HELLO_SIZE, refusal, (uint32_t)c->size);
    uv_read_stop((uv_stream_t *)&l->tcp);
    uv_buf_t b = uv_buf_init((char *)l->hs + RC_HELLO_SIZE, RC_HELLO_SIZE);
    if (uv_write(&l->hs_w[0], (uv_stream_t *)&l->tcp, &b, 1, refusal_sent) < 0)
      rtp__tcp_link_close(l);
    return;
  }
  if (why) return rtp__tcp_refuse(l, why);
  l->rank = rank;
  rtp__tcp_hello_fill(l->hs + RC_HELLO_SIZE, c->size, c->rank, c->host_key);
  if (hs_write(l, 0, RC_HELLO_SIZE, RC_HELLO_SIZE) < 0)
    return rtp__tcp_refuse(l, "write failed");
  rtp__tcp_reader_expect(l, R_MAC_C, l->hs + 2 * RC_HELLO_SIZE, RC_MAC_SIZE);
}

/* The acceptor has the connector's proof: checks it, then proves itself. */
static void hs_acceptor_mac_c(struct rc_link *l) {
  struct tcp *c = l->comm;
  uint8_t mac[RC_MAC_SIZE];
  rtp__tcp_hmac(c->params.token, "rtp-hs-connector", l->hs, 2 * RC_HELLO_SIZE, mac);
  if (CRYPTO_memcmp(mac, l->hs + 2 * RC_HELLO_SIZE, RC_MAC_SIZE) != 0)
    return refuse_guess(l, "authentication failed (wrong RTP_TOKEN)");
  if (c->links[l->rank]) return rtp__tcp_refuse(l, "duplicate rank");
  rtp__tcp_hmac(c->params.token, "rtp-hs-acceptor", l->hs, 2 * RC_HELLO_SIZE + RC_MAC_SIZE,
                l->hs + 2 * RC_HELLO_SIZE + RC_MAC_SIZE);
  if (hs_write(l, 1, 2 * RC_HELLO_SIZE + RC_MAC_SIZE, RC_MAC_SIZE) < 0)
    return rtp__tcp_refuse(l, "write failed");
  hello_note_peer(l, l->hs);
  link_up(l);
}

/* The connector has HELLO_a: a refusal ends the join with its reason; else it proves it
 * knows the token. */
static void hs_connector_hello_a(struct rc_link *l) {
  struct tcp *c = l->comm;
  const uint8_t *h = l->hs + RC_HELLO_SIZE;
  char reason[96];
  if (rtp__tcp_hello_refusal(h, reason, sizeof(reason)))
    return rtp__tcp_comm_fail(c, RTP_EAUTH, "rank %d (%s) refused this rank: %s", l->rank,
                              l->addr, reason);
  int rank = -1, refusal;
  const char *why = rtp__tcp_hello_check(h, c->size, c->rank, &rank, &refusal);
  if (!why && rank != l->rank) why = "answered with another rank";
  if (why)
    return rtp__tcp_comm_fail(c, RTP_EAUTH, "handshake with rank %d (%s) failed: %s", l->rank,
                              l->addr, why);
  rtp__tcp_hmac(c->params.token, "rtp-hs-connector", l->hs, 2 * RC_HELLO_SIZE,
                l->hs + 2 * RC_HELLO_SIZE);
  if (hs_write(l, 1, 2 * RC_HELLO_SIZE, RC_MAC_SIZE) < 0)
    return rtp__tcp_comm_fail(c, RTP_ECOMM, "handshake with rank %d (%s): write failed",
                              l->rank, l->addr);
  rtp__tcp_reader_expect(l, R_MAC_A, l->hs + 2 * RC_HELLO_SIZE + RC_MAC_SIZE, RC_MAC_SIZE);
}

/* The connector has the acceptor's proof. */
static void hs_connector_mac_a(struct rc_link *l) {
  struct tcp *c = l->comm;
  uint8_t mac[RC_MAC_SIZE];
  rtp__tcp_hmac(c->params.token, "rtp-hs-acceptor", l->hs, 2 * RC_HELLO_SIZE + RC_MAC_SIZE,
                mac);
  if (CRYPTO_memcmp(mac, l->hs + 2 * RC_HELLO_SIZE + RC_MAC_SIZE, RC_MAC_SIZE) != 0)
    return rtp__tcp_comm_fail(c, RTP_EAUTH,
                              "handshake with rank %d (%s) failed: authentication failed "
                              "(wrong RTP_TOKEN)",
                              l->rank, l->addr);
  hello_note_peer(l, l->hs + RC_HELLO_SIZE);
  link_up(l);
}

static void check_ready(struct tcp *c) {
  if (!c->ready && c->n_up == c->size - 1 && (c->rank != 0 || c->n_registered == c->size - 1))
    rtp__tcp_set_ready(c);
}

static void link_up(struct rc_link *l) {
  struct tcp *c = l->comm;
  if (link_alloc_buffers(l)) return rtp__tcp_comm_fail(c, RTP_ENOMEM, "out of memory");
  if (l->pending) {
    l->pending = false;
    c->n_pending--;
  }
  l->state = LS_UP;
  c->links[l->rank] = l;
  c->n_up++;
  rtp__tcp_reader_expect(l, R_HDR, l->hdrbuf, RC_HDR_SIZE);
  if (c->rank > 0 && l->rank == 0) {
    /* register where this rank listens: the bind address, or the local address of
       this connection (the interface that routes to rank 0) */
    uint8_t rec[RC_ADDR_REC] = {0};
    rtp__tcp_put32(rec, (uint32_t)c->my_port);
    if (c->have_bind) {
      rtp__tcp_sa_ip(&c->bind_sa, (char *)rec + 4, RC_ADDR_REC - 4);
    } else {
      struct sockaddr_storage ss;
      int n = sizeof(ss);
      uv_tcp_getsockname(&l->tcp, (struct sockaddr *)&ss, &n);
      rtp__tcp_sa_ip(&ss, (char *)rec + 4, RC_ADDR_REC - 4);
    }
    struct rc_hdr h = {.type = RC_T_REGISTER, .len = RC_ADDR_REC};
    if (rtp__tcp_send_ctrl(l, &h, rec) < 0)
      rtp__tcp_comm_fail(c, RTP_ECOMM, "registering with rank 0 failed");
  }
  check_ready(c);
}

/* Rank 0's table of every rank's address: this rank connects to the ranks below it, and
 * keeps every address (rtp_comm_hosts). */
static void on_peers(struct tcp *c, const uint8_t *p) {
  for (int q = 1; q < c->size; q++) {
    const uint8_t *rec = p + (size_t)q * RC_ADDR_REC;
    struct rc_peer *peer = &c->peers[q];
    memcpy(peer->addr, rec + 4, RC_ADDR_REC - 4);
    peer->addr[RC_ADDR_REC - 5] = 0;
    peer->port = (int)rtp__tcp_get32(rec);
    struct sockaddr_storage sa;
    if (rtp__tcp_parse_ip(peer->addr, peer->port, &sa) < 0) {
      rtp__tcp_comm_fail(c, RTP_EFORMAT, "rank 0 sent a bad address for rank %d", q);
      return;
    }
    if (q < c->rank) connect_to(c, q, &sa);
  }
}

static void free_write_cb(uv_write_t *w, int status) {
  (void)status;
  free(w->data);
}

static void on_ctrl(struct rc_link *l) {
  struct tcp *c = l->comm;
  struct rc_hdr h = l->hdr;
  rtp__tcp_reader_expect(l, R_HDR, l->hdrbuf, RC_HDR_SIZE);
  if (h.type == RC_T_ABORT) {
    char msg[RC_MSG];
    size_t n = h.len < RC_MSG - 1 ? h.len : RC_MSG - 1;
    memcpy(msg, l->ctrl, n);
    msg[n] = 0;
    for (size_t i = 0; i < n; i++)
      if (msg[i] < 32 || msg[i] > 126) msg[i] = '?';
    rtp__tcp_comm_fail(c, RTP_EPEER, "rank %d (%s) reported: %s", l->rank, l->addr, msg);
  } else if (h.type == RC_T_REGISTER) {
    struct rc_peer *p = &c->peers[l->rank];
    memcpy(p->addr, l->ctrl + 4, RC_ADDR_REC - 4);
    p->addr[RC_ADDR_REC - 5] = 0;
    p->port = (int)rtp__tcp_get32(l->ctrl);
    struct sockaddr_storage sa;
    if (p->registered || rtp__tcp_parse_ip(p->addr, p->port, &sa) < 0)
      return rtp__tcp_protocol_error(l, "bad registration");
    p->registered = true;
    if (++c->n_registered == c->size - 1) {
      size_t n = (size_t)c->size * RC_ADDR_REC;
      uint8_t *buf = calloc(1, n);
      if (!buf) return rtp__tcp_comm_fail(c, RTP_ENOMEM, "out of memory");
      for (int q = 1; q < c->size; q++) {
        rtp__tcp_put32(buf + (size_t)q * RC_ADDR_REC, (uint32_t)c->peers[q].port);
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
          return rtp__tcp_comm_fail(c, RTP_ENOMEM, "out of memory");
        }
        uv_write_t *w = (uv_write_t *)frame;
        uint8_t *fb = frame + sizeof(uv_write_t);
        rtp__tcp_hdr_put(fb, &ph);
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
  struct tcp *c = l->comm;
  struct rc_hdr *h = &l->hdr;
  rtp__tcp_hdr_get(l->hdrbuf, h);
  if (h->magic != RC_FRAME_MAGIC) return rtp__tcp_protocol_error(l, "bad frame magic");
  if (h->version != RC_VERSION)
    return rtp__tcp_protocol_error(l, "protocol version %d", h->version);
  switch (h->type) {
    case RC_T_DATA:
    case RC_T_DONE:
      if (h->cls > RC_COLL) return rtp__tcp_protocol_error(l, "bad class");
      if (!rtp__tcp_group_has(c, h->group, l->rank))
        return rtp__tcp_protocol_error(
            l, "data of group %016" PRIx64 ", which it does not share", h->group);
      return rtp__tcp_on_data_hdr(l, h);
    case RC_T_RTR:
      if (h->len || h->cls > RC_COLL || h->kind == RTP_COMM_K_NONE ||
          h->kind >= RTP_COMM_K_COUNT)
        return rtp__tcp_protocol_error(l, "bad ready-to-receive frame");
      if (!rtp__tcp_group_has(c, h->group, l->rank))
        return rtp__tcp_protocol_error(
            l, "ready-to-receive of group %016" PRIx64 ", which it does not share", h->group);
      rtp__tcp_reader_expect(l, R_HDR, l->hdrbuf, RC_HDR_SIZE);
      return rtp__tcp_on_rtr(l, h);
    default:
      if (h->group) return rtp__tcp_protocol_error(l, "a control frame of a group");
      break;
  }
  switch (h->type) {
    case RC_T_HEARTBEAT:
      if (h->len) return rtp__tcp_protocol_error(l, "bad heartbeat");
      rtp__tcp_reader_expect(l, R_HDR, l->hdrbuf, RC_HDR_SIZE);
      return;
    case RC_T_BYE: {
      /* The peer is gone for good once our writes to it are flushed: requests that
         still need anything else from it cannot complete. */
      l->bye_rx = true;
      rtp__tcp_reader_expect(l, R_HDR, l->hdrbuf, RC_HDR_SIZE);
      bool stuck = false;
      for (struct rc_leg *g = l->rx_legs; g; g = g->next) stuck |= g->next_k < g->nframes;
      for (struct rc_leg *g = l->tx_legs; g; g = g->next)
        stuck |= !g->ready || g->next_k < g->nframes;
      if (stuck && !c->shutting_down)
        return rtp__tcp_comm_fail(c, RTP_ECOMM,
                                  "rank %d (%s) left (rtp_comm_free) with operations "
                                  "pending",
                                  l->rank, l->addr);
      if (!l->tx_legs && !l->rx_legs) rtp__tcp_link_close(l);
      return;
    }
    case RC_T_ABORT:
      if (h->len > RC_MSG) return rtp__tcp_protocol_error(l, "abort message too long");
      break;
    case RC_T_REGISTER:
      if (c->rank != 0 || h->len != RC_ADDR_REC)
        return rtp__tcp_protocol_error(l, "bad registration");
      break;
    case RC_T_PEERS:
      if (c->rank == 0 || l->rank != 0 || h->len != (uint64_t)c->size * RC_ADDR_REC)
        return rtp__tcp_protocol_error(l, "bad peer table");
      break;
    default:
      return rtp__tcp_protocol_error(l, "unknown frame type %d", h->type);
  }
  if (h->len == 0) return on_ctrl(l);
  RTP_ASSERT(h->len <= l->ctrl_cap);
  rtp__tcp_reader_expect(l, R_CTRL, l->ctrl, (size_t)h->len);
}

void rtp__tcp_reader_step(struct rc_link *l) {
  switch (l->rstate) {
    case R_HELLO_C:
      return hs_acceptor_hello_c(l);
    case R_HELLO_A:
      return hs_connector_hello_a(l);
    case R_MAC_C:
      return hs_acceptor_mac_c(l);
    case R_MAC_A:
      return hs_connector_mac_a(l);
    case R_HDR:
      return on_hdr(l);
    case R_PAYLOAD:
      return rtp__tcp_on_payload(l);
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

/* The unproven connection to drop for a new one: the oldest of those that have not yet
 * sent a whole hello (a rank sends its hello at once; idle and trickling strangers never
 * do), else the oldest; of address a only (NULL: of all). */
static struct rc_link *eviction_pick(struct tcp *c, const char *a) {
  struct rc_link *oldest = NULL, *oldest_silent = NULL; /* links_all is newest first */
  for (struct rc_link *l = c->links_all; l; l = l->next) {
    if (!l->pending || (a && strcmp(l->src, a) != 0)) continue;
    oldest = l;
    if (l->rstate == R_HELLO_C) oldest_silent = l;
  }
  return oldest_silent ? oldest_silent : oldest;
}

/* Room for one more unproven connection from address a: one goes if a has
 * RC_PENDING_PER_SOURCE, or if there are as many in all as the job may legitimately open
 * at once and a margin. So strangers hold a bounded number of descriptors and bytes, and
 * a rank's handshake, which takes a round trip, outlives a flood's connections. */
static void make_room(struct tcp *c, const char *a) {
  int mine = 0;
  for (struct rc_link *l = c->links_all; l; l = l->next)
    mine += l->pending && !strcmp(l->src, a);
  if (mine >= RC_PENDING_PER_SOURCE)
    rtp__tcp_shed(eviction_pick(c, a), "too many unproven connections from its address");
  else if (c->n_pending >= RC_PENDING_BASE + 2 * c->size)
    rtp__tcp_shed(eviction_pick(c, NULL), "too many unproven connections");
}

static void on_connection(uv_stream_t *server, int status) {
  struct tcp *c = server->data;
  if (status < 0 || c->shutting_down) return;
  struct rc_link *l = link_new(c, false, -1);
  if (!l) return;
  uv_tcp_init(&c->loop, &l->tcp);
  l->tcp_open = true;
  l->nhandles = 1;
  if (uv_accept(server, (uv_stream_t *)&l->tcp) < 0) {
    rtp__tcp_link_close(l);
    return;
  }
  struct sockaddr_storage ss;
  int n = sizeof(ss);
  if (uv_tcp_getpeername(&l->tcp, (struct sockaddr *)&ss, &n) == 0) {
    rtp__tcp_sa_to_str((struct sockaddr *)&ss, l->addr, sizeof(l->addr));
    rtp__tcp_sa_ip(&ss, l->src, sizeof(l->src));
  }
  struct rc_source *src = source_of(c, l->src, false);
  if (c->loop_failed || (src && src->fails >= RC_FAILS_MAX)) { /* closed on sight */
    rtp__tcp_link_close(l);
    return;
  }
  make_room(c, l->src);
  l->pending = true;
  c->n_pending++;
  l->deadline = rtp__tcp_now_ms(c) + RC_ACCEPT_MS;
  tune_socket(&l->tcp);
  rtp__tcp_reader_expect(l, R_HELLO_C, l->hs, RC_HELLO_SIZE);
  uv_read_start((uv_stream_t *)&l->tcp, on_alloc, on_read);
}

static void connect_attempt(struct rc_link *l) {
  struct tcp *c = l->comm;
  if (l->state == LS_CLOSING) return;
  uv_tcp_init(&c->loop, &l->tcp);
  l->tcp_open = true;
  l->nhandles++;
  l->creq.data = l;
  int rc = uv_tcp_connect(&l->creq, &l->tcp, (const struct sockaddr *)&l->target, on_connect);
  if (rc < 0) {
    rtp__tcp_comm_fail(c, RTP_ECOMM, "cannot connect to rank %d at %s: %s", l->rank, l->addr,
                       uv_strerror(rc));
  }
}

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
  struct tcp *c = l->comm;
  if (l->state == LS_CLOSING) return;
  if (status < 0) {
    if (rtp__tcp_now_ms(c) > l->deadline || c->loop_failed) {
      rtp__tcp_comm_fail(c, RTP_ECOMM, "cannot connect to rank %d at %s: %s", l->rank, l->addr,
                         uv_strerror(status));
      return;
    }
    uv_close((uv_handle_t *)&l->tcp, retry_closed);
    return;
  }
  tune_socket(&l->tcp);
  l->state = LS_HANDSHAKE;
  rtp__tcp_hello_fill(l->hs, c->size, c->rank, c->host_key);
  if (hs_write(l, 0, 0, RC_HELLO_SIZE) < 0) {
    rtp__tcp_comm_fail(c, RTP_ECOMM, "handshake with rank %d (%s): write failed", l->rank,
                       l->addr);
    return;
  }
  l->deadline = rtp__tcp_now_ms(c) + RC_HANDSHAKE_MS;
  rtp__tcp_reader_expect(l, R_HELLO_A, l->hs + RC_HELLO_SIZE, RC_HELLO_SIZE);
  uv_read_start((uv_stream_t *)&l->tcp, on_alloc, on_read);
}

/* The acceptor closed before answering: connect again, as after a refused connection,
 * until the rendezvous's deadline. */
static void connect_retry(struct rc_link *l) {
  struct tcp *c = l->comm;
  l->refusals++;
  l->state = LS_CONNECTING;
  l->deadline = c->init_deadline;
  uv_read_stop((uv_stream_t *)&l->tcp);
  uv_close((uv_handle_t *)&l->tcp, retry_closed);
}

static void connect_to(struct tcp *c, int rank, const struct sockaddr_storage *sa) {
  struct rc_link *l = link_new(c, true, rank);
  if (!l) return rtp__tcp_comm_fail(c, RTP_ENOMEM, "out of memory");
  l->state = LS_CONNECTING;
  l->target = *sa;
  rtp__tcp_sa_to_str((const struct sockaddr *)sa, l->addr, sizeof(l->addr));
  uv_timer_init(&c->loop, &l->retry);
  l->has_timer = true;
  l->nhandles = 1;
  l->deadline = c->init_deadline;
  connect_attempt(l);
}

static int resolve(struct tcp *c, const char *host, int port, struct sockaddr_storage *out) {
  if (rtp__tcp_parse_ip(host, port, out) == 0) return 0;
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
static int resolve_bind(struct tcp *c) {
  const char *b = c->params.bind;
  if (!b[0]) return 0;
  if (rtp__tcp_parse_ip(b, 0, &c->bind_sa) == 0) {
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

static bool is_loopback(const struct sockaddr_storage *sa) {
  if (sa->ss_family == AF_INET)
    return (ntohl(((const struct sockaddr_in *)sa)->sin_addr.s_addr) >> 24) == 127;
  return sa->ss_family == AF_INET6 &&
         IN6_IS_ADDR_LOOPBACK(&((const struct sockaddr_in6 *)sa)->sin6_addr);
}

/* Where to listen when the job names no address (RTP_BIND_ADDR, RTP_IFNAME): where the
 * job lives, not on every interface. Rank 0 listens on the master address when it was
 * given as one (127.0.0.1 for a job on one host); the others on their address that routes
 * to the master, which is also the one they register. False: on every interface, as when
 * the master is a name (it may resolve to 127.0.1.1 here and to the LAN address
 * elsewhere) or no route is known. */
static bool job_address(struct tcp *c, struct sockaddr_storage *la) {
  if (c->rank == 0) {
    *la = c->master;
    return rtp__tcp_parse_ip(c->params.master_addr, 0, la) == 0 &&
           (is_loopback(la) || !is_loopback(&c->master));
  }
  int fd = socket(c->master.ss_family, SOCK_DGRAM, 0); /* connecting sends nothing */
  socklen_t n = sizeof(*la);
  socklen_t len = c->master.ss_family == AF_INET6 ? sizeof(struct sockaddr_in6)
                                                  : sizeof(struct sockaddr_in);
  bool ok = fd >= 0 && connect(fd, (const struct sockaddr *)&c->master, len) == 0 &&
            getsockname(fd, (struct sockaddr *)la, &n) == 0;
  if (fd >= 0) close(fd);
  return ok;
}

void rtp__tcp_loop_start(struct tcp *c) {
  struct rtp_comm_params *p = &c->params;
  int rc = resolve(c, p->master_addr, p->master_port, &c->master);
  if (rc < 0)
    return rtp__tcp_comm_fail(c, RTP_ECOMM, "cannot resolve master address '%s': %s",
                              p->master_addr, uv_strerror(rc));
  rtp__tcp_sa_to_str((struct sockaddr *)&c->master, c->master_str, sizeof(c->master_str));
  if (resolve_bind(c) < 0)
    return rtp__tcp_comm_fail(
        c, RTP_EINVAL, "bind '%s' is neither an address nor an interface with one", p->bind);
  /* listen: rank 0 on the master port, others on any port */
  struct sockaddr_storage la;
  bool wild = !c->have_bind && !job_address(c, &la);
  if (c->have_bind) la = c->bind_sa;
  if (wild) {
    memset(&la, 0, sizeof(la));
    rtp__tcp_parse_ip(c->master.ss_family == AF_INET6 ? "::" : "0.0.0.0", 0, &la);
  }
  rtp__tcp_sa_set_port(&la, c->rank == 0 ? p->master_port : 0);
  uv_tcp_init(&c->loop, &c->listener);
  c->listener.data = c;
  c->listener_open = true;
  rc = uv_tcp_bind(&c->listener, (struct sockaddr *)&la, 0);
  if (rc == UV_EADDRNOTAVAIL && !c->have_bind && !wild) { /* the master's name is not ours */
    memset(&la, 0, sizeof(la));
    rtp__tcp_parse_ip(c->master.ss_family == AF_INET6 ? "::" : "0.0.0.0", p->master_port, &la);
    rc = uv_tcp_bind(&c->listener, (struct sockaddr *)&la, 0);
  }
  if (rc == 0) rc = uv_listen((uv_stream_t *)&c->listener, 128, on_connection);
  if (rc < 0) {
    char s[96];
    rtp__tcp_sa_to_str((struct sockaddr *)&la, s, sizeof(s));
    return rtp__tcp_comm_fail(c, RTP_ECOMM, "cannot listen on %s: %s", s, uv_strerror(rc));
  }
  struct sockaddr_storage ss;
  int n = sizeof(ss);
  uv_tcp_getsockname(&c->listener, (struct sockaddr *)&ss, &n);
  c->my_port = rtp__tcp_sa_port(&ss);
  if (c->rank > 0) connect_to(c, 0, &c->master);
}
