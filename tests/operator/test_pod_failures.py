"""Pod chaos on the real control plane: delete a pod, exit 137, exit 1.

Chaos survived: `kubectl delete pod`; a container killed by SIGKILL (exit 137, KWOK's
pod-container-running-failed stage); an application error (exit 1) until the budget runs out;
exit 1 as torchrun's answer to the SIGTERM of a deletion.
"""

from __future__ import annotations

import datetime as dt

import pytest

from crucible.operator import manifests as m
from tests.operator.cluster import IMAGE

from tests.support.operator_run import assert_clean_exit
from tests.support.services import eventually

pytestmark = pytest.mark.stack


def _uid(cluster, name: str) -> str:
    return cluster.core.read_namespaced_pod(name, cluster.namespace).metadata.uid


def test_deleted_pod_is_replaced_alone_and_not_counted(cluster, run_operator):
    with run_operator(cluster.namespace) as runner:
        cluster.create_job("gpt", nodes={"min": 2, "max": 3})
        cluster.wait_running("gpt", 3, generation=0)
        cluster.wait_phase("gpt", "Running")
        before = {p.metadata.name: p.metadata.uid for p in cluster.pods("gpt")}
        cluster.core.delete_namespaced_pod("gpt-0-1", cluster.namespace)
        eventually(lambda: _uid(cluster, "gpt-0-1") != before["gpt-0-1"], 30,
                   "gpt-0-1 recreated under the same name")
        pods = cluster.wait_running("gpt", 3, generation=0)
        after = {p.metadata.name: p.metadata.uid for p in pods}
        assert after["gpt-0-0"] == before["gpt-0-0"] and after["gpt-0-2"] == before["gpt-0-2"]
        status = eventually(lambda: (s := cluster.status("gpt"))["restarts"]["total"] == 1 and s,
                            10, "restart counted")
        assert status["restarts"] == {"total": 1, "application": 0, "infrastructure": 1,
                                      "byCause": {"PodDeleted": 1}}
        assert status["podGeneration"] == 0
        cluster.wait_event("gpt", "PodDeleted")
        cluster.delete_job("gpt")
    assert_clean_exit(runner, "PodDeleted: pod gpt-0-1 ")


def test_exit_137_replaces_the_pod_and_on_pod_0_restarts_the_group_uncounted(cluster,
                                                                            run_operator):
    with run_operator(cluster.namespace) as runner:
        cluster.create_job("gpt", nodes={"min": 1, "max": 2},
                           faultTolerance={"maxRestarts": 0})
        cluster.wait_running("gpt", 2, generation=0)
        first = _uid(cluster, "gpt-0-1")
        cluster.fail_pod("gpt-0-1", 137)
        eventually(lambda: _uid(cluster, "gpt-0-1") != first, 30, "gpt-0-1 replaced")
        cluster.wait_running("gpt", 2, generation=0)
        status = cluster.status("gpt")
        assert status["restarts"]["byCause"] == {"Signal": 1}
        assert status["restarts"]["application"] == 0 and status["phase"] != "Failed"

        cluster.fail_pod("gpt-0-0", 137)       # pod 0 hosts the c10d store
        cluster.wait_running("gpt", 2, generation=1)
        status = cluster.wait_phase("gpt", "Running")
        assert status["podGeneration"] == 1
        assert status["restarts"] == {"total": 2, "application": 0, "infrastructure": 2,
                                      "byCause": {"Signal": 2}}
        eventually(lambda: {p.metadata.labels["crucible.dev/generation"]
                            for p in cluster.running("gpt")} == {"1"}, 30, "generation 0 gone")
        cluster.delete_job("gpt")
    assert_clean_exit(runner, "Signal: pod gpt-0-1 on", "killed by signal 9 (exit code 137)",
                      "it hosted the c10d store; restarting the group as generation 1")


def test_exit_1_restarts_the_group_within_the_budget_then_fails(cluster, run_operator):
    with run_operator(cluster.namespace) as runner:
        cluster.create_job("gpt", nodes={"min": 2, "max": 2},
                           faultTolerance={"maxRestarts": 1, "maxRestartsWithoutProgress": 5})
        cluster.wait_running("gpt", 2, generation=0)
        cluster.fail_pod("gpt-0-1", 1)
        cluster.wait_running("gpt", 2, generation=1)
        status = cluster.wait_phase("gpt", "Running")
        assert status["restarts"] == {"total": 1, "application": 1, "infrastructure": 0,
                                      "byCause": {"ApplicationError": 1}}

        cluster.fail_pod("gpt-1-0", 1)
        status = cluster.wait_phase("gpt", "Failed", 30)
        failed = next(c for c in status["conditions"] if c["type"] == "Failed")
        assert failed["reason"] == "RestartBudgetExhausted"
        assert "maxRestarts=1" in failed["message"]
        # The failed pod stays for `kubectl logs`; the other one is stopped.
        eventually(lambda: [p.metadata.name for p in cluster.pods("gpt")
                            if p.metadata.labels["crucible.dev/generation"] == "1"] == ["gpt-1-0"],
                   30, "only the failed pod left")
        cluster.wait_event("gpt", "RestartBudgetExhausted")
        assert cluster.event_reasons("gpt").count("ApplicationError") == 1
        cluster.delete_job("gpt")
    assert_clean_exit(runner, "exited with 1: container failed (application restart 1 of 1)",
                      "RestartBudgetExhausted: job failed")


def test_exit_1_after_a_deletion_is_the_deletion_not_the_program(cluster, run_operator):
    """torchrun answers the kubelet's SIGTERM with exit 1. The operator is stopped while it
    happens, so its first pass sees the pod already Failed with exit 1 and deleting (a
    finalizer holds it, as a log shipper's would): the exit came after the deletion was asked
    for, so it is a PodDeleted, not an application failure."""
    with run_operator(cluster.namespace) as runner:
        cluster.create_job("gpt", nodes={"min": 2, "max": 3})
        cluster.wait_running("gpt", 3, generation=0)
        cluster.wait_phase("gpt", "Running")
    assert_clean_exit(runner)
    held = "test.crucible.dev/hold"
    cluster.core.patch_namespaced_pod("gpt-0-1", cluster.namespace,
                                      {"metadata": {"finalizers": [held]}})
    try:
        cluster.core.delete_namespaced_pod("gpt-0-1", cluster.namespace, grace_period_seconds=30)
        finished = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        cluster.core.patch_namespaced_pod_status("gpt-0-1", cluster.namespace, {"status": {
            "phase": "Failed", "containerStatuses": [{
                "name": m.CONTAINER, "image": IMAGE, "imageID": "", "ready": False,
                "restartCount": 0, "state": {"terminated": {
                    "exitCode": 1, "reason": "Error", "startedAt": finished,
                    "finishedAt": finished}}}]}})
        with run_operator(cluster.namespace) as runner:
            status = eventually(lambda: (s := cluster.status("gpt"))["restarts"]["total"] and s,
                                30, "the exit judged")
            assert status["restarts"]["application"] == 0, status["restarts"]
            assert status["restarts"]["byCause"] == {"PodDeleted": 1}
            assert status["podGeneration"] == 0 and status["phase"] != "Failed"
            cluster.core.patch_namespaced_pod("gpt-0-1", cluster.namespace,
                                              {"metadata": {"finalizers": None}})
            cluster.wait_running("gpt", 3, generation=0)
            cluster.delete_job("gpt")
    finally:
        try:
            cluster.core.patch_namespaced_pod("gpt-0-1", cluster.namespace,
                                              {"metadata": {"finalizers": None}})
        except Exception:  # noqa: BLE001 - gone already
            pass
    assert_clean_exit(runner, "torchrun's answer to SIGTERM")
