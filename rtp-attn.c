/* rtp-attn.c - fused causal attention's builders: the op (rtp_attention_causal) and the
 * nodes of its backward. The kernels are in rtp-cpu-attn.c; docs/attention.md. */
#include "rtp-backend.h"

/* op_params of the three nodes: scale (f32 word 0) and the number of heads (word 1). */
static void set_params(struct rtp_tensor *t, float scale, int n_head) {
  rtp__set_param_f32(t, 0, scale);
  t->op_params[1] = n_head;
}

struct rtp_tensor *rtp_attention_causal(struct rtp_context *ctx, struct rtp_tensor *qkv,
                                        int n_head, float scale) {
  if (!rtp__inputs_ok(ctx, "attention", qkv, NULL, false)) return NULL;
  struct rtp_backend *be = rtp__ctx_backend(ctx);
  if (be && be->i->has_kernel && !be->i->has_kernel(be, RTP_OP_ATTENTION)) {
    rtp__ctx_error(ctx, RTP_ENOSYS,
                   "attention: the fused attention op has no kernel on the %s backend (build "
                   "it from soft_max and mul_mat there)",
                   rtp_backend_name(be));
    return NULL;
  }
  if (qkv->type != RTP_TYPE_F32 || !rtp__rows_contiguous(qkv))
    return rtp__op_error(ctx, "attention", RTP_ESHAPE, qkv, NULL,
                         "qkv must be f32 with packed rows");
  if (n_head < 1 || qkv->ne[0] % (3 * (int64_t)n_head) || qkv->ne[3] != 1)
    return rtp__op_error(ctx, "attention", RTP_ESHAPE, qkv, NULL,
                         "qkv must be {3 n_head hd, T, B}");
  int64_t d = qkv->ne[0] / 3, T = qkv->ne[1], B = qkv->ne[2];
  /* Each row's log-sum-exp (and later its dO . O): what backward needs of forward. */
  int64_t ne_stats[4] = {T, n_head, B, 2}, ne[4] = {d, T, B, 1};
  struct rtp_tensor *stats =
      rtp__new_node(ctx, RTP_OP_EMPTY, RTP_TYPE_F32, ne_stats, NULL, NULL);
  struct rtp_tensor *t =
      stats ? rtp__new_node(ctx, RTP_OP_ATTENTION, RTP_TYPE_F32, ne, qkv, stats) : NULL;
  if (!t) return NULL;
  rtp_tensor_set_name(stats, "attention.stats");
  set_params(t, scale, n_head);
  return t;
}

/* d qkv of attention node t given dy: rows' dO . O (attention_delta, written into the
 * second half of t's statistics, beside the log-sum-exp), then attention_back, which
 * reads both halves through it. */
struct rtp_tensor *rtp__attention_back(struct rtp_context *ctx, struct rtp_tensor *t,
                                       struct rtp_tensor *dy) {
  struct rtp_tensor *qkv = t->src[0], *stats = t->src[1];
  struct rtp_tensor *g = rtp_cont(ctx, dy);
  if (!g) return NULL;
  int n_head = t->op_params[1];
  int64_t ne[4] = {stats->ne[0], stats->ne[1], stats->ne[2], 1};
  struct rtp_tensor *delta = rtp__new_node(ctx, RTP_OP_ATTENTION_DELTA, RTP_TYPE_F32, ne, g, t);
  if (!delta) return NULL;
  delta->src[2] = stats; /* placed after it, and keeps it alive */
  delta->view_src = stats;
  delta->view_offs = rtp_tensor_nbytes(stats) / 2;
  set_params(delta, rtp__get_param_f32(t, 0), n_head);
  struct rtp_tensor *dqkv =
      rtp__new_node(ctx, RTP_OP_ATTENTION_BACK, RTP_TYPE_F32, qkv->ne, g, qkv);
  if (!dqkv) return NULL;
  dqkv->src[2] = delta;
  set_params(dqkv, rtp__get_param_f32(t, 0), n_head);
  return dqkv;
}
