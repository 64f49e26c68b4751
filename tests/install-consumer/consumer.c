/* f(x) = 3x^2 + 4 at x = 2 and its gradient, through the installed library. */
#include <rtp.h>
#include <stdio.h>

int main(void) {
  struct rtp_init_params ip = {.mem_size = 1 << 20, .no_alloc = false};
  struct rtp_context *ctx = rtp_init(ip);
  struct rtp_tensor *x = rtp_new_tensor_1d(ctx, RTP_TYPE_F32, 1);
  rtp_set_param(x);
  struct rtp_tensor *f = rtp_add(ctx, rtp_scale(ctx, rtp_mul(ctx, x, x), 3.0f), x);
  struct rtp_graph *g = rtp_graph_new(ctx, 32);
  if (rtp_graph_build(g, f) || rtp_build_backward(ctx, g, f) || rtp_graph_plan(ctx, g)) {
    fprintf(stderr, "consumer: %s\n", rtp_last_error());
    return 1;
  }
  rtp_set_f32(x, 2.0f);
  if (rtp_graph_compute(g, NULL)) return 1;
  float v = rtp_get_f32_1d(f, 0), d = rtp_get_f32_1d(x->grad, 0);
  printf("f=%g df=%g\n", v, d);
  rtp_free(ctx);
  return v == 14.0f && d == 13.0f ? 0 : 1;
}
