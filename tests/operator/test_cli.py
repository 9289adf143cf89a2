"""`crucible-operator`: its commands, and that the operator never needs torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from crucible.operator import crd, main, rbac

REPO = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=REPO,
                          timeout=120)


def test_crd_and_rbac_commands_print_the_committed_manifests(capsys):
    assert main.main(["crd"]) == 0
    assert capsys.readouterr().out == crd.render()
    assert main.main(["rbac"]) == 0
    assert capsys.readouterr().out == rbac.render()


def test_run_help_names_the_scope_options():
    out = _run("-m", "crucible.operator.main", "run", "--help")
    assert out.returncode == 0, out.stderr
    for flag in ("--namespace", "--all-namespaces", "--interval", "--metrics-port", "--liveness"):
        assert flag in out.stdout


def test_bad_options_are_one_line_errors():
    out = _run("-m", "crucible.operator.main", "run", "--interval", "0")
    assert out.returncode == 2 and "--interval must be > 0" in out.stderr
    out = _run("-m", "crucible.operator.main", "run", "-n", "a", "-A")
    assert out.returncode == 2 and "not allowed with" in out.stderr


def test_the_operator_imports_no_torch():
    # The operator image has no torch (pyproject's `operator` extra).
    probe = ("import sys, crucible.operator.handlers, crucible.operator.main; "
             "sys.exit('torch' in sys.modules)")
    out = _run("-c", probe)
    assert out.returncode == 0, "crucible.operator imports torch"


def test_the_login_token_is_read_whatever_the_case_of_its_scheme():
    """In a pod the kubernetes client writes "bearer <jwt>" (load_incluster_config), from a
    kubeconfig "Bearer <jwt>": either way kopf must get the bare token, or every call is 401."""
    from crucible.operator.apiclient import bearer_token

    assert bearer_token("bearer eyJ.a.b") == "eyJ.a.b"
    assert bearer_token("Bearer eyJ.a.b") == "eyJ.a.b"
    assert bearer_token("BEARER  eyJ.a.b ") == "eyJ.a.b"
    assert bearer_token("") is None


def test_no_kueue_registers_no_watch_on_kueues_objects_and_reaches_the_policy():
    probe = ("import os, sys, kopf; from crucible.operator import handlers\n"
             "plurals = {h.selector.any_name for h in "
             "kopf.get_default_registry()._indexing.get_all_handlers()}\n"
             "print(sorted(p for p in plurals if p in ('workloads', 'localqueues', "
             "'resourceflavors', 'workloadpriorityclasses')),\n"
             "      handlers.OperatorConfig.from_env().cluster_policy.kueue)\n")
    on = _run("-c", probe)
    assert on.returncode == 0, on.stderr
    assert on.stdout.split() == ["['localqueues',", "'resourceflavors',",
                                 "'workloadpriorityclasses',", "'workloads']", "True"]
    off = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO,
                         timeout=120, env={**__import__("os").environ,
                                           "CRUCIBLE_OPERATOR_KUEUE": "off"})
    assert off.returncode == 0, off.stderr
    assert off.stdout.split() == ["[]", "False"]
    assert "--no-kueue" in _run("-m", "crucible.operator.main", "run", "--help").stdout
