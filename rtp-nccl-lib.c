/* rtp-nccl-lib.c - NCCL, opened with dlopen by the first user of the nccl transport
 * (rtp-nccl-lib.h). Linking it would make every program of a CUDA build need libnccl to
 * start, CPU runs included (docs/backend.md, "CUDA at run time"). */
#define _GNU_SOURCE /* RTLD_DEFAULT */
#include "rtp-nccl-lib.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>

#include "rtp-impl.h"

#define NL_STR_(x) #x
#define NL_STR(x) NL_STR_(x)
#define NL_SONAME "libnccl.so." NL_STR(NCCL_MAJOR)

struct rtp_nccl_fn rtp__nccl_fn;

static pthread_mutex_t nl_mu = PTHREAD_MUTEX_INITIALIZER;
static bool nl_loaded; /* under nl_mu, or read after a locked check set it */

/* Fills fn from lib (a handle, or RTLD_DEFAULT); false, with why, if one is missing. */
static bool nl_resolve(void *lib, const char *name, struct rtp_nccl_fn *fn, char *why,
                       size_t n) {
#define NL_LOAD(f)                                                        \
  if (!(*(void **)&fn->f = dlsym(lib, "nccl" #f))) {                      \
    snprintf(why, n, "%s has no nccl" #f " (NCCL 2.14 or later?)", name); \
    return false;                                                         \
  }
  RTP_NCCL_FUNCS(NL_LOAD)
#undef NL_LOAD
  return true;
}

static bool nl_open(const char *name, struct rtp_nccl_fn *fn, char *why, size_t n) {
  void *lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    const char *e = dlerror();
    snprintf(why, n, "%s", e ? e : name);
    return false;
  }
  if (nl_resolve(lib, name, fn, why, n)) return true; /* stays loaded until exit */
  dlclose(lib);
  return false;
}

static int nl_load_locked(void) {
  struct rtp_nccl_fn fn;
  char why[512] = "";
  const char *env = getenv("RTP_NCCL_LIBRARY");
  bool ok;
  if (env && env[0]) {
    ok = nl_open(env, &fn, why, sizeof(why));
  } else {
    /* A program that links NCCL (or a library that loaded it globally) has its symbols
     * here already: share that copy rather than load a second, maybe other, version. */
    ok = dlsym(RTLD_DEFAULT, "ncclGetVersion") &&
         nl_resolve(RTLD_DEFAULT, "this process", &fn, why, sizeof(why));
    if (!ok) ok = nl_open(NL_SONAME, &fn, why, sizeof(why));
#ifdef RTP_NCCL_PATH /* where the build found it: a toolkit the loader does not search */
    char first[sizeof(why)];
    snprintf(first, sizeof(first), "%s", why);
    if (!ok && !(ok = nl_open(RTP_NCCL_PATH, &fn, why, sizeof(why))))
      snprintf(why, sizeof(why), "%s", first); /* the soname's reason is the telling one */
#endif
  }
  if (!ok)
    return rtp__error(RTP_ENOSYS,
                      "the nccl backend needs NCCL (%s), which cannot be loaded: %s (install "
                      "NCCL 2.19 or later, or set RTP_NCCL_LIBRARY to its path)",
                      env && env[0] ? env : NL_SONAME, why);
  rtp__nccl_fn = fn;
  __atomic_store_n(&nl_loaded, true, __ATOMIC_RELEASE);
  return RTP_OK;
}

int rtp__nccl_load(void) {
  if (__atomic_load_n(&nl_loaded, __ATOMIC_ACQUIRE)) return RTP_OK;
  pthread_mutex_lock(&nl_mu);
  int st = nl_loaded ? RTP_OK : nl_load_locked();
  pthread_mutex_unlock(&nl_mu);
  return st;
}
