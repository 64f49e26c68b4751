/* gpt.h - the reference GPT-2-style model (DESIGN.md section 6), built with rtp ops.
 * Shared by the examples, the tests and the benchmarks. */
#ifndef RTP_GPT_H
#define RTP_GPT_H

#include "rtp.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Deep enough for what a few machines' memory holds at the narrowest width we train
 * (bench/capacity found 64 blocks of d 768 fitting 4 ranks of 2 GiB). */
#define GPT_MAX_LAYERS 256
/* The largest vocab, seq_len and d_model: with at most GPT_MAX_LAYERS blocks the
 * parameter count stays below 2^52, so no size computed from them overflows. */
#define GPT_MAX_SIZE (1 << 20)

struct gpt_config {
  int vocab;   /* V: 256 byte tokens */
  int seq_len; /* T */
  int d_model; /* d */
  int n_layer;
  int n_head;
  /* GPT-2's tied embeddings: the head is wte itself (no lm_head), so the token embedding
   * gets the gradients of both of its uses, summed by backward */
  bool tie_embeddings;
  /* attention as one fused op (rtp_attention_causal: no T x T probabilities in memory)
   * instead of views, soft_max and mul_mat; the same model and values. The CPU only. */
  bool fused_attention;
};

struct gpt_config gpt_config_small(void);  /* T=128 d=384 L=6 H=6 */
struct gpt_config gpt_config_medium(void); /* T=256 d=768 L=12 H=12 */

/* One transformer block's parameters; shapes are nn.Linear's [out, in], so ne = {in, out}. */
struct gpt_block {
  struct rtp_tensor *ln_1_w, *ln_1_b;           /* {d} */
  struct rtp_tensor *c_attn_w, *c_attn_b;       /* {d, 3d}, {3d} */
  struct rtp_tensor *attn_proj_w, *attn_proj_b; /* {d, d}, {d} */
  struct rtp_tensor *ln_2_w, *ln_2_b;           /* {d} */
  struct rtp_tensor *c_fc_w, *c_fc_b;           /* {d, 4d}, {4d} */
  struct rtp_tensor *mlp_proj_w, *mlp_proj_b;   /* {4d, d}, {d} */
};

struct gpt {
  struct gpt_config cfg;
  int batch;              /* B sequences per step */
  struct rtp_tensor *wte; /* {d, V} */
  struct rtp_tensor *wpe; /* {d, T} */
  struct gpt_block blocks[GPT_MAX_LAYERS];
  struct rtp_tensor *ln_f_w, *ln_f_b;                 /* {d} */
  struct rtp_tensor *lm_head;                         /* {d, V}; wte when tied */
  struct rtp_tensor *idx;                             /* i32 {T, B}: input tokens */
  struct rtp_tensor *targets;                         /* i32 {T, B}: next tokens */
  struct rtp_tensor *logits;                          /* {V, T*B} */
  struct rtp_tensor *loss;                            /* scalar: mean cross-entropy */
  int n_params;                                       /* tensors */
  struct rtp_tensor *params[5 + 12 * GPT_MAX_LAYERS]; /* in creation order */
};

/* Checks the config: sizes 1..GPT_MAX_SIZE, 1..GPT_MAX_LAYERS blocks, heads dividing d.
 * 0 or RTP_EINVAL. */
int gpt_config_check(struct gpt_config cfg);
/* Parameter count of a config gpt_config_check accepts. */
int64_t gpt_n_params(struct gpt_config cfg);
/* Arena bytes that building, differentiating, planning and an optimizer need; SIZE_MAX
 * when that is past what 64 bits count (no machine holds it, so allocating it fails). */
size_t gpt_arena_size(struct gpt_config cfg, int batch);
/* Nodes of the one-device model's graph, forward to the loss (rtp_graph_new's size), with
 * room to spare; a config gpt_config_check accepts. */
int gpt_graph_size(struct gpt_config cfg);
/* What bf16 products (compute_type bf16) add to that: the scratch a product rounds its two
 * operands into, for the largest product (an MLP layer's, the head's backward with the
 * logits' gradient, or attention's with the scores), bounded by the sum of them all; once
 * for a training plan, once for an evaluation plan. */
double gpt_bf16_scratch_size(struct gpt_config cfg, int batch);
/* Creates the parameters and inputs in ctx and records the forward pass to the loss. */
int gpt_build(struct rtp_context *ctx, struct gpt *m, struct gpt_config cfg, int batch);
/* GPT-2 initialisation from seed: N(0, 0.02), residual projections N(0, 0.02/sqrt(2L)),
 * biases 0, LayerNorm weights 1. Every parameter has its own stream of (seed, index). */
void gpt_init_weights(struct gpt *m, uint64_t seed);
/* The initial values of the whole parameter m->params[i] into data (its element count):
 * what gpt_init_weights puts there, for models whose parameters have no memory of their
 * own (built with no_alloc and sharded by rtp_parallel_new). */
void gpt_init_tensor(const struct gpt *m, int i, uint64_t seed, float *data);
/* Decoding one token at a time with a cache of every earlier token's keys and values
 * (sampling): a token costs O(T d + d^2) instead of a forward over the whole window. Built
 * on a one-device model of batch 1 whose parameters hold data (gpt_build in an allocated
 * context). Per step: the token, its position p (< T), and the mask that lets it attend
 * to cache slots 0..p-1 and itself; after the step, gpt_decode_commit writes its keys and
 * values into slot p. */
struct gpt_decode {
  struct gpt_config cfg;
  struct rtp_tensor *tok, *pos; /* i32 {1} */
  struct rtp_tensor *mask;      /* f32 {T + 1}: per cache slot, then the token itself */
  struct rtp_tensor *k_cache[GPT_MAX_LAYERS], *v_cache[GPT_MAX_LAYERS]; /* {hd, T, H} */
  struct rtp_tensor *qkv[GPT_MAX_LAYERS]; /* {3d, 1}: the token's q, k, v (outputs) */
  struct rtp_tensor *logits;              /* {V, 1} */
};
int gpt_build_decode(struct rtp_context *ctx, struct gpt_decode *dec, const struct gpt *m);
/* Sets the inputs of the step for token tok at position p (0 <= p < T). */
int gpt_decode_inputs(struct gpt_decode *dec, int tok, int p);
/* After the step's compute: its keys and values into cache slot p. */
void gpt_decode_commit(struct gpt_decode *dec, int p);
/* Model FLOPs of one training step (forward + backward): 6 x params x tokens + attention. */
double gpt_step_flops(struct gpt_config cfg, int batch);

#ifdef __cplusplus
}
#endif

#endif
