// The simulated device (rtp_backend_sim_new) itself: host copies through it, and its memory
// closed to any other host access, so that the tests of device paths that use it (here and
// in test-device) fail on a host access they should not make. Then the library's host paths
// on it: safetensors from and into device tensors (views too), a plan's constants, and
// checkpoints of the GPT trained on it on 1 and 2 ranks, loaded into the CPU and the device,
// all bit for bit the CPU's.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "gpt.h"
extern "C" {
#include "rtp-backend.h"
}
#include "test-gpt-ranks.h"
#include "test-util.h"

namespace {

struct Sim {
  rtp_backend *b = nullptr;
  Sim() {
    EXPECT_EQ(rtp_backend_sim_new(3, &b), RTP_OK) << rtp_last_error();
  }
  ~Sim() {
    rtp_backend_free(b);
  }
  Sim(const Sim &) = delete;
  Sim &operator=(const Sim &) = delete;
};

// A context of the simulated device with one f32 vector of n elements.
struct SimVector {
  Sim dev;
  rtp_context *ctx = nullptr;
  rtp_tensor *t = nullptr;
  explicit SimVector(int64_t n) {
    rtp_init_params ip = {1 << 20, nullptr, false, dev.b, 1 << 20};
    ctx = rtp_context_new(ip);
    if (ctx) t = rtp_tensor_new_1d(ctx, RTP_TYPE_F32, n);
  }
  ~SimVector() {
    rtp_context_free(ctx);
  }
};

TEST(Sim, NewNamesAndRefuses) {
  EXPECT_EQ(rtp_backend_sim_new(1, nullptr), RTP_EINVAL);
  Sim s;
  ASSERT_NE(s.b, nullptr);
  EXPECT_STREQ(rtp_backend_name(s.b), "sim");
  EXPECT_EQ(rtp__sim_host_touches_while_busy(s.b), 0);
  EXPECT_EQ(rtp__sim_set_order(nullptr, RTP__SIM_RANDOM), RTP_EINVAL);
  EXPECT_EQ(rtp__sim_host_touches_while_busy(nullptr), -1);
}

TEST(Sim, HostCopiesGoThroughTheBackend) {
  SimVector v(1000);
  ASSERT_NE(v.t, nullptr) << rtp_last_error();
  EXPECT_STREQ(rtp_backend_name(rtp__tensor_backend(v.t)), "sim");
  std::vector<float> x(1000), y(1000, -1.0f);
  for (size_t i = 0; i < x.size(); i++) x[i] = 0.5f * (float)i - 7.0f;
  ASSERT_EQ(rtp_tensor_set(v.t, x.data(), 0, x.size() * 4), RTP_OK);
  ASSERT_EQ(rtp_tensor_get(v.t, y.data(), 0, y.size() * 4), RTP_OK);
  EXPECT_EQ(x, y);
  float f = 0;
  ASSERT_EQ(rtp_tensor_get_f32(v.t, 999, &f), RTP_OK);
  EXPECT_EQ(f, x[999]);
  ASSERT_EQ(rtp_tensor_set_zero(v.t), RTP_OK);
  ASSERT_EQ(rtp_tensor_get_f32(v.t, 3, &f), RTP_OK);
  EXPECT_EQ(f, 0.0f);
  EXPECT_EQ(rtp__sim_host_touches_while_busy(v.dev.b), 0);
}

// A copy to or from bytes the device does not hold is refused, not made.
TEST(Sim, CopiesOutsideItsMemoryAreRefused) {
  Sim s;
  float host[4] = {1, 2, 3, 4}, out[4];
  EXPECT_EQ(s.b->i->set(s.b, host, out, sizeof(host)), RTP_EINVAL);
  EXPECT_NE(std::strstr(rtp_last_error(), "not device memory"), nullptr) << rtp_last_error();
  void *mem = nullptr;
  ASSERT_EQ(s.b->i->alloc(s.b, 100, &mem), RTP_OK);
  EXPECT_EQ(s.b->i->get(s.b, out, (char *)mem + 90, 16), RTP_EINVAL);  // runs past its end
  ASSERT_EQ(s.b->i->get(s.b, out, mem, 16), RTP_OK);
  EXPECT_TRUE(std::isnan(out[0]));  // fresh memory is NaN, so a read of it shows
  s.b->i->release(s.b, mem);
}

// A kernel's failure (an index out of range) comes back from the sync that ran it, once.
TEST(Sim, AKernelsFailureIsReportedAtSync) {
  SimVector v(8);
  ASSERT_NE(v.t, nullptr);
  rtp_tensor *ix = rtp_tensor_new_1d(v.ctx, RTP_TYPE_I32, 2);
  rtp_tensor *rows = rtp_get_rows(v.ctx, rtp_tensor_new_2d(v.ctx, RTP_TYPE_F32, 4, 2), ix);
  rtp_tensor_set_output(rows);
  rtp_graph *g = rtp_graph_new(v.ctx, 16);
  ASSERT_EQ(rtp_graph_build(g, rows), RTP_OK);
  ASSERT_EQ(rtp_graph_plan(v.ctx, g), RTP_OK) << rtp_last_error();
  const int32_t bad[2] = {1, 2}, good[2] = {1, 0};
  ASSERT_EQ(rtp_tensor_set(ix, bad, 0, sizeof(bad)), RTP_OK);
  EXPECT_EQ(rtp_graph_compute(g, nullptr), RTP_EINVAL);
  EXPECT_NE(std::strstr(rtp_last_error(), "index is out of range"), nullptr)
      << rtp_last_error();
  ASSERT_EQ(rtp_tensor_set(ix, good, 0, sizeof(good)), RTP_OK);
  EXPECT_EQ(rtp_graph_compute(g, nullptr), RTP_OK) << rtp_last_error();
}

// What the protection is for: host code that reads or writes device data directly.
TEST(SimDeathTest, HostReadOfDeviceDataFaults) {
  SimVector v(16);
  ASSERT_NE(v.t, nullptr) << rtp_last_error();
  EXPECT_DEATH(
      {
        volatile float x = *(const volatile float *)v.t->data;
        (void)x;
      },
      "");
}

TEST(SimDeathTest, HostWriteOfDeviceDataFaults) {
  SimVector v(16);
  ASSERT_NE(v.t, nullptr) << rtp_last_error();
  EXPECT_DEATH(*(volatile float *)v.t->data = 1.0f, "");
}

// ---- safetensors from and into device memory ----------------------------------------

std::string tmp_path(const std::string &name) {
  return testing::TempDir() + "rtp-sim-" + std::to_string(getpid()) + "-" + name;
}

std::vector<char> file_bytes(const std::string &path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

// Every byte of t, through rtp_tensor_get (t contiguous).
std::vector<char> bytes_of(const rtp_tensor *t) {
  std::vector<char> v(t ? rtp_tensor_nbytes(t) : 0);
  if (!t || rtp_tensor_get(t, v.data(), 0, v.size())) v.assign(1, 'X');
  return v;
}

const int64_t kCols = 37, kRows = 29;

float w_at(int64_t i) {
  return 0.25f * (float)i - 11.0f;
}

// A view of columns [c0, c0 + n) of every row of w (rows of n adjacent elements).
rtp_tensor *columns(rtp_context *ctx, rtp_tensor *w, int64_t c0, int64_t n) {
  const int64_t ne[2] = {n, w->ne[1]};
  const size_t nb[2] = {4, w->nb[1]};
  return rtp_view(ctx, w, 2, ne, nb, (size_t)c0 * 4);
}

// What the safetensors functions give with tensors on backend b (NULL: the CPU): the file
// saved from a tensor, an i32 vector and views (strided columns, one column, a block of
// rows), then, from `src` (a file the CPU saved), a load, reads into contiguous tensors and
// into strided views, and a read of rows; every result as bytes. `out` is where to save.
std::vector<std::vector<char>> safetensors_on(rtp_backend *b, const std::string &out,
                                              const std::string &src) {
  std::vector<std::vector<char>> res;
  rtp_init_params ip = {1 << 20, nullptr, false, b, b ? 1u << 20 : 0};
  rtp_context *ctx = rtp_context_new(ip);
  if (!ctx) return {{'C'}};
  rtp_tensor *w = rtp_tensor_set_name(rtp_tensor_new_2d(ctx, RTP_TYPE_F32, kCols, kRows), "w");
  rtp_tensor *ix = rtp_tensor_set_name(rtp_tensor_new_1d(ctx, RTP_TYPE_I32, 50), "ix");
  std::vector<float> wv(kCols * kRows);
  for (size_t i = 0; i < wv.size(); i++) wv[i] = w_at((int64_t)i);
  std::vector<int32_t> iv(50);
  for (size_t i = 0; i < iv.size(); i++) iv[i] = 1000 - 7 * (int32_t)i;
  EXPECT_EQ(rtp_tensor_set(w, wv.data(), 0, wv.size() * 4), RTP_OK);
  EXPECT_EQ(rtp_tensor_set(ix, iv.data(), 0, iv.size() * 4), RTP_OK);
  rtp_tensor *ts[] = {w, ix, rtp_tensor_set_name(columns(ctx, w, 3, 10), "cols"),
                      rtp_tensor_set_name(columns(ctx, w, 5, 1), "col"),
                      rtp_tensor_set_name(rtp_view_rows(ctx, w, 4, 12), "rows")};
  EXPECT_EQ(rtp_safetensors_save(out.c_str(), ts, 5, nullptr), RTP_OK) << rtp_last_error();
  res.push_back(file_bytes(out));

  rtp_safetensors *st = nullptr;
  EXPECT_EQ(rtp_safetensors_open(src.c_str(), &st), RTP_OK) << rtp_last_error();
  if (!st) {
    rtp_context_free(ctx);
    return {{'O'}};
  }
  res.push_back(bytes_of(rtp_safetensors_load(ctx, st, "w")));
  res.push_back(bytes_of(rtp_safetensors_load(ctx, st, "ix")));
  rtp_tensor *c = rtp_tensor_new_2d(ctx, RTP_TYPE_F32, 10, kRows);
  EXPECT_EQ(rtp_safetensors_read(st, "cols", c), RTP_OK) << rtp_last_error();
  res.push_back(bytes_of(c));
  // Into views of a zeroed tensor: the saved columns go back where they came from.
  rtp_tensor *z = rtp_tensor_new_2d(ctx, RTP_TYPE_F32, kCols, kRows);
  EXPECT_EQ(rtp_safetensors_read(st, "cols", columns(ctx, z, 3, 10)), RTP_OK)
      << rtp_last_error();
  EXPECT_EQ(rtp_safetensors_read(st, "col", columns(ctx, z, 20, 1)), RTP_OK)
      << rtp_last_error();
  res.push_back(bytes_of(z));
  rtp_tensor *r = rtp_tensor_new_2d(ctx, RTP_TYPE_F32, kCols, 9);
  EXPECT_EQ(rtp_safetensors_read_rows(st, "w", 17, r), RTP_OK) << rtp_last_error();
  res.push_back(bytes_of(r));
  // Rows of a strided view, read in part.
  rtp_tensor *z2 = rtp_tensor_new_2d(ctx, RTP_TYPE_F32, kCols, 5);
  EXPECT_EQ(rtp_safetensors_read_rows(st, "cols", 2, columns(ctx, z2, 1, 10)), RTP_OK)
      << rtp_last_error();
  res.push_back(bytes_of(z2));
  rtp_safetensors_close(st);
  rtp_context_free(ctx);
  return res;
}

TEST(SimIo, SafetensorsMatchTheCpuBitForBit) {
  std::string cpu = tmp_path("cpu.safetensors"), dev = tmp_path("dev.safetensors");
  std::vector<std::vector<char>> want = safetensors_on(nullptr, cpu, cpu);
  Sim s;
  std::vector<std::vector<char>> got = safetensors_on(s.b, dev, cpu);
  ASSERT_EQ(want.size(), 7u);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); i++) EXPECT_EQ(got[i], want[i]) << "result " << i;
  // Not equal for want of data: the rows read are the saved ones.
  std::vector<float> r(want[5].size() / 4);
  memcpy(r.data(), want[5].data(), want[5].size());
  ASSERT_EQ(r.size(), (size_t)(kCols * 9));
  for (size_t i = 0; i < r.size(); i++) ASSERT_EQ(r[i], w_at(17 * kCols + (int64_t)i)) << i;
  EXPECT_EQ(rtp__sim_host_touches_while_busy(s.b), 0);
  unlink(cpu.c_str());
  unlink(dev.c_str());
}

// A view whose rows are not contiguous would take a device copy per element: refused with
// a message that says what to do, before anything is written.
TEST(SimIo, TransposedDeviceViewsAreRefused) {
  SimVector v(64);
  ASSERT_NE(v.t, nullptr);
  rtp_tensor *m = rtp_tensor_new_2d(v.ctx, RTP_TYPE_F32, 8, 4);
  rtp_tensor *tr = rtp_tensor_set_name(rtp_transpose(v.ctx, m), "tr");
  ASSERT_NE(tr, nullptr) << rtp_last_error();
  std::string path = tmp_path("tr.safetensors");
  EXPECT_EQ(rtp_safetensors_save(path.c_str(), &tr, 1, nullptr), RTP_ENOSYS);
  EXPECT_NE(std::strstr(rtp_last_error(), "transposed"), nullptr) << rtp_last_error();
  EXPECT_NE(access(path.c_str(), F_OK), 0);
  rtp_tensor *c = rtp_tensor_set_name(rtp_tensor_new_2d(v.ctx, RTP_TYPE_F32, 4, 8), "tr");
  ASSERT_EQ(rtp_safetensors_save(path.c_str(), &c, 1, nullptr), RTP_OK) << rtp_last_error();
  rtp_safetensors *st = nullptr;
  ASSERT_EQ(rtp_safetensors_open(path.c_str(), &st), RTP_OK);
  EXPECT_EQ(rtp_safetensors_read(st, "tr", tr), RTP_ENOSYS);
  rtp_safetensors_close(st);
  unlink(path.c_str());
}

// ---- a plan made from a model whose constants live on the device ----------------------

// sum(x * k) for a constant k set in a model context on b, made parallel into a CPU
// context (the constants are copied into the plan's context).
float constant_sum(rtp_backend *b) {
  rtp_context *model = rtp_context_new({1 << 20, nullptr, false, b, b ? 1u << 20 : 0});
  rtp_context *ctx = rtp_context_new({4 << 20, nullptr, false, nullptr, 0});
  rtp_tensor *x = rtp_tensor_set_name(rtp_tensor_new_1d(model, RTP_TYPE_F32, 5), "x");
  rtp_tensor *k = rtp_tensor_new_1d(model, RTP_TYPE_F32, 5);
  const float kv[5] = {1.5f, -2.0f, 3.25f, 4.0f, 0.5f}, xv[5] = {1, 2, 3, 4, 5};
  EXPECT_EQ(rtp_tensor_set(k, kv, 0, sizeof(kv)), RTP_OK);
  rtp_tensor_set_param(x);
  rtp_tensor *loss = rtp_sum(model, rtp_mul(model, x, k));
  rtp_graph *g = rtp_graph_new(model, 16);
  float out = NAN;
  rtp_parallel_params pp{};
  pp.strategy = RTP_STRATEGY_NONE;
  rtp_parallel *par =
      g && !rtp_graph_build(g, loss) ? rtp_parallel_new(ctx, g, loss, &pp) : nullptr;
  EXPECT_NE(par, nullptr) << rtp_last_error();
  if (par && !rtp_graph_plan(ctx, rtp_parallel_graph(par)) &&
      !rtp_tensor_set(rtp_parallel_tensor(par, x), xv, 0, sizeof(xv)) &&
      !rtp_graph_compute(rtp_parallel_graph(par), nullptr))
    out = rtptest::f32_at(rtp_parallel_tensor(par, loss), 0);
  rtp_context_free(ctx);
  rtp_context_free(model);
  return out;
}

TEST(SimParallel, ConstantsOfADeviceModelAreCopied) {
  float want = constant_sum(nullptr);
  EXPECT_EQ(want, 1.5f - 4.0f + 9.75f + 16.0f + 2.5f);
  Sim s;
  EXPECT_EQ(constant_sum(s.b), want);
}

// ---- the optimizer's refusal of a step on NaN -----------------------------------------

// Which parameter's gradients are not finite is found by the backend's sums of squares,
// not by reading device memory: the step is refused naming it, and nothing changes.
TEST(SimOptimizer, NotFiniteGradientsAreNamedFromTheDevice) {
  Sim dev;
  rtp_context *ctx = rtp_context_new({1 << 20, nullptr, false, dev.b, 1 << 20});
  ASSERT_NE(ctx, nullptr);
  rtp_tensor *w = rtp_tensor_set_name(rtp_tensor_new_2d(ctx, RTP_TYPE_F32, 3, 2), "w");
  rtp_tensor *x = rtp_tensor_new_2d(ctx, RTP_TYPE_F32, 3, 4);
  rtp_tensor_set_param(w);
  rtp_tensor *loss = rtp_sum(ctx, rtp_mul_mat(ctx, w, x));
  rtp_graph *g = rtp_graph_new(ctx, 64);
  ASSERT_EQ(rtp_graph_build(g, loss), RTP_OK);
  ASSERT_EQ(rtp_graph_build_backward(ctx, g, loss), RTP_OK) << rtp_last_error();
  ASSERT_EQ(rtp_graph_plan(ctx, g), RTP_OK) << rtp_last_error();
  rtp_optimizer *opt = rtp_optimizer_new(ctx, g, rtp_adamw_params_default());
  ASSERT_NE(opt, nullptr) << rtp_last_error();
  const float wv[6] = {1, 2, 3, 4, 5, 6}, nan = NAN;
  ASSERT_EQ(rtp_tensor_set(w, wv, 0, sizeof(wv)), RTP_OK);
  ASSERT_EQ(rtp_tensor_fill_f32(x, 0.5f), RTP_OK);
  ASSERT_EQ(rtp_tensor_set(x, &nan, 4 * 5, 4), RTP_OK);  // the gradient of w is x's sums
  ASSERT_EQ(rtp_graph_compute(g, nullptr), RTP_OK) << rtp_last_error();
  EXPECT_EQ(rtp_optimizer_step(opt, nullptr), RTP_EINVAL);
  EXPECT_NE(std::strstr(rtp_last_error(), "gradients of 'w' are not finite"), nullptr)
      << rtp_last_error();
  float back[6];
  ASSERT_EQ(rtp_tensor_get(w, back, 0, sizeof(back)), RTP_OK);
  EXPECT_EQ(memcmp(back, wv, sizeof(wv)), 0);
  EXPECT_EQ(rtp_optimizer_steps(opt), 0);
  EXPECT_EQ(rtp__sim_host_touches_while_busy(dev.b), 0);
  rtp_context_free(ctx);
}

// ---- checkpoints of the GPT trained on the device -------------------------------------

// The reference model on this rank under a strategy over comm, on backend b (NULL: the
// CPU), its parameters from the seed: what the runs below train, save, load and reshard.
struct GptPlan {
  int rank = 0;
  rtp_strategy strategy = RTP_STRATEGY_RTP;
  gpt m{};
  rtp_context *meta = nullptr, *ctx = nullptr;
  rtp_parallel *par = nullptr;
  rtp_optimizer *opt = nullptr;

  GptPlan() = default;
  GptPlan(const GptPlan &) = delete;
  GptPlan &operator=(const GptPlan &) = delete;
  ~GptPlan() {
    rtp_context_free(ctx);
    rtp_context_free(meta);
  }
  // 0, or a code naming the stage that failed (the message goes to stderr).
  int fail(int code) const {
    fprintf(stderr, "rank %d: %s\n", rank, rtp_last_error());
    return code;
  }
  // pipe: this rank's pipeline communicator (comm NULL: one rank per stage), cutting the
  // batch into `micro` micro-batches.
  int build(rtp_comm *comm, int r, rtp_strategy s, rtp_backend *b, rtp_comm *pipe = nullptr,
            int micro = 1, rtp_schedule schedule = RTP_SCHEDULE_1F1B) {
    rank = r;
    strategy = s;
    rtp_graph *fwd;
    const int mb = rtptest::kRanksBatch / micro;
    meta = rtptest::gpt_forward(rtptest::kRanksCfg, mb, &m, &fwd);
    if (!meta) return fail(50);
    for (int i = 0; pipe && i < rtptest::kRanksCfg.n_layer; i++)  // the blocks it cuts at
      for (rtp_tensor **p = &m.blocks[i].ln_1_w; p <= &m.blocks[i].mlp_proj_b; p++)
        if (rtp_tensor_set_fsdp_unit(*p, i + 1)) return fail(50);
    size_t bytes = gpt_arena_size(rtptest::kRanksCfg, rtptest::kRanksBatch) + (16 << 20);
    ctx = rtp_context_new({bytes, nullptr, false, b, b ? bytes : 0});
    rtp_parallel_params pp{};
    pp.strategy = s;
    pp.comm = comm;
    pp.pipe_comm = pipe;
    pp.micro_batches = micro;
    pp.schedule = schedule;
    par = ctx ? rtp_parallel_new(ctx, fwd, m.loss, &pp) : nullptr;
    if (!par || rtp_graph_plan(ctx, rtp_parallel_graph(par))) return fail(51);
    for (int i = 0; i < m.n_params; i++) {
      rtp_tensor *mine = rtp_parallel_tensor(par, m.params[i]);
      if (!mine) continue;  // another stage's
      std::vector<float> full(rtp_tensor_nelements(m.params[i])),
          part(rtp_tensor_nelements(mine));
      gpt_init_tensor(&m, i, 42, full.data());
      if (rtp_parallel_shard_copy(par, m.params[i], full.data(), part.data()) ||
          rtp_tensor_set(mine, part.data(), 0, rtp_tensor_nbytes(mine)))
        return fail(52);
    }
    const int T = rtptest::kRanksCfg.seq_len, V = rtptest::kRanksCfg.vocab;
    std::vector<int32_t> idx(rtptest::kRanksBatch * T), tgt(idx.size());
    size_t seq = s == RTP_STRATEGY_TP || pipe ? 0 : (size_t)rank;  // one batch
    for (size_t i = 0; i < idx.size(); i++) {
      idx[i] = (int32_t)((7 * i + 3 * seq + 1) % V);
      tgt[i] = (int32_t)((5 * i + seq) % V);
    }
    for (int k = 0; k < micro; k++) {
      rtp_tensor *ti = rtp_parallel_micro_tensor(par, m.idx, k),
                 *tt = rtp_parallel_micro_tensor(par, m.targets, k);
      size_t n = (size_t)mb * T * 4;
      if ((ti && rtp_tensor_set(ti, idx.data() + k * mb * T, 0, n)) ||
          (tt && rtp_tensor_set(tt, tgt.data() + k * mb * T, 0, n)))
        return fail(53);
    }
    rtp_adamw_params hp = rtp_adamw_params_default();
    hp.lr = rtptest::kRanksLr;
    hp.clip_norm = 0.5f;
    opt = rtp_parallel_optimizer(par, hp);
    return opt ? 0 : fail(54);
  }
  rtp_ckpt_params ckpt(const std::string &dir, rtp_comm *comm) const {
    return {dir.c_str(), par, comm, strategy, m.params, m.n_params, opt, 0, nullptr, false};
  }
  int load(const std::string &dir, rtp_comm *comm) {
    rtp_ckpt *c = nullptr;
    rtp_ckpt_params cp = ckpt(dir, comm);
    int rc = rtp_ckpt_open(dir.c_str(), &c);
    if (!rc) rc = rtp_ckpt_load(c, &cp);
    rtp_ckpt_close(c);
    return rc ? fail(55) : 0;
  }
  int train(int steps, std::vector<float> *losses) {
    for (int s = 0; s < steps; s++) {
      if (rtp_graph_compute(rtp_parallel_graph(par), nullptr) ||
          rtp_optimizer_step(opt, nullptr))
        return fail(56);
      losses->push_back(rtptest::f32_at(rtp_parallel_tensor(par, m.loss), 0));
    }
    return 0;
  }
  int save(const std::string &dir, rtp_comm *comm) {
    rtp_ckpt_params cp = ckpt(dir, comm);
    return rtp_ckpt_save(&cp, rtp_optimizer_steps(opt)) ? fail(57) : 0;
  }
  // This rank's parameter blocks, appended to out.
  int params(std::vector<float> *out) {
    for (int i = 0; i < m.n_params; i++) {
      rtp_tensor *mine = rtp_parallel_tensor(par, m.params[i]);
      if (!mine) continue;
      std::vector<float> v(rtp_tensor_nelements(mine));
      if (rtp_tensor_get(mine, v.data(), 0, rtp_tensor_nbytes(mine))) return fail(58);
      out->insert(out->end(), v.begin(), v.end());
    }
    return 0;
  }
};

// One run: parameters from the seed or from the checkpoint in load_dir, `steps` steps,
// then a checkpoint in save_dir if set; the losses and final parameter blocks appended.
struct Run {
  rtp_strategy strategy = RTP_STRATEGY_RTP;
  rtp_backend *b = nullptr;
  int steps = 0;
  std::string load_dir, save_dir;
};

int gpt_run(rtp_comm *comm, int rank, const Run &run, std::vector<float> *losses,
            std::vector<float> *params) {
  GptPlan p;
  int rc = p.build(comm, rank, run.strategy, run.b);
  if (!rc && !run.load_dir.empty()) rc = p.load(run.load_dir, comm);
  if (!rc) rc = p.train(run.steps, losses);
  if (!rc && !run.save_dir.empty()) rc = p.save(run.save_dir, comm);
  return rc ? rc : p.params(params);
}

// Owned by the calling process: a communicator and a simulated device.
struct RankEnv {
  rtp_comm *comm = nullptr;
  rtp_backend *sim = nullptr;
  int open(int rank, int world, int port) {
    rtp_comm_params cp = rtptest::params(rank, world, port);
    if (rtp_comm_init(&cp, &comm)) return 40;
    return rtp_backend_sim_new(5u + (unsigned)rank, &sim) ? 41 : 0;
  }
  ~RankEnv() {
    rtp_backend_free(sim);
    rtp_comm_free(comm);
  }
};

// 2K steps on the CPU, against K on the device saved, then K more from that checkpoint on
// the CPU and on the device: 0 if all agree bit for bit, else which part differs or failed.
int resume_agrees(int rank, int world, int port, rtp_strategy s, const std::string &dir) {
  const int K = 2;
  RankEnv env;
  if (int rc = env.open(rank, world, port)) return rc;
  rtp_comm *comm = env.comm;
  rtp_backend *sim = env.sim;
  std::vector<float> ref, ref_p, first, first_p, cpu, cpu_p, dev, dev_p;
  int rc = gpt_run(comm, rank, {s, nullptr, 2 * K, "", ""}, &ref, &ref_p);
  if (!rc) rc = gpt_run(comm, rank, {s, sim, K, "", dir}, &first, &first_p);
  if (!rc) rc = gpt_run(comm, rank, {s, nullptr, K, dir, ""}, &cpu, &cpu_p);
  if (!rc) rc = gpt_run(comm, rank, {s, sim, K, dir, ""}, &dev, &dev_p);
  if (rc) return rc;
  if (rtp__sim_host_touches_while_busy(sim)) return 20;
  std::vector<float> head(ref.begin(), ref.begin() + K), tail(ref.begin() + K, ref.end());
  if (first != head) return 1;
  if (cpu != tail || cpu_p != ref_p) return 2;
  if (dev != tail || dev_p != ref_p) return 3;
  if (tail == head) return 4;  // training moved: the resumed steps are not the first ones
  return 0;
}

// rtp on 1 and 2 ranks; on 2, also fsdp (its blocks live in a pool) and tp (saved from
// gathered pieces, loaded as the boxes of its part that the files hold, device views).
TEST(SimCkpt, GptTrainedOnTheDeviceResumesExactlyOnCpuAndDevice) {
  const std::pair<int, rtp_strategy> runs[] = {{1, RTP_STRATEGY_RTP},
                                               {2, RTP_STRATEGY_RTP},
                                               {2, RTP_STRATEGY_FSDP},
                                               {2, RTP_STRATEGY_TP}};
  for (auto [world, s] : runs) {
    std::string dir = tmp_path("ckpt-" + std::to_string(world) + rtp_strategy_name(s));
    int port = rtptest::free_port();
    auto res = rtptest::run_procs(
        world, [&](int rank) { return resume_agrees(rank, world, port, s, dir); }, 120);
    for (int r = 0; r < world; r++)
      EXPECT_EQ(res[r].code, 0) << rtp_strategy_name(s) << " world " << world << " rank " << r;
    EXPECT_EQ(std::system(("rm -rf '" + dir + "'").c_str()), 0);
  }
}

// ---- a training state moved live between plans on the device ------------------------

// K steps of rtp, its state resharded into tp (rtp_parallel_reshard), K steps of tp, on
// backend b: the losses of both and tp's final parameters appended.
int reshard_run(rtp_comm *comm, int rank, rtp_backend *b, std::vector<float> *losses,
                std::vector<float> *params) {
  const int K = 2;
  GptPlan from, to;
  int rc = from.build(comm, rank, RTP_STRATEGY_RTP, b);
  if (!rc) rc = from.train(K, losses);
  if (!rc) rc = to.build(comm, rank, RTP_STRATEGY_TP, b);
  if (rc) return rc;
  rtp_parallel_reshard_params rp{};
  rp.job = comm;
  rp.from = from.par;
  rp.from_opt = from.opt;
  rp.to = to.par;
  rp.to_opt = to.opt;
  rp.chunk_bytes = 1000;  // several chunks per slice
  if (rtp_parallel_reshard(&rp)) return to.fail(59);
  rc = to.train(K, losses);
  return rc ? rc : to.params(params);
}

int reshard_agrees(int rank, int world, int port) {
  RankEnv env;
  if (int rc = env.open(rank, world, port)) return rc;
  std::vector<float> want, want_p, got, got_p;
  int rc = reshard_run(env.comm, rank, nullptr, &want, &want_p);
  if (!rc) rc = reshard_run(env.comm, rank, env.sim, &got, &got_p);
  if (rc) return rc;
  if (rtp__sim_host_touches_while_busy(env.sim)) return 20;
  return got == want && got_p == want_p ? 0 : 1;
}

TEST(SimReshard, RtpToTpOnTheDeviceMatchesTheCpu) {
  const int world = 2;
  int port = rtptest::free_port();
  auto res = rtptest::run_procs(
      world, [&](int rank) { return reshard_agrees(rank, world, port); }, 120);
  for (int r = 0; r < world; r++) EXPECT_EQ(res[r].code, 0) << "rank " << r;
}

// ---- a pipeline on the device -----------------------------------------------------------

// Stage `rank` of a 2-stage pipeline (one rank each, 2 micro-batches under schedule), 2
// steps on backend b: the losses and this stage's parameters appended.
int pipeline_run(rtp_comm *job, int rank, rtp_backend *b, rtp_schedule schedule,
                 std::vector<float> *losses, std::vector<float> *params) {
  rtp_comm *stage = nullptr, *pipe = nullptr;
  if (rtp_comm_mesh_2d(job, 2, 1, &stage, &pipe)) return 60;
  int rc;
  {
    GptPlan p;
    rc = p.build(nullptr, rank, RTP_STRATEGY_NONE, b, pipe, 2, schedule);
    if (!rc) rc = p.train(2, losses);
    if (!rc) rc = p.params(params);
  }
  rtp_comm_free(stage);
  rtp_comm_free(pipe);
  return rc;
}

// gpipe on the device gives the CPU's numbers; 1f1b, whose transfers would deadlock on a
// device's in-order comm stream, is refused when the plan is made.
int pipeline_agrees(int rank, int port) {
  RankEnv env;
  if (int rc = env.open(rank, 2, port)) return rc;
  std::vector<float> want, want_p, got, got_p;
  int rc = pipeline_run(env.comm, rank, nullptr, RTP_SCHEDULE_GPIPE, &want, &want_p);
  if (!rc) rc = pipeline_run(env.comm, rank, env.sim, RTP_SCHEDULE_GPIPE, &got, &got_p);
  if (rc) return rc;
  if (rtp__sim_host_touches_while_busy(env.sim)) return 20;
  if (got != want || got_p != want_p) return 1;
  rtp_comm *stage = nullptr, *pipe = nullptr;
  if (rtp_comm_mesh_2d(env.comm, 2, 1, &stage, &pipe)) return 60;
  GptPlan p;
  rc = p.build(nullptr, rank, RTP_STRATEGY_NONE, env.sim, pipe, 2, RTP_SCHEDULE_1F1B);
  bool refused = rc == 51 && std::strstr(rtp_last_error(), "gpipe schedule only");
  rtp_comm_free(stage);
  rtp_comm_free(pipe);
  return refused ? 0 : 2;
}

TEST(SimPipeline, GpipeOnTheDeviceMatchesTheCpuAnd1f1bIsRefused) {
  int port = rtptest::free_port();
  auto res = rtptest::run_procs(
      2, [&](int rank) { return pipeline_agrees(rank, port); }, 120);
  for (int r = 0; r < 2; r++) EXPECT_EQ(res[r].code, 0) << "rank " << r;
}

}  // namespace
