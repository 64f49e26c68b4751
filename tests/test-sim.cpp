// The simulated device (rtp_backend_sim_new) itself: host copies through it, and its memory
// closed to any other host access, so that the tests of device paths that use it (here and
// in test-device) fail on a host access they should not make.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

extern "C" {
#include "rtp-backend.h"
}

namespace {

struct Sim {
  rtp_backend *b = nullptr;
  Sim() {
    EXPECT_EQ(rtp_backend_sim_new(3, &b), RTP_OK) << rtp_last_error();
  }
  ~Sim() {
    rtp_backend_free(b);
  }
  Sim(const Sim &) = delete;
  Sim &operator=(const Sim &) = delete;
};

// A context of the simulated device with one f32 vector of n elements.
struct SimVector {
  Sim dev;
  rtp_context *ctx = nullptr;
  rtp_tensor *t = nullptr;
  explicit SimVector(int64_t n) {
    rtp_init_params ip = {1 << 20, nullptr, false, dev.b, 1 << 20};
    ctx = rtp_context_new(ip);
    if (ctx) t = rtp_tensor_new_1d(ctx, RTP_TYPE_F32, n);
  }
  ~SimVector() {
    rtp_context_free(ctx);
  }
};

TEST(Sim, NewNamesAndRefuses) {
  EXPECT_EQ(rtp_backend_sim_new(1, nullptr), RTP_EINVAL);
  Sim s;
  ASSERT_NE(s.b, nullptr);
  EXPECT_STREQ(rtp_backend_name(s.b), "sim");
  EXPECT_EQ(rtp__sim_host_touches_while_busy(s.b), 0);
  EXPECT_EQ(rtp__sim_set_order(nullptr, RTP__SIM_RANDOM), RTP_EINVAL);
  EXPECT_EQ(rtp__sim_host_touches_while_busy(nullptr), -1);
}

TEST(Sim, HostCopiesGoThroughTheBackend) {
  SimVector v(1000);
  ASSERT_NE(v.t, nullptr) << rtp_last_error();
  EXPECT_STREQ(rtp_backend_name(rtp__tensor_backend(v.t)), "sim");
  std::vector<float> x(1000), y(1000, -1.0f);
  for (size_t i = 0; i < x.size(); i++) x[i] = 0.5f * (float)i - 7.0f;
  ASSERT_EQ(rtp_tensor_set(v.t, x.data(), 0, x.size() * 4), RTP_OK);
  ASSERT_EQ(rtp_tensor_get(v.t, y.data(), 0, y.size() * 4), RTP_OK);
  EXPECT_EQ(x, y);
  float f = 0;
  ASSERT_EQ(rtp_tensor_get_f32(v.t, 999, &f), RTP_OK);
  EXPECT_EQ(f, x[999]);
  ASSERT_EQ(rtp_tensor_set_zero(v.t), RTP_OK);
  ASSERT_EQ(rtp_tensor_get_f32(v.t, 3, &f), RTP_OK);
  EXPECT_EQ(f, 0.0f);
  EXPECT_EQ(rtp__sim_host_touches_while_busy(v.dev.b), 0);
}

// A copy to or from bytes the device does not hold is refused, not made.
TEST(Sim, CopiesOutsideItsMemoryAreRefused) {
  Sim s;
  float host[4] = {1, 2, 3, 4}, out[4];
  EXPECT_EQ(s.b->i->set(s.b, host, out, sizeof(host)), RTP_EINVAL);
  EXPECT_NE(std::strstr(rtp_last_error(), "not device memory"), nullptr) << rtp_last_error();
  void *mem = nullptr;
  ASSERT_EQ(s.b->i->alloc(s.b, 100, &mem), RTP_OK);
  EXPECT_EQ(s.b->i->get(s.b, out, (char *)mem + 90, 16), RTP_EINVAL);  // runs past its end
  ASSERT_EQ(s.b->i->get(s.b, out, mem, 16), RTP_OK);
  EXPECT_TRUE(std::isnan(out[0]));  // fresh memory is NaN, so a read of it shows
  s.b->i->release(s.b, mem);
}

// What the protection is for: host code that reads or writes device data directly.
TEST(SimDeathTest, HostReadOfDeviceDataFaults) {
  SimVector v(16);
  ASSERT_NE(v.t, nullptr) << rtp_last_error();
  EXPECT_DEATH(
      {
        volatile float x = *(const volatile float *)v.t->data;
        (void)x;
      },
      "");
}

TEST(SimDeathTest, HostWriteOfDeviceDataFaults) {
  SimVector v(16);
  ASSERT_NE(v.t, nullptr) << rtp_last_error();
  EXPECT_DEATH(*(volatile float *)v.t->data = 1.0f, "");
}

}  // namespace
