// Mistakes a caller can make get a status and a message naming the op and the shapes;
// nothing aborts, nothing writes out of bounds (this suite also runs under ASan/UBSan).
#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "gpt.h"
#include "rtp.h"
#include "test-gpt-ranks.h"

namespace {

rtp_context *new_ctx(size_t bytes = 1 << 20) {
  rtp_init_params ip = {bytes, nullptr, false, nullptr, 0};
  return rtp_context_new(ip);
}

std::string ctx_msg(rtp_context *ctx) {
  const char *m = nullptr;
  rtp_context_error(ctx, &m);
  return m ? m : "";
}

TEST(Errors, ShapeMismatchNamesOpAndShapes) {
  rtp_context *ctx = new_ctx();
  rtp_tensor *a = rtp_tensor_set_name(rtp_tensor_new_2d(ctx, RTP_TYPE_F32, 3, 4), "w");
  rtp_tensor *b = rtp_tensor_set_name(rtp_tensor_new_2d(ctx, RTP_TYPE_F32, 5, 4), "x");
  EXPECT_EQ(rtp_mul_mat(ctx, a, b), nullptr);
  EXPECT_EQ(rtp_context_error(ctx, nullptr), RTP_ESHAPE);
  std::string m = ctx_msg(ctx);
  EXPECT_NE(m.find("mul_mat"), std::string::npos) << m;
  EXPECT_NE(m.find("'w'[3,4,1,1]"), std::string::npos) << m;
  EXPECT_NE(m.find("'x'[5,4,1,1]"), std::string::npos) << m;
  EXPECT_EQ(std::string(rtp_last_error()), m);
  // The first error stays; builders given NULL pass the failure on.
  EXPECT_EQ(rtp_gelu(ctx, nullptr), nullptr);
  EXPECT_EQ(rtp_add(ctx, a, rtp_tensor_new_1d(ctx, RTP_TYPE_F32, 7)), nullptr);
  EXPECT_EQ(ctx_msg(ctx), m);
  rtp_context_free(ctx);
}

TEST(Errors, EveryBuilderChecksItsInputs) {
  rtp_context *ctx = new_ctx();
  rtp_tensor *f = rtp_tensor_new_2d(ctx, RTP_TYPE_F32, 4, 3);
  rtp_tensor *i = rtp_tensor_new_1d(ctx, RTP_TYPE_I32, 3);
  rtp_tensor *wrong = rtp_tensor_new_2d(ctx, RTP_TYPE_F32, 5, 2);
  rtp_tensor *p3 = rtp_permute(ctx, rtp_tensor_new_3d(ctx, RTP_TYPE_F32, 4, 2, 3), 1, 2, 0, 3);
  rtp_tensor *tall = rtp_tensor_new_2d(ctx, RTP_TYPE_F32, 2, 3);
  const int64_t ne44[2] = {4, 4};
  struct Case {
    const char *name;
    std::function<rtp_tensor *()> build;
  } cases[] = {
      {"add", [&] { return rtp_add(ctx, f, wrong); }},
      {"mul", [&] { return rtp_mul(ctx, f, i); }},
      {"gelu", [&] { return rtp_gelu(ctx, i); }},
      {"soft_max", [&] { return rtp_soft_max(ctx, tall, 1, true); }},
      {"get_rows", [&] { return rtp_get_rows(ctx, f, f); }},
      {"cross_entropy", [&] { return rtp_cross_entropy(ctx, f, wrong); }},
      {"reshape", [&] { return rtp_reshape_2d(ctx, f, 5, 5); }},
      {"reshape", [&] { return rtp_reshape_2d(ctx, rtp_transpose(ctx, f), 3, 4); }},
      {"view", [&] { return rtp_view(ctx, f, 2, ne44, f->nb, 0); }},
      {"view_rows", [&] { return rtp_view_rows(ctx, f, 2, 2); }},
      {"permute", [&] { return rtp_permute(ctx, f, 0, 0, 1, 2); }},
      {"concat", [&] { return rtp_concat(ctx, f, wrong, 0); }},
      {"acc", [&] { return rtp_acc(ctx, f, wrong, f->nb[1], f->nb[2], f->nb[3], 40); }},
      {"repeat", [&] { return rtp_repeat(ctx, wrong, f); }},
      {"layer_norm", [&] { return rtp_layer_norm(ctx, f, wrong, nullptr, 1e-5f); }},
      {"mul_mat", [&] { return rtp_mul_mat(ctx, f, wrong); }},
      {"mul_mat",
       [&] { return rtp_mul_mat(ctx, rtp_tensor_new_2d(ctx, RTP_TYPE_F32, 2, 5), p3); }},
  };
  for (const Case &c : cases) {
    EXPECT_EQ(c.build(), nullptr) << c.name;
    EXPECT_NE(std::string(rtp_last_error()).find(c.name), std::string::npos)
        << c.name << ": " << rtp_last_error();
  }
  rtp_context_free(ctx);
}

TEST(Errors, ArenaFullSaysHowMuch) {
  rtp_context *ctx = new_ctx(64 << 10);
  EXPECT_EQ(rtp_tensor_new_2d(ctx, RTP_TYPE_F32, 1024, 1024), nullptr);
  EXPECT_EQ(rtp_context_error(ctx, nullptr), RTP_ENOMEM);
  std::string m = ctx_msg(ctx);
  EXPECT_NE(m.find("needs 4194304 bytes"), std::string::npos) << m;
  EXPECT_NE(m.find("of 65536 are left"), std::string::npos) << m;
  rtp_context_free(ctx);
  // Planning a model into an arena too small for its activations fails the same way.
  gpt_config cfg = {256, 16, 32, 2, 4};
  for (size_t bytes : {16u << 10, 256u << 10, 1u << 20}) {
    ctx = new_ctx(bytes);
    gpt m{};
    rtp_graph *g = rtp_graph_new(ctx, 4096);
    bool failed = gpt_build(ctx, &m, cfg, 2) != 0 || rtp_graph_build(g, m.loss) != 0 ||
                  rtp_graph_build_backward(ctx, g, m.loss) != 0 ||
                  rtp_graph_plan(ctx, g) != 0 ||
                  rtp_optimizer_new(ctx, g, rtp_adamw_params_default()) == nullptr;
    EXPECT_TRUE(failed) << bytes;
    EXPECT_EQ(rtp_context_error(ctx, nullptr), RTP_ENOMEM) << bytes;
    rtp_context_free(ctx);
  }
}

TEST(Errors, GraphMisuse) {
  rtp_context *ctx = new_ctx();
  rtp_tensor *x = rtp_tensor_new_1d(ctx, RTP_TYPE_F32, 4);
  rtp_tensor *y = rtp_gelu(ctx, rtp_gelu(ctx, rtp_gelu(ctx, x)));
  rtp_graph *small = rtp_graph_new(ctx, 2);
  EXPECT_EQ(rtp_graph_build(small, y), RTP_ENOMEM);
  EXPECT_NE(std::string(rtp_last_error()).find("graph full"), std::string::npos);
  rtp_graph *g = rtp_graph_new(ctx, 16);
  ASSERT_EQ(rtp_graph_build(g, y), 0);
  EXPECT_EQ(rtp_graph_compute(g, nullptr), RTP_ESTATE);                      // not planned
  EXPECT_EQ(rtp_graph_build_backward(ctx, g, rtp_sum(ctx, y)), RTP_EINVAL);  // loss not in g
  rtp_tensor *l = rtp_sum(ctx, y);
  ASSERT_EQ(rtp_graph_build(g, l), 0);
  EXPECT_EQ(rtp_graph_build_backward(ctx, g, l), RTP_EINVAL);  // no parameters
  EXPECT_NE(std::string(rtp_last_error()).find("no parameter"), std::string::npos);
  EXPECT_EQ(rtp_graph_new(ctx, 0), nullptr);
  EXPECT_EQ(rtp_graph_build(nullptr, y), RTP_EINVAL);
  rtp_context_free(ctx);
}

// Parallel marks go on parameters only, with sensible values: a clear error otherwise.
TEST(Errors, ParallelMarks) {
  rtp_context *ctx = new_ctx();
  rtp_tensor *x = rtp_tensor_new_1d(ctx, RTP_TYPE_F32, 4),
             *w = rtp_tensor_new_1d(ctx, RTP_TYPE_F32, 4);
  rtp_tensor_set_param(rtp_tensor_set_name(w, "w"));
  EXPECT_EQ(rtp_tensor_set_fsdp_unit(x, 1), RTP_EINVAL);
  EXPECT_NE(std::string(rtp_last_error()).find("not a parameter"), std::string::npos);
  EXPECT_EQ(rtp_tensor_set_fsdp_unit(nullptr, 1), RTP_EINVAL);
  EXPECT_EQ(rtp_tensor_set_fsdp_unit(w, -1), RTP_EINVAL);
  EXPECT_NE(std::string(rtp_last_error()).find("unit -1 for 'w'"), std::string::npos);
  EXPECT_EQ(rtp_tensor_set_fsdp_unit(w, 3), RTP_OK);
  EXPECT_EQ(rtp_tensor_set_fsdp_unit(w, 0), RTP_OK);
  EXPECT_EQ(rtp_tensor_set_tp(x, RTP_TP_COLUMN, 1), RTP_EINVAL);
  EXPECT_EQ(rtp_tensor_set_tp(w, RTP_TP_ROW, 2), RTP_EINVAL);
  EXPECT_EQ(rtp_tensor_set_tp(w, RTP_TP_COLUMN, 0), RTP_EINVAL);
  rtp_context_free(ctx);
}

TEST(Errors, BadTokensAreReportedNotRead) {
  rtp_context *ctx = new_ctx(64 << 20);
  gpt m{};
  gpt_config cfg = {256, 16, 32, 2, 4};
  ASSERT_EQ(gpt_build(ctx, &m, cfg, 2), 0);
  rtp_graph *g = rtp_graph_new(ctx, 4096);
  ASSERT_EQ(rtp_graph_build(g, m.loss), 0);
  ASSERT_EQ(rtp_graph_build_backward(ctx, g, m.loss), 0);
  ASSERT_EQ(rtp_graph_plan(ctx, g), 0);
  for (int32_t bad : {-1, 256, 1 << 30}) {
    ((int32_t *)m.idx->data)[5] = bad;
    EXPECT_EQ(rtp_graph_compute(g, nullptr), RTP_EINVAL);
    EXPECT_NE(std::string(rtp_last_error()).find("get_rows"), std::string::npos)
        << rtp_last_error();
    ((int32_t *)m.idx->data)[5] = 0;
    ((int32_t *)m.targets->data)[3] = bad;
    EXPECT_EQ(rtp_graph_compute(g, nullptr), RTP_EINVAL);
    EXPECT_NE(std::string(rtp_last_error()).find("cross_entropy"), std::string::npos)
        << rtp_last_error();
    ((int32_t *)m.targets->data)[3] = 0;
  }
  EXPECT_EQ(rtp_graph_compute(g, nullptr), 0);
  rtp_context_free(ctx);
}

// A product's precision: only mul_mat nodes, only f32 and bf16; set before planning, since
// the plan sizes the scratch a bf16 product rounds its operands into.
TEST(Errors, MulMatPrecision) {
  rtp_context *ctx = new_ctx();
  rtp_tensor *a = rtp_tensor_new_2d(ctx, RTP_TYPE_F32, 4, 3);
  rtp_tensor *b = rtp_tensor_set_name(rtp_tensor_new_2d(ctx, RTP_TYPE_F32, 4, 5), "x");
  rtp_tensor *mm = rtp_tensor_set_name(rtp_mul_mat(ctx, a, b), "mm");
  rtp_tensor *g = rtp_tensor_set_name(rtp_gelu(ctx, mm), "act");
  EXPECT_EQ(rtp_mul_mat_set_prec(g, RTP_TYPE_BF16), RTP_EINVAL);
  EXPECT_NE(std::string(rtp_last_error()).find("'act' is a gelu, not a mul_mat"),
            std::string::npos)
      << rtp_last_error();
  EXPECT_EQ(rtp_mul_mat_set_prec(b, RTP_TYPE_BF16), RTP_EINVAL);  // a leaf
  EXPECT_NE(std::string(rtp_last_error()).find("'x' is a leaf"), std::string::npos)
      << rtp_last_error();
  EXPECT_EQ(rtp_mul_mat_set_prec(nullptr, RTP_TYPE_BF16), RTP_EINVAL);
  for (rtp_type bad : {RTP_TYPE_I32, RTP_TYPE_COUNT}) {  // (C++ has no values past these)
    EXPECT_EQ(rtp_mul_mat_set_prec(mm, bad), RTP_EINVAL);
    EXPECT_NE(std::string(rtp_last_error()).find("f32 or bf16 only"), std::string::npos)
        << rtp_last_error();
  }
  EXPECT_EQ(rtp_mul_mat_get_prec(mm), RTP_TYPE_F32);  // the failures changed nothing
  EXPECT_EQ(rtp_mul_mat_get_prec(g), RTP_TYPE_F32);
  EXPECT_EQ(rtp_mul_mat_get_prec(nullptr), RTP_TYPE_F32);
  rtp_tensor_set_output(g);
  rtp_graph *gr = rtp_graph_new(ctx, 16);
  ASSERT_EQ(rtp_graph_build(gr, g), 0);
  ASSERT_EQ(rtp_graph_plan(ctx, gr), 0);
  ASSERT_EQ(rtp_mul_mat_set_prec(mm, RTP_TYPE_BF16), RTP_OK);
  EXPECT_EQ(rtp_graph_compute(gr, nullptr), RTP_ESTATE);
  EXPECT_NE(std::string(rtp_last_error()).find("mul_mat 'mm' needs"), std::string::npos)
      << rtp_last_error();
  ASSERT_EQ(rtp_mul_mat_set_prec(mm, RTP_TYPE_F32), RTP_OK);
  EXPECT_EQ(rtp_graph_compute(gr, nullptr), RTP_OK) << rtp_last_error();
  rtp_context_free(ctx);
}

// compute_type is f32 or bf16, and never lowers a product the model made bf16.
TEST(Errors, ParallelComputeType) {
  gpt_config cfg = {256, 16, 32, 2, 4};
  for (int c = 0; c < 3; c++) {
    gpt m{};
    rtp_graph *fwd;
    rtp_context *meta = rtptest::gpt_forward(cfg, 1, &m, &fwd);
    ASSERT_NE(meta, nullptr) << rtp_last_error();
    rtp_type compute = c == 0 ? RTP_TYPE_I32 : c == 1 ? RTP_TYPE_COUNT : RTP_TYPE_F32;
    if (c == 2) {
      ASSERT_EQ(rtp_mul_mat_set_prec(m.logits, RTP_TYPE_BF16), 0);
    }
    rtp_context *ctx = new_ctx(gpt_arena_size(cfg, 1));
    rtp_parallel_params pp{};
    pp.strategy = RTP_STRATEGY_NONE;
    pp.compute_type = compute;
    EXPECT_EQ(rtp_parallel_new(ctx, fwd, m.loss, &pp), nullptr);
    EXPECT_EQ(rtp_context_error(ctx, nullptr), RTP_EINVAL);
    std::string want = c == 0   ? "compute_type i32 (1): f32 or bf16 only"
                       : c == 1 ? "compute_type ? (3)"
                                : "mul_mat 'logits' has precision bf16 but compute_type is f32";
    EXPECT_NE(ctx_msg(ctx).find(want), std::string::npos) << ctx_msg(ctx);
    rtp_context_free(ctx);
    rtp_context_free(meta);
  }
}

TEST(Errors, StatusNames) {
  EXPECT_STREQ(rtp_strerror(RTP_OK), "success");
  EXPECT_STREQ(rtp_strerror(RTP_ENOMEM), "out of memory (arena or system)");
  EXPECT_STREQ(rtp_strerror(12345), "unknown status");
  EXPECT_STREQ(rtp_op_name(RTP_OP_MUL_MAT), "mul_mat");
  EXPECT_STREQ(rtp_op_name((rtp_op)999), "?");
}

}  // namespace
