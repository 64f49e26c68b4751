// Finite-difference gradient checks for every differentiable op, on random inputs of
// several shapes (odd sizes included), plus forward checks against direct formulas.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "rtp.h"

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
  rtp_context *ctx = rtp_init(ip);
  ASSERT_NE(ctx, nullptr);
  std::mt19937 rng(42);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<rtp_tensor *> xs;
  for (const Input &in : inputs) {
    rtp_tensor *x = rtp_new_tensor(ctx, in.index_range ? RTP_TYPE_I32 : RTP_TYPE_F32,
                                   (int)in.ne.size(), in.ne.data());
    ASSERT_NE(x, nullptr);
    for (int64_t i = 0; i < rtp_nelements(x); i++) {
      if (in.index_range)
        ((int32_t *)x->data)[i] = (int32_t)(rng() % (uint32_t)in.index_range);
      else
        ((float *)x->data)[i] = in.positive ? 1.0f + 0.5f * u(rng) : u(rng);
    }
    if (in.param && !in.index_range) rtp_set_param(x);
    xs.push_back(x);
  }
  rtp_tensor *f = build(ctx, xs);
  const char *msg = nullptr;
  ASSERT_NE(f, nullptr) << (rtp_context_error(ctx, &msg), msg);
  f = rtp_cont(ctx, f);
  rtp_tensor *r = rtp_new_tensor(ctx, RTP_TYPE_F32, 4, f->ne);
  for (int64_t i = 0; i < rtp_nelements(r); i++) ((float *)r->data)[i] = u(rng);
  rtp_tensor *loss = rtp_sum(ctx, rtp_mul(ctx, f, r));
  ASSERT_NE(loss, nullptr) << (rtp_context_error(ctx, &msg), msg);
  rtp_graph *g = rtp_graph_new(ctx, 1024);
  ASSERT_EQ(rtp_graph_build(g, loss), 0) << rtp_last_error();
  ASSERT_EQ(rtp_build_backward(ctx, g, loss), 0) << rtp_last_error();
  ASSERT_EQ(rtp_graph_plan(ctx, g), 0) << rtp_last_error();
  rtp_threadpool *tp = rtp_threadpool_new(n_threads);
  ASSERT_EQ(rtp_graph_compute(g, tp), 0) << rtp_last_error();

  // Every gradient is read before any input moves: each depends on the others' values.
  std::vector<std::vector<float>> grads(xs.size());
  for (size_t k = 0; k < xs.size(); k++) {
    if (!(xs[k]->flags & RTP_FLAG_PARAM)) continue;
    ASSERT_NE(xs[k]->grad, nullptr) << "input " << k << " got no gradient";
    grads[k].assign((float *)xs[k]->grad->data,
                    (float *)xs[k]->grad->data + rtp_nelements(xs[k]));
  }
  int checked = 0;
  for (size_t k = 0; k < xs.size(); k++) {
    rtp_tensor *x = xs[k];
    if (!(x->flags & RTP_FLAG_PARAM)) continue;
    const std::vector<float> &ana = grads[k];
    for (int64_t i = 0; i < rtp_nelements(x); i++) {
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
  rtp_free(ctx);
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
    rtp_tensor *like = rtp_new_tensor(c, RTP_TYPE_F32, (int)one.size(), one.data());
    return rtp_repeat_back(c, x[0], like);
  });
  check_grad("repeat_back rows", {{s}}, [s](rtp_context *c, auto &x) {
    rtp_tensor *like = rtp_new_tensor_1d(c, RTP_TYPE_F32, s[0]);
    return rtp_repeat_back(c, x[0], like);
  });
  check_grad("repeat", {{{s[0]}}}, [s](rtp_context *c, auto &x) {
    rtp_tensor *like = rtp_new_tensor(c, RTP_TYPE_F32, (int)s.size(), s.data());
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
      int d = rtp_n_dims(x[0]) - 1;
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

// ---- forward values against direct formulas ----------------------------------------

TEST(OpForward, Example) {
  rtp_init_params ip = {1 << 20, nullptr, false, nullptr, 0};
  rtp_context *ctx = rtp_init(ip);
  rtp_tensor *x = rtp_new_tensor_1d(ctx, RTP_TYPE_F32, 1);
  rtp_tensor *a = rtp_new_tensor_1d(ctx, RTP_TYPE_F32, 1);
  rtp_tensor *b = rtp_new_tensor_1d(ctx, RTP_TYPE_F32, 1);
  rtp_set_param(x);
  rtp_tensor *f = rtp_add(ctx, rtp_mul(ctx, a, rtp_mul(ctx, x, x)), b);
  rtp_graph *g = rtp_graph_new(ctx, 64);
  ASSERT_EQ(rtp_graph_build(g, f), 0);
  ASSERT_EQ(rtp_build_backward(ctx, g, f), 0);
  ASSERT_EQ(rtp_graph_plan(ctx, g), 0);
  rtp_set_f32(x, 2.0f);
  rtp_set_f32(a, 3.0f);
  rtp_set_f32(b, 4.0f);
  ASSERT_EQ(rtp_graph_compute(g, nullptr), 0);
  EXPECT_FLOAT_EQ(rtp_get_f32_1d(f, 0), 16.0f);
  EXPECT_FLOAT_EQ(rtp_get_f32_1d(x->grad, 0), 12.0f);
  rtp_free(ctx);
}

TEST(OpForward, SoftMaxCausalAndCrossEntropy) {
  rtp_init_params ip = {1 << 20, nullptr, false, nullptr, 0};
  rtp_context *ctx = rtp_init(ip);
  rtp_tensor *s = rtp_new_tensor_2d(ctx, RTP_TYPE_F32, 3, 3);
  for (int i = 0; i < 9; i++) ((float *)s->data)[i] = (float)i;
  rtp_tensor *p = rtp_soft_max(ctx, s, 1.0f, true);
  rtp_tensor *t = rtp_new_tensor_1d(ctx, RTP_TYPE_I32, 3);
  ((int32_t *)t->data)[0] = 0, ((int32_t *)t->data)[1] = 2, ((int32_t *)t->data)[2] = 1;
  rtp_tensor *ce = rtp_cross_entropy(ctx, s, t);
  rtp_set_output(p);
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
  EXPECT_NEAR(rtp_get_f32_1d(ce, 0), expect / 3, 1e-5);
  rtp_free(ctx);
}

}  // namespace
