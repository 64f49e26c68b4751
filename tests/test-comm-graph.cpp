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
  rtp_context *ctx = rtp_init(ip);
  const int n = 37;
  rtp_tensor *mine = rtp_new_tensor_1d(ctx, RTP_TYPE_F32, n);
  rtp_tensor *slot[2] = {rtp_new_tensor_1d(ctx, RTP_TYPE_F32, n),
                         rtp_new_tensor_1d(ctx, RTP_TYPE_F32, n)};
  for (int i = 0; i < n; i++) ((float *)mine->data)[i] = (float)(100 * rank + i);
  int left = (rank + world - 1) % world, right = (rank + 1) % world;
  rtp_tensor *hop1 = rtp_sendrecv(ctx, comm, mine, left, slot[0], right, nullptr);
  rtp_tensor *busy = rtp_gelu(ctx, rtp_scale(ctx, mine, 0.5f));  // runs during hop 1
  rtp_tensor *hop2 = rtp_sendrecv(ctx, comm, hop1, left, slot[1], right, hop1);
  rtp_tensor *got = rtp_add(ctx, rtp_scale(ctx, hop2, 2.0f), rtp_scale(ctx, busy, 0.0f));
  rtp_tensor *summed = rtp_allreduce(ctx, comm, got, nullptr);
  rtp_tensor *out = rtp_scale(ctx, summed, 1.0f);
  rtp_set_output(out);
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
  rtp_free(ctx);
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

}  // namespace
