"""Queueing with Kueue, decision by decision (pure: no cluster, no clock).

A job with the `kueue.x-k8s.io/queue-name` label has pods only while its Workload is admitted;
an eviction takes every pod as one unit, counts one infrastructure restart and gives the quota
back once the pods are gone; re-admission starts a new generation. tests/operator/test_kueue.py
shows the same against a real Kueue.
"""

from __future__ import annotations

from crucible.api.names import ANNOTATION_WORKLOAD_DIGEST
from crucible.operator import manifests as m
from crucible.operator import queueing as q
from crucible.operator.decision import decide
from crucible.operator.observed import flavor_view, pod_view
from tests.operator import builders as b
from tests.operator.test_decision import acts, cond, reasons

H = m.spec_hash(b.spec())
QUEUE = {q.QUEUE_LABEL: "team-a-gpus"}
FLAVORS = {"gpu": flavor_view({"metadata": {"name": "gpu"}, "spec": {
    "nodeLabels": {"crucible.dev/pool": "gpu"},
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]}})}
ADMITTED = {"QuotaReserved": ("True", "QuotaReserved", "Quota reserved in ClusterQueue gpus"),
            "Admitted": ("True", "Admitted", "The workload is admitted")}
PREEMPTED = {**ADMITTED, "Evicted": ("True", "Preempted", "Preempted to accommodate a workload "
                                     "(UID: u2) due to prioritization in the ClusterQueue")}


def created(**spec) -> dict:
    """The Workload as the operator creates it for the job."""
    return q.workload(b.JOB, b.NS, b.UID, b.spec(**spec), QUEUE[q.QUEUE_LABEL], None)


def queued_job(status=None, **spec):
    return b.job(status=status, labels=QUEUE, **spec)


def workload_actions(outcome, verb=None):
    return [a for a in outcome.actions if a.kind == "Workload" and (verb is None or a.verb == verb)]


def admitted_status(gen=0, pods=4):
    return {"phase": "Running", "podGeneration": gen, "startTime": b.ts(0),
            "conditions": [{"type": "Running", "status": "True", "reason": "PodsRunning",
                            "lastTransitionTime": b.ts(0)}],
            "restarts": {"total": 0, "application": 0, "infrastructure": 0, "byCause": {}},
            "tracking": {"everRunning": True, "admission": {
                "clusterQueue": "gpus", "localQueue": "team-a-gpus", "pods": pods}}}


def test_without_the_label_nothing_changes_and_no_workload_is_made():
    outcome = decide(b.job(), b.observed(), b.at(0))
    assert workload_actions(outcome) == []
    assert acts(outcome, "create", "Pod") == [("create", "Pod", "gpt-0-0")]
    assert "Admitted" not in [c["type"] for c in outcome.status["conditions"]]


def test_a_queued_job_makes_its_workload_and_no_pod_until_admitted():
    outcome = decide(queued_job(), b.observed(), b.at(0))
    [create] = workload_actions(outcome, "create")
    wl = create.body
    assert wl["apiVersion"] == "kueue.x-k8s.io/v1beta2" and wl["kind"] == "Workload"
    assert wl["metadata"]["name"] == "pretrainjob-gpt"
    assert wl["metadata"]["ownerReferences"][0]["uid"] == b.UID
    assert wl["spec"]["queueName"] == "team-a-gpus"
    [podset] = wl["spec"]["podSets"]
    assert (podset["count"], podset["minCount"]) == (4, 2)     # nodes.max, nodes.min
    assert podset["template"]["spec"]["containers"][0]["resources"] == {
        "limits": {"nvidia.com/gpu": "8"}}
    assert "topologyRequest" not in podset and "priority" not in wl["spec"]
    assert acts(outcome, "create", "Pod") == []
    assert outcome.status["phase"] == "Queued"
    assert cond(outcome, "Admitted")["status"] == "False"
    assert "Queued" in reasons(outcome)


def test_a_fixed_size_job_asks_for_no_partial_admission():
    wl = created(nodes={"min": 4, "max": 4})
    assert "minCount" not in wl["spec"]["podSets"][0]


def test_a_pending_workload_says_why_in_kueues_words_and_names_the_cluster_queue():
    message = ("couldn't assign flavors to pod set workers: insufficient unused quota for "
               "nvidia.com/gpu in flavor gpu, 32 more needed")
    wl = b.workload(created(), conditions={"QuotaReserved": ("False", "Pending", message)})
    outcome = decide(queued_job(), b.observed(workload=wl, cluster_queue="gpus"), b.at(1))
    assert acts(outcome, "create", "Pod") == [] and workload_actions(outcome) == []
    assert outcome.status["phase"] == "Queued"
    admitted = cond(outcome, "Admitted")
    assert admitted["status"] == "False" and admitted["reason"] == "Pending"
    assert message in admitted["message"] and "ClusterQueue gpus" in admitted["message"]
    assert "LocalQueue team-a-gpus" in outcome.status["message"]


def test_an_admitted_job_gets_the_admitted_count_of_pods_on_the_flavors_nodes():
    wl = b.workload(created(), conditions=ADMITTED, cluster_queue="gpus", count=3)
    obs = b.observed(workload=wl, cluster_queue="gpus", flavors=FLAVORS)
    outcome = decide(queued_job(), obs, b.at(2))
    [create] = [a for a in outcome.actions if a.verb == "create" and a.kind == "Pod"]
    pod = create.body
    assert pod["metadata"]["annotations"][q.WORKLOAD_ANNOTATION] == "pretrainjob-gpt"
    assert pod["metadata"]["labels"][q.PODSET_LABEL] == "workers"
    assert pod["spec"]["nodeSelector"] == {"crucible.dev/pool": "gpu"}
    assert pod["spec"]["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists",
                                           "effect": "NoSchedule"}]
    assert "schedulingGates" not in pod["spec"]
    assert outcome.status["admission"] == {"clusterQueue": "gpus", "localQueue": "team-a-gpus",
                                           "pods": 3}
    assert cond(outcome, "Admitted")["status"] == "True"
    assert "Admitted" in reasons(outcome)
    # Partial admission: 3 of nodes.max=4, so pods 1 and 2 follow pod 0, and no pod 3.
    bound = b.pod(0, 0, phase="Pending", node="gpu-node-0", spec_hash=H)
    nxt = decide(queued_job(status=outcome.status), b.observed([bound], workload=wl,
                                                               flavors=FLAVORS), b.at(3))
    assert acts(nxt, "create", "Pod") == [("create", "Pod", "gpt-0-1"), ("create", "Pod",
                                                                         "gpt-0-2")]
    assert "Admitted" not in reasons(nxt)                      # said once per admission
    running = decide(queued_job(status=nxt.status), b.observed(
        b.running(0, 3, H), workload=wl, flavors=FLAVORS), b.at(4))
    assert running.status["phase"] == "Running"
    assert running.status["pods"]["desired"] == 3
    assert cond(running, "Degraded")["status"] == "False"       # all admitted pods run


def test_a_topology_request_reaches_the_workload_and_gates_the_pods():
    topology = {"topology": {"required": "example.com/rack"}}
    wl_body = created(scheduling=topology)
    assert wl_body["spec"]["podSets"][0]["topologyRequest"] == {"required": "example.com/rack"}
    wl = b.workload(wl_body, conditions=ADMITTED, cluster_queue="gpus", count=4)
    outcome = decide(queued_job(scheduling=topology), b.observed(workload=wl, flavors=FLAVORS),
                     b.at(1))
    [create] = [a for a in outcome.actions if a.verb == "create" and a.kind == "Pod"]
    assert create.body["spec"]["schedulingGates"] == [{"name": q.TOPOLOGY_GATE}]
    assert create.body["metadata"]["annotations"][q.TOPOLOGY_ANNOTATION["required"]] == \
        "example.com/rack"


def test_a_gated_pod_is_not_short_of_capacity():
    body = b.pod_body(0, 0, phase="Pending", node=None)
    body["status"]["conditions"] = [{"type": "PodScheduled", "status": "False",
                                     "reason": "SchedulingGated",
                                     "message": "Scheduling is blocked due to non-empty "
                                                "scheduling gates"}]
    assert pod_view(body).unschedulable is None


def test_a_topology_request_without_a_queue_holds_the_job_and_says_how_to_fix_it():
    outcome = decide(b.job(scheduling={"topology": {"preferred": "example.com/rack"}}),
                     b.observed(), b.at(0))
    assert acts(outcome, "create", "Pod") == [] and workload_actions(outcome) == []
    assert outcome.status["phase"] == "Queued"
    assert q.QUEUE_LABEL in cond(outcome, "Admitted")["message"]


def test_preemption_deletes_every_pod_counts_one_infrastructure_restart_then_releases_quota():
    wl = b.workload(created(), conditions=PREEMPTED, cluster_queue="gpus", count=4)
    obs = b.observed(b.running(0, 4, H), workload=wl, flavors=FLAVORS, cluster_queue="gpus")
    outcome = decide(queued_job(status=admitted_status()), obs, b.at(10))
    assert sorted(acts(outcome, "delete", "Pod")) == [("delete", "Pod", f"gpt-0-{i}")
                                                      for i in range(4)]
    assert workload_actions(outcome, "patch_status") == []       # not while pods live
    restarts = outcome.status["restarts"]
    assert (restarts["application"], restarts["infrastructure"]) == (0, 1)
    assert restarts["byCause"] == {"Preempted": 1}
    assert outcome.status["podGeneration"] == 1
    assert outcome.status["phase"] == "Queued" and "admission" not in outcome.status
    assert "Preempted" in reasons(outcome)
    # The pods are terminating: nothing counted again, still no release.
    leaving = [b.pod(0, i, node=f"gpu-node-{i}", spec_hash=H, deletion=40) for i in range(4)]
    nxt = decide(queued_job(status=outcome.status), b.observed(leaving, workload=wl), b.at(11))
    assert nxt.status["restarts"]["infrastructure"] == 1
    assert workload_actions(nxt, "patch_status") == []
    # Gone: the quota is given back, as Kueue's own integrations do.
    gone = decide(queued_job(status=nxt.status), b.observed(workload=wl), b.at(12))
    [release] = workload_actions(gone, "patch_status")
    status = release.body["status"]
    assert status["admission"] is None
    assert release.body["metadata"]["resourceVersion"] == "7"
    by_type = {c["type"]: c for c in status["conditions"]}
    assert by_type["QuotaReserved"]["status"] == "False"
    assert by_type["Admitted"]["status"] == "False"
    assert (by_type["Requeued"]["status"], by_type["Requeued"]["reason"]) == ("True", "Preempted")
    assert by_type["Evicted"]["status"] == "True"                # Kueue's own, kept
    assert gone.status["restarts"]["infrastructure"] == 1
    assert acts(gone, "create", "Pod") == []


def test_readmission_after_a_preemption_starts_the_new_generation():
    released = {"QuotaReserved": ("False", "Pending", "Preempted"),
                "Evicted": ("True", "Preempted", "Preempted"), "Requeued": ("True", "Preempted",
                                                                            "")}
    status = admitted_status(gen=1)
    del status["tracking"]["admission"]
    status["restarts"] = {"total": 1, "application": 0, "infrastructure": 1,
                          "byCause": {"Preempted": 1}}
    wl = b.workload(created(), conditions=released)
    waiting = decide(queued_job(status=status), b.observed(workload=wl), b.at(20))
    assert workload_actions(waiting) == [] and acts(waiting, "create", "Pod") == []
    assert waiting.status["phase"] == "Queued"
    again = b.workload(created(), conditions={**ADMITTED, "Evicted": ("False", "QuotaReserved",
                                                                      "Previously: Preempted")},
                       cluster_queue="gpus", count=4)
    outcome = decide(queued_job(status=waiting.status), b.observed(workload=again,
                                                                   flavors=FLAVORS), b.at(30))
    assert acts(outcome, "create", "Pod") == [("create", "Pod", "gpt-1-0")]
    assert outcome.status["restarts"]["infrastructure"] == 1     # the preemption, once


def test_the_wait_after_a_preemption_is_left_out_of_goodput_like_a_suspension():
    wl = b.workload(created(), conditions=PREEMPTED, cluster_queue="gpus", count=4)
    evicted = decide(queued_job(status=admitted_status()), b.observed(workload=wl), b.at(100))
    assert evicted.status["tracking"]["queuedSince"] == b.ts(100)
    again = b.workload(created(), conditions=ADMITTED, cluster_queue="gpus", count=4)
    back = decide(queued_job(status=evicted.status), b.observed(workload=again, flavors=FLAVORS),
                  b.at(160))
    assert "queuedSince" not in back.status["tracking"]
    assert back.status["tracking"]["suspendedSeconds"] == 60.0


def test_quota_lost_without_an_evicted_condition_is_handled_as_an_eviction():
    wl = b.workload(created(), conditions={"QuotaReserved": ("False", "Inadmissible",
                                                             "ClusterQueue gpus is inactive")})
    outcome = decide(queued_job(status=admitted_status()), b.observed(b.running(0, 4, H),
                                                                      workload=wl), b.at(10))
    assert len(acts(outcome, "delete", "Pod")) == 4
    assert outcome.status["restarts"]["byCause"] == {"Evicted": 1}
    assert workload_actions(outcome, "patch_status") == []      # no quota to give back


def test_a_finished_job_marks_its_workload_finished():
    wl = b.workload(created(), conditions=ADMITTED, cluster_queue="gpus", count=4)
    done = b.running(0, 4, H)
    done[0] = b.pod(0, 0, phase="Succeeded", node="gpu-node-0", spec_hash=H, exit_code=0)
    outcome = decide(queued_job(status=admitted_status()), b.observed(done, workload=wl,
                                                                      flavors=FLAVORS), b.at(50))
    assert outcome.status["phase"] == "Succeeded"
    # The other pods are being stopped: they still use the quota, which stays reserved.
    assert [a.reason for a in workload_actions(outcome, "patch_status")] == ["PodsReady"]
    assert len(acts(outcome, "delete", "Pod")) == 3
    stopping = [b.pod(0, 1, node="gpu-node-1", spec_hash=H, deletion=51)]
    held = decide(queued_job(status=outcome.status), b.observed(stopping, workload=wl), b.at(51))
    assert workload_actions(held, "patch_status") == []
    # Gone: the Workload is Finished, its quota free; again until Kueue shows it.
    [finish] = workload_actions(decide(queued_job(status=held.status),
                                       b.observed(done[:1], workload=wl), b.at(52)),
                                "patch_status")
    nxt = decide(queued_job(status=outcome.status), b.observed(workload=wl), b.at(53))
    [again] = workload_actions(nxt, "patch_status")
    assert (again.name, again.reason) == (finish.name, finish.reason) == ("pretrainjob-gpt",
                                                                         "Finished")
    finished = next(c for c in finish.body["status"]["conditions"] if c["type"] == "Finished")
    assert (finished["status"], finished["reason"]) == ("True", "Succeeded")
    marked = b.workload(created(), conditions={**ADMITTED, "Finished": ("True", "Succeeded", "")},
                        cluster_queue="gpus", count=4)
    assert workload_actions(decide(queued_job(status=nxt.status), b.observed(workload=marked),
                                   b.at(52))) == []


def test_suspension_deletes_the_workload_and_resumption_makes_it_again():
    wl = b.workload(created(), conditions=ADMITTED, cluster_queue="gpus", count=4)
    outcome = decide(queued_job(status=admitted_status(), suspend=True),
                     b.observed(b.running(0, 4, H), workload=wl), b.at(10))
    # The pods go first; the Workload (and with it the quota) once they are gone.
    assert workload_actions(outcome) == [] and len(acts(outcome, "delete", "Pod")) == 4
    assert outcome.status["phase"] == "Suspended" and "admission" not in outcome.status
    outcome = decide(queued_job(status=outcome.status, suspend=True), b.observed(workload=wl),
                     b.at(11))
    assert [(a.verb, a.name) for a in workload_actions(outcome)] == [("delete",
                                                                      "pretrainjob-gpt")]


def test_a_spec_change_that_reaches_kueue_replaces_the_workload():
    wl = b.workload(created(), conditions=ADMITTED, cluster_queue="gpus", count=4)
    wider = queued_job(status=admitted_status(), nodes={"min": 2, "max": 3})
    outcome = decide(wider, b.observed(b.running(0, 4, H), workload=wl), b.at(10))
    # The pods go first: deleting the Workload would free the quota they still use.
    assert workload_actions(outcome) == [] and len(acts(outcome, "delete", "Pod")) == 4
    assert outcome.status["podGeneration"] == 1
    assert outcome.status["restarts"]["total"] == 0              # not a failure
    wider = queued_job(status=outcome.status, nodes={"min": 2, "max": 3})
    gone = decide(wider, b.observed(workload=wl), b.at(11))
    assert [(a.verb, a.reason) for a in workload_actions(gone)] == [("delete", "SpecChanged")]
    assert gone.status["podGeneration"] == 1
    assert wl.digest != q.workload(b.JOB, b.NS, b.UID, b.spec(nodes={"min": 2, "max": 3}),
                                   "team-a-gpus", None)["metadata"]["annotations"][
        ANNOTATION_WORKLOAD_DIGEST]


def test_the_workload_carries_the_priority_classs_value_and_waits_to_know_it():
    pc = {"scheduling": {"priorityClassName": "research-high"}}
    waiting = decide(queued_job(**pc), b.observed(priority_classes=frozenset({"research-high"})),
                     b.at(0))
    assert workload_actions(waiting) == []
    assert cond(waiting, "Admitted")["reason"] == "PriorityClassUnknown"
    outcome = decide(queued_job(**pc), b.observed(priority_classes=frozenset({"research-high"}),
                                                  priority_values={"research-high": 1000}),
                     b.at(1))
    [create] = workload_actions(outcome, "create")
    assert create.body["spec"]["priority"] == 1000
    assert create.body["spec"]["priorityClassRef"] == {
        "group": "scheduling.k8s.io", "kind": "PriorityClass", "name": "research-high"}


def test_a_namesakes_workload_is_waited_for_and_never_adopted():
    wl = b.workload(created(), conditions=ADMITTED, cluster_queue="gpus", count=4, owner="uid-old")
    outcome = decide(queued_job(), b.observed(workload=wl), b.at(0))
    assert workload_actions(outcome) == [] and acts(outcome, "create", "Pod") == []
    assert cond(outcome, "Admitted")["reason"] == "WaitingForNamesake"


def test_a_job_taken_out_of_its_queue_stops_its_pods_before_its_workload_frees_the_quota():
    """Removing the label must not free the quota while the admitted pods keep running: they
    stop first, the Workload (and its quota) stays until they are gone, then the job runs
    outside Kueue."""
    wl = b.workload(created(), conditions=ADMITTED, cluster_queue="gpus", count=4)
    outcome = decide(b.job(status=admitted_status()), b.observed(b.running(0, 4, H), workload=wl),
                     b.at(10))
    assert workload_actions(outcome) == []
    assert len(acts(outcome, "delete", "Pod")) == 4 and acts(outcome, "create", "Pod") == []
    assert outcome.status["phase"] == "Queued"
    assert cond(outcome, "Admitted")["reason"] == "LeavingQueue"
    # The pods are gone: now the Workload goes, and the job runs without Kueue, as a new
    # generation that no failure is counted for (leaving the queue was the user's doing).
    gone = decide(b.job(status=outcome.status), b.observed(workload=wl), b.at(20))
    assert [(a.verb, a.reason) for a in workload_actions(gone)] == [("delete", "NotQueued")]
    assert cond(gone, "Admitted")["reason"] == "NotQueued"
    assert "admission" not in gone.status
    assert gone.status["podGeneration"] == 1
    assert gone.status["restarts"]["total"] == 0 and not gone.status["restarts"]["byCause"]
    assert acts(gone, "create", "Pod") == [("create", "Pod", "gpt-1-0")]


def test_an_operator_without_kueue_holds_a_queued_job_and_says_so():
    from crucible.operator.cluster_policy import ClusterPolicy

    outcome = decide(queued_job(), b.observed(), b.at(0), ClusterPolicy(kueue=False))
    assert workload_actions(outcome) == [] and acts(outcome, "create", "Pod") == []
    assert outcome.status["phase"] == "Queued"
    assert cond(outcome, "Admitted")["reason"] == "KueueDisabled"
    assert "--no-kueue" in cond(outcome, "Admitted")["message"]


def test_a_cluster_without_kueue_holds_a_queued_job_says_how_to_fix_it_and_tries_again():
    first = decide(queued_job(), b.observed(), b.at(0))
    assert [a.verb for a in workload_actions(first)] == ["create"]
    assert cond(first, "Admitted")["reason"] == "Created"
    # The create met a 404: the Workload API is not served. Said so; the create is tried again.
    outcome = decide(queued_job(status=first.status), b.observed(unserved=frozenset({"Workload"})),
                     b.at(5))
    assert [a.verb for a in workload_actions(outcome)] == ["create"]
    assert acts(outcome, "create", "Pod") == []
    assert outcome.status["phase"] == "Queued"
    message = cond(outcome, "Admitted")["message"]
    assert cond(outcome, "Admitted")["reason"] == "KueueNotInstalled"
    assert "install Kueue" in message and "--no-kueue" in message and q.API_VERSION in message
    assert outcome.wake_in_s is not None and outcome.wake_in_s <= 30


def test_a_kueue_workload_priority_class_wins_over_the_pods_priority_class():
    labels = {**QUEUE, q.PRIORITY_LABEL: "production"}
    pc = {"scheduling": {"priorityClassName": "research-high"}}
    known = {"priority_classes": frozenset({"research-high"}),
             "priority_values": {"research-high": 1000}}
    waiting = decide(b.job(labels=labels, **pc), b.observed(**known), b.at(0))
    assert workload_actions(waiting) == []
    assert "WorkloadPriorityClass production" in cond(waiting, "Admitted")["message"]
    outcome = decide(b.job(labels=labels, **pc), b.observed(
        **known, workload_priorities={"production": 5000}), b.at(1))
    [create] = workload_actions(outcome, "create")
    assert create.body["spec"]["priority"] == 5000
    assert create.body["spec"]["priorityClassRef"] == {
        "group": "kueue.x-k8s.io", "kind": "WorkloadPriorityClass", "name": "production"}
    # The pods keep their own class (the kubelet and scheduler read that one).
    assert create.body["spec"]["podSets"][0]["template"]["spec"]["priorityClassName"] == \
        "research-high"


def test_a_workload_deleted_under_a_running_job_takes_its_pods_and_is_made_again():
    outcome = decide(queued_job(status=admitted_status()), b.observed(b.running(0, 4, H)),
                     b.at(10))
    assert len(acts(outcome, "delete", "Pod")) == 4
    assert [a.verb for a in workload_actions(outcome)] == ["create"]
    assert outcome.status["restarts"]["byCause"] == {"Evicted": 1}
    assert outcome.status["podGeneration"] == 1 and outcome.status["phase"] == "Queued"


def test_a_job_naming_no_priority_class_takes_the_clusters_default_one():
    outcome = decide(queued_job(), b.observed(priority_values={"normal": 50, "other": 7},
                                              default_priority_class="normal"), b.at(0))
    [create] = workload_actions(outcome, "create")
    assert create.body["spec"]["priority"] == 50
    assert create.body["spec"]["priorityClassRef"]["name"] == "normal"
    without = decide(queued_job(), b.observed(priority_values={"other": 7}), b.at(0))
    assert "priority" not in workload_actions(without, "create")[0].body["spec"]
