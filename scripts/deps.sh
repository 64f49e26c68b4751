#!/usr/bin/env bash
# Installs what a fresh Debian machine lacks to build and test rtp. Idempotent: does
# nothing when every package is already there.
set -euo pipefail
pkgs=(build-essential cmake pkg-config libuv1-dev libopenblas-dev libdnnl-dev libssl-dev
      libgtest-dev googletest python3 python3-torch python3-numpy python3-matplotlib iproute2
      iperf3)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
echo "deps.sh: installing ${missing[*]}"
sudo=""
[ "$(id -u)" -ne 0 ] && sudo="sudo"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -q
$sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
