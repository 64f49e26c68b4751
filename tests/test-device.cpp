// The executor's stream path (what a GPU backend runs) tested without a GPU: the simulated
// device (rtp_backend_sim_new) keeps its work in two in-order queues until sync, then runs
// it in an order a scheduler picks among those the events allow. Kernels are the CPU's and
// transfers the real TCP communicator's, so results must equal the CPU executor's whatever
// the order; an event the executor forgot lets a node run before what it depends on, and
// the results differ (the control test shows that they do).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "gpt.h"
extern "C" {
#include "rtp-backend.h"
}
#include "test-util.h"
#include "test-gpt-ranks.h"

namespace {

enum class Order { kComputeFirst, kCommFirst, kRandom };

// The library's simulated device (rtp-sim.c), set up for one test: its memory is
// protected from the host, so a host access the executor should not make faults.
struct SimDevice {
  rtp_backend *b = nullptr;
  explicit SimDevice(Order order, bool drop_waits = false, unsigned seed = 1) {
    EXPECT_EQ(rtp_backend_sim_new(seed, &b), RTP_OK) << rtp_last_error();
    rtp__sim_order o = order == Order::kComputeFirst ? RTP__SIM_COMPUTE_FIRST
                       : order == Order::kCommFirst  ? RTP__SIM_COMM_FIRST
                                                     : RTP__SIM_RANDOM;
    EXPECT_EQ(rtp__sim_set_order(b, o), RTP_OK);
    EXPECT_EQ(rtp__sim_drop_waits(b, drop_waits), RTP_OK);
  }
  ~SimDevice() {
    rtp_backend_free(b);
  }
  SimDevice(const SimDevice &) = delete;
  SimDevice &operator=(const SimDevice &) = delete;
  rtp_backend *get() {
    return b;
  }
  long host_touch_while_busy() {
    return rtp__sim_host_touches_while_busy(b);
  }
};

// ---- a graph of chained rotations, compute between them, and an all-reduce -----------

// A rank of a ring of `world` ranks: its context (tensor data on b, NULL: the CPU), a
// vector of kN values and two slots to receive into, and its neighbours.
struct Ring {
  static const int kN = 37;
  rtp_comm *comm = nullptr;
  rtp_context *ctx = nullptr;
  rtp_tensor *mine = nullptr, *slot[2] = {nullptr, nullptr};
  int left = 0, right = 0;

  int open(int rank, int world, int port, rtp_backend *b) {
    rtp_comm_params cp = rtptest::params(rank, world, port);
    if (rtp_comm_init(&cp, &comm)) return 10;
    rtp_init_params ip = {8 << 20, nullptr, false, b, b ? 8u << 20 : 0};
    if (!(ctx = rtp_context_new(ip))) return 11;
    mine = rtp_tensor_new_1d(ctx, RTP_TYPE_F32, kN);
    for (rtp_tensor *&t : slot) t = rtp_tensor_new_1d(ctx, RTP_TYPE_F32, kN);
    left = (rank + world - 1) % world;
    right = (rank + 1) % world;
    return 0;
  }
  ~Ring() {
    rtp_context_free(ctx);
    rtp_comm_free(comm);
  }
};

// Each rank rotates a vector two hops down the ring, computing on the way, and sums a
// result over ranks; returns the 37 outputs of 3 runs (0 on success, else a code).
int rotations(int rank, int world, int port, rtp_backend *b, std::vector<float> *out) {
  Ring ring;
  if (int rc = ring.open(rank, world, port, b)) return rc;
  auto &[comm, ctx, mine, slot, left, right] = ring;
  const int n = Ring::kN;
  rtp_tensor *hop1 =
      rtp_sendrecv(ctx, comm, rtp_gelu(ctx, mine), left, slot[0], right, nullptr);
  rtp_tensor *busy = rtp_gelu(ctx, rtp_scale(ctx, mine, 0.5f));
  rtp_tensor *hop2 = rtp_sendrecv(ctx, comm, hop1, left, slot[1], right, hop1);
  rtp_tensor *got = rtp_add(ctx, rtp_scale(ctx, hop2, 2.0f), busy);
  rtp_tensor *summed = rtp_allreduce(ctx, comm, got, nullptr);
  rtp_tensor *res = rtp_mul(ctx, summed, rtp_scale(ctx, hop1, 3.0f));
  rtp_tensor_set_output(res);
  rtp_graph *g = rtp_graph_new(ctx, 64);
  if (rtp_graph_build(g, res) || rtp_graph_plan(ctx, g)) return 12;
  for (int rep = 0; rep < 3; rep++) {
    std::vector<float> x(n);
    for (int i = 0; i < n; i++) x[i] = 0.01f * (float)(100 * rank + i + 7 * rep);
    if (rtp_tensor_set(mine, x.data(), 0, n * sizeof(float))) return 13;
    if (rtp_graph_compute(g, nullptr)) {
      fprintf(stderr, "rank %d: %s\n", rank, rtp_last_error());
      return 14;
    }
    std::vector<float> y(n);
    if (rtp_tensor_get(res, y.data(), 0, n * sizeof(float))) return 15;
    out->insert(out->end(), y.begin(), y.end());
  }
  return 0;
}

// Every rank's results on the simulated device under `order`, compared with the CPU
// executor's: 0 if equal, 1 if they differ, else the failure code.
int rotations_agree(int rank, int world, int port_cpu, int port_dev, Order order,
                    bool drop_waits) {
  std::vector<float> want, got;
  int rc = rotations(rank, world, port_cpu, nullptr, &want);
  if (rc) return rc;
  SimDevice dev(order, drop_waits, 7u + (unsigned)rank);
  rc = rotations(rank, world, port_dev, dev.get(), &got);
  if (rc) return rc;
  if (dev.host_touch_while_busy()) return 20;
  for (size_t i = 0; i < want.size(); i++)
    if (!(got[i] == want[i])) return 1;
  return 0;
}

void expect_rotations(Order order, bool drop_waits, int want_code) {
  for (int world : {1, 2, 3}) {
    int p1 = rtptest::free_port(), p2 = rtptest::free_port();
    auto res = rtptest::run_procs(world, [&](int rank) {
      return rotations_agree(rank, world, p1, p2, order, drop_waits);
    });
    for (int r = 0; r < world; r++)
      EXPECT_EQ(res[r].code, want_code) << "world " << world << " rank " << r;
  }
}

TEST(Streams, RotationsMatchCpuWhenComputeRunsFirst) {
  expect_rotations(Order::kComputeFirst, false, 0);
}

TEST(Streams, RotationsMatchCpuWhenTransfersRunFirst) {
  expect_rotations(Order::kCommFirst, false, 0);
}

TEST(Streams, RotationsMatchCpuInRandomOrders) {
  expect_rotations(Order::kRandom, false, 0);
}

// Without its events the same schedule reads results before the transfers made them.
TEST(Streams, ControlWithoutEventsResultsDiffer) {
  expect_rotations(Order::kComputeFirst, true, 1);
}

// A transfer whose result only another transfer reads (hop1, read by hop2 alone) is waited
// for by no compute node: on a device, the first compute wait that orders it is that of
// hop2's reader. Its source (the planned x) must stay in place until then; a node placed
// after hop2 (later, reading neither) that took x's memory once x's last reader was posted
// overwrote x before hop1 sent it when compute ran first.
int forwarded(int rank, int world, int port, rtp_backend *b, std::vector<float> *out) {
  Ring ring;
  if (int rc = ring.open(rank, world, port, b)) return rc;
  auto &[comm, ctx, mine, slot, left, right] = ring;
  const int n = Ring::kN;
  rtp_tensor *x = rtp_gelu(ctx, mine);
  rtp_tensor *hop1 = rtp_sendrecv(ctx, comm, x, left, slot[0], right, nullptr);
  rtp_tensor *hop2 = rtp_sendrecv(ctx, comm, hop1, left, slot[1], right, hop1);
  rtp_tensor *late = rtp_scale(ctx, mine, 3.0f);  // x's size, placed after hop2
  rtp_tensor *res = rtp_add(ctx, rtp_scale(ctx, hop2, 2.0f), late);
  rtp_tensor_set_output(res);
  rtp_graph *g = rtp_graph_new(ctx, 64);
  if (rtp_graph_build(g, hop2) || rtp_graph_build(g, late) || rtp_graph_build(g, res) ||
      rtp_graph_plan(ctx, g))
    return 12;
  std::vector<float> v(n);
  for (int i = 0; i < n; i++) v[i] = 0.01f * (float)(100 * rank + i);
  if (rtp_tensor_set(mine, v.data(), 0, n * sizeof(float))) return 13;
  if (rtp_graph_compute(g, nullptr)) {
    fprintf(stderr, "rank %d: %s\n", rank, rtp_last_error());
    return 14;
  }
  if (rtp_tensor_get(res, v.data(), 0, n * sizeof(float))) return 15;
  out->insert(out->end(), v.begin(), v.end());
  return 0;
}

TEST(Streams, AForwardedTransferKeepsItsSourceUntilItIsWaitedFor) {
  for (int world : {2, 3}) {
    int p1 = rtptest::free_port(), p2 = rtptest::free_port();
    auto res = rtptest::run_procs(world, [&](int rank) {
      std::vector<float> want, got;
      int rc = forwarded(rank, world, p1, nullptr, &want);
      SimDevice dev(Order::kComputeFirst);
      if (!rc) rc = forwarded(rank, world, p2, dev.get(), &got);
      return rc ? rc : want == got ? 0 : 1;
    });
    for (int r = 0; r < world; r++)
      EXPECT_EQ(res[r].code, 0) << "world " << world << " rank " << r;
  }
}

// ---- the GPT reference model under each strategy ---------------------------------------

int train_agrees(int rank, int world, int port_cpu, int port_dev, rtp_strategy strategy) {
  std::vector<float> l0, p0, l1, p1;
  int rc = rtptest::train_gpt_rank(rtptest::params(rank, world, port_cpu), strategy, nullptr,
                                   &l0, &p0);
  if (rc) return rc;
  SimDevice dev(Order::kRandom, false, 11u + (unsigned)rank);
  rc = rtptest::train_gpt_rank(rtptest::params(rank, world, port_dev), strategy, dev.get(), &l1,
                               &p1);
  if (rc) return rc;
  if (dev.host_touch_while_busy()) return 20;
  if (l0 != l1) return 1;
  if (p0 != p1) return 2;
  return 0;
}

TEST(Streams, TrainingMatchesCpuForEveryStrategy) {
  for (rtp_strategy s :
       {RTP_STRATEGY_RTP, RTP_STRATEGY_DDP, RTP_STRATEGY_FSDP, RTP_STRATEGY_TP}) {
    const int world = 2;
    int p1 = rtptest::free_port(), p2 = rtptest::free_port();
    auto res = rtptest::run_procs(
        world, [&](int rank) { return train_agrees(rank, world, p1, p2, s); }, 120);
    for (int r = 0; r < world; r++)
      EXPECT_EQ(res[r].code, 0) << rtp_strategy_name(s) << " rank " << r;
  }
}

// ---- host copies: safetensors to and from device memory ---------------------------------

TEST(Device, SafetensorsRoundTripThroughDeviceMemory) {
  SimDevice dev(Order::kRandom);
  rtp_init_params ip = {1 << 20, nullptr, false, dev.get(), 8 << 20};
  rtp_context *ctx = rtp_context_new(ip);
  ASSERT_NE(ctx, nullptr);
  // Larger than the 1 MiB staging buffer, so the copy takes several chunks.
  const int64_t rows = 700, cols = 500;
  rtp_tensor *w = rtp_tensor_set_name(rtp_tensor_new_2d(ctx, RTP_TYPE_F32, cols, rows), "w");
  std::vector<float> v(rows * cols);
  for (size_t i = 0; i < v.size(); i++) v[i] = 0.25f * (float)i - 3.0f;
  ASSERT_EQ(rtp_tensor_set(w, v.data(), 0, v.size() * 4), RTP_OK);
  std::string path = testing::TempDir() + "rtp-device.safetensors";
  ASSERT_EQ(rtp_safetensors_save(path.c_str(), &w, 1, nullptr), RTP_OK) << rtp_last_error();

  rtp_safetensors *st = nullptr;
  ASSERT_EQ(rtp_safetensors_open(path.c_str(), &st), RTP_OK);
  rtp_tensor *back = rtp_tensor_new_2d(ctx, RTP_TYPE_F32, cols, 300);  // rows 200..499
  ASSERT_EQ(rtp_safetensors_read_rows(st, "w", 200, back), RTP_OK) << rtp_last_error();
  std::vector<float> got(300 * cols);
  ASSERT_EQ(rtp_tensor_get(back, got.data(), 0, got.size() * 4), RTP_OK);
  for (size_t i = 0; i < got.size(); i++) ASSERT_EQ(got[i], v[200 * cols + i]) << i;

  // A strided view of device memory (one column) is saved row by row.
  const int64_t ne[2] = {1, rows};
  const size_t nb[2] = {4, (size_t)cols * 4};
  rtp_tensor *col = rtp_tensor_set_name(rtp_view(ctx, w, 2, ne, nb, 0), "col");
  ASSERT_NE(col, nullptr);
  std::string cpath = testing::TempDir() + "rtp-device-col.safetensors";
  ASSERT_EQ(rtp_safetensors_save(cpath.c_str(), &col, 1, nullptr), RTP_OK) << rtp_last_error();
  rtp_safetensors *cst = nullptr;
  ASSERT_EQ(rtp_safetensors_open(cpath.c_str(), &cst), RTP_OK);
  rtp_tensor *cback = rtp_tensor_new_2d(ctx, RTP_TYPE_F32, 1, rows);
  ASSERT_EQ(rtp_safetensors_read(cst, "col", cback), RTP_OK) << rtp_last_error();
  std::vector<float> cgot(rows);
  ASSERT_EQ(rtp_tensor_get(cback, cgot.data(), 0, cgot.size() * 4), RTP_OK);
  for (int64_t r = 0; r < rows; r++) ASSERT_EQ(cgot[r], v[r * cols]) << r;
  rtp_safetensors_close(cst);
  EXPECT_EQ(dev.host_touch_while_busy(), 0);
  rtp_safetensors_close(st);
  rtp_context_free(ctx);
}

}  // namespace
