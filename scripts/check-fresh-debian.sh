#!/usr/bin/env bash
# Checks the README's claim that `make test` and `make run` work on a fresh Debian machine:
# debootstraps a Debian bookworm root, binds the CUDA toolkit this host has into it
# read-only (without its loader configuration, as NVIDIA's runfile leaves it), clones the
# repository's HEAD there and runs the README's two commands as root. A developer runs it
# before a release (an hour or more); CI does not. Needs root, debootstrap and the network.
#
# Usage: sudo scripts/check-fresh-debian.sh [--keep] [-- MAKE_ARGS...]
#   WORK=/var/tmp/rtp-fresh  where the roots go (the debootstrapped base is kept there and
#                            copied for each run, so every run starts fresh)
#   CUDA=/usr/local/cuda     the toolkit to bind ("" for none)
#   MIRROR=http://deb.debian.org/debian
#   STOP_AFTER=PHASE         stop after a phase: base, root, clone, test (default: run)
#   MAKE_ARGS go to both make commands, e.g. CMAKE_FLAGS=-DRTP_CUDA_ARCHS=90-real to build
#   the CUDA code for one GPU only.
# --keep leaves the run's root in $WORK/root for a look (its mounts are undone either way).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=${WORK:-/var/tmp/rtp-fresh}
cuda=${CUDA-/usr/local/cuda}
mirror=${MIRROR:-http://deb.debian.org/debian}
stop_after=${STOP_AFTER:-run}
keep=0
if [ "${1:-}" = --keep ]; then keep=1; shift; fi
if [ "${1:-}" = -- ]; then shift; fi
make_args=("$@")
[ "$(id -u)" -eq 0 ] || { echo "check-fresh-debian: run as root (debootstrap, chroot, mounts)"; exit 1; }
command -v debootstrap > /dev/null ||
  { echo "check-fresh-debian: needs debootstrap (apt-get install debootstrap)"; exit 1; }
base=$work/base
root=$work/root
log() { echo "[$(date -u +%H:%M:%S)] $*"; }
phase_done() { [ "$stop_after" = "$1" ] && { log "stopping after phase $1 (STOP_AFTER)"; exit 0; }; true; }

# ---- base: a bookworm root with nothing but debootstrap's default packages -------------
if [ ! -e "$base/.complete" ]; then
  log "base: debootstrap bookworm into $base"
  rm -rf "$base"
  mkdir -p "$base"
  debootstrap bookworm "$base" "$mirror" > "$work/debootstrap.log" 2>&1 ||
    { tail -20 "$work/debootstrap.log"; exit 1; }
  touch "$base/.complete"
fi
phase_done base

# ---- root: a copy of the base, with the kernel's file systems, DNS and the toolkit ----------
mounts=()
cleanup() {
  # Ours, then any the tests made (ip netns mounts /run/netns), the deepest first.
  for ((i = ${#mounts[@]} - 1; i >= 0; i--)); do umount -l "${mounts[$i]}" 2> /dev/null || true; done
  awk -v r="$root/" 'index($2, r) == 1 { print $2 }' /proc/mounts | sort -r |
    while read -r m; do umount -l "$m" || true; done
  [ $keep = 1 ] || remove_root
}
remove_root() { # never through a mount that is left: /dev is the host's
  if grep -q " $root[/ ]" /proc/mounts; then
    echo "check-fresh-debian: mounts are left under $root; not deleting it"
    return 1
  fi
  rm -rf --one-file-system "$root"
}
trap cleanup EXIT
bind() { # bind SRC DST [ro]
  mkdir -p "$2"
  mount --bind "$1" "$2"
  mounts+=("$2")
  if [ "${3:-}" = ro ]; then mount -o remount,bind,ro "$2"; fi
}
log "root: fresh copy of the base in $root"
remove_root
cp -a "$base" "$root"
rm -f "$root/.complete"
# Its own mount, as a machine's root is: a mount namespace made inside (test-no-cuda) must
# be able to make "/" private. Private here, so nothing mounted below reaches the host's.
bind "$root" "$root"
mount --make-private "$root"
mount -t proc proc "$root/proc" && mounts+=("$root/proc")
mount -t sysfs sys "$root/sys" && mounts+=("$root/sys")
bind /dev "$root/dev"
mount -t devpts devpts "$root/dev/pts" -o newinstance,ptmxmode=0666 && mounts+=("$root/dev/pts")
mount -t tmpfs tmpfs "$root/dev/shm" && mounts+=("$root/dev/shm")
cp -L /etc/resolv.conf "$root/etc/resolv.conf"
cuda_path=""
if [ -n "$cuda" ] && [ -e "$cuda" ]; then
  real=$(readlink -f "$cuda")
  bind "$real" "$root$real" ro
  [ "$real" = "$cuda" ] || ln -sfn "$real" "$root$cuda"
  cuda_path="$cuda/bin:" # NVIDIA's install guide puts nvcc on PATH; no ld.so.conf entry
  log "root: CUDA toolkit $real bound read-only at $cuda (not in the loader's configuration)"
fi
phase_done root

# ---- clone: what a user types before the README's commands -------------------------------
in_root() {
  chroot "$root" /usr/bin/env -i HOME=/root TERM="${TERM:-dumb}" LANG=C.UTF-8 \
    PATH="${cuda_path}/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
    bash -c "$1"
}
commit=$(git -C "$repo" rev-parse HEAD)
log "clone: $repo at $commit (committed work only)"
git clone -q --no-local "$repo" "$root/root/rtp"
git -C "$root/root/rtp" checkout -q "$commit"
# make and git are what a user needs to fetch the repository and type the commands.
in_root "export DEBIAN_FRONTEND=noninteractive; apt-get update -q > /dev/null &&
         apt-get install -y -q --no-install-recommends make git ca-certificates > /dev/null"
phase_done clone

# ---- the README's two commands ----------------------------------------------------------
args=$(printf '%q ' "${make_args[@]}")
for target in test run; do
  log "make $target ${make_args[*]}"
  t0=$(date +%s)
  if ! in_root "cd /root/rtp && make $target $args" > "$work/make-$target.log" 2>&1; then
    tail -40 "$work/make-$target.log"
    log "make $target FAILED after $(($(date +%s) - t0)) s (log: $work/make-$target.log)"
    exit 1
  fi
  log "make $target: ok in $(($(date +%s) - t0)) s (log: $work/make-$target.log)"
  phase_done "$target"
done
log "fresh Debian: make test and make run work"
