"""decide(job, observed, now) -> Outcome, scenario by scenario (pure: no cluster, no clock).

Each test names the situation and checks the actions, the status and the events the operator
would produce; the cluster tests then show the same decisions carried out against the real
control plane.
"""

from __future__ import annotations

import dataclasses

import pytest

from crucible.operator import manifests as m
from crucible.operator.decision import decide
from tests.operator import builders as b

H = m.spec_hash(b.spec())


def acts(outcome, verb=None, kind=None):
    return [(a.verb, a.kind, a.name) for a in outcome.actions
            if (verb is None or a.verb == verb) and (kind is None or a.kind == kind)]


def reasons(outcome):
    return [e.reason for e in outcome.events]


def cond(outcome, type_):
    return next(c for c in outcome.status["conditions"] if c["type"] == type_)


def running_status(gen=0, *, app=0, members=None, **extra):
    members = members if members is not None else {str(i): f"uid-gpt-{gen}-{i}" for i in range(4)}
    status = {"phase": "Running", "podGeneration": gen, "startTime": b.ts(0),
              "conditions": [{"type": "Running", "status": "True", "reason": "PodsRunning",
                              "lastTransitionTime": b.ts(0)}],
              "restarts": {"total": app, "application": app, "infrastructure": 0,
                           "byCause": {"ApplicationError": app} if app else {}},
              "tracking": {"members": members, "everRunning": True}}
    status.update(extra)
    return status


# --- creation ----------------------------------------------------------------------------------
def test_new_job_creates_children_then_pod_0_and_the_rest_once_pod_0_has_a_node():
    first = decide(b.job(), b.observed(children=frozenset()), b.at(0))
    kinds = [a.kind for a in first.actions if a.verb == "create"]
    assert kinds == ["ServiceAccount", "Role", "RoleBinding", "Lease", "ConfigMap", "Service",
                     "NetworkPolicy", "Pod"]
    # Pod 0 hosts the rendezvous store: it alone first, so it is never the one left Pending;
    # in the same pass as the NetworkPolicy that fences the store, and only after it (the
    # adapter holds it unless that create lands).
    pod0 = [a for a in first.actions if a.kind == "Pod"]
    assert [(a.name, a.after) for a in pod0] == [("gpt-0-0", ("NetworkPolicy", "gpt"))]
    assert first.status["phase"] == "Pending" and first.status["podGeneration"] == 0
    assert first.status["startTime"] == b.ts(0)
    assert first.status["observedGeneration"] == 1
    # The NetworkPolicy still missing from the index on a later pass (refused by a quota, say,
    # or created and not shown yet): written again, and the pod again only after it.
    policy = next(ch for ch in b.observed().children if ch.kind == "NetworkPolicy")
    without = b.observed(children=b.observed().children - {policy})
    again = decide(b.job(status=first.status), without, b.at(0.5))
    assert [a.after for a in again.actions if a.kind == "Pod"] == [("NetworkPolicy", "gpt")]
    assert [a.kind for a in again.actions if a.verb == "create"] == ["NetworkPolicy", "Pod"]
    # There, but rendered from older settings: replaced, and the pod only after the replace.
    drifted = b.observed(children=b.observed().children - {policy}
                         | {dataclasses.replace(policy, digest="0000000000000000")})
    stale = decide(b.job(status=first.status), drifted, b.at(0.5))
    assert [(a.verb, a.kind, a.after) for a in stale.actions] == [
        ("replace", "NetworkPolicy", None), ("create", "Pod", ("NetworkPolicy", "gpt"))]
    # With the policy there, the pod goes unconditionally.
    outcome = decide(b.job(status=first.status), b.observed(), b.at(0))
    assert [(a.name, a.after) for a in outcome.actions] == [("gpt-0-0", None)]
    unbound = b.pod(0, 0, phase="Pending", node=None, spec_hash=H)
    assert acts(decide(b.job(status=outcome.status), b.observed([unbound]), b.at(1)),
                "create", "Pod") == []
    bound = b.pod(0, 0, phase="Pending", node="gpu-node-0", spec_hash=H)
    assert acts(decide(b.job(status=outcome.status), b.observed([bound]), b.at(2)),
                "create", "Pod") == [("create", "Pod", f"gpt-0-{i}") for i in (1, 2, 3)]


def test_existing_children_are_not_recreated_and_a_drifted_configmap_is_replaced():
    outcome = decide(b.job(), b.observed(b.running(0, 4, H)), b.at(5))
    assert acts(outcome) == []
    edited = b.job(training={"tokens": 2e9, "lr": 1e-3}, status=running_status())
    outcome = decide(edited, b.observed(b.running(0, 4, m.spec_hash(b.spec(training={
        "tokens": 2e9, "lr": 1e-3})))), b.at(5))
    assert acts(outcome) == [("replace", "ConfigMap", "gpt-config")]


def test_enough_running_pods_make_the_job_running():
    outcome = decide(b.job(), b.observed(b.running(0, 2, H) + [b.pod(0, 2, phase="Pending", node=None, spec_hash=H),
                                                         b.pod(0, 3, phase="Pending", node=None,
                                                               spec_hash=H)]),
                  b.at(5))
    assert outcome.status["phase"] == "Running"           # 2 >= nodes.min
    assert cond(outcome, "Running")["status"] == "True"
    assert cond(outcome, "Degraded")["status"] == "True"  # 2 < nodes.max
    assert outcome.status["pods"] == {"desired": 4, "running": 2, "pending": 2, "failed": 0, "lost": 0}
    assert "Running" in reasons(outcome)


def test_replaying_a_pass_gives_the_same_plan():
    job, obs = b.job(status=running_status()), b.observed(b.running(0, 3, H))
    assert decide(job, obs, b.at(7)) == decide(job, obs, b.at(7))


# --- application failures ----------------------------------------------------------------------
def test_exit_1_restarts_the_group_and_counts_against_the_budget():
    pods = b.running(0, 4, H)
    pods[2] = b.pod(0, 2, phase="Failed", exit_code=1, node="gpu-node-2", spec_hash=H)
    outcome = decide(b.job(status=running_status()), b.observed(pods), b.at(30))
    assert acts(outcome) == []                    # a restart is a counter: pods move next pass
    assert outcome.requeue and outcome.status["podGeneration"] == 1
    assert outcome.status["restarts"] == {"total": 1, "application": 1, "infrastructure": 0,
                                       "byCause": {"ApplicationError": 1}}
    assert outcome.status["phase"] == "Restarting"
    assert cond(outcome, "Restarting")["reason"] == "ApplicationError"
    assert outcome.events[0].type == "Warning" and "exited with 1" in outcome.events[0].message
    assert [(r.cause, r.kind) for r in outcome.restarts] == [("ApplicationError", "application")]


def test_next_pass_deletes_the_old_generation_and_creates_the_new_one():
    status = running_status(gen=1, members={})   # a bump clears the members
    status["phase"] = "Restarting"
    old = b.running(0, 4, H)
    old[2] = b.pod(0, 2, phase="Failed", exit_code=1, node="gpu-node-2", spec_hash=H)
    outcome = decide(b.job(status=status), b.observed(old), b.at(31))
    deleted = acts(outcome, "delete", "Pod")
    assert set(deleted) == {("delete", "Pod", f"gpt-0-{i}") for i in (0, 1, 3)}  # failed kept
    assert acts(outcome, "create", "Pod") == [("create", "Pod", "gpt-1-0")]  # pod 0 first
    assert outcome.status["restarts"]["total"] == 0   # counted once, in the pass that decided it


def test_budget_exhausted_fails_the_job_and_deletes_its_active_pods():
    pods = b.running(0, 4, H)
    pods[1] = b.pod(0, 1, phase="Failed", exit_code=3, node="gpu-node-1", spec_hash=H)
    outcome = decide(b.job(status=running_status(app=3)), b.observed(pods, lease_view_=b.lease(9, 20)),
                  b.at(30))
    assert outcome.status["phase"] == "Failed"
    assert cond(outcome, "Failed")["reason"] == "RestartBudgetExhausted"
    assert "maxRestarts=3" in cond(outcome, "Failed")["message"]
    assert set(acts(outcome, "delete")) == {("delete", "Pod", f"gpt-0-{i}") for i in (0, 2, 3)}


def test_failures_with_no_step_in_between_fail_fast():
    job = b.job(status=running_status(app=1, tracking={
        "members": {}, "everRunning": True, "noProgressFailures": 1,
        "lastFailureTime": b.ts(10), "stepSeen": 5, "stepSeenAt": b.ts(5)}), faultTolerance={"maxRestarts": 20,
                                                         "maxRestartsWithoutProgress": 1})
    pods = [b.pod(0, 0, phase="Failed", exit_code=2, spec_hash=m.spec_hash(job_spec(job)))]
    outcome = decide(job, b.observed(pods, lease_view_=b.lease(5, 5)), b.at(30))  # step before
    assert cond(outcome, "Failed")["reason"] == "CrashLoopNoProgress"
    progressed = decide(job, b.observed(pods, lease_view_=b.lease(7, 20)), b.at(30))
    assert progressed.status["phase"] == "Restarting"   # a step after the last failure


def job_spec(job):
    from crucible.api.spec import PretrainJobSpec
    return PretrainJobSpec.model_validate(job.spec)


def test_retryable_exit_code_is_infrastructure():
    job = b.job(status=running_status(), faultTolerance={"retryableExitCodes": [42]})
    h = m.spec_hash(job_spec(job))
    pods = b.running(0, 4, h)
    pods[3] = b.pod(0, 3, phase="Failed", exit_code=42, node="gpu-node-3", spec_hash=h)
    outcome = decide(job, b.observed(pods), b.at(30))
    assert outcome.status["restarts"]["infrastructure"] == 1 and outcome.status["podGeneration"] == 0
    assert acts(outcome, "delete", "Pod") == [("delete", "Pod", "gpt-0-3")]


# --- infrastructure failures -------------------------------------------------------------------
@pytest.mark.parametrize("failed, cause", [
    (dict(exit_code=137), "Signal"),
    (dict(reason="Evicted"), "Evicted"),
    (dict(exit_code=143, disruption="PreemptionByScheduler"), "Disrupted"),
])
def test_infrastructure_failure_of_a_worker_replaces_only_that_pod(failed, cause):
    pods = b.running(0, 4, H)
    pods[2] = b.pod(0, 2, phase="Failed", node="gpu-node-2", spec_hash=H, **failed)
    outcome = decide(b.job(status=running_status()), b.observed(pods), b.at(30))
    assert outcome.status["podGeneration"] == 0 and outcome.status["phase"] == "Running"
    assert acts(outcome) == [("delete", "Pod", "gpt-0-2")]
    assert outcome.status["restarts"]["byCause"] == {cause: 1}
    assert outcome.status["restarts"]["application"] == 0
    # Next pass: same pod still there (being deleted) -> not counted again; then gone -> created.
    again = decide(b.job(status=outcome.status), b.observed(pods), b.at(31))
    assert again.status["restarts"]["total"] == 1
    gone = decide(b.job(status=outcome.status), b.observed(pods[:2] + pods[3:]), b.at(32))
    assert acts(gone, "create", "Pod") == [("create", "Pod", "gpt-0-2")]
    assert gone.status["restarts"]["total"] == 1


def test_infrastructure_failure_of_pod_0_restarts_the_group_because_it_hosts_the_store():
    pods = b.running(0, 4, H)
    pods[0] = b.pod(0, 0, phase="Failed", exit_code=137, node="gpu-node-0", spec_hash=H)
    outcome = decide(b.job(status=running_status()), b.observed(pods), b.at(30))
    assert outcome.status["podGeneration"] == 1
    assert outcome.status["restarts"] == {"total": 1, "application": 0, "infrastructure": 1,
                                       "byCause": {"Signal": 1}}
    assert "c10d store" in outcome.events[0].message


def test_a_pod_deleted_by_someone_else_is_counted_once_and_recreated():
    pods = b.running(0, 4, H)
    vanished = pods[:1] + pods[2:]                        # gpt-0-1 gone without a trace
    outcome = decide(b.job(status=running_status()), b.observed(vanished), b.at(30))
    assert outcome.status["restarts"]["byCause"] == {"PodDeleted": 1}
    assert acts(outcome, "create", "Pod") == [("create", "Pod", "gpt-0-1")]
    again = decide(b.job(status=outcome.status), b.observed(vanished), b.at(31))
    assert again.status["restarts"]["total"] == 1


def test_pods_of_a_newer_generation_than_the_status_shows_are_left_alone():
    outcome = decide(b.job(status=running_status(gen=0)),
                  b.observed(b.running(0, 4, H) + [b.pod(1, 0, spec_hash=H)]), b.at(3))
    assert ("delete", "Pod", "gpt-1-0") not in acts(outcome)
    assert not outcome.requeue and outcome.wake_in_s == 1  # soon, but never a hot loop


# --- ownership ---------------------------------------------------------------------------------
def test_a_foreign_pod_with_the_jobs_labels_is_never_judged_or_counted():
    foreign = b.pod(0, 5, phase="Succeeded", exit_code=0, owner="uid-someone-else",
                    spec_hash=H)
    crashed = b.pod(0, 6, phase="Failed", exit_code=1, owner=None, spec_hash=H)
    outcome = decide(b.job(status=running_status()),
                     b.observed(b.running(0, 4, H) + [foreign, crashed]), b.at(5))
    assert outcome.status["phase"] == "Running"            # not Succeeded by a stranger's exit 0
    assert outcome.status["restarts"]["total"] == 0
    assert not acts(outcome, "delete")


def test_a_deleted_namesakes_pods_are_waited_for_and_a_foreign_object_is_a_name_conflict():
    # The job was deleted and created again under the same name: its old pods, held by a
    # finalizer, carry the names the new generation 0 needs.
    held = [b.pod(0, i, owner="uid-old-job", deletion=0, spec_hash=H) for i in range(4)]
    outcome = decide(b.job(), b.observed(held), b.at(5))
    assert acts(outcome) == [] and outcome.status["restarts"]["total"] == 0
    assert cond(outcome, "NameConflict")["reason"] == "WaitingForNamesake"
    assert outcome.wake_in_s == 2 and not outcome.requeue
    gone = decide(b.job(status=outcome.status), b.observed(), b.at(9))
    assert acts(gone, "create", "Pod") == [("create", "Pod", "gpt-0-0")]
    assert cond(gone, "NameConflict")["status"] == "False"
    # Still there past their grace and terminatingTimeoutSeconds (a dead node: no kubelet will
    # ever end them): force-deleted, or they would hold the names forever.
    stuck = decide(b.job(), b.observed(held), b.at(120))
    assert sorted(acts(stuck)) == [("force_delete", "Pod", f"gpt-0-{i}") for i in range(4)]
    assert cond(stuck, "NameConflict")["reason"] == "WaitingForNamesake"
    # Someone else's Service under the job's name: reported, never adopted, nothing created.
    children = {v if v.kind != "Service" else dataclasses.replace(v, owner_uid="uid-stranger")
                for v in b.observed().children}
    clash = decide(b.job(), b.observed(children=frozenset(children)), b.at(5))
    assert cond(clash, "NameConflict")["status"] == "True"
    assert "Service gpt exists and belongs to another owner" in cond(clash, "NameConflict")["message"]
    assert "NameConflict" in reasons(clash) and acts(clash) == []
    # One with none of the job's labels (no index shows it): the last pass's create met it.
    unseen = b.observed(children=frozenset(v for v in b.observed().children
                                           if v.kind != "Service"))
    unseen = dataclasses.replace(unseen, conflicts=frozenset({("Service", "gpt")}))
    outcome = decide(b.job(), unseen, b.at(5))
    assert cond(outcome, "NameConflict")["status"] == "True"
    assert acts(outcome) == [("create", "Service", "gpt")]   # tried again, nothing else


# --- nodes -------------------------------------------------------------------------------------
def _node_down(since=20.0, **kw):
    nodes = b.healthy_nodes()
    nodes["gpu-node-2"] = b.node("gpu-node-2", ready="Unknown", since=since, **kw)
    return nodes


def test_a_failed_node_is_suspect_for_the_grace_then_cordoned_and_its_pod_replaced():
    outcome = decide(b.job(status=running_status()), b.observed(b.running(0, 4, H),
                                                             nodes=_node_down()), b.at(30))
    # Within the grace (a kubelet restart, a short partition): only suspect.
    assert not acts(outcome, "patch_node") and not acts(outcome, "force_delete")
    assert "cordonedNodes" not in outcome.status
    assert not outcome.status["tracking"].get("badNodes")
    assert cond(outcome, "Degraded")["status"] == "True"
    assert outcome.wake_in_s == pytest.approx(50)            # 60 s grace from t=20, now t=30
    assert outcome.status["pods"]["lost"] == 1
    after = decide(b.job(status=outcome.status), b.observed(b.running(0, 4, H),
                                                            nodes=_node_down()), b.at(81))
    (patch,) = [a for a in after.actions if a.verb == "patch_node"]
    assert patch.name == "gpu-node-2" and patch.body["spec"] == {"unschedulable": True}
    ann = patch.body["metadata"]["annotations"]
    assert ann["crucible.dev/failure-reason"] == "NodeUnreachable"
    assert ann["crucible.dev/failure-job"] == "team-a/gpt"
    assert after.status["cordonedNodes"] == ["gpu-node-2"]
    assert acts(after, "force_delete") == [("force_delete", "Pod", "gpt-0-2")]
    assert [e["node"] for e in after.status["tracking"]["badNodes"]] == ["gpu-node-2"]


def test_a_node_back_within_the_grace_is_never_cordoned():
    down = decide(b.job(status=running_status()), b.observed(b.running(0, 4, H),
                                                          nodes=_node_down()), b.at(40))
    back = decide(b.job(status=down.status), b.observed(b.running(0, 4, H)), b.at(41))
    assert not acts(down, "patch_node") and not acts(back, "patch_node")
    assert back.status["restarts"]["total"] == 0
    assert cond(back, "Degraded")["status"] == "False"


def test_a_pod_held_on_a_dead_node_is_counted_once_however_many_passes_see_it():
    nodes = _node_down(annotations={"crucible.dev/failure-reason": "NodeUnreachable",
                                    "crucible.dev/failure-time": b.ts(80)}, unschedulable=True)
    held = b.running(0, 4, H)
    held[2] = b.pod(0, 2, node="gpu-node-2", deletion=81, spec_hash=H, uid="uid-gpt-0-2")
    status = decide(b.job(status=running_status()), b.observed(b.running(0, 4, H), nodes=nodes),
                    b.at(81)).status
    for t in range(82, 92):  # ten resyncs while a finalizer keeps the pod listed
        outcome = decide(b.job(status=status), b.observed(held, nodes=nodes), b.at(t))
        status = outcome.status
        assert "NodeFailure" not in reasons(outcome)
    assert status["restarts"]["byCause"] == {"NodeFailure": 1}


def test_a_repaired_node_that_fails_again_is_cordoned_again_and_uncordon_lifts_the_ban():
    # Reported at t=10 by an earlier failure, uncordoned since by whoever repaired it.
    reported = {"crucible.dev/failure-reason": "NodeUnreachable",
                "crucible.dev/failure-time": b.ts(10)}
    repaired = b.healthy_nodes()
    repaired["gpu-node-2"] = b.node("gpu-node-2", annotations=reported)
    status = running_status(tracking={"members": {str(i): f"uid-gpt-0-{i}" for i in range(4)},
                                      "everRunning": True, "badNodes": ["gpu-node-2"]})
    outcome = decide(b.job(status=status), b.observed(b.running(0, 2, H), nodes=repaired),
                     b.at(200))
    created = [a for a in outcome.actions if a.verb == "create" and a.kind == "Pod"]
    assert created and all(a.body["spec"].get("affinity") is None for a in created)
    assert outcome.status["tracking"]["badNodes"] == []
    # It fails again at t=300: a new failure, reported and cordoned anew after the grace.
    again = _node_down(since=300, annotations=reported)
    outcome = decide(b.job(status=running_status()), b.observed(b.running(0, 4, H), nodes=again),
                     b.at(361))
    (patch,) = [a for a in outcome.actions if a.verb == "patch_node"]
    assert patch.body["spec"] == {"unschedulable": True}
    assert patch.body["metadata"]["annotations"]["crucible.dev/failure-time"] == b.ts(361)


def test_after_the_grace_the_pod_is_force_deleted_and_recreated_avoiding_the_node():
    nodes = _node_down(annotations={"crucible.dev/failure-reason": "NodeUnreachable"},
                       unschedulable=True)
    outcome = decide(b.job(status=running_status()), b.observed(b.running(0, 4, H), nodes=nodes),
                  b.at(81))
    assert acts(outcome) == [("force_delete", "Pod", "gpt-0-2")]   # already cordoned: no patch
    assert outcome.status["restarts"]["byCause"] == {"NodeFailure": 1}
    nxt = decide(b.job(status=outcome.status),
                 b.observed([p for p in b.running(0, 4, H) if p.index != 2], nodes=nodes), b.at(82))
    (create,) = [a for a in nxt.actions if a.verb == "create"]
    terms = create.body["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms[0]["matchExpressions"][0]["values"] == ["gpu-node-2"]
    assert nxt.status["restarts"]["total"] == 1


def test_node_failure_under_pod_0_restarts_the_group_after_the_grace():
    nodes = b.healthy_nodes()
    nodes["gpu-node-0"] = b.node("gpu-node-0", ready="False", since=0)
    outcome = decide(b.job(status=running_status()), b.observed(b.running(0, 4, H), nodes=nodes),
                  b.at(61))
    assert outcome.status["podGeneration"] == 1
    assert outcome.status["restarts"]["byCause"] == {"NodeFailure": 1}
    stale = decide(b.job(status=outcome.status), b.observed(b.running(0, 4, H), nodes=nodes), b.at(62))
    assert ("force_delete", "Pod", "gpt-0-0") in acts(stale)   # it will never terminate there
    assert ("delete", "Pod", "gpt-0-1") in acts(stale)


def test_a_pass_from_a_status_older_than_its_own_cordon_still_lists_the_node():
    # The node already carries this job's cordon (an earlier pass patched it) but the status the
    # pass starts from was read before that pass's status landed: the restart must not drop it.
    nodes = b.healthy_nodes()
    nodes["gpu-node-0"] = b.node("gpu-node-0", ready="Unknown", since=0, unschedulable=True,
                                 annotations={"crucible.dev/failure-reason": "NodeUnreachable",
                                              "crucible.dev/cordoned-by": "team-a/gpt"})
    nodes["gpu-node-1"] = b.node("gpu-node-1", ready="Unknown", since=0, unschedulable=True,
                                 annotations={"crucible.dev/failure-reason": "NodeUnreachable",
                                              "crucible.dev/cordoned-by": "team-b/other"})
    outcome = decide(b.job(status={**running_status(), "cordonedNodes": ["gpu-node-3"]}),
                     b.observed(b.running(0, 4, H), nodes=nodes), b.at(61))
    assert outcome.status["podGeneration"] == 1
    assert not acts(outcome, "patch_node")                   # annotated once, never again
    # Another job's cordon is that job's to report.
    assert outcome.status["cordonedNodes"] == ["gpu-node-3", "gpu-node-0"]


def test_configured_node_condition_counts_as_failure_and_cordon_can_be_off():
    nodes = b.healthy_nodes()
    nodes["gpu-node-1"] = b.node("gpu-node-1", conditions={"GPUUnhealthy": "True"})
    job = b.job(status=running_status(), faultTolerance={"nodeFailureConditions": ["GPUUnhealthy"],
                                                         "cordonFailedNodes": False})
    outcome = decide(job, b.observed(b.running(0, 4, m.spec_hash(job_spec(job))), nodes=nodes),
                  b.at(61))
    (patch,) = [a for a in outcome.actions if a.verb == "patch_node"]
    assert "spec" not in patch.body                      # annotated, not cordoned
    assert patch.body["metadata"]["annotations"]["crucible.dev/failure-reason"] == "NodeGPUUnhealthy"
    assert "cordonedNodes" not in outcome.status


def test_a_node_missing_from_the_snapshot_is_not_judged():
    nodes = b.healthy_nodes()
    del nodes["gpu-node-3"]
    outcome = decide(b.job(status=running_status()), b.observed(b.running(0, 4, H), nodes=nodes),
                  b.at(500))
    assert acts(outcome) == []


# --- hangs -------------------------------------------------------------------------------------
def test_lease_advancing_updates_step_loss_and_goodput():
    job = b.job(status=running_status(tracking={"members": {}, "everRunning": True, "goodput": {
        "lastStep": 10, "lastStepTime": b.ts(100), "productiveSeconds": 100.0, "steps": 10}}))
    outcome = decide(job, b.observed(b.running(0, 4, H), lease_view_=b.lease(20, 200, loss=2.5,
                                                                          checkpoint_step=15)),
                  b.at(200))
    assert outcome.status["step"] == 20 and outcome.status["loss"] == 2.5
    assert outcome.status["lastCheckpoint"]["step"] == 15
    assert outcome.status["goodput"] == 1.0                  # 200 s productive of 200 s
    assert cond(outcome, "Progressing")["status"] == "True"


def test_lease_stuck_past_the_timeout_is_a_hang_restart():
    stuck = running_status(tracking={"members": {}, "everRunning": True, "stepSeen": 50,
                                     "stepSeenAt": b.ts(100)})
    outcome = decide(b.job(status=stuck), b.observed(b.running(0, 4, H),
                                                     lease_view_=b.lease(50, 100)),
                  b.at(701))
    assert outcome.status["podGeneration"] == 1
    assert outcome.status["restarts"]["byCause"] == {"Hang": 1}
    assert outcome.status["restarts"]["application"] == 1
    assert "stuck after step 50" in outcome.events[0].message


def test_after_a_restart_the_startup_timeout_runs_until_the_first_new_step():
    status = running_status(tracking={"members": {}, "everRunning": True, "stepSeen": 50,
                                      "stepSeenAt": b.ts(100), "lastDisruption": b.ts(600)})
    outcome = decide(b.job(status=status), b.observed(b.running(0, 4, H), lease_view_=b.lease(50, 100)),
                  b.at(701))
    assert outcome.status["podGeneration"] == 0
    assert outcome.wake_in_s == pytest.approx(1800 - 101)  # startupTimeoutSeconds from t=600
    late = decide(b.job(status=status), b.observed(b.running(0, 4, H),
                                                   lease_view_=b.lease(50, 100)), b.at(2401))
    assert late.status["restarts"]["byCause"] == {"Hang": 1}
    assert "within 1800s of the start" in late.events[0].message


def test_hangs_are_timed_on_the_operators_clock_not_the_trainer_nodes():
    ahead = running_status(tracking={"members": {}, "everRunning": True, "stepSeen": 50,
                                     "stepSeenAt": b.ts(100)})
    # The trainer node's clock runs an hour ahead: its stale step still looks fresh to it.
    outcome = decide(b.job(status=ahead), b.observed(b.running(0, 4, H),
                                                     lease_view_=b.lease(50, 3700)), b.at(701))
    assert outcome.status["restarts"]["byCause"] == {"Hang": 1}
    # An hour behind, but stepping: every pass sees a new step, so no hang.
    status = ahead
    for t, step in ((200, 51), (800, 52), (1400, 53)):
        outcome = decide(b.job(status=status), b.observed(
            b.running(0, 4, H), lease_view_=b.lease(step, t - 3600)), b.at(t))
        status = outcome.status
        assert outcome.status["restarts"]["total"] == 0
        assert cond(outcome, "Progressing")["status"] == "True"


# --- lifecycle ---------------------------------------------------------------------------------
def test_success_of_any_pod_completes_the_job_and_stops_the_others():
    pods = b.running(0, 4, H)
    pods[1] = b.pod(0, 1, phase="Succeeded", exit_code=0, node="gpu-node-1", spec_hash=H)
    outcome = decide(b.job(status=running_status()), b.observed(pods, lease_view_=b.lease(1907, 9)),
                  b.at(60))
    assert outcome.status["phase"] == "Succeeded" and outcome.status["completionTime"] == b.ts(60)
    assert set(acts(outcome)) == {("delete", "Pod", f"gpt-0-{i}") for i in (0, 2, 3)}
    assert "step 1907" in cond(outcome, "Succeeded")["message"]


def test_ttl_deletes_the_finished_job():
    status = {"phase": "Succeeded", "completionTime": b.ts(0), "podGeneration": 0}
    early = decide(b.job(status=status, ttlSecondsAfterFinished=100), b.observed(), b.at(50))
    assert acts(early) == [] and early.wake_in_s == pytest.approx(50)
    late = decide(b.job(status=status, ttlSecondsAfterFinished=100), b.observed(), b.at(100))
    assert acts(late) == [("delete_job", "PretrainJob", "gpt")]


def test_suspend_deletes_pods_and_resume_starts_a_new_generation():
    outcome = decide(b.job(status=running_status(), suspend=True), b.observed(b.running(0, 4, H)),
                  b.at(100))
    assert set(acts(outcome)) == {("delete", "Pod", f"gpt-0-{i}") for i in range(4)}
    assert outcome.status["phase"] == "Suspended" and cond(outcome, "Suspended")["status"] == "True"
    resumed = decide(b.job(status=outcome.status), b.observed(), b.at(160))
    assert resumed.status["podGeneration"] == 1 and resumed.status["phase"] == "Pending"
    assert resumed.status["tracking"]["suspendedSeconds"] == 60
    assert resumed.status["restarts"]["total"] == 0         # not a restart
    nxt = decide(b.job(status=resumed.status), b.observed(), b.at(161))
    assert acts(nxt, "create", "Pod") == [("create", "Pod", "gpt-1-0")]


def test_spec_change_that_reaches_the_pods_restarts_and_operator_knobs_do_not():
    job = b.job(status=running_status(), image="registry.example/crucible-trainer:0.2")
    outcome = decide(job, b.observed(b.running(0, 4, H)), b.at(5))
    assert outcome.status["podGeneration"] == 1 and cond(outcome, "Restarting")["reason"] == "SpecChanged"
    knob = b.job(status=running_status(), faultTolerance={"maxRestarts": 50})
    assert decide(knob, b.observed(b.running(0, 4, H)), b.at(5)).status["podGeneration"] == 0


def test_stuck_terminating_pods_are_force_deleted():
    pods = b.running(0, 4, H)
    pods[3] = b.pod(0, 3, node="gpu-node-3", deletion=0, spec_hash=H, uid="uid-gpt-0-3")
    status = running_status(tracking={"members": {}, "everRunning": True,
                                      "handled": ["uid-gpt-0-3"]})
    assert acts(decide(b.job(status=status), b.observed(pods), b.at(60))) == []
    assert acts(decide(b.job(status=status), b.observed(pods), b.at(121))) == [
        ("force_delete", "Pod", "gpt-0-3")]


def test_image_pull_errors_fail_the_job_after_the_pending_timeout_unschedulable_does_not():
    pods = [b.pod(0, i, phase="Pending", waiting="ImagePullBackOff", spec_hash=H) for i in range(4)]
    assert decide(b.job(), b.observed(pods), b.at(100)).status["phase"] == "Pending"
    failed = decide(b.job(), b.observed(pods), b.at(601))
    assert failed.status["phase"] == "Failed" and cond(failed, "Failed")["reason"] == "ImagePullFailed"
    stuck = [b.pod(0, i, phase="Pending", node=None, spec_hash=H,
                   unschedulable="0/4 nodes are available: 4 Insufficient nvidia.com/gpu.")
             for i in range(4)]
    outcome = decide(b.job(), b.observed(stuck), b.at(5000))
    assert outcome.status["phase"] == "Waiting"           # not Failed, however long
    assert cond(outcome, "PodsScheduled")["reason"] == "InsufficientCapacity"
    assert "Insufficient nvidia.com/gpu" in cond(outcome, "PodsScheduled")["message"]
    assert "InsufficientCapacity" in reasons(outcome)
    # One pod short of max but nodes.min (2) placed: an elastic job runs, reporting the pod.
    some = b.running(0, 3, H) + [stuck[3]]
    outcome = decide(b.job(status=running_status()), b.observed(some), b.at(5))
    assert outcome.status["phase"] == "Running"
    assert cond(outcome, "PodsScheduled")["reason"] == "Unschedulable"


FULL_POOL = {"nodes": {"min": 4, "max": 4}}
NO_GPU = "0/4 nodes are available: 1 node(s) were unschedulable, 3 Insufficient nvidia.com/gpu."


def test_in_a_full_pool_the_survivors_exits_restart_without_spending_the_budget():
    h = m.spec_hash(b.spec(**FULL_POOL))
    pods = b.running(0, 3, h) + [b.pod(0, 3, phase="Pending", node=None, spec_hash=h,
                                       unschedulable=NO_GPU)]
    waiting = decide(b.job(status=running_status(), **FULL_POOL), b.observed(pods), b.at(100))
    assert waiting.status["phase"] == "Waiting"
    assert cond(waiting, "PodsScheduled")["reason"] == "InsufficientCapacity"
    assert "only 3 of nodes.min=4" in cond(waiting, "PodsScheduled")["message"]
    assert not acts(waiting, "delete") and not acts(waiting, "create")
    # The survivors give up on the rendezvous (exit 1), which frees their nodes, so the pass
    # that sees the exits may already see the waiting pod scheduled on one of them: a restart,
    # but not the program's fault.
    exited = [b.pod(0, i, phase="Failed", exit_code=1, node=f"gpu-node-{i}", spec_hash=h)
              for i in range(3)] + [b.pod(0, 3, node="gpu-node-0", spec_hash=h)]
    outcome = decide(b.job(status=waiting.status, **FULL_POOL), b.observed(exited), b.at(700))
    assert outcome.status["podGeneration"] == 1
    assert outcome.status["restarts"]["application"] == 0
    assert outcome.status["restarts"]["byCause"] == {"InsufficientCapacity": 1}
    assert outcome.status["phase"] != "Failed"
    # A generation that once had nodes.min pods running: the same exit is the program's.
    counted = decide(b.job(status=running_status(), **FULL_POOL), b.observed(exited), b.at(700))
    assert counted.status["restarts"]["application"] == 1


def test_image_errors_after_the_job_has_run_are_degraded_and_retried_not_terminal():
    # A replacement pod that waited long for a node, then cannot pull the image the job has
    # been training with (a registry outage): report it, never fail a long run over it.
    pods = b.running(0, 3, H) + [b.pod(0, 3, phase="Pending", node="gpu-node-3",
                                       waiting="ImagePullBackOff", spec_hash=H)]
    outcome = decide(b.job(status=running_status()),
                     b.observed(pods, lease_view_=b.lease(900, 4990)), b.at(5000))
    assert outcome.status["phase"] == "Running"
    assert cond(outcome, "Degraded")["reason"] == "ImagePullFailed"


def test_one_infrastructure_cause_looping_fails_the_job_and_capacity_waits_do_not_count():
    job = dict(faultTolerance={"maxInfrastructureRestarts": 3,
                               "infrastructureRestartWindowMinutes": 10})
    h = m.spec_hash(b.spec(**job))
    status = running_status()
    for i, t in enumerate((0, 100, 200)):   # pod 0 SIGKILLed three times in 200 s
        pods = [b.pod(i, 0, phase="Failed", node="gpu-node-0", spec_hash=h,
                      exit_code=137, uid=f"oom-{i}")] + [
            b.pod(i, k, node=f"gpu-node-{k}", spec_hash=h, uid=f"u-{i}-{k}") for k in (1, 2, 3)]
        outcome = decide(b.job(status=status, **job), b.observed(pods), b.at(t))
        status = outcome.status
        assert status["phase"] == ("Failed" if i == 2 else "Restarting"), status["phase"]
    assert cond(outcome, "Failed")["reason"] == "InfrastructureLoop"
    assert "3 restarts caused by Signal within 10 min" in cond(outcome, "Failed")["message"]
    assert status["restarts"]["application"] == 0
    # Spread out beyond the window, the same three are no loop.
    status = running_status()
    for i, t in enumerate((0, 700, 1400)):
        pods = [b.pod(i, 0, phase="Failed", node="gpu-node-0", spec_hash=h,
                      exit_code=137, uid=f"oom-{i}")] + [
            b.pod(i, k, node=f"gpu-node-{k}", spec_hash=h, uid=f"u-{i}-{k}") for k in (1, 2, 3)]
        status = decide(b.job(status=status, **job), b.observed(pods), b.at(t)).status
    assert status["phase"] == "Restarting" and status["restarts"]["byCause"] == {"Signal": 3}


def test_oomkilled_spends_the_budget_and_an_oom_loop_fails_the_job():
    """OOMKilled is the program outgrowing its memory limit: counted, so it ends. With no step
    between them, maxRestartsWithoutProgress (3) ends it sooner than the budget."""
    status = running_status()
    for i, t in enumerate((0, 100, 200, 300)):
        pods = b.running(i, 4, H)
        pods[1] = b.pod(i, 1, phase="Failed", node="gpu-node-1", spec_hash=H,
                        terminated_reason="OOMKilled", exit_code=137)
        outcome = decide(b.job(status=status, faultTolerance={"maxRestarts": 20}),
                         b.observed(pods), b.at(t))
        status = outcome.status
        if i < 3:
            assert status["phase"] == "Restarting" and status["podGeneration"] == i + 1
            assert status["restarts"]["application"] == i + 1
    assert status["phase"] == "Failed"
    assert cond(outcome, "Failed")["reason"] == "CrashLoopNoProgress"
    assert "OOMKilled" in cond(outcome, "Failed")["message"]
    assert status["restarts"]["byCause"] == {"OOMKilled": 3}


def test_invalid_spec_fails_with_the_field_named():
    outcome = decide(b.job(nodes={"min": 5, "max": 2}), b.observed(), b.at(0))
    assert outcome.status["phase"] == "Failed"
    assert "nodes" in cond(outcome, "Failed")["message"] and cond(outcome, "Failed")["reason"] == "InvalidSpec"


def test_a_job_being_deleted_gets_no_actions():
    assert acts(decide(b.job(deleting=True), b.observed(b.running(0, 4, H)), b.at(0))) == []


def test_a_network_policy_rendered_otherwise_is_replaced():
    """One made by an older operator (no digest) or under other settings: its egress may still
    let pods reach the instance metadata, or block what the administrator now allows."""
    children = b.observed().children
    stale = frozenset(dataclasses.replace(ch, digest=None) if ch.kind == "NetworkPolicy" else ch
                      for ch in children)
    outcome = decide(b.job(status=running_status()), b.observed(b.running(0, 4, H),
                                                                children=stale), b.at(5))
    assert acts(outcome) == [("replace", "NetworkPolicy", "gpt")]
    [action] = outcome.actions
    assert action.body["spec"]["policyTypes"] == ["Ingress", "Egress"]
    assert acts(decide(b.job(status=running_status()), b.observed(b.running(0, 4, H)),
                       b.at(5))) == []   # rendered the same: left alone
