/* rtp-exec.c - the executor and its thread pool. Every thread walks the graph's nodes
 * in order and computes its share of each; a barrier separates nodes. Between jobs the
 * workers sleep, so an idle pool leaves the cores to others (the transport thread). */
#include "rtp-backend.h"
#include "rtp-comm.h"

#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

struct rtp_threadpool {
  int n;
  pthread_t *threads;
  struct worker *workers;
  pthread_mutex_t mu;
  pthread_cond_t wake, done;
  int job_id; /* bumped for each job; guarded by mu */
  int n_busy; /* workers still running the current job; guarded by mu */
  bool stop;
  rtp__job_fn fn;
  void *arg;
  int bar_count; /* atomic: threads at the barrier */
  int bar_gen;   /* atomic: barrier generation */
};

struct worker {
  struct rtp_threadpool *tp;
  int ith;
};

void rtp__barrier(const struct rtp_compute_params *p) {
  struct rtp_threadpool *tp = p->tp;
  if (!tp || p->nth == 1) return;
  int gen = __atomic_load_n(&tp->bar_gen, __ATOMIC_ACQUIRE);
  if (__atomic_add_fetch(&tp->bar_count, 1, __ATOMIC_ACQ_REL) == p->nth) {
    __atomic_store_n(&tp->bar_count, 0, __ATOMIC_RELAXED);
    __atomic_add_fetch(&tp->bar_gen, 1, __ATOMIC_RELEASE);
    return;
  }
  for (int spins = 0; __atomic_load_n(&tp->bar_gen, __ATOMIC_ACQUIRE) == gen; spins++)
    if (spins > 1000) sched_yield();
}

static void *worker_main(void *arg) {
  struct worker *w = arg;
  struct rtp_threadpool *tp = w->tp;
  int seen = 0;
  for (;;) {
    pthread_mutex_lock(&tp->mu);
    while (tp->job_id == seen && !tp->stop) pthread_cond_wait(&tp->wake, &tp->mu);
    if (tp->stop) {
      pthread_mutex_unlock(&tp->mu);
      return NULL;
    }
    seen = tp->job_id;
    rtp__job_fn fn = tp->fn;
    void *job_arg = tp->arg;
    pthread_mutex_unlock(&tp->mu);
    struct rtp_compute_params p = {.ith = w->ith, .nth = tp->n, .tp = tp};
    fn(&p, job_arg);
    pthread_mutex_lock(&tp->mu);
    if (--tp->n_busy == 0) pthread_cond_signal(&tp->done);
    pthread_mutex_unlock(&tp->mu);
  }
}

struct rtp_threadpool *rtp_threadpool_new(int n_threads) {
  if (n_threads <= 0) n_threads = (int)sysconf(_SC_NPROCESSORS_ONLN);
  if (n_threads <= 0) n_threads = 1;
  if (n_threads > RTP_MAX_THREADS) n_threads = RTP_MAX_THREADS;
  rtp__gemm_init();
  struct rtp_threadpool *tp = calloc(1, sizeof(*tp));
  struct worker *ws = calloc((size_t)n_threads, sizeof(*ws));
  if (tp) tp->threads = calloc((size_t)n_threads, sizeof(pthread_t));
  if (!tp || !ws || !tp->threads) {
    if (tp) free(tp->threads);
    free(tp);
    free(ws);
    rtp__error(RTP_ENOMEM, "rtp_threadpool_new: out of memory");
    return NULL;
  }
  tp->n = n_threads;
  pthread_mutex_init(&tp->mu, NULL);
  pthread_cond_init(&tp->wake, NULL);
  pthread_cond_init(&tp->done, NULL);
  /* Thread 0 is the caller of each job; workers are 1..n-1. */
  tp->workers = ws;
  for (int i = 1; i < n_threads; i++) {
    ws[i] = (struct worker){tp, i};
    if (pthread_create(&tp->threads[i], NULL, worker_main, &ws[i]) != 0) {
      tp->n = i; /* run with the threads we got */
      RTP_LOG_WARN("rtp_threadpool_new: could only start %d of %d threads", i, n_threads);
      break;
    }
  }
  return tp;
}

void rtp_threadpool_free(struct rtp_threadpool *tp) {
  if (!tp) return;
  pthread_mutex_lock(&tp->mu);
  tp->stop = true;
  pthread_cond_broadcast(&tp->wake);
  pthread_mutex_unlock(&tp->mu);
  for (int i = 1; i < tp->n; i++) pthread_join(tp->threads[i], NULL);
  free(tp->workers);
  pthread_mutex_destroy(&tp->mu);
  pthread_cond_destroy(&tp->wake);
  pthread_cond_destroy(&tp->done);
  free(tp->threads);
  free(tp);
}

int rtp_threadpool_size(const struct rtp_threadpool *tp) {
  return tp ? tp->n : 1;
}

void rtp__threadpool_run(struct rtp_threadpool *tp, rtp__job_fn fn, void *arg) {
  if (!tp || tp->n == 1) {
    struct rtp_compute_params p = {.ith = 0, .nth = 1, .tp = tp};
    fn(&p, arg);
    return;
  }
  pthread_mutex_lock(&tp->mu);
  tp->fn = fn;
  tp->arg = arg;
  tp->n_busy = tp->n - 1;
  tp->job_id++;
  pthread_cond_broadcast(&tp->wake);
  pthread_mutex_unlock(&tp->mu);
  struct rtp_compute_params p = {.ith = 0, .nth = tp->n, .tp = tp};
  fn(&p, arg);
  pthread_mutex_lock(&tp->mu);
  while (tp->n_busy > 0) pthread_cond_wait(&tp->done, &tp->mu);
  pthread_mutex_unlock(&tp->mu);
}

/* ---- graph execution ------------------------------------------------------------
 * Communication nodes are posted by thread 0 and left running; their request waits in
 * the node's `extra` until a later node reads the result. Thread 0 does that wait just
 * before the barrier that ends the previous node, so every thread starts a node with its
 * inputs complete. */

/* RTP_PROFILE=1: wall time per op (thread 0's view, waits for transfers included in
 * "comm.wait"), printed to stderr when the process exits. For finding slow kernels. */
static struct {
  int on; /* -1 unknown */
  double op_s[RTP_OP_COUNT], wait_s;
  long op_n[RTP_OP_COUNT];
} prof = {-1, {0}, 0, {0}};

static double prof_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void prof_print(void) {
  fprintf(stderr, "rtp profile (pid %d):\n", (int)getpid());
  for (int i = 0; i < RTP_OP_COUNT; i++)
    if (prof.op_n[i])
      fprintf(stderr, "  %-20s %8ld nodes %10.1f ms\n", rtp_op_name((enum rtp_op)i),
              prof.op_n[i], prof.op_s[i] * 1e3);
  fprintf(stderr, "  %-20s %19s %10.1f ms\n", "comm.wait", "", prof.wait_s * 1e3);
}

/* A forked child reports only its own time. */
static void prof_reset(void) {
  memset(prof.op_s, 0, sizeof(prof.op_s));
  memset(prof.op_n, 0, sizeof(prof.op_n));
  prof.wait_s = 0;
}

static bool prof_enabled(void) {
  if (prof.on < 0) {
    const char *v = getenv("RTP_PROFILE");
    prof.on = v && *v && strcmp(v, "0") != 0;
    if (prof.on) {
      atexit(prof_print);
      pthread_atfork(NULL, NULL, prof_reset);
    }
  }
  return prof.on;
}

/* A transfer in flight (the COMM node's `extra` while it is): its request, when it was
 * posted, and its communicator. */
struct inflight {
  struct rtp_comm_req *req;
  const struct rtp_comm *comm;
  double posted;
};

struct graph_job {
  struct rtp_graph *g;
  void *work;
  int status;                   /* set by kernels that meet bad data */
  const struct rtp_tensor *bad; /* the first node that did */
  int comm_status;              /* a failed transfer stops the graph */
  int stop_at; /* atomic: the node after which every thread stops (INT_MAX: none). Thread 0
                * may set it for node i + 1 while others still look after node i's barrier,
                * so it names the node rather than being a flag. */
  struct inflight *fl; /* one per COMM node, in posting order */
  int n_fl;
  bool trace;            /* RTP_TRACE: thread 0 records spans */
  double waited;         /* seconds thread 0 waited for transfers */
  struct rtp_plan *plan; /* where the waits per communicator go; NULL: nowhere */
};

/* Thread 0's clock: wall time when tracing (so the ranks' traces line up), else
 * monotonic. Seconds. */
static double job_now(const struct graph_job *job) {
  return job->trace ? rtp__trace_now() : prof_now();
}

static void add_wait(struct graph_job *job, const struct rtp_comm *comm, double s) {
  job->waited += s;
  if (!job->plan) return;
  struct rtp_plan_wait *w = job->plan->waits;
  int k = 0;
  while (k < RTP__PLAN_WAIT_GROUPS - 1 && w[k].comm && w[k].comm != comm) k++;
  if (!w[k].comm && k < RTP__PLAN_WAIT_GROUPS - 1) w[k].comm = comm;
  w[k].s += s; /* the last entry also takes every group beyond the table */
}

static void comm_wait(struct graph_job *job, struct rtp_tensor *c) {
  struct inflight *f = c->extra;
  if (!f) return;
  double t0 = job_now(job);
  int rc = rtp_comm_wait(f->req);
  double t1 = job_now(job);
  if (prof.on > 0) prof.wait_s += t1 - t0;
  add_wait(job, f->comm, t1 - t0);
  if (job->trace) {
    if (t1 - t0 > 1e-6) rtp__trace_span(0, c, "wait", t0, t1);
    rtp__trace_span(1, c, "transfer", f->posted, t1);
  }
  c->extra = NULL;
  if (rc && !job->comm_status) job->comm_status = rc;
}

static void comm_post(struct graph_job *job, struct rtp_tensor *t) {
  struct inflight *f = &job->fl[job->n_fl++];
  f->posted = job->trace ? rtp__trace_now() : 0;
  f->comm = rtp__comm_node_comm(t);
  int rc = rtp__comm_node_post(t, &f->req);
  if (rc) {
    job->comm_status = rc;
    return;
  }
  t->extra = f;
}

/* Thread 0, before node t runs: every transfer t reads from must be complete. */
static void wait_inputs(struct graph_job *job, struct rtp_tensor *t) {
  for (int s = 0; s < RTP_MAX_SRC; s++) {
    struct rtp_tensor *c = rtp__waited_transfer(t, s);
    if (c) comm_wait(job, c);
  }
}

/* Thread 0's bookkeeping after node i (t) is computed: the first bad index, the waits
 * for the next node's transfers, and whether to stop. */
static void after_node(struct graph_job *job, int i, struct rtp_tensor *t) {
  struct rtp_graph *g = job->g;
  if (__atomic_load_n(&job->status, __ATOMIC_RELAXED) && !job->bad) job->bad = t;
  for (int j = i + 1; j < g->n_nodes; j++)
    if (!rtp__is_view_op(g->nodes[j]->op)) {
      wait_inputs(job, g->nodes[j]);
      break;
    }
  if (job->comm_status) __atomic_store_n(&job->stop_at, i, __ATOMIC_RELAXED);
}

static void compute_job(const struct rtp_compute_params *base, void *arg) {
  struct graph_job *job = arg;
  struct rtp_compute_params p = *base;
  p.work = job->work;
  p.status = &job->status;
  struct rtp_graph *g = job->g;
  bool profile = p.ith == 0 && prof_enabled(), timed = p.ith == 0 && (profile || job->trace);
  for (int i = 0; i < g->n_nodes; i++) {
    struct rtp_tensor *t = g->nodes[i];
    if (rtp__is_view_op(t->op)) continue;
    double t0 = timed ? job_now(job) : 0, wait0 = timed ? job->waited : 0;
    if (t->op == RTP_OP_COMM) {
      if (p.ith == 0) comm_post(job, t);
    } else {
      rtp__compute_forward(&p, t);
    }
    if (p.ith == 0) after_node(job, i, t);
    rtp__barrier(&p);
    if (timed) { /* waits for the next node's transfers are counted apart */
      double busy = job_now(job) - t0 - (job->waited - wait0);
      if (profile) {
        prof.op_s[t->op] += busy;
        prof.op_n[t->op]++;
      }
      if (job->trace && t->op != RTP_OP_COMM) rtp__trace_span(0, t, "compute", t0, t0 + busy);
    }
    if (__atomic_load_n(&job->stop_at, __ATOMIC_RELAXED) <= i) break;
  }
  if (p.ith == 0) /* nothing stays in flight once compute returns */
    for (int i = 0; i < g->n_nodes; i++)
      if (g->nodes[i]->op == RTP_OP_COMM) comm_wait(job, g->nodes[i]);
}

/* A job over g: room for its transfers in flight. */
static int job_init(struct graph_job *job, struct rtp_graph *g, struct rtp_plan *plan) {
  int n = 0;
  for (int i = 0; i < g->n_nodes; i++) n += g->nodes[i]->op == RTP_OP_COMM;
  *job = (struct graph_job){.g = g,
                            .work = plan ? plan->work : NULL,
                            .stop_at = INT_MAX,
                            .trace = rtp__trace_on(),
                            .plan = plan};
  job->fl = n ? malloc(sizeof(*job->fl) * (size_t)n) : NULL;
  if (n && !job->fl) return rtp__error(RTP_ENOMEM, "rtp_graph_compute: out of memory");
  return RTP_OK;
}

/* Every tensor a kernel touches must have memory: leafs from the arena or the caller. */
static int check_ready(const struct rtp_graph *g) {
  for (int i = 0; i < g->n_leafs; i++)
    if (!g->leafs[i]->data && rtp_tensor_nelements(g->leafs[i]) > 0)
      return rtp__error(RTP_ESTATE, "rtp_graph_compute: leaf '%s' has no data",
                        g->leafs[i]->name);
  return RTP_OK;
}

/* The plan sized the kernels' scratch; a node changed since (a product's precision set
 * after planning) could need more, which a kernel must never write past. */
static int check_work(const struct rtp_graph *g, const struct rtp_plan *plan) {
  struct rtp_backend *be = plan->backend;
  for (int i = 0; i < g->n_nodes; i++) {
    const struct rtp_tensor *t = g->nodes[i];
    size_t need = be ? be->i->work_size(be, t) : rtp__op_work_size(t);
    if (need > plan->work_size)
      return rtp__error(RTP_ESTATE,
                        "rtp_graph_compute: %s '%s' needs %zu bytes of scratch, the plan has "
                        "%zu (was it changed after rtp_graph_plan?)",
                        rtp_op_name(t->op), t->name, need, plan->work_size);
  }
  return RTP_OK;
}

/* ---- device backends ----------------------------------------------------------------
 * The same schedule on two in-order queues. A COMM node is posted on the comm stream
 * after an event recorded on the compute stream at its place in the graph: everything
 * computed before it (its inputs, and the last readers of the memory it will write) is
 * then done. The first compute node to read its result waits for a second event recorded
 * after the transfer. These are the waits the CPU executor does on the host. */

static int stream_comm(struct rtp_backend *b, struct rtp_tensor *t, int k) {
  struct rtp_comm_op op;
  struct rtp_comm *comm = rtp__comm_node_op(t, &op);
  int rc = b->i->record(b, RTP_STREAM_COMPUTE, 2 * k);
  if (!rc) rc = b->i->wait(b, RTP_STREAM_COMM, 2 * k);
  if (!rc) rc = b->i->comm(b, comm, &op);
  if (!rc) rc = b->i->record(b, RTP_STREAM_COMM, 2 * k + 1);
  t->extra = (void *)(uintptr_t)(k + 1); /* pending: its done event is 2k + 1 */
  return rc;
}

static int stream_compute(struct rtp_backend *b, struct rtp_tensor *t, void *work) {
  int rc = RTP_OK;
  for (int s = 0; s < RTP_MAX_SRC && !rc; s++) {
    struct rtp_tensor *c = rtp__waited_transfer(t, s);
    if (!c || !c->extra) continue;
    int k = (int)(uintptr_t)c->extra - 1;
    c->extra = NULL; /* one wait orders every later node too */
    rc = b->i->wait(b, RTP_STREAM_COMPUTE, 2 * k + 1);
  }
  return rc ? rc : b->i->compute(b, t, work);
}

/* A transport that gives up on a peer aborts its device kernels, which then end without an
 * error of their own; the communicator knows why. */
static int comm_failed(const struct rtp_tensor *t) {
  struct rtp_comm_op op;
  struct rtp_comm *comm = rtp__comm_node_op(t, &op);
  const char *msg = NULL;
  int st = comm ? rtp_comm_status(comm, &msg) : RTP_OK;
  return st ? rtp__error(st, "%s", msg) : RTP_OK;
}

static int stream_graph_compute(struct rtp_graph *g, const struct rtp_plan *plan) {
  struct rtp_backend *b = plan->backend;
  int rc = RTP_OK;
  for (int i = 0, k = 0; i < g->n_nodes && !rc; i++) {
    struct rtp_tensor *t = g->nodes[i];
    if (rtp__is_view_op(t->op) || t->op == RTP_OP_EMPTY) continue;
    rc = t->op == RTP_OP_COMM ? stream_comm(b, t, k++) : stream_compute(b, t, plan->work);
  }
  int src = b->i->sync(b); /* nothing stays queued once compute returns */
  if (!rc) rc = src;
  for (int i = 0; i < g->n_nodes; i++) {
    struct rtp_tensor *t = g->nodes[i];
    if (t->op != RTP_OP_COMM) continue;
    t->extra = NULL;
    if (!rc) rc = comm_failed(t);
  }
  return rc;
}

int rtp_graph_compute(struct rtp_graph *g, struct rtp_threadpool *tp) {
  if (!g) return rtp__error(RTP_EINVAL, "rtp_graph_compute: NULL graph");
  if (!g->plan) return rtp__error(RTP_ESTATE, "rtp_graph_compute: call rtp_graph_plan first");
  const struct rtp_plan *plan = g->plan;
  int rc = check_ready(g);
  if (!rc) rc = check_work(g, plan);
  if (rc) return rc;
  struct rtp_plan *mplan = g->plan; /* the timings of this compute go there */
  memset(mplan->waits, 0, sizeof(mplan->waits));
  double t0 = prof_now();
  if (plan->backend) {
    rc = stream_graph_compute(g, plan);
    mplan->wall_s = prof_now() - t0;
    return rc;
  }
  struct graph_job job;
  if ((rc = job_init(&job, g, mplan))) return rc;
  double w0 = job.trace ? rtp__trace_now() : 0;
  rtp__threadpool_run(tp, compute_job, &job);
  if (job.trace) rtp__trace_graph(g, w0, rtp__trace_now());
  free(job.fl);
  mplan->wall_s = prof_now() - t0;
  if (job.comm_status) return job.comm_status; /* the transport set the message */
  if (job.status) {
    char s[160];
    rtp__shape_str(job.bad, s, sizeof(s));
    return rtp__error(job.status, "rtp_graph_compute: %s %s: an index is out of range",
                      rtp_op_name(job.bad->op), s);
  }
  return RTP_OK;
}

/* ---- communication only ------------------------------------------------------------
 * The CPU executor's walk over g with every kernel skipped: the same transfers posted in
 * the same places and waited for where their results are first read. How benchmarks
 * time a step's communication alone. */
int rtp__graph_replay_comm(struct rtp_graph *g) {
  if (!g) return rtp__error(RTP_EINVAL, "rtp__graph_replay_comm: NULL graph");
  struct graph_job job;
  int rc = job_init(&job, g, NULL);
  if (rc) return rc;
  for (int i = 0; i < g->n_nodes && !job.comm_status; i++) {
    struct rtp_tensor *t = g->nodes[i];
    if (rtp__is_view_op(t->op)) continue;
    if (t->op == RTP_OP_COMM) comm_post(&job, t);
    for (int j = i + 1; j < g->n_nodes; j++)
      if (!rtp__is_view_op(g->nodes[j]->op)) {
        wait_inputs(&job, g->nodes[j]);
        break;
      }
  }
  for (int i = 0; i < g->n_nodes; i++) /* nothing stays in flight, even after a failure */
    if (g->nodes[i]->op == RTP_OP_COMM) comm_wait(&job, g->nodes[i]);
  free(job.fl);
  return job.comm_status;
}

int rtp_graph_timing_get(const struct rtp_graph *g, const struct rtp_comm *c,
                         struct rtp_graph_timing *out) {
  if (!g || !out) return rtp__error(RTP_EINVAL, "rtp_graph_timing_get: NULL argument");
  if (!g->plan) return rtp__error(RTP_ESTATE, "rtp_graph_timing_get: the graph is not planned");
  const struct rtp_plan *plan = g->plan;
  *out = (struct rtp_graph_timing){.wall_s = plan->wall_s};
  for (int k = 0; k < RTP__PLAN_WAIT_GROUPS; k++)
    if (!c || plan->waits[k].comm == c) out->wait_s += plan->waits[k].s;
  return RTP_OK;
}
