#!/usr/bin/python3
"""bench-comm-gloo.py - the same measurements as bench-comm, with PyTorch's gloo backend
(Debian's python3-torch), for comparison on the same machine and sizes. JSON lines:

  {"bench":"comm","impl":"gloo","op":"allreduce","world":4,"bytes":16777216,...}

usage: bench-comm-gloo.py [--worlds 2,3,4] [--sizes-mib 1,4,16,64] [--ops ...]
gloo has no reduce-scatter in torch 1.13, so that op is skipped; all-gather gathers
into a list of per-rank tensors; rotation is isend/irecv to the ring neighbours.
"""
import argparse
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_op(op, rank, n, a, b, parts):
    if op == "rotation":
        reqs = [dist.isend(a, (rank + n - 1) % n), dist.irecv(b, (rank + 1) % n)]
        for r in reqs:
            r.wait()
    elif op == "allreduce":
        dist.all_reduce(a)
    elif op == "allgather":
        dist.all_gather(parts, parts[rank].clone())


def worker(rank, n, port, sizes, ops, q):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=n)
    bus = {"rotation": 1.0, "allreduce": 2.0 * (n - 1) / n, "allgather": (n - 1) / n}
    for op in ops:
        for mib in sizes:
            nbytes = mib << 20
            a = torch.ones(nbytes // 4)
            b = torch.ones(nbytes // 4)
            parts = [torch.ones(nbytes // 4 // n) for _ in range(n)]  # gloo: equal parts
            iters = max(3, min(20, (512 << 20) // nbytes))
            for _ in range(2):
                run_op(op, rank, n, a, b, parts)
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                run_op(op, rank, n, a, b, parts)
            dist.barrier()
            t = (time.perf_counter() - t0) / iters
            alg = nbytes / t / 1e9
            if rank == 0:
                print(json.dumps({"bench": "comm", "impl": "gloo", "net": "loopback", "op": op,
                                  "world": n, "bytes": nbytes, "iters": iters,
                                  "seconds": round(t, 6), "algbw_GBps": round(alg, 4),
                                  "busbw_GBps": round(alg * bus[op], 4)}), flush=True)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worlds", default="2,3,4")
    ap.add_argument("--sizes-mib", default="1,4,16,64")
    ap.add_argument("--ops", default="rotation,allreduce,allgather")
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes_mib.split(",")]
    ops = [o for o in args.ops.split(",") if o in ("rotation", "allreduce", "allgather")]
    for n in [int(x) for x in args.worlds.split(",")]:
        mp.spawn(worker, args=(n, free_port(), sizes, ops, None), nprocs=n, join=True)


if __name__ == "__main__":
    sys.exit(main())
