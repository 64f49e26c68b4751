/* rtp-ddp.c - the ddp strategy: every rank holds every parameter and trains on its own
 * batch; the gradients are summed over the ranks by all-reduces of buckets of adjacent
 * gradients, each posted as soon as backward has computed its last gradient, so the
 * reductions run during the rest of backward. docs/parallel.md, "ddp". */
#include "rtp-strategy.h"

#include <stdlib.h>

/* One all-reduce over the gradients [i, j) of grads (in memory, lo to hi), posted right
 * after the last of them is computed; with accumulate, in the sync graph instead, run once
 * the step's computes have all added theirs. */
static int ddp_bucket(struct rtp_parallel *p, struct rtp_tensor **grads, int i, int j, char *lo,
                      char *hi) {
  struct rtp_graph *g = p->graph;
  /* The bucket spans the gradients and the padding between them. */
  struct rtp_tensor *span = rtp_tensor_new_1d(p->ctx, RTP_TYPE_F32, 0);
  if (!span) return rtp_context_error(p->ctx, NULL);
  span->ne[0] = (hi - lo) / (int64_t)sizeof(float);
  for (int d = 1; d < 4; d++) span->nb[d] = span->nb[0] * (size_t)span->ne[0];
  span->data = lo;
  rtp_tensor_set_name(span, "ddp.bucket.%d", i);
  if (p->accumulate > 1) {
    struct rtp_tensor *ar = rtp_allreduce(p->ctx, p->comm, span, NULL);
    return ar && !rtp_graph_build(p->sync, ar) ? RTP_OK : rtp_context_error(p->ctx, NULL);
  }
  struct rtp_tensor *ar = rtp_allreduce(p->ctx, p->comm, span, grads[j - 1]);
  if (!ar || rtp_graph_build(g, ar)) return rtp_context_error(p->ctx, NULL);
  int at = 0;
  for (int k = 0; k < g->n_nodes; k++)
    if (g->nodes[k] == grads[j - 1]) at = k;
  rtp__graph_move_after(g, at, ar);
  return RTP_OK;
}

/* Nodes by their place in the graph (kept in extra while the pass runs). */
static int by_place(const void *a, const void *b) {
  intptr_t x = (intptr_t)(*(struct rtp_tensor *const *)a)->extra;
  intptr_t y = (intptr_t)(*(struct rtp_tensor *const *)b)->extra;
  return (x > y) - (x < y);
}

/*
 * The gradients of consecutive parameters that are adjacent in memory form buckets of
 * about bucket_bytes, in the order backward computes them: with micro-batches, the order
 * in which the last one's adds complete them, each bucket reduced once.
 */
static int ddp_finish(struct rtp_parallel *p) {
  struct rtp_graph *g = p->graph;
  struct rtp_tensor **grads = malloc(sizeof(*grads) * (size_t)(g->n_leafs + 1));
  if (!grads) return rtp__ctx_error(p->ctx, RTP_ENOMEM, "ddp: out of memory for buckets");
  int n_params = 0, rc = RTP_OK;
  if (p->accumulate > 1 && !(p->sync = rtp_graph_new(p->ctx, 2 * g->n_leafs + 2))) {
    free(grads);
    return rtp_context_error(p->ctx, NULL);
  }
  for (int i = 0; i < g->n_leafs; i++) /* their last writers: what each bucket follows */
    if ((g->leafs[i]->flags & RTP_FLAG_PARAM) && g->leafs[i]->grad)
      grads[n_params++] = g->leafs[i]->grad;
  for (int i = 0; i < g->n_nodes; i++) g->nodes[i]->extra = (void *)(intptr_t)i;
  qsort(grads, (size_t)n_params, sizeof(*grads), by_place);
  for (int i = 0; i < g->n_nodes; i++) g->nodes[i]->extra = NULL;
  for (int i = 0, j; i < n_params && !rc; i = j) {
    char *lo = grads[i]->data, *hi = lo + rtp_tensor_nbytes(grads[i]);
    for (j = i + 1; j < n_params && (size_t)(hi - lo) < p->bucket_bytes; j++) {
      char *d = grads[j]->data;
      if (d + rtp_tensor_nbytes(grads[j]) + RTP_ALIGN < lo || d > hi + RTP_ALIGN) break;
      if (d < lo) lo = d;
      if (d + rtp_tensor_nbytes(grads[j]) > hi) hi = d + rtp_tensor_nbytes(grads[j]);
    }
    rc = ddp_bucket(p, grads, i, j, lo, hi);
  }
  free(grads);
  return rc;
}

const struct rtp_strategy_i rtp__strategy_ddp = {
    .name = "ddp",
    .finish = ddp_finish,
};
