/* The reference GPT from the installed rtp-gpt: a tiny model, built and initialised as
 * train-gpt does, whose first loss on random tokens is about ln 256 (its logits start
 * near 0, so every byte is about as likely). */
#include <math.h>
#include <stdio.h>

#include "gpt.h"

int main(void) {
  struct gpt_config cfg = {
      .vocab = 256, .seq_len = 8, .d_model = 16, .n_layer = 2, .n_head = 2};
  int batch = 2;
  struct rtp_context *ctx = rtp_context_new(
      (struct rtp_init_params){.mem_size = gpt_arena_size(cfg, batch), .no_alloc = false});
  struct gpt m;
  if (!ctx || gpt_config_check(cfg) || gpt_build(ctx, &m, cfg, batch)) {
    fprintf(stderr, "consumer-gpt: %s\n", rtp_last_error());
    return 1;
  }
  gpt_init_weights(&m, 1);
  int32_t tok[8 * 2];
  for (int i = 0; i < 8 * 2; i++) tok[i] = (i * 37 + 11) % 256;
  struct rtp_graph *g = rtp_graph_new(ctx, 4096);
  float loss;
  if (rtp_tensor_set(m.idx, tok, 0, sizeof(tok)) ||
      rtp_tensor_set(m.targets, tok, 0, sizeof(tok)) || !g || rtp_graph_build(g, m.loss) ||
      rtp_graph_plan(ctx, g) || rtp_graph_compute(g, NULL) ||
      rtp_tensor_get_f32(m.loss, 0, &loss)) {
    fprintf(stderr, "consumer-gpt: %s\n", rtp_last_error());
    return 1;
  }
  printf("gpt: %lld parameters, loss %.4f\n", (long long)gpt_n_params(cfg), loss);
  rtp_context_free(ctx);
  return fabsf(loss - logf(256)) < 0.1f ? 0 : 1;
}
