/* rtp-reshard.c - cross-mesh resharding's layouts and planner (the Alpa team's, arXiv
 * 2211.05322): which hyper-rectangles of a tensor move, who sends each, and in what rounds.
 * Pure functions: nothing here communicates (tests/test-reshard.cpp runs them on simulated
 * meshes). docs/resharding.md. */
#include "rtp-strategy.h"

#include <stdlib.h>
#include <string.h>

/* The most ranks the slices of a plan list together (64 MiB of ints), and the most blocks
 * a layout cuts a dimension into. */
#define PLAN_MAX_POOL (1u << 24)

/* ---- meshes ----------------------------------------------------------------------- */

static int mesh_init(struct rtp_mesh *m, int rows, int cols, const int *ranks,
                     const int *hosts) {
  if (!m || !hosts || rows < 1 || cols < 1 || rows > RTP_MESH_MAX_RANKS / cols)
    return rtp__error(RTP_EINVAL,
                      "rtp_mesh_init: a mesh of %d x %d ranks (1 to %d ranks, with hosts)",
                      rows, cols, RTP_MESH_MAX_RANKS);
  int n = rows * cols;
  for (int i = 0; i < n; i++) {
    int r = ranks ? ranks[i] : i;
    if (r < 0 || hosts[i] < 0 || hosts[i] >= RTP_MESH_MAX_RANKS)
      return rtp__error(RTP_EINVAL, "rtp_mesh_init: rank %d on host %d (hosts are 0..%d)", r,
                        hosts[i], RTP_MESH_MAX_RANKS - 1);
    for (int j = 0; j < i; j++)
      if (m->ranks[j] == r)
        return rtp__error(RTP_EINVAL, "rtp_mesh_init: rank %d appears twice", r);
    m->ranks[i] = r;
    m->hosts[i] = hosts[i];
  }
  m->shape[0] = rows;
  m->shape[1] = cols;
  return RTP_OK;
}

int rtp_mesh_init_1d(struct rtp_mesh *m, int n, const int *ranks, const int *hosts) {
  int rc = mesh_init(m, n, 1, ranks, hosts);
  if (!rc) m->n_axes = 1;
  return rc;
}

int rtp_mesh_init_2d(struct rtp_mesh *m, int rows, int cols, const int *ranks,
                     const int *hosts) {
  int rc = mesh_init(m, rows, cols, ranks, hosts);
  if (!rc) m->n_axes = 2;
  return rc;
}

int rtp_mesh_init_comm(struct rtp_mesh *m, const struct rtp_comm *c, const int *hosts) {
  if (!c || !hosts)
    return rtp__error(RTP_EINVAL, "rtp_mesh_init_comm: NULL communicator or hosts");
  int n = rtp_comm_size(c), ranks[RTP_MESH_MAX_RANKS], h[RTP_MESH_MAX_RANKS];
  if (n > RTP_MESH_MAX_RANKS)
    return rtp__error(RTP_EINVAL, "rtp_mesh_init_comm: %d ranks (at most %d)", n,
                      RTP_MESH_MAX_RANKS);
  for (int i = 0; i < n; i++) {
    ranks[i] = rtp_comm_world_rank(c, i);
    h[i] = hosts[ranks[i]];
  }
  return rtp_mesh_init_1d(m, n, ranks, h);
}

/* ---- layouts ---------------------------------------------------------------------- */

struct rtp_layout rtp_layout_replicated(void) {
  struct rtp_layout l;
  for (int d = 0; d < RTP_MAX_DIMS; d++) {
    l.axis[d] = RTP_LAYOUT_REPLICATED;
    l.groups[d] = 1;
  }
  return l;
}

int rtp_layout_chunk(struct rtp_layout *l, int dim, int axis, int groups) {
  if (!l || dim < 0 || dim >= RTP_MAX_DIMS || axis < 0 || axis > 1 || groups < 1)
    return rtp__error(RTP_EINVAL,
                      "rtp_layout_chunk: dimension %d over axis %d in %d groups (dimensions "
                      "0..%d, axes 0..1, groups >= 1)",
                      dim, axis, groups, RTP_MAX_DIMS - 1);
  for (int d = 0; d < RTP_MAX_DIMS; d++)
    if (d != dim && l->axis[d] == axis)
      return rtp__error(RTP_EINVAL,
                        "rtp_layout_chunk: dimension %d is already chunked over axis %d", d,
                        axis);
  l->axis[dim] = axis;
  l->groups[dim] = groups;
  return RTP_OK;
}

int rtp_layout_param(enum rtp_strategy s, const struct rtp_tensor *param,
                     struct rtp_layout *out) {
  if (!param || !out || (unsigned)s >= RTP_STRATEGY_COUNT)
    return rtp__error(RTP_EINVAL, "rtp_layout_param: NULL tensor or unknown strategy");
  *out = rtp_layout_replicated();
  int outer = rtp__param_split_dim(param);
  if (s == RTP_STRATEGY_RTP || s == RTP_STRATEGY_FSDP)
    return rtp_layout_chunk(out, outer, 0, 1);
  if (s != RTP_STRATEGY_TP) return RTP_OK;
  /* tp's marks live on parameter leaves only (rtp__tp_role) */
  switch (rtp__tp_role(param)) {
    case RTP_TP_COLUMN:
      return rtp_layout_chunk(out, outer, 0, param->op_params[1]);
    case RTP_TP_ROW:
      return rtp_layout_chunk(out, 0, 0, 1);
    default:
      return RTP_OK;
  }
}

int rtp_layout_activation(enum rtp_strategy s, int n_dims, struct rtp_layout *out) {
  if (!out || (unsigned)s >= RTP_STRATEGY_COUNT || n_dims < 1 || n_dims > RTP_MAX_DIMS)
    return rtp__error(RTP_EINVAL, "rtp_layout_activation: %d dimensions or unknown strategy",
                      n_dims);
  *out = rtp_layout_replicated();
  bool own_batch = s == RTP_STRATEGY_DDP || s == RTP_STRATEGY_FSDP || s == RTP_STRATEGY_RTP;
  return own_batch ? rtp_layout_chunk(out, n_dims - 1, 0, 1) : RTP_OK;
}

int rtp_parallel_layout(const struct rtp_parallel *p, const struct rtp_tensor *param,
                        struct rtp_layout *out) {
  if (!p || !param || !out || !(param->flags & RTP_FLAG_PARAM) ||
      rtp__parallel_index(p, param) < 0)
    return rtp__error(RTP_EINVAL, "rtp_parallel_layout: not a parameter of the model");
  if (!rtp_parallel_tensor(p, param))
    return rtp__error(RTP_EINVAL, "rtp_parallel_layout: '%s' belongs to another pipeline stage",
                      param->name);
  int n = p->comm ? rtp_comm_size(p->comm) : 1, rank = p->comm ? rtp_comm_rank(p->comm) : 0;
  /* one rank runs the identity strategy, whatever was asked */
  int rc = rtp_layout_param(n > 1 ? p->strategy : RTP_STRATEGY_NONE, param, out);
  if (rc) return rc;
  int64_t first, len;
  int dim;
  /* A grouped tp column holds several ranges, which rtp_parallel_block does not give: its
   * layout stands on the mark alone. Every other layout must give this rank's block. */
  bool grouped = false;
  for (int d = 0; d < RTP_MAX_DIMS; d++) grouped |= out->groups[d] > 1;
  if (grouped) return RTP_OK;
  if ((rc = rtp_parallel_block(p, param, &first, &len, &dim))) return rc;
  size_t f = 0, l = (size_t)param->ne[dim];
  if (out->axis[dim] == 0) rtp_comm_block((size_t)param->ne[dim], n, rank, &f, &l);
  if ((int64_t)f != first || (int64_t)l != len)
    return rtp__error(
        RTP_ENOSYS,
        "rtp_parallel_layout: rank %d holds rows [%lld, +%lld) of dimension %d of "
        "'%s', not a block of a layout",
        rank, (long long)first, (long long)len, dim, param->name);
  return RTP_OK;
}

/* ---- the planner: slices ---------------------------------------------------------- */

/* How one layout cuts one dimension of ne elements on a mesh. */
struct cut {
  int axis, n, groups; /* n: ranks on the axis (1 when replicated) */
  int64_t part;        /* elements per group */
};

/* The block (rank coordinate on the axis) that holds element x: rtp_comm_block's inverse. */
static int cut_block(const struct cut *c, int64_t x) {
  int64_t y = x % c->part, q = c->part / c->n, rem = c->part % c->n;
  return (int)(y < rem * (q + 1) ? y / (q + 1) : rem + (y - rem * (q + 1)) / q);
}

static int64_t *cut_points(const struct cut *c, int64_t *pt) {
  for (int g = 0; g < c->groups; g++)
    for (int i = 0; i < c->n; i++) {
      size_t f, l;
      rtp_comm_block((size_t)c->part, c->n, i, &f, &l);
      *pt++ = g * c->part + (int64_t)f;
    }
  return pt;
}

static int cmp_i64(const void *a, const void *b) {
  int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
  return (x > y) - (x < y);
}

static int check_side(const char *side, const struct rtp_mesh *m, const struct rtp_layout *l,
                      const int64_t *ne, struct cut *cuts) {
  if (!m || !l) return rtp__error(RTP_EINVAL, "rtp_reshard_plan: NULL %s mesh or layout", side);
  if (m->n_axes < 1 || m->n_axes > 2 || m->shape[0] < 1 || m->shape[1] < 1 ||
      (m->n_axes == 1 && m->shape[1] != 1) || m->shape[0] > RTP_MESH_MAX_RANKS / m->shape[1])
    return rtp__error(RTP_EINVAL, "rtp_reshard_plan: the %s mesh is %d-D of %d x %d ranks",
                      side, m->n_axes, m->shape[0], m->shape[1]);
  for (int i = 0; i < m->shape[0] * m->shape[1]; i++)
    if (m->ranks[i] < 0 || m->hosts[i] < 0 || m->hosts[i] >= RTP_MESH_MAX_RANKS)
      return rtp__error(RTP_EINVAL, "rtp_reshard_plan: the %s mesh has rank %d on host %d",
                        side, m->ranks[i], m->hosts[i]);
  for (int d = 0; d < RTP_MAX_DIMS; d++) {
    int a = l->axis[d], g = l->groups[d];
    bool chunked = a != RTP_LAYOUT_REPLICATED;
    if ((chunked && (a < 0 || a >= m->n_axes)) || g < 1 || (!chunked && g != 1) ||
        ne[d] % g != 0)
      return rtp__error(RTP_EINVAL,
                        "rtp_reshard_plan: the %s layout chunks dimension %d (%lld elements) "
                        "over axis %d in %d groups on a %d-D mesh",
                        side, d, (long long)ne[d], a, g, m->n_axes);
    for (int e = 0; e < d && chunked; e++)
      if (l->axis[e] == a)
        return rtp__error(RTP_EINVAL,
                          "rtp_reshard_plan: the %s layout chunks dimensions %d and %d over "
                          "axis %d",
                          side, e, d, a);
    cuts[d] = (struct cut){a, chunked ? m->shape[a] : 1, g, ne[d] / g};
    /* the planner lists every block's first element */
    if ((uint64_t)g * (uint64_t)cuts[d].n > PLAN_MAX_POOL)
      return rtp__error(RTP_EINVAL,
                        "rtp_reshard_plan: the %s layout cuts dimension %d in %d x %d blocks",
                        side, d, g, cuts[d].n);
  }
  return RTP_OK;
}

/* Ranks of m whose coordinate on each axis is want[axis] (-1: any), in mesh order. */
static int mesh_select(const struct rtp_mesh *m, const int want[2], int *ranks, int *hosts) {
  int k = 0;
  for (int i = 0; i < m->shape[0]; i++)
    for (int j = 0; j < m->shape[1]; j++) {
      if ((want[0] >= 0 && want[0] != i) || (want[1] >= 0 && want[1] != j)) continue;
      ranks[k] = m->ranks[i * m->shape[1] + j];
      hosts[k++] = m->hosts[i * m->shape[1] + j];
    }
  return k;
}

/* ---- the planner: senders --------------------------------------------------------- */

/* The planner's scratch, beside the plan. */
struct planner {
  struct rtp_reshard *r;
  int *pool;       /* the ranks the slices list (the plan's) */
  int *pool_hosts; /* the host of each */
  int *shost;      /* per slice: its sender's host (-1: no sender) */
  int *last;       /* per slice: the last host of its chain, which forwards nothing (-1: the
                      broadcast crosses no NIC) */
  int *stamp, now; /* per host: == now when dest_hosts has seen it in this call */
  int *busy;       /* per host: the last round it takes part in, plus 1 */
};

static const int *hosts_of(const struct planner *pl, const int *ranks) {
  return pl->pool_hosts + (ranks - pl->pool);
}

/* The hosts other than the sender's (hs) that slice s's broadcast reaches, into out. */
static int dest_hosts(struct planner *pl, const struct rtp_reshard_slice *s, int hs, int *out) {
  const int *h = hosts_of(pl, s->receivers);
  int k = 0;
  pl->now++;
  pl->stamp[hs] = pl->now;
  for (int i = s->n_local; i < s->n_receivers; i++)
    if (pl->stamp[h[i]] != pl->now) {
      pl->stamp[h[i]] = pl->now;
      out[k++] = h[i];
    }
  return k;
}

static uint64_t max_u64(uint64_t a, uint64_t b) {
  return a > b ? a : b;
}

/* The chain hs -> D[0] -> ... ends at the host that has sent most so far, so that the one
 * host that forwards nothing is the busiest. */
static int chain_last(const uint64_t *sent, const int *D, int nd) {
  int last = D[0];
  for (int i = 1; i < nd; i++)
    if (sent[D[i]] > sent[last] || (sent[D[i]] == sent[last] && D[i] > last)) last = D[i];
  return last;
}

/* The busiest NIC (either way) once b bytes go from hs along the chain through D. */
static uint64_t max_after(const uint64_t *sent, const uint64_t *recv, uint64_t cur, int hs,
                          const int *D, int nd, int last, uint64_t b) {
  cur = max_u64(cur, sent[hs] + b);
  for (int i = 0; i < nd; i++)
    cur = max_u64(cur, max_u64(recv[D[i]] + b, sent[D[i]] + (D[i] == last ? 0 : b)));
  return cur;
}

/* Senders for every slice that has receivers to reach: the first holder, or greedily in
 * decreasing size (largest first, as list scheduling does) the holder that leaves the
 * busiest NIC least loaded, then the one that puts the fewest hosts on the chain (a
 * holder on a receiver's host), then the one whose host has sent least (which spreads the
 * load of the hosts below the busiest). Fills r's NIC counts; returns the busiest NIC's
 * bytes. */
static uint64_t choose_senders(struct planner *pl, const int *order, bool first_owner, int *D) {
  struct rtp_reshard *r = pl->r;
  memset(r->nic_sent, 0, sizeof(uint64_t) * (size_t)r->n_hosts);
  memset(r->nic_recv, 0, sizeof(uint64_t) * (size_t)r->n_hosts);
  uint64_t cur = 0;
  for (int k = 0; k < r->n_slices; k++) {
    struct rtp_reshard_slice *s = &r->slices[order[k]];
    s->sender = -1;
    pl->shost[order[k]] = pl->last[order[k]] = -1;
    if (s->n_local == s->n_receivers) continue;
    const int *hh = hosts_of(pl, s->holders);
    int best = 0, best_nd = 0;
    uint64_t best_max = UINT64_MAX, best_own = UINT64_MAX;
    for (int c = 0; c < (first_owner ? 1 : s->n_holders); c++) {
      int nd = dest_hosts(pl, s, hh[c], D);
      uint64_t m = nd ? max_after(r->nic_sent, r->nic_recv, cur, hh[c], D, nd,
                                  chain_last(r->nic_sent, D, nd), s->nbytes)
                      : cur;
      uint64_t own = r->nic_sent[hh[c]]; /* last: the least loaded sender's host */
      if (m < best_max ||
          (m == best_max && (nd < best_nd || (nd == best_nd && own < best_own)))) {
        best = c;
        best_max = m;
        best_nd = nd;
        best_own = own;
      }
    }
    s->sender = s->holders[best];
    pl->shost[order[k]] = hh[best];
    int nd = dest_hosts(pl, s, hh[best], D);
    if (!nd) continue;
    int last = chain_last(r->nic_sent, D, nd);
    pl->last[order[k]] = last;
    r->nic_sent[hh[best]] += s->nbytes;
    for (int i = 0; i < nd; i++) {
      r->nic_recv[D[i]] += s->nbytes;
      if (D[i] != last) r->nic_sent[D[i]] += s->nbytes;
    }
    cur = best_max;
  }
  return cur;
}

/* Receivers that hold the slice first (local copies), then the chain: the sender's host's
 * ranks, the other hosts in increasing id, the chain's last host at the end. */
static void order_receivers(struct planner *pl, int c) {
  struct rtp_reshard_slice *s = &pl->r->slices[c];
  int *rk = pl->pool + (s->receivers - pl->pool);
  int *h = pl->pool_hosts + (s->receivers - pl->pool);
  int hs = pl->shost[c], last = pl->last[c];
  /* insertion sort: receivers are few */
  for (int i = 1; i < s->n_receivers; i++)
    for (int j = i; j > 0; j--) {
      int a = j - 1, b = j;
      bool la = a < s->n_local, lb = b < s->n_local;
      long ka = la ? -1 : h[a] == hs ? 0 : h[a] == last ? 2L * RTP_MESH_MAX_RANKS : 1 + h[a];
      long kb = lb ? -1 : h[b] == hs ? 0 : h[b] == last ? 2L * RTP_MESH_MAX_RANKS : 1 + h[b];
      if (ka < kb || (ka == kb && rk[a] <= rk[b])) break;
      int t = rk[a];
      rk[a] = rk[b];
      rk[b] = t;
      t = h[a];
      h[a] = h[b];
      h[b] = t;
    }
}

/* ---- the planner: rounds ---------------------------------------------------------- */

/* Whether slice x goes before slice y: larger first, then by index. */
static bool size_before(const struct rtp_reshard_slice *s, int x, int y) {
  return s[x].nbytes != s[y].nbytes ? s[x].nbytes > s[y].nbytes : x < y;
}

/* Sorts idx[0..n) by size_before: a merge sort, as qsort has no context argument in C11
 * and the order must not depend on the C library's qsort (every rank plans alike). */
static void sort_by_size(int *idx, int *tmp, int n, const struct rtp_reshard_slice *s) {
  if (n < 2) return;
  int h = n / 2;
  sort_by_size(idx, tmp, h, s);
  sort_by_size(idx + h, tmp, n - h, s);
  int i = 0, j = h, k = 0;
  while (i < h || j < n)
    tmp[k++] = j >= n || (i < h && !size_before(s, idx[j], idx[i])) ? idx[i++] : idx[j++];
  memcpy(idx, tmp, sizeof(int) * (size_t)n);
}

/* Rounds of broadcasts with no host in common, which can run at once (the paper's greedy):
 * each round takes, largest first, every remaining broadcast whose hosts are all free. */
static void make_rounds(struct planner *pl, const int *order, int *D, double bw) {
  struct rtp_reshard *r = pl->r;
  int left = 0;
  for (int k = 0; k < r->n_slices; k++) {
    r->slices[k].round = -1;
    left += pl->last[k] >= 0;
  }
  for (int round = 0; left > 0; round++) {
    uint64_t longest = 0;
    for (int k = 0; k < r->n_slices; k++) {
      struct rtp_reshard_slice *s = &r->slices[order[k]];
      if (pl->last[order[k]] < 0 || s->round >= 0) continue;
      int hs = pl->shost[order[k]], nd = dest_hosts(pl, s, hs, D);
      bool ok = pl->busy[hs] != round + 1;
      for (int i = 0; i < nd && ok; i++) ok = pl->busy[D[i]] != round + 1;
      if (!ok) continue;
      pl->busy[hs] = round + 1;
      for (int i = 0; i < nd; i++) pl->busy[D[i]] = round + 1;
      s->round = round;
      longest = max_u64(longest, s->nbytes);
      left--;
    }
    r->n_rounds = round + 1;
    r->makespan_s += (double)longest / bw;
  }
}

/* ---- the planner ------------------------------------------------------------------ */

static size_t align8(size_t n) {
  return (n + 7) & ~(size_t)7;
}

int rtp_reshard_plan(const struct rtp_reshard_params *p, struct rtp_reshard **out) {
  if (!p || !out) return rtp__error(RTP_EINVAL, "rtp_reshard_plan: NULL params or out");
  *out = NULL;
  struct cut cs[RTP_MAX_DIMS], cd[RTP_MAX_DIMS];
  for (int d = 0; d < RTP_MAX_DIMS; d++)
    if (p->ne[d] < 1)
      return rtp__error(RTP_EINVAL, "rtp_reshard_plan: ne[%d] = %lld (>= 1)", d,
                        (long long)p->ne[d]);
  uint64_t total = p->elem_size;
  for (int d = 0; d < RTP_MAX_DIMS; d++)
    total = total > UINT64_MAX / (uint64_t)p->ne[d] ? 0 : total * (uint64_t)p->ne[d];
  if (total == 0 || total > SIZE_MAX || !(p->bandwidth >= 0))
    return rtp__error(RTP_EINVAL,
                      "rtp_reshard_plan: %zu-byte elements, a tensor of %lld x %lld x %lld x "
                      "%lld, bandwidth %g",
                      p->elem_size, (long long)p->ne[0], (long long)p->ne[1],
                      (long long)p->ne[2], (long long)p->ne[3], p->bandwidth);
  int rc = check_side("source", p->src_mesh, p->src, p->ne, cs);
  if (!rc) rc = check_side("destination", p->dst_mesh, p->dst, p->ne, cd);
  if (rc) return rc;
  const struct rtp_mesh *ma = p->src_mesh, *mb = p->dst_mesh;
  int na = ma->shape[0] * ma->shape[1], nb = mb->shape[0] * mb->shape[1], n_hosts = 0;
  for (int i = 0; i < na; i++) {
    n_hosts = n_hosts > ma->hosts[i] + 1 ? n_hosts : ma->hosts[i] + 1;
    for (int j = 0; j < i; j++)
      if (ma->ranks[i] == ma->ranks[j])
        return rtp__error(RTP_EINVAL, "rtp_reshard_plan: rank %d twice in the source mesh",
                          ma->ranks[i]);
  }
  for (int i = 0; i < nb; i++) {
    n_hosts = n_hosts > mb->hosts[i] + 1 ? n_hosts : mb->hosts[i] + 1;
    for (int j = 0; j < i; j++)
      if (mb->ranks[i] == mb->ranks[j])
        return rtp__error(RTP_EINVAL, "rtp_reshard_plan: rank %d twice in the destination mesh",
                          mb->ranks[i]);
    for (int j = 0; j < na; j++)
      if (ma->ranks[j] == mb->ranks[i] && ma->hosts[j] != mb->hosts[i])
        return rtp__error(RTP_EINVAL,
                          "rtp_reshard_plan: rank %d is on host %d in the source mesh and %d "
                          "in the destination mesh",
                          mb->ranks[i], ma->hosts[j], mb->hosts[i]);
  }

  /* Per dimension, the common refinement of both layouts' blocks: each interval lies in
   * one source block and one destination block, so a cell (one interval per dimension)
   * has one set of holders and one of receivers. */
  int64_t *pts[RTP_MAX_DIMS] = {0};
  int npts[RTP_MAX_DIMS];
  size_t cells = 1;
  rc = RTP_OK;
  for (int d = 0; d < RTP_MAX_DIMS && !rc; d++) {
    size_t cap = (size_t)cs[d].groups * (size_t)cs[d].n + (size_t)cd[d].groups * cd[d].n + 1;
    if (!(pts[d] = malloc(sizeof(int64_t) * cap))) {
      rc = rtp__error(RTP_ENOMEM, "rtp_reshard_plan: out of memory");
      break;
    }
    int64_t *e = cut_points(&cd[d], cut_points(&cs[d], pts[d]));
    *e++ = p->ne[d];
    qsort(pts[d], (size_t)(e - pts[d]), sizeof(int64_t), cmp_i64);
    int k = 0;
    for (int64_t *q = pts[d]; q < e; q++)
      if (k == 0 || pts[d][k - 1] != *q) pts[d][k++] = *q;
    npts[d] = k;
    if ((size_t)(k - 1) > PLAN_MAX_POOL / cells)
      rc = rtp__error(RTP_EINVAL, "rtp_reshard_plan: more than %u slices", PLAN_MAX_POOL);
    cells *= (size_t)(k - 1);
  }
  int rep_a = na, rep_b = nb; /* holders and receivers per cell: the free axes' ranks */
  for (int d = 0; d < RTP_MAX_DIMS; d++) {
    rep_a /= cs[d].n;
    rep_b /= cd[d].n;
  }
  if (!rc && cells * (size_t)(rep_a + rep_b) > PLAN_MAX_POOL)
    rc = rtp__error(RTP_EINVAL, "rtp_reshard_plan: %zu slices of %d ranks: more than %u", cells,
                    rep_a + rep_b, PLAN_MAX_POOL);
  size_t n_pool = cells * (size_t)(rep_a + rep_b);
  size_t o_sl = align8(sizeof(struct rtp_reshard));
  size_t o_nic = o_sl + align8(sizeof(struct rtp_reshard_slice) * cells);
  size_t o_pool = o_nic + sizeof(uint64_t) * 2 * (size_t)n_hosts;
  struct rtp_reshard *r = rc ? NULL : calloc(1, o_pool + sizeof(int) * n_pool);
  struct planner pl = {r, NULL, NULL, NULL, NULL, NULL, 0, NULL};
  int *order = NULL, *tmp = NULL, *D = NULL;
  if (r) {
    pl.pool_hosts = malloc(sizeof(int) * (n_pool + 1));
    pl.shost = malloc(sizeof(int) * 2 * (cells + 1));
    pl.last = pl.shost + cells + 1;
    pl.stamp = calloc(2 * (size_t)n_hosts, sizeof(int));
    pl.busy = pl.stamp + n_hosts;
    order = malloc(sizeof(int) * (cells + 1));
    tmp = malloc(sizeof(int) * (cells + 1));
    D = malloc(sizeof(int) * (size_t)n_hosts);
  }
  if (!rc && (!r || !pl.pool_hosts || !pl.shost || !pl.stamp || !order || !tmp || !D))
    rc = rtp__error(RTP_ENOMEM, "rtp_reshard_plan: out of memory for %zu slices", cells);
  if (!rc) {
    r->slices = (struct rtp_reshard_slice *)(void *)((char *)r + o_sl);
    r->nic_sent = (uint64_t *)(void *)((char *)r + o_nic);
    r->nic_recv = r->nic_sent + n_hosts;
    r->n_hosts = n_hosts;
    r->n_slices = (int)cells;
    int *pool = (int *)(void *)((char *)r + o_pool);
    pl.pool = pool;
    int at[RTP_MAX_DIMS] = {0}; /* the cell's interval in each dimension */
    for (size_t c = 0; c < cells; c++) {
      struct rtp_reshard_slice *s = &r->slices[c];
      int want_a[2] = {-1, -1}, want_b[2] = {-1, -1};
      s->nbytes = p->elem_size;
      for (int d = 0; d < RTP_MAX_DIMS; d++) {
        s->first[d] = pts[d][at[d]];
        s->len[d] = pts[d][at[d] + 1] - s->first[d];
        s->nbytes *= (size_t)s->len[d];
        if (cs[d].axis >= 0) want_a[cs[d].axis] = cut_block(&cs[d], s->first[d]);
        if (cd[d].axis >= 0) want_b[cd[d].axis] = cut_block(&cd[d], s->first[d]);
      }
      int *hp = pl.pool_hosts + (pool - pl.pool);
      s->holders = pool;
      s->n_holders = mesh_select(ma, want_a, pool, hp);
      s->receivers = pool + s->n_holders;
      int *rk = pool + s->n_holders, *rh = hp + s->n_holders;
      s->n_receivers = mesh_select(mb, want_b, rk, rh);
      pool += s->n_holders + s->n_receivers;
      /* receivers that hold the slice copy it locally: move them to the front */
      for (int i = 0; i < s->n_receivers; i++)
        for (int j = 0; j < s->n_holders; j++)
          if (rk[i] == s->holders[j]) {
            int t = rk[i];
            rk[i] = rk[s->n_local];
            rk[s->n_local] = t;
            t = rh[i];
            rh[i] = rh[s->n_local];
            rh[s->n_local++] = t;
            break;
          }
      order[c] = (int)c;
      for (int d = 0; d < RTP_MAX_DIMS && ++at[d] == npts[d] - 1; d++) at[d] = 0;
    }
    sort_by_size(order, tmp, (int)cells, r->slices);
    uint64_t base = choose_senders(&pl, order, true, D);
    if (!p->first_owner && choose_senders(&pl, order, false, D) > base)
      choose_senders(&pl, order, true, D); /* the greedy lost to the baseline: keep that */
    double bw = p->bandwidth > 0 ? p->bandwidth : 125e6;
    for (int h = 0; h < n_hosts; h++)
      r->nic_max = max_u64(r->nic_max, max_u64(r->nic_sent[h], r->nic_recv[h]));
    r->lower_bound_s = (double)r->nic_max / bw;
    for (size_t c = 0; c < cells; c++)
      if (r->slices[c].sender >= 0) order_receivers(&pl, (int)c);
    make_rounds(&pl, order, D, bw);
  }
  for (int d = 0; d < RTP_MAX_DIMS; d++) free(pts[d]);
  free(pl.pool_hosts);
  free(pl.shost);
  free(pl.stamp);
  free(order);
  free(tmp);
  free(D);
  if (rc) {
    free(r);
    return rc;
  }
  *out = r;
  return RTP_OK;
}

void rtp_reshard_free(struct rtp_reshard *r) {
  free(r);
}

struct rtp_reshard_params rtp__reshard_params_pair(struct rtp_mesh mesh[2],
                                                   struct rtp_layout lay[2], const int64_t *ne,
                                                   size_t elem_size) {
  struct rtp_reshard_params rp = {.src_mesh = &mesh[0],
                                  .dst_mesh = &mesh[1],
                                  .src = &lay[0],
                                  .dst = &lay[1],
                                  .elem_size = elem_size};
  memcpy(rp.ne, ne, sizeof(rp.ne));
  return rp;
}
