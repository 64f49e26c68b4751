/* rtp-nccl.h - what rtp-comm.c, rtp-nccl.c and the tests share about the NCCL transport,
 * beyond the transport interface of rtp-comm.h. Internal; free of CUDA headers (NCCL and
 * CUDA result codes travel as int). docs/transport.md, "NCCL", has the design. */
#ifndef RTP_NCCL_H
#define RTP_NCCL_H

#include "rtp-comm.h"

#ifdef __cplusplus
extern "C" {
#endif

#ifdef RTP_HAVE_NCCL
/* ---- rtp-nccl.c ---- */
struct rtp_nccl;
/* Broadcasts rank 0's n bytes at id to every rank over c, then rtp__nccl_check_same: how
 * the ncclUniqueId travels. */
int rtp__nccl_exchange_id(struct rtp_comm *c, void *id, size_t n);
/* RTP_OK if every rank holds the same n bytes at p (an all-gather of a 64-bit hash of each
 * rank's bytes), else RTP_EPEER on every rank, naming the ranks that differ from rank 0. */
int rtp__nccl_check_same(struct rtp_comm *c, const void *p, size_t n);
/* What a rank checks before the rendezvous: NCCL loaded (rtp__nccl_load) and new enough
 * (RTP_ENOSYS, naming the library or its version), and a
 * CUDA device: resolves device (-1: the local rank, from RTP_LOCAL_RANK else rank, modulo
 * the number of devices), checks that it exists and makes it the calling thread's current
 * device. RTP_ENOSYS naming CUDA's reason where there is no usable device or driver. */
int rtp__nccl_prepare(int rank, int device, int *out);
/* The library's status for an ncclResult_t / a cudaError_t (RTP_OK for success). */
int rtp__nccl_status(int nccl_result);
int rtp__nccl_cuda_status(int cuda_error);
/* Records "NCCL rank R (device D): CALL failed: <ncclGetErrorString> (<detail>)" as the
 * thread's error and returns its status; detail is ncclGetLastError's text ("" or NULL
 * to leave it out). The CUDA one names cudaGetErrorString and cudaGetErrorName. */
int rtp__nccl_error(int rank, int device, const char *call, int nccl_result,
                    const char *detail);
int rtp__nccl_cuda_error(int rank, int device, const char *call, int cuda_error);
/* RTP_OK, or the status that failed n (message recorded as the thread's error). A failure
 * of n is also c's: rtp_comm_status(c) reports it as well. */
int rtp__nccl_check(struct rtp_nccl *n);
/* Enqueues op (group ranks, device buffers) on stream, a cudaStream_t. */
int rtp__nccl_post(struct rtp_nccl *n, const struct rtp_comm_op *op, void *stream);
/* c's NCCL communicator, or NULL if its device transport is not nccl. */
struct rtp_nccl *rtp__comm_nccl(const struct rtp_comm *c);
#endif

#ifdef __cplusplus
}
#endif

#endif /* RTP_NCCL_H */
