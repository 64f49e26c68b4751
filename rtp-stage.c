/*
 * rtp-stage.c - one pipeline stage's graph, a micro-batch and a segment at a time.
 *
 * A segment is what one block adds (with the embeddings a segment of their own, and the
 * head in the last block's). Where a segment reads a tensor of an earlier segment, or one
 * received from an earlier stage, it reads it through a placeholder: a view that stops
 * gradients (RTP__FLAG_GRAD_STOP). So each segment's backward can be built by itself,
 * seeded with the gradients its later readers left on their placeholders, the gradients
 * a later stage sent back, or the loss (rtp__graph_build_backward_seeded), and the
 * schedule can order segments and micro-batches as it likes: ZeroPP runs a unit's
 * micro-batches through one segment before the next, so a stage gathers each block once
 * per unit. With recompute, a segment's forward is built again just before its backward,
 * from its placeholders, and the backward reads that copy: the first forward's
 * activations die as soon as the next segment has read its inputs.
 */
#include "rtp-strategy.h"

#include <stdlib.h>
#include <string.h>

static size_t rows(const struct rtp_parallel *p) {
  return (size_t)(p->src->n_nodes + p->src->n_leafs);
}

static struct rtp_tensor **map_of(struct rtp_parallel *p, int m) {
  return p->maps + (size_t)m * rows(p);
}

/* Memory the size of one-device node t, planned by liveness, that a transfer fills. */
static struct rtp_tensor *buffer_like(struct rtp_parallel *p, const struct rtp_tensor *t,
                                      const char *what, int m) {
  struct rtp_tensor *b = rtp__new_node(p->ctx, RTP_OP_EMPTY, t->type, t->ne, NULL, NULL);
  return b ? rtp_tensor_set_name(b, "%s.%d.%.40s", what, m, t->name) : NULL;
}

/* Node t (last in g) moved to just after the last node it reads: a send posted as soon as
 * what it sends is computed, but never before another transfer of the pipe, since the
 * k-th send to a rank matches its k-th recv from this one. */
static void post_early(struct rtp_graph *g, struct rtp_tensor *t) {
  int at = g->n_nodes - 2;
  for (; at >= 0; at--) {
    struct rtp_tensor *u = g->nodes[at];
    bool read = u->op == RTP_OP_COMM && rtp__get_param_u64(u, 4) == rtp__get_param_u64(t, 4);
    for (int k = 0; k < RTP_MAX_SRC; k++) read |= t->src[k] == u;
    if (read || (t->src[0] && t->src[0]->view_src == u)) break;
  }
  if (at < g->n_nodes - 2) rtp__graph_move_after(g, at, t);
}

/* The placeholder through which segment q of micro-batch m reads node j, made on first
 * use; NULL if out of memory. */
static struct rtp_xing *xing(struct rtp_parallel *p, struct rtp_pipe *pp, int m, int j, int q) {
  for (int k = 0; k < pp->n_xs; k++) {
    struct rtp_xing *x = &pp->xs[k];
    if (x->m == m && x->j == j && x->q == q) return x;
  }
  if (pp->n_xs == pp->cap_xs) {
    int cap = pp->cap_xs ? 2 * pp->cap_xs : 64;
    struct rtp_xing *xs = realloc(pp->xs, sizeof(*xs) * (size_t)cap);
    if (!xs) {
      rtp__ctx_error(p->ctx, RTP_ENOMEM, "pipeline: out of memory");
      return NULL;
    }
    pp->xs = xs;
    pp->cap_xs = cap;
  }
  struct rtp_tensor *orig = map_of(p, m)[j];
  struct rtp_tensor *ph = rtp_view(p->ctx, orig, RTP_MAX_DIMS, orig->ne, orig->nb, 0);
  if (!ph) return NULL;
  ph->flags |= RTP__FLAG_GRAD_STOP;
  rtp_tensor_set_name(ph, "seg%d.%d.%.40s", q, m, orig->name);
  pp->xs[pp->n_xs] = (struct rtp_xing){m, j, q, ph, NULL};
  return &pp->xs[pp->n_xs++];
}

/* Whether segment q reads node j through a placeholder: j was made by another stage, or
 * by an earlier segment of this one. */
static bool crosses(const struct rtp_pipe *pp, int j, int q) {
  return pp->node_stage[j] != pp->s || pp->node_seg[j] != q;
}

/* Segment q's nodes of micro-batch m cloned into p->map (the micro-batch's map, or a copy
 * for a recomputation), each reading earlier segments through placeholders. */
static int clone_segment(struct rtp_parallel *p, struct rtp_pipe *pp, int m, int q) {
  const struct rtp_graph *src = p->src;
  int rc = RTP_OK;
  for (int i = 0; i < src->n_nodes && !rc; i++) {
    if (pp->node_stage[i] != pp->s || pp->node_seg[i] != q) continue;
    const struct rtp_tensor *t = src->nodes[i];
    int swapped[RTP_MAX_SRC], n = 0;
    struct rtp_tensor *saved[RTP_MAX_SRC];
    for (int k = 0; k < RTP_MAX_SRC && !rc; k++) {
      const struct rtp_tensor *u = t->src[k];
      int j = u && u->op != RTP_OP_NONE ? rtp__graph_index(src, u) : -1;
      if (j < 0 || !crosses(pp, j, q)) continue;
      bool seen = false;
      for (int e = 0; e < n; e++) seen |= swapped[e] == j;
      if (seen) continue;
      struct rtp_xing *x = xing(p, pp, m, j, q);
      if (!x) {
        rc = rtp_context_error(p->ctx, NULL);
        break;
      }
      swapped[n] = j;
      saved[n++] = p->map[j];
      p->map[j] = x->ph;
    }
    if (!rc) rc = rtp__parallel_clone_node(p, i);
    for (int e = n - 1; e >= 0; e--) p->map[swapped[e]] = saved[e];
  }
  return rc;
}

/* ---- forward ----------------------------------------------------------------------- */

int rtp__stage_forward_begin(struct rtp_parallel *p, struct rtp_pipe *pp, int m) {
  const struct rtp_graph *src = p->src;
  int rc = rtp__parallel_clone_leaves(p, m, pp->leaf_stage, pp->s);
  for (int k = 0; k < pp->n_in && !rc; k++) {
    int i = pp->in[k];
    struct rtp_tensor *buf = buffer_like(p, src->nodes[i], "pipe.in", m);
    struct rtp_tensor *r =
        buf ? rtp_recv(p->ctx, pp->comm, buf, pp->node_stage[i], NULL) : NULL;
    if (!r) return rtp_context_error(p->ctx, NULL);
    p->map[i] = pp->in_recv[(size_t)m * (size_t)pp->n_in + (size_t)k] = r;
  }
  return rc;
}

int rtp__stage_forward_segment(struct rtp_parallel *p, struct rtp_pipe *pp, int m, int q) {
  p->map = map_of(p, m);
  if (p->iface->segment) p->iface->segment(p);
  int rc = clone_segment(p, pp, m, q);
  /* The model's outputs are kept (to the end of the step) for the first micro-batch
   * only: all M of a pipeline's logits would outweigh its stash. */
  for (int i = 0; i < p->src->n_nodes && !rc && m > 0; i++)
    if (pp->node_stage[i] == pp->s && pp->node_seg[i] == q && p->map[i])
      p->map[i]->flags &= ~RTP_FLAG_OUTPUT;
  return rc;
}

int rtp__stage_forward_end(struct rtp_parallel *p, struct rtp_pipe *pp, int m) {
  struct rtp_context *ctx = p->ctx;
  struct rtp_tensor **map = map_of(p, m);
  int rc = RTP_OK;
  for (int k = 0; k < pp->n_out && !rc; k++) {
    struct rtp_tensor *y = rtp_cont(ctx, map[pp->out[k]]);
    for (int c = 0; c < pp->S && !rc; c++) {
      if (!(pp->out_to[k] >> c & 1)) continue;
      struct rtp_tensor *snd = rtp_send(ctx, pp->comm, y, c, NULL);
      pp->out_send[((size_t)m * (size_t)pp->n_out + (size_t)k) * (size_t)pp->S + (size_t)c] =
          snd;
      rc = snd ? rtp_graph_build(p->graph, snd) : rtp_context_error(ctx, NULL);
    }
  }
  if (!rc && pp->s == pp->S - 1) {
    struct rtp_tensor *l = map[rtp__parallel_index(p, p->loss)];
    pp->losses[m] = l;
    l->flags |= RTP_FLAG_LOSS | RTP_FLAG_OUTPUT;
    rc = rtp_graph_build(p->graph, l);
  }
  return rc;
}

/* ---- backward ---------------------------------------------------------------------- */

/* The gradients of this stage's outputs, sent back by the stages that read them (summed
 * over them); each waits for the send of the output it belongs to. */
int rtp__stage_backward_begin(struct rtp_parallel *p, struct rtp_pipe *pp, int m) {
  const struct rtp_graph *src = p->src;
  struct rtp_context *ctx = p->ctx;
  int rc = RTP_OK;
  for (int k = 0; k < pp->n_out && !rc; k++) {
    struct rtp_tensor *sum = NULL;
    for (int c = 0; c < pp->S && !rc; c++) {
      if (!(pp->out_to[k] >> c & 1)) continue;
      struct rtp_tensor *after =
          pp->out_send[((size_t)m * (size_t)pp->n_out + (size_t)k) * (size_t)pp->S + (size_t)c];
      struct rtp_tensor *buf = buffer_like(p, src->nodes[pp->out[k]], "pipe.grad", m);
      struct rtp_tensor *g = buf ? rtp_recv(ctx, pp->comm, buf, c, after) : NULL;
      sum = !g ? NULL : sum ? rtp_add(ctx, sum, g) : g;
      if (!sum) rc = rtp_context_error(ctx, NULL);
    }
    pp->out_grad[(size_t)m * (size_t)pp->n_out + (size_t)k] = sum;
  }
  return rc;
}

/* Adds gradient g of node j to the seeds (outs, seeds, *n). */
static int add_seed(struct rtp_context *ctx, struct rtp_tensor *out, struct rtp_tensor *g,
                    struct rtp_tensor **outs, struct rtp_tensor **seeds, int *n) {
  for (int k = 0; k < *n; k++)
    if (outs[k] == out) {
      seeds[k] = rtp_add(ctx, seeds[k], g);
      return seeds[k] ? RTP_OK : rtp_context_error(ctx, NULL);
    }
  outs[*n] = out;
  seeds[(*n)++] = g;
  return RTP_OK;
}

/* Segment q's backward for micro-batch m: seeded with the gradients that its readers left
 * (later segments' placeholders, later stages) and, on the last stage, the loss's 1/(D M);
 * with recompute, through a copy of its forward built here. */
int rtp__stage_backward_segment(struct rtp_parallel *p, struct rtp_pipe *pp, int m, int q) {
  const struct rtp_graph *src = p->src;
  struct rtp_context *ctx = p->ctx;
  struct rtp_tensor **map = map_of(p, m);
  int cap = pp->n_xs + pp->n_out + 2, n = 0, rc = RTP_OK, li = rtp__parallel_index(p, p->loss);
  struct rtp_tensor **outs = calloc((size_t)cap, sizeof(*outs));
  struct rtp_tensor **seeds = calloc((size_t)cap, sizeof(*seeds));
  int *idx = calloc((size_t)cap, sizeof(int));
  struct rtp_tensor **rmap = NULL;
  if (!outs || !seeds || !idx) rc = rtp__ctx_error(ctx, RTP_ENOMEM, "pipeline: out of memory");
  for (int k = 0; k < pp->n_xs && !rc; k++) { /* what later segments left */
    struct rtp_xing *x = &pp->xs[k];
    if (x->m != m || x->grad == NULL || pp->node_stage[x->j] != pp->s ||
        pp->node_seg[x->j] != q)
      continue;
    idx[n] = x->j;
    rc = add_seed(ctx, map[x->j], x->grad, outs, seeds, &n);
  }
  for (int k = 0; k < pp->n_out && !rc; k++) { /* what later stages sent back */
    struct rtp_tensor *g = pp->out_grad[(size_t)m * (size_t)pp->n_out + (size_t)k];
    if (pp->node_seg[pp->out[k]] != q || !g) continue;
    idx[n] = pp->out[k];
    rc = add_seed(ctx, map[pp->out[k]], g, outs, seeds, &n);
  }
  if (!rc && pp->s == pp->S - 1 && pp->node_seg[li] == q) { /* the loss: its mean's share */
    struct rtp_tensor *seed = rtp_tensor_new_1d(ctx, RTP_TYPE_F32, 1);
    if (!seed || (!seed->data && !rtp__tensor_alloc(ctx, seed, RTP_ROLE_INPUT)))
      rc = rtp_context_error(ctx, NULL);
    int D = p->comm ? rtp_comm_size(p->comm) : 1;
    if (!rc)
      rc = rtp_tensor_fill_f32(rtp_tensor_set_name(seed, "loss.seed.%d", m),
                               1.0f / (float)(D * pp->M));
    if (!rc) rc = rtp_graph_build(p->graph, seed);
    idx[n] = li;
    if (!rc) rc = add_seed(ctx, map[li], seed, outs, seeds, &n);
  }
  if (!rc && n > 0 && p->iface->segment) p->iface->segment(p);
  if (!rc && n > 0 && pp->recompute && q >= 0) { /* the forward again, read by backward */
    if (!(rmap = malloc(sizeof(*rmap) * rows(p))))
      rc = rtp__ctx_error(ctx, RTP_ENOMEM, "pipeline: out of memory");
    if (!rc) {
      memcpy(rmap, map, sizeof(*rmap) * rows(p));
      p->map = rmap;
      rc = clone_segment(p, pp, m, q);
      p->map = map;
    }
    for (int i = 0; i < src->n_nodes && !rc; i++) /* the copies are not kept to the end */
      if (pp->node_stage[i] == pp->s && pp->node_seg[i] == q && rmap[i] != map[i])
        rmap[i]->flags &= ~RTP_FLAG_OUTPUT;
    for (int k = 0; k < n && !rc; k++) outs[k] = rmap[idx[k]];
  }
  for (int k = 0; k < n && !rc; k++) rc = rtp_graph_build(p->graph, outs[k]);
  for (int k = 0; k < n && !rc; k++) rc = rtp_graph_build(p->graph, seeds[k]);
  if (!rc && n > 0) rc = rtp__graph_build_backward_seeded(ctx, p->graph, n, outs, seeds);
  for (int k = 0; k < pp->n_xs && !rc; k++) { /* what this segment leaves to the ones before */
    struct rtp_xing *x = &pp->xs[k];
    if (x->m == m && x->q == q) x->grad = x->ph->grad ? rtp_cont(ctx, x->ph->grad) : NULL;
  }
  free(outs);
  free(seeds);
  free(idx);
  free(rmap);
  return rc;
}

/* The gradients of what this stage received, summed over the segments that read it, sent
 * back as soon as they are computed. */
int rtp__stage_backward_end(struct rtp_parallel *p, struct rtp_pipe *pp, int m) {
  struct rtp_context *ctx = p->ctx;
  int rc = RTP_OK;
  for (int k = 0; k < pp->n_in && !rc; k++) {
    struct rtp_tensor *r = pp->in_recv[(size_t)m * (size_t)pp->n_in + (size_t)k], *d = NULL;
    for (int e = 0; e < pp->n_xs && !rc; e++) {
      struct rtp_xing *x = &pp->xs[e];
      if (x->m != m || x->j != pp->in[k] || !x->grad) continue;
      d = d ? rtp_add(ctx, d, x->grad) : x->grad;
    }
    if (!d) d = rtp_scale(ctx, r, 0.0f); /* read by nothing that needs a gradient */
    /* After the send before it to the same stage: what it sends dies once it is done,
     * rather than at the end of the step. */
    struct rtp_tensor **last = &pp->last_grad_send[pp->node_stage[pp->in[k]]];
    struct rtp_tensor *snd =
        d ? rtp_send(ctx, pp->comm, d, pp->node_stage[pp->in[k]], *last) : NULL;
    if (snd) *last = snd;
    rc = snd ? rtp_graph_build(p->graph, snd) : rtp_context_error(ctx, NULL);
    if (!rc) post_early(p->graph, snd);
  }
  return rc;
}
