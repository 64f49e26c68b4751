// fake-cuda.cpp - a fake CUDA runtime and NCCL, so that rtp-nccl.c runs every path on a
// machine without a GPU: device memory is host memory, a stream is a thread running its
// queue in order, an event is a marker in that queue. An NCCL communicator is a second TCP
// rtp_comm (the unique id carries its port); an NCCL operation is queued on its stream and
// runs there over that communicator. Like a real NCCL kernel, an operation whose peer is
// gone (or that a test made fail, fake-hooks.h) does not end until the communicator is
// aborted. Like a real non-blocking communicator, init, some operations and finalize
// return ncclInProgress first.
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "cuda_runtime.h"
#include "fake-hooks.h"
#include "nccl.h"
#include "rtp.h"
#include "test-util.h"
extern "C" {
#include "rtp-nccl.h"
}

fake_hooks fake;

// ---- CUDA ------------------------------------------------------------------------------

struct fake_stream {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::function<void()>> q;
  bool busy = false, stop = false;
  std::thread th;

  fake_stream() : th([this] { run(); }) {}
  ~fake_stream() {
    {
      std::lock_guard<std::mutex> lk(mu);
      stop = true;
      cv.notify_all();
    }
    th.join();
  }
  void run() {
    std::unique_lock<std::mutex> lk(mu);
    for (;;) {
      cv.wait(lk, [&] { return stop || !q.empty(); });
      if (q.empty()) return;  // stopped, and everything queued has run
      auto f = std::move(q.front());
      q.pop_front();
      busy = true;
      lk.unlock();
      f();
      lk.lock();
      busy = false;
      cv.notify_all();
    }
  }
  void push(std::function<void()> f) {
    std::lock_guard<std::mutex> lk(mu);
    q.push_back(std::move(f));
    cv.notify_all();
  }
  void sync() {
    std::unique_lock<std::mutex> lk(mu);
    cv.wait(lk, [&] { return q.empty() && !busy; });
  }
};

struct fake_event {
  struct state {
    std::mutex mu;
    unsigned long recorded = 0, reached = 0;
  };
  std::shared_ptr<state> s = std::make_shared<state>();  // outlives a destroyed event
};

namespace {

thread_local cudaError_t last_cuda = cudaSuccess;
thread_local int current_device = 0;
std::mutex mem_mu;
std::map<const char *, std::pair<size_t, int>> allocations;  // base -> (size, device)

cudaError_t fail(cudaError_t e) {
  last_cuda = e;
  return e;
}

fake_stream *stream_of(cudaStream_t s) {
  static fake_stream *legacy = new fake_stream;  // the NULL stream; lives until exit
  return s ? s : legacy;
}

}  // namespace

void fake_stream_sleep(cudaStream_t s, int ms) {
  stream_of(s)->push([ms] { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); });
}

extern "C" {

const char *cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess:
      return "no error";
    case cudaErrorNoDevice:
      return "no CUDA-capable device is detected";
    case cudaErrorInsufficientDriver:
      return "CUDA driver version is insufficient for CUDA runtime version";
    case cudaErrorInvalidDevice:
      return "invalid device ordinal";
    case cudaErrorInvalidValue:
      return "invalid argument";
    case cudaErrorMemoryAllocation:
      return "out of memory";
    case cudaErrorNotReady:
      return "device not ready";
    case cudaErrorIllegalAddress:
      return "an illegal memory access was encountered";
    default:
      return "some CUDA error";
  }
}

const char *cudaGetErrorName(cudaError_t e) {
  static thread_local char buf[32];
  snprintf(buf, sizeof(buf), "cudaError%d", (int)e);
  return buf;
}

cudaError_t cudaGetLastError(void) {
  cudaError_t e = last_cuda;
  last_cuda = cudaSuccess;
  return e;
}

cudaError_t cudaGetDeviceCount(int *count) {
  *count = 0;
  if (fake.devices <= 0) return fail(cudaErrorNoDevice);
  *count = fake.devices;
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
  if (device < 0 || device >= fake.devices) return fail(cudaErrorInvalidDevice);
  current_device = device;
  return cudaSuccess;
}

cudaError_t cudaGetDevice(int *device) {
  if (fake.devices <= 0) return fail(cudaErrorNoDevice);
  *device = current_device;
  return cudaSuccess;
}

cudaError_t cudaMalloc(void **p, size_t n) {
  *p = malloc(n ? n : 1);
  if (!*p) return fail(cudaErrorMemoryAllocation);
  std::lock_guard<std::mutex> lk(mem_mu);
  allocations[(const char *)*p] = {n, current_device};
  return cudaSuccess;
}

cudaError_t cudaFree(void *p) {
  if (!p) return cudaSuccess;
  std::lock_guard<std::mutex> lk(mem_mu);
  if (!allocations.erase((const char *)p)) return fail(cudaErrorInvalidDevicePointer);
  free(p);
  return cudaSuccess;
}

cudaError_t cudaMemset(void *p, int v, size_t n) {
  memset(p, v, n);
  return cudaSuccess;
}

cudaError_t cudaMemcpy(void *dst, const void *src, size_t n, enum cudaMemcpyKind kind) {
  (void)kind;
  memmove(dst, src, n);
  return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, enum cudaMemcpyKind kind,
                            cudaStream_t s) {
  (void)kind;
  stream_of(s)->push([=] { memmove(dst, src, n); });
  return cudaSuccess;
}

cudaError_t cudaHostAlloc(void **p, size_t n, unsigned int flags) {
  (void)flags;
  *p = fake.host_alloc_fails ? nullptr : malloc(n ? n : 1);
  if (!*p) return fail(cudaErrorMemoryAllocation);
  fake.host_allocs++;
  return cudaSuccess;
}

cudaError_t cudaFreeHost(void *p) {
  free(p);
  return cudaSuccess;
}

// Runs fn on the stream's thread, as the driver runs it on a thread of its own.
cudaError_t cudaLaunchHostFunc(cudaStream_t s, cudaHostFn_t fn, void *user) {
  stream_of(s)->push([fn, user] { fn(user); });
  return cudaSuccess;
}

cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes *a, const void *p) {
  memset(a, 0, sizeof(*a));
  a->device = -2;
  std::lock_guard<std::mutex> lk(mem_mu);
  auto it = allocations.upper_bound((const char *)p);
  if (it != allocations.begin()) {
    --it;
    if ((const char *)p < it->first + it->second.first) {
      a->type = cudaMemoryTypeDevice;
      a->device = it->second.second;
      a->devicePointer = (void *)p;
    }
  }
  return cudaSuccess;
}

cudaError_t cudaStreamCreate(cudaStream_t *s) {
  *s = new fake_stream;
  return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t s) {
  delete s;  // runs what is queued first
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  stream_of(s)->sync();
  return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned int flags) {
  (void)flags;
  *e = new fake_event;
  return cudaSuccess;
}

cudaError_t cudaEventDestroy(cudaEvent_t e) {
  delete e;
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
  auto st = e->s;
  unsigned long k;
  {
    std::lock_guard<std::mutex> lk(st->mu);
    k = ++st->recorded;
  }
  stream_of(s)->push([st, k] {
    std::lock_guard<std::mutex> lk(st->mu);
    if (st->reached < k) st->reached = k;
  });
  return cudaSuccess;
}

cudaError_t cudaEventQuery(cudaEvent_t e) {
  std::lock_guard<std::mutex> lk(e->s->mu);
  return e->s->reached >= e->s->recorded ? cudaSuccess : cudaErrorNotReady;
}

}  // extern "C"

// ---- NCCL ------------------------------------------------------------------------------

struct fake_nccl_comm {
  int rank = 0, size = 1;
  rtp_comm *wire = nullptr;
  std::mutex mu;
  std::condition_variable cv;
  ncclResult_t state = ncclInProgress;  // what ncclCommGetAsyncError says
  int polls = 0;                        // polls until an in-progress call is done
  bool hang = false, finalizing = false, aborted = false;
  int running = 0;  // operations queued and not finished
  char last[256] = "";
};

namespace {

enum op_kind { OP_SEND, OP_RECV, OP_ALLREDUCE, OP_ALLGATHER, OP_BROADCAST };
struct op {
  op_kind kind;
  const void *s;
  void *r;
  size_t count;  // bytes, or floats for allreduce
  int peer;      // send/recv peer, broadcast root
};

struct group {
  int depth = 0;
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  std::vector<op> ops;
};
thread_local group grp;
std::mutex global_mu;
char global_last[256] = "";

// Sets an asynchronous error (the first one sticks), under c->mu.
void set_error_locked(ncclComm_t c, ncclResult_t r, const char *why) {
  if (c->state != ncclSuccess && c->state != ncclInProgress) return;
  snprintf(c->last, sizeof(c->last), "%s", why);
  c->state = r;
}

bool run_ops(ncclComm_t c, const std::vector<op> &ops) {
  std::vector<rtp_comm_req *> reqs;
  bool ok = true;
  for (const op &o : ops) {
    rtp_comm_req *q = nullptr;
    switch (o.kind) {
      case OP_SEND:
        ok = rtp_comm_send(c->wire, o.s, o.count, o.peer, &q) == RTP_OK;
        break;
      case OP_RECV:
        ok = rtp_comm_recv(c->wire, o.r, o.count, o.peer, &q) == RTP_OK;
        break;
      case OP_ALLREDUCE:
        if (o.s != o.r) memmove(o.r, o.s, o.count * 4);
        ok = rtp_comm_allreduce(c->wire, (float *)o.r, o.count, nullptr) == RTP_OK;
        break;
      case OP_ALLGATHER:
        if (o.s != (char *)o.r + (size_t)c->rank * o.count)
          memmove((char *)o.r + (size_t)c->rank * o.count, o.s, o.count);
        ok = rtp_comm_allgather(c->wire, o.r, (size_t)c->size * o.count, 1, nullptr) == RTP_OK;
        break;
      case OP_BROADCAST:
        if (c->rank == o.peer && o.s != o.r) memmove(o.r, o.s, o.count);
        ok = rtp_comm_broadcast(c->wire, o.r, o.count, o.peer, nullptr) == RTP_OK;
        break;
    }
    if (q) reqs.push_back(q);
    if (!ok) break;
  }
  for (auto *q : reqs) ok &= rtp_comm_wait(q) == RTP_OK;
  return ok;
}

// Queues the operations of one group on its stream.
ncclResult_t launch(ncclComm_t c, cudaStream_t s, std::vector<op> ops) {
  int n = fake.ops++;
  bool injected = c->rank == fake.fail_rank && n == fake.fail_op;
  std::lock_guard<std::mutex> lk(c->mu);
  if (c->aborted) return ncclInvalidUsage;
  if (c->state != ncclSuccess) return c->state;  // an asynchronous error, or a call unsettled
  if (injected) set_error_locked(c, ncclSystemError, "fake: injected network failure");
  c->running++;
  stream_of(s)->push([c, ops, injected] {
    bool run = false;
    {
      std::lock_guard<std::mutex> lk(c->mu);
      run = !injected && !c->aborted;  // an aborted kernel ends at once
    }
    bool ok = !run || run_ops(c, ops);
    std::unique_lock<std::mutex> lk(c->mu);
    if (!ok && !c->aborted && fake.loss_reports)
      set_error_locked(c, ncclRemoteError, "fake: a peer exited or the network failed");
    if (!ok || injected) c->cv.wait(lk, [c] { return c->aborted; });  // hangs like a kernel
    c->running--;
    c->cv.notify_all();
  });
  if (n % 2 == 0) return ncclSuccess;  // the error of an injected one shows when polled
  if (!injected) {
    c->state = ncclInProgress;  // odd ones are still being set up
    c->polls = 1;
  }
  return ncclInProgress;
}

ncclResult_t add(op o, ncclComm_t c, cudaStream_t s) {
  if (!c) return ncclInvalidArgument;
  if (grp.depth == 0) return launch(c, s, {o});
  if (grp.comm && (grp.comm != c || grp.stream != s)) return ncclInvalidUsage;  // not faked
  grp.comm = c;
  grp.stream = s;
  grp.ops.push_back(o);
  return ncclSuccess;
}

}  // namespace

extern "C" {

const char *ncclGetErrorString(ncclResult_t r) {
  static const char *const s[] = {
      "no error",       "unhandled cuda error", "unhandled system error",
      "internal error", "invalid argument",     "invalid usage",
      "remote error",   "operation in progress"};
  return r >= 0 && r < ncclNumResults ? s[r] : "unknown result code";
}

ncclResult_t ncclGetVersion(int *version) {
  *version = fake.nccl_version;
  return ncclSuccess;
}

const char *ncclGetLastError(ncclComm_t comm) {
  return comm ? comm->last : global_last;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId *id) {
  memset(id, 0, sizeof(*id));
  snprintf(id->internal, sizeof(id->internal), "fake-nccl:%d", rtptest::free_port());
  return ncclSuccess;
}

// Joins the wire communicator now (every rank calls this), then says "in progress" for a
// poll or two, or for ever on fake.hang_init_rank. Two ranks on one device fail as in NCCL.
ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank,
                                    ncclConfig_t *config) {
  int port = 0;
  if (sscanf(id.internal, "fake-nccl:%d", &port) != 1 || config->blocking != 0) {
    std::lock_guard<std::mutex> lk(global_mu);
    snprintf(global_last, sizeof(global_last), "fake: bad id or a blocking config");
    return ncclInvalidArgument;
  }
  rtp_comm_params p = rtp_comm_params_default();
  snprintf(p.backend, sizeof(p.backend), "tcp");
  p.rank = rank;
  p.world_size = nranks;
  p.master_port = port;
  snprintf(p.token, sizeof(p.token), "fake-nccl-token-of-the-fake-cuda-tests");
  p.timeout_ms = 60000;  // the layer under test must notice failures first
  auto *c = new fake_nccl_comm;
  c->rank = rank;
  c->size = nranks;
  if (rtp_comm_init(&p, &c->wire) != RTP_OK) {
    std::lock_guard<std::mutex> lk(global_mu);
    snprintf(global_last, sizeof(global_last), "fake: %s", rtp_last_error());
    delete c;
    return ncclSystemError;
  }
  std::vector<int> dev(nranks);
  dev[rank] = current_device;
  rtp_comm_allgather(c->wire, dev.data(), nranks, sizeof(int), nullptr);
  for (int q = 0; q < nranks; q++)
    if (q != rank && dev[q] == dev[rank]) {
      char why[128];
      snprintf(why, sizeof(why),
               "Duplicate GPU detected : rank %d and rank %d both on CUDA device %d", rank, q,
               dev[rank]);
      set_error_locked(c, ncclInvalidUsage, why);
    }
  c->hang = rank == fake.hang_init_rank;
  c->polls = 2;
  *comm = c;
  return ncclInProgress;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t c, ncclResult_t *state) {
  std::lock_guard<std::mutex> lk(c->mu);
  if (c->state == ncclInProgress) {
    if (c->finalizing) {
      if (c->running == 0) c->state = ncclSuccess;
    } else if (c->polls > 0) {
      c->polls--;
    } else if (!c->hang) {
      c->state = ncclSuccess;
    }
  }
  *state = c->state;
  return ncclSuccess;
}

ncclResult_t ncclCommFinalize(ncclComm_t c) {
  std::lock_guard<std::mutex> lk(c->mu);
  if (c->state != ncclSuccess) return c->state;
  c->finalizing = true;
  c->state = ncclInProgress;
  return ncclInProgress;
}

static void release(ncclComm_t c) {
  {
    std::unique_lock<std::mutex> lk(c->mu);
    c->cv.wait(lk, [c] { return c->running == 0; });
  }
  rtp_comm_free(c->wire);
  delete c;
}

ncclResult_t ncclCommDestroy(ncclComm_t c) {
  release(c);
  return ncclSuccess;
}

// Ends every operation (their peers' then fail or hang, as with a real abort) and frees.
ncclResult_t ncclCommAbort(ncclComm_t c) {
  {
    std::lock_guard<std::mutex> lk(c->mu);
    c->aborted = true;
    c->cv.notify_all();
  }
  rtp_comm_abort(c->wire, RTP_ECOMM, "fake NCCL communicator aborted");
  release(c);
  return ncclSuccess;
}

ncclResult_t ncclGroupStart(void) {
  grp.depth++;
  return ncclSuccess;
}

ncclResult_t ncclGroupEnd(void) {
  if (grp.depth == 0) return ncclInvalidUsage;
  if (--grp.depth > 0 || grp.ops.empty()) return ncclSuccess;
  ncclComm_t c = grp.comm;
  cudaStream_t s = grp.stream;
  std::vector<op> ops;
  ops.swap(grp.ops);
  grp.comm = nullptr;
  return launch(c, s, std::move(ops));
}

ncclResult_t ncclSend(const void *buf, size_t count, ncclDataType_t type, int peer,
                      ncclComm_t comm, cudaStream_t s) {
  if (type != ncclInt8) return ncclInvalidArgument;
  return add({OP_SEND, buf, nullptr, count, peer}, comm, s);
}

ncclResult_t ncclRecv(void *buf, size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
                      cudaStream_t s) {
  if (type != ncclInt8) return ncclInvalidArgument;
  return add({OP_RECV, nullptr, buf, count, peer}, comm, s);
}

ncclResult_t ncclAllReduce(const void *sendbuf, void *recvbuf, size_t count,
                           ncclDataType_t type, ncclRedOp_t op, ncclComm_t comm,
                           cudaStream_t s) {
  if (type != ncclFloat32 || op != ncclSum) return ncclInvalidArgument;
  return add({OP_ALLREDUCE, sendbuf, recvbuf, count, 0}, comm, s);
}

ncclResult_t ncclAllGather(const void *sendbuf, void *recvbuf, size_t sendcount,
                           ncclDataType_t type, ncclComm_t comm, cudaStream_t s) {
  if (type != ncclInt8) return ncclInvalidArgument;
  return add({OP_ALLGATHER, sendbuf, recvbuf, sendcount, 0}, comm, s);
}

ncclResult_t ncclBroadcast(const void *sendbuf, void *recvbuf, size_t count,
                           ncclDataType_t type, int root, ncclComm_t comm, cudaStream_t s) {
  if (type != ncclInt8) return ncclInvalidArgument;
  return add({OP_BROADCAST, sendbuf, recvbuf, count, root}, comm, s);
}

}  // extern "C"
