"""e2e/kind/, checked without a Docker engine (`make test` runs the real thing, e2e/kind/run.sh):
the script parses, the example PretrainJob and the S3 objects pass a strict server-side dry run
against the local apiserver, the files agree with what `make images` builds and what pytest
collects, and the image loader's layer cache keys and reuses layers by their digest."""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import io
import json
import re
import subprocess
import sys
import tarfile

import pytest
import yaml

from tests.support.apply import strict_dry_run
from tests.support.repo import REPO

KIND = REPO / "e2e" / "kind"


def test_script_parses_and_names_what_exists():
    for script in sorted(KIND.glob("*.sh")):
        subprocess.run(["bash", "-n", str(script)], check=True)
    script = (KIND / "run.sh").read_text()
    for path in re.findall(r"(tests/[\w/]+\.py)", script):
        assert (REPO / path).is_file(), path
    assert "make -C \"$repo\" local-images" in script and "CRUCIBLE_STACK_ENV=" in script
    # The images are built as `make test KIND=1` builds them: with no registry, the Debian
    # base made here first (the Dockerfiles' public bases cannot be pulled).
    target = re.search(r"^local-images:\n((?:\t.*\n)+)", (REPO / "Makefile").read_text(), re.M)
    assert target and "base" in target.group(1) and "images" in target.group(1)


def test_chaos_runs_every_fault_it_names_and_records_whether_each_held():
    script = (KIND / "chaos.sh").read_text()
    faults = re.search(r"^ALL=\(([^)]*)\)", script, re.M).group(1).split()
    cases = re.findall(r"^    ([\w-]+)\)", script, re.M)
    assert sorted(faults) == sorted(cases)       # each default fault has a case, and no case is left out
    assert {"node-loss-worker", "apiserver-restart", "operator-kill-mid-restart",
            "s3-outage-5min", "leader-node-kill", "kueue"} <= set(faults)
    for fault in faults:                         # a row of the results per fault, named as run
        body = re.search(rf"^    {fault}\)(.*?);;", script, re.M | re.S).group(1)
        if re.search(rf'measure "?{fault}[\w${{}}:-]*"? f_\w+', body):
            continue
        # Or a function of its own that writes the row (its name may say more: kueue-preempt).
        called = [f for f in re.findall(r"\b([a-z_]+)\b", body)
                  if re.search(rf"^{f}\(\) {{", script, re.M)]
        assert any(re.search(rf"^{f}\(\) {{\n(?:.+\n)*?\s+row \"?{fault}[\w-]*\"? ", script, re.M)
                   for f in called), fault
    for function in set(re.findall(r"measure [\w-]+ (f_\w+)", script)):
        assert re.search(rf"^{function}\(\) {{", script, re.M), function
    header = re.search(r"^HEADER=\$'([^']*)'", script, re.M).group(1).split("\\t")
    assert {"fault", "fault_to_resumed_step_s", "steps_lost", "restarts_by_cause", "ok"} <= set(header)


def test_cluster_has_workers_to_lose():
    nodes = yaml.safe_load((KIND / "cluster.yaml").read_text())["nodes"]
    assert [n["role"] for n in nodes].count("control-plane") == 1
    assert [n["role"] for n in nodes].count("worker") >= 2


def test_example_image_builds_on_the_trainer_image_make_builds():
    version = re.search(r'^version = "(.+)"', (REPO / "pyproject.toml").read_text(), re.M).group(1)
    assert f"ARG TRAINER_IMAGE=crucible-trainer:{version}" in (KIND / "Dockerfile.example").read_text()
    job = yaml.safe_load((KIND / "pretrainjob.yaml").read_text())
    assert job["spec"]["image"] == f"crucible-trainer-example:{version}"


@pytest.mark.stack
def test_example_job_and_s3_objects_pass_a_server_side_dry_run(kube, namespace):
    from tests.support.apply import CRD_FILE, apply

    apply(kube.client(), yaml.safe_load(CRD_FILE.read_text()))
    docs = [d for f in ("pretrainjob.yaml", "seaweedfs.yaml", "kueue-queues.yaml")
            for d in yaml.safe_load_all((KIND / f).read_text()) if d]
    for doc in docs:
        if "namespace" in doc["metadata"]:      # Kueue's ResourceFlavor, ClusterQueue, ... are not
            doc["metadata"]["namespace"] = namespace
    # The stack runs Kueue (its CRDs and admission webhooks): the queues of the chaos's `kueue`
    # fault are checked by the version kind installs.
    assert strict_dry_run(kube.client(), docs, namespace) == []


def _saved_image(layers: dict[str, bytes]) -> bytes:
    """A `docker save`-shaped archive: one folder per layer (VERSION, json, layer.tar), the
    image config, manifest.json."""
    config = json.dumps({"architecture": "amd64", "os": "linux", "rootfs": {
        "type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(d).hexdigest()
                                       for d in layers.values()]}}).encode()
    config_name = hashlib.sha256(config).hexdigest() + ".json"
    manifest = json.dumps([{"Config": config_name, "RepoTags": ["crucible-test:1"],
                            "Layers": [f"{folder}/layer.tar" for folder in layers]}]).encode()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        files = [(f"{folder}/{name}", content) for folder, data in layers.items()
                 for name, content in (("VERSION", b"1.0"), ("json", b"{}"), ("layer.tar", data))]
        for name, content in sorted(files) + [(config_name, config), ("manifest.json", manifest)]:
            info = tarfile.TarInfo(name)
            info.size = len(content)
            tar.addfile(info, io.BytesIO(content))
    return buf.getvalue()


def test_the_image_loader_caches_gzipped_layers_by_digest(tmp_path, monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("load_image", KIND / "load_image.py")
    loader = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loader)
    base, app, app2 = b"base layer " * 1000, b"app layer v1", b"app layer v2"

    sent = []

    class Collect:  # stands in for the nodes' importers: no kind node here
        def __init__(self, nodes, free_disk_of):
            sent.append(io.BytesIO())

        def write(self, data):
            return sent[-1].write(data)

        def close(self):
            return []

    monkeypatch.setattr(loader, "FanOut", Collect)

    def load(layers, two_passes):
        archive = _saved_image(layers)
        digests = loader.layer_digests(io.BytesIO(archive)) if two_passes else {}
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(archive)))
        assert loader.main(str(tmp_path), digests, []) == 0
        return capsys.readouterr().err

    # Folder names change with every image (Docker folds in its creation time); digests do not.
    assert "2 layers, 0 of them gzipped" in load({"aaa": base, "bbb": app}, two_passes=False)
    assert "2 layers, 1 of them gzipped" in load({"zzz": base, "yyy": app2}, two_passes=True)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted(hashlib.sha256(d).hexdigest() + ext for d in (base, app2)
                           for ext in (".gz", ".digest"))
    for data in (base, app2):   # the old app layer is gone; each entry holds its layer
        assert gzip.decompress((tmp_path / (hashlib.sha256(data).hexdigest() + ".gz"))
                               .read_bytes()) == data
    # What the nodes get: an OCI layout naming the image, its config (the image ID) and each
    # layer gzipped under its own digest, in the config's layer order.
    with tarfile.open(fileobj=io.BytesIO(sent[-1].getvalue())) as oci:
        blobs = {m.name: oci.extractfile(m).read() for m in oci.getmembers()}
    (entry,) = json.loads(blobs["index.json"])["manifests"]
    assert entry["annotations"]["io.containerd.image.name"] == "docker.io/library/crucible-test:1"
    manifest = json.loads(blobs["blobs/sha256/" + entry["digest"].split(":")[1]])
    config = blobs["blobs/sha256/" + manifest["config"]["digest"].split(":")[1]]
    assert manifest["config"]["digest"] == "sha256:" + hashlib.sha256(config).hexdigest()
    layers = [blobs["blobs/sha256/" + d["digest"].split(":")[1]] for d in manifest["layers"]]
    assert [gzip.decompress(layer) for layer in layers] == [base, app2]
    assert all(d["digest"] == "sha256:" + hashlib.sha256(layer).hexdigest()
               for d, layer in zip(manifest["layers"], layers))
    # A layer that differs from what pass 1 saw (an image rebuilt in between) stops the load.
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(_saved_image({"q": b"new"}))))
    with pytest.raises(SystemExit, match="changed between two"):
        loader.main(str(tmp_path), {"q/layer.tar": hashlib.sha256(b"old").hexdigest()}, [])
