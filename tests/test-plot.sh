#!/usr/bin/env bash
# scripts/plot turns train-gpt metrics into a PNG, and refuses what is not metrics;
# scripts/bench-charts does the same for the benchmarks' JSON lines.
# Usage: test-plot.sh TRAIN_GPT
set -euo pipefail
train_gpt=$1
root=$(cd "$(dirname "$0")/.." && pwd)
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
if ! /usr/bin/python3 -c "import matplotlib" 2> /dev/null; then
  echo "skipped: matplotlib is not installed (scripts/deps.sh installs python3-matplotlib)"
  exit 77
fi
"$train_gpt" --config tiny --steps 12 --batch 2 --eval-windows 16 --metrics "$scratch/a.jsonl" > /dev/null
"$train_gpt" --config tiny --steps 12 --batch 2 --eval-windows 16 --seed 7 --metrics "$scratch/b.jsonl" > /dev/null
"$root/scripts/plot" "$scratch/loss.png" "$scratch/a.jsonl" "$scratch/b.jsonl"
[ "$(head -c 8 "$scratch/loss.png" | od -An -tx1 | tr -d ' \n')" = "89504e470d0a1a0a" ] ||
  { echo "not a PNG"; exit 1; }
echo '{"step": 1}' > "$scratch/bad.jsonl"
if "$root/scripts/plot" "$scratch/x.png" "$scratch/bad.jsonl" 2> "$scratch/err"; then
  echo "bad metrics were accepted"
  exit 1
fi
grep -q "not a train-gpt metrics line" "$scratch/err"
# The charts of docs/benchmarks.md from the committed JSON lines: one PNG per group.
"$root/scripts/bench-charts" "$scratch" "$root"/docs/bench/*.jsonl > "$scratch/charts"
[ "$(wc -l < "$scratch/charts")" -ge 2 ] || { cat "$scratch/charts"; echo "too few charts"; exit 1; }
while read -r png; do
  [ "$(head -c 8 "$png" | od -An -tx1 | tr -d ' \n')" = "89504e470d0a1a0a" ] ||
    { echo "$png: not a PNG"; exit 1; }
done < "$scratch/charts"
if "$root/scripts/bench-charts" "$scratch" "$scratch/bad.jsonl" 2> "$scratch/err"; then
  echo "bench-charts drew from no benchmark lines"
  exit 1
fi
grep -q "no bench-parallel or bench-pipeline lines" "$scratch/err"
echo "plot: ok"
