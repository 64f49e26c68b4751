/* rtp-cuda.h - what the two files of the CUDA backend share: rtp-cuda.cu (errors, cuBLAS
 * loading, memory, streams, events and the interface) and rtp-cuda-kernels.cu (the kernels
 * and the ops that launch them). Internal and CUDA C++ only: the rest of the library sees
 * the backend through rtp-backend.h. */
#ifndef RTP_CUDA_H
#define RTP_CUDA_H

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

extern "C" {
#include "rtp-backend.h"
}
#include "rtp-cuda-profile.h"
#include "rtp-cuda-stage.h"

namespace rtp_cuda {

enum {
  kRedBlocks = 256, /* blocks of a two-pass sum: fixed, so sums are the same everywhere */
};

/* ---- errors (rtp-cuda.cu) ------------------------------------------------------------ */

/* Records "cuda device D: WHAT: <CUDA's text> (<error name>)" and returns its status.
 * device < 0 leaves the device out. Clears the thread's last CUDA error, so that a later
 * launch check does not report this one again. */
int cuda_fail(int device, cudaError_t e, const char *what);
/* The same for a cuBLAS status. */
int cublas_fail(int device, cublasStatus_t s, const char *what);

#define RTP_CUDA_TRY(cu, call)                                                  \
  do {                                                                          \
    cudaError_t e_ = (call);                                                    \
    if (e_ != cudaSuccess) return rtp_cuda::cuda_fail((cu)->device, e_, #call); \
  } while (0)

#define RTP_CUBLAS_TRY(cu, call)                                                            \
  do {                                                                                      \
    cublasStatus_t s_ = (call);                                                             \
    if (s_ != CUBLAS_STATUS_SUCCESS) return rtp_cuda::cublas_fail((cu)->device, s_, #call); \
  } while (0)

/* ---- cuBLAS, called through these pointers (rtp-cuda.cu loads it) ---------------------- */

// clang-format off
#define RTP_CUBLAS_FUNCS(X)                                    \
  X(create, cublasCreate)                                      \
  X(destroy, cublasDestroy)                                    \
  X(set_stream, cublasSetStream)                               \
  X(set_workspace, cublasSetWorkspace)                         \
  X(set_math_mode, cublasSetMathMode)                          \
  X(sgemm, cublasSgemm_64)                                     \
  X(sgemm_batched, cublasSgemmStridedBatched_64)               \
  X(gemm_ex, cublasGemmEx_64)                                  \
  X(gemm_batched_ex, cublasGemmStridedBatchedEx_64)            \
  X(status_string, cublasGetStatusString)
// clang-format on

struct cublas_api {
#define RTP_CUBLAS_MEMBER(m, f) decltype(&f) m;
  RTP_CUBLAS_FUNCS(RTP_CUBLAS_MEMBER)
#undef RTP_CUBLAS_MEMBER
};

extern cublas_api blas_api; /* filled once, by the first backend */

/* ---- the backend object ----------------------------------------------------------- */

struct cuda_backend {
  struct rtp_backend base; /* base.impl points back here */
  int device;
  cudaStream_t stream[2]; /* RTP_STREAM_COMPUTE, RTP_STREAM_COMM */
  cublasHandle_t blas;    /* bound to the compute stream */
  void *blas_ws;          /* cuBLAS's workspace, ours so it is taken once */
  cudaEvent_t *ev;
  int n_ev;
  int *err;          /* device: the op of the first kernel that met a bad index, or 0 */
  double *red;       /* device: kRedBlocks partial sums and the total, for sumsq */
  cuda_stage stage;  /* transfers through a tcp communicator */
  cuda_profile prof; /* RTP_CUDA_PROFILE */
};

inline cuda_backend *cuda_of(struct rtp_backend *b) {
  return (cuda_backend *)b->impl;
}

inline cudaStream_t compute_stream(const cuda_backend *cu) {
  return cu->stream[RTP_STREAM_COMPUTE];
}

/* ---- the ops (rtp-cuda-kernels.cu) ---------------------------------------------------- */

/* Does nothing: open checks that it loads, that is, that this build has code for the GPU. */
__global__ void k_probe();

/* The interface's functions that launch kernels. */
size_t cuda_work_size(struct rtp_backend *b, const struct rtp_tensor *t);
int cuda_compute(struct rtp_backend *b, struct rtp_tensor *t, void *work);
int cuda_adam(struct rtp_backend *b, const struct rtp_adam_args *a);
int cuda_sumsq(struct rtp_backend *b, const float *g, int64_t n, double *out);

}  // namespace rtp_cuda

#endif /* RTP_CUDA_H */
