// test-comm-netns.cpp - three ranks as three hosts on an emulated 1 Gbit/s Ethernet
// (scripts/netns-ethernet.sh: network namespaces, a bridge, tc tbf). Needs root; skips
// otherwise. The ranks are this binary running NetnsWorker.Job inside the namespaces.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "test-util.h"

using namespace rtptest;

namespace {

std::string self() {
  char buf[4096];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  buf[n > 0 ? n : 0] = 0;
  return buf;
}

int sh(const std::string &cmd) {
  int st = system(cmd.c_str());
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

}  // namespace

TEST(Netns, RingOverEmulatedEthernet) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root for network namespaces";
  std::string prefix = "rtpt" + std::to_string(getpid() % 100000);
  std::string script = std::string(RTP_TEST_DIR) + "/../scripts/netns-ethernet.sh";
  std::string env = "RTP_NETNS_PREFIX=" + prefix + " ";
  if (sh(env + script + " up 3 1gbit >/dev/null 2>&1") != 0) {
    sh(env + script + " down 3 >/dev/null 2>&1");
    GTEST_SKIP() << "cannot create network namespaces here (ip netns / tc tbf unavailable)";
  }
  std::string exe = self();
  auto res = run_procs(
      3,
      [&](int rank) {
        std::string ns = prefix + std::to_string(rank);
        setenv("RTP_NETNS_WORKER", "1", 1);
        setenv("RTP_RANK", std::to_string(rank).c_str(), 1);
        setenv("RTP_WORLD_SIZE", "3", 1);
        setenv("RTP_MASTER_ADDR", "10.231.0.1", 1);
        setenv("RTP_MASTER_PORT", "29500", 1);
        setenv("RTP_TOKEN", "netns-test-token-of-the-emulated-hosts", 1);
        setenv("RTP_TIMEOUT_MS", "20000", 1);
        execlp("ip", "ip", "netns", "exec", ns.c_str(), exe.c_str(),
               "--gtest_filter=NetnsWorker.Job", (char *)nullptr);
        return 127;
      },
      120);
  sh(env + script + " down 3 >/dev/null 2>&1");
  for (int r = 0; r < 3; r++) EXPECT_EQ(res[r].code, 0) << "rank " << r;
}

TEST(NetnsWorker, Job) {
  if (!getenv("RTP_NETNS_WORKER")) GTEST_SKIP() << "runs inside Netns.RingOverEmulatedEthernet";
  rtp_comm_params p;
  ASSERT_EQ(rtp_comm_params_from_env(&p), RTP_OK) << rtp_last_error();
  rtp_comm *c;
  ASSERT_EQ(rtp_comm_init(&p, &c), RTP_OK) << rtp_last_error();
  int rank = rtp_comm_rank(c), n = rtp_comm_size(c);
  int hosts[3] = {-1, -1, -1};
  ASSERT_EQ(rtp_comm_hosts(c, hosts), RTP_OK) << rtp_last_error();
  EXPECT_TRUE(hosts[0] == 0 && hosts[1] == 1 && hosts[2] == 2)
      << "three namespaces, three hosts";
  const size_t count = (8u << 20) / 4 + 5;
  std::vector<float> a(count), b(count);
  for (size_t i = 0; i < count; i++) a[i] = (float)(rank + (int)(i % 7));
  ASSERT_EQ(rtp_comm_allreduce(c, a.data(), count, nullptr), RTP_OK) << rtp_last_error();
  for (size_t i = 0; i < count; i++) ASSERT_EQ(a[i], (float)(3 + 3 * (int)(i % 7)));
  // rotation bandwidth: bounded by the emulated link (125 MB/s), and close to it
  ASSERT_EQ(rtp_comm_barrier(c, nullptr), RTP_OK);
  double t0 = now_s();
  for (int k = 0; k < 3; k++)
    ASSERT_EQ(rtp_comm_sendrecv(c, a.data(), count * 4, (rank + n - 1) % n, b.data(), count * 4,
                                (rank + 1) % n, nullptr),
              RTP_OK)
        << rtp_last_error();
  double mbps = 3.0 * count * 4 / (now_s() - t0) / 1e6;
  printf("rank %d: rotation at %.1f MB/s over the emulated 1 Gbit/s link\n", rank, mbps);
  EXPECT_LT(mbps, 140.0);
  EXPECT_GT(mbps, 60.0);
  rtp_comm_free(c);
}
