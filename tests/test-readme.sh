#!/usr/bin/env bash
# Runs the shell block of one README section as written there, from a scratch directory
# that looks like the repository's root (build/ and docs/ link to the real ones), and checks
# what it printed.
# Usage: test-readme.sh BUILD_DIR SECTION   (SECTION: own-text or gpt2)
# gpt2 needs transformers: RTP_TEST_PYTHON, else python3, must import it (exit 77 if none).
set -euo pipefail
build=$(cd "$1" && pwd)
section=$2
root=$(cd "$(dirname "$0")/.." && pwd)
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT

# The lines of the first ``` block after the heading "## $1".
readme_block() {
  awk -v h="## $1" '$0 == h { s = 1; next } s && /^## / { exit }
    s && /^```/ { if (b) exit; b = 1; next } b { print }' "$root/README.md"
}

case $section in
  own-text) heading="Train on your own text" ;;
  gpt2) heading="Fine-tune GPT-2" ;;
  *) echo "test-readme.sh: no section '$section'"; exit 2 ;;
esac
block=$(readme_block "$heading")
[ -n "$block" ] || { echo "README.md: no shell block under '## $heading'"; exit 1; }
ln -s "$build" "$scratch/build"
ln -s "$root/docs" "$scratch/docs"

# What the GPT-2 lines need and must not do here: the download becomes a small random
# GPT2LMHeadModel of GPT-2's vocabulary, the token files random GPT-2 tokens, python3 the
# Python that has transformers, and the training a short run (flags appended: the last wins).
if [ "$section" = gpt2 ]; then
  py=${RTP_TEST_PYTHON:-python3}
  if ! "$py" -c "import transformers" 2> /dev/null; then
    echo "skipped: $py cannot import transformers (set RTP_TEST_PYTHON to a Python that can)"
    exit 77
  fi
  download="python3 -c \"from transformers import GPT2LMHeadModel as M; M.from_pretrained('gpt2').save_pretrained('gpt2')\""
  grep -qxF "$download" <<< "$block" || { echo "README.md: no download line: $download"; exit 1; }
  block=$(sed -e "s|^python3 -c \"from transformers import GPT2LMHeadModel as M; M.from_pretrained('gpt2').save_pretrained('gpt2')\"\$|\"\$py\" \"\$root/scripts/hf-gpt2.py\" make gpt2 --vocab 50257 --n-positions 256|" \
    -e 's|^python3 |"$py" |' \
    -e 's|^\(build/tools/rtp-run .*\)$|\1 --steps 4 --seq-len 32 --batch 2 --grad-accum 2 --eval-every 2 --eval-windows 8 --threads 1|' <<< "$block")
  "$py" - "$scratch" << 'PY'
import random, struct, sys
random.seed(1)
for name, n in (("train.bin", 4000), ("val.bin", 1000)):  # llm.c's GPT-2 header, then tokens
    tokens = [random.randrange(50257) for _ in range(n)]
    header = struct.pack("<256i", 20240520, 1, n, *([0] * 253))
    open(f"{sys.argv[1]}/{name}", "wb").write(header + struct.pack(f"<{n}H", *tokens))
PY
  export py root
fi
echo "$block"
(cd "$scratch" && bash -euo pipefail -c "$block") > "$scratch/out" 2>&1 ||
  { cat "$scratch/out"; echo "the README's lines failed"; exit 1; }

expect() {
  grep -q -- "$1" "$scratch/out" || { cat "$scratch/out"; echo "expected: $1"; exit 1; }
}
case $section in
  own-text)
    expect "step 300/300"
    expect "checkpoint my-ckpt/step-00000300"
    expect "^--- sample (200 bytes, sampled) ---"
    ;;
  gpt2)
    expect "vocabulary 50257"
    expect "step 4/4 .*| eval "
    expect "^[0-9][0-9]*$" # the parameter count of the model transformers loaded
    ;;
esac
echo "README's '$heading': ok"
