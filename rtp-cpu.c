/* rtp-cpu.c - the CPU backend: one kernel per op. Every kernel is called by all threads
 * of the pool with its thread index and splits the work itself, so results do not
 * depend on scheduling: sums always run in the same order for a given thread count.
 * Loop bounds are read into locals first: the build allows any pointer to alias (for
 * type punning), so a bound read through the tensor header inside a loop that stores
 * floats would be reloaded every iteration and the loop would not vectorise. */
#include "rtp-impl.h"
#include "rtp-cpu-math.h"

#include <math.h>
#include <string.h>

#define DATA(t) ((char *)(t)->data)

/* [r0, r1): this thread's share of n items. */
static void split(int64_t n, const struct rtp_compute_params *p, int64_t *r0, int64_t *r1) {
  *r0 = n * p->ith / p->nth;
  *r1 = n * (p->ith + 1) / p->nth;
}

/* Row r of t (rows are indexed over dims 1..3). */
static char *row_ptr(const struct rtp_tensor *t, int64_t r) {
  int64_t i1 = r % t->ne[1], i2 = r / t->ne[1] % t->ne[2], i3 = r / t->ne[1] / t->ne[2];
  return DATA(t) + i1 * t->nb[1] + i2 * t->nb[2] + i3 * t->nb[3];
}

/* Row of b that broadcasts to row r of a shape ne. */
static char *bcast_row_ptr(const struct rtp_tensor *b, const int64_t *ne, int64_t r) {
  int64_t i1 = r % ne[1], i2 = r / ne[1] % ne[2], i3 = r / ne[1] / ne[2];
  return DATA(b) + (i1 % b->ne[1]) * b->nb[1] + (i2 % b->ne[2]) * b->nb[2] +
         (i3 % b->ne[3]) * b->nb[3];
}

/* tanh through exp; |u| is clamped where tanh is 1 to float precision. */
static inline float fast_tanhf(float u) {
  u = u < -9.0f ? -9.0f : u > 9.0f ? 9.0f : u;
  float e = fast_expf(2.0f * u);
  return (e - 1.0f) / (e + 1.0f);
}

/* Row reductions keep LANES partial results: one running sum is a chain the compiler must
 * keep in order (no -ffast-math here), so it stays scalar; independent lanes vectorise.
 * Sums are in double, as the single running sums before them were. */
enum { LANES = 8 };

static double sum_f32(const float *x, int64_t n) {
  double acc[LANES] = {0}, s = 0;
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES)
    for (int l = 0; l < LANES; l++) acc[l] += x[i + l];
  for (; i < n; i++) s += x[i];
  for (int l = 0; l < LANES; l++) s += acc[l];
  return s;
}

/* sum((x - m)^2) */
static double sum_sq_dev(const float *x, float m, int64_t n) {
  double acc[LANES] = {0}, s = 0;
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES)
    for (int l = 0; l < LANES; l++) acc[l] += (double)((x[i + l] - m) * (x[i + l] - m));
  for (; i < n; i++) s += (double)((x[i] - m) * (x[i] - m));
  for (int l = 0; l < LANES; l++) s += acc[l];
  return s;
}

/* sum(x * (y - m)) */
static double dot_dev(const float *x, const float *y, float m, int64_t n) {
  double acc[LANES] = {0}, s = 0;
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES)
    for (int l = 0; l < LANES; l++) acc[l] += (double)(x[i + l] * (y[i + l] - m));
  for (; i < n; i++) s += (double)(x[i] * (y[i] - m));
  for (int l = 0; l < LANES; l++) s += acc[l];
  return s;
}

/* max(x * scale). Rounding is monotonic, so for scale > 0 that is max(x) * scale. */
static float max_scaled(const float *x, int64_t n, float scale) {
  float acc[LANES], m = -INFINITY;
  if (!(scale > 0)) {
    for (int64_t i = 0; i < n; i++) m = fmaxf(m, x[i] * scale);
    return m;
  }
  for (int l = 0; l < LANES; l++) acc[l] = -INFINITY;
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES)
    for (int l = 0; l < LANES; l++) acc[l] = acc[l] > x[i + l] ? acc[l] : x[i + l];
  for (; i < n; i++) m = m > x[i] ? m : x[i];
  for (int l = 0; l < LANES; l++) m = m > acc[l] ? m : acc[l];
  return m * scale;
}

static void report(const struct rtp_compute_params *p, int status) {
  __atomic_store_n(p->status, status, __ATOMIC_RELAXED);
}

/* ---- copies and elementwise ----------------------------------------------------- */

/* Copies n elements of `size` bytes (4, or 2 for bf16) of a row that may be strided. */
static void copy_row(char *dst, const char *src, size_t stride, int64_t n, size_t size) {
  if (stride == size)
    memcpy(dst, src, (size_t)n * size);
  else if (size == 2)
    for (int64_t i = 0; i < n; i++)
      ((uint16_t *)dst)[i] = *(const uint16_t *)(src + i * stride);
  else
    for (int64_t i = 0; i < n; i++)
      ((uint32_t *)dst)[i] = *(const uint32_t *)(src + i * stride);
}

static void k_dup(const struct rtp_compute_params *p, struct rtp_tensor *t) {
  const struct rtp_tensor *a = t->src[0];
  size_t size = rtp_type_size(t->type);
  int64_t r0, r1;
  split(rtp_tensor_nrows(t), p, &r0, &r1);
  for (int64_t r = r0; r < r1; r++)
    copy_row(row_ptr(t, r), row_ptr(a, r), a->nb[0], t->ne[0], size);
}

/* f32 -> bf16, rounding to nearest even: adding 0x7fff plus the lowest kept bit carries
 * into the kept half exactly when the dropped half is more than one half of the last kept
 * bit, or exactly one half with that bit odd. Past the largest finite bf16 the carry
 * reaches the exponent, giving inf, as rounding should. A NaN could carry into inf (or
 * lose its payload to zero), so NaNs keep their top half with the quiet bit set. */
static inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof(u));
  uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : rounded);
}

/* bf16 is the top half of an f32: exact. */
static inline float bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
}

/* Rows of any strides in, contiguous rows out. Packed rows get their own loops, which
 * vectorise. */
static void k_cast(const struct rtp_compute_params *p, struct rtp_tensor *t) {
  const struct rtp_tensor *a = t->src[0];
  const int64_t ne0 = t->ne[0];
  const size_t stride = a->nb[0];
  size_t in = rtp_type_size(a->type), out = rtp_type_size(t->type);
  int64_t r0, r1;
  split(rtp_tensor_nrows(t), p, &r0, &r1);
  for (int64_t r = r0; r < r1; r++) {
    const char *x = row_ptr(a, r);
    char *y = row_ptr(t, r);
    if (in == out) { /* the same type: a copy */
      copy_row(y, x, stride, ne0, out);
    } else if (out == 2) {
      uint16_t *h = (uint16_t *)y;
      if (stride == 4)
        for (int64_t i = 0; i < ne0; i++) h[i] = f32_to_bf16(((const float *)x)[i]);
      else
        for (int64_t i = 0; i < ne0; i++) h[i] = f32_to_bf16(*(const float *)(x + i * stride));
    } else {
      float *f = (float *)y;
      if (stride == 2)
        for (int64_t i = 0; i < ne0; i++) f[i] = bf16_to_f32(((const uint16_t *)x)[i]);
      else
        for (int64_t i = 0; i < ne0; i++)
          f[i] = bf16_to_f32(*(const uint16_t *)(x + i * stride));
    }
  }
}

static void k_binary(const struct rtp_compute_params *p, struct rtp_tensor *t) {
  const struct rtp_tensor *a = t->src[0], *b = t->src[1];
  int64_t n = t->ne[0], r0, r1;
  bool full = b->ne[0] == n;
  split(rtp_tensor_nrows(t), p, &r0, &r1);
  for (int64_t r = r0; r < r1; r++) {
    float *y = (float *)row_ptr(t, r);
    const float *x = (const float *)row_ptr(a, r);
    const float *z = (const float *)bcast_row_ptr(b, t->ne, r);
    switch (t->op) {
      case RTP_OP_ADD:
        if (full)
          for (int64_t i = 0; i < n; i++) y[i] = x[i] + z[i];
        else
          for (int64_t i = 0; i < n; i++) y[i] = x[i] + z[0];
        break;
      case RTP_OP_SUB:
        if (full)
          for (int64_t i = 0; i < n; i++) y[i] = x[i] - z[i];
        else
          for (int64_t i = 0; i < n; i++) y[i] = x[i] - z[0];
        break;
      default: /* MUL */
        if (full)
          for (int64_t i = 0; i < n; i++) y[i] = x[i] * z[i];
        else
          for (int64_t i = 0; i < n; i++) y[i] = x[i] * z[0];
    }
  }
}

static void k_scale(const struct rtp_compute_params *p, struct rtp_tensor *t) {
  const int64_t ne0 = t->ne[0];
  float s = rtp__get_param_f32(t, 0);
  int64_t r0, r1;
  split(rtp_tensor_nrows(t), p, &r0, &r1);
  for (int64_t r = r0; r < r1; r++) {
    float *y = (float *)row_ptr(t, r);
    const float *x = (const float *)row_ptr(t->src[0], r);
    for (int64_t i = 0; i < ne0; i++) y[i] = x[i] * s;
  }
}

/* Each thread sums its rows in double; thread 0 adds the partial sums in order. */
static void k_sum(const struct rtp_compute_params *p, struct rtp_tensor *t) {
  const struct rtp_tensor *a = t->src[0];
  const int64_t ne0 = a->ne[0];
  double *part = p->work;
  int64_t r0, r1;
  split(rtp_tensor_nrows(a), p, &r0, &r1);
  double s = 0;
  for (int64_t r = r0; r < r1; r++) {
    const float *x = (const float *)row_ptr(a, r);
    for (int64_t i = 0; i < ne0; i++) s += x[i];
  }
  part[p->ith] = s;
  rtp__barrier(p);
  if (p->ith == 0) {
    double total = 0;
    for (int i = 0; i < p->nth; i++) total += part[i];
    *(float *)t->data = (float)total;
  }
}

static void k_repeat(const struct rtp_compute_params *p, struct rtp_tensor *t) {
  const int64_t ne0 = t->ne[0];
  const struct rtp_tensor *a = t->src[0];
  int64_t r0, r1;
  split(rtp_tensor_nrows(t), p, &r0, &r1);
  for (int64_t r = r0; r < r1; r++) {
    float *y = (float *)row_ptr(t, r);
    const float *x = (const float *)bcast_row_ptr(a, t->ne, r);
    if (a->ne[0] == t->ne[0])
      memcpy(y, x, (size_t)t->ne[0] * sizeof(float));
    else
      for (int64_t i = 0; i < ne0; i++) y[i] = x[0];
  }
}

/* t (b's shape) = a summed over the dims where t has 1. Threads own columns of t when it
 * has more than one, so no two threads write the same element. */
static void k_repeat_back(const struct rtp_compute_params *p, struct rtp_tensor *t) {
  const struct rtp_tensor *a = t->src[0];
  const int64_t ne0 = a->ne[0];
  int64_t n_out = rtp_tensor_nrows(t), n_in = rtp_tensor_nrows(a);
  if (t->ne[0] == a->ne[0] && t->ne[0] > 1) {
    int64_t c0, c1;
    split(t->ne[0], p, &c0, &c1);
    for (int64_t r = 0; r < n_out; r++)
      memset((float *)row_ptr(t, r) + c0, 0, (size_t)(c1 - c0) * 4);
    for (int64_t r = 0; r < n_in; r++) {
      float *y = (float *)bcast_row_ptr(t, a->ne, r);
      const float *x = (const float *)row_ptr(a, r);
      for (int64_t i = c0; i < c1; i++) y[i] += x[i];
    }
    return;
  }
  if (p->ith != 0) return; /* summing along rows: rare and small */
  for (int64_t r = 0; r < n_out; r++) memset(row_ptr(t, r), 0, (size_t)t->ne[0] * 4);
  for (int64_t r = 0; r < n_in; r++) {
    float *y = (float *)bcast_row_ptr(t, a->ne, r);
    const float *x = (const float *)row_ptr(a, r);
    for (int64_t i = 0; i < ne0; i++) y[t->ne[0] == 1 ? 0 : i] += x[i];
  }
}

/* ---- matrix product ------------------------------------------------------------- */

/* Bytes of scratch a bf16-precision product takes for a rounded copy of operand x. */
static size_t rounded_bytes(const struct rtp_tensor *x) {
  return RTP_PAD((size_t)rtp_tensor_nelements(x) * sizeof(float), RTP_ALIGN);
}

/* x rounded to bf16 (f32_to_bf16, so exactly rtp_cast's rounding) and kept as f32, into
 * contiguous memory at dst, which *out describes: the GEMM then multiplies and sums the
 * rounded values in f32. Threads share the rows; the caller's barrier ends the copy. */
static const struct rtp_tensor *round_operand(const struct rtp_compute_params *p,
                                              const struct rtp_tensor *x, float *dst,
                                              struct rtp_tensor *out) {
  const int64_t ne0 = x->ne[0];
  const size_t stride = x->nb[0];
  *out = *x;
  out->data = dst;
  out->nb[0] = sizeof(float);
  for (int i = 1; i < RTP_MAX_DIMS; i++) out->nb[i] = out->nb[i - 1] * (size_t)out->ne[i - 1];
  int64_t r0, r1;
  split(rtp_tensor_nrows(x), p, &r0, &r1);
  for (int64_t r = r0; r < r1; r++) {
    const char *src = row_ptr(x, r);
    float *y = dst + r * ne0;
    if (stride == sizeof(float))
      for (int64_t i = 0; i < ne0; i++)
        y[i] = bf16_to_f32(f32_to_bf16(((const float *)src)[i]));
    else
      for (int64_t i = 0; i < ne0; i++)
        y[i] = bf16_to_f32(f32_to_bf16(*(const float *)(src + i * stride)));
  }
  return out;
}

/* t{M,N,B2,B3}[n][m] = sum_k a[m][k] * b[n][k] (+ c[n][m] with an addend c = src[2]):
 * C = B . A^T per batch. Threads take whole batches when there are enough of them, else
 * rows of each product. With bf16 precision the operands are read through rounded copies
 * in scratch (the addend stays f32). */
static void k_mul_mat(const struct rtp_compute_params *p, struct rtp_tensor *t) {
  const struct rtp_tensor *a = t->src[0], *b = t->src[1], *c = rtp__addend(t);
  /* In place (the planner gave t c's memory), the GEMM adds to c where it lies. */
  bool copy_c = c && DATA(c) != DATA(t);
  struct rtp_tensor ra, rb;
  if (rtp_mul_mat_get_prec(t) == RTP_TYPE_BF16) {
    float *w = p->work;
    a = round_operand(p, a, w, &ra);
    b = round_operand(p, b, w + rounded_bytes(t->src[0]) / sizeof(float), &rb);
    rtp__barrier(p);
  }
  int64_t M = a->ne[1], N = b->ne[1], K = a->ne[0];
  int64_t nbatch = b->ne[2] * b->ne[3];
  bool a_2d = a->ne[2] == 1 && a->ne[3] == 1;
  int64_t ar = a->nb[1] / 4, ak = a->nb[0] / 4, br = b->nb[1] / 4, bk = b->nb[0] / 4;
  if (a_2d && nbatch > 1 && b->nb[2] == b->nb[1] * (size_t)N &&
      b->nb[3] == b->nb[2] * (size_t)b->ne[2]) {
    N *= nbatch; /* the batches of b are just more rows */
    nbatch = 1;
  }
  bool by_batch = nbatch >= p->nth;
  int64_t b0 = 0, b1 = nbatch, n0 = 0, n1 = N;
  if (by_batch)
    split(nbatch, p, &b0, &b1);
  else
    split(N, p, &n0, &n1);
  for (int64_t bi = b0; bi < b1; bi++) {
    int64_t i2 = bi % b->ne[2], i3 = bi / b->ne[2];
    const float *ap = (const float *)(DATA(a) + (a_2d ? 0 : i2 * a->nb[2] + i3 * a->nb[3]));
    const float *bp = (const float *)(DATA(b) + i2 * b->nb[2] + i3 * b->nb[3]);
    float *cp = (float *)(DATA(t) + i2 * t->nb[2] + i3 * t->nb[3]);
    int64_t ldc = t->nb[1] / 4; /* M, or wider when t is a block of a larger result */
    if (copy_c) /* c is contiguous and shaped like t, so it has t's rows at ldc M */
      for (int64_t n = n0; n < n1; n++)
        memcpy(cp + n * ldc, (const float *)DATA(c) + (bi * N + n) * M, (size_t)M * 4);
    rtp__gemm(n1 - n0, M, K, bp + n0 * br, br, bk, ap, ar, ak, cp + n0 * ldc, ldc, c != NULL);
  }
}

/* What k_mul_mat's GEMM calls will need, made ahead: the same arguments but the number
 * of rows, which depends on the threads (the rounded copies of bf16 precision are
 * contiguous). rtp__gemm_stats counts what this missed. */
int rtp__mul_mat_plan(const struct rtp_tensor *t) {
  const struct rtp_tensor *a = t->src[0], *b = t->src[1];
  bool rounded = rtp_mul_mat_get_prec(t) == RTP_TYPE_BF16;
  int64_t K = a->ne[0];
  return rtp__gemm_plan(
      a->ne[1], K, rounded ? K : (int64_t)(b->nb[1] / 4), rounded ? 1 : (int64_t)(b->nb[0] / 4),
      rounded ? K : (int64_t)(a->nb[1] / 4), rounded ? 1 : (int64_t)(a->nb[0] / 4),
      (int64_t)(t->nb[1] / 4), rtp__addend(t) != NULL);
}

/* ---- normalisation and activations ---------------------------------------------- */

static void row_stats(const float *x, int64_t n, float eps, float *mean, float *rstd) {
  *mean = (float)(sum_f32(x, n) / (double)n);
  *rstd = (float)(1.0 / sqrt(sum_sq_dev(x, *mean, n) / (double)n + eps));
}

static void k_norm(const struct rtp_compute_params *p, struct rtp_tensor *t) {
  float eps = rtp__get_param_f32(t, 0);
  int64_t n = t->ne[0], r0, r1;
  split(rtp_tensor_nrows(t), p, &r0, &r1);
  for (int64_t r = r0; r < r1; r++) {
    const float *x = (const float *)row_ptr(t->src[0], r);
    float *y = (float *)row_ptr(t, r), mean, rstd;
    row_stats(x, n, eps, &mean, &rstd);
    for (int64_t i = 0; i < n; i++) y[i] = (x[i] - mean) * rstd;
  }
}

/* dx = rstd * (dy - mean(dy) - xhat * mean(dy * xhat)) */
static void k_norm_back(const struct rtp_compute_params *p, struct rtp_tensor *t) {
  float eps = rtp__get_param_f32(t, 0);
  int64_t n = t->ne[0], r0, r1;
  split(rtp_tensor_nrows(t), p, &r0, &r1);
  for (int64_t r = r0; r < r1; r++) {
    const float *dy = (const float *)row_ptr(t->src[0], r);
    const float *x = (const float *)row_ptr(t->src[1], r);
    float *dx = (float *)row_ptr(t, r), mean, rstd;
    row_stats(x, n, eps, &mean, &rstd);
    float m_dy = (float)(sum_f32(dy, n) / (double)n);
    float m_dyx = (float)(dot_dev(dy, x, mean, n) * rstd / (double)n);
    for (int64_t i = 0; i < n; i++)
      dx[i] = rstd * (dy[i] - m_dy - (x[i] - mean) * rstd * m_dyx);
  }
}

#define GELU_C 0.7978845608028654f /* sqrt(2 / pi) */

static void k_gelu(const struct rtp_compute_params *p, struct rtp_tensor *t) {
  const int64_t ne0 = t->ne[0];
  int64_t r0, r1;
  split(rtp_tensor_nrows(t), p, &r0, &r1);
  for (int64_t r = r0; r < r1; r++) {
    const float *x = (const float *)row_ptr(t->src[0], r);
    float *y = (float *)row_ptr(t, r);
    for (int64_t i = 0; i < ne0; i++) {
      float v = x[i];
      y[i] = 0.5f * v * (1.0f + fast_tanhf(GELU_C * (v + 0.044715f * v * v * v)));
    }
  }
}

static void k_gelu_back(const struct rtp_compute_params *p, struct rtp_tensor *t) {
  const int64_t ne0 = t->ne[0];
  int64_t r0, r1;
  split(rtp_tensor_nrows(t), p, &r0, &r1);
  for (int64_t r = r0; r < r1; r++) {
    const float *dy = (const float *)row_ptr(t->src[0], r);
    const float *x = (const float *)row_ptr(t->src[1], r);
    float *dx = (float *)row_ptr(t, r);
    for (int64_t i = 0; i < ne0; i++) {
      float v = x[i], u = GELU_C * (v + 0.044715f * v * v * v);
      float th = fast_tanhf(u), du = GELU_C * (1.0f + 3.0f * 0.044715f * v * v);
      dx[i] = dy[i] * (0.5f * (1.0f + th) + 0.5f * v * (1.0f - th * th) * du);
    }
  }
}

static void k_soft_max(const struct rtp_compute_params *p, struct rtp_tensor *t) {
  float scale = rtp__get_param_f32(t, 0);
  bool causal = t->op_params[1];
  int64_t n = t->ne[0], r0, r1;
  split(rtp_tensor_nrows(t), p, &r0, &r1);
  for (int64_t r = r0; r < r1; r++) {
    const float *x = (const float *)row_ptr(t->src[0], r);
    float *y = (float *)row_ptr(t, r);
    int64_t len = causal ? r % t->ne[1] + (n - t->ne[1]) + 1 : n;
    float mx = max_scaled(x, len, scale);
    for (int64_t i = 0; i < len; i++) y[i] = fast_expf(x[i] * scale - mx);
    float inv = (float)(1.0 / sum_f32(y, len));
    for (int64_t i = 0; i < len; i++) y[i] *= inv;
    for (int64_t i = len; i < n; i++) y[i] = 0.0f;
  }
}

/* dx = scale * y * (dy - sum(dy * y)) */
static void k_soft_max_back(const struct rtp_compute_params *p, struct rtp_tensor *t) {
  const int64_t ne0 = t->ne[0];
  float scale = rtp__get_param_f32(t, 0);
  int64_t r0, r1;
  split(rtp_tensor_nrows(t), p, &r0, &r1);
  for (int64_t r = r0; r < r1; r++) {
    const float *dy = (const float *)row_ptr(t->src[0], r);
    const float *y = (const float *)row_ptr(t->src[1], r);
    float *dx = (float *)row_ptr(t, r);
    float dot = (float)dot_dev(dy, y, 0.0f, ne0);
    for (int64_t i = 0; i < ne0; i++) dx[i] = scale * y[i] * (dy[i] - dot);
  }
}

/* ---- embeddings and loss -------------------------------------------------------- */

static bool index_ok(const struct rtp_compute_params *p, int32_t idx, int64_t n) {
  if (idx >= 0 && idx < n) return true;
  report(p, RTP_EINVAL);
  return false;
}

/* The row of a block of a table that token v names: op_params[0] is the block's first
 * row and op_params[1] says indices outside it are expected (zero rows, no error). */
static int64_t block_row(const struct rtp_compute_params *p, const struct rtp_tensor *t,
                         int32_t v, int64_t rows) {
  int64_t row = (int64_t)v - t->op_params[0];
  if (row >= 0 && row < rows) return row;
  if (!t->op_params[1] || v < 0) report(p, RTP_EINVAL);
  return -1;
}

static void k_get_rows(const struct rtp_compute_params *p, struct rtp_tensor *t) {
  const struct rtp_tensor *a = t->src[0];
  const int32_t *idx = t->src[1]->data;
  int64_t r0, r1;
  split(rtp_tensor_nrows(t), p, &r0, &r1);
  for (int64_t r = r0; r < r1; r++) {
    float *y = (float *)row_ptr(t, r);
    int64_t row = block_row(p, t, idx[r], a->ne[1]);
    if (row >= 0)
      memcpy(y, DATA(a) + row * a->nb[1], (size_t)t->ne[0] * 4);
    else
      memset(y, 0, (size_t)t->ne[0] * 4);
  }
}

/* Scatter-add; each thread owns a band of columns, so rows may repeat freely. */
static void k_get_rows_back(const struct rtp_compute_params *p, struct rtp_tensor *t) {
  const struct rtp_tensor *dy = t->src[0];
  const int32_t *idx = t->src[1]->data;
  int64_t c0, c1;
  split(t->ne[0], p, &c0, &c1);
  for (int64_t v = 0; v < t->ne[1]; v++)
    memset((float *)row_ptr(t, v) + c0, 0, (size_t)(c1 - c0) * 4);
  for (int64_t r = 0; r < rtp_tensor_nrows(dy); r++) {
    int64_t row = block_row(p, t, idx[r], t->ne[1]);
    if (row < 0) continue;
    float *y = (float *)row_ptr(t, row);
    const float *x = (const float *)row_ptr(dy, r);
    for (int64_t i = c0; i < c1; i++) y[i] += x[i];
  }
}

static double row_logsumexp(const float *x, int64_t n) {
  float mx = max_scaled(x, n, 1.0f);
  double acc[LANES] = {0}, s = 0;
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES)
    for (int l = 0; l < LANES; l++) acc[l] += fast_expf(x[i + l] - mx);
  for (; i < n; i++) s += fast_expf(x[i] - mx);
  for (int l = 0; l < LANES; l++) s += acc[l];
  return mx + log(s);
}

static void k_cross_entropy(const struct rtp_compute_params *p, struct rtp_tensor *t) {
  const struct rtp_tensor *logits = t->src[0];
  const int32_t *tgt = t->src[1]->data;
  double *part = p->work;
  int64_t r0, r1, n = rtp_tensor_nrows(logits);
  split(n, p, &r0, &r1);
  double s = 0;
  for (int64_t r = r0; r < r1; r++) {
    const float *x = (const float *)row_ptr(logits, r);
    if (index_ok(p, tgt[r], logits->ne[0])) s += row_logsumexp(x, logits->ne[0]) - x[tgt[r]];
  }
  part[p->ith] = s;
  rtp__barrier(p);
  if (p->ith == 0) {
    double total = 0;
    for (int i = 0; i < p->nth; i++) total += part[i];
    *(float *)t->data = (float)(total / (double)(n ? n : 1));
  }
}

/* d logits = (softmax - onehot) * dloss / rows */
static void k_cross_entropy_back(const struct rtp_compute_params *p, struct rtp_tensor *t) {
  const struct rtp_tensor *logits = t->src[1];
  const int32_t *tgt = t->src[2]->data;
  int64_t n = rtp_tensor_nrows(logits), V = logits->ne[0], r0, r1;
  float g = *(const float *)t->src[0]->data / (float)(n ? n : 1);
  split(n, p, &r0, &r1);
  for (int64_t r = r0; r < r1; r++) {
    const float *x = (const float *)row_ptr(logits, r);
    float *dx = (float *)row_ptr(t, r);
    float lse = (float)row_logsumexp(x, V);
    for (int64_t i = 0; i < V; i++) dx[i] = fast_expf(x[i] - lse) * g;
    if (index_ok(p, tgt[r], V)) dx[tgt[r]] -= g;
  }
}

/* ---- blocks of tensors ---------------------------------------------------------- */

/* t = base (or zeros), then src[0] added into the view (nb, offset) of t. */
static void k_acc(const struct rtp_compute_params *p, struct rtp_tensor *t) {
  const struct rtp_tensor *b = t->src[0], *base = t->src[1];
  const int64_t ne0 = b->ne[0];
  size_t bytes = rtp_tensor_nbytes(t), c0 = bytes * p->ith / p->nth / 4 * 4;
  size_t c1 = p->ith == p->nth - 1 ? bytes : bytes * (p->ith + 1) / p->nth / 4 * 4;
  if (!base)
    memset(DATA(t) + c0, 0, c1 - c0);
  else if (base->data != t->data) /* else the planner put t in base's memory */
    memcpy(DATA(t) + c0, DATA(base) + c0, c1 - c0);
  rtp__barrier(p);
  size_t nb1 = rtp__get_param_u64(t, 0), nb2 = rtp__get_param_u64(t, 2);
  size_t nb3 = rtp__get_param_u64(t, 4), offs = rtp__get_param_u64(t, 6);
  int64_t r0, r1;
  split(rtp_tensor_nrows(b), p, &r0, &r1);
  for (int64_t r = r0; r < r1; r++) {
    int64_t i1 = r % b->ne[1], i2 = r / b->ne[1] % b->ne[2], i3 = r / b->ne[1] / b->ne[2];
    float *y = (float *)(DATA(t) + offs + i1 * nb1 + i2 * nb2 + i3 * nb3);
    const float *x = (const float *)row_ptr(b, r);
    for (int64_t i = 0; i < ne0; i++) y[i] += x[i];
  }
}

/* Row r of t comes from a's row or b's (dim > 0), or is a's row then b's (dim 0). */
static void k_concat(const struct rtp_compute_params *p, struct rtp_tensor *t) {
  const struct rtp_tensor *a = t->src[0], *b = t->src[1];
  int dim = t->op_params[0];
  size_t size = rtp_type_size(t->type);
  int64_t r0, r1;
  split(rtp_tensor_nrows(t), p, &r0, &r1);
  for (int64_t r = r0; r < r1; r++) {
    int64_t idx[4] = {0, r % t->ne[1], r / t->ne[1] % t->ne[2], r / t->ne[1] / t->ne[2]};
    char *y = row_ptr(t, r);
    if (dim == 0) {
      copy_row(y, row_ptr(a, r), a->nb[0], a->ne[0], size);
      copy_row(y + (size_t)a->ne[0] * size, row_ptr(b, r), b->nb[0], b->ne[0], size);
      continue;
    }
    const struct rtp_tensor *s = idx[dim] < a->ne[dim] ? a : b;
    if (s == b) idx[dim] -= a->ne[dim];
    copy_row(y, DATA(s) + idx[1] * s->nb[1] + idx[2] * s->nb[2] + idx[3] * s->nb[3], s->nb[0],
             t->ne[0], size);
  }
}

/* ---- dispatch ------------------------------------------------------------------- */

size_t rtp__op_work_size(const struct rtp_tensor *t) {
  switch (t->op) {
    case RTP_OP_SUM:
    case RTP_OP_CROSS_ENTROPY:
    case RTP_OP_ADAMW:
      return RTP_MAX_THREADS * sizeof(double);
    case RTP_OP_ATTENTION:
    case RTP_OP_ATTENTION_BACK:
      return rtp__attention_work_size(t);
    case RTP_OP_MUL_MAT:
      return rtp_mul_mat_get_prec(t) == RTP_TYPE_BF16
                 ? rounded_bytes(t->src[0]) + rounded_bytes(t->src[1])
                 : 0;
    default:
      return 0;
  }
}

void rtp__compute_forward(const struct rtp_compute_params *p, struct rtp_tensor *t) {
  switch (t->op) {
    case RTP_OP_DUP:
      k_dup(p, t);
      break;
    case RTP_OP_ADD:
    case RTP_OP_SUB:
    case RTP_OP_MUL:
      k_binary(p, t);
      break;
    case RTP_OP_SCALE:
      k_scale(p, t);
      break;
    case RTP_OP_SUM:
      k_sum(p, t);
      break;
    case RTP_OP_REPEAT:
      k_repeat(p, t);
      break;
    case RTP_OP_REPEAT_BACK:
      k_repeat_back(p, t);
      break;
    case RTP_OP_MUL_MAT:
      k_mul_mat(p, t);
      break;
    case RTP_OP_NORM:
      k_norm(p, t);
      break;
    case RTP_OP_NORM_BACK:
      k_norm_back(p, t);
      break;
    case RTP_OP_GELU:
      k_gelu(p, t);
      break;
    case RTP_OP_GELU_BACK:
      k_gelu_back(p, t);
      break;
    case RTP_OP_SOFT_MAX:
      k_soft_max(p, t);
      break;
    case RTP_OP_SOFT_MAX_BACK:
      k_soft_max_back(p, t);
      break;
    case RTP_OP_ATTENTION:
      rtp__k_attention(p, t);
      break;
    case RTP_OP_ATTENTION_DELTA:
      rtp__k_attention_delta(p, t);
      break;
    case RTP_OP_ATTENTION_BACK:
      rtp__k_attention_back(p, t);
      break;
    case RTP_OP_GET_ROWS:
      k_get_rows(p, t);
      break;
    case RTP_OP_GET_ROWS_BACK:
      k_get_rows_back(p, t);
      break;
    case RTP_OP_CROSS_ENTROPY:
      k_cross_entropy(p, t);
      break;
    case RTP_OP_CROSS_ENTROPY_BACK:
      k_cross_entropy_back(p, t);
      break;
    case RTP_OP_ACC:
      k_acc(p, t);
      break;
    case RTP_OP_CONCAT:
      k_concat(p, t);
      break;
    case RTP_OP_CAST:
      k_cast(p, t);
      break;
    case RTP_OP_ADAMW:
      rtp__k_adamw(p, t);
      break;
    default:
      break; /* views and leafs compute nothing */
  }
}
