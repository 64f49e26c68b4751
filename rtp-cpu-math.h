/* rtp-cpu-math.h - float math for the CPU kernels that must vectorise (rtp-cpu.c,
 * rtp-cpu-attn.c): libm's functions have branches and calls that keep loops scalar. */
#ifndef RTP_CPU_MATH_H
#define RTP_CPU_MATH_H

#include <stdint.h>
#include <string.h>

/* exp(x) for float, branch-free so loops over it vectorise (libm's expf does not):
 * x = n ln2 + r with |r| <= ln2 / 2, e^r by a degree-6 polynomial, 2^n by exponent bits.
 * Relative error below 2e-7 over the clamped range. NaN in, NaN out. */
static inline float fast_expf(float x) {
  /* Written so that NaN, which fails every comparison, is clamped too: n must stay in
   * [-126, 127] for the exponent bits (a NaN converted to int would shift a negative
   * value), and the NaN comes back out at the end, so a diverged model's NaN is seen. */
  float c = x > -87.0f ? (x < 88.0f ? x : 88.0f) : -87.0f;
  /* Adding 1.5 * 2^23 rounds to an integer in plain float arithmetic. */
  float n = (c * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = c - n * 0.693145751953125f;
  r = r - n * 1.428606765330187e-06f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  int32_t bits = ((int32_t)n + 127) << 23;
  float scale;
  memcpy(&scale, &bits, sizeof(scale));
  return x == x ? p * scale : x;
}

#endif /* RTP_CPU_MATH_H */
