/*
 * rtp-pipeline.c - pipeline stages with a strategy inside each (ZeroPP's layout): the
 * model's blocks are cut into S stages; this rank builds only its stage's graph, for M
 * micro-batches in the order its schedule says, and runs the in-stage strategy (rtp, fsdp,
 * ddp) on its stage group. Activations and their gradients cross stages as send and recv
 * nodes on the pipe group (one rank per stage). docs/pipeline.md.
 *
 * Which stage a node belongs to follows the data: each node sits at the latest block
 * (rtp_tensor_set_fsdp_unit marks) that any of its sources depends on, so the embeddings,
 * which depend on no block, go with the first stage, and the head and the loss, which
 * depend on the last block, with the last. A stage's graph starts with a recv of every
 * tensor it reads from an earlier stage, marked so that autodiff keeps its gradient
 * (RTP__FLAG_GRAD_STOP), which a send returns to that stage; its backward starts from the
 * gradients the later stages send back (rtp__graph_build_backward_seeded).
 */
#include "rtp-strategy.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *rtp_schedule_name(enum rtp_schedule s) {
  static const char *const names[RTP_SCHEDULE_COUNT] = {"1f1b", "gpipe", "eager-1f1b",
                                                        "zeropp"};
  return (unsigned)s < RTP_SCHEDULE_COUNT ? names[s] : "?";
}

int rtp_schedule_parse(const char *name, enum rtp_schedule *out) {
  for (int s = 0; s < RTP_SCHEDULE_COUNT; s++)
    if (name && strcmp(name, rtp_schedule_name((enum rtp_schedule)s)) == 0) {
      *out = (enum rtp_schedule)s;
      return RTP_OK;
    }
  return rtp__error(RTP_EINVAL, "unknown schedule '%s' (1f1b, gpipe, eager-1f1b or zeropp)",
                    name ? name : "(null)");
}

/* ---- cutting the model into stages ---------------------------------------------- */

/* What a node costs, for balancing: a product's multiply-adds, else its elements. */
static double node_cost(const struct rtp_tensor *t) {
  if (t->op == RTP_OP_MUL_MAT)
    return 2.0 * (double)t->src[0]->ne[0] * (double)rtp_tensor_nelements(t);
  return rtp__is_view_op(t->op) ? 0.0 : (double)rtp_tensor_nelements(t);
}

/* The blocks in the order the forward first reads them: block b is unit units[b]. */
static int block_of_unit(const int *units, int n, int unit) {
  for (int b = 0; b < n; b++)
    if (units[b] == unit) return b;
  return -1;
}

/* pos[i]: the latest block node i depends on (-1: none); returns the number of blocks. */
static int node_positions(const struct rtp_graph *src, int *pos, int *units) {
  int K = 0;
  for (int i = 0; i < src->n_nodes; i++) {
    const struct rtp_tensor *t = src->nodes[i];
    int at = -1;
    for (int k = 0; k < RTP_MAX_SRC; k++) {
      const struct rtp_tensor *u = t->src[k];
      if (!u) continue;
      if (rtp__param_leaf(u) && u->op_params[2] > 0) {
        int b = block_of_unit(units, K, u->op_params[2]);
        if (b < 0) units[b = K++] = u->op_params[2];
        if (b > at) at = b;
      } else if (u->op != RTP_OP_NONE) {
        int j = rtp__graph_index(src, u);
        if (j >= 0 && pos[j] > at) at = pos[j];
      }
    }
    pos[i] = at;
  }
  /* A node that reads no parameter moves to its earliest reader's block (the norm of a
   * LayerNorm goes with the block whose weights scale it): less crosses between stages,
   * and a recomputed block recomputes it. Readers come after it, so one backward pass. */
  int *first = malloc(sizeof(int) * (size_t)src->n_nodes + 1);
  if (!first) return -1;
  for (int i = 0; i < src->n_nodes; i++) first[i] = INT_MAX;
  for (int i = src->n_nodes - 1; i >= 0; i--) {
    const struct rtp_tensor *t = src->nodes[i];
    bool reads_param = false;
    for (int k = 0; k < RTP_MAX_SRC; k++) reads_param |= rtp__param_leaf(t->src[k]);
    if (!reads_param && !(t->flags & (RTP_FLAG_OUTPUT | RTP_FLAG_LOSS)) &&
        first[i] != INT_MAX && first[i] > pos[i])
      pos[i] = first[i];
    for (int k = 0; k < RTP_MAX_SRC; k++) {
      int j = t->src[k] && t->src[k]->op != RTP_OP_NONE ? rtp__graph_index(src, t->src[k]) : -1;
      if (j >= 0 && pos[i] < first[j]) first[j] = pos[i];
    }
  }
  free(first);
  return K;
}

/* Stage of each block: contiguous runs of blocks, as the caller says (blocks[s] each) or
 * balanced: the largest stage's cost as small as it can be (the embeddings, cost `pre`,
 * count with the first stage). */
static int cut_stages(struct rtp_parallel *p, const double *cost, int K, double pre, int S,
                      const int *blocks, int *stage_of_block) {
  if (K == 0) return RTP_OK; /* one stage of no blocks: nothing to cut */
  if (blocks) {
    int b = 0;
    for (int s = 0; s < S; s++) {
      if (blocks[s] < 1 || b + blocks[s] > K)
        return rtp__ctx_error(p->ctx, RTP_EINVAL,
                              "pipeline: stage_blocks[%d] = %d: each of the %d stages needs at "
                              "least one block, %d in all",
                              s, blocks[s], S, K);
      for (int k = 0; k < blocks[s]; k++) stage_of_block[b++] = s;
    }
    if (b != K)
      return rtp__ctx_error(p->ctx, RTP_EINVAL,
                            "pipeline: stage_blocks add up to %d blocks, the model has %d", b,
                            K);
    return RTP_OK;
  }
  /* best[j][k]: the least largest cost of blocks [0, k) cut into j stages. */
  double *best = malloc(sizeof(double) * (size_t)(S + 1) * (size_t)(K + 1));
  int *from = malloc(sizeof(int) * (size_t)(S + 1) * (size_t)(K + 1));
  double *sum = malloc(sizeof(double) * (size_t)(K + 1));
  if (!best || !from || !sum) {
    free(best);
    free(from);
    free(sum);
    return rtp__ctx_error(p->ctx, RTP_ENOMEM, "pipeline: out of memory");
  }
  sum[0] = pre;
  for (int k = 0; k < K; k++) sum[k + 1] = sum[k] + cost[k];
#define AT(j, k) ((size_t)(j) * (size_t)(K + 1) + (size_t)(k))
  for (int j = 0; j <= S; j++)
    for (int k = 0; k <= K; k++) best[AT(j, k)] = 1e300;
  best[AT(0, 0)] = 0;
  for (int j = 1; j <= S; j++)
    for (int k = j; k <= K; k++)
      for (int i = j - 1; i < k; i++) {
        double c = best[AT(j - 1, i)], part = sum[k] - sum[i];
        double v = c > part ? c : part;
        if (v < best[AT(j, k)]) {
          best[AT(j, k)] = v;
          from[AT(j, k)] = i;
        }
      }
  for (int j = S, k = K; j > 0; j--) {
    int i = from[AT(j, k)];
    for (int b = i; b < k; b++) stage_of_block[b] = j - 1;
    k = i;
  }
#undef AT
  free(best);
  free(from);
  free(sum);
  return RTP_OK;
}

/* Each node's stage, each parameter's, and what crosses between stages. */
static int assign_stages(struct rtp_parallel *p, struct rtp_pipe *pp, const int *blocks) {
  const struct rtp_graph *src = p->src;
  int n = src->n_nodes, rc = RTP_OK;
  int *pos = calloc((size_t)n + 1, sizeof(int)), *units = calloc((size_t)n + 1, sizeof(int));
  double *cost = calloc((size_t)n + 1, sizeof(double)), pre = 0;
  int *stage_of_block = calloc((size_t)n + 1, sizeof(int));
  if (!pos || !units || !cost || !stage_of_block) {
    rc = rtp__ctx_error(p->ctx, RTP_ENOMEM, "pipeline: out of memory");
    goto done;
  }
  int K = node_positions(src, pos, units);
  if (K < 0) {
    rc = rtp__ctx_error(p->ctx, RTP_ENOMEM, "pipeline: out of memory");
    goto done;
  }
  if (K < pp->S && pp->S > 1) {
    rc = rtp__ctx_error(p->ctx, RTP_EINVAL,
                        "pipeline: %d stages but the model marks %d blocks "
                        "(rtp_tensor_set_fsdp_unit): at most one stage per block",
                        pp->S, K);
    goto done;
  }
  for (int i = 0; i < n; i++) {
    if (pos[i] < 0)
      pre += node_cost(src->nodes[i]);
    else
      cost[pos[i]] += node_cost(src->nodes[i]);
  }
  if ((rc = cut_stages(p, cost, K, pre, pp->S, blocks, stage_of_block))) goto done;
  pp->seg_lo = n;
  pp->seg_hi = -1;
  for (int i = 0; i < n; i++) {
    pp->node_stage[i] = pos[i] < 0 ? 0 : stage_of_block[pos[i]];
    pp->node_seg[i] = pos[i];
    if (pp->node_stage[i] == pp->s && pos[i] < pp->seg_lo) pp->seg_lo = pos[i];
    if (pp->node_stage[i] == pp->s && pos[i] > pp->seg_hi) pp->seg_hi = pos[i];
  }
  for (int l = 0; l < src->n_leafs; l++) pp->leaf_stage[l] = -1;
  for (int i = 0; i < n && !rc; i++) {
    const struct rtp_tensor *t = src->nodes[i];
    for (int k = 0; k < RTP_MAX_SRC && !rc; k++) {
      const struct rtp_tensor *u = t->src[k];
      int l = u && u->op == RTP_OP_NONE ? rtp__parallel_index(p, u) - n : -1;
      if (l < 0) continue;
      int *ls = &pp->leaf_stage[l];
      if (*ls >= 0 && *ls != pp->node_stage[i] && rtp__param_leaf(u))
        rc = rtp__ctx_error(p->ctx, RTP_EINVAL,
                            "pipeline: parameter '%s' is read on stages %d and %d (each "
                            "parameter must live on one stage: tied weights cannot be split)",
                            u->name, *ls, pp->node_stage[i]);
      if (*ls < 0 || pp->node_stage[i] == pp->s) *ls = pp->node_stage[i];
    }
  }
  int loss_stage = pp->node_stage[rtp__parallel_index(p, p->loss)];
  if (!rc && loss_stage != pp->S - 1)
    rc = rtp__ctx_error(p->ctx, RTP_EINVAL,
                        "pipeline: the loss is computed on stage %d of %d, not on the last",
                        loss_stage, pp->S);
done:
  free(pos);
  free(units);
  free(cost);
  free(stage_of_block);
  return rc;
}

/* The tensors that cross into and out of this rank's stage. A tensor crosses whole and
 * contiguous, so the views the next stage takes of it read it as they would here. */
static int find_boundaries(struct rtp_parallel *p, struct rtp_pipe *pp) {
  const struct rtp_graph *src = p->src;
  int n = src->n_nodes;
  uint64_t *to = calloc((size_t)n + 1, sizeof(uint64_t));
  bool *in = calloc((size_t)n + 1, sizeof(bool));
  if (!to || !in) {
    free(to);
    free(in);
    return rtp__ctx_error(p->ctx, RTP_ENOMEM, "pipeline: out of memory");
  }
  for (int i = 0; i < n; i++) {
    const struct rtp_tensor *t = src->nodes[i];
    for (int k = 0; k < RTP_MAX_SRC; k++) {
      int j = t->src[k] && t->src[k]->op != RTP_OP_NONE ? rtp__graph_index(src, t->src[k]) : -1;
      if (j < 0 || pp->node_stage[j] == pp->node_stage[i]) continue;
      to[j] |= (uint64_t)1 << pp->node_stage[i];
      if (pp->node_stage[i] == pp->s) in[j] = true;
    }
  }
  pp->in = rtp__ctx_alloc(p->ctx, sizeof(int) * (size_t)n + 1, "pipeline inputs");
  pp->out = rtp__ctx_alloc(p->ctx, sizeof(int) * (size_t)n + 1, "pipeline outputs");
  pp->out_to = rtp__ctx_alloc(p->ctx, sizeof(uint64_t) * (size_t)n + 1, "pipeline outputs");
  int rc = pp->in && pp->out && pp->out_to ? RTP_OK : rtp_context_error(p->ctx, NULL);
  for (int i = 0; i < n && !rc; i++) {
    const struct rtp_tensor *t = src->nodes[i];
    bool crosses = in[i] || (pp->node_stage[i] == pp->s && to[i]);
    if (crosses && (!rtp_tensor_is_contiguous(t) || t->type != RTP_TYPE_F32)) {
      char s[128];
      rtp__shape_str(t, s, sizeof(s));
      rc = rtp__ctx_error(p->ctx, RTP_EINVAL,
                          "pipeline: %s '%s' %s crosses from stage %d to a later one: tensors "
                          "that cross stages must be contiguous f32",
                          rtp_op_name(t->op), t->name, s, pp->node_stage[i]);
    }
    if (in[i]) pp->in[pp->n_in++] = i;
    if (pp->node_stage[i] == pp->s && to[i]) {
      pp->out_to[pp->n_out] = to[i];
      pp->out[pp->n_out++] = i;
    }
  }
  free(to);
  free(in);
  return rc;
}

/* ---- schedules --------------------------------------------------------------------- */

/* The order of this stage's work, in units of U micro-batches (1 but under ZeroPP):
 * acts[k] = u + 1 for unit u's forward, -(u + 1) for its backward. 1F1B keeps at most
 * S - s units in flight on stage s, eager 1F1B twice the warm-up forwards (so each send
 * overlaps the next forward), GPipe every unit. */
static int schedule(const struct rtp_pipe *pp, int *acts) {
  int n = pp->M / pp->U, k = 0;
  if (pp->schedule == RTP_SCHEDULE_GPIPE) {
    for (int u = 0; u < n; u++) acts[k++] = u + 1;
    for (int u = 0; u < n; u++) acts[k++] = -(u + 1);
    return k;
  }
  int warm = pp->S - pp->s - 1;
  if (pp->schedule == RTP_SCHEDULE_EAGER_1F1B) warm = 2 * (pp->S - pp->s - 1);
  if (warm > n) warm = n;
  for (int u = 0; u < warm; u++) acts[k++] = u + 1;
  for (int u = 0; u < n - warm; u++) {
    acts[k++] = warm + u + 1;
    acts[k++] = -(u + 1);
  }
  for (int u = n - warm; u < n; u++) acts[k++] = -(u + 1);
  return k;
}

/* Unit u's forward: each segment for every micro-batch of the unit before the next
 * segment, so a strategy that gathers a block does it once for them all. */
static int unit_forward(struct rtp_parallel *p, struct rtp_pipe *pp, int u) {
  int m0 = u * pp->U, m1 = m0 + pp->U, rc = RTP_OK;
  for (int m = m0; m < m1 && !rc; m++) rc = rtp__stage_forward_begin(p, pp, m);
  for (int q = pp->seg_lo; q <= pp->seg_hi && !rc; q++)
    rc = rtp__stage_forward_segment(p, pp, m0, m1, q);
  for (int m = m0; m < m1 && !rc; m++) rc = rtp__stage_forward_end(p, pp, m);
  return rc;
}

static int unit_backward(struct rtp_parallel *p, struct rtp_pipe *pp, int u) {
  int m0 = u * pp->U, m1 = m0 + pp->U, rc = RTP_OK;
  for (int m = m0; m < m1 && !rc; m++) rc = rtp__stage_backward_begin(p, pp, m);
  for (int q = pp->seg_hi; q >= pp->seg_lo && !rc; q--)
    rc = rtp__stage_backward_segment(p, pp, m0, m1, q);
  for (int m = m0; m < m1 && !rc; m++) rc = rtp__stage_backward_end(p, pp, m);
  return rc;
}

/* A stage other than the last adds zero to the job's loss. 0, or a status. */
static int loss_zero(struct rtp_context *ctx, struct rtp_tensor **mine) {
  struct rtp_tensor *zero = rtp_tensor_new_1d(ctx, RTP_TYPE_F32, 1);
  if (zero && !zero->data && !rtp__tensor_alloc(ctx, zero, RTP_ROLE_INPUT)) zero = NULL;
  if (zero && rtp_tensor_set_zero(zero))
    return rtp__ctx_error(ctx, RTP_EIO, "pipeline: %s", rtp_last_error());
  *mine = zero ? rtp_dup(ctx, zero) : NULL;
  return RTP_OK;
}

/* Every rank's loss: this rank's share summed over `comm` (NULL: its own). */
static int loss_global(struct rtp_parallel *p, struct rtp_comm *comm, struct rtp_tensor *mine) {
  struct rtp_context *ctx = p->ctx;
  struct rtp_tensor *all = mine && comm ? rtp_allreduce(ctx, comm, mine, NULL) : mine;
  p->global_loss = all ? rtp_tensor_set_name(rtp_scale(ctx, all, 1.0f), "loss.global") : NULL;
  if (!p->global_loss) return rtp_context_error(ctx, NULL);
  rtp_tensor_set_output(p->global_loss);
  return rtp_graph_build(p->graph, p->global_loss);
}

/* Every stage ends with the loss over the global batch: the last stage's mean over its
 * micro-batches and its group, summed over the pipe (the other stages add zero). */
static int pipe_loss(struct rtp_parallel *p, struct rtp_pipe *pp) {
  struct rtp_context *ctx = p->ctx;
  struct rtp_tensor *mine = NULL;
  if (pp->s == pp->S - 1) {
    struct rtp_tensor *sum = pp->losses[0];
    for (int m = 1; m < pp->M; m++) sum = rtp_add(ctx, sum, pp->losses[m]);
    if (p->comm) sum = rtp_allreduce(ctx, p->comm, rtp_dup(ctx, sum), NULL);
    int D = p->comm ? rtp_comm_size(p->comm) : 1;
    mine = rtp_scale(ctx, sum, 1.0f / (float)(D * pp->M));
  } else {
    int rc = loss_zero(ctx, &mine);
    if (rc) return rc;
  }
  return loss_global(p, pp->comm, mine);
}

/* Stages of different sizes: the last stage's sum over its micro-batches (over its group
 * too where the units are shared out), its first rank's share of the mean over the U
 * units, summed over the job (every other rank adds zero). */
static int hetero_loss(struct rtp_parallel *p, struct rtp_pipe *pp) {
  struct rtp_context *ctx = p->ctx;
  const struct rtp_hetero *h = pp->het;
  struct rtp_tensor *mine = NULL;
  if (pp->s == pp->S - 1) {
    struct rtp_tensor *sum = pp->losses[0];
    for (int m = 1; m < pp->M; m++) sum = rtp_add(ctx, sum, pp->losses[m]);
    if (!rtp__hetero_whole(h, pp->s))
      sum = rtp_allreduce(ctx, p->comm, rtp_dup(ctx, sum), NULL);
    mine = rtp_scale(ctx, sum, h->g == 0 ? 1.0f / (float)h->U : 0.0f);
  } else {
    int rc = loss_zero(ctx, &mine);
    if (rc) return rc;
  }
  return loss_global(p, pp->comm, mine);
}

int rtp__pipeline_build(struct rtp_parallel *p, struct rtp_comm *pipe, struct rtp_hetero *het,
                        enum rtp_schedule sched, int unit, bool recompute,
                        const int *stage_blocks, int graph_size) {
  struct rtp_context *ctx = p->ctx;
  const struct rtp_graph *src = p->src;
  struct rtp_pipe *pp = rtp__ctx_alloc(ctx, sizeof(*pp), "the pipeline");
  if (!pp) return rtp_context_error(ctx, NULL);
  int M = p->micro_batches, U = sched == RTP_SCHEDULE_ZEROPP && unit > 1 ? unit : 1;
  *pp = (struct rtp_pipe){.comm = pipe,
                          .het = het,
                          .S = het    ? het->S
                               : pipe ? rtp_comm_size(pipe)
                                      : 1,
                          .s = het    ? het->s
                               : pipe ? rtp_comm_rank(pipe)
                                      : 0,
                          .M = M,
                          .U = U,
                          .schedule = sched,
                          .recompute = recompute};
  p->pipe = pp;
  if ((unsigned)sched >= RTP_SCHEDULE_COUNT)
    return rtp__ctx_error(ctx, RTP_EINVAL, "pipeline: schedule %d", (int)sched);
  if (M % U)
    return rtp__ctx_error(ctx, RTP_EINVAL,
                          "pipeline: %d micro-batches do not make units of %d (zeropp's unit)",
                          M, U);
  if (pp->S > 64)
    return rtp__ctx_error(ctx, RTP_EINVAL, "pipeline: %d stages (at most 64)", pp->S);
  pp->node_stage = rtp__ctx_alloc(ctx, sizeof(int) * (size_t)src->n_nodes + 1, "stages");
  pp->node_seg = rtp__ctx_alloc(ctx, sizeof(int) * (size_t)src->n_nodes + 1, "segments");
  pp->leaf_stage = rtp__ctx_alloc(ctx, sizeof(int) * (size_t)src->n_leafs + 1, "stages");
  pp->losses = rtp__ctx_alloc(ctx, sizeof(*pp->losses) * (size_t)M, "micro-batch losses");
  if (!pp->node_stage || !pp->node_seg || !pp->leaf_stage || !pp->losses)
    return rtp_context_error(ctx, NULL);
  int rc = assign_stages(p, pp, stage_blocks);
  if (!rc) rc = find_boundaries(p, pp);
  if (rc) return rc;
  pp->in_recv = rtp__ctx_alloc(ctx, sizeof(*pp->in_recv) * (size_t)(M * pp->n_in) + 1,
                               "pipeline receives");
  pp->out_send = rtp__ctx_alloc(
      ctx, sizeof(*pp->out_send) * (size_t)(M * pp->n_out) * (size_t)pp->S + 1, "sends");
  pp->out_grad = rtp__ctx_alloc(ctx, sizeof(*pp->out_grad) * (size_t)(M * pp->n_out) + 1,
                                "pipeline gradients");
  pp->last_grad_send =
      rtp__ctx_alloc(ctx, sizeof(*pp->last_grad_send) * (size_t)pp->S, "pipeline gradients");
  if (pp->last_grad_send)
    memset(pp->last_grad_send, 0, sizeof(*pp->last_grad_send) * (size_t)pp->S);
  if (pp->out_send) /* het: the planner's moves leave them NULL */
    memset(pp->out_send, 0, sizeof(*pp->out_send) * (size_t)(M * pp->n_out) * (size_t)pp->S);
  if (het) {
    size_t n_in = (size_t)(M * pp->n_in) + 1, n_out = (size_t)(M * pp->n_out * pp->S) + 1;
    pp->in_nodes = rtp__ctx_alloc(ctx, sizeof(*pp->in_nodes) * n_in, "pipeline receives");
    pp->out_nodes = rtp__ctx_alloc(ctx, sizeof(*pp->out_nodes) * n_out, "pipeline sends");
    if (!pp->in_nodes || !pp->out_nodes) return rtp_context_error(ctx, NULL);
    memset(pp->in_nodes, 0, sizeof(*pp->in_nodes) * n_in);
    memset(pp->out_nodes, 0, sizeof(*pp->out_nodes) * n_out);
  }
  int *acts = malloc(sizeof(int) * 2 * (size_t)M);
  if (!pp->in_recv || !pp->out_send || !pp->out_grad || !pp->last_grad_send || !acts) {
    free(acts);
    return rtp__ctx_error(ctx, RTP_ENOMEM, "pipeline: out of memory");
  }
  p->leaf_here = pp->leaf_stage;
  p->here = pp->s;
  if (p->iface->prepare) rc = p->iface->prepare(p);
  if (!rc && !(p->graph = rtp_graph_new(ctx, graph_size))) rc = rtp_context_error(ctx, NULL);
  if (!rc && p->accumulate > 1) rtp__graph_set_accumulate(p->graph);
  if (!rc && p->in_backward) rtp__graph_set_planned_grads(p->graph);
  int n = schedule(pp, acts);
  for (int k = 0; k < n && !rc; k++) {
    if (p->iface->micro) p->iface->micro(p, k);
    rc = acts[k] > 0 ? unit_forward(p, pp, acts[k] - 1) : unit_backward(p, pp, -acts[k] - 1);
  }
  free(acts);
  free(pp->xs);
  pp->xs = NULL;
  p->map = p->maps;
  if (!rc && p->iface->finish) rc = p->iface->finish(p);
  if (!rc) rc = het ? hetero_loss(p, pp) : pipe_loss(p, pp);
  return rc;
}

/* Every transfer of the first unit between stages up to node i's is kept, needed by node
 * i or not: each send in one stage's graph then meets its recv in the other's, however a
 * stage orders a unit's micro-batches (under zeropp, micro-batch 0's forward may wait on
 * micro-batch 1's recv). */
static int build_nodes(struct rtp_graph *g, const struct rtp_nodes *l) {
  int rc = RTP_OK;
  for (int k = 0; k < l->n && !rc; k++) rc = rtp_graph_build(g, l->v[k]);
  return rc;
}

/* Stages of different sizes: micro-batch 0 is another unit on each stage, so the forward
 * graph runs the fewest units that every stage can run alone (rtp__hetero_forward_micro),
 * with every move between stages up to node i's. */
static int hetero_forward(const struct rtp_parallel *p, int i, struct rtp_graph *g) {
  const struct rtp_pipe *pp = p->pipe;
  int at = pp->node_stage[i], rc = RTP_OK, n = rtp__hetero_forward_micro(pp->het);
  size_t rows = (size_t)(p->src->n_nodes + p->src->n_leafs);
  for (int m = 0; m < n && !rc; m++) {
    for (int k = 0; k < pp->n_in && !rc; k++)
      rc = build_nodes(g, &pp->in_nodes[(size_t)m * (size_t)pp->n_in + (size_t)k]);
    for (int k = 0; k < pp->n_out && pp->s < at && !rc; k++) {
      /* on a replica that sends nothing too (a tp stage's others compute with it) */
      rc = rtp_graph_build(g, p->maps[(size_t)m * rows + (size_t)pp->out[k]]);
      for (int c = pp->s + 1; c <= at && !rc; c++)
        if (pp->out_to[k] >> c & 1)
          rc = build_nodes(
              g, &pp->out_nodes[((size_t)m * (size_t)pp->n_out + (size_t)k) * (size_t)pp->S +
                                (size_t)c]);
    }
  }
  return rc || pp->s < at ? rc : rtp_graph_build(g, p->maps[i]);
}

int rtp__pipeline_forward(const struct rtp_parallel *p, int i, struct rtp_graph *g) {
  const struct rtp_pipe *pp = p->pipe;
  int at = pp->node_stage[i], rc = RTP_OK;
  if (pp->s > at) return RTP_OK;
  if (pp->het) return hetero_forward(p, i, g);
  for (int m = 0; m < pp->U && !rc; m++) {
    for (int k = 0; k < pp->n_in && !rc; k++)
      rc = rtp_graph_build(g, pp->in_recv[(size_t)m * (size_t)pp->n_in + (size_t)k]);
    for (int k = 0; k < pp->n_out && pp->s < at; k++)
      for (int c = pp->s + 1; c <= at && !rc; c++)
        if (pp->out_to[k] >> c & 1)
          rc = rtp_graph_build(
              g, pp->out_send[((size_t)m * (size_t)pp->n_out + (size_t)k) * (size_t)pp->S +
                              (size_t)c]);
  }
  return rc || pp->s < at ? rc : rtp_graph_build(g, p->maps[i]);
}

int rtp_parallel_micro_batches(const struct rtp_parallel *p) {
  return p ? p->micro_batches : 0;
}

int rtp_parallel_micro_unit(const struct rtp_parallel *p, int m) {
  if (!p || m < 0 || m >= p->micro_batches)
    return rtp__error(RTP_EINVAL, "rtp_parallel_micro_unit: micro-batch %d of %d", m,
                      p ? p->micro_batches : 0),
           -1;
  if (p->pipe && p->pipe->het)
    return rtp__hetero_unit(p->pipe->het, p->pipe->s, p->pipe->het->g, m);
  int d = p->comm && !p->iface->whole_batch ? rtp_comm_rank(p->comm) : 0;
  return d * p->micro_batches + m;
}

int rtp_parallel_stage(const struct rtp_parallel *p) {
  return p && p->pipe ? p->pipe->s : 0;
}

int rtp_parallel_stages(const struct rtp_parallel *p) {
  return p && p->pipe ? p->pipe->S : 1;
}

int rtp_parallel_tensor_stage(const struct rtp_parallel *p, const struct rtp_tensor *t) {
  int i = p && t ? rtp__parallel_index(p, t) : -1;
  if (i < 0) return -1;
  if (!p->pipe) return 0;
  int n = p->src->n_nodes;
  return i < n ? p->pipe->node_stage[i] : p->pipe->leaf_stage[i - n];
}

struct rtp_comm *rtp__pipeline_comm(const struct rtp_parallel *p) {
  return p && p->pipe ? p->pipe->comm : NULL;
}
