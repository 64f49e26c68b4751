/* rtp-cuda-profile.cu - per-op times of the compute stream (rtp-cuda-profile.h). A pair's
 * time runs from when the stream reaches its first event to when it passes its second, so
 * an op whose kernels wait for the host to queue them (a starved stream) counts that wait:
 * the table's total against the step's time says whether the GPU or the host is the limit. */
#include "rtp-cuda-profile.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace rtp_cuda {

void profile_init(cuda_profile *p) {
  memset(p, 0, sizeof(*p));
  const char *env = getenv("RTP_CUDA_PROFILE");
  p->on = env && *env && strcmp(env, "0") != 0;
}

/* Room for one more pair; a failure turns the profile off rather than the run. */
static bool profile_grow(cuda_profile *p) {
  if (p->n < p->cap) return true;
  int cap = p->cap ? 2 * p->cap : 4096;
  cudaEvent_t *ev = (cudaEvent_t *)realloc(p->ev, 2 * (size_t)cap * sizeof(*ev));
  if (ev) p->ev = ev;
  int *slot = ev ? (int *)realloc(p->slot, (size_t)cap * sizeof(*slot)) : nullptr;
  if (slot) p->slot = slot;
  for (int i = 2 * p->cap; slot && i < 2 * cap; i++)
    if (cudaEventCreate(&p->ev[i]) != cudaSuccess) {
      p->cap = i / 2;
      p->on = false;
      (void)cudaGetLastError();
      fprintf(stderr, "rtp: RTP_CUDA_PROFILE: no more events; the profile stops here\n");
      return false;
    }
  if (!slot) {
    p->on = false;
    return false;
  }
  p->cap = cap;
  return true;
}

void profile_begin(cuda_profile *p, cudaStream_t s, int slot) {
  if (!p->on || !profile_grow(p)) return;
  p->slot[p->n] = slot;
  (void)cudaEventRecord(p->ev[2 * p->n], s);
}

void profile_end(cuda_profile *p, cudaStream_t s) {
  if (!p->on || p->n >= p->cap) return;
  (void)cudaEventRecord(p->ev[2 * p->n + 1], s);
  p->n++;
}

void profile_split(cuda_profile *p, cudaStream_t s, int slot) {
  profile_end(p, s);
  profile_begin(p, s, slot);
}

static const char *slot_name(int k) {
  switch (k) {
    case kProfileAdam:
      return "adam";
    case kProfileGemm:
      return "gemm (cuBLAS)";
    case RTP_OP_MUL_MAT:
      return "mul_mat operands";
    default:
      return rtp_op_name((enum rtp_op)k);
  }
}

void profile_settle(cuda_profile *p) {
  for (int i = 0; i < p->n; i++) {
    float ms = 0;
    if (cudaEventElapsedTime(&ms, p->ev[2 * i], p->ev[2 * i + 1]) != cudaSuccess) {
      (void)cudaGetLastError();
      continue;
    }
    p->ms[p->slot[i]] += ms;
    p->calls[p->slot[i]]++;
  }
  p->n = 0;
}

void profile_free(cuda_profile *p, int device) {
  double total = 0;
  for (int k = 0; k < kProfileSlots; k++) total += p->ms[k];
  if (p->on || p->cap) {
    fprintf(stderr, "rtp: RTP_CUDA_PROFILE, cuda device %d: %.1f ms in kernels\n", device,
            total);
    bool printed[kProfileSlots] = {false};
    for (;;) { /* the ops by time, most first */
      int best = -1;
      for (int k = 0; k < kProfileSlots; k++)
        if (!printed[k] && p->calls[k] && (best < 0 || p->ms[k] > p->ms[best])) best = k;
      if (best < 0) break;
      printed[best] = true;
      fprintf(stderr, "rtp:   %-18s %9ld calls %10.1f ms %5.1f%% %9.1f us each\n",
              slot_name(best), p->calls[best], p->ms[best],
              total > 0 ? 100 * p->ms[best] / total : 0,
              1e3 * p->ms[best] / (double)p->calls[best]);
    }
  }
  for (int i = 0; i < 2 * p->cap; i++) (void)cudaEventDestroy(p->ev[i]);
  free(p->ev);
  free(p->slot);
  memset(p, 0, sizeof(*p));
}

}  // namespace rtp_cuda
