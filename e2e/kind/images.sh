#!/usr/bin/env bash
# The container images a kind node preloads, built here from the binaries of bins.sh, tagged with
# exactly the names kubeadm and kind's manifests use (so nothing is ever pulled), and saved as
# archives (`docker save`, one image each) for node-image.sh:
#   e2e/kind/images.sh          prints the archive folder; builds what is missing
# Images: kube-apiserver, kube-controller-manager, kube-scheduler, kube-proxy (what a Kubernetes
# release ships as server/bin/*.tar), etcd, CoreDNS, pause (what `kubeadm config images list`
# adds), kind's local-path-provisioner and local-path-helper, and kube-router (the cluster's CNI,
# in place of kind's kindnetd: e2e/kind/kube-router.yaml).
# Two base images stand in for the upstream ones (registry.k8s.io's distroless images):
#   crucible-kind/static  FROM scratch: passwd/group (nonroot 65532), CA certificates, /tmp;
#   crucible-kind/slim    Debian minbase + iptables/nftables/conntrack/ipset (rootfs.sh slim), with an
#                         iptables wrapper that picks the legacy or nft backend on first use,
#                         as the upstream distroless-iptables image does.
# Every build runs with --network=none.
set -euo pipefail
# shellcheck source=e2e/kind/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

recipe=$(cat "$E2E_KIND/lib.sh" "$E2E_KIND/images.sh" "$E2E_KIND/rootfs.sh" | sha256sum | cut -c1-12)
out="$KIMG/$recipe"
static="crucible-kind/static:$recipe"
slim="crucible-kind/slim:$DEBIAN_SUITE-$recipe"

# The iptables wrapper (after kubernetes-sigs/iptables-wrappers): the first call of any
# iptables* command counts the rules each backend holds, points the alternatives at the busier one
# (nft when tied and both empty: what Debian and the kind node default to), then re-executes.
IPTABLES_WRAPPER='#!/bin/sh
set -e
nft=$( (iptables-nft-save -t nat; ip6tables-nft-save -t nat; iptables-nft-save; ip6tables-nft-save) 2>/dev/null | grep -c "^-" || true)
legacy=$( (iptables-legacy-save; ip6tables-legacy-save) 2>/dev/null | grep -c "^-" || true)
mode=nft
[ "$legacy" -gt "$nft" ] && mode=legacy
for cmd in iptables iptables-save iptables-restore ip6tables ip6tables-save ip6tables-restore; do
  ln -sf "xtables-$mode-multi" "/usr/sbin/$cmd"
done
exec "$0" "$@"'

build_static() {
  image_exists "$static" && return 0
  local root
  root=$(mktemp -d)
  mkdir -p "$root/etc/ssl/certs" "$root/tmp" "$root/home/nonroot"
  chmod 1777 "$root/tmp"
  printf 'root:x:0:0:root:/root:/sbin/nologin\nnobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n' >"$root/etc/passwd"
  printf 'root:x:0:\nnobody:x:65534:\nnonroot:x:65532:\n' >"$root/etc/group"
  echo 'hosts: files dns' >"$root/etc/nsswitch.conf"
  cp -L "$(rootfs_dir slim)/etc/ssl/certs/ca-certificates.crt" "$root/etc/ssl/certs/"
  chown 65532:65532 "$root/home/nonroot"
  tar -C "$root" --numeric-owner -cf - . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt' - "$static" >/dev/null
  rm -rf "$root"
}

build_slim() {
  image_exists "$slim" && return 0
  local root="$KCACHE/stage/slim" cmd
  rm -rf "$root"
  mkdir -p "$KCACHE/stage"
  cp -a "$(rootfs_dir slim)" "$root"
  printf '%s\n' "$IPTABLES_WRAPPER" >"$root/usr/sbin/iptables-wrapper"
  chmod 0755 "$root/usr/sbin/iptables-wrapper"
  for cmd in iptables iptables-save iptables-restore ip6tables ip6tables-save ip6tables-restore; do
    ln -sf iptables-wrapper "$root/usr/sbin/$cmd"
  done
  tar -C "$root" --numeric-owner -cf - . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' - "$slim" >/dev/null
  rm -rf "$root"
}

# image FILE TAG[,TAG...] FROM BINARY|- DEST [ENTRYPOINT-JSON [USER]]: build, tag, save to
# $out/FILE.tar.
image() {
  local file=$1 tags=$2 from=$3 binary=$4 dest=$5 entrypoint=${6:-} user=${7:-}
  [[ -f "$out/$file.tar" ]] && return 0
  local ctx tag args=()
  ctx=$(mktemp -d)
  {
    echo "FROM $from"
    if [[ "$binary" != - ]]; then
      cp "$binary" "$ctx/bin"
      echo "COPY bin $dest"
    fi
    [[ -n "$entrypoint" ]] && echo "ENTRYPOINT $entrypoint"
    [[ -n "$user" ]] && echo "USER $user"
  } >"$ctx/Dockerfile"
  IFS=, read -r -a tagv <<<"$tags"
  for tag in "${tagv[@]}"; do args+=(-t "$tag"); done
  logged images.log docker build --network=none "${args[@]}" "$ctx"
  rm -rf "$ctx"
  logged images.log docker save -o "$out/$file.tar.tmp" "${tagv[@]}"
  mv "$out/$file.tar.tmp" "$out/$file.tar"
}

build() {
  "$E2E_KIND/rootfs.sh" slim
  "$E2E_KIND/bins.sh" kube etcd coredns pause local-path kube-router nodeconsts
  mkdir -p "$out"
  build_static
  build_slim
  local kube="$KBIN/kube-$K8S_VERSION" c
  for c in kube-apiserver kube-controller-manager kube-scheduler; do
    image "$c" "registry.k8s.io/$c:$K8S_VERSION" "$static" "$kube/$c" "/usr/local/bin/$c"
  done
  image kube-proxy "registry.k8s.io/kube-proxy:$K8S_VERSION" "$slim" "$kube/kube-proxy" /usr/local/bin/kube-proxy
  image etcd "registry.k8s.io/etcd:${ETCD_VERSION#v}-0" "$static" \
    "$KBIN/etcd-$ETCD_VERSION/etcd" /usr/local/bin/etcd
  # Root, not upstream's nonroot + file capability: kubeadm's Deployment adds NET_BIND_SERVICE,
  # which a root process keeps and a non-root one only gets from a file capability.
  image coredns "registry.k8s.io/coredns/coredns:$COREDNS_VERSION" "$static" \
    "$KBIN/coredns-$COREDNS_VERSION/coredns" /coredns '["/coredns"]'
  image pause "registry.k8s.io/pause:$PAUSE_VERSION,registry.k8s.io/pause:${PAUSE_VERSION%.*}" scratch \
    "$KBIN/pause-$PAUSE_VERSION/pause" /pause '["/pause"]' 65535:65535
  image local-path-provisioner "$(kind_const storageProvisionerImage)" "$static" \
    "$KBIN/local-path-provisioner-$LOCAL_PATH_PROVISIONER_VERSION/local-path-provisioner" \
    /usr/local/bin/local-path-provisioner '["/usr/local/bin/local-path-provisioner"]'
  image kube-router "docker.io/cloudnativelabs/kube-router:$KUBE_ROUTER_VERSION" "$slim" \
    "$KBIN/kube-router-$KUBE_ROUTER_VERSION/kube-router" /usr/local/bin/kube-router \
    '["/usr/local/bin/kube-router"]'
  # The helper runs the `setup`/`teardown` shell scripts of local-path-config: sh, mkdir, rm.
  image local-path-helper "$(kind_const storageHelperImage)" "$slim" - -
}

if [[ ! -f "$out/.done" ]]; then
  say "building the preloaded images -> $out (log: $KLOG/images.log)"
  timed component-images build >&2
  touch "$out/.done"
fi
echo "$out"
