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
    ctx_ = rtp_init(ip);
    ASSERT_NE(ctx_, nullptr);
  }
  void TearDown() override {
    rtp_free(ctx_);
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
    rtp_tensor *t = rtp_new_tensor(ctx_, RTP_TYPE_F32, (int)ne.size(), ne.data());
    EXPECT_NE(t, nullptr);
    rtp_set_name(t, "%s", name);
    float *p = (float *)t->data;
    for (int64_t i = 0; i < rtp_nelements(t); i++) p[i] = base + 0.25f * (float)i - 1.0f / 3;
    return t;
  }

  rtp_tensor *I32(std::vector<int64_t> ne, const char *name) {
    rtp_tensor *t = rtp_new_tensor(ctx_, RTP_TYPE_I32, (int)ne.size(), ne.data());
    EXPECT_NE(t, nullptr);
    rtp_set_name(t, "%s", name);
    int32_t *p = (int32_t *)t->data;
    for (int64_t i = 0; i < rtp_nelements(t); i++) p[i] = (int32_t)(i * 7919 - 40000);
    return t;
  }

  // A tensor of the same type and shape as t, zeroed.
  rtp_tensor *Like(const rtp_tensor *t) {
    rtp_tensor *r = rtp_new_tensor(ctx_, t->type, RTP_MAX_DIMS, t->ne);
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
  for (auto *t : ts) data += rtp_nbytes(t);
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
    EXPECT_EQ(memcmp(r->data, ts[i]->data, rtp_nbytes(ts[i])), 0) << name;

    rtp_tensor *l = rtp_safetensors_load(ctx_, st, ts[i]->name);
    ASSERT_NE(l, nullptr) << rtp_last_error();
    EXPECT_STREQ(l->name, ts[i]->name);
    EXPECT_TRUE(rtp_are_same_shape(l, ts[i]));
    EXPECT_EQ(memcmp(l->data, ts[i]->data, rtp_nbytes(ts[i])), 0) << name;
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

  rtp_tensor *a = rtp_new_tensor_2d(ctx_, RTP_TYPE_F32, 3, 4);
  ASSERT_EQ(rtp_safetensors_read(st, "transposed", a), RTP_OK) << rtp_last_error();
  const float *pa = (const float *)a->data;
  for (int i = 0; i < 4; i++)
    for (int j = 0; j < 3; j++) EXPECT_EQ(pa[i * 3 + j], m[j * 4 + i]);

  rtp_tensor *b = rtp_new_tensor_2d(ctx_, RTP_TYPE_F32, 5, 3);
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

  rtp_tensor *blk = rtp_new_tensor_2d(ctx_, RTP_TYPE_F32, 4, 3);
  ASSERT_EQ(rtp_safetensors_read_rows(st, "w", 2, blk), RTP_OK) << rtp_last_error();
  EXPECT_EQ(memcmp(blk->data, (float *)w->data + 8, 12 * sizeof(float)), 0);
  ASSERT_EQ(rtp_safetensors_read_rows(st, "w", 3, blk), RTP_OK) << rtp_last_error();
  EXPECT_EQ(memcmp(blk->data, (float *)w->data + 12, 12 * sizeof(float)), 0);
  EXPECT_EQ(rtp_safetensors_read_rows(st, "w", 4, blk), RTP_ESHAPE);
  EXPECT_TRUE(Contains(rtp_last_error(), "rows [4,7)")) << rtp_last_error();
  EXPECT_EQ(rtp_safetensors_read_rows(st, "w", -1, blk), RTP_ESHAPE);
  rtp_tensor *bad = rtp_new_tensor_2d(ctx_, RTP_TYPE_F32, 3, 3);
  EXPECT_EQ(rtp_safetensors_read_rows(st, "w", 0, bad), RTP_ESHAPE);

  rtp_tensor *part = rtp_new_tensor_1d(ctx_, RTP_TYPE_I32, 4);
  ASSERT_EQ(rtp_safetensors_read_rows(st, "v", 5, part), RTP_OK) << rtp_last_error();
  EXPECT_EQ(memcmp(part->data, (int32_t *)v->data + 5, 4 * sizeof(int32_t)), 0);
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
  rtp_context *ctx = rtp_init(ip);
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
  rtp_tensor *c = rtp_new_tensor_1d(ctx, RTP_TYPE_F32, 1);
  ASSERT_EQ(rtp_safetensors_read(st, "c.scalar", c), RTP_OK) << rtp_last_error();
  EXPECT_EQ(rtp_get_f32_1d(c, 0), 3.25f);

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
  rtp_tensor *u = rtp_new_tensor_1d(ctx, RTP_TYPE_F32, 2);
  ASSERT_EQ(rtp_safetensors_read(st, uname, u), RTP_OK) << rtp_last_error();
  EXPECT_EQ(rtp_get_f32_1d(u, 0), 1.5f);
  EXPECT_EQ(rtp_get_f32_1d(u, 1), -2.5f);

  rtp_safetensors_close(st);
  rtp_free(ctx);
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
  rtp_context *ctx = rtp_init(ip);
  ASSERT_NE(ctx, nullptr);
  rtp_tensor *w = rtp_new_tensor_2d(ctx, RTP_TYPE_F32, 32, 96);  // [3d, d]
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
  EXPECT_EQ(rtp_get_f32_1d(loss, 0), rtp_get_f32_1d(losses, 0));
  EXPECT_NEAR(rtp_get_f32_1d(loss, 0), std::log(256.0f), 0.1f);
  for (int i = 1; i < 5; i++)
    EXPECT_LT(rtp_get_f32_1d(losses, i), rtp_get_f32_1d(losses, i - 1));
  EXPECT_GE(rtp_safetensors_find(st, "grad.lm_head.weight"), 0);
  EXPECT_GE(rtp_safetensors_find(st, "adam.transformer.ln_f.bias"), 0);
  rtp_free(ctx);
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

  rtp_tensor *t = rtp_new_tensor_2d(ctx_, RTP_TYPE_F32, 3, 4);
  EXPECT_EQ(rtp_safetensors_read(st, "w", t), RTP_ESHAPE);
  std::string msg = rtp_last_error();
  EXPECT_TRUE(Contains(msg, "[3, 4]")) << msg;
  EXPECT_TRUE(Contains(msg, "ne={4,3,1,1}")) << msg;
  EXPECT_TRUE(Contains(msg, "ne={3,4,1,1}")) << msg;
  EXPECT_TRUE(Contains(msg, "'w'")) << msg;

  rtp_tensor *ti = rtp_new_tensor_1d(ctx_, RTP_TYPE_F32, 6);  // wrong type
  EXPECT_EQ(rtp_safetensors_read(st, "i", ti), RTP_ESHAPE);
  msg = rtp_last_error();
  EXPECT_TRUE(Contains(msg, "I32")) << msg;
  EXPECT_TRUE(Contains(msg, "F32")) << msg;

  rtp_tensor *t3 = rtp_new_tensor_3d(ctx_, RTP_TYPE_F32, 4, 3, 2);
  EXPECT_EQ(rtp_safetensors_read(st, "w", t3), RTP_ESHAPE);
  rtp_tensor *ok = rtp_new_tensor_3d(ctx_, RTP_TYPE_F32, 4, 3, 1);  // trailing 1 is fine
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

}  // namespace
