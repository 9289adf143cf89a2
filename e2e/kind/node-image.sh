#!/usr/bin/env bash
# The kind node image, built from source with no registry: what `kind build node-image` does
# (kind v0.33.0 pkg/build/nodeimage/buildcontext.go), minus its pulls:
#   e2e/kind/node-image.sh      prints the image name (kindest/node:v1.36.3-crucible, or
#                               $CRUCIBLE_KIND_NODE_IMAGE); builds it unless it is up to date
# Steps, as kind's: start a container of the base image (base-image.sh) that sleeps; copy in
# kubeadm, kubelet and kubectl (bins.sh); write /kind/version and kind's default storage
# (local-path-provisioner) manifest, taken from kind's source; run containerd in it and import
# every image archive of images.sh into its k8s.io namespace, pinned; commit.
# Unlike kind's, the image has no default CNI (kindnetd: no manifest, no image): clusters made from
# it set networking.disableDefaultCNI and run kube-router (e2e/kind/cluster.yaml, cluster.sh).
# kind would `docker pull` the base image and `ctr content fetch` every image kubeadm or its
# manifests name that the Kubernetes build did not provide; here all of them are built, and the
# build fails if one is missing instead of pulling it. The container has no network.
set -euo pipefail
# shellcheck source=e2e/kind/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
command -v docker >/dev/null || die "docker is not on PATH"
docker info >/dev/null 2>&1 || die "docker info fails: start the engine (e2e/host/docker.sh)"

base=$("$E2E_KIND/base-image.sh")
archives=$("$E2E_KIND/images.sh")
"$E2E_KIND/bins.sh" kube nodeconsts
recipe=$( (echo "$base $archives"; cat "$E2E_KIND/lib.sh" "$E2E_KIND/node-image.sh") | sha256sum | cut -c1-12)
if [[ "$(docker image inspect -f '{{ index .Config.Labels "crucible.kind.recipe" }}' "$NODE_IMAGE" 2>/dev/null)" == "$recipe" ]]; then
  echo "$NODE_IMAGE"
  exit 0
fi

build() {
  local id="crucible-kind-build-$$" kube="$KBIN/kube-$K8S_VERSION" b tar
  docker rm -f -v "$id" >/dev/null 2>&1 || true
  trap 'docker rm -f -v '"$id"' >/dev/null 2>&1 || true' RETURN
  logged node-image.log docker run -d --name "$id" --network none --entrypoint=sleep \
    --security-opt seccomp=unconfined "$base" infinity
  nx() { docker exec -i "$id" "$@"; }

  for b in kubeadm kubelet kubectl; do
    logged node-image.log docker cp "$kube/$b" "$id:/usr/bin/$b"
    nx chmod +x "/usr/bin/$b"
    nx chown root:root "/usr/bin/$b"
  done
  printf '%s' "$K8S_VERSION" | nx sh -c 'cat > /kind/version'

  # Every image the node will run must be among the archives: no pulls.
  local have want missing=()
  have=$(for tar in "$archives"/*.tar; do tar -xOf "$tar" manifest.json | jq -r '.[].RepoTags[]'; done \
    | sed -E 's#^([^/.:]+/[^/]+:)#docker.io/\1#; s#^([^/.]+:)#docker.io/library/\1#' | sort -u)
  want=$( (nx kubeadm config images list --kubernetes-version "$K8S_VERSION" | grep -v pause
           nx sed -n 's/^[[:space:]]*sandbox_image[[:space:]]*=[[:space:]]*"\(.*\)"/\1/p' /etc/containerd/config.toml
           sed -n 's/^[[:space:]]*image:[[:space:]]*//p' "$E2E_KIND/kube-router.yaml"
           kind_const storageProvisionerImage; echo
           kind_const storageHelperImage; echo) | grep . | sort -u)
  for b in $want; do grep -qxF "$b" <<<"$have" || missing+=("$b"); done
  ((${#missing[@]} == 0)) || die "no archive for ${missing[*]} (have: $(tr "\n" " " <<<"$have"))"

  nx mkdir -p /kind/manifests
  kind_const defaultStorageManifest | nx sh -c 'cat > /kind/manifests/default-storage.yaml'

  nx bash -c 'nohup containerd > /dev/null 2>&1 &'
  logged node-image.log nx bash -c 'for i in $(seq 1 30); do [ -S /run/containerd/containerd.sock ] && break; sleep 1; done; ctr info >/dev/null'
  for tar in "$archives"/*.tar; do
    logged node-image.log nx ctr --namespace=k8s.io images import --label=io.cri-containerd.pinned=pinned \
      --all-platforms --no-unpack --digests - <"$tar"
  done
  nx ctr --namespace=k8s.io images list -q >>"$KLOG/node-image.log"
  nx pkill containerd
  # (Its parent is `sleep`, which never reaps it: done once it is a zombie.)
  nx bash -c 'for i in $(seq 1 100); do pid=$(pgrep -x containerd) || exit 0
    [ "$(cut -d" " -f3 /proc/$pid/stat)" = Z ] && exit 0; sleep 0.2; done; exit 1'

  logged node-image.log docker commit \
    --change 'ENTRYPOINT [ "/usr/local/bin/entrypoint", "/sbin/init" ]' \
    --change "LABEL crucible.kind.recipe=$recipe" \
    "$id" "$NODE_IMAGE"
}

say "building $NODE_IMAGE from $base (log: $KLOG/node-image.log)"
timed node-image build >&2
echo "$NODE_IMAGE"
