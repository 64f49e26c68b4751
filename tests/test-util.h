// test-util.h - the helpers the tests share: free ports, forking ranks (or any child
// process) with a deadline, a rank's check of a failure it expects, and a common way to
// build communicator parameters.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "rtp.h"
#include "tools/free-port.h"

// Set by LeakSanitizer (ASan builds): forked ranks end with _exit, which skips the
// end-of-process leak check, so they run it themselves.
extern "C" void __lsan_do_leak_check(void) __attribute__((weak));

// In a rank's function (an int rank in scope): fail the rank with a message.
#define CHECK_OK(x)                                                                \
  do {                                                                             \
    int st_ = (x);                                                                 \
    if (st_ != RTP_OK) {                                                           \
      fprintf(stderr, "rank %d: %s failed: %s: %s\n", rank, #x, rtp_strerror(st_), \
              rtp_last_error());                                                   \
      return 10;                                                                   \
    }                                                                              \
  } while (0)

#define CHECK(cond, ...)                                                               \
  do {                                                                                 \
    if (!(cond)) {                                                                     \
      fprintf(stderr, "rank %d: check %s failed at line %d: ", rank, #cond, __LINE__); \
      fprintf(stderr, __VA_ARGS__);                                                    \
      fprintf(stderr, "\n");                                                           \
      return 11;                                                                       \
    }                                                                                  \
  } while (0)

namespace rtptest {

// Element i of t as f32 (rtp_tensor_get_f32); NaN where it cannot be read, which fails
// every comparison.
inline float f32_at(const rtp_tensor *t, int64_t i) {
  float v;
  return rtp_tensor_get_f32(t, i, &v) == RTP_OK ? v : std::nanf("");
}

using ::free_port;  // tools/free-port.h: a free port, reserved among the tests

// A stranger's flood of 127.0.0.1:port until done() says stop: 600 connections kept open
// (nonblocking connects, reopened as the listener drops them), the first 30 trickling a
// byte at a time. Returns how many it opened.
inline long flood_port(int port, const std::function<bool()> &done) {
  std::vector<int> fds;
  long opened = 0;
  while (!done()) {
    while (fds.size() < 600) {
      int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      a.sin_port = htons((uint16_t)port);
      if (fd < 0) break;
      if (connect(fd, (sockaddr *)&a, sizeof(a)) < 0 && errno != EINPROGRESS) {
        close(fd);
        break;
      }
      fds.push_back(fd);
      opened++;
    }
    std::vector<int> open;
    for (size_t i = 0; i < fds.size(); i++) {
      char ch;
      if (i < 30) send(fds[i], "R", 1, MSG_NOSIGNAL | MSG_DONTWAIT);
      ssize_t r = recv(fds[i], &ch, 1, MSG_DONTWAIT);
      if (r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != ENOTCONN))
        close(fds[i]);
      else
        open.push_back(fds[i]);
    }
    fds.swap(open);
    usleep(20000);
  }
  for (int fd : fds) close(fd);
  return opened;
}

// Block b of n of a count-element tensor for the rotation tests: distinct values that
// say which element and which block they are.
inline std::vector<float> rotation_block(size_t count, int n, int b) {
  size_t first, len;
  rtp_comm_block(count, n, b, &first, &len);
  std::vector<float> v(len);
  for (size_t i = 0; i < len; i++) v[i] = (float)(first + i) * 0.5f + (float)b;
  return v;
}

inline double now_s() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

// A /proc/self/status figure in bytes: "VmRSS:" (resident now), "VmHWM:" (the peak).
inline size_t proc_bytes(const char *key) {
  FILE *f = fopen("/proc/self/status", "r");
  char line[256];
  size_t kb = 0;
  while (f && fgets(line, sizeof(line), f))
    if (strncmp(line, key, strlen(key)) == 0)
      kb = strtoull(line + strlen(key) + 1, nullptr, 10);
  if (f) fclose(f);
  return kb * 1024;
}

inline bool contains(const std::string &s, const std::string &what) {
  return s.find(what) != std::string::npos;
}

// A rank's check of a failure it expects: status st is one of statuses, the message has one
// of words, and it came within max_s seconds of t0. With a communicator c, a later
// operation on c must fail at once too. Returns the rank's exit code: 0 as expected, 3 it
// succeeded, 4 another status or message, 5 too slow.
inline int expect_failure(int rank, int st, double t0, double max_s,
                          const std::vector<int> &statuses,
                          const std::vector<std::string> &words, rtp_comm *c = nullptr) {
  double dt = now_s() - t0;
  std::string msg = rtp_last_error();
  fprintf(stderr, "rank %d: status %d (%s) after %.2f s: %s\n", rank, st, rtp_strerror(st), dt,
          msg.c_str());
  if (st == RTP_OK) return 3;
  bool ok_status = false;
  for (int s : statuses) ok_status |= s == st;
  bool ok_words = false;
  for (auto &w : words) ok_words |= contains(msg, w);
  if (!ok_status) fprintf(stderr, "rank %d: unexpected status %d\n", rank, st);
  if (!ok_words)
    fprintf(stderr, "rank %d: '%s' is not in the message\n", rank,
            words.empty() ? "" : words[0].c_str());
  if (!ok_status || !ok_words) return 4;
  if (dt > max_s) {
    fprintf(stderr, "rank %d: took %.2f s\n", rank, dt);
    return 5;
  }
  if (!c) return 0;
  float x = 1;  // later operations fail at once
  if (rtp_comm_allreduce(c, &x, 1, nullptr) == RTP_OK) {
    fprintf(stderr, "rank %d: an operation after the failure succeeded\n", rank);
    return 3;
  }
  return 0;
}

inline int expect_failure(int rank, int st, double t0, double max_s,
                          const std::vector<int> &statuses, const char *word,
                          rtp_comm *c = nullptr) {
  return expect_failure(rank, st, t0, max_s, statuses, std::vector<std::string>{word}, c);
}

// The tests' job token: long enough for rtp_comm_init, which refuses guessable ones.
inline constexpr const char *kTestToken = "test-token-of-the-rtp-unit-tests";

inline rtp_comm_params params(int rank, int size, int port, int timeout_ms = 20000,
                              const char *token = kTestToken) {
  rtp_comm_params p = rtp_comm_params_default();
  snprintf(p.backend, sizeof(p.backend), "tcp");
  p.rank = rank;
  p.world_size = size;
  snprintf(p.master_addr, sizeof(p.master_addr), "127.0.0.1");
  p.master_port = port;
  snprintf(p.token, sizeof(p.token), "%s", token);
  p.timeout_ms = timeout_ms;
  return p;
}

struct Result {
  int code = -1;  // exit code, or -signal, -1000 if killed at the deadline, -1001 if not forked
};

// Runs fn(i) in n forked processes. Processes listed in expendable are killed once all the
// others have exited. Everything is killed after timeout_s. Returns one result per process.
inline std::vector<Result> run_procs(int n, const std::function<int(int)> &fn,
                                     double timeout_s = 60, std::vector<int> expendable = {}) {
  fflush(stdout);
  fflush(stderr);
  std::vector<pid_t> pids(n);
  for (int i = 0; i < n; i++) {
    pid_t pid = fork();
    if (pid == 0) {
      int code = 1;
      code = fn(i);
      if (__lsan_do_leak_check) __lsan_do_leak_check();
      fflush(stdout);
      fflush(stderr);
      _exit(code);
    }
    pids[i] = pid;
  }
  std::vector<Result> res(n);
  std::vector<bool> done(n, false);
  double t0 = now_s();
  int left = n;
  for (int i = 0; i < n; i++)
    if (pids[i] < 0) {  // fork failed: nothing to wait for, and never kill(-1)
      perror("fork");
      res[i].code = -1001;
      done[i] = true;
      left--;
    }
  while (left > 0) {
    bool progress = false;
    for (int i = 0; i < n; i++) {
      if (done[i]) continue;
      int st;
      pid_t r = waitpid(pids[i], &st, WNOHANG);
      if (r == pids[i]) {
        done[i] = true;
        left--;
        progress = true;
        res[i].code = WIFEXITED(st) ? WEXITSTATUS(st) : -WTERMSIG(st);
      }
    }
    bool only_expendable = left > 0;
    for (int i = 0; i < n; i++) {
      bool exp = false;
      for (int e : expendable) exp |= e == i;
      if (!done[i] && !exp) only_expendable = false;
    }
    if (only_expendable || now_s() - t0 > timeout_s) {
      for (int i = 0; i < n; i++)
        if (!done[i]) {
          kill(pids[i], SIGKILL);
          kill(pids[i], SIGCONT);
          waitpid(pids[i], nullptr, 0);
          res[i].code = -1000;
          done[i] = true;
        }
      break;
    }
    if (!progress) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return res;
}

}  // namespace rtptest
