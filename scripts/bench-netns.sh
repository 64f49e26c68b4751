#!/usr/bin/env bash
# bench-netns.sh BUILD_DIR [N] [RATE] [SIZES_MIB] - the transport on an emulated Ethernet:
# sets up N hosts (scripts/netns-ethernet.sh), measures one link with iperf3, runs
# bench-comm with one rank per host through rtp-run, and tears everything down. Prints
# JSON lines: one {"bench":"iperf3",...} then bench-comm's, with "net" = RATE.
# Needs root. Example: sudo scripts/bench-netns.sh build 4 1gbit 1,4,16,64
set -euo pipefail

build=${1:?usage: $0 BUILD_DIR [N] [RATE] [SIZES_MIB]}
n=${2:-4}
rate=${3:-1gbit}
sizes=${4:-1,4,16,64}
here=$(cd "$(dirname "$0")" && pwd)
export RTP_NETNS_PREFIX=${RTP_NETNS_PREFIX:-rtpb$$}
prefix=$RTP_NETNS_PREFIX
net=${RTP_NETNS_NET:-231}

trap '"$here/netns-ethernet.sh" down "$n" >/dev/null 2>&1 || true' EXIT
"$here/netns-ethernet.sh" up "$n" "$rate" >/dev/null

# iperf3 from host 0 to host 1, the reference for what one link can carry
ip netns exec "${prefix}1" iperf3 -s -1 -D -p 5201
sleep 0.3
bps=$(ip netns exec "${prefix}0" iperf3 -c "10.${net}.0.2" -p 5201 -t 3 -J |
  python3 -c 'import json,sys; print(json.load(sys.stdin)["end"]["sum_received"]["bits_per_second"])')
python3 -c "import sys; b=float(sys.argv[1]); print('{\"bench\":\"iperf3\",\"net\":\"%s\",\"GBps\":%.4f}' % (sys.argv[2], b/8e9))" "$bps" "$rate"

RTP_TOKEN=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')
export RTP_TOKEN
pids=()
for ((i = n - 1; i >= 0; i--)); do
  out=/dev/null
  [[ $i -eq 0 ]] && out=/dev/stdout
  ip netns exec "${prefix}$i" "$build/tools/rtp-run" -n 1 --nnodes "$n" --node-rank "$i" \
    --master "10.${net}.0.1:29500" -- "$build/bench/bench-comm" --sizes-mib "$sizes" \
    --net "$rate" | sed 's/^\[0\] //' >"$out" &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
exit $rc
