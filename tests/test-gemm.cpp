// The GEMM under mul_mat: the CBLAS path and the built-in blocked kernel against a
// double-precision reference, for every operand layout and for edge sizes.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

extern "C" {
#include "rtp-impl.h"
}

namespace {

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

TEST(Gemm, Fallback) {
  check_all(rtp__gemm_fallback);
}

TEST(Gemm, Dispatch) {
  check_all(rtp__gemm);
  if (!rtp__gemm_has_cblas()) GTEST_SKIP() << "built without CBLAS: dispatch is the fallback";
}

}  // namespace
