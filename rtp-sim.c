/* rtp-sim.c - a simulated device: the backend interface on host memory, for testing a
 * program's device path (the executor's stream plan, host copies) without a GPU.
 *
 * Two things make it a device rather than the CPU in disguise:
 * - its memory cannot be touched from the host: every allocation is its own mapping,
 *   PROT_NONE except while the backend itself works on it (a drain at sync, set/get/zero,
 *   sumsq). Host code that reads or writes a device tensor's data directly faults at once
 *   (a system call given such memory fails with EFAULT) instead of silently working, as it
 *   would on unified memory;
 * - its work waits in two in-order queues until sync, then runs in an order drawn from the
 *   seed among those the recorded events allow: a missing event lets a node run before what
 *   it depends on, and results differ from the CPU's.
 * Kernels are the CPU's (rtp__compute_forward on one thread), transfers the communicator's
 * (rtp__comm_post, blocking, inside the drain: so nothing writes device memory once the
 * drain has returned and the memory is protected again). Single-threaded by design: the
 * protection is per backend, and two threads driving one backend would race on it. */
#define _DEFAULT_SOURCE /* MAP_ANONYMOUS */
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "rtp-backend.h"
#include "rtp-comm.h"

enum sim_kind { SIM_COMPUTE, SIM_COMM, SIM_ADAM, SIM_RECORD, SIM_WAIT };

struct sim_item {
  enum sim_kind kind;
  int event;
  long seq; /* SIM_RECORD: its number; SIM_WAIT: the record it waits for (0: none) */
  struct rtp_tensor *t;
  void *work;
  struct rtp_comm *c;
  struct rtp_comm_op op;
  struct rtp_adam_args adam;
};

struct sim_queue {
  struct sim_item *items;
  size_t head, len, cap;
};

struct sim_region {
  uint8_t *p;
  size_t size; /* bytes asked for: the device's, checked by host copies */
  size_t len;  /* mapped bytes, whole pages */
};

struct sim {
  struct rtp_backend base;
  enum rtp__sim_order order;
  bool drop_waits;
  uint64_t rng;
  struct sim_queue q[2];
  long *last_enqueued, *last_done; /* per event: record numbers */
  int n_events;
  long n_records;
  int kernel_status;
  long host_touch_while_busy;
  struct sim_region *regions;
  int n_regions, cap_regions;
};

static const struct rtp_backend_i sim_i;

static struct sim *sim_of(struct rtp_backend *b) {
  return (struct sim *)b->impl;
}

static struct sim *sim_cast(struct rtp_backend *b) {
  return b && b->i == &sim_i ? sim_of(b) : NULL;
}

/* splitmix64: one stream of choices per seed, the same on every platform. */
static uint64_t sim_rand(struct sim *s) {
  uint64_t z = (s->rng += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/* ---- memory protection ------------------------------------------------------------ */

static int protect_all(struct sim *s, int prot) {
  for (int i = 0; i < s->n_regions; i++)
    if (mprotect(s->regions[i].p, s->regions[i].len, prot))
      return rtp__error(RTP_ENOMEM, "simulated device: mprotect of %zu bytes failed",
                        s->regions[i].len);
  return RTP_OK;
}

/* Opens the pages of [p, p + n) alone to a host copy: mprotect's cost grows with the
 * pages it changes, and a whole arena per copy made the training tests 20 times slower. */
static int protect_range(const void *p, size_t n, int prot) {
  if (n == 0) return RTP_OK;
  uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
  uintptr_t lo = (uintptr_t)p / page * page, hi = ((uintptr_t)p + n + page - 1) / page * page;
  if (mprotect((void *)lo, hi - lo, prot))
    return rtp__error(RTP_ENOMEM, "simulated device: mprotect of %zu bytes failed",
                      (size_t)(hi - lo));
  return RTP_OK;
}

/* Whether [p, p + n) lies in one allocation of s: anything else is not this device's. */
static bool sim_owns(const struct sim *s, const void *p, size_t n) {
  const uint8_t *q = p;
  for (int i = 0; i < s->n_regions; i++) {
    const struct sim_region *r = &s->regions[i];
    if (q >= r->p && q <= r->p + r->size && n <= (size_t)(r->p + r->size - q)) return true;
  }
  return false;
}

static int sim_alloc(struct rtp_backend *b, size_t size, void **out) {
  struct sim *s = sim_of(b);
  long page = sysconf(_SC_PAGESIZE);
  size_t len = size ? size : 1;
  if (len > SIZE_MAX - (size_t)page)
    return rtp__error(RTP_ENOMEM, "simulated device: %zu bytes is too large", size);
  len = (len + (size_t)page - 1) / (size_t)page * (size_t)page;
  if (s->n_regions == s->cap_regions) {
    int cap = s->cap_regions ? 2 * s->cap_regions : 8;
    struct sim_region *r = realloc(s->regions, (size_t)cap * sizeof(*r));
    if (!r) return rtp__error(RTP_ENOMEM, "simulated device: out of memory");
    s->regions = r;
    s->cap_regions = cap;
  }
  void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED)
    return rtp__error(RTP_ENOMEM, "simulated device: cannot map %zu bytes", len);
  memset(p, 0xff, len); /* NaN: a read of memory nothing wrote shows in the results */
  if (mprotect(p, len, PROT_NONE)) {
    munmap(p, len);
    return rtp__error(RTP_ENOMEM, "simulated device: mprotect of %zu bytes failed", len);
  }
  s->regions[s->n_regions++] = (struct sim_region){p, size, len};
  *out = p;
  return RTP_OK;
}

static void sim_release(struct rtp_backend *b, void *p) {
  struct sim *s = sim_of(b);
  for (int i = 0; i < s->n_regions; i++)
    if (s->regions[i].p == p) {
      munmap(p, s->regions[i].len);
      s->regions[i] = s->regions[--s->n_regions];
      return;
    }
}

/* ---- host copies ------------------------------------------------------------------ */

static bool sim_busy(const struct sim *s) {
  return s->q[0].len > s->q[0].head || s->q[1].len > s->q[1].head;
}

/* A host copy must find its device bytes in one allocation; work still queued means the
 * host raced the streams, which the executor never does (counted for the tests). */
static int sim_host_begin(struct sim *s, const char *what, const void *p, size_t n) {
  if (!sim_owns(s, p, n))
    return rtp__error(
        RTP_EINVAL, "simulated device: %s of %zu bytes at %p is not device memory", what, n, p);
  if (sim_busy(s)) s->host_touch_while_busy++;
  return protect_range(p, n, PROT_READ | PROT_WRITE);
}

static int sim_set(struct rtp_backend *b, void *dst, const void *src, size_t n) {
  struct sim *s = sim_of(b);
  int rc = sim_host_begin(s, "set", dst, n);
  if (rc) return rc;
  if (n) memcpy(dst, src, n);
  return protect_range(dst, n, PROT_NONE);
}

static int sim_get(struct rtp_backend *b, void *dst, const void *src, size_t n) {
  struct sim *s = sim_of(b);
  int rc = sim_host_begin(s, "get", src, n);
  if (rc) return rc;
  if (n) memcpy(dst, src, n);
  return protect_range(src, n, PROT_NONE);
}

static int sim_zero(struct rtp_backend *b, void *dst, size_t n) {
  struct sim *s = sim_of(b);
  int rc = sim_host_begin(s, "zero", dst, n);
  if (rc) return rc;
  if (n) memset(dst, 0, n);
  return protect_range(dst, n, PROT_NONE);
}

/* ---- the streams ------------------------------------------------------------------ */

static int sim_push(struct sim *s, int stream, const struct sim_item *it) {
  if (it->kind == SIM_WAIT && s->drop_waits) return RTP_OK;
  struct sim_queue *q = &s->q[stream];
  if (q->len == q->cap) {
    size_t cap = q->cap ? 2 * q->cap : 64;
    struct sim_item *items = realloc(q->items, cap * sizeof(*items));
    if (!items) return rtp__error(RTP_ENOMEM, "simulated device: out of memory for its queue");
    q->items = items;
    q->cap = cap;
  }
  q->items[q->len++] = *it;
  return RTP_OK;
}

static bool sim_runnable(const struct sim *s, int stream) {
  const struct sim_queue *q = &s->q[stream];
  if (q->head == q->len) return false;
  const struct sim_item *it = &q->items[q->head];
  return it->kind != SIM_WAIT || it->seq == 0 || s->last_done[it->event] >= it->seq;
}

static int run_compute(struct sim *s, struct sim_item *it) {
  struct rtp_compute_params p = {0};
  p.nth = 1;
  p.work = it->work;
  s->kernel_status = 0;
  p.status = &s->kernel_status;
  rtp__compute_forward(&p, it->t);
  return s->kernel_status
             ? rtp__error(RTP_EINVAL, "%s: an index is out of range", rtp_op_name(it->t->op))
             : RTP_OK;
}

static int run_item(struct sim *s, struct sim_item *it) {
  switch (it->kind) {
    case SIM_COMPUTE:
      return run_compute(s, it);
    case SIM_COMM:
      return rtp__comm_post(it->c, &it->op, NULL);
    case SIM_ADAM:
      rtp__adam_update(&it->adam, 0, it->adam.n);
      return RTP_OK;
    case SIM_RECORD:
      s->last_done[it->event] = it->seq;
      return RTP_OK;
    case SIM_WAIT:
      return RTP_OK;
  }
  return RTP_OK;
}

static int pick_stream(struct sim *s) {
  bool r0 = sim_runnable(s, RTP_STREAM_COMPUTE), r1 = sim_runnable(s, RTP_STREAM_COMM);
  if (!r0 || !r1) return r0 ? RTP_STREAM_COMPUTE : r1 ? RTP_STREAM_COMM : -1;
  switch (s->order) {
    case RTP__SIM_COMPUTE_FIRST:
      return RTP_STREAM_COMPUTE;
    case RTP__SIM_COMM_FIRST:
      return RTP_STREAM_COMM;
    case RTP__SIM_RANDOM:
      break;
  }
  return (int)(sim_rand(s) & 1);
}

/* Runs everything queued, in an order the events allow, and returns the first failure
 * (reported once, like a device's at sync). A wait names a record enqueued before it, so
 * the order of enqueuing is one the events allow: some stream can always run. */
static int sim_drain(struct sim *s) {
  if (!sim_busy(s)) return RTP_OK;
  int status = protect_all(s, PROT_READ | PROT_WRITE); /* kernels touch any of it */
  if (status) return status;
  while (sim_busy(s)) {
    int st = pick_stream(s);
    RTP_ASSERT(st >= 0);
    struct sim_queue *q = &s->q[st];
    struct sim_item it = q->items[q->head++];
    int rc = run_item(s, &it);
    if (rc && !status) status = rc;
  }
  for (int i = 0; i < 2; i++) s->q[i].head = s->q[i].len = 0;
  int rc = protect_all(s, PROT_NONE);
  return status ? status : rc;
}

static size_t sim_work_size(struct rtp_backend *b, const struct rtp_tensor *t) {
  (void)b;
  return rtp__op_work_size(t);
}

static int sim_events_reserve(struct rtp_backend *b, int n) {
  struct sim *s = sim_of(b);
  if (n <= s->n_events) return RTP_OK;
  long *e = realloc(s->last_enqueued, (size_t)n * sizeof(*e));
  if (e) s->last_enqueued = e;
  long *d = e ? realloc(s->last_done, (size_t)n * sizeof(*d)) : NULL;
  if (!d) return rtp__error(RTP_ENOMEM, "simulated device: out of memory for %d events", n);
  s->last_done = d;
  for (int i = s->n_events; i < n; i++) e[i] = d[i] = 0;
  s->n_events = n;
  return RTP_OK;
}

static int sim_compute(struct rtp_backend *b, struct rtp_tensor *t, void *work) {
  struct sim_item it = {.kind = SIM_COMPUTE, .t = t, .work = work};
  return sim_push(sim_of(b), RTP_STREAM_COMPUTE, &it);
}

static int sim_comm(struct rtp_backend *b, struct rtp_comm *c, struct rtp_comm_op *op) {
  struct sim_item it = {.kind = SIM_COMM, .c = c, .op = *op};
  return sim_push(sim_of(b), RTP_STREAM_COMM, &it);
}

static int check_event(const struct sim *s, int e) {
  return e >= 0 && e < s->n_events
             ? RTP_OK
             : rtp__error(RTP_EINVAL, "simulated device: event %d was not reserved", e);
}

static int sim_record(struct rtp_backend *b, enum rtp_stream st, int e) {
  struct sim *s = sim_of(b);
  int rc = check_event(s, e);
  if (rc) return rc;
  s->last_enqueued[e] = ++s->n_records;
  struct sim_item it = {.kind = SIM_RECORD, .event = e, .seq = s->n_records};
  return sim_push(s, st, &it);
}

static int sim_wait(struct rtp_backend *b, enum rtp_stream st, int e) {
  struct sim *s = sim_of(b);
  int rc = check_event(s, e);
  if (rc) return rc;
  struct sim_item it = {.kind = SIM_WAIT, .event = e, .seq = s->last_enqueued[e]};
  return sim_push(s, st, &it);
}

static int sim_sync(struct rtp_backend *b) {
  return sim_drain(sim_of(b));
}

static int sim_adam(struct rtp_backend *b, const struct rtp_adam_args *a) {
  struct sim_item it = {.kind = SIM_ADAM, .adam = *a};
  return sim_push(sim_of(b), RTP_STREAM_COMPUTE, &it);
}

static int sim_sumsq(struct rtp_backend *b, const float *g, int64_t n, double *out) {
  struct sim *s = sim_of(b);
  size_t bytes = (size_t)n * sizeof(float);
  if (n < 0 || !sim_owns(s, g, bytes))
    return rtp__error(RTP_EINVAL,
                      "simulated device: sumsq of %lld floats at %p is not device memory",
                      (long long)n, (const void *)g);
  int rc = sim_drain(s);
  int prc = protect_range(g, bytes, PROT_READ);
  if (prc) return prc;
  double sum = 0;
  for (int64_t i = 0; i < n; i++) sum += (double)g[i] * g[i];
  *out = sum;
  prc = protect_range(g, bytes, PROT_NONE);
  return rc ? rc : prc;
}

static void sim_free(struct rtp_backend *b) {
  struct sim *s = sim_of(b);
  for (int i = 0; i < s->n_regions; i++) munmap(s->regions[i].p, s->regions[i].len);
  free(s->regions);
  for (int i = 0; i < 2; i++) free(s->q[i].items);
  free(s->last_enqueued);
  free(s->last_done);
  free(s);
}

static const struct rtp_backend_i sim_i = {
    .name = "sim",
    .free = sim_free,
    .alloc = sim_alloc,
    .release = sim_release,
    .set = sim_set,
    .get = sim_get,
    .zero = sim_zero,
    .work_size = sim_work_size,
    .events_reserve = sim_events_reserve,
    .compute = sim_compute,
    .comm = sim_comm,
    .record = sim_record,
    .wait = sim_wait,
    .sync = sim_sync,
    .adam = sim_adam,
    .sumsq = sim_sumsq,
    .has_kernel = NULL,
};

int rtp_backend_sim_new(unsigned seed, struct rtp_backend **out) {
  if (!out) return rtp__error(RTP_EINVAL, "rtp_backend_sim_new: NULL out");
  *out = NULL;
  struct sim *s = calloc(1, sizeof(*s));
  if (!s) return rtp__error(RTP_ENOMEM, "rtp_backend_sim_new: out of memory");
  s->base.i = &sim_i;
  s->base.impl = s;
  s->order = RTP__SIM_RANDOM;
  s->rng = seed;
  *out = &s->base;
  return RTP_OK;
}

/* ---- controls for the tests ------------------------------------------------------- */

int rtp__sim_set_order(struct rtp_backend *b, enum rtp__sim_order order) {
  struct sim *s = sim_cast(b);
  if (!s) return rtp__error(RTP_EINVAL, "rtp__sim_set_order: not a simulated device");
  s->order = order;
  return RTP_OK;
}

int rtp__sim_drop_waits(struct rtp_backend *b, bool drop) {
  struct sim *s = sim_cast(b);
  if (!s) return rtp__error(RTP_EINVAL, "rtp__sim_drop_waits: not a simulated device");
  s->drop_waits = drop;
  return RTP_OK;
}

long rtp__sim_host_touches_while_busy(struct rtp_backend *b) {
  struct sim *s = sim_cast(b);
  return s ? s->host_touch_while_busy : -1;
}
