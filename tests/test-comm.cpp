// test-comm.cpp - every rtp_comm operation, with real processes joined over TCP on
// 127.0.0.1 (world sizes 1-5, odd counts, checked element by element), and the local
// backend.
#include <gtest/gtest.h>
#include <cstring>
#include <unistd.h>
#include <sstream>
#include <set>
#include <fstream>
#include <dirent.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "test-util.h"

using namespace rtptest;

namespace {

float pattern(int rank, size_t i) {
  return (float)(rank + 1) + (float)(i % 13);
}

// Every collective with several counts; the sums are integers, so exact.
int check_collectives(rtp_comm *c) {
  int rank = rtp_comm_rank(c), n = rtp_comm_size(c);
  const size_t counts[] = {0, 1, 7, 1001, (1u << 20) + 3};
  for (size_t count : counts) {
    std::vector<float> b(count);
    for (size_t i = 0; i < count; i++) b[i] = pattern(rank, i);
    CHECK_OK(rtp_comm_allreduce(c, b.data(), count, nullptr));
    for (size_t i = 0; i < count; i++) {
      float want = 0;
      for (int q = 0; q < n; q++) want += pattern(q, i);
      CHECK(b[i] == want, "allreduce count %zu [%zu] = %g, want %g", count, i, b[i], want);
    }
    for (size_t i = 0; i < count; i++) b[i] = pattern(rank, i);
    CHECK_OK(rtp_comm_reduce_scatter(c, b.data(), count, nullptr));
    size_t first, len;
    rtp_comm_block(count, n, rank, &first, &len);
    for (size_t i = first; i < first + len; i++) {
      float want = 0;
      for (int q = 0; q < n; q++) want += pattern(q, i);
      CHECK(b[i] == want, "reduce_scatter count %zu [%zu] = %g, want %g", count, i, b[i], want);
    }
    // all-gather with 3-byte elements: odd sizes everywhere
    std::vector<uint8_t> g(count * 3, 0xee);
    for (size_t i = first * 3; i < (first + len) * 3; i++) g[i] = (uint8_t)(i * 7 + 1);
    CHECK_OK(rtp_comm_allgather(c, g.data(), count, 3, nullptr));
    for (size_t i = 0; i < count * 3; i++)
      CHECK(g[i] == (uint8_t)(i * 7 + 1), "allgather count %zu byte %zu", count, i);
    // broadcast from the last rank and from rank 0
    for (int root : {n - 1, 0}) {
      std::vector<uint8_t> bb(count + 5, 0);
      if (rank == root)
        for (size_t i = 0; i < bb.size(); i++) bb[i] = (uint8_t)(i * 31 + root);
      CHECK_OK(rtp_comm_broadcast(c, bb.data(), bb.size(), root, nullptr));
      for (size_t i = 0; i < bb.size(); i++)
        CHECK(bb[i] == (uint8_t)(i * 31 + root), "broadcast %zu from %d [%zu]", count, root, i);
    }
  }
  CHECK_OK(rtp_comm_barrier(c, nullptr));
  return 0;
}

// The RTP rotation: every rank starts with its own (uneven) block of a tensor and passes
// blocks to rank r-1 while receiving from r+1; after k hops it holds block (r+k) mod n.
int check_rotation(rtp_comm *c, size_t count) {
  int rank = rtp_comm_rank(c), n = rtp_comm_size(c);
  auto block = [&](int b) { return rotation_block(count, n, b); };
  std::vector<float> held = block(rank);
  for (int k = 1; k < n + 1; k++) {
    int s = (rank + k) % n;
    size_t len;
    rtp_comm_block(count, n, s, nullptr, &len);
    std::vector<float> next(len);
    rtp_comm_req *req;
    CHECK_OK(rtp_comm_sendrecv(c, held.data(), held.size() * 4, (rank + n - 1) % n, next.data(),
                               len * 4, (rank + 1) % n, &req));
    CHECK_OK(rtp_comm_wait(req));
    CHECK(next == block(s), "rotation hop %d: block %d differs", k, s);
    held.swap(next);
  }
  return 0;
}

// Point-to-point between every pair, all posted at once, odd sizes.
int check_p2p(rtp_comm *c) {
  int rank = rtp_comm_rank(c), n = rtp_comm_size(c);
  std::vector<std::vector<uint8_t>> out(n), in(n);
  std::vector<rtp_comm_req *> reqs;
  for (int q = 0; q < n; q++) {
    if (q == rank) continue;
    size_t sz = (size_t)(rank * n + q) * 1001 + 3;
    out[q].resize(sz);
    for (size_t i = 0; i < sz; i++) out[q][i] = (uint8_t)(i + rank * 7 + q);
    in[q].resize((size_t)(q * n + rank) * 1001 + 3);
    rtp_comm_req *r;
    CHECK_OK(rtp_comm_recv(c, in[q].data(), in[q].size(), q, &r));
    reqs.push_back(r);
    CHECK_OK(rtp_comm_send(c, out[q].data(), sz, q, &r));
    reqs.push_back(r);
  }
  for (auto *r : reqs) CHECK_OK(rtp_comm_wait(r));
  for (int q = 0; q < n; q++) {
    if (q == rank) continue;
    for (size_t i = 0; i < in[q].size(); i++)
      CHECK(in[q][i] == (uint8_t)(i + q * 7 + rank), "p2p from %d byte %zu", q, i);
  }
  return 0;
}

// Several operations in flight at once, waited for in reverse order, one of them from
// another thread.
int check_overlap(rtp_comm *c) {
  int rank = rtp_comm_rank(c), n = rtp_comm_size(c);
  const size_t count = 300001;
  std::vector<float> a(count), g(count);
  for (size_t i = 0; i < count; i++) a[i] = pattern(rank, i);
  size_t first, len;
  rtp_comm_block(count, n, rank, &first, &len);
  for (size_t i = first; i < first + len; i++) g[i] = (float)i;
  std::vector<float> rot_in(1000), rot_out(1000, (float)rank);
  rtp_comm_req *ra, *rg, *rr, *rb;
  CHECK_OK(rtp_comm_allreduce(c, a.data(), count, &ra));
  CHECK_OK(rtp_comm_sendrecv(c, rot_out.data(), 4000, (rank + 1) % n, rot_in.data(), 4000,
                             (rank + n - 1) % n, &rr));
  CHECK_OK(rtp_comm_allgather(c, g.data(), count, 4, &rg));
  CHECK_OK(rtp_comm_barrier(c, &rb));
  int thread_st = -100;
  std::thread t([&] { thread_st = rtp_comm_wait(rg); });
  struct Joiner {
    std::thread &t;
    ~Joiner() {
      if (t.joinable()) t.join();
    }
  } joiner{t};
  CHECK_OK(rtp_comm_wait(rb));
  bool done = false;
  while (!done) {
    int st = rtp_comm_test(rr, &done);
    CHECK(st == RTP_OK, "test: %s", rtp_last_error());
  }
  CHECK_OK(rtp_comm_wait_for(ra, 20000));
  t.join();
  CHECK(thread_st == RTP_OK, "wait from another thread: %d", thread_st);
  for (size_t i = 0; i < count; i++) {
    float want = 0;
    for (int q = 0; q < n; q++) want += pattern(q, i);
    CHECK(a[i] == want, "overlapped allreduce [%zu]", i);
    CHECK(g[i] == (float)i, "overlapped allgather [%zu]", i);
  }
  for (float v : rot_in) CHECK(v == (float)((rank + n - 1) % n), "overlapped rotation");
  return 0;
}

// Posting and waiting from several threads at once; a pending receive does not hold up
// a collective behind it; rtp_comm_wait_for gives up without losing the request.
int check_threads(rtp_comm *c) {
  int rank = rtp_comm_rank(c), n = rtp_comm_size(c);
  const int rounds = 50;
  int bad_send = 0, bad_recv = 0;
  std::thread ts([&] {
    for (int k = 0; k < rounds && !bad_send; k++) {
      int v = k * 1000 + rank;
      if (rtp_comm_send(c, &v, sizeof(v), (rank + 1) % n, nullptr) != RTP_OK) bad_send = 1;
    }
  });
  std::thread tr([&] {
    int left = (rank + n - 1) % n;
    for (int k = 0; k < rounds && !bad_recv; k++) {
      int v = -1;
      rtp_comm_req *r;
      if (rtp_comm_recv(c, &v, sizeof(v), left, &r) != RTP_OK || rtp_comm_wait(r) != RTP_OK ||
          v != k * 1000 + left)
        bad_recv = 1;
    }
  });
  ts.join();
  tr.join();
  CHECK(!bad_send && !bad_recv, "threads: send %d recv %d: %s", bad_send, bad_recv,
        rtp_last_error());
  // rank 0 waits for a message that rank 1 sends only after a barrier
  int v = 0;
  rtp_comm_req *r = nullptr;
  if (rank == 0) {
    CHECK_OK(rtp_comm_recv(c, &v, sizeof(v), 1, &r));
    CHECK(rtp_comm_wait_for(r, 50) == RTP_ETIMEDOUT, "wait_for should time out");
  }
  CHECK_OK(rtp_comm_barrier(c, nullptr));
  if (rank == 1) {
    v = 42;
    CHECK_OK(rtp_comm_send(c, &v, sizeof(v), 0, nullptr));
  }
  if (rank == 0) {
    CHECK_OK(rtp_comm_wait(r));
    CHECK(v == 42, "late message");
  }
  return 0;
}

int run_all(int rank, int n, int port) {
  rtp_comm_params p = params(rank, n, port);
  rtp_comm *c;
  CHECK_OK(rtp_comm_init(&p, &c));
  CHECK(rtp_comm_rank(c) == rank && rtp_comm_size(c) == n, "rank/size");
  int rc = check_collectives(c);
  if (!rc) rc = check_rotation(c, 1001);
  if (!rc) rc = check_rotation(c, (1u << 20) + 7);
  if (!rc && n > 1) rc = check_p2p(c);
  if (!rc) rc = check_overlap(c);
  if (!rc && n > 1) rc = check_threads(c);
  if (!rc) {
    const char *msg;
    CHECK(rtp_comm_status(c, &msg) == RTP_OK, "status");
  }
  rtp_comm_free(c);
  return rc;
}

void run_world(int n) {
  int port = free_port();
  auto res = run_procs(
      n, [&](int r) { return run_all(r, n, port); }, 120);
  for (int r = 0; r < n; r++) EXPECT_EQ(res[r].code, 0) << "rank " << r;
}

}  // namespace

// Two tests that ctest runs side by side once chose the same port for rank 0. A port
// free_port hands out stays reserved until its process exits: another process (a forked
// child opens its own reservations) cannot have it, and gets another.
TEST(Comm, FreePortIsReservedAgainstOtherProcesses) {
  int port = free_port();
  ASSERT_GT(port, 0);
  auto res = run_procs(1, [&](int) {
    if (free_port_reserve(port)) return 1;
    for (int i = 0; i < 50; i++)
      if (free_port() == port) return 2;
    return 0;
  });
  EXPECT_EQ(res[0].code, 0) << "1: the child reserved the parent's port; 2: was handed it";
}

TEST(Comm, Block) {
  size_t f, l;
  rtp_comm_block(10, 3, 0, &f, &l);
  EXPECT_EQ(f, 0u);
  EXPECT_EQ(l, 4u);
  rtp_comm_block(10, 3, 1, &f, &l);
  EXPECT_EQ(f, 4u);
  EXPECT_EQ(l, 3u);
  rtp_comm_block(10, 3, 2, &f, &l);
  EXPECT_EQ(f, 7u);
  EXPECT_EQ(l, 3u);
  rtp_comm_block(2, 5, 4, &f, &l);
  EXPECT_EQ(f, 2u);
  EXPECT_EQ(l, 0u);
}

TEST(Comm, Local) {
  rtp_comm_params p = rtp_comm_params_default();
  rtp_comm *c;
  ASSERT_EQ(rtp_comm_init(&p, &c), RTP_OK) << rtp_last_error();
  EXPECT_EQ(rtp_comm_size(c), 1);
  int rank = 0;
  EXPECT_EQ(run_all(0, 1, 0) == 0 ? 0 : 1, 0);  // the tcp backend with one rank needs no socket
  (void)rank;
  float x[3] = {1, 2, 3};
  EXPECT_EQ(rtp_comm_allreduce(c, x, 3, nullptr), RTP_OK);
  EXPECT_EQ(x[2], 3.0f);
  float y[3];
  EXPECT_EQ(rtp_comm_sendrecv(c, x, 12, 0, y, 12, 0, nullptr), RTP_OK);
  EXPECT_EQ(y[1], 2.0f);
  EXPECT_EQ(rtp_comm_send(c, x, 12, 0, nullptr), RTP_EINVAL);
  EXPECT_EQ(rtp_comm_send(c, x, 12, 1, nullptr), RTP_EINVAL);
  EXPECT_NE(std::string(rtp_last_error()).find("out of range"), std::string::npos);
  rtp_comm_free(c);
}

TEST(Comm, Params) {
  setenv("RTP_RANK", "2", 1);
  setenv("RTP_WORLD_SIZE", "3", 1);
  setenv("RTP_MASTER_PORT", "1234", 1);
  setenv("RTP_TOKEN", "abc", 1);
  rtp_comm_params p;
  ASSERT_EQ(rtp_comm_params_from_env(&p), RTP_OK);
  EXPECT_EQ(p.rank, 2);
  EXPECT_EQ(p.world_size, 3);
  EXPECT_EQ(p.master_port, 1234);
  EXPECT_STREQ(p.token, "abc");
  unsetenv("RTP_RANK");
  unsetenv("RTP_WORLD_SIZE");
  setenv("SLURM_PROCID", "1", 1);
  setenv("SLURM_NTASKS", "4", 1);
  ASSERT_EQ(rtp_comm_params_from_env(&p), RTP_OK);
  EXPECT_EQ(p.rank, 1);
  EXPECT_EQ(p.world_size, 4);
  setenv("SLURM_PROCID", "x", 1);
  EXPECT_EQ(rtp_comm_params_from_env(&p), RTP_EINVAL);
  unsetenv("SLURM_PROCID");
  unsetenv("SLURM_NTASKS");
  setenv("OMPI_COMM_WORLD_RANK", "3", 1);
  setenv("OMPI_COMM_WORLD_SIZE", "2", 1);
  EXPECT_EQ(rtp_comm_params_from_env(&p), RTP_EINVAL);  // rank >= size
  unsetenv("OMPI_COMM_WORLD_RANK");
  unsetenv("OMPI_COMM_WORLD_SIZE");
  unsetenv("RTP_MASTER_PORT");
  unsetenv("RTP_TOKEN");
  p = params(0, 2, 5000, 1000, "");
  rtp_comm *c;
  EXPECT_EQ(rtp_comm_init(&p, &c), RTP_EINVAL);  // no token
}

// A token that could be guessed is refused with a message that says how to make one:
// short, 31 hex digits (124 bits), few distinct characters; 32 hex digits (128 bits) join.
TEST(Comm, GuessableTokensRefused) {
  for (const char *t : {"abc", "0123456789abcdef0123456789abcde",
                        "abababababababababababababababab", "short-but-not-hex-21c"}) {
    rtp_comm_params p = params(0, 2, 5000, 1000, t);
    rtp_comm *c;
    EXPECT_EQ(rtp_comm_init(&p, &c), RTP_EINVAL) << t;
    EXPECT_NE(std::string(rtp_last_error()).find("openssl rand -hex 32"), std::string::npos)
        << rtp_last_error();
  }
  int port = free_port();
  auto res = run_procs(2, [&](int rank) {
    rtp_comm_params p = params(rank, 2, port, 10000, "0123456789abcdef0123456789abcdef");
    rtp_comm *c;
    if (rtp_comm_init(&p, &c) != RTP_OK) return 2;
    int st = rtp_comm_barrier(c, nullptr);
    rtp_comm_free(c);
    return st == RTP_OK ? 0 : 3;
  });
  for (int r = 0; r < 2; r++) EXPECT_EQ(res[r].code, 0) << "rank " << r;
}

// The addresses (hex, as /proc/net/tcp{,6} print them) of this process's listening
// TCP sockets.
std::vector<std::string> own_listeners() {
  std::set<std::string> inodes;
  if (DIR *d = opendir("/proc/self/fd")) {
    while (dirent *e = readdir(d)) {
      char link[256] = {0};
      std::string path = std::string("/proc/self/fd/") + e->d_name;
      if (readlink(path.c_str(), link, sizeof(link) - 1) > 0 && !strncmp(link, "socket:[", 8))
        inodes.insert(std::string(link + 8, strlen(link) - 9));
    }
    closedir(d);
  }
  std::vector<std::string> out;
  for (const char *table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream f(table);
    std::string line;
    std::getline(f, line);  // the header
    while (std::getline(f, line)) {
      std::istringstream in(line);
      std::string sl, local, remote, st, queues, tr, retr, uid, timeout, inode;
      in >> sl >> local >> remote >> st >> queues >> tr >> retr >> uid >> timeout >> inode;
      if (st == "0A" && inodes.count(inode)) out.push_back(local.substr(0, local.find(':')));
    }
  }
  return out;
}

// Hosts come from the addresses the ranks joined by: ranks 0 and 1 on 127.0.0.1, ranks 2
// and 3 bound to 127.0.0.2 (another "host" of the loopback), rank 4 to 127.0.0.3. Every
// rank numbers them alike, in order of first appearance, and a group renumbers its own.
TEST(Comm, HostsFromTheRendezvous) {
  int port = free_port();
  auto res = run_procs(5, [&](int rank) {
    rtp_comm_params p = params(rank, 5, port, 10000);
    const char *bind[5] = {"", "127.0.0.1", "127.0.0.2", "127.0.0.2", "127.0.0.3"};
    snprintf(p.bind, sizeof(p.bind), "%s", bind[rank]);
    rtp_comm *c, *odd = nullptr;
    CHECK_OK(rtp_comm_init(&p, &c));
    int hosts[5] = {-1, -1, -1, -1, -1};
    CHECK_OK(rtp_comm_hosts(c, hosts));
    CHECK(hosts[0] == 0 && hosts[1] == 0 && hosts[2] == 1 && hosts[3] == 1 && hosts[4] == 2,
          "hosts %d %d %d %d %d", hosts[0], hosts[1], hosts[2], hosts[3], hosts[4]);
    CHECK_OK(rtp_comm_split(c, rank % 2 ? 0 : RTP_COMM_UNDEFINED, 0, &odd));
    if (odd) {  // world ranks 1 and 3
      CHECK_OK(rtp_comm_hosts(odd, hosts));
      CHECK(hosts[0] == 0 && hosts[1] == 1, "the group's hosts %d %d", hosts[0], hosts[1]);
      rtp_comm_free(odd);
    }
    CHECK_OK(rtp_comm_barrier(c, nullptr));
    rtp_comm_free(c);
    return 0;
  });
  for (int r = 0; r < 5; r++) EXPECT_EQ(res[r].code, 0) << "rank " << r;
}

// A job whose master is 127.0.0.1 listens on the loopback only, rank 0 and the others
// alike (no RTP_BIND_ADDR): nothing of it is reachable from another host.
TEST(Comm, ListensWhereTheJobLives) {
  int port = free_port();
  auto res = run_procs(3, [&](int rank) {
    rtp_comm_params p = params(rank, 3, port, 10000);
    rtp_comm *c;
    if (rtp_comm_init(&p, &c) != RTP_OK) return 2;
    std::vector<std::string> ls = own_listeners();
    int rc = ls.empty() ? 3 : 0;
    for (const std::string &a : ls) {
      fprintf(stderr, "rank %d listens on %s\n", rank, a.c_str());
      if (a != "0100007F") rc = 4;  // 127.0.0.1
    }
    rtp_comm_barrier(c, nullptr);
    rtp_comm_free(c);
    return rc;
  });
  for (int r = 0; r < 3; r++) EXPECT_EQ(res[r].code, 0) << "rank " << r;
}

TEST(Comm, World1) {
  run_world(1);
}
TEST(Comm, World2) {
  run_world(2);
}
TEST(Comm, World3) {
  run_world(3);
}
TEST(Comm, World4) {
  run_world(4);
}
TEST(Comm, World5) {
  run_world(5);
}
