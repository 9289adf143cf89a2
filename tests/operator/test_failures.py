"""Failure classification, table by table: which failures spend the restart budget."""

from __future__ import annotations

import pytest

from crucible.operator import failures as f
from tests.operator import builders as b

FT = b.spec(faultTolerance={"retryableExitCodes": [75],
                            "nodeFailureConditions": ["GPUUnhealthy"]}).fault_tolerance


@pytest.mark.parametrize("pod, cause, kind", [
    (dict(exit_code=1), "ApplicationError", "application"),
    (dict(exit_code=2), "ApplicationError", "application"),
    (dict(exit_code=127), "ApplicationError", "application"),
    (dict(exit_code=75), "RetryableExitCode", "infrastructure"),
    # The trainer's checkpoint store did not answer (its termination message says so): an outage.
    # (Counted while the job has no commit: see the test below; this table's jobs have none.)
    (dict(exit_code=1, terminated_message="StorageUnavailable: cannot list the checkpoints: "
          "cannot reach the S3 endpoint"), "StorageUnavailable", "application"),
    (dict(exit_code=1, terminated_message="oops: StorageUnavailable: quoted"), "ApplicationError",
     "application"),
    (dict(exit_code=1, terminated_message="stopped by the stability guard: ..."),
     "ApplicationError", "application"),
    (dict(exit_code=128), "Signal", "infrastructure"),
    (dict(exit_code=137), "Signal", "infrastructure"),      # SIGKILL
    (dict(exit_code=143), "Signal", "infrastructure"),      # SIGTERM
    # Over its own memory limit: the spec's limit against the program's use, which no retry
    # fixes; counted, so an OOM loop ends.
    (dict(exit_code=137, terminated_reason="OOMKilled"), "OOMKilled", "application"),
    (dict(reason="Evicted"), "Evicted", "infrastructure"),
    (dict(exit_code=1, reason="Evicted"), "Evicted", "infrastructure"),  # eviction wins
    (dict(exit_code=143, disruption="DeletionByTaintManager"), "Disrupted", "infrastructure"),
    (dict(exit_code=1, disruption="PreemptionByScheduler"), "Disrupted", "infrastructure"),
    (dict(), "PodFailed", "infrastructure"),                 # failed, no container state
])
def test_failed_pods_are_classified(pod, cause, kind):
    failure = f.pod_failure(b.pod(0, 1, phase="Failed", **pod), FT)
    assert (failure.cause, failure.kind) == (cause, kind)
    assert failure.counted == (kind == "application")
    assert "gpt-0-1" in failure.message


@pytest.mark.parametrize("phase", ["Running", "Pending", "Succeeded"])
def test_pods_that_have_not_failed_are_not_failures(phase):
    assert f.pod_failure(b.pod(0, 0, phase=phase), FT) is None


@pytest.mark.parametrize("node, reason", [
    (dict(ready="Unknown"), "NodeUnreachable"),
    (dict(ready="False"), "NodeNotReady"),
    # The node controller's leftover taints on a node Ready again: pods placed there since are
    # fine (the scheduler places them while the taint lasts), never failed for the old outage.
    (dict(taints=[("node.kubernetes.io/unreachable", "NoExecute", 5)]), None),
    (dict(taints=[("node.kubernetes.io/not-ready", "NoExecute", 5)]), None),
    (dict(ready="Unknown", taints=[("node.kubernetes.io/unreachable", "NoExecute", 5)]),
     "NodeUnreachable"),
    (dict(conditions={"GPUUnhealthy": "True"}), "NodeGPUUnhealthy"),
    (dict(conditions={"GPUUnhealthy": "False"}), None),
    (dict(conditions={"SomethingElse": "True"}), None),          # not configured
    (dict(taints=[("node.kubernetes.io/unreachable", "NoSchedule", 5)]), None),
    (dict(unschedulable=True), None),                            # cordoned is not broken
    (dict(), None),
])
def test_node_failures_are_classified(node, reason):
    broken = f.node_failure("gpu-node-5", b.node("gpu-node-5", since=10, **node), FT)
    assert (broken.reason if broken else None) == reason
    if broken:
        assert broken.age_s(b.at(70)) in (60, 65)


def test_a_deleted_node_has_failed_since_forever():
    broken = f.node_failure("gpu-node-9", None, FT)
    assert broken.reason == "NodeDeleted" and broken.age_s(b.at(0)) == float("inf")


def test_terminating_counts_from_the_end_of_the_grace_period():
    pod = b.pod(0, 0, deletion=100)            # deletionTimestamp = request + grace
    assert not f.stuck_terminating(pod, FT, b.at(100 + 119))
    assert f.stuck_terminating(pod, FT, b.at(100 + 120))
    assert not f.stuck_terminating(b.pod(0, 0), FT, b.at(10_000))


@pytest.mark.parametrize("waiting, reason, hopeless", [
    ("ImagePullBackOff", "ImagePullFailed", True), ("ErrImagePull", "ImagePullFailed", True),
    ("InvalidImageName", "ImagePullFailed", True),
    ("CreateContainerConfigError", "ContainerConfigError", True),
    ("ContainerCreating", None, None),
])
def test_pending_problems(waiting, reason, hopeless):
    problem = f.pending_problem(b.pod(0, 0, phase="Pending", waiting=waiting))
    assert (problem.reason, problem.hopeless) == (reason, hopeless) if reason else problem is None


def test_unschedulable_pods_carry_the_schedulers_message():
    msg = "0/4 nodes are available: 4 node(s) didn't match Pod's node affinity/selector."
    problem = f.pending_problem(b.pod(0, 0, phase="Pending", node=None, unschedulable=msg))
    assert problem.reason == "Unschedulable" and msg in problem.message and not problem.hopeless
    assert not f.pending_too_long(b.pod(0, 0, phase="Pending", created=0), FT, b.at(599))
    assert f.pending_too_long(b.pod(0, 0, phase="Pending", created=0), FT, b.at(600))


def test_an_unreachable_taint_counts_on_a_node_without_a_ready_condition():
    from crucible.operator.observed import node_view
    bare = node_view({"metadata": {"name": "n"}, "spec": {"taints": [
        {"key": "node.kubernetes.io/unreachable", "effect": "NoExecute", "timeAdded": b.ts(5)}]},
        "status": {}})
    assert f.node_failure("n", bare, FT).reason == "NodeUnreachable"


def test_an_oom_whose_exit_code_is_listed_as_retryable_is_infrastructure_again():
    ft = b.spec(faultTolerance={"retryableExitCodes": [137]}).fault_tolerance
    failure = f.pod_failure(b.pod(0, 1, phase="Failed", exit_code=137,
                                  terminated_reason="OOMKilled"), ft)
    assert (failure.cause, failure.kind) == ("Signal", "infrastructure")


def test_a_stop_for_the_stores_outage_counts_until_the_job_has_committed_there():
    """`StorageUnavailable:` is an outage (not counted) once the job has committed a checkpoint,
    its storage settings proven; before that it may as well be a wrong endpoint or a blocked
    egress, which no restart fixes: counted, so the job fails instead of restarting for ever."""
    pod = b.pod(0, 1, phase="Failed", exit_code=1, terminated_message="StorageUnavailable: "
                "cannot list the checkpoints: cannot reach the S3 endpoint for s3://b/run")
    outage = f.pod_failure(pod, FT, store_answered=True)
    assert (outage.cause, outage.counted) == ("StorageUnavailable", False)
    first = f.pod_failure(pod, FT)
    assert (first.cause, first.counted) == ("StorageUnavailable", True)
    assert "AWS_ENDPOINT_URL" in first.message
