/* rtp-rotate.c - the rtp strategy (Rotated Tensor Parallelism): each rank owns one block
 * of rows of every parameter, with its gradient and optimizer state. Every op that reads a
 * parameter becomes a schedule of block ops and transfers closed by a ROT node: forward,
 * the blocks rotate around the ring, each rank applying every block in turn to its own
 * batch; backward (the ROT node's, reached through the plan's hook), they rotate the other
 * way with their gradients, which arrive at their owner summed over all ranks. The blocks
 * are fetched again in backward rather than kept, which is what keeps memory at 1/N.
 * docs/parallel.md, "rtp". */
#include "rtp-strategy.h"

#include <string.h>

struct rotate {
  struct rtp_sched s; /* forward rotation uses the block slots, and packs its first hops */
  /* The previous op's last forward step, so the next op's first hop is posted before it. */
  struct rtp_tensor *prev_apply;
  /* backward: ops done so far, and the first node of the last one's final step (NULL
   * when that step has none but its sum, whose order edge is taken) */
  int n_backward;
  struct rtp_tensor *last_step;
};

/* ---- forward -------------------------------------------------------------------- */

static struct rtp_tensor *slot_as(struct rtp_parallel *p, struct rtp_tensor *slot,
                                  const struct rtp_tensor *full, int s) {
  return rtp__sched_slot_at(p, slot, full, s, 0);
}

/* What travels for block or gradient t (f32): t itself, or its bf16 rounding. The
 * identity for f32, so the default graph is the one without this option. */
static struct rtp_tensor *to_wire(struct rtp_parallel *p, struct rtp_tensor *t) {
  return p->comm_type == RTP_TYPE_F32 ? rtp_cont(p->ctx, t) : rtp_cast(p->ctx, t, p->comm_type);
}

/* A travelling copy as kernels take it (f32): the cast is ordered after `after` so that
 * it, which now reads the transfer, waits for it where the compute it feeds did. */
static struct rtp_tensor *from_wire(struct rtp_parallel *p, struct rtp_tensor *t,
                                    struct rtp_tensor *after) {
  if (!t || t->type == RTP_TYPE_F32) return t;
  struct rtp_tensor *c = rtp_cast(p->ctx, t, RTP_TYPE_F32);
  if (c) c->src[RTP_SRC_ORDER] = after;
  return c;
}

/* The part of the op that block w (= block s of the parameter) serves. */
static struct rtp_tensor *apply_block(struct rtp_parallel *p, enum rtp__rot_kind kind,
                                      const struct rtp_tensor *full, struct rtp_tensor *w,
                                      int s, struct rtp_tensor *x) {
  int64_t first, len;
  rtp__param_block(full, rtp_comm_size(p->comm), s, &first, &len);
  switch (kind) {
    case RTP__ROT_MUL_MAT:
      return rtp_mul_mat(p->ctx, w, x);
    case RTP__ROT_GET_ROWS:
      return rtp__get_rows_block(p->ctx, w, x, first);
    case RTP__ROT_ADD:
      return rtp_add(p->ctx, rtp__slice(p->ctx, x, rtp__param_split_dim(full), first, len), w);
    default:
      return rtp_mul(p->ctx, rtp__slice(p->ctx, x, rtp__param_split_dim(full), first, len), w);
  }
}

/* Blocks of the result, by block index, made whole: summed (get_rows, where each
 * block contributes zero rows for the tokens it does not hold) or concatenated along
 * the dimension the blocks split. */
static struct rtp_tensor *assemble(struct rtp_parallel *p, enum rtp__rot_kind kind, int dim,
                                   struct rtp_tensor **parts) {
  struct rtp_tensor *y = parts[0];
  for (int s = 1; s < rtp_comm_size(p->comm); s++)
    y = kind == RTP__ROT_GET_ROWS ? rtp_add(p->ctx, y, parts[s])
                                  : rtp_concat(p->ctx, y, parts[s], dim);
  return y;
}

/* Makes `part`, block s's part of the op's result, write into its slice of one result y
 * (created by the first block) instead of memory of its own: no concatenation. */
static int write_into(struct rtp_parallel *p, enum rtp__rot_kind kind,
                      const struct rtp_tensor *full, int s, struct rtp_tensor *part,
                      struct rtp_tensor **y) {
  int dim = kind == RTP__ROT_MUL_MAT ? 0 : rtp__param_split_dim(full);
  int64_t first, len, ne[4];
  rtp__param_block(full, rtp_comm_size(p->comm), s, &first, &len);
  if (!*y) {
    memcpy(ne, part->ne, sizeof(ne));
    ne[dim] = kind == RTP__ROT_MUL_MAT ? full->ne[1] : full->ne[rtp__param_split_dim(full)];
    *y = rtp__new_node(p->ctx, RTP_OP_EMPTY, RTP_TYPE_F32, ne, NULL, NULL);
    if (!*y) return rtp_context_error(p->ctx, NULL);
  }
  memcpy(part->nb, (*y)->nb, sizeof(part->nb));
  part->view_src = *y;
  part->view_offs = (size_t)first * (*y)->nb[dim];
  part->src[2] = *y; /* placed after it, and keeps it alive */
  return RTP_OK;
}

/* Whether node u of the one-device graph is read by any node but t (views count). */
static bool read_elsewhere(const struct rtp_graph *g, const struct rtp_tensor *u,
                           const struct rtp_tensor *t) {
  for (int i = 0; i < g->n_nodes; i++) {
    const struct rtp_tensor *v = g->nodes[i];
    for (int s = 0; s < RTP_MAX_SRC && v != t; s++)
      if (v->src[s] == u) return true;
  }
  return false;
}

/* A bias added to a product writes into the product's memory, as one device's in-place
 * add does, rather than into a second buffer of the product's size. Safe when nothing
 * else reads the product: the one-device graph has no other reader, it is no output, and
 * neither the product's backward nor the add's reads it. Returns the memory to write
 * into, or NULL. */
static struct rtp_tensor *add_in_place(struct rtp_parallel *p, const struct rtp_tensor *t,
                                       struct rtp_tensor *x) {
  const struct rtp_tensor *u = t->src[0];
  struct rtp_tensor *b = x->view_src ? x->view_src : x;
  if (u->op != RTP_OP_MUL_MAT || (u->flags & (RTP_FLAG_OUTPUT | RTP_FLAG_LOSS)) ||
      read_elsewhere(p->src, u, t))
    return NULL;
  if (b->op != RTP_OP_EMPTY || x->type != RTP_TYPE_F32 || x->view_offs != 0 ||
      !rtp_tensor_is_contiguous(x) || rtp_tensor_nbytes(x) != rtp_tensor_nbytes(b))
    return NULL;
  return b;
}

/* y = op(param, x) on this rank. rtp: step k applies block (rank + k) % N, which arrived
 * from rank + 1 during step k - 1; step 0 uses the owned block and never waits. */
static struct rtp_tensor *rot_forward(struct rtp_parallel *p, const struct rtp_tensor *t,
                                      const struct rtp_tensor *full) {
  struct rotate *st = p->state;
  struct rtp_sched *sc = &st->s;
  enum rtp__rot_kind kind;
  struct rtp_tensor *x, *own;
  if (rtp__rot_operands(p, t, full, &kind, &x, &own)) return NULL;
  int N = rtp_comm_size(p->comm), r = rtp_comm_rank(p->comm);
  int left = (r + N - 1) % N, right = (r + 1) % N;
  /* Order edges (RTP_SRC_ORDER) lay the steps out as: post the transfer of step k + 1,
   * compute step k. The first hop (of the owned block, ready from the start) lands in a
   * gradient slot (rtp__sched_pack_hop), so it depends only on that slot's earlier
   * readers and rot_finish posts it as early as that allows (hoisting); later hops
   * alternate between the block slots. A transfer into a slot waits (src[3]) for whatever
   * last read the slot. */
  struct rtp_tensor *parts[RTP_MAX_WORLD] = {0}, *held = own, *prev = NULL;
  struct rtp_tensor *y = kind == RTP__ROT_ADD ? add_in_place(p, t, x) : NULL;
  struct rtp_tensor **reader[RTP_MAX_WORLD] = {0}; /* of the slot step k reads */
  /* Hops are sized as the largest block, not the one that arrives: every rank then packs
   * alike, and posts its hops in the same order as the others. */
  size_t n = rtp__param_largest_block(N, full);
  for (int k = 0; k < N; k++) {
    int s = (r + k) % N;
    struct rtp_tensor *next = NULL;
    /* With bf16 the owned block is rounded once per op: that copy travels, and this rank
     * computes with it too, so every rank applies the same (rounded) weights. */
    if (k == 0 && !(held = to_wire(p, own))) return NULL;
    if (k + 1 < N) {
      size_t offs = 0;
      struct rtp_tensor *slot, *dep;
      if (k == 0) { /* on 2 ranks forward has no other hops: the block slots are free */
        int i = rtp__sched_pack_hop(sc, 0, N == 2 ? 4 : 2, n, &offs, &dep);
        slot = rtp__sched_slot(sc, i);
        reader[k + 1] = rtp__sched_reader(sc, i);
      } else {
        slot = sc->pool_w[(k + 1) % 2];
        dep = sc->w_reader[(k + 1) % 2];
        reader[k + 1] = &sc->w_reader[(k + 1) % 2];
      }
      next = rtp_sendrecv(p->ctx, p->comm, held, left,
                          rtp__sched_slot_at(p, slot, full, (s + 1) % N, offs), right,
                          k ? prev : NULL);
      if (!next) return NULL;
      next->src[RTP_SRC_ORDER] = dep;
      if (rtp__sched_small(sc, n)) next->flags |= RTP__FLAG_SMALL_HOP;
    }
    /* Step k's block as f32, cast once the next hop is posted. */
    struct rtp_tensor *w = from_wire(p, held, next ? next : prev);
    parts[s] = w ? apply_block(p, kind, full, w, s, x) : NULL;
    if (!parts[s] || (kind != RTP__ROT_GET_ROWS && write_into(p, kind, full, s, parts[s], &y)))
      return NULL;
    /* Step 0 follows the previous op's last step: the readers of the slots then come in
     * the order this pass sees them, which rtp__sched_pack_hop's dependencies rely on. */
    parts[s]->src[RTP_SRC_ORDER] = k == 0 ? st->prev_apply : next ? next : prev;
    /* Step k reads its slot; it also waits for hop k, which sent from step k - 1's. */
    if (k >= 1) *reader[k] = parts[s];
    if (k >= 2) *reader[k - 1] = parts[s];
    prev = parts[s];
    held = next;
  }
  st->prev_apply = prev;
  if (kind == RTP__ROT_GET_ROWS) { /* blocks give zero rows for tokens they do not hold: sum */
    struct rtp_tensor *y = assemble(p, kind, 0, parts);
    return y ? rtp__rot_handle(p, t, full, kind, x, own, y) : NULL;
  }
  /* The other ops' blocks wrote their parts of the result in place. */
  struct rtp_tensor *h = rtp__rot_handle(p, t, full, kind, x, own, parts[0]->view_src);
  if (h) h->src[2] = prev; /* after every block (they are chained by order edges) */
  return h;
}

/* ---- backward ------------------------------------------------------------------- */

/* dy's part that block s produced (the slice, or all of it for get_rows). */
static struct rtp_tensor *dy_part(struct rtp_parallel *p, enum rtp__rot_kind kind, int dim,
                                  const struct rtp_tensor *full, struct rtp_tensor *dy, int s) {
  if (kind == RTP__ROT_GET_ROWS) return dy;
  int64_t first, len;
  rtp__param_block(full, rtp_comm_size(p->comm), s, &first, &len);
  return rtp__slice(p->ctx, dy, kind == RTP__ROT_MUL_MAT ? 0 : dim, first, len);
}

/*
 * Step k = N-1 .. 0 holds block s = (rank + k) % N and the gradient of s summed over the
 * ranks that held it before; it adds its own part and passes both on to rank + 1, so at
 * k = 0 each rank holds its own block with the gradient summed over all ranks. The first
 * block is fetched from its owner; the last hop carries only the gradient.
 */
static void rot_backward(struct rtp_parallel *p, struct rtp_tensor *t, struct rtp_tensor *dy,
                         struct rtp_tensor **dx, struct rtp_tensor **dp) {
  struct rotate *st = p->state;
  struct rtp_sched *sc = &st->s;
  struct rtp_context *ctx = p->ctx;
  struct rtp_tensor *full = rtp__rot_full(t);
  enum rtp__rot_kind kind = (enum rtp__rot_kind)t->op_params[0];
  int dim = t->op_params[1], N = rtp_comm_size(p->comm), r = rtp_comm_rank(p->comm);
  int left = (r + N - 1) % N, right = (r + 1) % N;
  struct rtp_tensor *x = t->src[0], *own = t->src[1];
  /* Only ops whose input gradient needs the block fetch it again (mul_mat, mul). Step m
   * = N-1-k holds its block in slot (j + m) % 2, j counting the ops' backward passes, so
   * the first block lands in the slot the previous op's backward left free and can be
   * fetched during that op's last step (an order edge on that step's first node). A
   * transfer into a slot also waits (src[3]) for the node that last read it. */
  bool need_w = dx && (kind == RTP__ROT_MUL_MAT || kind == RTP__ROT_MUL);
  int j = st->n_backward++;
  struct rtp_tensor *parts[RTP_MAX_WORLD] = {0}, *dx_sum = NULL, *w = NULL;
  size_t n_block = rtp__param_largest_block(N, full); /* every rank packs alike */
  bool small = rtp__sched_small(sc, n_block);
  /* On 2 ranks this fetch is the op's only one: it is packed into the block slots as
   * forward's first hops are (slots 2 and 3 of rtp__sched_pack_hop). */
  int w_slot = j % 2;
  size_t w_offs = 0;
  struct rtp_tensor *w_dep = sc->w_reader[j % 2];
  if (need_w && N == 2) w_slot = rtp__sched_pack_hop(sc, 2, 4, n_block, &w_offs, &w_dep) - 2;
  if (need_w) {
    w = rtp_sendrecv(ctx, p->comm, to_wire(p, own), right,
                     rtp__sched_slot_at(p, sc->pool_w[w_slot], full, left, w_offs), left,
                     w_dep);
    if (w && small) w->flags |= RTP__FLAG_SMALL_HOP;
    if (w && st->last_step) st->last_step->src[RTP_SRC_ORDER] = w;
  }
  struct rtp_tensor *g_in = NULL, *g = NULL, *last_read = NULL;
  /* On 2 ranks the contributions to both blocks' gradients come from one pass over the
   * whole parameter, whose ranges are the blocks': for a product one GEMM over the whole
   * of dW (faster per FLOP than two halves, docs/parallel.md), for a bias or LayerNorm
   * one sum over dy's rows instead of two. The
   * whole gradient (two blocks of planned memory) lives until the owner's sum reads its
   * half. With more ranks the partial sums in between are added at their steps, which
   * need a product of their own to wait behind, so each block's part is computed at its
   * step; an embedding's blocks scatter only their own rows either way. */
  struct rtp_tensor *all = NULL;
  if (kind != RTP__ROT_GET_ROWS && N == 2) {
    if (!(all = rtp__block_grad(ctx, kind, dim, full, x, dy, 0,
                                full->ne[rtp__param_split_dim(full)])))
      return;
    all->src[RTP_SRC_ORDER] = w; /* computed while the first block arrives */
    last_read = all;
  }
  int g_slot = 0;
  for (int k = N - 1, m = 0; k >= 0; k--, m++) {
    int s = (r + k) % N;
    struct rtp_tensor *held = k == 0 ? own : w, *next_w = NULL;
    struct rtp_tensor *dys = dy_part(p, kind, dim, full, dy, s);
    int64_t first, len;
    rtp__param_block(full, N, s, &first, &len);
    struct rtp_tensor *contrib;
    if (all) {
      contrib = rtp__slice(ctx, all, rtp__param_split_dim(full), first, len);
    } else { /* shaped as block s, whether or not the block itself is here */
      struct rtp_tensor *shape = k == 0 ? own : slot_as(p, sc->pool_g[0], full, s);
      if ((contrib = rtp__block_grad(ctx, kind, dim, shape, x, dys, first, len))) {
        contrib->src[RTP_SRC_ORDER] = last_read;
        last_read = contrib;
      }
    }
    if (!contrib) return;
    /* The step's first node, which the next op's fetch is posted before: with `all`, the
     * dx product (set below), or none: the sum's order edge chains its slot's readers. */
    if (k == 0) st->last_step = all ? NULL : contrib;
    if (need_w && k > 1) { /* at k = 1 the next block is our own */
      int slot = (j + m + 1) % 2;
      next_w = rtp_sendrecv(ctx, p->comm, held, right,
                            slot_as(p, sc->pool_w[slot], full, (s + N - 1) % N), left, contrib);
      if (next_w) next_w->src[RTP_SRC_ORDER] = sc->w_reader[slot];
    }
    if (dx) {
      /* dx reads the block as f32; at k = 0 the owned block rounded like every rank's
       * copy of it. The casts come where d comes: after the next hop is posted. */
      struct rtp_tensor *after = next_w ? next_w : last_read, *hw = held;
      if (need_w) {
        struct rtp_tensor *wire = k == 0 ? to_wire(p, own) : held;
        if (wire && wire != held && wire->op == RTP_OP_CAST) wire->src[RTP_SRC_ORDER] = after;
        hw = from_wire(p, wire, after);
      }
      struct rtp_tensor *d = hw ? rtp__block_dx(ctx, kind, hw, dys, dx_sum) : NULL;
      if (d) {
        d->src[RTP_SRC_ORDER] = after;
        last_read = d;
      }
      if (need_w && k > 0) { /* d reads this step's slot and waited for the hop that
                              * sent from the previous step's */
        sc->w_reader[m == 0 ? w_slot : (j + m) % 2] = d;
        if (m > 0) sc->w_reader[m == 1 ? w_slot : (j + m - 1) % 2] = d;
      }
      if (kind == RTP__ROT_MUL_MAT) dx_sum = d;
      parts[s] = d;
      if (k == 0 && all) st->last_step = d;
    }
    /* The partial sum arrives as it travels (bf16: rounded) and is summed in f32; its
     * cast waits for the transfer after this step's contribution, as the add did. */
    g = g_in ? rtp_add(ctx, from_wire(p, g_in, all ? last_read : contrib), contrib) : contrib;
    if (g_in && g) {
      /* The add reads the slot after what read it before (rtp__sched_pack_hop relies on
       * that order). The owner's sum is read by nothing in the step (the optimizer reads
       * it after), so it sinks late (rot_finish), where its hop is long done. */
      g->src[RTP_SRC_ORDER] = sc->g_reader[g_slot];
      sc->g_reader[g_slot] = g;
      if (k == 0) sc->sink[sc->n_sink++] = g;
    }
    if (k > 0) /* the summed gradient of s goes on to the next holder */
      g_in = rtp__sched_grad_hop(p, sc, to_wire(p, g), full, (s + N - 1) % N, g_in, &g_slot);
    w = next_w;
  }
  *dp = g;
  if (!dx) return;
  if (kind == RTP__ROT_MUL_MAT)
    *dx = dx_sum;
  else if (kind == RTP__ROT_MUL)
    *dx = assemble(p, kind, dim, parts);
  else if (kind == RTP__ROT_ADD)
    *dx = dy;
}

/* ---- the strategy ----------------------------------------------------------------- */

static int rot_prepare(struct rtp_parallel *p) {
  struct rotate *st = rtp__ctx_alloc(p->ctx, sizeof(*st), "the rtp plan");
  if (!st) return rtp_context_error(p->ctx, NULL);
  *st = (struct rotate){0};
  p->state = st;
  return rtp__sched_init(p, &st->s, 0);
}

/* Rank r owns block r of every parameter. */
static struct rtp_shard rot_shard(const struct rtp_parallel *p, const struct rtp_tensor *t) {
  struct rtp_shard s = {rtp__param_split_dim(t), 1, 0, 0};
  rtp__param_block(t, rtp_comm_size(p->comm), rtp_comm_rank(p->comm), &s.first, &s.len);
  return s;
}

/* Each micro-batch's schedule starts as the first one's: its first op follows no forward
 * step, its backward's first fetch no backward step (those came before it), and its
 * first hops empty the slots they land in. */
static void rot_micro(struct rtp_parallel *p, int m) {
  struct rotate *st = p->state;
  st->prev_apply = NULL;
  st->last_step = NULL;
  rtp__sched_micro(&st->s, p->graph, m);
}

/* A segment's first op follows no step of another, and its first hops empty their slots:
 * autodiff appends each segment's backward by itself, after whatever came before. */
static void rot_segment(struct rtp_parallel *p) {
  struct rotate *st = p->state;
  st->prev_apply = NULL;
  st->last_step = NULL;
  rtp__sched_segment(&st->s);
}

static struct rtp_tensor *rot_node(struct rtp_parallel *p, int i, const struct rtp_tensor *t) {
  (void)i;
  const struct rtp_tensor *param = rtp__param_read(t);
  return param ? rot_forward(p, t, param) : NULL;
}

/* The owners' sums late, then every ready hop early. */
static int rot_finish(struct rtp_parallel *p) {
  struct rotate *st = p->state;
  int rc = rtp__sched_sink_sums(p->graph, &st->s, p->in_backward ? RTP__SINK_IN_BACKWARD : 0);
  if (!rc) rtp__graph_hoist_transfers(p->graph);
  return rc;
}

/* Each rank's gradients are disjoint shares of the whole: their norm needs every rank. */
static void rot_optimizer(const struct rtp_parallel *p, struct rtp_optimizer *opt) {
  rtp__optimizer_set_comm(opt, p->comm);
}

const struct rtp_strategy_i rtp__strategy_rtp = {
    .name = "rtp",
    .unit_ops = true,
    .prepare = rot_prepare,
    .shard = rot_shard,
    .micro = rot_micro,
    .segment = rot_segment,
    .node = rot_node,
    .backward = rot_backward,
    .finish = rot_finish,
    .optimizer = rot_optimizer,
};
