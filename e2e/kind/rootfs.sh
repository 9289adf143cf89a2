#!/usr/bin/env bash
# Debian root filesystems made with debootstrap on this host (the only step that downloads:
# Debian packages, from the Debian mirror), kept as folders under ~/.cache/crucible/kind/rootfs/:
#   e2e/kind/rootfs.sh node      bookworm minbase + the packages of kind's images/base/Dockerfile
#   e2e/kind/rootfs.sh slim      bookworm minbase + iptables, nftables, conntrack, ipset, iproute2,
#                                kmod (the base of kube-proxy, kube-router, local-path-helper)
# Package lists: lib.sh. Each is skipped when its folder (named with a hash of the list) exists. Needs root and debootstrap
# (installed with apt-get when missing).
set -euo pipefail
# shellcheck source=e2e/kind/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

make_rootfs() {
  local name=$1 dir include
  dir=$(rootfs_dir "$name")
  shift
  include=$(IFS=,; echo "$*")
  [[ -d "$dir" ]] && return 0
  [[ $(id -u) == 0 ]] || die "debootstrap needs root"
  command -v debootstrap >/dev/null || logged rootfs.log apt-get install -y -q debootstrap
  mkdir -p "$KCACHE/debs" "$KCACHE/rootfs"
  rm -rf "$dir.tmp"
  say "debootstrap $DEBIAN_SUITE -> $dir (log: $KLOG/rootfs-$name.log)"
  logged "rootfs-$name.log" debootstrap --variant=minbase --include="$include" \
    --cache-dir="$KCACHE/debs" "$DEBIAN_SUITE" "$dir.tmp" "$DEBIAN_MIRROR"
  # What clean-install does after apt-get in kind's Dockerfile.
  chroot "$dir.tmp" apt-get clean
  rm -rf "$dir.tmp"/var/lib/apt/lists/* "$dir.tmp"/var/cache/debconf/*-old "$dir.tmp"/var/log/* \
    "$dir.tmp"/usr/share/doc/* "$dir.tmp"/usr/share/man/* "$dir.tmp"/tmp/* "$dir.tmp"/var/tmp/*
  mv "$dir.tmp" "$dir"
}

for what in "${@:-node slim}"; do
  for w in $what; do
    case $w in
      node) timed rootfs-node make_rootfs node "${NODE_PACKAGES[@]}" ;;
      slim) timed rootfs-slim make_rootfs slim "${SLIM_PACKAGES[@]}" ;;
      *) die "usage: $0 [node|slim]..." ;;
    esac
  done
done
