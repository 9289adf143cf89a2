"""decide() when GPUs run out, and when the store host or a pod's deletion takes the group down.

Pure scenarios (no cluster, no clock), as in test_decision.py: a generation short of capacity
for `capacityTimeoutSeconds` releases its pods and waits, retrying with backoff or as soon as a
the operator grants it room; an exit that follows a deletion, or the loss of pod 0, is never the
program's failure; a failed node is avoided for `avoidFailedNodesMinutes` unless someone
uncordoned it after the operator's cordon.
"""

from __future__ import annotations

import pytest

from crucible.api.progress import parse_time
from crucible.operator import capacity
from crucible.operator import manifests as m
from crucible.operator.decision import decide
from crucible.operator.cluster_policy import ClusterPolicy
from crucible.operator.observed import pod_view
from tests.operator import builders as b
from tests.operator.test_decision import acts, cond, reasons, running_status

FULL = {"nodes": {"min": 4, "max": 4},
        "faultTolerance": {"capacityTimeoutSeconds": 600, "capacityRetrySeconds": 60}}
H = m.spec_hash(b.spec(**FULL))
NO_GPU = "0/4 nodes are available: 4 Insufficient nvidia.com/gpu."


def _short(gen: int) -> list:
    """Three pods placed, the fourth waiting for a GPU."""
    return b.running(gen, 3, H) + [b.pod(gen, 3, phase="Pending", node=None, spec_hash=H,
                                         unschedulable=NO_GPU)]


def _pass(status, pods, t, **obs):
    return decide(b.job(status=status, **FULL), b.observed(pods, **obs), b.at(t))


def _released(t_short=100.0):
    """A running job loses a node at t_short, then waits out its capacity timeout."""
    first = _pass(running_status(), _short(0), t_short)
    assert first.status["phase"] == "Waiting"
    assert first.wake_in_s == pytest.approx(600)
    still = _pass(first.status, _short(0), t_short + 599)
    assert still.status["podGeneration"] == 0 and not acts(still, "delete")
    return _pass(still.status, _short(0), t_short + 600)


def test_a_generation_short_for_the_capacity_timeout_releases_its_pods_uncounted():
    out = _released()
    assert out.status["podGeneration"] == 1          # the old pods are stale now
    assert out.status["phase"] == "Waiting"
    assert out.status["restarts"]["total"] == 0      # neither kind of restart
    assert cond(out, "PodsScheduled")["reason"] == "InsufficientCapacity"
    assert cond(out, "Running")["reason"] == "CapacityReleased"
    assert "CapacityReleased" in reasons(out)
    assert out.status["tracking"]["capacityHold"]["since"] == b.ts(700)
    # The next pass deletes the held pods and creates none, however often it runs.
    for t in (701, 720, 740):
        nxt = _pass(out.status, _short(0), t)
        assert sorted(acts(nxt, "delete")) == [("delete", "Pod", f"gpt-0-{i}") for i in range(4)]
        assert not acts(nxt, "create", "Pod")
        assert nxt.status["phase"] == "Waiting" and nxt.status["podGeneration"] == 1
        assert nxt.wake_in_s is not None and nxt.wake_in_s > 0


def test_a_released_job_retries_after_the_backoff():
    out = _released()
    due = (parse_time(out.status["tracking"]["capacityHold"]["until"]) - b.at(0)).total_seconds()
    assert 700 + 60 <= due <= 700 + 60 * 1.25        # capacityRetrySeconds plus its jitter
    early = _pass(out.status, [], due - 1)
    assert not acts(early, "create", "Pod")
    retry = _pass(early.status, [], due)
    assert "CapacityRetry" in reasons(retry)
    assert acts(retry, "create", "Pod") == [("create", "Pod", "gpt-1-0")]   # pod 0 first
    assert "capacityHold" not in retry.status["tracking"]


def test_a_released_job_retries_at_once_when_the_operator_grants_it_room():
    out = _released()
    retry = _pass(out.status, [], 705, capacity_granted=True)
    assert "CapacityRetry" in reasons(retry)
    assert acts(retry, "create", "Pod") == [("create", "Pod", "gpt-1-0")]


def test_a_released_job_the_operator_sees_no_room_for_waits_past_its_backoff_up_to_the_cap():
    """Its backoff alone would send it after part of a gang again: it waits for a grant, or
    RETRY_CAP_S at most (the operator does not see every pod)."""
    out = _released()
    due = (parse_time(out.status["tracking"]["capacityHold"]["until"]) - b.at(0)).total_seconds()
    later = _pass(out.status, [], due + 10, capacity_granted=False)
    assert not acts(later, "create", "Pod") and "CapacityRetry" not in reasons(later)
    assert later.status["phase"] == "Waiting"
    assert later.wake_in_s == pytest.approx(700 + capacity.RETRY_CAP_S - (due + 10))
    capped = _pass(later.status, [], 700 + capacity.RETRY_CAP_S, capacity_granted=False)
    assert acts(capped, "create", "Pod") == [("create", "Pod", "gpt-1-0")]


def test_a_retry_still_short_releases_after_the_retry_window_and_backs_off_longer():
    out = _released()
    retry = _pass(out.status, [], 705, capacity_granted=True)
    still = _pass(retry.status, _short(1), 706)
    assert still.status["phase"] == "Waiting" and still.status["podGeneration"] == 1
    again = _pass(still.status, _short(1), 705 + 60)
    assert again.status["podGeneration"] == 2 and "CapacityReleased" in reasons(again)
    hold = again.status["tracking"]["capacityHold"]
    wait = (parse_time(hold["until"]) - b.at(765)).total_seconds()
    assert 120 <= wait <= 120 * 1.25                  # doubled after a second release
    assert again.status["restarts"]["total"] == 0
    # A grant that lost the race keeps the job's place in line: where it first joined it.
    assert hold["since"] == out.status["tracking"]["capacityHold"]["since"] == b.ts(700)


def test_running_again_resets_the_wait_and_the_backoff():
    out = _released()
    retry = _pass(out.status, [], 705, capacity_granted=True)
    running = _pass(retry.status, b.running(1, 4, H), 720)
    assert running.status["phase"] == "Running"
    for key in ("capacityRetries", "capacityWaitSince", "capacityHold", "capacityShort",
                capacity.IN_LINE_SINCE):
        assert key not in running.status["tracking"], key


def test_retry_delay_doubles_is_capped_and_its_jitter_is_fixed_per_job():
    assert capacity.retry_delay_s(60, 1, "a") == capacity.retry_delay_s(60, 1, "a")
    for uid in ("a", "b", "c"):
        assert 60 <= capacity.retry_delay_s(60, 1, uid) <= 75
        assert 120 <= capacity.retry_delay_s(60, 2, uid) <= 150
        assert capacity.RETRY_CAP_S <= capacity.retry_delay_s(60, 30, uid) \
            <= capacity.RETRY_CAP_S * 1.25
    spread = {capacity.retry_delay_s(60, 1, f"job-{i}") for i in range(20)}
    assert len(spread) > 10                           # jobs released together retry apart


# --- exits that are not the program's ------------------------------------------------------
HD = m.spec_hash(b.spec())


def test_an_exit_after_the_pod_was_deleted_is_infrastructure():
    # `kubectl delete pod`: torchrun gets SIGTERM and exits 1. Deletion asked at t=70 (the
    # deletionTimestamp is the end of the 30 s grace), the container ended at t=72.
    pods = b.running(0, 4, HD)
    pods[2] = b.pod(0, 2, phase="Failed", exit_code=1, node="gpu-node-2", deletion=100,
                    grace=30, finished=72, spec_hash=HD, uid="uid-gpt-0-2")
    out = decide(b.job(status=running_status()), b.observed(pods), b.at(73))
    assert out.status["restarts"]["application"] == 0
    assert out.status["restarts"]["byCause"] == {"PodDeleted": 1}
    assert out.status["podGeneration"] == 0           # one pod replaced, not the group
    # One that crashed first (t=50) and was then deleted by someone cleaning up: the program's.
    pods[2] = b.pod(0, 2, phase="Failed", exit_code=1, node="gpu-node-2", deletion=100,
                    grace=30, finished=50, spec_hash=HD, uid="uid-gpt-0-2")
    out = decide(b.job(status=running_status()), b.observed(pods), b.at(73))
    assert out.status["restarts"]["application"] == 1


def test_survivors_exiting_after_pod_0_vanished_restart_the_group_uncounted():
    # One pass sees both: pod 0 gone (its node was drained) and the others' exit 1.
    pods = [b.pod(0, i, phase="Failed", exit_code=1, node=f"gpu-node-{i}", spec_hash=HD)
            for i in (1, 2, 3)]
    out = decide(b.job(status=running_status()), b.observed(pods), b.at(50))
    assert out.status["podGeneration"] == 1
    assert out.status["restarts"]["application"] == 0
    assert out.status["restarts"]["byCause"] == {"PodDeleted": 1}
    assert "c10d store" in cond(out, "Restarting")["message"]


def test_survivors_exiting_while_pod_0_node_is_down_restart_uncounted_within_the_grace():
    nodes = b.healthy_nodes()
    nodes["gpu-node-0"] = b.node("gpu-node-0", ready="Unknown", since=20)
    pods = b.running(0, 4, HD)
    pods[1] = b.pod(0, 1, phase="Failed", exit_code=1, node="gpu-node-1", spec_hash=HD)
    out = decide(b.job(status=running_status()), b.observed(pods, nodes=nodes), b.at(30))
    assert out.status["podGeneration"] == 1
    assert out.status["restarts"]["application"] == 0
    assert out.status["restarts"]["byCause"] == {"NodeFailure": 1}
    assert not acts(out, "patch_node")                # the node is judged after its grace
    # With pod 0's node healthy the same exit is the program's.
    out = decide(b.job(status=running_status()), b.observed(pods), b.at(30))
    assert out.status["restarts"]["application"] == 1


# --- the per-job list of nodes to avoid ------------------------------------------------------
def _avoided(status, nodes, t, **spec):
    pods = b.running(0, 2, HD)
    out = decide(b.job(status=status, **spec),
                 b.observed(pods, nodes=nodes, lease_view_=b.lease(10, t)), b.at(t))
    created = [a for a in out.actions if a.verb == "create" and a.kind == "Pod"]
    assert created
    terms = [a.body["spec"].get("affinity") for a in created]
    return out, terms[0] is not None and "gpu-node-2" in str(terms[0])


def _bad(entry):
    return running_status(tracking={"members": {str(i): f"uid-gpt-0-{i}" for i in range(2)},
                                    "everRunning": True, "badNodes": [entry]})


def test_a_node_never_cordoned_is_avoided_until_the_expiry_once_healthy():
    nodes = b.healthy_nodes()     # gpu-node-2 is healthy and schedulable again
    entry = {"node": "gpu-node-2", "since": b.ts(100), "cordoned": False}
    out, avoided = _avoided(_bad(entry), nodes, 100 + 599)
    assert avoided and out.status["tracking"]["badNodes"][0]["node"] == "gpu-node-2"
    out, avoided = _avoided(_bad(entry), nodes, 100 + 600)      # 10 min by default
    assert not avoided and out.status["tracking"]["badNodes"] == []
    out, avoided = _avoided(_bad(entry), nodes, 100 + 120,
                            faultTolerance={"avoidFailedNodesMinutes": 1})
    assert not avoided


def test_a_cordoned_node_is_avoided_while_cordoned_and_trusted_at_once_when_uncordoned():
    entry = {"node": "gpu-node-2", "since": b.ts(100), "cordoned": False}
    cordoned = b.healthy_nodes()
    cordoned["gpu-node-2"] = b.node("gpu-node-2", unschedulable=True)
    out, avoided = _avoided(_bad(entry), cordoned, 100 + 5000)  # long past the expiry
    assert avoided
    seen = out.status["tracking"]["badNodes"][0]
    assert seen["cordoned"] is True
    out, avoided = _avoided(_bad(seen), b.healthy_nodes(), 100 + 10)  # uncordoned: repaired
    assert not avoided and out.status["tracking"]["badNodes"] == []


def test_a_broken_node_stays_avoided_past_the_expiry():
    nodes = b.healthy_nodes()
    nodes["gpu-node-2"] = b.node("gpu-node-2", ready="False", since=100)
    entry = {"node": "gpu-node-2", "since": b.ts(100), "cordoned": False}
    _, avoided = _avoided(_bad(entry), nodes, 100 + 86400)
    assert avoided


# --- the administrator's node policy -----------------------------------------------------------
def _gpu_unhealthy(policy):
    nodes = b.healthy_nodes()
    nodes["gpu-node-2"] = b.node("gpu-node-2", since=0, conditions={"GPUUnhealthy": "True"})
    spec = {"faultTolerance": {"nodeFailureConditions": ["GPUUnhealthy"]}}
    h = m.spec_hash(b.spec(**spec))
    return decide(b.job(status=running_status(), **spec),
                  b.observed(b.running(0, 4, h), nodes=nodes), b.at(100), policy)


def test_a_condition_the_operator_does_not_allow_is_ignored():
    assert acts(_gpu_unhealthy(ClusterPolicy()), "patch_node")          # any: acted on
    assert acts(_gpu_unhealthy(ClusterPolicy(frozenset({"GPUUnhealthy"}))), "patch_node")
    ignored = _gpu_unhealthy(ClusterPolicy(frozenset({"KernelDeadlock"})))
    assert not acts(ignored, "patch_node") and not acts(ignored, "force_delete")
    assert ignored.status["restarts"]["total"] == 0


def test_by_default_a_condition_true_on_healthy_nodes_cordons_nothing():
    """A tenant naming a condition that is True on every healthy node (EKS' node monitoring
    agent sets AcceleratedHardwareReady=True): with "*" the pool would be cordoned; the
    operator's default allow-list ignores it, and still takes the usual problem conditions."""
    from crucible.operator.handlers import OperatorConfig

    default = OperatorConfig().cluster_policy
    nodes = {name: b.node(name, conditions={"AcceleratedHardwareReady": "True"})
             for name in b.healthy_nodes()}
    spec = {"faultTolerance": {"nodeFailureConditions": ["AcceleratedHardwareReady"]}}
    h = m.spec_hash(b.spec(**spec))
    out = decide(b.job(status=running_status(), **spec),
                 b.observed(b.running(0, 4, h), nodes=nodes), b.at(100), default)
    assert not acts(out, "patch_node") and not acts(out, "force_delete")
    assert acts(_gpu_unhealthy(default), "patch_node")


def test_with_cordoning_off_a_failed_node_is_annotated_and_avoided_only():
    out = _gpu_unhealthy(ClusterPolicy(cordon=False))
    (patch,) = [a for a in out.actions if a.verb == "patch_node"]
    assert "spec" not in patch.body and patch.body["metadata"]["annotations"][
        "crucible.dev/failure-reason"] == "NodeGPUUnhealthy"
    assert "cordonedNodes" not in out.status
    assert [e["node"] for e in out.status["tracking"]["badNodes"]] == ["gpu-node-2"]
    assert any("--max-cordons-per-minute=0" in e.message for e in out.events)


def test_the_kubelet_conditions_are_refused_in_the_spec():
    with pytest.raises(ValueError, match="kubelet's own conditions"):
        b.spec(faultTolerance={"nodeFailureConditions": ["Ready"]})
    assert ClusterPolicy.from_settings("*", 6) == ClusterPolicy(None, True)
    assert ClusterPolicy.from_settings("GPUUnhealthy, KernelDeadlock", 0) == ClusterPolicy(
        frozenset({"GPUUnhealthy", "KernelDeadlock"}), False)


def test_one_node_failure_under_several_pods_counts_once_toward_an_infrastructure_loop():
    # Two pods of the job on one node that died: two replacements, one failure of the node.
    spec = {"faultTolerance": {"maxInfrastructureRestarts": 2, "nodeFailureGraceSeconds": 0}}
    h = m.spec_hash(b.spec(**spec))
    nodes = b.healthy_nodes()
    nodes["gpu-node-2"] = b.node("gpu-node-2", ready="Unknown", since=0)
    pods = b.running(0, 2, h) + [b.pod(0, i, node="gpu-node-2", spec_hash=h) for i in (2, 3)]
    out = decide(b.job(status=running_status(), **spec), b.observed(pods, nodes=nodes), b.at(10))
    assert out.status["restarts"]["byCause"] == {"NodeFailure": 2}
    assert out.status["phase"] != "Failed"
    assert len(out.status["tracking"]["infrastructureRestarts"]["NodeFailure:gpu-node-2"]) == 1


def test_a_failed_job_says_why_in_its_message():
    out = decide(b.job(nodes={"min": 5, "max": 2}), b.observed(), b.at(0))
    assert out.status["message"].startswith("Failed: InvalidSpec:")


def _waiting_avoiding(node: str):
    """Pod 1 of a running 2-pod job, still waiting for a node, rendered to keep off `node`."""
    body = b.pod_body(0, 1, phase="Pending", node=None, spec_hash=HD,
                      unschedulable="0/4 nodes are available: 1 node(s) didn't match Pod's "
                                    "node affinity/selector, 3 Insufficient nvidia.com/gpu.")
    body["spec"]["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [
            {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": [node]}]}]}}}
    return [b.pod(0, 0, node="gpu-node-0", spec_hash=HD), pod_view(body)]


def test_a_pending_pod_kept_off_a_node_trusted_again_is_recreated_uncounted():
    entry = {"node": "gpu-node-2", "since": b.ts(100), "cordoned": True}
    pods = _waiting_avoiding("gpu-node-2")
    assert pods[1].avoided_nodes == ("gpu-node-2",)
    # Still cordoned: the pod keeps waiting as it is.
    cordoned = b.healthy_nodes()
    cordoned["gpu-node-2"] = b.node("gpu-node-2", unschedulable=True)
    held = decide(b.job(status=_bad(entry)), b.observed(pods, nodes=cordoned,
                                                        lease_view_=b.lease(10, 200)), b.at(200))
    assert not acts(held, "delete") and "NodeTrusted" not in reasons(held)
    # Uncordoned and Ready: the waiting pod is deleted, not counted as a failure...
    out = decide(b.job(status=_bad(entry)), b.observed(pods, nodes=b.healthy_nodes(),
                                                       lease_view_=b.lease(10, 210)), b.at(210))
    assert acts(out, "delete") == [("delete", "Pod", "gpt-0-1")]
    assert "NodeTrusted" in reasons(out)
    assert out.status["tracking"]["badNodes"] == []
    # ...nor when its deletion is observed; once gone it comes back without the constraint.
    deleting = [pods[0], b.pod(0, 1, phase="Pending", node=None, spec_hash=HD, deletion=215)]
    seen = decide(b.job(status=out.status), b.observed(deleting, nodes=b.healthy_nodes(),
                                                       lease_view_=b.lease(11, 215)), b.at(215))
    gone = decide(b.job(status=seen.status), b.observed(pods[:1], nodes=b.healthy_nodes(),
                                                        lease_view_=b.lease(12, 220)), b.at(220))
    for later in (seen, gone):
        assert later.status["restarts"]["total"] == 0
    created = {a.name: a.body for a in gone.actions if a.verb == "create" and a.kind == "Pod"}
    assert "affinity" not in created["gpt-0-1"]["spec"]


def test_a_running_pod_is_never_recreated_for_its_affinity():
    pods = _waiting_avoiding("gpu-node-2")
    body = b.pod_body(0, 1, node="gpu-node-1", spec_hash=HD)
    body["spec"]["affinity"] = {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "NotIn",
                                   "values": ["gpu-node-2"]}]}]}}}
    out = decide(b.job(status=running_status()),
                 b.observed([pods[0], pod_view(body)], nodes=b.healthy_nodes(),
                            lease_view_=b.lease(10, 200)), b.at(200))
    assert not acts(out, "delete") and "NodeTrusted" not in reasons(out)


# --- a survivor's exit that was its store host's node dying --------------------------------------
TWO = {"nodes": {"min": 1, "max": 2}, "faultTolerance": {"nodeFailureGraceSeconds": 10}}
H2 = m.spec_hash(b.spec(**TWO))


def _survivor_exits(t=100):
    """Pod 1 exits 1 while pod 0 (the store host) still looks alive on a Ready node."""
    pods = [b.pod(0, 0, node="gpu-node-0", spec_hash=H2),
            b.pod(0, 1, node="gpu-node-1", spec_hash=H2, phase="Failed", exit_code=1,
                  finished=t - 1)]
    status = running_status(members={"0": "uid-gpt-0-0", "1": "uid-gpt-0-1"})
    out = decide(b.job(status=status, **TWO), b.observed(pods, nodes=b.healthy_nodes()), b.at(t))
    assert out.status["restarts"]["application"] == 1 and out.status["podGeneration"] == 1
    assert "gpu-node-0" in out.status["tracking"]["peerSuspect"]["nodes"]
    return out


def _later(prev, t, nodes):
    return decide(b.job(status=prev.status, **TWO), b.observed([], nodes=nodes), b.at(t))


def test_a_survivors_exit_is_recounted_as_its_store_hosts_node_failure():
    out = _survivor_exits()
    dead = b.healthy_nodes()
    dead["gpu-node-0"] = b.node("gpu-node-0", ready="Unknown", since=150)
    early = _later(out, 155, dead)                 # within nodeFailureGraceSeconds: not yet
    assert early.status["restarts"]["application"] == 1 and not acts(early, "patch_node")
    assert early.wake_in_s == pytest.approx(5)
    late = _later(early, 160, dead)
    r = late.status["restarts"]
    assert (r["application"], r["infrastructure"], r["total"]) == (0, 1, 1)
    assert r["byCause"] == {"NodeFailure": 1}
    (patch,) = acts(late, "patch_node")
    assert patch[2] == "gpu-node-0"
    assert [e["node"] for e in late.status["tracking"]["badNodes"]] == ["gpu-node-0"]
    assert "peerSuspect" not in late.status["tracking"]
    assert "NodeFailure" in reasons(late)
    # Settled once: later passes never recount it again.
    again = _later(late, 200, dead)
    assert again.status["restarts"] == r


def test_a_survivors_exit_stays_the_programs_when_the_store_host_lives_on():
    out = _survivor_exits()
    within = _later(out, 150, b.healthy_nodes())
    assert within.status["tracking"].get("peerSuspect") and within.wake_in_s > 0
    after = _later(within, 100 + 121, b.healthy_nodes())
    assert "peerSuspect" not in after.status["tracking"]
    # A node failure well after the window is another story, not this restart's cause.
    dead = b.healthy_nodes()
    dead["gpu-node-0"] = b.node("gpu-node-0", ready="Unknown", since=400)
    much_later = _later(after, 500, dead)
    assert much_later.status["restarts"]["application"] == 1
    assert much_later.status["restarts"]["byCause"] == {"ApplicationError": 1}


def test_a_new_job_with_jobs_waiting_ahead_of_it_waits_its_turn_then_starts_when_granted():
    ahead = "2 job(s) that released their pods wait for room ahead of it"
    new = _pass({}, [], 10, queued_behind=ahead)
    assert not acts(new, "create", "Pod")
    assert new.status["phase"] == "Waiting" and new.status.get("podGeneration", 0) == 0
    assert "CapacityQueued" in reasons(new) and ahead in new.status["message"]
    assert cond(new, "Running")["reason"] == "QueuedForCapacity"
    assert new.status["tracking"]["capacityHold"]["since"] == b.ts(10)
    assert (new.status.get("restarts") or {}).get("total", 0) == 0
    # On the list now: no room granted yet, nothing made; granted, pod 0 first.
    later = _pass(new.status, [], 200, capacity_granted=False)
    assert not acts(later, "create", "Pod") and later.status["phase"] == "Waiting"
    granted = _pass(later.status, [], 210, capacity_granted=True)
    assert "CapacityRetry" in reasons(granted)
    assert acts(granted, "create", "Pod") == [("create", "Pod", "gpt-0-0")]
    # A running job's own restart never queues behind anyone.
    running = _pass(running_status(), _short(0), 300, queued_behind=ahead)
    assert "CapacityQueued" not in reasons(running)


def test_a_job_that_ever_had_pods_never_queues_and_a_queued_one_keeps_saying_why():
    ahead = "1 job(s) that released their pods wait for room ahead of it"
    # Made its pods (startTime), the watch has not shown them yet: no queueing.
    first = _pass({}, [], 0)
    assert acts(first, "create", "Pod") and "startTime" in first.status
    second = _pass(first.status, [], 1, queued_behind=ahead)
    assert "CapacityQueued" not in reasons(second) and second.status["phase"] != "Waiting"
    # Queued: every later pass says it is queued, not that it released pods it never had.
    new = _pass({}, [], 10, queued_behind=ahead)
    later = _pass(new.status, [], 20, capacity_granted=False)
    assert cond(later, "Running")["reason"] == "QueuedForCapacity"
    assert "queued for room" in later.status["message"]


def test_a_released_job_waits_up_to_the_cap_from_this_release_not_from_its_place_in_line():
    """A job keeps its place in line across releases, but the hour it may wait without a grant
    counts from the release: measured from the place, a job in line over an hour in all would
    go after part of a gang at every timer, the herd the waitlist exists to stop."""
    out = _released()
    retry = _pass(out.status, [], 705, capacity_granted=True)
    t = 705 + capacity.RETRY_CAP_S + 100        # short again, long after it joined the line
    again = _pass(retry.status, _short(1), t)   # past its retry window: released again
    hold = again.status["tracking"]["capacityHold"]
    assert hold["since"] == b.ts(700) and hold["released"] == b.ts(t)
    due = (parse_time(hold["until"]) - b.at(0)).total_seconds()
    later = _pass(again.status, [], due + 10, capacity_granted=False)
    assert not acts(later, "create", "Pod") and later.status["phase"] == "Waiting"
    capped = _pass(later.status, [], t + capacity.RETRY_CAP_S, capacity_granted=False)
    assert acts(capped, "create", "Pod") == [("create", "Pod", "gpt-2-0")]


def test_suspending_a_waiting_job_ends_its_wait_and_its_place_in_line():
    out = _released()
    suspended = decide(b.job(status=out.status, **{**FULL, "suspend": True}), b.observed([]),
                       b.at(800))
    assert suspended.status["phase"] == "Suspended"
    for key in capacity.WAIT_KEYS:
        assert key not in suspended.status["tracking"], key
