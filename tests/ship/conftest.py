"""Fixtures for the ship tests: the chart rendered and installed, tools of the local stack.

- `tool(name)`: helm and promtool as the stack builds them (~/.cache/crucible/bin), else PATH;
- `render(values, ...)`: `helm template` of charts/crucible, parsed;
- `release`: the chart really installed (`helm install --wait`) into the stack, serving one
  fresh namespace (operator.watchNamespaces, so the namespaced-RBAC layout is what runs), with a
  real token of the chart's operator ServiceAccount; uninstalled afterwards. Its names are its
  own (release `ship-<hex>`), so it never touches the cluster-wide objects other tests apply;
  the CRD comes from the chart's crds/ folder, which helm installs when absent and never deletes.
- `corpus`: tests/trainer's real-text corpus fixture (Python's docs, tokenized once).
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from kubernetes import client

from tests.operator.conftest import write_kubeconfig
from tests.support.services import Kube, eventually
from tests.trainer.conftest import corpus  # noqa: F401 - re-exported fixture

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "crucible"
STACK_BIN = Path.home() / ".cache" / "crucible" / "bin"


def tool(name: str) -> str:
    """A binary the stack builds (helm, promtool), or the one on PATH (kind users)."""
    built = Path(os.environ.get("CRUCIBLE_BIN", STACK_BIN)) / name
    if built.is_file():
        return str(built)
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} not found in {built.parent} or on PATH: `make stack` builds it",
                    pytrace=False)
    return found


def helm(*args: str, kubeconfig: Path | None = None, check: bool = True,
         timeout: float = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, **({"KUBECONFIG": str(kubeconfig)} if kubeconfig else {})}
    proc = subprocess.run([tool("helm"), *args], capture_output=True, text=True, env=env,
                          timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed ({proc.returncode}):\n"
                             f"{proc.stderr[-3000:]}")
    return proc


def render(values: dict | None = None, *, release: str = "crucible",
           namespace: str = "crucible-system", include_crds: bool = False) -> list[dict]:
    """`helm template` with these values; the documents, parsed."""
    args = ["template", release, str(CHART), "--namespace", namespace]
    if include_crds:
        args.append("--include-crds")
    with tempfile.TemporaryDirectory() as tmp:
        if values:
            path = Path(tmp) / "values.yaml"
            path.write_text(yaml.safe_dump(values))
            args += ["--values", str(path)]
        out = helm(*args).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def token_kubeconfig(kube: Kube, namespace: str, account: str, path: Path) -> Path:
    """A kubeconfig holding a real (TokenRequest) token of this ServiceAccount."""
    token = client.CoreV1Api(kube.client()).create_namespaced_service_account_token(
        account, namespace, client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(
            audiences=[], expiration_seconds=3600))).status.token
    return write_kubeconfig(kube.kubeconfig, token, path)


@dataclass
class Release:
    name: str
    namespace: str          # where the operator runs
    jobs_namespace: str     # the one namespace it serves
    operator_account: str
    operator_kubeconfig: Path
    manifest: list[dict]    # what helm installed (helm get manifest)


@pytest.fixture(scope="session")
def release(kube: Kube, tmp_path_factory) -> Release:
    name = f"ship-{secrets.token_hex(3)}"
    ns = kube.create_namespace("ship-operator")
    jobs = kube.create_namespace("ship-jobs")
    tmp = tmp_path_factory.mktemp("release")
    values = tmp / "values.yaml"
    # KWOK never pulls the image; on kind (e2e/kind/run.sh) the real one runs and must pass
    # its probes for `helm install --wait` to return.
    image = os.environ.get("CRUCIBLE_OPERATOR_IMAGE", "registry.invalid/crucible-operator:test")
    repository, _, tag = image.rpartition(":")
    values.write_text(yaml.safe_dump({"operator": {"watchNamespaces": [jobs]},
                                      "image": {"repository": repository, "tag": tag}}))
    try:
        helm("install", name, str(CHART), "--namespace", ns, "--values", str(values), "--wait",
             "--timeout", "120s", kubeconfig=kube.kubeconfig)
        manifest = [d for d in yaml.safe_load_all(helm(
            "get", "manifest", name, "--namespace", ns, kubeconfig=kube.kubeconfig).stdout) if d]
        account = next(d for d in manifest if d["kind"] == "ServiceAccount")["metadata"]["name"]
        kubeconfig = eventually(lambda: token_kubeconfig(kube, ns, account, tmp / "operator"), 30,
                                f"a token for ServiceAccount {account}")
        yield Release(name, ns, jobs, account, kubeconfig, manifest)
    finally:
        helm("uninstall", name, "--namespace", ns, "--wait", "--timeout", "60s", check=False,
             kubeconfig=kube.kubeconfig)
        kube.delete_namespace(jobs)
        kube.delete_namespace(ns)


def exported_metric_names() -> set[str]:
    """Every series name the code can export: the trainer's registry (trainer/metrics.py) and
    the operator's (operator/metrics.py, per-job families included), read from their own
    exposition output, with the suffixes Prometheus stores (_total, _bucket, _sum, _count)."""
    from prometheus_client import generate_latest

    from crucible.operator import metrics as operator_metrics
    from crucible.trainer.metrics import Metrics

    trainer = Metrics("j", 0, enabled=False, port=None, jsonl_path=None).registry
    record = operator_metrics.JobRecord("ns", "j", {"phase": "Running"}, 600.0)
    text = generate_latest(trainer).decode()
    text += generate_latest(operator_metrics.REGISTRY).decode()
    for collector in (operator_metrics.JobsByPhase(lambda: {}),
                      operator_metrics.JobStatus(lambda: {"u": record})):
        for family in collector.collect():
            text += f"# TYPE {family.name} {family.type}\n"
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"],
                        "summary": ["_sum", "_count", ""]}.get(kind, [""])
            names.update(name.removesuffix("_total") + s if kind == "counter" else name + s
                         for s in suffixes)
    return names
