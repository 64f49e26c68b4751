#!/usr/bin/env bash
# `make build` (and so `make run`) wraps `cmake --build`, whose make runs below ours: every
# make under another prints "Entering directory" lines around the build's own unless told
# not to. A fake cmake whose build is a make with a make under it (as CMake's Makefiles
# have) stands in for the real build, so this takes no compiler. Usage: test-make-quiet.sh
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
mkdir "$scratch/bin" "$scratch/build"
printf 'all:\n\t@$(MAKE) -f Makefile inner\ninner:\n\t@echo fake build done\n' \
  > "$scratch/build/Makefile"
cat > "$scratch/bin/cmake" <<'FAKE'
#!/bin/sh
# configure: nothing; --build DIR ...: make in DIR, as cmake --build runs it
[ "$1" = --build ] && cd "$2" && exec make
exit 0
FAKE
chmod +x "$scratch/bin/cmake"
# -o deps: the packages are not this test's business. Under `make test` this runs below a
# make whose flags would reach these makes; they must come from the Makefile alone.
out=$(cd "$src" && env -u MAKEFLAGS -u MFLAGS -u MAKELEVEL PATH="$scratch/bin:$PATH" \
      make -o deps build BUILD="$scratch/build" 2>&1)
echo "$out"
grep -q 'fake build done' <<< "$out" || { echo "the fake build did not run"; exit 1; }
if grep -q 'Entering directory' <<< "$out"; then
  echo "make build prints recursive make's directory lines"
  exit 1
fi
echo "make-quiet: ok"
