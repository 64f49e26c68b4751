#!/usr/bin/env bash
# bench-reshard-netns.sh BUILD_DIR [HOSTS...] [-- BENCH-RESHARD ARGS...] - the resharding
# microbenchmark (bench/bench-reshard.c) on emulated hosts: for each number of HOSTS
# (default 2 3 4) sets up that many hosts joined at RATE (RTP_BENCH_RATE, default 1gbit;
# scripts/netns-ethernet.sh), runs 2 ranks in each host's namespace (ranks of a host talk
# over its own loopback; only what crosses hosts takes the shaped link), prints rank 0's
# JSON lines with "net" and "hosts" added, and tears the hosts down. The bandwidth the
# benchmark's lower bound assumes is the rate's (1gbit: 125e6 bytes/s).
# Needs root; skips otherwise. Example: scripts/bench-reshard-netns.sh build 4 -- --mib 16
# Environment: RTP_BENCH_RATE, RTP_BENCH_TIMEOUT (seconds per run, default 1800), and
# netns-ethernet.sh's RTP_NETNS_PREFIX / RTP_NETNS_NET.
set -euo pipefail

usage() {
  echo "usage: $0 BUILD_DIR [HOSTS...] [-- BENCH-RESHARD ARGS...]" >&2
  exit 2
}

build=${1:-}
[[ -n "$build" && "$build" != -* ]] || usage
shift
counts=()
while [[ $# -gt 0 && "$1" != "--" ]]; do
  [[ "$1" =~ ^[0-9]+$ && "$1" -ge 1 ]] || usage
  counts+=("$1")
  shift
done
if [[ $# -gt 0 ]]; then shift; fi
[[ ${#counts[@]} -gt 0 ]] || counts=(2 3 4)

if [[ $(id -u) -ne 0 ]]; then
  echo "$0: skipped: network namespaces need root" >&2
  exit 0
fi
bench="$build/bench/bench-reshard"
[[ -x "$bench" ]] || { echo "$0: $bench not found (build the bench-reshard target)" >&2; exit 2; }

here=$(cd "$(dirname "$0")" && pwd)
out=$(mktemp)
export RTP_NETNS_PREFIX=${RTP_NETNS_PREFIX:-rtpr$(($$ % 100000))}
export RTP_NETNS_NET=${RTP_NETNS_NET:-233}
rate=${RTP_BENCH_RATE:-1gbit}
per_host=2
up=0
job=

# bytes per second of a tc rate (netns-ethernet.sh's units)
rate_bytes() {
  local num=${1%%[a-zA-Z]*}
  case "${1#"$num"}" in
    gbit) echo $((num * 125000000)) ;;
    mbit) echo $((num * 125000)) ;;
    *) echo "$0: rate '$1' not understood (use e.g. 100mbit, 1gbit)" >&2; exit 2 ;;
  esac
}
bw=$(rate_bytes "$rate")

# shellcheck disable=SC2317  # called by the trap
cleanup() {
  [[ -n "$job" ]] && kill "$job" 2>/dev/null && wait "$job" 2>/dev/null
  [[ $up -gt 0 ]] && "$here/netns-ethernet.sh" down "$up" >/dev/null 2>&1
  rm -f "$out"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

rc=0
for hosts in "${counts[@]}"; do
  "$here/netns-ethernet.sh" up "$hosts" "$rate" >/dev/null
  up=$hosts
  "$here/netns-job.sh" "$hosts" "$per_host" timeout "${RTP_BENCH_TIMEOUT:-1800}" "$bench" \
    --bandwidth "$bw" "$@" >"$out" &
  job=$!
  wait "$job" || rc=1
  job=
  sed "s/^{/{\"net\":\"$rate\",/" "$out"
  "$here/netns-ethernet.sh" down "$hosts" >/dev/null
  up=0
done
exit $rc
