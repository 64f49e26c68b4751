// Every strategy trains the same model to the same numbers: N ranks (processes over TCP
// on 127.0.0.1) with batch B each (tp: all ranks on the whole batch N x B) give the same
// losses and final parameters as one process with batch N x B, within float rounding;
// rtp with bf16 rotation within bf16's. Also: rtp's memory per rank, and bf16's schedule
// and bytes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "gpt.h"
#include "rtp.h"
#include "test-util.h"
#include "test-gpt-ranks.h"

namespace {

const gpt_config kCfg = {256, 16, 32, 2, 4, false, false};
const int kBatch = 2, kSteps = 3;

// Adam with gradient clipping low enough to act: the norm must be global over shards.
rtp_adamw_params adam(bool clip = true) {
  rtp_adamw_params hp = rtp_adamw_params_default();
  hp.clip_norm = clip ? 0.5f : 0.0f;
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
  ~Model() {
    rtp_context_free(ctx);
  }
};

// Sets the precision of every product of g; false if one of g's products has another.
bool set_prec(rtp_graph *g, rtp_type prec, bool check) {
  for (int i = 0; i < g->n_nodes; i++) {
    rtp_tensor *t = g->nodes[i];
    if (t->op != RTP_OP_MUL_MAT) continue;
    if (check && rtp_mul_mat_get_prec(t) != prec) return false;
    if (rtp_mul_mat_set_prec(t, prec)) return false;
  }
  return true;
}

// f32 rounded to bf16 (to nearest, ties to even) and back: what the cast gives, from the
// definition on the bits.
float bf16_round(float v) {
  uint32_t u;
  memcpy(&u, &v, sizeof(u));
  uint32_t lower = u & 0xffffu, upper = u >> 16;
  if (lower > 0x8000u || (lower == 0x8000u && (upper & 1u))) upper++;
  u = upper << 16;
  memcpy(&v, &u, sizeof(v));
  return v;
}

// GPT-2's initial values with LayerNorm weights and biases moved off 1 and 0: as
// initialised, a pass that applied one of them to the wrong elements (or in the wrong
// memory) would give the same first step. The new values are bf16's, as 1 and 0 were,
// so rotating bf16 copies rounds none of them at first. (RtpBf16 keeps GPT-2's: its
// parameter bound is relative to the distance moved, which these would make
// rounding-sized after they move.)
void init_weights(gpt &m, bool moved_off) {
  gpt_init_weights(&m, 42);
  for (int i = 0; i < m.n_params && moved_off; i++) {
    rtp_tensor *p = m.params[i];
    if (rtp_tensor_n_dims(p) != 1) continue;
    float *d = (float *)p->data;
    for (int64_t j = 0; j < rtp_tensor_nelements(p); j++)
      d[j] = bf16_round(d[j] + 0.1f * std::sin(0.7f * j + i));
  }
}

// The one-process reference: batch world x B, K Adam steps from the initial values
// (kept in init). Its forward products take precision `prec`, and backward gives their
// gradient products the same (checked). Unless `any_norm`, clipping must act.
bool reference(int world, std::vector<float> &losses, std::vector<float> &norms, Model &ref,
               std::vector<std::vector<float>> &moving, std::vector<std::vector<float>> &init,
               std::vector<std::vector<float>> &grad0, rtp_type prec = RTP_TYPE_F32,
               bool moved_off = true, int steps = kSteps, bool any_norm = false,
               bool clip = true) {
  rtp_init_params ip = {gpt_arena_size(kCfg, world * kBatch), nullptr, false, nullptr, 0};
  ref.ctx = rtp_context_new(ip);
  if (gpt_build(ref.ctx, &ref.m, kCfg, world * kBatch)) return false;
  ref.g = rtp_graph_new(ref.ctx, 8192);
  if (rtp_graph_build(ref.g, ref.m.loss) || !set_prec(ref.g, prec, false) ||
      rtp_graph_build_backward(ref.ctx, ref.g, ref.m.loss) || !set_prec(ref.g, prec, true) ||
      rtp_graph_plan(ref.ctx, ref.g))
    return false;
  init_weights(ref.m, moved_off);
  for (int i = 0; i < ref.m.n_params; i++) {
    const float *d = (const float *)ref.m.params[i]->data;
    init.emplace_back(d, d + rtp_tensor_nelements(ref.m.params[i]));
  }
  for (int i = 0; i < world * kBatch; i++)
    fill_sequence(i, kCfg.seq_len, (int32_t *)ref.m.idx->data + i * kCfg.seq_len,
                  (int32_t *)ref.m.targets->data + i * kCfg.seq_len);
  rtp_optimizer *opt = rtp_optimizer_new(ref.ctx, ref.g, adam(clip));
  for (int s = 0; s < steps; s++) {
    if (rtp_graph_compute(ref.g, nullptr)) return false;
    losses.push_back(rtptest::f32_at(ref.m.loss, 0));
    // Adam divides by the gradient's own size, so where it is tiny beside the terms that
    // summed to it (zero, for the key bias) rounding decides the step: those elements
    // are left out of the comparison of parameters (gradients are compared in full).
    if (s == 0)
      for (int i = 0; i < ref.m.n_params; i++) {
        const rtp_tensor *gr = ref.m.params[i]->grad;
        float mx = 0;
        for (int64_t j = 0; j < rtp_tensor_nelements(gr); j++)
          mx = std::fmax(mx, std::fabs(((float *)gr->data)[j]));
        std::vector<float> mv(rtp_tensor_nelements(gr));
        for (int64_t j = 0; j < rtp_tensor_nelements(gr); j++)
          mv[j] = std::fabs(((float *)gr->data)[j]) > 1e-3f * mx ? 1.0f : 0.0f;
        moving.push_back(mv);
        grad0.emplace_back((float *)gr->data, (float *)gr->data + rtp_tensor_nelements(gr));
      }
    if (rtp_optimizer_step(opt, nullptr)) return false;
    norms.push_back(rtp_optimizer_grad_norm(opt));
  }
  return any_norm || !clip ||
         norms[0] > adam().clip_norm;  // clipping must act for the test to mean anything
}

// This rank's part of a whole parameter's values (or gradient, or mask).
std::vector<float> shard(rtp_parallel *par, const gpt &m, int i,
                         const std::vector<float> &full) {
  std::vector<float> mine(rtp_tensor_nelements(rtp_parallel_tensor(par, m.params[i])));
  EXPECT_EQ(rtp_parallel_shard_copy(par, m.params[i], full.data(), mine.data()), RTP_OK);
  return mine;
}

// How far this rank's part of parameter i is from the reference run's (L2), and how far
// the reference moved it from `init`, over the elements whose steps rounding does not
// decide (`moving` nonzero).
struct Distance {
  double err, moved;
};
Distance param_distance(rtp_parallel *par, const gpt &m, int i, const Model &ref,
                        const std::vector<float> &moving, const std::vector<float> &init) {
  rtp_tensor *mine = rtp_parallel_tensor(par, m.params[i]);
  const float *fin = (const float *)ref.m.params[i]->data;
  std::vector<float> want_p =
      shard(par, m, i, std::vector<float>(fin, fin + rtp_tensor_nelements(ref.m.params[i])));
  std::vector<float> mv = shard(par, m, i, moving), in = shard(par, m, i, init);
  double err = 0, moved = 0;
  for (int64_t j = 0; j < rtp_tensor_nelements(mine); j++) {
    if (mv[j] == 0.0f) continue;
    double d = ((float *)mine->data)[j] - want_p[j], t = (double)want_p[j] - in[j];
    err += d * d;
    moved += t * t;
  }
  return {std::sqrt(err), std::sqrt(moved)};
}

// After the first step, each rank's gradients (of the parameter rows it holds) are the
// one-process gradients of the global batch.
bool grads_match(rtp_parallel *par, const gpt &m, const std::vector<std::vector<float>> &grad0,
                 int rank) {
  bool ok = true;
  for (int i = 0; i < m.n_params; i++) {
    const rtp_tensor *mine = rtp_parallel_tensor(par, m.params[i]);
    std::vector<float> want = shard(par, m, i, grad0[i]);
    const float *got = (const float *)mine->grad->data;
    double err = 0, scale = 0;  // scale: the whole gradient's, as a block can be all zeros
    for (float v : grad0[i]) scale = std::fmax(scale, std::fabs(v));
    for (int64_t j = 0; j < rtp_tensor_nelements(mine); j++)
      err = std::fmax(err, std::fabs(got[j] - want[j]));
    if (err > 1e-5 * scale) {
      fprintf(stderr, "rank %d: gradient of %s differs by %g (scale %g)\n", rank,
              m.params[i]->name, err, scale);
      ok = false;
    }
  }
  return ok;
}

// tp really splits: a rank holds 1/N of q, k, v and of the MLP's hidden units, and its
// graph has Megatron's four all-reduces per layer (after each row-parallel layer in
// forward, before each column-parallel one in backward).
bool tp_is_split(rtp_parallel *par, const gpt &m, rtp_graph *g, int world) {
  int64_t d = kCfg.d_model;
  const rtp_tensor *qkv = rtp_parallel_tensor(par, m.blocks[0].c_attn_w),
                   *proj = rtp_parallel_tensor(par, m.blocks[0].mlp_proj_w);
  int comms = 0;
  for (int i = 0; i < g->n_nodes; i++) comms += g->nodes[i]->op == RTP_OP_COMM;
  if (qkv->ne[1] == 3 * d / world && proj->ne[0] == 4 * d / world && comms == 4 * kCfg.n_layer)
    return true;
  fprintf(stderr, "tp: c_attn rows %lld, mlp.c_proj columns %lld, %d all-reduces\n",
          (long long)qkv->ne[1], (long long)proj->ne[0], comms);
  return false;
}

// One rank of a job: joined to the others, the model built once for one device (its
// parameters take no memory), and this rank's graph from rtp_parallel_new. Leaving waits
// for every rank, since a rank that leaves early fails the others' transfers in flight.
struct Rank {
  rtp_comm *comm = nullptr;
  rtp_context *meta = nullptr, *ctx = nullptr;
  gpt m{};
  rtp_parallel *par = nullptr;

  rtp_comm *job = nullptr, *col = nullptr; /* join_row: the whole job and this column */

  // 0, or `code` after a failure.
  int join(int rank, int world, int port, int code) {
    rtp_comm_params cp = rtptest::params(rank, world, port);
    return rtp_comm_init(&cp, &comm) ? code : 0;
  }

  // Joins a job of rows x cols ranks as world rank `rank`; comm is this rank's row.
  int join_row(int rank, int rows, int cols, int port, int code) {
    rtp_comm_params cp = rtptest::params(rank, rows * cols, port);
    if (rtp_comm_init(&cp, &job) || rtp_comm_mesh_2d(job, rows, cols, &comm, &col)) return code;
    return 0;
  }

  // units: fsdp's units for the model's parameters (by index), instead of its blocks.
  int build(rtp_strategy strategy, gpt_config cfg, int batch, int code,
            rtp_type comm_type = RTP_TYPE_F32, rtp_type compute_type = RTP_TYPE_F32,
            int (*units)(int param) = nullptr, int micro_batches = 0, int accumulate = 0,
            bool in_backward = false) {
    rtp_graph *fwd;
    if (!(meta = rtptest::gpt_forward(cfg, batch, &m, &fwd))) return code;
    for (int i = 0; units && i < m.n_params; i++)
      if (rtp_tensor_set_fsdp_unit(m.params[i], units(i))) return code;
    rtp_init_params ip = {gpt_arena_size(cfg, batch * std::max(1, micro_batches)), nullptr,
                          false, nullptr, 0};
    ctx = rtp_context_new(ip);
    rtp_parallel_params pp{};
    pp.strategy = strategy;
    pp.comm = comm;
    pp.comm_type = comm_type;
    pp.compute_type = compute_type;
    pp.micro_batches = micro_batches;
    pp.accumulate = accumulate;
    pp.optimizer_in_backward = in_backward;
    par = rtp_parallel_new(ctx, fwd, m.loss, &pp);
    if (par) return 0;
    fprintf(stderr, "rtp_parallel_new: %s\n", rtp_last_error());
    return code + 1;
  }

  void leave() {
    rtp_comm_barrier(job ? job : comm, nullptr);
    rtp_comm_free(comm);
    comm = nullptr;
  }

  ~Rank() {
    rtp_context_free(ctx);
    rtp_context_free(meta);
    rtp_comm_free(comm);
    rtp_comm_free(col);
    rtp_comm_free(job);
  }
};

// The sequences of the global batch (world x kBatch) a rank trains on: its own kBatch,
// or under tp, which splits the model and not the batch, all of them.
struct Share {
  int batch, first_seq;
};
Share share_of(rtp_strategy strategy, int rank, int world) {
  if (strategy == RTP_STRATEGY_TP) return {world * kBatch, 0};
  return {kBatch, rank * kBatch};
}

// The rank's plan made ready to train: planned, its parameters this rank's part of init
// (f32 master weights), batch sequences from first_seq, an optimizer. 0, or the code of
// the step that failed.
int prepare_training(Rank &rk, const std::vector<std::vector<float>> &init, int batch,
                     int first_seq, rtp_graph **g, rtp_optimizer **opt, rtp_tensor **loss,
                     bool clip = true) {
  rtp_parallel *par = rk.par;
  const gpt &m = rk.m;
  *g = rtp_parallel_graph(par);
  if (rtp_graph_plan(rk.ctx, *g)) return 24;
  for (int i = 0; i < m.n_params; i++) {
    rtp_tensor *mine = rtp_parallel_tensor(par, m.params[i]);
    if (!mine || mine->type != RTP_TYPE_F32) return 25;
    if (rtp_parallel_shard_copy(par, m.params[i], init[i].data(), (float *)mine->data))
      return 26;
  }
  rtp_tensor *idx = rtp_parallel_tensor(par, m.idx), *tgt = rtp_parallel_tensor(par, m.targets);
  for (int b = 0; b < batch; b++)
    fill_sequence(first_seq + b, kCfg.seq_len, (int32_t *)idx->data + b * kCfg.seq_len,
                  (int32_t *)tgt->data + b * kCfg.seq_len);
  // Adam's state starts from zero, as the reference's did.
  *opt = rtp_parallel_optimizer(par, adam(clip));
  *loss = rtp_parallel_tensor(par, m.loss);
  return *opt && *loss ? 0 : 27;
}

// rows > 0: this process is rank `rank` of a job of rows x world ranks, and trains on its
// row of a rows x world mesh (a group of world ranks, as a pipeline stage would), as rank
// `rank % world` of a world-rank job. in_backward: with the optimizer in backward (no
// gradients are kept to compare; the losses, norms and weights are).
int rank_main(rtp_strategy strategy, int rank, int world, int port,
              int (*units)(int param) = nullptr, int rows = 0, bool in_backward = false) {
  std::vector<float> want, want_norm;
  Model ref;
  std::vector<std::vector<float>> moving;
  std::vector<std::vector<float>> init, grad0;
  if (!reference(world, want, want_norm, ref, moving, init, grad0, RTP_TYPE_F32, true, kSteps,
                 false, !in_backward))
    return 20;

  Rank rk;
  if (rows > 0) {
    if (int rc = rk.join_row(rank, rows, world, port, 21)) return rc;
    rank = rtp_comm_rank(rk.comm);
  } else if (int rc = rk.join(rank, world, port, 21)) {
    return rc;
  }
  Share sh = share_of(strategy, rank, world);
  if (int rc = rk.build(strategy, kCfg, sh.batch, 22, RTP_TYPE_F32, RTP_TYPE_F32, units, 0, 0,
                        in_backward))
    return rc;
  rtp_parallel *par = rk.par;
  const gpt &m = rk.m;
  rtp_graph *g = nullptr;
  rtp_optimizer *opt = nullptr;
  rtp_tensor *loss = nullptr;
  // The reference already ran, so its parameters are the final ones to compare with.
  if (int rc =
          prepare_training(rk, init, sh.batch, sh.first_seq, &g, &opt, &loss, !in_backward))
    return rc;
  if (strategy == RTP_STRATEGY_TP && world > 1 && !tp_is_split(par, m, g, world)) return 34;
  for (int s = 0; s < kSteps; s++) {
    if (rtp_graph_compute(g, nullptr)) {
      fprintf(stderr, "rank %d: %s\n", rank, rtp_last_error());
      return 28;
    }
    float got = rtptest::f32_at(loss, 0);
    if (std::fabs(got - want[s]) > 1e-5f * std::fabs(want[s])) {
      fprintf(stderr, "rank %d step %d: loss %.8f, one process %.8f\n", rank, s, got, want[s]);
      return 29;
    }
    if (s == 0 && !in_backward && !grads_match(par, m, grad0, rank)) return 32;
    if (rtp_optimizer_step(opt, nullptr)) return 30;
    float norm = rtp_optimizer_grad_norm(opt);
    if (std::fabs(norm - want_norm[s]) > 1e-5f * want_norm[s]) {
      fprintf(stderr, "rank %d step %d: gradient norm %g, one process %g\n", rank, s, norm,
              want_norm[s]);
      return 33;
    }
  }
  for (int i = 0; i < m.n_params; i++) {
    rtp_tensor *mine = rtp_parallel_tensor(par, m.params[i]);
    const float *fin = (const float *)ref.m.params[i]->data;
    std::vector<float> want_p =
        shard(par, m, i, std::vector<float>(fin, fin + rtp_tensor_nelements(ref.m.params[i])));
    std::vector<float> mv = shard(par, m, i, moving[i]);
    // Relative in the L2 norm of the block, with the weights' scale (init std 0.02) as the
    // floor: zero-initialised biases hold only a few Adam steps, below float rounding.
    // Adam divides by each gradient's own size, so where one is tiny beside the terms
    // that summed to it (zero, for the key bias) rounding decides its step: those
    // elements are left out (gradients themselves are compared in full above).
    double err = 0, ref2 = 0, n = 0;
    for (int64_t j = 0; j < rtp_tensor_nelements(mine); j++) {
      if (mv[j] == 0.0f) continue;
      double d = ((float *)mine->data)[j] - want_p[j];
      err += d * d;
      ref2 += (double)want_p[j] * want_p[j];
      n++;
    }
    double scale = std::fmax(std::sqrt(ref2), 0.02 * std::sqrt(n));
    err = std::sqrt(err);
    if (err > 1e-5 * scale) {
      fprintf(stderr, "rank %d: %s differs by %g (scale %g)\n", rank, m.params[i]->name, err,
              scale);
      return 31;
    }
  }
  rk.leave();
  return 0;
}

// Runs rank(r, port) in `world` processes on a free port: every rank must return 0.
// `what` names the case in a failure.
void expect_ranks_pass(int world, const std::function<int(int rank, int port)> &rank,
                       const std::string &what = "", double timeout_s = 60) {
  int port = rtptest::free_port();
  auto res = rtptest::run_procs(
      world, [&](int r) { return rank(r, port); }, timeout_s);
  for (int r = 0; r < world; r++)
    EXPECT_EQ(res[r].code, 0) << what << "world " << world << " rank " << r;
}

// The strategies the N-rank tests run, named in the tests' names as the library names them.
const auto kStrategies =
    ::testing::Values(RTP_STRATEGY_DDP, RTP_STRATEGY_FSDP, RTP_STRATEGY_TP, RTP_STRATEGY_RTP);
std::string strategy_name(const ::testing::TestParamInfo<rtp_strategy> &info) {
  return rtp_strategy_name(info.param);
}

class Equivalence : public ::testing::TestWithParam<rtp_strategy> {};

TEST_P(Equivalence, NRanksMatchOneProcess) {
  rtp_strategy s = GetParam();
  for (int world : {1, 2, 3, 4}) {
    // tp splits the tiny model's 4 heads between the ranks: 3 cannot share them (that
    // refusal is ParallelErrors.TpHeadsNotDivisible).
    if (s == RTP_STRATEGY_TP && world == 3) continue;
    expect_ranks_pass(
        world, [&](int r, int port) { return rank_main(s, r, world, port); },
        std::string(rtp_strategy_name(s)) + " ", 120);
  }
}

INSTANTIATE_TEST_SUITE_P(Strategies, Equivalence, kStrategies, strategy_name);

// The optimizer in backward: each update runs inside the compute, yet N ranks (one: the
// strategy none) take the losses, gradient norms and weights of one process whose
// optimizer steps after backward.
class InBackward : public ::testing::TestWithParam<rtp_strategy> {};

TEST_P(InBackward, NRanksMatchOneProcess) {
  rtp_strategy s = GetParam();
  for (int world : {1, 2, 3})
    expect_ranks_pass(
        world, [&](int r, int port) { return rank_main(s, r, world, port, nullptr, 0, true); },
        std::string(rtp_strategy_name(s)) + " in backward ", 120);
}

INSTANTIATE_TEST_SUITE_P(Strategies, InBackward,
                         ::testing::Values(RTP_STRATEGY_FSDP, RTP_STRATEGY_RTP), strategy_name);

// A strategy runs on whatever communicator it is given: on each row of a 2 x 2 mesh (two
// groups training at once over the job's connections, as two pipeline stages' groups
// would), every rank trains exactly as the same rank of a 2-rank job.
class OnGroups : public ::testing::TestWithParam<rtp_strategy> {};

TEST_P(OnGroups, EachRowMatchesOneProcess) {
  rtp_strategy s = GetParam();
  expect_ranks_pass(
      4, [&](int r, int port) { return rank_main(s, r, 2, port, nullptr, 2); },
      std::string(rtp_strategy_name(s)) + " on rows ", 120);
}

INSTANTIATE_TEST_SUITE_P(Strategies, OnGroups, kStrategies, strategy_name);

// fsdp gathers whatever units the model marks, not only blocks (Equivalence's): every
// parameter alone, the whole model as one unit, and three units whose parameters
// interleave, so that ops keep needing a unit that was evicted (gathered again) or one
// still held by the other slot (read in place). Each trains as one process does.
TEST(FsdpUnits, AnyGroupingMatchesOneProcess) {
  int (*const groupings[])(int) = {[](int) { return 0; }, [](int) { return 1; },
                                   [](int i) { return i % 3 + 1; }};
  for (int k = 0; k < 3; k++)
    for (int world : {2, 3}) {
      expect_ranks_pass(
          world,
          [&](int r, int port) {
            return rank_main(RTP_STRATEGY_FSDP, r, world, port, groupings[k]);
          },
          "grouping " + std::to_string(k) + " ", 120);
    }
}

// ---- rtp with bf16 rotation ----------------------------------------------------------

// One process, batch world x B, with the initial weights rounded to bf16: the first step's
// loss and gradients, which N ranks rotating bf16 copies compute with.
bool rounded_reference(int world, float *loss, std::vector<std::vector<float>> &grads) {
  Model ref;
  rtp_init_params ip = {gpt_arena_size(kCfg, world * kBatch), nullptr, false, nullptr, 0};
  ref.ctx = rtp_context_new(ip);
  if (gpt_build(ref.ctx, &ref.m, kCfg, world * kBatch)) return false;
  ref.g = rtp_graph_new(ref.ctx, 8192);
  if (rtp_graph_build(ref.g, ref.m.loss) ||
      rtp_graph_build_backward(ref.ctx, ref.g, ref.m.loss) || rtp_graph_plan(ref.ctx, ref.g))
    return false;
  init_weights(ref.m, false);
  for (int i = 0; i < ref.m.n_params; i++) {
    float *d = (float *)ref.m.params[i]->data;
    for (int64_t j = 0; j < rtp_tensor_nelements(ref.m.params[i]); j++) d[j] = bf16_round(d[j]);
  }
  for (int i = 0; i < world * kBatch; i++)
    fill_sequence(i, kCfg.seq_len, (int32_t *)ref.m.idx->data + i * kCfg.seq_len,
                  (int32_t *)ref.m.targets->data + i * kCfg.seq_len);
  if (rtp_graph_compute(ref.g, nullptr)) return false;
  *loss = rtptest::f32_at(ref.m.loss, 0);
  for (int i = 0; i < ref.m.n_params; i++) {
    const rtp_tensor *gr = ref.m.params[i]->grad;
    grads.emplace_back((float *)gr->data, (float *)gr->data + rtp_tensor_nelements(gr));
  }
  return true;
}

// The largest difference of this rank's gradients from `want` (whole gradients), relative
// to each whole gradient's largest element.
double grad_error(rtp_parallel *par, const gpt &m,
                  const std::vector<std::vector<float>> &want) {
  double worst = 0;
  for (int i = 0; i < m.n_params; i++) {
    const rtp_tensor *mine = rtp_parallel_tensor(par, m.params[i]);
    std::vector<float> w = shard(par, m, i, want[i]);
    double err = 0, scale = 0;
    for (float v : want[i]) scale = std::fmax(scale, std::fabs(v));
    for (int64_t j = 0; j < rtp_tensor_nelements(mine); j++)
      err = std::fmax(err, std::fabs(((float *)mine->grad->data)[j] - w[j]));
    worst = std::fmax(worst, err / scale);
  }
  return worst;
}

int count_op(const rtp_graph *g, rtp_op op) {
  int n = 0;
  for (int i = 0; i < g->n_nodes; i++) n += g->nodes[i]->op == op;
  return n;
}

// N ranks rotating bf16 copies against one process in f32 (batch N x B, the same data).
// bf16 keeps 8 significant bits: a rounding moves a value by at most 2^-9 of itself.
//  - Forward: every rank computes with the bf16-rounded blocks (its own too), so the
//    first loss is the one-process loss of the rounded weights to f32 precision (1e-6:
//    a few ulps), and differs from the exact weights' loss by more (proof that the blocks
//    were rounded; 7e-6 to 9e-6 here).
//  - Backward: each of the N - 1 hops of a gradient rounds a partial sum, of the order of
//    the gradient, by 2^-9 of it: first gradients within N 2^-9 of the largest element of
//    the rounded-weights reference, and (proof that the sums travel in bf16) further from
//    it than f32 sums would be (1e-4, 10x f32's bound of 1e-5; 2e-3 to 4e-3 here).
//    The gradient norm inherits that bound.
//  - Losses of all steps against the exact f32 run: rounding every weight by 2^-9 in the
//    worst (same) direction changes the loss by at most 2^-9 sum |w dL/dw| to first order
//    (4e-4 to 7e-4 of it here); twice that covers what three Adam steps add (errors are
//    2e-5 at most here: the roundings' signs are random).
//  - Parameters after three steps: Adam's first steps move an element by about lr in its
//    gradient's direction, and bf16 sums flip that direction where a gradient is within
//    rounding of zero; within 25% of the distance the f32 run moved them (12% at worst
//    here, for small biases; a lost or doubled gradient is 50% or more).
// One rank has nothing to rotate and no casts: f32 results, within the f32 test's 1e-5.
int rank_main_bf16(int rank, int world, int port) {
  std::vector<float> want, want_norm;
  Model ref;
  std::vector<std::vector<float>> moving, init, grad0, grad_r;
  float loss_r = 0;
  if (!reference(world, want, want_norm, ref, moving, init, grad0, RTP_TYPE_F32, false))
    return 20;
  if (!rounded_reference(world, &loss_r, grad_r)) return 19;
  double first_order = 0;
  for (size_t i = 0; i < init.size(); i++)
    for (size_t j = 0; j < init[i].size(); j++)
      first_order += std::fabs(init[i][j] * grad0[i][j]);
  double loss_tol = world == 1 ? 1e-5 : 2.0 * first_order / 512.0 / std::fabs(want[0]);
  double grad_tol = world == 1 ? 1e-5 : world / 512.0, param_tol = world == 1 ? 1e-3 : 0.25;

  Rank rk;
  if (int rc = rk.join(rank, world, port, 21)) return rc;
  if (int rc = rk.build(RTP_STRATEGY_RTP, kCfg, kBatch, 22, RTP_TYPE_BF16)) return rc;
  rtp_parallel *par = rk.par;
  const gpt &m = rk.m;
  rtp_graph *g = nullptr;
  rtp_optimizer *opt = nullptr;
  rtp_tensor *loss = nullptr;
  // (it checks that the master weights stay f32)
  if (int rc = prepare_training(rk, init, kBatch, rank * kBatch, &g, &opt, &loss)) return rc;
  for (int s = 0; s < kSteps; s++) {
    if (rtp_graph_compute(g, nullptr)) {
      fprintf(stderr, "rank %d: %s\n", rank, rtp_last_error());
      return 28;
    }
    float got = rtptest::f32_at(loss, 0);
    if (std::fabs(got - want[s]) > loss_tol * std::fabs(want[s])) {
      fprintf(stderr, "rank %d step %d: loss %.8f, one process in f32 %.8f (tolerance %.2g)\n",
              rank, s, got, want[s], loss_tol);
      return 29;
    }
    if (s == 0 && world > 1) {
      double rounded = std::fabs(got - loss_r) / std::fabs(loss_r);
      double exact = std::fabs(got - want[0]) / std::fabs(want[0]);
      if (rounded > 1e-6 || exact <= 1e-6) {
        fprintf(stderr,
                "rank %d: first loss %.8f: %.3g from the rounded weights' %.8f, %.3g "
                "from the exact weights' %.8f: the blocks were not (all) rounded to bf16\n",
                rank, got, rounded, loss_r, exact, want[0]);
        return 36;
      }
      double err = grad_error(par, m, grad_r);
      if (err > grad_tol || err < 1e-4) {
        fprintf(stderr,
                "rank %d: gradients differ from the rounded weights' by %.3g of their "
                "largest element (want 1e-4 .. %.3g: bf16 partial sums)\n",
                rank, err, grad_tol);
        return 32;
      }
    } else if (s == 0 && grad_error(par, m, grad0) > 1e-5) {  // world 1: nothing travels
      fprintf(stderr, "rank %d: gradients differ from one process's\n", rank);
      return 32;
    }
    if (rtp_optimizer_step(opt, nullptr)) return 30;
    float norm = rtp_optimizer_grad_norm(opt);
    if (std::fabs(norm - want_norm[s]) > grad_tol * want_norm[s]) {
      fprintf(stderr, "rank %d step %d: gradient norm %g, one process %g\n", rank, s, norm,
              want_norm[s]);
      return 33;
    }
  }
  for (int i = 0; i < m.n_params; i++) {
    Distance d = param_distance(par, m, i, ref, moving[i], init[i]);
    if (d.err > param_tol * d.moved) {
      fprintf(stderr, "rank %d: %s is %g from the f32 run's, which moved %g\n", rank,
              m.params[i]->name, d.err, d.moved);
      return 31;
    }
  }
  rk.leave();
  return 0;
}

TEST(RtpBf16, NRanksMatchOneProcess) {
  for (int world : {1, 2, 3, 4}) {
    expect_ranks_pass(
        world, [&](int r, int port) { return rank_main_bf16(r, world, port); }, "", 120);
  }
}

// ---- mixed precision: products of bf16 operands -----------------------------------------

// N ranks with compute_type bf16 against one process whose products are all bf16 (the
// same global batch), and against f32 training.
//  - Against the bf16 process: the ranks compute each product's operands in another order
//    or split (sums over ranks, tp's partial sums, products over blocks of rows), so they
//    differ from the process's by f32 rounding (about 1e-7 of a value), as in the f32 test.
//    Where that moves an operand across a bf16 rounding boundary, its rounded value differs
//    by a whole bf16 step (2^-8 of it): rare (an operand within 1e-7 of a boundary 2^-8
//    wide, one in 10^4 to 10^5), but each such term of a sum is off by 4e-3 of itself, so
//    the f32 test's 1e-5 would be luck. Bounds: losses 1e-4 relative, first gradients 1e-3
//    of each tensor's largest element (a few flipped terms of that size), parameters after
//    three Adam steps 5% of the distance they moved (Adam steps a small gradient's element
//    by about lr in its direction, which a flip can reverse). Measured here: losses within
//    4e-7, gradients 1.3e-5, parameters 0.1%.
//  - Against f32 training: every operand moves by up to 2^-9 of itself; the losses of a few
//    steps stay within 1e-2 relative (measured: 2e-5).
// rtp with comm_type bf16 too: the blocks arrive rounded and rounding them again is exact,
// so the first loss is the bf16 process's as above; then the gradients, summed in bf16 on
// their way (RtpBf16), move Adam's steps: later losses within 1e-3, and the gradients and
// parameters are RtpBf16's to check.
int rank_main_mixed(rtp_strategy strategy, rtp_type comm_type, int rank, int world, int port) {
  std::vector<float> want, want_norm, want32, norm32;
  Model ref, ref32;
  std::vector<std::vector<float>> moving, init, grad0, moving32, init32, grad32;
  if (!reference(world, want, want_norm, ref, moving, init, grad0, RTP_TYPE_BF16)) return 20;
  if (!reference(world, want32, norm32, ref32, moving32, init32, grad32)) return 19;
  const bool exact_comm = comm_type == RTP_TYPE_F32;
  const double grad_tol = 1e-3, param_tol = 0.05;

  Rank rk;
  if (int rc = rk.join(rank, world, port, 21)) return rc;
  Share sh = share_of(strategy, rank, world);
  if (int rc = rk.build(strategy, kCfg, sh.batch, 22, comm_type, RTP_TYPE_BF16)) return rc;
  rtp_parallel *par = rk.par;
  const gpt &m = rk.m;
  rtp_graph *g = nullptr;
  rtp_optimizer *opt = nullptr;
  rtp_tensor *loss = nullptr;
  if (int rc = prepare_training(rk, init, sh.batch, sh.first_seq, &g, &opt, &loss)) return rc;
  if (!set_prec(g, RTP_TYPE_BF16, true)) {
    fprintf(stderr, "rank %d: a product of the rank's graph is not bf16\n", rank);
    return 35;
  }
  double worst_loss = 0, worst_grad = 0, worst_param = 0, worst32 = 0;
  for (int s = 0; s < kSteps; s++) {
    if (rtp_graph_compute(g, nullptr)) {
      fprintf(stderr, "rank %d: %s\n", rank, rtp_last_error());
      return 28;
    }
    float got = rtptest::f32_at(loss, 0);
    double err = std::fabs(got - want[s]) / std::fabs(want[s]);
    double err32 = std::fabs(got - want32[s]) / std::fabs(want32[s]);
    worst_loss = std::fmax(worst_loss, err), worst32 = std::fmax(worst32, err32);
    if (err > (exact_comm || s == 0 ? 1e-4 : 1e-3) || err32 > 1e-2) {
      fprintf(stderr, "rank %d step %d: loss %.8f, one process %.8f in bf16, %.8f in f32\n",
              rank, s, got, want[s], want32[s]);
      return 29;
    }
    if (s == 0 && exact_comm && (worst_grad = grad_error(par, m, grad0)) > grad_tol) {
      fprintf(stderr, "rank %d: gradients differ by %.3g of their largest element\n", rank,
              worst_grad);
      return 32;
    }
    if (rtp_optimizer_step(opt, nullptr)) return 30;
  }
  for (int i = 0; i < m.n_params && exact_comm; i++) {
    Distance d = param_distance(par, m, i, ref, moving[i], init[i]);
    worst_param = std::fmax(worst_param, d.err / d.moved);
    if (d.err > param_tol * d.moved) {
      fprintf(stderr, "rank %d: %s is %g from the bf16 process's, which moved %g\n", rank,
              m.params[i]->name, d.err, d.moved);
      return 31;
    }
  }
  if (rank == 0)
    printf(
        "%s world %d comm %s: losses within %.2g of the bf16 process (%.2g of f32), "
        "gradients %.2g, parameters %.2g\n",
        rtp_strategy_name(strategy), world, rtp_type_name(comm_type), worst_loss, worst32,
        worst_grad, worst_param);
  rk.leave();
  return 0;
}

class MixedPrecision : public ::testing::TestWithParam<rtp_strategy> {};

TEST_P(MixedPrecision, NRanksMatchOneProcess) {
  rtp_strategy s = GetParam();
  for (int world : {1, 2, 3, 4}) {
    if (s == RTP_STRATEGY_TP && world == 3) continue;  // 3 ranks cannot share 4 heads
    for (rtp_type comm : {RTP_TYPE_F32, RTP_TYPE_BF16}) {
      if (comm == RTP_TYPE_BF16 && (s != RTP_STRATEGY_RTP || world == 1)) continue;
      expect_ranks_pass(
          world, [&](int r, int port) { return rank_main_mixed(s, comm, r, world, port); },
          std::string(rtp_strategy_name(s)) + " comm " + rtp_type_name(comm) + " ", 120);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Strategies, MixedPrecision, kStrategies, strategy_name);

// The transfer whose result t is (through views), as the executor finds it, or NULL.
const rtp_tensor *comm_of(const rtp_tensor *t) {
  while (t && (t->op == RTP_OP_RESHAPE || t->op == RTP_OP_VIEW || t->op == RTP_OP_PERMUTE ||
               t->op == RTP_OP_TRANSPOSE || t->op == RTP_OP_ROT))
    t = t->src[0];
  return t && t->op == RTP_OP_COMM ? t : nullptr;
}

bool is_view(rtp_op op) {
  return op == RTP_OP_RESHAPE || op == RTP_OP_VIEW || op == RTP_OP_PERMUTE ||
         op == RTP_OP_TRANSPOSE || op == RTP_OP_ROT || op == RTP_OP_EMPTY;
}

// Whether node u waits for transfer t, as the executor does: for its sources, and a
// transfer for its order edge too.
bool waits_for(const rtp_tensor *u, const rtp_tensor *t) {
  for (int k = 0; k < RTP_MAX_SRC; k++)
    if (u->src[k] && (k < 3 || u->op == RTP_OP_COMM) && comm_of(u->src[k]) == t) return true;
  return false;
}

// A transfer as the schedule has it: what it is, the bytes it sends, and how many compute
// nodes other than casts run between its post and the first node that waits for it.
struct Transfer {
  int kind, dst, src;
  size_t bytes;
  int overlap;
};

std::vector<Transfer> transfers(const rtp_graph *g) {
  std::vector<Transfer> out;
  for (int i = 0; i < g->n_nodes; i++) {
    const rtp_tensor *t = g->nodes[i];
    if (t->op != RTP_OP_COMM) continue;
    Transfer x = {t->op_params[0], t->op_params[1], t->op_params[2],
                  rtp_tensor_nbytes(t->src[0]), 0};
    for (int j = i + 1; j < g->n_nodes; j++) {
      const rtp_tensor *u = g->nodes[j];
      if (is_view(u->op)) continue;
      if (waits_for(u, t)) break;
      x.overlap += u->op != RTP_OP_COMM && u->op != RTP_OP_CAST;
    }
    out.push_back(x);
  }
  return out;
}

// Compute nodes other than casts that read a parameter (directly or through a view).
int param_readers(const rtp_graph *g) {
  int n = 0;
  for (int i = 0; i < g->n_nodes; i++) {
    const rtp_tensor *t = g->nodes[i];
    if (is_view(t->op) || t->op == RTP_OP_CAST) continue;
    for (int k = 0; k < RTP_MAX_SRC; k++) {
      const rtp_tensor *s = t->src[k];
      if (s && s->view_src) s = s->view_src;
      if (s && s->op == RTP_OP_NONE && (s->flags & RTP_FLAG_PARAM)) {
        n++;
        break;
      }
    }
  }
  return n;
}

// Bytes this rank sends per step: sendrecvs to other ranks, and a ring all-reduce's
// 2 (N - 1) / N of its buffer (bench-parallel counts the same way).
double bytes_sent(const rtp_graph *g, int world, int rank) {
  double b = 0;
  for (const Transfer &x : transfers(g))
    if (x.kind == 0 && x.dst != rank)
      b += (double)x.bytes;
    else if (x.kind != 0)
      b += 2.0 * (world - 1) / world * (double)x.bytes;
  return b;
}

// The same rank's graph with f32 and bf16 rotation: the bf16 one is the f32 one with casts
// inserted. The same compute and transfer nodes in the same order once casts (and views,
// which compute nothing and may be recorded elsewhere) are left out, the same transfers
// between the same ranks, each posted as far ahead of its first reader (counted in compute
// nodes), with exactly half the bytes for every rotation hop; and every rank reads its
// parameter blocks only through casts (it computes with the rounded copy). One rank has
// nothing to rotate: the graphs are the same.
int rank_schedule(int rank, int world, int port) {
  Rank f32, bf16;
  if (int rc = f32.join(rank, world, port, 70)) return rc;
  if (int rc = f32.build(RTP_STRATEGY_RTP, kCfg, kBatch, 71)) return rc;
  bf16.comm = f32.comm;
  int rc = bf16.build(RTP_STRATEGY_RTP, kCfg, kBatch, 73, RTP_TYPE_BF16);
  bf16.comm = nullptr;  // f32's to free
  if (rc) return rc;
  const rtp_graph *a = rtp_parallel_graph(f32.par), *b = rtp_parallel_graph(bf16.par);
  std::vector<rtp_op> ops_a, ops_b;
  for (int i = 0; i < a->n_nodes; i++)
    if (!is_view(a->nodes[i]->op) || a->nodes[i]->op == RTP_OP_EMPTY)
      ops_a.push_back(a->nodes[i]->op);
  for (int i = 0; i < b->n_nodes; i++)
    if ((!is_view(b->nodes[i]->op) || b->nodes[i]->op == RTP_OP_EMPTY) &&
        b->nodes[i]->op != RTP_OP_CAST)
      ops_b.push_back(b->nodes[i]->op);
  if (count_op(a, RTP_OP_CAST) != 0 || ops_a != ops_b) {
    fprintf(stderr, "rank %d: the node order differs beyond the casts\n", rank);
    return 75;
  }
  if ((count_op(b, RTP_OP_CAST) > 0) != (world > 1) || (world > 1 && param_readers(b) != 0)) {
    fprintf(stderr, "rank %d: %d casts, %d other readers of parameters\n", rank,
            count_op(b, RTP_OP_CAST), param_readers(b));
    return 76;
  }
  std::vector<Transfer> ta = transfers(a), tb = transfers(b);
  if (ta.size() != tb.size()) return 77;
  for (size_t i = 0; i < ta.size(); i++) {
    bool hop = ta[i].kind == 0;
    if (ta[i].kind != tb[i].kind || ta[i].dst != tb[i].dst || ta[i].src != tb[i].src ||
        (hop ? tb[i].bytes * 2 != ta[i].bytes : tb[i].bytes != ta[i].bytes) ||
        ta[i].overlap != tb[i].overlap) {
      fprintf(stderr,
              "rank %d transfer %zu: kind %d/%d, %d->%d / %d->%d, %zu/%zu bytes, overlap "
              "%d/%d\n",
              rank, i, ta[i].kind, tb[i].kind, ta[i].src, ta[i].dst, tb[i].src, tb[i].dst,
              ta[i].bytes, tb[i].bytes, ta[i].overlap, tb[i].overlap);
      return 78;
    }
  }
  if (rank == 0)
    printf("world %d: rank 0 sends %.0f bytes per step with f32 rotation, %.0f with bf16\n",
           world, bytes_sent(a, world, rank), bytes_sent(b, world, rank));
  f32.leave();
  return 0;
}

TEST(RtpBf16, SameScheduleHalfTheBytes) {
  for (int world : {1, 2, 3, 4}) {
    expect_ranks_pass(world, [&](int r, int port) { return rank_schedule(r, world, port); });
  }
}

// The node that first waits for transfer i (g->n_nodes: none), and the matrix products
// between them: the compute a transfer has to arrive during.
int first_wait(const rtp_graph *g, int i, int *products) {
  const rtp_tensor *t = g->nodes[i];
  int j = i + 1;
  for (*products = 0; j < g->n_nodes; j++) {
    const rtp_tensor *u = g->nodes[j];
    if (!is_view(u->op) && waits_for(u, t)) break;
    *products += u->op == RTP_OP_MUL_MAT;
  }
  return j;
}

// rtp's schedule (docs/parallel.md, "Small blocks must not make the ranks meet"): every hop
// that sends a parameter block from where it lives (forward's first hops, backward's
// fetches) is posted at least one matrix product before the node that waits for it, once
// the graph has reached its first product; so a hop is not a meeting at the op that
// needs it. Hops keep the order the pass made them in: the first needed is posted first.
int rank_hops_ahead(int rank, int world, int port) {
  Rank r;
  if (int rc = r.join(rank, world, port, 80)) return rc;
  if (int rc = r.build(RTP_STRATEGY_RTP, kCfg, kBatch, 81)) return rc;
  const rtp_graph *g = rtp_parallel_graph(r.par);
  int first_product = g->n_nodes, checked = 0, bad = 0;
  for (int i = 0; i < g->n_nodes && first_product == g->n_nodes; i++)
    if (g->nodes[i]->op == RTP_OP_MUL_MAT) first_product = i;
  for (int i = 0; i < g->n_nodes; i++) {
    const rtp_tensor *t = g->nodes[i];
    const rtp_tensor *sent = t->op == RTP_OP_COMM ? t->src[0] : nullptr;
    if (!sent || sent->op != RTP_OP_NONE || !(sent->flags & RTP_FLAG_PARAM)) continue;
    int products, j = first_wait(g, i, &products);
    if (j < first_product) continue;
    checked++;
    if (products == 0) {
      fprintf(stderr,
              "rank %d: the hop at node %d (%zu bytes) is waited for at node %d (%s) "
              "with no product in between\n",
              rank, i, rtp_tensor_nbytes(t), j,
              j < g->n_nodes ? rtp_op_name(g->nodes[j]->op) : "end");
      bad++;
    }
  }
  r.leave();
  return bad ? 82 : checked ? 0 : 83;
}

TEST(RtpSchedule, HopsArePostedAProductAhead) {
  for (int world : {2, 3}) {
    expect_ranks_pass(world, [&](int r, int port) { return rank_hops_ahead(r, world, port); });
  }
}

// fsdp with the reference model's units (its blocks): a block's parameters are gathered
// together, posted one after another: all 12 forward, and backward the 6 that input
// gradients need (the weights of products and LayerNorms; biases and gradients of weights
// need none). Each gather is posted at least one matrix product before the node that
// first waits for it (once the graph has reached its first product): the prefetch. The
// pool is two slots of the largest unit (a block here) and two gradient slots of the
// largest block.
int rank_fsdp_schedule(int rank, int world, int port) {
  Rank rk;
  if (int rc = rk.join(rank, world, port, 90)) return rc;
  if (int rc = rk.build(RTP_STRATEGY_FSDP, kCfg, kBatch, 91)) return rc;
  const gpt &m = rk.m;
  const rtp_graph *g = rtp_parallel_graph(rk.par);
  auto unit_of = [&](const char *name) {  // the rank's copies keep the names, not the marks
    for (int i = 0; i < m.n_params; i++)
      if (!strcmp(m.params[i]->name, name)) return (int)m.params[i]->op_params[2];
    return -1;
  };
  int first_product = g->n_nodes, bad = 0;
  for (int i = 0; i < g->n_nodes && first_product == g->n_nodes; i++)
    if (g->nodes[i]->op == RTP_OP_MUL_MAT) first_product = i;
  std::vector<std::vector<int>> runs(kCfg.n_layer + 1);  // each unit's runs of gathers
  int last_unit = -1;
  for (int i = 0; i < g->n_nodes; i++) {
    const rtp_tensor *t = g->nodes[i];
    if (t->op != RTP_OP_COMM || t->op_params[0] != 2) continue;        // all-gathers
    const rtp_tensor *mine = t->src[2] ? t->src[2]->src[0] : nullptr;  // this rank's rows
    int unit = mine ? unit_of(mine->name) : -1;
    if (unit < 0 || unit > kCfg.n_layer) return 92;
    if (unit != last_unit) runs[unit].push_back(0);
    runs[unit].back()++;
    last_unit = unit;
    int products, j = first_wait(g, i, &products);
    if (unit > 0 && j > first_product && products == 0) {
      fprintf(stderr,
              "rank %d: %s's gather at node %d is waited for at node %d with no product "
              "in between\n",
              rank, mine->name, i, j);
      bad++;
    }
  }
  for (int u = 1; u <= kCfg.n_layer; u++)
    if (runs[u] != std::vector<int>{12, 6}) {
      fprintf(stderr, "rank %d: block %d's gathers come in %zu runs\n", rank, u - 1,
              runs[u].size());
      bad++;
    }
  // The pool: slots as rtp_parallel_new lays a unit out (each parameter after the one before,
  // at a multiple of 64 bytes), each allocation a multiple of 64 bytes.
  auto pad = [](size_t n, size_t to) { return (n + to - 1) / to * to; };
  size_t unit = 0, whole = 0, largest = 0;
  for (int i = 0; i < m.n_params; i++) {
    const rtp_tensor *p = m.params[i];
    size_t n = (size_t)rtp_tensor_nelements(p), rows = (size_t)p->ne[rtp_tensor_n_dims(p) - 1];
    if (p->op_params[2] == 1) unit = pad(unit, 16) + n;
    whole = std::max(whole, n);
    largest = std::max(largest, n / rows * ((rows + world - 1) / world));
  }
  size_t want = 2 * pad(4 * std::max(unit, whole), 64) + 2 * pad(4 * largest, 64);
  rtp_mem_report rep;
  if (rtp_graph_plan(rk.ctx, rtp_parallel_graph(rk.par))) return 93;
  rtp_mem_report_get(rk.ctx, &rep);
  if (rep.bytes[RTP_ROLE_COMM] != want) {
    fprintf(stderr, "rank %d: pool %zu bytes, want %zu\n", rank, rep.bytes[RTP_ROLE_COMM],
            want);
    bad++;
  }
  rk.leave();
  return bad ? 94 : 0;
}

TEST(FsdpSchedule, BlocksGatheredTogetherAhead) {
  for (int world : {2, 3}) {
    expect_ranks_pass(world,
                      [&](int r, int port) { return rank_fsdp_schedule(r, world, port); });
  }
}

// Only rtp rotates bf16 copies: the other strategies, and types other than f32 and bf16,
// are refused when the plan is built, naming the strategy or the type (one process
// suffices: the check comes before any communication).
TEST(RtpBf16, OtherStrategiesRefuse) {
  for (rtp_strategy s : {RTP_STRATEGY_NONE, RTP_STRATEGY_DDP, RTP_STRATEGY_FSDP,
                         RTP_STRATEGY_TP, RTP_STRATEGY_RTP})
    for (rtp_type type : {RTP_TYPE_BF16, RTP_TYPE_I32}) {
      if (s == RTP_STRATEGY_RTP && type == RTP_TYPE_BF16) continue;
      gpt m{};
      rtp_graph *fwd;
      rtp_context *meta = rtptest::gpt_forward(kCfg, 1, &m, &fwd);
      ASSERT_NE(meta, nullptr) << rtp_last_error();
      rtp_init_params ip = {gpt_arena_size(kCfg, 1), nullptr, false, nullptr, 0};
      rtp_context *ctx = rtp_context_new(ip);
      rtp_parallel_params pp{};
      pp.strategy = s;
      pp.comm_type = type;
      EXPECT_EQ(rtp_parallel_new(ctx, fwd, m.loss, &pp), nullptr);
      const char *msg = "";
      EXPECT_EQ(rtp_context_error(ctx, &msg), RTP_EINVAL);
      std::string want = type == RTP_TYPE_BF16 ? std::string("strategy ") + rtp_strategy_name(s)
                                               : std::string("comm_type i32");
      EXPECT_NE(std::string(msg).find(want), std::string::npos) << msg;
      rtp_context_free(ctx);
      rtp_context_free(meta);
    }
}

size_t model_states(const rtp_mem_report &r) {
  return r.bytes[RTP_ROLE_PARAM] + r.bytes[RTP_ROLE_GRAD] + r.bytes[RTP_ROLE_OPTIM];
}

// Model states of one process: parameters, gradients, Adam's two states; and the
// elements of the largest block of a parameter split between `world` ranks.
size_t one_process_states(gpt_config cfg, size_t *largest_block_of, int world) {
  Model ref;
  rtp_init_params ip = {gpt_arena_size(cfg, 1), nullptr, false, nullptr, 0};
  ref.ctx = rtp_context_new(ip);
  gpt_build(ref.ctx, &ref.m, cfg, 1);
  ref.g = rtp_graph_new(ref.ctx, 8192);
  rtp_graph_build(ref.g, ref.m.loss);
  rtp_graph_build_backward(ref.ctx, ref.g, ref.m.loss);
  rtp_optimizer_new(ref.ctx, ref.g, rtp_adamw_params_default());
  *largest_block_of = 0;
  for (int i = 0; i < ref.m.n_params; i++) {  // block 0 is a largest one (rtp_comm_block)
    const rtp_tensor *p = ref.m.params[i];
    int64_t rows = p->ne[rtp_tensor_n_dims(p) - 1];
    size_t block = (size_t)(rtp_tensor_nelements(p) / rows * ((rows + world - 1) / world));
    *largest_block_of = std::max(*largest_block_of, block);
  }
  rtp_mem_report r;
  rtp_mem_report_get(ref.ctx, &r);
  return model_states(r);
}

// One rank: parallelize with rtp, plan, make Adam; optionally run steps. Its report and
// the resident memory before building and at the end.
int rtp_rank_memory(gpt_config cfg, int batch, int rank, int world, int port, int steps,
                    rtp_mem_report *rep, size_t *baseline, size_t *peak,
                    rtp_type comm_type = RTP_TYPE_F32) {
  Rank rk;
  if (int rc = rk.join(rank, world, port, 40)) return rc;
  *baseline = rtptest::proc_bytes("VmRSS:");
  if (int rc = rk.build(RTP_STRATEGY_RTP, cfg, batch, 41, comm_type)) return rc;
  rtp_parallel *par = rk.par;
  const gpt &m = rk.m;
  if (rtp_graph_plan(rk.ctx, rtp_parallel_graph(par))) return 42;
  rtp_optimizer *opt = rtp_parallel_optimizer(par, rtp_adamw_params_default());
  if (!opt) return 43;
  for (int i = 0; i < m.n_params; i++) {
    rtp_tensor *t = rtp_parallel_tensor(par, m.params[i]);
    for (int64_t j = 0; j < rtp_tensor_nelements(t); j++)
      ((float *)t->data)[j] = 0.01f * (float)(j % 7);
  }
  for (int s = 0; s < steps; s++)
    if (rtp_graph_compute(rtp_parallel_graph(par), nullptr) || rtp_optimizer_step(opt, nullptr))
      return 44;
  rtp_mem_report_get(rk.ctx, rep);
  *peak = rtptest::proc_bytes("VmHWM:");
  rk.leave();
  return 0;
}

// rtp's model states per rank are at most a 1/N share of one process's (plus each
// tensor's padding to 64 bytes), and the pool is two (block, gradient) pairs of the
// largest block whatever the depth: of f32, or of bf16 (half the bytes) when the copies
// rotate in bf16, which leaves the states (f32 master weights) as they were.
TEST(Memory, RtpStatesAreOneNthPlusPool) {
  for (rtp_type type : {RTP_TYPE_F32, RTP_TYPE_BF16})
    for (int world : {2, 4})
      for (int layers : {2, 6}) {
        gpt_config cfg = {256, 16, 48, layers, 4, false, false};
        size_t largest = 0, single = one_process_states(cfg, &largest, world);
        int port = rtptest::free_port();
        auto res = rtptest::run_procs(world, [&](int r) {
          rtp_mem_report rep;
          size_t base, peak;
          int rc = rtp_rank_memory(cfg, 2, r, world, port, 0, &rep, &base, &peak, type);
          if (rc) return rc;
          size_t tensors = 3 * (4 + 12 * (size_t)layers + 3), pad = 64 * tensors;
          if (model_states(rep) > single / world + pad) {
            fprintf(stderr, "rank %d: states %zu > %zu / %d + %zu\n", r, model_states(rep),
                    single, world, pad);
            return 45;
          }
          size_t pool = 4 * ((largest * rtp_type_size(type) + 63) / 64 * 64);
          if (rep.bytes[RTP_ROLE_COMM] != pool) {
            fprintf(stderr, "rank %d: pool %zu, want %zu\n", r, rep.bytes[RTP_ROLE_COMM], pool);
            return 46;
          }
          return 0;
        });
        for (int r = 0; r < world; r++)
          EXPECT_EQ(res[r].code, 0) << rtp_type_name(type) << " world " << world << " layers "
                                    << layers << " rank " << r;
      }
}

// The optimizer in backward keeps no gradients: one process's model states are its
// weights and Adam's two states (12 bytes a parameter), where the optimizer after
// backward also keeps a gradient (16).
TEST(InBackwardMemory, NoGradientsKept) {
  size_t grads[2], states[2];
  for (int on = 0; on < 2; on++) {
    Rank rk;
    ASSERT_EQ(rk.build(RTP_STRATEGY_NONE, kCfg, kBatch, 1, RTP_TYPE_F32, RTP_TYPE_F32, nullptr,
                       0, 0, on == 1),
              0);
    ASSERT_EQ(rtp_graph_plan(rk.ctx, rtp_parallel_graph(rk.par)), RTP_OK);
    ASSERT_NE(rtp_parallel_optimizer(rk.par, adam(on == 0)), nullptr);
    rtp_mem_report rep;
    rtp_mem_report_get(rk.ctx, &rep);
    grads[on] = rep.bytes[RTP_ROLE_GRAD];
    states[on] = model_states(rep);
  }
  EXPECT_GT(grads[0], 0u);
  EXPECT_EQ(grads[1], 0u);
  EXPECT_EQ(states[1], states[0] - grads[0]);
  EXPECT_EQ(grads[0] * 4, states[0]);
}

// What the optimizer in backward cannot run with is refused, saying why: gradients kept
// over micro-batches or computes, clipping (it needs every gradient first), ddp.
TEST(InBackwardErrors, RefusesWhatKeepsGradients) {
  for (int k = 0; k < 2; k++) {
    Rank rk;
    EXPECT_NE(rk.build(RTP_STRATEGY_NONE, kCfg, kBatch, 1, RTP_TYPE_F32, RTP_TYPE_F32, nullptr,
                       k == 0 ? 2 : 0, k == 1 ? 2 : 0, true),
              0);
    EXPECT_TRUE(rtptest::contains(rtp_last_error(), "no accumulation")) << rtp_last_error();
  }
  Rank rk;
  ASSERT_EQ(rk.build(RTP_STRATEGY_NONE, kCfg, kBatch, 1, RTP_TYPE_F32, RTP_TYPE_F32, nullptr, 0,
                     0, true),
            0);
  EXPECT_EQ(rtp_parallel_optimizer(rk.par, adam()), nullptr);
  EXPECT_TRUE(rtptest::contains(rtp_last_error(), "clipping")) << rtp_last_error();
  int port = rtptest::free_port();
  auto res = rtptest::run_procs(2, [&](int r) {
    Rank d;
    if (d.join(r, 2, port, 1)) return 1;
    int rc = d.build(RTP_STRATEGY_DDP, kCfg, kBatch, 2, RTP_TYPE_F32, RTP_TYPE_F32, nullptr, 0,
                     0, true);
    bool said = rtptest::contains(rtp_last_error(), "none, rtp, fsdp");
    d.leave();
    return rc != 0 && said ? 0 : 3;
  });
  for (int r = 0; r < 2; r++) EXPECT_EQ(res[r].code, 0) << "ddp rank " << r;
}

// A gradient that is not finite leaves its parameter as it was and fails the step with a
// message that says the weights updated before it were changed; the step is not counted.
TEST(InBackwardErrors, NonFiniteGradientFailsTheStep) {
  Rank rk;
  ASSERT_EQ(rk.build(RTP_STRATEGY_NONE, kCfg, kBatch, 1, RTP_TYPE_F32, RTP_TYPE_F32, nullptr, 0,
                     0, true),
            0);
  rtp_graph *g = rtp_parallel_graph(rk.par);
  ASSERT_EQ(rtp_graph_plan(rk.ctx, g), RTP_OK);
  rtp_optimizer *opt = rtp_parallel_optimizer(rk.par, adam(false));
  ASSERT_NE(opt, nullptr);
  for (int i = 0; i < rk.m.n_params; i++)
    ASSERT_EQ(rtp_tensor_fill_f32(rtp_parallel_tensor(rk.par, rk.m.params[i]), 0.02f), RTP_OK);
  rtp_tensor *last = rtp_parallel_tensor(rk.par, rk.m.params[rk.m.n_params - 1]);
  ASSERT_EQ(rtp_tensor_fill_f32(last, NAN), RTP_OK);
  ASSERT_EQ(rtp_graph_compute(g, nullptr), RTP_OK);
  EXPECT_EQ(rtp_optimizer_step(opt, nullptr), RTP_EINVAL);
  EXPECT_TRUE(rtptest::contains(rtp_last_error(), "not finite")) << rtp_last_error();
  EXPECT_TRUE(rtptest::contains(rtp_last_error(), "resume from a checkpoint"))
      << rtp_last_error();
  EXPECT_EQ(rtp_optimizer_steps(opt), 0);
  // The loss is NaN, so every gradient is: no weight moved.
  EXPECT_EQ(rtptest::f32_at(rtp_parallel_tensor(rk.par, rk.m.params[0]), 0), 0.02f);
}

// The report can be trusted: a rank's peak resident memory after training steps is the
// report's total plus what the process held before building, within 10%.
TEST(MemorySlow, PeakResidentMatchesReport) {
  const int world = 2;
  int port = rtptest::free_port();
  auto res = rtptest::run_procs(
      world,
      [&](int r) {
        rtp_mem_report rep;
        size_t base, peak;
        int rc = rtp_rank_memory(gpt_config_small(), 8, r, world, port, 2, &rep, &base, &peak);
        if (rc) return rc;
        double want = (double)(rep.total + base);
        printf("rank %d: peak %zu, report %zu + baseline %zu\n", r, peak, rep.total, base);
        return std::fabs((double)peak - want) <= 0.1 * want ? 0 : 47;
      },
      300);
  for (int r = 0; r < world; r++) EXPECT_EQ(res[r].code, 0) << "rank " << r;
}

}  // namespace

namespace {

// A parameter with fewer rows than ranks cannot be split: a clear error, on every rank.
TEST(ParallelErrors, TooFewRowsToSplit) {
  const int world = 3;
  int port = rtptest::free_port();
  auto res = rtptest::run_procs(world, [&](int r) {
    rtp_comm_params cp = rtptest::params(r, world, port);
    rtp_comm *comm = nullptr;
    if (rtp_comm_init(&cp, &comm)) return 50;
    rtp_init_params mip = {1 << 20, nullptr, true, nullptr, 0};
    rtp_context *meta = rtp_context_new(mip);
    rtp_tensor *w = rtp_tensor_set_name(rtp_tensor_new_2d(meta, RTP_TYPE_F32, 4, 2), "w");
    rtp_tensor *x = rtp_tensor_new_2d(meta, RTP_TYPE_F32, 4, 5);
    rtp_tensor_set_param(w);
    rtp_tensor *loss = rtp_sum(meta, rtp_mul_mat(meta, w, x));
    rtp_graph *g = rtp_graph_new(meta, 64);
    rtp_graph_build(g, loss);
    rtp_init_params ip = {1 << 20, nullptr, false, nullptr, 0};
    rtp_context *ctx = rtp_context_new(ip);
    int code = 0;
    for (rtp_strategy s : {RTP_STRATEGY_RTP, RTP_STRATEGY_FSDP}) {
      rtp_parallel_params pp{};
      pp.strategy = s;
      pp.comm = comm;
      if (rtp_parallel_new(ctx, g, loss, &pp) != nullptr) code = 51;
      const char *msg = nullptr;
      rtp_context_error(ctx, &msg);
      if (!strstr(msg, "fewer rows") || !strstr(msg, "'w'")) code = 52;
    }
    rtp_context_free(ctx);
    rtp_context_free(meta);
    rtp_comm_barrier(comm, nullptr);  // nobody leaves while a rank still talks to it
    rtp_comm_free(comm);
    return code;
  });
  for (int r = 0; r < world; r++) EXPECT_EQ(res[r].code, 0) << "rank " << r;
}

// tp with heads that the ranks cannot share evenly (4 heads, 3 ranks, d = 48 so that every
// weight itself would split): a clear error at rtp_parallel_new, on every rank, with the
// unfused attention (at the heads' views) and the fused op.
TEST(ParallelErrors, TpHeadsNotDivisible) {
  const int world = 3;
  int port = rtptest::free_port();
  auto res = rtptest::run_procs(world, [&](int r) {
    rtp_comm_params cp = rtptest::params(r, world, port);
    rtp_comm *comm = nullptr;
    if (rtp_comm_init(&cp, &comm)) return 60;
    int code = 0;
    for (int fused = 0; fused < 2 && !code; fused++) {
      gpt_config cfg = {256, 16, 48, 1, 4, false, fused == 1};
      gpt m{};
      rtp_graph *g;
      rtp_context *meta = rtptest::gpt_forward(cfg, 2, &m, &g);
      if (!meta) return 61;
      rtp_init_params ip = {gpt_arena_size(cfg, 2), nullptr, false, nullptr, 0};
      rtp_context *ctx = rtp_context_new(ip);
      rtp_parallel_params pp{};
      pp.strategy = RTP_STRATEGY_TP;
      pp.comm = comm;
      code = rtp_parallel_new(ctx, g, m.loss, &pp) == nullptr ? 0 : 62;
      const char *msg = "";
      if (!code && rtp_context_error(ctx, &msg) != RTP_EINVAL) code = 63;
      if (!code && (!strstr(msg, "heads") || !strstr(msg, "not divisible by the 3 ranks"))) {
        fprintf(stderr, "rank %d (fused %d): unclear message: %s\n", r, fused, msg);
        code = 64;
      }
      rtp_context_free(ctx);
      rtp_context_free(meta);
    }
    rtp_comm_barrier(comm, nullptr);  // nobody leaves while a rank still talks to it
    rtp_comm_free(comm);
    return code;
  });
  for (int r = 0; r < world; r++) EXPECT_EQ(res[r].code, 0) << "rank " << r;
}

}  // namespace

// ---- ddp with many gradients ----------------------------------------------------------

namespace {

// More gradients than the fixed array of 4096 that ddp's bucketing once stopped at, each
// a parameter of 2 floats: z = x * w_0 * w_1 * ... over a batch x {2, B}, loss = mean(z^2),
// so every w_i has its own gradient (z / w_i's share). Small buckets make many
// all-reduces.
const int kManyParams = 4200, kManyBatch = 2;

struct ManyModel {
  std::vector<rtp_tensor *> w;
  rtp_tensor *x = nullptr, *loss = nullptr;
};

ManyModel many_build(rtp_context *ctx, int batch) {
  ManyModel mm;
  mm.x = rtp_tensor_new_2d(ctx, RTP_TYPE_F32, 2, batch);
  rtp_tensor_set_input(mm.x);
  rtp_tensor *z = mm.x;
  for (int i = 0; i < kManyParams; i++) {
    rtp_tensor *w = rtp_tensor_set_name(rtp_tensor_new_1d(ctx, RTP_TYPE_F32, 2), "w%d", i);
    rtp_tensor_set_param(w);
    mm.w.push_back(w);
    z = rtp_mul(ctx, z, w);
  }
  mm.loss = rtp_mean(ctx, rtp_mul(ctx, z, z));
  return mm;
}

// Near 1, so that the product of all of them stays of the order of 1.
float many_w(int i, int j) {
  return 1.0f + 0.01f * (float)((i * 7 + j * 3) % 11 - 5);
}

float many_x(int col, int j) {
  return 0.5f + 0.25f * (float)((col * 5 + j) % 4);
}

// The one-process gradients and loss on the global batch of `cols` columns.
bool many_reference(int cols, std::vector<std::vector<float>> &grads, float *loss) {
  rtp_init_params ip = {64 << 20, nullptr, false, nullptr, 0};
  rtp_context *ctx = rtp_context_new(ip);
  ManyModel mm = many_build(ctx, cols);
  rtp_graph *g = rtp_graph_new(ctx, 1 << 16);
  bool ok = rtp_graph_build(g, mm.loss) == RTP_OK &&
            rtp_graph_build_backward(ctx, g, mm.loss) == RTP_OK &&
            rtp_graph_plan(ctx, g) == RTP_OK;
  for (int i = 0; ok && i < kManyParams; i++)
    for (int j = 0; j < 2; j++) ((float *)mm.w[i]->data)[j] = many_w(i, j);
  for (int c = 0; ok && c < cols; c++)
    for (int j = 0; j < 2; j++) ((float *)mm.x->data)[c * 2 + j] = many_x(c, j);
  ok = ok && rtp_graph_compute(g, nullptr) == RTP_OK;
  for (int i = 0; ok && i < kManyParams; i++) {
    const float *d = (const float *)mm.w[i]->grad->data;
    grads.emplace_back(d, d + 2);
  }
  if (ok) *loss = rtptest::f32_at(mm.loss, 0);
  rtp_context_free(ctx);
  return ok;
}

int many_rank(int rank, int world, int port) {
  std::vector<std::vector<float>> want;
  float want_loss = 0;
  if (!many_reference(world * kManyBatch, want, &want_loss)) return 70;
  Rank rk;
  if (int rc = rk.join(rank, world, port, 71)) return rc;
  rtp_init_params mip = {64 << 20, nullptr, true, nullptr, 0};
  rk.meta = rtp_context_new(mip);
  ManyModel mm = many_build(rk.meta, kManyBatch);
  rtp_graph *fwd = rtp_graph_new(rk.meta, 1 << 15);
  if (rtp_graph_build(fwd, mm.loss)) return 72;
  rtp_init_params ip = {128 << 20, nullptr, false, nullptr, 0};
  rk.ctx = rtp_context_new(ip);
  rtp_parallel_params pp{};
  pp.strategy = RTP_STRATEGY_DDP;
  pp.comm = rk.comm;
  pp.bucket_bytes = 4096;
  pp.graph_size = 1 << 16;
  rk.par = rtp_parallel_new(rk.ctx, fwd, mm.loss, &pp);
  if (!rk.par) {
    fprintf(stderr, "rank %d: %s\n", rank, rtp_last_error());
    return 73;
  }
  rtp_graph *g = rtp_parallel_graph(rk.par);
  if (rtp_graph_plan(rk.ctx, g)) return 74;
  int buckets = 0;
  for (int i = 0; i < g->n_nodes; i++) buckets += g->nodes[i]->op == RTP_OP_COMM;
  if (buckets < 32) {  // 4200 x 64 bytes (aligned) in buckets of 4 KiB, and the loss's
    fprintf(stderr, "rank %d: %d all-reduces\n", rank, buckets);
    return 75;
  }
  for (int i = 0; i < kManyParams; i++) {
    float *d = (float *)rtp_parallel_tensor(rk.par, mm.w[i])->data;
    for (int j = 0; j < 2; j++) d[j] = many_w(i, j);
  }
  float *x = (float *)rtp_parallel_tensor(rk.par, mm.x)->data;
  for (int c = 0; c < kManyBatch; c++)
    for (int j = 0; j < 2; j++) x[c * 2 + j] = many_x(rank * kManyBatch + c, j);
  if (rtp_graph_compute(g, nullptr)) return 76;
  float loss = rtptest::f32_at(rtp_parallel_tensor(rk.par, mm.loss), 0);
  if (std::fabs(loss - want_loss) > 1e-5f * std::fabs(want_loss)) {
    fprintf(stderr, "rank %d: loss %.8f, one process %.8f\n", rank, loss, want_loss);
    return 77;
  }
  for (int i = 0; i < kManyParams; i++) {
    const float *got = (const float *)rtp_parallel_tensor(rk.par, mm.w[i])->grad->data;
    for (int j = 0; j < 2; j++)
      if (std::fabs(got[j] - want[i][j]) > 1e-5f * std::fabs(want[i][j]) + 1e-7f) {
        fprintf(stderr, "rank %d: gradient of w%d[%d] %g, one process %g\n", rank, i, j, got[j],
                want[i][j]);
        return 78;
      }
  }
  rk.leave();
  return 0;
}

TEST(DdpBuckets, MoreThan4096GradientsMatchOneProcess) {
  expect_ranks_pass(2, [](int r, int port) { return many_rank(r, 2, port); });
}

}  // namespace

// ---- gradient accumulation and micro-batches ------------------------------------------

namespace {

// A graph with up to two losses over the same parameters: loss_k = mean(y_k^2) with
// y_0 = gelu(w x_0 + b) and y_1 = gelu(w x_1 + b) * c (c: a parameter only loss 1 reads).
struct TwoLosses {
  rtp_context *ctx = nullptr;
  rtp_tensor *w = nullptr, *b = nullptr, *c = nullptr, *x[2] = {}, *loss[2] = {};
  rtp_graph *g = nullptr;
  ~TwoLosses() {
    rtp_context_free(ctx);
  }

  // Builds the losses in `which` (bit k: loss k), each followed by its backward.
  bool build(int which) {
    rtp_init_params ip = {16 << 20, nullptr, false, nullptr, 0};
    ctx = rtp_context_new(ip);
    w = rtp_tensor_new_2d(ctx, RTP_TYPE_F32, 4, 3);
    b = rtp_tensor_new_1d(ctx, RTP_TYPE_F32, 3);
    c = rtp_tensor_new_1d(ctx, RTP_TYPE_F32, 3);
    for (rtp_tensor *p : {w, b, c}) rtp_tensor_set_param(p);
    g = rtp_graph_new(ctx, 1024);
    for (int k = 0; k < 2; k++) {
      x[k] = rtp_tensor_new_2d(ctx, RTP_TYPE_F32, 4, 5);
      rtp_tensor_set_input(x[k]);
      rtp_tensor *y = rtp_gelu(ctx, rtp_add(ctx, rtp_mul_mat(ctx, w, x[k]), b));
      if (k == 1) y = rtp_mul(ctx, y, c);
      loss[k] = rtp_mean(ctx, rtp_mul(ctx, y, y));
      if (!(which >> k & 1)) continue;
      if (rtp_graph_build(g, loss[k]) || rtp_graph_build_backward(ctx, g, loss[k]))
        return false;
    }
    if (rtp_graph_plan(ctx, g)) return false;
    std::vector<rtp_tensor *> all = {w, b, c, x[0], x[1]};
    for (size_t t = 0; t < all.size(); t++)
      for (int64_t i = 0; i < rtp_tensor_nelements(all[t]); i++)
        ((float *)all[t]->data)[i] = std::sin(0.37f * (float)i + 1.3f * (float)t);
    return true;
  }

  std::vector<float> grad(const rtp_tensor *p) const {
    const float *d = (const float *)p->grad->data;
    return std::vector<float>(d, d + rtp_tensor_nelements(p));
  }
};

// A second rtp_graph_build_backward adds its loss's gradients into the memory the first one's
// claimed: after every compute (no zeroing between) each gradient is, bit for bit, the
// first loss's alone plus the second's alone, and no GRAD memory was added for it. A
// parameter that only the second loss reads gets memory of its own.
TEST(GradAccumulation, TwoBackwardsAddTheirGradients) {
  TwoLosses first, second, both;
  ASSERT_TRUE(first.build(1));
  ASSERT_TRUE(second.build(2));
  ASSERT_TRUE(both.build(3));
  ASSERT_EQ(rtp_graph_compute(first.g, nullptr), RTP_OK);
  ASSERT_EQ(rtp_graph_compute(second.g, nullptr), RTP_OK);
  rtp_mem_report r1, r2;
  rtp_mem_report_get(first.ctx, &r1);
  rtp_mem_report_get(both.ctx, &r2);
  EXPECT_EQ(r2.bytes[RTP_ROLE_GRAD], r1.bytes[RTP_ROLE_GRAD] + 64);  // c's, 64-byte aligned
  EXPECT_EQ(both.w->grad->op, RTP_OP_ADD);  // the second call's add, in the first's memory
  EXPECT_NE(both.w->grad->view_src, nullptr);
  for (int step = 0; step < 2; step++) {
    ASSERT_EQ(rtp_graph_compute(both.g, nullptr), RTP_OK);
    for (auto pick : {&TwoLosses::w, &TwoLosses::b}) {
      std::vector<float> a = first.grad(first.*pick), b = second.grad(second.*pick),
                         ab = both.grad(both.*pick);
      for (size_t i = 0; i < ab.size(); i++) EXPECT_EQ(ab[i], a[i] + b[i]) << i;
    }
    EXPECT_EQ(both.grad(both.c), second.grad(second.c));
  }
}

const int kMicro = 3, kMicroSteps = 2;

// The sequences of micro-batch m on this rank: after those of the micro-batches before on
// every rank (tp: every rank has each micro-batch whole).
int micro_first_seq(rtp_strategy strategy, int rank, int world, int m) {
  if (strategy == RTP_STRATEGY_TP) return m * world * kBatch;
  return (m * world + rank) * kBatch;
}

// N ranks x kMicro micro-batches of batch B against one process on batch N x kMicro x B:
// the losses and the parameters after two Adam steps within 1e-6, the first gradients
// within 1e-5 of each gradient's largest element. Memory: the gradients and the pool are
// those of one micro-batch, and the planned activations grow with the micro-batches only
// by their outputs (each one's logits and loss are kept): a micro-batch after the first
// computes its contributions to the gradients in planned memory before adding them in, so
// at most the gradients' size more, and its activations die before the next one starts.
int rank_main_micro(rtp_strategy strategy, int rank, int world, int port) {
  std::vector<float> want, want_norm;
  Model ref;
  std::vector<std::vector<float>> moving, init, grad0;
  if (!reference(world * kMicro, want, want_norm, ref, moving, init, grad0, RTP_TYPE_F32, true,
                 kMicroSteps, true))
    return 20;
  Rank rk;
  if (int rc = rk.join(rank, world, port, 21)) return rc;
  Share sh = share_of(strategy, rank, world);
  if (int rc =
          rk.build(strategy, kCfg, sh.batch, 22, RTP_TYPE_F32, RTP_TYPE_F32, nullptr, kMicro))
    return rc;
  rtp_parallel *par = rk.par;
  const gpt &m = rk.m;
  rtp_graph *g = nullptr;
  rtp_optimizer *opt = nullptr;
  rtp_tensor *loss = nullptr;
  if (int rc = prepare_training(rk, init, sh.batch, sh.first_seq, &g, &opt, &loss)) return rc;
  for (int mb = 0; mb < kMicro; mb++) {
    rtp_tensor *idx = rtp_parallel_micro_tensor(par, m.idx, mb),
               *tgt = rtp_parallel_micro_tensor(par, m.targets, mb);
    if (!idx || !tgt || (mb == 0) != (idx == rtp_parallel_tensor(par, m.idx))) return 40;
    if (rtp_parallel_micro_tensor(par, m.params[0], mb) !=
        rtp_parallel_tensor(par, m.params[0]))
      return 41;
    for (int b = 0; b < sh.batch; b++)
      fill_sequence(micro_first_seq(strategy, rank, world, mb) + b, kCfg.seq_len,
                    (int32_t *)idx->data + b * kCfg.seq_len,
                    (int32_t *)tgt->data + b * kCfg.seq_len);
  }
  if (rtp_parallel_micro_tensor(par, m.idx, kMicro) != nullptr) return 42;
  for (int s = 0; s < kMicroSteps; s++) {
    if (rtp_graph_compute(g, nullptr)) {
      fprintf(stderr, "rank %d: %s\n", rank, rtp_last_error());
      return 28;
    }
    float got = rtptest::f32_at(loss, 0);
    if (std::fabs(got - want[s]) > 1e-6f * std::fabs(want[s])) {
      fprintf(stderr, "rank %d step %d: loss %.8f, one process %.8f\n", rank, s, got, want[s]);
      return 29;
    }
    if (s == 0 && !grads_match(par, m, grad0, rank)) return 32;
    if (rtp_optimizer_step(opt, nullptr)) return 30;
  }
  for (int i = 0; i < m.n_params; i++) {
    Distance d = param_distance(par, m, i, ref, moving[i], init[i]);
    std::vector<float> mine = shard(par, m, i, init[i]);
    double norm = 0;
    for (float v : mine) norm += (double)v * v;
    double scale = std::fmax(std::sqrt(norm), 0.02 * std::sqrt((double)mine.size()));
    if (d.err > 1e-6 * scale) {
      fprintf(stderr, "rank %d: %s differs by %g (scale %g)\n", rank, m.params[i]->name, d.err,
              scale);
      return 31;
    }
  }
  // One micro-batch of the same batch, planned the same way.
  Rank one;
  one.comm = rk.comm;
  int rc = one.build(strategy, kCfg, sh.batch, 43);
  if (!rc && rtp_graph_plan(one.ctx, rtp_parallel_graph(one.par))) rc = 45;
  one.comm = nullptr;
  if (rc) return rc;
  rtp_mem_report rm, r1;
  rtp_mem_report_get(rk.ctx, &rm);
  rtp_mem_report_get(one.ctx, &r1);
  size_t outputs =
      (rtp_tensor_nbytes(rtp_parallel_micro_tensor(par, m.logits, 1)) + 63) / 64 * 64 + 64;
  if (rm.bytes[RTP_ROLE_GRAD] != r1.bytes[RTP_ROLE_GRAD] ||
      rm.bytes[RTP_ROLE_COMM] != r1.bytes[RTP_ROLE_COMM] ||
      rm.bytes[RTP_ROLE_ACTIVATION] >
          r1.bytes[RTP_ROLE_ACTIVATION] + r1.bytes[RTP_ROLE_GRAD] + (kMicro - 1) * outputs) {
    fprintf(stderr, "rank %d: %zu bytes of activations with %d micro-batches, %zu with one\n",
            rank, rm.bytes[RTP_ROLE_ACTIVATION], kMicro, r1.bytes[RTP_ROLE_ACTIVATION]);
    return 46;
  }
  rk.leave();
  return 0;
}

class MicroBatches : public ::testing::TestWithParam<rtp_strategy> {};

TEST_P(MicroBatches, MatchOneBatchOfAll) {
  rtp_strategy s = GetParam();
  for (int world : {1, 2})
    expect_ranks_pass(
        world, [&](int r, int port) { return rank_main_micro(s, r, world, port); },
        std::string(rtp_strategy_name(s)) + " ", 120);
}

INSTANTIATE_TEST_SUITE_P(Strategies, MicroBatches, kStrategies, strategy_name);

// Micro-batch k's sequences into this rank's inputs.
void fill_micro(const Rank &rk, rtp_strategy strategy, int rank, int world, int k, int batch) {
  rtp_tensor *idx = rtp_parallel_tensor(rk.par, rk.m.idx),
             *tgt = rtp_parallel_tensor(rk.par, rk.m.targets);
  for (int b = 0; b < batch; b++)
    fill_sequence(micro_first_seq(strategy, rank, world, k) + b, kCfg.seq_len,
                  (int32_t *)idx->data + b * kCfg.seq_len,
                  (int32_t *)tgt->data + b * kCfg.seq_len);
}

// N ranks x K = kMicro computes of batch B accumulated (accumulate) against one process on
// batch N x K x B, as MicroBatches does: the mean of the computes' losses and the
// parameters after two Adam steps within 1e-6, the first gradients within 1e-5. The graph
// is one batch's with an add per parameter (ddp: without its all-reduces, which
// rtp_parallel_sync runs), and so is its memory: the gradients and the pool are one
// batch's, the activations at most the gradients' size more (micro-batch 0's
// contributions too are computed apart, then added), and the headers and graphs (ddp's
// sync graph too) less than the gradients' size more: a gradient allocated twice, the
// first one lost, showed there.
int rank_main_accum(rtp_strategy strategy, int rank, int world, int port) {
  std::vector<float> want, want_norm;
  Model ref;
  std::vector<std::vector<float>> moving, init, grad0;
  if (!reference(world * kMicro, want, want_norm, ref, moving, init, grad0, RTP_TYPE_F32, true,
                 kMicroSteps, true))
    return 20;
  Rank rk;
  if (int rc = rk.join(rank, world, port, 21)) return rc;
  Share sh = share_of(strategy, rank, world);
  if (int rc = rk.build(strategy, kCfg, sh.batch, 22, RTP_TYPE_F32, RTP_TYPE_F32, nullptr, 0,
                        kMicro))
    return rc;
  rtp_graph *g = nullptr;
  rtp_optimizer *opt = nullptr;
  rtp_tensor *loss = nullptr;
  if (int rc = prepare_training(rk, init, sh.batch, sh.first_seq, &g, &opt, &loss)) return rc;
  for (int s = 0; s < kMicroSteps; s++) {
    if (rtp_parallel_zero_grads(rk.par)) return 27;
    double sum = 0;
    for (int k = 0; k < kMicro; k++) {
      fill_micro(rk, strategy, rank, world, k, sh.batch);
      if (rtp_graph_compute(g, nullptr)) {
        fprintf(stderr, "rank %d: %s\n", rank, rtp_last_error());
        return 28;
      }
      sum += rtptest::f32_at(loss, 0);
    }
    if (rtp_parallel_sync(rk.par, nullptr)) return 33;
    double got = sum / kMicro;
    if (std::fabs(got - want[s]) > 1e-6 * std::fabs(want[s])) {
      fprintf(stderr, "rank %d step %d: loss %.8f, one process %.8f\n", rank, s, got, want[s]);
      return 29;
    }
    if (s == 0 && !grads_match(rk.par, rk.m, grad0, rank)) return 32;
    if (rtp_optimizer_step(opt, nullptr)) return 30;
  }
  for (int i = 0; i < rk.m.n_params; i++) {
    Distance d = param_distance(rk.par, rk.m, i, ref, moving[i], init[i]);
    std::vector<float> mine = shard(rk.par, rk.m, i, init[i]);
    double norm = 0;
    for (float v : mine) norm += (double)v * v;
    double scale = std::fmax(std::sqrt(norm), 0.02 * std::sqrt((double)mine.size()));
    if (d.err > 1e-6 * scale) {
      fprintf(stderr, "rank %d: %s differs by %g (scale %g)\n", rank, rk.m.params[i]->name,
              d.err, scale);
      return 31;
    }
  }
  Rank one;  // one compute of the same batch, planned the same way
  one.comm = rk.comm;
  int rc = one.build(strategy, kCfg, sh.batch, 43);
  if (!rc && rtp_graph_plan(one.ctx, rtp_parallel_graph(one.par))) rc = 45;
  one.comm = nullptr;
  if (rc) return rc;
  rtp_mem_report ra, r1;
  rtp_mem_report_get(rk.ctx, &ra);
  rtp_mem_report_get(one.ctx, &r1);
  int n1 = rtp_parallel_graph(one.par)->n_nodes;
  if (g->n_nodes > n1 + rk.m.n_params || ra.bytes[RTP_ROLE_GRAD] != r1.bytes[RTP_ROLE_GRAD] ||
      ra.metadata >= r1.metadata + r1.bytes[RTP_ROLE_GRAD] ||
      ra.bytes[RTP_ROLE_COMM] != r1.bytes[RTP_ROLE_COMM] ||
      ra.bytes[RTP_ROLE_ACTIVATION] > r1.bytes[RTP_ROLE_ACTIVATION] + r1.bytes[RTP_ROLE_GRAD]) {
    fprintf(stderr,
            "rank %d: accumulating, %d nodes, %zu bytes of activations and %zu of metadata; "
            "one batch, %d, %zu and %zu\n",
            rank, g->n_nodes, ra.bytes[RTP_ROLE_ACTIVATION], ra.metadata, n1,
            r1.bytes[RTP_ROLE_ACTIVATION], r1.metadata);
    return 46;
  }
  rk.leave();
  return 0;
}

class Accumulate : public ::testing::TestWithParam<rtp_strategy> {};

TEST_P(Accumulate, ComputesMatchOneBatchOfAll) {
  rtp_strategy s = GetParam();
  for (int world : {1, 2})
    expect_ranks_pass(
        world, [&](int r, int port) { return rank_main_accum(s, r, world, port); },
        std::string(rtp_strategy_name(s)) + " ", 120);
}

INSTANTIATE_TEST_SUITE_P(Strategies, Accumulate, kStrategies, strategy_name);

}  // namespace
