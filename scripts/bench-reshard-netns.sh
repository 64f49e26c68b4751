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
export RTP_NETNS_PREFIX=${RTP_NETNS_PREFIX:-rtpr$(($$ % 100000))}
prefix=$RTP_NETNS_PREFIX
net=${RTP_NETNS_NET:-233}
export RTP_NETNS_NET=$net
rate=${RTP_BENCH_RATE:-1gbit}
per_host=2
tmp=$(mktemp -d)
pids=()
up=0

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
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  [[ $up -gt 0 ]] && "$here/netns-ethernet.sh" down "$up" >/dev/null 2>&1
  rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

rc=0
for hosts in "${counts[@]}"; do
  "$here/netns-ethernet.sh" up "$hosts" "$rate" >/dev/null
  up=$hosts
  token=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')
  world=$((hosts * per_host))
  pids=()
  for ((r = world - 1; r >= 0; r--)); do
    h=$((r / per_host))
    ip netns exec "${prefix}$h" env RTP_RANK="$r" RTP_WORLD_SIZE="$world" \
      RTP_LOCAL_RANK=$((r % per_host)) RTP_LOCAL_WORLD_SIZE="$per_host" \
      RTP_MASTER_ADDR="10.${net}.0.1" RTP_MASTER_PORT=29500 RTP_TOKEN="$token" \
      timeout "${RTP_BENCH_TIMEOUT:-1800}" "$bench" --bandwidth "$bw" "$@" \
      >"$tmp/out$r" 2>"$tmp/err$r" &
    pids+=($!)
  done
  for ((k = 0; k < world; k++)); do
    r=$((world - 1 - k))
    if ! wait "${pids[$k]}"; then
      rc=1
      echo "$0: $hosts hosts: rank $r failed:" >&2
      sed 's/^/  /' "$tmp/err$r" >&2
    fi
  done
  pids=()
  grep '^{' "$tmp/out0" | sed "s/^{/{\"net\":\"$rate\",/" || true
  "$here/netns-ethernet.sh" down "$hosts" >/dev/null
  up=0
done
exit $rc
