#!/usr/bin/env bash
# An image holding one static binary the local stack built (e2e/stack.sh, ~/.cache/crucible/bin),
# on the kind slim Debian base built from source by e2e/kind/images.sh; no registry.
#   e2e/kind/binary-image.sh weed     crucible-seaweedfs:<weed version>: the kind end to end's S3
#                                     (e2e/kind/seaweedfs.yaml), /usr/bin/weed
#   e2e/kind/binary-image.sh kueue    crucible-kueue:<Kueue version>: Kueue's controller manager
#                                     at /manager (what its Helm chart runs), user 65532 (its
#                                     chart sets runAsNonRoot)
# Builds the image unless present and prints its tag. Loading it into the nodes is run.sh's job.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cache="${CRUCIBLE_CACHE:-$HOME/.cache/crucible}"
case "${1:-}" in
  weed)
    binary="${CRUCIBLE_WEED:-$cache/bin/weed}"; name=crucible-seaweedfs; path=/usr/bin/weed; user=0
    [[ -x "$binary" ]] || { echo "binary-image: no weed binary at $binary (run e2e/stack.sh first)" >&2; exit 1; }
    ver="$("$binary" version 2>/dev/null | sed -n 's/^version [^ ]* \([0-9][0-9.]*\) .*/\1/p' | head -1)"
    extra='RUN mkdir -p /data && /usr/bin/weed version
EXPOSE 8333' ;;
  kueue)
    binary="$cache/bin/kueue"; name=crucible-kueue; path=/manager; user=65532
    [[ -x "$binary" ]] || { echo "binary-image: no kueue binary at $binary (run e2e/stack.sh first)" >&2; exit 1; }
    # The version the stack pins (and stamps into the binary).
    ver="$(sed -n 's/^KUEUE = "\(.*\)"$/\1/p' "$here/../stack/build.py")"
    extra= ;;
  *) echo "usage: $0 weed|kueue" >&2; exit 2 ;;
esac
[[ -n "$ver" ]] || { echo "binary-image: cannot read the version of $binary" >&2; exit 1; }
tag="$name:$ver"
base="$(docker images --format '{{.Repository}}:{{.Tag}}' 'crucible-kind/slim' | head -1)"
[[ -n "$base" ]] || base=crucible-base/debian-python:bookworm
if ! docker image inspect "$tag" >/dev/null 2>&1; then
  ctx="$(mktemp -d)"; trap 'rm -rf "$ctx"' EXIT
  cp "$binary" "$ctx/binary"
  cat > "$ctx/Dockerfile" <<DOCKERFILE
FROM $base
COPY binary $path
$extra
USER $user
ENTRYPOINT ["$path"]
DOCKERFILE
  docker build -q -t "$tag" "$ctx" >&2
fi
echo "$tag"
