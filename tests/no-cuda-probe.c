/* no-cuda-probe.c - asks a CUDA build for each GPU path and prints what it answered, one
 * line each: "<what>: <status name>: <message>". test-no-cuda.sh runs it where the CUDA and
 * NCCL libraries are hidden and checks the answers (a clear error, not a crash). */
#include <stdio.h>
#include <string.h>

#include "rtp.h"

static void report(const char *what, int st) {
  printf("%s: %s: %s\n", what, rtp_strerror(st), st ? rtp_last_error() : "");
}

int main(void) {
  printf("cuda devices: %d\n", rtp_backend_cuda_count());
  struct rtp_backend *b = NULL;
  int st = rtp_backend_cuda_new(0, &b);
  report("cuda backend", st);
  rtp_backend_free(b);
  /* One rank: the nccl transport is checked before any rendezvous. */
  struct rtp_comm_params p = rtp_comm_params_default();
  snprintf(p.backend, sizeof(p.backend), "nccl");
  snprintf(p.token, sizeof(p.token), "no-cuda-probe");
  p.master_port = 0;
  struct rtp_comm *c = NULL;
  st = rtp_comm_init(&p, &c);
  report("nccl transport", st);
  if (!st) rtp_comm_free(c);
  return 0;
}
