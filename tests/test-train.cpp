// Training end to end on one process: a small MLP and the GPT learn fixed synthetic
// tasks, with the loss falling well below where it started.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gpt.h"
#include "rtp.h"
#include "test-util.h"

namespace {

TEST(Train, MlpLearnsClassification) {
  const int in = 6, hidden = 32, classes = 4, n = 96;
  rtp_init_params ip = {16 << 20, nullptr, false, nullptr, 0};
  rtp_context *ctx = rtp_context_new(ip);
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  rtp_tensor *x = rtp_tensor_new_2d(ctx, RTP_TYPE_F32, in, n);
  rtp_tensor *y = rtp_tensor_new_1d(ctx, RTP_TYPE_I32, n);
  // Labels: the largest of four fixed random projections of a nonlinear feature.
  float proj[classes][in];
  for (auto &row : proj)
    for (float &v : row) v = nd(rng);
  for (int i = 0; i < n; i++) {
    float *xi = (float *)x->data + i * in;
    for (int k = 0; k < in; k++) xi[k] = nd(rng);
    int best = 0;
    float best_v = -1e30f;
    for (int c = 0; c < classes; c++) {
      float v = 0;
      for (int k = 0; k < in; k++) v += proj[c][k] * xi[k] * std::fabs(xi[(k + 1) % in]);
      if (v > best_v) best_v = v, best = c;
    }
    ((int32_t *)y->data)[i] = best;
  }
  rtp_tensor *w1 = rtp_tensor_new_2d(ctx, RTP_TYPE_F32, in, hidden);
  rtp_tensor *b1 = rtp_tensor_new_1d(ctx, RTP_TYPE_F32, hidden);
  rtp_tensor *w2 = rtp_tensor_new_2d(ctx, RTP_TYPE_F32, hidden, classes);
  for (rtp_tensor *w : {w1, b1, w2}) {
    for (int64_t i = 0; i < rtp_tensor_nelements(w); i++)
      ((float *)w->data)[i] = 0.3f * nd(rng);
    rtp_tensor_set_param(w);
  }
  rtp_tensor *h = rtp_gelu(ctx, rtp_add(ctx, rtp_mul_mat(ctx, w1, x), b1));
  rtp_tensor *loss = rtp_cross_entropy(ctx, rtp_mul_mat(ctx, w2, h), y);
  rtp_graph *g = rtp_graph_new(ctx, 256);
  ASSERT_EQ(rtp_graph_build(g, loss), 0) << rtp_last_error();
  ASSERT_EQ(rtp_graph_build_backward(ctx, g, loss), 0) << rtp_last_error();
  ASSERT_EQ(rtp_graph_plan(ctx, g), 0) << rtp_last_error();
  rtp_adamw_params hp = rtp_adamw_params_default();
  hp.lr = 1e-2f;
  rtp_optimizer *opt = rtp_optimizer_new(ctx, g, hp);
  ASSERT_NE(opt, nullptr);
  float first = 0, last = 0;
  for (int step = 0; step < 300; step++) {
    ASSERT_EQ(rtp_graph_compute(g, nullptr), 0);
    last = rtptest::f32_at(loss, 0);
    if (step == 0) first = last;
    ASSERT_EQ(rtp_optimizer_step(opt, nullptr), 0);
  }
  std::printf("mlp: loss %.3f -> %.3f\n", first, last);
  EXPECT_NEAR(first, std::log(4.0f), 0.8f);
  EXPECT_LT(last, 0.05f * first) << "first " << first << " last " << last;
  rtp_context_free(ctx);
}

// Windows of a fixed text: predicting the next byte needs the bytes before it.
void fill_text_batch(const std::string &text, std::mt19937 &rng, int T, int B, int32_t *idx,
                     int32_t *tgt) {
  std::uniform_int_distribution<size_t> off(0, text.size() - T - 2);
  for (int b = 0; b < B; b++) {
    size_t o = off(rng);
    for (int t = 0; t < T; t++) {
      idx[b * T + t] = (uint8_t)text[o + t];
      tgt[b * T + t] = (uint8_t)text[o + t + 1];
    }
  }
}

void train_gpt(gpt_config cfg, int batch, int steps, float lr, int threads, float *first,
               float *last) {
  rtp_init_params ip = {gpt_arena_size(cfg, batch), nullptr, false, nullptr, 0};
  rtp_context *ctx = rtp_context_new(ip);
  ASSERT_NE(ctx, nullptr);
  gpt m{};
  ASSERT_EQ(gpt_build(ctx, &m, cfg, batch), 0) << rtp_last_error();
  rtp_graph *g = rtp_graph_new(ctx, 8192);
  ASSERT_EQ(rtp_graph_build(g, m.loss), 0);
  ASSERT_EQ(rtp_graph_build_backward(ctx, g, m.loss), 0) << rtp_last_error();
  ASSERT_EQ(rtp_graph_plan(ctx, g), 0) << rtp_last_error();
  gpt_init_weights(&m, 1234);
  rtp_adamw_params hp = rtp_adamw_params_default();
  hp.lr = lr;
  rtp_optimizer *opt = rtp_optimizer_new(ctx, g, hp);
  ASSERT_NE(opt, nullptr);
  rtp_threadpool *tp = rtp_threadpool_new(threads);
  std::string text;
  for (int i = 0; i < 40; i++)
    text += "the quick brown fox jumps over the lazy dog; pack my box with five dozen jugs. ";
  std::mt19937 rng(99);
  for (int step = 0; step < steps; step++) {
    fill_text_batch(text, rng, cfg.seq_len, batch, (int32_t *)m.idx->data,
                    (int32_t *)m.targets->data);
    ASSERT_EQ(rtp_graph_compute(g, tp), 0) << rtp_last_error();
    *last = rtptest::f32_at(m.loss, 0);
    if (step == 0) *first = *last;
    ASSERT_TRUE(std::isfinite(*last));
    ASSERT_EQ(rtp_optimizer_step(opt, tp), 0);
  }
  std::printf("gpt d=%d L=%d: loss %.3f -> %.3f in %d steps\n", cfg.d_model, cfg.n_layer,
              *first, *last, steps);
  rtp_threadpool_free(tp);
  rtp_context_free(ctx);
}

TEST(Train, TinyGptLearnsText) {
  float first = 0, last = 0;
  train_gpt({256, 32, 64, 2, 4, false, false}, 4, 150, 3e-3f, 2, &first, &last);
  EXPECT_NEAR(first, std::log(256.0f), 0.5f);
  EXPECT_LT(last, 0.1f * first) << "first " << first << " last " << last;
}

TEST(TrainSlow, SmallGptLearnsText) {
  float first = 0, last = 0;
  train_gpt(gpt_config_small(), 4, 40, 1e-3f, 2, &first, &last);
  EXPECT_NEAR(first, std::log(256.0f), 0.5f);
  EXPECT_LT(last, 0.3f * first) << "first " << first << " last " << last;
}

// AdamW's decoupled decay: one step with weight_decay wd multiplies a parameter by
// 1 - lr * wd on top of the Adam update, except a RTP_FLAG_NO_DECAY one (nanoGPT decays
// neither biases nor LayerNorm weights), which takes the Adam update alone.
TEST(Train, WeightDecaySkipsNoDecayParameters) {
  const int in = 3, out = 2, n = 4;
  const float lr = 0.1f, wd = 0.5f;
  rtp_init_params ip = {4 << 20, nullptr, false, nullptr, 0};
  rtp_context *ctx = rtp_context_new(ip);
  ASSERT_NE(ctx, nullptr);
  rtp_tensor *x = rtp_tensor_new_2d(ctx, RTP_TYPE_F32, in, n);
  rtp_tensor *y = rtp_tensor_new_1d(ctx, RTP_TYPE_I32, n);
  rtp_tensor *w = rtp_tensor_new_2d(ctx, RTP_TYPE_F32, in, out);
  rtp_tensor *b = rtp_tensor_new_1d(ctx, RTP_TYPE_F32, out);
  for (int i = 0; i < in * n; i++) ((float *)x->data)[i] = 0.25f * (float)(i % 5) - 0.5f;
  for (int i = 0; i < n; i++) ((int32_t *)y->data)[i] = i % out;
  rtp_tensor_set_param(w);
  rtp_tensor_set_param(b);
  b->flags |= RTP_FLAG_NO_DECAY;
  rtp_tensor *loss = rtp_cross_entropy(ctx, rtp_add(ctx, rtp_mul_mat(ctx, w, x), b), y);
  rtp_graph *g = rtp_graph_new(ctx, 64);
  ASSERT_EQ(rtp_graph_build(g, loss), 0) << rtp_last_error();
  ASSERT_EQ(rtp_graph_build_backward(ctx, g, loss), 0) << rtp_last_error();
  ASSERT_EQ(rtp_graph_plan(ctx, g), 0) << rtp_last_error();
  rtp_adamw_params hp = rtp_adamw_params_default();
  hp.lr = lr;
  rtp_optimizer *adam = rtp_optimizer_new(ctx, g, hp);
  hp.weight_decay = wd;
  rtp_optimizer *adamw = rtp_optimizer_new(ctx, g, hp);
  ASSERT_NE(adam, nullptr);
  ASSERT_NE(adamw, nullptr);
  std::vector<float> w0(in * out), b0(out);
  for (int i = 0; i < in * out; i++) w0[i] = ((float *)w->data)[i] = 0.1f * (float)(i + 1);
  for (int i = 0; i < out; i++) b0[i] = ((float *)b->data)[i] = 0.2f * (float)(i + 1);
  ASSERT_EQ(rtp_graph_compute(g, nullptr), 0) << rtp_last_error();
  // The same gradients and fresh Adam states: only the decay differs between the two.
  ASSERT_EQ(rtp_optimizer_step(adam, nullptr), 0) << rtp_last_error();
  std::vector<float> w1(in * out), b1(out);
  std::memcpy(w1.data(), w->data, w1.size() * sizeof(float));
  std::memcpy(b1.data(), b->data, b1.size() * sizeof(float));
  std::memcpy(w->data, w0.data(), w0.size() * sizeof(float));
  std::memcpy(b->data, b0.data(), b0.size() * sizeof(float));
  ASSERT_EQ(rtp_optimizer_step(adamw, nullptr), 0) << rtp_last_error();
  for (int i = 0; i < in * out; i++) {
    EXPECT_NE(w1[i], w0[i]) << "the Adam step moved w[" << i << "]";
    EXPECT_NEAR(((float *)w->data)[i], w1[i] - lr * wd * w0[i], 1e-6f) << "w[" << i << "]";
  }
  for (int i = 0; i < out; i++) {
    EXPECT_NE(b1[i], b0[i]) << "the Adam step moved b[" << i << "]";
    EXPECT_EQ(((float *)b->data)[i], b1[i]) << "b[" << i << "] decayed";
  }
  rtp_context_free(ctx);
}

}  // namespace
