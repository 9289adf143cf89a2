# Sourced by the scripts in e2e/kind/: the pinned versions, the cache layout and small helpers for
# building kind, its node image and the images it preloads from source, with no registry.
# shellcheck shell=bash

# kind and the Kubernetes it runs. Kubernetes is the local stack's version (e2e/stack/build.py), so
# the Go build cache is shared with it; kind v0.33.0 supports it (its default node is v1.37.0).
KIND_VERSION=v0.33.0
K8S_VERSION=v1.36.3
# What kind v0.33.0's images/base/Dockerfile builds into its base image.
CONTAINERD_VERSION=v2.3.4
RUNC_VERSION=v1.4.3
CRICTL_VERSION=v1.36.0
# kind v0.33.0 has v1.9.1; v1.10.0 is the current release (same config). The plugins of kind's
# base image (host-local, loopback, ptp, portmap) plus bridge, which kube-router's CNI config uses.
CNI_PLUGINS_VERSION=v1.10.0
CNI_PLUGINS=(ipam/host-local main/loopback main/ptp meta/portmap main/bridge)
# What kubeadm v1.36.3 deploys (`kubeadm config images list`): etcd 3.6.8-0, CoreDNS v1.14.2,
# pause 3.10.2; kind's containerd config names pause 3.10 as the sandbox image: both tags are set.
ETCD_VERSION=v3.6.8   # also pinned in e2e/gobuild/kind/kube/go.mod, which builds it
COREDNS_VERSION=v1.14.2
PAUSE_VERSION=3.10.2
# kind v0.33.0 builds v0.0.34, which the Go module proxy does not serve; v0.0.30 is the newest it
# does (same flags: --debug start --helper-image --config).
LOCAL_PATH_PROVISIONER_VERSION=v0.0.30
# The cluster's CNI (instead of kind's kindnetd): kube-router's routing (pod network) and firewall
# (NetworkPolicy, iptables + ipset), e2e/kind/kube-router.yaml. v2.1.0 is the version the Go
# module proxy serves.
KUBE_ROUTER_VERSION=v2.1.0
# Debian release of every rootfs made here: the host's, so that runc (cgo) links the same
# libseccomp; its systemd (252) still boots on the cgroup v1 hosts this runs on, trixie's (257)
# refuses cgroup v1 by default.
DEBIAN_SUITE=bookworm
DEBIAN_MIRROR="${CRUCIBLE_DEBIAN_MIRROR:-http://deb.debian.org/debian}"

E2E_KIND="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$E2E_KIND/../.." && pwd)"
GOBUILD_KIND="$REPO/e2e/gobuild/kind"
CACHE="${CRUCIBLE_CACHE:-$HOME/.cache/crucible}"
KCACHE="$CACHE/kind"            # everything below is built here, each step skipped when done
KBIN="$KCACHE/bin"              # node binaries, one folder per pinned version
KIMG="$KCACHE/images"           # image archives (docker save) and stamps
KLOG="$KCACHE/logs"
KIND_BIN="$CACHE/bin/kind"
NODE_IMAGE="${CRUCIBLE_KIND_NODE_IMAGE:-kindest/node:$K8S_VERSION-crucible}"
BASE_IMAGE="crucible-kind/base:$DEBIAN_SUITE-containerd-$CONTAINERD_VERSION"
export GOTOOLCHAIN="${GOTOOLCHAIN:-local}"
mkdir -p "$KBIN" "$KIMG" "$KLOG"

# Packages of the Debian root filesystems (rootfs.sh). node: kind v0.33.0 images/base/Dockerfile,
# one line per purpose: services (systemd), Kubernetes components, network storage, storage e2e
# tests, the container runtime, kind itself. slim: the base of the kube-proxy, kube-router and
# local-path-helper images (iptables/nftables/conntrack/ipset, a shell; iproute2's rt_tables and
# modprobe, which kube-router uses, as its upstream image has them).
NODE_PACKAGES=(
  systemd
  conntrack iptables nftables iproute2 ethtool util-linux mount kmod
  libseccomp2 pigz fuse-overlayfs
  nfs-common open-iscsi
  e2fsprogs
  bash ca-certificates curl jq procps
)
SLIM_PACKAGES=(iptables nftables conntrack ipset iproute2 kmod ca-certificates)

# The folder of a root filesystem: its name and a hash of its suite and packages.
rootfs_dir() {
  local -n pkgs="${1^^}_PACKAGES"
  echo "$KCACHE/rootfs/$1-$DEBIAN_SUITE-$(echo "$DEBIAN_MIRROR ${pkgs[*]}" | sha256sum | cut -c1-8)"
}

say() { printf '%s %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { printf 'e2e/kind: %s\n' "$*" >&2; exit 1; }

# timed NAME CMD...: run a step, append "NAME SECONDS" to $KLOG/timings.
# The step runs in a subshell with errexit (a function called as `f || ...` would run without it).
timed() {
  local name=$1 start=$SECONDS rc
  shift
  set +e
  (set -e; "$@")
  rc=$?
  set -e
  printf '%s %s %ds rc=%d\n' "$(date -Is)" "$name" $((SECONDS - start)) "$rc" >>"$KLOG/timings"
  say "$name: $((SECONDS - start))s"
  return "$rc"
}

# logged LOG CMD...: run CMD with its output in $KLOG/LOG; on failure show the tail and fail.
logged() {
  local log="$KLOG/$1"
  shift
  printf '\n$ %s\n' "$*" >>"$log"
  if ! "$@" >>"$log" 2>&1; then
    tail -n 25 "$log" >&2
    die "failed: $* (log: $log)"
  fi
}

# The source of kind itself, from the Go module proxy's zip (the Dockerfile, files and constants
# of its node image live there).
kind_src() {
  go mod download -json "sigs.k8s.io/kind@$KIND_VERSION" | sed -n 's/^\t"Dir": "\(.*\)",$/\1/p'
}
kube_src() {
  go mod download -json "k8s.io/kubernetes@$K8S_VERSION" | sed -n 's/^\t"Dir": "\(.*\)",$/\1/p'
}

# A string constant of kind's node image builder (package nodeimage), e.g. storageHelperImage.
kind_const() {
  "$KBIN/nodeconsts" "$(kind_src)/pkg/build/nodeimage" "$1"
}

image_exists() { docker image inspect "$1" >/dev/null 2>&1; }
