"""The planes meet only in `crucible.api`: the import graph, and what each image is built from.

`operator/` may import `crucible.api` and `crucible.operator`, never `crucible.trainer`;
`trainer/` never imports `crucible.operator`; `api/` imports neither plane and nothing heavy
(no torch, kopf or Kubernetes client). Read from the source with `ast`, so an import hidden
inside a function counts too. Then the operator image's build context (`make -s
operator-context`, exactly what `make images` streams to docker) is unpacked, built into a
wheel and imported in an interpreter that cannot see the checkout: the operator runs with no
trainer code at all.
"""

from __future__ import annotations

import ast
import io
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FOLDERS = {"api": "crucible.api", "operator": "crucible.operator", "trainer": "crucible.trainer"}
# What each plane's source may import from crucible.*
ALLOWED = {"api": {"crucible.api"}, "operator": {"crucible.api", "crucible.operator"},
           "trainer": {"crucible.api", "crucible.trainer"}}
API_THIRD_PARTY = {"pydantic", "yaml"}  # api/ may use these besides the standard library


def imports_of(path: Path, package: str) -> set[str]:
    """Absolute names of every module `path` imports (relative imports resolved)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            found.add(base)
            # `from crucible.api import arch` imports the module crucible.api.arch
            found |= {f"{base}.{alias.name}" for alias in node.names}
    return found


def sources(folder: str) -> list[tuple[Path, str]]:
    root = REPO / folder
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).with_suffix("")
        parts = [FOLDERS[folder], *rel.parts[:-1]]
        out.append((path, ".".join(parts)))  # the package the module lives in
    return out


def crucible_imports(folder: str) -> dict[str, set[str]]:
    return {str(path.relative_to(REPO)): {name for name in imports_of(path, package)
                                          if name.startswith("crucible.")}
            for path, package in sources(folder)}


@pytest.mark.parametrize("folder", sorted(FOLDERS))
def test_each_plane_imports_only_itself_and_the_api(folder):
    assert sources(folder), f"no sources under {folder}/"
    bad = {module: sorted(name for name in names
                          if not any(name == ok or name.startswith(ok + ".")
                                     for ok in ALLOWED[folder]))
           for module, names in crucible_imports(folder).items()}
    assert not {k: v for k, v in bad.items() if v}, bad


def test_the_checker_sees_a_forbidden_import(tmp_path):
    # The test above must be able to fail: a function-local import of the other plane is found.
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from crucible.trainer import loop\n    from .. import x\n")
    names = imports_of(probe, "crucible.operator")
    assert {"crucible.trainer", "crucible.trainer.loop", "crucible.x"} <= names


def test_api_imports_nothing_heavy():
    stdlib = set(sys.stdlib_module_names)
    for path, package in sources("api"):
        tops = {name.split(".")[0] for name in imports_of(path, package) if name}
        assert tops <= stdlib | API_THIRD_PARTY | {"crucible"}, (path.name, tops)


def _operator_context() -> tarfile.TarFile:
    tar = subprocess.run(["make", "-s", "operator-context"], cwd=REPO, capture_output=True,
                         timeout=60, check=True).stdout
    return tarfile.open(fileobj=io.BytesIO(tar))


def test_operator_image_context_holds_no_trainer_code():
    names = _operator_context().getnames()
    assert {"pyproject.toml", "setup.py", "api/spec.py", "operator/handlers.py"} <= set(names)
    assert not [n for n in names if n == "trainer" or n.startswith("trainer/")]
    dockerfile = (REPO / "operator" / "Dockerfile").read_text()
    assert "COPY api/ api/" in dockerfile and "trainer/" not in dockerfile.split("FROM")[1]


def test_operator_runs_from_its_image_context_alone(tmp_path):
    """Build the wheel the operator image installs, from its context, and import the operator
    from it in an interpreter that sees no checkout and no editable install (-S: no site)."""
    context = tmp_path / "context"
    _operator_context().extractall(context, filter="data")
    wheels = tmp_path / "wheels"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                            "--no-build-isolation", "-q", "-w", str(wheels), str(context)],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = wheels.glob("crucible-*.whl")
    members = zipfile.ZipFile(wheel).namelist()
    assert any(m.startswith("crucible/api/") for m in members)
    assert any(m.startswith("crucible/operator/") for m in members)
    assert not any(m.startswith("crucible/trainer/") for m in members)
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    probe = ("import sys, importlib.util\n"
             f"sys.path[:0] = [{str(site)!r}, {sysconfig.get_paths()['purelib']!r}]\n"
             "import crucible.operator.handlers, crucible.operator.main\n"
             "assert crucible.operator.handlers.__file__.startswith(sys.path[0])\n"
             "assert importlib.util.find_spec('crucible.trainer') is None\n"
             "assert 'torch' not in sys.modules\n"
             "print(crucible.operator.crd.render()[:40])\n")
    run = subprocess.run([sys.executable, "-S", "-c", probe], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Generated by" in run.stdout
