"""How long the operator's cordon of a failed node lasts, and who may end it (quarantine.py).

Pure: node views as the apiserver writes them (managedFields included) and times in, a merge
patch out. The stack test in test_node_failure.py runs the same against real nodes.
"""

from __future__ import annotations

import pytest

from crucible.api.progress import parse_time
from crucible.operator import quarantine as q
from crucible.operator.decision import decide
from crucible.operator.cluster_policy import ClusterPolicy
from tests.operator import builders as b
from tests.operator.test_decision import H, running_status

HOUR = 3600.0


def _ours(until: float, *, count: int = 1, ready: str = "True", **kw):
    """A node the operator cordoned, its quarantine ending at `until`."""
    return b.node("gpu-node-2", ready=ready, unschedulable=True,
                  cordoned_by_manager=q.FIELD_MANAGER, annotations={
                      q.CORDONED_BY: "team-a/gpt", q.UNTIL: b.ts(until), q.COUNT: str(count),
                      q.FAILURE_REASON: kw.pop("reason", "NodeUnreachable")}, **kw)


def test_a_cordon_lasts_the_period_and_a_failure_on_probation_doubles_it():
    fresh = q.cordon_annotations(b.node("gpu-node-2"), b.at(0), HOUR)
    assert fresh == {q.UNTIL: b.ts(HOUR), q.COUNT: "1"}
    on_probation = b.node("gpu-node-2", annotations={q.PROBATION: b.ts(5000), q.COUNT: "2"})
    again = q.cordon_annotations(on_probation, b.at(4000), HOUR)
    assert again == {q.UNTIL: b.ts(4000 + 4 * HOUR), q.COUNT: "3"}
    # Probation over: a failure long after starts from one period again.
    assert q.cordon_annotations(on_probation, b.at(6000), HOUR)[q.COUNT] == "1"
    assert q.cordon_annotations(b.node("gpu-node-2"), b.at(0), 0) == {}   # never expires
    huge = b.node("gpu-node-2", annotations={q.PROBATION: b.ts(10), q.COUNT: "40"})
    assert q.cordon_annotations(huge, b.at(0), HOUR)[q.UNTIL] == b.ts(q.MAX_PERIOD_S)


def test_the_operators_cordon_ends_once_its_quarantine_is_over_and_the_node_is_healthy():
    node = _ours(HOUR)
    patch, due = q.release(node, b.at(HOUR - 10), HOUR)
    assert patch is None and due == pytest.approx(10)
    patch, due = q.release(node, b.at(HOUR), HOUR)
    assert patch["spec"] == {"unschedulable": False}
    ann = patch["metadata"]["annotations"]
    assert ann[q.CORDONED_BY] is None and ann[q.UNTIL] is None
    assert ann[q.PROBATION] == b.ts(2 * HOUR)         # on probation for one more period


def test_a_node_still_broken_stays_cordoned_and_is_asked_again():
    patch, due = q.release(_ours(HOUR, ready="Unknown"), b.at(2 * HOUR), HOUR)
    assert patch is None and due == q.CHECK_INTERVAL_S
    gpu = _ours(HOUR, reason="NodeGPUUnhealthy", conditions={"GPUUnhealthy": "True"})
    assert q.release(gpu, b.at(2 * HOUR), HOUR)[0] is None
    repaired = _ours(HOUR, reason="NodeGPUUnhealthy", conditions={"GPUUnhealthy": "False"})
    assert q.release(repaired, b.at(2 * HOUR), HOUR)[0]["spec"] == {"unschedulable": False}


def test_a_cordon_someone_else_set_or_took_over_is_never_lifted():
    """The node carries the operator's annotations, but the last to set spec.unschedulable was
    a person (`kubectl cordon` after someone uncordoned it): the cordon stays; the operator
    drops its claim."""
    theirs = b.node("gpu-node-2", unschedulable=True, cordoned_by_manager="kubectl-cordon",
                    annotations={q.CORDONED_BY: "team-a/gpt", q.UNTIL: b.ts(0)})
    patch, _ = q.release(theirs, b.at(2 * HOUR), HOUR)
    assert "spec" not in patch
    assert patch["metadata"]["annotations"] == {q.CORDONED_BY: None, q.UNTIL: None}
    uncordoned = b.node("gpu-node-2", annotations={q.CORDONED_BY: "team-a/gpt",
                                                   q.UNTIL: b.ts(HOUR)})
    patch, _ = q.release(uncordoned, b.at(0), HOUR)
    assert "spec" not in patch and patch["metadata"]["annotations"][q.CORDONED_BY] is None
    # Without the operator's claim there is nothing to do, whoever cordoned it.
    admin = b.node("gpu-node-2", unschedulable=True)
    assert q.release(admin, b.at(10 * HOUR), HOUR) == (None, None)


def test_the_cordon_a_pass_sets_says_until_when():
    nodes = b.healthy_nodes()
    nodes["gpu-node-2"] = b.node("gpu-node-2", ready="Unknown", since=20)
    out = decide(b.job(status=running_status()), b.observed(b.running(0, 4, H), nodes=nodes),
                 b.at(81), ClusterPolicy(quarantine_s=600))
    (patch,) = [a for a in out.actions if a.verb == "patch_node"]
    ann = patch.body["metadata"]["annotations"]
    assert patch.body["spec"] == {"unschedulable": True}
    assert parse_time(ann[q.UNTIL]) == b.at(81 + 600) and ann[q.COUNT] == "1"


def test_a_cordon_an_earlier_version_made_is_the_operators_and_lasts_one_period():
    """Before the operator named its field manager, its cordons carry the python client's
    default one and no quarantine-until: they end one period after their failure-time."""
    old = b.node("gpu-node-2", unschedulable=True, cordoned_by_manager=q.LEGACY_MANAGER,
                 annotations={q.CORDONED_BY: "team-a/gpt", q.FAILURE_TIME: b.ts(0),
                              q.FAILURE_REASON: "NodeUnreachable"})
    assert q.release(old, b.at(HOUR - 1), HOUR) == (None, pytest.approx(1))
    assert q.release(old, b.at(HOUR), HOUR)[0]["spec"] == {"unschedulable": False}


def test_a_count_annotation_anyone_could_write_never_breaks_the_loop():
    bad = b.node("gpu-node-2", unschedulable=True, cordoned_by_manager=q.FIELD_MANAGER,
                 annotations={q.CORDONED_BY: "a/b", q.UNTIL: b.ts(HOUR), q.COUNT: "lots"})
    assert q.release(bad, b.at(2 * HOUR), HOUR)[0]["spec"] == {"unschedulable": False}
    assert q.cordon_annotations(b.node("n", annotations={q.PROBATION: b.ts(10), q.COUNT: "x"}),
                                b.at(0), HOUR)[q.COUNT] == "2"
