/*
 * rtp-plan - which strategy and layout to train a model with, before running anything:
 *
 *   rtp-plan --config medium --n-layer 24 -n 4 --nnodes 2 --mem-per-rank 4G --link 1gbit
 *
 * For each layout of the job's ranks (one process; ddp, fsdp, rtp, and tp where the heads
 * split; pipelines of S stages with rtp or fsdp inside each, for every S that divides the
 * ranks) it prints what one rank holds (model states, the communication pool, activations,
 * the rest), its predicted peak resident memory, the bytes it sends per step, and an
 * estimated step time; it marks what does not fit --mem-per-rank and recommends the
 * layout that trains the most tokens a second among those that fit.
 *
 * Memory is not estimated: every layout's rank is built dry by the library, exactly as
 * train-gpt builds it (tools/plan-model.c), so the figures are its memory report
 * (tests/test-plan.cpp checks them against ranks that train). The step time is an estimate:
 * the rank's blocks, the rest of its model and its Adam update at the costs that short
 * one-process steps of the model at the real shapes take on this machine (or its FLOPs
 * over --flops), the bytes it sends over the link, overlapped as the strategy overlaps
 * them. docs/planner.md explains each column.
 */
#include <ctype.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <poll.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "plan-model.h"

#define EXIT_USAGE 2
#define MAX_LAYOUTS 160
#define NUM 32 /* a formatted number */

struct opts {
  struct plan_model pm;
  int per_host, hosts, threads;
  double mem_per_rank, link, local_link, flops; /* bytes, bytes/s, bytes/s, FLOP/s */
  bool json;
  bool unfused_attn; /* --fused-attn off (train-gpt's default is on) */
};

/* One layout's prediction, for its busiest stage. */
struct row {
  struct plan_layout l;
  char name[48];
  struct rtp_mem_report mem;
  double peak, sent, sync_sent, compute_s, comm_s, step_s, tokens, tokens_per_s;
  bool fits, overlap;
};

static int usage(const char *fmt, const char *arg) {
  fprintf(stderr, "rtp-plan: ");
  fprintf(stderr, fmt, arg);
  fprintf(stderr, " (rtp-plan --help)\n");
  return EXIT_USAGE;
}

static void help(void) {
  printf(
      "usage: rtp-plan [model flags] [-n RANKS] [--nnodes HOSTS] [--mem-per-rank SIZE]\n"
      "                [--link SPEED] [--local-link SPEED] [--flops RATE] [--threads N] "
      "[--json]\n\n"
      "model flags, as train-gpt's: --config tiny|small|medium, --n-layer N, --d-model N,\n"
      "  --n-head N, --seq-len T, --vocab N, --batch B (per data-parallel rank),\n"
      "  --micro-batches M, --grad-accum K, --recompute, --adam-in-backward, --bf16,\n"
      "  --tie-embeddings, --fused-attn on|off, --schedule gpipe|1f1b|eager-1f1b|zeropp\n"
      "job: -n RANKS per host and --nnodes HOSTS, as rtp-run's (default 1 and 1)\n"
      "  --mem-per-rank SIZE  memory of each rank: 2G, 512M, 1.5GiB or bytes (default: none)\n"
      "  --link SPEED         each host's network, each way: 1gbit, 100mbit, 25gbit or "
      "bytes/s\n"
      "                       (default 1gbit)\n"
      "  --local-link SPEED   between ranks on one host (default 20gbit)\n"
      "  --flops RATE         FLOP/s of one rank (default: one-process steps measure the "
      "costs)\n"
      "  --threads N          the calibration's threads (default: the cores / -n)\n"
      "  --json               one JSON line per layout, then the recommendation\n");
}

/* "2G", "1.5GiB", "512M", "4096": binary units. */
static int parse_size(const char *s, double *out) {
  char *end;
  double v = strtod(s, &end);
  double unit = 1;
  switch (toupper((unsigned char)*end)) {
    case 'K':
      unit = 1024.0, end++;
      break;
    case 'M':
      unit = 1048576.0, end++;
      break;
    case 'G':
      unit = 1073741824.0, end++;
      break;
    case 'T':
      unit = 1099511627776.0, end++;
      break;
  }
  if (*end == 'i' || *end == 'I') end++;
  if (*end == 'B' || *end == 'b') end++;
  if (end == s || *end || !(v > 0) || !isfinite(v)) return -1;
  *out = v * unit;
  return 0;
}

/* "1gbit", "100mbit", "125000000" (bytes/s): decimal units, as links are sold. */
static int parse_rate(const char *s, double *out) {
  char *end;
  double v = strtod(s, &end);
  static const struct {
    const char *suffix;
    double bytes;
  } units[] = {{"", 1}, {"kbit", 1e3 / 8}, {"mbit", 1e6 / 8}, {"gbit", 1e9 / 8}};
  if (end == s || !(v > 0) || !isfinite(v)) return -1;
  for (size_t i = 0; i < sizeof(units) / sizeof(units[0]); i++)
    if (!strcasecmp(end, units[i].suffix)) {
      *out = v * units[i].bytes;
      return 0;
    }
  return -1;
}

static int parse_number(const char *s, double *out) {
  char *end;
  double v = strtod(s, &end);
  if (end == s || *end || !(v > 0) || !isfinite(v)) return -1;
  *out = v;
  return 0;
}

static int parse_int(const char *s, int lo, int hi, int *out) {
  char *end;
  long v = strtol(s, &end, 10);
  if (end == s || *end || v < lo || v > hi) return -1;
  *out = (int)v;
  return 0;
}

static int set_config(struct opts *o, const char *v) {
  if (!strcmp(v, "tiny"))
    o->pm.cfg = (struct gpt_config){256, 32, 64, 2, 4, false, false}; /* train-gpt's */
  else if (!strcmp(v, "small"))
    o->pm.cfg = gpt_config_small();
  else if (!strcmp(v, "medium"))
    o->pm.cfg = gpt_config_medium();
  else
    return usage("--config must be tiny, small or medium, not '%s'", v);
  return 0;
}

/* A flag that takes an integer: where it goes and its range. */
static int *int_flag(struct opts *o, const char *a, int *lo, int *hi) {
  static const struct {
    const char *name;
    int lo, hi;
  } f[] = {{"--n-layer", 1, GPT_MAX_LAYERS},
           {"--d-model", 1, GPT_MAX_SIZE},
           {"--n-head", 1, GPT_MAX_SIZE},
           {"--seq-len", 1, GPT_MAX_SIZE},
           {"--vocab", 1, GPT_MAX_SIZE},
           {"--batch", 1, 1 << 20},
           {"--micro-batches", 1, 1 << 16},
           {"--grad-accum", 1, 1 << 20},
           {"-n", 1, 65536},
           {"--nnodes", 1, 65536},
           {"--threads", 1, 1024}};
  int *dst[] = {
      &o->pm.cfg.n_layer, &o->pm.cfg.d_model, &o->pm.cfg.n_head,    &o->pm.cfg.seq_len,
      &o->pm.cfg.vocab,   &o->pm.batch,       &o->pm.micro_batches, &o->pm.accumulate,
      &o->per_host,       &o->hosts,          &o->threads};
  for (size_t i = 0; i < sizeof(f) / sizeof(f[0]); i++)
    if (!strcmp(a, f[i].name)) {
      *lo = f[i].lo, *hi = f[i].hi;
      return dst[i];
    }
  return NULL;
}

/* A flag with a value other than an integer. */
static int value_flag(struct opts *o, const char *a, const char *v) {
  if (!strcmp(a, "--config")) return set_config(o, v);
  if (!strcmp(a, "--fused-attn")) {
    if (strcmp(v, "on") && strcmp(v, "off"))
      return usage("--fused-attn: on or off, not '%s'", v);
    o->unfused_attn = !strcmp(v, "off");
    return 0;
  }
  if (!strcmp(a, "--schedule"))
    return rtp_schedule_parse(v, &o->pm.schedule)
               ? usage("--schedule must be gpipe, 1f1b, eager-1f1b or zeropp, not '%s'", v)
               : 0;
  if (!strcmp(a, "--mem-per-rank"))
    return parse_size(v, &o->mem_per_rank) ? usage(
                                                 "--mem-per-rank: '%s' is not a size "
                                                 "(2G, 512M, 1.5GiB or bytes)",
                                                 v)
                                           : 0;
  double *rate = !strcmp(a, "--link")         ? &o->link
                 : !strcmp(a, "--local-link") ? &o->local_link
                 : !strcmp(a, "--flops")      ? &o->flops
                                              : NULL;
  if (!rate) return usage("unknown option '%s'", a);
  if (rate == &o->flops ? parse_number(v, rate) : parse_rate(v, rate))
    return usage(rate == &o->flops
                     ? "--flops: '%s' is not a rate (e.g. 5e10)"
                     : "the link: '%s' is not a speed (1gbit, 100mbit or bytes/s)",
                 v);
  return 0;
}

static int parse_args(struct opts *o, int argc, char **argv) {
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
      help();
      exit(0);
    }
    bool *on = !strcmp(a, "--json")               ? &o->json
               : !strcmp(a, "--recompute")        ? &o->pm.recompute
               : !strcmp(a, "--adam-in-backward") ? &o->pm.adam_in_backward
               : !strcmp(a, "--bf16")             ? &o->pm.bf16
               : !strcmp(a, "--tie-embeddings")   ? &o->pm.cfg.tie_embeddings
                                                  : NULL;
    if (on) {
      *on = true;
      continue;
    }
    if (!strcmp(a, "--stages")) /* train-gpt's; enumerating such layouts is not done */
      return usage(
          "%s: pipelines of stages of different sizes or strategies are not planned "
          "yet (rtp-plan plans S x D meshes)",
          a);
    if (i + 1 == argc) return usage("%s needs a value", a);
    const char *v = argv[++i];
    int lo, hi, *dst = int_flag(o, a, &lo, &hi);
    if (dst && parse_int(v, lo, hi, dst)) {
      fprintf(stderr, "rtp-plan: %s must be an integer in %d..%d, not '%s' (rtp-plan --help)\n",
              a, lo, hi, v);
      return EXIT_USAGE;
    }
    if (!dst && value_flag(o, a, v)) return EXIT_USAGE;
  }
  o->pm.cfg.fused_attention = !o->unfused_attn; /* after --config, which sets cfg whole */
  if (o->pm.cfg.d_model % o->pm.cfg.n_head)
    return usage("%s: --n-head must divide --d-model", "the model");
  if (o->pm.batch % o->pm.micro_batches)
    return usage("%s: --micro-batches must divide --batch", "the model");
  if (o->pm.adam_in_backward && (o->pm.micro_batches > 1 || o->pm.accumulate > 1))
    return usage("%s: not with --micro-batches or --grad-accum", "--adam-in-backward");
  return 0;
}

/* ---- the layouts ------------------------------------------------------------------ */

static int add_layout(struct row *rows, int n, enum rtp_strategy s, int ranks, int stages) {
  if (n == MAX_LAYOUTS) return n;
  struct row *r = &rows[n];
  memset(r, 0, sizeof(*r));
  r->l = (struct plan_layout){s, ranks, stages};
  int d = ranks / stages;
  if (ranks == 1)
    snprintf(r->name, sizeof(r->name), "one process");
  else if (stages == 1)
    snprintf(r->name, sizeof(r->name), "%s", rtp_strategy_name(s));
  else if (d == 1)
    snprintf(r->name, sizeof(r->name), "pp %d", stages);
  else
    snprintf(r->name, sizeof(r->name), "pp %d x %s %d", stages, rtp_strategy_name(s), d);
  return n + 1;
}

/* Every layout train-gpt can run on `ranks` ranks (one process first, for comparison). */
static int layouts(const struct opts *o, int ranks, struct row *rows) {
  int n = add_layout(rows, 0, RTP_STRATEGY_NONE, 1, 1);
  if (ranks == 1) return n;
  if (o->pm.adam_in_backward) { /* what train-gpt runs it with */
    n = add_layout(rows, n, RTP_STRATEGY_FSDP, ranks, 1);
    return add_layout(rows, n, RTP_STRATEGY_RTP, ranks, 1);
  }
  n = add_layout(rows, n, RTP_STRATEGY_DDP, ranks, 1);
  n = add_layout(rows, n, RTP_STRATEGY_FSDP, ranks, 1);
  n = add_layout(rows, n, RTP_STRATEGY_RTP, ranks, 1);
  if (o->pm.cfg.n_head % ranks == 0) n = add_layout(rows, n, RTP_STRATEGY_TP, ranks, 1);
  /* train-gpt refuses pipelines of a tied model (the two uses sit on different stages) */
  for (int s = 2; s <= ranks && s <= o->pm.cfg.n_layer && !o->pm.cfg.tie_embeddings; s++) {
    if (ranks % s) continue;
    if (s == ranks) {
      n = add_layout(rows, n, RTP_STRATEGY_NONE, ranks, s);
      continue;
    }
    n = add_layout(rows, n, RTP_STRATEGY_RTP, ranks, s);
    n = add_layout(rows, n, RTP_STRATEGY_FSDP, ranks, s);
  }
  return n;
}

/* ---- memory: each stage's first rank, built dry ------------------------------------- */

static size_t proc_rss(void) {
  FILE *f = fopen("/proc/self/status", "r");
  char line[256];
  size_t kb = 0;
  while (f && fgets(line, sizeof(line), f))
    if (!strncmp(line, "VmRSS:", 6)) kb = strtoull(line + 6, NULL, 10);
  if (f) fclose(f);
  return kb * 1024;
}

/* The busiest stage's memory and bytes; 0, or -1 with rtp_last_error. */
static int predict_memory(const struct opts *o, struct row *r, size_t baseline) {
  int per_stage = r->l.ranks / r->l.stages;
  for (int s = 0; s < r->l.stages; s++) {
    struct plan_rank pr;
    int rc = plan_rank_build(&pr, &o->pm, &r->l, s * per_stage, true, NULL, NULL);
    if (rc) {
      plan_rank_free(&pr);
      return -1;
    }
    struct rtp_mem_report m;
    rtp_mem_report_get(pr.ctx, &m);
    double peak = (double)(baseline + m.total + plan_rss_overhead(&pr));
    if (peak > r->peak) r->peak = peak, r->mem = m;
    double sent = plan_bytes_sent(&pr);
    if (sent > r->sent) r->sent = sent, r->sync_sent = plan_sync_bytes(&pr);
    plan_rank_free(&pr);
  }
  r->fits = o->mem_per_rank <= 0 || r->peak <= o->mem_per_rank;
  return 0;
}

/* ---- time: FLOPs over the measured rate, bytes over the link -------------------------- */

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* What a rank's compute costs on this machine: seconds per token of one block's forward and
 * backward (with recomputation's second forward when asked), per token of the rest of the
 * model (embeddings, head, loss), and per parameter of Adam's update. */
struct rates {
  double block_s, rest_s, adam_s;
  struct gpt_config cal; /* the calibration's model (n_layer 0: --flops gave the rate) */
  int cal_batch;
  int copies;   /* processes that stepped at once (0: one) */
  double flops; /* what the calibration's larger model reached, FLOP/s */
};

#define CAL_WARMUP 2
#define CAL_STEPS 11

/* One step of r (compute, then Adam), its two times added to t[0] and t[1]. */
static int time_step(struct plan_rank *r, struct rtp_threadpool *tp, double t[2]) {
  double t0 = now_s();
  int rc = rtp_graph_compute(r->train, tp);
  double t1 = now_s();
  if (!rc) rc = rtp_optimizer_step(r->opt, tp);
  t[0] = t1 - t0, t[1] = now_s() - t1;
  return rc;
}

/* Whether the calibrating parent closed its end of `fd` (poll says it reads EOF). */
static bool stopped(int fd) {
  struct pollfd p = {.fd = fd, .events = POLLIN};
  return poll(&p, 1, 0) != 0;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static double median(double *v, int n) {
  qsort(v, (size_t)n, sizeof(double), cmp_double);
  return v[n / 2];
}

/* The compute and Adam times of one-process steps of c with 1 and 3 blocks at batch b
 * (times[k] for 2k + 1 blocks): the medians of CAL_STEPS after CAL_WARMUP, as a run's step
 * time is its steps' median, the two models' steps taken in turn so that a moment's load
 * from other work, or a core that has not reached its clock yet, slows neither alone.
 * With stop_fd >= 0 it is a copy that only loads the host as another rank would, stepping
 * until stop_fd reads EOF. 0, or a status with rtp_last_error. */
static int time_models(const struct opts *o, struct gpt_config c, int b, int stop_fd,
                       double times[2][2]) {
  struct plan_rank r[2] = {{0}};
  struct rtp_threadpool *tp = rtp_threadpool_new(o->threads);
  int rc = tp ? RTP_OK : RTP_ENOMEM;
  for (int k = 0; k < 2 && !rc; k++) {
    struct plan_model pm = {.cfg = c,
                            .batch = b,
                            .micro_batches = 1,
                            .bf16 = o->pm.bf16,
                            .recompute = o->pm.recompute};
    pm.cfg.n_layer = 2 * k + 1;
    struct plan_layout l = {RTP_STRATEGY_NONE, 1, 1};
    rc = plan_rank_build(&r[k], &pm, &l, 0, false, NULL, NULL);
    for (int i = 0; i < r[k].m.n_params && !rc; i++)
      rc = rtp_tensor_fill_f32(rtp_parallel_tensor(r[k].par, r[k].m.params[i]), 0.01f);
  }
  double t[2][2][CAL_STEPS];
  for (int s = 0; (stop_fd >= 0 ? !stopped(stop_fd) : s < CAL_WARMUP + CAL_STEPS) && !rc; s++)
    for (int k = 0; k < 2 && !rc; k++) {
      double ts[2];
      rc = time_step(&r[k], tp, ts);
      if (s >= CAL_WARMUP && stop_fd < 0)
        t[k][0][s - CAL_WARMUP] = ts[0], t[k][1][s - CAL_WARMUP] = ts[1];
    }
  for (int k = 0; k < 2; k++) plan_rank_free(&r[k]);
  rtp_threadpool_free(tp);
  for (int k = 0; k < 2 && !rc && stop_fd < 0; k++)
    times[k][0] = median(t[k][0], CAL_STEPS), times[k][1] = median(t[k][1], CAL_STEPS);
  return rc;
}

/* Times one-process steps of the model with 1 and 3 blocks at the micro-batch's shape (the
 * batch, then the sequence, halved while the larger step is over 16 GFLOP): their
 * difference is two blocks, the rest is the rest. The products then have the shapes of the
 * real step's, and the ops that FLOPs leave out (LayerNorm, softmax, GELU, the loss) are
 * in the times. */
static int calibrate(const struct opts *o, int stop_fd, struct rates *k) {
  struct gpt_config c = o->pm.cfg;
  int b = o->pm.batch / o->pm.micro_batches;
  c.n_layer = 3;
  while (gpt_step_flops(c, b) > 16e9 && (b > 1 || c.seq_len > 16))
    b > 1 ? (b /= 2) : (c.seq_len /= 2);
  double t[2][2], tokens = (double)c.seq_len * b;
  int rc = time_models(o, c, b, stop_fd, t);
  if (rc) return rc;
  k->cal = c, k->cal_batch = b;
  k->flops = gpt_step_flops(c, b) * (o->pm.recompute ? 4.0 / 3 : 1) / t[1][0];
  k->block_s = fmax(t[1][0] - t[0][0], 0) / (2 * tokens);
  k->rest_s = fmax(t[0][0] / tokens - k->block_s, 0);
  k->adam_s = t[1][1] / (double)gpt_n_params(c);
  return RTP_OK;
}

/* The calibration while `copies` (>= 2) processes step at once, the others forked copies that
 * load the host as its other ranks would: ranks of one host share its caches and memory
 * bandwidth (2 ranks on this 2-core machine each ran 20 to 25% slower than one process
 * alone; docs/planner.md). */
static int calibrate_shared(const struct opts *o, int copies, struct rates *k) {
  int fds[2];
  pid_t kids[64];
  int n = 0;
  if (copies > 64) copies = 64;
  if (pipe(fds)) return calibrate(o, -1, k);
  for (int i = 1; i < copies; i++) {
    pid_t pid = fork();
    if (pid == 0) {
      close(fds[1]);
      struct rates x;
      _exit(calibrate(o, fds[0], &x) ? 1 : 0);
    }
    if (pid > 0) kids[n++] = pid;
  }
  close(fds[0]);
  int rc = calibrate(o, -1, k);
  close(fds[1]); /* the copies read EOF and stop */
  for (int i = 0; i < n; i++) waitpid(kids[i], NULL, 0);
  return rc;
}

/* The same costs from a FLOP rate alone: the blocks' and the head's FLOPs over it. */
static void rates_from_flops(const struct opts *o, struct rates *k) {
  struct gpt_config c = o->pm.cfg;
  double tokens = (double)c.seq_len * o->pm.batch;
  double all = gpt_step_flops(c, o->pm.batch), head = 6.0 * c.vocab * c.d_model * tokens;
  double blocks = (all - head) * (o->pm.recompute ? 4.0 / 3 : 1);
  *k = (struct rates){.block_s = blocks / c.n_layer / tokens / o->flops,
                      .rest_s = head / tokens / o->flops,
                      .flops = o->flops};
}

/* The busiest rank's compute for one compute of the graph: tp splits the blocks between
 * the ranks, a pipeline between the stages (the head on the last one), which also idle
 * (S - 1) / M of the step (1F1B's bubble). */
static double rank_compute_s(const struct opts *o, const struct plan_layout *l,
                             const struct rates *k) {
  double tokens = (double)o->pm.cfg.seq_len * o->pm.batch;
  double blocks = o->pm.cfg.n_layer * k->block_s;
  if (l->strategy == RTP_STRATEGY_TP) return tokens * (blocks / l->ranks + k->rest_s);
  double m = o->pm.micro_batches;
  return tokens * (blocks / l->stages + k->rest_s) * (m + l->stages - 1) / m;
}

/* Ranks of one host that share its cores: each gets cores / (ranks x threads) of them. */
static double oversubscription(const struct opts *o, const struct plan_layout *l) {
  long cores = sysconf(_SC_NPROCESSORS_ONLN);
  double busy = (double)(l->ranks < o->per_host ? l->ranks : o->per_host) * o->threads;
  return cores > 0 && busy > (double)cores ? busy / (double)cores : 1;
}

/* k[0]: one process's costs, k[1]: those of a host's ranks running at once. */
static void predict_time(const struct opts *o, const struct rates k[2], struct row *r) {
  struct gpt_config c = o->pm.cfg;
  const struct rates *rk = &k[r->l.ranks > 1 && o->per_host > 1];
  bool one_host = o->hosts == 1 || r->l.ranks == 1;
  double bw = one_host || o->local_link < o->link ? o->local_link : o->link;
  int acc = o->pm.accumulate > 1 ? o->pm.accumulate : 1;
  double params = (double)r->mem.bytes[RTP_ROLE_PARAM] / sizeof(float);
  r->compute_s =
      (acc * rank_compute_s(o, &r->l, rk) + params * rk->adam_s) * oversubscription(o, &r->l);
  r->comm_s = r->sent / bw;
  /* tp's all-reduces wait for the activations they sum; the others' transfers run during
   * the compute (ddp's buckets, fsdp's prefetched gathers, rtp's rotations, the stages),
   * except the reductions that --grad-accum leaves for after the step's last compute. */
  r->overlap = r->l.strategy != RTP_STRATEGY_TP;
  double sync_s = r->sync_sent / bw;
  r->step_s =
      r->overlap ? fmax(r->compute_s, r->comm_s - sync_s) + sync_s : r->compute_s + r->comm_s;
  int data_ranks = r->l.strategy == RTP_STRATEGY_TP ? 1 : r->l.ranks / r->l.stages;
  r->tokens = (double)c.seq_len * o->pm.batch * data_ranks * acc;
  r->tokens_per_s = r->tokens / r->step_s;
}

/* ---- output ------------------------------------------------------------------------- */

static const char *mib(double bytes, char *buf) {
  if (bytes >= 1024.0 * 1048576)
    snprintf(buf, NUM, "%.2fG", bytes / (1024.0 * 1048576));
  else
    snprintf(buf, NUM, "%.1fM", bytes / 1048576);
  return buf;
}

/* A link in the units it is sold in. */
static const char *bits(double bytes_per_s, char *buf) {
  double b = 8 * bytes_per_s;
  if (b >= 1e9)
    snprintf(buf, NUM, "%.3g Gbit/s", b / 1e9);
  else
    snprintf(buf, NUM, "%.3g Mbit/s", b / 1e6);
  return buf;
}

static size_t states(const struct rtp_mem_report *m) {
  return m->bytes[RTP_ROLE_PARAM] + m->bytes[RTP_ROLE_GRAD] + m->bytes[RTP_ROLE_OPTIM];
}

/* The fastest layout on the job's ranks that fits, ties (within 1%) to less memory. */
static int recommend(const struct row *rows, int n, int ranks) {
  int best = -1;
  for (int i = 0; i < n; i++) {
    if (!rows[i].fits || (rows[i].l.ranks != ranks && ranks > 1)) continue;
    if (best < 0) {
      best = i;
      continue;
    }
    double a = rows[i].tokens_per_s, b = rows[best].tokens_per_s;
    if (a > 1.01 * b || (a >= 0.99 * b && rows[i].peak < rows[best].peak)) best = i;
  }
  return best;
}

static void print_header(const struct opts *o, int ranks, const struct rates k[2],
                         size_t baseline) {
  struct gpt_config c = o->pm.cfg;
  char a[NUM], b[NUM], m[NUM], accum[48] = "";
  if (o->pm.accumulate > 1)
    snprintf(accum, sizeof(accum), ", x %d accumulated", o->pm.accumulate);
  printf(
      "model: %.1fM parameters (L %d, d %d, H %d, T %d, V %d), batch %d per rank in %d "
      "micro-batch%s%s%s%s%s\n",
      gpt_n_params(c) / 1e6, c.n_layer, c.d_model, c.n_head, c.seq_len, c.vocab, o->pm.batch,
      o->pm.micro_batches, o->pm.micro_batches > 1 ? "es" : "", accum,
      o->pm.recompute ? ", recompute" : "", o->pm.bf16 ? ", bf16" : "",
      o->pm.adam_in_backward ? ", Adam in backward" : "");
  printf("job: %d rank%s (%d host%s x %d), memory %s per rank, link %s (on a host %s)\n", ranks,
         ranks > 1 ? "s" : "", o->hosts, o->hosts > 1 ? "s" : "", o->per_host,
         o->mem_per_rank > 0 ? mib(o->mem_per_rank, m) : "unlimited", bits(o->link, a),
         bits(o->local_link, b));
  if (!k[0].cal.n_layer)
    printf("compute: %.1f GFLOP/s per rank (--flops)\n", o->flops / 1e9);
  else
    printf(
        "compute: a block %.1f us and the rest %.1f us a token, Adam %.2f ns a parameter "
        "(%.1f GFLOP/s; measured on %d thread%s, L 1 and %d, T %d, batch %d)\n",
        k[0].block_s * 1e6, k[0].rest_s * 1e6, k[0].adam_s * 1e9, k[0].flops / 1e9, o->threads,
        o->threads > 1 ? "s" : "", k[0].cal.n_layer, k[0].cal.seq_len, k[0].cal_batch);
  if (k[1].copies)
    printf(
        "  with %d ranks at once: a block %.1f us and the rest %.1f us a token, Adam %.2f "
        "ns a parameter\n",
        k[1].copies, k[1].block_s * 1e6, k[1].rest_s * 1e6, k[1].adam_s * 1e9);
  printf(
      "peak = the rank's arena (states + pool + activations + the rest) + %s of process "
      "and runtime\n\n",
      mib((double)baseline + plan_runtime_bytes(), a));
  printf("%-18s %9s %9s %9s %9s %9s  %-4s %10s %9s %9s %9s %10s\n", "layout", "states", "pool",
         "activ.", "rest", "peak", "fits", "sent/step", "compute", "comm", "step", "tokens/s");
}

static void print_row(const struct row *r, bool best) {
  char s[NUM], p[NUM], a[NUM], x[NUM], k[NUM], t[NUM];
  const struct rtp_mem_report *m = &r->mem;
  double rest =
      r->peak - (double)states(m) - m->bytes[RTP_ROLE_COMM] - m->bytes[RTP_ROLE_ACTIVATION];
  printf("%-18s %9s %9s %9s %9s %9s  %-4s %10s %8.0fms %8.0fms %8.0fms%s %10.0f%s\n", r->name,
         mib((double)states(m), s), mib((double)m->bytes[RTP_ROLE_COMM], p),
         mib((double)m->bytes[RTP_ROLE_ACTIVATION], a), mib(rest, x), mib(r->peak, k),
         r->fits ? "yes" : "NO", mib(r->sent, t), r->compute_s * 1e3, r->comm_s * 1e3,
         r->step_s * 1e3, r->overlap ? " " : "+", r->tokens_per_s,
         best ? "  <- recommended" : "");
}

static void print_json(const struct row *r, bool best) {
  const struct rtp_mem_report *m = &r->mem;
  printf(
      "{\"layout\":\"%s\",\"strategy\":\"%s\",\"ranks\":%d,\"stages\":%d,\"params\":%zu,"
      "\"grads\":%zu,\"optim\":%zu,\"model_states\":%zu,\"comm\":%zu,\"activations\":%zu,"
      "\"work\":%zu,\"metadata\":%zu,\"arena_total\":%zu,\"peak_rss\":%.0f,\"fits\":%s,"
      "\"bytes_sent_per_step\":%.0f,\"compute_s\":%.6f,\"comm_s\":%.6f,\"step_s\":%.6f,"
      "\"overlap\":%s,\"tokens_per_step\":%.0f,\"tokens_per_s\":%.1f,\"recommended\":%s}\n",
      r->name, rtp_strategy_name(r->l.strategy), r->l.ranks, r->l.stages,
      m->bytes[RTP_ROLE_PARAM], m->bytes[RTP_ROLE_GRAD], m->bytes[RTP_ROLE_OPTIM], states(m),
      m->bytes[RTP_ROLE_COMM], m->bytes[RTP_ROLE_ACTIVATION], m->work, m->metadata, m->total,
      r->peak, r->fits ? "true" : "false", r->sent, r->compute_s, r->comm_s, r->step_s,
      r->overlap ? "true" : "false", r->tokens, r->tokens_per_s, best ? "true" : "false");
}

static void print_verdict(const struct opts *o, const struct row *rows, int n, int best) {
  if (o->json) {
    printf("{\"recommended\":%s%s%s}\n", best < 0 ? "" : "\"",
           best < 0 ? "null" : rows[best].name, best < 0 ? "" : "\"");
    return;
  }
  printf("\n(+: tp's transfers wait for its compute; the others overlap them)\n");
  if (best >= 0) {
    printf("recommended: %s\n", rows[best].name);
    return;
  }
  double least = rows[0].peak;
  for (int i = 1; i < n; i++) least = fmin(least, rows[i].peak);
  char a[NUM];
  printf(
      "nothing fits: the smallest layout needs %s per rank (try --recompute, more ranks, "
      "or a smaller --batch)\n",
      mib(least, a));
}

int main(int argc, char **argv) {
  size_t baseline = proc_rss(); /* what a rank's process holds before it builds, about */
  struct opts o = {
      .pm = {.batch = 8, .micro_batches = 1, .accumulate = 1, .schedule = RTP_SCHEDULE_1F1B},
      .per_host = 1,
      .hosts = 1,
      .link = 1e9 / 8,
      .local_link = 20e9 / 8};
  o.pm.cfg = gpt_config_small();
  int rc = parse_args(&o, argc, argv);
  if (rc) return rc;
  int ranks = o.per_host * o.hosts;
  if (o.threads == 0) {
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    o.threads = cores > o.per_host ? (int)(cores / o.per_host) : 1;
  }
  static struct row rows[MAX_LAYOUTS];
  int n = layouts(&o, ranks, rows);
  char why[256];
  for (int i = 0; i < n; i++)
    if (plan_check(&o.pm, &rows[i].l, why, sizeof(why))) return usage("%s", why);
  for (int i = 0; i < n; i++)
    if (predict_memory(&o, &rows[i], baseline)) {
      fprintf(stderr, "rtp-plan: %s: %s\n", rows[i].name, rtp_last_error());
      return 1;
    }
  struct rates k[2] = {{0}}; /* one process alone; the ranks of a host at once */
  long cores = sysconf(_SC_NPROCESSORS_ONLN);
  int copies = o.per_host < cores / o.threads ? o.per_host : (int)(cores / o.threads);
  if (o.flops > 0) {
    rates_from_flops(&o, &k[0]);
  } else if (calibrate(&o, -1, &k[0]) || (copies > 1 && calibrate_shared(&o, copies, &k[1]))) {
    fprintf(stderr, "rtp-plan: the calibration step failed: %s\n", rtp_last_error());
    return 1;
  }
  if (o.flops > 0 || copies < 2) k[1] = k[0]; /* no copies to step beside: the same costs */
  k[1].copies = o.flops > 0 || copies < 2 ? 0 : copies;
  for (int i = 0; i < n; i++) predict_time(&o, k, &rows[i]);
  int best = recommend(rows, n, ranks);
  if (!o.json) print_header(&o, ranks, k, baseline);
  for (int i = 0; i < n; i++)
    o.json ? print_json(&rows[i], i == best) : print_row(&rows[i], i == best);
  print_verdict(&o, rows, n, best);
  return 0;
}
