/* rtp-coll.c - collective geometry: which block of a buffer each step of a ring
 * collective sends and receives, and how an operation is cut into frames. Pure functions
 * of the operation (tests/test-coll.cpp runs them on simulated rings); the tcp transport
 * moves the frames they describe. docs/transport.md, "Algorithms and costs". */
#include "rtp-comm.h"

void rtp_comm_block(size_t count, int n, int i, size_t *first, size_t *len) {
  if (n < 1) n = 1;
  size_t q = count / (size_t)n, rem = count % (size_t)n, ui = (size_t)i;
  if (first) *first = ui * q + (ui < rem ? ui : rem);
  if (len) *len = q + (ui < rem ? 1 : 0);
}

static int imod(int a, int n) {
  int m = a % n;
  return m < 0 ? m + n : m;
}

static uint64_t ceil_div(uint64_t a, uint64_t b) {
  return a / b + (a % b != 0);
}

static bool ring_kind(int kind) {
  return kind == RTP_COMM_K_ALLREDUCE || kind == RTP_COMM_K_REDUCE_SCATTER ||
         kind == RTP_COMM_K_ALLGATHER || kind == RTP_COMM_K_BARRIER;
}

/* Reduce-scatter leaves rank r with block r; all-gather starts from it, so an all-reduce
 * is the two in a row. */
int rtp__coll_ring_block(int kind, int rank, int n, bool tx, int s, bool *reduce) {
  bool rs = kind == RTP_COMM_K_REDUCE_SCATTER || (kind == RTP_COMM_K_ALLREDUCE && s < n - 1);
  *reduce = rs && !tx;
  if (rs) return imod(tx ? rank - s - 1 : rank - s - 2, n);
  if (kind == RTP_COMM_K_ALLREDUCE) s -= n - 1;
  return imod(tx ? rank - s : rank - s - 1, n);
}

/* Ring collectives and the broadcast's chain send to rank + 1 and receive from rank - 1.
 * The broadcast's root also "receives" (nothing) from its left neighbour, whose empty
 * send then waits for the root's ready-to-receive: the root has posted. */
void rtp__coll_peers(const struct rtp_comm_op *op, int *to, int *from) {
  if (op->kind == RTP_COMM_K_P2P) {
    *to = op->dst;
    *from = op->src;
    return;
  }
  *to = (op->rank + 1) % op->size;
  *from = imod(op->rank - 1, op->size);
}

static uint64_t leg_total(const struct rtp_comm_op *op, const struct rtp_coll_plan *p,
                          bool tx) {
  if (op->kind == RTP_COMM_K_P2P) return tx ? op->sbytes : op->rbytes;
  if (op->kind == RTP_COMM_K_BROADCAST) return p->nframes[tx ? 0 : 1] ? op->count : 0;
  uint64_t total = 0;
  for (int s = 0; s < p->steps; s++) {
    bool red;
    size_t len;
    int b = rtp__coll_ring_block(op->kind, op->rank, op->size, tx, s, &red);
    rtp_comm_block(op->count, op->size, b, NULL, &len);
    total += len * op->esize;
  }
  return total;
}

void rtp__coll_plan(const struct rtp_comm_op *op, uint64_t segment, uint64_t p2p_frame,
                    struct rtp_coll_plan *p) {
  *p = (struct rtp_coll_plan){.dep = -1, .p2p_frame = p2p_frame};
  int n = op->size;
  if (op->kind == RTP_COMM_K_P2P) { /* an empty message is one empty frame */
    if (op->dst >= 0) p->nframes[0] = op->sbytes ? ceil_div(op->sbytes, p2p_frame) : 1;
    if (op->src >= 0) p->nframes[1] = op->rbytes ? ceil_div(op->rbytes, p2p_frame) : 1;
  } else if (op->kind == RTP_COMM_K_BROADCAST) {
    p->nseg = op->count ? ceil_div(op->count, segment) : 1;
    p->nframes[0] = (op->rank + 1) % n != op->root ? p->nseg : 0;
    p->nframes[1] = op->rank != op->root ? p->nseg : 0;
    p->dep = op->rank == op->root ? -1 : 0;
  } else if (ring_kind(op->kind)) {
    p->steps = op->kind == RTP_COMM_K_ALLREDUCE ? 2 * (n - 1) : n - 1;
    uint64_t largest = ceil_div(op->count, (uint64_t)n) * op->esize;
    p->nseg = largest ? ceil_div(largest, segment) : 1;
    p->nframes[0] = p->nframes[1] = (uint64_t)p->steps * p->nseg;
    p->dep = (int64_t)p->nseg;
  }
  p->total[0] = leg_total(op, p, true);
  p->total[1] = leg_total(op, p, false);
}

void rtp__coll_frame(const struct rtp_comm_op *op, const struct rtp_coll_plan *p, bool tx,
                     uint64_t k, uint64_t *offset, uint64_t *len, bool *reduce) {
  *reduce = false;
  if (op->kind == RTP_COMM_K_P2P) {
    uint64_t n = tx ? op->sbytes : op->rbytes, off = k * p->p2p_frame;
    *offset = off;
    *len = n - off < p->p2p_frame ? n - off : p->p2p_frame;
    return;
  }
  if (op->kind == RTP_COMM_K_BROADCAST) {
    size_t first, l;
    rtp_comm_block(op->count, (int)p->nseg, (int)k, &first, &l);
    *offset = first;
    *len = l;
    return;
  }
  int s = (int)(k / p->nseg);
  uint64_t j = k % p->nseg;
  int b = rtp__coll_ring_block(op->kind, op->rank, op->size, tx, s, reduce);
  size_t bf, bl, sf, sl;
  rtp_comm_block(op->count, op->size, b, &bf, &bl);
  rtp_comm_block(bl, (int)p->nseg, (int)j, &sf, &sl);
  *offset = (bf + sf) * op->esize;
  *len = sl * op->esize;
}
