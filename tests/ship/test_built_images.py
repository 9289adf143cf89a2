"""The built images themselves (`make images`), where a Docker engine answers and they exist.

Skipped, with the reason, when `docker info` fails or an image is missing: build them with
`e2e/host/docker.sh && make base && make images` (BASE=local builds on a Debian base made on the
machine, no registry needed). Marked `docker`: `pytest -m docker` selects only these,
`-m "not docker"` leaves them out. Checked: both entry points start read-only as UID 1000 (the
pods' runAsUser, with a readOnlyRootFilesystem), the images' USER is that UID, the operator image
holds no torch and no trainer code, and torch.compile (Inductor, CPU: g++ and the Python headers)
works in the trainer image as a pod runs it.
The image names are the Makefile's (crucible-<image>:<version>, no REGISTRY) unless
CRUCIBLE_OPERATOR_IMAGE / CRUCIBLE_TRAINER_IMAGE name others.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tomllib

import pytest

from crucible.operator import manifests as m
from tests.support.repo import REPO

pytestmark = pytest.mark.docker

VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
IMAGES = {"operator": os.environ.get("CRUCIBLE_OPERATOR_IMAGE", f"crucible-operator:{VERSION}"),
          "trainer": os.environ.get("CRUCIBLE_TRAINER_IMAGE", f"crucible-trainer:{VERSION}")}
# What the pods get (operator/manifests.py and the chart): a read-only root filesystem, UID 1000.
RUN = ["run", "--rm", "--read-only", "--network", "none", "-u", str(m.RUN_UID)]


def docker(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def images() -> dict[str, str]:
    if shutil.which("docker") is None:
        pytest.skip("no docker CLI on PATH (e2e/host/docker.sh installs an engine)")
    try:
        info = docker("info", "-f", "{{.ServerVersion}}", timeout=20)
    except subprocess.TimeoutExpired:
        pytest.skip("`docker info` did not answer within 20s")
    if info.returncode != 0 or not info.stdout.strip():
        pytest.skip(f"no Docker engine answers (`docker info`: {info.stderr.strip()[-200:]})")
    missing = [name for name in IMAGES.values() if docker("image", "inspect", name).returncode]
    if missing:
        pytest.skip(f"image(s) not built: {', '.join(missing)} (`make images`)")
    return IMAGES


@pytest.mark.parametrize("image,command", [("operator", "crucible-operator"),
                                           ("trainer", "crucible")])
def test_entry_point_starts_read_only_as_uid_1000(images, image, command):
    run = docker(*RUN, "--entrypoint", command, images[image], "--help")
    assert run.returncode == 0, run.stderr[-2000:]
    assert "usage" in run.stdout.lower(), run.stdout[-2000:]


@pytest.mark.parametrize("image", ["operator", "trainer"])
def test_image_user_is_numeric_uid_1000(images, image):
    user = docker("image", "inspect", "-f", "{{.Config.User}}", images[image]).stdout.strip()
    assert user.split(":")[0] == str(m.RUN_UID), user


def test_operator_image_has_no_torch_and_no_trainer(images):
    probe = ("import importlib.util as u; "
             "print([n for n in ('torch', 'triton', 'crucible.trainer') if u.find_spec(n)])")
    run = docker(*RUN, "--entrypoint", "python3", images["operator"], "-c", probe)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "[]", run.stdout
    listed = docker(*RUN, "--entrypoint", "python3", images["operator"], "-m", "pip", "list",
                    "--format", "freeze")
    assert listed.returncode == 0 and "kopf==" in listed.stdout, listed.stderr[-2000:]
    assert not [line for line in listed.stdout.splitlines()
                if line.lower().startswith(("torch==", "triton==", "nvidia-"))], listed.stdout


def test_trainer_image_runs_torch_compile_on_cpu(images):
    """training.compile: Inductor generates C++ for the CPU, compiles it with the image's g++
    against the headers of its Python and loads it, at run time. As in a pod: root filesystem
    read-only, UID 1000, /scratch a writable (exec) emptyDir that is HOME and TMPDIR, where
    Inductor keeps its cache (operator/manifests.py)."""
    script = (
        "import torch\n"
        "f = torch.compile(lambda x: (x.sin() + x.cos()).sum())\n"
        "x = torch.randn(64)\n"
        "torch.testing.assert_close(f(x), (x.sin() + x.cos()).sum())\n"
        "print('compiled ok')\n")
    run = docker(*RUN, "--tmpfs", f"/scratch:exec,uid={m.RUN_UID},gid={m.RUN_UID}",
                 "-e", "TMPDIR=/scratch", "--entrypoint", "python3", images["trainer"],
                 "-c", script, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().endswith("compiled ok"), run.stdout[-2000:]
