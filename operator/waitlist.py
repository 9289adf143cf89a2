"""The waitlist: which of the jobs that let go of their pods for want of room get it back, and when.

Owns one question. A job short of capacity for long enough releases its pods and waits
(capacity.py); room then frees up (a node joins or comes back, another job's pods go). Which
waiting jobs should try again? Waking them all (what a node event used to do) sends every
waiting job after the same few GPUs: one gets them, the rest gather part of a gang, hold it for
their retry window and release it again, over and over (a herd: most passes, most events, and
jobs that never run). So the operator keeps a book of room and grants it in order:

- **Room** is counted in the extended resources the jobs ask for (`nvidia.com/gpu`, ...; any
  resource name with a domain): per node, its allocatable less what the operator's own active
  pods on it ask for. Nodes that are not Ready, cordoned, or tainted against the job (NoSchedule,
  NoExecute), or lack its node selector's labels, hold no room for it. What the operator cannot
  see (other workloads' pods) it does not subtract: a job granted room that is not there finds
  out, releases again after its retry window, and waits its backoff.
- **Order**: higher priority first, then the job waiting longest (since its release), as
  Kueue's StrictFIFO queueing: a job is granted only if, after every job ahead of it took its
  `nodes.min` pods' worth (placed first-fit on nodes, one pod's request per placement), the room
  left holds its own `nodes.min` pods; nobody behind a job that does not fit yet jumps it (a
  big gang would otherwise wait forever behind a stream of small ones): what it could use
  stays for it, and only jobs that need none of that (another pool, another resource) go on.
  A new job queues at the end too, when the room left after the list does not hold it.
- A job the book cannot account (it asks for no extended resource) is not on the list: it
  retries on its backoff timer, as before.

`grants` is pure; `RoomBook` is the operator's in-memory picture of the room, fed
by its node and pod watches, versioned so grants are computed again only when it changed.
Nothing here is needed for correctness after a restart: a new operator rebuilds the book from
its watches, and a job that is never granted still retries after RETRY_CAP_S (capacity.py).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

Key = tuple[str, str]                     # (namespace, job)
Amounts = Mapping[str, int]               # extended resource -> count
BLOCKING_EFFECTS = ("NoSchedule", "NoExecute")


def extended(resources: Mapping | None) -> dict[str, int]:
    """The extended resources (a name with a domain: nvidia.com/gpu) of a `resources` block
    (`limits` win over `requests`: for extended resources they must be equal anyway)."""
    out: dict[str, int] = {}
    for kind in ("requests", "limits"):
        for name, amount in ((resources or {}).get(kind) or {}).items():
            if "/" in name and not name.startswith("hugepages-"):
                try:
                    out[name] = int(str(amount))
                except ValueError:
                    continue
    return {name: amount for name, amount in out.items() if amount > 0}


@dataclass(frozen=True)
class NodeRoom:
    """What a node offers: its allocatable extended resources, and what keeps pods off it."""

    allocatable: Mapping[str, int] = field(default_factory=dict)
    labels: Mapping[str, str] = field(default_factory=dict)
    taints: tuple[tuple[str, str, str], ...] = ()        # (key, value, effect), blocking only
    schedulable: bool = True                              # Ready and not cordoned


def node_room(body: Mapping) -> NodeRoom:
    meta, spec, status = body.get("metadata", {}), body.get("spec", {}), body.get("status", {})
    ready = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), None)
    alloc = extended({"limits": status.get("allocatable") or {}})
    return NodeRoom(
        allocatable=alloc, labels=dict(meta.get("labels") or {}),
        taints=tuple((t.get("key", ""), t.get("value", "") or "", t.get("effect", ""))
                     for t in spec.get("taints") or [] if t.get("effect") in BLOCKING_EFFECTS),
        schedulable=(ready is not None and ready.get("status") == "True"
                     and not spec.get("unschedulable")))


def tolerates(tolerations: Iterable[Mapping], taint: tuple[str, str, str]) -> bool:
    """Kubernetes' toleration match (k8s.io/api core/v1 toleration.go, ToleratesTaint)."""
    key, value, effect = taint
    for t in tolerations:
        if t.get("effect") and t.get("effect") != effect:
            continue
        operator = t.get("operator") or "Equal"
        if not t.get("key"):
            if operator == "Exists":
                return True
            continue
        if t.get("key") != key:
            continue
        if operator == "Exists" or (t.get("value") or "") == value:
            return True
    return False


@dataclass(frozen=True)
class Waiter:
    """A job waiting for room after releasing its pods."""

    key: Key
    since: dt.datetime                    # when it released them: the queue's order
    pods: int                             # nodes.min: the gang that must fit at once
    per_pod: Mapping[str, int]            # extended resources each pod asks for
    priority: int = 0
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping, ...] = ()

    def can_use(self, node: NodeRoom) -> bool:
        # A taint named after an extended resource the pods ask for (GKE's and AKS's
        # `nvidia.com/gpu` on GPU nodes) is tolerated by the pods themselves: the
        # ExtendedResourceToleration admission plugin adds that toleration to them.
        return (node.schedulable
                and all(node.labels.get(k) == v for k, v in self.node_selector.items())
                and all(taint[0] in self.per_pod or tolerates(self.tolerations, taint)
                        for taint in node.taints))


def _place(free: Mapping[str, Mapping[str, int]], nodes: Mapping[str, NodeRoom], waiter: Waiter
           ) -> dict[str, Mapping[str, int]] | None:
    """`free` after placing the waiter's gang first-fit (nodes by name), or None if it does
    not fit. Several of its pods may share a node, as the scheduler allows. `free` is left as it
    was: the answer shares the rooms the gang did not touch with it (a pass asks this of a
    whole cluster's book; copying every node's room each time was most of the cost)."""
    left = dict(free)
    placed = 0
    for name in sorted(left):
        node = nodes.get(name)
        if node is None or not waiter.can_use(node):
            continue
        room = left[name]
        fits = min(max(0, room.get(r, 0)) // n for r, n in waiter.per_pod.items())
        take = min(fits, waiter.pods - placed)
        if take:
            left[name] = {**room, **{r: room.get(r, 0) - n * take
                                     for r, n in waiter.per_pod.items()}}
            placed += take
        if placed >= waiter.pods:
            return left
    return None


def could_fit(waiter: Waiter, nodes: Mapping[str, NodeRoom]) -> bool:
    """Whether the waiter's gang fits the cluster with nothing else running."""
    empty = {name: node.allocatable for name, node in nodes.items()
             if node.schedulable and node.allocatable}
    return _place(empty, nodes, waiter) is not None


def order(waiters: Iterable[Waiter]) -> list[Waiter]:
    return sorted(waiters, key=lambda w: (-w.priority, w.since, w.key))


def grants(waiters: Iterable[Waiter], free: Mapping[str, Mapping[str, int]],
           nodes: Mapping[str, NodeRoom]) -> list[Key]:
    """The waiters the room holds, in queue order, none jumping one that does not fit: what such
    a one could use (its resources, on the nodes it may use) stays for it, and only jobs that
    need none of that (another pool, another resource) go on past it. One that would not fit
    even in an empty cluster (a gang larger than every node it may use, a node selector no
    node matches) holds nobody up: it is skipped, and retries on its timer."""
    left = {name: dict(amounts) for name, amounts in free.items()}
    out = []
    for waiter in order(waiters):
        if not could_fit(waiter, nodes):
            continue
        after = _place(left, nodes, waiter)
        if after is None:
            for name, room in left.items():
                if name in nodes and waiter.can_use(nodes[name]):
                    for resource in waiter.per_pod:
                        room[resource] = 0
            continue
        left = after
        out.append(waiter.key)
    return out


class RoomBook:
    """The operator's picture of the room: nodes (from the node watch), what its own active pods
    ask for (from the pod watch; bound to a node, or not yet), and claims (a pass about to
    create a gang it found room for; gone once its pods show up). Every change bumps
    `version`."""

    def __init__(self):
        self.nodes: dict[str, NodeRoom] = {}
        # uid -> (job, node or None while unbound, asks)
        self.pods: dict[str, tuple[Key, str | None, dict[str, int]]] = {}
        self.claims: dict[Key, dict[str, int]] = {}
        self.version = 0
        self._free: tuple[int, dict[str, dict[str, int]]] = (-1, {})   # (version, free)

    def set_node(self, name: str, room: NodeRoom | None) -> bool:
        """Record a node (None: deleted). True if it now offers room it did not before."""
        before = self.nodes.get(name)
        if room is None:
            self.nodes.pop(name, None)
        else:
            self.nodes[name] = room
        if before != room:
            self.version += 1
        return room is not None and room.schedulable and bool(room.allocatable) and (
            before is None or not before.schedulable
            or any(room.allocatable.get(r, 0) > before.allocatable.get(r, 0)
                   for r in room.allocatable))

    def set_pod(self, uid: str, job: Key, node: str | None, asks: dict[str, int],
                active: bool) -> bool:
        """Record one of the operator's pods. True if it just gave room back."""
        had = uid in self.pods
        if active and asks:
            if self.pods.get(uid) != (job, node, asks):
                self.pods[uid] = (job, node, asks)
                self.version += 1
            return False
        if had:
            del self.pods[uid]
            self.version += 1
        return had

    def sync_job(self, job: Key, uids: Iterable[str]) -> bool:
        """Forget the job's pods not among `uids` (deleted without a last update seen). True if
        that gave room back."""
        keep = set(uids)
        gone = [uid for uid, (owner, _, _) in self.pods.items() if owner == job
                and uid not in keep]
        for uid in gone:
            del self.pods[uid]
        if gone:
            self.version += 1
        return bool(gone)

    def free(self) -> dict[str, dict[str, int]]:
        """Per node: allocatable less what the operator's pods bound there ask for (a copy the
        caller may change)."""
        return {name: dict(room) for name, room in self._bound_free().items()}

    def _bound_free(self) -> Mapping[str, Mapping[str, int]]:
        """`free`, computed once per version of the book and shared: not to be changed. Every
        pass of a job with a gang to place asks; the book changes far less often."""
        version, free = self._free
        if version != self.version:
            free = {name: dict(node.allocatable) for name, node in self.nodes.items()
                    if node.schedulable and node.allocatable}
            for _, node, asks in self.pods.values():
                if node in free:
                    for r, n in asks.items():
                        free[node][r] = free[node].get(r, 0) - n
            self._free = (self.version, free)
        return free

    def free_after_pending(self, exclude: Iterable[Key] = ()) -> dict[str, dict[str, int]]:
        """`free`, less what the operator's unbound pods and the claimed gangs will take (but
        those of the jobs in `exclude`: the waiting jobs, whose whole gangs `grants` places):
        taken from the nodes in name order, resource by resource (where, the scheduler decides;
        the total is what counts)."""
        skip = set(exclude)
        free = self.free()
        taken = [asks for job, node, asks in self.pods.values() if node is None
                 and job not in skip]
        taken += [asks for job, asks in self.claims.items() if job not in skip]
        for asks in taken:
            for resource, amount in asks.items():
                for name in sorted(free):
                    have = free[name].get(resource, 0)
                    if have > 0 and amount > 0:
                        use = min(have, amount)
                        free[name][resource] = have - use
                        amount -= use
        return free

    def room_for(self, gang: Waiter) -> bool:
        """Whether the gang fits now: placed node by node on what bound pods leave, and in
        total on what is left once every unbound pod and every other job's claim is counted
        (they will take room somewhere; where, the scheduler decides)."""
        free = self._bound_free()
        if _place(free, self.nodes, gang) is None:
            return False
        left: dict[str, int] = {}
        for amounts in free.values():
            for r, n in amounts.items():
                left[r] = left.get(r, 0) + n
        taken = [asks for job, node, asks in self.pods.values() if node is None]
        taken += [asks for job, asks in self.claims.items() if job != gang.key]
        for asks in taken:
            for r, n in asks.items():
                left[r] = left.get(r, 0) - n
        return all(left.get(r, 0) >= n * gang.pods for r, n in gang.per_pod.items())

    def claim(self, job: Key, per_pod: Mapping[str, int], pods: int) -> None:
        self.claims[job] = {r: n * pods for r, n in per_pod.items()}
        self.version += 1

    def unclaim(self, job: Key) -> None:
        if self.claims.pop(job, None) is not None:
            self.version += 1


def waiter(key: Key, spec: Mapping, hold: Mapping, obs, pods: int | None = None
           ) -> Waiter | None:
    """The job (its raw spec, its `tracking.capacityHold`) as the waitlist holds it, a gang of
    nodes.min pods (or `pods`); None when it asks for no extended resource (nothing the book can
    count) or its spec does not parse."""
    from pydantic import ValidationError

    from crucible.api.progress import parse_time
    from crucible.api.spec import PretrainJobSpec

    try:
        parsed = PretrainJobSpec.model_validate(spec)
    except ValidationError:
        return None
    asks = extended(parsed.resources)
    since = parse_time(hold.get("since"))
    if not asks or since is None:
        return None
    sched = parsed.scheduling
    name = sched.priority_class_name or obs.default_priority_class
    return Waiter(key=key, since=since, pods=pods or parsed.nodes.min, per_pod=asks,
                  priority=int(obs.priority_values.get(name, 0)) if name else 0,
                  node_selector=dict(sched.node_selector),
                  tolerations=tuple(t.model_dump(by_alias=True, exclude_none=True)
                                    for t in sched.tolerations))
