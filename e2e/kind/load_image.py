"""Stream `docker save IMAGE` into `ctr images import` on kind nodes, as an OCI layout with
gzipped layers.

    docker save IMAGE | python3 e2e/kind/load_image.py --digests > DIGESTS.json   (pass 1)
    docker save IMAGE | python3 e2e/kind/load_image.py CACHE_DIR DIGESTS.json|- HELD|- NODE...

HELD: a file of the blob digests every node's containerd already holds (`ctr content ls -q`).

Why not `kind load docker-image`: it imports `docker save`'s archive as it is, uncompressed layer
tars with no digest in their names. containerd then keeps each layer twice on every node (the tar
as content, the unpacked snapshot), and must write every layer to its ingest folder just to learn
its digest, even one it already holds: a reload of the 6.6 GB trainer needs ~3.4 GB of scratch per
node. Here the archive is rewritten, on the fly, as an OCI image layout: each layer gzipped, every
blob under its digest (`blobs/sha256/<digest>`), so containerd skips, unread, any blob it already
has, and keeps ~3.4 GB of content per node next to the snapshot. The image ID (the config's
digest) is the one `docker images` shows.

Each gzipped layer is kept in CACHE_DIR as <diff ID>.gz (the sha256 of the layer tar) with its
compressed digest in <diff ID>.digest, and reused: after a source change only the new top layers
are compressed. The folder names of Docker's legacy `docker save` cannot be the key (they fold in
the image's creation time, and come in name order, not layer order), and a layer's digest is known
only once it has streamed by: pass 1 reads the stream once for the digests (seconds of hashing,
nothing written), so that pass 2 knows each layer's cache entry when it reaches it. With an empty
cache pass 1 is skipped (`-`): every layer is compressed anyway. Layers the image no longer has
are deleted from CACHE_DIR. The archive goes to every node's importer as it is made: nothing the
size of the image lands on this disk. Hand-written because neither kind nor ctr can do this.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import threading

CHUNK = 1 << 20
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"


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
                raise SystemExit(f"the import into {node} stopped (exit {proc.wait()}); free "
                                 f"disk here: {free:.1f} GiB") from None
        return len(data)

    def close(self) -> list[str]:
        """Close every importer's input; the nodes whose import failed."""
        for _, proc in self.importers:
            proc.stdin.close()
        return [node for node, proc in self.importers if proc.wait()]


def layer_digests(stream) -> dict[str, str]:
    """Pass 1 over a `docker save` stream: each layer tar's name -> its sha256 (no disk)."""
    digests = {}
    with tarfile.open(fileobj=stream, mode="r|") as src:
        for member in src:
            if member.isfile() and member.name.endswith("/layer.tar"):
                digest, f = hashlib.sha256(), src.extractfile(member)
                for chunk in iter(lambda: f.read(CHUNK), b""):
                    digest.update(chunk)
                digests[member.name] = digest.hexdigest()
    return digests


def gzip_into_cache(layer, cache: str, expected: str | None) -> str:
    """Compress one layer tar from the stream into the cache; its diff ID (hex)."""
    diff, packed, part = hashlib.sha256(), hashlib.sha256(), os.path.join(cache, "incoming.part")
    with open(part, "wb") as out:
        gz = subprocess.Popen(["gzip", "-1", "-n", "-c"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        # gzip's output is hashed as it is written, so its input is fed from a second thread
        # (one thread writing and reading the same process would deadlock on a full pipe).
        feeder = _feed(gz.stdin, layer, diff)
        for chunk in iter(lambda: gz.stdout.read(CHUNK), b""):
            packed.update(chunk)
            out.write(chunk)
        feeder.join()
        if gz.wait():
            raise SystemExit("gzip failed")
    if expected is not None and diff.hexdigest() != expected:
        os.remove(part)
        raise SystemExit(f"a layer changed between two `docker save`s (sha256:{expected}, then "
                         f"sha256:{diff.hexdigest()}): was the image rebuilt meanwhile? Run again.")
    name = diff.hexdigest()
    with open(os.path.join(cache, name + ".digest"), "w") as f:
        f.write(packed.hexdigest())
    os.replace(part, os.path.join(cache, name + ".gz"))   # never a half-written layer
    return name


def _feed(pipe, layer, digest) -> threading.Thread:
    def run():
        for chunk in iter(lambda: layer.read(CHUNK), b""):
            digest.update(chunk)
            pipe.write(chunk)
        pipe.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _add(out: tarfile.TarFile, name: str, data: bytes | None = None, path: str | None = None):
    info = tarfile.TarInfo(name)
    info.mode = 0o644
    if path is not None:
        with open(path, "rb") as f:
            info.size = os.fstat(f.fileno()).st_size
            out.addfile(info, f)
    else:
        info.size = len(data)
        out.addfile(info, io.BytesIO(data))


def _blob(out: tarfile.TarFile, data: bytes) -> dict:
    digest = hashlib.sha256(data).hexdigest()
    _add(out, f"blobs/sha256/{digest}", data)
    return {"digest": f"sha256:{digest}", "size": len(data)}


def image_name(tag: str) -> str:
    """containerd's name for a Docker tag: Docker Hub's defaults spelled out."""
    first, _, rest = tag.partition("/")
    if not rest:
        return f"docker.io/library/{tag}"
    if "." in first or ":" in first or first == "localhost":
        return tag
    return f"docker.io/{tag}"


def main(cache: str, digests: dict[str, str], nodes: list[str],
         held: frozenset[str] = frozenset()) -> int:
    """Pass 2: the OCI layout, each layer from the cache where `digests` (pass 1) names a cached
    one, else compressed from the stream into the cache. A layer blob every node already holds
    (`held`: digests) is left out of the archive: containerd would write it to its ingest folder
    again before noticing it has it (~3.4 GB a node for the trainer), and it takes the image's
    blobs from its content store."""
    os.makedirs(cache, exist_ok=True)
    fan = FanOut(nodes, cache)
    out = tarfile.open(fileobj=fan, mode="w|")
    by_member, sent, metadata, cached = {}, set(), {}, 0
    with tarfile.open(fileobj=sys.stdin.buffer, mode="r|") as src:
        for member in src:
            if not member.isfile():
                continue
            f = src.extractfile(member)
            if member.name.endswith("/layer.tar"):
                expected = digests.get(member.name)
                if expected and os.path.exists(os.path.join(cache, expected + ".gz")):
                    name, cached = expected, cached + 1    # the stream's copy is skipped, unread
                else:
                    name = gzip_into_cache(f, cache, expected)
                by_member[member.name] = name
                packed = open(os.path.join(cache, name + ".digest")).read().strip()
                if packed not in sent and f"sha256:{packed}" not in held:
                    _add(out, f"blobs/sha256/{packed}", path=os.path.join(cache, name + ".gz"))
                    sent.add(packed)
            elif "/" not in member.name:         # manifest.json, the config, repositories
                metadata[member.name] = f.read()
    (saved,) = json.loads(metadata["manifest.json"])
    config_bytes = metadata[saved["Config"]]
    config = json.loads(config_bytes)
    layers = []
    for member_name in saved["Layers"]:
        name = by_member[member_name]
        packed = open(os.path.join(cache, name + ".digest")).read().strip()
        layers.append({"mediaType": OCI_LAYER_GZIP, "digest": f"sha256:{packed}",
                       "size": os.path.getsize(os.path.join(cache, name + ".gz"))})
    if config["rootfs"]["diff_ids"] != [f"sha256:{by_member[m]}" for m in saved["Layers"]]:
        raise SystemExit("the saved layers do not match the image config's diff IDs")
    manifest = {"schemaVersion": 2, "mediaType": OCI_MANIFEST,
                "config": {"mediaType": OCI_CONFIG, **_blob(out, config_bytes)},
                "layers": layers}
    manifest_desc = {"mediaType": OCI_MANIFEST, **_blob(out, json.dumps(manifest).encode()),
                     "platform": {"architecture": config.get("architecture", "amd64"),
                                  "os": config.get("os", "linux")}}
    index = {"schemaVersion": 2, "manifests": [
        {**manifest_desc, "annotations": {"io.containerd.image.name": image_name(tag),
                                          "org.opencontainers.image.ref.name": tag.rsplit(":", 1)[1]}}
        for tag in saved.get("RepoTags") or []]}
    _add(out, "index.json", json.dumps(index).encode())
    _add(out, "oci-layout", b'{"imageLayoutVersion": "1.0.0"}')
    out.close()
    failed = fan.close()
    keep = {name + ext for name in by_member.values() for ext in (".gz", ".digest")}
    for entry in os.listdir(cache):
        if entry not in keep:
            os.remove(os.path.join(cache, entry))
    print(f"{len(saved['Layers'])} layers, {cached} of them gzipped by an earlier load, image "
          f"sha256:{hashlib.sha256(config_bytes).hexdigest()[:12]}", file=sys.stderr)
    if failed:
        print(f"the import into {', '.join(failed)} failed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "--digests":       # pass 1: print the map for pass 2
        json.dump(layer_digests(sys.stdin.buffer), sys.stdout)
        sys.exit(0)
    cache, digests_file, held_file, nodes = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
    digests = json.load(open(digests_file)) if digests_file != "-" else {}
    held = frozenset(open(held_file).read().split()) if held_file != "-" else frozenset()
    sys.exit(main(cache, digests, nodes, held))
