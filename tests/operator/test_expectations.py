"""Creates the watches have not shown yet are not sent again (operator/expectations.py).

`Expectations` on its own (a fake clock); then the adapter against the real apiserver: a pass
that runs again before the watch showed its pods sends no second create (counted on the client
the adapter calls), one that runs after the pod index saw them and the pod was deleted creates
it again, and a create that failed is not waited for.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from kubernetes import client

from crucible.operator.decision import Action, Outcome
from crucible.operator.expectations import Expectations
from crucible.operator.kube import Kube
from tests.operator import builders as b
from tests.support.clock import FakeClock


def test_an_expected_create_is_not_sent_again_until_seen_failed_or_timed_out():
    clock = FakeClock()
    expected = Expectations(ttl_s=30, clock=clock)
    job, other = ("ns", "gpt"), ("ns", "bert")
    assert expected.expect(job, "Pod", "a")
    assert not expected.expect(job, "Pod", "a")          # sent; the watch has not shown it
    assert expected.pending(job) == {("Pod", "a")} and expected.pending(other) == set()
    assert expected.expect(job, "Pod", "b")              # another name
    assert expected.expect(other, "Pod", "a")            # another job
    assert expected.expect(job, "Service", "a")          # another kind
    expected.seen(job, "Pod", "a")
    assert ("Pod", "a") not in expected.pending(job)
    assert expected.expect(job, "Pod", "a")              # shown, then gone: create it again
    clock.now += 29.9
    assert not expected.expect(job, "Pod", "a")
    clock.now += 0.1                                     # no watch ever showed it
    assert expected.pending(job) == set()
    assert expected.expect(job, "Pod", "a")
    clock.now += 30
    assert len(expected) == 4 and expected.expired() == 4 and len(expected) == 0
    expected.seen(job, "Pod", "a")                       # nothing expected: no error


class Counting:
    """The adapter's CoreV1Api with its pod creates counted (the calls still go to the API)."""

    def __init__(self, core):
        self.core, self.creates = core, 0

    def __getattr__(self, name):
        return getattr(self.core, name)

    def create_namespaced_pod(self, *args, **kwargs):
        self.creates += 1
        return self.core.create_namespaced_pod(*args, **kwargs)


def _pod(namespace: str, name: str) -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"restartPolicy": "Never", "nodeSelector": {"crucible.dev/none": "none"},
                     "containers": [{"name": "c", "image": "registry.invalid/x:1"}]}}


@pytest.mark.stack
def test_a_pass_before_the_watch_caught_up_does_not_create_its_pods_again(kube, namespace):
    from crucible.operator.handlers import pods_by_job
    from crucible.operator.observed import pod_view
    from tests.operator.passes import pass_memo

    api = kube.client()
    memo = pass_memo(api)
    adapter = memo.kube
    core = adapter.core = Counting(adapter.core)
    try:
        job = replace(b.job(), namespace=namespace)
        create = Action("create", "Pod", "gpt-0-0", _pod(namespace, "gpt-0-0"))
        first = adapter.apply(job, Outcome(actions=(create,)))
        assert first.created_pods == ["gpt-0-0"] and core.creates == 1
        again = adapter.apply(job, Outcome(actions=(create,)))     # the watch is behind
        assert again.created_pods == [] and not again.rejected and not again.transient
        assert core.creates == 1
        # The pod watch shows it (kopf calls the pod index with the body); then it is deleted:
        # the next pass that finds it missing creates it again.
        body = api.sanitize_for_serialization(
            client.CoreV1Api(api).read_namespaced_pod("gpt-0-0", namespace))
        body["metadata"]["labels"] = {"crucible.dev/job": b.JOB}
        index = {(namespace, b.JOB): [pod_view(body)]}
        asyncio.run(pods_by_job(namespace=namespace, labels=body["metadata"]["labels"],
                                body=body, memo=memo, pods_by_job=index))
        assert adapter.expected.pending((namespace, b.JOB)) == set()
        client.CoreV1Api(api).delete_namespaced_pod("gpt-0-0", namespace, grace_period_seconds=0)
        third = adapter.apply(job, Outcome(actions=(create,)))
        assert core.creates == 2 and not third.rejected      # created, or still there: a 409
        # A pass whose snapshot was taken while a create was on its way, and that applies after
        # the watch showed the pod: its snapshot lacks the pod and the create is no longer
        # expected, but it was when the snapshot was taken, and that is what counts.
        other = Action("create", "Pod", "gpt-0-1", _pod(namespace, "gpt-0-1"))
        adapter.apply(job, Outcome(actions=(other,)))
        assert core.creates == 3
        in_flight = adapter.expected.pending((namespace, b.JOB))
        assert ("Pod", "gpt-0-1") in in_flight
        adapter.expected.seen((namespace, b.JOB), "Pod", "gpt-0-1")      # the watch shows it
        late = adapter.apply(job, Outcome(actions=(other,)), in_flight)
        assert late.created_pods == [] and core.creates == 3
        # A create that met a 409 leaves nothing expected (its object may have been shown
        # before the create was sent); nor does a create the API refuses.
        adapter.expected.seen((namespace, b.JOB), "Pod", "gpt-0-1")
        exists = adapter.apply(job, Outcome(actions=(other,)))
        assert exists.created_pods == [] and core.creates == 4
        assert ("Pod", "gpt-0-1") not in adapter.expected.pending((namespace, b.JOB))
        bad = Action("create", "Pod", "Bad_Name", _pod(namespace, "Bad_Name"))
        refused = adapter.apply(job, Outcome(actions=(bad,)))
        assert refused.rejected and core.creates == 5
        adapter.apply(job, Outcome(actions=(bad,)))
        assert core.creates == 6
    finally:
        memo.executor.shutdown(wait=False)
        adapter.events.shutdown(wait=False)
