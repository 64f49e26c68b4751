/* rtp-cuda.cu - the CUDA backend (struct rtp_backend_i of rtp-backend.h): device memory,
 * a compute stream and a communication stream that the executor orders with events, the
 * mapping of CUDA and cuBLAS errors, and cuBLAS, loaded by the first backend. The kernels,
 * one per op, and the ops that launch them are in rtp-cuda-kernels.cu; rtp-cuda.h is what
 * the two share.
 *
 * Nothing here allocates after the backend is created, except alloc (the arenas). Kernels
 * that meet a bad index set a flag in device memory that sync reads: the host never waits
 * inside compute. */
#include <dlfcn.h>
#include <pthread.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "rtp-cuda.h"
#include "rtp-comm.h"

namespace rtp_cuda {
namespace {

/* ---- errors ------------------------------------------------------------------------- */

int cuda_class(cudaError_t e) {
  switch (e) {
    case cudaErrorMemoryAllocation:
      return RTP_ENOMEM;
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorNoKernelImageForDevice:
    case cudaErrorStubLibrary:
    case cudaErrorUnsupportedPtxVersion:
    case cudaErrorSystemDriverMismatch:
    case cudaErrorCompatNotSupportedOnDevice:
      return RTP_ENOSYS;
    default:
      return RTP_EIO;
  }
}

const char *cuda_hint(cudaError_t e) {
  switch (e) {
    case cudaErrorNoKernelImageForDevice:
    case cudaErrorUnsupportedPtxVersion:
      return "; this GPU needs code this build does not have (add its architecture to "
             "RTP_CUDA_ARCHS, or update the driver)";
    case cudaErrorInsufficientDriver:
    case cudaErrorSystemDriverMismatch:
      return "; the NVIDIA driver is missing, or older than this build's CUDA toolkit";
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorMisalignedAddress:
    case cudaErrorIllegalInstruction:
    case cudaErrorHardwareStackError:
      return "; a kernel failed, maybe earlier than this call (CUDA_LAUNCH_BLOCKING=1 finds "
             "it), and the device cannot be used again in this process";
    default:
      return "";
  }
}

}  // namespace

int cuda_fail(int device, cudaError_t e, const char *what) {
  (void)cudaGetLastError();
  char dev[32] = "cuda";
  if (device >= 0) snprintf(dev, sizeof(dev), "cuda device %d", device);
  return rtp__error(cuda_class(e), "%s: %s: %s (%s)%s", dev, what, cudaGetErrorString(e),
                    cudaGetErrorName(e), cuda_hint(e));
}

/* ---- cuBLAS, loaded by the first backend ---------------------------------------------
 * Loading libcublas costs a process about 200 MiB of resident memory (the dynamic loader's
 * work on libcublasLt), GPU or not, so a CUDA build linked against it would make every
 * CPU run that much larger. The first rtp_backend_cuda_new opens it instead and calls it
 * through these pointers; a process that never makes a CUDA backend never loads it. The
 * header's macros name the exported symbols (cublasCreate is cublasCreate_v2). */
#define RTP_STR_(x) #x
#define RTP_STR(x) RTP_STR_(x)

cublas_api blas_api; /* filled once by cublas_open_once */

namespace {

bool blas_ok;       /* every pointer of blas_api is set */
char blas_why[512]; /* why not, otherwise */

void cublas_open_once(void) {
  const char *const names[] = {"libcublas.so." RTP_STR(CUBLAS_VER_MAJOR), RTP_CUBLAS_PATH};
  void *lib = nullptr;
  for (const char *name : names) {
    if ((lib = dlopen(name, RTLD_NOW | RTLD_LOCAL))) break;
    const char *e = dlerror();
    snprintf(blas_why, sizeof(blas_why), "%s", e ? e : name);
  }
  if (!lib) return;
#define RTP_CUBLAS_LOAD(m, f)                                                   \
  if (!(blas_api.m = (decltype(&f))dlsym(lib, RTP_STR(f)))) {                   \
    snprintf(blas_why, sizeof(blas_why), "%s has no %s", names[0], RTP_STR(f)); \
    return;                                                                     \
  }
  RTP_CUBLAS_FUNCS(RTP_CUBLAS_LOAD)
#undef RTP_CUBLAS_LOAD
  blas_ok = true; /* the library stays loaded until the process ends */
}

bool cublas_open(void) {
  static pthread_once_t once = PTHREAD_ONCE_INIT;
  pthread_once(&once, cublas_open_once);
  return blas_ok;
}

int cublas_class(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_ALLOC_FAILED:
      return RTP_ENOMEM;
    case CUBLAS_STATUS_ARCH_MISMATCH:
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return RTP_ENOSYS;
    default:
      return RTP_EIO;
  }
}

}  // namespace

int cublas_fail(int device, cublasStatus_t s, const char *what) {
  (void)cudaGetLastError();
  char dev[32] = "cuda";
  if (device >= 0) snprintf(dev, sizeof(dev), "cuda device %d", device);
  const char *text = cublas_open() ? blas_api.status_string(s) : "cuBLAS error";
  return rtp__error(cublas_class(s), "%s: %s: %s (cuBLAS status %d)", dev, what, text, (int)s);
}

namespace {

/* ---- the interface -------------------------------------------------------------------- */

/* Transfers that need no peer: a copy for sendrecv to oneself, nothing for the collectives
 * of a single rank, which leave the buffer as it is. */
int comm_single(cuda_backend *cu, struct rtp_comm *c, const struct rtp_comm_op *op) {
  if (op->kind != RTP_COMM_K_P2P) return RTP_OK;
  int rank = rtp_comm_rank(c);
  const char *name = op->what ? op->what : "?";
  if (op->dst != rank || op->src != rank || op->sbytes != op->rbytes)
    return rtp__error(RTP_EINVAL,
                      "cuda device %d: sendrecv '%s': a single rank sends only to itself, "
                      "the same number of bytes",
                      cu->device, name);
  if (op->sbuf == op->buf || op->rbytes == 0) return RTP_OK;
  RTP_CUDA_TRY(cu, cudaMemcpyAsync(op->buf, op->sbuf, op->rbytes, cudaMemcpyDeviceToDevice,
                                   cu->stream[RTP_STREAM_COMM]));
  return RTP_OK;
}

/* Through the communicator's device transport (nccl) when it has one, else staged through
 * host memory over its host transport (rtp-cuda-stage.cu). */
int cuda_comm(struct rtp_backend *b, struct rtp_comm *c, struct rtp_comm_op *op) {
  cuda_backend *cu = cuda_of(b);
  const char *name = op->what ? op->what : "?";
  RTP_CUDA_TRY(cu, cudaSetDevice(cu->device));
  if (!c)
    return rtp__error(RTP_EINVAL, "cuda device %d: comm '%s': no communicator", cu->device,
                      name);
  if (rtp__comm_device(c))
    return rtp__comm_post_stream(c, op, (void *)cu->stream[RTP_STREAM_COMM]);
  int rank = rtp_comm_rank(c);
  if (rtp_comm_size(c) == 1 ||
      (op->kind == RTP_COMM_K_P2P && (op->dst == rank || op->src == rank)))
    return comm_single(cu, c, op);
  return stage_comm(&cu->stage, cu->stream[RTP_STREAM_COMM], c, op);
}

int cuda_alloc(struct rtp_backend *b, size_t size, void **out) {
  cuda_backend *cu = cuda_of(b);
  *out = nullptr;
  RTP_CUDA_TRY(cu, cudaSetDevice(cu->device));
  cudaError_t e = cudaMalloc(out, size ? size : 1);
  if (e == cudaSuccess) return RTP_OK;
  *out = nullptr;
  size_t free_b = 0, total_b = 0;
  (void)cudaGetLastError();
  if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) free_b = total_b = 0;
  char what[160];
  snprintf(what, sizeof(what), "cudaMalloc of %zu bytes (%zu MiB of %zu MiB free)", size,
           free_b >> 20, total_b >> 20);
  return cuda_fail(cu->device, e, what);
}

void cuda_release(struct rtp_backend *b, void *p) {
  cuda_backend *cu = cuda_of(b);
  if (!p) return;
  cudaError_t e = cudaSetDevice(cu->device);
  if (e == cudaSuccess) e = cudaFree(p);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    RTP_LOG_WARN("cuda device %d: cudaFree: %s", cu->device, cudaGetErrorString(e));
  }
}

/* Host copies wait for everything queued on both streams: the host sees memory as the
 * graph left it, and a transfer still writing into dst cannot overwrite what set wrote. */
int cuda_copy(struct rtp_backend *b, void *dst, const void *src, size_t n,
              cudaMemcpyKind kind) {
  cuda_backend *cu = cuda_of(b);
  if (n == 0) return RTP_OK;
  RTP_CUDA_TRY(cu, cudaSetDevice(cu->device));
  RTP_CUDA_TRY(cu, cudaStreamSynchronize(cu->stream[RTP_STREAM_COMM]));
  RTP_CUDA_TRY(cu, cudaMemcpyAsync(dst, src, n, kind, compute_stream(cu)));
  RTP_CUDA_TRY(cu, cudaStreamSynchronize(compute_stream(cu)));
  return RTP_OK;
}

int cuda_set(struct rtp_backend *b, void *dst, const void *src, size_t n) {
  return cuda_copy(b, dst, src, n, cudaMemcpyHostToDevice);
}

int cuda_get(struct rtp_backend *b, void *dst, const void *src, size_t n) {
  return cuda_copy(b, dst, src, n, cudaMemcpyDeviceToHost);
}

int cuda_zero(struct rtp_backend *b, void *dst, size_t n) {
  cuda_backend *cu = cuda_of(b);
  if (n == 0) return RTP_OK;
  RTP_CUDA_TRY(cu, cudaSetDevice(cu->device));
  RTP_CUDA_TRY(cu, cudaStreamSynchronize(cu->stream[RTP_STREAM_COMM]));
  RTP_CUDA_TRY(cu, cudaMemsetAsync(dst, 0, n, compute_stream(cu)));
  RTP_CUDA_TRY(cu, cudaStreamSynchronize(compute_stream(cu)));
  return RTP_OK;
}

int cuda_events_reserve(struct rtp_backend *b, int n) {
  cuda_backend *cu = cuda_of(b);
  if (n <= cu->n_ev) return RTP_OK;
  RTP_CUDA_TRY(cu, cudaSetDevice(cu->device));
  cudaEvent_t *ev = (cudaEvent_t *)realloc(cu->ev, (size_t)n * sizeof(*ev));
  if (!ev)
    return rtp__error(RTP_ENOMEM, "cuda device %d: %d events: out of memory", cu->device, n);
  cu->ev = ev;
  for (; cu->n_ev < n; cu->n_ev++)
    RTP_CUDA_TRY(cu, cudaEventCreateWithFlags(&cu->ev[cu->n_ev], cudaEventDisableTiming));
  return RTP_OK;
}

int check_event(const cuda_backend *cu, enum rtp_stream s, int e, const char *what) {
  if ((s == RTP_STREAM_COMPUTE || s == RTP_STREAM_COMM) && e >= 0 && e < cu->n_ev)
    return RTP_OK;
  return rtp__error(RTP_EINVAL, "cuda device %d: %s: stream %d, event %d of %d reserved",
                    cu->device, what, (int)s, e, cu->n_ev);
}

int cuda_record(struct rtp_backend *b, enum rtp_stream s, int e) {
  cuda_backend *cu = cuda_of(b);
  int rc = check_event(cu, s, e, "record");
  if (rc) return rc;
  RTP_CUDA_TRY(cu, cudaSetDevice(cu->device));
  RTP_CUDA_TRY(cu, cudaEventRecord(cu->ev[e], cu->stream[s]));
  return RTP_OK;
}

int cuda_wait(struct rtp_backend *b, enum rtp_stream s, int e) {
  cuda_backend *cu = cuda_of(b);
  int rc = check_event(cu, s, e, "wait");
  if (rc) return rc;
  RTP_CUDA_TRY(cu, cudaSetDevice(cu->device));
  RTP_CUDA_TRY(cu, cudaStreamWaitEvent(cu->stream[s], cu->ev[e], 0));
  return RTP_OK;
}

/* Waits for both streams, then reports (and clears) a staged transfer's failure and a
 * kernel's bad index. */
int cuda_sync(struct rtp_backend *b) {
  cuda_backend *cu = cuda_of(b);
  RTP_CUDA_TRY(cu, cudaSetDevice(cu->device));
  RTP_CUDA_TRY(cu, cudaStreamSynchronize(cu->stream[RTP_STREAM_COMM]));
  RTP_CUDA_TRY(cu, cudaStreamSynchronize(compute_stream(cu)));
  profile_settle(&cu->prof);
  int staged = stage_settle(&cu->stage);
  char msg[512];
  if (staged) snprintf(msg, sizeof(msg), "%s", rtp_last_error());
  int op = 0;
  RTP_CUDA_TRY(cu, cudaMemcpyAsync(&op, cu->err, sizeof(op), cudaMemcpyDeviceToHost,
                                   compute_stream(cu)));
  RTP_CUDA_TRY(cu, cudaStreamSynchronize(compute_stream(cu)));
  if (op) {
    RTP_CUDA_TRY(cu, cudaMemsetAsync(cu->err, 0, sizeof(int), compute_stream(cu)));
    RTP_CUDA_TRY(cu, cudaStreamSynchronize(compute_stream(cu)));
  }
  if (staged) return rtp__error(staged, "%s", msg);
  if (!op) return RTP_OK;
  return rtp__error(RTP_EINVAL, "%s: an index is out of range (cuda device %d)",
                    rtp_op_name((enum rtp_op)op), cu->device);
}

/* Frees what open took, whatever it got to; errors are ignored (nothing to report to). */
void cuda_close(cuda_backend *cu) {
  if (cudaSetDevice(cu->device) == cudaSuccess) {
    for (int s = 0; s < 2; s++)
      if (cu->stream[s]) (void)cudaStreamSynchronize(cu->stream[s]);
    profile_settle(&cu->prof);
    profile_free(&cu->prof, cu->device);
    for (int i = 0; i < cu->n_ev; i++) (void)cudaEventDestroy(cu->ev[i]);
    if (cu->blas) (void)blas_api.destroy(cu->blas);
    if (cu->blas_ws) (void)cudaFree(cu->blas_ws);
    if (cu->err) (void)cudaFree(cu->err);
    if (cu->red) (void)cudaFree(cu->red);
    for (int s = 0; s < 2; s++)
      if (cu->stream[s]) (void)cudaStreamDestroy(cu->stream[s]);
  }
  stage_free(&cu->stage); /* the streams are idle, or could not run anything */
  (void)cudaGetLastError();
  free(cu->ev);
  free(cu);
}

void cuda_free(struct rtp_backend *b) {
  if (b) cuda_close(cuda_of(b));
}

/* Checks that this build has code the device can run, naming the device if not. */
int check_arch(cuda_backend *cu) {
  cudaFuncAttributes fa;
  cudaError_t e = cudaFuncGetAttributes(&fa, k_probe);
  if (e == cudaSuccess) return RTP_OK;
  int major = 0, minor = 0;
  char name[256] = "?";
  cudaDeviceProp prop;
  (void)cudaGetLastError();
  if (cudaGetDeviceProperties(&prop, cu->device) == cudaSuccess) {
    major = prop.major, minor = prop.minor;
    snprintf(name, sizeof(name), "%s", prop.name);
  }
  char what[400];
  snprintf(what, sizeof(what), "%s, compute capability %d.%d: loading kernels", name, major,
           minor);
  return cuda_fail(cu->device, e, what);
}

size_t blas_workspace_size(int device) {
  int major = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess)
    (void)cudaGetLastError();
  return major >= 9 ? (size_t)32 << 20 : (size_t)4 << 20; /* cuBLAS's advice */
}

int cuda_open(cuda_backend *cu) {
  RTP_CUDA_TRY(cu, cudaSetDevice(cu->device));
  int rc = check_arch(cu);
  if (rc) return rc;
  for (int s = 0; s < 2; s++)
    RTP_CUDA_TRY(cu, cudaStreamCreateWithFlags(&cu->stream[s], cudaStreamNonBlocking));
  size_t ws = blas_workspace_size(cu->device);
  RTP_CUDA_TRY(cu, cudaMalloc(&cu->blas_ws, ws));
  RTP_CUDA_TRY(cu, cudaMalloc(&cu->err, sizeof(int)));
  RTP_CUDA_TRY(cu, cudaMalloc(&cu->red, (kRedBlocks + 1) * sizeof(double)));
  if (!cublas_open())
    return rtp__error(RTP_ENOSYS, "cuda device %d: cannot load cuBLAS (libcublas.so.%d): %s",
                      cu->device, CUBLAS_VER_MAJOR, blas_why);
  RTP_CUBLAS_TRY(cu, blas_api.create(&cu->blas));
  RTP_CUBLAS_TRY(cu, blas_api.set_stream(cu->blas, compute_stream(cu)));
  RTP_CUBLAS_TRY(cu, blas_api.set_workspace(cu->blas, cu->blas_ws, ws));
  /* f32 results within rounding of the CPU's: no TF32 (the default already, said here).
   * Products of bf16 precision pass bf16 operands, which use tensor cores in this mode. */
  RTP_CUBLAS_TRY(cu, blas_api.set_math_mode(cu->blas, CUBLAS_DEFAULT_MATH));
  RTP_CUDA_TRY(cu, cudaMemsetAsync(cu->err, 0, sizeof(int), compute_stream(cu)));
  RTP_CUDA_TRY(cu, cudaStreamSynchronize(compute_stream(cu)));
  return RTP_OK;
}

/* Fused attention (rtp_attention_causal) and the optimizer in backward have CPU kernels
 * only. */
bool cuda_has_kernel(struct rtp_backend *, enum rtp_op op) {
  return op != RTP_OP_ATTENTION && op != RTP_OP_ATTENTION_DELTA &&
         op != RTP_OP_ATTENTION_BACK && op != RTP_OP_ADAMW;
}

const struct rtp_backend_i cuda_iface = {
    "cuda",    cuda_free,      cuda_alloc,          cuda_release, cuda_set,        cuda_get,
    cuda_zero, cuda_work_size, cuda_events_reserve, cuda_compute, cuda_comm,       cuda_record,
    cuda_wait, cuda_sync,      cuda_adam,           cuda_sumsq,   cuda_has_kernel,
};

}  // namespace

/* ---- C entry points ------------------------------------------------------------------
 * C linkage: the namespace is no part of their names. */

/* For the tests, which need no GPU to check the mapping. */
extern "C" int rtp__cuda_status(int cuda_error, const char *what) {
  return cuda_error == 0 ? RTP_OK : cuda_fail(-1, (cudaError_t)cuda_error, what);
}

extern "C" int rtp__cublas_status(int cublas_status, const char *what) {
  return cublas_status == 0 ? RTP_OK : cublas_fail(-1, (cublasStatus_t)cublas_status, what);
}

extern "C" int rtp__cuda_device_count(void) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

extern "C" int rtp__cuda_backend_new(int device, struct rtp_backend **out) {
  if (!out) return rtp__error(RTP_EINVAL, "rtp_backend_cuda_new: NULL out");
  *out = nullptr;
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    char why[600];
    if (rtp__cuda_driver_why(why, sizeof(why)))
      return rtp__error(RTP_ENOSYS, "rtp_backend_cuda_new: no usable CUDA driver: %s", why);
    return rtp__error(RTP_ENOSYS,
                      "rtp_backend_cuda_new: no usable CUDA driver or device: %s (%s)%s",
                      cudaGetErrorString(e), cudaGetErrorName(e), cuda_hint(e));
  }
  if (n == 0) return rtp__error(RTP_ENOSYS, "rtp_backend_cuda_new: no CUDA device");
  if (device < 0 || device >= n)
    return rtp__error(RTP_EINVAL, "rtp_backend_cuda_new: no CUDA device %d (%d found)", device,
                      n);
  cuda_backend *cu = (cuda_backend *)calloc(1, sizeof(*cu));
  if (!cu) return rtp__error(RTP_ENOMEM, "rtp_backend_cuda_new: out of memory");
  cu->base.i = &cuda_iface;
  cu->base.impl = cu;
  cu->device = device;
  stage_init(&cu->stage, device);
  profile_init(&cu->prof);
  int rc = cuda_open(cu);
  if (rc) {
    cuda_close(cu); /* the message of the failure stays the thread's last error */
    return rc;
  }
  *out = &cu->base;
  return RTP_OK;
}

}  // namespace rtp_cuda
