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
# The package never makes its users link or load CUDA or NCCL, not even from a CUDA build:
# librtp.a holds the static CUDA runtime and opens the driver, NCCL and cuBLAS when a GPU
# is asked for (docs/backend.md, "CUDA at run time").
gpu='lib(cuda|cudart|nccl|cublas|cublasLt)[.]so|-l(cuda|cudart|nccl|cublas)\b|CUDA::'
for bin in consumer/consumer consumer/consumer-cpp consumer/consumer-gpt pc pc-gpt; do
  if readelf -d "$scratch/$bin" | grep NEEDED | grep -E "$gpu"; then
    echo "$bin needs CUDA or NCCL libraries (build with CUDA: $with_cuda)"
    exit 1
  fi
done
if pkg-config --static --libs rtp rtp-gpt | grep -E "$gpu" ||
   grep -E "$gpu" "$scratch"/prefix/lib/cmake/rtp/*.cmake; then
  echo "the package names CUDA or NCCL (build with CUDA: $with_cuda)"
  exit 1
fi
# A static OpenBLAS's dependencies are not the consumer's: it links the shared one.
if pkg-config --static --libs rtp rtp-gpt | grep -E -- '-lgfortran'; then
  echo "rtp.pc makes its users link the Fortran runtime"
  exit 1
fi
echo "install: ok"
