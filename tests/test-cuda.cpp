// The CUDA backend against the CPU: every op, forward and gradients, on views, broadcasts
// and the batched and transposed products (in f32 and bf16 precision); the GPT reference model
// through a training step with Adam; bad indices reported, not crashing; the backend interface
// itself (memory, events, Adam, sums of squares, single-rank transfers). Tests that need a GPU
// skip on machines without one; the mapping of CUDA and cuBLAS errors needs none and runs
// anyway.
#include <gtest/gtest.h>

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "gpt.h"
extern "C" {
#include "rtp-backend.h"
// rtp-cuda.cu's status mapping, exposed for this test.
int rtp__cuda_status(int cuda_error, const char *what);
int rtp__cublas_status(int cublas_status, const char *what);
}
#include "test-util.h"

namespace {

const char *const kNoGpu = "no CUDA device: the CUDA backend is compiled but not run here";

bool has(const std::string &s, const std::string &part) {
  return s.find(part) != std::string::npos;
}

// ---- error mapping: no GPU needed ----------------------------------------------------------

TEST(CudaStatus, MapsCudaErrors) {
  struct {
    cudaError_t e;
    int want;
  } cases[] = {
      {cudaErrorMemoryAllocation, RTP_ENOMEM},   {cudaErrorNoDevice, RTP_ENOSYS},
      {cudaErrorInsufficientDriver, RTP_ENOSYS}, {cudaErrorNoKernelImageForDevice, RTP_ENOSYS},
      {cudaErrorIllegalAddress, RTP_EIO},        {cudaErrorLaunchFailure, RTP_EIO},
      {cudaErrorInvalidValue, RTP_EIO},
  };
  for (const auto &c : cases) {
    SCOPED_TRACE(cudaGetErrorName(c.e));
    EXPECT_EQ(rtp__cuda_status(c.e, "cudaSomething(x, 4)"), c.want);
    std::string msg = rtp_last_error();
    EXPECT_TRUE(has(msg, cudaGetErrorString(c.e))) << msg;
    EXPECT_TRUE(has(msg, cudaGetErrorName(c.e))) << msg;
    EXPECT_TRUE(has(msg, "cudaSomething(x, 4)")) << msg;
  }
  EXPECT_EQ(rtp__cuda_status(cudaSuccess, "nothing"), RTP_OK);
  rtp__cuda_status(cudaErrorNoKernelImageForDevice, "launch");
  EXPECT_TRUE(has(rtp_last_error(), "RTP_CUDA_ARCHS")) << rtp_last_error();
  rtp__cuda_status(cudaErrorIllegalAddress, "cudaStreamSynchronize(s)");
  EXPECT_TRUE(has(rtp_last_error(), "CUDA_LAUNCH_BLOCKING")) << rtp_last_error();
}

TEST(CudaStatus, MapsCublasErrors) {
  struct {
    cublasStatus_t s;
    int want;
  } cases[] = {
      {CUBLAS_STATUS_ALLOC_FAILED, RTP_ENOMEM},  {CUBLAS_STATUS_ARCH_MISMATCH, RTP_ENOSYS},
      {CUBLAS_STATUS_NOT_SUPPORTED, RTP_ENOSYS}, {CUBLAS_STATUS_EXECUTION_FAILED, RTP_EIO},
      {CUBLAS_STATUS_INTERNAL_ERROR, RTP_EIO},   {CUBLAS_STATUS_INVALID_VALUE, RTP_EIO},
  };
  for (const auto &c : cases) {
    SCOPED_TRACE(cublasGetStatusString(c.s));
    EXPECT_EQ(rtp__cublas_status(c.s, "cublasSgemm_64(...)"), c.want);
    std::string msg = rtp_last_error();
    EXPECT_TRUE(has(msg, cublasGetStatusString(c.s))) << msg;
    EXPECT_TRUE(has(msg, "cublasSgemm_64(...)")) << msg;
  }
  EXPECT_EQ(rtp__cublas_status(CUBLAS_STATUS_SUCCESS, "nothing"), RTP_OK);
}

TEST(CudaBackend, NewFailsCleanly) {
  rtp_backend *b = reinterpret_cast<rtp_backend *>(&b);  // must be reset to NULL
  int n = rtp_backend_cuda_count();
  if (n == 0) {
    EXPECT_EQ(rtp_backend_cuda_new(0, &b), RTP_ENOSYS);
    EXPECT_EQ(b, nullptr);
    EXPECT_TRUE(has(rtp_last_error(), "CUDA")) << rtp_last_error();
    return;
  }
  EXPECT_EQ(rtp_backend_cuda_new(-1, &b), RTP_EINVAL);
  EXPECT_EQ(b, nullptr);
  EXPECT_EQ(rtp_backend_cuda_new(n, &b), RTP_EINVAL);
  EXPECT_TRUE(has(rtp_last_error(), std::to_string(n))) << rtp_last_error();
}

// ---- the device --------------------------------------------------------------------------

// One backend per device and process: made on first use, freed when the tests end.
rtp_backend *g_backend = nullptr;

class BackendEnv : public ::testing::Environment {
 public:
  void TearDown() override {
    rtp_backend_free(g_backend);
    g_backend = nullptr;
  }
};
[[maybe_unused]] const auto *const g_env = ::testing::AddGlobalTestEnvironment(new BackendEnv);

class Cuda : public ::testing::Test {
 protected:
  void SetUp() override {
    if (rtp_backend_cuda_count() == 0) GTEST_SKIP() << kNoGpu;
    if (!g_backend) {
      ASSERT_EQ(rtp_backend_cuda_new(0, &g_backend), RTP_OK) << rtp_last_error();
    }
    b = g_backend;
    EXPECT_STREQ(rtp_backend_name(b), "cuda");
  }
  rtp_backend *b = nullptr;
};

rtp_context *new_ctx(rtp_backend *be, size_t size = 64 << 20) {
  rtp_init_params ip = {size, nullptr, false, be, be ? size : 0};
  return rtp_context_new(ip);
}

// max |a - ref| / max |ref|: one number per tensor, scale-free.
double rel_err(const std::vector<float> &a, const std::vector<float> &ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size() && i < a.size(); i++) {
    num = std::fmax(num, std::fabs((double)a[i] - ref[i]));
    den = std::fmax(den, std::fabs((double)ref[i]));
  }
  return num / (den > 0 ? den : 1);
}

std::vector<float> get_f32(const rtp_tensor *t) {
  std::vector<float> v((size_t)rtp_tensor_nelements(t));
  EXPECT_EQ(rtp_tensor_get(t, v.data(), 0, v.size() * sizeof(float)), RTP_OK)
      << rtp_last_error();
  return v;
}

// ---- ops: the same graph on both backends --------------------------------------------------

using Shape = std::vector<int64_t>;
using Build = std::function<rtp_tensor *(rtp_context *, std::vector<rtp_tensor *> &)>;

struct Input {
  Shape ne;
  bool param = true;      // differentiated
  bool positive = false;  // values in (0.5, 1.5) instead of (-1, 1)
  int index_range = 0;    // > 0: i32 indices in [0, index_range)
  int index_min = 0;      // ... shifted by this (negative or past the end: bad indices)
};

// One backend's copy of f(inputs) and loss = sum(f * R), differentiated when an input is
// a parameter, planned and computed.
struct Side {
  rtp_context *ctx = nullptr;
  std::vector<rtp_tensor *> xs;
  rtp_tensor *f = nullptr, *loss = nullptr;
  ~Side() {
    rtp_context_free(ctx);
  }

  void run(rtp_backend *be, const std::vector<Input> &inputs,
           const std::vector<std::vector<uint32_t>> &values, const std::vector<float> &r,
           const Build &build) {
    ctx = new_ctx(be);
    ASSERT_NE(ctx, nullptr) << rtp_last_error();
    bool any_param = false;
    for (size_t k = 0; k < inputs.size(); k++) {
      const Input &in = inputs[k];
      rtp_tensor *x = rtp_tensor_new(ctx, in.index_range ? RTP_TYPE_I32 : RTP_TYPE_F32,
                                     (int)in.ne.size(), in.ne.data());
      ASSERT_NE(x, nullptr) << rtp_last_error();
      ASSERT_EQ(rtp_tensor_set(x, values[k].data(), 0, values[k].size() * 4), RTP_OK)
          << rtp_last_error();
      if (in.param && !in.index_range) {
        rtp_tensor_set_param(x);
        any_param = true;
      }
      xs.push_back(x);
    }
    const char *msg = nullptr;
    f = build(ctx, xs);
    ASSERT_NE(f, nullptr) << (rtp_context_error(ctx, &msg), msg);
    f = rtp_cont(ctx, f);
    rtp_tensor_set_output(f);
    if (f->type == RTP_TYPE_F32) {
      rtp_tensor *rt = rtp_tensor_new(ctx, RTP_TYPE_F32, 4, f->ne);
      ASSERT_NE(rt, nullptr);
      ASSERT_EQ(rtp_tensor_set(rt, r.data(), 0, rtp_tensor_nbytes(rt)), RTP_OK)
          << rtp_last_error();
      loss = rtp_sum(ctx, rtp_mul(ctx, f, rt));
      ASSERT_NE(loss, nullptr) << (rtp_context_error(ctx, &msg), msg);
    }
    rtp_graph *g = rtp_graph_new(ctx, 1024);
    ASSERT_EQ(rtp_graph_build(g, loss ? loss : f), 0) << rtp_last_error();
    if (any_param && loss) {
      ASSERT_EQ(rtp_graph_build_backward(ctx, g, loss), 0) << rtp_last_error();
    }
    ASSERT_EQ(rtp_graph_plan(ctx, g), 0) << rtp_last_error();
    ASSERT_EQ(rtp_graph_compute(g, nullptr), 0) << rtp_last_error();
  }
};

// Builds f on the CPU and on the GPU from the same random inputs and compares f, the loss
// and every gradient.
void compare(rtp_backend *be, const std::string &what, const std::vector<Input> &inputs,
             const Build &build, double tol = 1e-4) {
  SCOPED_TRACE(what);
  std::mt19937 rng(42);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<std::vector<uint32_t>> values;
  for (const Input &in : inputs) {
    int64_t n = 1;
    for (int64_t d : in.ne) n *= d;
    std::vector<uint32_t> v((size_t)n);
    for (auto &e : v) {
      if (in.index_range) {
        int32_t i = in.index_min + (int32_t)(rng() % (uint32_t)in.index_range);
        std::memcpy(&e, &i, 4);
      } else {
        float x = in.positive ? 1.0f + 0.5f * u(rng) : u(rng);
        std::memcpy(&e, &x, 4);
      }
    }
    values.push_back(std::move(v));
  }
  std::vector<float> r(1 << 16);
  for (float &x : r) x = u(rng);

  Side cpu, gpu;
  ASSERT_NO_FATAL_FAILURE(cpu.run(nullptr, inputs, values, r, build));
  ASSERT_NO_FATAL_FAILURE(gpu.run(be, inputs, values, r, build));
  ASSERT_EQ(rtp_tensor_nelements(cpu.f), rtp_tensor_nelements(gpu.f));
  if (cpu.f->type == RTP_TYPE_I32) {
    std::vector<int32_t> a((size_t)rtp_tensor_nelements(cpu.f)), c(a.size());
    ASSERT_EQ(rtp_tensor_get(cpu.f, a.data(), 0, a.size() * 4), 0);
    ASSERT_EQ(rtp_tensor_get(gpu.f, c.data(), 0, c.size() * 4), 0) << rtp_last_error();
    EXPECT_EQ(a, c);
    return;
  }
  EXPECT_LE(rel_err(get_f32(gpu.f), get_f32(cpu.f)), tol) << "f";
  float lc = get_f32(cpu.loss)[0], lg = get_f32(gpu.loss)[0];
  EXPECT_NEAR(lg, lc, tol * (1.0 + std::fabs(lc))) << "loss";
  for (size_t k = 0; k < cpu.xs.size(); k++) {
    if (!(cpu.xs[k]->flags & RTP_FLAG_PARAM)) continue;
    ASSERT_NE(cpu.xs[k]->grad, nullptr);
    ASSERT_NE(gpu.xs[k]->grad, nullptr) << "input " << k;
    EXPECT_LE(rel_err(get_f32(gpu.xs[k]->grad), get_f32(cpu.xs[k]->grad)), tol)
        << "gradient of input " << k;
  }
}

class CudaOps : public Cuda, public ::testing::WithParamInterface<Shape> {};

TEST_P(CudaOps, Elementwise) {
  Shape s = GetParam(), row = {s[0]}, col = s;
  col[0] = 1;
  compare(b, "add", {{s}, {s}}, [](rtp_context *c, auto &x) { return rtp_add(c, x[0], x[1]); });
  compare(b, "add row", {{s}, {row}},
          [](rtp_context *c, auto &x) { return rtp_add(c, x[0], x[1]); });
  compare(b, "add column", {{s}, {col}},
          [](rtp_context *c, auto &x) { return rtp_add(c, x[0], x[1]); });
  compare(b, "sub row", {{s}, {row}},
          [](rtp_context *c, auto &x) { return rtp_sub(c, x[0], x[1]); });
  compare(b, "mul", {{s}, {s}}, [](rtp_context *c, auto &x) { return rtp_mul(c, x[0], x[1]); });
  compare(b, "mul row", {{s}, {row}},
          [](rtp_context *c, auto &x) { return rtp_mul(c, x[0], x[1]); });
  if (s.size() >= 3) {
    Shape mid = s;
    mid[1] = 1;
    compare(b, "mul broadcast dim 1", {{s}, {mid}},
            [](rtp_context *c, auto &x) { return rtp_mul(c, x[0], x[1]); });
  }
  compare(b, "scale", {{s}}, [](rtp_context *c, auto &x) { return rtp_scale(c, x[0], -1.7f); });
  compare(b, "dup", {{s}}, [](rtp_context *c, auto &x) { return rtp_dup(c, x[0]); });
}

TEST_P(CudaOps, Reductions) {
  Shape s = GetParam(), one = s;
  one[0] = 1;
  compare(b, "sum", {{s}}, [](rtp_context *c, auto &x) { return rtp_sum(c, x[0]); });
  compare(b, "mean", {{s}}, [](rtp_context *c, auto &x) { return rtp_mean(c, x[0]); });
  compare(b, "repeat_back", {{s}}, [one](rtp_context *c, auto &x) {
    return rtp_repeat_back(c, x[0],
                           rtp_tensor_new(c, RTP_TYPE_F32, (int)one.size(), one.data()));
  });
  compare(b, "repeat_back rows", {{s}}, [s](rtp_context *c, auto &x) {
    return rtp_repeat_back(c, x[0], rtp_tensor_new_1d(c, RTP_TYPE_F32, s[0]));
  });
  compare(b, "repeat", {{{s[0]}}}, [s](rtp_context *c, auto &x) {
    return rtp_repeat(c, x[0], rtp_tensor_new(c, RTP_TYPE_F32, (int)s.size(), s.data()));
  });
}

TEST_P(CudaOps, Activations) {
  Shape s = GetParam();
  compare(b, "gelu", {{s}}, [](rtp_context *c, auto &x) { return rtp_gelu(c, x[0]); });
  compare(b, "norm", {{s}}, [](rtp_context *c, auto &x) { return rtp_norm(c, x[0], 1e-5f); });
  compare(b, "layer_norm", {{s}, {{s[0]}}, {{s[0]}}},
          [](rtp_context *c, auto &x) { return rtp_layer_norm(c, x[0], x[1], x[2], 1e-5f); });
  compare(b, "soft_max", {{s}},
          [](rtp_context *c, auto &x) { return rtp_soft_max(c, x[0], 0.7f, false); });
  if (s[0] >= (s.size() > 1 ? s[1] : 1))
    compare(b, "soft_max causal", {{s}},
            [](rtp_context *c, auto &x) { return rtp_soft_max(c, x[0], 1.3f, true); });
}

TEST_P(CudaOps, Views) {
  Shape s = GetParam();
  while (s.size() < 3) s.push_back(1);
  compare(b, "transpose", {{s}},
          [](rtp_context *c, auto &x) { return rtp_transpose(c, x[0]); });
  compare(b, "permute", {{s}},
          [](rtp_context *c, auto &x) { return rtp_permute(c, x[0], 2, 0, 1, 3); });
  compare(b, "reshape", {{s}}, [](rtp_context *c, auto &x) {
    return rtp_reshape_2d(c, x[0], x[0]->ne[0] * x[0]->ne[1], x[0]->ne[2] * x[0]->ne[3]);
  });
  if (s[1] > 1)
    compare(b, "view_rows", {{s}}, [](rtp_context *c, auto &x) {
      int d = rtp_tensor_n_dims(x[0]) - 1;
      return rtp_view_rows(c, x[0], 1, x[0]->ne[d] - 1);
    });
  if (s[0] > 2)
    compare(b, "strided view", {{s}}, [](rtp_context *c, auto &x) {
      int64_t ne[4] = {x[0]->ne[0] - 2, x[0]->ne[1], x[0]->ne[2], x[0]->ne[3]};
      return rtp_view(c, x[0], 4, ne, x[0]->nb, sizeof(float));
    });
  for (int dim = 0; dim < 3; dim++)
    compare(b, "concat dim " + std::to_string(dim), {{s}, {s}},
            [dim](rtp_context *c, auto &x) { return rtp_concat(c, x[0], x[1], dim); });
  if (s[0] > 2)
    compare(b, "acc", {{s}, {{s[0] - 2, s[1]}}}, [](rtp_context *c, auto &x) {
      return rtp_acc(c, x[0], x[1], x[0]->nb[1], x[0]->nb[2], x[0]->nb[3], 2 * sizeof(float));
    });
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaOps,
                         ::testing::Values(Shape{7}, Shape{5, 3}, Shape{4, 4}, Shape{3, 2, 3},
                                           Shape{6, 3, 2, 2}, Shape{300, 5}, Shape{33, 70, 3}));

// repeat's backward when the sums are long and few (a bias's gradient over every token):
// cut into runs added in order (several runs, and the one-run path with few addends).
TEST_F(Cuda, RepeatBackOfLongSums) {
  const std::pair<Shape, Shape> cases[] = {{{48, 1024, 3}, {48}},
                                           {{37, 64, 40}, {1, 64, 1}},
                                           {{5, 3, 700}, {5, 3, 1}},
                                           {{2048, 16}, {2048, 1}}};
  for (const auto &[from, to] : cases)
    compare(b, "repeat_back to " + std::to_string(to.size()) + "-D", {{from}},
            [to = to](rtp_context *c, auto &x) {
              return rtp_repeat_back(
                  c, x[0], rtp_tensor_new(c, RTP_TYPE_F32, (int)to.size(), to.data()));
            });
}

TEST_F(Cuda, MulMat) {
  auto mm = [](rtp_context *c, auto &x) { return rtp_mul_mat(c, x[0], x[1]); };
  auto tr = [](rtp_context *c, rtp_tensor *t) { return rtp_transpose(c, t); };
  compare(b, "2d", {{{5, 3}}, {{5, 4}}}, mm);
  compare(b, "odd", {{{7, 1}}, {{7, 9}}}, mm);
  compare(b, "k = 1", {{{1, 6}}, {{1, 5}}}, mm);
  compare(b, "n = 1", {{{6, 4}}, {{6, 1}}}, mm);
  compare(b, "large", {{{67, 45}}, {{67, 130}}}, mm);
  compare(b, "batched", {{{4, 3, 2, 3}}, {{4, 5, 2, 3}}}, mm);
  compare(b, "shared a", {{{4, 3}}, {{4, 5, 2}}}, mm);
  compare(b, "shared a 4d", {{{4, 3}}, {{4, 5, 2, 3}}}, mm);
  compare(b, "a^T", {{{3, 5}}, {{5, 4}}},
          [tr](rtp_context *c, auto &x) { return rtp_mul_mat(c, tr(c, x[0]), x[1]); });
  compare(b, "b^T", {{{5, 3}}, {{4, 5, 2}}},
          [tr](rtp_context *c, auto &x) { return rtp_mul_mat(c, x[0], tr(c, x[1])); });
  compare(b, "both^T batched", {{{3, 5, 2}}, {{4, 5, 2}}},
          [tr](rtp_context *c, auto &x) { return rtp_mul_mat(c, tr(c, x[0]), tr(c, x[1])); });
  compare(b, "both^T 4d", {{{3, 5, 2, 3}}, {{4, 5, 2, 3}}},
          [tr](rtp_context *c, auto &x) { return rtp_mul_mat(c, tr(c, x[0]), tr(c, x[1])); });
  // Batches of b that are not one stride apart (a permuted view): a loop over dim 3.
  compare(b, "permuted batches", {{{4, 3, 2, 3}}, {{4, 5, 3, 2}}}, [](rtp_context *c, auto &x) {
    return rtp_mul_mat(c, x[0], rtp_permute(c, x[1], 0, 1, 3, 2));
  });
  // Rows that overlap (stride 2 for rows of 4): cuBLAS cannot read it, so it is copied.
  compare(b, "overlapping rows", {{{16}}, {{4, 5}}}, [](rtp_context *c, auto &x) {
    int64_t ne[2] = {4, 6};
    size_t nb[2] = {sizeof(float), 2 * sizeof(float)};
    return rtp_mul_mat(c, rtp_view(c, x[0], 2, ne, nb, 0), x[1]);
  });
  // With an addend (rtp's backward sums dx over blocks so): beta 1 on the addend's memory
  // when it dies at the product, on a copy of it when it is read later.
  auto in_place = [](rtp_context *c, auto &x) {
    return rtp__mul_mat_add(c, x[0], x[1], rtp_scale(c, x[2], 2.0f));
  };
  compare(b, "addend in place", {{{5, 3}}, {{5, 4}}, {{3, 4}}}, in_place);
  compare(b, "addend batched", {{{4, 3, 2, 3}}, {{4, 5, 2, 3}}, {{3, 5, 2, 3}}}, in_place);
  compare(b, "addend copied", {{{67, 45}}, {{67, 130}}, {{45, 130}}},
          [](rtp_context *c, auto &x) {
            rtp_tensor *s = rtp_scale(c, x[2], 2.0f);
            return rtp_add(c, rtp__mul_mat_add(c, x[0], x[1], s), s);
          });
  compare(b, "addend, k = 0", {{{0, 3}, false}, {{0, 4}, false}, {{3, 4}}}, in_place);
}

// Products of bf16 precision: operands cast to bf16 copies and multiplied by cublasGemmEx
// with f32 sums, against the CPU's f32 GEMM of the same rounded operands. Both sum the
// same exact products (bf16 x bf16 fits in f32) in their own order: 1e-5 of the largest
// element, where an f32 product of the unrounded operands is off by about 1e-3.
TEST_F(Cuda, MulMatBf16) {
  auto bf = [](rtp_tensor *y) {
    EXPECT_EQ(rtp_mul_mat_set_prec(y, RTP_TYPE_BF16), RTP_OK);
    return y;
  };
  auto mm = [bf](rtp_context *c, auto &x) { return bf(rtp_mul_mat(c, x[0], x[1])); };
  auto tr = [](rtp_context *c, rtp_tensor *t) { return rtp_transpose(c, t); };
  const double tol = 1e-5;
  compare(b, "bf16 2d", {{{5, 3}}, {{5, 4}}}, mm, tol);
  compare(b, "bf16 large", {{{67, 45}}, {{67, 130}}}, mm, tol);
  compare(b, "bf16 packed, four at a time", {{{64, 96}}, {{64, 200}}}, mm, tol);
  compare(b, "bf16 batched", {{{4, 3, 2, 3}}, {{4, 5, 2, 3}}}, mm, tol);
  compare(b, "bf16 shared a", {{{4, 3}}, {{4, 5, 2}}}, mm, tol);
  compare(
      b, "bf16 a^T", {{{3, 5}}, {{5, 4}}},
      [=](rtp_context *c, auto &x) { return bf(rtp_mul_mat(c, tr(c, x[0]), x[1])); }, tol);
  compare(
      b, "bf16 both^T 4d", {{{3, 5, 2, 3}}, {{4, 5, 2, 3}}},
      [=](rtp_context *c, auto &x) { return bf(rtp_mul_mat(c, tr(c, x[0]), tr(c, x[1]))); },
      tol);
  compare(
      b, "bf16 permuted batches", {{{4, 3, 2, 3}}, {{4, 5, 3, 2}}},
      [=](rtp_context *c, auto &x) {
        return bf(rtp_mul_mat(c, x[0], rtp_permute(c, x[1], 0, 1, 3, 2)));
      },
      tol);
}

// The parallel passes make ops write their result into a block of a larger tensor (an
// EMPTY node): columns of each row for a product (ldc > M), rows for an elementwise op.
// Built here as rtp-rotate.c's write_into does.
TEST_F(Cuda, ResultsIntoBlocks) {
  const int64_t K = 5, M = 7, N = 6, D = 4;
  std::vector<float> va(K * M), vb(K * N), vx(D * N), vr(D);
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (auto *v : {&va, &vb, &vx, &vr})
    for (float &x : *v) x = u(rng);
  std::vector<float> got[2][2];
  for (int side = 0; side < 2; side++) {
    rtp_context *ctx = new_ctx(side ? b : nullptr, 8 << 20);
    ASSERT_NE(ctx, nullptr) << rtp_last_error();
    rtp_tensor *a = rtp_tensor_new_2d(ctx, RTP_TYPE_F32, K, M);
    rtp_tensor *bb = rtp_tensor_new_2d(ctx, RTP_TYPE_F32, K, N);
    rtp_tensor *x = rtp_tensor_new_2d(ctx, RTP_TYPE_F32, D, N);
    rtp_tensor *r = rtp_tensor_new_1d(ctx, RTP_TYPE_F32, D);
    ASSERT_EQ(rtp_tensor_set(a, va.data(), 0, va.size() * 4), 0);
    ASSERT_EQ(rtp_tensor_set(bb, vb.data(), 0, vb.size() * 4), 0);
    ASSERT_EQ(rtp_tensor_set(x, vx.data(), 0, vx.size() * 4), 0);
    ASSERT_EQ(rtp_tensor_set(r, vr.data(), 0, vr.size() * 4), 0);
    // Products of rows [0, 3) and [3, M) of a, into columns of one {M, N} result.
    int64_t ne_y[4] = {M, N, 1, 1}, ne_z[4] = {D, N, 1, 1};
    rtp_tensor *y = rtp__new_node(ctx, RTP_OP_EMPTY, RTP_TYPE_F32, ne_y, nullptr, nullptr);
    rtp_tensor *z = rtp__new_node(ctx, RTP_OP_EMPTY, RTP_TYPE_F32, ne_z, nullptr, nullptr);
    ASSERT_TRUE(y && z);
    rtp_graph *g = rtp_graph_new(ctx, 64);
    int64_t first[2] = {0, 3}, len[2] = {3, M - 3};
    for (int s = 0; s < 2; s++) {
      rtp_tensor *part = rtp_mul_mat(ctx, rtp_view_rows(ctx, a, first[s], len[s]), bb);
      ASSERT_NE(part, nullptr);
      memcpy(part->nb, y->nb, sizeof(part->nb));
      part->view_src = y;
      part->view_offs = (size_t)first[s] * y->nb[0];
      part->src[2] = y;
      ASSERT_EQ(rtp_graph_build(g, part), 0) << rtp_last_error();
    }
    // Sums of rows [0, 2) and [2, N) of x and r, into rows of one {D, N} result.
    int64_t zfirst[2] = {0, 2}, zlen[2] = {2, N - 2};
    for (int s = 0; s < 2; s++) {
      rtp_tensor *part = rtp_add(ctx, rtp_view_rows(ctx, x, zfirst[s], zlen[s]), r);
      ASSERT_NE(part, nullptr);
      memcpy(part->nb, z->nb, sizeof(part->nb));
      part->view_src = z;
      part->view_offs = (size_t)zfirst[s] * z->nb[1];
      part->src[2] = z;
      ASSERT_EQ(rtp_graph_build(g, part), 0) << rtp_last_error();
    }
    rtp_tensor_set_output(y);
    rtp_tensor_set_output(z);
    ASSERT_EQ(rtp_graph_plan(ctx, g), 0) << rtp_last_error();
    ASSERT_EQ(rtp_graph_compute(g, nullptr), 0) << rtp_last_error();
    got[side][0] = get_f32(y);
    got[side][1] = get_f32(z);
    rtp_context_free(ctx);
  }
  EXPECT_LE(rel_err(got[1][0], got[0][0]), 1e-5) << "products";
  EXPECT_EQ(got[1][1], got[0][1]) << "sums";
}

TEST_F(Cuda, IndicesAndLoss) {
  auto gr = [](rtp_context *c, auto &x) { return rtp_get_rows(c, x[0], x[1]); };
  compare(b, "get_rows", {{{5, 7}}, {{4, 3}, false, false, 7}}, gr);
  compare(b, "get_rows 1d, wide", {{{300, 9}}, {{40}, false, false, 9}}, gr);
  compare(b, "get_rows many indices", {{{3, 4}}, {{2100}, false, false, 4}}, gr);
  auto ce = [](rtp_context *c, auto &x) { return rtp_cross_entropy(c, x[0], x[1]); };
  compare(b, "cross_entropy", {{{9, 4, 3}}, {{4, 3}, false, false, 9}}, ce);
  compare(b, "cross_entropy wide", {{{1000, 7}}, {{7}, false, false, 1000}}, ce);
}

// The parallel passes' block variants: indices outside [first, first + rows) give zero
// rows (forward) and are skipped (backward), without an error.
TEST_F(Cuda, RowBlocks) {
  const int64_t first = 3, rows = 4, D = 6;
  compare(b, "get_rows block", {{{D, rows}, false}, {{10}, false, false, 10}},
          [](rtp_context *c, auto &x) { return rtp__get_rows_block(c, x[0], x[1], first); });
  compare(b, "get_rows_back block", {{{D, 10}, false}, {{10}, false, false, 10}},
          [](rtp_context *c, auto &x) {
            rtp_tensor *like = rtp_tensor_new_2d(c, RTP_TYPE_F32, D, rows);
            return rtp__get_rows_back_block(c, x[0], x[1], like, first);
          });
}

TEST_F(Cuda, IntegerCopies) {
  compare(b, "dup i32", {{{5, 3}, false, false, 100}},
          [](rtp_context *c, auto &x) { return rtp_dup(c, rtp_transpose(c, x[0])); });
  compare(b, "concat i32", {{{5, 3}, false, false, 100}, {{5, 2}, false, false, 100}},
          [](rtp_context *c, auto &x) { return rtp_concat(c, x[0], x[1], 1); });
}

// bf16 tensors are copied, cast and transferred, never computed with (a product of bf16
// precision makes its own bf16 copies: MulMatBf16): casts on the way in and out, copies of
// strided views in between; the gradients come back through the same ops.
TEST_F(Cuda, Bf16) {
  auto bf = [](rtp_context *c, rtp_tensor *t) { return rtp_cast(c, t, RTP_TYPE_BF16); };
  auto f32 = [](rtp_context *c, rtp_tensor *t) { return rtp_cast(c, t, RTP_TYPE_F32); };
  compare(b, "cast", {{{7, 5}}}, [=](rtp_context *c, auto &x) { return f32(c, bf(c, x[0])); });
  compare(b, "cast of a view", {{{6, 5, 2}}}, [=](rtp_context *c, auto &x) {
    return f32(c, bf(c, rtp_permute(c, x[0], 2, 0, 1, 3)));
  });
  compare(b, "dup of a transposed view", {{{7, 5}}}, [=](rtp_context *c, auto &x) {
    return f32(c, rtp_dup(c, rtp_transpose(c, bf(c, x[0]))));
  });
  for (int dim = 0; dim < 3; dim++)
    compare(b, "concat dim " + std::to_string(dim), {{{5, 3, 2}}, {{5, 3, 2}}},
            [=](rtp_context *c, auto &x) {
              return f32(c, rtp_concat(c, bf(c, x[0]), bf(c, x[1]), dim));
            });
}

// The GPT's attention: heads as permuted views of one projection.
TEST_F(Cuda, AttentionHeads) {
  const int64_t hd = 4, H = 3, T = 5, B = 2, d = hd * H;
  compare(b, "attention", {{{3 * d, T * B}}}, [](rtp_context *c, auto &x) {
    size_t f = sizeof(float), nb[4] = {f, hd * f, 3 * d * f, 3 * d * T * f};
    int64_t ne[4] = {hd, H, T, B};
    rtp_tensor *h[3];
    for (int i = 0; i < 3; i++)
      h[i] = rtp_permute(c, rtp_view(c, x[0], 4, ne, nb, (size_t)i * d * f), 0, 2, 1, 3);
    rtp_tensor *att = rtp_soft_max(c, rtp_mul_mat(c, h[1], h[0]), 0.7f, true);
    rtp_tensor *out = rtp_mul_mat(c, rtp_transpose(c, h[2]), att);
    return rtp_cont(c, rtp_permute(c, out, 0, 2, 1, 3));
  });
}

// The fused attention op has no CUDA kernel: its builder refuses a CUDA context with
// RTP_ENOSYS naming the op, and a node of it that reaches the device anyway (cloned from a
// model built on the CPU, as rtp_parallel_new clones) is refused by the planner the same
// way, before anything runs.
TEST_F(Cuda, FusedAttentionIsRefusedCleanly) {
  rtp_context *ctx = new_ctx(b, 8 << 20);
  ASSERT_NE(ctx, nullptr) << rtp_last_error();
  rtp_tensor *qkv = rtp_tensor_new_3d(ctx, RTP_TYPE_F32, 12, 5, 2);
  EXPECT_EQ(rtp_attention_causal(ctx, qkv, 2, 0.5f), nullptr);
  const char *msg = nullptr;
  EXPECT_EQ(rtp_context_error(ctx, &msg), RTP_ENOSYS);
  EXPECT_TRUE(has(msg, "attention")) << msg;
  rtp_context_free(ctx);
  ctx = new_ctx(b, 8 << 20);
  qkv = rtp_tensor_new_3d(ctx, RTP_TYPE_F32, 12, 5, 2);
  int64_t ne_stats[4] = {5, 2, 2, 2}, ne[4] = {4, 5, 2, 1};
  rtp_tensor *stats =
      rtp__new_node(ctx, RTP_OP_EMPTY, RTP_TYPE_F32, ne_stats, nullptr, nullptr);
  rtp_tensor *y = rtp__new_node(ctx, RTP_OP_ATTENTION, RTP_TYPE_F32, ne, qkv, stats);
  y->op_params[1] = 2;
  rtp_graph *g = rtp_graph_new(ctx, 16);
  ASSERT_EQ(rtp_graph_build(g, y), 0) << rtp_last_error();
  EXPECT_EQ(rtp_graph_plan(ctx, g), RTP_ENOSYS);
  EXPECT_TRUE(has(rtp_last_error(), "attention")) << rtp_last_error();
  rtp_context_free(ctx);
}

// ---- bad indices --------------------------------------------------------------------------

TEST_F(Cuda, BadIndexIsAnErrorNotACrash) {
  rtp_context *ctx = new_ctx(b, 8 << 20);
  ASSERT_NE(ctx, nullptr) << rtp_last_error();
  rtp_tensor *a = rtp_tensor_new_2d(ctx, RTP_TYPE_F32, 4, 5);
  rtp_tensor *idx = rtp_tensor_new_1d(ctx, RTP_TYPE_I32, 3);
  rtp_tensor *tgt = rtp_tensor_new_1d(ctx, RTP_TYPE_I32, 3);
  rtp_tensor_set_param(a);
  rtp_tensor *rows = rtp_get_rows(ctx, a, idx);
  rtp_tensor *loss = rtp_cross_entropy(ctx, rows, tgt);
  rtp_graph *g = rtp_graph_new(ctx, 64);
  ASSERT_EQ(rtp_graph_build(g, loss), 0) << rtp_last_error();
  ASSERT_EQ(rtp_graph_build_backward(ctx, g, loss), 0) << rtp_last_error();
  ASSERT_EQ(rtp_graph_plan(ctx, g), 0) << rtp_last_error();
  std::vector<float> av(20, 0.5f);
  ASSERT_EQ(rtp_tensor_set(a, av.data(), 0, 80), 0);
  struct {
    int32_t idx[3], tgt[3];
    const char *op;
  } cases[] = {{{0, 5, 1}, {0, 1, 2}, "get_rows"},
               {{0, -1, 1}, {0, 1, 2}, "get_rows"},
               {{0, 4, 1}, {0, 4, 2}, "cross_entropy"},
               {{0, 4, 1}, {0, 1, -7}, "cross_entropy"}};
  for (const auto &c : cases) {
    ASSERT_EQ(rtp_tensor_set(idx, c.idx, 0, 12), 0);
    ASSERT_EQ(rtp_tensor_set(tgt, c.tgt, 0, 12), 0);
    EXPECT_EQ(rtp_graph_compute(g, nullptr), RTP_EINVAL) << c.op;
    EXPECT_TRUE(has(rtp_last_error(), "out of range")) << rtp_last_error();
    EXPECT_TRUE(has(rtp_last_error(), c.op)) << rtp_last_error();
  }
  int32_t good[3] = {0, 4, 1}, good_tgt[3] = {0, 1, 2};
  ASSERT_EQ(rtp_tensor_set(idx, good, 0, 12), 0);
  ASSERT_EQ(rtp_tensor_set(tgt, good_tgt, 0, 12), 0);
  EXPECT_EQ(rtp_graph_compute(g, nullptr), RTP_OK) << rtp_last_error();  // the flag was cleared
  EXPECT_NEAR(rtptest::f32_at(loss, 0), std::log(4.0f), 1e-5);
  rtp_context_free(ctx);
}

// ---- the GPT reference model: one training step on both backends ---------------------------

struct Model {
  rtp_context *ctx = nullptr;
  gpt m{};
  rtp_graph *g = nullptr;
  rtp_optimizer *opt = nullptr;
  ~Model() {
    rtp_context_free(ctx);
  }

  void build(rtp_backend *be, gpt_config cfg, int batch, const std::vector<int32_t> &tokens,
             rtp_adamw_params hp) {
    size_t size = gpt_arena_size(cfg, batch) + (64 << 20);
    ctx = new_ctx(be, size);
    ASSERT_NE(ctx, nullptr) << rtp_last_error();
    ASSERT_EQ(gpt_build(ctx, &m, cfg, batch), 0) << rtp_last_error();
    for (int i = 0; i < m.n_params; i++) {
      std::vector<float> w((size_t)rtp_tensor_nelements(m.params[i]));
      gpt_init_tensor(&m, i, 1234, w.data());
      ASSERT_EQ(rtp_tensor_set(m.params[i], w.data(), 0, w.size() * 4), 0) << rtp_last_error();
    }
    set_tokens(tokens);
    g = rtp_graph_new(ctx, 4096);
    ASSERT_EQ(rtp_graph_build(g, m.loss), 0) << rtp_last_error();
    ASSERT_EQ(rtp_graph_build_backward(ctx, g, m.loss), 0) << rtp_last_error();
    ASSERT_EQ(rtp_graph_plan(ctx, g), 0) << rtp_last_error();
    opt = rtp_optimizer_new(ctx, g, hp);
    ASSERT_NE(opt, nullptr) << rtp_last_error();
  }

  // tokens: T * B inputs, then T * B targets.
  void set_tokens(const std::vector<int32_t> &tokens) {
    size_t n = tokens.size() / 2;
    ASSERT_EQ(rtp_tensor_set(m.idx, tokens.data(), 0, n * 4), 0) << rtp_last_error();
    ASSERT_EQ(rtp_tensor_set(m.targets, tokens.data() + n, 0, n * 4), 0) << rtp_last_error();
  }
};

const gpt_config kTiny = {64, 16, 32, 2, 4, false, false};
const int kBatch = 3;

std::vector<int32_t> random_tokens(const gpt_config &cfg, int batch, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> t(2 * (size_t)cfg.seq_len * batch);
  for (auto &v : t) v = (int32_t)(rng() % (uint32_t)cfg.vocab);
  return t;
}

TEST_F(Cuda, GptTrainingStep) {
  rtp_adamw_params hp = {1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 1.0f};  // decay and clipping too
  std::vector<int32_t> tokens = random_tokens(kTiny, kBatch, 7);
  Model cpu, gpu;
  ASSERT_NO_FATAL_FAILURE(cpu.build(nullptr, kTiny, kBatch, tokens, hp));
  ASSERT_NO_FATAL_FAILURE(gpu.build(b, kTiny, kBatch, tokens, hp));

  ASSERT_EQ(rtp_graph_compute(cpu.g, nullptr), 0) << rtp_last_error();
  ASSERT_EQ(rtp_graph_compute(gpu.g, nullptr), 0) << rtp_last_error();
  float lc = rtptest::f32_at(cpu.m.loss, 0), lg = rtptest::f32_at(gpu.m.loss, 0);
  EXPECT_NEAR(lg, lc, 1e-4 * std::fabs(lc));
  EXPECT_LE(rel_err(get_f32(gpu.m.logits), get_f32(cpu.m.logits)), 1e-4);
  std::vector<std::vector<float>> grads;
  for (int i = 0; i < cpu.m.n_params; i++) {
    grads.push_back(get_f32(cpu.m.params[i]->grad));
    EXPECT_LE(rel_err(get_f32(gpu.m.params[i]->grad), grads.back()), 1e-4)
        << "gradient of " << cpu.m.params[i]->name;
  }

  ASSERT_EQ(rtp_optimizer_step(cpu.opt, nullptr), 0) << rtp_last_error();
  ASSERT_EQ(rtp_optimizer_step(gpu.opt, nullptr), 0) << rtp_last_error();
  float nc = rtp_optimizer_grad_norm(cpu.opt), ng = rtp_optimizer_grad_norm(gpu.opt);
  EXPECT_NEAR(ng, nc, 1e-4 * nc);
  for (int i = 0; i < cpu.m.n_params; i++) {
    // Adam's first step moves every weight by about lr * sign(g): where the true gradient
    // is zero (the key bias), rounding picks the sign, differently on each backend.
    const std::vector<float> &gr = grads[(size_t)i];
    double gmax = 0;
    for (float v : gr) gmax = std::fmax(gmax, std::fabs(v));
    std::vector<float> want = get_f32(cpu.m.params[i]), got = get_f32(gpu.m.params[i]);
    for (size_t j = 0; j < gr.size(); j++)
      if (std::fabs(gr[j]) <= 1e-3 * gmax) got[j] = want[j];
    EXPECT_LE(rel_err(got, want), 1e-4) << cpu.m.params[i]->name;
  }

  ASSERT_EQ(rtp_graph_compute(cpu.g, nullptr), 0) << rtp_last_error();
  ASSERT_EQ(rtp_graph_compute(gpu.g, nullptr), 0) << rtp_last_error();
  lc = rtptest::f32_at(cpu.m.loss, 0), lg = rtptest::f32_at(gpu.m.loss, 0);
  EXPECT_NEAR(lg, lc, 1e-3 * std::fabs(lc)) << "loss after the step";
}

TEST_F(Cuda, GptBadToken) {
  std::vector<int32_t> tokens = random_tokens(kTiny, 1, 9);
  Model gpu;
  ASSERT_NO_FATAL_FAILURE(gpu.build(b, kTiny, 1, tokens, rtp_adamw_params_default()));
  ASSERT_EQ(rtp_graph_compute(gpu.g, nullptr), 0) << rtp_last_error();
  tokens[3] = kTiny.vocab;  // one past the end of the embedding table
  ASSERT_NO_FATAL_FAILURE(gpu.set_tokens(tokens));
  EXPECT_EQ(rtp_graph_compute(gpu.g, nullptr), RTP_EINVAL);
  EXPECT_TRUE(has(rtp_last_error(), "out of range")) << rtp_last_error();
  tokens[3] = 0;
  ASSERT_NO_FATAL_FAILURE(gpu.set_tokens(tokens));
  EXPECT_EQ(rtp_graph_compute(gpu.g, nullptr), RTP_OK) << rtp_last_error();
}

// ---- the backend interface ----------------------------------------------------------------

struct DeviceBuf {
  rtp_backend *b;
  void *p = nullptr;
  DeviceBuf(rtp_backend *be, size_t n) : b(be) {
    EXPECT_EQ(b->i->alloc(b, n, &p), RTP_OK) << rtp_last_error();
  }
  ~DeviceBuf() {
    b->i->release(b, p);
  }
  float *f() {
    return (float *)p;
  }
};

TEST_F(Cuda, MemoryAndEvents) {
  std::vector<float> h(1000), back(1000);
  for (size_t i = 0; i < h.size(); i++) h[i] = (float)i * 0.5f;
  DeviceBuf d(b, h.size() * 4);
  ASSERT_EQ(b->i->set(b, d.p, h.data(), h.size() * 4), RTP_OK) << rtp_last_error();
  ASSERT_EQ(b->i->get(b, back.data(), d.p, back.size() * 4), RTP_OK) << rtp_last_error();
  EXPECT_EQ(h, back);
  ASSERT_EQ(b->i->zero(b, (char *)d.p + 40, 80), RTP_OK) << rtp_last_error();
  ASSERT_EQ(b->i->get(b, back.data(), d.p, back.size() * 4), RTP_OK);
  for (size_t i = 0; i < h.size(); i++) EXPECT_EQ(back[i], i >= 10 && i < 30 ? 0.0f : h[i]);

  void *huge = nullptr;
  EXPECT_EQ(b->i->alloc(b, (size_t)1 << 52, &huge), RTP_ENOMEM);
  EXPECT_EQ(huge, nullptr);
  EXPECT_TRUE(has(rtp_last_error(), "cudaMalloc")) << rtp_last_error();

  ASSERT_EQ(b->i->events_reserve(b, 4), RTP_OK) << rtp_last_error();
  EXPECT_EQ(b->i->record(b, RTP_STREAM_COMPUTE, 3), RTP_OK) << rtp_last_error();
  EXPECT_EQ(b->i->wait(b, RTP_STREAM_COMM, 3), RTP_OK) << rtp_last_error();
  EXPECT_EQ(b->i->record(b, RTP_STREAM_COMM, 1 << 20), RTP_EINVAL);
  EXPECT_EQ(b->i->sync(b), RTP_OK) << rtp_last_error();
}

TEST_F(Cuda, AdamAndSumOfSquares) {
  const int64_t n = 100003;  // several blocks, not a multiple of any
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> w(n), m(n), v(n), g(n);
  for (int64_t i = 0; i < n; i++) {
    w[i] = u(rng);
    m[i] = 0.1f * u(rng);
    v[i] = 0.5f + 0.5f * u(rng);
    g[i] = u(rng);
  }
  DeviceBuf dw(b, n * 4), dm(b, n * 4), dv(b, n * 4), dg(b, n * 4);
  ASSERT_EQ(b->i->set(b, dw.p, w.data(), n * 4), 0);
  ASSERT_EQ(b->i->set(b, dm.p, m.data(), n * 4), 0);
  ASSERT_EQ(b->i->set(b, dv.p, v.data(), n * 4), 0);
  ASSERT_EQ(b->i->set(b, dg.p, g.data(), n * 4), 0);

  double want = 0, got = -1;
  for (float x : g) want += (double)x * x;
  ASSERT_EQ(b->i->sumsq(b, dg.f(), n, &got), RTP_OK) << rtp_last_error();
  EXPECT_NEAR(got, want, 1e-12 * want);
  ASSERT_EQ(b->i->sumsq(b, dg.f(), 0, &got), RTP_OK);
  EXPECT_EQ(got, 0.0);

  rtp_adam_args a = {dw.f(), dm.f(), dv.f(), dg.f(), n,     0.5f,
                     0.9f,   0.95f,  1e-8f,  0.999f, 1e-3f, 0.3f};
  ASSERT_EQ(b->i->adam(b, &a), RTP_OK) << rtp_last_error();
  ASSERT_EQ(b->i->sync(b), RTP_OK) << rtp_last_error();
  std::vector<float> w2(n), m2(n), v2(n);
  ASSERT_EQ(b->i->get(b, w2.data(), dw.p, n * 4), 0);
  ASSERT_EQ(b->i->get(b, m2.data(), dm.p, n * 4), 0);
  ASSERT_EQ(b->i->get(b, v2.data(), dv.p, n * 4), 0);
  for (int64_t i = 0; i < n; i++) {  // rtp-opt.c's adam_job
    float gi = g[i] * a.gscale;
    m[i] = a.beta1 * m[i] + (1.0f - a.beta1) * gi;
    v[i] = a.beta2 * v[i] + (1.0f - a.beta2) * gi * gi;
    float denom = std::sqrt(v[i]) / a.bc2 + a.eps;
    w[i] = w[i] * a.decay - a.lr_t * m[i] / denom;
  }
  // The device rounds each operation as written; the host compiler may fuse multiply-adds.
  EXPECT_LE(rel_err(m2, m), 1e-6);
  EXPECT_LE(rel_err(v2, v), 1e-6);
  EXPECT_LE(rel_err(w2, w), 1e-6);
}

// A device arena larger than the GPU: a clear error naming the bytes asked for and the
// device's free and total memory, no context, no crash; the device still works after.
TEST_F(Cuda, ContextLargerThanDeviceFails) {
  const size_t pib = (size_t)1 << 50;
  rtp_init_params ip = {1 << 20, nullptr, false, b, pib};
  rtp_context *ctx = rtp_context_new(ip);
  EXPECT_EQ(ctx, nullptr);
  rtp_context_free(ctx);
  std::string msg = rtp_last_error();
  EXPECT_TRUE(has(msg, std::to_string(pib) + " bytes")) << msg;
  EXPECT_TRUE(has(msg, "MiB free")) << msg;
  EXPECT_TRUE(has(msg, "data_size")) << msg;
  EXPECT_TRUE(has(msg, "cuda device 0")) << msg;
  size_t free_b = 0, total_b = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_b, &total_b), cudaSuccess);
  EXPECT_TRUE(has(msg, "of " + std::to_string(total_b >> 20) + " MiB")) << msg;
  rtp_context *ok = new_ctx(b, 1 << 20);
  EXPECT_NE(ok, nullptr) << rtp_last_error();
  rtp_context_free(ok);
}

// A single rank's transfers through the executor's stream path: sendrecv to oneself
// copies on the comm stream, all-reduce leaves the buffer as it is.
TEST_F(Cuda, SingleRankTransfers) {
  rtp_comm_params cp = rtp_comm_params_default();
  rtp_comm *comm = nullptr;
  ASSERT_EQ(rtp_comm_init(&cp, &comm), 0) << rtp_last_error();
  rtp_context *ctx = new_ctx(b, 8 << 20);
  ASSERT_NE(ctx, nullptr) << rtp_last_error();
  const int n = 1000;
  rtp_tensor *send = rtp_tensor_new_1d(ctx, RTP_TYPE_F32, n);
  rtp_tensor *recv = rtp_tensor_new_1d(ctx, RTP_TYPE_F32, n);
  rtp_tensor *got = rtp_sendrecv(ctx, comm, rtp_scale(ctx, send, 3.0f), 0, recv, 0, nullptr);
  rtp_tensor *sum = rtp_allreduce(ctx, comm, rtp_scale(ctx, got, 2.0f), nullptr);
  rtp_tensor *out = rtp_add(ctx, sum, send);
  rtp_tensor_set_output(out);
  rtp_graph *g = rtp_graph_new(ctx, 64);
  ASSERT_EQ(rtp_graph_build(g, out), 0) << rtp_last_error();
  ASSERT_EQ(rtp_graph_plan(ctx, g), 0) << rtp_last_error();
  std::vector<float> x(n);
  for (int i = 0; i < n; i++) x[i] = (float)i;
  ASSERT_EQ(rtp_tensor_set(send, x.data(), 0, n * 4), 0);
  for (int rep = 0; rep < 3; rep++) {
    ASSERT_EQ(rtp_graph_compute(g, nullptr), 0) << rtp_last_error();
    std::vector<float> y = get_f32(out);
    for (int i = 0; i < n; i++) ASSERT_EQ(y[i], 7.0f * x[i]) << i;
  }
  rtp_context_free(ctx);
  rtp_comm_free(comm);
}

}  // namespace
