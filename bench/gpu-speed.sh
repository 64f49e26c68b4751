#!/usr/bin/env bash
# gpu-speed.sh OUTDIR [BUILD]: rtp (BUILD/bench/bench-gpu; BUILD defaults to $RTP_BUILD, else
# ./build) against PyTorch (bench/torch-gpu.py: eager, then torch.compile, in one process) on
# one GPU, a whole training step of the reference GPT, for each case of {gpt2, medium} x
# {bf16, f32}: round by round, each case's rtp run right before its PyTorch run, so that a
# drifting machine slows both alike. Every run's JSON line goes to OUTDIR/gpu-speed.jsonl
# (with its "round"); a failed or timed-out run leaves a line with "error". Then one summary
# line per case (OUTDIR/gpu-speed-summary.txt, and as JSON in gpu-speed-summary.jsonl): each
# implementation's median step time over the rounds, MFU and peak memory, and rtp's speed
# relative to PyTorch eager and compiled (their step time over rtp's: above 1, rtp is faster),
# the median of the rounds' paired ratios with their range.
#
# Time: the script starts no run once BUDGET_S (default 240) has passed, and kills a run at
# RUN_TIMEOUT_S (120) or when the budget ends, whichever is first (so it ends by BUDGET_S +
# 10 s and the summary); what did not run is listed as skipped. Estimate for one H100, not
# yet measured: per case and round, bench-gpu 5 to 10 s (CUDA and cuBLAS start, the weights'
# copy, 25 steps of 30 to 200 ms: gpt2 f32 is 7 TFLOP a step at well under f32's 67 TFLOP/s
# peak), torch-gpu.py 5 to 10 s to import torch and start CUDA, 25 eager and 25 compiled
# steps, and torch.compile's start: regional (COMPILE_SCOPE=blocks, the default: the 12
# identical blocks compiled once) 10 to 20 s cold in round 1, a few seconds from inductor's
# cache in round 2. About 30 to 40 s per case in round 1 and 20 to 30 s in round 2: the 4
# cases x 2 rounds in 3 to 4 minutes. COMPILE_SCOPE=model (the whole forward as one graph,
# as nanoGPT compiles it) adds tens of seconds per case cold: raise BUDGET_S to ~450.
#
# Settings (environment): ROUNDS (2), WARMUP (5), STEPS (20), CASES ("gpt2:bf16 gpt2:f32
# medium:bf16 medium:f32", each CONFIG:PRECISION[:BATCH]; first the ones that matter most,
# since the budget cuts the last), TORCH_MODES (eager,compile), COMPILE_SCOPE (blocks),
# DEVICE (cuda; cpu runs the same on the host, for tests), SHAPE_ARGS (size flags for both,
# e.g. "--n-layer 2"), PEAK_TFLOPS (MFU's peak instead of the built-in H100/H200 SXM
# table), PYTHON (python3).
set -uo pipefail
if [ $# -lt 1 ]; then
  echo "usage: bench/gpu-speed.sh OUTDIR [BUILD]" >&2
  exit 2
fi
out=$1
build=${2:-${RTP_BUILD:-build}}
here=$(cd "$(dirname "$0")" && pwd)
bench=$build/bench/bench-gpu
py=${PYTHON:-python3}
rounds=${ROUNDS:-2}
warmup=${WARMUP:-5}
steps=${STEPS:-20}
cases=${CASES:-"gpt2:bf16 gpt2:f32 medium:bf16 medium:f32"}
modes=${TORCH_MODES:-eager,compile}
scope=${COMPILE_SCOPE:-blocks}
device=${DEVICE:-cuda}
budget=${BUDGET_S:-240}
run_limit=${RUN_TIMEOUT_S:-120}
if [ ! -x "$bench" ]; then
  echo "gpu-speed.sh: no $bench (build with -DRTP_CUDA=ON, or give the build folder)" >&2
  exit 2
fi
mkdir -p "$out"
jsonl=$out/gpu-speed.jsonl
log=$out/gpu-speed.log
: > "$jsonl"
: > "$log"

name=
if [ "$device" = cuda ]; then
  name=$(nvidia-smi --query-gpu=name --format=csv,noheader -i 0 2>> "$log" | head -n 1)
  nvidia-smi >> "$log" 2>&1
  # without nvidia-smi, torch's name for it, so that both sides find the same peak
  [ -n "$name" ] || name=$("$py" -c 'import torch; print(torch.cuda.get_device_name(0))' \
    2>> "$log")
fi
common=(--device "$device" --warmup "$warmup" --steps "$steps")
[ -n "$name" ] && common+=(--device-name "$name")
[ -n "${PEAK_TFLOPS:-}" ] && common+=(--peak-tflops "$PEAK_TFLOPS")
read -r -a shape <<< "${SHAPE_ARGS:-}"

end=$((SECONDS + budget))
# run ROUND IMPL CONFIG PRECISION CMD...: the command's JSON lines, each with the round, into
# the results; an error line where it failed, timed out or had no time left.
run() {
  local round=$1 impl=$2 config=$3 prec=$4
  shift 4
  local left=$((end - SECONDS)) limit=$run_limit t0=$SECONDS rc
  local tag="\"round\":$round,\"impl\":\"$impl\",\"config\":\"$config\",\"precision\":\"$prec\""
  if [ "$left" -lt 15 ]; then
    echo "{$tag,\"error\":\"skipped: the ${budget} s budget is spent\"}" >> "$jsonl"
    echo "gpu-speed: round $round $impl $config $prec: skipped (budget)" | tee -a "$log" >&2
    return
  fi
  [ "$left" -lt "$limit" ] && limit=$left
  echo "gpu-speed: round $round $impl $config $prec: $*" >> "$log"
  timeout -k 10 "$limit" "$@" > "$out/run.out" 2>> "$log"
  rc=$?
  # JSON lines only (anything else a program prints stays in the log)
  grep -v '^{' "$out/run.out" >> "$log"
  grep '^{' "$out/run.out" | sed "s/^{/{\"round\":$round,/" >> "$jsonl"
  if [ $rc -ne 0 ]; then
    local why="exit status $rc"
    [ $rc -eq 124 ] || [ $rc -eq 137 ] && why="killed after $limit s (timeout)"
    echo "{$tag,\"error\":\"$why; see gpu-speed.log\"}" >> "$jsonl"
  fi
  echo "gpu-speed: round $round $impl $config $prec: $((SECONDS - t0)) s, status $rc" |
    tee -a "$log" >&2
}

for ((r = 1; r <= rounds; r++)); do
  for c in $cases; do
    IFS=: read -r config prec batch <<< "$c"
    args=(--config "$config" "${common[@]}" "${shape[@]}")
    [ "$prec" = bf16 ] && args+=(--bf16)
    [ -n "${batch:-}" ] && args+=(--batch "$batch")
    run "$r" rtp "$config" "$prec" "$bench" "${args[@]}"
    run "$r" torch "$config" "$prec" "$py" "$here/torch-gpu.py" "${args[@]}" \
      --modes "$modes" --compile-scope "$scope"
  done
done
rm -f "$out/run.out"

"$py" - "$jsonl" "$out" <<'PY'
import json, os, statistics, sys

lines = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
impls = ["rtp", "torch-eager", "torch-compile"]
cases = []
for l in lines:
    if (l["config"], l["precision"]) not in cases:
        cases.append((l["config"], l["precision"]))


def med(v):
    return statistics.median(v) if v else None


def fmt(x, f):
    return "n/a" if x is None else f % x


summary, text = [], []
for config, prec in cases:
    runs = {i: [l for l in lines if (l["config"], l["precision"]) == (config, prec)
                and l["impl"] == i and "ms_median" in l] for i in impls}
    errors = sorted({f'{l["impl"]}: {l["error"]}' for l in lines
                     if (l["config"], l["precision"]) == (config, prec) and "error" in l})
    s = {"summary": True, "config": config, "precision": prec, "errors": errors}
    parts = []
    for i in impls:
        r = runs[i]
        s[i] = {"rounds": len(r), "ms": med([x["ms_median"] for x in r]),
                "tokens_per_s": med([x["tokens_per_s"] for x in r]),
                "mfu": med([x["mfu"] for x in r if x.get("mfu") is not None]),
                "peak_mem_bytes": max([x["peak_mem_bytes"] for x in r
                                       if x.get("peak_mem_bytes") is not None], default=None)}
        gib = s[i]["peak_mem_bytes"] / 2**30 if s[i]["peak_mem_bytes"] else None
        parts.append(f'{i} {fmt(s[i]["ms"], "%.1f")} ms (MFU {fmt(s[i]["mfu"], "%.3f")}, '
                     f'{fmt(gib, "%.2f")} GiB)')
    for i in impls[1:]:
        # each round's ratio pairs runs made minutes apart at most
        mine = {x["round"]: x["ms_median"] for x in runs["rtp"]}
        pairs = [x["ms_median"] / mine[x["round"]] for x in runs[i] if x["round"] in mine]
        key = "rtp_vs_" + i.replace("torch-", "torch_")
        s[key] = {"median": med(pairs), "min": min(pairs, default=None),
                  "max": max(pairs, default=None), "pairs": len(pairs)}
        parts.append(f'rtp speed vs {i} {fmt(med(pairs), "%.2f")}'
                     + (f' (range {min(pairs):.2f}-{max(pairs):.2f}, pairs {len(pairs)})'
                        if pairs else ""))
    summary.append(s)
    text.append(f"{config} {prec}: " + " | ".join(parts)
                + (f" | errors: {'; '.join(errors)}" if errors else ""))
with open(os.path.join(sys.argv[2], "gpu-speed-summary.jsonl"), "w") as f:
    for s in summary:
        f.write(json.dumps(s) + "\n")
with open(os.path.join(sys.argv[2], "gpu-speed-summary.txt"), "w") as f:
    f.write("\n".join(text) + "\n")
print("\n".join(text))
PY
