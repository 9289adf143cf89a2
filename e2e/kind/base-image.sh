#!/usr/bin/env bash
# The kind base image (what kind's images/base/Dockerfile makes: Debian + systemd + containerd +
# runc + crictl + CNI plugins + kind's files), made without a registry or network:
#   e2e/kind/base-image.sh      prints the image name; builds it unless it exists
# From the node rootfs of rootfs.sh (debootstrap), the binaries of bins.sh and the files of kind's
# own source (its module zip from the Go module proxy): staged in a folder on this host, then
# `docker import`ed as one layer (kind squashes its base image to one layer too).
# Additions to kind's image: the CNI bridge plugin (kube-router's CNI config uses it), and a fix for
# hosts whose capability bounding set lacks CAP_SYS_RESOURCE (see restrict_oom_score_adj below).
# Left out: containerd-fuse-overlayfs (rootless/zfs only).
set -euo pipefail
# shellcheck source=e2e/kind/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

recipe=$(cat "$E2E_KIND/lib.sh" "$E2E_KIND/base-image.sh" "$E2E_KIND/rootfs.sh" | sha256sum | cut -c1-12)
image="crucible-kind/base:$DEBIAN_SUITE-$recipe"
if image_exists "$image"; then
  echo "$image"
  exit 0
fi

build() {
  "$E2E_KIND/rootfs.sh" node
  "$E2E_KIND/bins.sh" containerd runc crictl cni
  local src stage bins f
  src="$(kind_src)/images/base"
  stage="$KCACHE/stage/base"
  rm -rf "$stage"
  mkdir -p "$KCACHE/stage"
  cp -a "$(rootfs_dir node)" "$stage"

  # COPY steps of the Dockerfile: scripts 0755, everything else 0644.
  install -m 0755 "$src"/files/usr/local/bin/* "$stage/usr/local/bin/"
  mkdir -p "$stage/kind/bin" "$stage/LICENSES" "$stage/etc/containerd" \
    "$stage/etc/systemd/system/kubelet.service.d"
  while IFS= read -r f; do
    install -D -m 0644 "$src/files/kind/$f" "$stage/kind/$f"
  done < <(cd "$src/files/kind" && find . -type f -printf '%P\n')
  chmod 0755 "$stage/kind" "$stage/kind/bin" "$stage"/kind/bin/*
  install -m 0644 "$src"/files/LICENSES/* "$stage/LICENSES/"
  install -m 0644 "$src/files/etc/crictl.yaml" "$stage/etc/"
  install -m 0644 "$src"/files/etc/containerd/* "$stage/etc/containerd/"
  install -m 0644 "$src"/files/etc/default/* "$stage/etc/default/"
  install -m 0644 "$src"/files/etc/sysctl.d/* "$stage/etc/sysctl.d/"
  find "$src/files/etc/systemd/system" -maxdepth 1 -type f -exec install -m 0644 {} "$stage/etc/systemd/system/" \;
  install -m 0644 "$src"/files/etc/systemd/system/kubelet.service.d/* \
    "$stage/etc/systemd/system/kubelet.service.d/"

  # The first RUN (after its apt-get, which rootfs.sh did).
  find "$stage/lib/systemd/system/sysinit.target.wants/" -name systemd-tmpfiles-setup.service -delete
  rm -f "$stage"/lib/systemd/system/multi-user.target.wants/* \
    "$stage"/etc/systemd/system/*.wants/* \
    "$stage"/lib/systemd/system/local-fs.target.wants/* \
    "$stage"/lib/systemd/system/sockets.target.wants/*udev* \
    "$stage"/lib/systemd/system/sockets.target.wants/*initctl* \
    "$stage"/lib/systemd/system/basic.target.wants/*
  echo "ReadKMsg=no" >>"$stage/etc/systemd/journald.conf"
  ln -sf /usr/lib/systemd/systemd "$stage/sbin/init"
  chroot "$stage" systemctl enable kubelet.service containerd.service undo-mount-hacks.service
  chroot "$stage" systemctl mask systemd-binfmt.service
  mkdir -p "$stage/etc/kubernetes/manifests"

  # The binaries of the build stages.
  bins="$KBIN/containerd-$CONTAINERD_VERSION"
  install -m 0755 "$bins/containerd" "$bins/ctr" "$bins/containerd-shim-runc-v2" "$stage/usr/local/bin/"
  "$bins/ctr" oci spec \
    | jq '.hooks.createContainer[.hooks.createContainer| length] |= . + {"path": "/kind/bin/mount-product-files.sh"}' \
    | jq 'del(.process.rlimits)' >"$stage/etc/containerd/cri-base.json"
  install -D -m 0755 "$KBIN/runc-$RUNC_VERSION/runc" "$stage/usr/local/sbin/runc"
  install -m 0755 "$KBIN/crictl-$CRICTL_VERSION/crictl" "$stage/usr/local/bin/"
  mkdir -p "$stage/opt/cni/bin"
  local cni plugin
  cni=$("$E2E_KIND/bins.sh" --dir cni)
  for plugin in "${CNI_PLUGINS[@]##*/}"; do install -m 0755 "$cni/$plugin" "$stage/opt/cni/bin/"; done
  chroot "$stage" containerd --version
  chroot "$stage" runc --version

  # Addition: without CAP_SYS_RESOURCE (dropped by some sandboxes; Docker's runtime wrapper of
  # e2e/host/docker.sh then drops it from the node containers too), no process in the node may
  # lower an oom_score_adj, so runc fails to start the pods kubelet gives a negative one
  # (static pods, node-critical pods). containerd's restrict_oom_score_adj, which kind's
  # entrypoint turns on for rootless nodes for the same reason, clamps them to containerd's own.
  # Privileged pods need nothing more: containerd gives them its own effective capabilities.
  cat >"$stage/kind/bin/restrict-oom-score-adj.sh" <<'EOF'
#!/bin/sh
# Turn on containerd's restrict_oom_score_adj when this node lacks CAP_SYS_RESOURCE (bit 24).
bnd=$(sed -n 's/^CapBnd:[[:space:]]*//p' /proc/self/status)
if [ $(( (0x$bnd >> 24) & 1 )) -eq 0 ]; then
  echo "no CAP_SYS_RESOURCE: setting restrict_oom_score_adj = true"
  sed -i 's/restrict_oom_score_adj = false/restrict_oom_score_adj = true/' /etc/containerd/config.toml
fi
EOF
  chmod 0755 "$stage/kind/bin/restrict-oom-score-adj.sh"
  mkdir -p "$stage/etc/systemd/system/containerd.service.d"
  printf '[Service]\nExecStartPre=/kind/bin/restrict-oom-score-adj.sh\n' \
    >"$stage/etc/systemd/system/containerd.service.d/10-crucible-oom-score-adj.conf"

  # The final stage: one layer, systemd's container metadata, kind's entrypoint.
  # (`docker import --change` takes no STOPSIGNAL on Docker 20.10: a metadata-only build adds it.)
  tar -C "$stage" --numeric-owner -cf - . | docker import - "$image-rootfs" >/dev/null
  rm -rf "$stage"
  local ctx
  ctx=$(mktemp -d)
  cat >"$ctx/Dockerfile" <<EOF
FROM $image-rootfs
ENV container=docker
STOPSIGNAL SIGRTMIN+3
ENTRYPOINT [ "/usr/local/bin/entrypoint", "/sbin/init" ]
LABEL crucible.kind.recipe=$recipe
EOF
  logged base-image.log docker build --network=none -t "$image" "$ctx"
  rm -rf "$ctx"
  docker rmi "$image-rootfs" >/dev/null
}

say "building $image"
timed base-image build >&2
echo "$image"
