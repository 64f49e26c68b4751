// test-comm-run.cpp - the rtp-run launcher: environment, output prefixes, failure
// propagation and exit codes, signal forwarding, --help, and a real job whose ranks are this
// binary (the RunWorker tests, which only run under rtp-run).
#include <gtest/gtest.h>

#include <dirent.h>

#include <csignal>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "test-util.h"

using namespace rtptest;

namespace {

const std::string kRun = std::string(RTP_BUILD_DIR) + "/tools/rtp-run";

struct Out {
  int code;
  std::string text;
  double seconds;
};

Out run(const std::string &cmd) {
  double t0 = now_s();
  FILE *f = popen((cmd + " 2>&1").c_str(), "r");
  std::string text;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), f)) > 0) text.append(buf, n);
  int st = pclose(f);
  return {WIFEXITED(st) ? WEXITSTATUS(st) : -1, text, now_s() - t0};
}

bool has(const std::string &s, const std::string &w) {
  return s.find(w) != std::string::npos;
}

std::string self() {
  char buf[4096];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  buf[n > 0 ? n : 0] = 0;
  return buf;
}

std::string slurp(const std::string &path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// Each first group of re in text.
void collect(const std::string &text, const std::regex &re, std::set<std::string> *out) {
  for (std::sregex_iterator m(text.begin(), text.end(), re), end; m != end; ++m)
    out->insert((*m)[1]);
}

// Whether text has w as a word of its own ("-n" is in every "--nnodes").
bool names(const std::string &text, const std::string &w) {
  return std::regex_search(text, std::regex("(^|[^-\\w])" + w + "($|[^-\\w])"));
}

}  // namespace

TEST(Run, PrefixesAndEnvironment) {
  Out o = run(kRun +
              " -n 3 -- sh -c 'echo hello $RTP_RANK of $RTP_WORLD_SIZE local "
              "$RTP_LOCAL_RANK; echo oops $RTP_RANK >&2; "
              "test ${#RTP_TOKEN} -ge 32 && test $RTP_MASTER_PORT -gt 0 && printf last'");
  EXPECT_EQ(o.code, 0) << o.text;
  for (int r = 0; r < 3; r++) {
    std::string p = "[" + std::to_string(r) + "] ";
    EXPECT_TRUE(has(
        o.text, p + "hello " + std::to_string(r) + " of 3 local " + std::to_string(r) + "\n"))
        << o.text;
    EXPECT_TRUE(has(o.text, p + "oops " + std::to_string(r) + "\n")) << o.text;
    EXPECT_TRUE(has(o.text, p + "last\n")) << o.text;  // an unterminated last line
  }
}

TEST(Run, FailureStopsTheOthers) {
  Out o = run(kRun +
              " -n 3 -- sh -c 'if [ $RTP_RANK = 1 ]; then echo bye; exit 7; fi; "
              "exec sleep 30'");
  EXPECT_EQ(o.code, 7) << o.text;
  EXPECT_TRUE(has(o.text, "rank 1 exited with status 7")) << o.text;
  EXPECT_TRUE(has(o.text, "[1] bye")) << o.text;
  EXPECT_LT(o.seconds, 4) << o.text;  // SIGTERM worked; SIGKILL comes only after 5 s
}

TEST(Run, KilledRank) {
  Out o = run(kRun +
              " -n 2 -- sh -c 'if [ $RTP_RANK = 0 ]; then kill -9 $$; fi; "
              "exec sleep 30'");
  EXPECT_NE(o.code, 0) << o.text;
  EXPECT_TRUE(has(o.text, "rank 0 was killed by signal 9")) << o.text;
  EXPECT_LT(o.seconds, 10) << o.text;
}

TEST(Run, ForwardsSigterm) {
  // rtp-run in the background, SIGTERM to it: the ranks get it and the job ends non-zero
  Out o = run("sh -c '" + kRun +
              " -n 2 -- sh -c \"trap \\\"echo got term; exit 3\\\" TERM; "
              "sleep 30 & wait\" & pid=$!; sleep 0.5; kill -TERM $pid; wait $pid; "
              "echo code $?'");
  EXPECT_TRUE(has(o.text, "[0] got term")) << o.text;
  EXPECT_TRUE(has(o.text, "[1] got term")) << o.text;
  EXPECT_TRUE(has(o.text, "code 143")) << o.text;
  EXPECT_LT(o.seconds, 10) << o.text;
}

TEST(Run, BadUsage) {
  EXPECT_EQ(run(kRun + " -n 2").code, 2);
  EXPECT_EQ(run(kRun + " --nnodes 2 -n 1 -- true").code, 2);  // needs --master
  Out o = run(kRun + " -n 1 -- /nonexistent/program");
  EXPECT_EQ(o.code, 127) << o.text;
  EXPECT_TRUE(has(o.text, "rank 0 exited with status 127")) << o.text;
}

// Numbers out of range are refused with exit 2 and the range before any rank starts:
// atoi would have read "2x" as 2, "1e3" as 1 and a bad --timeout-ms as none at all, and a
// world too large for the library would have started its ranks only for them to fail.
TEST(Run, BadNumbersAreRefused) {
  const std::pair<std::string, std::string> cases[] = {
      {"-n 0", "-n wants an integer from 1 to 65536, not '0'"},
      {"-n 2x", "-n wants an integer from 1 to 65536, not '2x'"},
      {"--nproc-per-node -1", "--nproc-per-node wants an integer from 1 to 65536, not '-1'"},
      {"-n 2 --timeout-ms 0", "--timeout-ms wants an integer from 1 to 86400000, not '0'"},
      {"-n 2 --timeout-ms -5", "--timeout-ms wants an integer from 1 to 86400000, not '-5'"},
      {"-n 2 --timeout-ms 1e3", "--timeout-ms wants an integer from 1 to 86400000, not '1e3'"},
      {"-n 2 --nnodes 0", "--nnodes wants an integer from 1 to 65536, not '0'"},
      {"-n 256 --nnodes 512 --node-rank 0 --master h:1", "-n 256 x --nnodes 512 is more than"},
      {"-n 1 --nnodes 2 --node-rank 2 --master h:1", "--node-rank 2 must be below --nnodes 2"},
  };
  for (const auto &c : cases) {
    Out o = run("RTP_TOKEN=t " + kRun + " " + c.first + " -- echo started");
    EXPECT_EQ(o.code, 2) << c.first << ": " << o.text;
    EXPECT_TRUE(has(o.text, "rtp-run: " + c.second)) << c.first << ": " << o.text;
    EXPECT_FALSE(has(o.text, "started")) << c.first << ": " << o.text;
  }
}

// --help names every flag rtp-run parses, every variable it reads or sets and every one the
// library reads in a rank, all taken from the sources: a new one cannot go unmentioned.
TEST(Run, HelpNamesEveryFlagAndVariable) {
  Out o = run(kRun + " --help");
  EXPECT_EQ(o.code, 0) << o.text;
  const std::string root = std::string(RTP_TEST_DIR) + "/..";
  const std::regex var(R"re((?:getenv|setenv|env_str|env_int)\("(RTP_\w+)")re");
  std::set<std::string> flags, vars;
  std::string launcher = slurp(root + "/tools/rtp-run.c");
  collect(launcher, std::regex(R"re(strcmp\(a, "(--?[a-z][-a-z]*)"\))re"), &flags);
  collect(launcher, var, &vars);
  DIR *d = opendir(root.c_str());
  ASSERT_NE(d, nullptr);
  while (dirent *e = readdir(d)) {
    std::string n = e->d_name;
    if (std::regex_match(n, std::regex(R"(.*\.(c|cu))")))
      collect(slurp(root + "/" + n), var, &vars);
  }
  closedir(d);
  // the sources still read the way the patterns expect
  EXPECT_TRUE(flags.count("--timeout-ms") && flags.count("-n")) << flags.size();
  EXPECT_TRUE(vars.count("RTP_RUN_BLAME_FD") && vars.count("RTP_IFNAME") &&
              vars.count("RTP_TRACE"))
      << vars.size();
  for (const std::string &f : flags) EXPECT_TRUE(names(o.text, f)) << f << "\n" << o.text;
  for (const std::string &v : vars) EXPECT_TRUE(names(o.text, v)) << v << "\n" << o.text;
}

// A real job: the ranks are this binary running the RunWorker tests.
TEST(Run, CommJob) {
  std::string cmd =
      "RTP_RUN_WORKER=ok " + kRun + " -n 3 -- " + self() + " --gtest_filter=RunWorker.Job";
  Out o = run(cmd);
  EXPECT_EQ(o.code, 0) << o.text;
  for (int r = 0; r < 3; r++)
    EXPECT_TRUE(has(o.text, "[" + std::to_string(r) + "] worker ok")) << o.text;
}

// Binding by interface name, and an IPv6 master address.
TEST(Run, CommJobIfnameAndIPv6) {
  Out o = run("RTP_RUN_WORKER=ok RTP_IFNAME=lo " + kRun + " -n 2 -- " + self() +
              " --gtest_filter=RunWorker.Job");
  EXPECT_EQ(o.code, 0) << o.text;
  EXPECT_TRUE(has(o.text, "[1] worker ok")) << o.text;
  int port = free_port();
  o = run("RTP_RUN_WORKER=ok " + kRun + " -n 2 --master '[::1]:" + std::to_string(port) +
          "' -- " + self() + " --gtest_filter=RunWorker.Job");
  if (has(o.text, "cannot listen") || has(o.text, "address not available"))
    GTEST_SKIP() << "no IPv6 loopback here";
  EXPECT_EQ(o.code, 0) << o.text;
  EXPECT_TRUE(has(o.text, "[1] worker ok")) << o.text;
}

// Rank 2 aborts in the middle of the job: rtp-run names it, the others do not hang.
TEST(Run, CommJobRankDies) {
  std::string cmd = "RTP_RUN_WORKER=die RTP_TIMEOUT_MS=10000 " + kRun + " -n 3 -- " + self() +
                    " --gtest_filter=RunWorker.Job";
  Out o = run(cmd);
  EXPECT_NE(o.code, 0) << o.text;
  EXPECT_TRUE(has(o.text, "rtp-run: rank 2 was killed by signal 6")) << o.text;
  EXPECT_LT(o.seconds, 20) << o.text;
}

// Rank 2 stops (SIGSTOP) in the middle of the job: the rank that notices fails first,
// but the launcher's last line names rank 2, which went silent.
TEST(Run, CommJobRankSilent) {
  std::string cmd = "RTP_RUN_WORKER=silent RTP_TIMEOUT_MS=2000 " + kRun + " -n 3 -- " + self() +
                    " --gtest_filter=RunWorker.Job";
  Out o = run(cmd);
  EXPECT_NE(o.code, 0) << o.text;
  size_t last = o.text.rfind("rtp-run: job failed: ");
  ASSERT_NE(last, std::string::npos) << o.text;
  EXPECT_EQ(o.text.compare(last, 40, "rtp-run: job failed: rank 2 went silent "), 0) << o.text;
  EXPECT_LT(o.seconds, 20) << o.text;
}

TEST(RunWorker, Job) {
  const char *mode = getenv("RTP_RUN_WORKER");
  if (!mode) GTEST_SKIP() << "runs under rtp-run only (Run.CommJob)";
  rtp_comm_params p;
  ASSERT_EQ(rtp_comm_params_from_env(&p), RTP_OK) << rtp_last_error();
  rtp_comm *c;
  ASSERT_EQ(rtp_comm_init(&p, &c), RTP_OK) << rtp_last_error();
  int rank = rtp_comm_rank(c), n = rtp_comm_size(c);
  for (int step = 0; step < 20; step++) {
    if (!strcmp(mode, "die") && rank == 2 && step == 5) abort();
    if (!strcmp(mode, "silent") && rank == 2 && step == 5) raise(SIGSTOP);
    std::vector<float> v(12345, (float)rank);
    ASSERT_EQ(rtp_comm_allreduce(c, v.data(), v.size(), nullptr), RTP_OK) << rtp_last_error();
    ASSERT_EQ(v[777], (float)(n * (n - 1) / 2));
  }
  printf("worker ok\n");
  rtp_comm_free(c);
}
