"""The operator's cluster-wide cap on cordons: a burst of node failures never empties the pool.

`CordonLimit` on its own (a fake clock), then the adapter against the real apiserver with the
operator's own credentials: with a limit of one a minute, the first of two cordons lands, the
second is carried out as an annotation only, and the pass's status and events say so. Then the
whole operator: every node under a job failing at once gets no more cordons than the cap.
"""

from __future__ import annotations

import time

import pytest
from kubernetes import client, config

from crucible.operator import handlers
from crucible.operator.decision import Action, Outcome
from crucible.operator.kube import CordonLimit, Kube, is_cordon
from tests.operator import builders as b
from tests.support.clock import FakeClock
from tests.support.operator_run import assert_clean_exit
from tests.support.services import eventually


def test_the_limit_counts_nodes_cordoned_in_any_60_seconds():
    clock = FakeClock()
    limit = CordonLimit(2, clock)
    assert limit.take("a") and limit.take("b") and not limit.take("c")
    assert limit.take("a")                # another job cordoning the same node: no new slot
    clock.now += 59.9
    assert not limit.take("c")
    clock.now += 0.1                      # the first two are a minute old
    assert limit.take("c") and limit.take("d") and not limit.take("e")
    assert not CordonLimit(0, clock).take("a")   # 0: never cordon


def _cordon(node: str) -> Action:
    return Action("patch_node", "Node", node, {
        "spec": {"unschedulable": True},
        "metadata": {"annotations": {"crucible.dev/failure-reason": "NodeNotReady",
                                     "crucible.dev/failure-job": "team-a/gpt",
                                     "crucible.dev/cordoned-by": "team-a/gpt"}}}, "Cordon")


def test_only_a_node_patch_that_sets_unschedulable_is_a_cordon():
    assert is_cordon(_cordon("n"))
    assert not is_cordon(Action("patch_node", "Node", "n", {"metadata": {"annotations": {}}}))
    assert not is_cordon(Action("delete", "Pod", "p"))          # no body at all


@pytest.mark.stack
def test_past_the_limit_a_failed_node_is_annotated_not_cordoned(kube, operator_kubeconfig):
    admin = client.CoreV1Api(kube.client())
    names = [f"cordon-limit-{i}-{int(time.time())}" for i in range(2)]
    for name in names:   # bare Node objects, tainted: nothing is ever scheduled on them
        admin.create_node({"metadata": {"name": name}, "spec": {"taints": [
            {"key": "crucible.dev/test", "effect": "NoSchedule"}]}})
    try:
        api = config.new_client_from_config(str(operator_kubeconfig))
        adapter = Kube(api, cordons_per_minute=1)
        job = b.job()
        status = {"cordonedNodes": list(names), "phase": "Running"}
        outcome = Outcome(actions=(_cordon(names[0]), _cordon(names[1])), status=status)
        applied = adapter.apply(job, outcome)
        assert not applied.rejected and not applied.transient, applied
        assert applied.cordons_limited == [names[1]]
        first, second = (admin.read_node(name) for name in names)
        assert first.spec.unschedulable is True
        assert first.metadata.annotations["crucible.dev/cordoned-by"] == "team-a/gpt"
        assert not second.spec.unschedulable
        assert "crucible.dev/cordoned-by" not in second.metadata.annotations
        assert second.metadata.annotations["crucible.dev/failure-reason"] == "NodeNotReady"
        assert "limit of 1 cordons per minute" in \
            second.metadata.annotations["crucible.dev/cordon-skipped"]
        # What the pass writes and says: only the node really cordoned is listed.
        fixed = handlers.not_cordoned(outcome, applied.cordons_limited, 1)
        assert fixed.status["cordonedNodes"] == [names[0]]
        assert [e.reason for e in fixed.events] == ["CordonRateLimited"]
        assert names[1] in fixed.events[0].message
        adapter.events.shutdown(wait=False)
    finally:
        for name in names:
            admin.delete_node(name)


def _condition(cluster, node: str, status: str) -> None:
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    cluster.core.patch_node_status(node, {"status": {"conditions": [{
        "type": "GPUUnhealthy", "status": status, "reason": "XidError",
        "message": "XID 79 on GPU 3" if status == "True" else "healthy",
        "lastTransitionTime": now, "lastHeartbeatTime": now}]}})


@pytest.mark.stack
def test_a_burst_of_failing_nodes_is_cordoned_no_faster_than_the_cap(cluster, run_operator,
                                                                      monkeypatch):
    """Every node under a job reports GPUUnhealthy at once (a bad health-checker rollout, say):
    with a cap of 2 a minute, 2 are cordoned, the rest annotated and avoided by the job only."""
    nodes = [n.metadata.name for n in cluster.core.list_node(label_selector="type=kwok").items
             if not n.spec.unschedulable]
    monkeypatch.setenv("CRUCIBLE_OPERATOR_MAX_CORDONS_PER_MINUTE", "2")
    try:
        with run_operator(cluster.namespace) as runner:
            cluster.create_job("gpt", nodes={"min": 1, "max": len(nodes)},
                               resources={"limits": {"nvidia.com/gpu": 8}},
                               faultTolerance={"nodeFailureConditions": ["GPUUnhealthy"],
                                               "nodeFailureGraceSeconds": 2})
            cluster.wait_running("gpt", len(nodes), generation=0, timeout_s=90)
            for node in nodes:
                _condition(cluster, node, "True")
            reported = eventually(lambda: (r := {
                n.metadata.name: n for n in cluster.core.list_node(label_selector="type=kwok")
                .items if (n.metadata.annotations or {}).get("crucible.dev/failure-reason")})
                and len(r) == len(nodes) and r, 30, "every failed node annotated")
            cordoned = [name for name, n in reported.items() if n.spec.unschedulable]
            skipped = [name for name, n in reported.items()
                       if "crucible.dev/cordon-skipped" in n.metadata.annotations]
            assert len(cordoned) == 2, cordoned
            assert sorted(skipped) == sorted(set(nodes) - set(cordoned))
            assert sorted(cluster.status("gpt").get("cordonedNodes") or []) == sorted(cordoned)
            eventually(lambda: cluster.event_reasons("gpt").count("CordonRateLimited")
                       == len(nodes) - 2, 10, "an event per node left uncordoned")
            time.sleep(5)   # and no more cordons arrive within the minute
            assert sum(1 for name in nodes if cluster.core.read_node(name).spec.unschedulable) == 2
            cluster.delete_job("gpt")
    finally:
        for node in nodes:
            _condition(cluster, node, "False")
            cluster.forget_failure(node)
    assert_clean_exit(runner, "CordonRateLimited")
