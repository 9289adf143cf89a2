"""Stragglers the trainer reports, as the operator handles them (pure: decide() scenario by
scenario): status and an event by default; with replaceAfterMinutes the slow pod's node is
quarantined and the pod replaced once it stayed slow that long (pod 0: the group restarts)."""

from __future__ import annotations

import dataclasses

import pytest

from crucible.api.progress import ProgressReport, Straggler
from crucible.operator import manifests as m
from crucible.operator.cluster_policy import ClusterPolicy, parse_label_selector
from crucible.operator.decision import decide
from crucible.operator.observed import lease_view
from tests.operator import builders as b
from tests.operator.test_decision import acts, reasons, running_status


def _lease(*slow: tuple[int, int, float], step_time: float = 0):
    """The Lease listing stragglers as (rank, pod index, ratio), pods of generation 0."""
    report = ProgressReport(step=100, step_time=b.at(step_time), loss=3.0, tokens=100, world_size=4,
                            stragglers=tuple(Straggler(rank, m.pod_name(b.JOB, 0, index), ratio)
                                             for rank, index, ratio in slow))
    return lease_view({"metadata": {"annotations": report.to_annotations()}, "spec": {}})


def _decide(status, lease, t, replace_after: int = 0, pods=None, policy=ClusterPolicy(),
            nodes=None):
    ft = {**b.spec_doc()["faultTolerance"], "stragglers": {"replaceAfterMinutes": replace_after}}
    h = m.spec_hash(b.spec(faultTolerance=ft))
    return decide(b.job(status=status, faultTolerance=ft),
                  b.observed(pods or b.running(0, 4, h), nodes=nodes, lease_view_=lease),
                  b.at(t), policy)


def _replaced(index: int, node: str, created: float, replace_after: int) -> list:
    """The running pods after pod `index` was recreated on `node`: same name, a new UID."""
    ft = {**b.spec_doc()["faultTolerance"], "stragglers": {"replaceAfterMinutes": replace_after}}
    h = m.spec_hash(b.spec(faultTolerance=ft))
    pods = b.running(0, 4, h)
    pods[index] = b.pod(0, index, node=node, uid="uid-replacement", created=created,
                        spec_hash=h)
    return pods


def test_a_reported_straggler_is_in_status_with_its_node_and_an_event_once():
    first = _decide(running_status(), _lease((9, 2, 1.31)), 10)
    assert first.status["stragglers"] == [{"rank": 9, "pod": "gpt-0-2", "ratio": 1.31,
                                           "node": "gpu-node-2"}]
    assert reasons(first).count("Straggler") == 1
    again = _decide(first.status, _lease((9, 2, 1.33)), 20)
    assert "Straggler" not in reasons(again)        # the same one: no second event
    assert not acts(again, "force_delete") and not acts(again, "patch_node")  # report only
    cleared = _decide(again.status, _lease(), 30)
    assert cleared.status["stragglers"] == [] and not cleared.status["tracking"]["stragglerSince"]


def test_with_replace_after_minutes_the_slow_pod_is_replaced_and_its_node_avoided_untouched():
    slow = _lease((9, 2, 1.4))
    seen = _decide(running_status(), slow, 0, replace_after=5)
    assert not acts(seen, "force_delete") and seen.wake_in_s == 300
    waiting = _decide(seen.status, slow, 200, replace_after=5)
    assert not acts(waiting, "force_delete")
    due = _decide(waiting.status, slow, 301, replace_after=5)
    assert acts(due, "force_delete") == [("force_delete", "Pod", "gpt-0-2")]
    # The report is the tenant's code speaking: by default no node is cordoned or annotated.
    assert not acts(due, "patch_node")
    assert [e["node"] for e in due.status["tracking"]["badNodes"]] == ["gpu-node-2"]
    assert "--straggler-cordon-selector" in " ".join(e.message for e in due.events
                                                      if e.reason == "Straggler")
    assert due.status["restarts"]["byCause"] == {"Straggler": 1}
    assert due.status["restarts"]["application"] == 0  # not the program's fault
    # The same report read again before the trainer clears it: handled once.
    later = _decide(due.status, slow, 302, replace_after=5)
    assert not acts(later, "force_delete") and later.status["restarts"]["total"] == 1


def test_a_straggling_pod_0_restarts_the_group():
    slow = _lease((0, 0, 1.5))
    seen = _decide(running_status(), slow, 0, replace_after=1)
    due = _decide(seen.status, slow, 61, replace_after=1)
    assert due.status["podGeneration"] == 1  # a new generation, its store on a new pod 0
    assert due.status["restarts"]["byCause"] == {"Straggler": 1}


def test_the_old_report_is_not_held_against_the_pod_that_replaced_the_straggler():
    slow = _lease((9, 2, 1.4))                   # taken at t=0, about the pod on gpu-node-2
    seen = _decide(running_status(), slow, 0, replace_after=5)
    due = _decide(seen.status, slow, 301, replace_after=5)
    assert acts(due, "force_delete") == [("force_delete", "Pod", "gpt-0-2")]
    # Recreated at t=310 on gpu-node-5; the restarted trainer has not written a report yet.
    pods = _replaced(2, "gpu-node-5", created=310, replace_after=5)
    stale = _decide(due.status, slow, 320, replace_after=5, pods=pods)
    assert not acts(stale, "force_delete") and not acts(stale, "patch_node")
    assert stale.status["stragglers"] == [] and "Straggler" not in reasons(stale)
    assert stale.status["restarts"]["total"] == 1
    # A new report (taken after the replacement started) that names it again: its own clock.
    fresh = _lease((9, 2, 1.4), step_time=400)
    again = _decide(stale.status, fresh, 401, replace_after=5, pods=pods)
    assert again.status["stragglers"][0]["node"] == "gpu-node-5"
    assert reasons(again).count("Straggler") == 1 and again.wake_in_s == 300
    assert not acts(again, "force_delete") and not acts(again, "patch_node")
    due_again = _decide(again.status, fresh, 702, replace_after=5, pods=pods)
    assert acts(due_again, "force_delete") == [("force_delete", "Pod", "gpt-0-2")]


ALLOWED = ClusterPolicy.from_settings(
    "*", 6, straggler_cordon_selector="crucible.dev/straggler-cordon=allowed")


def _nodes(labelled: set[str]) -> dict:
    nodes = b.healthy_nodes()
    return {name: dataclasses.replace(view, labels=(
        (("crucible.dev/straggler-cordon", "allowed"),) if name in labelled else ()))
        for name, view in nodes.items()}


def _due(policy, nodes):
    slow = _lease((9, 2, 1.4))
    seen = _decide(running_status(), slow, 0, replace_after=1, policy=policy, nodes=nodes)
    return _decide(seen.status, slow, 61, replace_after=1, policy=policy, nodes=nodes)


def test_only_a_node_the_administrator_labelled_is_cordoned_on_a_straggler_report():
    due = _due(ALLOWED, _nodes({"gpu-node-2"}))
    (patch,) = [a for a in due.actions if a.verb == "patch_node"]
    assert patch.name == "gpu-node-2" and patch.body["spec"] == {"unschedulable": True}
    assert patch.body["metadata"]["annotations"]["crucible.dev/failure-reason"] == "Straggler"
    # A node without the label (a control-plane node a forged report aimed at, say) is not.
    for policy, labelled in ((ALLOWED, {"gpu-node-1"}), (ClusterPolicy(), {"gpu-node-2"})):
        due = _due(policy, _nodes(labelled))
        assert not acts(due, "patch_node")
        assert acts(due, "force_delete") == [("force_delete", "Pod", "gpt-0-2")]


@pytest.mark.parametrize("text, pairs", [
    ("pool=gpu", (("pool", "gpu"),)),
    (" b=2 , a.example.com/x=y ", (("a.example.com/x", "y"), ("b", "2"))),
    ("empty=", (("empty", ""),)),
])
def test_the_straggler_cordon_selector_parses_equality_labels(text, pairs):
    assert parse_label_selector(text) == pairs


@pytest.mark.parametrize("text", ["pool", "pool!=gpu", "pool in (gpu)", "=gpu", "a=b,", "k=v w",
                                  "x/y/z=1", "a=1,a=2"])
def test_a_malformed_straggler_cordon_selector_is_refused_with_an_example(text):
    with pytest.raises(ValueError, match=r"--straggler-cordon-selector: .*\(e\.g\. "):
        parse_label_selector(text)
