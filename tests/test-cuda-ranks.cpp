// N ranks on N GPUs: the reference model trained under each strategy with tensor data on
// the CUDA backend and transfers over NCCL gives the losses and parameters that the same
// ranks get on the CPU over TCP (to float rounding: cuBLAS sums in another order). Skips
// with a message on hosts with fewer than two GPUs. The parent never touches CUDA (a CUDA
// context does not survive fork): devices are counted in a child.
//
// CudaRanksTcp: ranks that share one GPU, with a tcp communicator, whose transfers the
// CUDA backend stages through pinned host memory (rtp-cuda-stage.cu): the same training,
// transfers bit for bit as on the CPU, and a peer's death reported, not waited for. These
// need one GPU.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "test-util.h"
#include "test-gpt-ranks.h"
extern "C" {
#include "rtp-impl.h"  // rtp__allgather_rows
}

namespace {

using rtptest::run_procs;

int device_count() {
  auto r = run_procs(
      1, [](int) { return std::min(rtp_backend_cuda_count(), 100); }, 60);
  return r[0].code > 0 ? r[0].code : 0;
}

// 0 if rank's CUDA run agrees with its CPU + TCP run, else a code saying how not. The CUDA
// run is on `device` (-1: the rank's own, over NCCL; else that one, shared, over TCP).
int gpu_agrees(int rank, int world, int port_cpu, int port_gpu, rtp_strategy strategy,
               int device = -1) {
  std::vector<float> l0, p0, l1, p1;
  int rc = rtptest::train_gpt_rank(rtptest::params(rank, world, port_cpu), strategy, nullptr,
                                   &l0, &p0);
  if (rc) return rc;
  rtp_backend *b = nullptr;
  if (rtp_backend_cuda_new(device < 0 ? rank : device, &b)) {
    fprintf(stderr, "rank %d: %s\n", rank, rtp_last_error());
    return 40;
  }
  rtp_comm_params cp = rtptest::params(rank, world, port_gpu);
  if (device < 0) {
    snprintf(cp.backend, sizeof(cp.backend), "nccl");
    cp.device = rank;
  }
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

// ---- ranks sharing one GPU over TCP --------------------------------------------------------

class CudaRanksTcp : public ::testing::Test {
 protected:
  void SetUp() override {
    if (device_count() < 1)
      GTEST_SKIP() << "needs 1 CUDA device, the host has none: the staging of device "
                      "transfers through host memory over TCP is compiled but not run here";
  }
};

// Two ranks on CUDA device 0, a tcp communicator: the training of every strategy agrees with
// the CPU's as closely as over NCCL on two GPUs.
TEST_F(CudaRanksTcp, TrainingMatchesCpuForEveryStrategy) {
  const int world = 2;
  for (rtp_strategy s :
       {RTP_STRATEGY_RTP, RTP_STRATEGY_FSDP, RTP_STRATEGY_DDP, RTP_STRATEGY_TP}) {
    int p1 = rtptest::free_port(), p2 = rtptest::free_port();
    auto res = run_procs(
        world, [&](int rank) { return gpu_agrees(rank, world, p1, p2, s, 0); }, 240);
    for (int r = 0; r < world; r++)
      EXPECT_EQ(res[r].code, 0)
          << rtp_strategy_name(s) << ", " << world << " ranks on cuda device 0 over tcp, rank "
          << r
          << " (1: loss, 2: sizes, 3: parameters differ from the CPU's; 30-38: training "
             "failed, "
             "40: no backend; -1000: killed after 240 s; the rank's stderr says more)";
  }
}

// Inputs of repetition rep on rank: integers (sums exact in any order) and bf16 bit patterns.
float f32_in(int rep, int rank, int64_t i) {
  return (float)(rep * 1000 + rank * 100 + i % 97);
}
uint16_t bf16_in(int rep, int rank, int64_t i) {
  return (uint16_t)(0x3f80 + (i * 3 + 7 * rank + rep) % 127);
}

// One rank's transfers on backend b (NULL: the CPU) over tcp, three times with new inputs:
// a ring of f32 sendrecv, an all-reduce of a computed 4 MiB buffer (the staging buffer grows
// after the first transfer), a ring of bf16 sendrecv and an all-gather of bf16 rows in place
// (7 rows: uneven blocks). Each result is checked against its inputs and its bytes appended
// to *out. 0, or a code: 50-55 a stage failed, 60-63 a result is wrong.
int transfer_rank(int rank, int world, int port, rtp_backend *b, std::vector<uint8_t> *out) {
  auto fail = [rank](int code) {
    fprintf(stderr, "rank %d: %s\n", rank, rtp_last_error());
    return code;
  };
  rtp_comm_params cp = rtptest::params(rank, world, port);
  rtp_comm *comm = nullptr;
  if (rtp_comm_init(&cp, &comm)) return fail(50);
  const int64_t n = 1000, nbig = 1 << 20, cols = 333, rows = 7;
  size_t bytes = 32 << 20;
  rtp_init_params ip = {bytes, nullptr, false, b, b ? bytes : 0};
  rtp_context *ctx = rtp_context_new(ip);
  if (!ctx) return fail(51);
  int next = (rank + 1) % world, prev = (rank + world - 1) % world;
  rtp_tensor *x = rtp_tensor_new_1d(ctx, RTP_TYPE_F32, n);
  rtp_tensor *xr = rtp_tensor_new_1d(ctx, RTP_TYPE_F32, n);
  rtp_tensor *big = rtp_tensor_new_1d(ctx, RTP_TYPE_F32, nbig);
  rtp_tensor *y = rtp_tensor_new_1d(ctx, RTP_TYPE_BF16, n);
  rtp_tensor *yr = rtp_tensor_new_1d(ctx, RTP_TYPE_BF16, n);
  rtp_tensor *blk = rtp_tensor_new_2d(ctx, RTP_TYPE_BF16, cols, rows);
  rtp_tensor *tx = rtp_sendrecv(ctx, comm, x, next, xr, prev, nullptr);
  rtp_tensor *tsum = rtp_allreduce(ctx, comm, rtp_scale(ctx, big, 2.0f), tx);
  rtp_tensor *ty = rtp_sendrecv(ctx, comm, y, next, yr, prev, tsum);
  rtp_tensor *tall = rtp__allgather_rows(ctx, comm, blk, ty);
  rtp_graph *g = rtp_graph_new(ctx, 64);
  if (!tall || !g) return fail(52);
  for (rtp_tensor *t : {tx, tsum, ty, tall}) {
    rtp_tensor_set_output(t);
    if (rtp_graph_build(g, t)) return fail(52);
  }
  if (rtp_graph_plan(ctx, g)) return fail(53);
  size_t first, len;
  rtp_comm_block((size_t)rows, world, rank, &first, &len);
  for (int rep = 0; rep < 3; rep++) {
    std::vector<float> vx(n), vbig(nbig), gx(n), gsum(nbig);
    std::vector<uint16_t> vy(n), vblk(cols * rows, 0), gy(n), gall(cols * rows);
    for (int64_t i = 0; i < n; i++) vx[i] = f32_in(rep, rank, i), vy[i] = bf16_in(rep, rank, i);
    for (int64_t i = 0; i < nbig; i++) vbig[i] = f32_in(rep, rank, i);
    for (size_t i = first * cols; i < (first + len) * cols; i++)
      vblk[i] = bf16_in(rep, rank, i);
    if (rtp_tensor_set(x, vx.data(), 0, n * 4) ||
        rtp_tensor_set(big, vbig.data(), 0, nbig * 4) ||
        rtp_tensor_set(y, vy.data(), 0, n * 2) ||
        rtp_tensor_set(blk, vblk.data(), 0, vblk.size() * 2))
      return fail(54);
    if (rtp_graph_compute(g, nullptr)) return fail(55);
    if (rtp_tensor_get(tx, gx.data(), 0, n * 4) ||
        rtp_tensor_get(tsum, gsum.data(), 0, nbig * 4) ||
        rtp_tensor_get(ty, gy.data(), 0, n * 2) ||
        rtp_tensor_get(tall, gall.data(), 0, gall.size() * 2))
      return fail(54);
    for (int64_t i = 0; i < n; i++) {
      if (gx[i] != f32_in(rep, prev, i)) {
        fprintf(stderr, "rank %d rep %d: f32 sendrecv [%ld] = %g, rank %d sent %g\n", rank, rep,
                (long)i, gx[i], prev, f32_in(rep, prev, i));
        return 60;
      }
      if (gy[i] != bf16_in(rep, prev, i)) {
        fprintf(stderr, "rank %d rep %d: bf16 sendrecv [%ld] = 0x%04x, rank %d sent 0x%04x\n",
                rank, rep, (long)i, gy[i], prev, bf16_in(rep, prev, i));
        return 61;
      }
    }
    for (int64_t i = 0; i < nbig; i++) {
      float want = 0;
      for (int q = 0; q < world; q++) want += 2.0f * f32_in(rep, q, i);
      if (gsum[i] != want) {
        fprintf(stderr, "rank %d rep %d: allreduce [%ld] = %g, not %g\n", rank, rep, (long)i,
                gsum[i], want);
        return 62;
      }
    }
    for (int q = 0; q < world; q++) {
      size_t f, l;
      rtp_comm_block((size_t)rows, world, q, &f, &l);
      for (size_t i = f * cols; i < (f + l) * cols; i++)
        if (gall[i] != bf16_in(rep, q, (int64_t)i)) {
          fprintf(stderr, "rank %d rep %d: allgather [%zu] = 0x%04x, rank %d has 0x%04x\n",
                  rank, rep, i, gall[i], q, bf16_in(rep, q, (int64_t)i));
          return 63;
        }
    }
    auto put = [out](const void *p, size_t nb) {
      out->insert(out->end(), (const uint8_t *)p, (const uint8_t *)p + nb);
    };
    put(gx.data(), n * 4), put(gsum.data(), nbig * 4), put(gy.data(), n * 2);
    put(gall.data(), gall.size() * 2);
  }
  rtp_context_free(ctx);
  rtp_comm_free(comm);
  return 0;
}

// Three ranks on CUDA device 0 over tcp move the bytes the same ranks move on the CPU.
TEST_F(CudaRanksTcp, TransfersAreExact) {
  const int world = 3;
  int p1 = rtptest::free_port(), p2 = rtptest::free_port();
  auto res = run_procs(
      world,
      [&](int rank) {
        std::vector<uint8_t> cpu, gpu;
        int rc = transfer_rank(rank, world, p1, nullptr, &cpu);
        if (rc) return rc;
        rtp_backend *b = nullptr;
        if (rtp_backend_cuda_new(0, &b)) {
          fprintf(stderr, "rank %d: %s\n", rank, rtp_last_error());
          return 40;
        }
        rc = transfer_rank(rank, world, p2, b, &gpu);
        rtp_backend_free(b);
        if (rc) return rc;
        if (gpu != cpu) {
          fprintf(stderr, "rank %d: the GPU's results differ from the CPU's\n", rank);
          return 70;
        }
        return 0;
      },
      120);
  for (int r = 0; r < world; r++)
    EXPECT_EQ(res[r].code, 0)
        << "rank " << r
        << " (40: no backend; 50-55: a stage failed; 60-63: a result "
           "is wrong; 70: differs from the CPU; -1000: killed after 120 s)";
}

// A peer that dies (SIGKILL) or stops answering (SIGSTOP) while the other rank's staged
// transfer waits for it: the other's rtp_graph_compute returns the communicator's error,
// naming the rank, within seconds (the timeout for the silent one), and the next compute
// fails at once rather than waiting.
void peer_lost(int sig) {
  const int timeout_ms = 2000;
  int port = rtptest::free_port();
  auto res = run_procs(
      2,
      [&](int rank) {
        rtp_backend *b = nullptr;
        if (rtp_backend_cuda_new(0, &b)) {
          fprintf(stderr, "rank %d: %s\n", rank, rtp_last_error());
          return 40;
        }
        rtp_comm_params cp = rtptest::params(rank, 2, port, timeout_ms);
        rtp_comm *comm = nullptr;
        if (rtp_comm_init(&cp, &comm)) return 50;
        size_t bytes = 32 << 20;
        rtp_init_params ip = {bytes, nullptr, false, b, bytes};
        rtp_context *ctx = rtp_context_new(ip);
        rtp_tensor *x = ctx ? rtp_tensor_new_1d(ctx, RTP_TYPE_F32, 1 << 20) : nullptr;
        rtp_tensor *xr = ctx ? rtp_tensor_new_1d(ctx, RTP_TYPE_F32, 1 << 20) : nullptr;
        rtp_tensor *t =
            x ? rtp_sendrecv(ctx, comm, x, 1 - rank, xr, 1 - rank, nullptr) : nullptr;
        rtp_tensor *sum = t ? rtp_allreduce(ctx, comm, rtp_scale(ctx, t, 1.0f), t) : nullptr;
        rtp_graph *g = sum ? rtp_graph_new(ctx, 64) : nullptr;
        if (!g || rtp_graph_build(g, sum) || rtp_graph_plan(ctx, g) ||
            rtp_tensor_fill_f32(x, 1.0f) || rtp_graph_compute(g, nullptr) ||
            rtp_comm_barrier(comm, nullptr)) {
          fprintf(stderr, "rank %d: %s\n", rank, rtp_last_error());
          return 51;
        }
        if (rank == 1) {  // once rank 0's barrier is done and its next step queued
          usleep(100 * 1000);
          raise(sig);
        }
        double t0 = rtptest::now_s();
        int st = rtp_graph_compute(g, nullptr);
        double max_s = sig == SIGSTOP ? 3.0 * timeout_ms / 1000 : 5.0;
        int rc = rtptest::expect_failure(rank, st, t0, max_s,
                                         {RTP_EPEER, RTP_ECOMM, RTP_ETIMEDOUT}, {"rank 1"});
        t0 = rtptest::now_s();
        if (!rc && rtp_graph_compute(g, nullptr) == RTP_OK) rc = 6;
        if (!rc && rtptest::now_s() - t0 > 1.0) rc = 7;
        rtp_context_free(ctx);
        rtp_comm_free(comm);
        rtp_backend_free(b);
        return rc;
      },
      60, {1});
  EXPECT_EQ(res[0].code, 0) << "rank 0 (3: compute succeeded, 4: another status or message, "
                               "5: too slow, 6/7: the next compute succeeded / was slow; "
                               "-1000: hung, killed after 60 s)";
}

TEST_F(CudaRanksTcp, PeerKilledIsReported) {
  peer_lost(SIGKILL);
}

TEST_F(CudaRanksTcp, PeerSilentIsReported) {
  peer_lost(SIGSTOP);
}

}  // namespace
