/* rtp-opt.c - Adam and AdamW over the parameters of a graph. Each rank updates only the
 * parameters it holds, so the optimizer needs no communication. */
#include "rtp-opt.h"

#include <inttypes.h>
#include <math.h>

struct rtp_adamw_params rtp_adamw_params_default(void) {
  return (struct rtp_adamw_params){3e-4f, 0.9f, 0.95f, 1e-8f, 0.0f, 0.0f};
}

static bool params_valid(struct rtp_adamw_params hp) {
  return hp.lr >= 0 && hp.beta1 >= 0 && hp.beta1 < 1 && hp.beta2 >= 0 && hp.beta2 < 1 &&
         hp.eps > 0 && hp.weight_decay >= 0 && hp.clip_norm >= 0 && isfinite(hp.lr) &&
         isfinite(hp.eps) && isfinite(hp.weight_decay) && isfinite(hp.clip_norm);
}

struct rtp_optimizer *rtp_optimizer_new(struct rtp_context *ctx, struct rtp_graph *g,
                                        struct rtp_adamw_params hp) {
  if (!ctx || !g) {
    rtp__error(RTP_EINVAL, "rtp_optimizer_new: NULL argument");
    return NULL;
  }
  return rtp__optimizer_alloc(ctx, g, hp, "rtp_optimizer_new");
}

struct rtp_optimizer *rtp__optimizer_alloc(struct rtp_context *ctx, struct rtp_graph *g,
                                           struct rtp_adamw_params hp, const char *what) {
  if (!params_valid(hp)) {
    rtp__ctx_error(ctx, RTP_EINVAL,
                   "%s: need finite lr >= 0, 0 <= betas < 1, eps > 0, weight_decay >= 0, "
                   "clip_norm >= 0",
                   what);
    return NULL;
  }
  int n = 0;
  for (int i = 0; i < g->n_leafs; i++)
    if ((g->leafs[i]->flags & RTP_FLAG_PARAM) && g->leafs[i]->grad) n++;
  struct rtp_optimizer *opt =
      rtp__ctx_alloc(ctx,
                     sizeof(*opt) + (size_t)n * sizeof(double) +
                         3 * (size_t)n * sizeof(void *) + (size_t)n * sizeof(float),
                     "the optimizer");
  if (!opt) return NULL;
  *opt = (struct rtp_optimizer){
      .hp = hp, .n = n, .gscale = 1.0f, .backend = rtp__ctx_backend(ctx)};
  opt->sumsq = (double *)(opt + 1);
  opt->params = (struct rtp_tensor **)(opt->sumsq + n);
  opt->m = opt->params + n;
  opt->v = opt->m + n;
  opt->norm_w = (float *)(opt->v + n);
  for (int i = 0, k = 0; i < g->n_leafs; i++) {
    struct rtp_tensor *p = g->leafs[i];
    if (!(p->flags & RTP_FLAG_PARAM) || !p->grad) continue;
    if (!rtp_tensor_is_contiguous(p) || !p->data || p->type != RTP_TYPE_F32) {
      rtp__ctx_error(ctx, RTP_EINVAL, "%s: parameter '%s' must be contiguous f32 with data",
                     what, p->name);
      return NULL;
    }
    if (rtp__tensor_backend(p) != opt->backend) {
      rtp__ctx_error(ctx, RTP_EINVAL,
                     "%s: parameter '%s' is in %s memory, the optimizer's states would be "
                     "in %s memory",
                     what, p->name, rtp_backend_name(rtp__tensor_backend(p)),
                     rtp_backend_name(opt->backend));
      return NULL;
    }
    opt->params[k] = p;
    opt->norm_w[k] = 1.0f;
    opt->m[k] = rtp_tensor_new(ctx, RTP_TYPE_F32, RTP_MAX_DIMS, p->ne);
    opt->v[k] = rtp_tensor_new(ctx, RTP_TYPE_F32, RTP_MAX_DIMS, p->ne);
    if (!opt->m[k] || !opt->v[k]) return NULL;
    for (int j = 0; j < 2; j++) {
      struct rtp_tensor *s = j ? opt->v[k] : opt->m[k];
      if (!s->data && !rtp__tensor_alloc(ctx, s, RTP_ROLE_OPTIM)) return NULL;
      s->role = RTP_ROLE_OPTIM;
      rtp_tensor_set_name(s, "adam.%c.%.56s", j ? 'v' : 'm', p->name);
    }
    k++;
  }
  return opt;
}

/* The factor decoupled weight decay multiplies parameter k's weights by this step. */
static float param_decay(const struct rtp_optimizer *opt, int k) {
  if (opt->params[k]->flags & RTP_FLAG_NO_DECAY) return 1.0f;
  return 1.0f - opt->hp.lr * opt->hp.weight_decay;
}

struct rtp_adam_args rtp__optimizer_args(const struct rtp_optimizer *opt, int k, float *g) {
  return (struct rtp_adam_args){.w = opt->params[k]->data,
                                .m = opt->m[k]->data,
                                .v = opt->v[k]->data,
                                .g = g,
                                .n = rtp_tensor_nelements(opt->params[k]),
                                .gscale = opt->gscale,
                                .beta1 = opt->hp.beta1,
                                .beta2 = opt->hp.beta2,
                                .eps = opt->hp.eps,
                                .decay = param_decay(opt, k),
                                .lr_t = opt->lr_t,
                                .bc2 = opt->bc2};
}

void rtp__adam_update(const struct rtp_adam_args *a, int64_t i0, int64_t i1) {
  for (int64_t i = i0; i < i1; i++) {
    float gi = a->g[i] * a->gscale;
    a->m[i] = a->beta1 * a->m[i] + (1.0f - a->beta1) * gi;
    a->v[i] = a->beta2 * a->v[i] + (1.0f - a->beta2) * gi * gi;
    float denom = sqrtf(a->v[i]) / a->bc2 + a->eps;
    a->w[i] = a->w[i] * a->decay - a->lr_t * a->m[i] / denom;
  }
}

/* Each thread takes the same share of every parameter, so the split stays balanced. */
static void adam_job(const struct rtp_compute_params *p, void *arg) {
  const struct rtp_optimizer *opt = arg;
  for (int k = 0; k < opt->n; k++) {
    struct rtp_adam_args a = rtp__optimizer_args(opt, k, opt->params[k]->grad->data);
    rtp__adam_update(&a, a.n * p->ith / p->nth, a.n * (p->ith + 1) / p->nth);
  }
}

/* Each thread sums the squares of its share of every gradient. */
static void sumsq_job(const struct rtp_compute_params *p, void *arg) {
  struct rtp_optimizer *opt = arg;
  double s = 0;
  for (int k = 0; k < opt->n; k++) {
    int64_t n = rtp_tensor_nelements(opt->params[k]);
    const float *g = opt->params[k]->grad->data;
    double sk = 0;
    for (int64_t i = n * p->ith / p->nth; i < n * (p->ith + 1) / p->nth; i++)
      sk += (double)g[i] * g[i];
    s += opt->norm_w[k] * sk;
  }
  opt->partial[p->ith] = s;
}

static int sumsq_device(struct rtp_optimizer *opt, double *s) {
  *s = 0;
  for (int k = 0; k < opt->n; k++) {
    double sk;
    int rc = opt->backend->i->sumsq(opt->backend, opt->params[k]->grad->data,
                                    rtp_tensor_nelements(opt->params[k]), &sk);
    if (rc) return rc;
    *s += opt->norm_w[k] * sk;
  }
  return RTP_OK;
}

static int adam_device(struct rtp_optimizer *opt) {
  for (int k = 0; k < opt->n; k++) {
    struct rtp_adam_args a = rtp__optimizer_args(opt, k, opt->params[k]->grad->data);
    int rc = opt->backend->i->adam(opt->backend, &a);
    if (rc) return rc;
  }
  return opt->backend->i->sync(opt->backend);
}

static int grad_norm(struct rtp_optimizer *opt, struct rtp_threadpool *tp) {
  double s = 0;
  if (opt->backend) {
    int rc = sumsq_device(opt, &s);
    if (rc) return rc;
  } else {
    rtp__threadpool_run(tp, sumsq_job, opt);
    for (int i = 0; i < rtp_threadpool_size(tp); i++) s += opt->partial[i];
  }
  return rtp__optimizer_norm(opt, s);
}

int rtp__optimizer_norm(struct rtp_optimizer *opt, double s) {
  for (int c = 0; c < 2; c++) { /* the shares of all ranks make the whole */
    if (!opt->comm[c]) continue;
    float f = c == 1 && opt->pipe_quiet ? 0.0f : (float)s; /* another rank adds it */
    int rc = rtp_comm_allreduce(opt->comm[c], &f, 1, NULL);
    if (rc) return rc;
    s = f;
  }
  opt->norm = (float)sqrt(s);
  return RTP_OK;
}

void rtp__optimizer_set_comm(struct rtp_optimizer *opt, struct rtp_comm *comm) {
  opt->comm[0] = comm;
}

void rtp__optimizer_add_comm(struct rtp_optimizer *opt, struct rtp_comm *comm, bool share) {
  opt->comm[1] = comm;
  opt->pipe_quiet = !share;
}

void rtp__optimizer_set_norm_weight(struct rtp_optimizer *opt, const struct rtp_tensor *param,
                                    float w) {
  for (int k = 0; k < opt->n; k++)
    if (opt->params[k] == param) opt->norm_w[k] = w;
}

float rtp_optimizer_grad_norm(const struct rtp_optimizer *opt) {
  return opt ? opt->norm : 0.0f;
}

/* Whether n floats at data (in the optimizer's memory) are all finite: their sum of
 * squares in double is, as a float's square is below 2^256. */
static int all_finite(const struct rtp_optimizer *opt, const float *data, int64_t n,
                      bool *finite) {
  double s = 0;
  if (opt->backend) {
    int rc = opt->backend->i->sumsq(opt->backend, data, n, &s);
    if (rc) return rc;
  } else {
    for (int64_t i = 0; i < n; i++) s += (double)data[i] * data[i];
  }
  *finite = isfinite(s);
  return RTP_OK;
}

/* The refusal of a step whose global gradient norm is not finite, naming the first of this
 * rank's parameters whose weights, else whose gradient, holds NaN or infinity: weights
 * first, as NaN weights make every gradient NaN. */
static int refuse_not_finite(const struct rtp_optimizer *opt) {
  int64_t step = opt->t + 1;
  for (int pass = 0; pass < 2; pass++)
    for (int k = 0; k < opt->n; k++) {
      const struct rtp_tensor *p = pass ? opt->params[k]->grad : opt->params[k];
      bool finite = true;
      int rc = all_finite(opt, p->data, rtp_tensor_nelements(p), &finite);
      if (rc) return rc;
      if (!finite)
        return rtp__error(RTP_EINVAL,
                          "rtp_optimizer_step: step %" PRId64
                          ": the %s of '%s' are not finite (NaN or infinity)%s; no weight "
                          "was changed",
                          step, pass ? "gradients" : "weights", opt->params[k]->name,
                          pass ? ": the loss diverged (a lower learning rate may help)" : "");
    }
  return rtp__error(RTP_EINVAL,
                    "rtp_optimizer_step: step %" PRId64
                    ": the gradient norm is %g: another rank's gradients are not finite, or "
                    "too large to sum in a float; no weight was changed",
                    step, (double)opt->norm);
}

int rtp__optimizer_factors(struct rtp_optimizer *opt, const char *what) {
  /* PyTorch's form: step = lr / (1 - b1^t), denom = sqrt(v) / sqrt(1 - b2^t) + eps. */
  double t = (double)(opt->t + 1);
  opt->bc1 = 1.0f - (float)pow(opt->hp.beta1, t);
  opt->bc2 = (float)sqrt(1.0 - pow(opt->hp.beta2, t));
  opt->lr_t = opt->hp.lr / opt->bc1;
  if (isfinite(opt->lr_t)) return RTP_OK;
  return rtp__error(RTP_EINVAL,
                    "%s: step %" PRId64
                    ": the learning rate %g over the bias correction %g is not a float; no "
                    "weight was changed",
                    what, opt->t + 1, (double)opt->hp.lr, (double)opt->bc1);
}

int rtp_optimizer_step(struct rtp_optimizer *opt, struct rtp_threadpool *tp) {
  if (!opt) return rtp__error(RTP_EINVAL, "rtp_optimizer_step: NULL optimizer");
  if (opt->t == INT64_MAX)
    return rtp__error(
        RTP_EINVAL, "rtp_optimizer_step: %" PRId64 " steps taken, the most there are", opt->t);
  if (opt->in_backward) return rtp__optimizer_close_step(opt);
  int rc = grad_norm(opt, tp);
  if (rc) return rc;
  /* A step on NaN or infinity would spread it to every weight and Adam state for good. */
  if (!isfinite(opt->norm)) return refuse_not_finite(opt);
  float clip = opt->hp.clip_norm;
  opt->gscale = clip > 0 && opt->norm > clip ? clip / opt->norm : 1.0f;
  if ((rc = rtp__optimizer_factors(opt, "rtp_optimizer_step"))) return rc;
  opt->t++;
  if (opt->backend) return adam_device(opt);
  rtp__threadpool_run(tp, adam_job, opt);
  return RTP_OK;
}

int rtp__optimizer_set_params(struct rtp_optimizer *opt, struct rtp_adamw_params hp) {
  if (!params_valid(hp))
    return rtp__error(RTP_EINVAL,
                      "rtp_parallel_optimizer: need finite lr >= 0, 0 <= betas < 1, eps > 0, "
                      "weight_decay >= 0, clip_norm >= 0");
  opt->hp = hp;
  return rtp__optimizer_factors(opt, "rtp_parallel_optimizer");
}

int rtp_optimizer_set_lr(struct rtp_optimizer *opt, float lr) {
  if (!opt || !(lr >= 0) || !isfinite(lr))
    return rtp__error(RTP_EINVAL,
                      "rtp_optimizer_set_lr: need an optimizer and a finite lr >= 0, not %g",
                      (double)lr);
  opt->hp.lr = lr;
  return opt->in_backward ? rtp__optimizer_factors(opt, "rtp_optimizer_set_lr") : RTP_OK;
}

int64_t rtp_optimizer_steps(const struct rtp_optimizer *opt) {
  return opt ? opt->t : 0;
}

int rtp_optimizer_count(const struct rtp_optimizer *opt) {
  return opt ? opt->n : 0;
}

int rtp_optimizer_state(const struct rtp_optimizer *opt, int i, struct rtp_tensor **param,
                        struct rtp_tensor **m, struct rtp_tensor **v) {
  if (!opt || i < 0 || i >= opt->n)
    return rtp__error(RTP_EINVAL, "rtp_optimizer_state: no parameter %d", i);
  if (param) *param = opt->params[i];
  if (m) *m = opt->m[i];
  if (v) *v = opt->v[i];
  return RTP_OK;
}

void rtp__optimizer_find(const struct rtp_optimizer *opt, const struct rtp_tensor *param,
                         struct rtp_tensor **m, struct rtp_tensor **v) {
  *m = *v = NULL;
  for (int i = 0; opt && i < opt->n; i++)
    if (opt->params[i] == param) {
      *m = opt->m[i];
      *v = opt->v[i];
      return;
    }
}

int rtp_optimizer_set_steps(struct rtp_optimizer *opt, int64_t steps) {
  if (!opt || steps < 0)
    return rtp__error(RTP_EINVAL,
                      "rtp_optimizer_set_steps: need an optimizer and steps >= 0, not %" PRId64,
                      steps);
  opt->t = steps;
  return opt->in_backward ? rtp__optimizer_factors(opt, "rtp_optimizer_set_steps") : RTP_OK;
}
