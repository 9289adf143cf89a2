"""Node failure on the real control plane: a KWOK node stops heartbeating.

Chaos survived: the node under a worker pod goes silent (the real node lifecycle controller marks
it Ready=Unknown and taints it unreachable), then the node under pod 0, the c10d store's host.
Expected: after nodeFailureGraceSeconds, cordon + annotation, the pod force-deleted and
recreated on a healthy node (anti-affinity to the bad one); for pod 0, a whole-group restart.
Every node this test kills is revived, uncordoned and un-annotated, whatever happens.
"""

from __future__ import annotations

import time

import pytest

from tests.support.operator_run import assert_clean_exit
from tests.support.services import eventually

pytestmark = pytest.mark.stack


def _node_of(cluster, pod: str) -> str:
    return cluster.core.read_namespaced_pod(pod, cluster.namespace).spec.node_name


def _unreachable(cluster, node: str) -> bool:
    ready = next(c for c in cluster.core.read_node(node).status.conditions if c.type == "Ready")
    return ready.status != "True"


def test_node_loss_cordons_and_moves_the_pod_and_pod_0_loss_restarts_the_group(cluster, kube,
                                                                               run_operator):
    killed: list[str] = []
    try:
        with run_operator(cluster.namespace) as runner:
            cluster.create_job("gpt", nodes={"min": 1, "max": 2},
                               resources={"limits": {"nvidia.com/gpu": 8}},
                               faultTolerance={"nodeFailureGraceSeconds": 2})
            cluster.wait_running("gpt", 2, generation=0)
            cluster.wait_phase("gpt", "Running")

            # 1. The node under worker pod 1 dies.
            victim = _node_of(cluster, "gpt-0-1")
            kube.set_node_alive(victim, False)
            killed.append(victim)
            eventually(lambda: _unreachable(cluster, victim), 45, f"{victim} NotReady")
            down_at = time.monotonic()
            node = eventually(lambda: (n := cluster.core.read_node(victim)).spec.unschedulable
                              and n, 20, f"{victim} cordoned")
            ann = node.metadata.annotations
            assert ann["crucible.dev/failure-job"] == f"{cluster.namespace}/gpt"
            assert ann["crucible.dev/failure-reason"] == "NodeUnreachable"
            assert ann["crucible.dev/cordoned-by"] == f"{cluster.namespace}/gpt"
            moved = eventually(lambda: (p := [x for x in cluster.running("gpt", 0)
                                              if x.metadata.name == "gpt-0-1"])
                               and p[0].spec.node_name != victim and p[0], 30,
                               "gpt-0-1 Running on another node")
            moved_s = time.monotonic() - down_at
            assert moved.spec.affinity.node_affinity  # kept off the bad node for good
            status = cluster.status("gpt")
            assert status["cordonedNodes"] == [victim] and status["podGeneration"] == 0
            assert status["restarts"]["byCause"] == {"NodeFailure": 1}
            # Grace 2 s + scheduling: well inside the goal "grace + 15 s" (docs/operator.md, Scale).
            assert moved_s < 2 + 15, moved_s

            # 2. The node under pod 0 (it serves the c10d store) dies: the group restarts.
            store_host = _node_of(cluster, "gpt-0-0")
            kube.set_node_alive(store_host, False)
            killed.append(store_host)
            eventually(lambda: _unreachable(cluster, store_host), 45, f"{store_host} NotReady")
            pods = cluster.wait_running("gpt", 2, generation=1, timeout_s=45)
            assert not {p.spec.node_name for p in pods} & {victim, store_host}
            status = cluster.wait_phase("gpt", "Running")
            assert status["restarts"] == {"total": 2, "application": 0, "infrastructure": 2,
                                          "byCause": {"NodeFailure": 2}}
            assert sorted(status["cordonedNodes"]) == sorted([victim, store_host])
            cluster.wait_event("gpt", "NodeFailure")
            # The old pod 0 sat on a dead node: force-deleted, nothing left Terminating.
            eventually(lambda: not [p for p in cluster.pods("gpt")
                                    if p.metadata.labels["crucible.dev/generation"] == "0"],
                       30, "generation 0 gone, none stuck Terminating")
            cluster.delete_job("gpt")
    finally:
        for node in killed:
            cluster.revive(node)
    assert_clean_exit(runner, f"{victim} is Unreachable", "cordoned and annotated it",
                      "force-deleted it to recreate it elsewhere",
                      "it hosted the c10d store; restarting the group as generation 1")


def test_the_operators_cordon_ends_after_its_quarantine_and_a_persons_cordon_stays(
        cluster, kube, run_operator, monkeypatch):
    """`--quarantine-minutes` 0.25: the node the operator cordoned is back in the pool 15 s
    later (healthy again), on probation. Another node carries the operator's annotations but a
    person's cordon (`kubectl cordon` after the operator's was lifted): it stays cordoned."""
    monkeypatch.setenv("CRUCIBLE_OPERATOR_QUARANTINE_MINUTES", "0.25")
    killed, admin_node = [], None
    try:
        with run_operator(cluster.namespace) as runner:
            cluster.create_job("q", nodes={"min": 1, "max": 1},
                               faultTolerance={"nodeFailureGraceSeconds": 2})
            cluster.wait_running("q", 1, generation=0)
            victim = _node_of(cluster, "q-0-0")
            admin_node = next(n for n in kube.nodes if n != victim)
            # What `kubectl cordon` writes (its field manager), on a node whose old operator
            # annotations say the cordon ended long ago.
            cluster.core.patch_node(admin_node, {"spec": {"unschedulable": True}},
                                    field_manager="kubectl-cordon")
            cluster.core.patch_node(admin_node, {"metadata": {"annotations": {
                "crucible.dev/cordoned-by": "elsewhere/job",
                "crucible.dev/quarantine-until": "2026-01-01T00:00:00.000000Z"}}},
                field_manager="kubectl-annotate")

            kube.set_node_alive(victim, False)
            killed.append(victim)
            node = eventually(lambda: (n := cluster.core.read_node(victim)).spec.unschedulable
                              and n, 60, f"{victim} cordoned by the operator")
            until = node.metadata.annotations["crucible.dev/quarantine-until"]
            cordoned_at = time.monotonic()
            kube.set_node_alive(victim, True)          # repaired, nobody uncordons it
            back = eventually(lambda: not (n := cluster.core.read_node(victim)).spec.unschedulable
                              and n, 60, f"{victim} uncordoned after its quarantine")
            print(f"{victim} back in the pool {time.monotonic() - cordoned_at:.1f}s after its "
                  f"cordon (quarantine until {until})")
            assert time.monotonic() - cordoned_at >= 10     # not before its quarantine ended
            ann = back.metadata.annotations
            assert "crucible.dev/cordoned-by" not in ann and "crucible.dev/probation-until" in ann
            assert ann["crucible.dev/failure-reason"] == "NodeUnreachable"   # the record stays

            held = eventually(lambda: "crucible.dev/cordoned-by" not in (
                (n := cluster.core.read_node(admin_node)).metadata.annotations or {}) and n, 45,
                "the operator's stale claim on the person's cordon dropped")
            assert held.spec.unschedulable is True
            cluster.delete_job("q")
    finally:
        for node in killed:
            cluster.revive(node)
        if admin_node:
            cluster.forget_failure(admin_node)
    assert_clean_exit(runner, "quarantine over and the node healthy: uncordoned, on probation",
                      "its cordon is no longer the operator's")
