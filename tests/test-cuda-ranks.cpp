// N ranks on N GPUs: the reference model trained under each strategy with tensor data on
// the CUDA backend and transfers over NCCL gives the losses and parameters that the same
// ranks get on the CPU over TCP (to float rounding: cuBLAS sums in another order). Skips
// with a message on hosts with fewer than two GPUs. The parent never touches CUDA (a CUDA
// context does not survive fork): devices are counted in a child.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

#include "test-util.h"
#include "test-gpt-ranks.h"

namespace {

using rtptest::run_procs;

int device_count() {
  auto r = run_procs(
      1, [](int) { return std::min(rtp_backend_cuda_count(), 100); }, 60);
  return r[0].code > 0 ? r[0].code : 0;
}

// 0 if rank's CUDA + NCCL run agrees with its CPU + TCP run, else a code saying how not.
int gpu_agrees(int rank, int world, int port_cpu, int port_gpu, rtp_strategy strategy) {
  std::vector<float> l0, p0, l1, p1;
  int rc = rtptest::train_gpt_rank(rtptest::params(rank, world, port_cpu), strategy, nullptr,
                                   &l0, &p0);
  if (rc) return rc;
  rtp_backend *b = nullptr;
  if (rtp_backend_cuda_new(rank, &b)) return 40;
  rtp_comm_params cp = rtptest::params(rank, world, port_gpu);
  snprintf(cp.backend, sizeof(cp.backend), "nccl");
  cp.device = rank;
  rc = rtptest::train_gpt_rank(cp, strategy, b, &l1, &p1);
  rtp_backend_free(b);
  if (rc) return rc;
  for (size_t i = 0; i < l0.size(); i++)
    if (std::fabs(l1[i] - l0[i]) > 1e-4f * std::fabs(l0[i])) {
      fprintf(stderr, "rank %d step %zu: loss %.7f on the GPU, %.7f on the CPU\n", rank, i,
              l1[i], l0[i]);
      return 1;
    }
  if (p1.size() != p0.size()) return 2;
  // Adam moves a weight by about lr whatever its gradient's size, so a gradient near zero
  // may send it the other way on the GPU: bound the worst weight by that, the mean tightly.
  double sum = 0, worst = 0;
  for (size_t i = 0; i < p0.size(); i++) {
    double d = std::fabs((double)p1[i] - p0[i]);
    sum += d;
    worst = std::max(worst, d);
  }
  if (worst > 2.0 * rtptest::kRanksLr * rtptest::kRanksSteps || sum / p0.size() > 1e-4) {
    fprintf(stderr,
            "rank %d: parameters differ from the CPU's by %.3g at most, %.3g on "
            "average\n",
            rank, worst, sum / p0.size());
    return 3;
  }
  return 0;
}

// A CUDA build must not make CPU runs pay for cuBLAS (about 200 MiB resident once loaded):
// it is opened only by the first CUDA backend. This program links the library but never
// makes a backend in this process.
TEST(CudaRanks, CpuProcessesDoNotLoadCublas) {
  std::vector<float> losses, params;
  ASSERT_EQ(rtptest::train_gpt_rank(rtptest::params(0, 1, 0), RTP_STRATEGY_RTP, nullptr,
                                    &losses, &params),
            0);
  FILE *f = fopen("/proc/self/maps", "r");
  ASSERT_NE(f, nullptr);
  char line[4096];
  bool cublas = false;
  while (fgets(line, sizeof(line), f)) cublas |= strstr(line, "libcublas") != nullptr;
  fclose(f);
  EXPECT_FALSE(cublas) << "libcublas is mapped into a process that computes on the CPU";
}

TEST(CudaRanks, TrainingMatchesCpuForEveryStrategy) {
  int devices = device_count();
  if (devices < 2)
    GTEST_SKIP() << "needs 2 CUDA devices, the host has " << devices
                 << ": the CUDA backend and NCCL transport are compiled but not run here";
  for (int world = 2; world <= std::min(4, devices); world++)
    for (rtp_strategy s :
         {RTP_STRATEGY_RTP, RTP_STRATEGY_DDP, RTP_STRATEGY_FSDP, RTP_STRATEGY_TP}) {
      if (s == RTP_STRATEGY_TP && rtptest::kRanksCfg.n_head % world) continue;
      int p1 = rtptest::free_port(), p2 = rtptest::free_port();
      auto res = run_procs(
          world, [&](int rank) { return gpu_agrees(rank, world, p1, p2, s); }, 240);
      for (int r = 0; r < world; r++)
        EXPECT_EQ(res[r].code, 0)
            << rtp_strategy_name(s) << " on " << world << " ranks, rank " << r;
    }
}

}  // namespace
