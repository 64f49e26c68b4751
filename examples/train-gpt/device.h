/* device.h - train-gpt's --device: where a rank computes, and how its transfers travel.
 *
 * auto takes the GPU of the rank's local rank when the build has the CUDA backend and the
 * host has a device, else the CPU. When every rank of a host has a GPU of its own, their
 * transfers go through NCCL (RTP_BACKEND=nccl unless the environment names a backend);
 * ranks that share a GPU (more local ranks than devices: NCCL refuses two ranks on one
 * device) go through TCP, the CUDA backend staging their device tensors through pinned host
 * memory (docs/backend.md). Hosts decide alone, so a job whose hosts differ (one with GPUs
 * for each rank, one without) sets RTP_BACKEND=tcp on every rank.
 *
 * sim is the library's simulated device (rtp_backend_sim_new): the CPU's kernels on memory
 * the host cannot touch, queued until the device syncs. It runs the whole device path of
 * the trainer on a machine without a GPU, which is how the tests check it. */
#ifndef TRAIN_GPT_DEVICE_H
#define TRAIN_GPT_DEVICE_H

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rtp.h"

struct device {
  struct rtp_backend *b; /* NULL: the CPU */
  int index;             /* the CUDA device this rank uses; -1: none */
  int count;             /* CUDA devices on this host */
  char name[32];         /* "cpu", "cuda:0", ...: for the progress line */
};

/* RTP_LOCAL_RANK (rtp-run, torchrun, Slurm's launchers set one), else 0. */
static inline int device_local_rank(void) {
  const char *env = getenv("RTP_LOCAL_RANK");
  long r = env ? strtol(env, NULL, 10) : 0;
  return r > 0 && r < (1 << 20) ? (int)r : 0;
}

static inline bool device_is_gpu(const struct device *d) {
  return d->index >= 0;
}

/* want: auto, cpu, cuda or sim (check_options checked it). On failure *d is the CPU and
 * the status comes with rtp_last_error's reason: no CUDA in this build, no driver, no
 * device. */
static inline int device_open(const char *want, struct device *d) {
  *d = (struct device){.b = NULL, .index = -1, .count = 0, .name = "cpu"};
  if (!strcmp(want, "cpu")) return RTP_OK;
  if (!strcmp(want, "sim")) { /* each rank its own order of the streams */
    snprintf(d->name, sizeof(d->name), "sim");
    return rtp_backend_sim_new(1u + (unsigned)device_local_rank(), &d->b);
  }
  d->count = rtp_backend_cuda_count();
  if (d->count == 0 && !strcmp(want, "auto")) return RTP_OK;
  int index = d->count > 0 ? device_local_rank() % d->count : 0;
  int rc = rtp_backend_cuda_new(index, &d->b); /* with no device: the reason why */
  if (rc) return rc;
  d->index = index;
  snprintf(d->name, sizeof(d->name), "cuda:%d", index);
  return RTP_OK;
}

static inline void device_close(struct device *d) {
  rtp_backend_free(d->b);
  d->b = NULL;
}

/* The transport of a job's transfers: NCCL when each of the host's ranks has a GPU of its
 * own, unless the environment chose one (RTP_BACKEND). */
static inline void device_choose_transport(const struct device *d, long local_ranks,
                                           struct rtp_comm_params *p) {
  if (!device_is_gpu(d) || p->world_size < 2 || getenv("RTP_BACKEND")) return;
  if (local_ranks <= d->count) snprintf(p->backend, sizeof(p->backend), "nccl");
}

#endif /* TRAIN_GPT_DEVICE_H */
