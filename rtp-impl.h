/* rtp-impl.h - what the library's .c files share and users never see. */
#ifndef RTP_IMPL_H
#define RTP_IMPL_H

#include "rtp.h"

#include <stdarg.h>

#define RTP_ALIGN 64
#define RTP_PAD(x, n) (((x) + (n)-1) / (n) * (n))

/* A flag bit only tensors made by a context carry: a caller may hand the library a tensor
 * header of its own (e.g. to write a strided view to a file), which has no context behind it.
 */
#define RTP__FLAG_OWNED (1 << 30)
/* rtp: a hop of a small block, which the schedule may post ahead of transfers needed
 * sooner (rtp-sched.c, rtp__graph_hoist_transfers); set from the largest block, so alike
 * on all ranks. */
#define RTP__FLAG_SMALL_HOP (1 << 29)
/* A mul_mat whose src[2] is an addend (rtp__mul_mat_add), not only kept alive by it (the
 * rtp forward's blocks name the result they write into there). */
#define RTP__FLAG_ADDEND (1 << 28)

/* Autodiff computes this tensor's gradient (t->grad, after it) even if it depends on no
 * parameter, and passes none on to its sources: where a pipeline stage's graph begins, the
 * received activations whose gradients go back to the stage before. */
#define RTP__FLAG_GRAD_STOP (1 << 27)

/* The addend of a mul_mat made by rtp__mul_mat_add, else NULL. */
static inline struct rtp_tensor *rtp__addend(const struct rtp_tensor *t) {
  return t->flags & RTP__FLAG_ADDEND ? t->src[2] : NULL;
}

/* The op_params word of a mul_mat that holds its precision (rtp_mul_mat_set_prec). */
#define RTP__MUL_MAT_PREC 0

/* Records msg as the calling thread's last error and returns status. */
int rtp__error(int status, const char *fmt, ...) RTP_PRINTF(2, 3);
int rtp__verror(int status, const char *fmt, va_list ap);
void rtp__log(int level, const char *fmt, ...) RTP_PRINTF(2, 3);
#define RTP_LOG_ERROR(...) rtp__log(0, __VA_ARGS__)
#define RTP_LOG_WARN(...) rtp__log(1, __VA_ARGS__)
#define RTP_LOG_INFO(...) rtp__log(2, __VA_ARGS__)

/* Invariants of the library itself (never of user input): abort with file and line. */
#define RTP_ASSERT(x)                             \
  do {                                            \
    if (!(x)) rtp__abort(__FILE__, __LINE__, #x); \
  } while (0)
#ifdef __cplusplus /* tests include this header to reach internal kernels */
[[noreturn]] void rtp__abort(const char *file, int line, const char *what);
#else
_Noreturn void rtp__abort(const char *file, int line, const char *what);
#endif

/* ---- rtp-cuda-driver.c (CUDA builds) ---- */
/* 1, with "the NVIDIA driver's library libcuda.so.1 cannot be loaded: <why>" in buf, if the
 * driver cannot be loaded; 0 if it can (then CUDA's own error says what is wrong). */
int rtp__cuda_driver_why(char *buf, size_t n);

/* ---- rtp.c: context, tensors, builders ---- */
int rtp__ctx_error(struct rtp_context *ctx, int status, const char *fmt, ...) RTP_PRINTF(3, 4);
void *rtp__ctx_alloc(struct rtp_context *ctx, size_t size, const char *what);
/* Memory for tensor data: the host arena, or the device arena of a backend context. */
void *rtp__ctx_data_alloc(struct rtp_context *ctx, size_t size, const char *what);
void rtp__ctx_note_plan(struct rtp_context *ctx, size_t peak, size_t sum, size_t live,
                        size_t work);
void *rtp__tensor_alloc(struct rtp_context *ctx, struct rtp_tensor *t, enum rtp_role role);
/* Copies src's bytes into dst (contiguous, of src's size), either in device memory:
 * through a bounded host buffer when src is. */
int rtp__tensor_copy(struct rtp_tensor *dst, const struct rtp_tensor *src);
struct rtp_tensor *rtp__new_node(struct rtp_context *ctx, enum rtp_op op, enum rtp_type type,
                                 const int64_t ne[RTP_MAX_DIMS], struct rtp_tensor *a,
                                 struct rtp_tensor *b);
struct rtp_tensor *rtp__op3(struct rtp_context *ctx, enum rtp_op op, const int64_t ne[4],
                            struct rtp_tensor *a, struct rtp_tensor *b, struct rtp_tensor *c);
struct rtp_tensor *rtp__acc_impl(struct rtp_context *ctx, struct rtp_tensor *a,
                                 const struct rtp_tensor *like, struct rtp_tensor *b,
                                 const size_t nb[3], size_t offset);
bool rtp__rows_contiguous(const struct rtp_tensor *t);
/* Records "op: why (a = shape, b = shape)" in ctx; returns NULL. */
struct rtp_tensor *rtp__op_error(struct rtp_context *ctx, const char *op, int status,
                                 const struct rtp_tensor *a, const struct rtp_tensor *b,
                                 const char *why);
/* Whether a builder's inputs are there; a NULL one (an earlier failed builder) is passed on
 * as an error of ctx unless ctx has one already. */
bool rtp__inputs_ok(struct rtp_context *ctx, const char *op, const struct rtp_tensor *a,
                    const struct rtp_tensor *b, bool need_b);
void rtp__shape_str(const struct rtp_tensor *t, char *buf, size_t n);
void rtp__set_param_f32(struct rtp_tensor *t, int i, float v);
float rtp__get_param_f32(const struct rtp_tensor *t, int i);
void rtp__set_param_u64(struct rtp_tensor *t, int i, uint64_t v);
uint64_t rtp__get_param_u64(const struct rtp_tensor *t, int i);

/* A ROT node stands for an op whose backward the pass that made it supplies (a parallel
 * strategy's schedule): op_params words 2..3 point to its hook, which autodiff calls for
 * the gradient of src[0] (dx NULL when src[0] needs none) and of src[1] (dp). Core reaches
 * the strategies only through it. */
struct rtp_rot_hook {
  void (*backward)(const struct rtp_rot_hook *hook, struct rtp_context *ctx,
                   struct rtp_tensor *t, struct rtp_tensor *dy, struct rtp_tensor **dx,
                   struct rtp_tensor **dp);
};
#define RTP__ROT_HOOK 2
static inline void rtp__rot_set_hook(struct rtp_tensor *t, const struct rtp_rot_hook *h) {
  rtp__set_param_u64(t, RTP__ROT_HOOK, (uint64_t)(uintptr_t)h);
}
static inline const struct rtp_rot_hook *rtp__rot_hook(const struct rtp_tensor *t) {
  return (const struct rtp_rot_hook *)(uintptr_t)rtp__get_param_u64(t, RTP__ROT_HOOK);
}

/* Whether t is an add by which rtp_graph_build_backward accumulated a later loss's gradient
 * (src[1]) into a parameter's gradient (src[0]), in the memory of src[0]. */
static inline bool rtp__is_grad_acc(const struct rtp_tensor *t) {
  return t->op == RTP_OP_ADD && t->role == RTP_ROLE_GRAD && t->view_src;
}

/* src[3] of a compute node may be an order-only edge: the node runs after it but does
 * not read it (the executor does not wait for it, the planner does not count it). The
 * parallel passes use it to lay out their schedules. */
#define RTP_SRC_ORDER 3
#define RTP_MAX_WORLD 64

/* ---- rtp-comm-node.c: communication nodes ---- */
/* What a COMM node does (op_params[0]); op_params[1], [2] are the ranks it sends to and
 * receives from (-1: none), op_params[4..5] hold the communicator. */
enum {
  RTP__COMM_SENDRECV,
  RTP__COMM_ALLREDUCE,
  RTP__COMM_ALLGATHER,
  RTP__COMM_SEND,
  RTP__COMM_RECV
};
/* a's memory: every rank's block of rows (rtp_comm_block over the outermost dimension)
 * gathered in place. Internal: the fsdp pass gathers parameters with it. */
struct rtp_tensor *rtp__allgather_rows(struct rtp_context *ctx, struct rtp_comm *comm,
                                       struct rtp_tensor *a, struct rtp_tensor *after);
struct rtp_comm_op;
struct rtp_comm_req;
/* What COMM node t asks of its communicator, which it returns. */
struct rtp_comm *rtp__comm_node_op(const struct rtp_tensor *t, struct rtp_comm_op *op);
/* Posts t's transfer on the host (its request in *req). */
int rtp__comm_node_post(const struct rtp_tensor *t, struct rtp_comm_req **req);
/* The communicator of COMM node t. */
const struct rtp_comm *rtp__comm_node_comm(const struct rtp_tensor *t);
/* "send to 1", "recv from 0", "allreduce"...: what COMM node t does, after its name
 * (group ranks), for traces. */
void rtp__comm_node_describe(const struct rtp_tensor *t, char *buf, size_t n);
/* The bytes this rank sends for t (ring algorithms: what each link carries). */
double rtp__comm_node_bytes(const struct rtp_tensor *t);

/* View ops compute nothing: their data is their source's. */
static inline bool rtp__is_view_op(enum rtp_op op) {
  return op == RTP_OP_RESHAPE || op == RTP_OP_VIEW || op == RTP_OP_PERMUTE ||
         op == RTP_OP_TRANSPOSE || op == RTP_OP_ROT;
}

/* The tensor whose memory t is: its view source, or itself. */
static inline const struct rtp_tensor *rtp__base_of(const struct rtp_tensor *t) {
  return t->view_src ? t->view_src : t;
}

/* The communication node whose result t is (through any chain of views), or NULL. */
static inline struct rtp_tensor *rtp__comm_source(const struct rtp_tensor *t) {
  while (t && rtp__is_view_op(t->op)) t = t->src[0];
  return t && t->op == RTP_OP_COMM ? (struct rtp_tensor *)t : NULL;
}

/* Whether node t reads its source k: a compute node's order edge (src[3]) only orders it,
 * while a transfer waits for its order edge too (a hop that forwards what arrived). */
static inline bool rtp__src_read(const struct rtp_tensor *t, int k) {
  return t->src[k] && (k != RTP_SRC_ORDER || t->op == RTP_OP_COMM);
}

/* The transfer node t waits for through its source k, or NULL. */
static inline struct rtp_tensor *rtp__waited_transfer(const struct rtp_tensor *t, int k) {
  return rtp__src_read(t, k) ? rtp__comm_source(t->src[k]) : NULL;
}

/* c + mul_mat(a, b), c f32, contiguous and shaped like the product: the product is added
 * into c's memory when c dies there (the planner's in-place rule), else into a copy. It
 * saves an add's pass over memory where a pass sums products (rtp's dx over blocks). */
struct rtp_tensor *rtp__mul_mat_add(struct rtp_context *ctx, struct rtp_tensor *a,
                                    struct rtp_tensor *b, struct rtp_tensor *c);
/* get_rows / get_rows_back on the block of rows [first, first + a's rows) of a larger
 * table: indices outside the block give zero rows instead of an error. */
struct rtp_tensor *rtp__get_rows_block(struct rtp_context *ctx, struct rtp_tensor *a,
                                       struct rtp_tensor *idx, int64_t first);
struct rtp_tensor *rtp__get_rows_back_block(struct rtp_context *ctx, struct rtp_tensor *dy,
                                            struct rtp_tensor *idx,
                                            const struct rtp_tensor *like, int64_t first);

/* ---- rtp-attn.c ---- */
/* The gradient of qkv for attention node t (rtp_attention_causal) given dy. */
struct rtp_tensor *rtp__attention_back(struct rtp_context *ctx, struct rtp_tensor *t,
                                       struct rtp_tensor *dy);

/* ---- rtp-opt.c ---- */
/* The Adam states of param (a rank tensor opt updates); NULL, NULL if opt does not. */
void rtp__optimizer_find(const struct rtp_optimizer *opt, const struct rtp_tensor *param,
                         struct rtp_tensor **m, struct rtp_tensor **v);
void rtp__optimizer_set_comm(struct rtp_optimizer *opt, struct rtp_comm *comm);
/* A second group whose ranks hold other shares (a pipeline's stages): the norm sums over
 * it after the first; share false: this rank adds zero there (its group's first adds the
 * group's sum, which every rank of the group has). */
void rtp__optimizer_add_comm(struct rtp_optimizer *opt, struct rtp_comm *comm, bool share);
/* param's weight in the all-reduced sum of squares (default 1): 1/N for a gradient that
 * every rank holds whole (tp's replicated parameters), so it is counted once. */
void rtp__optimizer_set_norm_weight(struct rtp_optimizer *opt, const struct rtp_tensor *param,
                                    float w);
/* rtp-opt-fused.c: the optimizer whose ADAMW nodes it adds to g (built, with planned
 * gradients: rtp__graph_set_planned_grads), each placed after the last node that needs
 * its parameter or gradient; default hyperparameters. */
struct rtp_optimizer *rtp__optimizer_in_backward(struct rtp_context *ctx, struct rtp_graph *g);

/* ---- rtp-gemm.c ---- */
/* C[m][n] = sum_k A(m,k) * B(n,k) (+ C[m][n] if accumulate), all f32, where A(m,k) is at
 * a[m*lda_m + k*lda_k] and B(n,k) at b[n*ldb_n + k*ldb_k]; one of each pair of strides is 1.
 * C is row-major with leading dimension ldc. Single-threaded: callers split the work. */
void rtp__gemm(int64_t m, int64_t n, int64_t k, const float *a, int64_t lda_m, int64_t lda_k,
               const float *b, int64_t ldb_n, int64_t ldb_k, float *c, int64_t ldc,
               bool accumulate);
/* The portable blocked kernel, exposed so tests can compare it with CBLAS. */
void rtp__gemm_fallback(int64_t m, int64_t n, int64_t k, const float *a, int64_t lda_m,
                        int64_t lda_k, const float *b, int64_t ldb_n, int64_t ldb_k, float *c,
                        int64_t ldc, bool accumulate);
bool rtp__gemm_has_cblas(void);
/* The provider the build chose (RTP_GEMM): "onednn", "openblas" or "builtin"; and the
 * kernel it runs (oneDNN's implementation name and ISA, OpenBLAS's core type). */
const char *rtp__gemm_provider(void);
const char *rtp__gemm_kernel(void);
/* Makes ahead of time what rtp__gemm(m, n, k, ...) will need for these arguments, any m
 * (rtp_graph_plan calls it per product, so that no step creates anything); RTP_ENOMEM. */
int rtp__gemm_plan(int64_t n, int64_t k, int64_t x_row, int64_t x_k, int64_t y_row, int64_t y_k,
                   int64_t ldc, bool accumulate);
/* What the provider made ahead of time (oneDNN's primitives; 0 for the others), how
 * many of those a call made because no plan had (each a creation inside a step), and
 * the calls it did not take (run by the built-in kernel: a layout it cannot read). */
void rtp__gemm_stats(size_t *made, size_t *late, size_t *declined);
/* rtp-gemm-dnnl.c: the product through a oneDNN primitive; false if oneDNN cannot take it
 * (the caller falls back, nothing written). */
bool rtp__gemm_dnnl(int64_t m, int64_t n, int64_t k, const float *x, int64_t x_row, int64_t x_k,
                    const float *y, int64_t y_row, int64_t y_k, float *c, int64_t ldc,
                    bool accumulate);
const char *rtp__gemm_dnnl_kernel(void);
void rtp__gemm_dnnl_stats(size_t *primitives, size_t *late, size_t *declined);
/* How a BLAS can read a matrix of `rows` rows of k elements stored at strides (row, kst),
 * in elements: with packed rows (*packed_rows; leading dimension *ld from row) or packed
 * columns (read transposed; *ld from kst). false if neither: the operand must be copied
 * first. CBLAS (rtp-gemm.c) and cuBLAS (rtp-cuda-kernels.cu) take the same layouts. */
bool rtp__gemm_layout(int64_t rows, int64_t k, int64_t row, int64_t kst, bool *packed_rows,
                      int64_t *ld);

/* ---- rtp-cpu.c: kernels ---- */
struct rtp_compute_params {
  int ith, nth; /* this thread's index and the number of threads */
  void *work;   /* scratch of rtp__op_work_size bytes, shared by the threads */
  int *status;  /* kernels report bad data (an index out of range) here */
  struct rtp_threadpool *tp;
};
/* Waits until every thread of the node has called it: for kernels with two phases.
 * All threads must call it the same number of times. */
void rtp__barrier(const struct rtp_compute_params *p);
/* Runs fn(ith, nth, arg) on every thread of tp (or once on the caller if tp is NULL). */
typedef void (*rtp__job_fn)(const struct rtp_compute_params *p, void *arg);
void rtp__threadpool_run(struct rtp_threadpool *tp, rtp__job_fn fn, void *arg);
void rtp__gemm_init(void);
void rtp__compute_forward(const struct rtp_compute_params *p, struct rtp_tensor *t);
/* rtp-cpu-attn.c: fused attention's kernels and their scratch. */
void rtp__k_attention(const struct rtp_compute_params *p, struct rtp_tensor *t);
void rtp__k_attention_delta(const struct rtp_compute_params *p, struct rtp_tensor *t);
void rtp__k_attention_back(const struct rtp_compute_params *p, struct rtp_tensor *t);
size_t rtp__attention_work_size(const struct rtp_tensor *t);
/* rtp-opt-fused.c: an ADAMW node's update. */
void rtp__k_adamw(const struct rtp_compute_params *p, struct rtp_tensor *t);
size_t rtp__op_work_size(const struct rtp_tensor *t);
/* rtp_graph_plan's preparation of a MUL_MAT node t's GEMM (rtp__gemm_plan). */
int rtp__mul_mat_plan(const struct rtp_tensor *t);
#define RTP_MAX_THREADS 256

/* ---- rtp-graph.c ---- */
/* Backward from several outputs at once, outs[i] with gradient seeds[i] (nodes of g, f32,
 * outs[i]'s shape): the gradients of the parameters (added into those an earlier call
 * claimed, as rtp_graph_build_backward does) and of the RTP__FLAG_GRAD_STOP nodes. */
int rtp__graph_build_backward_seeded(struct rtp_context *ctx, struct rtp_graph *g, int n,
                                     struct rtp_tensor *const *outs,
                                     struct rtp_tensor *const *seeds);
/* From now on a parameter's first gradient in g is added too, into zeroed GRAD memory of
 * its own, as later ones are: every compute of g adds to the gradients, which the caller
 * zeroes (rtp_parallel_params.accumulate). Before the first backward. */
void rtp__graph_set_accumulate(struct rtp_graph *g);
/* From now on a parameter's gradient in g is planned memory, read by nodes added later
 * (the optimizer in backward), not persistent memory kept to the end. Before the first
 * backward. */
void rtp__graph_set_planned_grads(struct rtp_graph *g);
/* Puts g's nodes in the order they have in `like` (which must hold them all): a graph of
 * some of a planned graph's nodes then runs them in an order its placement is valid for. */
int rtp__graph_order_like(struct rtp_graph *g, const struct rtp_graph *like);

/* ---- rtp-exec.c ---- */
/* One run of g's transfers without its compute: posted and waited for where the executor
 * would (a planned CPU graph). */
int rtp__graph_replay_comm(struct rtp_graph *g);

/* ---- rtp-alloc.c ---- */
/* What rtp_graph_plan leaves in g->plan for the executor. */
#define RTP__PLAN_WAIT_GROUPS 8
struct rtp_plan_wait {
  const struct rtp_comm *comm;
  double s;
};

struct rtp_plan {
  void *work; /* kernel scratch */
  size_t work_size;
  struct rtp_backend *backend; /* NULL: the CPU executor */
  int n_comm; /* COMM nodes: a device backend has events 2k, 2k+1 for the k-th */
  /* The last compute's wall seconds, and the seconds the CPU executor's thread 0 waited
   * for transfers, per communicator: the first few, the rest in the last entry
   * (rtp_graph_timing_get). */
  double wall_s;
  struct rtp_plan_wait waits[RTP__PLAN_WAIT_GROUPS];
};

/* ---- rtp-io.c: files ---- */
/* Around each file the library writes: a write past the file size limit (ulimit -f) then
 * fails with EFBIG, which the writer reports, instead of killing the process with
 * SIGXFSZ. begin returns whether it blocked the signal; pass that to end. */
bool rtp__fsize_guard_begin(void);
void rtp__fsize_guard_end(bool blocked);

/* ---- rtp-trace.c: RTP_TRACE ---- */
bool rtp__trace_on(void);
/* Wall-clock seconds (CLOCK_REALTIME): the trace's time base. */
double rtp__trace_now(void);
/* Node t's span [t0, t1] (seconds) on lane 0 (compute and waits) or 1 (transfers). */
void rtp__trace_span(int lane, const struct rtp_tensor *t, const char *cat, double t0,
                     double t1);
/* A whole rtp_graph_compute of g, on lane 2. */
void rtp__trace_graph(const struct rtp_graph *g, double t0, double t1);

/* ---- rtp-io.c: files ---- */
/* Opens path for reading if it is a regular file of at most max_bytes, without blocking
 * (a FIFO) and before reading a byte: *fd (blocking reads) and its size. Anything else is
 * refused, naming path: RTP_EIO for what cannot be opened and for any other type (FIFO,
 * device, directory, socket), RTP_EFORMAT for a larger file. Every file the library reads
 * is opened through here. */
int rtp__file_open(const char *path, uint64_t max_bytes, int *fd, uint64_t *bytes);
/* "[d0, ..., dk]": the file shape (outermost first) of the n_dims dims of ne, in buf. */
const char *rtp__file_shape_str(const int64_t *ne, int n_dims, char *buf, size_t size);
/* rtp_safetensors_open of a file that must be `bytes` long (UINT64_MAX: any), checked
 * before its header is read (RTP_EFORMAT). */
int rtp__safetensors_open(const char *path, uint64_t bytes, struct rtp_safetensors **out);
/* Reads the box of the named tensor that starts at element `at` (ggml order) and has t's
 * shape into t (a view of any strides; in device memory, with contiguous rows). RTP_ESHAPE
 * for a box that is not inside the tensor or of another type. */
int rtp__safetensors_read_box(struct rtp_safetensors *st, const char *name, const int64_t *at,
                              struct rtp_tensor *t);

/* ---- rtp-reshard.c ---- */
/* The move of a tensor of shape ne (RTP_MAX_DIMS of them, unused ones 1) and elem_size
 * bytes an element from (mesh[0], lay[0]) to (mesh[1], lay[1]), which the caller fills
 * before planning: the move every internal user (a stage boundary, a checkpoint's load, a
 * live reshard) plans. */
struct rtp_reshard_params rtp__reshard_params_pair(struct rtp_mesh mesh[2],
                                                   struct rtp_layout lay[2], const int64_t *ne,
                                                   size_t elem_size);

/* ---- rtp-reshard-exec.c: where a rank's local tensor holds the global one ---- */
/* Per dimension, the distinct intervals of the slices of a plan (rtp_reshard_plan) that a
 * rank holds (or receives), sorted: its local tensor is their concatenation, as the
 * layouts' blocks (and groups) are. */
struct rtp__reshard_map {
  int n[RTP_MAX_DIMS];
  int64_t *first[RTP_MAX_DIMS]; /* n pairs: an interval's global first, its local first */
  int64_t ne[RTP_MAX_DIMS];     /* the local tensor's shape */
};
/* The map of the slices of r that rank holds (holders) or receives. false when out of
 * memory; m->n[0] == 0 when the rank is in none. */
bool rtp__reshard_map_init(struct rtp__reshard_map *m, const struct rtp_reshard *r, int rank,
                           bool holders);
void rtp__reshard_map_free(struct rtp__reshard_map *m);
/* The byte offset in local tensor t (of map m) of a box whose global first element is
 * `first` (a slice's, or inside one). */
size_t rtp__reshard_map_offset(const struct rtp__reshard_map *m, const struct rtp_tensor *t,
                               const int64_t *first);

#endif /* RTP_IMPL_H */
