/* rtp-comm-node.c - communication as graph nodes: the builders (rotation, all-reduce,
 * all-gather of rows, one-way send and recv) and what each node asks of its communicator
 * (rtp__comm_node_op), which the executor posts on the host or hands to a device
 * backend. A node's result is the memory the transfer fills (or, for a send, the memory
 * it reads): whoever reads the node waits for the transfer. */
#include "rtp-comm.h"

#include <stdio.h>

/* Transfers that only move bytes take f32 or bf16; the all-reduce sums f32. */
static bool comm_type_ok(const struct rtp_tensor *t, bool sums) {
  return t->type == RTP_TYPE_F32 || (!sums && t->type == RTP_TYPE_BF16);
}

/* A node of kind `kind` on the memory of `buf`, posted when the executor reaches it. */
static struct rtp_tensor *comm_node(struct rtp_context *ctx, const char *name,
                                    struct rtp_comm *comm, struct rtp_tensor *buf,
                                    struct rtp_tensor *after, int kind) {
  bool sums = kind == RTP__COMM_ALLREDUCE;
  if (!comm) {
    rtp__ctx_error(ctx, RTP_EINVAL, "%s: NULL communicator", name);
    return NULL;
  }
  if (!comm_type_ok(buf, sums) || !rtp_tensor_is_contiguous(buf))
    return rtp__op_error(
        ctx, name, RTP_ESHAPE, buf, NULL,
        sums ? "needs a contiguous f32 buffer" : "needs a contiguous f32 or bf16 buffer");
  struct rtp_tensor *t = rtp__new_node(ctx, RTP_OP_COMM, buf->type, buf->ne, buf, NULL);
  if (!t) return NULL;
  t->view_src = buf->view_src ? buf->view_src : buf;
  t->view_offs = buf->view_offs;
  if (t->view_src->data) t->data = (char *)t->view_src->data + t->view_offs;
  t->src[2] = after;
  t->op_params[0] = kind;
  rtp__set_param_u64(t, 4, (uint64_t)(uintptr_t)comm);
  return t;
}

static bool rank_ok(struct rtp_context *ctx, const char *name, struct rtp_comm *comm,
                    int rank) {
  if (!comm || (rank >= 0 && rank < rtp_comm_size(comm))) return true;
  rtp__ctx_error(ctx, RTP_EINVAL, "%s: rank %d out of range (group of %d)", name, rank,
                 rtp_comm_size(comm));
  return false;
}

struct rtp_tensor *rtp_sendrecv(struct rtp_context *ctx, struct rtp_comm *comm,
                                struct rtp_tensor *send, int dst, struct rtp_tensor *recv,
                                int src, struct rtp_tensor *after) {
  if (!rtp__inputs_ok(ctx, "sendrecv", send, recv, true)) return NULL;
  if (!comm_type_ok(send, false) || !rtp_tensor_is_contiguous(send))
    return rtp__op_error(ctx, "sendrecv", RTP_ESHAPE, send, recv,
                         "send must be contiguous f32 or bf16");
  if (!rank_ok(ctx, "sendrecv", comm, dst) || !rank_ok(ctx, "sendrecv", comm, src)) return NULL;
  struct rtp_tensor *t = comm_node(ctx, "sendrecv", comm, recv, after, RTP__COMM_SENDRECV);
  if (!t) return NULL;
  t->src[0] = send;
  t->src[1] = recv;
  t->op_params[1] = dst;
  t->op_params[2] = src;
  return t;
}

struct rtp_tensor *rtp_send(struct rtp_context *ctx, struct rtp_comm *comm,
                            struct rtp_tensor *a, int dst, struct rtp_tensor *after) {
  if (!rtp__inputs_ok(ctx, "send", a, NULL, false) || !rank_ok(ctx, "send", comm, dst))
    return NULL;
  if (comm && dst == rtp_comm_rank(comm)) {
    rtp__ctx_error(ctx, RTP_EINVAL, "send: to oneself (rank %d)", dst);
    return NULL;
  }
  struct rtp_tensor *t = comm_node(ctx, "send", comm, a, after, RTP__COMM_SEND);
  if (!t) return NULL;
  t->src[0] = a;
  t->op_params[1] = dst;
  t->op_params[2] = -1;
  return t;
}

struct rtp_tensor *rtp_recv(struct rtp_context *ctx, struct rtp_comm *comm,
                            struct rtp_tensor *buf, int src, struct rtp_tensor *after) {
  if (!rtp__inputs_ok(ctx, "recv", buf, NULL, false) || !rank_ok(ctx, "recv", comm, src))
    return NULL;
  if (comm && src == rtp_comm_rank(comm)) {
    rtp__ctx_error(ctx, RTP_EINVAL, "recv: from oneself (rank %d)", src);
    return NULL;
  }
  struct rtp_tensor *t = comm_node(ctx, "recv", comm, buf, after, RTP__COMM_RECV);
  if (!t) return NULL;
  t->src[1] = buf;
  t->op_params[1] = -1;
  t->op_params[2] = src;
  return t;
}

struct rtp_tensor *rtp_allreduce(struct rtp_context *ctx, struct rtp_comm *comm,
                                 struct rtp_tensor *a, struct rtp_tensor *after) {
  if (!rtp__inputs_ok(ctx, "allreduce", a, NULL, false)) return NULL;
  return comm_node(ctx, "allreduce", comm, a, after, RTP__COMM_ALLREDUCE);
}

struct rtp_tensor *rtp__allgather_rows(struct rtp_context *ctx, struct rtp_comm *comm,
                                       struct rtp_tensor *a, struct rtp_tensor *after) {
  if (!rtp__inputs_ok(ctx, "allgather", a, NULL, false)) return NULL;
  struct rtp_tensor *t = comm_node(ctx, "allgather", comm, a, after, RTP__COMM_ALLGATHER);
  if (t) t->src[0] = a;
  return t;
}

struct rtp_comm *rtp__comm_node_op(const struct rtp_tensor *t, struct rtp_comm_op *op) {
  *op = (struct rtp_comm_op){.dst = -1, .src = -1, .what = t->name};
  int d = rtp_tensor_n_dims(t) - 1;
  switch (t->op_params[0]) {
    case RTP__COMM_SENDRECV:
    case RTP__COMM_SEND:
    case RTP__COMM_RECV:
      op->kind = RTP_COMM_K_P2P;
      op->dst = t->op_params[1];
      op->src = t->op_params[2];
      if (op->dst >= 0) {
        op->sbuf = t->src[0]->data;
        op->sbytes = rtp_tensor_nbytes(t->src[0]);
      }
      if (op->src >= 0) {
        op->buf = t->data;
        op->rbytes = rtp_tensor_nbytes(t);
      }
      break;
    case RTP__COMM_ALLGATHER: /* blocks of the outermost dimension */
      op->kind = RTP_COMM_K_ALLGATHER;
      op->buf = t->data;
      op->count = (uint64_t)t->ne[d];
      op->esize = t->nb[d];
      break;
    default:
      op->kind = RTP_COMM_K_ALLREDUCE;
      op->buf = t->data;
      op->count = (uint64_t)rtp_tensor_nelements(t);
      op->esize = sizeof(float);
  }
  return (struct rtp_comm *)(uintptr_t)rtp__get_param_u64(t, 4);
}

int rtp__comm_node_post(const struct rtp_tensor *t, struct rtp_comm_req **req) {
  struct rtp_comm_op op;
  struct rtp_comm *comm = rtp__comm_node_op(t, &op);
  return rtp__comm_post(comm, &op, req);
}

const struct rtp_comm *rtp__comm_node_comm(const struct rtp_tensor *t) {
  return (const struct rtp_comm *)(uintptr_t)rtp__get_param_u64(t, 4);
}

void rtp__comm_node_describe(const struct rtp_tensor *t, char *buf, size_t n) {
  const char *name = t->name[0] ? t->name : "";
  const char *sep = t->name[0] ? " " : "";
  switch (t->op_params[0]) {
    case RTP__COMM_SEND:
      snprintf(buf, n, "%s%ssend to %d", name, sep, t->op_params[1]);
      break;
    case RTP__COMM_RECV:
      snprintf(buf, n, "%s%srecv from %d", name, sep, t->op_params[2]);
      break;
    case RTP__COMM_SENDRECV:
      snprintf(buf, n, "%s%ssend to %d, recv from %d", name, sep, t->op_params[1],
               t->op_params[2]);
      break;
    case RTP__COMM_ALLGATHER:
      snprintf(buf, n, "%s%sallgather", name, sep);
      break;
    default:
      snprintf(buf, n, "%s%sallreduce", name, sep);
  }
}

/* What the transport's own plan of the operation sends (rtp-coll.c), so that every kind
 * counts as it travels: a reduce-scatter carries half an all-reduce's bytes, a broadcast
 * its whole buffer from every rank but the last of the chain. */
double rtp__comm_node_bytes(const struct rtp_tensor *t) {
  struct rtp_comm_op op;
  struct rtp_comm *comm = rtp__comm_node_op(t, &op);
  op.rank = rtp_comm_rank(comm);
  op.size = rtp_comm_size(comm);
  if (op.kind == RTP_COMM_K_P2P && (op.dst < 0 || op.dst == op.rank)) return 0;
  if (op.kind != RTP_COMM_K_P2P && op.size == 1) return 0;
  struct rtp_coll_plan plan;
  rtp__coll_plan(&op, 1u << 20, 1u << 20, &plan);
  return (double)plan.total[0];
}
