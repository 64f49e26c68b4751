#!/usr/bin/env bash
# netns-job.sh HOSTS PER_HOST CMD [ARGS...] - one job of HOSTS x PER_HOST ranks on the hosts
# that scripts/netns-ethernet.sh set up (RTP_NETNS_PREFIX, RTP_NETNS_NET as it had them):
# rank r runs CMD in host r / PER_HOST's namespace with RTP_RANK, RTP_WORLD_SIZE,
# RTP_LOCAL_RANK, RTP_LOCAL_WORLD_SIZE, RTP_MASTER_ADDR (host 0), RTP_MASTER_PORT and a
# random RTP_TOKEN of the job. Prints rank 0's JSON lines; a rank that fails has its
# standard error printed, and the status is 1. Stopping this script stops the ranks.
# What the netns benchmark scripts share (bench-parallel-, bench-pipeline-,
# bench-reshard-netns.sh).
set -euo pipefail

[[ $# -ge 3 && "$1" =~ ^[0-9]+$ && "$2" =~ ^[0-9]+$ ]] || {
  echo "usage: $0 HOSTS PER_HOST CMD [ARGS...]" >&2
  exit 2
}
hosts=$1
per_host=$2
shift 2
prefix=${RTP_NETNS_PREFIX:?set by the caller, as for netns-ethernet.sh}
net=${RTP_NETNS_NET:-231}
world=$((hosts * per_host))
tmp=$(mktemp -d)
pids=()

# shellcheck disable=SC2317  # called by the trap
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

token=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')
for ((r = world - 1; r >= 0; r--)); do # rank 0 last: the others wait for it anyway
  ip netns exec "${prefix}$((r / per_host))" env RTP_RANK="$r" RTP_WORLD_SIZE="$world" \
    RTP_LOCAL_RANK=$((r % per_host)) RTP_LOCAL_WORLD_SIZE="$per_host" \
    RTP_MASTER_ADDR="10.${net}.0.1" RTP_MASTER_PORT=29500 RTP_TOKEN="$token" \
    "$@" >"$tmp/out$r" 2>"$tmp/err$r" &
  pids+=($!)
done
rc=0
for ((k = 0; k < world; k++)); do
  r=$((world - 1 - k))
  if ! wait "${pids[$k]}"; then
    rc=1
    echo "$0: $hosts hosts: rank $r failed:" >&2
    sed 's/^/  /' "$tmp/err$r" >&2
  fi
done
pids=()
grep '^{' "$tmp/out0" || true
exit $rc
