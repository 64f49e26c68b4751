/* rtp-fsdp.c - the fsdp strategy (ZeRO-3): each rank owns the same block of rows of every
 * parameter as under rtp, and gathers parameters whole before the ops that read them, a
 * unit at a time (rtp_tensor_set_fsdp_unit) into one of two slots, the next unit's gathers
 * running during this one's compute. Backward gathers a unit again for the input
 * gradients that need it, then reduce-scatters each parameter's gradient around the
 * ring. docs/parallel.md, "fsdp". */
#include "rtp-strategy.h"

#include <string.h>

struct fsdp {
  struct rtp_sched s; /* pool_w: two unit slots; pool_g: the reduce-scatter's hops */
  /* the unit each whole-parameter slot holds (0: none; unit_key), which slot was read
   * last, where each parameter (by leaf) lies in its unit's slot, and each slot's
   * gathered parameters (by leaf). The readers of a slot are chained by order edges, so
   * s.w_reader[i] is the last one. */
  int unit_in[2], recent;
  size_t *unit_offs;
  struct rtp_tensor **gathered[2];
};

/* Which parameters are gathered together: a marked unit (> 0), or the parameter alone
 * (leaf: its index among the leaves). */
static int unit_key(const struct rtp_tensor *param, int leaf) {
  return param->op_params[2] > 0 ? param->op_params[2] : -(leaf + 1);
}

/*
 * Gathers every parameter of `unit` whole into slot i, each at its place in the slot
 * (unit_offs): this rank's rows copied in, then an all-gather of every rank's rows. The
 * copies wait (an order edge) for the slot's last reader; hoist_transfers then posts the
 * gathers as early as that allows: while the unit before computes.
 */
static int fsdp_gather(struct rtp_parallel *p, int unit, int i) {
  struct fsdp *f = p->state;
  struct rtp_context *ctx = p->ctx;
  size_t esize = rtp_type_size(f->s.pool_w[i]->type);
  f->unit_in[i] = unit;
  for (int q = 0; q < p->src->n_leafs; q++) {
    const struct rtp_tensor *full = p->src->leafs[q];
    if (!(full->flags & RTP_FLAG_PARAM) || unit_key(full, q) != unit) continue;
    size_t nb[4] = {esize}, offs = f->unit_offs[q] * esize;
    for (int d = 1; d < 4; d++) nb[d] = nb[d - 1] * (size_t)full->ne[d - 1];
    struct rtp_tensor *w = rtp_view(ctx, f->s.pool_w[i], RTP_MAX_DIMS, full->ne, nb, offs);
    struct rtp_tensor *mine = rtp_dup(ctx, p->map[p->src->n_nodes + q]);
    if (!w || !mine) return rtp_context_error(ctx, NULL);
    int64_t first, len;
    rtp__param_block(full, rtp_comm_size(p->comm), rtp_comm_rank(p->comm), &first, &len);
    mine->view_src = f->s.pool_w[i]; /* the copy writes its rows of the slot */
    mine->view_offs = offs + (size_t)first * nb[rtp__param_split_dim(full)];
    mine->data = (char *)f->s.pool_w[i]->data + mine->view_offs;
    mine->src[RTP_SRC_ORDER] = f->s.w_reader[i];
    struct rtp_tensor *all = rtp__allgather_rows(ctx, p->comm, w, mine);
    if (!all || !(f->gathered[i][q] = rtp_reshape(ctx, all, RTP_MAX_DIMS, full->ne)))
      return rtp_context_error(ctx, NULL);
  }
  return RTP_OK;
}

/* The whole of `full` from the slot that holds its unit, which is gathered into the
 * other slot than the one read last unless an earlier op left it there. */
static struct rtp_tensor *fsdp_param(struct rtp_parallel *p, const struct rtp_tensor *full,
                                     int *slot) {
  struct fsdp *f = p->state;
  int leaf = rtp__parallel_index(p, full) - p->src->n_nodes, unit = unit_key(full, leaf);
  int i = f->unit_in[0] == unit ? 0 : f->unit_in[1] == unit ? 1 : -1;
  if (i < 0 && fsdp_gather(p, unit, i = f->recent == 0 ? 1 : 0)) return NULL;
  *slot = i;
  return f->gathered[i][leaf];
}

/* Node u reads slot i: it follows the slot's earlier readers (an order edge), so the
 * last one built is the last one run, which the next gather into the slot waits for. */
static void fsdp_read(struct rtp_parallel *p, int i, struct rtp_tensor *u) {
  struct fsdp *f = p->state;
  if (!u->src[RTP_SRC_ORDER]) u->src[RTP_SRC_ORDER] = f->s.w_reader[i];
  f->s.w_reader[i] = u;
  f->recent = i;
}

/* The op itself, with the whole parameter w. */
static struct rtp_tensor *apply_whole(struct rtp_parallel *p, enum rtp__rot_kind kind,
                                      struct rtp_tensor *w, struct rtp_tensor *x) {
  switch (kind) {
    case RTP__ROT_MUL_MAT:
      return rtp_mul_mat(p->ctx, w, x);
    case RTP__ROT_GET_ROWS:
      return rtp_get_rows(p->ctx, w, x);
    case RTP__ROT_ADD:
      return rtp_add(p->ctx, x, w);
    default:
      return rtp_mul(p->ctx, x, w);
  }
}

static struct rtp_tensor *fsdp_forward(struct rtp_parallel *p, const struct rtp_tensor *t,
                                       const struct rtp_tensor *full) {
  enum rtp__rot_kind kind;
  struct rtp_tensor *x, *own;
  if (rtp__rot_operands(p, t, full, &kind, &x, &own)) return NULL;
  int slot;
  struct rtp_tensor *w = fsdp_param(p, full, &slot);
  struct rtp_tensor *y = w ? apply_whole(p, kind, w, x) : NULL;
  if (!y) return NULL;
  fsdp_read(p, slot, y);
  return rtp__rot_handle(p, t, full, kind, x, own, y);
}

/*
 * Backward: the whole gradient needs the parameter's shape only, dx (of a product or a
 * LayerNorm weight) the parameter itself, gathered again with its unit. The gradient is
 * then reduce-scattered around the ring over blocks of rows: at step k rank r passes the
 * partial sum of block r - k on to r + 1 and adds its own part to the partial of block
 * r - k - 1 it receives, so after N - 1 steps it holds its own block summed over all
 * ranks. The hops land in the gradient slots as rtp's do (rtp__sched_pack_hop), and the
 * owner's final sum is moved late (fsdp_finish), where its hop is done.
 */
static void fsdp_backward(struct rtp_parallel *p, struct rtp_tensor *t, struct rtp_tensor *dy,
                          struct rtp_tensor **dx, struct rtp_tensor **dp) {
  struct fsdp *f = p->state;
  struct rtp_context *ctx = p->ctx;
  struct rtp_tensor *full = rtp__rot_full(t), *x = t->src[0];
  enum rtp__rot_kind kind = (enum rtp__rot_kind)t->op_params[0];
  int dim = t->op_params[1], N = rtp_comm_size(p->comm), r = rtp_comm_rank(p->comm), slot;
  if (dx) *dx = kind == RTP__ROT_ADD ? dy : NULL;
  if (dx && (kind == RTP__ROT_MUL_MAT || kind == RTP__ROT_MUL)) {
    struct rtp_tensor *w = fsdp_param(p, full, &slot);
    if (!w || !(*dx = rtp__block_dx(ctx, kind, w, dy, NULL))) return;
    fsdp_read(p, slot, *dx);
  }
  /* The whole parameter is the one block [0, rows) of a world of one. */
  struct rtp_tensor *gw = rtp__block_grad(ctx, kind, dim, full, x, dy, 0, full->ne[dim]);
  struct rtp_tensor *acc = NULL, *in = NULL;
  for (int k = 1; k < N && gw; k++) {
    int b_send = ((r - k) % N + N) % N, b_recv = ((r - k - 1) % N + N) % N, i;
    int64_t fr, len;
    rtp__param_block(full, N, b_send, &fr, &len);
    struct rtp_tensor *send = acc ? acc : rtp_cont(ctx, rtp__slice(ctx, gw, dim, fr, len));
    if (!(in = rtp__sched_grad_hop(p, &f->s, send, full, b_recv, in, &i))) return;
    rtp__param_block(full, N, b_recv, &fr, &len);
    if (!(acc = rtp_add(ctx, in, rtp_cont(ctx, rtp__slice(ctx, gw, dim, fr, len))))) return;
    acc->src[RTP_SRC_ORDER] = f->s.g_reader[i]; /* pack_hop relies on the readers' order */
    f->s.g_reader[i] = acc;
  }
  if (acc) f->s.sink[f->s.n_sink++] = acc;
  *dp = acc;
}

/* ---- the strategy ----------------------------------------------------------------- */

/* Where each parameter lies in its unit's slot (parameters of a unit one after
 * another, in the order of the leaves), and the elements of the largest unit. */
static size_t fsdp_units(struct rtp_parallel *p, struct fsdp *f) {
  const struct rtp_graph *src = p->src;
  size_t largest = 0;
  for (int q = 0; q < src->n_leafs; q++) {
    const struct rtp_tensor *t = src->leafs[q];
    if (!(t->flags & RTP_FLAG_PARAM) || !rtp__parallel_leaf_here(p, q)) continue;
    size_t offs = 0; /* after the parameter before it in its unit */
    for (int e = q - 1; e >= 0 && !offs; e--)
      if ((src->leafs[e]->flags & RTP_FLAG_PARAM) &&
          unit_key(src->leafs[e], e) == unit_key(t, q))
        offs = f->unit_offs[e] +
               RTP_PAD((size_t)rtp_tensor_nelements(src->leafs[e]), RTP_ALIGN / sizeof(float));
    f->unit_offs[q] = offs;
    if (offs + (size_t)rtp_tensor_nelements(t) > largest)
      largest = offs + (size_t)rtp_tensor_nelements(t);
  }
  return largest;
}

/* Two slots for the largest unit (one in use, one being gathered) and two gradient slots
 * for the largest block (the reduce-scatter ring). */
static int fsdp_prepare(struct rtp_parallel *p) {
  struct fsdp *f = rtp__ctx_alloc(p->ctx, sizeof(*f), "the fsdp plan");
  if (!f) return rtp_context_error(p->ctx, NULL);
  *f = (struct fsdp){.recent = -1};
  p->state = f;
  size_t n = (size_t)p->src->n_leafs;
  f->unit_offs = rtp__ctx_alloc(p->ctx, sizeof(size_t) * n + 1, "fsdp's unit layout");
  for (int i = 0; i < 2; i++)
    f->gathered[i] = rtp__ctx_alloc(p->ctx, sizeof(struct rtp_tensor *) * n + 1,
                                    "fsdp's gathered parameters");
  if (!f->unit_offs || !f->gathered[0] || !f->gathered[1])
    return rtp_context_error(p->ctx, NULL);
  return rtp__sched_init(p, &f->s, fsdp_units(p, f));
}

/* Rank r owns block r of every parameter, as under rtp. */
static struct rtp_shard fsdp_shard(const struct rtp_parallel *p, const struct rtp_tensor *t) {
  struct rtp_shard s = {rtp__param_split_dim(t), 1, 0, 0};
  rtp__param_block(t, rtp_comm_size(p->comm), rtp_comm_rank(p->comm), &s.first, &s.len);
  return s;
}

static void fsdp_micro(struct rtp_parallel *p, int m) {
  struct fsdp *f = p->state;
  rtp__sched_micro(&f->s, p->graph, m);
}

static struct rtp_tensor *fsdp_node(struct rtp_parallel *p, int i, const struct rtp_tensor *t) {
  (void)i;
  const struct rtp_tensor *param = rtp__param_read(t);
  return param ? fsdp_forward(p, t, param) : NULL;
}

/* The owners' sums late, then every gather and ready hop early: the next unit's gathers
 * are posted while the unit before it computes. */
static int fsdp_finish(struct rtp_parallel *p) {
  struct fsdp *f = p->state;
  int rc = rtp__sched_sink_sums(p->graph, &f->s, p->in_backward ? RTP__SINK_IN_BACKWARD : 0);
  if (!rc) rtp__graph_hoist_transfers(p->graph);
  return rc;
}

/* Each rank's gradients are disjoint shares of the whole: their norm needs every rank. */
static void fsdp_optimizer(const struct rtp_parallel *p, struct rtp_optimizer *opt) {
  rtp__optimizer_set_comm(opt, p->comm);
}

const struct rtp_strategy_i rtp__strategy_fsdp = {
    .name = "fsdp",
    .prepare = fsdp_prepare,
    .shard = fsdp_shard,
    .micro = fsdp_micro,
    .node = fsdp_node,
    .backward = fsdp_backward,
    .finish = fsdp_finish,
    .optimizer = fsdp_optimizer,
};
