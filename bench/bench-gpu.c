/* bench-gpu: the speed of one whole training step (forward, backward, AdamW) of the
 * reference GPT (examples/gpt, the model train-gpt trains) in one process on one device,
 * as bench/torch-gpu.py measures PyTorch on the same model. Prints one JSON line.
 *
 *   bench-gpu [--device cuda|cpu] [--config medium|gpt2|tiny] [--batch B] [--bf16]
 *             [--n-layer L] [--d-model D] [--n-head H] [--seq-len T] [--vocab V]
 *             [--steps S] [--warmup W] [--peak-tflops P] [--device-name NAME]
 *             [--threads N]
 *
 * The model is built as train-gpt builds it for one process: once in a no_alloc context,
 * then rtp_parallel_new (strategy none) makes the device's graph with --bf16's
 * compute_type, and rtp_parallel_optimizer its AdamW. Attention is the unfused chain
 * (views, mul_mat, soft_max): the fused op has no CUDA kernel, and PyTorch's twin
 * (scripts/gpt_torch.py) computes the same chain. A step is rtp_graph_compute and
 * rtp_optimizer_step, timed by the wall clock: both return only once the device is idle
 * (they end with the backend's sync), so the time is the device's work and the host's
 * launches. bench/gpu-speed.sh runs it next to PyTorch; docs/benchmarks.md, "GPU".
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench-util.h"
#include "gpt.h"
#include "rtp.h"

struct options {
  const char *device, *config, *device_name;
  int batch, steps, warmup, threads;
  int n_layer, d_model, n_head, seq_len, vocab; /* -1: the config's */
  bool bf16;
  double peak_tflops; /* <= 0: from the table */
};

/* medium: train-gpt's preset (bytes, T 256, d 768, 12 layers and heads), batch 32 (8,192
 * tokens a step). gpt2: GPT-2 124M's shape with its tied head, and the vocabulary padded to
 * 50,304 (a multiple of 128, as nanoGPT and llm.c pad GPT-2's 50,257), batch 8 of T 1024.
 * tiny: train-gpt's, for tests. */
static int find_config(const char *name, struct gpt_config *c, int *batch) {
  if (!strcmp(name, "medium")) {
    *c = gpt_config_medium();
    *batch = 32;
  } else if (!strcmp(name, "gpt2")) {
    *c = (struct gpt_config){50304, 1024, 768, 12, 12, true, false};
    *batch = 8;
  } else if (!strcmp(name, "tiny")) {
    *c = (struct gpt_config){256, 32, 64, 2, 4, false, false};
    *batch = 2;
  } else {
    return -1;
  }
  return 0;
}

/* Dense tensor-core peaks (TFLOP/s, no sparsity) of the SXM H100 and H200 from NVIDIA's
 * datasheets: bf16 989, f32 67 (the CUDA cores: cuBLAS's default f32 GEMM uses no TF32).
 * The H200 has the H100's compute (more and faster memory). PCIe and NVL parts differ:
 * no entry, so --peak-tflops or no MFU. */
static double peak_tflops(const char *name, bool bf16) {
  if (!name || strstr(name, "PCIe") || strstr(name, "NVL")) return 0;
  if (strstr(name, "H100") || strstr(name, "H200")) return bf16 ? 989.0 : 67.0;
  return 0;
}

/* The CPU's model name from /proc/cpuinfo, for --device cpu. */
static void cpu_name(char *out, size_t n) {
  char line[256];
  FILE *f = fopen("/proc/cpuinfo", "r");
  snprintf(out, n, "unknown");
  while (f && fgets(line, sizeof(line), f)) {
    char *colon = strchr(line, ':');
    if (strncmp(line, "model name", 10) || !colon) continue;
    snprintf(out, n, "%s", colon + 2);
    out[strcspn(out, "\n")] = 0;
    break;
  }
  if (f) fclose(f);
}

/* JSON string body: quotes, backslashes and control characters dropped (names from
 * nvidia-smi and /proc have none in practice). */
static void json_clean(char *s) {
  char *w = s;
  for (; *s; s++)
    if (*s != '"' && *s != '\\' && (unsigned char)*s >= 0x20) *w++ = *s;
  *w = 0;
}

static int usage(const char *why) {
  if (why) fprintf(stderr, "bench-gpu: %s\n", why);
  fprintf(stderr,
          "usage: bench-gpu [--device cuda|cpu] [--config medium|gpt2|tiny] [--batch B] "
          "[--bf16]\n"
          "                 [--n-layer L] [--d-model D] [--n-head H] [--seq-len T] "
          "[--vocab V]\n"
          "                 [--steps S] [--warmup W] [--peak-tflops P] [--device-name NAME] "
          "[--threads N]\n");
  return 2;
}

/* An integer argument in [lo, 2^24], or -1. */
static int int_arg(const char *s, int lo) {
  char *end;
  long v = strtol(s, &end, 10);
  return *s && !*end && v >= lo && v <= 1 << 24 ? (int)v : -1;
}

static int parse(int argc, char **argv, struct options *o) {
  *o = (struct options){"cuda", "medium", NULL, -1, 20, 10, 0, -1, -1, -1, -1, -1, false, 0};
  struct {
    const char *name;
    int *dst;
  } ints[] = {
      {"--batch", &o->batch},     {"--steps", &o->steps},     {"--warmup", &o->warmup},
      {"--threads", &o->threads}, {"--n-layer", &o->n_layer}, {"--d-model", &o->d_model},
      {"--n-head", &o->n_head},   {"--seq-len", &o->seq_len}, {"--vocab", &o->vocab}};
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    size_t k = 0;
    while (k < sizeof(ints) / sizeof(ints[0]) && strcmp(a, ints[k].name)) k++;
    if (!strcmp(a, "--bf16")) {
      o->bf16 = true;
      continue;
    }
    if (!v) return usage(a);
    i++;
    if (k < sizeof(ints) / sizeof(ints[0])) {
      *ints[k].dst = int_arg(v, ints[k].dst == &o->warmup ? 0 : 1);
      if (*ints[k].dst < 0) return usage("sizes, --steps and --threads must be positive");
    } else if (!strcmp(a, "--device")) {
      o->device = v;
    } else if (!strcmp(a, "--config")) {
      o->config = v;
    } else if (!strcmp(a, "--device-name")) {
      o->device_name = v;
    } else if (!strcmp(a, "--peak-tflops")) {
      o->peak_tflops = strtod(v, NULL);
      if (!(o->peak_tflops > 0)) return usage("--peak-tflops must be a positive number");
    } else {
      return usage(a);
    }
  }
  if (strcmp(o->device, "cuda") && strcmp(o->device, "cpu"))
    return usage("--device must be cuda or cpu");
  return 0;
}

/* The config with the size flags on top; -1 if it is not one gpt_build takes. */
static int resolve(struct options *o, struct gpt_config *c) {
  int batch;
  if (find_config(o->config, c, &batch)) return usage("--config must be medium, gpt2 or tiny");
  if (o->batch < 0) o->batch = batch;
  int *dst[] = {&c->n_layer, &c->d_model, &c->n_head, &c->seq_len, &c->vocab};
  int src[] = {o->n_layer, o->d_model, o->n_head, o->seq_len, o->vocab};
  for (int i = 0; i < 5; i++)
    if (src[i] > 0) *dst[i] = src[i];
  if (gpt_config_check(*c))
    return usage("bad sizes (n_head must divide d_model; 1..64 layers; sizes up to 2^20)");
  return 0;
}

struct bench {
  struct rtp_backend *be;
  struct rtp_context *meta, *ctx;
  struct gpt m;
  struct rtp_parallel *par;
  struct rtp_graph *g;
  struct rtp_optimizer *opt;
  struct rtp_threadpool *tp;
  size_t data_size; /* the device arena taken (0 on the CPU) */
};

static int fail(const char *what) {
  fprintf(stderr, "bench-gpu: %s: %s\n", what, rtp_last_error());
  return 1;
}

static uint64_t lcg(uint64_t *s) {
  return *s = *s * 6364136223846793005ull + 1442695040888963407ull;
}

/* Parameter i's initial values: gpt_init_tensor's for vectors (biases 0, LayerNorm 1), and
 * for matrices uniform values of GPT-2's standard deviation (0.02, the residual projections
 * 0.02 / sqrt(2L)) instead of its normal ones: Box-Muller over GPT-2's 124M weights takes
 * the host 10 to 20 s, and a step's speed depends on the values' scale only. */
static void init_param(const struct gpt *m, int i, float *w) {
  const struct rtp_tensor *p = m->params[i];
  if (rtp_tensor_n_dims(p) < 2) {
    gpt_init_tensor(m, i, 1, w);
    return;
  }
  double sd = strstr(p->name, "c_proj") ? 0.02 / sqrt(2.0 * m->cfg.n_layer) : 0.02;
  float a = (float)(sd * sqrt(3.0)) / (float)(1u << 31); /* U(-a, a) has sd a / sqrt(3) */
  uint64_t s = (uint64_t)i + 1;
  for (int64_t j = 0; j < rtp_tensor_nelements(p); j++)
    w[j] = a * (float)((int64_t)(lcg(&s) >> 32) - (1ll << 31));
}

/* Every parameter's initial values, then random tokens: what the step reads does not
 * change its speed, only that it is a real batch. */
static int fill(struct bench *b, struct gpt_config c, int batch) {
  for (int i = 0; i < b->m.n_params; i++) {
    struct rtp_tensor *mine = rtp_parallel_tensor(b->par, b->m.params[i]);
    float *w = malloc(rtp_tensor_nbytes(mine));
    if (!w) return fail("the initial weights");
    init_param(&b->m, i, w);
    int rc = rtp_tensor_set(mine, w, 0, rtp_tensor_nbytes(mine));
    free(w);
    if (rc) return fail("setting the weights");
  }
  size_t n = (size_t)c.seq_len * (size_t)batch;
  int32_t *tok = malloc(2 * n * sizeof(int32_t));
  if (!tok) return fail("the tokens");
  uint64_t s = 42;
  for (size_t i = 0; i < 2 * n; i++) tok[i] = (int32_t)((lcg(&s) >> 33) % (uint64_t)c.vocab);
  int rc = rtp_tensor_set(rtp_parallel_tensor(b->par, b->m.idx), tok, 0, n * 4) ||
           rtp_tensor_set(rtp_parallel_tensor(b->par, b->m.targets), tok + n, 0, n * 4);
  free(tok);
  return rc ? fail("setting the tokens") : 0;
}

static int bench_new(struct bench *b, const struct options *o, struct gpt_config c) {
  *b = (struct bench){0};
  if (!strcmp(o->device, "cuda") && rtp_backend_cuda_new(0, &b->be))
    return fail("--device cuda");
  int nodes = gpt_graph_size(c);
  b->meta = rtp_context_new((struct rtp_init_params){
      .mem_size = (size_t)nodes * 2048 + (8u << 20), .no_alloc = true});
  struct rtp_graph *fwd = b->meta ? rtp_graph_new(b->meta, nodes) : NULL;
  if (!fwd || gpt_build(b->meta, &b->m, c, o->batch) || rtp_graph_build(fwd, b->m.loss))
    return fail("building the model");
  /* On a device the host arena holds headers, graphs and plans, the device arena the data;
   * the CPU's one arena holds both (as train-gpt's). */
  double graphs = (double)nodes * 2 * 1024 + (1u << 20);
  double data =
      (double)gpt_arena_size(c, o->batch) + (o->bf16 ? gpt_bf16_scratch_size(c, o->batch) : 0);
  if (data + graphs >= 0x1p63) return usage("sizes past what 64 bits count");
  b->data_size = b->be ? (size_t)data : 0;
  b->ctx = rtp_context_new(
      (struct rtp_init_params){.mem_size = (size_t)(b->be ? graphs : data + graphs),
                               .backend = b->be,
                               .data_size = b->data_size});
  if (!b->ctx) return fail("the arena");
  struct rtp_parallel_params pp = {.strategy = RTP_STRATEGY_NONE,
                                   .compute_type = o->bf16 ? RTP_TYPE_BF16 : RTP_TYPE_F32};
  b->par = rtp_parallel_new(b->ctx, fwd, b->m.loss, &pp);
  b->g = b->par ? rtp_parallel_graph(b->par) : NULL;
  if (!b->g || rtp_graph_plan(b->ctx, b->g)) return fail("the step's graph");
  if (fill(b, c, o->batch)) return 1;
  /* nanoGPT's GPT-2 recipe, as torch-gpu.py's: decay 0.1 but not on biases and LayerNorm,
   * the global gradient norm clipped to 1. */
  struct rtp_adamw_params hp = {3e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, 1.0f};
  b->opt = rtp_parallel_optimizer(b->par, hp);
  if (!b->opt) return fail("the optimizer");
  if (!b->be && !(b->tp = rtp_threadpool_new(o->threads))) return fail("the threads");
  return 0;
}

static void bench_free(struct bench *b) {
  rtp_threadpool_free(b->tp);
  rtp_context_free(b->ctx);
  rtp_context_free(b->meta);
  rtp_backend_free(b->be);
}

/* One step's seconds, or -1 (the message printed). */
static double step(struct bench *b) {
  double t0 = bench_now_s();
  if (rtp_graph_compute(b->g, b->tp) || rtp_optimizer_step(b->opt, b->tp)) {
    fail("a training step");
    return -1;
  }
  return bench_now_s() - t0;
}

static float loss_of(const struct bench *b) {
  float l = NAN;
  rtp_tensor_get(rtp_parallel_tensor(b->par, b->m.loss), &l, 0, sizeof(l));
  return l;
}

static double median_of(double *v, int n) { /* sorts v */
  qsort(v, (size_t)n, sizeof(double), bench_cmp_double);
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* A 95% bootstrap interval of the median, as bench/bench_stats.py's interval: 2,000
 * resamples with a fixed seed, so runs repeat. */
static void median_interval(const double *v, int n, double *lo, double *hi) {
  enum { R = 2000 };
  static double meds[R];
  double *s = malloc((size_t)n * sizeof(double));
  uint64_t x = 1;
  for (int r = 0; r < R && s; r++) {
    for (int i = 0; i < n; i++) s[i] = v[(lcg(&x) >> 33) % (uint64_t)n];
    meds[r] = median_of(s, n);
  }
  free(s);
  qsort(meds, R, sizeof(double), bench_cmp_double);
  *lo = meds[(int)(0.025 * R)];
  *hi = meds[(int)(0.975 * R) - 1];
}

/* Model FLOPs of a step (gpt_step_flops, the PaLM / llm.c convention): 6 x parameters x
 * tokens for the matrix products forward and backward, plus 6 x 2 x L x T x d x tokens for
 * the attention scores and their use (the whole T x T, not its causal half); the embedding
 * lookup, LayerNorm, softmax and Adam are not counted. */
static void report(const struct options *o, struct gpt_config c, struct bench *b, double *t,
                   float loss0, float loss1) {
  char name[128];
  if (o->device_name)
    snprintf(name, sizeof(name), "%s", o->device_name);
  else if (b->be)
    snprintf(name, sizeof(name), "unknown");
  else
    cpu_name(name, sizeof(name));
  json_clean(name);
  double lo, hi;
  median_interval(t, o->steps, &lo, &hi);
  double med = median_of(t, o->steps), min = t[0]; /* t is sorted now */
  double tokens = (double)c.seq_len * o->batch, flops = gpt_step_flops(c, o->batch);
  double peak = o->peak_tflops > 0 ? o->peak_tflops : b->be ? peak_tflops(name, o->bf16) : 0;
  char mfu[64] = "null", peak_s[32] = "null";
  if (peak > 0) {
    snprintf(mfu, sizeof(mfu), "%.4g", flops / med / (peak * 1e12));
    snprintf(peak_s, sizeof(peak_s), "%.1f", peak);
  }
  /* Peak memory: what the arena holds for tensor data, the planned activations and kernel
   * scratch (on a device, all of it device memory; the CUDA context and cuBLAS's own
   * workspace are not counted), next to the device arena taken. */
  struct rtp_mem_report r;
  rtp_mem_report_get(b->ctx, &r);
  printf(
      "{\"bench\":\"gpu_step\",\"impl\":\"rtp\",\"device\":\"%s\",\"backend\":\"%s\","
      "\"device_name\":\"%s\",\"config\":\"%s\",\"precision\":\"%s\",\"batch\":%d,"
      "\"seq_len\":%d,\"d_model\":%d,\"n_layer\":%d,\"n_head\":%d,\"vocab\":%d,\"tied\":%s,"
      "\"params\":%lld,\"warmup\":%d,\"steps\":%d,\"ms_median\":%.3f,\"ms_ci95\":[%.3f,%.3f],"
      "\"ms_min\":%.3f,\"tokens_per_s\":%.1f,\"flops_per_step\":%.0f,\"tflops\":%.4g,"
      "\"peak_tflops\":%s,\"mfu\":%s,\"peak_mem_bytes\":%zu,\"device_reserved_bytes\":%zu,"
      "\"loss_first\":%.4f,\"loss_last\":%.4f}\n",
      o->device, rtp_backend_name(b->be), name, o->config, o->bf16 ? "bf16" : "f32", o->batch,
      c.seq_len, c.d_model, c.n_layer, c.n_head, c.vocab, c.tie_embeddings ? "true" : "false",
      (long long)gpt_n_params(c), o->warmup, o->steps, med * 1e3, lo * 1e3, hi * 1e3, min * 1e3,
      tokens / med, flops, flops / med * 1e-12, peak_s, mfu, r.total - r.metadata, b->data_size,
      (double)loss0, (double)loss1);
  fflush(stdout);
}

int main(int argc, char **argv) {
  struct options o;
  struct gpt_config c;
  int rc = parse(argc, argv, &o);
  if (!rc) rc = resolve(&o, &c);
  if (rc) return rc;
  struct bench b = {0};
  double *t = malloc((size_t)o.steps * sizeof(double));
  rc = t ? bench_new(&b, &o, c) : fail("the timings");
  float loss0 = NAN;
  for (int s = 0; !rc && s < o.warmup + o.steps; s++) {
    double dt = step(&b);
    if (s == 0) loss0 = loss_of(&b);
    if (dt < 0) rc = 1;
    if (s >= o.warmup) t[s - o.warmup] = dt;
  }
  float loss1 = rc ? NAN : loss_of(&b);
  if (!rc && !(isfinite(loss0) && isfinite(loss1))) {
    fprintf(stderr, "bench-gpu: the loss is not finite (%g, then %g)\n", (double)loss0,
            (double)loss1);
    rc = 1;
  }
  if (!rc) report(&o, c, &b, t, loss0, loss1);
  free(t);
  bench_free(&b);
  return rc;
}
