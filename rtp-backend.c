/* rtp-backend.c - the public face of backends: which exist in this build, their names. */
#include "rtp-backend.h"

int rtp_backend_cuda_count(void) {
#ifdef RTP_HAVE_CUDA
  return rtp__cuda_device_count();
#else
  return 0;
#endif
}

int rtp_backend_cuda_new(int device, struct rtp_backend **out) {
  if (!out) return rtp__error(RTP_EINVAL, "rtp_backend_cuda_new: NULL out");
  *out = NULL;
#ifdef RTP_HAVE_CUDA
  return rtp__cuda_backend_new(device, out);
#else
  (void)device;
  return rtp__error(RTP_ENOSYS,
                    "rtp_backend_cuda_new: this build has no CUDA backend (configure with "
                    "-DRTP_CUDA=ON where the CUDA toolkit is installed)");
#endif
}

void rtp_backend_free(struct rtp_backend *b) {
  if (b) b->i->free(b);
}

const char *rtp_backend_name(const struct rtp_backend *b) {
  return b ? b->i->name : "cpu";
}
