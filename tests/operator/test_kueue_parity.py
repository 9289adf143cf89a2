"""Kueue as production runs it, decision by decision (pure): what Kueue's own job integrations
do after an admission, done for a PretrainJob's Workload too.

Each case cites the Kueue v0.17.0 code it matches:
- PodsReady (pkg/controller/jobframework/reconciler.go, generatePodsReadyCondition): with
  waitForPodsReady on, nobody writing it gets every job evicted after the timeout;
- implicit topology-aware scheduling (pkg/podset/podset.go, FromAssignment): a pod set Kueue
  assigned a topology is gated, with or without a request of the job's;
- admission checks' podSetUpdates (jobframework reconciler, the podSetUpdates merge);
- priority decided once, at creation, and changed in place only by the job's
  kueue.x-k8s.io/priority-class label (the webhook lets it change under an admitted Workload);
- quota given back only once no pod runs (suspension, spec change, the end of the job);
- manageJobsWithoutQueueName with LocalQueue defaulting (pkg/controller/jobframework).
"""

from __future__ import annotations

import copy

from crucible.api.names import ANNOTATION_WORKLOAD_DIGEST
from crucible.operator import queueing as q
from crucible.operator.cluster_policy import ClusterPolicy
from crucible.operator.decision import decide
from crucible.operator.observed import pod_view, workload_view
from tests.operator import builders as b
from tests.operator.test_decision import acts, cond, reasons
from tests.operator.test_queueing import (ADMITTED, FLAVORS, H, admitted_status, created,
                                          queued_job, workload_actions)


def _ready(gen: int, count: int, ready: bool = True) -> list:
    pods = []
    for i in range(count):
        body = b.pod_body(gen, i, node=f"gpu-node-{i}", spec_hash=H)
        body["status"]["conditions"].append({"type": "Ready",
                                             "status": "True" if ready else "False"})
        pods.append(pod_view(body))
    return pods


def _with(wl_body: dict, **status) -> dict:
    body = b.workload_body(wl_body, conditions=ADMITTED, cluster_queue="gpus", count=4)
    body = copy.deepcopy(body)
    body["status"].update(status.pop("status", {}))
    for key, value in status.items():
        body["status"]["admission"]["podSetAssignments"][0][key] = value
    return body


def _pods_ready(outcome):
    patches = [a for a in workload_actions(outcome, "patch_status") if a.reason == "PodsReady"]
    if not patches:
        return None
    [patch] = patches
    cond_ = next(c for c in patch.body["status"]["conditions"] if c["type"] == "PodsReady")
    return cond_["status"], cond_["reason"]


def _pass(wl_body, pods, status=None, t=10):
    return decide(queued_job(status=status or admitted_status()),
                  b.observed(pods, workload=workload_view(wl_body), flavors=FLAVORS), b.at(t))


def test_pods_ready_follows_kueues_state_machine_and_is_written_only_on_change():
    wl = _with(created())
    assert _pods_ready(_pass(wl, _ready(0, 4, ready=False))) == ("False", "WaitForStart")
    assert _pods_ready(_pass(wl, _ready(0, 3))) == ("False", "WaitForStart")   # 3 of 4
    started = _pass(wl, _ready(0, 4))
    assert _pods_ready(started) == ("True", "Started")
    # Kueue stored it: the same state writes nothing.
    (patch,) = [a for a in workload_actions(started, "patch_status")]
    stored = copy.deepcopy(wl)
    stored["status"]["conditions"] = patch.body["status"]["conditions"]
    assert patch.body["metadata"]["resourceVersion"] == "7"
    assert _pods_ready(_pass(stored, _ready(0, 4))) is None
    # A pod lost: waiting for recovery; back: recovered.
    recovering = _pass(stored, _ready(0, 3))
    assert _pods_ready(recovering) == ("False", "WaitForRecovery")
    (patch,) = workload_actions(recovering, "patch_status")
    stored["status"]["conditions"] = patch.body["status"]["conditions"]
    assert _pods_ready(_pass(stored, _ready(0, 4))) == ("True", "Recovered")


def test_a_pod_set_kueue_placed_by_topology_is_gated_even_without_a_request():
    """A TAS-only ClusterQueue: Kueue assigns every pod set a topology; its ungater then waits
    for gated pods to give them their domain's node selector."""
    wl = _with(created(), topologyAssignment={"levels": ["kubernetes.io/hostname"],
                                               "slices": []})
    assert workload_view(wl).topology_assigned
    outcome = _pass(wl, [], status={})
    [create] = [a for a in outcome.actions if a.verb == "create" and a.kind == "Pod"]
    assert create.body["spec"]["schedulingGates"] == [{"name": q.TOPOLOGY_GATE}]
    assert create.body["metadata"]["annotations"][q.UNCONSTRAINED_ANNOTATION] == "true"
    plain = _pass(_with(created()), [], status={})
    [create] = [a for a in plain.actions if a.verb == "create" and a.kind == "Pod"]
    assert "schedulingGates" not in create.body["spec"]


def test_the_admission_checks_pod_set_updates_reach_the_pods():
    """A ProvisioningRequest check names the node group it provisioned (a label to select)."""
    checks = [{"name": "provision", "state": "Ready", "podSetUpdates": [
        {"name": "workers", "nodeSelector": {"autoscaling.x-k8s.io/provisioning-class": "gpu"},
         "labels": {"team": "ml"}, "annotations": {"cluster-autoscaler.kubernetes.io/"
                                                   "consume-provisioning-request": "wl-1"},
         "tolerations": [{"key": "provisioned", "operator": "Exists", "effect": "NoSchedule"}]},
        {"name": "other-pod-set", "labels": {"not": "ours"}}]}]
    outcome = _pass(_with(created(), status={"admissionChecks": checks}), [], status={})
    [create] = [a for a in outcome.actions if a.verb == "create" and a.kind == "Pod"]
    pod = create.body
    assert pod["spec"]["nodeSelector"] == {"crucible.dev/pool": "gpu",
                                           "autoscaling.x-k8s.io/provisioning-class": "gpu"}
    assert pod["metadata"]["labels"]["team"] == "ml" and "not" not in pod["metadata"]["labels"]
    assert pod["metadata"]["annotations"][
        "cluster-autoscaler.kubernetes.io/consume-provisioning-request"] == "wl-1"
    assert {"key": "provisioned", "operator": "Exists", "effect": "NoSchedule"} in \
        pod["spec"]["tolerations"]


def test_a_new_default_priority_class_restarts_no_admitted_job():
    """Made when `normal` (50) was the cluster's default; a new globalDefault (`high`) changes
    nothing for the admitted Workload, whatever digest version it carries."""
    made = q.workload(b.JOB, b.NS, b.UID, b.spec(), "team-a-gpus", q.Priority(
        "PriorityClass", "normal", 50))
    legacy = copy.deepcopy(made)      # an earlier version's digest included the priority
    legacy["metadata"]["annotations"][ANNOTATION_WORKLOAD_DIGEST] = q.digest(made["spec"])
    for body in (made, legacy):
        wl = b.workload_body(body, conditions=ADMITTED, cluster_queue="gpus", count=4)
        outcome = decide(queued_job(status=admitted_status()), b.observed(
            _ready(0, 4), workload=workload_view(wl), flavors=FLAVORS,
            priority_values={"normal": 50, "high": 900}, default_priority_class="high"),
            b.at(10))
        assert not [a for a in workload_actions(outcome) if a.verb in ("delete", "patch")]
        assert outcome.status["podGeneration"] == 0 and not acts(outcome, "delete", "Pod")


def test_the_priority_class_label_changes_the_workloads_priority_in_place():
    made = q.workload(b.JOB, b.NS, b.UID, b.spec(), "team-a-gpus", q.Priority(
        "WorkloadPriorityClass", "research", 100))
    wl = workload_view(b.workload_body(made, conditions=ADMITTED, cluster_queue="gpus", count=4))
    job = b.job(status=admitted_status(), labels={**{q.QUEUE_LABEL: "team-a-gpus"},
                                                  q.PRIORITY_LABEL: "production"})
    outcome = decide(job, b.observed(_ready(0, 4), workload=wl, flavors=FLAVORS,
                                     workload_priorities={"research": 100, "production": 5000}),
                     b.at(10))
    [patch] = workload_actions(outcome, "patch")
    assert patch.body["spec"] == {"priorityClassRef": {"group": "kueue.x-k8s.io",
                                                       "kind": "WorkloadPriorityClass",
                                                       "name": "production"},
                                  "priority": 5000}
    assert patch.body["metadata"]["resourceVersion"] == "7"
    assert "PriorityChanged" in reasons(outcome)
    assert outcome.status["podGeneration"] == 0 and not acts(outcome, "delete", "Pod")


MANAGE_ALL = ClusterPolicy(kueue_manage_all=True)


def test_an_unlabelled_job_queues_in_the_namespaces_default_queue_when_every_job_is_managed():
    outcome = decide(b.job(), b.observed(default_queue=True), b.at(0), MANAGE_ALL)
    [create] = workload_actions(outcome, "create")
    assert create.body["spec"]["queueName"] == q.DEFAULT_QUEUE
    assert not acts(outcome, "create", "Pod")
    # No LocalQueue named default: it waits, saying how to fix it, and never runs unqueued.
    held = decide(b.job(), b.observed(b.running(0, 4, H)), b.at(0), MANAGE_ALL)
    assert held.status["phase"] == "Queued" and not acts(held, "create", "Pod")
    assert cond(held, "Admitted")["reason"] == "NoQueue"
    assert "default" in cond(held, "Admitted")["message"]
    assert len(acts(held, "delete", "Pod")) == 4      # pods made before the setting: withdrawn
    # Without the setting, an unlabelled job runs as it always has.
    free = decide(b.job(), b.observed(default_queue=True), b.at(0))
    assert workload_actions(free) == [] and acts(free, "create", "Pod")


def test_a_job_admitted_below_nodes_max_asks_for_nodes_max_again_when_it_restarts():
    """Partial admission grows back at the next whole-group restart: a new Workload (pod sets
    are immutable once admitted), made once the old pods are gone."""
    wl = workload_view(b.workload_body(created(), conditions=ADMITTED, cluster_queue="gpus",
                                       count=3))
    first = decide(queued_job(), b.observed(workload=wl, flavors=FLAVORS), b.at(1))
    assert first.status["tracking"]["admittedGeneration"] == 0
    running = decide(queued_job(status=first.status), b.observed(
        _ready(0, 3), workload=wl, flavors=FLAVORS), b.at(2))
    assert running.status["phase"] == "Running" and not workload_actions(running, "delete")
    # Pod 2 exits 1: the group restarts (generation 1), counted as the program's.
    crashed = _ready(0, 3)
    crashed[2] = b.pod(0, 2, phase="Failed", exit_code=1, node="gpu-node-2", spec_hash=H)
    restart = decide(queued_job(status=running.status), b.observed(
        crashed, workload=wl, flavors=FLAVORS), b.at(3))
    assert restart.status["podGeneration"] == 1
    # The next pass asks again for nodes.max: the old pods go first, then the Workload.
    again = decide(queued_job(status=restart.status), b.observed(
        crashed, workload=wl, flavors=FLAVORS), b.at(4))
    assert cond(again, "Admitted")["reason"] == "Regrow" and again.status["phase"] == "Queued"
    assert not workload_actions(again, "delete") and len(acts(again, "delete", "Pod")) == 2
    assert not acts(again, "create", "Pod")
    gone = decide(queued_job(status=again.status), b.observed(workload=wl, flavors=FLAVORS),
                  b.at(5))
    assert [(a.verb, a.reason) for a in workload_actions(gone)] == [("delete", "Regrow")]
    made = decide(queued_job(status=gone.status), b.observed(flavors=FLAVORS), b.at(6))
    [create] = workload_actions(made, "create")
    assert create.body["spec"]["podSets"][0]["count"] == 4
    assert made.status["restarts"]["infrastructure"] == 0     # re-queueing is no restart
    # Admitted at nodes.max from the start: a restart keeps its Workload.
    full = workload_view(b.workload_body(created(), conditions=ADMITTED, cluster_queue="gpus",
                                         count=4))
    status = decide(queued_job(), b.observed(workload=full, flavors=FLAVORS), b.at(1)).status
    status = {**status, "podGeneration": 1}
    kept = decide(queued_job(status=status), b.observed(workload=full, flavors=FLAVORS), b.at(2))
    assert cond(kept, "Admitted")["reason"] == "Admitted" and acts(kept, "create", "Pod")


def test_a_release_sets_pods_ready_back_to_wait_for_start():
    """Left True through an eviction, the next admission would read as a recovery, which Kueue
    times by recoveryTimeout (no default) instead of waitForPodsReady's timeout."""
    ready = [{"type": "PodsReady", "status": "True", "reason": "Started",
              "lastTransitionTime": b.ts(5)}]
    wl = workload_view({**_with(created()), "status": {
        **_with(created())["status"], "conditions": _with(created())["status"]["conditions"]
        + ready}})
    patch = q.release(wl, b.at(100))
    (cond_,) = [c for c in patch["status"]["conditions"] if c["type"] == "PodsReady"]
    assert (cond_["status"], cond_["reason"]) == ("False", "WaitForStart")
    # One set True before the current admission (released by someone else): a fresh start.
    body = _with(created())
    body["status"]["conditions"] = [
        {"type": "Admitted", "status": "True", "reason": "Admitted",
         "lastTransitionTime": b.ts(50)},
        {"type": "PodsReady", "status": "True", "reason": "Started",
         "lastTransitionTime": b.ts(5)}]
    assert q.pods_ready_condition(workload_view(body), False) == ("False", "WaitForStart",
                                                                  q.NOT_READY)
    assert q.pods_ready_condition(workload_view(body), True)[:2] == ("True", "Started")


def test_a_priority_the_workload_was_made_with_from_a_pod_priority_class_is_never_patched():
    """Kueue's CRD forbids changing a priorityClassRef's kind (or adding one) while quota is
    reserved: the label then changes nothing rather than be refused every pass."""
    for priority in (q.Priority("PriorityClass", "normal", 50), None):
        made = q.workload(b.JOB, b.NS, b.UID, b.spec(), "team-a-gpus", priority)
        wl = workload_view(b.workload_body(made, conditions=ADMITTED, cluster_queue="gpus",
                                           count=4))
        job = b.job(status=admitted_status(), labels={q.QUEUE_LABEL: "team-a-gpus",
                                                      q.PRIORITY_LABEL: "production"})
        outcome = decide(job, b.observed(_ready(0, 4), workload=wl, flavors=FLAVORS,
                                         workload_priorities={"production": 5000}), b.at(10))
        assert workload_actions(outcome, "patch") == []


def test_the_default_queue_is_chosen_once():
    """As Kueue defaults the queue when a job is made: a LocalQueue named default deleted
    later never pulls a running unlabelled job out of its queue."""
    first = decide(b.job(), b.observed(default_queue=True), b.at(0), MANAGE_ALL)
    assert first.status["tracking"]["defaultQueue"] == q.DEFAULT_QUEUE
    later = decide(b.job(status=first.status), b.observed(default_queue=False), b.at(5),
                   MANAGE_ALL)
    assert cond(later, "Admitted")["reason"] != "NoQueue"
    assert q.queue_name(b.job(status=first.status), True, False, q.DEFAULT_QUEUE) == \
        q.DEFAULT_QUEUE
