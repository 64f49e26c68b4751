#!/usr/bin/env bash
# bench-parallel-netns.sh BUILD_DIR [N] [RATE] [-- BENCH-PARALLEL ARGS...] - the parallel
# strategies over an emulated Ethernet: sets up N hosts at RATE (scripts/netns-ethernet.sh,
# default 2 hosts at 1gbit), runs one bench-parallel rank per host (RTP_RANK, RTP_WORLD_SIZE,
# RTP_MASTER_ADDR = host 0, a random RTP_TOKEN), prints rank 0's JSON lines with "net" =
# RATE, and tears the hosts down on any exit. Only the namespaces' own addresses are used.
# The default arguments, which later ones override:
#   --model small --batch 8 --threads 1 --steps 3 --strategies "ddp fsdp rtp"
# Needs root; skips otherwise. Example: sudo scripts/bench-parallel-netns.sh build 2 1gbit
# Environment: RTP_BENCH_TIMEOUT (seconds for the whole job, default 900), and
# netns-ethernet.sh's RTP_NETNS_PREFIX / RTP_NETNS_NET.
set -euo pipefail

usage() {
  echo "usage: $0 BUILD_DIR [N] [RATE] [-- BENCH-PARALLEL ARGS...]" >&2
  exit 2
}

build=${1:-}
[[ -n "$build" && "$build" != -* ]] || usage
shift
n=2
rate=1gbit
if [[ $# -gt 0 && "$1" != "--" ]]; then n=$1; shift; fi
if [[ $# -gt 0 && "$1" != "--" ]]; then rate=$1; shift; fi
if [[ $# -gt 0 ]]; then [[ "$1" == "--" ]] || usage; shift; fi
[[ "$n" =~ ^[0-9]+$ && "$n" -ge 1 && "$n" -le 64 ]] || usage

if [[ $(id -u) -ne 0 ]]; then
  echo "$0: skipped: network namespaces need root" >&2
  exit 0
fi
bench="$build/bench/bench-parallel"
[[ -x "$bench" ]] || { echo "$0: $bench not found (build the bench-parallel target)" >&2; exit 2; }

here=$(cd "$(dirname "$0")" && pwd)
# A prefix of our own (<= 10 characters), so that other runs' namespaces are left alone.
export RTP_NETNS_PREFIX=${RTP_NETNS_PREFIX:-rtpp$(($$ % 100000))}
export RTP_NETNS_NET=${RTP_NETNS_NET:-231}
job=

# shellcheck disable=SC2317  # called by the trap
cleanup() {
  [[ -n "$job" ]] && kill "$job" 2>/dev/null && wait "$job" 2>/dev/null
  "$here/netns-ethernet.sh" down "$n" >/dev/null 2>&1 || true
}
trap cleanup EXIT
trap 'exit 130' INT TERM
"$here/netns-ethernet.sh" up "$n" "$rate" >/dev/null

args=(--model small --batch 8 --threads 1 --steps 3 --strategies "ddp fsdp rtp" "$@"
  --net "$rate")
"$here/netns-job.sh" "$n" 1 timeout "${RTP_BENCH_TIMEOUT:-900}" "$bench" "${args[@]}" &
job=$!
rc=0
wait "$job" || rc=1
job=
exit $rc
