// test-comm-big.cpp - sizes past 32 bits: a point-to-point message of 4 GiB + 13 bytes
// and an all-reduce of 2 GiB + 12 bytes between two processes. Needs ~9 GB of memory and
// some seconds, so it is labelled slow.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>

#include "test-util.h"

using namespace rtptest;

TEST(CommBig, Over4GiB) {
  int port = free_port();
  auto res = run_procs(
      2,
      [&](int rank) {
        rtp_comm_params p = params(rank, 2, port, 60000);
        rtp_comm *c;
        if (rtp_comm_init(&p, &c) != RTP_OK) return 2;
        {
          const size_t n = ((size_t)4 << 30) + 13;
          uint8_t *b = (uint8_t *)malloc(n);
          if (!b) return 3;
          if (rank == 0)
            for (size_t i = 0; i < n; i++) b[i] = (uint8_t)(i % 251);
          int st = rank == 0 ? rtp_comm_send(c, b, n, 1, nullptr)
                             : rtp_comm_recv(c, b, n, 0, nullptr);
          if (st != RTP_OK) {
            fprintf(stderr, "rank %d: %s\n", rank, rtp_last_error());
            return 4;
          }
          for (size_t i = 0; i < n; i++)
            if (b[i] != (uint8_t)(i % 251)) {
              fprintf(stderr, "rank %d: byte %zu differs\n", rank, i);
              return 5;
            }
          free(b);
        }
        {
          const size_t n = ((size_t)1 << 29) + 3;
          float *f = (float *)malloc(n * sizeof(float));
          if (!f) return 3;
          for (size_t i = 0; i < n; i++) f[i] = (float)(rank + (int)(i & 1023));
          if (rtp_comm_allreduce(c, f, n, nullptr) != RTP_OK) {
            fprintf(stderr, "rank %d: %s\n", rank, rtp_last_error());
            return 6;
          }
          for (size_t i = 0; i < n; i++)
            if (f[i] != (float)(1 + 2 * (int)(i & 1023))) {
              fprintf(stderr, "rank %d: element %zu = %g\n", rank, i, f[i]);
              return 7;
            }
          free(f);
        }
        rtp_comm_free(c);
        return 0;
      },
      300);
  EXPECT_EQ(res[0].code, 0);
  EXPECT_EQ(res[1].code, 0);
}
