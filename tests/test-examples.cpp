// The examples end to end: train-gpt trains the tiny model on its built-in task, writes
// one metrics object per step, exports a model that --init and --eval-only read back to the
// same loss (and PyTorch too, when /usr/bin/python3 has torch), and refuses bad input with a
// message and a non-zero exit; under rtp-run, 2 ranks train like one process with twice the
// batch (rtp and ddp) or the same batch (tp, which splits the model, not the data) and
// export the model they evaluated; so do two "hosts" started with the README's multi-host
// commands; checkpoints resume with the same losses, also across strategies, damaged ones
// are refused, and a full disk during a save loses nothing already saved; token files
// (llm.c's and nanoGPT's) train, evaluate, resume and export with their vocabulary, and
// malformed ones are refused; embed-c and train-gpt-cpp run and save.
#include <arpa/inet.h>
#include <dirent.h>
#include <sys/socket.h>
#include <netinet/in.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <thread>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "device.h"
#include "gpt-hf.h"
#include "rtp.h"
#include "lr-schedule.h"
#include "test-util.h"

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

// argv's shell command line, its output going to files under tmp_dir().
std::string command(const std::vector<std::string> &argv) {
  std::string cmd;
  for (const std::string &a : argv) cmd += quote(a) + " ";
  return cmd + ">" + quote(tmp_dir() + "stdout") + " 2>" + quote(tmp_dir() + "stderr");
}

Result result(int status) {
  Result r;
  if (WIFEXITED(status)) r.code = WEXITSTATUS(status);
  r.out = slurp(tmp_dir() + "stdout");
  r.err = slurp(tmp_dir() + "stderr");
  return r;
}

Result run(const std::vector<std::string> &argv) {
  return result(std::system(command(argv).c_str()));
}

// run, where no file may grow past `bytes` (RLIMIT_FSIZE) and SIGXFSZ has its default
// action, which kills the process: a shell after ulimit -f, whatever this one inherited.
Result run_fsize_limited(const std::vector<std::string> &argv, rlim_t bytes) {
  std::string cmd = command(argv);
  std::fflush(nullptr);
  pid_t pid = fork();
  if (pid == 0) {
    rlimit rl = {bytes, bytes};
    signal(SIGXFSZ, SIG_DFL);
    if (setrlimit(RLIMIT_FSIZE, &rl) == 0)
      execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char *>(nullptr));
    _exit(127);
  }
  int st = 0;
  if (pid < 0 || waitpid(pid, &st, 0) != pid) return Result();
  return result(st);
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

// An evaluation of 99 batches says how far it is on stderr, a tenth at a time, and
// stdout stays the one JSON line.
TEST_F(TrainGpt, LongEvaluationShowsProgress) {
  ASSERT_EQ(train_.code, 0) << train_.err;
  Result r = run({TRAIN_GPT, "--init", model_, "--eval-only", "--eval-problems", "0"});
  ASSERT_EQ(r.code, 0) << r.err;
  std::vector<std::string> progress;
  for (const std::string &l : lines(r.err))
    if (l.rfind("evaluation: ", 0) == 0) progress.push_back(l);
  ASSERT_EQ(progress.size(), 10u) << r.err;
  EXPECT_EQ(progress[0], "evaluation: 0/792 windows") << r.err;
  EXPECT_EQ(lines(r.out).size(), 1u) << r.out;
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

// The built-in task's sample marks each sum the model wrote right or wrong, and counts
// them (a model of 300 steps writes sums, with wrong answers yet); a long sample says how
// far it is on stderr.
TEST(TrainGptSample, SumsAreMarkedRightOrWrong) {
  std::string model = tmp_dir() + "sums.safetensors";
  Result t =
      run(train_gpt("--config tiny --steps 300 --lr 3e-3 --seed 7 --threads 2 "
                    "--log-every 300 --eval-windows 0 --eval-problems 0",
                    {"--export", model}));
  ASSERT_EQ(t.code, 0) << t.err;
  Result r = run({TRAIN_GPT, "--init", model, "--steps", "0", "--sample", "64"});
  ASSERT_EQ(r.code, 0) << r.err;
  int marked = 0, right = 0, a, b, c;
  char mark[8];
  for (const std::string &l : lines(r.out)) {
    if (std::sscanf(l.c_str(), "%3d+%3d=%4d   %7s", &a, &b, &c, mark) != 4) continue;
    marked++;
    right += std::string(mark) == "right";
    EXPECT_EQ(std::string(mark), a + b == c ? "right" : "wrong") << l;
  }
  EXPECT_GE(marked, 3) << r.out;
  EXPECT_EQ(r.err.find("sampling: "), std::string::npos) << r.err;  // short: no progress
  Result l = run({TRAIN_GPT, "--init", model, "--steps", "0", "--sample", "300"});
  ASSERT_EQ(l.code, 0) << l.err;
  std::vector<std::string> progress;
  for (const std::string &e : lines(l.err))
    if (e.rfind("sampling: ", 0) == 0) progress.push_back(e);
  ASSERT_EQ(progress.size(), 10u) << l.err;
  EXPECT_EQ(progress[9], "sampling: 270/300 bytes") << l.err;
  EXPECT_NE(r.out.find(std::to_string(right) + " of " + std::to_string(marked) + " sums right"),
            std::string::npos)
      << r.out;
}

TEST_F(TrainGpt, LoadsInPyTorch) {
  ASSERT_EQ(train_.code, 0) << train_.err;
  if (run({"/usr/bin/python3", "-c", "import torch"}).code != 0)
    GTEST_SKIP() << "/usr/bin/python3 has no torch (apt install python3-torch)";
  // the eval loss, and a greedy sample of 100 bytes through the KV cache (past the window
  // of 32 twice) against the whole context's forward there
  Result r = run({"/usr/bin/python3", CHECK_EXPORT, model_, write_data_file(), "--train-gpt",
                  TRAIN_GPT, "--sample", "100"});
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
       "tensor 'transformer.wte.weight' is F32 [256, 64] in the file, expected F32 [256, 32]"},
      {{"--config", "tiny", "--data", missing}, 1, "no-such.safetensors"},
      {{"--config", "tiny", "--data", corrupt}, 1, "too few"},
      {{"--batch", "3", "--micro-batches", "2"},
       2,
       "--batch 3 does not split into --micro-batches 2"},
      {{"--pp", "2"}, 2, "--pp 2 on 1 ranks: the ranks must be S x D"},
      {{"--micro-batches", "4", "--unit", "3"},
       2,
       "--unit 3 does not divide --micro-batches 4"},
      {{"--schedule", "2f2b"}, 2, "--schedule must be gpipe, 1f1b, eager-1f1b or zeropp"},
      {{"--device", "gpu"}, 2, "--device must be auto, cpu, cuda or sim, not 'gpu'"},
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
      run({RTP_RUN, "-n", "3", "--", TRAIN_GPT, "--config", "tiny", "--strategy", "tp"});
  EXPECT_NE(tp.code, 0);  // every rank refuses; whichever exits first has said why
  EXPECT_NE(tp.err.find("] train-gpt: --strategy tp on 3 ranks: the 4 heads must split"),
            std::string::npos)
      << tp.err;
  EXPECT_NE(tp.err.find("failed first (exit code 2)"), std::string::npos) << tp.err;
  const std::pair<std::vector<std::string>, std::string> layouts[] = {
      {{"-n", "4", "--", TRAIN_GPT, "--pp", "3"},
       "] train-gpt: --pp 3 on 4 ranks: the ranks must be S x D (4 is not a multiple of 3)"},
      {{"-n", "4", "--", TRAIN_GPT, "--config", "tiny", "--pp", "4"},
       "] train-gpt: --pp 4 with 2 blocks (--n-layer): at most one stage per block"},
      {{"-n", "4", "--", TRAIN_GPT, "--pp", "2", "--strategy", "tp"},
       "] train-gpt: --strategy tp does not run inside pipeline stages"},
      {{"-n", "3", "--", TRAIN_GPT, "--stages", "2:tp,2:ddp"},
       "] train-gpt: --stages 2:tp,2:ddp has 4 ranks, the job 3"},
      {{"-n", "3", "--", TRAIN_GPT, "--stages", "2:rtp,one"},
       "] train-gpt: --stages '2:rtp,one': each stage is RANKS:STRATEGY, e.g. 2:tp,3:ddp (at "
       "'one')"},
      {{"-n", "3", "--", TRAIN_GPT, "--stages", "2:rtp,1:none", "--batch", "3",
        "--micro-batches", "3"},
       "] train-gpt: --stages: stage 0's 2 rtp ranks share the --micro-batches 3 units "
       "unevenly"},
      {{"-n", "3", "--", TRAIN_GPT, "--stages", "2:rtp,1:none", "--schedule", "1f1b"},
       "] train-gpt: --stages runs the gpipe schedule only, not --schedule 1f1b"},
      {{"-n", "3", "--", TRAIN_GPT, "--config", "tiny", "--stages", "1:none,1:none,1:none"},
       "] train-gpt: 3 --stages with 2 blocks (--n-layer): at most one stage per block"}};
  for (const auto &l : layouts) {
    std::vector<std::string> argv = {RTP_RUN};
    argv.insert(argv.end(), l.first.begin(), l.first.end());
    Result r = run(argv);
    EXPECT_EQ(r.code, 2) << r.err;
    EXPECT_NE(r.err.find(l.second), std::string::npos) << r.err;
  }
}

// Numbers out of range are refused with the range, never replaced by a default: 0 for a
// size is not "the config's", and sizes whose counts would overflow are refused up front.
TEST(TrainGptErrors, BadNumbersAreRefusedNotReplaced) {
  const BadCase cases[] = {
      {{"--n-layer", "0"}, 2, "--n-layer must be 1..256, not 0"},
      {{"--d-model", "0"}, 2, "--d-model must be 1..1048576, not 0"},
      {{"--n-head", "0"}, 2, "--n-head must be at least 1, not 0"},
      {{"--seq-len", "0"}, 2, "--seq-len must be 2..1048576, not 0"},
      {{"--d-model", "1073741824", "--n-head", "1"},
       2,
       "--d-model must be 1..1048576, not 1073741824"},
      {{"--threads", "0"}, 2, "--threads must be at least 1"},
      {{"--steps", "0", "--threads", "100000"},
       2,
       "--threads 100000: the library runs at most"},
      {{"--unit", "0"}, 2, "--pp, --micro-batches and --unit must be at least 1"},
      {{"--adam-in-backward", "--grad-clip", "1"},
       2,
       "--adam-in-backward: not with --grad-clip"},
      {{"--adam-in-backward", "--micro-batches", "2", "--batch", "2"},
       2,
       "--adam-in-backward: not with --grad-clip, --grad-accum, --micro-batches"},
      {{"--lr", "1e39"}, 2, "--lr: expected a number >= 0 that a float holds"},
      {{"--batch", "1073741824"}, 2, "--batch 1073741824 x --seq-len 32 is more than"},
      {{"--seq-len", "2", "--batch", "536870912", "--micro-batches", "536870912"},
       2,
       "--micro-batches 536870912 on 1 ranks: 1099511627776 graph nodes"},
      {{"--d-model", "1048576", "--n-head", "1048576", "--seq-len", "16384", "--batch",
        "131071"},
       2,
       "need more memory than 64 bits count"},
  };
  for (const BadCase &c : cases) {
    std::vector<std::string> argv = {TRAIN_GPT, "--config", "tiny"};
    argv.insert(argv.end(), c.args.begin(), c.args.end());
    Result r = run(argv);
    EXPECT_EQ(r.code, c.code) << c.args[0] << ": " << r.err;
    EXPECT_NE(r.err.find(c.message), std::string::npos)
        << c.args[0] << ": expected '" << c.message << "' in: " << r.err;
  }
}

// More threads than cores run, with a warning that they will wait for each other.
TEST(TrainGptErrors, ThreadsAboveTheCoresWarn) {
  long cores = sysconf(_SC_NPROCESSORS_ONLN);
  std::string n = std::to_string(cores + 1);
  Result r = run({TRAIN_GPT, "--config", "tiny", "--steps", "0", "--threads", n});
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.err.find("warning: --threads " + n + " is more than the " +
                       std::to_string(cores) + " cores"),
            std::string::npos)
      << r.err;
  r = run({TRAIN_GPT, "--config", "tiny", "--steps", "0", "--threads", std::to_string(cores)});
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.err.find("warning"), std::string::npos) << r.err;
}

// A copy of the model at from, each F32 tensor passed through edit (name, values, count),
// saved at to with the same metadata.
void edit_model(const std::string &from, const std::string &to,
                const std::function<void(const std::string &, float *, int64_t)> &edit) {
  rtp_safetensors *st = nullptr;
  ASSERT_EQ(rtp_safetensors_open(from.c_str(), &st), 0) << rtp_last_error();
  rtp_init_params ip = {64 << 20, nullptr, false, nullptr, 0};
  rtp_context *ctx = rtp_context_new(ip);
  std::vector<rtp_tensor *> ts;
  for (int i = 0; i < rtp_safetensors_count(st); i++) {
    const char *name = nullptr;
    ASSERT_EQ(rtp_safetensors_info(st, i, &name, nullptr, nullptr, nullptr), 0);
    rtp_tensor *t = rtp_safetensors_load(ctx, st, name);
    ASSERT_NE(t, nullptr) << rtp_last_error();
    edit(name, (float *)t->data, rtp_tensor_nelements(t));
    ts.push_back(t);
  }
  std::vector<const char *> meta;
  for (int i = 0; i < rtp_safetensors_meta_count(st); i++) {
    const char *k = nullptr, *v = nullptr;
    ASSERT_EQ(rtp_safetensors_meta_at(st, i, &k, &v), 0);
    meta.push_back(k);
    meta.push_back(v);
  }
  meta.push_back(nullptr);
  ASSERT_EQ(rtp_safetensors_save(to.c_str(), ts.data(), (int)ts.size(), meta.data()), 0)
      << rtp_last_error();
  rtp_context_free(ctx);
  rtp_safetensors_close(st);
}

// NaN in --init's weights, weights so large that the logits overflow, and a run whose
// --lr makes it diverge stop with a message naming what is not finite (the tensor, and the
// step), never with samples of byte 0 or an eval_loss of nan.
TEST(TrainGptErrors, NonFiniteNumbersStopWithTheirName) {
  std::string good = tmp_dir() + "finite.safetensors", nan = tmp_dir() + "nan.safetensors",
              big = tmp_dir() + "overflow.safetensors";
  ASSERT_EQ(run({TRAIN_GPT, "--config", "tiny", "--steps", "0", "--export", good}).code, 0);
  edit_model(good, nan, [](const std::string &name, float *v, int64_t) {
    if (name == "transformer.h.1.attn.c_attn.weight") v[3] = NAN;
  });
  // Every position's last state all ones (ln_f), each logit 64 x 1e37: past a float.
  edit_model(good, big, [](const std::string &name, float *v, int64_t n) {
    float fill = name == "transformer.ln_f.weight" ? 0.0f
                 : name == "transformer.ln_f.bias" ? 1.0f
                 : name == "lm_head.weight"        ? 1e37f
                                                   : NAN;
    for (int64_t i = 0; i < n && !std::isnan(fill); i++) v[i] = fill;
  });
  for (const char *mode : {"--sample", "--eval-only", "--steps"}) {
    std::vector<std::string> args = {TRAIN_GPT, "--init", nan, mode};
    if (std::string(mode) != "--eval-only") args.push_back("4");
    Result r = run(args);
    EXPECT_EQ(r.code, 1) << mode << ": " << r.err;
    EXPECT_NE(r.err.find("--init " + nan +
                         ": transformer.h.1.attn.c_attn.weight holds nan: the weights must be "
                         "finite"),
              std::string::npos)
        << mode << ": " << r.err;
    EXPECT_EQ(r.out.find("--- sample"), std::string::npos) << r.out;
  }
  for (const char *mode : {"--sample", "--eval-only"}) {
    std::vector<std::string> args = {TRAIN_GPT, "--init", big, "--steps", "0", mode};
    if (std::string(mode) == "--sample") args.push_back("4");
    Result r = run(args);
    EXPECT_EQ(r.code, 1) << mode << ": " << r.err;
    EXPECT_NE(r.err.find("the model's logits are not finite: its weights overflow"),
              std::string::npos)
        << mode << ": " << r.err;
    EXPECT_EQ(r.out.find("--- sample"), std::string::npos) << r.out;
    EXPECT_EQ(r.out.find("nan"), std::string::npos) << r.out;
  }
  Result diverged = run(train_gpt(
      "--config tiny --lr 1e30 --steps 5 --threads 1 --eval-windows 1 --eval-problems 0"));
  EXPECT_EQ(diverged.code, 1) << diverged.err;
  EXPECT_NE(diverged.err.find("train-gpt: step 2: optimizer: rtp_optimizer_step: step 2: the "
                              "gradients of '"),
            std::string::npos)
      << diverged.err;
  EXPECT_NE(diverged.err.find("' are not finite (NaN or infinity): the loss diverged"),
            std::string::npos)
      << diverged.err;
}

// A FIFO, a device, a directory or a link loop as --data or --init is refused with one
// line naming it, at once: reading a FIFO would wait for a writer and /dev/zero would
// fill memory, so each run has a deadline (timeout's status 124 says it blocked).
TEST(TrainGptErrors, SpecialFilesAreRefusedWithoutBlocking) {
  std::string dir = tmp_dir() + "special/", fifo = dir + "fifo", loop = dir + "loop";
  ASSERT_EQ(mkdir(dir.c_str(), 0700), 0);
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  ASSERT_EQ(symlink(loop.c_str(), loop.c_str()), 0);
  const std::pair<std::vector<std::string>, std::string> cases[] = {
      {{"--data", fifo}, "--data " + fifo + ": " + fifo + ": is a FIFO, not a regular file"},
      {{"--data", "/dev/zero"},
       "--data /dev/zero: /dev/zero: is a character device, not a regular file"},
      {{"--data", dir}, dir + ": is a directory, not a regular file"},
      {{"--data", loop}, loop + ": cannot open: Too many levels of symbolic links"},
      {{"--init", fifo, "--eval-only"}, "--init " + fifo + ": " + fifo + ": is a FIFO"},
      {{"--init", "/dev/zero", "--eval-only"}, "/dev/zero: is a character device"},
      {{"--init", dir, "--eval-only"}, dir + ": is a directory, not a regular file"},
  };
  for (const auto &c : cases) {
    std::vector<std::string> argv = {"timeout", "20", TRAIN_GPT, "--config", "tiny"};
    argv.insert(argv.end(), c.first.begin(), c.first.end());
    Result r = run(argv);
    EXPECT_EQ(r.code, 1) << c.first[1] << ": " << r.err;
    EXPECT_EQ(r.err.rfind("train-gpt: ", 0), 0u) << r.err;
    EXPECT_NE(r.err.find(c.second), std::string::npos)
        << "expected '" << c.second << "' in: " << r.err;
    EXPECT_EQ(lines(r.err).size(), 1u) << r.err;
  }
  std::remove(fifo.c_str());
  std::remove(loop.c_str());
  rmdir(dir.c_str());
}

// --init takes only a file of the model's own sizes: one with more or fewer layers, longer
// or wider tensors, or metadata that disagrees (n_head changes no shape) is refused naming
// the tensor and both shapes, or the size; it used to load the first rows and layers of a
// larger model.
TEST(TrainGptErrors, InitMustMatchTheModelExactly) {
  const struct {
    const char *name, *sizes, *message;
  } cases[] = {
      {"layers3", "--n-layer 3", "tensor 'transformer.h.2."},
      {"layers1", "--n-layer 1", "no tensor 'transformer.h.1."},
      {"longer", "--seq-len 64",
       "tensor 'transformer.wpe.weight' is F32 [64, 64] in the file, expected F32 [32, 64]"},
      {"wider", "--d-model 128",
       "tensor 'transformer.wte.weight' is F32 [256, 128] in the file, expected F32 [256, 64]"},
      {"heads", "--n-head 2", "its metadata says n_head 2, the model has 4"},
  };
  for (const auto &c : cases) {
    std::string file = tmp_dir() + "init-" + c.name + ".safetensors";
    Result made =
        run(train_gpt(std::string("--config tiny --steps 0 ") + c.sizes, {"--export", file}));
    ASSERT_EQ(made.code, 0) << made.err;
    Result r = run(train_gpt("--config tiny --eval-only", {"--init", file}));
    EXPECT_EQ(r.code, 1) << c.name << ": " << r.out << r.err;
    EXPECT_NE(r.err.find("train-gpt: --init " + file + ": "), std::string::npos) << r.err;
    EXPECT_NE(r.err.find(c.message), std::string::npos)
        << c.name << ": expected '" << c.message << "' in: " << r.err;
    if (std::string(c.name) == "layers3") {
      EXPECT_NE(r.err.find("is not expected (41 tensors, 29 expected)"), std::string::npos)
          << r.err;
    }
    std::remove(file.c_str());
  }
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

// The losses of one process with batch 4 under kRanksFlags (run once).
const std::vector<double> &one_process_losses() {
  static const std::vector<double> losses = [] {
    std::string one = tmp_dir() + "one.jsonl";
    Result ref = run(train_gpt(kRanksFlags + " --batch 4", {"--metrics", one}));
    EXPECT_EQ(ref.code, 0) << ref.err;
    return metric(one, "loss");
  }();
  return losses;
}

// Rank 0's losses in the metrics file m (and rank 1's in m.rank1, which must be the same)
// are one process's with the same global batch, to float rounding; every object counts the
// global batch's tokens once: tokens_per_s x ms_per_step = 4 x 32 tokens per step.
void expect_one_process_losses(const std::string &m, const std::string &what,
                               bool ranks = true) {
  const std::vector<double> &want = one_process_losses();
  std::vector<double> got = metric(m, "loss"), tps = metric(m, "tokens_per_s"),
                      ms = metric(m, "ms_per_step");
  ASSERT_EQ(want.size(), 10u);
  ASSERT_EQ(got.size(), want.size());
  if (ranks) {
    EXPECT_EQ(metric(m + ".rank1", "loss"), got);
  }
  for (size_t i = 0; i < want.size(); i++) {
    std::printf("step %2zu: one process %.8f, %s %.8f\n", i + 1, want[i], what.c_str(), got[i]);
    EXPECT_NEAR(got[i], want[i], 1e-5 * want[i]) << what << ", step " << i + 1;
  }
  ASSERT_EQ(tps.size(), ms.size());
  for (size_t i = 0; i < tps.size(); i++)
    EXPECT_NEAR(tps[i] * ms[i] / 1e3, 4 * 32, 0.01 * 4 * 32) << what << ", step " << i + 1;
}

// 2 ranks with batch 2 see the data of one process with batch 4 (sample_batch), and the
// strategy's gradients are those of the global mean; tp ranks with batch 4 all see the
// batch of one process with batch 4 and compute its loss together: every step's loss is
// the same, in rank 0's metrics and in rank 1's. Only rank 0 prints.
void expect_losses_of_one_process(const std::string &strategy) {
  std::string two = tmp_dir() + strategy + ".jsonl";
  std::string batch = strategy == "tp" ? " --batch 4" : " --batch 2";
  Result r =
      run(on_ranks(2, kRanksFlags + batch + " --strategy " + strategy, {"--metrics", two}));
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  expect_one_process_losses(two, "2 ranks (" + strategy + ")");
  EXPECT_NE(r.out.find("[0] step 10/10"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("[1] "), std::string::npos) << r.out;
}

// A tied GPT-2-sized vocabulary read by a few tokens: the embedding's gradients are whole
// tables whatever the batch, and the arena must count them (it once ran out making the
// optimizer).
TEST(TrainGptArena, LargeTiedVocabularyWithFewTokensFits) {
  std::string tok = tmp_dir() + "tokens50k.bin";
  {
    std::vector<uint16_t> t(4096);
    for (size_t i = 0; i < t.size(); i++) t[i] = (uint16_t)((i * 7919) % 50304);
    std::ofstream(tok, std::ios::binary)
        .write(reinterpret_cast<const char *>(t.data()), (std::streamsize)(t.size() * 2));
  }
  Result r =
      run(train_gpt("--data-format uint16 --vocab 50304 --tie-embeddings --n-layer 1 "
                    "--d-model 768 --n-head 12 --seq-len 64 --batch 1 --steps 1 "
                    "--threads 1 --eval-windows 1",
                    {"--data", tok}));
  EXPECT_EQ(r.code, 0) << r.err;
}

// --device: auto is the CPU on a host without a GPU, and says so; cuda there is an error
// with the reason (no CUDA in this build, no driver, no device), not a run on the CPU.
TEST(TrainGptDevice, WithoutAGpuAutoIsTheCpuAndCudaIsRefused) {
  if (rtp_backend_cuda_count() > 0) GTEST_SKIP() << "this host has a CUDA device";
  const std::string flags =
      "--config tiny --steps 3 --threads 1 --eval-windows 0 "
      "--eval-problems 0 --log-every 3";
  std::string a = tmp_dir() + "auto.jsonl", c = tmp_dir() + "cpu.jsonl";
  Result r = run(train_gpt(flags, {"--metrics", a}));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("; on cpu\n"), std::string::npos) << r.out;
  ASSERT_EQ(run(train_gpt(flags + " --device cpu", {"--metrics", c})).code, 0);
  EXPECT_EQ(metric(a, "loss"), metric(c, "loss"));
  Result cuda = run(train_gpt(flags + " --device cuda", {}));
  EXPECT_EQ(cuda.code, 1);
  EXPECT_NE(cuda.err.find("train-gpt: --device cuda: "), std::string::npos) << cuda.err;
  EXPECT_EQ(cuda.out.find("step"), std::string::npos) << cuda.out;
}

// Where the ranks' transfers go: NCCL when each of the host's ranks has a GPU of its own,
// TCP when they share one (NCCL refuses that) or compute on the CPU, and always what the
// environment names.
TEST(TrainGptDevice, TransportFollowsTheGpus) {
  auto transport = [](int index, int count, long local, int world, const char *env) {
    if (env)
      setenv("RTP_BACKEND", env, 1);
    else
      unsetenv("RTP_BACKEND");
    device d{};
    d.index = index;
    d.count = count;
    rtp_comm_params p{};
    p.world_size = world;
    device_choose_transport(&d, local, &p);
    unsetenv("RTP_BACKEND");
    return std::string(p.backend);
  };
  EXPECT_EQ(transport(0, 2, 2, 2, nullptr), "nccl");
  EXPECT_EQ(transport(1, 8, 4, 8, nullptr), "nccl");  // two hosts of 4 ranks, 8 GPUs each
  EXPECT_EQ(transport(0, 1, 2, 2, nullptr), "");      // two ranks share GPU 0: TCP
  EXPECT_EQ(transport(-1, 0, 2, 2, nullptr), "");     // the CPU
  EXPECT_EQ(transport(0, 2, 1, 1, nullptr), "");      // one process: no transfers
  EXPECT_EQ(transport(0, 2, 2, 2, "tcp"), "");        // the environment's choice stands
}

// The trainer's whole device path on the simulated device (rtp_backend_sim_new: the CPU's
// kernels on memory the host cannot touch, so any host access of device data faults):
// one process and two ranks (rtp and tp, over TCP) train to the CPU's losses bit for bit,
// and a checkpoint, an export and a sample of a device run are a CPU run's.
TEST(TrainGptDevice, SimulatedDeviceTrainsLikeTheCpu) {
  const std::string flags =
      "--config tiny --steps 4 --threads 1 --eval-windows 8 "
      "--eval-problems 2 --log-every 2";
  auto losses = [&](const std::string &extra, int ranks, const std::string &name) {
    std::string m = tmp_dir() + name + ".jsonl";
    Result r = ranks == 1 ? run(train_gpt(flags + extra, {"--metrics", m}))
                          : run(on_ranks(ranks, flags + extra, {"--metrics", m}));
    EXPECT_EQ(r.code, 0) << name << ": " << r.err;
    if (ranks == 1 && extra.find("sim") != std::string::npos) {
      EXPECT_NE(r.out.find("; on sim\n"), std::string::npos) << r.out;
    }
    std::vector<double> l = metric(m, "loss"), e = metric(m, "eval_loss");
    l.insert(l.end(), e.begin(), e.end());
    return l;
  };
  std::vector<double> cpu = losses(" --device cpu", 1, "cpu");
  ASSERT_EQ(cpu.size(), 4u + 3u);
  EXPECT_EQ(losses(" --device sim", 1, "sim"), cpu);
  for (const char *strategy : {"rtp", "tp"}) {
    std::string s = std::string(" --batch 4 --strategy ") + strategy;
    EXPECT_EQ(losses(s + " --device sim", 2, std::string("sim2-") + strategy),
              losses(s + " --device cpu", 2, std::string("cpu2-") + strategy))
        << strategy;
  }
  // A checkpoint of the device run, resumed on the CPU: the CPU's own losses.
  std::string ck = tmp_dir() + "sim-ck", m = tmp_dir() + "sim-resumed.jsonl";
  std::string half = "--config tiny --threads 1 --eval-windows 8 --eval-problems 0 --steps ";
  ASSERT_EQ(run(train_gpt(half + "2 --device sim --ckpt-dir " + ck)).code, 0);
  Result resumed =
      run(train_gpt(half + "4 --device cpu --resume --ckpt-dir " + ck, {"--metrics", m}));
  ASSERT_EQ(resumed.code, 0) << resumed.err;
  std::vector<double> got = metric(m, "loss");
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[0], cpu[2]);
  EXPECT_EQ(got[1], cpu[3]);
  // The device run's export: the CPU's evaluation, and the same sample either way.
  std::string model = tmp_dir() + "sim.safetensors";
  ASSERT_EQ(run(train_gpt(half + "4 --device sim --export " + model)).code, 0);
  std::string read = "--init " + model + " --eval-only --eval-problems 0 --threads 1 --device ";
  Result on_cpu = run(train_gpt(read + "cpu")), on_sim = run(train_gpt(read + "sim"));
  ASSERT_EQ(on_cpu.code, 0) << on_cpu.err;
  ASSERT_EQ(on_sim.code, 0) << on_sim.err;
  EXPECT_EQ(on_cpu.out, on_sim.out);
  std::string sample = "--init " + model + " --steps 0 --sample 24 --threads 1 --device ";
  Result s_cpu = run(train_gpt(sample + "cpu")), s_sim = run(train_gpt(sample + "sim"));
  ASSERT_EQ(s_sim.code, 0) << s_sim.err;
  EXPECT_EQ(s_cpu.out, s_sim.out);
}

// A stranger floods rank 0's port while 2 ranks meet and train (~600 connections kept
// open, 30 of them trickling a byte at a time): the job trains to the losses of one
// process all the same (docs/transport.md, "Strangers").
TEST(TrainGptRanks, FloodedJobTrainsToTheSameLosses) {
  int port = rtptest::free_port();
  std::atomic<bool> stop{false};
  std::atomic<long> opened{0};
  std::thread flood([&] { opened = rtptest::flood_port(port, [&] { return stop.load(); }); });
  usleep(300000);  // the flood first
  std::string m = tmp_dir() + "flooded.jsonl";
  std::vector<std::string> argv = {
      RTP_RUN, "-n", "2", "--master", "127.0.0.1:" + std::to_string(port), "--"};
  for (const std::string &a : train_gpt(kRanksFlags + " --batch 2", {"--metrics", m}))
    argv.push_back(a);
  Result r = run(argv);
  stop = true;
  flood.join();
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_GT(opened.load(), 1000) << "the flood did not flood";
  expect_one_process_losses(m, "2 flooded ranks (rtp)");
}

// Each strategy on 2 ranks with flags and extra (batch 2 each; tp's ranks share one batch,
// of 4) trains to want's losses (1e-5 relative), both ranks logging the same; the metrics go
// to tmp_dir() + name + "-<strategy>.jsonl".
void expect_two_ranks_give(const std::string &flags, std::vector<std::string> extra,
                           const std::vector<double> &want, const std::string &name,
                           std::initializer_list<const char *> strategies = {"rtp", "fsdp",
                                                                             "ddp", "tp"}) {
  for (const std::string st : strategies) {
    std::string m = tmp_dir() + name + "-" + st + ".jsonl";
    std::string batch = st == "tp" ? " --batch 4" : " --batch 2";
    std::vector<std::string> args = extra;
    args.insert(args.end(), {"--metrics", m});
    Result r = run(on_ranks(2, flags + batch + " --strategy " + st, args));
    ASSERT_EQ(r.code, 0) << st << ": " << r.err;
    std::vector<double> got = metric(m, "loss");
    ASSERT_EQ(got.size(), want.size()) << st;
    EXPECT_EQ(metric(m + ".rank1", "loss"), got) << st;
    for (size_t i = 0; i < want.size(); i++)
      EXPECT_NEAR(got[i], want[i], 1e-5 * want[i]) << st << ", step " << i + 1;
  }
}

// A cosine schedule with warm-up, AdamW's decay (off the biases and LayerNorm weights on
// every rank's share) and clipping train on 2 ranks as in one process, under every
// strategy.
TEST(TrainGptRanks, ScheduleDecayAndClipMatchOneProcess) {
  const std::string flags = kRanksFlags +
                            " --weight-decay 0.1 --grad-clip 1 --lr-schedule cosine --warmup 3 "
                            "--max-steps 10";
  std::string one = tmp_dir() + "wd-one.jsonl";
  ASSERT_EQ(run(train_gpt(flags + " --batch 4", {"--metrics", one})).code, 0);
  std::vector<double> want = metric(one, "loss");
  ASSERT_EQ(want.size(), 10u);
  expect_two_ranks_give(flags, {}, want, "wd");
}

// The fused attention op (train-gpt's default, which every test here runs unless it says
// otherwise) trains to the losses of the unfused chain (--fused-attn off) in one process,
// with T = 40 (a key block of 32 and a partial one), and so do 2 ranks under rtp and under
// tp, which splits the fused op by heads.
TEST(TrainGptRanks, FusedAttentionMatchesUnfused) {
  const std::string flags = kRanksFlags + " --seq-len 40";
  std::vector<double> loss[2];
  for (int fused = 0; fused < 2; fused++) {
    std::string m = tmp_dir() + "attn-" + std::to_string(fused) + ".jsonl";
    std::string on = fused ? " --fused-attn on" : " --fused-attn off";
    Result r = run(train_gpt(flags + " --batch 4" + on, {"--metrics", m}));
    ASSERT_EQ(r.code, 0) << r.err;
    loss[fused] = metric(m, "loss");
    ASSERT_EQ(loss[fused].size(), 10u);
  }
  for (size_t i = 0; i < loss[0].size(); i++) {
    std::printf("step %2zu: unfused %.8f, fused %.8f\n", i + 1, loss[0][i], loss[1][i]);
    EXPECT_NEAR(loss[1][i], loss[0][i], 1e-5 * loss[0][i]) << "step " << i + 1;
  }
  expect_two_ranks_give(flags + " --fused-attn on", {}, loss[0], "attn", {"rtp", "tp"});
}

TEST(TrainGptRanks, RtpLossesMatchOneProcess) {
  expect_losses_of_one_process("rtp");
}

TEST(TrainGptRanks, DdpLossesMatchOneProcess) {
  expect_losses_of_one_process("ddp");
}

TEST(TrainGptRanks, FsdpLossesMatchOneProcess) {
  expect_losses_of_one_process("fsdp");
}

TEST(TrainGptRanks, TpLossesMatchOneProcessWithTheSameBatch) {
  expect_losses_of_one_process("tp");
}

// Pipelines: 4 ranks as 2 stages x 2 ranks with batch 2 train on the global batch of one
// process with batch 4, whatever runs inside the stages, the schedule, the micro-batches
// and recomputation; one process with micro-batches and recomputation does too, and so
// does tp with recomputation (its ranks all train on the batch of 4), and the optimizer in
// backward, with and without recomputation.
TEST(TrainGptPipeline, LossesMatchOneProcess) {
  struct Case {
    int ranks;
    std::string flags;
  };
  const Case cases[] = {
      {4, " --pp 2 --batch 2 --strategy rtp"},
      {4, " --pp 2 --batch 2 --strategy fsdp --micro-batches 2 --schedule gpipe"},
      {4, " --pp 2 --batch 2 --strategy ddp --micro-batches 2 --schedule eager-1f1b"},
      {4, " --pp 2 --batch 2 --strategy rtp --micro-batches 2 --schedule zeropp --recompute"},
      {2, " --pp 2 --batch 4 --micro-batches 4"},
      {1, " --batch 4 --micro-batches 2 --recompute"},
      {2, " --batch 4 --strategy tp --recompute"},
      {1, " --batch 4 --recompute --adam-in-backward"},
      {2, " --batch 2 --strategy rtp --recompute --adam-in-backward"},
      {2, " --batch 2 --strategy fsdp --adam-in-backward"},
  };
  for (const Case &c : cases) {
    std::string m = tmp_dir() + "pp.jsonl";
    std::vector<std::string> extra = {"--metrics", m};
    Result r = run(c.ranks == 1 ? train_gpt(kRanksFlags + c.flags, extra)
                                : on_ranks(c.ranks, kRanksFlags + c.flags, extra));
    ASSERT_EQ(r.code, 0) << c.flags << "\n" << r.out << r.err;
    expect_one_process_losses(m, std::to_string(c.ranks) + " ranks," + c.flags, c.ranks > 1);
  }
}

// Stages of different sizes and strategies (--stages): the global batch of 4 in units of
// 1 or 2 trains as one process with batch 4, whatever each stage runs.
TEST(TrainGptPipeline, StagesOfDifferentSizesMatchOneProcess) {
  struct Case {
    int ranks;
    std::string flags;
  };
  const Case cases[] = {
      {4, " --stages 2:tp,2:ddp --batch 4 --micro-batches 4"},
      {3, " --stages 1:none,2:fsdp --batch 4 --micro-batches 2"},
  };
  for (const Case &c : cases) {
    std::string m = tmp_dir() + "stages.jsonl";
    Result r = run(on_ranks(c.ranks, kRanksFlags + c.flags, {"--metrics", m}));
    ASSERT_EQ(r.code, 0) << c.flags << "\n" << r.out << r.err;
    EXPECT_NE(r.out.find("on " + std::to_string(c.ranks) + " ranks (stages "),
              std::string::npos)
        << r.out;
    expect_one_process_losses(m, std::to_string(c.ranks) + " ranks," + c.flags);
  }
  // Sampling gathers each parameter on its stage (tp's pieces too) and broadcasts it over
  // the job: the bytes one process samples.
  const std::string sample = " --prompt 1+1= --sample 16";
  Result a = run(train_gpt(kRanksFlags + " --batch 4" + sample));
  Result b = run(
      on_ranks(4, kRanksFlags + sample + " --stages 2:tp,2:ddp --batch 4 --micro-batches 4"));
  ASSERT_EQ(a.code, 0) << a.err;
  ASSERT_EQ(b.code, 0) << b.out << b.err;
  size_t at = a.out.find("--- sample"), bt = b.out.find("[0] --- sample");
  ASSERT_TRUE(at != std::string::npos && bt != std::string::npos) << a.out << b.out;
  std::string sb;
  for (const std::string &l : lines(b.out.substr(bt)))
    sb += (l.rfind("[0] ", 0) == 0 ? l.substr(4) : l) + "\n";
  EXPECT_EQ(sb, a.out.substr(at)) << b.out;
}

// The README's pipeline command as written there, with flags for a short run appended.
TEST(TrainGptPipeline, ReadmeCommand) {
  std::string cmd;
  for (const std::string &l : lines(slurp(RTP_TEST_DIR "/../README.md")))
    if (l.find("--pp 2") != std::string::npos && l.rfind("build/tools/rtp-run", 0) == 0)
      cmd = l;
  ASSERT_FALSE(cmd.empty()) << "README.md: expected a line 'build/tools/rtp-run ... --pp 2'";
  std::string argv;
  std::stringstream ss(cmd);
  for (std::string w; ss >> w; argv += w + " ") {
    if (w == "build/tools/rtp-run") w = quote(RTP_RUN);
    if (w == "build/examples/train-gpt") w = quote(TRAIN_GPT);
  }
  argv += "--config tiny --steps 4 --threads 1 --eval-windows 4 --eval-problems 0";
  Result r = run({"sh", "-c", argv});
  ASSERT_EQ(r.code, 0) << argv << "\n" << r.out << r.err;
  EXPECT_NE(r.out.find("2 pipeline stages x 2 ranks, rtp inside"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("[0] step 4/4"), std::string::npos) << r.out;
}

// RTP_TRACE: every rank of a pipelined run writes its Chrome trace (its compute, waits and
// transfers, the pipe's sends and recvs among them), scripts/trace-merge puts the four in
// one file with a line per rank, and scripts/trace-timeline draws a step of it.
TEST(TrainGptPipeline, TraceShowsEveryRank) {
  std::string prefix = tmp_dir() + "trace", merged = prefix + ".json";
  ASSERT_EQ(std::system(("rm -f " + quote(prefix) + ".*").c_str()), 0);
  std::vector<std::string> argv = {"env", "RTP_TRACE=" + prefix};
  for (const std::string &a : on_ranks(4, kRanksFlags + " --steps 2 --pp 2 --micro-batches 2"))
    argv.push_back(a);
  Result r = run(argv);
  ASSERT_EQ(r.code, 0) << r.err;
  for (int rank = 0; rank < 4; rank++) {
    std::string t = slurp(prefix + "." + std::to_string(rank) + ".json");
    EXPECT_NE(t.find("\"cat\": \"compute\""), std::string::npos) << rank;
    EXPECT_NE(t.find(rank < 2 ? "send to 1" : "recv from 0"), std::string::npos) << rank;
    EXPECT_NE(t.find("\"name\": \"rank " + std::to_string(rank) + "\""), std::string::npos);
  }
  Result m = run({RTP_TEST_DIR "/../scripts/trace-merge", prefix});
  ASSERT_EQ(m.code, 0) << m.err;
  EXPECT_EQ(lines(m.out).size(), 5u) << m.out;
  EXPECT_NE(m.out.find("events from 4 ranks"), std::string::npos) << m.out;
  EXPECT_NE(slurp(merged).find("\"traceEvents\""), std::string::npos);
  std::string svg = tmp_dir() + "trace.svg";
  Result t = run({RTP_TEST_DIR "/../scripts/trace-timeline", merged, svg});
  ASSERT_EQ(t.code, 0) << t.err;
  std::string pic = slurp(svg);
  for (int rank = 0; rank < 4; rank++)  // a row per rank, with its bubble
    EXPECT_NE(pic.find(">rank " + std::to_string(rank) + ": bubble 0."), std::string::npos)
        << rank;
  EXPECT_NE(pic.find("fill=\"#d62728\""), std::string::npos) << "no wait on the pipe drawn";
}

// A pipeline's export is the model it evaluated, and its eval loss, decoding and
// sampling (the last stage's logits, shared) are one process's.
TEST(TrainGptPipeline, ExportEvalAndSamplesMatchOneProcess) {
  std::string one = tmp_dir() + "pp-one.safetensors", pp = tmp_dir() + "pp-4.safetensors";
  const std::string flags =
      "--config tiny --steps 20 --threads 1 --log-every 20 --eval-windows 8 --eval-problems 8 "
      "--sample 24";
  Result a = run(train_gpt(flags + " --batch 4", {"--export", one}));
  Result b = run(on_ranks(4, flags + " --batch 2 --pp 2 --micro-batches 2", {"--export", pp}));
  ASSERT_EQ(a.code, 0) << a.err;
  ASSERT_EQ(b.code, 0) << b.out << b.err;
  auto tail = [](const std::string &out, const std::string &from) {
    size_t at = out.find(from);
    return at == std::string::npos ? std::string() : out.substr(at);
  };
  std::string sa = tail(a.out, "--- sample"), sb;
  for (const std::string &l : lines(tail(b.out, "[0] --- sample")))
    sb += (l.rfind("[0] ", 0) == 0 ? l.substr(4) : l) + "\n";
  EXPECT_FALSE(sa.empty()) << a.out;
  EXPECT_EQ(sb, sa) << b.out;
  std::string ea = tail(a.out, "step 20/20"), eb = tail(b.out, "[0] step 20/20");
  ASSERT_FALSE(ea.empty() || eb.empty()) << a.out << b.out;
  EXPECT_EQ(eb.substr(4, eb.find(" | ", eb.find("eval")) - 4),
            ea.substr(0, ea.find(" | ", ea.find("eval"))));
  Result e1 = run({TRAIN_GPT, "--init", one, "--eval-only", "--threads", "1"});
  Result e2 = run({TRAIN_GPT, "--init", pp, "--eval-only", "--threads", "1"});
  ASSERT_EQ(e1.code | e2.code, 0) << e1.err << e2.err;
  std::map<std::string, double> v1, v2;
  ASSERT_TRUE(parse_flat_json(e1.out, &v1) && parse_flat_json(e2.out, &v2)) << e1.out << e2.out;
  EXPECT_NEAR(v2["eval_loss"], v1["eval_loss"], 1e-5 * v1["eval_loss"]);
  Result e3 = run(on_ranks(4, "--eval-only --threads 1 --pp 2", {"--init", pp}));
  ASSERT_EQ(e3.code, 0) << e3.err;
  std::map<std::string, double> v3;
  ASSERT_TRUE(parse_flat_json(e3.out.substr(4), &v3)) << e3.out;
  EXPECT_NEAR(v3["eval_loss"], v2["eval_loss"], 1e-5 * v2["eval_loss"]);
}

// --bf16 is mixed precision: every strategy's products take bf16 operands (weights, sums
// and Adam stay f32) and rtp's blocks also travel as bf16, so its pool and bytes sent
// halve. One process and 2 ddp ranks with --bf16 train alike (within bf16 rounding
// boundaries: 1e-4, as MixedPrecision in test-parallel), every run stays near the f32
// process (bf16 keeps 8 bits of mantissa: 1e-2) and one process differs from it (the
// products were rounded).
TEST(TrainGptRanks, Bf16IsMixedPrecision) {
  std::string f32 = tmp_dir() + "rot-f32.jsonl", rot16 = tmp_dir() + "rot-bf16.jsonl",
              one16 = tmp_dir() + "one-bf16.jsonl", ddp16 = tmp_dir() + "ddp-bf16.jsonl";
  Result r = run(on_ranks(2, kRanksFlags + " --batch 2", {"--metrics", f32}));
  ASSERT_EQ(r.code, 0) << r.err;
  r = run(on_ranks(2, kRanksFlags + " --batch 2 --bf16", {"--metrics", rot16}));
  ASSERT_EQ(r.code, 0) << r.err;
  r = run(on_ranks(2, kRanksFlags + " --batch 2 --bf16 --strategy ddp", {"--metrics", ddp16}));
  ASSERT_EQ(r.code, 0) << r.err;
  r = run(train_gpt(kRanksFlags + " --batch 4 --bf16", {"--metrics", one16}));
  ASSERT_EQ(r.code, 0) << r.err;
  const std::vector<double> &want = one_process_losses();
  std::vector<double> one = metric(one16, "loss"), ddp = metric(ddp16, "loss");
  ASSERT_EQ(one.size(), want.size());
  ASSERT_EQ(ddp.size(), want.size());
  double moved = 0;
  for (const std::string &m : {rot16, ddp16, one16}) {
    std::vector<double> got = metric(m, "loss");
    ASSERT_EQ(got.size(), want.size()) << m;
    for (size_t i = 0; i < want.size(); i++)
      EXPECT_NEAR(got[i], want[i], 1e-2 * want[i]) << m << ", step " << i + 1;
    EXPECT_LT(got.back(), got.front()) << m;
  }
  for (size_t i = 0; i < want.size(); i++) {
    EXPECT_NEAR(ddp[i], one[i], 1e-4 * one[i]) << "step " << i + 1;
    moved = std::max(moved, std::fabs(one[i] - want[i]) / want[i]);
  }
  EXPECT_GT(moved, 1e-6) << "--bf16 on one process computed in f32";
  std::vector<double> comm32 = metric(f32, "comm"), comm16 = metric(rot16, "comm");
  ASSERT_FALSE(comm32.empty());
  ASSERT_FALSE(comm16.empty());
  EXPECT_NEAR(comm16.back(), comm32.back() / 2, 0.05 * comm32.back());
  EXPECT_EQ(metric(rot16, "params"), metric(f32, "params"));  // the owned blocks stay f32
}

// 2 ranks export the model they evaluated: one process reads the consolidated file back
// to the eval loss they reported on the held-out tenth of --data (given to --eval-only as
// a file of its own: the same 16 windows), and 2 ranks of the strategy read it back
// (--init) to that loss too.
void expect_export_reloads(const std::string &strategy) {
  std::string text, data = tmp_dir() + "ranks.txt", tail = tmp_dir() + "ranks-tail.txt";
  while (text.size() < 5130) text += "Blocks rotate around the ring; gradients come home. ";
  text.resize(5130);  // the last tenth: 513 bytes, 16 windows of 32 + 1
  std::ofstream(data, std::ios::binary) << text;
  std::ofstream(tail, std::ios::binary) << text.substr(text.size() - 513);
  std::string metrics = tmp_dir() + "ranks-" + strategy + ".jsonl",
              model = tmp_dir() + "ranks-" + strategy + ".safetensors";
  Result r = run(on_ranks(2,
                          "--config tiny --steps 10 --batch 2 --threads 1 --log-every 10 "
                          "--eval-windows 0 --strategy " +
                              strategy,
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
  Result e2 = run(on_ranks(2, "--eval-only --threads 1 --strategy " + strategy,
                           {"--init", model, "--data", tail}));
  ASSERT_EQ(e2.code, 0) << e2.err;
  std::map<std::string, double> ev2;
  ASSERT_EQ(e2.out.rfind("[0] ", 0), 0u) << e2.out;
  ASSERT_TRUE(parse_flat_json(e2.out.substr(4), &ev2)) << e2.out;
  EXPECT_NEAR(ev2["eval_loss"], reported.back(), 1e-5 * reported.back());
  std::printf(
      "2 %s ranks reported eval %.8f; their export, in one process: %.8f, on 2 %s "
      "ranks: %.8f\n",
      strategy.c_str(), reported.back(), ev["eval_loss"], strategy.c_str(), ev2["eval_loss"]);
}

// The README's multi-host commands as written there, one rtp-run per "host", both on
// 127.0.0.1: host0 and its port replaced, "..." by a token, and flags appended for a short
// run. The two nodes train like one process with their global batch: 2 nodes x 1 rank x
// --batch 2.
TEST(TrainGptMultiHost, ReadmeCommandsTrainLikeOneProcess) {
  std::vector<std::string> readme;
  for (const std::string &l : lines(slurp(RTP_TEST_DIR "/../README.md")))
    if (l.rfind("RTP_TOKEN=... rtp-run --nnodes 2 ", 0) == 0) readme.push_back(l);
  ASSERT_EQ(readme.size(), 2u) << "README.md: expected the two lines of the multi-host "
                                  "example, 'RTP_TOKEN=... rtp-run --nnodes 2 ...'";
  int port = rtptest::free_port();
  std::string m = tmp_dir() + "multihost.jsonl", out[2], script;
  for (int node = 1; node >= 0; node--) {  // node 1 first: it waits for rank 0's host
    EXPECT_NE(readme[node].find("--node-rank " + std::to_string(node)), std::string::npos)
        << readme[node];
    std::string cmd;
    int replaced = 0;
    std::stringstream ss(readme[node]);
    for (std::string w; ss >> w; cmd += w + " ") {
      std::string was = w;
      if (w == "RTP_TOKEN=...") w = "RTP_TOKEN=multi-host-test-token-of-the-readme";
      if (w == "rtp-run") w = quote(RTP_RUN);
      if (w == "train-gpt") w = quote(TRAIN_GPT);
      if (w.rfind("host0:", 0) == 0) w = "127.0.0.1:" + std::to_string(port);
      replaced += w != was;
    }
    ASSERT_EQ(replaced, 4) << "token, rtp-run, train-gpt and host0:PORT in " << readme[node];
    cmd += kRanksFlags + " --batch 2 --metrics " + quote(m);
    out[node] = tmp_dir() + "node" + std::to_string(node);
    script += "timeout 120 sh -c " + quote(cmd) + " >" + quote(out[node]) + " 2>&1" +
              (node ? " & node1=$!; " : "; rc0=$?; wait $node1; rc1=$?; ");
  }
  script += "echo $rc0 $rc1 >" + quote(tmp_dir() + "nodes-rc");
  ASSERT_EQ(std::system(script.c_str()), 0) << script;
  std::string node0 = slurp(out[0]), node1 = slurp(out[1]);
  EXPECT_EQ(slurp(tmp_dir() + "nodes-rc"), "0 0\n") << node0 << node1;
  EXPECT_NE(node0.find("batch 2 x 2 ranks (rtp)"), std::string::npos) << node0;
  EXPECT_NE(node0.find("[0] step 10/10"), std::string::npos) << node0;
  // every node shows progress: the first rank of node 1 too, with its rank
  EXPECT_NE(node1.find("[1] model: "), std::string::npos) << node1;
  EXPECT_NE(node1.find("[1] step 1/10"), std::string::npos) << node1;
  expect_one_process_losses(m, "2 hosts of 1 rank (rtp)");
}

// The README's checkpoint commands as written there, in a fresh directory, with a metrics
// file and flags for a quicker evaluation appended: each later line resumes where the
// one before stopped and trains on from there.
TEST(TrainGptCkpt, ReadmeCommands) {
  std::vector<std::string> readme;
  for (const std::string &l : lines(slurp(RTP_TEST_DIR "/../README.md")))
    if (l.find("build/examples/train-gpt --config tiny --steps ") != std::string::npos &&
        l.find("--ckpt-dir ckpt") != std::string::npos)
      readme.push_back(l);
  ASSERT_EQ(readme.size(), 3u) << "README.md: expected the three checkpoint lines";
  std::string dir = tmp_dir() + "readme-ckpt";
  ASSERT_EQ(std::system(("rm -rf " + quote(dir)).c_str()), 0);
  const int64_t first[] = {1, 101, 201};
  for (size_t i = 0; i < readme.size(); i++) {
    std::string cmd, m = tmp_dir() + "readme-ckpt" + std::to_string(i) + ".jsonl";
    std::stringstream ss(readme[i]);
    for (std::string w; ss >> w; cmd += w + " ") {
      if (w == "build/tools/rtp-run") w = quote(RTP_RUN);
      if (w == "build/examples/train-gpt") w = quote(TRAIN_GPT);
      if (w == "ckpt") w = quote(dir);
    }
    cmd += "--threads 1 --eval-windows 8 --eval-problems 0 --metrics " + quote(m);
    Result r = run({"sh", "-c", cmd});
    ASSERT_EQ(r.code, 0) << cmd << "\n" << r.out << r.err;
    EXPECT_EQ(r.out.find("resumed from") != std::string::npos, i > 0) << cmd << "\n" << r.out;
    std::vector<double> steps = metric(m, "step");
    ASSERT_EQ(steps.size(), 100u) << cmd;
    EXPECT_EQ(steps.front(), first[i]) << cmd;
  }
}

TEST(TrainGptRanks, RtpExportReloadsToTheReportedEvalLoss) {
  expect_export_reloads("rtp");
}

TEST(TrainGptRanks, TpExportReloadsToTheReportedEvalLoss) {
  expect_export_reloads("tp");
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
  for (const char *strategy : {"rtp", "ddp", "tp"}) {
    std::string s = strategy, flags = kCkptFlags + (s == "tp" ? " --batch 4" : " --batch 2") +
                                      " --strategy " + s;
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

// Checkpoints hold whole tensors' rows whatever the strategy, and loading reshards them
// from the saved layout to the plan's (rtp_reshard_plan): 2 tp ranks' resume in one process
// and on 2 rtp ranks, 2 rtp ranks' under tp, and 4 rtp ranks' on fewer ranks, as after
// losing one (3 rtp, 3 fsdp, 2 tp), all with the same global batch (12) and the losses of
// the saving layout's run never stopped (to float rounding: the ranks sum in another
// order).
TEST(TrainGptCkpt, CheckpointsResumeUnderAnotherStrategyAndOnFewerRanks) {
  const std::string tp = " --batch 12 --strategy tp", rtp2 = " --batch 6 --strategy rtp",
                    rtp4 = " --batch 3 --strategy rtp", on3 = " --batch 4 --strategy ";
  const struct {
    std::string name;
    int ranks;
    std::string flags;
  } saves[] = {{"-tp", 2, tp}, {"-rtp", 2, rtp2}, {"-rtp4", 4, rtp4}};
  // Each saving layout's run to step 20 (the reference) and to its checkpoint at step 10.
  for (const auto &sv : saves) {
    std::string ref = tmp_dir() + "ckx-ref" + sv.name + ".jsonl";
    Result r =
        run(on_ranks(sv.ranks, kCkptFlags + sv.flags + " --steps 20", {"--metrics", ref}));
    ASSERT_EQ(r.code, 0) << sv.name << ": " << r.err;
    r = run(on_ranks(sv.ranks, kCkptFlags + sv.flags + " --steps 10",
                     {"--ckpt-dir", tmp_dir() + "ckx" + sv.name}));
    ASSERT_EQ(r.code, 0) << sv.name << ": " << r.err;
  }
  struct Case {
    std::string saved, what;
    int ranks;
    std::string flags;
  };
  const Case cases[] = {{"-tp", "tp's, in one process", 1, " --batch 12"},
                        {"-tp", "tp's, on 2 rtp ranks", 2, rtp2},
                        {"-rtp", "rtp's, on 2 tp ranks", 2, tp},
                        {"-rtp4", "4 rtp ranks', on 3 rtp ranks", 3, on3 + "rtp"},
                        {"-rtp4", "4 rtp ranks', on 3 fsdp ranks", 3, on3 + "fsdp"},
                        {"-rtp4", "4 rtp ranks', on 2 tp ranks", 2, tp}};
  for (const Case &c : cases) {
    std::vector<double> want = losses_after(tmp_dir() + "ckx-ref" + c.saved + ".jsonl", 10);
    ASSERT_EQ(want.size(), 10u);
    std::string dir = tmp_dir() + "ckx-resume", m = tmp_dir() + "ckx-resumed.jsonl";
    ASSERT_EQ(std::system(("rm -rf " + quote(dir) + " && cp -r " +
                           quote(tmp_dir() + "ckx" + c.saved) + " " + quote(dir))
                              .c_str()),
              0);
    std::string flags = kCkptFlags + c.flags + " --steps 20 --resume";
    std::vector<std::string> extra = {"--ckpt-dir", dir, "--metrics", m};
    Result r = run(c.ranks == 1 ? train_gpt(flags, extra) : on_ranks(c.ranks, flags, extra));
    ASSERT_EQ(r.code, 0) << c.what << ": " << r.err;
    EXPECT_NE(r.out.find("resumed from"), std::string::npos) << c.what << ": " << r.out;
    if (c.saved == "-rtp4") {
      EXPECT_NE(r.out.find("saved on 4 ranks with rtp"), std::string::npos) << c.what;
    }
    std::vector<double> got = metric(m, "loss");
    ASSERT_EQ(got.size(), want.size()) << c.what;
    double worst = 0;
    for (size_t i = 0; i < want.size(); i++) {
      EXPECT_NEAR(got[i], want[i], 1e-5 * want[i]) << c.what << ", step " << i + 11;
      worst = std::max(worst, std::fabs(got[i] - want[i]) / want[i]);
    }
    std::printf("%s: %zu losses, largest relative difference %.2g\n", c.what.c_str(),
                got.size(), worst);
  }
}

// A checkpoint resumed on another layout (`ranks` ranks with `flags`), from a copy of it
// under <tag>-resume: it says `says` and trains steps 11 to 20 with the losses `want` of
// the run that never stopped, to float rounding (bit for bit where `exact`).
struct ResumeCase {
  std::string from, what;
  int ranks;
  std::string flags;
  bool exact;
  std::string says;
};

void resume_matches(const ResumeCase &c, const std::string &tag,
                    const std::vector<double> &want) {
  std::string dir = tmp_dir() + tag + "-resume", m = tmp_dir() + tag + "-resumed.jsonl";
  ASSERT_EQ(
      std::system(
          ("rm -rf " + quote(dir) + " && cp -r " + quote(c.from) + " " + quote(dir)).c_str()),
      0);
  std::string flags = kCkptFlags + c.flags + " --steps 20 --resume";
  std::vector<std::string> extra = {"--ckpt-dir", dir, "--metrics", m};
  Result r = run(c.ranks == 1 ? train_gpt(flags, extra) : on_ranks(c.ranks, flags, extra));
  ASSERT_EQ(r.code, 0) << c.what << ": " << r.out << r.err;
  EXPECT_NE(r.out.find(c.says), std::string::npos) << c.what << ": " << r.out;
  std::vector<double> got = metric(m, "loss");
  ASSERT_EQ(got.size(), want.size()) << c.what;
  if (c.exact) {
    EXPECT_EQ(got, want) << c.what;
  }
  double worst = 0;
  for (size_t i = 0; i < want.size(); i++) {
    EXPECT_NEAR(got[i], want[i], 1e-5 * want[i]) << c.what << ", step " << i + 11;
    worst = std::max(worst, std::fabs(got[i] - want[i]) / want[i]);
  }
  std::printf("%s: %zu losses, largest relative difference %.2g\n", c.what.c_str(), got.size(),
              worst);
}

// A pipeline's checkpoints: resumed on the same pipeline, the losses of a run never
// stopped, bit for bit; resumed in one process or on 2 flat rtp ranks, and a flat job's
// resumed on a pipeline, the same to float rounding.
TEST(TrainGptCkpt, PipelineCheckpointsResumeOnAnyLayout) {
  const std::string pp = " --batch 2 --pp 2 --micro-batches 2";
  std::string ref = tmp_dir() + "ckp-ref.jsonl", saved = tmp_dir() + "ckp",
              flat = tmp_dir() + "ckp-flat";
  ASSERT_EQ(run(on_ranks(4, kCkptFlags + pp + " --steps 20", {"--metrics", ref})).code, 0);
  ASSERT_EQ(std::system(("rm -rf " + quote(saved) + " " + quote(flat)).c_str()), 0);
  Result a = run(on_ranks(4, kCkptFlags + pp + " --steps 10", {"--ckpt-dir", saved}));
  ASSERT_EQ(a.code, 0) << a.err;
  Result b = run(on_ranks(2, kCkptFlags + " --batch 2 --steps 10", {"--ckpt-dir", flat}));
  ASSERT_EQ(b.code, 0) << b.err;
  const std::string by_pp = "saved on 4 ranks as 2 pipeline stages, rtp inside",
                    by_flat = "saved on 2 ranks with rtp";
  const ResumeCase cases[] = {
      {saved, "the same pipeline", 4, pp, true, by_pp},
      {saved, "one process", 1, " --batch 4", false, by_pp},
      {saved, "2 rtp ranks", 2, " --batch 2", false, by_pp},
      {flat, "a pipeline, from 2 rtp ranks", 4, pp + " --strategy fsdp --schedule gpipe", false,
       by_flat},
  };
  std::vector<double> want = losses_after(ref, 10);
  ASSERT_EQ(want.size(), 10u);
  for (const ResumeCase &c : cases) resume_matches(c, "ckp", want);
}

// Checkpoints of stages of different sizes and strategies (--stages 2:tp,2:ddp, index
// version 3): resumed on the same stages, the losses of a run never stopped, bit for bit;
// resumed in one process, on 2 flat rtp ranks and on other such stages, and a flat job's
// and a rectangular pipeline's resumed on such stages, the same to float rounding. The global
// batch is 4 throughout.
TEST(TrainGptCkpt, StagesCheckpointsResumeOnAnyLayout) {
  const std::string het = " --batch 4 --stages 2:tp,2:ddp --micro-batches 4",
                    pp = " --batch 2 --pp 2 --micro-batches 2";
  std::string ref = tmp_dir() + "ckh-ref.jsonl", saved = tmp_dir() + "ckh",
              flat = tmp_dir() + "ckh-flat", rect = tmp_dir() + "ckh-pp",
              one = tmp_dir() + "ckh-one";  // a stage of one rank saves whole tensors
  ASSERT_EQ(std::system(("rm -rf " + quote(saved) + " " + quote(flat) + " " + quote(rect) +
                         " " + quote(one))
                            .c_str()),
            0);
  ASSERT_EQ(run(on_ranks(4, kCkptFlags + het + " --steps 20", {"--metrics", ref})).code, 0);
  Result a = run(on_ranks(4, kCkptFlags + het + " --steps 10", {"--ckpt-dir", saved}));
  ASSERT_EQ(a.code, 0) << a.out << a.err;
  std::string index = slurp(saved + "/step-00000010/index.json");
  EXPECT_NE(index.find("\"stage_ranks\": [2, 2]"), std::string::npos) << index;
  EXPECT_NE(index.find("\"stage_strategies\": [\"tp\", \"ddp\"]"), std::string::npos) << index;
  Result b = run(on_ranks(2, kCkptFlags + " --batch 2 --steps 10", {"--ckpt-dir", flat}));
  ASSERT_EQ(b.code, 0) << b.err;
  Result c4 = run(on_ranks(4, kCkptFlags + pp + " --steps 10", {"--ckpt-dir", rect}));
  ASSERT_EQ(c4.code, 0) << c4.err;
  Result d = run(
      on_ranks(3, kCkptFlags + " --batch 4 --stages 1:none,2:fsdp --micro-batches 2 --steps 10",
               {"--ckpt-dir", one}));
  ASSERT_EQ(d.code, 0) << d.err;
  const std::string by = "resumed from";
  const ResumeCase cases[] = {
      {saved, "the same stages", 4, het, true, by},
      {saved, "one process", 1, " --batch 4", false, by},
      {saved, "2 rtp ranks", 2, " --batch 2 --strategy rtp", false, by},
      {flat, "stages, from 2 rtp ranks", 4, het, false, by},
      {rect, "stages, from a 2 x 2 pipeline", 4, het, false, by},
      {saved, "other stages, 2:ddp,2:tp", 4, " --batch 4 --stages 2:ddp,2:tp --micro-batches 4",
       false, by},
      {saved, "other stages, 1:none,2:fsdp", 3,
       " --batch 4 --stages 1:none,2:fsdp --micro-batches 2", false, by},
      {one, "one process, from 1:none,2:fsdp", 1, " --batch 4", false, by},
  };
  std::vector<double> want = losses_after(ref, 10);
  ASSERT_EQ(want.size(), 10u);
  for (const ResumeCase &c : cases) resume_matches(c, "ckh", want);
}

// A checkpoint read as a model by the README's lines as written there, which give neither
// --config (the sizes come from the checkpoint) nor --steps: the export and --eval-only
// give the trained model's loss, and PyTorch, with the README's snippet, loads the export
// and picks the byte that --sample picked.
TEST(TrainGptCkpt, ReadmeReadsTheCheckpointAsAModel) {
  std::vector<std::string> readme;
  for (const std::string &l : lines(slurp(RTP_TEST_DIR "/../README.md")))
    if (l.rfind("build/examples/train-gpt --ckpt-dir ckpt ", 0) == 0) readme.push_back(l);
  ASSERT_EQ(readme.size(), 3u) << "README.md: expected the export, eval-only and sample lines";
  std::string dir = tmp_dir() + "ck-model", trained = tmp_dir() + "ck-trained.safetensors",
              model = tmp_dir() + "ck-model.safetensors";
  ASSERT_EQ(std::system(("rm -rf " + quote(dir)).c_str()), 0);
  Result t = run(train_gpt(kCkptFlags + " --steps 30 --ckpt-every 20",
                           {"--ckpt-dir", dir, "--export", trained}));
  ASSERT_EQ(t.code, 0) << t.err;
  std::vector<Result> r;
  for (const std::string &l : readme) {
    std::string cmd;
    std::stringstream ss(l);
    for (std::string w; ss >> w; cmd += w + " ") {
      if (w == "build/examples/train-gpt") w = quote(TRAIN_GPT);
      if (w == "ckpt") w = quote(dir);
      if (w == "model.safetensors") w = quote(model);
    }
    r.push_back(run({"sh", "-c", cmd + "--threads 1"}));
    ASSERT_EQ(r.back().code, 0) << cmd << "\n" << r.back().out << r.back().err;
  }
  EXPECT_EQ(r[0].out, "") << "--export prints nothing";
  rtp_safetensors *st = nullptr;
  ASSERT_EQ(rtp_safetensors_open(model.c_str(), &st), RTP_OK) << rtp_last_error();
  EXPECT_STREQ(rtp_safetensors_meta(st, "step"), "30");
  EXPECT_STREQ(rtp_safetensors_meta(st, "d_model"), "64");
  rtp_safetensors_close(st);
  for (const std::string &m : {trained, model}) {
    Result e = run({TRAIN_GPT, "--init", m, "--eval-only", "--threads", "1"});
    ASSERT_EQ(e.code, 0) << e.err;
    EXPECT_EQ(e.out, r[1].out) << "--eval-only of the checkpoint and of " << m;
  }
  const std::string head = "--- sample (8 bytes, greedy) ---\n12+34=";
  size_t at = r[2].out.find(head);
  ASSERT_NE(at, std::string::npos) << r[2].out;
  std::string picked = r[2].out.substr(at + head.size(), 1);

  if (run({"/usr/bin/python3", "-c", "import torch"}).code != 0)
    GTEST_SKIP() << "/usr/bin/python3 has no torch (apt install python3-torch)";
  std::string snippet;
  bool in = false;
  for (const std::string &l : lines(slurp(RTP_TEST_DIR "/../README.md"))) {
    if (in && l == "```") break;
    if (in) snippet += l + "\n";
    in = in || l == "```python";
  }
  ASSERT_EQ(lines(snippet).size(), 5u) << "README.md: expected the five lines of PyTorch";
  size_t name = snippet.find("\"model.safetensors\"");
  ASSERT_NE(name, std::string::npos) << snippet;
  snippet.replace(name, 19, "\"" + model + "\"");
  Result py = run({"sh", "-c",
                   "cd " + quote(RTP_TEST_DIR "/..") +
                       " && PYTHONDONTWRITEBYTECODE=1 /usr/bin/python3 -c " + quote(snippet)});
  ASSERT_EQ(py.code, 0) << snippet << py.err;
  EXPECT_EQ(py.out, picked + "\n") << "PyTorch's greedy byte after 12+34= and train-gpt's";
}

// --eval-only and --sample with nothing but random weights are refused, and so are flags
// that train with a checkpoint read; a training run still never replaces checkpoints.
TEST(TrainGptCkpt, ReadingWithoutWeightsIsRefused) {
  std::string dir = tmp_dir() + "ck-weights", empty = tmp_dir() + "ck-empty";
  ASSERT_EQ(std::system(("rm -rf " + quote(dir) + " && mkdir -p " + quote(empty)).c_str()), 0);
  ASSERT_EQ(run(train_gpt(kCkptFlags + " --steps 1", {"--ckpt-dir", dir})).code, 0);
  const BadCase cases[] = {
      {{"--eval-only"}, 2, "--eval-only has no weights but random ones: give --init FILE"},
      {{"--config", "tiny", "--steps", "0", "--sample", "4"},
       2,
       "--sample with --steps 0 has no weights but random ones"},
      {{"--eval-only", "--ckpt-dir", empty}, 2, "--ckpt-dir " + empty + " has no checkpoint"},
      {{"--eval-only", "--ckpt-dir", dir, "--resume"}, 2, "without --resume"},
      {{"--ckpt-dir", dir, "--export", empty + "/m", "--steps", "5"}, 2, "trains nothing"},
      {{"--ckpt-dir", dir, "--sample", "4", "--metrics", empty + "/m"}, 2, "trains nothing"},
      {{"--ckpt-dir", dir, "--eval-only", "--init", empty + "/m"}, 2, "both give the weights"},
      {{"--ckpt-dir", dir, "--steps", "5"}, 2, "already has checkpoints"},
  };
  for (const BadCase &c : cases) {
    std::vector<std::string> argv = {TRAIN_GPT};
    argv.insert(argv.end(), c.args.begin(), c.args.end());
    Result r = run(argv);
    EXPECT_EQ(r.code, c.code) << testing::PrintToString(c.args) << ": " << r.err;
    EXPECT_NE(r.err.find(c.message), std::string::npos)
        << "expected '" << c.message << "' in: " << r.err;
  }
  EXPECT_EQ(ckpt_step(dir), 1);
}

// A resumed run's metrics file continues the curve: a run that logged steps 1..10 and
// stopped before its checkpoint of step 10 was complete, resumed from step 5, leaves steps
// 1..15 once each with the losses of a run never stopped. A line without a step is kept;
// a run without --resume starts the file anew.
TEST(TrainGptCkpt, ResumedMetricsContinueTheCurve) {
  std::string ref = tmp_dir() + "ckm-ref.jsonl", dir = tmp_dir() + "ckm",
              m = tmp_dir() + "ckm.jsonl";
  ASSERT_EQ(std::system(("rm -rf " + quote(dir)).c_str()), 0);
  ASSERT_EQ(run(train_gpt(kCkptFlags + " --steps 15", {"--metrics", ref})).code, 0);
  Result a = run(train_gpt(kCkptFlags + " --steps 10 --ckpt-every 5",
                           {"--ckpt-dir", dir, "--metrics", m}));
  ASSERT_EQ(a.code, 0) << a.err;
  std::vector<std::string> logged = lines(slurp(m));
  ASSERT_EQ(logged.size(), 10u);
  std::string crashed;  // a line that is not train-gpt's, and step 11's cut short
  for (size_t i = 0; i < logged.size(); i++)
    crashed += (i == 3 ? "# a note\n" : "") + logged[i] + "\n";
  std::ofstream(m, std::ios::binary) << crashed << "{\"step\": 11, \"lo";
  std::ofstream(dir + "/latest", std::ios::binary) << "step-00000005\n";
  ASSERT_EQ(std::system(("rm -rf " + quote(dir + "/step-00000010")).c_str()), 0);
  Result b =
      run(train_gpt(kCkptFlags + " --steps 15 --resume", {"--ckpt-dir", dir, "--metrics", m}));
  ASSERT_EQ(b.code, 0) << b.err;
  EXPECT_NE(b.err.find("line 4 has no step: kept"), std::string::npos) << b.err;
  std::vector<std::string> got = lines(slurp(m));
  ASSERT_EQ(got.size(), 16u) << slurp(m);
  EXPECT_EQ(got[3], "# a note");
  for (size_t i = 0; i < 5; i++) EXPECT_EQ(got[i < 3 ? i : i + 1], logged[i]);
  std::vector<double> steps = metric(m, "step");
  ASSERT_EQ(steps.size(), 15u);
  for (size_t i = 0; i < steps.size(); i++) EXPECT_EQ(steps[i], i + 1);
  EXPECT_EQ(metric(m, "loss"), metric(ref, "loss"));
  EXPECT_FALSE(std::ifstream(m + ".tmp").good()) << "the temporary file is renamed";
  ASSERT_EQ(run(train_gpt(kCkptFlags + " --steps 2", {"--metrics", m})).code, 0);
  EXPECT_EQ(metric(m, "step"), (std::vector<double>{1, 2}));
  EXPECT_EQ(lines(slurp(m)).size(), 2u);
}

// The learning-rate schedule survives --resume: 10 steps of a cosine schedule of 20 with
// warm-up, then --resume --steps 20, train the last 10 steps with the losses and rates of
// one run of 20 (rates as lr-schedule.h computes them); the schedule's flags come from the
// checkpoint, and one that differs from it is refused. Weight decay and clipping change
// the losses.
TEST(TrainGptCkpt, LrScheduleSurvivesResume) {
  const std::string flags = kCkptFlags +
                            " --lr-schedule cosine --warmup 5 --max-steps 20"
                            " --weight-decay 0.1 --grad-clip 1";
  std::string ref = tmp_dir() + "cks-ref.jsonl", dir = tmp_dir() + "cks",
              m = tmp_dir() + "cks.jsonl", plain = tmp_dir() + "cks-plain.jsonl";
  ASSERT_EQ(std::system(("rm -rf " + quote(dir)).c_str()), 0);
  Result r = run(train_gpt(flags + " --steps 20", {"--metrics", ref}));
  ASSERT_EQ(r.code, 0) << r.err;
  std::vector<double> lr = metric(ref, "lr");
  ASSERT_EQ(lr.size(), 20u) << slurp(ref);
  lr_schedule want = {LR_COSINE, 5, 20, 3e-3f, 3e-3f / 10};
  for (int i = 0; i < 20; i++) EXPECT_EQ((float)lr[i], lr_at(&want, i)) << "step " << i + 1;
  EXPECT_LT(lr[0], lr[4]);
  EXPECT_GT(lr[5], lr[19]);
  Result a = run(train_gpt(flags + " --steps 10", {"--ckpt-dir", dir}));
  ASSERT_EQ(a.code, 0) << a.err;
  Result bad =
      run(train_gpt(kCkptFlags + " --steps 20 --resume --max-steps 30", {"--ckpt-dir", dir}));
  EXPECT_EQ(bad.code, 1);
  EXPECT_NE(bad.err.find("was saved with --max-steps 20, this run has 30"), std::string::npos)
      << bad.err;
  // Only the optimizer's flags again: the schedule's are the checkpoint's.
  Result b = run(train_gpt(kCkptFlags + " --weight-decay 0.1 --grad-clip 1 --steps 20 --resume",
                           {"--ckpt-dir", dir, "--metrics", m}));
  ASSERT_EQ(b.code, 0) << b.err;
  EXPECT_EQ(metric(m, "loss"), losses_after(ref, 10));
  EXPECT_EQ(metric(m, "lr"), std::vector<double>(lr.begin() + 10, lr.end()));
  ASSERT_EQ(run(train_gpt(kCkptFlags + " --lr-schedule cosine --warmup 5 --max-steps 20 "
                                       "--steps 20",
                          {"--metrics", plain}))
                .code,
            0);
  std::vector<double> without = metric(plain, "loss"), with = metric(ref, "loss");
  ASSERT_EQ(without.size(), 20u);
  EXPECT_EQ(without[0], with[0]);  // the first step's loss is before any update
  EXPECT_NE(without[19], with[19]) << "weight decay and clipping changed nothing";
}

TEST(TrainGptCkpt, BadCheckpointsAreRefusedAndKept) {
  std::string dir = tmp_dir() + "ck-bad", step = dir + "/step-00000010";
  ASSERT_EQ(run(train_gpt(kCkptFlags + " --steps 10", {"--ckpt-dir", dir})).code, 0);
  std::string good = slurp(step + "/rank-0.safetensors"), index = slurp(step + "/index.json"),
              marker = slurp(step + "/COMPLETE");
  // The same run again: its file differs from step's only in the save's id.
  std::string other = dir + "-again";
  ASSERT_EQ(run(train_gpt(kCkptFlags + " --steps 10", {"--ckpt-dir", other})).code, 0);
  const std::string seal =
      " index.json && printf 'sha256 %s\\n' $(sha256sum index.json | cut -c1-64) > COMPLETE";
  struct Case {
    std::string damage, flags, message;
    int code;
  };
  const Case cases[] = {
      {"", " --steps 20", "already has checkpoints: --resume", 2},
      {"", " --steps 20 --resume --batch 4", "global_batch 8, this run has 4", 1},
      {"", " --steps 20 --resume --d-model 32 --n-head 2",
       "index.json: tensor 'transformer.wte.weight' is [256, 64], the model's is [256, 32]", 1},
      {"", " --steps 20 --resume --n-layer 1",
       "index.json: tensor 'transformer.h.1.ln_1.weight' is not in the model", 1},
      {"cp " + quote(other + "/step-00000010/rank-0.safetensors") + " .",
       " --steps 20 --resume", "rank-0.safetensors: metadata save_id is '", 1},
      {"sed -i 's/\"data_pos\": \"10\"/\"data_pos\": \"1x\"/'" + seal, " --steps 20 --resume",
       "data_pos is '1x', expected 10 (its step)", 1},
      {"sed -i 's/\"adam_steps\": 10/\"adam_steps\": 7/'" + seal, " --steps 20 --resume",
       "adam_steps is 7, expected 10 (one a step)", 1},
      {"printf X | dd of=rank-0.safetensors bs=1 conv=notrunc seek=900000 2>/dev/null",
       " --steps 20 --resume", "checksum mismatch (corrupted)", 1},
      {"truncate -s 1000 rank-0.safetensors", " --steps 20 --resume", "rank-0.safetensors", 1},
      {"mv COMPLETE COMPLETE.x", " --steps 20 --resume", "no COMPLETE marker", 1},
  };
  for (const Case &c : cases) {
    std::ofstream(step + "/rank-0.safetensors", std::ios::binary) << good;
    std::ofstream(step + "/index.json", std::ios::binary) << index;
    std::remove((step + "/COMPLETE.x").c_str());
    std::ofstream(step + "/COMPLETE", std::ios::binary) << marker;
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

// The names in a directory, sorted ("." and ".." left out).
std::vector<std::string> list_dir(const std::string &path) {
  std::vector<std::string> names;
  if (DIR *d = opendir(path.c_str())) {
    for (dirent *e; (e = readdir(d));)
      if (std::strcmp(e->d_name, ".") && std::strcmp(e->d_name, ".."))
        names.push_back(e->d_name);
    closedir(d);
  }
  std::sort(names.begin(), names.end());
  return names;
}

// A checkpoint's file with its save's id, which every save draws anew, blanked out, and in
// the index the checksums of the files that hold it (they are compared without it).
std::string without_save_id(const std::string &step, const std::string &file) {
  const std::string index = slurp(step + "/index.json"), key = "\"save_id\": \"",
                    sha = "\"sha256\": \"";
  std::string text = slurp(step + "/" + file);
  size_t at = index.find(key);
  if (at == std::string::npos) return text;
  const std::string id = index.substr(at + key.size(), 32);
  for (size_t p; (p = text.find(id)) != std::string::npos;) text.replace(p, 32, "<save id>");
  for (size_t p = 0; file == "index.json" && (p = text.find(sha, p)) != std::string::npos;)
    text.replace(p += sha.size(), 64, "<sha256>");
  return text;
}

// Whether two steps' file is the same but for the save's id; COMPLETE, the checksum of an
// index that holds the id, only in its length (a load checks it against the index).
bool same_but_save_id(const std::string &a, const std::string &b, const std::string &file) {
  if (file == "COMPLETE") return slurp(a + "/" + file).size() == slurp(b + "/" + file).size();
  return without_save_id(a, file) == without_save_id(b, file);
}

// A full disk during a save loses nothing already saved: the run stops with status 1 and a
// message naming the cause (training on without checkpoints would put ever more steps at
// risk), latest still names the last good checkpoint, byte for byte the one a run with
// room wrote, the failed save leaves no file behind (its space is free again), and
// --resume, once there is room, continues with the losses of a run never stopped.
void expect_failed_save_loses_nothing(const Result &failed, const std::string &dir,
                                      const std::string &ref_dir, const char *cause) {
  EXPECT_EQ(failed.code, 1) << "stopped with status 1, not killed: " << failed.err;
  EXPECT_NE(
      failed.err.find("checkpoint of step 10 in " + dir + " (the previous one is intact)"),
      std::string::npos)
      << failed.err;
  EXPECT_NE(failed.err.find(cause), std::string::npos) << failed.err;
  EXPECT_NE(failed.err.find("latest still names step-00000005: fix the cause (e.g. free disk "
                            "space), then rerun with --resume"),
            std::string::npos)
      << failed.err;
  EXPECT_EQ(ckpt_step(dir), 5);
  EXPECT_EQ(list_dir(dir), std::vector<std::string>({"latest", "step-00000005"}));
  std::vector<std::string> files = list_dir(ref_dir + "/step-00000005");
  EXPECT_EQ(list_dir(dir + "/step-00000005"), files);
  for (const std::string &f : files)
    EXPECT_TRUE(same_but_save_id(dir + "/step-00000005", ref_dir + "/step-00000005", f))
        << f << " differs from the one a run with room wrote";
}

// A tmpfs of a given size mounted at a new directory (root only), unmounted and removed
// however the test ends.
class Tmpfs {
 public:
  Tmpfs(const std::string &dir, size_t bytes) : dir_(dir) {
    if (mkdir(dir.c_str(), 0755) != 0) {
      error_ = "mkdir " + dir + ": " + std::strerror(errno);
      return;
    }
    if (mount("tmpfs", dir.c_str(), "tmpfs", 0, ("size=" + std::to_string(bytes)).c_str()))
      error_ = "mount -t tmpfs " + dir + ": " + std::strerror(errno);
    mounted_ = error_.empty();
  }
  ~Tmpfs() {
    if (mounted_ && umount2(dir_.c_str(), 0) != 0 && umount2(dir_.c_str(), MNT_DETACH) != 0)
      std::fprintf(stderr, "could not unmount %s: %s\n", dir_.c_str(), std::strerror(errno));
    rmdir(dir_.c_str());
  }
  Tmpfs(const Tmpfs &) = delete;
  Tmpfs &operator=(const Tmpfs &) = delete;
  const std::string &error() const {
    return error_;
  }
  bool resize(size_t bytes) {
    std::string opts = "size=" + std::to_string(bytes);
    return mount("tmpfs", dir_.c_str(), "tmpfs", MS_REMOUNT, opts.c_str()) == 0;
  }

 private:
  std::string dir_, error_;
  bool mounted_ = false;
};

// Root (CI): a real full disk. A tmpfs with room for one checkpoint and a half: step 5's
// is saved, step 10's runs out of space in the middle of its file.
TEST(TrainGptCkpt, FullDiskLosesNothing) {
  if (geteuid() != 0)
    GTEST_SKIP() << "needs root to mount a small tmpfs as the full disk (FileSizeLimit"
                    "LosesNothing fails the save without root)";
  std::string ref = tmp_dir() + "full-ref.jsonl", ref_dir = tmp_dir() + "full-ref";
  Result r = run(train_gpt(kCkptFlags + " --steps 20", {"--metrics", ref}));
  ASSERT_EQ(r.code, 0) << r.err;
  r = run(train_gpt(kCkptFlags + " --steps 5", {"--ckpt-dir", ref_dir}));
  ASSERT_EQ(r.code, 0) << r.err;
  size_t one = 0;
  for (const std::string &f : list_dir(ref_dir + "/step-00000005"))
    one += slurp(ref_dir + "/step-00000005/" + f).size();
  ASSERT_GT(one, 1000000u);  // the tiny model with its Adam states
  Tmpfs disk(tmp_dir() + "full-disk", (one * 3 / 2 + 65535) / 4096 * 4096);
  if (!disk.error().empty()) GTEST_SKIP() << "cannot mount a tmpfs as root: " << disk.error();
  std::string dir = tmp_dir() + "full-disk/ck", got = tmp_dir() + "full.jsonl",
              resumed = tmp_dir() + "full-resumed.jsonl";
  Result full = run(train_gpt(kCkptFlags + " --steps 20 --ckpt-every 5",
                              {"--ckpt-dir", dir, "--metrics", got}));
  expect_failed_save_loses_nothing(full, dir, ref_dir, "No space left on device");
  std::vector<double> want = metric(ref, "loss");
  ASSERT_EQ(want.size(), 20u);
  EXPECT_EQ(metric(got, "loss"), std::vector<double>(want.begin(), want.begin() + 10));
  ASSERT_TRUE(disk.resize(8 * one)) << std::strerror(errno);  // space freed
  Result again = run(train_gpt(kCkptFlags + " --steps 20 --ckpt-every 5 --resume",
                               {"--ckpt-dir", dir, "--metrics", resumed}));
  ASSERT_EQ(again.code, 0) << again.err;
  EXPECT_NE(again.out.find("resumed from " + dir + "/step-00000005"), std::string::npos)
      << again.out;
  EXPECT_EQ(metric(resumed, "loss"), losses_after(ref, 5));
  EXPECT_EQ(ckpt_step(dir), 20);
}

// Any user: 2 ranks whose files may not grow past 128 KiB (RLIMIT_FSIZE, with SIGXFSZ's
// default action, as after ulimit -f): step 10's files fail with EFBIG on both ranks,
// which stop together; nothing of step 5 is lost.
TEST(TrainGptCkpt, FileSizeLimitLosesNothing) {
  std::string flags = kCkptFlags + " --batch 2 --strategy rtp --steps 20 --ckpt-every 5";
  std::string ref = tmp_dir() + "fsize-ref.jsonl", ref_dir = tmp_dir() + "fsize-ref",
              dir = tmp_dir() + "fsize", resumed = tmp_dir() + "fsize-resumed.jsonl";
  Result r =
      run(on_ranks(2, kCkptFlags + " --batch 2 --strategy rtp --steps 20", {"--metrics", ref}));
  ASSERT_EQ(r.code, 0) << r.err;
  for (const std::string &d : {ref_dir, dir}) {  // step 5: one to compare, one to go on from
    r = run(on_ranks(2, kCkptFlags + " --batch 2 --strategy rtp --steps 5", {"--ckpt-dir", d}));
    ASSERT_EQ(r.code, 0) << r.err;
    ASSERT_EQ(ckpt_step(d), 5);
  }
  // rtp-run exits with the status of the first rank to stop
  Result failed =
      run_fsize_limited(on_ranks(2, flags + " --resume", {"--ckpt-dir", dir}), 128 << 10);
  for (const char *rank : {"0", "1"}) {  // each rank says why its own file failed
    std::string line = std::string("[") + rank + "] train-gpt: checkpoint of step 10";
    size_t at = failed.err.find(line);
    ASSERT_NE(at, std::string::npos) << failed.err;
    std::string why = failed.err.substr(at, failed.err.find('\n', at) - at);
    EXPECT_NE(why.find(std::string("rank-") + rank + ".safetensors.tmp."), std::string::npos)
        << why;
    EXPECT_NE(why.find("write failed: File too large"), std::string::npos) << why;
  }
  EXPECT_NE(failed.err.find("failed first (exit code 1)"), std::string::npos) << failed.err;
  expect_failed_save_loses_nothing(failed, dir, ref_dir, "File too large");
  Result again =
      run(on_ranks(2, flags + " --resume", {"--ckpt-dir", dir, "--metrics", resumed}));
  ASSERT_EQ(again.code, 0) << again.err;
  EXPECT_EQ(metric(resumed, "loss"), losses_after(ref, 5));
  EXPECT_EQ(metric(resumed + ".rank1", "loss"), losses_after(ref, 5));
  EXPECT_EQ(ckpt_step(dir), 20);
}

// One process under the same limit, SIGXFSZ not ignored: the checkpoint of step 10 and an
// --export fail with the EFBIG message and status 1, and what was saved before stays and
// loads; the trace file written at exit fails with a message.
TEST(TrainGptCkpt, FileSizeLimitStopsWithAMessageNotASignal) {
  std::string dir = tmp_dir() + "fsize-one", model = tmp_dir() + "fsize-one.safetensors";
  Result r = run(train_gpt(kCkptFlags + " --steps 5", {"--ckpt-dir", dir, "--export", model}));
  ASSERT_EQ(r.code, 0) << r.err;
  std::string exported = slurp(model);
  Result failed = run_fsize_limited(
      train_gpt(kCkptFlags + " --steps 20 --ckpt-every 5 --resume", {"--ckpt-dir", dir}),
      128 << 10);
  EXPECT_EQ(failed.code, 1) << "stopped with status 1, not killed: " << failed.err;
  EXPECT_NE(
      failed.err.find("checkpoint of step 10 in " + dir + " (the previous one is intact)"),
      std::string::npos)
      << failed.err;
  EXPECT_NE(failed.err.find("write failed: File too large (EFBIG: no file may grow past "
                            "131072 bytes here, ulimit -f)"),
            std::string::npos)
      << failed.err;
  EXPECT_EQ(ckpt_step(dir), 5);
  Result exp = run_fsize_limited(
      train_gpt(kCkptFlags + " --steps 1", {"--init", model, "--export", model}), 128 << 10);
  EXPECT_EQ(exp.code, 1) << exp.err;
  EXPECT_NE(exp.err.find("--export " + model), std::string::npos) << exp.err;
  EXPECT_NE(exp.err.find("File too large (EFBIG"), std::string::npos) << exp.err;
  EXPECT_TRUE(slurp(model) == exported) << "the previous export is replaced";
  Result again = run(train_gpt(kCkptFlags + " --steps 6 --resume", {"--ckpt-dir", dir}));
  EXPECT_EQ(again.code, 0) << again.err;
  EXPECT_NE(again.out.find("resumed from " + dir + "/step-00000005"), std::string::npos)
      << again.out;
  // RTP_TRACE's file, written at exit (about 20 KiB here): reported, not a crash.
  std::string trace = tmp_dir() + "fsize-trace";
  std::vector<std::string> traced = {"env", "RTP_TRACE=" + trace};
  for (const std::string &a : train_gpt(kCkptFlags + " --steps 1")) traced.push_back(a);
  Result t = run_fsize_limited(traced, 8 << 10);
  EXPECT_EQ(t.code, 0) << t.err;
  EXPECT_NE(t.err.find("rtp: RTP_TRACE: writing " + trace), std::string::npos) << t.err;
}

// ---- --grad-accum, --eval-every and --keep-best (issue 26) ----------------------------

// K computes of B sequences per optimizer step train like one process with the whole
// batch (one_process_losses: 4 sequences), within 1e-6: in one process, on 2 ranks under
// every strategy (tp: the ranks share each compute's B), on a pipeline with ddp inside and
// on one with micro-batches inside. Every step counts the 4 x 32 tokens of the optimizer
// step, and the model line says how many that is.
TEST(TrainGptRanks, GradAccumMatchesOneBatchOfAll) {
  struct Case {
    int ranks;
    std::string flags;
  };
  const Case cases[] = {
      {1, " --batch 2 --grad-accum 2"},
      {1, " --batch 1 --grad-accum 4"},
      {2, " --batch 1 --grad-accum 2 --strategy rtp"},
      {2, " --batch 1 --grad-accum 2 --strategy ddp"},
      {2, " --batch 1 --grad-accum 2 --strategy fsdp"},
      {2, " --batch 2 --grad-accum 2 --strategy tp"},
      {4, " --batch 1 --grad-accum 2 --pp 2 --strategy ddp"},
      {2, " --batch 2 --grad-accum 2 --pp 2 --micro-batches 2"},
  };
  const std::vector<double> &want = one_process_losses();
  ASSERT_EQ(want.size(), 10u);
  for (const Case &c : cases) {
    std::string m = tmp_dir() + "accum.jsonl";
    std::vector<std::string> extra = {"--metrics", m};
    std::string flags = kRanksFlags + c.flags;
    Result r = run(c.ranks == 1 ? train_gpt(flags, extra) : on_ranks(c.ranks, flags, extra));
    ASSERT_EQ(r.code, 0) << c.flags << ": " << r.err;
    EXPECT_NE(r.out.find("accumulated (128 tokens per step)"), std::string::npos)
        << c.flags << ": " << r.out;
    std::vector<double> got = metric(m, "loss"), tps = metric(m, "tokens_per_s"),
                        ms = metric(m, "ms_per_step");
    ASSERT_EQ(got.size(), want.size()) << c.flags;
    ASSERT_EQ(tps.size(), ms.size()) << c.flags;
    for (size_t i = 0; i < want.size(); i++) {
      EXPECT_NEAR(got[i], want[i], 1e-6 * want[i]) << c.flags << ", step " << i + 1;
      EXPECT_NEAR(tps[i] * ms[i] / 1e3, 4 * 32, 0.01 * 4 * 32) << c.flags << ", step " << i + 1;
    }
  }
}

// A checkpoint of a run with --grad-accum records the global batch of its optimizer steps
// (K x B), and the data of step s is drawn from (seed, s): resumed with the same flags it
// gives the losses of the run never stopped, bit for bit; resumed as one batch of K x B,
// the same to float rounding; resumed with another global batch, it is refused.
TEST(TrainGptCkpt, GradAccumResumesOnTheSameData) {
  const std::string accum = kCkptFlags + " --batch 2 --grad-accum 2";
  std::string ref = tmp_dir() + "cka-ref.jsonl", dir = tmp_dir() + "cka",
              copy = tmp_dir() + "cka-copy", resumed = tmp_dir() + "cka-resumed.jsonl";
  ASSERT_EQ(run(train_gpt(accum + " --steps 20", {"--metrics", ref})).code, 0);
  ASSERT_EQ(run(train_gpt(accum + " --steps 10", {"--ckpt-dir", dir})).code, 0);
  ASSERT_EQ(std::system(("cp -r " + quote(dir) + " " + quote(copy)).c_str()), 0);
  Result again =
      run(train_gpt(accum + " --steps 20 --resume", {"--ckpt-dir", dir, "--metrics", resumed}));
  ASSERT_EQ(again.code, 0) << again.err;
  std::vector<double> want = losses_after(ref, 10);
  ASSERT_EQ(want.size(), 10u);
  EXPECT_EQ(metric(resumed, "loss"), want);
  std::string whole = tmp_dir() + "cka-whole.jsonl";
  Result one = run(train_gpt(kCkptFlags + " --batch 4 --steps 20 --resume",
                             {"--ckpt-dir", copy, "--metrics", whole}));
  ASSERT_EQ(one.code, 0) << one.err;
  std::vector<double> got = metric(whole, "loss");
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); i++)
    EXPECT_NEAR(got[i], want[i], 1e-6 * want[i]) << "step " << i + 11;
  Result other = run(train_gpt(kCkptFlags + " --batch 2 --grad-accum 3 --steps 20 --resume",
                               {"--ckpt-dir", copy}));
  EXPECT_EQ(other.code, 1);
  EXPECT_NE(other.err.find("was saved with global_batch 4, this run has 6"), std::string::npos)
      << other.err;
}

// The value of key in the JSON line that --eval-only prints.
double eval_only_value(const Result &r, const char *key) {
  std::map<std::string, double> o;
  EXPECT_TRUE(parse_flat_json(lines(r.out).empty() ? "" : lines(r.out).back(), &o)) << r.out;
  return o.count(key) ? o[key] : NAN;
}

// --eval-every 5 evaluates at steps 5, 10, ... alone (the metrics' eval_loss and the
// progress lines'), on the windows --eval-only reads, so the latest checkpoint's
// --eval-only loss is step 30's. --keep-best keeps the checkpoint of the lowest eval
// loss, saved at its step between --ckpt-every's (15), past the pruning of all but the
// newest two, and --keep-best reads it; a resumed run compares with the best before it
// (step 35's loss is higher at this learning rate: a run that forgot the best would keep
// step 35's checkpoint).
TEST(TrainGptEval, EveryNStepsAndTheBestKept) {
  const std::string flags =
      "--config tiny --lr 3e-2 --threads 1 --batch 4 --log-every 100 --eval-windows 0 "
      "--eval-problems 0 --eval-every 5 --ckpt-every 15 --keep-best";
  std::string dir = tmp_dir() + "best", m = tmp_dir() + "best.jsonl";
  Result r = run(train_gpt(flags + " --steps 30", {"--ckpt-dir", dir, "--metrics", m}));
  ASSERT_EQ(r.code, 0) << r.err;
  std::vector<double> steps, evals;
  for (const std::string &l : lines(slurp(m))) {
    std::map<std::string, double> o;
    ASSERT_TRUE(parse_flat_json(l, &o)) << l;
    if (o.count("eval_loss")) steps.push_back(o["step"]), evals.push_back(o["eval_loss"]);
  }
  EXPECT_EQ(steps, (std::vector<double>{5, 10, 15, 20, 25, 30}));
  for (const std::string &l : lines(r.out))
    if (l.rfind("step ", 0) == 0) {
      int step = std::atoi(l.c_str() + 5);
      EXPECT_EQ(l.find("| eval ") != std::string::npos, step % 5 == 0) << l;
    }
  ASSERT_EQ(evals.size(), 6u);
  size_t best = std::min_element(evals.begin(), evals.end()) - evals.begin();
  ASSERT_LT(steps[best], 15) << "the test needs a best between --ckpt-every's, older than the "
                                "newest two checkpoints";
  char name[32];
  std::snprintf(name, sizeof(name), "step-%08d", (int)steps[best]);
  EXPECT_EQ(slurp(dir + "/best"), std::string(name) + "\n");
  EXPECT_EQ(ckpt_step(dir), 30);
  const std::string read = "--threads 1 --batch 4 --eval-problems 0 --eval-only";
  Result latest = run(train_gpt(read, {"--ckpt-dir", dir}));
  Result kept = run(train_gpt(read + " --keep-best", {"--ckpt-dir", dir}));
  ASSERT_EQ(latest.code, 0) << latest.err;
  ASSERT_EQ(kept.code, 0) << kept.err;
  EXPECT_NEAR(eval_only_value(latest, "eval_loss"), evals.back(), 1e-7 * evals.back());
  EXPECT_NEAR(eval_only_value(kept, "eval_loss"), evals[best], 1e-7 * evals[best]);
  std::printf("eval losses at steps 5..30:");
  for (double e : evals) std::printf(" %.6f", e);
  std::printf("; best: step %d; --eval-only: %.8f (latest), %.8f (best)\n", (int)steps[best],
              eval_only_value(latest, "eval_loss"), eval_only_value(kept, "eval_loss"));
  Result more =
      run(train_gpt(flags + " --steps 35 --resume", {"--ckpt-dir", dir, "--metrics", m}));
  ASSERT_EQ(more.code, 0) << more.err;
  std::vector<double> all = metric(m, "eval_loss"), at = {};
  for (const std::string &l : lines(slurp(m))) {
    std::map<std::string, double> o;
    if (parse_flat_json(l, &o) && o.count("eval_loss")) at.push_back(o["step"]);
  }
  ASSERT_EQ(all.size(), 7u);
  size_t b = std::min_element(all.begin(), all.end()) - all.begin();
  std::snprintf(name, sizeof(name), "step-%08d", (int)at[b]);
  EXPECT_EQ(slurp(dir + "/best"), std::string(name) + "\n");
  struct stat st;
  EXPECT_EQ(stat((dir + "/" + name).c_str(), &st), 0) << name;
}

// Bad values and combinations of the flags are refused with a message naming them; so is
// --keep-best reading a directory that has no best checkpoint.
TEST(TrainGptErrors, GradAccumAndEvalFlagsAreChecked) {
  std::string tiny = tmp_dir() + "tiny-eval.safetensors", plain = tmp_dir() + "no-best";
  ASSERT_EQ(run({TRAIN_GPT, "--config", "tiny", "--steps", "0", "--export", tiny}).code, 0);
  ASSERT_EQ(run(train_gpt("--config tiny --steps 2 --threads 1", {"--ckpt-dir", plain})).code,
            0);
  std::string fresh = tmp_dir() + "fresh-ck";
  const BadCase cases[] = {
      {{"--grad-accum", "0"}, 2, "--grad-accum must be at least 1"},
      {{"--eval-every", "0"}, 2, "--eval-every must be at least 1"},
      {{"--keep-best"}, 2, "--keep-best needs --ckpt-dir"},
      {{"--keep-best", "--ckpt-dir", fresh}, 2, "--keep-best needs --eval-every N"},
      {{"--init", tiny, "--eval-only", "--eval-every", "5"},
       2,
       "--eval-every evaluates during training, and this run trains nothing"},
      {{"--ckpt-dir", plain, "--eval-only", "--grad-accum", "4"},
       2,
       "--grad-accum accumulates gradients in training, and this run trains nothing"},
      {{"--ckpt-dir", plain, "--eval-only", "--keep-best"}, 1, "no best checkpoint"},
  };
  for (const BadCase &c : cases) {
    std::vector<std::string> argv = {TRAIN_GPT};
    argv.insert(argv.end(), c.args.begin(), c.args.end());
    Result r = run(argv);
    EXPECT_EQ(r.code, c.code) << c.args[0] << ": " << r.err;
    EXPECT_NE(r.err.find(c.message), std::string::npos)
        << c.args[0] << ": expected '" << c.message << "' in: " << r.err;
  }
  Result help = run({TRAIN_GPT, "--help"});
  for (const char *f : {"--grad-accum", "--eval-every", "--keep-best"})
    EXPECT_NE(help.out.find(f), std::string::npos) << f;
}

TEST(TrainGptHelp, ListsTheIssueFlags) {
  Result r = run({TRAIN_GPT, "--help"});
  ASSERT_EQ(r.code, 0);
  for (const char *f : {"--config",      "--n-layer",  "--d-model",    "--n-head",
                        "--seq-len",     "--batch",    "--steps",      "--lr",
                        "--seed",        "--threads",  "--strategy",   "--data",
                        "--metrics",     "--ckpt-dir", "--ckpt-every", "--resume",
                        "--init",        "--export",   "--eval-only",  "--sample",
                        "--temperature", "--help",     "--pp",         "--micro-batches",
                        "--schedule",    "--unit",     "--recompute",  "--tie-embeddings",
                        "--format"})
    EXPECT_NE(r.out.find(f), std::string::npos) << f;
  EXPECT_NE(r.out.find("N x B sequences under rtp, ddp and fsdp"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("B under tp, where every rank trains on the same B sequences"),
            std::string::npos)
      << r.out;
}

// Token files (docs/data.md): llm.c's .bin and nanoGPT's uint16, here of a vocabulary of
// 300 (tiny and quick; GPT-2's 50257 is llm.c's default, checked without training).
const int kTokenVocab = 300;

// A learnable stream of n tokens below kTokenVocab, from `first` on.
std::vector<uint16_t> token_stream(int n, int first = 0) {
  std::vector<uint16_t> t;
  for (int i = first; i < first + n; i++)
    t.push_back((uint16_t)((i * 7 + i / 5) % kTokenVocab));
  return t;
}

std::string le16(const std::vector<uint16_t> &tokens) {
  std::string b;
  for (uint16_t t : tokens) b += std::string{(char)(t & 0xff), (char)(t >> 8)};
  return b;
}

// llm.c's write_datafile: 256 int32 (magic 20240520, version 1, the count), the tokens.
std::string write_llmc(const std::string &name, const std::vector<uint16_t> &tokens,
                       int32_t count = -1) {
  int32_t header[256] = {20240520, 1, count < 0 ? (int32_t)tokens.size() : count};
  std::string path = tmp_dir() + name;
  std::ofstream(path, std::ios::binary)
      << std::string((const char *)header, sizeof(header)) + le16(tokens);
  return path;
}

// nanoGPT's prepare.py: np.uint16 .tofile, nothing else.
std::string write_uint16(const std::string &name, const std::vector<uint16_t> &tokens) {
  std::string path = tmp_dir() + name;
  std::ofstream(path, std::ios::binary) << le16(tokens);
  return path;
}

const std::string kTokenFlags = kRanksFlags + " --vocab 300";

// The same tokens as llm.c's file and as nanoGPT's train alike, to the bit; 2 ranks train
// on them like one process with their global batch, under rtp and tp.
TEST(TrainGptTokens, LlmcAndUint16TrainLikeOneProcessOnTwoRanks) {
  std::string llmc = write_llmc("tokens.bin", token_stream(4000)),
              plain = write_uint16("tokens-u16.bin", token_stream(4000));
  std::string one = tmp_dir() + "tok-one.jsonl", u16 = tmp_dir() + "tok-u16.jsonl";
  Result r = run(train_gpt(kTokenFlags + " --batch 4", {"--data", llmc, "--metrics", one}));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("vocabulary 300; batch 4"), std::string::npos) << r.out;
  ASSERT_EQ(
      run(train_gpt(kTokenFlags + " --batch 4", {"--data", plain, "--metrics", u16})).code, 0);
  std::vector<double> want = metric(one, "loss");
  ASSERT_EQ(want.size(), 10u);
  EXPECT_GT(want[0], 0.9 * std::log(kTokenVocab)) << "about log(300) from the start";
  EXPECT_LT(want.back(), want[0]);
  EXPECT_EQ(metric(u16, "loss"), want);
  expect_two_ranks_give(kTokenFlags, {"--data", llmc}, want, "tok", {"rtp", "tp"});
}

// llm.c's header has no vocabulary: a GPT-2 file's is its tokenizer's, 50257, in the
// exported model's sizes (no training: --steps 0).
TEST(TrainGptTokens, LlmcGpt2FilesDefaultToGpt2sVocabulary) {
  std::vector<uint16_t> tokens(40, 464);
  tokens[0] = tokens[39] = 50256;  // GPT-2's <|endoftext|>, its largest token
  std::string llmc = write_llmc("gpt2.bin", tokens);
  std::string model = tmp_dir() + "gpt2-vocab.safetensors";
  Result r = run(
      train_gpt("--config tiny --seq-len 2 --steps 0", {"--data", llmc, "--export", model}));
  ASSERT_EQ(r.code, 0) << r.err;
  rtp_safetensors *st = nullptr;
  ASSERT_EQ(rtp_safetensors_open(model.c_str(), &st), RTP_OK) << rtp_last_error();
  EXPECT_STREQ(rtp_safetensors_meta(st, "vocab"), "50257");
  rtp_safetensors_close(st);
}

// A token out of range, a malformed file and flags that do not go together: a message
// that names the file and what is wrong (a token by its index and byte offset), status 1
// for a file, 2 for the command line.
TEST(TrainGptTokens, BadTokenFilesAreRefusedClearly) {
  std::vector<uint16_t> bad = token_stream(200);
  bad[150] = 300;
  std::string out_of_range = write_llmc("range.bin", bad);
  std::string odd = tmp_dir() + "odd.bin";
  std::ofstream(odd, std::ios::binary) << std::string("abc");
  std::string text = write_data_file();
  std::string truncated = tmp_dir() + "truncated.bin";
  std::ofstream(truncated, std::ios::binary)
      << slurp(write_llmc("full.bin", token_stream(10))).substr(0, 512);
  std::string counted = write_llmc("count.bin", token_stream(100), 101);
  std::string small = write_llmc("small.bin", token_stream(2000));
  const BadCase cases[] = {
      {{"--data", out_of_range, "--vocab", "300"},
       1,
       "--data " + out_of_range +
           ": token 300 at token index 150 (byte offset 1324) is not below the vocabulary "
           "size 300"},
      {{"--data", write_uint16("range-u16.bin", bad), "--vocab", "300"},
       1,
       "token 300 at token index 150 (byte offset 300)"},
      {{"--data", truncated}, 1, "truncated llm.c header: the file has 512 bytes"},
      {{"--data", text, "--data-format", "llmc"},
       1,
       "--data " + text + ": not an llm.c token file: its first int32 is"},
      {{"--data", counted}, 1, "the token count is 101 (larger than the file)"},
      {{"--data", odd, "--vocab", "300"}, 1, "3 bytes, an odd count"},
      {{"--data", small, "--val-data", text},
       1,
       "--val-data " + text + " holds bytes (vocabulary 256), --data " + small +
           " llm.c GPT-2 tokens (vocabulary 50257)"},
      {{"--data", small, "--vocab", "300", "--val-data", odd},
       1,
       "--val-data " + odd + ": 3 bytes"},
      {{"--data", small, "--vocab", "300", "--seq-len", "4000"},
       1,
       "has 1800 tokens for training: too few for --seq-len 4000"},
      {{"--data", odd, "--data-format", "uint16"}, 2, "--data-format uint16 needs --vocab N"},
      {{"--data", odd, "--data-format", "u16"}, 2, "--data-format must be auto, bytes"},
      {{"--data", text, "--data-format", "bytes", "--vocab", "300"},
       2,
       "--vocab is for token files"},
      {{"--vocab", "300"}, 2, "--data-format, --vocab and --val-data go with --data"},
      {{"--data", small, "--vocab", "0"}, 2, "--vocab must be 1..1048576, not 0"},
      {{"--data", small, "--val-data", small, "--eval-only"},
       2,
       "--eval-only evaluates all of --data"},
  };
  for (const BadCase &c : cases) {
    std::vector<std::string> argv = {TRAIN_GPT, "--config", "tiny", "--steps", "1"};
    argv.insert(argv.end(), c.args.begin(), c.args.end());
    Result r = run(argv);
    EXPECT_EQ(r.code, c.code) << c.message << ": " << r.err;
    EXPECT_NE(r.err.find(c.message), std::string::npos)
        << "expected '" << c.message << "' in: " << r.err;
  }
  Result bin = run(train_gpt("--config tiny --steps 1 --threads 1",
                             {"--data", write_uint16("text.bin", token_stream(1000))}));
  EXPECT_EQ(bin.code, 0) << bin.err;
  EXPECT_NE(
      bin.err.find(
          "has no llm.c header and is read as bytes; nanoGPT's uint16 tokens need --vocab N"),
      std::string::npos)
      << bin.err;
}

// --val-data is what the held-out evaluation reads: the eval loss training reports is
// --eval-only's over that file, not over --data's last tenth.
TEST(TrainGptTokens, ValDataIsTheEvaluationsSource) {
  std::string train = write_llmc("val-train.bin", token_stream(4000)),
              val = write_llmc("val-val.bin", token_stream(600, 100000));
  std::string m = tmp_dir() + "val.jsonl", model = tmp_dir() + "val.safetensors";
  Result r =
      run(train_gpt(kTokenFlags + " --eval-windows 0",
                    {"--data", train, "--val-data", val, "--metrics", m, "--export", model}));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("evaluated on " + val), std::string::npos) << r.out;
  std::vector<double> reported = metric(m, "eval_loss");
  ASSERT_FALSE(reported.empty());
  auto eval_only = [&](const std::string &data) {
    Result e = run(
        train_gpt("--eval-only --threads 1 --vocab 300", {"--init", model, "--data", data}));
    EXPECT_EQ(e.code, 0) << e.err;
    std::map<std::string, double> o;
    EXPECT_TRUE(parse_flat_json(e.out, &o)) << e.out;
    return o;
  };
  std::map<std::string, double> on_val = eval_only(val), on_train = eval_only(train);
  EXPECT_EQ(on_val["windows"], (600 - 1) / 32);
  EXPECT_NEAR(reported.back(), on_val["eval_loss"], 1e-6 * on_val["eval_loss"]);
  EXPECT_GT(std::fabs(reported.back() - on_train["eval_loss"]), 1e-3)
      << "the evaluation read --data, not --val-data";
}

// A vocabulary of 300 lives in the checkpoint (a resumed run gives the same losses), in the
// model read back from it and in the export, which --init reads and PyTorch computes alike,
// and a token model's sample is token ids.
TEST(TrainGptTokens, VocabularySurvivesCheckpointResumeAndExport) {
  std::string data = write_llmc("ck-tokens.bin", token_stream(4000));
  std::string ref = tmp_dir() + "tok-ck-ref.jsonl", dir = tmp_dir() + "tok-ck",
              resumed = tmp_dir() + "tok-ck-resumed.jsonl",
              model = tmp_dir() + "tok-ck.safetensors";
  ASSERT_EQ(std::system(("rm -rf " + quote(dir)).c_str()), 0);
  const std::string flags = kCkptFlags + " --vocab 300";
  ASSERT_EQ(run(train_gpt(flags + " --steps 8", {"--data", data, "--metrics", ref})).code, 0);
  ASSERT_EQ(run(train_gpt(flags + " --steps 4", {"--data", data, "--ckpt-dir", dir})).code, 0);
  Result again = run(train_gpt(flags + " --steps 8 --resume",
                               {"--data", data, "--ckpt-dir", dir, "--metrics", resumed}));
  ASSERT_EQ(again.code, 0) << again.err;
  EXPECT_EQ(metric(resumed, "loss"), losses_after(ref, 4));
  Result exported = run({TRAIN_GPT, "--ckpt-dir", dir, "--export", model});
  ASSERT_EQ(exported.code, 0) << exported.err;
  rtp_safetensors *st = nullptr;
  ASSERT_EQ(rtp_safetensors_open(model.c_str(), &st), RTP_OK) << rtp_last_error();
  EXPECT_STREQ(rtp_safetensors_meta(st, "vocab"), "300");
  rtp_safetensors_close(st);
  Result sample =
      run({TRAIN_GPT, "--init", model, "--steps", "0", "--sample", "5", "--prompt", "1 8 15"});
  ASSERT_EQ(sample.code, 0) << sample.err;
  EXPECT_NE(sample.out.find(
                "--- sample (5 tokens after 3 of prompt, greedy; token ids) ---\n1 8 15 "),
            std::string::npos)
      << sample.out;
  Result text =
      run({TRAIN_GPT, "--init", model, "--steps", "0", "--sample", "5", "--prompt", "hi"});
  EXPECT_EQ(text.code, 2);
  EXPECT_NE(text.err.find("a token model (vocabulary 300) takes token ids below 300"),
            std::string::npos)
      << text.err;
  Result bytes = run({TRAIN_GPT, "--init", model, "--eval-only"});
  EXPECT_EQ(bytes.code, 1);
  EXPECT_NE(bytes.err.find("the built-in task holds bytes (vocabulary 256), the model (" +
                           model + ") has a vocabulary of 300"),
            std::string::npos)
      << bytes.err;
  if (run({"/usr/bin/python3", "-c", "import torch"}).code != 0)
    GTEST_SKIP() << "/usr/bin/python3 has no torch (apt install python3-torch)";
  Result py = run({"/usr/bin/python3", CHECK_EXPORT, model, data, "--vocab", "300",
                   "--train-gpt", TRAIN_GPT, "--sample", "40", "--prompt", "1 8 15"});
  EXPECT_EQ(py.code, 0) << py.out << py.err;
  std::printf("%s", py.out.c_str());
}

// ---- tied embeddings and Hugging Face GPT-2 (examples/gpt/gpt-hf.c) -----------------------

// --tie-embeddings trains on 2 ranks as in one process under every strategy: wte is read by
// the embedding and by the head, and each strategy sums its two gradients once. The tied
// losses are not the untied ones (the flag takes effect), a pipeline refuses it, and the
// export (without lm_head.weight) loads in PyTorch's tied GPT to train-gpt's loss.
TEST(TrainGptRanks, TiedEmbeddingsMatchOneProcess) {
  const std::string flags = kRanksFlags + " --tie-embeddings";
  std::string one = tmp_dir() + "tied-one.jsonl", model = tmp_dir() + "tied.safetensors";
  ASSERT_EQ(run(train_gpt(flags + " --batch 4", {"--metrics", one, "--export", model})).code,
            0);
  std::vector<double> want = metric(one, "loss");
  ASSERT_EQ(want.size(), 10u);
  EXPECT_GT(std::fabs(want[9] - one_process_losses()[9]), 1e-3) << "tying changed nothing";
  expect_two_ranks_give(flags, {}, want, "tied");
  Result pp = run(on_ranks(2, flags + " --pp 2 --batch 4"));
  EXPECT_EQ(pp.code, 2) << pp.err;
  EXPECT_NE(pp.err.find("tied embeddings (--tie-embeddings, or a GPT-2 --init) with --pp 2"),
            std::string::npos)
      << pp.err;
  if (run({"/usr/bin/python3", "-c", "import torch"}).code != 0) return;  // as LoadsInPyTorch
  Result torch = run(
      {"/usr/bin/python3", CHECK_EXPORT, model, write_data_file(), "--train-gpt", TRAIN_GPT});
  EXPECT_EQ(torch.code, 0) << torch.out << torch.err;  // the export has no lm_head.weight
}

// The value of key in the last line of out that is a flat JSON object; NaN if none.
double json_value(const std::string &out, const char *key) {
  double v = std::nan("");
  for (const std::string &l : lines(out)) {
    std::map<std::string, double> o;
    if (parse_flat_json(l, &o) && o.count(key)) v = o[key];
  }
  return v;
}

// --stages exports the model it trained (each parameter gathered on its stage), and --init
// loads a model onto any stages: evaluating one stages run's export on one process and on
// other stages gives the loss of one process's own export.
TEST(TrainGptPipeline, StagesExportAndInitOnOtherStages) {
  const std::string flags = kRanksFlags + " --steps 5 --batch 4";
  std::string one = tmp_dir() + "stages-one.safetensors",
              het = tmp_dir() + "stages.safetensors";
  ASSERT_EQ(run(train_gpt(flags, {"--export", one})).code, 0);
  Result r =
      run(on_ranks(4, flags + " --stages 2:tp,2:ddp --micro-batches 4", {"--export", het}));
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  const std::string eval = " --eval-only --threads 1 --eval-windows 8 --eval-problems 0";
  Result want = run(train_gpt("--init " + one + eval, {}));
  Result a = run(train_gpt("--init " + het + eval, {}));
  Result b = run(on_ranks(3, "--init " + het + eval +
                                 " --stages 1:none,2:rtp --batch 4 "
                                 "--micro-batches 2"));
  ASSERT_EQ(want.code + a.code + b.code, 0) << want.err << a.err << b.out << b.err;
  double w = json_value(want.out, "eval_loss");
  ASSERT_FALSE(std::isnan(w)) << want.out;
  EXPECT_NEAR(json_value(a.out, "eval_loss"), w, 1e-5 * w) << a.out;
  std::string b0;  // rank 0's lines
  for (const std::string &l : lines(b.out))
    if (l.rfind("[0] ", 0) == 0) b0 += l.substr(4) + "\n";
  EXPECT_NEAR(json_value(b0, "eval_loss"), w, 1e-5 * w) << b.out;
}

// Without transformers: a model written --format hf reads back (--init) to the loss of the
// same weights written as train-gpt's own file, and what would read a GPT-2 wrongly is
// refused naming the cause: --config, a window past its positions, a size flag, heads that
// config.json contradicts or that nothing gives, a config.json of another model, a
// pipeline. A shorter window reads (the first positions).
TEST(TrainGptErrors, GptTwoInitReadsBackAndRefusesClearly) {
  std::string dir = tmp_dir() + "hf-own", data = write_data_file();
  ASSERT_EQ(mkdir(dir.c_str(), 0700), 0);
  std::string hf = dir + "/model.safetensors", pt = tmp_dir() + "hf-own-pt.safetensors";
  const std::string make = "--config tiny --steps 0 --tie-embeddings --seed 3";
  ASSERT_EQ(run(train_gpt(make, {"--export", hf, "--format", "hf"})).code, 0);
  ASSERT_EQ(run(train_gpt(make, {"--export", pt})).code, 0);
  Result a = run(train_gpt("--eval-only", {"--init", hf, "--data", data}));
  Result b = run(train_gpt("--eval-only", {"--init", pt, "--data", data}));
  ASSERT_EQ(a.code, 0) << a.err;
  ASSERT_EQ(b.code, 0) << b.err;
  EXPECT_EQ(json_value(a.out, "eval_loss"), json_value(b.out, "eval_loss"));
  EXPECT_EQ(run(train_gpt("--eval-only --seq-len 16", {"--init", hf, "--data", data})).code, 0);
  struct Case {
    const char *flags, *message;
  } cases[] = {
      {"--config tiny", "is a GPT-2, whose sizes are the file's"},
      {"--seq-len 64", "has 32 positions (n_positions)"},
      {"--n-layer 1", "(leave the size flags out)"},
      {"--n-head 2", "config.json says n_head 4, --n-head says 2"},
  };
  for (const Case &c : cases) {
    Result r =
        run(train_gpt(std::string("--eval-only ") + c.flags, {"--init", hf, "--data", data}));
    EXPECT_NE(r.code, 0) << c.flags;
    EXPECT_NE(r.err.find(c.message), std::string::npos) << c.flags << ": " << r.err;
  }
  Result pp = run(on_ranks(2, "--eval-only --pp 2", {"--init", hf, "--data", data}));
  EXPECT_EQ(pp.code, 2) << pp.err;
  EXPECT_NE(pp.err.find("tied embeddings (--tie-embeddings, or a GPT-2 --init)"),
            std::string::npos)
      << pp.err;
  std::string config = slurp(dir + "/config.json"), from = "1e-05";
  ASSERT_NE(config.find(from), std::string::npos) << config;
  std::ofstream(dir + "/config.json")
      << config.replace(config.find(from), from.size(), "1e-06");
  Result eps = run(train_gpt("--eval-only", {"--init", hf, "--data", data}));
  EXPECT_NE(eps.code, 0);
  EXPECT_NE(eps.err.find("layer_norm_epsilon 1e-06"), std::string::npos) << eps.err;
  ASSERT_EQ(std::remove((dir + "/config.json").c_str()), 0);
  Result heads = run(train_gpt("--eval-only", {"--init", hf, "--data", data}));
  EXPECT_EQ(heads.code, 2);
  EXPECT_NE(heads.err.find("give --n-head N, or put the model's config.json beside it"),
            std::string::npos)
      << heads.err;
}

// An interpreter where transformers imports: $RTP_TEST_PYTHON, else python3; "" if none.
const std::string &transformers_python() {
  static const std::string py = [] {
    std::vector<std::string> candidates;
    if (const char *e = std::getenv("RTP_TEST_PYTHON")) candidates.push_back(e);
    candidates.push_back("python3");
    for (const std::string &p : candidates)
      if (run({p, "-c", "import transformers"}).code == 0) return p;
    return std::string();
  }();
  return py;
}

#define SKIP_WITHOUT_TRANSFORMERS()                                                           \
  if (transformers_python().empty())                                                          \
  GTEST_SKIP() << "no python with transformers: pip install transformers (torch too) into a " \
                  "venv and set RTP_TEST_PYTHON=venv/bin/python"

// The reference GPT's logits for data's windows (T + 1 bytes at i*T, every i that fits)
// under the HF model at path, read through gpt_hf_read, one process.
std::vector<float> hf_logits(const std::string &path, const std::vector<uint16_t> &text,
                             int *vocab) {
  rtp_safetensors *st = nullptr;
  EXPECT_EQ(rtp_safetensors_open(path.c_str(), &st), 0) << rtp_last_error();
  gpt_config cfg{};
  EXPECT_EQ(gpt_hf_config(path.c_str(), st, -1, &cfg), 0) << gpt_hf_error();
  int T = cfg.seq_len, n = (int)((text.size() - 1) / T);
  rtp_context *ctx = rtp_context_new({gpt_arena_size(cfg, n), nullptr, false, nullptr, 0});
  gpt m{};
  EXPECT_EQ(gpt_build(ctx, &m, cfg, n), 0) << rtp_last_error();
  for (int i = 0; i < m.n_params; i++)
    EXPECT_EQ(gpt_hf_read(st, m.params[i], (float *)m.params[i]->data), 0) << gpt_hf_error();
  for (int w = 0; w < n; w++)
    for (int t = 0; t < T; t++) {
      ((int32_t *)m.idx->data)[w * T + t] = text[w * T + t];
      ((int32_t *)m.targets->data)[w * T + t] = text[w * T + t + 1];
    }
  rtp_graph *g = rtp_graph_new(ctx, 4096);
  EXPECT_EQ(rtp_graph_build(g, m.logits), 0) << rtp_last_error();
  EXPECT_EQ(rtp_graph_plan(ctx, g), 0) << rtp_last_error();
  EXPECT_EQ(rtp_graph_compute(g, nullptr), 0) << rtp_last_error();
  const float *l = (const float *)m.logits->data;
  std::vector<float> out(l, l + rtp_tensor_nelements(m.logits));
  *vocab = cfg.vocab;
  rtp_context_free(ctx);
  rtp_safetensors_close(st);
  return out;
}

// A randomly initialised transformers.GPT2LMHeadModel (save_pretrained: model.safetensors
// and config.json) read by --init gives its logits and its loss on a text, to 1e-4
// (transformers in float64), also on 2 ranks under every strategy. Without config.json the
// heads must be given (--n-head); a
// config.json of another activation is refused, naming it.
TEST(TrainGptHf, InitGivesTransformersLogitsAndLoss) {
  SKIP_WITHOUT_TRANSFORMERS();
  const std::vector<uint16_t> tokens = token_stream(4000);  // below the model's 300
  std::string dir = tmp_dir() + "hf-made", data = write_uint16("hf-tokens.bin", tokens);
  std::string model = dir + "/model.safetensors", want_logits = dir + "/logits.f32";
  Result made = run({transformers_python(), HF_GPT2, "make", dir, "--vocab", "300", "--data",
                     data, "--uint16", "--logits", want_logits});
  ASSERT_EQ(made.code, 0) << made.out << made.err;
  double want = json_value(made.out, "loss");
  ASSERT_TRUE(std::isfinite(want)) << made.out;

  Result eval =
      run(train_gpt("--eval-only", {"--init", model, "--data", data, "--vocab", "300"}));
  ASSERT_EQ(eval.code, 0) << eval.err;
  double got = json_value(eval.out, "eval_loss");
  std::printf("transformers %.9f, train-gpt --init %.9f\n", want, got);
  EXPECT_NEAR(got, want, 1e-4 * want);
  for (const std::string st : {"rtp", "fsdp", "ddp", "tp"}) {  // each rank keeps its part
    Result r = run(on_ranks(2, "--eval-only --threads 1 --strategy " + st,
                            {"--init", model, "--data", data, "--vocab", "300"}));
    ASSERT_EQ(r.code, 0) << st << ": " << r.err;
    EXPECT_NEAR(json_value(r.out.substr(r.out.find('{')), "eval_loss"), got, 1e-6 * got) << st;
  }

  int vocab = 0;
  std::vector<float> logits = hf_logits(model, tokens, &vocab);
  std::string ref_bytes = slurp(want_logits);
  ASSERT_EQ(ref_bytes.size(), logits.size() * sizeof(float));
  const float *ref = (const float *)ref_bytes.data();
  double num = 0, den = 0;  // both [window][position][vocab]
  for (size_t i = 0; i < logits.size(); i++) {
    num = std::fmax(num, std::fabs((double)logits[i] - ref[i]));
    den = std::fmax(den, std::fabs((double)ref[i]));
  }
  std::printf("logits: %zu, vocab %d, max |diff| %.3g of max |logit| %.3g\n", logits.size(),
              vocab, num, den);
  EXPECT_LT(num, 1e-4 * den);

  std::string alone = tmp_dir() + "hf-alone";
  ASSERT_EQ(mkdir(alone.c_str(), 0700), 0);
  std::ofstream(alone + "/model.safetensors", std::ios::binary) << slurp(model);
  Result no_heads = run(train_gpt("--eval-only", {"--init", alone + "/model.safetensors",
                                                  "--data", data, "--vocab", "300"}));
  EXPECT_EQ(no_heads.code, 2) << no_heads.err;
  EXPECT_NE(no_heads.err.find("give --n-head N, or put the model's config.json beside it"),
            std::string::npos)
      << no_heads.err;
  Result heads =
      run(train_gpt("--eval-only --n-head 4", {"--init", alone + "/model.safetensors", "--data",
                                               data, "--vocab", "300"}));
  ASSERT_EQ(heads.code, 0) << heads.err;
  EXPECT_EQ(json_value(heads.out, "eval_loss"), got);

  std::string config = slurp(dir + "/config.json"), from = "\"gelu_new\"";
  ASSERT_NE(config.find(from), std::string::npos) << config;
  std::ofstream(alone + "/config.json")
      << config.replace(config.find(from), from.size(), "\"gelu\"");
  Result exact = run(train_gpt("--eval-only", {"--init", alone + "/model.safetensors", "--data",
                                               data, "--vocab", "300"}));
  EXPECT_NE(exact.code, 0);
  EXPECT_NE(exact.err.find("activation_function \"gelu\""), std::string::npos) << exact.err;
}

// A model trained here with tied embeddings and written with --export --format hf loads in
// transformers.GPT2LMHeadModel.from_pretrained to the loss train-gpt gives it.
TEST(TrainGptHf, TiedExportLoadsInTransformers) {
  SKIP_WITHOUT_TRANSFORMERS();
  std::string dir = tmp_dir() + "hf-export", data = write_data_file();
  ASSERT_EQ(mkdir(dir.c_str(), 0700), 0);
  std::string model = dir + "/model.safetensors";
  Result train = run(train_gpt("--config tiny --steps 10 --threads 2 --tie-embeddings",
                               {"--data", data, "--export", model, "--format", "hf"}));
  ASSERT_EQ(train.code, 0) << train.err;
  Result eval = run(train_gpt("--eval-only", {"--init", model, "--data", data}));
  ASSERT_EQ(eval.code, 0) << eval.err;
  double got = json_value(eval.out, "eval_loss");
  Result hf = run({transformers_python(), HF_GPT2, "loss", dir, data});
  ASSERT_EQ(hf.code, 0) << hf.out << hf.err;
  double want = json_value(hf.out, "loss");
  std::printf("train-gpt %.9f, transformers %.9f\n", got, want);
  EXPECT_NEAR(got, want, 1e-4 * want);
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
