// Finite-difference gradient checks for every differentiable op, on random inputs of
// several shapes (odd sizes included), plus forward checks against direct formulas and
// exact checks of the f32 <-> bf16 casts (rounding, specials, the gradient rule).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "rtp.h"
extern "C" {
#include "rtp-impl.h"
}
#include "test-util.h"

namespace {

using Build = std::function<rtp_tensor *(rtp_context *, std::vector<rtp_tensor *> &)>;

struct Input {
  std::vector<int64_t> ne;
  bool param = true;      // differentiated
  bool positive = false;  // values in (0.5, 1.5) instead of (-1, 1)
  int index_range = 0;    // > 0: an i32 input of indices in [0, index_range)
};

// Builds f(inputs), then loss = sum(f * R) with a fixed random R, and compares every
// element's analytic gradient with a central difference of the loss.
void check_grad(const std::string &what, const std::vector<Input> &inputs, const Build &build,
                int n_threads = 1, float h = 1e-2f, float tol = 1e-3f) {
  SCOPED_TRACE(what);
  rtp_init_params ip = {64 << 20, nullptr, false, nullptr, 0};
  rtp_context *ctx = rtp_context_new(ip);
  ASSERT_NE(ctx, nullptr);
  std::mt19937 rng(42);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<rtp_tensor *> xs;
  for (const Input &in : inputs) {
    rtp_tensor *x = rtp_tensor_new(ctx, in.index_range ? RTP_TYPE_I32 : RTP_TYPE_F32,
                                   (int)in.ne.size(), in.ne.data());
    ASSERT_NE(x, nullptr);
    for (int64_t i = 0; i < rtp_tensor_nelements(x); i++) {
      if (in.index_range)
        ((int32_t *)x->data)[i] = (int32_t)(rng() % (uint32_t)in.index_range);
      else
        ((float *)x->data)[i] = in.positive ? 1.0f + 0.5f * u(rng) : u(rng);
    }
    if (in.param && !in.index_range) rtp_tensor_set_param(x);
    xs.push_back(x);
  }
  rtp_tensor *f = build(ctx, xs);
  const char *msg = nullptr;
  ASSERT_NE(f, nullptr) << (rtp_context_error(ctx, &msg), msg);
  f = rtp_cont(ctx, f);
  rtp_tensor *r = rtp_tensor_new(ctx, RTP_TYPE_F32, 4, f->ne);
  for (int64_t i = 0; i < rtp_tensor_nelements(r); i++) ((float *)r->data)[i] = u(rng);
  rtp_tensor *loss = rtp_sum(ctx, rtp_mul(ctx, f, r));
  ASSERT_NE(loss, nullptr) << (rtp_context_error(ctx, &msg), msg);
  rtp_graph *g = rtp_graph_new(ctx, 1024);
  ASSERT_EQ(rtp_graph_build(g, loss), 0) << rtp_last_error();
  ASSERT_EQ(rtp_graph_build_backward(ctx, g, loss), 0) << rtp_last_error();
  ASSERT_EQ(rtp_graph_plan(ctx, g), 0) << rtp_last_error();
  rtp_threadpool *tp = rtp_threadpool_new(n_threads);
  ASSERT_EQ(rtp_graph_compute(g, tp), 0) << rtp_last_error();

  // Every gradient is read before any input moves: each depends on the others' values.
  std::vector<std::vector<float>> grads(xs.size());
  for (size_t k = 0; k < xs.size(); k++) {
    if (!(xs[k]->flags & RTP_FLAG_PARAM)) continue;
    ASSERT_NE(xs[k]->grad, nullptr) << "input " << k << " got no gradient";
    grads[k].assign((float *)xs[k]->grad->data,
                    (float *)xs[k]->grad->data + rtp_tensor_nelements(xs[k]));
  }
  int checked = 0;
  for (size_t k = 0; k < xs.size(); k++) {
    rtp_tensor *x = xs[k];
    if (!(x->flags & RTP_FLAG_PARAM)) continue;
    const std::vector<float> &ana = grads[k];
    for (int64_t i = 0; i < rtp_tensor_nelements(x); i++) {
      float *v = (float *)x->data + i, saved = *v;
      *v = saved + h;
      ASSERT_EQ(rtp_graph_compute(g, tp), 0);
      double lp = *(float *)loss->data;
      *v = saved - h;
      ASSERT_EQ(rtp_graph_compute(g, tp), 0);
      double lm = *(float *)loss->data;
      *v = saved;
      double num = (lp - lm) / (2.0 * h);
      double err = std::fabs(num - ana[i]);
      ASSERT_LE(err, tol * (1.0 + std::fabs(num)))
          << "input " << k << " element " << i << ": numeric " << num << " analytic " << ana[i];
      checked++;
    }
  }
  EXPECT_GT(checked, 0);
  rtp_threadpool_free(tp);
  rtp_context_free(ctx);
}

using Shape = std::vector<int64_t>;

class OpGrad : public ::testing::TestWithParam<Shape> {};

TEST_P(OpGrad, Elementwise) {
  Shape s = GetParam();
  Shape row = {s[0]};
  check_grad("add", {{s}, {s}}, [](rtp_context *c, auto &x) { return rtp_add(c, x[0], x[1]); });
  check_grad("add row", {{s}, {row}},
             [](rtp_context *c, auto &x) { return rtp_add(c, x[0], x[1]); });
  check_grad("sub", {{s}, {row}},
             [](rtp_context *c, auto &x) { return rtp_sub(c, x[0], x[1]); });
  check_grad("mul", {{s}, {s}}, [](rtp_context *c, auto &x) { return rtp_mul(c, x[0], x[1]); });
  check_grad("mul row", {{s}, {row}},
             [](rtp_context *c, auto &x) { return rtp_mul(c, x[0], x[1]); });
  check_grad("scale", {{s}}, [](rtp_context *c, auto &x) { return rtp_scale(c, x[0], -1.7f); });
  check_grad("dup", {{s}}, [](rtp_context *c, auto &x) { return rtp_dup(c, x[0]); });
}

TEST_P(OpGrad, Reductions) {
  Shape s = GetParam();
  check_grad("sum", {{s}}, [](rtp_context *c, auto &x) { return rtp_sum(c, x[0]); });
  check_grad("mean", {{s}}, [](rtp_context *c, auto &x) { return rtp_mean(c, x[0]); });
  Shape one = s;
  one[0] = 1;
  check_grad("repeat_back", {{s}}, [one](rtp_context *c, auto &x) {
    rtp_tensor *like = rtp_tensor_new(c, RTP_TYPE_F32, (int)one.size(), one.data());
    return rtp_repeat_back(c, x[0], like);
  });
  check_grad("repeat_back rows", {{s}}, [s](rtp_context *c, auto &x) {
    rtp_tensor *like = rtp_tensor_new_1d(c, RTP_TYPE_F32, s[0]);
    return rtp_repeat_back(c, x[0], like);
  });
  check_grad("repeat", {{{s[0]}}}, [s](rtp_context *c, auto &x) {
    rtp_tensor *like = rtp_tensor_new(c, RTP_TYPE_F32, (int)s.size(), s.data());
    return rtp_repeat(c, x[0], like);
  });
}

TEST_P(OpGrad, Activations) {
  Shape s = GetParam();
  check_grad("gelu", {{s}}, [](rtp_context *c, auto &x) { return rtp_gelu(c, x[0]); });
  check_grad("norm", {{s}}, [](rtp_context *c, auto &x) { return rtp_norm(c, x[0], 1e-5f); });
  check_grad("layer_norm", {{s}, {{s[0]}}, {{s[0]}}}, [](rtp_context *c, auto &x) {
    return rtp_layer_norm(c, x[0], x[1], x[2], 1e-5f);
  });
  check_grad("soft_max", {{s}},
             [](rtp_context *c, auto &x) { return rtp_soft_max(c, x[0], 0.7f, false); });
  if (s[0] >= (s.size() > 1 ? s[1] : 1))
    check_grad("soft_max causal", {{s}},
               [](rtp_context *c, auto &x) { return rtp_soft_max(c, x[0], 1.3f, true); });
}

TEST_P(OpGrad, Views) {
  Shape s = GetParam();
  while (s.size() < 3) s.push_back(1);
  check_grad("transpose", {{s}},
             [](rtp_context *c, auto &x) { return rtp_transpose(c, x[0]); });
  check_grad("permute", {{s}},
             [](rtp_context *c, auto &x) { return rtp_permute(c, x[0], 2, 0, 1, 3); });
  check_grad("reshape", {{s}}, [](rtp_context *c, auto &x) {
    return rtp_reshape_2d(c, x[0], x[0]->ne[0] * x[0]->ne[1], x[0]->ne[2] * x[0]->ne[3]);
  });
  if (s[1] > 1)
    check_grad("view_rows", {{s}}, [](rtp_context *c, auto &x) {
      int d = rtp_tensor_n_dims(x[0]) - 1;
      return rtp_view_rows(c, x[0], 1, x[0]->ne[d] - 1);
    });
  if (s[0] > 2)
    check_grad("strided view", {{s}}, [](rtp_context *c, auto &x) {
      int64_t ne[4] = {x[0]->ne[0] - 2, x[0]->ne[1], x[0]->ne[2], x[0]->ne[3]};
      return rtp_view(c, x[0], 4, ne, x[0]->nb, sizeof(float));
    });
  for (int dim = 0; dim < 3; dim++)
    check_grad("concat dim " + std::to_string(dim), {{s}, {s}},
               [dim](rtp_context *c, auto &x) { return rtp_concat(c, x[0], x[1], dim); });
  if (s[0] > 2)
    check_grad("acc", {{s}, {{s[0] - 2, s[1]}}}, [](rtp_context *c, auto &x) {
      return rtp_acc(c, x[0], x[1], x[0]->nb[1], x[0]->nb[2], x[0]->nb[3], 2 * sizeof(float));
    });
}

INSTANTIATE_TEST_SUITE_P(Shapes, OpGrad,
                         ::testing::Values(Shape{7}, Shape{5, 3}, Shape{4, 4}, Shape{3, 2, 3},
                                           Shape{6, 3, 2, 2}));

TEST(OpGradMatMul, Shapes) {
  for (int threads : {1, 3}) {
    auto mm = [](rtp_context *c, auto &x) { return rtp_mul_mat(c, x[0], x[1]); };
    check_grad("mul_mat 2d", {{{5, 3}}, {{5, 4}}}, mm, threads);
    check_grad("mul_mat odd", {{{7, 1}}, {{7, 9}}}, mm, threads);
    check_grad("mul_mat batched", {{{4, 3, 2, 3}}, {{4, 5, 2, 3}}}, mm, threads);
    check_grad("mul_mat shared a", {{{4, 3}}, {{4, 5, 2}}}, mm, threads);
    check_grad(
        "mul_mat a^T", {{{3, 5}}, {{5, 4}}},
        [](rtp_context *c, auto &x) { return rtp_mul_mat(c, rtp_transpose(c, x[0]), x[1]); },
        threads);
    check_grad(
        "mul_mat b^T", {{{5, 3}}, {{4, 5, 2}}},
        [](rtp_context *c, auto &x) { return rtp_mul_mat(c, x[0], rtp_transpose(c, x[1])); },
        threads);
    check_grad(
        "mul_mat both^T batched", {{{3, 5, 2}}, {{4, 5, 2}}},
        [](rtp_context *c, auto &x) {
          return rtp_mul_mat(c, rtp_transpose(c, x[0]), rtp_transpose(c, x[1]));
        },
        threads);
  }
}

// A product added to an addend (rtp's backward sums dx over blocks with it): a computed
// addend that dies at the product is summed into in place, one read later is copied.
TEST(OpGradMatMul, Addend) {
  auto in_place = [](rtp_context *c, auto &x) {
    return rtp__mul_mat_add(c, x[0], x[1], rtp_scale(c, x[2], 2.0f));
  };
  auto copied = [](rtp_context *c, auto &x) {
    rtp_tensor *s = rtp_scale(c, x[2], 2.0f);
    return rtp_add(c, rtp__mul_mat_add(c, x[0], x[1], s), s);
  };
  for (int threads : {1, 3}) {
    check_grad("addend in place", {{{5, 3}}, {{5, 4}}, {{3, 4}}}, in_place, threads);
    check_grad("addend copied", {{{5, 3}}, {{5, 4}}, {{3, 4}}}, copied, threads);
    check_grad("addend batched", {{{4, 3, 2, 3}}, {{4, 5, 2, 3}}, {{3, 5, 2, 3}}}, in_place,
               threads);
    check_grad("addend shared a", {{{4, 3}}, {{4, 5, 2}}, {{3, 5, 2}}}, copied, threads);
    check_grad("addend, k = 0", {{{0, 3}, false}, {{0, 4}, false}, {{3, 4}}}, in_place,
               threads);
    check_grad(
        "addend a^T", {{{3, 5}}, {{5, 4}}, {{3, 4}}},
        [&](rtp_context *c, auto &x) {
          std::vector<rtp_tensor *> y = {rtp_transpose(c, x[0]), x[1], x[2]};
          return in_place(c, y);
        },
        threads);
  }
}

TEST(OpForward, MulMatAddendPlacement) {
  rtp_init_params ip = {1 << 20, nullptr, false, nullptr, 0};
  rtp_context *ctx = rtp_context_new(ip);
  rtp_tensor *a = rtp_tensor_new_2d(ctx, RTP_TYPE_F32, 2, 2);
  rtp_tensor *b = rtp_tensor_new_2d(ctx, RTP_TYPE_F32, 2, 1);
  rtp_tensor *c = rtp_tensor_new_2d(ctx, RTP_TYPE_F32, 2, 1);
  for (int i = 0; i < 4; i++) ((float *)a->data)[i] = (float)(i + 1);  // rows {1,2}, {3,4}
  ((float *)b->data)[0] = 1.0f, ((float *)b->data)[1] = 10.0f;
  ((float *)c->data)[0] = 100.0f, ((float *)c->data)[1] = 200.0f;
  rtp_tensor *dying = rtp_scale(ctx, c, 1.0f), *kept = rtp_scale(ctx, c, 1.0f);
  rtp_tensor *p = rtp__mul_mat_add(ctx, a, b, dying), *q = rtp__mul_mat_add(ctx, a, b, kept);
  rtp_tensor *f = rtp_add(ctx, rtp_add(ctx, p, q), kept);
  ASSERT_NE(f, nullptr);
  rtp_tensor_set_output(p);  // read after compute: its memory is not reused
  rtp_graph *g = rtp_graph_new(ctx, 64);
  ASSERT_EQ(rtp_graph_build(g, f), 0);
  ASSERT_EQ(rtp_graph_plan(ctx, g), 0);
  EXPECT_EQ(p->data, dying->data) << "an addend that dies at the product is summed in place";
  EXPECT_NE(q->data, kept->data) << "an addend read later keeps its memory";
  ASSERT_EQ(rtp_graph_compute(g, nullptr), 0);
  EXPECT_FLOAT_EQ(rtptest::f32_at(p, 0), 121.0f);  // 1 + 20 + 100
  EXPECT_FLOAT_EQ(rtptest::f32_at(p, 1), 243.0f);  // 3 + 40 + 200
  EXPECT_FLOAT_EQ(rtptest::f32_at(f, 1), 243.0f * 2 + 200.0f);
  rtp_tensor *bad = rtp__mul_mat_add(ctx, a, b, a);
  EXPECT_EQ(bad, nullptr);
  const char *msg = nullptr;
  EXPECT_EQ(rtp_context_error(ctx, &msg), RTP_ESHAPE);
  EXPECT_NE(std::string(msg).find("addend"), std::string::npos) << msg;
  rtp_context_free(ctx);
}

TEST(OpGradIndex, GetRowsAndCrossEntropy) {
  for (int threads : {1, 2}) {
    check_grad(
        "get_rows", {{{5, 7}}, {{4, 3}, false, false, 7}},
        [](rtp_context *c, auto &x) { return rtp_get_rows(c, x[0], x[1]); }, threads);
    check_grad(
        "cross_entropy", {{{9, 4, 3}}, {{4, 3}, false, false, 9}},
        [](rtp_context *c, auto &x) { return rtp_cross_entropy(c, x[0], x[1]); }, threads);
  }
}

// The composition the GPT uses: heads as permuted views of one projection.
TEST(OpGradComposite, AttentionHeads) {
  const int64_t hd = 2, H = 2, T = 3, B = 2, d = hd * H;
  check_grad(
      "attention", {{{3 * d, T * B}}},
      [](rtp_context *c, auto &x) {
        size_t f = sizeof(float), nb[4] = {f, hd * f, 3 * d * f, 3 * d * T * f};
        int64_t ne[4] = {hd, H, T, B};
        rtp_tensor *h[3];
        for (int i = 0; i < 3; i++)
          h[i] = rtp_permute(c, rtp_view(c, x[0], 4, ne, nb, (size_t)i * d * f), 0, 2, 1, 3);
        rtp_tensor *att = rtp_soft_max(c, rtp_mul_mat(c, h[1], h[0]), 0.7f, true);
        rtp_tensor *out = rtp_mul_mat(c, rtp_transpose(c, h[2]), att);
        return rtp_cont(c, rtp_permute(c, out, 0, 2, 1, 3));
      },
      2);
}

// ---- fused causal attention ------------------------------------------------------------

// The unfused chain the GPT builds (and the composite test above checks): per-head views
// of qkv {3d, T, B} (offs bytes into the rows of src, each view taken of src directly, as
// backward needs), scores, causal softmax, the product with v, heads side by side.
rtp_tensor *attention_unfused(rtp_context *c, rtp_tensor *src, size_t offs, int64_t d,
                              int64_t H, float scale) {
  const int64_t hd = d / H, T = src->ne[1], B = src->ne[2];
  size_t f = sizeof(float), nb[4] = {f, hd * f, src->nb[1], src->nb[2]};
  int64_t ne[4] = {hd, H, T, B};
  rtp_tensor *h[3];
  for (int i = 0; i < 3; i++)
    h[i] = rtp_permute(c, rtp_view(c, src, 4, ne, nb, offs + (size_t)i * d * f), 0, 2, 1, 3);
  rtp_tensor *att = rtp_soft_max(c, rtp_mul_mat(c, h[1], h[0]), scale, true);
  rtp_tensor *out = rtp_mul_mat(c, rtp_transpose(c, h[2]), att);
  return rtp_reshape_3d(c, rtp_cont(c, rtp_permute(c, out, 0, 2, 1, 3)), d, T, B);
}

struct AttnShape {
  int64_t hd, H, T, B;
  int64_t pad;  // > 0: qkv is a view of rows this many floats wider (strided rows)
};

// The output and qkv's gradient of attention (fused or not) of the same random qkv, with
// the loss sum(out * R), on `threads` threads.
void attention_run(const AttnShape &s, bool fused, int threads, std::vector<float> &y,
                   std::vector<float> &g) {
  rtp_init_params ip = {64 << 20, nullptr, false, nullptr, 0};
  rtp_context *ctx = rtp_context_new(ip);
  ASSERT_NE(ctx, nullptr);
  const int64_t d = s.hd * s.H;
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  rtp_tensor *base = rtp_tensor_new_3d(ctx, RTP_TYPE_F32, 3 * d + s.pad, s.T, s.B);
  for (int64_t i = 0; i < rtp_tensor_nelements(base); i++) ((float *)base->data)[i] = u(rng);
  rtp_tensor_set_param(base);
  int64_t ne[4] = {3 * d, s.T, s.B, 1};
  size_t offs = (size_t)(s.pad / 2) * sizeof(float);
  float scale = 1.0f / std::sqrt((float)s.hd);
  rtp_tensor *out = fused
                        ? rtp_attention_causal(ctx, rtp_view(ctx, base, 3, ne, base->nb, offs),
                                               (int)s.H, scale)
                        : attention_unfused(ctx, base, offs, d, s.H, scale);
  rtp_tensor *r = rtp_tensor_new_3d(ctx, RTP_TYPE_F32, d, s.T, s.B);
  for (int64_t i = 0; i < rtp_tensor_nelements(r); i++) ((float *)r->data)[i] = u(rng);
  const char *msg = nullptr;
  ASSERT_NE(out, nullptr) << (rtp_context_error(ctx, &msg), msg);
  rtp_tensor_set_output(out);
  rtp_tensor *loss = rtp_sum(ctx, rtp_mul(ctx, out, r));
  rtp_graph *gr = rtp_graph_new(ctx, 256);
  ASSERT_EQ(rtp_graph_build(gr, loss), 0) << rtp_last_error();
  ASSERT_EQ(rtp_graph_build_backward(ctx, gr, loss), 0) << rtp_last_error();
  ASSERT_EQ(rtp_graph_plan(ctx, gr), 0) << rtp_last_error();
  rtp_threadpool *tp = rtp_threadpool_new(threads);
  ASSERT_EQ(rtp_graph_compute(gr, tp), 0) << rtp_last_error();
  const float *o = (const float *)out->data, *dg = (const float *)base->grad->data;
  y.assign(o, o + rtp_tensor_nelements(out));
  g.assign(dg, dg + rtp_tensor_nelements(base));
  rtp_threadpool_free(tp);
  rtp_context_free(ctx);
}

// Forward and qkv's gradient of the fused op against the unfused chain: within 1e-5.
void expect_attention_equal(const AttnShape &s, int threads) {
  SCOPED_TRACE(::testing::Message() << "hd " << s.hd << " H " << s.H << " T " << s.T << " B "
                                    << s.B << " pad " << s.pad << " threads " << threads);
  std::vector<float> y[2], g[2];
  attention_run(s, true, threads, y[0], g[0]);
  attention_run(s, false, threads, y[1], g[1]);
  ASSERT_EQ(y[0].size(), y[1].size());
  ASSERT_EQ(g[0].size(), g[1].size());
  for (size_t i = 0; i < y[0].size(); i++)
    ASSERT_NEAR(y[0][i], y[1][i], 1e-5f * (1.0f + std::fabs(y[1][i]))) << "output " << i;
  for (size_t i = 0; i < g[0].size(); i++)
    ASSERT_NEAR(g[0][i], g[1][i], 1e-5f * (1.0f + std::fabs(g[1][i]))) << "d qkv " << i;
}

// T = 1, T below, at and past the block (32) and not a multiple of it, several heads and
// sequences, head sizes that fill the kernel's column chunks (16) or leave tails.
TEST(Attention, EqualsUnfusedOps) {
  const AttnShape shapes[] = {{2, 2, 3, 2, 0},   {8, 3, 1, 2, 0},   {16, 2, 33, 3, 0},
                              {64, 2, 70, 1, 0}, {5, 1, 100, 2, 0}, {24, 4, 64, 2, 0},
                              {16, 2, 40, 2, 7}};
  for (const AttnShape &s : shapes) expect_attention_equal(s, 1);
  expect_attention_equal({32, 3, 45, 3, 0}, 4);  // 9 heads on 4 threads
  expect_attention_equal({16, 1, 50, 1, 0}, 3);  // more threads than heads
}

// Finite differences of d qkv: within one key block, and across blocks with the diagonal
// block partly masked (T = 35 = 32 + 3).
TEST(OpGradAttention, Causal) {
  const int64_t shapes[][4] = {{3, 2, 5, 2}, {2, 1, 35, 1}, {2, 3, 1, 2}};
  for (const auto &s : shapes) {
    int64_t hd = s[0], H = s[1], T = s[2], B = s[3];
    check_grad(
        "attention_causal", {{{3 * hd * H, T, B}}},
        [H](rtp_context *c, auto &x) { return rtp_attention_causal(c, x[0], (int)H, 0.8f); },
        2);
  }
}

TEST(Attention, RefusesBadInput) {
  rtp_init_params ip = {1 << 20, nullptr, false, nullptr, 0};
  rtp_context *ctx = rtp_context_new(ip);
  rtp_tensor *qkv = rtp_tensor_new_3d(ctx, RTP_TYPE_F32, 12, 4, 2);
  const char *msg = nullptr;
  EXPECT_EQ(rtp_attention_causal(ctx, qkv, 3, 1.0f), nullptr);  // 12 = 3 x 4: not 3 x H x hd
  ASSERT_EQ(rtp_context_error(ctx, &msg), RTP_ESHAPE);
  EXPECT_NE(std::string(msg).find("attention"), std::string::npos) << msg;
  rtp_context_free(ctx);
  ctx = rtp_context_new(ip);
  qkv = rtp_tensor_new_3d(ctx, RTP_TYPE_F32, 12, 4, 2);
  EXPECT_EQ(rtp_attention_causal(ctx, rtp_transpose(ctx, qkv), 1, 1.0f), nullptr);
  EXPECT_EQ(rtp_context_error(ctx, nullptr), RTP_ESHAPE);
  rtp_context_free(ctx);
  ctx = rtp_context_new(ip);
  EXPECT_EQ(rtp_attention_causal(ctx, nullptr, 1, 1.0f), nullptr);  // an earlier failure
  EXPECT_EQ(rtp_context_error(ctx, nullptr), RTP_EINVAL);
  rtp_context_free(ctx);
}

// ---- casts between f32 and bf16 ------------------------------------------------------

// The definition of rounding to nearest even on the bits, written differently from the
// kernel (which adds 0x7fff plus the kept half's lowest bit): keep the top half, and add
// one if the dropped half is more than half of it, or exactly half with the kept half odd.
// For finite values and infinities; NaNs are checked apart.
uint16_t bf16_reference(uint32_t u) {
  uint32_t lower = u & 0xffffu, upper = u >> 16;
  if (lower > 0x8000u || (lower == 0x8000u && (upper & 1u))) upper++;
  return (uint16_t)upper;
}

bool bf16_is_nan(uint16_t h) {
  return (h & 0x7f80u) == 0x7f80u && (h & 0x7fu) != 0;
}

float f32_of_bits(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
}

uint32_t bits_of_f32(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof(u));
  return u;
}

// Converts n f32 values (given as bits) to bf16 and those back to f32 with rtp_cast, on
// `threads` threads.
void cast_roundtrip(const std::vector<uint32_t> &in, std::vector<uint16_t> &half,
                    std::vector<uint32_t> &back, int threads) {
  rtp_init_params ip = {16 << 20, nullptr, false, nullptr, 0};
  rtp_context *ctx = rtp_context_new(ip);
  ASSERT_NE(ctx, nullptr);
  int64_t n = (int64_t)in.size();
  rtp_tensor *x = rtp_tensor_new_2d(ctx, RTP_TYPE_F32, 7, (n + 6) / 7);  // several rows
  ASSERT_NE(x, nullptr);
  memset(x->data, 0, rtp_tensor_nbytes(x));
  memcpy(x->data, in.data(), in.size() * 4);
  rtp_tensor *h = rtp_cast(ctx, x, RTP_TYPE_BF16);
  rtp_tensor *f = rtp_cast(ctx, h, RTP_TYPE_F32);
  ASSERT_NE(f, nullptr);
  EXPECT_EQ(h->type, RTP_TYPE_BF16);
  EXPECT_EQ(rtp_tensor_nbytes(h), (size_t)rtp_tensor_nelements(x) * 2);
  rtp_tensor_set_output(h);
  rtp_tensor_set_output(f);
  rtp_graph *g = rtp_graph_new(ctx, 16);
  ASSERT_EQ(rtp_graph_build(g, f), 0);
  ASSERT_EQ(rtp_graph_plan(ctx, g), 0) << rtp_last_error();
  rtp_threadpool *tp = rtp_threadpool_new(threads);
  ASSERT_EQ(rtp_graph_compute(g, tp), 0) << rtp_last_error();
  half.assign((const uint16_t *)h->data, (const uint16_t *)h->data + n);
  back.assign((const uint32_t *)f->data, (const uint32_t *)f->data + n);
  rtp_threadpool_free(tp);
  rtp_context_free(ctx);
}

struct CastCase {
  uint32_t in;
  uint16_t want;
  const char *what;
};

TEST(Cast, RoundsToNearestEven) {
  const CastCase cases[] = {
      {0x3f800000u, 0x3f80u, "1 is exact"},
      {0x3f808000u, 0x3f80u, "1 + 2^-8: a tie, to the even 1"},
      {0x3f818000u, 0x3f82u, "a tie above an odd value rounds up to even"},
      {0x3f807fffu, 0x3f80u, "just below half: down"},
      {0x3f808001u, 0x3f81u, "just above half: up"},
      {0xbf808000u, 0xbf80u, "negative tie to even"},
      {0xbf818000u, 0xbf82u, "negative tie, away from zero to even"},
      {0x3fffffffu, 0x4000u, "the carry moves into the exponent"},
      {0x00000000u, 0x0000u, "+0"},
      {0x80000000u, 0x8000u, "-0 keeps its sign"},
      {0x7f800000u, 0x7f80u, "inf"},
      {0xff800000u, 0xff80u, "-inf"},
      {0x7f7f7fffu, 0x7f7fu, "below half of the last step: the largest finite bf16"},
      {0x7f7f8000u, 0x7f80u, "a tie above the largest (odd) finite bf16: inf"},
      {0x7f7fffffu, 0x7f80u, "FLT_MAX overflows to inf"},
      {0xff7fffffu, 0xff80u, "-FLT_MAX overflows to -inf"},
      {0x00000001u, 0x0000u, "the smallest f32 subnormal rounds to +0"},
      {0x80000001u, 0x8000u, "... and its negative to -0"},
      {0x00008000u, 0x0000u, "half the smallest bf16 subnormal: a tie, to even 0"},
      {0x00008001u, 0x0001u, "just above: the smallest bf16 subnormal"},
      {0x00010000u, 0x0001u, "a bf16 subnormal is exact"},
      {0x00018000u, 0x0002u, "a subnormal tie to even"},
      {0x807f8000u, 0x8080u, "the largest negative subnormal tie rounds into the normals"},
      {0x007fffffu, 0x0080u, "the largest f32 subnormal rounds up to the smallest normal"},
  };
  std::vector<uint32_t> in;
  for (const CastCase &c : cases) in.push_back(c.in);
  for (int threads : {1, 3}) {
    std::vector<uint16_t> half;
    std::vector<uint32_t> back;
    cast_roundtrip(in, half, back, threads);
    ASSERT_EQ(half.size(), in.size());
    for (size_t i = 0; i < in.size(); i++) {
      EXPECT_EQ(half[i], cases[i].want) << std::hex << cases[i].in << ": " << cases[i].what;
      EXPECT_EQ(back[i], (uint32_t)cases[i].want << 16) << "bf16 to f32 must be exact";
    }
  }
}

TEST(Cast, NanStaysNan) {
  // Payloads only in the low half would round (or carry) into inf without the NaN rule.
  std::vector<uint32_t> in = {0x7fc00000u, 0x7f800001u, 0x7f80ffffu, 0x7fffffffu,
                              0xff800001u, 0xffc00000u, 0x7fbfffffu};
  std::vector<uint16_t> half;
  std::vector<uint32_t> back;
  cast_roundtrip(in, half, back, 2);
  for (size_t i = 0; i < in.size(); i++) {
    EXPECT_TRUE(bf16_is_nan(half[i])) << std::hex << in[i] << " became " << half[i];
    EXPECT_EQ(half[i] >> 15, in[i] >> 31) << "sign of " << std::hex << in[i];
    EXPECT_TRUE(std::isnan(f32_of_bits(back[i])));
  }
}

// Every bf16 value converts to f32 exactly and back to itself (NaNs to a NaN); random f32
// bit patterns of every exponent round as the definition says.
TEST(Cast, ExhaustiveAndRandom) {
  std::vector<uint32_t> in;
  for (uint32_t h = 0; h < 65536; h++) in.push_back(h << 16);
  std::mt19937 rng(7);
  for (int i = 0; i < 200000; i++) in.push_back((uint32_t)rng());
  std::vector<uint16_t> half;
  std::vector<uint32_t> back;
  cast_roundtrip(in, half, back, 3);
  int nans = 0;
  for (size_t i = 0; i < in.size(); i++) {
    if (std::isnan(f32_of_bits(in[i]))) {
      nans++;
      ASSERT_TRUE(bf16_is_nan(half[i])) << std::hex << in[i];
      continue;
    }
    ASSERT_EQ(half[i], bf16_reference(in[i])) << std::hex << in[i];
    ASSERT_EQ(back[i], (uint32_t)half[i] << 16) << std::hex << in[i];
  }
  EXPECT_GT(nans, 0);
}

// Strided sources (a transposed view, either type) give contiguous results, and a bf16
// tensor can be copied (dup), reshaped and read back as f32.
TEST(Cast, StridedSourcesAndBf16Copies) {
  rtp_init_params ip = {1 << 20, nullptr, false, nullptr, 0};
  rtp_context *ctx = rtp_context_new(ip);
  rtp_tensor *x = rtp_tensor_new_2d(ctx, RTP_TYPE_F32, 5, 3);
  for (int i = 0; i < 15; i++) ((float *)x->data)[i] = 1.0f + (float)i / 256.0f + 1e-3f;
  rtp_tensor *h = rtp_cast(ctx, rtp_transpose(ctx, x), RTP_TYPE_BF16);  // {3, 5}
  rtp_tensor *hd = rtp_cont(ctx, rtp_transpose(ctx, h));                // bf16 dup {5, 3}
  rtp_tensor *f = rtp_cast(ctx, rtp_transpose(ctx, hd), RTP_TYPE_F32);  // {3, 5}
  rtp_tensor *cat = rtp_concat(ctx, hd, hd, 1);                         // bf16 {5, 6}
  ASSERT_NE(cat, nullptr);
  for (rtp_tensor *t : {h, hd, f, cat}) rtp_tensor_set_output(t);
  EXPECT_TRUE(rtp_tensor_is_contiguous(h));
  EXPECT_EQ(hd->type, RTP_TYPE_BF16);
  rtp_graph *g = rtp_graph_new(ctx, 32);
  ASSERT_EQ(rtp_graph_build(g, f), 0);
  ASSERT_EQ(rtp_graph_build(g, cat), 0);
  ASSERT_EQ(rtp_graph_plan(ctx, g), 0);
  ASSERT_EQ(rtp_graph_compute(g, nullptr), 0);
  for (int r = 0; r < 3; r++)
    for (int c = 0; c < 5; c++) {
      uint32_t want = (uint32_t)bf16_reference(bits_of_f32(((float *)x->data)[r * 5 + c]))
                      << 16;
      EXPECT_EQ(((uint16_t *)h->data)[c * 3 + r], want >> 16);   // h[c][r] = x[r][c]
      EXPECT_EQ(((uint16_t *)hd->data)[r * 5 + c], want >> 16);  // x's layout again
      EXPECT_EQ(bits_of_f32(((float *)f->data)[c * 3 + r]), want);
      EXPECT_EQ(rtptest::f32_at(hd, r * 5 + c), f32_of_bits(want));
      EXPECT_EQ(rtptest::f32_at(cat, (r + 3) * 5 + c), f32_of_bits(want));  // second copy
    }
  rtp_context_free(ctx);
}

TEST(Cast, RefusesOtherTypes) {
  rtp_init_params ip = {1 << 20, nullptr, false, nullptr, 0};
  rtp_context *ctx = rtp_context_new(ip);
  rtp_tensor *i = rtp_tensor_new_1d(ctx, RTP_TYPE_I32, 4);
  EXPECT_EQ(rtp_cast(ctx, i, RTP_TYPE_F32), nullptr);
  const char *msg = nullptr;
  EXPECT_EQ(rtp_context_error(ctx, &msg), RTP_ESHAPE);
  EXPECT_NE(std::string(msg).find("cast"), std::string::npos) << msg;
  rtp_context_free(ctx);
  ctx = rtp_context_new(ip);
  rtp_tensor *x = rtp_tensor_new_1d(ctx, RTP_TYPE_F32, 4);
  EXPECT_EQ(rtp_cast(ctx, x, RTP_TYPE_I32), nullptr);
  EXPECT_EQ(rtp_cast(ctx, x, RTP_TYPE_COUNT), nullptr);
  EXPECT_STREQ(rtp_type_name(RTP_TYPE_BF16), "bf16");
  EXPECT_EQ(rtp_type_size(RTP_TYPE_BF16), 2u);
  EXPECT_STREQ(rtp_op_name(RTP_OP_CAST), "cast");
  rtp_context_free(ctx);
}

// Finite differences: a cast to f32 is the identity; through bf16 and back the values
// move by up to 2^-8 of themselves (half a step of bf16's 8-bit significand in [1, 2)), so
// a difference over 2h = 0.5 is within 2 * 2^-8 / 0.5 = 1.6e-2 of the slope for |R| <= 1,
// and the analytic gradient is R rounded to bf16 (2^-9 of it): tolerance 2e-2. This
// catches a missing, zero or scaled gradient; the exact test below catches a missing cast.
TEST_P(OpGrad, Cast) {
  Shape s = GetParam();
  check_grad("cast f32", {{s}},
             [](rtp_context *c, auto &x) { return rtp_cast(c, x[0], RTP_TYPE_F32); });
  check_grad(
      "cast through bf16", {{s}},
      [](rtp_context *c, auto &x) {
        return rtp_cast(c, rtp_cast(c, x[0], RTP_TYPE_BF16), RTP_TYPE_F32);
      },
      2, 0.25f, 2e-2f);
}

// The backward rule exactly: d/dx sum(w * f32(bf16(x))) = f32(bf16(w)), the upstream
// gradient cast to bf16 (the type of the cast's input) and back to f32. Without the cast
// back the gradient would be w itself, which bf16 cannot hold: the values are chosen so.
TEST(Cast, GradientIsCastBack) {
  rtp_init_params ip = {1 << 20, nullptr, false, nullptr, 0};
  rtp_context *ctx = rtp_context_new(ip);
  const int n = 37;
  rtp_tensor *x = rtp_tensor_new_2d(ctx, RTP_TYPE_F32, n, 2);
  rtp_tensor *w = rtp_tensor_new_2d(ctx, RTP_TYPE_F32, n, 2);
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  int inexact = 0;
  for (int i = 0; i < 2 * n; i++) {
    ((float *)x->data)[i] = u(rng);
    float v = u(rng);
    ((float *)w->data)[i] = v;
    inexact += (bits_of_f32(v) & 0xffffu) != 0;
  }
  ASSERT_GT(inexact, n);
  rtp_tensor_set_param(x);
  rtp_tensor *y = rtp_cast(ctx, rtp_cast(ctx, x, RTP_TYPE_BF16), RTP_TYPE_F32);
  rtp_tensor *loss = rtp_sum(ctx, rtp_mul(ctx, y, w));
  rtp_graph *g = rtp_graph_new(ctx, 64);
  ASSERT_EQ(rtp_graph_build(g, loss), 0);
  ASSERT_EQ(rtp_graph_build_backward(ctx, g, loss), 0) << rtp_last_error();
  ASSERT_EQ(rtp_graph_plan(ctx, g), 0);
  rtp_threadpool *tp = rtp_threadpool_new(2);
  ASSERT_EQ(rtp_graph_compute(g, tp), 0);
  ASSERT_NE(x->grad, nullptr);
  EXPECT_EQ(x->grad->type, RTP_TYPE_F32);
  for (int i = 0; i < 2 * n; i++) {
    uint32_t want = (uint32_t)bf16_reference(bits_of_f32(((float *)w->data)[i])) << 16;
    ASSERT_EQ(bits_of_f32(((float *)x->grad->data)[i]), want) << "element " << i;
  }
  rtp_threadpool_free(tp);
  rtp_context_free(ctx);
}

// A bf16 tensor read by two nodes would need its gradients summed in bf16: refused.
TEST(Cast, Bf16GradientsAreNotSummed) {
  rtp_init_params ip = {1 << 20, nullptr, false, nullptr, 0};
  rtp_context *ctx = rtp_context_new(ip);
  rtp_tensor *x = rtp_tensor_new_1d(ctx, RTP_TYPE_F32, 4);
  rtp_tensor_set_param(x);
  rtp_tensor *h = rtp_cast(ctx, x, RTP_TYPE_BF16);
  rtp_tensor *loss = rtp_sum(
      ctx, rtp_add(ctx, rtp_cast(ctx, h, RTP_TYPE_F32), rtp_cast(ctx, h, RTP_TYPE_F32)));
  rtp_graph *g = rtp_graph_new(ctx, 64);
  ASSERT_EQ(rtp_graph_build(g, loss), 0);
  EXPECT_EQ(rtp_graph_build_backward(ctx, g, loss), RTP_EINVAL);
  EXPECT_NE(std::string(rtp_last_error()).find("bf16"), std::string::npos) << rtp_last_error();
  rtp_context_free(ctx);
}

// ---- matrix products in bf16 precision ------------------------------------------------

using View = std::function<rtp_tensor *(rtp_context *, rtp_tensor *)>;

rtp_tensor *as_is(rtp_context *, rtp_tensor *x) {
  return x;
}

struct MmCase {
  const char *what;
  Shape a, b;       // the leaves
  View va = as_is;  // the operands, views of them
  View vb = as_is;
};

const MmCase kMmCases[] = {
    {"2d", {5, 3}, {5, 4}},
    {"m = 1", {7, 1}, {7, 9}},
    {"large", {67, 45}, {67, 130}},
    {"batched", {4, 3, 2, 3}, {4, 5, 2, 3}},
    {"shared a", {4, 3}, {4, 5, 2}},
    {"a^T", {3, 5}, {5, 4}, [](rtp_context *c, rtp_tensor *x) { return rtp_transpose(c, x); }},
    {"b^T shared a",
     {5, 3},
     {4, 5, 2},
     as_is,
     [](rtp_context *c, rtp_tensor *x) { return rtp_transpose(c, x); }},
    {"both^T batched",
     {3, 5, 2},
     {4, 5, 2},
     [](rtp_context *c, rtp_tensor *x) { return rtp_transpose(c, x); },
     [](rtp_context *c, rtp_tensor *x) { return rtp_transpose(c, x); }},
    {"permuted batches",
     {4, 3, 2, 3},
     {4, 5, 3, 2},
     as_is,
     [](rtp_context *c, rtp_tensor *x) { return rtp_permute(c, x, 0, 1, 3, 2); }},
};

// x rounded to bf16 and back to f32 by the CAST op: the operand a bf16 product reads.
rtp_tensor *rounded(rtp_context *c, rtp_tensor *x) {
  return rtp_cast(c, rtp_cast(c, x, RTP_TYPE_BF16), RTP_TYPE_F32);
}

rtp_tensor *new_random(rtp_context *ctx, const Shape &ne, std::mt19937 &rng) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  rtp_tensor *x = rtp_tensor_new(ctx, RTP_TYPE_F32, (int)ne.size(), ne.data());
  for (int64_t i = 0; i < rtp_tensor_nelements(x); i++) ((float *)x->data)[i] = u(rng);
  return x;
}

// The gradient of leaf x, read through view v of x (the same strides into x's layout,
// which x's gradient has), in v's element order.
std::vector<uint32_t> grad_through(const rtp_tensor *x, const rtp_tensor *v) {
  std::vector<uint32_t> out;
  for (int64_t i3 = 0; i3 < v->ne[3]; i3++)
    for (int64_t i2 = 0; i2 < v->ne[2]; i2++)
      for (int64_t i1 = 0; i1 < v->ne[1]; i1++)
        for (int64_t i0 = 0; i0 < v->ne[0]; i0++) {
          size_t offs = i0 * v->nb[0] + i1 * v->nb[1] + i2 * v->nb[2] + i3 * v->nb[3];
          out.push_back(*(const uint32_t *)((const char *)x->grad->data + offs));
        }
  return out;
}

std::vector<uint32_t> bits(const rtp_tensor *t) {
  const uint32_t *p = (const uint32_t *)t->data;
  return std::vector<uint32_t>(p, p + rtp_tensor_nelements(t));
}

// y = a'.b' in bf16 precision (a', b' views of leaves a, b) and loss = sum(y * R), with
// backward; against the f32 products, built explicitly, of a' and b' rounded by the CAST
// op, and of what backward multiplies (rtp-graph.c's rule: b'^T and dy^T for a', a'^T and
// dy for b', where dy = R, flattened over batches when a' serves all of them) rounded the
// same way. Rounded copies are contiguous, like the casts, so the GEMMs are the same
// calls: equal bit for bit.
void check_bf16_product(const MmCase &mc, int threads) {
  SCOPED_TRACE(std::string(mc.what) + ", threads " + std::to_string(threads));
  rtp_init_params ip = {16 << 20, nullptr, false, nullptr, 0};
  rtp_context *ctx = rtp_context_new(ip);
  std::mt19937 rng(11);
  rtp_tensor *a = new_random(ctx, mc.a, rng), *b = new_random(ctx, mc.b, rng);
  rtp_tensor_set_param(a);
  rtp_tensor_set_param(b);
  rtp_tensor *av = mc.va(ctx, a), *bv = mc.vb(ctx, b);
  rtp_tensor *y = rtp_mul_mat(ctx, av, bv);
  ASSERT_NE(y, nullptr) << rtp_last_error();
  ASSERT_EQ(rtp_mul_mat_set_prec(y, RTP_TYPE_BF16), RTP_OK);
  EXPECT_EQ(rtp_mul_mat_get_prec(y), RTP_TYPE_BF16);
  rtp_tensor *r = new_random(ctx, {y->ne[0], y->ne[1], y->ne[2], y->ne[3]}, rng);
  rtp_tensor *loss = rtp_sum(ctx, rtp_mul(ctx, y, r));
  rtp_tensor_set_output(y);
  rtp_graph *g = rtp_graph_new(ctx, 256);
  ASSERT_EQ(rtp_graph_build(g, loss), 0);
  ASSERT_EQ(rtp_graph_build_backward(ctx, g, loss), 0) << rtp_last_error();
  int products = 0;
  for (int i = 0; i < g->n_nodes; i++) {
    if (g->nodes[i]->op != RTP_OP_MUL_MAT) continue;
    products++;
    EXPECT_EQ(rtp_mul_mat_get_prec(g->nodes[i]), RTP_TYPE_BF16) << "product " << products;
  }
  EXPECT_EQ(products, 3);  // y and its two gradient products

  bool a_2d = av->ne[2] == 1 && av->ne[3] == 1, batched = bv->ne[2] > 1 || bv->ne[3] > 1;
  rtp_tensor *b2 = bv, *r2 = r;
  if (a_2d && batched) {
    b2 = rtp_reshape_2d(ctx, rtp_cont(ctx, bv), bv->ne[0], rtp_tensor_nrows(bv));
    r2 = rtp_reshape_2d(ctx, r, r->ne[0], rtp_tensor_nrows(r));
  }
  rtp_tensor *want_y = rtp_mul_mat(ctx, rounded(ctx, av), rounded(ctx, bv));
  rtp_tensor *want_da = rtp_mul_mat(ctx, rounded(ctx, rtp_transpose(ctx, b2)),
                                    rounded(ctx, rtp_transpose(ctx, r2)));
  rtp_tensor *want_db = rtp_mul_mat(ctx, rounded(ctx, rtp_transpose(ctx, av)), rounded(ctx, r));
  rtp_tensor *exact = rtp_mul_mat(ctx, av, bv);  // f32: the rounding must show
  rtp_graph *ref = rtp_graph_new(ctx, 256);
  for (rtp_tensor *t : {want_y, want_da, want_db, exact}) {
    ASSERT_NE(t, nullptr) << rtp_last_error();
    EXPECT_EQ(rtp_mul_mat_get_prec(t), RTP_TYPE_F32);
    rtp_tensor_set_output(t);
    ASSERT_EQ(rtp_graph_build(ref, t), 0);
  }
  ASSERT_EQ(rtp_graph_plan(ctx, g), 0) << rtp_last_error();
  ASSERT_EQ(rtp_graph_plan(ctx, ref), 0) << rtp_last_error();
  rtp_threadpool *tp = rtp_threadpool_new(threads);
  ASSERT_EQ(rtp_graph_compute(g, tp), 0) << rtp_last_error();
  ASSERT_EQ(rtp_graph_compute(ref, tp), 0) << rtp_last_error();
  EXPECT_EQ(bits(y), bits(want_y));
  EXPECT_NE(bits(y), bits(exact));
  EXPECT_EQ(grad_through(a, av), bits(want_da)) << "gradient of a";
  EXPECT_EQ(grad_through(b, bv), bits(want_db)) << "gradient of b";
  rtp_threadpool_free(tp);
  rtp_context_free(ctx);
}

TEST(MulMatBf16, ProductOfRoundedOperandsAndItsBackward) {
  for (int threads : {1, 2, 3})
    for (const MmCase &mc : kMmCases) check_bf16_product(mc, threads);
}

// The rounding is exactly the cast's, specials included: a product with one nonzero term
// per element gives back each rounded operand value (times 1, which bf16 holds).
TEST(MulMatBf16, RoundsAsTheCast) {
  const uint32_t vals[] = {0x3f808000u, 0x3f818000u, 0x3f808001u, 0xbf808000u, 0x7f7fffffu,
                           0x00008001u, 0x007fffffu, 0x7f800000u, 0x3fffffffu, 0x00000001u};
  const int n = (int)(sizeof(vals) / sizeof(vals[0]));
  rtp_init_params ip = {1 << 20, nullptr, false, nullptr, 0};
  rtp_context *ctx = rtp_context_new(ip);
  rtp_tensor *x = rtp_tensor_new_2d(ctx, RTP_TYPE_F32, 1, n);  // n rows of K = 1
  rtp_tensor *one = rtp_tensor_new_2d(ctx, RTP_TYPE_F32, 1, 1);
  memcpy(x->data, vals, sizeof(vals));
  rtp_tensor_fill_f32(one, 1.0f);
  rtp_tensor *y = rtp_mul_mat(ctx, x, one);  // {n, 1}: y[m] = x[m] * 1
  ASSERT_EQ(rtp_mul_mat_set_prec(y, RTP_TYPE_BF16), RTP_OK);
  rtp_tensor_set_output(y);
  rtp_graph *g = rtp_graph_new(ctx, 16);
  ASSERT_EQ(rtp_graph_build(g, y), 0);
  ASSERT_EQ(rtp_graph_plan(ctx, g), 0);
  ASSERT_EQ(rtp_graph_compute(g, nullptr), 0);
  for (int i = 0; i < n; i++)
    EXPECT_EQ(((const uint32_t *)y->data)[i], (uint32_t)bf16_reference(vals[i]) << 16)
        << std::hex << vals[i];
  rtp_context_free(ctx);
}

// ---- forward values against direct formulas ----------------------------------------

TEST(OpForward, Example) {
  rtp_init_params ip = {1 << 20, nullptr, false, nullptr, 0};
  rtp_context *ctx = rtp_context_new(ip);
  rtp_tensor *x = rtp_tensor_new_1d(ctx, RTP_TYPE_F32, 1);
  rtp_tensor *a = rtp_tensor_new_1d(ctx, RTP_TYPE_F32, 1);
  rtp_tensor *b = rtp_tensor_new_1d(ctx, RTP_TYPE_F32, 1);
  rtp_tensor_set_param(x);
  rtp_tensor *f = rtp_add(ctx, rtp_mul(ctx, a, rtp_mul(ctx, x, x)), b);
  rtp_graph *g = rtp_graph_new(ctx, 64);
  ASSERT_EQ(rtp_graph_build(g, f), 0);
  ASSERT_EQ(rtp_graph_build_backward(ctx, g, f), 0);
  ASSERT_EQ(rtp_graph_plan(ctx, g), 0);
  rtp_tensor_fill_f32(x, 2.0f);
  rtp_tensor_fill_f32(a, 3.0f);
  rtp_tensor_fill_f32(b, 4.0f);
  ASSERT_EQ(rtp_graph_compute(g, nullptr), 0);
  EXPECT_FLOAT_EQ(rtptest::f32_at(f, 0), 16.0f);
  EXPECT_FLOAT_EQ(rtptest::f32_at(x->grad, 0), 12.0f);
  rtp_context_free(ctx);
}

TEST(OpForward, SoftMaxCausalAndCrossEntropy) {
  rtp_init_params ip = {1 << 20, nullptr, false, nullptr, 0};
  rtp_context *ctx = rtp_context_new(ip);
  rtp_tensor *s = rtp_tensor_new_2d(ctx, RTP_TYPE_F32, 3, 3);
  for (int i = 0; i < 9; i++) ((float *)s->data)[i] = (float)i;
  rtp_tensor *p = rtp_soft_max(ctx, s, 1.0f, true);
  rtp_tensor *t = rtp_tensor_new_1d(ctx, RTP_TYPE_I32, 3);
  ((int32_t *)t->data)[0] = 0, ((int32_t *)t->data)[1] = 2, ((int32_t *)t->data)[2] = 1;
  rtp_tensor *ce = rtp_cross_entropy(ctx, s, t);
  rtp_tensor_set_output(p);
  rtp_graph *g = rtp_graph_new(ctx, 16);
  rtp_graph_build(g, p);
  rtp_graph_build(g, ce);
  ASSERT_EQ(rtp_graph_plan(ctx, g), 0);
  ASSERT_EQ(rtp_graph_compute(g, nullptr), 0);
  const float *y = (const float *)p->data;
  EXPECT_FLOAT_EQ(y[0], 1.0f);
  EXPECT_FLOAT_EQ(y[1], 0.0f);
  EXPECT_NEAR(y[3], 1.0f / (1.0f + std::exp(1.0f)), 1e-6);
  EXPECT_FLOAT_EQ(y[5], 0.0f);
  double expect = 0;
  for (int r = 0; r < 3; r++) {
    const float *x = (const float *)s->data + 3 * r;
    double lse = std::log(std::exp(x[0]) + std::exp(x[1]) + std::exp(x[2]));
    expect += lse - x[((int32_t *)t->data)[r]];
  }
  EXPECT_NEAR(rtptest::f32_at(ce, 0), expect / 3, 1e-5);
  rtp_context_free(ctx);
}

}  // namespace
