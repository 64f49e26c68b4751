#!/usr/bin/env python3
"""PyTorch's side of bench-parallel and bench-pipeline: the same reference model
(DESIGN.md section 6), batch and threads, trained with torch.distributed (gloo) DDP or FSDP
on N local processes, or as a pipeline ("ppS-fsdp": torch.distributed.pipelining's
Schedule1F1B over S stages of N/S ranks, FSDP2 inside each stage, --micro-batches M, the
global batch N/S x --batch). Prints one JSON line per strategy with tokens/s over all
ranks, step time and peak resident memory (rank 0's, and for pipelines every rank's), so
the benchmarks and this script can be compared in one run.

    python3 bench/torch-parallel.py [--model small] [--ranks 2] [--batch 8] [--threads 1]
                                    [--steps 5] [--strategies ddp,fsdp,pp2-fsdp]
                                    [--micro-batches 4]

bench/capacity runs it on a model of its own shape (--d-model, --n-head, --seq-len,
--n-layer override --model's), with --recompute (each block's forward replayed in
backward: torch.utils.checkpoint) and --cgroup DIR (rank r joins the memory cgroup
DIR/r<r> before it builds anything, so the cap holds it); its line then has every rank's
peak resident memory (peak_rss_ranks) for DDP and FSDP too.

Runs only where torch is installed (Debian's python3-torch; pipelines need torch >= 2.4
from PyPI, in a venv); exits 77 without torch, and a pipeline line says why it cannot run.
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


def pipeline_stage(model, s, S):
    """Stage s of S of the model as a module: the embeddings with the first, the final norm
    and the head with the last, the blocks split evenly (as rtp's cut of equal blocks)."""
    blocks = list(model.transformer.h)
    per = len(blocks) // S
    mine = nn.ModuleList(blocks[s * per:(s + 1) * per if s < S - 1 else len(blocks)])

    class Stage(nn.Module):
        def __init__(self):
            super().__init__()
            self.h = mine
            if s == 0:
                self.wte, self.wpe = model.transformer.wte, model.transformer.wpe
            if s == S - 1:
                self.ln_f, self.lm_head = model.transformer.ln_f, model.lm_head

        def forward(self, x):
            if s == 0:
                x = self.wte(x) + self.wpe(torch.arange(x.shape[1]))
            for block in self.h:
                x = block(x)
            return self.lm_head(self.ln_f(x)) if s == S - 1 else x

    return Stage()


def pipeline_main(rank, args, S, T, out):
    """One rank of S stages x D ranks: FSDP2 over the stage's D ranks, 1F1B over the pipe."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    D = args.ranks // S
    mesh = init_device_mesh("cpu", (S, D), mesh_dim_names=("pp", "dp"))
    s = rank // D
    torch.manual_seed(0)
    stage = pipeline_stage(GPT(vocab=256, **config(args)), s, S)
    if D > 1:
        for block in stage.h:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(stage, mesh=mesh["dp"])
    pipe = PipelineStage(stage, s, S, torch.device("cpu"), group=mesh["pp"].get_group())
    sched = Schedule1F1B(pipe, n_microbatches=args.micro_batches, loss_fn=mean_loss)
    opt = torch.optim.Adam(stage.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-8)
    idx = torch.randint(0, 256, (args.batch, T))
    tgt = torch.randint(0, 256, (args.batch, T))
    times = []
    for step in range(args.steps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        if s == 0:
            sched.step(idx)
        elif s == S - 1:
            sched.step(target=tgt, losses=[])
        else:
            sched.step()
        opt.step()
        if step > 0:
            times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2], every_peak(args.ranks), D


class Recompute(nn.Module):
    """A block whose forward is replayed in backward, as train-gpt's --recompute."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        return checkpoint(self.block, x, use_reentrant=False)


def config(args):
    c = dict(CONFIGS[args.model])
    for k in ("seq_len", "d_model", "n_layer", "n_head"):
        if getattr(args, k) is not None:
            c[k] = getattr(args, k)
    return c


def join_cgroup(args, rank):
    if args.cgroup:
        with open(os.path.join(args.cgroup, f"r{rank}", "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))


def every_peak(ranks):
    peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0])
    peaks = [torch.zeros(1) for _ in range(ranks)]
    dist.all_gather(peaks, peak)
    return [int(p.item()) for p in peaks]


def rank_main(rank, args, strategy, port, out):
    join_cgroup(args, rank)
    torch.set_num_threads(args.threads)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    T = config(args)["seq_len"]
    if strategy.startswith("pp"):
        S = int(strategy[2:].split("-")[0])
        try:
            step_s, peaks, D = pipeline_main(rank, args, S, T, out)
        except Exception as e:  # older torch: no pipelining, or no FSDP2
            if rank == 0:
                out.put(dict(bench="torch-parallel", strategy=strategy, error=repr(e)[:300],
                             torch=torch.__version__))
            return
        if rank == 0:
            out.put(dict(bench="torch-parallel", model=args.model, strategy=strategy,
                         ranks=args.ranks, stages=S, per_stage=D, batch=args.batch,
                         micro_batches=args.micro_batches, global_batch=D * args.batch,
                         threads=args.threads, step_ms=round(step_s * 1e3, 1),
                         tokens_per_s=round(D * args.batch * T / step_s, 1),
                         peak_rss=peaks[0], peak_rss_max=max(peaks), peak_rss_ranks=peaks,
                         torch=torch.__version__))
        dist.destroy_process_group()
        return
    torch.manual_seed(0)
    model = GPT(vocab=256, **config(args))
    if args.recompute:
        model.transformer.h = nn.ModuleList(Recompute(b) for b in model.transformer.h)
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
    peaks = every_peak(args.ranks)
    if rank == 0:
        step_s = times[len(times) // 2]
        out.put(dict(bench="torch-parallel", model=args.model, strategy=strategy,
                     ranks=args.ranks, batch=args.batch, threads=args.threads,
                     step_ms=round(step_s * 1e3, 1),
                     tokens_per_s=round(args.ranks * args.batch * T / step_s),
                     peak_rss=peaks[0], peak_rss_max=max(peaks), peak_rss_ranks=peaks,
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
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--master-port", type=int, default=29700)
    for k in ("seq-len", "d-model", "n-layer", "n-head"):
        ap.add_argument("--" + k, type=int, default=None)
    ap.add_argument("--recompute", action="store_true")
    ap.add_argument("--cgroup", default=None, help="rank r joins the cgroup DIR/r<r>")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    for i, strategy in enumerate(args.strategies.split(",")):
        out = ctx.Queue()
        procs = [ctx.Process(target=rank_main, args=(r, args, strategy, args.master_port + i, out))
                 for r in range(args.ranks)]
        for p in procs:
            p.start()
        result = None
        # a rank that died (killed by a memory cap) leaves the others waiting in gloo
        while result is None and any(p.is_alive() for p in procs) and \
                not any(p.exitcode not in (None, 0) for p in procs):
            try:
                result = out.get(timeout=1)
            except Exception:
                pass
        for p in procs:
            if result is None:
                p.kill()
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
        if result is None:
            codes = [p.exitcode for p in procs]
            result = dict(bench="torch-parallel", strategy=strategy,
                          error=f"a rank failed (exit codes {codes})")
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
