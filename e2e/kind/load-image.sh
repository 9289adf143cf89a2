#!/usr/bin/env bash
# Load a Docker image into kind nodes with its layers gzip-compressed:
#   e2e/kind/load-image.sh IMAGE NODE...
# `kind load docker-image` imports `docker save`'s uncompressed layer tars, and containerd keeps
# them as content next to the unpacked snapshot: the CUDA trainer image (6.6 GB) then costs ~13 GB
# per node plus the 6.6 GB archive, which ran this machine out of disk with two workers. Here
# each layer is gzipped (-1) into one archive first (containerd's importer detects the
# compression), so a node holds ~3.5 GB of content + the snapshot, and the archive is ~3.5 GB.
# The image ID (its config digest) is unchanged; the manifest digest differs.
set -euo pipefail
image=$1; shift
(($#)) || { echo "usage: $0 IMAGE NODE..." >&2; exit 2; }
tmp="$(mktemp -d "${TMPDIR:-/tmp}/kind-load.XXXXXX")"; trap 'rm -rf "$tmp"' EXIT
start=$SECONDS
docker save "$image" | python3 -c '
import shutil, subprocess, sys, tarfile, tempfile
out = tarfile.open(sys.argv[1], "w")
with tarfile.open(fileobj=sys.stdin.buffer, mode="r|") as src:
    for m in src:
        f = src.extractfile(m) if m.isfile() else None
        if f is not None and m.name.endswith(".tar") and m.size > 0:
            with tempfile.TemporaryFile(dir=sys.argv[2]) as gz:
                p = subprocess.Popen(["gzip", "-1", "-c"], stdin=subprocess.PIPE, stdout=gz)
                shutil.copyfileobj(f, p.stdin, 1 << 20); p.stdin.close()
                if p.wait(): sys.exit("gzip failed")
                m.size = gz.tell(); gz.seek(0); out.addfile(m, gz)
        else:
            out.addfile(m, f)
out.close()' "$tmp/image.tar" "$tmp"
echo "$image: archive $(du -h "$tmp/image.tar" | cut -f1) in $((SECONDS - start))s"
pids=()
for node in "$@"; do
  docker exec --privileged -i "$node" ctr --namespace=k8s.io images import --all-platforms \
    --digests --snapshotter=overlayfs - < "$tmp/image.tar" >"$tmp/$node.log" 2>&1 &
  pids+=($!)
done
rc=0
for i in "${!pids[@]}"; do
  wait "${pids[$i]}" || { rc=1; echo "import into ${*:i+1:1} failed:" >&2; cat "$tmp/${*:i+1:1}.log" >&2; }
done
echo "$image: loaded into $* in $((SECONDS - start))s"
exit $rc
