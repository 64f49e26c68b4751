/* rtp-alloc.c - the memory planner: places a graph's intermediate tensors in one buffer
 * by liveness, so a step reuses the memory of tensors no longer needed and computing
 * the graph never allocates. */
#include "rtp-backend.h"

#include <stdlib.h>
#include <string.h>

struct block {
  size_t offs, size;
};

/* Free ranges of the buffer being planned, sorted by offset and merged on free. */
struct free_list {
  struct block *b;
  int n, cap;
  size_t end; /* the buffer's size so far: the planned peak */
};

static int fl_insert(struct free_list *fl, int at, struct block blk) {
  if (fl->n == fl->cap) {
    int cap = fl->cap ? 2 * fl->cap : 64;
    struct block *b = realloc(fl->b, (size_t)cap * sizeof(*b));
    if (!b) return rtp__error(RTP_ENOMEM, "planner: out of memory");
    fl->b = b;
    fl->cap = cap;
  }
  memmove(fl->b + at + 1, fl->b + at, (size_t)(fl->n - at) * sizeof(*fl->b));
  fl->b[at] = blk;
  fl->n++;
  return RTP_OK;
}

static void fl_remove(struct free_list *fl, int at) {
  memmove(fl->b + at, fl->b + at + 1, (size_t)(fl->n - at - 1) * sizeof(*fl->b));
  fl->n--;
}

/* Best fit among free ranges; otherwise grow the buffer, reusing a free tail. */
static size_t fl_alloc(struct free_list *fl, size_t size) {
  int best = -1;
  for (int i = 0; i < fl->n; i++)
    if (fl->b[i].size >= size && (best < 0 || fl->b[i].size < fl->b[best].size)) best = i;
  if (best >= 0) {
    size_t offs = fl->b[best].offs;
    fl->b[best].offs += size;
    fl->b[best].size -= size;
    if (fl->b[best].size == 0) fl_remove(fl, best);
    return offs;
  }
  if (fl->n > 0 && fl->b[fl->n - 1].offs + fl->b[fl->n - 1].size == fl->end) {
    size_t offs = fl->b[fl->n - 1].offs;
    fl_remove(fl, fl->n - 1);
    fl->end = offs + size;
    return offs;
  }
  size_t offs = fl->end;
  fl->end += size;
  return offs;
}

static int fl_free(struct free_list *fl, struct block blk) {
  int i = 0;
  while (i < fl->n && fl->b[i].offs < blk.offs) i++;
  bool merge_prev = i > 0 && fl->b[i - 1].offs + fl->b[i - 1].size == blk.offs;
  bool merge_next = i < fl->n && blk.offs + blk.size == fl->b[i].offs;
  if (merge_prev && merge_next) {
    fl->b[i - 1].size += blk.size + fl->b[i].size;
    fl_remove(fl, i);
  } else if (merge_prev) {
    fl->b[i - 1].size += blk.size;
  } else if (merge_next) {
    fl->b[i].offs = blk.offs;
    fl->b[i].size += blk.size;
  } else {
    return fl_insert(fl, i, blk);
  }
  return RTP_OK;
}

/* Nodes with a view_src (views, and communication nodes that fill another tensor's
 * memory) live in their source's memory. */
static bool is_planned(const struct rtp_tensor *t) {
  return t->op != RTP_OP_NONE && !t->view_src && !t->data;
}

static int node_index(const struct rtp_tensor *t) {
  return (int)(intptr_t)t->extra - 1; /* -1 for leafs */
}

/* The index of the last node that reads each node, through any chain of views (a view's
 * data is its base's); outputs, and the bases of output views, live to the end. A
 * transfer is waited for only where its result is first read (or at the end), so what
 * it reads must stay in place until then. Where that first reader is another transfer
 * (a forwarded hop), nothing has waited for the first yet: on a device, the first compute
 * wait that orders it is the one for the second (the comm stream is in order), so the
 * first's source lives until the second's first reader. first_read is scratch of n ints. */
static void compute_last_use(const struct rtp_graph *g, int *last, int *first_read) {
  int n = g->n_nodes;
  for (int i = 0; i < n; i++) last[i] = i, first_read[i] = n;
  for (int i = 0; i < n; i++) {
    const struct rtp_tensor *t = g->nodes[i];
    for (int s = 0; s < RTP_MAX_SRC; s++) {
      if (!rtp__src_read(t, s)) continue;
      int j = node_index(rtp__base_of(t->src[s]));
      if (j >= 0 && last[j] < i) last[j] = i;
      const struct rtp_tensor *c = rtp__is_view_op(t->op) ? NULL : rtp__waited_transfer(t, s);
      int k = c ? node_index(c) : -1;
      if (k >= 0 && first_read[k] > i) first_read[k] = i;
    }
    if (t->flags & (RTP_FLAG_OUTPUT | RTP_FLAG_LOSS)) {
      int j = node_index(rtp__base_of(t));
      if (j >= 0) last[j] = n;
    }
  }
  for (int i = n - 1; i >= 0; i--) { /* later transfers first: chains resolve at once */
    int f = first_read[i];
    if (g->nodes[i]->op == RTP_OP_COMM && f < n && g->nodes[f]->op == RTP_OP_COMM)
      first_read[i] = first_read[f];
  }
  for (int i = 0; i < n; i++) {
    const struct rtp_tensor *t = g->nodes[i];
    if (t->op != RTP_OP_COMM) continue;
    for (int s = 0; s < RTP_MAX_SRC; s++) {
      int j = t->src[s] ? node_index(rtp__base_of(t->src[s])) : -1;
      if (j >= 0 && last[j] < first_read[i]) last[j] = first_read[i];
    }
  }
}

/* The source whose memory node t can write its result into, if that source dies at t:
 * the ops that read each element (or row) of it before writing the same element (or
 * row) of the result. -1 for the others. */
static int inplace_src(const struct rtp_tensor *t) {
  switch (t->op) {
    case RTP_OP_ADD:
    case RTP_OP_SUB:
    case RTP_OP_MUL:
    case RTP_OP_SCALE:
    case RTP_OP_GELU:
    case RTP_OP_GELU_BACK:
    case RTP_OP_NORM_BACK:
    case RTP_OP_SOFT_MAX_BACK:
      return 0;
    case RTP_OP_ACC: /* the base */
      return 1;
    case RTP_OP_MUL_MAT: /* the addend, unless an operand reads the same memory */
      return rtp__addend(t) && rtp__base_of(t->src[0]) != t->src[2] &&
                     rtp__base_of(t->src[1]) != t->src[2]
                 ? 2
                 : -1;
    default:
      return -1;
  }
}

/* Index of the source node whose memory node i (at step i) takes over, or -1. */
static int donor(const struct rtp_graph *g, int i, const int *last) {
  const struct rtp_tensor *t = g->nodes[i];
  int k = inplace_src(t);
  const struct rtp_tensor *s = k >= 0 ? t->src[k] : NULL;
  if (!s || s->view_src || !is_planned(s) || s->type != t->type ||
      rtp_tensor_nbytes(s) != rtp_tensor_nbytes(t) || !rtp_tensor_is_contiguous(s))
    return -1;
  int j = node_index(s);
  return j >= 0 && last[j] == i ? j : -1;
}

int rtp_graph_plan(struct rtp_context *ctx, struct rtp_graph *g) {
  if (!ctx || !g) return rtp__error(RTP_EINVAL, "rtp_graph_plan: NULL argument");
  if (g->plan) return rtp__error(RTP_ESTATE, "rtp_graph_plan: the graph is already planned");
  int n = g->n_nodes;
  int *last = malloc((size_t)(n ? n : 1) * 2 * sizeof(int));
  size_t *offs = malloc((size_t)(n ? n : 1) * sizeof(size_t));
  struct free_list fl = {0};
  int rc = RTP_OK;
  if (!last || !offs) {
    rc = rtp__error(RTP_ENOMEM, "rtp_graph_plan: out of memory");
    goto done;
  }
  /* extra holds index + 1 of each node during planning, so sources find their node. */
  for (int i = 0; i < n; i++) g->nodes[i]->extra = (void *)(intptr_t)(i + 1);
  compute_last_use(g, last, last + n);

  size_t sum = 0, live = 0, live_max = 0; /* live: what the plan holds, freed space aside */
  for (int i = 0; i < n && rc == RTP_OK; i++) {
    struct rtp_tensor *t = g->nodes[i];
    int d = is_planned(t) ? donor(g, i, last) : -1;
    if (is_planned(t))
      sum += RTP_PAD(rtp_tensor_nbytes(t) ? rtp_tensor_nbytes(t) : 1, RTP_ALIGN);
    if (d >= 0) { /* in place: the source's memory becomes the result's */
      offs[i] = offs[d];
      last[d] = -1;
    } else if (is_planned(t)) {
      size_t bytes = RTP_PAD(rtp_tensor_nbytes(t) ? rtp_tensor_nbytes(t) : 1, RTP_ALIGN);
      offs[i] = fl_alloc(&fl, bytes);
      if ((live += bytes) > live_max) live_max = live;
    }
    /* Tensors whose last reader is node i are dead once it has run. Node i's own output
     * was placed first, so it shares memory with an input only where it took it over. */
    for (int j = 0; j <= i && rc == RTP_OK; j++)
      if (last[j] == i && is_planned(g->nodes[j])) {
        size_t bytes = RTP_PAD(
            rtp_tensor_nbytes(g->nodes[j]) ? rtp_tensor_nbytes(g->nodes[j]) : 1, RTP_ALIGN);
        live -= bytes;
        rc = fl_free(&fl, (struct block){offs[j], bytes});
      }
  }
  if (rc) goto done;

  struct rtp_backend *be = rtp__ctx_backend(ctx);
  size_t work = 0;
  int n_comm = 0;
  for (int i = 0; i < n && be && be->i->has_kernel; i++) {
    const struct rtp_tensor *t = g->nodes[i];
    bool computes = !rtp__is_view_op(t->op) && t->op != RTP_OP_COMM && t->op != RTP_OP_EMPTY &&
                    t->op != RTP_OP_NONE;
    if (computes && !be->i->has_kernel(be, t->op)) {
      rc =
          rtp__error(RTP_ENOSYS, "rtp_graph_plan: op %s ('%s') has no kernel on the %s backend",
                     rtp_op_name(t->op), t->name, be->i->name);
      goto done;
    }
  }
  for (int i = 0; i < n; i++) {
    struct rtp_tensor *t = g->nodes[i];
    size_t w = be ? be->i->work_size(be, t) : rtp__op_work_size(t);
    if (w > work) work = w;
    n_comm += t->op == RTP_OP_COMM;
  }
  if (be && (rc = be->i->events_reserve(be, 2 * n_comm)) != RTP_OK) goto done;
  uint8_t *buf = fl.end ? rtp__ctx_data_alloc(ctx, fl.end, "the planned activations") : NULL;
  void *work_buf = work ? rtp__ctx_data_alloc(ctx, work, "kernel scratch") : NULL;
  struct rtp_plan *plan = rtp__ctx_alloc(ctx, sizeof(*plan), "a plan");
  if ((fl.end && !buf) || (work && !work_buf) || !plan) {
    rc = rtp_context_error(ctx, NULL);
    goto done;
  }
  for (int i = 0; i < n; i++)
    if (is_planned(g->nodes[i])) g->nodes[i]->data = buf + offs[i];
  for (int i = 0; i < n; i++) {
    struct rtp_tensor *t = g->nodes[i];
    if (t->view_src)
      t->data = t->view_src->data ? (char *)t->view_src->data + t->view_offs : NULL;
  }
  *plan =
      (struct rtp_plan){.work = work_buf, .work_size = work, .backend = be, .n_comm = n_comm};
  for (int i = 0; i < n && !be && rc == RTP_OK; i++)
    if (g->nodes[i]->op == RTP_OP_MUL_MAT) rc = rtp__mul_mat_plan(g->nodes[i]);
  if (rc) goto done;
  g->plan = plan;
  rtp__ctx_note_plan(ctx, fl.end, sum, live_max, work);

done:
  for (int i = 0; i < n; i++) g->nodes[i]->extra = NULL;
  free(fl.b);
  free(offs);
  free(last);
  return rc;
}
