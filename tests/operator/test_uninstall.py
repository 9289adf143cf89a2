"""Uninstalling the operator leaves no PretrainJob stuck on its finalizer.

On the local control plane: a Deployment stands for the operator (KWOK runs its pods), a job
carries kopf's finalizer and someone else's. `crucible-operator release-finalizers
--stop-deployment` (what the chart's pre-delete hook runs) scales the Deployment to 0, waits for
it, and takes off the operator's finalizer only: deleting the job then waits for the other
finalizer alone.
"""

from __future__ import annotations

import pytest
from kubernetes import client

from crucible.operator import crd, main, uninstall
from tests.operator.cluster import job_body
from tests.support.services import eventually

pytestmark = pytest.mark.stack

OTHER = "example.com/keep"


def test_release_finalizers_stops_the_operator_then_frees_every_job(cluster, kube, monkeypatch,
                                                                    capsys):
    apps = client.AppsV1Api(cluster.api)
    labels = {"app": "fake-operator"}
    apps.create_namespaced_deployment(cluster.namespace, {
        "metadata": {"name": "operator"},
        "spec": {"replicas": 2, "selector": {"matchLabels": labels}, "template": {
            "metadata": {"labels": labels},
            "spec": {"containers": [{"name": "c", "image": "registry.invalid/op:1"}]}}}})
    eventually(lambda: (apps.read_namespaced_deployment("operator", cluster.namespace)
                        .status.ready_replicas or 0) == 2, 60, "the stand-in operator running")
    for name, finalizers in (("freed", [uninstall.FINALIZER]),
                             ("shared", [OTHER, uninstall.FINALIZER])):
        body = job_body(name)
        body["metadata"]["finalizers"] = finalizers
        cluster.objs.create_namespaced_custom_object(crd.GROUP, crd.VERSION, cluster.namespace,
                                                     crd.PLURAL, body)
    monkeypatch.setenv("KUBECONFIG", str(kube.kubeconfig))
    code = main.main(["release-finalizers", "-n", cluster.namespace,
                      f"--stop-deployment={cluster.namespace}/operator", "--timeout", "60"])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert f"operator {cluster.namespace}/operator: scaled to 0" in out
    assert "2 PretrainJob(s) released" in out
    assert (apps.read_namespaced_deployment("operator", cluster.namespace).status.replicas
            or 0) == 0
    assert cluster.job("freed")["metadata"].get("finalizers") is None
    assert cluster.job("shared")["metadata"]["finalizers"] == [OTHER]   # not ours: kept
    cluster.delete_job("freed")
    eventually(lambda: not [j for j in cluster.objs.list_namespaced_custom_object(
        crd.GROUP, crd.VERSION, cluster.namespace, crd.PLURAL)["items"]
        if j["metadata"]["name"] == "freed"], 30, "the freed job deleted")
    cluster.strip_finalizers()
    # Nothing left to do the second time, and a bad --stop-deployment is a one-line error.
    assert main.main(["release-finalizers", "-n", cluster.namespace]) == 0
    assert "0 PretrainJob(s) released" in capsys.readouterr().out
    assert main.main(["release-finalizers", "--stop-deployment", "nonamespace"]) == 2
