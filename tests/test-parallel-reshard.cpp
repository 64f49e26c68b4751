// test-parallel-reshard: rtp_parallel_reshard moves a training state live between parallel
// plans (N ranks to M, strategies, pipelines). On 4 processes: plan A trains 3 steps; its
// state goes to plan B and back to a fresh A (bit for bit: every parameter, Adam state and
// the step count); then A trains 3 steps more as if nothing happened, B trains its 3 steps,
// and B's losses equal A's within 1e-6 relative (and one process's within 1e-5).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "test-gpt-ranks.h"
#include "test-util.h"

namespace {

using rtptest::kRanksCfg;

const int kWorld = 4, kSteps = 3;
const int kGlobal = 12;  // sequences a step, split over every layout's data-parallel ranks

struct Layout {
  const char *name;
  rtp_strategy strategy;
  int ranks, stages;  // on job ranks 0 .. ranks - 1, stage = rank / (ranks / stages)
};

// Sequence q of step s: the same global batch whatever the layout.
void fill_sequence(int s, int q, int32_t *idx, int32_t *tgt) {
  const int T = kRanksCfg.seq_len, V = kRanksCfg.vocab;
  for (int t = 0; t < T; t++) {
    idx[t] = (int32_t)((7 * t + 3 * q + 11 * s + 1) % V);
    tgt[t] = (int32_t)((5 * t + q + 2 * s) % V);
  }
}

rtp_adamw_params adam() {
  rtp_adamw_params hp = rtp_adamw_params_default();
  hp.lr = rtptest::kRanksLr;
  hp.clip_norm = 0.5f;
  return hp;
}

// One rank's plan of a layout, its model and its optimizer.
struct Plan {
  rtp_context *meta = nullptr, *ctx = nullptr;
  gpt m{};
  rtp_graph *fwd = nullptr, *g = nullptr;
  rtp_parallel *par = nullptr;
  rtp_optimizer *opt = nullptr;
  int rank = 0;  // in the job
  int dp = 1, dp_rank = 0, micro = 1, batch = 0;

  ~Plan() {
    rtp_context_free(ctx);
    rtp_context_free(meta);
  }
};

// The layout's groups for this job rank (collective over job: every rank calls it).
struct Groups {
  rtp_comm *all = nullptr, *group = nullptr, *pipe = nullptr;
  ~Groups() {
    if (group != all) rtp_comm_free(group);
    rtp_comm_free(pipe);
    rtp_comm_free(all);
  }
};

int join(rtp_comm *job, const Layout &l, int rank, Groups *gr) {
  CHECK_OK(rtp_comm_split(job, rank < l.ranks ? 0 : RTP_COMM_UNDEFINED, rank, &gr->all));
  if (!gr->all || l.ranks == 1) return 0;
  if (l.stages == 1) {
    gr->group = gr->all;
    return 0;
  }
  rtp_comm *row = nullptr;
  CHECK_OK(rtp_comm_mesh_2d(gr->all, l.stages, l.ranks / l.stages, &row, &gr->pipe));
  if (l.ranks / l.stages > 1)
    gr->group = row;
  else
    rtp_comm_free(row);
  return 0;
}

int build(const Layout &l, int rank, const Groups &gr, Plan *p, gpt_config cfg = kRanksCfg) {
  p->rank = rank;
  int per = l.ranks / l.stages;
  bool whole = l.strategy == RTP_STRATEGY_TP || per == 1;  // every rank on the whole batch
  p->micro = l.stages > 1 ? 2 : 1;
  p->dp = whole ? 1 : per;
  p->dp_rank = whole ? 0 : rank % per;
  p->batch = kGlobal / (p->dp * p->micro);
  p->meta = rtptest::gpt_forward(cfg, p->batch, &p->m, &p->fwd);
  CHECK(p->meta, "model: %s", rtp_last_error());
  for (int i = 0; i < cfg.n_layer; i++)  // the blocks a pipeline cuts at
    for (rtp_tensor **t = &p->m.blocks[i].ln_1_w; t <= &p->m.blocks[i].mlp_proj_b; t++)
      CHECK_OK(rtp_tensor_set_fsdp_unit(*t, i + 1));
  rtp_init_params ip = {gpt_arena_size(cfg, kGlobal) * 2 + (16 << 20), nullptr, false, nullptr,
                        0};
  p->ctx = rtp_context_new(ip);
  rtp_parallel_params pp{};
  pp.strategy = per > 1 ? l.strategy : RTP_STRATEGY_NONE;
  pp.comm = gr.group;
  pp.pipe_comm = gr.pipe;
  pp.micro_batches = p->micro;
  p->par = p->ctx ? rtp_parallel_new(p->ctx, p->fwd, p->m.loss, &pp) : nullptr;
  CHECK(p->par, "%s: rtp_parallel_new: %s", l.name, rtp_last_error());
  p->g = rtp_parallel_graph(p->par);
  CHECK_OK(rtp_graph_plan(p->ctx, p->g));
  p->opt = rtp_parallel_optimizer(p->par, adam());
  CHECK(p->opt, "%s: optimizer: %s", l.name, rtp_last_error());
  return 0;
}

int init_params(Plan *p) {
  const int rank = p->rank;
  for (int i = 0; i < p->m.n_params; i++) {
    rtp_tensor *mine = rtp_parallel_tensor(p->par, p->m.params[i]);
    if (!mine) continue;  // another stage's
    std::vector<float> full(rtp_tensor_nelements(p->m.params[i]));
    gpt_init_tensor(&p->m, i, 42, full.data());
    CHECK_OK(rtp_parallel_shard_copy(p->par, p->m.params[i], full.data(), (float *)mine->data));
  }
  return 0;
}

// Step s of plan p: its ranks' share of the global batch, one compute, one Adam step.
int step(Plan *p, int s, std::vector<float> *losses) {
  const int rank = p->rank;
  const int T = kRanksCfg.seq_len;
  for (int k = 0; k < p->micro; k++) {
    rtp_tensor *idx = rtp_parallel_micro_tensor(p->par, p->m.idx, k);
    rtp_tensor *tgt = rtp_parallel_micro_tensor(p->par, p->m.targets, k);
    for (int b = 0; idx && b < p->batch; b++)
      fill_sequence(s, (p->dp_rank * p->micro + k) * p->batch + b, (int32_t *)idx->data + b * T,
                    (int32_t *)tgt->data + b * T);
  }
  CHECK_OK(rtp_graph_compute(p->g, nullptr));
  CHECK_OK(rtp_optimizer_step(p->opt, nullptr));
  losses->push_back(rtptest::f32_at(rtp_parallel_tensor(p->par, p->m.loss), 0));
  return 0;
}

// hosts NULL: every rank on this machine's one host.
int reshard(rtp_comm *job, int rank, Plan *from, Plan *to, const int *hosts) {
  rtp_parallel_reshard_params rp{};
  rp.hosts = hosts;
  rp.job = job;
  rp.from = from ? from->par : nullptr;
  rp.from_opt = from ? from->opt : nullptr;
  rp.to = to ? to->par : nullptr;
  rp.to_opt = to ? to->opt : nullptr;
  rp.chunk_bytes = 1000;  // chains forward several chunks, an uneven last one too
  CHECK_OK(rtp_parallel_reshard(&rp));
  return 0;
}

// a's and b's tensors on this rank (the same layout) bit for bit: values, Adam states.
int same_state(const Plan &a, const Plan &b) {
  const int rank = a.rank;
  CHECK(rtp_optimizer_steps(a.opt) == rtp_optimizer_steps(b.opt), "steps %lld, back %lld",
        (long long)rtp_optimizer_steps(a.opt), (long long)rtp_optimizer_steps(b.opt));
  for (int i = 0; i < a.m.n_params; i++) {
    rtp_tensor *x[3] = {rtp_parallel_tensor(a.par, a.m.params[i])}, *y[3];
    y[0] = rtp_parallel_tensor(b.par, b.m.params[i]);
    if (!x[0]) continue;
    for (int k = 0; k < rtp_optimizer_count(a.opt); k++) {
      rtp_tensor *q;
      if (!rtp_optimizer_state(a.opt, k, &q, &x[1], &x[2]) && q == x[0]) break;
    }
    for (int k = 0; k < rtp_optimizer_count(b.opt); k++) {
      rtp_tensor *q;
      if (!rtp_optimizer_state(b.opt, k, &q, &y[1], &y[2]) && q == y[0]) break;
    }
    for (int k = 0; k < 3; k++)
      CHECK(rtp_tensor_nbytes(x[k]) == rtp_tensor_nbytes(y[k]) &&
                memcmp(x[k]->data, y[k]->data, rtp_tensor_nbytes(x[k])) == 0,
            "'%s' (%s) differs after the round trip", a.m.params[i]->name,
            k == 0   ? "value"
            : k == 1 ? "m"
                     : "v");
  }
  return 0;
}

// Rank 0 prints the largest relative difference, for the record.
int close_to(int rank, const std::vector<float> &got, const std::vector<float> &want,
             size_t from, float tol, const char *what) {
  double worst = 0;
  for (size_t s = 0; s < got.size(); s++) {
    float w = want[from + s];
    worst = std::fmax(worst, std::fabs(got[s] - w) / std::fabs(w));
    CHECK(std::fabs(got[s] - w) <= tol * std::fabs(w), "step %zu: loss %.9g, %s %.9g",
          from + s + 1, got[s], what, w);
  }
  if (rank == 0)
    printf("  steps %zu-%zu against %s: %.2g relative\n", from + 1, from + got.size(), what,
           worst);
  return 0;
}

int rank_run(const Layout &a, const Layout &b, int rank, int port,
             const std::vector<float> &one) {
  rtp_comm_params cp = rtptest::params(rank, kWorld, port);
  rtp_comm *job = nullptr;
  CHECK_OK(rtp_comm_init(&cp, &job));
  Groups ga, gb;
  if (int rc = join(job, a, rank, &ga)) return rc;
  if (int rc = join(job, b, rank, &gb)) return rc;
  bool in_a = rank < a.ranks, in_b = rank < b.ranks;
  Plan pa, pb, back;
  std::vector<float> la, lb;
  if (in_a) {
    if (int rc = build(a, rank, ga, &pa)) return rc;
    if (int rc = init_params(&pa)) return rc;
    for (int s = 0; s < kSteps; s++)
      if (int rc = step(&pa, s, &la)) return rc;
    if (int rc = build(a, rank, ga, &back)) return rc;
  }
  if (in_b)
    if (int rc = build(b, rank, gb, &pb)) return rc;
  const int two_hosts[kWorld] = {0, 0, 1, 1};
  if (int rc = reshard(job, rank, in_a ? &pa : nullptr, in_b ? &pb : nullptr, two_hosts))
    return rc;
  if (int rc = reshard(job, rank, in_b ? &pb : nullptr, in_a ? &back : nullptr, nullptr))
    return rc;
  if (in_a) {
    if (int rc = same_state(pa, back)) return rc;
    for (int s = kSteps; s < 2 * kSteps; s++)
      if (int rc = step(&pa, s, &la)) return rc;
    if (int rc = close_to(rank, la, one, 0, 1e-5f, "one process")) return rc;
  }
  if (in_b) {
    CHECK(rtp_optimizer_steps(pb.opt) == kSteps, "B's optimizer at step %lld",
          (long long)rtp_optimizer_steps(pb.opt));
    for (int s = kSteps; s < 2 * kSteps; s++)
      if (int rc = step(&pb, s, &lb)) return rc;
    if (int rc = close_to(rank, lb, one, kSteps, 1e-5f, "one process")) return rc;
    if (in_a)
      if (int rc = close_to(rank, lb, la, kSteps, 1e-6f, "never resharded")) return rc;
  }
  CHECK_OK(rtp_comm_barrier(job, nullptr));
  rtp_comm_free(job);
  return 0;
}

// One process's losses over 2 x kSteps steps on the whole global batch.
std::vector<float> one_process() {
  Layout one{"one", RTP_STRATEGY_NONE, 1, 1};
  Groups none;
  Plan p;
  std::vector<float> losses;
  if (build(one, 0, none, &p) || init_params(&p)) return {};
  for (int s = 0; s < 2 * kSteps; s++)
    if (step(&p, s, &losses)) return {};
  return losses;
}

void check(const Layout &a, const Layout &b) {
  static const std::vector<float> one = one_process();
  ASSERT_EQ(one.size(), 2u * kSteps) << rtp_last_error();
  int port = rtptest::free_port();
  auto res = rtptest::run_procs(
      kWorld, [&](int r) { return rank_run(a, b, r, port, one); }, 120);
  for (int r = 0; r < kWorld; r++)
    EXPECT_EQ(res[r].code, 0) << a.name << " -> " << b.name << ", rank " << r;
}

}  // namespace

TEST(ParallelReshard, FourRtpRanksToTwoFsdp) {
  check({"rtp 4", RTP_STRATEGY_RTP, 4, 1}, {"fsdp 2", RTP_STRATEGY_FSDP, 2, 1});
}

TEST(ParallelReshard, TwoTpRanksToFourRtp) {
  check({"tp 2", RTP_STRATEGY_TP, 2, 1}, {"rtp 4", RTP_STRATEGY_RTP, 4, 1});
}

TEST(ParallelReshard, ThreeDdpRanksToFourTp) {
  check({"ddp 3", RTP_STRATEGY_DDP, 3, 1}, {"tp 4", RTP_STRATEGY_TP, 4, 1});
}

TEST(ParallelReshard, RtpToAPipelineOfRtp) {
  check({"rtp 4", RTP_STRATEGY_RTP, 4, 1}, {"2 x 2 rtp", RTP_STRATEGY_RTP, 4, 2});
}

TEST(ParallelReshard, PipelineOfFsdpToOneProcess) {
  check({"2 x 2 fsdp", RTP_STRATEGY_FSDP, 4, 2}, {"one", RTP_STRATEGY_NONE, 1, 1});
}

TEST(ParallelReshard, OneProcessToThreeRtpRanks) {
  check({"one", RTP_STRATEGY_NONE, 1, 1}, {"rtp 3", RTP_STRATEGY_RTP, 3, 1});
}

// Refusals reach every rank of the job, each with the same words, and nothing hangs:
// rank 0's new plan has one layer fewer than its old one (rank 0 refuses, the others
// say that it did), then an optimizer on the new plan with none on the old one.
TEST(ParallelReshard, RefusalsFailEveryRank) {
  int port = rtptest::free_port();
  auto res = rtptest::run_procs(
      kWorld,
      [&](int rank) {
        rtp_comm_params cp = rtptest::params(rank, kWorld, port);
        rtp_comm *job = nullptr;
        CHECK_OK(rtp_comm_init(&cp, &job));
        Layout a{"rtp 2", RTP_STRATEGY_RTP, 2, 1}, b{"one", RTP_STRATEGY_NONE, 1, 1};
        Groups ga, gb;
        if (int rc = join(job, a, rank, &ga)) return rc;
        if (int rc = join(job, b, rank, &gb)) return rc;
        gpt_config shallow = kRanksCfg;
        shallow.n_layer = 1;
        Plan pa, pb, pc;
        if (rank < 2)
          if (int rc = build(a, rank, ga, &pa)) return rc;
        if (rank == 0)
          if (int rc = build(b, rank, gb, &pb, shallow)) return rc;
        rtp_parallel_reshard_params rp{};
        rp.job = job;
        rp.from = pa.par;
        rp.from_opt = pa.opt;
        rp.to = pb.par;
        rp.to_opt = pb.opt;
        int st = rtp_parallel_reshard(&rp);
        std::string msg = rtp_last_error();
        const char *want = rank == 0 ? "built from different models" : "rank 0 refused";
        CHECK(st == RTP_EINVAL && msg.find(want) != std::string::npos, "status %d: %s", st,
              msg.c_str());
        if (rank == 0)
          if (int rc = build(b, rank, gb, &pc)) return rc;
        rp.from_opt = nullptr;
        rp.to = pc.par;
        rp.to_opt = pc.opt;
        st = rtp_parallel_reshard(&rp);
        msg = rtp_last_error();
        CHECK(st == RTP_EINVAL && msg.find("no Adam states to move") != std::string::npos,
              "status %d: %s", st, msg.c_str());
        CHECK_OK(rtp_comm_barrier(job, nullptr));
        rtp_comm_free(job);
        return 0;
      },
      60);
  for (int r = 0; r < kWorld; r++) EXPECT_EQ(res[r].code, 0) << "rank " << r;
}
