#!/usr/bin/env python3
"""rtp's speed and memory goals (issue 4, docs/parallel.md), measured over several rounds.

    /usr/bin/python3 bench/targets.py BUILD_DIR [--rounds 5] [--steps 6] [--model small]
                                      [--batch 8] [--netns] [--torch-python PYTHON]

Speed on this kind of machine drifts by 10% from one minute to the next, so one run proves
little either way. Each round runs `bench-parallel --interleave 1` (one process, ddp, fsdp
and rtp on 2 ranks, their steps taken in turn in the same processes) and PyTorch's DDP
(bench/torch-parallel.py, where torch is installed), which of the two goes first
alternating between rounds; with --netns (root), also bench-parallel over the emulated
1 Gbit/s Ethernet (scripts/bench-parallel-netns.sh). Memory is measured once, one strategy
at a time. The PyTorch side runs under --torch-python (default Debian's /usr/bin/python3
and its torch 1.13, whose FSDP cannot run on a CPU; a venv with a newer torch can). Prints
one JSON line per round, then one per goal: the median, the range, and in how many rounds
the goal held.

A round's median moves by about 5% with the machine, more than rtp differs from our ddp or
fsdp, so those two goals are also judged step by step: step i of rtp and step i of the
other were taken in the same turn of the interleaving, so each pair's ratio has the drift
divided out. Their line adds the median over every pair of every round, its 95% bootstrap
interval, and a verdict: held if the whole interval meets the goal, not held if none of
it does, undecided otherwise (more rounds or steps narrow it).
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# The goals judged pair by pair too: name -> the strategy rtp is paired with.
PAIRED = {"rtp_vs_ddp": "ddp", "rtp_vs_fsdp": "fsdp"}

# name: (what is compared, want >= or <=, goal)
GOALS = {
    "rtp_vs_ddp": ("rtp tokens/s over our ddp's", ">=", 0.95),
    "rtp_vs_fsdp": ("rtp tokens/s over our fsdp's", ">=", 1.0),
    "rtp_vs_torch_ddp": ("rtp tokens/s over PyTorch DDP's", ">=", 1.2),
    "states_vs_ddp": ("rtp model-state bytes per rank over ddp's", "<=", 0.55),
    "peak_vs_torch_fsdp": ("rtp peak resident memory per rank over PyTorch FSDP's", "<=", 0.5),
    "step_over_max_1gbit": ("rtp step over max(compute, communication) at 1 Gbit/s", "<=", 1.15),
}


def json_lines(cmd, timeout, absent=None):
    """The JSON lines a command prints; None if it exits with `absent` (what it needs is
    not installed); raises if it fails otherwise."""
    res = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         timeout=timeout)
    if absent is not None and res.returncode == absent:
        return None
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {res.returncode}:\n{res.stderr[-2000:]}")
    return [json.loads(l) for l in res.stdout.splitlines() if l.startswith("{")]


def by_strategy(lines):
    return {l["strategy"]: l for l in lines if "strategy" in l}


def ours(args, strategies="ddp fsdp rtp", interleave=1):
    port = 20000 + random.randrange(10000)  # below the ephemeral range (bench-parallel.c)
    cmd = [os.path.join(args.build, "bench", "bench-parallel"), "--model", args.model,
           "--ranks", "2", "--batch", str(args.batch), "--threads", "1", "--steps",
           str(args.steps), "--interleave", str(interleave), "--master-port", str(port),
           "--strategies", strategies]
    return by_strategy(json_lines(cmd, 1800))


def torch_side(args, strategies):
    """PyTorch's lines by strategy; None where torch is missing (the script exits 77)."""
    cmd = [args.torch_python, os.path.join(HERE, "torch-parallel.py"), "--model", args.model,
           "--ranks", "2", "--batch", str(args.batch), "--threads", "1", "--steps",
           str(args.steps), "--strategies", strategies, "--master-port",
           str(29000 + random.randrange(1000))]
    lines = json_lines(cmd, 1800, absent=77)
    return None if lines is None else by_strategy(lines)


def netns(args):
    cmd = ["bash", os.path.join(ROOT, "scripts", "bench-parallel-netns.sh"), args.build, "2",
           "1gbit", "--", "--model", args.model, "--batch", str(args.batch), "--steps",
           str(args.steps), "--strategies", "ddp fsdp rtp", "--interleave", "1"]
    return by_strategy(json_lines(cmd, 1800))


def one_round(args, k, have_torch):
    r = {"bench": "targets", "round": k}
    mine = theirs = None
    for side in (("ours", "torch") if k % 2 == 0 else ("torch", "ours")):
        if side == "ours":
            mine = ours(args)
        elif have_torch:
            theirs = torch_side(args, "ddp")
    rtp = mine["rtp"]
    r["rtp_tokens_per_s"] = rtp["tokens_per_s"]
    r["states_vs_ddp"] = rtp["model_states"] / mine["ddp"]["model_states"]
    for name, other in PAIRED.items():  # other's step time over rtp's: rtp's speed over other's
        r[name] = rtp["tokens_per_s"] / mine[other]["tokens_per_s"]
        r["pairs_" + name] = [o / t for o, t in zip(mine[other]["steps_ms"], rtp["steps_ms"])]
    if theirs and "tokens_per_s" in theirs.get("ddp", {}):
        r["torch_ddp_tokens_per_s"] = theirs["ddp"]["tokens_per_s"]
        r["torch_ddp_peak_rss"] = theirs["ddp"]["peak_rss"]
        r["rtp_vs_torch_ddp"] = rtp["tokens_per_s"] / theirs["ddp"]["tokens_per_s"]
    if args.netns:
        r["step_over_max_1gbit"] = netns(args)["rtp"]["step_over_max"]
    return r


def memory(args, have_torch, rounds):
    """Peak resident memory per rank, one strategy at a time: rtp's, and PyTorch FSDP's
    where it runs (Debian's torch 1.13 FSDP neither imports on Python 3.11 nor runs without
    CUDA: bench/torch-parallel.py). PyTorch DDP's, from the rounds, is shown beside it: DDP
    holds every parameter, so FSDP's is lower."""
    out = {"bench": "targets", "memory": True}
    rtp = ours(args, "rtp", interleave=0)["rtp"]
    out["rtp_peak_rss"] = rtp["peak_rss"]
    ddp = [r["torch_ddp_peak_rss"] for r in rounds if "torch_ddp_peak_rss" in r]
    if ddp:
        out["torch_ddp_peak_rss"] = min(ddp)
        out["peak_vs_torch_ddp"] = round(rtp["peak_rss"] / min(ddp), 3)
    fsdp = torch_side(args, "fsdp") if have_torch else None
    line = (fsdp or {}).get("fsdp", {})
    if "peak_rss" in line:
        out["torch_fsdp_peak_rss"] = line["peak_rss"]
        out["peak_vs_torch_fsdp"] = rtp["peak_rss"] / line["peak_rss"]
    else:
        out["torch_fsdp"] = line.get("error", "torch is not installed")
    return out


def meets(v, op, goal):
    return v >= goal if op == ">=" else v <= goal


def paired(pairs, op, goal):
    """The median of the step pairs' ratios, its 95% bootstrap interval (fixed seed, so a
    rerun on the same figures prints the same), and the verdict."""
    rng, n = random.Random(1), 2000
    meds = sorted(statistics.median(rng.choices(pairs, k=len(pairs))) for _ in range(n))
    lo, hi = meds[n // 40], meds[n - 1 - n // 40]
    ok = meets(lo, op, goal) + meets(hi, op, goal)
    verdict = {2: "held", 0: "not held"}.get(ok, "undecided")
    return {"pairs": len(pairs), "median": round(statistics.median(pairs), 3),
            "ci95": [round(lo, 3), round(hi, 3)], "verdict": verdict}


def summary(name, values, pairs=None):
    what, op, goal = GOALS[name]
    line = {"bench": "targets", "goal": name, "what": what, "want": f"{op} {goal}"}
    if not values:
        line["measured"] = False
        return line
    held = sum(1 for v in values if meets(v, op, goal))
    line.update(median=round(statistics.median(values), 3), min=round(min(values), 3),
                max=round(max(values), 3), held=held, rounds=len(values))
    if pairs:
        line["paired"] = paired(pairs, op, goal)
    return line


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("build")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--model", default="small", choices=["tiny", "small", "medium"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--netns", action="store_true",
                    help="also over the emulated 1 Gbit/s Ethernet (needs root)")
    ap.add_argument("--torch-python", default="/usr/bin/python3",
                    help="the Python that runs PyTorch's side (bench/torch-parallel.py)")
    args = ap.parse_args()
    if args.rounds < 1 or args.steps < 1:
        ap.error("--rounds and --steps must be at least 1")
    if args.netns and os.geteuid() != 0:
        ap.error("--netns needs root (network namespaces)")
    have_torch = subprocess.run([args.torch_python, "-c", "import torch"],
                                stderr=subprocess.DEVNULL).returncode == 0
    rounds = []
    for k in range(args.rounds):
        rounds.append(one_round(args, k, have_torch))
        print(json.dumps({key: round(v, 3) if isinstance(v, float) else v
                          for key, v in rounds[-1].items() if not key.startswith("pairs_")}),
              flush=True)
    mem = memory(args, have_torch, rounds)
    print(json.dumps(mem), flush=True)
    for name in GOALS:
        values = [r[name] for r in rounds if name in r]
        if name in mem:
            values.append(mem[name])
        pairs = [p for r in rounds for p in r.get("pairs_" + name, [])]
        print(json.dumps(summary(name, values, pairs)), flush=True)


if __name__ == "__main__":
    sys.exit(main())
