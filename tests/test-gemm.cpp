// The GEMM under mul_mat: the provider the build chose (oneDNN, CBLAS) and the built-in
// blocked kernel against a double-precision reference, for every operand layout and for
// edge sizes; the provider against the built-in kernel on padded strides and row shares;
// and oneDNN's primitives all made by rtp_graph_plan, none inside a step.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>
#include <vector>

extern "C" {
#include "gpt.h"
#include "rtp-impl.h"
}

namespace {

size_t thread_count() {
  size_t n = 0;
  for (auto &e : std::filesystem::directory_iterator("/proc/self/task")) n += !e.path().empty();
  return n;
}

using GemmFn = void (*)(int64_t, int64_t, int64_t, const float *, int64_t, int64_t,
                        const float *, int64_t, int64_t, float *, int64_t, bool);

// C (m x n) = X . Y^T (+ C when accumulating); X is m x k and Y is n x k, each stored with
// packed rows or, when transposed, packed columns.
void check(GemmFn fn, int64_t m, int64_t n, int64_t k, bool xt, bool yt, bool acc) {
  SCOPED_TRACE(testing::Message()
               << m << "x" << n << "x" << k << " xt=" << xt << " yt=" << yt << " acc=" << acc);
  std::mt19937 rng((unsigned)(m * 131 + n * 17 + k));
  std::uniform_real_distribution<float> u(-1, 1);
  std::vector<float> x(m * k + 1), y(n * k + 1), c(m * n + 3, 7.0f);
  for (float &v : x) v = u(rng);
  for (float &v : y) v = u(rng);
  for (int64_t i = 0; i < m * n; i++) c[i] = u(rng);
  const std::vector<float> c0 = c;
  int64_t xr = xt ? 1 : k, xk = xt ? m : 1, yr = yt ? 1 : k, yk = yt ? n : 1;
  fn(m, n, k, x.data(), xr, xk, y.data(), yr, yk, c.data(), n, acc);
  double worst = 0;
  for (int64_t i = 0; i < m; i++)
    for (int64_t j = 0; j < n; j++) {
      double s = acc ? c0[i * n + j] : 0.0;
      for (int64_t p = 0; p < k; p++) s += (double)x[i * xr + p * xk] * y[j * yr + p * yk];
      worst = std::fmax(worst, std::fabs(s - c[i * n + j]) / (1.0 + std::fabs(s)));
    }
  EXPECT_LT(worst, 1e-5);
  for (int64_t i = m * n; i < m * n + 3; i++) EXPECT_EQ(c[i], 7.0f) << "wrote past C";
}

void check_all(GemmFn fn) {
  const int64_t sizes[][3] = {{1, 1, 1},  {3, 5, 7},    {4, 16, 256},  {17, 33, 257},
                              {64, 1, 9}, {1, 70, 300}, {130, 129, 3}, {5, 4, 0}};
  for (auto &s : sizes)
    for (bool xt : {false, true})
      for (bool yt : {false, true})
        for (bool acc : {false, true}) check(fn, s[0], s[1], s[2], xt, yt, acc);
}

// A product large enough for a library to share between threads, run on this thread:
// it runs on this thread alone, so the executor's threads, each running one, never
// compete with the provider's for the cores. libgomp keeps the threads of an OpenMP team
// it started, so none started if none is there after. First in this file: no earlier
// product has run in this process.
TEST(Gemm, ProviderStartsNoThreads) {
  const int64_t m = 512, n = 512, k = 512;
  std::vector<float> x(m * k, 0.5f), y(n * k, 0.25f), c(m * n);
  size_t before = thread_count();
  ASSERT_EQ(rtp__gemm_plan(n, k, k, 1, k, 1, n, false), RTP_OK);
  rtp__gemm(m, n, k, x.data(), k, 1, y.data(), k, 1, c.data(), n, false);
  EXPECT_FLOAT_EQ(c[0], 0.125f * (float)k);
  EXPECT_EQ(thread_count(), before) << "threads started by the GEMM provider";
}

TEST(Gemm, Fallback) {
  check_all(rtp__gemm_fallback);
}

TEST(Gemm, Dispatch) {
  check_all(rtp__gemm);
  if (!strcmp(rtp__gemm_provider(), "builtin"))
    GTEST_SKIP() << "built without a GEMM library: dispatch is the fallback";
}

TEST(Gemm, ProviderIsTheConfiguredOne) {
  EXPECT_STREQ(rtp__gemm_provider(), RTP_GEMM_EXPECTED);
  EXPECT_STRNE(rtp__gemm_kernel(), "");
  if (!strcmp(RTP_GEMM_EXPECTED, "openblas")) {
    EXPECT_TRUE(rtp__gemm_has_cblas());
  }
}

// Operands inside wider buffers (leading dimensions past the rows), C a block of a wider
// result, and the rows taken in two shares as two threads do: the provider against the
// built-in kernel, accumulating or not.
TEST(Gemm, ProviderEqualsBuiltinOnStridedShares) {
  const int64_t shapes[][3] = {{7, 13, 29}, {33, 65, 130}, {128, 96, 200}, {3, 200, 1}};
  for (auto &s : shapes)
    for (bool xt : {false, true})
      for (bool yt : {false, true})
        for (bool acc : {false, true}) {
          int64_t m = s[0], n = s[1], k = s[2], pad = 5;
          SCOPED_TRACE(testing::Message() << m << "x" << n << "x" << k << " xt=" << xt
                                          << " yt=" << yt << " acc=" << acc);
          int64_t xr = xt ? 1 : k + pad, xk = xt ? m + pad : 1;
          int64_t yr = yt ? 1 : k + pad, yk = yt ? n + pad : 1, ldc = n + pad;
          std::mt19937 rng((unsigned)(m + 7 * n + 31 * k + xt + 2 * yt));
          std::uniform_real_distribution<float> u(-1, 1);
          std::vector<float> x((m + pad) * (k + pad)), y((n + pad) * (k + pad)), c(m * ldc);
          for (float &v : x) v = u(rng);
          for (float &v : y) v = u(rng);
          for (float &v : c) v = u(rng);
          std::vector<float> want = c, got = c;
          ASSERT_EQ(rtp__gemm_plan(n, k, xr, xk, yr, yk, ldc, acc), RTP_OK);
          rtp__gemm_fallback(m, n, k, x.data(), xr, xk, y.data(), yr, yk, want.data(), ldc,
                             acc);
          int64_t half = m / 2;
          rtp__gemm(half, n, k, x.data(), xr, xk, y.data(), yr, yk, got.data(), ldc, acc);
          rtp__gemm(m - half, n, k, x.data() + half * xr, xr, xk, y.data(), yr, yk,
                    got.data() + half * ldc, ldc, acc);
          for (int64_t i = 0; i < m; i++)
            for (int64_t j = 0; j < ldc; j++) {
              float w = want[i * ldc + j];
              ASSERT_NEAR(got[i * ldc + j], w, 1e-5f * (float)k * (1 + std::fabs(w)))
                  << i << "," << j;
            }
        }
}

// A small training step (forward, backward: transposed and batched attention products,
// accumulated gradients) on 1, 2 and 3 threads finds every primitive it runs made by
// rtp_graph_plan, and the provider takes every product (none left to the built-in kernel).

void plan_makes_every_primitive(bool bf16) {
  struct gpt_config cfg = {64, 16, 32, 2, 2, false, false};
  const int batch = 2;
  struct rtp_init_params ip = {};
  ip.mem_size = gpt_arena_size(cfg, batch);
  struct rtp_context *ctx = rtp_context_new(ip);
  ASSERT_NE(ctx, nullptr);
  struct gpt m;
  struct rtp_graph *g = rtp_graph_new(ctx, 8192);
  ASSERT_EQ(gpt_build(ctx, &m, cfg, batch), RTP_OK);
  ASSERT_EQ(rtp_graph_build(g, m.loss), RTP_OK);
  ASSERT_EQ(rtp_graph_build_backward(ctx, g, m.loss), RTP_OK);
  for (int i = 0; i < g->n_nodes && bf16; i++) {
    if (g->nodes[i]->op == RTP_OP_MUL_MAT) {
      ASSERT_EQ(rtp_mul_mat_set_prec(g->nodes[i], RTP_TYPE_BF16), RTP_OK);
    }
  }
  size_t made0, late0, made1, late1, made2, late2, declined0, declined1, declined2;
  rtp__gemm_stats(&made0, &late0, &declined0);
  ASSERT_EQ(rtp_graph_plan(ctx, g), RTP_OK) << rtp_last_error();
  rtp__gemm_stats(&made1, &late1, &declined1);
  gpt_init_weights(&m, 1);
  int32_t *idx = (int32_t *)m.idx->data, *tgt = (int32_t *)m.targets->data;
  for (int64_t i = 0; i < rtp_tensor_nelements(m.idx); i++)
    idx[i] = tgt[i] = (int32_t)(i * 7 % cfg.vocab);
  for (int threads : {1, 2, 3}) {
    struct rtp_threadpool *tp = rtp_threadpool_new(threads);
    EXPECT_EQ(rtp_graph_compute(g, tp), RTP_OK) << rtp_last_error();
    rtp_threadpool_free(tp);
  }
  rtp__gemm_stats(&made2, &late2, &declined2);
  EXPECT_EQ(late2, late1) << "primitives made inside a step";
  EXPECT_EQ(made2, made1);
  EXPECT_EQ(declined2, declined1) << "products the provider left to the built-in kernel";
  if (!strcmp(rtp__gemm_provider(), "onednn")) {
    EXPECT_GT(made1, made0);
  }
  rtp_context_free(ctx);
}

TEST(Gemm, PlanMakesEveryPrimitive) {
  plan_makes_every_primitive(false);
}

// bf16 precision: the GEMM reads the operands' rounded copies, contiguous in scratch.
TEST(Gemm, PlanMakesEveryPrimitiveBf16) {
  plan_makes_every_primitive(true);
}

}  // namespace
