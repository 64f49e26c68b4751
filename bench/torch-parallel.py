#!/usr/bin/env python3
"""PyTorch's side of bench-parallel: the same reference model (DESIGN.md section 6), batch
and threads, trained with torch.distributed (gloo) DDP or FSDP on N local processes.
Prints one JSON line per strategy with tokens/s over all ranks, step time and rank 0's
peak resident memory, so `bench-parallel` and this script can be compared in one run.

    /usr/bin/python3 bench/torch-parallel.py [--model small] [--ranks 2] [--batch 8]
                                             [--threads 1] [--steps 5] [--strategies ddp,fsdp]

Runs only where torch is installed (Debian's python3-torch); exits 77 otherwise.
"""
import argparse
import json
import os
import resource
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
try:
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
    import torch.nn as nn
    from gpt_torch import GPT, loss as mean_loss
except ImportError:
    print("torch-parallel.py: torch is not installed, nothing to compare", file=sys.stderr)
    sys.exit(77)

CONFIGS = {
    "tiny": dict(seq_len=64, d_model=128, n_layer=2, n_head=4),
    "small": dict(seq_len=128, d_model=384, n_layer=6, n_head=6),
    "medium": dict(seq_len=256, d_model=768, n_layer=12, n_head=12),
}


def fsdp(model, ranks):
    """model sharded with FSDP2 (fully_shard) where torch has it, as bench-parallel's fsdp
    is: each transformer block a unit, the rest in the root's; it runs on the CPU. Else
    with FSDP1, the whole model one unit: Debian's torch 1.13 has only that, which does not
    import on Python 3.11 (a dataclass default that 3.11 rejects) and past that computes
    only on a CUDA device."""
    try:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.device_mesh import init_device_mesh
    except ImportError:
        from torch.distributed.fsdp import FullyShardedDataParallel
        return FullyShardedDataParallel(model)
    mesh = init_device_mesh("cpu", (ranks,))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def rank_main(rank, args, strategy, port, out):
    torch.set_num_threads(args.threads)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    torch.manual_seed(0)
    model = GPT(vocab=256, **CONFIGS[args.model])
    if strategy == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    else:
        try:
            model = fsdp(model, args.ranks)
        except Exception as e:
            if rank == 0:
                out.put(dict(bench="torch-parallel", strategy=strategy, error=repr(e)[:200]))
            return
    opt = torch.optim.Adam(model.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-8)
    T = CONFIGS[args.model]["seq_len"]
    idx = torch.randint(0, 256, (args.batch, T))
    tgt = torch.randint(0, 256, (args.batch, T))
    times = []
    for step in range(args.steps + 1):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        mean_loss(model(idx), tgt).backward()
        opt.step()
        if step > 0:  # step 0 warms up
            times.append(time.perf_counter() - t0)
    times.sort()
    if rank == 0:
        step_s = times[len(times) // 2]
        out.put(dict(bench="torch-parallel", model=args.model, strategy=strategy,
                     ranks=args.ranks, batch=args.batch, threads=args.threads,
                     step_ms=round(step_s * 1e3, 1),
                     tokens_per_s=round(args.ranks * args.batch * T / step_s),
                     peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                     torch=torch.__version__))
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="small", choices=CONFIGS)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--strategies", default="ddp,fsdp")
    ap.add_argument("--master-port", type=int, default=29700)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    for i, strategy in enumerate(args.strategies.split(",")):
        out = ctx.Queue()
        procs = [ctx.Process(target=rank_main, args=(r, args, strategy, args.master_port + i, out))
                 for r in range(args.ranks)]
        for p in procs:
            p.start()
        result = None
        while result is None and any(p.is_alive() for p in procs):
            try:
                result = out.get(timeout=1)
            except Exception:
                pass
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
        if result is None:
            result = dict(bench="torch-parallel", strategy=strategy, error="a rank failed")
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
