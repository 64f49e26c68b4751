#!/usr/bin/env bash
# Installs the build tree into a scratch prefix and builds two consumers against it: one
# with find_package(rtp) (C and C++), one with pkg-config. Usage: test-install.sh BUILD_DIR
set -euo pipefail
build=$1
src=$(cd "$(dirname "$0")" && pwd)
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
cmake --install "$build" --prefix "$scratch/prefix" > /dev/null
for f in include/rtp.h include/rtp.hpp bin/rtp-run lib/librtp.a lib/cmake/rtp/rtpConfig.cmake \
         lib/pkgconfig/rtp.pc; do
  [ -e "$scratch/prefix/$f" ] || { echo "missing after install: $f"; exit 1; }
done
cmake -S "$src/install-consumer" -B "$scratch/consumer" -DCMAKE_PREFIX_PATH="$scratch/prefix" \
      > /dev/null
cmake --build "$scratch/consumer" > /dev/null
"$scratch/consumer/consumer"
"$scratch/consumer/consumer-cpp"
export PKG_CONFIG_PATH="$scratch/prefix/lib/pkgconfig"
cc -std=c11 $(pkg-config --cflags rtp) "$src/install-consumer/consumer.c" -o "$scratch/pc" \
   $(pkg-config --static --libs rtp)
"$scratch/pc"
"$scratch/prefix/bin/rtp-run" -n 1 -- true
echo "install: ok"
