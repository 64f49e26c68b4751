/* rtp-reshard-exec.c - cross-mesh resharding's execution: this rank's part of a plan
 * (rtp-reshard.c) as graph nodes. Each slice's broadcast is a chain, sender -> r1 -> r2 ...,
 * cut into chunks that each hop forwards as soon as they arrive (rtp_send, rtp_sendrecv,
 * rtp_recv nodes); a receiver that holds the slice copies it locally. The plan's rounds
 * run in waves of WAVE rounds: the chains of a wave run at once, their chunks interleaved.
 * docs/resharding.md.
 *
 * Deadlock freedom: every transfer (chunk k of slice s, hop j of its chain) has the key
 * (wave of s, k + LOOKAHEAD·j, position of s), the same at both of its ends. Each rank
 * appends its nodes in increasing key, and a node only ever waits for transfers of smaller
 * keys. So the transfer of smallest key not yet done is posted at both ends (neither end
 * can be stuck behind it), and completes: by induction all do. Both ends also post the
 * transfers between two ranks in the same order, which is what matches the k-th send to
 * the k-th recv. */
#include "rtp-impl.h"

#include <stdlib.h>
#include <string.h>

/* Chunks a chain's receiver has asked for beyond the one it forwards: with 2, the next
 * chunk's ready-to-receive is always with the sender before the current chunk is done. */
#define LOOKAHEAD 2
/* Sends nobody reads (a sender's chunks, a chain's last forwards) that a rank keeps in
 * flight before a copy waits for the oldest: the communicator's requests are a fixed pool. */
#define WINDOW 16
/* Rounds whose broadcasts run at once. A rank is in at most one broadcast per round (they
 * share no host), so in at most WAVE chains at a time, each with at most LOOKAHEAD + 1
 * transfers in flight: with WINDOW, 40 of the communicator's 128 requests. Running rounds
 * together lets a host send in one round's broadcast while it receives in another's. */
#define WAVE 8

/* ---- where this rank's local tensor holds the global one ------------------------------ */

static int cmp_pair(const void *a, const void *b) {
  int64_t x = ((const int64_t *)a)[0], y = ((const int64_t *)b)[0];
  return (x > y) - (x < y);
}

static bool has_rank(const int *ranks, int n, int rank) {
  for (int i = 0; i < n; i++)
    if (ranks[i] == rank) return true;
  return false;
}

void rtp__reshard_map_free(struct rtp__reshard_map *m) {
  for (int d = 0; d < RTP_MAX_DIMS; d++) free(m->first[d]);
}

/* rtp-impl.h: the checkpoint's load places what it reads by the same map. */
bool rtp__reshard_map_init(struct rtp__reshard_map *m, const struct rtp_reshard *r, int rank,
                           bool holders) {
  memset(m, 0, sizeof(*m));
  for (int d = 0; d < RTP_MAX_DIMS; d++) {
    int64_t *pairs = malloc(sizeof(int64_t) * 2 * (size_t)(r->n_slices + 1));
    if (!pairs) {
      rtp__reshard_map_free(m);
      return false;
    }
    int k = 0;
    for (int i = 0; i < r->n_slices; i++) {
      const struct rtp_reshard_slice *s = &r->slices[i];
      if (!(holders ? has_rank(s->holders, s->n_holders, rank)
                    : has_rank(s->receivers, s->n_receivers, rank)))
        continue;
      pairs[2 * k] = s->first[d];
      pairs[2 * k++ + 1] = s->len[d];
    }
    qsort(pairs, (size_t)k, 2 * sizeof(int64_t), cmp_pair);
    /* the planner's intervals in a dimension are equal or disjoint: keep one of each */
    int u = 0;
    for (int i = 0; i < k; i++)
      if (u == 0 || pairs[2 * (u - 1)] != pairs[2 * i]) {
        pairs[2 * u] = pairs[2 * i];
        pairs[2 * u++ + 1] = pairs[2 * i + 1];
      }
    /* the same memory, rewritten as (global first, local first) */
    int64_t at = 0;
    for (int i = 0; i < u; i++) {
      int64_t len = pairs[2 * i + 1];
      pairs[2 * i + 1] = at;
      at += len;
    }
    m->first[d] = pairs;
    m->n[d] = u;
    m->ne[d] = at;
  }
  return true;
}

/* The local index of global index x of dimension d (x in one of the map's intervals). */
static int64_t map_local(const struct rtp__reshard_map *m, int d, int64_t x) {
  const int64_t *p = m->first[d];
  int lo = 0, hi = m->n[d] - 1;
  while (lo < hi) { /* the last interval that starts at or before x */
    int mid = (lo + hi + 1) / 2;
    if (p[2 * mid] <= x)
      lo = mid;
    else
      hi = mid - 1;
  }
  return p[2 * lo + 1] + (x - p[2 * lo]);
}

size_t rtp__reshard_map_offset(const struct rtp__reshard_map *m, const struct rtp_tensor *t,
                               const int64_t *first) {
  size_t off = 0;
  for (int d = 0; d < RTP_MAX_DIMS; d++) off += (size_t)map_local(m, d, first[d]) * t->nb[d];
  return off;
}

/* ---- chunks -------------------------------------------------------------------------- */

/* A slice cut into boxes of about `bytes`: whole along the dimensions below e, `rows`
 * indices along e, one index along those above. */
struct chunking {
  int e;
  int64_t rows, per; /* per: chunks along e for each index above it */
  int64_t count;
};

static struct chunking chunking_of(const struct rtp_reshard_slice *s, size_t esize,
                                   size_t bytes) {
  struct chunking c = {0, 1, 1, 1};
  size_t unit = esize; /* bytes of one index along dimension c.e */
  while (c.e < RTP_MAX_DIMS - 1 && unit * (size_t)s->len[c.e] <= bytes)
    unit *= (size_t)s->len[c.e++];
  c.rows = bytes / unit < (size_t)s->len[c.e] ? (int64_t)(bytes / unit) : s->len[c.e];
  if (c.rows < 1) c.rows = 1;
  c.per = (s->len[c.e] + c.rows - 1) / c.rows;
  c.count = c.per;
  for (int d = c.e + 1; d < RTP_MAX_DIMS; d++) c.count *= s->len[d];
  return c;
}

/* Chunk k of slice s, in global indices. */
static void chunk_box(const struct rtp_reshard_slice *s, const struct chunking *c, int64_t k,
                      int64_t first[RTP_MAX_DIMS], int64_t len[RTP_MAX_DIMS]) {
  int64_t rest = k / c->per, i = k % c->per;
  for (int d = 0; d < RTP_MAX_DIMS; d++) {
    first[d] = s->first[d];
    len[d] = s->len[d];
    if (d == c->e) {
      first[d] += i * c->rows;
      len[d] = i * c->rows + c->rows <= s->len[d] ? c->rows : s->len[d] - i * c->rows;
    } else if (d > c->e) {
      first[d] += rest % s->len[d];
      len[d] = 1;
      rest /= s->len[d];
    }
  }
}

/* ---- the nodes ------------------------------------------------------------------------ */

struct exec {
  struct rtp_context *ctx;
  struct rtp_graph *g;
  struct rtp_comm *comm;
  const struct rtp_reshard *r;
  struct rtp_tensor *src, *dst;
  struct rtp__reshard_map smap, dmap;
  size_t esize, chunk_bytes;
  int me;         /* this rank's job rank */
  int *comm_rank; /* job rank -> rank in comm (-1: not in it), for ranks < n_job */
  int n_job;      /* one more than the largest job rank of comm */
  struct rtp_tensor *unread[WINDOW + 2]; /* sends nobody reads yet, oldest first */
  int n_unread;
  int rc;
};

/* Appends t (and what it reads that g does not have yet) to g. */
static struct rtp_tensor *add(struct exec *x, struct rtp_tensor *t) {
  if (x->rc) return NULL;
  if (!t) {
    x->rc = rtp_context_error(x->ctx, NULL);
    if (!x->rc) x->rc = rtp__ctx_error(x->ctx, RTP_ENOMEM, "rtp_reshard_build: out of memory");
    return NULL;
  }
  if ((x->rc = rtp_graph_build(x->g, t))) return NULL;
  return t;
}

/* A view of the box of this rank's source tensor. */
static struct rtp_tensor *src_box(struct exec *x, const int64_t *first, const int64_t *len) {
  if (x->rc) return NULL;
  return rtp_view(x->ctx, x->src, RTP_MAX_DIMS, len, x->src->nb,
                  rtp__reshard_map_offset(&x->smap, x->src, first));
}

/* The oldest unread sends, for a pack or copy to wait for through its spare sources (up
 * to n): waiting is what bounds the requests in flight. Only the oldest of at least WINDOW
 * is taken, never the send just posted, so t waits for a smaller key than its own (the
 * deadlock argument). */
static void take_unread(struct exec *x, struct rtp_tensor *t, int first_spare, int n) {
  for (int k = first_spare; k < first_spare + n && x->n_unread >= WINDOW; k++) {
    t->src[k] = x->unread[0];
    memmove(x->unread, x->unread + 1, sizeof(x->unread[0]) * (size_t)--x->n_unread);
  }
}

static void note_unread(struct exec *x, struct rtp_tensor *send) {
  if (!send) return;
  RTP_ASSERT(x->n_unread < WINDOW + 2); /* each item adds one, and its copy takes one back */
  x->unread[x->n_unread++] = send;
}

/* A copy of `from` into the box (first, len) of this rank's destination tensor: a DUP whose
 * result is that memory (the kernels write a result at its strides). It reads dst too
 * (src[1]), so that a planned dst lives through every write into it. */
static struct rtp_tensor *copy_into_dst(struct exec *x, struct rtp_tensor *from,
                                        const int64_t *first, const char *what, int s,
                                        int64_t k) {
  if (x->rc || !from) return NULL;
  struct rtp_tensor *base = x->dst->view_src ? x->dst->view_src : x->dst;
  struct rtp_tensor *t = rtp__new_node(x->ctx, RTP_OP_DUP, x->dst->type, from->ne, from, base);
  if (!t) return add(x, NULL);
  memcpy(t->nb, x->dst->nb, sizeof(t->nb));
  t->view_src = base;
  t->view_offs = x->dst->view_offs + rtp__reshard_map_offset(&x->dmap, x->dst, first);
  if (base->data) t->data = (char *)base->data + t->view_offs;
  rtp_tensor_set_name(t, "reshard.%s.%d.%lld", what, s, (long long)k);
  take_unread(x, t, 2, 1);
  return add(x, t);
}

/* A transfer of chunk k of slice s, named so for traces ("reshard.3.0 send to 2"). */
static struct rtp_tensor *named(struct rtp_tensor *t, int s, int64_t k) {
  return t ? rtp_tensor_set_name(t, "reshard.%d.%lld", s, (long long)k) : NULL;
}

/* This rank's part of one slice's chain, appended a step at a time: step i (from 0 for
 * the sender, from -LOOKAHEAD for a receiver) has the key t = i + LOOKAHEAD·j at hop j. */
struct cursor {
  int s; /* the slice's index */
  const struct rtp_reshard_slice *sl;
  int j, m;       /* this rank's hop (0: the sender) of the chain's m */
  int prev, next; /* comm ranks before and after it in the chain (-1: none) */
  struct chunking c;
  int64_t step;
  struct rtp_tensor *got[LOOKAHEAD + 1]; /* got[k % (LOOKAHEAD + 1)]: the node whose
                                            result is chunk k */
};

static int64_t cursor_key(const struct cursor *u) {
  return u->step + (int64_t)LOOKAHEAD * u->j;
}

static bool cursor_done(const struct cursor *u) {
  return u->step >= u->c.count;
}

/* This rank's cursor on slice s; false if it is not on the chain. */
static bool cursor_init(struct exec *x, struct cursor *u, int s) {
  const struct rtp_reshard_slice *sl = &x->r->slices[s];
  *u = (struct cursor){.s = s, .sl = sl, .j = -1, .m = sl->n_receivers - sl->n_local};
  if (sl->sender == x->me)
    u->j = 0;
  else
    for (int i = sl->n_local; i < sl->n_receivers; i++)
      if (sl->receivers[i] == x->me) u->j = i - sl->n_local + 1;
  if (u->j < 0 || u->m == 0) return false;
  const int *chain = sl->receivers + sl->n_local; /* hops 1..m */
  u->prev = u->j > 0 ? x->comm_rank[u->j == 1 ? sl->sender : chain[u->j - 2]] : -1;
  u->next = u->j < u->m ? x->comm_rank[chain[u->j]] : -1;
  u->c = chunking_of(sl, x->esize, x->chunk_bytes);
  u->step = u->j > 0 ? -LOOKAHEAD : 0;
  return true;
}

/* A planned buffer for chunk k, which a recv fills. */
static struct rtp_tensor *chunk_buffer(struct exec *x, const struct cursor *u, int64_t k) {
  int64_t first[RTP_MAX_DIMS], len[RTP_MAX_DIMS];
  chunk_box(u->sl, &u->c, k, first, len);
  return x->rc ? NULL : rtp__new_node(x->ctx, RTP_OP_EMPTY, x->dst->type, len, NULL, NULL);
}

/* The sender's step k: pack chunk k of src and send it to the chain's first receiver. */
static void sender_step(struct exec *x, struct cursor *u, int64_t k) {
  int64_t first[RTP_MAX_DIMS], len[RTP_MAX_DIMS];
  chunk_box(u->sl, &u->c, k, first, len);
  struct rtp_tensor *p = x->rc ? NULL : rtp_dup(x->ctx, src_box(x, first, len));
  if (p) {
    rtp_tensor_set_name(p, "reshard.pack.%d.%lld", u->s, (long long)k);
    take_unread(x, p, 1, 2);
  }
  if (add(x, p))
    note_unread(x, add(x, named(rtp_send(x->ctx, x->comm, p, u->next, NULL), u->s, k)));
}

/* A receiver's step: before chunk 0, ask for the first chunks; at chunk k, forward it
 * (asking for chunk k + LOOKAHEAD in the same sendrecv), then copy it into dst. */
static void receiver_step(struct exec *x, struct cursor *u, int64_t k) {
  struct rtp_tensor **got = u->got;
  if (k < 0) {
    int64_t ask = k + LOOKAHEAD;
    if (ask < u->c.count)
      got[ask] = add(x, named(rtp_recv(x->ctx, x->comm, chunk_buffer(x, u, ask), u->prev, NULL),
                              u->s, ask));
    return;
  }
  struct rtp_tensor *have = got[k % (LOOKAHEAD + 1)], *more = NULL, *buf = NULL;
  if (k + LOOKAHEAD < u->c.count && !(buf = chunk_buffer(x, u, k + LOOKAHEAD))) {
    add(x, NULL);
    return;
  }
  if (u->next >= 0 && buf)
    more = add(
        x, named(rtp_sendrecv(x->ctx, x->comm, have, u->next, buf, u->prev, NULL), u->s, k));
  else if (u->next >= 0)
    note_unread(x, add(x, named(rtp_send(x->ctx, x->comm, have, u->next, NULL), u->s, k)));
  else if (buf)
    more = add(x, named(rtp_recv(x->ctx, x->comm, buf, u->prev, NULL), u->s, k + LOOKAHEAD));
  got[(k + LOOKAHEAD) % (LOOKAHEAD + 1)] = more;
  int64_t first[RTP_MAX_DIMS], len[RTP_MAX_DIMS];
  chunk_box(u->sl, &u->c, k, first, len);
  copy_into_dst(x, have, first, "chunk", u->s, k);
}

/* The chains of one wave (cursors in slice order), merged step by step in key order: the
 * smallest key first, ties to the earlier slice. */
static void run_wave(struct exec *x, struct cursor *u, int n) {
  for (;;) {
    int best = -1;
    for (int i = 0; i < n; i++)
      if (!cursor_done(&u[i]) && (best < 0 || cursor_key(&u[i]) < cursor_key(&u[best])))
        best = i;
    if (best < 0 || x->rc) return;
    struct cursor *c = &u[best];
    if (c->j == 0)
      sender_step(x, c, c->step);
    else
      receiver_step(x, c, c->step);
    c->step++;
  }
}

/* The slices in the order every rank appends them: by round, the broadcasts that cross no
 * NIC (local copies, same-host chains) last, then by index (a counting sort). */
static int *slice_order(const struct rtp_reshard *r) {
  int *order = malloc(sizeof(int) * (size_t)(r->n_slices + r->n_rounds + 2));
  if (!order) return NULL;
  int *at = order + r->n_slices; /* at[q + 1]: where round q's slices go; at[0]: round -1 */
  memset(at, 0, sizeof(int) * (size_t)(r->n_rounds + 2));
  for (int i = 0; i < r->n_slices; i++) at[r->slices[i].round + 1]++;
  int next = 0;
  for (int q = 1; q <= r->n_rounds; q++) {
    int n = at[q];
    at[q] = next;
    next += n;
  }
  at[0] = next;
  for (int i = 0; i < r->n_slices; i++) order[at[r->slices[i].round + 1]++] = i;
  return order;
}

/* The wave of the i-th slice in order: its round / WAVE, or for those in no round (the
 * last in the order, from position n_round) one wave per WAVE of them after the rounds'. */
static int wave_of(const struct rtp_reshard *r, const int *order, int i, int n_round) {
  int round = r->slices[order[i]].round;
  return round >= 0 ? round / WAVE : (r->n_rounds + WAVE - 1) / WAVE + (i - n_round) / WAVE;
}

/* ---- checks ---------------------------------------------------------------------------- */

/* t (src or dst: `which`, which this rank needs to `need`, or NULL) against the plan. */
static int check_tensor(struct exec *x, const char *which, const struct rtp_tensor *t,
                        const struct rtp__reshard_map *m, const char *need) {
  if (!t) {
    if (!need) return RTP_OK;
    return rtp__ctx_error(x->ctx, RTP_EINVAL,
                          "rtp_reshard_build: rank %d %s but its %s is NULL", x->me, need,
                          which);
  }
  char shape[128];
  rtp__shape_str(t, shape, sizeof(shape));
  if ((t->type != RTP_TYPE_F32 && t->type != RTP_TYPE_BF16) ||
      rtp_type_size(t->type) != x->esize || !rtp_tensor_is_contiguous(t))
    return rtp__ctx_error(x->ctx, RTP_ESHAPE,
                          "rtp_reshard_build: %s %s must be contiguous f32 or bf16 with the "
                          "plan's %zu-byte elements",
                          which, shape, x->esize);
  if (m->n[0] == 0) return RTP_OK; /* an empty block: this rank holds nothing */
  for (int d = 0; d < RTP_MAX_DIMS; d++)
    if (t->ne[d] != m->ne[d])
      return rtp__ctx_error(
          x->ctx, RTP_ESHAPE,
          "rtp_reshard_build: rank %d's %s is %s, its block of the layout is %lld x %lld x "
          "%lld x %lld",
          x->me, which, shape, (long long)m->ne[0], (long long)m->ne[1], (long long)m->ne[2],
          (long long)m->ne[3]);
  return RTP_OK;
}

/* comm_rank[job rank] for comm's ranks; every rank a slice names must be there. */
static int map_comm(struct exec *x) {
  int n = rtp_comm_size(x->comm), n_job = 0;
  for (int i = 0; i < n; i++)
    if (rtp_comm_world_rank(x->comm, i) + 1 > n_job)
      n_job = rtp_comm_world_rank(x->comm, i) + 1;
  if (!(x->comm_rank = malloc(sizeof(int) * (size_t)n_job)))
    return rtp__ctx_error(x->ctx, RTP_ENOMEM, "rtp_reshard_build: out of memory");
  x->n_job = n_job;
  for (int i = 0; i < n_job; i++) x->comm_rank[i] = -1;
  for (int i = 0; i < n; i++) x->comm_rank[rtp_comm_world_rank(x->comm, i)] = i;
  x->me = rtp_comm_world_rank(x->comm, rtp_comm_rank(x->comm));
  for (int i = 0; i < x->r->n_slices; i++) {
    const struct rtp_reshard_slice *s = &x->r->slices[i];
    for (int k = -1; k < s->n_receivers; k++) {
      int q = k < 0 ? s->sender : s->receivers[k];
      if (q >= 0 && (q >= n_job || x->comm_rank[q] < 0))
        return rtp__ctx_error(x->ctx, RTP_EINVAL,
                              "rtp_reshard_build: the plan moves data of rank %d, which is not "
                              "in the communicator",
                              q);
    }
  }
  return RTP_OK;
}

/* Whether this rank sends or copies locally (needs src), and receives (needs dst). */
static void roles(const struct exec *x, bool *sends, bool *receives) {
  *sends = *receives = false;
  for (int i = 0; i < x->r->n_slices; i++) {
    const struct rtp_reshard_slice *s = &x->r->slices[i];
    bool local = has_rank(s->receivers, s->n_local, x->me);
    *sends |= s->sender == x->me || local;
    *receives |=
        local || has_rank(s->receivers + s->n_local, s->n_receivers - s->n_local, x->me);
  }
}

int rtp_reshard_build(struct rtp_context *ctx, struct rtp_graph *g, struct rtp_comm *comm,
                      const struct rtp_reshard *r, struct rtp_tensor *src,
                      struct rtp_tensor *dst, size_t chunk_bytes) {
  if (!ctx || !g || !comm || !r || r->n_slices < 1)
    return rtp__ctx_error(ctx, RTP_EINVAL,
                          "rtp_reshard_build: NULL context, graph, communicator or plan");
  struct exec x = {.ctx = ctx, .g = g, .comm = comm, .r = r, .src = src, .dst = dst};
  const struct rtp_reshard_slice *s0 = &r->slices[0];
  x.esize = s0->nbytes / (size_t)(s0->len[0] * s0->len[1] * s0->len[2] * s0->len[3]);
  x.chunk_bytes = chunk_bytes ? chunk_bytes : RTP_RESHARD_CHUNK;
  int rc = map_comm(&x);
  bool sends = false, receives = false, maps = false;
  if (!rc) {
    roles(&x, &sends, &receives);
    maps = rtp__reshard_map_init(&x.smap, r, x.me, true);
    if (maps && !rtp__reshard_map_init(&x.dmap, r, x.me, false)) {
      rtp__reshard_map_free(&x.smap);
      maps = false;
    }
    if (!maps) rc = rtp__ctx_error(ctx, RTP_ENOMEM, "rtp_reshard_build: out of memory");
  }
  if (!rc) rc = check_tensor(&x, "source", src, &x.smap, sends ? "sends or copies" : NULL);
  if (!rc) rc = check_tensor(&x, "destination", dst, &x.dmap, receives ? "receives" : NULL);
  int *order = rc ? NULL : slice_order(r);
  if (!rc && !order) rc = rtp__ctx_error(ctx, RTP_ENOMEM, "rtp_reshard_build: out of memory");
  int n_round = 0; /* the slices in a round, which come first in order */
  for (int i = 0; !rc && i < r->n_slices; i++) n_round += r->slices[i].round >= 0;
  for (int i = 0; !rc && i < r->n_slices;) {
    /* a wave: the slices of WAVE rounds, or WAVE of those in no round */
    int w = wave_of(r, order, i, n_round), e = i, n = 0;
    struct cursor u[WAVE];
    struct cursor extra;
    for (; e < r->n_slices && wave_of(r, order, e, n_round) == w && !rc; e++)
      if (cursor_init(&x, n < WAVE ? &u[n] : &extra, order[e]) && ++n > WAVE)
        rc = x.rc = rtp__ctx_error(ctx, RTP_EINVAL,
                                   "rtp_reshard_build: the plan puts rank %d in more than one "
                                   "broadcast of a round (slice %d, round %d): a round's "
                                   "broadcasts must share no host",
                                   x.me, order[e], r->slices[order[e]].round);
    if (rc) break;
    run_wave(&x, u, n);
    for (; i < e && !x.rc; i++) {
      const struct rtp_reshard_slice *sl = &r->slices[order[i]];
      if (has_rank(sl->receivers, sl->n_local, x.me))
        copy_into_dst(&x, src_box(&x, sl->first, sl->len), sl->first, "local", order[i], 0);
    }
    rc = x.rc;
  }
  free(order);
  free(x.comm_rank);
  if (maps) {
    rtp__reshard_map_free(&x.smap);
    rtp__reshard_map_free(&x.dmap);
  }
  return rc;
}
