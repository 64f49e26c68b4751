/* rtp-parallel.c - the parallel pass: turns a one-device forward graph into one rank's
 * training graph with a strategy (ddp, fsdp, rtp, tp: rtp-ddp.c, rtp-fsdp.c,
 * rtp-rotate.c, rtp-tp.c), called through its interface (rtp-strategy.h).
 *
 * The model is built once, for one device, in a context that may give parameters no
 * memory (no_alloc). The pass clones its forward graph into the rank's context node by
 * node, letting the strategy replace the nodes it changes, then builds backward there
 * with the ordinary autodiff: the strategy's ops are ROT nodes whose backward autodiff
 * reaches through the plan's hook. Here too: the checks every strategy needs (the same
 * model on every rank, the precision of products), the loss over all ranks and the
 * seeding of backward. */
#include "rtp-backend.h"
#include "rtp-strategy.h"
#include "rtp-opt.h"

#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

int rtp_tensor_set_tp(struct rtp_tensor *param, enum rtp_tp_role role, int groups) {
  if (!rtp__param_leaf(param))
    return rtp__error(RTP_EINVAL,
                      "rtp_tensor_set_tp: not a parameter (call rtp_tensor_set_param first)");
  if ((unsigned)role > RTP_TP_ROW || groups < 1 || (role == RTP_TP_ROW && groups != 1))
    return rtp__error(RTP_EINVAL, "rtp_tensor_set_tp: bad role %d or groups %d for '%s'",
                      (int)role, groups, param->name);
  param->op_params[0] = (int32_t)role;
  param->op_params[1] = role == RTP_TP_COLUMN ? groups : 1;
  return RTP_OK;
}

int rtp_tensor_set_fsdp_unit(struct rtp_tensor *param, int unit) {
  if (!rtp__param_leaf(param))
    return rtp__error(
        RTP_EINVAL,
        "rtp_tensor_set_fsdp_unit: not a parameter (call rtp_tensor_set_param first)");
  if (unit < 0)
    return rtp__error(RTP_EINVAL, "rtp_tensor_set_fsdp_unit: unit %d for '%s' (0 or more)",
                      unit, param->name);
  param->op_params[2] = unit;
  return RTP_OK;
}

/* ---- the map from one-device tensors to this rank's ------------------------------ */

int rtp__parallel_index(const struct rtp_parallel *p, const struct rtp_tensor *t) {
  for (int i = 0; i < p->src->n_nodes; i++)
    if (p->src->nodes[i] == t) return i;
  for (int i = 0; i < p->src->n_leafs; i++)
    if (p->src->leafs[i] == t) return p->src->n_nodes + i;
  return -1;
}

/* Entries of the map per micro-batch: src's nodes, then its leaves. */
static size_t map_rows(const struct rtp_graph *src) {
  return (size_t)(src->n_nodes + src->n_leafs);
}

struct rtp_tensor *rtp__parallel_mapped(const struct rtp_parallel *p,
                                        const struct rtp_tensor *t) {
  int i = t ? rtp__parallel_index(p, t) : -1;
  return i >= 0 ? p->map[i] : NULL;
}

/* What this rank holds of parameter t: the strategy's part, or all of it. */
static struct rtp_shard shard_of(const struct rtp_parallel *p, const struct rtp_tensor *t) {
  if (p->iface->shard) return p->iface->shard(p, t);
  int dim = rtp__param_split_dim(t);
  return (struct rtp_shard){dim, 1, 0, t->ne[dim]};
}

struct rtp_tensor *rtp_parallel_tensor(const struct rtp_parallel *p,
                                       const struct rtp_tensor *t) {
  if (!p || !t) return NULL;
  if (t == p->loss) return p->global_loss;
  int i = rtp__parallel_index(p, t);
  return i >= 0 ? p->map[i] : NULL;
}

struct rtp_tensor *rtp_parallel_micro_tensor(const struct rtp_parallel *p,
                                             const struct rtp_tensor *t, int m) {
  if (!p || !t || m < 0 || m >= p->micro_batches) {
    rtp__error(RTP_EINVAL, "rtp_parallel_micro_tensor: micro-batch %d of %d", m,
               p ? p->micro_batches : 0);
    return NULL;
  }
  if (t == p->loss) return p->global_loss;
  int i = rtp__parallel_index(p, t);
  if (i < 0) rtp__error(RTP_EINVAL, "rtp_parallel_micro_tensor: not a tensor of the model");
  return i >= 0 ? p->maps[(size_t)m * map_rows(p->src) + (size_t)i] : NULL;
}

struct rtp_graph *rtp_parallel_graph(const struct rtp_parallel *p) {
  return p ? p->graph : NULL;
}

struct rtp_graph *rtp_parallel_forward_graph(struct rtp_parallel *p,
                                             const struct rtp_tensor *out) {
  int i = p && out ? rtp__graph_index(p->src, out) : -1;
  if (i < 0 || out == p->loss) {
    rtp__error(RTP_EINVAL, "rtp_parallel_forward_graph: not a forward node of the model");
    return NULL;
  }
  struct rtp_graph *g = rtp_graph_new(p->ctx, p->graph->n_nodes + 1);
  int rc = !g        ? rtp_context_error(p->ctx, NULL)
           : p->pipe ? rtp__pipeline_forward(p, i, g)
                     : rtp_graph_build(g, p->maps[i]);
  if (!rc) rc = rtp__graph_order_like(g, p->graph);
  if (rc) {
    rtp__error(rc, "rtp_parallel_forward_graph: %s", rtp_last_error());
    return NULL;
  }
  return g;
}

int rtp_parallel_block(const struct rtp_parallel *p, const struct rtp_tensor *param,
                       int64_t *first, int64_t *len, int *dim) {
  if (!p || !param || !(param->flags & RTP_FLAG_PARAM) || rtp__parallel_index(p, param) < 0)
    return rtp__error(RTP_EINVAL, "rtp_parallel_block: not a parameter of the model");
  if (!rtp_parallel_tensor(p, param))
    return rtp__error(RTP_EINVAL, "rtp_parallel_block: '%s' belongs to another pipeline stage",
                      param->name);
  struct rtp_shard s = shard_of(p, param);
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
      param->type != RTP_TYPE_F32 || rtp__parallel_index(p, param) < 0)
    return rtp__error(RTP_EINVAL, "rtp_parallel_shard_copy: not an f32 parameter of the model");
  if (!rtp_parallel_tensor(p, param))
    return rtp__error(RTP_EINVAL,
                      "rtp_parallel_shard_copy: '%s' belongs to another pipeline stage",
                      param->name);
  struct rtp_shard s = shard_of(p, param);
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

int rtp_parallel_zero_grads(const struct rtp_parallel *p) {
  if (!p) return rtp__error(RTP_EINVAL, "rtp_parallel_zero_grads: NULL plan");
  if (p->accumulate == 1) return RTP_OK;
  const struct rtp_graph *g = p->graph;
  int rc = RTP_OK;
  for (int i = 0; i < g->n_leafs && !rc; i++)
    if ((g->leafs[i]->flags & RTP_FLAG_PARAM) && g->leafs[i]->grad)
      rc = rtp_tensor_set_zero(g->leafs[i]->grad);
  return rc;
}

int rtp_parallel_sync(struct rtp_parallel *p, struct rtp_threadpool *tp) {
  if (!p) return rtp__error(RTP_EINVAL, "rtp_parallel_sync: NULL plan");
  if (!p->sync) return RTP_OK;
  int rc = p->sync->plan ? RTP_OK : rtp_graph_plan(p->ctx, p->sync);
  return rc ? rc : rtp_graph_compute(p->sync, tp);
}

/* The graph's own optimizer, its hyperparameters set. */
static struct rtp_optimizer *optimizer_in_backward(const struct rtp_parallel *p,
                                                   struct rtp_adamw_params params) {
  struct rtp_optimizer *opt = p->opt;
  if (params.clip_norm > 0) {
    rtp__ctx_error(p->ctx, RTP_ENOSYS,
                   "rtp_parallel_optimizer: clipping (clip_norm %g) needs every gradient "
                   "before the first update, not the optimizer in backward",
                   (double)params.clip_norm);
    return NULL;
  }
  int rc = rtp__optimizer_set_params(opt, params);
  if (rc) rtp__ctx_error(p->ctx, rc, "%s", rtp_last_error());
  return rc ? NULL : opt;
}

struct rtp_optimizer *rtp_parallel_optimizer(const struct rtp_parallel *p,
                                             struct rtp_adamw_params params) {
  if (!p) {
    rtp__error(RTP_EINVAL, "rtp_parallel_optimizer: NULL plan");
    return NULL;
  }
  if (p->in_backward) return optimizer_in_backward(p, params);
  struct rtp_optimizer *opt = rtp_optimizer_new(p->ctx, p->graph, params);
  if (opt && p->iface->optimizer) p->iface->optimizer(p, opt);
  /* each stage holds other parameters: the norm sums over the pipe too (over the job with
   * stages of different sizes, where each stage's first rank adds the stage's share) */
  const struct rtp_hetero *het = p->pipe ? p->pipe->het : NULL;
  if (opt && rtp__pipeline_comm(p))
    rtp__optimizer_add_comm(opt, rtp__pipeline_comm(p), !het || het->g == 0);
  return opt;
}

/* ---- cloning -------------------------------------------------------------------- */

static struct rtp_tensor *clone_leaf(struct rtp_parallel *p, const struct rtp_tensor *t) {
  int64_t ne[4];
  memcpy(ne, t->ne, sizeof(ne));
  bool param = t->flags & RTP_FLAG_PARAM;
  if (param) {
    struct rtp_shard s = shard_of(p, t);
    ne[s.dim] = s.len * s.groups;
  }
  struct rtp_tensor *c = rtp_tensor_new(p->ctx, t->type, RTP_MAX_DIMS, ne);
  if (!c) return NULL;
  if (!c->data && !rtp__tensor_alloc(p->ctx, c, RTP_ROLE_INPUT)) return NULL;
  if (t->data && !param && rtp__tensor_copy(c, t)) { /* constants, maybe on a device */
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
    if (t->src[s] && !(src[s] = rtp__parallel_mapped(p, t->src[s]))) return NULL;
  struct rtp_tensor *c = rtp__new_node(p->ctx, t->op, t->type, t->ne, src[0], src[1]);
  if (!c) return NULL;
  for (int s = 2; s < RTP_MAX_SRC; s++) c->src[s] = src[s];
  memcpy(c->nb, t->nb, sizeof(c->nb));
  memcpy(c->op_params, t->op_params, sizeof(c->op_params));
  memcpy(c->name, t->name, sizeof(c->name));
  c->flags = t->flags;
  if (t->view_src) { /* the rank's source may itself be a view (a ROT node): use its base */
    struct rtp_tensor *b = rtp__parallel_mapped(p, t->view_src);
    if (!b) return NULL;
    c->view_src = b->view_src ? b->view_src : b;
    c->view_offs = t->view_offs + (b->view_src ? b->view_offs : 0);
    if (c->view_src->data) c->data = (char *)c->view_src->data + c->view_offs;
  }
  return c;
}

int rtp__graph_index(const struct rtp_graph *g, const struct rtp_tensor *t) {
  for (int i = 0; i < g->n_nodes; i++)
    if (g->nodes[i] == t) return i;
  return -1;
}

int rtp__parallel_clone_leaves(struct rtp_parallel *p, int m, const int *leaf_stage,
                               int stage) {
  const struct rtp_graph *src = p->src;
  p->map = p->maps + (size_t)m * map_rows(src);
  for (int i = 0; i < src->n_leafs; i++) {
    const struct rtp_tensor *t = src->leafs[i];
    struct rtp_tensor **c = &p->map[src->n_nodes + i];
    bool input = t->flags & RTP_FLAG_INPUT;
    if (!input && leaf_stage && leaf_stage[i] != stage) continue; /* another stage's */
    *c = m > 0 && !input ? p->maps[src->n_nodes + i] : clone_leaf(p, t);
    if (!*c) return rtp_context_error(p->ctx, NULL);
  }
  return RTP_OK;
}

int rtp__parallel_clone_node(struct rtp_parallel *p, int i) {
  const struct rtp_tensor *t = p->src->nodes[i];
  p->map[i] = p->iface->node ? p->iface->node(p, i, t) : NULL;
  if (!p->map[i] && !rtp_context_error(p->ctx, NULL)) p->map[i] = clone_node(p, t);
  if (p->map[i]) return RTP_OK;
  int err = rtp_context_error(p->ctx, NULL);
  return err ? err
             : rtp__ctx_error(p->ctx, RTP_EINVAL, "rtp_parallel_new: cannot clone %s",
                              rtp_op_name(t->op));
}

/* Micro-batch m's forward: its own inputs, the parameters and constants of the first. */
static int clone_forward(struct rtp_parallel *p, int m) {
  int rc = rtp__parallel_clone_leaves(p, m, NULL, 0);
  for (int i = 0; i < p->src->n_nodes && !rc; i++) rc = rtp__parallel_clone_node(p, i);
  return rc;
}

/* ---- what every strategy shares ------------------------------------------------- */

/* Each rank's loss is the mean over its own batch (tp: over the whole batch), each
 * micro-batch's over its own and each of K accumulated computes' over its own: seeding
 * each backward with 1/(N M K) (tp: 1/(M K)) makes the summed gradients those of the mean
 * over the global batch. */
static int scale_seed(struct rtp_parallel *p, struct rtp_tensor *loss) {
  int n = p->comm && !p->iface->whole_batch ? rtp_comm_size(p->comm) : 1;
  if (n * p->micro_batches * p->accumulate == 1) return RTP_OK;
  struct rtp_tensor *seed = loss->grad;
  if (!seed || !seed->data) return rtp__error(RTP_ESTATE, "rtp_parallel_new: no loss seed");
  return rtp_tensor_fill_f32(seed, 1.0f / (float)(n * p->micro_batches * p->accumulate));
}

/* Micro-batch m: its forward cloned, then its backward, which adds its gradients to the
 * micro-batches' before (rtp_graph_build_backward), so one micro-batch's activations are dead
 * when the next one's forward starts. */
static int micro_batch(struct rtp_parallel *p, int m, int graph_size) {
  if (p->iface->micro) p->iface->micro(p, m);
  int rc = clone_forward(p, m);
  if (!rc && !p->graph && !(p->graph = rtp_graph_new(p->ctx, graph_size)))
    rc = rtp_context_error(p->ctx, NULL);
  if (!rc && m == 0 && p->accumulate > 1) rtp__graph_set_accumulate(p->graph);
  if (!rc && m == 0 && p->in_backward) rtp__graph_set_planned_grads(p->graph);
  struct rtp_tensor *l = rc ? NULL : p->map[rtp__parallel_index(p, p->loss)];
  if (!rc) rc = rtp_graph_build(p->graph, l);
  if (!rc) rc = rtp_graph_build_backward(p->ctx, p->graph, l);
  if (!rc) rc = scale_seed(p, l);
  return rc;
}

/* The loss over the global batch, for logging: the means of the ranks and micro-batches,
 * averaged. */
static int global_loss(struct rtp_parallel *p) {
  int li = rtp__parallel_index(p, p->loss), M = p->micro_batches;
  struct rtp_tensor *l = p->maps[li], *sum = l;
  bool local = !p->comm || p->iface->whole_batch; /* tp: every rank has the whole */
  if (local && M == 1) {
    p->global_loss = l;
    return RTP_OK;
  }
  for (int m = 1; m < M; m++)
    sum = rtp_add(p->ctx, sum, p->maps[(size_t)m * map_rows(p->src) + (size_t)li]);
  if (!local) /* summed in place: a copy of the loss, which stays for the caller */
    sum = rtp_allreduce(p->ctx, p->comm, M == 1 ? rtp_dup(p->ctx, l) : sum, NULL);
  int n = local ? M : M * rtp_comm_size(p->comm);
  p->global_loss = rtp_tensor_set_name(rtp_scale(p->ctx, sum, 1.0f / (float)n), "loss.global");
  rtp_tensor_set_output(p->global_loss);
  return p->global_loss ? rtp_graph_build(p->graph, p->global_loss)
                        : rtp_context_error(p->ctx, NULL);
}

/* Ranks must have built the same model: rank 0's fingerprint of names and shapes is
 * broadcast and compared. */
static int check_same_model(struct rtp_parallel *p, struct rtp_comm *pipe,
                            enum rtp_schedule sched, const struct rtp_hetero *het) {
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
  if (het) { /* the stages, and what each runs, must agree over the job */
    h = (h ^ ((uint64_t)het->U << 16 | (uint64_t)sched << 40)) * 1099511628211ull;
    for (int s = 0; s < het->S; s++)
      h = (h ^ ((uint64_t)(het->first[s + 1] - het->first[s]) << 8 | (uint64_t)het->strat[s])) *
          1099511628211ull;
  } else if (p->micro_batches > 1) /* every micro-batch's transfers must meet the others' */
    h = (h ^ ((uint64_t)p->micro_batches << 16)) * 1099511628211ull;
  if (p->accumulate > 1) /* ddp's all-reduces move out of the graph */
    h = (h ^ ((uint64_t)p->accumulate << 48)) * 1099511628211ull;
  if (pipe) /* stages and their order of work must agree */
    h = (h ^ ((uint64_t)rtp_comm_size(pipe) << 24 | (uint64_t)sched << 40)) * 1099511628211ull;
  /* over the stage group, then the pipe: every rank against every other */
  struct rtp_comm *comms[2] = {p->comm, pipe};
  for (int c = 0; c < 2; c++) {
    if (!comms[c] || rtp_comm_size(comms[c]) == 1) continue;
    uint64_t root = h;
    int rc = rtp_comm_broadcast(comms[c], &root, sizeof(root), 0, NULL);
    if (rc) return rc;
    if (root != h)
      return rtp__error(RTP_EPEER,
                        "rtp_parallel_new: rank %d of its %s built a different model than "
                        "rank 0 (parameter names, shapes or tp/fsdp marks, comm_type, "
                        "compute_type, micro_batches, accumulate, stages or schedule differ)",
                        rtp_comm_rank(comms[c]), c ? "pipe" : "group");
  }
  return RTP_OK;
}

/* compute_type is f32 or bf16, and no product of the model asks for a precision the pass
 * would lower: each rank's products are rebuilt (rtp, fsdp, tp) and take compute_type. */
static int check_compute_type(struct rtp_context *ctx, const struct rtp_graph *fwd,
                              enum rtp_type ct) {
  if (ct != RTP_TYPE_F32 && ct != RTP_TYPE_BF16)
    return rtp__ctx_error(ctx, RTP_EINVAL,
                          "rtp_parallel_new: compute_type %s (%d): f32 or bf16 only",
                          rtp_type_name(ct), (int)ct);
  for (int i = 0; i < fwd->n_nodes; i++) {
    enum rtp_type prec = rtp_mul_mat_get_prec(fwd->nodes[i]);
    if (prec != RTP_TYPE_F32 && prec != ct)
      return rtp__ctx_error(ctx, RTP_EINVAL,
                            "rtp_parallel_new: mul_mat '%s' has precision %s but compute_type "
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

/* What autodiff calls for a ROT node of the plan: the strategy's backward. */
static void rot_backward(const struct rtp_rot_hook *hook, struct rtp_context *ctx,
                         struct rtp_tensor *t, struct rtp_tensor *dy, struct rtp_tensor **dx,
                         struct rtp_tensor **dp) {
  struct rtp_parallel *p =
      (struct rtp_parallel *)((uintptr_t)hook - offsetof(struct rtp_parallel, hook));
  p->iface->backward(p, t, rtp_cont(ctx, dy), dx, dp);
}

/* One rank: the one-device graph, cloned as it is. */
static const struct rtp_strategy_i one_process = {.name = "none"};

static const struct rtp_strategy_i *strategy_of(enum rtp_strategy s, int world) {
  if (world == 1) return &one_process;
  switch (s) {
    case RTP_STRATEGY_DDP:
      return &rtp__strategy_ddp;
    case RTP_STRATEGY_FSDP:
      return &rtp__strategy_fsdp;
    case RTP_STRATEGY_TP:
      return &rtp__strategy_tp;
    default:
      return &rtp__strategy_rtp;
  }
}

/* A device runs transfers in order on its comm stream, each one holding the stream until
 * its peer's matching one runs. Pipelines schedule sends and receives for the CPU, which
 * posts them all at once: under 1f1b a stage sends the next micro-batch's activations
 * before it receives the last one's gradients, while its neighbour sends those gradients
 * before it receives the activations, and on a device the two wait on each other for
 * good. gpipe (every forward, then every backward) and one micro-batch do not cross. A
 * backend that runs no transfers (the planner's, which only places memory) is not asked. */
static int check_device_pipeline(struct rtp_context *ctx, const struct rtp_parallel_params *pp,
                                 int M) {
  struct rtp_backend *b = rtp__ctx_backend(ctx);
  if (!b || !b->i->comm || !pp->pipe_comm || rtp_comm_size(pp->pipe_comm) < 2 || M < 2 ||
      pp->schedule == RTP_SCHEDULE_GPIPE)
    return RTP_OK;
  return rtp__ctx_error(ctx, RTP_ENOSYS,
                        "rtp_parallel_new: a pipeline of %d micro-batches on a device (%s) "
                        "runs the gpipe schedule only, not %s: in order on the device's comm "
                        "stream, the transfers of neighbouring stages would wait on each "
                        "other",
                        M, rtp_backend_name(b), rtp_schedule_name(pp->schedule));
}

/* What the optimizer in backward runs with: one update a step, after one backward, with no
 * norm to wait for. */
static int check_in_backward(struct rtp_context *ctx, const struct rtp_parallel_params *pp,
                             enum rtp_strategy strategy, int M) {
  const char *why = NULL;
  if (strategy != RTP_STRATEGY_NONE && strategy != RTP_STRATEGY_RTP &&
      strategy != RTP_STRATEGY_FSDP)
    why = "a strategy whose gradients are sharded or one process (none, rtp, fsdp)";
  else if (M > 1 || pp->accumulate > 1)
    why = "one micro-batch and no accumulation: the gradients would have to be kept";
  else if (pp->stages || (pp->pipe_comm && rtp_comm_size(pp->pipe_comm) > 1))
    why = "no pipeline stages";
  else if (pp->schedule == RTP_SCHEDULE_ZEROPP && pp->unit > 1)
    why = "no zeropp units";
  if (!why) return RTP_OK;
  return rtp__ctx_error(ctx, RTP_ENOSYS,
                        "rtp_parallel_new: the optimizer in backward (strategy %s) needs %s",
                        rtp_strategy_name(strategy), why);
}

static int add_optimizer(struct rtp_parallel *p) {
  if (!(p->opt = rtp__optimizer_in_backward(p->ctx, p->graph)))
    return rtp_context_error(p->ctx, NULL);
  if (p->iface->optimizer) p->iface->optimizer(p, p->opt);
  return RTP_OK;
}

struct rtp_parallel *rtp_parallel_new(struct rtp_context *ctx, const struct rtp_graph *fwd,
                                      struct rtp_tensor *loss,
                                      const struct rtp_parallel_params *pp) {
  if (!ctx || !fwd || !loss || !pp) {
    rtp__error(RTP_EINVAL, "rtp_parallel_new: NULL argument");
    return NULL;
  }
  int world = pp->comm ? rtp_comm_size(pp->comm) : 1;
  int M = pp->micro_batches > 1 ? pp->micro_batches : 1;
  enum rtp_strategy strategy = pp->strategy;
  if (pp->micro_batches < 0 || pp->accumulate < 0) {
    rtp__ctx_error(ctx, RTP_EINVAL,
                   "rtp_parallel_new: micro_batches %d, accumulate %d (0 or more each)",
                   pp->micro_batches, pp->accumulate);
    return NULL;
  }
  /* Stages of different sizes or strategies: this rank's stage's strategy and its share
   * of the step's units. */
  struct rtp_hetero *het = pp->stages ? rtp__hetero_new(ctx, pp) : NULL;
  if (pp->stages && !het) return NULL;
  if (het) {
    M = rtp__hetero_micro(het, het->s);
    strategy = world > 1 ? het->strat[het->s] : RTP_STRATEGY_NONE;
  }
  if ((strategy == RTP_STRATEGY_NONE && world > 1) || world > RTP_MAX_WORLD) {
    rtp__ctx_error(ctx, RTP_EINVAL, "rtp_parallel_new: strategy %s with %d ranks (max %d)",
                   rtp_strategy_name(strategy), world, RTP_MAX_WORLD);
    return NULL;
  }
  /* Only rtp's rotations move bf16: ddp's and tp's all-reduces sum on the wire, which the
   * transport does in f32 only, and fsdp gathers and reduce-scatters f32 (not yet bf16). */
  if (pp->comm_type != RTP_TYPE_F32 &&
      (pp->comm_type != RTP_TYPE_BF16 || (strategy != RTP_STRATEGY_RTP && !het))) {
    if (pp->comm_type != RTP_TYPE_BF16)
      rtp__ctx_error(ctx, RTP_EINVAL, "rtp_parallel_new: comm_type %s (%d): f32 or bf16 only",
                     rtp_type_name(pp->comm_type), (int)pp->comm_type);
    else
      rtp__ctx_error(ctx, RTP_EINVAL,
                     "rtp_parallel_new: strategy %s cannot send bf16 (comm_type bf16 is for "
                     "rtp only)",
                     rtp_strategy_name(strategy));
    return NULL;
  }
  if (check_compute_type(ctx, fwd, pp->compute_type)) return NULL;
  if (!het && pp->pipe_comm && rtp_comm_size(pp->pipe_comm) > 1 &&
      pp->strategy == RTP_STRATEGY_TP) {
    rtp__ctx_error(ctx, RTP_EINVAL,
                   "rtp_parallel_new: pipelines run rtp, fsdp or ddp inside their stages, "
                   "not tp");
    return NULL;
  }
  if (check_device_pipeline(ctx, pp, M)) return NULL;
  if (pp->optimizer_in_backward && check_in_backward(ctx, pp, strategy, M)) return NULL;
  struct rtp_parallel *p = rtp__ctx_alloc(ctx, sizeof(*p), "the parallel plan");
  struct rtp_tensor **map =
      rtp__ctx_alloc(ctx, sizeof(*map) * (map_rows(fwd) * (size_t)M + 1), "the parallel map");
  if (!p || !map) return NULL;
  memset(map, 0, sizeof(*map) * (map_rows(fwd) * (size_t)M + 1)); /* another stage's: NULL */
  *p = (struct rtp_parallel){
      .ctx = ctx,
      .comm = world > 1 ? pp->comm : NULL,
      .iface = strategy_of(strategy, world),
      .strategy = strategy,
      .comm_type = pp->comm_type,
      .compute_type = pp->compute_type,
      .bucket_bytes = pp->bucket_bytes ? pp->bucket_bytes : (size_t)4 << 20,
      .micro_batches = M,
      .accumulate = pp->accumulate > 1 ? pp->accumulate : 1,
      .phases = M,
      .src = fwd,
      .map = map,
      .maps = map,
      .loss = loss,
      .hook = {rot_backward},
      .in_backward = pp->optimizer_in_backward};
  if (rtp__parallel_index(p, loss) < 0) {
    rtp__ctx_error(ctx, RTP_EINVAL, "rtp_parallel_new: the loss is not a node of the graph");
    return NULL;
  }
  struct rtp_comm *pipe =
      het || (pp->pipe_comm && rtp_comm_size(pp->pipe_comm) > 1) ? pp->pipe_comm : NULL;
  int graph_size = pp->graph_size > 0 ? pp->graph_size : 16384 * M;
  int rc = world > 1 || pipe ? check_same_model(p, pipe, pp->schedule, het) : RTP_OK;
  /* One stage takes the pipeline's path where it needs its segments: for recomputation,
   * or for zeropp's units (its weights move once per unit of micro-batches). */
  bool units = pp->schedule == RTP_SCHEDULE_ZEROPP && pp->unit > 1;
  if (!rc && (pipe || pp->recompute || units)) {
    p->phases = 2 * M;
    rc = rtp__pipeline_build(p, pipe, het, pp->schedule, pp->unit, pp->recompute,
                             pp->stage_blocks, graph_size);
  } else if (!rc) {
    if (p->iface->prepare) rc = p->iface->prepare(p);
    for (int m = 0; m < M && !rc; m++) rc = micro_batch(p, m, graph_size);
    p->map = p->maps;
    if (!rc && p->iface->finish) rc = p->iface->finish(p);
    if (!rc) rc = global_loss(p);
  }
  if (!rc && p->in_backward) rc = add_optimizer(p);
  if (!rc) set_compute_type(p);
  if (rc) {
    if (!rtp_context_error(ctx, NULL)) rtp__ctx_error(ctx, rc, "%s", rtp_last_error());
    return NULL;
  }
  return p;
}
