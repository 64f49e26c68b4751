/*
 * rtp-nccl.c - the "nccl" transport: the device transport of a communicator (the world or
 * a group). It bootstraps through the communicator's public operations, which keep the
 * rendezvous, the authentication, the host-memory operations and the fault detection on
 * the host transport; this one moves device buffers, enqueued on a CUDA stream
 * (rtp_transport_i.post_stream). docs/transport.md, "NCCL", has the whole story.
 *
 * Joining. rtp_comm_init loads NCCL (rtp-nccl-lib.c: a CUDA build does not link it), checks
 * it and picks the CUDA device before the TCP rendezvous (rtp__nccl_prepare), so a rank
 * without them reports its own reason; once TCP is up (and for each group rtp_comm_split
 * makes of it), rtp__nccl_new: rank 0 makes an ncclUniqueId, it travels over TCP
 * (broadcast, then a check that every rank holds the same bytes), every rank joins with a
 * non-blocking ncclCommInitRankConfig polled against timeout_ms and the TCP communicator's
 * status, and a TCP barrier ends it. A failure on one rank fails its TCP communicator
 * (rtp_comm_abort: ABORT to every peer), so no other rank waits for it.
 *
 * Never hanging. NCCL kernels wait for their peers without a deadline: a peer that died or
 * never posts the operation leaves them spinning for ever. A watcher thread per
 * communicator checks, every tick (timeout_ms / 8, clamped to 10..100 ms):
 *   - the TCP communicator, which fails when a peer is lost, silent or failed;
 *   - ncclCommGetAsyncError (NCCL's own network and remote errors);
 *   - the oldest operation not known to be complete (events recorded before and after it
 *     on its stream): running for timeout_ms since its stream reached it means a peer is
 *     stuck or never posted it (the TCP transport's "no progress" rule). CUDA errors
 *     show up here too.
 * On any of these it records the failure (sticky), fails the TCP communicator with it,
 * which tells every peer, then aborts the NCCL communicator (ncclCommAbort), which ends
 * the kernels still waiting. An aborted operation ends without an error on its stream,
 * with garbage in its buffers: the failure is reported by rtp__nccl_check and
 * rtp_comm_status, which hold it before the abort lets any kernel go.
 *
 * Every NCCL call on a communicator is made under its mutex (posting, the watcher's
 * polls, the abort), as NCCL requires of a communicator shared by threads. A call of a
 * non-blocking communicator may return ncclInProgress; it is polled with
 * ncclCommGetAsyncError until done (settle_locked, bounded by timeout_ms) before the mutex
 * is released, so the next call never meets an unfinished one.
 */
#define _POSIX_C_SOURCE 200809L
#include "rtp-nccl.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime.h>

#include "rtp-nccl-lib.h"

#define NC_TRACK 64 /* posted operations whose completion the watcher follows */
#define NC_MSG 512

struct rtp_nccl {
  struct rtp_comm *c;
  int rank, size, device, timeout_ms;
  pthread_mutex_t mu; /* every NCCL call on comm, and everything below */
  pthread_cond_t cv;  /* wakes the watcher to stop */
  ncclComm_t comm;    /* NULL once aborted or destroyed */
  int failed;         /* sticky status */
  char msg[NC_MSG];
  bool device_checked; /* the first posted buffer was on our device */
  uint64_t nops;       /* operations posted */
  /* Posted operations ops[tail .. head-1 mod NC_TRACK], oldest first. */
  struct nc_op {
    cudaEvent_t start, done; /* recorded before and after it on its stream */
    uint64_t num;            /* its number, from 0 */
    uint64_t started_ms;     /* when the watcher first saw it started; 0: not yet */
    const char *what;
  } ops[NC_TRACK];
  uint64_t head, tail;
  int n_events; /* ops[0 .. n_events-1] have their events */
  pthread_t watcher;
  bool watching, stop;
};

static uint64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

/* ---- errors ------------------------------------------------------------------------ */

int rtp__nccl_status(int nccl_result) {
  switch ((ncclResult_t)nccl_result) {
    case ncclSuccess:
      return RTP_OK;
    case ncclInvalidArgument: /* a bad call of ours: nothing was sent */
    case ncclInvalidUsage:    /* e.g. two ranks on one GPU */
      return RTP_EINVAL;
    case ncclRemoteError: /* a peer died or the network failed */
      return RTP_EPEER;
    default: /* ncclUnhandledCudaError, ncclSystemError, ncclInternalError, later codes */
      return RTP_ECOMM;
  }
}

int rtp__nccl_cuda_status(int cuda_error) {
  switch ((cudaError_t)cuda_error) {
    case cudaSuccess:
      return RTP_OK;
    case cudaErrorNoDevice: /* no usable device, driver or code for it here */
    case cudaErrorInsufficientDriver:
    case cudaErrorNoKernelImageForDevice:
    case cudaErrorUnsupportedPtxVersion:
    case cudaErrorStubLibrary:
    case cudaErrorCallRequiresNewerDriver:
    case cudaErrorSystemDriverMismatch:
    case cudaErrorCompatNotSupportedOnDevice:
    case cudaErrorDevicesUnavailable:
    case cudaErrorSystemNotReady:
    case cudaErrorNotSupported:
      return RTP_ENOSYS;
    case cudaErrorMemoryAllocation:
      return RTP_ENOMEM;
    case cudaErrorInvalidValue:
    case cudaErrorInvalidDevice:
    case cudaErrorInvalidDevicePointer:
    case cudaErrorInvalidResourceHandle:
      return RTP_EINVAL;
    default:
      return RTP_ECOMM;
  }
}

int rtp__nccl_error(int rank, int device, const char *call, int nccl_result,
                    const char *detail) {
  bool d = detail && detail[0];
  const char *text = rtp__nccl_load() == RTP_OK
                         ? rtp__nccl_fn.GetErrorString((ncclResult_t)nccl_result)
                         : "NCCL error";
  return rtp__error(rtp__nccl_status(nccl_result),
                    "NCCL rank %d (device %d): %s failed: %s%s%s%s", rank, device, call, text,
                    d ? " (" : "", d ? detail : "", d ? ")" : "");
}

int rtp__nccl_cuda_error(int rank, int device, const char *call, int cuda_error) {
  cudaError_t e = (cudaError_t)cuda_error;
  return rtp__error(rtp__nccl_cuda_status(cuda_error),
                    "NCCL rank %d (device %d): %s failed: %s (%s)", rank, device, call,
                    cudaGetErrorString(e), cudaGetErrorName(e));
}

static void abort_locked(struct rtp_nccl *n) {
  if (!n->comm) return;
  ncclComm_t comm = n->comm;
  n->comm = NULL;
  ncclResult_t r = rtp__nccl_fn.CommAbort(comm); /* frees comm: never poll it afterwards */
  if (r != ncclSuccess && r != ncclInProgress)
    RTP_LOG_WARN("NCCL rank %d: ncclCommAbort: %s", n->rank, rtp__nccl_fn.GetErrorString(r));
}

/* Fails n for good with (status, msg), unless it failed already: the TCP communicator
 * first (so rtp_comm_status and every peer know before any aborted kernel returns), then
 * the NCCL communicator. Returns the first failure, recorded as the thread's error. */
static int fail_locked(struct rtp_nccl *n, int status, const char *msg) {
  if (!n->failed) {
    n->failed = status;
    snprintf(n->msg, sizeof(n->msg), "%s", msg);
    rtp_comm_abort(n->c, status, n->msg); /* nothing if the failure came from TCP */
  }
  abort_locked(n);
  return rtp__error(n->failed, "%s", n->msg);
}

static int nccl_fail_locked(struct rtp_nccl *n, const char *call, ncclResult_t r) {
  const char *last =
      n->comm ? rtp__nccl_fn.GetLastError(n->comm) : rtp__nccl_fn.GetLastError(NULL);
  rtp__nccl_error(n->rank, n->device, call, r, last);
  return fail_locked(n, rtp__nccl_status(r), rtp_last_error());
}

/* Records a CUDA failure of this rank (without failing n) and returns its status. */
static int cuda_error(const struct rtp_nccl *n, const char *call, cudaError_t e) {
  (void)cudaGetLastError(); /* not reported again by the next CUDA user of this thread */
  return rtp__nccl_cuda_error(n->rank, n->device, call, e);
}

static int cuda_fail_locked(struct rtp_nccl *n, const char *call, cudaError_t e) {
  return fail_locked(n, cuda_error(n, call, e), rtp_last_error());
}

/* RTP_OK, or fails n with the TCP communicator's failure (or n's own, if first). */
static int check_locked(struct rtp_nccl *n) {
  if (n->failed) return rtp__error(n->failed, "%s", n->msg);
  const char *msg;
  int st = rtp_comm_status(n->c, &msg);
  return st ? fail_locked(n, st, msg) : RTP_OK;
}

/* Waits until the NCCL call that returned r is done: ncclInProgress is polled with
 * ncclCommGetAsyncError for at most timeout_ms, giving up at once if TCP fails. */
static int settle_locked(struct rtp_nccl *n, ncclResult_t r, const char *call) {
  uint64_t t0 = now_ms();
  while (r == ncclInProgress) {
    int st = check_locked(n);
    if (st) return st;
    if (now_ms() - t0 > (uint64_t)n->timeout_ms) {
      char m[NC_MSG];
      snprintf(m, sizeof(m), "NCCL rank %d (device %d): %s still in progress after %d ms",
               n->rank, n->device, call, n->timeout_ms);
      return fail_locked(n, RTP_ETIMEDOUT, m);
    }
    nanosleep(&(struct timespec){0, 200000}, NULL);
    ncclResult_t q = rtp__nccl_fn.CommGetAsyncError(n->comm, &r);
    if (q != ncclSuccess) r = q;
  }
  return r == ncclSuccess ? RTP_OK : nccl_fail_locked(n, call, r);
}

/* ---- the watcher -------------------------------------------------------------------- */

/* Retires completed operations; fails n if the oldest one has run for timeout_ms without
 * completing, or CUDA failed. An operation runs from when its stream reaches it (its
 * start event), not from when it was posted: the executor posts a step's transfers long
 * before the compute they wait for is done. */
static int progress_locked(struct rtp_nccl *n) {
  while (n->tail != n->head) {
    struct nc_op *o = &n->ops[n->tail % NC_TRACK];
    cudaError_t e = cudaEventQuery(o->done);
    if (e == cudaSuccess) {
      n->tail++;
      continue;
    }
    if (e != cudaErrorNotReady) return cuda_fail_locked(n, "cudaEventQuery", e);
    uint64_t now = now_ms();
    if (!o->started_ms) {
      e = cudaEventQuery(o->start);
      if (e == cudaErrorNotReady) break; /* still behind other work on its stream */
      if (e != cudaSuccess) return cuda_fail_locked(n, "cudaEventQuery", e);
      o->started_ms = now;
    }
    if (now - o->started_ms <= (uint64_t)n->timeout_ms) break;
    char m[NC_MSG];
    snprintf(m, sizeof(m),
             "NCCL rank %d (device %d): %s #%" PRIu64 " not complete %" PRIu64
             " ms after it started (timeout %d ms): did a rank die, hang, or not post it?",
             n->rank, n->device, o->what, o->num, now - o->started_ms, n->timeout_ms);
    return fail_locked(n, RTP_ETIMEDOUT, m);
  }
  return RTP_OK;
}

static void watch_locked(struct rtp_nccl *n) {
  if (n->failed || check_locked(n)) return;
  ncclResult_t r = ncclSuccess, q = rtp__nccl_fn.CommGetAsyncError(n->comm, &r);
  if (q != ncclSuccess) r = q;
  if (r != ncclSuccess && r != ncclInProgress) {
    nccl_fail_locked(n, "an asynchronous operation", r);
    return;
  }
  progress_locked(n);
}

static void *watch_main(void *arg) {
  struct rtp_nccl *n = arg;
  cudaSetDevice(n->device); /* for the event queries; it worked on the joining thread */
  long tick = n->timeout_ms / 8;
  tick = tick < 10 ? 10 : tick > 100 ? 100 : tick;
  pthread_mutex_lock(&n->mu);
  while (!n->stop) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    ts.tv_nsec += tick * 1000000L;
    ts.tv_sec += ts.tv_nsec / 1000000000L;
    ts.tv_nsec %= 1000000000L;
    pthread_cond_timedwait(&n->cv, &n->mu, &ts);
    if (!n->stop) watch_locked(n);
  }
  pthread_mutex_unlock(&n->mu);
  return NULL;
}

/* ---- joining ------------------------------------------------------------------------- */

static uint64_t fnv1a(const void *p, size_t n) {
  const uint8_t *b = p;
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ull;
  return h;
}

int rtp__nccl_check_same(struct rtp_comm *c, const void *p, size_t n) {
  int rank = rtp_comm_rank(c), size = rtp_comm_size(c);
  uint8_t *h = calloc((size_t)size, 8);
  if (!h) return rtp__error(RTP_ENOMEM, "NCCL rank %d: out of memory", rank);
  uint64_t mine = fnv1a(p, n);
  for (int i = 0; i < 8; i++) h[8 * rank + i] = (uint8_t)(mine >> (8 * i)); /* little-endian */
  int st = rtp_comm_allgather(c, h, (size_t)size, 8, NULL);
  if (!st) {
    char bad[96] = "";
    size_t off = 0;
    for (int q = 1; q < size; q++)
      if (memcmp(h + 8 * q, h, 8) != 0 && off < sizeof(bad) - 16)
        off += (size_t)snprintf(bad + off, sizeof(bad) - off, " %d", q);
    if (off)
      st = rtp__error(RTP_EPEER,
                      "NCCL rank %d: the NCCL unique id of rank(s)%s differs from rank 0's",
                      rank, bad);
  }
  free(h);
  return st;
}

int rtp__nccl_exchange_id(struct rtp_comm *c, void *id, size_t n) {
  int st = rtp_comm_broadcast(c, id, n, 0, NULL);
  return st ? st : rtp__nccl_check_same(c, id, n);
}

/* The rank among this host's ranks: RTP_LOCAL_RANK (rtp-run sets it), else the rank. */
static int local_rank(int rank, int *out) {
  const char *s = getenv("RTP_LOCAL_RANK");
  *out = rank;
  if (!s || !*s) return RTP_OK;
  char *end;
  errno = 0;
  long v = strtol(s, &end, 10);
  if (errno || *end || v < 0 || v > 1 << 20)
    return rtp__error(RTP_EINVAL, "NCCL rank %d: RTP_LOCAL_RANK='%s' is not an integer >= 0",
                      rank, s);
  *out = (int)v;
  return RTP_OK;
}

int rtp__nccl_prepare(int rank, int device, int *out) {
  int st = rtp__nccl_load();
  if (st) {
    char msg[NC_MSG];
    snprintf(msg, sizeof(msg), "%s", rtp_last_error());
    return rtp__error(st, "NCCL rank %d: %s", rank, msg);
  }
  /* The library found at run time, which may be older than the headers. Non-blocking
   * communicators came in 2.14; aborting from another thread is reliable since 2.19. */
  int v = 0;
  rtp__nccl_fn.GetVersion(&v);
  int major = v >= 10000 ? v / 10000 : v / 1000,
      minor = v >= 10000 ? v / 100 % 100 : v / 100 % 10;
  if (v < 21400)
    return rtp__error(
        RTP_ENOSYS,
        "NCCL rank %d: NCCL %d.%d is too old for the nccl backend (2.14 or later, "
        "2.19 or later recommended)",
        rank, major, minor);
  static int warned;
  if (v < 21900 && !__atomic_exchange_n(&warned, 1, __ATOMIC_RELAXED))
    RTP_LOG_WARN(
        "NCCL rank %d: NCCL %d.%d may hang when a failed communicator is aborted; "
        "2.19 or later is recommended",
        rank, major, minor);
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    char why[NC_MSG];
    if (rtp__cuda_driver_why(why, sizeof(why)))
      return rtp__error(RTP_ENOSYS, "NCCL rank %d: no CUDA device for the nccl backend: %s",
                        rank, why);
    return rtp__error(RTP_ENOSYS,
                      "NCCL rank %d: no CUDA device for the nccl backend (cudaGetDeviceCount: "
                      "%s (%s))",
                      rank, cudaGetErrorString(e), cudaGetErrorName(e));
  }
  if (count <= 0)
    return rtp__error(RTP_ENOSYS, "NCCL rank %d: no CUDA device for the nccl backend", rank);
  if (device < 0) {
    int lr;
    st = local_rank(rank, &lr);
    if (st) return st;
    device = lr % count;
  } else if (device >= count) {
    return rtp__error(RTP_EINVAL,
                      "NCCL rank %d: CUDA device %d does not exist (%d on this host)", rank,
                      device, count);
  }
  e = cudaSetDevice(device);
  if (e) {
    (void)cudaGetLastError();
    return rtp__nccl_cuda_error(rank, device, "cudaSetDevice", e);
  }
  *out = device;
  return RTP_OK;
}

static int join(struct rtp_nccl *n, int device) {
  int st = rtp__nccl_prepare(n->rank, device, &n->device);
  if (st) return st;
  for (; n->n_events < NC_TRACK; n->n_events++) {
    struct nc_op *o = &n->ops[n->n_events];
    cudaError_t e = cudaEventCreateWithFlags(&o->start, cudaEventDisableTiming);
    if (e) return cuda_error(n, "cudaEventCreateWithFlags", e);
    e = cudaEventCreateWithFlags(&o->done, cudaEventDisableTiming);
    if (e) {
      cudaEventDestroy(o->start);
      return cuda_error(n, "cudaEventCreateWithFlags", e);
    }
  }
  ncclUniqueId id;
  memset(&id, 0, sizeof(id));
  if (n->rank == 0) {
    ncclResult_t r = rtp__nccl_fn.GetUniqueId(&id);
    if (r)
      return rtp__nccl_error(n->rank, n->device, "ncclGetUniqueId", r,
                             rtp__nccl_fn.GetLastError(NULL));
  }
  if ((st = rtp__nccl_exchange_id(n->c, &id, sizeof(id))) < 0) return st;
  /* Non-blocking, so that a peer that never joins costs timeout_ms, not forever. */
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  ncclComm_t comm = NULL;
  ncclResult_t r = rtp__nccl_fn.CommInitRankConfig(&comm, n->size, id, n->rank, &cfg);
  pthread_mutex_lock(&n->mu);
  n->comm = r == ncclSuccess || r == ncclInProgress ? comm : NULL;
  st = settle_locked(n, r, "ncclCommInitRankConfig");
  pthread_mutex_unlock(&n->mu);
  if (st) return st;
  /* Every rank has joined (a rank that failed has failed TCP, so this fails too). */
  if ((st = rtp_comm_barrier(n->c, NULL)) < 0) return st;
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_BLOCK, &all, &old); /* signals go to the user's threads */
  int prc = pthread_create(&n->watcher, NULL, watch_main, n);
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  if (prc)
    return rtp__error(RTP_ECOMM, "NCCL rank %d: cannot start the watcher thread", n->rank);
  n->watching = true;
  return RTP_OK;
}

static void destroy(struct rtp_nccl *n) {
  if (n->watching) {
    pthread_mutex_lock(&n->mu);
    n->stop = true;
    pthread_cond_signal(&n->cv);
    pthread_mutex_unlock(&n->mu);
    pthread_join(n->watcher, NULL);
  }
  pthread_mutex_lock(&n->mu);
  int old = -1;
  bool dev = n->device >= 0 && cudaGetDevice(&old) == cudaSuccess;
  if (dev) cudaSetDevice(n->device);
  if (n->comm && !n->failed) { /* flush, then free; a peer that is gone costs timeout_ms */
    if (settle_locked(n, rtp__nccl_fn.CommFinalize(n->comm), "ncclCommFinalize") == RTP_OK) {
      ncclResult_t r = rtp__nccl_fn.CommDestroy(n->comm);
      n->comm = NULL;
      if (r)
        RTP_LOG_WARN("NCCL rank %d: ncclCommDestroy: %s", n->rank,
                     rtp__nccl_fn.GetErrorString(r));
    }
  }
  abort_locked(n);
  for (int i = 0; i < n->n_events; i++) {
    cudaEventDestroy(n->ops[i].start);
    cudaEventDestroy(n->ops[i].done);
  }
  if (dev) cudaSetDevice(old);
  pthread_mutex_unlock(&n->mu);
  pthread_mutex_destroy(&n->mu);
  pthread_cond_destroy(&n->cv);
  free(n);
}

static int nccl_init(struct rtp_comm *c, int device, int timeout_ms, struct rtp_nccl **out) {
  *out = NULL;
  struct rtp_nccl *n = calloc(1, sizeof(*n));
  int st;
  if (!n) {
    st = rtp__error(RTP_ENOMEM, "NCCL rank %d: out of memory", rtp_comm_rank(c));
    rtp_comm_abort(c, st, rtp_last_error());
    return st;
  }
  n->c = c;
  n->rank = rtp_comm_rank(c);
  n->size = rtp_comm_size(c);
  n->device = -1;
  n->timeout_ms = timeout_ms;
  pthread_mutex_init(&n->mu, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&n->cv, &ca);
  pthread_condattr_destroy(&ca);
  st = join(n, device);
  if (st) {
    char msg[NC_MSG];
    snprintf(msg, sizeof(msg), "%s", rtp_last_error());
    rtp_comm_abort(c, st, msg); /* every peer stops waiting for this rank */
    destroy(n);
    return rtp__error(st, "%s", msg);
  }
  *out = n;
  return RTP_OK;
}

int rtp__nccl_check(struct rtp_nccl *n) {
  pthread_mutex_lock(&n->mu);
  int st = check_locked(n);
  pthread_mutex_unlock(&n->mu);
  return st;
}

/* ---- posting ------------------------------------------------------------------------- */

/* Records the start event of the operation about to be enqueued on stream, unless all
 * NC_TRACK are followed already (then an older one still pending times out first). */
static int begin_locked(struct rtp_nccl *n, cudaStream_t stream, bool *follow) {
  *follow = false;
  if (n->head - n->tail == NC_TRACK) {
    int st = progress_locked(n);
    if (st || n->head - n->tail == NC_TRACK) return st;
  }
  cudaError_t e = cudaEventRecord(n->ops[n->head % NC_TRACK].start, stream);
  if (e) return cuda_fail_locked(n, "cudaEventRecord", e);
  *follow = true;
  return RTP_OK;
}

/* Records the done event of the operation begin_locked started to follow. */
static int end_locked(struct rtp_nccl *n, const char *what, cudaStream_t stream) {
  struct nc_op *o = &n->ops[n->head % NC_TRACK];
  cudaError_t e = cudaEventRecord(o->done, stream);
  if (e) return cuda_fail_locked(n, "cudaEventRecord", e);
  o->num = n->nops - 1;
  o->started_ms = 0;
  o->what = what;
  n->head++;
  return RTP_OK;
}

/* The first buffer posted must be on this communicator's device. */
static int check_device_locked(struct rtp_nccl *n, const struct rtp_comm_op *op) {
  const void *p = op->buf ? (const void *)op->buf : (const void *)op->sbuf;
  const char *name = op->what ? op->what : "?";
  if (n->device_checked || !p) return RTP_OK;
  struct cudaPointerAttributes a;
  cudaError_t e = cudaPointerGetAttributes(&a, p);
  if (e) return cuda_error(n, "cudaPointerGetAttributes", e);
  if (a.type != cudaMemoryTypeDevice && a.type != cudaMemoryTypeManaged)
    return rtp__error(RTP_EINVAL, "NCCL rank %d: tensor '%s' is not in CUDA device memory",
                      n->rank, name);
  if (a.device != n->device)
    return rtp__error(
        RTP_EINVAL,
        "NCCL rank %d: tensor '%s' is on CUDA device %d, the NCCL communicator on "
        "device %d (rtp_comm_params.device / RTP_DEVICE must be the backend's)",
        n->rank, name, a.device, n->device);
  n->device_checked = true;
  return RTP_OK;
}

/* A message (either side may be absent) or a rotation; both ends agree on the sizes. */
static int post_p2p(struct rtp_nccl *n, const struct rtp_comm_op *op, cudaStream_t s) {
  if (op->dst == n->rank) { /* a rotation onto oneself (one rank): a copy */
    if (!op->rbytes || op->buf == op->sbuf) return RTP_OK;
    cudaError_t e = cudaMemcpyAsync(op->buf, op->sbuf, op->rbytes, cudaMemcpyDeviceToDevice, s);
    return e ? cuda_fail_locked(n, "cudaMemcpyAsync", e) : RTP_OK;
  }
  /* Both sides of every pair agree on the size, so both skip an empty message. */
  ncclResult_t r = rtp__nccl_fn.GroupStart(), r1 = ncclSuccess;
  if (r != ncclSuccess) return nccl_fail_locked(n, "ncclGroupStart", r);
  if (op->dst >= 0 && op->sbytes)
    r1 = rtp__nccl_fn.Send(op->sbuf, op->sbytes, ncclInt8, op->dst, n->comm, s);
  if ((r1 == ncclSuccess || r1 == ncclInProgress) && op->src >= 0 && op->rbytes)
    r1 = rtp__nccl_fn.Recv(op->buf, op->rbytes, ncclInt8, op->src, n->comm, s);
  r = rtp__nccl_fn.GroupEnd(); /* closes the group whatever happened inside */
  if (r1 != ncclSuccess && r1 != ncclInProgress)
    return nccl_fail_locked(n, "ncclSend/ncclRecv", r1);
  return settle_locked(n, r, "ncclGroupEnd (ncclSend, ncclRecv)");
}

static int post_allreduce(struct rtp_nccl *n, const struct rtp_comm_op *op, cudaStream_t s) {
  if (!op->count) return RTP_OK;
  ncclResult_t r =
      rtp__nccl_fn.AllReduce(op->buf, op->buf, op->count, ncclFloat32, ncclSum, n->comm, s);
  return settle_locked(n, r, "ncclAllReduce");
}

/* Block q (rtp_comm_block) of count elements from rank q to every rank, in place. Equal
 * blocks are one ncclAllGather; uneven ones (which it cannot do) one ncclBroadcast per
 * block, in a group. */
static int post_allgather(struct rtp_nccl *n, const struct rtp_comm_op *op, cudaStream_t s) {
  size_t count = op->count, esize = op->esize;
  uint8_t *buf = op->buf;
  if (!count) return RTP_OK;
  ncclResult_t r;
  const char *call;
  if (count % (size_t)n->size == 0) {
    size_t blk = count / (size_t)n->size * esize;
    call = "ncclAllGather";
    r = rtp__nccl_fn.AllGather(buf + (size_t)n->rank * blk, buf, blk, ncclInt8, n->comm, s);
  } else {
    call = "ncclGroupEnd (ncclBroadcast per block)";
    r = rtp__nccl_fn.GroupStart();
    if (r != ncclSuccess) return nccl_fail_locked(n, "ncclGroupStart", r);
    ncclResult_t r1 = ncclSuccess;
    for (int q = 0; q < n->size && (r1 == ncclSuccess || r1 == ncclInProgress); q++) {
      size_t first, len;
      rtp_comm_block(count, n->size, q, &first, &len);
      if (len)
        r1 = rtp__nccl_fn.Broadcast(buf + first * esize, buf + first * esize, len * esize,
                                    ncclInt8, q, n->comm, s);
    }
    r = rtp__nccl_fn.GroupEnd();
    if (r1 != ncclSuccess && r1 != ncclInProgress)
      return nccl_fail_locked(n, "ncclBroadcast", r1);
  }
  return settle_locked(n, r, call);
}

/* What NCCL is asked for must make sense: a mistake of ours, before anything is sent. */
static int check_op(const struct rtp_nccl *n, const struct rtp_comm_op *op) {
  const char *name = op->what ? op->what : "?";
  if (op->kind == RTP_COMM_K_P2P) {
    bool self = op->dst == n->rank || op->src == n->rank;
    if (op->dst < -1 || op->dst >= n->size || op->src < -1 || op->src >= n->size ||
        (op->dst < 0 && op->src < 0) || (self && (op->dst != n->rank || op->src != n->rank)))
      return rtp__error(RTP_EINVAL,
                        "NCCL rank %d: send/recv '%s': dst %d, src %d (world size %d)", n->rank,
                        name, op->dst, op->src, n->size);
    if (self && op->rbytes != op->sbytes)
      return rtp__error(RTP_EINVAL,
                        "NCCL rank %d: sendrecv '%s' to oneself: %zu bytes sent, %zu received",
                        n->rank, name, (size_t)op->sbytes, (size_t)op->rbytes);
  } else if (op->kind == RTP_COMM_K_ALLREDUCE) {
    if (op->esize != sizeof(float))
      return rtp__error(RTP_EINVAL, "NCCL rank %d: allreduce '%s' is not f32", n->rank, name);
  } else if (op->kind != RTP_COMM_K_ALLGATHER) {
    return rtp__error(RTP_EINVAL, "NCCL rank %d: '%s': no device %s", n->rank, name,
                      rtp__comm_kind_name(op->kind));
  }
  return RTP_OK;
}

int rtp__nccl_post(struct rtp_nccl *n, const struct rtp_comm_op *op, void *stream) {
  if (!n || !op) return rtp__error(RTP_EINVAL, "rtp__nccl_post: NULL argument");
  int st = check_op(n, op);
  if (st) return st;
  cudaStream_t s = (cudaStream_t)stream;
  bool follow = false;
  pthread_mutex_lock(&n->mu);
  st = check_locked(n);
  if (!st) st = check_device_locked(n, op);
  if (!st) st = begin_locked(n, s, &follow);
  if (!st) {
    n->nops++;
    if (op->kind == RTP_COMM_K_P2P)
      st = post_p2p(n, op, s);
    else if (op->kind == RTP_COMM_K_ALLREDUCE)
      st = post_allreduce(n, op, s);
    else
      st = post_allgather(n, op, s);
  }
  if (!st && follow) st = end_locked(n, rtp__comm_kind_name(op->kind), s);
  pthread_mutex_unlock(&n->mu);
  return st;
}

/* ---- the transport interface ----------------------------------------------------------- */

static int nccl_post_stream(struct rtp_transport *t, const struct rtp_comm_op *op,
                            void *stream) {
  return rtp__nccl_post(t->impl, op, stream);
}

static void nccl_free(struct rtp_transport *t) {
  destroy(t->impl);
  free(t);
}

static const struct rtp_transport_i nccl_i = {
    .name = "nccl", .post_stream = nccl_post_stream, .free = nccl_free};

int rtp__nccl_new(struct rtp_comm *c, int device, int timeout_ms, struct rtp_transport **out) {
  *out = NULL;
  struct rtp_transport *t = malloc(sizeof(*t));
  struct rtp_nccl *n = NULL;
  int st = t ? nccl_init(c, device, timeout_ms, &n)
             : rtp__error(RTP_ENOMEM, "NCCL rank %d: out of memory", rtp_comm_rank(c));
  if (st) {
    if (!t) rtp_comm_abort(c, st, rtp_last_error()); /* every peer stops waiting */
    free(t);
    return st;
  }
  *t = (struct rtp_transport){&nccl_i, n};
  *out = t;
  return RTP_OK;
}

struct rtp_nccl *rtp__comm_nccl(const struct rtp_comm *c) {
  struct rtp_transport *t = rtp__comm_device(c);
  return t && t->i == &nccl_i ? t->impl : NULL;
}
