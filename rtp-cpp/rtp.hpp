// rtp.hpp - a thin, header-only C++17 wrapper over rtp.h.
//
// What it adds, and nothing more: owners that free their handle (context, threadpool,
// safetensors, comm), and exceptions instead of status codes. Everything else is the C
// API: the owners convert to their raw pointers, so models are built with rtp_add,
// rtp_mul_mat, ... as in C, and a builder's NULL becomes an exception through
// context::check:
//
//     rtp::context ctx(16 << 20);
//     rtp_tensor *x = ctx.check(rtp_tensor_new_1d(ctx, RTP_TYPE_F32, 4));
//     rtp_tensor *y = ctx.check(rtp_add(ctx, x, w));   // throws rtp::error on a bad shape
//     rtp::graph g(ctx, 256);
//     g.build(loss).backward(loss).plan();
//     rtp::optimizer opt(ctx, g);
//     g.compute(tp); opt.step(tp);
//
// Every failure throws rtp::error with the status code and the library's message.
#ifndef RTP_HPP
#define RTP_HPP

#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "rtp.h"

namespace rtp {

// A failed call: status() is the RTP_E* code, what() the library's message.
class error : public std::runtime_error {
 public:
  error(int status, const std::string &msg)
      : std::runtime_error(msg.empty() ? std::string(rtp_strerror(status)) : msg),
        status_(status) {}
  int status() const noexcept {
    return status_;
  }

 private:
  int status_;
};

// Throws the calling thread's last error when status is negative; returns it otherwise.
inline int check(int status) {
  if (status < 0) throw error(status, rtp_last_error());
  return status;
}

// Throws the last error when a call that reports failure as NULL returned it.
template <class T>
T *check_ptr(T *p, int status_if_null = RTP_EINVAL) {
  if (!p) throw error(status_if_null, rtp_last_error());
  return p;
}

// p itself, or ctx's first recorded error (a builder's failure) as an exception.
template <class T>
T *check(rtp_context *ctx, T *p) {
  if (p) return p;
  const char *msg = "";
  int status = rtp_context_error(ctx, &msg);
  if (status) throw error(status, msg);
  throw error(RTP_EINVAL, rtp_last_error());
}

// Element i of t as f32 (any strides, host or device memory); throws if it cannot be read.
inline float get_f32(const rtp_tensor *t, int64_t i) {
  float v = 0;
  check(rtp_tensor_get_f32(t, i, &v));
  return v;
}

namespace detail {

// Move-only ownership of one C handle, freed by Free.
template <class T, void (*Free)(T *)>
class handle {
 public:
  handle() = default;
  explicit handle(T *p) : p_(p) {}
  handle(const handle &) = delete;
  handle &operator=(const handle &) = delete;
  handle(handle &&o) noexcept : p_(std::exchange(o.p_, nullptr)) {}
  handle &operator=(handle &&o) noexcept {
    if (this != &o) reset(std::exchange(o.p_, nullptr));
    return *this;
  }
  ~handle() {
    reset();
  }
  T *get() const noexcept {
    return p_;
  }
  operator T *() const noexcept {
    return p_;
  }
  explicit operator bool() const noexcept {
    return p_ != nullptr;
  }
  void reset(T *p = nullptr) noexcept {
    if (p_) Free(p_);
    p_ = p;
  }
  T *release() noexcept {
    return std::exchange(p_, nullptr);
  }

 private:
  T *p_ = nullptr;
};

}  // namespace detail

// A device to compute on; outlives every context made with it.
class backend : public detail::handle<rtp_backend, rtp_backend_free> {
 public:
  static backend cuda(int device = 0) {
    rtp_backend *b = nullptr;
    check(rtp_backend_cuda_new(device, &b));
    return backend(b);
  }
  // The simulated device (rtp_backend_sim_new): a program's device path without a GPU.
  static backend sim(unsigned seed = 1) {
    rtp_backend *b = nullptr;
    check(rtp_backend_sim_new(seed, &b));
    return backend(b);
  }
  static int cuda_count() {
    return rtp_backend_cuda_count();
  }
  const char *name() const {
    return rtp_backend_name(get());
  }

 private:
  explicit backend(rtp_backend *b) : handle(b) {}
};

// The arena that owns tensors, graphs and optimizer states.
class context : public detail::handle<rtp_context, rtp_context_free> {
 public:
  explicit context(size_t mem_size, void *mem_buffer = nullptr, bool no_alloc = false,
                   rtp_backend *backend = nullptr, size_t data_size = 0)
      : handle(check_ptr(rtp_context_new(rtp_init_params{mem_size, mem_buffer, no_alloc,
                                                         backend, data_size}),
                         RTP_ENOMEM)) {}

  // p itself, or the context's first recorded error as an exception when p is NULL.
  template <class T>
  T *check(T *p) const {
    return rtp::check(get(), p);
  }

  rtp_mem_report mem_report() const {
    rtp_mem_report r;
    rtp_mem_report_get(get(), &r);
    return r;
  }
};

class threadpool : public detail::handle<rtp_threadpool, rtp_threadpool_free> {
 public:
  // n_threads <= 0: one per core.
  explicit threadpool(int n_threads = 0)
      : handle(check_ptr(rtp_threadpool_new(n_threads), RTP_ENOMEM)) {}
  int size() const {
    return rtp_threadpool_size(get());
  }
};

// A graph lives in its context's arena: this is a handle that throws, not an owner.
class graph {
 public:
  graph(rtp_context *ctx, int size) : ctx_(ctx), g_(check(ctx, rtp_graph_new(ctx, size))) {}
  graph &build(rtp_tensor *t) {
    check(rtp_graph_build(g_, t));
    return *this;
  }
  graph &backward(rtp_tensor *loss) {
    check(rtp_graph_build_backward(ctx_, g_, loss));
    return *this;
  }
  graph &plan() {
    check(rtp_graph_plan(ctx_, g_));
    return *this;
  }
  void compute(rtp_threadpool *tp = nullptr) {
    check(rtp_graph_compute(g_, tp));
  }
  rtp_graph *get() const noexcept {
    return g_;
  }
  operator rtp_graph *() const noexcept {
    return g_;
  }

 private:
  rtp_context *ctx_;
  rtp_graph *g_;
};

// Adam(W) states for the parameters of a graph; they live in the context's arena.
class optimizer {
 public:
  optimizer(rtp_context *ctx, const graph &g, rtp_adamw_params hp = rtp_adamw_params_default())
      : opt_(check(ctx, rtp_optimizer_new(ctx, g, hp))) {}
  void step(rtp_threadpool *tp = nullptr) {
    check(rtp_optimizer_step(opt_, tp));
  }
  void set_lr(float lr) {
    check(rtp_optimizer_set_lr(opt_, lr));
  }
  int64_t steps() const {
    return rtp_optimizer_steps(opt_);
  }
  rtp_optimizer *get() const noexcept {
    return opt_;
  }

 private:
  rtp_optimizer *opt_;
};

// An opened safetensors file (header checked, no data read yet).
class safetensors : public detail::handle<rtp_safetensors, rtp_safetensors_close> {
 public:
  explicit safetensors(const std::string &path) : handle(open(path)) {}
  int count() const {
    return rtp_safetensors_count(get());
  }
  // -1 if absent.
  int find(const std::string &name) const {
    return rtp_safetensors_find(get(), name.c_str());
  }
  // nullptr if absent.
  const char *meta(const std::string &key) const {
    return rtp_safetensors_meta(get(), key.c_str());
  }
  void read(const std::string &name, rtp_tensor *t) {
    check(rtp_safetensors_read(get(), name.c_str(), t));
  }
  rtp_tensor *load(rtp_context *ctx, const std::string &name) {
    return check_ptr(rtp_safetensors_load(ctx, get(), name.c_str()));
  }

  // Writes tensors by their names, with optional metadata pairs {key, value, ...}.
  static void save(const std::string &path, const std::vector<rtp_tensor *> &tensors,
                   const std::vector<std::string> &meta = {}) {
    std::vector<const char *> kv;
    for (const std::string &s : meta) kv.push_back(s.c_str());
    kv.push_back(nullptr);
    check(rtp_safetensors_save(path.c_str(), tensors.data(), (int)tensors.size(), kv.data()));
  }

 private:
  static rtp_safetensors *open(const std::string &path) {
    rtp_safetensors *st = nullptr;
    check(rtp_safetensors_open(path.c_str(), &st));
    return st;
  }
};

// A joined communicator; the destructor says goodbye to every peer.
class comm : public detail::handle<rtp_comm, rtp_comm_free> {
 public:
  explicit comm(const rtp_comm_params &p) : handle(init(p)) {}
  // The defaults overridden by the RTP_* environment (rtp_comm_params_from_env).
  static comm from_env() {
    rtp_comm_params p = rtp_comm_params_default();
    check(rtp_comm_params_from_env(&p));
    return comm(p);
  }
  int rank() const {
    return rtp_comm_rank(get());
  }
  int size() const {
    return rtp_comm_size(get());
  }
  // Throws the status that failed the communicator, if any.
  void check_status() const {
    const char *msg = "";
    int status = rtp_comm_status(get(), &msg);
    if (status) throw error(status, msg ? msg : "");
  }

 private:
  static rtp_comm *init(const rtp_comm_params &p) {
    rtp_comm *c = nullptr;
    check(rtp_comm_init(&p, &c));
    return c;
  }
};

}  // namespace rtp

#endif  // RTP_HPP
