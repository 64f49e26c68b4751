// Communication nodes in graphs: posted by the executor, overlapped with the nodes after
// them, and waited for only where their result is read. Ranks are processes on 127.0.0.1.
#include <gtest/gtest.h>

#include <cmath>

#include "rtp.h"
#include "test-util.h"

namespace {

// Each rank rotates a vector one hop down the ring twice (two chained sendrecv nodes
// through two buffers, the second ordered after the first), while computing on the way,
// then sums a computed tensor over ranks in place.
int rank_main(int rank, int world, int port) {
  rtp_comm_params cp = rtptest::params(rank, world, port);
  rtp_comm *comm = nullptr;
  if (rtp_comm_init(&cp, &comm)) return 10;
  rtp_init_params ip = {8 << 20, nullptr, false, nullptr, 0};
  rtp_context *ctx = rtp_context_new(ip);
  const int n = 37;
  rtp_tensor *mine = rtp_tensor_new_1d(ctx, RTP_TYPE_F32, n);
  rtp_tensor *slot[2] = {rtp_tensor_new_1d(ctx, RTP_TYPE_F32, n),
                         rtp_tensor_new_1d(ctx, RTP_TYPE_F32, n)};
  for (int i = 0; i < n; i++) ((float *)mine->data)[i] = (float)(100 * rank + i);
  int left = (rank + world - 1) % world, right = (rank + 1) % world;
  rtp_tensor *hop1 = rtp_sendrecv(ctx, comm, mine, left, slot[0], right, nullptr);
  rtp_tensor *busy = rtp_gelu(ctx, rtp_scale(ctx, mine, 0.5f));  // runs during hop 1
  rtp_tensor *hop2 = rtp_sendrecv(ctx, comm, hop1, left, slot[1], right, hop1);
  rtp_tensor *got = rtp_add(ctx, rtp_scale(ctx, hop2, 2.0f), rtp_scale(ctx, busy, 0.0f));
  rtp_tensor *summed = rtp_allreduce(ctx, comm, got, nullptr);
  rtp_tensor *out = rtp_scale(ctx, summed, 1.0f);
  rtp_tensor_set_output(out);
  rtp_graph *g = rtp_graph_new(ctx, 64);
  if (rtp_graph_build(g, out) || rtp_graph_plan(ctx, g)) return 11;
  rtp_threadpool *tp = rtp_threadpool_new(2);
  for (int rep = 0; rep < 3; rep++) {
    if (rtp_graph_compute(g, tp)) {
      fprintf(stderr, "rank %d: %s\n", rank, rtp_last_error());
      return 12;
    }
    int from = (rank + 2) % world;  // two hops down the ring
    for (int i = 0; i < n; i++) {
      float want_hop = (float)(100 * from + i);
      if (((float *)hop2->data)[i] != want_hop) return 13;
      float want = 0;  // sum over ranks of 2 * (what each got)
      for (int r = 0; r < world; r++) want += 2.0f * (float)(100 * ((r + 2) % world) + i);
      if (std::fabs(((float *)out->data)[i] - want) > 1e-3f) return 14;
    }
  }
  rtp_threadpool_free(tp);
  rtp_context_free(ctx);
  rtp_comm_free(comm);
  return 0;
}

TEST(CommGraph, RotateAndAllReduce) {
  for (int world : {1, 2, 3}) {
    int port = rtptest::free_port();
    auto res = rtptest::run_procs(
        world, [&](int r) { return rank_main(r, world, port); }, 60);
    for (int r = 0; r < world; r++)
      EXPECT_EQ(res[r].code, 0) << "world " << world << " rank " << r;
  }
}

// A three-stage pipeline of one-way transfers: rank 0 sends 2x to rank 1, which adds 1
// and sends the result on to rank 2 while it computes something else; rank 2 multiplies
// by 3 and sends that back to rank 0 over a group of ranks {0, 2} (group ranks 0 and 1).
int pipe_main(int rank, int port) {
  rtp_comm_params cp = rtptest::params(rank, 3, port);
  rtp_comm *comm = nullptr, *ends = nullptr;
  if (rtp_comm_init(&cp, &comm)) return 10;
  if (rtp_comm_split(comm, rank == 1 ? RTP_COMM_UNDEFINED : 0, rank, &ends)) return 10;
  rtp_init_params ip = {8 << 20, nullptr, false, nullptr, 0};
  rtp_context *ctx = rtp_context_new(ip);
  const int n = 1000;
  rtp_tensor *x = rtp_tensor_new_1d(ctx, RTP_TYPE_F32, n);
  rtp_tensor *buf = rtp_tensor_new_1d(ctx, RTP_TYPE_F32, n);
  rtp_tensor_set_input(x);
  rtp_tensor *out = nullptr;
  if (rank == 0) {
    rtp_tensor *sent = rtp_send(ctx, comm, rtp_scale(ctx, x, 2.0f), 1, nullptr);
    rtp_tensor *back = rtp_recv(ctx, ends, buf, 1, nullptr);
    out = rtp_add(ctx, back, rtp_scale(ctx, sent, 0.0f));
  } else if (rank == 1) {
    rtp_tensor *got = rtp_recv(ctx, comm, buf, 0, nullptr);
    rtp_tensor *sent =
        rtp_send(ctx, comm, rtp_add(ctx, got, rtp_scale(ctx, got, 0.0f)), 2, nullptr);
    rtp_tensor *plus = rtp_scale(ctx, x, 1.0f);  // while the send runs
    out = rtp_add(ctx, rtp_scale(ctx, sent, 1.0f), plus);
  } else {
    rtp_tensor *got = rtp_recv(ctx, comm, buf, 1, nullptr);
    out = rtp_send(ctx, ends, rtp_scale(ctx, got, 3.0f), 0, nullptr);
  }
  rtp_tensor_set_output(out);
  rtp_graph *g = rtp_graph_new(ctx, 64);
  if (!out || rtp_graph_build(g, out) || rtp_graph_plan(ctx, g)) {
    fprintf(stderr, "rank %d: %s\n", rank, rtp_last_error());
    return 11;
  }
  for (int rep = 0; rep < 3; rep++) {
    for (int i = 0; i < n; i++) ((float *)x->data)[i] = (float)(i + rep + 10 * rank);
    if (rtp_graph_compute(g, nullptr)) {
      fprintf(stderr, "rank %d: %s\n", rank, rtp_last_error());
      return 12;
    }
    for (int i = 0; i < n; i++) {
      float from0 = 2.0f * (float)(i + rep), want;
      if (rank == 0)
        want = 3.0f * from0;
      else if (rank == 1)
        want = from0 + (float)(i + rep + 10);
      else
        want = 3.0f * from0;
      if (((float *)out->data)[i] != want) {
        fprintf(stderr, "rank %d rep %d [%d]: %g, want %g\n", rank, rep, i,
                ((float *)out->data)[i], want);
        return 13;
      }
    }
  }
  // one-way transfers to oneself or out of the group are refused when built
  if (rtp_send(ctx, comm, x, rank, nullptr) || rtp_recv(ctx, comm, buf, 3, nullptr)) return 14;
  if (rtp_context_error(ctx, nullptr) != RTP_EINVAL) return 15;
  rtp_context_free(ctx);
  rtp_comm_free(ends);
  rtp_comm_free(comm);
  return 0;
}

TEST(CommGraph, SendRecvPipeline) {
  int port = rtptest::free_port();
  auto res = rtptest::run_procs(
      3, [&](int r) { return pipe_main(r, port); }, 60);
  for (int r = 0; r < 3; r++) EXPECT_EQ(res[r].code, 0) << "rank " << r;
}

}  // namespace
