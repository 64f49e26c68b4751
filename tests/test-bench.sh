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
