"""Fixtures for the ship tests: the chart installed into the local stack.

Their helpers live in tests/support/: chart.py (`helm`, `render`, `Release`), tools.py (helm and
promtool as the stack builds them), metric_names.py, kubeconfigs.py.

- `release`: the chart really installed (`helm install --wait`) into the stack, serving one
  fresh namespace (operator.watchNamespaces, so the namespaced-RBAC layout is what runs), with a
  real token of the chart's operator ServiceAccount; uninstalled afterwards. Its names are its
  own (release `ship-<hex>`), so it never touches the cluster-wide objects other tests apply;
  the CRD comes from the chart's crds/ folder, which helm installs when absent and never deletes.
"""

from __future__ import annotations

import os
import secrets

import pytest
import yaml

from tests.support.chart import CHART, Release, helm
from tests.support.kubeconfigs import token_kubeconfig
from tests.support.services import Kube, eventually


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
    # The uninstall hook's Job needs the real image to finish: KWOK only pretends to run pods,
    # and `helm uninstall` would wait on it. On kind it runs for real.
    real = "CRUCIBLE_OPERATOR_IMAGE" in os.environ
    values.write_text(yaml.safe_dump({"operator": {"watchNamespaces": [jobs]},
                                      "image": {"repository": repository, "tag": tag},
                                      "uninstallHook": {"enabled": real}}))
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
