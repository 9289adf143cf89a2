"""The operator's cluster-wide cap on cordons: a burst of node failures never empties the pool.

`CordonLimit` on its own (a fake clock), then the adapter against the real apiserver with the
operator's own credentials: with a limit of one a minute, the first of two cordons lands, the
second is carried out as an annotation only, and the pass's status and events say so.
"""

from __future__ import annotations

import time

import pytest
from kubernetes import client, config

from crucible.operator import handlers
from crucible.operator.decision import Action, Outcome
from crucible.operator.kube import CordonLimit, Kube
from tests.operator import builders as b


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_limit_counts_cordons_in_any_60_seconds():
    clock = Clock()
    limit = CordonLimit(2, clock)
    assert limit.take() and limit.take() and not limit.take()
    clock.now += 59.9
    assert not limit.take()
    clock.now += 0.1                      # the first two are a minute old
    assert limit.take() and limit.take() and not limit.take()
    assert not CordonLimit(0, clock).take()   # 0: never cordon


def _cordon(node: str) -> Action:
    return Action("patch_node", "Node", node, {
        "spec": {"unschedulable": True},
        "metadata": {"annotations": {"crucible.dev/failure-reason": "NodeNotReady",
                                     "crucible.dev/failure-job": "team-a/gpt",
                                     "crucible.dev/cordoned-by": "team-a/gpt"}}}, "Cordon")


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
