#!/usr/bin/env python3
"""pipeline-torch.py BUILD_DIR - our pipeline against PyTorch's, measured alternately.

Each round runs, on 4 local ranks and the same model, mesh (2 stages x 2 ranks), global
batch and micro-batches: bench-pipeline's pp2-rtp layout (rtp inside the stages) under
rtp-run, then bench/torch-parallel.py's pp2-fsdp (torch.distributed.pipelining's
Schedule1F1B, FSDP2 inside the stages, gloo). Prints every run's JSON line, then a summary:
the medians over rounds of tokens/s and of the largest peak memory of a rank, and our
ratios to PyTorch's (goals: >= 1.2x its tokens/s, <= 0.5x its peak memory).

    bench/pipeline-torch.py build [--model medium] [--global-batch 16] [--micro-batches 4]
        [--rounds 2] [--steps 2] [--threads 1] [--python /path/to/venv/bin/python3]

--python is an interpreter with torch >= 2.4 (PyPI's, in a venv; Debian's 1.13 has no
pipelining): without one the comparison is skipped with a message (exit 77)."""
import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def torch_has_pipelining(python):
    code = ("import torch.distributed.pipelining, torch.distributed.fsdp as f; "
            "assert hasattr(f, 'fully_shard')")
    try:
        return subprocess.run([python, "-c", code], capture_output=True,
                              timeout=300).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def json_lines(text):
    out = []
    for line in text.splitlines():
        line = line.split("] ", 1)[1] if line.startswith("[") else line
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def run_ours(args):
    cmd = [os.path.join(args.build, "tools", "rtp-run"), "-n", "4", "--",
           os.path.join(args.build, "bench", "bench-pipeline"), "--model", args.model,
           "--global-batch", str(args.global_batch), "--micro-batches",
           str(args.micro_batches), "--steps", str(args.steps), "--threads",
           str(args.threads), "--layouts", "pp2-rtp", "--net", "loopback"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"pipeline-torch: bench-pipeline failed:\n{r.stderr}")
    return [l for l in json_lines(r.stdout) if l.get("layout") == "pp2-rtp"][0]


def run_torch(args):
    cmd = [args.python, os.path.join(HERE, "torch-parallel.py"), "--model", args.model,
           "--ranks", "4", "--batch", str(args.global_batch // 2), "--micro-batches",
           str(args.micro_batches), "--steps", str(args.steps), "--threads",
           str(args.threads), "--strategies", "pp2-fsdp"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    lines = json_lines(r.stdout)
    if r.returncode or not lines or "error" in lines[0]:
        sys.exit(f"pipeline-torch: torch-parallel.py failed:\n{r.stdout}{r.stderr}")
    return lines[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("build")
    ap.add_argument("--model", default="medium")
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--python", default=sys.executable)
    args = ap.parse_args()
    if not torch_has_pipelining(args.python):
        print(f"pipeline-torch: {args.python} has no torch with pipelining and FSDP2 "
              "(torch >= 2.4; Debian's 1.13 has neither): skipped", file=sys.stderr)
        return 77
    ours, theirs = [], []
    for _ in range(args.rounds):
        ours.append(run_ours(args))
        print(json.dumps(ours[-1]), flush=True)
        theirs.append(run_torch(args))
        print(json.dumps(theirs[-1]), flush=True)
    med = lambda runs, key: statistics.median(r[key] for r in runs)
    summary = dict(bench="pipeline-torch", model=args.model, rounds=args.rounds,
                   mesh="2 stages x 2 ranks", global_batch=args.global_batch,
                   micro_batches=args.micro_batches, torch=theirs[0].get("torch"),
                   rtp_tokens_per_s=med(ours, "tokens_per_s"),
                   torch_tokens_per_s=med(theirs, "tokens_per_s"),
                   rtp_peak_rss_max=med(ours, "peak_rss_max"),
                   torch_peak_rss_max=med(theirs, "peak_rss_max"))
    summary["tokens_ratio"] = round(summary["rtp_tokens_per_s"] /
                                    summary["torch_tokens_per_s"], 3)
    summary["peak_ratio"] = round(summary["rtp_peak_rss_max"] / summary["torch_peak_rss_max"], 3)
    summary["tokens_goal_held"] = summary["tokens_ratio"] >= 1.2
    summary["peak_goal_held"] = summary["peak_ratio"] <= 0.5
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
