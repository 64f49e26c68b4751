/* rtp-cpu-attn.c - the CPU kernels of fused causal attention (rtp_attention_causal):
 * forward over blocks of keys with an online softmax, the rows' dO . O, and backward,
 * which recomputes each block's probabilities from its rows' log-sum-exp. Threads take
 * whole (sequence, head) pairs, so no two threads write the same element and the sums run
 * in the same order for any thread count. docs/attention.md. */
#include "rtp-impl.h"
#include "rtp-cpu-math.h"

#include <math.h>
#include <string.h>

/* Query and key rows per block: a block's scores and the key and value blocks stay in L1
 * and L2 (hd = 64: 4 KiB of scores, 8 KiB per block of keys). */
enum { BLK = 32 };

static int64_t min64(int64_t a, int64_t b) {
  return a < b ? a : b;
}

/* ---- one block product ------------------------------------------------------------ */

/* Eight floats as one vector value (GCC and Clang's vector extension, no intrinsics: AVX
 * with -march=native, pairs of SSE registers without it). Locals of this type stay in
 * registers, where arrays of floats would be stored back to memory at every step. */
typedef float v8f __attribute__((vector_size(32)));
/* Without AVX (RTP_NATIVE=OFF) GCC warns that such values change the calling convention;
 * every function here is static, so no call crosses an ABI boundary. */
#pragma GCC diagnostic ignored "-Wpsabi"

static inline v8f load8(const float *p) {
  v8f v;
  memcpy(&v, p, sizeof(v));
  return v;
}

static inline void store8(float *p, v8f v) {
  memcpy(p, &v, sizeof(v));
}

/* Rows 0..3 of C (+)= A . B, where A(i, p) = a[i am + p ak] and B's rows of n floats lie
 * ldb apart. Columns in chunks of 16: the 4 x 16 partial sums stay in registers over the
 * whole sum, and each step loads a chunk of B's row once for the four rows. */
static void mm_rows4(int64_t n, int64_t k, const float *a, int64_t am, int64_t ak,
                     const float *b, int64_t ldb, float *c, int64_t ldc, bool acc) {
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    v8f z = {0}, c00 = z, c01 = z, c10 = z, c11 = z, c20 = z, c21 = z, c30 = z, c31 = z;
    if (acc) {
      c00 = load8(c + j), c01 = load8(c + j + 8);
      c10 = load8(c + ldc + j), c11 = load8(c + ldc + j + 8);
      c20 = load8(c + 2 * ldc + j), c21 = load8(c + 2 * ldc + j + 8);
      c30 = load8(c + 3 * ldc + j), c31 = load8(c + 3 * ldc + j + 8);
    }
    for (int64_t p = 0; p < k; p++) {
      v8f b0 = load8(b + p * ldb + j), b1 = load8(b + p * ldb + j + 8);
      v8f a0 = z + a[p * ak], a1 = z + a[am + p * ak], a2 = z + a[2 * am + p * ak],
          a3 = z + a[3 * am + p * ak];
      c00 += a0 * b0, c01 += a0 * b1;
      c10 += a1 * b0, c11 += a1 * b1;
      c20 += a2 * b0, c21 += a2 * b1;
      c30 += a3 * b0, c31 += a3 * b1;
    }
    store8(c + j, c00), store8(c + j + 8, c01);
    store8(c + ldc + j, c10), store8(c + ldc + j + 8, c11);
    store8(c + 2 * ldc + j, c20), store8(c + 2 * ldc + j + 8, c21);
    store8(c + 3 * ldc + j, c30), store8(c + 3 * ldc + j + 8, c31);
  }
  for (; j < n; j++)
    for (int r = 0; r < 4; r++) {
      float s = acc ? c[r * ldc + j] : 0.0f;
      for (int64_t p = 0; p < k; p++) s += a[r * am + p * ak] * b[p * ldb + j];
      c[r * ldc + j] = s;
    }
}

static void mm_row1(int64_t n, int64_t k, const float *a, int64_t ak, const float *b,
                    int64_t ldb, float *c, bool acc) {
  if (!acc) memset(c, 0, (size_t)n * sizeof(float));
  for (int64_t p = 0; p < k; p++) {
    const float *bp = b + p * ldb;
    float x = a[p * ak];
    for (int64_t j = 0; j < n; j++) c[j] += x * bp[j];
  }
}

/* C{m x n} (+)= A{m x k} . B{k x n}, f32; A(i, p) = a[i am + p ak] (either stride may be
 * 1: A is read one element at a time), B row-major with leading dimension ldb. */
static void mm(int64_t m, int64_t n, int64_t k, const float *a, int64_t am, int64_t ak,
               const float *b, int64_t ldb, float *c, int64_t ldc, bool acc) {
  int64_t i = 0;
  for (; i + 4 <= m; i += 4) mm_rows4(n, k, a + i * am, am, ak, b, ldb, c + i * ldc, ldc, acc);
  for (; i < m; i++) mm_row1(n, k, a + i * am, ak, b, ldb, c + i * ldc, acc);
}

/* dst{hd x n} (leading dimension BLK) = the n rows of hd floats at src, ld apart,
 * transposed: the keys (or values) of a block as columns, for products over hd. */
static void transpose_block(float *dst, const float *src, int64_t ld, int64_t n, int64_t hd) {
  for (int64_t c = 0; c < n; c++)
    for (int64_t e = 0; e < hd; e++) dst[e * BLK + c] = src[c * ld + e];
}

/* ---- geometry --------------------------------------------------------------------- */

/* One (sequence, head): its rows of q, k and v in qkv, and where its results go. */
struct head {
  const float *q, *k, *v;
  int64_t ld; /* qkv's row stride, in floats */
  int64_t T, hd;
  float *lse, *delta; /* T floats each in the statistics */
};

static struct head head_of(const struct rtp_tensor *qkv, const struct rtp_tensor *stats,
                           int n_head, int64_t item) {
  int64_t H = n_head, d = qkv->ne[0] / 3, hd = d / H, T = qkv->ne[1];
  int64_t b = item / H, h = item % H;
  const float *base = (const float *)((const char *)qkv->data + b * qkv->nb[2]) + h * hd;
  /* stats {T, H, B, 2}: the log-sum-exps, then (from backward's delta node) dO . O */
  float *lse = (float *)stats->data + item * T, *delta = lse + rtp_tensor_nelements(stats) / 2;
  return (struct head){base, base + d, base + 2 * d, (int64_t)(qkv->nb[1] / sizeof(float)),
                       T,    hd,       lse,          delta};
}

/* The scratch one thread needs: key and value blocks transposed, two blocks of scores and
 * two accumulators of a block's rows. */
static size_t thread_bytes(int64_t hd) {
  return RTP_PAD((size_t)(4 * hd * BLK + 2 * BLK * BLK) * sizeof(float), RTP_ALIGN);
}

size_t rtp__attention_work_size(const struct rtp_tensor *t) {
  const struct rtp_tensor *qkv = t->src[t->op == RTP_OP_ATTENTION ? 0 : 1];
  int64_t H = t->op_params[1], items = qkv->ne[2] * H;
  int64_t slots = items < RTP_MAX_THREADS ? items : RTP_MAX_THREADS;
  return (size_t)slots * thread_bytes(qkv->ne[0] / 3 / H);
}

/* The scratch of a thread whose items start at r0. There is room for min(items,
 * RTP_MAX_THREADS) threads: with fewer items than threads, the threads that have any have
 * distinct first items below `items`; else every thread has some and ith < slots. */
static float *thread_work(const struct rtp_compute_params *p, int64_t items, int64_t r0,
                          int64_t hd) {
  int64_t slot = items < p->nth ? r0 : p->ith;
  return (float *)((char *)p->work + (size_t)slot * thread_bytes(hd));
}

/* ---- forward ---------------------------------------------------------------------- */

/* Folds a block of scores into the running max m, sum l and output accumulator acc of
 * the block's query rows. st holds the scores transposed (key c, query r at c BLK + r), so
 * every loop runs over the queries, contiguous, and vectorises; key j0 + c is masked for
 * the rows before i0 + r = j0 + c. st becomes the probabilities relative to the new max
 * (0 where masked), acc and l are rescaled to it. Every row keeps at least key j0 (key
 * blocks start at or below the query block), so the new max is finite. */
static void online_block(float *st, int64_t i0, int64_t mr, int64_t j0, int64_t nc, float scale,
                         float *m, float *l, float *acc, int64_t hd) {
  float mx[BLK], sum[BLK];
  for (int64_t r = 0; r < mr; r++) mx[r] = m[r], sum[r] = 0.0f;
  for (int64_t c = 0; c < nc; c++) {
    float *x = st + c * BLK;
    int64_t first = j0 + c - i0 > 0 ? j0 + c - i0 : 0; /* the first row that sees key c */
    for (int64_t r = 0; r < mr; r++) x[r] *= scale;
    for (int64_t r = first; r < mr; r++) mx[r] = x[r] > mx[r] ? x[r] : mx[r];
  }
  for (int64_t c = 0; c < nc; c++) {
    float *x = st + c * BLK;
    int64_t first = j0 + c - i0 > 0 ? min64(j0 + c - i0, mr) : 0;
    for (int64_t r = 0; r < first; r++) x[r] = 0.0f;
    for (int64_t r = first; r < mr; r++) x[r] = fast_expf(x[r] - mx[r]);
    for (int64_t r = 0; r < mr; r++) sum[r] += x[r];
  }
  for (int64_t r = 0; r < mr; r++) {
    float alpha = expf(m[r] - mx[r]); /* 0 for the first block (m = -inf) */
    l[r] = l[r] * alpha + sum[r];
    m[r] = mx[r];
    if (alpha != 1.0f)
      for (int64_t e = 0; e < hd; e++) acc[r * hd + e] *= alpha;
  }
}

/* One (sequence, head): per block of queries (transposed once), the key blocks up to the
 * diagonal; scores are computed transposed, S^T = K Q^T, so that the softmax runs along
 * contiguous queries and P V reads P^T as it lies. */
static void forward_head(const struct head *hp, float *o, int64_t ldo, float scale,
                         float *work) {
  const int64_t T = hp->T, hd = hp->hd, ld = hp->ld;
  float *qt = work, *st = qt + hd * BLK, *acc = st + BLK * BLK, m[BLK], l[BLK];
  for (int64_t i0 = 0; i0 < T; i0 += BLK) {
    int64_t mr = min64(BLK, T - i0);
    transpose_block(qt, hp->q + i0 * ld, ld, mr, hd);
    memset(acc, 0, (size_t)(mr * hd) * sizeof(float));
    for (int64_t r = 0; r < mr; r++) m[r] = -INFINITY, l[r] = 0.0f;
    for (int64_t j0 = 0; j0 < i0 + mr; j0 += BLK) { /* blocks above the diagonal: none */
      int64_t nc = min64(BLK, i0 + mr - j0);
      mm(nc, mr, hd, hp->k + j0 * ld, ld, 1, qt, BLK, st, BLK, false);
      online_block(st, i0, mr, j0, nc, scale, m, l, acc, hd);
      mm(mr, hd, nc, st, 1, BLK, hp->v + j0 * ld, ld, acc, hd, true);
    }
    for (int64_t r = 0; r < mr; r++) {
      float inv = 1.0f / l[r], *y = o + (i0 + r) * ldo;
      const float *x = acc + r * hd;
      for (int64_t e = 0; e < hd; e++) y[e] = x[e] * inv;
      hp->lse[i0 + r] = m[r] + logf(l[r]);
    }
  }
}

/* t{d, T, B} from qkv (src[0]); each row's log-sum-exp into the statistics (src[1]). */
void rtp__k_attention(const struct rtp_compute_params *p, struct rtp_tensor *t) {
  const struct rtp_tensor *qkv = t->src[0];
  int H = t->op_params[1];
  float scale = rtp__get_param_f32(t, 0);
  int64_t items = qkv->ne[2] * H, r0, r1, hd = t->ne[0] / H, ldo = t->nb[1] / sizeof(float);
  r0 = items * p->ith / p->nth;
  r1 = items * (p->ith + 1) / p->nth;
  float *work = thread_work(p, items, r0, hd);
  for (int64_t it = r0; it < r1; it++) {
    struct head hp = head_of(qkv, t->src[1], H, it);
    float *o = (float *)((char *)t->data + it / H * t->nb[2]) + it % H * hd;
    forward_head(&hp, o, ldo, scale, work);
  }
}

/* ---- backward --------------------------------------------------------------------- */

/* t (the statistics' second half): per (sequence, head, row) sum(dO . O), what every
 * probability's gradient subtracts (src[0] dO, src[1] O, both {d, T, B} contiguous). */
void rtp__k_attention_delta(const struct rtp_compute_params *p, struct rtp_tensor *t) {
  const float *dy = t->src[0]->data, *y = t->src[1]->data;
  int64_t T = t->ne[0], H = t->ne[1], d = t->src[1]->ne[0], hd = d / H;
  int64_t rows = t->src[1]->ne[1] * t->src[1]->ne[2], r0, r1;
  float *delta = t->data;
  r0 = rows * p->ith / p->nth;
  r1 = rows * (p->ith + 1) / p->nth;
  for (int64_t r = r0; r < r1; r++)
    for (int64_t h = 0; h < H; h++) {
      const float *a = dy + r * d + h * hd, *b = y + r * d + h * hd;
      double s = 0;
      for (int64_t e = 0; e < hd; e++) s += (double)(a[e] * b[e]);
      delta[(r / T * H + h) * T + r % T] = (float)s;
    }
}

/* Zeroes the T rows of hd floats at x, ld apart. */
static void zero_rows(float *x, int64_t ld, int64_t T, int64_t hd) {
  for (int64_t i = 0; i < T; i++) memset(x + i * ld, 0, (size_t)hd * sizeof(float));
}

/* Scores of a block turned into probabilities from the rows' log-sum-exp (0 above the
 * diagonal). */
static void block_probs(float *s, int64_t i0, int64_t mr, int64_t j0, int64_t nc, float scale,
                        const float *lse) {
  for (int64_t r = 0; r < mr; r++) {
    float *x = s + r * BLK, z = lse[i0 + r];
    int64_t len = min64(i0 + r - j0 + 1, nc);
    len = len < 0 ? 0 : len;
    for (int64_t c = 0; c < len; c++) x[c] = fast_expf(x[c] * scale - z);
    for (int64_t c = len; c < nc; c++) x[c] = 0.0f;
  }
}

/* One (sequence, head): per block of keys, every query block from the diagonal down:
 * S, P, dV += P^T dO, dP = dO V^T, dS = P (dP - delta) scale, dQ += dS K, dK += dS^T Q.
 * dK and dV of the key block sum in scratch; dQ sums where it lies. */
static void backward_head(const struct head *hp, const float *dy, int64_t ldy, float *dq,
                          int64_t ldg, float scale, float *work) {
  const int64_t T = hp->T, hd = hp->hd, ld = hp->ld;
  float *kt = work, *vt = kt + hd * BLK, *ps = vt + hd * BLK, *ds = ps + BLK * BLK;
  float *dka = ds + BLK * BLK, *dva = dka + BLK * hd;
  zero_rows(dq, ldg, T, hd);
  for (int64_t j0 = 0; j0 < T; j0 += BLK) {
    int64_t nc = min64(BLK, T - j0);
    transpose_block(kt, hp->k + j0 * ld, ld, nc, hd);
    transpose_block(vt, hp->v + j0 * ld, ld, nc, hd);
    memset(dka, 0, (size_t)(2 * BLK * hd) * sizeof(float)); /* dka and dva */
    for (int64_t i0 = j0; i0 < T; i0 += BLK) {
      int64_t mr = min64(BLK, T - i0);
      const float *q = hp->q + i0 * ld, *g = dy + i0 * ldy;
      mm(mr, nc, hd, q, ld, 1, kt, BLK, ps, BLK, false);
      block_probs(ps, i0, mr, j0, nc, scale, hp->lse);
      mm(nc, hd, mr, ps, 1, BLK, g, ldy, dva, hd, true);
      mm(mr, nc, hd, g, ldy, 1, vt, BLK, ds, BLK, false);
      for (int64_t r = 0; r < mr; r++) {
        float dl = hp->delta[i0 + r], *x = ds + r * BLK;
        const float *pr = ps + r * BLK;
        for (int64_t c = 0; c < nc; c++) x[c] = pr[c] * (x[c] - dl) * scale;
      }
      mm(mr, hd, nc, ds, BLK, 1, hp->k + j0 * ld, ld, dq + i0 * ldg, ldg, true);
      mm(nc, hd, mr, ds, 1, BLK, q, ld, dka, hd, true);
    }
    /* dk and dv of the head lie where k and v lie in qkv, at the gradient's strides */
    float *dk = dq + (hp->k - hp->q) + j0 * ldg, *dv = dq + (hp->v - hp->q) + j0 * ldg;
    for (int64_t c = 0; c < nc; c++) {
      memcpy(dk + c * ldg, dka + c * hd, (size_t)hd * sizeof(float));
      memcpy(dv + c * ldg, dva + c * hd, (size_t)hd * sizeof(float));
    }
  }
}

/* t = d qkv {3d, T, B}, contiguous, from dO (src[0], contiguous), qkv (src[1]) and the
 * statistics, whose second half src[2] is (the view computed by attention_delta). */
void rtp__k_attention_back(const struct rtp_compute_params *p, struct rtp_tensor *t) {
  const struct rtp_tensor *dy = t->src[0], *qkv = t->src[1], *stats = t->src[2]->view_src;
  int H = t->op_params[1];
  float scale = rtp__get_param_f32(t, 0);
  int64_t items = qkv->ne[2] * H, r0, r1, hd = qkv->ne[0] / 3 / H;
  int64_t ldy = dy->nb[1] / sizeof(float), ldg = t->nb[1] / sizeof(float);
  r0 = items * p->ith / p->nth;
  r1 = items * (p->ith + 1) / p->nth;
  float *work = thread_work(p, items, r0, hd);
  for (int64_t it = r0; it < r1; it++) {
    struct head hp = head_of(qkv, stats, H, it);
    const float *g = (const float *)((const char *)dy->data + it / H * dy->nb[2]) + it % H * hd;
    float *dq = (float *)((char *)t->data + it / H * t->nb[2]) + it % H * hd;
    backward_head(&hp, g, ldy, dq, ldg, scale, work);
  }
}
