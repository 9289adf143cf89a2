"""e2e/kind/, checked without a Docker engine (`make test` runs the real thing, e2e/kind/run.sh):
the script parses, the example PretrainJob and the S3 objects pass a strict server-side dry run
against the local apiserver, the files agree with what `make images` builds and what pytest
collects, and the image loader's layer cache keys and reuses layers by their digest."""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import io
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
    assert "make -C \"$repo\" images" in script and "CRUCIBLE_STACK_ENV=" in script


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
    docs = [d for f in ("pretrainjob.yaml", "seaweedfs.yaml")
            for d in yaml.safe_load_all((KIND / f).read_text()) if d]
    for doc in docs:
        doc["metadata"]["namespace"] = namespace
    assert strict_dry_run(kube.client(), docs, namespace) == []


def _saved_image(layers: dict[str, bytes]) -> bytes:
    """A `docker save`-shaped archive: one folder per layer (VERSION, json, layer.tar)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for folder, data in layers.items():
            for name, content in (("VERSION", b"1.0"), ("json", b"{}"), ("layer.tar", data)):
                info = tarfile.TarInfo(f"{folder}/{name}")
                info.size = len(content)
                tar.addfile(info, io.BytesIO(content))
        manifest = b'[{"Layers": []}]'
        info = tarfile.TarInfo("manifest.json")
        info.size = len(manifest)
        tar.addfile(info, io.BytesIO(manifest))
    return buf.getvalue()


def test_the_image_loader_caches_gzipped_layers_by_digest(tmp_path, monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("load_image", KIND / "load_image.py")
    loader = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loader)
    base, app, app2 = b"base layer " * 1000, b"app layer v1", b"app layer v2"

    def load(layers):  # no node: the archive is made and checked, then dropped
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(_saved_image(layers))))
        assert loader.main(str(tmp_path), []) == 0
        return capsys.readouterr().err

    # Folder names change with every image (Docker folds in its creation time); digests do not.
    assert "2 layers, 0 of them gzipped" in load({"aaa": base, "bbb": app})
    assert "2 layers, 1 of them gzipped" in load({"zzz": base, "yyy": app2})
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted(hashlib.sha256(d).hexdigest() + ".gz" for d in (base, app2))
    for data in (base, app2):   # the old app layer is gone; each entry holds its layer
        assert gzip.decompress((tmp_path / (hashlib.sha256(data).hexdigest() + ".gz"))
                               .read_bytes()) == data
