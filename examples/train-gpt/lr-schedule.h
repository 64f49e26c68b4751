/* lr-schedule.h - train-gpt's learning rate at each step: nanoGPT's linear warm-up, then
 * constant, or a cosine or linear decay to a floor at max_steps and the floor after it.
 *
 * A pure function of the step and the schedule's flags, so that a run resumed from a
 * checkpoint (whose step and flags are in its state) continues the same curve, and tests
 * check it without training. max_steps is the schedule's length, not the steps of one run:
 * a run of 10 steps then one resumed to 20 follow the curve of one run of 20 when both
 * have --max-steps 20. */
#ifndef RTP_LR_SCHEDULE_H
#define RTP_LR_SCHEDULE_H

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

enum lr_kind { LR_CONSTANT, LR_COSINE, LR_LINEAR, LR_KIND_COUNT };

static inline const char *lr_kind_name(enum lr_kind k) {
  static const char *const names[LR_KIND_COUNT] = {"constant", "cosine", "linear"};
  return (unsigned)k < LR_KIND_COUNT ? names[k] : "?";
}

/* false, leaving *k, if name is none of lr_kind_name's. */
static inline bool lr_kind_parse(const char *name, enum lr_kind *k) {
  for (int i = 0; i < LR_KIND_COUNT && name; i++)
    if (strcmp(name, lr_kind_name((enum lr_kind)i)) == 0) {
      *k = (enum lr_kind)i;
      return true;
    }
  return false;
}

struct lr_schedule {
  enum lr_kind kind;
  int64_t warmup;    /* steps from lr / (warmup + 1) up to lr */
  int64_t max_steps; /* where a decay reaches lr_min (unused by LR_CONSTANT) */
  float lr, lr_min;
};

/* The rate of the step with 0-based index step, as nanoGPT's get_lr(it): during warm-up
 * lr * (step + 1) / (warmup + 1); then lr (constant), or the decay from lr at step warmup
 * to lr_min at step max_steps, lr_min from there on. */
static inline float lr_at(const struct lr_schedule *s, int64_t step) {
  if (step < s->warmup) return (float)((double)s->lr * (double)(step + 1) / (s->warmup + 1));
  if (s->kind == LR_CONSTANT) return s->lr;
  if (step >= s->max_steps) return s->lr_min;
  double ratio = (double)(step - s->warmup) / (double)(s->max_steps - s->warmup);
  double coeff =
      s->kind == LR_COSINE ? 0.5 * (1.0 + cos(3.14159265358979323846 * ratio)) : 1.0 - ratio;
  return (float)(s->lr_min + coeff * ((double)s->lr - s->lr_min));
}

#endif
