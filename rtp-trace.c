/*
 * rtp-trace.c - RTP_TRACE=PREFIX: what the CPU executor ran, as Chrome trace events.
 *
 * Thread 0 of every rtp_graph_compute records each node it runs and each wait for a
 * transfer on lane 0, each transfer (posted to waited-for) on lane 1 and the compute as
 * a whole on lane 2, in wall-clock
 * microseconds so that the ranks of a job on one machine line up. At exit the process
 * writes PREFIX.<rank>.json (RTP_RANK, else the pid) in the Trace Event Format, which
 * chrome://tracing and Perfetto open; scripts/trace-merge puts a job's files in one.
 * Off unless RTP_TRACE is set: then the executor never reads the clock for it.
 */
#define _POSIX_C_SOURCE 200809L
#include "rtp-impl.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define TRACE_MAX_EVENTS 2000000 /* about 150 MB: a few steps of a large graph */

struct trace_event {
  char name[64];
  const char *cat;
  double ts, dur; /* microseconds */
  double bytes;   /* transfers; 0 otherwise */
  int lane;
  const void *group; /* a transfer's communicator; NULL otherwise */
};

static struct {
  int on; /* -1 unknown */
  char prefix[1024];
  pthread_mutex_t mu;
  struct trace_event *ev;
  size_t n, cap;
  size_t dropped;
} tr = {.on = -1, .mu = PTHREAD_MUTEX_INITIALIZER};

double rtp__trace_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void trace_write_file(void) {
  char path[1100];
  const char *rank = getenv("RTP_RANK");
  if (rank && *rank)
    snprintf(path, sizeof(path), "%s.%s.json", tr.prefix, rank);
  else
    snprintf(path, sizeof(path), "%s.pid%d.json", tr.prefix, (int)getpid());
  FILE *f = fopen(path, "w");
  if (!f) {
    fprintf(stderr, "rtp: RTP_TRACE: cannot write %s\n", path);
    return;
  }
  int pid = rank && *rank ? atoi(rank) : (int)getpid();
  fprintf(f, "{\"traceEvents\": [\n");
  fprintf(f,
          "{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": %d, \"args\": {\"name\": "
          "\"rank %s\"}},\n",
          pid, rank && *rank ? rank : "?");
  fprintf(f,
          "{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": %d, \"tid\": 0, \"args\": "
          "{\"name\": \"compute\"}},\n"
          "{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": %d, \"tid\": 1, \"args\": "
          "{\"name\": \"transfers\"}},\n"
          "{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": %d, \"tid\": 2, \"args\": "
          "{\"name\": \"graphs\"}}",
          pid, pid, pid);
  const void *groups[64] = {0}; /* communicators, numbered in the order first seen */
  for (size_t i = 0; i < tr.n; i++) {
    const struct trace_event *e = &tr.ev[i];
    fprintf(f,
            ",\n{\"name\": \"%s\", \"cat\": \"%s\", \"ph\": \"X\", \"pid\": %d, \"tid\": %d, "
            "\"ts\": %.3f, \"dur\": %.3f",
            e->name, e->cat, pid, e->lane, e->ts, e->dur);
    int g = 0;
    while (e->group && g < 63 && groups[g] && groups[g] != e->group) g++;
    if (e->group && !groups[g]) groups[g] = e->group;
    if (e->group) fprintf(f, ", \"args\": {\"bytes\": %.0f, \"group\": %d}", e->bytes, g);
    fprintf(f, "}");
  }
  fprintf(f, "\n], \"otherData\": {\"dropped_events\": %zu}}\n", tr.dropped);
  bool failed = ferror(f);
  if (fclose(f) || failed) fprintf(stderr, "rtp: RTP_TRACE: writing %s failed\n", path);
}

/* At exit: a trace past the file size limit (ulimit -f) is reported, not a crash. */
static void trace_write(void) {
  bool blocked = rtp__fsize_guard_begin();
  trace_write_file();
  rtp__fsize_guard_end(blocked);
}

/* A forked child traces only what it runs itself. */
static void trace_reset(void) {
  tr.n = 0;
  tr.dropped = 0;
}

bool rtp__trace_on(void) {
  if (tr.on < 0) {
    pthread_mutex_lock(&tr.mu);
    if (tr.on < 0) {
      const char *v = getenv("RTP_TRACE");
      bool on = v && *v && strlen(v) < sizeof(tr.prefix);
      if (on) {
        snprintf(tr.prefix, sizeof(tr.prefix), "%s", v);
        atexit(trace_write);
        pthread_atfork(NULL, NULL, trace_reset);
      }
      __atomic_store_n(&tr.on, on ? 1 : 0, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&tr.mu);
  }
  return __atomic_load_n(&tr.on, __ATOMIC_ACQUIRE) > 0;
}

/* Names are quoted in JSON as they are: anything that would need escaping becomes '_'. */
static void copy_name(char *dst, size_t n, const char *src) {
  size_t i = 0;
  for (; src[i] && i + 1 < n; i++) {
    char c = src[i];
    dst[i] = c == '"' || c == '\\' || (unsigned char)c < 32 ? '_' : c;
  }
  dst[i] = 0;
}

/* Appends one span; past TRACE_MAX_EVENTS it is counted as dropped. */
static void trace_event(int lane, const char *name, const char *cat, double t0, double t1,
                        double bytes, const void *group) {
  pthread_mutex_lock(&tr.mu);
  if (tr.n == tr.cap && tr.cap < TRACE_MAX_EVENTS) {
    size_t cap = tr.cap ? 2 * tr.cap : 4096;
    struct trace_event *ev = realloc(tr.ev, cap * sizeof(*ev));
    if (ev) {
      tr.ev = ev;
      tr.cap = cap;
    }
  }
  if (tr.n < tr.cap) {
    struct trace_event *e = &tr.ev[tr.n++];
    copy_name(e->name, sizeof(e->name), name);
    e->cat = cat;
    e->ts = 1e6 * t0;
    e->dur = t1 > t0 ? 1e6 * (t1 - t0) : 0;
    e->bytes = bytes;
    e->lane = lane;
    e->group = group;
  } else {
    tr.dropped++;
  }
  pthread_mutex_unlock(&tr.mu);
}

void rtp__trace_span(int lane, const struct rtp_tensor *t, const char *cat, double t0,
                     double t1) {
  char what[64];
  if (t->op == RTP_OP_COMM)
    rtp__comm_node_describe(t, what, sizeof(what));
  else
    snprintf(what, sizeof(what), "%s", t->name[0] ? t->name : rtp_op_name(t->op));
  bool comm = t->op == RTP_OP_COMM;
  trace_event(lane, what, cat, t0, t1, comm ? rtp__comm_node_bytes(t) : 0,
              comm ? rtp__comm_node_comm(t) : NULL);
}

void rtp__trace_graph(const struct rtp_graph *g, double t0, double t1) {
  char what[64];
  snprintf(what, sizeof(what), "graph of %d nodes", g->n_nodes);
  trace_event(2, what, "graph", t0, t1, 0, NULL);
}
