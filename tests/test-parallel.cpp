// Every strategy trains the same model to the same numbers: N ranks (processes over TCP
// on 127.0.0.1) with batch B each (tp: all ranks on the whole batch N x B) give the same
// losses and final parameters as one process with batch N x B, within float rounding.
// Also: rtp's memory per rank.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
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
  ~Model() {
    rtp_free(ctx);
  }
};

// The one-process reference: batch world x B, K Adam steps from the initial values
// (kept in init).
bool reference(int world, std::vector<float> &losses, std::vector<float> &norms, Model &ref,
               std::vector<std::vector<float>> &moving, std::vector<std::vector<float>> &init,
               std::vector<std::vector<float>> &grad0) {
  rtp_init_params ip = {gpt_arena_size(kCfg, world * kBatch), nullptr, false, nullptr, 0};
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
        for (int64_t j = 0; j < rtp_nelements(gr); j++)
          mx = std::fmax(mx, std::fabs(((float *)gr->data)[j]));
        std::vector<float> mv(rtp_nelements(gr));
        for (int64_t j = 0; j < rtp_nelements(gr); j++)
          mv[j] = std::fabs(((float *)gr->data)[j]) > 1e-3f * mx ? 1.0f : 0.0f;
        moving.push_back(mv);
        grad0.emplace_back((float *)gr->data, (float *)gr->data + rtp_nelements(gr));
      }
    if (rtp_optimizer_step(opt, nullptr)) return false;
    norms.push_back(rtp_optimizer_grad_norm(opt));
  }
  return norms[0] > adam().clip_norm;  // clipping must act for the test to mean anything
}

// This rank's part of a whole parameter's values (or gradient, or mask).
std::vector<float> shard(rtp_parallel *par, const gpt &m, int i,
                         const std::vector<float> &full) {
  std::vector<float> mine(rtp_nelements(rtp_parallel_tensor(par, m.params[i])));
  EXPECT_EQ(rtp_parallel_shard_copy(par, m.params[i], full.data(), mine.data()), RTP_OK);
  return mine;
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
// parameters take no memory), and this rank's graph from rtp_parallelize. Leaving waits
// for every rank, since a rank that leaves early fails the others' transfers in flight.
struct Rank {
  rtp_comm *comm = nullptr;
  rtp_context *meta = nullptr, *ctx = nullptr;
  gpt m{};
  rtp_parallel *par = nullptr;

  // 0, or `code` after a failure.
  int join(int rank, int world, int port, int code) {
    rtp_comm_params cp = rtptest::params(rank, world, port);
    return rtp_comm_init(&cp, &comm) ? code : 0;
  }

  int build(rtp_strategy strategy, gpt_config cfg, int batch, int code) {
    rtp_init_params meta_ip = {32 << 20, nullptr, true, nullptr, 0};
    meta = rtp_init(meta_ip);
    rtp_graph *fwd = rtp_graph_new(meta, 8192);
    if (gpt_build(meta, &m, cfg, batch) || rtp_graph_build(fwd, m.loss)) return code;
    rtp_init_params ip = {gpt_arena_size(cfg, batch), nullptr, false, nullptr, 0};
    ctx = rtp_init(ip);
    rtp_parallel_params pp = {strategy, comm, 0, 0};
    par = rtp_parallelize(ctx, fwd, m.loss, &pp);
    if (par) return 0;
    fprintf(stderr, "rtp_parallelize: %s\n", rtp_last_error());
    return code + 1;
  }

  void leave() {
    rtp_comm_barrier(comm, nullptr);
    rtp_comm_free(comm);
    comm = nullptr;
  }

  ~Rank() {
    rtp_free(ctx);
    rtp_free(meta);
    rtp_comm_free(comm);
  }
};

int rank_main(rtp_strategy strategy, int rank, int world, int port) {
  std::vector<float> want, want_norm;
  Model ref;
  std::vector<std::vector<float>> moving;
  std::vector<std::vector<float>> init, grad0;
  if (!reference(world, want, want_norm, ref, moving, init, grad0)) return 20;

  Rank rk;
  if (int rc = rk.join(rank, world, port, 21)) return rc;
  // tp splits the model, not the batch: every rank runs the whole global batch.
  int batch = strategy == RTP_STRATEGY_TP ? world * kBatch : kBatch;
  int first_seq = strategy == RTP_STRATEGY_TP ? 0 : rank * kBatch;
  if (int rc = rk.build(strategy, kCfg, batch, 22)) return rc;
  rtp_parallel *par = rk.par;
  const gpt &m = rk.m;
  rtp_graph *g = rtp_parallel_graph(par);
  if (rtp_graph_plan(rk.ctx, g)) return 24;
  if (strategy == RTP_STRATEGY_TP && world > 1 && !tp_is_split(par, m, g, world)) return 34;
  // Parameters: this rank's part of the reference's initial values.
  for (int i = 0; i < m.n_params; i++) {
    rtp_tensor *mine = rtp_parallel_tensor(par, m.params[i]);
    if (!mine) return 25;
    if (rtp_parallel_shard_copy(par, m.params[i], init[i].data(), (float *)mine->data))
      return 26;
  }
  rtp_tensor *idx = rtp_parallel_tensor(par, m.idx), *tgt = rtp_parallel_tensor(par, m.targets);
  for (int b = 0; b < batch; b++)
    fill_sequence(first_seq + b, kCfg.seq_len, (int32_t *)idx->data + b * kCfg.seq_len,
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
    rtp_tensor *mine = rtp_parallel_tensor(par, m.params[i]);
    const float *fin = (const float *)ref.m.params[i]->data;
    std::vector<float> want_p =
        shard(par, m, i, std::vector<float>(fin, fin + rtp_nelements(ref.m.params[i])));
    std::vector<float> mv = shard(par, m, i, moving[i]);
    // Relative in the L2 norm of the block, with the weights' scale (init std 0.02) as the
    // floor: zero-initialised biases hold only a few Adam steps, below float rounding.
    // Adam divides by each gradient's own size, so where one is tiny beside the terms
    // that summed to it (zero, for the key bias) rounding decides its step: those
    // elements are left out (gradients themselves are compared in full above).
    double err = 0, ref2 = 0, n = 0;
    for (int64_t j = 0; j < rtp_nelements(mine); j++) {
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

class Equivalence : public ::testing::TestWithParam<rtp_strategy> {};

TEST_P(Equivalence, NRanksMatchOneProcess) {
  rtp_strategy s = GetParam();
  for (int world : {1, 2, 3, 4}) {
    // tp splits the tiny model's 4 heads between the ranks: 3 cannot share them (that
    // refusal is ParallelErrors.TpHeadsNotDivisible).
    if (s == RTP_STRATEGY_TP && world == 3) continue;
    int port = rtptest::free_port();
    auto res = rtptest::run_procs(
        world, [&](int r) { return rank_main(s, r, world, port); }, 120);
    for (int r = 0; r < world; r++)
      EXPECT_EQ(res[r].code, 0) << rtp_strategy_name(s) << " world " << world << " rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(Strategies, Equivalence,
                         ::testing::Values(RTP_STRATEGY_DDP, RTP_STRATEGY_FSDP, RTP_STRATEGY_TP,
                                           RTP_STRATEGY_RTP),
                         [](const auto &info) {
                           return std::string(rtp_strategy_name(info.param));
                         });

}  // namespace

namespace {

size_t proc_bytes(const char *key) {
  FILE *f = fopen("/proc/self/status", "r");
  char line[256];
  size_t kb = 0;
  while (f && fgets(line, sizeof(line), f))
    if (strncmp(line, key, strlen(key)) == 0)
      kb = strtoull(line + strlen(key) + 1, nullptr, 10);
  if (f) fclose(f);
  return kb * 1024;
}

size_t model_states(const rtp_mem_report &r) {
  return r.bytes[RTP_ROLE_PARAM] + r.bytes[RTP_ROLE_GRAD] + r.bytes[RTP_ROLE_OPTIM];
}

// Model states of one process: parameters, gradients, Adam's two states.
size_t one_process_states(gpt_config cfg, size_t *largest_block_of, int world) {
  Model ref;
  rtp_init_params ip = {gpt_arena_size(cfg, 1), nullptr, false, nullptr, 0};
  ref.ctx = rtp_init(ip);
  gpt_build(ref.ctx, &ref.m, cfg, 1);
  ref.g = rtp_graph_new(ref.ctx, 8192);
  rtp_graph_build(ref.g, ref.m.loss);
  rtp_build_backward(ref.ctx, ref.g, ref.m.loss);
  rtp_optimizer_new(ref.ctx, ref.g, rtp_adamw_default());
  *largest_block_of = 0;
  for (int i = 0; i < ref.m.n_params; i++) {  // block 0 is a largest one (rtp_comm_block)
    const rtp_tensor *p = ref.m.params[i];
    int64_t rows = p->ne[rtp_n_dims(p) - 1];
    size_t block = (size_t)(rtp_nelements(p) / rows * ((rows + world - 1) / world)) * 4;
    *largest_block_of = std::max(*largest_block_of, block);
  }
  rtp_mem_report r;
  rtp_mem_report_get(ref.ctx, &r);
  return model_states(r);
}

// One rank: parallelize with rtp, plan, make Adam; optionally run steps. Its report and
// the resident memory before building and at the end.
int rtp_rank_memory(gpt_config cfg, int batch, int rank, int world, int port, int steps,
                    rtp_mem_report *rep, size_t *baseline, size_t *peak) {
  Rank rk;
  if (int rc = rk.join(rank, world, port, 40)) return rc;
  *baseline = proc_bytes("VmRSS:");
  if (int rc = rk.build(RTP_STRATEGY_RTP, cfg, batch, 41)) return rc;
  rtp_parallel *par = rk.par;
  const gpt &m = rk.m;
  if (rtp_graph_plan(rk.ctx, rtp_parallel_graph(par))) return 42;
  rtp_optimizer *opt = rtp_parallel_optimizer(par, rtp_adamw_default());
  if (!opt) return 43;
  for (int i = 0; i < m.n_params; i++) {
    rtp_tensor *t = rtp_parallel_tensor(par, m.params[i]);
    for (int64_t j = 0; j < rtp_nelements(t); j++)
      ((float *)t->data)[j] = 0.01f * (float)(j % 7);
  }
  for (int s = 0; s < steps; s++)
    if (rtp_graph_compute(rtp_parallel_graph(par), nullptr) || rtp_optimizer_step(opt, nullptr))
      return 44;
  rtp_mem_report_get(rk.ctx, rep);
  *peak = proc_bytes("VmHWM:");
  rk.leave();
  return 0;
}

// rtp's model states per rank are at most a 1/N share of one process's (plus each
// tensor's padding to 64 bytes), and the pool is two (block, gradient) pairs of the
// largest block whatever the depth.
TEST(Memory, RtpStatesAreOneNthPlusPool) {
  for (int world : {2, 4})
    for (int layers : {2, 6}) {
      gpt_config cfg = {256, 16, 48, layers, 4};
      size_t largest = 0, single = one_process_states(cfg, &largest, world);
      int port = rtptest::free_port();
      auto res = rtptest::run_procs(world, [&](int r) {
        rtp_mem_report rep;
        size_t base, peak;
        int rc = rtp_rank_memory(cfg, 2, r, world, port, 0, &rep, &base, &peak);
        if (rc) return rc;
        size_t tensors = 3 * (4 + 12 * (size_t)layers + 3), pad = 64 * tensors;
        if (model_states(rep) > single / world + pad) {
          fprintf(stderr, "rank %d: states %zu > %zu / %d + %zu\n", r, model_states(rep),
                  single, world, pad);
          return 45;
        }
        size_t pool = 4 * ((largest + 63) / 64 * 64);
        if (rep.bytes[RTP_ROLE_COMM] != pool) {
          fprintf(stderr, "rank %d: pool %zu, want %zu\n", r, rep.bytes[RTP_ROLE_COMM], pool);
          return 46;
        }
        return 0;
      });
      for (int r = 0; r < world; r++)
        EXPECT_EQ(res[r].code, 0) << "world " << world << " layers " << layers << " rank " << r;
    }
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
    rtp_context *meta = rtp_init(mip);
    rtp_tensor *w = rtp_set_name(rtp_new_tensor_2d(meta, RTP_TYPE_F32, 4, 2), "w");
    rtp_tensor *x = rtp_new_tensor_2d(meta, RTP_TYPE_F32, 4, 5);
    rtp_set_param(w);
    rtp_tensor *loss = rtp_sum(meta, rtp_mul_mat(meta, w, x));
    rtp_graph *g = rtp_graph_new(meta, 64);
    rtp_graph_build(g, loss);
    rtp_init_params ip = {1 << 20, nullptr, false, nullptr, 0};
    rtp_context *ctx = rtp_init(ip);
    int code = 0;
    for (rtp_strategy s : {RTP_STRATEGY_RTP, RTP_STRATEGY_FSDP}) {
      rtp_parallel_params pp = {s, comm, 0, 0};
      if (rtp_parallelize(ctx, g, loss, &pp) != nullptr) code = 51;
      const char *msg = nullptr;
      rtp_context_error(ctx, &msg);
      if (!strstr(msg, "fewer rows") || !strstr(msg, "'w'")) code = 52;
    }
    rtp_free(ctx);
    rtp_free(meta);
    rtp_comm_barrier(comm, nullptr);  // nobody leaves while a rank still talks to it
    rtp_comm_free(comm);
    return code;
  });
  for (int r = 0; r < world; r++) EXPECT_EQ(res[r].code, 0) << "rank " << r;
}

// tp with heads that the ranks cannot share evenly (4 heads, 3 ranks, d = 48 so that every
// weight itself would split): a clear error at rtp_parallelize, on every rank.
TEST(ParallelErrors, TpHeadsNotDivisible) {
  const int world = 3;
  int port = rtptest::free_port();
  auto res = rtptest::run_procs(world, [&](int r) {
    rtp_comm_params cp = rtptest::params(r, world, port);
    rtp_comm *comm = nullptr;
    if (rtp_comm_init(&cp, &comm)) return 60;
    gpt_config cfg = {256, 16, 48, 1, 4};
    rtp_init_params mip = {16 << 20, nullptr, true, nullptr, 0};
    rtp_context *meta = rtp_init(mip);
    gpt m{};
    rtp_graph *g = rtp_graph_new(meta, 4096);
    if (gpt_build(meta, &m, cfg, 2) || rtp_graph_build(g, m.loss)) return 61;
    rtp_init_params ip = {gpt_arena_size(cfg, 2), nullptr, false, nullptr, 0};
    rtp_context *ctx = rtp_init(ip);
    rtp_parallel_params pp = {RTP_STRATEGY_TP, comm, 0, 0};
    int code = rtp_parallelize(ctx, g, m.loss, &pp) == nullptr ? 0 : 62;
    const char *msg = "";
    if (!code && rtp_context_error(ctx, &msg) != RTP_EINVAL) code = 63;
    if (!code && (!strstr(msg, "heads") || !strstr(msg, "not divisible by the 3 ranks"))) {
      fprintf(stderr, "rank %d: unclear message: %s\n", r, msg);
      code = 64;
    }
    rtp_free(ctx);
    rtp_free(meta);
    rtp_comm_barrier(comm, nullptr);  // nobody leaves while a rank still talks to it
    rtp_comm_free(comm);
    return code;
  });
  for (int r = 0; r < world; r++) EXPECT_EQ(res[r].code, 0) << "rank " << r;
}

}  // namespace
