// test-comm-group.cpp - communicator groups (rtp_comm_split, rtp_comm_mesh_2d): ranks and
// members as MPI's split gives them, collectives and rotations on the rows and columns of
// a 2 x 2 mesh running at the same time and equal, bit for bit, to the same collectives on
// separate flat communicators, and a lost rank failing every group of the job.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "test-util.h"

using namespace rtptest;

namespace {

float value(int rank, size_t i) {
  return (float)rank * 0.25f + (float)(i % 29) * 1.5f + 0.125f;
}

// What each collective of the test gives, on one communicator: the all-reduce of 1001
// floats, the all-gather of 4099 floats (each rank's block filled), a rotation of 777
// floats to the next rank, and a broadcast of 5000 bytes from the last rank.
struct Results {
  std::vector<float> sum, gathered, rotated;
  std::vector<uint8_t> bcast;
};

// Posts the collectives on c (all at once, waited for at the end); ident: the rank's
// identity in the data (its world rank), so that the flat and the group runs compare.
int post_all(int rank, rtp_comm *c, int ident, Results *out,
             std::vector<rtp_comm_req *> *reqs) {
  int n = rtp_comm_size(c), me = rtp_comm_rank(c);
  out->sum.resize(1001);
  for (size_t i = 0; i < out->sum.size(); i++) out->sum[i] = value(ident, i);
  out->gathered.assign(4099, -1.0f);
  size_t first, len;
  rtp_comm_block(out->gathered.size(), n, me, &first, &len);
  for (size_t i = first; i < first + len; i++) out->gathered[i] = value(ident, i);
  out->rotated.assign(777, 0.0f);
  out->bcast.assign(5000, 0);
  if (me == n - 1)
    for (size_t i = 0; i < out->bcast.size(); i++) out->bcast[i] = (uint8_t)(i * 7 + ident);
  rtp_comm_req *r;
  CHECK_OK(rtp_comm_allreduce(c, out->sum.data(), out->sum.size(), &r));
  reqs->push_back(r);
  CHECK_OK(rtp_comm_allgather(c, out->gathered.data(), out->gathered.size(), 4, &r));
  reqs->push_back(r);
  CHECK_OK(rtp_comm_broadcast(c, out->bcast.data(), out->bcast.size(), n - 1, &r));
  reqs->push_back(r);
  return 0;
}

int rotate(int rank, rtp_comm *c, int ident, Results *out) {
  int n = rtp_comm_size(c), me = rtp_comm_rank(c);
  std::vector<float> mine(777);
  for (size_t i = 0; i < mine.size(); i++) mine[i] = value(ident, i) + 7.0f;
  CHECK_OK(rtp_comm_sendrecv(c, mine.data(), mine.size() * 4, (me + 1) % n, out->rotated.data(),
                             out->rotated.size() * 4, (me + n - 1) % n, nullptr));
  return 0;
}

int wait_all(int rank, std::vector<rtp_comm_req *> &reqs) {
  for (rtp_comm_req *r : reqs) CHECK_OK(rtp_comm_wait(r));
  reqs.clear();
  return 0;
}

// Appends v's bytes to a rank's results file, which the parent compares.
template <class T>
void emit(FILE *f, const std::vector<T> &v) {
  if (fwrite(v.data(), sizeof(T), v.size(), f) != v.size()) _exit(20);
}

std::vector<uint8_t> slurp(const std::string &path) {
  std::vector<uint8_t> all;
  FILE *f = fopen(path.c_str(), "rb");
  if (!f) return all;
  uint8_t buf[65536];
  for (size_t k; (k = fread(buf, 1, sizeof(buf), f)) > 0;) all.insert(all.end(), buf, buf + k);
  fclose(f);
  return all;
}

TEST(CommGroup, SplitRanksAndMembers) {
  int port = free_port();
  auto res = run_procs(5, [&](int rank) {
    rtp_comm_params p = params(rank, 5, port, 20000);
    rtp_comm *c;
    CHECK_OK(rtp_comm_init(&p, &c));
    // colors: {0, 2, 4} -> 0, {1, 3} -> 1; keys reverse the order within a color
    rtp_comm *g = nullptr;
    CHECK_OK(rtp_comm_split(c, rank % 2, 10 - rank, &g));
    CHECK(g, "no group");
    int want_size = rank % 2 ? 2 : 3;
    CHECK(rtp_comm_size(g) == want_size, "size %d", rtp_comm_size(g));
    std::vector<int> members = rank % 2 ? std::vector<int>{3, 1} : std::vector<int>{4, 2, 0};
    for (int i = 0; i < want_size; i++)
      CHECK(rtp_comm_world_rank(g, i) == members[i], "member %d is %d", i,
            rtp_comm_world_rank(g, i));
    CHECK(rtp_comm_world_rank(g, rtp_comm_rank(g)) == rank, "own rank");
    CHECK(rtp_comm_world_rank(g, want_size) == -1, "out of range");
    // a rank outside every group takes part and gets NULL
    rtp_comm *h = nullptr;
    CHECK_OK(rtp_comm_split(c, rank == 2 ? RTP_COMM_UNDEFINED : 0, rank, &h));
    CHECK((h == nullptr) == (rank == 2), "undefined color");
    if (h) {
      CHECK(rtp_comm_size(h) == 4, "size %d", rtp_comm_size(h));
      float x = (float)rank;
      CHECK_OK(rtp_comm_allreduce(h, &x, 1, nullptr));
      CHECK(x == 0 + 1 + 3 + 4, "sum %g", x);
    }
    // a group of a group, and the parent still works after
    rtp_comm *gg = nullptr;
    CHECK_OK(rtp_comm_split(g, 0, rtp_comm_rank(g), &gg));
    float y = 1;
    CHECK_OK(rtp_comm_allreduce(gg, &y, 1, nullptr));
    CHECK(y == (float)want_size, "nested sum %g", y);
    float z = 1;
    CHECK_OK(rtp_comm_allreduce(c, &z, 1, nullptr));
    CHECK(z == 5, "world sum %g", z);
    rtp_comm *bad = nullptr;
    CHECK(rtp_comm_split(c, -2, 0, &bad) == RTP_EINVAL && !bad, "color -2 accepted");
    rtp_comm *row = nullptr, *col = nullptr;
    CHECK(rtp_comm_mesh_2d(c, 2, 2, &row, &col) == RTP_EINVAL && !row && !col,
          "2 x 2 of 5 accepted");
    rtp_comm_free(gg);
    rtp_comm_free(h);
    rtp_comm_free(c);  // the world first: the groups keep the connections
    float w = 1;
    CHECK_OK(rtp_comm_allreduce(g, &w, 1, nullptr));
    rtp_comm_free(g);
    return 0;
  });
  for (int i = 0; i < 5; i++) EXPECT_EQ(res[i].code, 0) << "rank " << i;
}

// Rows {0, 1}, {2, 3} and columns {0, 2}, {1, 3} of a 2 x 2 mesh: every collective on a
// row and on a column at the same time, then rotations; the same again on four separate
// flat 2-rank communicators. Both runs must give the same bytes.
TEST(CommGroup, MeshEqualsFlat) {
  std::string base = "/tmp/rtp-test-group-" + std::to_string(getpid()) + "-";
  int port = free_port(), row_ports[2] = {free_port(), free_port()},
      col_ports[2] = {free_port(), free_port()};
  auto res = run_procs(4, [&](int rank) {
    int r = rank / 2, cidx = rank % 2;
    Results mesh_row, mesh_col, flat_row, flat_col;
    std::vector<rtp_comm_req *> reqs;
    {
      rtp_comm_params p = params(rank, 4, port, 20000);
      rtp_comm *c, *row, *col;
      CHECK_OK(rtp_comm_init(&p, &c));
      CHECK_OK(rtp_comm_mesh_2d(c, 2, 2, &row, &col));
      CHECK(rtp_comm_size(row) == 2 && rtp_comm_rank(row) == cidx, "row rank");
      CHECK(rtp_comm_size(col) == 2 && rtp_comm_rank(col) == r, "column rank");
      if (post_all(rank, row, rank, &mesh_row, &reqs)) return 12;
      if (post_all(rank, col, rank, &mesh_col, &reqs)) return 12;
      if (wait_all(rank, reqs)) return 13;
      if (rotate(rank, row, rank, &mesh_row) || rotate(rank, col, rank, &mesh_col)) return 14;
      rtp_comm_free(row);
      rtp_comm_free(col);
      rtp_comm_free(c);
    }
    {
      rtp_comm_params pr = params(cidx, 2, row_ports[r], 20000);
      rtp_comm_params pc = params(r, 2, col_ports[cidx], 20000);
      rtp_comm *row, *col;
      // rank 0 of each flat comm joins first: the other joins as soon as it listens
      CHECK_OK(rtp_comm_init(cidx == 0 ? &pr : &pc, cidx == 0 ? &row : &col));
      CHECK_OK(rtp_comm_init(cidx == 0 ? &pc : &pr, cidx == 0 ? &col : &row));
      if (post_all(rank, row, rank, &flat_row, &reqs)) return 12;
      if (post_all(rank, col, rank, &flat_col, &reqs)) return 12;
      if (wait_all(rank, reqs)) return 13;
      if (rotate(rank, row, rank, &flat_row) || rotate(rank, col, rank, &flat_col)) return 14;
      rtp_comm_free(row);
      rtp_comm_free(col);
    }
    FILE *f = fopen((base + std::to_string(rank)).c_str(), "wb");
    CHECK(f, "results file");
    for (Results *x : {&mesh_row, &mesh_col, &flat_row, &flat_col}) {
      emit(f, x->sum);
      emit(f, x->gathered);
      emit(f, x->rotated);
      emit(f, x->bcast);
    }
    fclose(f);
    return 0;
  });
  for (int i = 0; i < 4; i++) {
    std::vector<uint8_t> all = slurp(base + std::to_string(i));
    unlink((base + std::to_string(i)).c_str());
    EXPECT_EQ(res[i].code, 0) << "rank " << i;
    ASSERT_EQ(all.size() % 4, 0u);
    size_t quarter = all.size() / 4;
    ASSERT_GT(quarter, 0u) << "rank " << i;
    EXPECT_TRUE(std::equal(all.begin(), all.begin() + quarter, all.begin() + 2 * quarter))
        << "rank " << i << ": the row's results differ from a flat communicator's";
    EXPECT_TRUE(
        std::equal(all.begin() + quarter, all.begin() + 2 * quarter, all.begin() + 3 * quarter))
        << "rank " << i << ": the column's results differ from a flat communicator's";
  }
}

// Rank 3 is killed while every group has an operation pending: the other ranks' world, row and
// column communicators all fail, within the timeout, naming rank 3.
TEST(CommGroup, LostRankFailsEveryGroup) {
  int port = free_port();
  const int timeout_ms = 4000;
  auto res = run_procs(
      4,
      [&](int rank) {
        rtp_comm_params p = params(rank, 4, port, timeout_ms);
        rtp_comm *c, *row, *col;
        CHECK_OK(rtp_comm_init(&p, &c));
        CHECK_OK(rtp_comm_mesh_2d(c, 2, 2, &row, &col));
        CHECK_OK(rtp_comm_barrier(c, nullptr));
        if (rank == 3) {
          usleep(200000);
          kill(getpid(), SIGKILL);  // no goodbye: the others see the connection drop
        }
        double t0 = now_s();
        std::vector<float> a(1000, 1.0f), b(1000, 1.0f), w(1000, 1.0f);
        rtp_comm_req *ra, *rb;
        CHECK_OK(rtp_comm_allreduce(row, a.data(), a.size(), &ra));
        CHECK_OK(rtp_comm_allreduce(col, b.data(), b.size(), &rb));
        int st_w = rtp_comm_allreduce(c, w.data(), w.size(), nullptr);
        std::string msg_w = rtp_last_error();
        int st_a = rtp_comm_wait(ra), st_b = rtp_comm_wait(rb);
        double dt = now_s() - t0;
        // rank 0's row and column are {0, 1} and {0, 2}: without rank 3, but the job failed
        fprintf(stderr, "rank %d after %.2f s: world %d, row %d, col %d: %s\n", rank, dt, st_w,
                st_a, st_b, msg_w.c_str());
        CHECK(st_w != RTP_OK, "the world's allreduce succeeded");
        CHECK(contains(msg_w, "rank 3"), "message: %s", msg_w.c_str());
        CHECK(dt < 2.0 * timeout_ms / 1000, "took %.2f s", dt);
        const char *m;
        for (rtp_comm *g : {row, col, c}) {
          CHECK(rtp_comm_status(g, &m) != RTP_OK, "a group did not fail");
          CHECK(contains(m, "rank 3"), "group message: %s", m);
          float x = 1;
          CHECK(rtp_comm_allreduce(g, &x, 1, nullptr) != RTP_OK, "a later operation succeeded");
        }
        rtp_comm_free(row);
        rtp_comm_free(col);
        rtp_comm_free(c);
        return 0;
      },
      60);
  for (int i = 0; i < 3; i++) EXPECT_EQ(res[i].code, 0) << "rank " << i;
  EXPECT_EQ(res[3].code, -SIGKILL);
}

}  // namespace
