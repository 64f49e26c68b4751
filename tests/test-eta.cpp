// test-eta.cpp - train-gpt's ETA (examples/train-gpt/eta.h) on made-up timings: a slow
// first step and evaluations between steps must not skew the estimate of what is left.
#include <gtest/gtest.h>

#include <cstdint>

#include "eta.h"

namespace {

// The schedule of a run as train-gpt has it: an evaluation at step 1, every `every` steps
// and at the last; a checkpoint every `ckpt_every` steps (0: none but the last).
struct Schedule {
  int64_t steps, every, ckpt_every;
  double warm_s, step_s, eval_s, ckpt_s;  // the first step's time, then every step's

  bool evaluates(int64_t k) const {
    return k % every == 0 || k == 1 || k == steps;
  }
  bool saves(int64_t k) const {
    return (ckpt_every && k % ckpt_every == 0) || k == steps;
  }
  // What is left once step `done` has trained and evaluated, before its checkpoint;
  // checkpoints count only once one has been timed.
  double left(int64_t done, bool ckpts) const {
    double c = ckpts ? ckpt_s : 0, s = saves(done) ? c : 0;
    for (int64_t k = done + 1; k <= steps; k++)
      s += step_s + (evaluates(k) ? eval_s : 0) + (saves(k) ? c : 0);
    return s;
  }
};

}  // namespace

TEST(Eta, EventsLeft) {
  EXPECT_EQ(eta_events_left(1, 100, 5), 20);  // 5, 10, ..., 100
  EXPECT_EQ(eta_events_left(5, 100, 5), 19);
  EXPECT_EQ(eta_events_left(100, 103, 5), 1);  // the last step, not a multiple
  EXPECT_EQ(eta_events_left(99, 103, 5), 2);   // 100 and 103
  EXPECT_EQ(eta_events_left(103, 103, 5), 0);
  EXPECT_EQ(eta_events_left(0, 10, 1), 10);
  EXPECT_EQ(eta_events_left(3, 10, 0), 1);  // every 0: the last step only
  EXPECT_EQ(eta_events_left(10, 10, 0), 0);
}

TEST(Eta, WarmupStepLeftOut) {
  eta_times t = {};
  eta_add_step(&t, 10);
  EXPECT_DOUBLE_EQ(eta_left(&t, 100, 0, 0), 1000);  // the only step timed stands for all
  for (int i = 0; i < 3; i++) eta_add_step(&t, 1);
  EXPECT_DOUBLE_EQ(eta_left(&t, 100, 0, 0), 100);
}

TEST(Eta, EachKindAtItsOwnMean) {
  eta_times t = {};
  eta_add_step(&t, 5);
  eta_add_step(&t, 2);
  eta_add_step(&t, 4);
  t.evals = 2;
  t.evals_s = 6;
  EXPECT_DOUBLE_EQ(eta_left(&t, 10, 4, 3), 10 * 3 + 4 * 3);  // no checkpoint timed: free
  t.ckpts = 1;
  t.ckpts_s = 7;
  EXPECT_DOUBLE_EQ(eta_left(&t, 10, 4, 3), 10 * 3 + 4 * 3 + 3 * 7);
}

// A whole run fed to the estimate as train-gpt's loop feeds it: from the second step on it
// is exact while the times are steady. Elapsed / steps done, the estimate before, says
// 201 s where 30 s are left after step 2 of the first run: the warm-up and the step-1
// evaluation in a mean over two steps.
TEST(Eta, ExactFromTheSecondStep) {
  const Schedule runs[] = {{100, 5, 0, 3.0, 0.1, 1.0, 0.5},
                           {103, 5, 20, 3.0, 0.1, 1.0, 0.5},
                           {7, 1, 1, 0.5, 0.2, 0.05, 0.3}};
  for (const Schedule &r : runs) {
    eta_times t = {};
    for (int64_t k = 1; k <= r.steps; k++) {
      eta_add_step(&t, k == 1 ? r.warm_s : r.step_s);
      if (r.evaluates(k)) {
        t.evals++;
        t.evals_s += r.eval_s;
      }
      double eta = eta_left(&t, r.steps - k, eta_events_left(k, r.steps, r.every),
                            eta_events_left(k - 1, r.steps, r.ckpt_every));
      if (k >= 2) {
        EXPECT_NEAR(eta, r.left(k, t.ckpts > 0), 1e-9) << "step " << k;
      }
      if (r.saves(k)) {
        t.ckpts++;
        t.ckpts_s += r.ckpt_s;
      }
    }
  }
}
