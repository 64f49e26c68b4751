// test-comm-faults.cpp - the transport's fault model: ranks that disagree, die or go
// silent; strangers and garbage on the listening port; malformed frames from a peer that
// knows the token. Every case must end quickly with a clear error, never a hang or crash.
#include <gtest/gtest.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <sys/resource.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

#include "test-util.h"

using namespace rtptest;

namespace {

// Exit codes of a rank's check: 0 as expected, 2 init failed, 3 succeeded but should not
// have, 4 wrong status or message, 5 too slow (expect_failure's).

TEST(CommFaults, DifferentCollectives) {
  int port = free_port();
  auto res = run_procs(3, [&](int rank) {
    rtp_comm_params p = params(rank, 3, port, 10000);
    rtp_comm *c;
    double t0 = now_s();
    int st = rtp_comm_init(&p, &c);  // fails if the others already failed
    if (st != RTP_OK)
      return expect_failure(rank, st, t0, 5, {RTP_EPEER},
                            {"called allgather", "called allreduce"});
    std::vector<float> v(10, 1.0f);
    st = rank == 2 ? rtp_comm_allgather(c, v.data(), 10, 4, nullptr)
                   : rtp_comm_allreduce(c, v.data(), 10, nullptr);
    int rc = expect_failure(rank, st, t0, 5, {RTP_EPEER},
                            {"called allgather", "called allreduce"}, c);
    rtp_comm_free(c);
    return rc;
  });
  for (int r = 0; r < 3; r++) EXPECT_EQ(res[r].code, 0) << "rank " << r;
}

TEST(CommFaults, DifferentCounts) {
  int port = free_port();
  auto res = run_procs(2, [&](int rank) {
    rtp_comm_params p = params(rank, 2, port, 10000);
    rtp_comm *c;
    double t0 = now_s();
    int st = rtp_comm_init(&p, &c);
    if (st != RTP_OK) return expect_failure(rank, st, t0, 5, {RTP_EPEER}, {"disagree"});
    std::vector<float> v(12, 1.0f);
    st = rtp_comm_allreduce(c, v.data(), rank == 1 ? 12 : 11, nullptr);
    int rc = expect_failure(rank, st, t0, 5, {RTP_EPEER}, {"disagree"}, c);
    rtp_comm_free(c);
    return rc;
  });
  for (int r = 0; r < 2; r++) EXPECT_EQ(res[r].code, 0) << "rank " << r;
}

TEST(CommFaults, DifferentP2PSizes) {
  int port = free_port();
  auto res = run_procs(2, [&](int rank) {
    rtp_comm_params p = params(rank, 2, port, 10000);
    rtp_comm *c;
    double t0 = now_s();
    int st = rtp_comm_init(&p, &c);
    if (st != RTP_OK) return expect_failure(rank, st, t0, 5, {RTP_EPEER}, {"disagree"});
    std::vector<uint8_t> v(100);
    st = rank == 0 ? rtp_comm_send(c, v.data(), 100, 1, nullptr)
                   : rtp_comm_recv(c, v.data(), 99, 0, nullptr);
    int rc = expect_failure(rank, st, t0, 5, {RTP_EPEER}, {"disagree"}, c);
    rtp_comm_free(c);
    return rc;
  });
  for (int r = 0; r < 2; r++) EXPECT_EQ(res[r].code, 0) << "rank " << r;
}

// Rank 2 dies (SIGKILL) in the middle of a large all-reduce: the others fail at once,
// naming it.
TEST(CommFaults, RankKilled) {
  int port = free_port();
  auto res = run_procs(3, [&](int rank) {
    rtp_comm_params p = params(rank, 3, port, 10000);
    rtp_comm *c;
    if (rtp_comm_init(&p, &c) != RTP_OK) return 2;
    if (rtp_comm_barrier(c, nullptr) != RTP_OK) return 2;
    std::vector<float> v(16 << 20, 1.0f);
    rtp_comm_req *req;
    double t0 = now_s();
    // posting fails at once if the others already noticed rank 2's death
    int st = rtp_comm_allreduce(c, v.data(), v.size(), &req);
    if (rank == 2) {
      usleep(2000);
      raise(SIGKILL);
    }
    if (st == RTP_OK) st = rtp_comm_wait(req);
    int rc = expect_failure(rank, st, t0, 5, {RTP_EPEER, RTP_ECOMM}, {"rank 2"}, c);
    rtp_comm_free(c);
    return rc;
  });
  EXPECT_EQ(res[0].code, 0);
  EXPECT_EQ(res[1].code, 0);
  EXPECT_EQ(res[2].code, -SIGKILL);
}

// Rank 1 stops (SIGSTOP): its sockets stay open but it says nothing; the others fail
// after the timeout, naming it.
TEST(CommFaults, RankSilent) {
  int port = free_port();
  const int timeout_ms = 2000;
  auto res = run_procs(3,
                       [&](int rank) {
                         rtp_comm_params p = params(rank, 3, port, timeout_ms);
                         rtp_comm *c;
                         if (rtp_comm_init(&p, &c) != RTP_OK) return 2;
                         if (rtp_comm_barrier(c, nullptr) != RTP_OK) return 2;
                         if (rank == 1) raise(SIGSTOP);
                         std::vector<float> v(1000, 1.0f);
                         double t0 = now_s();
                         int st = rtp_comm_allreduce(c, v.data(), v.size(), nullptr);
                         int rc = expect_failure(rank, st, t0, 3 * timeout_ms / 1000.0,
                                                 {RTP_ETIMEDOUT, RTP_EPEER}, {"rank 1"}, c);
                         rtp_comm_free(c);
                         return rc;
                       },
                       60, {1});
  EXPECT_EQ(res[0].code, 0);
  EXPECT_EQ(res[2].code, 0);
}

// ---- strangers ------------------------------------------------------------------------

int connect_to(int port) {
  for (int i = 0; i < 500; i++) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons((uint16_t)port);
    if (connect(fd, (sockaddr *)&a, sizeof(a)) == 0) return fd;
    close(fd);
    usleep(10000);
  }
  return -1;
}

bool write_all(int fd, const void *p, size_t n) {
  const uint8_t *b = (const uint8_t *)p;
  while (n) {
    ssize_t w = send(fd, b, n, MSG_NOSIGNAL);
    if (w <= 0) return false;
    b += w;
    n -= (size_t)w;
  }
  return true;
}

bool read_all(int fd, void *p, size_t n) {
  uint8_t *b = (uint8_t *)p;
  while (n) {
    ssize_t r = recv(fd, b, n, 0);
    if (r <= 0) return false;
    b += r;
    n -= (size_t)r;
  }
  return true;
}

// The wire's version and frame header size (docs/transport.md, "Frames").
const uint8_t kProtocolVersion = 4;
const size_t kHeaderSize = 56;

void put32(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
void put64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}

void mac(const std::string &token, const std::string &label, const uint8_t *d, size_t n,
         uint8_t out[32]) {
  std::vector<uint8_t> buf(label.begin(), label.end());
  buf.insert(buf.end(), d, d + n);
  unsigned len = 32;
  HMAC(EVP_sha256(), token.data(), (int)token.size(), buf.data(), buf.size(), out, &len);
}

// The connector's side of the handshake (docs/transport.md), done by hand: HELLO_c, read
// HELLO_a, the connector's proof, read the acceptor's. 0 when the acceptor proved itself.
int handshake(int fd, const std::string &token, int world, int rank) {
  uint8_t t[80 + 80 + 32 + 32] = {0};
  put32(t, 0x48505452u);
  t[4] = kProtocolVersion;  // no direct writes offered
  put32(t + 16, (uint32_t)world);
  put32(t + 20, (uint32_t)rank);
  for (int i = 0; i < 32; i++) t[24 + i] = (uint8_t)rand();
  if (!write_all(fd, t, 80) || !read_all(fd, t + 80, 80)) return -1;
  mac(token, "rtp-hs-connector", t, 160, t + 160);
  if (!write_all(fd, t + 160, 32) || !read_all(fd, t + 192, 32)) return -1;
  uint8_t want[32];
  mac(token, "rtp-hs-acceptor", t, 192, want);
  return memcmp(want, t + 192, 32) == 0 ? 0 : -1;
}

// A job of two ranks carries on while strangers knock: a process with the wrong token,
// random bytes, a truncated and a corrupted handshake, and a connection that says nothing.
TEST(CommFaults, StrangersRefused) {
  int port = free_port();
  auto res = run_procs(
      7,
      [&](int who) {
        int rank = who;
        if (who <= 1) {
          if (who == 1) usleep(300000);  // let the strangers knock first
          rtp_comm_params p = params(who, 2, port, 15000);
          rtp_comm *c;
          int st = rtp_comm_init(&p, &c);
          if (st != RTP_OK) {
            fprintf(stderr, "rank %d: init: %s\n", who, rtp_last_error());
            return 2;
          }
          std::vector<float> v(1001, (float)who);
          if (rtp_comm_allreduce(c, v.data(), v.size(), nullptr) != RTP_OK) return 3;
          for (float x : v)
            if (x != 1.0f) return 4;
          rtp_comm_free(c);
          return 0;
        }
        if (who == 2) {  // the right protocol, the wrong token
          rtp_comm_params p = params(1, 2, port, 15000, "not-the-token-of-this-test-job");
          rtp_comm *c;
          int st = rtp_comm_init(&p, &c);
          fprintf(stderr, "stranger: %s\n", rtp_last_error());
          if (st == RTP_OK) return 3;
          return st == RTP_EAUTH ? 0 : 4;
        }
        (void)rank;
        int fd = connect_to(port);
        if (fd < 0) return 5;
        uint8_t buf[200];
        for (int i = 0; i < 200; i++) buf[i] = (uint8_t)(rand() ^ (i * 37));
        if (who == 3) {  // random bytes
          write_all(fd, buf, sizeof(buf));
        } else if (who == 4) {  // a hello cut short, then gone
          put32(buf, 0x48505452u);
          buf[4] = kProtocolVersion;
          write_all(fd, buf, 30);
        } else if (who == 5) {  // right magic, nonsense fields
          put32(buf, 0x48505452u);
          write_all(fd, buf, 80);
        } else {  // connects and says nothing for a while
          usleep(1500000);
        }
        // a refused connection is closed by the listener, never answered
        char c;
        ssize_t r = recv(fd, &c, 1, 0);
        close(fd);
        return r <= 0 || who == 6 ? 0 : 6;
      },
      60);
  for (int i = 0; i < 7; i++) EXPECT_EQ(res[i].code, 0) << "process " << i;
}

// A stranger who sends a well-formed hello gets the acceptor's hello, in which nothing
// derives from the token (the bytes that once held a token-derived job id are zero), and
// no proof: after a wrong proof of its own the connection closes with no byte more. So a
// stranger cannot test guesses of the token against anything the acceptor sent.
TEST(CommFaults, StrangerLearnsNothingBeforeItsProof) {
  int port = free_port();
  auto res = run_procs(3, [&](int who) {
    if (who == 2) {  // the stranger, while ranks 0 and 1 train
      usleep(200000);
      int fd = connect_to(port);
      uint8_t t[80 + 80 + 32] = {0}, extra;
      put32(t, 0x48505452u);
      t[4] = kProtocolVersion;
      put32(t + 16, 2);
      put32(t + 20, 1);
      if (fd < 0 || !write_all(fd, t, 80) || !read_all(fd, t + 80, 80)) return 5;
      for (int i = 8; i < 16; i++)
        if (t[80 + i]) return 6;
      memset(t + 160, 0x5a, 32);  // a wrong proof
      if (!write_all(fd, t + 160, 32)) return 7;
      ssize_t r = recv(fd, &extra, 1, 0);
      close(fd);
      return r <= 0 ? 0 : 8;
    }
    rtp_comm_params p = params(who, 2, port, 15000);
    rtp_comm *c;
    if (who == 1) usleep(600000);  // after the stranger
    if (rtp_comm_init(&p, &c) != RTP_OK) return 2;
    float v = 1.0f;
    int st = rtp_comm_allreduce(c, &v, 1, nullptr);
    rtp_comm_free(c);
    return st == RTP_OK && v == 2.0f ? 0 : 3;
  });
  for (int i = 0; i < 3; i++) EXPECT_EQ(res[i].code, 0) << "process " << i;
}

// Guessing online: after 5 wrong proofs from one address (127.0.0.2), its next
// connection is closed unanswered (for a minute); the ranks already joined carry on, and a
// rank from another address (127.0.0.1) still joins.
TEST(CommFaults, WrongProofsLockOutTheirAddress) {
  int port = free_port();
  auto res = run_procs(4, [&](int who) {
    if (who == 3) {
      usleep(300000);  // after ranks 0 and 1, before rank 2
      for (int k = 0; k < 6; k++) {
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        sockaddr_in a{};
        a.sin_family = AF_INET;
        a.sin_addr.s_addr = htonl(0x7f000002);  // 127.0.0.2
        if (fd < 0 || bind(fd, (sockaddr *)&a, sizeof(a))) return 4;
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        a.sin_port = htons((uint16_t)port);
        if (connect(fd, (sockaddr *)&a, sizeof(a))) return 4;
        uint8_t t[80 + 80 + 32] = {0}, extra;
        put32(t, 0x48505452u);
        t[4] = kProtocolVersion;
        put32(t + 16, 3);
        put32(t + 20, 2);
        bool answered = write_all(fd, t, 80) && read_all(fd, t + 80, 80);
        if (k == 5) {
          close(fd);
          return answered ? 6 : 0;  // locked out: closed before any answer
        }
        if (!answered || !write_all(fd, t + 160, 32) || recv(fd, &extra, 1, 0) > 0) return 5;
        close(fd);
      }
      return 7;
    }
    rtp_comm_params p = params(who, 3, port, 15000);
    rtp_comm *c;
    if (who == 2) usleep(1000000);  // after the guesses
    if (rtp_comm_init(&p, &c) != RTP_OK) return 2;
    float v = 1.0f;
    int st = rtp_comm_allreduce(c, &v, 1, nullptr);
    rtp_comm_free(c);
    return st == RTP_OK && v == 3.0f ? 0 : 3;
  });
  for (int i = 0; i < 4; i++) EXPECT_EQ(res[i].code, 0) << "process " << i;
}

// A flood during rendezvous and training: a stranger keeps 600 connections open to rank
// 0 (nonblocking connects, reopened as they are dropped), 30 of them trickling a byte at a
// time, while rank 0 has a descriptor limit of 256 (`ulimit -n 256`). The others still
// join, and the job's sums come out right: unproven connections are bounded in number
// and time, and a rank's handshake outlives the flood's.
TEST(CommFaults, FloodOfIdleAndTricklingConnections) {
  int port = free_port();
  auto res = run_procs(
      4,
      [&](int who) {
        if (who == 3) {  // the flood, for 5 s
          double end = now_s() + 5.0;
          long opened = flood_port(port, [&] { return now_s() >= end; });
          fprintf(stderr, "flood: %ld connections opened\n", opened);
          return opened > 1000 ? 0 : 9;  // it did flood
        }
        if (who == 0) {
          rlimit lim{256, 256};
          if (setrlimit(RLIMIT_NOFILE, &lim)) return 8;
        } else {
          usleep(1000000);  // join in the middle of the flood
        }
        rtp_comm_params p = params(who, 3, port, 15000);
        rtp_comm *c;
        if (rtp_comm_init(&p, &c) != RTP_OK) {
          fprintf(stderr, "rank %d: %s\n", who, rtp_last_error());
          return 2;
        }
        int st = RTP_OK;
        for (int i = 0; i < 50 && st == RTP_OK; i++) {  // training, still flooded
          std::vector<float> v(1000, (float)(who + i));
          st = rtp_comm_allreduce(c, v.data(), v.size(), nullptr);
          for (float x : v)
            if (x != (float)(3 + 3 * i)) st = -100;
          usleep(40000);
        }
        if (st != RTP_OK) fprintf(stderr, "rank %d: %d %s\n", who, st, rtp_last_error());
        rtp_comm_free(c);
        return st == RTP_OK ? 0 : 3;
      },
      60);
  for (int i = 0; i < 4; i++) EXPECT_EQ(res[i].code, 0) << "process " << i;
}

// A broadcast's root leaves (rtp_comm_free, exit) as soon as its part is done, before the
// last rank of the chain, whose only part towards the root is an empty send, posts: that
// rank still gets the data and succeeds (the root's ready-to-receive outlives it).
TEST(CommFaults, RootLeavesRightAfterBroadcast) {
  int port = free_port();
  auto res = run_procs(3, [&](int rank) {
    rtp_comm_params p = params(rank, 3, port, 10000);
    rtp_comm *c;
    if (rtp_comm_init(&p, &c) != RTP_OK) return 2;
    std::vector<float> v(100, rank == 0 ? 7.0f : 0.0f);
    if (rank == 2) usleep(500000);  // the root is gone by now
    int st = rtp_comm_broadcast(c, v.data(), v.size() * sizeof(float), 0, nullptr);
    if (st != RTP_OK) fprintf(stderr, "rank %d: %s\n", rank, rtp_last_error());
    rtp_comm_free(c);
    return st == RTP_OK && v[99] == 7.0f ? 0 : 3;
  });
  for (int r = 0; r < 3; r++) EXPECT_EQ(res[r].code, 0) << "rank " << r;
}

// A peer that passed the handshake sends a malformed frame: rank 0 fails cleanly with
// RTP_EFORMAT naming rank 1, whatever the frame says.
TEST(CommFaults, MalformedFrames) {
  for (int variant = 0; variant < 4; variant++) {
    int port = free_port();
    auto res = run_procs(2, [&](int who) {
      int rank = who;
      if (who == 0) {
        rtp_comm_params p = params(0, 2, port, 5000);
        rtp_comm *c;
        int st = rtp_comm_init(&p, &c);
        fprintf(stderr, "rank 0, variant %d: %s\n", variant, rtp_last_error());
        if (st == RTP_OK) return 3;
        return st == RTP_EFORMAT && contains(rtp_last_error(), "rank 1") ? 0 : 4;
      }
      (void)rank;
      int fd = connect_to(port);
      if (fd < 0 || handshake(fd, kTestToken, 2, 1) != 0) return 5;
      uint8_t h[kHeaderSize] = {0};
      put32(h, 0x46505452u);
      h[4] = kProtocolVersion;
      if (variant == 0) {
        put32(h, 0xdeadbeef);  // bad magic
      } else if (variant == 1) {
        h[5] = 1;  // DATA of a request that does not exist, absurdly long
        put64(h + 16, (uint64_t)1 << 62);
      } else if (variant == 2) {
        h[5] = 6;  // REGISTER of the wrong size
        put64(h + 16, 1 << 20);
      } else {
        h[5] = 8;  // DONE (a direct write) where none was offered or asked for
        put64(h + 16, 4096);
      }
      write_all(fd, h, sizeof(h));
      char c;
      recv(fd, &c, 1, 0);
      close(fd);
      return 0;
    });
    EXPECT_EQ(res[0].code, 0) << "variant " << variant;
    EXPECT_EQ(res[1].code, 0) << "variant " << variant;
  }
}

// A rank that leaves (rtp_comm_free) is not an error for the others until they need it.
TEST(CommFaults, PeerLeaves) {
  int port = free_port();
  auto res = run_procs(2, [&](int rank) {
    rtp_comm_params p = params(rank, 2, port, 10000);
    rtp_comm *c;
    if (rtp_comm_init(&p, &c) != RTP_OK) return 2;
    if (rtp_comm_barrier(c, nullptr) != RTP_OK) return 3;
    if (rank == 1) {
      rtp_comm_free(c);
      return 0;
    }
    usleep(300000);
    float x = 1;
    int st = rtp_comm_send(c, &x, 4, 1, nullptr);
    fprintf(stderr, "rank 0 after rank 1 left: %s\n", rtp_last_error());
    rtp_comm_free(c);
    return st == RTP_ECOMM && contains(rtp_last_error(), "rank 1") ? 0 : 4;
  });
  EXPECT_EQ(res[0].code, 0);
  EXPECT_EQ(res[1].code, 0);
}

}  // namespace
