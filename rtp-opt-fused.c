/* rtp-opt-fused.c - the optimizer in backward (rtp_parallel_params.optimizer_in_backward):
 * each parameter's AdamW update is an ADAMW node placed right after the last node that
 * needs the parameter or its gradient, so the gradient is planned memory that dies there
 * and no rank keeps a whole step's gradients. docs/parallel.md, "The optimizer in
 * backward". */
#include "rtp-opt.h"

#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "rtp-impl.h"

/* The node that waits for transfer i (the first to read its result, through forwarded
 * hops), or -1 when only the end of the compute does. */
static int waiter_of(const struct rtp_graph *g, int i) {
  for (int j = i + 1; j < g->n_nodes; j++)
    for (int s = 0; s < RTP_MAX_SRC; s++) {
      if (rtp__waited_transfer(g->nodes[j], s) != g->nodes[i]) continue;
      return g->nodes[j]->op == RTP_OP_COMM ? waiter_of(g, j) : j;
    }
  return -1;
}

/* The index after which parameter p may change: past its gradient's node and every node
 * that reads p, a transfer past the node that waits for it; -1 where a transfer of it is
 * never waited for. */
static int last_need(const struct rtp_graph *g, const struct rtp_tensor *p,
                     const struct rtp_tensor *grad) {
  int last = 0;
  for (int i = 0; i < g->n_nodes; i++) {
    const struct rtp_tensor *t = g->nodes[i];
    bool reads = t == rtp__base_of(grad);
    for (int s = 0; s < RTP_MAX_SRC && !reads; s++)
      reads = rtp__src_read(t, s) && rtp__base_of(t->src[s]) == p;
    if (!reads) continue;
    int at = t->op == RTP_OP_COMM ? waiter_of(g, i) : i;
    if (at < 0) return -1;
    if (at > last) last = at;
  }
  return last;
}

/* Parameter k's update: reads its gradient and Adam states, writes them and the weights
 * in place (the node is a view of the parameter, so it takes no memory). */
static struct rtp_tensor *adamw_node(struct rtp_context *ctx, struct rtp_optimizer *opt,
                                     int k) {
  struct rtp_tensor *p = opt->params[k];
  struct rtp_tensor *t = rtp__op3(ctx, RTP_OP_ADAMW, p->ne, p->grad, opt->m[k], opt->v[k]);
  if (!t) return NULL;
  t->view_src = p;
  memcpy(&t->op_params[0], &opt, sizeof(opt));
  t->op_params[2] = k;
  rtp_tensor_set_name(t, "adamw.%.57s", p->name);
  return t;
}

/* Puts each update in g right after where its parameter was last needed. */
static int place_updates(struct rtp_context *ctx, struct rtp_graph *g,
                         struct rtp_optimizer *opt, int n_before) {
  int n = g->n_nodes, *after = malloc(sizeof(int) * (size_t)(opt->n + 1));
  struct rtp_tensor **nodes = malloc(sizeof(*nodes) * (size_t)(n + 1));
  int rc = after && nodes ? RTP_OK : rtp__ctx_error(ctx, RTP_ENOMEM, "out of memory");
  struct rtp_graph before = *g;
  before.n_nodes = n_before;
  for (int k = 0; k < opt->n && !rc; k++)
    if ((after[k] = last_need(&before, opt->params[k], opt->params[k]->grad)) < 0)
      rc = rtp__ctx_error(ctx, RTP_ENOSYS,
                          "optimizer in backward: a transfer of '%s' is never waited for",
                          opt->params[k]->name);
  for (int i = 0, o = 0; i < n_before && !rc; i++) {
    nodes[o++] = g->nodes[i];
    for (int j = n_before; j < n; j++)
      if (after[g->nodes[j]->op_params[2]] == i) nodes[o++] = g->nodes[j];
  }
  if (!rc) memcpy(g->nodes, nodes, sizeof(*nodes) * (size_t)n);
  free(nodes);
  free(after);
  return rc;
}

struct rtp_optimizer *rtp__optimizer_in_backward(struct rtp_context *ctx, struct rtp_graph *g) {
  /* a device without the kernel refuses the graph when it is planned */
  const char *what = "optimizer in backward";
  struct rtp_optimizer *opt = rtp__optimizer_alloc(ctx, g, rtp_adamw_params_default(), what);
  if (!opt) return NULL;
  opt->in_backward = true;
  int n_before = g->n_nodes;
  for (int k = 0; k < opt->n; k++)
    if (rtp_graph_build(g, adamw_node(ctx, opt, k))) return NULL;
  if (g->n_nodes != n_before + opt->n) {
    rtp__ctx_error(ctx, RTP_EINVAL, "%s: the updates read nodes outside the graph", what);
    return NULL;
  }
  if (place_updates(ctx, g, opt, n_before) || rtp__optimizer_factors(opt, what)) return NULL;
  return opt;
}

/* Every thread sums the squares of its share; if the whole is finite, every thread updates
 * its share; else nothing changes and the sum (NaN) tells rtp_optimizer_step. */
void rtp__k_adamw(const struct rtp_compute_params *p, struct rtp_tensor *t) {
  struct rtp_optimizer *opt;
  memcpy(&opt, &t->op_params[0], sizeof(opt));
  int k = t->op_params[2];
  float *g = t->src[0]->data;
  int64_t n = rtp_tensor_nelements(t), i0 = n * p->ith / p->nth, i1 = n * (p->ith + 1) / p->nth;
  double *part = p->work, s = 0;
  for (int64_t i = i0; i < i1; i++) s += (double)g[i] * g[i];
  part[p->ith] = s;
  rtp__barrier(p);
  double total = 0;
  for (int i = 0; i < p->nth; i++) total += part[i];
  if (p->ith == 0) opt->sumsq[k] = isfinite(total) ? total : NAN;
  if (!isfinite(total)) return;
  struct rtp_adam_args a = rtp__optimizer_args(opt, k, g);
  rtp__adam_update(&a, i0, i1);
}

int rtp__optimizer_close_step(struct rtp_optimizer *opt) {
  double s = 0;
  int bad = -1;
  for (int k = 0; k < opt->n; k++) {
    if (isnan(opt->sumsq[k]) && bad < 0) bad = k;
    s += opt->norm_w[k] * opt->sumsq[k];
  }
  int rc = rtp__optimizer_norm(opt, s);
  if (rc) return rc;
  if (bad >= 0)
    return rtp__error(RTP_EINVAL,
                      "rtp_optimizer_step: step %" PRId64
                      ": the gradients of '%s' are not finite (NaN or infinity); its weights "
                      "were not changed, but those updated before it in backward were "
                      "(optimizer in backward): resume from a checkpoint",
                      opt->t + 1, opt->params[bad]->name);
  if (!isfinite(opt->norm))
    return rtp__error(RTP_EINVAL,
                      "rtp_optimizer_step: step %" PRId64
                      ": the gradient norm is %g: another rank's gradients are not finite "
                      "(optimizer in backward: its weights were updated in part)",
                      opt->t + 1, (double)opt->norm);
  opt->t++;
  return rtp__optimizer_factors(opt, "rtp_optimizer_step");
}
