/* rtp-opt.h - the optimizer's state, shared by the step after the compute (rtp-opt.c) and
 * the step inside it (rtp-opt-fused.c). Private to the library. */
#ifndef RTP_OPT_H
#define RTP_OPT_H

#include "rtp-backend.h"

struct rtp_optimizer {
  struct rtp_adamw_params hp;
  int64_t t; /* steps taken */
  int n;
  struct rtp_tensor **params, **m, **v;
  float lr_t, bc1, bc2; /* this step's factors, set before the threads run */
  float gscale;         /* clipping factor for this step's gradients */
  float norm;           /* the last global gradient norm */
  /* Where each rank holds a different share of the gradients: the groups whose shares
   * make the whole (a stage's ranks, then the pipe's stages). */
  struct rtp_comm *comm[2];
  bool pipe_quiet; /* this rank adds nothing over comm[1]: its group's first rank does */
  float *norm_w;   /* per parameter: its share of the global norm (1/N if replicated) */
  struct rtp_backend *backend; /* NULL: the CPU */
  double partial[RTP_MAX_THREADS];
  /* In backward (rtp-opt-fused.c): the graph's ADAMW nodes update the parameters during
   * the compute with the factors of step t + 1, each leaving its gradient's sum of
   * squares in sumsq (NaN where it was not finite and the update was skipped). */
  bool in_backward;
  double *sumsq;
};

/* Every parameter of g that has a gradient, with zeroed Adam states from the arena. */
struct rtp_optimizer *rtp__optimizer_alloc(struct rtp_context *ctx, struct rtp_graph *g,
                                           struct rtp_adamw_params hp, const char *what);
/* The factors of step t + 1 (PyTorch's bias corrections); RTP_EINVAL where the rate
 * over the correction is not a float. */
int rtp__optimizer_factors(struct rtp_optimizer *opt, const char *what);
/* Parameter k's update, wherever its data lives, from gradient g. */
struct rtp_adam_args rtp__optimizer_args(const struct rtp_optimizer *opt, int k, float *g);
/* The global norm from this rank's weighted sum of squares s: the other ranks' shares
 * added over the optimizer's groups. */
int rtp__optimizer_norm(struct rtp_optimizer *opt, double s);

/* Checks and sets hp (and the next step's factors); RTP_EINVAL if out of range. */
int rtp__optimizer_set_params(struct rtp_optimizer *opt, struct rtp_adamw_params hp);
/* In backward: after the compute that ran the ADAMW nodes, the step's norm and count, or
 * the refusal of a gradient that was not finite. */
int rtp__optimizer_close_step(struct rtp_optimizer *opt);

#endif
