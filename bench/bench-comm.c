/*
 * bench-comm - bandwidth of the transport's operations, one JSON line per (op, world
 * size, size), printed by rank 0:
 *
 *   {"bench":"comm","op":"allreduce","world":4,"bytes":16777216,"iters":10,
 *    "seconds":0.0123,"algbw_GBps":1.36,"busbw_GBps":2.04}
 *
 * algbw is bytes / time; busbw is what each link carries per second (the NCCL
 * convention): rotation x1, allreduce x 2(N-1)/N, allgather and reduce-scatter x (N-1)/N.
 *
 *   bench-comm [--worlds 2,3,4] [--sizes-mib 1,4,16,64] [--full] [--ops a,b]
 *     forks the ranks itself on 127.0.0.1 (loopback)
 *   rtp-run -n N [--nnodes ...] -- bench-comm [--sizes-mib ...]
 *     one rank per process, from the RTP_* environment (e.g. across network namespaces)
 * --full adds 256 MiB.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "bench-util.h"
#include "tools/free-port.h"
#include "rtp.h"

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int parse_list(const char *s, int *out, int max) {
  int n = 0;
  while (*s && n < max) {
    out[n++] = atoi(s);
    const char *c = strchr(s, ',');
    if (!c) break;
    s = c + 1;
  }
  return n;
}

static int op_wanted(const char *ops, const char *op) {
  if (!ops) return 1;
  const char *p = strstr(ops, op);
  size_t n = strlen(op);
  return p && (p == ops || p[-1] == ',') && (p[n] == 0 || p[n] == ',');
}

static int run_op(struct rtp_comm *c, const char *op, void *buf, void *buf2, size_t bytes) {
  int r = rtp_comm_rank(c), n = rtp_comm_size(c);
  if (!strcmp(op, "rotation"))
    return rtp_comm_sendrecv(c, buf, bytes, (r + n - 1) % n, buf2, bytes, (r + 1) % n, NULL);
  if (!strcmp(op, "allreduce")) return rtp_comm_allreduce(c, buf, bytes / 4, NULL);
  if (!strcmp(op, "allgather")) return rtp_comm_allgather(c, buf, bytes / 4, 4, NULL);
  if (!strcmp(op, "reduce_scatter")) return rtp_comm_reduce_scatter(c, buf, bytes / 4, NULL);
  return RTP_EINVAL;
}

static int bench_rank(const struct rtp_comm_params *p, const int *sizes, int nsizes,
                      const char *ops, const char *label) {
  struct rtp_comm *c;
  if (rtp_comm_init(p, &c) != RTP_OK) {
    fprintf(stderr, "bench-comm rank %d: %s\n", p->rank, rtp_last_error());
    return 1;
  }
  int n = rtp_comm_size(c);
  size_t maxb = 0;
  for (int i = 0; i < nsizes; i++)
    if ((size_t)sizes[i] << 20 > maxb) maxb = (size_t)sizes[i] << 20;
  float *a = malloc(maxb), *b = malloc(maxb);
  if (!a || !b) return 1;
  for (size_t i = 0; i < maxb / 4; i++) a[i] = b[i] = 1.0f;
  static const char *const all_ops[] = {"rotation", "allreduce", "allgather", "reduce_scatter"};
  static const double bus[] = {0, 2, 1, 1}; /* busbw factor: x (N-1)/N times this */
  for (int o = 0; o < 4; o++) {
    if (!op_wanted(ops, all_ops[o])) continue;
    for (int s = 0; s < nsizes; s++) {
      size_t bytes = (size_t)sizes[s] << 20;
      int iters = (int)((512u << 20) / bytes);
      iters = iters < 3 ? 3 : iters > 20 ? 20 : iters;
      for (int w = 0; w < 2; w++) /* warm up */
        if (run_op(c, all_ops[o], a, b, bytes) != RTP_OK) goto fail;
      if (rtp_comm_barrier(c, NULL) != RTP_OK) goto fail;
      double t0 = now_s();
      for (int it = 0; it < iters; it++)
        if (run_op(c, all_ops[o], a, b, bytes) != RTP_OK) goto fail;
      if (rtp_comm_barrier(c, NULL) != RTP_OK) goto fail;
      double t = (now_s() - t0) / iters;
      double alg = bytes / t / 1e9;
      double busf = o == 0 ? 1.0 : bus[o] * (n - 1) / (double)n;
      if (rtp_comm_rank(c) == 0) {
        printf(
            "{\"bench\":\"comm\",\"net\":\"%s\",\"op\":\"%s\",\"world\":%d,\"bytes\":%zu,"
            "\"iters\":%d,\"seconds\":%.6f,\"algbw_GBps\":%.4f,\"busbw_GBps\":%.4f}\n",
            label, all_ops[o], n, bytes, iters, t, alg, alg * busf);
        fflush(stdout);
      }
    }
  }
  free(a);
  free(b);
  rtp_comm_free(c);
  return 0;
fail:
  fprintf(stderr, "bench-comm rank %d: %s\n", rtp_comm_rank(c), rtp_last_error());
  rtp_comm_free(c);
  return 1;
}

int main(int argc, char **argv) {
  int worlds[16] = {2, 3, 4}, nworlds = 3;
  int sizes[16] = {1, 4, 16, 64}, nsizes = 4;
  const char *ops = NULL, *label = NULL;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--worlds") && i + 1 < argc) {
      nworlds = parse_list(argv[++i], worlds, 16);
    } else if (!strcmp(argv[i], "--sizes-mib") && i + 1 < argc) {
      nsizes = parse_list(argv[++i], sizes, 15);
    } else if (!strcmp(argv[i], "--full")) {
      sizes[nsizes++] = 256;
    } else if (!strcmp(argv[i], "--ops") && i + 1 < argc) {
      ops = argv[++i];
    } else if (!strcmp(argv[i], "--net") && i + 1 < argc) {
      label = argv[++i];
    } else {
      fprintf(stderr,
              "usage: bench-comm [--worlds 2,3,4] [--sizes-mib 1,4,16,64] [--full] "
              "[--ops rotation,allreduce,allgather,reduce_scatter] [--net LABEL]\n");
      return 2;
    }
  }
  if (getenv("RTP_WORLD_SIZE")) { /* one rank of a job started by rtp-run */
    struct rtp_comm_params p;
    if (rtp_comm_params_from_env(&p) != RTP_OK) {
      fprintf(stderr, "bench-comm: %s\n", rtp_last_error());
      return 1;
    }
    return bench_rank(&p, sizes, nsizes, ops, label ? label : "env");
  }
  int rc = 0;
  for (int w = 0; w < nworlds; w++) {
    int n = worlds[w], port = free_port();
    char token[RTP_COMM_MAX_TOKEN];
    bench_token(token, sizeof(token));
    fflush(stdout);
    for (int r = 0; r < n; r++) {
      if (fork() == 0) {
        struct rtp_comm_params p = rtp_comm_params_default();
        snprintf(p.backend, sizeof(p.backend), "tcp");
        p.rank = r;
        p.world_size = n;
        p.master_port = port;
        snprintf(p.token, sizeof(p.token), "%s", token);
        _exit(bench_rank(&p, sizes, nsizes, ops, label ? label : "loopback"));
      }
    }
    for (int r = 0; r < n; r++) {
      int st;
      wait(&st);
      if (!WIFEXITED(st) || WEXITSTATUS(st)) rc = 1;
    }
  }
  return rc;
}
