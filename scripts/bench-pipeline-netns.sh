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
export RTP_NETNS_NET=${RTP_NETNS_NET:-232}
hosts=2
per_host=2
job=

# shellcheck disable=SC2317  # called by the trap
cleanup() {
  [[ -n "$job" ]] && kill "$job" 2>/dev/null && wait "$job" 2>/dev/null
  "$here/netns-ethernet.sh" down "$hosts" >/dev/null 2>&1 || true
}
trap cleanup EXIT
trap 'exit 130' INT TERM

rc=0
for rate in "${rates[@]}"; do
  "$here/netns-ethernet.sh" up "$hosts" "$rate" >/dev/null
  args=(--model medium --global-batch 16 --micro-batches 4 --steps 2 --threads 1 "$@"
    --net "$rate")
  "$here/netns-job.sh" "$hosts" "$per_host" env RTP_BENCH_NIC=eth0 \
    timeout "${RTP_BENCH_TIMEOUT:-3600}" "$bench" "${args[@]}" &
  job=$!
  wait "$job" || rc=1
  job=
  "$here/netns-ethernet.sh" down "$hosts" >/dev/null
done
exit $rc
