/* rtp-parallel.c - passes that turn a one-device forward graph into one rank's training
 * graph: ddp (every rank holds everything; gradients all-reduced in buckets during
 * backward), fsdp (parameters gathered whole, a unit at a time), rtp (each rank owns one block
 * of every parameter; blocks rotate around the ring, forward one way and with their gradients
 * the other way back) and tp (Megatron's column- and row-parallel layers, marked on the
 * parameters with rtp_set_tp; the nodes between them are rebuilt for the rank's part).
 *
 * The model is built once, for one device, in a context that may give parameters no
 * memory (no_alloc). The pass clones its forward graph into the rank's context node by
 * node, replacing what the strategy changes, then builds backward there. For rtp, every
 * op that reads a parameter becomes a schedule of block ops and transfers closed by a
 * ROT node, whose backward rule (rtp__rot_backward) emits the backward schedule: the
 * blocks are fetched again rather than kept, which is what keeps memory at 1/N. */
#include "rtp-impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* What a ROT node applies its parameter block with (op_params[0]); tp's handles are the
 * identity forward with an all-reduce of the gradient (ENTER, Megatron's f) and the
 * all-reduce forward with the identity gradient (REDUCE, Megatron's g). */
enum rot_kind { ROT_MUL_MAT, ROT_GET_ROWS, ROT_ADD, ROT_MUL, ROT_TP_ENTER, ROT_TP_REDUCE };

struct rtp_parallel {
  struct rtp_context *ctx;
  struct rtp_comm *comm;
  enum rtp_strategy strategy;
  enum rtp_type comm_type;    /* rtp: what the travelling copies are (f32 or bf16) */
  enum rtp_type compute_type; /* the precision of every product (f32 or bf16) */
  int rank, world;
  const struct rtp_graph *src; /* the one-device forward graph */
  struct rtp_tensor **map;     /* rank tensor of src node i, then of src leaf i */
  struct rtp_graph *graph;
  struct rtp_tensor *loss, *global_loss;
  /* rtp's flyweight pool: two (block, gradient) slots sized for the largest block,
   * shared by every op; forward rotation uses the block slots. Of comm_type. */
  struct rtp_tensor *pool_w[2], *pool_g[2];
  size_t pool_elems;
  /* The last node that read each slot, so the next write into it waits for it (fsdp:
   * the readers of a slot are chained by order edges, so this one is the last); rtp:
   * the previous op's last step, so the next op's first hop is posted before it. */
  struct rtp_tensor *w_reader[2], *g_reader[2], *prev_apply;
  /* fsdp: the unit each whole-parameter slot holds (0: none; unit_key), which slot was
   * read last, where each parameter (by leaf) lies in its unit's slot, and each slot's
   * gathered parameters (by leaf) */
  int unit_in[2], recent;
  size_t *unit_offs;
  struct rtp_tensor **gathered[2];
  /* rtp forward: the first hop of each op lands in a gradient slot (which forward leaves
   * free), packed after the blocks already there when it fits: elements used, hops
   * packed, the last reader before the slot was last emptied (what every hop packed
   * since waits for), and when the slot last took a hop. */
  size_t used[4]; /* slots 0, 1: pool_g; 2, 3: pool_w (forward on 2 ranks only) */
  int live[4], stamp[4], n_first_hops;
  struct rtp_tensor *base[4];
  /* rtp and fsdp backward: the owners' final sums of gradients, which sink_sums moves
   * late */
  struct rtp_tensor **sink;
  int n_sink;
  /* rtp backward: ops done so far, and the first node of the last one's final step (NULL
   * when that step has none but its sum, whose order edge is taken) */
  int n_backward;
  struct rtp_tensor *last_step;
  int *groups; /* tp: groups of the split dimension of each src node's rank tensor */
};

const char *rtp_strategy_name(enum rtp_strategy s) {
  static const char *const names[RTP_STRATEGY_COUNT] = {"none", "ddp", "fsdp", "tp", "rtp"};
  return (unsigned)s < RTP_STRATEGY_COUNT ? names[s] : "?";
}

int rtp_strategy_parse(const char *name, enum rtp_strategy *out) {
  for (int s = 0; s < RTP_STRATEGY_COUNT; s++)
    if (name && strcmp(name, rtp_strategy_name((enum rtp_strategy)s)) == 0) {
      *out = (enum rtp_strategy)s;
      return RTP_OK;
    }
  return rtp__error(RTP_EINVAL, "unknown strategy '%s' (none, ddp, fsdp, tp or rtp)",
                    name ? name : "(null)");
}

/* ---- blocks of a parameter ------------------------------------------------------ */

/* Whether each rank holds only its block of every parameter. */
static bool sharded(const struct rtp_parallel *p) {
  return p->world > 1 && (p->strategy == RTP_STRATEGY_RTP || p->strategy == RTP_STRATEGY_FSDP);
}

/* Parameters are split along their outermost dimension (PyTorch's first). */
static int split_dim(const struct rtp_tensor *p) {
  return rtp_n_dims(p) - 1;
}

static void block_of(const struct rtp_tensor *full, int world, int s, int64_t *first,
                     int64_t *len) {
  size_t f, l;
  rtp_comm_block((size_t)full->ne[split_dim(full)], world, s, &f, &l);
  *first = (int64_t)f;
  *len = (int64_t)l;
}

/* Elements in full's largest block (block 0): the same number on every rank. */
static size_t largest_block(int world, const struct rtp_tensor *full) {
  int64_t first, len;
  block_of(full, world, 0, &first, &len);
  return (size_t)(rtp_nelements(full) / full->ne[split_dim(full)] * len);
}

/* Whether the tp pass applies (with one rank it is the one-device graph). */
static bool tp_on(const struct rtp_parallel *p) {
  return p->world > 1 && p->strategy == RTP_STRATEGY_TP;
}

/* Whether t is a parameter itself (a leaf), which carries the passes' marks. */
static bool param_leaf(const struct rtp_tensor *t) {
  return t && t->op == RTP_OP_NONE && (t->flags & RTP_FLAG_PARAM);
}

static enum rtp_tp_role tp_role(const struct rtp_tensor *t) {
  return param_leaf(t) ? (enum rtp_tp_role)t->op_params[0] : RTP_TP_REPLICATED;
}

int rtp_set_tp(struct rtp_tensor *param, enum rtp_tp_role role, int groups) {
  if (!param_leaf(param))
    return rtp__error(RTP_EINVAL, "rtp_set_tp: not a parameter (call rtp_set_param first)");
  if ((unsigned)role > RTP_TP_ROW || groups < 1 || (role == RTP_TP_ROW && groups != 1))
    return rtp__error(RTP_EINVAL, "rtp_set_tp: bad role %d or groups %d for '%s'", (int)role,
                      groups, param->name);
  param->op_params[0] = (int32_t)role;
  param->op_params[1] = role == RTP_TP_COLUMN ? groups : 1;
  return RTP_OK;
}

int rtp_set_fsdp_unit(struct rtp_tensor *param, int unit) {
  if (!param_leaf(param))
    return rtp__error(RTP_EINVAL,
                      "rtp_set_fsdp_unit: not a parameter (call rtp_set_param first)");
  if (unit < 0)
    return rtp__error(RTP_EINVAL, "rtp_set_fsdp_unit: unit %d for '%s' (0 or more)", unit,
                      param->name);
  param->op_params[2] = unit;
  return RTP_OK;
}

/* fsdp: which parameters are gathered together: a marked unit (> 0), or the parameter
 * alone (leaf: its index among the leaves). */
static int unit_key(const struct rtp_tensor *param, int leaf) {
  return param->op_params[2] > 0 ? param->op_params[2] : -(leaf + 1);
}

/* What a rank holds of a parameter: along dim, in each of `groups` equal parts, the
 * rows [first, first + len) of the part. */
struct shard {
  int dim, groups;
  int64_t first, len;
};

static struct shard shard_of(const struct rtp_parallel *p, const struct rtp_tensor *t) {
  struct shard s = {split_dim(t), 1, 0, t->ne[split_dim(t)]};
  enum rtp_tp_role role = tp_on(p) ? tp_role(t) : RTP_TP_REPLICATED;
  if (role != RTP_TP_REPLICATED) {
    s.dim = role == RTP_TP_ROW ? 0 : s.dim;
    s.groups = t->op_params[1];
    s.len = t->ne[s.dim] / s.groups / p->world;
    s.first = p->rank * s.len;
  } else if (sharded(p)) {
    block_of(t, p->world, p->rank, &s.first, &s.len);
  }
  return s;
}

/* ---- the map from one-device tensors to this rank's ------------------------------ */

static int index_in(const struct rtp_parallel *p, const struct rtp_tensor *t) {
  for (int i = 0; i < p->src->n_nodes; i++)
    if (p->src->nodes[i] == t) return i;
  for (int i = 0; i < p->src->n_leafs; i++)
    if (p->src->leafs[i] == t) return p->src->n_nodes + i;
  return -1;
}

struct rtp_tensor *rtp_parallel_tensor(const struct rtp_parallel *p,
                                       const struct rtp_tensor *t) {
  if (!p || !t) return NULL;
  if (t == p->loss) return p->global_loss;
  int i = index_in(p, t);
  return i >= 0 ? p->map[i] : NULL;
}

struct rtp_graph *rtp_parallel_graph(const struct rtp_parallel *p) {
  return p ? p->graph : NULL;
}

int rtp_parallel_block(const struct rtp_parallel *p, const struct rtp_tensor *param,
                       int64_t *first, int64_t *len, int *dim) {
  if (!p || !param || !(param->flags & RTP_FLAG_PARAM) || index_in(p, param) < 0)
    return rtp__error(RTP_EINVAL, "rtp_parallel_block: not a parameter of the model");
  struct shard s = shard_of(p, param);
  if (s.groups > 1)
    return rtp__error(RTP_EINVAL,
                      "rtp_parallel_block: this rank holds %d row ranges of '%s' "
                      "(use rtp_parallel_shard_copy)",
                      s.groups, param->name);
  *dim = s.dim;
  *first = s.first;
  *len = s.len;
  return RTP_OK;
}

int rtp_parallel_shard_copy(const struct rtp_parallel *p, const struct rtp_tensor *param,
                            const float *full, float *mine) {
  if (!p || !param || !full || !mine || !(param->flags & RTP_FLAG_PARAM) ||
      param->type != RTP_TYPE_F32 || index_in(p, param) < 0)
    return rtp__error(RTP_EINVAL, "rtp_parallel_shard_copy: not an f32 parameter of the model");
  struct shard s = shard_of(p, param);
  int64_t inner = 1, outer = 1, part = param->ne[s.dim] / s.groups;
  for (int d = 0; d < RTP_MAX_DIMS; d++) {
    if (d < s.dim) inner *= param->ne[d];
    if (d > s.dim) outer *= param->ne[d];
  }
  for (int64_t o = 0; o < outer; o++)
    for (int g = 0; g < s.groups; g++)
      memcpy(mine + (o * s.groups + g) * s.len * inner,
             full + (o * param->ne[s.dim] + g * part + s.first) * inner,
             (size_t)(s.len * inner) * sizeof(float));
  return RTP_OK;
}

struct rtp_optimizer *rtp_parallel_optimizer(const struct rtp_parallel *p,
                                             struct rtp_adamw_params params) {
  if (!p) {
    rtp__error(RTP_EINVAL, "rtp_parallel_optimizer: NULL plan");
    return NULL;
  }
  struct rtp_optimizer *opt = rtp_optimizer_new(p->ctx, p->graph, params);
  /* Sharded gradients are disjoint shares of the whole: their norm needs every rank. */
  if (opt && (sharded(p) || tp_on(p))) rtp__optimizer_set_comm(opt, p->comm);
  /* tp's replicated gradients are whole on every rank: each rank counts 1/N of them. */
  for (int i = 0; opt && tp_on(p) && i < p->src->n_leafs; i++) {
    const struct rtp_tensor *t = p->src->leafs[i];
    if ((t->flags & RTP_FLAG_PARAM) && tp_role(t) == RTP_TP_REPLICATED)
      rtp__optimizer_set_norm_weight(opt, p->map[p->src->n_nodes + i], 1.0f / (float)p->world);
  }
  return opt;
}

/* ---- cloning -------------------------------------------------------------------- */

static struct rtp_tensor *mapped(struct rtp_parallel *p, const struct rtp_tensor *t) {
  int i = t ? index_in(p, t) : -1;
  return i >= 0 ? p->map[i] : NULL;
}

static struct rtp_tensor *clone_leaf(struct rtp_parallel *p, const struct rtp_tensor *t) {
  int64_t ne[4];
  memcpy(ne, t->ne, sizeof(ne));
  bool param = t->flags & RTP_FLAG_PARAM;
  if (param) {
    struct shard s = shard_of(p, t);
    ne[s.dim] = s.len * s.groups;
  }
  struct rtp_tensor *c = rtp_new_tensor(p->ctx, t->type, RTP_MAX_DIMS, ne);
  if (!c) return NULL;
  if (!c->data && !rtp__tensor_alloc(p->ctx, c, RTP_ROLE_INPUT)) return NULL;
  if (t->data && !param && rtp_tensor_set(c, t->data, 0, rtp_nbytes(t))) { /* constants */
    char msg[256];
    snprintf(msg, sizeof(msg), "%s", rtp_last_error());
    rtp__ctx_error(p->ctx, RTP_EIO, "%s", msg);
    return NULL;
  }
  c->flags = t->flags;
  c->role = t->role;
  memcpy(c->name, t->name, sizeof(c->name));
  return c;
}

/* A node like t over this rank's sources: same op, params, shape and strides. */
static struct rtp_tensor *clone_node(struct rtp_parallel *p, const struct rtp_tensor *t) {
  struct rtp_tensor *src[RTP_MAX_SRC] = {0};
  for (int s = 0; s < RTP_MAX_SRC; s++)
    if (t->src[s] && !(src[s] = mapped(p, t->src[s]))) return NULL;
  struct rtp_tensor *c = rtp__new_node(p->ctx, t->op, t->type, t->ne, src[0], src[1]);
  if (!c) return NULL;
  for (int s = 2; s < RTP_MAX_SRC; s++) c->src[s] = src[s];
  memcpy(c->nb, t->nb, sizeof(c->nb));
  memcpy(c->op_params, t->op_params, sizeof(c->op_params));
  memcpy(c->name, t->name, sizeof(c->name));
  c->flags = t->flags;
  if (t->view_src) { /* the rank's source may itself be a view (a ROT node): use its base */
    struct rtp_tensor *b = mapped(p, t->view_src);
    if (!b) return NULL;
    c->view_src = b->view_src ? b->view_src : b;
    c->view_offs = t->view_offs + (b->view_src ? b->view_offs : 0);
    if (c->view_src->data) c->data = (char *)c->view_src->data + c->view_offs;
  }
  return c;
}

static struct rtp_tensor *fsdp_forward(struct rtp_parallel *p, const struct rtp_tensor *t,
                                       const struct rtp_tensor *full, enum rot_kind kind,
                                       struct rtp_tensor *x, struct rtp_tensor *own);
static void fsdp_backward(struct rtp_parallel *p, enum rot_kind kind, int dim,
                          struct rtp_tensor *full, struct rtp_tensor *dy, struct rtp_tensor *x,
                          struct rtp_tensor **dx, struct rtp_tensor **dp);
static void tp_backward(struct rtp_context *ctx, struct rtp_parallel *p, struct rtp_tensor *t,
                        struct rtp_tensor *dy, struct rtp_tensor **dx, struct rtp_tensor **dp);
static struct rtp_tensor *handle(struct rtp_parallel *p, const struct rtp_tensor *t,
                                 const struct rtp_tensor *full, enum rot_kind kind,
                                 struct rtp_tensor *x, struct rtp_tensor *own,
                                 struct rtp_tensor *y);

/* ---- rtp: the forward schedule -------------------------------------------------- */

/* The pool slot `slot`, from element offs on, seen as block s of full (its shape, the
 * slot's type). */
static struct rtp_tensor *slot_at(struct rtp_parallel *p, struct rtp_tensor *slot,
                                  const struct rtp_tensor *full, int s, size_t offs) {
  int64_t first, len, ne[4];
  block_of(full, p->world, s, &first, &len);
  memcpy(ne, full->ne, sizeof(ne));
  ne[split_dim(full)] = len;
  size_t nb[4] = {rtp_type_size(slot->type)};
  for (int i = 1; i < 4; i++) nb[i] = nb[i - 1] * (size_t)ne[i - 1];
  return rtp_view(p->ctx, slot, RTP_MAX_DIMS, ne, nb, offs * nb[0]);
}

static struct rtp_tensor *slot_as(struct rtp_parallel *p, struct rtp_tensor *slot,
                                  const struct rtp_tensor *full, int s) {
  return slot_at(p, slot, full, s, 0);
}

/* x's slice [first, first + len) along dim. */
static struct rtp_tensor *slice(struct rtp_context *ctx, struct rtp_tensor *x, int dim,
                                int64_t first, int64_t len) {
  int64_t ne[4];
  memcpy(ne, x->ne, sizeof(ne));
  ne[dim] = len;
  return rtp_view(ctx, x, RTP_MAX_DIMS, ne, x->nb, (size_t)first * x->nb[dim]);
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
static struct rtp_tensor *apply_block(struct rtp_parallel *p, enum rot_kind kind,
                                      const struct rtp_tensor *full, struct rtp_tensor *w,
                                      int s, struct rtp_tensor *x) {
  int64_t first, len;
  block_of(full, p->world, s, &first, &len);
  switch (kind) {
    case ROT_MUL_MAT:
      return rtp_mul_mat(p->ctx, w, x);
    case ROT_GET_ROWS:
      return rtp__get_rows_block(p->ctx, w, x, first);
    case ROT_ADD:
      return rtp_add(p->ctx, slice(p->ctx, x, split_dim(full), first, len), w);
    default:
      return rtp_mul(p->ctx, slice(p->ctx, x, split_dim(full), first, len), w);
  }
}

/* Blocks of the result, by block index, made whole: summed (get_rows, where each
 * block contributes zero rows for the tokens it does not hold) or concatenated along
 * the dimension the blocks split. */
static struct rtp_tensor *assemble(struct rtp_parallel *p, enum rot_kind kind, int dim,
                                   struct rtp_tensor **parts) {
  struct rtp_tensor *y = parts[0];
  for (int s = 1; s < p->world; s++)
    y = kind == ROT_GET_ROWS ? rtp_add(p->ctx, y, parts[s])
                             : rtp_concat(p->ctx, y, parts[s], dim);
  return y;
}

/* Makes `part`, block s's part of the op's result, write into its slice of one result y
 * (created by the first block) instead of memory of its own: no concatenation. */
static int write_into(struct rtp_parallel *p, enum rot_kind kind, const struct rtp_tensor *full,
                      int s, struct rtp_tensor *part, struct rtp_tensor **y) {
  int dim = kind == ROT_MUL_MAT ? 0 : split_dim(full);
  int64_t first, len, ne[4];
  block_of(full, p->world, s, &first, &len);
  if (!*y) {
    memcpy(ne, part->ne, sizeof(ne));
    ne[dim] = kind == ROT_MUL_MAT ? full->ne[1] : full->ne[split_dim(full)];
    *y = rtp__new_node(p->ctx, RTP_OP_EMPTY, RTP_TYPE_F32, ne, NULL, NULL);
    if (!*y) return rtp_context_error(p->ctx, NULL);
  }
  memcpy(part->nb, (*y)->nb, sizeof(part->nb));
  part->view_src = *y;
  part->view_offs = (size_t)first * (*y)->nb[dim];
  part->src[2] = *y; /* placed after it, and keeps it alive */
  return RTP_OK;
}

static int rot_kind_of(const struct rtp_tensor *t, const struct rtp_tensor *param,
                       enum rot_kind *kind) {
  if (t->op == RTP_OP_MUL_MAT && t->src[0] == param && param->ne[2] == 1 && param->ne[3] == 1)
    *kind = ROT_MUL_MAT;
  else if (t->op == RTP_OP_GET_ROWS && t->src[0] == param)
    *kind = ROT_GET_ROWS;
  else if ((t->op == RTP_OP_ADD || t->op == RTP_OP_MUL) && t->src[1] == param &&
           param->ne[split_dim(param)] == t->ne[split_dim(param)])
    *kind = t->op == RTP_OP_ADD ? ROT_ADD : ROT_MUL;
  else
    return RTP_EINVAL;
  return RTP_OK;
}

/* Hops packed into one slot at most: a bound on the transfers in flight. */
#define RTP_PACKED_HOPS 8

/* Whether blocks of n elements are small: that many fit in one slot. Decided from a
 * parameter's largest block, so alike on every rank. */
static bool small_block(const struct rtp_parallel *p, size_t n) {
  return n * RTP_PACKED_HOPS <= p->pool_elems;
}

static struct rtp_tensor *slot_tensor(struct rtp_parallel *p, int i) {
  return i < 2 ? p->pool_g[i] : p->pool_w[i - 2];
}

/* The last node that read slot i (a chain: each reader follows the one before). */
static struct rtp_tensor **slot_reader(struct rtp_parallel *p, int i) {
  return i < 2 ? &p->g_reader[i] : &p->w_reader[i - 2];
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
static int pack_hop(struct rtp_parallel *p, int lo, int hi, size_t n, size_t *offs,
                    struct rtp_tensor **dep) {
  size_t padded = RTP_PAD(n, RTP_ALIGN / sizeof(float));
  int best = -1;
  for (int i = lo; i < hi; i++)
    if (p->used[i] > 0 && p->used[i] + n <= p->pool_elems && p->live[i] < RTP_PACKED_HOPS &&
        (best < 0 || p->used[i] > p->used[best]))
      best = i;
  if (best < 0) {
    best = lo;
    for (int i = lo + 1; i < hi; i++)
      if (p->stamp[i] < p->stamp[best]) best = i;
    p->base[best] = *slot_reader(p, best);
    p->used[best] = p->live[best] = 0;
  }
  *offs = p->used[best];
  *dep = p->base[best];
  p->used[best] += padded;
  p->live[best]++;
  p->stamp[best] = ++p->n_first_hops;
  return best;
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
      !rtp_is_contiguous(x) || rtp_nbytes(x) != rtp_nbytes(b))
    return NULL;
  return b;
}

/* y = op(param, x) on this rank. rtp: step k applies block (rank + k) % N, which arrived
 * from rank + 1 during step k - 1; step 0 uses the owned block and never waits. */
static struct rtp_tensor *rot_forward(struct rtp_parallel *p, const struct rtp_tensor *t,
                                      const struct rtp_tensor *full) {
  enum rot_kind kind;
  if (rot_kind_of(t, full, &kind)) {
    char s[128];
    rtp__shape_str(full, s, sizeof(s));
    rtp__ctx_error(p->ctx, RTP_EINVAL,
                   "%s strategy: parameter %s is used by %s, which it cannot split "
                   "(mul_mat as the first operand, get_rows, or a broadcast add/mul)",
                   rtp_strategy_name(p->strategy), s, rtp_op_name(t->op));
    return NULL;
  }
  int N = p->world, r = p->rank, left = (r + N - 1) % N, right = (r + 1) % N;
  struct rtp_tensor *own = mapped(p, full),
                    *x = mapped(p, kind == ROT_ADD || kind == ROT_MUL ? t->src[0] : t->src[1]);
  if (p->strategy == RTP_STRATEGY_FSDP) return fsdp_forward(p, t, full, kind, x, own);
  /* Order edges (RTP_SRC_ORDER) lay the steps out as: post the transfer of step k + 1,
   * compute step k. The first hop (of the owned block, ready from the start) lands in a
   * gradient slot (pack_hop), so it depends only on that slot's earlier readers and
   * rtp_parallelize posts it as early as that allows (hoist_transfers); later hops
   * alternate between the block slots. A transfer into a slot waits (src[3]) for whatever
   * last read the slot. */
  struct rtp_tensor *parts[RTP_MAX_WORLD] = {0}, *held = own, *prev = NULL;
  struct rtp_tensor *y = kind == ROT_ADD ? add_in_place(p, t, x) : NULL;
  struct rtp_tensor **reader[RTP_MAX_WORLD] = {0}; /* of the slot step k reads */
  /* Hops are sized as the largest block, not the one that arrives: every rank then packs
   * alike, and posts its hops in the same order as the others. */
  size_t n = largest_block(N, full);
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
        int i = pack_hop(p, 0, N == 2 ? 4 : 2, n, &offs, &dep);
        slot = slot_tensor(p, i);
        reader[k + 1] = slot_reader(p, i);
      } else {
        slot = p->pool_w[(k + 1) % 2];
        dep = p->w_reader[(k + 1) % 2];
        reader[k + 1] = &p->w_reader[(k + 1) % 2];
      }
      next = rtp_sendrecv(p->ctx, p->comm, held, left,
                          slot_at(p, slot, full, (s + 1) % N, offs), right, k ? prev : NULL);
      if (!next) return NULL;
      next->src[RTP_SRC_ORDER] = dep;
      if (small_block(p, n)) next->flags |= RTP__FLAG_SMALL_HOP;
    }
    /* Step k's block as f32, cast once the next hop is posted. */
    struct rtp_tensor *w = from_wire(p, held, next ? next : prev);
    parts[s] = w ? apply_block(p, kind, full, w, s, x) : NULL;
    if (!parts[s] || (kind != ROT_GET_ROWS && write_into(p, kind, full, s, parts[s], &y)))
      return NULL;
    /* Step 0 follows the previous op's last step: the readers of the slots then come in
     * the order this pass sees them, which pack_hop's dependencies rely on. */
    parts[s]->src[RTP_SRC_ORDER] = k == 0 ? p->prev_apply : next ? next : prev;
    /* Step k reads its slot; it also waits for hop k, which sent from step k - 1's. */
    if (k >= 1) *reader[k] = parts[s];
    if (k >= 2) *reader[k - 1] = parts[s];
    prev = parts[s];
    held = next;
  }
  p->prev_apply = prev;
  if (kind == ROT_GET_ROWS) { /* blocks give zero rows for tokens they do not hold: sum */
    struct rtp_tensor *y = assemble(p, kind, 0, parts);
    return y ? handle(p, t, full, kind, x, own, y) : NULL;
  }
  /* The other ops' blocks wrote their parts of the result in place. */
  struct rtp_tensor *h = handle(p, t, full, kind, x, own, parts[0]->view_src);
  if (h) h->src[2] = prev; /* after every block (they are chained by order edges) */
  return h;
}

/* ---- rtp: the backward schedule ------------------------------------------------- */

/* dy's part that block s produced (the slice, or all of it for get_rows). */
static struct rtp_tensor *dy_part(struct rtp_parallel *p, enum rot_kind kind, int dim,
                                  const struct rtp_tensor *full, struct rtp_tensor *dy, int s) {
  if (kind == ROT_GET_ROWS) return dy;
  int64_t first, len;
  block_of(full, p->world, s, &first, &len);
  return slice(p->ctx, dy, kind == ROT_MUL_MAT ? 0 : dim, first, len);
}

/* This rank's contribution to the gradient of block s (shaped like w, not read). */
static struct rtp_tensor *block_grad(struct rtp_parallel *p, enum rot_kind kind, int dim,
                                     struct rtp_tensor *w, struct rtp_tensor *x,
                                     struct rtp_tensor *dys, int64_t first, int64_t len) {
  struct rtp_context *ctx = p->ctx;
  switch (kind) {
    case ROT_MUL_MAT: {        /* dW_s = dy_s^T x, over all rows of the batch */
      if (rtp_n_dims(x) > 2) { /* GEMM reads 2-D strided slices in place; else flatten */
        x = rtp_reshape_2d(ctx, rtp_cont(ctx, x), x->ne[0], rtp_nrows(x));
        dys = rtp_reshape_2d(ctx, rtp_cont(ctx, dys), dys->ne[0], rtp_nrows(dys));
      }
      return rtp_mul_mat(ctx, rtp_transpose(ctx, x), rtp_transpose(ctx, dys));
    }
    case ROT_GET_ROWS:
      return rtp__get_rows_back_block(ctx, dys, x, w, first);
    case ROT_ADD:
      return rtp_repeat_back(ctx, dys, w); /* kernels read strided rows in place */
    default:
      return rtp_repeat_back(ctx, rtp_mul(ctx, dys, slice(ctx, x, dim, first, len)), w);
  }
}

/* Block s's part of dx (NULL where the op has none); for mul_mat, added to the sum of the
 * blocks before (`sum`, NULL for the first). */
static struct rtp_tensor *block_dx(struct rtp_parallel *p, enum rot_kind kind,
                                   struct rtp_tensor *w, struct rtp_tensor *dys,
                                   struct rtp_tensor *sum) {
  switch (kind) {
    case ROT_MUL_MAT:
      return rtp__mul_mat_add(p->ctx, rtp_transpose(p->ctx, w), dys, sum);
    case ROT_MUL: /* concatenated over blocks */
      return rtp_mul(p->ctx, dys, w);
    default: /* add passes dy through whole; get_rows has no input gradient */
      return NULL;
  }
}

/* rtp and fsdp backward: a partial sum of a gradient passed on to rank + 1, while rank -
 * 1's partial sum of block s arrives in a gradient slot, packed as forward's first hops are
 * (pack_hop); `after`: the hop before it, whose sum this one forwards. The slot it lands
 * in goes to *slot. */
static struct rtp_tensor *grad_hop(struct rtp_parallel *p, struct rtp_tensor *send,
                                   const struct rtp_tensor *full, int s,
                                   struct rtp_tensor *after, int *slot) {
  int N = p->world;
  size_t offs, n = largest_block(N, full); /* every rank packs alike */
  struct rtp_tensor *dep;
  *slot = pack_hop(p, 0, 2, n, &offs, &dep);
  struct rtp_tensor *h =
      rtp_sendrecv(p->ctx, p->comm, send, (p->rank + 1) % N,
                   slot_at(p, p->pool_g[*slot], full, s, offs), (p->rank + N - 1) % N, after);
  if (h) {
    h->src[RTP_SRC_ORDER] = dep;
    if (small_block(p, n)) h->flags |= RTP__FLAG_SMALL_HOP;
  }
  return h;
}

/*
 * Step k = N-1 .. 0 holds block s = (rank + k) % N and the gradient of s summed over the
 * ranks that held it before; it adds its own part and passes both on to rank + 1, so at
 * k = 0 each rank holds its own block with the gradient summed over all ranks. The first
 * block is fetched from its owner; the last hop carries only the gradient.
 */
void rtp__rot_backward(struct rtp_context *ctx, struct rtp_tensor *t, struct rtp_tensor *dy,
                       struct rtp_tensor **dx, struct rtp_tensor **dp) {
  struct rtp_parallel *p = (struct rtp_parallel *)(uintptr_t)rtp__get_param_u64(t, 2);
  /* The one-device parameter (the model's context): its shape only */
  struct rtp_tensor *full = (struct rtp_tensor *)(uintptr_t)rtp__get_param_u64(t, 4);
  enum rot_kind kind = (enum rot_kind)t->op_params[0];
  int dim = t->op_params[1], N = p->world, r = p->rank;
  int left = (r + N - 1) % N, right = (r + 1) % N;
  struct rtp_tensor *x = t->src[0], *own = t->src[1];
  dy = rtp_cont(ctx, dy);
  if (p->strategy == RTP_STRATEGY_TP) {
    tp_backward(ctx, p, t, dy, dx, dp);
    return;
  }
  if (p->strategy == RTP_STRATEGY_FSDP) {
    fsdp_backward(p, kind, dim, full, dy, x, dx, dp);
    return;
  }
  /* Only ops whose input gradient needs the block fetch it again (mul_mat, mul). Step m
   * = N-1-k holds its block in slot (j + m) % 2, j counting the ops' backward passes, so
   * the first block lands in the slot the previous op's backward left free and can be
   * fetched during that op's last step (an order edge on that step's first node). A
   * transfer into a slot also waits (src[3]) for the node that last read it. */
  bool need_w = dx && (kind == ROT_MUL_MAT || kind == ROT_MUL);
  int j = p->n_backward++;
  struct rtp_tensor *parts[RTP_MAX_WORLD] = {0}, *dx_sum = NULL, *w = NULL;
  size_t n_block = largest_block(N, full); /* every rank packs alike (pack_hop) */
  bool small = small_block(p, n_block);
  /* On 2 ranks this fetch is the op's only one: it is packed into the block slots as
   * forward's first hops are (slots 2 and 3 of pack_hop). */
  int w_slot = j % 2;
  size_t w_offs = 0;
  struct rtp_tensor *w_dep = p->w_reader[j % 2];
  if (need_w && N == 2) w_slot = pack_hop(p, 2, 4, n_block, &w_offs, &w_dep) - 2;
  if (need_w) {
    w = rtp_sendrecv(ctx, p->comm, to_wire(p, own), right,
                     slot_at(p, p->pool_w[w_slot], full, left, w_offs), left, w_dep);
    if (w && small) w->flags |= RTP__FLAG_SMALL_HOP;
    if (w && p->last_step) p->last_step->src[RTP_SRC_ORDER] = w;
  }
  struct rtp_tensor *g_in = NULL, *g = NULL, *last_read = NULL;
  /* On 2 ranks the contributions to both blocks' gradients come from one pass over the
   * whole parameter, whose ranges are the blocks': for a product one GEMM over the whole
   * of dW (split, the smaller products ran ~10% slower, and a 3-D dy's slices were
   * copied first), for a bias or LayerNorm one sum over dy's rows instead of two. The
   * whole gradient (two blocks of planned memory) lives until the owner's sum reads its
   * half. With more ranks the partial sums in between are added at their steps, which
   * need a product of their own to wait behind, so each block's part is computed at its
   * step; an embedding's blocks scatter only their own rows either way. */
  struct rtp_tensor *all = NULL;
  if (kind != ROT_GET_ROWS && N == 2) {
    if (!(all = block_grad(p, kind, dim, full, x, dy, 0, full->ne[split_dim(full)]))) return;
    all->src[RTP_SRC_ORDER] = w; /* computed while the first block arrives */
    last_read = all;
  }
  int g_slot = 0;
  for (int k = N - 1, m = 0; k >= 0; k--, m++) {
    int s = (r + k) % N;
    struct rtp_tensor *held = k == 0 ? own : w, *next_w = NULL;
    struct rtp_tensor *dys = dy_part(p, kind, dim, full, dy, s);
    int64_t first, len;
    block_of(full, N, s, &first, &len);
    struct rtp_tensor *contrib;
    if (all) {
      contrib = slice(ctx, all, split_dim(full), first, len);
    } else { /* shaped as block s, whether or not the block itself is here */
      struct rtp_tensor *shape = k == 0 ? own : slot_as(p, p->pool_g[0], full, s);
      if ((contrib = block_grad(p, kind, dim, shape, x, dys, first, len))) {
        contrib->src[RTP_SRC_ORDER] = last_read;
        last_read = contrib;
      }
    }
    if (!contrib) return;
    /* The step's first node, which the next op's fetch is posted before: with `all`, the
     * dx product (set below), or none: the sum's order edge chains its slot's readers. */
    if (k == 0) p->last_step = all ? NULL : contrib;
    if (need_w && k > 1) { /* at k = 1 the next block is our own */
      int slot = (j + m + 1) % 2;
      next_w = rtp_sendrecv(ctx, p->comm, held, right,
                            slot_as(p, p->pool_w[slot], full, (s + N - 1) % N), left, contrib);
      if (next_w) next_w->src[RTP_SRC_ORDER] = p->w_reader[slot];
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
      struct rtp_tensor *d = hw ? block_dx(p, kind, hw, dys, dx_sum) : NULL;
      if (d) {
        d->src[RTP_SRC_ORDER] = after;
        last_read = d;
      }
      if (need_w && k > 0) { /* d reads this step's slot and waited for the hop that
                              * sent from the previous step's */
        p->w_reader[m == 0 ? w_slot : (j + m) % 2] = d;
        if (m > 0) p->w_reader[m == 1 ? w_slot : (j + m - 1) % 2] = d;
      }
      if (kind == ROT_MUL_MAT) dx_sum = d;
      parts[s] = d;
      if (k == 0 && all) p->last_step = d;
    }
    /* The partial sum arrives as it travels (bf16: rounded) and is summed in f32; its
     * cast waits for the transfer after this step's contribution, as the add did. */
    g = g_in ? rtp_add(ctx, from_wire(p, g_in, all ? last_read : contrib), contrib) : contrib;
    if (g_in && g) {
      /* The add reads the slot after what read it before (pack_hop relies on that
       * order). The owner's sum is read by nothing in the step (the optimizer reads it
       * after), so sink_sums moves it late, where its hop is long done. */
      g->src[RTP_SRC_ORDER] = p->g_reader[g_slot];
      p->g_reader[g_slot] = g;
      if (k == 0) p->sink[p->n_sink++] = g;
    }
    if (k > 0) /* the summed gradient of s goes on to the next holder */
      g_in = grad_hop(p, to_wire(p, g), full, (s + N - 1) % N, g_in, &g_slot);
    w = next_w;
  }
  *dp = g;
  if (!dx) return;
  if (kind == ROT_MUL_MAT)
    *dx = dx_sum;
  else if (kind == ROT_MUL)
    *dx = assemble(p, kind, dim, parts);
  else if (kind == ROT_ADD)
    *dx = dy;
}

/* ---- fsdp: gather a unit's parameters whole; reduce-scatter their gradients ------- */

/*
 * Gathers every parameter of `unit` whole into slot i, each at its place in the slot
 * (unit_offs): this rank's rows copied in, then an all-gather of every rank's rows. The
 * copies wait (an order edge) for the slot's last reader; hoist_transfers then posts the
 * gathers as early as that allows: while the unit before computes.
 */
static int fsdp_gather(struct rtp_parallel *p, int unit, int i) {
  struct rtp_context *ctx = p->ctx;
  size_t esize = rtp_type_size(p->pool_w[i]->type);
  p->unit_in[i] = unit;
  for (int q = 0; q < p->src->n_leafs; q++) {
    const struct rtp_tensor *full = p->src->leafs[q];
    if (!(full->flags & RTP_FLAG_PARAM) || unit_key(full, q) != unit) continue;
    size_t nb[4] = {esize}, offs = p->unit_offs[q] * esize;
    for (int d = 1; d < 4; d++) nb[d] = nb[d - 1] * (size_t)full->ne[d - 1];
    struct rtp_tensor *w = rtp_view(ctx, p->pool_w[i], RTP_MAX_DIMS, full->ne, nb, offs);
    struct rtp_tensor *mine = rtp_dup(ctx, p->map[p->src->n_nodes + q]);
    if (!w || !mine) return rtp_context_error(ctx, NULL);
    int64_t first, len;
    block_of(full, p->world, p->rank, &first, &len);
    mine->view_src = p->pool_w[i]; /* the copy writes its rows of the slot */
    mine->view_offs = offs + (size_t)first * nb[split_dim(full)];
    mine->data = (char *)p->pool_w[i]->data + mine->view_offs;
    mine->src[RTP_SRC_ORDER] = p->w_reader[i];
    struct rtp_tensor *all = rtp__allgather_rows(ctx, p->comm, w, mine);
    if (!all || !(p->gathered[i][q] = rtp_reshape(ctx, all, RTP_MAX_DIMS, full->ne)))
      return rtp_context_error(ctx, NULL);
  }
  return RTP_OK;
}

/* The whole of `full` from the slot that holds its unit, which is gathered into the
 * other slot than the one read last unless an earlier op left it there. */
static struct rtp_tensor *fsdp_param(struct rtp_parallel *p, const struct rtp_tensor *full,
                                     int *slot) {
  int leaf = index_in(p, full) - p->src->n_nodes, unit = unit_key(full, leaf);
  int i = p->unit_in[0] == unit ? 0 : p->unit_in[1] == unit ? 1 : -1;
  if (i < 0 && fsdp_gather(p, unit, i = p->recent == 0 ? 1 : 0)) return NULL;
  *slot = i;
  return p->gathered[i][leaf];
}

/* Node u reads slot i: it follows the slot's earlier readers (an order edge), so the
 * last one built is the last one run, which the next gather into the slot waits for. */
static void fsdp_read(struct rtp_parallel *p, int i, struct rtp_tensor *u) {
  if (!u->src[RTP_SRC_ORDER]) u->src[RTP_SRC_ORDER] = p->w_reader[i];
  p->w_reader[i] = u;
  p->recent = i;
}

/* The op itself, with the whole parameter w. */
static struct rtp_tensor *apply_whole(struct rtp_parallel *p, enum rot_kind kind,
                                      struct rtp_tensor *w, struct rtp_tensor *x) {
  switch (kind) {
    case ROT_MUL_MAT:
      return rtp_mul_mat(p->ctx, w, x);
    case ROT_GET_ROWS:
      return rtp_get_rows(p->ctx, w, x);
    case ROT_ADD:
      return rtp_add(p->ctx, x, w);
    default:
      return rtp_mul(p->ctx, x, w);
  }
}

/* The handle autodiff sees for an op on a distributed parameter: y, as an op of (x, the
 * owned block), whose backward is the strategy's (rtp__rot_backward). */
static struct rtp_tensor *handle(struct rtp_parallel *p, const struct rtp_tensor *t,
                                 const struct rtp_tensor *full, enum rot_kind kind,
                                 struct rtp_tensor *x, struct rtp_tensor *own,
                                 struct rtp_tensor *y) {
  struct rtp_tensor *h = rtp__new_node(p->ctx, RTP_OP_ROT, y->type, y->ne, x, own);
  if (!h) return NULL;
  memcpy(h->nb, y->nb, sizeof(h->nb));
  h->src[2] = y;
  h->view_src = y->view_src ? y->view_src : y;
  h->view_offs = y->view_offs;
  h->op_params[0] = kind;
  h->op_params[1] = split_dim(full);
  rtp__set_param_u64(h, 2, (uint64_t)(uintptr_t)p);
  rtp__set_param_u64(h, 4, (uint64_t)(uintptr_t)full);
  memcpy(h->name, t->name, sizeof(h->name));
  h->flags = t->flags;
  return h;
}

static struct rtp_tensor *fsdp_forward(struct rtp_parallel *p, const struct rtp_tensor *t,
                                       const struct rtp_tensor *full, enum rot_kind kind,
                                       struct rtp_tensor *x, struct rtp_tensor *own) {
  int slot;
  struct rtp_tensor *w = fsdp_param(p, full, &slot);
  struct rtp_tensor *y = w ? apply_whole(p, kind, w, x) : NULL;
  if (!y) return NULL;
  fsdp_read(p, slot, y);
  return handle(p, t, full, kind, x, own, y);
}

/*
 * Backward: the whole gradient needs the parameter's shape only, dx (of a product or a
 * LayerNorm weight) the parameter itself, gathered again with its unit. The gradient is
 * then reduce-scattered around the ring over blocks of rows: at step k rank r passes the
 * partial sum of block r - k on to r + 1 and adds its own part to the partial of block
 * r - k - 1 it receives, so after N - 1 steps it holds its own block summed over all
 * ranks. The hops land in the gradient slots as rtp's do (pack_hop), and the owner's
 * final sum is moved late (sink_sums), where its hop is done.
 */
static void fsdp_backward(struct rtp_parallel *p, enum rot_kind kind, int dim,
                          struct rtp_tensor *full, struct rtp_tensor *dy, struct rtp_tensor *x,
                          struct rtp_tensor **dx, struct rtp_tensor **dp) {
  struct rtp_context *ctx = p->ctx;
  int N = p->world, r = p->rank, slot;
  if (dx) *dx = kind == ROT_ADD ? dy : NULL;
  if (dx && (kind == ROT_MUL_MAT || kind == ROT_MUL)) {
    struct rtp_tensor *w = fsdp_param(p, full, &slot);
    if (!w || !(*dx = block_dx(p, kind, w, dy, NULL))) return;
    fsdp_read(p, slot, *dx);
  }
  /* The whole parameter is the one block [0, rows) of a world of one. */
  struct rtp_tensor *gw = block_grad(p, kind, dim, full, x, dy, 0, full->ne[dim]);
  struct rtp_tensor *acc = NULL, *in = NULL;
  for (int k = 1; k < N && gw; k++) {
    int b_send = ((r - k) % N + N) % N, b_recv = ((r - k - 1) % N + N) % N, i;
    int64_t f, len;
    block_of(full, N, b_send, &f, &len);
    struct rtp_tensor *send = acc ? acc : rtp_cont(ctx, slice(ctx, gw, dim, f, len));
    if (!(in = grad_hop(p, send, full, b_recv, in, &i))) return;
    block_of(full, N, b_recv, &f, &len);
    if (!(acc = rtp_add(ctx, in, rtp_cont(ctx, slice(ctx, gw, dim, f, len))))) return;
    acc->src[RTP_SRC_ORDER] = p->g_reader[i]; /* pack_hop relies on the readers' order */
    p->g_reader[i] = acc;
  }
  if (acc) p->sink[p->n_sink++] = acc;
  *dp = acc;
}

/* ---- tp: column- and row-parallel layers (Megatron) ------------------------------ */

/* Marked parameters must split evenly: groups x N blocks along their dimension. */
static int tp_check_params(struct rtp_parallel *p) {
  for (int i = 0; i < p->src->n_leafs; i++) {
    const struct rtp_tensor *t = p->src->leafs[i];
    enum rtp_tp_role role = tp_role(t);
    if (role == RTP_TP_REPLICATED) continue;
    int dim = role == RTP_TP_ROW ? 0 : split_dim(t), groups = t->op_params[1];
    if (role > RTP_TP_ROW || groups < 1 || t->ne[dim] % ((int64_t)groups * p->world)) {
      char s[128];
      rtp__shape_str(t, s, sizeof(s));
      return rtp__ctx_error(p->ctx, RTP_EINVAL,
                            "tp strategy: parameter %s: dimension %d (%lld, in %d groups) "
                            "does not split evenly between %d ranks",
                            s, dim, (long long)t->ne[dim], groups, p->world);
    }
  }
  return RTP_OK;
}

/* The parameters checked, and the groups of every node's split dimension. */
static int tp_prepare(struct rtp_parallel *p) {
  p->groups = rtp__ctx_alloc(p->ctx, sizeof(int) * (size_t)p->src->n_nodes, "tp groups");
  return p->groups ? tp_check_params(p) : rtp_context_error(p->ctx, NULL);
}

/* The dimension along which this rank's tensor is a part of the one-device one, or -1. */
static int split_of(const struct rtp_tensor *full, const struct rtp_tensor *mine) {
  for (int d = 0; d < RTP_MAX_DIMS; d++)
    if (full->ne[d] != mine->ne[d]) return d;
  return -1;
}

/* Groups of the split dimension of a one-device tensor's rank tensor. */
static int groups_of(struct rtp_parallel *p, const struct rtp_tensor *t) {
  if (t->op == RTP_OP_NONE) return tp_role(t) == RTP_TP_COLUMN ? t->op_params[1] : 1;
  int i = index_in(p, t);
  return i >= 0 && i < p->src->n_nodes ? p->groups[i] : 1;
}

static struct rtp_tensor *tp_error(struct rtp_parallel *p, const struct rtp_tensor *t,
                                   const char *why) {
  char s[128];
  rtp__shape_str(t, s, sizeof(s));
  rtp__ctx_error(p->ctx, RTP_EINVAL, "tp strategy: %s %s: %s", rtp_op_name(t->op), s, why);
  return NULL;
}

/* A handle that autodiff sees as an op of src0 (and src1), whose data is y's and whose
 * backward is tp_backward. */
static struct rtp_tensor *tp_handle(struct rtp_parallel *p, enum rot_kind kind,
                                    struct rtp_tensor *src0, struct rtp_tensor *src1,
                                    struct rtp_tensor *y) {
  struct rtp_tensor *h = rtp__new_node(p->ctx, RTP_OP_ROT, y->type, y->ne, src0, src1);
  if (!h) return NULL;
  memcpy(h->nb, y->nb, sizeof(h->nb));
  h->src[2] = y;
  h->view_src = y->view_src ? y->view_src : y;
  h->view_offs = y->view_src ? y->view_offs : 0;
  if (h->view_src->data) h->data = (char *)h->view_src->data + h->view_offs;
  h->op_params[0] = kind;
  rtp__set_param_u64(h, 2, (uint64_t)(uintptr_t)p);
  return h;
}

/* f: identity forward; backward sums the input gradient, of which each rank computed the
 * part its block of output rows contributes. The handle is the column layer's only
 * reader, so its gradient is a fresh node that the all-reduce may sum in place. */
static void tp_backward(struct rtp_context *ctx, struct rtp_parallel *p, struct rtp_tensor *t,
                        struct rtp_tensor *dy, struct rtp_tensor **dx, struct rtp_tensor **dp) {
  if (t->op_params[0] == ROT_TP_REDUCE) /* g: every rank's dy is already the whole one */
    *dp = dy;
  else if (dx)
    *dx = rtp_allreduce(ctx, p->comm, dy, NULL);
}

/* y = W x with this rank's rows of W: x is whole (replicated), y is this rank's part. */
static struct rtp_tensor *tp_column(struct rtp_parallel *p, int i, const struct rtp_tensor *t) {
  struct rtp_tensor *x = mapped(p, t->src[1]);
  if (split_of(t->src[1], x) >= 0)
    return tp_error(p, t, "the input of a column-parallel layer must be whole on every rank");
  struct rtp_tensor *f = tp_handle(p, ROT_TP_ENTER, x, NULL, x);
  p->groups[i] = t->src[0]->op_params[1];
  return f ? rtp_mul_mat(p->ctx, mapped(p, t->src[0]), f) : NULL;
}

/* y = W x with this rank's columns of W and its part of x: a partial sum, all-reduced.
 * The handle reads the sum (src[0], so readers wait for it) and passes the gradient
 * straight to the partial product (src[1]). */
static struct rtp_tensor *tp_row(struct rtp_parallel *p, const struct rtp_tensor *t) {
  struct rtp_tensor *w = mapped(p, t->src[0]), *x = mapped(p, t->src[1]);
  if (split_of(t->src[1], x) != 0 || x->ne[0] != w->ne[0])
    return tp_error(p, t,
                    "the input of a row-parallel layer must be split along ne[0] like its "
                    "weight (by a column-parallel layer before it)");
  struct rtp_tensor *y = rtp_mul_mat(p->ctx, w, x);
  struct rtp_tensor *sum = y ? rtp_allreduce(p->ctx, p->comm, y, NULL) : NULL;
  return sum ? tp_handle(p, ROT_TP_REDUCE, sum, y, sum) : NULL;
}

/*
 * A view of a tensor split along dim ds (contiguous, in G equal groups), restricted to
 * this rank's part. The view's dimensions that step within ds, from the smallest stride
 * up, must tile exactly one group (e.g. q's {hd, H} of fused {3d}); the outermost of them
 * (the heads) is split between the ranks, which selects this rank's part of that group.
 * Strides and the offset beyond ds are rescaled to the rank's smaller ds.
 */
static struct rtp_tensor *tp_view(struct rtp_parallel *p, const struct rtp_tensor *t,
                                  struct rtp_tensor *a) {
  const struct rtp_tensor *full = t->src[0];
  int ds = split_of(full, a), N = p->world, top = -1;
  if (!rtp_is_contiguous(full) || !rtp_is_contiguous(a))
    return tp_error(p, t, "a view of a split tensor needs a contiguous source");
  int64_t f = (int64_t)rtp_type_size(t->type), inner = 1;
  for (int d = 0; d < ds; d++) inner *= full->ne[d];
  int64_t span = inner * full->ne[ds], span_mine = inner * a->ne[ds];
  int64_t group = full->ne[ds] / groups_of(p, full), reach = 1;
  int64_t ne[4], off = (int64_t)rtp__get_param_u64(t, 0) / f;
  size_t nb[4];
  memcpy(ne, t->ne, sizeof(ne));
  memcpy(nb, t->nb, sizeof(nb));
  for (int d = 0; d < RTP_MAX_DIMS; d++) { /* beyond ds: rescale */
    int64_t s = (int64_t)nb[d] / f;
    if (s >= span && s % span == 0) nb[d] = (size_t)(s / span * span_mine * f);
  }
  unsigned chain = 0;
  for (bool grew = true; grew;) { /* within ds: a dense chain from stride `inner` up */
    grew = false;
    for (int d = 0; d < RTP_MAX_DIMS; d++)
      if (ne[d] > 1 && (int64_t)t->nb[d] / f == reach * inner && reach < span / inner) {
        reach *= ne[d];
        top = d;
        chain |= 1u << d;
        grew = true;
      }
  }
  bool placed = true; /* every other dimension lies wholly below ds or beyond it */
  for (int d = 0; d < RTP_MAX_DIMS; d++) {
    int64_t s = (int64_t)t->nb[d] / f;
    if (ne[d] > 1 && !(chain >> d & 1) && s * ne[d] > inner && (s < span || s % span))
      placed = false;
  }
  int64_t c = off % span / inner;
  if (top < 0 || !placed || reach != group || c % group)
    return tp_error(p, t,
                    "a view of a split tensor must cover exactly one of its groups "
                    "(e.g. all heads of q)");
  if (ne[top] % N) {
    char s[160];
    snprintf(s, sizeof(s),
             "dimension %d (%lld, e.g. attention heads) is not divisible by the %d ranks", top,
             (long long)ne[top], N);
    return tp_error(p, t, s);
  }
  ne[top] /= N;
  int64_t mine = off / span * span_mine + c / group * (group / N) * inner + off % inner;
  return rtp_view(p->ctx, a, RTP_MAX_DIMS, ne, nb, (size_t)(mine * f));
}

/* A reshape of a tensor split along ds: the result dimension that ends where ds ends
 * (and starts at a boundary of ds's inner dimensions, or inside ds) is split instead. */
static struct rtp_tensor *tp_reshape(struct rtp_parallel *p, const struct rtp_tensor *t,
                                     struct rtp_tensor *a) {
  const struct rtp_tensor *full = t->src[0];
  int ds = split_of(full, a);
  int64_t inner = 1, ne[4], below = 1;
  for (int d = 0; d < ds; d++) inner *= full->ne[d];
  memcpy(ne, t->ne, sizeof(ne));
  for (int k = 0; k < RTP_MAX_DIMS; below *= ne[k], k++) {
    bool aligned = inner % below == 0 || below % inner == 0;
    if (below * ne[k] == inner * full->ne[ds] && aligned && ne[k] % p->world == 0 &&
        groups_of(p, full) == 1) {
      ne[k] /= p->world;
      return rtp_reshape(p->ctx, a, RTP_MAX_DIMS, ne);
    }
  }
  return tp_error(p, t, "this reshape does not keep the split dimension whole");
}

/* The op again over this rank's parts: builders recompute the shapes. Ops that reduce
 * over a split dimension would give partial results and are refused. */
static struct rtp_tensor *tp_rebuild_op(struct rtp_parallel *p, const struct rtp_tensor *t,
                                        struct rtp_tensor **s) {
  struct rtp_context *ctx = p->ctx;
  int ds0 = split_of(t->src[0], s[0]), ds1 = s[1] ? split_of(t->src[1], s[1]) : -1;
  switch (t->op) {
    case RTP_OP_ADD:
      return rtp_add(ctx, s[0], s[1]);
    case RTP_OP_SUB:
      return rtp_sub(ctx, s[0], s[1]);
    case RTP_OP_MUL:
      return rtp_mul(ctx, s[0], s[1]);
    case RTP_OP_SCALE:
      return rtp_scale(ctx, s[0], rtp__get_param_f32(t, 0));
    case RTP_OP_GELU:
      return rtp_gelu(ctx, s[0]);
    case RTP_OP_DUP:
      return rtp_dup(ctx, s[0]);
    case RTP_OP_PERMUTE:
      return rtp_permute(ctx, s[0], t->op_params[2], t->op_params[3], t->op_params[4],
                         t->op_params[5]);
    case RTP_OP_TRANSPOSE:
      return rtp_transpose(ctx, s[0]);
    case RTP_OP_VIEW:
      return tp_view(p, t, s[0]);
    case RTP_OP_RESHAPE:
      return tp_reshape(p, t, s[0]);
    case RTP_OP_SOFT_MAX: /* rows and the causal mask need ne[0] and ne[1] whole */
      if (ds0 < 2) return tp_error(p, t, "softmax over a split dimension");
      return rtp_soft_max(ctx, s[0], rtp__get_param_f32(t, 0), t->op_params[1]);
    case RTP_OP_MUL_MAT: /* a contraction over a split ne[0] is a row-parallel layer's job */
      if (ds0 == 0 || ds1 == 0) return tp_error(p, t, "contracts over a split dimension");
      if (ds0 == 1 && ds1 == 1) return tp_error(p, t, "both operands split their rows");
      return rtp_mul_mat(ctx, s[0], s[1]);
    default:
      return tp_error(p, t, "this op cannot read a tensor split between ranks");
  }
}

/* A node whose sources include a rank's part: rebuilt, with the groups of its split
 * sources (which must agree: a bias split like its layer's output). */
static struct rtp_tensor *tp_rebuild(struct rtp_parallel *p, int i,
                                     const struct rtp_tensor *t) {
  struct rtp_tensor *s[RTP_MAX_SRC] = {0};
  int groups = 0;
  for (int k = 0; k < RTP_MAX_SRC; k++) {
    if (!t->src[k]) continue;
    if (!(s[k] = mapped(p, t->src[k]))) return NULL;
    if (split_of(t->src[k], s[k]) < 0) continue;
    int g = groups_of(p, t->src[k]);
    if (groups && g != groups)
      return tp_error(p, t, "its sources are split in different groups");
    groups = g;
  }
  bool regroups = t->op == RTP_OP_VIEW || t->op == RTP_OP_RESHAPE;
  p->groups[i] = regroups ? 1 : groups;
  struct rtp_tensor *c = tp_rebuild_op(p, t, s);
  if (!c) return NULL;
  memcpy(c->name, t->name, sizeof(c->name));
  c->flags |= t->flags;
  return c;
}

/* Rank r's node for src node i: column and row layers replaced, nodes that read a
 * rank's part rebuilt for its shape, the rest cloned as they are. */
static struct rtp_tensor *tp_node(struct rtp_parallel *p, int i, const struct rtp_tensor *t) {
  enum rtp_tp_role role = t->op == RTP_OP_MUL_MAT ? tp_role(t->src[0]) : RTP_TP_REPLICATED;
  p->groups[i] = 1;
  if (role != RTP_TP_REPLICATED) {
    struct rtp_tensor *c = role == RTP_TP_COLUMN ? tp_column(p, i, t) : tp_row(p, t);
    if (c) memcpy(c->name, t->name, sizeof(c->name));
    return c;
  }
  for (int k = 0; k < RTP_MAX_SRC; k++) {
    struct rtp_tensor *m = t->src[k] ? mapped(p, t->src[k]) : NULL;
    if (m && split_of(t->src[k], m) >= 0) return tp_rebuild(p, i, t);
  }
  return clone_node(p, t);
}

/* ---- the pass ------------------------------------------------------------------- */

/* Which parameter, if any, node t reads (the first one). */
static const struct rtp_tensor *param_read(const struct rtp_tensor *t) {
  for (int s = 0; s < RTP_MAX_SRC; s++)
    if (t->src[s] && (t->src[s]->flags & RTP_FLAG_PARAM)) return t->src[s];
  return NULL;
}

/* fsdp: where each parameter lies in its unit's slot (parameters of a unit one after
 * another, in the order of the leaves), and the elements of the largest unit. */
static size_t fsdp_units(struct rtp_parallel *p) {
  const struct rtp_graph *src = p->src;
  size_t largest = 0;
  for (int q = 0; q < src->n_leafs; q++) {
    const struct rtp_tensor *t = src->leafs[q];
    if (!(t->flags & RTP_FLAG_PARAM)) continue;
    size_t offs = 0; /* after the parameter before it in its unit */
    for (int e = q - 1; e >= 0 && !offs; e--)
      if ((src->leafs[e]->flags & RTP_FLAG_PARAM) &&
          unit_key(src->leafs[e], e) == unit_key(t, q))
        offs = p->unit_offs[e] +
               RTP_PAD((size_t)rtp_nelements(src->leafs[e]), RTP_ALIGN / sizeof(float));
    p->unit_offs[q] = offs;
    if (offs + (size_t)rtp_nelements(t) > largest) largest = offs + (size_t)rtp_nelements(t);
  }
  return largest;
}

/* rtp: two block slots and two gradient slots, each for the largest block. fsdp: two
 * slots for the largest unit (one in use, one being gathered) and two gradient slots
 * for the largest block (the reduce-scatter ring). */
static int make_pool(struct rtp_parallel *p) {
  size_t largest = 0, unit = 0;
  if (p->strategy == RTP_STRATEGY_FSDP) {
    size_t n = (size_t)p->src->n_leafs;
    p->unit_offs = rtp__ctx_alloc(p->ctx, sizeof(size_t) * n + 1, "fsdp's unit layout");
    for (int i = 0; i < 2; i++)
      p->gathered[i] = rtp__ctx_alloc(p->ctx, sizeof(struct rtp_tensor *) * n + 1,
                                      "fsdp's gathered parameters");
    if (!p->unit_offs || !p->gathered[0] || !p->gathered[1])
      return rtp_context_error(p->ctx, NULL);
    unit = fsdp_units(p);
    p->recent = -1;
  }
  for (int i = 0; i < p->src->n_leafs; i++) {
    const struct rtp_tensor *t = p->src->leafs[i];
    if (!(t->flags & RTP_FLAG_PARAM)) continue;
    if (t->ne[split_dim(t)] < p->world) {
      char s[128];
      rtp__shape_str(t, s, sizeof(s));
      return rtp__ctx_error(p->ctx, RTP_EINVAL,
                            "%s strategy: parameter %s has fewer rows (outermost dimension) "
                            "than the %d ranks to split it between",
                            rtp_strategy_name(p->strategy), s, p->world);
    }
    size_t n = largest_block(p->world, t);
    if (n > largest) largest = n;
  }
  p->pool_elems = largest;
  p->sink = rtp__ctx_alloc(p->ctx, sizeof(*p->sink) * (size_t)(p->src->n_nodes + 1),
                           "the rtp plan's late sums");
  if (!p->sink) return rtp_context_error(p->ctx, NULL);
  size_t w_elems = p->strategy == RTP_STRATEGY_FSDP ? unit : largest;
  for (int i = 0; i < 2; i++) { /* bf16 copies travel in a pool of half the bytes */
    p->pool_w[i] = rtp_new_tensor_1d(p->ctx, p->comm_type, (int64_t)w_elems);
    p->pool_g[i] = rtp_new_tensor_1d(p->ctx, p->comm_type, (int64_t)largest);
    for (int j = 0; j < 2; j++) {
      struct rtp_tensor *s = j ? p->pool_g[i] : p->pool_w[i];
      if (!s || (!s->data && !rtp__tensor_alloc(p->ctx, s, RTP_ROLE_COMM)))
        return rtp_context_error(p->ctx, NULL);
      s->role = RTP_ROLE_COMM;
      rtp_set_name(s, "rtp.pool.%c%d", j ? 'g' : 'w', i);
    }
  }
  return RTP_OK;
}

static int clone_forward(struct rtp_parallel *p) {
  const struct rtp_graph *src = p->src;
  bool rot = sharded(p);
  for (int i = 0; i < src->n_leafs; i++) {
    p->map[src->n_nodes + i] = clone_leaf(p, src->leafs[i]);
    if (!p->map[src->n_nodes + i]) return rtp_context_error(p->ctx, NULL);
  }
  for (int i = 0; i < src->n_nodes; i++) {
    const struct rtp_tensor *t = src->nodes[i], *param = rot ? param_read(t) : NULL;
    p->map[i] = param      ? rot_forward(p, t, param)
                : tp_on(p) ? tp_node(p, i, t)
                           : clone_node(p, t);
    if (!p->map[i]) {
      int err = rtp_context_error(p->ctx, NULL);
      return err ? err
                 : rtp__ctx_error(p->ctx, RTP_EINVAL, "rtp_parallelize: cannot clone %s",
                                  rtp_op_name(t->op));
    }
  }
  return RTP_OK;
}

/* Each rank's loss is the mean over its own batch: seeding backward with 1/N makes the
 * summed gradients those of the mean over the global batch. */
static int scale_seed(struct rtp_parallel *p) {
  struct rtp_tensor *seed = p->map[index_in(p, p->loss)]->grad;
  if (!seed || !seed->data) return rtp__error(RTP_ESTATE, "rtp_parallelize: no loss seed");
  rtp_set_f32(seed, 1.0f / (float)p->world);
  return RTP_OK;
}

/* Moves node `t` (last in g) to just after position `at`. */
static void graph_move_after(struct rtp_graph *g, int at, struct rtp_tensor *t) {
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
static void hoist_transfers(struct rtp_parallel *p) {
  struct rtp_graph *g = p->graph;
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
static void sink_sums(struct rtp_parallel *p) {
  struct rtp_graph *g = p->graph;
  for (int q = p->n_sink - 1; q >= 0; q--) {
    struct rtp_tensor *a = p->sink[q], *m[3] = {NULL};
    int n = 0;
    if (a->src[0] && a->src[0]->op == RTP_OP_CAST) m[n++] = a->src[0];
    m[n++] = a;
    int i = node_pos(g, m[0]), j = node_pos(g, a);
    if (i < 0 || j < i) continue;
    while (j + 1 < g->n_nodes && !refers_to(g->nodes[j + 1], m) &&
           !(j + 2 < g->n_nodes && g->nodes[j + 1]->op == RTP_OP_CAST &&
             g->nodes[j + 2]->src[0] == g->nodes[j + 1] && refers_to(g->nodes[j + 2], m)))
      j++; /* (a later sum sunk already stays right after its cast) */
    /* Nodes [i, j]: the others first, in their order, then the group in its. */
    for (int q2 = j, k = j; q2 >= i && k > j - n; q2--) {
      struct rtp_tensor *u = g->nodes[q2];
      if (!in_group(m, u)) continue;
      memmove(&g->nodes[q2], &g->nodes[q2 + 1], (size_t)(k - q2) * sizeof(u));
      g->nodes[k--] = u;
    }
  }
}

/*
 * ddp: the gradients of consecutive parameters that are adjacent in memory form buckets
 * of about bucket_bytes; each bucket's all-reduce is posted right after the last of its
 * gradients is computed, so it runs during the rest of backward.
 */
static int ddp_buckets(struct rtp_parallel *p, size_t bucket_bytes) {
  struct rtp_graph *g = p->graph;
  int n_params = 0;
  struct rtp_tensor *grads[4096];
  for (int i = 0; i < g->n_nodes && n_params < 4096; i++) /* in the order they are computed */
    if (g->nodes[i]->role == RTP_ROLE_GRAD && !g->nodes[i]->view_src)
      grads[n_params++] = g->nodes[i];
  int i = 0;
  while (i < n_params) {
    char *lo = grads[i]->data, *hi = lo + rtp_nbytes(grads[i]);
    int j = i + 1;
    for (; j < n_params && (size_t)(hi - lo) < bucket_bytes; j++) {
      char *d = grads[j]->data;
      if (d + rtp_nbytes(grads[j]) + RTP_ALIGN < lo || d > hi + RTP_ALIGN) break;
      if (d < lo) lo = d;
      if (d + rtp_nbytes(grads[j]) > hi) hi = d + rtp_nbytes(grads[j]);
    }
    /* The bucket spans the gradients and the padding between them. */
    struct rtp_tensor *span = rtp_new_tensor_1d(p->ctx, RTP_TYPE_F32, 0);
    if (!span) return rtp_context_error(p->ctx, NULL);
    span->ne[0] = (hi - lo) / (int64_t)sizeof(float);
    for (int d = 1; d < 4; d++) span->nb[d] = span->nb[0] * (size_t)span->ne[0];
    span->data = lo;
    rtp_set_name(span, "ddp.bucket.%d", i);
    struct rtp_tensor *ar = rtp_allreduce(p->ctx, p->comm, span, grads[j - 1]);
    if (!ar || rtp_graph_build(g, ar)) return rtp_context_error(p->ctx, NULL);
    int at = 0;
    for (int k = 0; k < g->n_nodes; k++)
      if (g->nodes[k] == grads[j - 1]) at = k;
    graph_move_after(g, at, ar);
    i = j;
  }
  return RTP_OK;
}

/* The loss over the global batch, for logging: the ranks' means, averaged. */
static int global_loss(struct rtp_parallel *p) {
  struct rtp_tensor *l = p->map[index_in(p, p->loss)];
  if (p->world == 1 || p->strategy == RTP_STRATEGY_TP) { /* tp: every rank has the whole */
    p->global_loss = l;
    return RTP_OK;
  }
  struct rtp_tensor *copy = rtp_dup(p->ctx, l);
  struct rtp_tensor *sum = rtp_allreduce(p->ctx, p->comm, copy, NULL);
  p->global_loss = rtp_set_name(rtp_scale(p->ctx, sum, 1.0f / (float)p->world), "loss.global");
  rtp_set_output(p->global_loss);
  return p->global_loss ? rtp_graph_build(p->graph, p->global_loss)
                        : rtp_context_error(p->ctx, NULL);
}

/* Ranks must have built the same model: rank 0's fingerprint of names and shapes is
 * broadcast and compared. */
static int check_same_model(struct rtp_parallel *p) {
  uint64_t h = 1469598103934665603ull;
  for (int i = 0; i < p->src->n_leafs; i++) {
    const struct rtp_tensor *t = p->src->leafs[i];
    if (!(t->flags & RTP_FLAG_PARAM)) continue;
    for (const char *c = t->name; *c; c++) h = (h ^ (uint8_t)*c) * 1099511628211ull;
    for (int d = 0; d < 4; d++) h = (h ^ (uint64_t)t->ne[d]) * 1099511628211ull;
    for (int d = 0; d < 3; d++) /* tp's marks, fsdp's unit */
      h = (h ^ (uint64_t)t->op_params[d]) * 1099511628211ull;
  }
  if (p->comm_type) /* transfers must agree in size (f32 leaves the fingerprint as it was) */
    h = (h ^ (uint64_t)p->comm_type) * 1099511628211ull;
  if (p->compute_type) /* shifted: bf16 products alone must not hash as bf16 rotation */
    h = (h ^ ((uint64_t)p->compute_type << 8)) * 1099511628211ull;
  uint64_t root = h;
  int rc = rtp_comm_broadcast(p->comm, &root, sizeof(root), 0, NULL);
  if (rc) return rc;
  if (root != h)
    return rtp__error(RTP_EPEER,
                      "rtp_parallelize: rank %d built a different model than "
                      "rank 0 (parameter names, shapes or tp/fsdp marks, comm_type or "
                      "compute_type differ)",
                      p->rank);
  return RTP_OK;
}

/* compute_type is f32 or bf16, and no product of the model asks for a precision the pass
 * would lower: each rank's products are rebuilt (rtp, fsdp, tp) and take compute_type. */
static int check_compute_type(struct rtp_context *ctx, const struct rtp_graph *fwd,
                              enum rtp_type ct) {
  if (ct != RTP_TYPE_F32 && ct != RTP_TYPE_BF16)
    return rtp__ctx_error(ctx, RTP_EINVAL,
                          "rtp_parallelize: compute_type %s (%d): f32 or bf16 only",
                          rtp_type_name(ct), (int)ct);
  for (int i = 0; i < fwd->n_nodes; i++) {
    enum rtp_type prec = rtp_mul_mat_get_prec(fwd->nodes[i]);
    if (prec != RTP_TYPE_F32 && prec != ct)
      return rtp__ctx_error(ctx, RTP_EINVAL,
                            "rtp_parallelize: mul_mat '%s' has precision %s but compute_type "
                            "is %s (it sets the precision of every product: set it to %s)",
                            fwd->nodes[i]->name, rtp_type_name(prec), rtp_type_name(ct),
                            rtp_type_name(prec));
  }
  return RTP_OK;
}

/* Every product of the rank's graph, forward, backward and the passes' own, computes in
 * compute_type's precision. */
static void set_compute_type(struct rtp_parallel *p) {
  for (int i = 0; i < p->graph->n_nodes; i++)
    if (p->graph->nodes[i]->op == RTP_OP_MUL_MAT)
      rtp_mul_mat_set_prec(p->graph->nodes[i], p->compute_type);
}

struct rtp_parallel *rtp_parallelize(struct rtp_context *ctx, const struct rtp_graph *fwd,
                                     struct rtp_tensor *loss,
                                     const struct rtp_parallel_params *pp) {
  if (!ctx || !fwd || !loss || !pp) {
    rtp__error(RTP_EINVAL, "rtp_parallelize: NULL argument");
    return NULL;
  }
  int world = pp->comm ? rtp_comm_size(pp->comm) : 1;
  if ((pp->strategy == RTP_STRATEGY_NONE && world > 1) || world > RTP_MAX_WORLD) {
    rtp__ctx_error(ctx, RTP_EINVAL, "rtp_parallelize: strategy %s with %d ranks (max %d)",
                   rtp_strategy_name(pp->strategy), world, RTP_MAX_WORLD);
    return NULL;
  }
  /* Only rtp's rotations move bf16: ddp's and tp's all-reduces sum on the wire, which the
   * transport does in f32 only, and fsdp gathers and reduce-scatters f32 (not yet bf16). */
  if (pp->comm_type != RTP_TYPE_F32 &&
      (pp->comm_type != RTP_TYPE_BF16 || pp->strategy != RTP_STRATEGY_RTP)) {
    if (pp->comm_type != RTP_TYPE_BF16)
      rtp__ctx_error(ctx, RTP_EINVAL, "rtp_parallelize: comm_type %s (%d): f32 or bf16 only",
                     rtp_type_name(pp->comm_type), (int)pp->comm_type);
    else
      rtp__ctx_error(ctx, RTP_EINVAL,
                     "rtp_parallelize: strategy %s cannot send bf16 (comm_type bf16 is for "
                     "rtp only)",
                     rtp_strategy_name(pp->strategy));
    return NULL;
  }
  if (check_compute_type(ctx, fwd, pp->compute_type)) return NULL;
  struct rtp_parallel *p = rtp__ctx_alloc(ctx, sizeof(*p), "the parallel plan");
  struct rtp_tensor **map = rtp__ctx_alloc(
      ctx, sizeof(*map) * (size_t)(fwd->n_nodes + fwd->n_leafs + 1), "the parallel map");
  if (!p || !map) return NULL;
  *p = (struct rtp_parallel){.ctx = ctx,
                             .comm = pp->comm,
                             .strategy = pp->strategy,
                             .comm_type = pp->comm_type,
                             .compute_type = pp->compute_type,
                             .rank = pp->comm ? rtp_comm_rank(pp->comm) : 0,
                             .world = world,
                             .src = fwd,
                             .map = map,
                             .loss = loss};
  if (index_in(p, loss) < 0) {
    rtp__ctx_error(ctx, RTP_EINVAL, "rtp_parallelize: the loss is not a node of the graph");
    return NULL;
  }
  int rc = world > 1 ? check_same_model(p) : RTP_OK;
  if (!rc && sharded(p)) rc = make_pool(p);
  if (!rc && tp_on(p)) rc = tp_prepare(p);
  if (!rc) rc = clone_forward(p);
  if (!rc && !(p->graph = rtp_graph_new(ctx, pp->graph_size > 0 ? pp->graph_size : 16384)))
    rc = rtp_context_error(ctx, NULL);
  struct rtp_tensor *l = rc ? NULL : p->map[index_in(p, loss)];
  if (!rc) rc = rtp_graph_build(p->graph, l);
  if (!rc) rc = rtp_build_backward(ctx, p->graph, l);
  if (!rc && world > 1 && pp->strategy != RTP_STRATEGY_TP) rc = scale_seed(p);
  if (!rc && p->strategy == RTP_STRATEGY_DDP && world > 1)
    rc = ddp_buckets(p, pp->bucket_bytes ? pp->bucket_bytes : (size_t)4 << 20);
  if (!rc && sharded(p)) {
    sink_sums(p);
    hoist_transfers(p);
  }
  if (!rc) rc = global_loss(p);
  if (!rc) set_compute_type(p);
  if (rc) {
    if (!rtp_context_error(ctx, NULL)) rtp__ctx_error(ctx, rc, "%s", rtp_last_error());
    return NULL;
  }
  return p;
}
