"""Fixtures for the operator's cluster tests (dask-kubernetes' layout, STYLE.md section 3).

- `crd`: the committed CRD applied once per session and Established;
- `operator_kubeconfig`: the operator's own identity: manifests/rbac/operator.yaml applied as is,
  and a real ServiceAccount token for it, so every cluster test also proves that RBAC suffices;
- `cluster`: helpers bound to the test's fresh namespace, whose PretrainJobs lose kopf's
  finalizer at teardown (the operator is stopped by then, and the namespace must go);
- `run_operator(namespace)`: `KopfRunner` on crucible.operator.handlers with a timeout; each test
  ends with the three assertions kopf's docs/testing.rst asks for.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import yaml
from kopf.testing import KopfRunner
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from crucible.operator import crd as crd_module
from crucible.operator import rbac
from tests.operator.cluster import Cluster, operator_env
from tests.support.services import Kube, eventually

REPO = Path(__file__).resolve().parents[2]
CRD_FILE = REPO / "manifests" / "crd" / "pretrainjobs.crucible.dev.yaml"
RBAC_FILE = REPO / "manifests" / "rbac" / "operator.yaml"


def _apply(api: client.ApiClient, doc: dict) -> None:
    """Create, or replace what an earlier run left (the same generated documents)."""
    kind, name, ns = doc["kind"], doc["metadata"]["name"], doc["metadata"].get("namespace")
    rbac_api, core = client.RbacAuthorizationV1Api(api), client.CoreV1Api(api)
    ext = client.ApiextensionsV1Api(api)
    create, replace, read = {
        "CustomResourceDefinition": (lambda: ext.create_custom_resource_definition(doc),
                                     lambda rv: ext.replace_custom_resource_definition(name, doc),
                                     lambda: ext.read_custom_resource_definition(name)),
        "ClusterRole": (lambda: rbac_api.create_cluster_role(doc),
                        lambda rv: rbac_api.replace_cluster_role(name, doc), None),
        "ClusterRoleBinding": (lambda: rbac_api.create_cluster_role_binding(doc),
                               lambda rv: rbac_api.replace_cluster_role_binding(name, doc), None),
        "ServiceAccount": (lambda: core.create_namespaced_service_account(ns, doc),
                           None, None),
    }[kind]
    try:
        create()
    except ApiException as err:
        if err.status != 409:
            raise
        if replace is not None:
            doc.setdefault("metadata", {})
            if read is not None:
                doc["metadata"]["resourceVersion"] = read().metadata.resource_version
            replace(None)


@pytest.fixture(scope="session")
def crd(kube: Kube) -> dict:
    doc = yaml.safe_load(CRD_FILE.read_text())
    api = kube.client()
    _apply(api, doc)
    ext = client.ApiextensionsV1Api(api)
    eventually(lambda: any(c.type == "Established" and c.status == "True" for c in
                           ext.read_custom_resource_definition(crd_module.NAME).status.conditions
                           or []), 30, "PretrainJob CRD Established")
    return doc


@pytest.fixture(scope="session")
def operator_kubeconfig(kube: Kube, crd, tmp_path_factory) -> Path:
    api = kube.client()
    core = client.CoreV1Api(api)
    try:
        core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(
            name=rbac.NAMESPACE)))
    except ApiException as err:
        if err.status != 409:
            raise
    eventually(lambda: core.read_namespaced_service_account("default", rbac.NAMESPACE), 30,
               f"namespace {rbac.NAMESPACE} ready")
    for doc in yaml.safe_load_all(RBAC_FILE.read_text()):
        _apply(api, doc)
    token = core.create_namespaced_service_account_token(
        rbac.NAME, rbac.NAMESPACE, client.AuthenticationV1TokenRequest(
            spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=6 * 3600))).status.token
    return write_kubeconfig(kube.kubeconfig, token, tmp_path_factory.mktemp("operator") /
                            "kubeconfig")


def write_kubeconfig(admin: Path, token: str, path: Path) -> Path:
    """Same server and CA as the admin kubeconfig, another identity."""
    doc = yaml.safe_load(admin.read_text())
    doc["users"] = [{"name": "sa", "user": {"token": token}}]
    doc["contexts"] = [{"name": "sa", "context": {"cluster": doc["clusters"][0]["name"],
                                                 "user": "sa"}}]
    doc["current-context"] = "sa"
    path.write_text(yaml.safe_dump(doc))
    path.chmod(0o600)
    return path


@pytest.fixture
def cluster(kube: Kube, namespace: str, crd):
    c = Cluster(kube, namespace)
    yield c
    c.strip_finalizers()


@pytest.fixture
def run_operator(operator_kubeconfig: Path, monkeypatch):
    """Start the operator (in-process, KopfRunner) for one namespace: `with run_operator(ns)`."""

    @contextlib.contextmanager
    def start(namespace: str, metrics_port: int | str = "off"):
        for key, value in operator_env(operator_kubeconfig, metrics_port).items():
            monkeypatch.setenv(key, value)
        with KopfRunner(["run", "--standalone", "--namespace", namespace,
                         "-m", "crucible.operator.handlers"], timeout=60) as runner:
            yield runner

    return start


def assert_clean_exit(runner, *lines: str) -> None:
    """kopf's docs/testing.rst: no exception, exit code 0, and the log says what happened."""
    assert runner.exception is None, runner.output[-3000:]
    assert runner.exit_code == 0, runner.output[-3000:]
    for line in lines:
        assert line in runner.output, f"{line!r} not in the operator's log:\n{runner.output[-3000:]}"
