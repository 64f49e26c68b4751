/* bench-parallel: the reference model trained with each strategy on N local ranks (the
 * benchmark forks them and joins them over TCP on 127.0.0.1), next to one process with
 * the same per-rank batch. One JSON line per strategy, printed by rank 0:
 * tokens/s over all ranks, step time, this rank's bytes by role, bytes sent per step,
 * peak resident memory, and the fraction of communication hidden behind compute.
 *
 *   bench-parallel [--model tiny|small|medium] [--ranks N] [--batch B] [--threads T]
 *                  [--steps S] [--strategies "ddp rtp"] [--master-port P]
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "gpt.h"
#include "rtp-impl.h"
#include "rtp.h"

struct opts {
  struct gpt_config cfg;
  const char *model;
  int ranks, batch, threads, steps, port;
  char strategies[64];
};

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* VmHWM or VmRSS from /proc/self/status, in bytes. */
static size_t proc_bytes(const char *key) {
  FILE *f = fopen("/proc/self/status", "r");
  char line[256];
  size_t kb = 0;
  while (f && fgets(line, sizeof(line), f))
    if (strncmp(line, key, strlen(key)) == 0)
      kb = (size_t)strtoull(line + strlen(key) + 1, NULL, 10);
  if (f) fclose(f);
  return kb * 1024;
}

static void die(const char *what) {
  fprintf(stderr, "bench-parallel: %s: %s\n", what, rtp_last_error());
  exit(1);
}

/* Bytes this rank sends per step: what its communication nodes move. */
static double bytes_sent(const struct rtp_graph *g, int world, int rank) {
  double b = 0;
  for (int i = 0; i < g->n_nodes; i++) {
    const struct rtp_tensor *t = g->nodes[i];
    if (t->op != RTP_OP_COMM) continue;
    if (t->op_params[0] == RTP__COMM_SENDRECV) {
      if (t->op_params[1] != rank) /* not a copy to itself */
        b += (double)rtp_nbytes(t->src[0]);
    } else if (t->op_params[0] == RTP__COMM_ALLGATHER) { /* ring: (N - 1) / N of it */
      b += (double)(world - 1) / world * (double)rtp_nbytes(t);
    } else { /* ring all-reduce: 2 (N - 1) / N of the buffer */
      b += 2.0 * (world - 1) / world * (double)rtp_nbytes(t);
    }
  }
  return b;
}

/* Median of the measured step times. */
static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

struct result {
  double step_s, sent, comm_s;
  size_t baseline, peak;
  struct rtp_mem_report mem;
};

/* One rank's run: build for one device (no memory for parameters), parallelize, train. */
static struct result run_rank(const struct opts *o, enum rtp_strategy strategy,
                              struct rtp_comm *comm) {
  struct result res = {0};
  struct rtp_threadpool *tp = rtp_threadpool_new(o->threads);
  res.baseline = proc_bytes("VmRSS:");
  struct rtp_init_params meta_ip = {64 << 20, NULL, true};
  struct rtp_context *meta = rtp_init(meta_ip);
  struct gpt m;
  struct rtp_graph *fwd = rtp_graph_new(meta, 16384);
  if (!meta || gpt_build(meta, &m, o->cfg, o->batch) || rtp_graph_build(fwd, m.loss))
    die("build");
  struct rtp_init_params ip = {gpt_arena_size(o->cfg, o->batch), NULL, false};
  struct rtp_context *ctx = rtp_init(ip);
  struct rtp_parallel_params pp = {strategy, comm, 0, 0};
  struct rtp_parallel *par = ctx ? rtp_parallelize(ctx, fwd, m.loss, &pp) : NULL;
  if (!par) die("parallelize");
  struct rtp_graph *g = rtp_parallel_graph(par);
  if (rtp_graph_plan(ctx, g)) die("plan");
  struct rtp_optimizer *opt = rtp_optimizer_new(ctx, g, rtp_adamw_default());
  if (!opt) die("optimizer");
  for (int i = 0; i < m.n_params; i++) { /* values do not matter for speed, only finiteness */
    struct rtp_tensor *t = rtp_parallel_tensor(par, m.params[i]);
    float *d = t->data;
    for (int64_t j = 0; j < rtp_nelements(t); j++)
      d[j] = 0.02f * (float)((j * 7919) % 101 - 50) / 50;
  }
  struct rtp_tensor *idx = rtp_parallel_tensor(par, m.idx),
                    *tgt = rtp_parallel_tensor(par, m.targets);
  for (int64_t j = 0; j < rtp_nelements(idx); j++) {
    ((int32_t *)idx->data)[j] = (int32_t)((j * 31) % 256);
    ((int32_t *)tgt->data)[j] = (int32_t)((j * 17 + 3) % 256);
  }
  double times[64];
  int n = o->steps < 64 ? o->steps : 64;
  for (int s = 0; s <= n; s++) {
    double t0 = now_s();
    if (rtp_graph_compute(g, tp) || rtp_optimizer_step(opt, tp)) die("step");
    if (s > 0) times[s - 1] = now_s() - t0; /* step 0 warms up */
  }
  qsort(times, (size_t)n, sizeof(double), cmp_double);
  res.step_s = times[n / 2];
  res.sent = bytes_sent(g, comm ? rtp_comm_size(comm) : 1, comm ? rtp_comm_rank(comm) : 0);
  res.peak = proc_bytes("VmHWM:");
  rtp_mem_report_get(ctx, &res.mem);
  /* Communication alone: the same bytes through one rotation of the largest message. */
  if (comm && rtp_comm_size(comm) > 1 && res.sent > 0) {
    size_t bytes = 4 << 20;
    char *a = malloc(bytes), *b = malloc(bytes);
    memset(a, 1, bytes);
    int r = rtp_comm_rank(comm), N = rtp_comm_size(comm);
    double t0 = now_s();
    for (int k = 0; k < 4; k++)
      if (rtp_comm_sendrecv(comm, a, bytes, (r + 1) % N, b, bytes, (r + N - 1) % N, NULL))
        die("sendrecv");
    double bw = 4.0 * (double)bytes / (now_s() - t0);
    res.comm_s = res.sent / bw;
    free(a);
    free(b);
  }
  rtp_free(ctx);
  rtp_free(meta);
  rtp_threadpool_free(tp);
  return res;
}

static void print_result(const struct opts *o, const char *strategy, int world,
                         const struct result *r, double compute_s) {
  double tokens = (double)o->cfg.seq_len * o->batch * world;
  double hidden = 0;
  if (r->comm_s > 0) {
    hidden = (compute_s + r->comm_s - r->step_s) / r->comm_s;
    hidden = hidden < 0 ? 0 : hidden > 1 ? 1 : hidden;
  }
  size_t states =
      r->mem.bytes[RTP_ROLE_PARAM] + r->mem.bytes[RTP_ROLE_GRAD] + r->mem.bytes[RTP_ROLE_OPTIM];
  printf(
      "{\"bench\":\"parallel\",\"model\":\"%s\",\"strategy\":\"%s\",\"ranks\":%d,\"batch\":%d,"
      "\"threads\":%d,\"step_ms\":%.1f,\"tokens_per_s\":%.0f,\"params\":%zu,\"grads\":%zu,"
      "\"optim\":%zu,\"model_states\":%zu,\"activations\":%zu,\"comm\":%zu,\"arena_total\":%zu,"
      "\"bytes_sent_per_step\":%.0f,\"comm_only_ms\":%.1f,\"compute_only_ms\":%.1f,"
      "\"comm_hidden\":%.2f,\"peak_rss\":%zu,\"baseline_rss\":%zu}\n",
      o->model, strategy, world, o->batch, o->threads, r->step_s * 1e3, tokens / r->step_s,
      r->mem.bytes[RTP_ROLE_PARAM], r->mem.bytes[RTP_ROLE_GRAD], r->mem.bytes[RTP_ROLE_OPTIM],
      states, r->mem.bytes[RTP_ROLE_ACTIVATION], r->mem.bytes[RTP_ROLE_COMM], r->mem.total,
      r->sent, r->comm_s * 1e3, compute_s * 1e3, hidden, r->peak, r->baseline);
  fflush(stdout);
}

/* Forks the ranks of one strategy; rank 0 prints. Returns 0 if every rank succeeded. */
static int run_strategy(const struct opts *o, enum rtp_strategy s, double compute_s) {
  int port = o->port + (int)s * 7 + (int)(getpid() % 97) * 13;
  pid_t pids[RTP_MAX_WORLD];
  for (int r = 0; r < o->ranks; r++) {
    if ((pids[r] = fork()) != 0) continue;
    struct rtp_comm_params cp = rtp_comm_params_default();
    snprintf(cp.backend, sizeof(cp.backend), "tcp");
    cp.rank = r;
    cp.world_size = o->ranks;
    snprintf(cp.master_addr, sizeof(cp.master_addr), "127.0.0.1");
    cp.master_port = port;
    snprintf(cp.token, sizeof(cp.token), "bench-%d", (int)getppid());
    struct rtp_comm *comm;
    if (rtp_comm_init(&cp, &comm)) die("comm");
    struct result res = run_rank(o, s, comm);
    if (r == 0) print_result(o, rtp_strategy_name(s), o->ranks, &res, compute_s);
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

int main(int argc, char **argv) {
  struct opts o = {gpt_config_small(), "small", 2, 8, 1, 5, 29600, "ddp rtp"};
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (!v) goto usage;
    if (!strcmp(a, "--model")) {
      o.model = v;
      if (!strcmp(v, "small"))
        o.cfg = gpt_config_small();
      else if (!strcmp(v, "medium"))
        o.cfg = gpt_config_medium();
      else if (!strcmp(v, "tiny"))
        o.cfg = (struct gpt_config){256, 64, 128, 2, 4};
      else
        goto usage;
    } else if (!strcmp(a, "--ranks"))
      o.ranks = atoi(v);
    else if (!strcmp(a, "--batch"))
      o.batch = atoi(v);
    else if (!strcmp(a, "--threads"))
      o.threads = atoi(v);
    else if (!strcmp(a, "--steps"))
      o.steps = atoi(v);
    else if (!strcmp(a, "--master-port"))
      o.port = atoi(v);
    else if (!strcmp(a, "--strategies"))
      snprintf(o.strategies, sizeof(o.strategies), "%s", v);
    else
      goto usage;
    i++;
  }
  if (o.ranks < 1 || o.ranks > RTP_MAX_WORLD || o.batch < 1 || o.steps < 1) goto usage;
  /* Compute alone: one process, the per-rank batch. */
  struct result one = run_rank(&o, RTP_STRATEGY_NONE, NULL);
  print_result(&o, "none", 1, &one, one.step_s);
  char buf[64];
  snprintf(buf, sizeof(buf), "%s", o.strategies);
  int bad = 0;
  for (char *tok = strtok(buf, " ,"); tok; tok = strtok(NULL, " ,")) {
    enum rtp_strategy s;
    if (rtp_strategy_parse(tok, &s)) die("--strategies");
    bad |= run_strategy(&o, s, one.step_s);
  }
  return bad;
usage:
  fprintf(stderr,
          "usage: bench-parallel [--model tiny|small|medium] [--ranks N] [--batch B] "
          "[--threads T] [--steps S] [--strategies \"ddp rtp\"] [--master-port P]\n");
  return 2;
}
