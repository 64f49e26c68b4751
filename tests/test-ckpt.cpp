// Sharded checkpoints (rtp-ckpt.c): a plan's parameter blocks and Adam states saved on 1 or
// 2 ranks load back exactly, also onto the other world size; only the newest two complete
// checkpoints are kept; a failed save leaves latest on the previous one; damaged
// checkpoints are refused with a message naming the fault.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include "rtp.h"
#include "test-comm-util.h"

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

// A two-parameter model (w: 6 rows of 8, b: 6) made parallel, with its optimizer.
struct Plan {
  rtp_context *meta = nullptr, *ctx = nullptr;
  rtp_comm *comm = nullptr;
  rtp_parallel *par = nullptr;
  rtp_optimizer *opt = nullptr;
  rtp_tensor *params[2] = {};
  rtp_strategy strategy = RTP_STRATEGY_NONE;

  bool build(rtp_strategy s, rtp_comm *c) {
    strategy = s;
    comm = c;
    meta = rtp_init({1 << 20, nullptr, true, nullptr, 0});
    ctx = rtp_init({4 << 20, nullptr, false, nullptr, 0});
    params[0] = rtp_set_name(rtp_new_tensor_2d(meta, RTP_TYPE_F32, 8, 6), "w");
    params[1] = rtp_set_name(rtp_new_tensor_1d(meta, RTP_TYPE_F32, 6), "b");
    rtp_tensor *x = rtp_new_tensor_2d(meta, RTP_TYPE_F32, 8, 5);
    rtp_set_param(params[0]);
    rtp_set_param(params[1]);
    rtp_set_input(x);
    rtp_tensor *loss = rtp_sum(meta, rtp_add(meta, rtp_mul_mat(meta, params[0], x), params[1]));
    rtp_graph *g = rtp_graph_new(meta, 64);
    if (!loss || rtp_graph_build(g, loss)) return false;
    rtp_parallel_params pp = {s, c, 0, 0};
    par = rtp_parallelize(ctx, g, loss, &pp);
    if (!par || rtp_graph_plan(ctx, rtp_parallel_graph(par))) return false;
    opt = rtp_parallel_optimizer(par, rtp_adamw_default());
    return opt != nullptr;
  }
  ~Plan() {
    rtp_free(ctx);
    rtp_free(meta);
    rtp_comm_free(comm);
  }
  rtp_ckpt_params ckpt(const std::string &dir) const {
    static const char *const kv[] = {"seed", "42", nullptr};
    return {dir.c_str(), par, comm, strategy, params, 2, opt, 0, kv};
  }
  // The value of element j of the whole of parameter i (k: 0 value, 1 m, 2 v) ...
  static float value(int i, int64_t j, int k) {
    return 0.001f * (float)(i * 1000 + j) + (float)k;
  }
  // ... each rank holding its block, or zeros (fill = false) to be loaded into.
  void fill(bool values) {
    for (int i = 0; i < 2; i++) {
      rtp_tensor *t = rtp_parallel_tensor(par, params[i]), *st[3] = {t};
      for (int k = 0; k < rtp_optimizer_count(opt); k++) {
        rtp_tensor *q, *m, *v;
        rtp_optimizer_state(opt, k, &q, &m, &v);
        if (q == t) st[1] = m, st[2] = v;
      }
      int64_t first = offset(i);
      for (int k = 0; k < 3; k++)
        for (int64_t j = 0; j < rtp_nelements(t); j++)
          ((float *)st[k]->data)[j] = values ? value(i, first + j, k) : 0.0f;
    }
    rtp_optimizer_set_steps(opt, values ? 7 : 0);
  }
  int64_t offset(int i) const {
    int64_t first, len;
    int dim;
    rtp_parallel_block(par, params[i], &first, &len, &dim);
    return first * (rtp_nelements(params[i]) / params[i]->ne[dim]);
  }
  // How many elements differ from value() (states included), and the step count.
  int mismatches() {
    int bad = rtp_optimizer_steps(opt) != 7;
    for (int i = 0; i < 2; i++) {
      rtp_tensor *t = rtp_parallel_tensor(par, params[i]);
      for (int k = 0; k < rtp_optimizer_count(opt); k++) {
        rtp_tensor *q, *st[3] = {};
        rtp_optimizer_state(opt, k, &q, &st[1], &st[2]);
        if (q != t) continue;
        st[0] = t;
        for (int s = 0; s < 3; s++)
          for (int64_t j = 0; j < rtp_nelements(t); j++)
            bad += ((float *)st[s]->data)[j] != value(i, offset(i) + j, s);
      }
    }
    return bad;
  }
};

// One process: save, clear, load.
int save_one(const std::string &dir, int64_t step) {
  Plan p;
  if (!p.build(RTP_STRATEGY_NONE, nullptr)) return 10;
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

int load_one(const std::string &dir) {
  Plan p;
  return p.build(RTP_STRATEGY_NONE, nullptr) ? load_and_check(p, dir) : 20;
}

// 2 ranks: save (fill) or load, with strategy s.
int on_two_ranks(rtp_strategy s, const std::string &dir, bool save) {
  int port = rtptest::free_port();
  auto res = rtptest::run_procs(2, [&](int r) {
    rtp_comm_params cp = rtptest::params(r, 2, port);
    rtp_comm *comm = nullptr;
    if (rtp_comm_init(&cp, &comm)) return 40;
    Plan p;
    if (!p.build(s, comm)) return 41;
    if (!save) return load_and_check(p, dir);
    p.fill(true);
    rtp_ckpt_params ck = p.ckpt(dir);
    return rtp_ckpt_save(&ck, 5) ? 42 : 0;
  });
  return res[0].code ? res[0].code : res[1].code;
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

}  // namespace
