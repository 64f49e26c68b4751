/* plan-model.h - one rank of a train-gpt job, built as train-gpt builds it (the reference
 * GPT for one device, then rtp_parallel_new, the training plan, the evaluation graph and
 * Adam), either for real or dry: in a dry build the rank's communicators have no peers
 * (rtp__comm_dry_new) and its tensor data is address space that is never touched, so the
 * memory report of a job of any size comes out exact, in milliseconds, on any machine.
 * rtp-plan builds every layout dry; tests/test-plan.cpp builds them for real too and checks
 * that both reports agree and that they predict the resident memory. */
#ifndef RTP_PLAN_MODEL_H
#define RTP_PLAN_MODEL_H

#include "gpt.h"
#include "rtp.h"

#ifdef __cplusplus
extern "C" {
#endif

/* train-gpt's model flags. */
struct plan_model {
  struct gpt_config cfg;
  int batch;         /* B sequences per data-parallel rank and step */
  int micro_batches; /* M, dividing B */
  int accumulate;    /* K computes per optimizer step (--grad-accum; 0 or 1: one) */
  bool recompute, bf16;
  bool adam_in_backward; /* rtp_parallel_params.optimizer_in_backward */
  enum rtp_schedule schedule;
};

/* Where a rank sits: `strategy` inside each of `stages` pipeline stages of ranks / stages
 * ranks (rank = stage x ranks per stage + rank in the stage, as rtp_comm_mesh_2d lays
 * them out). One rank, or one rank per stage: RTP_STRATEGY_NONE. */
struct plan_layout {
  enum rtp_strategy strategy;
  int ranks, stages;
};

struct plan_rank {
  struct rtp_context *meta, *ctx;
  struct rtp_backend *dry;               /* dry builds: the untouched data's backend */
  struct rtp_comm *dry_group, *dry_pipe; /* dry builds: the peerless communicators */
  struct gpt m;
  struct rtp_parallel *par;
  struct rtp_graph *train, *eval;
  struct rtp_graph *sync; /* accumulate > 1: the once-a-step reductions (ddp's), or NULL */
  struct rtp_optimizer *opt;
  int accumulate;
};

/* Checks the flags and the layout as train-gpt does; 0, or RTP_EINVAL with the reason in
 * why (a sentence). */
int plan_check(const struct plan_model *pm, const struct plan_layout *l, char *why, size_t n);
/* Builds rank `rank` of layout l. Real: group and pipe are its live stage and pipe groups
 * (either NULL where it has none). Dry (group and pipe ignored): nothing is allocated for
 * the data. 0, or a status with rtp_last_error naming what failed; free r either way. */
int plan_rank_build(struct plan_rank *r, const struct plan_model *pm,
                    const struct plan_layout *l, int rank, bool dry, struct rtp_comm *group,
                    struct rtp_comm *pipe);
void plan_rank_free(struct plan_rank *r);

/* Bytes this rank sends per step: its graph's transfers (ring collectives as the
 * transport runs them) once per compute, and the reductions left for once a step
 * (accumulate > 1); the optimizer's scalar all-reduce of the gradient norm aside. */
double plan_bytes_sent(const struct plan_rank *r);
/* Of those, the once-a-step reductions (0 without accumulate). */
double plan_sync_bytes(const struct plan_rank *r);

/* The resident memory a rank holds beyond its context's report and what the process held
 * before building: the one-device model's headers (the meta context, exact) and the
 * runtime's scratch (plan_runtime_bytes: it depends on the build's GEMM provider). */
size_t plan_runtime_bytes(void);
size_t plan_rss_overhead(const struct plan_rank *r);

#ifdef __cplusplus
}
#endif

#endif
