// The memory planner and the memory report: no two tensors that are alive at the same
// time share memory (checked against liveness computed here, independently), the peak
// is far below the sum of all activations, and the report counts every role.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdint>
#include <vector>

#include "gpt.h"
#include "rtp.h"

namespace {

struct Built {
  rtp_context *ctx = nullptr;
  gpt m{};
  rtp_graph *g = nullptr;
  ~Built() {
    rtp_context_free(ctx);
  }
};

void build(Built &b, gpt_config cfg, int batch) {
  rtp_init_params ip = {gpt_arena_size(cfg, batch), nullptr, false, nullptr, 0};
  b.ctx = rtp_context_new(ip);
  ASSERT_NE(b.ctx, nullptr) << rtp_last_error();
  ASSERT_EQ(gpt_build(b.ctx, &b.m, cfg, batch), 0) << rtp_last_error();
  b.g = rtp_graph_new(b.ctx, 8192);
  ASSERT_EQ(rtp_graph_build(b.g, b.m.loss), 0) << rtp_last_error();
  ASSERT_EQ(rtp_graph_build_backward(b.ctx, b.g, b.m.loss), 0) << rtp_last_error();
  ASSERT_EQ(rtp_graph_plan(b.ctx, b.g), 0) << rtp_last_error();
}

bool is_view(const rtp_tensor *t) {
  return t->op == RTP_OP_RESHAPE || t->op == RTP_OP_VIEW || t->op == RTP_OP_PERMUTE ||
         t->op == RTP_OP_TRANSPOSE;
}

const rtp_tensor *base(const rtp_tensor *t) {
  return t->view_src ? t->view_src : t;
}

// Unfused attention, and fused (whose backward writes its rows' dO . O into the second
// half of the statistics the forward's log-sum-exp fills: a node that lives in another's
// memory, as views do).
class PlannerGpt : public ::testing::TestWithParam<bool> {};

TEST_P(PlannerGpt, LiveTensorsNeverOverlap) {
  gpt_config cfg = {256, 40, 64, 2, 4, false, GetParam()};
  Built b;
  ASSERT_NO_FATAL_FAILURE(build(b, cfg, 3));
  rtp_graph *g = b.g;
  int n = g->n_nodes;
  std::vector<int> index_of_node;  // planned nodes
  std::vector<int> last(n);
  for (int i = 0; i < n; i++) last[i] = i;
  auto find = [&](const rtp_tensor *t) {
    for (int i = 0; i < n; i++)
      if (g->nodes[i] == t) return i;
    return -1;
  };
  for (int i = 0; i < n; i++) {
    const rtp_tensor *t = g->nodes[i];
    for (const rtp_tensor *s : t->src) {
      if (!s) continue;
      int j = find(base(s));
      if (j >= 0) last[j] = std::max(last[j], i);
    }
    if (t->flags & (RTP_FLAG_OUTPUT | RTP_FLAG_LOSS)) {
      int j = find(base(t));
      if (j >= 0) last[j] = n;
    }
  }
  std::vector<int> planned;
  for (int i = 0; i < n; i++) {
    const rtp_tensor *t = g->nodes[i];
    ASSERT_NE(t->data, nullptr) << "node " << i << " " << rtp_op_name(t->op) << " not placed";
    if (!is_view(t) && !t->view_src && t->role == RTP_ROLE_ACTIVATION) planned.push_back(i);
  }
  ASSERT_GT(planned.size(), 50u);
  int checked = 0, in_place = 0;
  for (size_t x = 0; x < planned.size(); x++)
    for (size_t y = x + 1; y < planned.size(); y++) {
      int i = planned[x], j = planned[y];  // i < j: alive together if j <= last[i]
      if (j > last[i]) continue;
      auto lo = [](const rtp_tensor *t) { return (uintptr_t)t->data; };
      auto hi = [](const rtp_tensor *t) { return (uintptr_t)t->data + rtp_tensor_nbytes(t); };
      const rtp_tensor *a = g->nodes[i], *c = g->nodes[j];
      // In place: c may take over exactly the memory of a source that dies at c.
      bool reads_a = false;
      for (const rtp_tensor *s : c->src) reads_a |= s == a;
      if (reads_a && last[i] == j && a->data == c->data &&
          rtp_tensor_nbytes(a) == rtp_tensor_nbytes(c)) {
        in_place++;
        continue;
      }
      EXPECT_TRUE(hi(a) <= lo(c) || hi(c) <= lo(a))
          << rtp_op_name(a->op) << " #" << i << " and " << rtp_op_name(c->op) << " #" << j
          << " overlap while both alive";
      checked++;
    }
  EXPECT_GT(checked, 100);
  EXPECT_GT(in_place, 10);  // backward accumulates gradients in place
}

INSTANTIATE_TEST_SUITE_P(Attention, PlannerGpt, ::testing::Values(false, true),
                         [](const auto &p) { return p.param ? "fused" : "unfused"; });

// The fused attention op keeps no T x T matrix: the planned activation peak of the small
// model's training step falls by the probabilities the unfused chain keeps for backward
// (L x B x H x T x T floats), less the row statistics the fused op keeps instead
// (L x B x H x T x 2 floats).
TEST(Planner, FusedAttentionDropsTheProbabilities) {
  gpt_config cfg = gpt_config_small();
  const int batch = 4;
  rtp_mem_report r[2];
  for (int fused = 0; fused < 2; fused++) {
    cfg.fused_attention = fused;
    Built b;
    ASSERT_NO_FATAL_FAILURE(build(b, cfg, batch));
    rtp_mem_report_get(b.ctx, &r[fused]);
  }
  double rows = (double)cfg.n_layer * batch * cfg.n_head * cfg.seq_len;
  double probs = rows * cfg.seq_len * 4, stats = rows * 2 * 4;
  double saved = (double)r[0].bytes[RTP_ROLE_ACTIVATION] - r[1].bytes[RTP_ROLE_ACTIVATION];
  std::printf(
      "activations: unfused %zu, fused %zu bytes (%.2f MiB less; probabilities %.2f "
      "MiB, statistics %.2f MiB); kernel scratch %zu -> %zu bytes\n",
      r[0].bytes[RTP_ROLE_ACTIVATION], r[1].bytes[RTP_ROLE_ACTIVATION], saved / 1048576,
      probs / 1048576, stats / 1048576, r[0].work, r[1].work);
  EXPECT_GE(saved, probs - stats);
  EXPECT_LT(r[1].activation_sum, r[0].activation_sum);
}

TEST(Planner, SmallModelPeakFarBelowSum) {
  Built b;
  ASSERT_NO_FATAL_FAILURE(build(b, gpt_config_small(), 8));
  rtp_mem_report r;
  rtp_mem_report_get(b.ctx, &r);
  EXPECT_GT(r.activation_sum, 0u);
  EXPECT_LT(r.bytes[RTP_ROLE_ACTIVATION], r.activation_sum / 2)
      << "peak " << r.bytes[RTP_ROLE_ACTIVATION] << " sum " << r.activation_sum;
}

TEST(MemReport, CountsEveryRole) {
  gpt_config cfg = {256, 16, 32, 2, 4, false, false};
  Built b;
  ASSERT_NO_FATAL_FAILURE(build(b, cfg, 2));
  rtp_mem_report before;
  rtp_mem_report_get(b.ctx, &before);
  size_t pbytes = 0;
  for (int i = 0; i < b.m.n_params; i++) pbytes += rtp_tensor_nbytes(b.m.params[i]);
  EXPECT_EQ((size_t)gpt_n_params(cfg) * 4, pbytes);
  // Padded to the arena's alignment, so within 64 bytes per tensor.
  EXPECT_GE(before.bytes[RTP_ROLE_PARAM], pbytes);
  EXPECT_LE(before.bytes[RTP_ROLE_PARAM], pbytes + 64 * (size_t)b.m.n_params);
  EXPECT_GE(before.bytes[RTP_ROLE_GRAD], pbytes);
  EXPECT_LE(before.bytes[RTP_ROLE_GRAD], pbytes + 64 * (size_t)b.m.n_params);
  EXPECT_EQ(before.bytes[RTP_ROLE_OPTIM], 0u);
  ASSERT_NE(rtp_optimizer_new(b.ctx, b.g, rtp_adamw_params_default()), nullptr);
  rtp_mem_report after;
  rtp_mem_report_get(b.ctx, &after);
  EXPECT_EQ(after.bytes[RTP_ROLE_OPTIM], 2 * before.bytes[RTP_ROLE_PARAM]);
  EXPECT_GT(after.bytes[RTP_ROLE_ACTIVATION], 0u);
  EXPECT_GT(after.bytes[RTP_ROLE_INPUT], 0u);  // tokens and targets
}

// Computing again allocates nothing: the arena does not grow after planning.
TEST(Planner, ComputeDoesNotAllocate) {
  gpt_config cfg = {256, 16, 32, 2, 4, false, false};
  Built b;
  ASSERT_NO_FATAL_FAILURE(build(b, cfg, 2));
  rtp_optimizer *opt = rtp_optimizer_new(b.ctx, b.g, rtp_adamw_params_default());
  size_t used = rtp_context_used_mem(b.ctx);
  rtp_threadpool *tp = rtp_threadpool_new(2);
  for (int s = 0; s < 3; s++) {
    ASSERT_EQ(rtp_graph_compute(b.g, tp), 0) << rtp_last_error();
    ASSERT_EQ(rtp_optimizer_step(opt, tp), 0);
  }
  EXPECT_EQ(rtp_context_used_mem(b.ctx), used);
  rtp_threadpool_free(tp);
}

}  // namespace

namespace {

// Tensors can be found again by name and iterated in creation order.
TEST(Context, FindAndIterateTensors) {
  rtp_init_params ip = {1 << 20, nullptr, false, nullptr, 0};
  rtp_context *ctx = rtp_context_new(ip);
  rtp_tensor *a = rtp_tensor_set_name(rtp_tensor_new_1d(ctx, RTP_TYPE_F32, 3), "a");
  rtp_tensor *b =
      rtp_tensor_set_name(rtp_tensor_new_2d(ctx, RTP_TYPE_I32, 2, 2), "layer.%d.b", 7);
  rtp_tensor *c = rtp_gelu(ctx, a);
  EXPECT_EQ(rtp_context_find_tensor(ctx, "a"), a);
  EXPECT_EQ(rtp_context_find_tensor(ctx, "layer.7.b"), b);
  EXPECT_EQ(rtp_context_find_tensor(ctx, "missing"), nullptr);
  EXPECT_EQ(rtp_context_tensor_at(ctx, 0), a);
  EXPECT_EQ(rtp_context_tensor_at(ctx, 1), b);
  EXPECT_EQ(rtp_context_tensor_at(ctx, 2), c);
  EXPECT_EQ(rtp_context_tensor_at(ctx, 3), nullptr);
  EXPECT_EQ(b->data != nullptr, true);  // leafs get memory, op results wait for the planner
  EXPECT_EQ(c->data, nullptr);
  rtp_context_free(ctx);
}

}  // namespace
