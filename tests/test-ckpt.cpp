// Sharded checkpoints (rtp-ckpt.c): a plan's parameter blocks and Adam states saved on 1 or
// 2 ranks load back exactly, also onto the other world size; only the newest two complete
// checkpoints are kept; a failed save leaves latest on the previous one; damaged
// checkpoints are refused with a message naming the fault; index.json is read as JSON
// (any order, spacing, escapes) and refused whole when any field is wrong; a pipeline's
// checkpoint (the GPT of examples/gpt trained on S stages x D ranks) loads bit for bit onto
// other pipelines, flat jobs and one process, and theirs onto pipelines.
#include <gtest/gtest.h>
#include <openssl/sha.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <regex>
#include <string>
#include <vector>

#include "gpt.h"
#include "rtp.h"
#include "test-gpt-ranks.h"
#include "test-util.h"

namespace {

std::string tmp_dir(const char *name) {
  std::string d = testing::TempDir() + "rtp-ckpt-" + name + "-" + std::to_string(getpid());
  return std::system(("rm -rf '" + d + "'").c_str()) == 0 ? d : "";
}

// Removes every directory tmp_dir made once the tests have run.
class Cleanup : public testing::Environment {
  void TearDown() override {
    std::string pattern = testing::TempDir() + "rtp-ckpt-*-" + std::to_string(getpid());
    if (std::system(("rm -rf " + pattern).c_str()) != 0) fprintf(stderr, "cleanup failed\n");
  }
};
testing::Environment *const cleanup = testing::AddGlobalTestEnvironment(new Cleanup);

// A two-parameter model (w: 6 rows of 8, b: 6) made parallel, with its optimizer; or
// (mlp) a two-layer MLP marked for tp: fc.w {8, 12} and fc.b column-parallel (a rank holds
// rows), proj.w {12, 6} row-parallel (a rank holds columns), proj.b replicated.
struct Plan {
  rtp_context *meta = nullptr, *ctx = nullptr;
  rtp_comm *comm = nullptr;
  rtp_parallel *par = nullptr;
  rtp_optimizer *opt = nullptr;
  rtp_tensor *params[4] = {};
  int n_params = 2;
  rtp_strategy strategy = RTP_STRATEGY_NONE;

  bool build(rtp_strategy s, rtp_comm *c, bool mlp = false) {
    strategy = s;
    comm = c;
    meta = rtp_context_new({1 << 20, nullptr, true, nullptr, 0});
    ctx = rtp_context_new({4 << 20, nullptr, false, nullptr, 0});
    rtp_tensor *x = rtp_tensor_new_2d(meta, RTP_TYPE_F32, 8, 5), *loss = nullptr;
    rtp_tensor_set_input(x);
    if (mlp) {
      n_params = 4;
      params[0] = rtp_tensor_set_name(rtp_tensor_new_2d(meta, RTP_TYPE_F32, 8, 12), "fc.w");
      params[1] = rtp_tensor_set_name(rtp_tensor_new_1d(meta, RTP_TYPE_F32, 12), "fc.b");
      params[2] = rtp_tensor_set_name(rtp_tensor_new_2d(meta, RTP_TYPE_F32, 12, 6), "proj.w");
      params[3] = rtp_tensor_set_name(rtp_tensor_new_1d(meta, RTP_TYPE_F32, 6), "proj.b");
      for (rtp_tensor *t : params) rtp_tensor_set_param(t);
      if (rtp_tensor_set_tp(params[0], RTP_TP_COLUMN, 1) ||
          rtp_tensor_set_tp(params[1], RTP_TP_COLUMN, 1) ||
          rtp_tensor_set_tp(params[2], RTP_TP_ROW, 1))
        return false;
      rtp_tensor *h = rtp_gelu(meta, rtp_add(meta, rtp_mul_mat(meta, params[0], x), params[1]));
      loss = rtp_sum(meta, rtp_add(meta, rtp_mul_mat(meta, params[2], h), params[3]));
    } else {
      params[0] = rtp_tensor_set_name(rtp_tensor_new_2d(meta, RTP_TYPE_F32, 8, 6), "w");
      params[1] = rtp_tensor_set_name(rtp_tensor_new_1d(meta, RTP_TYPE_F32, 6), "b");
      rtp_tensor_set_param(params[0]);
      rtp_tensor_set_param(params[1]);
      loss = rtp_sum(meta, rtp_add(meta, rtp_mul_mat(meta, params[0], x), params[1]));
    }
    rtp_graph *g = rtp_graph_new(meta, 64);
    if (!loss || rtp_graph_build(g, loss)) return false;
    rtp_parallel_params pp{};
    pp.strategy = s;
    pp.comm = c;
    par = rtp_parallel_new(ctx, g, loss, &pp);
    if (!par || rtp_graph_plan(ctx, rtp_parallel_graph(par))) return false;
    opt = rtp_parallel_optimizer(par, rtp_adamw_params_default());
    return opt != nullptr;
  }
  ~Plan() {
    rtp_context_free(ctx);
    rtp_context_free(meta);
    rtp_comm_free(comm);
  }
  rtp_ckpt_params ckpt(const std::string &dir) const {
    static const char *const kv[] = {"seed", "42", nullptr};
    return {dir.c_str(), par, comm, strategy, params, n_params, opt, 0, kv, false};
  }
  // The value of element j of the whole of parameter i (k: 0 value, 1 m, 2 v) ...
  static float value(int i, int64_t j, int k) {
    return 0.001f * (float)(i * 1000 + j) + (float)k;
  }
  // ... this rank's part of it (rtp_parallel_shard_copy: any strategy) ...
  std::vector<float> expected(int i, int k) const {
    std::vector<float> whole(rtp_tensor_nelements(params[i]));
    for (size_t j = 0; j < whole.size(); j++) whole[j] = value(i, (int64_t)j, k);
    std::vector<float> mine(rtp_tensor_nelements(rtp_parallel_tensor(par, params[i])));
    EXPECT_EQ(rtp_parallel_shard_copy(par, params[i], whole.data(), mine.data()), RTP_OK);
    return mine;
  }
  // ... and parameter i's tensor on this rank with its Adam states.
  void states(int i, rtp_tensor *st[3]) const {
    st[0] = rtp_parallel_tensor(par, params[i]);
    st[1] = st[2] = nullptr;
    for (int k = 0; k < rtp_optimizer_count(opt); k++) {
      rtp_tensor *q, *m, *v;
      rtp_optimizer_state(opt, k, &q, &m, &v);
      if (q == st[0]) st[1] = m, st[2] = v;
    }
  }
  // Each rank holding its part of value(), or zeros (values = false) to be loaded into.
  void fill(bool values) {
    for (int i = 0; i < n_params; i++) {
      rtp_tensor *st[3];
      states(i, st);
      for (int k = 0; k < 3; k++) {
        std::vector<float> want = expected(i, k);
        for (size_t j = 0; j < want.size(); j++)
          ((float *)st[k]->data)[j] = values ? want[j] : 0.0f;
      }
    }
    rtp_optimizer_set_steps(opt, values ? 7 : 0);
  }
  // How many elements differ from value() (states included), and the step count.
  int mismatches() {
    int bad = rtp_optimizer_steps(opt) != 7;
    for (int i = 0; i < n_params; i++) {
      rtp_tensor *st[3];
      states(i, st);
      if (!st[1]) return bad + 1000;
      for (int k = 0; k < 3; k++) {
        std::vector<float> want = expected(i, k);
        for (size_t j = 0; j < want.size(); j++) bad += ((float *)st[k]->data)[j] != want[j];
      }
    }
    return bad;
  }
};

// One process: save, clear, load.
int save_one(const std::string &dir, int64_t step, bool mlp = false) {
  Plan p;
  if (!p.build(RTP_STRATEGY_NONE, nullptr, mlp)) return 10;
  p.fill(true);
  rtp_ckpt_params cp = p.ckpt(dir);
  return rtp_ckpt_save(&cp, step) ? 11 : 0;
}

int load_and_check(Plan &p, const std::string &dir) {
  p.fill(false);
  rtp_ckpt *c = nullptr;
  if (rtp_ckpt_open(dir.c_str(), &c)) return 30;
  rtp_ckpt_params cp = p.ckpt(dir);
  int rc = rtp_ckpt_load(c, &cp);
  bool state_ok = rtp_ckpt_state(c, "seed") && std::string(rtp_ckpt_state(c, "seed")) == "42";
  rtp_ckpt_close(c);
  if (rc) {
    fprintf(stderr, "load: %s\n", rtp_last_error());
    return 31;
  }
  if (!state_ok) return 32;
  int bad = p.mismatches();
  if (bad) fprintf(stderr, "%d values differ after loading\n", bad);
  return bad ? 33 : 0;
}

int load_one(const std::string &dir, bool mlp = false) {
  Plan p;
  return p.build(RTP_STRATEGY_NONE, nullptr, mlp) ? load_and_check(p, dir) : 20;
}

// n ranks: save (fill) or load, with strategy s; the first failing rank's code.
int on_ranks(int n, rtp_strategy s, const std::string &dir, bool save, bool mlp = false) {
  int port = rtptest::free_port();
  auto res = rtptest::run_procs(n, [&](int r) {
    rtp_comm_params cp = rtptest::params(r, n, port);
    rtp_comm *comm = nullptr;
    if (rtp_comm_init(&cp, &comm)) return 40;
    Plan p;
    if (!p.build(s, comm, mlp)) return 41;
    if (!save) return load_and_check(p, dir);
    p.fill(true);
    rtp_ckpt_params ck = p.ckpt(dir);
    return rtp_ckpt_save(&ck, 5) ? 42 : 0;
  });
  for (const rtptest::Result &r : res)
    if (r.code) return r.code;
  return 0;
}

int on_two_ranks(rtp_strategy s, const std::string &dir, bool save) {
  return on_ranks(2, s, dir, save);
}

TEST(Ckpt, RoundTripOneProcess) {
  std::string dir = tmp_dir("one");
  ASSERT_EQ(save_one(dir, 3), 0) << rtp_last_error();
  EXPECT_EQ(load_one(dir), 0);
  std::ifstream latest(dir + "/latest");
  std::string name;
  latest >> name;
  EXPECT_EQ(name, "step-00000003");
}

// A save marked best is what DIR/best names, and outlives the pruning of all but the newest
// two; a later best moves the mark and lets the old one go. rtp_ckpt_open_best opens it
// (a directory without one says so), and it loads.
TEST(Ckpt, BestOutlivesPruning) {
  std::string dir = tmp_dir("best");
  Plan p;
  ASSERT_TRUE(p.build(RTP_STRATEGY_NONE, nullptr)) << rtp_last_error();
  p.fill(true);
  rtp_ckpt_params cp = p.ckpt(dir);
  auto steps_kept = [&] {
    std::vector<int> kept;
    for (int s = 1; s <= 6; s++) {
      char name[32];
      std::snprintf(name, sizeof(name), "/step-%08d", s);
      if (access((dir + name).c_str(), F_OK) == 0) kept.push_back(s);
    }
    return kept;
  };
  rtp_ckpt *c = nullptr;
  for (int s = 1; s <= 4; s++) {
    cp.best = s == 2;
    ASSERT_EQ(rtp_ckpt_save(&cp, s), RTP_OK) << rtp_last_error();
    if (s == 1) {
      EXPECT_NE(rtp_ckpt_open_best(dir.c_str(), &c), RTP_OK);
      EXPECT_NE(std::string(rtp_last_error()).find("no best checkpoint"), std::string::npos)
          << rtp_last_error();
    }
  }
  EXPECT_EQ(steps_kept(), (std::vector<int>{2, 3, 4}));
  ASSERT_EQ(rtp_ckpt_open_best(dir.c_str(), &c), RTP_OK) << rtp_last_error();
  EXPECT_EQ(rtp_ckpt_step(c), 2);
  p.fill(false);
  EXPECT_EQ(rtp_ckpt_load(c, &cp), RTP_OK) << rtp_last_error();
  EXPECT_EQ(p.mismatches(), 0);
  rtp_ckpt_close(c);
  for (int s = 5; s <= 6; s++) {
    cp.best = s == 5;
    ASSERT_EQ(rtp_ckpt_save(&cp, s), RTP_OK) << rtp_last_error();
  }
  EXPECT_EQ(steps_kept(), (std::vector<int>{5, 6}));
  std::ifstream best(dir + "/best");
  std::string name;
  best >> name;
  EXPECT_EQ(name, "step-00000005");
}

// Adam's states are saved as adam.m.<name> and adam.v.<name>, which must fit a tensor's
// name: a parameter name that leaves them no room is refused before anything is written,
// and the longest one allowed saves and loads.
TEST(Ckpt, LongParameterNames) {
  std::string dir = tmp_dir("long-names");
  const std::string longest(56, 'p'), too_long(57, 'p');
  {
    Plan p;
    ASSERT_TRUE(p.build(RTP_STRATEGY_NONE, nullptr)) << rtp_last_error();
    p.fill(true);
    rtp_tensor_set_name(p.params[0], "%s", too_long.c_str());
    rtp_ckpt_params cp = p.ckpt(dir);
    EXPECT_EQ(rtp_ckpt_save(&cp, 1), RTP_EINVAL);
    EXPECT_NE(std::string(rtp_last_error()).find("at most 56 characters"), std::string::npos)
        << rtp_last_error();
    EXPECT_FALSE(std::ifstream(dir + "/latest").good());
    rtp_tensor_set_name(p.params[0], "%s", longest.c_str());
    ASSERT_EQ(rtp_ckpt_save(&cp, 1), RTP_OK) << rtp_last_error();
  }
  Plan q;
  ASSERT_TRUE(q.build(RTP_STRATEGY_NONE, nullptr)) << rtp_last_error();
  rtp_tensor_set_name(q.params[0], "%s", longest.c_str());
  EXPECT_EQ(load_and_check(q, dir), 0);
}

TEST(Ckpt, RoundTripTwoRanksAndReshard) {
  for (rtp_strategy s : {RTP_STRATEGY_RTP, RTP_STRATEGY_DDP}) {
    std::string dir = tmp_dir(rtp_strategy_name(s));
    ASSERT_EQ(on_two_ranks(s, dir, true), 0) << rtp_strategy_name(s);
    EXPECT_EQ(on_two_ranks(s, dir, false), 0) << rtp_strategy_name(s);
    EXPECT_EQ(load_one(dir), 0) << rtp_strategy_name(s) << " on 2 ranks, loaded on 1";
    EXPECT_EQ(
        on_two_ranks(s == RTP_STRATEGY_RTP ? RTP_STRATEGY_DDP : RTP_STRATEGY_FSDP, dir, false),
        0)
        << "saved with " << rtp_strategy_name(s) << ", loaded with another strategy";
  }
  std::string one = tmp_dir("one-to-two");
  ASSERT_EQ(save_one(one, 5), 0);
  EXPECT_EQ(on_two_ranks(RTP_STRATEGY_RTP, one, false), 0) << "1 process, loaded on 2 ranks";
}

// tp holds fc.w as rows, proj.w as columns and proj.b whole; its files hold the row blocks
// rtp's would (rank 1: rows [6, 12) of fc.w, [3, 6) of proj.w and of proj.b), so its
// checkpoints load on 1, 2 or 3 ranks under any strategy, and rtp's load under tp.
TEST(Ckpt, TpSavesRowBlocksThatLoadAnywhere) {
  std::string dir = tmp_dir("tp");
  ASSERT_EQ(on_ranks(2, RTP_STRATEGY_TP, dir, true, true), 0);
  rtp_safetensors *st = nullptr;
  ASSERT_EQ(rtp_safetensors_open((dir + "/step-00000005/rank-1.safetensors").c_str(), &st), 0)
      << rtp_last_error();
  rtp_context *ctx = rtp_context_new({1 << 20, nullptr, false, nullptr, 0});
  const struct {
    const char *name;
    int param;
    int64_t ne0, rows, first;
  } want[] = {{"fc.w", 0, 8, 6, 6}, {"adam.v.proj.w", 2, 12, 3, 3}, {"proj.b", 3, 6, 3, 3}};
  for (const auto &w : want) {
    rtp_tensor *t = rtp_safetensors_load(ctx, st, w.name);
    ASSERT_NE(t, nullptr) << w.name << ": " << rtp_last_error();
    int64_t ne0 = w.param == 3 ? w.rows : w.ne0, ne1 = w.param == 3 ? 1 : w.rows;
    EXPECT_EQ(t->ne[0], ne0) << w.name;
    EXPECT_EQ(t->ne[1], ne1) << w.name;
    int k = std::string(w.name).rfind("adam.v.", 0) == 0 ? 2 : 0, bad = 0;
    int64_t off = w.first * (w.param == 3 ? 1 : w.ne0);
    for (int64_t j = 0; j < rtp_tensor_nelements(t); j++)
      bad += ((float *)t->data)[j] != Plan::value(w.param, off + j, k);
    EXPECT_EQ(bad, 0) << w.name << ": values not those of its rows";
  }
  rtp_context_free(ctx);
  rtp_safetensors_close(st);
  EXPECT_EQ(on_ranks(2, RTP_STRATEGY_TP, dir, false, true), 0) << "tp on 2 ranks, loaded so";
  EXPECT_EQ(on_ranks(3, RTP_STRATEGY_TP, dir, false, true), 0) << "loaded by tp on 3 ranks";
  EXPECT_EQ(on_ranks(2, RTP_STRATEGY_RTP, dir, false, true), 0) << "loaded by rtp";
  EXPECT_EQ(on_ranks(2, RTP_STRATEGY_DDP, dir, false, true), 0) << "loaded by ddp";
  EXPECT_EQ(load_one(dir, true), 0) << "loaded by one process";
  std::string from_rtp = tmp_dir("rtp-to-tp");
  ASSERT_EQ(on_ranks(2, RTP_STRATEGY_RTP, from_rtp, true, true), 0);
  EXPECT_EQ(on_ranks(2, RTP_STRATEGY_TP, from_rtp, false, true), 0) << "rtp's, loaded by tp";
}

TEST(Ckpt, KeepsTheNewestTwoAndSurvivesAFailedSave) {
  std::string dir = tmp_dir("keep");
  for (int step : {1, 2, 3}) ASSERT_EQ(save_one(dir, step), 0) << rtp_last_error();
  EXPECT_NE(access((dir + "/step-00000001").c_str(), F_OK), 0);
  EXPECT_EQ(access((dir + "/step-00000002/COMPLETE").c_str(), F_OK), 0);
  // A step directory that cannot be created: the save fails, latest stays on step 3.
  std::ofstream(dir + "/step-00000004") << "in the way";
  EXPECT_EQ(save_one(dir, 4), 11);
  EXPECT_NE(std::string(rtp_last_error()).find("step-00000004"), std::string::npos);
  rtp_ckpt *c = nullptr;
  ASSERT_EQ(rtp_ckpt_open(dir.c_str(), &c), 0) << rtp_last_error();
  EXPECT_EQ(rtp_ckpt_step(c), 3);
  rtp_ckpt_close(c);
  EXPECT_EQ(load_one(dir), 0);
  // A complete checkpoint is never overwritten.
  EXPECT_EQ(save_one(dir, 3), 11);
}

// A save killed after its COMPLETE marker but before latest moved leaves a complete step
// that latest does not name; the run resumed from latest saves that step again, which
// must replace it (not stop the run for good). A complete step that latest names, or an
// older one, is still never overwritten.
TEST(Ckpt, AStepCompletedButNotLatestIsSavedAgain) {
  std::string dir = tmp_dir("orphan");
  for (int step : {1, 2}) ASSERT_EQ(save_one(dir, step), 0) << rtp_last_error();
  std::ofstream(dir + "/latest") << "step-00000001\n";
  ASSERT_EQ(save_one(dir, 2), 0) << rtp_last_error();
  std::ifstream latest(dir + "/latest");
  std::string name;
  latest >> name;
  EXPECT_EQ(name, "step-00000002");
  EXPECT_EQ(load_one(dir), 0);
  EXPECT_EQ(save_one(dir, 2), 11);
  EXPECT_NE(std::string(rtp_last_error()).find("latest or best names"), std::string::npos)
      << rtp_last_error();
  EXPECT_EQ(save_one(dir, 1), 11);
  std::ofstream(dir + "/latest") << "garbage\n";  // names nothing one can tell
  EXPECT_EQ(save_one(dir, 3), 0) << "a new step";
  std::ofstream(dir + "/latest") << "garbage\n";
  EXPECT_EQ(save_one(dir, 3), 11) << "a complete step, with latest unreadable";
}

// A save whose write fails on one rank (rank 1's files may not grow past 64 bytes: EFBIG)
// fails on both, each naming the cause, and rank 0 removes the step directory, its own
// file included: latest stays on the previous checkpoint, which loads.
TEST(Ckpt, AWriteFailingOnOneRankLeavesNothing) {
  std::string dir = tmp_dir("efbig");
  ASSERT_EQ(save_one(dir, 3), 0) << rtp_last_error();
  int port = rtptest::free_port();
  auto res = rtptest::run_procs(2, [&](int r) {
    rtp_comm_params cp = rtptest::params(r, 2, port);
    rtp_comm *comm = nullptr;
    if (rtp_comm_init(&cp, &comm)) return 40;
    Plan p;
    if (!p.build(RTP_STRATEGY_RTP, comm)) return 41;
    p.fill(true);
    rlimit small = {64, 64};
    if (r == 1 && (signal(SIGXFSZ, SIG_IGN) == SIG_ERR || setrlimit(RLIMIT_FSIZE, &small)))
      return 42;
    rtp_ckpt_params ck = p.ckpt(dir);
    if (rtp_ckpt_save(&ck, 5) == RTP_OK) return 43;
    std::string why = rtp_last_error();
    if (why.find(r ? "File too large" : "rank 1 could not write its file") != std::string::npos)
      return 0;
    fprintf(stderr, "rank %d: %s\n", r, why.c_str());
    return 44;
  });
  EXPECT_EQ(res[0].code, 0);
  EXPECT_EQ(res[1].code, 0);
  EXPECT_NE(access((dir + "/step-00000005").c_str(), F_OK), 0) << "the failed save is left";
  rtp_ckpt *c = nullptr;
  ASSERT_EQ(rtp_ckpt_open(dir.c_str(), &c), 0) << rtp_last_error();
  EXPECT_EQ(rtp_ckpt_step(c), 3);
  rtp_ckpt_close(c);
  EXPECT_EQ(load_one(dir), 0);
}

// Damage to a copy of a good checkpoint: open or load fails with the given words.
void expect_refused(const char *what, const std::string &damage, const char *message) {
  std::string dir = tmp_dir(what), step = dir + "/step-00000001";
  ASSERT_EQ(save_one(dir, 1), 0);
  ASSERT_EQ(std::system(("cd '" + step + "' && " + damage).c_str()), 0) << damage;
  Plan p;
  ASSERT_TRUE(p.build(RTP_STRATEGY_NONE, nullptr));
  rtp_ckpt *c = nullptr;
  int rc = rtp_ckpt_open(dir.c_str(), &c);
  rtp_ckpt_params cp = p.ckpt(dir);
  if (!rc) rc = rtp_ckpt_load(c, &cp);
  rtp_ckpt_close(c);
  EXPECT_NE(rc, 0) << what;
  EXPECT_NE(std::string(rtp_last_error()).find(message), std::string::npos)
      << what << ": " << rtp_last_error();
}

TEST(Ckpt, DamagedCheckpointsAreRefused) {
  expect_refused("flip",
                 "printf X | dd of=rank-0.safetensors bs=1 conv=notrunc 2>/dev/null "
                 "seek=$(($(stat -c%s rank-0.safetensors) - 10))",
                 "checksum mismatch (corrupted)");
  expect_refused("truncate", "truncate -s -4 rank-0.safetensors", "rank-0.safetensors");
  expect_refused("marker", "rm COMPLETE", "no COMPLETE marker");
  expect_refused("index", "sed -i s/42/43/ index.json", "index.json: checksum mismatch");
  expect_refused("latest", "echo bogus > ../latest", "step-<8 digits>");
}

// A checkpoint's file replaced by a FIFO, a device or a directory, or grown past what it
// may hold, is refused by its type or size before it is read, naming it: a FIFO opened
// for reading would wait for a writer, so each open and load runs in a child process with
// a deadline.
TEST(Ckpt, SpecialFilesAreRefusedWithoutBlocking) {
  const char *files[] = {"../latest", "index.json", "COMPLETE", "rank-0.safetensors"};
  const struct {
    const char *what, *damage, *message;
  } kinds[] = {
      {"fifo", "rm -f F && mkfifo F", ": is a FIFO, not a regular file"},
      {"device", "rm -f F && ln -s /dev/zero F", ": is a character device, not a regular file"},
      {"dir", "rm -f F && mkdir F", ": is a directory, not a regular file"},
      {"loop", "rm -f F && ln -s N F", ": cannot open: Too many levels of symbolic links"},
      {"huge", "truncate -s 1G F", " bytes, more than the "},
  };
  for (const char *file : files)
    for (const auto &k : kinds) {
      std::string name = std::string(file).substr(std::string(file).rfind('/') + 1);
      std::string dir = tmp_dir(("special-" + name + "-" + k.what).c_str());
      std::string step = dir + "/step-00000001", damage = k.damage;
      if (name == "rank-0.safetensors" && std::string(k.what) == "huge")
        continue;  // its size is the index's, checked before a read: below
      for (size_t at; (at = damage.find_first_of("FN")) != std::string::npos;)
        damage.replace(at, 1, damage[at] == 'F' ? file : name);
      ASSERT_EQ(save_one(dir, 1), 0) << rtp_last_error();
      ASSERT_EQ(std::system(("cd '" + step + "' && " + damage).c_str()), 0) << damage;
      SCOPED_TRACE(name + " " + k.what);
      auto child = rtptest::run_procs(
          1,
          [&](int) {
            Plan p;
            if (!p.build(RTP_STRATEGY_NONE, nullptr)) return 10;
            rtp_ckpt *c = nullptr;
            int rc = rtp_ckpt_open(dir.c_str(), &c);
            rtp_ckpt_params cp = p.ckpt(dir);
            if (!rc) rc = rtp_ckpt_load(c, &cp);
            rtp_ckpt_close(c);
            std::string msg = rtp_last_error();
            bool named = msg.find(name + k.message) != std::string::npos ||
                         (std::string(k.what) == "huge" &&
                          msg.find(name + ": 1073741824 bytes") != std::string::npos);
            fprintf(stderr, "%s %s: %s\n", name.c_str(), k.what, msg.c_str());
            return rc != RTP_OK && named ? 0 : 1;
          },
          20);
      EXPECT_EQ(child[0].code, 0) << "(-1000: it blocked)";
    }
  // A rank file of another size than the index says is refused before it is hashed.
  std::string dir = tmp_dir("special-rank-huge"), step = dir + "/step-00000001";
  ASSERT_EQ(save_one(dir, 1), 0) << rtp_last_error();
  ASSERT_EQ(truncate((step + "/rank-0.safetensors").c_str(), 1 << 30), 0);
  rtp_ckpt *c = nullptr;
  ASSERT_EQ(rtp_ckpt_open(dir.c_str(), &c), RTP_OK) << rtp_last_error();
  Plan p;
  ASSERT_TRUE(p.build(RTP_STRATEGY_NONE, nullptr));
  rtp_ckpt_params cp = p.ckpt(dir);
  EXPECT_NE(rtp_ckpt_load(c, &cp), RTP_OK);
  rtp_ckpt_close(c);
  EXPECT_NE(std::string(rtp_last_error())
                .find("rank-0.safetensors: truncated or changed: 1073741824 bytes"),
            std::string::npos)
      << rtp_last_error();
}

// ---- index.json read as JSON ---------------------------------------------------------

std::string slurp(const std::string &path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

std::string sha256_hex(const std::string &bytes) {
  unsigned char d[SHA256_DIGEST_LENGTH];
  SHA256((const unsigned char *)bytes.data(), bytes.size(), d);
  char hex[2 * SHA256_DIGEST_LENGTH + 1];
  for (int i = 0; i < SHA256_DIGEST_LENGTH; i++) snprintf(hex + 2 * i, 3, "%02x", d[i]);
  return hex;
}

// Replaces index.json in step and writes the COMPLETE marker that matches it, so that
// only the reader stands between the text and a load. The old files are removed first:
// ext4 flushes a file truncated and written again to disk on close, seconds per thousand.
void put_index(const std::string &step, const std::string &text) {
  std::remove((step + "/index.json").c_str());
  std::remove((step + "/COMPLETE").c_str());
  std::ofstream(step + "/index.json", std::ios::binary) << text;
  std::ofstream(step + "/COMPLETE") << "sha256 " << sha256_hex(text) << "\n";
}

// save_one's index.json (step 1) as its keys and their values' JSON text; text() puts it
// back together in any order and with any spacing.
struct Index {
  std::vector<std::pair<std::string, std::string>> top;
  std::string bytes, sha;  // of rank-0.safetensors, as JSON

  explicit Index(const std::string &step) {
    std::string rank0 = slurp(step + "/rank-0.safetensors");
    bytes = std::to_string(rank0.size());
    sha = "\"" + sha256_hex(rank0) + "\"";
    const std::string written = slurp(step + "/index.json"), key = "\"save_id\": ";
    size_t at = written.find(key);
    top = {{"format", "\"rtp-checkpoint\""},
           {"version", "2"},
           {"save_id", at == std::string::npos ? "" : written.substr(at + key.size(), 34)},
           {"step", "1"},
           {"world_size", "1"},
           {"stages", "1"},
           {"strategy", "\"none\""},
           {"adam_steps", "7"},
           {"state", "{\"seed\": \"42\"}"},
           {"files", "[\n    " + file() + "\n  ]"},
           {"tensors",
            "[\n    " + tensor("w", "[6, 8]") + ",\n    " + tensor("b", "[6]") + "\n  ]"}};
  }
  // An entry of "files", by default rank 0's as written.
  std::string file(const std::string &name = "\"rank-0.safetensors\"",
                   const std::string &rank = "0", std::string b = "",
                   std::string s = "") const {
    return "{\"name\": " + name + ", \"rank\": " + rank +
           ", \"bytes\": " + (b.empty() ? bytes : b) +
           ", \"sha256\": " + (s.empty() ? sha : s) + "}";
  }
  // An entry of "tensors" held whole by rank 0.
  static std::string tensor(const std::string &name, const std::string &shape,
                            const std::string &block = "\"first\": 0, \"rows\": 6") {
    return "{\"name\": \"" + name + "\", \"shape\": " + shape +
           ", \"blocks\": [{\"rank\": 0, " + block + "}]}";
  }
  std::string &operator[](const std::string &key) {
    for (auto &kv : top)
      if (kv.first == key) return kv.second;
    top.push_back({key, ""});
    return top.back().second;
  }
  Index &erase(const std::string &key) {
    for (size_t i = 0; i < top.size(); i++)
      if (top[i].first == key) top.erase(top.begin() + (long)i);
    return *this;
  }
  Index &first(const std::string &key) {  // moves key to the front
    for (size_t i = 0; i < top.size(); i++)
      if (top[i].first == key)
        std::rotate(top.begin(), top.begin() + (long)i, top.begin() + (long)i + 1);
    return *this;
  }
  std::string text(const char *open = "{\n  ", const char *colon = ": ",
                   const char *comma = ",\n  ", const char *close = "\n}\n") const {
    std::string s = open;
    for (size_t i = 0; i < top.size(); i++)
      s += (i ? comma : "") + ("\"" + top[i].first + "\"") + colon + top[i].second;
    return s + close;
  }
};

void expect_opens_and_loads(const std::string &dir, const char *what) {
  rtp_ckpt *ck = nullptr;
  ASSERT_EQ(rtp_ckpt_open(dir.c_str(), &ck), RTP_OK) << what << ": " << rtp_last_error();
  EXPECT_EQ(rtp_ckpt_step(ck), 1) << what;
  EXPECT_EQ(rtp_ckpt_world_size(ck), 1) << what;
  EXPECT_EQ(rtp_ckpt_stages(ck), 1) << what;
  EXPECT_EQ(rtp_ckpt_strategy(ck), RTP_STRATEGY_NONE) << what;
  EXPECT_STREQ(rtp_ckpt_state(ck, "seed"), "42") << what;
  rtp_ckpt_close(ck);
  EXPECT_EQ(load_one(dir), 0) << what;
}

// Whatever the order of keys, the spacing and the escapes, and whatever else holds the
// names of keys, the fields of index.json load. Of these, key scanning took only the text
// as written and the reversed one: it refused the others (no space after a colon, a
// file's "bytes" before its name, escapes) or read the state's "strategy" for the index's.
TEST(CkptIndex, ReadAsJsonNotScanned) {
  std::string dir = tmp_dir("index-json"), step = dir + "/step-00000001";
  ASSERT_EQ(save_one(dir, 1), 0) << rtp_last_error();
  const Index good(step);
  ASSERT_EQ(good.text(), slurp(step + "/index.json")) << "the writer's layout changed";
  Index reversed = good, nested = good, escaped = good, members = good;
  std::reverse(reversed.top.begin(), reversed.top.end());
  nested["state"] =
      R"({"strategy": "ddp", "step": "9", "world_size": "4", "adam_steps": "3", "seed": "42"})";
  nested.first("state");
  escaped["strategy"] = R"("\u006eone")";
  escaped["state"] = R"({"se\u0065d": "4\u0032", "note": "\"step\": 9, \"bytes\": 1"})";
  members["files"] = "[{\"sha256\": " + good.sha + ", \"bytes\": " + good.bytes +
                     ",\n \"rank\": 0, \"name\": \"rank-0.safetensors\"}]";
  const struct {
    const char *what;
    std::string text;
  } cases[] = {
      {"as written", good.text()},
      {"spaced", good.text("\r\n\t{ \n", " \t:\r\n ", "\n\n ,\t", " \n}\r\n\n")},
      {"compact", good.text("{", ":", ",", "}")},
      {"reversed", reversed.text()},
      {"state keys named like the index's, first", nested.text()},
      {"escapes", escaped.text()},
      {"a file entry's members in another order", members.text()},
      {"no stages (an index older than pipelines)", Index(good).erase("stages").text()},
  };
  for (const auto &c : cases) {
    put_index(step, c.text);
    expect_opens_and_loads(dir, c.what);
  }
  put_index(step, escaped.text());
  rtp_ckpt *ck = nullptr;
  ASSERT_EQ(rtp_ckpt_open(dir.c_str(), &ck), RTP_OK) << rtp_last_error();
  EXPECT_STREQ(rtp_ckpt_state(ck, "note"), "\"step\": 9, \"bytes\": 1");
  rtp_ckpt_close(ck);
}

// A state value that names a rank's file (a word the writer accepts): key scanning found
// it ahead of the "files" entry and took the next entry's size and checksum, refusing a
// good checkpoint of 2 ranks as changed.
TEST(CkptIndex, StateNamingAFileLoads) {
  std::string dir = tmp_dir("index-state-file");
  ASSERT_EQ(on_two_ranks(RTP_STRATEGY_RTP, dir, true), 0);
  std::string step = dir + "/step-00000005", text = slurp(step + "/index.json");
  const std::string seed = "\"seed\": \"42\"";
  ASSERT_NE(text.find(seed), std::string::npos) << text;
  put_index(step, text.replace(text.find(seed), seed.size(),
                               "\"from\": \"rank-1.safetensors\", " + seed));
  EXPECT_EQ(load_one(dir), 0) << rtp_last_error();
}

// Damaged or inconsistent indexes, each with a marker that matches it (only the reader
// stands in the way), fail with RTP_EFORMAT and a message naming index.json and the fault.
TEST(CkptIndex, DamagedIndexesAreRefused) {
  std::string dir = tmp_dir("index-bad"), step = dir + "/step-00000001";
  ASSERT_EQ(save_one(dir, 1), 0) << rtp_last_error();
  const Index good(step);
  auto with = [&](const std::string &key, const std::string &value) {
    Index i = good;
    i[key] = value;
    return i.text();
  };
  auto tensors = [&](const std::string &w, const std::string &b) {
    return with("tensors", "[" + w + ", " + b + "]");
  };
  const std::string w = Index::tensor("w", "[6, 8]"), b = Index::tensor("b", "[6]");
  const std::string text = good.text();
  Index twice = good, hidden = good, uneven = good;
  uneven["world_size"] = "3";
  uneven["stages"] = "2";
  // Version 3 (stages that differ) needs 2 stages or more, each with its ranks and strategy.
  Index v3 = good;
  v3["version"] = "3";
  v3["stage_ranks"] = "[1]";
  v3["stage_strategies"] = "[\"none\"]";
  twice.top.push_back({"step", "2"});
  hidden.erase("step")["history"] = "{\"step\": 1}";
  hidden.first("history");
  const struct {
    std::string text;
    const char *message;
  } cases[] = {
      {Index(good).erase("step").text(), "index.json: missing step"},
      {hidden.text(), "index.json: unknown key 'history'"},
      {twice.text(), "duplicate key 'step'"},
      {with("step", "\"1\""), "index.json: step: expected an integer, found a string"},
      {with("world_size", "1.0"), "world_size: expected an integer, found a number with a"},
      {with("world_size", "0"), "world_size: 0 is out of range [1, 65536]"},
      {with("stages", "0"), "index.json: stages: 0 is out of range [1, 1]"},
      {with("stages", "2"), "index.json: stages: 2 is out of range [1, 1]"},
      {with("stages", "\"1\""), "stages: expected an integer, found a string"},
      {uneven.text(), "index.json: stages 2 does not divide world_size 3"},
      {with("step", "99999999999999999999"), "step: integer too large"},
      {with("adam_steps", "-7"), "adam_steps: negative number -7"},
      {with("adam_steps", "true"), "adam_steps: expected an integer, found true"},
      {with("stepp", "1"), "unknown key 'stepp'"},
      {Index(good).erase("adam_steps").text(), "index.json: missing adam_steps"},
      {with("format", "\"safetensors\""), "format 'safetensors': not an rtp checkpoint index"},
      {with("version", "4"), "version 4, this library reads versions 1 to 3"},
      {with("version", "3"), "index.json: missing stage_ranks"},
      {v3.text(), "stages 1 with 1 stage_ranks and 1 stage_strategies (2 to 64 stages"},
      {with("version", "1"), "index.json: unknown key 'save_id'"},
      {Index(good).erase("save_id").text(), "index.json: missing save_id"},
      {with("save_id", "\"0123\""), "save_id '0123' is not 32 lowercase hex digits"},
      {with("save_id", "\"" + std::string(32, 'G') + "\""), "is not 32 lowercase hex digits"},
      {with("save_id", "7"), "save_id: expected a string, found an integer"},
      {with("step", "-5"), "index.json: step: negative number -5"},
      {with("adam_steps", "9007199254740993"),
       "adam_steps: 9007199254740993 is out of range [0, 9007199254740992]"},
      {with("adam_steps", "9223372036854775807"), "adam_steps: 9223372036854775807 is out of"},
      {with("step", "2"), "step 2 in the directory of step 1"},
      {with("strategy", "\"nope\""), "unknown strategy 'nope'"},
      {with("strategy", "null"), "strategy: expected a string, found null"},
      {with("state", R"({"seed": 42})"), "state: seed: expected a string, found an integer"},
      {with("state", "[]"), "state: expected '{' (an object), found an array"},
      {with("state", R"({"seed": "4\u0000"})"), "NUL character"},
      {with("state", "{\"deep\": [[[[[[[[[1]]]]]]]]]}"), "nesting deeper than 8"},
      {with("files", "[]"), "does not list rank-0.safetensors, which it needs"},
      {with("files", "[" + good.file() + ", " + good.file() + "]"), "listed twice"},
      {with("files", "{}"), "files: expected '[' (an array), found an object"},
      {with("files", "[\"rank-0.safetensors\"]"), "files[0]: expected '{' (an object)"},
      {with("files", "[{\"name\": \"rank-0.safetensors\", \"rank\": 0}]"),
       "files[0]: missing bytes"},
      {with("files", "[" + good.file("\"rank-1.safetensors\"") + "]"),
       "files[0]: name 'rank-1.safetensors' for rank 0, expected 'rank-0.safetensors'"},
      {with("files", "[" + good.file("\"rank-1.safetensors\"", "1") + "]"),
       "files[0]: rank: 1 is out of range [0, 0]"},
      {with("files", "[" + good.file("\"rank-0.safetensors\"", "0", "", "\"XYZ\"") + "]"),
       "sha256 'XYZ' is not 64 lowercase hex digits"},
      {with("files", "[" + good.file("\"rank-0.safetensors\"", "0", "1e3") + "]"),
       "files[0]: bytes: expected an integer, found a number with a fraction"},
      {tensors(w, Index::tensor("b", "[6]", "\"first\": 1, \"rows\": 5")),
       "tensors[1] ('b'): blocks[0]: first row 1, expected 0"},
      {tensors(Index::tensor("w", "[6, 8]", "\"first\": 0, \"rows\": 5"), b),
       "tensors[0] ('w'): 1 blocks of 5 rows for 1 files and 6 rows"},
      {tensors(w, Index::tensor(
                      "b", "[6]",
                      "\"first\": 0, \"rows\": 6}, {\"rank\": 0, \"first\": 6, \"rows\": 0")),
       "tensors[1] ('b'): blocks[1]: more blocks than the 1 files"},
      {tensors(w, Index::tensor("w", "[6]")), "tensor 'w' is listed twice"},
      {tensors(Index::tensor("w", "[6, \"8\"]"), b),
       "tensors[0] ('w'): shape[1]: expected an integer, found a string"},
      {tensors(Index::tensor("w", "[1, 1, 1, 6, 8]"), b), "5 dims, expected 1 to 4"},
      {tensors(Index::tensor("w", "[6, 8]", "\"rank\": 0, \"first\": 0, \"rows\": 6"), b),
       "duplicate key 'rank'"},
      {text + "x", "trailing bytes after the top-level value"},
      {text + "{}", "trailing"},
      {text.substr(0, text.find("\"files\"")), "unexpected end of input"},
      {text.substr(0, text.find("none") + 2), "unterminated string"},
      {"", "unexpected end of input"},
      {"[]", "index.json: expected '{' (an object), found an array"},
      {"{" + std::string(1, '\0') + text.substr(1), "found byte 0x00"},
      {with("strategy", "\"n\xc3one\""), "invalid UTF-8"},
      {with("strategy", "\"n\\one\""), "bad escape '\\o'"},
  };
  for (const auto &c : cases) {
    SCOPED_TRACE(c.message);
    put_index(step, c.text);
    rtp_ckpt *ck = nullptr;
    int rc = rtp_ckpt_open(dir.c_str(), &ck);
    rtp_ckpt_close(ck);
    std::string why = rtp_last_error();
    EXPECT_EQ(rc, RTP_EFORMAT) << why;
    EXPECT_NE(why.find(step + "/index.json: "), std::string::npos) << why;
    EXPECT_NE(why.find(c.message), std::string::npos) << why;
  }
  // ddp with one rank is consistent (rank 0 writes the one file): it loads.
  put_index(step, with("strategy", "\"ddp\""));
  EXPECT_EQ(load_one(dir), 0) << rtp_last_error();
  put_index(step, good.text());
  EXPECT_EQ(load_one(dir), 0) << "the good index, back";
}

// Rewrites step's rank-0.safetensors with its tensors under the metadata meta_kv, as a
// writer of another version or a damaged file would have it; with a 1-d tensor of `rows`
// named extra in place of the one of that name, or added.
void resave_rank0(const std::string &step, const std::vector<const char *> &meta_kv,
                  const char *extra = nullptr, int64_t rows = 3) {
  std::string path = step + "/rank-0.safetensors";
  rtp_safetensors *st = nullptr;
  ASSERT_EQ(rtp_safetensors_open(path.c_str(), &st), RTP_OK) << rtp_last_error();
  rtp_context *ctx = rtp_context_new({1 << 20, nullptr, false, nullptr, 0});
  std::vector<rtp_tensor *> ts;
  for (int i = 0; i < rtp_safetensors_count(st); i++) {
    const char *name;
    rtp_safetensors_info(st, i, &name, nullptr, nullptr, nullptr);
    if (extra && std::string(name) == extra) continue;
    ts.push_back(rtp_safetensors_load(ctx, st, name));
    ASSERT_NE(ts.back(), nullptr) << rtp_last_error();
  }
  rtp_safetensors_close(st);
  if (extra) {
    ts.push_back(rtp_tensor_set_name(rtp_tensor_new_1d(ctx, RTP_TYPE_F32, rows), "%s", extra));
    ASSERT_EQ(rtp_tensor_fill_f32(ts.back(), 0.0f), RTP_OK);
  }
  EXPECT_EQ(rtp_safetensors_save(path.c_str(), ts.data(), (int)ts.size(), meta_kv.data()),
            RTP_OK)
      << rtp_last_error();
  rtp_context_free(ctx);
}

// Opens and loads dir; the load's status, with its message in *why.
int open_and_load(const std::string &dir, std::string *why) {
  Plan p;
  if (!p.build(RTP_STRATEGY_NONE, nullptr)) return -1;
  rtp_ckpt *c = nullptr;
  int rc = rtp_ckpt_open(dir.c_str(), &c);
  rtp_ckpt_params cp = p.ckpt(dir);
  if (!rc) rc = rtp_ckpt_load(c, &cp);
  rtp_ckpt_close(c);
  *why = rtp_last_error();
  return rc;
}

// A save's id ties its files to its index: a file of another save (here of the same
// values, so only the id differs) is refused naming save_id, even with an index that
// names its size and checksum; before save ids a checksum mismatch was all it said, and
// an index rewritten with the file's checksum loaded it.
TEST(CkptIndex, FilesOfAnotherSaveAreRefused) {
  std::string dir = tmp_dir("save-id"), other = tmp_dir("save-id-other");
  std::string step = dir + "/step-00000001", rank0 = "/step-00000001/rank-0.safetensors";
  ASSERT_EQ(save_one(dir, 1), 0) << rtp_last_error();
  ASSERT_EQ(save_one(other, 1), 0) << rtp_last_error();
  Index mine(step);
  ASSERT_NE(slurp(dir + rank0), slurp(other + rank0));
  ASSERT_EQ(slurp(dir + rank0).size(), slurp(other + rank0).size());
  std::string why;
  for (bool reindexed : {false, true}) {
    std::ofstream(dir + rank0, std::ios::binary) << slurp(other + rank0);
    if (reindexed) put_index(step, Index(step).text());
    EXPECT_EQ(open_and_load(dir, &why), RTP_EFORMAT) << why;
    EXPECT_NE(why.find(dir + rank0 + ": metadata save_id is '"), std::string::npos) << why;
    EXPECT_NE(why.find("', expected '" + mine["save_id"].substr(1, 32) + "' (index.json's"),
              std::string::npos)
        << why;
  }
}

// An index of version 1 (before save ids) with files that have none loads; with a file
// that has one it is refused, and so is a file without one under a version 2 index.
TEST(CkptIndex, VersionOneWithoutSaveIdLoads) {
  std::string dir = tmp_dir("version-1"), step = dir + "/step-00000001";
  ASSERT_EQ(save_one(dir, 1), 0) << rtp_last_error();
  std::string why;
  Index v2(step), v1 = v2;
  v1.erase("save_id")["version"] = "1";
  put_index(step, v1.text());
  EXPECT_EQ(open_and_load(dir, &why), RTP_EFORMAT);
  EXPECT_NE(why.find("rank-0.safetensors: metadata save_id is '"), std::string::npos) << why;
  EXPECT_NE(why.find("', expected ''"), std::string::npos) << why;
  resave_rank0(step, {"format", "rtp-checkpoint", "rank", "0", nullptr});
  Index old(step);
  old.erase("save_id")["version"] = "1";
  put_index(step, old.text());
  EXPECT_EQ(open_and_load(dir, &why), RTP_OK) << why;
  v2.bytes = old.bytes;
  v2.sha = old.sha;
  v2["files"] = "[" + v2.file() + "]";
  put_index(step, v2.text());
  EXPECT_EQ(open_and_load(dir, &why), RTP_EFORMAT);
  EXPECT_NE(why.find("rank-0.safetensors: metadata save_id is '', expected '"),
            std::string::npos)
      << why;
}

// The index, its files and the model must agree on every tensor: a shape in the index
// other than the model's, or a file with a tensor, a shape or a rank the index does not
// give it, is refused naming the tensor and both shapes. The loader read the files'
// shapes and ignored the index's, so each of these loaded.
TEST(CkptIndex, IndexFilesAndModelMustAgree) {
  std::string dir = tmp_dir("agree"), step = dir + "/step-00000001";
  ASSERT_EQ(save_one(dir, 1), 0) << rtp_last_error();
  const Index good(step);
  const std::string id = good.top[2].second.substr(1, 32), b = Index::tensor("b", "[6]");
  std::string why;
  auto with_tensors = [&](const std::string &w) {
    Index i(step);
    i["tensors"] = "[" + w + ", " + b + "]";
    return i.text();
  };
  const struct {
    std::string text;
    const char *message;
  } cases[] = {
      {with_tensors(Index::tensor("w", "[6, 9]")),
       "index.json: tensor 'w' is [6, 9], the model's is [6, 8]"},
      {with_tensors(Index::tensor("v", "[6, 8]")),
       "index.json: no tensor 'w' (the model's is [6, 8])"},
      {with_tensors(Index::tensor("w", "[6, 8]") + ", " + Index::tensor("u", "[6]")),
       "index.json: tensor 'u' is not in the model (3 tensors, the model has 2)"},
  };
  for (const auto &c : cases) {
    put_index(step, c.text);
    EXPECT_EQ(open_and_load(dir, &why), RTP_ESHAPE) << why;
    EXPECT_NE(why.find(c.message), std::string::npos) << why;
  }
  const std::vector<const char *> meta = {"format",  "rtp-checkpoint", "rank", "0",
                                          "save_id", id.c_str(),       nullptr};
  resave_rank0(step, meta, "adam.v.b", 5);
  put_index(step, Index(step).text());
  EXPECT_EQ(open_and_load(dir, &why), RTP_EFORMAT);
  EXPECT_NE(
      why.find("rank-0.safetensors: tensor 'adam.v.b' is F32 [5], index.json says F32 [6]"),
      std::string::npos)
      << why;
  resave_rank0(step, meta, "adam.v.b", 6);
  resave_rank0(step, meta, "x");
  put_index(step, Index(step).text());
  EXPECT_EQ(open_and_load(dir, &why), RTP_EFORMAT);
  EXPECT_NE(why.find("rank-0.safetensors: tensor 'x' is not among the 2 index.json gives it"),
            std::string::npos)
      << why;
  resave_rank0(step, {"format", "rtp-checkpoint", "rank", "1", "save_id", id.c_str(), nullptr});
  put_index(step, Index(step).text());
  EXPECT_EQ(open_and_load(dir, &why), RTP_EFORMAT);
  EXPECT_NE(why.find("rank-0.safetensors: metadata rank is '1', expected '0'"),
            std::string::npos)
      << why;
}

// Random damage to the index, each time with a matching marker: open and load never crash
// (ASan build) and fail only with the statuses they document. The seed is fixed, so any
// failure repeats.
TEST(CkptIndex, FuzzedIndexesNeverCrash) {
  std::string dir = tmp_dir("index-fuzz"), step = dir + "/step-00000001";
  ASSERT_EQ(save_one(dir, 1), 0) << rtp_last_error();
  const std::string good = slurp(step + "/index.json");
  const char interesting[] = "\"\\{}[],:0123456789-.e \n\x80\xff";
  Plan p;
  ASSERT_TRUE(p.build(RTP_STRATEGY_NONE, nullptr));
  rtp_ckpt_params cp = p.ckpt(dir);
  std::mt19937 rng(42);
  const char *env = getenv("RTP_CKPT_FUZZ_ITERS");  // more for a longer run
  const int iters = env ? atoi(env) : 3000;
  int opened = 0, loaded = 0;
  for (int iter = 0; iter < iters; iter++) {
    std::string t = good;
    for (int m = 1 + (int)(rng() % 3); m > 0 && !t.empty(); m--) {
      size_t pos = rng() % t.size();
      switch (rng() % 5) {
        case 0:
          t[pos] = interesting[rng() % (sizeof(interesting) - 1)];
          break;
        case 1:
          t[pos] = (char)(t[pos] ^ (1 << (rng() % 8)));
          break;
        case 2:
          t.erase(pos, 1 + rng() % 4);
          break;
        case 3:
          t.insert(pos, 1, interesting[rng() % (sizeof(interesting) - 1)]);
          break;
        default:
          t.resize(pos);
      }
    }
    put_index(step, t);
    rtp_ckpt *ck = nullptr;
    int rc = rtp_ckpt_open(dir.c_str(), &ck);
    if (rc) {
      ASSERT_EQ(rc, RTP_EFORMAT) << rtp_last_error();
      ASSERT_EQ(ck, nullptr);
      continue;
    }
    opened++;
    rc = rtp_ckpt_load(ck, &cp);
    rtp_ckpt_close(ck);
    EXPECT_TRUE(rc == RTP_OK || rc == RTP_EFORMAT || rc == RTP_ESHAPE || rc == RTP_EIO)
        << rc << ": " << rtp_last_error();
    loaded += rc == RTP_OK;
  }
  std::printf("%d damaged indexes: %d opened, %d of them loaded\n", iters, opened, loaded);
  EXPECT_GT(opened, iters / 100);  // spacing, digits of values: some mutations stay valid
  EXPECT_GT(loaded, 0);
  put_index(step, good);
  EXPECT_EQ(load_one(dir), 0);
}

}  // namespace

// ---- pipelines ------------------------------------------------------------------------

namespace {

// The GPT of examples/gpt with 4 blocks, marked as a pipeline cuts them (test-pipeline's).
const gpt_config kGptCfg = {64, 8, 16, 4, 2, false, false};
const int kGptBatch = 2, kGptMicro = 2, kGptSteps = 2;  // per data-parallel rank and step

// S stages of D ranks each (rank = s * D + d: rtp_comm_mesh_2d), the strategy running
// inside each stage (none when D == 1); S == 1 is a flat job of D ranks, no pipeline.
struct Layout {
  int S, D;
  rtp_strategy strategy;
};

std::string str(const Layout &L) {
  return std::to_string(L.S) + "x" + std::to_string(L.D) + " " +
         rtp_strategy_name(L.D > 1 ? L.strategy : RTP_STRATEGY_NONE);
}

void fill_tokens(int seq, int T, int32_t *idx, int32_t *tgt) {
  for (int t = 0; t < T; t++) {
    idx[t] = (int32_t)((7 * t + 13 * seq + 1) % kGptCfg.vocab);
    tgt[t] = (int32_t)((5 * t + 3 * seq + 2) % kGptCfg.vocab);
  }
}

// The Adam states of the rank tensor t.
void adam_states(rtp_optimizer *opt, rtp_tensor *t, rtp_tensor **m, rtp_tensor **v) {
  *m = *v = nullptr;
  for (int k = 0; k < rtp_optimizer_count(opt); k++) {
    rtp_tensor *q, *qm, *qv;
    if (rtp_optimizer_state(opt, k, &q, &qm, &qv) == RTP_OK && q == t) *m = qm, *v = qv;
  }
}

// rtp_parallel_block and rtp_parallel_shard_copy refuse a parameter of another stage,
// naming it.
int check_other_stage(rtp_parallel *par, const gpt &m, int rank) {
  for (int i = 0; i < m.n_params; i++) {
    if (rtp_parallel_tensor(par, m.params[i])) continue;
    int64_t first, len;
    int dim;
    std::vector<float> full(rtp_tensor_nelements(m.params[i])), mine(full.size());
    std::string name = m.params[i]->name;
    CHECK(rtp_parallel_block(par, m.params[i], &first, &len, &dim) == RTP_EINVAL, "block");
    std::string why = rtp_last_error();
    CHECK(why.find("'" + name + "' belongs to another pipeline stage") != std::string::npos,
          "block: %s", why.c_str());
    CHECK(rtp_parallel_shard_copy(par, m.params[i], full.data(), mine.data()) == RTP_EINVAL,
          "shard_copy");
    why = rtp_last_error();
    CHECK(why.find("'" + name + "' belongs to another pipeline stage") != std::string::npos,
          "shard_copy: %s", why.c_str());
    return 0;
  }
  fprintf(stderr, "rank %d holds every parameter in a pipeline\n", rank);
  return 11;
}

// This rank's blocks of every parameter it holds, with their Adam states, into
// dump/rank-<rank>.bin: the optimizer's step count and the number of parameters, then per
// parameter held its index, its whole element count, elements per row, first row and rows,
// and the rows of the parameter, m and v.
int dump_blocks(rtp_parallel *par, rtp_optimizer *opt, const gpt &m, int rank,
                const std::string &dump) {
  FILE *f = fopen((dump + "/rank-" + std::to_string(rank) + ".bin").c_str(), "wb");
  CHECK(f, "cannot write the dump");
  int64_t head[2] = {rtp_optimizer_steps(opt), m.n_params};
  fwrite(head, sizeof(head), 1, f);
  for (int i = 0; i < m.n_params; i++) {
    rtp_tensor *t = rtp_parallel_tensor(par, m.params[i]), *st[3] = {t};
    if (!t) continue;
    adam_states(opt, t, &st[1], &st[2]);
    int64_t rec[5] = {i, rtp_tensor_nelements(m.params[i]), 0, 0, 0};
    int dim;
    CHECK_OK(rtp_parallel_block(par, m.params[i], &rec[3], &rec[4], &dim));
    CHECK(dim == rtp_tensor_n_dims(m.params[i]) - 1 && st[1] && st[2], "%s: dim %d",
          m.params[i]->name, dim);
    rec[2] = rec[1] / m.params[i]->ne[dim];
    CHECK(rtp_tensor_nelements(t) == rec[2] * rec[4], "%s: not one block of rows",
          m.params[i]->name);
    fwrite(rec, sizeof(rec), 1, f);
    std::vector<float> v(rtp_tensor_nelements(t));
    for (rtp_tensor *x : st) {
      CHECK_OK(rtp_tensor_get(x, v.data(), 0, v.size() * sizeof(float)));
      fwrite(v.data(), sizeof(float), v.size(), f);
    }
  }
  CHECK(fclose(f) == 0, "cannot write the dump");
  return 0;
}

// Rank `rank` of layout L: trains kGptSteps Adam steps from gpt's initial weights and
// saves at step kGptSteps (save), or loads dir's latest checkpoint into parameters and
// states filled with garbage; then dumps its blocks (dump_blocks). With refused, the load
// must fail with RTP_EFORMAT and those words instead.
int gpt_rank(const Layout &L, int rank, int port, const std::string &dir, bool save,
             const std::string &dump, const char *refused = nullptr) {
  const int world = L.S * L.D, d = rank % L.D, mb = kGptBatch / kGptMicro;
  rtp_comm *job = nullptr, *stage = nullptr, *pipe = nullptr;
  if (world > 1) {
    rtp_comm_params cp = rtptest::params(rank, world, port);
    CHECK_OK(rtp_comm_init(&cp, &job));
    CHECK_OK(rtp_comm_mesh_2d(job, L.S, L.D, &stage, &pipe));
  }
  gpt m{};
  rtp_graph *fwd = nullptr;
  rtp_context *meta = rtptest::gpt_forward(kGptCfg, mb, &m, &fwd);
  CHECK(meta, "model: %s", rtp_last_error());
  for (int i = 0; i < kGptCfg.n_layer; i++)  // the blocks a pipeline cuts at
    for (rtp_tensor **p = &m.blocks[i].ln_1_w; p <= &m.blocks[i].mlp_proj_b; p++)
      CHECK_OK(rtp_tensor_set_fsdp_unit(*p, i + 1));
  rtp_init_params ip = {gpt_arena_size(kGptCfg, kGptBatch) * 2, nullptr, false, nullptr, 0};
  rtp_context *ctx = rtp_context_new(ip);
  rtp_parallel_params pp{};
  pp.strategy = L.D > 1 ? L.strategy : RTP_STRATEGY_NONE;
  pp.comm = L.D > 1 ? stage : nullptr;
  pp.pipe_comm = L.S > 1 ? pipe : nullptr;
  pp.micro_batches = kGptMicro;
  pp.schedule = RTP_SCHEDULE_1F1B;
  rtp_parallel *par = ctx ? rtp_parallel_new(ctx, fwd, m.loss, &pp) : nullptr;
  CHECK(par, "rtp_parallel_new: %s", rtp_last_error());
  CHECK(rtp_parallel_stages(par) == L.S && rtp_parallel_stage(par) == rank / L.D, "stage %d",
        rtp_parallel_stage(par));
  rtp_graph *g = rtp_parallel_graph(par);
  CHECK_OK(rtp_graph_plan(ctx, g));
  rtp_optimizer *opt = rtp_parallel_optimizer(par, rtp_adamw_params_default());
  CHECK(opt, "optimizer: %s", rtp_last_error());
  if (L.S > 1 && check_other_stage(par, m, rank)) return 12;
  rtp_ckpt_params ck = {dir.c_str(), par, job, pp.strategy, m.params,
                        m.n_params,  opt, 0,   nullptr,     false};
  for (int i = 0; i < m.n_params; i++) {
    rtp_tensor *mine = rtp_parallel_tensor(par, m.params[i]), *st[3] = {mine};
    if (!mine) continue;  // another stage's
    adam_states(opt, mine, &st[1], &st[2]);
    std::vector<float> full(rtp_tensor_nelements(m.params[i])),
        part(rtp_tensor_nelements(mine));
    gpt_init_tensor(&m, i, 42, full.data());
    CHECK_OK(rtp_parallel_shard_copy(par, m.params[i], full.data(), part.data()));
    for (int k = 0; k < 3; k++) {  // loads must overwrite all of it: garbage first
      if (!save) std::fill(part.begin(), part.end(), k ? -1e30f : 1e30f);
      CHECK_OK(rtp_tensor_set(st[k], part.data(), 0, part.size() * sizeof(float)));
      if (save) std::fill(part.begin(), part.end(), 0.0f);  // Adam's states start at 0
    }
  }
  if (save) {
    for (int k = 0; k < kGptMicro; k++) {
      rtp_tensor *idx = rtp_parallel_micro_tensor(par, m.idx, k);
      rtp_tensor *tgt = rtp_parallel_micro_tensor(par, m.targets, k);
      CHECK(idx && tgt, "inputs of micro-batch %d", k);
      for (int b = 0; b < mb; b++)
        fill_tokens(d * kGptBatch + k * mb + b, kGptCfg.seq_len,
                    (int32_t *)idx->data + b * kGptCfg.seq_len,
                    (int32_t *)tgt->data + b * kGptCfg.seq_len);
    }
    for (int s = 0; s < kGptSteps; s++) {
      CHECK_OK(rtp_graph_compute(g, nullptr));
      CHECK_OK(rtp_optimizer_step(opt, nullptr));
    }
    CHECK_OK(rtp_ckpt_save(&ck, kGptSteps));
  } else {
    rtp_ckpt *c = nullptr;
    CHECK_OK(rtp_ckpt_open(dir.c_str(), &c));
    int rc = rtp_ckpt_load(c, &ck);
    rtp_ckpt_close(c);
    if (refused) {
      CHECK(rc == RTP_EFORMAT && strstr(rtp_last_error(), refused), "load: %d: %s", rc,
            rtp_last_error());
    } else {
      CHECK_OK(rc);
    }
  }
  if (!refused && dump_blocks(par, opt, m, rank, dump)) return 13;
  rtp_context_free(ctx);
  rtp_context_free(meta);
  if (job) CHECK_OK(rtp_comm_barrier(job, nullptr));
  rtp_comm_free(stage);
  rtp_comm_free(pipe);
  rtp_comm_free(job);
  return 0;
}

// Runs layout L's ranks (gpt_rank), each dumping its blocks into a fresh directory `dump`;
// 0, or the first failing rank's code.
int run_layout(const Layout &L, bool save, const std::string &dir, const std::string &dump) {
  if (std::system(("rm -rf '" + dump + "' && mkdir -p '" + dump + "'").c_str())) return 90;
  int port = rtptest::free_port();
  auto res = rtptest::run_procs(L.S * L.D,
                                [&](int r) { return gpt_rank(L, r, port, dir, save, dump); });
  for (const rtptest::Result &r : res)
    if (r.code) return r.code;
  return 0;
}

// The whole parameters and Adam states put together from every rank's dump.
struct Whole {
  int64_t steps = -1;
  std::vector<std::vector<float>> v[3];  // parameter, m, v
  std::vector<std::vector<int>> held;    // how many ranks dumped each element
  std::string fault;                     // what was wrong with the dumps, if anything
};

Whole gather(const std::string &dump, int world) {
  Whole w;
  for (int r = 0; r < world && w.fault.empty(); r++) {
    std::string path = dump + "/rank-" + std::to_string(r) + ".bin";
    FILE *f = fopen(path.c_str(), "rb");
    int64_t head[2], rec[5];
    if (!f || fread(head, sizeof(head), 1, f) != 1) {
      w.fault = path + ": cannot read it";
      if (f) fclose(f);
      break;
    }
    if (r > 0 && head[0] != w.steps) w.fault = path + ": another step count";
    w.steps = head[0];
    if (r == 0) {
      for (auto &k : w.v) k.resize(head[1]);
      w.held.resize(head[1]);
    }
    while (w.fault.empty() && fread(rec, sizeof(rec), 1, f) == 1) {
      int64_t i = rec[0], n = rec[1], lo = rec[2] * rec[3], len = rec[2] * rec[4];
      if (i < 0 || i >= (int64_t)w.held.size() || lo < 0 || lo + len > n) {
        w.fault = path + ": bad record";
        break;
      }
      if (w.held[i].empty()) {
        for (auto &k : w.v) k[i].resize(n);
        w.held[i].resize(n);
      }
      std::vector<float> x(len);
      for (int k = 0; k < 3 && w.fault.empty(); k++) {
        if (fread(x.data(), sizeof(float), len, f) != (size_t)len) w.fault = path + ": short";
        for (int64_t j = 0; j < len && w.fault.empty(); j++) {
          float &dst = w.v[k][i][lo + j];
          if (w.held[i][lo + j] && memcmp(&dst, &x[j], sizeof(float)))
            w.fault = path + ": replicas of parameter " + std::to_string(i) + " differ";
          dst = x[j];
        }
      }
      for (int64_t j = 0; j < len; j++) w.held[i][lo + j]++;
    }
    fclose(f);
  }
  for (size_t i = 0; i < w.held.size() && w.fault.empty(); i++)
    for (int h : w.held[i])
      if (h == 0) {
        w.fault = "parameter " + std::to_string(i) + " is not held whole";
        break;
      }
  return w;
}

// The parameters and states loaded are bit for bit those saved, step count included.
void expect_same(const Whole &saved, const Whole &loaded, const std::string &what) {
  ASSERT_EQ(saved.fault, "") << what << ": saved";
  ASSERT_EQ(loaded.fault, "") << what << ": loaded";
  EXPECT_EQ(saved.steps, kGptSteps) << what;
  EXPECT_EQ(loaded.steps, saved.steps) << what;
  ASSERT_EQ(loaded.held.size(), saved.held.size()) << what;
  int params = 0, differ = 0;
  for (int k = 0; k < 3; k++)
    for (size_t i = 0; i < saved.v[k].size(); i++) {
      params += k == 0;
      const std::vector<float> &a = saved.v[k][i], &b = loaded.v[k][i];
      if (a.size() != b.size() || memcmp(a.data(), b.data(), a.size() * sizeof(float)))
        differ++;
    }
  EXPECT_EQ(params, 2 + 12 * kGptCfg.n_layer + 3) << what;  // wte, wpe; blocks; ln_f, head
  int still = 0;  // parameters Adam has not moved: their checkpoint would prove little
  for (const std::vector<float> &v : saved.v[2])
    still += std::all_of(v.begin(), v.end(), [](float x) { return x == 0.0f; });
  EXPECT_EQ(still, 0) << what;
  EXPECT_EQ(differ, 0) << what << ": tensors (parameters, m, v) that differ";
}

// The step directory of dir's checkpoint (saved at step kGptSteps).
std::string step_dir(const std::string &dir) {
  char name[32];
  snprintf(name, sizeof(name), "/step-%08d", kGptSteps);
  return dir + name;
}

// Saves on layout `from`, loads on each of `to` and compares; the checkpoint's step dir.
std::string save_and_load_on(const char *name, const Layout &from,
                             const std::vector<Layout> &to) {
  std::string dir = tmp_dir(name), dump = dir + "-dump";
  EXPECT_EQ(run_layout(from, true, dir, dump + "-saved"), 0) << "saving on " << str(from);
  Whole saved = gather(dump + "-saved", from.S * from.D);
  for (const Layout &L : to) {
    std::string what = "saved on " + str(from) + ", loaded on " + str(L);
    EXPECT_EQ(run_layout(L, false, dir, dump), 0) << what;
    expect_same(saved, gather(dump, L.S * L.D), what);
  }
  std::system(("rm -rf '" + dump + "' '" + dump + "-saved'").c_str());
  return step_dir(dir);
}

// Opens dir and checks what its index says of the job that saved it.
void expect_index(const std::string &dir, int world, int stages, rtp_strategy s) {
  rtp_ckpt *c = nullptr;
  ASSERT_EQ(rtp_ckpt_open(dir.c_str(), &c), RTP_OK) << rtp_last_error();
  EXPECT_EQ(rtp_ckpt_world_size(c), world);
  EXPECT_EQ(rtp_ckpt_stages(c), stages);
  EXPECT_EQ(rtp_ckpt_strategy(c), s);
  rtp_ckpt_close(c);
}

// The first stage's embedding and the last stage's head, as gpt names them.
const char *const kWte = "transformer.wte.weight", *const kHead = "lm_head.weight";

// Whether the safetensors file holds a tensor of that name.
bool holds(const std::string &file, const char *name) {
  rtp_safetensors *st = nullptr;
  if (rtp_safetensors_open(file.c_str(), &st)) return false;
  bool found = rtp_safetensors_find(st, name) >= 0;
  rtp_safetensors_close(st);
  return found;
}

// A copy of the checkpoint in dir whose index is text with `from` replaced by `to` (the
// first occurrence), with a matching marker: opening it fails with RTP_EFORMAT and words.
void expect_index_refused(const std::string &dir, const std::string &from,
                          const std::string &to, const char *words) {
  std::string copy = dir + "-bad", step = step_dir(copy);
  ASSERT_EQ(
      std::system(("rm -rf '" + copy + "' && cp -r '" + dir + "' '" + copy + "'").c_str()), 0);
  std::string text = slurp(step + "/index.json");
  size_t at = text.find(from);
  ASSERT_NE(at, std::string::npos) << from;
  put_index(step, text.replace(at, from.size(), to));
  rtp_ckpt *c = nullptr;
  int rc = rtp_ckpt_open(copy.c_str(), &c);
  rtp_ckpt_close(c);
  std::string why = rtp_last_error();
  EXPECT_EQ(rc, RTP_EFORMAT) << why;
  EXPECT_NE(why.find(words), std::string::npos) << why;
  std::system(("rm -rf '" + copy + "'").c_str());
}

// 2 stages of 1 rank: each rank's file holds its stage's parameters only (the embeddings
// rank 0's, the head rank 1's), and the checkpoint loads on one process and on the same
// pipeline; a damaged file of the second stage is refused before it is read.
TEST(CkptPipeline, TwoStagesLoadOnOneProcess) {
  const Layout pipe2 = {2, 1, RTP_STRATEGY_NONE};
  std::string step = save_and_load_on("pipe-2x1", pipe2, {{1, 1, RTP_STRATEGY_NONE}, pipe2});
  std::string dir = step.substr(0, step.rfind('/'));
  expect_index(dir, 2, 2, RTP_STRATEGY_NONE);
  EXPECT_TRUE(holds(step + "/rank-0.safetensors", kWte));
  EXPECT_TRUE(holds(step + "/rank-0.safetensors", "adam.v.transformer.wte.weight"));
  EXPECT_FALSE(holds(step + "/rank-0.safetensors", kHead));
  EXPECT_TRUE(holds(step + "/rank-1.safetensors", kHead));
  EXPECT_FALSE(holds(step + "/rank-1.safetensors", kWte));
  // A tensor's blocks list only the files of its stage; that is a pipeline's alone: read
  // as a checkpoint without one, the index is refused.
  expect_index_refused(dir, "\"stages\": 2", "\"stages\": 1", "blocks of");
  ASSERT_EQ(std::system(("cd '" + step +
                         "' && printf X | dd of=rank-1.safetensors bs=1 conv=notrunc "
                         "seek=$(($(stat -c%s rank-1.safetensors) - 10)) 2>/dev/null")
                            .c_str()),
            0);
  auto res = rtptest::run_procs(1, [&](int r) {
    return gpt_rank({1, 1, RTP_STRATEGY_NONE}, r, 0, dir, false, dir,
                    "rank-1.safetensors: checksum mismatch (corrupted)");
  });
  EXPECT_EQ(res[0].code, 0) << "a corrupted file of the second stage was loaded";
}

// 2 stages of 2 rtp ranks: the checkpoint loads on 4 stages of 1 rank and on a flat job of
// 2 fsdp ranks.
TEST(CkptPipeline, TwoByTwoRtpLoadsOnFourStagesAndFlatFsdp) {
  std::string step = save_and_load_on("pipe-2x2-rtp", {2, 2, RTP_STRATEGY_RTP},
                                      {{4, 1, RTP_STRATEGY_NONE}, {1, 2, RTP_STRATEGY_FSDP}});
  std::string dir = step.substr(0, step.rfind('/'));
  expect_index(dir, 4, 2, RTP_STRATEGY_RTP);
  for (int r = 0; r < 4; r++)
    EXPECT_EQ(holds(step + "/rank-" + std::to_string(r) + ".safetensors", kWte), r < 2)
        << "rank " << r;
  // Blocks in rank order, each of a rank that wrote a file.
  expect_index_refused(dir, "{\"rank\": 1, \"first\"", "{\"rank\": 0, \"first\"",
                       "rank 0 after rank 0");
  // Blocks that tile the rows, but not as rtp_comm_block splits them: no save writes them,
  // and loading, a reshard from the saved layout, stands on that split.
  std::smatch m;
  std::string text = slurp(step + "/index.json");
  ASSERT_TRUE(std::regex_search(
      text, m,
      std::regex("\"rows\": (\\d+)\\}, \\{\"rank\": 1, \"first\": \\d+, \"rows\": (\\d+)\\}")));
  int a = std::stoi(m[1]), b = std::stoi(m[2]);
  std::string to = "\"rows\": " + std::to_string(a - 1) +
                   "}, {\"rank\": 1, \"first\": " + std::to_string(a - 1) +
                   ", \"rows\": " + std::to_string(b + 1) + "}";
  expect_index_refused(dir, m[0], to,
                       ("blocks[0]: rows [0, " + std::to_string(a - 1) + "), expected [0, " +
                        std::to_string(a) + ") (the files split the rows as rtp_comm_block")
                           .c_str());
}

// A flat job of 2 rtp ranks loads on 2 stages of 2 ddp ranks; 2 x 2 ddp saves from each
// stage's rank 0 alone (ranks 0 and 2), which loads on one process.
TEST(CkptPipeline, FlatRtpLoadsOnTwoByTwoDdpWhichSavesFromStageRankZero) {
  const Layout ddp = {2, 2, RTP_STRATEGY_DDP};
  save_and_load_on("flat-rtp", {1, 2, RTP_STRATEGY_RTP}, {ddp});
  std::string step = save_and_load_on("pipe-2x2-ddp", ddp, {{1, 1, RTP_STRATEGY_NONE}});
  std::string dir = step.substr(0, step.rfind('/'));
  expect_index(dir, 4, 2, RTP_STRATEGY_DDP);
  for (int r = 0; r < 4; r++)
    EXPECT_EQ(access((step + "/rank-" + std::to_string(r) + ".safetensors").c_str(), F_OK) == 0,
              r % 2 == 0)
        << "rank " << r;
  expect_index_refused(dir, "{\"rank\": 2, \"first\"", "{\"rank\": 1, \"first\"",
                       "rank 1, which wrote no file");
}

// Stage groups that are the mesh's columns (rank = d x S + s): the stages' files would not
// hold their rows in rank order, so every rank refuses the save, and nothing is written.
TEST(CkptPipeline, OtherRankLayoutsAreRefused) {
  std::string dir = tmp_dir("pipe-transposed");
  int port = rtptest::free_port();
  auto res = rtptest::run_procs(4, [&](int rank) {
    rtp_comm_params cp = rtptest::params(rank, 4, port);
    rtp_comm *job = nullptr, *rows = nullptr, *cols = nullptr;
    CHECK_OK(rtp_comm_init(&cp, &job));
    CHECK_OK(rtp_comm_mesh_2d(job, 2, 2, &rows, &cols));
    gpt m{};
    rtp_graph *fwd = nullptr;
    rtp_context *meta = rtptest::gpt_forward(kGptCfg, 1, &m, &fwd);
    CHECK(meta, "model");
    for (int i = 0; i < kGptCfg.n_layer; i++)
      for (rtp_tensor **p = &m.blocks[i].ln_1_w; p <= &m.blocks[i].mlp_proj_b; p++)
        CHECK_OK(rtp_tensor_set_fsdp_unit(*p, i + 1));
    rtp_init_params ip = {gpt_arena_size(kGptCfg, 1) * 2, nullptr, false, nullptr, 0};
    rtp_context *ctx = rtp_context_new(ip);
    rtp_parallel_params pp{};
    pp.strategy = RTP_STRATEGY_RTP;
    pp.comm = cols;  // stage groups {0, 2}, {1, 3}
    pp.pipe_comm = rows;
    rtp_parallel *par = rtp_parallel_new(ctx, fwd, m.loss, &pp);
    CHECK(par, "rtp_parallel_new: %s", rtp_last_error());
    CHECK(rtp_parallel_stage(par) == rank % 2, "stage %d", rtp_parallel_stage(par));
    CHECK_OK(rtp_graph_plan(ctx, rtp_parallel_graph(par)));
    rtp_optimizer *opt = rtp_parallel_optimizer(par, rtp_adamw_params_default());
    CHECK(opt, "optimizer");
    rtp_ckpt_params ck = {dir.c_str(), par, job, pp.strategy, m.params,
                          m.n_params,  opt, 0,   nullptr,     false};
    int st = rtp_ckpt_save(&ck, 1);
    std::string why = rtp_last_error();
    fprintf(stderr, "rank %d: %s\n", rank, why.c_str());
    CHECK(st == RTP_ENOSYS, "status %d", st);
    // ranks 1 and 2 are out of place and say why; rank 0 and 3 name one of them
    CHECK(why.find(rank == 1 || rank == 2
                       ? "checkpoints of a pipeline need rank = stage"
                       : "failed to check the pipeline's layout") != std::string::npos,
          "%s", why.c_str());
    rtp_context_free(ctx);
    rtp_context_free(meta);
    CHECK_OK(rtp_comm_barrier(job, nullptr));
    rtp_comm_free(rows);
    rtp_comm_free(cols);
    rtp_comm_free(job);
    return 0;
  });
  for (int r = 0; r < 4; r++) EXPECT_EQ(res[r].code, 0) << "rank " << r;
  EXPECT_NE(access(dir.c_str(), F_OK), 0) << "the refused save wrote something";
}

}  // namespace
