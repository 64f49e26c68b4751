// Every strategy trains the same model to the same numbers: N ranks (processes over TCP
// on 127.0.0.1) with batch B each give the same losses and final parameters as one
// process with batch N x B, within float rounding. Also: rtp's memory per rank.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "gpt.h"
#include "rtp.h"
#include "test-comm-util.h"

namespace {

const gpt_config kCfg = {256, 16, 32, 2, 4};
const int kBatch = 2, kSteps = 3;

// Adam with gradient clipping low enough to act: the norm must be global over shards.
rtp_adamw_params adam() {
  rtp_adamw_params hp = rtp_adamw_default();
  hp.clip_norm = 0.5f;
  return hp;
}

// Tokens of sequence i of the global batch: the same for every world size.
void fill_sequence(int i, int T, int32_t *idx, int32_t *tgt) {
  uint32_t s = 12345u + 7919u * (uint32_t)i;
  int32_t prev = (int32_t)(s % 256);
  for (int t = 0; t < T; t++) {
    s = s * 1664525u + 1013904223u;
    int32_t next = (int32_t)((s >> 13) % 256);
    idx[t] = prev;
    tgt[t] = next;
    prev = next;
  }
}

struct Model {
  rtp_context *ctx = nullptr;
  gpt m{};
  rtp_graph *g = nullptr;
  ~Model() { rtp_free(ctx); }
};

// The one-process reference: batch world x B, K Adam steps from the initial values
// (kept in init).
bool reference(int world, std::vector<float> &losses, std::vector<float> &norms, Model &ref,
               std::vector<std::vector<bool>> &moving, std::vector<std::vector<float>> &init,
               std::vector<std::vector<float>> &grad0) {
  rtp_init_params ip = {gpt_arena_size(kCfg, world * kBatch), nullptr, false};
  ref.ctx = rtp_init(ip);
  if (gpt_build(ref.ctx, &ref.m, kCfg, world * kBatch)) return false;
  ref.g = rtp_graph_new(ref.ctx, 8192);
  if (rtp_graph_build(ref.g, ref.m.loss) || rtp_build_backward(ref.ctx, ref.g, ref.m.loss) ||
      rtp_graph_plan(ref.ctx, ref.g))
    return false;
  gpt_init_weights(&ref.m, 42);
  for (int i = 0; i < ref.m.n_params; i++) {
    const float *d = (const float *)ref.m.params[i]->data;
    init.emplace_back(d, d + rtp_nelements(ref.m.params[i]));
  }
  for (int i = 0; i < world * kBatch; i++)
    fill_sequence(i, kCfg.seq_len, (int32_t *)ref.m.idx->data + i * kCfg.seq_len,
                  (int32_t *)ref.m.targets->data + i * kCfg.seq_len);
  rtp_optimizer *opt = rtp_optimizer_new(ref.ctx, ref.g, adam());
  for (int s = 0; s < kSteps; s++) {
    if (rtp_graph_compute(ref.g, nullptr)) return false;
    losses.push_back(rtp_get_f32_1d(ref.m.loss, 0));
    // Adam divides by the gradient's own size, so where it is tiny beside the terms that
    // summed to it (zero, for the key bias) rounding decides the step: those elements
    // are left out of the comparison of parameters (gradients are compared in full).
    if (s == 0)
      for (int i = 0; i < ref.m.n_params; i++) {
        const rtp_tensor *gr = ref.m.params[i]->grad;
        float mx = 0;
        for (int64_t j = 0; j < rtp_nelements(gr); j++) mx = std::fmax(mx, std::fabs(((float *)gr->data)[j]));
        std::vector<bool> mv(rtp_nelements(gr));
        for (int64_t j = 0; j < rtp_nelements(gr); j++)
          mv[j] = std::fabs(((float *)gr->data)[j]) > 1e-3f * mx;
        moving.push_back(mv);
        grad0.emplace_back((float *)gr->data, (float *)gr->data + rtp_nelements(gr));
      }
    if (rtp_optimizer_step(opt, nullptr)) return false;
    norms.push_back(rtp_optimizer_grad_norm(opt));
  }
  return norms[0] > adam().clip_norm;  // clipping must act for the test to mean anything
}

// After the first step, each rank's gradients (of the parameter rows it holds) are the
// one-process gradients of the global batch.
bool grads_match(rtp_parallel *par, const gpt &m, const std::vector<std::vector<float>> &grad0,
                 int rank) {
  bool ok = true;
  for (int i = 0; i < m.n_params; i++) {
    int64_t first, len;
    int dim;
    rtp_parallel_block(par, m.params[i], &first, &len, &dim);
    const rtp_tensor *mine = rtp_parallel_tensor(par, m.params[i]);
    int64_t row = rtp_nelements(m.params[i]) / m.params[i]->ne[dim];
    const float *want = grad0[i].data() + first * row, *got = (const float *)mine->grad->data;
    double err = 0, scale = 0;  // scale: the whole gradient's, as a block can be all zeros
    for (float v : grad0[i]) scale = std::fmax(scale, std::fabs(v));
    for (int64_t j = 0; j < rtp_nelements(mine); j++)
      err = std::fmax(err, std::fabs(got[j] - want[j]));
    if (err > 1e-5 * scale) {
      fprintf(stderr, "rank %d: gradient of %s differs by %g (scale %g)\n", rank,
              m.params[i]->name, err, scale);
      ok = false;
    }
  }
  return ok;
}

int rank_main(rtp_strategy strategy, int rank, int world, int port) {
  std::vector<float> want, want_norm;
  Model ref;
  std::vector<std::vector<bool>> moving;
  std::vector<std::vector<float>> init, grad0;
  if (!reference(world, want, want_norm, ref, moving, init, grad0)) return 20;

  rtp_comm_params cp = rtptest::params(rank, world, port);
  rtp_comm *comm = nullptr;
  if (rtp_comm_init(&cp, &comm)) return 21;
  rtp_init_params meta_ip = {16 << 20, nullptr, true};
  rtp_context *meta = rtp_init(meta_ip);
  gpt m{};
  rtp_graph *g1 = rtp_graph_new(meta, 4096);
  if (gpt_build(meta, &m, kCfg, kBatch) || rtp_graph_build(g1, m.loss)) return 22;
  rtp_init_params ip = {gpt_arena_size(kCfg, kBatch), nullptr, false};
  rtp_context *ctx = rtp_init(ip);
  rtp_parallel_params pp = {strategy, comm, 0, 0};
  rtp_parallel *par = rtp_parallelize(ctx, g1, m.loss, &pp);
  if (!par) {
    fprintf(stderr, "rank %d: %s\n", rank, rtp_last_error());
    return 23;
  }
  rtp_graph *g = rtp_parallel_graph(par);
  if (rtp_graph_plan(ctx, g)) return 24;
  // Parameters: this rank's block of the reference's initial values.
  for (int i = 0; i < m.n_params; i++) {
    int64_t first, len;
    int dim;
    rtp_tensor *mine = rtp_parallel_tensor(par, m.params[i]);
    if (!mine || rtp_parallel_block(par, m.params[i], &first, &len, &dim)) return 25;
    int64_t row = rtp_nelements(m.params[i]) / m.params[i]->ne[dim];
    if (rtp_nelements(mine) != row * len) return 26;
    memcpy(mine->data, init[i].data() + first * row, rtp_nbytes(mine));
  }
  rtp_tensor *idx = rtp_parallel_tensor(par, m.idx), *tgt = rtp_parallel_tensor(par, m.targets);
  for (int b = 0; b < kBatch; b++)
    fill_sequence(rank * kBatch + b, kCfg.seq_len, (int32_t *)idx->data + b * kCfg.seq_len,
                  (int32_t *)tgt->data + b * kCfg.seq_len);
  // Adam's state starts from zero on both sides; the reference already ran, so its
  // parameters are the final ones to compare with.
  rtp_optimizer *opt = rtp_parallel_optimizer(par, adam());
  rtp_tensor *loss = rtp_parallel_tensor(par, m.loss);
  if (!opt || !loss) return 27;
  for (int s = 0; s < kSteps; s++) {
    if (rtp_graph_compute(g, nullptr)) {
      fprintf(stderr, "rank %d: %s\n", rank, rtp_last_error());
      return 28;
    }
    float got = rtp_get_f32_1d(loss, 0);
    if (std::fabs(got - want[s]) > 1e-5f * std::fabs(want[s])) {
      fprintf(stderr, "rank %d step %d: loss %.8f, one process %.8f\n", rank, s, got, want[s]);
      return 29;
    }
    if (s == 0 && !grads_match(par, m, grad0, rank)) return 32;
    if (rtp_optimizer_step(opt, nullptr)) return 30;
    float norm = rtp_optimizer_grad_norm(opt);
    if (std::fabs(norm - want_norm[s]) > 1e-5f * want_norm[s]) {
      fprintf(stderr, "rank %d step %d: gradient norm %g, one process %g\n", rank, s, norm,
              want_norm[s]);
      return 33;
    }
  }
  for (int i = 0; i < m.n_params; i++) {
    int64_t first, len;
    int dim;
    rtp_parallel_block(par, m.params[i], &first, &len, &dim);
    rtp_tensor *mine = rtp_parallel_tensor(par, m.params[i]);
    int64_t row = rtp_nelements(m.params[i]) / m.params[i]->ne[dim];
    const float *want_p = (const float *)ref.m.params[i]->data + first * row;
    // Relative to the weights' scale (their init std) at least: zero-initialised biases
    // hold only a few Adam steps, where 1e-5 of their own size is below float rounding.
    double err = 0, scale = 0.02;
    for (int64_t j = 0; j < rtp_nelements(mine); j++) {
      scale = std::fmax(scale, std::fabs(want_p[j]));
      if (moving[i][first * row + j])
        err = std::fmax(err, std::fabs(((float *)mine->data)[j] - want_p[j]));
    }
    if (err > 1e-5 * scale) {
      fprintf(stderr, "rank %d: %s differs by %g (scale %g)\n", rank, m.params[i]->name, err,
              scale);
      return 31;
    }
  }
  rtp_free(ctx);
  rtp_free(meta);
  rtp_comm_free(comm);
  return 0;
}

class Equivalence : public ::testing::TestWithParam<rtp_strategy> {};

TEST_P(Equivalence, NRanksMatchOneProcess) {
  for (int world : {1, 2, 3, 4}) {
    int port = rtptest::free_port();
    rtp_strategy s = GetParam();
    auto res = rtptest::run_procs(world, [&](int r) { return rank_main(s, r, world, port); }, 120);
    for (int r = 0; r < world; r++)
      EXPECT_EQ(res[r].code, 0) << rtp_strategy_name(s) << " world " << world << " rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(Strategies, Equivalence,
                         ::testing::Values(RTP_STRATEGY_DDP, RTP_STRATEGY_RTP),
                         [](const auto &info) { return std::string(rtp_strategy_name(info.param)); });

}  // namespace
