/* plan-model.c - one rank of a train-gpt job, real or dry (plan-model.h). The sizes and
 * parameters below are train-gpt's (examples/train-gpt/train-gpt.c:
 * parallel_graph_size, arena_size, parallel_params, parallelize, build_graphs), so that a
 * dry build reports what train-gpt's context holds; keep them in step. */
#include "plan-model.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "rtp-backend.h"
#include "rtp-comm.h"
#include "rtp-impl.h"
#include "rtp-strategy.h"

static int64_t parallel_graph_size(const struct plan_model *pm, int world) {
  return (int64_t)gpt_graph_size(pm->cfg) * (1 + world) * pm->micro_batches *
         (pm->recompute ? 2 : 1);
}

/* train-gpt's arena: the model's data and activations, then 1 KiB per graph node. */
static double arena_bytes(const struct plan_model *pm, int world) {
  return (double)gpt_arena_size(pm->cfg, pm->batch) +
         (double)parallel_graph_size(pm, world) * 1024 + (1u << 20) +
         (pm->bf16 ? gpt_bf16_scratch_size(pm->cfg, pm->batch) : 0);
}

static int unit_size(const struct plan_model *pm, int stages) {
  int u = stages < pm->micro_batches ? stages : pm->micro_batches;
  while (pm->micro_batches % u) u--;
  return u;
}

int plan_check(const struct plan_model *pm, const struct plan_layout *l, char *why, size_t n) {
  struct gpt_config c = pm->cfg;
  const char *s = rtp_strategy_name(l->strategy);
  if (gpt_config_check(c)) {
    snprintf(why, n, "the model: %s", rtp_last_error());
  } else if (pm->batch < 1 || pm->micro_batches < 1 || pm->batch % pm->micro_batches) {
    snprintf(why, n, "--batch %d does not split into --micro-batches %d", pm->batch,
             pm->micro_batches);
  } else if (l->ranks < 1 || l->stages < 1 || l->ranks % l->stages) {
    snprintf(why, n, "%d ranks do not split into %d stages", l->ranks, l->stages);
  } else if (l->stages > c.n_layer) {
    snprintf(why, n, "%d stages for %d blocks: at most one stage per block", l->stages,
             c.n_layer);
  } else if ((l->strategy == RTP_STRATEGY_NONE) != (l->ranks == l->stages)) {
    snprintf(why, n, "%s with %d ranks per stage", s, l->ranks / l->stages);
  } else if (c.tie_embeddings && l->stages > 1) {
    snprintf(why, n, "tied embeddings do not run in pipeline stages");
  } else if (l->strategy == RTP_STRATEGY_TP && l->stages > 1) {
    snprintf(why, n, "tp does not run inside pipeline stages");
  } else if (l->strategy == RTP_STRATEGY_TP && c.n_head % l->ranks) {
    snprintf(why, n, "tp: %d heads do not split between %d ranks", c.n_head, l->ranks);
  } else if (parallel_graph_size(pm, l->ranks) > INT32_MAX ||
             arena_bytes(pm, l->ranks) >= 0x1p63) {
    snprintf(why, n, "more graph nodes or bytes than train-gpt counts");
  } else {
    return RTP_OK;
  }
  return RTP_EINVAL;
}

/* ---- the dry backend: data that has addresses but no memory --------------------------- */

struct dry_mem {
  size_t size;
};

static int dry_refuse(const char *what) {
  return rtp__error(RTP_ENOSYS, "a dry build (planning) cannot %s", what);
}

static void dry_free(struct rtp_backend *b) {
  free(b->impl);
  free(b);
}

/* Address space only (PROT_NONE): a stray read or write faults instead of costing memory. */
static int dry_alloc(struct rtp_backend *b, size_t size, void **out) {
  void *p = mmap(NULL, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED)
    return rtp__error(RTP_ENOMEM, "planning: cannot reserve %zu bytes of address space", size);
  ((struct dry_mem *)b->impl)->size = size;
  *out = p;
  return RTP_OK;
}

static void dry_release(struct rtp_backend *b, void *p) {
  munmap(p, ((struct dry_mem *)b->impl)->size);
}

/* Constants written while building (backward's seed gradient) are never read. */
static int dry_set(struct rtp_backend *b, void *dst, const void *src, size_t n) {
  (void)b, (void)dst, (void)src, (void)n;
  return RTP_OK;
}

static int dry_get(struct rtp_backend *b, void *dst, const void *src, size_t n) {
  (void)b, (void)dst, (void)src, (void)n;
  return dry_refuse("read tensor data");
}

/* What is zeroed is never read. */
static int dry_zero(struct rtp_backend *b, void *dst, size_t n) {
  (void)b, (void)dst, (void)n;
  return RTP_OK;
}

/* The CPU's scratch, so that the report is the CPU run's. */
static size_t dry_work_size(struct rtp_backend *b, const struct rtp_tensor *t) {
  (void)b;
  return rtp__op_work_size(t);
}

static int dry_events(struct rtp_backend *b, int n) {
  (void)b, (void)n;
  return RTP_OK;
}

static int dry_compute(struct rtp_backend *b, struct rtp_tensor *t, void *work) {
  (void)b, (void)t, (void)work;
  return dry_refuse("compute");
}

static const struct rtp_backend_i dry_i = {.name = "dry",
                                           .free = dry_free,
                                           .alloc = dry_alloc,
                                           .release = dry_release,
                                           .set = dry_set,
                                           .get = dry_get,
                                           .zero = dry_zero,
                                           .work_size = dry_work_size,
                                           .events_reserve = dry_events,
                                           .compute = dry_compute};

static struct rtp_backend *dry_backend_new(void) {
  struct rtp_backend *b = calloc(1, sizeof(*b));
  struct dry_mem *m = calloc(1, sizeof(*m));
  if (!b || !m) {
    free(b);
    free(m);
    return NULL;
  }
  b->i = &dry_i;
  b->impl = m;
  return b;
}

/* ---- building a rank ------------------------------------------------------------------ */

/* The dry rank's peerless stage and pipe groups, where the layout has them. */
static int dry_comms(struct plan_rank *r, const struct plan_layout *l, int rank) {
  int per_stage = l->ranks / l->stages;
  int rc = per_stage > 1 ? rtp__comm_dry_new(per_stage, rank % per_stage, &r->dry_group) : 0;
  if (!rc && l->stages > 1) rc = rtp__comm_dry_new(l->stages, rank / per_stage, &r->dry_pipe);
  return rc;
}

static int contexts_new(struct plan_rank *r, const struct plan_model *pm, int world, bool dry) {
  size_t meta_bytes = (size_t)gpt_graph_size(pm->cfg) * 2048 + (8u << 20);
  r->meta = rtp_context_new((struct rtp_init_params){.mem_size = meta_bytes, .no_alloc = true});
  struct rtp_init_params ip = {.mem_size = (size_t)arena_bytes(pm, world)};
  if (dry) { /* the host arena keeps headers, graphs and plans; the data goes to `dry` */
    ip.mem_size = (size_t)parallel_graph_size(pm, world) * 1024 + (8u << 20);
    ip.backend = r->dry = dry_backend_new();
    ip.data_size = (size_t)arena_bytes(pm, world);
    if (!r->dry) return rtp__error(RTP_ENOMEM, "planning: out of memory");
  }
  r->ctx = r->meta ? rtp_context_new(ip) : NULL;
  return r->ctx ? RTP_OK : RTP_ENOMEM;
}

static struct rtp_parallel_params parallel_params(const struct plan_model *pm,
                                                  const struct plan_layout *l,
                                                  struct rtp_comm *group,
                                                  struct rtp_comm *pipe) {
  bool bf16_rotation = pm->bf16 && l->strategy == RTP_STRATEGY_RTP;
  return (struct rtp_parallel_params){.strategy = group ? l->strategy : RTP_STRATEGY_NONE,
                                      .comm = group,
                                      .graph_size = (int)parallel_graph_size(pm, l->ranks),
                                      .comm_type = bf16_rotation ? RTP_TYPE_BF16 : RTP_TYPE_F32,
                                      .compute_type = pm->bf16 ? RTP_TYPE_BF16 : RTP_TYPE_F32,
                                      .micro_batches = pm->micro_batches,
                                      .accumulate = pm->accumulate,
                                      .pipe_comm = pipe,
                                      .schedule = pm->schedule,
                                      .unit = unit_size(pm, l->stages),
                                      .recompute = pm->recompute,
                                      .optimizer_in_backward = pm->adam_in_backward};
}

int plan_rank_build(struct plan_rank *r, const struct plan_model *pm,
                    const struct plan_layout *l, int rank, bool dry, struct rtp_comm *group,
                    struct rtp_comm *pipe) {
  memset(r, 0, sizeof(*r));
  char why[256];
  if (plan_check(pm, l, why, sizeof(why))) return rtp__error(RTP_EINVAL, "%s", why);
  int rc = dry ? dry_comms(r, l, rank) : RTP_OK;
  if (dry) group = r->dry_group, pipe = r->dry_pipe;
  if (!rc) rc = contexts_new(r, pm, l->ranks, dry);
  if (rc) return rc;
  struct rtp_graph *fwd = rtp_graph_new(r->meta, gpt_graph_size(pm->cfg));
  if (!fwd || gpt_build(r->meta, &r->m, pm->cfg, pm->batch / pm->micro_batches) ||
      rtp_graph_build(fwd, r->m.loss))
    return rtp__error(RTP_EINVAL, "building the model: %s", rtp_last_error());
  struct rtp_parallel_params pp = parallel_params(pm, l, group, pipe);
  r->par = rtp_parallel_new(r->ctx, fwd, r->m.loss, &pp);
  if (!r->par) return rtp_context_error(r->ctx, NULL);
  r->train = rtp_parallel_graph(r->par);
  if ((rc = rtp_graph_plan(r->ctx, r->train))) return rc;
  /* train-gpt's first rtp_parallel_sync plans it, after the training graph */
  r->accumulate = pm->accumulate > 1 ? pm->accumulate : 1;
  r->sync = r->par->sync;
  if (r->sync && (rc = rtp_graph_plan(r->ctx, r->sync))) return rc;
  r->eval = rtp_parallel_forward_graph(r->par, r->m.logits);
  if (!r->eval) return RTP_EINVAL;
  if ((rc = rtp_graph_plan(r->ctx, r->eval))) return rc;
  r->opt = rtp_parallel_optimizer(r->par, rtp_adamw_params_default());
  return r->opt ? RTP_OK : RTP_ENOMEM;
}

void plan_rank_free(struct plan_rank *r) {
  rtp_context_free(r->ctx);
  rtp_context_free(r->meta);
  rtp_backend_free(r->dry); /* after the context that used it */
  rtp_comm_free(r->dry_group);
  rtp_comm_free(r->dry_pipe);
  memset(r, 0, sizeof(*r));
}

static double graph_bytes_sent(const struct rtp_graph *g) {
  double b = 0;
  for (int i = 0; g && i < g->n_nodes; i++)
    if (g->nodes[i]->op == RTP_OP_COMM) b += rtp__comm_node_bytes(g->nodes[i]);
  return b;
}

double plan_bytes_sent(const struct plan_rank *r) {
  return r->accumulate * graph_bytes_sent(r->train) + graph_bytes_sent(r->sync);
}

double plan_sync_bytes(const struct plan_rank *r) {
  return graph_bytes_sent(r->sync);
}

/* Measured by tests/test-plan.cpp (x86-64): the peak over two training steps exceeded the
 * process's resident memory before building plus the report plus the meta context by 1.4
 * to 2.6 MiB with OpenBLAS 0.3.21, the same for every strategy and a pipeline, on 1, 2 or
 * 4 threads: OpenBLAS's packing buffers (0.4 to 1 MiB for one product of d 256 to 1024,
 * measured alone), the executor's and the planner's scratch. With oneDNN 2.6.3 it is 6
 * MiB more (7.6 to 8.3 MiB): the pages of libdnnl's code a step runs, its primitives
 * (1.1 MiB) and its GEMM's packing buffers, allocated per call. */
size_t plan_runtime_bytes(void) {
  return (size_t)(strcmp(rtp__gemm_provider(), "onednn") ? 2 : 8) << 20;
}

size_t plan_rss_overhead(const struct plan_rank *r) {
  return rtp_context_used_mem(r->meta) + plan_runtime_bytes();
}
