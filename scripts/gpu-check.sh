#!/usr/bin/env bash
# One command that checks a machine with NVIDIA GPUs: builds rtp for the local GPU and runs,
# each step bounded in time and printing a JSON line (also in OUTDIR/gpu-check.jsonl):
#   env        the GPUs, driver, toolkit and PyTorch found
#   build      Release, for this GPU's architecture only, on every core
#   test-cuda  every kernel against the CPU, a GPT training step
#   test-nccl  the NCCL transport (one GPU: one rank; two or more: the ranks)
#   test-cuda-ranks  N ranks on N GPUs over NCCL, and two ranks sharing GPU 0 over TCP
#   train-f32, train-bf16   train-gpt --config small on the GPU and on the CPU, same seed
#   files      checkpoints, --resume, --export, --eval-only and --sample from a GPU run
#   out-of-memory  a model larger than the GPU: exit 1 and a message naming the free memory
#   shared-gpu  two ranks of train-gpt on GPU 0 over TCP against two ranks on the CPU
#   speed      bench/gpu-speed.sh: tokens/s against PyTorch (where python3 has torch)
#   summary    how many steps passed, failed and were skipped
# Everything it writes is under OUTDIR (default ./gpu-check-out); it needs no network.
# Dependencies: the CUDA toolkit (nvcc, cuBLAS), NCCL (or PyTorch's wheel of it), CMake, a
# C/C++ compiler; libuv, OpenBLAS, OpenSSL and GoogleTest from the system or, without apt,
# from Debian packages carried in RTP_DEPS_DIR (scripts/deps.sh --download / --unpack).
# RTP_GPU_CHECK_BUILD=DIR skips the build step and uses DIR's programs.
set -uo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
out=$(mkdir -p "${1:-gpu-check-out}" && cd "${1:-gpu-check-out}" && pwd)
jsonl=$out/gpu-check.jsonl
: >"$jsonl"
passed=0 failed=0 skipped=0
t_start=$(date +%s.%N)

json_str() { python3 -c 'import json,sys; print(json.dumps(sys.argv[1]))' "$1"; }
since() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }

# record NAME STATUS SECONDS DETAIL: one JSON line on stdout and in the .jsonl
record() {
  local line
  line=$(printf '{"check": "%s", "status": "%s", "seconds": %.1f, "detail": %s}' \
    "$1" "$2" "$3" "$(json_str "$4")")
  echo "$line" | tee -a "$jsonl"
  case $2 in pass) passed=$((passed + 1)) ;; skip) skipped=$((skipped + 1)) ;;
    *) failed=$((failed + 1)) ;; esac
}

# step NAME LIMIT_S CMD...: runs CMD under a time limit, its output in OUTDIR/NAME.log;
# status pass (exit 0), skip (exit 77), timeout (124) or fail; detail: the log's last line.
step() {
  local name=$1 limit=$2 t0 rc status
  shift 2
  t0=$(date +%s.%N)
  timeout -k 10 "$limit" "$@" >"$out/$name.log" 2>&1
  rc=$?
  case $rc in 0) status=pass ;; 77) status=skip ;; 124 | 137) status=timeout ;; *) status=fail ;; esac
  record "$name" "$status" "$(since "$t0")" \
    "$(grep -v '^\s*$' "$out/$name.log" | tail -1 | cut -c1-300)"
  return $rc
}

# A GoogleTest program, then a line of its counts: skip (77) when every test it ran skipped.
gtest_run() {
  local log rc ran skipped
  log=$("$1" 2>&1)
  rc=$?
  echo "$log"
  [ $rc -ne 0 ] && return $rc
  ran=$(echo "$log" | sed -n 's/^\[==========\] \([0-9]*\) tests\? from .* ran\..*/\1/p')
  skipped=$(echo "$log" | sed -n 's/^\[  SKIPPED \] \([0-9]*\) tests\?, listed below:/\1/p')
  echo "$ran tests: $((ran - ${skipped:-0})) passed, ${skipped:-0} skipped"
  [ -n "$ran" ] && [ "$ran" = "${skipped:-0}" ] && return 77
  return 0
}

gtest_step() {
  step "$1" "$2" bash -c "$(declare -f gtest_run); gtest_run \"\$1\"" _ "$3"
}

# ---- env ---------------------------------------------------------------------------------
t0=$(date +%s.%N)
gpus=$(nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version --format=csv,noheader 2>&1)
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .')
torch_v=$(python3 -c 'import torch; print(torch.__version__)' 2>/dev/null || echo none)
nvcc_v=$(nvcc --version 2>/dev/null | grep -o 'release [0-9.]*' || echo "no nvcc")
if [ "$ngpu" -gt 0 ] && [ -n "$cap" ]; then
  record env pass "$(since "$t0")" \
    "$ngpu GPU(s): $(echo "$gpus" | paste -sd';'); CUDA $nvcc_v; torch $torch_v"
else
  record env fail "$(since "$t0")" "no GPU found: $gpus"
fi

# ---- build -------------------------------------------------------------------------------
if [ -n "${RTP_DEPS_DIR:-}" ]; then
  bash "$src/scripts/deps.sh" --unpack "$RTP_DEPS_DIR" >/dev/null && . "$RTP_DEPS_DIR/env.sh"
fi
# NCCL: the system's or the toolkit's, or else the one PyTorch's wheel carries.
nccl_flags=()
if ! { ldconfig -p 2>/dev/null | grep -q 'libnccl\.so '; } && [ ! -e /usr/local/cuda/lib64/libnccl.so ]; then
  nccl=$(python3 -c 'import nvidia.nccl as n; print(list(n.__path__)[0])' 2>/dev/null)
  [ -f "$nccl/include/nccl.h" ] && nccl_flags=(-DNCCL_INCLUDE_DIR="$nccl/include"
                                               -DNCCL_LIBRARY="$nccl/lib/libnccl.so.2")
fi
build=${RTP_GPU_CHECK_BUILD:-$out/build}
targets=(test-cuda test-nccl test-cuda-ranks train-gpt rtp-run bench-gpu)
if [ -z "${RTP_GPU_CHECK_BUILD:-}" ]; then
  step build 420 bash -c 'cmake -S "$1" -B "$2" -DCMAKE_BUILD_TYPE=Release -DRTP_CUDA=ON \
      -DRTP_CUDA_ARCHS="$3-real" "${@:5}" && cmake --build "$2" -j "$(nproc)" --target $4' \
    _ "$src" "$build" "$cap" "${targets[*]}" "${nccl_flags[@]}" ||
    echo "gpu-check: the build failed: $out/build.log (missing libraries: RTP_DEPS_DIR, scripts/deps.sh)" >&2
fi

# ---- tests -------------------------------------------------------------------------------
gtest_step test-cuda 300 "$build/tests/test-cuda"
gtest_step test-nccl 240 "$build/tests/test-nccl"
gtest_step test-cuda-ranks 420 "$build/tests/test-cuda-ranks"

# ---- train-gpt on the GPU against the CPU ------------------------------------------------
# losses A B TOL: the largest relative difference of the two metrics files' losses, which
# must have the same steps; exit 1 above TOL.
losses_agree() {
  python3 - "$@" <<'PY'
import json, sys
a, b, tol = sys.argv[1], sys.argv[2], float(sys.argv[3])
def read(p):
    return {r["step"]: r["loss"] for r in map(json.loads, open(p)) if "loss" in r}
la, lb = read(a), read(b)
if not la or la.keys() != lb.keys():
    sys.exit(f"the runs logged different steps: {sorted(la)[:5]} vs {sorted(lb)[:5]}")
d = max(abs(la[s] - lb[s]) / max(abs(lb[s]), 1e-12) for s in la)
print(f"{len(la)} steps, largest relative loss difference {d:.2e} (tolerance {tol:g}); "
      f"last loss {la[max(la)]:.5f} vs {lb[max(lb)]:.5f}")
sys.exit(0 if d <= tol else 1)
PY
}

train=(--config small --steps 30 --log-every 10 --eval-windows 0 --eval-problems 0
       --fused-attn off --seed 7)
for prec in f32 bf16; do
  flags=()
  tol=1e-4
  [ $prec = bf16 ] && flags=(--bf16) && tol=1e-2
  step "train-$prec" 300 bash -c '"$1/examples/train-gpt" "${@:4}" --device cuda --metrics "$2/gpu-$3.jsonl" &&
      "$1/examples/train-gpt" "${@:4}" --device cpu --metrics "$2/cpu-$3.jsonl"' \
    _ "$build" "$out" "$prec" "${train[@]}" "${flags[@]}" &&
    step "train-$prec-agree" 30 bash -c "$(declare -f losses_agree); losses_agree \"\$@\"" _ \
      "$out/gpu-$prec.jsonl" "$out/cpu-$prec.jsonl" "$tol"
done

# ---- checkpoints, export and sampling from a GPU run -------------------------------------
# 20 steps on the GPU straight; 10 steps with a checkpoint, resumed to 20 on the GPU (the
# same losses, bit for bit) and on the CPU (to float rounding); the GPU run's export read
# back by the CPU and the GPU (--eval-only: the same loss) and sampled from.
files() {
  local b=$1 o=$2 f=(--config small --log-every 10 --eval-windows 16 --eval-problems 0
                     --fused-attn off --seed 3)
  rm -rf "$o/ck" "$o/ck-cpu"
  "$b/examples/train-gpt" "${f[@]}" --steps 20 --device cuda --metrics "$o/straight.jsonl" \
    --export "$o/model.safetensors" || return 1
  "$b/examples/train-gpt" "${f[@]}" --steps 10 --device cuda --ckpt-dir "$o/ck" || return 1
  cp -r "$o/ck" "$o/ck-cpu"
  "$b/examples/train-gpt" "${f[@]}" --steps 20 --device cuda --ckpt-dir "$o/ck" --resume \
    --metrics "$o/resumed.jsonl" || return 1
  "$b/examples/train-gpt" "${f[@]}" --steps 20 --device cpu --ckpt-dir "$o/ck-cpu" --resume \
    --metrics "$o/resumed-cpu.jsonl" || return 1
  python3 - "$o" <<'PY' || return 1
import json, sys
o = sys.argv[1]
def losses(name):
    return {r["step"]: r["loss"] for r in map(json.loads, open(f"{o}/{name}"))}
a, b, c = losses("straight.jsonl"), losses("resumed.jsonl"), losses("resumed-cpu.jsonl")
late = [s for s in a if s > 10]
assert sorted(b) == late == sorted(c), (sorted(b), late, sorted(c))
bad = [s for s in late if b[s] != a[s]]
assert not bad, f"resumed on the GPU differs from straight at steps {bad}"
d = max(abs(c[s] - a[s]) / abs(a[s]) for s in late)
assert d < 1e-4, f"resumed on the CPU differs by {d:.2e}"
print(f"GPU resume bit-exact over steps 11-20; CPU resume within {d:.1e}")
PY
  local e_gpu e_cpu
  e_gpu=$("$b/examples/train-gpt" --init "$o/model.safetensors" --eval-only --device cuda --eval-problems 0 \
            --eval-windows 16 --fused-attn off) || return 1
  e_cpu=$("$b/examples/train-gpt" --init "$o/model.safetensors" --eval-only --device cpu --eval-problems 0 \
            --eval-windows 16 --fused-attn off) || return 1
  echo "eval-only: GPU $e_gpu; CPU $e_cpu"
  python3 -c 'import json,sys; a,b=(json.loads(x)["eval_loss"] for x in sys.argv[1:]);
assert abs(a-b) <= 1e-4*abs(b), (a, b)' "$e_gpu" "$e_cpu" || return 1
  "$b/examples/train-gpt" --init "$o/model.safetensors" --device cuda --steps 0 --sample 40 \
    --fused-attn off || return 1
  echo "checkpoints, export, eval-only and sample from a GPU run: all agree"
}
step files 300 bash -c "$(declare -f files); files \"\$1\" \"\$2\"" _ "$build" "$out"

# ---- a model larger than the GPU: a clear error, not a crash ------------------------------
oom() {
  local log
  log=$("$1/examples/train-gpt" --config small --n-layer 64 --d-model 8192 --n-head 64 \
          --steps 1 --device cuda 2>&1)
  local rc=$?
  echo "$log" | tail -3
  [ $rc -eq 1 ] && echo "$log" | grep -q "free" && echo "refused with exit 1, naming the free memory"
}
step out-of-memory 60 bash -c "$(declare -f oom); oom \"\$1\"" _ "$build"

# ---- two ranks on one GPU over TCP -------------------------------------------------------
shared=(--config small --steps 20 --log-every 10 --eval-windows 0 --eval-problems 0
        --fused-attn off --seed 7)
step shared-gpu 300 bash -c 'RTP_BACKEND=tcp CUDA_VISIBLE_DEVICES=0 "$1/tools/rtp-run" -n 2 -- \
      "$1/examples/train-gpt" "${@:3}" --device cuda --metrics "$2/shared-gpu.jsonl" &&
    "$1/tools/rtp-run" -n 2 -- "$1/examples/train-gpt" "${@:3}" --device cpu \
      --metrics "$2/shared-cpu.jsonl"' _ "$build" "$out" "${shared[@]}" &&
  step shared-gpu-agree 30 bash -c "$(declare -f losses_agree); losses_agree \"\$@\"" _ \
    "$out/shared-gpu.jsonl" "$out/shared-cpu.jsonl" 1e-4

# ---- speed -------------------------------------------------------------------------------
# Passes when rtp ran every case it started (a case the time budget cut is not a failure).
speed() {
  RTP_BUILD=$1 bash "$2/bench/gpu-speed.sh" "$3" || return 1
  grep '"impl":"rtp"' "$3/gpu-speed.jsonl" | grep -qv '"error"' || return 1
  ! grep '"impl":"rtp"' "$3/gpu-speed.jsonl" | grep '"error"' | grep -qv 'skipped'
}
step speed 300 bash -c "$(declare -f speed); speed \"\$@\"" _ "$build" "$src" "$out"

total=$(since "$t_start")
summary=$(printf '{"check": "summary", "passed": %d, "failed": %d, "skipped": %d, "seconds": %.1f}' \
  $passed $failed $skipped "$total")
echo "$summary" | tee -a "$jsonl"
[ $failed -eq 0 ]
