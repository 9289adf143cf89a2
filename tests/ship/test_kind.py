"""e2e/kind/, checked as far as this machine allows (no Docker engine to run it): the script
parses, the example PretrainJob and the S3 objects pass a strict server-side dry run against the
local apiserver, and the files agree with what `make images` builds and what pytest collects."""

from __future__ import annotations

import re
import subprocess

import pytest
import yaml

from tests.support.apply import strict_dry_run
from tests.support.repo import REPO

KIND = REPO / "e2e" / "kind"


def test_script_parses_and_names_what_exists():
    subprocess.run(["bash", "-n", str(KIND / "run.sh")], check=True)
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
