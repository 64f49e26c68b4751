/* rtp-sched.c - what rtp and fsdp share: parameters split into blocks of rows, the handle
 * that stands for an op on a distributed parameter, the gradient of a block, and the
 * schedule of their transfers: the flyweight pool of slots they travel in, the packing of
 * small hops into a slot, and the passes that move the owners' final sums late and every
 * ready transfer early (docs/parallel.md, "Small blocks must not make the ranks meet"). */
#include "rtp-strategy.h"

#include <stdlib.h>
#include <string.h>

/* ---- blocks of a parameter ------------------------------------------------------ */

void rtp__param_block(const struct rtp_tensor *full, int world, int s, int64_t *first,
                      int64_t *len) {
  size_t f, l;
  rtp_comm_block((size_t)full->ne[rtp__param_split_dim(full)], world, s, &f, &l);
  *first = (int64_t)f;
  *len = (int64_t)l;
}

size_t rtp__param_largest_block(int world, const struct rtp_tensor *full) {
  int64_t first, len;
  rtp__param_block(full, world, 0, &first, &len);
  return (size_t)(rtp_tensor_nelements(full) / full->ne[rtp__param_split_dim(full)] * len);
}

struct rtp_tensor *rtp__slice(struct rtp_context *ctx, struct rtp_tensor *x, int dim,
                              int64_t first, int64_t len) {
  int64_t ne[4];
  memcpy(ne, x->ne, sizeof(ne));
  ne[dim] = len;
  return rtp_view(ctx, x, RTP_MAX_DIMS, ne, x->nb, (size_t)first * x->nb[dim]);
}

/* ---- an op on a distributed parameter ------------------------------------------- */

static int rot_kind_of(const struct rtp_tensor *t, const struct rtp_tensor *param,
                       enum rtp__rot_kind *kind) {
  if (t->op == RTP_OP_MUL_MAT && t->src[0] == param && param->ne[2] == 1 && param->ne[3] == 1)
    *kind = RTP__ROT_MUL_MAT;
  else if (t->op == RTP_OP_GET_ROWS && t->src[0] == param)
    *kind = RTP__ROT_GET_ROWS;
  else if ((t->op == RTP_OP_ADD || t->op == RTP_OP_MUL) && t->src[1] == param &&
           param->ne[rtp__param_split_dim(param)] == t->ne[rtp__param_split_dim(param)])
    *kind = t->op == RTP_OP_ADD ? RTP__ROT_ADD : RTP__ROT_MUL;
  else
    return RTP_EINVAL;
  return RTP_OK;
}

int rtp__rot_operands(struct rtp_parallel *p, const struct rtp_tensor *t,
                      const struct rtp_tensor *full, enum rtp__rot_kind *kind,
                      struct rtp_tensor **x, struct rtp_tensor **own) {
  if (rot_kind_of(t, full, kind)) {
    char s[128];
    rtp__shape_str(full, s, sizeof(s));
    return rtp__ctx_error(p->ctx, RTP_EINVAL,
                          "%s strategy: parameter %s is used by %s, which it cannot split "
                          "(mul_mat as the first operand, get_rows, or a broadcast add/mul)",
                          p->iface->name, s, rtp_op_name(t->op));
  }
  *own = rtp__parallel_mapped(p, full);
  *x = rtp__parallel_mapped(
      p, *kind == RTP__ROT_ADD || *kind == RTP__ROT_MUL ? t->src[0] : t->src[1]);
  return RTP_OK;
}

/* The one-device parameter is kept in op_params words 4..5 (the hook is in 2..3). */
#define ROT_FULL 4

struct rtp_tensor *rtp__rot_handle(struct rtp_parallel *p, const struct rtp_tensor *t,
                                   const struct rtp_tensor *full, enum rtp__rot_kind kind,
                                   struct rtp_tensor *x, struct rtp_tensor *own,
                                   struct rtp_tensor *y) {
  struct rtp_tensor *h = rtp__new_node(p->ctx, RTP_OP_ROT, y->type, y->ne, x, own);
  if (!h) return NULL;
  memcpy(h->nb, y->nb, sizeof(h->nb));
  h->src[2] = y;
  h->view_src = y->view_src ? y->view_src : y;
  h->view_offs = y->view_offs;
  h->op_params[0] = kind;
  h->op_params[1] = rtp__param_split_dim(full);
  rtp__rot_set_hook(h, &p->hook);
  rtp__set_param_u64(h, ROT_FULL, (uint64_t)(uintptr_t)full);
  memcpy(h->name, t->name, sizeof(h->name));
  h->flags = t->flags;
  return h;
}

struct rtp_tensor *rtp__rot_full(const struct rtp_tensor *h) {
  return (struct rtp_tensor *)(uintptr_t)rtp__get_param_u64(h, ROT_FULL);
}

/* This rank's contribution to the gradient of block s (shaped like w, not read). */
struct rtp_tensor *rtp__block_grad(struct rtp_context *ctx, enum rtp__rot_kind kind, int dim,
                                   struct rtp_tensor *w, struct rtp_tensor *x,
                                   struct rtp_tensor *dys, int64_t first, int64_t len) {
  switch (kind) {
    case RTP__ROT_MUL_MAT: {          /* dW_s = dy_s^T x, over all rows of the batch */
      if (rtp_tensor_n_dims(x) > 2) { /* GEMM reads 2-D strided slices in place; else flatten */
        x = rtp_reshape_2d(ctx, rtp_cont(ctx, x), x->ne[0], rtp_tensor_nrows(x));
        dys = rtp_reshape_2d(ctx, rtp_cont(ctx, dys), dys->ne[0], rtp_tensor_nrows(dys));
      }
      return rtp_mul_mat(ctx, rtp_transpose(ctx, x), rtp_transpose(ctx, dys));
    }
    case RTP__ROT_GET_ROWS:
      return rtp__get_rows_back_block(ctx, dys, x, w, first);
    case RTP__ROT_ADD:
      return rtp_repeat_back(ctx, dys, w); /* kernels read strided rows in place */
    default:
      return rtp_repeat_back(ctx, rtp_mul(ctx, dys, rtp__slice(ctx, x, dim, first, len)), w);
  }
}

/* Block s's part of dx (NULL where the op has none); for mul_mat, added to the sum of the
 * blocks before (`sum`, NULL for the first). */
struct rtp_tensor *rtp__block_dx(struct rtp_context *ctx, enum rtp__rot_kind kind,
                                 struct rtp_tensor *w, struct rtp_tensor *dys,
                                 struct rtp_tensor *sum) {
  switch (kind) {
    case RTP__ROT_MUL_MAT:
      return rtp__mul_mat_add(ctx, rtp_transpose(ctx, w), dys, sum);
    case RTP__ROT_MUL: /* concatenated over blocks */
      return rtp_mul(ctx, dys, w);
    default: /* add passes dy through whole; get_rows has no input gradient */
      return NULL;
  }
}

/* ---- the pool and its slots ----------------------------------------------------- */

int rtp__sched_init(struct rtp_parallel *p, struct rtp_sched *s, size_t w_elems) {
  int world = rtp_comm_size(p->comm);
  size_t largest = 0;
  for (int i = 0; i < p->src->n_leafs; i++) {
    const struct rtp_tensor *t = p->src->leafs[i];
    if (!(t->flags & RTP_FLAG_PARAM) || !rtp__parallel_leaf_here(p, i)) continue;
    if (t->ne[rtp__param_split_dim(t)] < world) {
      char str[128];
      rtp__shape_str(t, str, sizeof(str));
      return rtp__ctx_error(p->ctx, RTP_EINVAL,
                            "%s strategy: parameter %s has fewer rows (outermost dimension) "
                            "than the %d ranks to split it between",
                            p->iface->name, str, world);
    }
    size_t n = rtp__param_largest_block(world, t);
    if (n > largest) largest = n;
  }
  s->pool_elems = largest;
  s->sink = rtp__ctx_alloc(p->ctx,
                           sizeof(*s->sink) * (size_t)(p->src->n_nodes + 1) * (size_t)p->phases,
                           "the rtp plan's late sums");
  s->n_micro = p->phases;
  s->micro_sink = rtp__ctx_alloc(p->ctx, sizeof(int) * 2 * (size_t)s->n_micro, "micro-batches");
  if (!s->sink || !s->micro_sink) return rtp_context_error(p->ctx, NULL);
  s->micro_start = s->micro_sink + s->n_micro;
  if (!w_elems) w_elems = largest;
  for (int i = 0; i < 2; i++) { /* bf16 copies travel in a pool of half the bytes */
    s->pool_w[i] = rtp_tensor_new_1d(p->ctx, p->comm_type, (int64_t)w_elems);
    s->pool_g[i] = rtp_tensor_new_1d(p->ctx, p->comm_type, (int64_t)largest);
    for (int j = 0; j < 2; j++) {
      struct rtp_tensor *t = j ? s->pool_g[i] : s->pool_w[i];
      if (!t || (!t->data && !rtp__tensor_alloc(p->ctx, t, RTP_ROLE_COMM)))
        return rtp_context_error(p->ctx, NULL);
      t->role = RTP_ROLE_COMM;
      rtp_tensor_set_name(t, "rtp.pool.%c%d", j ? 'g' : 'w', i);
    }
  }
  return RTP_OK;
}

struct rtp_tensor *rtp__sched_slot_at(struct rtp_parallel *p, struct rtp_tensor *slot,
                                      const struct rtp_tensor *full, int b, size_t offs) {
  int64_t first, len, ne[4];
  rtp__param_block(full, rtp_comm_size(p->comm), b, &first, &len);
  memcpy(ne, full->ne, sizeof(ne));
  ne[rtp__param_split_dim(full)] = len;
  size_t nb[4] = {rtp_type_size(slot->type)};
  for (int i = 1; i < 4; i++) nb[i] = nb[i - 1] * (size_t)ne[i - 1];
  return rtp_view(p->ctx, slot, RTP_MAX_DIMS, ne, nb, offs * nb[0]);
}

/*
 * The slot (of the first n_slots: the gradient slots, then the block slots), and the
 * element offset in it, where a hop of n elements lands, and the node that hop must
 * follow. Small blocks (biases, LayerNorm parameters) are packed one after another into a
 * slot: a packed hop waits only for what read the slot before it was last emptied, so it
 * can be posted long before its op, during the large products, and ranks do not meet at
 * every small op. A hop that fits in no slot empties the one filled longest ago, after
 * that slot's last reader.
 */
int rtp__sched_pack_hop(struct rtp_sched *s, int lo, int hi, size_t n, size_t *offs,
                        struct rtp_tensor **dep) {
  size_t padded = RTP_PAD(n, RTP_ALIGN / sizeof(float));
  int best = -1;
  for (int i = lo; i < hi; i++)
    if (s->used[i] > 0 && s->used[i] + n <= s->pool_elems && s->live[i] < RTP__PACKED_HOPS &&
        (best < 0 || s->used[i] > s->used[best]))
      best = i;
  if (best < 0) {
    best = lo;
    for (int i = lo + 1; i < hi; i++)
      if (s->stamp[i] < s->stamp[best]) best = i;
    s->base[best] = *rtp__sched_reader(s, best);
    s->used[best] = s->live[best] = 0;
  }
  *offs = s->used[best];
  *dep = s->base[best];
  s->used[best] += padded;
  s->live[best]++;
  s->stamp[best] = ++s->n_hops;
  return best;
}

void rtp__sched_micro(struct rtp_sched *s, const struct rtp_graph *g, int m) {
  s->micro_sink[m] = s->n_sink;
  s->micro_start[m] = g ? g->n_nodes : 0;
  for (int i = 0; i < 4 && m > 0; i++) s->used[i] = 0;
}

void rtp__sched_segment(struct rtp_sched *s) {
  for (int i = 0; i < 4; i++) s->used[i] = 0;
}

/* rtp and fsdp backward: a partial sum of a gradient passed on to rank + 1, while rank -
 * 1's partial sum of block s arrives in a gradient slot, packed as forward's first hops are
 * (rtp__sched_pack_hop); `after`: the hop before it, whose sum this one forwards. The slot it
 * lands in goes to *slot. */
struct rtp_tensor *rtp__sched_grad_hop(struct rtp_parallel *p, struct rtp_sched *s,
                                       struct rtp_tensor *send, const struct rtp_tensor *full,
                                       int b, struct rtp_tensor *after, int *slot) {
  int N = rtp_comm_size(p->comm), r = rtp_comm_rank(p->comm);
  size_t offs, n = rtp__param_largest_block(N, full); /* every rank packs alike */
  struct rtp_tensor *dep;
  *slot = rtp__sched_pack_hop(s, 0, 2, n, &offs, &dep);
  struct rtp_tensor *h = rtp_sendrecv(p->ctx, p->comm, send, (r + 1) % N,
                                      rtp__sched_slot_at(p, s->pool_g[*slot], full, b, offs),
                                      (r + N - 1) % N, after);
  if (h) {
    h->src[RTP_SRC_ORDER] = dep;
    if (rtp__sched_small(s, n)) h->flags |= RTP__FLAG_SMALL_HOP;
  }
  return h;
}

/* ---- moving transfers and sums ---------------------------------------------------- */

/* Moves node `t` (last in g) to just after position `at`. */
void rtp__graph_move_after(struct rtp_graph *g, int at, struct rtp_tensor *t) {
  memmove(&g->nodes[at + 2], &g->nodes[at + 1],
          (size_t)(g->n_nodes - 1 - (at + 1)) * sizeof(t));
  g->nodes[at + 1] = t;
}

/* Whether t reads, through views, what a transfer delivers: where it is the executor waits
 * for that transfer. */
static bool reads_transfer(const struct rtp_tensor *t) {
  for (int k = 0; k < RTP_MAX_SRC; k++)
    if (rtp__waited_transfer(t, k)) return true;
  return false;
}

/* What moves up with transfer t: the views it receives into, the cast (bf16) of the block
 * it sends, and an all-gather's copy of this rank's rows, which wait for no transfer;
 * NULL-terminated, t last. */
static int hoist_group(struct rtp_tensor *t, struct rtp_tensor **m) {
  int n = 0;
  bool gather = t->op_params[0] == RTP__COMM_ALLGATHER;
  for (int k = 0; k < 3; k++) {
    struct rtp_tensor *u = t->src[k];
    if (!u || reads_transfer(u)) continue;
    if (k < 2 ? rtp__is_view_op(u->op) || u->op == RTP_OP_CAST : gather) m[n++] = u;
  }
  m[n++] = t;
  m[n] = NULL;
  return n;
}

static bool in_group(struct rtp_tensor *const *m, const struct rtp_tensor *u) {
  for (; *m; m++)
    if (*m == u) return true;
  return false;
}

/* Whether node u must stay before the group: some member reads it (or is ordered after
 * it). */
static bool group_needs(struct rtp_tensor *const *m, const struct rtp_tensor *u) {
  for (; *m; m++)
    for (int k = 0; k < RTP_MAX_SRC; k++)
      if ((*m)->src[k] == u) return true;
  return false;
}

/* Where the first node that waits for transfer t is (as reads_transfer counts), kept in t's
 * extra while the passes run (the executor's, unused until then); -1: none. */
static intptr_t first_wait(const struct rtp_tensor *t) {
  return (intptr_t)t->extra - 1;
}

static void mark_first_waits(struct rtp_graph *g) {
  for (int i = 0; i < g->n_nodes; i++)
    if (g->nodes[i]->op == RTP_OP_COMM) g->nodes[i]->extra = (void *)(intptr_t)g->n_nodes + 1;
  for (int j = 0; j < g->n_nodes; j++) {
    struct rtp_tensor *u = g->nodes[j];
    if (rtp__is_view_op(u->op)) continue;
    for (int k = 0; k < RTP_MAX_SRC; k++) {
      struct rtp_tensor *c = rtp__waited_transfer(u, k);
      if (c && first_wait(c) > j) c->extra = (void *)(intptr_t)(j + 1);
    }
  }
}

/*
 * rtp and fsdp: every hop whose block is ready (not itself in flight), and every gather,
 * is moved up to just after the last node it depends on (its data, and the last reader of
 * the slot it lands in): the executor then posts it as early as the pool allows, but, if
 * it is large, never before a transfer needed before it: the link carries them in
 * posting order.
 * Nothing that waits moves, so no wait comes earlier, and both ranks move the same hops,
 * so they post in the same order.
 */
void rtp__graph_hoist_transfers(struct rtp_graph *g) {
  mark_first_waits(g);
  for (int i = 0; i < g->n_nodes; i++) {
    struct rtp_tensor *t = g->nodes[i], *m[5];
    if (t->op != RTP_OP_COMM || t->op_params[0] == RTP__COMM_ALLREDUCE || reads_transfer(t))
      continue;
    /* A large hop never passes a transfer needed before it: the link sends in posting
     * order. A small one may: it delays nothing by much. An fsdp gather passes the
     * reduce-scatter's hops (as PyTorch's FSDP posts the next unit's all-gather first):
     * their sums wait late, the gathered unit's first reader soon. */
    bool small = t->flags & RTP__FLAG_SMALL_HOP;
    bool gather = t->op_params[0] == RTP__COMM_ALLGATHER;
    int n = hoist_group(t, m), at = i;
    for (struct rtp_tensor *u; at > 0; at--) {
      u = g->nodes[at - 1];
      if (!in_group(m, u) && group_needs(m, u)) break;
      if (u->op == RTP_OP_COMM && !small && first_wait(u) <= first_wait(t) &&
          !(gather && u->op_params[0] == RTP__COMM_SENDRECV))
        break;
    }
    /* Nodes [at, i]: the group's first, in their order, then the rest in theirs. */
    for (int q = at, k = at; q <= i && k < at + n; q++) {
      struct rtp_tensor *u = g->nodes[q];
      if (!in_group(m, u)) continue;
      memmove(&g->nodes[k + 1], &g->nodes[k], (size_t)(q - k) * sizeof(u));
      g->nodes[k++] = u;
    }
  }
  for (int i = 0; i < g->n_nodes; i++)
    if (g->nodes[i]->op == RTP_OP_COMM) g->nodes[i]->extra = NULL;
}

static bool refers_to(const struct rtp_tensor *u, struct rtp_tensor *const *m) {
  for (int k = 0; k < RTP_MAX_SRC; k++)
    if (u->src[k] && in_group(m, u->src[k])) return true;
  return false;
}

static int node_pos(const struct rtp_graph *g, const struct rtp_tensor *t) {
  for (int i = 0; i < g->n_nodes; i++)
    if (g->nodes[i] == t) return i;
  return -1;
}

/*
 * rtp and fsdp: each owner's final sum of a block's gradient (and, with bf16, the cast of the
 * partial sum it adds) moves down to just before the first node that refers to it (the
 * next hop into its slot waits for it), or to the end. It waits for the last hop of that
 * gradient; late, the hop is long done, so the ranks do not meet there. Later sums move
 * first, so an earlier one can follow them down. Runs before hoist_transfers: a sum
 * moved down no longer holds back the hops posted before its transfer.
 */
int rtp__sched_sink_sums(struct rtp_graph *g, const struct rtp_sched *s, int max_products) {
  /* With micro-batches, the add that accumulates sum q into the gradient moves with it:
   * else it would hold the sum where it is, and the ranks would meet there. */
  struct rtp_tensor **acc = calloc((size_t)s->n_sink + 1, sizeof(*acc));
  if (!acc) return rtp__error(RTP_ENOMEM, "rtp_parallel_new: out of memory");
  for (int l = 0; l < g->n_leafs; l++)
    for (struct rtp_tensor *u = g->leafs[l]->grad; u && rtp__is_grad_acc(u); u = u->src[0])
      for (int q = 0; q < s->n_sink; q++)
        if (s->sink[q] == u->src[1]) acc[q] = u;
  for (int q = s->n_sink - 1; q >= 0; q--) {
    struct rtp_tensor *a = s->sink[q], *m[4] = {NULL};
    int n = 0;
    if (a->src[0] && a->src[0]->op == RTP_OP_CAST) m[n++] = a->src[0];
    m[n++] = a;
    if (acc[q]) m[n++] = acc[q];
    int i = node_pos(g, m[0]), j = node_pos(g, a), mb = 0;
    if (i < 0 || j < i) continue;
    while (mb + 1 < s->n_micro && s->micro_sink[mb + 1] <= q) mb++;
    int end = mb + 1 < s->n_micro ? s->micro_start[mb + 1] : g->n_nodes, products = 0;
    while (j + 1 < end &&
           !(max_products > 0 && g->nodes[j + 1]->op == RTP_OP_MUL_MAT &&
             ++products > max_products) &&
           (in_group(m, g->nodes[j + 1]) ||
            (!refers_to(g->nodes[j + 1], m) &&
             !(j + 2 < g->n_nodes && g->nodes[j + 1]->op == RTP_OP_CAST &&
               g->nodes[j + 2]->src[0] == g->nodes[j + 1] && refers_to(g->nodes[j + 2], m)))))
      j++; /* (a later sum sunk already stays right after its cast) */
    /* Nodes [i, j]: the others first, in their order, then the group in its. */
    for (int q2 = j, k = j; q2 >= i && k > j - n; q2--) {
      struct rtp_tensor *u = g->nodes[q2];
      if (!in_group(m, u)) continue;
      memmove(&g->nodes[q2], &g->nodes[q2 + 1], (size_t)(k - q2) * sizeof(u));
      g->nodes[k--] = u;
    }
  }
  free(acc);
  return RTP_OK;
}
