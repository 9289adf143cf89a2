"""The distribution's shape: import names, console scripts, and the stdlib `operator` module.

`operator/` is the source folder of `crucible.operator`. With the repository root on sys.path
(as under `python -m pytest` or `python -m ...` from the root), a top-level package named
`operator` there would shadow the standard library module that torch imports. These tests run
real interpreters from the repository root to prove it does not.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STDLIB = Path(sysconfig.get_paths()["stdlib"]).resolve()


def _python(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True,
                          env=env, timeout=120)


def test_operator_in_this_pytest_process_is_the_stdlib_module():
    import operator

    assert Path(operator.__file__).resolve().parent == STDLIB
    assert operator.itemgetter(1)([5, 6]) == 6


def test_operator_from_repo_root_is_stdlib_even_without_site():
    # -S skips site.py, so nothing has imported `operator` before the script asks for it; the
    # empty entry on sys.path is the repository root, where operator/ lives.
    probe = ("import sys; sys.path.insert(0, ''); import operator; "
             "print(operator.__file__); print(operator.add(2, 3))")
    for flags in ([], ["-S"]):
        out = _python(*flags, "-c", probe)
        assert out.returncode == 0, out.stderr
        path, total = out.stdout.split()
        assert Path(path).resolve().parent == STDLIB, (flags, path)
        assert total == "5"


def test_torch_imports_from_repo_root():
    out = _python("-c", "import torch, operator; print(torch.__version__, operator.__file__)")
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.split()[1]).resolve().parent == STDLIB


def test_import_names_map_to_source_folders():
    import crucible.operator.main as op_main
    import crucible.trainer as trainer

    assert Path(op_main.__file__).resolve().parent == REPO / "operator"
    assert Path(trainer.__file__).resolve().parent == REPO / "trainer"
    assert not (REPO / "operator" / "__init__.py").exists()


def _script(name: str) -> str:
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    assert found, f"console script {name} is not installed"
    return found


def test_console_scripts_answer_help():
    for name, expected in (("crucible", "usage: crucible"),
                           ("crucible-operator", "usage: crucible-operator")):
        out = subprocess.run([_script(name), "--help"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith(expected)


def test_crucible_help_does_not_import_torch():
    # The operator image has no torch; `crucible --help` must not need it either.
    probe = ("import sys, runpy; sys.argv = ['crucible', '--help']\n"
             "from crucible.trainer import cli\n"
             "try:\n    cli.main()\nexcept SystemExit:\n    pass\n"
             "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')")
    out = _python("-c", probe)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("NO-TORCH")
