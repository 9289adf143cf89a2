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
# differ: e2e/kind/load_image.py keeps each gzipped layer under
# ~/.cache/crucible/kind/layers/<repository>/, named by its diff ID, and reuses it. containerd
# checks each layer's uncompressed digest when it unpacks, and skips the content and snapshots it
# already holds, so a warm load costs little more than `docker save`.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
image=$1; shift
(($#)) || { echo "usage: $0 IMAGE NODE..." >&2; exit 2; }
cache="${CRUCIBLE_CACHE:-$HOME/.cache/crucible}/kind/layers/$(echo "${image%:*}" | tr '/' '_')"
start=$SECONDS
digests=- held=-
if [[ -n "$(ls -A "$cache" 2>/dev/null)" ]]; then   # a warm cache: pass 1 maps layers to entries
  digests="$(mktemp)" held="$(mktemp)"; trap 'rm -f "$digests" "$held"' EXIT
  docker save "$image" | python3 "$here/load_image.py" --digests > "$digests"
  # The blobs every node holds already (listed in each node, kept when in all of them).
  for node in "$@"; do
    docker exec "$node" ctr -n k8s.io content ls -q 2>/dev/null | sort -u > "$held.$node"
  done
  cat "$held".* | sort | uniq -c | awk -v n=$# '$1 == n {print $2}' > "$held"
  rm -f "$held".*
fi
docker save "$image" | python3 "$here/load_image.py" "$cache" "$digests" "$held" "$@"
echo "$image: loaded into $* in $((SECONDS - start))s"
