"""kopf wiring: indexes that observe, one daemon per PretrainJob that reconciles.

Owns the event-driven shell around the pure core, following kopf's own advice on real
reconciliation (kopf's docs/reconciliation.rst and examples/16-indexing): children and
nodes live in `@kopf.index`es fed by one watch per kind (filtered server-side by label), and a
per-job daemon runs passes: snapshot the indexes and the Lease (in the event loop, so the view is
consistent) -> `decide` -> apply, with one status patch beside it -> events (in a thread pool,
because the `kubernetes` client blocks). A pass runs when an indexed pod, Lease or failing node
changes (debounced), when a time-based decision falls due (grace periods, hang timeout), and at
least every `interval_s` regardless: level-triggered, so a missed event costs latency, never
correctness.

Everything a pass needs to survive a restart is in the job's status. The only memory kept here
is a fence: the count of status writes this process made, so a pass never acts on a body older
than its own last write (the watch may lag the patch by a few milliseconds).

Configuration comes from the environment (set by `crucible-operator run`, or by tests before
`KopfRunner`): CRUCIBLE_OPERATOR_INTERVAL (s, default 10), CRUCIBLE_OPERATOR_WORKERS (8),
CRUCIBLE_OPERATOR_METRICS_PORT (8080; "off" disables), CRUCIBLE_OPERATOR_METRICS_ADDRESS,
CRUCIBLE_OPERATOR_LEADER_ELECTION (a namespace; empty: off),
CRUCIBLE_OPERATOR_MAX_CORDONS_PER_MINUTE (6; 0: never cordon),
CRUCIBLE_OPERATOR_NODE_FAILURE_CONDITIONS ("*": any; else comma-separated condition types),
CRUCIBLE_OPERATOR_KUEUE ("off": no watch on Kueue's objects; read once, at import),
CRUCIBLE_OPERATOR_QUARANTINE_MINUTES (60; 0: the operator's cordons never end),
CRUCIBLE_OPERATOR_KUEUE_MANAGE_ALL ("on": unlabelled jobs queue in their LocalQueue "default"),
CRUCIBLE_OPERATOR_NAMESPACES (a JSON list of kopf's --namespace patterns: where the child kinds'
metadata is watched; empty: everywhere).
Must not import torch.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime as dt
import enum
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import kopf
from kubernetes.client.exceptions import ApiException

from crucible.operator import crd
from crucible.operator.apiclient import (API_ERRORS, CONNECTION_ERRORS, api_client, bearer_token,
                                         client_configuration, describe)
from crucible.operator import manifests as m
from crucible.operator import (leader, metadata_watch, metrics, quarantine, queueing, uninstall,
                               waitlist)
from crucible.operator.decision import Event, Outcome, decide
from crucible.operator.failure_policy import bad_entries
from crucible.operator.failures import orphan_stuck
from crucible.operator.kube import Applied, Kube, is_cordon
from crucible.operator.cluster_policy import DEFAULT_FAILURE_CONDITIONS, ClusterPolicy
from crucible.operator.tenant_limits import TenantLimits
from crucible.operator.observed import (ChildView, JobView, NodeView, Observed, controller_uid,
                                        flavor_view, job_view, lease_view, node_view, pod_view,
                                        workload_view)
from crucible.operator.waitlist import node_room

FINALIZER = uninstall.FINALIZER       # kopf's: stops the daemon before the job goes
WRITES = "writes"                     # status.tracking.writes: the fence counter
FENCE_WAIT_S = 10.0                   # then read the job from the API instead of the watch
FAN_OUT = 8                           # concurrent API calls within one pass (kube.Kube.apply)
RETRY_S = 2.0                         # after a failed or partly refused pass ...
RETRY_MAX_S = 30.0                    # ... doubled while the failures go on, up to this
RESERVE_S = 120.0                     # a grant holds its room this long for the pods to bind
KNOWN_NODE_TTL_S = 3600.0             # a deleted node is remembered as deleted this long
CONFLICT_RETRIES = 3                  # passes again after a 409 before backing off
CONFLICT_WAIT_S = 2.0                 # for the watch to show the newer job, then read it
FINALIZER_WAIT_S = 2.0                # for kopf's finalizer on a new job before its first pass
LIST_WAIT_S = 60.0                    # for the child kinds' first lists before a job's first pass
DUE_SLACK_S = 0.05                    # run a due pass just after its time, never just before
LAST_IN_LINE = {"since": "9999-12-31T00:00:00Z"}   # a gang placed after every waiting job


@dataclass(frozen=True)
class OperatorConfig:
    interval_s: float = 10.0
    # A woken pass waits this long for the rest of the burst (a gang's start is tens of pod
    # events): the Kubernetes Job controller's `syncJobBatchPeriod` (1 s). With it and a
    # job's pods made in its first pass, a 100-job start writes 3.5-3.6 status patches a job,
    # against 5.3-5.7 before, and the jobs are Running no later (docs/operator.md, "Scale").
    debounce_s: float = 1.0
    workers: int = 8
    metrics_port: int | None = 8080
    metrics_address: str = "0.0.0.0"
    leader_election_namespace: str | None = None   # where the leader Lease lives; None: off
    max_cordons_per_minute: int = 6                # across all jobs (kube.CordonLimit)
    node_failure_conditions: str = DEFAULT_FAILURE_CONDITIONS  # those jobs may name; "*": any
    metrics_scrapers: str = ""                     # JSON NetworkPolicy peers; "": any namespace
    kueue: bool = True                             # watch Kueue's objects (queueing.py)
    quarantine_minutes: float = 60.0               # how long its cordons last; 0: forever
    kueue_manage_all: bool = False                 # unlabelled jobs queue in LocalQueue default
    straggler_cordon_selector: str = ""            # nodes straggler reports may cordon; "": none
    instance_metadata: bool = False                # pods may reach the node's cloud role
    tenant_limits: TenantLimits = TenantLimits()   # what jobs' scheduling and sizes may ask
    namespaces: tuple[str, ...] = ()               # those served (globs allowed); (): all

    @classmethod
    def from_env(cls) -> "OperatorConfig":
        env = os.environ
        port = env.get("CRUCIBLE_OPERATOR_METRICS_PORT", "8080")
        return cls(interval_s=float(env.get("CRUCIBLE_OPERATOR_INTERVAL", "10")),
                   workers=int(env.get("CRUCIBLE_OPERATOR_WORKERS", "8")),
                   metrics_port=None if port == "off" else int(port),
                   metrics_address=env.get("CRUCIBLE_OPERATOR_METRICS_ADDRESS", "0.0.0.0"),
                   leader_election_namespace=env.get("CRUCIBLE_OPERATOR_LEADER_ELECTION") or None,
                   max_cordons_per_minute=int(env.get("CRUCIBLE_OPERATOR_MAX_CORDONS_PER_MINUTE",
                                                      "6")),
                   node_failure_conditions=env.get("CRUCIBLE_OPERATOR_NODE_FAILURE_CONDITIONS",
                                                   DEFAULT_FAILURE_CONDITIONS),
                   metrics_scrapers=env.get("CRUCIBLE_OPERATOR_METRICS_SCRAPERS", ""),
                   kueue=kueue_enabled(),
                   quarantine_minutes=float(env.get("CRUCIBLE_OPERATOR_QUARANTINE_MINUTES",
                                                    "60")),
                   kueue_manage_all=env.get("CRUCIBLE_OPERATOR_KUEUE_MANAGE_ALL") == "on",
                   straggler_cordon_selector=env.get(
                       "CRUCIBLE_OPERATOR_STRAGGLER_CORDON_SELECTOR", ""),
                   instance_metadata=env.get("CRUCIBLE_OPERATOR_INSTANCE_METADATA") == "on",
                   tenant_limits=TenantLimits.from_settings(
                       env.get("CRUCIBLE_OPERATOR_ALLOWED_PRIORITY_CLASSES", ""),
                       env.get("CRUCIBLE_OPERATOR_ALLOWED_TOLERATION_KEYS", ""),
                       env.get("CRUCIBLE_OPERATOR_ALLOWED_NODE_SELECTOR_KEYS", ""),
                       env.get("CRUCIBLE_OPERATOR_MAX_SCRATCH_SIZE", ""),
                       env.get("CRUCIBLE_OPERATOR_MAX_SHM_SIZE", "")),
                   namespaces=tuple(json.loads(env.get("CRUCIBLE_OPERATOR_NAMESPACES")
                                               or "[]")))

    @property
    def cluster_policy(self) -> ClusterPolicy:
        return ClusterPolicy.from_settings(self.node_failure_conditions,
                                           self.max_cordons_per_minute, self.metrics_scrapers,
                                           self.kueue, self.quarantine_minutes,
                                           self.kueue_manage_all, self.straggler_cordon_selector,
                                           self.instance_metadata, self.tenant_limits)


def kueue_enabled() -> bool:
    return os.environ.get("CRUCIBLE_OPERATOR_KUEUE", "on") != "off"


@kopf.on.login()
def login(**_) -> kopf.ConnectionInfo:
    """kopf connects with the same identity as our adapter (one place decides credentials)."""
    cfg = client_configuration()
    if cfg.refresh_api_key_hook is not None:  # in-cluster: the projected token rotates
        cfg.refresh_api_key_hook(cfg)
    token = bearer_token((cfg.auth_settings().get("BearerToken") or {}).get("value") or "")
    return kopf.ConnectionInfo(server=cfg.host, ca_path=cfg.ssl_ca_cert,
                               insecure=not cfg.verify_ssl, scheme="Bearer" if token else None,
                               token=token, certificate_path=cfg.cert_file,
                               private_key_path=cfg.key_file, username=cfg.username or None,
                               password=cfg.password or None)


# --- observation: indexes --------------------------------------------------------------------
# (kind, kopf resource selector) of every child that is not a pod and not the Lease.
CHILD_KINDS = [("Service", ("v1", "services")), ("ConfigMap", ("v1", "configmaps")),
               ("ServiceAccount", ("v1", "serviceaccounts")),
               ("Role", ("rbac.authorization.k8s.io", "roles")),
               ("RoleBinding", ("rbac.authorization.k8s.io", "rolebindings")),
               ("NetworkPolicy", ("networking.k8s.io", "networkpolicies"))]
# What kopf watches by the job label (the child kinds are watched by metadata_watch.py).
SELECTED = [("v1", "pods"), ("coordination.k8s.io", "leases"), (queueing.GROUP, queueing.PLURAL)]


def _seen(memo, key, kind: str, name: str) -> None:
    """A watch showed one of the job's objects: a create of it is no longer on its way."""
    kube = getattr(memo, "kube", None)    # absent before `configure` ran
    if kube is not None:
        kube.expected.seen(key, kind, name)


def _wake(memo, key) -> None:
    event = memo.wakeups.get(key)
    if event is not None:
        event.set()


@kopf.index("v1", "pods", labels={m.LABEL_JOB: kopf.PRESENT})
async def pods_by_job(namespace, labels, body, memo, pods_by_job, **_):
    key = (namespace, labels[m.LABEL_JOB])
    view = pod_view(body)
    _seen(memo, key, "Pod", view.name)
    memo.pods_index = pods_by_job       # kopf's live view, for the housekeeping loop
    _wake(memo, key)
    # A pod being deleted holds its room until it is gone (the scheduler counts it until the
    # object is removed); granting that room early sends jobs after GPUs not free yet.
    active = not view.terminated
    if memo.book.set_pod(view.uid, key, view.node, dict(view.asks), active):
        _grant(memo)                     # room given back: the jobs waiting longest take it
    if view.deleting:
        memo.terminating[(namespace, view.name)] = (key, view)
    else:
        memo.terminating.pop((namespace, view.name), None)
    return {key: view}


@kopf.index("coordination.k8s.io", "leases", labels={m.LABEL_JOB: kopf.PRESENT})
async def leases_by_job(namespace, labels, body, meta, memo, **_):
    _seen(memo, (namespace, labels[m.LABEL_JOB]), "Lease", meta.get("name", ""))
    _wake(memo, (namespace, labels[m.LABEL_JOB]))
    return {(namespace, labels[m.LABEL_JOB]): (controller_uid(meta), lease_view(body))}


def schedulable_node(view: NodeView) -> bool:
    ready = view.condition("Ready")
    return ready is not None and ready.status == "True" and not view.unschedulable


def _wake_jobs_on(memo, pods_by_job, node: str) -> None:
    """Wake the jobs with a pod on `node` or that keep off it (it may be trusted again)."""
    for key, store in pods_by_job.items():
        if any(pod.node == node for pod in store):
            _wake(memo, key)
    for key, avoided in memo.avoiding.items():
        if node in avoided:
            _wake(memo, key)


@kopf.index("v1", "nodes")
async def nodes_by_name(name, body, memo, pods_by_job, nodes_by_name, **_):
    view = node_view(body)
    memo.nodes_index = nodes_by_name    # kopf's live view, for the housekeeping loop
    memo.known_nodes[name] = None       # one the index lacks later was deleted (kopf drops it)
    if view.annotation(quarantine.CORDONED_BY):   # the quarantine loop looks at these alone
        memo.cordoned[name] = view
    else:
        memo.cordoned.pop(name, None)
    # Only the jobs this node concerns look, and only when its health or schedulability
    # changed: a node's status is written often (conditions' heartbeats, images), and every
    # job looking at every write was most of the operator's passes.
    health = (schedulable_node(view), view.condition("Ready") and view.condition("Ready").status,
              view.unschedulable, tuple(c for c in view.conditions if c.status == "True"
                                        and c.type != "Ready"))
    if memo.node_health.get(name) != health:
        memo.node_health[name] = health
        _wake_jobs_on(memo, pods_by_job, name)
    if memo.book.set_node(name, node_room(body)):
        _grant(memo)                     # room: the jobs waiting longest take it
    return {name: view}


def _grant(memo, quiet=None) -> frozenset[tuple[str, str]]:
    """The waiting jobs the room holds now (waitlist.py), woken (all but `quiet`: the job whose
    own pass asks); cached until the book or the waitlist changes."""
    version = (memo.book.version, memo.waitlist_version)
    if memo.grants[0] != version:
        # Room that the pods already on their way (a running job's replacements, a gang just
        # made) will take is not granted again: such a grant would lose the race to them.
        free = memo.book.free_after_pending(exclude=memo.waitlist)
        memo.grants = (version, frozenset(waitlist.grants(memo.waitlist.values(), free,
                                                          memo.book.nodes)))
    for key in memo.grants[1]:
        if key != quiet:
            _wake(memo, key)
    return memo.grants[1]


def _granted(memo, key) -> bool | None:
    """Whether the operator grants a waiting job room now; None: it is not on the waitlist, or
    it holds a grant already (reserved, waiting for its pods to get nodes)."""
    if (key not in memo.waitlist or key in memo.reserved
            or not waitlist.could_fit(memo.waitlist[key], memo.book.nodes)):
        return None
    return key in _grant(memo, quiet=key)


def _forget_deleted_nodes(memo, nodes_by_name) -> None:
    """Nodes gone from the index (deleted) leave the book and the per-node maps. Never from an
    index handler: kopf stores a handler's result only after it returns, so the node it is
    indexing is not in the index yet."""
    for name in [n for n in memo.book.nodes if n not in nodes_by_name]:
        memo.book.set_node(name, None)
    for table in (memo.node_health, memo.cordoned):
        for name in [n for n in table if n not in nodes_by_name]:
            del table[name]


@kopf.index("scheduling.k8s.io", "priorityclasses")
async def priority_classes(name, body, memo, **_):
    # Rare, and a job may be held for want of this one (references.py): every job looks.
    for event in memo.wakeups.values():
        event.set()
    return {name: (body.get("value"), bool(body.get("globalDefault")))}


# Kueue (queueing.py). Kopf watches these only once their CRDs exist: without Kueue installed
# the indexes stay empty, and only jobs with the queue-name label ever read them. With
# CRUCIBLE_OPERATOR_KUEUE=off they are not registered at all: a watch the operator has no
# right to would fail over and over where Kueue is installed for others.
async def workloads_by_job(namespace, labels, body, memo, **_):
    _seen(memo, (namespace, labels[m.LABEL_JOB]), "Workload",
          (body.get("metadata") or {}).get("name", ""))
    _wake(memo, (namespace, labels[m.LABEL_JOB]))
    return {(namespace, labels[m.LABEL_JOB]): workload_view(body)}


async def local_queues(namespace, name, spec, **_):
    return {(namespace, name): spec.get("clusterQueue")}


async def resource_flavors(name, body, memo, **_):
    for event in memo.wakeups.values():   # rare; an admitted job may wait to read one
        event.set()
    return {name: flavor_view(body)}


async def workload_priority_classes(name, body, memo, **_):
    for event in memo.wakeups.values():   # rare; a job may wait for its class's value
        event.set()
    return {name: body.get("value")}


KUEUE_INDEXES = [(queueing.PLURAL, workloads_by_job, {m.LABEL_JOB: kopf.PRESENT}),
                 ("localqueues", local_queues, None), ("resourceflavors", resource_flavors, None),
                 ("workloadpriorityclasses", workload_priority_classes, None)]
if kueue_enabled():
    for _plural, _fn, _labels in KUEUE_INDEXES:
        kopf.index(queueing.GROUP, queueing.VERSION, _plural, labels=_labels)(_fn)


def child_view(kind: str, meta: dict):
    """(job key, ChildView) of a child's metadata, in a watch's thread: what the index keeps
    of it, small whatever the metadata holds (metadata_watch.py)."""
    job = (meta.get("labels") or {}).get(m.LABEL_JOB)
    # One being deleted is as good as gone: nothing may count on it being in place (pods come
    # only behind their NetworkPolicy), and the pass creates it again once it has gone.
    if not job or meta.get("deletionTimestamp"):
        return None
    return ((meta.get("namespace") or "", job),
            ChildView(kind, meta.get("name") or "", m.observed_digest(kind, meta),
                      controller_uid(meta)))


def _api_version(group: str) -> tuple[str, str]:
    """CHILD_KINDS name the core group by its version, as kopf does."""
    return ("", "v1") if group == "v1" else (group, "v1")


def start_child_watches(memo, namespaces: tuple[str, ...]) -> None:
    """Metadata-only watches of the child kinds into `memo.children` (kopf's index names, so
    `snapshot` reads them alike). Watches a retried start-up left are stopped first."""
    stop_child_watches(memo)
    loop = asyncio.get_running_loop()
    scopes = metadata_watch.Scopes(namespaces)
    client = api_client(len(CHILD_KINDS) * len(scopes.watched) + 1)
    memo.children, memo.child_watches = {}, []
    for kind, (group, plural) in CHILD_KINDS:
        index = metadata_watch.MetadataIndex(
            kind, lambda key, view: _seen(memo, key, view.kind, view.name))
        memo.children[f"children_{plural}"] = index
        for scope in scopes.watched:
            memo.child_watches.append(metadata_watch.MetadataWatch(
                client, *_api_version(group), plural, scope, m.LABEL_JOB, index, child_view,
                loop, scopes.serves))
    for watch in memo.child_watches:
        watch.start()


def stop_child_watches(memo) -> None:
    for watch in getattr(memo, "child_watches", ()):
        watch.stop()
    memo.child_watches = []


def children_listed(memo, namespace: str) -> bool:
    """Whether every child kind has been listed where this namespace's objects are."""
    return all(index.covers(namespace) for index in memo.children.values())


def _first(store):
    return next(iter(store), None) if store else None


def snapshot(key: tuple[str, str], indexes: dict,
             conflicts: frozenset[tuple[str, str]] = frozenset(),
             also_nodes: tuple[str, ...] = (), queue: str | None = None,
             unserved: frozenset[str] = frozenset(), deleted_nodes=frozenset(),
             capacity_granted: bool | None = None) -> Observed:
    """The job's world from the indexes (event loop only: indexes change between awaits): its
    pods' nodes and `also_nodes` (those it avoids), a node the index lacks as deleted only if
    it is in `deleted_nodes` (seen, then gone: else one the watch has not shown yet), the
    name conflicts the last pass's creates met (`conflicts`) and the kinds they found not
    served (`unserved`), whether the job may try for capacity again (`capacity_granted`),
    and for a job in Kueue's LocalQueue `queue` its Workload, the queue's ClusterQueue and the
    ResourceFlavors. It never walks every node: passes are many, nodes can be thousands."""
    pods = tuple(indexes["pods_by_job"].get(key, ()))
    node_index = indexes["nodes_by_name"]
    nodes = {}
    for name in [pod.node for pod in pods if pod.node] + list(also_nodes):
        if name not in nodes:
            store = node_index.get(name)
            if store:
                nodes[name] = next(iter(store))
            elif name in deleted_nodes:    # seen deleted: the node is gone
                nodes[name] = None
    children = {view for _, (_, plural) in CHILD_KINDS
                for view in indexes[f"children_{plural}"].get(key, ())}
    leases = indexes["leases_by_job"].get(key)
    owner, lease = next(iter(leases)) if leases else (None, None)
    if lease is not None:
        children.add(ChildView("Lease", m.progress_lease_name(key[1]), owner_uid=owner))
    # The cluster always has the built-in system-* classes: an empty index is one still filling.
    classes = indexes["priority_classes"]
    # The Workload even without the label: a job taken out of its queue deletes it.
    queued = {}
    if "workloads_by_job" in indexes:            # not registered with Kueue off
        queued["workload"] = _first(indexes["workloads_by_job"].get(key))
        queued["default_queue"] = (key[0], queueing.DEFAULT_QUEUE) in indexes["local_queues"]
        if queue is not None:
            queued.update(cluster_queue=_first(indexes["local_queues"].get((key[0], queue))),
                          flavors={name: _first(store)
                                   for name, store in indexes["resource_flavors"].items()},
                          workload_priorities={
                              name: value for name, store in
                              indexes["workload_priority_classes"].items()
                              for value in store if value is not None})
    return Observed(pods=pods, nodes=nodes, children=frozenset(children), lease=lease,
                    conflicts=conflicts, unserved=unserved, capacity_granted=capacity_granted,
                    priority_classes=frozenset(classes) if len(classes) else None,
                    priority_values={name: value for name, store in classes.items()
                                     for value, _ in store if value is not None},
                    default_priority_class=next((name for name, store in classes.items()
                                                 for _, default in store if default), None),
                    **queued)


# --- lifecycle -------------------------------------------------------------------------------
def init_state(memo) -> None:
    """The in-memory state passes share, empty. What a pass needs to be right lives in the
    job's status; this only steers wake-ups, fences, conflicts and metrics."""
    memo.wakeups, memo.fences, memo.phases, memo.jobs, memo.conflicts = {}, {}, {}, {}, {}
    memo.unserved = {}
    # The room the operator sees and the jobs waiting for it (waitlist.py), the nodes ever
    # seen (one gone from the index since was deleted), each node's last health (a write that
    # changes neither wakes nobody), the nodes jobs avoid.
    memo.book, memo.waitlist, memo.waitlist_version = waitlist.RoomBook(), {}, 0
    memo.grants = (None, frozenset())
    memo.known_nodes, memo.node_health, memo.avoiding = {}, {}, {}
    memo.reserved = {}     # job key -> monotonic deadline: granted room, pods not bound yet
    memo.nodes_index = memo.pods_index = None
    memo.cordoned = {}     # name -> NodeView of nodes carrying the operator's cordon annotation
    memo.terminating = {}  # (namespace, pod) -> (job key, PodView) of pods being deleted
    memo.live = {}         # job key -> the UID of the job a daemon runs for
    memo.children = {}    # start_child_watches fills it


class SpecDiffBase(kopf.AnnotationsDiffBaseStorage):
    """kopf's diff base (what a change handler compares), built without deep-copying the parts
    it then throws away. kopf builds one at every event of every job; its `build` deep-copies the
    whole body first, status and managedFields included, and that copy was about a tenth of the
    operator's CPU while 100 jobs started. The essence is the same: what kopf keeps (spec and
    the other top-level fields, labels, annotations) plus what it reads to name its key."""

    def build(self, *, body, extra_fields=None):
        if extra_fields:   # fields picked from anywhere (a status field handler): kopf's own way
            return super().build(body=body, extra_fields=extra_fields)
        meta = body.get("metadata") or {}
        slim = {k: v for k, v in body.items() if k not in ("metadata", "status")}
        slim["metadata"] = {k: meta[k] for k in ("labels", "annotations", "ownerReferences")
                            if k in meta}
        return super().build(body=kopf.Body(slim), extra_fields=extra_fields)


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, logger, **_):
    cfg = OperatorConfig.from_env()
    # Our own events (kube.py) say what happened; kopf's would repeat our log lines as events.
    settings.posting.enabled = False
    # Fail fast on silent watch connections rather than wait for TCP (dask-kubernetes' startup
    # handler does the same; kopf docs/configuration.rst, "API timeouts").
    settings.watching.server_timeout = 120
    settings.watching.client_timeout = 150
    settings.watching.connect_timeout = 10
    # Lists in pages: one response of every labelled pod in the cluster is held whole at once.
    settings.watching.chunk_size = 100
    settings.networking.request_timeout = 60
    # A deleted job's daemon leaves within a pass; wait that long for it rather than re-check
    # after the daemon's cancellation backoff (15 s), which would hold the job (and a queued
    # job's Kueue quota, freed when its Workload goes with it) for that long.
    settings.background.instant_exit_timeout = 2.0
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="crucible.dev")
    settings.persistence.diffbase_storage = SpecDiffBase(prefix="crucible.dev")
    settings.execution.max_workers = cfg.workers
    for group, plural in SELECTED:  # server-side: only what the operator made
        settings.watching.label_selectors[group, plural] = m.LABEL_JOB
    memo.config = cfg
    memo.cluster_policy = cfg.cluster_policy   # settings: parsed once, read by every pass
    # A connection for each call a pass may have in flight: its actions and its status write.
    memo.kube = Kube(api_client(cfg.workers * (FAN_OUT + 1)), fan_out=FAN_OUT,
                     cordons_per_minute=cfg.max_cordons_per_minute)
    memo.executor = concurrent.futures.ThreadPoolExecutor(cfg.workers, "crucible-pass")
    init_state(memo)
    # With leader election on, passes wait until this replica holds the leader Lease, and
    # stop writing the moment it could not renew it (leader.py).
    memo.leadership = None
    if cfg.leader_election_namespace:
        memo.leadership = leader.Leadership()
        memo.became_leader = asyncio.Event()
        loop = asyncio.get_running_loop()
        memo.leadership.on_leading(lambda: loop.call_soon_threadsafe(memo.became_leader.set))
        leader.start(api_client(1, leader.CALL_TIMEOUT_S, retries=0),
                     cfg.leader_election_namespace, memo.leadership)
    memo.housekeeping = asyncio.create_task(_housekeeping(memo, logger))
    memo.metrics_server = None
    if cfg.metrics_port is not None:
        memo.metrics_server = metrics.serve(cfg.metrics_port, lambda: memo.phases,
                                            cfg.metrics_address, lambda: memo.jobs)
        logger.info(f"metrics on http://{cfg.metrics_address}:"
                    f"{memo.metrics_server[0].server_port}/metrics")
    start_child_watches(memo, cfg.namespaces)    # last: a failure above retries without them
    logger.info(f"reconciling {crd.NAME}: resync every {cfg.interval_s}s, "
                f"{cfg.workers} API workers")


async def _housekeeping(memo, logger) -> None:
    """What no job's pass owns, on the leader only: end the operator's cordons whose quarantine
    is over (quarantine.py), force-delete the pods of deleted jobs stuck Terminating (on a dead
    node no kubelet confirms their end: they would hold a same-name job's pod names forever),
    and drop from memory what belongs to nodes and jobs that are gone. Looks again when the
    next quarantine falls due, at least every CHECK_INTERVAL_S."""
    while True:
        delay = quarantine.CHECK_INTERVAL_S
        try:
            _forget_gone(memo)
            if _acting(memo)():
                now = dt.datetime.now(dt.timezone.utc)
                delay = min(delay, await _end_quarantines(memo, logger, now))
                await _sweep_orphans(memo, logger, now)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - a background loop must outlive one bad object
            logger.exception("housekeeping failed; trying again later")
        await asyncio.sleep(max(delay, 0.5))


def _indexed_uids(pods_by_job, key) -> list[str]:
    """The UIDs of the job's pods in the pod index (none while the index is not there yet)."""
    return [view.uid for view in pods_by_job.get(key, ())] if pods_by_job is not None else []


def _forget_gone(memo) -> None:
    """Bound the in-memory maps: deleted nodes leave them (known ones an hour after they went:
    by then no pod of theirs is left, PodGC deletes those), pods gone from the index leave the
    Terminating list, jobs without a loop leave the room book once their pods are gone, and
    expected creates past their time leave the expectations."""
    nodes, pods = memo.nodes_index, memo.pods_index
    if nodes is not None:
        _forget_deleted_nodes(memo, nodes)
        now = time.monotonic()
        for name, gone in list(memo.known_nodes.items()):
            if name in nodes:
                memo.known_nodes[name] = None
            elif gone is None:
                memo.known_nodes[name] = now
            elif now - gone > KNOWN_NODE_TTL_S:
                del memo.known_nodes[name]
    if pods is not None:
        for ref, (key, pod) in list(memo.terminating.items()):
            if not any(view.uid == pod.uid for view in pods.get(key, ())):
                del memo.terminating[ref]
    # A deleted job's pods hold their room until they are gone from the index (the scheduler
    # counts a Terminating pod until then); then it goes to the waiting jobs.
    gave_back = False
    for key in {owner for owner, _, _ in memo.book.pods.values()} - set(memo.wakeups):
        gave_back |= memo.book.sync_job(key, _indexed_uids(pods, key))
    if gave_back:
        _grant(memo)
    memo.kube.expected.expired()    # creates whose object no watch ever showed


async def _end_quarantines(memo, logger, now: dt.datetime) -> float:
    """Lift or disown the cordons due; the seconds until the next one falls due."""
    loop = asyncio.get_running_loop()
    delay = quarantine.CHECK_INTERVAL_S
    for name, view in list(memo.cordoned.items()):
        patch, due_s = quarantine.release(view, now, memo.cluster_policy.quarantine_s)
        if due_s is not None:
            delay = min(delay, due_s + DUE_SLACK_S)
        if patch is None:
            continue
        lifted = (patch.get("spec") or {}).get("unschedulable") is False
        try:
            await loop.run_in_executor(memo.executor, memo.kube.release_quarantine, name, patch)
        except API_ERRORS as err:
            logger.warning(f"node {name}: quarantine not ended, will retry: {describe(err)}")
            delay = min(delay, RETRY_S)
            continue
        memo.cordoned.pop(name, None)    # its next event says where it stands now
        logger.info(f"node {name}: " + (
            "quarantine over and the node healthy: uncordoned, on probation" if lifted
            else "its cordon is no longer the operator's: dropped the operator's claim"))
    return delay


async def _sweep_orphans(memo, logger, now: dt.datetime) -> None:
    """Force-delete pods whose job is gone (or is a new job of the same name) once they have
    been Terminating past their grace and ORPHAN_TERMINATING_S more: a live job's own pods are
    its passes' to judge."""
    loop = asyncio.get_running_loop()
    for ref, (key, pod) in list(memo.terminating.items()):
        if (memo.live.get(key) == pod.owner_uid or pod.owner_kind != crd.KIND
                or not orphan_stuck(pod, now)):
            continue
        try:
            await loop.run_in_executor(memo.executor, memo.kube.force_delete_pod, *ref,
                                       pod.uid)
        except API_ERRORS as err:
            logger.warning(f"pod {ref[0]}/{ref[1]}: not force-deleted, will retry: "
                           f"{describe(err)}")
            continue
        memo.terminating.pop(ref, None)
        logger.info(f"pod {ref[0]}/{ref[1]} of a deleted job was stuck Terminating: "
                    "force-deleted")


@kopf.on.cleanup()
async def shutdown(memo: kopf.Memo, **_):
    stop_child_watches(memo)
    if getattr(memo, "housekeeping", None):
        memo.housekeeping.cancel()
    if getattr(memo, "metrics_server", None):
        server, _thread, collectors = memo.metrics_server
        server.shutdown()
        for collector in collectors:
            metrics.REGISTRY.unregister(collector)
    if getattr(memo, "executor", None):
        memo.executor.shutdown(wait=False, cancel_futures=True)
        memo.kube.events.shutdown(wait=True, cancel_futures=False)


@kopf.on.probe(id="jobs")
async def jobs_probe(memo: kopf.Memo, **_):
    return len(getattr(memo, "phases", {}))


# --- reconciliation --------------------------------------------------------------------------
def _comparable(status: dict) -> dict:
    out = {k: v for k, v in status.items() if k != "goodput"}
    out["tracking"] = {k: v for k, v in (status.get("tracking") or {}).items() if k != WRITES}
    return out


class After(enum.Enum):
    """Why the daemon waits as long as it does before its next pass."""

    STALE = "stale"      # the job body predates our own last status write: wait for the watch
    CONFLICT = "conflict"  # the job changed since the pass read it: read it and decide again
    RETRY = "retry"      # the API failed, or refused something for now
    NOW = "now"          # the pass decided something status-only: run the next one at once
    DUE = "due"          # a time-based decision falls due (a grace period, the hang timeout)
    RESYNC = "resync"    # nothing pending: the periodic resync
    GONE = "gone"        # the job no longer exists (deleted, or its namespace was)
    FOLLOW = "follow"    # this replica does not lead (any more): wait until it does


@dataclass(frozen=True)
class NextPass:
    after: After
    delay_s: float


@dataclass(frozen=True)
class PassResult:
    """What one pass did: the decision, what the API made of it, the status write's fence
    count (None when the status did not change) and the events posted."""

    outcome: Outcome
    applied: Applied
    written: int | None
    events: tuple[Event, ...]
    conflict: bool = False   # the status patch met a 409: the job moved since the pass read it


class NotLeading(Exception):
    """The replica lost (or could not renew) the leader Lease: the pass stops writing."""


def retry_delay_s(failures: int) -> float:
    """The wait after `failures` passes in a row that the API failed: RETRY_S, doubled each
    time up to RETRY_MAX_S (an apiserver that is down is not asked every 2 s by every job)."""
    return min(RETRY_S * 2 ** max(0, failures - 1), RETRY_MAX_S)


def next_pass(outcome: Outcome, applied: Applied, interval_s: float,
              failures: int = 1) -> NextPass:
    """When to run again after a pass that went through (pure); `failures`: passes in a row,
    this one included, that met a transient API failure. Actions held because what they
    come after did not land (a refused NetworkPolicy: no pods) are retried the same way."""
    if applied.transient or applied.held:
        # A timed decision (a node's grace, a hang) still falls due meanwhile, but never
        # sooner than RETRY_S after a failure: an apiserver that throttles is not hammered.
        delay = retry_delay_s(failures)
        if outcome.wake_in_s is not None:
            delay = min(delay, max(outcome.wake_in_s + DUE_SLACK_S, RETRY_S))
        return NextPass(After.RETRY, delay)
    if outcome.requeue:
        return NextPass(After.NOW, 0.0)
    if outcome.wake_in_s is not None and outcome.wake_in_s + DUE_SLACK_S < interval_s:
        return NextPass(After.DUE, outcome.wake_in_s + DUE_SLACK_S)
    return NextPass(After.RESYNC, interval_s)


def _execute(kube: Kube, job: JobView, obs: Observed, now: dt.datetime, queued: float,
             cluster_policy: ClusterPolicy,
             acting: Callable[[], bool] = lambda: True,
             in_flight: frozenset[tuple[str, str]] = frozenset()) -> PassResult:
    """decide -> apply -> status -> events (runs in a worker thread). `acting` is asked before
    each write: a replica that stopped leading mid-pass writes nothing more. `in_flight`: the
    job's creates sent and not yet seen when the snapshot `obs` was taken (not sent again)."""
    started = time.perf_counter()
    metrics.RECONCILE_QUEUE_SECONDS.observe(started - queued)
    outcome = decide(job, obs, now, cluster_policy)
    if not acting():
        raise NotLeading()
    def unstarted(no_pod: bool) -> Outcome:
        """The outcome as the status must say it: a job whose first pods were all held (their
        NetworkPolicy refused, say) has not started, whatever the decision wrote."""
        if (no_pod and "startTime" not in job.status
                and not any(pod.owner_uid == job.uid for pod in obs.pods)):
            return replace(outcome, status={k: v for k, v in outcome.status.items()
                                            if k != "startTime"})
        return outcome

    if any(is_cordon(action) for action in outcome.actions):
        # The cordon limit may hold a cordon back, and the status must then not list that node.
        applied = kube.apply(job, outcome, in_flight)
        if applied.cordons_limited:
            outcome = not_cordoned(outcome, applied.cordons_limited, kube.cordons.per_minute)
        outcome = unstarted(bool(applied.held) and not applied.created_pods)
        written, conflict = _write_status(kube, job, outcome, acting)
    else:
        # Otherwise the status is the decision's whatever the actions meet (a refused create is
        # retried by the next pass, which decides from what then exists), so it goes alongside
        # them: under a start-up burst each round trip waits on a busy apiserver. Either may
        # land first; passes are level-triggered, and the pod watch can lag the job watch
        # anyway. Pods that come after a NetworkPolicy this pass writes may be held, which the
        # status must know: it then goes beside the pod wave, once the adapter knows.
        gated = any(action.after for action in outcome.actions)
        with concurrent.futures.ThreadPoolExecutor(1, "crucible-status") as side:
            writes = []

            def write(no_pod: bool) -> None:
                writes.append(side.submit(_write_status, kube, job, unstarted(no_pod), acting))

            if not gated:
                write(False)
            applied = kube.apply(job, outcome, in_flight, before_pods=write if gated else None)
            if not writes:     # never reached the pod wave
                write(bool(applied.held) and not applied.created_pods)
            written, conflict = writes[0].result()
    # The decision's events only once its status landed; what the API did, always.
    events = [] if conflict else list(outcome.events)
    if applied.created_pods:
        names = ", ".join(applied.created_pods)
        events.append(Event("Normal", "Created", f"created pod(s) {names}"))
    if applied.rejected:
        events.append(Event("Warning", "ApiRejected", "; ".join(applied.rejected)[:1024]))
    # After the status patch landed; posted in the background: an event is a record for
    # people, and waiting for it would only delay the next pass.
    kube.events.submit(kube.post_events, job, events)
    metrics.RECONCILE_SECONDS.observe(time.perf_counter() - started)
    return PassResult(outcome, applied, written, tuple(events), conflict)


def _write_status(kube: Kube, job: JobView, outcome: Outcome,
                  acting: Callable[[], bool]) -> tuple[int | None, bool]:
    """Patch the outcome's status if it differs from the job's: (the fence count written, or
    None if nothing was; whether the job had moved since the pass read it: a 409)."""
    if _comparable(outcome.status) == _comparable(job.status):
        return None, False
    status = dict(outcome.status)
    writes = int((job.status.get("tracking") or {}).get(WRITES, 0)) + 1
    status["tracking"] = {**status.get("tracking", {}), WRITES: writes}
    if not acting():
        raise NotLeading()
    try:
        kube.patch_status(job, status)   # names job.resource_version: 409 if it moved since
    except ApiException as err:
        if err.status != 409:
            raise
        return None, True
    return writes, False


def not_cordoned(outcome: Outcome, nodes: list[str], per_minute: int) -> Outcome:
    """The outcome as the cordon limit left it: those nodes annotated, not cordoned."""
    status = dict(outcome.status)
    status["cordonedNodes"] = [n for n in status.get("cordonedNodes") or [] if n not in nodes]
    if not status["cordonedNodes"]:
        del status["cordonedNodes"]
    events = outcome.events + tuple(Event(
        "Warning", "CordonRateLimited", f"node {node} failed under this job but was not "
        f"cordoned: the operator's limit of {per_minute} cordons per minute is reached (many "
        "nodes failing at once); it is annotated and this job keeps off it") for node in nodes)
    return replace(outcome, status=status, events=events)


def _log(logger, applied: Applied, events: tuple[Event, ...]):
    # kopf's object logger prefixes each line with [namespace/name].
    for event in events:
        (logger.warning if event.type == "Warning" else logger.info)(
            f"{event.reason}: {event.message}")
    for line in applied.rejected:
        logger.error(f"the API refused: {line}")
    for line in applied.transient:
        logger.warning(f"will retry: {line}")
    for line in applied.held:
        logger.info(f"held for a later pass: {line}")


def _acting(memo) -> Callable[[], bool]:
    leadership = getattr(memo, "leadership", None)
    return leadership.acting if leadership is not None else (lambda: True)


async def _one_pass(key, job_body, memo, indexes, logger, fenced: bool = True,
                    failures: int = 1) -> NextPass:
    """Run one pass; says when the next one should run. `failures`: passes in a row before
    this one that met a transient API failure, plus one (the backoff if this one does too)."""
    cfg: OperatorConfig = memo.config
    job = job_view(job_body)
    fence = memo.fences.get(job.uid, 0)
    if fenced and int((job.status.get("tracking") or {}).get(WRITES, 0)) < fence:
        return NextPass(After.STALE, 0.1)
    avoided = tuple(entry["node"] for entry in bad_entries(job.status.get("tracking") or {}))
    nodes = indexes["nodes_by_name"]
    _forget_deleted_nodes(memo, nodes)
    if memo.book.sync_job(key, _indexed_uids(indexes["pods_by_job"], key)):
        _grant(memo)
    policy = memo.cluster_policy
    queue = queueing.queue_name(job, policy.kueue and policy.kueue_manage_all,
                                (key[0], queueing.DEFAULT_QUEUE)
                                in indexes.get("local_queues", {}),
                                (job.status.get("tracking") or {}).get("defaultQueue"))
    # A node seen once and gone from the index was deleted; one never seen is one the watch
    # has not shown yet (a pod bound to a node that just joined), unknown, judged by nobody.
    wanted = [pod.node for pod in indexes["pods_by_job"].get(key, ()) if pod.node]
    deleted = {name for name in wanted + list(avoided) if name in memo.known_nodes
               and name not in nodes}
    obs = snapshot(key, {**indexes, **memo.children}, memo.conflicts.get(job.uid, frozenset()),
                   avoided, queue, memo.unserved.get(job.uid, frozenset()), deleted,
                   _granted(memo, key))
    in_flight = memo.kube.expected.pending(key)   # with the snapshot: what it cannot show yet
    obs = _queued_behind(memo, key, job, obs, queue)
    obs = _room_for_gang(memo, key, job, obs, queue)
    now = dt.datetime.now(dt.timezone.utc)
    loop = asyncio.get_running_loop()
    try:
        result: PassResult = await loop.run_in_executor(
            memo.executor, _execute, memo.kube, job, obs, now, time.perf_counter(),
            memo.cluster_policy, _acting(memo), in_flight)
    except NotLeading:
        logger.warning("no longer leading: the pass stops before writing")
        return NextPass(After.FOLLOW, 0.0)
    except API_ERRORS as err:
        metrics.RECONCILES.labels("error").inc()
        status = getattr(err, "status", None)
        # A 404 may mean the job itself is gone (its namespace deleted while this operator was
        # not watching): retrying would go on forever, every RETRY_S. Ask once.
        try:
            gone = status == 404 and await loop.run_in_executor(
                memo.executor, memo.kube.read_job, job.namespace, job.name) is None
        except API_ERRORS:
            gone = False
        if gone:
            logger.info("the job no longer exists: its reconcile loop ends")
            return NextPass(After.GONE, 0.0)
        delay = retry_delay_s(failures)
        logger.warning(f"pass failed, retrying in {delay:.0f}s: {describe(err)}")
        return NextPass(After.RETRY, delay)
    outcome, applied = result.outcome, result.applied
    if applied.held:
        memo.book.unclaim(key)   # no pod went: the room claimed for them is not taken
    # What this pass's creates found under another owner; the next pass reports it and tries
    # again (a create that now succeeds, or meets no conflict, clears it).
    memo.conflicts[job.uid] = frozenset(applied.conflicts)
    memo.unserved[job.uid] = frozenset(applied.unserved)
    if result.conflict:
        # The status patch named the resourceVersion the pass read, and the job has moved
        # since (a spec edit, kopf's finalizer, another writer): never a blind write. Read the
        # job and decide again (its actions are idempotent: they are replayed, not repeated).
        _log(logger, applied, result.events)
        logger.info("the job changed while the pass ran: deciding again from a fresh read")
        return NextPass(After.CONFLICT, 0.0)
    if result.written is not None:
        memo.fences[job.uid] = result.written
    memo.phases[job.uid] = outcome.status.get("phase", "Pending")
    _enlist(memo, key, job, outcome.status, obs)
    avoiding = {entry["node"] for entry in bad_entries(outcome.status.get("tracking") or {})}
    if avoiding:
        memo.avoiding[key] = avoiding
    else:
        memo.avoiding.pop(key, None)
    memo.jobs[job.uid] = metrics.JobRecord(job.namespace, job.name, outcome.status,
                                           metrics.checkpoint_interval_s(job.spec))
    for failure in outcome.restarts:
        metrics.RESTARTS.labels(failure.cause, failure.kind).inc()
    _log(logger, applied, result.events)
    metrics.RECONCILES.labels("error" if applied.transient else "ok").inc()
    return next_pass(outcome, applied, cfg.interval_s, failures)


def _queued_behind(memo, key, job: JobView, obs: Observed, queue: str | None) -> Observed:
    """A new job (generation 0, no pod yet) takes its place at the end of the waitlist when the
    room left after the jobs already on it (in their order) does not hold its gang: without
    this a job arriving just as room frees would take it before the jobs that have waited for
    it, and under a steady stream of new jobs those could wait forever. Kueue's jobs queue in
    Kueue; a job the book cannot account (no extended resource) is not on the list."""
    # Never one that has had pods (`startTime`: written by the pass that made the first): a
    # running job whose pods all vanished, or whose pods the watch has not shown yet, restarts
    # or goes on; it never queues.
    if (queue is not None or key in memo.waitlist or key in memo.reserved or job.deleting
            or "startTime" in job.status or int(job.status.get("podGeneration") or 0) != 0
            or any(pod.owner_uid == job.uid for pod in obs.pods)
            or (job.status.get("tracking") or {}).get("capacityHold")):
        return obs
    me = waitlist.waiter(key, job.spec, LAST_IN_LINE, obs)
    if me is None or _fits_behind_waitlist(memo, me):
        return obs
    return replace(obs, queued_behind=(
        f"{len(memo.waitlist)} job(s) that released their pods wait for room ahead of it"))


def _fits_behind_waitlist(memo, gang: waitlist.Waiter) -> bool:
    """Whether the gang (last in line: `since` later than anyone's) fits in the room left once
    the waitlist's jobs took theirs, in their order, and the operator's pods on their way and
    the other claimed gangs theirs. True when nobody waits."""
    if not memo.waitlist:
        return True
    if not waitlist.could_fit(gang, memo.book.nodes):
        return True    # no cluster of this shape holds it: the API's answer will say so
    ahead = [w for k, w in memo.waitlist.items() if k != gang.key]
    free = memo.book.free_after_pending(exclude=[*memo.waitlist, gang.key])
    return gang.key in waitlist.grants(ahead + [gang], free, memo.book.nodes)


def _room_for_gang(memo, key, job: JobView, obs: Observed, queue: str | None) -> Observed:
    """Whether the pass may create all of the generation's missing pods at once instead of pod
    0 first (obs.room_for_gang): the book shows room for every one of them, counting the pods
    other jobs have not got a node for yet and the gangs their passes just claimed. If so, the
    room is claimed in the book until this job's pods show up in it (the next pass), so jobs
    starting together do not all see the same room. Kueue's jobs are placed by Kueue."""
    memo.book.unclaim(key)
    tracking = job.status.get("tracking") or {}
    if queue is not None or tracking.get("capacityHold") or job.deleting:
        return obs
    gen = int(job.status.get("podGeneration") or 0)
    have = {pod.index for pod in obs.pods if pod.owner_uid == job.uid
            and pod.generation == gen}
    missing = int((job.spec.get("nodes") or {}).get("max") or 0) - len(have)
    if missing <= 1:
        return obs
    # A new job's gang (last in line): all at once only if the room left after the waitlist's
    # jobs holds all of them (nodes.max may be more than the nodes.min `_queued_behind` made
    # room for), else pod 0 first. A running job's restart goes first, as its replacements do.
    gang = waitlist.waiter(key, job.spec, LAST_IN_LINE, obs, missing)
    if (gang is None or not memo.book.room_for(gang)
            or ("startTime" not in job.status and key not in memo.waitlist
                and not _fits_behind_waitlist(memo, gang))):
        return obs
    memo.book.claim(key, gang.per_pod, missing)
    return replace(obs, room_for_gang=True)


def _enlist(memo, key, job: JobView, status: dict, obs: Observed) -> None:
    """Keep the waitlist in step with the job: on it while it waits (phase Waiting) with its
    pods released (`tracking.capacityHold`) and asks for an extended resource the book can
    count. A job just granted room keeps its place, holding that room, until nodes.min of its
    pods have a node (or RESERVE_S passes): its new pods are not in the book before they are
    bound, and the same room would otherwise be granted again. A job no longer waiting for
    any other reason (suspended, failed, held by Kueue) leaves the list at once."""
    hold = (status.get("tracking") or {}).get("capacityHold")
    phase = status.get("phase")
    waiter = waitlist.waiter(key, job.spec, hold, obs) if hold and phase == "Waiting" else None
    # Still after capacity: not suspended, finished, or held by Kueue.
    seeking = phase not in ("Suspended", "Succeeded", "Failed", "Queued")
    if waiter is None and key in memo.waitlist and obs.capacity_granted and seeking:
        memo.reserved.setdefault(key, time.monotonic() + RESERVE_S)
    if key in memo.reserved:
        bound = sum(1 for pod in obs.pods if pod.node and not pod.terminated
                    and pod.owner_uid == job.uid
                    and pod.generation == status.get("podGeneration"))
        minimum = ((job.spec.get("nodes") or {}).get("min") or 1)
        if (waiter is None and seeking and bound < minimum
                and time.monotonic() < memo.reserved[key]):
            waiter = memo.waitlist.get(key)
        else:
            del memo.reserved[key]
    if memo.waitlist.get(key) != waiter:
        if waiter is None:
            memo.waitlist.pop(key, None)
        else:
            memo.waitlist[key] = waiter
        memo.waitlist_version += 1


async def _sleep(wake: asyncio.Event, stopped, timeout: float) -> None:
    """Until woken, stopped, or the timeout."""
    waiters = [asyncio.ensure_future(wake.wait()), asyncio.ensure_future(stopped.wait())]
    try:
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()


def _version(body) -> str | None:
    return (body.get("metadata") or {}).get("resourceVersion")


async def _fresh_pass(key, memo, indexes, logger, failures: int) -> NextPass:
    """A pass on the job as the API has it now, not as the watch last showed it."""
    loop = asyncio.get_running_loop()
    try:
        fresh = await loop.run_in_executor(memo.executor, memo.kube.read_job, *key)
    except API_ERRORS as err:
        logger.warning(f"could not read the job, retrying: {describe(err)}")
        return NextPass(After.RETRY, retry_delay_s(failures))
    if fresh is None:
        return NextPass(After.GONE, 0.0)
    return await _one_pass(key, fresh, memo, indexes, logger, fenced=False, failures=failures)


@kopf.daemon(crd.GROUP, crd.VERSION, crd.PLURAL, cancellation_backoff=15.0,
             cancellation_timeout=15.0)
async def reconcile(body, namespace, name, uid, memo: kopf.Memo, stopped, logger, **indexes):
    """The per-job loop: a pass, then sleep until woken, due, or the resync interval. A
    standby replica's loop sleeps until the replica leads: it never wakes for events."""
    key = (namespace, name)
    wake = memo.wakeups.setdefault(key, asyncio.Event())
    if memo.live.get(key) != uid:
        # A namesake deleted just before: what its creates still expect is not this job's.
        memo.kube.expected.forget(key)
    memo.live[key] = uid
    fenced_since = None
    failures = 0              # passes in a row that met a transient API failure (backoff)
    ended = False             # the loop ended as it should (stopped, or the job gone)
    # kopf adds its finalizer to a new job as the daemon starts: a first pass begun before
    # that lands meets a 409 on its status write (the job moved) and runs again. Waiting a
    # moment for it saves a write and a pass per job, most of all when many start at once.
    settle = time.monotonic() + FINALIZER_WAIT_S
    while (FINALIZER not in ((body.get("metadata") or {}).get("finalizers") or ())
           and time.monotonic() < settle and not stopped):
        await asyncio.sleep(0.05)
    try:
        # A pass before the children's first lists are in would create what may exist already
        # (harmless, a 409 then, but noisy): wait for them a while, not for ever, since a watch
        # that cannot list (its rights gone) must not stop the job.
        listed_by = time.monotonic() + LIST_WAIT_S
        while (not children_listed(memo, namespace) and time.monotonic() < listed_by
               and not stopped):
            await asyncio.sleep(0.1)
        if not children_listed(memo, namespace):
            logger.warning(f"the child kinds in {namespace} are not listed after {LIST_WAIT_S:.0f}"
                           " s (see the metadata watch's warnings); passes go on without them")
        while not stopped:
            if not _acting(memo)():
                if memo.became_leader.is_set():   # led, and lost it: the process is ending
                    await asyncio.sleep(1.0)
                else:
                    await _sleep(memo.became_leader, stopped, 60.0)
                continue
            wake.clear()
            read = _version(body)
            nxt = await _one_pass(key, body, memo, indexes, logger, failures=failures + 1)
            if nxt.after is After.STALE:  # wait for the watch; if it lags too long, read the job
                fenced_since = fenced_since or time.monotonic()
                if time.monotonic() - fenced_since < FENCE_WAIT_S:
                    await _sleep(wake, stopped, nxt.delay_s)
                    continue
                logger.warning("the watch lags our own status write; reading the job instead")
                nxt = await _fresh_pass(key, memo, indexes, logger, failures + 1)
            for _ in range(CONFLICT_RETRIES):   # the job moved under the pass: decide again
                if nxt.after is not After.CONFLICT:
                    break
                # From the watch's newer body, once it shows it (its indexes then show this
                # pass's creates too, which a pass on a fresh read would replay); from a read
                # if the watch is slow.
                deadline = time.monotonic() + CONFLICT_WAIT_S
                while _version(body) == read and time.monotonic() < deadline and not stopped:
                    await asyncio.sleep(0.05)
                if _version(body) != read:
                    read = _version(body)
                    nxt = await _one_pass(key, body, memo, indexes, logger,
                                          failures=failures + 1)
                else:
                    nxt = await _fresh_pass(key, memo, indexes, logger, failures + 1)
            if nxt.after is After.GONE:
                break
            fenced_since = None
            failures = failures + 1 if nxt.after in (After.RETRY, After.CONFLICT) else 0
            if nxt.after is After.CONFLICT:
                nxt = NextPass(After.RETRY, retry_delay_s(failures))
            if nxt.delay_s > 0:
                await _sleep(wake, stopped, nxt.delay_s)
                if wake.is_set() and not stopped:
                    await asyncio.sleep(memo.config.debounce_s)  # let a burst of events land
        ended = True
    finally:
        memo.wakeups.pop(key, None)
        memo.fences.pop(uid, None)
        memo.phases.pop(uid, None)
        memo.jobs.pop(uid, None)
        memo.conflicts.pop(uid, None)
        memo.unserved.pop(uid, None)
        memo.avoiding.pop(key, None)
        # A loop that crashed comes back after kopf's backoff: the job is still live, and its
        # Terminating pods are not orphans for the sweep meanwhile.
        if ended and memo.live.get(key) == uid:
            del memo.live[key]
        if memo.waitlist.pop(key, None) is not None:
            memo.waitlist_version += 1
        # Its pods keep their room in the book until they are gone (`_forget_gone`).
        memo.book.sync_job(key, _indexed_uids(memo.pods_index, key))
        memo.book.unclaim(key)


logging.getLogger("kubernetes.client.rest").setLevel(logging.WARNING)
logging.getLogger("leaderelection").setLevel(logging.WARNING)  # a line per retry otherwise
