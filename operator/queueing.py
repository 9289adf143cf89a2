"""Queueing with Kueue: a PretrainJob admitted, preempted and resumed as one unit.

Owns what a job carrying the `kueue.x-k8s.io/queue-name` label does differently: it has pods only
while a Kueue Workload it owns is admitted. A Workload the operator owns, rather than Kueue's
pod-group integration (docs/operator.md, "Queueing with Kueue", has the long form):
- a pod group has a fixed size, so no partial admission between nodes.min and nodes.max;
- on preemption Kueue would delete the group's pods itself, and the owner must make them again
  under new names anyway: the operator already does both, with generations;
- pod groups need Kueue's pod webhook, which fails closed: no pod in a managed namespace could be
  created while Kueue is down.

Kueue admits a Workload that no job integration stands behind like any other (quota, priority,
preemption, partial admission, topology-aware scheduling); what an integration does after that
is done here, step for step as Kueue's own `jobframework` reconciler does it:
- admitted: the pass creates the admitted number of pods, marked as the Workload's (its
  annotation and pod-set label) and placed on its ResourceFlavors (their node labels and
  tolerations). With a topology request the pods also carry Kueue's scheduling gate: Kueue's
  topology ungater lifts it, giving each pod the node selector of its domain;
- evicted (preempted, its ClusterQueue stopped, ...): delete the pods (each gets its grace period
  to finish a checkpoint), count one infrastructure restart (never against maxRestarts), start a
  new generation, and once no pod is left release the quota: `status.admission` cleared,
  QuotaReserved=False, Requeued=True after a preemption. Kueue leaves that to the job's owner; a
  preemptor would otherwise wait forever. Re-admission creates the new generation's pods, and
  the trainer resumes from the newest commit as after any restart;
- finished: the Workload's Finished condition gives the quota back;
- suspended: the Workload is deleted (a suspended job holds no quota) and made again on resume.

Pure: Workload manifests and status patches, and decisions written into a `Pass`.
"""

from __future__ import annotations

import copy
import datetime as dt
import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from crucible.api.launch import CONTAINER
from crucible.api.names import ANNOTATION_WORKLOAD_DIGEST, workload_name
from crucible.api.progress import format_time, parse_time
from crucible.api.spec import PretrainJobSpec, TopologySpec
from crucible.operator import conditions as c
from crucible.operator import failures as f
from crucible.operator import manifests as m
from crucible.operator.observed import WORKLOAD_PODSET, JobView, WorkloadView
from crucible.operator.outcome import QUEUED, Pass
from crucible.operator.tenant_limits import PRIORITY_LABEL

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
# A Kueue WorkloadPriorityClass for the job's Workload: it wins over the pods' PriorityClass,
# as in Kueue's own integrations (jobframework.ExtractPriority), and leaves the pods' alone.
GROUP, VERSION, PLURAL = "kueue.x-k8s.io", "v1beta2", "workloads"
API_VERSION = f"{GROUP}/{VERSION}"
PODSET = WORKLOAD_PODSET
# What Kueue reads on a pod (sigs.k8s.io/kueue v0.17: apis/kueue/v1beta2/topology_types.go,
# pkg/constants/constants.go): whose pod it is, its pod set, and the topology gate.
WORKLOAD_ANNOTATION = "kueue.x-k8s.io/workload"
PODSET_LABEL = "kueue.x-k8s.io/podset"
TOPOLOGY_GATE = "kueue.x-k8s.io/topology"
TOPOLOGY_ANNOTATION = {"required": "kueue.x-k8s.io/podset-required-topology",
                       "preferred": "kueue.x-k8s.io/podset-preferred-topology"}
UNCONSTRAINED_ANNOTATION = "kueue.x-k8s.io/podset-unconstrained-topology"
# Evictions after which Kueue's own integrations mark the Workload Requeued=True; after the
# others (a stopped queue, a deactivation) Kueue requeues it itself when the cause is gone.
REQUEUED_AFTER = ("Preempted", "NodeFailures")


DEFAULT_QUEUE = "default"   # Kueue's LocalQueueDefaulting: the queue of an unlabelled job


def queue_name(job: JobView, manage_all: bool = False, default_queue: bool = False,
               chosen: str | None = None) -> str | None:
    """The LocalQueue the job waits in: its label's; for an unlabelled job, when the operator
    manages every job (`--manage-jobs-without-queue-name`, as Kueue's own setting of that name)
    and the namespace has a LocalQueue named `default`, that one (Kueue's LocalQueueDefaulting,
    pkg/controller/jobframework/defaults.go). Kueue defaults once, when the job is made; so
    here, once chosen (`chosen`, from `tracking.defaultQueue`), it sticks: a LocalQueue made
    or deleted later never moves a running job."""
    label = job.labels.get(QUEUE_LABEL)
    if label:
        return label
    if manage_all and chosen:
        return chosen
    return DEFAULT_QUEUE if manage_all and default_queue else None


# --- the Workload -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Priority:
    """The Workload's priority: the class it comes from and that class's value (Kueue orders
    and preempts by the value; a job integration's webhook would look it up, and here nothing
    else does)."""

    kind: str        # PriorityClass (scheduling.k8s.io) or WorkloadPriorityClass (Kueue's)
    name: str
    value: int

    @property
    def ref(self) -> dict:
        group = "scheduling.k8s.io" if self.kind == "PriorityClass" else GROUP
        return {"group": group, "kind": self.kind, "name": self.name}


def workload(job: str, namespace: str, uid: str, spec: PretrainJobSpec, queue: str,
             priority: Priority | None) -> dict:
    """The job's Workload: one pod set of nodes.max pods, at least nodes.min (partial admission),
    with the resources, node selector and tolerations every worker pod asks for. Its digest
    annotation says which spec it was made from: Kueue forbids changing pod sets once quota is
    reserved, so a job whose digest moved gets a new Workload."""
    sched = spec.scheduling
    pod_spec: dict = {"restartPolicy": "Never",
                      "containers": [{"name": CONTAINER, "image": spec.image,
                                      "resources": m.container_resources(spec)}]}
    if sched.node_selector:
        pod_spec["nodeSelector"] = dict(sched.node_selector)
    if sched.tolerations:
        pod_spec["tolerations"] = m.tolerations(spec)
    if sched.priority_class_name:
        pod_spec["priorityClassName"] = sched.priority_class_name
    podset: dict = {"name": PODSET, "count": spec.nodes.max,
                    "template": {"metadata": {"labels": {PODSET_LABEL: PODSET}}, "spec": pod_spec}}
    if spec.nodes.min < spec.nodes.max:
        podset["minCount"] = spec.nodes.min
    if sched.topology is not None:
        kind = "required" if sched.topology.required else "preferred"
        podset["topologyRequest"] = {kind: sched.topology.level}
    wl_spec: dict = {"queueName": queue, "podSets": [podset]}
    # The digest leaves the priority out: Kueue lets it change under an admitted Workload (only
    # pod sets are immutable), and it is decided once, when the Workload is made, as a pod's
    # is: a new globalDefault PriorityClass must not restart every admitted job.
    meta = m.metadata(job, uid, workload_name(job), namespace)
    meta["annotations"] = {ANNOTATION_WORKLOAD_DIGEST: digest(wl_spec)}
    if priority is not None:
        wl_spec["priorityClassRef"] = priority.ref
        wl_spec["priority"] = priority.value
    return {"apiVersion": API_VERSION, "kind": "Workload", "metadata": meta, "spec": wl_spec}


def same_spec(wl: WorkloadView, desired: dict) -> bool:
    """Whether the Workload was made from the spec `desired` was (made without a priority):
    its digest, or the digest an earlier version wrote, which included the Workload's priority
    (a Workload made then must not be made again for that alone)."""
    spec = {k: v for k, v in desired["spec"].items() if k not in ("priorityClassRef", "priority")}
    legacy = dict(spec)
    if wl.priority_ref is not None:
        legacy.update(priorityClassRef=dict(wl.priority_ref), priority=wl.priority)
    return wl.digest in (digest(spec), digest(legacy))


def digest(wl_spec: dict) -> str:
    return hashlib.sha256(json.dumps(wl_spec, sort_keys=True).encode()).hexdigest()[:16]


def _condition(old: tuple, type_: str, status: str, reason: str, message: str,
               now: dt.datetime) -> dict:
    """A Kueue condition; its transition time moves only when its status does."""
    was = next((x for x in old if x.get("type") == type_), None)
    since = was.get("lastTransitionTime") if was and was.get("status") == status else None
    return {"type": type_, "status": status, "reason": reason, "message": message[:32768],
            "lastTransitionTime": since or format_time(now)}


def _status_patch(wl: WorkloadView, changed: list[dict], **fields) -> dict:
    """A merge patch of the Workload's status: its conditions with `changed` set, and `fields`.
    It carries the resourceVersion read, so a patch racing one of Kueue's fails (409) and the
    next pass decides again from the newer object."""
    kept = [dict(x) for x in wl.raw_conditions
            if x.get("type") not in {new["type"] for new in changed}]
    return {"metadata": {"resourceVersion": wl.resource_version},
            "status": {**fields, "conditions": kept + changed}}


def release(wl: WorkloadView, now: dt.datetime) -> dict:
    """Give back an evicted Workload's quota once its pods are gone (what Kueue's
    jobframework reconciler does for the jobs it integrates)."""
    evicted = wl.conditions.get("Evicted")
    reason = evicted.reason if evicted and evicted.reason else "Released"
    message = evicted.message if evicted and evicted.message else "the pods are gone"
    old = wl.raw_conditions
    return _status_patch(wl, [
        _condition(old, "QuotaReserved", "False", "Pending", message, now),
        _condition(old, "Admitted", "False", "NoReservation", "The workload has no reservation",
                   now),
        _condition(old, "Requeued", "True" if reason in REQUEUED_AFTER else "False", reason,
                   message, now),
        # Not admitted: waiting to start again, as Kueue's jobframework writes it; left True,
        # the next admission would read as a recovery, timed by recoveryTimeout (no default)
        # instead of waitForPodsReady's timeout.
        _condition(old, "PodsReady", "False", "WaitForStart", NOT_READY, now)], admission=None)


# Kueue's own words for the PodsReady condition (sigs.k8s.io/kueue v0.17.0,
# pkg/controller/jobframework/reconciler.go, generatePodsReadyCondition).
NOT_READY = "Not all pods are ready or succeeded"
RECOVERING = "At least one pod has failed, waiting for recovery"
READY = "All pods reached readiness and the workload is running"


def pods_ready_condition(wl: WorkloadView, ready: bool) -> tuple[str, str, str]:
    """(status, reason, message) of the Workload's PodsReady condition, as Kueue's jobframework
    reconciler writes it for the jobs it integrates: with waitForPodsReady on, Kueue evicts an
    admitted Workload whose PodsReady stays False past its timeout, so nobody writing it means
    every job evicted a few minutes after each admission."""
    was = wl.conditions.get("PodsReady")
    admitted = wl.conditions.get("Admitted")
    if (was is not None and admitted is not None and admitted.since is not None
            and was.since is not None and was.since < admitted.since):
        was = None     # from before this admission (an eviction someone else released)
    if ready:
        recovering = was is not None and was.reason in ("WaitForRecovery", "Recovered")
        return "True", "Recovered" if recovering else "Started", READY
    if was is not None and (was.status == "True" or was.reason == "WaitForRecovery"):
        return "False", "WaitForRecovery", RECOVERING
    return "False", "WaitForStart", NOT_READY


def pods_ready(wl: WorkloadView, ready: bool, now: dt.datetime) -> dict | None:
    """The status patch that brings PodsReady to where it should be; None when it is there."""
    status, reason, message = pods_ready_condition(wl, ready)
    was = wl.conditions.get("PodsReady")
    if was is not None and (was.status, was.reason) == (status, reason):
        return None
    return _status_patch(wl, [_condition(wl.raw_conditions, "PodsReady", status, reason,
                                         message, now)])


def finish(wl: WorkloadView, succeeded: bool, message: str, now: dt.datetime) -> dict:
    """The Workload's Finished condition: Kueue frees its quota."""
    return _status_patch(wl, [_condition(wl.raw_conditions, "Finished", "True",
                                         "Succeeded" if succeeded else "Failed", message, now)])


# --- the pods ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Admission:
    """What an admitted Workload asks of the pods made under it."""

    workload: str
    count: int
    node_labels: tuple[tuple[str, str], ...] = ()
    tolerations: tuple[dict, ...] = ()
    topology: TopologySpec | None = None
    topology_assigned: bool = False     # Kueue's TAS placed it, asked for or implied
    pod_set_updates: tuple[Mapping, ...] = ()   # from the admission checks, in their order


def admitted_pod(pod: dict, admission: Admission) -> dict:
    """A worker pod (`manifests.pod`) as Kueue's own integrations make one from an admission
    (sigs.k8s.io/kueue v0.17.0: pkg/podset/podset.go FromAssignment, and the podSetUpdates
    merge in pkg/controller/jobframework/reconciler.go): marked as the Workload's, on the
    admission's ResourceFlavors, with what its admission checks ask (a ProvisioningRequest's
    node selector, say), and, whenever Kueue's topology-aware scheduling assigned the pod set a
    topology (a request of the job's, or implied by a ClusterQueue whose flavors are all TAS),
    gated until Kueue's topology ungater gives each pod the node selector of its domain."""
    pod = copy.deepcopy(pod)
    meta, spec = pod["metadata"], pod["spec"]
    meta["labels"][PODSET_LABEL] = PODSET
    meta.setdefault("annotations", {})[WORKLOAD_ANNOTATION] = admission.workload
    if admission.node_labels:
        spec["nodeSelector"] = {**spec.get("nodeSelector", {}), **dict(admission.node_labels)}
    tolerations = [dict(t) for t in admission.tolerations]
    for update in admission.pod_set_updates:
        meta["labels"].update(update.get("labels") or {})
        meta["annotations"].update(update.get("annotations") or {})
        if update.get("nodeSelector"):
            spec["nodeSelector"] = {**spec.get("nodeSelector", {}), **update["nodeSelector"]}
        tolerations += [dict(t) for t in update.get("tolerations") or []]
    if tolerations:
        spec["tolerations"] = spec.get("tolerations", []) + [
            t for i, t in enumerate(tolerations)
            if t not in spec.get("tolerations", []) and t not in tolerations[:i]]
    if admission.topology is not None:
        kind = "required" if admission.topology.required else "preferred"
        meta["annotations"][TOPOLOGY_ANNOTATION[kind]] = admission.topology.level
    elif admission.topology_assigned:
        meta["annotations"][UNCONSTRAINED_ANNOTATION] = "true"
    if admission.topology is not None or admission.topology_assigned:
        spec["schedulingGates"] = [{"name": TOPOLOGY_GATE}]
    return pod


# --- the pass ---------------------------------------------------------------------------------
def admitted(p: Pass) -> bool:
    """Whether the pass may run the job's pods; when not, the status says why. Sets
    `p.admission` for a queued job that Kueue admitted."""
    policy = p.cluster_policy
    queue = queue_name(p.job, policy.kueue and policy.kueue_manage_all, p.obs.default_queue,
                       p.track.get("defaultQueue"))
    if queue is not None and not p.job.labels.get(QUEUE_LABEL):
        p.track["defaultQueue"] = queue    # chosen once, as Kueue's defaulting at creation
    ours = p.obs.workload if p.obs.workload and p.obs.workload.owner_uid == p.job.uid else None
    if queue is None and policy.kueue and policy.kueue_manage_all:
        _withdraw_pods(p)
        _hold(p, "NoQueue", f"this cluster queues every job through Kueue (the operator's "
              f"--manage-jobs-without-queue-name): label the job {QUEUE_LABEL}=<LocalQueue>, or "
              f"create a LocalQueue named {DEFAULT_QUEUE} in namespace {p.job.namespace}")
        return False
    if queue is None:
        if ours is not None and _live(p):
            # The label was removed from a queued job (the chart's admission policy refuses
            # that while the job runs, as Kueue's webhook does for its own Jobs). Its pods run
            # on the Workload's quota: they stop first and the quota stays taken until they are
            # gone, as for a suspended job; then the job runs outside Kueue, as a new
            # generation that no failure counts against.
            if p.track.pop("admission", None) is not None:
                p.new_generation()
            _withdraw_pods(p)
            _hold(p, "LeavingQueue", f"the {QUEUE_LABEL} label was removed: the pods stop "
                  "while the Workload keeps their quota, then the job runs without Kueue")
            p.wake(2)
            return False
        if ours is not None:   # no pod runs on its quota any more: the job leaves Kueue
            p.act("delete", "Workload", ours.name, reason="NotQueued")
            p.track.pop("admission", None)
            p.status.pop("admission", None)
            p.cond(c.ADMITTED, False, "NotQueued", f"no {QUEUE_LABEL} label: Kueue does not "
                   "admit this job")
        if p.spec.scheduling.topology is not None:
            _hold(p, "NoQueue", f"scheduling.topology is placed by Kueue: add the {QUEUE_LABEL} "
                  "label naming a LocalQueue, or remove scheduling.topology")
            return False
        return True
    if not p.cluster_policy.kueue:
        _hold(p, "KueueDisabled", f"the job has the {QUEUE_LABEL} label, but this operator runs "
              "without Kueue (--no-kueue; the chart's kueue.enabled=false): remove the label, "
              "or enable Kueue for the operator")
        return False
    name = workload_name(p.job.name)
    if p.obs.workload is not None and ours is None:
        _hold(p, "WaitingForNamesake", f"Workload {name} of a deleted namesake still exists; "
              "waiting for it to go")
        p.wake(2)
        return False
    conflict = ("Workload", name) in p.obs.conflicts
    if ours is None:
        priority, unknown = _priority(p)
        if unknown:
            _hold(p, "PriorityClassUnknown", f"{unknown} is not known (yet): the Workload "
                  "needs its value")
            p.wake(10)
            return False
        desired = workload(p.job.name, p.job.namespace, p.job.uid, p.spec, queue, priority)
        # Deleted under a running job (by a person, say): its quota is gone with it.
        _evict(p, "WorkloadDeleted", lambda cq: f"the job's Workload was deleted while "
               f"ClusterQueue {cq} admitted it; a new one is queued")
        p.act("create", "Workload", name, desired)   # again after a conflict: it may be gone
        if conflict:
            _hold(p, "NameConflict", f"Workload {name} exists and belongs to another owner: "
                  "delete it (it is never adopted)")
            p.wake(10)
            return False
        if "Workload" in p.obs.unserved:   # tried again every pass: Kueue may come later
            _hold(p, "KueueNotInstalled", f"the cluster does not serve Kueue's Workload API "
                  f"({API_VERSION}): install Kueue, or remove the {QUEUE_LABEL} label and "
                  "run the operator with --no-kueue (the chart's kueue.enabled=false)")
            p.wake(30)
            return False
        _queued(p, "Created", f"Workload {name} created in LocalQueue {queue}"
                f"{_cluster_queue(p)}; waiting for Kueue to admit it")
        return False
    desired = workload(p.job.name, p.job.namespace, p.job.uid, p.spec, queue, None)
    if not same_spec(ours, desired) or ours.is_true("Finished"):
        # Pod sets are immutable once Kueue reserved quota: a new Workload for the new spec,
        # once the pods are gone (deleting the Workload gives its quota back at once).
        if p.track.pop("admission", None) is not None:
            p.new_generation()   # the spec change restarts the group, uncounted
        live = _withdraw_pods(p)
        if not live:
            p.act("delete", "Workload", ours.name, reason="SpecChanged")
        _queued(p, "SpecChanged", "the spec changed what Kueue admits (pods, resources, "
                "placement or queue): the Workload is made again" +
                (f" once its {live} pod(s) are gone" if live else ""))
        return False
    _reprioritize(p, ours)
    if ours.is_true("Evicted") or (p.track.get("admission") and not ours.is_true("QuotaReserved")):
        _evicted(p, ours, queue)
        return False
    if not ours.is_true("Admitted"):
        _withdraw_pods(p)
        why = ours.conditions.get("QuotaReserved")
        reason = why.reason if why and why.reason else "Pending"
        message = why.message if why and why.message else "waiting for Kueue"
        _queued(p, reason, f"in LocalQueue {queue}{_cluster_queue(p)}: {message}")
        return False
    return _admit(p, ours, queue)


def _priority(p: Pass) -> tuple[Priority | None, str | None]:
    """The Workload's priority, or what names a class whose value is not known."""
    kueue_class = p.job.labels.get(PRIORITY_LABEL)
    if kueue_class:
        value = p.obs.workload_priorities.get(kueue_class)
        return ((Priority("WorkloadPriorityClass", kueue_class, value), None) if value is not None
                else (None, f"WorkloadPriorityClass {kueue_class} named by the {PRIORITY_LABEL} "
                      "label"))
    # Naming none, the pods get the cluster's default class; Kueue's integrations then take its
    # value for the Workload too, and so does this one.
    pod_class = p.spec.scheduling.priority_class_name or p.obs.default_priority_class
    if pod_class:
        value = p.obs.priority_values.get(pod_class)
        return ((Priority("PriorityClass", pod_class, value), None) if value is not None
                else (None, f"PriorityClass {pod_class} named by scheduling.priorityClassName"))
    return None, None


def _reprioritize(p: Pass, wl: WorkloadView) -> None:
    """The job's kueue.x-k8s.io/priority-class label names another WorkloadPriorityClass than
    the Workload's: its priority changes in place (Kueue allows it under an admitted Workload,
    and its own integrations follow the label). Any other priority is fixed at creation."""
    name = p.job.labels.get(PRIORITY_LABEL)
    value = p.obs.workload_priorities.get(name) if name else None
    if value is None or wl.priority_class == name:
        return
    # Kueue's CRD forbids adding a priorityClassRef to, or changing its kind on, a Workload
    # holding quota (v1beta2 workload_types.go validation rules); its own integrations update
    # only one with no class or a WorkloadPriorityClass (jobframework/reconciler.go,
    # UpdateWorkloadPriority). Anything else keeps the priority it was made with.
    if wl.priority_ref is None:
        if wl.is_true("QuotaReserved"):
            return
    elif wl.priority_ref.get("kind") != "WorkloadPriorityClass":
        return
    ref = Priority("WorkloadPriorityClass", name, value)
    p.act("patch", "Workload", wl.name, {"metadata": {"resourceVersion": wl.resource_version},
                                         "spec": {"priorityClassRef": ref.ref,
                                                  "priority": value}},
          reason="PriorityChanged")
    p.event("Normal", "PriorityChanged", f"Workload {wl.name} now has WorkloadPriorityClass "
            f"{name} ({value}), as the {PRIORITY_LABEL} label says; nothing restarts")


def _admit(p: Pass, wl: WorkloadView, queue: str) -> bool:
    labels, tolerations = {}, []
    for name in wl.flavors:
        flavor = p.obs.flavors.get(name)
        if flavor is None:
            _hold(p, "FlavorUnknown", f"admitted on ResourceFlavor {name}, which the operator "
                  "cannot see (yet): its node labels decide where the pods go")
            p.wake(5)
            return False
        labels.update(dict(flavor.node_labels))
        tolerations += [t for t in flavor.tolerations if t not in tolerations]
    count = min(wl.count or p.spec.nodes.max, p.spec.nodes.max)
    record = {"clusterQueue": wl.cluster_queue, "localQueue": queue, "pods": count}
    message = (f"admitted by ClusterQueue {wl.cluster_queue} (LocalQueue {queue}): {count} of "
               f"nodes.max={p.spec.nodes.max} pods" +
               (f" on ResourceFlavor {', '.join(wl.flavors)}" if wl.flavors else ""))
    if p.track.get("admission") != record:
        p.event("Normal", "Admitted", message)
        p.track["admittedGeneration"] = p.gen
    elif count < p.spec.nodes.max and p.gen > int(p.track.get("admittedGeneration", p.gen)):
        return _regrow(p, wl, queue, count)
    since = parse_time(p.track.pop("queuedSince", None))
    if since is not None:   # back from a preemption: the wait is not the job's lost time
        p.track["suspendedSeconds"] = round(float(p.track.get("suspendedSeconds", 0.0))
                                            + (p.now - since).total_seconds(), 3)
    p.track["admission"] = record
    p.status["admission"] = record
    p.cond(c.ADMITTED, True, "Admitted", message)
    p.admission = Admission(wl.name, count, tuple(sorted(labels.items())), tuple(tolerations),
                            p.spec.scheduling.topology, wl.topology_assigned,
                            wl.pod_set_updates)
    ready = sum(1 for pod in p.obs.pods if pod.generation == p.gen and not pod.deleting
                and (pod.ready or pod.phase == "Succeeded")) >= count
    patch = pods_ready(wl, ready, p.now)
    if patch is not None:
        p.act("patch_status", "Workload", wl.name, patch, reason="PodsReady")
    return True


def _regrow(p: Pass, wl: WorkloadView, queue: str, count: int) -> bool:
    """A job Kueue admitted below nodes.max restarts its group (a failure, a lost pod 0, a
    hang): it asks Kueue again for nodes.max instead of carrying the smaller width on. The
    restart already costs a reload from the newest checkpoint; a Workload's pod sets cannot
    change once admitted, so asking again means a new Workload (once the old generation's pods
    are gone: the quota is theirs until then). Kueue admits it again at whatever width fits,
    which may be the same; the wait is left out of goodput as after a preemption."""
    live = _withdraw_pods(p)
    if not live:
        p.act("delete", "Workload", wl.name, reason="Regrow")
        p.track.pop("admission", None)
        p.track.pop("admittedGeneration", None)
        p.track["queuedSince"] = format_time(p.now)
    _queued(p, "Regrow", f"admitted with {count} of nodes.max={p.spec.nodes.max} pods and "
            "restarting: asking Kueue again for nodes.max" +
            (f" once its {live} pod(s) are gone" if live else ""))
    return False


def _evicted(p: Pass, wl: WorkloadView, queue: str) -> None:
    """Kueue took the quota back: the pods go as one unit, then the quota is released."""
    evicted = wl.conditions.get("Evicted")
    reason = evicted.reason if evicted and evicted.status == "True" and evicted.reason \
        else "QuotaLost"
    message = (evicted.message if evicted and evicted.status == "True" and evicted.message
               else "Kueue no longer reserves quota for the Workload")
    live = _evict(p, reason, lambda cq: f"Kueue evicted the job from ClusterQueue {cq} "
                  f"({reason}): {message}")
    if wl.is_true("QuotaReserved") and not live:
        p.act("patch_status", "Workload", wl.name, release(wl, p.now), reason="Released")
    _queued(p, reason, f"evicted by Kueue ({reason}: {message}); "
            + (f"{live} pod(s) still terminating" if live else
               f"waiting in LocalQueue {queue}{_cluster_queue(p)} for re-admission"))


def _evict(p: Pass, reason: str, describe: Callable[[str | None], str]) -> int:
    """The pods go as one unit: one infrastructure restart per admission lost, and a new
    generation; `describe(cluster_queue)` says why. How many pods are still live."""
    admission = p.track.pop("admission", None)
    if admission is not None:
        failure = f.Failure("Preempted" if reason == "Preempted" else "Evicted",
                            f.INFRASTRUCTURE, describe(admission.get("clusterQueue")))
        p.new_generation(failure)
        p.track["queuedSince"] = format_time(p.now)   # goodput leaves the wait out, as a suspension
        p.event("Warning", failure.cause, f"{failure.message}; deleting its pods as one unit "
                "(checkpoints stay); it resumes from the newest commit when admitted again")
    return _withdraw_pods(p)


def _withdraw_pods(p: Pass) -> int:
    """Delete every pod still running or terminating; how many are left."""
    live = [pod for pod in p.obs.pods if not pod.terminated]
    for pod in live:
        p.delete(pod)
    return len(live)


def _cluster_queue(p: Pass) -> str:
    return f" (ClusterQueue {p.obs.cluster_queue})" if p.obs.cluster_queue else ""


def _queued(p: Pass, reason: str, message: str) -> None:
    was = c.get(p.conds, c.ADMITTED)
    if not was or was.get("status") != "False" or was.get("reason") != reason:
        p.event("Normal", "Queued", message)
    _hold(p, reason, message)


def _hold(p: Pass, reason: str, message: str) -> None:
    p.status["phase"] = QUEUED
    p.status.pop("admission", None)
    p.status["pods"] = {"desired": p.spec.nodes.max, "running": 0, "pending": 0, "failed": 0,
                        "lost": 0}
    p.cond(c.ADMITTED, False, reason, message)
    p.cond(c.RUNNING, False, "Queued", message)
    p.status["message"] = f"{QUEUED}: {message}"


def withdraw(p: Pass, reason: str) -> None:
    """A suspended job holds no quota: its Workload goes (made again on resume), once its pods
    are gone (the quota is free the moment the Workload is)."""
    wl = p.obs.workload
    if wl is not None and wl.owner_uid == p.job.uid and not _live(p):
        p.act("delete", "Workload", wl.name, reason=reason)
    p.track.pop("admission", None)
    p.track.pop("queuedSince", None)   # the suspension's own clock takes over
    p.status.pop("admission", None)
    if c.get(p.conds, c.ADMITTED):
        p.cond(c.ADMITTED, False, reason, "the job is suspended: its Workload is deleted")


def _live(p: Pass) -> int:
    return sum(1 for pod in p.obs.pods if not pod.terminated)


def finished(p: Pass) -> None:
    """A Succeeded or Failed job's Workload is marked Finished, which frees its quota: once no
    pod of it runs any more (a failed job's survivors are being stopped), never before."""
    wl = p.obs.workload
    if wl is None or wl.owner_uid != p.job.uid or wl.is_true("Finished") or _live(p):
        return
    succeeded = p.status.get("phase") == "Succeeded"
    p.act("patch_status", "Workload", wl.name,
          finish(wl, succeeded, p.status.get("message") or "", p.now), reason="Finished")
    p.status.pop("admission", None)
