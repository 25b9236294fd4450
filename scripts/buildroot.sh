#!/usr/bin/env bash
# Debian 13 (trixie) build root for hosts whose own LibTorch is too old
# (Debian 12 ships 1.13, whose Gloo lacks reduce-scatter).
#
#   scripts/buildroot.sh ensure        create + install packages (idempotent)
#   scripts/buildroot.sh run CMD...    run CMD inside, in the current directory
#   scripts/buildroot.sh umount        remove the bind mounts
#
# HP_BUILDROOT chooses where the root lives (default /var/cache/hyperparallel/trixie).
# The checkout is bind-mounted at the same absolute path, so paths in build trees
# and error messages mean the same inside and outside.
set -euo pipefail

ROOT=${HP_BUILDROOT:-/var/cache/hyperparallel/trixie}
CHECKOUT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PACKAGES=(libtorch-dev libgloo-dev python3-torch g++ cmake make libgtest-dev
          ninja-build clang-format iproute2 procps nlohmann-json3-dev zlib1g-dev libzip-dev
          libcli11-dev python3-safetensors)
STAMP="$ROOT/.hyperparallel-packages"

die() { echo "buildroot: $*" >&2; exit 1; }

need_root() {
  [ "$(id -u)" = 0 ] || die "must run as root (debootstrap, chroot and mount need it); try sudo"
}

create() {
  [ -x "$ROOT/usr/bin/apt-get" ] && return 0
  if ! command -v debootstrap >/dev/null; then
    echo "buildroot: installing debootstrap on the host"
    apt-get update -qq && apt-get install -y -qq --no-install-recommends debootstrap >/dev/null
  fi
  echo "buildroot: debootstrap trixie into $ROOT (a few minutes, once)"
  mkdir -p "$(dirname "$ROOT")"
  rm -rf "$ROOT.partial"
  debootstrap --variant=minbase trixie "$ROOT.partial" >"$ROOT.partial.log" 2>&1 ||
    die "debootstrap failed, see $ROOT.partial.log"
  mv "$ROOT.partial" "$ROOT" && rm -f "$ROOT.partial.log"
}

install_packages() {
  local want="${PACKAGES[*]}"
  [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && return 0
  echo "buildroot: installing ${PACKAGES[*]}"
  mount_all
  chroot "$ROOT" /usr/bin/env DEBIAN_FRONTEND=noninteractive bash -c \
    "apt-get update -qq && apt-get install -y -qq --no-install-recommends $want >/dev/null" ||
    die "package installation inside $ROOT failed"
  echo "$want" >"$STAMP"
}

bind() {  # bind SRC DST, once; a mount left by an earlier checkout at this path is replaced
  mkdir -p "$2"
  # A checkout deleted and cloned again at the same path leaves a mount of the deleted
  # directory behind; inside the root the current directory would not exist.
  while mountpoint -q "$2" && [ "$(stat -c %d:%i "$1")" != "$(stat -c %d:%i "$2")" ]; do
    umount -l "$2"
  done
  mountpoint -q "$2" || mount --bind "$1" "$2"
}

mount_all() {
  bind /proc "$ROOT/proc"
  bind /dev "$ROOT/dev"
  bind /dev/pts "$ROOT/dev/pts"
  bind /sys "$ROOT/sys"
  bind "$CHECKOUT" "$ROOT$CHECKOUT"
  # Multi-rank tests and the launcher need a writable /dev/shm and /tmp.
  mkdir -p "$ROOT/dev/shm" "$ROOT/tmp" && chmod 1777 "$ROOT/tmp"
  cp -f /etc/resolv.conf "$ROOT/etc/resolv.conf" 2>/dev/null || true
}

umount_all() {
  local m
  for m in "$ROOT$CHECKOUT" "$ROOT/sys" "$ROOT/dev/pts" "$ROOT/dev" "$ROOT/proc"; do
    mountpoint -q "$m" && umount "$m"
  done
  return 0
}

cmd=${1:-}
shift || true
case "$cmd" in
  ensure) need_root; create; install_packages ;;
  run)
    need_root; create; install_packages; mount_all
    [ $# -gt 0 ] || die "run needs a command"
    exec chroot "$ROOT" /usr/bin/env -C "$PWD" HOME=/root PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$@"
    ;;
  umount) need_root; umount_all ;;
  *) die "usage: $0 ensure | run CMD... | umount" ;;
esac
