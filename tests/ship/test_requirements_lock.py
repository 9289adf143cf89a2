"""The images' hash-locked dependencies (requirements/<image>.txt, `make requirements`), offline.

Each image installs only what its lock names, with `pip install --require-hashes --no-deps`, so a
package re-uploaded or swapped on the index cannot get in. One lock per image serves every Python
the images run (IMAGE_PYTHONS: 3.12 on the public bases, 3.11 on the local Debian 12 base): uv
resolves it universally, and a pin that differs between them carries a marker pip evaluates.
Checked here without the network, for each of those Pythons: the locks agree with pyproject.toml
(every pin of the base dependencies and of the image's extra, at the same version: a pin bumped
without `make requirements` fails), exactly one pin of each package applies, every requirement
carries a sha256 hash, the dependencies of locked packages this checkout's venv has at the locked
version are locked too (torch's nvidia-* CUDA wheels for the trainer), the Dockerfiles install the
lock that way and nothing from an index otherwise, the image contexts carry their lock, and
`make images-push` refuses bases pinned by tag only and the local base. Whether every locked
wheel downloads and matches its hash is what an image build proves (`make images`;
tests/ship/test_built_images.py checks images built on the local base).
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
# The images' Pythons, Linux x86_64: CPython 3.12 on the public bases (python:3.12 slim; Ubuntu
# 24.04's python3), 3.11 on the local base (Debian 12's python3, e2e/images/base.sh).
PYTHONS = {"3.11": "3.11.2", "3.12": "3.12.13"}
TARGETS = {short: {"os_name": "posix", "sys_platform": "linux", "platform_system": "Linux",
                   "platform_machine": "x86_64", "platform_python_implementation": "CPython",
                   "implementation_name": "cpython", "python_version": short,
                   "python_full_version": full, "implementation_version": full}
           for short, full in PYTHONS.items()}
TARGET = TARGETS["3.12"]
HASH = re.compile(r"--hash=sha256:[0-9a-f]{64}")
LINE = re.compile(r"(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)==(?P<version>[^\s;@]+)"
                  r"(?:\s*;\s*(?P<marker>[^-][^\n]*?))?(?P<hashes>(?:\s+--hash=\S+)*)\s*")


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def applies(req: Requirement, extras=("",), target=TARGET) -> bool:
    return req.marker is None or any(req.marker.evaluate({**target, "extra": e}) for e in extras)


def wanted(project: dict, image: str, target=TARGET) -> list[Requirement]:
    """What the image's lock must satisfy: base dependencies, the image's extra, the backend."""
    reqs = [Requirement(r) for r in project["project"]["dependencies"]
            + project["project"]["optional-dependencies"][image]
            + project["build-system"]["requires"]]
    return [r for r in reqs if applies(r, target=target)]


def requirement_lines(path: Path) -> list[str]:
    """The lock's logical lines (continuations joined), comments and blank lines dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    return [line.split(" #")[0].strip() for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def pins(image: str) -> list[tuple[str, Version, Marker | None]]:
    """Every pin of the lock: (name, version, marker or None)."""
    out = []
    for line in requirement_lines(LOCKS[image]):
        mo = LINE.fullmatch(line)
        assert mo, line
        marker = Marker(mo["marker"]) if mo["marker"] else None
        out.append((canonicalize_name(mo["name"]), Version(mo["version"]), marker))
    return out


def lock(image: str, target=TARGET) -> dict[str, Version]:
    """What pip installs from the lock on `target`: the pins whose marker holds there."""
    out = {}
    for name, version, marker in pins(image):
        if marker is None or marker.evaluate(target):
            assert name not in out, f"two pins of {name} apply to Python {target['python_version']}"
            out[name] = version
    return out


def mismatches(requirements: list[Requirement], locked: dict[str, Version]) -> list[str]:
    return [f"{r} (lock: {locked.get(canonicalize_name(r.name), 'missing')})" for r in requirements
            if not r.specifier.contains(locked.get(canonicalize_name(r.name), Version("0.0.0a0")),
                                        prereleases=True)
            or canonicalize_name(r.name) not in locked]


@pytest.mark.parametrize("python", TARGETS)
@pytest.mark.parametrize("image", IMAGES)
def test_every_pin_of_the_image_is_locked_at_its_version(image, python):
    project = pyproject()
    target = TARGETS[python]
    pinned = [r for r in wanted(project, image, target)
              if any(s.operator == "==" for s in r.specifier)]
    assert len(pinned) >= len(project["project"]["dependencies"]) + 3, pinned
    assert mismatches(wanted(project, image, target), lock(image, target)) == [], \
        f"requirements/{image}.txt is stale: run `make requirements`"


@pytest.mark.parametrize("image", IMAGES)
def test_one_lock_serves_every_image_python(image):
    """Each package has exactly one pin per Python (lock() asserts it); pins that differ between
    the Pythons carry python_* markers; none is left out on any of them."""
    locks = {python: lock(image, target) for python, target in TARGETS.items()}
    names = {n for locked in locks.values() for n in locked}
    for name in names:
        versions = {python: locked.get(name) for python, locked in locks.items()}
        assert None not in versions.values(), (name, versions)
    for name, _, marker in pins(image):
        if len([n for n, _, _ in pins(image) if n == name]) > 1:
            assert marker is not None and "python_" in str(marker), (name, marker)


def test_a_bumped_pin_is_caught():
    project = pyproject()
    project["project"]["optional-dependencies"]["operator"] = [
        re.sub(r"^kopf==.*", "kopf==99.0.0", r)
        for r in project["project"]["optional-dependencies"]["operator"]]
    assert mismatches(wanted(project, "operator"), lock("operator")) == [
        f"kopf==99.0.0 (lock: {lock('operator')['kopf']})"]
    # A pin the lock has only for another Python is missing on this one.
    multi = {n for n, _, m in pins("trainer") if m is not None and "python_" in str(m)}
    name = sorted(multi)[0] if multi else None
    if name:
        newest = lock("trainer", TARGETS["3.12"])[name]
        assert lock("trainer", TARGETS["3.11"])[name] != newest
        assert mismatches([Requirement(f"{name}=={newest}")], lock("trainer", TARGETS["3.11"]))
    project["project"]["dependencies"].append("left-pad==1.0")
    assert "left-pad==1.0 (lock: missing)" in mismatches(wanted(project, "operator"),
                                                         lock("operator"))


@pytest.mark.parametrize("image", IMAGES)
def test_every_locked_requirement_is_pinned_and_hashed(image):
    lines = requirement_lines(LOCKS[image])
    assert len(lines) >= 20, lines
    for line in lines:
        mo = LINE.fullmatch(line)
        assert mo, line
        if mo["marker"]:
            Marker(mo["marker"])  # a valid PEP 508 marker
        options = mo["hashes"].split()
        assert options and all(HASH.fullmatch(o) for o in options), line


def test_the_build_backend_is_the_projects_and_is_locked():
    build_in = [line for line in BUILD_IN.read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    assert build_in == pyproject()["build-system"]["requires"]
    for image in IMAGES:
        assert {"setuptools", "wheel"} <= set(lock(image)), image


@pytest.mark.parametrize("python", TARGETS)
def test_the_operator_lock_has_no_torch_and_the_trainers_has_its_cuda_wheels(python):
    assert not [n for n, _, _ in pins("operator")
                if n in ("torch", "triton") or n.startswith("nvidia-")]
    trainer = lock("trainer", TARGETS[python])
    assert {"torch", "triton", "nvidia-cudnn-cu13", "nvidia-nccl-cu13"} <= set(trainer)
    assert len([n for n in trainer if n.startswith("nvidia-")]) >= 10


@pytest.mark.parametrize("python", TARGETS)
@pytest.mark.parametrize("image", IMAGES)
def test_locked_packages_have_their_dependencies_locked(image, python):
    """The lock is closed under dependencies, as far as this venv's metadata shows: a package it
    has at the version locked for `python` has each of its Linux requirements on that Python (with
    their extras) locked at a version that satisfies it. The image build's `pip check` and
    `--no-index` repeat this."""
    target = TARGETS[python]
    locked = lock(image, target)
    todo = [(canonicalize_name(r.name), frozenset(r.extras))
            for r in wanted(pyproject(), image, target)]
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
            if not applies(req, ("", *extras), target):
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
    """Resolved universally from the project's lowest Python, then checked on each image Python
    for Linux x86_64 (the wheels the images install)."""
    makefile = (REPO / "Makefile").read_text()
    uv_version = re.search(r"^UV_VERSION := (\S+)$", makefile, re.M).group(1)
    lock_python = re.search(r"^LOCK_PYTHON := (\S+)$", makefile, re.M).group(1)
    image_pythons = re.search(r"^IMAGE_PYTHONS := (.+)$", makefile, re.M).group(1).split()
    floor = re.fullmatch(r">=\s*(\d+\.\d+)", pyproject()["project"]["requires-python"]).group(1)
    assert lock_python == floor == min(image_pythons, key=Version)
    assert sorted(image_pythons, key=Version) == sorted(TARGETS, key=Version)
    assert "--universal --python-version $(LOCK_PYTHON) --only-binary :all:" in makefile
    assert ("--python-version $$py --python-platform x86_64-manylinux_2_28 --only-binary :all: "
            "\\\n\t      -c requirements/$$image.txt") in makefile
    for image in IMAGES:
        header = LOCKS[image].read_text().split("\n", 3)[:3]
        assert header[0].startswith(f"# Generated by `make requirements` (uv {uv_version})")
        assert header[2].split() == [
            "#", "uv", "pip", "compile", "pyproject.toml", "requirements/build.in", "--extra", image,
            "--generate-hashes", "--universal", "--python-version", lock_python,
            "--only-binary", ":all:", "-o", f"requirements/{image}.txt"]


LOCAL = "crucible-base/debian-python:bookworm"


@pytest.fixture()
def release_tree(tmp_path):
    """The Makefile's image targets in a scratch tree, with a `docker` that only logs its calls;
    `docker image inspect` finds only the images make(..., present=[...]) names."""
    tree = tmp_path / "tree"
    tree.mkdir()
    for name in ("Makefile", "pyproject.toml", "setup.py", "README.md", "api", "requirements"):
        (tree / name).symlink_to(REPO / name)
    for image in IMAGES:
        (tree / image).mkdir()
        (tree / image / "Dockerfile").write_text(DOCKERFILES[image].read_text())
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text(
        f'#!/bin/sh\necho "$*" >> {tmp_path}/docker.log\n'
        'if [ "$1 $2" = "image inspect" ]; then\n'
        '  case " $FAKE_PRESENT " in *" $3 "*) exit 0 ;; *) exit 1 ;; esac\n'
        'fi\ncat >/dev/null\n')
    (bin_dir / "docker").chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "ALLOW_UNPINNED_BASE", "REGISTRY",
                        "BASE", "BASE_SUITE", "LOCAL_BASE", "DOCKER_BUILD_ARGS")}
    env["PATH"] = f"{bin_dir}:{env['PATH']}"

    def make(*args, present=()):
        log = tmp_path / "docker.log"
        log.unlink(missing_ok=True)
        run = subprocess.run(["make", *args], cwd=tree, env={**env, "FAKE_PRESENT": " ".join(present)},
                             capture_output=True, text=True, timeout=60)
        calls = log.read_text().splitlines() if log.exists() else []
        return run, [c for c in calls if not c.startswith("image inspect ")]

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
    assert "PYTHON_IMAGE=python:3.12.13-slim-bookworm@sha256:" in docker[0], docker

    # A release never builds on the local base: BASE=auto means public there, BASE=local fails.
    run, docker = make("images-push", present=[LOCAL])
    assert run.returncode == 0 and "PYTHON_IMAGE=python:3.12.13" in docker[0], docker
    run, docker = make("images-push", "BASE=local")
    assert run.returncode != 0 and docker == [] and "refuses BASE=local" in run.stderr, run.stderr


def test_images_base_choice(release_tree):
    """BASE=public|local|auto picks each image's base: the public one pinned in its Dockerfile,
    or the Debian base made on this machine (e2e/images/base.sh); auto takes the public one when
    it is in the image store, else the local one when that is, else the public one (a pull)."""
    tree, make = release_tree
    public = {image: re.search(r"^ARG (?:PYTHON|CUDA)_IMAGE=(\S+)$",
                               DOCKERFILES[image].read_text(), re.M).group(1) for image in IMAGES}

    def bases(docker):
        assert [c.split()[0] for c in docker] == ["build", "build"], docker
        return [re.search(r"--build-arg (?:PYTHON|CUDA)_IMAGE=(\S+)", c).group(1) for c in docker]

    trixie = "crucible-base/debian-python:trixie"
    for args, present, want in [
            (["BASE=public"], [LOCAL], [public["operator"], public["trainer"]]),
            (["BASE=local"], [], [LOCAL, LOCAL]),
            ([], [], [public["operator"], public["trainer"]]),  # auto, nothing here: pull
            ([], [LOCAL], [LOCAL, LOCAL]),
            ([], [LOCAL, public["operator"]], [public["operator"], LOCAL]),
            (["BASE_SUITE=trixie"], [trixie], [trixie, trixie])]:
        run, docker = make("images", *args, present=present)
        assert run.returncode == 0, run.stderr
        assert bases(docker) == want, (args, present, docker)
        assert f"on {want[0]}" in run.stdout, run.stdout  # the build says which base
    run, docker = make("images", "BASE=nope")
    assert run.returncode != 0 and "use public, local or auto" in run.stderr and docker == []
