// test-coll.cpp - collective geometry (rtp-coll.c) on simulated rings: every rank's plan
// and frames, moved in any order their dependencies allow, must give each collective's
// result, and both ends of every link must agree on every frame.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "rtp-comm.h"

namespace {

struct Rank {
  rtp_comm_op op{};
  rtp_coll_plan plan{};
  std::vector<uint8_t> buf, sbuf;
  uint64_t tx_next = 0, rx_next = 0;
};

// N ranks of one operation, frames moved from each rank to the one it sends to, in a
// random order of ranks each round, until every leg is done; false on a deadlock or a
// disagreement (reported with EXPECTs).
bool run_ring(std::vector<Rank> &rk, uint64_t segment, uint64_t p2p_frame, unsigned seed) {
  int n = (int)rk.size();
  for (Rank &r : rk) rtp__coll_plan(&r.op, segment, p2p_frame, &r.plan);
  std::vector<int> to(n), from(n);
  for (int r = 0; r < n; r++) rtp__coll_peers(&rk[r].op, &to[r], &from[r]);
  for (int r = 0; r < n; r++) {
    if (rk[r].plan.nframes[0] == 0) continue;
    int q = to[r];
    EXPECT_EQ(from[q], r) << "rank " << r << " sends to " << q;
    EXPECT_EQ(rk[r].plan.nframes[0], rk[q].plan.nframes[1]) << r << " -> " << q;
    EXPECT_EQ(rk[r].plan.total[0], rk[q].plan.total[1]) << r << " -> " << q;
  }
  std::mt19937 rng(seed);
  std::vector<int> order(n);
  for (int i = 0; i < n; i++) order[i] = i;
  for (;;) {
    bool moved = false, all_done = true;
    std::shuffle(order.begin(), order.end(), rng);
    for (int r : order) {
      Rank &s = rk[r];
      if (s.tx_next == s.plan.nframes[0]) continue;
      all_done = false;
      uint64_t k = s.tx_next;
      if (s.plan.dep >= 0 && k >= (uint64_t)s.plan.dep && s.rx_next <= k - s.plan.dep) continue;
      Rank &d = rk[to[r]];
      EXPECT_EQ(d.rx_next, k);
      uint64_t so, sl, ro, rl;
      bool sred, rred;
      rtp__coll_frame(&s.op, &s.plan, true, k, &so, &sl, &sred);
      rtp__coll_frame(&d.op, &d.plan, false, k, &ro, &rl, &rred);
      EXPECT_EQ(sl, rl) << "frame " << k << " of " << r << " -> " << to[r];
      if (sl != rl) return false;
      const uint8_t *src =
          (s.op.kind == RTP_COMM_K_P2P ? s.sbuf.data() : s.buf.data()) + (sl ? so : 0);
      uint8_t *dst = d.buf.data() + (rl ? ro : 0);
      if (rred) {
        for (uint64_t i = 0; i < rl / 4; i++) {
          float a, b;
          memcpy(&a, dst + 4 * i, 4);
          memcpy(&b, src + 4 * i, 4);
          a += b;
          memcpy(dst + 4 * i, &a, 4);
        }
      } else if (rl) {
        memcpy(dst, src, rl);
      }
      s.tx_next++;
      d.rx_next++;
      moved = true;
    }
    for (Rank &r : rk) all_done = all_done && r.rx_next == r.plan.nframes[1];
    if (all_done) return true;
    if (!moved) {
      ADD_FAILURE() << "deadlock";
      return false;
    }
  }
}

std::vector<Rank> make(int n, int kind, uint64_t count, uint64_t esize, int root = 0) {
  std::vector<Rank> rk(n);
  for (int r = 0; r < n; r++) {
    rtp_comm_op &op = rk[r].op;
    op.kind = kind;
    op.count = count;
    op.esize = esize;
    op.root = root;
    op.dst = op.src = -1;
    op.rank = r;
    op.size = n;
    rk[r].buf.assign(count * esize + 1, 0);
  }
  return rk;
}

float value(int rank, uint64_t i) {
  return (float)(rank * 1000 + (int)(i % 997));
}

const uint64_t kCounts[] = {0, 1, 7, 1001, 4099};
const uint64_t kSegments[] = {16, 64, 1 << 20};

TEST(Coll, RingBlocksMeet) {
  for (int kind : {RTP_COMM_K_ALLREDUCE, RTP_COMM_K_REDUCE_SCATTER, RTP_COMM_K_ALLGATHER})
    for (int n = 2; n <= 7; n++) {
      int steps = kind == RTP_COMM_K_ALLREDUCE ? 2 * (n - 1) : n - 1;
      for (int s = 0; s < steps; s++)
        for (int r = 0; r < n; r++) {
          bool red_tx, red_rx;
          int tx = rtp__coll_ring_block(kind, r, n, true, s, &red_tx);
          int rx = rtp__coll_ring_block(kind, (r + 1) % n, n, false, s, &red_rx);
          EXPECT_EQ(tx, rx) << "kind " << kind << " n " << n << " step " << s << " rank " << r;
          EXPECT_FALSE(red_tx);
        }
    }
}

TEST(Coll, AllReduce) {
  for (int n = 2; n <= 7; n++)
    for (uint64_t count : kCounts)
      for (uint64_t seg : kSegments) {
        auto rk = make(n, RTP_COMM_K_ALLREDUCE, count, 4);
        for (int r = 0; r < n; r++)
          for (uint64_t i = 0; i < count; i++) {
            float v = value(r, i);
            memcpy(&rk[r].buf[4 * i], &v, 4);
          }
        ASSERT_TRUE(run_ring(rk, seg, 1 << 20, (unsigned)(n * 31 + count)));
        for (int r = 0; r < n; r++)
          for (uint64_t i = 0; i < count; i++) {
            float want = 0, got;
            for (int q = 0; q < n; q++) want += value(q, i);
            memcpy(&got, &rk[r].buf[4 * i], 4);
            ASSERT_EQ(got, want) << "n " << n << " count " << count << " rank " << r << " ["
                                 << i << "]";
          }
      }
}

TEST(Coll, ReduceScatter) {
  for (int n = 2; n <= 7; n++)
    for (uint64_t count : kCounts)
      for (uint64_t seg : kSegments) {
        auto rk = make(n, RTP_COMM_K_REDUCE_SCATTER, count, 4);
        for (int r = 0; r < n; r++)
          for (uint64_t i = 0; i < count; i++) {
            float v = value(r, i);
            memcpy(&rk[r].buf[4 * i], &v, 4);
          }
        ASSERT_TRUE(run_ring(rk, seg, 1 << 20, (unsigned)(n + count)));
        for (int r = 0; r < n; r++) {
          size_t first, len;
          rtp_comm_block(count, n, r, &first, &len);
          for (uint64_t i = first; i < first + len; i++) {
            float want = 0, got;
            for (int q = 0; q < n; q++) want += value(q, i);
            memcpy(&got, &rk[r].buf[4 * i], 4);
            ASSERT_EQ(got, want) << "n " << n << " count " << count << " rank " << r;
          }
        }
      }
}

TEST(Coll, AllGather) {
  for (int n = 2; n <= 7; n++)
    for (uint64_t count : kCounts)
      for (uint64_t esize : {(uint64_t)1, (uint64_t)3, (uint64_t)8})
        for (uint64_t seg : kSegments) {
          auto rk = make(n, RTP_COMM_K_ALLGATHER, count, esize);
          for (int r = 0; r < n; r++) {
            size_t first, len;
            rtp_comm_block(count, n, r, &first, &len);
            for (uint64_t b = first * esize; b < (first + len) * esize; b++)
              rk[r].buf[b] = (uint8_t)(b * 7 + 1);
          }
          ASSERT_TRUE(run_ring(rk, seg, 1 << 20, (unsigned)(n * esize + count)));
          for (int r = 0; r < n; r++)
            for (uint64_t b = 0; b < count * esize; b++)
              ASSERT_EQ(rk[r].buf[b], (uint8_t)(b * 7 + 1))
                  << "n " << n << " count " << count << " esize " << esize << " rank " << r;
        }
}

TEST(Coll, Broadcast) {
  for (int n = 2; n <= 6; n++)
    for (int root = 0; root < n; root++)
      for (uint64_t count : kCounts)
        for (uint64_t seg : kSegments) {
          auto rk = make(n, RTP_COMM_K_BROADCAST, count, 1, root);
          for (uint64_t b = 0; b < count; b++) rk[root].buf[b] = (uint8_t)(b * 13 + 5);
          ASSERT_TRUE(run_ring(rk, seg, 1 << 20, (unsigned)(root + count)));
          for (int r = 0; r < n; r++) {
            for (uint64_t b = 0; b < count; b++)
              ASSERT_EQ(rk[r].buf[b], (uint8_t)(b * 13 + 5))
                  << "root " << root << " rank " << r;
            EXPECT_EQ(rk[r].plan.nframes[1], r == root ? 0u : rk[r].plan.nseg);
          }
        }
}

// The barrier moves no bytes, and every rank's last step waits for word from all others.
TEST(Coll, Barrier) {
  for (int n = 2; n <= 7; n++) {
    auto rk = make(n, RTP_COMM_K_BARRIER, 0, 1);
    ASSERT_TRUE(run_ring(rk, 1 << 20, 1 << 20, (unsigned)n));
    for (Rank &r : rk) {
      EXPECT_EQ(r.plan.nframes[0], (uint64_t)(n - 1));
      EXPECT_EQ(r.plan.total[0], 0u);
    }
  }
}

// A message is cut into frames of p2p_frame bytes that tile it exactly (an empty one is
// one empty frame).
TEST(Coll, PointToPoint) {
  const uint64_t frame = 64;
  for (uint64_t bytes : {(uint64_t)0, (uint64_t)1, frame - 1, frame, frame + 1, 3 * frame}) {
    std::vector<Rank> rk(2);
    for (int r = 0; r < 2; r++) {
      rtp_comm_op &op = rk[r].op;
      op.kind = RTP_COMM_K_P2P;
      op.rank = r;
      op.size = 2;
      op.dst = r == 0 ? 1 : -1;
      op.src = r == 1 ? 0 : -1;
      op.sbytes = r == 0 ? bytes : 0;
      op.rbytes = r == 1 ? bytes : 0;
      rk[r].sbuf.assign(bytes + 1, 0);
      rk[r].buf.assign(bytes + 1, 0);
    }
    for (uint64_t b = 0; b < bytes; b++) rk[0].sbuf[b] = (uint8_t)(b * 3 + 2);
    ASSERT_TRUE(run_ring(rk, 1 << 20, frame, 7));
    EXPECT_EQ(rk[0].plan.nframes[0], bytes ? (bytes + frame - 1) / frame : 1);
    EXPECT_EQ(rk[1].plan.total[1], bytes);
    for (uint64_t b = 0; b < bytes; b++) ASSERT_EQ(rk[1].buf[b], (uint8_t)(b * 3 + 2));
  }
}

}  // namespace
