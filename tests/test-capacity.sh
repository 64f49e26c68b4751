#!/usr/bin/env bash
# bench/capacity at a small cap (48 MiB per rank, d 256, 2 ranks): one JSON line per
# strategy; each found a model that fits, under the cap (enforced by a cgroup per rank where
# one can be made, as root) and one layer more did not; rtp's is at least one process's;
# and rtp-plan predicted the peak RSS of each within 10%. Usage: test-capacity.sh SRC BUILD
set -euo pipefail
src=$1
build=$2
out=$(mktemp)
trap 'rm -f "$out"' EXIT
python3 "$src/bench/capacity" --build "$build" --cap 48M --ranks 2 --d-model 256 --n-head 4 \
  --seq-len 32 --strategies none,rtp,pp2-rtp --max-layers 12 > "$out"
python3 - "$out" <<'PY'
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
by = {l["strategy"]: l for l in lines}
assert sorted(by) == ["none", "pp2-rtp", "rtp"], lines
for l in lines:
    assert l["layers"] >= 1 and 0 < l["peak"] <= l["cap"], l
    ran = {k: fit for k, fit, _ in l["runs"]}  # the largest: it fits and one more does not
    assert ran[l["layers"]] and (l["layers"] == 12 or ran[l["layers"] + 1] is False), l
    assert 0.9 <= l["predicted_over_peak_rss"] <= 1.1, l
assert by["rtp"]["layers"] >= by["none"]["layers"], lines
print(lines[0]["mode"], " ".join(
    f'{s}: {l["layers"]} layers, peak {l["peak"] / 2**20:.1f} MiB (RSS '
    f'{l["peak_rss"] / 2**20:.1f}), predicted x{l["predicted_over_peak_rss"]}'
    for s, l in by.items()))
PY
