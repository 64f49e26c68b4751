// test-compat.cpp - the deprecated names of rtp.h (kept for one release) still work and
// do what their replacements do.
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
#include <gtest/gtest.h>

#include <cmath>

#include "rtp.h"

namespace {

TEST(Compat, OldNamesStillWork) {
  rtp_init_params ip = {1 << 20, nullptr, false, nullptr, 0};
  rtp_context *ctx = rtp_init(ip);
  ASSERT_NE(ctx, nullptr);
  rtp_tensor *x = rtp_new_tensor_1d(ctx, RTP_TYPE_F32, 1);
  rtp_tensor *a = rtp_new_tensor_2d(ctx, RTP_TYPE_F32, 1, 1);
  int64_t ne[4] = {1, 1, 1, 1};
  rtp_tensor *b = rtp_new_tensor(ctx, RTP_TYPE_F32, 4, ne);
  EXPECT_NE(rtp_new_tensor_3d(ctx, RTP_TYPE_F32, 2, 3, 4), nullptr);
  EXPECT_NE(rtp_new_tensor_4d(ctx, RTP_TYPE_F32, 2, 3, 4, 5), nullptr);
  rtp_set_param(x);
  rtp_set_input(a);
  rtp_set_name(b, "b%d", 7);
  EXPECT_EQ(rtp_get_tensor(ctx, "b7"), b);
  EXPECT_EQ(rtp_tensor_at(ctx, 0), x);
  rtp_tensor *f = rtp_add(ctx, rtp_mul(ctx, a, rtp_mul(ctx, x, x)), b);  // a x^2 + b
  rtp_set_output(f);
  rtp_graph *g = rtp_graph_new(ctx, 64);
  ASSERT_EQ(rtp_graph_build(g, f), RTP_OK);
  ASSERT_EQ(rtp_build_backward(ctx, g, f), RTP_OK);
  ASSERT_EQ(rtp_graph_plan(ctx, g), RTP_OK);
  rtp_set_f32(x, 2.0f);
  rtp_set_f32(a, 3.0f);
  rtp_set_zero(b);
  ASSERT_EQ(rtp_graph_compute(g, nullptr), RTP_OK);
  EXPECT_EQ(rtp_get_f32_1d(f, 0), 12.0f);
  EXPECT_EQ(rtp_get_f32_1d(x->grad, 0), 12.0f);
  EXPECT_TRUE(std::isnan(rtp_get_f32_1d(f, 1)));  // out of range: no status to return
  EXPECT_EQ(rtp_nelements(f), 1);
  EXPECT_EQ(rtp_nrows(f), 1);
  EXPECT_EQ(rtp_nbytes(f), 4u);
  EXPECT_EQ(rtp_n_dims(f), 1);
  EXPECT_TRUE(rtp_is_contiguous(f));
  EXPECT_TRUE(rtp_are_same_shape(f, x));
  EXPECT_GT(rtp_used_mem(ctx), 0u);
  EXPECT_EQ(rtp_adamw_default().lr, rtp_adamw_params_default().lr);
  EXPECT_EQ(rtp_set_tp(x, RTP_TP_REPLICATED, 1), RTP_OK);
  EXPECT_EQ(rtp_set_fsdp_unit(x, 1), RTP_OK);
  EXPECT_EQ(rtp_set_fsdp_unit(f, 1), RTP_EINVAL);  // not a parameter
  rtp_free(ctx);
}

// The parallel pass under its old name, on one process.
TEST(Compat, Parallelize) {
  rtp_init_params ip = {1 << 20, nullptr, false, nullptr, 0};
  rtp_context *meta = rtp_init(ip), *ctx = rtp_init(ip);
  rtp_tensor *w = rtp_new_tensor_2d(meta, RTP_TYPE_F32, 4, 4);
  rtp_tensor *x = rtp_new_tensor_2d(meta, RTP_TYPE_F32, 4, 2);
  rtp_set_param(w);
  rtp_set_input(x);
  rtp_tensor *loss = rtp_sum(meta, rtp_mul_mat(meta, w, x));
  rtp_graph *fwd = rtp_graph_new(meta, 16);
  ASSERT_EQ(rtp_graph_build(fwd, loss), RTP_OK);
  rtp_parallel_params pp = {};
  rtp_parallel *p = rtp_parallelize(ctx, fwd, loss, &pp);
  ASSERT_NE(p, nullptr) << rtp_last_error();
  EXPECT_NE(rtp_parallel_tensor(p, w), nullptr);
  rtp_free(ctx);
  rtp_free(meta);
}

}  // namespace
