/*
 * train-gpt.c - the flagship trainer: the reference GPT (DESIGN.md section 6) on bytes.
 *
 *     train-gpt --config tiny --steps 300                 # the built-in addition task
 *     train-gpt --data input.txt --export model.safetensors
 *     train-gpt --data train.bin --val-data val.bin      # llm.c's GPT-2 tokens
 *     train-gpt --init model.safetensors --eval-only --data test.txt
 *     train-gpt --init model.safetensors --sample 200 --prompt "12+34="
 *     train-gpt --ckpt-dir ck --ckpt-every 50            # then, after a crash: --resume
 *     train-gpt --ckpt-dir ck --export model.safetensors # ck's latest checkpoint as a model
 *     train-gpt --init gpt2/model.safetensors --export out/model.safetensors --format hf
 *                                                        # Hugging Face GPT-2, docs/gpt2.md
 *     rtp-run -n 2 -- train-gpt --config tiny --strategy rtp --batch 4
 *     rtp-run -n 2 -- train-gpt --config tiny --strategy tp --batch 8
 *
 * One process or N ranks (rtp-run, Slurm or MPI environment variables), one code path:
 * the model is built once for one device in a no_alloc context, and rtp_parallel_new turns
 * it into this rank's training graph (strategy none for one process). Data: sample_batch
 * defines the global batch of world x B windows and the rank's share of it, so N ranks
 * with batch B train exactly like one process with batch N x B. tp splits the model, not
 * the data: every rank trains on the same B windows (the global batch is B), so N tp
 * ranks with batch B train like one process with batch B. Evaluation, accuracy and
 * sampling are forward passes with transfers in them: every rank runs them at the same
 * moments on the same inputs, and rank 0 alone prints.
 */
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "eta.h"
#include "lr-schedule.h"
#include "gpt.h"
#include "device.h"
#include "gpt-hf.h"
#include "rtp.h"
#include "token-data.h"

#define EXIT_USAGE 2

/* ---- options ------------------------------------------------------------------------ */

/* A flag left out is -1 where the flags' values are never negative. */
struct options {
  const char *config;                    /* tiny, small, medium; NULL: --init's, else small */
  int n_layer, d_model, n_head, seq_len; /* -1: from the config */
  int batch, steps, log_every, eval_windows, eval_problems, sample, ckpt_every;
  int threads;                 /* -1: the cores shared by the local ranks */
  int pp, micro_batches, unit; /* pipeline stages, micro-batches per step, zeropp's unit */
  const char *stages;          /* --stages: G:STRATEGY,... (stages of different sizes) */
  int grad_accum;              /* computes of the graph per optimizer step */
  int eval_every;              /* -1: evaluate at each progress line */
  float lr;                    /* -1: the config's */
  /* the schedule (lr-schedule.h): -1 or NULL when left out, then the checkpoint's on
   * --resume, else constant, 0, --steps (constant: 0, unused) and lr / 10
   * (resolve_schedule) */
  const char *lr_schedule;
  int warmup, max_steps;
  float lr_min;
  float weight_decay, grad_clip; /* AdamW's; 0 disables */
  float temperature;
  int64_t seed;
  const char *strategy, *schedule, *data, *metrics, *init, *export_path, *ckpt_dir, *prompt;
  const char *val_data, *data_format; /* data_format NULL: auto (token-data.h) */
  int vocab;                          /* -1: the file's (token-data.h) */
  const char *format;     /* --export's: pt (train-gpt's) or hf (Hugging Face GPT-2) */
  const char *fused_attn; /* on | off: gpt_config's fused_attention; NULL: the device's */
  const char *device;     /* auto | cpu | cuda | sim (device.h) */
  bool eval_only, resume, bf16, recompute, tie_embeddings, adam_in_backward, help;
  bool keep_best; /* training: keep the best eval loss's checkpoint; reading: read it */
};

#define MAX_FLAGS 56

enum arg_kind { ARG_INT, ARG_I64, ARG_FLOAT, ARG_STR, ARG_BOOL };

struct flag {
  const char *name;
  enum arg_kind kind;
  void *dst;
  const char *arg; /* the value's name in --help; NULL for a switch */
  const char *help;
};

/* The command line of issue 5; the table is both the parser and the --help text. */
static int flag_table(struct options *o, struct flag *f) {
  struct flag t[] = {
      {"--config", ARG_STR, &o->config, "NAME",
       "tiny | small | medium (default small, or --init's)"},
      {"--n-layer", ARG_INT, &o->n_layer, "N", "transformer blocks (overrides the config)"},
      {"--d-model", ARG_INT, &o->d_model, "N", "embedding width"},
      {"--n-head", ARG_INT, &o->n_head, "N", "attention heads (must divide --d-model)"},
      {"--seq-len", ARG_INT, &o->seq_len, "T", "context length in tokens (bytes)"},
      {"--batch", ARG_INT, &o->batch, "B",
       "sequences per step and rank (default 8; tp: shared by all ranks)"},
      {"--steps", ARG_INT, &o->steps, "N", "optimizer steps (default 200; 0: only --init)"},
      {"--lr", ARG_FLOAT, &o->lr, "X", "Adam learning rate (tiny 1e-3, else 3e-4)"},
      {"--lr-schedule", ARG_STR, &o->lr_schedule, "S",
       "constant (default) | cosine | linear decay to --lr-min at --max-steps"},
      {"--warmup", ARG_INT, &o->warmup, "N",
       "steps of linear warm-up to --lr (default 0; nanoGPT: 2000)"},
      {"--max-steps", ARG_INT, &o->max_steps, "N",
       "the decay's length, kept by --resume (default: --steps)"},
      {"--lr-min", ARG_FLOAT, &o->lr_min, "X", "the decay's floor (default --lr / 10)"},
      {"--weight-decay", ARG_FLOAT, &o->weight_decay, "X",
       "AdamW decay, not on biases and LayerNorm (default 0; nanoGPT: 0.1)"},
      {"--grad-clip", ARG_FLOAT, &o->grad_clip, "X",
       "clip the global gradient norm to X (default 0: off; nanoGPT: 1)"},
      {"--seed", ARG_I64, &o->seed, "N", "seed of the weights, batches and sampling (1337)"},
      {"--threads", ARG_INT, &o->threads, "N",
       "compute threads per rank (default: the cores / local ranks)"},
      {"--strategy", ARG_STR, &o->strategy, "S",
       "rtp | ddp | fsdp | tp, on N ranks (default rtp; one process: all equal)"},
      {"--pp", ARG_INT, &o->pp, "S",
       "pipeline stages; the N ranks are S stages x N/S ranks (default 1)"},
      {"--stages", ARG_STR, &o->stages, "G:S,...",
       "pipeline stages of different sizes and strategies, the ranks stage after stage "
       "(e.g. 2:tp,3:ddp); --batch is the global batch, in --micro-batches units (gpipe)"},
      {"--micro-batches", ARG_INT, &o->micro_batches, "M",
       "micro-batches per step, each B/M sequences (default 1)"},
      {"--grad-accum", ARG_INT, &o->grad_accum, "K",
       "accumulate K batches of B per optimizer step (default 1; global batch x K)"},
      {"--schedule", ARG_STR, &o->schedule, "NAME",
       "gpipe | 1f1b | eager-1f1b | zeropp (default 1f1b; gpipe with --stages)"},
      {"--unit", ARG_INT, &o->unit, "U",
       "zeropp: micro-batches per unit (default: the largest divisor of M up to S)"},
      {"--recompute", ARG_BOOL, &o->recompute, NULL,
       "recompute each block's activations in backward (less memory)"},
      {"--adam-in-backward", ARG_BOOL, &o->adam_in_backward, NULL,
       "update each parameter as soon as its gradient is complete, keeping no gradients "
       "(less memory; rtp, fsdp or one process, CPU, no clipping or accumulation)"},
      {"--fused-attn", ARG_STR, &o->fused_attn, "on|off",
       "attention as one fused op, no T x T matrix in memory (default on; GPU: off)"},
      {"--device", ARG_STR, &o->device, "D",
       "auto | cpu | cuda | sim: auto is the local rank's GPU if there is one, sim a "
       "simulated device for tests (default auto)"},
      {"--bf16", ARG_BOOL, &o->bf16, NULL,
       "mixed precision: bf16 products (f32 sums, weights, Adam); rtp rotates bf16 blocks"},
      {"--data", ARG_STR, &o->data, "FILE",
       "bytes or a token file, last 10% held out (default: built-in sums)"},
      {"--data-format", ARG_STR, &o->data_format, "F",
       "auto | bytes | uint16 | llmc (auto: llm.c's if its magic, uint16 if --vocab)"},
      {"--vocab", ARG_INT, &o->vocab, "N",
       "token files' vocabulary (uint16: required; llm.c: default its tokenizer's)"},
      {"--val-data", ARG_STR, &o->val_data, "FILE",
       "evaluate on this file (same formats) instead of --data's last 10%"},
      {"--metrics", ARG_STR, &o->metrics, "FILE",
       "write one JSON object per step (JSONL; --resume appends)"},
      {"--tie-embeddings", ARG_BOOL, &o->tie_embeddings, NULL,
       "the head is the token embedding (GPT-2's tying; not with --pp)"},
      {"--init", ARG_STR, &o->init, "FILE",
       "start from a .safetensors model: train-gpt's, or Hugging Face GPT-2's"},
      {"--export", ARG_STR, &o->export_path, "FILE",
       "write the model as .safetensors at the end"},
      {"--format", ARG_STR, &o->format, "F",
       "--export's layout: pt (default) | hf (GPT2LMHeadModel, + config.json beside it)"},
      {"--eval-only", ARG_BOOL, &o->eval_only, NULL,
       "print {\"eval_loss\": x, \"windows\": n} over all of --data"
       ", for --init's or --ckpt-dir's model"},
      {"--sample", ARG_INT, &o->sample, "N",
       "generate N tokens (bytes) after training (or from --init or --ckpt-dir)"},
      {"--temperature", ARG_FLOAT, &o->temperature, "X", "sampling temperature (0: greedy)"},
      {"--prompt", ARG_STR, &o->prompt, "TEXT",
       "what --sample continues (token models: ids, e.g. \"464 2068\"; default: held-out "
       "text)"},
      {"--log-every", ARG_INT, &o->log_every, "N", "steps between progress lines (auto)"},
      {"--eval-windows", ARG_INT, &o->eval_windows, "N",
       "held-out windows per evaluation (256; 0: all)"},
      {"--eval-problems", ARG_INT, &o->eval_problems, "N",
       "held-out sums for the accuracy (64)"},
      {"--eval-every", ARG_INT, &o->eval_every, "N",
       "evaluate every N steps (default: at each progress line)"},
      {"--keep-best", ARG_BOOL, &o->keep_best, NULL,
       "keep --ckpt-dir's checkpoint of the best --eval-every loss (DIR/best); "
       "reading DIR: read it"},
      {"--ckpt-dir", ARG_STR, &o->ckpt_dir, "DIR",
       "write sharded checkpoints there (the last 2 are kept), or read the latest"},
      {"--ckpt-every", ARG_INT, &o->ckpt_every, "N",
       "steps between checkpoints (0: only at the end)"},
      {"--resume", ARG_BOOL, &o->resume, NULL,
       "continue from --ckpt-dir's latest checkpoint (same --seed and global batch)"},
      {"--help", ARG_BOOL, &o->help, NULL, "this text"},
  };
  _Static_assert(sizeof(t) / sizeof(t[0]) <= MAX_FLAGS, "raise MAX_FLAGS");
  int n = (int)(sizeof(t) / sizeof(t[0]));
  memcpy(f, t, sizeof(t));
  return n;
}

static void print_usage(FILE *out) {
  struct options o;
  struct flag f[MAX_FLAGS];
  int n = flag_table(&o, f);
  fprintf(
      out,
      "usage: train-gpt [options]\n"
      "Trains the reference GPT with rtp on bytes, or on the tokens of an llm.c or nanoGPT\n"
      "token file (docs/data.md). Without --data it learns the built-in task, sums like\n"
      "\"042+917=0959\", and reports exact-match accuracy on held-out sums.\n\noptions:\n");
  for (int i = 0; i < n; i++) {
    char left[40];
    snprintf(left, sizeof(left), "%s%s%s", f[i].name, f[i].arg ? " " : "",
             f[i].arg ? f[i].arg : "");
    fprintf(out, "  %-22s %s\n", left, f[i].help);
  }
  fprintf(out,
          "\nconfigs: tiny T=32 d=64 L=2 H=4; small T=128 d=384 L=6 H=6; medium T=256 d=768 "
          "L=12 H=12.\nGlobal batch on N ranks: N x B sequences under rtp, ddp and fsdp (each "
          "rank its own B);\nB under tp, where every rank trains on the same B sequences with "
          "1/N of the heads and\nMLP units (N must divide the heads). With --pp S, D = N/S "
          "ranks per stage and the\nglobal batch is D x B; --strategy runs inside each stage "
          "(rtp, fsdp or ddp).\n--grad-accum K runs K batches of that size per optimizer "
          "step (global batch x K),\nthe graph and activations of one; --micro-batches M "
          "splits each batch inside the graph.\n"
          "A checkpoint that cannot be written (e.g. a full disk) stops training with status "
          "1; the\nprevious one is kept and --resume continues from it, its --metrics file "
          "too (the steps\nlogged after the checkpoint are dropped). --ckpt-dir DIR with "
          "--export, --eval-only or\n--sample and without --resume reads DIR's latest "
          "checkpoint, sizes included, and trains\nnothing.\n"
          "Exit status: 0 success, 1 failure, 2 bad command line.\n");
}

static int usage_error(const char *fmt, ...) RTP_PRINTF(1, 2);
static int usage_error(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "train-gpt: ");
  vfprintf(stderr, fmt, ap);
  fprintf(stderr, "\n(train-gpt --help lists the options)\n");
  va_end(ap);
  return EXIT_USAGE;
}

static int parse_value(const struct flag *f, const char *s) {
  char *end = NULL;
  errno = 0;
  if (f->kind == ARG_STR) {
    *(const char **)f->dst = s;
    return 0;
  }
  if (f->kind == ARG_FLOAT) {
    double v = strtod(s, &end);
    if (*s && !*end && !errno && isfinite((float)v) && v >= 0) {
      *(float *)f->dst = (float)v;
      return 0;
    }
    return usage_error("%s: expected a number >= 0 that a float holds (below 3.4e38), got '%s'",
                       f->name, s);
  }
  long long v = strtoll(s, &end, 10);
  bool ok = *s && !*end && !errno && v >= 0;
  if (f->kind == ARG_INT && ok && v <= 1 << 30) {
    *(int *)f->dst = (int)v;
    return 0;
  }
  if (f->kind == ARG_I64 && ok) {
    *(int64_t *)f->dst = v;
    return 0;
  }
  return usage_error("%s: expected a non-negative integer, got '%s'", f->name, s);
}

static int parse_args(int argc, char **argv, struct options *o) {
  *o = (struct options){.n_layer = -1,
                        .d_model = -1,
                        .n_head = -1,
                        .seq_len = -1,
                        .lr = -1,
                        .warmup = -1,
                        .max_steps = -1,
                        .lr_min = -1,
                        .threads = -1,
                        .unit = -1,
                        .batch = 8,
                        .steps = -1,
                        .seed = 1337,
                        .eval_windows = 256,
                        .eval_problems = 64,
                        .strategy = "rtp",
                        .format = "pt",
                        .device = "auto",
                        .pp = 1,
                        .micro_batches = 1,
                        .vocab = -1,
                        .grad_accum = 1,
                        .eval_every = -1};
  struct flag f[MAX_FLAGS];
  int n = flag_table(o, f);
  for (int i = 1; i < argc; i++) {
    int k = 0;
    while (k < n && strcmp(argv[i], f[k].name) != 0) k++;
    if (k == n) return usage_error("unknown option '%s'", argv[i]);
    if (f[k].kind == ARG_BOOL) {
      *(bool *)f[k].dst = true;
      continue;
    }
    if (i + 1 == argc) return usage_error("%s needs a value (%s)", f[k].name, f[k].arg);
    int rc = parse_value(&f[k], argv[++i]);
    if (rc) return rc;
  }
  if (!o->schedule) o->schedule = o->stages ? "gpipe" : "1f1b";
  return 0;
}

/* Whether dir has a latest pointer: a new run must not replace those checkpoints. */
static bool has_checkpoint(const char *dir) {
  char path[4096];
  snprintf(path, sizeof(path), "%s/latest", dir);
  return access(path, F_OK) == 0;
}

/* --export, --eval-only and --sample with a --ckpt-dir that has a checkpoint, and no
 * --resume: the model is that checkpoint, and nothing is trained. */
static bool reads_checkpoint(const struct options *o) {
  return o->ckpt_dir && !o->resume && (o->export_path || o->eval_only || o->sample) &&
         has_checkpoint(o->ckpt_dir);
}

/* Where the weights come from. Evaluating or sampling the random weights a run starts from
 * would print numbers that look like a result, so it is refused; so are the flags of
 * training with a checkpoint read, rather than ignored. */
static int check_weights(const struct options *o) {
  if (reads_checkpoint(o) && o->init)
    return usage_error("--init and --ckpt-dir %s's checkpoint both give the weights",
                       o->ckpt_dir);
  if (reads_checkpoint(o) && (o->steps >= 0 || o->ckpt_every || o->metrics))
    return usage_error(
        "--ckpt-dir %s: reading its checkpoint trains nothing, so --steps, --ckpt-every and "
        "--metrics do not apply (--resume trains on from it)",
        o->ckpt_dir);
  if (reads_checkpoint(o)) return 0;
  if (o->resume && o->eval_only)
    return usage_error("--eval-only reads --ckpt-dir's checkpoint without --resume");
  if (o->eval_only && o->ckpt_dir)
    return usage_error("--eval-only: --ckpt-dir %s has no checkpoint", o->ckpt_dir);
  if ((o->eval_only || (o->sample && o->steps == 0)) && !o->init && !o->resume)
    return usage_error("%s has no weights but random ones: give --init FILE or --ckpt-dir DIR",
                       o->eval_only ? "--eval-only" : "--sample with --steps 0");
  return 0;
}

/* --data's companions: a format train-gpt reads, and the flags each needs. */
static int check_data_options(const struct options *o) {
  enum token_format f = TOKEN_AUTO;
  if (o->data_format && !token_format_parse(o->data_format, &f))
    return usage_error("--data-format must be auto, bytes, uint16 or llmc, not '%s'",
                       o->data_format);
  if (!o->data && (o->data_format || o->vocab >= 0 || o->val_data))
    return usage_error(
        "--data-format, --vocab and --val-data go with --data (the built-in task is bytes)");
  if (o->vocab == 0 || o->vocab > GPT_MAX_SIZE)
    return usage_error("--vocab must be 1..%d, not %d", GPT_MAX_SIZE, o->vocab);
  if (f == TOKEN_BYTES && o->vocab > 0)
    return usage_error("--vocab is for token files: --data-format bytes has 256 tokens");
  if (f == TOKEN_UINT16 && o->vocab < 0)
    return usage_error("--data-format uint16 needs --vocab N (GPT-2's tokenizer: 50257)");
  if (o->val_data && o->eval_only)
    return usage_error(
        "--eval-only evaluates all of --data: give the file to evaluate as "
        "--data, without --val-data");
  return 0;
}

/* --eval-every and --keep-best: evaluations during training, and the checkpoint of the
 * best one; with a checkpoint read, --keep-best reads DIR/best instead of DIR/latest.
 * Neither, nor --grad-accum, applies to a run that trains nothing. */
static int check_eval(const struct options *o) {
  bool reads = o->eval_only || reads_checkpoint(o);
  if (o->grad_accum > 1 && reads)
    return usage_error(
        "--grad-accum accumulates gradients in training, and this run trains "
        "nothing");
  if (o->eval_every == 0) return usage_error("--eval-every must be at least 1");
  if (o->eval_every > 0 && reads)
    return usage_error("--eval-every evaluates during training, and this run trains nothing");
  if (o->keep_best && !o->ckpt_dir)
    return usage_error("--keep-best needs --ckpt-dir (where the best checkpoint is kept)");
  if (o->keep_best && !reads && o->eval_every < 0)
    return usage_error("--keep-best needs --eval-every N (the evaluations it compares)");
  return 0;
}

/* --format names --export's layout. */
static int check_hf_options(const struct options *o) {
  if (strcmp(o->format, "pt") != 0 && strcmp(o->format, "hf") != 0)
    return usage_error("--format must be pt or hf, not '%s'", o->format);
  if (strcmp(o->format, "pt") != 0 && !o->export_path)
    return usage_error("--format %s is --export's layout: give --export FILE", o->format);
  return 0;
}

/* What the parser accepts but this build cannot do yet gets a clear refusal. */
/* --stages: each stage's ranks and strategy, the job's ranks stage after stage. */
#define MAX_STAGES 64
struct stage_spec {
  int n;
  int ranks[MAX_STAGES];
  enum rtp_strategy strategy[MAX_STAGES];
};

/* "G:STRATEGY,..." into *sp, or a usage error naming the part that is wrong. */
static int parse_stages(const char *spec, struct stage_spec *sp) {
  sp->n = 0;
  for (const char *c = spec; *c;) {
    char *end, name[16];
    long g = strtol(c, &end, 10);
    size_t len = *end == ':' ? strcspn(end + 1, ",") : 0;
    if (end == c || *end != ':' || g < 1 || g > RTP_MESH_MAX_RANKS || len == 0 ||
        len >= sizeof(name))
      return usage_error(
          "--stages '%s': each stage is RANKS:STRATEGY, e.g. 2:tp,3:ddp (at '%s')", spec, c);
    if (sp->n == MAX_STAGES) return usage_error("--stages: at most %d stages", MAX_STAGES);
    memcpy(name, end + 1, len);
    name[len] = '\0';
    enum rtp_strategy st;
    if (rtp_strategy_parse(name, &st) || (g > 1 && st == RTP_STRATEGY_NONE))
      return usage_error(
          "--stages '%s': stage %d's strategy '%s' (rtp, fsdp, ddp or tp; "
          "none on one rank)",
          spec, sp->n, name);
    sp->ranks[sp->n] = (int)g;
    sp->strategy[sp->n++] = st;
    c = end + 1 + len;
    if (*c == ',' && !*++c)
      return usage_error("--stages '%s': a stage after the last ','", spec);
  }
  if (sp->n < 2)
    return usage_error("--stages '%s': at least 2 stages (one stage: --strategy)", spec);
  return 0;
}

/* What --stages cannot run with, refused before any rank joins. */
static int check_stages(const struct options *o, int world) {
  struct stage_spec sp;
  int rc = parse_stages(o->stages, &sp), sum = 0;
  if (rc) return rc;
  if (o->pp != 1) return usage_error("--stages and --pp: one or the other");
  if (strcmp(o->schedule, "gpipe") != 0)
    return usage_error("--stages runs the gpipe schedule only, not --schedule %s", o->schedule);
  if (o->grad_accum > 1 || o->recompute)
    return usage_error("--stages: --grad-accum and --recompute are not supported yet");
  for (int s = 0; s < sp.n; s++) sum += sp.ranks[s];
  if (sum != world)
    return usage_error("--stages %s has %d ranks, the job %d", o->stages, sum, world);
  for (int s = 0; s < sp.n; s++) {
    if (sp.ranks[s] > 1 && sp.strategy[s] != RTP_STRATEGY_TP && o->micro_batches % sp.ranks[s])
      return usage_error(
          "--stages: stage %d's %d %s ranks share the --micro-batches %d units "
          "unevenly (a multiple of %d)",
          s, sp.ranks[s], rtp_strategy_name(sp.strategy[s]), o->micro_batches, sp.ranks[s]);
  }
  return 0;
}

/* The optimizer in backward updates once per backward, before any norm is known. */
static int check_in_backward(const struct options *o, int world) {
  if (o->grad_clip > 0 || o->grad_accum > 1 || o->micro_batches > 1 || o->pp > 1 || o->stages)
    return usage_error(
        "--adam-in-backward: not with --grad-clip, --grad-accum, --micro-batches, --pp or "
        "--stages (each needs the gradients kept until every one is complete)");
  if (world > 1 && strcmp(o->strategy, "rtp") && strcmp(o->strategy, "fsdp"))
    return usage_error("--adam-in-backward: --strategy rtp or fsdp, not %s", o->strategy);
  return RTP_OK;
}

static int check_options(const struct options *o) {
  static const char *const strategies[] = {"rtp", "ddp", "fsdp", "tp"};
  bool known = false;
  for (int i = 0; i < 4; i++) known |= strcmp(o->strategy, strategies[i]) == 0;
  if (!known)
    return usage_error("--strategy must be rtp, ddp, fsdp or tp, not '%s'", o->strategy);
  enum lr_kind kind;
  if (o->lr_schedule && !lr_kind_parse(o->lr_schedule, &kind))
    return usage_error("--lr-schedule must be constant, cosine or linear, not '%s'",
                       o->lr_schedule);
  if (o->max_steps == 0) return usage_error("--max-steps must be at least 1");
  if ((o->ckpt_every || o->resume) && !o->ckpt_dir)
    return usage_error("--ckpt-every and --resume need --ckpt-dir");
  int data_rc = check_data_options(o);
  if (data_rc) return data_rc;
  if (o->resume && o->init) return usage_error("--resume and --init both give the weights");
  int rc = check_weights(o);
  if (!rc) rc = check_eval(o);
  if (rc) return rc;
  if (o->ckpt_dir && !o->resume && !reads_checkpoint(o) && has_checkpoint(o->ckpt_dir))
    return usage_error("--ckpt-dir %s already has checkpoints: --resume continues from them",
                       o->ckpt_dir);
  struct rtp_comm_params p;
  if (rtp_comm_params_from_env(&p) != RTP_OK)
    return usage_error("bad rank environment: %s", rtp_last_error());
  if (o->batch < 1) return usage_error("--batch must be at least 1");
  if (o->threads == 0) return usage_error("--threads must be at least 1");
  if (o->pp < 1 || o->micro_batches < 1 || o->unit == 0)
    return usage_error("--pp, --micro-batches and --unit must be at least 1");
  if (o->grad_accum < 1) return usage_error("--grad-accum must be at least 1");
  if (o->batch % o->micro_batches)
    return usage_error(
        "--batch %d does not split into --micro-batches %d (B must be a "
        "multiple of M)",
        o->batch, o->micro_batches);
  enum rtp_schedule sched;
  if (rtp_schedule_parse(o->schedule, &sched))
    return usage_error("--schedule must be gpipe, 1f1b, eager-1f1b or zeropp, not '%s'",
                       o->schedule);
  if (o->unit > 0 && o->micro_batches % o->unit)
    return usage_error("--unit %d does not divide --micro-batches %d", o->unit,
                       o->micro_batches);
  if (o->stages && (rc = check_stages(o, p.world_size))) return rc;
  if (o->adam_in_backward && (rc = check_in_backward(o, p.world_size))) return rc;
  if (o->pp > 1 && strcmp(o->strategy, "tp") == 0)
    return usage_error(
        "--strategy tp does not run inside pipeline stages (--pp): use rtp, "
        "fsdp or ddp");
  if (p.world_size % o->pp)
    return usage_error(
        "--pp %d on %d ranks: the ranks must be S x D (%d is not a multiple "
        "of %d)",
        o->pp, p.world_size, p.world_size, o->pp);
  if (o->prompt && !*o->prompt) return usage_error("--prompt must not be empty");
  static const char *const devices[] = {"auto", "cpu", "cuda", "sim"};
  known = false;
  for (int i = 0; i < 4; i++) known |= strcmp(o->device, devices[i]) == 0;
  if (!known)
    return usage_error("--device must be auto, cpu, cuda or sim, not '%s'", o->device);
  return check_hf_options(o);
}

/* ---- errors --------------------------------------------------------------------------- */

/* Prints what failed with the library's message and passes the status on. */
static int fail(int status, const char *fmt, ...) RTP_PRINTF(2, 3);
static int fail(int status, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "train-gpt: ");
  vfprintf(stderr, fmt, ap);
  va_end(ap);
  const char *msg = rtp_last_error();
  fprintf(stderr, ": %s\n", *msg ? msg : rtp_strerror(status));
  return status;
}

/* ---- model configuration -------------------------------------------------------------- */

struct preset {
  const char *name;
  struct gpt_config cfg;
  float lr;
};

static const struct preset *find_preset(const char *name) {
  static struct preset presets[3];
  presets[0] = (struct preset){"tiny", {256, 32, 64, 2, 4, false, false}, 1e-3f};
  presets[1] = (struct preset){"small", gpt_config_small(), 3e-4f};
  presets[2] = (struct preset){"medium", gpt_config_medium(), 3e-4f};
  for (int i = 0; i < 3; i++)
    if (strcmp(presets[i].name, name) == 0) return &presets[i];
  return NULL;
}

static int meta_int(struct rtp_safetensors *st, const char *key, int *out) {
  const char *s = rtp_safetensors_meta(st, key);
  if (!s) return 0;
  char *end;
  long v = strtol(s, &end, 10);
  if (!*s || *end || v <= 0 || v > 1 << 20) return -1;
  *out = (int)v;
  return 1;
}

/* The sizes of an exported model, from its metadata; false if it has none. */
static bool config_from_file(struct rtp_safetensors *st, struct gpt_config *c) {
  struct gpt_config f = *c;
  int found = meta_int(st, "vocab", &f.vocab) + meta_int(st, "seq_len", &f.seq_len) +
              meta_int(st, "d_model", &f.d_model) + meta_int(st, "n_layer", &f.n_layer) +
              meta_int(st, "n_head", &f.n_head);
  if (found != 5) return false;
  const char *tie = rtp_safetensors_meta(st, "tie_embeddings");
  f.tie_embeddings = tie && strcmp(tie, "1") == 0;
  *c = f;
  return true;
}

static const char *const size_keys[] = {"vocab", "seq_len", "d_model", "n_layer", "n_head"};

/* The sizes train-gpt records in a checkpoint's state (ckpt_params), into c; a checkpoint of
 * an older train-gpt has none, and --config and the size flags must give them. */
static void config_from_ckpt(const struct rtp_ckpt *ck, struct gpt_config *c) {
  struct gpt_config f = *c;
  int *dst[] = {&f.vocab, &f.seq_len, &f.d_model, &f.n_layer, &f.n_head};
  for (int i = 0; i < 5; i++) {
    const char *s = rtp_ckpt_state(ck, size_keys[i]);
    char *end;
    long v = s ? strtol(s, &end, 10) : 0;
    if (!s || !*s || *end || v <= 0 || v > 1 << 20) return;
    *dst[i] = (int)v;
  }
  const char *tie = rtp_ckpt_state(ck, "tie_embeddings");
  f.tie_embeddings = tie && strcmp(tie, "1") == 0;
  *c = f;
}

/* A Hugging Face GPT-2 as --init: its sizes (its config.json's n_head, or --n-head); a
 * shorter --seq-len takes the first positions of its wpe. */
static int resolve_hf_config(const struct options *o, struct rtp_safetensors *init,
                             struct gpt_config *c) {
  if (o->config)
    return usage_error("--config %s: --init %s is a GPT-2, whose sizes are the file's",
                       o->config, o->init);
  int rc = gpt_hf_config(o->init, init, o->n_head, c);
  if (rc) {
    fprintf(stderr, "train-gpt: --init %s\n", gpt_hf_error());
    return rc == RTP_EINVAL ? EXIT_USAGE : rc;
  }
  if (o->seq_len > c->seq_len)
    return usage_error("--seq-len %d: --init %s has %d positions (n_positions)", o->seq_len,
                       o->init, c->seq_len);
  if (o->tie_embeddings && !c->tie_embeddings)
    return usage_error("--tie-embeddings: --init %s has a head of its own (lm_head.weight)",
                       o->init);
  return 0;
}

/* --config (or the sizes of --init or of the checkpoint read), then the size flags on top. */
static int resolve_config(struct options *o, struct rtp_safetensors *init,
                          const struct rtp_ckpt *ck, struct gpt_config *c) {
  const struct preset *p = find_preset(o->config ? o->config : "small");
  if (!p) return usage_error("--config must be tiny, small or medium, not '%s'", o->config);
  *c = p->cfg;
  if (init && gpt_hf_detect(init)) {
    int rc = resolve_hf_config(o, init, c);
    if (rc) return rc;
  } else if (!o->config && init) {
    config_from_file(init, c);
  }
  if (!o->config && ck) config_from_ckpt(ck, c);
  if (o->tie_embeddings) c->tie_embeddings = true;
  if (strcmp(o->fused_attn, "on") && strcmp(o->fused_attn, "off"))
    return usage_error("--fused-attn must be on or off, not '%s'", o->fused_attn);
  c->fused_attention = !strcmp(o->fused_attn, "on");
  if (o->lr < 0) o->lr = p->lr;
  if (o->n_layer >= 0) c->n_layer = o->n_layer;
  if (o->d_model >= 0) c->d_model = o->d_model;
  if (o->n_head >= 0) c->n_head = o->n_head;
  if (o->seq_len >= 0) c->seq_len = o->seq_len;
  if (c->n_layer < 1 || c->n_layer > GPT_MAX_LAYERS)
    return usage_error("--n-layer must be 1..%d, not %d", GPT_MAX_LAYERS, c->n_layer);
  if (c->d_model < 1 || c->d_model > GPT_MAX_SIZE)
    return usage_error("--d-model must be 1..%d, not %d", GPT_MAX_SIZE, c->d_model);
  if (c->n_head < 1) return usage_error("--n-head must be at least 1, not %d", c->n_head);
  if (c->d_model % c->n_head)
    return usage_error("--n-head (%d) must divide --d-model (%d)", c->n_head, c->d_model);
  if (c->seq_len < 2 || c->seq_len > GPT_MAX_SIZE)
    return usage_error("--seq-len must be 2..%d, not %d", GPT_MAX_SIZE, c->seq_len);
  if ((int64_t)o->batch * c->seq_len > INT_MAX) /* a batch's tokens are indexed by int */
    return usage_error("--batch %d x --seq-len %d is more than %d tokens", o->batch, c->seq_len,
                       INT_MAX);
  return 0;
}

/* ---- data ----------------------------------------------------------------------------- */

/* Training windows lie in train, evaluation windows in held: the last tenth of --data's
 * tokens (all of them with --eval-only), or all of --val-data's. */
struct dataset {
  void *file, *val_file; /* what was read (owned): --data (or the task) and --val-data */
  struct token_span train, held;
  bool builtin; /* the addition task: held-out lines are sums with one right answer */
};

static uint64_t mix64(uint64_t z) { /* splitmix64's finaliser */
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

#define TASK_LINES 20000
#define TASK_MAX_LINE 16

/*
 * The built-in task: lines "a+b=c\n" with a, b < 1000 written with three digits and c with
 * four ("042+917=0959"). Predicting c needs each digit of a, b and the carries from the
 * digits to its right: attention over the line, not n-grams.
 * Held-out sums are a fixed hash class of (a, b), so none of them is ever trained on;
 * they follow the training lines and make up the last tenth of the bytes.
 */
static int make_addition_task(struct dataset *d) {
  size_t cap = (size_t)TASK_LINES * TASK_MAX_LINE;
  char *train = malloc(cap), *held = malloc(cap);
  if (!train || !held) {
    free(train);
    free(held);
    fprintf(stderr, "train-gpt: out of memory for the built-in task\n");
    return RTP_ENOMEM;
  }
  size_t nt = 0, nh = 0;
  uint64_t s = 0xadd; /* fixed, so every run and every --eval-only sees the same task */
  for (int lines = 0; lines < TASK_LINES;) {
    s = mix64(s);
    int a = (int)(s % 1000), b = (int)((s >> 32) % 1000);
    bool is_held = mix64(((uint64_t)a << 32) | (uint64_t)b) % 10 == 0;
    if (is_held && nh >= nt / 9) continue; /* keep the held-out part at a tenth */
    char *dst = is_held ? held + nh : train + nt;
    int len = snprintf(dst, TASK_MAX_LINE, "%03d+%03d=%04d\n", a, b, a + b);
    *(is_held ? &nh : &nt) += (size_t)len;
    lines++;
  }
  memcpy(train + nt, held, nh);
  free(held);
  struct token_span all = {(const uint8_t *)train, nt + nh, 1, 256, "bytes"};
  *d = (struct dataset){train, NULL, token_span_slice(all, 0, nt),
                        token_span_slice(all, nt, nh), true};
  return RTP_OK;
}

/* A file of --data's formats (token-data.h), its tokens checked against the vocabulary. A
 * FIFO or a device is refused before it is read. *buf: what was read, to free. */
static int load_tokens(const char *flag, const char *path, const struct options *o, void **buf,
                       struct token_span *s) {
  size_t n;
  int rc = rtp_file_read(path, SIZE_MAX, buf, &n);
  if (rc) return fail(rc, "%s %s", flag, path);
  enum token_format f = TOKEN_AUTO;
  token_format_parse(o->data_format, &f); /* checked by check_data_options */
  char why[256];
  if (token_span_parse(*buf, n, f, o->vocab > 0 ? o->vocab : 0, s, why, sizeof(why))) {
    fprintf(stderr, "train-gpt: %s %s: %s\n", flag, path, why);
    return RTP_EFORMAT;
  }
  size_t len = strlen(path);
  if (!o->data_format && s->width == 1 && len > 4 && strcmp(path + len - 4, ".bin") == 0)
    fprintf(stderr,
            "train-gpt: warning: %s %s has no llm.c header and is read as bytes; nanoGPT's "
            "uint16 tokens need --vocab N (--data-format bytes says bytes are meant)\n",
            flag, path);
  return RTP_OK;
}

/* --data, and --val-data if given: both bytes, or both tokens of one vocabulary (in any
 * of the token formats). */
static int load_data_files(const struct options *o, struct dataset *d) {
  struct token_span all;
  int rc = load_tokens("--data", o->data, o, &d->file, &all);
  if (rc) return rc;
  if (!o->val_data) {
    size_t split = o->eval_only ? 0 : all.n - all.n / 10;
    d->train = token_span_slice(all, 0, split);
    d->held = token_span_slice(all, split, all.n - split);
    return RTP_OK;
  }
  d->train = all;
  rc = load_tokens("--val-data", o->val_data, o, &d->val_file, &d->held);
  if (rc) return rc;
  bool bytes = strcmp(all.kind, "bytes") == 0, val_bytes = strcmp(d->held.kind, "bytes") == 0;
  if (bytes != val_bytes || all.vocab != d->held.vocab) {
    fprintf(stderr,
            "train-gpt: --val-data %s holds %s (vocabulary %d), --data %s %s (vocabulary %d): "
            "they must be the same tokens\n",
            o->val_data, d->held.kind, d->held.vocab, o->data, all.kind, all.vocab);
    rc = RTP_EINVAL;
  }
  return rc;
}

static int check_data(const struct dataset *d, int T, const struct options *o) {
  size_t need = (size_t)T + 1;
  const char *what = d->builtin ? "the built-in task" : o->data;
  const char *units = d->train.width == 1 ? "bytes" : "tokens";
  if (!o->eval_only && d->train.n < need) {
    fprintf(
        stderr,
        "train-gpt: %s has %zu %s for training: too few for --seq-len %d (at least %zu%s)\n",
        what, d->train.n, units, T, need, o->val_data ? "" : " before the held-out tenth");
    return RTP_EINVAL;
  }
  if (d->held.n < need) {
    fprintf(
        stderr,
        "train-gpt: %s %s has %zu %s to evaluate: too few for --seq-len %d (at least %zu)\n",
        o->val_data    ? "--val-data"
        : o->eval_only ? "--data"
                       : "the held-out tenth of",
        o->val_data ? o->val_data : what, d->held.n, units, T, need);
    return RTP_EINVAL;
  }
  return RTP_OK;
}

/*
 * The global batch of a step is K x ranks x B windows of T + 1 bytes from the training
 * part; window j starts at an offset drawn from (seed, step, j) alone. In the step's
 * compute k (--grad-accum), data-parallel rank r takes windows first = (k*N + r)*B ..
 * first + B - 1 (window_first), row b of them in micro-batch b / (B/M), so N ranks with
 * batch B and K computes see exactly the data of one process with batch K*N*B, however each
 * splits its B. idx[k] gets the first T bytes of micro-batch k's windows, tgt[k] the last T
 * (either NULL on a pipeline stage that does not read it).
 */
static void sample_batch(const struct dataset *d, uint64_t seed, int64_t step, uint64_t first,
                         int B, int M, int T, int32_t *const *idx, int32_t *const *tgt) {
  uint64_t starts = d->train.n - (size_t)T; /* window starts that fit */
  int mb = B / M;
  for (int b = 0; b < B; b++) {
    uint64_t j = first + (uint64_t)b;
    uint64_t h = mix64(mix64(seed) ^ mix64(((uint64_t)step << 20) ^ j));
    size_t w = (size_t)(h % starts);
    int k = b / mb, row = b % mb;
    for (int t = 0; t < T; t++) {
      if (idx[k]) idx[k][row * T + t] = token_at(&d->train, w + (size_t)t);
      if (tgt[k]) tgt[k][row * T + t] = token_at(&d->train, w + (size_t)t + 1);
    }
  }
}

/* ---- the model and its graphs ---------------------------------------------------------- */

struct trainer {
  const struct device *dev; /* where ctx's data lives and the kernels run */
  struct rtp_context *meta; /* the one-device model: no_alloc, parameters hold no data */
  struct rtp_context *ctx;  /* this rank's parameters, states, graphs and activations */
  struct rtp_threadpool *tp;
  struct rtp_comm *comm; /* the job; NULL for one process */
  /* With --pp: this rank's stage group (the strategy's ranks; NULL if one) and its pipe
   * group (one rank of each stage). Without, group is comm and pipe NULL. */
  struct rtp_comm *group, *pipe;
  struct rtp_parallel *par;
  struct gpt m; /* the one-device model (in meta) for one micro-batch: sizes and names */
  /* Per micro-batch, this rank's inputs (NULL on a stage that does not read them), and the
   * host buffers they are filled from. */
  struct rtp_tensor **idx_t, **tgt_t;
  int32_t **idx, **targets;
  float *logits_row;              /* one position's logits, read from tr->logits */
  struct rtp_tensor *in, *logits; /* micro-batch 0's, which evaluation uses; or NULL */
  int32_t *eval_idx, *eval_tgt;   /* evaluation's inputs, on every rank */
  struct rtp_tensor *loss;        /* the mean over the global batch */
  struct rtp_graph *train; /* forward, backward, transfers; not planned with --eval-only */
  struct rtp_graph *eval;  /* micro-batch 0's forward to the logits alone */
  struct rtp_optimizer *opt;
  enum rtp_strategy strategy; /* inside a stage with --pp */
  int world, rank;
  int stages, per_stage; /* S and D: rank = stage x D + data-parallel rank */
  /* --stages (het.n > 0): stage `stage` of het.ranks[stage] ranks (per_stage); the
   * global batch is --micro-batches units of unit_seqs sequences */
  struct stage_spec het;
  int stage, unit_seqs;
  int batch, micro; /* B sequences per data-parallel rank and compute, in M micro-batches */
  int accum;        /* K computes (batches of B) per optimizer step */
  int head;         /* the rank whose logits evaluation reads: the last stage's first */
  int64_t saved;    /* the step of the last checkpoint saved or resumed from; -1: none */
  double best_loss; /* --keep-best: the lowest eval loss checkpointed (INFINITY: none) */
};

/* The ranks that draw different data: under tp every rank trains on the same batch. */
static int data_ranks(const struct trainer *tr) {
  return tr->strategy == RTP_STRATEGY_TP || tr->het.n ? 1 : tr->per_stage;
}

static int data_rank(const struct trainer *tr) {
  return tr->strategy == RTP_STRATEGY_TP || tr->het.n ? 0 : tr->rank % tr->per_stage;
}

/* The sequences of an optimizer step: K computes of the data ranks' B each. */
static int64_t global_batch(const struct trainer *tr) {
  return (int64_t)tr->accum * data_ranks(tr) * tr->batch;
}

/* rtp and fsdp turn each op on a parameter into a few nodes per rank, forward and back
 * (rtp on 4 ranks: about 2.3 times the one-device graph), for each micro-batch, twice over
 * with recomputation. */
static int64_t parallel_graph_size(struct gpt_config c, int world, const struct options *o) {
  return (int64_t)gpt_graph_size(c) * (1 + world) * o->micro_batches * (o->recompute ? 2 : 1);
}

/* The rank's tensor data (gpt_arena_size) and its graphs with their tensor headers, which
 * on a device live in two arenas, and on the CPU in one. Summed in double (exact below
 * 2^53 bytes): SIZE_MAX if past 64 bits. */
static double data_bytes(struct gpt_config c, const struct options *o) {
  return (double)gpt_arena_size(c, o->batch) +
         (o->bf16 ? gpt_bf16_scratch_size(c, o->batch) : 0);
}

static double graph_bytes(struct gpt_config c, int world, const struct options *o) {
  return (double)parallel_graph_size(c, world, o) * 1024 + (1u << 20);
}

static size_t arena_size(struct gpt_config c, int world, const struct options *o) {
  double bytes = data_bytes(c, o) + graph_bytes(c, world, o);
  return bytes < 0x1p63 ? (size_t)bytes : SIZE_MAX;
}

static struct rtp_init_params context_params(const struct device *dev, struct gpt_config c,
                                             int world, const struct options *o) {
  if (!dev->b) return (struct rtp_init_params){.mem_size = arena_size(c, world, o)};
  return (struct rtp_init_params){.mem_size = (size_t)graph_bytes(c, world, o),
                                  .backend = dev->b,
                                  .data_size = (size_t)data_bytes(c, o)};
}

/* Sizes whose counts overflow (the graph's nodes are an int, the arena's bytes 64 bits)
 * are refused before anything is allocated: no machine would hold them anyway. */
static int check_sizes(struct gpt_config c, int world, const struct options *o) {
  int64_t nodes = parallel_graph_size(c, world, o);
  if (nodes > INT_MAX)
    return usage_error("--micro-batches %d on %d ranks: %" PRId64 " graph nodes, more than %d",
                       o->micro_batches, world, nodes, INT_MAX);
  if (arena_size(c, world, o) == SIZE_MAX)
    return usage_error(
        "--d-model %d, --seq-len %d and --batch %d need more memory than 64 bits count",
        c.d_model, c.seq_len, o->batch);
  return RTP_OK;
}

/* The ranks on this host (rtp-run's RTP_LOCAL_WORLD_SIZE; 1 without it). */
static long local_ranks(void) {
  const char *env = getenv("RTP_LOCAL_WORLD_SIZE");
  long ranks = env ? strtol(env, NULL, 10) : 1;
  return ranks > 1 ? ranks : 1;
}

/* Threads per rank: by default the cores shared among the ranks on this host. */
static int thread_count(const struct options *o) {
  if (o->threads > 0) return o->threads;
  long ranks = local_ranks();
  if (ranks == 1) return 0; /* all cores */
  long cores = sysconf(_SC_NPROCESSORS_ONLN);
  return cores > ranks ? (int)(cores / ranks) : 1;
}

/* More threads than cores are allowed, but every kernel splits its work evenly between
 * the threads, so each step waits for those the cores cannot run at once. Said once per
 * host, by its first rank. */
static void warn_threads(const struct options *o) {
  const char *local = getenv("RTP_LOCAL_RANK");
  long cores = sysconf(_SC_NPROCESSORS_ONLN), ranks = local_ranks();
  if (o->threads < 1 || cores < 1 || (long)o->threads * ranks <= cores ||
      (local && strcmp(local, "0") != 0))
    return;
  if (ranks == 1)
    fprintf(stderr,
            "train-gpt: warning: --threads %d is more than the %ld cores: the threads will "
            "wait for each other\n",
            o->threads, cores);
  else
    fprintf(stderr,
            "train-gpt: warning: --threads %d for each of %ld ranks on this host is more "
            "than its %ld cores: the threads will wait for each other\n",
            o->threads, ranks, cores);
}

/* Joins the job when the environment names more than one rank (rtp-run, Slurm, MPI);
 * with --pp, as a mesh of S stages x D ranks (check_options saw that S divides the ranks). */
static int join_job(struct trainer *tr, const struct options *o) {
  struct rtp_comm_params p;
  int rc = rtp_comm_params_from_env(&p);
  if (rc) return fail(rc, "the rank environment");
  tr->world = p.world_size;
  tr->rank = p.rank;
  tr->stages = o->pp;
  tr->per_stage = p.world_size / o->pp;
  tr->head = (tr->stages - 1) * tr->per_stage;
  if (o->stages) { /* check_options parsed it */
    parse_stages(o->stages, &tr->het);
    tr->stages = tr->het.n;
    for (int s = 0, first = 0; s < tr->het.n; first += tr->het.ranks[s++]) {
      if (p.rank >= first && p.rank < first + tr->het.ranks[s]) tr->stage = s;
      tr->head = first; /* ends as the last stage's first */
    }
    tr->per_stage = tr->het.ranks[tr->stage];
  }
  if (p.world_size == 1) return RTP_OK;
  device_choose_transport(tr->dev, local_ranks(), &p);
  rc = rtp_comm_init(&p, &tr->comm);
  if (rc) return fail(rc, "rank %d of %d: joining the job", p.rank, p.world_size);
  if (o->stages) { /* the stage groups; the job carries what crosses stages */
    struct rtp_comm *grp;
    rc = rtp_comm_split(tr->comm, tr->stage, tr->rank, &grp);
    if (rc) return fail(rc, "--stages %s: the stage groups", o->stages);
    if (tr->per_stage > 1)
      tr->group = grp;
    else
      rtp_comm_free(grp);
    return RTP_OK;
  }
  if (o->pp == 1) {
    tr->group = tr->comm;
    return RTP_OK;
  }
  struct rtp_comm *row;
  rc = rtp_comm_mesh_2d(tr->comm, tr->stages, tr->per_stage, &row, &tr->pipe);
  if (rc) return fail(rc, "--pp %d: the stage and pipe groups", o->pp);
  if (tr->per_stage > 1)
    tr->group = row;
  else
    rtp_comm_free(row);
  return RTP_OK;
}

/* What the layout asks that the model cannot give gets a one-line refusal on every rank. */
static int check_layout(const struct trainer *tr, struct gpt_config c) {
  int tp_ranks = tr->het.n ? tr->per_stage : tr->world;
  if (tr->strategy == RTP_STRATEGY_TP && c.n_head % tp_ranks) {
    fprintf(stderr,
            "train-gpt: --strategy tp on %d ranks: the %d heads must split evenly between "
            "them (--n-head a multiple of %d)\n",
            tp_ranks, c.n_head, tp_ranks);
    return EXIT_USAGE;
  }
  char stages[32]; /* as the user asked for them */
  snprintf(stages, sizeof(stages), tr->het.n ? "%d --stages" : "--pp %d", tr->stages);
  /* Tied, wte would be on the first stage (the embedding) and on the last (the head), its
   * two gradients summed across them: not done (the library refuses a parameter read on
   * two stages). */
  if (tr->stages > 1 && c.tie_embeddings) {
    fprintf(stderr,
            "train-gpt: tied embeddings (--tie-embeddings, or a GPT-2 --init) with %s: "
            "the embedding is on the first stage and the head on the last, and a tied weight "
            "cannot be split across stages (use --pp 1)\n",
            stages);
    return EXIT_USAGE;
  }
  if (tr->stages > c.n_layer) {
    fprintf(stderr, "train-gpt: %s with %d blocks (--n-layer): at most one stage per block\n",
            stages, c.n_layer);
    return EXIT_USAGE;
  }
  return RTP_OK;
}

/* zeropp's unit: --unit, or the largest divisor of M up to S (a unit as long as the
 * pipeline, so its gathers are shared by every micro-batch in flight). */
static int unit_size(const struct options *o) {
  int u = o->unit > 0 ? o->unit : o->pp < o->micro_batches ? o->pp : o->micro_batches;
  while (o->micro_batches % u) u--;
  return u;
}

static struct rtp_parallel_params parallel_params(const struct trainer *tr, struct gpt_config c,
                                                  const struct options *o) {
  /* --bf16: every strategy's products take bf16 operands; rtp's blocks travel as bf16 too
   * (its products would round them anyway), while the others' all-reduces and gathers
   * stay f32. */
  bool bf16_rotation = o->bf16 && tr->strategy == RTP_STRATEGY_RTP;
  for (int s = 0; s < tr->het.n; s++) /* --stages: the same on every rank, or none */
    bf16_rotation &= tr->het.ranks[s] == 1 || tr->het.strategy[s] == RTP_STRATEGY_RTP;
  struct rtp_parallel_params pp = {.strategy = tr->group ? tr->strategy : RTP_STRATEGY_NONE,
                                   .comm = tr->group,
                                   .graph_size = (int)parallel_graph_size(c, tr->world, o),
                                   .comm_type = bf16_rotation ? RTP_TYPE_BF16 : RTP_TYPE_F32,
                                   .compute_type = o->bf16 ? RTP_TYPE_BF16 : RTP_TYPE_F32,
                                   .micro_batches = o->micro_batches,
                                   .accumulate = o->grad_accum,
                                   .pipe_comm = tr->pipe,
                                   .unit = unit_size(o),
                                   .recompute = o->recompute,
                                   .optimizer_in_backward = o->adam_in_backward,
                                   .stages = tr->het.n,
                                   .stage_ranks = tr->het.ranks,
                                   .stage_strategies = tr->het.strategy};
  if (tr->het.n) pp.pipe_comm = tr->comm;        /* the job: ranks stage after stage */
  rtp_schedule_parse(o->schedule, &pp.schedule); /* checked by check_options */
  return pp;
}

/* Micro-batch k's inputs, where this rank's stage reads them, with host buffers to fill
 * them from (the tensors may be in device memory). */
static int find_inputs(struct trainer *tr) {
  size_t n = (size_t)tr->m.batch * (size_t)tr->m.cfg.seq_len, m = (size_t)tr->micro;
  tr->idx_t = calloc(m, sizeof(*tr->idx_t));
  tr->tgt_t = calloc(m, sizeof(*tr->tgt_t));
  tr->idx = calloc(m, sizeof(*tr->idx));
  tr->targets = calloc(m, sizeof(*tr->targets));
  tr->eval_idx = calloc(n, sizeof(int32_t));
  tr->eval_tgt = calloc(n, sizeof(int32_t));
  tr->logits_row = calloc((size_t)tr->m.cfg.vocab, sizeof(float));
  bool ok = tr->idx_t && tr->tgt_t && tr->idx && tr->targets && tr->eval_idx && tr->eval_tgt &&
            tr->logits_row;
  for (int k = 0; k < tr->micro && ok; k++) {
    tr->idx_t[k] = rtp_parallel_micro_tensor(tr->par, tr->m.idx, k);
    tr->tgt_t[k] = rtp_parallel_micro_tensor(tr->par, tr->m.targets, k);
    if (tr->idx_t[k]) ok = (tr->idx[k] = malloc(rtp_tensor_nbytes(tr->idx_t[k])));
    if (tr->tgt_t[k] && ok) ok = (tr->targets[k] = malloc(rtp_tensor_nbytes(tr->tgt_t[k])));
  }
  if (!ok) return fail(RTP_ENOMEM, "the inputs");
  tr->in = rtp_parallel_tensor(tr->par, tr->m.idx);
  tr->logits = rtp_parallel_tensor(tr->par, tr->m.logits);
  return RTP_OK;
}

/* The batch sample_batch wrote, into the graph's inputs. */
static int upload_batch(struct trainer *tr) {
  int rc = RTP_OK;
  for (int k = 0; k < tr->micro && !rc; k++) {
    if (tr->idx_t[k])
      rc = rtp_tensor_set(tr->idx_t[k], tr->idx[k], 0, rtp_tensor_nbytes(tr->idx_t[k]));
    if (tr->tgt_t[k] && !rc)
      rc = rtp_tensor_set(tr->tgt_t[k], tr->targets[k], 0, rtp_tensor_nbytes(tr->tgt_t[k]));
  }
  return rc;
}

/* The vocab logits of row b at position t (micro-batch 0's, on tr->head), in host memory. */
static const float *logits_at(struct trainer *tr, int b, int t) {
  size_t V = (size_t)tr->m.cfg.vocab;
  size_t first = ((size_t)b * (size_t)tr->m.cfg.seq_len + (size_t)t) * V * sizeof(float);
  if (rtp_tensor_get(tr->logits, tr->logits_row, first, V * sizeof(float))) return NULL;
  return tr->logits_row;
}

/* The model once, as for one device and one micro-batch, then this rank's training graph
 * for the strategy (inside its stage with --pp). */
static int parallelize(struct trainer *tr, struct gpt_config c, const struct options *o) {
  size_t meta_bytes = (size_t)gpt_graph_size(c) * 2048 + (8u << 20);
  int rc = check_sizes(c, tr->world, o);
  if (rc) return rc;
  tr->batch = o->batch;
  tr->micro = o->micro_batches;
  tr->accum = o->grad_accum;
  tr->meta =
      rtp_context_new((struct rtp_init_params){.mem_size = meta_bytes, .no_alloc = true});
  tr->ctx = rtp_context_new(context_params(tr->dev, c, tr->world, o));
  if (!tr->meta || !tr->ctx)
    return fail(RTP_ENOMEM, "creating the arena%s%s", tr->dev->b ? " on " : "",
                tr->dev->b ? tr->dev->name : "");
  struct rtp_graph *fwd = rtp_graph_new(tr->meta, gpt_graph_size(c));
  if (!fwd || gpt_build(tr->meta, &tr->m, c, o->batch / o->micro_batches) ||
      rtp_graph_build(fwd, tr->m.loss))
    return fail(RTP_EINVAL, "building the model");
  tr->strategy = RTP_STRATEGY_NONE; /* one process: every strategy is this one */
  if (tr->het.n && tr->per_stage > 1)
    tr->strategy = tr->het.strategy[tr->stage];
  else if (tr->world > 1 && !tr->het.n && rtp_strategy_parse(o->strategy, &tr->strategy))
    return fail(RTP_EINVAL, "--strategy");
  rc = check_layout(tr, c);
  if (rc) return rc;
  struct rtp_parallel_params pp = parallel_params(tr, c, o);
  tr->par = rtp_parallel_new(tr->ctx, fwd, tr->m.loss, &pp);
  rc = tr->par ? RTP_OK : rtp_context_error(tr->ctx, NULL);
  if (rc == RTP_ENOSYS) {
    fprintf(stderr, "train-gpt: --strategy %s on %d ranks%s on %s is not yet supported: %s\n",
            o->strategy, tr->world, o->pp > 1 ? " with --pp" : "", tr->dev->name,
            rtp_last_error());
    return EXIT_USAGE;
  }
  if (!tr->par)
    return fail(rc ? rc : RTP_EINVAL, "--strategy %s on %d ranks", o->strategy, tr->world);
  tr->loss = rtp_parallel_tensor(tr->par, tr->m.loss);
  tr->train = rtp_parallel_graph(tr->par);
  tr->micro = rtp_parallel_micro_batches(tr->par); /* --stages: this stage's share */
  tr->unit_seqs = o->batch / o->micro_batches;
  return find_inputs(tr);
}

/*
 * Evaluation reuses the training graph's forward nodes instead of building a second model:
 * the eval graph is micro-batch 0's forward up to the logits (rtp_parallel_forward_graph:
 * the training graph's nodes in its order, transfers included), already placed by the
 * training plan, so planning it adds no activation memory and computing it runs the
 * forward alone. The cost is that evaluation uses the micro-batch's shape. On a pipeline
 * the last stage's first rank (tr->head) has the logits; what it finds is broadcast. With
 * --eval-only the training graph is never planned: the eval plan places the forward alone.
 */
static int build_graphs(struct trainer *tr, bool train) {
  if (train && rtp_graph_plan(tr->ctx, tr->train))
    return fail(RTP_EINVAL, "planning the training graph");
  tr->eval = rtp_parallel_forward_graph(tr->par, tr->m.logits);
  if (!tr->eval || rtp_graph_plan(tr->ctx, tr->eval))
    return fail(RTP_EINVAL, "building the evaluation graph");
  return RTP_OK;
}

/* train: plan the training graph and make the optimizer (not for --eval-only or a
 * checkpoint read). */
static int trainer_init(struct trainer *tr, const struct device *dev, struct gpt_config c,
                        const struct options *o, bool train) {
  *tr = (struct trainer){.dev = dev,
                         .world = 1,
                         .rank = 0,
                         .stages = 1,
                         .per_stage = 1,
                         .saved = -1,
                         .best_loss = INFINITY};
  int rc = join_job(tr, o);
  if (!rc) rc = parallelize(tr, c, o);
  if (!rc) rc = build_graphs(tr, train);
  if (rc) return rc;
  tr->tp = rtp_threadpool_new(thread_count(o));
  if (!tr->tp) return fail(RTP_ENOMEM, "starting %d threads", thread_count(o));
  if (o->threads > 0 && rtp_threadpool_size(tr->tp) != o->threads)
    return usage_error("--threads %d: the library runs at most %d", o->threads,
                       rtp_threadpool_size(tr->tp));
  warn_threads(o);
  if (!train) return RTP_OK;
  struct rtp_adamw_params hp = rtp_adamw_params_default();
  hp.lr = o->lr;
  hp.weight_decay = o->weight_decay;
  hp.clip_norm = o->grad_clip;
  tr->opt = rtp_parallel_optimizer(tr->par, hp);
  rc = tr->opt ? RTP_OK : rtp_context_error(tr->ctx, NULL);
  return tr->opt ? RTP_OK : fail(rc ? rc : RTP_ENOMEM, "creating the optimizer");
}

static void trainer_free(struct trainer *tr) {
  rtp_threadpool_free(tr->tp);
  rtp_context_free(tr->ctx);
  rtp_context_free(tr->meta);
  for (int k = 0; k < tr->micro && tr->idx && tr->targets; k++) {
    free(tr->idx[k]);
    free(tr->targets[k]);
  }
  free(tr->idx_t);
  free(tr->tgt_t);
  free(tr->logits_row);
  free(tr->idx);
  free(tr->targets);
  free(tr->eval_idx);
  free(tr->eval_tgt);
  if (tr->group != tr->comm) rtp_comm_free(tr->group);
  rtp_comm_free(tr->pipe);
  rtp_comm_free(tr->comm);
}

/* The rows of parameter i this rank holds ([first, first + len) of the outermost
 * dimension, one contiguous run) and the elements in one row. */
static void param_block(const struct trainer *tr, int i, int64_t *first, int64_t *row) {
  const struct rtp_tensor *p = tr->m.params[i];
  int64_t len;
  int dim;
  rtp_parallel_block(tr->par, p, first, &len, &dim);
  *row = rtp_tensor_nelements(p) / p->ne[dim];
}

static size_t largest_param_bytes(const struct gpt *m) {
  size_t n = 0;
  for (int i = 0; i < m->n_params; i++)
    if ((size_t)rtp_tensor_nelements(m->params[i]) > n)
      n = (size_t)rtp_tensor_nelements(m->params[i]);
  return n * sizeof(float);
}

/* Host room for a whole parameter (full) and then for this rank's part of it. */
static float *param_buffers(const struct gpt *m, float **part) {
  size_t n = largest_param_bytes(m) / sizeof(float);
  float *full = malloc(2 * n * sizeof(float));
  *part = full ? full + n : NULL;
  return full;
}

/* This rank's part of parameter p, out of all of its values in full, into its tensor,
 * which may be in device memory, through part. */
static int put_param(struct trainer *tr, const struct rtp_tensor *p, const float *full,
                     float *part) {
  struct rtp_tensor *mine = rtp_parallel_tensor(tr->par, p);
  int rc = rtp_parallel_shard_copy(tr->par, p, full, part);
  return rc ? rc : rtp_tensor_set(mine, part, 0, rtp_tensor_nbytes(mine));
}

/* Every rank computes each whole parameter of its stage from its own stream and keeps its
 * part (a block of rows, or tp's pieces), so every layout starts from the same model. */
static int init_weights(struct trainer *tr, uint64_t seed) {
  float *part, *full = param_buffers(&tr->m, &part);
  if (!full) return fail(RTP_ENOMEM, "initialising the weights");
  int rc = RTP_OK;
  for (int i = 0; i < tr->m.n_params && !rc; i++) {
    if (!rtp_parallel_tensor(tr->par, tr->m.params[i])) continue; /* another stage's */
    gpt_init_tensor(&tr->m, i, seed, full);
    rc = put_param(tr, tr->m.params[i], full, part);
  }
  free(full);
  return rc ? fail(rc, "initialising the weights") : RTP_OK;
}

/* The first window of this rank's batch in the step's compute k (sample_batch). */
static uint64_t window_first(const struct trainer *tr, int k) {
  return ((uint64_t)k * (uint64_t)data_ranks(tr) + (uint64_t)data_rank(tr)) *
         (uint64_t)tr->batch;
}

/* The step's K computes (--grad-accum), each on the next batch of the global one, adding
 * to the gradients (rtp_parallel_params.accumulate); *loss is the mean of their global
 * means, each over as many windows. */
static int accumulate_step(struct trainer *tr, const struct dataset *d, uint64_t seed,
                           int64_t step, float *loss) {
  int rc = rtp_parallel_zero_grads(tr->par);
  double sum = 0;
  for (int k = 0; k < tr->accum && !rc; k++) {
    if (tr->het.n) /* each micro-batch is a unit of the global batch */
      for (int m = 0; m < tr->micro; m++)
        sample_batch(d, seed, step,
                     (uint64_t)rtp_parallel_micro_unit(tr->par, m) * (uint64_t)tr->unit_seqs,
                     tr->unit_seqs, 1, tr->m.cfg.seq_len, &tr->idx[m], &tr->targets[m]);
    else
      sample_batch(d, seed, step, window_first(tr, k), tr->batch, tr->micro, tr->m.cfg.seq_len,
                   tr->idx, tr->targets);
    float l = 0;
    rc = upload_batch(tr);
    if (!rc) rc = rtp_graph_compute(tr->train, tr->tp);
    if (!rc) rc = rtp_tensor_get_f32(tr->loss, 0, &l);
    sum += l;
  }
  if (!rc) rc = rtp_parallel_sync(tr->par, tr->tp);
  *loss = (float)(sum / tr->accum);
  return rc ? fail(rc, "step %" PRId64 ": forward and backward", step + 1) : RTP_OK;
}

/* One optimizer step on this rank's share of the global batch (tp: all of it); *loss is
 * the global mean. */
static int train_step(struct trainer *tr, const struct dataset *d, uint64_t seed, int64_t step,
                      float lr, float *loss) {
  /* before the compute, which runs the updates with --adam-in-backward */
  int rc = rtp_optimizer_set_lr(tr->opt, lr);
  if (rc) return fail(rc, "step %" PRId64 ": setting the learning rate", step + 1);
  if ((rc = accumulate_step(tr, d, seed, step, loss))) return rc;
  rc = rtp_optimizer_step(tr->opt, tr->tp);
  return rc ? fail(rc, "step %" PRId64 ": optimizer", step + 1) : RTP_OK;
}

/* ---- evaluation ------------------------------------------------------------------------ */

/* Sum over the T positions of row b of -log softmax(logits)[target]. */
static int row_loss(struct trainer *tr, int b, double *sum) {
  int V = tr->m.cfg.vocab, T = tr->m.cfg.seq_len;
  const int32_t *tgt = tr->eval_tgt;
  for (int t = 0; t < T; t++) {
    const float *l = logits_at(tr, b, t);
    if (!l) return RTP_EINVAL;
    float mx = l[0];
    for (int v = 1; v < V; v++) mx = l[v] > mx ? l[v] : mx;
    double z = 0;
    for (int v = 0; v < V; v++) z += exp((double)l[v] - mx);
    *sum += log(z) + mx - l[tgt[b * T + t]];
  }
  return RTP_OK;
}

/* Fills row b of the inputs with the window of T + 1 tokens of s at w (zeros if s is
 * NULL). */
static void set_window(struct trainer *tr, int b, const struct token_span *s, size_t w) {
  int T = tr->m.cfg.seq_len;
  int32_t *idx = tr->eval_idx, *tgt = tr->eval_tgt;
  for (int t = 0; t < T; t++) {
    idx[b * T + t] = s ? token_at(s, w + (size_t)t) : 0;
    tgt[b * T + t] = s ? token_at(s, w + (size_t)t + 1) : 0;
  }
}

/* The forward of evaluation's inputs, to the logits on tr->head. */
static int eval_forward(struct trainer *tr) {
  int rc = tr->in ? rtp_tensor_set(tr->in, tr->eval_idx, 0, rtp_tensor_nbytes(tr->in)) : 0;
  return rc ? rc : rtp_graph_compute(tr->eval, tr->tp);
}

/* tr->head's n bytes at buf, on every rank. Decoding feeds each pick back as the next
 * input: every rank must run the next forward (whose transfers pair the ranks up) on the
 * same inputs and stop at the same step, whatever the last bits of its own logits. */
static int share_head(struct trainer *tr, void *buf, size_t n, const char *what) {
  int rc = tr->comm ? rtp_comm_broadcast(tr->comm, buf, n, tr->head, NULL) : RTP_OK;
  return rc ? fail(rc, "sharing rank %d's %s", tr->head, what) : RTP_OK;
}

/* Evaluation's windows (--eval-every, the progress lines', --eval-only) come from d->held:
 * the held-out part of --data, or --val-data; window i at i*T (T + 1 tokens, so each
 * shares its last token with the next). */
static int64_t count_windows(const struct dataset *d, int T) {
  return (int64_t)((d->held.n - 1) / (size_t)T);
}

/* Whether this rank shows progress: rank 0, and the first rank of every other host, so
 * that each node's terminal shows the job is alive (rtp-run prefixes the ranks). */
static bool shows_progress(const struct trainer *tr) {
  const char *local = getenv("RTP_LOCAL_RANK");
  return tr->rank == 0 || (local && strcmp(local, "0") == 0);
}

/* A long evaluation (EVAL_PROGRESS_BATCHES batches or more) says how far it is, a tenth at
 * a time, so that it is not taken for a hang; on stderr, which keeps --eval-only's stdout
 * one JSON line. */
#define EVAL_PROGRESS_BATCHES 50

/* Mean next-token loss over the held-out windows [i*T, i*T + T] of held, i < n,
 * computed B windows at a time (unused rows of the last batch are ignored). */
static int evaluate(struct trainer *tr, const struct dataset *d, int64_t n, double *loss) {
  int B = tr->m.batch, T = tr->m.cfg.seq_len;
  double sum = 0;
  int64_t batches = (n + B - 1) / B, tenth = 0;
  bool show = shows_progress(tr) && batches >= EVAL_PROGRESS_BATCHES;
  for (int64_t first = 0; first < n; first += B) {
    if (show && first / B * 10 >= tenth * batches) {
      fprintf(stderr, "evaluation: %" PRId64 "/%" PRId64 " windows\n", first, n);
      tenth++;
    }
    for (int b = 0; b < B; b++)
      set_window(tr, b, first + b < n ? &d->held : NULL, (size_t)(first + b) * (size_t)T);
    int rc = eval_forward(tr);
    for (int b = 0; b < B && first + b < n && tr->rank == tr->head && !rc; b++)
      rc = row_loss(tr, b, &sum);
    if (rc) return fail(rc, "evaluation");
  }
  *loss = sum / ((double)n * T);
  return tr->stages > 1 ? share_head(tr, loss, sizeof(*loss), "evaluation loss") : RTP_OK;
}

/* The next byte after logits l (V of them): greedy, or sampled at the temperature; -1 if
 * they are not finite (weights so large that they overflow), where every comparison
 * would pick byte 0. */
static int pick_byte(const float *l, int V, float temperature, uint64_t *rng) {
  int best = 0;
  for (int v = 0; v < V; v++) {
    if (!isfinite(l[v])) return -1;
    best = l[v] > l[best] ? v : best;
  }
  if (temperature <= 0) return best;
  double z = 0, r;
  for (int v = 0; v < V; v++) z += exp((l[v] - l[best]) / temperature);
  *rng = mix64(*rng);
  r = (double)(*rng >> 11) / 9007199254740992.0 * z;
  for (int v = 0; v < V; v++) {
    r -= exp((l[v] - l[best]) / temperature);
    if (r <= 0) return v;
  }
  return best;
}

/* A held-out sum: the prompt "\na+b=" and the answer "c\n". */
struct problem {
  char prompt[TASK_MAX_LINE + 1], answer[TASK_MAX_LINE];
  int prompt_len;
};

/* Up to max problems from the complete lines of the held-out part. */
static int held_out_problems(const struct dataset *d, struct problem *p, int max) {
  int n = 0;
  const char *s = (const char *)d->held.p, *end = s + d->held.n; /* bytes: the task's */
  while (n < max && s < end) {
    const char *eq = memchr(s, '=', (size_t)(end - s));
    const char *nl = eq ? memchr(eq, '\n', (size_t)(end - eq)) : NULL;
    if (!nl || nl - s >= TASK_MAX_LINE - 1) break;
    p[n].prompt_len =
        snprintf(p[n].prompt, sizeof(p[n].prompt), "\n%.*s", (int)(eq + 1 - s), s);
    snprintf(p[n].answer, sizeof(p[n].answer), "%.*s", (int)(nl + 1 - eq - 1), eq + 1);
    n++;
    s = nl + 1;
  }
  return n;
}

#define DECODE_ROWS 64 /* problems decoded at once, at most one per batch row */

static int logits_not_finite(void) {
  fprintf(stderr, "train-gpt: the model's logits are not finite: its weights overflow\n");
  return RTP_EINVAL;
}

/* Greedy answers to a batch of problems, each in its own row, one byte per forward. */
static int solve_batch(struct trainer *tr, const struct problem *p, int n, int *right) {
  int T = tr->m.cfg.seq_len;
  char got[DECODE_ROWS][TASK_MAX_LINE] = {{0}};
  int len[DECODE_ROWS] = {0};
  for (int b = 0; b < tr->m.batch; b++) set_window(tr, b, NULL, 0);
  int32_t *idx = tr->eval_idx;
  for (int b = 0; b < n; b++)
    for (int t = 0; t < p[b].prompt_len; t++) idx[b * T + t] = (uint8_t)p[b].prompt[t];
  for (int k = 0; k < TASK_MAX_LINE - 1; k++) {
    int rc = eval_forward(tr);
    if (rc) return fail(rc, "decoding");
    bool live[DECODE_ROWS], busy = false;
    for (int b = 0; b < n; b++) {
      int pos = p[b].prompt_len + len[b];
      live[b] = !(len[b] && got[b][len[b] - 1] == '\n') && pos < T;
      if (!live[b] || tr->rank != tr->head) continue;
      const float *l = logits_at(tr, b, pos - 1);
      if (!l) return fail(RTP_EINVAL, "decoding");
      idx[b * T + pos] = pick_byte(l, tr->m.cfg.vocab, 0, NULL);
    }
    size_t bytes = (size_t)tr->m.batch * (size_t)T * sizeof(int32_t);
    if ((rc = share_head(tr, idx, bytes, "picks"))) return rc;
    for (int b = 0; b < n; b++)
      if (live[b]) {
        if (idx[b * T + p[b].prompt_len + len[b]] < 0) return logits_not_finite();
        got[b][len[b]] = (char)idx[b * T + p[b].prompt_len + len[b]];
        len[b]++;
        busy = true;
      }
    if (!busy) break;
  }
  for (int b = 0; b < n; b++) *right += strcmp(got[b], p[b].answer) == 0;
  return RTP_OK;
}

/* Exact-match accuracy of greedy answers to up to max held-out sums. */
static int accuracy(struct trainer *tr, const struct dataset *d, int max, double *acc, int *n) {
  struct problem *p = calloc((size_t)(max > 0 ? max : 1), sizeof(*p));
  if (!p) return fail(RTP_ENOMEM, "accuracy");
  *n = held_out_problems(d, p, max);
  int right = 0, rc = RTP_OK, B = tr->m.batch < DECODE_ROWS ? tr->m.batch : DECODE_ROWS;
  for (int first = 0; first < *n && !rc; first += B)
    rc = solve_batch(tr, p + first, *n - first < B ? *n - first : B, &right);
  free(p);
  *acc = *n ? (double)right / *n : 0;
  return rc;
}

struct eval_stats {
  double loss, acc;
  int64_t windows;
  int problems; /* 0: no accuracy (not the built-in task) */
};

static int eval_all(struct trainer *tr, const struct dataset *d, int max_windows,
                    int max_problems, struct eval_stats *e) {
  *e = (struct eval_stats){0};
  e->windows = count_windows(d, tr->m.cfg.seq_len);
  if (max_windows > 0 && e->windows > max_windows) e->windows = max_windows;
  int rc = evaluate(tr, d, e->windows, &e->loss);
  if (!rc && d->builtin && max_problems > 0)
    rc = accuracy(tr, d, max_problems, &e->acc, &e->problems);
  return rc;
}

/* ---- generation ------------------------------------------------------------------------- */

/* Whether line (len bytes, no newline) is a sum of the built-in task, "aaa+bbb=cccc", and
 * if so whether it is right. */
static bool task_sum(const uint8_t *line, size_t len, bool *right) {
  int a, b, c, used = 0;
  char buf[TASK_MAX_LINE + 1];
  if (len != 12) return false;
  memcpy(buf, line, len);
  buf[len] = 0;
  if (sscanf(buf, "%3d+%3d=%4d%n", &a, &b, &c, &used) != 3 || used != 12) return false;
  *right = a + b == c;
  return true;
}

static void print_bytes(const uint8_t *p, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (p[i] >= 32 && p[i] < 127)
      putchar(p[i]);
    else
      printf("\\x%02x", p[i]);
}

/* The sample, a line at a time; with `sums` (the built-in task), each whole sum whose
 * answer the model wrote (the line ends past the prompt's plen bytes) marked right or
 * wrong, and the count. */
static void print_sample(const uint8_t *text, size_t len, size_t plen, int n, float temperature,
                         bool sums) {
  printf("--- sample (%d bytes, %s) ---\n", n, temperature > 0 ? "sampled" : "greedy");
  int judged = 0, right_n = 0;
  for (size_t start = 0; start < len;) {
    const uint8_t *nl = memchr(text + start, '\n', len - start);
    size_t end = nl ? (size_t)(nl - text) : len;
    print_bytes(text + start, end - start);
    bool right;
    if (sums && nl && end > plen && task_sum(text + start, end - start, &right)) {
      judged++;
      right_n += right;
      printf("   %s", right ? "right" : "wrong");
    }
    if (nl) putchar('\n');
    start = end + 1;
  }
  printf("\n---\n");
  if (judged) printf("%d of %d sums right\n", right_n, judged);
}

static int gather_param(struct trainer *tr, int i, float *full); /* below, with the export */

/* The whole model on rank 0 with a KV cache (gpt_build_decode), for sampling: a byte costs
 * one token's forward, not the window's. */
struct decoder {
  struct rtp_context *ctx;
  struct gpt m;
  struct gpt_decode dec;
  struct rtp_graph *g;
};

/* Every rank takes part in gathering each parameter whole; rank 0 keeps them in a model of
 * its own, with the cache and the one-token graph planned. */
static int decoder_new(struct trainer *tr, struct decoder *dc) {
  memset(dc, 0, sizeof(*dc));
  struct gpt_config c = tr->m.cfg;
  size_t cache = (size_t)2 * (size_t)c.n_layer * (size_t)c.seq_len * (size_t)c.d_model;
  size_t bytes = ((size_t)gpt_n_params(c) + cache) * sizeof(float) +
                 (size_t)tr->m.n_params * 4096 + (32u << 20);
  float *scratch = tr->rank == 0 ? NULL : malloc(largest_param_bytes(&tr->m));
  int rc = RTP_OK;
  if (tr->rank == 0) {
    dc->ctx = rtp_context_new((struct rtp_init_params){.mem_size = bytes});
    rc = !dc->ctx || gpt_build(dc->ctx, &dc->m, c, 1) ? RTP_ENOMEM : RTP_OK;
  } else if (!scratch) {
    rc = RTP_ENOMEM;
  }
  for (int i = 0; i < tr->m.n_params && !rc; i++)
    rc = gather_param(tr, i, tr->rank == 0 ? dc->m.params[i]->data : scratch);
  free(scratch);
  if (!rc && dc->ctx && gpt_build_decode(dc->ctx, &dc->dec, &dc->m)) rc = RTP_ENOMEM;
  if (!rc && dc->ctx && !(dc->g = rtp_graph_new(dc->ctx, 1024 + 64 * c.n_layer)))
    rc = RTP_ENOMEM;
  for (int l = 0; l < c.n_layer && !rc && dc->g; l++)
    rc = rtp_graph_build(dc->g, dc->dec.qkv[l]);
  if (!rc && dc->g) rc = rtp_graph_build(dc->g, dc->dec.logits);
  if (!rc && dc->g) rc = rtp_graph_plan(dc->ctx, dc->g);
  return rc ? fail(rc, "sampling: the decoder") : RTP_OK;
}

/* Token tok at position p: its logits, and its keys and values cached. */
static int decoder_step(struct trainer *tr, struct decoder *dc, int tok, int p) {
  int rc = gpt_decode_inputs(&dc->dec, tok, p) ? RTP_EINVAL : RTP_OK;
  if (!rc) rc = rtp_graph_compute(dc->g, tr->tp);
  if (!rc) gpt_decode_commit(&dc->dec, p);
  return rc ? fail(rc, "sampling") : RTP_OK;
}

/* A long sample (SAMPLE_PROGRESS_BYTES or more) says how far it is on stderr, a tenth at a
 * time. */
#define SAMPLE_PROGRESS_BYTES 256

/* A token model's sample (vocabulary other than 256): its ids, space-separated, the
 * prompt's first; a tokenizer turns them into text (docs/data.md). */
static void print_ids(const int32_t *text, size_t len, size_t plen, int n, float temperature) {
  printf("--- sample (%d tokens after %zu of prompt, %s; token ids) ---\n", n, plen,
         temperature > 0 ? "sampled" : "greedy");
  for (size_t i = 0; i < len; i++) printf("%s%" PRId32, i ? " " : "", text[i]);
  printf("\n---\n");
}

/* The sample as text (a byte model) or ids (a token model). */
static int print_tokens(const struct trainer *tr, const int32_t *text, size_t plen, int n,
                        float temperature, bool sums) {
  size_t len = plen + (size_t)n;
  if (tr->m.cfg.vocab != 256) {
    print_ids(text, len, plen, n, temperature);
    return RTP_OK;
  }
  uint8_t *bytes = malloc(len);
  if (!bytes) return fail(RTP_ENOMEM, "sampling");
  for (size_t i = 0; i < len; i++) bytes[i] = (uint8_t)text[i];
  print_sample(bytes, len, plen, n, temperature, sums);
  free(bytes);
  return RTP_OK;
}

/* Rank 0 prints the prompt and n generated tokens. The context is a suffix of the text at
 * positions 0, 1, ... of the cache; when the next position would pass the window (T), the
 * context becomes the last T/2 tokens, computed again: each token then costs one token's
 * forward and, on average, one more for the refills, so a sample's cost is linear in its
 * length. Up to T tokens it is exactly the window's forward (each position attends to
 * all before it). */
static int sample_text(struct trainer *tr, const int32_t *prompt, size_t plen, int n,
                       float temperature, uint64_t seed, bool sums) {
  struct decoder dc;
  int rc = decoder_new(tr, &dc);
  if (rc || tr->rank != 0) {
    rtp_context_free(dc.ctx);
    return rc;
  }
  size_t T = (size_t)tr->m.cfg.seq_len, start = 0, cached = 0;
  int32_t *text = malloc((plen + (size_t)n) * sizeof(*text));
  if (!text) rc = fail(RTP_ENOMEM, "sampling");
  if (text) memcpy(text, prompt, plen * sizeof(*text));
  uint64_t rng = mix64(seed ^ 0x5a);
  int tenth = 0;
  bool show = n >= SAMPLE_PROGRESS_BYTES;
  const char *units = tr->m.cfg.vocab == 256 ? "bytes" : "tokens";
  for (size_t len = plen; text && len < plen + (size_t)n && !rc; len++) {
    if (show && (int64_t)(len - plen) * 10 >= (int64_t)tenth * n) {
      fprintf(stderr, "sampling: %zu/%d %s\n", len - plen, n, units);
      tenth++;
    }
    if (len - 1 - start >= T) { /* the window is full: keep its last half */
      start = len - T / 2;
      cached = 0;
    }
    for (; start + cached < len && !rc; cached++) /* the context up to the last token */
      rc = decoder_step(tr, &dc, text[start + cached], (int)cached);
    int pick = rc ? 0 : pick_byte(dc.dec.logits->data, tr->m.cfg.vocab, temperature, &rng);
    if (!rc && pick < 0) rc = logits_not_finite();
    if (!rc) text[len] = pick;
  }
  if (!rc) rc = print_tokens(tr, text, plen, n, temperature, sums);
  free(text);
  rtp_context_free(dc.ctx);
  return rc;
}

/* What --sample continues: --prompt's bytes, or for a token model (vocabulary other than
 * 256) its token ids, e.g. "464 2068"; NULL (p->n 0) without --prompt. Parsed before any
 * training, so that a bad prompt costs no run. */
struct prompt {
  int32_t *tok;
  size_t n;
};

static int parse_prompt(const struct options *o, int vocab, struct prompt *p) {
  *p = (struct prompt){NULL, 0};
  if (!o->prompt) return RTP_OK;
  size_t len = strlen(o->prompt);
  if (!(p->tok = malloc((len + 1) * sizeof(*p->tok)))) return fail(RTP_ENOMEM, "--prompt");
  for (const char *s = o->prompt; vocab == 256 && *s; s++) p->tok[p->n++] = (uint8_t)*s;
  for (const char *s = o->prompt; vocab != 256 && *s;) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (end == s || errno || v < 0 || v >= vocab || (*end && *end != ' '))
      return usage_error(
          "--prompt: '%s': a token model (vocabulary %d) takes token ids "
          "below %d separated by spaces, e.g. \"464 2068\"",
          o->prompt, vocab, vocab);
    p->tok[p->n++] = (int32_t)v;
    for (s = end; *s == ' '; s++) continue;
  }
  return RTP_OK;
}

static int run_sample(struct trainer *tr, const struct dataset *d, const struct options *o,
                      const struct prompt *given) {
  if (given->n)
    return sample_text(tr, given->tok, given->n, o->sample, o->temperature, (uint64_t)o->seed,
                       false);
  const uint8_t *eq = d->builtin ? memchr(d->held.p, '=', d->held.n) : NULL;
  size_t plen = eq ? (size_t)(eq + 1 - d->held.p) : (size_t)tr->m.cfg.seq_len / 2;
  int32_t *prompt = malloc(plen * sizeof(*prompt));
  if (!prompt) return fail(RTP_ENOMEM, "sampling");
  for (size_t i = 0; i < plen; i++) prompt[i] = token_at(&d->held, i);
  int rc =
      sample_text(tr, prompt, plen, o->sample, o->temperature, (uint64_t)o->seed, d->builtin);
  free(prompt);
  return rc;
}

/* ---- files --------------------------------------------------------------------------------
 */

/* The file must be this model, not one that shares a prefix of its rows or layers: every
 * tensor of the shape the model has and no other, and sizes in its metadata (the only
 * place n_head shows) that are the model's. */
static int check_init(const struct trainer *tr, struct rtp_safetensors *st, const char *path) {
  const struct gpt_config c = tr->m.cfg;
  const char *keys[] = {"vocab", "seq_len", "d_model", "n_layer", "n_head"};
  const int model[] = {c.vocab, c.seq_len, c.d_model, c.n_layer, c.n_head};
  int rc = rtp_safetensors_check(st, tr->m.params, tr->m.n_params);
  if (rc) return fail(rc, "--init %s", path);
  for (int i = 0; i < 5; i++) {
    const char *saved = rtp_safetensors_meta(st, keys[i]);
    int v;
    if (!saved || (meta_int(st, keys[i], &v) == 1 && v == model[i])) continue;
    fprintf(stderr, "train-gpt: --init %s: its metadata says %s %s, the model has %d\n", path,
            keys[i], saved, model[i]);
    return RTP_ESHAPE;
  }
  return RTP_OK;
}

/* A Hugging Face GPT-2 must be this model too: a size flag must not make it read a part of
 * the file (fewer blocks, say); only the positions may be fewer (resolve_hf_config). */
static int check_hf_init(const struct trainer *tr, struct rtp_safetensors *st,
                         const char *path) {
  struct gpt_config f, c = tr->m.cfg;
  if (gpt_hf_config(path, st, c.n_head, &f)) {
    fprintf(stderr, "train-gpt: --init %s\n", gpt_hf_error());
    return RTP_EINVAL;
  }
  if (f.vocab == c.vocab && f.d_model == c.d_model && f.n_layer == c.n_layer &&
      f.seq_len >= c.seq_len && f.tie_embeddings == c.tie_embeddings)
    return RTP_OK;
  fprintf(stderr,
          "train-gpt: --init %s is a GPT-2 of vocab %d, d_model %d, %d blocks%s; the model has "
          "vocab %d, d_model %d, %d blocks%s (leave the size flags out)\n",
          path, f.vocab, f.d_model, f.n_layer, f.tie_embeddings ? ", tied" : "", c.vocab,
          c.d_model, c.n_layer, c.tie_embeddings ? ", tied" : "");
  return RTP_ESHAPE;
}

/* Every rank reads each parameter whole (HF's Conv1D weights are the transpose of ours, so
 * a rank's rows are not rows of the file) and keeps its part. */
static int load_hf_init(struct trainer *tr, struct rtp_safetensors *st, const char *path) {
  int rc = check_hf_init(tr, st, path);
  float *part, *full = rc ? NULL : param_buffers(&tr->m, &part);
  if (!rc && !full) rc = fail(RTP_ENOMEM, "--init %s", path);
  for (int i = 0; i < tr->m.n_params && !rc; i++) {
    const struct rtp_tensor *p = tr->m.params[i];
    if (!rtp_parallel_tensor(tr->par, p)) continue; /* another stage's */
    if (gpt_hf_read(st, p, full)) {
      fprintf(stderr, "train-gpt: --init %s: %s\n", path, gpt_hf_error());
      rc = RTP_EFORMAT;
      break;
    }
    rc = put_param(tr, p, full, part);
    if (rc) rc = fail(rc, "--init %s", path);
  }
  free(full);
  return rc;
}

/* Each rank reads only its block of every parameter; under tp, whose pieces are not all
 * blocks of rows, each parameter whole, and keeps its part of it. */
static int load_init(struct trainer *tr, struct rtp_safetensors *st, const char *path) {
  if (gpt_hf_detect(st)) return load_hf_init(tr, st, path);
  int checked = check_init(tr, st, path);
  if (checked) return checked;
  bool tp = tr->strategy == RTP_STRATEGY_TP;
  size_t hdr_bytes = (size_t)tr->m.n_params * 1024 + (64u << 10);
  struct rtp_context *hdr =
      tp ? rtp_context_new((struct rtp_init_params){.mem_size = hdr_bytes, .no_alloc = true})
         : NULL;
  float *part = NULL, *full = tp ? param_buffers(&tr->m, &part) : NULL;
  int rc = tp && (!hdr || !full) ? RTP_ENOMEM : RTP_OK;
  for (int i = 0; i < tr->m.n_params && !rc; i++) {
    const struct rtp_tensor *p = tr->m.params[i];
    struct rtp_tensor *mine = rtp_parallel_tensor(tr->par, p);
    if (!mine) continue; /* another stage's */
    if (!tp) {
      int64_t first, row;
      param_block(tr, i, &first, &row);
      rc = rtp_safetensors_read_rows(st, p->name, first, mine);
      continue;
    }
    struct rtp_tensor *whole = rtp_tensor_new(hdr, RTP_TYPE_F32, rtp_tensor_n_dims(p), p->ne);
    if (!whole) {
      rc = RTP_ENOMEM;
      break;
    }
    whole->data = full;
    rc = rtp_safetensors_read(st, p->name, whole);
    if (!rc) rc = put_param(tr, p, full, part);
  }
  rtp_context_free(hdr);
  free(full);
  return rc ? fail(rc, "--init %s", path) : RTP_OK;
}

/* A model with NaN or infinite weights would train on NaN and sample byte 0 forever:
 * refused, naming the first such tensor of this rank's part. */
static int check_init_finite(const struct trainer *tr, const char *path) {
  float *v = malloc(largest_param_bytes(&tr->m));
  int rc = v ? RTP_OK : fail(RTP_ENOMEM, "--init %s", path);
  for (int i = 0; i < tr->m.n_params && !rc; i++) {
    const struct rtp_tensor *mine = rtp_parallel_tensor(tr->par, tr->m.params[i]);
    if (!mine) continue; /* another stage's */
    if ((rc = rtp_tensor_get(mine, v, 0, rtp_tensor_nbytes(mine)))) {
      rc = fail(rc, "--init %s", path);
      break;
    }
    for (int64_t j = 0; j < rtp_tensor_nelements(mine); j++)
      if (!isfinite(v[j])) {
        fprintf(stderr, "train-gpt: --init %s: %s holds %f: the weights must be finite\n", path,
                tr->m.params[i]->name, v[j]);
        rc = RTP_EINVAL;
        break;
      }
  }
  free(v);
  return rc;
}

/* tp: parameter i whole into full, on every rank. A replicated one is whole everywhere;
 * of a split one, each rank gathers every rank's piece and where each of its elements
 * lies in the whole: the piece's rtp_parallel_shard_copy of the indices 0, 1, 2, ...
 * (they travel as the bits of floats, which the copy and the gather only move). */
static int gather_tp_param(struct trainer *tr, int i, float *full) {
  const struct rtp_tensor *p = tr->m.params[i], *mine = rtp_parallel_tensor(tr->par, p);
  size_t n = (size_t)rtp_tensor_nelements(p), local = (size_t)rtp_tensor_nelements(mine);
  struct rtp_comm *tp = tr->het.n ? tr->group : tr->comm; /* --stages: the tp stage's */
  int rank = rtp_comm_rank(tp), world = rtp_comm_size(tp);
  if (local == n) {
    int rc = rtp_tensor_get(mine, full, 0, n * sizeof(float));
    return rc ? fail(rc, "gathering %s", p->name) : RTP_OK;
  }
  uint32_t *iota = malloc(n * sizeof(uint32_t)), *where = malloc(n * sizeof(uint32_t));
  float *pieces = malloc(n * sizeof(float));
  int rc = iota && where && pieces ? RTP_OK : RTP_ENOMEM;
  if (!rc && local * (size_t)world != n) rc = RTP_EINVAL; /* tp splits evenly */
  for (size_t e = 0; e < n && !rc; e++) iota[e] = (uint32_t)e;
  if (!rc)
    rc = rtp_parallel_shard_copy(tr->par, p, (const float *)(const void *)iota,
                                 (float *)(void *)(where + (size_t)rank * local));
  if (!rc) rc = rtp_comm_allgather(tp, where, (size_t)world, local * sizeof(*where), NULL);
  if (!rc) rc = rtp_tensor_get(mine, pieces + (size_t)rank * local, 0, local * sizeof(float));
  if (!rc) rc = rtp_comm_allgather(tp, pieces, (size_t)world, local * sizeof(float), NULL);
  for (size_t e = 0; e < n && !rc; e++) full[where[e]] = pieces[e];
  free(iota);
  free(where);
  free(pieces);
  return rc ? fail(rc, "gathering %s", p->name) : RTP_OK;
}

/* Parameter i whole into full, on every rank of the stage that holds it: each puts in its
 * block, and an all-gather of rows over the stage (the partition of the blocks) brings the
 * others'. ddp replicates parameters, so its ranks already hold all of it; rtp and fsdp
 * shard every parameter; tp has its own. On a pipeline, that stage then broadcasts it
 * along each pipe: every rank has it. */
static int gather_param(struct trainer *tr, int i, float *full) {
  const struct rtp_tensor *p = tr->m.params[i], *mine = rtp_parallel_tensor(tr->par, p);
  int rc = RTP_OK;
  if (tr->strategy == RTP_STRATEGY_TP && (!tr->het.n || mine)) {
    rc = gather_tp_param(tr, i, full);
    if (rc || !tr->het.n) return rc;
  } else if (mine) {
    int64_t first, row;
    param_block(tr, i, &first, &row);
    rc = rtp_tensor_get(mine, full + first * row, 0, rtp_tensor_nbytes(mine));
    if (!rc && tr->group && tr->strategy != RTP_STRATEGY_DDP)
      rc = rtp_comm_allgather(tr->group, full, (size_t)(rtp_tensor_nelements(p) / row),
                              (size_t)row * sizeof(float), NULL);
  }
  if (!rc && tr->pipe)
    rc = rtp_comm_broadcast(tr->pipe, full, rtp_tensor_nbytes(p),
                            rtp_parallel_tensor_stage(tr->par, p), NULL);
  if (!rc && tr->het.n) { /* --stages: from the first rank of its stage to the job */
    int root = 0;
    for (int s = 0; s < rtp_parallel_tensor_stage(tr->par, p); s++) root += tr->het.ranks[s];
    rc = rtp_comm_broadcast(tr->comm, full, rtp_tensor_nbytes(p), root, NULL);
  }
  return rc ? fail(rc, "gathering %s", p->name) : RTP_OK;
}

/* One consolidated file with nanoGPT's names and [out, in] shapes, plus the sizes (and
 * the tying: a tied model has no lm_head.weight); or, --format hf, Hugging Face's GPT-2. */
static int save_model(const char *path, const char *format, struct gpt_config c,
                      struct rtp_tensor **t, int n, int64_t steps) {
  if (strcmp(format, "hf") == 0) {
    int rc = gpt_hf_save(path, c, t, n);
    if (rc) fprintf(stderr, "train-gpt: --export %s: %s\n", path, gpt_hf_error());
    return rc;
  }
  char v[6][24];
  snprintf(v[0], sizeof(v[0]), "%d", c.vocab);
  snprintf(v[1], sizeof(v[1]), "%d", c.seq_len);
  snprintf(v[2], sizeof(v[2]), "%d", c.d_model);
  snprintf(v[3], sizeof(v[3]), "%d", c.n_layer);
  snprintf(v[4], sizeof(v[4]), "%d", c.n_head);
  snprintf(v[5], sizeof(v[5]), "%" PRId64, steps);
  const char *meta[] = {"format",  "pt", "vocab",          v[0],
                        "seq_len", v[1], "d_model",        v[2],
                        "n_layer", v[3], "n_head",         v[4],
                        "step",    v[5], "tie_embeddings", c.tie_embeddings ? "1" : "0",
                        NULL};
  int rc = rtp_safetensors_save(path, t, n, meta);
  return rc ? fail(rc, "--export %s", path) : RTP_OK;
}

/* Every rank waits for rank 0's file and leaves with its verdict, so none exits early. */
static int export_verdict(struct trainer *tr, int rc, const char *path) {
  int32_t verdict = rc;
  if (!tr->comm) return rc;
  int brc = rtp_comm_broadcast(tr->comm, &verdict, sizeof(verdict), 0, NULL);
  if (brc) return fail(brc, "--export %s: waiting for rank 0", path);
  if (verdict && !rc) fprintf(stderr, "train-gpt: rank 0 could not write --export %s\n", path);
  return rc ? rc : verdict;
}

/* Rank 0 gathers the whole model into a context of its own and writes it; the other
 * ranks take part in the gathers with room for one parameter. */
static int export_model(struct trainer *tr, const char *path, const char *format,
                        int64_t steps) {
  struct rtp_tensor *full[5 + 12 * GPT_MAX_LAYERS];
  size_t bytes = (size_t)gpt_n_params(tr->m.cfg) * sizeof(float) +
                 (size_t)tr->m.n_params * 1024 + (1u << 20);
  struct rtp_context *ctx =
      tr->rank == 0 ? rtp_context_new((struct rtp_init_params){.mem_size = bytes}) : NULL;
  float *scratch = tr->rank == 0 ? NULL : malloc(largest_param_bytes(&tr->m));
  int rc = ctx || scratch ? RTP_OK : fail(RTP_ENOMEM, "--export %s", path);
  for (int i = 0; i < tr->m.n_params && !rc; i++) {
    const struct rtp_tensor *p = tr->m.params[i];
    float *dst = scratch;
    if (ctx) {
      full[i] = rtp_tensor_set_name(
          rtp_tensor_new(ctx, RTP_TYPE_F32, rtp_tensor_n_dims(p), p->ne), "%s", p->name);
      if (!full[i]) {
        rc = fail(RTP_ENOMEM, "--export %s", path);
        break;
      }
      dst = full[i]->data;
    }
    rc = gather_param(tr, i, dst);
  }
  if (!rc && ctx) rc = save_model(path, format, tr->m.cfg, full, tr->m.n_params, steps);
  rc = export_verdict(tr, rc, path);
  rtp_context_free(ctx);
  free(scratch);
  return rc;
}

/* ---- checkpoints ----------------------------------------------------------------------- */

/* What decides the steps after a checkpoint besides the weights and Adam states: the
 * batches are drawn from (seed, step) over the global batch (--grad-accum's computes
 * included), so the data position is the step itself. --keep-best's lowest eval loss too,
 * so that a resumed run keeps comparing with it. */
struct ckpt_state {
  char seed[24], batch[24], pos[24], sizes[5][24]; /* sizes: for reading it as a model */
  char sched[3][24];                               /* the schedule's numbers */
  char best[24];
  const char *kv[29]; /* 6 + 10 sizes + 2 tie + 8 schedule + 2 best + NULL */
};

/* The learning-rate schedule's flags as the checkpoint's state records them; the step is
 * the checkpoint's own. */
static const char *const sched_keys[] = {"lr_schedule", "warmup", "max_steps", "lr_min"};

/* The schedule's flags as text, as the checkpoint's state holds them: out[0] the kind,
 * out[1..3] into buf. */
static void sched_text(const struct options *o, char buf[3][24], const char *out[4]) {
  snprintf(buf[0], 24, "%d", o->warmup);
  snprintf(buf[1], 24, "%d", o->max_steps);
  snprintf(buf[2], 24, "%.9g", o->lr_min);
  out[0] = o->lr_schedule;
  for (int i = 0; i < 3; i++) out[i + 1] = buf[i];
}

static struct rtp_ckpt_params ckpt_params(struct trainer *tr, const struct options *o,
                                          struct ckpt_state *cs, int64_t step) {
  snprintf(cs->seed, sizeof(cs->seed), "%" PRId64, o->seed);
  snprintf(cs->batch, sizeof(cs->batch), "%" PRId64, global_batch(tr));
  snprintf(cs->pos, sizeof(cs->pos), "%" PRId64, step);
  const char *kv[] = {"seed", cs->seed, "global_batch", cs->batch, "data_pos", cs->pos};
  memcpy(cs->kv, kv, sizeof(kv));
  struct gpt_config c = tr->m.cfg;
  int sizes[] = {c.vocab, c.seq_len, c.d_model, c.n_layer, c.n_head}, n = 6;
  for (int i = 0; i < 5; i++) {
    snprintf(cs->sizes[i], sizeof(cs->sizes[i]), "%d", sizes[i]);
    cs->kv[n++] = size_keys[i];
    cs->kv[n++] = cs->sizes[i];
  }
  cs->kv[n++] = "tie_embeddings";
  cs->kv[n++] = c.tie_embeddings ? "1" : "0";
  const char *sched[4];
  sched_text(o, cs->sched, sched);
  for (int i = 0; i < 4 && o->lr_schedule; i++) { /* once resolve_schedule has run */
    cs->kv[n++] = sched_keys[i];
    cs->kv[n++] = sched[i];
  }
  if (isfinite(tr->best_loss)) {
    snprintf(cs->best, sizeof(cs->best), "%.9g", tr->best_loss);
    cs->kv[n++] = "best_eval_loss";
    cs->kv[n++] = cs->best;
  }
  cs->kv[n] = NULL;
  return (struct rtp_ckpt_params){o->ckpt_dir,    tr->par, tr->comm, tr->strategy, tr->m.params,
                                  tr->m.n_params, tr->opt, 2,        cs->kv,       false};
}

/* A checkpoint that cannot be written (a full disk, an unwritable directory) stops the
 * run: training on without one would put ever more steps at risk, and the library has
 * kept the previous checkpoint, which --resume continues from once the cause is fixed. */
static int save_checkpoint(struct trainer *tr, const struct options *o, int64_t step,
                           bool best) {
  struct ckpt_state cs;
  struct rtp_ckpt_params p = ckpt_params(tr, o, &cs, step);
  p.best = best;
  int rc = rtp_ckpt_save(&p, step);
  if (rc) {
    fail(rc, "checkpoint of step %" PRId64 " in %s %s", step, o->ckpt_dir,
         tr->saved >= 0 ? "(the previous one is intact)" : "(no earlier checkpoint)");
    if (tr->rank == 0 && tr->saved >= 0)
      fprintf(stderr,
              "train-gpt: stopped after step %" PRId64 "; %s/latest still names step-%08" PRId64
              ": fix the cause (e.g. free disk space), then rerun with --resume\n",
              step, o->ckpt_dir, tr->saved);
    /* Every rank has failed: none leaves (and has the launcher stop the others) before
     * all have said why. Not after a transport failure, which a barrier would wait out. */
    if (tr->comm && rc != RTP_ECOMM && rc != RTP_ETIMEDOUT && rc != RTP_EPEER)
      rtp_comm_barrier(tr->comm, NULL);
    return rc;
  }
  tr->saved = step;
  if (tr->rank == 0 && !isatty(STDOUT_FILENO) && best) /* a terminal's bar would break */
    printf("checkpoint %s/step-%08" PRId64 " (the best eval loss so far: %s/best)\n",
           o->ckpt_dir, step, o->ckpt_dir);
  else if (tr->rank == 0 && !isatty(STDOUT_FILENO))
    printf("checkpoint %s/step-%08" PRId64 "\n", o->ckpt_dir, step);
  return RTP_OK;
}

/* A resumed run must draw the same batches as the run it continues. */
static int check_resume_state(const struct rtp_ckpt *c, const struct ckpt_state *cs) {
  const char *keys[] = {"seed", "global_batch"}, *mine[] = {cs->seed, cs->batch};
  for (int i = 0; i < 2; i++) {
    const char *saved = rtp_ckpt_state(c, keys[i]);
    if (!saved || strcmp(saved, mine[i])) {
      fprintf(stderr,
              "train-gpt: --resume: %s was saved with %s %s, this run has %s (use the same "
              "--seed and global batch: ranks x --batch x --grad-accum, or --batch x "
              "--grad-accum under tp)\n",
              rtp_ckpt_path(c), keys[i], saved ? saved : "(none)", mine[i]);
      return RTP_EINVAL;
    }
  }
  return RTP_OK;
}

/* This trainer draws the data of step s from (seed, s) and takes one Adam step a step, so
 * a checkpoint of step s says data_pos s and has s Adam steps: anything else is not one
 * of its checkpoints (or a damaged one), and would resume on other data or bias
 * corrections. */
static int check_resume_position(const struct rtp_ckpt *c, const struct trainer *tr) {
  int64_t step = rtp_ckpt_step(c), adam = rtp_optimizer_steps(tr->opt);
  const char *pos = rtp_ckpt_state(c, "data_pos");
  char want[24];
  snprintf(want, sizeof(want), "%" PRId64, step);
  if (!pos || strcmp(pos, want)) {
    fprintf(stderr, "train-gpt: --resume: %s: data_pos is '%s', expected %s (its step)\n",
            rtp_ckpt_path(c), pos ? pos : "(none)", want);
    return RTP_EFORMAT;
  }
  if (adam != step) {
    fprintf(stderr,
            "train-gpt: --resume: %s: adam_steps is %" PRId64 ", expected %" PRId64
            " (one a step)\n",
            rtp_ckpt_path(c), adam, step);
    return RTP_EFORMAT;
  }
  return RTP_OK;
}

/* The schedule's flags: those left out from checkpoint c (NULL: none; an older train-gpt
 * recorded none) so that a resumed run continues its curve, else their defaults; a flag
 * given that differs from c's would bend the curve, and is refused. */
static int resolve_schedule(struct options *o, const struct rtp_ckpt *c) {
  static const char *const flags[] = {"--lr-schedule", "--warmup", "--max-steps", "--lr-min"};
  char buf[3][24];
  const char *mine[4];
  sched_text(o, buf, mine);
  bool given[] = {o->lr_schedule != NULL, o->warmup >= 0, o->max_steps >= 0, o->lr_min >= 0};
  for (int i = 0; i < 4 && c; i++) {
    const char *saved = rtp_ckpt_state(c, sched_keys[i]);
    if (!saved) continue;
    if (given[i] && strcmp(saved, mine[i])) {
      fprintf(stderr,
              "train-gpt: --resume: %s was saved with %s %s, this run has %s (leave the "
              "flag out to continue its schedule)\n",
              rtp_ckpt_path(c), flags[i], saved, mine[i]);
      return RTP_EINVAL;
    }
    char *end = NULL;
    long v = i == 1 || i == 2 ? strtol(saved, &end, 10) : 0;
    float x = i == 3 ? strtof(saved, &end) : 0;
    bool ok = i == 0 ||
              (*saved && !*end && (i == 3 ? x >= 0 && isfinite(x) : v >= 0 && v <= 1 << 30));
    if (!ok) {
      fprintf(stderr, "train-gpt: --resume: %s: %s is '%s'\n", rtp_ckpt_path(c), sched_keys[i],
              saved);
      return RTP_EFORMAT;
    }
    if (i == 0) o->lr_schedule = saved;
    if (i == 1) o->warmup = (int)v;
    if (i == 2) o->max_steps = (int)v;
    if (i == 3) o->lr_min = x;
  }
  enum lr_kind kind = LR_CONSTANT;
  if (o->lr_schedule && !lr_kind_parse(o->lr_schedule, &kind)) {
    fprintf(stderr, "train-gpt: --resume: %s: lr_schedule is '%s'\n", rtp_ckpt_path(c),
            o->lr_schedule);
    return RTP_EFORMAT;
  }
  o->lr_schedule = lr_kind_name(kind); /* not the checkpoint's string, freed with it */
  if (o->warmup < 0) o->warmup = 0;
  /* constant: 0, unused, so that runs of any --steps save the same state */
  if (o->max_steps < 0) o->max_steps = kind == LR_CONSTANT ? 0 : o->steps > 0 ? o->steps : 1;
  if (o->lr_min < 0) o->lr_min = o->lr / 10;
  return RTP_OK;
}

static struct lr_schedule schedule_of(const struct options *o) {
  enum lr_kind kind = LR_CONSTANT;
  lr_kind_parse(o->lr_schedule, &kind);
  return (struct lr_schedule){kind, o->warmup, o->max_steps, o->lr, o->lr_min};
}

/* --keep-best's lowest eval loss so far, from checkpoint c's state (none: INFINITY). */
static int resume_best(struct trainer *tr, const struct rtp_ckpt *c) {
  const char *s = rtp_ckpt_state(c, "best_eval_loss");
  char *end = NULL;
  double v = s ? strtod(s, &end) : INFINITY;
  if (s && (!*s || *end || !isfinite(v))) {
    fprintf(stderr, "train-gpt: --resume: %s: best_eval_loss is '%s'\n", rtp_ckpt_path(c), s);
    return RTP_EFORMAT;
  }
  tr->best_loss = v;
  return RTP_OK;
}

/* The weights, Adam states and step of --ckpt-dir's latest checkpoint, and the schedule's
 * flags left out (resolve_schedule). */
/* A tied model's checkpoint has no lm_head: resumed untied (or the other way round) the
 * load would name a missing tensor rather than the flag. Older checkpoints are untied. */
static int check_resume_tie(const struct rtp_ckpt *c, const struct trainer *tr) {
  const char *saved = rtp_ckpt_state(c, "tie_embeddings");
  bool tied = saved && strcmp(saved, "1") == 0;
  if (tied == tr->m.cfg.tie_embeddings) return RTP_OK;
  fprintf(stderr, "train-gpt: --resume: %s was saved %s --tie-embeddings: resume %s it\n",
          rtp_ckpt_path(c), tied ? "with" : "without", tied ? "with" : "without");
  return EXIT_USAGE;
}

static int resume(struct trainer *tr, struct options *o, int64_t *step) {
  struct rtp_ckpt *c = NULL;
  struct ckpt_state cs;
  int rc = rtp_ckpt_open(o->ckpt_dir, &c);
  if (rc) return fail(rc, "--resume");
  struct rtp_ckpt_params p = ckpt_params(tr, o, &cs, 0);
  rc = check_resume_state(c, &cs);
  if (!rc) rc = check_resume_tie(c, tr);
  if (!rc) rc = resolve_schedule(o, c);
  if (!rc && (rc = rtp_ckpt_load(c, &p))) fail(rc, "--resume from %s", rtp_ckpt_path(c));
  if (!rc) rc = check_resume_position(c, tr);
  if (!rc) rc = resume_best(tr, c);
  *step = rtp_ckpt_step(c);
  if (!rc) tr->saved = *step;
  if (!rc && tr->rank == 0 && rtp_ckpt_world_size(c) == 1)
    printf("resumed from %s (step %" PRId64 ", saved by one process)\n", rtp_ckpt_path(c),
           *step);
  else if (!rc && tr->rank == 0 && rtp_ckpt_stages(c) > 1)
    printf("resumed from %s (step %" PRId64
           ", saved on %d ranks as %d pipeline stages, %s "
           "inside)\n",
           rtp_ckpt_path(c), *step, rtp_ckpt_world_size(c), rtp_ckpt_stages(c),
           rtp_strategy_name(rtp_ckpt_strategy(c)));
  else if (!rc && tr->rank == 0)
    printf("resumed from %s (step %" PRId64 ", saved on %d ranks with %s)\n", rtp_ckpt_path(c),
           *step, rtp_ckpt_world_size(c), rtp_strategy_name(rtp_ckpt_strategy(c)));
  rtp_ckpt_close(c);
  return rc;
}

/* A checkpoint read as a model (reads_checkpoint): its weights alone; the seed and batch,
 * which decide training's batches, do not matter. *step: the checkpoint's. */
static int load_checkpoint(struct trainer *tr, const struct options *o,
                           const struct rtp_ckpt *ck, int64_t *step) {
  struct ckpt_state cs;
  struct rtp_ckpt_params p = ckpt_params(tr, o, &cs, 0);
  int rc = rtp_ckpt_load(ck, &p);
  *step = rtp_ckpt_step(ck);
  return rc ? fail(rc, "--ckpt-dir: reading %s", rtp_ckpt_path(ck)) : RTP_OK;
}

/* ---- progress and metrics ------------------------------------------------------------------
 */

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* The process's peak resident set (VmHWM) in bytes, 0 if /proc does not say. */
static size_t peak_rss(void) {
  FILE *f = fopen("/proc/self/status", "r");
  if (!f) return 0;
  char line[256];
  size_t kb = 0;
  while (fgets(line, sizeof(line), f))
    if (sscanf(line, "VmHWM: %zu kB", &kb) == 1) break;
  fclose(f);
  return kb * 1024;
}

struct step_stats {
  int64_t step, steps; /* 1-based */
  float loss, lr;
  double ms, tokens_per_s, eta_s;
  const struct eval_stats *eval; /* NULL unless evaluated at this step */
};

static void write_metrics(FILE *f, const struct trainer *tr, const struct step_stats *s) {
  struct rtp_mem_report r;
  rtp_mem_report_get(tr->ctx, &r);
  fprintf(
      f,
      "{\"step\": %" PRId64
      ", \"loss\": %.9g, \"lr\": %.9g, \"ms_per_step\": %.4f, \"tokens_per_s\": %.2f"
      ", \"params\": %zu, \"grads\": %zu, \"optim\": %zu, \"activations\": %zu, \"comm\": %zu"
      ", \"peak_rss\": %zu",
      s->step, s->loss, s->lr, s->ms, s->tokens_per_s, r.bytes[RTP_ROLE_PARAM],
      r.bytes[RTP_ROLE_GRAD], r.bytes[RTP_ROLE_OPTIM], r.bytes[RTP_ROLE_ACTIVATION],
      r.bytes[RTP_ROLE_COMM], peak_rss());
  if (s->eval) fprintf(f, ", \"eval_loss\": %.9g", s->eval->loss);
  if (s->eval && s->eval->problems) fprintf(f, ", \"accuracy\": %.6g", s->eval->acc);
  fprintf(f, "}\n");
  fflush(f);
}

static void format_duration(double s, char *buf, size_t n) {
  long t = (long)(s + 0.5);
  if (t >= 3600)
    snprintf(buf, n, "%ldh%02ldm", t / 3600, t / 60 % 60);
  else
    snprintf(buf, n, "%ldm%02lds", t / 60, t % 60);
}

/* One line per interval: a bar redrawn in place on a terminal, plain lines otherwise. */
static void print_progress(const struct trainer *tr, const struct step_stats *s, bool tty) {
  struct rtp_mem_report r;
  rtp_mem_report_get(tr->ctx, &r);
  char eta[32], ev[64] = "";
  format_duration(s->eta_s, eta, sizeof(eta));
  if (s->eval && s->eval->problems)
    snprintf(ev, sizeof(ev), " | eval %.4f acc %5.1f%%", s->eval->loss, 100 * s->eval->acc);
  else if (s->eval)
    snprintf(ev, sizeof(ev), " | eval %.4f", s->eval->loss);
  if (tty) {
    char bar[21];
    int fill = (int)(20 * s->step / s->steps);
    for (int i = 0; i < 20; i++) bar[i] = i < fill ? '#' : '.';
    bar[20] = 0;
    printf("\r[%s] ", bar);
  }
  printf("step %" PRId64 "/%" PRId64
         " | loss %.4f%s | %.0f tok/s | %.1f ms/step | mem %.1f MiB "
         "rss %.1f MiB | ETA %s%s",
         s->step, s->steps, s->loss, ev, s->tokens_per_s, s->ms, r.total / 1048576.0,
         peak_rss() / 1048576.0, eta, tty && s->step < s->steps ? "\x1b[K" : "\n");
  fflush(stdout);
}

/* ---- the two modes ---------------------------------------------------------------------- */

/* Whether step (1-based) evaluates: every --eval-every steps, else at each progress line. */
static bool evaluates_at(const struct options *o, int64_t step, bool log) {
  return o->eval_every > 0 ? step % o->eval_every == 0 : log;
}

/* The evaluations after step done, for the ETA. */
static int64_t evals_left(const struct options *o, int64_t done, int every) {
  if (o->eval_every > 0) return o->steps / o->eval_every - done / o->eval_every;
  return eta_events_left(done, o->steps, every);
}

static int run_training(struct trainer *tr, const struct dataset *d, const struct options *o,
                        int64_t first, FILE *metrics) {
  int every = o->log_every ? o->log_every : (o->steps >= 20 ? o->steps / 20 : 1);
  bool tty = isatty(STDOUT_FILENO);
  double start = now_s(), tokens = (double)global_batch(tr) * tr->m.cfg.seq_len;
  struct eta_times times = {0};
  struct lr_schedule sched = schedule_of(o);
  for (int64_t step = first; step < o->steps; step++) {
    double t0 = now_s();
    float loss = 0, lr = lr_at(&sched, step);
    int rc = train_step(tr, d, (uint64_t)o->seed, step, lr, &loss);
    if (rc) return rc;
    double dt = now_s() - t0;
    eta_add_step(&times, dt);
    if (!isfinite(loss)) {
      fprintf(stderr, "train-gpt: the loss is %f at step %" PRId64 " (try a lower --lr)\n",
              loss, step + 1);
      return RTP_EINVAL;
    }
    struct step_stats s = {step + 1, o->steps, loss, lr, 1e3 * dt, tokens / dt, 0, NULL};
    struct eval_stats e;
    bool log = s.step % every == 0 || s.step == 1 || s.step == o->steps;
    bool eval = evaluates_at(o, s.step, log);
    if (eval) {
      double te = now_s();
      if ((rc = eval_all(tr, d, o->eval_windows, o->eval_problems, &e))) return rc;
      times.evals++;
      times.evals_s += now_s() - te;
    }
    s.eval = eval ? &e : NULL;
    /* this step's checkpoint is still to come: it is saved after the progress line */
    s.eta_s = eta_left(&times, o->steps - s.step, evals_left(o, s.step, every),
                       o->ckpt_dir ? eta_events_left(s.step - 1, o->steps, o->ckpt_every) : 0);
    if (metrics) write_metrics(metrics, tr, &s);
    if ((log || eval) && shows_progress(tr)) print_progress(tr, &s, tty);
    bool best = o->keep_best && eval && e.loss < tr->best_loss; /* saved, whatever the step */
    if (best) tr->best_loss = e.loss;
    bool ckpt = o->ckpt_dir &&
                ((o->ckpt_every && s.step % o->ckpt_every == 0) || s.step == o->steps || best);
    if (ckpt) {
      double tc = now_s();
      if ((rc = save_checkpoint(tr, o, s.step, best))) return rc;
      times.ckpts++;
      times.ckpts_s += now_s() - tc;
    }
  }
  if (tr->rank == 0)
    printf("trained %" PRId64 " steps in %.1f s\n", o->steps - first, now_s() - start);
  return RTP_OK;
}

/* {"eval_loss": x, "windows": n} over every window of the held-out part (all of --data). */
static int run_eval_only(struct trainer *tr, const struct dataset *d, const struct options *o) {
  struct eval_stats e;
  int rc = eval_all(tr, d, 0, d->builtin ? o->eval_problems : 0, &e);
  if (rc || tr->rank) return rc;
  if (!isfinite(e.loss)) return logits_not_finite();
  printf("{\"eval_loss\": %.9g, \"windows\": %" PRId64, e.loss, e.windows);
  if (e.problems) printf(", \"accuracy\": %.6g, \"problems\": %d", e.acc, e.problems);
  printf("}\n");
  return RTP_OK;
}

/* ---- main ----------------------------------------------------------------------------------
 */

/* Whether the run reads the data: to train, to evaluate, or for the prompt of a sample. */
static bool uses_data(const struct options *o, const struct rtp_ckpt *ck) {
  return o->eval_only || (!ck && o->steps > 0) || (o->sample && !o->prompt);
}

/* The model's vocabulary: that of the model read (--init's metadata or a GPT-2's shapes,
 * or the checkpoint's state), else the data's. A model read must fit the data it uses: a byte
 * model (256) bytes, a token model tokens below its vocabulary. */
static int resolve_vocab(const struct options *o, struct rtp_safetensors *init,
                         const struct rtp_ckpt *ck, const struct dataset *d,
                         struct gpt_config *c) {
  const char *s = ck ? rtp_ckpt_state(ck, "vocab") : NULL;
  char *end;
  long saved = s ? strtol(s, &end, 10) : 0;
  int v = 0;
  if (init && meta_int(init, "vocab", &v) == 1)
    c->vocab = v;
  else if (init && gpt_hf_detect(init))
    ; /* a GPT-2's is its wte's rows, which resolve_config read */
  else if (s && *s && !*end && saved > 0 && saved <= GPT_MAX_SIZE)
    c->vocab = (int)saved;
  else
    c->vocab = d->train.vocab;
  bool bytes = strcmp(d->train.kind, "bytes") == 0;
  if (!uses_data(o, ck) || (bytes ? c->vocab == 256 : d->train.vocab <= c->vocab))
    return RTP_OK;
  fprintf(stderr,
          "train-gpt: %s holds %s (vocabulary %d), the model (%s) has a vocabulary of %d: %s\n",
          o->data ? o->data : "the built-in task", d->train.kind, d->train.vocab,
          init ? o->init : "the checkpoint", c->vocab,
          bytes ? "give --data its tokens (an llm.c .bin, or uint16 with --vocab N)"
                : "give --vocab N to say the tokens are below N");
  return RTP_EINVAL;
}

static int open_inputs(struct options *o, const struct rtp_ckpt *ck,
                       struct rtp_safetensors **init, struct gpt_config *c, struct dataset *d) {
  if (o->init && rtp_safetensors_open(o->init, init))
    return fail(RTP_EIO, "--init %s", o->init);
  int rc = resolve_config(o, *init, ck, c);
  if (rc) return rc;
  rc = o->data ? load_data_files(o, d) : make_addition_task(d);
  if (!rc) rc = resolve_vocab(o, *init, ck, d, c);
  return rc ? rc : check_data(d, c->seq_len, o);
}

static int metrics_error(const char *name) {
  fprintf(stderr, "train-gpt: --metrics %s: %s\n", name, strerror(errno));
  return RTP_EIO;
}

/* The step a metrics line starts with (write_metrics); false if it has none. */
static bool metrics_step(const char *line, int64_t *step) {
  static const char key[] = "{\"step\": ";
  if (strncmp(line, key, sizeof(key) - 1) != 0) return false;
  const char *digits = line + sizeof(key) - 1;
  char *end;
  errno = 0;
  long long v = strtoll(digits, &end, 10);
  *step = v;
  return end != digits && !errno;
}

/* A resumed run continues the curve in the file: the lines of steps up to the checkpoint's
 * (last) are kept, those of later steps, which the stopped run logged after its last
 * checkpoint, dropped. The kept lines go to FILE.tmp, renamed over FILE, so a crash here
 * leaves FILE as it was. A line without a step is not train-gpt's to judge: it is kept, with
 * a warning, and so is a last line cut short (given its newline) if its step is kept. */
static int keep_metrics_until(const char *name, int64_t last) {
  FILE *in = fopen(name, "r");
  if (!in) return errno == ENOENT ? RTP_OK : metrics_error(name);
  char tmp[4200];
  snprintf(tmp, sizeof(tmp), "%s.tmp", name);
  FILE *out = fopen(tmp, "w");
  char *line = NULL;
  size_t cap = 0;
  ssize_t len;
  for (int64_t n = 1; out && (len = getline(&line, &cap, in)) > 0; n++) {
    int64_t step;
    bool has_step = metrics_step(line, &step);
    if (has_step && step > last) continue;
    if (!has_step)
      fprintf(stderr, "train-gpt: warning: --metrics %s: line %" PRId64 " has no step: kept\n",
              name, n);
    fwrite(line, 1, (size_t)len, out);
    if (line[len - 1] != '\n') fputc('\n', out);
  }
  free(line);
  bool bad = ferror(in) || !out || fflush(out) || fsync(fileno(out)) || ferror(out);
  fclose(in);
  if (out && fclose(out)) bad = true;
  if (!bad && rename(tmp, name) == 0) return RTP_OK;
  int rc = metrics_error(name);
  remove(tmp);
  return rc;
}

/* Rank 0 writes FILE, rank k FILE.rank<k>: anew, or after --resume from step resumed (-1:
 * none) appended to the curve of the run it continues. */
static int open_metrics(const struct trainer *tr, const char *path, int64_t resumed, FILE **f) {
  char name[4096];
  if (tr->rank == 0)
    snprintf(name, sizeof(name), "%s", path);
  else
    snprintf(name, sizeof(name), "%s.rank%d", path, tr->rank);
  if (resumed >= 0 && keep_metrics_until(name, resumed)) return RTP_EIO;
  if ((*f = fopen(name, resumed >= 0 ? "a" : "w"))) return RTP_OK;
  return metrics_error(name);
}

static void print_model(const struct trainer *tr, const struct options *o) {
  struct gpt_config c = tr->m.cfg;
  char ranks[160] = "", micro[48] = "", accum[96] = "";
  if (tr->micro > 1 && !tr->het.n)
    snprintf(micro, sizeof(micro), " in %d micro-batches", tr->micro);
  if (tr->accum > 1)
    snprintf(accum, sizeof(accum), " x %d accumulated (%" PRId64 " tokens per step)", tr->accum,
             global_batch(tr) * c.seq_len);
  if (tr->het.n)
    snprintf(ranks, sizeof(ranks), " in %d units on %d ranks (stages %s, %s)", o->micro_batches,
             tr->world, o->stages, o->schedule);
  else if (tr->strategy == RTP_STRATEGY_TP)
    snprintf(ranks, sizeof(ranks), " on each of %d ranks (tp)", tr->world);
  else if (tr->stages > 1)
    snprintf(ranks, sizeof(ranks), " x %d ranks (%d pipeline stages x %d ranks, %s inside, %s)",
             tr->per_stage, tr->stages, tr->per_stage,
             tr->group ? rtp_strategy_name(tr->strategy) : "one rank", o->schedule);
  else if (tr->world > 1)
    snprintf(ranks, sizeof(ranks), " x %d ranks (%s)", tr->world,
             rtp_strategy_name(tr->strategy));
  char data[96] = "";
  if (c.vocab != 256) snprintf(data, sizeof(data), ", vocabulary %d", c.vocab);
  printf(
      "model: %d layers, d_model %d, %d heads, seq_len %d, %.2fM parameters%s%s; batch "
      "%d%s%s%s, lr %g, %s data%s%s; on %s\n",
      c.n_layer, c.d_model, c.n_head, c.seq_len, gpt_n_params(c) / 1e6, data,
      c.tie_embeddings ? " (tied embeddings)" : "", o->batch, micro, ranks, accum, o->lr,
      o->data ? o->data : "built-in addition", o->val_data ? ", evaluated on " : "",
      o->val_data ? o->val_data : "", tr->dev->name);
  fflush(stdout); /* before the slow work: under rtp-run stdout is a pipe */
}

static int run(struct options *o) {
  struct rtp_safetensors *init = NULL;
  struct rtp_ckpt *ck = NULL; /* a checkpoint read as the model (reads_checkpoint) */
  struct gpt_config cfg;
  struct dataset data = {0};
  struct prompt prompt = {0};
  struct trainer tr = {0};
  struct device dev;
  FILE *metrics = NULL;
  int64_t first = 0; /* the step the weights are at: 0, or their checkpoint's */
  int rc = device_open(o->device, &dev);
  if (rc) rc = fail(rc, "--device %s", o->device);
  /* The CUDA backend has no fused attention kernel yet (docs/attention.md). */
  if (!o->fused_attn) o->fused_attn = device_is_gpu(&dev) ? "off" : "on";
  if (!rc && reads_checkpoint(o)) {
    rc = o->keep_best ? rtp_ckpt_open_best(o->ckpt_dir, &ck) : rtp_ckpt_open(o->ckpt_dir, &ck);
    if (rc) rc = fail(rc, "--ckpt-dir %s", o->ckpt_dir);
  }
  if (!rc) rc = open_inputs(o, ck, &init, &cfg, &data);
  if (!rc && o->sample) rc = parse_prompt(o, cfg.vocab, &prompt);
  if (!rc) rc = trainer_init(&tr, &dev, cfg, o, !o->eval_only && !ck);
  bool trains = !o->eval_only && !ck && o->steps > 0;
  if (!rc && trains && shows_progress(&tr)) print_model(&tr, o);
  if (!rc && !o->resume) rc = resolve_schedule(o, NULL);
  if (!rc && o->resume)
    rc = resume(&tr, o, &first);
  else if (!rc && ck)
    rc = load_checkpoint(&tr, o, ck, &first);
  else if (!rc)
    rc = init ? load_init(&tr, init, o->init) : init_weights(&tr, (uint64_t)o->seed);
  if (!rc && init) rc = check_init_finite(&tr, o->init);
  if (!rc && o->metrics) rc = open_metrics(&tr, o->metrics, o->resume ? first : -1, &metrics);
  bool train = trains && o->steps > first;
  if (!rc && train) rc = run_training(&tr, &data, o, first, metrics);
  if (!rc && o->eval_only) rc = run_eval_only(&tr, &data, o);
  /* the export before the sample: rank 0 alone decodes, the others are done by then */
  if (!rc && o->export_path)
    rc = export_model(&tr, o->export_path, o->format, train ? o->steps : first);
  if (!rc && o->sample) rc = run_sample(&tr, &data, o, &prompt);
  if (metrics && fclose(metrics) && !rc) rc = fail(RTP_EIO, "--metrics %s", o->metrics);
  trainer_free(&tr);
  device_close(&dev);
  rtp_ckpt_close(ck);
  rtp_safetensors_close(init);
  free(data.file);
  free(data.val_file);
  free(prompt.tok);
  return rc;
}

int main(int argc, char **argv) {
  struct options o;
  int rc = parse_args(argc, argv, &o);
  if (rc) return rc;
  if (o.help) {
    print_usage(stdout);
    return 0;
  }
  rc = check_options(&o);
  if (rc) return rc;
  if (o.steps < 0) o.steps = 200; /* left out; -1 until check_options saw whether it was */
  rc = run(&o);
  return rc == EXIT_USAGE ? EXIT_USAGE : rc ? 1 : 0;
}
