#!/usr/bin/env bash
# A Debian base image with Python, made on this machine from Debian's archive: no container
# registry is needed. `make images BASE=local` builds both images on it (see README.md, "Images").
#   e2e/images/base.sh           make crucible-base/debian-python:bookworm unless it exists
#   SUITE=trixie e2e/images/base.sh     the same from Debian 13 (Python 3.13; see below)
# Steps, each skipped when its result exists:
#  1. debootstrap (--variant=minbase) a Debian rootfs with python3, python3-venv, ca-certificates,
#     from the mirror apt already uses here (/etc/apt/sources.list*; MIRROR= overrides), with the
#     suite's -updates and -security suites added and applied, apt's lists and caches removed,
#     docs/man pages/translations left out (as Debian's slim images do, copyright files kept);
#  2. the rootfs as a tarball, cached: ~/.cache/crucible/images/debian-python-<suite>-<arch>.tar.gz;
#  3. `docker import` of that tarball as crucible-base/debian-python:<suite>.
# The CA certificates this host added locally (/usr/local/share/ca-certificates/*.crt) are added
# to the rootfs too, so that apt and pip inside image builds trust what this host trusts (e.g. a
# TLS-intercepting egress proxy). Such a base is for local use (kind, tests), not for release:
# `make images-push` refuses BASE=local.
# Why bookworm by default: it is the Debian release of this host (the same mirror and archive
# keyring debootstrap verifies against) and of the operator's public base
# (python:3.12.13-slim-bookworm: the same glibc 2.36), and its Python, 3.11, is the lowest the
# project supports (requires-python), the one the host's test venv runs and the one the
# requirements locks are resolved for (`make requirements`: --universal --python-version 3.11).
# trixie (Python 3.13) works the same way, but the locks are only checked for 3.11 and 3.12.
# Needs root (debootstrap, chroot). Logs: ~/.cache/crucible/images/base-<suite>.log.
set -euo pipefail
suite="${SUITE:-bookworm}"
tag="${BASE_IMAGE:-crucible-base/debian-python:$suite}"
cache="${CRUCIBLE_CACHE:-$HOME/.cache/crucible}/images"
arch="$(dpkg --print-architecture)"
tarball="$cache/debian-python-$suite-$arch.tar.gz"
log="$cache/base-$suite.log"
say() { printf 'base.sh: %s\n' "$*"; }
die() { printf 'base.sh: %s\n' "$*" >&2; exit 1; }
mkdir -p "$cache"

if docker image inspect "$tag" >/dev/null 2>&1; then
  say "$tag exists ($(docker image inspect -f '{{.Size}}' "$tag" | numfmt --to=iec)); nothing to do"
  exit 0
fi

# The first URI apt uses for Debian's archive (deb822 .sources or one-line .list), and the
# security archive's.
apt_uri() {
  local want=$1
  local files=() f
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list; do
    [[ -f "$f" ]] && files+=("$f")
  done
  ((${#files[@]})) || return 0
  grep -hv '^[[:space:]]*#' "${files[@]}" | grep -oE 'https?://[^ ]+' | sed 's:/*$::' \
    | grep -E "/$want\$" | head -n 1 || true
}
mirror="${MIRROR:-$(apt_uri debian)}"
mirror="${mirror:-http://deb.debian.org/debian}"
security="${SECURITY_MIRROR:-$(apt_uri debian-security)}"
security="${security:-http://deb.debian.org/debian-security}"

make_rootfs() {
  local root=$1
  command -v debootstrap >/dev/null || {
    say "installing debootstrap"
    { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap; } \
      >>"$log" 2>&1 || die "apt-get install debootstrap failed, see $log"
  }
  say "debootstrap $suite from $mirror (log: $log)"
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    "$suite" "$root" "$mirror" >>"$log" 2>&1 || die "debootstrap failed, see $log"

  # What Debian's own container images configure: no docs, man pages or translations (copyright
  # files stay), no services started by package scripts, no apt caches left in layers.
  cat >"$root/etc/dpkg/dpkg.cfg.d/crucible-slim" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-exclude /usr/share/lintian/*
EOF
  printf '#!/bin/sh\nexit 101\n' >"$root/usr/sbin/policy-rc.d"
  chmod 755 "$root/usr/sbin/policy-rc.d"
  cat >"$root/etc/apt/apt.conf.d/docker-clean" <<'EOF'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
EOF
  echo 'APT::Install-Recommends "false";' >"$root/etc/apt/apt.conf.d/docker-no-recommends"
  rm -f "$root/etc/apt/sources.list"
  cat >"$root/etc/apt/sources.list.d/debian.sources" <<EOF
Types: deb
URIs: $mirror
Suites: $suite $suite-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: $security
Suites: $suite-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
  local crt
  for crt in /usr/local/share/ca-certificates/*.crt; do
    [[ -f "$crt" ]] || continue
    say "adding this host's CA certificate $(basename "$crt")"
    cp "$crt" "$root/usr/local/share/ca-certificates/"
  done
  cp /etc/resolv.conf "$root/etc/resolv.conf"
  mount -t proc proc "$root/proc"
  trap 'umount "$root/proc" 2>/dev/null || true' EXIT
  say "applying $suite-updates and $suite-security"
  chroot "$root" /bin/sh -ec '
    update-ca-certificates
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get -y -q upgrade
    apt-get clean
    rm -rf /var/lib/apt/lists/* /var/cache/debconf/*-old /var/log/apt/* /var/log/dpkg.log
    rm -rf /usr/share/doc/*/[!c]* /usr/share/doc/*/c[!o]* /usr/share/man/* /usr/share/info/* \
      /usr/share/locale/* /usr/share/lintian/*
    find / -xdev -name __pycache__ -type d -prune -exec rm -rf {} +
  ' >>"$log" 2>&1 || die "configuring the rootfs failed, see $log"
  umount "$root/proc"
  trap - EXIT
  : >"$root/etc/resolv.conf"
  rm -f "$root/etc/hostname"
}

if [[ ! -s "$tarball" ]]; then
  [[ $(id -u) == 0 ]] || die "debootstrap needs root"
  root="$cache/rootfs-$suite.tmp"
  rm -rf "$root"
  start=$SECONDS
  make_rootfs "$root"
  tar --numeric-owner --one-file-system -C "$root" -c . | gzip -1 >"$tarball.tmp"
  mv "$tarball.tmp" "$tarball"
  rm -rf "$root"
  say "rootfs: $tarball ($(du -h "$tarball" | cut -f1), $((SECONDS - start))s)"
fi

os_name="$(tar -xzOf "$tarball" ./usr/lib/os-release | sed -n 's/^PRETTY_NAME="\(.*\)"/\1/p')"
say "docker import $tarball as $tag ($os_name)"
docker import \
  --change 'ENV LANG=C.UTF-8 PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'CMD ["python3"]' \
  --change "LABEL org.opencontainers.image.description=\"Debian $suite with python3, made by crucible's e2e/images/base.sh\"" \
  "$tarball" "$tag" >/dev/null
docker run --rm --network none "$tag" python3 -c \
  'import sys, ssl, venv; print("python", sys.version.split()[0])'
