#!/usr/bin/env bash
# bench-pipeline-netns.sh BUILD_DIR [RATE...] [-- BENCH-PIPELINE ARGS...] - pipelines
# against the flat strategies on 2 emulated hosts of 2 ranks each: for each RATE (default
# 1gbit, then 100mbit) sets up 2 hosts joined at that rate (scripts/netns-ethernet.sh),
# runs ranks 0, 1 in host 0's namespace and 2, 3 in host 1's (ranks of a host talk over
# its own loopback; only what crosses hosts takes the shaped link), with RTP_BENCH_NIC=eth0
# so that bench-pipeline counts the bytes over the link, prints rank 0's JSON lines with
# "net" = RATE, and tears the hosts down. The default arguments, which later ones override:
#   --model medium --global-batch 16 --micro-batches 4 --steps 2 --threads 1
# Needs root; skips otherwise. Example: scripts/bench-pipeline-netns.sh build 100mbit
# Environment: RTP_BENCH_TIMEOUT (seconds per rate, default 3600), and netns-ethernet.sh's
# RTP_NETNS_PREFIX / RTP_NETNS_NET.
set -euo pipefail

usage() {
  echo "usage: $0 BUILD_DIR [RATE...] [-- BENCH-PIPELINE ARGS...]" >&2
  exit 2
}

build=${1:-}
[[ -n "$build" && "$build" != -* ]] || usage
shift
rates=()
while [[ $# -gt 0 && "$1" != "--" ]]; do rates+=("$1"); shift; done
if [[ $# -gt 0 ]]; then shift; fi
[[ ${#rates[@]} -gt 0 ]] || rates=(1gbit 100mbit)

if [[ $(id -u) -ne 0 ]]; then
  echo "$0: skipped: network namespaces need root" >&2
  exit 0
fi
bench="$build/bench/bench-pipeline"
[[ -x "$bench" ]] || { echo "$0: $bench not found (build the bench-pipeline target)" >&2; exit 2; }

here=$(cd "$(dirname "$0")" && pwd)
export RTP_NETNS_PREFIX=${RTP_NETNS_PREFIX:-rtpq$(($$ % 100000))}
prefix=$RTP_NETNS_PREFIX
net=${RTP_NETNS_NET:-232}
export RTP_NETNS_NET=$net
hosts=2
per_host=2
tmp=$(mktemp -d)
pids=()

# shellcheck disable=SC2317  # called by the trap
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  "$here/netns-ethernet.sh" down "$hosts" >/dev/null 2>&1 || true
  rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

rc=0
for rate in "${rates[@]}"; do
  "$here/netns-ethernet.sh" up "$hosts" "$rate" >/dev/null
  token=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')
  args=(--model medium --global-batch 16 --micro-batches 4 --steps 2 --threads 1 "$@"
    --net "$rate")
  pids=()
  world=$((hosts * per_host))
  for ((r = world - 1; r >= 0; r--)); do
    h=$((r / per_host))
    ip netns exec "${prefix}$h" env RTP_RANK="$r" RTP_WORLD_SIZE="$world" \
      RTP_LOCAL_RANK=$((r % per_host)) RTP_LOCAL_WORLD_SIZE="$per_host" \
      RTP_MASTER_ADDR="10.${net}.0.1" RTP_MASTER_PORT=29500 RTP_TOKEN="$token" \
      RTP_BENCH_NIC=eth0 timeout "${RTP_BENCH_TIMEOUT:-3600}" "$bench" "${args[@]}" \
      >"$tmp/out$r" 2>"$tmp/err$r" &
    pids+=($!)
  done
  for ((k = 0; k < world; k++)); do
    r=$((world - 1 - k))
    if ! wait "${pids[$k]}"; then
      rc=1
      echo "$0: $rate: rank $r failed:" >&2
      sed 's/^/  /' "$tmp/err$r" >&2
    fi
  done
  pids=()
  grep '^{' "$tmp/out0" || true
  "$here/netns-ethernet.sh" down "$hosts" >/dev/null
done
exit $rc
