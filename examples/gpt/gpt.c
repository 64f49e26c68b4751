/* gpt.c - the reference GPT-2-style model built from rtp ops. */
#include "gpt.h"

#include <math.h>
#include <stdio.h>
#include <stdarg.h>
#include <string.h>

/* The model reports through the library's channel, so callers read rtp_last_error(). */
static int rtp__gpt_error(const char *fmt, ...) {
  char msg[256];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  fprintf(stderr, "%s\n", msg);
  return RTP_EINVAL;
}

struct gpt_config gpt_config_small(void) {
  return (struct gpt_config){256, 128, 384, 6, 6, false, false};
}

struct gpt_config gpt_config_medium(void) {
  return (struct gpt_config){256, 256, 768, 12, 12, false, false};
}

int gpt_config_check(struct gpt_config c) {
  if (c.vocab <= 0 || c.seq_len <= 0 || c.d_model <= 0 || c.n_layer <= 0 || c.n_head <= 0)
    return RTP_EINVAL;
  if (c.vocab > GPT_MAX_SIZE || c.seq_len > GPT_MAX_SIZE || c.d_model > GPT_MAX_SIZE)
    return RTP_EINVAL;
  if (c.d_model % c.n_head) return RTP_EINVAL;
  if (c.n_layer > GPT_MAX_LAYERS) return RTP_EINVAL;
  return RTP_OK;
}

int64_t gpt_n_params(struct gpt_config c) {
  int64_t d = c.d_model, V = c.vocab, T = c.seq_len;
  int64_t block =
      2 * d + (3 * d * d + 3 * d) + (d * d + d) + 2 * d + (4 * d * d + 4 * d) + (4 * d * d + d);
  return V * d + T * d + c.n_layer * block + 2 * d + (c.tie_embeddings ? 0 : V * d);
}

size_t gpt_arena_size(struct gpt_config c, int batch) {
  /* In double: the activations of a large batch of long sequences overflow 64 bits before
   * the parameters do; below 2^53 bytes double counts them exactly. */
  double tokens = (double)c.seq_len * batch;
  double per_layer = tokens * (40.0 * c.d_model + 6.0 * c.n_head * c.seq_len);
  double logits = tokens * c.vocab * 4;
  /* The embeddings' gradients are whole tables whatever the batch: the lookup's and the
   * head's before they are summed (tied), and the positions'. A large vocabulary read by
   * few tokens does not fit in the activations' share. */
  double tables = 4.0 * (2.0 * c.vocab + c.seq_len) * c.d_model;
  double bytes = 4.0 * 4 * (double)gpt_n_params(c) * 5 / 4 + 4 * per_layer * c.n_layer +
                 4 * logits + tables + (64u << 20);
  return bytes < 0x1p63 ? (size_t)bytes : SIZE_MAX;
}

int gpt_graph_size(struct gpt_config c) {
  return 512 + 256 * c.n_layer;
}

double gpt_bf16_scratch_size(struct gpt_config c, int batch) {
  double d = c.d_model, tokens = (double)c.seq_len * batch;
  double floats =
      4 * d * d + c.vocab * d + tokens * (5 * d + c.vocab + (double)c.seq_len * c.n_head);
  return 2 * floats * sizeof(float);
}

double gpt_step_flops(struct gpt_config c, int batch) {
  double tokens = (double)c.seq_len * batch;
  /* Attention scores and their use: 2 GEMMs of T x T x d per layer, x3 for backward. */
  double attn = 6.0 * 2.0 * c.n_layer * (double)c.seq_len * c.d_model * tokens;
  return 6.0 * (double)gpt_n_params(c) * tokens + attn;
}

static struct rtp_tensor *param(struct rtp_context *ctx, struct gpt *m, int64_t ne0,
                                int64_t ne1, const char *fmt, int layer) {
  struct rtp_tensor *t = ne1 > 0 ? rtp_tensor_new_2d(ctx, RTP_TYPE_F32, ne0, ne1)
                                 : rtp_tensor_new_1d(ctx, RTP_TYPE_F32, ne0);
  if (!t) return NULL;
  rtp_tensor_set_param(t);
  if (ne1 <= 0) t->flags |= RTP_FLAG_NO_DECAY; /* biases and LayerNorm: no weight decay */
  rtp_tensor_set_name(t, fmt, layer);
  m->params[m->n_params++] = t;
  return t;
}

static struct rtp_tensor *linear(struct rtp_context *ctx, struct rtp_tensor *x,
                                 struct rtp_tensor *w, struct rtp_tensor *b) {
  struct rtp_tensor *y = rtp_mul_mat(ctx, w, x);
  return b ? rtp_add(ctx, y, b) : y;
}

/* Causal self-attention of x {d, T*B}: heads are views of the fused q, k, v projection. */
static struct rtp_tensor *attention(struct rtp_context *ctx, const struct gpt *m,
                                    const struct gpt_block *blk, struct rtp_tensor *x) {
  int64_t d = m->cfg.d_model, H = m->cfg.n_head, hd = d / H, T = m->cfg.seq_len, B = m->batch;
  struct rtp_tensor *qkv = linear(ctx, x, blk->c_attn_w, blk->c_attn_b); /* {3d, T*B} */
  if (m->cfg.fused_attention) {
    struct rtp_tensor *y = rtp_attention_causal(ctx, rtp_reshape_3d(ctx, qkv, 3 * d, T, B),
                                                (int)H, 1.0f / sqrtf((float)hd));
    return linear(ctx, rtp_reshape_2d(ctx, y, d, T * B), blk->attn_proj_w, blk->attn_proj_b);
  }
  size_t f = sizeof(float), nb[4] = {f, hd * f, 3 * d * f, 3 * d * T * f};
  int64_t ne[4] = {hd, H, T, B};
  struct rtp_tensor *heads[3];
  for (int i = 0; i < 3; i++) /* {hd, H, T, B} -> {hd, T, H, B} */
    heads[i] = rtp_permute(ctx, rtp_view(ctx, qkv, 4, ne, nb, (size_t)i * d * f), 0, 2, 1, 3);
  struct rtp_tensor *scores = rtp_mul_mat(ctx, heads[1], heads[0]); /* {T, T, H, B} */
  struct rtp_tensor *att = rtp_soft_max(ctx, scores, 1.0f / sqrtf((float)hd), true);
  struct rtp_tensor *out = rtp_mul_mat(ctx, rtp_transpose(ctx, heads[2]), att); /* {hd,T,H,B} */
  out = rtp_cont(ctx, rtp_permute(ctx, out, 0, 2, 1, 3));                       /* {hd,H,T,B} */
  return linear(ctx, rtp_reshape_2d(ctx, out, d, T * B), blk->attn_proj_w, blk->attn_proj_b);
}

static struct rtp_tensor *mlp(struct rtp_context *ctx, const struct gpt_block *blk,
                              struct rtp_tensor *x) {
  struct rtp_tensor *h = rtp_gelu(ctx, linear(ctx, x, blk->c_fc_w, blk->c_fc_b));
  return linear(ctx, h, blk->mlp_proj_w, blk->mlp_proj_b);
}

/* For the tp strategy (Megatron): q, k and v (three groups of c_attn's rows) and c_fc
 * are split by output rows, the projections after them by input columns, so attention
 * runs on each rank's heads and the MLP on its hidden units. Ignored by the others. */
static void mark_tp(const struct gpt_block *b) {
  if (!b->c_attn_w || !b->c_attn_b || !b->c_fc_w || !b->c_fc_b || !b->attn_proj_w ||
      !b->mlp_proj_w)
    return; /* the context is full: gpt_build reports it */
  rtp_tensor_set_tp(b->c_attn_w, RTP_TP_COLUMN, 3);
  rtp_tensor_set_tp(b->c_attn_b, RTP_TP_COLUMN, 3);
  rtp_tensor_set_tp(b->c_fc_w, RTP_TP_COLUMN, 1);
  rtp_tensor_set_tp(b->c_fc_b, RTP_TP_COLUMN, 1);
  rtp_tensor_set_tp(b->attn_proj_w, RTP_TP_ROW, 1);
  rtp_tensor_set_tp(b->mlp_proj_w, RTP_TP_ROW, 1);
}

static void make_params(struct rtp_context *ctx, struct gpt *m) {
  int64_t d = m->cfg.d_model;
  m->wte = param(ctx, m, d, m->cfg.vocab, "transformer.wte.weight", 0);
  m->wpe = param(ctx, m, d, m->cfg.seq_len, "transformer.wpe.weight", 0);
  for (int l = 0; l < m->cfg.n_layer; l++) {
    struct gpt_block *b = &m->blocks[l];
    int first = m->n_params;
    b->ln_1_w = param(ctx, m, d, 0, "transformer.h.%d.ln_1.weight", l);
    b->ln_1_b = param(ctx, m, d, 0, "transformer.h.%d.ln_1.bias", l);
    b->c_attn_w = param(ctx, m, d, 3 * d, "transformer.h.%d.attn.c_attn.weight", l);
    b->c_attn_b = param(ctx, m, 3 * d, 0, "transformer.h.%d.attn.c_attn.bias", l);
    b->attn_proj_w = param(ctx, m, d, d, "transformer.h.%d.attn.c_proj.weight", l);
    b->attn_proj_b = param(ctx, m, d, 0, "transformer.h.%d.attn.c_proj.bias", l);
    b->ln_2_w = param(ctx, m, d, 0, "transformer.h.%d.ln_2.weight", l);
    b->ln_2_b = param(ctx, m, d, 0, "transformer.h.%d.ln_2.bias", l);
    b->c_fc_w = param(ctx, m, d, 4 * d, "transformer.h.%d.mlp.c_fc.weight", l);
    b->c_fc_b = param(ctx, m, 4 * d, 0, "transformer.h.%d.mlp.c_fc.bias", l);
    b->mlp_proj_w = param(ctx, m, 4 * d, d, "transformer.h.%d.mlp.c_proj.weight", l);
    b->mlp_proj_b = param(ctx, m, d, 0, "transformer.h.%d.mlp.c_proj.bias", l);
    mark_tp(b);
    for (int i = first; i < m->n_params; i++) /* fsdp gathers a block at a time */
      rtp_tensor_set_fsdp_unit(m->params[i], l + 1);
  }
  m->ln_f_w = param(ctx, m, d, 0, "transformer.ln_f.weight", 0);
  m->ln_f_b = param(ctx, m, d, 0, "transformer.ln_f.bias", 0);
  /* Tied, the head reads wte: one parameter, so every strategy shards, rotates or gathers
   * it as any other, and autodiff sums the gradients of its two uses into one. */
  m->lm_head =
      m->cfg.tie_embeddings ? m->wte : param(ctx, m, d, m->cfg.vocab, "lm_head.weight", 0);
}

int gpt_build(struct rtp_context *ctx, struct gpt *m, struct gpt_config cfg, int batch) {
  if (gpt_config_check(cfg) || batch <= 0)
    return rtp__gpt_error(
        "gpt_build: bad config (sizes 1..%d, n_head must divide d_model, 1..%d layers, "
        "batch > 0)",
        GPT_MAX_SIZE, GPT_MAX_LAYERS);
  memset(m, 0, sizeof(*m));
  m->cfg = cfg;
  m->batch = batch;
  int64_t d = cfg.d_model, T = cfg.seq_len;
  make_params(ctx, m);
  m->idx = rtp_tensor_set_name(rtp_tensor_new_2d(ctx, RTP_TYPE_I32, T, batch), "input.idx");
  m->targets =
      rtp_tensor_set_name(rtp_tensor_new_2d(ctx, RTP_TYPE_I32, T, batch), "input.targets");
  rtp_tensor_set_input(m->idx);
  rtp_tensor_set_input(m->targets);

  struct rtp_tensor *x = rtp_get_rows(ctx, m->wte, m->idx); /* {d, T, B} */
  x = rtp_add(ctx, x, m->wpe);
  for (int l = 0; l < cfg.n_layer; l++) {
    const struct gpt_block *blk = &m->blocks[l];
    struct rtp_tensor *h = rtp_layer_norm(ctx, x, blk->ln_1_w, blk->ln_1_b, 1e-5f);
    h = attention(ctx, m, blk, rtp_reshape_2d(ctx, h, d, T * batch));
    x = rtp_add(ctx, x, rtp_reshape_3d(ctx, h, d, T, batch));
    h = rtp_layer_norm(ctx, x, blk->ln_2_w, blk->ln_2_b, 1e-5f);
    h = mlp(ctx, blk, rtp_reshape_2d(ctx, h, d, T * batch));
    x = rtp_add(ctx, x, rtp_reshape_3d(ctx, h, d, T, batch));
  }
  x = rtp_layer_norm(ctx, x, m->ln_f_w, m->ln_f_b, 1e-5f);
  m->logits = linear(ctx, rtp_reshape_2d(ctx, x, d, T * batch), m->lm_head, NULL);
  rtp_tensor_set_output(rtp_tensor_set_name(m->logits, "logits"));
  m->loss = rtp_tensor_set_name(rtp_cross_entropy(ctx, m->logits, m->targets), "loss");
  return rtp_context_error(ctx, NULL);
}

/* splitmix64 and Box-Muller: the same weights on every platform for a seed. */
static uint64_t next_u64(uint64_t *s) {
  uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

static float normal(uint64_t *s) {
  double u1 = ((double)(next_u64(s) >> 11) + 0.5) / 9007199254740992.0;
  double u2 = (double)(next_u64(s) >> 11) / 9007199254740992.0;
  return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

/* Parameter i's values from its own stream, so that a rank can initialise any parameter
 * alone (each fills a full buffer and keeps its block) and every world size, and every
 * order of initialisation, gives the same model. */
void gpt_init_tensor(const struct gpt *m, int i, uint64_t seed, float *data) {
  const char *n = m->params[i]->name;
  size_t len = strlen(n);
  bool bias = len > 5 && strcmp(n + len - 5, ".bias") == 0;
  bool ln = strstr(n, "ln_") != NULL;
  float resid = 0.02f / sqrtf(2.0f * (float)m->cfg.n_layer);
  float std = bias || ln ? 0.0f : strstr(n, "c_proj") ? resid : 0.02f;
  float constant = ln && !bias ? 1.0f : 0.0f;
  uint64_t key = (uint64_t)i, s = seed ^ next_u64(&key);
  for (int64_t j = 0; j < rtp_tensor_nelements(m->params[i]); j++)
    data[j] = std > 0 ? std * normal(&s) : constant;
}

void gpt_init_weights(struct gpt *m, uint64_t seed) {
  for (int i = 0; i < m->n_params; i++) gpt_init_tensor(m, i, seed, m->params[i]->data);
}

/* ---- decoding with a KV cache ------------------------------------------------------ */

/* Attention of one token (x {d, 1}) over the cached keys and values and its own. */
static struct rtp_tensor *decode_attention(struct rtp_context *ctx, struct gpt_decode *dec,
                                           const struct gpt_block *blk, int l,
                                           struct rtp_tensor *x) {
  int64_t d = dec->cfg.d_model, H = dec->cfg.n_head, hd = d / H;
  struct rtp_tensor *qkv = linear(ctx, x, blk->c_attn_w, blk->c_attn_b); /* {3d, 1} */
  dec->qkv[l] = qkv;
  size_t f = sizeof(float), nb[4] = {f, 3 * d * f, hd * f, 3 * d * H * f};
  int64_t ne[4] = {hd, 1, H, 1};
  struct rtp_tensor *heads[3];
  for (int i = 0; i < 3; i++) /* {hd, 1, H}: head h at hd * h */
    heads[i] = rtp_cont(ctx, rtp_view(ctx, qkv, 4, ne, nb, (size_t)i * d * f));
  struct rtp_tensor *k = rtp_concat(ctx, dec->k_cache[l], heads[1], 1); /* {hd, T+1, H} */
  struct rtp_tensor *v = rtp_concat(ctx, dec->v_cache[l], heads[2], 1);
  struct rtp_tensor *scores = rtp_add(ctx, rtp_mul_mat(ctx, k, heads[0]), dec->mask);
  struct rtp_tensor *att = rtp_soft_max(ctx, scores, 1.0f / sqrtf((float)hd), false);
  struct rtp_tensor *out = rtp_mul_mat(ctx, rtp_cont(ctx, rtp_transpose(ctx, v)), att);
  return linear(ctx, rtp_reshape_2d(ctx, out, d, 1), blk->attn_proj_w, blk->attn_proj_b);
}

int gpt_build_decode(struct rtp_context *ctx, struct gpt_decode *dec, const struct gpt *m) {
  memset(dec, 0, sizeof(*dec));
  struct gpt_config c = m->cfg;
  dec->cfg = c;
  int64_t d = c.d_model, H = c.n_head, hd = d / H, T = c.seq_len;
  dec->tok = rtp_tensor_new_1d(ctx, RTP_TYPE_I32, 1);
  dec->pos = rtp_tensor_new_1d(ctx, RTP_TYPE_I32, 1);
  dec->mask = rtp_tensor_new_1d(ctx, RTP_TYPE_F32, T + 1);
  for (int l = 0; l < c.n_layer; l++) {
    dec->k_cache[l] = rtp_tensor_new_3d(ctx, RTP_TYPE_F32, hd, T, H);
    dec->v_cache[l] = rtp_tensor_new_3d(ctx, RTP_TYPE_F32, hd, T, H);
  }
  if (rtp_context_error(ctx, NULL)) return rtp_context_error(ctx, NULL);
  rtp_tensor_set_input(dec->tok);
  rtp_tensor_set_input(dec->pos);
  rtp_tensor_set_input(dec->mask);
  for (int l = 0; l < c.n_layer; l++) { /* zeros: what a slot holds before its token */
    rtp_tensor_set_input(dec->k_cache[l]);
    rtp_tensor_set_input(dec->v_cache[l]);
    memset(dec->k_cache[l]->data, 0, rtp_tensor_nbytes(dec->k_cache[l]));
    memset(dec->v_cache[l]->data, 0, rtp_tensor_nbytes(dec->v_cache[l]));
  }
  struct rtp_tensor *x =
      rtp_add(ctx, rtp_get_rows(ctx, m->wte, dec->tok), rtp_get_rows(ctx, m->wpe, dec->pos));
  for (int l = 0; l < c.n_layer; l++) {
    const struct gpt_block *blk = &m->blocks[l];
    struct rtp_tensor *h = rtp_layer_norm(ctx, x, blk->ln_1_w, blk->ln_1_b, 1e-5f);
    x = rtp_add(ctx, x, decode_attention(ctx, dec, blk, l, h));
    h = rtp_layer_norm(ctx, x, blk->ln_2_w, blk->ln_2_b, 1e-5f);
    x = rtp_add(ctx, x, mlp(ctx, blk, h));
    if (dec->qkv[l]) rtp_tensor_set_output(dec->qkv[l]); /* read by gpt_decode_commit */
  }
  x = rtp_layer_norm(ctx, x, m->ln_f_w, m->ln_f_b, 1e-5f);
  dec->logits = linear(ctx, x, m->lm_head, NULL);
  int rc = rtp_context_error(ctx, NULL);
  if (!rc) rtp_tensor_set_output(dec->logits);
  return rc;
}

int gpt_decode_inputs(struct gpt_decode *dec, int tok, int p) {
  int T = dec->cfg.seq_len;
  if (p < 0 || p >= T || tok < 0 || tok >= dec->cfg.vocab)
    return rtp__gpt_error("gpt_decode_inputs: token %d at position %d (vocab %d, T %d)", tok, p,
                          dec->cfg.vocab, T);
  ((int32_t *)dec->tok->data)[0] = tok;
  ((int32_t *)dec->pos->data)[0] = p;
  float *mask = dec->mask->data;
  for (int j = 0; j <= T; j++) mask[j] = j < p || j == T ? 0.0f : -1e30f;
  return 0;
}

void gpt_decode_commit(struct gpt_decode *dec, int p) {
  int64_t d = dec->cfg.d_model, H = dec->cfg.n_head, hd = d / H, T = dec->cfg.seq_len;
  for (int l = 0; l < dec->cfg.n_layer; l++) {
    const float *qkv = dec->qkv[l]->data;
    float *k = dec->k_cache[l]->data, *v = dec->v_cache[l]->data;
    for (int64_t h = 0; h < H; h++) { /* slot p of head h: {hd, T, H} */
      memcpy(k + (h * T + p) * hd, qkv + d + h * hd, (size_t)hd * sizeof(float));
      memcpy(v + (h * T + p) * hd, qkv + 2 * d + h * hd, (size_t)hd * sizeof(float));
    }
  }
}
