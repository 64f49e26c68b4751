// test-reshard-exec.cpp - cross-mesh resharding carried out (rtp-reshard-exec.c): ranks
// forked on 127.0.0.1 move tensors from every layout of a suite to every other, over TCP,
// and each checks its destination block bit for bit (NaN payloads and -0 included) against
// the layouts' own definition (rtp_comm_block); a rank that dies mid-reshard fails the
// others, naming it, within seconds.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "rtp.h"
#include "test-util.h"

using namespace rtptest;

namespace {

struct Side {
  std::string name;
  rtp_mesh mesh;
  rtp_layout layout;
};

int n_ranks(const rtp_mesh &m) {
  return m.shape[0] * m.shape[1];
}

rtp_layout chunked(std::vector<std::vector<int>> dim_axis_groups) {
  rtp_layout l = rtp_layout_replicated();
  for (auto &d : dim_axis_groups) EXPECT_EQ(rtp_layout_chunk(&l, d[0], d[1], d[2]), RTP_OK);
  return l;
}

// Meshes of 1..4 ranks from `base` (1-D, 1x2, 2x1, 2x2), two ranks per host, each with
// some layouts of a 3-D tensor: replicated, each dimension chunked, dimension 1 also in 3
// groups, and on 2-D meshes over either axis and two dimensions at once (21 in all).
std::vector<Side> sides(int base) {
  std::vector<Side> out;
  auto mesh = [&](int rows, int cols, bool two_d) {
    std::vector<int> ranks, hosts;
    for (int i = 0; i < rows * cols; i++) {
      ranks.push_back(base + i);
      hosts.push_back((base + i) / 2);
    }
    rtp_mesh m;
    EXPECT_EQ(two_d ? rtp_mesh_init_2d(&m, rows, cols, ranks.data(), hosts.data())
                    : rtp_mesh_init_1d(&m, rows, ranks.data(), hosts.data()),
              RTP_OK);
    return m;
  };
  auto add = [&](const std::string &name, const rtp_mesh &m,
                 std::vector<std::vector<std::vector<int>>> layouts) {
    for (auto &l : layouts) {
      std::string what = name;
      for (auto &d : l)
        what += " d" + std::to_string(d[0]) + "/a" + std::to_string(d[1]) +
                (d[2] > 1 ? "x" + std::to_string(d[2]) : "");
      out.push_back({l.empty() ? name + " rep" : what, m, chunked(l)});
    }
  };
  add("1", mesh(1, 1, false), {{}});
  add("2", mesh(2, 1, false), {{}, {{0, 0, 1}}, {{1, 0, 1}}, {{2, 0, 1}}});
  add("3", mesh(3, 1, false), {{}, {{0, 0, 1}}, {{1, 0, 1}}, {{1, 0, 3}}, {{2, 0, 1}}});
  add("4", mesh(4, 1, false), {{}, {{0, 0, 1}}, {{1, 0, 3}}, {{2, 0, 1}}});
  add("1x2", mesh(1, 2, true), {{{1, 1, 1}}, {{0, 0, 1}, {1, 1, 1}}});
  add("2x1", mesh(2, 1, true), {{{2, 0, 1}}});
  add("2x2", mesh(2, 2, true),
      {{}, {{0, 0, 1}, {1, 1, 1}}, {{1, 1, 3}, {2, 0, 1}}, {{2, 1, 1}}});
  return out;
}

// This rank's block of a layout: per dimension, the global index of each local index (the
// groups' blocks one after the other). Empty when the rank is not in the mesh.
std::vector<std::vector<int64_t>> block_of(const rtp_mesh &m, const rtp_layout &l,
                                           const int64_t *ne, int rank) {
  int pos = -1;
  for (int i = 0; i < n_ranks(m); i++)
    if (m.ranks[i] == rank) pos = i;
  if (pos < 0) return {};
  int coord[2] = {pos / m.shape[1], pos % m.shape[1]};
  std::vector<std::vector<int64_t>> idx(RTP_MAX_DIMS);
  for (int d = 0; d < RTP_MAX_DIMS; d++) {
    if (l.axis[d] == RTP_LAYOUT_REPLICATED) {
      for (int64_t x = 0; x < ne[d]; x++) idx[d].push_back(x);
      continue;
    }
    int64_t part = ne[d] / l.groups[d];
    size_t f, len;
    rtp_comm_block((size_t)part, m.shape[l.axis[d]], coord[l.axis[d]], &f, &len);
    for (int g = 0; g < l.groups[d]; g++)
      for (size_t i = 0; i < len; i++) idx[d].push_back(g * part + (int64_t)(f + i));
  }
  return idx;
}

// The bits of global element i: mostly scrambled, with NaNs carrying payloads and
// negative zeros among them, which only a bit-exact move keeps.
uint32_t bits32(int64_t i, int salt) {
  if (i % 7 == 3) return 0x7fa00000u | (uint32_t)(i * 31 + salt);  // signalling NaN
  if (i % 11 == 5) return 0x80000000u;                             // -0
  return (uint32_t)(i + 1) * 2654435761u ^ (uint32_t)salt * 40503u;
}

uint16_t bits16(int64_t i, int salt) {
  if (i % 7 == 3) return (uint16_t)(0x7f81u + (uint16_t)((i + salt) % 60));  // NaN
  if (i % 11 == 5) return 0x8000u;
  return (uint16_t)(((uint32_t)(i + 1) * 40503u) ^ (uint32_t)salt);
}

// Local tensor of a block, its elements' global linear indices in local order.
std::vector<int64_t> global_indices(const std::vector<std::vector<int64_t>> &idx,
                                    const int64_t *ne) {
  std::vector<int64_t> out;
  for (int64_t i3 : idx[3])
    for (int64_t i2 : idx[2])
      for (int64_t i1 : idx[1])
        for (int64_t i0 : idx[0]) out.push_back(((i3 * ne[2] + i2) * ne[1] + i1) * ne[0] + i0);
  return out;
}

std::vector<uint8_t> values(const std::vector<int64_t> &gi, rtp_type type, int salt) {
  size_t es = rtp_type_size(type);
  std::vector<uint8_t> v(gi.size() * es);
  for (size_t i = 0; i < gi.size(); i++) {
    uint32_t b32 = bits32(gi[i], salt);
    uint16_t b16 = bits16(gi[i], salt);
    memcpy(v.data() + i * es, es == 4 ? (void *)&b32 : (void *)&b16, es);
  }
  return v;
}

rtp_tensor *block_tensor(rtp_context *ctx, rtp_type type,
                         const std::vector<std::vector<int64_t>> &idx) {
  if (idx.empty()) return nullptr;
  int64_t ne[RTP_MAX_DIMS];
  for (int d = 0; d < RTP_MAX_DIMS; d++) ne[d] = (int64_t)idx[d].size();
  return rtp_tensor_new(ctx, type, RTP_MAX_DIMS, ne);
}

// One move on this rank: plans a -> b, builds and runs the graph, checks its destination
// block. Returns "" or what went wrong. A rank in neither mesh does nothing.
std::string reshard_once(rtp_comm *c, int rank, const Side &a, const Side &b, const int64_t *ne,
                         rtp_type type, size_t chunk, int salt, size_t mem = 1u << 20) {
  rtp_reshard_params p{};
  p.src_mesh = &a.mesh;
  p.dst_mesh = &b.mesh;
  p.src = &a.layout;
  p.dst = &b.layout;
  for (int d = 0; d < RTP_MAX_DIMS; d++) p.ne[d] = ne[d];
  p.elem_size = rtp_type_size(type);
  rtp_reshard *plan = nullptr;
  if (rtp_reshard_plan(&p, &plan) != RTP_OK) return std::string("plan: ") + rtp_last_error();
  auto sidx = block_of(a.mesh, a.layout, ne, rank), didx = block_of(b.mesh, b.layout, ne, rank);
  std::string err;
  if (!sidx.empty() || !didx.empty()) {
    rtp_init_params ip{};
    ip.mem_size = mem;
    rtp_context *ctx = rtp_context_new(ip);
    rtp_tensor *src = block_tensor(ctx, type, sidx), *dst = block_tensor(ctx, type, didx);
    std::vector<int64_t> sg = sidx.empty() ? std::vector<int64_t>{} : global_indices(sidx, ne);
    std::vector<int64_t> dg = didx.empty() ? std::vector<int64_t>{} : global_indices(didx, ne);
    std::vector<uint8_t> sv = values(sg, type, salt), want = values(dg, type, salt);
    if (src) rtp_tensor_set(src, sv.data(), 0, sv.size());
    if (dst) rtp_tensor_set_zero(dst);
    rtp_graph *g = rtp_graph_new(ctx, 4096);
    int st = rtp_reshard_build(ctx, g, c, plan, src, dst, chunk);
    if (!st) st = rtp_graph_plan(ctx, g);
    if (!st) st = rtp_graph_compute(g, nullptr);
    if (st) {
      err = std::string("reshard: ") + rtp_last_error();
    } else if (dst) {
      std::vector<uint8_t> got(want.size());
      rtp_tensor_get(dst, got.data(), 0, got.size());
      size_t es = rtp_type_size(type);
      for (size_t i = 0; i < dg.size() && err.empty(); i++)
        if (memcmp(got.data() + i * es, want.data() + i * es, es) != 0)
          err = "element " + std::to_string(dg[i]) + " differs";
    }
    rtp_context_free(ctx);
  }
  rtp_reshard_free(plan);
  return err.empty() ? err : a.name + " -> " + b.name + ": " + err;
}

constexpr int kRanks = 8;

// Every pair of layouts of the suite, with the destination on the same ranks (0..),
// overlapping ones (2..) or others (4..), moves a {5, 6, 3} f32 tensor bit for bit, in
// chunks of 3 elements (so chains forward several chunks, uneven ones too), all on one set
// of 8 processes. Every 7th pair moves bf16 instead.
TEST(ReshardExec, EveryPairArrivesBitExact) {
  int port = free_port();
  auto res = run_procs(kRanks, [&](int rank) {
    rtp_comm_params cp = params(rank, kRanks, port);
    rtp_comm *c;
    CHECK_OK(rtp_comm_init(&cp, &c));
    const int64_t ne[RTP_MAX_DIMS] = {5, 6, 3, 1};
    std::vector<Side> src = sides(0);
    int pairs = 0, failures = 0;
    double t0 = now_s();
    for (int base : {0, 2, 4}) {
      std::vector<Side> dst = sides(base);
      for (const Side &a : src)
        for (const Side &b : dst) {
          bool bf16 = pairs % 7 == 6;
          std::string e = reshard_once(c, rank, a, b, ne, bf16 ? RTP_TYPE_BF16 : RTP_TYPE_F32,
                                       bf16 ? 6 : 12, pairs);
          pairs++;
          if (!e.empty() && failures++ < 5)
            fprintf(stderr, "rank %d, base %d: %s\n", rank, base, e.c_str());
        }
    }
    if (rank == 0) fprintf(stderr, "%d pairs in %.1f s\n", pairs, now_s() - t0);
    CHECK(failures == 0, "%d of %d pairs failed", failures, pairs);
    CHECK(pairs == 3 * (int)src.size() * (int)src.size(), "%d pairs", pairs);
    CHECK_OK(rtp_comm_barrier(c, nullptr));
    rtp_comm_free(c);
    return 0;
  });
  for (int r = 0; r < kRanks; r++) EXPECT_EQ(res[r].code, 0) << "rank " << r;
}

// A larger tensor in the default chunks (several per slice, each several frames of the
// transport) and in one chunk per slice: row blocks on 3 ranks to replicated on 4, and a
// 2x2 mesh's tiles to column blocks on 3 others.
TEST(ReshardExec, LargeTensorInDefaultChunks) {
  int port = free_port();
  auto res = run_procs(7, [&](int rank) {
    rtp_comm_params cp = params(rank, 7, port);
    rtp_comm *c;
    CHECK_OK(rtp_comm_init(&cp, &c));
    const int64_t ne[RTP_MAX_DIMS] = {1000, 501, 1, 1};
    int h[4] = {0, 0, 1, 1}, r4[4] = {3, 4, 5, 6}, r3[3] = {0, 1, 2}, h3[3] = {0, 0, 1};
    Side rows3{"3 d1", {}, chunked({{1, 0, 1}})}, rep4{"4 rep", {}, rtp_layout_replicated()};
    Side tiles{"2x2 d0/a0 d1/a1", {}, chunked({{0, 0, 1}, {1, 1, 1}})};
    Side cols3{"3 d0 (others)", {}, chunked({{0, 0, 1}})};
    EXPECT_EQ(rtp_mesh_init_1d(&rows3.mesh, 3, r3, h3), RTP_OK);
    EXPECT_EQ(rtp_mesh_init_1d(&rep4.mesh, 4, nullptr, h), RTP_OK);
    EXPECT_EQ(rtp_mesh_init_2d(&tiles.mesh, 2, 2, r4, h), RTP_OK);
    EXPECT_EQ(rtp_mesh_init_1d(&cols3.mesh, 3, r3, h3), RTP_OK);
    for (size_t chunk : {(size_t)0, (size_t)64 << 20}) {
      std::string e = reshard_once(c, rank, rows3, rep4, ne, RTP_TYPE_F32, chunk, 1, 64u << 20);
      CHECK(e.empty(), "%s", e.c_str());
      e = reshard_once(c, rank, tiles, cols3, ne, RTP_TYPE_F32, chunk, 2, 64u << 20);
      CHECK(e.empty(), "%s", e.c_str());
    }
    CHECK_OK(rtp_comm_barrier(c, nullptr));
    rtp_comm_free(c);
    return 0;
  });
  for (int r = 0; r < 7; r++) EXPECT_EQ(res[r].code, 0) << "rank " << r;
}

// More rounds than run at once (WAVE, 8): row blocks in 9 groups on 2 ranks of 2 hosts,
// replicated on those and a third, make 18 broadcasts that each take both hosts, so 18
// rounds in 3 waves, and 18 local copies after them; bit for bit, in chunks of 3 elements
// and whole.
TEST(ReshardExec, ManyRoundsRunInWaves) {
  int port = free_port();
  auto res = run_procs(3, [&](int rank) {
    rtp_comm_params cp = params(rank, 3, port);
    rtp_comm *c;
    CHECK_OK(rtp_comm_init(&cp, &c));
    const int64_t ne[RTP_MAX_DIMS] = {10, 90, 1, 1};
    int h[3] = {0, 1, 1};
    Side groups{"2 d1/a0x9", {}, chunked({{1, 0, 9}})},
        rep{"3 rep", {}, rtp_layout_replicated()};
    EXPECT_EQ(rtp_mesh_init_1d(&groups.mesh, 2, nullptr, h), RTP_OK);
    EXPECT_EQ(rtp_mesh_init_1d(&rep.mesh, 3, nullptr, h), RTP_OK);
    rtp_reshard_params p{};
    p.src_mesh = &groups.mesh;
    p.dst_mesh = &rep.mesh;
    p.src = &groups.layout;
    p.dst = &rep.layout;
    for (int d = 0; d < RTP_MAX_DIMS; d++) p.ne[d] = ne[d];
    p.elem_size = 4;
    rtp_reshard *plan = nullptr;
    CHECK_OK(rtp_reshard_plan(&p, &plan));
    CHECK(plan->n_rounds == 18, "%d rounds", plan->n_rounds);
    rtp_reshard_free(plan);
    for (size_t chunk : {(size_t)12, (size_t)0}) {
      std::string e = reshard_once(c, rank, groups, rep, ne, RTP_TYPE_F32, chunk, 3);
      CHECK(e.empty(), "%s", e.c_str());
    }
    CHECK_OK(rtp_comm_barrier(c, nullptr));
    rtp_comm_free(c);
    return 0;
  });
  for (int r = 0; r < 3; r++) EXPECT_EQ(res[r].code, 0) << "rank " << r;
}

// Bad input is refused with a message naming it, before anything is sent: a plan with a
// rank the communicator lacks, a block of the wrong shape or type, a missing destination,
// a plan whose round has a rank in two broadcasts (edited by hand), no plan.
TEST(ReshardExec, BadInputIsRefusedWithAMessage) {
  int port = free_port();
  auto res = run_procs(2, [&](int rank) {
    rtp_comm_params cp = params(rank, 2, port);
    rtp_comm *c;
    CHECK_OK(rtp_comm_init(&cp, &c));
    // rank 0's 10 x 90 tensor in 9 groups of rows, to rank 1 (or 2), replicated
    int h0[1] = {0}, h1[1] = {1}, r1[1] = {1}, r2[1] = {2};
    Side groups{"1 d1/a0x9", {}, chunked({{1, 0, 9}})},
        rep{"1 rep", {}, rtp_layout_replicated()};
    Side far = rep;
    EXPECT_EQ(rtp_mesh_init_1d(&groups.mesh, 1, nullptr, h0), RTP_OK);
    EXPECT_EQ(rtp_mesh_init_1d(&rep.mesh, 1, r1, h1), RTP_OK);
    EXPECT_EQ(rtp_mesh_init_1d(&far.mesh, 1, r2, h1), RTP_OK);
    auto plan_of = [&](const Side &a, const Side &b) {
      rtp_reshard_params p{};
      p.src_mesh = &a.mesh;
      p.dst_mesh = &b.mesh;
      p.src = &a.layout;
      p.dst = &b.layout;
      p.ne[0] = 10;
      p.ne[1] = 90;
      p.ne[2] = p.ne[3] = 1;
      p.elem_size = 4;
      rtp_reshard *r = nullptr;
      EXPECT_EQ(rtp_reshard_plan(&p, &r), RTP_OK);
      return r;
    };
    rtp_reshard *ok = plan_of(groups, rep), *bad_rank = plan_of(groups, far),
                *bad_rounds = plan_of(groups, rep);
    CHECK(ok && bad_rank && bad_rounds && ok->n_rounds == 9, "plans");
    for (int i = 0; i < bad_rounds->n_slices; i++) bad_rounds->slices[i].round = 0;
    rtp_init_params ip{};
    ip.mem_size = 1u << 20;
    rtp_context *ctx = rtp_context_new(ip);
    rtp_tensor *whole = rtp_tensor_new_2d(ctx, RTP_TYPE_F32, 10, 90);
    rtp_tensor *wrong = rtp_tensor_new_2d(ctx, RTP_TYPE_F32, 10, 89);
    rtp_tensor *bf16 = rtp_tensor_new_2d(ctx, RTP_TYPE_BF16, 10, 90);
    rtp_tensor *mine = rank == 0 ? whole : nullptr, *got = rank == 1 ? whole : nullptr;
    struct Case {
      const rtp_reshard *plan;
      rtp_tensor *src, *dst;
      int status;
      const char *words;
      bool rank0, rank1;  // the ranks that must refuse it
    } cases[] = {
        {bad_rank, mine, nullptr, RTP_EINVAL, "rank 2, which is not in the communicator", 1, 1},
        {ok, rank == 0 ? wrong : nullptr, got, RTP_ESHAPE, "its block of the layout is 10 x 90",
         1, 0},
        {ok, mine, rank == 1 ? bf16 : nullptr, RTP_ESHAPE, "4-byte elements", 0, 1},
        {ok, mine, nullptr, RTP_EINVAL, "receives but its destination is NULL", 0, 1},
        {ok, nullptr, got, RTP_EINVAL, "sends or copies but its source is NULL", 1, 0},
        {bad_rounds, mine, got, RTP_EINVAL, "more than one broadcast of a round", 1, 1},
        {nullptr, mine, got, RTP_EINVAL, "NULL context, graph, communicator or plan", 1, 1},
    };
    for (const Case &k : cases) {
      rtp_graph *g = rtp_graph_new(ctx, 4096);
      int st = rtp_reshard_build(ctx, g, c, k.plan, k.src, k.dst, 0);
      bool refuses = rank == 0 ? k.rank0 : k.rank1;
      std::string msg = rtp_last_error();
      if (!refuses) {
        CHECK(st == RTP_OK || k.plan == bad_rounds, "'%s': %s", k.words, msg.c_str());
        continue;
      }
      CHECK(st == k.status, "'%s': status %d: %s", k.words, st, msg.c_str());
      CHECK(contains(msg, k.words), "'%s' not in '%s'", k.words, msg.c_str());
    }
    rtp_context_free(ctx);
    for (rtp_reshard *r : {ok, bad_rank, bad_rounds}) rtp_reshard_free(r);
    rtp_comm_free(c);
    return 0;
  });
  for (int r = 0; r < 2; r++) EXPECT_EQ(res[r].code, 0) << "rank " << r;
}

// Rank 3 runs the first half of its part of a reshard (row blocks on 4 ranks to replicated
// on 4, in small chunks) and dies (SIGKILL): the others, mid-reshard, fail within seconds
// naming it, and their graphs return the failure instead of a destination.
TEST(ReshardExec, RankDyingMidReshardFailsTheOthers) {
  int port = free_port();
  auto res = run_procs(4, [&](int rank) {
    rtp_comm_params cp = params(rank, 4, port, 10000);
    rtp_comm *c;
    CHECK_OK(rtp_comm_init(&cp, &c));
    const int64_t ne[RTP_MAX_DIMS] = {256, 1024, 1, 1};
    int h[4] = {0, 0, 1, 1};
    Side rows{"4 d1", {}, chunked({{1, 0, 1}})}, rep{"4 rep", {}, rtp_layout_replicated()};
    EXPECT_EQ(rtp_mesh_init_1d(&rows.mesh, 4, nullptr, h), RTP_OK);
    EXPECT_EQ(rtp_mesh_init_1d(&rep.mesh, 4, nullptr, h), RTP_OK);
    rtp_reshard_params p{};
    p.src_mesh = &rows.mesh;
    p.dst_mesh = &rep.mesh;
    p.src = &rows.layout;
    p.dst = &rep.layout;
    for (int d = 0; d < RTP_MAX_DIMS; d++) p.ne[d] = ne[d];
    p.elem_size = 4;
    rtp_reshard *plan = nullptr;
    CHECK_OK(rtp_reshard_plan(&p, &plan));
    rtp_init_params ip{};
    ip.mem_size = 64u << 20;
    rtp_context *ctx = rtp_context_new(ip);
    rtp_tensor *src = rtp_tensor_new_2d(ctx, RTP_TYPE_F32, 256, 256);
    rtp_tensor *dst = rtp_tensor_new_2d(ctx, RTP_TYPE_F32, 256, 1024);
    rtp_tensor_fill_f32(src, (float)rank);
    rtp_graph *g = rtp_graph_new(ctx, 1 << 16);
    CHECK_OK(rtp_reshard_build(ctx, g, c, plan, src, dst, 16 << 10));
    if (rank == 3) g->n_nodes /= 2;  // its nodes are in order: a prefix is a valid graph
    CHECK_OK(rtp_graph_plan(ctx, g));
    CHECK_OK(rtp_comm_barrier(c, nullptr));
    double t0 = now_s();
    int st = rtp_graph_compute(g, nullptr);
    if (rank == 3) raise(SIGKILL);
    int rc = expect_failure(rank, st, t0, 5, {RTP_EPEER, RTP_ECOMM}, {"rank 3"}, c);
    rtp_context_free(ctx);
    rtp_reshard_free(plan);
    rtp_comm_free(c);
    return rc;
  });
  for (int r = 0; r < 3; r++) EXPECT_EQ(res[r].code, 0) << "rank " << r;
  EXPECT_EQ(res[3].code, -SIGKILL);
}

}  // namespace
