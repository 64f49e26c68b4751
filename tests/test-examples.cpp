// The examples end to end: train-gpt trains the tiny model on its built-in task, writes
// one metrics object per step, exports a model that --init and --eval-only read back to the
// same loss (and PyTorch too, when /usr/bin/python3 has torch), and refuses bad input with a
// message and a non-zero exit; under rtp-run, 2 ranks train like one process with twice the
// batch (rtp and ddp) and export the model they evaluated; checkpoints resume with the
// same losses and damaged ones are refused; embed-c and train-gpt-cpp run and save.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "rtp.h"

namespace {

struct Result {
  int code = -1;  // exit status, -1 if killed by a signal
  std::string out, err;
};

std::string slurp(const std::string &path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::string quote(const std::string &s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

std::string tmp_dir() {
  static std::string dir = [] {
    std::string tmpl = testing::TempDir() + "rtp-examples-XXXXXX";
    std::vector<char> buf(tmpl.begin(), tmpl.end());
    buf.push_back(0);
    return std::string(mkdtemp(buf.data())) + "/";
  }();
  return dir;
}

// Removes the scratch directory once every test has run.
class ScratchCleanup : public testing::Environment {
  void TearDown() override {
    if (std::system(("rm -rf " + quote(tmp_dir())).c_str()) != 0)
      std::fprintf(stderr, "could not remove %s\n", tmp_dir().c_str());
  }
};
testing::Environment *const scratch_cleanup =
    testing::AddGlobalTestEnvironment(new ScratchCleanup);

Result run(const std::vector<std::string> &argv) {
  std::string cmd;
  for (const std::string &a : argv) cmd += quote(a) + " ";
  std::string out = tmp_dir() + "stdout", err = tmp_dir() + "stderr";
  int st = std::system((cmd + ">" + quote(out) + " 2>" + quote(err)).c_str());
  Result r;
  if (WIFEXITED(st)) r.code = WEXITSTATUS(st);
  r.out = slurp(out);
  r.err = slurp(err);
  return r;
}

// A flat JSON object of numbers, strings and null, as train-gpt writes; false if malformed.
bool parse_flat_json(const std::string &s, std::map<std::string, double> *obj) {
  size_t i = 0;
  auto ws = [&] {
    while (i < s.size() && std::isspace((unsigned char)s[i])) i++;
  };
  auto str = [&](std::string *v) {
    if (s[i] != '"') return false;
    size_t end = s.find('"', i + 1);
    if (end == std::string::npos) return false;
    *v = s.substr(i + 1, end - i - 1);
    i = end + 1;
    return true;
  };
  ws();
  if (i >= s.size() || s[i++] != '{') return false;
  for (;;) {
    ws();
    std::string key, text;
    if (!str(&key)) return false;
    ws();
    if (i >= s.size() || s[i++] != ':') return false;
    ws();
    if (s.compare(i, 4, "null") == 0) {
      i += 4;
    } else if (s[i] == '"') {
      if (!str(&text)) return false;
    } else {
      char *end = nullptr;
      double v = std::strtod(s.c_str() + i, &end);
      if (end == s.c_str() + i) return false;
      i = (size_t)(end - s.c_str());
      (*obj)[key] = v;
    }
    ws();
    if (i < s.size() && s[i] == ',') {
      i++;
      continue;
    }
    if (i >= s.size() || s[i++] != '}') return false;
    ws();
    return i == s.size();
  }
}

std::vector<std::string> lines(const std::string &s) {
  std::vector<std::string> v;
  std::stringstream ss(s);
  for (std::string l; std::getline(ss, l);) v.push_back(l);
  return v;
}

// Some text for --data: bytes[i*T .. i*T+T] windows, 32 of them at T = 32.
std::string write_data_file() {
  std::string path = tmp_dir() + "data.txt", text;
  while (text.size() < 32 * 32 + 1)
    text += "Every rank keeps one shard of every parameter; the shards travel. ";
  text.resize(32 * 32 + 1);
  std::ofstream(path, std::ios::binary) << text;
  return path;
}

const int kSteps = 30;

// train-gpt's argv: the flags split at spaces, then the extra arguments (paths).
std::vector<std::string> train_gpt(const std::string &flags,
                                   const std::vector<std::string> &extra = {}) {
  std::vector<std::string> argv = {TRAIN_GPT};
  std::stringstream ss(flags);
  for (std::string w; ss >> w;) argv.push_back(w);
  argv.insert(argv.end(), extra.begin(), extra.end());
  return argv;
}

// One short training run shared by the tests below: its outputs are what they check.
class TrainGpt : public testing::Test {
 protected:
  static void SetUpTestSuite() {
    metrics_ = tmp_dir() + "metrics.jsonl";
    model_ = tmp_dir() + "model.safetensors";
    train_ =
        run(train_gpt("--config tiny --steps 30 --lr 3e-3 --seed 7 --threads 2 --log-every 15 "
                      "--eval-windows 0 --eval-problems 16",
                      {"--metrics", metrics_, "--export", model_}));
  }
  static std::string metrics_, model_;
  static Result train_;
};
std::string TrainGpt::metrics_, TrainGpt::model_;
Result TrainGpt::train_;

TEST_F(TrainGpt, LossFallsAndMetricsHaveOneObjectPerStep) {
  ASSERT_EQ(train_.code, 0) << train_.err;
  std::vector<std::string> ls = lines(slurp(metrics_));
  ASSERT_EQ((int)ls.size(), kSteps);
  std::map<std::string, double> first, last;
  for (int i = 0; i < kSteps; i++) {
    std::map<std::string, double> o;
    ASSERT_TRUE(parse_flat_json(ls[i], &o)) << ls[i];
    for (const char *k : {"step", "loss", "ms_per_step", "tokens_per_s", "params", "grads",
                          "optim", "activations", "comm", "peak_rss"})
      ASSERT_TRUE(o.count(k)) << k << " missing in " << ls[i];
    EXPECT_EQ(o["step"], i + 1);
    EXPECT_GT(o["ms_per_step"], 0);
    EXPECT_GT(o["tokens_per_s"], 0);
    EXPECT_GT(o["params"], 0);
    EXPECT_EQ(o["params"], o["grads"]);
    EXPECT_EQ(o["optim"], 2 * o["params"]);
    EXPECT_GT(o["peak_rss"], o["params"]);
    if (i == 0) first = o;
    last = o;
  }
  std::printf("tiny on the addition task: loss %.3f -> %.3f in %d steps, eval %.3f\n",
              first["loss"], last["loss"], kSteps, last["eval_loss"]);
  EXPECT_GT(first["loss"], 5.0);  // about log(256) from the start
  EXPECT_LT(last["loss"], 0.6 * first["loss"]);
  EXPECT_TRUE(last.count("eval_loss") && last.count("accuracy"));
  EXPECT_NE(train_.out.find("step 30/30"), std::string::npos) << train_.out;
}

TEST_F(TrainGpt, ExportReloadsToTheSameEvalLoss) {
  ASSERT_EQ(train_.code, 0) << train_.err;
  std::map<std::string, double> last;
  ASSERT_TRUE(parse_flat_json(lines(slurp(metrics_)).back(), &last));
  Result r = run(
      {TRAIN_GPT, "--init", model_, "--eval-only", "--threads", "2", "--eval-problems", "16"});
  ASSERT_EQ(r.code, 0) << r.err;
  std::map<std::string, double> ev;
  ASSERT_EQ(lines(r.out).size(), 1u) << r.out;
  ASSERT_TRUE(parse_flat_json(r.out, &ev)) << r.out;
  EXPECT_NEAR(ev["eval_loss"], last["eval_loss"], 1e-6 * last["eval_loss"]);
  EXPECT_EQ(ev["accuracy"], last["accuracy"]);
  EXPECT_GT(ev["windows"], 100);
}

TEST_F(TrainGpt, EvalOnlyDataPrintsOneJsonLine) {
  ASSERT_EQ(train_.code, 0) << train_.err;
  std::string data = write_data_file();
  Result r = run({TRAIN_GPT, "--init", model_, "--eval-only", "--data", data});
  ASSERT_EQ(r.code, 0) << r.err;
  std::map<std::string, double> ev;
  ASSERT_TRUE(parse_flat_json(r.out, &ev)) << r.out;
  EXPECT_EQ(ev.size(), 2u) << r.out;
  EXPECT_EQ(ev["windows"], 32);
  EXPECT_GT(ev["eval_loss"], 0);
  EXPECT_EQ(r.out.rfind("{\"eval_loss\": ", 0), 0u) << r.out;
  EXPECT_EQ(r.out.find("\n"), r.out.size() - 1) << r.out;
}

TEST_F(TrainGpt, SamplesFromTheExport) {
  ASSERT_EQ(train_.code, 0) << train_.err;
  Result r = run({TRAIN_GPT, "--init", model_, "--steps", "0", "--sample", "12", "--prompt",
                  "12+34=", "--temperature", "0.8"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("--- sample (12 bytes, sampled) ---\n12+34="), std::string::npos)
      << r.out;
}

TEST_F(TrainGpt, LoadsInPyTorch) {
  ASSERT_EQ(train_.code, 0) << train_.err;
  if (run({"/usr/bin/python3", "-c", "import torch"}).code != 0)
    GTEST_SKIP() << "/usr/bin/python3 has no torch (apt install python3-torch)";
  Result r = run(
      {"/usr/bin/python3", CHECK_EXPORT, model_, write_data_file(), "--train-gpt", TRAIN_GPT});
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  std::printf("%s", r.out.c_str());
}

// Bad input: a message on stderr and a non-zero exit, never a crash.
struct BadCase {
  std::vector<std::string> args;
  int code;
  std::string message;
};

TEST(TrainGptErrors, BadInputIsRefusedClearly) {
  std::string corrupt = tmp_dir() + "corrupt.safetensors";
  std::ofstream(corrupt, std::ios::binary) << std::string("\x40\0\0\0\0\0\0\0{\"a\":", 13);
  std::string other = tmp_dir() + "other.safetensors";
  ASSERT_EQ(run({EMBED_C, other}).code, 0);
  std::string tiny = tmp_dir() + "tiny.safetensors";
  ASSERT_EQ(run({TRAIN_GPT, "--config", "tiny", "--steps", "0", "--export", tiny}).code, 0);
  std::string missing = tmp_dir() + "no-such.safetensors";
  const BadCase cases[] = {
      {{"--bogus"}, 2, "unknown option '--bogus'"},
      {{"--steps"}, 2, "--steps needs a value"},
      {{"--steps", "ten"}, 2, "--steps: expected a non-negative integer"},
      {{"--lr", "-1"}, 2, "--lr: expected a number"},
      {{"--config", "huge"}, 2, "--config must be tiny, small or medium"},
      {{"--config", "tiny", "--n-head", "5"}, 2, "must divide --d-model"},
      {{"--strategy", "zero"}, 2, "--strategy must be"},
      {{"--resume"}, 2, "--resume need --ckpt-dir"},
      {{"--ckpt-dir", missing, "--resume"}, 1, "no checkpoint to resume from"},
      {{"--init", missing, "--eval-only"}, 1, "no-such.safetensors"},
      {{"--init", corrupt, "--eval-only"}, 1, "corrupt.safetensors"},
      {{"--init", other, "--config", "tiny", "--eval-only"}, 1, "no tensor"},
      {{"--init", tiny, "--d-model", "32", "--n-head", "2", "--eval-only"},
       1,
       "destination is"},
      {{"--config", "tiny", "--data", missing}, 1, "no-such.safetensors"},
      {{"--config", "tiny", "--data", corrupt}, 1, "too few"},
  };
  for (const BadCase &c : cases) {
    std::vector<std::string> argv = {TRAIN_GPT};
    argv.insert(argv.end(), c.args.begin(), c.args.end());
    Result r = run(argv);
    EXPECT_EQ(r.code, c.code) << c.args[0] << ": " << r.err;
    EXPECT_NE(r.err.find(c.message), std::string::npos)
        << c.args[0] << ": expected '" << c.message << "' in: " << r.err;
  }
  Result env = run({"env", "RTP_WORLD_SIZE=2", "RTP_RANK=5", TRAIN_GPT});
  EXPECT_EQ(env.code, 2);
  EXPECT_NE(env.err.find("bad rank environment"), std::string::npos) << env.err;
  Result tp =
      run({RTP_RUN, "-n", "2", "--", TRAIN_GPT, "--config", "tiny", "--strategy", "tp"});
  EXPECT_EQ(tp.code, 2);
  EXPECT_NE(tp.err.find("--strategy tp on 2 ranks is not yet supported"), std::string::npos)
      << tp.err;
}

// Under rtp-run: rtp-run's argv for n ranks of train-gpt with these flags.
std::vector<std::string> on_ranks(int n, const std::string &flags,
                                  const std::vector<std::string> &extra = {}) {
  std::vector<std::string> argv = {RTP_RUN, "-n", std::to_string(n), "--"};
  std::vector<std::string> tg = train_gpt(flags, extra);
  argv.insert(argv.end(), tg.begin(), tg.end());
  return argv;
}

// The values of key in the objects of a metrics file, in order.
std::vector<double> metric(const std::string &path, const char *key) {
  std::vector<double> v;
  for (const std::string &l : lines(slurp(path))) {
    std::map<std::string, double> o;
    if (parse_flat_json(l, &o) && o.count(key)) v.push_back(o[key]);
  }
  return v;
}

const std::string kRanksFlags =
    "--config tiny --steps 10 --threads 1 --log-every 10 --eval-windows 8 --eval-problems 0";

// 2 ranks with batch 2 see the data of one process with batch 4 (sample_batch), and the
// strategy's gradients are those of the global mean: every step's loss is the same, in
// rank 0's metrics and in rank 1's. Only rank 0 prints.
void expect_losses_of_twice_the_batch(const std::string &strategy) {
  std::string one = tmp_dir() + "one.jsonl", two = tmp_dir() + strategy + ".jsonl";
  static const Result ref = run(train_gpt(kRanksFlags + " --batch 4", {"--metrics", one}));
  ASSERT_EQ(ref.code, 0) << ref.err;
  Result r =
      run(on_ranks(2, kRanksFlags + " --batch 2 --strategy " + strategy, {"--metrics", two}));
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  std::vector<double> want = metric(one, "loss"), got = metric(two, "loss");
  ASSERT_EQ(want.size(), 10u);
  ASSERT_EQ(got.size(), want.size());
  EXPECT_EQ(metric(two + ".rank1", "loss"), got);
  for (size_t i = 0; i < want.size(); i++) {
    std::printf("step %2zu: one process %.8f, 2 ranks (%s) %.8f\n", i + 1, want[i],
                strategy.c_str(), got[i]);
    EXPECT_NEAR(got[i], want[i], 1e-5 * want[i]) << "step " << i + 1;
  }
  EXPECT_NE(r.out.find("[0] step 10/10"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("[1] "), std::string::npos) << r.out;
}

TEST(TrainGptRanks, RtpLossesMatchOneProcess) {
  expect_losses_of_twice_the_batch("rtp");
}

TEST(TrainGptRanks, DdpLossesMatchOneProcess) {
  expect_losses_of_twice_the_batch("ddp");
}

// 2 rtp ranks export the model they evaluated: one process reads the consolidated file
// back to the eval loss they reported on the held-out tenth of --data (given to
// --eval-only as a file of its own: the same 16 windows).
TEST(TrainGptRanks, RtpExportReloadsToTheReportedEvalLoss) {
  std::string text, data = tmp_dir() + "ranks.txt", tail = tmp_dir() + "ranks-tail.txt";
  while (text.size() < 5130) text += "Blocks rotate around the ring; gradients come home. ";
  text.resize(5130);  // the last tenth: 513 bytes, 16 windows of 32 + 1
  std::ofstream(data, std::ios::binary) << text;
  std::ofstream(tail, std::ios::binary) << text.substr(text.size() - 513);
  std::string metrics = tmp_dir() + "ranks.jsonl", model = tmp_dir() + "ranks.safetensors";
  Result r = run(on_ranks(2,
                          "--config tiny --steps 10 --batch 2 --threads 1 --log-every 10 "
                          "--eval-windows 0 --strategy rtp",
                          {"--data", data, "--metrics", metrics, "--export", model}));
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  std::vector<double> reported = metric(metrics, "eval_loss");
  ASSERT_EQ(reported.size(), 2u);  // steps 1 and 10
  Result e = run({TRAIN_GPT, "--init", model, "--eval-only", "--data", tail, "--threads", "1"});
  ASSERT_EQ(e.code, 0) << e.err;
  std::map<std::string, double> ev;
  ASSERT_TRUE(parse_flat_json(e.out, &ev)) << e.out;
  EXPECT_EQ(ev["windows"], 16);
  EXPECT_NEAR(ev["eval_loss"], reported.back(), 1e-6 * reported.back());
  std::printf("2 rtp ranks reported eval %.8f; their export, in one process: %.8f\n",
              reported.back(), ev["eval_loss"]);
}

// Checkpoints: a run killed (SIGKILL) after a checkpoint and resumed prints the same losses,
// bit for bit, as one never stopped; so do 2 ranks resumed from their checkpoint; damaged
// or mismatched checkpoints are refused with a message, and never replaced.
const std::string kCkptFlags =
    "--config tiny --lr 3e-3 --seed 7 --threads 1 --log-every 100 --eval-windows 4 "
    "--eval-problems 0";

// The losses of steps after `from` (1-based steps) in a metrics file.
std::vector<double> losses_after(const std::string &path, int from) {
  std::vector<double> all = metric(path, "loss");
  return std::vector<double>(all.begin() + std::min<size_t>(from, all.size()), all.end());
}

int ckpt_step(const std::string &dir) {
  std::string latest = slurp(dir + "/latest");
  return latest.size() > 5 ? std::atoi(latest.c_str() + 5) : -1;
}

TEST(TrainGptCkpt, ResumeAfterKillGivesTheSameLosses) {
  std::string ref = tmp_dir() + "ck-ref.jsonl", dir = tmp_dir() + "ck-kill",
              resumed = tmp_dir() + "ck-resumed.jsonl";
  Result r = run(train_gpt(kCkptFlags + " --steps 60", {"--metrics", ref}));
  ASSERT_EQ(r.code, 0) << r.err;
  // Started in the background and killed as soon as its first checkpoint is complete.
  std::string cmd;
  for (const std::string &a :
       train_gpt(kCkptFlags + " --steps 60 --ckpt-every 5", {"--ckpt-dir", dir}))
    cmd += quote(a) + " ";
  cmd += ">/dev/null 2>&1 & pid=$!; while [ ! -e " + quote(dir + "/latest") +
         " ] && kill -0 $pid 2>/dev/null; do sleep 0.005; done; kill -9 $pid; wait $pid";
  std::system(cmd.c_str());
  int step = ckpt_step(dir);
  ASSERT_GT(step, 0);
  EXPECT_LT(step, 60) << "the run ended before it could be killed";
  Result again = run(train_gpt(kCkptFlags + " --steps 60 --ckpt-every 5 --resume",
                               {"--ckpt-dir", dir, "--metrics", resumed}));
  ASSERT_EQ(again.code, 0) << again.err;
  EXPECT_NE(again.out.find("resumed from"), std::string::npos) << again.out;
  std::vector<double> want = losses_after(ref, step), got = metric(resumed, "loss");
  EXPECT_EQ(got.size(), (size_t)(60 - step));
  EXPECT_EQ(got, want) << "killed at step " << step;
  EXPECT_EQ(ckpt_step(dir), 60);
  std::printf("killed after the checkpoint of step %d; resumed: %zu losses, all equal\n", step,
              got.size());
}

TEST(TrainGptCkpt, TwoRanksResumeWithTheSameLosses) {
  for (const char *strategy : {"rtp", "ddp"}) {
    std::string s = strategy, flags = kCkptFlags + " --batch 2 --strategy " + s;
    std::string ref = tmp_dir() + "ck2-ref-" + s + ".jsonl", dir = tmp_dir() + "ck2-" + s,
                resumed = tmp_dir() + "ck2-resumed-" + s + ".jsonl";
    ASSERT_EQ(run(on_ranks(2, flags + " --steps 20", {"--metrics", ref})).code, 0);
    Result first = run(on_ranks(2, flags + " --steps 10", {"--ckpt-dir", dir}));
    ASSERT_EQ(first.code, 0) << first.err;
    Result again = run(
        on_ranks(2, flags + " --steps 20 --resume", {"--ckpt-dir", dir, "--metrics", resumed}));
    ASSERT_EQ(again.code, 0) << again.err;
    EXPECT_EQ(metric(resumed, "loss"), losses_after(ref, 10)) << strategy;
    EXPECT_EQ(metric(resumed + ".rank1", "loss"), losses_after(ref, 10)) << strategy;
  }
}

TEST(TrainGptCkpt, BadCheckpointsAreRefusedAndKept) {
  std::string dir = tmp_dir() + "ck-bad", step = dir + "/step-00000010";
  ASSERT_EQ(run(train_gpt(kCkptFlags + " --steps 10", {"--ckpt-dir", dir})).code, 0);
  std::string good = slurp(step + "/rank-0.safetensors");
  struct Case {
    std::string damage, flags, message;
    int code;
  };
  const Case cases[] = {
      {"", " --steps 20", "already has checkpoints: --resume", 2},
      {"", " --steps 20 --resume --batch 4", "global_batch 8, this run has 4", 1},
      {"", " --steps 20 --resume --d-model 32 --n-head 2", "destination is", 1},
      {"printf X | dd of=rank-0.safetensors bs=1 conv=notrunc seek=900000 2>/dev/null",
       " --steps 20 --resume", "checksum mismatch (corrupted)", 1},
      {"truncate -s 1000 rank-0.safetensors", " --steps 20 --resume", "rank-0.safetensors", 1},
      {"mv COMPLETE COMPLETE.x", " --steps 20 --resume", "no COMPLETE marker", 1},
  };
  for (const Case &c : cases) {
    std::ofstream(step + "/rank-0.safetensors", std::ios::binary) << good;
    std::system(("cd " + quote(step) + " && mv -f COMPLETE.x COMPLETE 2>/dev/null").c_str());
    if (!c.damage.empty()) {
      ASSERT_EQ(std::system(("cd " + quote(step) + " && " + c.damage).c_str()), 0);
    }
    Result r = run(train_gpt(kCkptFlags + c.flags, {"--ckpt-dir", dir}));
    EXPECT_EQ(r.code, c.code) << c.damage << c.flags << ": " << r.err;
    EXPECT_NE(r.err.find(c.message), std::string::npos)
        << c.damage << c.flags << ": expected '" << c.message << "' in: " << r.err;
    EXPECT_EQ(ckpt_step(dir), 10) << "latest must stay on the last good checkpoint";
  }
  // A save that fails (its directory is in the way) leaves latest on step 10.
  std::system(("cd " + quote(step) + " && mv -f COMPLETE.x COMPLETE").c_str());
  std::ofstream(step + "/rank-0.safetensors", std::ios::binary) << good;
  std::ofstream(dir + "/step-00000015") << "in the way";
  Result r =
      run(train_gpt(kCkptFlags + " --steps 20 --ckpt-every 5 --resume", {"--ckpt-dir", dir}));
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("the previous one is intact"), std::string::npos) << r.err;
  EXPECT_EQ(ckpt_step(dir), 10);
}

TEST(TrainGptHelp, ListsTheIssueFlags) {
  Result r = run({TRAIN_GPT, "--help"});
  ASSERT_EQ(r.code, 0);
  for (const char *f :
       {"--config",    "--n-layer",  "--d-model",     "--n-head",  "--seq-len",  "--batch",
        "--steps",     "--lr",       "--seed",        "--threads", "--strategy", "--data",
        "--metrics",   "--ckpt-dir", "--ckpt-every",  "--resume",  "--init",     "--export",
        "--eval-only", "--sample",   "--temperature", "--help"})
    EXPECT_NE(r.out.find(f), std::string::npos) << f;
}

TEST(EmbedC, TrainsAndSaves) {
  std::string out = tmp_dir() + "mlp.safetensors";
  Result r = run({EMBED_C, out});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("step 100"), std::string::npos) << r.out;
  rtp_safetensors *st = nullptr;
  ASSERT_EQ(rtp_safetensors_open(out.c_str(), &st), 0) << rtp_last_error();
  EXPECT_EQ(rtp_safetensors_count(st), 3);
  EXPECT_GE(rtp_safetensors_find(st, "fc1.weight"), 0);
  rtp_safetensors_close(st);
}

TEST(TrainGptCpp, TrainsAndSaves) {
  std::string out = tmp_dir() + "cpp.safetensors";
  Result r = run({TRAIN_GPT_CPP, "12", out});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("step  12"), std::string::npos) << r.out;
  EXPECT_EQ(access(out.c_str(), R_OK), 0);
}

}  // namespace
