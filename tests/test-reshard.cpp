// test-reshard.cpp - cross-mesh resharding's layouts and planner (rtp-reshard.c), pure
// functions: every pair of a suite of layouts on 1-D and 2-D meshes of 1..4 ranks on 1..2
// hosts is planned and checked element by element against the layouts' own definition
// (rtp_comm_block), and a few small plans against byte counts worked out by hand.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "rtp.h"
#include "test-util.h"

namespace {

constexpr double kBw = 1e9;

rtp_mesh mesh_1d(std::vector<int> ranks, std::vector<int> hosts) {
  rtp_mesh m;
  EXPECT_EQ(rtp_mesh_init_1d(&m, (int)ranks.size(), ranks.data(), hosts.data()), RTP_OK);
  return m;
}

rtp_mesh mesh_2d(int rows, int cols, std::vector<int> ranks, std::vector<int> hosts) {
  rtp_mesh m;
  EXPECT_EQ(rtp_mesh_init_2d(&m, rows, cols, ranks.data(), hosts.data()), RTP_OK);
  return m;
}

rtp_layout chunked(std::vector<std::vector<int>> dim_axis_groups) {
  rtp_layout l = rtp_layout_replicated();
  for (auto &d : dim_axis_groups) EXPECT_EQ(rtp_layout_chunk(&l, d[0], d[1], d[2]), RTP_OK);
  return l;
}

int n_ranks(const rtp_mesh &m) {
  return m.shape[0] * m.shape[1];
}

// Whether the rank at mesh position pos holds element x, from the layout's definition.
bool holds(const rtp_mesh &m, const rtp_layout &l, const int64_t *ne, int pos,
           const int64_t *x) {
  int coord[2] = {pos / m.shape[1], pos % m.shape[1]};
  for (int d = 0; d < RTP_MAX_DIMS; d++) {
    if (l.axis[d] == RTP_LAYOUT_REPLICATED) continue;
    int64_t part = ne[d] / l.groups[d], y = x[d] % part;
    size_t f, len;
    rtp_comm_block((size_t)part, m.shape[l.axis[d]], coord[l.axis[d]], &f, &len);
    if (y < (int64_t)f || y >= (int64_t)(f + len)) return false;
  }
  return true;
}

int64_t n_elements(const int64_t *ne) {
  return ne[0] * ne[1] * ne[2] * ne[3];
}

void coords(const int64_t *ne, int64_t i, int64_t *x) {
  for (int d = 0; d < RTP_MAX_DIMS; d++) {
    x[d] = i % ne[d];
    i /= ne[d];
  }
}

bool in_slice(const rtp_reshard_slice &s, const int64_t *x) {
  for (int d = 0; d < RTP_MAX_DIMS; d++)
    if (x[d] < s.first[d] || x[d] >= s.first[d] + s.len[d]) return false;
  return true;
}

int host_of(const rtp_mesh &a, const rtp_mesh &b, int rank) {
  for (int i = 0; i < n_ranks(a); i++)
    if (a.ranks[i] == rank) return a.hosts[i];
  for (int i = 0; i < n_ranks(b); i++)
    if (b.ranks[i] == rank) return b.hosts[i];
  return -1;
}

// The hosts a slice's broadcast visits, in chain order: the sender's, then its receivers'.
std::vector<int> chain_hosts(const rtp_reshard_params &p, const rtp_reshard_slice &s) {
  std::vector<int> h = {host_of(*p.src_mesh, *p.dst_mesh, s.sender)};
  for (int i = s.n_local; i < s.n_receivers; i++) {
    int hr = host_of(*p.src_mesh, *p.dst_mesh, s.receivers[i]);
    if (std::find(h.begin(), h.end(), hr) == h.end()) h.push_back(hr);
  }
  return h;
}

// Everything a plan must satisfy, checked from the layouts' definition.
void check_plan(const rtp_reshard_params &p, const rtp_reshard *r, const std::string &what) {
  SCOPED_TRACE(what);
  const rtp_mesh &ma = *p.src_mesh, &mb = *p.dst_mesh;
  int64_t n = n_elements(p.ne), x[RTP_MAX_DIMS];
  // Each receiving rank gets every element it needs exactly once, and nothing else.
  for (int pos = 0; pos < n_ranks(mb); pos++) {
    std::vector<int> got(n, 0);
    for (int k = 0; k < r->n_slices; k++) {
      const rtp_reshard_slice &s = r->slices[k];
      if (std::find(s.receivers, s.receivers + s.n_receivers, mb.ranks[pos]) ==
          s.receivers + s.n_receivers)
        continue;
      for (int64_t i = 0; i < n; i++) got[i] += (coords(p.ne, i, x), in_slice(s, x));
    }
    for (int64_t i = 0; i < n; i++) {
      coords(p.ne, i, x);
      ASSERT_EQ(got[i], holds(mb, *p.dst, p.ne, pos, x) ? 1 : 0)
          << "rank " << mb.ranks[pos] << " element " << i;
    }
  }
  std::vector<uint64_t> sent(r->n_hosts, 0), recv(r->n_hosts, 0);
  std::vector<std::vector<std::set<int>>> rounds(r->n_rounds);
  std::vector<size_t> longest(r->n_rounds, 0);
  for (int k = 0; k < r->n_slices; k++) {
    const rtp_reshard_slice &s = r->slices[k];
    size_t bytes = p.elem_size;
    for (int d = 0; d < RTP_MAX_DIMS; d++) bytes *= (size_t)s.len[d];
    ASSERT_EQ(s.nbytes, bytes);
    // holders: exactly the source ranks that hold every element of the slice
    std::set<int> holders(s.holders, s.holders + s.n_holders);
    ASSERT_EQ(holders.size(), (size_t)s.n_holders);
    for (int pos = 0; pos < n_ranks(ma); pos++) {
      bool all = true;
      for (int64_t i = 0; i < n; i++)
        if (coords(p.ne, i, x), in_slice(s, x)) all &= holds(ma, *p.src, p.ne, pos, x);
      ASSERT_EQ(all, holders.count(ma.ranks[pos]) == 1) << "slice " << k;
    }
    // local copies are receivers that hold it; the others come from a holder
    for (int i = 0; i < s.n_receivers; i++)
      ASSERT_EQ(holders.count(s.receivers[i]) == 1, i < s.n_local) << "slice " << k;
    if (s.n_local == s.n_receivers) {
      ASSERT_EQ(s.sender, -1);
      ASSERT_EQ(s.round, -1);
      continue;
    }
    ASSERT_EQ(holders.count(s.sender), 1u) << "slice " << k;
    std::vector<int> h = chain_hosts(p, s);
    for (size_t i = 0; i + 1 < h.size(); i++) {
      sent[h[i]] += s.nbytes;
      recv[h[i + 1]] += s.nbytes;
    }
    ASSERT_EQ(s.round >= 0, h.size() > 1) << "slice " << k;
    if (s.round < 0) continue;
    ASSERT_LT(s.round, r->n_rounds);
    rounds[s.round].push_back(std::set<int>(h.begin(), h.end()));
    longest[s.round] = std::max(longest[s.round], s.nbytes);
  }
  uint64_t nic_max = 0;
  for (int h = 0; h < r->n_hosts; h++) {
    EXPECT_EQ(r->nic_sent[h], sent[h]) << "host " << h;
    EXPECT_EQ(r->nic_recv[h], recv[h]) << "host " << h;
    nic_max = std::max({nic_max, sent[h], recv[h]});
  }
  EXPECT_EQ(r->nic_max, nic_max);
  // rounds: none empty, their broadcasts' host sets pairwise disjoint
  double makespan = 0;
  for (int q = 0; q < r->n_rounds; q++) {
    ASSERT_FALSE(rounds[q].empty()) << "round " << q;
    std::set<int> seen;
    for (auto &hs : rounds[q])
      for (int h : hs) ASSERT_TRUE(seen.insert(h).second) << "host " << h << " round " << q;
    makespan += (double)longest[q] / kBw;
  }
  EXPECT_DOUBLE_EQ(r->makespan_s, makespan);
  EXPECT_DOUBLE_EQ(r->lower_bound_s, (double)nic_max / kBw);
  EXPECT_GE(r->makespan_s, r->lower_bound_s * (1 - 1e-12));
}

rtp_reshard_params params(const rtp_mesh &a, const rtp_layout &la, const rtp_mesh &b,
                          const rtp_layout &lb, std::vector<int64_t> ne, size_t elem = 4) {
  rtp_reshard_params p{};
  p.src_mesh = &a;
  p.dst_mesh = &b;
  p.src = &la;
  p.dst = &lb;
  for (int d = 0; d < RTP_MAX_DIMS; d++) p.ne[d] = d < (int)ne.size() ? ne[d] : 1;
  p.elem_size = elem;
  p.bandwidth = kBw;
  return p;
}

struct Plan {
  rtp_reshard *r = nullptr;
  explicit Plan(const rtp_reshard_params &p) {
    EXPECT_EQ(rtp_reshard_plan(&p, &r), RTP_OK) << rtp_last_error();
  }
  ~Plan() {
    rtp_reshard_free(r);
  }
  Plan(const Plan &) = delete;
  Plan &operator=(const Plan &) = delete;
};

// ---- the suite of layout pairs ----------------------------------------------------------

struct Side {
  std::string name;
  rtp_mesh mesh;
  rtp_layout layout;
};

// Meshes of 1..4 ranks (1-D, and 2-D 1x2, 2x1, 2x2) numbered from `base`, each rank on host
// host(rank); on each, every layout of a {5, 6, 3} tensor: replicated, each dimension
// chunked (dimension 1 also in 2 and 3 groups), and on 2-D meshes two dimensions at once.
std::vector<Side> sides(int base, int (*host)(int)) {
  std::vector<Side> out;
  auto add_mesh = [&](const std::string &mname, const rtp_mesh &m) {
    out.push_back({mname + " replicated", m, rtp_layout_replicated()});
    for (int axis = 0; axis < m.n_axes; axis++)
      for (int d = 0; d < 3; d++) {
        std::string a = " d" + std::to_string(d) + "/a" + std::to_string(axis);
        out.push_back({mname + a, m, chunked({{d, axis, 1}})});
        if (d == 1) out.push_back({mname + a + "x2", m, chunked({{d, axis, 2}})});
        if (d == 1) out.push_back({mname + a + "x3", m, chunked({{d, axis, 3}})});
      }
    if (m.n_axes == 2) {
      out.push_back({mname + " d0/a0 d1/a1", m, chunked({{0, 0, 1}, {1, 1, 1}})});
      out.push_back({mname + " d2/a0 d0/a1", m, chunked({{2, 0, 1}, {0, 1, 1}})});
      out.push_back({mname + " d1/a1x3 d2/a0", m, chunked({{1, 1, 3}, {2, 0, 1}})});
    }
  };
  for (int n = 1; n <= 4; n++) {
    std::vector<int> ranks, hosts;
    for (int i = 0; i < n; i++) {
      ranks.push_back(base + i);
      hosts.push_back(host(base + i));
    }
    add_mesh(std::to_string(n), mesh_1d(ranks, hosts));
    if (n == 2) {
      add_mesh("1x2", mesh_2d(1, 2, ranks, hosts));
      add_mesh("2x1", mesh_2d(2, 1, ranks, hosts));
    }
    if (n == 4) add_mesh("2x2", mesh_2d(2, 2, ranks, hosts));
  }
  return out;
}

int one_host(int) {
  return 0;
}
int two_per_host(int rank) {
  return (rank / 2) % 2;
}
int alternating(int rank) {
  return rank % 2;
}

// Every pair: source ranks 0.., destination ranks from 0 (the same ranks), 2 (overlapping)
// or 4 (others), on one host, two ranks per host, or alternating hosts.
TEST(ReshardSuite, EveryPairCoversEachReceiverOnce) {
  const std::vector<int64_t> ne = {5, 6, 3};
  int plans = 0;
  for (auto host : {one_host, two_per_host, alternating})
    for (int base : {0, 2, 4}) {
      std::vector<Side> src = sides(0, host), dst = sides(base, host);
      for (const Side &a : src)
        for (const Side &b : dst) {
          rtp_reshard_params p = params(a.mesh, a.layout, b.mesh, b.layout, ne);
          std::string what = a.name + " -> " + b.name + " (base " + std::to_string(base) + ")";
          Plan bal(p);
          ASSERT_NE(bal.r, nullptr) << what;
          check_plan(p, bal.r, what);
          p.first_owner = true;
          Plan first(p);
          ASSERT_NE(first.r, nullptr) << what;
          check_plan(p, first.r, what + " first owner");
          ASSERT_LE(bal.r->nic_max, first.r->nic_max) << what;
          if (HasFatalFailure()) return;
          plans++;
        }
    }
  EXPECT_EQ(plans, 9 * 66 * 66);  // 66 layouts on the meshes of each side
}

// The same layout on the same ranks moves nothing: every slice is a local copy.
TEST(ReshardSuite, SameLayoutIsLocalCopies) {
  for (const Side &a : sides(0, two_per_host)) {
    rtp_reshard_params p = params(a.mesh, a.layout, a.mesh, a.layout, {5, 6, 3});
    Plan pl(p);
    ASSERT_NE(pl.r, nullptr);
    check_plan(p, pl.r, a.name);
    EXPECT_EQ(pl.r->nic_max, 0u) << a.name;
    EXPECT_EQ(pl.r->n_rounds, 0) << a.name;
    EXPECT_EQ(pl.r->makespan_s, 0.0) << a.name;
    for (int k = 0; k < pl.r->n_slices; k++) {
      EXPECT_EQ(pl.r->slices[k].sender, -1);
      EXPECT_EQ(pl.r->slices[k].n_local, pl.r->slices[k].n_receivers);
    }
  }
}

// ---- small plans worked out by hand ------------------------------------------------------

// One rank broadcasts a 64-byte tensor to 4 ranks on 2 hosts: the chain crosses one NIC
// once (host 0 -> host 1), whatever the number of receivers behind it.
TEST(ReshardByHand, OneToManyCrossesEachNicOnce) {
  rtp_mesh a = mesh_1d({0}, {0}), b = mesh_1d({1, 2, 3, 4}, {0, 0, 1, 1});
  rtp_layout rep = rtp_layout_replicated();
  rtp_reshard_params p = params(a, rep, b, rep, {4, 4});
  Plan pl(p);
  ASSERT_NE(pl.r, nullptr);
  check_plan(p, pl.r, "1 to 4");
  ASSERT_EQ(pl.r->n_slices, 1);
  const rtp_reshard_slice &s = pl.r->slices[0];
  EXPECT_EQ(s.sender, 0);
  EXPECT_EQ(s.n_local, 0);
  EXPECT_EQ(std::vector<int>(s.receivers, s.receivers + 4), (std::vector<int>{1, 2, 3, 4}));
  EXPECT_EQ(pl.r->nic_sent[0], 64u);
  EXPECT_EQ(pl.r->nic_sent[1], 0u);
  EXPECT_EQ(pl.r->nic_recv[0], 0u);
  EXPECT_EQ(pl.r->nic_recv[1], 64u);
  EXPECT_EQ(pl.r->n_rounds, 1);
  EXPECT_DOUBLE_EQ(pl.r->makespan_s, 64 / kBw);
  EXPECT_DOUBLE_EQ(pl.r->lower_bound_s, 64 / kBw);
}

// A tensor replicated on ranks 0 (host 0) and 1 (host 1) goes as 2 row blocks to ranks 2
// (host 2) and 3 (host 3): the first owner sends both halves (32 bytes on host 0's NIC);
// balanced, each source host sends one half (16), and the two broadcasts, with no host in
// common, share one round.
TEST(ReshardByHand, BalanceSplitsTheSendersNics) {
  rtp_mesh a = mesh_1d({0, 1}, {0, 1}), b = mesh_1d({2, 3}, {2, 3});
  rtp_layout rep = rtp_layout_replicated(), rows = chunked({{1, 0, 1}});
  rtp_reshard_params p = params(a, rep, b, rows, {1, 8});
  p.first_owner = true;
  Plan first(p);
  ASSERT_NE(first.r, nullptr);
  check_plan(p, first.r, "first owner");
  EXPECT_EQ(first.r->nic_sent[0], 32u);
  EXPECT_EQ(first.r->nic_sent[1], 0u);
  EXPECT_EQ(first.r->nic_max, 32u);
  EXPECT_EQ(first.r->n_rounds, 2);
  p.first_owner = false;
  Plan bal(p);
  ASSERT_NE(bal.r, nullptr);
  check_plan(p, bal.r, "balanced");
  EXPECT_EQ(bal.r->nic_sent[0], 16u);
  EXPECT_EQ(bal.r->nic_sent[1], 16u);
  EXPECT_EQ(bal.r->nic_recv[2], 16u);
  EXPECT_EQ(bal.r->nic_recv[3], 16u);
  EXPECT_EQ(bal.r->nic_max, 16u);
  EXPECT_EQ(bal.r->n_rounds, 1);
  EXPECT_DOUBLE_EQ(bal.r->makespan_s, 16 / kBw);
  EXPECT_DOUBLE_EQ(bal.r->lower_bound_s, 16 / kBw);
}

// Uneven blocks: rows of a {2, 5} f32 tensor in blocks [0,3) [3,5) on ranks 0, 1 (host 0) to
// blocks [0,2) [2,4) [4,5) on ranks 2, 3, 4 (host 1): the common refinement is rows [0,2)
// [2,3) [3,4) [4,5), 16 + 8 + 8 + 8 bytes, all from host 0 to host 1, one round each.
TEST(ReshardByHand, UnevenBlocksRefineBothLayouts) {
  rtp_mesh a = mesh_1d({0, 1}, {0, 0}), b = mesh_1d({2, 3, 4}, {1, 1, 1});
  rtp_layout rows = chunked({{1, 0, 1}});
  rtp_reshard_params p = params(a, rows, b, rows, {2, 5});
  Plan pl(p);
  ASSERT_NE(pl.r, nullptr);
  check_plan(p, pl.r, "2 to 3 rows");
  ASSERT_EQ(pl.r->n_slices, 4);
  const int64_t first[4] = {0, 2, 3, 4}, len[4] = {2, 1, 1, 1};
  const int sender[4] = {0, 0, 1, 1}, receiver[4] = {2, 3, 3, 4};
  for (int k = 0; k < 4; k++) {
    const rtp_reshard_slice &s = pl.r->slices[k];
    EXPECT_EQ(s.first[1], first[k]);
    EXPECT_EQ(s.len[1], len[k]);
    EXPECT_EQ(s.len[0], 2);
    EXPECT_EQ(s.sender, sender[k]);
    ASSERT_EQ(s.n_receivers, 1);
    EXPECT_EQ(s.receivers[0], receiver[k]);
  }
  EXPECT_EQ(pl.r->nic_sent[0], 40u);
  EXPECT_EQ(pl.r->nic_recv[1], 40u);
  EXPECT_EQ(pl.r->n_rounds, 4);
  EXPECT_DOUBLE_EQ(pl.r->makespan_s, 40 / kBw);
  EXPECT_DOUBLE_EQ(pl.r->lower_bound_s, 40 / kBw);
}

// A 2x2 mesh (rows on hosts 0 and 1) with rows of the tensor chunked over axis 0, gathered
// to every rank: each half is a local copy on its own host's two ranks and crosses one NIC
// for the other two. Both broadcasts use hosts 0 and 1, so they take two rounds: the
// makespan (16 bytes' time) is twice the lower bound (8).
TEST(ReshardByHand, AllGatherOn2DMeshNeedsTwoRounds) {
  rtp_mesh m = mesh_2d(2, 2, {0, 1, 2, 3}, {0, 0, 1, 1});
  rtp_layout rows = chunked({{1, 0, 1}}), rep = rtp_layout_replicated();
  rtp_reshard_params p = params(m, rows, m, rep, {1, 4});
  Plan pl(p);
  ASSERT_NE(pl.r, nullptr);
  check_plan(p, pl.r, "2x2 gather");
  ASSERT_EQ(pl.r->n_slices, 2);
  for (int k = 0; k < 2; k++) {
    const rtp_reshard_slice &s = pl.r->slices[k];
    EXPECT_EQ(s.n_holders, 2);
    EXPECT_EQ(s.n_local, 2);
    EXPECT_EQ(s.n_receivers, 4);
    EXPECT_EQ(s.sender / 2, k);  // from its own host's ranks
  }
  EXPECT_EQ(pl.r->nic_sent[0], 8u);
  EXPECT_EQ(pl.r->nic_sent[1], 8u);
  EXPECT_EQ(pl.r->nic_recv[0], 8u);
  EXPECT_EQ(pl.r->nic_recv[1], 8u);
  EXPECT_EQ(pl.r->n_rounds, 2);
  EXPECT_DOUBLE_EQ(pl.r->makespan_s, 16 / kBw);
  EXPECT_DOUBLE_EQ(pl.r->lower_bound_s, 8 / kBw);
}

// Receivers on the sender's host get the slice without the NIC: a broadcast within one
// host is in no round.
TEST(ReshardByHand, SameHostBroadcastCrossesNoNic) {
  rtp_mesh a = mesh_1d({0}, {0}), b = mesh_1d({1, 2}, {0, 0});
  rtp_layout rep = rtp_layout_replicated();
  rtp_reshard_params p = params(a, rep, b, rep, {3});
  Plan pl(p);
  ASSERT_NE(pl.r, nullptr);
  check_plan(p, pl.r, "same host");
  EXPECT_EQ(pl.r->slices[0].sender, 0);
  EXPECT_EQ(pl.r->slices[0].round, -1);
  EXPECT_EQ(pl.r->nic_max, 0u);
  EXPECT_EQ(pl.r->n_rounds, 0);
}

// ---- layouts of the strategies ----------------------------------------------------------

TEST(ReshardLayout, StrategiesParameters) {
  rtp_init_params ip = {1 << 20, nullptr, true, nullptr, 0};
  rtp_context *ctx = rtp_context_new(ip);
  ASSERT_NE(ctx, nullptr);
  rtp_tensor *qkv = rtp_tensor_new_2d(ctx, RTP_TYPE_F32, 8, 24);  // {in, 3 x out}
  rtp_tensor *proj = rtp_tensor_new_2d(ctx, RTP_TYPE_F32, 8, 8);
  rtp_tensor *ln = rtp_tensor_new_1d(ctx, RTP_TYPE_F32, 8);
  for (rtp_tensor *t : {qkv, proj, ln}) rtp_tensor_set_param(t);
  ASSERT_EQ(rtp_tensor_set_tp(qkv, RTP_TP_COLUMN, 3), RTP_OK);
  ASSERT_EQ(rtp_tensor_set_tp(proj, RTP_TP_ROW, 1), RTP_OK);
  rtp_layout l;
  for (rtp_strategy s : {RTP_STRATEGY_RTP, RTP_STRATEGY_FSDP}) {
    ASSERT_EQ(rtp_layout_param(s, qkv, &l), RTP_OK);
    EXPECT_EQ(l.axis[1], 0);  // the outermost dimension, in one group
    EXPECT_EQ(l.groups[1], 1);
    EXPECT_EQ(l.axis[0], RTP_LAYOUT_REPLICATED);
    ASSERT_EQ(rtp_layout_param(s, ln, &l), RTP_OK);
    EXPECT_EQ(l.axis[0], 0);
  }
  ASSERT_EQ(rtp_layout_param(RTP_STRATEGY_TP, qkv, &l), RTP_OK);
  EXPECT_EQ(l.axis[1], 0);
  EXPECT_EQ(l.groups[1], 3);
  ASSERT_EQ(rtp_layout_param(RTP_STRATEGY_TP, proj, &l), RTP_OK);
  EXPECT_EQ(l.axis[0], 0);  // a row weight: ne[0], the input dimension
  EXPECT_EQ(l.axis[1], RTP_LAYOUT_REPLICATED);
  for (rtp_strategy s : {RTP_STRATEGY_TP, RTP_STRATEGY_DDP, RTP_STRATEGY_NONE}) {
    ASSERT_EQ(rtp_layout_param(s, ln, &l), RTP_OK);
    for (int d = 0; d < RTP_MAX_DIMS; d++) EXPECT_EQ(l.axis[d], RTP_LAYOUT_REPLICATED);
  }
  // activations {C, T, B}: data-parallel ranks hold their own batch, tp ranks all of it
  ASSERT_EQ(rtp_layout_activation(RTP_STRATEGY_DDP, 3, &l), RTP_OK);
  EXPECT_EQ(l.axis[2], 0);
  ASSERT_EQ(rtp_layout_activation(RTP_STRATEGY_TP, 3, &l), RTP_OK);
  EXPECT_EQ(l.axis[2], RTP_LAYOUT_REPLICATED);
  rtp_context_free(ctx);
}

// tp's fused q, k, v (3 groups) on 2 ranks to rtp's row blocks on 3: each rank's q, k and v
// parts are its three ranges of the outermost dimension.
TEST(ReshardLayout, TpColumnToRtpRows) {
  rtp_layout tp = chunked({{1, 0, 3}}), rows = chunked({{1, 0, 1}});
  rtp_mesh a = mesh_1d({0, 1}, {0, 1}), b = mesh_1d({0, 1, 2}, {0, 1, 1});
  rtp_reshard_params p = params(a, tp, b, rows, {4, 12});
  Plan pl(p);
  ASSERT_NE(pl.r, nullptr);
  check_plan(p, pl.r, "tp to rtp");
  // rank 0 of tp holds rows 0-1, 4-5, 8-9; rtp's rank 0 needs 0-3: rows 0-1 stay local
  EXPECT_EQ(pl.r->slices[0].first[1], 0);
  EXPECT_EQ(pl.r->slices[0].len[1], 2);
  EXPECT_EQ(pl.r->slices[0].n_local, 1);
  EXPECT_EQ(pl.r->slices[0].receivers[0], 0);
}

// A plan's parameter layouts, derived on 3 ranks (7 rows: blocks of 3, 2, 2), agree with
// each strategy's: rtp and fsdp row blocks, ddp whole; one process holds it whole.
TEST(ReshardLayout, DerivedFromAPlan) {
  const int world = 3;
  int port = rtptest::free_port();
  auto layout_in = [](rtp_comm *comm, rtp_strategy s, rtp_layout *l) {
    rtp_init_params mip = {1 << 20, nullptr, true, nullptr, 0};
    rtp_context *meta = rtp_context_new(mip);
    rtp_tensor *w = rtp_tensor_set_name(rtp_tensor_new_2d(meta, RTP_TYPE_F32, 4, 7), "w");
    rtp_tensor *x = rtp_tensor_new_2d(meta, RTP_TYPE_F32, 4, 5);
    rtp_tensor_set_param(w);
    rtp_tensor *loss = rtp_sum(meta, rtp_mul_mat(meta, w, x));
    rtp_graph *g = rtp_graph_new(meta, 64);
    rtp_graph_build(g, loss);
    rtp_init_params ip = {1 << 20, nullptr, false, nullptr, 0};
    rtp_context *ctx = rtp_context_new(ip);
    rtp_parallel_params pp{};
    pp.strategy = s;
    pp.comm = comm;
    rtp_parallel *p = rtp_parallel_new(ctx, g, loss, &pp);
    int rc = p ? rtp_parallel_layout(p, w, l) : RTP_EINVAL;
    if (!rc && rtp_parallel_layout(p, x, l) != RTP_EINVAL) rc = RTP_ESTATE;  // not a parameter
    rtp_context_free(ctx);
    rtp_context_free(meta);
    return rc;
  };
  rtp_layout l;
  ASSERT_EQ(layout_in(nullptr, RTP_STRATEGY_RTP, &l), RTP_OK) << rtp_last_error();
  EXPECT_EQ(l.axis[1], RTP_LAYOUT_REPLICATED);  // one process: the identity
  auto res = rtptest::run_procs(world, [&](int r) {
    rtp_comm_params cp = rtptest::params(r, world, port);
    rtp_comm *comm = nullptr;
    if (rtp_comm_init(&cp, &comm)) return 50;
    int code = 0;
    for (rtp_strategy s : {RTP_STRATEGY_RTP, RTP_STRATEGY_FSDP, RTP_STRATEGY_DDP}) {
      rtp_layout got;
      if (layout_in(comm, s, &got)) code = 51;
      int want = s == RTP_STRATEGY_DDP ? RTP_LAYOUT_REPLICATED : 0;
      if (!code && (got.axis[1] != want || got.axis[0] != RTP_LAYOUT_REPLICATED)) code = 52;
    }
    rtp_comm_barrier(comm, nullptr);  // nobody leaves while a rank still talks to it
    rtp_comm_free(comm);
    return code;
  });
  for (int r = 0; r < world; r++) EXPECT_EQ(res[r].code, 0) << "rank " << r;
}

// ---- bad input ----------------------------------------------------------------------------

TEST(ReshardErrors, BadInputIsRefusedWithAMessage) {
  rtp_mesh a = mesh_1d({0, 1}, {0, 0}), b = mesh_1d({1, 2}, {1, 1});
  rtp_layout rep = rtp_layout_replicated(), rows = chunked({{1, 0, 1}});
  rtp_reshard *r = reinterpret_cast<rtp_reshard *>(&a);
  auto expect_einval = [&](rtp_reshard_params p, const char *word) {
    r = reinterpret_cast<rtp_reshard *>(&a);
    EXPECT_EQ(rtp_reshard_plan(&p, &r), RTP_EINVAL) << word;
    EXPECT_EQ(r, nullptr) << word;
    EXPECT_NE(std::string(rtp_last_error()).find(word), std::string::npos) << rtp_last_error();
  };
  expect_einval(params(a, rep, b, rows, {4, 4}), "rank 1 is on host 0");
  rtp_mesh c = mesh_1d({5, 6}, {0, 1});
  expect_einval(params(a, rep, c, rows, {4, 0}), "ne[1] = 0");
  expect_einval(params(a, rep, c, rows, {4, 4}, 0), "element");
  rtp_layout axis1 = chunked({{0, 1, 1}});
  expect_einval(params(a, axis1, c, rows, {4, 4}), "axis 1");
  rtp_layout g3 = chunked({{1, 0, 3}});
  expect_einval(params(a, g3, c, rows, {4, 4}), "3 groups");
  rtp_mesh bad = c;
  bad.n_axes = 3;
  expect_einval(params(a, rep, bad, rows, {4, 4}), "destination mesh");
  bad = c;
  bad.hosts[1] = -1;
  expect_einval(params(a, rep, bad, rows, {4, 4}), "host -1");
  rtp_reshard_params np = params(a, rep, c, rows, {4, 4});
  np.src = nullptr;
  expect_einval(np, "NULL");
  EXPECT_EQ(rtp_reshard_plan(nullptr, &r), RTP_EINVAL);

  rtp_layout l = rtp_layout_replicated();
  EXPECT_EQ(rtp_layout_chunk(&l, 0, 0, 1), RTP_OK);
  EXPECT_EQ(rtp_layout_chunk(&l, 1, 0, 1), RTP_EINVAL);  // axis 0 is taken
  EXPECT_EQ(rtp_layout_chunk(&l, 4, 1, 1), RTP_EINVAL);
  EXPECT_EQ(rtp_layout_chunk(&l, 1, 2, 1), RTP_EINVAL);
  EXPECT_EQ(rtp_layout_chunk(&l, 1, 1, 0), RTP_EINVAL);
  rtp_mesh m;
  int ranks[2] = {3, 3}, hosts[2] = {0, 0};
  EXPECT_EQ(rtp_mesh_init_1d(&m, 2, ranks, hosts), RTP_EINVAL);
  EXPECT_EQ(rtp_mesh_init_1d(&m, 0, nullptr, hosts), RTP_EINVAL);
  EXPECT_EQ(rtp_mesh_init_2d(&m, 16, 17, nullptr, hosts), RTP_EINVAL);
  EXPECT_EQ(rtp_mesh_init_1d(&m, 2, nullptr, nullptr), RTP_EINVAL);
  EXPECT_EQ(rtp_layout_activation(RTP_STRATEGY_DDP, 0, &l), RTP_EINVAL);
  EXPECT_EQ(rtp_layout_param(RTP_STRATEGY_DDP, nullptr, &l), RTP_EINVAL);
  EXPECT_EQ(rtp_parallel_layout(nullptr, nullptr, &l), RTP_EINVAL);
}

}  // namespace
