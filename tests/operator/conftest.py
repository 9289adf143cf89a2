"""Fixtures for the operator's cluster tests, laid out as dask-kubernetes' operator tests are.

- `crd`: the committed CRD applied once per session and Established;
- `operator_kubeconfig`: the operator's own identity: manifests/rbac/operator.yaml applied as is,
  and a real ServiceAccount token for it, so every cluster test also proves that RBAC suffices;
- `cluster`: helpers bound to the test's fresh namespace, whose PretrainJobs lose kopf's
  finalizer at teardown (the operator is stopped by then, and the namespace must go);
- `run_operator(namespace)`: `KopfRunner` on crucible.operator.handlers with a timeout; each test
  ends with the three assertions kopf's docs/testing.rst asks for
  (tests/support/operator_run.py).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import yaml
from kopf.testing import KopfRunner
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from crucible.operator import crd as crd_module
from crucible.operator import rbac
from tests.operator.cluster import Cluster, operator_env
from tests.support.apply import CRD_FILE, RBAC_FILE, apply
from tests.support.kubeconfigs import write_kubeconfig
from tests.support.services import Kube, eventually


@pytest.fixture(scope="session")
def crd(kube: Kube) -> dict:
    doc = yaml.safe_load(CRD_FILE.read_text())
    api = kube.client()
    apply(api, doc)
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
        apply(api, doc)
    token = core.create_namespaced_service_account_token(
        rbac.NAME, rbac.NAMESPACE, client.AuthenticationV1TokenRequest(
            spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=6 * 3600))).status.token
    return write_kubeconfig(kube.kubeconfig, token, tmp_path_factory.mktemp("operator") /
                            "kubeconfig")


@pytest.fixture
def cluster(kube: Kube, namespace: str, crd):
    kube.wait_nodes_healthy()     # a node an earlier test killed may still be coming back
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
        monkeypatch.setenv("CRUCIBLE_OPERATOR_NAMESPACES", json.dumps([namespace]))
        with KopfRunner(["run", "--standalone", "--namespace", namespace,
                         "-m", "crucible.operator.handlers"], timeout=60) as runner:
            yield runner

    return start
