// test-pipeline.cpp - pipelines train exactly like one process: S stages x D ranks per
// stage (processes over TCP on 127.0.0.1), each schedule, each in-stage strategy, M
// micro-batches per data-parallel rank: losses, global gradient norms and parameters
// after three Adam steps equal one process on the global batch.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include <unistd.h>

#include "gpt.h"
#include "rtp.h"
#include "test-gpt-ranks.h"
#include "test-util.h"

namespace {

const gpt_config kCfg = {256, 16, 32, 4, 4, false, false};  // 4 blocks: up to 4 stages
const int kBatch = 4, kSteps = 3;  // sequences per data-parallel rank and step

rtp_adamw_params adam() {
  rtp_adamw_params hp = rtp_adamw_params_default();
  hp.clip_norm = 0.5f;  // acts: the norm must be global over stages and shards
  return hp;
}

void fill_sequence(int i, int T, int32_t *idx, int32_t *tgt) {
  uint32_t s = 777u + 7919u * (uint32_t)i;
  int32_t prev = (int32_t)(s % 256);
  for (int t = 0; t < T; t++) {
    s = s * 1664525u + 1013904223u;
    int32_t next = (int32_t)((s >> 13) % 256);
    idx[t] = prev;
    tgt[t] = next;
    prev = next;
  }
}

struct Reference {
  std::vector<float> losses, norms;
  std::vector<float> logits;  // of the first forward, at the initial weights
  std::vector<std::vector<float>> init, final_params;
  // Elements whose first gradient is not tiny beside the largest of its parameter: where
  // it is (zero, for the key bias), Adam's step is rounding's, so only these are compared.
  std::vector<std::vector<float>> moving;
};

// One process on the global batch of D x kBatch sequences (n sequences, when given).
bool reference(int D, Reference *ref, int n = 0) {
  const int N = n > 0 ? n : D * kBatch;
  rtp_init_params ip = {gpt_arena_size(kCfg, N), nullptr, false, nullptr, 0};
  rtp_context *ctx = rtp_context_new(ip);
  gpt m{};
  if (!ctx || gpt_build(ctx, &m, kCfg, N)) return false;
  rtp_graph *g = rtp_graph_new(ctx, 8192);
  if (rtp_graph_build(g, m.loss) || rtp_graph_build_backward(ctx, g, m.loss) ||
      rtp_graph_plan(ctx, g))
    return false;
  gpt_init_weights(&m, 42);
  for (int i = 0; i < m.n_params; i++) {
    const float *d = (const float *)m.params[i]->data;
    ref->init.emplace_back(d, d + rtp_tensor_nelements(m.params[i]));
  }
  for (int i = 0; i < N; i++)
    fill_sequence(i, kCfg.seq_len, (int32_t *)m.idx->data + i * kCfg.seq_len,
                  (int32_t *)m.targets->data + i * kCfg.seq_len);
  rtp_optimizer *opt = rtp_optimizer_new(ctx, g, adam());
  for (int s = 0; s < kSteps; s++) {
    if (rtp_graph_compute(g, nullptr)) return false;
    if (s == 0) {
      const float *l = (const float *)m.logits->data;
      ref->logits.assign(l, l + rtp_tensor_nelements(m.logits));
    }
    for (int i = 0; i < m.n_params && s == 0; i++) {
      const rtp_tensor *gr = m.params[i]->grad;
      const float *v = (const float *)gr->data;
      float mx = 0;
      for (int64_t j = 0; j < rtp_tensor_nelements(gr); j++)
        mx = std::fmax(mx, std::fabs(v[j]));
      ref->moving.emplace_back(rtp_tensor_nelements(gr));
      for (int64_t j = 0; j < rtp_tensor_nelements(gr); j++)
        ref->moving[i][j] = std::fabs(v[j]) > 1e-3f * mx ? 1.0f : 0.0f;
    }
    if (rtp_optimizer_step(opt, nullptr)) return false;
    ref->losses.push_back(rtptest::f32_at(m.loss, 0));
    ref->norms.push_back(rtp_optimizer_grad_norm(opt));
  }
  for (int i = 0; i < m.n_params; i++) {
    const float *d = (const float *)m.params[i]->data;
    ref->final_params.emplace_back(d, d + rtp_tensor_nelements(m.params[i]));
  }
  rtp_context_free(ctx);
  return ref->norms[0] > adam().clip_norm;
}

struct Case {
  int S, D, M;
  rtp_schedule schedule;
  rtp_strategy strategy;
  bool recompute = false;
};

// zeropp's scheduling units: two micro-batches each.
const int kUnit = 2;

std::string name(const Case &c) {
  return std::to_string(c.S) + "x" + std::to_string(c.D) + " M=" + std::to_string(c.M) + " " +
         rtp_schedule_name(c.schedule) + " " + rtp_strategy_name(c.strategy) +
         (c.recompute ? " recompute" : "");
}

// This rank's parameters after training against the reference's (1e-5 relative, on the
// elements whose gradient is not rounding's).
int check_params(int rank, const rtp_parallel *par, const gpt &m, const Reference &ref) {
  for (int i = 0; i < m.n_params; i++) {
    rtp_tensor *mine = rtp_parallel_tensor(par, m.params[i]);
    if (!mine) continue;
    std::vector<float> want(rtp_tensor_nelements(mine)), mv(want.size());
    CHECK_OK(
        rtp_parallel_shard_copy(par, m.params[i], ref.final_params[i].data(), want.data()));
    CHECK_OK(rtp_parallel_shard_copy(par, m.params[i], ref.moving[i].data(), mv.data()));
    double err = 0, norm = 0;
    for (size_t j = 0; j < want.size(); j++) {
      if (mv[j] == 0.0f) continue;
      double e = ((float *)mine->data)[j] - want[j];
      err += e * e;
      norm += (double)want[j] * want[j];
    }
    double scale = std::fmax(std::sqrt(norm), 0.02 * std::sqrt((double)want.size()));
    CHECK(std::sqrt(err) <= 1e-5 * scale, "%s differs by %g (scale %g)", m.params[i]->name,
          std::sqrt(err), scale);
  }
  return 0;
}

// Rank `rank` of an S x D job (stage rank / D): trains kSteps on its data-parallel rank's
// sequences, split into M micro-batches, and checks everything against the reference.
int pipeline_rank(const Case &c, int rank, int port, const Reference &ref) {
  rtp_comm_params cp = rtptest::params(rank, c.S * c.D, port);
  rtp_comm *job = nullptr, *stage = nullptr, *pipe = nullptr;
  CHECK_OK(rtp_comm_init(&cp, &job));
  CHECK_OK(rtp_comm_mesh_2d(job, c.S, c.D, &stage, &pipe));
  int d = rank % c.D, mb = kBatch / c.M;
  gpt m{};
  rtp_graph *fwd = nullptr;
  rtp_context *meta = rtptest::gpt_forward(kCfg, mb, &m, &fwd);
  CHECK(meta, "model: %s", rtp_last_error());
  for (int i = 0; i < kCfg.n_layer; i++)  // the blocks a pipeline cuts at
    for (rtp_tensor **p = &m.blocks[i].ln_1_w; p <= &m.blocks[i].mlp_proj_b; p++)
      CHECK_OK(rtp_tensor_set_fsdp_unit(*p, i + 1));
  rtp_init_params ip = {gpt_arena_size(kCfg, kBatch) * 2, nullptr, false, nullptr, 0};
  rtp_context *ctx = rtp_context_new(ip);
  rtp_parallel_params pp{};
  pp.strategy = c.D > 1 ? c.strategy : RTP_STRATEGY_NONE;
  pp.comm = c.D > 1 ? stage : nullptr;
  pp.micro_batches = c.M;
  pp.pipe_comm = pipe;
  pp.schedule = c.schedule;
  pp.unit = kUnit;
  pp.recompute = c.recompute;
  rtp_parallel *par = rtp_parallel_new(ctx, fwd, m.loss, &pp);
  CHECK(par, "rtp_parallel_new: %s", rtp_last_error());
  CHECK(rtp_parallel_stage(par) == rank / c.D, "stage %d", rtp_parallel_stage(par));
  rtp_graph *g = rtp_parallel_graph(par);
  CHECK_OK(rtp_graph_plan(ctx, g));
  int held = 0;
  for (int i = 0; i < m.n_params; i++) {
    rtp_tensor *mine = rtp_parallel_tensor(par, m.params[i]);
    if (!mine) continue;  // another stage's
    held++;
    CHECK_OK(
        rtp_parallel_shard_copy(par, m.params[i], ref.init[i].data(), (float *)mine->data));
  }
  CHECK(held > 0 && (held < m.n_params || c.S == 1), "holds %d of %d parameters", held,
        m.n_params);
  for (int k = 0; k < c.M; k++) {
    rtp_tensor *idx = rtp_parallel_micro_tensor(par, m.idx, k);
    rtp_tensor *tgt = rtp_parallel_micro_tensor(par, m.targets, k);
    CHECK(idx && tgt, "inputs of micro-batch %d", k);
    CHECK(rtp_parallel_micro_unit(par, k) == d * c.M + k, "micro-batch %d is unit %d", k,
          rtp_parallel_micro_unit(par, k));
    for (int b = 0; b < mb; b++)
      fill_sequence(d * kBatch + k * mb + b, kCfg.seq_len,
                    (int32_t *)idx->data + b * kCfg.seq_len,
                    (int32_t *)tgt->data + b * kCfg.seq_len);
  }
  // Micro-batch 0's forward alone (evaluation's graph), before and after the steps: its
  // logits are one process's rows, and running it changes nothing training computes.
  rtp_graph *fg = rtp_parallel_forward_graph(par, m.logits);
  CHECK(fg, "rtp_parallel_forward_graph: %s", rtp_last_error());
  CHECK_OK(rtp_graph_plan(ctx, fg));
  CHECK_OK(rtp_graph_compute(fg, nullptr));
  if (rank / c.D == c.S - 1) {
    rtp_tensor *lg = rtp_parallel_tensor(par, m.logits);
    size_t n = (size_t)rtp_tensor_nelements(lg), off = (size_t)d * kBatch * n / mb;
    float mx = 0, err = 0;
    for (size_t j = 0; j < n; j++) {
      mx = std::fmax(mx, std::fabs(ref.logits[off + j]));
      err = std::fmax(err, std::fabs(((float *)lg->data)[j] - ref.logits[off + j]));
    }
    CHECK(err <= 1e-5f * mx, "micro-batch 0's logits differ by %g (largest %g)", err, mx);
  }
  if (c.S == 2 && c.D == 1) {  // to a node of stage 0: stage 1 has nothing to do
    rtp_graph *eg = rtp_parallel_forward_graph(par, fwd->nodes[0]);
    CHECK(eg && eg->n_nodes == (rank == 0 ? 1 : 0), "forward graph to the first node");
    CHECK_OK(rtp_graph_plan(ctx, eg));
    CHECK_OK(rtp_graph_compute(eg, nullptr));
    CHECK(!rtp_parallel_forward_graph(par, m.loss) &&
              !rtp_parallel_forward_graph(par, m.params[0]),
          "a forward graph to the loss or a parameter");
  }
  rtp_optimizer *opt = rtp_parallel_optimizer(par, adam());
  rtp_tensor *loss = rtp_parallel_tensor(par, m.loss);
  CHECK(opt && loss, "optimizer or loss");
  for (int s = 0; s < kSteps; s++) {
    CHECK_OK(rtp_graph_compute(g, nullptr));
    CHECK_OK(rtp_optimizer_step(opt, nullptr));
    float l = rtptest::f32_at(loss, 0), nrm = rtp_optimizer_grad_norm(opt);
    CHECK(std::fabs(l - ref.losses[s]) <= 1e-5f * std::fabs(ref.losses[s]),
          "step %d: loss %.8f, one process %.8f", s, l, ref.losses[s]);
    CHECK(std::fabs(nrm - ref.norms[s]) <= 1e-5f * ref.norms[s],
          "step %d: gradient norm %.8f, one process %.8f", s, nrm, ref.norms[s]);
  }
  CHECK_OK(rtp_graph_compute(fg, nullptr));
  if (int rc = check_params(rank, par, m, ref)) return rc;
  rtp_context_free(ctx);
  rtp_context_free(meta);
  rtp_comm_barrier(job, nullptr);
  rtp_comm_free(stage);
  rtp_comm_free(pipe);
  rtp_comm_free(job);
  return 0;
}

void run_case(const Case &c) {
  Reference ref;
  ASSERT_TRUE(reference(c.D, &ref));
  int port = rtptest::free_port();
  auto res = rtptest::run_procs(
      c.S * c.D, [&](int r) { return pipeline_rank(c, r, port, ref); }, 120);
  for (int r = 0; r < c.S * c.D; r++) EXPECT_EQ(res[r].code, 0) << name(c) << ": rank " << r;
}

class Schedules : public ::testing::TestWithParam<rtp_schedule> {};

TEST_P(Schedules, TwoStagesMatchOneProcess) {
  run_case({2, 1, 4, GetParam(), RTP_STRATEGY_NONE});
}

TEST_P(Schedules, FourStagesMatchOneProcess) {
  run_case({4, 1, 4, GetParam(), RTP_STRATEGY_NONE});
}

TEST_P(Schedules, TwoByTwoMatchOneProcess) {
  for (rtp_strategy st : {RTP_STRATEGY_RTP, RTP_STRATEGY_FSDP, RTP_STRATEGY_DDP})
    run_case({2, 2, 2, GetParam(), st});
}

// One stage of two ranks, two units of zeropp (whose rtp rotates once per unit).
TEST_P(Schedules, OneByTwoMatchOneProcess) {
  for (rtp_strategy st : {RTP_STRATEGY_RTP, RTP_STRATEGY_FSDP, RTP_STRATEGY_DDP})
    run_case({1, 2, 4, GetParam(), st});
}

TEST_P(Schedules, RecomputeMatchesOneProcess) {
  run_case({2, 1, 4, GetParam(), RTP_STRATEGY_NONE, true});
  for (rtp_strategy st : {RTP_STRATEGY_RTP, RTP_STRATEGY_FSDP, RTP_STRATEGY_DDP})
    run_case({2, 2, 2, GetParam(), st, true});
}

// A pipe of one stage is no pipeline: the strategy alone, with its micro-batches; and
// recomputation without a pipeline, under every strategy.
TEST(Pipeline, OneStageOfTwoRanks) {
  for (rtp_strategy st : {RTP_STRATEGY_RTP, RTP_STRATEGY_FSDP, RTP_STRATEGY_DDP}) {
    run_case({1, 2, 2, RTP_SCHEDULE_1F1B, st});
    run_case({1, 2, 2, RTP_SCHEDULE_1F1B, st, true});
  }
  run_case({1, 1, 2, RTP_SCHEDULE_1F1B, RTP_STRATEGY_NONE, true});
}

INSTANTIATE_TEST_SUITE_P(Pipeline, Schedules,
                         ::testing::Values(RTP_SCHEDULE_GPIPE, RTP_SCHEDULE_1F1B,
                                           RTP_SCHEDULE_EAGER_1F1B, RTP_SCHEDULE_ZEROPP),
                         [](const ::testing::TestParamInfo<rtp_schedule> &info) {
                           std::string s = rtp_schedule_name(info.param);
                           for (char &ch : s)
                             if (ch == '-') ch = '_';
                           return s;
                         });

}  // namespace

namespace {

// A rank of the last stage dies (SIGKILL) or goes silent (SIGSTOP) in the middle of
// training: every rank of every stage fails within the timeout, naming it; none waits on
// a send or recv for ever.
void rank_lost(bool silent) {
  const int timeout_ms = 3000, S = 2, D = 2;
  int port = rtptest::free_port();
  auto res = rtptest::run_procs(
      S * D,
      [&](int rank) {
        rtp_comm_params cp = rtptest::params(rank, S * D, port, timeout_ms);
        rtp_comm *job = nullptr, *stage = nullptr, *pipe = nullptr;
        CHECK_OK(rtp_comm_init(&cp, &job));
        CHECK_OK(rtp_comm_mesh_2d(job, S, D, &stage, &pipe));
        gpt m{};
        rtp_graph *fwd = nullptr;
        rtp_context *meta = rtptest::gpt_forward(kCfg, 2, &m, &fwd);
        CHECK(meta, "model");
        for (int i = 0; i < kCfg.n_layer; i++)
          for (rtp_tensor **p = &m.blocks[i].ln_1_w; p <= &m.blocks[i].mlp_proj_b; p++)
            CHECK_OK(rtp_tensor_set_fsdp_unit(*p, i + 1));
        rtp_init_params ip = {gpt_arena_size(kCfg, kBatch) * 2, nullptr, false, nullptr, 0};
        rtp_context *ctx = rtp_context_new(ip);
        rtp_parallel_params pp{};
        pp.strategy = RTP_STRATEGY_RTP;
        pp.comm = stage;
        pp.micro_batches = 2;
        pp.pipe_comm = pipe;
        rtp_parallel *par = rtp_parallel_new(ctx, fwd, m.loss, &pp);
        CHECK(par, "rtp_parallel_new: %s", rtp_last_error());
        rtp_graph *g = rtp_parallel_graph(par);
        CHECK_OK(rtp_graph_plan(ctx, g));
        if (rank == 3) {  // after one step, in which every stage has run
          CHECK_OK(rtp_graph_compute(g, nullptr));
          kill(getpid(), silent ? SIGSTOP : SIGKILL);
          return 0;
        }
        double t0 = rtptest::now_s();  // the others may not have finished that step
        int st = RTP_OK;
        for (int s = 0; s < 1000 && st == RTP_OK; s++) st = rtp_graph_compute(g, nullptr);
        int rc = rtptest::expect_failure(rank, st, t0, 3.0 * timeout_ms / 1000,
                                         {RTP_EPEER, RTP_ETIMEDOUT, RTP_ECOMM}, {"rank 3"});
        rtp_context_free(ctx);
        rtp_context_free(meta);
        rtp_comm_free(stage);
        rtp_comm_free(pipe);
        rtp_comm_free(job);
        return rc;
      },
      60, {3});
  for (int r = 0; r < 3; r++)
    EXPECT_EQ(res[r].code, 0) << (silent ? "silent" : "killed") << " rank " << r;
}

// The bubble is measured where it happens: stage 1 of a 2 x 1 pipeline waits on the pipe
// for stage 0, held back here by 300 ms before its step, and rtp_graph_timing says so;
// the waits it reports lie within the step, and a group the graph never uses has none.
TEST(PipelineTiming, WaitsOnThePipeAreTheStagesBubble) {
  int port = rtptest::free_port();
  auto res = rtptest::run_procs(
      2,
      [&](int rank) {
        rtp_comm_params cp = rtptest::params(rank, 2, port);
        rtp_comm *job = nullptr, *stage = nullptr, *pipe = nullptr;
        CHECK_OK(rtp_comm_init(&cp, &job));
        CHECK_OK(rtp_comm_mesh_2d(job, 2, 1, &stage, &pipe));
        gpt m{};
        rtp_graph *fwd = nullptr;
        rtp_context *meta = rtptest::gpt_forward(kCfg, 2, &m, &fwd);
        CHECK(meta, "model");
        for (int i = 0; i < kCfg.n_layer; i++)
          for (rtp_tensor **p = &m.blocks[i].ln_1_w; p <= &m.blocks[i].mlp_proj_b; p++)
            CHECK_OK(rtp_tensor_set_fsdp_unit(*p, i + 1));
        rtp_init_params ip = {gpt_arena_size(kCfg, kBatch) * 2, nullptr, false, nullptr, 0};
        rtp_context *ctx = rtp_context_new(ip);
        rtp_parallel_params pp{};
        pp.micro_batches = 2;
        pp.pipe_comm = pipe;
        rtp_parallel *par = rtp_parallel_new(ctx, fwd, m.loss, &pp);
        CHECK(par, "rtp_parallel_new: %s", rtp_last_error());
        rtp_graph *g = rtp_parallel_graph(par);
        rtp_graph_timing t{};
        CHECK(rtp_graph_timing_get(g, nullptr, &t) == RTP_ESTATE, "timing before the plan");
        CHECK_OK(rtp_graph_plan(ctx, g));
        CHECK_OK(rtp_graph_compute(g, nullptr));
        CHECK_OK(rtp_comm_barrier(job, nullptr));
        if (rank == 0) usleep(300 * 1000);
        CHECK_OK(rtp_graph_compute(g, nullptr));
        rtp_graph_timing all{}, on_pipe{}, on_job{};
        CHECK_OK(rtp_graph_timing_get(g, nullptr, &all));
        CHECK_OK(rtp_graph_timing_get(g, pipe, &on_pipe));
        CHECK_OK(rtp_graph_timing_get(g, job, &on_job));
        std::printf("rank %d: step %.3f s, waits %.3f s, on the pipe %.3f s\n", rank,
                    all.wall_s, all.wait_s, on_pipe.wait_s);
        CHECK(on_pipe.wait_s <= all.wait_s && all.wait_s <= all.wall_s,
              "waits within the step");
        CHECK(on_job.wait_s == 0, "waits on a group the graph does not use: %g", on_job.wait_s);
        if (rank == 1) CHECK(on_pipe.wait_s >= 0.25, "stage 1 waited %g s", on_pipe.wait_s);
        if (rank == 0) CHECK(all.wall_s < 0.25 + on_pipe.wait_s, "stage 0 was not held back");
        rtp_context_free(ctx);
        rtp_context_free(meta);
        rtp_comm_barrier(job, nullptr);
        rtp_comm_free(stage);
        rtp_comm_free(pipe);
        rtp_comm_free(job);
        return 0;
      },
      60);
  for (int r = 0; r < 2; r++) EXPECT_EQ(res[r].code, 0) << "rank " << r;
}

TEST(PipelineFaults, RankKilled) {
  rank_lost(false);
}

TEST(PipelineFaults, RankSilent) {
  rank_lost(true);
}

}  // namespace

namespace {

// Memory as the schedule says, on 4 stages of 1 rank and M = 8: the activations alive at
// once on stage s (the plan's, without fragmentation) grow by S - s - 1 micro-batches'
// stashes over one micro-batch's under 1F1B, by M - 1 under GPipe (which measures the
// stash); and on 2 x 2 under rtp, each rank's parameters are half of its stage's.
size_t activation_peak(rtp_comm *stage, rtp_comm *pipe, rtp_strategy st, rtp_schedule sched,
                       int M, size_t *params, size_t *stage_params) {
  gpt m{};
  rtp_graph *fwd = nullptr;
  rtp_context *meta = rtptest::gpt_forward(kCfg, 1, &m, &fwd);
  for (int i = 0; meta && i < kCfg.n_layer; i++)
    for (rtp_tensor **p = &m.blocks[i].ln_1_w; p <= &m.blocks[i].mlp_proj_b; p++)
      rtp_tensor_set_fsdp_unit(*p, i + 1);
  rtp_init_params ip = {gpt_arena_size(kCfg, M) * 2, nullptr, false, nullptr, 0};
  rtp_context *ctx = meta ? rtp_context_new(ip) : nullptr;
  rtp_parallel_params pp{};
  pp.strategy = st;
  pp.comm = rtp_comm_size(stage) > 1 ? stage : nullptr;
  pp.micro_batches = M;
  pp.pipe_comm = pipe;
  pp.schedule = sched;
  rtp_parallel *par = ctx ? rtp_parallel_new(ctx, fwd, m.loss, &pp) : nullptr;
  size_t peak = 0;
  if (par && rtp_graph_plan(ctx, rtp_parallel_graph(par)) == RTP_OK) {
    rtp_mem_report r;
    rtp_mem_report_get(ctx, &r);
    peak = r.activation_live;
    if (params) *params = r.bytes[RTP_ROLE_PARAM];
    if (stage_params) {
      *stage_params = 0;
      for (int i = 0; i < m.n_params; i++)
        if (rtp_parallel_tensor(par, m.params[i]))
          *stage_params += (size_t)rtp_tensor_nelements(m.params[i]) * sizeof(float);
    }
  } else {
    fprintf(stderr, "build: %s\n", rtp_last_error());
  }
  rtp_context_free(ctx);
  rtp_context_free(meta);
  return peak;
}

// Bytes the graph of one step moves (every transfer node's), on a stage of D ranks of
// one-stage pipe, under `st` with M micro-batches in units of U (zeropp; U = 1: 1f1b).
double step_transfer_bytes(rtp_comm *stage, rtp_comm *pipe, rtp_strategy st, int M, int U) {
  gpt m{};
  rtp_graph *fwd = nullptr;
  rtp_context *meta = rtptest::gpt_forward(kCfg, 1, &m, &fwd);
  for (int i = 0; meta && i < kCfg.n_layer; i++)
    for (rtp_tensor **p = &m.blocks[i].ln_1_w; p <= &m.blocks[i].mlp_proj_b; p++)
      rtp_tensor_set_fsdp_unit(*p, i + 1);
  rtp_init_params ip = {gpt_arena_size(kCfg, M) * 2, nullptr, false, nullptr, 0};
  rtp_context *ctx = meta ? rtp_context_new(ip) : nullptr;
  rtp_parallel_params pp{};
  pp.strategy = st;
  pp.comm = stage;
  pp.micro_batches = M;
  pp.pipe_comm = pipe;
  pp.schedule = U > 1 ? RTP_SCHEDULE_ZEROPP : RTP_SCHEDULE_1F1B;
  pp.unit = U;
  rtp_parallel *par = ctx ? rtp_parallel_new(ctx, fwd, m.loss, &pp) : nullptr;
  double bytes = -1;
  if (par) {
    rtp_graph *g = rtp_parallel_graph(par);
    bytes = 0;
    for (int i = 0; i < g->n_nodes; i++)
      if (g->nodes[i]->op == RTP_OP_COMM) bytes += (double)rtp_tensor_nbytes(g->nodes[i]);
  } else {
    fprintf(stderr, "build: %s\n", rtp_last_error());
  }
  rtp_context_free(ctx);
  rtp_context_free(meta);
  return bytes;
}

// ZeroPP's point: inside a stage the weights move once per unit of U micro-batches, not
// once per micro-batch. Under rtp a unit's micro-batches go through each rotation
// together, and under fsdp through each gather; so a step's transfers shrink with U. (The
// same step trains exactly like one process: Schedules.*/zeropp.)
TEST(PipelineUnits, WeightsMoveOncePerUnit) {
  const int M = 4;
  int port = rtptest::free_port();
  auto res = rtptest::run_procs(2, [&](int rank) {
    rtp_comm_params cp = rtptest::params(rank, 2, port);
    rtp_comm *job = nullptr, *stage = nullptr, *pipe = nullptr;
    CHECK_OK(rtp_comm_init(&cp, &job));
    CHECK_OK(rtp_comm_mesh_2d(job, 1, 2, &stage, &pipe));
    for (rtp_strategy st : {RTP_STRATEGY_RTP, RTP_STRATEGY_FSDP}) {
      double u1 = step_transfer_bytes(stage, pipe, st, M, 1);
      double u2 = step_transfer_bytes(stage, pipe, st, M, 2);
      double u4 = step_transfer_bytes(stage, pipe, st, M, 4);
      fprintf(stderr, "%s: %.0f bytes a step in units of 1, %.0f of 2, %.0f of 4\n",
              rtp_strategy_name(st), u1, u2, u4);
      CHECK(u1 > 0 && u2 > 0 && u4 > 0, "building failed");
      if (st == RTP_STRATEGY_RTP)  // blocks and their gradients both travel per unit
        CHECK(std::fabs(u2 - u1 / 2) < 1e-3 * u1 && std::fabs(u4 - u1 / 4) < 1e-3 * u1,
              "rtp: %.0f, %.0f, %.0f bytes", u1, u2, u4);
      else  // the gathers shrink as 1/U; the gradients are reduce-scattered once a step
        CHECK(u2 < u1 && std::fabs((u1 - u2) - 2 * (u2 - u4)) < 1e-3 * u1,
              "fsdp: %.0f, %.0f, %.0f bytes", u1, u2, u4);
    }
    rtp_comm_free(stage);
    rtp_comm_free(pipe);
    rtp_comm_free(job);
    return 0;
  });
  for (int r = 0; r < 2; r++) EXPECT_EQ(res[r].code, 0) << "rank " << r;
}

TEST(PipelineMemory, StashAsTheScheduleSays) {
  const int S = 4, M = 8;
  int port = rtptest::free_port();
  auto res = rtptest::run_procs(S, [&](int rank) {
    rtp_comm_params cp = rtptest::params(rank, S, port);
    rtp_comm *job = nullptr, *stage = nullptr, *pipe = nullptr;
    CHECK_OK(rtp_comm_init(&cp, &job));
    CHECK_OK(rtp_comm_mesh_2d(job, S, 1, &stage, &pipe));
    rtp_strategy none = RTP_STRATEGY_NONE;
    size_t g1 = activation_peak(stage, pipe, none, RTP_SCHEDULE_GPIPE, 1, nullptr, nullptr);
    size_t g8 = activation_peak(stage, pipe, none, RTP_SCHEDULE_GPIPE, M, nullptr, nullptr);
    size_t f8 = activation_peak(stage, pipe, none, RTP_SCHEDULE_1F1B, M, nullptr, nullptr);
    CHECK(g1 && g8 && f8, "planning failed");
    double stash = (double)(g8 - g1) / (M - 1), held = (double)(f8 - g1) / stash;
    fprintf(stderr,
            "stage %d: one micro-batch %zu B, stash %.0f B each; 1F1B holds %.2f more\n", rank,
            g1, stash, held);
    CHECK(stash > 0, "no stash");
    // beyond the S - s - 1 stashes, less than one more: boundary tensors still in flight
    CHECK(held < S - rank - 1 + 0.5, "1F1B holds %.2f micro-batches beyond one", held);
    CHECK(held > S - rank - 1 - 0.5, "1F1B holds %.2f", held);
    rtp_comm_free(stage);
    rtp_comm_free(pipe);
    rtp_comm_free(job);
    return 0;
  });
  for (int r = 0; r < S; r++) EXPECT_EQ(res[r].code, 0) << "stage " << r;
}

TEST(PipelineMemory, StatesAreOneDthOfTheStage) {
  int port = rtptest::free_port();
  auto res = rtptest::run_procs(4, [&](int rank) {
    rtp_comm_params cp = rtptest::params(rank, 4, port);
    rtp_comm *job = nullptr, *stage = nullptr, *pipe = nullptr;
    CHECK_OK(rtp_comm_init(&cp, &job));
    CHECK_OK(rtp_comm_mesh_2d(job, 2, 2, &stage, &pipe));
    size_t mine = 0, whole = 0;
    CHECK(activation_peak(stage, pipe, RTP_STRATEGY_RTP, RTP_SCHEDULE_1F1B, 2, &mine, &whole),
          "planning failed");
    fprintf(stderr, "rank %d: %zu parameter bytes of the stage's %zu\n", rank, mine, whole);
    // each block split in two, each padded to 64 bytes at most
    CHECK(mine <= whole / 2 + 64 * 64 && mine >= whole / 2 - 64 * 64, "%zu of %zu", mine,
          whole);
    rtp_comm_free(stage);
    rtp_comm_free(pipe);
    rtp_comm_free(job);
    return 0;
  });
  for (int r = 0; r < 4; r++) EXPECT_EQ(res[r].code, 0) << "rank " << r;
}

}  // namespace

namespace {

// Stages of different sizes and strategies: stage s has ranks[s] ranks running
// strategies[s]; a step is U units of `seqs` sequences each.
struct HeteroCase {
  std::vector<int> ranks;
  std::vector<rtp_strategy> strategies;
  int U, seqs;
  rtp_schedule schedule = RTP_SCHEDULE_GPIPE;
};

std::string name(const HeteroCase &c) {
  std::string s;
  for (size_t i = 0; i < c.ranks.size(); i++)
    s += (i ? "," : "") + std::to_string(c.ranks[i]) + ":" + rtp_strategy_name(c.strategies[i]);
  return s + " U=" + std::to_string(c.U);
}

int job_size(const HeteroCase &c) {
  int n = 0;
  for (int g : c.ranks) n += g;
  return n;
}

// The job's stage group for this rank (NULL on a stage of one rank) and its stage.
int hetero_stage(const HeteroCase &c, int rank, rtp_comm *job, rtp_comm **stage) {
  int s = 0, first = 0;
  while (rank >= first + c.ranks[s]) first += c.ranks[s++];
  rtp_comm *group = nullptr;
  if (rtp_comm_split(job, s, rank, &group)) return -1;
  if (c.ranks[s] == 1) {
    rtp_comm_free(group);
    group = nullptr;
  }
  *stage = group;
  return s;
}

// The plan of rank `rank`'s stage; NULL with rtp_last_error.
rtp_parallel *hetero_plan(const HeteroCase &c, rtp_context *ctx, rtp_graph *fwd, gpt *m,
                          rtp_comm *job, rtp_comm *stage) {
  rtp_parallel_params pp{};
  pp.comm = stage;
  pp.pipe_comm = job;
  pp.micro_batches = c.U;
  pp.schedule = c.schedule;
  pp.stages = (int)c.ranks.size();
  pp.stage_ranks = c.ranks.data();
  pp.stage_strategies = c.strategies.data();
  return rtp_parallel_new(ctx, fwd, m->loss, &pp);
}

rtp_context *hetero_model(const HeteroCase &c, gpt *m, rtp_graph **fwd) {
  rtp_context *meta = rtptest::gpt_forward(kCfg, c.seqs, m, fwd);
  for (int i = 0; meta && i < kCfg.n_layer; i++)
    for (rtp_tensor **p = &m->blocks[i].ln_1_w; p <= &m->blocks[i].mlp_proj_b; p++)
      rtp_tensor_set_fsdp_unit(*p, i + 1);
  return meta;
}

// One rank of case c up to its plan: the job and its stage group, the one-device model
// and an arena of `arena` bytes; close frees them, contexts before communicators.
struct HeteroRank {
  rtp_comm *job = nullptr, *stage = nullptr;
  gpt m{};
  rtp_graph *fwd = nullptr;
  rtp_context *meta = nullptr, *ctx = nullptr;
  int s = -1;  // this rank's stage

  // 0, or the rank's failure code (CHECK's).
  int open(const HeteroCase &c, int rank, int port, size_t arena, int timeout_ms = 20000) {
    rtp_comm_params cp = rtptest::params(rank, job_size(c), port, timeout_ms);
    CHECK_OK(rtp_comm_init(&cp, &job));
    s = hetero_stage(c, rank, job, &stage);
    CHECK(s >= 0, "stage group: %s", rtp_last_error());
    meta = hetero_model(c, &m, &fwd);
    ctx = rtp_context_new(rtp_init_params{arena, nullptr, false, nullptr, 0});
    CHECK(meta && ctx, "model or arena: %s", rtp_last_error());
    return 0;
  }
  rtp_parallel *plan(const HeteroCase &c) {
    return hetero_plan(c, ctx, fwd, &m, job, stage);
  }
  // barrier: wait for every rank of the job first, so that none leaves one still sending.
  void close(bool barrier) {
    rtp_context_free(ctx);
    rtp_context_free(meta);
    if (barrier) rtp_comm_barrier(job, nullptr);
    rtp_comm_free(stage);
    rtp_comm_free(job);
  }
};

// Trains kSteps: every rank's loss and gradient norm, and its parameters at the end,
// against one process on the U units' batch.
int hetero_rank(const HeteroCase &c, int rank, int port, const Reference &ref) {
  HeteroRank h;
  if (int rc = h.open(c, rank, port, gpt_arena_size(kCfg, c.seqs) * (size_t)(c.U + 2)))
    return rc;
  gpt &m = h.m;
  rtp_context *ctx = h.ctx;
  int s = h.s;
  rtp_parallel *par = h.plan(c);
  CHECK(par, "rtp_parallel_new: %s", rtp_last_error());
  CHECK(rtp_parallel_stage(par) == s && rtp_parallel_stages(par) == (int)c.ranks.size(),
        "stage %d of %d", rtp_parallel_stage(par), rtp_parallel_stages(par));
  bool whole = c.ranks[s] == 1 || c.strategies[s] == RTP_STRATEGY_TP;
  int M = rtp_parallel_micro_batches(par);
  CHECK(M == (whole ? c.U : c.U / c.ranks[s]), "%d micro-batches", M);
  CHECK(rtp_parallel_micro_unit(par, M) == -1, "micro-batch %d of %d", M, M);
  rtp_graph *g = rtp_parallel_graph(par);
  CHECK_OK(rtp_graph_plan(ctx, g));
  for (int i = 0; i < m.n_params; i++) {
    rtp_tensor *mine = rtp_parallel_tensor(par, m.params[i]);
    if (mine)
      CHECK_OK(
          rtp_parallel_shard_copy(par, m.params[i], ref.init[i].data(), (float *)mine->data));
  }
  for (int k = 0; k < M; k++) {
    int u = rtp_parallel_micro_unit(par, k);
    CHECK(u >= 0 && u < c.U, "micro-batch %d is unit %d", k, u);
    rtp_tensor *idx = rtp_parallel_micro_tensor(par, m.idx, k);
    rtp_tensor *tgt = rtp_parallel_micro_tensor(par, m.targets, k);
    CHECK(idx && tgt, "inputs of micro-batch %d", k);
    for (int b = 0; b < c.seqs; b++)
      fill_sequence(u * c.seqs + b, kCfg.seq_len, (int32_t *)idx->data + b * kCfg.seq_len,
                    (int32_t *)tgt->data + b * kCfg.seq_len);
  }
  // The forward graph (evaluation's): micro-batch 0's logits on the last stage are its
  // unit's rows of one process's, and running it changes nothing training computes.
  rtp_graph *fg = rtp_parallel_forward_graph(par, m.logits);
  CHECK(fg, "rtp_parallel_forward_graph: %s", rtp_last_error());
  CHECK_OK(rtp_graph_plan(ctx, fg));
  CHECK_OK(rtp_graph_compute(fg, nullptr));
  if (s == (int)c.ranks.size() - 1) {
    rtp_tensor *lg = rtp_parallel_tensor(par, m.logits);
    size_t n = (size_t)rtp_tensor_nelements(lg),
           off = (size_t)rtp_parallel_micro_unit(par, 0) * n;
    float mx = 0, err = 0;
    for (size_t j = 0; j < n; j++) {
      mx = std::fmax(mx, std::fabs(ref.logits[off + j]));
      err = std::fmax(err, std::fabs(((float *)lg->data)[j] - ref.logits[off + j]));
    }
    CHECK(err <= 1e-5f * mx, "micro-batch 0's logits differ by %g (largest %g)", err, mx);
  }
  rtp_optimizer *opt = rtp_parallel_optimizer(par, adam());
  rtp_tensor *loss = rtp_parallel_tensor(par, m.loss);
  CHECK(opt && loss, "optimizer or loss");
  for (int st = 0; st < kSteps; st++) {
    if (st == 1) CHECK_OK(rtp_graph_compute(fg, nullptr));
    CHECK_OK(rtp_graph_compute(g, nullptr));
    CHECK_OK(rtp_optimizer_step(opt, nullptr));
    float l = rtptest::f32_at(loss, 0), nrm = rtp_optimizer_grad_norm(opt);
    if (rank == 0)
      std::printf("%s step %d: loss %.7f (one process %.7f)\n", name(c).c_str(), st, l,
                  ref.losses[st]);
    CHECK(std::fabs(l - ref.losses[st]) <= 1e-5f * std::fabs(ref.losses[st]),
          "step %d: loss %.8f, one process %.8f", st, l, ref.losses[st]);
    CHECK(std::fabs(nrm - ref.norms[st]) <= 1e-5f * ref.norms[st],
          "step %d: gradient norm %.8f, one process %.8f", st, nrm, ref.norms[st]);
  }
  if (int rc = check_params(rank, par, m, ref)) return rc;
  h.close(true);
  return 0;
}

void run_hetero(const HeteroCase &c) {
  Reference ref;
  ASSERT_TRUE(reference(1, &ref, c.U * c.seqs));
  int port = rtptest::free_port(), n = job_size(c);
  auto res = rtptest::run_procs(
      n, [&](int r) { return hetero_rank(c, r, port, ref); }, 120);
  for (int r = 0; r < n; r++) EXPECT_EQ(res[r].code, 0) << name(c) << ": rank " << r;
}

// A tp stage of 2 ranks feeding a ddp stage of 3: every unit's activation has two
// holders (the planner picks one) and one receiver; its gradient one holder and two
// receivers (a chain).
TEST(PipelineHetero, TpTwoToDdpThree) {
  run_hetero({{2, 3}, {RTP_STRATEGY_TP, RTP_STRATEGY_DDP}, 6, 2});
}

// And the other way: a tp stage last, whose loss every rank computes for every unit.
TEST(PipelineHetero, DdpTwoToTpTwo) {
  run_hetero({{2, 2}, {RTP_STRATEGY_DDP, RTP_STRATEGY_TP}, 4, 1});
}

// rtp on 2 ranks to one rank, and one rank to fsdp on 2: the last stage runs every unit,
// the first shares them out, and the other way round.
TEST(PipelineHetero, RtpTwoToOneAndOneToFsdpTwo) {
  run_hetero({{2, 1}, {RTP_STRATEGY_RTP, RTP_STRATEGY_NONE}, 4, 2});
  run_hetero({{1, 2}, {RTP_STRATEGY_NONE, RTP_STRATEGY_FSDP}, 4, 2});
}

// Three stages: rtp on 3 ranks, tp on 2, ddp on 2 (unit u on rank u % 3, then on both, then
// on rank u % 2).
TEST(PipelineHetero, ThreeStagesOfThreeTwoTwo) {
  run_hetero({{3, 2, 2}, {RTP_STRATEGY_RTP, RTP_STRATEGY_TP, RTP_STRATEGY_DDP}, 6, 1});
}

// What cannot run is refused on every rank, with a message, before anything is sent.
TEST(PipelineHetero, ImpossibleSpecsAreRefused) {
  struct Refusal {
    HeteroCase c;
    int status;
    const char *words;
  };
  const std::vector<Refusal> refusals = {
      {{{2, 1}, {RTP_STRATEGY_RTP, RTP_STRATEGY_NONE}, 3, 1}, RTP_EINVAL, "multiple of"},
      {{{2, 1}, {RTP_STRATEGY_DDP, RTP_STRATEGY_NONE}, 2, 1, RTP_SCHEDULE_1F1B},
       RTP_ENOSYS,
       "gpipe"},
      {{{2, 1}, {RTP_STRATEGY_NONE, RTP_STRATEGY_NONE}, 2, 1}, RTP_EINVAL, "stage 0: 2 ranks"},
  };
  for (const Refusal &f : refusals) {
    int port = rtptest::free_port(), n = job_size(f.c);
    auto res = rtptest::run_procs(
        n,
        [&](int rank) {
          HeteroRank h;
          if (int rc = h.open(f.c, rank, port, 64 << 20)) return rc;
          CHECK(!h.plan(f.c), "%s was not refused", name(f.c).c_str());
          std::string msg = rtp_last_error();
          CHECK(rtp_context_error(h.ctx, nullptr) == f.status, "status %d: %s",
                rtp_context_error(h.ctx, nullptr), msg.c_str());
          CHECK(msg.find(f.words) != std::string::npos, "message: %s", msg.c_str());
          h.close(true);
          return 0;
        },
        60);
    for (int r = 0; r < n; r++) EXPECT_EQ(res[r].code, 0) << name(f.c) << ": rank " << r;
  }
}

// Checkpoints take each stage's strategy and group (index version 3, its stages' ranks and
// strategies: tp's ranks write rtp's row blocks, ddp's first rank alone) and load back
// onto the plan (train-gpt's TrainGptCkpt.StagesCheckpointsResumeOnAnyLayout checks the
// values on other layouts); the live reshard of a training state (one group size per
// plan) still refuses on every rank, which would otherwise lay the stages' parameters out
// wrongly.
TEST(PipelineHetero, CheckpointsLoadAndLiveReshardRefuses) {
  const HeteroCase c = {{2, 2}, {RTP_STRATEGY_TP, RTP_STRATEGY_DDP}, 2, 1};
  const std::string dir = testing::TempDir() + "rtp-hetero-ckpt-" + std::to_string(getpid());
  int port = rtptest::free_port();
  auto res = rtptest::run_procs(
      4,
      [&](int rank) {
        HeteroRank h;
        if (int rc = h.open(c, rank, port, gpt_arena_size(kCfg, 1) * 4)) return rc;
        rtp_parallel *par = h.plan(c);
        CHECK(par, "rtp_parallel_new: %s", rtp_last_error());
        CHECK_OK(rtp_graph_plan(h.ctx, rtp_parallel_graph(par)));
        rtp_ckpt_params kp{};
        kp.dir = dir.c_str();
        kp.par = par;
        kp.comm = h.job;
        kp.strategy = RTP_STRATEGY_DDP;
        kp.params = h.m.params;
        kp.n_params = h.m.n_params;
        CHECK_OK(rtp_ckpt_save(&kp, 1));
        rtp_ckpt *ck = nullptr;
        CHECK_OK(rtp_ckpt_open(dir.c_str(), &ck));
        CHECK(rtp_ckpt_stages(ck) == 2 && rtp_ckpt_world_size(ck) == 4 &&
                  rtp_ckpt_strategy(ck) == RTP_STRATEGY_TP,
              "index: %d stages, %d ranks", rtp_ckpt_stages(ck), rtp_ckpt_world_size(ck));
        CHECK_OK(rtp_ckpt_load(ck, &kp));
        rtp_ckpt_close(ck);
        rtp_parallel_reshard_params rp{};
        rp.job = h.job;
        rp.from = par;
        rp.to = par;
        CHECK(rtp_parallel_reshard(&rp) == RTP_EINVAL, "resharded: %s", rtp_last_error());
        CHECK(std::string(rtp_last_error())
                      .find(rank == 0 ? "stages of different sizes" : "rank 0 refused") !=
                  std::string::npos,
              "message: %s", rtp_last_error());
        h.close(true);
        return 0;
      },
      60);
  for (int r = 0; r < 4; r++) EXPECT_EQ(res[r].code, 0) << "rank " << r;
  // tp's 2 ranks and ddp's first: 3 files
  for (int r = 0; r < 4; r++)
    EXPECT_EQ(
        access((dir + "/step-00000001/rank-" + std::to_string(r) + ".safetensors").c_str(),
               F_OK) == 0,
        r != 3)
        << "rank " << r;
  EXPECT_EQ(std::system(("rm -rf '" + dir + "'").c_str()), 0);
}

// The last stage's rank dies after a step: the others, waiting at a boundary, fail naming
// it within the timeout; none waits for ever.
TEST(PipelineHetero, RankKilledAtABoundary) {
  const HeteroCase c = {{2, 1}, {RTP_STRATEGY_TP, RTP_STRATEGY_NONE}, 2, 1};
  const int timeout_ms = 3000, n = 3;
  int port = rtptest::free_port();
  auto res = rtptest::run_procs(
      n,
      [&](int rank) {
        HeteroRank h;
        if (int rc = h.open(c, rank, port, gpt_arena_size(kCfg, 1) * 4, timeout_ms)) return rc;
        rtp_parallel *par = h.plan(c);
        CHECK(par, "rtp_parallel_new: %s", rtp_last_error());
        rtp_graph *g = rtp_parallel_graph(par);
        CHECK_OK(rtp_graph_plan(h.ctx, g));
        if (rank == 2) {
          CHECK_OK(rtp_graph_compute(g, nullptr));
          kill(getpid(), SIGKILL);
          return 0;
        }
        double t0 = rtptest::now_s();
        int st = RTP_OK;
        for (int s = 0; s < 1000 && st == RTP_OK; s++) st = rtp_graph_compute(g, nullptr);
        int rc = rtptest::expect_failure(rank, st, t0, 3.0 * timeout_ms / 1000,
                                         {RTP_EPEER, RTP_ETIMEDOUT, RTP_ECOMM}, {"rank 2"});
        h.close(false);
        return rc;
      },
      60, {2});
  for (int r = 0; r < 2; r++) EXPECT_EQ(res[r].code, 0) << "rank " << r;
}

}  // namespace
