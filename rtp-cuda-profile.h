/* rtp-cuda-profile.h - where a CUDA backend's compute stream spends its time, per op:
 * RTP_CUDA_PROFILE=1 brackets every kernel the backend queues with a pair of events and
 * prints, when the backend is freed, each op's calls and milliseconds. Off, it costs one
 * branch per node. Internal, CUDA C++ only. docs/backend.md, "Profiling kernels". */
#ifndef RTP_CUDA_PROFILE_H
#define RTP_CUDA_PROFILE_H

#include <cuda_runtime.h>

extern "C" {
#include "rtp-impl.h"
}

namespace rtp_cuda {

/* Slots beyond the ops: the optimizer's kernels, and cuBLAS's share of a product (whose own
 * slot keeps the copies and bf16 casts of its operands). */
enum { kProfileAdam = RTP_OP_COUNT, kProfileGemm, kProfileSlots };

struct cuda_profile {
  bool on;
  cudaEvent_t *ev; /* pairs: 2i before the i-th kernel, 2i + 1 after it */
  int *slot;       /* the op of pair i */
  int n, cap;      /* pairs recorded since the last settle, and room */
  double ms[kProfileSlots];
  long calls[kProfileSlots];
};

/* Reads RTP_CUDA_PROFILE; nothing is taken until the first kernel. */
void profile_init(cuda_profile *p);
/* Around the kernels of one node (slot: its op, or kProfileAdam) on stream s. */
void profile_begin(cuda_profile *p, cudaStream_t s, int slot);
void profile_end(cuda_profile *p, cudaStream_t s);
/* Ends the node's pair and begins another, for what follows, in slot. */
void profile_split(cuda_profile *p, cudaStream_t s, int slot);
/* After the stream is idle: adds up the pairs recorded so far. */
void profile_settle(cuda_profile *p);
/* Prints the table to stderr (device d), then frees what it took. */
void profile_free(cuda_profile *p, int device);

}  // namespace rtp_cuda

#endif /* RTP_CUDA_PROFILE_H */
