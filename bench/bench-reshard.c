/*
 * bench-reshard - cross-mesh resharding (rtp_reshard_plan + rtp_reshard_build) after the
 * Alpa team's microbenchmarks: one JSON line per (case, method), printed by rank 0, then
 * one per case comparing the methods:
 *
 *   {"bench":"reshard","case":"1-to-all","method":"ours","hosts":4,"ranks":8,
 *    "bytes":67108864,"seconds":0.61,"lower_bound_s":0.537,"ratio_to_bound":1.14,
 *    "nic_max_bytes":67108864,"exact":true}
 *   {"bench":"reshard","case":"1-to-all","receivers":8,"receiver_hosts":4,
 *    "ours_vs_naive":6.1,"ours_vs_p2p_per_host":2.0,"ours_vs_broadcast":1.0,
 *    "ours_ratio_to_bound":1.14}
 *
 * Methods, in the same run: "naive" (each receiver gets every slice it needs from the
 * slice's first holder, point to point), "p2p-per-host" (the slice goes point to point to
 * one receiver per host, which forwards it to the others there: Alpa's older send/recv
 * plus a local gather, done as a chain), "broadcast" (one chained broadcast per slice from
 * its first holder: no load balance) and "ours" (the planner's balanced senders). seconds
 * is the median over --reps runs of the slowest rank's time; the lower bound is the
 * busiest NIC's bytes under our plan / --bandwidth; exact says every rank's destination
 * block arrived bit for bit. Cases (H hosts of P ranks, N = H x P, a {4096, S/16 KiB} f32
 * tensor of S bytes):
 *   1-to-all       rank 0's whole tensor to all N ranks, replicated
 *   rows-to-rep    row blocks on all N ranks to all N, replicated (an all-gather)
 *   rows-to-cols   row blocks on all N to column blocks on all N (an all-to-all)
 *   tiles-to-rows  a H x P mesh's tiles to row blocks on all N (another mesh shape)
 *   rep-to-rows    replicated on the first H/2 hosts to row blocks on the others
 *   rows-to-rep2   row blocks on the first H/2 hosts to replicated on the others
 *
 *   ip netns exec ... env RTP_RANK=.. RTP_WORLD_SIZE=.. RTP_LOCAL_WORLD_SIZE=P ...
 *       bench-reshard [--mib 64] [--reps 3] [--bandwidth 125e6] [--cases a,b]
 *     one rank per process, from the RTP_* environment; host = rank / P
 *     (scripts/bench-reshard-netns.sh runs it on emulated 1 Gbit/s hosts)
 *   bench-reshard --fork N --per-host P [...]   forks N ranks on 127.0.0.1 (a smoke test:
 *     the "hosts" then share the loopback)
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench-util.h"
#include "tools/free-port.h"
#include "rtp.h"

struct opts {
  int mib, reps, per_host;
  double bandwidth;
  const char *cases;
};

struct side {
  struct rtp_mesh mesh;
  struct rtp_layout layout;
};

/* ranks [first, first + n) on their hosts (rank / per_host) as a 1-D mesh */
static struct rtp_mesh mesh_range(int first, int n, int per_host) {
  struct rtp_mesh m;
  int ranks[RTP_MESH_MAX_RANKS], hosts[RTP_MESH_MAX_RANKS];
  for (int i = 0; i < n; i++) {
    ranks[i] = first + i;
    hosts[i] = (first + i) / per_host;
  }
  rtp_mesh_init_1d(&m, n, ranks, hosts);
  return m;
}

static struct side rows_on(struct rtp_mesh m) {
  struct side s = {m, rtp_layout_replicated()};
  rtp_layout_chunk(&s.layout, 1, 0, 1);
  return s;
}

static struct side rep_on(struct rtp_mesh m) {
  return (struct side){m, rtp_layout_replicated()};
}

/* Case `name`'s two sides on n ranks of per_host each; false if it needs more hosts. */
static int case_sides(const char *name, int n, int per_host, struct side *a, struct side *b) {
  int hosts = n / per_host, half = (hosts / 2) * per_host;
  struct rtp_mesh all = mesh_range(0, n, per_host);
  if (!strcmp(name, "1-to-all")) {
    *a = rep_on(mesh_range(0, 1, per_host));
    *b = rep_on(all);
  } else if (!strcmp(name, "rows-to-rep")) {
    *a = rows_on(all);
    *b = rep_on(all);
  } else if (!strcmp(name, "rows-to-cols")) {
    *a = rows_on(all);
    *b = rep_on(all);
    rtp_layout_chunk(&b->layout, 0, 0, 1);
  } else if (!strcmp(name, "tiles-to-rows")) {
    int hs[RTP_MESH_MAX_RANKS];
    for (int i = 0; i < n; i++) hs[i] = i / per_host;
    a->layout = rtp_layout_replicated();
    rtp_mesh_init_2d(&a->mesh, hosts, per_host, NULL, hs);
    rtp_layout_chunk(&a->layout, 0, 0, 1); /* columns over hosts, rows within each */
    rtp_layout_chunk(&a->layout, 1, 1, 1);
    *b = rows_on(all);
  } else if (!strcmp(name, "rep-to-rows") || !strcmp(name, "rows-to-rep2")) {
    if (hosts < 2) return 0;
    struct rtp_mesh first = mesh_range(0, half, per_host),
                    rest = mesh_range(half, n - half, per_host);
    bool rep_first = !strcmp(name, "rep-to-rows");
    *a = rep_first ? rep_on(first) : rows_on(first);
    *b = rep_first ? rows_on(rest) : rep_on(rest);
  } else {
    return 0;
  }
  return 1;
}

/* The plans of the send/recv methods, from the first-owner plan r: every slice goes from
 * its first holder point to point to each receiver ("naive"), or to each receiving host,
 * whose first receiver forwards it to the others there ("p2p-per-host"; by_host);
 * receivers that hold it copy it. In rounds of transfers with no host in common (greedy,
 * as the planner's), with the busiest NIC's bytes. Shares r's rank lists. */
static struct rtp_reshard *p2p_plan(const struct rtp_reshard *r, int per_host, bool by_host) {
  int n = 0;
  for (int i = 0; i < r->n_slices; i++)
    n += (r->slices[i].n_local > 0) + r->slices[i].n_receivers - r->slices[i].n_local;
  struct rtp_reshard *p = calloc(1, sizeof(*p) + sizeof(struct rtp_reshard_slice) * (size_t)n);
  if (!p) return NULL;
  uint64_t sent[RTP_MESH_MAX_RANKS] = {0}, recv[RTP_MESH_MAX_RANKS] = {0};
  int hosts = RTP_MESH_MAX_RANKS;
  unsigned char *busy = calloc((size_t)n * (size_t)hosts, 1); /* [round][host] */
  if (!busy) {
    free(p);
    return NULL;
  }
  *p = *r;
  p->slices = (struct rtp_reshard_slice *)(p + 1);
  p->n_slices = 0;
  p->n_rounds = 0;
  p->nic_sent = p->nic_recv = NULL;
  p->nic_max = 0;
  for (int i = 0; i < r->n_slices; i++) {
    const struct rtp_reshard_slice *s = &r->slices[i];
    if (s->n_local > 0) {
      struct rtp_reshard_slice *l = &p->slices[p->n_slices++];
      *l = *s;
      l->n_receivers = s->n_local;
      l->sender = -1;
      l->round = -1;
    }
    /* the chain visits a host's receivers one after the other */
    for (int k = s->n_local, e; k < s->n_receivers; k = e) {
      for (e = k + 1; by_host && e < s->n_receivers &&
                      s->receivers[e] / per_host == s->receivers[k] / per_host;)
        e++;
      struct rtp_reshard_slice *t = &p->slices[p->n_slices++];
      *t = *s;
      t->receivers = s->receivers + k;
      t->n_receivers = e - k;
      t->n_local = 0;
      t->sender = s->holders[0];
      int hs = t->sender / per_host, hr = t->receivers[0] / per_host;
      t->round = -1; /* within a host: in no round */
      if (hs == hr || hs >= RTP_MESH_MAX_RANKS || hr >= RTP_MESH_MAX_RANKS) continue;
      /* the first round where both hosts are free: a round's transfers share no host */
      for (t->round = 0; busy[t->round * hosts + hs] || busy[t->round * hosts + hr];)
        t->round++;
      busy[t->round * hosts + hs] = busy[t->round * hosts + hr] = 1;
      p->n_rounds = t->round + 1 > p->n_rounds ? t->round + 1 : p->n_rounds;
      sent[hs] += s->nbytes;
      recv[hr] += s->nbytes;
      p->nic_max = sent[hs] > p->nic_max ? sent[hs] : p->nic_max;
      p->nic_max = recv[hr] > p->nic_max ? recv[hr] : p->nic_max;
    }
  }
  free(busy);
  return p;
}

/* This rank's block of a side: per dimension its global indices (groups are 1 here). */
static int64_t block_of(const struct side *s, const int64_t *ne, int rank, int d,
                        int64_t *first) {
  int pos = -1, n = s->mesh.shape[0] * s->mesh.shape[1];
  for (int i = 0; i < n; i++)
    if (s->mesh.ranks[i] == rank) pos = i;
  if (pos < 0) return -1;
  int coord[2] = {pos / s->mesh.shape[1], pos % s->mesh.shape[1]}, a = s->layout.axis[d];
  *first = 0;
  if (a == RTP_LAYOUT_REPLICATED) return ne[d];
  size_t f, len;
  rtp_comm_block((size_t)ne[d], s->mesh.shape[a], coord[a], &f, &len);
  *first = (int64_t)f;
  return (int64_t)len;
}

/* The bits of element (x, y) of the whole tensor. */
static uint32_t bits_at(int64_t x, int64_t y) {
  return (uint32_t)(x * 2654435761u) ^ (uint32_t)(y * 40503u + 7u);
}

/* A 2-D f32 block of side s for this rank (NULL if not in it), filled or zeroed. */
static struct rtp_tensor *block_tensor(struct rtp_context *ctx, const struct side *s,
                                       const int64_t *ne, int rank, bool fill) {
  int64_t f0 = 0, f1 = 0, n0 = block_of(s, ne, rank, 0, &f0),
          n1 = block_of(s, ne, rank, 1, &f1);
  if (n0 < 0) return NULL;
  struct rtp_tensor *t = rtp_tensor_new_2d(ctx, RTP_TYPE_F32, n0, n1);
  if (!t || !fill) return t;
  uint32_t *v = t->data;
  for (int64_t y = 0; y < n1; y++)
    for (int64_t x = 0; x < n0; x++) v[y * n0 + x] = bits_at(f0 + x, f1 + y);
  return t;
}

static bool block_exact(const struct rtp_tensor *t, const struct side *s, const int64_t *ne,
                        int rank) {
  if (!t) return true;
  int64_t f0 = 0, f1 = 0, n0 = block_of(s, ne, rank, 0, &f0),
          n1 = block_of(s, ne, rank, 1, &f1);
  const uint32_t *v = t->data;
  for (int64_t y = 0; y < n1; y++)
    for (int64_t x = 0; x < n0; x++)
      if (v[y * n0 + x] != bits_at(f0 + x, f1 + y)) return false;
  return true;
}

/* One method: builds the graph, runs it reps times; *seconds the median of the slowest
 * rank's times, *exact whether every rank's block arrived bit for bit. */
static int run_method(struct rtp_comm *c, const struct rtp_reshard *plan, const struct side *a,
                      const struct side *b, const int64_t *ne, const struct opts *o,
                      double *seconds, bool *exact) {
  int rank = rtp_comm_rank(c);
  size_t bytes = (size_t)ne[0] * (size_t)ne[1] * 4;
  struct rtp_init_params ip = {.mem_size = 3 * bytes + (64u << 20)};
  struct rtp_context *ctx = rtp_context_new(ip);
  if (!ctx) return -1;
  struct rtp_tensor *src = block_tensor(ctx, a, ne, rank, true);
  struct rtp_tensor *dst = block_tensor(ctx, b, ne, rank, false);
  struct rtp_graph *g = rtp_graph_new(ctx, 1 << 16);
  int rc = rtp_reshard_build(ctx, g, c, plan, src, dst, 0);
  if (!rc) rc = rtp_graph_plan(ctx, g);
  double t[64];
  int reps = o->reps < 64 ? o->reps : 64, n = rtp_comm_size(c);
  float *all = calloc((size_t)n, 2 * sizeof(float)); /* per rank: seconds, inexact */
  *exact = true;
  if (!all && !rc) rc = RTP_ENOMEM;
  for (int i = 0; i < reps && !rc; i++) {
    if (dst) memset(dst->data, 0, rtp_tensor_nbytes(dst));
    rc = rtp_comm_barrier(c, NULL);
    double t0 = bench_now_s();
    if (!rc) rc = rtp_graph_compute(g, NULL);
    all[2 * rank] = (float)(bench_now_s() - t0);
    all[2 * rank + 1] = block_exact(dst, b, ne, rank) ? 0.0f : 1.0f;
    if (!rc) rc = rtp_comm_allgather(c, all, (size_t)n, 2 * sizeof(float), NULL);
    t[i] = 0;
    for (int k = 0; k < n; k++) {
      t[i] = all[2 * k] > t[i] ? all[2 * k] : t[i];
      *exact &= all[2 * k + 1] == 0;
    }
  }
  free(all);
  *seconds = bench_median(t, reps);
  rtp_context_free(ctx);
  return rc;
}

static const char *const kCases[] = {"1-to-all",      "rows-to-rep", "rows-to-cols",
                                     "tiles-to-rows", "rep-to-rows", "rows-to-rep2"};

static bool case_wanted(const char *list, const char *name) {
  if (!list) return true;
  const char *p = strstr(list, name);
  size_t n = strlen(name);
  return p && (p == list || p[-1] == ',') && (p[n] == 0 || p[n] == ',');
}

/* Receivers of a plan that get something over the network, and their hosts. */
static void receivers(const struct rtp_reshard *r, int per_host, int *n_recv, int *n_hosts) {
  bool seen[RTP_MESH_MAX_RANKS] = {0}, hseen[RTP_MESH_MAX_RANKS] = {0};
  *n_recv = *n_hosts = 0;
  for (int i = 0; i < r->n_slices; i++)
    for (int k = r->slices[i].n_local; k < r->slices[i].n_receivers; k++) {
      int q = r->slices[i].receivers[k];
      if (q < RTP_MESH_MAX_RANKS && !seen[q]) {
        seen[q] = true;
        ++*n_recv;
        if (!hseen[q / per_host]) ++*n_hosts;
        hseen[q / per_host] = true;
      }
    }
}

/* seconds / bound as JSON: null when nothing crosses a NIC (a bound of 0). */
static const char *ratio_json(double seconds, double bound, char *buf) {
  if (bound > 0)
    snprintf(buf, 32, "%.3f", seconds / bound);
  else
    snprintf(buf, 32, "null");
  return buf;
}

static int bench_case(struct rtp_comm *c, const char *name, const struct opts *o) {
  int n = rtp_comm_size(c), rank = rtp_comm_rank(c);
  struct side a, b;
  if (!case_sides(name, n, o->per_host, &a, &b)) return 0;
  int64_t ne[RTP_MAX_DIMS] = {4096, (int64_t)o->mib * 64, 1, 1}; /* 16 KiB rows */
  struct rtp_reshard_params p = {.src_mesh = &a.mesh,
                                 .dst_mesh = &b.mesh,
                                 .src = &a.layout,
                                 .dst = &b.layout,
                                 .ne = {ne[0], ne[1], 1, 1},
                                 .elem_size = 4,
                                 .bandwidth = o->bandwidth};
  struct rtp_reshard *ours = NULL, *first = NULL, *naive = NULL, *per_host = NULL;
  int rc = rtp_reshard_plan(&p, &ours);
  p.first_owner = true;
  if (!rc) rc = rtp_reshard_plan(&p, &first);
  if (!rc && !(naive = p2p_plan(first, o->per_host, false))) rc = RTP_ENOMEM;
  if (!rc && !(per_host = p2p_plan(first, o->per_host, true))) rc = RTP_ENOMEM;
  const char *names[4] = {"naive", "p2p-per-host", "broadcast", "ours"};
  const struct rtp_reshard *plans[4] = {naive, per_host, first, ours};
  double secs[4] = {0};
  char ratio[32];
  for (int m = 0; m < 4 && !rc; m++) {
    bool exact = false;
    rc = run_method(c, plans[m], &a, &b, ne, o, &secs[m], &exact);
    if (!rc && rank == 0)
      printf(
          "{\"bench\":\"reshard\",\"case\":\"%s\",\"method\":\"%s\",\"hosts\":%d,"
          "\"ranks\":%d,\"bytes\":%zu,\"seconds\":%.4f,\"lower_bound_s\":%.4f,"
          "\"ratio_to_bound\":%s,\"nic_max_bytes\":%llu,\"exact\":%s}\n",
          name, names[m], n / o->per_host, n, (size_t)(ne[0] * ne[1] * 4), secs[m],
          ours->lower_bound_s, ratio_json(secs[m], ours->lower_bound_s, ratio),
          (unsigned long long)plans[m]->nic_max, exact ? "true" : "false");
    fflush(stdout);
  }
  if (!rc && rank == 0) {
    int nr, nh;
    receivers(ours, o->per_host, &nr, &nh);
    printf(
        "{\"bench\":\"reshard\",\"case\":\"%s\",\"receivers\":%d,"
        "\"receiver_hosts\":%d,\"ours_vs_naive\":%.2f,\"ours_vs_p2p_per_host\":%.2f,"
        "\"ours_vs_broadcast\":%.2f,\"ours_ratio_to_bound\":%s}\n",
        name, nr, nh, secs[0] / secs[3], secs[1] / secs[3], secs[2] / secs[3],
        ratio_json(secs[3], ours->lower_bound_s, ratio));
    fflush(stdout);
  }
  free(naive);
  free(per_host);
  rtp_reshard_free(first);
  rtp_reshard_free(ours);
  if (rc) fprintf(stderr, "bench-reshard rank %d: %s: %s\n", rank, name, rtp_last_error());
  return rc;
}

static int bench_rank(const struct rtp_comm_params *p, const struct opts *o) {
  struct rtp_comm *c;
  if (rtp_comm_init(p, &c) != RTP_OK) {
    fprintf(stderr, "bench-reshard rank %d: %s\n", p->rank, rtp_last_error());
    return 1;
  }
  int rc = 0;
  if (rtp_comm_size(c) % o->per_host) {
    fprintf(stderr, "bench-reshard: %d ranks are not hosts of %d\n", rtp_comm_size(c),
            o->per_host);
    rc = 1;
  }
  for (size_t i = 0; i < sizeof(kCases) / sizeof(kCases[0]) && !rc; i++)
    if (case_wanted(o->cases, kCases[i])) rc = bench_case(c, kCases[i], o) != 0;
  rtp_comm_free(c);
  return rc;
}

int main(int argc, char **argv) {
  struct opts o = {64, 3, 0, 125e6, NULL};
  int fork_n = 0;
  for (int i = 1; i < argc; i++) {
    bool more = i + 1 < argc;
    if (!strcmp(argv[i], "--mib") && more)
      o.mib = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--reps") && more)
      o.reps = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--bandwidth") && more)
      o.bandwidth = atof(argv[++i]);
    else if (!strcmp(argv[i], "--cases") && more)
      o.cases = argv[++i];
    else if (!strcmp(argv[i], "--fork") && more)
      fork_n = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--per-host") && more)
      o.per_host = atoi(argv[++i]);
    else {
      fprintf(stderr,
              "usage: bench-reshard [--mib M] [--reps R] [--bandwidth B/s] [--cases a,b] "
              "[--fork N --per-host P]\n");
      return 2;
    }
  }
  if (o.mib < 1 || o.reps < 1 || !(o.bandwidth > 0)) {
    fprintf(stderr, "bench-reshard: --mib, --reps and --bandwidth must be positive\n");
    return 2;
  }
  if (!fork_n) { /* one rank of a job: RTP_* from the environment */
    struct rtp_comm_params p;
    if (rtp_comm_params_from_env(&p) != RTP_OK) {
      fprintf(stderr, "bench-reshard: %s\n", rtp_last_error());
      return 1;
    }
    const char *lws = getenv("RTP_LOCAL_WORLD_SIZE");
    if (!o.per_host) o.per_host = lws ? atoi(lws) : 1;
    if (o.per_host < 1) o.per_host = 1;
    return bench_rank(&p, &o);
  }
  if (o.per_host < 1) o.per_host = 1;
  int port = free_port(), rc = 0;
  char token[RTP_COMM_MAX_TOKEN];
  bench_token(token, sizeof(token));
  fflush(stdout);
  for (int r = 0; r < fork_n; r++)
    if (fork() == 0) {
      struct rtp_comm_params p = rtp_comm_params_default();
      snprintf(p.backend, sizeof(p.backend), "tcp");
      p.rank = r;
      p.world_size = fork_n;
      p.master_port = port;
      snprintf(p.token, sizeof(p.token), "%s", token);
      _exit(bench_rank(&p, &o));
    }
  for (int r = 0; r < fork_n; r++) {
    int st;
    wait(&st);
    if (!WIFEXITED(st) || WEXITSTATUS(st)) rc = 1;
  }
  return rc;
}
