/* rtp.c - contexts and arenas, tensors, op builders, graphs. */
#include "rtp-backend.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *const op_names[RTP_OP_COUNT] = {
#define RTP_XX(name, text) text,
    RTP_OP_MAP(RTP_XX)
#undef RTP_XX
};

const char *rtp_op_name(enum rtp_op op) {
  return (unsigned)op < RTP_OP_COUNT ? op_names[op] : "?";
}

const char *rtp_type_name(enum rtp_type type) {
  static const char *const names[RTP_TYPE_COUNT] = {"f32", "i32", "bf16"};
  return (unsigned)type < RTP_TYPE_COUNT ? names[type] : "?";
}

const char *rtp_role_name(enum rtp_role role) {
  static const char *const names[RTP_ROLE_COUNT] = {"activations", "params", "grads",
                                                    "optim",       "inputs", "comm"};
  return (unsigned)role < RTP_ROLE_COUNT ? names[role] : "?";
}

size_t rtp_type_size(enum rtp_type type) {
  switch (type) {
    case RTP_TYPE_F32:
    case RTP_TYPE_I32:
      return 4;
    case RTP_TYPE_BF16:
      return 2;
    default:
      return 0;
  }
}

/* ---- tensor queries ------------------------------------------------------------ */

int64_t rtp_tensor_nelements(const struct rtp_tensor *t) {
  return t->ne[0] * t->ne[1] * t->ne[2] * t->ne[3];
}

int64_t rtp_tensor_nrows(const struct rtp_tensor *t) {
  return t->ne[1] * t->ne[2] * t->ne[3];
}

size_t rtp_tensor_nbytes(const struct rtp_tensor *t) {
  if (rtp_tensor_nelements(t) == 0) return 0;
  size_t n = rtp_type_size(t->type);
  for (int i = 0; i < RTP_MAX_DIMS; i++) n += (size_t)(t->ne[i] - 1) * t->nb[i];
  return n;
}

int rtp_tensor_n_dims(const struct rtp_tensor *t) {
  for (int i = RTP_MAX_DIMS - 1; i >= 1; i--)
    if (t->ne[i] > 1) return i + 1;
  return 1;
}

bool rtp_tensor_is_contiguous(const struct rtp_tensor *t) {
  size_t nb = rtp_type_size(t->type);
  for (int i = 0; i < RTP_MAX_DIMS; i++) {
    if (t->ne[i] != 1 && t->nb[i] != nb) return false;
    nb *= (size_t)t->ne[i];
  }
  return true;
}

bool rtp_tensor_same_shape(const struct rtp_tensor *a, const struct rtp_tensor *b) {
  return memcmp(a->ne, b->ne, sizeof(a->ne)) == 0;
}

bool rtp__rows_contiguous(const struct rtp_tensor *t) {
  return t->ne[0] == 1 || t->nb[0] == rtp_type_size(t->type);
}

void rtp__shape_str(const struct rtp_tensor *t, char *buf, size_t n) {
  if (!t) {
    snprintf(buf, n, "(null)");
    return;
  }
  snprintf(buf, n, "%s'%s'[%lld,%lld,%lld,%lld]", rtp_type_name(t->type), t->name,
           (long long)t->ne[0], (long long)t->ne[1], (long long)t->ne[2], (long long)t->ne[3]);
}

/* ---- context and arena ---------------------------------------------------------- */

struct rtp_context {
  uint8_t *mem;
  size_t mem_size;
  size_t used;
  bool own_mem;
  bool no_alloc;
  int n_tensors;
  struct rtp_tensor_obj *first, *last;
  size_t activation_peak; /* planned activation buffers */
  size_t activation_sum;
  size_t activation_live;
  size_t work;
  int err;
  char errmsg[512];
  /* With a device backend, tensor data comes from this second arena in device memory. */
  struct rtp_backend *backend;
  uint8_t *data;
  size_t data_size, data_used;
};

/* A tensor as the context keeps it: the public struct first, so a tensor pointer is an
 * object pointer. */
struct rtp_tensor_obj {
  struct rtp_tensor t;
  struct rtp_tensor_obj *next;
  struct rtp_context *ctx;
  size_t data_bytes; /* arena bytes this tensor's own data took */
};

/* Device memory is taken once, here; tensors and plans then carve it like the host arena. */
static int init_device_arena(struct rtp_context *ctx, struct rtp_backend *b, size_t size) {
  ctx->backend = b;
  if (size == 0) return RTP_OK;
  void *mem = NULL;
  int rc = b->i->alloc(b, size, &mem);
  if (rc) { /* the backend's message names the device and its free memory */
    char why[400];
    snprintf(why, sizeof(why), "%s", rtp_last_error());
    return rtp__error(rc, "rtp_context_new: data_size of %zu bytes: %s", size, why);
  }
  ctx->data = mem;
  ctx->data_size = size;
  ctx->data_used = (size_t)(-(uintptr_t)ctx->data & (RTP_ALIGN - 1));
  return RTP_OK;
}

struct rtp_context *rtp_context_new(struct rtp_init_params p) {
  rtp__gemm_init();
  struct rtp_context *ctx = calloc(1, sizeof(*ctx));
  if (!ctx) {
    rtp__error(RTP_ENOMEM, "rtp_context_new: cannot allocate the context");
    return NULL;
  }
  ctx->mem_size = p.mem_size;
  ctx->no_alloc = p.no_alloc;
  ctx->mem = p.mem_buffer;
  if (!ctx->mem && p.mem_size > 0) {
    /* Padding a size near SIZE_MAX would wrap to a tiny block. */
    ctx->mem = p.mem_size <= SIZE_MAX - RTP_ALIGN
                   ? aligned_alloc(RTP_ALIGN, RTP_PAD(p.mem_size, RTP_ALIGN))
                   : NULL;
    ctx->own_mem = true;
    if (!ctx->mem) {
      rtp__error(RTP_ENOMEM, "rtp_context_new: cannot allocate an arena of %zu bytes",
                 p.mem_size);
      free(ctx);
      return NULL;
    }
  }
  ctx->used = (size_t)(-(uintptr_t)ctx->mem & (RTP_ALIGN - 1)); /* align the start */
  if (p.backend && init_device_arena(ctx, p.backend, p.data_size)) {
    rtp_context_free(ctx);
    return NULL;
  }
  return ctx;
}

void rtp_context_free(struct rtp_context *ctx) {
  if (!ctx) return;
  if (ctx->data) ctx->backend->i->release(ctx->backend, ctx->data);
  if (ctx->own_mem) free(ctx->mem);
  free(ctx);
}

struct rtp_backend *rtp__ctx_backend(const struct rtp_context *ctx) {
  return ctx ? ctx->backend : NULL;
}

struct rtp_backend *rtp__tensor_backend(const struct rtp_tensor *t) {
  while (t->view_src) t = t->view_src;
  if (!(t->flags & RTP__FLAG_OWNED)) return NULL;
  return rtp__ctx_backend(((const struct rtp_tensor_obj *)t)->ctx);
}

int rtp_context_error(const struct rtp_context *ctx, const char **msg) {
  if (msg) *msg = ctx->errmsg;
  return ctx->err;
}

size_t rtp_context_used_mem(const struct rtp_context *ctx) {
  return ctx->used;
}

int rtp__ctx_error(struct rtp_context *ctx, int status, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  rtp__verror(status, fmt, ap);
  va_end(ap);
  if (ctx && ctx->err == RTP_OK) {
    ctx->err = status;
    snprintf(ctx->errmsg, sizeof(ctx->errmsg), "%s", rtp_last_error());
  }
  return status;
}

void *rtp__ctx_alloc(struct rtp_context *ctx, size_t size, const char *what) {
  size_t need = RTP_PAD(size, RTP_ALIGN);
  if (size > ctx->mem_size || need > ctx->mem_size - ctx->used) {
    rtp__ctx_error(ctx, RTP_ENOMEM,
                   "arena full: %s needs %zu bytes but %zu of %zu are left (raise mem_size)",
                   what, need, ctx->mem_size - ctx->used, ctx->mem_size);
    return NULL;
  }
  void *p = ctx->mem + ctx->used;
  ctx->used += need;
  return p;
}

void *rtp__ctx_data_alloc(struct rtp_context *ctx, size_t size, const char *what) {
  if (!ctx->backend) return rtp__ctx_alloc(ctx, size, what);
  size_t need = RTP_PAD(size, RTP_ALIGN);
  if (size > ctx->data_size || need > ctx->data_size - ctx->data_used) {
    rtp__ctx_error(ctx, RTP_ENOMEM,
                   "%s memory full: %s needs %zu bytes but %zu of %zu are left (raise "
                   "data_size)",
                   ctx->backend->i->name, what, need, ctx->data_size - ctx->data_used,
                   ctx->data_size);
    return NULL;
  }
  void *p = ctx->data + ctx->data_used;
  ctx->data_used += need;
  return p;
}

void rtp__ctx_note_plan(struct rtp_context *ctx, size_t peak, size_t sum, size_t live,
                        size_t work) {
  ctx->activation_peak += peak;
  ctx->activation_sum += sum;
  ctx->activation_live += live;
  ctx->work += work;
}

/* Tensor data is counted by each tensor's role at report time, so changing a role
 * (rtp_tensor_set_param) needs no bookkeeping. */
void rtp_mem_report_get(const struct rtp_context *ctx, struct rtp_mem_report *r) {
  memset(r, 0, sizeof(*r));
  size_t data = 0;
  for (const struct rtp_tensor_obj *o = ctx->first; o; o = o->next) {
    r->bytes[o->t.role] += o->data_bytes;
    data += o->data_bytes;
  }
  r->bytes[RTP_ROLE_ACTIVATION] += ctx->activation_peak;
  r->activation_sum = ctx->activation_sum;
  r->activation_live = ctx->activation_live;
  r->work = ctx->work;
  r->total = ctx->used + ctx->data_used;
  r->metadata = r->total - data - ctx->activation_peak - ctx->work;
}

/* ---- tensors -------------------------------------------------------------------- */

static struct rtp_tensor *new_tensor_impl(struct rtp_context *ctx, enum rtp_type type,
                                          int n_dims, const int64_t *ne, bool alloc) {
  if ((unsigned)type >= RTP_TYPE_COUNT) {
    rtp__ctx_error(ctx, RTP_EINVAL, "rtp_tensor_new: unknown type %d", (int)type);
    return NULL;
  }
  if (n_dims < 1 || n_dims > RTP_MAX_DIMS) {
    rtp__ctx_error(ctx, RTP_EINVAL, "rtp_tensor_new: %d dims (1..%d allowed)", n_dims,
                   RTP_MAX_DIMS);
    return NULL;
  }
  int64_t count = 1;
  for (int i = 0; i < n_dims; i++) {
    if (ne[i] < 0 || (ne[i] > 0 && count > INT64_MAX / 4 / ne[i])) {
      rtp__ctx_error(ctx, RTP_EINVAL, "rtp_tensor_new: bad size %lld in dim %d",
                     (long long)ne[i], i);
      return NULL;
    }
    count *= ne[i];
  }
  struct rtp_tensor_obj *obj = rtp__ctx_alloc(ctx, sizeof(*obj), "a tensor header");
  if (!obj) return NULL;
  memset(obj, 0, sizeof(*obj));
  obj->ctx = ctx;
  struct rtp_tensor *t = &obj->t;
  t->flags = RTP__FLAG_OWNED;
  t->type = type;
  t->role = RTP_ROLE_ACTIVATION;
  for (int i = 0; i < RTP_MAX_DIMS; i++) t->ne[i] = i < n_dims ? ne[i] : 1;
  t->nb[0] = rtp_type_size(type);
  for (int i = 1; i < RTP_MAX_DIMS; i++) t->nb[i] = t->nb[i - 1] * (size_t)t->ne[i - 1];
  if (alloc && !rtp__tensor_alloc(ctx, t, RTP_ROLE_INPUT)) return NULL;
  if (ctx->last)
    ctx->last->next = obj;
  else
    ctx->first = obj;
  ctx->last = obj;
  ctx->n_tensors++;
  return t;
}

struct rtp_tensor *rtp_tensor_new(struct rtp_context *ctx, enum rtp_type type, int n_dims,
                                  const int64_t *ne) {
  return new_tensor_impl(ctx, type, n_dims, ne, !ctx->no_alloc);
}

struct rtp_tensor *rtp_tensor_new_1d(struct rtp_context *ctx, enum rtp_type type, int64_t ne0) {
  return rtp_tensor_new(ctx, type, 1, (int64_t[]){ne0});
}

struct rtp_tensor *rtp_tensor_new_2d(struct rtp_context *ctx, enum rtp_type type, int64_t ne0,
                                     int64_t ne1) {
  return rtp_tensor_new(ctx, type, 2, (int64_t[]){ne0, ne1});
}

struct rtp_tensor *rtp_tensor_new_3d(struct rtp_context *ctx, enum rtp_type type, int64_t ne0,
                                     int64_t ne1, int64_t ne2) {
  return rtp_tensor_new(ctx, type, 3, (int64_t[]){ne0, ne1, ne2});
}

struct rtp_tensor *rtp_tensor_new_4d(struct rtp_context *ctx, enum rtp_type type, int64_t ne0,
                                     int64_t ne1, int64_t ne2, int64_t ne3) {
  return rtp_tensor_new(ctx, type, 4, (int64_t[]){ne0, ne1, ne2, ne3});
}

/* An op result: no data until the planner places it. */
struct rtp_tensor *rtp__new_node(struct rtp_context *ctx, enum rtp_op op, enum rtp_type type,
                                 const int64_t ne[RTP_MAX_DIMS], struct rtp_tensor *a,
                                 struct rtp_tensor *b) {
  struct rtp_tensor *t = new_tensor_impl(ctx, type, RTP_MAX_DIMS, ne, false);
  if (!t) return NULL;
  t->op = op;
  t->src[0] = a;
  t->src[1] = b;
  return t;
}

/* Gives t zeroed memory of its own from the arena, counted under role. */
void *rtp__tensor_alloc(struct rtp_context *ctx, struct rtp_tensor *t, enum rtp_role role) {
  size_t n = rtp_tensor_nbytes(t);
  t->data = rtp__ctx_data_alloc(ctx, n ? n : 1, "tensor data");
  if (!t->data) return NULL;
  if (!ctx->backend) {
    memset(t->data, 0, n);
  } else {
    int rc = ctx->backend->i->zero(ctx->backend, t->data, n);
    if (rc) {
      char msg[256];
      snprintf(msg, sizeof(msg), "%s", rtp_last_error());
      rtp__ctx_error(ctx, rc, "%s", msg);
      t->data = NULL;
      return NULL;
    }
  }
  t->role = role;
  ((struct rtp_tensor_obj *)t)->data_bytes = RTP_PAD(n ? n : 1, RTP_ALIGN);
  return t->data;
}

void rtp_tensor_set_param(struct rtp_tensor *t) {
  if (!t) return;
  t->flags |= RTP_FLAG_PARAM;
  t->role = RTP_ROLE_PARAM;
}

void rtp_tensor_set_input(struct rtp_tensor *t) {
  if (t) t->flags |= RTP_FLAG_INPUT;
}

void rtp_tensor_set_output(struct rtp_tensor *t) {
  if (t) t->flags |= RTP_FLAG_OUTPUT;
}

struct rtp_tensor *rtp_tensor_set_name(struct rtp_tensor *t, const char *fmt, ...) {
  if (!t) return NULL;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(t->name, sizeof(t->name), fmt, ap);
  va_end(ap);
  return t;
}

struct rtp_tensor *rtp_context_find_tensor(struct rtp_context *ctx, const char *name) {
  for (struct rtp_tensor_obj *o = ctx->first; o; o = o->next)
    if (strcmp(o->t.name, name) == 0) return &o->t;
  return NULL;
}

struct rtp_tensor *rtp_context_tensor_at(struct rtp_context *ctx, int n) {
  struct rtp_tensor_obj *o = ctx->first;
  for (int i = 0; o && i < n; i++) o = o->next;
  return o ? &o->t : NULL;
}

int rtp_tensor_set(struct rtp_tensor *t, const void *src, size_t offset, size_t n) {
  if (!t || !t->data || (!src && n))
    return rtp__error(RTP_EINVAL, "rtp_tensor_set: NULL tensor, data or source");
  if (!rtp_tensor_is_contiguous(t) || offset > rtp_tensor_nbytes(t) ||
      n > rtp_tensor_nbytes(t) - offset)
    return rtp__error(RTP_EINVAL, "rtp_tensor_set: %zu bytes at %zu into '%s' (%zu bytes%s)", n,
                      offset, t->name, rtp_tensor_nbytes(t),
                      rtp_tensor_is_contiguous(t) ? "" : ", not contiguous");
  struct rtp_backend *b = rtp__tensor_backend(t);
  if (!b) {
    if (n) memcpy((char *)t->data + offset, src, n); /* src may be NULL for n == 0 */
    return RTP_OK;
  }
  return b->i->set(b, (char *)t->data + offset, src, n);
}

int rtp_tensor_get(const struct rtp_tensor *t, void *dst, size_t offset, size_t n) {
  if (!t || !t->data || (!dst && n))
    return rtp__error(RTP_EINVAL, "rtp_tensor_get: NULL tensor, data or destination");
  if (!rtp_tensor_is_contiguous(t) || offset > rtp_tensor_nbytes(t) ||
      n > rtp_tensor_nbytes(t) - offset)
    return rtp__error(RTP_EINVAL, "rtp_tensor_get: %zu bytes at %zu from '%s' (%zu bytes%s)", n,
                      offset, t->name, rtp_tensor_nbytes(t),
                      rtp_tensor_is_contiguous(t) ? "" : ", not contiguous");
  struct rtp_backend *b = rtp__tensor_backend(t);
  if (!b) {
    if (n) memcpy(dst, (const char *)t->data + offset, n); /* dst may be NULL for n == 0 */
    return RTP_OK;
  }
  return b->i->get(b, dst, (const char *)t->data + offset, n);
}

int rtp__tensor_copy(struct rtp_tensor *dst, const struct rtp_tensor *src) {
  size_t n = rtp_tensor_nbytes(src);
  if (!src->data) return rtp__error(RTP_EINVAL, "copy of '%s': it has no data", src->name);
  if (!rtp__tensor_backend(src)) return rtp_tensor_set(dst, src->data, 0, n);
  size_t cap = n < ((size_t)1 << 20) ? n : (size_t)1 << 20;
  char *buf = malloc(cap ? cap : 1);
  if (!buf) return rtp__error(RTP_ENOMEM, "copy of '%s': out of memory", src->name);
  int rc = RTP_OK;
  for (size_t at = 0; at < n && !rc; at += cap) {
    size_t k = n - at < cap ? n - at : cap;
    rc = rtp_tensor_get(src, buf, at, k);
    if (!rc) rc = rtp_tensor_set(dst, buf, at, k);
  }
  free(buf);
  return rc;
}

static void set_f32_host(struct rtp_tensor *t, float v) {
  for (int64_t i3 = 0; i3 < t->ne[3]; i3++)
    for (int64_t i2 = 0; i2 < t->ne[2]; i2++)
      for (int64_t i1 = 0; i1 < t->ne[1]; i1++) {
        char *row = (char *)t->data + i1 * t->nb[1] + i2 * t->nb[2] + i3 * t->nb[3];
        for (int64_t i0 = 0; i0 < t->ne[0]; i0++) *(float *)(row + i0 * t->nb[0]) = v;
      }
}

/* Device tensors are filled through a host copy: these are for setup, not the step loop. */
int rtp_tensor_fill_f32(struct rtp_tensor *t, float v) {
  if (!t) return rtp__error(RTP_EINVAL, "rtp_tensor_fill_f32: NULL tensor");
  if (t->type != RTP_TYPE_F32)
    return rtp__error(RTP_ESHAPE, "rtp_tensor_fill_f32: '%s' is %s, not f32", t->name,
                      rtp_type_name(t->type));
  if (!t->data) return rtp__error(RTP_ESTATE, "rtp_tensor_fill_f32: '%s' has no data", t->name);
  if (!rtp__tensor_backend(t)) {
    set_f32_host(t, v);
    return RTP_OK;
  }
  if (!rtp_tensor_is_contiguous(t))
    return rtp__error(RTP_EINVAL,
                      "rtp_tensor_fill_f32: '%s' is a device view that is not "
                      "contiguous",
                      t->name);
  size_t n = (size_t)rtp_tensor_nelements(t);
  float *tmp = malloc(n * sizeof(float));
  if (!tmp)
    return rtp__error(RTP_ENOMEM, "rtp_tensor_fill_f32: out of memory for '%s'", t->name);
  for (size_t i = 0; i < n; i++) tmp[i] = v;
  int rc = rtp_tensor_set(t, tmp, 0, n * sizeof(float));
  free(tmp);
  return rc;
}

int rtp_tensor_set_zero(struct rtp_tensor *t) {
  if (!t) return rtp__error(RTP_EINVAL, "rtp_tensor_set_zero: NULL tensor");
  if (!t->data) return rtp__error(RTP_ESTATE, "rtp_tensor_set_zero: '%s' has no data", t->name);
  struct rtp_backend *b = rtp__tensor_backend(t);
  if (!rtp_tensor_is_contiguous(t)) {
    if (t->type != RTP_TYPE_F32)
      return rtp__error(RTP_EINVAL,
                        "rtp_tensor_set_zero: '%s' is a %s view that is not "
                        "contiguous",
                        t->name, rtp_type_name(t->type));
    return rtp_tensor_fill_f32(t, 0.0f);
  }
  if (!b) {
    memset(t->data, 0, rtp_tensor_nbytes(t));
    return RTP_OK;
  }
  return b->i->zero(b, t->data, rtp_tensor_nbytes(t));
}

int rtp_tensor_get_f32(const struct rtp_tensor *t, int64_t i, float *out) {
  if (!t || !out) return rtp__error(RTP_EINVAL, "rtp_tensor_get_f32: NULL argument");
  if (!t->data) return rtp__error(RTP_ESTATE, "rtp_tensor_get_f32: '%s' has no data", t->name);
  if (i < 0 || i >= rtp_tensor_nelements(t))
    return rtp__error(RTP_EINVAL, "rtp_tensor_get_f32: element %lld of '%s' (%lld elements)",
                      (long long)i, t->name, (long long)rtp_tensor_nelements(t));
  int64_t i0 = i % t->ne[0], r = i / t->ne[0];
  int64_t i1 = r % t->ne[1], i2 = r / t->ne[1] % t->ne[2], i3 = r / t->ne[1] / t->ne[2];
  size_t offs = (size_t)i0 * t->nb[0] + (size_t)i1 * t->nb[1] + (size_t)i2 * t->nb[2] +
                (size_t)i3 * t->nb[3];
  union {
    float f;
    int32_t i;
    uint32_t u;
    uint16_t h;
  } v;
  size_t n = rtp_type_size(t->type); /* a bf16 element may end the buffer: read 2 bytes */
  struct rtp_backend *b = rtp__tensor_backend(t);
  if (!b) {
    memcpy(&v, (const char *)t->data + offs, n);
  } else {
    int rc = b->i->get(b, &v, (const char *)t->data + offs, n);
    if (rc) return rc;
  }
  if (t->type == RTP_TYPE_BF16) v.u = (uint32_t)v.h << 16; /* bf16 is f32's top half */
  *out = t->type == RTP_TYPE_I32 ? (float)v.i : v.f;
  return RTP_OK;
}

/* ---- op builders ------------------------------------------------------------------
 * Each checks its inputs, records an error naming the op and the shapes when they do
 * not fit, and otherwise only records a node. */

void rtp__set_param_f32(struct rtp_tensor *t, int i, float v) {
  memcpy(&t->op_params[i], &v, sizeof(v));
}

float rtp__get_param_f32(const struct rtp_tensor *t, int i) {
  float v;
  memcpy(&v, &t->op_params[i], sizeof(v));
  return v;
}

void rtp__set_param_u64(struct rtp_tensor *t, int i, uint64_t v) {
  memcpy(&t->op_params[i], &v, sizeof(v));
}

uint64_t rtp__get_param_u64(const struct rtp_tensor *t, int i) {
  uint64_t v;
  memcpy(&v, &t->op_params[i], sizeof(v));
  return v;
}

/* Records an error about op with the shapes of a and b. */
struct rtp_tensor *rtp__op_error(struct rtp_context *ctx, const char *op, int status,
                                 const struct rtp_tensor *a, const struct rtp_tensor *b,
                                 const char *why) {
  char sa[128], sb[128];
  rtp__shape_str(a, sa, sizeof(sa));
  rtp__shape_str(b, sb, sizeof(sb));
  rtp__ctx_error(ctx, status, "%s: %s (a = %s, b = %s)", op, why, sa, b ? sb : "-");
  return NULL;
}

/* NULL inputs come from an earlier failed builder: pass the failure on. */
bool rtp__inputs_ok(struct rtp_context *ctx, const char *op, const struct rtp_tensor *a,
                    const struct rtp_tensor *b, bool need_b) {
  if (!ctx) return false;
  if (a && (b || !need_b)) return true;
  if (ctx->err == RTP_OK) rtp__ctx_error(ctx, RTP_EINVAL, "%s: NULL input", op);
  return false;
}

static bool can_broadcast(const struct rtp_tensor *b, const struct rtp_tensor *a) {
  for (int i = 0; i < RTP_MAX_DIMS; i++)
    if (b->ne[i] != a->ne[i] && b->ne[i] != 1) return false;
  return true;
}

static struct rtp_tensor *unary(struct rtp_context *ctx, enum rtp_op op, struct rtp_tensor *a) {
  const char *name = rtp_op_name(op);
  if (!rtp__inputs_ok(ctx, name, a, NULL, false)) return NULL;
  if (a->type != RTP_TYPE_F32)
    return rtp__op_error(ctx, name, RTP_ESHAPE, a, NULL, "needs f32");
  if (!rtp__rows_contiguous(a))
    return rtp__op_error(ctx, name, RTP_ESHAPE, a, NULL,
                         "rows must be contiguous (use rtp_cont)");
  return rtp__new_node(ctx, op, RTP_TYPE_F32, a->ne, a, NULL);
}

static struct rtp_tensor *binary(struct rtp_context *ctx, enum rtp_op op, struct rtp_tensor *a,
                                 struct rtp_tensor *b) {
  const char *name = rtp_op_name(op);
  if (!rtp__inputs_ok(ctx, name, a, b, true)) return NULL;
  if (a->type != RTP_TYPE_F32 || b->type != RTP_TYPE_F32)
    return rtp__op_error(ctx, name, RTP_ESHAPE, a, b, "needs f32 operands");
  if (!can_broadcast(b, a))
    return rtp__op_error(ctx, name, RTP_ESHAPE, a, b, "b does not broadcast to a");
  if (!rtp__rows_contiguous(a) || !rtp__rows_contiguous(b))
    return rtp__op_error(ctx, name, RTP_ESHAPE, a, b, "rows must be contiguous (use rtp_cont)");
  return rtp__new_node(ctx, op, RTP_TYPE_F32, a->ne, a, b);
}

struct rtp_tensor *rtp_dup(struct rtp_context *ctx, struct rtp_tensor *a) {
  if (!rtp__inputs_ok(ctx, "dup", a, NULL, false)) return NULL;
  return rtp__new_node(ctx, RTP_OP_DUP, a->type, a->ne, a, NULL);
}

struct rtp_tensor *rtp_cont(struct rtp_context *ctx, struct rtp_tensor *a) {
  if (a && rtp_tensor_is_contiguous(a)) return a;
  return rtp_dup(ctx, a);
}

struct rtp_tensor *rtp_cast(struct rtp_context *ctx, struct rtp_tensor *a, enum rtp_type type) {
  if (!rtp__inputs_ok(ctx, "cast", a, NULL, false)) return NULL;
  bool fp = (a->type == RTP_TYPE_F32 || a->type == RTP_TYPE_BF16) &&
            (type == RTP_TYPE_F32 || type == RTP_TYPE_BF16);
  if (!fp) {
    char sa[128];
    rtp__shape_str(a, sa, sizeof(sa));
    rtp__ctx_error(ctx, RTP_ESHAPE, "cast: %s to %s (f32 and bf16 only)", sa,
                   rtp_type_name(type));
    return NULL;
  }
  return rtp__new_node(ctx, RTP_OP_CAST, type, a->ne, a, NULL);
}

struct rtp_tensor *rtp_add(struct rtp_context *ctx, struct rtp_tensor *a,
                           struct rtp_tensor *b) {
  return binary(ctx, RTP_OP_ADD, a, b);
}

struct rtp_tensor *rtp_sub(struct rtp_context *ctx, struct rtp_tensor *a,
                           struct rtp_tensor *b) {
  return binary(ctx, RTP_OP_SUB, a, b);
}

struct rtp_tensor *rtp_mul(struct rtp_context *ctx, struct rtp_tensor *a,
                           struct rtp_tensor *b) {
  return binary(ctx, RTP_OP_MUL, a, b);
}

struct rtp_tensor *rtp_scale(struct rtp_context *ctx, struct rtp_tensor *a, float s) {
  struct rtp_tensor *t = unary(ctx, RTP_OP_SCALE, a);
  if (t) rtp__set_param_f32(t, 0, s);
  return t;
}

struct rtp_tensor *rtp_sum(struct rtp_context *ctx, struct rtp_tensor *a) {
  if (!rtp__inputs_ok(ctx, "sum", a, NULL, false)) return NULL;
  if (a->type != RTP_TYPE_F32)
    return rtp__op_error(ctx, "sum", RTP_ESHAPE, a, NULL, "needs f32");
  if (!rtp__rows_contiguous(a))
    return rtp__op_error(ctx, "sum", RTP_ESHAPE, a, NULL,
                         "rows must be contiguous (use rtp_cont)");
  return rtp__new_node(ctx, RTP_OP_SUM, RTP_TYPE_F32, (int64_t[]){1, 1, 1, 1}, a, NULL);
}

struct rtp_tensor *rtp_mean(struct rtp_context *ctx, struct rtp_tensor *a) {
  struct rtp_tensor *s = rtp_sum(ctx, a);
  return s ? rtp_scale(ctx, s,
                       1.0f / (float)(rtp_tensor_nelements(a) ? rtp_tensor_nelements(a) : 1))
           : NULL;
}

struct rtp_tensor *rtp_repeat(struct rtp_context *ctx, struct rtp_tensor *a,
                              struct rtp_tensor *b) {
  if (!rtp__inputs_ok(ctx, "repeat", a, b, true)) return NULL;
  if (a->type != RTP_TYPE_F32 || !can_broadcast(a, b) || !rtp__rows_contiguous(a))
    return rtp__op_error(ctx, "repeat", RTP_ESHAPE, a, b,
                         "a must be f32 with contiguous rows and broadcast to b");
  return rtp__new_node(ctx, RTP_OP_REPEAT, RTP_TYPE_F32, b->ne, a, NULL);
}

struct rtp_tensor *rtp_repeat_back(struct rtp_context *ctx, struct rtp_tensor *a,
                                   struct rtp_tensor *b) {
  if (!rtp__inputs_ok(ctx, "repeat_back", a, b, true)) return NULL;
  if (a->type != RTP_TYPE_F32 || !can_broadcast(b, a) || !rtp__rows_contiguous(a))
    return rtp__op_error(ctx, "repeat_back", RTP_ESHAPE, a, b,
                         "a must be f32 with contiguous rows and b must broadcast to a");
  return rtp__new_node(ctx, RTP_OP_REPEAT_BACK, RTP_TYPE_F32, b->ne, a, NULL);
}

/* A matrix operand is usable by GEMM as is when its rows or its columns are packed. */
static bool gemm_operand_ok(const struct rtp_tensor *t) {
  return t->nb[0] == sizeof(float) || t->nb[1] == sizeof(float) || t->ne[0] == 1 ||
         t->ne[1] == 1;
}

struct rtp_tensor *rtp_mul_mat(struct rtp_context *ctx, struct rtp_tensor *a,
                               struct rtp_tensor *b) {
  if (!rtp__inputs_ok(ctx, "mul_mat", a, b, true)) return NULL;
  if (a->type != RTP_TYPE_F32 || b->type != RTP_TYPE_F32)
    return rtp__op_error(ctx, "mul_mat", RTP_ESHAPE, a, b, "needs f32 operands");
  if (a->ne[0] != b->ne[0])
    return rtp__op_error(ctx, "mul_mat", RTP_ESHAPE, a, b, "inner dimensions (ne[0]) differ");
  bool a_2d = a->ne[2] == 1 && a->ne[3] == 1;
  if (!a_2d && (a->ne[2] != b->ne[2] || a->ne[3] != b->ne[3]))
    return rtp__op_error(ctx, "mul_mat", RTP_ESHAPE, a, b,
                         "a must be 2-D or have the batch dimensions of b");
  if (!gemm_operand_ok(a) || !gemm_operand_ok(b))
    return rtp__op_error(ctx, "mul_mat", RTP_ESHAPE, a, b,
                         "operands need packed rows or columns (use rtp_cont)");
  int64_t ne[4] = {a->ne[1], b->ne[1], b->ne[2], b->ne[3]};
  return rtp__new_node(ctx, RTP_OP_MUL_MAT, RTP_TYPE_F32, ne, a, b);
}

int rtp_mul_mat_set_prec(struct rtp_tensor *mm, enum rtp_type prec) {
  if (!mm || mm->op != RTP_OP_MUL_MAT)
    return rtp__error(RTP_EINVAL, "rtp_mul_mat_set_prec: '%s' is a %s, not a mul_mat",
                      mm ? mm->name : "(null)",
                      !mm                     ? "NULL tensor"
                      : mm->op == RTP_OP_NONE ? "leaf"
                                              : rtp_op_name(mm->op));
  if (prec != RTP_TYPE_F32 && prec != RTP_TYPE_BF16)
    return rtp__error(RTP_EINVAL,
                      "rtp_mul_mat_set_prec: precision %s (%d) of '%s': f32 or bf16 only",
                      rtp_type_name(prec), (int)prec, mm->name);
  mm->op_params[RTP__MUL_MAT_PREC] = (int32_t)prec;
  return RTP_OK;
}

enum rtp_type rtp_mul_mat_get_prec(const struct rtp_tensor *mm) {
  return mm && mm->op == RTP_OP_MUL_MAT ? (enum rtp_type)mm->op_params[RTP__MUL_MAT_PREC]
                                        : RTP_TYPE_F32;
}

struct rtp_tensor *rtp_norm(struct rtp_context *ctx, struct rtp_tensor *a, float eps) {
  if (!(eps >= 0.0f)) {
    rtp__ctx_error(ctx, RTP_EINVAL, "norm: eps must be >= 0");
    return NULL;
  }
  struct rtp_tensor *t = unary(ctx, RTP_OP_NORM, a);
  if (t) rtp__set_param_f32(t, 0, eps);
  return t;
}

struct rtp_tensor *rtp_layer_norm(struct rtp_context *ctx, struct rtp_tensor *a,
                                  struct rtp_tensor *w, struct rtp_tensor *b, float eps) {
  if (!rtp__inputs_ok(ctx, "layer_norm", a, NULL, false)) return NULL;
  const struct rtp_tensor *bad = NULL;
  if (w && (rtp_tensor_nelements(w) != a->ne[0] || w->ne[0] != a->ne[0])) bad = w;
  if (b && (rtp_tensor_nelements(b) != a->ne[0] || b->ne[0] != a->ne[0])) bad = b;
  if (bad)
    return rtp__op_error(ctx, "layer_norm", RTP_ESHAPE, a, bad, "affine must be {ne[0]}");
  struct rtp_tensor *t = rtp_norm(ctx, a, eps);
  if (w) t = rtp_mul(ctx, t, w);
  if (b) t = rtp_add(ctx, t, b);
  return t;
}

struct rtp_tensor *rtp_gelu(struct rtp_context *ctx, struct rtp_tensor *a) {
  return unary(ctx, RTP_OP_GELU, a);
}

struct rtp_tensor *rtp_soft_max(struct rtp_context *ctx, struct rtp_tensor *a, float scale,
                                bool causal) {
  if (a && causal && a->ne[0] < a->ne[1])
    return rtp__op_error(ctx, "soft_max", RTP_ESHAPE, a, NULL,
                         "causal needs ne[0] (keys) >= ne[1] (queries)");
  struct rtp_tensor *t = unary(ctx, RTP_OP_SOFT_MAX, a);
  if (t) {
    rtp__set_param_f32(t, 0, scale);
    t->op_params[1] = causal;
  }
  return t;
}

struct rtp_tensor *rtp_get_rows(struct rtp_context *ctx, struct rtp_tensor *a,
                                struct rtp_tensor *idx) {
  if (!rtp__inputs_ok(ctx, "get_rows", a, idx, true)) return NULL;
  if (a->type != RTP_TYPE_F32 || a->ne[2] != 1 || a->ne[3] != 1 || !rtp__rows_contiguous(a))
    return rtp__op_error(ctx, "get_rows", RTP_ESHAPE, a, idx,
                         "a must be f32 {D, V}, rows packed");
  if (idx->type != RTP_TYPE_I32 || idx->ne[3] != 1 || !rtp_tensor_is_contiguous(idx))
    return rtp__op_error(ctx, "get_rows", RTP_ESHAPE, a, idx,
                         "indices must be contiguous i32 of up to 3 dims");
  int64_t ne[4] = {a->ne[0], idx->ne[0], idx->ne[1], idx->ne[2]};
  return rtp__new_node(ctx, RTP_OP_GET_ROWS, RTP_TYPE_F32, ne, a, idx);
}

struct rtp_tensor *rtp_cross_entropy(struct rtp_context *ctx, struct rtp_tensor *logits,
                                     struct rtp_tensor *targets) {
  if (!rtp__inputs_ok(ctx, "cross_entropy", logits, targets, true)) return NULL;
  if (logits->type != RTP_TYPE_F32 || !rtp__rows_contiguous(logits))
    return rtp__op_error(ctx, "cross_entropy", RTP_ESHAPE, logits, targets,
                         "logits must be f32 with contiguous rows");
  if (targets->type != RTP_TYPE_I32 || !rtp_tensor_is_contiguous(targets) ||
      rtp_tensor_nelements(targets) != rtp_tensor_nrows(logits))
    return rtp__op_error(ctx, "cross_entropy", RTP_ESHAPE, logits, targets,
                         "targets must be contiguous i32 with one entry per row of logits");
  return rtp__new_node(ctx, RTP_OP_CROSS_ENTROPY, RTP_TYPE_F32, (int64_t[]){1, 1, 1, 1}, logits,
                       targets);
}

struct rtp_tensor *rtp__get_rows_block(struct rtp_context *ctx, struct rtp_tensor *a,
                                       struct rtp_tensor *idx, int64_t first) {
  struct rtp_tensor *t = rtp_get_rows(ctx, a, idx);
  if (t) {
    t->op_params[0] = (int32_t)first;
    t->op_params[1] = 1;
  }
  return t;
}

struct rtp_tensor *rtp__get_rows_back_block(struct rtp_context *ctx, struct rtp_tensor *dy,
                                            struct rtp_tensor *idx,
                                            const struct rtp_tensor *like, int64_t first) {
  struct rtp_tensor *t = rtp__op3(ctx, RTP_OP_GET_ROWS_BACK, like->ne, dy, idx, NULL);
  if (t) {
    t->op_params[0] = (int32_t)first;
    t->op_params[1] = 1;
  }
  return t;
}

/* Largest byte offset + 1 that a tensor of shape ne with strides nb touches. */
static size_t extent(const int64_t *ne, const size_t *nb, size_t elem) {
  size_t n = elem;
  for (int i = 0; i < RTP_MAX_DIMS; i++) {
    if (ne[i] == 0) return 0;
    n += (size_t)(ne[i] - 1) * nb[i];
  }
  return n;
}

/* ACC with a NULL (zero) base of shape `like`: how backward turns a view's gradient into
 * a gradient of the whole. */
struct rtp_tensor *rtp__acc_impl(struct rtp_context *ctx, struct rtp_tensor *a,
                                 const struct rtp_tensor *like, struct rtp_tensor *b,
                                 const size_t nb[3], size_t offset) {
  const struct rtp_tensor *base = a ? a : like;
  if (base->type != RTP_TYPE_F32 || b->type != RTP_TYPE_F32 || !rtp__rows_contiguous(b))
    return rtp__op_error(ctx, "acc", RTP_ESHAPE, base, b, "needs f32, b with contiguous rows");
  if (a && !rtp_tensor_is_contiguous(a))
    return rtp__op_error(ctx, "acc", RTP_ESHAPE, a, b, "a must be contiguous (use rtp_cont)");
  size_t vnb[4] = {sizeof(float), nb[0], nb[1], nb[2]};
  size_t ext = extent(b->ne, vnb, sizeof(float));
  size_t size = (size_t)rtp_tensor_nelements(base) * sizeof(float);
  if (offset % sizeof(float) || offset > size || ext > size - offset)
    return rtp__op_error(ctx, "acc", RTP_ESHAPE, base, b, "the view of b falls outside a");
  struct rtp_tensor *t = rtp__new_node(ctx, RTP_OP_ACC, RTP_TYPE_F32, base->ne, b, a);
  if (!t) return NULL;
  for (int i = 0; i < 3; i++) rtp__set_param_u64(t, 2 * i, nb[i]);
  rtp__set_param_u64(t, 6, offset);
  return t;
}

struct rtp_tensor *rtp_acc(struct rtp_context *ctx, struct rtp_tensor *a, struct rtp_tensor *b,
                           size_t nb1, size_t nb2, size_t nb3, size_t offset) {
  if (!rtp__inputs_ok(ctx, "acc", a, b, true)) return NULL;
  return rtp__acc_impl(ctx, a, a, b, (size_t[]){nb1, nb2, nb3}, offset);
}

struct rtp_tensor *rtp_concat(struct rtp_context *ctx, struct rtp_tensor *a,
                              struct rtp_tensor *b, int dim) {
  if (!rtp__inputs_ok(ctx, "concat", a, b, true)) return NULL;
  if (dim < 0 || dim >= RTP_MAX_DIMS)
    return rtp__op_error(ctx, "concat", RTP_EINVAL, a, b, "dim out of range");
  int64_t ne[4];
  for (int i = 0; i < RTP_MAX_DIMS; i++) {
    if (i != dim && a->ne[i] != b->ne[i])
      return rtp__op_error(ctx, "concat", RTP_ESHAPE, a, b, "shapes differ outside dim");
    ne[i] = i == dim ? a->ne[i] + b->ne[i] : a->ne[i];
  }
  if (a->type != b->type) return rtp__op_error(ctx, "concat", RTP_ESHAPE, a, b, "types differ");
  struct rtp_tensor *t = rtp__new_node(ctx, RTP_OP_CONCAT, a->type, ne, a, b);
  if (t) t->op_params[0] = dim;
  return t;
}

/* ---- views ---------------------------------------------------------------------- */

static struct rtp_tensor *new_view(struct rtp_context *ctx, enum rtp_op op,
                                   struct rtp_tensor *a, const int64_t ne[4],
                                   const size_t nb[4], size_t offset) {
  struct rtp_tensor *base = a->view_src ? a->view_src : a;
  size_t base_bytes = rtp_tensor_nbytes(base);
  size_t offs = a->view_offs + offset;
  size_t ext = extent(ne, nb, rtp_type_size(a->type));
  if (offs > base_bytes || ext > base_bytes - offs)
    return rtp__op_error(ctx, rtp_op_name(op), RTP_ESHAPE, a, NULL,
                         "the view falls outside the memory of its source");
  struct rtp_tensor *t = rtp__new_node(ctx, op, a->type, ne, a, NULL);
  if (!t) return NULL;
  memcpy(t->nb, nb, sizeof(t->nb));
  t->view_src = base;
  t->view_offs = offs;
  if (base->data) t->data = (char *)base->data + offs;
  rtp__set_param_u64(t, 0, offset);
  return t;
}

struct rtp_tensor *rtp_reshape(struct rtp_context *ctx, struct rtp_tensor *a, int n_dims,
                               const int64_t *ne) {
  if (!rtp__inputs_ok(ctx, "reshape", a, NULL, false)) return NULL;
  if (n_dims < 1 || n_dims > RTP_MAX_DIMS)
    return rtp__op_error(ctx, "reshape", RTP_EINVAL, a, NULL, "1..4 dims allowed");
  int64_t full[4] = {1, 1, 1, 1}, n = 1;
  for (int i = 0; i < n_dims; i++) {
    full[i] = ne[i];
    n *= ne[i];
  }
  if (n != rtp_tensor_nelements(a))
    return rtp__op_error(ctx, "reshape", RTP_ESHAPE, a, NULL, "element count differs");
  if (!rtp_tensor_is_contiguous(a))
    return rtp__op_error(ctx, "reshape", RTP_ESHAPE, a, NULL, "needs a contiguous tensor");
  size_t nb[4] = {rtp_type_size(a->type)};
  for (int i = 1; i < 4; i++) nb[i] = nb[i - 1] * (size_t)full[i - 1];
  return new_view(ctx, RTP_OP_RESHAPE, a, full, nb, 0);
}

struct rtp_tensor *rtp_reshape_2d(struct rtp_context *ctx, struct rtp_tensor *a, int64_t ne0,
                                  int64_t ne1) {
  return rtp_reshape(ctx, a, 2, (int64_t[]){ne0, ne1});
}

struct rtp_tensor *rtp_reshape_3d(struct rtp_context *ctx, struct rtp_tensor *a, int64_t ne0,
                                  int64_t ne1, int64_t ne2) {
  return rtp_reshape(ctx, a, 3, (int64_t[]){ne0, ne1, ne2});
}

struct rtp_tensor *rtp_reshape_4d(struct rtp_context *ctx, struct rtp_tensor *a, int64_t ne0,
                                  int64_t ne1, int64_t ne2, int64_t ne3) {
  return rtp_reshape(ctx, a, 4, (int64_t[]){ne0, ne1, ne2, ne3});
}

struct rtp_tensor *rtp_view(struct rtp_context *ctx, struct rtp_tensor *a, int n_dims,
                            const int64_t *ne, const size_t *nb, size_t offset) {
  if (!rtp__inputs_ok(ctx, "view", a, NULL, false)) return NULL;
  if (n_dims < 1 || n_dims > RTP_MAX_DIMS)
    return rtp__op_error(ctx, "view", RTP_EINVAL, a, NULL, "1..4 dims allowed");
  if (!nb) return rtp__op_error(ctx, "view", RTP_EINVAL, a, NULL, "NULL strides");
  int64_t full[4] = {1, 1, 1, 1};
  size_t fnb[4];
  for (int i = 0; i < n_dims; i++) {
    if (ne[i] < 0) return rtp__op_error(ctx, "view", RTP_EINVAL, a, NULL, "negative size");
    full[i] = ne[i];
  }
  for (int i = 0; i < 4; i++) fnb[i] = i < n_dims ? nb[i] : fnb[i - 1] * (size_t)full[i - 1];
  return new_view(ctx, RTP_OP_VIEW, a, full, fnb, offset);
}

struct rtp_tensor *rtp_view_rows(struct rtp_context *ctx, struct rtp_tensor *a, int64_t first,
                                 int64_t n) {
  if (!rtp__inputs_ok(ctx, "view_rows", a, NULL, false)) return NULL;
  int d = rtp_tensor_n_dims(a) - 1;
  if (first < 0 || n < 0 || first + n > a->ne[d])
    return rtp__op_error(ctx, "view_rows", RTP_EINVAL, a, NULL, "row range out of bounds");
  int64_t ne[4];
  memcpy(ne, a->ne, sizeof(ne));
  ne[d] = n;
  return rtp_view(ctx, a, RTP_MAX_DIMS, ne, a->nb, (size_t)first * a->nb[d]);
}

struct rtp_tensor *rtp_permute(struct rtp_context *ctx, struct rtp_tensor *a, int ax0, int ax1,
                               int ax2, int ax3) {
  if (!rtp__inputs_ok(ctx, "permute", a, NULL, false)) return NULL;
  int ax[4] = {ax0, ax1, ax2, ax3}, seen = 0;
  for (int i = 0; i < 4; i++) {
    if (ax[i] < 0 || ax[i] > 3 || (seen & (1 << ax[i])))
      return rtp__op_error(ctx, "permute", RTP_EINVAL, a, NULL, "axes must permute 0..3");
    seen |= 1 << ax[i];
  }
  int64_t ne[4];
  size_t nb[4];
  for (int i = 0; i < 4; i++) {
    ne[ax[i]] = a->ne[i];
    nb[ax[i]] = a->nb[i];
  }
  struct rtp_tensor *t = new_view(ctx, RTP_OP_PERMUTE, a, ne, nb, 0);
  if (t)
    for (int i = 0; i < 4; i++) t->op_params[2 + i] = ax[i];
  return t;
}

struct rtp_tensor *rtp_transpose(struct rtp_context *ctx, struct rtp_tensor *a) {
  if (!rtp__inputs_ok(ctx, "transpose", a, NULL, false)) return NULL;
  int64_t ne[4] = {a->ne[1], a->ne[0], a->ne[2], a->ne[3]};
  size_t nb[4] = {a->nb[1], a->nb[0], a->nb[2], a->nb[3]};
  return new_view(ctx, RTP_OP_TRANSPOSE, a, ne, nb, 0);
}

/* ---- backward-only builders (used by rtp-graph.c) -------------------------------- */

struct rtp_tensor *rtp__mul_mat_add(struct rtp_context *ctx, struct rtp_tensor *a,
                                    struct rtp_tensor *b, struct rtp_tensor *c) {
  struct rtp_tensor *t = rtp_mul_mat(ctx, a, b);
  if (!t || !c) return t;
  if (c->type != RTP_TYPE_F32 || !rtp_tensor_same_shape(c, t) || !rtp_tensor_is_contiguous(c)) {
    char sc[128], st[128];
    rtp__shape_str(c, sc, sizeof(sc));
    rtp__shape_str(t, st, sizeof(st));
    rtp__ctx_error(
        ctx, RTP_ESHAPE,
        "mul_mat: the addend %s must be f32, contiguous and shaped like the product %s", sc,
        st);
    return NULL;
  }
  t->src[2] = c;
  t->flags |= RTP__FLAG_ADDEND;
  return t;
}

struct rtp_tensor *rtp__op3(struct rtp_context *ctx, enum rtp_op op, const int64_t ne[4],
                            struct rtp_tensor *a, struct rtp_tensor *b, struct rtp_tensor *c) {
  if (!rtp__inputs_ok(ctx, rtp_op_name(op), a, b, true)) return NULL;
  struct rtp_tensor *t = rtp__new_node(ctx, op, RTP_TYPE_F32, ne, a, b);
  if (t) t->src[2] = c;
  return t;
}
