#!/usr/bin/env bash
# The in-cluster S3 image of the kind end to end (e2e/kind/seaweedfs.yaml), built here with no
# registry: the static `weed` binary the local stack built (e2e/stack.sh, ~/.cache/crucible/bin/weed)
# on the kind slim Debian base built from source by e2e/kind/images.sh.
#   e2e/kind/s3-image.sh            build crucible-seaweedfs:<weed version> unless present, print its tag
# Loading it into the nodes is run.sh's job (kind load).
set -euo pipefail
cache="${CRUCIBLE_CACHE:-$HOME/.cache/crucible}"
weed="${CRUCIBLE_WEED:-$cache/bin/weed}"
[[ -x "$weed" ]] || { echo "s3-image: no weed binary at $weed (run e2e/stack.sh first)" >&2; exit 1; }
ver="$("$weed" version 2>/dev/null | sed -n 's/^version [^ ]* \([0-9][0-9.]*\) .*/\1/p' | head -1)"
[[ -n "$ver" ]] || { echo "s3-image: cannot read the version of $weed" >&2; exit 1; }
tag="crucible-seaweedfs:$ver"
base="$(docker images --format '{{.Repository}}:{{.Tag}}' 'crucible-kind/slim' | head -1)"
[[ -n "$base" ]] || base=crucible-base/debian-python:bookworm
if ! docker image inspect "$tag" >/dev/null 2>&1; then
  ctx="$(mktemp -d)"; trap 'rm -rf "$ctx"' EXIT
  cp "$weed" "$ctx/weed"
  cat > "$ctx/Dockerfile" <<DOCKERFILE
FROM $base
COPY weed /usr/bin/weed
RUN mkdir -p /data && /usr/bin/weed version
EXPOSE 8333
ENTRYPOINT ["/usr/bin/weed"]
DOCKERFILE
  docker build -q -t "$tag" "$ctx" >&2
fi
echo "$tag"
