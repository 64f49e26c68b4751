/* rtp-compat.c - the names of the public API before the rtp_<noun>_<verb> rule (rtp.h,
 * "deprecated names"), each the function that replaced it. Removed in 0.3. */
#include "rtp-impl.h"

#include <math.h>
#include <stdio.h>

struct rtp_context *rtp_init(struct rtp_init_params p) {
  return rtp_context_new(p);
}

void rtp_free(struct rtp_context *ctx) {
  rtp_context_free(ctx);
}

size_t rtp_used_mem(const struct rtp_context *ctx) {
  return rtp_context_used_mem(ctx);
}

struct rtp_tensor *rtp_new_tensor(struct rtp_context *ctx, enum rtp_type type, int n_dims,
                                  const int64_t *ne) {
  return rtp_tensor_new(ctx, type, n_dims, ne);
}

struct rtp_tensor *rtp_new_tensor_1d(struct rtp_context *ctx, enum rtp_type type, int64_t ne0) {
  return rtp_tensor_new_1d(ctx, type, ne0);
}

struct rtp_tensor *rtp_new_tensor_2d(struct rtp_context *ctx, enum rtp_type type, int64_t ne0,
                                     int64_t ne1) {
  return rtp_tensor_new_2d(ctx, type, ne0, ne1);
}

struct rtp_tensor *rtp_new_tensor_3d(struct rtp_context *ctx, enum rtp_type type, int64_t ne0,
                                     int64_t ne1, int64_t ne2) {
  return rtp_tensor_new_3d(ctx, type, ne0, ne1, ne2);
}

struct rtp_tensor *rtp_new_tensor_4d(struct rtp_context *ctx, enum rtp_type type, int64_t ne0,
                                     int64_t ne1, int64_t ne2, int64_t ne3) {
  return rtp_tensor_new_4d(ctx, type, ne0, ne1, ne2, ne3);
}

void rtp_set_param(struct rtp_tensor *t) {
  rtp_tensor_set_param(t);
}

void rtp_set_input(struct rtp_tensor *t) {
  rtp_tensor_set_input(t);
}

void rtp_set_output(struct rtp_tensor *t) {
  rtp_tensor_set_output(t);
}

struct rtp_tensor *rtp_set_name(struct rtp_tensor *t, const char *fmt, ...) {
  if (!t) return NULL;
  char name[RTP_MAX_NAME];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(name, sizeof(name), fmt, ap);
  va_end(ap);
  return rtp_tensor_set_name(t, "%s", name);
}

struct rtp_tensor *rtp_get_tensor(struct rtp_context *ctx, const char *name) {
  return rtp_context_find_tensor(ctx, name);
}

struct rtp_tensor *rtp_tensor_at(struct rtp_context *ctx, int n) {
  return rtp_context_tensor_at(ctx, n);
}

void rtp_set_f32(struct rtp_tensor *t, float v) {
  (void)rtp_tensor_fill_f32(t, v);
}

void rtp_set_zero(struct rtp_tensor *t) {
  (void)rtp_tensor_set_zero(t);
}

float rtp_get_f32_1d(const struct rtp_tensor *t, int64_t i) {
  float v;
  return rtp_tensor_get_f32(t, i, &v) == RTP_OK ? v : NAN;
}

int64_t rtp_nelements(const struct rtp_tensor *t) {
  return rtp_tensor_nelements(t);
}

int64_t rtp_nrows(const struct rtp_tensor *t) {
  return rtp_tensor_nrows(t);
}

size_t rtp_nbytes(const struct rtp_tensor *t) {
  return rtp_tensor_nbytes(t);
}

int rtp_n_dims(const struct rtp_tensor *t) {
  return rtp_tensor_n_dims(t);
}

bool rtp_is_contiguous(const struct rtp_tensor *t) {
  return rtp_tensor_is_contiguous(t);
}

bool rtp_are_same_shape(const struct rtp_tensor *a, const struct rtp_tensor *b) {
  return rtp_tensor_same_shape(a, b);
}

int rtp_build_backward(struct rtp_context *ctx, struct rtp_graph *g, struct rtp_tensor *loss) {
  return rtp_graph_build_backward(ctx, g, loss);
}

struct rtp_adamw_params rtp_adamw_default(void) {
  return rtp_adamw_params_default();
}

int rtp_set_tp(struct rtp_tensor *param, enum rtp_tp_role role, int groups) {
  return rtp_tensor_set_tp(param, role, groups);
}

int rtp_set_fsdp_unit(struct rtp_tensor *param, int unit) {
  return rtp_tensor_set_fsdp_unit(param, unit);
}

struct rtp_parallel *rtp_parallelize(struct rtp_context *ctx, const struct rtp_graph *fwd,
                                     struct rtp_tensor *loss,
                                     const struct rtp_parallel_params *params) {
  return rtp_parallel_new(ctx, fwd, loss, params);
}
