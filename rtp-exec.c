/* rtp-exec.c - the executor and its thread pool. Every thread walks the graph's nodes
 * in order and computes its share of each; a barrier separates nodes. Between jobs the
 * workers sleep, so an idle pool leaves the cores to others (the transport thread). */
#include "rtp-impl.h"

#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <unistd.h>

struct rtp_threadpool {
  int n;
  pthread_t *threads;
  struct worker *workers;
  pthread_mutex_t mu;
  pthread_cond_t wake, done;
  int job_id;   /* bumped for each job; guarded by mu */
  int n_busy;   /* workers still running the current job; guarded by mu */
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

/* ---- graph execution ------------------------------------------------------------ */

struct graph_job {
  struct rtp_graph *g;
  void *work;
  int status;                   /* set by kernels that meet bad data */
  const struct rtp_tensor *bad; /* the first node that did */
};

static void compute_job(const struct rtp_compute_params *base, void *arg) {
  struct graph_job *job = arg;
  struct rtp_compute_params p = *base;
  p.work = job->work;
  p.status = &job->status;
  for (int i = 0; i < job->g->n_nodes; i++) {
    struct rtp_tensor *t = job->g->nodes[i];
    if (rtp__is_view_op(t->op)) continue;
    rtp__compute_forward(&p, t);
    rtp__barrier(&p);
    if (p.ith == 0 && job->status && !job->bad) job->bad = t;
  }
}

/* Every tensor a kernel touches must have memory: leafs from the arena or the caller. */
static int check_ready(const struct rtp_graph *g) {
  for (int i = 0; i < g->n_leafs; i++)
    if (!g->leafs[i]->data && rtp_nelements(g->leafs[i]) > 0)
      return rtp__error(RTP_ESTATE, "rtp_graph_compute: leaf '%s' has no data",
                        g->leafs[i]->name);
  return RTP_OK;
}

int rtp_graph_compute(struct rtp_graph *g, struct rtp_threadpool *tp) {
  if (!g) return rtp__error(RTP_EINVAL, "rtp_graph_compute: NULL graph");
  if (!g->plan) return rtp__error(RTP_ESTATE, "rtp_graph_compute: call rtp_graph_plan first");
  int rc = check_ready(g);
  if (rc) return rc;
  struct graph_job job = {g, rtp__graph_work(g), RTP_OK, NULL};
  rtp__threadpool_run(tp, compute_job, &job);
  if (job.status) {
    char s[160];
    rtp__shape_str(job.bad, s, sizeof(s));
    return rtp__error(job.status, "rtp_graph_compute: %s %s: an index is out of range",
                      rtp_op_name(job.bad->op), s);
  }
  return RTP_OK;
}
