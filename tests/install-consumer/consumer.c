/* f(x) = 3x^2 + 4 at x = 2 and its gradient, through the installed library. */
#include <rtp.h>
#include <stdio.h>

int main(void) {
  struct rtp_init_params ip = {.mem_size = 1 << 20, .no_alloc = false};
  struct rtp_context *ctx = rtp_context_new(ip);
  struct rtp_tensor *x = rtp_tensor_new_1d(ctx, RTP_TYPE_F32, 1);
  rtp_tensor_set_param(x);
  struct rtp_tensor *f = rtp_add(ctx, rtp_scale(ctx, rtp_mul(ctx, x, x), 3.0f), x);
  struct rtp_graph *g = rtp_graph_new(ctx, 32);
  if (rtp_graph_build(g, f) || rtp_graph_build_backward(ctx, g, f) || rtp_graph_plan(ctx, g)) {
    fprintf(stderr, "consumer: %s\n", rtp_last_error());
    return 1;
  }
  if (rtp_tensor_fill_f32(x, 2.0f) || rtp_graph_compute(g, NULL)) return 1;
  float v, d;
  if (rtp_tensor_get_f32(f, 0, &v) || rtp_tensor_get_f32(x->grad, 0, &d)) return 1;
  printf("f=%g df=%g\n", v, d);
  rtp_context_free(ctx);
  return v == 14.0f && d == 13.0f ? 0 : 1;
}
