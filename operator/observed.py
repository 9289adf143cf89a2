"""The operator's view of the world: small frozen records built from raw API objects.

Owns the parsing of pods, nodes, the progress Lease and the job itself into just the fields the
decision needs (JobSet builds one `childJobs` snapshot per pass in the same spirit,
kubernetes-sigs/jobset pkg/controllers/jobset_controller.go). The kopf indexes in
`handlers.py` store these records, so a pass reads memory, not the API. Pure: no clock, no
I/O; timestamps are parsed, never compared with "now" here.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Mapping

from crucible.api.names import ANNOTATION_WORKLOAD_DIGEST, PREFIX
from crucible.api.progress import ProgressReport, parse_time
from crucible.operator import manifests as m
from crucible.operator.waitlist import extended

UNREACHABLE_TAINTS = ("node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready")
WORKLOAD_PODSET = "workers"   # the one pod set of a job's Kueue Workload (queueing.py)


def _int(value) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


@dataclass(frozen=True)
class PodView:
    name: str
    uid: str
    job: str
    generation: int | None
    index: int | None
    phase: str                          # Pending, Running, Succeeded, Failed, Unknown
    node: str | None
    created: dt.datetime | None
    deletion: dt.datetime | None = None  # deletionTimestamp: end of the grace period
    deletion_grace_s: int | None = None  # deletionGracePeriodSeconds: deletion - grace = request
    finished: dt.datetime | None = None  # the trainer container's finishedAt, once terminated
    spec_hash: str | None = None
    exit_code: int | None = None        # the trainer container's, once terminated
    terminated_reason: str | None = None  # OOMKilled, Error, Completed, ...
    terminated_message: str | None = None
    reason: str | None = None           # pod-level status.reason, e.g. Evicted
    message: str | None = None
    disruption: str | None = None       # DisruptionTarget condition's reason, when True
    unschedulable: str | None = None    # the scheduler's message while PodScheduled is False
    waiting_reason: str | None = None   # e.g. ImagePullBackOff, CreateContainerConfigError
    waiting_message: str | None = None
    owner_uid: str | None = None        # the controlling owner's UID: which job it belongs to
    owner_kind: str | None = None       # ... and its kind (PretrainJob, or a stranger's)
    avoided_nodes: tuple[str, ...] = ()  # nodes its required affinity keeps it off
    asks: tuple[tuple[str, int], ...] = ()   # extended resources it requests (nvidia.com/gpu)
    ready: bool = False                 # its Ready condition is True

    @property
    def deleting(self) -> bool:
        return self.deletion is not None

    @property
    def terminated(self) -> bool:
        return self.phase in ("Succeeded", "Failed")

    @property
    def ended_by_deletion(self) -> bool:
        """Its container ended after someone asked to delete it: the exit is the kubelet's
        SIGTERM (torchrun answers one with exit 1), whatever the code says. One that ended
        before the request (a crash, then a person cleaning up) is judged by its exit."""
        if self.deletion is None:
            return False
        if self.finished is None or self.deletion_grace_s is None:
            return True
        requested = self.deletion - dt.timedelta(seconds=self.deletion_grace_s)
        return self.finished >= requested


def pod_view(body: Mapping) -> PodView:
    meta, spec, status = body.get("metadata", {}), body.get("spec", {}), body.get("status", {})
    labels = meta.get("labels") or {}
    conditions = {c.get("type"): c for c in status.get("conditions") or []}
    disruption = conditions.get("DisruptionTarget", {})
    scheduled = conditions.get("PodScheduled", {})
    exit_code = terminated_reason = terminated_message = finished = None
    waiting_reason = waiting_message = None
    for cs in status.get("containerStatuses") or []:
        if cs.get("name") != m.CONTAINER:
            continue
        state = cs.get("state") or {}
        if state.get("terminated"):
            term = state["terminated"]
            exit_code, terminated_reason = _int(term.get("exitCode")), term.get("reason")
            terminated_message = term.get("message")
            finished = parse_time(term.get("finishedAt"))
        elif state.get("waiting"):
            waiting = state["waiting"]
            waiting_reason, waiting_message = waiting.get("reason"), waiting.get("message")
    return PodView(
        name=meta.get("name", ""), uid=meta.get("uid", ""), job=labels.get(m.LABEL_JOB, ""),
        generation=_int(labels.get(m.LABEL_GENERATION)), index=_int(labels.get(m.LABEL_INDEX)),
        phase=status.get("phase") or "Pending", node=spec.get("nodeName"),
        created=parse_time(meta.get("creationTimestamp")),
        deletion=parse_time(meta.get("deletionTimestamp")),
        deletion_grace_s=_int(meta.get("deletionGracePeriodSeconds")), finished=finished,
        spec_hash=(meta.get("annotations") or {}).get(m.ANNOTATION_SPEC_HASH),
        avoided_nodes=m.avoided_nodes(spec),
        exit_code=exit_code, terminated_reason=terminated_reason,
        terminated_message=terminated_message,
        reason=status.get("reason"), message=status.get("message"),
        disruption=disruption.get("reason") or "DisruptionTarget"
        if disruption.get("status") == "True" else None,
        # A gated pod waits for whoever holds the gate (Kueue's topology ungater), not for room.
        unschedulable=(scheduled.get("message") or scheduled.get("reason") or "unschedulable")
        if scheduled.get("status") == "False" and scheduled.get("reason") != "SchedulingGated"
        else None,
        waiting_reason=waiting_reason, waiting_message=waiting_message,
        owner_uid=controller_uid(meta),
        owner_kind=next((ref.get("kind") for ref in meta.get("ownerReferences") or []
                         if ref.get("controller")), None),
        ready=conditions.get("Ready", {}).get("status") == "True",
        asks=tuple(sorted({name: amount for c in spec.get("containers") or []
                           for name, amount in extended(c.get("resources")).items()}.items())),
    )


def controller_uid(meta: Mapping) -> str | None:
    """The UID of an object's controlling owner (ownerReferences with controller: true)."""
    return next((ref.get("uid") for ref in meta.get("ownerReferences") or []
                 if ref.get("controller")), None)


@dataclass(frozen=True)
class NodeCondition:
    type: str
    status: str
    since: dt.datetime | None
    reason: str = ""
    message: str = ""


@dataclass(frozen=True)
class NodeView:
    name: str
    unschedulable: bool = False
    conditions: tuple[NodeCondition, ...] = ()
    taints: tuple[tuple[str, str, dt.datetime | None], ...] = ()   # (key, effect, timeAdded)
    annotations: tuple[tuple[str, str], ...] = ()                  # crucible.dev/* only
    labels: tuple[tuple[str, str], ...] = ()   # for the administrator's node selectors
    # The field manager that last set spec.unschedulable (managedFields): whose cordon it is.
    cordon_manager: str | None = None
    resource_version: str | None = None

    def condition(self, type_: str) -> NodeCondition | None:
        return next((c for c in self.conditions if c.type == type_), None)

    def annotation(self, key: str) -> str | None:
        return dict(self.annotations).get(key)

    def has_labels(self, wanted: tuple[tuple[str, str], ...]) -> bool:
        """Carries every (key, value) of `wanted` (a matchLabels selector)."""
        return set(wanted) <= set(self.labels)


def node_view(body: Mapping) -> NodeView:
    meta, spec, status = body.get("metadata", {}), body.get("spec", {}), body.get("status", {})
    return NodeView(
        name=meta.get("name", ""),
        unschedulable=bool(spec.get("unschedulable")),
        conditions=tuple(NodeCondition(c.get("type", ""), c.get("status", "Unknown"),
                                       parse_time(c.get("lastTransitionTime")),
                                       c.get("reason") or "", c.get("message") or "")
                         for c in status.get("conditions") or []),
        taints=tuple((t.get("key", ""), t.get("effect", ""), parse_time(t.get("timeAdded")))
                     for t in spec.get("taints") or []),
        annotations=tuple(sorted((k, v) for k, v in (meta.get("annotations") or {}).items()
                                 if k.startswith(PREFIX))),
        labels=tuple(sorted((meta.get("labels") or {}).items())),
        cordon_manager=unschedulable_manager(meta) if spec.get("unschedulable") else None,
        resource_version=meta.get("resourceVersion"),
    )


def unschedulable_manager(meta: Mapping) -> str | None:
    """The manager that owns `spec.unschedulable` in the object's managedFields (the apiserver
    moves a field's ownership to whoever last changed it)."""
    owner = None
    for entry in meta.get("managedFields") or []:
        if "f:unschedulable" in ((entry.get("fieldsV1") or {}).get("f:spec") or {}):
            owner = entry.get("manager")
    return owner


def lease_view(body: Mapping) -> ProgressReport:
    """The trainer's progress report on its Lease (`crucible.api.progress`)."""
    return ProgressReport.from_annotations((body.get("metadata") or {}).get("annotations"))


@dataclass(frozen=True)
class ChildView:
    """Any other child: its kind and name, plus a digest of what drifts (the ConfigMap's data)."""

    kind: str
    name: str
    digest: str | None = None
    owner_uid: str | None = None  # the controlling owner's UID: whose child it is


@dataclass(frozen=True)
class JobView:
    name: str
    namespace: str
    uid: str
    generation: int
    spec: Mapping
    status: Mapping
    deleting: bool = False
    labels: Mapping[str, str] = field(default_factory=dict)
    resource_version: str | None = None   # what the status patch names (optimistic locking)


def job_view(body: Mapping) -> JobView:
    meta = body.get("metadata", {})
    return JobView(name=meta.get("name", ""), namespace=meta.get("namespace", ""),
                   uid=meta.get("uid", ""), generation=_int(meta.get("generation")) or 0,
                   spec=dict(body.get("spec") or {}), status=dict(body.get("status") or {}),
                   deleting=meta.get("deletionTimestamp") is not None,
                   labels=dict(meta.get("labels") or {}),
                   resource_version=meta.get("resourceVersion"))


@dataclass(frozen=True)
class KueueCondition:
    status: str
    reason: str = ""
    message: str = ""
    since: dt.datetime | None = None    # lastTransitionTime


@dataclass(frozen=True)
class WorkloadView:
    """A Kueue Workload (kueue.x-k8s.io/v1beta2) as the queueing decision reads it."""

    name: str
    owner_uid: str | None
    resource_version: str
    digest: str | None                  # of the spec it was created from (queueing.py)
    conditions: Mapping[str, KueueCondition]
    cluster_queue: str | None = None    # status.admission: where the quota is reserved
    count: int | None = None            # pods admitted (partial admission: nodes.min..max)
    flavors: tuple[str, ...] = ()       # ResourceFlavors of the admission
    raw_conditions: tuple[Mapping, ...] = ()   # as stored: a status patch rewrites the list
    topology_assigned: bool = False     # Kueue's TAS placed the pod set (explicitly or implied)
    # What the admission checks (a ProvisioningRequest, say) ask of the pods: merged
    # {labels, annotations, nodeSelector, tolerations} of their podSetUpdates for our pod set.
    pod_set_updates: tuple[Mapping, ...] = ()
    priority_ref: Mapping | None = None  # spec.priorityClassRef
    priority: int | None = None          # spec.priority

    @property
    def priority_class(self) -> str | None:
        return (self.priority_ref or {}).get("name")

    def is_true(self, type_: str) -> bool:
        found = self.conditions.get(type_)
        return found is not None and found.status == "True"


def workload_view(body: Mapping) -> WorkloadView:
    meta, status = body.get("metadata", {}), body.get("status") or {}
    raw = tuple(dict(c) for c in status.get("conditions") or [])
    admission = status.get("admission") or {}
    assignment = next(iter(admission.get("podSetAssignments") or []), {})
    return WorkloadView(
        name=meta.get("name", ""), owner_uid=controller_uid(meta),
        resource_version=meta.get("resourceVersion", ""),
        digest=(meta.get("annotations") or {}).get(ANNOTATION_WORKLOAD_DIGEST),
        conditions={c.get("type", ""): KueueCondition(c.get("status", "Unknown"),
                                                      c.get("reason") or "",
                                                      c.get("message") or "",
                                                      parse_time(c.get("lastTransitionTime")))
                    for c in raw},
        cluster_queue=admission.get("clusterQueue"), count=_int(assignment.get("count")),
        flavors=tuple(sorted(set((assignment.get("flavors") or {}).values()))),
        raw_conditions=raw, topology_assigned=assignment.get("topologyAssignment") is not None,
        pod_set_updates=tuple(dict(update) for check in status.get("admissionChecks") or []
                              for update in check.get("podSetUpdates") or []
                              if update.get("name") == WORKLOAD_PODSET),
        priority_ref=(body.get("spec") or {}).get("priorityClassRef"),
        priority=_int((body.get("spec") or {}).get("priority")))


@dataclass(frozen=True)
class FlavorView:
    """What a Kueue ResourceFlavor asks of the pods admitted on it (Kueue's job integrations
    copy the same into their pods)."""

    name: str
    node_labels: tuple[tuple[str, str], ...] = ()
    tolerations: tuple[Mapping, ...] = ()


def flavor_view(body: Mapping) -> FlavorView:
    meta, spec = body.get("metadata", {}), body.get("spec") or {}
    return FlavorView(name=meta.get("name", ""),
                      node_labels=tuple(sorted((spec.get("nodeLabels") or {}).items())),
                      tolerations=tuple(dict(t) for t in spec.get("tolerations") or []))


@dataclass(frozen=True)
class Observed:
    """One pass's snapshot of the job's world."""

    pods: tuple[PodView, ...] = ()
    # The pods' nodes: a NodeView, or None for a node the (filled) index does not have, i.e.
    # deleted. A node missing from this mapping is unknown and judged by nobody.
    nodes: Mapping[str, NodeView | None] = field(default_factory=dict)
    children: frozenset[ChildView] = frozenset()
    lease: ProgressReport | None = None
    # (kind, name) of children the last pass could not create: they exist under another owner,
    # with none of this job's labels, so no index shows them (kube.py finds them on a 409).
    conflicts: frozenset[tuple[str, str]] = frozenset()
    # Kinds whose create the last pass found the server does not serve (a 404: no such API).
    unserved: frozenset[str] = frozenset()
    # For a job waiting after releasing its pods: whether the operator grants it room now
    # (waitlist.py: oldest first, as many as fit); None: the operator cannot account it.
    capacity_granted: bool | None = None
    # The operator's book shows room for all of the generation's missing pods at once (and
    # has claimed it): they are created together, not pod 0 first (waitlist.py).
    room_for_gang: bool = False
    # For a new job (no pod yet): why it must wait behind jobs on the waitlist (they released
    # their pods earlier and the room left after them does not hold it), or None (waitlist.py).
    queued_behind: str | None = None
    # Names of the cluster's PriorityClasses (None: not known yet).
    priority_classes: frozenset[str] | None = None
    # Their values, by name (Kueue orders and preempts Workloads by the value, not the name).
    priority_values: Mapping[str, int] = field(default_factory=dict)
    # The class marked globalDefault: what a pod naming none gets (the Priority admission plugin).
    default_priority_class: str | None = None
    # Kueue: the job's Workload, the ClusterQueue its LocalQueue points at, the flavors in use.
    workload: WorkloadView | None = None
    workload_priorities: Mapping[str, int] = field(default_factory=dict)  # Kueue's classes
    cluster_queue: str | None = None
    flavors: Mapping[str, FlavorView] = field(default_factory=dict)
    default_queue: bool = False          # the namespace has a LocalQueue named "default"

    def has_child(self, kind: str, name: str) -> bool:
        return any(c.kind == kind and c.name == name for c in self.children)

    def child_owner(self, kind: str, name: str) -> str | None:
        return next((c.owner_uid for c in self.children if c.kind == kind and c.name == name),
                    None)

    def child_digest(self, kind: str, name: str) -> str | None:
        return next((c.digest for c in self.children if c.kind == kind and c.name == name), None)
