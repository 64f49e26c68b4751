/*
 * embed-c.c - the smallest complete use of rtp from C: build a model, train it, save it.
 *
 * The model is a two-layer perceptron that learns XOR of two bits (the classic problem a
 * linear model cannot solve). The steps are the same for any model, a GPT included:
 *
 *   1. one context = one arena: every tensor, graph and optimizer state comes from it;
 *   2. parameters are tensors marked with rtp_tensor_set_param; op builders record the model;
 *   3. a graph is built from the loss, differentiated and planned once;
 *   4. each step computes the graph (forward + backward) and runs the optimizer;
 *   5. rtp_safetensors_save writes the parameters by name, for rtp or PyTorch to read.
 *
 * Every call that can fail is checked and its message (rtp_last_error) printed.
 *
 *     embed-c [OUT.safetensors]      (default: mlp.safetensors)
 */
#include <stdio.h>
#include <stdlib.h>

#include "rtp.h"

/* Prints the library's message for a failed call and exits. */
static void check(int status, const char *what) {
  if (status == RTP_OK) return;
  fprintf(stderr, "embed-c: %s: %s (%s)\n", what, rtp_last_error(), rtp_strerror(status));
  exit(1);
}

/* Builders return NULL on bad input (or NULL input) and the context keeps the first error,
 * so a whole model is checked once, at its last tensor. */
static void check_built(struct rtp_context *ctx, const void *last, const char *what) {
  if (last) return;
  int status = rtp_context_error(ctx, NULL);
  check(status ? status : RTP_EINVAL, what);
}

/* Small reproducible starting weights in [-0.5, 0.5). */
static void fill_random(struct rtp_tensor *t, unsigned *seed) {
  float *p = t->data;
  for (int64_t i = 0; i < rtp_tensor_nelements(t); i++) {
    *seed = *seed * 1103515245u + 12345u;
    p[i] = (float)(*seed >> 8) / 16777216.0f - 0.5f;
  }
}

int main(int argc, char **argv) {
  const char *out = argc > 1 ? argv[1] : "mlp.safetensors";
  enum { IN = 2, HIDDEN = 16, CLASSES = 2, N = 4 };

  /* 1. A 4 MiB arena is plenty for this model, its gradients and Adam's states. */
  struct rtp_context *ctx = rtp_context_new((struct rtp_init_params){.mem_size = 4 << 20});
  if (!ctx) check(RTP_ENOMEM, "rtp_context_new");

  /* 2. Tensors: the data, x {IN, N} and labels y {N}, and the parameters, named as
   * PyTorch's nn.Linear names them (a weight [out, in] has ne = {in, out}). */
  struct rtp_tensor *x = rtp_tensor_new_2d(ctx, RTP_TYPE_F32, IN, N);
  struct rtp_tensor *y = rtp_tensor_new_1d(ctx, RTP_TYPE_I32, N);
  struct rtp_tensor *w1 =
      rtp_tensor_set_name(rtp_tensor_new_2d(ctx, RTP_TYPE_F32, IN, HIDDEN), "fc1.weight");
  struct rtp_tensor *b1 =
      rtp_tensor_set_name(rtp_tensor_new_1d(ctx, RTP_TYPE_F32, HIDDEN), "fc1.bias");
  struct rtp_tensor *w2 =
      rtp_tensor_set_name(rtp_tensor_new_2d(ctx, RTP_TYPE_F32, HIDDEN, CLASSES), "fc2.weight");
  struct rtp_tensor *params[] = {w1, b1, w2};
  for (int i = 0; i < 3; i++) rtp_tensor_set_param(params[i]);

  /* The model: loss = cross_entropy(w2 . gelu(w1 . x + b1), y). Nothing runs yet: the
   * builders only record nodes. */
  struct rtp_tensor *h = rtp_gelu(ctx, rtp_add(ctx, rtp_mul_mat(ctx, w1, x), b1));
  struct rtp_tensor *loss = rtp_cross_entropy(ctx, rtp_mul_mat(ctx, w2, h), y);
  check_built(ctx, loss, "building the model");

  /* Leaf tensors have their data in the arena already: the four XOR cases, random weights. */
  for (int i = 0; i < N; i++) {
    ((float *)x->data)[i * IN] = (float)(i & 1);
    ((float *)x->data)[i * IN + 1] = (float)(i >> 1);
    ((int32_t *)y->data)[i] = (i & 1) ^ (i >> 1);
  }
  unsigned seed = 42;
  for (int i = 0; i < 3; i++) fill_random(params[i], &seed);

  /* 3. Graph: forward nodes, then gradient nodes, then memory placement (once). */
  struct rtp_graph *g = rtp_graph_new(ctx, 128);
  check_built(ctx, g, "rtp_graph_new");
  check(rtp_graph_build(g, loss), "rtp_graph_build");
  check(rtp_graph_build_backward(ctx, g, loss), "rtp_graph_build_backward");
  check(rtp_graph_plan(ctx, g), "rtp_graph_plan");

  struct rtp_adamw_params hp = rtp_adamw_params_default();
  hp.lr = 0.05f;
  struct rtp_optimizer *opt = rtp_optimizer_new(ctx, g, hp);
  check_built(ctx, opt, "rtp_optimizer_new");

  /* 4. Training: compute fills loss and every parameter's grad; the optimizer applies them.
   * NULL thread pool: run on this thread (a model this small gains nothing from more). */
  for (int step = 1; step <= 100; step++) {
    check(rtp_graph_compute(g, NULL), "rtp_graph_compute");
    check(rtp_optimizer_step(opt, NULL), "rtp_optimizer_step");
    float l;
    check(rtp_tensor_get_f32(loss, 0, &l), "rtp_tensor_get_f32");
    if (step == 1 || step % 25 == 0) printf("step %3d  loss %.4f\n", step, l);
  }

  /* 5. Save the parameters (by their names) with a line of metadata. */
  const char *meta[] = {"model", "xor-mlp", NULL};
  check(rtp_safetensors_save(out, params, 3, meta), "rtp_safetensors_save");
  printf("saved %s\n", out);

  rtp_context_free(ctx);
  return 0;
}
