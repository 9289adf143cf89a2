#!/usr/bin/env bash
# Build (once) every binary of the kind node image and of the images it preloads, from the Go
# module proxy and this repository (e2e/gobuild/kind/), plus `kind` itself:
#   e2e/kind/bins.sh            all targets, each skipped when its folder is complete
#   e2e/kind/bins.sh NAME...    only these (kind kube containerd runc crictl cni etcd coredns
#                               local-path pause kube-router nodeconsts)
# Output: $CRUCIBLE_CACHE/bin/kind (default ~/.cache/crucible/bin) and
# ~/.cache/crucible/kind/bin/<name>-<version>/; logs in ~/.cache/crucible/kind/logs/bins-*.log.
# Static Go binaries (CGO_ENABLED=0) except runc, which needs cgo: linked statically against
# Debian's libseccomp (apt-get install libseccomp-dev, done here when missing).
set -euo pipefail
# shellcheck source=e2e/kind/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
command -v go >/dev/null || die "go is not on PATH (Go >= 1.26)"
export CGO_ENABLED=0

# target NAME DIR BUILD-FUNCTION: run the function with $out set, unless DIR/.done exists.
target() {
  local name=$1 dir=$2 fn=$3
  [[ -f "$dir/.done" ]] && return 0
  rm -rf "$dir.tmp"
  mkdir -p "$dir.tmp"
  say "building $name -> $dir (log: $KLOG/bins-$name.log)"
  out="$dir.tmp" timed "go-build-$name" "$fn"
  touch "$dir.tmp/.done"
  rm -rf "$dir"
  mv "$dir.tmp" "$dir"
}

gi() {  # go install into $out, logged
  local log=$1
  shift
  GOBIN="$out" logged "$log" go install -trimpath "$@"
}

build_kind() {
  gi bins-kind.log -ldflags "-s -w" "sigs.k8s.io/kind@$KIND_VERSION"
}

build_kube() {
  local v=k8s.io/component-base/version minor
  minor=$(cut -d. -f2 <<<"$K8S_VERSION")
  (cd "$GOBUILD_KIND/kube" && logged bins-kube.log go build -trimpath \
    -ldflags "-s -w -X $v.gitVersion=$K8S_VERSION -X $v.gitMajor=1 -X $v.gitMinor=$minor -X $v.gitTreeState=clean" \
    -o "$out/" \
    k8s.io/kubernetes/cmd/{kubelet,kubeadm,kubectl,kube-proxy,kube-apiserver,kube-controller-manager,kube-scheduler})
}

build_containerd() {
  local p=github.com/containerd/containerd/v2
  gi bins-containerd.log -tags "no_aufs no_zfs no_btrfs no_devmapper" \
    -ldflags "-s -w -X $p/version.Version=$CONTAINERD_VERSION -X $p/version.Package=$p" \
    "$p/cmd/containerd@$CONTAINERD_VERSION" "$p/cmd/ctr@$CONTAINERD_VERSION" \
    "$p/cmd/containerd-shim-runc-v2@$CONTAINERD_VERSION"
}

build_runc() {
  if ! dpkg -s libseccomp-dev >/dev/null 2>&1; then
    logged bins-runc.log apt-get install -y -q --no-install-recommends libseccomp-dev pkg-config
  fi
  # runc's Makefile `static` target: cgo, seccomp, netgo/osusergo, -extldflags -static.
  CGO_ENABLED=1 gi bins-runc.log -tags "seccomp urfave_cli_no_docs netgo osusergo" \
    -ldflags "-s -w -X main.version=${RUNC_VERSION#v} -extldflags -static" \
    "github.com/opencontainers/runc@$RUNC_VERSION"
  "$out/runc" --version | grep -q seccomp || die "runc was built without seccomp"
}

build_crictl() {
  gi bins-crictl.log -ldflags "-s -w -X sigs.k8s.io/cri-tools/pkg/version.Version=$CRICTL_VERSION" \
    "sigs.k8s.io/cri-tools/cmd/crictl@$CRICTL_VERSION"
}

build_cni() {
  local p=github.com/containernetworking/plugins v=$CNI_PLUGINS_VERSION plugin pkgs=()
  for plugin in "${CNI_PLUGINS[@]}"; do pkgs+=("$p/plugins/$plugin@$v"); done
  gi bins-cni.log -ldflags "-s -w -X $p/pkg/utils/buildversion.BuildVersion=$v" "${pkgs[@]}"
}

build_etcd() {
  # From the kube wrapper module: etcd's go.mod has replace directives, which `go install` refuses.
  (cd "$GOBUILD_KIND/kube" && logged bins-etcd.log go build -trimpath -ldflags "-s -w" \
    -o "$out/etcd" go.etcd.io/etcd/server/v3)
}

build_coredns() {
  gi bins-coredns.log -ldflags "-s -w -X github.com/coredns/coredns/coremain.GitCommit=$COREDNS_VERSION" \
    "github.com/coredns/coredns@$COREDNS_VERSION"
}

build_local_path() {
  gi bins-local-path.log -ldflags "-s -w -X main.VERSION=$LOCAL_PATH_PROVISIONER_VERSION" \
    "github.com/rancher/local-path-provisioner@$LOCAL_PATH_PROVISIONER_VERSION"
}

build_kube_router() {
  local p=github.com/cloudnativelabs/kube-router/v2
  gi bins-kube-router.log -ldflags "-s -w -X $p/pkg/version.Version=$KUBE_ROUTER_VERSION" \
    "$p/cmd/kube-router@$KUBE_ROUTER_VERSION"
}

build_pause() {
  # Kubernetes' build/pause/Makefile: a static C binary.
  command -v gcc >/dev/null || logged bins-pause.log apt-get install -y -q gcc libc6-dev
  logged bins-pause.log gcc -Os -Wall -Werror -static -DVERSION="v$PAUSE_VERSION" \
    -o "$out/pause" "$(kube_src)/build/pause/linux/pause.c"
  strip "$out/pause"
}

build_nodeconsts() {
  (cd "$GOBUILD_KIND/nodeconsts" && logged bins-nodeconsts.log go build -trimpath -o "$out/" .)
}

declare -A DIRS=(
  [kube]="$KBIN/kube-$K8S_VERSION"
  [containerd]="$KBIN/containerd-$CONTAINERD_VERSION"
  [runc]="$KBIN/runc-$RUNC_VERSION"
  [crictl]="$KBIN/crictl-$CRICTL_VERSION"
  # The folder names the plugin set (a hash of lib.sh's CNI_PLUGINS), so changing it rebuilds.
  [cni]="$KBIN/cni-plugins-$CNI_PLUGINS_VERSION-$(echo "${CNI_PLUGINS[*]}" | sha256sum | cut -c1-8)"
  [etcd]="$KBIN/etcd-$ETCD_VERSION"
  [coredns]="$KBIN/coredns-$COREDNS_VERSION"
  [local-path]="$KBIN/local-path-provisioner-$LOCAL_PATH_PROVISIONER_VERSION"
  [pause]="$KBIN/pause-$PAUSE_VERSION"
  [kube-router]="$KBIN/kube-router-$KUBE_ROUTER_VERSION"
  [nodeconsts]="$KBIN/nodeconsts.d"
)
ORDER=(nodeconsts kind kube containerd runc crictl cni etcd coredns local-path pause kube-router)

build_one() {
  local name=$1
  case $name in
    kind)
      # Into the shared bin folder, stamped like e2e/stack/build.py's targets.
      if [[ -x "$KIND_BIN" && "$(cat "$CACHE/bin/.kind.pin" 2>/dev/null)" == "$KIND_VERSION" ]]; then
        return 0
      fi
      say "building kind $KIND_VERSION -> $KIND_BIN"
      out="$CACHE/bin" timed go-build-kind build_kind
      printf '%s' "$KIND_VERSION" >"$CACHE/bin/.kind.pin"
      ;;
    *)
      [[ -n "${DIRS[$name]:-}" ]] || die "unknown target $name"
      target "$name" "${DIRS[$name]}" "build_${name//-/_}"
      ;;
  esac
}

# Where each target's binaries are, for the image scripts: `bins.sh --dir NAME`.
if [[ "${1:-}" == --dir ]]; then
  echo "${DIRS[$2]}"
  exit 0
fi
for name in "${@:-${ORDER[@]}}"; do
  build_one "$name"
done
# nodeconsts is also wanted at a stable path by lib.sh's kind_const.
ln -sf "${DIRS[nodeconsts]}/nodeconsts" "$KBIN/nodeconsts"
