/*
 * rtp-stage-reshard.c - pipeline stages of different sizes and strategies (a tp stage of
 * 2 ranks feeding a ddp stage of 3): what crosses a boundary moves as the cross-mesh
 * resharding planner says (rtp-reshard.c, rtp-reshard-exec.c). docs/pipeline.md, "Stages
 * of different sizes and strategies".
 *
 * A step is U units, each one micro-batch of the one-device graph's batch. A data-parallel
 * stage of G ranks holds unit u on its rank u % G (as micro-batch u / G), a tp stage every
 * unit on every rank. Seen as one tensor of all U units stacked along a new dimension,
 * that is a layout on the stage's ranks: the unit dimension chunked in U / G groups of G
 * (rank i holds block i of each group: units i, i + G, ...), or replicated. One plan per
 * boundary tensor and direction moves that tensor from one stage's layout to the other's:
 * each unit is one of its slices, with the sender chosen among the unit's holders so that
 * no host's NIC carries much more than the others over the whole step, and its receivers
 * in chain order. Each unit's slice is then built by itself, when the schedule reaches its
 * micro-batch (rtp_reshard_build: point-to-point for one receiver, a chained broadcast
 * for several).
 *
 * Order: every rank appends its moves in the order of its micro-batches, which is the
 * order of their units on every stage (u = m G + g grows with m), and a stage's forward
 * only waits on earlier stages' forwards, its backward on later stages' backwards. So
 * between two ranks each direction's transfers are posted in the same order at both ends
 * (the transport pairs the k-th send with the k-th recv), and under gpipe the transfer of
 * the smallest unit not yet moved is always posted at both ends.
 */
#include "rtp-strategy.h"

#include <stdlib.h>
#include <string.h>

/* One boundary: node j's value from stage a to stage c, or (grad) its gradient from c
 * back to a; per unit, the one slice of the plan that carries it. */
struct rtp_move {
  int j, a, c;
  bool grad;
  struct rtp_reshard_slice *units;
  struct rtp_move *next;
};

static int stage_size(const struct rtp_hetero *h, int s) {
  return h->first[s + 1] - h->first[s];
}

bool rtp__hetero_whole(const struct rtp_hetero *h, int s) {
  return stage_size(h, s) == 1 || h->strat[s] == RTP_STRATEGY_TP;
}

int rtp__hetero_micro(const struct rtp_hetero *h, int s) {
  return rtp__hetero_whole(h, s) ? h->U : h->U / stage_size(h, s);
}

int rtp__hetero_unit(const struct rtp_hetero *h, int s, int g, int m) {
  return rtp__hetero_whole(h, s) ? m : m * stage_size(h, s) + g;
}

/* The spec's refusals: each is a function of the spec alone, so every rank refuses alike
 * and none waits on a rank that gave up. */
static int check_spec(struct rtp_context *ctx, const struct rtp_parallel_params *pp, int n) {
  int S = pp->stages, U = pp->micro_batches > 1 ? pp->micro_batches : 1, sum = 0;
  if (S < 2 || S > RTP_HETERO_MAX || !pp->stage_ranks || !pp->stage_strategies)
    return rtp__ctx_error(ctx, RTP_EINVAL,
                          "rtp_parallel_new: stages %d (2 to %d, with stage_ranks and "
                          "stage_strategies)",
                          S, RTP_HETERO_MAX);
  for (int s = 0; s < S; s++) {
    int G = pp->stage_ranks[s];
    enum rtp_strategy st = pp->stage_strategies[s];
    if (G < 1 || (unsigned)st >= RTP_STRATEGY_COUNT || (G > 1 && st == RTP_STRATEGY_NONE))
      return rtp__ctx_error(ctx, RTP_EINVAL,
                            "rtp_parallel_new: stage %d: %d ranks running %s (at least one "
                            "rank; rtp, fsdp, ddp or tp on more than one)",
                            s, G, rtp_strategy_name(st));
    if (G > 1 && st != RTP_STRATEGY_TP && U % G)
      return rtp__ctx_error(ctx, RTP_EINVAL,
                            "rtp_parallel_new: stage %d runs %s on %d ranks, which do not "
                            "share %d micro-batches (units) evenly: micro_batches must be a "
                            "multiple of each data-parallel stage's ranks",
                            s, rtp_strategy_name(st), G, U);
    if (pp->comm_type != RTP_TYPE_F32 && G > 1 && st != RTP_STRATEGY_RTP)
      return rtp__ctx_error(ctx, RTP_EINVAL,
                            "rtp_parallel_new: stage %d runs %s, which cannot send bf16 "
                            "(comm_type bf16 is for rtp only)",
                            s, rtp_strategy_name(st));
    sum += G;
  }
  if (sum != n)
    return rtp__ctx_error(ctx, RTP_EINVAL,
                          "rtp_parallel_new: the stages have %d ranks in all, the job "
                          "(pipe_comm) %d",
                          sum, n);
  if (pp->schedule != RTP_SCHEDULE_GPIPE || pp->recompute || pp->accumulate > 1)
    return rtp__ctx_error(ctx, RTP_ENOSYS,
                          "rtp_parallel_new: stages of different sizes or strategies run the "
                          "gpipe schedule without recompute or accumulate only (asked: %s%s%s)",
                          rtp_schedule_name(pp->schedule), pp->recompute ? ", recompute" : "",
                          pp->accumulate > 1 ? ", accumulate" : "");
  return RTP_OK;
}

struct rtp_hetero *rtp__hetero_new(struct rtp_context *ctx,
                                   const struct rtp_parallel_params *pp) {
  struct rtp_comm *job = pp->pipe_comm;
  if (!job) {
    rtp__ctx_error(ctx, RTP_EINVAL,
                   "rtp_parallel_new: stages of different sizes need pipe_comm (the job)");
    return NULL;
  }
  int n = rtp_comm_size(job), r = rtp_comm_rank(job);
  if (check_spec(ctx, pp, n)) return NULL;
  struct rtp_hetero *h = rtp__ctx_alloc(ctx, sizeof(*h), "the pipeline's stages");
  int *hosts = rtp__ctx_alloc(ctx, sizeof(int) * (size_t)n, "the pipeline's hosts");
  if (!h || !hosts) return NULL;
  *h = (struct rtp_hetero){
      .S = pp->stages, .U = pp->micro_batches > 1 ? pp->micro_batches : 1, .hosts = hosts};
  for (int s = 0; s < h->S; s++) {
    h->first[s + 1] = h->first[s] + pp->stage_ranks[s];
    h->strat[s] = pp->stage_strategies[s];
    if (r >= h->first[s] && r < h->first[s + 1]) h->s = s;
  }
  h->g = r - h->first[h->s];
  int G = stage_size(h, h->s);
  struct rtp_comm *c = pp->comm;
  if (G > 1 ? !c || rtp_comm_size(c) != G || rtp_comm_rank(c) != h->g
            : c && rtp_comm_size(c) != 1) {
    rtp__ctx_error(ctx, RTP_EINVAL,
                   "rtp_parallel_new: job rank %d is rank %d of stage %d's %d: comm must be "
                   "that stage group (rank %d of %d)",
                   r, h->g, h->s, G, c ? rtp_comm_rank(c) : -1, c ? rtp_comm_size(c) : 0);
    return NULL;
  }
  if (rtp_comm_hosts(job, hosts)) {
    rtp__ctx_error(ctx, RTP_EINVAL, "rtp_parallel_new: %s", rtp_last_error());
    return NULL;
  }
  return h;
}

/* Stage s's ranks as a 1-D mesh of job ranks on their hosts, and its layout of all units
 * stacked along dimension 1 (the unit's elements along dimension 0). */
static int stage_mesh(const struct rtp_hetero *h, struct rtp_comm *job, int s,
                      struct rtp_mesh *m, struct rtp_layout *l) {
  int G = stage_size(h, s), ranks[RTP_MESH_MAX_RANKS], hosts[RTP_MESH_MAX_RANKS];
  if (G > RTP_MESH_MAX_RANKS)
    return rtp__error(RTP_EINVAL, "pipeline: stage %d has %d ranks (at most %d)", s, G,
                      RTP_MESH_MAX_RANKS);
  for (int i = 0; i < G; i++) {
    ranks[i] = rtp_comm_world_rank(job, h->first[s] + i);
    hosts[i] = h->hosts[h->first[s] + i];
  }
  *l = rtp_layout_replicated();
  int rc = rtp_mesh_init_1d(m, G, ranks, hosts);
  return rc || rtp__hetero_whole(h, s) ? rc : rtp_layout_chunk(l, 1, 0, h->U / G);
}

/* Slice sl of a plan cut to unit u, in ctx memory: the sender is its only holder that
 * matters (the executor reads no other). */
static int unit_slice(struct rtp_context *ctx, const struct rtp_reshard_slice *sl, int u,
                      struct rtp_reshard_slice *out) {
  int *ranks = rtp__ctx_alloc(ctx, sizeof(int) * (size_t)(sl->n_receivers + 1), "moves");
  if (!ranks) return rtp_context_error(ctx, NULL);
  ranks[0] = sl->sender;
  memcpy(ranks + 1, sl->receivers, sizeof(int) * (size_t)sl->n_receivers);
  *out = *sl;
  out->first[1] = u;
  out->len[1] = 1;
  out->nbytes = sl->nbytes / (size_t)sl->len[1];
  out->holders = ranks;
  out->n_holders = 1;
  out->receivers = ranks + 1;
  out->round = sl->round >= 0 ? 0 : -1; /* the only slice of its own plan */
  return RTP_OK;
}

/* The plan of boundary (j, a, c, grad), made on first use. */
static struct rtp_move *move_of(struct rtp_parallel *p, struct rtp_pipe *pp, int j, int a,
                                int c, bool grad) {
  struct rtp_hetero *h = pp->het;
  for (struct rtp_move *mv = h->moves; mv; mv = mv->next)
    if (mv->j == j && mv->a == a && mv->c == c && mv->grad == grad) return mv;
  struct rtp_context *ctx = p->ctx;
  struct rtp_move *mv = rtp__ctx_alloc(ctx, sizeof(*mv), "moves");
  struct rtp_reshard_slice *units = rtp__ctx_alloc(ctx, sizeof(*units) * (size_t)h->U, "moves");
  if (!mv || !units) return NULL;
  memset(units, 0, sizeof(*units) * (size_t)h->U);
  int64_t n = rtp_tensor_nelements(p->src->nodes[j]);
  struct rtp_mesh mesh[2];
  struct rtp_layout lay[2];
  int from = grad ? c : a, to = grad ? a : c;
  int rc = stage_mesh(h, pp->comm, from, &mesh[0], &lay[0]);
  if (!rc) rc = stage_mesh(h, pp->comm, to, &mesh[1], &lay[1]);
  const int64_t ne[RTP_MAX_DIMS] = {n, h->U, 1, 1};
  struct rtp_reshard_params rp = rtp__reshard_params_pair(mesh, lay, ne, sizeof(float));
  struct rtp_reshard *plan = NULL;
  if (!rc) rc = rtp_reshard_plan(&rp, &plan);
  int covered = 0;
  for (int i = 0; !rc && i < plan->n_slices; i++) {
    const struct rtp_reshard_slice *sl = &plan->slices[i];
    /* the stages share no rank: every receiver gets its unit from a sender */
    if (sl->first[0] != 0 || sl->len[0] != n || sl->n_local != 0 || sl->sender < 0) break;
    for (int64_t u = sl->first[1]; u < sl->first[1] + sl->len[1] && !rc; u++, covered++)
      rc = unit_slice(ctx, sl, (int)u, &units[u]);
  }
  rtp_reshard_free(plan);
  if (!rc && covered != h->U)
    rc = rtp__error(RTP_EINVAL, "pipeline: the plan from stage %d to %d moves %d of %d units",
                    from, to, covered, h->U);
  if (rc) {
    if (!rtp_context_error(ctx, NULL)) rtp__ctx_error(ctx, rc, "%s", rtp_last_error());
    return NULL;
  }
  *mv = (struct rtp_move){j, a, c, grad, units, h->moves};
  h->moves = mv;
  return mv;
}

/* Chunks of at least a quarter of a unit: a chain still forwards one while the next
 * arrives, and a step's sends in flight stay within the communicator's request pool. */
static size_t chunk_of(const struct rtp_reshard_slice *sl) {
  size_t quarter = (sl->nbytes + 3) / 4;
  return quarter > RTP_RESHARD_CHUNK ? quarter : RTP_RESHARD_CHUNK;
}

/* This rank's unit of micro-batch m on stage s, and its slice of the move. */
static const struct rtp_reshard_slice *slice_of(struct rtp_parallel *p, struct rtp_pipe *pp,
                                                int j, int a, int c, bool grad, int m) {
  const struct rtp_move *mv = move_of(p, pp, j, a, c, grad);
  const struct rtp_hetero *h = pp->het;
  return mv ? &mv->units[rtp__hetero_unit(h, h->s, h->g, m)] : NULL;
}

static int my_rank(const struct rtp_pipe *pp) {
  return rtp_comm_world_rank(pp->comm, rtp_comm_rank(pp->comm));
}

/* rtp_reshard_build's nodes for this rank, listed in *rec (if not NULL). */
static int build(struct rtp_parallel *p, struct rtp_pipe *pp,
                 const struct rtp_reshard_slice *sl, struct rtp_tensor *src,
                 struct rtp_tensor *dst, struct rtp_nodes *rec) {
  struct rtp_reshard r = {
      .slices = (struct rtp_reshard_slice *)sl, .n_slices = 1, .n_rounds = sl->round >= 0};
  int n0 = p->graph->n_nodes;
  int rc = rtp_reshard_build(p->ctx, p->graph, pp->comm, &r, src, dst, chunk_of(sl));
  if (rc || !rec) return rc;
  rec->n = p->graph->n_nodes - n0;
  rec->v = rtp__ctx_alloc(p->ctx, sizeof(*rec->v) * (size_t)rec->n + 1, "moves");
  if (!rec->v) return rtp_context_error(p->ctx, NULL);
  memcpy(rec->v, p->graph->nodes + n0, sizeof(*rec->v) * (size_t)rec->n);
  return RTP_OK;
}

int rtp__hetero_forward_micro(const struct rtp_hetero *h) {
  int64_t L = 1;
  for (int s = 0; s < h->S; s++) {
    if (rtp__hetero_whole(h, s)) continue;
    int64_t G = stage_size(h, s), a = L, b = G;
    while (b) { /* a = gcd(L, G) */
      int64_t t = a % b;
      a = b;
      b = t;
    }
    L = L / a * G;
  }
  return rtp__hetero_whole(h, h->s) ? (int)L : (int)(L / stage_size(h, h->s));
}

int rtp__hetero_send(struct rtp_parallel *p, struct rtp_pipe *pp, int j, int a, int c,
                     bool grad, int m, struct rtp_tensor *x, struct rtp_nodes *rec) {
  const struct rtp_reshard_slice *sl = slice_of(p, pp, j, a, c, grad, m);
  if (!sl) return rtp_context_error(p->ctx, NULL);
  if (sl->sender != my_rank(pp)) return RTP_OK; /* another replica sends this unit */
  if (x && !rtp_tensor_is_contiguous(x)) x = rtp_cont(p->ctx, x);
  if (!x) return rtp_context_error(p->ctx, NULL);
  int64_t ne[4] = {rtp_tensor_nelements(x), 1, 1, 1};
  size_t row = sizeof(float) * (size_t)ne[0], nb[4] = {sizeof(float), row, row, row};
  struct rtp_tensor *flat = rtp_view(p->ctx, x, RTP_MAX_DIMS, ne, nb, 0);
  return flat ? build(p, pp, sl, flat, NULL, rec) : rtp_context_error(p->ctx, NULL);
}

struct rtp_tensor *rtp__hetero_recv(struct rtp_parallel *p, struct rtp_pipe *pp, int j, int a,
                                    int c, bool grad, int m, struct rtp_nodes *rec) {
  const struct rtp_tensor *t = p->src->nodes[j];
  const struct rtp_reshard_slice *sl = slice_of(p, pp, j, a, c, grad, m);
  if (!sl) return NULL;
  bool receives = false;
  for (int k = 0; k < sl->n_receivers; k++) receives |= sl->receivers[k] == my_rank(pp);
  if (!receives) {
    rtp__ctx_error(p->ctx, RTP_EINVAL, "pipeline: rank %d receives no unit %d of '%s'",
                   my_rank(pp), rtp__hetero_unit(pp->het, pp->het->s, pp->het->g, m), t->name);
    return NULL;
  }
  int64_t ne[4] = {rtp_tensor_nelements(t), 1, 1, 1};
  struct rtp_tensor *buf = rtp__new_node(p->ctx, RTP_OP_EMPTY, RTP_TYPE_F32, ne, NULL, NULL);
  if (!buf) return NULL;
  rtp_tensor_set_name(buf, "%s.%d.%.40s", grad ? "pipe.grad" : "pipe.in", m, t->name);
  if (build(p, pp, sl, NULL, buf, rec)) return NULL;
  size_t nb[4] = {rtp_type_size(t->type)};
  for (int d = 1; d < 4; d++) nb[d] = nb[d - 1] * (size_t)t->ne[d - 1];
  return rtp_view(p->ctx, buf, RTP_MAX_DIMS, t->ne, nb, 0);
}
