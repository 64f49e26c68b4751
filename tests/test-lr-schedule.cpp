// test-lr-schedule.cpp - train-gpt's learning-rate schedule (examples/train-gpt/
// lr-schedule.h): nanoGPT's warm-up and decays, at the steps where their formulas meet.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>

#include "lr-schedule.h"

namespace {

lr_schedule make(lr_kind kind, int64_t warmup, int64_t max_steps) {
  return lr_schedule{kind, warmup, max_steps, 6e-4f, 6e-5f};
}

TEST(LrSchedule, WarmupRisesLinearlyToTheRate) {
  for (lr_kind k : {LR_CONSTANT, LR_COSINE, LR_LINEAR}) {
    lr_schedule s = make(k, 4, 20);
    for (int64_t i = 0; i < 4; i++)
      EXPECT_FLOAT_EQ(lr_at(&s, i), 6e-4f * (float)(i + 1) / 5.0f) << lr_kind_name(k) << i;
    EXPECT_FLOAT_EQ(lr_at(&s, 4), 6e-4f) << lr_kind_name(k);  // the decay starts at lr
  }
}

TEST(LrSchedule, ConstantKeepsTheRateForever) {
  lr_schedule s = make(LR_CONSTANT, 0, 10);
  for (int64_t i : {0, 1, 9, 10, 11, 1000}) EXPECT_EQ(lr_at(&s, i), 6e-4f) << i;
}

TEST(LrSchedule, CosineIsHalfWayAtTheMiddleAndTheFloorAfterMaxSteps) {
  lr_schedule s = make(LR_COSINE, 10, 110);
  EXPECT_FLOAT_EQ(lr_at(&s, 10), 6e-4f);
  EXPECT_FLOAT_EQ(lr_at(&s, 60), 0.5f * (6e-4f + 6e-5f));
  EXPECT_NEAR(lr_at(&s, 35), 6e-5 + 0.5 * (1 + std::cos(M_PI * 0.25)) * 5.4e-4, 1e-9);
  EXPECT_FLOAT_EQ(lr_at(&s, 110), 6e-5f);
  EXPECT_FLOAT_EQ(lr_at(&s, 500), 6e-5f);
  for (int64_t i = 10; i < 110; i++) EXPECT_GT(lr_at(&s, i), lr_at(&s, i + 1)) << i;
}

TEST(LrSchedule, LinearFallsByEqualSteps) {
  lr_schedule s = make(LR_LINEAR, 0, 10);
  for (int64_t i = 0; i <= 10; i++)
    EXPECT_NEAR(lr_at(&s, i), 6e-4 - 5.4e-4 * (double)i / 10.0, 1e-9) << i;
  EXPECT_FLOAT_EQ(lr_at(&s, 11), 6e-5f);
}

TEST(LrSchedule, WarmupLongerThanTheScheduleEndsOnTheFloor) {
  lr_schedule s = make(LR_COSINE, 10, 5);
  EXPECT_FLOAT_EQ(lr_at(&s, 9), 6e-4f * 10.0f / 11.0f);
  EXPECT_FLOAT_EQ(lr_at(&s, 10), 6e-5f);
}

TEST(LrSchedule, NamesParseBack) {
  for (int i = 0; i < LR_KIND_COUNT; i++) {
    lr_kind k = LR_CONSTANT;
    EXPECT_TRUE(lr_kind_parse(lr_kind_name((lr_kind)i), &k));
    EXPECT_EQ(k, i);
  }
  lr_kind k = LR_LINEAR;
  EXPECT_FALSE(lr_kind_parse("step", &k));
  EXPECT_FALSE(lr_kind_parse(nullptr, &k));
  EXPECT_EQ(k, LR_LINEAR);
}

}  // namespace
