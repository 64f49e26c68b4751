/* rtp-gemm.c - single-threaded f32 GEMM through the provider the build chose (RTP_GEMM:
 * oneDNN, rtp-gemm-dnnl.c; CBLAS), else a blocked kernel that compilers vectorise, which
 * also takes the layouts a provider cannot. Callers split the rows between threads. */
#include "rtp-impl.h"

#include <pthread.h>
#include <string.h>

#ifdef RTP_USE_CBLAS
#include <cblas.h>
#endif

/* The portable kernel works on panels: NC columns of Y by KC steps of k, packed; then
 * four rows of X, packed, against 16 columns at a time: an inner loop of independent
 * multiply-adds that vectorises without reassociating sums. Packing both operands
 * makes the speed independent of how they are laid out. */
enum { MR = 4, NR = 16, KC = 256, NC = 128 };

static void micro_kernel(int64_t mr, int64_t kc, const float *xp, const float *yp, float *c,
                         int64_t ldc, int64_t nr, bool first) {
  float a0[NR], a1[NR], a2[NR], a3[NR];
  float *acc[MR] = {a0, a1, a2, a3};
  for (int r = 0; r < MR; r++)
    for (int j = 0; j < NR; j++) acc[r][j] = (!first && r < mr && j < nr) ? c[r * ldc + j] : 0;
  /* One row of Y against four broadcast values of X: the j loop is the vector. */
  for (int64_t k = 0; k < kc; k++) {
    const float *yk = yp + k * NR;
    float x0 = xp[k * MR], x1 = xp[k * MR + 1], x2 = xp[k * MR + 2], x3 = xp[k * MR + 3];
    for (int j = 0; j < NR; j++) {
      a0[j] += x0 * yk[j];
      a1[j] += x1 * yk[j];
      a2[j] += x2 * yk[j];
      a3[j] += x3 * yk[j];
    }
  }
  for (int64_t r = 0; r < mr; r++)
    for (int64_t j = 0; j < nr; j++) c[r * ldc + j] = acc[r][j];
}

void rtp__gemm_fallback(int64_t m, int64_t n, int64_t k, const float *x, int64_t x_row,
                        int64_t x_k, const float *y, int64_t y_row, int64_t y_k, float *c,
                        int64_t ldc, bool accumulate) {
  float yp[KC * NC] __attribute__((aligned(64)));
  float xp[KC * MR] __attribute__((aligned(64)));
  if (k == 0) {
    if (!accumulate)
      for (int64_t i = 0; i < m; i++) memset(c + i * ldc, 0, (size_t)n * sizeof(float));
    return;
  }
  for (int64_t j0 = 0; j0 < n; j0 += NC) {
    int64_t nc = n - j0 < NC ? n - j0 : NC;
    for (int64_t k0 = 0; k0 < k; k0 += KC) {
      int64_t kc = k - k0 < KC ? k - k0 : KC;
      /* yp holds NC/NR slabs of [kc][NR]: column j of the panel, step k. */
      for (int64_t js = 0; js < nc; js += NR)
        for (int64_t kk = 0; kk < kc; kk++)
          for (int64_t j = 0; j < NR; j++)
            yp[js * kc + kk * NR + j] =
                js + j < nc ? y[(j0 + js + j) * y_row + (k0 + kk) * y_k] : 0.0f;
      for (int64_t i0 = 0; i0 < m; i0 += MR) {
        int64_t mr = m - i0 < MR ? m - i0 : MR;
        for (int64_t kk = 0; kk < kc; kk++)
          for (int64_t r = 0; r < MR; r++)
            xp[kk * MR + r] = r < mr ? x[(i0 + r) * x_row + (k0 + kk) * x_k] : 0.0f;
        for (int64_t js = 0; js < nc; js += NR)
          micro_kernel(mr, kc, xp, yp + js * kc, c + i0 * ldc + j0 + js, ldc,
                       nc - js < NR ? nc - js : NR, k0 == 0 && !accumulate);
      }
    }
  }
}

bool rtp__gemm_has_cblas(void) {
#ifdef RTP_USE_CBLAS
  return true;
#else
  return false;
#endif
}

const char *rtp__gemm_provider(void) {
#if defined(RTP_USE_DNNL)
  return "onednn";
#elif defined(RTP_USE_CBLAS)
  return "openblas";
#else
  return "builtin";
#endif
}

#ifndef RTP_USE_DNNL
int rtp__gemm_plan(int64_t n, int64_t k, int64_t x_row, int64_t x_k, int64_t y_row, int64_t y_k,
                   int64_t ldc, bool accumulate) {
  (void)n, (void)k, (void)x_row, (void)x_k, (void)y_row, (void)y_k, (void)ldc;
  (void)accumulate;
  return RTP_OK; /* CBLAS and the built-in kernel keep nothing per shape */
}
#endif

void rtp__gemm_stats(size_t *made, size_t *late, size_t *declined) {
#ifdef RTP_USE_DNNL
  rtp__gemm_dnnl_stats(made, late, declined);
#else
  *made = *late = *declined = 0;
#endif
}

const char *rtp__gemm_kernel(void) {
#if defined(RTP_USE_DNNL)
  return rtp__gemm_dnnl_kernel();
#elif defined(RTP_USE_CBLAS) && defined(OPENBLAS_VERSION)
  return openblas_get_corename();
#else
  return "rtp blocked kernel";
#endif
}

bool rtp__gemm_layout(int64_t rows, int64_t k, int64_t row, int64_t kst, bool *packed_rows,
                      int64_t *ld) {
  if ((kst == 1 || k == 1) && (rows == 1 || row >= k)) {
    *packed_rows = true;
    *ld = rows == 1 ? (k > 1 ? k : 1) : row;
    return true;
  }
  if ((row == 1 || rows == 1) && (k == 1 || kst >= rows)) {
    *packed_rows = false;
    *ld = k == 1 ? (rows > 1 ? rows : 1) : kst;
    return true;
  }
  return false;
}

/* C (m x n, row-major) = X . Y^T with X(i,k) = x[i*x_row + k*x_k], Y(j,k) = y[j*y_row + k*y_k].
 */
void rtp__gemm(int64_t m, int64_t n, int64_t k, const float *x, int64_t x_row, int64_t x_k,
               const float *y, int64_t y_row, int64_t y_k, float *c, int64_t ldc,
               bool accumulate) {
  if (m == 0 || n == 0) return;
#ifdef RTP_USE_DNNL
  if (rtp__gemm_dnnl(m, n, k, x, x_row, x_k, y, y_row, y_k, c, ldc, accumulate)) return;
#endif
#ifdef RTP_USE_CBLAS
  bool x_rows, y_rows;
  int64_t ldx, ldy;
  bool fits = m < INT32_MAX && n < INT32_MAX && k < INT32_MAX && ldc < INT32_MAX;
  if (fits && k > 0 && rtp__gemm_layout(m, k, x_row, x_k, &x_rows, &ldx) &&
      rtp__gemm_layout(n, k, y_row, y_k, &y_rows, &ldy)) {
    /* op(B) must be Y^T (k x n): Y with packed rows is read transposed. */
    if (ldx >= INT32_MAX || ldy >= INT32_MAX) goto fallback;
    cblas_sgemm(CblasRowMajor, x_rows ? CblasNoTrans : CblasTrans,
                y_rows ? CblasTrans : CblasNoTrans, (int)m, (int)n, (int)k, 1.0f, x, (int)ldx,
                y, (int)ldy, accumulate ? 1.0f : 0.0f, c, (int)ldc);
    return;
  }
fallback:
#endif
  rtp__gemm_fallback(m, n, k, x, x_row, x_k, y, y_row, y_k, c, ldc, accumulate);
}

static void gemm_init_once(void) {
#if defined(RTP_USE_CBLAS) && defined(OPENBLAS_VERSION)
  /* rtp's threads split the work; OpenBLAS threads inside them would oversubscribe. */
  openblas_set_num_threads(1);
#endif
}

void rtp__gemm_init(void) {
  static pthread_once_t once = PTHREAD_ONCE_INIT;
  pthread_once(&once, gemm_init_once);
}
