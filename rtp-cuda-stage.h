/* rtp-cuda-stage.h - transfers of device tensors through a communicator without a device
 * transport (tcp), staged through pinned host memory on a stream (rtp-cuda-stage.cu). Part
 * of the CUDA backend (rtp-cuda.cu calls it from its comm and sync), apart from it so that
 * test-cuda-stage-fake runs it against the fake CUDA runtime of tests/fake-cuda on hosts
 * without a GPU. Internal, CUDA C++ only. */
#ifndef RTP_CUDA_STAGE_H
#define RTP_CUDA_STAGE_H

#include <cuda_runtime.h>
#include <pthread.h>

#include <cstddef>
#include <cstdint>

#include "rtp-comm.h"

namespace rtp_cuda {

struct stage_job;
struct stage_retired;

/* One backend's staging. The stream runs one staged transfer at a time, so one buffer
 * serves them all. Only the enqueuing thread touches it, but for failed and msg, which
 * host functions set. */
struct cuda_stage {
  int device;      /* for messages */
  uint8_t *pinned; /* cap bytes of page-locked host memory, or NULL */
  size_t cap;
  struct stage_retired *retired; /* smaller buffers queued work may still use; freed at sync */
  struct stage_job *free_jobs;   /* reused: none is allocated once every node had one */
  struct stage_job *queued;      /* enqueued since the last settle */
  pthread_mutex_t mu;
  int failed;    /* the first failure since the last settle, or 0 */
  char msg[512]; /* as long as rtp_last_error */
};

void stage_init(cuda_stage *s, int device);
/* Frees everything; the stream must be idle. */
void stage_free(cuda_stage *s);
/* Enqueues op (device buffers) on stream through c's host transport: copies out to pinned
 * memory, a host function that posts the operation and waits for it, copies back in. */
int stage_comm(cuda_stage *s, cudaStream_t stream, struct rtp_comm *c, struct rtp_comm_op *op);
/* The first staged transfer's failure since the last settle (its message), or RTP_OK. */
int stage_status(cuda_stage *s);
/* Once the stream is idle: reports and forgets that failure, gives the jobs back for reuse
 * and frees the retired buffers. */
int stage_settle(cuda_stage *s);

/* rtp-cuda.cu (rtp-cuda.h says more). */
int cuda_fail(int device, cudaError_t e, const char *what);

}  // namespace rtp_cuda

#endif /* RTP_CUDA_STAGE_H */
