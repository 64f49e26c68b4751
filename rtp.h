/*
 * rtp.h - the public API of rtp, a small library for training transformers on a
 * few machines joined by ordinary Ethernet with Rotated Tensor Parallelism.
 *
 * How it works, in one example. Computing f(x) = a*x^2 + b and its gradient:
 *
 *     struct rtp_init_params ip = {.mem_size = 16 << 20};
 *     struct rtp_context *ctx = rtp_context_new(ip);
 *
 *     struct rtp_tensor *x = rtp_tensor_new_1d(ctx, RTP_TYPE_F32, 1);
 *     struct rtp_tensor *a = rtp_tensor_new_1d(ctx, RTP_TYPE_F32, 1);
 *     struct rtp_tensor *b = rtp_tensor_new_1d(ctx, RTP_TYPE_F32, 1);
 *     rtp_tensor_set_param(x);
 *     struct rtp_tensor *f = rtp_add(ctx, rtp_mul(ctx, a, rtp_mul(ctx, x, x)), b);
 *
 *     struct rtp_graph *g = rtp_graph_new(ctx, 64);
 *     rtp_graph_build(g, f);               // records the forward nodes
 *     rtp_graph_build_backward(ctx, g, f);       // appends the gradient nodes
 *     rtp_graph_plan(ctx, g);              // places every intermediate in one arena
 *
 *     rtp_tensor_fill_f32(x, 2.0f); rtp_tensor_fill_f32(a, 3.0f); rtp_tensor_fill_f32(b, 4.0f);
 *     rtp_graph_compute(g, NULL);          // f = 16, x->grad = 12
 *
 * The context owns one fixed arena given at init: tensor headers, graphs, parameters,
 * gradients, optimizer states and the planned activation buffer all come from it, so a
 * training loop never allocates. Op builders (rtp_add, rtp_mul_mat, ...) only record
 * nodes; nothing is computed until a graph runs. A builder that is given bad input
 * returns NULL and records the first error in the context (rtp_context_error); builders
 * given NULL return NULL, so a whole model can be built and checked once at the end.
 *
 * Shapes follow ggml: ne[0] is the innermost (contiguous) dimension. A row-major matrix
 * with R rows and C columns has ne = {C, R}; PyTorch's nn.Linear weight [out, in] has
 * ne = {in, out}. A safetensors shape [d0, d1, ..., dk] is ne = {dk, ..., d1, d0}.
 *
 * Functions that can fail return 0 or a negative RTP_E* status; rtp_strerror names it
 * and rtp_last_error gives the message of the last failure on the calling thread.
 */
#ifndef RTP_H
#define RTP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define RTP_API __attribute__((visibility("default")))
#define RTP_PRINTF(f, a) __attribute__((format(printf, f, a)))
#else
#define RTP_API
#define RTP_PRINTF(f, a)
#endif

#define RTP_MAX_DIMS 4
#define RTP_MAX_SRC 4
#define RTP_MAX_OP_PARAMS 16 /* int32 words */
#define RTP_MAX_NAME 64

/* ---- status ------------------------------------------------------------------ */

#define RTP_STATUS_MAP(XX)                                                       \
  XX(OK, 0, "success")                                                           \
  XX(ENOMEM, -1, "out of memory (arena or system)")                              \
  XX(EINVAL, -2, "invalid argument")                                             \
  XX(ESHAPE, -3, "shape or type mismatch")                                       \
  XX(EIO, -4, "input/output error")                                              \
  XX(EFORMAT, -5, "malformed file or frame")                                     \
  XX(ECOMM, -6, "communication failure")                                         \
  XX(ETIMEDOUT, -7, "timed out")                                                 \
  XX(EPEER, -8, "peer failed or disagreed")                                      \
  XX(EAUTH, -9, "authentication failed")                                         \
  XX(ENOSYS, -10, "not available (not built, or a library it needs is missing)") \
  XX(ESTATE, -11, "operation not valid in this state")

enum rtp_status {
#define RTP_XX(name, code, text) RTP_##name = code,
  RTP_STATUS_MAP(RTP_XX)
#undef RTP_XX
};

RTP_API const char *rtp_strerror(int status);
/* The message of the most recent failure on the calling thread ("" if none). */
RTP_API const char *rtp_last_error(void);

/* Log lines go to stderr unless a callback is set. level: 0 error, 1 warn, 2 info. */
typedef void (*rtp_log_cb)(int level, const char *msg, void *user);
RTP_API void rtp_log_set(rtp_log_cb cb, void *user);

/* ---- types, ops, roles ---------------------------------------------------------- */

/* Always add types at the end: the values are stored in files and sent on the wire. */
enum rtp_type {
  RTP_TYPE_F32 = 0,
  RTP_TYPE_I32 = 1,
  RTP_TYPE_BF16 = 2, /* bfloat16: f32's sign and 8 exponent bits, 7 mantissa bits; only
                        rtp_cast, views, copies and transfers take it (other ops compute in
                        f32; rtp_mul_mat_set_prec makes a product read bf16-rounded
                        operands) */
  RTP_TYPE_COUNT,
};

#define RTP_OP_MAP(XX)                                             \
  XX(NONE, "none")                                                 \
  XX(DUP, "dup")                 /* contiguous copy of any view */ \
  XX(ADD, "add")                 /* a + b, b broadcast */          \
  XX(SUB, "sub")                 /* a - b, b broadcast */          \
  XX(MUL, "mul")                 /* a * b, b broadcast */          \
  XX(SCALE, "scale")             /* a * s */                       \
  XX(SUM, "sum")                 /* sum of all elements */         \
  XX(REPEAT, "repeat")           /* broadcast a to b's shape */    \
  XX(REPEAT_BACK, "repeat_back") /* sum a down to b's shape */     \
  XX(MUL_MAT, "mul_mat")         /* b . a^T per batch */           \
  XX(NORM, "norm")               /* (x - mean) / std over ne[0] */ \
  XX(NORM_BACK, "norm_back")                                       \
  XX(GELU, "gelu") /* tanh approximation */                        \
  XX(GELU_BACK, "gelu_back")                                       \
  XX(SOFT_MAX, "soft_max") /* scaled, optionally causal */         \
  XX(SOFT_MAX_BACK, "soft_max_back")                               \
  XX(ATTENTION, "attention") /* fused, causal */                   \
  XX(ATTENTION_DELTA, "attention_delta")                           \
  XX(ATTENTION_BACK, "attention_back")                             \
  XX(GET_ROWS, "get_rows")           /* embedding lookup */        \
  XX(GET_ROWS_BACK, "get_rows_back") /* scatter-add of rows */     \
  XX(CROSS_ENTROPY, "cross_entropy") /* mean loss from logits */   \
  XX(CROSS_ENTROPY_BACK, "cross_entropy_back")                     \
  XX(ACC, "acc") /* a with b added into a view */                  \
  XX(CONCAT, "concat")                                             \
  XX(RESHAPE, "reshape")                                           \
  XX(VIEW, "view")                                                 \
  XX(PERMUTE, "permute")                                           \
  XX(TRANSPOSE, "transpose")                                       \
  XX(CAST, "cast")   /* f32 <-> bf16, contiguous result */         \
  XX(COMM, "comm")   /* posted to a communicator */                \
  XX(ROT, "rot")     /* an op on a rotated parameter */            \
  XX(EMPTY, "empty") /* memory that later nodes write into */      \
  XX(ADAMW, "adamw") /* a parameter's AdamW update, in backward */

enum rtp_op {
#define RTP_XX(name, text) RTP_OP_##name,
  RTP_OP_MAP(RTP_XX)
#undef RTP_XX
      RTP_OP_COUNT,
};

/* What a tensor's memory is for; the memory report counts bytes by role. */
enum rtp_role {
  RTP_ROLE_ACTIVATION = 0, /* planned by liveness, reused within a step */
  RTP_ROLE_PARAM,          /* trainable values (this rank's share) */
  RTP_ROLE_GRAD,           /* gradients of parameters */
  RTP_ROLE_OPTIM,          /* optimizer states */
  RTP_ROLE_INPUT,          /* data the caller fills: tokens, targets, constants */
  RTP_ROLE_COMM,           /* buffers that travel between ranks */
  RTP_ROLE_COUNT,
};

enum rtp_flag {
  RTP_FLAG_PARAM = 1 << 0,  /* trainable: gets a persistent gradient */
  RTP_FLAG_INPUT = 1 << 1,  /* filled by the caller before each compute */
  RTP_FLAG_OUTPUT = 1 << 2, /* read after compute: the planner never reuses it */
  RTP_FLAG_LOSS = 1 << 3,   /* the scalar that backward differentiates */
  /* a parameter that AdamW's weight decay leaves alone (as nanoGPT, biases and LayerNorm
   * weights); set it with t->flags |= RTP_FLAG_NO_DECAY, parallel plans keep it */
  RTP_FLAG_NO_DECAY = 1 << 4,
};

RTP_API const char *rtp_op_name(enum rtp_op op);
RTP_API const char *rtp_type_name(enum rtp_type type);
RTP_API const char *rtp_role_name(enum rtp_role role);
RTP_API size_t rtp_type_size(enum rtp_type type);

/* ---- tensors -------------------------------------------------------------------- */

struct rtp_tensor {
  enum rtp_type type;
  enum rtp_role role;
  int32_t flags;            /* enum rtp_flag bits */
  int64_t ne[RTP_MAX_DIMS]; /* elements per dimension; unused ones are 1 */
  size_t nb[RTP_MAX_DIMS];  /* byte strides: nb[0] = type size for a contiguous
                               tensor, nb[i] = nb[i-1] * ne[i-1] */
  enum rtp_op op;
  int32_t op_params[RTP_MAX_OP_PARAMS];
  struct rtp_tensor *src[RTP_MAX_SRC];
  struct rtp_tensor *view_src; /* a view shares the memory of view_src ... */
  size_t view_offs;            /* ... starting this many bytes in */
  struct rtp_tensor *grad;     /* set by rtp_graph_build_backward */
  void *data;                  /* NULL until allocated or planned */
  char name[RTP_MAX_NAME];
  void *extra; /* backend-private */
};

RTP_API int64_t rtp_tensor_nelements(const struct rtp_tensor *t);
RTP_API int64_t rtp_tensor_nrows(const struct rtp_tensor *t);
RTP_API size_t rtp_tensor_nbytes(const struct rtp_tensor *t);
RTP_API int rtp_tensor_n_dims(const struct rtp_tensor *t);
RTP_API bool rtp_tensor_is_contiguous(const struct rtp_tensor *t);
RTP_API bool rtp_tensor_same_shape(const struct rtp_tensor *a, const struct rtp_tensor *b);

/* ---- context -------------------------------------------------------------------- */

/*
 * Backends. A context computes on the CPU unless given a device backend at init; then
 * every tensor's data lives in device memory (one arena of data_size bytes taken at
 * init), graphs run as kernels queued on the device, and the host reads and writes
 * tensors only through rtp_tensor_set / rtp_tensor_get. The context's own arena
 * (headers, graphs, plans) stays in host memory.
 */
struct rtp_backend;
/* The number of CUDA devices (0 if none, or if this build has no CUDA backend). */
RTP_API int rtp_backend_cuda_count(void);
/* A backend on CUDA device `device`: RTP_ENOSYS if the build has no CUDA backend, RTP_EINVAL
 * if there is no such device. One backend per device and process. */
RTP_API int rtp_backend_cuda_new(int device, struct rtp_backend **out);
/* A device for testing a program's device path on a machine without a GPU. Its memory is
 * host memory the host cannot read or write except through the backend (rtp_tensor_set,
 * rtp_tensor_get and the setters built on them), so code that touches t->data of a device
 * tensor faults at once instead of silently working; its two streams run only at sync, in
 * an order drawn from seed among those the recorded events allow. Kernels are the CPU's (one
 * thread), transfers the communicator's. rtp_backend_name gives "sim"; rtp_backend_free
 * frees it. RTP_EINVAL for a NULL out, RTP_ENOMEM. */
RTP_API int rtp_backend_sim_new(unsigned seed, struct rtp_backend **out);
RTP_API void rtp_backend_free(struct rtp_backend *b); /* after every context using it */
RTP_API const char *rtp_backend_name(const struct rtp_backend *b); /* "cpu" for NULL */

struct rtp_init_params {
  size_t mem_size;             /* bytes of the arena */
  void *mem_buffer;            /* caller's memory, or NULL for the library to allocate it */
  bool no_alloc;               /* leaves get no data: the caller points t->data itself */
  struct rtp_backend *backend; /* NULL: the CPU */
  size_t data_size;            /* with a device backend: bytes of device memory for data */
};

struct rtp_context;

/* NULL (with rtp_last_error) when the arena cannot be had. */
RTP_API struct rtp_context *rtp_context_new(struct rtp_init_params params);
RTP_API void rtp_context_free(struct rtp_context *ctx);
/* The first error recorded while building (RTP_OK if none) and its message. */
RTP_API int rtp_context_error(const struct rtp_context *ctx, const char **msg);
RTP_API size_t rtp_context_used_mem(const struct rtp_context *ctx);

/* New leaf tensors; their data comes from the arena unless no_alloc. */
RTP_API struct rtp_tensor *rtp_tensor_new(struct rtp_context *ctx, enum rtp_type type,
                                          int n_dims, const int64_t *ne);
RTP_API struct rtp_tensor *rtp_tensor_new_1d(struct rtp_context *ctx, enum rtp_type type,
                                             int64_t ne0);
RTP_API struct rtp_tensor *rtp_tensor_new_2d(struct rtp_context *ctx, enum rtp_type type,
                                             int64_t ne0, int64_t ne1);
RTP_API struct rtp_tensor *rtp_tensor_new_3d(struct rtp_context *ctx, enum rtp_type type,
                                             int64_t ne0, int64_t ne1, int64_t ne2);
RTP_API struct rtp_tensor *rtp_tensor_new_4d(struct rtp_context *ctx, enum rtp_type type,
                                             int64_t ne0, int64_t ne1, int64_t ne2,
                                             int64_t ne3);

RTP_API void rtp_tensor_set_param(struct rtp_tensor *t);
RTP_API void rtp_tensor_set_input(struct rtp_tensor *t);
RTP_API void rtp_tensor_set_output(struct rtp_tensor *t);
RTP_API struct rtp_tensor *rtp_tensor_set_name(struct rtp_tensor *t, const char *fmt, ...)
    RTP_PRINTF(2, 3);
RTP_API struct rtp_tensor *rtp_context_find_tensor(struct rtp_context *ctx, const char *name);
/* The n-th tensor created in ctx (0-based), or NULL past the end: for iterating. */
RTP_API struct rtp_tensor *rtp_context_tensor_at(struct rtp_context *ctx, int n);

/* Copies n bytes between host memory and t's data starting offset bytes in (t must be
 * contiguous), wherever the data lives: the way to fill inputs of a device context. */
RTP_API int rtp_tensor_set(struct rtp_tensor *t, const void *src, size_t offset, size_t n);
RTP_API int rtp_tensor_get(const struct rtp_tensor *t, void *dst, size_t offset, size_t n);
/* Every element of t (f32, any strides; a device tensor must be contiguous) set to v. */
RTP_API int rtp_tensor_fill_f32(struct rtp_tensor *t, float v);
RTP_API int rtp_tensor_set_zero(struct rtp_tensor *t);
/* Element i of t (in the order of ne, whatever the strides; f32, bf16 or i32) as f32. */
RTP_API int rtp_tensor_get_f32(const struct rtp_tensor *t, int64_t i, float *out);

/* ---- op builders: record a node, compute nothing -------------------------------- */

RTP_API struct rtp_tensor *rtp_dup(struct rtp_context *ctx, struct rtp_tensor *a);
/* a itself if already contiguous, else a contiguous copy. */
RTP_API struct rtp_tensor *rtp_cont(struct rtp_context *ctx, struct rtp_tensor *a);
/*
 * a (f32 or bf16, any strides) converted to `type` (f32 or bf16), contiguous. f32 to bf16
 * rounds to nearest, ties to even (too large for bf16 becomes inf; NaN stays NaN, quiet);
 * bf16 to f32 is exact. The gradient is cast back to a's type.
 */
RTP_API struct rtp_tensor *rtp_cast(struct rtp_context *ctx, struct rtp_tensor *a,
                                    enum rtp_type type);
/* Elementwise; b is broadcast along each dimension where its ne is 1. */
RTP_API struct rtp_tensor *rtp_add(struct rtp_context *ctx, struct rtp_tensor *a,
                                   struct rtp_tensor *b);
RTP_API struct rtp_tensor *rtp_sub(struct rtp_context *ctx, struct rtp_tensor *a,
                                   struct rtp_tensor *b);
RTP_API struct rtp_tensor *rtp_mul(struct rtp_context *ctx, struct rtp_tensor *a,
                                   struct rtp_tensor *b);
RTP_API struct rtp_tensor *rtp_scale(struct rtp_context *ctx, struct rtp_tensor *a, float s);
RTP_API struct rtp_tensor *rtp_sum(struct rtp_context *ctx, struct rtp_tensor *a);
RTP_API struct rtp_tensor *rtp_mean(struct rtp_context *ctx, struct rtp_tensor *a);
/* a broadcast to b's shape (each ne of a is 1 or b's). */
RTP_API struct rtp_tensor *rtp_repeat(struct rtp_context *ctx, struct rtp_tensor *a,
                                      struct rtp_tensor *b);
/* a summed down to b's shape: the adjoint of rtp_repeat. */
RTP_API struct rtp_tensor *rtp_repeat_back(struct rtp_context *ctx, struct rtp_tensor *a,
                                           struct rtp_tensor *b);
/*
 * Matrix product per batch: with a = {K, M, ...} and b = {K, N, ...}, the result is
 * {M, N, ...} with r[n][m] = sum_k a[m][k] * b[n][k], i.e. b . a^T: exactly
 * nn.Linear's x @ W^T when a is the weight. a may be 2-D (shared by every batch of b)
 * or have b's batch dims. Either operand may be a transposed view (rtp_transpose).
 */
RTP_API struct rtp_tensor *rtp_mul_mat(struct rtp_context *ctx, struct rtp_tensor *a,
                                       struct rtp_tensor *b);
/*
 * The precision of the product mm (a node made by rtp_mul_mat): RTP_TYPE_F32 (the
 * default) or RTP_TYPE_BF16, which rounds both operands to bf16 as rtp_cast does and
 * multiplies and sums in f32 to an f32 result: mixed precision, what GPU tensor cores do
 * with bf16 inputs. Types in the graph stay as they are, and so does the memory plan, but
 * for the kernel's scratch (set the precision before rtp_graph_plan). Backward gives mm's
 * gradient products mm's precision. RTP_EINVAL for any other node or type.
 */
RTP_API int rtp_mul_mat_set_prec(struct rtp_tensor *mm, enum rtp_type prec);
/* mm's precision; RTP_TYPE_F32 for a node that is not a mul_mat. */
RTP_API enum rtp_type rtp_mul_mat_get_prec(const struct rtp_tensor *mm);
/* Normalise each row (ne[0]) to zero mean and unit variance. */
RTP_API struct rtp_tensor *rtp_norm(struct rtp_context *ctx, struct rtp_tensor *a, float eps);
/* norm(a) * w + b with w, b of shape {ne[0]} (either may be NULL). */
RTP_API struct rtp_tensor *rtp_layer_norm(struct rtp_context *ctx, struct rtp_tensor *a,
                                          struct rtp_tensor *w, struct rtp_tensor *b,
                                          float eps);
RTP_API struct rtp_tensor *rtp_gelu(struct rtp_context *ctx, struct rtp_tensor *a);
/* softmax(a * scale) over ne[0]; causal masks column j > i + (ne[0] - ne[1]) of row i. */
RTP_API struct rtp_tensor *rtp_soft_max(struct rtp_context *ctx, struct rtp_tensor *a,
                                        float scale, bool causal);
/*
 * Causal multi-head self-attention in one fused op (flash-attention style, docs/attention.md):
 * qkv = {3 d, T, B} f32 (rows packed, any row and sequence strides) holds per token the
 * queries, keys and values of n_head heads of hd = d / n_head each, as GPT-2's c_attn
 * computes them: q of head h at [h hd, (h + 1) hd), k at d + h hd, v at 2 d + h hd. The
 * result {d, T, B} is per token the heads' outputs side by side, each
 * softmax(scale q k^T, causal) v over the tokens of its sequence, computed over blocks of
 * keys with an online softmax: no T x T matrix is ever stored, and key blocks wholly above
 * the diagonal are skipped. Backward recomputes the probabilities from each row's
 * log-sum-exp, which forward keeps (2 floats per row and head). Its gradient is qkv's,
 * whole. CPU kernels only: RTP_ENOSYS in a context whose backend has none (CUDA).
 */
RTP_API struct rtp_tensor *rtp_attention_causal(struct rtp_context *ctx, struct rtp_tensor *qkv,
                                                int n_head, float scale);
/* Rows of a ({D, V}) picked by the I32 indices in idx ({n}, any shape): {D, n...}. */
RTP_API struct rtp_tensor *rtp_get_rows(struct rtp_context *ctx, struct rtp_tensor *a,
                                        struct rtp_tensor *idx);
/* Mean over rows of -log softmax(logits)[target]; logits {V, n...}, targets I32 {n...}. */
RTP_API struct rtp_tensor *rtp_cross_entropy(struct rtp_context *ctx, struct rtp_tensor *logits,
                                             struct rtp_tensor *targets);
/* a, with b added into the view of a given by strides nb1..nb3 and byte offset. */
RTP_API struct rtp_tensor *rtp_acc(struct rtp_context *ctx, struct rtp_tensor *a,
                                   struct rtp_tensor *b, size_t nb1, size_t nb2, size_t nb3,
                                   size_t offset);
RTP_API struct rtp_tensor *rtp_concat(struct rtp_context *ctx, struct rtp_tensor *a,
                                      struct rtp_tensor *b, int dim);

/* Views share the memory of their source. */
RTP_API struct rtp_tensor *rtp_reshape(struct rtp_context *ctx, struct rtp_tensor *a,
                                       int n_dims, const int64_t *ne);
RTP_API struct rtp_tensor *rtp_reshape_2d(struct rtp_context *ctx, struct rtp_tensor *a,
                                          int64_t ne0, int64_t ne1);
RTP_API struct rtp_tensor *rtp_reshape_3d(struct rtp_context *ctx, struct rtp_tensor *a,
                                          int64_t ne0, int64_t ne1, int64_t ne2);
RTP_API struct rtp_tensor *rtp_reshape_4d(struct rtp_context *ctx, struct rtp_tensor *a,
                                          int64_t ne0, int64_t ne1, int64_t ne2, int64_t ne3);
/* A view with its own shape and strides, offset bytes into a. */
RTP_API struct rtp_tensor *rtp_view(struct rtp_context *ctx, struct rtp_tensor *a, int n_dims,
                                    const int64_t *ne, const size_t *nb, size_t offset);
/* Rows [first, first + n) along the outermost used dimension: a block of a tensor. */
RTP_API struct rtp_tensor *rtp_view_rows(struct rtp_context *ctx, struct rtp_tensor *a,
                                         int64_t first, int64_t n);
/* Dimension i of a becomes dimension axes[i] of the result. */
RTP_API struct rtp_tensor *rtp_permute(struct rtp_context *ctx, struct rtp_tensor *a, int ax0,
                                       int ax1, int ax2, int ax3);
RTP_API struct rtp_tensor *rtp_transpose(struct rtp_context *ctx, struct rtp_tensor *a);

/* ---- graphs --------------------------------------------------------------------- */

struct rtp_graph {
  int size; /* capacity */
  int n_nodes;
  int n_leafs;
  struct rtp_tensor **nodes; /* ops in execution order */
  struct rtp_tensor **leafs; /* parameters, inputs, constants */
  void *plan;                /* set by rtp_graph_plan */
};

RTP_API struct rtp_graph *rtp_graph_new(struct rtp_context *ctx, int size);
/* Appends t and everything it depends on that is not yet in g. */
RTP_API int rtp_graph_build(struct rtp_graph *g, struct rtp_tensor *t);
/*
 * Appends to g the nodes that compute d loss / d p for every parameter p that loss
 * depends on, into p->grad (persistent, role GRAD). Intermediate gradients are
 * activations like any other. loss must be a scalar already in g.
 *
 * Gradient accumulation: called again on the same g with another loss (e.g. the next
 * micro-batch's, built into g after the first backward), it ADDS that loss's gradients to
 * the gradients the first call claimed: the last node of each new contribution is an add
 * whose result is the existing gradient's memory (no new GRAD memory, no copies), and
 * p->grad becomes that add. Each compute, the first call's nodes overwrite the gradients
 * (no zeroing between steps) and the later ones add to them, in graph order. A parameter
 * that only a later loss reaches gets its memory from that call.
 */
RTP_API int rtp_graph_build_backward(struct rtp_context *ctx, struct rtp_graph *g,
                                     struct rtp_tensor *loss);
/*
 * Places every node of g in one activation buffer taken from the arena once, reusing
 * memory of tensors that are no longer needed. Call once after building; computing
 * the graph any number of times afterwards allocates nothing.
 */
RTP_API int rtp_graph_plan(struct rtp_context *ctx, struct rtp_graph *g);

/* ---- memory report -------------------------------------------------------------- */

struct rtp_mem_report {
  size_t bytes[RTP_ROLE_COUNT]; /* by role; ACTIVATION is the planned peak */
  size_t activation_sum;        /* all activations if none were reused */
  size_t activation_live;       /* the most activations alive at once: the planned peak
                                   without the free list's fragmentation (a lower bound) */
  size_t work;                  /* scratch for kernels */
  size_t metadata;              /* tensor headers, graphs, plans */
  size_t total;                 /* everything taken from the arena */
};
RTP_API void rtp_mem_report_get(const struct rtp_context *ctx, struct rtp_mem_report *r);

/* ---- execution ------------------------------------------------------------------ */

struct rtp_threadpool;
struct rtp_comm;
/* n_threads <= 0 picks the number of cores; at most 256 threads run, which
 * rtp_threadpool_size tells. */
RTP_API struct rtp_threadpool *rtp_threadpool_new(int n_threads);
RTP_API void rtp_threadpool_free(struct rtp_threadpool *tp);
RTP_API int rtp_threadpool_size(const struct rtp_threadpool *tp);
/* Runs a planned graph; tp NULL runs on the calling thread alone. */
RTP_API int rtp_graph_compute(struct rtp_graph *g, struct rtp_threadpool *tp);
/* Where the last rtp_graph_compute of g spent its time: its wall seconds, and the seconds
 * the CPU executor's first thread waited for transfers to complete (it posts them and
 * reads their results), those of communicator c only, or of all (c NULL). On a pipeline,
 * the waits on the pipe group are the stage's bubble. A device backend's graph reports
 * wall_s alone. RTP_ESTATE before rtp_graph_plan. Setting RTP_TRACE=PREFIX also writes
 * every compute's nodes and transfers as a Chrome trace, PREFIX.<rank>.json, at exit. */
struct rtp_graph_timing {
  double wall_s, wait_s;
};
RTP_API int rtp_graph_timing_get(const struct rtp_graph *g, const struct rtp_comm *c,
                                 struct rtp_graph_timing *out);

/* ---- optimizer ------------------------------------------------------------------ */

struct rtp_adamw_params {
  float lr;
  float beta1;
  float beta2;
  float eps;
  float weight_decay; /* decoupled (AdamW), not on RTP_FLAG_NO_DECAY parameters; 0 is Adam */
  float clip_norm;    /* > 0: scale gradients so their global L2 norm is at most this */
};
RTP_API struct rtp_adamw_params rtp_adamw_params_default(
    void); /* 3e-4, 0.9, 0.95, 1e-8, 0, 0 */

struct rtp_optimizer;
/* Adam states (role OPTIM) for every parameter of g, zeroed, from the arena. */
RTP_API struct rtp_optimizer *rtp_optimizer_new(struct rtp_context *ctx, struct rtp_graph *g,
                                                struct rtp_adamw_params params);
/* One update of every parameter from its gradient. RTP_EINVAL, changing nothing, when the
 * global gradient norm is not finite (the message names this rank's first parameter whose
 * weights, else gradients, hold NaN or infinity, and the step), when the learning rate over
 * the bias correction overflows a float, or after INT64_MAX steps. The optimizer of a graph
 * with the optimizer in backward (rtp_parallel_params.optimizer_in_backward) has updated
 * the parameters during the compute: this closes the step (the norm, the count), or fails
 * it naming the first parameter whose gradient was not finite, which it left unchanged. */
RTP_API int rtp_optimizer_step(struct rtp_optimizer *opt, struct rtp_threadpool *tp);
/* RTP_EINVAL, keeping the rate, unless lr is finite and >= 0. */
RTP_API int rtp_optimizer_set_lr(struct rtp_optimizer *opt, float lr);
RTP_API int64_t rtp_optimizer_steps(const struct rtp_optimizer *opt);
/* For checkpoints: the number of parameters opt updates, and the i-th one with its Adam
 * states m and v (same shape; any output may be NULL); RTP_EINVAL if i is out of range.
 * set_steps restores the step count that the bias corrections depend on (RTP_EINVAL if
 * negative). */
RTP_API int rtp_optimizer_count(const struct rtp_optimizer *opt);
RTP_API int rtp_optimizer_state(const struct rtp_optimizer *opt, int i,
                                struct rtp_tensor **param, struct rtp_tensor **m,
                                struct rtp_tensor **v);
RTP_API int rtp_optimizer_set_steps(struct rtp_optimizer *opt, int64_t steps);
/* The L2 norm of all gradients (over every rank) at the last step, before clipping. */
RTP_API float rtp_optimizer_grad_norm(const struct rtp_optimizer *opt);

/* ---- files: safetensors (rtp-io.c) ---------------------------------------------- */
/* RTP-IO-BEGIN */
/*
 * safetensors: 8-byte little-endian header length N, N bytes of JSON header, then the
 * raw little-endian data. Types F32 and I32 only. A file shape [d0, ..., dk] is
 * ne = {dk, ..., d0}, padded with 1 (a 0-d tensor is ne = {1, 1, 1, 1}); shapes are
 * compared on the padded ne, so [1, 5] and [5] are the same shape.
 *
 * Opening checks the whole header (strict JSON, known types, at most RTP_MAX_DIMS dims,
 * shape size == byte length, offsets that tile the data section without overlap or hole,
 * unique names) and reads no data; any malformed file gives RTP_EFORMAT (RTP_EIO if it
 * cannot be read) with a message naming the file and the fault. An opened file may be
 * read from several threads at once.
 */
struct rtp_safetensors;

RTP_API int rtp_safetensors_open(const char *path, struct rtp_safetensors **out);
RTP_API void rtp_safetensors_close(struct rtp_safetensors *st); /* NULL is fine */
RTP_API int rtp_safetensors_count(const struct rtp_safetensors *st);
/* Name, type, number of dims in the file (0..4) and padded ne of the i-th tensor (in
 * file order); any output may be NULL. RTP_EINVAL if i is out of range. */
RTP_API int rtp_safetensors_info(const struct rtp_safetensors *st, int i, const char **name,
                                 enum rtp_type *type, int *n_dims, int64_t ne[RTP_MAX_DIMS]);
RTP_API int rtp_safetensors_find(const struct rtp_safetensors *st,
                                 const char *name); /* index or -1 */
/* The value of a __metadata__ key, or NULL; and all pairs, by index. */
RTP_API const char *rtp_safetensors_meta(const struct rtp_safetensors *st, const char *key);
RTP_API int rtp_safetensors_meta_count(const struct rtp_safetensors *st);
RTP_API int rtp_safetensors_meta_at(const struct rtp_safetensors *st, int i, const char **key,
                                    const char **value);
/*
 * Reads the named tensor into t, which must have data and the same type and (padded)
 * ne, else RTP_ESHAPE naming both shapes; RTP_EINVAL if there is no such tensor. t may
 * be a strided view; in device memory, one whose rows are contiguous (else RTP_ENOSYS).
 */
RTP_API int rtp_safetensors_read(struct rtp_safetensors *st, const char *name,
                                 struct rtp_tensor *t);
/*
 * Reads rows [first, first + n) of the named tensor's outermost file dimension into t,
 * where t has the file's shape except n along that dimension: a block of a sharded
 * tensor. rtp_safetensors_read is the case first = 0, n = all.
 */
RTP_API int rtp_safetensors_read_rows(struct rtp_safetensors *st, const char *name,
                                      int64_t first, struct rtp_tensor *t);
/* A new tensor in ctx with the named tensor's type, shape and name, read from the file;
 * NULL (with rtp_last_error) if it is missing, ctx is full or has no_alloc. */
RTP_API struct rtp_tensor *rtp_safetensors_load(struct rtp_context *ctx,
                                                struct rtp_safetensors *st, const char *name);
/*
 * Checks that the file holds exactly these n tensors, found by name: the same type and
 * (padded) ne, and no tensor besides them. RTP_ESHAPE naming the first tensor that is
 * missing, extra or different, with both shapes.
 */
RTP_API int rtp_safetensors_check(const struct rtp_safetensors *st,
                                  struct rtp_tensor *const *tensors, int n);
/*
 * Writes n tensors, each named by its t->name (non-empty, unique, not "__metadata__"),
 * in the given order, with the optional __metadata__ string pairs meta_kv = {k0, v0,
 * k1, v1, ..., NULL} (meta_kv may be NULL). A tensor is stored with ne's dims up to the
 * last one that is not 1 (at least one); views of any strides are copied row by row (in
 * device memory, views whose rows are contiguous: a transposed one is RTP_ENOSYS).
 * Atomic: writes a temporary file next to path, fsyncs it, renames it over path and
 * fsyncs the directory; on any failure (RTP_EIO for a full disk, RTP_EINVAL for bad
 * tensors) path is untouched and no temporary file is left. A write past the file size
 * limit (ulimit -f) fails with RTP_EIO instead of raising SIGXFSZ, whose default action
 * would kill the process; an ignored or handled SIGXFSZ is left as the program set it
 * (docs/checkpoints.md, "The file size limit and SIGXFSZ").
 */
RTP_API int rtp_safetensors_save(const char *path, struct rtp_tensor *const *tensors, int n,
                                 const char *const *meta_kv);
/*
 * The whole of the regular file path, of at most max_bytes (SIZE_MAX: any size), in a
 * buffer the caller frees with free(), with a NUL after its *size bytes (size may be
 * NULL). A FIFO, device, directory or socket is refused by its type before any read and
 * without blocking (RTP_EIO, naming the file and its type), as is a file that cannot be
 * opened (RTP_EIO) or a larger one (RTP_EFORMAT); no more than the size found at the
 * open is read. Safetensors and checkpoint files are opened with the same checks.
 */
RTP_API int rtp_file_read(const char *path, size_t max_bytes, void **data, size_t *size);
/* RTP-IO-END */

/* ---- communication (rtp-comm.c; transports rtp-local.c, rtp-tcp*.c, rtp-nccl.c) ---- */
/* RTP-COMM-BEGIN */
/*
 * A communicator (struct rtp_comm) joins world_size ranks. Backends: "local" (world
 * size 1, no sockets), "tcp" (libuv on a comm thread; rendezvous through rank 0,
 * one authenticated connection to every other rank) and "nccl" (a tcp communicator that
 * also joins an NCCL communicator on CUDA device `device`, which carries the transfers of
 * graphs whose tensors live on that device; the functions below, on host memory, still
 * go over TCP. RTP_ENOSYS from a build without CUDA or on a host without a CUDA device).
 * Every operation is asynchronous:
 * it is posted from any thread without blocking on the network and gives a request
 * that rtp_comm_wait / rtp_comm_test completes (and gives back to the comm's fixed pool:
 * a request may be waited on only once, by one thread). Passing req = NULL makes the
 * call wait itself. Buffers must stay valid and untouched until the request completes.
 *
 * Collectives must be posted in the same order with the same sizes on every rank; a
 * disagreement is detected and fails every rank with RTP_EPEER. When a rank dies or
 * goes silent longer than timeout_ms, or an operation makes no progress for that long,
 * the communicator fails: pending and later operations return RTP_EPEER, RTP_ECOMM or
 * RTP_ETIMEDOUT and rtp_last_error() names the rank. A failure is final (fail-stop).
 * Wire format, algorithms and costs: docs/transport.md.
 */
#define RTP_COMM_MAX_ADDR 256
#define RTP_COMM_MAX_TOKEN 256

struct rtp_comm_params {
  char backend[16];                    /* "tcp", "nccl", "local", or "" (local iff
                                          world_size 1) */
  int rank;                            /* 0 .. world_size-1 */
  int world_size;                      /* >= 1 */
  char master_addr[RTP_COMM_MAX_ADDR]; /* host name or address where rank 0 listens */
  int master_port;                     /* rank 0 listens there (0: any, for world size 1) */
  char token[RTP_COMM_MAX_TOKEN];      /* the job's shared secret (required by tcp) */
  char bind[RTP_COMM_MAX_ADDR];        /* local address or interface name; "": the one
                                          that routes to rank 0 */
  int timeout_ms;                      /* rendezvous, silence and no-progress limit */
  int max_requests;                    /* requests in flight at once (the pool) */
  int device; /* nccl: this rank's CUDA device; -1: the local rank (RTP_LOCAL_RANK, which
                 rtp-run sets, else the rank) modulo the number of devices */
};

/* rank 0 of 1, backend "", master 127.0.0.1:29500, timeout 60000, 128 requests,
 * device -1. */
RTP_API struct rtp_comm_params rtp_comm_params_default(void);
/*
 * The defaults overridden by RTP_RANK, RTP_WORLD_SIZE (else SLURM_PROCID/SLURM_NTASKS,
 * else OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE), RTP_MASTER_ADDR, RTP_MASTER_PORT,
 * RTP_TOKEN, RTP_IFNAME or RTP_BIND_ADDR, RTP_TIMEOUT_MS, RTP_BACKEND, RTP_DEVICE.
 * RTP_EINVAL on a malformed value.
 */
RTP_API int rtp_comm_params_from_env(struct rtp_comm_params *p);

struct rtp_comm;
struct rtp_comm_req;

/* Joins the job (blocks until every rank is connected or timeout_ms passes). */
RTP_API int rtp_comm_init(const struct rtp_comm_params *p, struct rtp_comm **out);
/* Says goodbye to every peer and frees everything. Wait for every request first: the
 * requests still pending are failed and freed with the communicator. */
RTP_API void rtp_comm_free(struct rtp_comm *c);
RTP_API int rtp_comm_rank(const struct rtp_comm *c);
RTP_API int rtp_comm_size(const struct rtp_comm *c);

/*
 * Groups (MPI's communicator split). Collective over c: every rank of c calls it, in the
 * same order as its other collectives. Ranks that pass the same color >= 0 form a new
 * communicator, ranked by key, then by their rank in c; a rank that passes
 * RTP_COMM_UNDEFINED takes part but gets *out = NULL. The group runs over c's connections
 * (every frame carries the group's id, checked on receipt), with its own ranks,
 * collectives and message numbers, so groups work concurrently; a communicator with a
 * device transport (nccl) gives its groups one too. The job fails as a whole: a lost or
 * silent rank, or any failure, fails every group, with a message naming the rank. Free
 * a group with rtp_comm_free (before or after c: the connections live until the job's
 * last communicator is freed).
 */
#define RTP_COMM_UNDEFINED (-1)
RTP_API int rtp_comm_split(struct rtp_comm *c, int color, int key, struct rtp_comm **out);
/* A rows x cols mesh of c's ranks (rank = row * cols + col): *row joins the cols ranks of
 * this rank's row, *col the rows ranks of its column (both by rank in c). A pipeline's
 * stage groups are the rows of a stages x ranks-per-stage mesh; its pipe groups the
 * columns. RTP_EINVAL unless rows x cols is c's size. */
RTP_API int rtp_comm_mesh_2d(struct rtp_comm *c, int rows, int cols, struct rtp_comm **row,
                             struct rtp_comm **col);
/* The rank in the job (the world communicator) of c's rank `rank`; -1 out of range. */
RTP_API int rtp_comm_world_rank(const struct rtp_comm *c, int rank);
/* hosts[i] (c's size of them): the host of c's rank i, numbered 0, 1, ... in order of
 * first appearance, from the address each rank joined the job by (tcp: ranks that joined
 * by one IP address share a host, and its NIC); one process is host 0. For the resharding
 * planner's meshes (rtp_mesh_init_1d). */
RTP_API int rtp_comm_hosts(const struct rtp_comm *c, int *hosts);
/* RTP_OK, or the status that failed the communicator (message in *msg if msg). */
RTP_API int rtp_comm_status(struct rtp_comm *c, const char **msg);
/* Fails c's job from any thread, for good, with status (< 0) and msg, as a failure the
 * transport detected itself would: rtp_comm_status returns it at once, every pending and
 * later operation of every group fails with it, and every peer is told (so its
 * communicators fail too, naming this rank). For a failure of the caller's own (a device
 * that died) that the other ranks must not wait for. Nothing happens if the job failed
 * already. */
RTP_API void rtp_comm_abort(struct rtp_comm *c, int status, const char *msg);

/*
 * Block i of n of count elements: the first count % n blocks have one element more.
 * This is the partition every collective below uses for uneven counts.
 */
RTP_API void rtp_comm_block(size_t count, int n, int i, size_t *first, size_t *len);

/* Point-to-point: the k-th send from a to b matches the k-th recv at b from a, and
 * the byte counts must be equal. */
RTP_API int rtp_comm_send(struct rtp_comm *c, const void *buf, size_t nbytes, int dst,
                          struct rtp_comm_req **req);
RTP_API int rtp_comm_recv(struct rtp_comm *c, void *buf, size_t nbytes, int src,
                          struct rtp_comm_req **req);
/*
 * Ring rotation: sends sendbuf to dst while receiving recvbuf from src, as one
 * request (a send and a recv that match the other ranks' sends and recvs). With
 * dst == src == this rank it copies.
 */
RTP_API int rtp_comm_sendrecv(struct rtp_comm *c, const void *sendbuf, size_t sendbytes,
                              int dst, void *recvbuf, size_t recvbytes, int src,
                              struct rtp_comm_req **req);
/* In place, f32 sum over ranks (ring reduce-scatter then all-gather, pipelined). */
RTP_API int rtp_comm_allreduce(struct rtp_comm *c, float *buf, size_t count,
                               struct rtp_comm_req **req);
/* In place: afterwards block rank (rtp_comm_block) of buf holds the sum over ranks of
 * that block; the rest of buf is scratch. */
RTP_API int rtp_comm_reduce_scatter(struct rtp_comm *c, float *buf, size_t count,
                                    struct rtp_comm_req **req);
/* In place: buf has count elements of elem_size bytes; each rank fills its block
 * (rtp_comm_block) and afterwards every rank has every block. */
RTP_API int rtp_comm_allgather(struct rtp_comm *c, void *buf, size_t count, size_t elem_size,
                               struct rtp_comm_req **req);
/* root's nbytes of buf to every rank (pipelined along the ring). */
RTP_API int rtp_comm_broadcast(struct rtp_comm *c, void *buf, size_t nbytes, int root,
                               struct rtp_comm_req **req);
RTP_API int rtp_comm_barrier(struct rtp_comm *c, struct rtp_comm_req **req);

/* Waits for req, gives it back to the pool, returns its status. */
RTP_API int rtp_comm_wait(struct rtp_comm_req *req);
/* As rtp_comm_wait, but RTP_ETIMEDOUT after timeout_ms with req still pending. */
RTP_API int rtp_comm_wait_for(struct rtp_comm_req *req, int timeout_ms);
/* *done = whether req completed; if so it is given back and its status returned. */
RTP_API int rtp_comm_test(struct rtp_comm_req *req, bool *done);
/* RTP-COMM-END */

/* ---- communication in graphs ---------------------------------------------------- */
/*
 * Communication nodes are posted to the communicator when the executor reaches them and
 * run while the compute nodes after them run; a node that reads a communication node's
 * result (directly or through views) waits for it first. Their result is a view of the
 * buffer they fill, so buffers can be persistent (a pool shared by every layer) or
 * planned. `after` (may be NULL) orders the node after another one: how a graph says
 * that a buffer may be overwritten only once an earlier transfer out of it is done.
 */
/* recv's memory, filled with what rank src sends while send goes to rank dst (both
 * contiguous, f32 or bf16: the bytes move as they are). */
RTP_API struct rtp_tensor *rtp_sendrecv(struct rtp_context *ctx, struct rtp_comm *comm,
                                        struct rtp_tensor *send, int dst,
                                        struct rtp_tensor *recv, int src,
                                        struct rtp_tensor *after);
/* a's memory, summed over all ranks in place (f32, contiguous). */
RTP_API struct rtp_tensor *rtp_allreduce(struct rtp_context *ctx, struct rtp_comm *comm,
                                         struct rtp_tensor *a, struct rtp_tensor *after);
/*
 * One-way transfers (pipeline stages): rtp_send sends a (contiguous, f32 or bf16) to rank
 * dst of comm's group and returns a's memory, which a reader sees only once the send is
 * done (so a writer of that memory reads this node first); rtp_recv fills buf's memory
 * with what rank src sends and returns it. The k-th send from a to b matches the k-th recv
 * at b from a (rtp_sendrecv counts as one of each), with equal byte counts. On device
 * tensors they go through the communicator's device transport (ncclSend, ncclRecv).
 * They have no gradient: a pipeline sends the gradients back with nodes of its own.
 */
RTP_API struct rtp_tensor *rtp_send(struct rtp_context *ctx, struct rtp_comm *comm,
                                    struct rtp_tensor *a, int dst, struct rtp_tensor *after);
RTP_API struct rtp_tensor *rtp_recv(struct rtp_context *ctx, struct rtp_comm *comm,
                                    struct rtp_tensor *buf, int src, struct rtp_tensor *after);

/* ---- parallel strategies (rtp-parallel.c, a file per strategy) ------------------ */
/*
 * Build the model once, as for one device, in a context that may have no_alloc (its
 * parameters then take no memory); then rtp_parallel_new builds this rank's training
 * graph in ctx: forward, backward and communication, ready for rtp_graph_plan.
 *
 *   ddp  every rank holds every parameter; gradients are summed over ranks in buckets
 *        all-reduced while backward runs.
 *   fsdp every rank owns one block of every parameter (as rtp); parameters are
 *        all-gathered whole before the ops that read them, a unit at a time
 *        (rtp_tensor_set_fsdp_unit), the next unit's gathers running during this one's compute;
 *        backward gathers a unit again for its input gradients, then reduce-scatters each
 *        parameter's gradient (ZeRO-3).
 *   rtp  every parameter is split into world-size blocks along its first (outermost)
 *        dimension; this rank owns one block, its gradient and its optimizer state.
 *        Blocks rotate around the ring during forward; during backward they rotate the
 *        other way with their gradients, which arrive at their owner summed over ranks.
 *   tp   Megatron-style tensor parallelism over the parameters marked with rtp_tensor_set_tp:
 *        column-parallel layers hold a block of output rows (of each group), row-parallel
 *        ones a block of input columns (ne[0]); everything between them runs on this
 *        rank's part (e.g. its attention heads), an all-reduce of activations follows each
 *        row-parallel layer and one of input gradients precedes each column-parallel layer
 *        in backward. Unmarked parameters are replicated. See docs/parallel.md.
 *
 * ddp, fsdp, rtp: each rank trains on its own batch; the loss that rtp_parallel_tensor
 * gives for the model's loss is the mean over all ranks' batches, and the gradients are
 * those of that mean, so N ranks with batch B train exactly like one process with batch
 * N x B. tp: every rank trains on the same (whole) batch, which the model was built for.
 * Every strategy accumulates gradients over micro-batches (micro_batches): ddp reduces
 * each bucket once, after the last micro-batch's gradients; rtp and fsdp reduce each
 * micro-batch's into the owners' sums; tp all-reduces per micro-batch.
 */
enum rtp_strategy {
  RTP_STRATEGY_NONE = 0, /* one process */
  RTP_STRATEGY_DDP,
  RTP_STRATEGY_FSDP,
  RTP_STRATEGY_TP,
  RTP_STRATEGY_RTP,
  RTP_STRATEGY_COUNT,
};

RTP_API const char *rtp_strategy_name(enum rtp_strategy s);
RTP_API int rtp_strategy_parse(const char *name, enum rtp_strategy *out);

/* How tp splits a parameter (rtp_tensor_set_tp); other strategies ignore it. */
enum rtp_tp_role {
  RTP_TP_REPLICATED = 0, /* every rank holds it whole (the default) */
  RTP_TP_COLUMN,         /* a weight {in, out} read by mul_mat, or its bias {out}: each of
                            the `groups` equal parts of the outermost dimension is split into
                            N blocks, and rank r holds block r of every group (fused q, k, v
                            is 3 groups) */
  RTP_TP_ROW,            /* a weight {in, out} read by mul_mat: rank r holds block r of
                            ne[0], the input dimension; its bias stays replicated */
};

/*
 * Marks a parameter (after rtp_tensor_set_param) for tp, kept in the leaf's op_params (a leaf
 * has no op): role in word 0, groups in word 1. groups >= 1, and 1 for RTP_TP_ROW.
 * RTP_EINVAL for anything else. rtp_parallel_new checks that the marked dimension splits
 * evenly into groups x N blocks and that the graph between column- and row-parallel
 * layers can run on a rank's part (e.g. attention heads divisible by N).
 */
RTP_API int rtp_tensor_set_tp(struct rtp_tensor *param, enum rtp_tp_role role, int groups);

/*
 * Puts a parameter (after rtp_tensor_set_param) in fsdp's unit `unit` (>= 1; 0, the default,
 * takes it out), kept in the leaf's op_params word 2. fsdp gathers a unit's parameters
 * together, when an op first needs one of them, into one of two slots that each hold a
 * unit, while the unit before computes; a parameter in no unit is gathered on its own.
 * A transformer block is the usual unit (what PyTorch's FSDP wraps); the pool then holds
 * two blocks. Other strategies ignore it. RTP_EINVAL for anything but a parameter, or a
 * negative unit.
 */
RTP_API int rtp_tensor_set_fsdp_unit(struct rtp_tensor *param, int unit);

/*
 * Pipeline schedules: the order in which each stage runs its micro-batches' forwards (F)
 * and backwards (B). GPipe: every F, then every B (M micro-batches of activations on every
 * stage). 1F1B: S - s - 1 forwards first, then one F, one B, so stage s holds at most
 * S - s micro-batches of activations. Eager 1F1B (Alpa): twice the warm-up forwards, so a
 * stage's sends overlap its next forward. ZeroPP: 1F1B in scheduling units of
 * rtp_parallel_params.unit micro-batches, each block run for all of a unit's
 * micro-batches before the next, so a stage's fsdp gathers each block once per unit.
 * On a device backend, pipelines of several micro-batches run GPipe only (RTP_ENOSYS
 * otherwise; docs/pipeline.md).
 */
enum rtp_schedule {
  RTP_SCHEDULE_1F1B = 0,
  RTP_SCHEDULE_GPIPE,
  RTP_SCHEDULE_EAGER_1F1B,
  RTP_SCHEDULE_ZEROPP,
  RTP_SCHEDULE_COUNT,
};
RTP_API const char *rtp_schedule_name(enum rtp_schedule s);
RTP_API int rtp_schedule_parse(const char *name, enum rtp_schedule *out);

struct rtp_parallel_params {
  enum rtp_strategy strategy;
  struct rtp_comm *comm;   /* NULL for one process */
  size_t bucket_bytes;     /* ddp: gradient bucket size (0: 4 MiB) */
  int graph_size;          /* nodes of the rank's graph (0: 16384 per micro-batch) */
  enum rtp_type comm_type; /* rtp: type of the rotating copies of blocks and partial
                              gradient sums. RTP_TYPE_F32 (0, the default) or RTP_TYPE_BF16,
                              which halves the bytes sent and the pool; owned blocks, their
                              gradients and Adam's states stay f32, every rank computes
                              with the bf16-rounded blocks and sums gradients in f32. Other
                              strategies refuse BF16 (RTP_EINVAL). See docs/parallel.md. */
  /* The precision (rtp_mul_mat_set_prec) of every matrix product of the rank's graph,
   * forward and backward, for every strategy: RTP_TYPE_F32 (0, the default) or
   * RTP_TYPE_BF16, mixed precision: bf16 operands; f32 sums, results, weights, gradients and
   * Adam states. The model's own products must be f32 or of this precision (RTP_EINVAL). */
  enum rtp_type compute_type;
  /* Gradient accumulation: M micro-batches per step (0 or 1: one). The forward graph is
   * cloned M times (parameters and constants shared, each input leaf per micro-batch,
   * filled through rtp_parallel_micro_tensor), each clone followed by its backward, whose
   * gradients add up in the parameters' gradients before the optimizer step; N ranks x M
   * micro-batches of batch B train exactly like one process on batch N x M x B (tp: M
   * micro-batches of the whole batch). See docs/parallel.md, "Micro-batches". */
  int micro_batches;
  /* Gradient accumulation over computes: K computes of the graph per optimizer step (0 or
   * 1: one), for batches that micro_batches would make a graph too large for (its graph
   * and activations are those of one compute, whatever K). Every compute adds its
   * gradients (micro-batch 0's too) into the parameters' gradients, which the caller zeroes
   * before the step's first (rtp_parallel_zero_grads), and backward is seeded 1/K more, so
   * after K computes on K batches the gradients are those of the mean over all of them;
   * the loss of each compute is its own batch's mean. The reductions that must run once
   * a step (ddp's all-reduces) are left out of the graph: rtp_parallel_sync runs them
   * after the K-th compute. rtp and fsdp reduce every compute's gradients into the owners'
   * (as they do every micro-batch's), tp all-reduces per compute. See docs/parallel.md,
   * "Accumulation over computes". */
  int accumulate;
  /*
   * Pipelines: pipe_comm joins this rank with one rank of each stage, ranked by stage (a
   * stages x ranks-per-stage mesh's column: rtp_comm_mesh_2d), and comm is this rank's
   * stage group (the mesh's row), on which the strategy (rtp, fsdp or ddp; one rank: none)
   * runs. NULL or one rank: no pipeline. The model's blocks (rtp_tensor_set_fsdp_unit) are
   * cut into as many stages as pipe_comm has ranks, balanced by compute or as stage_blocks
   * says (blocks per stage); embeddings go with the first stage, the head and the loss
   * with the last. This rank's graph holds only its stage's nodes and parameters
   * (rtp_parallel_tensor gives NULL for another stage's) for micro_batches micro-batches in
   * the schedule's order, activations and their gradients crossing stages as rtp_send /
   * rtp_recv. The loss of every rank is the global one. docs/pipeline.md.
   */
  struct rtp_comm *pipe_comm;
  enum rtp_schedule schedule;
  const int *stage_blocks; /* NULL: balanced by compute */
  int unit;                /* zeropp: micro-batches per scheduling unit (divides M) */
  /* Activation recomputation, with or without a pipeline: each block's forward is built
   * again just before its backward, from the block's input, and the backward reads that
   * copy, so the first forward's activations die as the next block reads its input: the
   * activations kept per micro-batch are the blocks' inputs (plus one block's at a time). */
  bool recompute;
  /*
   * The optimizer in backward: each parameter's AdamW update is a node of the graph, run
   * as soon as its gradient is complete (after its last reader, transfers included), and
   * the gradient is planned memory that dies there instead of persistent memory: model
   * states take 12 bytes a parameter instead of 16 (docs/parallel.md, "The optimizer in
   * backward"). rtp_parallel_optimizer then returns the optimizer those nodes run (make
   * it before the first compute; set the learning rate before each), and
   * rtp_optimizer_step after each compute only closes the step (the norm, the step count).
   * Strategies none, rtp and fsdp, one micro-batch, no accumulate, no pipeline stages and
   * no clipping (clip_norm 0), on the CPU; otherwise RTP_ENOSYS. A non-finite gradient
   * leaves its parameter unchanged and fails rtp_optimizer_step, but the parameters
   * updated before it stay updated: resume from a checkpoint. Gradients are not kept.
   */
  bool optimizer_in_backward;
  /*
   * Stages of different sizes and strategies (docs/pipeline.md, "Stages of different sizes
   * and strategies"): `stages` > 1 stages, stage s of stage_ranks[s] ranks running
   * stage_strategies[s] (rtp, fsdp, ddp or tp; on one rank any, run as none). pipe_comm is
   * then the job: its ranks stage after stage, stage 0's first; comm is this rank's stage
   * group (rtp_comm_split of the job by stage; NULL on a stage of one rank); strategy is
   * not read. micro_batches is U, the units of a step, each a micro-batch of the one-device
   * graph's batch: a data-parallel stage of G ranks (G must divide U) runs U / G of them on
   * each rank, unit u on its rank u % G as micro-batch u / G; a tp stage runs all U on every
   * rank (rtp_parallel_micro_batches, rtp_parallel_micro_unit). The job trains as one
   * process on the U units' batch, and every rank's loss is the mean over all U. Each
   * unit's activations and their gradients cross a boundary as the cross-mesh resharding
   * planner moves them (rtp_reshard_plan, rtp_reshard_build: one sender among the holders,
   * balanced by host NIC; a chained broadcast to several receivers). The gpipe schedule
   * only; recompute and accumulate not yet (RTP_ENOSYS). rtp_parallel_forward_graph runs
   * the first L units, L the least common multiple of the data-parallel stages' sizes.
   * 0: a rectangular pipeline (pipe_comm as above) or none.
   */
  int stages;
  const int *stage_ranks;
  const enum rtp_strategy *stage_strategies;
};

struct rtp_parallel;

/* NULL with the error in ctx (rtp_context_error) and rtp_last_error. Collective: every
 * rank calls it, and ranks that built different models fail with RTP_EPEER. */
RTP_API struct rtp_parallel *rtp_parallel_new(struct rtp_context *ctx,
                                              const struct rtp_graph *fwd,
                                              struct rtp_tensor *loss,
                                              const struct rtp_parallel_params *params);
RTP_API struct rtp_graph *rtp_parallel_graph(const struct rtp_parallel *p);
/*
 * Micro-batch 0's forward to `out` (a node of the one-device graph, e.g. the logits) as a
 * graph of its own: for evaluation and generation at the training batch shape, without
 * the backward. Its nodes are the training graph's, run in the training graph's order, so
 * they keep the training plan's placement (plan the training graph first, or not at all:
 * then this graph's plan places them). On a pipeline, each stage runs its part: the
 * stages before out's send micro-batch 0's activations on (under zeropp, its unit's), out's
 * stage ends with out, the later stages' graphs are empty. Every rank of the job computes it
 * together. NULL on error (rtp_last_error).
 */
RTP_API struct rtp_graph *rtp_parallel_forward_graph(struct rtp_parallel *p,
                                                     const struct rtp_tensor *out);
/* This rank's pipeline stage (0 without a pipeline), and the number of stages (1). */
RTP_API int rtp_parallel_stage(const struct rtp_parallel *p);
RTP_API int rtp_parallel_stages(const struct rtp_parallel *p);
/* The stage whose graph has t, a parameter, input or node of the one-device graph (0
 * without a pipeline); -1 for a tensor no stage uses. */
RTP_API int rtp_parallel_tensor_stage(const struct rtp_parallel *p, const struct rtp_tensor *t);
/* This rank's tensor for a tensor of the one-device graph (inputs to fill, parameters
 * to initialise); for the loss, the mean over all ranks (and micro-batches). With
 * micro-batches, micro-batch 0's. NULL for a tensor of another pipeline stage. */
RTP_API struct rtp_tensor *rtp_parallel_tensor(const struct rtp_parallel *p,
                                               const struct rtp_tensor *t);
/* Micro-batch m's rank tensor (0 <= m < micro_batches) for a tensor of the one-device
 * graph: its own for inputs and the nodes computed from them, the shared one for
 * parameters and constants; for the loss, the mean over all ranks and micro-batches. NULL
 * (rtp_last_error) for m out of range or a tensor not in the graph. */
RTP_API struct rtp_tensor *rtp_parallel_micro_tensor(const struct rtp_parallel *p,
                                                     const struct rtp_tensor *t, int m);
/* The micro-batches this rank runs a step (micro_batches; with stages of different sizes,
 * its stage's: U / G on a data-parallel stage of G ranks, U on a tp stage). */
RTP_API int rtp_parallel_micro_batches(const struct rtp_parallel *p);
/* Which unit of the step's U micro-batch m of this rank is, with stages of different sizes
 * (the u-th micro-batch of the global batch: fill m's inputs with unit u's data); without
 * them, m + d x M on data-parallel rank d of a group running M (tp: m). -1 for m out of
 * range (rtp_last_error). */
RTP_API int rtp_parallel_micro_unit(const struct rtp_parallel *p, int m);
/* accumulate > 1: zeroes this rank's gradients, before a step's first compute. RTP_OK
 * doing nothing otherwise (each compute then overwrites them). */
RTP_API int rtp_parallel_zero_grads(const struct rtp_parallel *p);
/* accumulate > 1: the reductions of the step's gradients over the ranks that the graph
 * leaves out (ddp's all-reduces), after the step's K-th compute and before the optimizer
 * step; every rank of the group calls it. RTP_OK doing nothing where there are none. */
RTP_API int rtp_parallel_sync(struct rtp_parallel *p, struct rtp_threadpool *tp);
/* Adam over this rank's parameters; the gradient norm for clipping is the global one
 * (a scalar all-reduce when parameters are sharded). With optimizer_in_backward, the
 * graph's own optimizer with params set (the same one on every call; RTP_ENOSYS for
 * clip_norm > 0). */
RTP_API struct rtp_optimizer *rtp_parallel_optimizer(const struct rtp_parallel *p,
                                                     struct rtp_adamw_params params);
/* The rows [first, first + len) of dimension dim of param that this rank holds.
 * RTP_EINVAL for a tp column parameter with several groups (not one range: use
 * rtp_parallel_shard_copy), or another pipeline stage's parameter. */
RTP_API int rtp_parallel_block(const struct rtp_parallel *p, const struct rtp_tensor *param,
                               int64_t *first, int64_t *len, int *dim);
/* Copies this rank's part of param out of `full` (all of param's f32 values, contiguous)
 * into `mine` (as many values as this rank's tensor for param has): for every strategy,
 * how a rank initialises its parameters or compares them with whole ones. RTP_EINVAL
 * for another pipeline stage's parameter. */
RTP_API int rtp_parallel_shard_copy(const struct rtp_parallel *p,
                                    const struct rtp_tensor *param, const float *full,
                                    float *mine);

/* ---- resharding: layouts and the planner (rtp-reshard.c) --------------------------- */
/*
 * Cross-mesh resharding (the Alpa team's, arXiv 2211.05322): a tensor laid out one way
 * on a mesh A of ranks is needed laid out another way on a mesh B (the same ranks or
 * others, the same shape or another). rtp_reshard_plan cuts the move into slices, picks
 * a sender for each slice so that no host's NIC carries much more than the others, and
 * groups the broadcasts into rounds of host-disjoint broadcasts. It only plans:
 * rtp_reshard_build (below) makes the graph nodes that move the data. docs/resharding.md.
 */
#define RTP_MESH_MAX_RANKS 256

/* A group of job ranks seen as a 1-D or 2-D grid. Ranks that share a host share its NIC:
 * hosts[i] names rank ranks[i]'s host (0 .. RTP_MESH_MAX_RANKS - 1). */
struct rtp_mesh {
  int n_axes;                    /* 1 or 2 */
  int shape[2];                  /* ranks along each axis; shape[1] is 1 on a 1-D mesh */
  int ranks[RTP_MESH_MAX_RANKS]; /* the job rank at (i, j): ranks[i * shape[1] + j] */
  int hosts[RTP_MESH_MAX_RANKS]; /* the host of each of them */
};

/* n ranks in a row (ranks NULL: 0 .. n-1) on the given hosts (n of them). RTP_EINVAL for
 * n out of 1 .. RTP_MESH_MAX_RANKS, a negative or repeated rank, or a host out of range. */
RTP_API int rtp_mesh_init_1d(struct rtp_mesh *m, int n, const int *ranks, const int *hosts);
/* rows x cols ranks, row-major (rtp_comm_mesh_2d's order); as rtp_mesh_init_1d. */
RTP_API int rtp_mesh_init_2d(struct rtp_mesh *m, int rows, int cols, const int *ranks,
                             const int *hosts);
/* The ranks of c as a 1-D mesh of job ranks (rtp_comm_world_rank); hosts[k] is job rank
 * k's host (the communicator does not learn hosts at rendezvous: the caller knows them,
 * e.g. from rtp-run's RTP_LOCAL_RANK). */
RTP_API int rtp_mesh_init_comm(struct rtp_mesh *m, const struct rtp_comm *c, const int *hosts);

#define RTP_LAYOUT_REPLICATED (-1)

/*
 * A sharding spec: per tensor dimension (ggml order, ne[0] innermost), the mesh axis it is
 * chunked over, or RTP_LAYOUT_REPLICATED. A dimension chunked over an axis of n ranks is
 * cut into groups equal parts, each part into n blocks as rtp_comm_block cuts it (uneven:
 * the first blocks one longer), and the rank at coordinate i on that axis holds block i of
 * every part; groups is 1 except for tp's fused column weights (q, k, v: 3). A tensor is
 * replicated over the mesh axes that none of its dimensions is chunked over. At most one
 * dimension per axis.
 */
struct rtp_layout {
  int axis[RTP_MAX_DIMS];
  int groups[RTP_MAX_DIMS];
};

/* Every rank holds the whole tensor (ddp; tp's unmarked parameters). */
RTP_API struct rtp_layout rtp_layout_replicated(void);
/* Chunks dimension dim over mesh axis `axis` in `groups` parts (>= 1). RTP_EINVAL for dim,
 * axis or groups out of range, or an axis another dimension is chunked over. */
RTP_API int rtp_layout_chunk(struct rtp_layout *l, int dim, int axis, int groups);
/* What each rank of a strategy's 1-D group holds of param: rtp and fsdp a block of its
 * outermost dimension; tp by its mark (rtp_tensor_set_tp: a column weight or bias the
 * outermost dimension in each group, a row weight ne[0], else whole); ddp and none whole. */
RTP_API int rtp_layout_param(enum rtp_strategy s, const struct rtp_tensor *param,
                             struct rtp_layout *out);
/* The activations of a micro-batch with n_dims dimensions, the outermost being the batch:
 * ddp, fsdp and rtp ranks each hold their own batch (a block of the outermost dimension
 * on the stage's group); tp ranks (and one process) hold all of it. A pipeline stage's
 * boundary moves one such tensor per micro-batch. */
RTP_API int rtp_layout_activation(enum rtp_strategy s, int n_dims, struct rtp_layout *out);
/* param's layout in plan p on p's group (in a pipeline, its stage's), checked against
 * this rank's block (rtp_parallel_block). RTP_EINVAL for a tensor that is not one of p's
 * parameters, or another stage's. */
RTP_API int rtp_parallel_layout(const struct rtp_parallel *p, const struct rtp_tensor *param,
                                struct rtp_layout *out);

struct rtp_reshard_params {
  const struct rtp_mesh *src_mesh, *dst_mesh;
  const struct rtp_layout *src, *dst;
  int64_t ne[RTP_MAX_DIMS]; /* the whole tensor's shape (unused dimensions 1) */
  size_t elem_size;         /* bytes per element */
  double bandwidth;         /* bytes/s of each host's NIC, each way (0: 1 Gbit/s) */
  bool first_owner;         /* each slice's first holder sends it (the baseline) instead of
                               the balanced choice */
};

/* A hyper-rectangle of the tensor and who moves it. */
struct rtp_reshard_slice {
  int64_t first[RTP_MAX_DIMS], len[RTP_MAX_DIMS]; /* elements */
  size_t nbytes;
  const int *holders; /* the ranks of A that hold it (candidate senders), by mesh order */
  int n_holders;
  /* The ranks of B that need it: the first n_local hold it already (local copies), the
   * rest receive it from sender, in chain order (the sender's host, then host by host). */
  const int *receivers;
  int n_receivers, n_local;
  int sender; /* -1 when every receiver is a local copy */
  int round;  /* the round of its broadcast; -1 when it crosses no NIC (local copies, or
                 a sender with every receiver on its host) */
};

struct rtp_reshard {
  struct rtp_reshard_slice *slices;
  int n_slices;
  int n_rounds;
  int n_hosts;          /* host ids 0 .. n_hosts - 1 */
  uint64_t *nic_sent;   /* per host: bytes its NIC sends */
  uint64_t *nic_recv;   /* per host: bytes its NIC receives */
  uint64_t nic_max;     /* the busiest NIC's bytes, either way */
  double makespan_s;    /* the sum over rounds of each round's longest broadcast */
  double lower_bound_s; /* nic_max / bandwidth */
};

/*
 * Plans moving a tensor from p->src on p->src_mesh to p->dst on p->dst_mesh (a pure
 * function). A rank in both meshes must be on the same host in both. RTP_EINVAL, with a
 * message, for a malformed mesh or layout or a shape the layout cannot split; RTP_ENOMEM.
 * Free *out with rtp_reshard_free.
 */
RTP_API int rtp_reshard_plan(const struct rtp_reshard_params *p, struct rtp_reshard **out);
RTP_API void rtp_reshard_free(struct rtp_reshard *r); /* NULL is fine */

/* ---- resharding: execution (rtp-reshard-exec.c) ------------------------------------ */

/* The default chunk of a chained broadcast: 256 KiB, 2 ms on a 1 Gbit/s NIC. */
#define RTP_RESHARD_CHUNK (256u << 10)

/*
 * Appends to g the nodes that carry out this rank's part of plan r over comm: each slice's
 * broadcast is a chain from its sender through its receivers (sender -> r1 -> r2 ...,
 * point-to-point for one receiver) in chunks of about chunk_bytes (0: RTP_RESHARD_CHUNK),
 * each forwarded as soon as it arrives (rtp_send / rtp_sendrecv / rtp_recv nodes, so on
 * device tensors ncclSend / ncclRecv); a receiver that holds a slice copies it. Every rank
 * of the job that comm spans calls it with the same plan and chunk_bytes (ranks with
 * nothing to do append nothing), in the same order as their other transfers on comm.
 *
 * src is this rank's block of the source layout, dst its block of the destination layout
 * (contiguous, f32 or bf16 with the plan's element size; the shape of the layout's block,
 * a grouped dimension's groups one after the other): src may be NULL on a rank that
 * neither sends nor copies, dst on one that receives nothing. Nodes appended to g after
 * these see dst complete and may overwrite src (src is copied before it is sent). If a
 * rank dies or the job fails meanwhile, rtp_graph_compute returns the failure (naming the
 * rank), and dst must not be used. Each chunk takes 2 to 3 nodes of g. RTP_EINVAL for a
 * plan naming ranks that comm lacks or putting a rank in two broadcasts of one round (an
 * edited plan), or a NULL tensor this rank needs; RTP_ESHAPE for tensors that do not fit
 * the plan (messages in ctx too). docs/resharding.md.
 */
RTP_API int rtp_reshard_build(struct rtp_context *ctx, struct rtp_graph *g,
                              struct rtp_comm *comm, const struct rtp_reshard *r,
                              struct rtp_tensor *src, struct rtp_tensor *dst,
                              size_t chunk_bytes);

/* ---- resharding a training state (rtp-parallel-reshard.c) ------------------------ */

struct rtp_parallel_reshard_params {
  struct rtp_comm *job;                 /* spans every rank of both plans */
  const struct rtp_parallel *from;      /* this rank's plan now; NULL if it is not in it */
  const struct rtp_optimizer *from_opt; /* its Adam states (NULL: only parameters move) */
  struct rtp_parallel *to;              /* the plan to train on next; NULL if not in it */
  struct rtp_optimizer *to_opt;         /* filled with from_opt's states and step count */
  /* hosts[k]: job rank k's host (0 .. RTP_MESH_MAX_RANKS - 1), whose NIC it shares; NULL:
   * rtp_comm_hosts(job) */
  const int *hosts;
  size_t chunk_bytes; /* of the chained broadcasts (0: RTP_RESHARD_CHUNK) */
};

/*
 * Moves a training state live, without a checkpoint: every parameter's values and Adam
 * states (m, v), and the optimizer's step count, from plan `from` on its ranks to plan
 * `to` on its own (N ranks to M; rtp, fsdp, tp, ddp or none, pipelined or not), bit for
 * bit, each parameter by the cross-mesh planner and its broadcasts (rtp_reshard_plan,
 * rtp_reshard_build). Collective over job: every rank of job calls it, a rank in neither
 * plan too (it only takes part in the exchange of what each rank is in each plan). Both
 * plans must be built from the same model (parameter names, shapes, tp marks) and be
 * planned; a rank may be in both. Afterwards `to` trains as it would have from a
 * checkpoint of `from`. Checks fail on every rank together: RTP_EINVAL for models that
 * differ, plans whose ranks disagree, or an optimizer on `to` with none on `from`; a rank
 * that dies meanwhile fails it as any transfer does. docs/resharding.md.
 */
RTP_API int rtp_parallel_reshard(const struct rtp_parallel_reshard_params *p);

/* ---- checkpoints (rtp-ckpt.c) ------------------------------------------------------ */
/*
 * A sharded checkpoint of a parallel plan's parameters and their Adam states, one
 * directory per step under dir:
 *
 *   dir/latest                              "step-<8 digits>": the newest complete one
 *   dir/best                                "step-<8 digits>": the best, if a save said so
 *   dir/step-<8 digits>/rank-<k>.safetensors rank k's rows of every parameter P (named P)
 *                                           and of its states (adam.m.P, adam.v.P); ddp
 *                                           ranks hold everything, so rank 0 alone writes;
 *                                           in a pipeline, of its stage's parameters (ddp:
 *                                           the stage's rank 0 alone)
 *   dir/step-<8 digits>/index.json          save_id (in each rank file too, tying it to
 *                                           this index), step, world_size, stages,
 *                                           strategy, adam_steps, the caller's state pairs,
 *                                           each rank file's bytes and sha256, each tensor's
 *                                           global shape (safetensors order) and the rows
 *                                           each rank holds
 *   dir/step-<8 digits>/COMPLETE            "sha256 <index.json's>": written last
 *
 * Saving never endangers the previous checkpoint: every file is written to a temporary
 * name, fsynced and renamed; latest moves only after every rank has written and the
 * marker is on disk; the older checkpoints beyond the keep newest are deleted after that.
 * A checkpoint loads onto any world size, strategy and pipeline: loading is a reshard from
 * the saved layout (the files' row blocks) to the plan's through rtp_reshard_plan, each
 * rank reading the boxes it needs from the files that hold them, after checking those
 * files' sizes and checksums.
 * A pipeline's ranks must be laid out as rtp_comm_mesh_2d lays them out (rank = stage x
 * ranks per stage + rank in the stage), with comm the job's communicator: a save refuses
 * any other layout (RTP_ENOSYS). Every
 * strategy saves the same files: tp, whose pieces are not blocks of rows, gathers each
 * split tensor and writes the rows rtp's rank would hold (docs/checkpoints.md, "tp").
 */
struct rtp_ckpt_params {
  const char *dir;
  const struct rtp_parallel *par;
  struct rtp_comm *comm;            /* the job's (all ranks, every stage); NULL: one process */
  enum rtp_strategy strategy;       /* the plan's (in a pipeline, inside each stage; unused
                                       with stages that differ: the plan has each one's) */
  struct rtp_tensor *const *params; /* the one-device parameters: names, global shapes */
  int n_params;
  struct rtp_optimizer *opt; /* whose states are saved and loaded; may be NULL */
  int keep;                  /* complete checkpoints kept (0: 2) */
  /* The caller's training state saved in index.json, {k0, v0, ..., NULL}: words of
   * [A-Za-z0-9_.+-], at most 32 pairs (may be NULL; not used by load). */
  const char *const *state_kv;
  /* Save: this checkpoint is the best so far (the caller's measure, e.g. an evaluation
   * loss): dir/best names it, written before latest moves, and pruning never deletes the
   * step best names, so it outlives the keep newest. */
  bool best;
};

/* Collective: writes dir/step-<step>; RTP_ESTATE if that step is already complete there.
 * A failed write (a full disk, the file size limit) fails the save on every rank and
 * leaves latest on the previous checkpoint, as rtp_safetensors_save describes. */
RTP_API int rtp_ckpt_save(const struct rtp_ckpt_params *p, int64_t step);

struct rtp_ckpt;
/* The checkpoint dir/latest names, after checking its marker, its index's checksum and
 * every field of the index; RTP_EIO or RTP_EFORMAT with a message saying what is missing
 * or wrong. */
RTP_API int rtp_ckpt_open(const char *dir, struct rtp_ckpt **out);
/* The same for the checkpoint dir/best names (rtp_ckpt_params.best). */
RTP_API int rtp_ckpt_open_best(const char *dir, struct rtp_ckpt **out);
RTP_API void rtp_ckpt_close(struct rtp_ckpt *c); /* NULL is fine */
RTP_API int64_t rtp_ckpt_step(const struct rtp_ckpt *c);
RTP_API int rtp_ckpt_world_size(const struct rtp_ckpt *c);
/* The pipeline stages it was saved from (1: no pipeline, or an index older than them). */
RTP_API int rtp_ckpt_stages(const struct rtp_ckpt *c);
/* The strategy saved under (of stages that differ: stage 0's). */
RTP_API enum rtp_strategy rtp_ckpt_strategy(const struct rtp_ckpt *c);
RTP_API const char *rtp_ckpt_path(const struct rtp_ckpt *c); /* the step directory */
/* A value of the caller's state saved with it, or NULL. */
RTP_API const char *rtp_ckpt_state(const struct rtp_ckpt *c, const char *key);
/* Collective: fills this rank's blocks of p's parameters and states and the optimizer's
 * step count; a missing, truncated or corrupted file, a file of another save, or a tensor
 * that the index, the files and p->params do not all have with the same shape fails every
 * rank (RTP_EFORMAT, RTP_ESHAPE, RTP_EIO) with a message naming it. */
RTP_API int rtp_ckpt_load(const struct rtp_ckpt *c, const struct rtp_ckpt_params *p);

/* ---- deprecated names (until 0.3) ---------------------------------------------------- */
/*
 * Every public function is named rtp_<noun>_<verb> (or rtp_<noun>_<attribute> for a
 * getter); op builders are named after their op (rtp_add, rtp_mul_mat, ...). The names
 * below came before that rule and still work, with a compiler warning, for one release.
 * The fill and get functions among them cannot report a failure: their replacements
 * return a status.
 */
#if defined(__GNUC__)
#define RTP_DEPRECATED(use) __attribute__((deprecated("use " #use)))
#else
#define RTP_DEPRECATED(use)
#endif
RTP_API RTP_DEPRECATED(rtp_context_new) struct rtp_context *rtp_init(struct rtp_init_params p);
RTP_API RTP_DEPRECATED(rtp_context_free) void rtp_free(struct rtp_context *ctx);
RTP_API RTP_DEPRECATED(rtp_context_used_mem) size_t rtp_used_mem(const struct rtp_context *ctx);
RTP_API RTP_DEPRECATED(rtp_tensor_new) struct rtp_tensor *rtp_new_tensor(
    struct rtp_context *ctx, enum rtp_type type, int n_dims, const int64_t *ne);
RTP_API RTP_DEPRECATED(rtp_tensor_new_1d) struct rtp_tensor *rtp_new_tensor_1d(
    struct rtp_context *ctx, enum rtp_type type, int64_t ne0);
RTP_API RTP_DEPRECATED(rtp_tensor_new_2d) struct rtp_tensor *rtp_new_tensor_2d(
    struct rtp_context *ctx, enum rtp_type type, int64_t ne0, int64_t ne1);
RTP_API RTP_DEPRECATED(rtp_tensor_new_3d) struct rtp_tensor *rtp_new_tensor_3d(
    struct rtp_context *ctx, enum rtp_type type, int64_t ne0, int64_t ne1, int64_t ne2);
RTP_API RTP_DEPRECATED(rtp_tensor_new_4d) struct rtp_tensor *rtp_new_tensor_4d(
    struct rtp_context *ctx, enum rtp_type type, int64_t ne0, int64_t ne1, int64_t ne2,
    int64_t ne3);
RTP_API RTP_DEPRECATED(rtp_tensor_set_param) void rtp_set_param(struct rtp_tensor *t);
RTP_API RTP_DEPRECATED(rtp_tensor_set_input) void rtp_set_input(struct rtp_tensor *t);
RTP_API RTP_DEPRECATED(rtp_tensor_set_output) void rtp_set_output(struct rtp_tensor *t);
RTP_API RTP_DEPRECATED(rtp_tensor_set_name) struct rtp_tensor *rtp_set_name(
    struct rtp_tensor *t, const char *fmt, ...) RTP_PRINTF(2, 3);
RTP_API RTP_DEPRECATED(rtp_context_find_tensor) struct rtp_tensor *rtp_get_tensor(
    struct rtp_context *ctx, const char *name);
RTP_API RTP_DEPRECATED(rtp_context_tensor_at) struct rtp_tensor *rtp_tensor_at(
    struct rtp_context *ctx, int n);
RTP_API RTP_DEPRECATED(rtp_tensor_fill_f32) void rtp_set_f32(struct rtp_tensor *t, float v);
RTP_API RTP_DEPRECATED(rtp_tensor_set_zero) void rtp_set_zero(struct rtp_tensor *t);
/* NaN where the element cannot be read. */
RTP_API RTP_DEPRECATED(rtp_tensor_get_f32) float rtp_get_f32_1d(const struct rtp_tensor *t,
                                                                int64_t i);
RTP_API RTP_DEPRECATED(rtp_tensor_nelements) int64_t rtp_nelements(const struct rtp_tensor *t);
RTP_API RTP_DEPRECATED(rtp_tensor_nrows) int64_t rtp_nrows(const struct rtp_tensor *t);
RTP_API RTP_DEPRECATED(rtp_tensor_nbytes) size_t rtp_nbytes(const struct rtp_tensor *t);
RTP_API RTP_DEPRECATED(rtp_tensor_n_dims) int rtp_n_dims(const struct rtp_tensor *t);
RTP_API RTP_DEPRECATED(rtp_tensor_is_contiguous) bool rtp_is_contiguous(
    const struct rtp_tensor *t);
RTP_API RTP_DEPRECATED(rtp_tensor_same_shape) bool rtp_are_same_shape(
    const struct rtp_tensor *a, const struct rtp_tensor *b);
RTP_API RTP_DEPRECATED(rtp_graph_build_backward) int rtp_build_backward(
    struct rtp_context *ctx, struct rtp_graph *g, struct rtp_tensor *loss);
RTP_API RTP_DEPRECATED(rtp_adamw_params_default) struct rtp_adamw_params
    rtp_adamw_default(void);
RTP_API RTP_DEPRECATED(rtp_tensor_set_tp) int rtp_set_tp(struct rtp_tensor *param,
                                                         enum rtp_tp_role role, int groups);
RTP_API RTP_DEPRECATED(rtp_tensor_set_fsdp_unit) int rtp_set_fsdp_unit(struct rtp_tensor *param,
                                                                       int unit);
RTP_API RTP_DEPRECATED(rtp_parallel_new) struct rtp_parallel *rtp_parallelize(
    struct rtp_context *ctx, const struct rtp_graph *fwd, struct rtp_tensor *loss,
    const struct rtp_parallel_params *params);

#ifdef __cplusplus
}
#endif

#endif /* RTP_H */
