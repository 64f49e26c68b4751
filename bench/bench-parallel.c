/* bench-parallel: the reference model trained with each strategy on N ranks, next to one
 * process with the same per-rank batch. One JSON line per strategy, printed by rank 0:
 * tokens/s over all ranks, step time, this rank's bytes by role, bytes sent per step,
 * peak resident memory, the step's communication alone, and the fraction of it hidden
 * behind compute.
 *
 * Two modes. By default the benchmark forks N local ranks and joins them over TCP on
 * 127.0.0.1; the parent measures the one-process (compute-only) step first. When
 * RTP_WORLD_SIZE is set (rtp-run, scripts/bench-parallel-netns.sh), this process is one
 * rank of a job whose ranks are separate processes, possibly on other hosts: it joins
 * through rtp_comm_params_from_env and runs every strategy as that rank (--ranks is
 * ignored); before each strategy every rank measures the one-process step at once, and
 * the mean over ranks is the compute-only figure.
 *
 * "steps_ms" lists every timed step in the order taken; interleaved, step i of each
 * strategy was taken in the same round, so their ratios pair up (bench/targets.py).
 *
 * Communication alone ("comm_only_method":"replay"): after training, each rank walks its
 * graph as the executor does (posts every transfer in order, waits for a node's inputs
 * just before it would run) with every kernel skipped, plus the optimizer's grad-norm
 * all-reduce: the exact transfers of one step, with the same sizes, peers and order, and
 * no compute. "comm_est_ms" is the older estimate, bytes sent over a measured rotation.
 *
 *   bench-parallel [--model tiny|small|medium] [--ranks N] [--batch B] [--threads T]
 *                  [--steps S] [--strategies "ddp rtp"] [--master-port P] [--net LABEL]
 *                  (--master-port: the first strategy's; default: a free port each)
 *                  [--comm-type f32|bf16]   (bf16: rtp rotates bf16 copies; others stay f32)
 *                  [--compute-type f32|bf16] (bf16: every product, one process included,
 *                                             rounds its operands to bf16)
 *                  [--interleave 0|1]        (1: every rank builds all the strategies and
 *                                             takes their steps in turn; for ratios on a
 *                                             machine whose speed drifts; no peak memory)
 */
#define _GNU_SOURCE
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "bench-util.h"
#include "tools/free-port.h"
#include "gpt.h"
#include "rtp-impl.h"
#include "rtp.h"

struct opts {
  struct gpt_config cfg;
  const char *model, *net; /* net: a label for the JSON (the link the ranks share) */
  int ranks, batch, threads, steps, port;
  char strategies[64];
  enum rtp_strategy list[8]; /* --strategies, parsed before any rank joins */
  int n_list;
  enum rtp_type comm_type;    /* rtp's travelling copies */
  enum rtp_type compute_type; /* the products' precision, every strategy */
  bool interleave;            /* --interleave: strategies' steps taken in turn */
};

static enum rtp_type comm_type_of(const struct opts *o, enum rtp_strategy s) {
  return s == RTP_STRATEGY_RTP ? o->comm_type : RTP_TYPE_F32;
}

static void die(const char *what) {
  fprintf(stderr, "bench-parallel: %s: %s\n", what, rtp_last_error());
  exit(1);
}

/* Bytes this rank sends per step: what its communication nodes move. */
static double bytes_sent(const struct rtp_graph *g) {
  double b = 0;
  for (int i = 0; i < g->n_nodes; i++)
    if (g->nodes[i]->op == RTP_OP_COMM) b += rtp__comm_node_bytes(g->nodes[i]);
  return b;
}

struct result {
  double step_s, sent, comm_s, comm_est_s;
  double steps[64]; /* every timed step, in the order taken */
  int n_steps;
  size_t baseline, peak;
  struct rtp_mem_report mem;
};

/* One step's communication without its compute (the executor's replay), then the scalar
 * all-reduce rtp_optimizer_step makes for the norm. */
static int replay_step(struct rtp_graph *g, struct rtp_comm *comm) {
  int rc = rtp__graph_replay_comm(g);
  float f = 0;
  return rc ? rc : rtp_comm_allreduce(comm, &f, 1, NULL);
}

/* Median time of n replays after one to warm up. */
static double comm_only_s(struct rtp_graph *g, struct rtp_comm *comm, int n) {
  double times[64];
  for (int s = 0; s <= n; s++) {
    double t0 = bench_now_s();
    if (replay_step(g, comm)) die("replay");
    if (s > 0) times[s - 1] = bench_now_s() - t0;
  }
  qsort(times, (size_t)n, sizeof(double), bench_cmp_double);
  return times[n / 2];
}

/* The older estimate: the step's bytes over the bandwidth of a rotation of 4 MiB blocks. */
static double comm_estimate_s(struct rtp_comm *comm, double sent) {
  size_t bytes = 4 << 20;
  char *a = malloc(bytes), *b = malloc(bytes);
  if (!a || !b) {
    free(a);
    free(b);
    return 0;
  }
  memset(a, 1, bytes);
  int r = rtp_comm_rank(comm), N = rtp_comm_size(comm);
  double t0 = bench_now_s();
  for (int k = 0; k < 4; k++)
    if (rtp_comm_sendrecv(comm, a, bytes, (r + 1) % N, b, bytes, (r + N - 1) % N, NULL))
      die("sendrecv");
  double bw = 4.0 * (double)bytes / (bench_now_s() - t0);
  free(a);
  free(b);
  return sent / bw;
}

/* One strategy on this rank: built for one device (no memory for parameters), then
 * parallelized, planned and given an optimizer; steps are timed into `times`. */
struct run {
  enum rtp_strategy strategy;
  struct rtp_context *meta, *ctx;
  struct rtp_parallel *par;
  struct rtp_graph *g;
  struct rtp_optimizer *opt;
  size_t baseline;
  double times[64];
  int n_times;
};

static void run_setup(const struct opts *o, enum rtp_strategy strategy, struct rtp_comm *comm,
                      struct run *u) {
  memset(u, 0, sizeof(*u));
  u->strategy = strategy;
  u->baseline = bench_proc_bytes("VmRSS:");
  struct rtp_init_params meta_ip = {.mem_size = 64 << 20, .no_alloc = true};
  u->meta = rtp_context_new(meta_ip);
  struct gpt m;
  struct rtp_graph *fwd = u->meta ? rtp_graph_new(u->meta, 16384) : NULL;
  if (!fwd || gpt_build(u->meta, &m, o->cfg, o->batch) || rtp_graph_build(fwd, m.loss))
    die("build");
  struct rtp_init_params ip = {.mem_size = gpt_arena_size(o->cfg, o->batch), .no_alloc = false};
  u->ctx = rtp_context_new(ip);
  struct rtp_parallel_params pp = {.strategy = strategy,
                                   .comm = comm,
                                   .comm_type = comm_type_of(o, strategy),
                                   .compute_type = o->compute_type};
  u->par = u->ctx ? rtp_parallel_new(u->ctx, fwd, m.loss, &pp) : NULL;
  if (!u->par) die("parallelize");
  u->g = rtp_parallel_graph(u->par);
  if (rtp_graph_plan(u->ctx, u->g)) die("plan");
  u->opt = rtp_optimizer_new(u->ctx, u->g, rtp_adamw_params_default());
  if (!u->opt) die("optimizer");
  for (int i = 0; i < m.n_params; i++) { /* values do not matter for speed, only finiteness */
    struct rtp_tensor *t = rtp_parallel_tensor(u->par, m.params[i]);
    float *d = t->data;
    for (int64_t j = 0; j < rtp_tensor_nelements(t); j++)
      d[j] = 0.02f * (float)((j * 7919) % 101 - 50) / 50;
  }
  struct rtp_tensor *idx = rtp_parallel_tensor(u->par, m.idx),
                    *tgt = rtp_parallel_tensor(u->par, m.targets);
  for (int64_t j = 0; j < rtp_tensor_nelements(idx); j++) {
    ((int32_t *)idx->data)[j] = (int32_t)((j * 31) % 256);
    ((int32_t *)tgt->data)[j] = (int32_t)((j * 17 + 3) % 256);
  }
}

/* One training step; `timed` false for the warm-up. */
static void run_step(struct run *u, struct rtp_threadpool *tp, bool timed) {
  double t0 = bench_now_s();
  if (rtp_graph_compute(u->g, tp) || rtp_optimizer_step(u->opt, tp)) die("step");
  if (timed && u->n_times < 64) u->times[u->n_times++] = bench_now_s() - t0;
}

/* The median step, bytes and memory, then communication alone; frees the run. */
static struct result run_finish(struct run *u, struct rtp_comm *comm) {
  struct result res = {.baseline = u->baseline, .peak = bench_proc_bytes("VmHWM:")};
  memcpy(res.steps, u->times, sizeof(res.steps));
  res.n_steps = u->n_times;
  qsort(u->times, (size_t)u->n_times, sizeof(double), bench_cmp_double);
  res.step_s = u->times[u->n_times / 2];
  res.sent = bytes_sent(u->g);
  rtp_mem_report_get(u->ctx, &res.mem);
  if (comm && rtp_comm_size(comm) > 1 && res.sent > 0) {
    res.comm_s = comm_only_s(u->g, comm, u->n_times);
    res.comm_est_s = comm_estimate_s(comm, res.sent);
  }
  rtp_context_free(u->ctx);
  rtp_context_free(u->meta);
  return res;
}

static int n_steps(const struct opts *o) {
  return o->steps < 64 ? o->steps : 64;
}

/* One rank's run of one strategy: a warm-up step, then the timed ones. */
static struct result run_rank(const struct opts *o, enum rtp_strategy strategy,
                              struct rtp_comm *comm) {
  struct rtp_threadpool *tp = rtp_threadpool_new(o->threads);
  struct run u;
  run_setup(o, strategy, comm, &u);
  for (int s = 0; s <= n_steps(o); s++) run_step(&u, tp, s > 0);
  rtp_threadpool_free(tp);
  return run_finish(&u, comm);
}

static void print_result(const struct opts *o, const char *strategy, int world,
                         const struct result *r, double compute_s) {
  double tokens = (double)o->cfg.seq_len * o->batch * world;
  double hidden = 0, bound = compute_s > r->comm_s ? compute_s : r->comm_s;
  if (r->comm_s > 0) {
    hidden = (compute_s + r->comm_s - r->step_s) / r->comm_s;
    hidden = hidden < 0 ? 0 : hidden > 1 ? 1 : hidden;
  }
  char peak[24] = "null", baseline[24] = "null"; /* interleaved: the process's, not its own */
  if (!o->interleave) {
    snprintf(peak, sizeof(peak), "%zu", r->peak);
    snprintf(baseline, sizeof(baseline), "%zu", r->baseline);
  }
  size_t states =
      r->mem.bytes[RTP_ROLE_PARAM] + r->mem.bytes[RTP_ROLE_GRAD] + r->mem.bytes[RTP_ROLE_OPTIM];
  char steps[64 * 12] = "";
  for (int i = 0, n = 0; i < r->n_steps && n < (int)sizeof(steps); i++)
    n += snprintf(steps + n, sizeof(steps) - (size_t)n, "%s%.1f", i ? "," : "",
                  r->steps[i] * 1e3);
  printf(
      "{\"bench\":\"parallel\",\"model\":\"%s\",\"strategy\":\"%s\",\"comm_type\":\"%s\","
      "\"compute_type\":\"%s\",\"ranks\":%d,\"batch\":%d,"
      "\"threads\":%d,\"net\":\"%s\",\"step_ms\":%.1f,\"tokens_per_s\":%.0f,\"params\":%zu,"
      "\"grads\":%zu,\"optim\":%zu,\"model_states\":%zu,\"activations\":%zu,\"comm\":%zu,"
      "\"arena_total\":%zu,\"bytes_sent_per_step\":%.0f,\"comm_only_ms\":%.1f,"
      "\"comm_only_method\":\"%s\",\"comm_est_ms\":%.1f,\"compute_only_ms\":%.1f,"
      "\"step_over_max\":%.3f,\"comm_hidden\":%.2f,\"interleaved\":%s,\"peak_rss\":%s,"
      "\"baseline_rss\":%s,\"steps_ms\":[%s]}\n",
      o->model, strategy,
      rtp_type_name(strcmp(strategy, "rtp") == 0 ? o->comm_type : RTP_TYPE_F32),
      rtp_type_name(o->compute_type), world, o->batch, o->threads, o->net, r->step_s * 1e3,
      tokens / r->step_s, r->mem.bytes[RTP_ROLE_PARAM], r->mem.bytes[RTP_ROLE_GRAD],
      r->mem.bytes[RTP_ROLE_OPTIM], states, r->mem.bytes[RTP_ROLE_ACTIVATION],
      r->mem.bytes[RTP_ROLE_COMM], r->mem.total, r->sent, r->comm_s * 1e3,
      r->comm_s > 0 ? "replay" : "none", r->comm_est_s * 1e3, compute_s * 1e3,
      r->step_s / bound, hidden, o->interleave ? "true" : "false", peak, baseline, steps);
  fflush(stdout);
}

/* --interleave: this rank builds a one-process run and every strategy, then takes their
 * steps in turn (the order rotating each round), so that a machine whose speed drifts
 * during the run slows every strategy alike and the ratios between them hold. The
 * one-process step runs on every rank at once, as the ranks do (compute_only_s). Peak
 * memory is the process's, over all of them, so it is not reported. */
static void run_interleaved(const struct opts *o, struct rtp_comm *comm) {
  struct rtp_threadpool *tp = rtp_threadpool_new(o->threads);
  struct run one, runs[8];
  int n = o->n_list;
  run_setup(o, RTP_STRATEGY_NONE, NULL, &one);
  for (int k = 0; k < n; k++) run_setup(o, o->list[k], comm, &runs[k]);
  for (int s = 0; s <= n_steps(o); s++) {
    float barrier = 0; /* every rank starts the strategies' steps together */
    run_step(&one, tp, s > 0);
    if (rtp_comm_allreduce(comm, &barrier, 1, NULL)) die("allreduce");
    for (int k = 0; k < n; k++) run_step(&runs[(s + k) % n], tp, s > 0);
  }
  rtp_threadpool_free(tp);
  struct result r1 = run_finish(&one, NULL);
  float c = (float)r1.step_s;
  if (rtp_comm_allreduce(comm, &c, 1, NULL)) die("allreduce");
  double compute_s = (double)c / rtp_comm_size(comm);
  bool print = rtp_comm_rank(comm) == 0;
  if (print) print_result(o, "none", 1, &r1, compute_s);
  for (int k = 0; k < n; k++) {
    struct result res = run_finish(&runs[k], comm);
    if (print) print_result(o, rtp_strategy_name(o->list[k]), o->ranks, &res, compute_s);
  }
}

/* Forks the ranks of one strategy (with --interleave, of all); rank 0 prints. Returns 0
 * if every rank succeeded. */
static int run_strategy(const struct opts *o, enum rtp_strategy s, double compute_s) {
  int port = o->port ? o->port + (int)s : free_port();
  if (!port) die("no free port for rank 0");
  pid_t pids[RTP_MAX_WORLD];
  char token[RTP_COMM_MAX_TOKEN];
  bench_token(token, sizeof(token));
  for (int r = 0; r < o->ranks; r++) {
    if ((pids[r] = fork()) != 0) continue;
    struct rtp_comm_params cp = rtp_comm_params_default();
    snprintf(cp.backend, sizeof(cp.backend), "tcp");
    cp.rank = r;
    cp.world_size = o->ranks;
    snprintf(cp.master_addr, sizeof(cp.master_addr), "127.0.0.1");
    cp.master_port = port;
    snprintf(cp.token, sizeof(cp.token), "%s", token);
    struct rtp_comm *comm;
    if (rtp_comm_init(&cp, &comm)) die("comm");
    if (o->interleave) {
      run_interleaved(o, comm);
    } else {
      struct result res = run_rank(o, s, comm);
      if (r == 0) print_result(o, rtp_strategy_name(s), o->ranks, &res, compute_s);
    }
    rtp_comm_free(comm);
    exit(0); /* exit, not _exit: RTP_PROFILE prints at exit */
  }
  int bad = 0;
  for (int r = 0; r < o->ranks; r++) {
    int st;
    waitpid(pids[r], &st, 0);
    bad |= !WIFEXITED(st) || WEXITSTATUS(st) != 0;
  }
  return bad;
}

/* Default mode: the parent measures compute alone, then forks the ranks of each strategy. */
static int run_forked(const struct opts *o) {
  if (o->interleave) return run_strategy(o, RTP_STRATEGY_NONE, 0);
  struct result one = run_rank(o, RTP_STRATEGY_NONE, NULL);
  print_result(o, "none", 1, &one, one.step_s);
  int bad = 0;
  for (int k = 0; k < o->n_list; k++) bad |= run_strategy(o, o->list[k], one.step_s);
  return bad;
}

/* Compute alone on every rank at once (one process's step, the per-rank batch), as the
 * ranks will run; the mean over ranks. */
static double compute_only_s(const struct opts *o, struct rtp_comm *comm, struct result *one) {
  *one = run_rank(o, RTP_STRATEGY_NONE, NULL);
  float c = (float)one->step_s;
  if (rtp_comm_allreduce(comm, &c, 1, NULL)) die("allreduce");
  return (double)c / rtp_comm_size(comm);
}

/* RTP_WORLD_SIZE mode: this process is one rank. Compute alone is measured again right
 * before each strategy, because on a shared machine the load drifts during the run. */
static int run_env(struct opts *o) {
  struct rtp_comm_params cp = rtp_comm_params_default();
  if (rtp_comm_params_from_env(&cp)) die("RTP_* environment");
  struct rtp_comm *comm;
  if (rtp_comm_init(&cp, &comm)) die("comm");
  int rank = rtp_comm_rank(comm);
  o->ranks = rtp_comm_size(comm);
  if (o->interleave) {
    run_interleaved(o, comm);
    rtp_comm_free(comm);
    return 0;
  }
  struct result one;
  double compute_s = compute_only_s(o, comm, &one);
  if (rank == 0) print_result(o, "none", 1, &one, compute_s);
  for (int k = 0; k < o->n_list; k++) {
    if (k > 0) compute_s = compute_only_s(o, comm, &one);
    bench_reset_peak();
    struct result res = run_rank(o, o->list[k], comm);
    if (rank == 0) print_result(o, rtp_strategy_name(o->list[k]), o->ranks, &res, compute_s);
  }
  rtp_comm_free(comm);
  return 0;
}

static int parse_model(struct opts *o, const char *v) {
  o->model = v;
  return bench_model(v, &o->cfg);
}

/* --strategies into o->list; -1 on an unknown name or too many. */
static int parse_strategies(struct opts *o) {
  char buf[64];
  snprintf(buf, sizeof(buf), "%s", o->strategies);
  o->n_list = 0;
  for (char *tok = strtok(buf, " ,"); tok; tok = strtok(NULL, " ,")) {
    if (o->n_list == (int)(sizeof(o->list) / sizeof(o->list[0]))) return -1;
    if (rtp_strategy_parse(tok, &o->list[o->n_list++])) {
      fprintf(stderr, "bench-parallel: --strategies: %s\n", rtp_last_error());
      return -1;
    }
  }
  return 0;
}

static int parse_args(struct opts *o, int argc, char **argv) {
  for (int i = 1; i < argc; i += 2) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (!v) return -1;
    if (!strcmp(a, "--model")) {
      if (parse_model(o, v)) return -1;
    } else if (!strcmp(a, "--ranks"))
      o->ranks = atoi(v);
    else if (!strcmp(a, "--batch"))
      o->batch = atoi(v);
    else if (!strcmp(a, "--threads"))
      o->threads = atoi(v);
    else if (!strcmp(a, "--steps"))
      o->steps = atoi(v);
    else if (!strcmp(a, "--master-port"))
      o->port = atoi(v);
    else if (!strcmp(a, "--net"))
      o->net = v;
    else if (!strcmp(a, "--comm-type") && (!strcmp(v, "f32") || !strcmp(v, "bf16")))
      o->comm_type = strcmp(v, "bf16") ? RTP_TYPE_F32 : RTP_TYPE_BF16;
    else if (!strcmp(a, "--compute-type") && (!strcmp(v, "f32") || !strcmp(v, "bf16")))
      o->compute_type = strcmp(v, "bf16") ? RTP_TYPE_F32 : RTP_TYPE_BF16;
    else if (!strcmp(a, "--interleave") && (!strcmp(v, "0") || !strcmp(v, "1")))
      o->interleave = v[0] == '1';
    else if (!strcmp(a, "--strategies"))
      snprintf(o->strategies, sizeof(o->strategies), "%s", v);
    else
      return -1;
  }
  if (o->ranks < 1 || o->ranks > RTP_MAX_WORLD || o->batch < 1 || o->steps < 1 ||
      o->threads < 1)
    return -1;
  return parse_strategies(o);
}

int main(int argc, char **argv) {
  const char *ws = getenv("RTP_WORLD_SIZE");
  bool env_mode = ws && *ws;
  struct opts o = {.cfg = gpt_config_small(),
                   .model = "small",
                   .net = env_mode ? "env" : "loopback",
                   .ranks = 2,
                   .batch = 8,
                   .threads = 1,
                   .steps = 5,
                   .strategies = "ddp rtp",
                   .comm_type = RTP_TYPE_F32,
                   .compute_type = RTP_TYPE_F32};
  if (parse_args(&o, argc, argv)) {
    fprintf(stderr,
            "usage: bench-parallel [--model tiny|small|medium] [--ranks N] [--batch B] "
            "[--threads T] [--steps S] [--strategies \"ddp rtp\"] [--master-port P] "
            "[--net LABEL] [--comm-type f32|bf16] [--compute-type f32|bf16] "
            "[--interleave 0|1]\n"
            "  with RTP_WORLD_SIZE set, runs as rank RTP_RANK of that job (--ranks ignored)\n");
    return 2;
  }
  return env_mode ? run_env(&o) : run_forked(&o);
}
