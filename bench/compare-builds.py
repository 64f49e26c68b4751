#!/usr/bin/env python3
"""Whether a change moved the strategies' speed ratios: two bench-parallel binaries, run
in turn, compared pair by pair.

    /usr/bin/python3 bench/compare-builds.py OLD_BENCH_PARALLEL NEW_BENCH_PARALLEL
                     [--rounds 4] [--steps 12] [--model small] [--ranks 2]

Each round runs both binaries (which one goes first alternates) with --interleave 1, so
within a run step i of rtp, ddp and fsdp were taken in the same turn and each pair's
ratio (the other strategy's step time over rtp's: rtp's speed relative to it) has the
machine's drift divided out. For each binary and ratio it prints the median over every
pair of every round with a 95% bootstrap interval (fixed seed), then the difference of
the two medians and whether the intervals overlap. One JSON line per round and per
ratio.
"""
import argparse
import json
import random
import statistics
import subprocess
import sys

from bench_stats import interval

RATIOS = {"rtp_vs_ddp": "ddp", "rtp_vs_fsdp": "fsdp"}


def run(binary, args):
    port = 20000 + random.randrange(10000)  # below the ephemeral range (bench-parallel.c)
    cmd = [binary, "--model", args.model, "--ranks", str(args.ranks), "--steps",
           str(args.steps), "--interleave", "1", "--strategies", "ddp fsdp rtp",
           "--master-port", str(port)]
    res = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         timeout=3600)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {res.returncode}:\n{res.stderr[-2000:]}")
    lines = [json.loads(l) for l in res.stdout.splitlines() if l.startswith("{")]
    return {l["strategy"]: l for l in lines if "strategy" in l}


def pairs(by):
    return {name: [o / r for o, r in zip(by[other]["steps_ms"], by["rtp"]["steps_ms"])]
            for name, other in RATIOS.items()}



def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--model", default="small")
    ap.add_argument("--ranks", type=int, default=2)
    args = ap.parse_args()
    got = {"old": {n: [] for n in RATIOS}, "new": {n: [] for n in RATIOS}}
    for k in range(args.rounds):
        order = ["old", "new"] if k % 2 == 0 else ["new", "old"]
        for which in order:
            p = pairs(run(getattr(args, which), args))
            for n in RATIOS:
                got[which][n] += p[n]
            print(json.dumps({"round": k, "build": which,
                              **{n: round(statistics.median(v), 4) for n, v in p.items()}}),
                  flush=True)
    for n in RATIOS:
        line = {"ratio": n}
        for which in ("old", "new"):
            lo, hi = interval(got[which][n])
            line[which] = {"median": round(statistics.median(got[which][n]), 4),
                           "ci95": [round(lo, 4), round(hi, 4)], "pairs": len(got[which][n])}
        line["new_minus_old"] = round(line["new"]["median"] - line["old"]["median"], 4)
        line["intervals_overlap"] = (line["new"]["ci95"][0] <= line["old"]["ci95"][1] and
                                     line["old"]["ci95"][0] <= line["new"]["ci95"][1])
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    sys.exit(main())
