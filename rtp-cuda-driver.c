/* rtp-cuda-driver.c - whether the NVIDIA driver's library can be loaded, for the messages
 * of a CUDA backend or nccl transport that finds no usable device. The static CUDA runtime
 * opens libcuda itself and reports only "driver insufficient"; a user needs to hear that
 * the library is missing (a host without a GPU, or a container without the driver). */
#include <dlfcn.h>
#include <stdio.h>

#include "rtp-impl.h"

#define RTP_CUDA_DRIVER "libcuda.so.1"

int rtp__cuda_driver_why(char *buf, size_t n) {
  void *lib = dlopen(RTP_CUDA_DRIVER, RTLD_LAZY | RTLD_LOCAL | RTLD_NOLOAD);
  if (!lib) lib = dlopen(RTP_CUDA_DRIVER, RTLD_LAZY | RTLD_LOCAL);
  if (lib) {
    dlclose(lib);
    return 0;
  }
  const char *e = dlerror();
  snprintf(buf, n, "the NVIDIA driver's library %s cannot be loaded: %s", RTP_CUDA_DRIVER,
           e ? e : "?");
  return 1;
}
