/*
 * rtp-ckpt-load.c - loading a checkpoint: a reshard from the saved layout to the loading
 * plan's through the cross-mesh planner (rtp-ckpt.c's header comment has the whole
 * picture). Each file's size, metadata and tensors are checked at its open, its checksum
 * before its first read, and each rank reads exactly the boxes the planner assigns it.
 */
#define _POSIX_C_SOURCE 200809L
#include "rtp-ckpt.h"
#include "rtp-impl.h"
#include "rtp-strategy.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- loading ------------------------------------------------------------------------ */

/* The saved rank files, opened (headers only); each file's checksum is checked before the
 * first read from it. */
struct ck_files {
  int n;
  struct rtp_safetensors **st;
  bool *verified;
  const struct rtp_ckpt *c;
};

static const struct ck_tensor *ck_find_tensor(const struct rtp_ckpt *c, const char *name) {
  for (int i = 0; i < c->n_tensors; i++)
    if (strcmp(c->tensors[i].name, name) == 0) return &c->tensors[i];
  return NULL;
}

/* The checkpoint must be of this model: its tensors the model's parameters, no more and no
 * fewer, each of the same global shape (else a smaller model would load the first rows
 * and layers of a larger one). */
static int ck_check_model(const struct rtp_ckpt *c, const struct rtp_ckpt_params *p) {
  char a[160], b[160];
  for (int i = 0; i < p->n_params; i++) {
    const struct rtp_tensor *g = p->params[i];
    const struct ck_tensor *t = ck_find_tensor(c, g->name);
    rtp__file_shape_str(g->ne, rtp_tensor_n_dims(g), b, sizeof(b));
    if (!t)
      return rtp__error(RTP_ESHAPE, "%s/index.json: no tensor '%s' (the model's is %s)", c->dir,
                        g->name, b);
    if (memcmp(t->ne, g->ne, sizeof(t->ne)))
      return rtp__error(RTP_ESHAPE, "%s/index.json: tensor '%s' is %s, the model's is %s",
                        c->dir, g->name, rtp__file_shape_str(t->ne, t->n_dims, a, sizeof(a)),
                        b);
  }
  for (int k = 0; k < c->n_tensors; k++) {
    bool found = false;
    for (int i = 0; i < p->n_params && !found; i++)
      found = strcmp(c->tensors[k].name, p->params[i]->name) == 0;
    if (!found)
      return rtp__error(RTP_ESHAPE,
                        "%s/index.json: tensor '%s' is not in the model (%d tensors, the model "
                        "has %d)",
                        c->dir, c->tensors[k].name, c->n_tensors, p->n_params);
  }
  return RTP_OK;
}

/* The block of t that file r holds by the index, or NULL if none. */
static const struct ck_block *ck_index_block(const struct ck_tensor *t, int r) {
  for (int j = 0; j < t->n_blocks; j++)
    if (t->blocks[j].rank == r) return &t->blocks[j];
  return NULL;
}

/* Rank r's file must be of this save and hold what the index says it does: its metadata
 * naming the format, its rank and the index's save_id (none from a version 1 index); each
 * tensor the index gives it rows of (with its Adam states, adam.m. and adam.v.), of the
 * tensor's shape with that many rows, and nothing else. */
static int ck_check_file(const struct rtp_ckpt *c, const struct rtp_safetensors *st, int r,
                         const char *path) {
  char rs[16], a[160], b[160];
  snprintf(rs, sizeof(rs), "%d", r);
  const char *keys[] = {"format", "rank", "save_id"},
             *want[] = {"rtp-checkpoint", rs, c->save_id};
  for (int i = 0; i < 3; i++) {
    const char *v = rtp_safetensors_meta(st, keys[i]);
    if (strcmp(v ? v : "", want[i]))
      return rtp__error(RTP_EFORMAT, "%s: metadata %s is '%s', expected '%s'%s", path, keys[i],
                        v ? v : "", want[i],
                        i == 2 ? " (index.json's: the file is of another save)" : "");
  }
  int listed = 0;
  for (int k = 0; k < c->n_tensors; k++) listed += ck_index_block(&c->tensors[k], r) != NULL;
  for (int k = 0; k < rtp_safetensors_count(st); k++) {
    const char *name;
    enum rtp_type type;
    int64_t ne[RTP_MAX_DIMS];
    rtp_safetensors_info(st, k, &name, &type, NULL, ne);
    bool state =
        strncmp(name, "adam.", 5) == 0 && (name[5] == 'm' || name[5] == 'v') && name[6] == '.';
    const struct ck_tensor *t = ck_find_tensor(c, name);
    if (!t && state) t = ck_find_tensor(c, name + 7);
    const struct ck_block *blk = t ? ck_index_block(t, r) : NULL;
    int64_t expect[RTP_MAX_DIMS];
    if (!blk)
      return rtp__error(RTP_EFORMAT, "%s: tensor '%s' is not among the %d index.json gives it",
                        path, name, listed);
    memcpy(expect, t->ne, sizeof(expect));
    expect[t->n_dims - 1] = blk->rows;
    if (type != RTP_TYPE_F32 || memcmp(ne, expect, sizeof(ne)))
      return rtp__error(RTP_EFORMAT, "%s: tensor '%s' is %s %s, index.json says F32 %s", path,
                        name, type == RTP_TYPE_F32 ? "F32" : "I32",
                        rtp__file_shape_str(ne, t->n_dims, a, sizeof(a)),
                        rtp__file_shape_str(expect, t->n_dims, b, sizeof(b)));
  }
  for (int k = 0; k < c->n_tensors; k++)
    if (ck_index_block(&c->tensors[k], r) && rtp_safetensors_find(st, c->tensors[k].name) < 0)
      return rtp__error(RTP_EFORMAT, "%s: no tensor '%s', which index.json says it holds", path,
                        c->tensors[k].name);
  return RTP_OK;
}

static int ck_open_files(const struct rtp_ckpt *c, struct ck_files *f) {
  *f = (struct ck_files){.n = c->world, .c = c};
  f->st = calloc((size_t)c->world, sizeof(*f->st));
  f->verified = calloc((size_t)c->world, sizeof(bool));
  if (!f->st || !f->verified) return rtp__error(RTP_ENOMEM, "%s: out of memory", c->dir);
  for (int r = 0; r < c->world; r++) {
    char name[32], path[CK_PATH];
    if (!c->files[r].listed) continue; /* and the strategy writes none (checked at open) */
    snprintf(name, sizeof(name), "rank-%d.safetensors", r);
    int rc = rtp__ckpt_path(path, c->dir, name);
    if (!rc) rc = rtp__safetensors_open(path, c->files[r].bytes, &f->st[r]);
    if (!rc) rc = ck_check_file(c, f->st[r], r, path);
    if (rc) return rc;
  }
  return RTP_OK;
}

static void ck_close_files(struct ck_files *f) {
  for (int r = 0; f->st && r < f->n; r++) rtp_safetensors_close(f->st[r]);
  free(f->st);
  free(f->verified);
}

static int ck_verify_file(struct ck_files *f, int r) {
  if (f->verified[r]) return RTP_OK;
  char name[40], path[CK_PATH], hex[65];
  const struct ck_file *want = &f->c->files[r];
  uint64_t bytes;
  snprintf(name, sizeof(name), "rank-%d.safetensors", r);
  int rc = rtp__ckpt_path(path, f->c->dir, name);
  if (!rc) rc = rtp__ckpt_sha256_file(path, want->bytes, hex, &bytes);
  if (!rc && strcmp(hex, want->sha))
    rc = rtp__error(RTP_EFORMAT, "%s: checksum mismatch (corrupted): sha256 %s, index says %s",
                    path, hex, want->sha);
  f->verified[r] = !rc;
  return rc;
}

/* The saved layout of t: a mesh of the files that hold it, in rank order (ddp's one file,
 * or in a pipeline those of its stage), its outermost dimension chunked over them as
 * rtp_comm_block cuts it (rtp__ckpt_check_partition). Files are read, not sent: one host. */
static int ck_saved_layout(const struct rtp_ckpt *c, const struct ck_tensor *t,
                           struct rtp_mesh *m, struct rtp_layout *l) {
  int ranks[RTP_MESH_MAX_RANKS], hosts[RTP_MESH_MAX_RANKS] = {0};
  if (t->n_blocks > RTP_MESH_MAX_RANKS)
    return rtp__error(RTP_ENOSYS,
                      "%s: '%s' is in %d files; a load reads at most %d (the resharding "
                      "planner's meshes)",
                      c->dir, t->name, t->n_blocks, RTP_MESH_MAX_RANKS);
  for (int j = 0; j < t->n_blocks; j++) ranks[j] = t->blocks[j].rank;
  *l = rtp_layout_replicated();
  int rc = rtp_mesh_init_1d(m, t->n_blocks, ranks, hosts);
  return rc ? rc : rtp_layout_chunk(l, t->n_dims - 1, 0, 1);
}

/* g's layout in the plan, on a mesh of the plan's group whose ranks are numbered after the
 * files' (a file is never taken for a rank, so every slice is read); *me is this rank. */
static int ck_plan_layout(const struct rtp_ckpt *c, const struct rtp_parallel *par,
                          const struct rtp_tensor *g, struct rtp_mesh *m, struct rtp_layout *l,
                          int *me) {
  int n = par->comm ? rtp_comm_size(par->comm) : 1;
  int ranks[RTP_MESH_MAX_RANKS], hosts[RTP_MESH_MAX_RANKS] = {0};
  if (n > RTP_MESH_MAX_RANKS)
    return rtp__error(RTP_ENOSYS,
                      "rtp_ckpt_load: a group of %d ranks; a load reads onto at most %d (the "
                      "resharding planner's meshes)",
                      n, RTP_MESH_MAX_RANKS);
  for (int i = 0; i < n; i++) ranks[i] = c->world + i;
  *me = c->world + (par->comm ? rtp_comm_rank(par->comm) : 0);
  int rc = rtp_mesh_init_1d(m, n, ranks, hosts);
  return rc ? rc : rtp_parallel_layout(par, g, l);
}

static bool ck_receives(const struct rtp_reshard_slice *s, int me) {
  for (int k = 0; k < s->n_receivers; k++)
    if (s->receivers[k] == me) return true;
  return false;
}

/* Slice s of the saved tensor name (t in the index) into its place in dst, this rank's
 * block (map): read from its one holder (the saved blocks do not overlap), whose rows start
 * at its block's first. */
static int ck_read_slice(struct ck_files *f, struct rtp_context *views, const char *name,
                         const struct ck_tensor *t, const struct rtp_reshard_slice *s,
                         const struct rtp__reshard_map *map, struct rtp_tensor *dst) {
  int r = s->holders[0];
  int64_t at[RTP_MAX_DIMS];
  memcpy(at, s->first, sizeof(at));
  at[t->n_dims - 1] -= ck_index_block(t, r)->first;
  struct rtp_tensor *v = rtp_view(views, dst, RTP_MAX_DIMS, s->len, dst->nb,
                                  rtp__reshard_map_offset(map, dst, s->first));
  int rc = v ? ck_verify_file(f, r) : rtp__error(RTP_ENOMEM, "rtp_ckpt_load: out of memory");
  return rc ? rc : rtp__safetensors_read_box(f->st[r], name, at, v);
}

/* Parameter g's value and Adam states (st, as this rank holds them): loading is a reshard
 * from the saved layout to the plan's, whose slices say which file holds each box this
 * rank needs. */
static int ck_load_param(const struct rtp_ckpt_params *p, struct ck_files *f,
                         const struct rtp_tensor *g, struct rtp_tensor *st[3]) {
  const struct ck_tensor *t = ck_find_tensor(f->c, g->name);
  struct rtp_mesh mesh[2];
  struct rtp_layout lay[2];
  struct rtp_reshard_params rp = rtp__reshard_params_pair(mesh, lay, g->ne, sizeof(float));
  struct rtp_reshard *plan = NULL;
  struct rtp__reshard_map map = {0};
  struct rtp_context *views = NULL;
  int me = -1, rc = ck_saved_layout(f->c, t, &mesh[0], &lay[0]);
  if (!rc) rc = ck_plan_layout(f->c, p->par, g, &mesh[1], &lay[1], &me);
  if (!rc) rc = rtp_reshard_plan(&rp, &plan);
  if (!rc && rtp__reshard_map_init(&map, plan, me, false))
    views = rtp_context_new((struct rtp_init_params){
        .mem_size = ((size_t)plan->n_slices * 3 + 8) * 1024, .no_alloc = true});
  if (!rc && !views) rc = rtp__error(RTP_ENOMEM, "rtp_ckpt_load: out of memory");
  for (int j = 0; j < 3 && st[j] && !rc; j++) {
    char name[RTP_MAX_NAME + 8];
    snprintf(name, sizeof(name), "%s%s", j ? (j == 1 ? "adam.m." : "adam.v.") : "", g->name);
    if (map.n[0] && memcmp(st[j]->ne, map.ne, sizeof(map.ne)))
      rc = rtp__error(RTP_ESHAPE,
                      "rtp_ckpt_load: this rank's '%s' is not its block of the plan's layout",
                      name);
    for (int k = 0; k < plan->n_slices && !rc; k++)
      if (ck_receives(&plan->slices[k], me))
        rc = ck_read_slice(f, views, name, t, &plan->slices[k], &map, st[j]);
  }
  rtp_context_free(views);
  rtp__reshard_map_free(&map);
  rtp_reshard_free(plan);
  return rc;
}

static int ck_load_tensors(const struct rtp_ckpt_params *p, struct ck_files *f) {
  int rc = RTP_OK;
  for (int i = 0; i < p->n_params && !rc; i++) {
    const struct rtp_tensor *g = p->params[i];
    struct rtp_tensor *st[3] = {rtp_parallel_tensor(p->par, g)};
    if (!st[0] || rtp_tensor_nelements(g) == 0) continue; /* another stage's, or nothing */
    rtp__optimizer_find(p->opt, st[0], &st[1], &st[2]);
    rc = ck_load_param(p, f, g, st);
  }
  return rc;
}

int rtp_ckpt_load(const struct rtp_ckpt *c, const struct rtp_ckpt_params *p) {
  int rc = rtp__ckpt_check_params(p);
  if (rc) return rc;
  if (!c) return rtp__error(RTP_EINVAL, "rtp_ckpt_load: no checkpoint");
  struct ck_files f = {0};
  rc = ck_check_model(c, p);
  if (!rc) rc = ck_open_files(c, &f);
  if (!rc) rc = ck_load_tensors(p, &f);
  ck_close_files(&f);
  if (!rc && p->opt) rc = rtp_optimizer_set_steps(p->opt, c->adam_steps);
  return rtp__ckpt_any_failed(p, rc, "to load the checkpoint");
}
