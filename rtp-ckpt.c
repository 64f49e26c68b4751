/*
 * rtp-ckpt.c - sharded checkpoints of a parallel plan and its Adam states.
 *
 * Layout of DIR/step-<8 digits>/:
 *   rank-<k>.safetensors  rank k's block of every parameter P (named P) and of its Adam
 *                         states (adam.m.P, adam.v.P); under ddp every rank holds all of
 *                         it, so rank 0 alone writes rank-0.safetensors. In a pipeline of S
 *                         stages, each rank writes the parameters its stage holds (ddp: the
 *                         stage's rank 0 alone, job rank s x D)
 *   index.json            version 2: the save's id (also in each rank file's metadata,
 *                         with its rank), step, world size, stages, strategy, Adam steps,
 *                         the caller's state, each rank file's size and SHA-256, every
 *                         tensor's global shape and which ranks hold which rows (a
 *                         pipeline's: only the files of its stage). Version 3: a
 *                         pipeline of stages that differ, with each stage's ranks and
 *                         strategy (stage_ranks, stage_strategies), which save as their
 *                         own strategy in their own group would
 *   COMPLETE              "sha256 <hex of index.json>": written last, so a directory
 *                         without it is an interrupted save and is never loaded
 * and DIR/latest names the newest complete step directory. Every file is written to a
 * temporary name, fsynced and renamed; latest moves only after every rank has written
 * and the marker is on disk, so a crash or a full disk at any point leaves the previous
 * checkpoint loadable.
 *
 * A save that fails removes the step directory it made (a full disk gets its space back).
 *
 * tp holds some parameters in pieces that are not one block of rows (a row-parallel
 * weight's columns, a fused q, k, v weight's three row ranges): its ranks write the row
 * blocks rtp's would (rtp_comm_block of the outermost dimension), rebuilt from every
 * rank's pieces by all-gathers, so the files have one layout whatever the strategy.
 *
 * Loading is a reshard from the saved layout to the loading plan's, through the cross-mesh
 * planner (rtp_reshard_plan): the source is a mesh of the files that hold a parameter (the
 * rows rtp_comm_block gives each; ddp's one file holds all, a pipeline's files only their
 * stage's parameters), the destination the plan's layout of it (rtp_parallel_layout), and
 * each slice this rank receives is a box it reads from the one file that holds it (rows,
 * and under tp's split weights columns), so a checkpoint loads onto any world size,
 * strategy and pipeline. Each file's checksum is
 * verified before its first read; before that, at its open, its size, its metadata (the
 * save's id among it) and its tensors' shapes are checked against the index, and the
 * index's tensors against the model's parameters, all of them and no others.
 *
 * Opening parses index.json whole with the JSON reader the safetensors headers use
 * (rtp-json.c) and checks every field and their consistency before it keeps any: a
 * damaged index fails with RTP_EFORMAT rather than be half read.
 */
#define _POSIX_C_SOURCE 200809L
#include "rtp-ckpt.h"
#include "rtp-impl.h"
#include "rtp-json.h"
#include "rtp-strategy.h" /* a plan's stage group, to check a pipeline's layout */

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <openssl/evp.h>
#include <openssl/rand.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* What each rank reports to rank 0 after writing its file. */
struct ck_rank_rec {
  int32_t status;
  int32_t wrote; /* 0: this rank writes no file (ddp ranks other than 0) */
  uint64_t bytes;
  char sha[72];
};

/* ---- small helpers ------------------------------------------------------------------ */

static void ck_rank_world(const struct rtp_ckpt_params *p, int *rank, int *world) {
  *rank = p->comm ? rtp_comm_rank(p->comm) : 0;
  *world = p->comm ? rtp_comm_size(p->comm) : 1;
}

/* ddp replicates everything in a stage: one copy is enough, its rank 0's (per: ranks per
 * stage; the job's size without a pipeline). */
static bool ck_writes_file(enum rtp_strategy s, int rank, int per) {
  return !(s == RTP_STRATEGY_DDP && rank % per != 0);
}

/* Which ranks write a file: a mesh's stages are world / S ranks each, all running one
 * strategy; stages that differ (first != NULL) start at first[s] and run strat[s]. */
struct ck_stages {
  int S, world;
  enum rtp_strategy strategy; /* a mesh's */
  const int *first;           /* S + 1 of them; NULL: a mesh */
  const enum rtp_strategy *strat;
};

static bool ck_stages_writes(const struct ck_stages *st, int r) {
  if (!st->first) return ck_writes_file(st->strategy, r, st->world / st->S);
  int s = 0;
  while (r >= st->first[s + 1]) s++;
  return !(st->strat[s] == RTP_STRATEGY_DDP && r != st->first[s]);
}

static const struct rtp_hetero *ck_het(const struct rtp_ckpt_params *p) {
  return p->par->pipe ? p->par->pipe->het : NULL;
}

static struct ck_stages ck_save_stages(const struct rtp_ckpt_params *p, int world) {
  const struct rtp_hetero *h = ck_het(p);
  if (h) return (struct ck_stages){h->S, world, p->strategy, h->first, h->strat};
  return (struct ck_stages){rtp_parallel_stages(p->par), world, p->strategy, NULL, NULL};
}

/* The strategy of this rank's stage: stages that differ each run their own (none on one
 * rank), which the plan knows; otherwise the caller's. */
static enum rtp_strategy ck_strategy(const struct rtp_ckpt_params *p) {
  return ck_het(p) ? p->par->strategy : p->strategy;
}

/* The group whose ranks split a parameter: the job, or the stage's of stages that differ
 * (NULL on a stage of one rank); this rank's place in it. */
static struct rtp_comm *ck_group(const struct rtp_ckpt_params *p, int *g, int *n) {
  struct rtp_comm *c = ck_het(p) ? p->par->comm : p->comm;
  *g = c ? rtp_comm_rank(c) : 0;
  *n = c ? rtp_comm_size(c) : 1;
  return c;
}

/* tp's ranks write the row blocks of rtp_comm_block, not the pieces they hold. */
static bool ck_relayout(const struct rtp_ckpt_params *p) {
  return ck_strategy(p) == RTP_STRATEGY_TP;
}

int rtp__ckpt_path(char *buf, const char *a, const char *b) {
  int n = snprintf(buf, CK_PATH, "%s/%s", a, b);
  if (n < 0 || n >= CK_PATH) return rtp__error(RTP_EINVAL, "checkpoint path too long: %s", a);
  return RTP_OK;
}

/* The SHA-256 of n bytes as 64 lowercase hex digits. */
static int ck_sha256_hex(const void *data, size_t n, char hex[65]) {
  unsigned char digest[32];
  unsigned len = 0;
  if (!EVP_Digest(data, n, digest, &len, EVP_sha256(), NULL))
    return rtp__error(RTP_ENOMEM, "cannot compute a SHA-256");
  for (int i = 0; i < 32; i++) snprintf(hex + 2 * i, 3, "%02x", digest[i]);
  return RTP_OK;
}

/* The SHA-256 of path, which must be a regular file of want bytes (UINT64_MAX: any):
 * its size is checked before a byte is read, so a file grown huge is not hashed. */
int rtp__ckpt_sha256_file(const char *path, uint64_t want, char hex[65], uint64_t *bytes) {
  int fd;
  int rc = rtp__file_open(path, UINT64_MAX, &fd, bytes);
  if (rc) return rc;
  if (want != UINT64_MAX && *bytes != want) {
    close(fd);
    return rtp__error(RTP_EFORMAT,
                      "%s: truncated or changed: %" PRIu64 " bytes, index says %" PRIu64, path,
                      *bytes, want);
  }
  EVP_MD_CTX *md = EVP_MD_CTX_new();
  unsigned char *buf = malloc(1 << 20), digest[32];
  unsigned len = 0;
  uint64_t left = *bytes;
  bool ok = md && buf && EVP_DigestInit_ex(md, EVP_sha256(), NULL);
  while (ok && left > 0) {
    ssize_t got = read(fd, buf, left < (1u << 20) ? (size_t)left : (1u << 20));
    if (got < 0 && errno == EINTR) continue;
    ok = got > 0 && EVP_DigestUpdate(md, buf, (size_t)got);
    left -= ok ? (uint64_t)got : 0;
  }
  ok = ok && EVP_DigestFinal_ex(md, digest, &len);
  close(fd);
  free(buf);
  EVP_MD_CTX_free(md);
  if (!ok) return rtp__error(RTP_EIO, "%s: cannot read it to compute its checksum", path);
  for (int i = 0; i < 32; i++) snprintf(hex + 2 * i, 3, "%02x", digest[i]);
  return RTP_OK;
}

static int ck_sync_dir(const char *dir) {
  int fd = open(dir, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return rtp__error(RTP_EIO, "%s: %s", dir, strerror(errno));
  int rc = fsync(fd) == 0 || errno == EINVAL
               ? RTP_OK
               : rtp__error(RTP_EIO, "%s: fsync: %s", dir, strerror(errno));
  close(fd);
  return rc;
}

/* dir/name = text, atomically: a temporary file, fsync, rename, fsync of dir. */
static int ck_replace(const char *dir, const char *name, const char *text) {
  char path[CK_PATH], tmp[CK_PATH + 32];
  int rc = rtp__ckpt_path(path, dir, name);
  if (rc) return rc;
  snprintf(tmp, sizeof(tmp), "%s.tmp.%ld", path, (long)getpid());
  int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
  if (fd < 0) return rtp__error(RTP_EIO, "%s: %s", tmp, strerror(errno));
  size_t n = strlen(text), done = 0;
  while (done < n) {
    ssize_t w = write(fd, text + done, n - done);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) break;
    done += (size_t)w;
  }
  int err = done < n ? (errno ? errno : ENOSPC) : fsync(fd) ? errno : 0;
  if (close(fd) && !err) err = errno;
  if (!err && rename(tmp, path)) err = errno;
  if (err) {
    unlink(tmp);
    return rtp__error(RTP_EIO, "%s: %s", path, strerror(err));
  }
  return ck_sync_dir(dir);
}

/* ck_replace, where a file size limit (ulimit -f) fails the write instead of the process. */
static int ck_write_atomic(const char *dir, const char *name, const char *text) {
  bool blocked = rtp__fsize_guard_begin();
  int rc = ck_replace(dir, name, text);
  rtp__fsize_guard_end(blocked);
  return rc;
}

/* Removes a step directory (flat: files only). */
static void ck_remove_dir(const char *path) {
  DIR *d = opendir(path);
  if (!d) return;
  char f[CK_PATH];
  for (struct dirent *e; (e = readdir(d));)
    if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..") &&
        !rtp__ckpt_path(f, path, e->d_name))
      unlink(f);
  closedir(d);
  rmdir(path);
}

static bool ck_parse_step_name(const char *name, int64_t *step) {
  char *end;
  if (strncmp(name, "step-", 5) || strlen(name) != 13) return false;
  *step = strtoll(name + 5, &end, 10);
  return *end == 0 && *step >= 0;
}

static bool ck_is_complete(const char *stepdir) {
  char m[CK_PATH];
  return !rtp__ckpt_path(m, stepdir, "COMPLETE") && access(m, F_OK) == 0;
}

static int ck_read_pointer(const char *dir, const char *name, char *stepdir, int64_t *step);

/* Deletes step directories older than the keep newest complete ones (never newer ones:
 * they may be a save in progress), except the one DIR/best names. */
static void ck_prune(const char *dir, int keep) {
  int64_t steps[256]; /* more step directories than this are left alone */
  int n = 0;
  DIR *d = opendir(dir);
  if (!d) return;
  char path[CK_PATH];
  for (struct dirent *e; (e = readdir(d)) && n < 256;)
    if (ck_parse_step_name(e->d_name, &steps[n]) && !rtp__ckpt_path(path, dir, e->d_name)) n++;
  closedir(d);
  int64_t cutoff = -1;
  for (int kept = 0; kept < keep;) { /* the keep-th newest complete step */
    int64_t best = -1;
    for (int i = 0; i < n; i++) {
      snprintf(path, sizeof(path), "%s/step-%08" PRId64, dir, steps[i]);
      if ((cutoff < 0 || steps[i] < cutoff) && steps[i] > best && ck_is_complete(path))
        best = steps[i];
    }
    if (best < 0) return; /* fewer than keep complete ones: delete nothing */
    cutoff = best;
    kept++;
  }
  int64_t best = -1;
  if (ck_read_pointer(dir, "best", path, &best)) best = -1; /* none: every old one goes */
  for (int i = 0; i < n; i++)
    if (steps[i] < cutoff && steps[i] != best) {
      snprintf(path, sizeof(path), "%s/step-%08" PRId64, dir, steps[i]);
      ck_remove_dir(path);
    }
}

/* ---- saving ------------------------------------------------------------------------- */

/* Names and state go into index.json unescaped (ck_index_json), so they are restricted to
 * characters JSON never escapes. */
static bool ck_is_word(const char *s) {
  static const char ok[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.+-";
  return *s && strlen(s) < RTP_MAX_NAME && strspn(s, ok) == strlen(s);
}

/* The longest parameter name whose Adam states' names ("adam.m." + name) fit a tensor's. */
#define CK_MAX_PARAM_NAME (RTP_MAX_NAME - 1 - (int)sizeof("adam.m.") + 1)

int rtp__ckpt_check_params(const struct rtp_ckpt_params *p) {
  if (!p || !p->dir || !*p->dir || !p->par || !p->params || p->n_params < 1)
    return rtp__error(RTP_EINVAL, "rtp_ckpt: need dir, par and params");
  for (int i = 0; i < p->n_params; i++) {
    if (!p->params[i] || !ck_is_word(p->params[i]->name))
      return rtp__error(RTP_EINVAL, "rtp_ckpt: parameter %d: names must be [A-Za-z0-9_.+-]", i);
    if (strlen(p->params[i]->name) > CK_MAX_PARAM_NAME)
      return rtp__error(RTP_EINVAL,
                        "rtp_ckpt: parameter '%s': names of at most %d characters (its Adam "
                        "states are saved as adam.m.<name>, adam.v.<name>)",
                        p->params[i]->name, CK_MAX_PARAM_NAME);
  }
  for (int i = 0; p->state_kv && p->state_kv[i]; i++)
    if (i >= 2 * CK_MAX_STATE || !ck_is_word(p->state_kv[i]))
      return rtp__error(RTP_EINVAL,
                        "rtp_ckpt: state '%s': at most %d pairs of [A-Za-z0-9_.+-] words",
                        p->state_kv[i], CK_MAX_STATE);
  return RTP_OK;
}

/* The tensors of this rank's file, named after the one-device ones. */
struct ck_out {
  struct rtp_context *ctx; /* their headers; under tp also the row blocks rebuilt */
  struct rtp_tensor **ts;
  int n;
  uint32_t *iota, *where; /* tp: element indices of a whole tensor; of every rank's piece */
  float *pieces;          /* tp: every rank's piece of one tensor, in rank order */
};

static void ck_out_free(struct ck_out *o) {
  rtp_context_free(o->ctx);
  free(o->ts);
  free(o->iota);
  free(o->where);
  free(o->pieces);
}

/* Parameter i's tensor on this rank and its Adam states (NULL if opt does not update it). */
static void ck_states(const struct rtp_ckpt_params *p, int i, struct rtp_tensor *st[3]) {
  st[0] = rtp_parallel_tensor(p->par, p->params[i]);
  rtp__optimizer_find(p->opt, st[0], &st[1], &st[2]);
}

/* Whether this rank holds parameter i in pieces that tp's save rebuilds (not whole). */
static bool ck_tp_split(const struct rtp_ckpt_params *p, int i, const struct rtp_tensor *t) {
  return ck_relayout(p) && t && rtp_tensor_nelements(t) != rtp_tensor_nelements(p->params[i]);
}

/* What this rank writes, without communication: views of the blocks it holds (under tp,
 * of its rows in `blocks` of a tensor it holds whole) and, under tp, the row blocks of the
 * tensors it holds in pieces, for ck_tp_fill to fill, with its scratch. Nothing of another
 * pipeline stage's parameters. */
static int ck_rank_tensors(const struct rtp_ckpt_params *p, int rank, const int64_t *blocks,
                           struct ck_out *o) {
  size_t bytes = (size_t)(3 * p->n_params + 8) * 1024, largest = 0;
  for (int i = 0; i < p->n_params; i++) {
    const struct rtp_tensor *g = p->params[i];
    if (!ck_tp_split(p, i, rtp_parallel_tensor(p->par, g))) continue;
    size_t whole = (size_t)rtp_tensor_nelements(g),
           rows = (size_t)blocks[(rank * p->n_params + i) * 2 + 1];
    bytes += 3 * (whole / (size_t)g->ne[rtp_tensor_n_dims(g) - 1] * rows * sizeof(float) + 256);
    largest = whole > largest ? whole : largest;
  }
  if (largest > UINT32_MAX)
    return rtp__error(RTP_ENOSYS, "rtp_ckpt_save: tp parameters of 2^32 elements or more");
  o->ctx = rtp_context_new((struct rtp_init_params){.mem_size = bytes});
  o->ts = malloc(3 * (size_t)p->n_params * sizeof(*o->ts));
  if (largest) {
    o->iota = malloc(largest * sizeof(uint32_t));
    o->where = malloc(largest * sizeof(uint32_t));
    o->pieces = malloc(largest * sizeof(float));
  }
  if (!o->ctx || !o->ts || (largest && (!o->iota || !o->where || !o->pieces)))
    return rtp__error(RTP_ENOMEM, "rtp_ckpt_save: out of memory");
  for (size_t e = 0; e < largest; e++) o->iota[e] = (uint32_t)e;
  for (int i = 0; i < p->n_params; i++) {
    const struct rtp_tensor *g = p->params[i];
    struct rtp_tensor *st[3];
    ck_states(p, i, st);
    if (!st[0]) continue; /* another stage's */
    int dim = rtp_tensor_n_dims(g) - 1;
    int64_t first = 0, rows = st[0]->ne[rtp_tensor_n_dims(st[0]) - 1], ne[RTP_MAX_DIMS];
    if (ck_relayout(p)) {
      first = blocks[(rank * p->n_params + i) * 2];
      rows = blocks[(rank * p->n_params + i) * 2 + 1];
    }
    memcpy(ne, g->ne, sizeof(ne));
    ne[dim] = rows;
    for (int j = 0; j < 3 && st[j]; j++) {
      struct rtp_tensor *t = ck_tp_split(p, i, st[0])
                                 ? rtp_tensor_new(o->ctx, RTP_TYPE_F32, dim + 1, ne)
                                 : rtp_view_rows(o->ctx, st[j], first, rows);
      if (!t) return rtp__error(RTP_ENOMEM, "rtp_ckpt_save: out of memory");
      o->ts[o->n++] =
          rtp_tensor_set_name(t, "%s%s", j ? (j == 1 ? "adam.m." : "adam.v.") : "", g->name);
    }
  }
  return RTP_OK;
}

/* tp: fills the row blocks of the tensors this rank holds in pieces. Every rank's piece is
 * gathered, with where each of its elements lies in the whole tensor (each rank's
 * rtp_parallel_shard_copy of the element indices), and the elements in this rank's rows
 * are put in place. Collective; one gather of indices and one of values per tensor. */
static int ck_tp_fill(const struct rtp_ckpt_params *p, int rank, const int64_t *blocks,
                      struct ck_out *o) {
  int me, n; /* in the group */
  struct rtp_comm *group = ck_group(p, &me, &n);
  for (int i = 0, k = 0; i < p->n_params; i++) {
    const struct rtp_tensor *g = p->params[i];
    struct rtp_tensor *st[3];
    ck_states(p, i, st);
    int n_st = !st[0] ? 0 : st[1] ? 3 : 1;
    if (!ck_tp_split(p, i, st[0])) {
      k += n_st;
      continue;
    }
    size_t local = (size_t)rtp_tensor_nelements(st[0]), whole = (size_t)rtp_tensor_nelements(g);
    size_t row = whole / (size_t)g->ne[rtp_tensor_n_dims(g) - 1];
    size_t lo = (size_t)blocks[(rank * p->n_params + i) * 2] * row;
    size_t hi = lo + (size_t)blocks[(rank * p->n_params + i) * 2 + 1] * row;
    if (local * (size_t)n != whole)
      return rtp__error(RTP_ENOSYS, "rtp_ckpt_save: '%s' is not split evenly between ranks",
                        g->name);
    /* The indices travel as the bits of floats: shard_copy and the gather only copy them. */
    int rc = rtp_parallel_shard_copy(p->par, g, (const float *)(const void *)o->iota,
                                     (float *)(void *)(o->where + me * local));
    if (!rc)
      rc = rtp_comm_allgather(group, o->where, (size_t)n, local * sizeof(uint32_t), NULL);
    for (int j = 0; j < n_st && !rc; j++) {
      rc = rtp_tensor_get(st[j], o->pieces + me * local, 0, local * sizeof(float));
      if (!rc) /* (through rtp_tensor_get: the piece may live in device memory) */
        rc = rtp_comm_allgather(group, o->pieces, (size_t)n, local * sizeof(float), NULL);
      float *dst = o->ts[k + j]->data;
      size_t got = 0;
      for (size_t e = 0; e < whole && !rc; e++)
        if (o->where[e] >= lo && o->where[e] < hi) {
          dst[o->where[e] - lo] = o->pieces[e];
          got++;
        }
      if (!rc && got != hi - lo)
        rc = rtp__error(RTP_EINVAL, "rtp_ckpt_save: the ranks' pieces of '%s' do not tile it",
                        g->name);
    }
    if (rc) return rc;
    k += n_st;
  }
  return RTP_OK;
}

/* Writes o's tensors into dir/rank-<rank>, with the save's id. */
static int ck_save_rank(const struct ck_out *o, const char *stepdir, int rank, const char *id,
                        struct ck_rank_rec *rec) {
  char path[CK_PATH], name[32];
  snprintf(name, sizeof(name), "rank-%d.safetensors", rank);
  int rc = rtp__ckpt_path(path, stepdir, name);
  char rs[16];
  snprintf(rs, sizeof(rs), "%d", rank);
  const char *meta[] = {"format", "rtp-checkpoint", "rank", rs, "save_id", id, NULL};
  if (!rc) rc = rtp_safetensors_save(path, o->ts, o->n, meta);
  if (!rc) rc = rtp__ckpt_sha256_file(path, UINT64_MAX, rec->sha, &rec->bytes);
  return rc;
}

/* Every rank's records, on every rank (each fills its own slot first). */
static int ck_allgather(const struct rtp_ckpt_params *p, void *buf, size_t elem) {
  if (!p->comm) return RTP_OK;
  return rtp_comm_allgather(p->comm, buf, (size_t)rtp_comm_size(p->comm), elem, NULL);
}

/* blocks[.. * 2] of a parameter this rank does not hold (another pipeline stage's). */
#define CK_NOT_HELD (-2)

/* The rows each rank holds of every parameter: blocks[(rank * n + i) * 2 + {0, 1}]. */
static int ck_gather_blocks(const struct rtp_ckpt_params *p, int rank, int world,
                            int64_t **blocks) {
  size_t per = (size_t)p->n_params * 2;
  *blocks = calloc((size_t)world * per, sizeof(int64_t));
  if (!*blocks) return rtp__error(RTP_ENOMEM, "rtp_ckpt_save: out of memory");
  for (int i = 0; i < p->n_params; i++) {
    const struct rtp_tensor *g = p->params[i];
    int dim = rtp_tensor_n_dims(g) - 1;
    int64_t *b = *blocks + (size_t)rank * per + 2 * (size_t)i;
    size_t first, len;
    if (!rtp_parallel_tensor(p->par, g)) {
      b[0] = CK_NOT_HELD; /* its files, those of the stage that holds it, tile it */
    } else if (ck_relayout(p)) {
      int gr, gn;
      ck_group(p, &gr, &gn);
      rtp_comm_block((size_t)g->ne[dim], gn, gr, &first, &len);
      b[0] = (int64_t)first;
      b[1] = (int64_t)len;
    } else if (rtp_parallel_block(p->par, g, &b[0], &b[1], &dim) ||
               dim != rtp_tensor_n_dims(g) - 1) {
      b[0] = -1; /* not one block of rows: every rank sees it after the gather */
    }
  }
  return ck_allgather(p, *blocks, per * sizeof(int64_t));
}

/* The files of the ranks that hold a parameter must tile its rows in rank order: true of
 * every strategy (tp's by ck_relayout) and of a pipeline's stages (ck_check_layout),
 * checked in case a strategy holds parameters otherwise. */
static int ck_check_blocks(const struct rtp_ckpt_params *p, const struct ck_stages *st,
                           const int64_t *blocks) {
  for (int i = 0; i < p->n_params; i++) {
    const struct rtp_tensor *g = p->params[i];
    int64_t next = 0;
    for (int r = 0; r < st->world; r++) {
      const int64_t *b = blocks + ((size_t)r * p->n_params + i) * 2;
      if (!ck_stages_writes(st, r) || b[0] == CK_NOT_HELD) continue;
      if (b[0] != next) next = -1;
      if (next < 0) break;
      next += b[1];
    }
    if (next != g->ne[rtp_tensor_n_dims(g) - 1])
      return rtp__error(RTP_ENOSYS,
                        "rtp_ckpt: '%s' is not split into row blocks in rank order under "
                        "strategy %s: checkpoints of it are not supported",
                        g->name, rtp_strategy_name(ck_strategy(p)));
  }
  return RTP_OK;
}

static void ck_write_tensors(FILE *f, const struct rtp_ckpt_params *p,
                             const struct ck_stages *st, const int64_t *blocks) {
  fprintf(f, "  \"tensors\": [\n");
  for (int i = 0; i < p->n_params; i++) {
    const struct rtp_tensor *t = p->params[i];
    fprintf(f, "    {\"name\": \"%s\", \"shape\": [", t->name);
    for (int d = rtp_tensor_n_dims(t) - 1; d >= 0; d--)
      fprintf(f, "%" PRId64 "%s", t->ne[d], d ? ", " : "");
    fprintf(f, "], \"blocks\": [");
    for (int r = 0, n = 0; r < st->world; r++) {
      const int64_t *b = blocks + ((size_t)r * p->n_params + i) * 2;
      if (!ck_stages_writes(st, r) || b[0] == CK_NOT_HELD) continue;
      fprintf(f, "%s{\"rank\": %d, \"first\": %" PRId64 ", \"rows\": %" PRId64 "}",
              n++ ? ", " : "", r, b[0], b[1]);
    }
    fprintf(f, "]}%s\n", i + 1 < p->n_params ? "," : "");
  }
  fprintf(f, "  ]\n}\n");
}

/* index.json (rtp_ckpt_open reads it as JSON: order and spacing do not matter to it). */
static char *ck_index_json(const struct rtp_ckpt_params *p, int64_t step,
                           const struct ck_stages *st, const char *id,
                           const struct ck_rank_rec *recs, const int64_t *blocks) {
  char *text = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&text, &len);
  if (!f) return NULL;
  fprintf(f,
          "{\n  \"format\": \"rtp-checkpoint\",\n  \"version\": %d,\n  \"save_id\": "
          "\"%s\",\n  \"step\": %" PRId64
          ",\n  \"world_size\": %d,\n  \"stages\": %d,\n  \"strategy\": \"%s\",\n  ",
          st->first ? 3 : 2, id, step, st->world, st->S,
          rtp_strategy_name(st->first ? st->strat[0] : p->strategy));
  /* Version 3 (stages that differ): each stage's ranks and strategy, which say which ranks
   * write files; a mesh's index stays version 2, which older readers read. */
  for (int s = 0; st->first && s < st->S; s++)
    fprintf(f, "%s%d%s", s ? ", " : "\"stage_ranks\": [", st->first[s + 1] - st->first[s],
            s + 1 < st->S ? "" : "],\n  ");
  for (int s = 0; st->first && s < st->S; s++)
    fprintf(f, "%s\"%s\"%s", s ? ", " : "\"stage_strategies\": [",
            rtp_strategy_name(st->strat[s]), s + 1 < st->S ? "" : "],\n  ");
  fprintf(f, "\"adam_steps\": %" PRId64 ",\n  \"state\": {", rtp_optimizer_steps(p->opt));
  for (int i = 0; p->state_kv && p->state_kv[i] && p->state_kv[i + 1]; i += 2)
    fprintf(f, "%s\"%s\": \"%s\"", i ? ", " : "", p->state_kv[i], p->state_kv[i + 1]);
  fprintf(f, "},\n  \"files\": [");
  for (int r = 0, n = 0; r < st->world; r++) /* (a pipeline's ddp: ranks 0, D, 2D, ...) */
    if (recs[r].wrote)
      fprintf(f,
              "%s\n    {\"name\": \"rank-%d.safetensors\", \"rank\": %d, \"bytes\": %" PRIu64
              ", \"sha256\": \"%s\"}",
              n++ ? "," : "", r, r, recs[r].bytes, recs[r].sha);
  fprintf(f, "\n  ],\n");
  ck_write_tensors(f, p, st, blocks);
  if (fclose(f)) {
    free(text);
    return NULL;
  }
  return text;
}

/* Rank 0, once every rank has written: index, marker, then latest, then pruning. */
static int ck_commit(const struct rtp_ckpt_params *p, const char *stepdir, int64_t step,
                     const struct ck_stages *st, const char *id, const struct ck_rank_rec *recs,
                     const int64_t *blocks) {
  char *index = ck_index_json(p, step, st, id, recs, blocks);
  if (!index) return rtp__error(RTP_ENOMEM, "%s: out of memory for the index", stepdir);
  int rc = ck_write_atomic(stepdir, "index.json", index);
  free(index);
  char ipath[CK_PATH], hex[65], text[128];
  uint64_t bytes;
  if (!rc) rc = rtp__ckpt_path(ipath, stepdir, "index.json");
  if (!rc) rc = rtp__ckpt_sha256_file(ipath, UINT64_MAX, hex, &bytes);
  snprintf(text, sizeof(text), "sha256 %s\n", hex);
  if (!rc) rc = ck_write_atomic(stepdir, "COMPLETE", text);
  snprintf(text, sizeof(text), "step-%08" PRId64 "\n", step);
  /* best first: pruning, after latest moves, then keeps this step */
  if (!rc && p->best) rc = ck_write_atomic(p->dir, "best", text);
  if (!rc) rc = ck_write_atomic(p->dir, "latest", text);
  if (!rc) ck_prune(p->dir, p->keep > 0 ? p->keep : 2);
  return rc;
}

/* Whether a complete stepdir of step `step` was left by a save killed between its
 * COMPLETE marker and moving latest: neither latest nor best names it, and it is newer
 * than latest (or there is no latest). A run resumed from latest saves that step again,
 * and would otherwise stop there for good. */
static bool ck_is_orphan(const char *dir, const char *stepdir, int64_t step) {
  char named[CK_PATH];
  int64_t named_step, latest_step = -1;
  for (int i = 0; i < 2; i++) {
    const char *name = i ? "best" : "latest";
    if (ck_read_pointer(dir, name, named, &named_step)) {
      /* a pointer that exists but does not parse may name anything */
      if (rtp__ckpt_path(named, dir, name) || access(named, F_OK) == 0) return false;
      continue;
    }
    if (strcmp(named, stepdir) == 0) return false;
    if (!i) latest_step = named_step;
  }
  return step > latest_step;
}

/* Rank 0 makes the step directory, clearing what an interrupted save of this step left (a
 * complete one only if it is an orphan), and the save's id, which ties the files to the
 * index. */
static int ck_prepare_dir(const struct rtp_ckpt_params *p, const char *stepdir, int64_t step,
                          char id[CK_ID_LEN + 1]) {
  unsigned char bits[CK_ID_LEN / 2];
  if (RAND_bytes(bits, sizeof(bits)) != 1)
    return rtp__error(RTP_EIO, "rtp_ckpt_save: no random bytes for the save's id");
  for (size_t i = 0; i < sizeof(bits); i++) snprintf(id + 2 * i, 3, "%02x", bits[i]);
  if (mkdir(p->dir, 0777) && errno != EEXIST)
    return rtp__error(RTP_EIO, "%s: %s", p->dir, strerror(errno));
  if (ck_is_complete(stepdir) && !ck_is_orphan(p->dir, stepdir, step))
    return rtp__error(RTP_ESTATE,
                      "%s already holds a complete checkpoint, which latest or best names or "
                      "which is older than latest",
                      stepdir);
  ck_remove_dir(stepdir);
  if (mkdir(stepdir, 0777)) return rtp__error(RTP_EIO, "%s: %s", stepdir, strerror(errno));
  return RTP_OK;
}

/* After a failed save, rank 0 removes the step directory it made (every rank is done
 * writing), unless latest or best names it (moved, then a failure): what a full disk
 * needs. */
static void ck_discard(const char *dir, const char *stepdir) {
  char named_dir[CK_PATH];
  char why[1024]; /* the failure's message, which ck_read_pointer would replace */
  snprintf(why, sizeof(why), "%s", rtp_last_error());
  int64_t step;
  bool named = false;
  for (int i = 0; i < 2; i++)
    named |= !ck_read_pointer(dir, i ? "best" : "latest", named_dir, &step) &&
             strcmp(named_dir, stepdir) == 0;
  if (!named) ck_remove_dir(stepdir);
  rtp__error(RTP_EIO, "%s", why);
}

/* Every rank leaves with rank 0's status; the first failure's message stays local. */
static int ck_agree(const struct rtp_ckpt_params *p, int rc, const char *what) {
  int32_t verdict = rc;
  if (!p->comm) return rc;
  int brc = rtp_comm_broadcast(p->comm, &verdict, sizeof(verdict), 0, NULL);
  if (brc) return brc;
  if (verdict && !rc) return rtp__error(verdict, "rank 0 failed %s", what);
  return rc ? rc : verdict;
}

/* Any rank's failure fails every rank. */
int rtp__ckpt_any_failed(const struct rtp_ckpt_params *p, int rc, const char *what) {
  int rank, world;
  ck_rank_world(p, &rank, &world);
  int32_t *all = calloc((size_t)world, sizeof(int32_t));
  if (!all) return rtp__error(RTP_ENOMEM, "%s: out of memory", what);
  all[rank] = rc;
  int grc = ck_allgather(p, all, sizeof(int32_t));
  for (int r = 0; r < world && !grc && !rc; r++)
    if (all[r]) rc = rtp__error(all[r], "rank %d failed %s", r, what);
  free(all);
  return grc ? grc : rc;
}

/* A pipeline's ranks must be rank = stage x D + stage rank (rtp_comm_mesh_2d's rows as
 * the stage groups, p->comm the job): then the ranks that hold a parameter, one stage's,
 * are contiguous and hold its rows in rank order, which is what the index says and the
 * loader reads, and ddp's writers are ranks 0, D, 2D, ... Any other layout is refused.
 * Stages that differ: stage s's ranks are job ranks first[s] onward, as rtp_parallel_new
 * requires of the pipe communicator; p->comm must number them the same. */
static int ck_check_layout(const struct rtp_ckpt_params *p, int rank, int world) {
  const struct rtp_hetero *h = ck_het(p);
  if (h && (world != h->first[h->S] || rank != h->first[h->s] + h->g))
    return rtp__error(RTP_ENOSYS,
                      "rtp_ckpt_save: rank %d of %d is rank %d of pipeline stage %d, which "
                      "starts at rank %d of %d: checkpoints need the job's communicator in "
                      "rtp_ckpt_params.comm",
                      rank, world, h->g, h->s, h->first[h->s], h->first[h->S]);
  if (h) return RTP_OK;
  int S = rtp_parallel_stages(p->par), s = rtp_parallel_stage(p->par);
  const struct rtp_comm *group = p->par->comm; /* NULL: one rank per stage */
  int d = group ? rtp_comm_rank(group) : 0, n = group ? rtp_comm_size(group) : 1;
  if (S == 1 || (world % S == 0 && n == world / S && s == rank / n && d == rank % n))
    return RTP_OK;
  return rtp__error(RTP_ENOSYS,
                    "rtp_ckpt_save: rank %d of %d is rank %d of %d in pipeline stage %d of %d: "
                    "checkpoints of a pipeline need rank = stage x ranks per stage + rank in "
                    "the stage (rtp_comm_mesh_2d(job, stages, ranks per stage, &stage, &pipe)) "
                    "and the job's communicator in rtp_ckpt_params.comm",
                    rank, world, d, n, s, S);
}

int rtp_ckpt_save(const struct rtp_ckpt_params *p, int64_t step) {
  int rc = rtp__ckpt_check_params(p), rank, world;
  if (rc) return rc;
  if (step < 0 || step > 99999999) return rtp__error(RTP_EINVAL, "rtp_ckpt_save: bad step");
  if (p->opt && rtp_optimizer_steps(p->opt) > CK_MAX_ADAM_STEPS)
    return rtp__error(RTP_EINVAL, "rtp_ckpt_save: %" PRId64 " Adam steps, at most %" PRId64,
                      rtp_optimizer_steps(p->opt), CK_MAX_ADAM_STEPS);
  ck_rank_world(p, &rank, &world);
  char stepdir[CK_PATH], name[32];
  snprintf(name, sizeof(name), "step-%08" PRId64, step);
  if ((rc = rtp__ckpt_path(stepdir, p->dir, name))) return rc;
  rc = rtp__ckpt_any_failed(p, ck_check_layout(p, rank, world),
                            "to check the pipeline's layout");
  if (rc) return rc;
  struct ck_stages st = ck_save_stages(p, world);
  int64_t *blocks = NULL;
  rc = ck_gather_blocks(p, rank, world, &blocks);
  if (!rc) rc = ck_check_blocks(p, &st, blocks);
  /* What each rank writes, before anything changes on disk: tp's gathers run here. */
  struct ck_out out = {0};
  bool writes = ck_stages_writes(&st, rank);
  if (!rc)
    rc = rtp__ckpt_any_failed(p, writes ? ck_rank_tensors(p, rank, blocks, &out) : RTP_OK,
                              "to prepare its checkpoint file");
  int g, n; /* (stages that differ: only a tp stage's ranks gather, in their group) */
  bool fill = ck_relayout(p) && ck_group(p, &g, &n);
  if (!rc && p->comm)
    rc = rtp__ckpt_any_failed(p, fill ? ck_tp_fill(p, rank, blocks, &out) : RTP_OK,
                              "to gather its blocks");
  char id[CK_ID_LEN + 1] = "";
  if (!rc)
    rc = ck_agree(p, rank == 0 ? ck_prepare_dir(p, stepdir, step, id) : RTP_OK,
                  "to create the directory");
  if (!rc && p->comm) rc = rtp_comm_broadcast(p->comm, id, sizeof(id), 0, NULL);
  struct ck_rank_rec *recs = rc ? NULL : calloc((size_t)world, sizeof(*recs));
  if (!rc && !recs) rc = rtp__error(RTP_ENOMEM, "rtp_ckpt_save: out of memory");
  if (rc) {
    ck_out_free(&out);
    free(blocks);
    return rc;
  }
  recs[rank].wrote = writes;
  if (writes) recs[rank].status = ck_save_rank(&out, stepdir, rank, id, &recs[rank]);
  ck_out_free(&out);
  rc = ck_allgather(p, recs, sizeof(*recs));
  if (!rc && recs[rank].status) rc = recs[rank].status; /* its own failure's message */
  for (int r = 0; r < world && !rc; r++)
    if (recs[r].status)
      rc = rtp__error(recs[r].status, "rank %d could not write its file in %s", r, stepdir);
  /* Rank 0 cleans up before it tells the others, which may then exit at once. */
  int commit = rank == 0 && !rc ? ck_commit(p, stepdir, step, &st, id, recs, blocks) : rc;
  if (rank == 0 && commit) ck_discard(p->dir, stepdir);
  rc = ck_agree(p, commit, "to commit the checkpoint");
  free(recs);
  free(blocks);
  return rc;
}

/* ---- opening ------------------------------------------------------------------------ */

/* An integer member key of obj in [min, max]; at names obj in messages. */
static int ck_int(const struct rtp__json *doc, const struct rtp__json_value *obj,
                  const char *at, const char *key, int64_t min, int64_t max, int64_t *out) {
  const struct rtp__json_value *v;
  int rc = rtp__json_member(doc, obj, key, RTP__JSON_INT, &v, "%s", at);
  return rc ? rc : rtp__json_int(doc, v, min, max, out, "%s%s%s", at, *at ? ": " : "", key);
}

/* A string member key of obj, of at most max_len bytes. */
static int ck_str(const struct rtp__json *doc, const struct rtp__json_value *obj,
                  const char *at, const char *key, size_t max_len, const char **out) {
  const struct rtp__json_value *v;
  int rc = rtp__json_member(doc, obj, key, RTP__JSON_STRING, &v, "%s", at);
  return rc ? rc : rtp__json_string(doc, v, max_len, out, "%s%s%s", at, *at ? ": " : "", key);
}

/* "state": the caller's string pairs. */
static int ck_read_state(struct rtp_ckpt *c, const struct rtp__json *doc,
                         const struct rtp__json_value *root) {
  const struct rtp__json_value *state;
  int rc = rtp__json_member(doc, root, "state", RTP__JSON_OBJECT, &state, "%s", "");
  if (rc) return rc;
  if (rtp__json_count(state) > CK_MAX_STATE)
    return rtp__error(RTP_EFORMAT, "%s/index.json: state: %zu pairs, at most %d", c->dir,
                      rtp__json_count(state), CK_MAX_STATE);
  for (const struct rtp__json_value *m = rtp__json_child(doc, state); m && !rc;
       m = rtp__json_next(doc, m)) {
    const char *key = rtp__json_key(doc, m), *value;
    if (strlen(key) >= RTP_MAX_NAME)
      return rtp__error(RTP_EFORMAT, "%s/index.json: state: a key of %zu bytes, at most %d",
                        c->dir, strlen(key), RTP_MAX_NAME - 1);
    rc = rtp__json_string(doc, m, RTP_MAX_NAME - 1, &value, "state: %s", key);
    if (rc) return rc;
    snprintf(c->state[c->n_state][0], RTP_MAX_NAME, "%s", key);
    snprintf(c->state[c->n_state][1], RTP_MAX_NAME, "%s", value);
    c->n_state++;
  }
  return RTP_OK;
}

/* "files": exactly the ranks that write one under the strategy and stages, each named after
 * its rank, with its size and SHA-256. */
static int ck_read_files(struct rtp_ckpt *c, const struct rtp__json *doc,
                         const struct rtp__json_value *root) {
  static const char *const keys[] = {"name", "rank", "bytes", "sha256", NULL};
  const struct rtp__json_value *files;
  int rc = rtp__json_member(doc, root, "files", RTP__JSON_ARRAY, &files, "%s", "");
  if (rc) return rc;
  c->files = calloc((size_t)c->world, sizeof(*c->files));
  if (!c->files) return rtp__error(RTP_ENOMEM, "%s: out of memory", c->dir);
  int i = 0;
  for (const struct rtp__json_value *f = rtp__json_child(doc, files); f;
       f = rtp__json_next(doc, f), i++) {
    char at[32], want[40];
    const char *name, *sha;
    int64_t rank, bytes;
    snprintf(at, sizeof(at), "files[%d]", i);
    rc = rtp__json_expect(doc, f, RTP__JSON_OBJECT, "%s", at);
    if (!rc) rc = rtp__json_only(doc, f, keys, "%s", at);
    if (!rc) rc = ck_int(doc, f, at, "rank", 0, c->world - 1, &rank);
    if (!rc) rc = ck_str(doc, f, at, "name", RTP_MAX_NAME, &name);
    if (!rc) rc = ck_int(doc, f, at, "bytes", 0, INT64_MAX, &bytes);
    if (!rc) rc = ck_str(doc, f, at, "sha256", 64, &sha);
    if (rc) return rc;
    snprintf(want, sizeof(want), "rank-%d.safetensors", (int)rank);
    if (strcmp(name, want))
      return rtp__error(RTP_EFORMAT, "%s/index.json: %s: name '%s' for rank %d, expected '%s'",
                        c->dir, at, name, (int)rank, want);
    if (strlen(sha) != 64 || strspn(sha, "0123456789abcdef") != 64)
      return rtp__error(RTP_EFORMAT,
                        "%s/index.json: %s: sha256 '%s' is not 64 lowercase hex digits", c->dir,
                        at, sha);
    struct ck_file *cf = &c->files[rank];
    if (cf->listed)
      return rtp__error(RTP_EFORMAT, "%s/index.json: %s: rank %d's file is listed twice",
                        c->dir, at, (int)rank);
    *cf = (struct ck_file){true, (uint64_t)bytes, ""};
    memcpy(cf->sha, sha, 65);
  }
  struct ck_stages st = {c->stages, c->world, c->strategy, c->het ? c->first : NULL, c->strat};
  for (int r = 0; r < c->world; r++)
    if (c->files[r].listed != ck_stages_writes(&st, r))
      return rtp__error(RTP_EFORMAT, "%s/index.json: %s rank-%d.safetensors, which %s", c->dir,
                        c->files[r].listed ? "lists" : "does not list", r,
                        c->files[r].listed ? "that strategy does not write" : "it needs");
  return RTP_OK;
}

static int ck_count_files(const struct rtp_ckpt *c) {
  int n = 0;
  for (int r = 0; r < c->world; r++) n += c->files[r].listed;
  return n;
}

static int ck_cmp_str(const void *a, const void *b) {
  return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* A tensor's block of rank `rank` (bat names it), after a block of rank prev (-1: none):
 * without a pipeline every file holds a block of every tensor, so it must be the next
 * listed file; in a pipeline only the files of the stage that holds it do, so any later
 * listed file. */
static int ck_check_block_rank(const struct rtp_ckpt *c, const char *bat, int64_t rank,
                               int prev) {
  int next = prev + 1;
  while (c->stages == 1 && next < c->world && !c->files[next].listed) next++;
  if (c->stages == 1 && next == c->world)
    return rtp__error(RTP_EFORMAT, "%s/index.json: %s: more blocks than the %d files", c->dir,
                      bat, ck_count_files(c));
  if (c->stages == 1 && rank != next)
    return rtp__error(RTP_EFORMAT,
                      "%s/index.json: %s: rank %d, expected %d (the ranks "
                      "that wrote files, in order)",
                      c->dir, bat, (int)rank, next);
  if (rank <= prev)
    return rtp__error(RTP_EFORMAT,
                      "%s/index.json: %s: rank %d after rank %d (the blocks come in rank "
                      "order, one per file)",
                      c->dir, bat, (int)rank, prev);
  if (!c->files[rank].listed)
    return rtp__error(RTP_EFORMAT, "%s/index.json: %s: rank %d, which wrote no file", c->dir,
                      bat, (int)rank);
  return RTP_OK;
}

/* The blocks of t must split its rows as rtp_comm_block does over the files that hold it:
 * what every save writes (each strategy's blocks of rows; tp's files rtp's; ddp's one file
 * all), and the one layout of files that loading, a reshard through the planner, reads. */
int rtp__ckpt_check_partition(const struct rtp_ckpt *c, const char *at,
                              const struct ck_tensor *t) {
  for (int j = 0; j < t->n_blocks; j++) {
    size_t first, len;
    rtp_comm_block((size_t)t->ne[t->n_dims - 1], t->n_blocks, j, &first, &len);
    if (t->blocks[j].first != (int64_t)first || t->blocks[j].rows != (int64_t)len)
      return rtp__error(RTP_EFORMAT,
                        "%s/index.json: %s ('%s'): blocks[%d]: rows [%" PRId64 ", %" PRId64
                        "), expected [%zu, %zu) (the files split the rows as rtp_comm_block "
                        "does, as every save writes them)",
                        c->dir, at, t->name, j, t->blocks[j].first,
                        t->blocks[j].first + t->blocks[j].rows, first, first + len);
  }
  return RTP_OK;
}

/* One entry of "tensors" into t: its global shape, and blocks of rows that the listed
 * files hold in rank order and that tile its outermost dimension (every file's, or in a
 * pipeline those of the files that hold it). */
static int ck_check_tensor(const struct rtp_ckpt *c, const struct rtp__json *doc,
                           const struct rtp__json_value *jt, const char *at,
                           struct ck_tensor *t) {
  static const char *const keys[] = {"name", "shape", "blocks", NULL};
  static const char *const block_keys[] = {"rank", "first", "rows", NULL};
  const struct rtp__json_value *shape, *blocks;
  const char *name;
  int rc = rtp__json_expect(doc, jt, RTP__JSON_OBJECT, "%s", at);
  if (!rc) rc = rtp__json_only(doc, jt, keys, "%s", at);
  if (!rc) rc = ck_str(doc, jt, at, "name", RTP_MAX_NAME - 1, &name);
  if (!rc) rc = rtp__json_member(doc, jt, "shape", RTP__JSON_ARRAY, &shape, "%s", at);
  if (!rc) rc = rtp__json_member(doc, jt, "blocks", RTP__JSON_ARRAY, &blocks, "%s", at);
  if (rc) return rc;
  snprintf(t->name, sizeof(t->name), "%s", name);
  size_t nd = rtp__json_count(shape);
  if (nd < 1 || nd > RTP_MAX_DIMS)
    return rtp__error(RTP_EFORMAT, "%s/index.json: %s ('%s'): %zu dims, expected 1 to %d",
                      c->dir, at, name, nd, RTP_MAX_DIMS);
  t->n_dims = (int)nd;
  for (int d = 0; d < RTP_MAX_DIMS; d++) t->ne[d] = 1;
  int d = 0; /* the outermost dimension comes first */
  for (const struct rtp__json_value *v = rtp__json_child(doc, shape); v && !rc;
       v = rtp__json_next(doc, v), d++)
    rc = rtp__json_int(doc, v, 0, INT64_MAX, &t->ne[t->n_dims - 1 - d], "%s ('%s'): shape[%d]",
                       at, name, d);
  t->blocks = calloc(rtp__json_count(blocks) + 1, sizeof(*t->blocks));
  if (!t->blocks) return rtp__error(RTP_ENOMEM, "%s: out of memory", c->dir);
  int64_t next = 0;
  int prev = -1;
  for (const struct rtp__json_value *b = rtp__json_child(doc, blocks); b && !rc;
       b = rtp__json_next(doc, b), t->n_blocks++) {
    char bat[160];
    int64_t rank, first, n;
    snprintf(bat, sizeof(bat), "%s ('%s'): blocks[%d]", at, name, t->n_blocks);
    rc = rtp__json_expect(doc, b, RTP__JSON_OBJECT, "%s", bat);
    if (!rc) rc = rtp__json_only(doc, b, block_keys, "%s", bat);
    if (!rc) rc = ck_int(doc, b, bat, "rank", 0, c->world - 1, &rank);
    if (!rc) rc = ck_int(doc, b, bat, "first", 0, INT64_MAX, &first);
    if (!rc) rc = ck_int(doc, b, bat, "rows", 0, INT64_MAX - next, &n);
    if (!rc) rc = ck_check_block_rank(c, bat, rank, prev);
    if (rc) return rc;
    prev = (int)rank;
    if (first != next)
      return rtp__error(RTP_EFORMAT,
                        "%s/index.json: %s: first row %" PRId64 ", expected %" PRId64
                        " (the blocks tile the rows in rank order)",
                        c->dir, bat, first, next);
    next += n;
    t->blocks[t->n_blocks] = (struct ck_block){(int)rank, first, n};
  }
  int64_t rows = t->ne[t->n_dims - 1];
  if (!rc && (next != rows || (c->stages == 1 && t->n_blocks != ck_count_files(c))))
    rc = rtp__error(RTP_EFORMAT,
                    "%s/index.json: %s ('%s'): %d blocks of %" PRId64
                    " rows for "
                    "%d files and %" PRId64 " rows",
                    c->dir, at, name, t->n_blocks, next, ck_count_files(c), rows);
  return rc ? rc : rtp__ckpt_check_partition(c, at, t);
}

/* "tensors": each well formed, no name twice. */
static int ck_check_tensors(struct rtp_ckpt *c, const struct rtp__json *doc,
                            const struct rtp__json_value *root) {
  const struct rtp__json_value *ts;
  int rc = rtp__json_member(doc, root, "tensors", RTP__JSON_ARRAY, &ts, "%s", "");
  if (rc) return rc;
  size_t n = rtp__json_count(ts);
  const char **names = malloc((n + 1) * sizeof(*names));
  c->tensors = calloc(n + 1, sizeof(*c->tensors));
  if (!names || !c->tensors) {
    free(names);
    return rtp__error(RTP_ENOMEM, "%s: out of memory", c->dir);
  }
  for (const struct rtp__json_value *t = rtp__json_child(doc, ts); t && !rc;
       t = rtp__json_next(doc, t)) {
    char at[32];
    snprintf(at, sizeof(at), "tensors[%d]", c->n_tensors);
    struct ck_tensor *ct = &c->tensors[c->n_tensors++];
    rc = ck_check_tensor(c, doc, t, at, ct);
    names[c->n_tensors - 1] = ct->name;
  }
  if (!rc) qsort(names, n, sizeof(*names), ck_cmp_str);
  for (size_t i = 1; i < n && !rc; i++)
    if (strcmp(names[i - 1], names[i]) == 0)
      rc = rtp__error(RTP_EFORMAT, "%s/index.json: tensor '%s' is listed twice", c->dir,
                      names[i]);
  free(names);
  return rc;
}

/* "stages": the pipeline's, 1 to world_size and dividing it; absent (indexes written
 * before pipelines) 1. */
static int ck_read_stages(struct rtp_ckpt *c, const struct rtp__json *doc,
                          const struct rtp__json_value *root, const char *ipath,
                          int64_t world) {
  int64_t stages = 1;
  int rc = rtp__json_get(doc, root, "stages")
               ? ck_int(doc, root, "", "stages", 1, world, &stages)
               : RTP_OK;
  if (!rc && !c->het && world % stages)
    rc = rtp__error(RTP_EFORMAT,
                    "%s: stages %" PRId64 " does not divide world_size %" PRId64
                    " (a pipeline has as many ranks in each stage)",
                    ipath, stages, world);
  c->stages = (int)stages;
  return rc;
}

/* Version 3's "stage_ranks" and "stage_strategies": one per stage, 2 to RTP_HETERO_MAX
 * stages, the ranks adding up to world_size. */
static int ck_read_hetero(struct rtp_ckpt *c, const struct rtp__json *doc,
                          const struct rtp__json_value *root, const char *ipath) {
  const struct rtp__json_value *ranks, *strats;
  int rc = rtp__json_member(doc, root, "stage_ranks", RTP__JSON_ARRAY, &ranks, "%s", "");
  if (!rc)
    rc = rtp__json_member(doc, root, "stage_strategies", RTP__JSON_ARRAY, &strats, "%s", "");
  if (rc) return rc;
  if (c->stages < 2 || c->stages > RTP_HETERO_MAX ||
      rtp__json_count(ranks) != (size_t)c->stages ||
      rtp__json_count(strats) != (size_t)c->stages)
    return rtp__error(RTP_EFORMAT,
                      "%s: stages %d with %zu stage_ranks and %zu stage_strategies (2 to %d "
                      "stages, one of each per stage)",
                      ipath, c->stages, rtp__json_count(ranks), rtp__json_count(strats),
                      RTP_HETERO_MAX);
  const struct rtp__json_value *r = rtp__json_child(doc, ranks),
                               *k = rtp__json_child(doc, strats);
  for (int s = 0; s < c->stages && !rc;
       s++, r = rtp__json_next(doc, r), k = rtp__json_next(doc, k)) {
    int64_t n;
    const char *name;
    rc = rtp__json_int(doc, r, 1, c->world - c->first[s], &n, "stage_ranks[%d]", s);
    if (!rc) rc = rtp__json_string(doc, k, 32, &name, "stage_strategies[%d]", s);
    if (!rc && rtp_strategy_parse(name, &c->strat[s]))
      rc = rtp__error(RTP_EFORMAT, "%s: stage_strategies[%d]: unknown strategy '%s'", ipath, s,
                      name);
    c->first[s + 1] = c->first[s] + (int)(rc ? 0 : n);
  }
  if (!rc && c->first[c->stages] != c->world)
    rc = rtp__error(RTP_EFORMAT, "%s: stage_ranks add up to %d, world_size is %d", ipath,
                    c->first[c->stages], c->world);
  return rc;
}

/* "save_id": 32 lowercase hex digits (versions 2 and 3); version 1 has none. */
static int ck_read_save_id(struct rtp_ckpt *c, const struct rtp__json *doc,
                           const struct rtp__json_value *root, const char *ipath,
                           int64_t version) {
  static const char *const v1[] = {"format", "version",  "step",       "world_size",
                                   "stages", "strategy", "adam_steps", "state",
                                   "files",  "tensors",  NULL};
  static const char *const v2[] = {"format",     "version", "save_id",  "step",
                                   "world_size", "stages",  "strategy", "adam_steps",
                                   "state",      "files",   "tensors",  NULL};
  static const char *const v3[] = {"format",     "version", "save_id",          "step",
                                   "world_size", "stages",  "stage_ranks",      "strategy",
                                   "adam_steps", "state",   "stage_strategies", "files",
                                   "tensors",    NULL};
  const char *id;
  int rc = rtp__json_only(doc, root, version == 1 ? v1 : version == 2 ? v2 : v3, "%s", "");
  if (rc || version == 1) return rc;
  rc = ck_str(doc, root, "", "save_id", CK_ID_LEN, &id);
  if (!rc && (strlen(id) != CK_ID_LEN || strspn(id, "0123456789abcdef") != CK_ID_LEN))
    rc = rtp__error(RTP_EFORMAT, "%s: save_id '%s' is not %d lowercase hex digits", ipath, id,
                    CK_ID_LEN);
  if (!rc) memcpy(c->save_id, id, CK_ID_LEN + 1);
  return rc;
}

/* index.json, parsed and checked whole before anything is taken from it. */
static int ck_parse_index(struct rtp_ckpt *c, const char *ipath, const char *text, size_t n,
                          int64_t dir_step) {
  /* 5 levels deep: the top, tensors, a tensor, its blocks, a block. */
  struct rtp__json_limits lim = {CK_MAX_INDEX, 8, 0};
  struct rtp__json *doc;
  int rc = rtp__json_parse(ipath, text, n, &lim, &doc, NULL);
  if (rc) return rc;
  const struct rtp__json_value *root = rtp__json_root(doc);
  const char *format, *strategy;
  int64_t version = 0, world = 0;
  rc = rtp__json_expect(doc, root, RTP__JSON_OBJECT, "%s", "");
  if (!rc) rc = ck_str(doc, root, "", "format", 64, &format);
  if (!rc && strcmp(format, "rtp-checkpoint"))
    rc = rtp__error(RTP_EFORMAT, "%s: format '%s': not an rtp checkpoint index", ipath, format);
  if (!rc) rc = ck_int(doc, root, "", "version", 0, INT64_MAX, &version);
  if (!rc && (version < 1 || version > 3))
    rc = rtp__error(RTP_EFORMAT, "%s: version %" PRId64 ", this library reads versions 1 to 3",
                    ipath, version);
  c->het = version == 3;
  if (!rc) rc = ck_read_save_id(c, doc, root, ipath, version);
  if (!rc) rc = ck_int(doc, root, "", "step", 0, 99999999, &c->step);
  if (!rc && c->step != dir_step)
    rc = rtp__error(RTP_EFORMAT, "%s: step %" PRId64 " in the directory of step %" PRId64,
                    ipath, c->step, dir_step);
  if (!rc) rc = ck_int(doc, root, "", "world_size", 1, 1 << 16, &world);
  if (!rc) rc = ck_read_stages(c, doc, root, ipath, world);
  if (!rc) rc = ck_str(doc, root, "", "strategy", 32, &strategy);
  if (!rc && rtp_strategy_parse(strategy, &c->strategy))
    rc = rtp__error(RTP_EFORMAT, "%s: unknown strategy '%s'", ipath, strategy);
  if (!rc) rc = ck_int(doc, root, "", "adam_steps", 0, CK_MAX_ADAM_STEPS, &c->adam_steps);
  c->world = (int)world;
  if (!rc && c->het) rc = ck_read_hetero(c, doc, root, ipath);
  if (!rc) rc = ck_read_state(c, doc, root);
  if (!rc) rc = ck_read_files(c, doc, root);
  if (!rc) rc = ck_check_tensors(c, doc, root);
  rtp__json_free(doc);
  return rc;
}

/* DIR/name (latest or best), which must name a step directory: its path and step. */
static int ck_read_pointer(const char *dir, const char *name, char *stepdir, int64_t *step) {
  char path[CK_PATH];
  void *buf = NULL;
  int rc = rtp__ckpt_path(path, dir, name);
  if (!rc) rc = rtp_file_read(path, CK_MAX_LINE, &buf, NULL);
  if (rc) {
    char why[512]; /* the message is rewritten below: keep a copy */
    snprintf(why, sizeof(why), "%s", rtp_last_error());
    return rtp__error(rc, "%s: %s (%s)", dir,
                      strcmp(name, "best") ? "no checkpoint to resume from"
                                           : "no best checkpoint (none was saved as the best)",
                      why);
  }
  char *text = buf;
  text[strcspn(text, "\n")] = 0;
  if (!ck_parse_step_name(text, step)) {
    rc = rtp__error(RTP_EFORMAT, "%s: does not name a step-<8 digits> directory", path);
  } else {
    rc = rtp__ckpt_path(stepdir, dir, text);
  }
  free(text);
  return rc;
}

/* The marker must exist and hold index.json's checksum. */
static int ck_read_index(struct rtp_ckpt *c, int64_t dir_step) {
  char mpath[CK_PATH], ipath[CK_PATH], hex[65];
  void *marker = NULL, *index = NULL;
  size_t n = 0;
  int rc = rtp__ckpt_path(mpath, c->dir, "COMPLETE");
  if (!rc) rc = rtp__ckpt_path(ipath, c->dir, "index.json");
  if (!rc && access(mpath, F_OK) && errno == ENOENT)
    return rtp__error(RTP_EFORMAT, "%s is incomplete: no COMPLETE marker (an interrupted save)",
                      c->dir);
  if (!rc) rc = rtp_file_read(mpath, CK_MAX_LINE, &marker, NULL);
  if (!rc) rc = rtp_file_read(ipath, CK_MAX_INDEX, &index, &n);
  if (!rc) rc = ck_sha256_hex(index, n, hex);
  const char *m = marker;
  if (!rc && (strncmp(m, "sha256 ", 7) || strncmp(m + 7, hex, 64)))
    rc = rtp__error(RTP_EFORMAT, "%s: checksum mismatch: COMPLETE says %.64s, file is %s",
                    ipath, m + (strncmp(m, "sha256 ", 7) ? 0 : 7), hex);
  if (!rc) rc = ck_parse_index(c, ipath, index, n, dir_step);
  free(marker);
  free(index);
  return rc;
}

/* The checkpoint DIR/name names, checked. */
static int ck_open_pointer(const char *dir, const char *name, struct rtp_ckpt **out) {
  if (!dir || !out) return rtp__error(RTP_EINVAL, "rtp_ckpt_open: NULL argument");
  *out = NULL;
  struct rtp_ckpt *c = calloc(1, sizeof(*c));
  if (!c) return rtp__error(RTP_ENOMEM, "rtp_ckpt_open: out of memory");
  int64_t step = -1;
  int rc = ck_read_pointer(dir, name, c->dir, &step);
  if (!rc) rc = ck_read_index(c, step);
  if (rc) {
    rtp_ckpt_close(c);
    return rc;
  }
  *out = c;
  return RTP_OK;
}

int rtp_ckpt_open(const char *dir, struct rtp_ckpt **out) {
  return ck_open_pointer(dir, "latest", out);
}

int rtp_ckpt_open_best(const char *dir, struct rtp_ckpt **out) {
  return ck_open_pointer(dir, "best", out);
}

void rtp_ckpt_close(struct rtp_ckpt *c) {
  if (!c) return;
  for (int i = 0; i < c->n_tensors; i++) free(c->tensors[i].blocks);
  free(c->tensors);
  free(c->files);
  free(c);
}

int64_t rtp_ckpt_step(const struct rtp_ckpt *c) {
  return c ? c->step : -1;
}

int rtp_ckpt_world_size(const struct rtp_ckpt *c) {
  return c ? c->world : 0;
}

int rtp_ckpt_stages(const struct rtp_ckpt *c) {
  return c ? c->stages : 0;
}

enum rtp_strategy rtp_ckpt_strategy(const struct rtp_ckpt *c) {
  return c ? c->strategy : RTP_STRATEGY_NONE;
}

const char *rtp_ckpt_path(const struct rtp_ckpt *c) {
  return c ? c->dir : "";
}

const char *rtp_ckpt_state(const struct rtp_ckpt *c, const char *key) {
  for (int i = 0; c && key && i < c->n_state; i++)
    if (strcmp(c->state[i][0], key) == 0) return c->state[i][1];
  return NULL;
}
