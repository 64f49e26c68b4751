#!/usr/bin/env bash
# Installs what a fresh Debian machine lacks to build and test rtp. Idempotent: does
# nothing when every package is already there.
#
# Without network or apt (a borrowed GPU machine, say), the build's own dependencies can
# travel as Debian 12 packages instead:
#   scripts/deps.sh --download DIR   on a Debian 12 machine with network: their .debs into DIR
#   scripts/deps.sh --unpack DIR     on the machine without: unpacks them under DIR/root
#                                    (dpkg -x, no root needed) and writes DIR/env.sh, which
#                                    points CMake, pkg-config and the loader there
# then `. DIR/env.sh` before configuring (scripts/gpu-check.sh does it when given
# RTP_DEPS_DIR=DIR). The packages run on any x86-64 Linux with glibc 2.36 or later.
set -euo pipefail
offline=(libuv1 libuv1-dev libopenblas0-pthread libopenblas-pthread-dev libopenblas-dev
         libgfortran5 libquadmath0 libssl3 libssl-dev libgtest-dev pkgconf pkgconf-bin
         libpkgconf3)
if [ "${1:-}" = --download ]; then
  mkdir -p "$2" && cd "$2"
  apt-get download "${offline[@]}"
  exit 0
fi
if [ "${1:-}" = --unpack ]; then
  dir=$(cd "$2" && pwd)
  ls "$dir"/*.deb >/dev/null || { echo "deps.sh: no .deb in $dir (--download first)" >&2; exit 1; }
  for deb in "$dir"/*.deb; do dpkg-deb -x "$deb" "$dir/root"; done
  lib=$dir/root/usr/lib/x86_64-linux-gnu
  # The loader is pointed only at the libraries the system lacks: a newer copy the system
  # has (libgfortran, libssl) must not be shadowed for its other programs.
  mkdir -p "$dir/lib"
  known=$("$(command -v ldconfig || echo /sbin/ldconfig)" -p 2>/dev/null | awk '{print $1}')
  for so in "$lib"/*.so.* "$lib"/openblas-pthread/*.so.*; do
    name=$(basename "$so")
    grep -qx "$name" <<<"$known" || ln -sf "$so" "$dir/lib/$name"
  done
  cat >"$dir/env.sh" <<ENV
export CMAKE_PREFIX_PATH=$dir/root/usr\${CMAKE_PREFIX_PATH:+:\$CMAKE_PREFIX_PATH}
export OPENSSL_ROOT_DIR=$dir/root/usr
export PKG_CONFIG_PATH=$lib/pkgconfig:$lib/openblas-pthread/pkgconfig
export PKG_CONFIG_SYSROOT_DIR=$dir/root
export LD_LIBRARY_PATH=$dir/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}
command -v pkg-config >/dev/null || export PKG_CONFIG=$dir/root/usr/bin/pkgconf
ENV
  echo "deps.sh: unpacked under $dir/root; now: . $dir/env.sh"
  exit 0
fi
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
