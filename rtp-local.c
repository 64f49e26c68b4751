/* rtp-local.c - the transport of operations that need no peer: every operation of a
 * world (or group) of one rank, and a rotation onto oneself. Each completes when it is
 * posted; a message to oneself is a copy. Also the dry transport of planning
 * communicators (rtp__comm_dry_new), which completes everything and moves nothing. */
#include "rtp-comm.h"

#include <string.h>

static void local_submit(struct rtp_transport *t, struct rtp_comm_req *r) {
  (void)t;
  const struct rtp_comm_op *op = &r->op;
  if (op->kind == RTP_COMM_K_P2P && op->sbytes && op->buf && op->sbuf && op->sbuf != op->buf)
    memmove(op->buf, op->sbuf, op->sbytes);
  rtp__comm_req_done(r, RTP_OK, NULL);
}

static void local_free(struct rtp_transport *t) {
  (void)t; /* static */
}

static const struct rtp_transport_i local_i = {
    .name = "local", .submit = local_submit, .free = local_free};

struct rtp_transport *rtp__local_transport(void) {
  static struct rtp_transport local = {&local_i, NULL};
  return &local;
}

/* Planning builds a rank's graph without the other ranks: the few operations made while
 * building (rtp_parallel_new's model check) succeed and leave their buffers as they are,
 * so every "peer" agrees with this rank. */
static void dry_submit(struct rtp_transport *t, struct rtp_comm_req *r) {
  (void)t;
  rtp__comm_req_done(r, RTP_OK, NULL);
}

static const struct rtp_transport_i dry_i = {
    .name = "dry", .submit = dry_submit, .free = local_free};

struct rtp_transport *rtp__dry_transport(void) {
  static struct rtp_transport dry = {&dry_i, NULL};
  return &dry;
}
