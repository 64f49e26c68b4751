// test-nccl.cpp - the NCCL transport (rtp-nccl.c) and what it needs from the TCP one.
//
// Every build: backend "nccl" fails every rank cleanly and at once where it cannot work
// (a build without CUDA; in a CUDA build, a host without a CUDA device), and a TCP
// communicator failed from outside (rtp_comm_abort, how an NCCL failure reaches the
// peers) fails every rank with its message. CUDA builds, without a GPU: the exchange of
// the NCCL unique id over TCP (1-4 ranks, synthetic ids and real ones from
// ncclGetUniqueId) and the mapping of NCCL and CUDA errors to statuses and messages.
// With GPUs (skipped otherwise): rotation, all-reduce and all-gather of device buffers
// through rtp__nccl_post, checked element by element, and ranks that die, never post, or
// share a GPU. Ranks are forked processes on 127.0.0.1; the parent never initializes
// CUDA (a CUDA context does not survive fork), so even the device count is taken in a
// child.
//
// test-nccl-fake is this file built against a fake CUDA runtime and NCCL (fake-cuda/,
// RTP_TEST_FAKE_NCCL) with its own copies of rtp-nccl.c and rtp-comm.c: the GPU tests
// then run on two fake devices on any machine, with the sanitizers too, and further tests
// inject the failures only NCCL can report (an asynchronous error, an init that never
// completes).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "test-util.h"
extern "C" {
#include "rtp-backend.h"
}
#include "rtp-nccl.h"
#ifdef RTP_HAVE_NCCL
#include <cuda_runtime.h>

#include "rtp-nccl-lib.h"  // NCCL's functions, loaded by the library as it does for itself
#endif
#ifdef RTP_TEST_FAKE_NCCL
#include "fake-hooks.h"
#endif

using namespace rtptest;

namespace {

rtp_comm_params nccl_params(int rank, int n, int port, int timeout_ms) {
  rtp_comm_params p = params(rank, n, port, timeout_ms);
  snprintf(p.backend, sizeof(p.backend), "nccl");
  return p;
}

}  // namespace

TEST(Nccl, Params) {
  rtp_comm_params p = rtp_comm_params_default();
  EXPECT_EQ(p.device, -1);
  setenv("RTP_DEVICE", "3", 1);
  ASSERT_EQ(rtp_comm_params_from_env(&p), RTP_OK);
  EXPECT_EQ(p.device, 3);
  setenv("RTP_DEVICE", "-2", 1);
  EXPECT_EQ(rtp_comm_params_from_env(&p), RTP_EINVAL);
  EXPECT_TRUE(contains(rtp_last_error(), "RTP_DEVICE")) << rtp_last_error();
  unsetenv("RTP_DEVICE");
  p = params(0, 1, 0);
  snprintf(p.backend, sizeof(p.backend), "mpi");
  rtp_comm *c = nullptr;
  EXPECT_EQ(rtp_comm_init(&p, &c), RTP_EINVAL);
  EXPECT_TRUE(contains(rtp_last_error(), "nccl")) << rtp_last_error();
}

// How the NCCL layer fails its TCP communicator: every rank's pending and later operations
// fail with the reason, the peers' through the ABORT the failing rank sends, even when it
// frees its communicator at once (what a rank whose NCCL join failed does).
TEST(Nccl, FailFromOutside) {
  for (bool free_at_once : {false, true}) {
    int port = free_port();
    auto res = run_procs(3, [&](int rank) {
      rtp_comm_params p = params(rank, 3, port, 20000);
      rtp_comm *c;
      CHECK_OK(rtp_comm_init(&p, &c));
      double t0 = now_s();
      std::vector<float> v(1000, 1.0f);
      if (rank == 1) {
        usleep(100000);  // the others are waiting in the all-reduce
        rtp_comm_abort(c, RTP_ECOMM, "device 0 fell off the bus");
        rtp_comm_abort(c, RTP_EIO, "a second failure is ignored");
        if (!free_at_once) {
          const char *msg;
          CHECK(rtp_comm_status(c, &msg) == RTP_ECOMM, "status");
          CHECK(!strcmp(msg, "device 0 fell off the bus"), "message '%s'", msg);
          int st = rtp_comm_allreduce(c, v.data(), v.size(), nullptr);
          int rc = expect_failure(rank, st, t0, 5, {RTP_ECOMM}, "fell off the bus");
          if (rc) return rc;
        }
        rtp_comm_free(c);
        return 0;
      }
      int st = rtp_comm_allreduce(c, v.data(), v.size(), nullptr);
      std::string msg = rtp_last_error();
      int rc = expect_failure(rank, st, t0, 5, {RTP_EPEER}, "fell off the bus");
      CHECK(contains(msg, "rank 1"), "the message names rank 1: %s", msg.c_str());
      if (!rc) {
        st = rtp_comm_barrier(c, nullptr);  // later posts fail at once
        rc = expect_failure(rank, st, t0, 5, {RTP_EPEER}, "fell off the bus");
      }
      rtp_comm_free(c);
      return rc;
    });
    for (int r = 0; r < 3; r++)
      EXPECT_EQ(res[r].code, 0) << "rank " << r << " " << free_at_once;
  }
  // one rank: no thread, no peers
  rtp_comm_params p = rtp_comm_params_default();
  rtp_comm *c;
  ASSERT_EQ(rtp_comm_init(&p, &c), RTP_OK);
  rtp_comm_abort(c, RTP_ECOMM, "gone");
  float x = 1;
  EXPECT_EQ(rtp_comm_allreduce(c, &x, 1, nullptr), RTP_ECOMM);
  EXPECT_STREQ(rtp_last_error(), "gone");
  rtp_comm_free(c);
}

#ifndef RTP_HAVE_NCCL

TEST(Nccl, NoTransportInThisBuild) {
  for (int n : {1, 2}) {
    int port = free_port();
    auto res = run_procs(
        n,
        [&](int rank) {
          rtp_comm_params p = nccl_params(rank, n, port, 10000);
          rtp_comm *c = nullptr;
          double t0 = now_s();
          int rc =
              expect_failure(rank, rtp_comm_init(&p, &c), t0, 2, {RTP_ENOSYS},
                             "this build has no NCCL transport (configure with RTP_CUDA=ON)");
          CHECK(!c, "no communicator");
          return rc;
        },
        30);
    for (int r = 0; r < n; r++) EXPECT_EQ(res[r].code, 0) << "rank " << r << " of " << n;
  }
}

#else  // RTP_HAVE_NCCL

namespace {

// CUDA devices on this host, counted in a child process (the parent stays CUDA-free).
int device_count() {
#ifdef RTP_TEST_FAKE_NCCL
  return fake.devices;
#endif
  static int count = -1;
  if (count < 0) {
    auto r = run_procs(
        1,
        [](int) {
          int n = 0;
          if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
          return n > 100 ? 100 : n;
        },
        60);
    count = r[0].code > 0 ? r[0].code : 0;
  }
  return count;
}

#define NEED_GPUS(k)                                                                     \
  do {                                                                                   \
    if (device_count() == 0)                                                             \
      GTEST_SKIP() << "no CUDA device: the NCCL transport is compiled but not run here"; \
    if (device_count() < (k))                                                            \
      GTEST_SKIP() << "this test needs " << (k) << " CUDA devices, the host has "        \
                   << device_count();                                                    \
  } while (0)

}  // namespace

TEST(Nccl, NoDevice) {
#ifdef RTP_TEST_FAKE_NCCL
  struct Restore {
    int n = fake.devices;
    ~Restore() {
      fake.devices = n;
    }
  } restore;
  fake.devices = 0;
#endif
  if (device_count() > 0)
    GTEST_SKIP() << "this host has a CUDA device: the no-device path is not testable here";
  for (int n : {1, 2, 3}) {
    int port = free_port();
    auto res = run_procs(
        n,
        [&](int rank) {
          rtp_comm_params p = nccl_params(rank, n, port, 10000);
          rtp_comm *c = nullptr;
          double t0 = now_s();
          int rc = expect_failure(rank, rtp_comm_init(&p, &c), t0, 5, {RTP_ENOSYS},
                                  "no CUDA device for the nccl backend");
          CHECK(!c, "no communicator");
          return rc;
        },
        30);
    for (int r = 0; r < n; r++) EXPECT_EQ(res[r].code, 0) << "rank " << r << " of " << n;
  }
}

// The unique id travels over TCP: rank 0's bytes reach every rank, and a difference is
// caught on every rank.
TEST(Nccl, IdExchange) {
  for (int n = 1; n <= 4; n++) {
    int port = free_port();
    auto res = run_procs(
        n,
        [&](int rank) {
          rtp_comm_params p = params(rank, n, port, 20000);
          rtp_comm *c;
          CHECK_OK(rtp_comm_init(&p, &c));
          uint8_t id[NCCL_UNIQUE_ID_BYTES];
          for (int i = 0; i < NCCL_UNIQUE_ID_BYTES; i++)
            id[i] = rank == 0 ? (uint8_t)(i * 37 + 11) : (uint8_t)(0xa5 ^ rank);
          CHECK_OK(rtp__nccl_exchange_id(c, id, sizeof(id)));
          for (int i = 0; i < NCCL_UNIQUE_ID_BYTES; i++)
            CHECK(id[i] == (uint8_t)(i * 37 + 11), "synthetic id byte %d", i);
          // a real one (needs a network interface, not a GPU)
          ncclUniqueId u, want;
          memset(&u, rank + 1, sizeof(u));
          if (rank == 0) {
            CHECK_OK(rtp__nccl_load());
            ncclResult_t r = rtp__nccl_fn.GetUniqueId(&u);
            CHECK(r == ncclSuccess, "ncclGetUniqueId: %s", rtp__nccl_fn.GetErrorString(r));
          }
          want = u;
          CHECK_OK(rtp__nccl_exchange_id(c, &u, sizeof(u)));
          if (rank == 0) CHECK(!memcmp(&u, &want, sizeof(u)), "rank 0's id changed");
          std::vector<uint8_t> all((size_t)n * sizeof(u));
          memcpy(all.data() + (size_t)rank * sizeof(u), &u, sizeof(u));
          CHECK_OK(rtp_comm_allgather(c, all.data(), (size_t)n, sizeof(u), nullptr));
          for (int q = 0; q < n; q++)
            CHECK(!memcmp(all.data() + (size_t)q * sizeof(u), all.data(), sizeof(u)),
                  "rank %d's id differs", q);
          // the check itself: the last rank holds other bytes
          uint8_t x[16];
          memset(x, n > 1 && rank == n - 1 ? 2 : 1, sizeof(x));
          int st = rtp__nccl_check_same(c, x, sizeof(x));
          if (n == 1) {
            CHECK_OK(st);
          } else {
            std::string want_msg = "rank(s) " + std::to_string(n - 1) + " differs from rank 0";
            int rc = expect_failure(rank, st, now_s(), 5, {RTP_EPEER}, want_msg.c_str());
            if (rc) return rc;
          }
          const char *msg;
          CHECK(rtp_comm_status(c, &msg) == RTP_OK, "the communicator is still fine: %s", msg);
          rtp_comm_free(c);
          return 0;
        },
        60);
    for (int r = 0; r < n; r++) EXPECT_EQ(res[r].code, 0) << "rank " << r << " of " << n;
  }
}

TEST(Nccl, ErrorMapping) {
  if (rtp__nccl_load() != RTP_OK) GTEST_SKIP() << rtp_last_error();
  struct {
    int r, st;
  } nccl[] = {{ncclSuccess, RTP_OK},
              {ncclUnhandledCudaError, RTP_ECOMM},
              {ncclSystemError, RTP_ECOMM},
              {ncclInternalError, RTP_ECOMM},
              {ncclInvalidArgument, RTP_EINVAL},
              {ncclInvalidUsage, RTP_EINVAL},
              {ncclRemoteError, RTP_EPEER},
              {ncclInProgress, RTP_ECOMM},  // never an error the callers pass, but mapped
              {ncclNumResults, RTP_ECOMM},
              {1234, RTP_ECOMM}};  // a code of a later NCCL
  for (auto &k : nccl) {
    EXPECT_EQ(rtp__nccl_status(k.r), k.st) << "ncclResult_t " << k.r;
    if (k.r == ncclSuccess) continue;
    std::string text = rtp__nccl_fn.GetErrorString((ncclResult_t)k.r);
    EXPECT_EQ(rtp__nccl_error(3, 1, "ncclAllReduce", k.r, "NET/Socket: peer 10.0.0.2 closed"),
              k.st);
    EXPECT_EQ(std::string(rtp_last_error()), "NCCL rank 3 (device 1): ncclAllReduce failed: " +
                                                 text + " (NET/Socket: peer 10.0.0.2 closed)");
    EXPECT_EQ(rtp__nccl_error(0, 2, "ncclGroupEnd", k.r, ""), k.st);
    EXPECT_EQ(std::string(rtp_last_error()),
              "NCCL rank 0 (device 2): ncclGroupEnd failed: " + text);
    EXPECT_EQ(rtp__nccl_error(0, 2, "ncclGroupEnd", k.r, nullptr), k.st);
    EXPECT_EQ(std::string(rtp_last_error()),
              "NCCL rank 0 (device 2): ncclGroupEnd failed: " + text);
  }
  struct {
    cudaError_t e;
    int st;
  } cuda[] = {{cudaSuccess, RTP_OK},
              {cudaErrorNoDevice, RTP_ENOSYS},
              {cudaErrorInsufficientDriver, RTP_ENOSYS},
              {cudaErrorStubLibrary, RTP_ENOSYS},
              {cudaErrorCallRequiresNewerDriver, RTP_ENOSYS},
              {cudaErrorSystemDriverMismatch, RTP_ENOSYS},
              {cudaErrorCompatNotSupportedOnDevice, RTP_ENOSYS},
              {cudaErrorDevicesUnavailable, RTP_ENOSYS},
              {cudaErrorSystemNotReady, RTP_ENOSYS},
              {cudaErrorNotSupported, RTP_ENOSYS},
              {cudaErrorMemoryAllocation, RTP_ENOMEM},
              {cudaErrorInvalidValue, RTP_EINVAL},
              {cudaErrorInvalidDevice, RTP_EINVAL},
              {cudaErrorInvalidDevicePointer, RTP_EINVAL},
              {cudaErrorInvalidResourceHandle, RTP_EINVAL},
              {cudaErrorIllegalAddress, RTP_ECOMM},
              {cudaErrorLaunchFailure, RTP_ECOMM},
              {cudaErrorECCUncorrectable, RTP_ECOMM},
              {cudaErrorUnknown, RTP_ECOMM}};
  // cudaGetErrorString starts the CUDA runtime, and a process that forks after that has
  // children that cannot use the GPU (the NcclGpu tests below fork their ranks): so this
  // half runs in a child of its own.
  auto res = run_procs(
      1,
      [&](int rank) {
        for (auto &k : cuda) {
          CHECK(rtp__nccl_cuda_status(k.e) == k.st, "%s", cudaGetErrorName(k.e));
          if (k.e == cudaSuccess) continue;
          CHECK(rtp__nccl_cuda_error(1, 0, "cudaMemcpyAsync", k.e) == k.st, "%s",
                cudaGetErrorName(k.e));
          std::string want = std::string("NCCL rank 1 (device 0): cudaMemcpyAsync failed: ") +
                             cudaGetErrorString(k.e) + " (" + cudaGetErrorName(k.e) + ")";
          CHECK(want == rtp_last_error(), "got '%s', want '%s'", rtp_last_error(),
                want.c_str());
        }
        return 0;
      },
      60);
  EXPECT_EQ(res[0].code, 0);
}

// ---- with GPUs ------------------------------------------------------------------------

namespace {

// Tensor headers in a host context (no_alloc) whose data the test puts in device memory.
struct Device {
  rtp_context *ctx = nullptr;
  cudaStream_t s = nullptr;
  std::vector<void *> mem;
  ~Device() {
    for (void *p : mem) cudaFree(p);
    if (s) cudaStreamDestroy(s);
    if (ctx) rtp_context_free(ctx);
  }
  int init() {
    rtp_init_params ip{};
    ip.mem_size = 1 << 20;
    ip.no_alloc = true;
    ctx = rtp_context_new(ip);
    return ctx && cudaStreamCreate(&s) == cudaSuccess ? 0 : 1;
  }
  // An f32 tensor of shape ne on the device holding v (or garbage if v is empty).
  rtp_tensor *tensor(std::vector<int64_t> ne, const std::vector<float> &v) {
    rtp_tensor *t = rtp_tensor_new(ctx, RTP_TYPE_F32, (int)ne.size(), ne.data());
    void *p = nullptr;
    if (!t || cudaMalloc(&p, rtp_tensor_nbytes(t) + 4) != cudaSuccess) return nullptr;
    mem.push_back(p);
    t->data = p;
    cudaMemset(p, 0xff, rtp_tensor_nbytes(t) + 4);
    if (!v.empty() && cudaMemcpy(p, v.data(), v.size() * 4, cudaMemcpyHostToDevice))
      return nullptr;
    return t;
  }
  std::vector<float> get(const rtp_tensor *t) {
    std::vector<float> v((size_t)rtp_tensor_nelements(t));
    cudaMemcpy(v.data(), t->data, v.size() * 4, cudaMemcpyDeviceToHost);
    return v;
  }
};

float pattern(int rank, size_t i) {
  return (float)(rank + 1) + (float)(i % 13);
}

// Posts COMM node t (op_params as the graph builders set them) on the stream, as the
// executor hands a device backend its transfers.
int post_node(rtp_nccl *n, rtp_tensor *t, void *stream) {
  rtp_comm_op op;
  rtp__comm_node_op(t, &op);
  return rtp__nccl_post(n, &op, stream);
}

// Posts t on the stream, waits for it, and checks that nothing failed.
int run(int rank, rtp_nccl *n, Device &d, rtp_tensor *t) {
  CHECK_OK(post_node(n, t, d.s));
  CHECK(cudaStreamSynchronize(d.s) == cudaSuccess, "cudaStreamSynchronize");
  CHECK_OK(rtp__nccl_check(n));
  return 0;
}

// Rotation of uneven blocks all around the ring, all-reduce, all-gather of uneven and even
// blocks of rows: what the executor posts for rtp, ddp and fsdp.
int collectives(int rank, int n, rtp_comm *c) {
  rtp_nccl *nc = rtp__comm_nccl(c);
  CHECK(nc, "no NCCL communicator");
  Device d;
  CHECK(d.init() == 0, "device setup");
  const size_t count = 1001;
  auto block = [&](int b) { return rotation_block(count, n, b); };
  rtp_tensor *held = d.tensor({(int64_t)block(rank).size()}, block(rank));
  CHECK(held, "alloc");
  for (int k = 1; k <= n; k++) {
    int b = (rank + k) % n;
    rtp_tensor *next = d.tensor({(int64_t)block(b).size()}, {});
    CHECK(next, "alloc");
    next->src[0] = held;
    next->op_params[0] = RTP__COMM_SENDRECV;
    next->op_params[1] = (rank + n - 1) % n;
    next->op_params[2] = (rank + 1) % n;
    if (run(rank, nc, d, next)) return 12;
    CHECK(d.get(next) == block(b), "rotation hop %d: block %d differs", k, b);
    held = next;
  }
  // one-way: rank 0 sends its block to rank 1 (rtp_send / rtp_recv nodes)
  if (n >= 2 && rank < 2) {
    rtp_tensor *t = rank == 0 ? d.tensor({(int64_t)block(0).size()}, block(0))
                              : d.tensor({(int64_t)block(0).size()}, {});
    CHECK(t, "alloc");
    t->src[0] = t;
    t->op_params[0] = rank == 0 ? RTP__COMM_SEND : RTP__COMM_RECV;
    t->op_params[1] = rank == 0 ? 1 : -1;
    t->op_params[2] = rank == 0 ? -1 : 0;
    if (run(rank, nc, d, t)) return 12;
    CHECK(d.get(t) == block(0), "send/recv: rank %d's block differs", rank);
  }
  for (size_t m : {(size_t)1, (size_t)1001, (size_t)(1 << 20) + 3}) {
    std::vector<float> v(m);
    for (size_t i = 0; i < m; i++) v[i] = pattern(rank, i);
    rtp_tensor *t = d.tensor({(int64_t)m}, v);
    CHECK(t, "alloc");
    t->op_params[0] = RTP__COMM_ALLREDUCE;
    if (run(rank, nc, d, t)) return 12;
    std::vector<float> got = d.get(t);
    for (size_t i = 0; i < m; i++) {
      float want = 0;
      for (int q = 0; q < n; q++) want += pattern(q, i);
      CHECK(got[i] == want, "allreduce %zu [%zu] = %g, want %g", m, i, got[i], want);
    }
  }
  // Blocks of the outermost dimension that is not 1 (the executor's rtp_tensor_n_dims rule):
  // 1001 rows of 3 (uneven), 1000 (even), and one row of 3, which is 3 elements of 1.
  for (int64_t rows : {(int64_t)1001, (int64_t)1000, (int64_t)1}) {
    std::vector<float> v((size_t)rows * 3, -1.0f);
    rtp_tensor *t = d.tensor({3, rows}, {});
    CHECK(t, "alloc");
    int dim = rtp_tensor_n_dims(t) - 1;
    size_t first, len, per = t->nb[dim] / 4;  // floats per block element
    rtp_comm_block((size_t)t->ne[dim], n, rank, &first, &len);
    for (size_t i = first * per; i < (first + len) * per; i++) v[i] = (float)i;
    CHECK(cudaMemcpy(t->data, v.data(), v.size() * 4, cudaMemcpyHostToDevice) == cudaSuccess,
          "copy");
    t->op_params[0] = RTP__COMM_ALLGATHER;
    if (run(rank, nc, d, t)) return 12;
    std::vector<float> got = d.get(t);
    for (size_t i = 0; i < got.size(); i++)
      CHECK(got[i] == (float)i, "allgather %ld rows [%zu] = %g", (long)rows, i, got[i]);
  }
  // host memory still goes over TCP on the same communicator
  float x = (float)rank;
  CHECK_OK(rtp_comm_allreduce(c, &x, 1, nullptr));
  CHECK(x == (float)(n * (n - 1) / 2), "host allreduce %g", x);
  const char *msg;
  CHECK(rtp_comm_status(c, &msg) == RTP_OK, "status: %s", msg);
  return 0;
}

}  // namespace

TEST(NcclGpu, OneRank) {
  NEED_GPUS(1);
  auto res = run_procs(
      1,
      [&](int rank) {
        rtp_comm_params p = nccl_params(0, 1, 0, 20000);
        rtp_comm *c;
        CHECK_OK(rtp_comm_init(&p, &c));
        int rc = collectives(rank, 1, c);
        rtp_comm_free(c);
        return rc;
      },
      120);
  EXPECT_EQ(res[0].code, 0);
}

TEST(NcclGpu, Ranks) {
  NEED_GPUS(2);
  for (int n = 2; n <= std::min(4, device_count()); n++) {
    int port = free_port();
    auto res = run_procs(
        n,
        [&](int rank) {
          rtp_comm_params p = nccl_params(rank, n, port, 30000);
          p.device = rank;
          rtp_comm *c;
          CHECK_OK(rtp_comm_init(&p, &c));
          int rc = collectives(rank, n, c);
          rtp_comm_free(c);
          return rc;
        },
        180);
    for (int r = 0; r < n; r++) EXPECT_EQ(res[r].code, 0) << "rank " << r << " of " << n;
  }
}

// Groups of an nccl communicator get NCCL communicators of their own: the rows and the
// columns of a 2 x 2 mesh each run every device collective on 2 ranks.
TEST(NcclGpu, MeshGroups) {
  NEED_GPUS(4);
  int port = free_port();
  auto res = run_procs(
      4,
      [&](int rank) {
        rtp_comm_params p = nccl_params(rank, 4, port, 30000);
        p.device = rank;
        rtp_comm *c, *row, *col;
        CHECK_OK(rtp_comm_init(&p, &c));
        CHECK_OK(rtp_comm_mesh_2d(c, 2, 2, &row, &col));
        int rc = collectives(rtp_comm_rank(row), 2, row);
        if (!rc) rc = collectives(rtp_comm_rank(col), 2, col);
        rtp_comm_free(row);
        rtp_comm_free(col);
        rtp_comm_free(c);
        return rc;
      },
      180);
  for (int r = 0; r < 4; r++) EXPECT_EQ(res[r].code, 0) << "rank " << r;
}

// A rank that dies while the other waits in an NCCL all-reduce: the TCP connection's end
// (or NCCL's own report, if it gives one) aborts the NCCL communicator, long before the
// timeout.
void peer_dies() {
  int port = free_port();
  auto res = run_procs(
      2,
      [&](int rank) {
        rtp_comm_params p = nccl_params(rank, 2, port, 30000);
        p.device = rank;
        rtp_comm *c;
        CHECK_OK(rtp_comm_init(&p, &c));
        if (rank == 1) {
          usleep(300000);
          _exit(0);  // no goodbye
        }
        Device d;
        CHECK(d.init() == 0, "device setup");
        rtp_tensor *t = d.tensor({1 << 20}, std::vector<float>(1 << 20, 1.0f));
        CHECK(t, "alloc");
        t->op_params[0] = RTP__COMM_ALLREDUCE;
        double t0 = now_s();
        int st = post_node(rtp__comm_nccl(c), t, d.s);
        if (st == RTP_OK) {
          cudaStreamSynchronize(d.s);  // returns once the watcher aborted the kernel
          st = rtp__nccl_check(rtp__comm_nccl(c));
        }
        int rc = expect_failure(rank, st, t0, 10, {RTP_EPEER}, {"rank 1", "remote"});
        rtp_comm_free(c);
        return rc;
      },
      120);
  EXPECT_EQ(res[0].code, 0);
}

TEST(NcclGpu, PeerDies) {
  NEED_GPUS(2);
  peer_dies();
}

// A rank that stays alive but never posts the operation: the other's times out after
// timeout_ms, and its failure reaches the idle rank through TCP.
TEST(NcclGpu, NeverPosted) {
  NEED_GPUS(2);
  int port = free_port();
  auto res = run_procs(
      2,
      [&](int rank) {
        rtp_comm_params p = nccl_params(rank, 2, port, 3000);
        p.device = rank;
        rtp_comm *c;
        CHECK_OK(rtp_comm_init(&p, &c));
        double t0 = now_s();
        int rc;
        if (rank == 1) {  // posts nothing; heartbeats keep TCP alive until rank 0 gives up
          const char *msg = "";
          int st = RTP_OK;
          while (st == RTP_OK && now_s() - t0 < 20) {
            usleep(10000);
            st = rtp_comm_status(c, &msg);
          }
          rtp__error(st, "%s", msg);  // for expect_failure's message
          rc = expect_failure(rank, st, t0, 20, {RTP_EPEER}, "not complete");
        } else {
          Device d;
          CHECK(d.init() == 0, "device setup");
          rtp_tensor *t = d.tensor({1000}, std::vector<float>(1000, 1.0f));
          CHECK(t, "alloc");
          t->op_params[0] = RTP__COMM_ALLREDUCE;
          int st = post_node(rtp__comm_nccl(c), t, d.s);
          if (st == RTP_OK) {
            cudaStreamSynchronize(d.s);
            st = rtp__nccl_check(rtp__comm_nccl(c));
          }
          rc = expect_failure(rank, st, t0, 15, {RTP_ETIMEDOUT}, "not complete");
        }
        rtp_comm_free(c);
        return rc;
      },
      120);
  for (int r = 0; r < 2; r++) EXPECT_EQ(res[r].code, 0) << "rank " << r;
}

// Two ranks on one GPU: NCCL refuses; both ranks fail, neither hangs.
TEST(NcclGpu, SharedDevice) {
  NEED_GPUS(1);
  int port = free_port();
  auto res = run_procs(
      2,
      [&](int rank) {
        rtp_comm_params p = nccl_params(rank, 2, port, 10000);
        p.device = 0;
        rtp_comm *c = nullptr;
        double t0 = now_s();
        int st = rtp_comm_init(&p, &c);
        fprintf(stderr, "rank %d: %s\n", rank, rtp_last_error());
        CHECK(st != RTP_OK, "init succeeded");
        CHECK(!strstr(rtp_last_error(), "initialization error"),
              "the rank could not use the GPU at all, so NCCL was never asked");
        CHECK(!c, "no communicator");
        CHECK(now_s() - t0 < 15, "took %.1f s", now_s() - t0);
        return 0;
      },
      60);
  for (int r = 0; r < 2; r++) EXPECT_EQ(res[r].code, 0) << "rank " << r;
}

#ifdef RTP_TEST_FAKE_NCCL

namespace {

struct RestoreHooks {
  fake_hooks saved = fake;
  ~RestoreHooks() {
    fake = saved;
  }
};

}  // namespace

// NCCL reports an asynchronous error on rank 1, whose kernel then hangs: seen by the call
// that posted it (the fake's odd operations are still in progress when posted), or else by
// the watcher. Rank 1 fails with it and aborts; rank 0, whose kernel waits for rank 1,
// hears it through TCP and aborts too.
TEST(NcclFake, AsyncError) {
  RestoreHooks restore;
  for (int bad : {1, 2}) {
    fake.fail_rank = 1;
    fake.fail_op = bad;
    int port = free_port();
    auto res = run_procs(
        2,
        [&](int rank) {
          rtp_comm_params p = nccl_params(rank, 2, port, 20000);
          p.device = rank;
          rtp_comm *c;
          CHECK_OK(rtp_comm_init(&p, &c));
          rtp_nccl *nc = rtp__comm_nccl(c);
          Device d;
          CHECK(d.init() == 0, "device setup");
          rtp_tensor *t = d.tensor({1000}, std::vector<float>(1000, 1.0f));
          CHECK(t, "alloc");
          t->op_params[0] = RTP__COMM_ALLREDUCE;
          for (int k = 0; k < bad; k++) {  // these work
            if (run(rank, nc, d, t)) return 12;
            CHECK(d.get(t)[999] == (float)(2 << k), "allreduce %d", k);
          }
          // Both ranks past the working ones before rank 1 fails: else a slow rank 0 could
          // still be checking its last working one when rank 1's failure reaches it.
          CHECK_OK(rtp_comm_barrier(c, nullptr));
          double t0 = now_s();
          int st = post_node(nc, t, d.s);
          if (st == RTP_OK) {
            cudaStreamSynchronize(d.s);
            st = rtp__nccl_check(nc);
          }
          int rc = expect_failure(rank, st, t0, 5, {rank == 1 ? RTP_ECOMM : RTP_EPEER},
                                  "unhandled system error (fake: injected network failure)");
          std::string msg = rtp_last_error();
          if (!rc && rank == 1)
            CHECK(
                contains(msg, bad == 1 ? "ncclAllReduce failed" : "an asynchronous operation"),
                "the message names what failed: %s", msg.c_str());
          if (!rc)  // later posts fail at once, on both transports
            rc = expect_failure(rank, post_node(nc, t, d.s), t0, 5, {RTP_ECOMM, RTP_EPEER},
                                "injected");
          float x = 1;
          if (!rc)
            rc = expect_failure(rank, rtp_comm_allreduce(c, &x, 1, nullptr), t0, 5,
                                {RTP_ECOMM, RTP_EPEER}, "injected");
          rtp_comm_free(c);
          return rc;
        },
        60);
    for (int r = 0; r < 2; r++) EXPECT_EQ(res[r].code, 0) << "rank " << r << ", bad op " << bad;
  }
}

// Rank 1's ncclCommInitRankConfig never completes: it gives up after timeout_ms, aborts,
// and rank 0 (already joined, waiting in the closing barrier) hears why.
TEST(NcclFake, InitNeverCompletes) {
  RestoreHooks restore;
  fake.hang_init_rank = 1;
  int port = free_port();
  auto res = run_procs(
      2,
      [&](int rank) {
        rtp_comm_params p = nccl_params(rank, 2, port, 2000);
        p.device = rank;
        rtp_comm *c = nullptr;
        double t0 = now_s();
        int st = rtp_comm_init(&p, &c);
        CHECK(!c, "no communicator");
        return expect_failure(rank, st, t0, 10, {rank == 1 ? RTP_ETIMEDOUT : RTP_EPEER},
                              "ncclCommInitRankConfig still in progress after 2000 ms");
      },
      60);
  for (int r = 0; r < 2; r++) EXPECT_EQ(res[r].code, 0) << "rank " << r;
}

// A lost peer that NCCL reports (ncclRemoteError) rather than hangs on.
TEST(NcclFake, PeerLossReported) {
  RestoreHooks restore;
  fake.loss_reports = true;
  peer_dies();
}

// The device a rank gets: params.device, else the local rank (RTP_LOCAL_RANK, else the
// rank) modulo the device count; a tensor elsewhere than on that device is refused.
TEST(NcclFake, DeviceChoice) {
  RestoreHooks restore;
  fake.devices = 3;
  int dev = -5;
  setenv("RTP_LOCAL_RANK", "4", 1);
  EXPECT_EQ(rtp__nccl_prepare(0, -1, &dev), RTP_OK);
  EXPECT_EQ(dev, 1);
  setenv("RTP_LOCAL_RANK", "x", 1);
  EXPECT_EQ(rtp__nccl_prepare(0, -1, &dev), RTP_EINVAL);
  EXPECT_TRUE(contains(rtp_last_error(), "RTP_LOCAL_RANK")) << rtp_last_error();
  unsetenv("RTP_LOCAL_RANK");
  EXPECT_EQ(rtp__nccl_prepare(5, -1, &dev), RTP_OK);
  EXPECT_EQ(dev, 2);
  EXPECT_EQ(rtp__nccl_prepare(0, 2, &dev), RTP_OK);
  EXPECT_EQ(dev, 2);
  EXPECT_EQ(rtp__nccl_prepare(0, 3, &dev), RTP_EINVAL);
  EXPECT_TRUE(contains(rtp_last_error(), "CUDA device 3 does not exist (3 on this host)"))
      << rtp_last_error();
  auto res = run_procs(
      1,
      [&](int rank) {
        rtp_comm_params p = nccl_params(0, 1, 0, 20000);
        p.device = 1;
        rtp_comm *c;
        CHECK_OK(rtp_comm_init(&p, &c));
        Device d;
        CHECK(d.init() == 0, "device setup");
        cudaSetDevice(2);
        rtp_tensor *t = d.tensor({10}, std::vector<float>(10, 1.0f));
        CHECK(t, "alloc");
        t->op_params[0] = RTP__COMM_ALLREDUCE;
        int rc =
            expect_failure(rank, post_node(rtp__comm_nccl(c), t, d.s), now_s(), 5, {RTP_EINVAL},
                           "is on CUDA device 2, the NCCL communicator on device 1");
        std::vector<float> host(10);
        t->data = host.data();
        if (!rc)
          rc = expect_failure(rank, post_node(rtp__comm_nccl(c), t, d.s), now_s(), 5,
                              {RTP_EINVAL}, "is not in CUDA device memory");
        const char *msg;  // a mistake of the caller: the communicator is fine
        CHECK(rtp_comm_status(c, &msg) == RTP_OK, "status: %s", msg);
        rtp_comm_free(c);
        return rc;
      },
      60);
  EXPECT_EQ(res[0].code, 0);
}

// A transfer queued behind compute that takes longer than timeout_ms is not late: the
// timeout counts from when its stream reaches it.
TEST(NcclFake, QueuedBehindCompute) {
  int port = free_port();
  auto res = run_procs(
      2,
      [&](int rank) {
        rtp_comm_params p = nccl_params(rank, 2, port, 1500);
        p.device = rank;
        rtp_comm *c;
        CHECK_OK(rtp_comm_init(&p, &c));
        Device d;
        CHECK(d.init() == 0, "device setup");
        rtp_tensor *t = d.tensor({1000}, std::vector<float>(1000, 1.0f));
        CHECK(t, "alloc");
        t->op_params[0] = RTP__COMM_ALLREDUCE;
        fake_stream_sleep(d.s, 3500);
        if (run(rank, rtp__comm_nccl(c), d, t)) return 12;
        CHECK(d.get(t)[0] == 2.0f, "allreduce");
        rtp_comm_free(c);
        return 0;
      },
      60);
  for (int r = 0; r < 2; r++) EXPECT_EQ(res[r].code, 0) << "rank " << r;
}

// The NCCL library found at run time is checked before the rendezvous: too old fails every
// rank with its own reason; old but usable (no reliable abort from another thread) warns.
TEST(NcclFake, LibraryVersion) {
  RestoreHooks restore;
  for (int v : {21306, 21805}) {
    fake.nccl_version = v;
    int port = free_port();
    auto res = run_procs(
        2,
        [&](int rank) {
          rtp_comm_params p = nccl_params(rank, 2, port, 10000);
          p.device = rank;
          rtp_comm *c = nullptr;
          double t0 = now_s();
          int st = rtp_comm_init(&p, &c);
          if (v < 21400) {
            CHECK(!c, "no communicator");
            return expect_failure(rank, st, t0, 5, {RTP_ENOSYS}, "NCCL 2.13 is too old");
          }
          CHECK_OK(st);
          rtp_comm_free(c);
          return 0;
        },
        60);
    for (int r = 0; r < 2; r++) EXPECT_EQ(res[r].code, 0) << "rank " << r << ", version " << v;
  }
}

#endif  // RTP_TEST_FAKE_NCCL

#endif  // RTP_HAVE_NCCL
