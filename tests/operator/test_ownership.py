"""Ownership on the real control plane: a job acts only on what it controls (owner UID).

Chaos survived: a job deleted and created again under the same name while its old pods are held
by a finalizer; a Service of the job's name made beforehand by someone else; a stranger's pod
carrying the job's labels that exits 0. Expected: the new job waits for its namesake's pods
(restarts 0, a pass every few seconds, not a hot loop); the Service is a `NameConflict`, never
adopted; the stranger's exit does not complete the job.
"""

from __future__ import annotations

import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.operator.cluster import IMAGE, free_port
from tests.support.operator_run import assert_clean_exit
from tests.support.services import eventually

pytestmark = pytest.mark.stack

HOLD = "test.crucible.dev/hold"


def _reconciles(port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(sample.value for family in text_string_to_metric_families(text)
               if family.name == "crucible_operator_reconciles"
               for sample in family.samples if sample.name.endswith("_total"))


def _condition(status: dict, type_: str) -> dict:
    return next((c for c in status.get("conditions", []) if c["type"] == type_), {})


def test_a_job_recreated_by_name_waits_for_its_namesakes_held_pods(cluster, run_operator):
    port = free_port()
    with run_operator(cluster.namespace, metrics_port=port) as runner:
        cluster.create_job("gpt", nodes={"min": 2, "max": 2})
        pods = cluster.wait_running("gpt", 2, generation=0)
        for pod in pods:
            cluster.core.patch_namespaced_pod(pod.metadata.name, cluster.namespace,
                                              {"metadata": {"finalizers": [HOLD]}})
        old_uid = cluster.job("gpt")["metadata"]["uid"]
        cluster.delete_job("gpt")
        eventually(lambda: all(p.metadata.deletion_timestamp for p in cluster.pods("gpt")), 30,
                   "the old pods terminating, held by the finalizer")
        cluster.create_job("gpt", nodes={"min": 2, "max": 2})
        status = eventually(lambda: (s := cluster.status("gpt")) and _condition(
            s, "NameConflict").get("reason") == "WaitingForNamesake" and s, 30,
            "the new job waiting for its namesake's pods")
        assert cluster.job("gpt")["metadata"]["uid"] != old_uid
        before, started = _reconciles(port), time.monotonic()
        time.sleep(10)
        rate = (_reconciles(port) - before) / (time.monotonic() - started)
        assert rate <= 2, f"{rate:.1f} reconciles/s while waiting"
        status = cluster.status("gpt")
        assert status["restarts"]["total"] == 0 and status.get("podGeneration", 0) == 0
        for pod in cluster.pods("gpt"):
            cluster.core.patch_namespaced_pod(pod.metadata.name, cluster.namespace,
                                              {"metadata": {"finalizers": None}})
        pods = cluster.wait_running("gpt", 2, generation=0)
        uid = cluster.job("gpt")["metadata"]["uid"]
        assert all(p.metadata.owner_references[0].uid == uid for p in pods)
        status = cluster.wait_phase("gpt", "Running")
        assert status["restarts"]["total"] == 0
        assert _condition(status, "NameConflict")["status"] == "False"
        cluster.delete_job("gpt")
    assert_clean_exit(runner)


def test_a_foreign_service_is_a_name_conflict_and_a_strangers_pod_is_ignored(cluster,
                                                                             run_operator):
    cluster.core.create_namespaced_service(cluster.namespace, {
        "metadata": {"name": "gpt"}, "spec": {"ports": [{"port": 80}]}})
    with run_operator(cluster.namespace) as runner:
        cluster.create_job("gpt", nodes={"min": 1, "max": 1})
        status = eventually(lambda: (s := cluster.status("gpt")) and _condition(
            s, "NameConflict").get("status") == "True" and s, 30, "NameConflict")
        assert "Service gpt exists and belongs to another owner" in \
            _condition(status, "NameConflict")["message"]
        cluster.wait_event("gpt", "NameConflict")
        assert not cluster.pods("gpt")
        service = cluster.core.read_namespaced_service("gpt", cluster.namespace)
        assert not service.metadata.owner_references  # never adopted

        cluster.core.delete_namespaced_service("gpt", cluster.namespace)
        cluster.wait_running("gpt", 1, generation=0, timeout_s=60)
        cluster.wait_phase("gpt", "Running")

        # A stranger's pod with the job's labels, exiting 0: not the job's completion.
        cluster.core.create_namespaced_pod(cluster.namespace, {
            "metadata": {"name": "stranger", "labels": {
                "crucible.dev/job": "gpt", "crucible.dev/generation": "0",
                "crucible.dev/index": "5"}},
            "spec": {"containers": [{"name": "trainer", "image": IMAGE}],
                     "tolerations": [{"operator": "Exists"}]}})
        eventually(lambda: cluster.core.read_namespaced_pod(
            "stranger", cluster.namespace).status.phase == "Running", 30, "stranger Running")
        cluster.succeed_pod("stranger")
        time.sleep(5)
        status = cluster.status("gpt")
        assert status["phase"] == "Running", status.get("message")
        assert cluster.core.read_namespaced_pod("stranger", cluster.namespace)  # left alone
        cluster.delete_job("gpt")
    assert_clean_exit(runner)
