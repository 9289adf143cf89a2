"""Kill the operator mid-reconcile (SIGKILL, a real process), start it again.

Chaos survived: the operator dies while creating a job's pods, and again while carrying out a
whole-group restart. Expected: no duplicate pods, no orphans, no second count of the restart
(state lives in the job's status; names are deterministic; creating what exists is a no-op).
"""

from __future__ import annotations

import os
import signal
import threading

import pytest
from kubernetes import watch

from crucible.operator import manifests as m
from tests.operator.cluster import operator_process
from tests.support.operator_run import assert_clean_exit
from tests.support.services import eventually

pytestmark = pytest.mark.stack

PODS = 32


def _kill_on_first_pod(cluster, proc, generation: str) -> threading.Thread:
    """SIGKILL the operator the moment the first pod of `generation` appears."""
    ready = threading.Event()

    def run():
        w = watch.Watch()
        ready.set()
        for event in w.stream(cluster.core.list_namespaced_pod, cluster.namespace,
                              label_selector=f"{m.LABEL_GENERATION}={generation}",
                              timeout_seconds=60):
            if event["type"] == "ADDED":
                os.kill(proc.pid, signal.SIGKILL)
                w.stop()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    ready.wait(5)
    return thread


def _assert_one_clean_generation(cluster, generation: int, uid: str) -> None:
    pods = cluster.pods("gpt")
    current = [p for p in pods if p.metadata.labels[m.LABEL_GENERATION] == str(generation)]
    assert sorted(p.metadata.name for p in current) == sorted(
        m.pod_name("gpt", generation, i) for i in range(PODS))
    assert all(p.metadata.owner_references[0].uid == uid for p in pods), "orphaned pods"


def _not_node_failures(restarts: dict) -> dict:
    """Restarts by cause, less node failures: on a loaded 2-core machine a KWOK node can miss
    its heartbeat and really go unreachable, which the operator rightly counts; the operator's
    own kill must add nothing else."""
    return {cause: n for cause, n in restarts.get("byCause", {}).items() if cause != "NodeFailure"}


def test_killed_mid_reconcile_twice_leaves_no_duplicates_or_orphans(cluster, operator_kubeconfig,
                                                                   run_operator, tmp_path):
    log = tmp_path / "operator.log"
    proc = operator_process(operator_kubeconfig, cluster.namespace, log)
    try:
        watcher = _kill_on_first_pod(cluster, proc, "0")
        cluster.create_job("gpt", nodes={"min": 1, "max": PODS})
        assert proc.wait(timeout=60) == -signal.SIGKILL
        watcher.join(5)
        partial = len(cluster.pods("gpt"))
        assert 0 < partial < PODS, f"killed after {partial} of {PODS} pods: not mid-reconcile"
    finally:
        proc.kill()
    uid = cluster.job("gpt")["metadata"]["uid"]

    with run_operator(cluster.namespace) as runner:
        cluster.wait_running("gpt", PODS, generation=0)
        _assert_one_clean_generation(cluster, 0, uid)
        status = cluster.wait_phase("gpt", "Running")
        assert _not_node_failures(status["restarts"]) == {}
    assert_clean_exit(runner)

    # Again, while the operator carries out a whole-group restart.
    proc = operator_process(operator_kubeconfig, cluster.namespace, log)
    try:
        watcher = _kill_on_first_pod(cluster, proc, "1")
        cluster.fail_pod("gpt-0-5", 1)
        assert proc.wait(timeout=60) == -signal.SIGKILL
        watcher.join(5)
        assert cluster.status("gpt")["podGeneration"] == 1
    finally:
        proc.kill()
    with run_operator(cluster.namespace) as runner:
        cluster.wait_running("gpt", PODS, generation=1)
        eventually(lambda: [p.metadata.name for p in cluster.pods("gpt")
                            if p.metadata.labels[m.LABEL_GENERATION] == "0"] == ["gpt-0-5"],
                   60, "generation 0 gone but its failed pod (kept for logs)")
        _assert_one_clean_generation(cluster, 1, uid)
        status = cluster.wait_phase("gpt", "Running")
        assert status["restarts"]["application"] == 1
        assert _not_node_failures(status["restarts"]) == {"ApplicationError": 1}
        cluster.wait_event("gpt", "ApplicationError", count=1)
        cluster.delete_job("gpt")
    assert_clean_exit(runner, "pods running (min 1), generation 1")
    assert "ApplicationError: pod gpt-0-5" in log.read_text()
