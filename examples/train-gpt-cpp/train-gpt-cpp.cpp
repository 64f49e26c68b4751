// train-gpt-cpp.cpp - the tiny GPT trained for a few steps through the C++ wrapper.
//
// rtp.hpp owns the handles and turns every failure into an rtp::error carrying the
// library's message; the model itself is the C reference model (gpt.h), unchanged.
//
//     train-gpt-cpp [STEPS] [OUT.safetensors]
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "gpt.h"
#include "rtp.hpp"

namespace {

// Windows of a short repeated text: next-byte prediction a tiny model learns quickly.
void fill_batch(const std::string &text, unsigned step, gpt &m) {
  int T = m.cfg.seq_len;
  auto *idx = static_cast<int32_t *>(m.idx->data);
  auto *tgt = static_cast<int32_t *>(m.targets->data);
  for (int b = 0; b < m.batch; b++) {
    size_t start = (step * 7919u + b * 104729u) % (text.size() - T - 1);
    for (int t = 0; t < T; t++) {
      idx[b * T + t] = static_cast<uint8_t>(text[start + t]);
      tgt[b * T + t] = static_cast<uint8_t>(text[start + t + 1]);
    }
  }
}

void train(int steps, const char *out) {
  const gpt_config cfg = {256, 32, 64, 2, 4, false, false};
  const int batch = 4;
  rtp::context ctx(gpt_arena_size(cfg, batch));
  gpt m{};
  rtp::check(gpt_build(ctx, &m, cfg, batch));
  gpt_init_weights(&m, 1234);

  rtp::graph g(ctx, 2048);
  g.build(m.loss).backward(m.loss).plan();
  rtp_adamw_params hp = rtp_adamw_params_default();
  hp.lr = 3e-3f;
  rtp::optimizer opt(ctx, g, hp);
  rtp::threadpool tp(2);

  std::string text;
  for (int i = 0; i < 20; i++) text += "rotated tensor parallelism passes the shards around. ";
  for (int step = 0; step < steps; step++) {
    fill_batch(text, step, m);
    g.compute(tp);
    opt.step(tp);
    if (step % 10 == 0 || step == steps - 1)
      std::printf("step %3d  loss %.4f\n", step + 1, rtp::get_f32(m.loss, 0));
  }
  rtp::safetensors::save(out, {m.params, m.params + m.n_params}, {"format", "pt"});
  std::printf("saved %s\n", out);
}

}  // namespace

int main(int argc, char **argv) {
  int steps = argc > 1 ? std::atoi(argv[1]) : 40;
  const char *out = argc > 2 ? argv[2] : "tiny-gpt.safetensors";
  if (steps <= 0) {
    std::fprintf(stderr, "usage: train-gpt-cpp [STEPS > 0] [OUT.safetensors]\n");
    return 2;
  }
  try {
    train(steps, out);
  } catch (const rtp::error &e) {
    std::fprintf(stderr, "train-gpt-cpp: %s (%s)\n", e.what(), rtp_strerror(e.status()));
    return 1;
  }
  return 0;
}
