/* bench-pipeline: pipelines against the flat strategies, on the same job and global batch.
 *
 * Runs as one rank of a job (rtp-run, or scripts/bench-pipeline-netns.sh, which makes the
 * job 2 emulated hosts of 2 ranks each). For each layout of --layouts, in turn: "rtp",
 * "fsdp", "ddp" over all N ranks (one micro-batch), or "ppS-rtp", "ppS-fsdp", "ppS-ddp": S
 * stages of N/S ranks with that strategy inside (S = 1: the strategy alone, but with the
 * pipeline's micro-batches), --micro-batches M in --schedule's order (zeropp: in units of
 * --unit U; a layout "...@U" runs zeropp in units of U whatever --schedule says, so
 * units compare in one run: "pp1-rtp pp1-rtp@2").
 * Every layout trains on --global-batch sequences per step (each data-parallel rank its
 * share), so tokens/s compare. Rank 0 prints one JSON line per layout:
 *   tokens_per_s, step_ms (median) and steps_ms (all), over the whole job;
 *   bubble: the fraction of a step each rank's graph waited on the pipe (rtp_graph_timing
 *     _get on the pipe group: its stage's idle time), the median over steps of the mean
 *     over ranks, next to bubble_theory = (S - 1) / (M + S - 1), and other_waits, the
 *     fraction it waited on its other transfers (the strategy's, inside its stage);
 *   slow_link_bytes_per_step: what the hosts' NICs sent (RTP_BENCH_NIC, e.g. eth0 in a
 *     namespace, read from /sys by each host's first rank, RTP_LOCAL_RANK 0), summed over
 *     hosts; null without RTP_BENCH_NIC;
 *   peak_rss_max and peak_rss (every rank's VmHWM during the layout's steps);
 * then one "summary" line with the goals' ratios where their layouts ran.
 *
 *   rtp-run -n 4 -- bench-pipeline [--model tiny|small|medium] [--global-batch G]
 *       [--micro-batches M] [--schedule 1f1b] [--unit 1]
 *       [--layouts "rtp fsdp ddp pp2-rtp pp2-fsdp"]
 *       [--steps S] [--threads T] [--net LABEL]
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench-util.h"
#include "gpt.h"
#include "rtp.h"

#define MAX_LAYOUTS 8
#define MAX_STEPS 32

struct opts {
  struct gpt_config cfg;
  const char *model, *net, *schedule;
  int global_batch, micro, unit, steps, threads;
  char layouts[128];
};

struct layout {
  char name[16];
  enum rtp_strategy strategy;
  int stages;
  bool pipelined; /* "ppS-...": M micro-batches in the schedule's order (S may be 1) */
  int unit;       /* "...@U": zeropp in units of U, whatever --schedule says; else 0 */
};

struct result {
  double steps[MAX_STEPS], bubbles[MAX_STEPS], others[MAX_STEPS];
  int n;
  double nic_bytes; /* this host's NIC, over the timed steps; 0 on a host's other ranks */
  size_t peak;
};

static void die(const char *what) {
  fprintf(stderr, "bench-pipeline: %s: %s\n", what, rtp_last_error());
  exit(1);
}

/* Bytes this host's NIC has sent (RTP_BENCH_NIC), or -1 without one. */
static double nic_tx_bytes(void) {
  const char *nic = getenv("RTP_BENCH_NIC");
  if (!nic || !*nic) return -1;
  char path[256];
  snprintf(path, sizeof(path), "/sys/class/net/%s/statistics/tx_bytes", nic);
  FILE *f = fopen(path, "r");
  unsigned long long v = 0;
  if (!f || fscanf(f, "%llu", &v) != 1) die(path);
  fclose(f);
  return (double)v;
}

static bool host_leader(void) {
  const char *l = getenv("RTP_LOCAL_RANK");
  return !l || atoi(l) == 0;
}

/* One layout's run on this rank. */
struct run {
  struct rtp_comm *stage, *pipe; /* pipelines: the mesh's groups */
  struct rtp_context *meta, *ctx;
  struct rtp_parallel *par;
  struct rtp_graph *g;
  struct rtp_optimizer *opt;
};

static void fill_inputs(struct run *u, const struct gpt *m, int M) {
  for (int k = 0; k < M; k++) {
    struct rtp_tensor *idx = rtp_parallel_micro_tensor(u->par, m->idx, k);
    struct rtp_tensor *tgt = rtp_parallel_micro_tensor(u->par, m->targets, k);
    for (int64_t j = 0; idx && j < rtp_tensor_nelements(idx); j++)
      ((int32_t *)idx->data)[j] = (int32_t)((j * 31 + k) % 256);
    for (int64_t j = 0; tgt && j < rtp_tensor_nelements(tgt); j++)
      ((int32_t *)tgt->data)[j] = (int32_t)((j * 17 + 3 + k) % 256);
  }
}

static void run_setup(const struct opts *o, const struct layout *l, struct rtp_comm *job,
                      struct run *u) {
  memset(u, 0, sizeof(*u));
  int world = rtp_comm_size(job), D = world / l->stages, M = l->pipelined ? o->micro : 1;
  int B = o->global_batch / D;
  struct rtp_comm *group = job;
  if (l->stages > 1) {
    if (rtp_comm_mesh_2d(job, l->stages, D, &u->stage, &u->pipe)) die("mesh");
    group = D > 1 ? u->stage : NULL;
  }
  u->meta = rtp_context_new((struct rtp_init_params){.mem_size = 64 << 20, .no_alloc = true});
  struct gpt m;
  struct rtp_graph *fwd = u->meta ? rtp_graph_new(u->meta, 16384) : NULL;
  if (!fwd || gpt_build(u->meta, &m, o->cfg, B / M) || rtp_graph_build(fwd, m.loss))
    die("build");
  u->ctx = rtp_context_new((struct rtp_init_params){.mem_size = gpt_arena_size(o->cfg, B) +
                                                                (size_t)M * (64u << 20)});
  struct rtp_parallel_params pp = {.strategy = group ? l->strategy : RTP_STRATEGY_NONE,
                                   .comm = group,
                                   .micro_batches = M,
                                   .pipe_comm = u->pipe,
                                   .unit = l->unit ? l->unit : o->unit,
                                   .graph_size = 16384 * M};
  if (rtp_schedule_parse(l->unit ? "zeropp" : o->schedule, &pp.schedule)) die("--schedule");
  u->par = u->ctx ? rtp_parallel_new(u->ctx, fwd, m.loss, &pp) : NULL;
  if (!u->par) die(l->name);
  u->g = rtp_parallel_graph(u->par);
  if (rtp_graph_plan(u->ctx, u->g)) die("plan");
  u->opt = rtp_parallel_optimizer(u->par, rtp_adamw_params_default());
  if (!u->opt) die("optimizer");
  for (int i = 0; i < m.n_params; i++) { /* values do not matter for speed, only finiteness */
    struct rtp_tensor *t = rtp_parallel_tensor(u->par, m.params[i]);
    for (int64_t j = 0; t && j < rtp_tensor_nelements(t); j++)
      ((float *)t->data)[j] = 0.02f * (float)((j * 7919) % 101 - 50) / 50;
  }
  fill_inputs(u, &m, M);
}

static void run_free(struct run *u) {
  rtp_context_free(u->ctx);
  rtp_context_free(u->meta);
  rtp_comm_free(u->stage);
  rtp_comm_free(u->pipe);
}

/* A warm-up step, then the timed ones, every rank starting each together. */
static struct result run_layout(const struct opts *o, const struct layout *l,
                                struct rtp_comm *job, struct rtp_threadpool *tp) {
  struct result r = {.n = o->steps < MAX_STEPS ? o->steps : MAX_STEPS};
  struct run u;
  bench_reset_peak();
  run_setup(o, l, job, &u);
  double tx0 = 0;
  for (int s = -1; s < r.n; s++) {
    if (rtp_comm_barrier(job, NULL)) die("barrier");
    if (s == 0) tx0 = nic_tx_bytes();
    double t0 = bench_now_s();
    if (rtp_graph_compute(u.g, tp) || rtp_optimizer_step(u.opt, tp)) die("step");
    if (s < 0) continue;
    r.steps[s] = bench_now_s() - t0;
    struct rtp_graph_timing pipe, all;
    if (rtp_graph_timing_get(u.g, u.pipe, &pipe) || rtp_graph_timing_get(u.g, NULL, &all))
      die("timing");
    if (!u.pipe) pipe.wait_s = 0;
    r.bubbles[s] = all.wall_s > 0 ? pipe.wait_s / all.wall_s : 0;
    r.others[s] = all.wall_s > 0 ? (all.wait_s - pipe.wait_s) / all.wall_s : 0;
  }
  if (rtp_comm_barrier(job, NULL)) die("barrier");
  double tx1 = nic_tx_bytes();
  r.nic_bytes = tx0 >= 0 && host_leader() ? tx1 - tx0 : 0;
  r.peak = bench_proc_bytes("VmHWM:");
  run_free(&u);
  return r;
}

/* Every rank's bubbles, NIC bytes and peak, gathered; rank 0 prints. */
struct report {
  double step_s, bubble, other_waits, nic_per_step, peak_max, tokens_per_s;
  double peaks[64];
};

static struct report gather(const struct opts *o, struct rtp_comm *job,
                            const struct result *r) {
  int world = rtp_comm_size(job), rank = rtp_comm_rank(job);
  struct report rep = {.step_s = bench_median(r->steps, r->n)};
  /* per rank: bubbles and other waits of each step, NIC bytes, peak */
  size_t per = 2 * MAX_STEPS + 2, nic_at = 2 * MAX_STEPS, peak_at = nic_at + 1;
  float *all = calloc((size_t)world * per, sizeof(float));
  if (!all) die("out of memory");
  float *mine = all + (size_t)rank * per;
  for (int s = 0; s < r->n; s++) {
    mine[s] = (float)r->bubbles[s];
    mine[MAX_STEPS + s] = (float)r->others[s];
  }
  mine[nic_at] = (float)r->nic_bytes;
  mine[peak_at] = (float)r->peak;
  if (rtp_comm_allgather(job, all, (size_t)world, per * sizeof(float), NULL)) die("gather");
  double bubbles[MAX_STEPS] = {0}, others[MAX_STEPS] = {0}, nic = 0;
  for (int k = 0; k < world; k++) {
    const float *v = all + (size_t)k * per;
    for (int s = 0; s < r->n; s++) {
      bubbles[s] += v[s] / world;
      others[s] += v[MAX_STEPS + s] / world;
    }
    nic += v[nic_at];
    if (k < 64) rep.peaks[k] = v[peak_at];
    if (v[peak_at] > rep.peak_max) rep.peak_max = v[peak_at];
  }
  free(all);
  rep.bubble = bench_median(bubbles, r->n);
  rep.other_waits = bench_median(others, r->n);
  rep.nic_per_step = nic / r->n;
  rep.tokens_per_s = (double)o->global_batch * o->cfg.seq_len / rep.step_s;
  return rep;
}

static void print_layout(const struct opts *o, const struct layout *l, int world,
                         const struct result *r, const struct report *rep) {
  int M = l->pipelined ? o->micro : 1;
  char nic[32] = "null", steps[MAX_STEPS * 12] = "", peaks[64 * 16] = "";
  if (getenv("RTP_BENCH_NIC")) snprintf(nic, sizeof(nic), "%.0f", rep->nic_per_step);
  for (int s = 0, n = 0; s < r->n; s++)
    n += snprintf(steps + n, sizeof(steps) - (size_t)n, "%s%.1f", s ? "," : "",
                  r->steps[s] * 1e3);
  for (int k = 0, n = 0; k < world && k < 64; k++)
    n += snprintf(peaks + n, sizeof(peaks) - (size_t)n, "%s%.0f", k ? "," : "", rep->peaks[k]);
  printf(
      "{\"bench\":\"pipeline\",\"model\":\"%s\",\"net\":\"%s\",\"layout\":\"%s\","
      "\"stages\":%d,\"per_stage\":%d,\"strategy\":\"%s\",\"schedule\":\"%s\","
      "\"micro_batches\":%d,\"unit\":%d,\"global_batch\":%d,\"threads\":%d,\"step_ms\":%.1f,"
      "\"tokens_per_s\":%.1f,\"bubble\":%.4f,\"bubble_theory\":%.4f,\"other_waits\":%.4f,"
      "\"slow_link_bytes_per_step\":%s,\"peak_rss_max\":%.0f,\"peak_rss\":[%s],"
      "\"steps_ms\":[%s]}\n",
      o->model, o->net, l->name, l->stages, world / l->stages, rtp_strategy_name(l->strategy),
      !l->pipelined ? "none"
      : l->unit     ? "zeropp"
                    : o->schedule,
      M,
      l->unit        ? l->unit
      : l->pipelined ? o->unit
                     : 1,
      o->global_batch, o->threads, rep->step_s * 1e3, rep->tokens_per_s, rep->bubble,
      (double)(l->stages - 1) / (M + l->stages - 1), rep->other_waits, nic, rep->peak_max,
      peaks, steps);
  fflush(stdout);
}

/* The goals' ratios: pp2 x rtp (the first such layout) against the best flat layout's
 * tokens/s (one micro-batch, no stages), and its peak memory per rank against flat rtp's. */
static void print_summary(const struct opts *o, const struct layout *ls,
                          const struct report *reps, int n) {
  int pp = -1, rtp = -1, best = -1;
  for (int k = 0; k < n; k++) {
    bool flat = !ls[k].pipelined;
    if (pp < 0 && ls[k].stages == 2 && ls[k].strategy == RTP_STRATEGY_RTP) pp = k;
    if (flat && ls[k].strategy == RTP_STRATEGY_RTP) rtp = k;
    if (flat && (best < 0 || reps[k].tokens_per_s > reps[best].tokens_per_s)) best = k;
  }
  if (pp < 0 || best < 0) return;
  printf(
      "{\"bench\":\"pipeline\",\"summary\":true,\"model\":\"%s\",\"net\":\"%s\","
      "\"best_flat\":\"%s\",\"pp2_rtp_vs_best_flat_tokens\":%.3f",
      o->model, o->net, ls[best].name, reps[pp].tokens_per_s / reps[best].tokens_per_s);
  if (rtp >= 0)
    printf(",\"pp2_rtp_vs_flat_rtp_peak\":%.3f", reps[pp].peak_max / reps[rtp].peak_max);
  printf(",\"pp2_rtp_bubble\":%.4f,\"bubble_theory\":%.4f}\n", reps[pp].bubble,
         1.0 / (o->micro + 1));
  fflush(stdout);
}

static int parse_layouts(const struct opts *o, int world, struct layout *ls) {
  char buf[128];
  int n = 0;
  snprintf(buf, sizeof(buf), "%s", o->layouts);
  for (char *tok = strtok(buf, " ,"); tok; tok = strtok(NULL, " ,")) {
    if (n == MAX_LAYOUTS) return -1;
    struct layout *l = &ls[n++];
    snprintf(l->name, sizeof(l->name), "%s", tok);
    l->stages = 1;
    l->pipelined = !strncmp(tok, "pp", 2);
    char *at = strchr(tok, '@');
    l->unit = 0;
    if (at) { /* "...@U" */
      *at = '\0';
      l->unit = atoi(at + 1);
      if (!l->pipelined || l->unit < 1 || o->micro % l->unit) return -1;
    }
    const char *s = tok;
    if (!strncmp(tok, "pp", 2)) {
      char *end;
      l->stages = (int)strtol(tok + 2, &end, 10);
      if (*end != '-' || l->stages < 1 || world % l->stages) return -1;
      s = end + 1;
    }
    if (rtp_strategy_parse(s, &l->strategy) || l->strategy == RTP_STRATEGY_TP) return -1;
    if ((world / l->stages) > 0 && o->global_batch % (world / l->stages)) return -1;
    if (l->pipelined && (o->global_batch / (world / l->stages)) % o->micro) return -1;
  }
  return n;
}

static int parse_args(struct opts *o, int argc, char **argv) {
  for (int i = 1; i < argc; i += 2) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (!v) return -1;
    if (!strcmp(a, "--model")) {
      o->model = v;
      if (bench_model(v, &o->cfg)) return -1;
    } else if (!strcmp(a, "--global-batch"))
      o->global_batch = atoi(v);
    else if (!strcmp(a, "--micro-batches"))
      o->micro = atoi(v);
    else if (!strcmp(a, "--schedule"))
      o->schedule = v;
    else if (!strcmp(a, "--unit"))
      o->unit = atoi(v);
    else if (!strcmp(a, "--layouts"))
      snprintf(o->layouts, sizeof(o->layouts), "%s", v);
    else if (!strcmp(a, "--steps"))
      o->steps = atoi(v);
    else if (!strcmp(a, "--threads"))
      o->threads = atoi(v);
    else if (!strcmp(a, "--net"))
      o->net = v;
    else
      return -1;
  }
  enum rtp_schedule s;
  return o->global_batch < 1 || o->micro < 1 || o->unit < 1 || o->micro % o->unit ||
                 o->steps < 1 || o->threads < 1 || rtp_schedule_parse(o->schedule, &s)
             ? -1
             : 0;
}

int main(int argc, char **argv) {
  struct opts o = {.cfg = gpt_config_small(),
                   .model = "small",
                   .net = "env",
                   .schedule = "1f1b",
                   .global_batch = 16,
                   .micro = 4,
                   .unit = 1,
                   .steps = 3,
                   .threads = 1,
                   .layouts = "rtp fsdp ddp pp2-rtp pp2-fsdp"};
  struct rtp_comm_params cp = rtp_comm_params_default();
  struct layout ls[MAX_LAYOUTS];
  int n = -1;
  bool env = getenv("RTP_WORLD_SIZE") && !rtp_comm_params_from_env(&cp);
  if (env && !parse_args(&o, argc, argv)) n = parse_layouts(&o, cp.world_size, ls);
  if (n < 1) {
    fprintf(stderr,
            "usage: rtp-run -n N -- bench-pipeline [--model tiny|small|medium] "
            "[--global-batch G] [--micro-batches M] [--schedule NAME] [--unit U] [--layouts "
            "\"rtp fsdp ddp pp2-rtp pp2-fsdp\"] [--steps S] [--threads T] [--net LABEL]\n"
            "  (runs as one rank of a job; G must split among each layout's data-parallel "
            "ranks, and a pipeline's share into M micro-batches)\n");
    return 2;
  }
  struct rtp_comm *job;
  if (rtp_comm_init(&cp, &job)) die("joining the job");
  struct rtp_threadpool *tp = rtp_threadpool_new(o.threads);
  struct report reps[MAX_LAYOUTS];
  for (int k = 0; k < n; k++) {
    struct result r = run_layout(&o, &ls[k], job, tp);
    reps[k] = gather(&o, job, &r);
    if (rtp_comm_rank(job) == 0) print_layout(&o, &ls[k], cp.world_size, &r, &reps[k]);
  }
  if (rtp_comm_rank(job) == 0) print_summary(&o, ls, reps, n);
  rtp_threadpool_free(tp);
  rtp_comm_free(job);
  return 0;
}
