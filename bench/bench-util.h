/* bench-util.h - what the benchmarks share: a clock, the process's memory from /proc, the
 * model presets, a median, a job token. */
#ifndef RTP_BENCH_UTIL_H
#define RTP_BENCH_UTIL_H

#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "gpt.h"

/* A fresh job token (64 hex digits from /dev/urandom) for ranks forked from this
 * process; exits if there is none to be had. */
static inline void bench_token(char *out, size_t n) {
  unsigned char b[32];
  FILE *f = fopen("/dev/urandom", "rb");
  if (!f || fread(b, 1, sizeof(b), f) != sizeof(b) || n < 2 * sizeof(b) + 1) {
    fprintf(stderr, "bench: no random token (/dev/urandom)\n");
    exit(1);
  }
  fclose(f);
  for (size_t i = 0; i < sizeof(b); i++) snprintf(out + 2 * i, 3, "%02x", b[i]);
}

static inline double bench_now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* VmHWM or VmRSS from /proc/self/status, in bytes. */
static inline size_t bench_proc_bytes(const char *key) {
  FILE *f = fopen("/proc/self/status", "r");
  char line[256];
  size_t kb = 0;
  while (f && fgets(line, sizeof(line), f))
    if (strncmp(line, key, strlen(key)) == 0)
      kb = (size_t)strtoull(line + strlen(key) + 1, NULL, 10);
  if (f) fclose(f);
  return kb * 1024;
}

/* Restarts VmHWM at the current RSS, so that a run after another in the same process
 * reports its own peak (Linux >= 4.0; where it fails the peak is the process's). */
static inline void bench_reset_peak(void) {
  FILE *f = fopen("/proc/self/clear_refs", "w");
  if (!f) return;
  fputs("5", f);
  fclose(f);
}

static inline int bench_cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

/* The median of n values (sorts a copy). */
static inline double bench_median(const double *v, int n) {
  double s[64];
  if (n <= 0) return 0;
  if (n > 64) n = 64;
  memcpy(s, v, sizeof(double) * (size_t)n);
  qsort(s, (size_t)n, sizeof(double), bench_cmp_double);
  return s[n / 2];
}

/* tiny, small, medium: the model presets; -1 for another name. */
static inline int bench_model(const char *name, struct gpt_config *c) {
  if (!strcmp(name, "small"))
    *c = gpt_config_small();
  else if (!strcmp(name, "medium"))
    *c = gpt_config_medium();
  else if (!strcmp(name, "tiny"))
    *c = (struct gpt_config){256, 64, 128, 2, 4, false, false};
  else
    return -1;
  return 0;
}

#endif /* RTP_BENCH_UTIL_H */
