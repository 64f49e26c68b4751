/* rtp-backend.h - what a device backend (CUDA) provides to the context, the planner,
 * the executor and the optimizer. Internal: users see only struct rtp_backend handles.
 *
 * The CPU needs none of this: host memory, the thread pool and host-side asynchronous
 * transfers (rtp-exec.c). A device backend instead owns memory the host cannot read and
 * two in-order queues ("streams"): every kernel goes on the compute stream, every
 * transfer on the comm stream, and events recorded on one stream and waited on by the
 * other order them. The executor decides where events go (rtp-exec.c, stream path);
 * the backend only enqueues. */
#ifndef RTP_BACKEND_H
#define RTP_BACKEND_H

#include "rtp-impl.h"

enum rtp_stream { RTP_STREAM_COMPUTE = 0, RTP_STREAM_COMM = 1 };

struct rtp_comm_op;

/* One Adam update of n floats, enqueued on the compute stream (the arithmetic of
 * rtp__adam_update, PyTorch's form). */
struct rtp_adam_args {
  float *w, *m, *v;
  const float *g;
  int64_t n;
  float gscale, beta1, beta2, eps, decay, lr_t, bc2;
};

/* Elements [i0, i1) of a's update, on the host: the CPU optimizer's threads and the
 * simulated device run this one loop, so their results are the same bits (rtp-opt.c). */
void rtp__adam_update(const struct rtp_adam_args *a, int64_t i0, int64_t i1);

struct rtp_backend;

/* Every function returns RTP_OK or a negative status after setting the message with
 * rtp__error (naming the device and the CUDA/cuBLAS/NCCL error). Enqueuing functions
 * may report a failure of earlier asynchronous work; sync reports every failure. */
struct rtp_backend_i {
  const char *name;
  void (*free)(struct rtp_backend *b);

  /* Memory: one allocation per arena, taken once (never in the step loop). */
  int (*alloc)(struct rtp_backend *b, size_t size, void **out);
  void (*release)(struct rtp_backend *b, void *p);
  /* Synchronous copies between host memory and backend memory, and zero fill. */
  int (*set)(struct rtp_backend *b, void *dst, const void *src, size_t n);
  int (*get)(struct rtp_backend *b, void *dst, const void *src, size_t n);
  int (*zero)(struct rtp_backend *b, void *dst, size_t n);

  /* Scratch bytes node t needs (shared by all nodes of a graph, like the CPU's). */
  size_t (*work_size)(struct rtp_backend *b, const struct rtp_tensor *t);
  /* Events 0..n-1 for the executor; called once per graph at plan time (graphs of
   * one context share them, so the largest n wins). */
  int (*events_reserve)(struct rtp_backend *b, int n);
  /* Enqueue node t (every op but views, COMM and EMPTY) on the compute stream. */
  int (*compute)(struct rtp_backend *b, struct rtp_tensor *t, void *work);
  /* Enqueue op (a COMM node's, rtp__comm_node_op) on the comm stream through c. */
  int (*comm)(struct rtp_backend *b, struct rtp_comm *c, struct rtp_comm_op *op);
  int (*record)(struct rtp_backend *b, enum rtp_stream s, int event);
  int (*wait)(struct rtp_backend *b, enum rtp_stream s, int event);
  /* Blocks until both streams are idle; reports any failure since the last sync,
   * including a kernel that met an index out of range (RTP_EINVAL naming the op). */
  int (*sync)(struct rtp_backend *b);

  /* Optimizer, on the compute stream. sumsq blocks and returns sum(g[i]^2). */
  int (*adam)(struct rtp_backend *b, const struct rtp_adam_args *a);
  int (*sumsq)(struct rtp_backend *b, const float *g, int64_t n, double *out);

  /* Whether compute has a kernel for op; NULL: every op. Builders and the planner refuse
   * what it has none for (RTP_ENOSYS) before anything runs. */
  bool (*has_kernel)(struct rtp_backend *b, enum rtp_op op);
};

struct rtp_backend {
  const struct rtp_backend_i *i;
  void *impl;
};

/* The backend that owns t's data, or NULL for host memory. */
struct rtp_backend *rtp__tensor_backend(const struct rtp_tensor *t);
struct rtp_backend *rtp__ctx_backend(const struct rtp_context *ctx);

/* rtp-sim.c: controls of the simulated device for tests (rtp_backend_sim_new). Which
 * stream runs when both may (random: drawn from the seed), and the control run that drops
 * every wait (results must then differ). RTP_EINVAL if b is not a simulated device. */
enum rtp__sim_order { RTP__SIM_RANDOM, RTP__SIM_COMPUTE_FIRST, RTP__SIM_COMM_FIRST };
int rtp__sim_set_order(struct rtp_backend *b, enum rtp__sim_order order);
int rtp__sim_drop_waits(struct rtp_backend *b, bool drop);
/* Host copies (set, get, zero) made while work was queued: the executor never makes one,
 * so tests expect 0; -1 if b is not a simulated device. */
long rtp__sim_host_touches_while_busy(struct rtp_backend *b);

#ifdef RTP_HAVE_CUDA
/* rtp-cuda.cu */
int rtp__cuda_backend_new(int device, struct rtp_backend **out);
int rtp__cuda_device_count(void);
#endif

#endif /* RTP_BACKEND_H */
