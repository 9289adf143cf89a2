"""The one adapter between an `Outcome` and the Kubernetes API (official `kubernetes` client).

Owns how each action is carried out and which API answers mean "already done": creating what exists
(409) and deleting what is gone (404) succeed, so every action can be replayed after a crash, and
which creates are still on their way (`expected`: not sent twice). The pass's single status patch
(`handlers._execute` sends it beside the actions), and only after it lands, the events (the
`statusUpdateOpts` discipline of kubernetes-sigs/jobset, pkg/controllers/jobset_controller.go).
Failures are classified, never swallowed: a refused or invalid request (4xx) is `Rejected` (a
spec or RBAC problem that retrying will not fix, reported as a Warning event); anything else is
`Transient` (the caller retries the pass).

Blocking calls: the handlers run these in a thread pool, never on the event loop.
"""

from __future__ import annotations

import concurrent.futures
import datetime as dt
import hashlib
import logging
import collections
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from crucible.api.progress import format_time
from crucible.operator import crd, metrics, queueing
from crucible.operator.apiclient import API_ERRORS, CONNECTION_ERRORS, describe
from crucible.api.names import PREFIX
from crucible.operator.decision import Action, Event, Outcome
from crucible.operator.expectations import Expectations
from crucible.operator.observed import JobView
from crucible.operator.manifests import FIELD_MANAGER, child_digest, observed_digest

COMPONENT = "crucible-operator"
log = logging.getLogger(__name__)


@dataclass
class Applied:
    created_pods: list[str] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)    # 4xx other than the idempotent ones
    # (kind, name) of children that exist under another owner (a 409 on create, and not ours)
    conflicts: list[tuple[str, str]] = field(default_factory=list)
    # kinds whose create the server answered 404: their API is not served (Kueue's Workload
    # without Kueue installed), which says more than a rejection event every pass
    unserved: list[str] = field(default_factory=list)
    transient: list[str] = field(default_factory=list)   # 5xx, 429, timeouts, connection errors
    cordons_limited: list[str] = field(default_factory=list)  # nodes annotated, not cordoned
    # pod creates (and any action `after` an object) not carried out because what they need
    # did not land in this pass: a child's write failed, a child is someone else's, or the
    # object they come after was not put in place; the pass is retried
    held: list[str] = field(default_factory=list)


class CordonLimit:
    """At most `per_minute` cordons in any 60 s, across every job this operator serves (0: it
    never cordons). Past the limit a failed node is still annotated, and its job still keeps
    its pods off it, but the node stays schedulable for everyone else: many nodes failing at
    once is more likely the network, or the operator's view of the cluster, than the nodes,
    and cordoning them all would empty the pool (kube-controller-manager slows its own
    evictions for the same reason: --node-eviction-rate, --unhealthy-zone-threshold). Kept in
    memory, across threads: a new leader starts a fresh window."""

    def __init__(self, per_minute: int, clock=time.monotonic):
        self.per_minute, self.clock = per_minute, clock
        self._taken: collections.deque[tuple[float, str]] = collections.deque()
        self._lock = threading.Lock()

    def take(self, node: str) -> bool:
        """Whether `node` may be cordoned now. Counted per node: several jobs whose passes
        cordon the same failed node at once spend one slot, not one each."""
        with self._lock:
            now = self.clock()
            while self._taken and now - self._taken[0][0] >= 60:
                self._taken.popleft()
            if any(name == node for _, name in self._taken):
                return True
            if len(self._taken) >= self.per_minute:
                return False
            self._taken.append((now, node))
            return True


def is_cordon(action: Action) -> bool:
    """Whether the action cordons a node (what the cordon limit counts)."""
    if action.verb != "patch_node":
        return False      # other actions may carry no body
    return bool((action.body.get("spec") or {}).get("unschedulable"))


def annotate_only(action: Action, per_minute: int) -> Action:
    """A cordon patch turned into a report: the annotations without `spec.unschedulable`."""
    annotations = {k: v for k, v in action.body["metadata"]["annotations"].items()
                   if k != f"{PREFIX}cordoned-by"}
    annotations[f"{PREFIX}cordon-skipped"] = (f"the operator's limit of {per_minute} cordons "
                                              "per minute was reached")
    return replace(action, body={"metadata": {"annotations": annotations}},
                   reason="CordonRateLimited")


class NameConflict(Exception):
    """A child this job creates exists, and another owner controls it."""

    def __init__(self, kind: str, name: str):
        super().__init__(f"{kind} {name}")
        self.kind, self.name = kind, name


class ChildGoing(Exception):
    """A child this job creates exists, its own, but is being deleted: not in place for what
    comes after it. Created again by a later pass once it is gone."""


def event_name(job: str, uid: str, event: Event) -> str:
    """The one Event object of a job's (type, reason, message): the same name every time, so a
    repeat is a count on it. A hash keeps it a valid name whatever the message holds."""
    digest = hashlib.sha256(f"{uid}\n{event.type}\n{event.reason}\n{event.message}".encode())
    return f"{job}.{digest.hexdigest()[:16]}"


class Kube:
    def __init__(self, api: client.ApiClient, fan_out: int = 8, cordons_per_minute: int = 6):
        self.api = api
        self.fan_out = fan_out  # concurrent calls per pass
        self.cordons = CordonLimit(cordons_per_minute)
        self.expected = Expectations()   # creates sent that the watches have not shown yet
        self.events = concurrent.futures.ThreadPoolExecutor(2, "crucible-events")
        self.core = client.CoreV1Api(api)
        self.coordination = client.CoordinationV1Api(api)
        self.rbac = client.RbacAuthorizationV1Api(api)
        self.networking = client.NetworkingV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.instance = socket.gethostname()
        self._event_lock = threading.Lock()
        self._event_counts: dict[str, int] = {}  # Event name -> count posted

    # -- actions ------------------------------------------------------------------------------
    def _create(self, ns: str, kind: str, body: dict):
        creators = {
            "Pod": self.core.create_namespaced_pod,
            "Service": self.core.create_namespaced_service,
            "ConfigMap": self.core.create_namespaced_config_map,
            "ServiceAccount": self.core.create_namespaced_service_account,
            "Lease": self.coordination.create_namespaced_lease,
            "Role": self.rbac.create_namespaced_role,
            "RoleBinding": self.rbac.create_namespaced_role_binding,
            "NetworkPolicy": self.networking.create_namespaced_network_policy,
            "Workload": self._create_workload,
        }
        # The created object is not read: the watch brings it. The client would otherwise parse
        # the answer and build its models from it (a V1Pod is hundreds of Python objects), a
        # third of what a create cost the operator in a start-up burst. An error still raises
        # ApiException.
        answer = creators[kind](ns, body, _preload_content=False, field_manager=FIELD_MANAGER)
        answer.data   # read to the end, which hands the connection back to the pool

    def _create_workload(self, ns: str, body: dict, **kwargs):
        return self.custom.create_namespaced_custom_object(queueing.GROUP, queueing.VERSION, ns,
                                                           queueing.PLURAL, body, **kwargs)

    def _read_workload(self, name: str, ns: str):
        body = self.custom.get_namespaced_custom_object(queueing.GROUP, queueing.VERSION, ns,
                                                        queueing.PLURAL, name)
        refs = (body.get("metadata") or {}).get("ownerReferences") or []
        return client.V1ObjectMeta(owner_references=[
            client.V1OwnerReference(api_version=r.get("apiVersion"), kind=r.get("kind"),
                                    name=r.get("name"), uid=r.get("uid"),
                                    controller=r.get("controller")) for r in refs])

    def _existing(self, ns: str, kind: str, name: str) -> dict:
        """The metadata of the existing object of a create that met a 409: the children carry
        no label a stranger's object would have, so the index cannot tell whose it is; its
        owner can, and its digest annotation says what it was rendered from."""
        readers = {
            "Service": self.core.read_namespaced_service,
            "ConfigMap": self.core.read_namespaced_config_map,
            "ServiceAccount": self.core.read_namespaced_service_account,
            "Lease": self.coordination.read_namespaced_lease,
            "Role": self.rbac.read_namespaced_role,
            "RoleBinding": self.rbac.read_namespaced_role_binding,
            "NetworkPolicy": self.networking.read_namespaced_network_policy,
        }
        existing = (self._read_workload(name, ns) if kind == "Workload"
                    else readers[kind](name, ns).metadata)
        return self.api.sanitize_for_serialization(existing)

    def _do(self, ns: str, action: Action) -> bool:
        """Carry out one action; True if it changed something, False if it was already so."""
        verb, kind, name = action.verb, action.kind, action.name
        try:
            if verb == "create":
                self._create(ns, kind, action.body)
            elif verb == "replace" and kind in ("ConfigMap", "NetworkPolicy"):
                self._replace(ns, kind, name, action.body)
            elif verb == "delete" and kind == "Pod":
                self.core.delete_namespaced_pod(name, ns)
            elif verb == "force_delete" and kind == "Pod":
                self.core.delete_namespaced_pod(name, ns, grace_period_seconds=0,
                                                body=client.V1DeleteOptions(grace_period_seconds=0))
            elif verb == "patch_node":
                self.patch_node(name, action.body)
                if (action.body.get("spec") or {}).get("unschedulable"):
                    metrics.CORDONS.inc()
            elif verb == "delete" and kind == "Workload":
                self.custom.delete_namespaced_custom_object(
                    queueing.GROUP, queueing.VERSION, ns, queueing.PLURAL, name,
                    propagation_policy="Background")
            elif verb == "patch" and kind == "Workload":
                self.custom.patch_namespaced_custom_object(
                    queueing.GROUP, queueing.VERSION, ns, queueing.PLURAL, name, action.body)
            elif verb == "patch_status" and kind == "Workload":
                self.custom.patch_namespaced_custom_object_status(
                    queueing.GROUP, queueing.VERSION, ns, queueing.PLURAL, name, action.body)
            elif verb == "delete_job":
                self.custom.delete_namespaced_custom_object(
                    crd.GROUP, crd.VERSION, ns, crd.PLURAL, name, propagation_policy="Background")
            else:
                raise ValueError(f"no adapter for {verb} {kind}")
        except ApiException as err:
            if verb == "create" and err.status == 409:
                if kind != "Pod":
                    meta = self._existing(ns, kind, name)
                    want = action.body["metadata"]["ownerReferences"][0]["uid"]
                    if not any(ref.get("controller") and ref.get("uid") == want
                               for ref in meta.get("ownerReferences") or ()):
                        raise NameConflict(kind, name) from None
                    if meta.get("deletionTimestamp"):
                        raise ChildGoing(f"{kind} {name} is being deleted") from None
                    digest = child_digest(action.body)
                    if digest is not None and observed_digest(kind, meta) != digest:
                        # Ours, rendered from an older spec or setting, and not in the index
                        # (which decides replaces): replaced here, or nothing ever would.
                        self._replace(ns, kind, name, action.body)
                        return True
                return False
            if err.status == 404 and verb != "create":
                return False
            raise
        if kind == "Pod":
            metrics.POD_OPERATIONS.labels(verb).inc()
        return True

    def _replace(self, ns: str, kind: str, name: str, body: dict) -> None:
        if kind == "ConfigMap":
            # A JSON patch: the data whole (a key someone added goes), the annotation, in the
            # operator's name, so managedFields show the data is its own again.
            self.core.patch_namespaced_config_map(name, ns, [
                {"op": "add", "path": "/metadata/annotations",
                 "value": body["metadata"]["annotations"]},
                {"op": "add", "path": "/data", "value": body["data"]}],
                field_manager=FIELD_MANAGER)
        else:
            # A whole new spec (a key it no longer has must go: no merge).
            self.networking.replace_namespaced_network_policy(name, ns, body)

    def apply(self, job: JobView, outcome: Outcome,
              in_flight: frozenset[tuple[str, str]] = frozenset(),
              before_pods: Callable[[bool], None] | None = None) -> Applied:
        """Carry out the actions, independent ones concurrently, in waves: first all but
        RoleBindings and pods; then RoleBindings, because the apiserver's escalation check
        reads the Role a binding names; then pods, which need the ServiceAccount (admission)
        and must never outrun their NetworkPolicy. A new job's first pass is three round
        trips; any other, one. A create of what an earlier pass created and the watch has not
        shown is not sent again: `in_flight`, the (kind, name)s the job's creates awaited when
        the pass took its snapshot (`expected.pending`), and any expected since.

        Pods go only behind what this pass wrote before them: none once a child turns out to
        be someone else's (`conflicts`) or a child's create or replace failed (a pod without
        its ServiceAccount is refused, one without its ConfigMap never starts), and one whose
        `after` names an object is created only if this pass's write of it landed. Those are
        `held`: the pass is retried. `before_pods` is called once, just before the pod wave
        goes, with whether no pod create is left to send (the caller's status write can then
        go beside that wave)."""
        out = Applied()
        actions = []
        owner = (job.namespace, job.name)
        for action in outcome.actions:
            if action.verb == "create" and (action.kind, action.name) in in_flight:
                continue
            if is_cordon(action) and not self.cordons.take(action.name):
                action = annotate_only(action, self.cordons.per_minute)
                out.cordons_limited.append(action.name)
            actions.append(action)
        waves = [[a for a in actions if a.kind not in ("RoleBinding", "Pod")],
                 [a for a in actions if a.kind == "RoleBinding"],
                 [a for a in actions if a.kind == "Pod"]]
        written: set[tuple[str, str]] = set()   # what this pass's writes put in place
        unwritten: list[str] = []               # children whose create or replace failed
        for wave in waves:
            batch = wave
            if out.conflicts:  # a child is someone else's (the Service: their DNS): no pods
                out.held += [f"create Pod/{a.name}: {'/'.join(out.conflicts[0])} is someone "
                             "else's" for a in batch if a.kind == "Pod" and a.verb == "create"]
                batch = [a for a in batch if a.kind != "Pod"]
            go = []
            for a in batch:
                if a.kind == "Pod" and a.verb == "create" and unwritten:
                    out.held.append(f"create Pod/{a.name}: {unwritten[0]} did not land")
                elif a.after and a.after not in written:
                    out.held.append(f"{a.verb} {a.kind}/{a.name}: after {'/'.join(a.after)}, "
                                    "which this pass did not put in place")
                else:
                    go.append(a)
            if wave is waves[-1] and before_pods is not None:
                before_pods(not any(a.kind == "Pod" and a.verb == "create" for a in go))
            if not go:
                continue
            if len(go) == 1:
                results = [self._attempt(owner, go[0])]
            else:  # this pass's own threads: a shared queue would make it wait for others'
                workers = min(self.fan_out, len(go))
                with concurrent.futures.ThreadPoolExecutor(workers) as pool:
                    results = list(pool.map(lambda a: self._attempt(owner, a), go))
            for action, (changed, error) in zip(go, results):
                child_write = (action.kind not in ("Pod", "Workload")
                               and action.verb in ("create", "replace"))
                if error is not None:
                    kind, detail = error
                    if child_write and kind != "in_flight":
                        unwritten.append(f"{action.kind}/{action.name}")
                    if kind != "in_flight":
                        {"transient": out.transient, "rejected": out.rejected,
                         "conflict": out.conflicts, "unserved": out.unserved}[kind].append(detail)
                    continue
                if action.verb == "create" or (action.verb == "replace" and changed):
                    written.add((action.kind, action.name))
                if changed and action.verb == "create" and action.kind == "Pod":
                    out.created_pods.append(action.name)
        return out

    def _attempt(self, owner: tuple[str, str], action: Action
                 ) -> tuple[bool, tuple[str, str] | None]:
        creating = action.verb == "create"
        if creating and not self.expected.expect(owner, action.kind, action.name):
            # Sent by an earlier pass; the watch will show it (or, if it has gone since,
            # nothing will: this pass cannot count on it being there).
            return False, ("in_flight", f"{action.kind}/{action.name}")
        result = self._try(owner[0], action)
        if creating and result != (True, None):
            # Only a create the API made leaves an expectation: after an error nothing comes,
            # and after a 409 the object was there already, perhaps shown by the watch before
            # this pass expected it (then nothing would end the expectation but its time).
            self.expected.seen(owner, action.kind, action.name)
        return result

    def _try(self, namespace: str, action: Action) -> tuple[bool, tuple[str, str] | None]:
        what = f"{action.verb} {action.kind}/{action.name}"
        try:
            return self._do(namespace, action), None
        except NameConflict as err:
            return False, ("conflict", (err.kind, err.name))
        except ChildGoing as err:
            return False, ("transient", f"{what}: {err}; created again once it is gone")
        except ApiException as err:
            if err.status == 404 and action.verb == "create" and action.kind == "Workload":
                return False, ("unserved", action.kind)
            # A 409 on a status patch: Kueue wrote the Workload since the pass read it (the
            # patch names the resourceVersion read); the next pass decides from the new one.
            retry = (err.status is None or err.status >= 500 or err.status == 429
                     or (err.status == 409 and action.verb in ("patch", "patch_status")))
            return False, ("transient" if retry else "rejected",
                           f"{what}: HTTP {err.status} {_api_message(err)}")
        except CONNECTION_ERRORS as err:  # no HTTP answer: refused, reset, timed out
            return False, ("transient", f"{what}: {describe(err)}")

    def force_delete_pod(self, namespace: str, name: str, uid: str) -> bool:
        """Delete that very pod (its UID: not a namesake made since) at once (grace 0); False
        if it is gone already."""
        try:
            self.core.delete_namespaced_pod(name, namespace, grace_period_seconds=0,
                                            body=client.V1DeleteOptions(
                                                grace_period_seconds=0,
                                                preconditions=client.V1Preconditions(uid=uid)))
        except ApiException as err:
            if err.status in (404, 409):    # 409: the UID precondition failed: another pod
                return False
            raise
        metrics.POD_OPERATIONS.labels("force_delete").inc()
        return True

    def patch_node(self, name: str, body: dict) -> None:
        """A merge patch of a node under the operator's own field manager: the node's
        managedFields then say whether a cordon is the operator's (quarantine.py)."""
        self.core.patch_node(name, body, field_manager=FIELD_MANAGER)

    def release_quarantine(self, name: str, body: dict) -> bool:
        """Lift (or disown) the operator's cordon of a node; False if the node is gone, or
        moved since it was read (the patch names its resourceVersion: a cordon someone made a
        moment ago is never undone; the next look decides from the newer node)."""
        try:
            self.patch_node(name, body)
        except ApiException as err:
            if err.status in (404, 409):
                return False
            raise
        if (body.get("spec") or {}).get("unschedulable") is False:
            metrics.UNCORDONS.inc()
        return True

    # -- status and events --------------------------------------------------------------------
    def patch_status(self, job: JobView, status: dict) -> dict:
        """One merge patch of /status that makes it exactly `status` (see `merge_patch`),
        naming the resourceVersion the pass read: if the job moved since (another writer, a
        replica that still thinks it leads), the apiserver answers 409 and nothing is written
        (the caller reads the job and decides again)."""
        body: dict = {"status": merge_patch(dict(job.status), status)}
        if job.resource_version:
            body["metadata"] = {"resourceVersion": job.resource_version}
        return self.custom.patch_namespaced_custom_object_status(
            crd.GROUP, crd.VERSION, job.namespace, crd.PLURAL, job.name, body)

    def post_events(self, job: JobView, events: list[Event]) -> list[str]:
        """Post events, one Event object per job, type, reason and message: a repeat (an
        `ApiRejected` quota refusal every pass, say) raises its `count` and `lastTimestamp`, as
        client-go's event correlator does, instead of a new object each time. An event that
        cannot be posted is logged, never fatal."""
        problems = []
        now = format_time(dt.datetime.now(dt.timezone.utc))
        with self._event_lock:  # one poster at a time: counts are read, then raised
            for event in events:
                try:
                    self._post_event(job, event, now)
                except API_ERRORS as err:
                    problems.append(f"event {event.reason}: {describe(err)}")
        for problem in problems:
            log.warning(f"{job.namespace}/{job.name}: not posted: {problem}")
        return problems

    def _post_event(self, job: JobView, event: Event, now: str) -> None:
        name = event_name(job.name, job.uid, event)
        count = self._event_counts.get(name)
        if count is None:
            body = {
                "metadata": {"name": name, "namespace": job.namespace},
                "involvedObject": {"apiVersion": crd.API_VERSION, "kind": crd.KIND,
                                   "name": job.name, "namespace": job.namespace, "uid": job.uid},
                "type": event.type, "reason": event.reason, "message": event.message[:1024],
                "source": {"component": COMPONENT}, "reportingComponent": COMPONENT,
                "reportingInstance": self.instance,
                "firstTimestamp": now, "lastTimestamp": now, "count": 1,
            }
            try:
                self.core.create_namespaced_event(job.namespace, body)
                self._event_counts[name] = 1
                return
            except ApiException as err:
                if err.status != 409:
                    raise
            # Posted before (by an earlier operator process): carry on from its count.
            count = self.core.read_namespaced_event(name, job.namespace).count or 1
        try:
            self.core.patch_namespaced_event(name, job.namespace, {
                "count": count + 1, "lastTimestamp": now, "reportingInstance": self.instance})
            self._event_counts[name] = count + 1
        except ApiException as err:
            if err.status != 404:
                raise
            del self._event_counts[name]  # expired (the apiserver's event TTL): post anew
            self._post_event(job, event, now)

    def read_job(self, namespace: str, name: str) -> dict | None:
        try:
            return self.custom.get_namespaced_custom_object(crd.GROUP, crd.VERSION, namespace,
                                                            crd.PLURAL, name)
        except ApiException as err:
            if err.status == 404:
                return None
            raise


def merge_patch(old: dict, new: dict) -> dict:
    """The RFC 7386 merge patch that turns `old` into `new`: a key `new` dropped, at any depth,
    is sent as null (a plain `new` would leave nested keys behind: `{"members": {}}` merges
    into the old map and deletes nothing)."""
    patch = {key: None for key in old if key not in new}
    for key, value in new.items():
        before = old.get(key)
        if isinstance(value, dict) and isinstance(before, dict):
            patch[key] = merge_patch(before, value)
        else:
            patch[key] = value
    return patch


def _api_message(err: ApiException) -> str:
    import json

    try:
        return json.loads(err.body).get("message", "")[:300]
    except (TypeError, ValueError):
        return str(err.reason)
