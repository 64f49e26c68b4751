#!/usr/bin/env bash
# Runs the shell block of one README section as written there, from a scratch directory
# that looks like the repository's root (build/ and docs/ link to the real ones), and checks
# what it printed.
# Usage: test-readme.sh BUILD_DIR SECTION   (SECTION: own-text)
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
  *) echo "test-readme.sh: no section '$section'"; exit 2 ;;
esac
block=$(readme_block "$heading")
[ -n "$block" ] || { echo "README.md: no shell block under '## $heading'"; exit 1; }
ln -s "$build" "$scratch/build"
ln -s "$root/docs" "$scratch/docs"
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
esac
echo "README's '$heading': ok"
