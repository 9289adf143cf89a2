"""Stream `docker save IMAGE` (stdin) into `ctr images import` on kind nodes, layers gzipped.

    docker save IMAGE | python3 e2e/kind/load_image.py CACHE_DIR NODE...

Each gzipped layer is kept in CACHE_DIR as <sha256 of the layer tar>.gz (its diff ID) and reused,
so after a source change only the new top layers are compressed. (The folder names of Docker's
legacy `docker save` cannot be the key: they fold in the image's creation time, and the folders
come in name order, not layer order.) Layers the image no longer has are deleted from CACHE_DIR.
The archive goes to every node's importer at once, as it is made: only one uncompressed layer at
a time lands on this disk. Hand-written because neither kind nor ctr can import compressed layers
from a `docker save` stream.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile

CHUNK = 1 << 20


class FanOut:
    """A write-only file that writes to every importer's stdin."""

    def __init__(self, nodes: list[str], free_disk_of: str):
        self.free_disk_of = free_disk_of
        self.importers = [(node, subprocess.Popen(
            ["docker", "exec", "--privileged", "-i", node, "ctr", "--namespace=k8s.io", "images",
             "import", "--all-platforms", "--snapshotter=overlayfs", "-"],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)) for node in nodes]

    def write(self, data: bytes) -> int:
        for node, proc in self.importers:
            try:
                proc.stdin.write(data)
            except BrokenPipeError:      # its own error (e.g. no space left) is on stderr
                free = shutil.disk_usage(self.free_disk_of).free / 2**30
                sys.exit(f"the import into {node} stopped (exit {proc.wait()}); free disk "
                         f"here: {free:.1f} GiB")
        return len(data)

    def close(self) -> list[str]:
        """Close every importer's input; the nodes whose import failed."""
        for _, proc in self.importers:
            proc.stdin.close()
        return [node for node, proc in self.importers if proc.wait()]


def gzipped_layer(layer, cache: str) -> tuple[str, bool]:
    """The cached gzip of one layer tar read from the stream: (its path, whether it was cached).
    The layer is spooled to a temporary file while it is hashed: its digest names the cache
    entry, and only a miss is compressed."""
    digest = hashlib.sha256()
    with tempfile.NamedTemporaryFile(dir=cache, suffix=".tar") as raw:
        for chunk in iter(lambda: layer.read(CHUNK), b""):
            digest.update(chunk)
            raw.write(chunk)
        raw.flush()
        path = os.path.join(cache, digest.hexdigest() + ".gz")
        if os.path.exists(path):
            return path, True
        part = path + ".part"
        with open(raw.name, "rb") as data, open(part, "wb") as out:
            if subprocess.run(["gzip", "-1", "-c"], stdin=data, stdout=out).returncode:
                sys.exit("gzip failed")
        os.replace(part, path)           # a killed run never leaves a half-written layer
    return path, False


def main(cache: str, nodes: list[str]) -> int:
    os.makedirs(cache, exist_ok=True)
    fan = FanOut(nodes, cache)
    out = tarfile.open(fileobj=fan, mode="w|")
    used, position, cached = set(), 0, 0
    with tarfile.open(fileobj=sys.stdin.buffer, mode="r|") as src:
        for member in src:
            f = src.extractfile(member) if member.isfile() else None
            if f is None or not member.name.endswith("/layer.tar"):
                out.addfile(member, f)
                continue
            path, hit = gzipped_layer(f, cache)
            position += 1
            used.add(os.path.basename(path))
            cached += hit
            with open(path, "rb") as gz:
                member.size = os.fstat(gz.fileno()).st_size
                out.addfile(member, gz)
    out.close()
    failed = fan.close()
    for name in os.listdir(cache):
        if name not in used:
            os.remove(os.path.join(cache, name))
    print(f"{position} layers, {cached} of them gzipped by an earlier load", file=sys.stderr)
    if failed:
        print(f"the import into {', '.join(failed)} failed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
