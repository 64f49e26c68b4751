/* eta.h - train-gpt's estimate of the time left, from the times measured so far.
 *
 * Elapsed time over steps done is far off early in a run: the first step warms up (the
 * arena's pages, the caches, the peers' connections) and an evaluation runs at step 1 and
 * at every log interval, so both weigh on a mean taken over a few steps. This prices the
 * steps, evaluations and checkpoints still to come each at the mean of its own kind. Pure
 * functions of the times, so tests give them made-up timings instead of a clock. */
#ifndef RTP_ETA_H
#define RTP_ETA_H

#include <stdint.h>

struct eta_times {
  int64_t steps;  /* training steps timed */
  double first_s; /* the first of them, the warm-up */
  double rest_s;  /* the others together */
  int64_t evals;
  double evals_s;
  int64_t ckpts;
  double ckpts_s;
};

static inline void eta_add_step(struct eta_times *t, double s) {
  if (t->steps++ == 0)
    t->first_s = s;
  else
    t->rest_s += s;
}

/* How many of the steps after `done` up to `last` (1-based) are a multiple of `every` or
 * `last` itself: those that evaluate or save. every 0: only `last`. */
static inline int64_t eta_events_left(int64_t done, int64_t last, int64_t every) {
  if (done >= last) return 0;
  if (every <= 0) return 1;
  return last / every - done / every + (last % every != 0);
}

static inline double eta_mean(double total, int64_t n) {
  return n > 0 ? total / (double)n : 0;
}

/* Seconds for steps, evals and ckpts more of each. The warm-up step counts only while it is
 * the one step timed; a kind not timed yet counts as free. */
static inline double eta_left(const struct eta_times *t, int64_t steps, int64_t evals,
                              int64_t ckpts) {
  double step_s = t->steps > 1 ? eta_mean(t->rest_s, t->steps - 1) : t->first_s;
  return (double)steps * step_s + (double)evals * eta_mean(t->evals_s, t->evals) +
         (double)ckpts * eta_mean(t->ckpts_s, t->ckpts);
}

#endif
