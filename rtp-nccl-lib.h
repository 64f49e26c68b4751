/* rtp-nccl-lib.h - NCCL, loaded when the nccl transport is first asked for (rtp-nccl-lib.c)
 * and called through rtp__nccl_fn. A CUDA build links no NCCL, so its programs start and
 * run on the CPU on hosts without it; nccl.h still gives the types. Internal. */
#ifndef RTP_NCCL_LIB_H
#define RTP_NCCL_LIB_H

#include <nccl.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Every NCCL function the library calls, by the name after "nccl". */
#define RTP_NCCL_FUNCS(X) \
  X(GetVersion)           \
  X(GetErrorString)       \
  X(GetLastError)         \
  X(GetUniqueId)          \
  X(CommInitRankConfig)   \
  X(CommGetAsyncError)    \
  X(CommFinalize)         \
  X(CommDestroy)          \
  X(CommAbort)            \
  X(GroupStart)           \
  X(GroupEnd)             \
  X(Send)                 \
  X(Recv)                 \
  X(AllReduce)            \
  X(AllGather)            \
  X(Broadcast)

struct rtp_nccl_fn {
#define RTP_NCCL_MEMBER(f) __typeof__(&nccl##f) f;
  RTP_NCCL_FUNCS(RTP_NCCL_MEMBER)
#undef RTP_NCCL_MEMBER
};

/* Set by the first successful rtp__nccl_load; read only after one. */
extern struct rtp_nccl_fn rtp__nccl_fn;

/* RTP_OK once rtp__nccl_fn is set, loading NCCL on the first call: RTP_NCCL_LIBRARY (a
 * path or a file name) if set, else the NCCL already in the process (a program that links
 * it, which the library then shares), else libnccl.so.<major> by the loader's search, else
 * the library the build found. RTP_ENOSYS naming the library and the loader's reason
 * otherwise; a failure is not remembered, so a later call tries again. Thread-safe. */
int rtp__nccl_load(void);

#ifdef __cplusplus
}
#endif

#endif /* RTP_NCCL_LIB_H */
