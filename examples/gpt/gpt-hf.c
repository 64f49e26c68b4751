/* gpt-hf.c - Hugging Face's GPT-2 files in and out of the reference GPT (gpt-hf.h). */
#include "gpt-hf.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static _Thread_local char hf_msg[512];

const char *gpt_hf_error(void) {
  return hf_msg;
}

static int hf_error(int rc, const char *fmt, ...) RTP_PRINTF(2, 3);
static int hf_error(int rc, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(hf_msg, sizeof(hf_msg), fmt, ap);
  va_end(ap);
  return rc;
}

/* ---- names ---------------------------------------------------------------------------- */

/* GPT2LMHeadModel's names ("transformer.wte.weight") or GPT2Model's ("wte.weight", as in
 * the original gpt2 files); NULL: neither. */
static const char *hf_prefix(const struct rtp_safetensors *st) {
  if (rtp_safetensors_find(st, "transformer.wte.weight") >= 0) return "transformer.";
  if (rtp_safetensors_find(st, "wte.weight") >= 0) return "";
  return NULL;
}

/* The file's name of our parameter `name` (gpt_build's names are GPT2LMHeadModel's). */
static void hf_name(const char *prefix, const char *name, char *out, size_t n) {
  static const char ours[] = "transformer.";
  if (strncmp(name, ours, sizeof(ours) - 1) == 0)
    snprintf(out, n, "%s%s", prefix, name + sizeof(ours) - 1);
  else
    snprintf(out, n, "%s", name);
}

static bool ends_with(const char *s, const char *tail) {
  size_t a = strlen(s), b = strlen(tail);
  return a >= b && strcmp(s + a - b, tail) == 0;
}

/* HF's projections are Conv1D: weights stored [in, out], the transpose of nn.Linear's. */
static bool is_conv1d(const char *name) {
  return ends_with(name, ".c_attn.weight") || ends_with(name, ".c_proj.weight") ||
         ends_with(name, ".c_fc.weight");
}

bool gpt_hf_detect(const struct rtp_safetensors *st) {
  const char *prefix = hf_prefix(st);
  char name[128];
  int64_t ne[RTP_MAX_DIMS];
  int dims;
  if (!prefix) return false;
  snprintf(name, sizeof(name), "%sh.0.attn.c_attn.weight", prefix);
  int i = rtp_safetensors_find(st, name);
  return i >= 0 && rtp_safetensors_info(st, i, NULL, NULL, &dims, ne) == 0 && dims == 2 &&
         ne[0] == 3 * ne[1];
}

/* Whether file tensor `name` (prefix removed) belongs to a GPT-2 of n_layer blocks. */
static bool hf_known(const char *name, int n_layer) {
  static const char *const top[] = {"wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias"};
  static const char *const block[] = {
      "ln_1.weight",        "ln_1.bias",        "attn.c_attn.weight", "attn.c_attn.bias",
      "attn.c_proj.weight", "attn.c_proj.bias", "ln_2.weight",        "ln_2.bias",
      "mlp.c_fc.weight",    "mlp.c_fc.bias",    "mlp.c_proj.weight",  "mlp.c_proj.bias",
      "attn.bias",          "attn.masked_bias"}; /* the last two: old files' mask buffers */
  for (size_t k = 0; k < sizeof(top) / sizeof(top[0]); k++)
    if (strcmp(name, top[k]) == 0) return true;
  int layer, used = 0;
  if (sscanf(name, "h.%d.%n", &layer, &used) != 1 || used == 0 || layer < 0 || layer >= n_layer)
    return false;
  for (size_t k = 0; k < sizeof(block) / sizeof(block[0]); k++)
    if (strcmp(name + used, block[k]) == 0) return true;
  return false;
}

/* Every tensor of the file is GPT-2's: another model's would otherwise be half read. */
static int hf_check_names(const char *path, const struct rtp_safetensors *st,
                          const char *prefix, int n_layer) {
  size_t plen = strlen(prefix);
  for (int i = 0; i < rtp_safetensors_count(st); i++) {
    const char *name;
    rtp_safetensors_info(st, i, &name, NULL, NULL, NULL);
    bool ok = strcmp(name, "lm_head.weight") == 0 ||
              (strncmp(name, prefix, plen) == 0 && hf_known(name + plen, n_layer));
    if (!ok)
      return hf_error(RTP_EFORMAT,
                      "%s: tensor '%s' is not one of a GPT-2 of %d blocks (GPT2LMHeadModel)",
                      path, name, n_layer);
  }
  return RTP_OK;
}

/* ---- config.json: its top-level keys ------------------------------------------------ */

/* Where the value of top-level key `key` starts in the JSON object text, or NULL. Strings
 * are skipped whole (escapes included), so a key nested deeper or inside a string does
 * not match. */
static const char *json_top(const char *text, const char *key) {
  int depth = 0;
  bool want_key = false;
  size_t klen = strlen(key);
  for (const char *s = text; *s; s++) {
    if (*s == '"') {
      const char *start = s + 1;
      for (s++; *s && *s != '"'; s++)
        if (*s == '\\' && s[1]) s++;
      if (!*s) return NULL;
      if (depth == 1 && want_key && (size_t)(s - start) == klen &&
          strncmp(start, key, klen) == 0) {
        const char *v = s + 1;
        while (*v == ' ' || *v == '\t' || *v == '\n' || *v == '\r') v++;
        if (*v != ':') return NULL;
        for (v++; *v == ' ' || *v == '\t' || *v == '\n' || *v == '\r';) v++;
        return v;
      }
      want_key = false;
    } else if (*s == '{' || *s == '[') {
      depth++;
      want_key = *s == '{' && depth == 1;
    } else if (*s == '}' || *s == ']') {
      depth--;
    } else if (*s == ',' && depth == 1) {
      want_key = true;
    }
  }
  return NULL;
}

/* A JSON integer value at v into *out; false if it is not one in 1 .. 2^30. */
static bool json_int(const char *v, int *out) {
  char *end;
  errno = 0;
  long x = v ? strtol(v, &end, 10) : 0;
  if (!v || end == v || errno || x < 1 || x > 1 << 30 || *end == '.' || *end == 'e' ||
      *end == 'E')
    return false;
  *out = (int)x;
  return true;
}

static bool json_is(const char *v, const char *literal) {
  return v && strncmp(v, literal, strlen(literal)) == 0;
}

struct hf_json {
  const char *path;
  const char *text;
};

/* Integer key `key`, if config.json has it, must be `want` (what the shapes say). */
static int json_expect_int(const struct hf_json *j, const char *key, int want) {
  const char *v = json_top(j->text, key);
  int got;
  if (!v || json_is(v, "null")) return RTP_OK;
  if (!json_int(v, &got))
    return hf_error(RTP_EFORMAT, "%s: \"%s\" is not a positive integer", j->path, key);
  if (got != want)
    return hf_error(RTP_EFORMAT, "%s: \"%s\" is %d, the weights have %d", j->path, key, got,
                    want);
  return RTP_OK;
}

/* The settings under which HF's GPT-2 computes what ours does; any other is refused. */
static int json_check_model(const struct hf_json *j, int d) {
  const char *act = json_top(j->text, "activation_function");
  if (act && !json_is(act, "\"gelu_new\"") && !json_is(act, "\"gelu_pytorch_tanh\"") &&
      !json_is(act, "\"gelu_fast\""))
    return hf_error(RTP_EFORMAT,
                    "%s: activation_function %.20s: the reference GPT has GELU's tanh "
                    "approximation only (gelu_new, GPT-2's)",
                    j->path, act);
  const char *eps = json_top(j->text, "layer_norm_epsilon");
  if (eps && fabs(strtod(eps, NULL) - 1e-5) > 1e-12)
    return hf_error(RTP_EFORMAT,
                    "%s: layer_norm_epsilon %.20s: the reference GPT's LayerNorm has 1e-5",
                    j->path, eps);
  const char *inner = json_top(j->text, "n_inner");
  int n_inner;
  if (inner && !json_is(inner, "null") && (!json_int(inner, &n_inner) || n_inner != 4 * d))
    return hf_error(RTP_EFORMAT, "%s: n_inner %.20s: the reference GPT's MLP has 4 x %d units",
                    j->path, inner, d);
  if (json_is(json_top(j->text, "scale_attn_weights"), "false") ||
      json_is(json_top(j->text, "scale_attn_by_inverse_layer_idx"), "true") ||
      json_is(json_top(j->text, "add_cross_attention"), "true"))
    return hf_error(RTP_EFORMAT,
                    "%s: its attention is not GPT-2's (scale_attn_weights false, "
                    "scale_attn_by_inverse_layer_idx or add_cross_attention true)",
                    j->path);
  const char *type = json_top(j->text, "model_type");
  if (type && !json_is(type, "\"gpt2\""))
    return hf_error(RTP_EFORMAT, "%s: model_type %.20s is not gpt2", j->path, type);
  return RTP_OK;
}

/* path's directory's config.json into a buffer to free; *found false if there is none. */
static int read_config_json(const char *path, char *json_path, size_t n, char **text,
                            bool *found) {
  const char *slash = strrchr(path, '/');
  int dir = slash ? (int)(slash - path) : 0;
  if (slash)
    snprintf(json_path, n, "%.*s/config.json", dir, path);
  else
    snprintf(json_path, n, "config.json");
  *text = NULL;
  *found = access(json_path, F_OK) == 0;
  if (!*found) return RTP_OK;
  int rc = rtp_file_read(json_path, 1 << 20, (void **)text, NULL);
  return rc ? hf_error(rc, "%s", rtp_last_error()) : RTP_OK;
}

/* ---- reading -------------------------------------------------------------------------- */

static int hf_shape(const struct rtp_safetensors *st, const char *name, int64_t ne[4]) {
  int i = rtp_safetensors_find(st, name), dims;
  if (i < 0 || rtp_safetensors_info(st, i, NULL, NULL, &dims, ne) || dims != 2) return -1;
  return 0;
}

/* n_head and the tying from config.json (fields checked), else from the caller and the
 * file. */
static int hf_config_json(const char *path, const struct rtp_safetensors *st, int n_head,
                          struct gpt_config *c) {
  char json_path[4096];
  char *text;
  bool found;
  int rc = read_config_json(path, json_path, sizeof(json_path), &text, &found);
  if (rc) return rc;
  c->tie_embeddings = rtp_safetensors_find(st, "lm_head.weight") < 0;
  c->n_head = n_head;
  if (!found && n_head <= 0)
    return hf_error(RTP_EINVAL,
                    "%s: the number of heads is in no tensor's shape and there is no %s: "
                    "give --n-head N, or put the model's config.json beside it",
                    path, json_path);
  if (!found) return RTP_OK;
  struct hf_json j = {json_path, text};
  const char *keys[] = {"vocab_size", "n_positions", "n_embd", "n_layer"};
  const int want[] = {c->vocab, c->seq_len, c->d_model, c->n_layer};
  for (int k = 0; k < 4 && !rc; k++) rc = json_expect_int(&j, keys[k], want[k]);
  if (!rc) rc = json_check_model(&j, c->d_model);
  const char *h = json_top(text, "n_head");
  int heads = 0;
  if (!rc && h && !json_int(h, &heads))
    rc = hf_error(RTP_EFORMAT, "%s: \"n_head\" is not a positive integer", json_path);
  if (!rc && !h && n_head <= 0)
    rc = hf_error(RTP_EINVAL, "%s has no \"n_head\": give --n-head N", json_path);
  if (!rc && h && n_head > 0 && n_head != heads)
    rc = hf_error(RTP_EINVAL, "%s says n_head %d, --n-head says %d", json_path, heads, n_head);
  if (!rc && h) c->n_head = heads;
  if (!rc) c->tie_embeddings = !json_is(json_top(text, "tie_word_embeddings"), "false");
  free(text);
  return rc;
}

int gpt_hf_config(const char *path, const struct rtp_safetensors *st, int n_head,
                  struct gpt_config *c) {
  const char *prefix = hf_prefix(st);
  char name[128];
  int64_t wte[4], wpe[4];
  if (!prefix || !gpt_hf_detect(st))
    return hf_error(RTP_EFORMAT,
                    "%s: not a Hugging Face GPT-2 (no wte.weight, or no Conv1D "
                    "h.0.attn.c_attn.weight [d, 3d])",
                    path);
  snprintf(name, sizeof(name), "%swpe.weight", prefix);
  if (hf_shape(st, prefix[0] ? "transformer.wte.weight" : "wte.weight", wte) ||
      hf_shape(st, name, wpe) || wpe[0] != wte[0])
    return hf_error(RTP_EFORMAT, "%s: wte and wpe must be [vocab, d] and [n_positions, d]",
                    path);
  *c =
      (struct gpt_config){.vocab = (int)wte[1], .seq_len = (int)wpe[1], .d_model = (int)wte[0]};
  for (;; c->n_layer++) {
    snprintf(name, sizeof(name), "%sh.%d.ln_1.weight", prefix, c->n_layer);
    if (rtp_safetensors_find(st, name) < 0) break;
  }
  int rc = hf_check_names(path, st, prefix, c->n_layer);
  if (!rc) rc = hf_config_json(path, st, n_head, c);
  if (!rc && gpt_config_check(*c))
    rc = hf_error(RTP_EINVAL,
                  "%s: vocab %d, n_positions %d, n_embd %d, %d blocks, %d heads: not a model "
                  "the reference GPT builds (sizes 1..%d, 1..%d blocks, heads dividing n_embd)",
                  path, c->vocab, c->seq_len, c->d_model, c->n_layer, c->n_head, GPT_MAX_SIZE,
                  GPT_MAX_LAYERS);
  return rc;
}

/* A tensor header of shape ne over data, for the reads (a context of headers alone). */
static struct rtp_tensor *header(struct rtp_context *ctx, int64_t ne0, int64_t ne1,
                                 float *data) {
  struct rtp_tensor *t = ne1 > 1 ? rtp_tensor_new_2d(ctx, RTP_TYPE_F32, ne0, ne1)
                                 : rtp_tensor_new_1d(ctx, RTP_TYPE_F32, ne0);
  if (t) t->data = data;
  return t;
}

int gpt_hf_read(struct rtp_safetensors *st, const struct rtp_tensor *p, float *full) {
  const char *prefix = hf_prefix(st);
  char name[160];
  if (!prefix) return hf_error(RTP_EFORMAT, "not a Hugging Face GPT-2 file");
  hf_name(prefix, p->name, name, sizeof(name));
  int64_t in = p->ne[0], out = p->ne[1], n = in * out;
  bool conv = is_conv1d(p->name);
  struct rtp_context *ctx =
      rtp_context_new((struct rtp_init_params){.mem_size = 16u << 10, .no_alloc = true});
  float *stored = conv ? malloc((size_t)n * sizeof(float)) : full;
  int rc = ctx && stored ? RTP_OK : RTP_ENOMEM;
  struct rtp_tensor *t = rc     ? NULL
                         : conv ? header(ctx, out, in, stored)
                                : header(ctx, in, out, full);
  if (!rc && !t) rc = RTP_ENOMEM;
  /* wpe: its first seq_len positions, which may be fewer than the file's */
  if (!rc)
    rc = ends_with(name, "wpe.weight") ? rtp_safetensors_read_rows(st, name, 0, t)
                                       : rtp_safetensors_read(st, name, t);
  if (!rc && conv) /* stored [in][out] -> ours [out][in] */
    for (int64_t i = 0; i < in; i++)
      for (int64_t o = 0; o < out; o++) full[o * in + i] = stored[i * out + o];
  if (conv) free(stored);
  rtp_context_free(ctx);
  if (rc == RTP_ENOMEM) return hf_error(rc, "%s: out of memory", name);
  return rc ? hf_error(rc, "%s", rtp_last_error()) : RTP_OK;
}

/* ---- writing -------------------------------------------------------------------------- */

/* config.json: GPT2Config's fields for this model (no dropout: rtp trains without), written
 * to a temporary file renamed over it. */
static int write_config_json(const char *path, struct gpt_config c) {
  char json_path[4096], tmp[4200];
  char *text = NULL;
  bool found;
  int rc = read_config_json(path, json_path, sizeof(json_path), &text, &found);
  free(text);
  if (rc) return rc;
  snprintf(tmp, sizeof(tmp), "%s.tmp", json_path);
  FILE *f = fopen(tmp, "w");
  if (!f) return hf_error(RTP_EIO, "%s: %s", tmp, strerror(errno));
  fprintf(
      f,
      "{\n  \"architectures\": [\"GPT2LMHeadModel\"],\n  \"model_type\": \"gpt2\",\n"
      "  \"vocab_size\": %d,\n  \"n_positions\": %d,\n  \"n_ctx\": %d,\n"
      "  \"n_embd\": %d,\n  \"n_layer\": %d,\n  \"n_head\": %d,\n  \"n_inner\": null,\n"
      "  \"activation_function\": \"gelu_new\",\n  \"layer_norm_epsilon\": 1e-05,\n"
      "  \"resid_pdrop\": 0.0,\n  \"embd_pdrop\": 0.0,\n  \"attn_pdrop\": 0.0,\n"
      "  \"scale_attn_weights\": true,\n  \"tie_word_embeddings\": %s,\n"
      "  \"bos_token_id\": %d,\n  \"eos_token_id\": %d,\n  \"torch_dtype\": \"float32\"\n}\n",
      c.vocab, c.seq_len, c.seq_len, c.d_model, c.n_layer, c.n_head,
      c.tie_embeddings ? "true" : "false", c.vocab - 1, c.vocab - 1);
  bool bad = ferror(f) != 0;
  if (fclose(f)) bad = true;
  if (bad || rename(tmp, json_path)) {
    remove(tmp);
    return hf_error(RTP_EIO, "%s: %s", json_path, strerror(errno ? errno : EIO));
  }
  return RTP_OK;
}

int gpt_hf_save(const char *path, struct gpt_config c, struct rtp_tensor *const *t, int n) {
  size_t bytes = (size_t)n * 1024 + (1u << 16);
  for (int i = 0; i < n; i++)
    if (is_conv1d(t[i]->name)) bytes += (size_t)rtp_tensor_nbytes(t[i]) + 256;
  struct rtp_tensor **out = malloc(sizeof(*out) * (size_t)(n > 0 ? n : 1));
  struct rtp_context *ctx = rtp_context_new((struct rtp_init_params){.mem_size = bytes});
  int rc = out && ctx ? RTP_OK : hf_error(RTP_ENOMEM, "%s: out of memory", path);
  for (int i = 0; i < n && !rc; i++) {
    out[i] = t[i];
    if (!is_conv1d(t[i]->name)) continue;
    int64_t in = t[i]->ne[0], o = t[i]->ne[1];
    out[i] = rtp_tensor_set_name(rtp_tensor_new_2d(ctx, RTP_TYPE_F32, o, in), "%s", t[i]->name);
    if (!out[i]) {
      rc = hf_error(RTP_ENOMEM, "%s: out of memory", path);
      break;
    }
    const float *src = t[i]->data;
    float *dst = out[i]->data;
    for (int64_t r = 0; r < o; r++) /* ours [out][in] -> stored [in][out] */
      for (int64_t k = 0; k < in; k++) dst[k * o + r] = src[r * in + k];
  }
  const char *meta[] = {"format", "pt", NULL}; /* transformers refuses files without it */
  int saved = rc ? rc : rtp_safetensors_save(path, out, n, meta);
  if (!rc && saved) rc = hf_error(saved, "%s", rtp_last_error());
  if (!rc) rc = write_config_json(path, c);
  rtp_context_free(ctx);
  free(out);
  return rc;
}
