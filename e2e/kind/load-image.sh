#!/usr/bin/env bash
# Load a Docker image into kind nodes with its layers gzip-compressed:
#   e2e/kind/load-image.sh IMAGE NODE...
# `kind load docker-image` imports `docker save`'s uncompressed layer tars, and containerd keeps
# them as content next to the unpacked snapshot: the CUDA trainer image (6.6 GB) then costs ~13 GB
# per node plus the 6.6 GB archive, which ran this machine out of disk with two workers. Here
# each layer is gzipped (-1) into one archive first (containerd's importer detects the
# compression), so a node holds ~3.5 GB of content + the snapshot, and the archive is ~3.5 GB.
# The image ID (its config digest) is unchanged; the manifest digest differs.
# Gzipping 6.6 GB takes minutes on two cores, and after a source change only the top layers
# differ: each gzipped layer is kept under ~/.cache/crucible/kind/layers/<repository>/ and reused,
# named by its folder in `docker save`'s archive (Docker derives that ID from the layer's chain
# ID, i.e. from its content and everything under it; the top layer's also from the image config,
# so it is always compressed anew). Layers the image no longer has are deleted from there.
# containerd checks each layer's uncompressed digest when it unpacks, and skips the content and
# snapshots it already holds, so a warm load costs little more than `docker save`. The archive is
# streamed to every node's importer at once: nothing the size of the image lands on this disk.
set -euo pipefail
image=$1; shift
(($#)) || { echo "usage: $0 IMAGE NODE..." >&2; exit 2; }
cache="${CRUCIBLE_CACHE:-$HOME/.cache/crucible}/kind/layers/$(echo "${image%:*}" | tr '/' '_')"
mkdir -p "$cache"
start=$SECONDS
docker save "$image" | python3 -c '
import os, shutil, subprocess, sys, tarfile
cache, nodes = sys.argv[1], sys.argv[2:]
importers = [subprocess.Popen(
    ["docker", "exec", "--privileged", "-i", node, "ctr", "--namespace=k8s.io", "images", "import",
     "--all-platforms", "--snapshotter=overlayfs", "-"],
    stdin=subprocess.PIPE, stdout=subprocess.DEVNULL) for node in nodes]

class FanOut:
    """The archive, written to every importer as it is made."""
    def write(self, data):
        for node, p in zip(nodes, importers):
            try:
                p.stdin.write(data)
            except BrokenPipeError:      # its error (e.g. no space left) is on stderr above
                sys.exit(f"the import into {node} stopped (exit {p.wait()}); "
                         f"free disk here: {shutil.disk_usage(cache).free / 2**30:.1f} GiB")
        return len(data)

out = tarfile.open(fileobj=FanOut(), mode="w|")
used, reused = set(), 0
with tarfile.open(fileobj=sys.stdin.buffer, mode="r|") as src:
    for m in src:
        f = src.extractfile(m) if m.isfile() else None
        if f is None or not m.name.endswith("/layer.tar") or m.size == 0:
            out.addfile(m, f)
            continue
        name = m.name.split("/")[0] + ".gz"
        gz_path = os.path.join(cache, name)
        if os.path.exists(gz_path):
            reused += 1
        else:
            part = gz_path + ".part"
            with open(part, "wb") as gz:
                p = subprocess.Popen(["gzip", "-1", "-c"], stdin=subprocess.PIPE, stdout=gz)
                shutil.copyfileobj(f, p.stdin, 1 << 20); p.stdin.close()
                if p.wait():
                    sys.exit("gzip failed")
            os.replace(part, gz_path)    # a killed run never leaves a half-written layer
        used.add(name)
        with open(gz_path, "rb") as gz:
            m.size = os.fstat(gz.fileno()).st_size
            out.addfile(m, gz)
out.close()
for p in importers:
    p.stdin.close()
failed = [node for node, p in zip(nodes, importers) if p.wait()]
for name in os.listdir(cache):
    if name not in used:
        os.remove(os.path.join(cache, name))
print(f"{len(used)} layers, {reused} already gzipped", file=sys.stderr)
sys.exit(f"import into {failed} failed" if failed else 0)' "$cache" "$@"
# Once unpacked, the compressed layers are dead weight (~3.5 GB a node for the trainer): a
# container starts from the snapshots, which the image config (kept) references. Dropping them is
# what containerd's CRI does for pulled images with discard_unpacked_layers; an import cannot ask
# for it. The next load streams them again, and containerd skips the snapshots it has.
# containerd's name for it: Docker Hub's defaults spelled out unless it names a registry.
case "$image" in
  */*) first=${image%%/*}; [[ "$first" == *[.:]* || "$first" == localhost ]] && ref=$image || ref="docker.io/$image" ;;
  *) ref="docker.io/library/$image" ;;
esac
for node in "$@"; do
  docker exec "$node" sh -c '
    manifest=$(ctr -n k8s.io images ls | awk -v r="$1" "\$1 == r {print \$3}")
    [ -n "$manifest" ] || { echo "no image $1 after the import" >&2; exit 1; }
    ctr -n k8s.io content get "$manifest" | jq -r ".layers[].digest" | xargs ctr -n k8s.io content rm >/dev/null
  ' sh "$ref" 2>&1 | grep -v "level=warning" || true
done
echo "$image: loaded into $* in $((SECONDS - start))s"
