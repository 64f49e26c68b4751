/* rtp-cuda-stage.cu - transfers of device tensors through a communicator that has no device
 * transport (tcp: two ranks on one GPU, which NCCL refuses, or GPUs on some hosts only).
 * Each transfer is staged through page-locked host memory on the comm stream, so compute
 * keeps overlapping it as it does an NCCL transfer:
 *
 *   cudaMemcpyAsync device -> pinned   what the operation reads
 *   cudaLaunchHostFunc                 posts it to the host transport, waits for it
 *   cudaMemcpyAsync pinned -> device   what it wrote
 *
 * Order. The host function runs on a CUDA driver thread, whenever the stream reaches it,
 * while the enqueuing thread may post other operations (the optimizer's scalar all-reduce).
 * Operations are therefore numbered when enqueued (rtp__comm_number), in program order,
 * and only submitted by the host function: every rank matches the same operations
 * whichever thread posts first. The transports take posts from any thread.
 *
 * Memory. The comm stream runs one staged transfer at a time, so one pinned buffer serves
 * all. It grows when a transfer needs more (the first step of a graph); the buffer it
 * replaces may still be read by queued work, so it is freed at the next sync. The jobs
 * the host functions read are kept and reused the same way: a steady step allocates
 * nothing.
 *
 * Failure. A host function cannot return an error, nor call CUDA: it records the first
 * failure (the communicator's message) for stage_status and sync, and aborts the
 * communicator, so that peers waiting for its operations fail too rather than wait.
 * Later host functions see the failure and return at once: the stream drains, nothing
 * hangs. */
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "rtp-cuda-stage.h"

namespace rtp_cuda {

struct stage_job {
  stage_job *next;
  cuda_stage *s;
  struct rtp_comm *comm;
  struct rtp_comm_op op; /* numbered, on pinned memory */
  char what[RTP_MAX_NAME];
};

struct stage_retired {
  stage_retired *next;
  void *p;
};

namespace {

const size_t kAlign = 256;

size_t pad(size_t n) {
  return (n + kAlign - 1) / kAlign * kAlign;
}

/* rtp-cuda.h's RTP_CUDA_TRY, again: this file is also compiled against the fake runtime
 * (test-cuda-stage-fake), which has no cuBLAS or kernels for rtp-cuda.h to declare. */
#define STAGE_TRY(s, call)                                                     \
  do {                                                                         \
    cudaError_t e_ = (call);                                                   \
    if (e_ != cudaSuccess) return rtp_cuda::cuda_fail((s)->device, e_, #call); \
  } while (0)

/* Records the first failure; from any thread. */
void stage_fail(cuda_stage *s, int status, const char *msg) {
  pthread_mutex_lock(&s->mu);
  if (!s->failed) {
    s->failed = status;
    snprintf(s->msg, sizeof(s->msg), "%s", msg);
  }
  pthread_mutex_unlock(&s->mu);
}

/* The host function: posts the job's operation and waits for it. No CUDA calls here. */
void CUDART_CB stage_run(void *arg) {
  stage_job *j = (stage_job *)arg;
  if (stage_status(j->s)) return; /* the job failed: the communicator was aborted */
  int st = rtp__comm_submit(j->comm, &j->op, nullptr);
  if (!st) return;
  char msg[512];                                      /* as long as rtp_last_error */
  snprintf(msg, sizeof(msg), "%s", rtp_last_error()); /* this thread's */
  stage_fail(j->s, st, msg);
  rtp_comm_abort(j->comm, st, msg);
}

/* A pinned buffer of at least n bytes for the next transfer. */
int stage_reserve(cuda_stage *s, size_t n) {
  if (n <= s->cap) return RTP_OK;
  size_t cap = (n + ((size_t)1 << 20) - 1) >> 20 << 20; /* whole MiB */
  stage_retired *old = s->pinned ? (stage_retired *)malloc(sizeof(*old)) : nullptr;
  if (s->pinned && !old)
    return rtp__error(RTP_ENOMEM, "cuda device %d: staging buffer: out of memory", s->device);
  void *p = nullptr;
  cudaError_t e = cudaHostAlloc(&p, cap, cudaHostAllocDefault);
  if (e != cudaSuccess) {
    free(old);
    char what[160];
    snprintf(what, sizeof(what), "cudaHostAlloc of %zu bytes (pinned staging for tcp)", cap);
    return cuda_fail(s->device, e, what);
  }
  if (old) {
    *old = {s->retired, s->pinned};
    s->retired = old;
  }
  s->pinned = (uint8_t *)p;
  s->cap = cap;
  return RTP_OK;
}

stage_job *job_take(cuda_stage *s) {
  stage_job *j = s->free_jobs;
  if (j)
    s->free_jobs = j->next;
  else if (!(j = (stage_job *)calloc(1, sizeof(*j))))
    return nullptr;
  j->next = s->queued;
  s->queued = j;
  return j;
}

/* The byte ranges of op's buffers (device and pinned): what is copied out before the
 * post and in after it. A collective works in place on one range; a message sends one
 * and receives into another. */
struct stage_plan {
  const uint8_t *out_dev; /* copied to pinned + out_at */
  size_t out_at, out_n;
  uint8_t *in_dev; /* copied from pinned + in_at */
  size_t in_at, in_n;
  size_t need;
};

void plan_of(const struct rtp_comm_op *op, stage_plan *p) {
  *p = {};
  if (op->kind == RTP_COMM_K_P2P) {
    p->out_dev = op->sbuf, p->out_n = op->sbytes;
    p->in_dev = op->buf, p->in_at = pad(op->sbytes), p->in_n = op->rbytes;
    p->need = p->in_at + op->rbytes;
    return;
  }
  size_t n = op->count * op->esize;
  p->out_dev = op->buf, p->out_n = n;
  p->in_dev = op->buf, p->in_n = n;
  p->need = n;
  if (op->kind == RTP_COMM_K_ALLGATHER) { /* only this rank's block goes out */
    size_t first, len;
    rtp_comm_block(op->count, op->size, op->rank, &first, &len);
    p->out_dev = op->buf + first * op->esize;
    p->out_at = first * op->esize, p->out_n = len * op->esize;
  } else if (op->kind == RTP_COMM_K_BROADCAST) { /* only the root's goes out */
    if (op->rank != op->root) p->out_n = 0;
  }
}

/* Enqueues the copies and the host function of the numbered op. */
int stage_enqueue(cuda_stage *s, cudaStream_t stream, struct rtp_comm *c,
                  const struct rtp_comm_op *op) {
  stage_plan p;
  plan_of(op, &p);
  int rc = stage_reserve(s, p.need);
  if (rc) return rc;
  stage_job *j = job_take(s);
  if (!j) return rtp__error(RTP_ENOMEM, "cuda device %d: staging: out of memory", s->device);
  uint8_t *pin = s->pinned;
  j->s = s;
  j->comm = c;
  j->op = *op;
  snprintf(j->what, sizeof(j->what), "%s", op->what ? op->what : "");
  j->op.what = j->what;
  if (op->kind == RTP_COMM_K_P2P) {
    j->op.sbuf = op->sbytes ? pin : nullptr;
    j->op.buf = op->rbytes ? pin + p.in_at : nullptr;
  } else {
    j->op.buf = p.need ? pin : nullptr;
  }
  if (p.out_n)
    STAGE_TRY(
        s, cudaMemcpyAsync(pin + p.out_at, p.out_dev, p.out_n, cudaMemcpyDeviceToHost, stream));
  STAGE_TRY(s, cudaLaunchHostFunc(stream, stage_run, j));
  if (p.in_n)
    STAGE_TRY(s,
              cudaMemcpyAsync(p.in_dev, pin + p.in_at, p.in_n, cudaMemcpyHostToDevice, stream));
  return RTP_OK;
}

}  // namespace

int stage_comm(cuda_stage *s, cudaStream_t stream, struct rtp_comm *c, struct rtp_comm_op *op) {
  int rc = stage_status(s);
  if (rc) return rc;
  if ((rc = rtp__comm_number(c, op))) return rc;
  if ((rc = stage_enqueue(s, stream, c, op))) {
    /* Numbered but never posted: the peers would wait for it. */
    char msg[512]; /* as long as rtp_last_error */
    snprintf(msg, sizeof(msg), "%s", rtp_last_error());
    rtp_comm_abort(c, rc, msg);
    return rtp__error(rc, "%s", msg);
  }
  return RTP_OK;
}

int stage_status(cuda_stage *s) {
  pthread_mutex_lock(&s->mu);
  int st = s->failed;
  char msg[sizeof(s->msg)];
  if (st) snprintf(msg, sizeof(msg), "%s", s->msg);
  pthread_mutex_unlock(&s->mu);
  return st ? rtp__error(st, "%s", msg) : RTP_OK;
}

namespace {

/* The streams are idle: every job can be reused, every retired buffer freed. */
void stage_recycle(cuda_stage *s) {
  while (stage_job *j = s->queued) {
    s->queued = j->next;
    j->next = s->free_jobs;
    s->free_jobs = j;
  }
  while (stage_retired *r = s->retired) {
    s->retired = r->next;
    (void)cudaFreeHost(r->p);
    free(r);
  }
  (void)cudaGetLastError();
}

}  // namespace

int stage_settle(cuda_stage *s) {
  stage_recycle(s);
  int st = stage_status(s);
  pthread_mutex_lock(&s->mu);
  s->failed = 0;
  pthread_mutex_unlock(&s->mu);
  return st;
}

void stage_init(cuda_stage *s, int device) {
  *s = {};
  s->device = device;
  pthread_mutex_init(&s->mu, nullptr);
}

void stage_free(cuda_stage *s) {
  stage_recycle(s);
  while (stage_job *j = s->free_jobs) {
    s->free_jobs = j->next;
    free(j);
  }
  if (s->pinned) (void)cudaFreeHost(s->pinned);
  (void)cudaGetLastError();
  pthread_mutex_destroy(&s->mu);
}

}  // namespace rtp_cuda
