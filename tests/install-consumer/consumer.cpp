// The C++ wrapper from the installed headers: an error becomes an exception.
#include <rtp.hpp>

#include <cstdio>

int main() {
  rtp::context ctx(1 << 20);
  rtp_tensor *a = rtp_tensor_new_1d(ctx, RTP_TYPE_F32, 3);
  rtp_tensor *b = rtp_tensor_new_1d(ctx, RTP_TYPE_F32, 4);
  try {
    ctx.check(rtp_add(ctx, a, b));
  } catch (const rtp::error &e) {
    std::printf("caught: %s\n", e.what());
    return e.status() == RTP_ESHAPE ? 0 : 1;
  }
  return 1;
}
