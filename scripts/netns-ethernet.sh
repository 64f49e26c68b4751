#!/usr/bin/env bash
# netns-ethernet.sh up|down N [RATE] - an emulated Ethernet of N hosts on this machine.
#
#   up N RATE   N network namespaces ${PREFIX}0 .. ${PREFIX}N-1, each with eth0 at
#               10.${NET}.0.(i+1)/24, all plugged into one bridge that lives in its own
#               namespace ${PREFIX}br (so the host's own network is never touched). Every
#               link is limited to RATE (tc syntax: 100mbit, 1gbit, 10gbit) in each direction
#               with tc tbf, on both ends: a host sends at most RATE and receives at most
#               RATE, like a port of a switch. (netem is not available, so no added delay.)
#   down N      removes them.
#
# Run a program as host i:  ip netns exec ${PREFIX}i prog ...
# Environment: RTP_NETNS_PREFIX (default rtpns, at most 10 characters), RTP_NETNS_NET
# (the second octet of the 10.x.0.0/24 network, default 231). Needs root (CAP_NET_ADMIN).
set -euo pipefail

prefix=${RTP_NETNS_PREFIX:-rtpns}
net=${RTP_NETNS_NET:-231}
cmd=${1:-}
n=${2:-}

usage() {
  echo "usage: $0 up N RATE | down N   (e.g. $0 up 4 1gbit)" >&2
  exit 2
}

[[ -n "$cmd" && "$n" =~ ^[0-9]+$ && "$n" -ge 1 && "$n" -le 250 ]] || usage
[[ ${#prefix} -le 10 ]] || { echo "$0: RTP_NETNS_PREFIX is too long" >&2; exit 2; }

# bytes per second of a tc rate, for the bucket size
rate_bytes() {
  local r=$1 num unit
  num=${r%%[a-zA-Z]*}
  unit=${r#"$num"}
  case "$unit" in
    gbit) echo $((num * 125000000)) ;;
    mbit) echo $((num * 125000)) ;;
    kbit) echo $((num * 125)) ;;
    bit | "") echo $((num / 8)) ;;
    *) echo "$0: rate '$r' not understood (use e.g. 100mbit, 1gbit)" >&2; exit 2 ;;
  esac
}

shape() { # namespace device rate
  local ns=$1 dev=$2 rate=$3 bps burst
  bps=$(rate_bytes "$rate")
  burst=$((bps / 250)) # 4 ms of traffic, enough for the kernel timer
  [[ $burst -lt 131072 ]] && burst=131072
  ip netns exec "$ns" tc qdisc replace dev "$dev" root tbf rate "$rate" burst "$burst" latency 20ms
}

down() {
  for ((i = 0; i < n; i++)); do
    ip netns del "${prefix}$i" 2>/dev/null || true
  done
  ip netns del "${prefix}br" 2>/dev/null || true
}

up() {
  local rate=$1
  rate_bytes "$rate" >/dev/null
  down
  ip netns add "${prefix}br"
  ip -n "${prefix}br" link add br0 type bridge
  ip -n "${prefix}br" link set br0 up
  ip -n "${prefix}br" link set lo up
  for ((i = 0; i < n; i++)); do
    local ns="${prefix}$i" v="${prefix}v$i"
    ip netns add "$ns"
    ip link add "$v" type veth peer name "${v}p"
    ip link set "$v" netns "${prefix}br"
    ip link set "${v}p" netns "$ns"
    ip -n "$ns" link set "${v}p" name eth0
    ip -n "$ns" addr add "10.${net}.0.$((i + 1))/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
    ip -n "${prefix}br" link set "$v" master br0
    ip -n "${prefix}br" link set "$v" up
    shape "$ns" eth0 "$rate"           # what host i sends
    shape "${prefix}br" "$v" "$rate"   # what host i receives
    echo "${ns} 10.${net}.0.$((i + 1))"
  done
}

case "$cmd" in
  up) [[ -n "${3:-}" ]] || usage; up "$3" ;;
  down) down ;;
  *) usage ;;
esac
