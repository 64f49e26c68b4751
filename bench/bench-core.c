/* bench-core: GEMM through the library next to direct cblas_sgemm (and, in a oneDNN
 * build, a direct oneDNN matmul) for the shapes of the `small` model's forward and
 * backward, one full training step of the `small` model, and that step with the fused
 * attention op against the unfused chain, on 1 and 2 threads. Prints JSON lines, each
 * naming the library's GEMM provider and kernel; ratios are measured side by side in one
 * run.
 *
 *   bench-core [--batch B] [--threads "1 2"] [--reps R] [--steps S] [--step-only]
 *              [--attention-only]
 *
 * --step-only skips the GEMMs and the attention (the step's fraction of the GEMM rate is
 * then null): for alternating two builds' steps (docs/benchmarks.md, "GEMM providers").
 * --attention-only runs the attention comparisons alone.
 */
#include <cblas.h>
#ifdef RTP_BENCH_DNNL
#include <oneapi/dnnl/dnnl.h>
#include <omp.h>
#endif
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gpt.h"
#include "rtp-impl.h"
#include "rtp.h"

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void fill(float *p, int64_t n, unsigned seed) {
  for (int64_t i = 0; i < n; i++) {
    seed = seed * 1664525u + 1013904223u;
    p[i] = (float)(seed >> 8) / 16777216.0f - 0.5f;
  }
}

/* One GEMM of the model: C{M, N} = B{K, N} . A{K, M}^T, with either operand optionally
 * transposed as the backward pass uses them. */
struct shape {
  const char *name;
  int64_t m, n, k;
  bool a_t, b_t; /* operand stored transposed ({M, K} / {N, K}) and viewed back */
};

static double time_best(double (*run)(void *), void *arg, int reps) {
  double best = 1e30;
  run(arg); /* warm-up */
  for (int r = 0; r < reps; r++) {
    double t = run(arg);
    if (t < best) best = t;
  }
  return best;
}

struct lib_gemm {
  struct rtp_graph *g;
  struct rtp_threadpool *tp;
};

static double run_lib(void *arg) {
  struct lib_gemm *lg = arg;
  double t0 = now_s();
  if (rtp_graph_compute(lg->g, lg->tp)) {
    fprintf(stderr, "bench-core: %s\n", rtp_last_error());
    exit(1);
  }
  return now_s() - t0;
}

struct direct_gemm {
  const struct shape *s;
  const float *a, *b;
  float *c;
};

/* The built-in kernel the library uses when built without CBLAS (single thread). */
static double run_fallback(void *arg) {
  struct direct_gemm *d = arg;
  const struct shape *s = d->s;
  double t0 = now_s();
  rtp__gemm_fallback(s->n, s->m, s->k, d->b, s->b_t ? 1 : s->k, s->b_t ? s->n : 1, d->a,
                     s->a_t ? 1 : s->k, s->a_t ? s->m : 1, d->c, s->m, false);
  return now_s() - t0;
}

/* The same product straight to CBLAS: row-major C[N][M] = B[N][K] . A[M][K]^T. */
static double run_direct(void *arg) {
  struct direct_gemm *d = arg;
  const struct shape *s = d->s;
  double t0 = now_s();
  cblas_sgemm(CblasRowMajor, s->b_t ? CblasTrans : CblasNoTrans,
              s->a_t ? CblasNoTrans : CblasTrans, (int)s->n, (int)s->m, (int)s->k, 1.0f, d->b,
              s->b_t ? (int)s->n : (int)s->k, d->a, s->a_t ? (int)s->m : (int)s->k, 0.0f, d->c,
              (int)s->m);
  return now_s() - t0;
}

#ifdef RTP_BENCH_DNNL
/* The same product as one oneDNN matmul made for it, on `threads` OpenMP threads:
 * src B{N, K}, weights A^T{K, M}, either stored transposed. */
struct dnnl_direct {
  dnnl_engine_t eng;
  dnnl_stream_t st;
  dnnl_primitive_t p;
  dnnl_memory_t mem[3];
  int threads;
};

static void dnnl_check(dnnl_status_t st, const char *what) {
  if (st != dnnl_success) {
    fprintf(stderr, "bench-core: %s: oneDNN status %d\n", what, (int)st);
    exit(1);
  }
}

static void dnnl_direct_make(struct dnnl_direct *d, const struct shape *s, float *a, float *b,
                             float *c, int threads) {
  dnnl_memory_desc_t md[3];
  dnnl_dims_t sd = {s->n, s->k}, ss = {s->b_t ? 1 : s->k, s->b_t ? s->n : 1};
  dnnl_dims_t wd = {s->k, s->m}, ws = {s->a_t ? s->m : 1, s->a_t ? 1 : s->k};
  dnnl_dims_t dd = {s->n, s->m}, ds = {s->m, 1};
  dnnl_matmul_desc_t mm;
  dnnl_primitive_desc_t pd;
  d->threads = threads;
  omp_set_num_threads(threads);
  dnnl_check(dnnl_engine_create(&d->eng, dnnl_cpu, 0), "engine");
  dnnl_check(dnnl_stream_create(&d->st, d->eng, dnnl_stream_default_flags), "stream");
  dnnl_check(dnnl_memory_desc_init_by_strides(&md[0], 2, sd, dnnl_f32, ss), "src");
  dnnl_check(dnnl_memory_desc_init_by_strides(&md[1], 2, wd, dnnl_f32, ws), "weights");
  dnnl_check(dnnl_memory_desc_init_by_strides(&md[2], 2, dd, dnnl_f32, ds), "dst");
  dnnl_check(dnnl_matmul_desc_init(&mm, &md[0], &md[1], NULL, &md[2]), "matmul");
  dnnl_check(dnnl_primitive_desc_create(&pd, &mm, NULL, d->eng, NULL), "pd");
  dnnl_check(dnnl_primitive_create(&d->p, pd), "primitive");
  dnnl_primitive_desc_destroy(pd);
  float *ptr[3] = {b, a, c};
  for (int i = 0; i < 3; i++)
    dnnl_check(dnnl_memory_create(&d->mem[i], &md[i], d->eng, ptr[i]), "memory");
  omp_set_num_threads(1);
}

static void dnnl_direct_free(struct dnnl_direct *d) {
  for (int i = 0; i < 3; i++) dnnl_memory_destroy(d->mem[i]);
  dnnl_primitive_destroy(d->p);
  dnnl_stream_destroy(d->st);
  dnnl_engine_destroy(d->eng);
}

static double run_dnnl(void *arg) {
  struct dnnl_direct *d = arg;
  dnnl_exec_arg_t args[] = {
      {DNNL_ARG_SRC, d->mem[0]}, {DNNL_ARG_WEIGHTS, d->mem[1]}, {DNNL_ARG_DST, d->mem[2]}};
  omp_set_num_threads(d->threads);
  double t0 = now_s();
  dnnl_check(dnnl_primitive_execute(d->p, d->st, 3, args), "execute");
  dnnl_check(dnnl_stream_wait(d->st), "wait");
  double t = now_s() - t0;
  omp_set_num_threads(1);
  return t;
}
#endif

static double bench_gemm(const struct shape *s, int threads, int reps) {
  struct rtp_init_params ip = {
      .mem_size = (size_t)(s->m * s->k + s->n * s->k + s->m * s->n) * 4 + (16 << 20)};
  struct rtp_context *ctx = rtp_context_new(ip);
  struct rtp_tensor *a = s->a_t ? rtp_tensor_new_2d(ctx, RTP_TYPE_F32, s->m, s->k)
                                : rtp_tensor_new_2d(ctx, RTP_TYPE_F32, s->k, s->m);
  struct rtp_tensor *b = s->b_t ? rtp_tensor_new_2d(ctx, RTP_TYPE_F32, s->n, s->k)
                                : rtp_tensor_new_2d(ctx, RTP_TYPE_F32, s->k, s->n);
  fill(a->data, rtp_tensor_nelements(a), 1);
  fill(b->data, rtp_tensor_nelements(b), 2);
  struct rtp_tensor *c =
      rtp_mul_mat(ctx, s->a_t ? rtp_transpose(ctx, a) : a, s->b_t ? rtp_transpose(ctx, b) : b);
  rtp_tensor_set_output(c);
  struct rtp_graph *g = rtp_graph_new(ctx, 16);
  if (rtp_graph_build(g, c) || rtp_graph_plan(ctx, g)) {
    fprintf(stderr, "bench-core: %s\n", rtp_last_error());
    exit(1);
  }
  struct lib_gemm lg = {g, rtp_threadpool_new(threads)};
  float *cd = malloc((size_t)(s->m * s->n) * 4);
  struct direct_gemm dg = {s, a->data, b->data, cd};
  /* Interleaved, so that both see the same machine: this one's neighbours are noisy. */
  double t_lib = 1e30, t_direct = 1e30, t_dnnl = 1e30;
#ifdef RTP_BENCH_DNNL
  struct dnnl_direct dd;
  dnnl_direct_make(&dd, s, a->data, b->data, cd, threads);
#endif
  for (int r = 0; r < reps; r++) {
    double tl = time_best(run_lib, &lg, 1);
    openblas_set_num_threads(threads);
    double td = time_best(run_direct, &dg, 1);
    openblas_set_num_threads(1);
    t_lib = tl < t_lib ? tl : t_lib;
    t_direct = td < t_direct ? td : t_direct;
#ifdef RTP_BENCH_DNNL
    double tn = time_best(run_dnnl, &dd, 1);
    t_dnnl = tn < t_dnnl ? tn : t_dnnl;
#endif
  }
#ifdef RTP_BENCH_DNNL
  dnnl_direct_free(&dd);
#endif
  double t_fallback = threads == 1 ? time_best(run_fallback, &dg, 1) : 0;
  double flops = 2.0 * (double)s->m * (double)s->n * (double)s->k;
  printf(
      "{\"bench\":\"gemm\",\"shape\":\"%s\",\"m\":%lld,\"n\":%lld,\"k\":%lld,\"threads\":%d,"
      "\"provider\":\"%s\",\"lib_gflops\":%.2f,\"cblas_gflops\":%.2f,\"ratio\":%.3f",
      s->name, (long long)s->m, (long long)s->n, (long long)s->k, threads, rtp__gemm_provider(),
      flops / t_lib * 1e-9, flops / t_direct * 1e-9, t_direct / t_lib);
  if (t_dnnl < 1e30)
    printf(",\"onednn_gflops\":%.2f,\"ratio_onednn\":%.3f", flops / t_dnnl * 1e-9,
           t_dnnl / t_lib);
  if (t_fallback > 0) printf(",\"fallback_gflops\":%.2f", flops / t_fallback * 1e-9);
  printf("}\n");
  fflush(stdout);
  free(cd);
  rtp_threadpool_free(lg.tp);
  rtp_context_free(ctx);
  return flops / (t_dnnl < 1e30 ? t_dnnl : t_direct); /* the provider's own rate */
}

/* One process training the model: its graph planned, Adam, and fixed tokens. */
struct trainer {
  struct rtp_context *ctx;
  struct gpt m;
  struct rtp_graph *g;
  struct rtp_optimizer *opt;
  struct rtp_threadpool *tp;
};

static void trainer_new(struct trainer *t, struct gpt_config cfg, int batch, int threads) {
  struct rtp_init_params ip = {.mem_size = gpt_arena_size(cfg, batch), .no_alloc = false};
  t->ctx = rtp_context_new(ip);
  t->g = t->ctx ? rtp_graph_new(t->ctx, 8192) : NULL;
  if (!t->g || gpt_build(t->ctx, &t->m, cfg, batch) || rtp_graph_build(t->g, t->m.loss) ||
      rtp_graph_build_backward(t->ctx, t->g, t->m.loss) || rtp_graph_plan(t->ctx, t->g)) {
    fprintf(stderr, "bench-core: %s\n", rtp_last_error());
    exit(1);
  }
  gpt_init_weights(&t->m, 1);
  t->opt = rtp_optimizer_new(t->ctx, t->g, rtp_adamw_params_default());
  int32_t *idx = t->m.idx->data, *tgt = t->m.targets->data;
  for (int64_t i = 0; i < rtp_tensor_nelements(t->m.idx); i++)
    idx[i] = tgt[i] = (int32_t)(i * 7 % 256);
  t->tp = rtp_threadpool_new(threads);
}

/* One step's seconds. */
static double trainer_step(struct trainer *t) {
  double t0 = now_s();
  if (rtp_graph_compute(t->g, t->tp) || rtp_optimizer_step(t->opt, t->tp)) {
    fprintf(stderr, "bench-core: %s\n", rtp_last_error());
    exit(1);
  }
  return now_s() - t0;
}

static void trainer_free(struct trainer *t) {
  rtp_threadpool_free(t->tp);
  rtp_context_free(t->ctx);
}

static void bench_step(struct gpt_config cfg, int batch, int threads, int steps,
                       double gemm_rate) {
  struct trainer tr;
  trainer_new(&tr, cfg, batch, threads);
  double best = 1e30;
  for (int s = 0; s <= steps; s++) {
    double t = trainer_step(&tr);
    if (s > 0 && t < best) best = t; /* step 0 warms caches and pages */
  }
  struct rtp_mem_report r;
  rtp_mem_report_get(tr.ctx, &r);
  double tokens = (double)cfg.seq_len * batch, flops = gpt_step_flops(cfg, batch);
  char rate[80] = "\"gemm_gflops\":null,\"fraction_of_gemm\":null";
  if (gemm_rate > 0)
    snprintf(rate, sizeof(rate), "\"gemm_gflops\":%.2f,\"fraction_of_gemm\":%.3f",
             gemm_rate * 1e-9, flops / best / gemm_rate);
  printf(
      "{\"bench\":\"step\",\"model\":\"small\",\"batch\":%d,\"threads\":%d,\"ms\":%.1f,"
      "\"tokens_per_s\":%.0f,\"gflops\":%.2f,%s,\"params\":%lld,\"activation_bytes\":%zu,"
      "\"activation_sum\":%zu,\"gemm_provider\":\"%s\",\"gemm_kernel\":\"%s\","
      "\"bf16_products\":\"%s\"}\n",
      batch, threads, best * 1e3, tokens / best, flops / best * 1e-9, rate,
      (long long)gpt_n_params(cfg), r.bytes[RTP_ROLE_ACTIVATION], r.activation_sum,
      rtp__gemm_provider(), rtp__gemm_kernel(), "f32 GEMM on bf16-rounded operands");
  fflush(stdout);
  trainer_free(&tr);
}

/* The model's attention alone, forward and backward: one graph from qkv {3d, T, B} to a
 * scalar sum(out * r) and back to qkv's gradient, fused or as the GPT's unfused chain. */
struct attn_graph {
  struct rtp_context *ctx;
  struct rtp_graph *g;
};

static struct rtp_tensor *attn_unfused(struct rtp_context *c, struct rtp_tensor *qkv, int64_t H,
                                       float scale) {
  int64_t d = qkv->ne[0] / 3, hd = d / H, T = qkv->ne[1], B = qkv->ne[2];
  size_t f = sizeof(float), nb[4] = {f, hd * f, 3 * d * f, 3 * d * T * f};
  int64_t ne[4] = {hd, H, T, B};
  struct rtp_tensor *h[3];
  for (int i = 0; i < 3; i++)
    h[i] = rtp_permute(c, rtp_view(c, qkv, 4, ne, nb, (size_t)i * d * f), 0, 2, 1, 3);
  struct rtp_tensor *att = rtp_soft_max(c, rtp_mul_mat(c, h[1], h[0]), scale, true);
  struct rtp_tensor *out = rtp_mul_mat(c, rtp_transpose(c, h[2]), att);
  return rtp_reshape_3d(c, rtp_cont(c, rtp_permute(c, out, 0, 2, 1, 3)), d, T, B);
}

static void attn_graph_new(struct attn_graph *a, struct gpt_config cfg, int batch, bool fused) {
  int64_t d = cfg.d_model, T = cfg.seq_len, H = cfg.n_head;
  a->ctx = rtp_context_new((struct rtp_init_params){.mem_size = (size_t)1 << 30});
  struct rtp_tensor *qkv =
      a->ctx ? rtp_tensor_new_3d(a->ctx, RTP_TYPE_F32, 3 * d, T, batch) : NULL;
  struct rtp_tensor *r = a->ctx ? rtp_tensor_new_3d(a->ctx, RTP_TYPE_F32, d, T, batch) : NULL;
  if (qkv && r) {
    fill(qkv->data, rtp_tensor_nelements(qkv), 1);
    fill(r->data, rtp_tensor_nelements(r), 2);
    rtp_tensor_set_param(qkv);
  }
  float scale = 1.0f / sqrtf((float)(d / H));
  struct rtp_tensor *y = fused ? rtp_attention_causal(a->ctx, qkv, (int)H, scale)
                               : attn_unfused(a->ctx, qkv, H, scale);
  struct rtp_tensor *loss = rtp_sum(a->ctx, rtp_mul(a->ctx, y, r));
  a->g = rtp_graph_new(a->ctx, 256);
  if (!loss || rtp_graph_build(a->g, loss) || rtp_graph_build_backward(a->ctx, a->g, loss) ||
      rtp_graph_plan(a->ctx, a->g)) {
    fprintf(stderr, "bench-core: attention: %s\n", rtp_last_error());
    exit(1);
  }
}

/* Best seconds of forward + backward of one layer's attention, fused against unfused,
 * alternated. FLOPs: the unfused chain's 4 T x T x hd products per head forward and
 * backward (2 + 4, counting the causal half too, as its GEMMs do). */
static void bench_attention_op(struct gpt_config cfg, int batch, int threads, int reps) {
  struct attn_graph a[2];
  for (int f = 0; f < 2; f++) attn_graph_new(&a[f], cfg, batch, f);
  struct rtp_threadpool *tp = rtp_threadpool_new(threads);
  double best[2] = {1e30, 1e30};
  for (int r = 0; r <= reps; r++)
    for (int f = 0; f < 2; f++) {
      double t0 = now_s();
      if (rtp_graph_compute(a[f].g, tp)) {
        fprintf(stderr, "bench-core: attention: %s\n", rtp_last_error());
        exit(1);
      }
      double t = now_s() - t0;
      if (r > 0 && t < best[f]) best[f] = t;
    }
  double flops = 6.0 * 2.0 * (double)cfg.seq_len * cfg.seq_len * cfg.d_model * batch;
  printf(
      "{\"bench\":\"attention_op\",\"T\":%d,\"heads\":%d,\"hd\":%d,\"batch\":%d,"
      "\"threads\":%d,\"unfused_ms\":%.3f,\"fused_ms\":%.3f,\"speedup\":%.3f,"
      "\"unfused_gflops\":%.2f,\"fused_gflops_equiv\":%.2f}\n",
      cfg.seq_len, cfg.n_head, cfg.d_model / cfg.n_head, batch, threads, best[0] * 1e3,
      best[1] * 1e3, best[0] / best[1], flops / best[0] * 1e-9, flops / best[1] * 1e-9);
  fflush(stdout);
  rtp_threadpool_free(tp);
  for (int f = 0; f < 2; f++) rtp_context_free(a[f].ctx);
}

/* The step with the fused attention op against the unfused chain, alternated step by
 * step (so both see the same machine), best of each; and both activation peaks. */
static void bench_attention(struct gpt_config cfg, int batch, int threads, int steps) {
  struct trainer tr[2]; /* unfused, fused */
  for (int f = 0; f < 2; f++) {
    cfg.fused_attention = f;
    trainer_new(&tr[f], cfg, batch, threads);
  }
  double best[2] = {1e30, 1e30};
  for (int s = 0; s <= steps; s++)
    for (int f = 0; f < 2; f++) {
      double t = trainer_step(&tr[f]);
      if (s > 0 && t < best[f]) best[f] = t;
    }
  struct rtp_mem_report r[2];
  for (int f = 0; f < 2; f++) rtp_mem_report_get(tr[f].ctx, &r[f]);
  printf(
      "{\"bench\":\"attention\",\"model\":\"small\",\"batch\":%d,\"threads\":%d,"
      "\"unfused_ms\":%.1f,\"fused_ms\":%.1f,\"speedup\":%.3f,"
      "\"unfused_activation_bytes\":%zu,\"fused_activation_bytes\":%zu,"
      "\"unfused_work_bytes\":%zu,\"fused_work_bytes\":%zu}\n",
      batch, threads, best[0] * 1e3, best[1] * 1e3, best[0] / best[1],
      r[0].bytes[RTP_ROLE_ACTIVATION], r[1].bytes[RTP_ROLE_ACTIVATION], r[0].work, r[1].work);
  fflush(stdout);
  for (int f = 0; f < 2; f++) trainer_free(&tr[f]);
}

int main(int argc, char **argv) {
  int batch = 8, reps = 5, steps = 3;
  bool attention_only = false, step_only = false;
  const char *threads_arg = "1 2";
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--batch") && i + 1 < argc)
      batch = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--threads") && i + 1 < argc)
      threads_arg = argv[++i];
    else if (!strcmp(argv[i], "--reps") && i + 1 < argc)
      reps = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--steps") && i + 1 < argc)
      steps = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--attention-only"))
      attention_only = true;
    else if (!strcmp(argv[i], "--step-only"))
      step_only = true;
    else {
      fprintf(stderr,
              "usage: bench-core [--batch B] [--threads \"1 2\"] [--reps R] [--steps S] "
              "[--step-only] [--attention-only]\n");
      return 2;
    }
  }
  struct gpt_config cfg = gpt_config_small();
  int64_t d = cfg.d_model, V = cfg.vocab, N = (int64_t)cfg.seq_len * batch;
  /* Forward: y = x W^T. Backward: dx = dy W (W viewed transposed), dW = dy^T x. */
  const struct shape shapes[] = {
      {"c_attn.fwd", 3 * d, N, d, false, false},  {"c_attn.dx", d, N, 3 * d, true, false},
      {"c_attn.dw", d, 3 * d, N, true, true},     {"c_proj.fwd", d, N, d, false, false},
      {"c_fc.fwd", 4 * d, N, d, false, false},    {"c_fc.dx", d, N, 4 * d, true, false},
      {"c_fc.dw", d, 4 * d, N, true, true},       {"mlp.c_proj.fwd", d, N, 4 * d, false, false},
      {"mlp.c_proj.dw", 4 * d, d, N, true, true}, {"lm_head.fwd", V, N, d, false, false},
  };
  int n_shapes = (int)(sizeof(shapes) / sizeof(shapes[0]));
  char buf[64];
  snprintf(buf, sizeof(buf), "%s", threads_arg);
  for (char *tok = strtok(buf, " ,"); tok; tok = strtok(NULL, " ,")) {
    int threads = atoi(tok);
    double flops = 0, secs = 0;
    for (int i = 0; i < n_shapes && !attention_only && !step_only; i++) {
      double rate = bench_gemm(&shapes[i], threads, reps);
      double f = 2.0 * (double)shapes[i].m * (double)shapes[i].n * (double)shapes[i].k;
      flops += f;
      secs += f / rate;
    }
    if (!attention_only) bench_step(cfg, batch, threads, steps, step_only ? 0 : flops / secs);
    for (int T = cfg.seq_len; T <= 1024 && !step_only; T *= 4) { /* small's T, then longer */
      struct gpt_config c = cfg;
      c.seq_len = T;
      bench_attention_op(c, (int)(batch * cfg.seq_len / T > 0 ? batch * cfg.seq_len / T : 1),
                         threads, 4 * reps);
    }
    if (!step_only) bench_attention(cfg, batch, threads, steps);
  }
  return 0;
}
