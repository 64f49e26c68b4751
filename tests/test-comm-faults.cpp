// test-comm-faults.cpp - the transport's fault model: ranks that disagree, die or go
// silent; strangers and garbage on the listening port; malformed frames from a peer that
// knows the token. Every case must end quickly with a clear error, never a hang or crash.
#include <gtest/gtest.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>

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
const uint8_t kProtocolVersion = 3;
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

// The connector's side of the handshake (docs/transport.md), done by hand.
int handshake(int fd, const std::string &token, int world, int rank) {
  uint8_t t[80 + 112 + 32] = {0};
  uint8_t id[32];
  mac(token, "rtp-job-id", nullptr, 0, id);
  put32(t, 0x48505452u);
  t[4] = kProtocolVersion;  // no direct writes offered
  memcpy(t + 8, id, 8);
  put32(t + 16, (uint32_t)world);
  put32(t + 20, (uint32_t)rank);
  for (int i = 0; i < 32; i++) t[24 + i] = (uint8_t)rand();
  if (!write_all(fd, t, 80) || !read_all(fd, t + 80, 112)) return -1;
  mac(token, "rtp-hs-connector", t, 192, t + 192);
  return write_all(fd, t + 192, 32) ? 0 : -1;
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
          rtp_comm_params p = params(1, 2, port, 15000, "not-the-token");
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
      if (fd < 0 || handshake(fd, "test-token", 2, 1) != 0) return 5;
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
