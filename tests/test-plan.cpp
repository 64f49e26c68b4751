// test-plan: the planner's predictions (tools/plan-model.c, tools/rtp-plan.c) against
// ranks that really train. A dry build of a rank must report exactly what the real build
// of the same rank reports, and that report (plus what the process held before, plus
// plan_rss_overhead) must predict the rank's peak resident memory over training steps
// within 10%, for every strategy and a pipeline.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <cstring>

#include "plan-model.h"
#include "test-util.h"

namespace {

// VmHWM restarts at the current RSS (a forked rank inherits its parent's otherwise).
void reset_peak() {
  FILE *f = fopen("/proc/self/clear_refs", "w");
  if (!f) return;
  fputs("5", f);
  fclose(f);
}

// A model a bit larger than tiny, so that its arena (tens of MiB) dominates the process.
plan_model test_model() {
  plan_model pm{};
  pm.cfg = {256, 64, 256, 4, 4, false, false};
  pm.batch = 4;
  pm.micro_batches = 1;
  pm.schedule = RTP_SCHEDULE_1F1B;
  return pm;
}

// The rank's stage and pipe groups, as train-gpt joins them.
int join(const plan_layout &l, int rank, int port, rtp_comm **world, rtp_comm **group,
         rtp_comm **pipe) {
  *world = *group = *pipe = nullptr;
  if (l.ranks == 1) return 0;
  rtp_comm_params cp = rtptest::params(rank, l.ranks, port, 60000);
  CHECK_OK(rtp_comm_init(&cp, world));
  if (l.stages == 1) {
    *group = *world;
    return 0;
  }
  rtp_comm *row = nullptr;
  CHECK_OK(rtp_comm_mesh_2d(*world, l.stages, l.ranks / l.stages, &row, pipe));
  if (l.ranks / l.stages > 1)
    *group = row;
  else
    rtp_comm_free(row);
  return 0;
}

void fill(const plan_rank &r, int micro) {
  for (int i = 0; i < r.m.n_params; i++) {
    rtp_tensor *t = rtp_parallel_tensor(r.par, r.m.params[i]);
    for (int64_t j = 0; t && j < rtp_tensor_nelements(t); j++)
      ((float *)t->data)[j] = 0.02f * (float)((j * 7919) % 101 - 50) / 50;
  }
  for (int k = 0; k < micro; k++) {
    rtp_tensor *idx = rtp_parallel_micro_tensor(r.par, r.m.idx, k);
    rtp_tensor *tgt = rtp_parallel_micro_tensor(r.par, r.m.targets, k);
    for (int64_t j = 0; idx && j < rtp_tensor_nelements(idx); j++) {
      ((int32_t *)idx->data)[j] = (int32_t)((j * 31) % 256);
      ((int32_t *)tgt->data)[j] = (int32_t)((j * 17 + 3) % 256);
    }
  }
}

bool same_report(int rank, const rtp_mem_report &a, const rtp_mem_report &b) {
  bool same = a.total == b.total && a.work == b.work;
  for (int k = 0; k < RTP_ROLE_COUNT; k++) same &= a.bytes[k] == b.bytes[k];
  if (!same)
    fprintf(stderr, "rank %d: dry total %zu (activations %zu, comm %zu), real %zu (%zu, %zu)\n",
            rank, a.total, a.bytes[RTP_ROLE_ACTIVATION], a.bytes[RTP_ROLE_COMM], b.total,
            b.bytes[RTP_ROLE_ACTIVATION], b.bytes[RTP_ROLE_COMM]);
  return same;
}

const int kThreads = 2;

// One rank: real build, two training steps, then the dry build of the same rank.
int rank_check(const plan_model &pm, const plan_layout &l, int rank, int port) {
  rtp_comm *world, *group, *pipe;
  if (int rc = join(l, rank, port, &world, &group, &pipe)) return rc;
  rtp_threadpool *tp = rtp_threadpool_new(kThreads);
  size_t base = rtptest::proc_bytes("VmRSS:");
  reset_peak();
  plan_rank real, dry;
  CHECK_OK(plan_rank_build(&real, &pm, &l, rank, false, group, pipe));
  fill(real, pm.micro_batches);
  for (int s = 0; s < 2; s++) {  // train-gpt's step, --grad-accum's computes included
    CHECK_OK(rtp_parallel_zero_grads(real.par));
    for (int k = 0; k < std::max(1, pm.accumulate); k++)
      CHECK_OK(rtp_graph_compute(real.train, tp));
    CHECK_OK(rtp_parallel_sync(real.par, tp));
    CHECK_OK(rtp_optimizer_step(real.opt, tp));
  }
  size_t peak = rtptest::proc_bytes("VmHWM:");
  rtp_mem_report got, want;
  rtp_mem_report_get(real.ctx, &got);
  CHECK_OK(plan_rank_build(&dry, &pm, &l, rank, true, nullptr, nullptr));
  rtp_mem_report_get(dry.ctx, &want);
  double predicted = (double)(base + want.total + plan_rss_overhead(&dry));
  printf(
      "%s ranks %d stages %d rank %d: peak %.1f MiB, predicted %.1f MiB (base %.1f, "
      "report %.1f, overhead %.1f): %+.1f%%\n",
      rtp_strategy_name(l.strategy), l.ranks, l.stages, rank, peak / 1048576.0,
      predicted / 1048576.0, base / 1048576.0, want.total / 1048576.0,
      plan_rss_overhead(&dry) / 1048576.0, 100 * (predicted - peak) / peak);
  int code = same_report(rank, want, got) ? 0 : 30;
  if (std::fabs(predicted - (double)peak) > 0.1 * (double)peak) code = 31;
  plan_rank_free(&dry);
  plan_rank_free(&real);
  rtp_threadpool_free(tp);
  if (world) rtp_comm_barrier(world, nullptr);
  if (group && group != world) rtp_comm_free(group);
  rtp_comm_free(pipe);
  rtp_comm_free(world);
  return code;
}

void check_layout(const plan_layout &l, bool recompute = false, int accumulate = 1,
                  bool in_backward = false) {
  plan_model pm = test_model();
  pm.recompute = recompute;
  pm.adam_in_backward = in_backward;
  pm.accumulate = accumulate;
  if (l.stages > 1) pm.micro_batches = 2;
  int port = rtptest::free_port();
  auto res = rtptest::run_procs(
      l.ranks, [&](int r) { return rank_check(pm, l, r, port); }, 120);
  for (int r = 0; r < l.ranks; r++)
    EXPECT_EQ(res[r].code, 0) << rtp_strategy_name(l.strategy) << " stages " << l.stages
                              << " rank " << r;
}

TEST(PlanMemory, OneProcess) {
  check_layout({RTP_STRATEGY_NONE, 1, 1});
}
TEST(PlanMemory, Ddp) {
  check_layout({RTP_STRATEGY_DDP, 2, 1});
}
TEST(PlanMemory, Fsdp) {
  check_layout({RTP_STRATEGY_FSDP, 2, 1});
}
TEST(PlanMemory, Rtp) {
  check_layout({RTP_STRATEGY_RTP, 2, 1});
}
TEST(PlanMemory, Tp) {
  check_layout({RTP_STRATEGY_TP, 2, 1});
}
// --grad-accum 2: ddp's all-reduces leave the graph for the sync graph, planned too.
TEST(PlanMemory, DdpAccumulate) {
  check_layout({RTP_STRATEGY_DDP, 2, 1}, false, 2);
}

TEST(PlanMemory, RtpRecompute) {
  check_layout({RTP_STRATEGY_RTP, 2, 1}, true);
}
// The optimizer in backward: no gradients kept, their planned memory in the activations.
TEST(PlanMemory, RtpRecomputeAdamInBackward) {
  check_layout({RTP_STRATEGY_RTP, 2, 1}, true, 1, true);
}
TEST(PlanMemory, FsdpAdamInBackward) {
  check_layout({RTP_STRATEGY_FSDP, 2, 1}, false, 1, true);
}
TEST(PlanMemory, PipelineOfRtp) {
  check_layout({RTP_STRATEGY_RTP, 4, 2});
}

}  // namespace
