/* rtp-cuda-kernels.cu - the CUDA backend's kernels, one per op (GEMM through cuBLAS), and
 * the interface's functions that launch them: compute, work_size, adam and sumsq. The rest
 * of the backend (memory, streams, events, errors) is rtp-cuda.cu.
 *
 * Semantics are rtp-cpu.c's, op for op: the same op_params, broadcasts, strides (every
 * kernel follows nb[], so views and results written into a block of a larger tensor work),
 * the same in-place cases (dst may be src[0] of the elementwise and row-wise ops, src[1] of
 * acc: each element or row is read before it is written), and the same out-of-range index
 * rules. Arithmetic is f32 (cuBLAS in its default math mode, which never uses TF32); bf16
 * is only copied, cast and transferred, as on the CPU, but for the operands of products of
 * bf16 precision (rtp_mul_mat_set_prec): cast to bf16 copies in scratch, which
 * cublasGemmEx multiplies on tensor cores with f32 sums, to f32 results.
 *
 * Results are reproducible run to run: no float atomics where order matters (scatter-adds
 * are one block per output row scanning the indices in order), and reductions have a
 * fixed shape that depends on the tensor's size only, never on the device.
 *
 * Kernels that meet a bad index set a flag in device memory that sync (rtp-cuda.cu) reads:
 * the host never waits inside compute. */
#include <cstdint>
#include <cstdio>

#include "rtp-cuda.h"

namespace rtp_cuda {
namespace {

enum {
  kThreads = 256,     /* per block, everywhere */
  kMaxGrid = 1 << 20, /* blocks; kernels loop past it */
  kChunk = 1024,      /* indices get_rows_back scans per round */
};

const size_t kWorkAlign = 256;

/* ---- tensors as kernels see them ------------------------------------------------------
 * Strides in elements of the tensor's type, so kernels index typed pointers. */

struct tview {
  void *data;
  int64_t ne[4];
  int64_t nb[4];
};

__device__ __forceinline__ int64_t nrows_of(const tview &t) {
  return t.ne[1] * t.ne[2] * t.ne[3];
}

/* Offset of row r (rows are indexed over dims 1..3, as rtp-cpu.c's row_ptr). */
__device__ __forceinline__ int64_t row_off(const tview &t, int64_t r) {
  int64_t i1 = r % t.ne[1], q = r / t.ne[1];
  return i1 * t.nb[1] + q % t.ne[2] * t.nb[2] + q / t.ne[2] * t.nb[3];
}

/* Offset of the row of b that broadcasts to row r of shape ne (bcast_row_ptr). */
__device__ __forceinline__ int64_t bcast_row_off(const tview &b, const int64_t *ne, int64_t r) {
  int64_t i1 = r % ne[1], q = r / ne[1], i2 = q % ne[2], i3 = q / ne[2];
  return i1 % b.ne[1] * b.nb[1] + i2 % b.ne[2] * b.nb[2] + i3 % b.ne[3] * b.nb[3];
}

__device__ __forceinline__ float *frow(const tview &t, int64_t r) {
  return (float *)t.data + row_off(t, r);
}

/* Row loops of the elementwise kernels: a block is (tx, ty) threads, ty rows at a time, tx
 * threads along each row. The first row of this thread and the step between its rows: */
__device__ __forceinline__ int64_t row0_2d() {
  return (int64_t)blockIdx.x * blockDim.y + threadIdx.y;
}
__device__ __forceinline__ int64_t rowstep_2d() {
  return (int64_t)gridDim.x * blockDim.y;
}

/* Records the first op that met a bad index; sync reports it. */
__device__ __forceinline__ void flag_error(int *err, int op) {
  atomicCAS(err, 0, op);
}

/* ---- block reductions ----------------------------------------------------------------
 * Every thread of the block gets the same total: a butterfly within warps (a + b and b + a
 * are the same float, so all lanes agree bit for bit), then across warps. The shape of the
 * tree depends on the block size only, so results do not depend on scheduling. */

struct sum_op {
  template <class T>
  __device__ T operator()(T a, T b) const {
    return a + b;
  }
};
struct max_op {
  __device__ float operator()(float a, float b) const {
    return fmaxf(a, b);
  }
};

template <class T, class Op>
__device__ T block_reduce(T v, Op op, T identity) {
  __shared__ T part[32];
  const int tid = threadIdx.x + threadIdx.y * blockDim.x;
  const int nthreads = blockDim.x * blockDim.y; /* a multiple of 32 */
  const int lane = tid & 31, warp = tid >> 5;
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads(); /* the previous call's readers are done with part */
  if (lane == 0) part[warp] = v;
  __syncthreads();
  v = lane < nthreads / 32 ? part[lane] : identity;
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

template <class T>
__device__ T block_sum(T v) {
  return block_reduce(v, sum_op(), (T)0);
}

__device__ float block_max(float v) {
  return block_reduce(v, max_op(), -INFINITY);
}

/* ---- copies and elementwise ---------------------------------------------------------- */

/* E: an unsigned integer of the element's size; bits are copied. */
template <class E>
__global__ void k_dup(tview t, tview a) {
  const int64_t rows = nrows_of(t), n = t.ne[0];
  for (int64_t r = row0_2d(); r < rows; r += rowstep_2d()) {
    E *y = (E *)t.data + row_off(t, r);
    const E *x = (const E *)a.data + row_off(a, r);
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) y[i * t.nb[0]] = x[i * a.nb[0]];
  }
}

/* rtp-cpu.c's f32_to_bf16, bit for bit: round to nearest even by adding 0x7fff plus the
 * lowest kept bit; NaNs keep their top half with the quiet bit set. */
__device__ __forceinline__ uint16_t to_bf16(float f) {
  uint32_t u = __float_as_uint(f);
  uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : rounded);
}

__global__ void k_cast_to_bf16(tview t, tview a) {
  const int64_t rows = nrows_of(t), n = t.ne[0];
  for (int64_t r = row0_2d(); r < rows; r += rowstep_2d()) {
    uint16_t *y = (uint16_t *)t.data + row_off(t, r);
    const float *x = frow(a, r);
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
      y[i * t.nb[0]] = to_bf16(x[i * a.nb[0]]);
  }
}

/* A packed f32 tensor into bf16 four elements at a time (16-byte loads, 8-byte stores), with
 * to_bf16's rounding: the same bits as k_cast_to_bf16, at memory speed for the large
 * operands (attention's probabilities, the logits' gradient), which its 2-byte stores and
 * per-row index arithmetic left at about a third of it. */
__global__ void k_cast_to_bf16_x4(uint2 *y, const float4 *x, int64_t n4) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n4;
       i += (int64_t)gridDim.x * blockDim.x) {
    float4 v = x[i];
    uint2 o; /* element 0 in the low half: little-endian, as the f32 it came from */
    o.x = (uint32_t)to_bf16(v.x) | (uint32_t)to_bf16(v.y) << 16;
    o.y = (uint32_t)to_bf16(v.z) | (uint32_t)to_bf16(v.w) << 16;
    y[i] = o;
  }
}

/* bf16 is the top half of an f32: exact. */
__global__ void k_cast_to_f32(tview t, tview a) {
  const int64_t rows = nrows_of(t), n = t.ne[0];
  for (int64_t r = row0_2d(); r < rows; r += rowstep_2d()) {
    float *y = frow(t, r);
    const uint16_t *x = (const uint16_t *)a.data + row_off(a, r);
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
      y[i * t.nb[0]] = __uint_as_float((uint32_t)x[i * a.nb[0]] << 16);
  }
}

__global__ void k_fill(tview t, float v) {
  const int64_t rows = nrows_of(t), n = t.ne[0];
  for (int64_t r = row0_2d(); r < rows; r += rowstep_2d()) {
    float *y = frow(t, r);
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) y[i * t.nb[0]] = v;
  }
}

/* y may be x (in place): each element is read before it is written, by the same thread. */
template <enum rtp_op OP>
__global__ void k_binary(tview t, tview a, tview b) {
  const int64_t rows = nrows_of(t), n = t.ne[0];
  const bool full = b.ne[0] == n;
  for (int64_t r = row0_2d(); r < rows; r += rowstep_2d()) {
    float *y = frow(t, r);
    const float *x = frow(a, r);
    const float *z = (const float *)b.data + bcast_row_off(b, t.ne, r);
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      float xv = x[i * a.nb[0]], zv = z[full ? i * b.nb[0] : 0];
      y[i * t.nb[0]] = OP == RTP_OP_ADD ? xv + zv : OP == RTP_OP_SUB ? xv - zv : xv * zv;
    }
  }
}

__global__ void k_scale(tview t, tview a, float s) {
  const int64_t rows = nrows_of(t), n = t.ne[0];
  for (int64_t r = row0_2d(); r < rows; r += rowstep_2d()) {
    float *y = frow(t, r);
    const float *x = frow(a, r);
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) y[i * t.nb[0]] = x[i * a.nb[0]] * s;
  }
}

__global__ void k_repeat(tview t, tview a) {
  const int64_t rows = nrows_of(t), n = t.ne[0];
  const bool full = a.ne[0] == n;
  for (int64_t r = row0_2d(); r < rows; r += rowstep_2d()) {
    float *y = frow(t, r);
    const float *x = (const float *)a.data + bcast_row_off(a, t.ne, r);
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
      y[i * t.nb[0]] = x[full ? i * a.nb[0] : 0];
  }
}

#define RTP_GELU_C 0.7978845608028654f /* sqrt(2 / pi) */

__global__ void k_gelu(tview t, tview a) {
  const int64_t rows = nrows_of(t), n = t.ne[0];
  for (int64_t r = row0_2d(); r < rows; r += rowstep_2d()) {
    float *y = frow(t, r);
    const float *x = frow(a, r);
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      float v = x[i * a.nb[0]];
      y[i * t.nb[0]] = 0.5f * v * (1.0f + tanhf(RTP_GELU_C * (v + 0.044715f * v * v * v)));
    }
  }
}

__global__ void k_gelu_back(tview t, tview dy, tview a) {
  const int64_t rows = nrows_of(t), n = t.ne[0];
  for (int64_t r = row0_2d(); r < rows; r += rowstep_2d()) {
    float *dx = frow(t, r);
    const float *g = frow(dy, r), *x = frow(a, r);
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      float v = x[i * a.nb[0]], u = RTP_GELU_C * (v + 0.044715f * v * v * v);
      float th = tanhf(u), du = RTP_GELU_C * (1.0f + 3.0f * 0.044715f * v * v);
      dx[i * t.nb[0]] =
          g[i * dy.nb[0]] * (0.5f * (1.0f + th) + 0.5f * v * (1.0f - th * th) * du);
    }
  }
}

/* Row r of t is a's row then b's (dim 0), or a's or b's row (a_ext: a's size along dim,
 * which the other dims share with t). */
template <class E>
__global__ void k_concat(tview t, tview a, tview b, int dim, int64_t a_ext) {
  const int64_t rows = nrows_of(t), n = t.ne[0];
  for (int64_t r = row0_2d(); r < rows; r += rowstep_2d()) {
    E *y = (E *)t.data + row_off(t, r);
    if (dim == 0) {
      const E *xa = (const E *)a.data + row_off(a, r);
      const E *xb = (const E *)b.data + row_off(b, r);
      for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
        y[i * t.nb[0]] = i < a_ext ? xa[i * a.nb[0]] : xb[(i - a_ext) * b.nb[0]];
      continue;
    }
    int64_t i1 = r % t.ne[1], i2 = r / t.ne[1] % t.ne[2], i3 = r / t.ne[1] / t.ne[2];
    const bool from_a = (dim == 1 ? i1 : dim == 2 ? i2 : i3) < a_ext;
    const int64_t shift = from_a ? 0 : a_ext;
    i1 -= dim == 1 ? shift : 0;
    i2 -= dim == 2 ? shift : 0;
    i3 -= dim == 3 ? shift : 0;
    const E *x = from_a ? (const E *)a.data + i1 * a.nb[1] + i2 * a.nb[2] + i3 * a.nb[3]
                        : (const E *)b.data + i1 * b.nb[1] + i2 * b.nb[2] + i3 * b.nb[3];
    const int64_t xs = from_a ? a.nb[0] : b.nb[0];
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) y[i * t.nb[0]] = x[i * xs];
  }
}

/* b added into the view (nb1, nb2, nb3, offs: elements) of the flat memory of t. Atomic
 * because a view may map several elements of b to one of t (a stride of 0); when it does
 * not, each element gets one addition and the result is exact and reproducible. */
__global__ void k_acc_add(float *t, tview b, int64_t nb1, int64_t nb2, int64_t nb3,
                          int64_t offs) {
  const int64_t rows = nrows_of(b), n = b.ne[0];
  for (int64_t r = row0_2d(); r < rows; r += rowstep_2d()) {
    int64_t i1 = r % b.ne[1], i2 = r / b.ne[1] % b.ne[2], i3 = r / b.ne[1] / b.ne[2];
    float *y = t + offs + i1 * nb1 + i2 * nb2 + i3 * nb3;
    const float *x = frow(b, r);
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) atomicAdd(&y[i], x[i * b.nb[0]]);
  }
}

/* ---- embeddings -------------------------------------------------------------------------
 * first / block: rtp__get_rows_block's op_params. Index v names row v - first of a; rows
 * outside [0, rows) are zero, and an error unless the op is a block and v >= 0. */

__device__ __forceinline__ bool index_bad(int64_t v, int64_t row, int64_t rows, bool block) {
  return !(row >= 0 && row < rows) && (!block || v < 0);
}

__global__ void k_get_rows(tview t, tview a, const int32_t *idx, int64_t first, bool block,
                           int *err) {
  const int64_t rows = nrows_of(t), n = t.ne[0], arows = a.ne[1];
  for (int64_t r = row0_2d(); r < rows; r += rowstep_2d()) {
    float *y = frow(t, r);
    int64_t v = idx[r], row = v - first;
    bool ok = row >= 0 && row < arows;
    if (threadIdx.x == 0 && index_bad(v, row, arows, block)) flag_error(err, RTP_OP_GET_ROWS);
    const float *x = (const float *)a.data + (ok ? row : 0) * a.nb[1];
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
      y[i * t.nb[0]] = ok ? x[i * a.nb[0]] : 0.0f;
  }
}

__global__ void k_check_index(const int32_t *idx, int64_t n, int64_t first, int64_t rows,
                              bool block, int op, int *err) {
  for (int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; k < n;
       k += (int64_t)gridDim.x * blockDim.x) {
    int64_t v = idx[k];
    if (index_bad(v, v - first, rows, block)) flag_error(err, op);
  }
}

/* Scatter-add without atomics: the block of row v of t scans every index in order, warp 0
 * listing the matches of each chunk, and adds those rows of dy: the additions happen in
 * the CPU's order, so results are reproducible (and equal to the CPU's). Cost: every block
 * reads all the indices, n * rows / 32 warp steps in all. */
__global__ void k_get_rows_back(tview t, tview dy, const int32_t *idx, int64_t n,
                                int64_t first) {
  __shared__ int hits[kChunk];
  __shared__ int n_hits;
  const int64_t rows = nrows_of(t), d = t.ne[0];
  const int lane = threadIdx.x & 31;
  for (int64_t v = blockIdx.x; v < rows; v += gridDim.x) {
    float *y = frow(t, v);
    for (int64_t i = threadIdx.x; i < d; i += blockDim.x) y[i * t.nb[0]] = 0.0f;
    for (int64_t base = 0; base < n; base += kChunk) {
      if (threadIdx.x < 32) {
        int cnt = 0;
        for (int j = lane; j < kChunk; j += 32) {
          bool hit = base + j < n && (int64_t)idx[base + j] - first == v;
          unsigned mask = __ballot_sync(0xffffffffu, hit);
          if (hit) hits[cnt + __popc(mask & ((1u << lane) - 1u))] = j;
          cnt += __popc(mask);
        }
        if (lane == 0) n_hits = cnt;
      }
      __syncthreads();
      for (int h = 0; h < n_hits; h++) {
        const float *x = frow(dy, base + hits[h]);
        for (int64_t i = threadIdx.x; i < d; i += blockDim.x) y[i * t.nb[0]] += x[i * dy.nb[0]];
      }
      __syncthreads(); /* before warp 0 lists the next chunk */
    }
  }
}

/* ---- row-wise: one block per row (1-D blocks) -------------------------------------------
 * Sums that the CPU does in double are done in double here too. */

__global__ void k_norm(tview t, tview a, float eps) {
  const int64_t rows = nrows_of(t), n = t.ne[0];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float *x = frow(a, r);
    float *y = frow(t, r);
    double s = 0, v = 0;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) s += x[i * a.nb[0]];
    double m = block_sum(s) / (double)n;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      double c = x[i * a.nb[0]] - m;
      v += c * c;
    }
    v = block_sum(v);
    float mean = (float)m, rstd = (float)(1.0 / sqrt(v / (double)n + eps));
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
      y[i * t.nb[0]] = (x[i * a.nb[0]] - mean) * rstd;
  }
}

/* dx = rstd * (dy - mean(dy) - xhat * mean(dy * xhat)); dx may be dy. */
__global__ void k_norm_back(tview t, tview dy, tview a, float eps) {
  const int64_t rows = nrows_of(t), n = t.ne[0];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float *x = frow(a, r), *g = frow(dy, r);
    float *dx = frow(t, r);
    double s = 0, v = 0;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) s += x[i * a.nb[0]];
    double m = block_sum(s) / (double)n;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      double c = x[i * a.nb[0]] - m;
      v += c * c;
    }
    v = block_sum(v);
    float mean = (float)m, rstd = (float)(1.0 / sqrt(v / (double)n + eps));
    double s_dy = 0, s_dyx = 0;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      float gi = g[i * dy.nb[0]];
      s_dy += gi;
      s_dyx += gi * (x[i * a.nb[0]] - mean) * rstd;
    }
    float m_dy = (float)(block_sum(s_dy) / (double)n);
    float m_dyx = (float)(block_sum(s_dyx) / (double)n);
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      float gi = g[i * dy.nb[0]], xi = x[i * a.nb[0]];
      dx[i * t.nb[0]] = rstd * (gi - m_dy - (xi - mean) * rstd * m_dyx);
    }
  }
}

/* softmax(x * scale); causal rows keep columns j <= i + (ne0 - ne1), zeros after. */
__global__ void k_soft_max(tview t, tview a, float scale, bool causal) {
  const int64_t rows = nrows_of(t), n = t.ne[0];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float *x = frow(a, r);
    float *y = frow(t, r);
    const int64_t len = causal ? r % t.ne[1] + (n - t.ne[1]) + 1 : n;
    float mx = -INFINITY, s = 0.0f;
    for (int64_t i = threadIdx.x; i < len; i += blockDim.x)
      mx = fmaxf(mx, x[i * a.nb[0]] * scale);
    mx = block_max(mx);
    for (int64_t i = threadIdx.x; i < len; i += blockDim.x) {
      float e = expf(x[i * a.nb[0]] * scale - mx);
      y[i * t.nb[0]] = e;
      s += e;
    }
    float inv = 1.0f / block_sum(s);
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
      y[i * t.nb[0]] = i < len ? y[i * t.nb[0]] * inv : 0.0f;
  }
}

/* dx = scale * y * (dy - sum(dy * y)); dx may be dy. */
__global__ void k_soft_max_back(tview t, tview dy, tview yv, float scale) {
  const int64_t rows = nrows_of(t), n = t.ne[0];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float *g = frow(dy, r), *y = frow(yv, r);
    float *dx = frow(t, r);
    double dot = 0;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
      dot += g[i * dy.nb[0]] * y[i * yv.nb[0]];
    float d = (float)block_sum(dot);
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      float yi = y[i * yv.nb[0]];
      dx[i * t.nb[0]] = scale * yi * (g[i * dy.nb[0]] - d);
    }
  }
}

/* log(sum(exp(x))) of a row: the maximum, then the sum in double (rtp-cpu.c's
 * row_logsumexp, with float exponentials: double ones are slow on most GPUs). */
__device__ double row_logsumexp(const float *x, int64_t n, int64_t stride) {
  float mx = -INFINITY;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) mx = fmaxf(mx, x[i * stride]);
  mx = block_max(mx);
  double s = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) s += expf(x[i * stride] - mx);
  return mx + log(block_sum(s));
}

/* Each row's loss into loss[r] (0 for a bad target); k_sum_partials takes the mean. */
__global__ void k_cross_entropy(double *loss, tview lg, const int32_t *tgt, int *err) {
  const int64_t rows = nrows_of(lg), n = lg.ne[0];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float *x = frow(lg, r);
    double lse = row_logsumexp(x, n, lg.nb[0]);
    int64_t c = tgt[r];
    bool ok = c >= 0 && c < n;
    if (threadIdx.x == 0) {
      if (!ok) flag_error(err, RTP_OP_CROSS_ENTROPY);
      loss[r] = ok ? lse - x[c * lg.nb[0]] : 0.0;
    }
  }
}

/* d logits = (softmax - onehot) * dloss / rows */
__global__ void k_cross_entropy_back(tview t, const float *dloss, tview lg, const int32_t *tgt,
                                     int *err) {
  const int64_t rows = nrows_of(lg), n = lg.ne[0];
  const float g = *dloss / (float)(rows ? rows : 1);
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float *x = frow(lg, r);
    float *dx = frow(t, r);
    float lse = (float)row_logsumexp(x, n, lg.nb[0]);
    int64_t c = tgt[r];
    bool ok = c >= 0 && c < n;
    if (threadIdx.x == 0 && !ok) flag_error(err, RTP_OP_CROSS_ENTROPY_BACK);
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      float v = expf(x[i * lg.nb[0]] - lse) * g;
      dx[i * t.nb[0]] = ok && i == c ? v - g : v;
    }
  }
}

/* ---- sums -------------------------------------------------------------------------------
 * Two passes: a fixed number of blocks write partial sums, then one block adds them. */

__global__ void k_sum_rows(double *part, tview a) {
  const int64_t rows = nrows_of(a), n = a.ne[0];
  double s = 0;
  for (int64_t r = row0_2d(); r < rows; r += rowstep_2d()) {
    const float *x = frow(a, r);
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) s += x[i * a.nb[0]];
  }
  s = block_sum(s);
  if (threadIdx.x == 0 && threadIdx.y == 0) part[blockIdx.x] = s;
}

__global__ void k_sumsq(double *part, const float *g, int64_t n) {
  double s = 0;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x)
    s += (double)g[i] * g[i];
  s = block_sum(s);
  if (threadIdx.x == 0) part[blockIdx.x] = s;
}

/* sum(part[0..n)) / divisor into *out_f (as float) or *out_d. One block. */
__global__ void k_sum_partials(const double *part, int64_t n, double divisor, float *out_f,
                               double *out_d) {
  double s = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) s += part[i];
  s = block_sum(s);
  if (threadIdx.x == 0) {
    if (out_f) *out_f = (float)(s / divisor);
    if (out_d) *out_d = s / divisor;
  }
}

/* repeat's backward: t (shape ne_t) = a summed over the dims where t has 1 (rne: those dims'
 * sizes in a, 1 elsewhere). The sums of a bias's gradient are long (every token) and few
 * (the width), so the reduced indices are cut into gridDim.y runs: block (x, y) adds run y
 * for 32 outputs, 8 threads each taking a stretch of it, whose parts it adds in order into
 * part[y * n_out + j] (or, with one run, straight into t). k_repeat_back_sum then adds the
 * runs in order: the same sums on every launch. */
struct rback {
  int64_t rne[4];
  int64_t n_out, n_red;
};

/* The offset in a (elements) of output j's first addend, and in t of output j. */
__device__ void rback_offsets(const tview &t, const tview &a, int64_t j, int64_t *base,
                              int64_t *toff) {
  int64_t c[4] = {j % t.ne[0], j / t.ne[0] % t.ne[1], j / t.ne[0] / t.ne[1] % t.ne[2],
                  j / t.ne[0] / t.ne[1] / t.ne[2]};
  *base = *toff = 0;
  for (int d = 0; d < 4; d++) {
    *base += c[d] * a.nb[d]; /* reduced dims have c = 0 */
    *toff += c[d] * t.nb[d];
  }
}

/* Addends q in [q, end) of the sum at x: the index digits are found once, then counted up. */
__device__ double rback_stretch(const float *x, const tview &a, const rback &r, int64_t q,
                                int64_t end) {
  int64_t idx[4], off = 0, rest = q;
  for (int d = 0; d < 4; d++) {
    idx[d] = rest % r.rne[d];
    rest /= r.rne[d];
    off += idx[d] * a.nb[d];
  }
  double s = 0;
  for (; q < end; q++) {
    s += x[off];
    for (int d = 0; d < 4; d++) {
      if (++idx[d] < r.rne[d]) {
        off += a.nb[d];
        break;
      }
      off -= (r.rne[d] - 1) * a.nb[d];
      idx[d] = 0;
    }
  }
  return s;
}

__global__ void k_repeat_back(tview t, tview a, rback r, double *part) {
  __shared__ double acc[8][33];
  const int64_t run = (r.n_red + gridDim.y - 1) / gridDim.y;
  const int64_t lo = (int64_t)blockIdx.y * run, hi = min(r.n_red, lo + run);
  const int64_t stretch = hi > lo ? (hi - lo + blockDim.y - 1) / blockDim.y : 0;
  for (int64_t j0 = (int64_t)blockIdx.x * 32; j0 < r.n_out; j0 += (int64_t)gridDim.x * 32) {
    const int64_t j = j0 + threadIdx.x;
    int64_t base = 0, toff = 0;
    double s = 0;
    if (j < r.n_out) {
      rback_offsets(t, a, j, &base, &toff);
      const int64_t q = lo + threadIdx.y * stretch, end = min(hi, q + stretch);
      if (q < end) s = rback_stretch((const float *)a.data + base, a, r, q, end);
    }
    acc[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && j < r.n_out) {
      double total = 0;
      for (int k = 0; k < 8; k++) total += acc[k][threadIdx.x];
      if (part)
        part[blockIdx.y * r.n_out + j] = total;
      else
        ((float *)t.data)[toff] = (float)total;
    }
    __syncthreads();
  }
}

__global__ void k_repeat_back_sum(tview t, tview a, rback r, const double *part, int runs) {
  for (int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; j < r.n_out;
       j += (int64_t)gridDim.x * blockDim.x) {
    int64_t base, toff;
    rback_offsets(t, a, j, &base, &toff);
    double s = 0;
    for (int k = 0; k < runs; k++) s += part[k * r.n_out + j];
    ((float *)t.data)[toff] = (float)s;
  }
}

/* ---- optimizer ------------------------------------------------------------------------
 * rtp__adam_update (rtp-opt.c), operation for operation. The _rn intrinsics keep nvcc from
 * fusing multiply-adds, so every step rounds as the C expression does. */
__global__ void k_adam(rtp_adam_args a) {
  const float c1 = __fsub_rn(1.0f, a.beta1), c2 = __fsub_rn(1.0f, a.beta2);
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < a.n;
       i += (int64_t)gridDim.x * blockDim.x) {
    float gi = __fmul_rn(a.g[i], a.gscale);
    float m = __fadd_rn(__fmul_rn(a.beta1, a.m[i]), __fmul_rn(c1, gi));
    float v = __fadd_rn(__fmul_rn(a.beta2, a.v[i]), __fmul_rn(__fmul_rn(c2, gi), gi));
    a.m[i] = m;
    a.v[i] = v;
    float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), a.bc2), a.eps);
    a.w[i] = __fsub_rn(__fmul_rn(a.w[i], a.decay), __fdiv_rn(__fmul_rn(a.lr_t, m), denom));
  }
}

/* ---- launch shapes ----------------------------------------------------------------------- */

unsigned grid_of(int64_t blocks) {
  return blocks < 1 ? 1u : blocks > kMaxGrid ? (unsigned)kMaxGrid : (unsigned)blocks;
}

/* Threads along a row: a multiple of 32 up to kThreads, no more than the row needs. */
unsigned row_threads(int64_t ne0) {
  if (ne0 >= kThreads) return kThreads;
  unsigned tx = (unsigned)((ne0 + 31) / 32 * 32);
  return tx ? tx : 32;
}

struct geom {
  dim3 grid, block;
};

/* Elementwise kernels: (tx, ty) blocks of kThreads at most, ty rows per block. */
geom geom_2d(int64_t ne0, int64_t rows, int64_t max_blocks = kMaxGrid) {
  unsigned tx = row_threads(ne0), ty = kThreads / tx;
  int64_t blocks = (rows + ty - 1) / ty;
  return {dim3(grid_of(blocks < max_blocks ? blocks : max_blocks)), dim3(tx, ty)};
}

/* Row-wise kernels: one block per row. */
geom geom_rows(int64_t ne0, int64_t rows) {
  return {dim3(grid_of(rows)), dim3(row_threads(ne0))};
}

/* ---- views of tensors, checked ---------------------------------------------------------- */

int64_t nrows_host(const tview &v) {
  return v.ne[1] * v.ne[2] * v.ne[3];
}

int64_t nelem(const tview &v) {
  return v.ne[0] * nrows_host(v);
}

/* x (an operand or the result of node t) as kernels see it, if its type is `type` and its
 * data and strides are aligned to its element size (a GPU faults on unaligned loads; x86
 * does not, so the CPU path may have accepted such a view). */
int view_of(const cuda_backend *cu, const struct rtp_tensor *t, const struct rtp_tensor *x,
            enum rtp_type type, tview *v) {
  const char *op = rtp_op_name(t->op);
  if (!x)
    return rtp__error(RTP_EINVAL, "cuda device %d: %s '%s': missing operand", cu->device, op,
                      t->name);
  if (x->type != type)
    return rtp__error(RTP_ENOSYS, "cuda device %d: %s '%s': %s operand '%s' (needs %s)",
                      cu->device, op, t->name, rtp_type_name(x->type), x->name,
                      rtp_type_name(type));
  const size_t size = rtp_type_size(type);
  bool aligned = size > 0 && (uintptr_t)x->data % size == 0;
  for (int d = 0; d < 4; d++) aligned = aligned && x->nb[d] % size == 0;
  if (!aligned)
    return rtp__error(RTP_EINVAL,
                      "cuda device %d: %s '%s': '%s' is a view not aligned to %zu bytes",
                      cu->device, op, t->name, x->name, size);
  if (!x->data && rtp_tensor_nelements(x) > 0)
    return rtp__error(RTP_ESTATE, "cuda device %d: %s '%s': '%s' has no data", cu->device, op,
                      t->name, x->name);
  v->data = x->data;
  for (int d = 0; d < 4; d++) {
    v->ne[d] = x->ne[d];
    v->nb[d] = (int64_t)(x->nb[d] / size);
  }
  return RTP_OK;
}

/* A contiguous tensor of x's shape at p. */
tview packed_view(void *p, const int64_t ne[4]) {
  tview v = {p, {ne[0], ne[1], ne[2], ne[3]}, {1, ne[0], ne[0] * ne[1], ne[0] * ne[1] * ne[2]}};
  return v;
}

size_t pad_work(size_t n) {
  return (n + kWorkAlign - 1) / kWorkAlign * kWorkAlign;
}

/* ---- ops ------------------------------------------------------------------------------- */

#define RTP_VIEW(var, x, type)                   \
  tview var = {};                                \
  do {                                           \
    int rc_ = view_of(cu, t, (x), (type), &var); \
    if (rc_) return rc_;                         \
  } while (0)

int unsupported_type(const cuda_backend *cu, const struct rtp_tensor *t) {
  return rtp__error(RTP_ENOSYS, "cuda device %d: %s '%s': no kernel for type %s", cu->device,
                    rtp_op_name(t->op), t->name, rtp_type_name(t->type));
}

/* Copies of any type (its bits); cast of the same type too. */
int op_dup(cuda_backend *cu, struct rtp_tensor *t) {
  RTP_VIEW(y, t, t->type);
  RTP_VIEW(a, t->src[0], t->type);
  geom g = geom_2d(y.ne[0], nrows_host(y));
  size_t size = rtp_type_size(t->type);
  if (size == 4)
    k_dup<uint32_t><<<g.grid, g.block, 0, compute_stream(cu)>>>(y, a);
  else if (size == 2)
    k_dup<uint16_t><<<g.grid, g.block, 0, compute_stream(cu)>>>(y, a);
  else
    return unsupported_type(cu, t);
  return RTP_OK;
}

/* f32 <-> bf16, contiguous result. */
int op_cast(cuda_backend *cu, struct rtp_tensor *t) {
  const struct rtp_tensor *a = t->src[0];
  if (a && a->type == t->type) return op_dup(cu, t);
  geom g = geom_2d(t->ne[0], rtp_tensor_nrows(t));
  if (t->type == RTP_TYPE_BF16) {
    RTP_VIEW(y, t, RTP_TYPE_BF16);
    RTP_VIEW(x, a, RTP_TYPE_F32);
    k_cast_to_bf16<<<g.grid, g.block, 0, compute_stream(cu)>>>(y, x);
  } else if (t->type == RTP_TYPE_F32) {
    RTP_VIEW(y, t, RTP_TYPE_F32);
    RTP_VIEW(x, a, RTP_TYPE_BF16);
    k_cast_to_f32<<<g.grid, g.block, 0, compute_stream(cu)>>>(y, x);
  } else {
    return unsupported_type(cu, t);
  }
  return RTP_OK;
}

int op_binary(cuda_backend *cu, struct rtp_tensor *t) {
  RTP_VIEW(y, t, RTP_TYPE_F32);
  RTP_VIEW(a, t->src[0], RTP_TYPE_F32);
  RTP_VIEW(b, t->src[1], RTP_TYPE_F32);
  geom g = geom_2d(y.ne[0], nrows_host(y));
  cudaStream_t s = compute_stream(cu);
  if (t->op == RTP_OP_ADD)
    k_binary<RTP_OP_ADD><<<g.grid, g.block, 0, s>>>(y, a, b);
  else if (t->op == RTP_OP_SUB)
    k_binary<RTP_OP_SUB><<<g.grid, g.block, 0, s>>>(y, a, b);
  else
    k_binary<RTP_OP_MUL><<<g.grid, g.block, 0, s>>>(y, a, b);
  return RTP_OK;
}

int op_scale(cuda_backend *cu, struct rtp_tensor *t) {
  RTP_VIEW(y, t, RTP_TYPE_F32);
  RTP_VIEW(a, t->src[0], RTP_TYPE_F32);
  geom g = geom_2d(y.ne[0], nrows_host(y));
  k_scale<<<g.grid, g.block, 0, compute_stream(cu)>>>(y, a, rtp__get_param_f32(t, 0));
  return RTP_OK;
}

int op_repeat(cuda_backend *cu, struct rtp_tensor *t) {
  RTP_VIEW(y, t, RTP_TYPE_F32);
  RTP_VIEW(a, t->src[0], RTP_TYPE_F32);
  geom g = geom_2d(y.ne[0], nrows_host(y));
  k_repeat<<<g.grid, g.block, 0, compute_stream(cu)>>>(y, a);
  return RTP_OK;
}

/* The runs each sum of repeat_back t is cut into: enough blocks to fill the GPU (about
 * 1024) when the outputs are few, runs of at least 256 addends, at most 64 runs. */
rback rback_of(const struct rtp_tensor *t, int *runs) {
  rback r;
  r.n_out = rtp_tensor_nelements(t), r.n_red = 1;
  for (int d = 0; d < 4; d++) {
    r.rne[d] = t->ne[d] == 1 ? t->src[0]->ne[d] : 1;
    r.n_red *= r.rne[d];
  }
  int64_t col_blocks = (r.n_out + 31) / 32, n = 1024 / (col_blocks > 0 ? col_blocks : 1);
  if (n > r.n_red / 256) n = r.n_red / 256;
  *runs = (int)(n < 1 ? 1 : n > 64 ? 64 : n);
  return r;
}

size_t repeat_back_work(const struct rtp_tensor *t) {
  int runs;
  rback r = rback_of(t, &runs);
  return runs > 1 ? pad_work((size_t)runs * (size_t)r.n_out * sizeof(double)) : 0;
}

int op_repeat_back(cuda_backend *cu, struct rtp_tensor *t, void *work) {
  RTP_VIEW(y, t, RTP_TYPE_F32);
  RTP_VIEW(a, t->src[0], RTP_TYPE_F32);
  int runs;
  rback r = rback_of(t, &runs);
  double *part = runs > 1 ? (double *)work : nullptr;
  dim3 grid(grid_of((r.n_out + 31) / 32), (unsigned)runs);
  k_repeat_back<<<grid, dim3(32, 8), 0, compute_stream(cu)>>>(y, a, r, part);
  if (part)
    k_repeat_back_sum<<<grid_of((r.n_out + kThreads - 1) / kThreads), kThreads, 0,
                        compute_stream(cu)>>>(y, a, r, part, runs);
  return RTP_OK;
}

int op_sum(cuda_backend *cu, struct rtp_tensor *t, void *work) {
  RTP_VIEW(y, t, RTP_TYPE_F32);
  RTP_VIEW(a, t->src[0], RTP_TYPE_F32);
  double *part = (double *)work;
  geom g = geom_2d(a.ne[0], nrows_host(a), kRedBlocks);
  int64_t n_part = nelem(a) > 0 ? (int64_t)g.grid.x : 0;
  if (n_part) k_sum_rows<<<g.grid, g.block, 0, compute_stream(cu)>>>(part, a);
  k_sum_partials<<<1, kThreads, 0, compute_stream(cu)>>>(part, n_part, 1.0, (float *)y.data,
                                                         nullptr);
  return RTP_OK;
}

bool mm_needs_copy(const struct rtp_tensor *x) {
  bool packed_rows;
  int64_t ld;
  return !rtp__gemm_layout(x->ne[1], x->ne[0], (int64_t)(x->nb[1] / 4), (int64_t)(x->nb[0] / 4),
                           &packed_rows, &ld);
}

bool mm_bf16(const struct rtp_tensor *t) {
  return rtp_mul_mat_get_prec(t) == RTP_TYPE_BF16;
}

/* A bf16-precision product copies both operands (as bf16), an f32 one those cuBLAS cannot
 * read. */
size_t mm_work(const struct rtp_tensor *t) {
  const bool bf16 = mm_bf16(t);
  size_t n = 0;
  for (int s = 0; s < 2; s++)
    if (bf16 || mm_needs_copy(t->src[s]))
      n += pad_work((size_t)rtp_tensor_nelements(t->src[s]) * (bf16 ? 2 : 4));
  return n;
}

/* x copied to contiguous memory at *w (which moves past it): rounded to bf16 (rtp-cpu.c's
 * rounding, to_bf16) for a bf16-precision product, or as f32 when cuBLAS cannot read it. */
int mm_operand(cuda_backend *cu, const struct rtp_tensor *x, bool bf16, tview *v, char **w) {
  if (!bf16 && !mm_needs_copy(x)) return RTP_OK;
  if (!*w)
    return rtp__error(RTP_EINVAL,
                      "cuda device %d: mul_mat: no scratch memory for a copy of '%s'",
                      cu->device, x->name);
  tview c = packed_view(*w, v->ne);
  geom g = geom_2d(c.ne[0], nrows_host(c));
  const int64_t n = nelem(c);
  if (bf16 && rtp_tensor_is_contiguous(x) && n % 4 == 0 && (uintptr_t)v->data % 16 == 0 &&
      (uintptr_t)c.data % 8 == 0)
    k_cast_to_bf16_x4<<<grid_of((n / 4 + kThreads - 1) / kThreads), kThreads, 0,
                        compute_stream(cu)>>>((uint2 *)c.data, (const float4 *)v->data, n / 4);
  else if (bf16)
    k_cast_to_bf16<<<g.grid, g.block, 0, compute_stream(cu)>>>(c, *v);
  else
    k_dup<uint32_t><<<g.grid, g.block, 0, compute_stream(cu)>>>(c, *v);
  *v = c;
  *w += pad_work((size_t)nelem(c) * (bf16 ? 2 : 4));
  return RTP_OK;
}

/* C = op(A) op(B) in cuBLAS's column-major terms, or `count` such products at strides sa,
 * sb, sc (elements) when batched. A and B are f32 (cublasSgemm), or bf16 for a
 * bf16-precision product (cublasGemmEx: tensor cores, f32 sums); C is f32 either way. */
struct gemm_call {
  cublasOperation_t op_a, op_b;
  int64_t m, n, k;
  const void *a, *b;
  int64_t lda, ldb;
  float *c;
  int64_t ldc;
  int64_t sa, sb, sc, count;
  float beta; /* 1 adds the product to what c holds (an addend) */
};

int gemm_run(cuda_backend *cu, bool bf16, bool batched, const gemm_call &g) {
  const float one = 1.0f;
  const cudaDataType in = CUDA_R_16BF, out = CUDA_R_32F;
  const cublasComputeType_t acc = CUBLAS_COMPUTE_32F;
  if (!bf16 && !batched)
    RTP_CUBLAS_TRY(
        cu, blas_api.sgemm(cu->blas, g.op_a, g.op_b, g.m, g.n, g.k, &one, (const float *)g.a,
                           g.lda, (const float *)g.b, g.ldb, &g.beta, g.c, g.ldc));
  else if (!bf16)
    RTP_CUBLAS_TRY(
        cu, blas_api.sgemm_batched(cu->blas, g.op_a, g.op_b, g.m, g.n, g.k, &one,
                                   (const float *)g.a, g.lda, g.sa, (const float *)g.b, g.ldb,
                                   g.sb, &g.beta, g.c, g.ldc, g.sc, g.count));
  else if (!batched)
    RTP_CUBLAS_TRY(
        cu, blas_api.gemm_ex(cu->blas, g.op_a, g.op_b, g.m, g.n, g.k, &one, g.a, in, g.lda, g.b,
                             in, g.ldb, &g.beta, g.c, out, g.ldc, acc, CUBLAS_GEMM_DEFAULT));
  else
    RTP_CUBLAS_TRY(
        cu, blas_api.gemm_batched_ex(cu->blas, g.op_a, g.op_b, g.m, g.n, g.k, &one, g.a, in,
                                     g.lda, g.sa, g.b, in, g.ldb, g.sb, &g.beta, g.c, out,
                                     g.ldc, g.sc, g.count, acc, CUBLAS_GEMM_DEFAULT));
  return RTP_OK;
}

/* t{M, N, B2, B3}: t[n][m] = sum_k a[m][k] * b[n][k] per batch, a shared when 2-D, plus
 * the addend's c[n][m] if there is one (beta 1, on a copy unless the planner gave t c's
 * memory). In cuBLAS's column-major terms C (M x N, ldc) = op(A) op(B) + beta C with A read
 * as K x M (packed rows: transposed) or M x K, and B as K x N or N x K (packed columns:
 * transposed). With bf16 precision both operands are read through bf16 copies, which are
 * packed rows (the addend stays f32). */
int op_mul_mat(cuda_backend *cu, struct rtp_tensor *t, void *work) {
  RTP_VIEW(y, t, RTP_TYPE_F32);
  RTP_VIEW(a, t->src[0], RTP_TYPE_F32);
  RTP_VIEW(b, t->src[1], RTP_TYPE_F32);
  const int64_t M = a.ne[1], N = b.ne[1], K = a.ne[0], ne2 = b.ne[2], ne3 = b.ne[3];
  cudaStream_t s = compute_stream(cu);
  const struct rtp_tensor *addend = rtp__addend(t);
  geom gy = geom_2d(y.ne[0], nrows_host(y));
  if (addend && addend->data != t->data) {
    RTP_VIEW(c, addend, RTP_TYPE_F32);
    k_dup<uint32_t><<<gy.grid, gy.block, 0, s>>>(y, c);
  }
  if (K == 0) { /* an empty sum */
    if (!addend) k_fill<<<gy.grid, gy.block, 0, s>>>(y, 0.0f);
    return RTP_OK;
  }
  const bool bf16 = mm_bf16(t);
  char *w = (char *)work;
  int rc = mm_operand(cu, t->src[0], bf16, &a, &w);
  if (!rc) rc = mm_operand(cu, t->src[1], bf16, &b, &w);
  if (rc) return rc;
  profile_split(&cu->prof, s, kProfileGemm);
  bool a_rows, b_rows;
  int64_t lda, ldb, ldc = N == 1 ? (M > 1 ? M : 1) : y.nb[1];
  if (!rtp__gemm_layout(M, K, a.nb[1], a.nb[0], &a_rows, &lda) ||
      !rtp__gemm_layout(N, K, b.nb[1], b.nb[0], &b_rows, &ldb) || (M > 1 && y.nb[0] != 1) ||
      ldc < M)
    return rtp__error(RTP_ENOSYS, "cuda device %d: mul_mat '%s': a layout cuBLAS cannot take",
                      cu->device, t->name);
  const size_t es = bf16 ? 2 : 4; /* bytes per operand element */
  gemm_call g = {};
  g.op_a = a_rows ? CUBLAS_OP_T : CUBLAS_OP_N, g.op_b = b_rows ? CUBLAS_OP_N : CUBLAS_OP_T;
  g.m = M, g.n = N, g.k = K;
  g.a = a.data, g.lda = lda, g.b = b.data, g.ldb = ldb, g.c = (float *)y.data, g.ldc = ldc;
  g.beta = addend ? 1.0f : 0.0f;
  const bool a_2d = a.ne[2] == 1 && a.ne[3] == 1;
  const int64_t nbatch = ne2 * ne3;
  /* A shared a and batches of b that follow each other: one product with more rows. */
  if (a_2d && nbatch > 1 && b.nb[0] == 1 && b.nb[1] >= K && b.nb[2] == b.nb[1] * N &&
      b.nb[3] == b.nb[2] * ne2 && y.nb[0] == 1 && y.nb[1] >= M && y.nb[2] == y.nb[1] * N &&
      y.nb[3] == y.nb[2] * ne2) {
    g.op_b = CUBLAS_OP_N;
    g.n = N * nbatch;
    g.ldb = b.nb[1];
    g.ldc = y.nb[1];
    return gemm_run(cu, bf16, false, g);
  }
  /* Batches at one stride each for a, b and t when dims 2 and 3 collapse; else a loop
   * over dim 3 of products batched over dim 2. */
  int64_t sa[2] = {a_2d ? 0 : a.nb[2], a_2d ? 0 : a.nb[3]};
  int64_t sb[2] = {b.nb[2], b.nb[3]}, sc[2] = {y.nb[2], y.nb[3]};
  int64_t count = ne2, outer = ne3, step = 0; /* step: the stride index used for batches */
  if (ne2 == 1) {
    count = ne3, outer = 1, step = 1;
  } else if (ne3 == 1 ||
             (sa[1] == sa[0] * ne2 && sb[1] == sb[0] * ne2 && sc[1] == sc[0] * ne2)) {
    count = nbatch, outer = 1;
  }
  g.sa = sa[step], g.sb = sb[step], g.sc = sc[step], g.count = count;
  for (int64_t i3 = 0; i3 < outer && !rc; i3++) {
    gemm_call gi = g;
    gi.a = (const char *)a.data + (size_t)(i3 * sa[1]) * es;
    gi.b = (const char *)b.data + (size_t)(i3 * sb[1]) * es;
    gi.c = (float *)y.data + i3 * sc[1];
    rc = gemm_run(cu, bf16, true, gi);
  }
  return rc;
}

int op_norm(cuda_backend *cu, struct rtp_tensor *t) {
  RTP_VIEW(y, t, RTP_TYPE_F32);
  RTP_VIEW(a, t->src[0], RTP_TYPE_F32);
  geom g = geom_rows(y.ne[0], nrows_host(y));
  k_norm<<<g.grid, g.block, 0, compute_stream(cu)>>>(y, a, rtp__get_param_f32(t, 0));
  return RTP_OK;
}

int op_norm_back(cuda_backend *cu, struct rtp_tensor *t) {
  RTP_VIEW(y, t, RTP_TYPE_F32);
  RTP_VIEW(dy, t->src[0], RTP_TYPE_F32);
  RTP_VIEW(a, t->src[1], RTP_TYPE_F32);
  geom g = geom_rows(y.ne[0], nrows_host(y));
  k_norm_back<<<g.grid, g.block, 0, compute_stream(cu)>>>(y, dy, a, rtp__get_param_f32(t, 0));
  return RTP_OK;
}

int op_gelu(cuda_backend *cu, struct rtp_tensor *t) {
  RTP_VIEW(y, t, RTP_TYPE_F32);
  RTP_VIEW(a, t->src[0], RTP_TYPE_F32);
  geom g = geom_2d(y.ne[0], nrows_host(y));
  k_gelu<<<g.grid, g.block, 0, compute_stream(cu)>>>(y, a);
  return RTP_OK;
}

int op_gelu_back(cuda_backend *cu, struct rtp_tensor *t) {
  RTP_VIEW(y, t, RTP_TYPE_F32);
  RTP_VIEW(dy, t->src[0], RTP_TYPE_F32);
  RTP_VIEW(a, t->src[1], RTP_TYPE_F32);
  geom g = geom_2d(y.ne[0], nrows_host(y));
  k_gelu_back<<<g.grid, g.block, 0, compute_stream(cu)>>>(y, dy, a);
  return RTP_OK;
}

int op_soft_max(cuda_backend *cu, struct rtp_tensor *t) {
  RTP_VIEW(y, t, RTP_TYPE_F32);
  RTP_VIEW(a, t->src[0], RTP_TYPE_F32);
  geom g = geom_rows(y.ne[0], nrows_host(y));
  k_soft_max<<<g.grid, g.block, 0, compute_stream(cu)>>>(y, a, rtp__get_param_f32(t, 0),
                                                         t->op_params[1] != 0);
  return RTP_OK;
}

int op_soft_max_back(cuda_backend *cu, struct rtp_tensor *t) {
  RTP_VIEW(y, t, RTP_TYPE_F32);
  RTP_VIEW(dy, t->src[0], RTP_TYPE_F32);
  RTP_VIEW(sm, t->src[1], RTP_TYPE_F32);
  geom g = geom_rows(y.ne[0], nrows_host(y));
  k_soft_max_back<<<g.grid, g.block, 0, compute_stream(cu)>>>(y, dy, sm,
                                                              rtp__get_param_f32(t, 0));
  return RTP_OK;
}

int op_get_rows(cuda_backend *cu, struct rtp_tensor *t) {
  RTP_VIEW(y, t, RTP_TYPE_F32);
  RTP_VIEW(a, t->src[0], RTP_TYPE_F32);
  RTP_VIEW(idx, t->src[1], RTP_TYPE_I32);
  geom g = geom_2d(y.ne[0], nrows_host(y));
  k_get_rows<<<g.grid, g.block, 0, compute_stream(cu)>>>(
      y, a, (const int32_t *)idx.data, t->op_params[0], t->op_params[1] != 0, cu->err);
  return RTP_OK;
}

int op_get_rows_back(cuda_backend *cu, struct rtp_tensor *t) {
  RTP_VIEW(y, t, RTP_TYPE_F32);
  RTP_VIEW(dy, t->src[0], RTP_TYPE_F32);
  RTP_VIEW(idx, t->src[1], RTP_TYPE_I32);
  const int64_t n = nrows_host(dy), first = t->op_params[0];
  const bool block = t->op_params[1] != 0;
  const int32_t *ip = (const int32_t *)idx.data;
  cudaStream_t s = compute_stream(cu);
  if (n > 0)
    k_check_index<<<grid_of((n + kThreads - 1) / kThreads), kThreads, 0, s>>>(
        ip, n, first, y.ne[1], block, RTP_OP_GET_ROWS_BACK, cu->err);
  geom g = geom_rows(y.ne[0], nrows_host(y));
  k_get_rows_back<<<g.grid, g.block, 0, s>>>(y, dy, ip, n, first);
  return RTP_OK;
}

int op_cross_entropy(cuda_backend *cu, struct rtp_tensor *t, void *work) {
  RTP_VIEW(y, t, RTP_TYPE_F32);
  RTP_VIEW(lg, t->src[0], RTP_TYPE_F32);
  RTP_VIEW(tg, t->src[1], RTP_TYPE_I32);
  const int64_t rows = nrows_host(lg);
  double *loss = (double *)work;
  cudaStream_t s = compute_stream(cu);
  if (rows > 0 && lg.ne[0] > 0) {
    geom g = geom_rows(lg.ne[0], rows);
    k_cross_entropy<<<g.grid, g.block, 0, s>>>(loss, lg, (const int32_t *)tg.data, cu->err);
  } else if (rows > 0) { /* no classes: every target is out of range */
    k_check_index<<<grid_of((rows + kThreads - 1) / kThreads), kThreads, 0, s>>>(
        (const int32_t *)tg.data, rows, 0, 0, false, RTP_OP_CROSS_ENTROPY, cu->err);
  }
  int64_t n_part = rows > 0 && lg.ne[0] > 0 ? rows : 0;
  k_sum_partials<<<1, kThreads, 0, s>>>(loss, n_part, (double)(rows ? rows : 1),
                                        (float *)y.data, nullptr);
  return RTP_OK;
}

int op_cross_entropy_back(cuda_backend *cu, struct rtp_tensor *t) {
  RTP_VIEW(y, t, RTP_TYPE_F32);
  RTP_VIEW(dl, t->src[0], RTP_TYPE_F32);
  RTP_VIEW(lg, t->src[1], RTP_TYPE_F32);
  RTP_VIEW(tg, t->src[2], RTP_TYPE_I32);
  geom g = geom_rows(lg.ne[0], nrows_host(lg));
  k_cross_entropy_back<<<g.grid, g.block, 0, compute_stream(cu)>>>(
      y, (const float *)dl.data, lg, (const int32_t *)tg.data, cu->err);
  return RTP_OK;
}

/* t = base (or zeros), then src[0] added into the view (nb, offset) of t's memory. */
int op_acc(cuda_backend *cu, struct rtp_tensor *t) {
  RTP_VIEW(y, t, RTP_TYPE_F32);
  RTP_VIEW(b, t->src[0], RTP_TYPE_F32);
  const struct rtp_tensor *base = t->src[1];
  uint64_t nb1 = rtp__get_param_u64(t, 0), nb2 = rtp__get_param_u64(t, 2);
  uint64_t nb3 = rtp__get_param_u64(t, 4), offs = rtp__get_param_u64(t, 6);
  if ((nb1 | nb2 | nb3 | offs) % 4)
    return rtp__error(RTP_EINVAL, "cuda device %d: acc '%s': a view not aligned to 4 bytes",
                      cu->device, t->name);
  cudaStream_t s = compute_stream(cu);
  size_t bytes = rtp_tensor_nbytes(t);
  if (!base) {
    RTP_CUDA_TRY(cu, cudaMemsetAsync(y.data, 0, bytes, s));
  } else if (base->data != t->data) { /* else the planner put t in base's memory */
    RTP_VIEW(bv, base, RTP_TYPE_F32);
    RTP_CUDA_TRY(cu, cudaMemcpyAsync(y.data, bv.data, bytes, cudaMemcpyDeviceToDevice, s));
  }
  if (nelem(b) == 0) return RTP_OK;
  geom g = geom_2d(b.ne[0], nrows_host(b));
  k_acc_add<<<g.grid, g.block, 0, s>>>((float *)y.data, b, (int64_t)(nb1 / 4),
                                       (int64_t)(nb2 / 4), (int64_t)(nb3 / 4),
                                       (int64_t)(offs / 4));
  return RTP_OK;
}

int op_concat(cuda_backend *cu, struct rtp_tensor *t) {
  RTP_VIEW(y, t, t->type);
  RTP_VIEW(a, t->src[0], t->type);
  RTP_VIEW(b, t->src[1], t->type);
  int dim = t->op_params[0];
  if (dim < 0 || dim > 3)
    return rtp__error(RTP_EINVAL, "cuda device %d: concat '%s': dim %d", cu->device, t->name,
                      dim);
  geom g = geom_2d(y.ne[0], nrows_host(y));
  size_t size = rtp_type_size(t->type);
  if (size == 4)
    k_concat<uint32_t><<<g.grid, g.block, 0, compute_stream(cu)>>>(y, a, b, dim, a.ne[dim]);
  else if (size == 2)
    k_concat<uint16_t><<<g.grid, g.block, 0, compute_stream(cu)>>>(y, a, b, dim, a.ne[dim]);
  else
    return unsupported_type(cu, t);
  return RTP_OK;
}

int dispatch(cuda_backend *cu, struct rtp_tensor *t, void *work) {
  switch (t->op) {
    case RTP_OP_DUP:
      return op_dup(cu, t);
    case RTP_OP_ADD:
    case RTP_OP_SUB:
    case RTP_OP_MUL:
      return op_binary(cu, t);
    case RTP_OP_SCALE:
      return op_scale(cu, t);
    case RTP_OP_SUM:
      return op_sum(cu, t, work);
    case RTP_OP_REPEAT:
      return op_repeat(cu, t);
    case RTP_OP_REPEAT_BACK:
      return op_repeat_back(cu, t, work);
    case RTP_OP_MUL_MAT:
      return op_mul_mat(cu, t, work);
    case RTP_OP_NORM:
      return op_norm(cu, t);
    case RTP_OP_NORM_BACK:
      return op_norm_back(cu, t);
    case RTP_OP_GELU:
      return op_gelu(cu, t);
    case RTP_OP_GELU_BACK:
      return op_gelu_back(cu, t);
    case RTP_OP_SOFT_MAX:
      return op_soft_max(cu, t);
    case RTP_OP_SOFT_MAX_BACK:
      return op_soft_max_back(cu, t);
    case RTP_OP_GET_ROWS:
      return op_get_rows(cu, t);
    case RTP_OP_GET_ROWS_BACK:
      return op_get_rows_back(cu, t);
    case RTP_OP_CROSS_ENTROPY:
      return op_cross_entropy(cu, t, work);
    case RTP_OP_CROSS_ENTROPY_BACK:
      return op_cross_entropy_back(cu, t);
    case RTP_OP_ACC:
      return op_acc(cu, t);
    case RTP_OP_CONCAT:
      return op_concat(cu, t);
    case RTP_OP_CAST:
      return op_cast(cu, t);
    default:
      return rtp__error(RTP_ENOSYS, "cuda device %d: op %s ('%s') has no CUDA kernel",
                        cu->device, rtp_op_name(t->op), t->name);
  }
}

}  // namespace

/* ---- the interface's ops (rtp-cuda.h) -------------------------------------------------- */

__global__ void k_probe() {}

size_t cuda_work_size(struct rtp_backend *b, const struct rtp_tensor *t) {
  (void)b;
  switch (t->op) {
    case RTP_OP_SUM:
      return kRedBlocks * sizeof(double);
    case RTP_OP_CROSS_ENTROPY:
      return pad_work((size_t)rtp_tensor_nrows(t->src[0]) * sizeof(double));
    case RTP_OP_MUL_MAT:
      return mm_work(t);
    case RTP_OP_REPEAT_BACK:
      return repeat_back_work(t);
    default:
      return 0;
  }
}

int cuda_compute(struct rtp_backend *b, struct rtp_tensor *t, void *work) {
  cuda_backend *cu = cuda_of(b);
  if (rtp__is_view_op(t->op) || t->op == RTP_OP_COMM || t->op == RTP_OP_EMPTY ||
      t->op == RTP_OP_NONE)
    return RTP_OK;
  if (rtp_tensor_nelements(t) == 0) return RTP_OK; /* nothing to write */
  RTP_CUDA_TRY(cu, cudaSetDevice(cu->device));
  size_t need = cuda_work_size(b, t);
  if (need && (!work || (uintptr_t)work % sizeof(double)))
    return rtp__error(RTP_EINVAL,
                      "cuda device %d: %s '%s' needs %zu bytes of 8-byte aligned scratch, "
                      "got %p",
                      cu->device, rtp_op_name(t->op), t->name, need, work);
  profile_begin(&cu->prof, compute_stream(cu), t->op);
  int rc = dispatch(cu, t, need ? work : nullptr);
  profile_end(&cu->prof, compute_stream(cu));
  if (rc) return rc;
  cudaError_t e = cudaGetLastError(); /* a bad launch, or an earlier kernel's failure */
  if (e != cudaSuccess) {
    char what[128];
    snprintf(what, sizeof(what), "%s '%.64s'", rtp_op_name(t->op), t->name);
    return cuda_fail(cu->device, e, what);
  }
  return RTP_OK;
}

int cuda_adam(struct rtp_backend *b, const struct rtp_adam_args *a) {
  cuda_backend *cu = cuda_of(b);
  if (a->n <= 0) return RTP_OK;
  RTP_CUDA_TRY(cu, cudaSetDevice(cu->device));
  profile_begin(&cu->prof, compute_stream(cu), kProfileAdam);
  k_adam<<<grid_of((a->n + kThreads - 1) / kThreads), kThreads, 0, compute_stream(cu)>>>(*a);
  profile_end(&cu->prof, compute_stream(cu));
  RTP_CUDA_TRY(cu, cudaGetLastError());
  return RTP_OK;
}

int cuda_sumsq(struct rtp_backend *b, const float *g, int64_t n, double *out) {
  cuda_backend *cu = cuda_of(b);
  *out = 0;
  RTP_CUDA_TRY(cu, cudaSetDevice(cu->device));
  cudaStream_t s = compute_stream(cu);
  int64_t blocks = (n + kThreads - 1) / kThreads;
  if (blocks > kRedBlocks) blocks = kRedBlocks;
  if (n > 0) k_sumsq<<<(unsigned)blocks, kThreads, 0, s>>>(cu->red, g, n);
  k_sum_partials<<<1, kThreads, 0, s>>>(cu->red, n > 0 ? blocks : 0, 1.0, nullptr,
                                        cu->red + kRedBlocks);
  RTP_CUDA_TRY(cu, cudaGetLastError());
  double total = 0;
  RTP_CUDA_TRY(cu, cudaMemcpyAsync(&total, cu->red + kRedBlocks, sizeof(total),
                                   cudaMemcpyDeviceToHost, s));
  RTP_CUDA_TRY(cu, cudaStreamSynchronize(s));
  *out = total;
  return RTP_OK;
}

}  // namespace rtp_cuda
