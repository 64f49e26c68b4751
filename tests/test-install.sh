#!/usr/bin/env bash
# Installs the build tree into a scratch prefix and builds consumers against it: with
# find_package(rtp) (C, C++ and the reference GPT) and with pkg-config (rtp, rtp-gpt).
# Usage: test-install.sh BUILD_DIR WITH_CUDA (ON or OFF: whether the build has CUDA)
set -euo pipefail
build=$1
with_cuda=$2
src=$(cd "$(dirname "$0")" && pwd)
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
cmake --install "$build" --prefix "$scratch/prefix" > /dev/null
for f in include/rtp.h include/rtp.hpp include/rtp/gpt.h bin/rtp-run bin/rtp-plan lib/librtp.a \
         lib/librtp-gpt.a lib/cmake/rtp/rtpConfig.cmake lib/pkgconfig/rtp.pc \
         lib/pkgconfig/rtp-gpt.pc; do
  [ -e "$scratch/prefix/$f" ] || { echo "missing after install: $f"; exit 1; }
done
cmake -S "$src/install-consumer" -B "$scratch/consumer" -DCMAKE_PREFIX_PATH="$scratch/prefix" \
      > /dev/null
cmake --build "$scratch/consumer" > /dev/null
"$scratch/consumer/consumer"
"$scratch/consumer/consumer-cpp"
"$scratch/consumer/consumer-gpt"
export PKG_CONFIG_PATH="$scratch/prefix/lib/pkgconfig"
cc -std=c11 $(pkg-config --cflags rtp) "$src/install-consumer/consumer.c" -o "$scratch/pc" \
   $(pkg-config --static --libs rtp)
"$scratch/pc"
cc -std=c11 $(pkg-config --cflags rtp-gpt) "$src/install-consumer/consumer-gpt.c" \
   -o "$scratch/pc-gpt" $(pkg-config --static --libs rtp-gpt)
"$scratch/pc-gpt"
"$scratch/prefix/bin/rtp-run" -n 1 -- true
"$scratch/prefix/bin/rtp-plan" --config tiny --flops 1e10 > /dev/null
# Without CUDA the package must not make its users link or load CUDA or NCCL. With it, the
# consumers above linked and ran: rtp.pc and rtpConfig.cmake named what the library needs.
if [ "$with_cuda" = OFF ]; then
  gpu='lib(cuda|cudart|nccl|cublas|cublasLt)[.]so|-l(cuda|cudart|nccl|cublas)\b|CUDA::'
  for bin in consumer/consumer consumer/consumer-cpp consumer/consumer-gpt pc pc-gpt; do
    if ldd "$scratch/$bin" | grep -E "$gpu"; then
      echo "$bin loads CUDA or NCCL libraries from a build without CUDA"
      exit 1
    fi
  done
  if pkg-config --static --libs rtp rtp-gpt | grep -E "$gpu" ||
     grep -E "$gpu" "$scratch"/prefix/lib/cmake/rtp/*.cmake; then
    echo "the package names CUDA or NCCL in a build without CUDA"
    exit 1
  fi
fi
echo "install: ok"
