// The C++ wrapper (rtp-cpp/rtp.hpp): owners free and move, failures throw rtp::error with
// the library's status and message, and a model trains through it.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <type_traits>
#include <vector>
#include <unistd.h>

#include "rtp.hpp"
#include "test-util.h"

namespace {

static_assert(!std::is_copy_constructible_v<rtp::context>, "owners are move-only");
static_assert(!std::is_copy_assignable_v<rtp::threadpool>, "owners are move-only");
static_assert(std::is_nothrow_move_constructible_v<rtp::safetensors>, "owners move");
static_assert(std::is_base_of_v<std::runtime_error, rtp::error>, "catchable as std");

// Runs f, expecting an rtp::error with this status whose message contains text.
template <class F>
void expect_error(F f, int status, const std::string &text) {
  try {
    f();
    ADD_FAILURE() << "no exception; expected " << rtp_strerror(status);
  } catch (const rtp::error &e) {
    EXPECT_EQ(e.status(), status) << e.what();
    EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
  }
}

TEST(Cpp, OwnersMoveAndFree) {
  rtp::context a(1 << 20);
  rtp_context *raw = a;
  ASSERT_NE(raw, nullptr);
  rtp::context b(std::move(a));
  EXPECT_EQ(a.get(), nullptr);  // NOLINT: a moved-from owner is empty
  EXPECT_EQ(b.get(), raw);
  rtp::context c(1 << 16);
  c = std::move(b);  // frees c's old arena (ASan would report a leak otherwise)
  EXPECT_EQ(c.get(), raw);
  EXPECT_NE(rtp_tensor_new_1d(c, RTP_TYPE_F32, 4), nullptr);

  rtp::threadpool tp(2);
  EXPECT_EQ(tp.size(), 2);
  rtp::threadpool tp2 = std::move(tp);
  EXPECT_EQ(tp2.size(), 2);
  EXPECT_FALSE(tp);
}

// The simulated device through the wrapper: a context on it takes and gives data.
TEST(Cpp, SimBackendHoldsAContextsData) {
  rtp::backend dev = rtp::backend::sim(7);
  EXPECT_STREQ(dev.name(), "sim");
  rtp::context ctx(1 << 16, nullptr, false, dev, 1 << 16);
  rtp_tensor *t = rtp_tensor_new_1d(ctx, RTP_TYPE_F32, 3);
  const float x[3] = {1.5f, -2.0f, 8.0f};
  float y[3] = {};
  ASSERT_EQ(rtp_tensor_set(t, x, 0, sizeof(x)), RTP_OK);
  ASSERT_EQ(rtp_tensor_get(t, y, 0, sizeof(y)), RTP_OK);
  EXPECT_EQ(std::vector<float>(y, y + 3), std::vector<float>(x, x + 3));
}

TEST(Cpp, ShapeMismatchThrowsWithTheContextMessage) {
  rtp::context ctx(1 << 20);
  rtp_tensor *a = ctx.check(rtp_tensor_new_1d(ctx, RTP_TYPE_F32, 3));
  rtp_tensor *b = ctx.check(rtp_tensor_new_1d(ctx, RTP_TYPE_F32, 4));
  expect_error([&] { ctx.check(rtp_add(ctx, a, b)); }, RTP_ESHAPE, "add");
  // The first error stays recorded: a later builder given NULL reports it again.
  expect_error([&] { ctx.check(rtp_gelu(ctx, rtp_add(ctx, a, b))); }, RTP_ESHAPE, "add");
}

TEST(Cpp, ArenaFullThrows) {
  rtp::context ctx(64 << 10);
  expect_error([&] { ctx.check(rtp_tensor_new_1d(ctx, RTP_TYPE_F32, 1 << 20)); }, RTP_ENOMEM,
               "arena full");
}

TEST(Cpp, GraphMisuseThrows) {
  rtp::context ctx(1 << 20);
  rtp_tensor *x = ctx.check(rtp_tensor_new_1d(ctx, RTP_TYPE_F32, 4));
  rtp_tensor *y = ctx.check(rtp_sum(ctx, x));
  rtp::graph g(ctx, 16);
  g.build(y);
  expect_error([&] { g.compute(); }, RTP_ESTATE, "plan");
  expect_error([&] { g.backward(y); }, RTP_EINVAL, "no parameter");
  g.plan();
  expect_error([&] { g.plan(); }, RTP_ESTATE, "already planned");
  rtp_tensor_fill_f32(x, 2.0f);
  g.compute();
  EXPECT_EQ(rtptest::f32_at(y, 0), 8.0f);
  rtp::context fresh(1 << 20);
  expect_error([&] { rtp::graph(fresh, 0); }, RTP_EINVAL, "size");
}

TEST(Cpp, MissingOrCorruptSafetensorsThrows) {
  expect_error([] { rtp::safetensors st("/nonexistent/model.safetensors"); }, RTP_EIO,
               "/nonexistent/model.safetensors");
  std::string path = testing::TempDir() + "rtp-cpp-corrupt.safetensors";
  FILE *f = std::fopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr);
  const char bytes[] = "\x09\0\0\0\0\0\0\0{not json";
  std::fwrite(bytes, 1, sizeof(bytes) - 1, f);
  std::fclose(f);
  expect_error([&] { rtp::safetensors st(path); }, RTP_EFORMAT, path);
  unlink(path.c_str());
}

TEST(Cpp, SafetensorsRoundTrip) {
  std::string path = testing::TempDir() + "rtp-cpp-roundtrip.safetensors";
  rtp::context ctx(1 << 20);
  rtp_tensor *w = ctx.check(rtp_tensor_new_2d(ctx, RTP_TYPE_F32, 3, 2));
  rtp_tensor_set_name(w, "w");
  for (int i = 0; i < 6; i++) static_cast<float *>(w->data)[i] = 0.5f * i;
  rtp::safetensors::save(path, {w}, {"who", "test-cpp"});

  rtp::safetensors st(path);
  EXPECT_EQ(st.count(), 1);
  EXPECT_EQ(st.find("w"), 0);
  EXPECT_EQ(st.find("nope"), -1);
  EXPECT_STREQ(st.meta("who"), "test-cpp");
  rtp_tensor *back = st.load(ctx, "w");
  EXPECT_EQ(rtptest::f32_at(back, 5), 2.5f);
  rtp_tensor *wrong = ctx.check(rtp_tensor_new_1d(ctx, RTP_TYPE_F32, 5));
  expect_error([&] { st.read("w", wrong); }, RTP_ESHAPE, "w");
  expect_error([&] { st.read("nope", wrong); }, RTP_EINVAL, "nope");
  expect_error([&] { rtp::safetensors::save(path, {w, w}); }, RTP_EINVAL, "w");
  unlink(path.c_str());
}

TEST(Cpp, LocalCommunicator) {
  rtp_comm_params p = rtp_comm_params_default();
  rtp::comm c(p);
  EXPECT_EQ(c.rank(), 0);
  EXPECT_EQ(c.size(), 1);
  EXPECT_NO_THROW(c.check_status());
  p.world_size = 0;
  expect_error([&] { rtp::comm bad(p); }, RTP_EINVAL, "");
}

// A two-layer perceptron learns four points through the wrapper alone.
TEST(Cpp, TrainingLoop) {
  rtp::context ctx(4 << 20);
  rtp_tensor *x = ctx.check(rtp_tensor_new_2d(ctx, RTP_TYPE_F32, 2, 4));
  rtp_tensor *y = ctx.check(rtp_tensor_new_1d(ctx, RTP_TYPE_I32, 4));
  rtp_tensor *w1 = ctx.check(rtp_tensor_new_2d(ctx, RTP_TYPE_F32, 2, 16));
  rtp_tensor *b1 = ctx.check(rtp_tensor_new_1d(ctx, RTP_TYPE_F32, 16));
  rtp_tensor *w2 = ctx.check(rtp_tensor_new_2d(ctx, RTP_TYPE_F32, 16, 2));
  for (int i = 0; i < 4; i++) {
    static_cast<float *>(x->data)[2 * i] = static_cast<float>(i & 1);
    static_cast<float *>(x->data)[2 * i + 1] = static_cast<float>(i >> 1);
    static_cast<int32_t *>(y->data)[i] = (i & 1) ^ (i >> 1);
  }
  int k = 0;
  for (rtp_tensor *p : {w1, b1, w2}) {
    rtp_tensor_set_param(p);
    for (int64_t i = 0; i < rtp_tensor_nelements(p); i++)
      static_cast<float *>(p->data)[i] = 0.5f * std::sin(1.7f * static_cast<float>(k++));
  }
  rtp_tensor *h = rtp_gelu(ctx, rtp_add(ctx, rtp_mul_mat(ctx, w1, x), b1));
  rtp_tensor *loss = ctx.check(rtp_cross_entropy(ctx, rtp_mul_mat(ctx, w2, h), y));

  rtp::graph g(ctx, 128);
  g.build(loss).backward(loss).plan();
  rtp_adamw_params hp = rtp_adamw_params_default();
  hp.lr = 0.05f;
  rtp::optimizer opt(ctx, g, hp);
  rtp::threadpool tp(2);
  float first = 0, last = 0;
  for (int step = 0; step < 100; step++) {
    g.compute(tp);
    last = rtptest::f32_at(loss, 0);
    if (step == 0) first = last;
    opt.step(tp);
  }
  EXPECT_EQ(opt.steps(), 100);
  EXPECT_LT(last, 0.05f * first) << "first " << first << " last " << last;
  rtp_mem_report r = ctx.mem_report();
  EXPECT_GT(r.bytes[RTP_ROLE_OPTIM], 0u);
}

}  // namespace
