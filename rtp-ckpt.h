/* rtp-ckpt.h - what the checkpoint's files share (not installed): the index an open
 * checkpoint holds, and the helpers that saving, opening (rtp-ckpt.c) and loading
 * (rtp-ckpt-load.c) all use. */
#ifndef RTP_CKPT_H
#define RTP_CKPT_H

#include "rtp-impl.h"
#include "rtp-strategy.h" /* RTP_HETERO_MAX */

#include <stdbool.h>
#include <stdint.h>

#define CK_PATH 4096
#define CK_MAX_INDEX ((size_t)64 << 20)
/* latest and COMPLETE: a line of under 80 bytes as written */
#define CK_MAX_LINE ((size_t)256)
#define CK_MAX_STATE 32
/* A save's id: 128 random bits as lowercase hex. */
#define CK_ID_LEN 32
/* Adam's step count beyond which a double no longer tells consecutive steps apart (its
 * bias corrections take it as one); no run gets there, so a larger one is damage. */
#define CK_MAX_ADAM_STEPS ((int64_t)1 << 53)

/* What index.json says of rank r's file. */
struct ck_file {
  bool listed;
  uint64_t bytes;
  char sha[65];
};

/* What index.json says of a tensor: its global shape and the rows each file holds. */
struct ck_block {
  int rank;
  int64_t first, rows;
};
struct ck_tensor {
  char name[RTP_MAX_NAME];
  int64_t ne[RTP_MAX_DIMS]; /* padded with 1 */
  int n_dims, n_blocks;
  struct ck_block *blocks;
};

/* An open checkpoint: what rtp_ckpt_open read from index.json, checked. */
struct rtp_ckpt {
  char dir[CK_PATH];           /* the step directory */
  char save_id[CK_ID_LEN + 1]; /* "" from a version 1 index, which has none */
  int64_t step, adam_steps;
  int world, stages; /* stages: 1 without a pipeline (and in indexes older than pipelines) */
  enum rtp_strategy strategy; /* of stages that differ (version 3): stage 0's */
  bool het;                   /* version 3: stages of different sizes and strategies */
  int first[RTP_HETERO_MAX + 1];
  enum rtp_strategy strat[RTP_HETERO_MAX];
  int n_state;
  char state[CK_MAX_STATE][2][RTP_MAX_NAME];
  struct ck_file *files; /* world of them */
  int n_tensors;
  struct ck_tensor *tensors;
};

/* a/b into buf (CK_PATH bytes); RTP_EINVAL if it does not fit. */
int rtp__ckpt_path(char *buf, const char *a, const char *b);
/* The SHA-256 of path's bytes as hex, and their count; RTP_EIO, or RTP_EFORMAT where want
 * (UINT64_MAX: any) is not the size. */
int rtp__ckpt_sha256_file(const char *path, uint64_t want, char hex[65], uint64_t *bytes);
/* Collective over p's job: RTP_OK if every rank's rc is, else the first failure, named. */
int rtp__ckpt_any_failed(const struct rtp_ckpt_params *p, int rc, const char *what);
/* p's fields, for a save or a load. */
int rtp__ckpt_check_params(const struct rtp_ckpt_params *p);
/* t's blocks split its rows as rtp_comm_block does over its files; RTP_EFORMAT at `at`. */
int rtp__ckpt_check_partition(const struct rtp_ckpt *c, const char *at,
                              const struct ck_tensor *t);

#endif
