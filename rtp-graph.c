/* rtp-graph.c - graphs: recording nodes in dependency order, and autodiff. */
#include "rtp-impl.h"

#include <stdlib.h>
#include <string.h>

/* The graph as the context keeps it: a pointer set for "already in the graph", with one
 * flag byte per entry that backward uses for "depends on a parameter". */
struct graph_obj {
  struct rtp_graph g;
  struct rtp_context *ctx;
  size_t hash_size; /* a power of two */
  struct rtp_tensor **keys;
  uint8_t *marks;
  bool accumulate;    /* rtp__graph_set_accumulate */
  bool planned_grads; /* rtp__graph_set_planned_grads */
};

static size_t hash_slot(const struct graph_obj *go, const struct rtp_tensor *t) {
  size_t h = (size_t)(uintptr_t)t >> 4;
  h ^= h >> 17;
  h *= 0x9E3779B97F4A7C15ull;
  size_t i = h & (go->hash_size - 1);
  while (go->keys[i] && go->keys[i] != t) i = (i + 1) & (go->hash_size - 1);
  return i;
}

static bool graph_has(const struct graph_obj *go, const struct rtp_tensor *t) {
  return go->keys[hash_slot(go, t)] == t;
}

struct rtp_graph *rtp_graph_new(struct rtp_context *ctx, int size) {
  if (size <= 0) {
    rtp__ctx_error(ctx, RTP_EINVAL, "rtp_graph_new: size must be positive, got %d", size);
    return NULL;
  }
  size_t hs = 16;
  while (hs < 2 * (size_t)size) hs *= 2;
  size_t bytes = sizeof(struct graph_obj) + 2 * (size_t)size * sizeof(struct rtp_tensor *) +
                 hs * (sizeof(struct rtp_tensor *) + 1) + 64;
  uint8_t *mem = rtp__ctx_alloc(ctx, bytes, "a graph");
  if (!mem) return NULL;
  memset(mem, 0, bytes);
  struct graph_obj *go = (struct graph_obj *)mem;
  go->ctx = ctx;
  go->g.size = size;
  go->g.nodes = (struct rtp_tensor **)(go + 1);
  go->g.leafs = go->g.nodes + size;
  go->keys = go->g.leafs + size;
  go->marks = (uint8_t *)(go->keys + hs);
  go->hash_size = hs;
  return &go->g;
}

/* Depth-first, sources before their consumers. */
static int visit(struct graph_obj *go, struct rtp_tensor *t) {
  size_t slot = hash_slot(go, t);
  if (go->keys[slot] == t) return RTP_OK;
  for (int i = 0; i < RTP_MAX_SRC; i++)
    if (t->src[i]) {
      int rc = visit(go, t->src[i]);
      if (rc) return rc;
    }
  struct rtp_graph *g = &go->g;
  bool leaf = t->op == RTP_OP_NONE;
  if ((leaf ? g->n_leafs : g->n_nodes) >= g->size)
    return rtp__ctx_error(go->ctx, RTP_ENOMEM, "graph full: more than %d %s (raise size)",
                          g->size, leaf ? "leafs" : "nodes");
  slot = hash_slot(go, t); /* the recursion may have filled the old slot */
  go->keys[slot] = t;
  if (leaf)
    g->leafs[g->n_leafs++] = t;
  else
    g->nodes[g->n_nodes++] = t;
  return RTP_OK;
}

int rtp_graph_build(struct rtp_graph *g, struct rtp_tensor *t) {
  if (!g) return rtp__error(RTP_EINVAL, "rtp_graph_build: NULL graph");
  struct graph_obj *go = (struct graph_obj *)g;
  if (!t) {
    const char *msg;
    int err = rtp_context_error(go->ctx, &msg);
    return err ? rtp__error(err, "%s", msg)
               : rtp__error(RTP_EINVAL, "rtp_graph_build: NULL tensor");
  }
  if (g->plan) return rtp__error(RTP_ESTATE, "rtp_graph_build: the graph is already planned");
  return visit(go, t);
}

int rtp__graph_order_like(struct rtp_graph *g, const struct rtp_graph *like) {
  const struct graph_obj *go = (const struct graph_obj *)g;
  int n = 0;
  for (int i = 0; i < like->n_nodes && n < g->n_nodes; i++)
    if (graph_has(go, like->nodes[i])) g->nodes[n++] = like->nodes[i];
  if (n != g->n_nodes)
    return rtp__ctx_error(go->ctx, RTP_EINVAL, "graph: %d of its %d nodes are not in the other",
                          g->n_nodes - n, g->n_nodes);
  return RTP_OK;
}

/* ---- autodiff ------------------------------------------------------------------- */

enum { MARK_NEEDS_GRAD = 1, MARK_GRAD_CLAIMED = 2 };

struct backward {
  struct rtp_context *ctx;
  struct graph_obj *go;
};

static uint8_t *mark_of(struct graph_obj *go, const struct rtp_tensor *t) {
  return &go->marks[hash_slot(go, t)];
}

static bool needs_grad(struct backward *bw, const struct rtp_tensor *t) {
  return graph_has(bw->go, t) && (*mark_of(bw->go, t) & MARK_NEEDS_GRAD);
}

static int backward_error(struct backward *bw, const struct rtp_tensor *t, const char *why) {
  char s[128];
  rtp__shape_str(t, s, sizeof(s));
  return rtp__ctx_error(bw->ctx, RTP_EINVAL, "backward of %s %s: %s", rtp_op_name(t->op), s,
                        why);
}

static void add_grad(struct backward *bw, struct rtp_tensor *t, struct rtp_tensor *c) {
  if (!needs_grad(bw, t)) return;
  if (t->grad && c && (c->type != RTP_TYPE_F32 || t->grad->type != RTP_TYPE_F32)) {
    /* Kernels add in f32 only, and a sum of bf16 gradients would round at every term. */
    backward_error(bw, t,
                   "a bf16 tensor read by several nodes: its gradients cannot be summed "
                   "(cast it to f32 once and let the readers share that)");
    return;
  }
  t->grad = t->grad ? rtp_add(bw->ctx, t->grad, c) : c;
}

/* A gradient product of mul_mat t: in t's precision, as autocast computes it. */
static struct rtp_tensor *grad_mul_mat(struct rtp_context *ctx, const struct rtp_tensor *t,
                                       struct rtp_tensor *a, struct rtp_tensor *b) {
  struct rtp_tensor *g = rtp_mul_mat(ctx, a, b);
  if (g) rtp_mul_mat_set_prec(g, rtp_mul_mat_get_prec(t));
  return g;
}

static void backward_mul_mat(struct backward *bw, struct rtp_tensor *t, struct rtp_tensor *dy) {
  struct rtp_context *ctx = bw->ctx;
  struct rtp_tensor *a = t->src[0], *b = t->src[1];
  if (rtp__addend(t)) add_grad(bw, t->src[2], dy);
  if (needs_grad(bw, b)) add_grad(bw, b, grad_mul_mat(ctx, t, rtp_transpose(ctx, a), dy));
  if (!needs_grad(bw, a)) return;
  bool a_2d = a->ne[2] == 1 && a->ne[3] == 1;
  if (a_2d && (b->ne[2] > 1 || b->ne[3] > 1)) {
    /* a serves every batch of b: its gradient sums over them, one GEMM over all rows. */
    b = rtp_reshape_2d(ctx, rtp_cont(ctx, b), b->ne[0], rtp_tensor_nrows(b));
    dy = rtp_reshape_2d(ctx, dy, dy->ne[0], rtp_tensor_nrows(dy));
  }
  add_grad(bw, a, grad_mul_mat(ctx, t, rtp_transpose(ctx, b), rtp_transpose(ctx, dy)));
}

static void backward_view(struct backward *bw, struct rtp_tensor *t, struct rtp_tensor *dy) {
  struct rtp_tensor *a = t->src[0];
  if (!needs_grad(bw, a)) return;
  if (a->type != RTP_TYPE_F32) {
    backward_error(bw, t, "only views of f32 tensors have gradients (cast to f32 first)");
    return;
  }
  if (!rtp_tensor_is_contiguous(a) || t->nb[0] != sizeof(float)) {
    backward_error(bw, t, "the source of a differentiated view must be contiguous");
    return;
  }
  size_t offset = rtp__get_param_u64(t, 0);
  struct rtp_tensor *g = rtp__acc_impl(bw->ctx, a->grad, a, dy, &t->nb[1], offset);
  if (g) a->grad = g; /* acc already added the old gradient */
}

static void backward_concat(struct backward *bw, struct rtp_tensor *t, struct rtp_tensor *dy) {
  int dim = t->op_params[0];
  struct rtp_tensor *a = t->src[0], *b = t->src[1];
  struct rtp_context *ctx = bw->ctx;
  if (needs_grad(bw, a))
    add_grad(bw, a, rtp_cont(ctx, rtp_view(ctx, dy, RTP_MAX_DIMS, a->ne, dy->nb, 0)));
  if (needs_grad(bw, b))
    add_grad(bw, b,
             rtp_cont(ctx, rtp_view(ctx, dy, RTP_MAX_DIMS, b->ne, dy->nb,
                                    (size_t)a->ne[dim] * dy->nb[dim])));
}

static void backward_node(struct backward *bw, struct rtp_tensor *t) {
  struct rtp_context *ctx = bw->ctx;
  struct rtp_tensor *dy = t->grad, *a = t->src[0], *b = t->src[1];
  switch (t->op) {
    case RTP_OP_DUP:
      add_grad(bw, a, dy);
      break;
    case RTP_OP_ADD:
    case RTP_OP_SUB:
      add_grad(bw, a, dy);
      if (needs_grad(bw, b)) {
        struct rtp_tensor *db = rtp_tensor_same_shape(a, b) ? dy : rtp_repeat_back(ctx, dy, b);
        add_grad(bw, b, t->op == RTP_OP_SUB ? rtp_scale(ctx, db, -1.0f) : db);
      }
      break;
    case RTP_OP_MUL:
      if (needs_grad(bw, a)) add_grad(bw, a, rtp_mul(ctx, dy, b));
      if (needs_grad(bw, b)) {
        struct rtp_tensor *db = rtp_mul(ctx, dy, a);
        add_grad(bw, b, rtp_tensor_same_shape(a, b) ? db : rtp_repeat_back(ctx, db, b));
      }
      break;
    case RTP_OP_SCALE:
      add_grad(bw, a, rtp_scale(ctx, dy, rtp__get_param_f32(t, 0)));
      break;
    case RTP_OP_CAST: /* the gradient of a conversion is the conversion back */
      add_grad(bw, a, dy->type == a->type ? dy : rtp_cast(ctx, dy, a->type));
      break;
    case RTP_OP_SUM:
    case RTP_OP_REPEAT_BACK:
      add_grad(bw, a, rtp_repeat(ctx, dy, a));
      break;
    case RTP_OP_REPEAT:
      add_grad(bw, a, rtp_repeat_back(ctx, dy, a));
      break;
    case RTP_OP_MUL_MAT:
      backward_mul_mat(bw, t, dy);
      break;
    case RTP_OP_NORM: {
      struct rtp_tensor *g = rtp__op3(ctx, RTP_OP_NORM_BACK, a->ne, dy, a, NULL);
      if (g) rtp__set_param_f32(g, 0, rtp__get_param_f32(t, 0));
      add_grad(bw, a, g);
      break;
    }
    case RTP_OP_GELU:
      add_grad(bw, a, rtp__op3(ctx, RTP_OP_GELU_BACK, a->ne, dy, a, NULL));
      break;
    case RTP_OP_SOFT_MAX: {
      struct rtp_tensor *g = rtp__op3(ctx, RTP_OP_SOFT_MAX_BACK, a->ne, dy, t, NULL);
      if (g) rtp__set_param_f32(g, 0, rtp__get_param_f32(t, 0));
      add_grad(bw, a, g);
      break;
    }
    case RTP_OP_ATTENTION:
      add_grad(bw, a, rtp__attention_back(ctx, t, dy));
      break;
    case RTP_OP_GET_ROWS:
      add_grad(bw, a, rtp__op3(ctx, RTP_OP_GET_ROWS_BACK, a->ne, dy, b, NULL));
      break;
    case RTP_OP_CROSS_ENTROPY:
      add_grad(bw, a, rtp__op3(ctx, RTP_OP_CROSS_ENTROPY_BACK, a->ne, dy, a, b));
      break;
    case RTP_OP_ACC: /* src[0] was added into a view of the base src[1] */
      if (b) add_grad(bw, b, dy);
      if (needs_grad(bw, a)) {
        size_t nb[4] = {sizeof(float)};
        for (int i = 0; i < 3; i++) nb[i + 1] = rtp__get_param_u64(t, 2 * i);
        size_t offs = rtp__get_param_u64(t, 6);
        add_grad(bw, a, rtp_cont(ctx, rtp_view(ctx, dy, RTP_MAX_DIMS, a->ne, nb, offs)));
      }
      break;
    case RTP_OP_CONCAT:
      backward_concat(bw, t, dy);
      break;
    case RTP_OP_RESHAPE:
      add_grad(bw, a, rtp_reshape(ctx, dy, RTP_MAX_DIMS, a->ne));
      break;
    case RTP_OP_VIEW:
      backward_view(bw, t, dy);
      break;
    case RTP_OP_PERMUTE: {
      int inv[4];
      for (int i = 0; i < 4; i++) inv[t->op_params[2 + i]] = i;
      add_grad(bw, a, rtp_cont(ctx, rtp_permute(ctx, dy, inv[0], inv[1], inv[2], inv[3])));
      break;
    }
    case RTP_OP_TRANSPOSE:
      add_grad(bw, a, rtp_cont(ctx, rtp_transpose(ctx, dy)));
      break;
    case RTP_OP_ROT: {
      struct rtp_tensor *dx = NULL, *dp = NULL;
      const struct rtp_rot_hook *h = rtp__rot_hook(t);
      h->backward(h, ctx, t, dy, needs_grad(bw, a) ? &dx : NULL, &dp);
      if (dx) add_grad(bw, a, dx);
      if (dp) add_grad(bw, b, dp); /* tp's handles have no parameter source */
      break;
    }
    default:
      backward_error(bw, t, "this op has no gradient");
  }
}

/* Gives p's gradient persistent memory (role GRAD; with planned gradients, a node of its
 * own that the plan places): the node that computes it writes there directly unless it
 * is shared or has no memory of its own, then a copy does. */
static struct rtp_tensor *claim_grad(struct backward *bw, struct rtp_tensor *p) {
  struct rtp_tensor *g = p->grad;
  if (!g) return NULL;
  bool own = g->op != RTP_OP_NONE && !g->view_src && !g->data &&
             !(graph_has(bw->go, g) && (*mark_of(bw->go, g) & MARK_GRAD_CLAIMED));
  if (!own) g = rtp_dup(bw->ctx, g);
  if (!g || rtp_graph_build(&bw->go->g, g)) return NULL;
  *mark_of(bw->go, g) |= MARK_GRAD_CLAIMED;
  if (!bw->go->planned_grads) {
    if (!rtp__tensor_alloc(bw->ctx, g, RTP_ROLE_GRAD)) return NULL;
    g->flags |= RTP_FLAG_OUTPUT;
  }
  rtp_tensor_set_name(g, "grad.%.58s", p->name);
  return p->grad = g;
}

/* Adds this call's contribution to p's gradient (p->grad) into the gradient an earlier
 * call claimed (old): an add whose result is old's memory, so accumulating takes no
 * memory of its own and no copy. The add reads each element before writing it. */
static struct rtp_tensor *accumulate_grad(struct backward *bw, struct rtp_tensor *p,
                                          struct rtp_tensor *old) {
  struct rtp_tensor *g = rtp_add(bw->ctx, old, rtp_cont(bw->ctx, p->grad));
  if (!g) return NULL;
  g->view_src = old->view_src ? old->view_src : old;
  g->view_offs = old->view_offs;
  g->data = old->data;
  g->role = RTP_ROLE_GRAD;
  g->flags |= RTP_FLAG_OUTPUT;
  rtp_tensor_set_name(g, "grad.%.58s", p->name);
  if (rtp_graph_build(&bw->go->g, g)) return NULL;
  return p->grad = g;
}

/* rtp__graph_set_accumulate: the first contribution to each parameter's gradient, too, is
 * added, into persistent memory of its own that the caller zeroes (a leaf: no node writes
 * it but the adds), so the graph's computes add up until the caller zeroes it again. The
 * headers come first and then the memory of all of them, so that the gradients lie side
 * by side, as claimed ones do (ddp's buckets span neighbours only). */
static int accumulate_leaves(struct backward *bw, struct rtp_tensor **old) {
  struct rtp_graph *g = &bw->go->g;
  struct rtp_tensor **acc = calloc((size_t)g->n_leafs + 1, sizeof(*acc));
  if (!acc) return rtp__ctx_error(bw->ctx, RTP_ENOMEM, "backward: out of memory");
  for (int i = g->n_leafs - 1; i >= 0; i--) {
    struct rtp_tensor *p = g->leafs[i];
    if (!(p->flags & RTP_FLAG_PARAM) || !p->grad || old[i]) continue;
    acc[i] = rtp__new_node(bw->ctx, RTP_OP_NONE, RTP_TYPE_F32, p->ne, NULL, NULL);
    if (!acc[i]) break;
    rtp_tensor_set_name(acc[i], "grad.%.58s", p->name);
  }
  for (int i = g->n_leafs - 1; i >= 0 && !rtp_context_error(bw->ctx, NULL); i--)
    if (acc[i] && rtp__tensor_alloc(bw->ctx, acc[i], RTP_ROLE_GRAD)) old[i] = acc[i];
  free(acc);
  return rtp_context_error(bw->ctx, NULL);
}

void rtp__graph_set_accumulate(struct rtp_graph *g) {
  ((struct graph_obj *)g)->accumulate = true;
}

void rtp__graph_set_planned_grads(struct rtp_graph *g) {
  ((struct graph_obj *)g)->planned_grads = true;
}

static void mark_needs_grad(struct graph_obj *go) {
  struct rtp_graph *g = &go->g;
  for (int i = 0; i < g->n_leafs; i++) {
    uint8_t *m = mark_of(go, g->leafs[i]);
    *m = (g->leafs[i]->flags & RTP_FLAG_PARAM) ? MARK_NEEDS_GRAD : 0;
  }
  for (int i = 0; i < g->n_nodes; i++) {
    struct rtp_tensor *t = g->nodes[i];
    uint8_t need = t->flags & RTP__FLAG_GRAD_STOP ? MARK_NEEDS_GRAD : 0;
    for (int s = 0; s < RTP_MAX_SRC; s++)
      if (t->src[s] && (*mark_of(go, t->src[s]) & MARK_NEEDS_GRAD)) need = MARK_NEEDS_GRAD;
    *mark_of(go, t) = need;
    t->grad = NULL;
  }
}

/* Backward from outs[i] with gradient seeds[i] (already set as outs[i]->grad). */
static int backward_from(struct rtp_context *ctx, struct graph_obj *go, const char *what) {
  struct rtp_graph *g = &go->g;
  struct backward bw = {ctx, go};
  int n_fwd = g->n_nodes, n_leafs = g->n_leafs, rc = RTP_OK;
  /* Gradients an earlier call claimed: this call sums its own contributions apart, then
   * adds them in. */
  struct rtp_tensor **old = calloc((size_t)n_leafs + 1, sizeof(*old));
  if (!old) return rtp__ctx_error(ctx, RTP_ENOMEM, "%s: out of memory", what);
  for (int i = 0; i < n_leafs; i++)
    if (g->leafs[i]->flags & RTP_FLAG_PARAM) {
      old[i] = g->leafs[i]->grad;
      g->leafs[i]->grad = NULL;
    }
  /* A node that stops gradients keeps its own (for the caller) and passes none on. */
  for (int i = n_fwd - 1; i >= 0 && !rc; i--) {
    struct rtp_tensor *t = g->nodes[i];
    if (t->grad && (*mark_of(go, t) & MARK_NEEDS_GRAD) && !(t->flags & RTP__FLAG_GRAD_STOP))
      backward_node(&bw, t);
    rc = rtp_context_error(ctx, NULL);
  }
  if (!rc && go->accumulate) rc = accumulate_leaves(&bw, old);
  /* The last parameters used are the first whose gradients are ready. */
  for (int i = n_leafs - 1; i >= 0 && !rc; i--) {
    struct rtp_tensor *p = g->leafs[i];
    if (!(p->flags & RTP_FLAG_PARAM)) continue;
    if (!p->grad) /* no contribution from this loss */
      p->grad = old[i];
    else if (!(old[i] ? accumulate_grad(&bw, p, old[i]) : claim_grad(&bw, p)))
      rc = rtp_context_error(ctx, NULL);
  }
  free(old);
  return rc ? rc : rtp_context_error(ctx, NULL);
}

int rtp__graph_build_backward_seeded(struct rtp_context *ctx, struct rtp_graph *g, int n,
                                     struct rtp_tensor *const *outs,
                                     struct rtp_tensor *const *seeds) {
  const char *what = "rtp__graph_build_backward_seeded";
  if (!ctx || !g || n < 0 || (n && (!outs || !seeds)))
    return rtp__error(RTP_EINVAL, "%s: NULL argument", what);
  struct graph_obj *go = (struct graph_obj *)g;
  if (g->plan) return rtp__error(RTP_ESTATE, "%s: the graph is already planned", what);
  for (int i = 0; i < n; i++) {
    if (!outs[i] || !seeds[i] || !graph_has(go, outs[i]) || !graph_has(go, seeds[i]))
      return rtp__ctx_error(ctx, RTP_EINVAL, "%s: output %d or its seed is not in g", what, i);
    if (!rtp_tensor_same_shape(outs[i], seeds[i]) || seeds[i]->type != RTP_TYPE_F32)
      return rtp__ctx_error(ctx, RTP_ESHAPE, "%s: seed %d is not an f32 tensor of '%s''s shape",
                            what, i, outs[i]->name);
  }
  mark_needs_grad(go);
  bool any = false;
  for (int i = 0; i < n; i++) {
    any |= (*mark_of(go, outs[i]) & MARK_NEEDS_GRAD) != 0;
    outs[i]->grad = outs[i]->grad ? rtp_add(ctx, outs[i]->grad, seeds[i]) : seeds[i];
  }
  if (!any) return RTP_OK; /* nothing here depends on a parameter or a stopped input */
  return backward_from(ctx, go, what);
}

int rtp_graph_build_backward(struct rtp_context *ctx, struct rtp_graph *g,
                             struct rtp_tensor *loss) {
  if (!ctx || !g || !loss)
    return rtp__error(RTP_EINVAL, "rtp_graph_build_backward: NULL argument");
  struct graph_obj *go = (struct graph_obj *)g;
  if (g->plan)
    return rtp__error(RTP_ESTATE, "rtp_graph_build_backward: the graph is already planned");
  if (!graph_has(go, loss) || loss->op == RTP_OP_NONE)
    return rtp__ctx_error(ctx, RTP_EINVAL,
                          "rtp_graph_build_backward: the loss is not a node of g");
  if (rtp_tensor_nelements(loss) != 1 || loss->type != RTP_TYPE_F32)
    return rtp__ctx_error(ctx, RTP_ESHAPE,
                          "rtp_graph_build_backward: the loss must be an f32 scalar");
  mark_needs_grad(go);
  if (!(*mark_of(go, loss) & MARK_NEEDS_GRAD))
    return rtp__ctx_error(
        ctx, RTP_EINVAL,
        "rtp_graph_build_backward: the loss depends on no parameter (rtp_tensor_set_param)");
  loss->flags |= RTP_FLAG_LOSS | RTP_FLAG_OUTPUT;
  struct rtp_tensor *seed = rtp_tensor_new_1d(ctx, RTP_TYPE_F32, 1);
  if (!seed || (!seed->data && !rtp__tensor_alloc(ctx, seed, RTP_ROLE_INPUT)))
    return rtp_context_error(ctx, NULL);
  int rc = rtp_tensor_fill_f32(rtp_tensor_set_name(seed, "loss.seed"), 1.0f);
  if (rc) return rtp__ctx_error(ctx, rc, "rtp_graph_build_backward: %s", rtp_last_error());
  loss->grad = seed;
  return backward_from(ctx, go, "rtp_graph_build_backward");
}
