#!/usr/bin/env bash
# bench-parallel runs every strategy on 2 local ranks, one at a time and interleaved, and
# prints one well-formed JSON line per strategy (numbers are not checked: no timing here);
# bench/targets.py summarises a round of them as the goals; bench-pipeline prints a line per
# layout on 4 ranks, bench-reshard a line per case and method on 4 ranks as 2 "hosts"
# (below). Usage: test-bench.sh BENCH_PARALLEL
set -euo pipefail
bench=$1
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
for mode in 0 1; do
  "$bench" --model tiny --ranks 2 --batch 2 --steps 2 --strategies "ddp fsdp tp rtp" \
    --interleave $mode > "$scratch/out$mode.jsonl"
  /usr/bin/python3 - "$scratch/out$mode.jsonl" $mode <<'PY'
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
interleaved = sys.argv[2] == "1"
want = ["none", "ddp", "fsdp", "tp", "rtp"]
got = [l["strategy"] for l in lines]
assert got == want, f"strategies {got}, want {want}"
by = {l["strategy"]: l for l in lines}
for l in lines:
    assert l["interleaved"] is interleaved, l
    assert l["step_ms"] > 0 and l["tokens_per_s"] > 0, l
    assert (l["peak_rss"] is None) == interleaved, l
    if l["strategy"] != "none":
        assert l["bytes_sent_per_step"] > 0 and l["comm_only_ms"] > 0, l
# 2 ranks: rtp and fsdp hold half of every parameter, gradient and Adam state
for s in ("fsdp", "rtp"):
    assert 2 * by[s]["model_states"] == by["ddp"]["model_states"], (s, by[s], by["ddp"])
print(f"bench-parallel --interleave {sys.argv[2]}: {len(lines)} lines ok")
PY
done

# bench/targets.py: one round on the tiny model; every goal gets a line, and the one that
# does not depend on timing (2 ranks hold half of ddp's model states) is checked.
build=$(cd "$(dirname "$bench")/.." && pwd)
/usr/bin/python3 "$(dirname "$0")/../bench/targets.py" "$build" --model tiny --rounds 1 \
  --steps 1 --batch 2 > "$scratch/targets.jsonl"
/usr/bin/python3 - "$scratch/targets.jsonl" <<'PY'
import json, subprocess, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
goals = {l["goal"]: l for l in lines if "goal" in l}
want = ["rtp_vs_ddp", "rtp_vs_fsdp", "rtp_vs_torch_ddp", "states_vs_ddp",
        "peak_vs_torch_fsdp", "step_over_max_1gbit"]
assert list(goals) == want, list(goals)
for g in ("rtp_vs_ddp", "rtp_vs_fsdp", "states_vs_ddp"):
    assert goals[g]["rounds"] == 1 and goals[g]["min"] > 0, goals[g]
for g in ("rtp_vs_ddp", "rtp_vs_fsdp"):  # one round of one step: one pair
    p = goals[g]["paired"]
    assert p["pairs"] == 1 and p["ci95"] == [p["median"]] * 2, p
    assert p["verdict"] in ("held", "not held"), p  # an interval of one point
assert goals["states_vs_ddp"]["median"] == 0.5 and goals["states_vs_ddp"]["held"] == 1, goals
torch = subprocess.run(["/usr/bin/python3", "-c", "import torch"]).returncode == 0
assert ("rounds" in goals["rtp_vs_torch_ddp"]) == torch, goals["rtp_vs_torch_ddp"]
assert goals["step_over_max_1gbit"]["measured"] is False  # no --netns
mem = [l for l in lines if l.get("memory")]
assert len(mem) == 1 and mem[0]["rtp_peak_rss"] > 0, mem
print(f"targets.py: {len(lines)} lines ok")
PY

# bench-pipeline: 4 local ranks under rtp-run, each layout once on the tiny model: a
# well-formed line per layout and the summary; flat layouts have no bubble, the pipelines
# 2 stages of 2 ranks with the schedule's theory beside what they measured, and "@2" runs
# one stage in zeropp's units of 2.
"$build/tools/rtp-run" -n 4 -- "$(dirname "$bench")/bench-pipeline" --model tiny \
  --global-batch 8 --micro-batches 2 --steps 1 \
  --layouts "rtp fsdp ddp pp2-rtp pp2-fsdp pp1-rtp@2" | sed 's/^\[0\] //' > "$scratch/pp.jsonl"
/usr/bin/python3 - "$scratch/pp.jsonl" <<'PY'
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
layouts = [l["layout"] for l in lines if "layout" in l]
assert layouts == ["rtp", "fsdp", "ddp", "pp2-rtp", "pp2-fsdp", "pp1-rtp@2"], layouts
for l in lines:
    if "layout" not in l:
        continue
    assert l["tokens_per_s"] > 0 and l["peak_rss_max"] > 0 and len(l["peak_rss"]) == 4, l
    assert l["slow_link_bytes_per_step"] is None, l  # no RTP_BENCH_NIC
    if l["layout"] == "pp1-rtp@2":  # one stage of 4 ranks, zeropp in units of 2
        assert l["schedule"] == "zeropp" and l["unit"] == 2 and l["micro_batches"] == 2, l
    if l["stages"] == 1:
        assert l["bubble"] == 0 and l["bubble_theory"] == 0, l
    else:
        assert l["per_stage"] == 2 and abs(l["bubble_theory"] - 1 / 3) < 1e-4, l
        assert 0 < l["bubble"] < 1, l
summary = [l for l in lines if l.get("summary")]
assert len(summary) == 1 and summary[0]["pp2_rtp_vs_best_flat_tokens"] > 0, summary
assert summary[0]["best_flat"] in ("rtp", "fsdp", "ddp"), summary
print(f"bench-pipeline: {len(lines)} lines ok")
PY

# bench-reshard: 4 local ranks as 2 "hosts" of 2 under rtp-run, a 1 MiB tensor once per
# case and method: a well-formed line each, every move bit-exact, the busiest NICs as the
# plans say (naive sends 1-to-all's tensor once per receiver on the other host,
# p2p-per-host once to that host).
"$build/tools/rtp-run" -n 4 -- "$(dirname "$bench")/bench-reshard" --mib 1 --reps 1 \
  --per-host 2 | sed 's/^\[0\] //' > "$scratch/reshard.jsonl"
/usr/bin/python3 - "$scratch/reshard.jsonl" <<'PY'
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
runs = [l for l in lines if "method" in l]
cases = ["1-to-all", "rows-to-rep", "rows-to-cols", "tiles-to-rows", "rep-to-rows",
         "rows-to-rep2"]
methods = ["naive", "p2p-per-host", "broadcast", "ours"]
assert [l["case"] for l in runs] == [c for c in cases for _ in methods], runs
assert [l["method"] for l in runs] == methods * len(cases), runs
for l in runs:
    assert l["exact"] is True and l["seconds"] > 0 and l["hosts"] == 2, l
    assert (l["ratio_to_bound"] is None) == (l["lower_bound_s"] == 0), l
by = {(l["case"], l["method"]): l for l in runs}
mib = 1 << 20
assert by[("1-to-all", "naive")]["nic_max_bytes"] == 2 * mib, by[("1-to-all", "naive")]
assert by[("1-to-all", "p2p-per-host")]["nic_max_bytes"] == mib, by[("1-to-all", "p2p-per-host")]
assert by[("1-to-all", "ours")]["nic_max_bytes"] == mib, by[("1-to-all", "ours")]
summaries = [l for l in lines if "ours_vs_naive" in l]
assert [l["case"] for l in summaries] == cases, summaries
print(f"bench-reshard: {len(lines)} lines ok")
PY

# bench-gpu on the CPU (--device cpu: --device cuda's code but for the backend) on the tiny
# model, 2 steps: a well-formed line whose model FLOPs and parameters follow the formula
# (docs/benchmarks.md, "GPU"); --device cuda without a GPU and bad flags are refused.
# bench/torch-gpu.py on the same model where torch is (Debian's 1.13 has no torch.compile:
# its compile line says so): the same parameters and FLOPs. bench/gpu-speed.sh: one round of
# both on the CPU, its lines tagged with the round and its summary pairing them.
gpu=$(dirname "$bench")/bench-gpu
"$gpu" --device cpu --config tiny --steps 2 --warmup 1 > "$scratch/gpu.jsonl"
"$gpu" --device cpu --config tiny --steps 2 --warmup 0 --bf16 --batch 3 --peak-tflops 0.5 \
  >> "$scratch/gpu.jsonl"
rc=0
"$gpu" --device cuda --config tiny --steps 1 2> "$scratch/cuda.err" || rc=$?
if [ $rc -eq 0 ]; then echo "bench-gpu ran on a GPU: the CPU checks below still apply"; fi
if [ $rc -ne 0 ] && { [ $rc -ne 1 ] || ! grep -q -- "--device cuda" "$scratch/cuda.err"; }; then
  echo "bench-gpu --device cuda without a GPU: status $rc, $(cat "$scratch/cuda.err")" >&2
  exit 1
fi
for bad in "--device gpu" "--config huge" "--n-head 5" "--steps 0" "--peak-tflops x"; do
  rc=0
  # shellcheck disable=SC2086
  "$gpu" --device cpu $bad > /dev/null 2>&1 || rc=$?
  [ $rc -eq 2 ] || { echo "bench-gpu $bad: status $rc, want 2" >&2; exit 1; }
done
torch=0
/usr/bin/python3 -c "import torch" 2> /dev/null && torch=1
/usr/bin/python3 -m py_compile "$(dirname "$0")/../bench/torch-gpu.py"
if [ $torch -eq 1 ]; then
  /usr/bin/python3 "$(dirname "$0")/../bench/torch-gpu.py" --device cpu --config tiny \
    --steps 2 --warmup 1 > "$scratch/torch-gpu.jsonl"
fi
DEVICE=cpu CASES="tiny:f32" ROUNDS=1 STEPS=2 WARMUP=1 TORCH_MODES=eager PYTHON=/usr/bin/python3 \
  bash "$(dirname "$0")/../bench/gpu-speed.sh" "$scratch/speed" "$build" > /dev/null 2>&1
/usr/bin/python3 - "$scratch" $torch <<'PY'
import json, math, os, sys
d, torch = sys.argv[1], sys.argv[2] == "1"
rtp = [json.loads(l) for l in open(os.path.join(d, "gpu.jsonl"))]
assert len(rtp) == 2, rtp
for l, prec, batch in zip(rtp, ["f32", "bf16"], [2, 3]):
    assert l["impl"] == "rtp" and l["device"] == "cpu" and l["backend"] == "cpu", l
    assert l["precision"] == prec and l["batch"] == batch and l["steps"] == 2, l
    assert l["config"] == "tiny" and not l["tied"] and l["device_reserved_bytes"] == 0, l
    V, T, dm, L = l["vocab"], l["seq_len"], l["d_model"], l["n_layer"]
    block = 2 * dm + 3 * dm * dm + 3 * dm + dm * dm + dm + 2 * dm + 8 * dm * dm + 5 * dm
    assert l["params"] == 2 * V * dm + T * dm + L * block + 2 * dm, l
    tokens = T * batch
    flops = 6 * l["params"] * tokens + 12 * L * T * dm * tokens
    assert abs(l["flops_per_step"] / flops - 1) < 1e-5, (l, flops)
    lo, hi = l["ms_ci95"]
    assert 0 < l["ms_min"] <= lo <= l["ms_median"] <= hi, l
    assert abs(l["tokens_per_s"] * l["ms_median"] / 1e3 / tokens - 1) < 1e-3, l
    assert l["peak_mem_bytes"] > 0 and abs(l["loss_first"] - math.log(V)) < 0.5, l
    assert math.isfinite(l["loss_last"]), l
assert rtp[0]["mfu"] is None and rtp[0]["peak_tflops"] is None, rtp[0]
want = rtp[1]["flops_per_step"] / (rtp[1]["ms_median"] / 1e3) / 0.5e12
assert abs(rtp[1]["mfu"] / want - 1) < 2e-3, (rtp[1], want)
if torch:
    tl = [json.loads(l) for l in open(os.path.join(d, "torch-gpu.jsonl"))]
    assert [l["impl"] for l in tl] == ["torch-eager", "torch-compile"], tl
    eager = tl[0]
    assert set(rtp[0]) <= set(eager) | {"device_reserved_bytes"}, set(rtp[0]) - set(eager)
    for k in ("params", "flops_per_step", "batch", "seq_len", "vocab", "precision"):
        assert eager[k] == rtp[0][k], (k, eager, rtp[0])
    assert eager["ms_median"] > 0 and eager["peak_mem_bytes"] is None, eager
    assert "error" in tl[1] or tl[1]["ms_median"] > 0, tl[1]
speed = [json.loads(l) for l in open(os.path.join(d, "speed", "gpu-speed.jsonl"))]
assert speed[0]["impl"] == "rtp" and all(l["round"] == 1 for l in speed), speed
summary = [json.loads(l) for l in open(os.path.join(d, "speed", "gpu-speed-summary.jsonl"))]
assert len(summary) == 1 and summary[0]["rtp"]["rounds"] == 1, summary
assert summary[0]["rtp_vs_torch_eager"]["pairs"] == (1 if torch else 0), summary
print(f"bench-gpu, torch-gpu.py (torch: {torch}), gpu-speed.sh: ok")
PY

# bench/plan-time: one round, 2 ranks of the tiny model; a line per strategy and round with
# rtp-plan's prediction beside the measured step and peak, and a summary per strategy.
/usr/bin/python3 "$(dirname "$0")/../bench/plan-time" --build "$build" -n 2 --rounds 1 \
  --steps 3 --warmup 1 --strategies none,rtp,tp -- --config tiny --batch 2 \
  > "$scratch/plan-time.jsonl"
/usr/bin/python3 - "$scratch/plan-time.jsonl" <<'PY'
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
runs = [l for l in lines if "round" in l]
assert [l["strategy"] for l in runs] == ["none", "rtp", "tp"], runs
for l in runs:
    assert l["predicted_ms"] > 0 and l["measured_ms"] > 0, l
    # the milliseconds are rounded to 0.1, the ratio taken before
    assert abs(l["predicted_over_measured"] * l["measured_ms"] / l["predicted_ms"] - 1) < 0.05, l
    assert 0.5 < l["rss_ratio"] < 2, l  # test-plan checks the memory; here, that it is read
summary = [l for l in lines if "median_predicted_over_measured" in l]
assert [l["strategy"] for l in summary] == ["none", "rtp", "tp"], summary
print(f"plan-time: {len(lines)} lines ok")
PY
