// test-io.cpp - safetensors reading and writing (rtp-io.c).
#include <gtest/gtest.h>

#include <dirent.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "rtp.h"
extern "C" {
#include "rtp-impl.h" /* rtp__safetensors_read_box */
}
#include "rtp-json.h"
#include "test-util.h"

namespace {

namespace fs = std::filesystem;

std::string Fixture(const char *name) {
  return std::string(RTP_TEST_DIR) + "/fixtures/" + name;
}

// A fresh directory per test, removed at the end.
class IoTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/rtp-test-io-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    rtp_init_params ip = {};
    ip.mem_size = 8 << 20;
    ctx_ = rtp_context_new(ip);
    ASSERT_NE(ctx_, nullptr);
  }
  void TearDown() override {
    rtp_context_free(ctx_);
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }

  std::string Path(const std::string &name) const {
    return dir_ + "/" + name;
  }

  // Files in the test directory whose name contains ".tmp.": leftovers of a save.
  int TempFiles() const {
    int n = 0;
    for (const auto &e : fs::directory_iterator(dir_)) {
      if (e.path().filename().string().find(".tmp.") != std::string::npos) n++;
    }
    return n;
  }

  rtp_tensor *F32(std::vector<int64_t> ne, const char *name, float base = 0.0f) {
    rtp_tensor *t = rtp_tensor_new(ctx_, RTP_TYPE_F32, (int)ne.size(), ne.data());
    EXPECT_NE(t, nullptr);
    rtp_tensor_set_name(t, "%s", name);
    float *p = (float *)t->data;
    for (int64_t i = 0; i < rtp_tensor_nelements(t); i++)
      p[i] = base + 0.25f * (float)i - 1.0f / 3;
    return t;
  }

  rtp_tensor *I32(std::vector<int64_t> ne, const char *name) {
    rtp_tensor *t = rtp_tensor_new(ctx_, RTP_TYPE_I32, (int)ne.size(), ne.data());
    EXPECT_NE(t, nullptr);
    rtp_tensor_set_name(t, "%s", name);
    int32_t *p = (int32_t *)t->data;
    for (int64_t i = 0; i < rtp_tensor_nelements(t); i++) p[i] = (int32_t)(i * 7919 - 40000);
    return t;
  }

  // A tensor of the same type and shape as t, zeroed.
  rtp_tensor *Like(const rtp_tensor *t) {
    rtp_tensor *r = rtp_tensor_new(ctx_, t->type, RTP_MAX_DIMS, t->ne);
    EXPECT_NE(r, nullptr);
    return r;
  }

  std::string dir_;
  rtp_context *ctx_ = nullptr;
};

std::vector<uint8_t> ReadFile(const std::string &path) {
  std::ifstream f(path, std::ios::binary);
  return std::vector<uint8_t>((std::istreambuf_iterator<char>(f)),
                              std::istreambuf_iterator<char>());
}

void WriteFile(const std::string &path, const std::vector<uint8_t> &bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write((const char *)bytes.data(), (std::streamsize)bytes.size());
}

// A safetensors file from a header string and a data section; hlen overrides the length.
std::vector<uint8_t> MakeFile(const std::string &header, const std::vector<uint8_t> &data,
                              int64_t hlen = -1) {
  uint64_t n = hlen < 0 ? header.size() : (uint64_t)hlen;
  std::vector<uint8_t> out(8);
  for (int i = 0; i < 8; i++) out[i] = (uint8_t)(n >> (8 * i));
  out.insert(out.end(), header.begin(), header.end());
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

// Opens path expecting failure with status; returns the message.
std::string OpenFails(const std::string &path, int status) {
  rtp_safetensors *st = (rtp_safetensors *)0x1;
  int rc = rtp_safetensors_open(path.c_str(), &st);
  EXPECT_EQ(rc, status) << "message: " << rtp_last_error();
  EXPECT_EQ(st, nullptr);
  if (rc == RTP_OK) rtp_safetensors_close(st);
  std::string msg = rtp_last_error();
  EXPECT_FALSE(msg.empty());
  return msg;
}

bool Contains(const std::string &s, const std::string &part) {
  return s.find(part) != std::string::npos;
}

// ---- round trips ----------------------------------------------------------------------

TEST_F(IoTest, RoundTripSeveralTensors) {
  std::vector<rtp_tensor *> ts = {
      F32({7}, "a.vec"),
      F32({5, 3}, "b.mat", 10.0f),
      F32({3, 1, 4}, "c.3d"),
      F32({3, 5, 7, 2}, "d.4d", -5.0f),
      I32({11, 2}, "e.i32"),
      F32({1}, "f.one"),
      F32({1, 1, 1, 9}, "g.leading.ones"),
      F32({0, 3}, "h.empty"),
      I32({13}, "i.i32.vec"),
  };
  const char *meta[] = {"format", "pt", "step", "42", nullptr};
  std::string path = Path("model.safetensors");
  ASSERT_EQ(rtp_safetensors_save(path.c_str(), ts.data(), (int)ts.size(), meta), RTP_OK)
      << rtp_last_error();
  EXPECT_EQ(TempFiles(), 0);

  // The data section starts 8-byte aligned and the file holds exactly header + data.
  std::vector<uint8_t> bytes = ReadFile(path);
  ASSERT_GE(bytes.size(), 8u);
  uint64_t hlen = 0;
  for (int i = 7; i >= 0; i--) hlen = hlen << 8 | bytes[i];
  EXPECT_EQ((8 + hlen) % 8, 0u);
  size_t data = 0;
  for (auto *t : ts) data += rtp_tensor_nbytes(t);
  EXPECT_EQ(bytes.size(), 8 + hlen + data);

  rtp_safetensors *st = nullptr;
  ASSERT_EQ(rtp_safetensors_open(path.c_str(), &st), RTP_OK) << rtp_last_error();
  ASSERT_EQ(rtp_safetensors_count(st), (int)ts.size());
  const int want_dims[] = {1, 2, 3, 4, 2, 1, 4, 2, 1};
  for (int i = 0; i < (int)ts.size(); i++) {
    const char *name;
    rtp_type type;
    int nd;
    int64_t ne[RTP_MAX_DIMS];
    ASSERT_EQ(rtp_safetensors_info(st, i, &name, &type, &nd, ne), RTP_OK);
    EXPECT_STREQ(name, ts[i]->name);
    EXPECT_EQ(type, ts[i]->type);
    EXPECT_EQ(nd, want_dims[i]) << name;
    for (int d = 0; d < RTP_MAX_DIMS; d++) EXPECT_EQ(ne[d], ts[i]->ne[d]) << name;
    EXPECT_EQ(rtp_safetensors_find(st, ts[i]->name), i);

    rtp_tensor *r = Like(ts[i]);
    ASSERT_EQ(rtp_safetensors_read(st, ts[i]->name, r), RTP_OK) << rtp_last_error();
    EXPECT_EQ(memcmp(r->data, ts[i]->data, rtp_tensor_nbytes(ts[i])), 0) << name;

    rtp_tensor *l = rtp_safetensors_load(ctx_, st, ts[i]->name);
    ASSERT_NE(l, nullptr) << rtp_last_error();
    EXPECT_STREQ(l->name, ts[i]->name);
    EXPECT_TRUE(rtp_tensor_same_shape(l, ts[i]));
    EXPECT_EQ(memcmp(l->data, ts[i]->data, rtp_tensor_nbytes(ts[i])), 0) << name;
  }
  EXPECT_EQ(rtp_safetensors_find(st, "nope"), -1);
  EXPECT_EQ(rtp_safetensors_info(st, (int)ts.size(), nullptr, nullptr, nullptr, nullptr),
            RTP_EINVAL);
  EXPECT_EQ(rtp_safetensors_info(st, -1, nullptr, nullptr, nullptr, nullptr), RTP_EINVAL);
  ASSERT_EQ(rtp_safetensors_meta_count(st), 2);
  EXPECT_STREQ(rtp_safetensors_meta(st, "format"), "pt");
  EXPECT_STREQ(rtp_safetensors_meta(st, "step"), "42");
  EXPECT_EQ(rtp_safetensors_meta(st, "nope"), nullptr);
  const char *k, *v;
  ASSERT_EQ(rtp_safetensors_meta_at(st, 1, &k, &v), RTP_OK);
  EXPECT_STREQ(k, "step");
  EXPECT_STREQ(v, "42");
  EXPECT_EQ(rtp_safetensors_meta_at(st, 2, &k, &v), RTP_EINVAL);
  rtp_safetensors_close(st);
}

TEST_F(IoTest, OverwriteReplacesTheFile) {
  std::string path = Path("x.safetensors");
  rtp_tensor *a = F32({4}, "a");
  ASSERT_EQ(rtp_safetensors_save(path.c_str(), &a, 1, nullptr), RTP_OK) << rtp_last_error();
  rtp_tensor *b = I32({2, 3}, "b");
  ASSERT_EQ(rtp_safetensors_save(path.c_str(), &b, 1, nullptr), RTP_OK) << rtp_last_error();
  rtp_safetensors *st = nullptr;
  ASSERT_EQ(rtp_safetensors_open(path.c_str(), &st), RTP_OK) << rtp_last_error();
  EXPECT_EQ(rtp_safetensors_count(st), 1);
  EXPECT_EQ(rtp_safetensors_find(st, "b"), 0);
  EXPECT_EQ(rtp_safetensors_meta_count(st), 0);
  rtp_safetensors_close(st);
  EXPECT_EQ(TempFiles(), 0);
}

TEST_F(IoTest, EmptyFile) {
  std::string path = Path("empty.safetensors");
  ASSERT_EQ(rtp_safetensors_save(path.c_str(), nullptr, 0, nullptr), RTP_OK);
  rtp_safetensors *st = nullptr;
  ASSERT_EQ(rtp_safetensors_open(path.c_str(), &st), RTP_OK) << rtp_last_error();
  EXPECT_EQ(rtp_safetensors_count(st), 0);
  rtp_safetensors_close(st);
  rtp_safetensors_close(nullptr);
}

TEST_F(IoTest, MetadataEscapes) {
  std::string path = Path("meta.safetensors");
  rtp_tensor *a = F32({2}, "weird \"name\" \\ \x01 \xc3\xa9");
  const char *meta[] = {"quote\"back\\slash",
                        "line\nbreak\ttab\x1f",
                        "utf8 \xc3\xa9",
                        "\xf0\x9f\x98\x80",
                        "empty",
                        "",
                        nullptr};
  ASSERT_EQ(rtp_safetensors_save(path.c_str(), &a, 1, meta), RTP_OK) << rtp_last_error();
  rtp_safetensors *st = nullptr;
  ASSERT_EQ(rtp_safetensors_open(path.c_str(), &st), RTP_OK) << rtp_last_error();
  EXPECT_EQ(rtp_safetensors_find(st, a->name), 0);
  EXPECT_STREQ(rtp_safetensors_meta(st, meta[0]), meta[1]);
  EXPECT_STREQ(rtp_safetensors_meta(st, meta[2]), meta[3]);
  EXPECT_STREQ(rtp_safetensors_meta(st, "empty"), "");
  rtp_safetensors_close(st);
}

// ---- views: strided source and destination, blocks of rows ------------------------------

TEST_F(IoTest, StridedWriteAndRead) {
  // A 3x4 row-major matrix m (ne {4,3}); its transpose is the view ne {3,4}, nb {16, 4}.
  float m[12];
  for (int i = 0; i < 12; i++) m[i] = (float)i;
  rtp_tensor tr = {};
  tr.type = RTP_TYPE_F32;
  tr.ne[0] = 3, tr.ne[1] = 4, tr.ne[2] = tr.ne[3] = 1;
  tr.nb[0] = 16, tr.nb[1] = 4, tr.nb[2] = tr.nb[3] = 16 * 3;
  tr.data = m;
  snprintf(tr.name, sizeof(tr.name), "transposed");
  // Every other row of a 6x5 matrix: ne {5,3}, nb {4, 40}.
  float big[30];
  for (int i = 0; i < 30; i++) big[i] = 100.0f + (float)i;
  rtp_tensor rows = {};
  rows.type = RTP_TYPE_F32;
  rows.ne[0] = 5, rows.ne[1] = 3, rows.ne[2] = rows.ne[3] = 1;
  rows.nb[0] = 4, rows.nb[1] = 40, rows.nb[2] = rows.nb[3] = 120;
  rows.data = big;
  snprintf(rows.name, sizeof(rows.name), "rows");

  std::string path = Path("views.safetensors");
  rtp_tensor *ts[] = {&tr, &rows};
  ASSERT_EQ(rtp_safetensors_save(path.c_str(), ts, 2, nullptr), RTP_OK) << rtp_last_error();
  rtp_safetensors *st = nullptr;
  ASSERT_EQ(rtp_safetensors_open(path.c_str(), &st), RTP_OK) << rtp_last_error();

  rtp_tensor *a = rtp_tensor_new_2d(ctx_, RTP_TYPE_F32, 3, 4);
  ASSERT_EQ(rtp_safetensors_read(st, "transposed", a), RTP_OK) << rtp_last_error();
  const float *pa = (const float *)a->data;
  for (int i = 0; i < 4; i++)
    for (int j = 0; j < 3; j++) EXPECT_EQ(pa[i * 3 + j], m[j * 4 + i]);

  rtp_tensor *b = rtp_tensor_new_2d(ctx_, RTP_TYPE_F32, 5, 3);
  ASSERT_EQ(rtp_safetensors_read(st, "rows", b), RTP_OK) << rtp_last_error();
  const float *pb = (const float *)b->data;
  for (int i = 0; i < 3; i++)
    for (int j = 0; j < 5; j++) EXPECT_EQ(pb[i * 5 + j], big[i * 10 + j]);

  // Read the transposed matrix into a transposed destination: the original comes back.
  float back[12] = {};
  rtp_tensor dst = tr;
  dst.data = back;
  ASSERT_EQ(rtp_safetensors_read(st, "transposed", &dst), RTP_OK) << rtp_last_error();
  EXPECT_EQ(memcmp(back, m, sizeof(m)), 0);
  rtp_safetensors_close(st);
}

TEST_F(IoTest, ReadRows) {
  rtp_tensor *w = F32({4, 6}, "w");  // [6, 4]: 6 rows of 4
  rtp_tensor *v = I32({9}, "v");
  rtp_tensor *ts[] = {w, v};
  std::string path = Path("rows.safetensors");
  ASSERT_EQ(rtp_safetensors_save(path.c_str(), ts, 2, nullptr), RTP_OK) << rtp_last_error();
  rtp_safetensors *st = nullptr;
  ASSERT_EQ(rtp_safetensors_open(path.c_str(), &st), RTP_OK) << rtp_last_error();

  rtp_tensor *blk = rtp_tensor_new_2d(ctx_, RTP_TYPE_F32, 4, 3);
  ASSERT_EQ(rtp_safetensors_read_rows(st, "w", 2, blk), RTP_OK) << rtp_last_error();
  EXPECT_EQ(memcmp(blk->data, (float *)w->data + 8, 12 * sizeof(float)), 0);
  ASSERT_EQ(rtp_safetensors_read_rows(st, "w", 3, blk), RTP_OK) << rtp_last_error();
  EXPECT_EQ(memcmp(blk->data, (float *)w->data + 12, 12 * sizeof(float)), 0);
  EXPECT_EQ(rtp_safetensors_read_rows(st, "w", 4, blk), RTP_ESHAPE);
  EXPECT_TRUE(Contains(rtp_last_error(), "rows [4,7)")) << rtp_last_error();
  EXPECT_EQ(rtp_safetensors_read_rows(st, "w", -1, blk), RTP_ESHAPE);
  rtp_tensor *bad = rtp_tensor_new_2d(ctx_, RTP_TYPE_F32, 3, 3);
  EXPECT_EQ(rtp_safetensors_read_rows(st, "w", 0, bad), RTP_ESHAPE);

  rtp_tensor *part = rtp_tensor_new_1d(ctx_, RTP_TYPE_I32, 4);
  ASSERT_EQ(rtp_safetensors_read_rows(st, "v", 5, part), RTP_OK) << rtp_last_error();
  EXPECT_EQ(memcmp(part->data, (int32_t *)v->data + 5, 4 * sizeof(int32_t)), 0);
  rtp_safetensors_close(st);
}

// Boxes of a 3-D tensor (checkpoint loading reads a tp rank's columns so): each read into
// a packed tensor and into a view of a larger one, compared element by element with the
// tensor; a box not inside it is refused.
TEST_F(IoTest, ReadBoxes) {
  const int64_t ne[3] = {5, 4, 3};
  rtp_tensor *w = F32({ne[0], ne[1], ne[2]}, "w");
  std::string path = Path("boxes.safetensors");
  ASSERT_EQ(rtp_safetensors_save(path.c_str(), &w, 1, nullptr), RTP_OK) << rtp_last_error();
  rtp_safetensors *st = nullptr;
  ASSERT_EQ(rtp_safetensors_open(path.c_str(), &st), RTP_OK) << rtp_last_error();
  const float *all = (const float *)w->data;
  rtp_tensor *big = rtp_tensor_new_3d(ctx_, RTP_TYPE_F32, 7, 6, 5);
  int boxes = 0;
  for (int64_t a0 = 0; a0 < ne[0]; a0 += 2)
    for (int64_t l0 : {1, 3, 5})
      for (int64_t a1 : {0, 1})
        for (int64_t l1 : {1, 3})
          for (int64_t a2 : {0, 2})
            for (int64_t l2 : {1, 3}) {
              if (a0 + l0 > ne[0] || a1 + l1 > ne[1] || a2 + l2 > ne[2]) continue;
              const int64_t at[4] = {a0, a1, a2, 0}, len[4] = {l0, l1, l2, 1};
              rtp_tensor *packed = rtp_tensor_new(ctx_, RTP_TYPE_F32, 3, len);
              rtp_tensor *view = rtp_view(ctx_, big, 3, len, big->nb, big->nb[0] + big->nb[1]);
              for (rtp_tensor *t : {packed, view}) {
                ASSERT_EQ(rtp__safetensors_read_box(st, "w", at, t), RTP_OK)
                    << rtp_last_error();
                int bad = 0;
                for (int64_t k = 0; k < l2; k++)
                  for (int64_t j = 0; j < l1; j++)
                    for (int64_t i = 0; i < l0; i++) {
                      float got = *(const float *)((const char *)t->data + i * t->nb[0] +
                                                   j * t->nb[1] + k * t->nb[2]);
                      bad += got != all[((a2 + k) * ne[1] + a1 + j) * ne[0] + a0 + i];
                    }
                EXPECT_EQ(bad, 0) << "box at " << a0 << "," << a1 << "," << a2 << " of " << l0
                                  << "x" << l1 << "x" << l2;
              }
              boxes++;
            }
  EXPECT_GT(boxes, 40);
  const int64_t out[4] = {4, 0, 0, 0}, neg[4] = {0, -1, 0, 0};
  rtp_tensor *two = rtp_tensor_new_1d(ctx_, RTP_TYPE_F32, 2);
  EXPECT_EQ(rtp__safetensors_read_box(st, "w", out, two), RTP_ESHAPE);
  EXPECT_TRUE(Contains(rtp_last_error(), "no box of F32")) << rtp_last_error();
  EXPECT_EQ(rtp__safetensors_read_box(st, "w", neg, two), RTP_ESHAPE);
  EXPECT_EQ(rtp__safetensors_read_box(st, "x", out, two), RTP_EINVAL);
  rtp_safetensors_close(st);
}

// ---- files written by Python --------------------------------------------------------------

TEST(IoFixture, PythonWrittenFile) {
  // scripts/gen-io-fixture.py
  rtp_safetensors *st = nullptr;
  std::string path = Fixture("io-python.safetensors");
  ASSERT_EQ(rtp_safetensors_open(path.c_str(), &st), RTP_OK) << rtp_last_error();
  ASSERT_EQ(rtp_safetensors_count(st), 6);
  EXPECT_STREQ(rtp_safetensors_meta(st, "format"), "pt");
  EXPECT_STREQ(rtp_safetensors_meta(st, "note"), "line1\nline2 \xc3\xa9");

  rtp_init_params ip = {};
  ip.mem_size = 1 << 20;
  rtp_context *ctx = rtp_context_new(ip);
  ASSERT_NE(ctx, nullptr);

  rtp_tensor *a = rtp_safetensors_load(ctx, st, "a.f32");
  ASSERT_NE(a, nullptr) << rtp_last_error();
  EXPECT_EQ(a->type, RTP_TYPE_F32);
  EXPECT_EQ(a->ne[0], 5);
  EXPECT_EQ(a->ne[1], 3);
  for (int i = 0; i < 15; i++) EXPECT_EQ(((float *)a->data)[i], i * 0.5f - 3.0f);

  rtp_tensor *b = rtp_safetensors_load(ctx, st, "b.i32");
  ASSERT_NE(b, nullptr) << rtp_last_error();
  const int32_t want_b[] = {INT32_MIN, -1, 0, 1, INT32_MAX, 42, 7};
  EXPECT_EQ(b->type, RTP_TYPE_I32);
  EXPECT_EQ(memcmp(b->data, want_b, sizeof(want_b)), 0);

  int nd = -1;
  int64_t ne[RTP_MAX_DIMS];
  int ic = rtp_safetensors_find(st, "c.scalar");
  ASSERT_GE(ic, 0);
  ASSERT_EQ(rtp_safetensors_info(st, ic, nullptr, nullptr, &nd, ne), RTP_OK);
  EXPECT_EQ(nd, 0);
  for (int d = 0; d < RTP_MAX_DIMS; d++) EXPECT_EQ(ne[d], 1);
  rtp_tensor *c = rtp_tensor_new_1d(ctx, RTP_TYPE_F32, 1);
  ASSERT_EQ(rtp_safetensors_read(st, "c.scalar", c), RTP_OK) << rtp_last_error();
  EXPECT_EQ(rtptest::f32_at(c, 0), 3.25f);

  rtp_tensor *d4 = rtp_safetensors_load(ctx, st, "d.4d");
  ASSERT_NE(d4, nullptr) << rtp_last_error();
  const int64_t want_ne[] = {2, 3, 1, 2};
  for (int d = 0; d < 4; d++) EXPECT_EQ(d4->ne[d], want_ne[d]);
  for (int i = 0; i < 12; i++) EXPECT_EQ(((float *)d4->data)[i], (float)i);

  int ie = rtp_safetensors_find(st, "e.empty");
  ASSERT_GE(ie, 0);
  ASSERT_EQ(rtp_safetensors_info(st, ie, nullptr, nullptr, &nd, ne), RTP_OK);
  EXPECT_EQ(nd, 1);
  EXPECT_EQ(ne[0], 0);

  // JSON escapes in the name: \" and \u00e9 and the surrogate pair \ud83d\ude00.
  const char *uname = "name \"quoted\" \xc3\xa9 \xf0\x9f\x98\x80";
  rtp_tensor *u = rtp_tensor_new_1d(ctx, RTP_TYPE_F32, 2);
  ASSERT_EQ(rtp_safetensors_read(st, uname, u), RTP_OK) << rtp_last_error();
  EXPECT_EQ(rtptest::f32_at(u, 0), 1.5f);
  EXPECT_EQ(rtptest::f32_at(u, 1), -2.5f);

  rtp_safetensors_close(st);
  rtp_context_free(ctx);
}

TEST(IoFixture, GptFixture) {
  // scripts/gen-gpt-fixture.py: the reference the model tests use; check it is readable.
  rtp_safetensors *st = nullptr;
  std::string path = Fixture("gpt-tiny.safetensors");
  ASSERT_EQ(rtp_safetensors_open(path.c_str(), &st), RTP_OK) << rtp_last_error();
  EXPECT_STREQ(rtp_safetensors_meta(st, "vocab"), "256");
  EXPECT_STREQ(rtp_safetensors_meta(st, "n_layer"), "2");
  const int n_params = 4 + 2 * 12 + 1;
  EXPECT_EQ(rtp_safetensors_count(st), 3 * n_params + 2 + 2 + 1);
  rtp_init_params ip = {};
  ip.mem_size = 4 << 20;
  rtp_context *ctx = rtp_context_new(ip);
  ASSERT_NE(ctx, nullptr);
  rtp_tensor *w = rtp_tensor_new_2d(ctx, RTP_TYPE_F32, 32, 96);  // [3d, d]
  EXPECT_EQ(rtp_safetensors_read(st, "transformer.h.1.attn.c_attn.weight", w), RTP_OK)
      << rtp_last_error();
  rtp_tensor *idx = rtp_safetensors_load(ctx, st, "input.idx");
  ASSERT_NE(idx, nullptr) << rtp_last_error();
  EXPECT_EQ(idx->type, RTP_TYPE_I32);
  EXPECT_EQ(idx->ne[0], 16);
  EXPECT_EQ(idx->ne[1], 3);
  for (int i = 0; i < 48; i++) {
    int32_t x = ((int32_t *)idx->data)[i];
    EXPECT_TRUE(x >= 0 && x < 256);
  }
  rtp_tensor *logits = rtp_safetensors_load(ctx, st, "ref.logits");
  ASSERT_NE(logits, nullptr) << rtp_last_error();
  EXPECT_EQ(logits->ne[0], 256);
  EXPECT_EQ(logits->ne[1], 16);
  EXPECT_EQ(logits->ne[2], 3);
  rtp_tensor *loss = rtp_safetensors_load(ctx, st, "ref.loss");
  rtp_tensor *losses = rtp_safetensors_load(ctx, st, "ref.adam_losses");
  ASSERT_TRUE(loss && losses) << rtp_last_error();
  EXPECT_EQ(rtptest::f32_at(loss, 0), rtptest::f32_at(losses, 0));
  EXPECT_NEAR(rtptest::f32_at(loss, 0), std::log(256.0f), 0.1f);
  for (int i = 1; i < 5; i++)
    EXPECT_LT(rtptest::f32_at(losses, i), rtptest::f32_at(losses, i - 1));
  EXPECT_GE(rtp_safetensors_find(st, "grad.lm_head.weight"), 0);
  EXPECT_GE(rtp_safetensors_find(st, "adam.transformer.ln_f.bias"), 0);
  rtp_context_free(ctx);
  rtp_safetensors_close(st);
}

// ---- malformed files ------------------------------------------------------------------

const char *kGood =
    "{\"__metadata__\":{\"k\":\"v\"},"
    "\"a\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,24]},"
    "\"b\":{\"dtype\":\"I32\",\"shape\":[2],\"data_offsets\":[24,32]}}";

std::vector<uint8_t> Data(size_t n) {
  std::vector<uint8_t> d(n);
  for (size_t i = 0; i < n; i++) d[i] = (uint8_t)(i * 37 + 1);
  return d;
}

TEST_F(IoTest, HandMadeGoodFileOpens) {
  std::string path = Path("good.safetensors");
  WriteFile(path, MakeFile(kGood, Data(32)));
  rtp_safetensors *st = nullptr;
  ASSERT_EQ(rtp_safetensors_open(path.c_str(), &st), RTP_OK) << rtp_last_error();
  EXPECT_EQ(rtp_safetensors_count(st), 2);
  rtp_safetensors_close(st);
  // Whitespace around tokens and padding after the object are fine; unpadded too.
  WriteFile(path, MakeFile(" \n{ \"a\" :\t{ \"shape\" : [ 3 ] , \"dtype\" : \"F32\" , "
                           "\"data_offsets\" : [ 0 , 12 ] } }\r\n     ",
                           Data(12)));
  ASSERT_EQ(rtp_safetensors_open(path.c_str(), &st), RTP_OK) << rtp_last_error();
  rtp_safetensors_close(st);
  WriteFile(path, MakeFile("{}", {}));
  ASSERT_EQ(rtp_safetensors_open(path.c_str(), &st), RTP_OK) << rtp_last_error();
  rtp_safetensors_close(st);
}

TEST_F(IoTest, TruncatedAtEveryByte) {
  std::string src = Path("src.safetensors");
  rtp_tensor *ts[] = {F32({3, 2}, "x"), I32({5}, "y")};
  const char *meta[] = {"k", "v", nullptr};
  ASSERT_EQ(rtp_safetensors_save(src.c_str(), ts, 2, meta), RTP_OK) << rtp_last_error();
  std::vector<uint8_t> full = ReadFile(src);
  std::string path = Path("cut.safetensors");
  for (size_t n = 0; n < full.size(); n++) {
    WriteFile(path, std::vector<uint8_t>(full.begin(), full.begin() + n));
    SCOPED_TRACE("truncated to " + std::to_string(n) + " of " + std::to_string(full.size()));
    std::string msg = OpenFails(path, RTP_EFORMAT);
    EXPECT_TRUE(Contains(msg, path)) << msg;
  }
  WriteFile(path, {1, 2, 3});
  std::string msg = OpenFails(path, RTP_EFORMAT);
  EXPECT_TRUE(Contains(msg, "truncated")) << msg;
}

TEST_F(IoTest, BadHeaderLength) {
  std::string path = Path("len.safetensors");
  WriteFile(path, MakeFile(kGood, Data(32), 9999999));
  std::string msg = OpenFails(path, RTP_EFORMAT);
  EXPECT_TRUE(Contains(msg, "header length 9999999 exceeds file size")) << msg;
  WriteFile(path, MakeFile(kGood, Data(32), INT64_MAX));
  OpenFails(path, RTP_EFORMAT);
  std::vector<uint8_t> f = MakeFile(kGood, Data(32));
  for (int i = 0; i < 8; i++) f[i] = 0xff;  // 2^64 - 1
  WriteFile(path, f);
  OpenFails(path, RTP_EFORMAT);
  WriteFile(path, MakeFile(kGood, Data(32), 0));
  OpenFails(path, RTP_EFORMAT);
  WriteFile(path, MakeFile(kGood, Data(32), (int64_t)strlen(kGood) - 1));  // cuts the JSON
  OpenFails(path, RTP_EFORMAT);
  WriteFile(path, MakeFile(kGood, Data(32), (int64_t)strlen(kGood) + 4));  // eats data
  OpenFails(path, RTP_EFORMAT);
}

struct BadCase {
  const char *header;
  size_t data;
  const char *expect;  // a part of the message
};

TEST_F(IoTest, MalformedHeaders) {
  const BadCase cases[] = {
      // JSON syntax
      {"", 0, "header length"},
      {"{ ", 0, "unexpected end"},
      {"[]", 0, "expected '{'"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,12]},}", 12, "JSON"},
      {"{'a':1}", 0, "JSON"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,12]}}x", 12, "trailing"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,12]}}{}", 12, "trailing"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,12]}", 12, "JSON"},
      {"{\"a:{}}", 0, "JSON"},
      {"{\"a\\x\":{}}", 0, "bad escape"},
      {"{\"a\\", 0, "JSON"},
      {"{\"\\u12\":{}}", 0, "\\u escape"},
      {"{\"\\u12g4\":{}}", 0, "hex"},
      {"{\"\\udc00\":{}}", 0, "surrogate"},
      {"{\"\\ud800x\":{}}", 0, "surrogate"},
      {"{\"\\ud800\\u0041\":{}}", 0, "surrogate"},
      {"{\"\\u0000\":{}}", 0, "NUL"},
      {"{\"a\nb\":{}}", 0, "control"},
      {"{\"\xff\":{}}", 0, "UTF-8"},
      {"{\"\xc0\x80\":{}}", 0, "UTF-8"},      // overlong NUL
      {"{\"\xed\xa0\x80\":{}}", 0, "UTF-8"},  // encoded surrogate
      {"{\"\xe2\x82\":{}}", 0, "UTF-8"},      // cut sequence
      {"{\"a\" {}}", 0, "expected ':'"},
      {"{\"a\":{\"dtype\":\"F32\" \"shape\":[3],\"data_offsets\":[0,12]}}", 12, "JSON"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[3 4],\"data_offsets\":[0,12]}}", 12, "array"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[3,],\"data_offsets\":[0,12]}}", 12, "integer"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[03],\"data_offsets\":[0,12]}}", 12,
       "leading zero"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[-3],\"data_offsets\":[0,12]}}", 12, "negative"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[3.0],\"data_offsets\":[0,12]}}", 12, "fraction"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[3e0],\"data_offsets\":[0,12]}}", 12, "fraction"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[99999999999999999999],\"data_offsets\":[0,12]}}",
       12, "too large"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":\"3\",\"data_offsets\":[0,12]}}", 12,
       "expected '['"},
      // structure
      {"{\"a\":{\"dtype\":\"F16\",\"shape\":[3],\"data_offsets\":[0,6]}}", 6, "'F16'"},
      {"{\"a\":{\"dtype\":\"f32\",\"shape\":[3],\"data_offsets\":[0,12]}}", 12, "'f32'"},
      {"{\"a\":{\"dtype\":32,\"shape\":[3],\"data_offsets\":[0,12]}}", 12, "dtype"},
      {"{\"a\":{\"shape\":[3],\"data_offsets\":[0,12]}}", 12, "missing dtype"},
      {"{\"a\":{\"dtype\":\"F32\",\"data_offsets\":[0,12]}}", 12, "missing shape"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[3]}}", 12, "missing data_offsets"},
      {"{\"a\":{\"dtype\":\"F32\",\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,12]}}",
       12, "duplicate key 'dtype'"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,12],\"x\":1}}", 12,
       "unknown key 'x'"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,12,12]}}", 12, "not 2"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0]}}", 12, "not 2"},
      {"{\"a\":[]}", 0, "expected '{'"},
      {"{\"a\":{}}", 0, "missing"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,3],\"data_offsets\":[0,12]}}", 12,
       "5 dims, at most 4"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,12]}}", 12, "hold 12"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296,8],\"data_offsets\":[0,12]}"
       "}",
       12, "overflows"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[4611686018427387904,0],\"data_offsets\":[0,0]}}",
       0, "overflows"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2305843009213693952],\"data_offsets\":[0,12]}}",
       12, "overflows"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,100]}}", 12,
       "data offsets [0,100) out of range"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[12,0]}}", 12, "out of range"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,9223372036854775807]}}", 12,
       "out of range"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,12]},"
       "\"b\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[8,20]}}",
       20, "overlap"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,12]},"
       "\"b\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,12]}}",
       12, "overlap"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[4,16]}}", 16, "hole"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,12]}}", 13,
       "trailing bytes"},
      {"{}", 4, "no tensors"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,12]},"
       "\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[12,24]}}",
       24, "duplicate tensor name 'a'"},
      {"{\"__metadata__\":{\"k\":1}}", 0, "must be strings"},
      {"{\"__metadata__\":{\"k\":\"v\",\"k\":\"w\"}}", 0, "duplicate __metadata__ key 'k'"},
      {"{\"__metadata__\":{},\"__metadata__\":{}}", 0, "duplicate __metadata__"},
      {"{\"__metadata__\":[]}", 0, "expected '{'"},
      {"{\"__metadata__\":{\"k\":\"v\"", 0, "JSON"},
  };
  std::string path = Path("bad.safetensors");
  int i = 0;
  for (const BadCase &c : cases) {
    std::string header = c.header;
    SCOPED_TRACE("case " + std::to_string(i++) + ": " + header);
    WriteFile(path, MakeFile(header, Data(c.data)));
    std::string msg = OpenFails(path, RTP_EFORMAT);
    EXPECT_TRUE(Contains(msg, c.expect)) << msg;
    EXPECT_TRUE(Contains(msg, path)) << msg;
  }
  // NUL bytes: after the object (some writers pad with them) and inside a name.
  std::string nul = "{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,12]}}";
  WriteFile(path, MakeFile(nul + std::string(6, '\0'), Data(12)));
  EXPECT_TRUE(Contains(OpenFails(path, RTP_EFORMAT), "trailing"));
  std::string nul_name = "{\"a" + std::string(1, '\0') + "b\":{}}";
  WriteFile(path, MakeFile(nul_name, {}));
  EXPECT_TRUE(Contains(OpenFails(path, RTP_EFORMAT), "control"));
}

TEST_F(IoTest, OpenErrors) {
  rtp_safetensors *st = nullptr;
  EXPECT_EQ(rtp_safetensors_open(Path("missing.safetensors").c_str(), &st), RTP_EIO);
  EXPECT_TRUE(Contains(rtp_last_error(), "missing.safetensors")) << rtp_last_error();
  EXPECT_EQ(rtp_safetensors_open(dir_.c_str(), &st), RTP_EIO);  // a directory
  EXPECT_EQ(rtp_safetensors_open(nullptr, &st), RTP_EINVAL);
  EXPECT_EQ(rtp_safetensors_open(dir_.c_str(), nullptr), RTP_EINVAL);
  EXPECT_EQ(st, nullptr);
}

// A FIFO, a device, a directory, a link loop or an unreadable file given as a file to
// read is refused by its type (or its open's error) with one line naming it, and never
// blocks: opening a FIFO for reading waits for a writer unless told not to, so each check
// runs in a child process with a deadline. Both readers go through one check.
TEST_F(IoTest, SpecialFilesAreRefusedWithoutBlocking) {
  std::string fifo = Path("fifo"), loop = Path("loop"), sub = Path("sub"),
              secret = Path("secret"), to_fifo = Path("to-fifo");
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  ASSERT_EQ(symlink(loop.c_str(), loop.c_str()), 0);
  ASSERT_EQ(symlink(fifo.c_str(), to_fifo.c_str()), 0);
  fs::create_directory(sub);
  WriteFile(secret, std::vector<uint8_t>(16, 'x'));
  ASSERT_EQ(chmod(secret.c_str(), 0), 0);
  const struct {
    std::string path, words;
  } cases[] = {
      {fifo, ": is a FIFO, not a regular file"},
      {to_fifo, ": is a FIFO, not a regular file"},
      {"/dev/zero", ": is a character device, not a regular file"},
      {sub, ": is a directory, not a regular file"},
      {loop, ": cannot open: Too many levels of symbolic links"},
      {secret, ": cannot open: Permission denied"},
  };
  for (const auto &c : cases) {
    auto child = rtptest::run_procs(
        1,
        [&](int) {
          // root reads any file: the unreadable one is tried as nobody
          if (geteuid() == 0 && c.path == secret && setuid(65534) != 0) return 9;
          rtp_safetensors *st = nullptr;
          void *data = nullptr;
          int bad = 0;
          for (int reader = 0; reader < 2; reader++) {
            int rc = reader ? rtp_file_read(c.path.c_str(), SIZE_MAX, &data, nullptr)
                            : rtp_safetensors_open(c.path.c_str(), &st);
            std::string msg = rtp_last_error();
            if (rc != RTP_EIO || st || data || msg != c.path + c.words) {
              fprintf(stderr, "reader %d: status %d: %s\n", reader, rc, msg.c_str());
              bad++;
            }
          }
          return bad;
        },
        10);
    EXPECT_EQ(child[0].code, 0) << c.path << c.words << " (-1000: it blocked)";
  }
}

// rtp_file_read checks the size before it reads: a larger file is refused, one within the
// limit is read whole with a NUL after it.
TEST_F(IoTest, FileReadChecksTheSizeFirst) {
  std::string path = Path("text");
  WriteFile(path, std::vector<uint8_t>(100, 'a'));
  void *data = nullptr;
  size_t n = 0;
  EXPECT_EQ(rtp_file_read(path.c_str(), 99, &data, &n), RTP_EFORMAT);
  EXPECT_EQ(std::string(rtp_last_error()), path + ": 100 bytes, more than the 99 allowed");
  EXPECT_EQ(data, nullptr);
  ASSERT_EQ(rtp_file_read(path.c_str(), 100, &data, &n), RTP_OK) << rtp_last_error();
  EXPECT_EQ(n, 100u);
  EXPECT_EQ(std::string((const char *)data), std::string(100, 'a'));
  free(data);
  EXPECT_EQ(rtp_file_read(nullptr, 1, &data, &n), RTP_EINVAL);
}

// Random corruption of a good file: never a crash, an out-of-bounds access (ASan build)
// or a wrong acceptance of a broken tiling; whatever opens can be read.
TEST_F(IoTest, FuzzedFilesNeverCrash) {
  std::string src = Path("src.safetensors");
  rtp_tensor *ts[] = {F32({3, 2}, "x"), I32({5}, "yy"), F32({1}, "z")};
  const char *meta[] = {"key", "value", nullptr};
  ASSERT_EQ(rtp_safetensors_save(src.c_str(), ts, 3, meta), RTP_OK) << rtp_last_error();
  const std::vector<uint8_t> seeds[] = {ReadFile(src),
                                        ReadFile(Fixture("io-python.safetensors"))};
  std::string path = Path("fuzz.safetensors");
  std::mt19937 rng(1234);
  const char *env = getenv("RTP_IO_FUZZ_ITERS");  // more for a longer run
  const int iters = env ? atoi(env) : 4000;
  const uint8_t interesting[] = {0,   '"', '\\', '{',  '}',  '[',  ']', ',', ':', '0',
                                 '9', ' ', 'u',  0x7f, 0x80, 0xff, 'F', 'I', '-', '.'};
  int opened = 0;
  for (int iter = 0; iter < iters; iter++) {
    std::vector<uint8_t> f = seeds[iter % 2];
    int n_mut = 1 + (int)(rng() % 3);
    for (int m = 0; m < n_mut; m++) {
      size_t pos = rng() % f.size();
      switch (rng() % 4) {
        case 0:
          f[pos] = interesting[rng() % sizeof(interesting)];
          break;
        case 1:
          f[pos] ^= (uint8_t)(1u << (rng() % 8));
          break;
        case 2:
          f.erase(f.begin() + (long)pos);
          break;
        default:
          f.insert(f.begin() + (long)pos, interesting[rng() % sizeof(interesting)]);
      }
    }
    WriteFile(path, f);
    rtp_safetensors *st = nullptr;
    int rc = rtp_safetensors_open(path.c_str(), &st);
    if (rc != RTP_OK) {
      EXPECT_TRUE(rc == RTP_EFORMAT || rc == RTP_EIO || rc == RTP_ENOMEM) << rc;
      EXPECT_EQ(st, nullptr);
      continue;
    }
    opened++;
    for (int i = 0; i < rtp_safetensors_count(st); i++) {
      const char *name;
      rtp_type type;
      int64_t ne[RTP_MAX_DIMS];
      ASSERT_EQ(rtp_safetensors_info(st, i, &name, &type, nullptr, ne), RTP_OK);
      int64_t nel = ne[0] * ne[1] * ne[2] * ne[3];
      ASSERT_LE(nel, 64);  // the tiling check bounds every tensor by the file size
      std::vector<uint32_t> buf((size_t)nel + 1);
      rtp_tensor t = {};
      t.type = type;
      for (int d = 0; d < RTP_MAX_DIMS; d++) t.ne[d] = ne[d];
      t.nb[0] = 4;
      for (int d = 1; d < RTP_MAX_DIMS; d++) t.nb[d] = t.nb[d - 1] * (size_t)ne[d - 1];
      t.data = buf.data();
      EXPECT_EQ(rtp_safetensors_read(st, name, &t), RTP_OK) << rtp_last_error();
    }
    rtp_safetensors_close(st);
  }
  EXPECT_GT(opened, 0);  // mutations of data bytes, spaces, ... keep the file valid
}

// ---- read errors ----------------------------------------------------------------------

TEST_F(IoTest, ReadShapeMismatch) {
  std::string path = Path("m.safetensors");
  rtp_tensor *ts[] = {F32({4, 3}, "w"), I32({6}, "i")};
  ASSERT_EQ(rtp_safetensors_save(path.c_str(), ts, 2, nullptr), RTP_OK) << rtp_last_error();
  rtp_safetensors *st = nullptr;
  ASSERT_EQ(rtp_safetensors_open(path.c_str(), &st), RTP_OK) << rtp_last_error();

  rtp_tensor *t = rtp_tensor_new_2d(ctx_, RTP_TYPE_F32, 3, 4);
  EXPECT_EQ(rtp_safetensors_read(st, "w", t), RTP_ESHAPE);
  std::string msg = rtp_last_error();
  EXPECT_TRUE(Contains(msg, "[3, 4]")) << msg;
  EXPECT_TRUE(Contains(msg, "ne={4,3,1,1}")) << msg;
  EXPECT_TRUE(Contains(msg, "ne={3,4,1,1}")) << msg;
  EXPECT_TRUE(Contains(msg, "'w'")) << msg;

  rtp_tensor *ti = rtp_tensor_new_1d(ctx_, RTP_TYPE_F32, 6);  // wrong type
  EXPECT_EQ(rtp_safetensors_read(st, "i", ti), RTP_ESHAPE);
  msg = rtp_last_error();
  EXPECT_TRUE(Contains(msg, "I32")) << msg;
  EXPECT_TRUE(Contains(msg, "F32")) << msg;

  rtp_tensor *t3 = rtp_tensor_new_3d(ctx_, RTP_TYPE_F32, 4, 3, 2);
  EXPECT_EQ(rtp_safetensors_read(st, "w", t3), RTP_ESHAPE);
  rtp_tensor *ok = rtp_tensor_new_3d(ctx_, RTP_TYPE_F32, 4, 3, 1);  // trailing 1 is fine
  EXPECT_EQ(rtp_safetensors_read(st, "w", ok), RTP_OK) << rtp_last_error();

  EXPECT_EQ(rtp_safetensors_read(st, "missing", ok), RTP_EINVAL);
  EXPECT_TRUE(Contains(rtp_last_error(), "missing")) << rtp_last_error();
  EXPECT_EQ(rtp_safetensors_load(ctx_, st, "missing"), nullptr);
  rtp_tensor nodata = *ok;
  nodata.data = nullptr;
  EXPECT_EQ(rtp_safetensors_read(st, "w", &nodata), RTP_EINVAL);
  EXPECT_EQ(rtp_safetensors_read(st, "w", nullptr), RTP_EINVAL);
  rtp_safetensors_close(st);
}

// rtp_safetensors_check: the file must hold exactly the tensors given, by name, type and
// shape; the first one missing, extra or different is named with both shapes.
TEST_F(IoTest, CheckWantsExactlyTheTensors) {
  std::string path = Path("model.safetensors");
  rtp_tensor *w = F32({4, 3}, "w"), *b = F32({3}, "b");
  rtp_tensor *both[] = {w, b};
  ASSERT_EQ(rtp_safetensors_save(path.c_str(), both, 2, nullptr), RTP_OK) << rtp_last_error();
  rtp_safetensors *st = nullptr;
  ASSERT_EQ(rtp_safetensors_open(path.c_str(), &st), RTP_OK) << rtp_last_error();
  EXPECT_EQ(rtp_safetensors_check(st, both, 2), RTP_OK) << rtp_last_error();
  rtp_tensor *longer = F32({4, 2}, "w"), *wider = F32({5, 3}, "w"), *i32 = I32({4, 3}, "w");
  rtp_tensor *c = F32({3}, "c");
  const struct {
    std::vector<rtp_tensor *> ts;
    std::string message;
  } cases[] = {
      {{w}, ": tensor 'b' (F32 [3]) is not expected (2 tensors, 1 expected)"},
      {{w, b, c}, ": no tensor 'c' (F32 [3] expected)"},
      {{longer, b}, ": tensor 'w' is F32 [3, 4] in the file, expected F32 [2, 4]"},
      {{wider, b}, ": tensor 'w' is F32 [3, 4] in the file, expected F32 [3, 5]"},
      {{i32, b}, ": tensor 'w' is F32 [3, 4] in the file, expected I32 [3, 4]"},
      {{w, w}, ": tensor 'b' (F32 [3]) is not expected (2 tensors, 2 expected)"},
  };
  for (const auto &k : cases) {
    EXPECT_EQ(rtp_safetensors_check(st, k.ts.data(), (int)k.ts.size()), RTP_ESHAPE);
    EXPECT_EQ(std::string(rtp_last_error()), path + k.message);
  }
  EXPECT_EQ(rtp_safetensors_check(st, nullptr, 1), RTP_EINVAL);
  rtp_safetensors_close(st);
}

// ---- save errors ----------------------------------------------------------------------

TEST_F(IoTest, SaveIntoMissingDirectoryFails) {
  rtp_tensor *a = F32({3}, "a");
  std::string path = Path("no/such/dir/model.safetensors");
  EXPECT_EQ(rtp_safetensors_save(path.c_str(), &a, 1, nullptr), RTP_EIO);
  std::string msg = rtp_last_error();
  EXPECT_TRUE(Contains(msg, path)) << msg;
  EXPECT_FALSE(fs::exists(Path("no")));
  EXPECT_EQ(TempFiles(), 0);
}

TEST_F(IoTest, SaveRejectsBadTensors) {
  std::string path = Path("bad.safetensors");
  rtp_tensor *a = F32({3}, "a");
  rtp_tensor *b = F32({3}, "a");
  rtp_tensor *ab[] = {a, b};
  EXPECT_EQ(rtp_safetensors_save(path.c_str(), ab, 2, nullptr), RTP_EINVAL);
  EXPECT_TRUE(Contains(rtp_last_error(), "duplicate tensor name 'a'")) << rtp_last_error();
  rtp_tensor *noname = F32({3}, "");
  EXPECT_EQ(rtp_safetensors_save(path.c_str(), &noname, 1, nullptr), RTP_EINVAL);
  rtp_tensor *meta = F32({3}, "__metadata__");
  EXPECT_EQ(rtp_safetensors_save(path.c_str(), &meta, 1, nullptr), RTP_EINVAL);
  rtp_tensor nodata = *a;
  nodata.data = nullptr;
  rtp_tensor *pn = &nodata;
  EXPECT_EQ(rtp_safetensors_save(path.c_str(), &pn, 1, nullptr), RTP_EINVAL);
  rtp_tensor badtype = *a;
  badtype.type = RTP_TYPE_COUNT;
  rtp_tensor *pb = &badtype;
  EXPECT_EQ(rtp_safetensors_save(path.c_str(), &pb, 1, nullptr), RTP_EINVAL);
  rtp_tensor *null = nullptr;
  EXPECT_EQ(rtp_safetensors_save(path.c_str(), &null, 1, nullptr), RTP_EINVAL);
  const char *kv_dup[] = {"k", "v", "k", "w", nullptr};
  EXPECT_EQ(rtp_safetensors_save(path.c_str(), &a, 1, kv_dup), RTP_EINVAL);
  rtp_tensor *latin1 = F32({3}, "caf\xe9");
  EXPECT_EQ(rtp_safetensors_save(path.c_str(), &latin1, 1, nullptr), RTP_EINVAL);
  EXPECT_TRUE(Contains(rtp_last_error(), "UTF-8")) << rtp_last_error();
  const char *kv_bad[] = {"k", "\xff", nullptr};
  EXPECT_EQ(rtp_safetensors_save(path.c_str(), &a, 1, kv_bad), RTP_EINVAL);
  const char *kv_odd[] = {"k", nullptr};
  EXPECT_EQ(rtp_safetensors_save(path.c_str(), &a, 1, kv_odd), RTP_EINVAL);
  EXPECT_EQ(rtp_safetensors_save(nullptr, &a, 1, nullptr), RTP_EINVAL);
  EXPECT_EQ(rtp_safetensors_save(path.c_str(), &a, -1, nullptr), RTP_EINVAL);
  EXPECT_FALSE(fs::exists(path));
  EXPECT_EQ(TempFiles(), 0);
}

// When the rename cannot happen (the target is a directory), nothing is left behind.
TEST_F(IoTest, FailedRenameLeavesNoTemp) {
  std::string path = Path("target");
  fs::create_directory(path);
  rtp_tensor *a = F32({3}, "a");
  EXPECT_EQ(rtp_safetensors_save(path.c_str(), &a, 1, nullptr), RTP_EIO);
  EXPECT_TRUE(Contains(rtp_last_error(), "rename")) << rtp_last_error();
  EXPECT_TRUE(fs::is_directory(path));
  EXPECT_EQ(TempFiles(), 0);
}

// A disk that fills up during the write (simulated with RLIMIT_FSIZE in a child process)
// gives RTP_EIO, leaves the existing file as it was and removes the temporary file.
TEST_F(IoTest, FullDiskLeavesOldFileIntact) {
  std::string path = Path("ckpt.safetensors");
  rtp_tensor *small = F32({5}, "small");
  ASSERT_EQ(rtp_safetensors_save(path.c_str(), &small, 1, nullptr), RTP_OK);
  const std::vector<uint8_t> before = ReadFile(path);
  rtp_tensor *big = F32({256, 256}, "big");  // 256 KiB, over the 64 KiB limit below
  auto child = rtptest::run_procs(1, [&](int) {
    signal(SIGXFSZ, SIG_IGN);  // writes past the limit fail with EFBIG instead
    struct rlimit rl = {64 << 10, 64 << 10};
    if (setrlimit(RLIMIT_FSIZE, &rl) != 0) return 10;
    int rc = rtp_safetensors_save(path.c_str(), &big, 1, nullptr);
    if (rc != RTP_EIO) return 11;
    if (!strstr(rtp_last_error(), "write failed")) return 12;
    return 0;
  });
  ASSERT_GE(child[0].code, 0) << "killed, or not forked";
  EXPECT_EQ(child[0].code, 0) << "10 setrlimit, 11 wrong status, 12 wrong message";
  EXPECT_EQ(ReadFile(path), before);
  EXPECT_EQ(TempFiles(), 0);
  rtp_safetensors *st = nullptr;
  ASSERT_EQ(rtp_safetensors_open(path.c_str(), &st), RTP_OK) << rtp_last_error();
  EXPECT_EQ(rtp_safetensors_find(st, "small"), 0);
  rtp_safetensors_close(st);
}

// The same limit where SIGXFSZ keeps its default action, which kills the process (as in a
// shell after ulimit -f): the save fails with a message naming the limit and the process
// lives on, with the signal's disposition and its thread's mask as they were; a program's
// own handler still runs.
TEST_F(IoTest, FileSizeLimitFailsTheSaveNotTheProcess) {
  std::string path = Path("model.safetensors");
  rtp_tensor *small = F32({5}, "small");
  ASSERT_EQ(rtp_safetensors_save(path.c_str(), &small, 1, nullptr), RTP_OK);
  const std::vector<uint8_t> before = ReadFile(path);
  rtp_tensor *big = F32({256, 256}, "big");
  auto child = rtptest::run_procs(1, [&](int) {
    signal(SIGXFSZ, SIG_DFL);
    struct rlimit rl = {64 << 10, 64 << 10};
    if (setrlimit(RLIMIT_FSIZE, &rl) != 0) return 10;
    for (int i = 0; i < 2; i++) {  // the second: nothing left over from the first
      if (rtp_safetensors_save(path.c_str(), &big, 1, nullptr) != RTP_EIO) return 11;
      if (!strstr(rtp_last_error(),
                  "write failed: File too large (EFBIG: no file may grow "
                  "past 65536 bytes here, ulimit -f)"))
        return 12;
    }
    struct sigaction sa;
    sigset_t mask;
    if (sigaction(SIGXFSZ, nullptr, &sa) || sa.sa_handler != SIG_DFL) return 13;
    if (pthread_sigmask(SIG_SETMASK, nullptr, &mask) || sigismember(&mask, SIGXFSZ)) return 14;
    return 0;
  });
  ASSERT_GE(child[0].code, 0) << "killed (by SIGXFSZ?), or not forked";
  EXPECT_EQ(child[0].code, 0)
      << "10 setrlimit, 11 wrong status, 12 wrong message, 13 disposition, 14 mask";
  EXPECT_EQ(ReadFile(path), before);
  EXPECT_EQ(TempFiles(), 0);
  // A program's own handler still runs.
  child = rtptest::run_procs(1, [&](int) {
    static volatile sig_atomic_t raised;
    struct sigaction sa = {};
    sa.sa_handler = [](int) { raised = raised + 1; };
    struct rlimit rl = {64 << 10, 64 << 10};
    if (sigaction(SIGXFSZ, &sa, nullptr) || setrlimit(RLIMIT_FSIZE, &rl)) return 10;
    if (rtp_safetensors_save(path.c_str(), &big, 1, nullptr) != RTP_EIO) return 11;
    return raised == 1 ? 0 : 12;
  });
  EXPECT_EQ(child[0].code, 0) << "10 setup, 11 wrong status, 12 the handler did not run once";
}

// A target whose temporary name is too long for the filesystem (NAME_MAX) exists, but the
// temporary file cannot be made: the save fails and the old file stays.
TEST_F(IoTest, TempNotCreatableLeavesOldFileIntact) {
  std::string path = Path(std::string(250, 'm'));
  WriteFile(path, {'o', 'l', 'd'});
  rtp_tensor *a = F32({5}, "a");
  EXPECT_EQ(rtp_safetensors_save(path.c_str(), &a, 1, nullptr), RTP_EIO);
  EXPECT_TRUE(Contains(rtp_last_error(), "cannot create temporary file")) << rtp_last_error();
  EXPECT_EQ(ReadFile(path), std::vector<uint8_t>({'o', 'l', 'd'}));
  EXPECT_EQ(TempFiles(), 0);
}

// Without write permission on the directory the temporary file cannot be made: the old
// file stays. (Root ignores permissions, so this only runs as an ordinary user.)
TEST_F(IoTest, ReadOnlyDirectoryLeavesOldFileIntact) {
  if (geteuid() == 0) GTEST_SKIP() << "root ignores directory permissions";
  std::string sub = Path("ro");
  fs::create_directory(sub);
  std::string path = sub + "/m.safetensors";
  rtp_tensor *a = F32({5}, "a");
  ASSERT_EQ(rtp_safetensors_save(path.c_str(), &a, 1, nullptr), RTP_OK);
  const std::vector<uint8_t> before = ReadFile(path);
  chmod(sub.c_str(), 0555);
  rtp_tensor *b = F32({7}, "b");
  EXPECT_EQ(rtp_safetensors_save(path.c_str(), &b, 1, nullptr), RTP_EIO);
  EXPECT_TRUE(Contains(rtp_last_error(), "temporary")) << rtp_last_error();
  chmod(sub.c_str(), 0755);
  EXPECT_EQ(ReadFile(path), before);
}

// ---- the JSON reader (rtp-json.c), shared with checkpoint indexes ----------------------

// A parse of text named "f.json"; the tree is freed with it.
struct Json {
  rtp__json *doc = nullptr;
  rtp__json_fault fault = {};
  int rc;
  std::string msg;
  explicit Json(const std::string &text, rtp__json_limits lim = {}) {
    rc = rtp__json_parse("f.json", text.data(), text.size(), &lim, &doc, &fault);
    msg = rc ? rtp_last_error() : "";
  }
  ~Json() {
    rtp__json_free(doc);
  }
  const rtp__json_value *root() const {
    return rtp__json_root(doc);
  }
};

// The text fails to parse with RTP_EFORMAT and a message naming f.json and holding part.
void JsonFails(const std::string &text, const std::string &part, rtp__json_limits lim = {}) {
  Json j(text, lim);
  EXPECT_EQ(j.rc, RTP_EFORMAT) << "'" << text << "' parsed";
  EXPECT_EQ(j.doc, nullptr);
  EXPECT_TRUE(Contains(j.msg, "f.json: ")) << j.msg;
  EXPECT_TRUE(Contains(j.msg, part)) << "'" << text << "': " << j.msg;
}

// The decoded string of the JSON string text.
std::string JsonString(const std::string &text) {
  Json j(text);
  EXPECT_EQ(j.rc, RTP_OK) << text << ": " << j.msg;
  const char *s = rtp__json_str(j.doc, j.root());
  return s ? s : "(not a string)";
}

TEST(JsonReader, Escapes) {
  EXPECT_EQ(JsonString(R"("\"\\\/\b\f\n\r\t")"), "\"\\/\b\f\n\r\t");
  EXPECT_EQ(JsonString(R"("\u0041\u00e9\u20AC")"), "A\xc3\xa9\xe2\x82\xac");
  EXPECT_EQ(JsonString(R"("\ud83d\ude00 \uD83D\uDE00")"), "\xf0\x9f\x98\x80 \xf0\x9f\x98\x80");
  EXPECT_EQ(JsonString("\"raw \xc3\xa9 \xf0\x9f\x98\x80\""), "raw \xc3\xa9 \xf0\x9f\x98\x80");
  EXPECT_EQ(JsonString(R"("")"), "");
  JsonFails(R"("\x")", "bad escape '\\x'");
  JsonFails(R"("\')", "bad escape");
  JsonFails(R"("\u12")", "\\u escape");
  JsonFails(R"("\u12)", "\\u escape");
  JsonFails(R"("\u00g0")", "hex");
  JsonFails(R"("\ud800")", "high surrogate \\ud800 not followed by a low one");
  JsonFails(R"("\ud800\n")", "surrogate");
  JsonFails(R"("\ud800\ud800")", "surrogate");
  JsonFails(R"("\ude00\ud83d")", "lone low surrogate");
  JsonFails(R"("\u0000")", "NUL");
  JsonFails("\"a\tb\"", "control character (byte 0x09)");
  JsonFails(std::string("\"a\0b\"", 5), "control character (byte 0x00)");
  JsonFails("\"\xc0\xaf\"", "UTF-8");          // overlong '/'
  JsonFails("\"\xed\xb0\x80\"", "UTF-8");      // an encoded surrogate
  JsonFails("\"\xf4\x90\x80\x80\"", "UTF-8");  // beyond U+10FFFF
  JsonFails("\"\xe2\x82\"", "UTF-8");          // cut short
  JsonFails("\"\x80\"", "UTF-8");
  JsonFails("\"abc", "unterminated string");
  JsonFails("\"abc\\", "unterminated string");
  // Keys are compared decoded: "a" and "\u0061" are the same key.
  JsonFails(R"({"a": 1, "\u0061": 2})", "duplicate key 'a'");
}

TEST(JsonReader, Numbers) {
  const struct {
    const char *text;
    int64_t value;
  } ints[] = {{"0", 0},
              {"-0", 0},
              {"42", 42},
              {"-17", -17},
              {"9223372036854775807", INT64_MAX},
              {"-9223372036854775808", INT64_MIN}};
  for (const auto &c : ints) {
    Json j(c.text);
    ASSERT_EQ(j.rc, RTP_OK) << c.text << ": " << j.msg;
    EXPECT_EQ(rtp__json_kind(j.root()), RTP__JSON_INT) << c.text;
    EXPECT_EQ(rtp__json_int_value(j.root()), c.value) << c.text;
  }
  // Valid numbers that are not INTs: rtp__json_int says why.
  const struct {
    std::string text;
    const char *why;
  } others[] = {{"9223372036854775808", "too large"},
                {"-9223372036854775809", "too large"},
                {"99999999999999999999", "too large"},
                {std::string(5000, '7'), "too large"},
                {"1.5", "fraction"},
                {"3.0", "fraction"},
                {"1e3", "fraction"},
                {"1E+3", "fraction"},
                {"-0.0e-0", "fraction"},
                {"1e99999999999", "fraction"}};
  for (const auto &c : others) {
    Json j(c.text);
    ASSERT_EQ(j.rc, RTP_OK) << c.text << ": " << j.msg;
    EXPECT_EQ(rtp__json_kind(j.root()), RTP__JSON_NUMBER) << c.text;
    int64_t v;
    EXPECT_EQ(rtp__json_int(j.doc, j.root(), INT64_MIN, INT64_MAX, &v, "n"), RTP_EFORMAT);
    EXPECT_TRUE(Contains(rtp_last_error(), std::string("f.json: n: "))) << rtp_last_error();
    EXPECT_TRUE(Contains(rtp_last_error(), c.why)) << c.text << ": " << rtp_last_error();
  }
  JsonFails("01", "leading zero");
  JsonFails("-01", "leading zero");
  JsonFails("[00]", "leading zero");
  JsonFails("-", "expected a digit after '-'");
  JsonFails("-a", "expected a digit after '-'");
  JsonFails("1.", "expected a digit after '.'");
  JsonFails("1.e3", "expected a digit after '.'");
  JsonFails("1e", "exponent");
  JsonFails("1e+", "exponent");
  JsonFails(".5", "expected a value");
  JsonFails("+1", "expected a value");
  JsonFails("0x10", "trailing");
  JsonFails("NaN", "expected a value");
  JsonFails("[Infinity]", "expected a value");
  JsonFails("[1 2]", "expected ',' or ']' in array");
  JsonFails("[1,]", "expected a value");
}

TEST(JsonReader, LiteralsAndStructure) {
  Json j(R"({"t": true, "f": false, "n": null, "a": [], "o": {}})");
  ASSERT_EQ(j.rc, RTP_OK) << j.msg;
  EXPECT_EQ(rtp__json_kind(rtp__json_get(j.doc, j.root(), "t")), RTP__JSON_BOOL);
  EXPECT_STREQ(rtp__json_kind_name(rtp__json_get(j.doc, j.root(), "f")), "false");
  EXPECT_EQ(rtp__json_kind(rtp__json_get(j.doc, j.root(), "n")), RTP__JSON_NULL);
  EXPECT_EQ(rtp__json_count(rtp__json_get(j.doc, j.root(), "a")), 0u);
  EXPECT_EQ(rtp__json_child(j.doc, rtp__json_get(j.doc, j.root(), "o")), nullptr);
  EXPECT_EQ(rtp__json_get(j.doc, j.root(), "missing"), nullptr);
  JsonFails("tru", "unexpected end");
  JsonFails("trux", "expected a value");
  JsonFails("True", "expected a value");
  JsonFails("[nul]", "expected a value");
  JsonFails("{'a': 1}", "expected '\"' to start a key, found '''");
  JsonFails("{\"a\" 1}", "expected ':' after a key");
  JsonFails("{\"a\": 1,}", "expected '\"' to start a key, found '}'");
  JsonFails("{\"a\": 1 \"b\": 2}", "expected ',' or '}' in object");
  JsonFails("{1: 2}", "start a key");
  JsonFails("]", "expected a value");
  JsonFails("\xef\xbb\xbf{}", "found byte 0xef");  // no byte order mark
}

TEST(JsonReader, Nesting) {
  auto nested = [](int depth) { return std::string(depth, '[') + std::string(depth, ']'); };
  rtp__json_limits eight = {0, 8, 0};
  EXPECT_EQ(Json(nested(8), eight).rc, RTP_OK);
  JsonFails(nested(9), "nesting deeper than 8", eight);
  JsonFails(R"({"a": {"b": {"c": [[[[[[1]]]]]]}}})", "nesting deeper than 8", eight);
  EXPECT_EQ(Json(nested(64)).rc, RTP_OK);  // the default and the most any caller gets
  JsonFails(nested(65), "nesting deeper than 64");
  JsonFails(std::string(1000000, '['), "nesting deeper than 64");  // no stack overflow
  JsonFails(std::string(100000, '{'), "start a key");
}

TEST(JsonReader, DuplicateKeys) {
  Json top(R"({"a": 1, "b": 2, "a": 3})");
  EXPECT_EQ(top.rc, RTP_EFORMAT);
  EXPECT_TRUE(Contains(top.msg, "duplicate key 'a'")) << top.msg;
  EXPECT_TRUE(Contains(top.msg, "line 1, column 1")) << top.msg;  // the object's start
  EXPECT_TRUE(top.fault.duplicate);
  EXPECT_EQ(top.fault.depth, 1);
  EXPECT_STREQ(top.fault.key, "a");
  EXPECT_STREQ(top.fault.parent, "");
  Json nested("{\"x\": {\"ok\": [1, 2]},\n \"y\": {\"k\": 1, \"k\": {}}}");
  EXPECT_EQ(nested.rc, RTP_EFORMAT);
  EXPECT_TRUE(Contains(nested.msg, "line 2, column 7")) << nested.msg;
  EXPECT_EQ(nested.fault.depth, 2);
  EXPECT_STREQ(nested.fault.parent, "y");
  Json in_array(R"([{"k": 1}, {"k": 2, "k": 2}])");
  EXPECT_EQ(in_array.rc, RTP_EFORMAT);
  EXPECT_EQ(in_array.fault.depth, 2);
  EXPECT_STREQ(in_array.fault.parent, "");
  // The same key in different objects is fine; so are many keys, once each.
  EXPECT_EQ(Json(R"({"a": {"k": 1}, "b": {"k": 1}, "k": [{"k": 1}, {"k": 1}]})").rc, RTP_OK);
  std::string many = "{";
  for (int i = 0; i < 5000; i++) many += (i ? ",\"k" : "\"k") + std::to_string(i) + "\":0";
  EXPECT_EQ(Json(many + "}").rc, RTP_OK);
  JsonFails(many + ",\"k2500\":1}", "duplicate key 'k2500'");
}

TEST(JsonReader, GarbageAfterTheEnd) {
  EXPECT_EQ(Json(" \t\r\n{} \t\r\n").rc, RTP_OK);
  JsonFails("{} x", "trailing bytes after the top-level value");
  JsonFails("{}{}", "trailing");
  JsonFails("{}]", "trailing");
  JsonFails("1 2", "trailing");
  JsonFails(std::string("{}\0", 3), "trailing");
  JsonFails("{}\x0b", "trailing");  // vertical tab is not JSON whitespace
  JsonFails("", "unexpected end of input");
  JsonFails(" \n ", "unexpected end of input");
}

TEST(JsonReader, TruncatedAtEveryByte) {
  const std::string texts[] = {
      kGood,
      "{\n  \"format\": \"rtp-checkpoint\",\n  \"step\": -12,\n  \"state\": {\"s\": "
      "\"\\u00e9\\ud83d\\ude00\"},\n  \"x\": [1.5e3, true, false, null, {\"k\": []}]\n}"};
  for (const std::string &text : texts) {
    ASSERT_EQ(Json(text).rc, RTP_OK) << Json(text).msg;
    for (size_t n = 0; n < text.size(); n++) {
      SCOPED_TRACE("cut to " + std::to_string(n) + " bytes");
      JsonFails(text.substr(0, n), "byte");
    }
  }
}

TEST(JsonReader, Limits) {
  rtp__json_limits three = {0, 0, 3}, four = {0, 0, 4}, ten_bytes = {10, 0, 0};
  JsonFails("[1,2,3]", "more than 3 values", three);
  EXPECT_EQ(Json("[1,2,3]", four).rc, RTP_OK);
  JsonFails("[1, 2, 3, 4]", "12 bytes of JSON, more than the limit of 10", ten_bytes);
  EXPECT_EQ(Json("[1,2,3,4]", ten_bytes).rc, RTP_OK);
  JsonFails(std::string(100000, ' ') + "[" + std::string(100000, ' '), "unexpected end");
}

TEST(JsonReader, CheckedAccess) {
  Json j(R"({"name": "w", "shape": [6, -1], "n": 1.5, "s": "abcdef"})");
  ASSERT_EQ(j.rc, RTP_OK) << j.msg;
  const rtp__json_value *v = nullptr, *r = j.root();
  auto fails = [](int rc, const char *part) {
    EXPECT_EQ(rc, RTP_EFORMAT);
    EXPECT_TRUE(Contains(rtp_last_error(), part)) << rtp_last_error();
  };
  EXPECT_EQ(rtp__json_member(j.doc, r, "shape", RTP__JSON_ARRAY, &v, "tensor '%s'", "w"), 0);
  EXPECT_EQ(rtp__json_count(v), 2u);
  fails(rtp__json_member(j.doc, r, "dtype", RTP__JSON_STRING, &v, "tensor 'w'"),
        "f.json: tensor 'w': missing dtype");
  fails(rtp__json_member(j.doc, r, "name", RTP__JSON_ARRAY, &v, "tensor 'w'"),
        "f.json: tensor 'w': name: expected '[' (an array), found a string");
  fails(rtp__json_member(j.doc, r, "shape", RTP__JSON_OBJECT, &v, "%s", ""),
        "f.json: shape: expected '{' (an object), found an array");
  ASSERT_EQ(rtp__json_member(j.doc, r, "shape", RTP__JSON_ARRAY, &v, "t"), 0);
  const rtp__json_value *d0 = rtp__json_child(j.doc, v), *d1 = rtp__json_next(j.doc, d0);
  EXPECT_EQ(rtp__json_next(j.doc, d1), nullptr);
  EXPECT_EQ(rtp__json_key(j.doc, d0), nullptr);  // array elements have no key
  int64_t x = 0;
  EXPECT_EQ(rtp__json_int(j.doc, d0, 0, 10, &x, "shape[0]"), 0);
  EXPECT_EQ(x, 6);
  fails(rtp__json_int(j.doc, d0, 0, 5, &x, "shape[%d]", 0),
        "shape[0]: 6 is out of range [0, 5]");
  fails(rtp__json_int(j.doc, d1, 0, 10, &x, "shape[1]"), "shape[1]: negative number -1");
  fails(rtp__json_int(j.doc, rtp__json_get(j.doc, r, "n"), 0, 10, &x, "n"),
        "n: expected an integer, found a number with a fraction or exponent");
  const char *s = nullptr;
  fails(rtp__json_string(j.doc, rtp__json_get(j.doc, r, "s"), 5, &s, "s"),
        "s: a string of 6 bytes, at most 5 allowed");
  EXPECT_EQ(rtp__json_string(j.doc, rtp__json_get(j.doc, r, "s"), 6, &s, "s"), 0);
  EXPECT_STREQ(s, "abcdef");
  static const char *const keys[] = {"name", "shape", "n", nullptr};
  fails(rtp__json_only(j.doc, r, keys, "entry"), "f.json: entry: unknown key 's'");
  // Members in document order, with their keys.
  std::string order;
  for (const rtp__json_value *m = rtp__json_child(j.doc, r); m; m = rtp__json_next(j.doc, m))
    order += std::string(rtp__json_key(j.doc, m)) + ",";
  EXPECT_EQ(order, "name,shape,n,s,");
}

// Every value of a tree, visited through every accessor (for ASan to watch).
int JsonWalk(const rtp__json *doc, const rtp__json_value *v, int depth) {
  int n = 1;
  EXPECT_LE(depth, 64);
  EXPECT_NE(rtp__json_kind_name(v), nullptr);
  if (const char *s = rtp__json_str(doc, v)) {
    EXPECT_TRUE(rtp__json_utf8_valid(s, strlen(s)));
  }
  (void)rtp__json_int_value(v);
  size_t count = 0;
  for (const rtp__json_value *c = rtp__json_child(doc, v); c; c = rtp__json_next(doc, c)) {
    const char *key = rtp__json_key(doc, c);
    EXPECT_EQ(key != nullptr, rtp__json_kind(v) == RTP__JSON_OBJECT);
    if (key) {
      EXPECT_EQ(rtp__json_get(doc, v, key), c);  // keys are unique
    }
    n += JsonWalk(doc, c, depth + 1);
    count++;
  }
  EXPECT_EQ(count, rtp__json_count(v));
  return n;
}

// Random byte flips, insertions, deletions and truncations of a header and of an index:
// never a crash (ASan build) or an unchecked tree; the seed is fixed, so failures repeat.
TEST(JsonReader, FuzzedTextNeverCrashes) {
  const std::string seeds[] = {
      kGood,
      "{\n  \"format\": \"rtp-checkpoint\",\n  \"version\": 1,\n  \"step\": 3,\n  "
      "\"state\": {\"seed\": \"4\\u0032\"},\n  \"files\": [\n    {\"name\": "
      "\"rank-0.safetensors\", \"rank\": 0, \"bytes\": 1024, \"sha256\": \"00ff\"}\n  ],\n  "
      "\"tensors\": [{\"name\": \"w\", \"shape\": [6, 8], \"blocks\": [{\"rank\": 0, "
      "\"first\": 0, \"rows\": 6}]}],\n  \"x\": [-1.5e-3, true, false, null, "
      "\"\\ud83d\\ude00\"]\n}\n"};
  const char interesting[] = "\"\\{}[],:0-.eE+u \n\x7f\x80\xff\xc3";
  std::mt19937 rng(20261126);
  const char *env = getenv("RTP_IO_FUZZ_ITERS");
  const int iters = env ? atoi(env) : 20000;
  int parsed = 0;
  for (int iter = 0; iter < iters; iter++) {
    std::string t = seeds[iter % 2];
    for (int m = 1 + (int)(rng() % 4); m > 0 && !t.empty(); m--) {
      size_t pos = rng() % t.size();
      switch (rng() % 5) {
        case 0:
          t[pos] = interesting[rng() % (sizeof(interesting) - 1)];
          break;
        case 1:
          t[pos] = (char)(t[pos] ^ (1 << (rng() % 8)));
          break;
        case 2:
          t.erase(pos, 1 + rng() % 3);
          break;
        case 3:
          t.insert(pos, 1, interesting[rng() % (sizeof(interesting) - 1)]);
          break;
        default:
          t.resize(pos);
      }
    }
    rtp__json_limits lim = {0, 1 + (int)(rng() % 8), 0};
    Json j(t, lim);
    if (j.rc) {
      ASSERT_EQ(j.rc, RTP_EFORMAT) << j.msg;
      ASSERT_TRUE(Contains(j.msg, "f.json: ")) << j.msg;
      continue;
    }
    parsed++;
    EXPECT_GE(JsonWalk(j.doc, j.root(), 1), 1);
  }
  std::printf("%d damaged texts: %d parsed\n", iters, parsed);
  EXPECT_GT(parsed, iters / 50);  // spaces, digits, string bytes: many mutations stay valid
}

}  // namespace
