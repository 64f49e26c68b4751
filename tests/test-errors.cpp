// Mistakes a caller can make get a status and a message naming the op and the shapes;
// nothing aborts, nothing writes out of bounds (this suite also runs under ASan/UBSan).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

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
  gpt_config cfg = {256, 16, 32, 2, 4, false, false};
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
  gpt_config cfg = {256, 16, 32, 2, 4, false, false};
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
  gpt_config cfg = {256, 16, 32, 2, 4, false, false};
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

// A two-layer model with its optimizer, for the refusals of bad numbers below.
struct SmallModel {
  rtp_context *ctx = new_ctx(4 << 20);
  rtp_tensor *x = rtp_tensor_set_name(rtp_tensor_new_2d(ctx, RTP_TYPE_F32, 4, 8), "x");
  rtp_tensor *y = rtp_tensor_new_1d(ctx, RTP_TYPE_I32, 8);
  rtp_tensor *w1 = rtp_tensor_set_name(rtp_tensor_new_2d(ctx, RTP_TYPE_F32, 4, 6), "w1");
  rtp_tensor *w2 = rtp_tensor_set_name(rtp_tensor_new_2d(ctx, RTP_TYPE_F32, 6, 3), "w2");
  rtp_tensor *loss = nullptr;
  rtp_graph *g = nullptr;
  rtp_optimizer *opt = nullptr;
  SmallModel() {
    for (rtp_tensor *t : {x, w1, w2})
      for (int64_t i = 0; i < rtp_tensor_nelements(t); i++)
        ((float *)t->data)[i] = 0.1f * (float)((i * 7) % 11) - 0.5f;
    for (int i = 0; i < 8; i++) ((int32_t *)y->data)[i] = i % 3;
    rtp_tensor_set_param(w1);
    rtp_tensor_set_param(w2);
    loss =
        rtp_cross_entropy(ctx, rtp_mul_mat(ctx, w2, rtp_gelu(ctx, rtp_mul_mat(ctx, w1, x))), y);
    g = rtp_graph_new(ctx, 256);
    if (rtp_graph_build(g, loss) || rtp_graph_build_backward(ctx, g, loss) ||
        rtp_graph_plan(ctx, g))
      return;
    opt = rtp_optimizer_new(ctx, g, rtp_adamw_params_default());
  }
  ~SmallModel() {
    rtp_context_free(ctx);
  }
  std::vector<float> weights() const {
    std::vector<float> v;
    for (const rtp_tensor *t : {w1, w2})
      v.insert(v.end(), (float *)t->data, (float *)t->data + rtp_tensor_nelements(t));
    return v;
  }
};

// A step on NaN or infinity would spread it to every weight: it is refused, naming the
// step and the tensor (its weights before its gradients), and nothing changes.
TEST(Errors, OptimizerRefusesNonFiniteNumbers) {
  SmallModel m;
  ASSERT_NE(m.opt, nullptr) << rtp_last_error();
  ASSERT_EQ(rtp_graph_compute(m.g, nullptr), RTP_OK);
  ASSERT_EQ(rtp_optimizer_step(m.opt, nullptr), RTP_OK);
  ((float *)m.w2->data)[5] = NAN;
  std::vector<float> before = m.weights();
  ASSERT_EQ(rtp_graph_compute(m.g, nullptr), RTP_OK);
  EXPECT_EQ(rtp_optimizer_step(m.opt, nullptr), RTP_EINVAL);
  EXPECT_NE(std::string(rtp_last_error())
                .find("step 2: the weights of 'w2' are not finite (NaN or infinity); no weight "
                      "was changed"),
            std::string::npos)
      << rtp_last_error();
  std::vector<float> after = m.weights();
  EXPECT_EQ(std::memcmp(after.data(), before.data(), after.size() * sizeof(float)), 0);
  EXPECT_EQ(rtp_optimizer_steps(m.opt), 1);
  // Finite weights, an infinite input: the gradients are not.
  ((float *)m.w2->data)[5] = 0.25f;
  ((float *)m.x->data)[3] = INFINITY;
  ASSERT_EQ(rtp_graph_compute(m.g, nullptr), RTP_OK);
  EXPECT_EQ(rtp_optimizer_step(m.opt, nullptr), RTP_EINVAL);
  EXPECT_NE(std::string(rtp_last_error()).find("step 2: the gradients of 'w"),
            std::string::npos)
      << rtp_last_error();
  ((float *)m.x->data)[3] = 0.5f;
  // A rate that overflows once divided by the bias correction (1 - 0.9 at step 2).
  ASSERT_EQ(rtp_optimizer_set_lr(m.opt, 1e38f), RTP_OK);
  ASSERT_EQ(rtp_graph_compute(m.g, nullptr), RTP_OK);
  EXPECT_EQ(rtp_optimizer_step(m.opt, nullptr), RTP_EINVAL);
  EXPECT_NE(
      std::string(rtp_last_error()).find("the learning rate 1e+38 over the bias correction"),
      std::string::npos)
      << rtp_last_error();
  EXPECT_EQ(rtp_optimizer_steps(m.opt), 1);
  for (float lr : {-1.0f, NAN, INFINITY}) {
    EXPECT_EQ(rtp_optimizer_set_lr(m.opt, lr), RTP_EINVAL) << lr;
    EXPECT_NE(std::string(rtp_last_error()).find("rtp_optimizer_set_lr"), std::string::npos);
  }
  EXPECT_EQ(rtp_optimizer_set_steps(m.opt, -1), RTP_EINVAL);
  EXPECT_EQ(rtp_optimizer_steps(m.opt), 1);
  rtp_adamw_params hp = rtp_adamw_params_default();
  hp.lr = INFINITY;
  EXPECT_EQ(rtp_optimizer_new(m.ctx, m.g, hp), nullptr);
}

// A step count restored at the end of int64 (a checkpoint's adam_steps) cannot go on.
TEST(Errors, OptimizerStepCountHasAnEnd) {
  SmallModel m;
  ASSERT_NE(m.opt, nullptr) << rtp_last_error();
  ASSERT_EQ(rtp_optimizer_set_steps(m.opt, INT64_MAX), RTP_OK);
  ASSERT_EQ(rtp_graph_compute(m.g, nullptr), RTP_OK);
  std::vector<float> before = m.weights();
  EXPECT_EQ(rtp_optimizer_step(m.opt, nullptr), RTP_EINVAL);
  EXPECT_NE(std::string(rtp_last_error()).find("9223372036854775807 steps taken"),
            std::string::npos)
      << rtp_last_error();
  EXPECT_EQ(rtp_optimizer_steps(m.opt), INT64_MAX);
  EXPECT_TRUE(m.weights() == before);
}

// NaN through the kernels built on exp (softmax, GELU, cross-entropy) comes out NaN, so a
// diverged model is seen; no exponent bits are made from it.
TEST(Errors, NanThroughExpKernelsStaysNan) {
  rtp_context *ctx = new_ctx();
  rtp_tensor *x = rtp_tensor_new_2d(ctx, RTP_TYPE_F32, 4, 2);
  rtp_tensor *y = rtp_tensor_new_1d(ctx, RTP_TYPE_I32, 2);
  float v[8] = {NAN, 1, 2, 3, 0.5f, INFINITY, -INFINITY, 1};
  std::memcpy(x->data, v, sizeof(v));
  ((int32_t *)y->data)[0] = 1;
  ((int32_t *)y->data)[1] = 0;
  rtp_tensor *sm = rtp_soft_max(ctx, x, 1.0f, false), *ge = rtp_gelu(ctx, x);
  rtp_tensor *ce = rtp_cross_entropy(ctx, x, y);
  rtp_graph *g = rtp_graph_new(ctx, 64);
  for (rtp_tensor *t : {sm, ge, ce}) ASSERT_EQ(rtp_graph_build(g, t), RTP_OK);
  ASSERT_EQ(rtp_graph_plan(ctx, g), RTP_OK) << rtp_last_error();
  ASSERT_EQ(rtp_graph_compute(g, nullptr), RTP_OK);
  EXPECT_TRUE(std::isnan(((float *)sm->data)[0]));
  EXPECT_TRUE(std::isnan(((float *)ge->data)[0]));
  EXPECT_TRUE(std::isnan(((float *)ce->data)[0]));
  rtp_context_free(ctx);
}

// Sizes past what 64 bits count are refused or reported as such, never wrapped around.
TEST(Errors, HugeSizesAreRefused) {
  rtp_init_params ip = {SIZE_MAX, nullptr, false, nullptr, 0};
  EXPECT_EQ(rtp_context_new(ip), nullptr);
  EXPECT_NE(std::string(rtp_last_error()).find("cannot allocate an arena"), std::string::npos);
  // d_model^2 overflows the parameter count
  gpt_config huge = {256, 32, 1 << 30, 2, 1, false, false};
  EXPECT_EQ(gpt_config_check(huge), RTP_EINVAL);
  rtp_context *ctx = new_ctx();
  gpt m{};
  EXPECT_EQ(gpt_build(ctx, &m, huge, 1), RTP_EINVAL);
  rtp_context_free(ctx);
  gpt_config wide = {256,          GPT_MAX_SIZE, GPT_MAX_SIZE, GPT_MAX_LAYERS,
                     GPT_MAX_SIZE, false,        false};
  ASSERT_EQ(gpt_config_check(wide), RTP_OK);
  EXPECT_GT(gpt_n_params(wide), 0);
  EXPECT_EQ(gpt_arena_size(wide, 1 << 30), SIZE_MAX);
  gpt_config tiny = {256, 32, 64, 2, 4, false, false};
  EXPECT_EQ(gpt_arena_size(tiny, 4),
            (size_t)20 * gpt_n_params(tiny) + 4 * (size_t)128 * (40 * 64 + 6 * 4 * 32) * 2 +
                4 * (size_t)128 * 256 * 4 + 4 * (size_t)(2 * 256 + 32) * 64 + (64u << 20));
}

TEST(Errors, StatusNames) {
  EXPECT_STREQ(rtp_strerror(RTP_OK), "success");
  EXPECT_STREQ(rtp_strerror(RTP_ENOMEM), "out of memory (arena or system)");
  EXPECT_STREQ(rtp_strerror(12345), "unknown status");
  EXPECT_STREQ(rtp_op_name(RTP_OP_MUL_MAT), "mul_mat");
  EXPECT_STREQ(rtp_op_name((rtp_op)999), "?");
}

}  // namespace
