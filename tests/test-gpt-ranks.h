// test-gpt-ranks.h - the reference model built for one device, as the tests that
// parallelize it take it, and K training steps of it as one rank of a parallel plan, on
// the CPU or a device backend: what the device tests compare with the CPU.
#pragma once

#include <cstdio>
#include <vector>

#include "gpt.h"
#include "rtp.h"
#include "test-util.h"

namespace rtptest {

// The reference model built for one device in a no_alloc context (its parameters take no
// memory) and its forward graph, as rtp_parallel_new takes them: the context, or NULL
// (the message in rtp_last_error) with nothing left allocated.
inline rtp_context *gpt_forward(gpt_config cfg, int batch, gpt *m, rtp_graph **fwd) {
  rtp_init_params mip = {32 << 20, nullptr, true, nullptr, 0};
  rtp_context *meta = rtp_context_new(mip);
  *fwd = meta ? rtp_graph_new(meta, 8192) : nullptr;
  if (!*fwd || gpt_build(meta, m, cfg, batch) || rtp_graph_build(*fwd, m->loss)) {
    rtp_context_free(meta);
    return nullptr;
  }
  return meta;
}

const gpt_config kRanksCfg = {64, 16, 32, 2, 4, false, false};
const int kRanksBatch = 2, kRanksSteps = 3;
const float kRanksLr = 1e-2f;

// Rank cp.rank's losses and its final parameter blocks after kRanksSteps steps of the
// strategy, with tensor data on backend b (NULL: the CPU). 0, or a code naming the stage
// that failed (the message goes to stderr).
inline int train_gpt_rank(const rtp_comm_params &cp, rtp_strategy strategy, rtp_backend *b,
                          std::vector<float> *losses, std::vector<float> *params) {
  const int rank = cp.rank;
  auto fail = [rank](int code) {
    fprintf(stderr, "rank %d: %s\n", rank, rtp_last_error());
    return code;
  };
  rtp_comm *comm = nullptr;
  if (rtp_comm_init(&cp, &comm)) return fail(30);
  gpt m{};
  rtp_graph *fwd;
  rtp_context *meta = gpt_forward(kRanksCfg, kRanksBatch, &m, &fwd);
  if (!meta) return fail(31);
  size_t bytes = gpt_arena_size(kRanksCfg, kRanksBatch) + (16 << 20);
  rtp_init_params ip = {bytes, nullptr, false, b, b ? bytes : 0};
  rtp_context *ctx = rtp_context_new(ip);
  rtp_parallel_params pp{};
  pp.strategy = strategy;
  pp.comm = comm;
  rtp_parallel *par = ctx ? rtp_parallel_new(ctx, fwd, m.loss, &pp) : nullptr;
  if (!par) return fail(32);
  rtp_graph *g = rtp_parallel_graph(par);
  if (rtp_graph_plan(ctx, g)) return fail(33);
  for (int i = 0; i < m.n_params; i++) {
    rtp_tensor *mine = rtp_parallel_tensor(par, m.params[i]);
    std::vector<float> full(rtp_tensor_nelements(m.params[i])),
        part(rtp_tensor_nelements(mine));
    gpt_init_tensor(&m, i, 42, full.data());
    if (rtp_parallel_shard_copy(par, m.params[i], full.data(), part.data()) ||
        rtp_tensor_set(mine, part.data(), 0, rtp_tensor_nbytes(mine)))
      return fail(34);
  }
  const int T = kRanksCfg.seq_len, V = kRanksCfg.vocab;
  std::vector<int32_t> idx(kRanksBatch * T), tgt(kRanksBatch * T);
  int seq = strategy == RTP_STRATEGY_TP ? 0 : rank;  // tp: every rank on the same batch
  for (int i = 0; i < kRanksBatch * T; i++) {
    idx[i] = (int32_t)((7 * i + 3 * seq + 1) % V);
    tgt[i] = (int32_t)((5 * i + seq) % V);
  }
  if (rtp_tensor_set(rtp_parallel_tensor(par, m.idx), idx.data(), 0, idx.size() * 4) ||
      rtp_tensor_set(rtp_parallel_tensor(par, m.targets), tgt.data(), 0, tgt.size() * 4))
    return fail(35);
  rtp_adamw_params hp = rtp_adamw_params_default();
  hp.lr = kRanksLr;
  hp.clip_norm = 0.5f;
  rtp_optimizer *opt = rtp_parallel_optimizer(par, hp);
  if (!opt) return fail(36);
  for (int s = 0; s < kRanksSteps; s++) {
    if (rtp_graph_compute(g, nullptr) || rtp_optimizer_step(opt, nullptr)) return fail(37);
    losses->push_back(rtptest::f32_at(rtp_parallel_tensor(par, m.loss), 0));
  }
  for (int i = 0; i < m.n_params; i++) {
    rtp_tensor *mine = rtp_parallel_tensor(par, m.params[i]);
    std::vector<float> v(rtp_tensor_nelements(mine));
    if (rtp_tensor_get(mine, v.data(), 0, rtp_tensor_nbytes(mine))) return fail(38);
    params->insert(params->end(), v.begin(), v.end());
  }
  rtp_context_free(ctx);
  rtp_context_free(meta);
  rtp_comm_free(comm);
  return 0;
}

}  // namespace rtptest
