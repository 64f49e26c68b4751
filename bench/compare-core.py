#!/usr/bin/env python3
"""Two builds' one-process training step (bench-core --step-only), alternated: which one
goes first alternates every round, so both see the same machine's drift.

    /usr/bin/python3 bench/compare-core.py OLD_BENCH_CORE NEW_BENCH_CORE
                     [--rounds 6] [--threads "1 2"] [--steps 3] [--batch 8]

Prints one JSON line per run (the build's provider, kernel and best step ms), then per
thread count each build's median step ms over the rounds and the median of the rounds'
old/new ratios (above 1: new is faster) with its 95% bootstrap interval (fixed seed).
"""
import argparse
import json
import statistics
import subprocess
import sys

from bench_stats import interval


def run(binary, args):
    cmd = [binary, "--step-only", "--threads", args.threads, "--steps", str(args.steps),
           "--batch", str(args.batch)]
    res = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         timeout=3600)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {res.returncode}:\n{res.stderr[-2000:]}")
    return [json.loads(l) for l in res.stdout.splitlines() if l.startswith("{")]



def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", default="1 2")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    ms = {"old": {}, "new": {}}
    for k in range(args.rounds):
        for which in (["old", "new"] if k % 2 == 0 else ["new", "old"]):
            for line in run(getattr(args, which), args):
                ms[which].setdefault(line["threads"], []).append(line["ms"])
                print(json.dumps({"round": k, "build": which, "threads": line["threads"],
                                  "ms": line["ms"], "provider": line["gemm_provider"],
                                  "kernel": line["gemm_kernel"]}), flush=True)
    for t in sorted(ms["old"]):
        ratios = [o / n for o, n in zip(ms["old"][t], ms["new"][t])]
        lo, hi = interval(ratios)
        print(json.dumps({"threads": t, "old_ms": statistics.median(ms["old"][t]),
                          "new_ms": statistics.median(ms["new"][t]),
                          "old_over_new": round(statistics.median(ratios), 3),
                          "ci95": [round(lo, 3), round(hi, 3)], "rounds": len(ratios)}),
              flush=True)


if __name__ == "__main__":
    sys.exit(main())
