/* rtp-tp.c - the tp strategy (Megatron-style tensor parallelism): every rank runs the
 * whole batch and holds a part of the matrices the model marked (rtp_tensor_set_tp). A
 * column-parallel layer's input passes through a handle whose backward all-reduces its
 * gradient (f); a row-parallel layer's partial sums are all-reduced, and a handle passes
 * the gradient straight back (g). Every node between them that reads a rank's part is
 * rebuilt with its builder for the part's shape. docs/parallel.md, "tp". */
#include "rtp-strategy.h"

#include <stdio.h>
#include <string.h>

/* Marked parameters must split evenly: groups x N blocks along their dimension. */
static int tp_check_params(struct rtp_parallel *p) {
  int world = rtp_comm_size(p->comm);
  for (int i = 0; i < p->src->n_leafs; i++) {
    const struct rtp_tensor *t = p->src->leafs[i];
    enum rtp_tp_role role = rtp__tp_role(t);
    if (role == RTP_TP_REPLICATED) continue;
    int dim = role == RTP_TP_ROW ? 0 : rtp__param_split_dim(t), groups = t->op_params[1];
    if (role > RTP_TP_ROW || groups < 1 || t->ne[dim] % ((int64_t)groups * world)) {
      char s[128];
      rtp__shape_str(t, s, sizeof(s));
      return rtp__ctx_error(p->ctx, RTP_EINVAL,
                            "tp strategy: parameter %s: dimension %d (%lld, in %d groups) "
                            "does not split evenly between %d ranks",
                            s, dim, (long long)t->ne[dim], groups, world);
    }
  }
  return RTP_OK;
}

/* The parameters checked, and (the state) the groups of the split dimension of every src
 * node's rank tensor. */
static int tp_prepare(struct rtp_parallel *p) {
  p->state = rtp__ctx_alloc(p->ctx, sizeof(int) * (size_t)p->src->n_nodes, "tp groups");
  return p->state ? tp_check_params(p) : rtp_context_error(p->ctx, NULL);
}

/* The dimension along which this rank's tensor is a part of the one-device one, or -1. */
static int split_of(const struct rtp_tensor *full, const struct rtp_tensor *mine) {
  for (int d = 0; d < RTP_MAX_DIMS; d++)
    if (full->ne[d] != mine->ne[d]) return d;
  return -1;
}

/* Groups of the split dimension of a one-device tensor's rank tensor. */
static int groups_of(struct rtp_parallel *p, const struct rtp_tensor *t) {
  if (t->op == RTP_OP_NONE) return rtp__tp_role(t) == RTP_TP_COLUMN ? t->op_params[1] : 1;
  int i = rtp__parallel_index(p, t);
  return i >= 0 && i < p->src->n_nodes ? ((int *)p->state)[i] : 1;
}

static struct rtp_tensor *tp_error(struct rtp_parallel *p, const struct rtp_tensor *t,
                                   const char *why) {
  char s[128];
  rtp__shape_str(t, s, sizeof(s));
  rtp__ctx_error(p->ctx, RTP_EINVAL, "tp strategy: %s %s: %s", rtp_op_name(t->op), s, why);
  return NULL;
}

/* A handle that autodiff sees as an op of src0 (and src1), whose data is y's and whose
 * backward is tp_backward (through the plan's hook). */
static struct rtp_tensor *tp_handle(struct rtp_parallel *p, enum rtp__rot_kind kind,
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
  rtp__rot_set_hook(h, &p->hook);
  return h;
}

/* f: identity forward; backward sums the input gradient, of which each rank computed the
 * part its block of output rows contributes. The handle is the column layer's only
 * reader, so its gradient is a fresh node that the all-reduce may sum in place. */
static void tp_backward(struct rtp_parallel *p, struct rtp_tensor *t, struct rtp_tensor *dy,
                        struct rtp_tensor **dx, struct rtp_tensor **dp) {
  if (t->op_params[0] == RTP__ROT_TP_REDUCE) /* g: every rank's dy is already the whole one */
    *dp = dy;
  else if (dx)
    *dx = rtp_allreduce(p->ctx, p->comm, dy, NULL);
}

/* y = W x with this rank's rows of W: x is whole (replicated), y is this rank's part. */
static struct rtp_tensor *tp_column(struct rtp_parallel *p, int i, const struct rtp_tensor *t) {
  struct rtp_tensor *x = rtp__parallel_mapped(p, t->src[1]);
  if (split_of(t->src[1], x) >= 0)
    return tp_error(p, t, "the input of a column-parallel layer must be whole on every rank");
  struct rtp_tensor *f = tp_handle(p, RTP__ROT_TP_ENTER, x, NULL, x);
  ((int *)p->state)[i] = t->src[0]->op_params[1];
  return f ? rtp_mul_mat(p->ctx, rtp__parallel_mapped(p, t->src[0]), f) : NULL;
}

/* y = W x with this rank's columns of W and its part of x: a partial sum, all-reduced.
 * The handle reads the sum (src[0], so readers wait for it) and passes the gradient
 * straight to the partial product (src[1]). */
static struct rtp_tensor *tp_row(struct rtp_parallel *p, const struct rtp_tensor *t) {
  struct rtp_tensor *w = rtp__parallel_mapped(p, t->src[0]),
                    *x = rtp__parallel_mapped(p, t->src[1]);
  if (split_of(t->src[1], x) != 0 || x->ne[0] != w->ne[0])
    return tp_error(p, t,
                    "the input of a row-parallel layer must be split along ne[0] like its "
                    "weight (by a column-parallel layer before it)");
  struct rtp_tensor *y = rtp_mul_mat(p->ctx, w, x);
  struct rtp_tensor *sum = y ? rtp_allreduce(p->ctx, p->comm, y, NULL) : NULL;
  return sum ? tp_handle(p, RTP__ROT_TP_REDUCE, sum, y, sum) : NULL;
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
  int ds = split_of(full, a), N = rtp_comm_size(p->comm), top = -1;
  if (!rtp_tensor_is_contiguous(full) || !rtp_tensor_is_contiguous(a))
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

/* Whether reshape t leaves its source's dimensions up to ds as they are (only those
 * beyond ds are regrouped): then the split, groups and all, carries over. */
static bool keeps_split(const struct rtp_tensor *t, int ds) {
  for (int d = 0; d <= ds; d++)
    if (t->ne[d] != t->src[0]->ne[d]) return false;
  return ds >= 0;
}

/* A reshape of a tensor split along ds: the result dimension that ends where ds ends
 * (and starts at a boundary of ds's inner dimensions, or inside ds) is split instead. */
static struct rtp_tensor *tp_reshape(struct rtp_parallel *p, const struct rtp_tensor *t,
                                     struct rtp_tensor *a) {
  const struct rtp_tensor *full = t->src[0];
  int ds = split_of(full, a), world = rtp_comm_size(p->comm);
  int64_t inner = 1, ne[4], below = 1;
  for (int d = 0; d < ds; d++) inner *= full->ne[d];
  memcpy(ne, t->ne, sizeof(ne));
  if (keeps_split(t, ds)) {
    ne[ds] = a->ne[ds];
    return rtp_reshape(p->ctx, a, RTP_MAX_DIMS, ne);
  }
  for (int k = 0; k < RTP_MAX_DIMS; below *= ne[k], k++) {
    bool aligned = inner % below == 0 || below % inner == 0;
    if (below * ne[k] == inner * full->ne[ds] && aligned && ne[k] % world == 0 &&
        groups_of(p, full) == 1) {
      ne[k] /= world;
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
    case RTP_OP_ATTENTION: { /* q, k and v split by heads: the rank's heads */
      int world = rtp_comm_size(p->comm), H = t->op_params[1];
      if (ds0 != 0 || groups_of(p, t->src[0]) != 3)
        return tp_error(p, t, "needs q, k and v split by heads (c_attn's 3 groups)");
      if (H % world) {
        char why[96];
        snprintf(why, sizeof(why), "its %d heads are not divisible by the %d ranks", H, world);
        return tp_error(p, t, why);
      }
      return rtp_attention_causal(ctx, s[0], H / world, rtp__get_param_f32(t, 0));
    }
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
    if (!(s[k] = rtp__parallel_mapped(p, t->src[k]))) return NULL;
    if (split_of(t->src[k], s[k]) < 0) continue;
    int g = groups_of(p, t->src[k]);
    if (groups && g != groups)
      return tp_error(p, t, "its sources are split in different groups");
    groups = g;
  }
  /* views and reshapes regroup (a reshape that keeps the split does not); attention's
   * result has one group, its heads */
  bool regroups = t->op == RTP_OP_VIEW || t->op == RTP_OP_ATTENTION ||
                  (t->op == RTP_OP_RESHAPE && !keeps_split(t, split_of(t->src[0], s[0])));
  ((int *)p->state)[i] = regroups ? 1 : groups;
  struct rtp_tensor *c = tp_rebuild_op(p, t, s);
  if (!c) return NULL;
  memcpy(c->name, t->name, sizeof(c->name));
  c->flags |= t->flags;
  return c;
}

/* Rank r's node for src node i: column and row layers replaced, nodes that read a
 * rank's part rebuilt for its shape; NULL (cloned as they are) for the rest. */
static struct rtp_tensor *tp_node(struct rtp_parallel *p, int i, const struct rtp_tensor *t) {
  enum rtp_tp_role role = t->op == RTP_OP_MUL_MAT ? rtp__tp_role(t->src[0]) : RTP_TP_REPLICATED;
  ((int *)p->state)[i] = 1;
  if (role != RTP_TP_REPLICATED) {
    struct rtp_tensor *c = role == RTP_TP_COLUMN ? tp_column(p, i, t) : tp_row(p, t);
    if (c) memcpy(c->name, t->name, sizeof(c->name));
    return c;
  }
  for (int k = 0; k < RTP_MAX_SRC; k++) {
    struct rtp_tensor *m = t->src[k] ? rtp__parallel_mapped(p, t->src[k]) : NULL;
    if (m && split_of(t->src[k], m) >= 0) return tp_rebuild(p, i, t);
  }
  return NULL;
}

/* ---- the strategy ----------------------------------------------------------------- */

/* Marked parameters: along the marked dimension, in each of its groups, block r of N. */
static struct rtp_shard tp_shard(const struct rtp_parallel *p, const struct rtp_tensor *t) {
  struct rtp_shard s = {rtp__param_split_dim(t), 1, 0, t->ne[rtp__param_split_dim(t)]};
  enum rtp_tp_role role = rtp__tp_role(t);
  if (role != RTP_TP_REPLICATED) {
    s.dim = role == RTP_TP_ROW ? 0 : s.dim;
    s.groups = t->op_params[1];
    s.len = t->ne[s.dim] / s.groups / rtp_comm_size(p->comm);
    s.first = rtp_comm_rank(p->comm) * s.len;
  }
  return s;
}

/* Split gradients are shares of the whole, and replicated ones are whole on every rank:
 * the norm sums over ranks, each counting 1/N of the replicated ones. */
static void tp_optimizer(const struct rtp_parallel *p, struct rtp_optimizer *opt) {
  rtp__optimizer_set_comm(opt, p->comm);
  for (int i = 0; i < p->src->n_leafs; i++) {
    const struct rtp_tensor *t = p->src->leafs[i];
    if ((t->flags & RTP_FLAG_PARAM) && rtp__tp_role(t) == RTP_TP_REPLICATED)
      rtp__optimizer_set_norm_weight(opt, p->map[p->src->n_nodes + i],
                                     1.0f / (float)rtp_comm_size(p->comm));
  }
}

const struct rtp_strategy_i rtp__strategy_tp = {
    .name = "tp",
    .whole_batch = true,
    .prepare = tp_prepare,
    .shard = tp_shard,
    .node = tp_node,
    .backward = tp_backward,
    .optimizer = tp_optimizer,
};
