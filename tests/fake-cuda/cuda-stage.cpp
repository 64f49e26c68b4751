// rtp-cuda-stage.cu compiled as C++ against the fake CUDA runtime (this folder's
// cuda_runtime.h comes first on the include path), for test-cuda-stage-fake.
#include "rtp-cuda-stage.cu"
