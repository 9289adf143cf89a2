"""Two operator replicas on the real control plane: one leads, the other takes over.

Chaos survived: the leading replica is SIGKILLed while the job needs it (a pod was just deleted).
Expected: only the leader ever acted; the other replica takes the leader Lease within 15 s of
the kill and replaces the pod; no pod is duplicated or left behind.
"""

from __future__ import annotations

import signal
import time

import pytest

from crucible.operator import leader
from tests.operator.cluster import operator_process
from tests.support.services import eventually

pytestmark = pytest.mark.stack


def _holder(cluster) -> str | None:
    try:
        lease = cluster.coordination.read_namespaced_lease(leader.LEASE_NAME, cluster.namespace)
    except Exception:  # noqa: BLE001 - not created yet
        return None
    return lease.spec.holder_identity


def test_the_standby_takes_over_within_15_s_of_the_leaders_death(cluster, operator_kubeconfig,
                                                                 tmp_path):
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    procs = [operator_process(operator_kubeconfig, cluster.namespace, log,
                              "--leader-election-namespace", cluster.namespace) for log in logs]
    try:
        first = eventually(lambda: _holder(cluster), 60, "a leader")
        lead = next(i for i, p in enumerate(procs) if first.endswith(f"-{p.pid}"))
        cluster.create_job("gpt", nodes={"min": 2, "max": 3})
        cluster.wait_running("gpt", 3, generation=0, timeout_s=60)
        cluster.wait_phase("gpt", "Running")
        standby = 1 - lead
        assert "created pod(s)" in logs[lead].read_text()
        assert "created pod(s)" not in logs[standby].read_text()   # the standby never acted

        before = {p.metadata.name: p.metadata.uid for p in cluster.pods("gpt")}
        procs[lead].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        procs[lead].wait(timeout=10)
        cluster.core.delete_namespaced_pod("gpt-0-1", cluster.namespace)
        second = eventually(lambda: (h := _holder(cluster)) and h != first and h, 30,
                            "the standby holding the leader Lease")
        took_over_s = time.monotonic() - killed_at
        assert second.endswith(f"-{procs[standby].pid}")
        print(f"standby took over {took_over_s:.1f}s after the kill")
        assert took_over_s <= 15, f"took over after {took_over_s:.1f}s"
        pods = eventually(
            lambda: (ps := cluster.running("gpt", 0)) and len(ps) == 3
            and next(p for p in ps if p.metadata.name == "gpt-0-1").metadata.uid
            != before["gpt-0-1"] and ps, 30, "gpt-0-1 replaced by the new leader")
        assert sorted(p.metadata.name for p in cluster.pods("gpt")) == sorted(before)
        assert {p.metadata.name: p.metadata.uid for p in pods}["gpt-0-0"] == before["gpt-0-0"]
        status = cluster.wait_phase("gpt", "Running")
        assert status["podGeneration"] == 0
        cluster.delete_job("gpt")
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=10)
