// test-plan-cli: rtp-plan as a user runs it. Its memory figures are what train-gpt reports
// for the same flags (and predict train-gpt's peak RSS within 10%), bad flags get a clear
// error, and the recommendation follows --mem-per-rank.
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace {

struct Ran {
  int code = -1;
  std::string out;  // stdout and stderr
};

Ran run(const std::string &cmd) {
  Ran r;
  FILE *p = popen((cmd + " 2>&1").c_str(), "r");
  if (!p) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) r.out.append(buf, n);
  int st = pclose(p);
  r.code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}

// The number after "key": in a JSON line; NaN where there is none.
double field(const std::string &line, const std::string &key) {
  size_t at = line.find("\"" + key + "\":");
  if (at == std::string::npos) return std::nan("");
  std::string v = line.substr(at + key.size() + 3);
  if (v.rfind("true", 0) == 0) return 1;
  if (v.rfind("false", 0) == 0) return 0;
  return std::strtod(v.c_str(), nullptr);
}

// The JSON line of a layout ("rtp", "pp 2 x rtp 2", ...) in rtp-plan --json's output.
std::string layout(const std::string &out, const std::string &name) {
  std::istringstream in(out);
  for (std::string line; std::getline(in, line);)
    if (line.find("{\"layout\":\"" + name + "\"") == 0) return line;
  return "";
}

std::string recommended(const std::string &out) {
  size_t at = out.find("{\"recommended\":");
  return at == std::string::npos ? "?" : out.substr(at + 15, out.find('}', at) - at - 15);
}

// A model small enough to train in a second, large enough that its arena dominates.
const std::string kModel = " --config tiny --d-model 384 --seq-len 64 --n-layer 2 --batch 2";

std::string plan(const std::string &flags) {
  return std::string(RTP_PLAN) + kModel + " --flops 1e10 --json " + flags;
}

TEST(PlanCli, BadFlagsAreRefusedClearly) {
  struct Case {
    const char *flags, *says;
  } cases[] = {{"--mem-per-rank 2X", "--mem-per-rank: '2X' is not a size"},
               {"--link fast", "'fast' is not a speed"},
               {"--n-head 5", "--n-head must divide --d-model"},
               {"--batch 3 --micro-batches 2", "--micro-batches must divide --batch"},
               {"-n 0", "-n must be an integer in 1..65536"},
               {"--config huge", "--config must be tiny, small or medium"},
               {"--schedule fast", "--schedule must be"},
               {"--frobnicate 1", "unknown option '--frobnicate'"},
               {"--stages 2:tp,3:ddp", "--stages: pipelines of stages of different sizes"},
               {"--link", "--link needs a value"}};
  for (const Case &c : cases) {
    Ran r = run(plan(c.flags));
    EXPECT_EQ(r.code, 2) << c.flags << ": " << r.out;
    EXPECT_NE(r.out.find(c.says), std::string::npos) << c.flags << ": " << r.out;
  }
}

// ddp holds every parameter, rtp a half: a memory between their peaks fits rtp alone,
// and one below every layout fits nothing.
TEST(PlanCli, RecommendationFollowsTheMemory) {
  Ran all = run(plan("-n 2"));
  ASSERT_EQ(all.code, 0) << all.out;
  double ddp = field(layout(all.out, "ddp"), "peak_rss");
  double rtp = field(layout(all.out, "rtp"), "peak_rss");
  ASSERT_LT(rtp, ddp) << all.out;
  EXPECT_NE(recommended(all.out), "null") << all.out;

  Ran tight = run(plan("-n 2 --mem-per-rank " + std::to_string((long long)((rtp + ddp) / 2))));
  ASSERT_EQ(tight.code, 0) << tight.out;
  EXPECT_EQ(field(layout(tight.out, "ddp"), "fits"), 0) << tight.out;
  EXPECT_EQ(field(layout(tight.out, "rtp"), "fits"), 1) << tight.out;
  std::string best = recommended(tight.out);
  ASSERT_NE(best, "null") << tight.out;
  EXPECT_NE(best, "\"ddp\"") << tight.out;
  EXPECT_EQ(field(layout(tight.out, best.substr(1, best.size() - 2)), "fits"), 1);

  Ran none = run(plan("-n 2 --mem-per-rank 1M"));
  EXPECT_EQ(none.code, 0) << none.out;
  EXPECT_EQ(recommended(none.out), "null") << none.out;
  Ran table = run(std::string(RTP_PLAN) + kModel + " --flops 1e10 -n 2 --mem-per-rank 1M");
  EXPECT_NE(table.out.find("nothing fits"), std::string::npos) << table.out;
}

// --tie-embeddings drops lm_head: the model states of one process shrink by its
// parameter, gradient and two Adam moments (vocab x d floats each), and no pipeline is
// offered, as train-gpt refuses one.
TEST(PlanCli, TiedEmbeddingsDropTheHead) {
  Ran untied = run(plan("-n 2")), tied = run(plan("-n 2 --tie-embeddings"));
  ASSERT_EQ(untied.code, 0) << untied.out;
  ASSERT_EQ(tied.code, 0) << tied.out;
  auto states = [](const std::string &line) {
    return field(line, "params") + field(line, "grads") + field(line, "optim");
  };
  const double head = 256.0 * 384 * sizeof(float);  // kModel's vocab x d_model
  EXPECT_EQ(states(layout(untied.out, "one process")) - states(layout(tied.out, "one process")),
            4 * head);
  EXPECT_NE(layout(untied.out, "pp 2"), "") << untied.out;
  EXPECT_EQ(layout(tied.out, "pp 2"), "") << tied.out;
}

// The same model trained by train-gpt on 2 ranks: every role's bytes as rtp-plan said,
// and its peak resident memory within 10% of the prediction.
// --grad-accum K: K computes a step, so K times the tokens and the compute, and K times the
// bytes of the strategies that reduce every compute (rtp, fsdp, tp), where ddp's
// all-reduces run once a step, after the last compute.
TEST(PlanCli, GradAccumMultipliesTheComputes) {
  Ran one = run(plan("-n 2")), two = run(plan("-n 2 --grad-accum 2"));
  ASSERT_EQ(one.code, 0) << one.out;
  ASSERT_EQ(two.code, 0) << two.out;
  for (const char *s : {"rtp", "fsdp", "tp", "ddp"}) {
    std::string a = layout(one.out, s), b = layout(two.out, s);
    EXPECT_EQ(field(b, "tokens_per_step"), 2 * field(a, "tokens_per_step")) << s;
    EXPECT_NEAR(field(b, "compute_s"), 2 * field(a, "compute_s"), 2e-6) << s;  // 6 decimals
    double bytes = field(a, "bytes_sent_per_step"),
           accumulated = field(b, "bytes_sent_per_step");
    if (std::string(s) == "ddp")
      EXPECT_NEAR(accumulated, bytes, 64) << "ddp all-reduces once a step";
    else
      EXPECT_EQ(accumulated, 2 * bytes) << s;
  }
}

// What train-gpt's --metrics say of its memory is what rtp-plan said, and its peak RSS is
// within 10% of the prediction, with and without --grad-accum.
TEST(PlanCli, TrainGptReportsWhatThePlanSaid) {
  Ran p = run(plan("-n 2")), pk = run(plan("-n 2 --grad-accum 2"));
  ASSERT_EQ(p.code, 0) << p.out;
  ASSERT_EQ(pk.code, 0) << pk.out;
  struct Case {
    const char *strategy;
    int accum;
  } cases[] = {{"rtp", 1}, {"ddp", 1}, {"fsdp", 1}, {"ddp", 2}, {"rtp", 2}};
  for (const Case &c : cases) {
    const char *s = c.strategy;
    std::string metrics = std::string(RTP_BUILD_DIR) + "/test-plan-cli-" + s + ".jsonl";
    std::remove(metrics.c_str());
    Ran t =
        run(std::string(RTP_RUN) + " -n 2 -- " + TRAIN_GPT + kModel + " --strategy " + s +
            " --grad-accum " + std::to_string(c.accum) +
            " --steps 2 --threads 1 --eval-windows 2 --eval-problems 0 --metrics " + metrics);
    ASSERT_EQ(t.code, 0) << t.out;
    std::ifstream f(metrics);
    std::string line, last;
    while (std::getline(f, line)) last = line;
    std::string want = layout(c.accum > 1 ? pk.out : p.out, s);
    for (const char *k : {"params", "grads", "optim", "activations", "comm"})
      EXPECT_EQ(field(last, k), field(want, k)) << s << " x" << c.accum << " " << k;
    double peak = field(last, "peak_rss"), predicted = field(want, "peak_rss");
    printf("%s x%d: train-gpt's peak RSS %.1f MiB, rtp-plan's %.1f MiB (%+.1f%%)\n", s, c.accum,
           peak / 1048576, predicted / 1048576, 100 * (predicted - peak) / peak);
#if defined(__SANITIZE_ADDRESS__)
    // ASan's allocator keeps what train-gpt frees (its quarantine) and adds its own: the
    // RSS is not the program's. test-plan checks the ranks' RSS under ASan too.
    (void)predicted;
#else
    EXPECT_NEAR(predicted, peak, 0.1 * peak) << s << " x" << c.accum;
#endif
    std::remove(metrics.c_str());
  }
}

}  // namespace
