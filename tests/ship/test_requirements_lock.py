"""The images' hash-locked dependencies (requirements/<image>.txt, `make requirements`), offline.

Each image installs only what its lock names, with `pip install --require-hashes --no-deps`, so a
package re-uploaded or swapped on the index cannot get in. Checked here without the network: the
locks agree with pyproject.toml (every pin of the base dependencies and of the image's extra, at
the same version: a pin bumped without `make requirements` fails), every requirement carries a
sha256 hash, the dependencies of locked packages this checkout's venv has at the locked version
are locked too (torch's nvidia-* CUDA wheels for the trainer), the Dockerfiles install the lock
that way and nothing from an index otherwise, the image contexts carry their lock, and
`make images-push` refuses bases pinned by tag only. Whether every locked wheel downloads and
matches its hash is what an image build proves (`make images`).
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import tarfile
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.ship.test_images import DOCKERFILES, instructions
from tests.support.repo import REPO

IMAGES = ("operator", "trainer")
LOCKS = {name: REPO / "requirements" / f"{name}.txt" for name in IMAGES}
BUILD_IN = REPO / "requirements" / "build.in"
# Both images: Linux x86_64, CPython 3.12 (python:3.12 slim; Ubuntu 24.04's python3).
TARGET = {"os_name": "posix", "sys_platform": "linux", "platform_system": "Linux",
          "platform_machine": "x86_64", "platform_python_implementation": "CPython",
          "implementation_name": "cpython", "python_version": "3.12",
          "python_full_version": "3.12.13", "implementation_version": "3.12.13"}
HASH = re.compile(r"--hash=sha256:[0-9a-f]{64}")


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def applies(req: Requirement, extras=("",)) -> bool:
    return req.marker is None or any(req.marker.evaluate({**TARGET, "extra": e}) for e in extras)


def wanted(project: dict, image: str) -> list[Requirement]:
    """What the image's lock must satisfy: base dependencies, the image's extra, the backend."""
    reqs = [Requirement(r) for r in project["project"]["dependencies"]
            + project["project"]["optional-dependencies"][image]
            + project["build-system"]["requires"]]
    return [r for r in reqs if applies(r)]


def requirement_lines(path: Path) -> list[str]:
    """The lock's logical lines (continuations joined), comments and blank lines dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    return [line.split(" #")[0].strip() for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def lock(image: str) -> dict[str, Version]:
    out = {}
    for line in requirement_lines(LOCKS[image]):
        name, version = re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", line).groups()
        out[canonicalize_name(name)] = Version(version)
    return out


def mismatches(requirements: list[Requirement], locked: dict[str, Version]) -> list[str]:
    return [f"{r} (lock: {locked.get(canonicalize_name(r.name), 'missing')})" for r in requirements
            if not r.specifier.contains(locked.get(canonicalize_name(r.name), Version("0.0.0a0")),
                                        prereleases=True)
            or canonicalize_name(r.name) not in locked]


@pytest.mark.parametrize("image", IMAGES)
def test_every_pin_of_the_image_is_locked_at_its_version(image):
    project = pyproject()
    pins = [r for r in wanted(project, image) if any(s.operator == "==" for s in r.specifier)]
    assert len(pins) >= len(project["project"]["dependencies"]) + 3, pins
    assert mismatches(wanted(project, image), lock(image)) == [], \
        f"requirements/{image}.txt is stale: run `make requirements`"


def test_a_bumped_pin_is_caught():
    project = pyproject()
    project["project"]["optional-dependencies"]["operator"] = [
        re.sub(r"^kopf==.*", "kopf==99.0.0", r)
        for r in project["project"]["optional-dependencies"]["operator"]]
    assert mismatches(wanted(project, "operator"), lock("operator")) == [
        f"kopf==99.0.0 (lock: {lock('operator')['kopf']})"]
    project["project"]["dependencies"].append("left-pad==1.0")
    assert "left-pad==1.0 (lock: missing)" in mismatches(wanted(project, "operator"),
                                                         lock("operator"))


@pytest.mark.parametrize("image", IMAGES)
def test_every_locked_requirement_is_pinned_and_hashed(image):
    lines = requirement_lines(LOCKS[image])
    assert len(lines) >= 20, lines
    for line in lines:
        name_version, *options = line.split()
        assert re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*==[^\s;@]+", name_version), line
        assert options and all(HASH.fullmatch(o) for o in options), line


def test_the_build_backend_is_the_projects_and_is_locked():
    build_in = [line for line in BUILD_IN.read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    assert build_in == pyproject()["build-system"]["requires"]
    for image in IMAGES:
        assert {"setuptools", "wheel"} <= set(lock(image)), image


def test_the_operator_lock_has_no_torch_and_the_trainers_has_its_cuda_wheels():
    assert not [n for n in lock("operator") if n in ("torch", "triton") or n.startswith("nvidia-")]
    trainer = lock("trainer")
    assert {"torch", "triton", "nvidia-cudnn-cu13", "nvidia-nccl-cu13"} <= set(trainer)
    assert len([n for n in trainer if n.startswith("nvidia-")]) >= 10


@pytest.mark.parametrize("image", IMAGES)
def test_locked_packages_have_their_dependencies_locked(image):
    """The lock is closed under dependencies, as far as this venv's metadata shows: a package it
    has at the locked version has each of its Linux/3.12 requirements (with their extras) locked
    at a version that satisfies it. The image build's `pip check` and `--no-index` repeat this."""
    locked = lock(image)
    todo = [(canonicalize_name(r.name), frozenset(r.extras)) for r in wanted(pyproject(), image)]
    seen, read, gaps = set(), set(), []
    while todo:
        name, extras = todo.pop()
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        if Version(dist.version).public != str(locked[name]):
            continue
        read.add(name)
        for req in map(Requirement, dist.requires or []):
            if not applies(req, ("", *extras)):
                continue
            gaps += [f"{name} needs {g}" for g in mismatches([req], locked)]
            todo.append((canonicalize_name(req.name), frozenset(req.extras)))
    assert gaps == []
    assert len(read) >= 10, read
    if image == "trainer" and Version(metadata.version("torch")).public == str(locked["torch"]):
        assert "torch" in read and {n for n, _ in seen if n.startswith("nvidia-")}


@pytest.mark.parametrize("image", IMAGES)
def test_dockerfile_installs_only_the_hashed_lock(image):
    ops = instructions(DOCKERFILES[image])
    lock_file = f"requirements/{image}.txt"
    copied = [i for i, (op, rest) in enumerate(ops) if op == "COPY" and rest.split()[0] == lock_file]
    installs = [(i, cmd.strip()) for i, (op, rest) in enumerate(ops) if op == "RUN"
                for cmd in rest.split("&&") if re.search(r"\bpip install\b", cmd)]
    from_lock = [i for i, cmd in installs if "--require-hashes" in cmd.split()
                 and "--no-deps" in cmd.split() and f"-r {lock_file}" in " ".join(cmd.split())]
    assert copied and from_lock and copied[0] < from_lock[0], installs
    # Anything else pip installs is the project, with no index to fetch from and no isolated
    # build environment (whose setuptools would come unhashed from the index).
    for i, cmd in installs:
        if i not in from_lock:
            assert {"--no-index", "--no-build-isolation"} <= set(cmd.split()), cmd
            assert i > from_lock[0], cmd


@pytest.mark.parametrize("image", IMAGES)
def test_image_context_holds_its_lock(image):
    tar = subprocess.run(["make", "-s", f"{image}-context"], cwd=REPO, capture_output=True,
                         timeout=60, check=True).stdout
    names = tarfile.open(fileobj=io.BytesIO(tar)).getnames()
    other = next(i for i in IMAGES if i != image)
    assert f"requirements/{image}.txt" in names and f"requirements/{other}.txt" not in names


def test_locks_name_the_command_and_uv_version_that_made_them():
    makefile = (REPO / "Makefile").read_text()
    uv_version = re.search(r"^UV_VERSION := (\S+)$", makefile, re.M).group(1)
    assert "--python-version 3.12 --python-platform x86_64-manylinux_2_28 --only-binary :all:" \
        in makefile
    for image in IMAGES:
        header = LOCKS[image].read_text().split("\n", 3)[:3]
        assert header[0].startswith(f"# Generated by `make requirements` (uv {uv_version})")
        assert header[2].split() == [
            "#", "uv", "pip", "compile", "pyproject.toml", "requirements/build.in", "--extra", image,
            "--generate-hashes", "--python-version", "3.12", "--python-platform",
            "x86_64-manylinux_2_28", "--only-binary", ":all:", "-o", f"requirements/{image}.txt"]


@pytest.fixture()
def release_tree(tmp_path):
    """The Makefile's image targets in a scratch tree, with a `docker` that only logs its calls."""
    tree = tmp_path / "tree"
    tree.mkdir()
    for name in ("Makefile", "pyproject.toml", "setup.py", "README.md", "api", "requirements"):
        (tree / name).symlink_to(REPO / name)
    for image in IMAGES:
        (tree / image).mkdir()
        (tree / image / "Dockerfile").write_text(DOCKERFILES[image].read_text())
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text(f'#!/bin/sh\ncat >/dev/null\necho "$*" >> {tmp_path}/docker.log\n')
    (bin_dir / "docker").chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "ALLOW_UNPINNED_BASE", "REGISTRY")}
    env["PATH"] = f"{bin_dir}:{env['PATH']}"

    def make(*args):
        log = tmp_path / "docker.log"
        log.unlink(missing_ok=True)
        run = subprocess.run(["make", *args], cwd=tree, env=env, capture_output=True, text=True,
                             timeout=60)
        return run, (log.read_text().splitlines() if log.exists() else [])

    return tree, make


def test_images_push_refuses_bases_without_a_digest(release_tree):
    tree, make = release_tree
    run, docker = make("images-push")
    assert run.returncode != 0 and docker == [], run.stdout
    assert "not by digest" in run.stderr and "crane digest" in run.stderr, run.stderr
    assert "python:3.12.13-slim-bookworm" in run.stderr and "nvidia/cuda:" in run.stderr

    run, docker = make("images")  # local builds are not releases
    assert run.returncode == 0 and "digest" not in run.stderr, run.stderr
    assert [c.split()[0] for c in docker] == ["build", "build"]

    run, docker = make("images-push", "ALLOW_UNPINNED_BASE=1")
    assert run.returncode == 0 and "WARNING" in run.stderr, run.stderr
    assert [c.split()[0] for c in docker] == ["build", "build", "push", "push"]

    for image in IMAGES:  # a scratch digest, never a real one
        path = tree / image / "Dockerfile"
        path.write_text(re.sub(r"^(ARG (?:PYTHON|CUDA)_IMAGE=\S+)$", r"\1@sha256:" + "0" * 64,
                               path.read_text(), flags=re.M))
    run, docker = make("images-push")
    assert run.returncode == 0 and "digest" not in run.stderr, run.stderr
    assert [c.split()[0] for c in docker] == ["build", "build", "push", "push"]
