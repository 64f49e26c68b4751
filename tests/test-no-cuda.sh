#!/usr/bin/env bash
# A CUDA build on a host without CUDA: no program of the build needs the CUDA runtime, NCCL
# or the driver to start (DT_NEEDED); with those libraries hidden from the loader (a private
# mount namespace binds an empty folder or /dev/null over them) train-gpt trains on the
# CPU, and asking for the CUDA backend or the nccl transport gives an error naming the
# missing library instead of a crash. docs/backend.md, "CUDA at run time".
# Usage: test-no-cuda.sh BUILD_DIR WITH_CUDA TRAIN_GPT RTP_RUN PROBE [CUDA_LIB_DIR...]
set -euo pipefail
build=$1 with_cuda=$2 train_gpt=$3 rtp_run=$4 probe=$5
shift 5
if [ "$with_cuda" != ON ]; then
  echo "skipped: this build has no CUDA backend (RTP_CUDA=OFF, or no toolkit found)"
  exit 77
fi
gpu='lib(cuda|cudart|nccl)[.]so'

# 1. No program links them.
bad=0
while IFS= read -r f; do
  if readelf -d "$f" 2> /dev/null | grep NEEDED | grep -E "$gpu"; then
    echo "$f needs a CUDA library to start"
    bad=1
  fi
done < <(find "$build" -type f -perm -u+x ! -name '*.so*' ! -path '*/CMakeFiles/*')
[ $bad = 0 ] || exit 1

if [ "$(id -u)" -ne 0 ] || ! unshare -m true 2> /dev/null; then
  echo "skipped after the DT_NEEDED check: hiding the libraries needs a private mount" \
    "namespace (root, and a '/' that is a mount point: not a bare chroot)"
  exit 77
fi
# 2. Where the loader could find them: the build's folders, the system's library folders
# (a driver puts libcuda.so.1 there), LD_LIBRARY_PATH and the loader's cache.
dirs=("$@" /usr/local/lib /lib/x86_64-linux-gnu /usr/lib/x86_64-linux-gnu /usr/lib64)
IFS=: read -r -a ld_path <<< "${LD_LIBRARY_PATH:-}"
dirs+=("${ld_path[@]}")
while IFS= read -r f; do
  dirs+=("$(dirname "$f")" "$(dirname "$(readlink -f "$f")")")
done < <(ldconfig -p | grep -E "$gpu|libcublas" | sed 's/.*=> //')
mapfile -t dirs < <(printf '%s\n' "${dirs[@]}" | grep . | sort -u)
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
mkdir "$scratch/empty"
# In the namespace: a folder of CUDA's own (a toolkit's, a driver's) becomes an empty one;
# in a folder shared with other libraries only the CUDA files are hidden, by /dev/null.
cat > "$scratch/hidden.sh" << 'INNER'
set -e
empty=$1
shift
hidden=" "
while IFS= read -r d; do
  [ -d "$d" ] || continue
  d=$(readlink -f "$d")
  case "$hidden" in *" $d "*) continue ;; esac
  hidden="$hidden$d "
  case "$d" in
    *cuda* | *nccl* | *nvidia*) mount --bind "$empty" "$d" ;;
    *)
      for f in "$d"/libcuda.so* "$d"/libcudart.so* "$d"/libnccl.so* "$d"/libcublas*.so*; do
        if [ -f "$f" ] && [ ! -L "$f" ]; then mount --bind /dev/null "$f"; fi
      done
      ;;
  esac
done <<< "$HIDE_DIRS"
exec "$@"
INNER
hidden() { # hidden CMD...: runs CMD with the libraries hidden
  HIDE_DIRS=$(printf '%s\n' "${dirs[@]}") unshare -m --propagation private \
    bash "$scratch/hidden.sh" "$scratch/empty" "$@"
}
fail() {
  echo "$1"
  shift
  cat "$@"
  exit 1
}

# The hiding works: the loader finds none of them.
if hidden bash -c 'for l in libcudart.so.13 libnccl.so.2 libcuda.so.1; do
     python3 -c "import ctypes,sys; ctypes.CDLL(sys.argv[1])" $l 2> /dev/null && echo $l; done' |
  grep .; then
  echo "the libraries above are still found: cannot test without them here"
  exit 1
fi

# 3. The CPU path: a few steps of train-gpt.
hidden "$train_gpt" --config tiny --steps 3 --batch 2 > "$scratch/train" 2>&1 ||
  fail "train-gpt failed on the CPU without the CUDA libraries:" "$scratch/train"
grep -q "loss" "$scratch/train" || fail "train-gpt printed no loss:" "$scratch/train"

# 4. The GPU paths: a clear error (ENOSYS) naming the missing library, no crash.
hidden "$probe" > "$scratch/probe" 2>&1 || fail "no-cuda-probe crashed:" "$scratch/probe"
grep -qx "cuda devices: 0" "$scratch/probe" || fail "CUDA devices found:" "$scratch/probe"
grep -q "^cuda backend: .*libcuda.so.1 cannot be loaded" "$scratch/probe" ||
  fail "the CUDA backend's error does not name libcuda.so.1:" "$scratch/probe"
grep -q "^nccl transport: .*NCCL (libnccl.so.2), which cannot be loaded" "$scratch/probe" ||
  fail "the nccl transport's error does not name libnccl.so.2:" "$scratch/probe"
RTP_NCCL_LIBRARY=/nonexistent/libnccl.so.2 hidden "$probe" > "$scratch/probe-env" 2>&1 ||
  fail "no-cuda-probe crashed:" "$scratch/probe-env"
grep -q "^nccl transport: .*NCCL (/nonexistent/libnccl.so.2), which cannot" \
  "$scratch/probe-env" || fail "RTP_NCCL_LIBRARY is not the one named:" "$scratch/probe-env"
# train-gpt on two ranks asked for the nccl transport: each rank says why and exits.
if RTP_BACKEND=nccl hidden "$rtp_run" -n 2 -- "$train_gpt" --config tiny --steps 3 --batch 2 \
  > "$scratch/nccl" 2>&1; then
  fail "train-gpt joined an nccl job without NCCL:" "$scratch/nccl"
fi
grep -q "libnccl.so.2), which cannot be loaded" "$scratch/nccl" ||
  fail "train-gpt's error does not name libnccl.so.2:" "$scratch/nccl"
if grep -qiE "segmentation|core dumped|abort" "$scratch/nccl"; then
  fail "train-gpt crashed:" "$scratch/nccl"
fi
cat "$scratch/probe"
echo "no-cuda: ok"
