/* rtp-gemm-dnnl.c - oneDNN as the GEMM provider. One matmul primitive per product shape,
 * made when a graph is planned (rtp__gemm_plan) and shared by every graph and thread; the
 * number of rows is a run-time dimension, so whatever share of the rows an executor thread
 * takes runs the same primitive. Each call runs on its caller's thread alone: the
 * executor's threads split the rows, and oneDNN's own (OpenMP) threads would compete
 * with them for the cores. */
#include "rtp-impl.h"

#include <oneapi/dnnl/dnnl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if DNNL_CPU_THREADING_RUNTIME == DNNL_RUNTIME_OMP
#include <omp.h>
#elif DNNL_CPU_THREADING_RUNTIME != DNNL_RUNTIME_SEQ
#error "rtp needs oneDNN built with its OpenMP or sequential CPU runtime"
#endif

/* C (rows x n) = X . Y^T: everything but the number of rows. */
struct prim_key {
  int64_t n, k, x_row, x_k, y_row, y_k, ldc;
  bool accumulate;
};

struct prim {
  struct prim_key key;
  dnnl_primitive_t p; /* NULL: oneDNN refused the shape, the caller falls back */
};

static struct {
  pthread_once_t once;
  dnnl_engine_t engine; /* NULL: oneDNN is unusable here, every call falls back */
  pthread_key_t stream_key;
  pthread_rwlock_t lock; /* over prims: looked up by every call, added to when planning */
  struct prim *prims;
  size_t n_prims, cap_prims, late;
  size_t declined; /* calls oneDNN did not take (atomic): the built-in kernel ran them */
  char kernel[96];
} dnnl = {.once = PTHREAD_ONCE_INIT, .lock = PTHREAD_RWLOCK_INITIALIZER};

/* oneDNN's OpenMP runtime takes its thread count from the calling thread's OpenMP
 * setting, which belongs to the application on its own thread: set to 1 around each call
 * and put back, so oneDNN never opens a parallel region. */
static int threads_enter(void) {
#if DNNL_CPU_THREADING_RUNTIME == DNNL_RUNTIME_OMP
  int n = omp_get_max_threads();
  if (n != 1) omp_set_num_threads(1);
  return n;
#else
  return 1;
#endif
}

static void threads_leave(int n) {
#if DNNL_CPU_THREADING_RUNTIME == DNNL_RUNTIME_OMP
  if (n != 1) omp_set_num_threads(n);
#else
  (void)n;
#endif
}

static void stream_free(void *s) {
  dnnl_stream_destroy(s);
}

static void dnnl_init_once(void) {
  if (dnnl_engine_create(&dnnl.engine, dnnl_cpu, 0) != dnnl_success) dnnl.engine = NULL;
  if (pthread_key_create(&dnnl.stream_key, stream_free)) {
    if (dnnl.engine) dnnl_engine_destroy(dnnl.engine);
    dnnl.engine = NULL;
  }
}

/* This thread's stream, made on its first product and destroyed when it ends. */
static dnnl_stream_t thread_stream(void) {
  dnnl_stream_t s = pthread_getspecific(dnnl.stream_key);
  if (s) return s;
  if (dnnl_stream_create(&s, dnnl.engine, dnnl_stream_default_flags) != dnnl_success)
    return NULL;
  if (pthread_setspecific(dnnl.stream_key, s)) {
    dnnl_stream_destroy(s);
    return NULL;
  }
  return s;
}

/* X (rows x k) at strides (x_row, x_k), as oneDNN's src; rows -1: a run-time dimension. */
static bool src_md(dnnl_memory_desc_t *md, const struct prim_key *key, int64_t rows) {
  dnnl_dims_t dims = {rows < 0 ? DNNL_RUNTIME_DIM_VAL : rows, key->k};
  dnnl_dims_t strides = {key->x_row, key->x_k};
  return dnnl_memory_desc_init_by_strides(md, 2, dims, dnnl_f32, strides) == dnnl_success;
}

/* Y^T (k x n) as oneDNN's weights: element (k, j) is Y(j, k). */
static bool weights_md(dnnl_memory_desc_t *md, const struct prim_key *key) {
  dnnl_dims_t dims = {key->k, key->n}, strides = {key->y_k, key->y_row};
  return dnnl_memory_desc_init_by_strides(md, 2, dims, dnnl_f32, strides) == dnnl_success;
}

static bool dst_md(dnnl_memory_desc_t *md, const struct prim_key *key, int64_t rows) {
  dnnl_dims_t dims = {rows < 0 ? DNNL_RUNTIME_DIM_VAL : rows, key->n}, strides = {key->ldc, 1};
  return dnnl_memory_desc_init_by_strides(md, 2, dims, dnnl_f32, strides) == dnnl_success;
}

static const char *isa_name(dnnl_cpu_isa_t isa) {
  switch (isa) {
    case dnnl_cpu_isa_sse41:
      return "sse41";
    case dnnl_cpu_isa_avx:
      return "avx";
    case dnnl_cpu_isa_avx2:
      return "avx2";
    case dnnl_cpu_isa_avx512_core:
      return "avx512_core";
    case dnnl_cpu_isa_avx512_core_vnni:
      return "avx512_core_vnni";
    case dnnl_cpu_isa_avx512_core_bf16:
      return "avx512_core_bf16";
    case dnnl_cpu_isa_avx512_core_amx:
      return "avx512_core_amx";
    default:
      return "other";
  }
}

/* The primitive for key, or NULL where oneDNN has none (the caller falls back). Threads
 * set to 1 around creation too: oneDNN may size a primitive's work by the count. */
static dnnl_primitive_t prim_create(const struct prim_key *key) {
  dnnl_memory_desc_t x, w, c;
  dnnl_matmul_desc_t mm;
  dnnl_primitive_attr_t attr = NULL;
  dnnl_post_ops_t po = NULL;
  dnnl_primitive_desc_t pd = NULL;
  dnnl_primitive_t p = NULL;
  int nt = threads_enter();
  bool ok = src_md(&x, key, -1) && weights_md(&w, key) && dst_md(&c, key, -1) &&
            dnnl_matmul_desc_init(&mm, &x, &w, NULL, &c) == dnnl_success &&
            dnnl_primitive_attr_create(&attr) == dnnl_success;
  /* Accumulating is a sum post-op: C = X . Y^T + C, read and written in place. */
  if (ok && key->accumulate)
    ok = dnnl_post_ops_create(&po) == dnnl_success &&
         dnnl_post_ops_append_sum(po, 1.0f) == dnnl_success &&
         dnnl_primitive_attr_set_post_ops(attr, po) == dnnl_success;
  ok = ok && dnnl_primitive_desc_create(&pd, &mm, attr, dnnl.engine, NULL) == dnnl_success;
  /* A primitive that needs scratch would allocate it per call (library scratchpad). */
  ok = ok && dnnl_memory_desc_get_size(
                 dnnl_primitive_desc_query_md(pd, dnnl_query_scratchpad_md, 0)) == 0;
  if (ok && dnnl_primitive_create(&p, pd) != dnnl_success) p = NULL;
  const char *impl = NULL;
  if (p && !dnnl.kernel[0] &&
      dnnl_primitive_desc_query(pd, dnnl_query_impl_info_str, 0, &impl) == dnnl_success) {
    const dnnl_version_t *v = dnnl_version();
    snprintf(dnnl.kernel, sizeof(dnnl.kernel), "oneDNN %d.%d.%d matmul %s (%s)", v->major,
             v->minor, v->patch, impl, isa_name(dnnl_get_effective_cpu_isa()));
  }
  if (pd) dnnl_primitive_desc_destroy(pd);
  if (po) dnnl_post_ops_destroy(po);
  if (attr) dnnl_primitive_attr_destroy(attr);
  threads_leave(nt);
  return p;
}

static bool key_eq(const struct prim_key *a, const struct prim_key *b) {
  return a->n == b->n && a->k == b->k && a->x_row == b->x_row && a->x_k == b->x_k &&
         a->y_row == b->y_row && a->y_k == b->y_k && a->ldc == b->ldc &&
         a->accumulate == b->accumulate;
}

/* Under the lock. */
static struct prim *prim_find(const struct prim_key *key) {
  for (size_t i = 0; i < dnnl.n_prims; i++)
    if (key_eq(&dnnl.prims[i].key, key)) return &dnnl.prims[i];
  return NULL;
}

/* The primitive for key, made now if no plan made it (late counts those). false: no
 * memory for the table; *p NULL: oneDNN has no primitive for it. */
static bool prim_get(const struct prim_key *key, bool planning, dnnl_primitive_t *p) {
  pthread_rwlock_rdlock(&dnnl.lock);
  struct prim *e = prim_find(key);
  *p = e ? e->p : NULL;
  pthread_rwlock_unlock(&dnnl.lock);
  if (e) return true;
  pthread_rwlock_wrlock(&dnnl.lock);
  bool ok = true;
  if ((e = prim_find(key))) {
    *p = e->p;
  } else if (dnnl.n_prims == dnnl.cap_prims &&
             !(e = realloc(dnnl.prims, (dnnl.cap_prims * 2 + 16) * sizeof(*e)))) {
    ok = false;
  } else {
    if (e) dnnl.prims = e, dnnl.cap_prims = dnnl.cap_prims * 2 + 16;
    *p = prim_create(key);
    dnnl.prims[dnnl.n_prims++] = (struct prim){*key, *p};
    dnnl.late += !planning;
  }
  pthread_rwlock_unlock(&dnnl.lock);
  return ok;
}

/* oneDNN reads each operand with packed rows or packed columns, as CBLAS does. */
static bool key_make(struct prim_key *key, int64_t n, int64_t k, int64_t x_row, int64_t x_k,
                     int64_t y_row, int64_t y_k, int64_t ldc, bool accumulate) {
  pthread_once(&dnnl.once, dnnl_init_once);
  bool packed;
  int64_t ld;
  if (!dnnl.engine || n <= 0 || k <= 0 || !rtp__gemm_layout(n, k, y_row, y_k, &packed, &ld))
    return false;
  /* Rows vary by call; a layout that holds for two rows holds for any number. */
  if (!(x_k == 1 && x_row >= k) && !(x_row == 1 && x_k >= 1)) return false;
  *key = (struct prim_key){n, k, x_row, x_k, y_row, y_k, ldc, accumulate};
  return true;
}

int rtp__gemm_plan(int64_t n, int64_t k, int64_t x_row, int64_t x_k, int64_t y_row, int64_t y_k,
                   int64_t ldc, bool accumulate) {
  struct prim_key key;
  dnnl_primitive_t p;
  if (!key_make(&key, n, k, x_row, x_k, y_row, y_k, ldc, accumulate)) return RTP_OK;
  return prim_get(&key, true, &p) ? RTP_OK
                                  : rtp__error(RTP_ENOMEM, "rtp_graph_plan: out of memory");
}

bool rtp__gemm_dnnl(int64_t m, int64_t n, int64_t k, const float *x, int64_t x_row, int64_t x_k,
                    const float *y, int64_t y_row, int64_t y_k, float *c, int64_t ldc,
                    bool accumulate) {
  struct prim_key key;
  dnnl_primitive_t p;
  dnnl_stream_t s;
  if (!key_make(&key, n, k, x_row, x_k, y_row, y_k, ldc, accumulate) ||
      !prim_get(&key, false, &p) || !p || !(s = thread_stream())) {
    __atomic_fetch_add(&dnnl.declined, 1, __ATOMIC_RELAXED);
    return false;
  }
  dnnl_memory_desc_t xd, wd, cd;
  dnnl_memory_t mx = NULL, mw = NULL, mc = NULL;
  bool ok = src_md(&xd, &key, m) && weights_md(&wd, &key) && dst_md(&cd, &key, m) &&
            dnnl_memory_create(&mx, &xd, dnnl.engine, (void *)x) == dnnl_success &&
            dnnl_memory_create(&mw, &wd, dnnl.engine, (void *)y) == dnnl_success &&
            dnnl_memory_create(&mc, &cd, dnnl.engine, c) == dnnl_success;
  if (ok) {
    dnnl_exec_arg_t args[] = {{DNNL_ARG_SRC, mx}, {DNNL_ARG_WEIGHTS, mw}, {DNNL_ARG_DST, mc}};
    int nt = threads_enter();
    ok = dnnl_primitive_execute(p, s, 3, args) == dnnl_success &&
         dnnl_stream_wait(s) == dnnl_success;
    threads_leave(nt);
  }
  if (mx) dnnl_memory_destroy(mx);
  if (mw) dnnl_memory_destroy(mw);
  if (mc) dnnl_memory_destroy(mc);
  if (!ok) __atomic_fetch_add(&dnnl.declined, 1, __ATOMIC_RELAXED);
  return ok;
}

const char *rtp__gemm_dnnl_kernel(void) {
  pthread_rwlock_rdlock(&dnnl.lock);
  const char *k = dnnl.kernel[0] ? dnnl.kernel : "oneDNN (no primitive made yet)";
  pthread_rwlock_unlock(&dnnl.lock);
  return k;
}

void rtp__gemm_dnnl_stats(size_t *primitives, size_t *late, size_t *declined) {
  pthread_rwlock_rdlock(&dnnl.lock);
  *primitives = dnnl.n_prims;
  *late = dnnl.late;
  *declined = __atomic_load_n(&dnnl.declined, __ATOMIC_RELAXED);
  pthread_rwlock_unlock(&dnnl.lock);
}
