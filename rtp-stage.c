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
 * per unit; under rtp they go through each op that reads a parameter together, so each
 * block rotates once per unit (clone_unit_op), and their backward is built at once. With
 * recompute, a segment's forward is built again just before its backward,
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

/* What segment q of micro-batch m reads for entry `row` of its map: the entry, or its
 * placeholder when an earlier segment or stage made it; NULL if out of memory. */
static struct rtp_tensor *read_of(struct rtp_parallel *p, struct rtp_pipe *pp, int m, int q,
                                  int row, struct rtp_tensor **map) {
  if (row >= p->src->n_nodes || !crosses(pp, row, q)) return map[row];
  struct rtp_xing *x = xing(p, pp, m, row, q);
  return x ? x->ph : NULL;
}

/* Node i of micro-batch m cloned into `map`, reading earlier segments through
 * placeholders. */
static int clone_one(struct rtp_parallel *p, struct rtp_pipe *pp, int m, int q, int i,
                     struct rtp_tensor **map) {
  const struct rtp_tensor *t = p->src->nodes[i];
  int swapped[RTP_MAX_SRC], n = 0, rc = RTP_OK;
  struct rtp_tensor *saved[RTP_MAX_SRC];
  p->map = map;
  for (int k = 0; k < RTP_MAX_SRC && !rc; k++) {
    const struct rtp_tensor *u = t->src[k];
    int j = u && u->op != RTP_OP_NONE ? rtp__graph_index(p->src, u) : -1;
    if (j < 0 || !crosses(pp, j, q)) continue;
    bool seen = false;
    for (int e = 0; e < n; e++) seen |= swapped[e] == j;
    if (seen) continue;
    struct rtp_tensor *ph = read_of(p, pp, m, q, j, map);
    if (!ph) {
      rc = rtp_context_error(p->ctx, NULL);
      break;
    }
    swapped[n] = j;
    saved[n++] = map[j];
    map[j] = ph;
  }
  if (!rc) rc = rtp__parallel_clone_node(p, i);
  for (int e = n - 1; e >= 0; e--) map[swapped[e]] = saved[e];
  return rc;
}

/* The dimension a unit's inputs to node t stack along (a new outermost one), or -1 when
 * t's micro-batches cannot go through it together: it reads no parameter, reads more than
 * one other tensor (returned in *k), or that tensor fills every dimension (get_rows takes
 * indices of up to 3). */
static int unit_dim(const struct rtp_tensor *t, int *k) {
  *k = -1;
  if (!rtp__param_read(t)) return -1;
  for (int s = 0; s < RTP_MAX_SRC; s++) {
    if (!t->src[s] || rtp__param_leaf(t->src[s])) continue;
    if (*k >= 0) return -1;
    *k = s;
  }
  if (*k < 0) return -1;
  const struct rtp_tensor *x = t->src[*k];
  int top = RTP_MAX_DIMS - 1;
  while (top > 0 && x->ne[top] == 1) top--;
  return top + 1 < (t->op == RTP_OP_GET_ROWS ? 3 : RTP_MAX_DIMS) ? top + 1 : -1;
}

/* The unit's inputs xs[0..U) stacked along dimension d: the memory they already share when
 * they are the consecutive parts of one node's result (the unit op before), else a copy. */
static struct rtp_tensor *stack(struct rtp_context *ctx, struct rtp_tensor **xs, int U, int d) {
  struct rtp_tensor *h = xs[0]->op == RTP_OP_VIEW ? xs[0]->src[0] : NULL;
  size_t bytes = rtp_tensor_nbytes(xs[0]);
  bool shared = h && rtp_tensor_is_contiguous(h) && rtp_tensor_nbytes(h) == bytes * (size_t)U;
  for (int m = 0; m < U && shared; m++)
    shared = xs[m]->op == RTP_OP_VIEW && xs[m]->src[0] == h &&
             rtp_tensor_is_contiguous(xs[m]) &&
             rtp__get_param_u64(xs[m], 0) == (uint64_t)m * bytes;
  int64_t ne[4];
  memcpy(ne, xs[0]->ne, sizeof(ne));
  ne[d] *= U;
  if (shared) {
    size_t nb[4] = {rtp_type_size(h->type)};
    for (int i = 1; i < 4; i++) nb[i] = nb[i - 1] * (size_t)ne[i - 1];
    return rtp_view(ctx, h, RTP_MAX_DIMS, ne, nb, 0);
  }
  struct rtp_tensor *x = xs[0];
  for (int m = 1; m < U && x; m++) x = rtp_concat(ctx, x, xs[m], d);
  return x;
}

/* Node i (reading a parameter) for the unit's micro-batches m0 .. m0 + U - 1 at once: their
 * inputs stacked, one node over them (rtp: one rotation of the parameter for them all), and
 * each micro-batch's map entry its part of the result. */
static int clone_unit_op(struct rtp_parallel *p, struct rtp_pipe *pp, int m0, int U, int q,
                         int i, int k, int d, struct rtp_tensor **maps) {
  const struct rtp_tensor *t = p->src->nodes[i];
  size_t R = rows(p);
  int row = rtp__parallel_index(p, t->src[k]), rc = RTP_OK;
  struct rtp_tensor **xs = malloc(sizeof(*xs) * (size_t)U);
  if (!xs) return rtp__ctx_error(p->ctx, RTP_ENOMEM, "pipeline: out of memory");
  for (int m = 0; m < U && !rc; m++)
    if (!(xs[m] = read_of(p, pp, m0 + m, q, row, maps + (size_t)m * R)))
      rc = rtp_context_error(p->ctx, NULL);
  struct rtp_tensor *x = rc ? NULL : stack(p->ctx, xs, U, d);
  free(xs);
  if (!rc && !x) rc = rtp_context_error(p->ctx, NULL);
  if (rc) return rc;
  struct rtp_tensor *saved = maps[row];
  maps[row] = x;
  p->map = maps;
  rc = rtp__parallel_clone_node(p, i);
  maps[row] = saved;
  if (rc) return rc;
  struct rtp_tensor *y = maps[i];
  if (!rtp_tensor_is_contiguous(y) ||
      rtp_tensor_nelements(y) != (int64_t)U * rtp_tensor_nelements(t))
    return rtp__ctx_error(p->ctx, RTP_EINVAL, "pipeline: %s '%s' does not split by micro-batch",
                          rtp_op_name(t->op), t->name);
  size_t nb[4] = {rtp_type_size(t->type)}, bytes = rtp_tensor_nbytes(t);
  for (int e = 1; e < 4; e++) nb[e] = nb[e - 1] * (size_t)t->ne[e - 1];
  for (int m = 0; m < U; m++) { /* the flags (output, loss) go with each part */
    struct rtp_tensor *v = rtp_view(p->ctx, y, RTP_MAX_DIMS, t->ne, nb, (size_t)m * bytes);
    if (!v) return rtp_context_error(p->ctx, NULL);
    v->flags |= t->flags & (RTP_FLAG_OUTPUT | RTP_FLAG_LOSS);
    rtp_tensor_set_name(v, "%.50s.%d", t->name, m0 + m);
    maps[(size_t)m * R + (size_t)i] = v;
  }
  y->flags &= ~(RTP_FLAG_OUTPUT | RTP_FLAG_LOSS);
  return RTP_OK;
}

/* Segment q's nodes of micro-batches m0 .. m1 - 1 cloned into their maps (consecutive rows
 * from `maps`: theirs, or copies for a recomputation), node by node. Under a strategy with
 * unit_ops, each node that reads a parameter takes them together (clone_unit_op). */
static int clone_segment(struct rtp_parallel *p, struct rtp_pipe *pp, int m0, int m1, int q,
                         struct rtp_tensor **maps) {
  const struct rtp_graph *src = p->src;
  size_t R = rows(p);
  int rc = RTP_OK, U = m1 - m0;
  for (int i = 0; i < src->n_nodes && !rc; i++) {
    if (pp->node_stage[i] != pp->s || pp->node_seg[i] != q) continue;
    int k, d = U > 1 && p->iface->unit_ops ? unit_dim(src->nodes[i], &k) : -1;
    if (d >= 0) {
      rc = clone_unit_op(p, pp, m0, U, q, i, k, d, maps);
      continue;
    }
    for (int m = m0; m < m1 && !rc; m++)
      rc = clone_one(p, pp, m, q, i, maps + (size_t)(m - m0) * R);
  }
  return rc;
}

/* Whether a unit's micro-batches share each op that reads a parameter (and so their forward
 * is cloned node by node for them all, and their backward is built at once). */
static int unit_step(const struct rtp_parallel *p, int m0, int m1) {
  return p->iface->unit_ops ? m1 - m0 : 1;
}

/* ---- forward ----------------------------------------------------------------------- */

int rtp__stage_forward_begin(struct rtp_parallel *p, struct rtp_pipe *pp, int m) {
  const struct rtp_graph *src = p->src;
  int rc = rtp__parallel_clone_leaves(p, m, pp->leaf_stage, pp->s);
  for (int k = 0; k < pp->n_in && !rc; k++) {
    int i = pp->in[k];
    struct rtp_tensor *buf = pp->het ? NULL : buffer_like(p, src->nodes[i], "pipe.in", m);
    struct rtp_tensor *r =
        pp->het ? rtp__hetero_recv(p, pp, i, pp->node_stage[i], pp->s, false, m,
                                   &pp->in_nodes[(size_t)m * (size_t)pp->n_in + (size_t)k])
        : buf   ? rtp_recv(p->ctx, pp->comm, buf, pp->node_stage[i], NULL)
                : NULL;
    if (!r) return rtp_context_error(p->ctx, NULL);
    p->map[i] = pp->in_recv[(size_t)m * (size_t)pp->n_in + (size_t)k] = r;
  }
  return rc;
}

int rtp__stage_forward_segment(struct rtp_parallel *p, struct rtp_pipe *pp, int m0, int m1,
                               int q) {
  int rc = RTP_OK, step = unit_step(p, m0, m1);
  for (int m = m0; m < m1 && !rc; m += step) {
    if (p->iface->segment) p->iface->segment(p);
    rc = clone_segment(p, pp, m, m + step, q, map_of(p, m));
  }
  /* The model's outputs are kept (to the end of the step) for the first micro-batch
   * only: all M of a pipeline's logits would outweigh its stash. */
  for (int m = m0 > 0 ? m0 : 1; m < m1 && !rc; m++) {
    struct rtp_tensor **map = map_of(p, m);
    for (int i = 0; i < p->src->n_nodes; i++)
      if (pp->node_stage[i] == pp->s && pp->node_seg[i] == q && map[i])
        map[i]->flags &= ~RTP_FLAG_OUTPUT;
  }
  return rc;
}

int rtp__stage_forward_end(struct rtp_parallel *p, struct rtp_pipe *pp, int m) {
  struct rtp_context *ctx = p->ctx;
  struct rtp_tensor **map = map_of(p, m);
  int rc = RTP_OK;
  for (int k = 0; k < pp->n_out && !rc; k++) {
    /* het: the forward goes into the graph here, on a replica that sends nothing too
     * (its backward's receives come after it) */
    if (pp->het && (rc = rtp_graph_build(p->graph, map[pp->out[k]]))) break;
    struct rtp_tensor *y = pp->het ? NULL : rtp_cont(ctx, map[pp->out[k]]);
    for (int c = 0; c < pp->S && !rc; c++) {
      if (!(pp->out_to[k] >> c & 1)) continue;
      if (pp->het) { /* the planner's move (it copies what it sends); nothing reads it */
        rc = rtp__hetero_send(
            p, pp, pp->out[k], pp->s, c, false, m, map[pp->out[k]],
            &pp->out_nodes[((size_t)m * (size_t)pp->n_out + (size_t)k) * (size_t)pp->S +
                           (size_t)c]);
        continue;
      }
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
      struct rtp_tensor *buf =
          pp->het ? NULL : buffer_like(p, src->nodes[pp->out[k]], "pipe.grad", m);
      struct rtp_tensor *g = pp->het
                                 ? rtp__hetero_recv(p, pp, pp->out[k], pp->s, c, true, m, NULL)
                             : buf ? rtp_recv(ctx, pp->comm, buf, c, after)
                                   : NULL;
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

/* Segment q's backward for micro-batches m0 .. m1 - 1, built at once: seeded with the
 * gradients that their readers left (later segments' placeholders, later stages) and, on
 * the last stage, the loss's 1/(D M) each (tp, whole batch on every rank: 1/M); with recompute,
 * through a copy of their forward built here. */
static int backward_range(struct rtp_parallel *p, struct rtp_pipe *pp, int m0, int m1, int q) {
  const struct rtp_graph *src = p->src;
  struct rtp_context *ctx = p->ctx;
  size_t R = rows(p);
  int U = m1 - m0, li = rtp__parallel_index(p, p->loss);
  int cap = pp->n_xs + U * (pp->n_out + 1) + 1, n = 0, rc = RTP_OK;
  struct rtp_tensor **outs = calloc((size_t)cap, sizeof(*outs));
  struct rtp_tensor **seeds = calloc((size_t)cap, sizeof(*seeds));
  int *idx = calloc((size_t)cap, sizeof(int)); /* the seed's map entry, U rows in */
  struct rtp_tensor **rmap = NULL, **maps = map_of(p, m0);
  if (!outs || !seeds || !idx) rc = rtp__ctx_error(ctx, RTP_ENOMEM, "pipeline: out of memory");
  for (int k = 0; k < pp->n_xs && !rc; k++) { /* what later segments left */
    struct rtp_xing *x = &pp->xs[k];
    if (x->m < m0 || x->m >= m1 || x->grad == NULL || pp->node_stage[x->j] != pp->s ||
        pp->node_seg[x->j] != q)
      continue;
    idx[n] = (int)((size_t)(x->m - m0) * R) + x->j;
    rc = add_seed(ctx, maps[idx[n]], x->grad, outs, seeds, &n);
  }
  for (int m = m0; m < m1; m++)
    for (int k = 0; k < pp->n_out && !rc; k++) { /* what later stages sent back */
      struct rtp_tensor *g = pp->out_grad[(size_t)m * (size_t)pp->n_out + (size_t)k];
      if (pp->node_seg[pp->out[k]] != q || !g) continue;
      idx[n] = (int)((size_t)(m - m0) * R) + pp->out[k];
      rc = add_seed(ctx, maps[idx[n]], g, outs, seeds, &n);
    }
  for (int m = m0; m < m1 && !rc && pp->s == pp->S - 1 && pp->node_seg[li] == q; m++) {
    /* the loss: its mean's share */
    struct rtp_tensor *seed = rtp_tensor_new_1d(ctx, RTP_TYPE_F32, 1);
    if (!seed || (!seed->data && !rtp__tensor_alloc(ctx, seed, RTP_ROLE_INPUT)))
      rc = rtp_context_error(ctx, NULL);
    int D = p->comm && !p->iface->whole_batch ? rtp_comm_size(p->comm) : 1; /* tp: 1 */
    if (!rc)
      rc = rtp_tensor_fill_f32(rtp_tensor_set_name(seed, "loss.seed.%d", m),
                               1.0f / (float)(D * pp->M * p->accumulate));
    if (!rc) rc = rtp_graph_build(p->graph, seed);
    idx[n] = (int)((size_t)(m - m0) * R) + li;
    if (!rc) rc = add_seed(ctx, maps[idx[n]], seed, outs, seeds, &n);
  }
  if (!rc && n > 0 && p->iface->segment) p->iface->segment(p);
  if (!rc && n > 0 && pp->recompute && q >= 0) { /* the forward again, read by backward */
    if (!(rmap = malloc(sizeof(*rmap) * R * (size_t)U)))
      rc = rtp__ctx_error(ctx, RTP_ENOMEM, "pipeline: out of memory");
    if (!rc) {
      memcpy(rmap, maps, sizeof(*rmap) * R * (size_t)U);
      rc = clone_segment(p, pp, m0, m1, q, rmap);
      p->map = map_of(p, m0);
    }
    for (size_t e = 0; e < R * (size_t)U && !rc; e++) { /* the copies are not kept to the end */
      int i = (int)(e % R);
      if (i < src->n_nodes && pp->node_stage[i] == pp->s && pp->node_seg[i] == q &&
          rmap[e] != maps[e])
        rmap[e]->flags &= ~RTP_FLAG_OUTPUT;
    }
    for (int k = 0; k < n && !rc; k++) outs[k] = rmap[idx[k]];
  }
  for (int k = 0; k < n && !rc; k++) rc = rtp_graph_build(p->graph, outs[k]);
  for (int k = 0; k < n && !rc; k++) rc = rtp_graph_build(p->graph, seeds[k]);
  if (!rc && n > 0) rc = rtp__graph_build_backward_seeded(ctx, p->graph, n, outs, seeds);
  for (int k = 0; k < pp->n_xs && !rc; k++) { /* what this segment leaves to the ones before */
    struct rtp_xing *x = &pp->xs[k];
    if (x->m >= m0 && x->m < m1 && x->q == q)
      x->grad = x->ph->grad ? rtp_cont(ctx, x->ph->grad) : NULL;
  }
  free(outs);
  free(seeds);
  free(idx);
  free(rmap);
  return rc;
}

int rtp__stage_backward_segment(struct rtp_parallel *p, struct rtp_pipe *pp, int m0, int m1,
                                int q) {
  int rc = RTP_OK, step = unit_step(p, m0, m1);
  for (int m = m0; m < m1 && !rc; m += step) rc = backward_range(p, pp, m, m + step, q);
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
    if (pp->het) {
      rc = d ? rtp__hetero_send(p, pp, pp->in[k], pp->node_stage[pp->in[k]], pp->s, true, m, d,
                                NULL)
             : rtp_context_error(ctx, NULL);
      continue;
    }
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
