// The reference GPT against PyTorch (llm.c style): logits, loss and every parameter
// gradient for a fixed batch, then five Adam steps, from tests/fixtures/gpt-tiny.safetensors
// (scripts/gen-gpt-fixture.py, computed in float64). And the small model learns.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "gpt.h"
#include "rtp.h"
#include "test-util.h"

namespace {

const std::string kFixture = std::string(RTP_TEST_DIR) + "/fixtures/gpt-tiny.safetensors";

int meta_int(rtp_safetensors *st, const char *key) {
  const char *v = rtp_safetensors_meta(st, key);
  return v ? std::atoi(v) : -1;
}

// max |a - ref| / max |ref|: one number per tensor, scale-free.
double rel_err(const float *a, const float *ref, int64_t n) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; i++) {
    num = std::fmax(num, std::fabs((double)a[i] - ref[i]));
    den = std::fmax(den, std::fabs((double)ref[i]));
  }
  return num / (den > 0 ? den : 1);
}

struct Fixture {
  rtp_safetensors *st = nullptr;
  rtp_context *ctx = nullptr;
  gpt m{};
  rtp_graph *g = nullptr;

  void load(int threads) {
    ASSERT_EQ(rtp_safetensors_open(kFixture.c_str(), &st), 0) << rtp_last_error();
    gpt_config cfg = {meta_int(st, "vocab"),
                      meta_int(st, "seq_len"),
                      meta_int(st, "d_model"),
                      meta_int(st, "n_layer"),
                      meta_int(st, "n_head"),
                      false,
                      false};
    int batch = meta_int(st, "batch");
    ASSERT_EQ(gpt_config_check(cfg), 0);
    rtp_init_params ip = {gpt_arena_size(cfg, batch) + (64 << 20), nullptr, false, nullptr, 0};
    ctx = rtp_context_new(ip);
    ASSERT_NE(ctx, nullptr);
    ASSERT_EQ(gpt_build(ctx, &m, cfg, batch), 0) << rtp_last_error();
    for (int i = 0; i < m.n_params; i++)
      ASSERT_EQ(rtp_safetensors_read(st, m.params[i]->name, m.params[i]), 0)
          << rtp_last_error();
    ASSERT_EQ(rtp_safetensors_read(st, "input.idx", m.idx), 0) << rtp_last_error();
    ASSERT_EQ(rtp_safetensors_read(st, "input.targets", m.targets), 0) << rtp_last_error();
    g = rtp_graph_new(ctx, 4096);
    ASSERT_EQ(rtp_graph_build(g, m.loss), 0) << rtp_last_error();
    ASSERT_EQ(rtp_graph_build_backward(ctx, g, m.loss), 0) << rtp_last_error();
    ASSERT_EQ(rtp_graph_plan(ctx, g), 0) << rtp_last_error();
    (void)threads;
  }

  std::vector<float> ref(const std::string &name, int64_t n) {
    std::vector<float> v(n);
    rtp_tensor *t = rtp_safetensors_load(ctx, st, name.c_str());
    EXPECT_NE(t, nullptr) << rtp_last_error();
    if (t) {
      EXPECT_EQ(rtp_tensor_nelements(t), n) << name;
      v.assign((float *)t->data,
               (float *)t->data + std::min<int64_t>(n, rtp_tensor_nelements(t)));
    }
    return v;
  }

  ~Fixture() {
    rtp_safetensors_close(st);
    rtp_context_free(ctx);
  }
};

class GptVsTorch : public ::testing::TestWithParam<int> {};

TEST_P(GptVsTorch, LossLogitsAndGradients) {
  Fixture f;
  ASSERT_NO_FATAL_FAILURE(f.load(GetParam()));
  rtp_threadpool *tp = rtp_threadpool_new(GetParam());
  ASSERT_EQ(rtp_graph_compute(f.g, tp), 0) << rtp_last_error();

  std::vector<float> loss = f.ref("ref.loss", 1);
  EXPECT_NEAR(rtptest::f32_at(f.m.loss, 0), loss[0], 1e-4 * std::fabs(loss[0]));
  int64_t nl = rtp_tensor_nelements(f.m.logits);
  std::vector<float> logits = f.ref("ref.logits", nl);
  EXPECT_LE(rel_err((float *)f.m.logits->data, logits.data(), nl), 1e-4);

  for (int i = 0; i < f.m.n_params; i++) {
    rtp_tensor *p = f.m.params[i];
    ASSERT_NE(p->grad, nullptr) << p->name;
    std::vector<float> g = f.ref(std::string("grad.") + p->name, rtp_tensor_nelements(p));
    double e = rel_err((float *)p->grad->data, g.data(), rtp_tensor_nelements(p));
    EXPECT_LE(e, 1e-4) << "gradient of " << p->name;
  }
  rtp_threadpool_free(tp);
}

TEST_P(GptVsTorch, AdamSteps) {
  Fixture f;
  ASSERT_NO_FATAL_FAILURE(f.load(GetParam()));
  rtp_threadpool *tp = rtp_threadpool_new(GetParam());
  rtp_adamw_params hp = {1e-3f, 0.9f, 0.95f, 1e-8f, 0.0f, 0.0f};
  rtp_optimizer *opt = rtp_optimizer_new(f.ctx, f.g, hp);
  ASSERT_NE(opt, nullptr) << rtp_last_error();
  std::vector<float> losses = f.ref("ref.adam_losses", 5);
  for (int step = 0; step < 5; step++) {
    ASSERT_EQ(rtp_graph_compute(f.g, tp), 0) << rtp_last_error();
    EXPECT_NEAR(rtptest::f32_at(f.m.loss, 0), losses[step], 1e-4 * std::fabs(losses[step]))
        << "step " << step;
    ASSERT_EQ(rtp_optimizer_step(opt, tp), 0);
  }
  EXPECT_EQ(rtp_optimizer_steps(opt), 5);
  for (int i = 0; i < f.m.n_params; i++) {
    rtp_tensor *p = f.m.params[i];
    int64_t n = rtp_tensor_nelements(p);
    std::vector<float> want = f.ref(std::string("adam.") + p->name, n);
    std::vector<float> grad = f.ref(std::string("grad.") + p->name, n);
    // Adam divides by sqrt(v): where the true gradient is exactly zero (the key bias:
    // softmax ignores a constant added to a row of scores) it turns float rounding into
    // full-size steps, in PyTorch's float32 as in ours. Such elements are left out.
    double gmax = 0;
    for (float v : grad) gmax = std::fmax(gmax, std::fabs(v));
    std::vector<float> got((float *)p->data, (float *)p->data + n);
    int64_t skipped = 0;
    for (int64_t j = 0; j < n; j++)
      if (std::fabs(grad[j]) <= 1e-9 * gmax) got[j] = want[j], skipped++;
    EXPECT_LT(skipped, n) << p->name;
    EXPECT_LE(rel_err(got.data(), want.data(), n), 1e-4) << p->name;
  }
  rtp_threadpool_free(tp);
}

INSTANTIATE_TEST_SUITE_P(Threads, GptVsTorch, ::testing::Values(1, 2, 3));

}  // namespace
