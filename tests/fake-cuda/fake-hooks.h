// fake-hooks.h - what a test sets in the fake CUDA runtime and NCCL (fake-cuda.cpp) before
// it forks the ranks, which inherit it.
#pragma once

#include "cuda_runtime.h"

struct fake_hooks {
  int devices = 4;            // what cudaGetDeviceCount finds
  int nccl_version = 22809;   // what ncclGetVersion says
  int hang_init_rank = -1;    // this rank's ncclCommInitRankConfig stays in progress for ever
  int fail_rank = -1;         // this rank's operation number fail_op (from 0) fails
  int fail_op = -1;           //   asynchronously (ncclSystemError), then hangs until aborted
  bool loss_reports = false;  // a lost peer sets ncclRemoteError (else its ops just hang)
  int ops = 0;                // NCCL operations (groups) this process ran
  bool host_alloc_fails = false;  // cudaHostAlloc fails (cudaErrorMemoryAllocation)
  int host_allocs = 0;            // cudaHostAlloc calls that succeeded in this process
};

extern fake_hooks fake;

// Queues ms of "compute" on s: what the stream runs next waits behind it.
void fake_stream_sleep(cudaStream_t s, int ms);
