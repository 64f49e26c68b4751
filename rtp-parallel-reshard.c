/* rtp-parallel-reshard.c - a training state moved live from one parallel plan to another:
 * every parameter and its Adam states, from the ranks and layout of one plan to those of
 * the other (N ranks to M, rtp, fsdp, tp, ddp, pipelined or not), through the cross-mesh
 * planner (rtp-reshard.c) and its chained broadcasts (rtp-reshard-exec.c), without a
 * checkpoint on disk. docs/resharding.md, "Resharding a training state".
 *
 * A rank knows only its own plans, so the ranks first tell each other what they are in
 * each plan (an all-gather over the job): from that every rank derives the same meshes
 * and layouts, hence the same cross-mesh plan per parameter, which rtp_reshard_build
 * needs. Checks that fail on one rank fail every rank, with the same message: a rank that
 * returned early would leave the others waiting in the next transfer. */
#include "rtp-backend.h"
#include "rtp-strategy.h"

#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

/* What a rank is in one plan (a side), as it tells the others. */
enum { S_IN, S_STRATEGY, S_STAGE, S_STAGES, S_GRANK, S_GSIZE, S_OPT, S_FIELDS };
/* A rank's record: both sides, its model, its step count, its verdict. */
enum {
  R_FROM = 0,
  R_TO = S_FIELDS,
  R_MODEL = 2 * S_FIELDS,
  R_NPARAMS,
  R_STEPS_LO,
  R_STEPS_HI,
  R_BAD, /* 0, or 1 + the local check that failed (its message is this rank's) */
  R_FIELDS
};

struct side {
  const struct rtp_parallel *par;
  const struct rtp_optimizer *opt;
  struct rtp_tensor **params; /* the plan's one-device parameters, in graph order */
  int n_params;
  int first; /* the lowest job rank in this side, -1 if none */
};

struct job {
  struct rtp_comm *comm;
  int rank, size;
  int32_t *rec;    /* size x R_FIELDS */
  int32_t *stages; /* size x 2 x n_params: each rank's stage of every parameter, per side */
  int *hosts;      /* per job rank */
  int n_params;
};

static uint32_t fnv(uint32_t h, const void *p, size_t n) {
  const uint8_t *b = p;
  for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 16777619u;
  return h;
}

/* The parameters of plan p's one-device graph (its leaves marked as such). */
static int side_init(struct side *s, const struct rtp_parallel *par,
                     const struct rtp_optimizer *opt) {
  memset(s, 0, sizeof(*s));
  s->par = par;
  s->opt = opt;
  s->first = -1;
  if (!par) return RTP_OK;
  const struct rtp_graph *g = par->src;
  s->params = calloc((size_t)g->n_leafs + 1, sizeof(*s->params));
  if (!s->params) return rtp__error(RTP_ENOMEM, "rtp_parallel_reshard: out of memory");
  for (int i = 0; i < g->n_leafs; i++)
    if (g->leafs[i]->flags & RTP_FLAG_PARAM) s->params[s->n_params++] = g->leafs[i];
  return RTP_OK;
}

/* Names, shapes, types and marks (tp's) of the parameters, which the layouts stand on. */
static uint32_t side_model(const struct side *s) {
  uint32_t h = 2166136261u;
  for (int i = 0; i < s->n_params; i++) {
    const struct rtp_tensor *t = s->params[i];
    h = fnv(h, t->name, strlen(t->name));
    h = fnv(h, t->ne, sizeof(t->ne));
    h = fnv(h, &t->type, sizeof(t->type));
    h = fnv(h, t->op_params, sizeof(t->op_params));
  }
  return h;
}

static void side_record(const struct side *s, int32_t *out) {
  if (!s->par) return;
  const struct rtp_parallel *p = s->par;
  int n = p->comm ? rtp_comm_size(p->comm) : 1;
  out[S_IN] = 1;
  out[S_STRATEGY] = n > 1 ? (int32_t)p->strategy : RTP_STRATEGY_NONE;
  out[S_STAGE] = rtp_parallel_stage(p);
  out[S_STAGES] = rtp_parallel_stages(p);
  out[S_GRANK] = p->comm ? rtp_comm_rank(p->comm) : 0;
  out[S_GSIZE] = n;
  out[S_OPT] = s->opt != NULL;
}

/* This rank's record; a local check that fails sets R_BAD (its message in rtp_last_error). */
static void local_record(const struct side *from, const struct side *to, int32_t *r) {
  memset(r, 0, R_FIELDS * sizeof(*r));
  side_record(from, r + R_FROM);
  side_record(to, r + R_TO);
  const struct side *any = from->par ? from : to;
  r[R_MODEL] = (int32_t)side_model(any);
  r[R_NPARAMS] = any->n_params;
  int64_t steps = rtp_optimizer_steps(from->opt);
  r[R_STEPS_LO] = (int32_t)(uint32_t)steps;
  r[R_STEPS_HI] = (int32_t)(steps >> 32);
  if (from->par && to->par && side_model(from) != side_model(to)) {
    rtp__error(RTP_EINVAL,
               "rtp_parallel_reshard: the two plans were built from different "
               "models (parameter names, shapes or tp marks differ)");
    r[R_BAD] = 1;
  } else if ((from->opt && !from->par) || (to->opt && !to->par)) {
    rtp__error(RTP_EINVAL, "rtp_parallel_reshard: an optimizer without its plan");
    r[R_BAD] = 2;
  } else if ((from->par && from->par->pipe && from->par->pipe->het) ||
             (to->par && to->par->pipe && to->par->pipe->het)) {
    /* the records hold one strategy and group size per plan */
    rtp__error(RTP_EINVAL,
               "rtp_parallel_reshard: a pipeline of stages of different sizes or strategies "
               "is not supported yet");
    r[R_BAD] = 3;
  }
}

static int gather(struct job *j, int32_t *buf, size_t per_rank) {
  struct rtp_comm_req *req;
  int rc = rtp_comm_allgather(j->comm, buf, per_rank * (size_t)j->size, sizeof(*buf), &req);
  return rc ? rc : rtp_comm_wait(req);
}

static const int32_t *rec_side(const struct job *j, int rank, int side) {
  return j->rec + (size_t)rank * R_FIELDS + (side ? R_TO : R_FROM);
}

/* Every rank checks every record the same way, so all fail together, with one message. */
static int check_records(struct job *j, struct side *sd[2]) {
  static const char *names[2] = {"old", "new"};
  int first = -1;
  for (int r = 0; r < j->size; r++) {
    const int32_t *x = j->rec + (size_t)r * R_FIELDS;
    if (x[R_BAD] && r == j->rank) return RTP_EINVAL; /* its own message stands */
    if (x[R_BAD])
      return rtp__error(RTP_EINVAL,
                        "rtp_parallel_reshard: rank %d refused its part (check %d): the "
                        "message is in that rank's rtp_last_error",
                        r, x[R_BAD]);
    if (!x[R_FROM + S_IN] && !x[R_TO + S_IN]) continue;
    if (first < 0) first = r;
    const int32_t *f = j->rec + (size_t)first * R_FIELDS;
    if (x[R_MODEL] != f[R_MODEL] || x[R_NPARAMS] != f[R_NPARAMS])
      return rtp__error(
          RTP_EINVAL, "rtp_parallel_reshard: ranks %d and %d built different models", first, r);
  }
  if (first < 0) return rtp__error(RTP_EINVAL, "rtp_parallel_reshard: no rank is in a plan");
  j->n_params = j->rec[(size_t)first * R_FIELDS + R_NPARAMS];
  for (int s = 0; s < 2; s++) {
    int n = 0, stages = 0, gsize = 0, opt = -1;
    for (int r = 0; r < j->size; r++) {
      const int32_t *x = rec_side(j, r, s);
      if (!x[S_IN]) continue;
      if (!n++) {
        sd[s]->first = r;
        stages = x[S_STAGES];
        gsize = x[S_GSIZE];
        opt = x[S_OPT];
      }
      if (x[S_STAGES] != stages || x[S_GSIZE] != gsize || x[S_OPT] != opt || x[S_STAGE] < 0 ||
          x[S_STAGE] >= stages || x[S_GRANK] < 0 || x[S_GRANK] >= gsize)
        return rtp__error(RTP_EINVAL,
                          "rtp_parallel_reshard: the %s plan's ranks disagree on its shape "
                          "(rank %d: stage %d of %d, rank %d of %d%s)",
                          names[s], r, x[S_STAGE], x[S_STAGES], x[S_GRANK], x[S_GSIZE],
                          x[S_OPT] != opt ? ", optimizer or not" : "");
    }
    if (!n)
      return rtp__error(RTP_EINVAL, "rtp_parallel_reshard: no rank is in the %s plan",
                        names[s]);
    if (n != stages * gsize)
      return rtp__error(RTP_EINVAL,
                        "rtp_parallel_reshard: the %s plan has %d ranks, not its %d stages "
                        "x %d ranks",
                        names[s], n, stages, gsize);
  }
  if (rec_side(j, sd[1]->first, 1)[S_OPT] && !rec_side(j, sd[0]->first, 0)[S_OPT])
    return rtp__error(RTP_EINVAL,
                      "rtp_parallel_reshard: the new plan has an optimizer and the old one "
                      "none, so there are no Adam states to move");
  return RTP_OK;
}

/* Two positions of one plan's stage, rank by rank; a repeat fails check_meshes. */
static int check_meshes(const struct job *j) {
  for (int s = 0; s < 2; s++)
    for (int a = 0; a < j->size; a++)
      for (int b = a + 1; b < j->size; b++) {
        const int32_t *x = rec_side(j, a, s), *y = rec_side(j, b, s);
        if (x[S_IN] && y[S_IN] && x[S_STAGE] == y[S_STAGE] && x[S_GRANK] == y[S_GRANK])
          return rtp__error(RTP_EINVAL,
                            "rtp_parallel_reshard: ranks %d and %d are both rank %d of stage "
                            "%d of the %s plan",
                            a, b, x[S_GRANK], x[S_STAGE], s ? "new" : "old");
      }
  return RTP_OK;
}

/* The caller's hosts, else the rendezvous's (rtp_comm_hosts). */
static int set_hosts(struct job *j, const int *hosts) {
  if (!hosts) return rtp_comm_hosts(j->comm, j->hosts);
  for (int r = 0; r < j->size; r++) {
    if (hosts[r] < 0 || hosts[r] >= RTP_MESH_MAX_RANKS)
      return rtp__error(RTP_EINVAL,
                        "rtp_parallel_reshard: host %d of rank %d is not in 0 .. %d", hosts[r],
                        r, RTP_MESH_MAX_RANKS - 1);
    j->hosts[r] = hosts[r];
  }
  return RTP_OK;
}

/* Side s's ranks that hold stage `stage`, in group order, as a mesh. */
static int stage_mesh(const struct job *j, int s, int stage, struct rtp_mesh *m) {
  int ranks[RTP_MESH_MAX_RANKS], hosts[RTP_MESH_MAX_RANKS], n = 0;
  for (int r = 0; r < j->size; r++) {
    const int32_t *x = rec_side(j, r, s);
    if (!x[S_IN] || x[S_STAGE] != stage) continue;
    if (x[S_GRANK] >= RTP_MESH_MAX_RANKS)
      return rtp__error(RTP_EINVAL, "rtp_parallel_reshard: more than %d ranks in a stage",
                        RTP_MESH_MAX_RANKS);
    ranks[x[S_GRANK]] = r;
    hosts[x[S_GRANK]] = j->hosts[r];
    n++;
  }
  return rtp_mesh_init_1d(m, n, ranks, hosts);
}

/* This rank's tensors of parameter i in side sd (value, m, v; NULL where it holds none). */
static void rank_tensors(const struct side *sd, int i, struct rtp_tensor *t[3]) {
  t[0] = t[1] = t[2] = NULL;
  if (!sd->par) return;
  t[0] = rtp_parallel_tensor(sd->par, sd->params[i]);
  if (t[0] && sd->opt) rtp__optimizer_find(sd->opt, t[0], &t[1], &t[2]);
}

static bool involves(const struct rtp_reshard_slice *s, int rank) {
  for (int k = 0; k < s->n_holders; k++)
    if (s->holders[k] == rank) return true;
  for (int k = 0; k < s->n_receivers; k++)
    if (s->receivers[k] == rank) return true;
  return false;
}

/* The graph that moves parameter i's value and Adam states: planned, computed, freed. */
static int move_param(const struct job *j, struct side *sd[2], int i, int n_states,
                      const struct rtp_reshard_params *rp, size_t chunk) {
  struct rtp_reshard *plan;
  int rc = rtp_reshard_plan(rp, &plan);
  if (rc) return rc;
  struct rtp_tensor *src[3], *dst[3];
  rank_tensors(sd[0], i, src);
  rank_tensors(sd[1], i, dst);
  size_t bytes = 0, nodes = 64;
  for (int k = 0; k < plan->n_slices; k++) {
    const struct rtp_reshard_slice *sl = &plan->slices[k];
    if (!involves(sl, j->rank)) continue;
    bytes += sl->nbytes;
    nodes += 3 * (sl->nbytes / (chunk ? chunk : RTP_RESHARD_CHUNK) + 2);
  }
  const struct side *any = sd[1]->par ? sd[1] : sd[0];
  struct rtp_init_params ip = {(size_t)n_states * (nodes * 1024 + 2 * bytes) + (1u << 20), NULL,
                               false, rtp__ctx_backend(any->par->ctx), 0};
  if (ip.backend) ip.data_size = (size_t)n_states * 2 * bytes + (1u << 20);
  struct rtp_context *ctx = rtp_context_new(ip);
  struct rtp_graph *g = ctx ? rtp_graph_new(ctx, (int)(n_states * nodes)) : NULL;
  rc = g ? RTP_OK
         : rtp__error(RTP_ENOMEM, "rtp_parallel_reshard: no memory for '%s'",
                      sd[0]->par ? sd[0]->params[i]->name : sd[1]->params[i]->name);
  for (int k = 0; k < n_states && !rc; k++)
    rc = rtp_reshard_build(ctx, g, j->comm, plan, src[k], dst[k], chunk);
  if (!rc) rc = rtp_graph_plan(ctx, g);
  if (!rc) rc = rtp_graph_compute(g, NULL);
  rtp_context_free(ctx);
  rtp_reshard_free(plan);
  return rc;
}

static int stage_of(const struct job *j, const struct side *sd, int s, int i) {
  return j->stages[((size_t)sd->first * 2 + (size_t)s) * (size_t)j->n_params + (size_t)i];
}

static int move_all(struct job *j, struct side *sd[2], size_t chunk) {
  int n_states = rec_side(j, sd[1]->first, 1)[S_OPT] ? 3 : 1;
  const struct side *any = sd[0]->par ? sd[0] : sd[1];
  for (int i = 0; i < j->n_params; i++) {
    int st[2] = {stage_of(j, sd[0], 0, i), stage_of(j, sd[1], 1, i)};
    const struct rtp_tensor *param = any->params[i];
    if (st[1] < 0) continue; /* no stage of the new plan reads it */
    if (st[0] < 0)
      return rtp__error(RTP_EINVAL,
                        "rtp_parallel_reshard: the new plan needs '%s', which no stage of "
                        "the old one holds",
                        param->name);
    struct rtp_mesh mesh[2];
    struct rtp_layout lay[2];
    struct rtp_reshard_params rp =
        rtp__reshard_params_pair(mesh, lay, param->ne, rtp_type_size(param->type));
    for (int s = 0; s < 2; s++) {
      int rc = stage_mesh(j, s, st[s], &mesh[s]);
      if (!rc)
        rc = rtp_layout_param((enum rtp_strategy)rec_side(j, sd[s]->first, s)[S_STRATEGY],
                              param, &lay[s]);
      if (rc) return rc;
    }
    /* a rank in neither mesh has no part in this parameter's move */
    int rc = move_param(j, sd, i, n_states, &rp, chunk);
    if (rc) return rc;
  }
  return RTP_OK;
}

static int steps_set(const struct job *j, const struct side *from, struct rtp_optimizer *to) {
  if (!to) return RTP_OK;
  const int32_t *x = j->rec + (size_t)from->first * R_FIELDS;
  int64_t steps =
      (int64_t)(((uint64_t)(uint32_t)x[R_STEPS_HI] << 32) | (uint32_t)x[R_STEPS_LO]);
  return rtp_optimizer_set_steps(to, steps);
}

static int reshard(struct job *j, struct side *sd[2],
                   const struct rtp_parallel_reshard_params *p) {
  int32_t mine[R_FIELDS];
  local_record(sd[0], sd[1], mine);
  j->rec = calloc((size_t)j->size, R_FIELDS * sizeof(*j->rec));
  j->hosts = calloc((size_t)j->size, sizeof(*j->hosts));
  if (!j->rec || !j->hosts)
    return rtp__error(RTP_ENOMEM, "rtp_parallel_reshard: out of memory");
  memcpy(j->rec + (size_t)j->rank * R_FIELDS, mine, sizeof(mine));
  int rc = gather(j, j->rec, R_FIELDS);
  if (!rc) rc = check_records(j, sd);
  if (!rc) rc = check_meshes(j);
  if (!rc) rc = set_hosts(j, p->hosts);
  if (rc) return rc;
  size_t per = 2 * (size_t)j->n_params;
  j->stages = malloc((size_t)j->size * per * sizeof(*j->stages));
  if (!j->stages) return rtp__error(RTP_ENOMEM, "rtp_parallel_reshard: out of memory");
  int32_t *own = j->stages + (size_t)j->rank * per;
  for (int s = 0; s < 2; s++)
    for (int i = 0; i < j->n_params; i++)
      own[(size_t)s * (size_t)j->n_params + (size_t)i] =
          sd[s]->par ? rtp_parallel_tensor_stage(sd[s]->par, sd[s]->params[i]) : -1;
  if ((rc = gather(j, j->stages, per))) return rc;
  if (!sd[0]->par && !sd[1]->par) return RTP_OK;
  if ((rc = move_all(j, sd, p->chunk_bytes))) return rc;
  return steps_set(j, sd[0], p->to_opt);
}

int rtp_parallel_reshard(const struct rtp_parallel_reshard_params *p) {
  if (!p || !p->job)
    return rtp__error(RTP_EINVAL, "rtp_parallel_reshard: NULL parameters or job");
  struct side from, to, *sd[2] = {&from, &to};
  struct job j = {.comm = p->job, .rank = rtp_comm_rank(p->job), .size = rtp_comm_size(p->job)};
  int rc = side_init(&from, p->from, p->from_opt);
  if (!rc) rc = side_init(&to, p->to, p->to_opt);
  if (!rc) rc = reshard(&j, sd, p);
  free(from.params);
  free(to.params);
  free(j.rec);
  free(j.stages);
  free(j.hosts);
  return rc;
}
