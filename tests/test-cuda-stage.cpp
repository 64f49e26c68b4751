// test-cuda-stage.cpp - the CUDA backend's transfers of device buffers through a tcp
// communicator (rtp-cuda-stage.cu: staged through pinned host memory by a host function on
// the comm stream), built against the fake CUDA runtime of fake-cuda/ so that it runs on
// any machine, sanitizers included: device memory is host memory, a stream is a thread
// that runs its queue in order, and a host function runs on that thread, as the driver
// runs it on one of its own. Ranks are forked processes over tcp on 127.0.0.1.
//
// Every kind of operation gives what the host transfers give, while the enqueuing thread
// posts a host all-reduce that overtakes the queued ones (numbering at enqueue keeps the
// ranks matched); the staging buffer grows during the first round only (the one it replaces
// is freed at the settle, after the queued copies that read it: the sanitizers would see
// otherwise); a dead peer and a rank that cannot stage fail every rank with a message, none
// waits. On a GPU, test-cuda-ranks (CudaRanksTcp.*) runs the real thing.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <vector>

#include "cuda_runtime.h"
#include "fake-hooks.h"
#include "rtp-cuda-stage.h"
#include "test-util.h"

namespace rtp_cuda {
// rtp-cuda.cu's, which this program must not link (it would pull the real runtime).
int cuda_fail(int device, cudaError_t e, const char *what) {
  (void)cudaGetLastError();
  return rtp__error(e == cudaErrorMemoryAllocation ? RTP_ENOMEM : RTP_EIO,
                    "cuda device %d: %s: %s", device, what, cudaGetErrorString(e));
}
}  // namespace rtp_cuda

namespace {

using rtp_cuda::cuda_stage;
using rtptest::run_procs;

float f32_in(int round, int rank, int64_t i) {
  return (float)(round * 1000 + rank * 100 + i % 97);
}
uint8_t byte_in(int round, int rank, int64_t i) {
  return (uint8_t)(i * 7 + rank * 31 + round);
}

// One rank: a communicator, a comm stream and its staging, and "device" buffers.
struct Rank {
  int rank, world;
  rtp_comm *comm = nullptr;
  cudaStream_t stream = nullptr;
  cuda_stage st;
  std::vector<void *> bufs;

  Rank(int r, int n, int port) : rank(r), world(n) {
    rtp_comm_params cp = rtptest::params(r, n, port, 5000);
    if (rtp_comm_init(&cp, &comm)) fprintf(stderr, "rank %d: %s\n", r, rtp_last_error());
    cudaStreamCreate(&stream);
    rtp_cuda::stage_init(&st, 0);
  }
  ~Rank() {
    cudaStreamSynchronize(stream);
    rtp_cuda::stage_free(&st);
    cudaStreamDestroy(stream);
    for (void *p : bufs) cudaFree(p);
    rtp_comm_free(comm);
  }
  template <class T>
  T *dev(size_t n) {
    void *p = nullptr;
    cudaMalloc(&p, n * sizeof(T));
    bufs.push_back(p);
    return (T *)p;
  }
  int post(rtp_comm_op op) {
    int rc = rtp_cuda::stage_comm(&st, stream, comm, &op);
    if (rc) fprintf(stderr, "rank %d: stage_comm: %s\n", rank, rtp_last_error());
    return rc;
  }
  int sync() {
    cudaStreamSynchronize(stream);
    return rtp_cuda::stage_settle(&st);
  }
};

rtp_comm_op p2p(const void *s, size_t sn, int dst, void *r, size_t rn, int src) {
  rtp_comm_op op{};
  op.kind = RTP_COMM_K_P2P;
  op.sbuf = (const uint8_t *)s, op.sbytes = sn, op.dst = dst;
  op.buf = (uint8_t *)r, op.rbytes = rn, op.src = src;
  return op;
}

rtp_comm_op coll(int kind, void *buf, size_t count, size_t esize, int root = 0) {
  rtp_comm_op op{};
  op.kind = kind;
  op.buf = (uint8_t *)buf, op.count = count, op.esize = esize, op.root = root;
  op.dst = op.src = -1;
  return op;
}

// Two rounds of every kind of operation on 3 ranks; 0, or a code naming what was wrong.
int every_kind(int rank, int port) {
  const int world = 3, next = (rank + 1) % world, prev = (rank + world - 1) % world;
  const size_t n = 1000, nbig = 1 << 19, rows = 7, row_bytes = 666, nrs = 1001, nb = 5000;
  Rank R(rank, world, port);
  if (!R.comm) return 2;
  float *xs = R.dev<float>(n), *xr = R.dev<float>(n), *big = R.dev<float>(nbig);
  float *rs = R.dev<float>(nrs);
  uint8_t *all = R.dev<uint8_t>(rows * row_bytes), *bc = R.dev<uint8_t>(nb);
  uint8_t *one = R.dev<uint8_t>(n);
  int allocs_after_first = 0;
  for (int round = 0; round < 2; round++) {
    size_t first, len;
    rtp_comm_block(rows, world, rank, &first, &len);
    for (size_t i = 0; i < n; i++) xs[i] = f32_in(round, rank, i), xr[i] = -1;
    for (size_t i = 0; i < nbig; i++) big[i] = f32_in(round, rank, i);
    for (size_t i = 0; i < nrs; i++) rs[i] = f32_in(round, rank, i);
    for (size_t i = 0; i < rows * row_bytes; i++)
      all[i] =
          i / row_bytes >= first && i / row_bytes < first + len ? byte_in(round, rank, i) : 0;
    for (size_t i = 0; i < nb; i++) bc[i] = rank == 1 ? byte_in(round, 1, i) : 0;
    for (size_t i = 0; i < n; i++) one[i] = rank == 0 ? byte_in(round, 0, i) : 0;
    // On ranks 0 and 2, nothing staged runs before the host all-reduce below has finished;
    // on rank 1 the first staged collective is posted (by the stream) before it. Only
    // numbering at enqueue gives both the same place on every rank.
    if (rank != 1) fake_stream_sleep(R.stream, 1000);
    if (R.post(coll(RTP_COMM_K_REDUCE_SCATTER, rs, nrs, 4)) ||
        R.post(coll(RTP_COMM_K_ALLREDUCE, big, nbig, 4)) ||  // grows the buffer
        R.post(p2p(xs, n * 4, next, xr, n * 4, prev)) ||
        R.post(coll(RTP_COMM_K_ALLGATHER, all, rows, row_bytes)) ||
        R.post(coll(RTP_COMM_K_BROADCAST, bc, nb, 1, 1)))
      return 3;
    if (rank == 0 && R.post(p2p(one, n, 1, nullptr, 0, -1))) return 3;
    if (rank == 1 && R.post(p2p(nullptr, 0, -1, one, n, 0))) return 3;
    if (rank == 1) usleep(100 * 1000);
    float scalar = (float)rank;
    double t0 = rtptest::now_s();
    if (rtp_comm_allreduce(R.comm, &scalar, 1, nullptr) || scalar != 3.0f) {
      fprintf(stderr, "rank %d: host allreduce: %s (%g)\n", rank, rtp_last_error(), scalar);
      return 4;
    }
    if (rtptest::now_s() - t0 > 0.8) {
      fprintf(stderr, "rank %d: the host allreduce waited for the staged ones\n", rank);
      return 4;
    }
    if (R.sync()) {
      fprintf(stderr, "rank %d: settle: %s\n", rank, rtp_last_error());
      return 5;
    }
    for (size_t i = 0; i < n; i++)
      if (xr[i] != f32_in(round, prev, i)) return 10;
    for (size_t i = 0; i < nbig; i++) {
      float want = 0;
      for (int q = 0; q < world; q++) want += f32_in(round, q, i);
      if (big[i] != want) return 11;
    }
    for (int q = 0; q < world; q++) {
      size_t f, l;
      rtp_comm_block(rows, world, q, &f, &l);
      for (size_t i = f * row_bytes; i < (f + l) * row_bytes; i++)
        if (all[i] != byte_in(round, q, i)) return 12;
    }
    size_t f, l;
    rtp_comm_block(nrs, world, rank, &f, &l);
    for (size_t i = f; i < f + l; i++) {
      float want = 0;
      for (int q = 0; q < world; q++) want += f32_in(round, q, i);
      if (rs[i] != want) return 13;
    }
    for (size_t i = 0; i < nb; i++)
      if (bc[i] != byte_in(round, 1, i)) return 14;
    for (size_t i = 0; rank == 1 && i < n; i++)
      if (one[i] != byte_in(round, 0, i)) return 15;
    if (round == 0) allocs_after_first = fake.host_allocs;
  }
  if (allocs_after_first < 2) {
    fprintf(stderr, "rank %d: the buffer never grew (%d allocations)\n", rank,
            allocs_after_first);
    return 20;
  }
  if (fake.host_allocs != allocs_after_first) {
    fprintf(stderr, "rank %d: the second round allocated (%d, then %d)\n", rank,
            allocs_after_first, fake.host_allocs);
    return 21;
  }
  return 0;
}

TEST(CudaStage, EveryKindMatchesHostTransfers) {
  int port = rtptest::free_port();
  auto res = run_procs(
      3, [&](int rank) { return every_kind(rank, port); }, 60);
  for (int r = 0; r < 3; r++)
    EXPECT_EQ(res[r].code, 0) << "rank " << r
                              << " (2-5: a call failed, 10-15: sendrecv, allreduce, "
                                 "allgather, reduce-scatter, broadcast, send/recv wrong; "
                                 "20/21: allocations; -1000: hung)";
}

// Rank 2 dies while the others' staged transfers wait for it: their settle reports the
// communicator's error naming it, later queued transfers do not wait, and the next
// enqueue fails at once.
TEST(CudaStage, PeerKilledFailsEveryQueuedTransfer) {
  int port = rtptest::free_port();
  auto res = run_procs(
      3,
      [&](int rank) {
        const int world = 3, next = (rank + 1) % world, prev = (rank + world - 1) % world;
        Rank R(rank, world, port);
        if (!R.comm) return 2;
        const size_t n = 1 << 18;
        float *a = R.dev<float>(n), *b = R.dev<float>(n);
        for (size_t i = 0; i < n; i++) a[i] = 1.0f;
        if (R.post(p2p(a, n * 4, next, b, n * 4, prev)) || R.sync()) return 3;
        if (rtp_comm_barrier(R.comm, nullptr)) return 3;
        if (rank == 2) {  // once the others' barrier is done and their transfers queued
          usleep(100 * 1000);
          raise(SIGKILL);
        }
        double t0 = rtptest::now_s();
        // An enqueue fails at once if this rank already saw the death, else the settle.
        int st = R.post(p2p(a, n * 4, next, b, n * 4, prev));
        if (!st) st = R.post(coll(RTP_COMM_K_ALLREDUCE, a, n, 4));
        if (!st) st = R.post(coll(RTP_COMM_K_ALLGATHER, b, world, n / world * 4));
        if (!st) st = R.sync();
        int rc = rtptest::expect_failure(rank, st, t0, 5, {RTP_EPEER, RTP_ECOMM}, {"rank 2"});
        if (rc) return rc;
        if (rtp_cuda::stage_status(&R.st) != RTP_OK) return 6;
        t0 = rtptest::now_s();
        return rtptest::expect_failure(rank, R.post(coll(RTP_COMM_K_ALLREDUCE, a, n, 4)), t0,
                                       0.5, {RTP_EPEER, RTP_ECOMM}, {"rank 2"}, R.comm);
      },
      60);
  EXPECT_EQ(res[0].code, 0) << "3: succeeded, 4: another error, 5: too slow, 6: failure "
                               "not settled, -1000: hung";
  EXPECT_EQ(res[1].code, 0);
  EXPECT_EQ(res[2].code, -SIGKILL);
}

// Rank 1 cannot get pinned memory: its enqueue fails naming cudaHostAlloc, and rank 0,
// whose matching transfer is queued (or being enqueued), fails with that message rather
// than timing out.
TEST(CudaStage, StagingFailureReachesThePeers) {
  int port = rtptest::free_port();
  auto res = run_procs(
      2,
      [&](int rank) {
        Rank R(rank, 2, port);
        if (!R.comm) return 2;
        const size_t n = 4096;
        float *a = R.dev<float>(n);
        for (size_t i = 0; i < n; i++) a[i] = 1.0f;
        // Rank 1 fails once both have joined; rank 0 learns it wherever it is by then.
        double t0 = rtptest::now_s();
        int st = rtp_comm_barrier(R.comm, nullptr);
        if (rank == 1) {
          if (st) return 2;
          fake.host_alloc_fails = true;
          t0 = rtptest::now_s();
          st = R.post(coll(RTP_COMM_K_ALLREDUCE, a, n, 4));
          return rtptest::expect_failure(rank, st, t0, 1, {RTP_ENOMEM}, {"cudaHostAlloc"},
                                         R.comm);
        }
        if (st == RTP_OK) st = R.post(coll(RTP_COMM_K_ALLREDUCE, a, n, 4));
        if (st == RTP_OK) st = R.sync();
        return rtptest::expect_failure(rank, st, t0, 3, {RTP_EPEER}, {"cudaHostAlloc"}, R.comm);
      },
      60);
  EXPECT_EQ(res[0].code, 0) << "2: could not join, 3: succeeded, 4: another error, 5: too "
                               "slow, -1000: hung";
  EXPECT_EQ(res[1].code, 0);
}

}  // namespace
