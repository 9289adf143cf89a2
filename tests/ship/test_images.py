"""The Dockerfiles, linted without a Docker engine.

What a build also proves (that pip installs the locks, that the images start read-only as UID 1000,
that the trainer can compile) is tests/ship/test_built_images.py's, where a Docker engine answers
and `make images` has run (e2e/kind/run.sh builds both). Checked here: pinned bases, a numeric
non-root USER in the final stage, the torch pin equal to pyproject.toml's and the CUDA base
equal to the CUDA of that wheel, no torch in the operator image, nothing secret in the
instructions or the build context.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from crucible.operator import manifests as m
from tests.support.repo import REPO

DOCKERFILES = {"operator": REPO / "operator" / "Dockerfile",
               "trainer": REPO / "trainer" / "Dockerfile"}
SECRETISH = re.compile(r"(KEY|SECRET|TOKEN|PASSWORD|PASSWD|CREDENTIAL)", re.I)


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(line for line in path.read_text().splitlines()
                                         if not line.lstrip().startswith("#")))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line.strip() else "")
            for line in text.splitlines() if line.strip()]


def resolve(value: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{?(\w+)\}?", lambda mo: args.get(mo.group(1), mo.group(0)), value)


def stages(path: Path) -> list[dict]:
    args, out = {}, []
    for op, rest in instructions(path):
        if op == "ARG" and "=" in rest and not out:
            key, value = rest.split("=", 1)
            args[key] = value
        elif op == "FROM":
            image = resolve(rest.split()[0], args)
            out.append({"from": image, "ops": []})
        elif out:
            out[-1]["ops"].append((op, rest))
    return out


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


@pytest.mark.parametrize("name", DOCKERFILES)
def test_bases_are_pinned_and_the_final_stage_runs_as_uid_1000(name):
    built = stages(DOCKERFILES[name])
    for stage in built:
        image = stage["from"]
        if image in ("build",):
            continue
        repo, _, tag = image.partition(":")
        assert tag and tag != "latest" and re.match(r"\d+\.\d+\.\d+-", tag), image
    users = [rest for op, rest in built[-1]["ops"] if op == "USER"]
    assert users, "the final stage sets no USER"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) == m.RUN_UID != 0, users[-1]


def test_trainer_image_pins_the_projects_torch_on_the_matching_cuda_base():
    torch_pin = next(d for d in pyproject()["project"]["optional-dependencies"]["trainer"]
                     if d.startswith("torch=="))
    text = DOCKERFILES["trainer"].read_text()
    assert f"ARG TORCH_VERSION={torch_pin.removeprefix('torch==')}" in text
    assert '--no-build-isolation ".[trainer]"' in text  # the lock: test_requirements_lock.py
    # The CUDA of the installed wheel (the same pin from PyPI) is the base image's CUDA.
    import importlib.util

    version_py = Path(importlib.util.find_spec("torch").origin).parent / "version.py"
    cuda = re.search(r"^cuda(?::[^=]+)?\s*=\s*'([\d.]+)'", version_py.read_text(), re.M).group(1)
    base = stages(DOCKERFILES["trainer"])[-1]["from"]
    assert base.startswith(f"nvidia/cuda:{cuda}."), (base, cuda)


def test_trainer_runtime_stage_can_compile():
    """training.compile needs C and C++ compilers (Inductor's CPU code is C++) and Python's
    headers where the trainer runs. tests/ship/test_built_images.py compiles in the built image."""
    final = stages(DOCKERFILES["trainer"])[-1]
    installs = " ".join(rest for op, rest in final["ops"] if op == "RUN")
    assert all(f" {pkg} " in f"{installs} " for pkg in ("python3-dev", "gcc", "g++", "libc6-dev")), \
        installs


def test_operator_image_has_no_torch():
    extras = pyproject()["project"]["optional-dependencies"]
    assert not [d for d in extras["operator"] + pyproject()["project"]["dependencies"]
                if d.lower().startswith("torch")]
    text = DOCKERFILES["operator"].read_text()
    assert '--no-build-isolation ".[operator]"' in text and "[trainer]" not in text
    assert "find_spec('torch') is not None" in text  # the build fails if torch sneaks in


@pytest.mark.parametrize("name", DOCKERFILES)
def test_no_secrets_in_instructions_or_context(name):
    for op, rest in instructions(DOCKERFILES[name]):
        if op in ("ENV", "ARG", "LABEL"):
            assert not SECRETISH.search(rest), (op, rest)
        if op in ("COPY", "ADD"):
            sources = [s for s in rest.split()[:-1] if not s.startswith("--")]
            assert sources and all(s.rstrip("/") in ("pyproject.toml", "setup.py", "README.md",
                                                     "api", "operator", "trainer",
                                                     f"requirements/{name}.txt", "/opt/crucible")
                                   for s in sources), rest
        assert op != "ADD", "COPY, not ADD (no remote URLs, no auto-extraction)"
    ignore = (REPO / ".dockerignore").read_text().splitlines()
    assert "**" in ignore and not [
        line for line in ignore if line.startswith("!") and line.lstrip("!").rstrip("/") not in
        ("pyproject.toml", "setup.py", "README.md", "requirements", "api", "operator", "trainer")]
