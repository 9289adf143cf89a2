"""The operator's permissions are exactly what its code calls: nothing granted goes unused, and
nothing it calls is missing.

"What the code calls" is read from the source: every Kubernetes client method the operator's
modules name (`create_namespaced_pod` -> create pods, ...), every kind its kopf handlers watch
(`@kopf.index`, the daemon), and the few calls kopf makes on its own, declared below with why.
That set is compared with rbac.RULES, and with what the real apiserver says the operator's
ServiceAccount may do (`kubectl auth can-i --list`).
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
from pathlib import Path

import pytest

from crucible.operator import crd, queueing, rbac
from crucible.operator.handlers import CHILD_KINDS, KUEUE_INDEXES

OPERATOR = Path(__file__).resolve().parents[2] / "operator"
JOBS, JOB_STATUS = f"{crd.PLURAL}.{crd.GROUP}", f"{crd.PLURAL}.{crd.GROUP}/status"

# Client method name (less verb and "namespaced_") -> resource as RBAC names it (plural.group).
KINDS = {"pod": "pods", "service": "services", "config_map": "configmaps",
         "service_account": "serviceaccounts", "lease": "leases.coordination.k8s.io",
         "role": "roles.rbac.authorization.k8s.io",
         "role_binding": "rolebindings.rbac.authorization.k8s.io",
         "network_policy": "networkpolicies.networking.k8s.io", "event": "events",
         "node": "nodes", "custom_object": JOBS, "custom_object_status": JOB_STATUS}
VERBS = {"create": "create", "read": "get", "get": "get", "list": "list", "patch": "patch",
         "delete": "delete", "replace": "update"}
CALL = re.compile(r"^(create|read|get|list|patch|delete|replace)_(namespaced_)?([a-z_]+)$")
# Calls kopf itself makes for the handlers it runs (kopf docs/configuration.rst, "Persistence";
# kopf's cluster-wide discovery in kopf/_cogs/clients/scanning.py).
KOPF = {(JOBS, "patch"): "the finalizer and kopf's progress annotations on each job",
        ("namespaces", "list"): "which namespaces to serve",
        ("namespaces", "watch"): "which namespaces to serve",
        ("customresourcedefinitions.apiextensions.k8s.io", "list"): "resource discovery",
        ("customresourcedefinitions.apiextensions.k8s.io", "watch"): "resource discovery"}
# What no call names but an admission plugin checks on the calls the code makes: the
# OwnerReferencesPermissionEnforcement plugin lets an ownerReference with blockOwnerDeletion
# (every child's, manifests.owner_reference) be set only by who may update the owner's
# finalizers (kubernetes plugin/pkg/admission/gc).
ADMISSION = {(f"{JOBS}/finalizers", "update"): "blockOwnerDeletion on every child"}


# Modules that run under another identity: the chart's uninstall hook has its own
# ServiceAccount and rights (tests/ship/test_chart.py checks them).
NOT_THE_OPERATORS = {"uninstall.py"}


def _resource(group: str, plural: str) -> str:
    return plural if group in ("", "v1") else f"{plural}.{group}"


def code_calls() -> dict[tuple[str, str], str]:
    """(resource, verb) -> where the code makes that call."""
    found: dict[tuple[str, str], str] = {}
    for path in sorted(OPERATOR.glob("*.py")):
        if path.name in NOT_THE_OPERATORS:
            continue
        tree = ast.parse(path.read_text())
        custom = _custom_object_calls(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and (match := CALL.match(node.attr)):
                verb, namespaced, kind = match.groups()
                if id(node) in custom:       # a custom resource: its group names which
                    found.setdefault((custom[id(node)], VERBS[verb]), f"{path.name}: {node.attr}")
                    continue
                if kind not in KINDS:
                    assert not namespaced, f"{path.name}: {node.attr}: add its kind to KINDS"
                    continue
                found.setdefault((KINDS[kind], VERBS[verb]), f"{path.name}: {node.attr}")
            if isinstance(node, ast.Call) and _is_kopf(node.func, ("index", "daemon")):
                args = [_value(a) for a in node.args]
                if None in args:           # the loop over CHILD_KINDS: counted below
                    continue
                group, plural = args[0], args[-1]
                for verb in ("list", "watch"):
                    found.setdefault((_resource(group, plural), verb),
                                     f"{path.name}: kopf.{node.func.attr}({plural})")
    for _, (group, plural) in CHILD_KINDS:     # indexed in a loop, not by a decorator
        for verb in ("list", "watch"):
            found.setdefault((_resource(group, plural), verb), "handlers.py: CHILD_KINDS")
    for plural, _, _ in KUEUE_INDEXES:          # the same, unless the operator runs --no-kueue
        for verb in ("list", "watch"):
            found.setdefault((_resource(queueing.GROUP, plural), verb),
                             "handlers.py: KUEUE_INDEXES")
    for key, why in KOPF.items():
        found.setdefault(key, f"kopf: {why}")
    for key, why in ADMISSION.items():
        found.setdefault(key, f"admission: {why}")
    return found


def _custom_object_calls(tree) -> dict[int, str]:
    """id(the method attribute) -> resource, for each `*_custom_object[_status]` call: its first
    arguments name the group and the plural (`crd.GROUP, ..., crd.PLURAL` or Kueue's)."""
    out = {}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr.endswith(("_custom_object", "_custom_object_status"))):
            continue
        group, plural = _value(node.args[0]), _value(node.args[3])
        assert group and plural, f"{node.func.attr}: group and plural must be named constants"
        status = "/status" if node.func.attr.endswith("_status") else ""
        out[id(node.func)] = _resource(group, plural) + status
    return out


# Modules whose constants name the resources the operator calls (decorators, custom objects).
CONSTANTS = {"crd": crd, "queueing": queueing}


def _value(arg: ast.expr):
    """A decorator or call argument: a literal, or `crd.NAME` (`queueing.NAME`); None for
    anything else."""
    if isinstance(arg, ast.Constant):
        return arg.value
    if (isinstance(arg, ast.Attribute) and isinstance(arg.value, ast.Name)
            and arg.value.id in CONSTANTS):
        return getattr(CONSTANTS[arg.value.id], arg.attr)
    return None


def _is_kopf(func, names) -> bool:
    return (isinstance(func, ast.Attribute) and func.attr in names
            and isinstance(func.value, ast.Name) and func.value.id == "kopf")


def granted() -> set[tuple[str, str]]:
    return {(_resource(group, resource.split("/")[0]) + ("/" + resource.split("/")[1]
             if "/" in resource else ""), verb)
            for groups, resources, verbs, _ in rbac.RULES
            for group in groups for resource in resources for verb in verbs}


def test_the_rules_grant_exactly_what_the_code_calls():
    calls = code_calls()
    unused = sorted(granted() - set(calls))
    missing = sorted(set(calls) - granted())
    assert not unused, f"granted but never called (drop them from rbac.RULES): {unused}"
    assert not missing, ("called but not granted: " +
                         "; ".join(f"{r} {v} ({calls[r, v]})" for r, v in missing))


def test_the_scan_sees_the_calls_that_matter():
    """Guards the scanner itself: if it went blind, the test above would pass on anything."""
    calls = code_calls()
    for key in (("pods", "create"), ("pods", "delete"), ("nodes", "patch"), ("nodes", "watch"),
                ("configmaps", "patch"), (JOB_STATUS, "patch"), ("events", "create"),
                ("workloads.kueue.x-k8s.io", "create"), ("workloads.kueue.x-k8s.io/status",
                                                         "patch")):
        assert key in calls, key


# Every authenticated identity may ask what it may do; not the operator's grant.
SELF_REVIEWS = re.compile(r"^self\w+reviews\.")


def can_i_list(kubeconfig: Path, user: str, namespace: str) -> set[tuple[str, str]]:
    out = subprocess.run(["kubectl", "auth", "can-i", "--list", f"--as={user}", "-n", namespace],
                         capture_output=True, text=True, timeout=60, check=True,
                         env={**os.environ, "KUBECONFIG": str(kubeconfig)}).stdout
    rights = set()
    for line in out.splitlines()[1:]:
        resource, *_, verbs = re.split(r"\s{2,}", line.strip())
        if resource.startswith("[") or SELF_REVIEWS.match(resource):
            continue               # non-resource URLs (/healthz, /version, ...), self-reviews
        for verb in verbs.strip("[]").split():
            rights.add((resource, verb))
    return rights


@pytest.mark.stack
def test_what_the_apiserver_lets_the_operator_do_is_what_its_code_calls(kube, operator_kubeconfig,
                                                                        namespace):
    rights = can_i_list(kube.kubeconfig, rbac.OPERATOR_USER, namespace)
    calls = set(code_calls())
    assert rights == calls, (f"granted, never called: {sorted(rights - calls)}; "
                             f"called, not granted: {sorted(calls - rights)}")
