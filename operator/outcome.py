"""A reconcile pass's `Outcome` (actions, one status, events) and the `Pass` that builds it.

Owns the bookkeeping every policy shares: recording actions and events, setting conditions,
counting restarts by cause, bumping the pod generation, failing the job, and freezing it all into
an `Outcome` with one status. Pure: the pass's "now" is given. `decision.py` and `failure_policy.py`
write into a `Pass`; `kube.py` carries out the `Outcome`.
"""

from __future__ import annotations

import copy
import datetime as dt
import functools
from dataclasses import dataclass, field

from crucible.api.progress import format_time, parse_time
from crucible.api.spec import PretrainJobSpec
from crucible.operator import conditions as c
from crucible.operator import failures as f
from crucible.operator import manifests as m
from crucible.operator import progress
from crucible.operator.cluster_policy import ClusterPolicy
from crucible.operator.observed import JobView, Observed, PodView

PENDING, RUNNING, RESTARTING, WAITING, QUEUED, SUSPENDED, SUCCEEDED, FAILED = (
    "Pending", "Running", "Restarting", "Waiting", "Queued", "Suspended", "Succeeded", "Failed")
TERMINAL = (SUCCEEDED, FAILED)
MAX_HANDLED = 64       # failed pod instances remembered (by uid) beyond 2 x nodes.max


@dataclass(frozen=True)
class Action:
    verb: str                 # create, replace, delete, force_delete, patch_node, delete_job,
    #                           patch_status (a Workload's: release its quota, or finish it)
    kind: str
    name: str
    body: dict | None = None  # manifest (create, replace) or merge patch (patch_node)
    reason: str = ""
    # (kind, name) of an object this pass writes that must be in place first: the action is
    # carried out only if that create (or replace) landed in this very pass, else it is held
    # for a later pass (kube.Kube.apply)
    after: tuple[str, str] | None = None


@dataclass(frozen=True)
class Event:
    type: str                 # Normal or Warning
    reason: str
    message: str


@dataclass(frozen=True)
class Outcome:
    actions: tuple[Action, ...] = ()
    status: dict = field(default_factory=dict)
    events: tuple[Event, ...] = ()
    requeue: bool = False     # decided something status-only: run the next pass right away
    wake_in_s: float | None = None         # a time-based decision falls due then (grace, hang)
    restarts: tuple[f.Failure, ...] = ()   # for the operator's metrics


class Pass:
    """Accumulates one pass's decisions; `outcome()` freezes them."""

    def __init__(self, job: JobView, obs: Observed, now: dt.datetime,
                 cluster_policy: ClusterPolicy = ClusterPolicy()):
        self.job, self.obs, self.now, self.cluster_policy = job, obs, now, cluster_policy
        self.prev = job.status
        self.status = copy.deepcopy(dict(job.status))
        self.track = self.status.pop("tracking", None) or {}
        self.conds: list[dict] = list(self.status.get("conditions") or [])
        self.gen = int(self.status.get("podGeneration") or 0)
        self.actions: list[Action] = []
        self.events: list[Event] = []
        self.restarts: list[f.Failure] = []
        self.requeue = False
        self.wake_in_s: float | None = None
        self.degraded = False
        self.spec: PretrainJobSpec | None = None
        # Kueue's admission of this pass's pods (queueing.Admission); None: not queued.
        self.admission = None

    @property
    def width(self) -> int:
        """Pods of a generation: nodes.max, or as many as Kueue admitted (nodes.min..max)."""
        return self.admission.count if self.admission is not None else self.spec.nodes.max

    # -- recording ----------------------------------------------------------------------------
    def act(self, verb: str, kind: str, name: str, body: dict | None = None, reason: str = "",
            after: tuple[str, str] | None = None):
        self.actions.append(Action(verb, kind, name, body, reason, after))

    def writes(self, kind: str, name: str) -> bool:
        """Whether this pass has decided to create or replace that object."""
        return any(a.verb in ("create", "replace") and a.kind == kind and a.name == name
                   for a in self.actions)

    def event(self, type_: str, reason: str, message: str):
        self.events.append(Event(type_, reason, message))

    def cond(self, type_: str, status: bool | None, reason: str, message: str = ""):
        self.conds = c.set_condition(self.conds, type_, status, reason, message, self.now,
                                     self.job.generation)

    def wake(self, seconds: float):
        seconds = max(0.0, seconds)
        self.wake_in_s = seconds if self.wake_in_s is None else min(self.wake_in_s, seconds)

    def node_broken(self, name: str | None) -> f.NodeFailure | None:
        """The failure of a pod's node; None when healthy or not known to the snapshot (an
        index still filling must never read as "node deleted")."""
        if not name or name not in self.obs.nodes:
            return None
        return f.node_failure(name, self.obs.nodes[name], self.spec.fault_tolerance,
                              self.cluster_policy.allowed_conditions)

    @functools.cached_property
    def static_children(self) -> list[dict]:
        """The job's once-per-job children as this pass wants them: rendered once per pass,
        though both the name-conflict check and the creation read them."""
        return m.static_children(self.job.name, self.job.namespace, self.job.uid, self.spec,
                                 self.cluster_policy.metrics_from,
                                 self.cluster_policy.instance_metadata)

    @property
    def phase(self) -> str | None:
        return self.prev.get("phase")

    @property
    def handled(self) -> list[str]:
        return self.track.setdefault("handled", [])

    def mark_handled(self, uid: str):
        if uid not in self.handled:
            self.handled.append(uid)
        limit = MAX_HANDLED + 2 * (self.spec.nodes.max if self.spec else 1)
        del self.handled[:-limit]

    def count(self, failure: f.Failure):
        r = self.status.setdefault("restarts", {})
        r["total"] = r.get("total", 0) + 1
        r[failure.kind] = r.get(failure.kind, 0) + 1
        by = r.setdefault("byCause", {})
        by[failure.cause] = by.get(failure.cause, 0) + 1
        self.restarts.append(failure)
        self.lose_work()

    def recount(self, was: f.Failure, now: f.Failure) -> bool:
        """A restart counted as `was` turns out to have been `now`: moved between kinds and
        causes (no new restart, no work lost again). False when there is no such count."""
        r = self.status.setdefault("restarts", {})
        by = r.setdefault("byCause", {})
        if r.get(was.kind, 0) < 1 or by.get(was.cause, 0) < 1:
            return False
        r[was.kind] -= 1
        by[was.cause] -= 1
        if not by[was.cause]:
            del by[was.cause]
        r[now.kind] = r.get(now.kind, 0) + 1
        by[now.cause] = by.get(now.cause, 0) + 1
        return True

    def lose_work(self):
        """Every restart sends the trainer back to its last committed checkpoint."""
        self.track["lastDisruption"] = format_time(self.now)
        ckpt = (self.obs.lease.checkpoint_step if self.obs.lease else None)
        if ckpt is None:
            ckpt = (self.status.get("lastCheckpoint") or {}).get("step")
        self.track["goodput"], _ = progress.lose_uncheckpointed(self.track.get("goodput", {}), ckpt)

    # -- outcomes -----------------------------------------------------------------------------
    def bump(self, reason: str, message: str, failure: f.Failure | None = None):
        """Restart the group: new generation now, pod actions on the next pass."""
        self.new_generation(failure)
        self.status["phase"] = RESTARTING if self.track.get("everRunning") else PENDING
        self.cond(c.RESTARTING, True, reason, message)
        self.cond(c.RUNNING, False, reason, message)
        self.event("Warning" if failure else "Normal", reason,
                   f"{message}; restarting the group as generation {self.gen}")
        self.requeue = True

    def new_generation(self, failure: f.Failure | None = None):
        """The current pods become stale (the next pass deletes them), counted or not."""
        self.gen += 1
        self.status["podGeneration"] = self.gen
        if failure is not None:
            self.count(failure)
        else:
            self.lose_work()
        self.track["members"] = {}

    def fail(self, reason: str, message: str):
        self.status["phase"] = FAILED
        self.status["completionTime"] = format_time(self.now)
        self.status["message"] = f"{FAILED}: {reason}: {message}"
        self.cond(c.FAILED, True, reason, message)
        self.cond(c.RUNNING, False, reason, message)
        self.cond(c.RESTARTING, False, reason, message)
        self.event("Warning", reason, f"job failed: {message}")
        # A failed job creates nothing, whatever this pass decided before it failed it.
        self.actions = [a for a in self.actions if not (a.verb == "create" and a.kind == "Pod")]
        self.delete_active(self.obs.pods)

    def delete_active(self, pods):
        for pod in pods:
            if not pod.terminated:
                self.delete(pod)

    def delete(self, pod: PodView):
        if not pod.deleting:
            self.act("delete", "Pod", pod.name)
        elif self.spec and f.stuck_terminating(pod, self.spec.fault_tolerance, self.now):
            self.act("force_delete", "Pod", pod.name, reason="StuckTerminating")

    def outcome(self) -> Outcome:
        self.status["conditions"] = self.conds
        self.status["observedGeneration"] = self.job.generation
        self.status.setdefault("podGeneration", self.gen)
        r = self.status.setdefault("restarts", {})
        for key in ("total", "application", "infrastructure"):
            r.setdefault(key, 0)
        r.setdefault("byCause", {})
        start = parse_time(self.status.get("startTime"))
        value = progress.goodput(self.track.get("goodput", {}), start,
                                 float(self.track.get("suspendedSeconds", 0.0)), self.now)
        if value is not None:
            self.status["goodput"] = value
        self.status["tracking"] = self.track
        return Outcome(tuple(self.actions), self.status, tuple(self.events), self.requeue,
                    self.wake_in_s, tuple(self.restarts))


