"""decide(job, observed, now) -> Outcome: the whole reconcile policy as one pure function.

Owns what the operator does, never how: no I/O, no clock, no randomness (the model is JobSet's
`Reconcile`, pkg/controllers/jobset_controller.go in kubernetes-sigs/jobset). A pass rebuilds
everything from the job (spec + status), the indexes and the Lease (level-triggered); what must
outlive the process lives in `status` (counters, `podGeneration`) and `status.tracking` (failures
already handled, goodput accumulators), never in memory.

A whole-group restart is a counter, as in JobSet: the pass that decides it only bumps
`status.podGeneration` (and the counters), with no pod actions; the status patch is the commit
point. The next pass sees the old generation as stale and deletes it, and creates the new one
under new deterministic names `<job>-<generation>-<index>`. Replaying a pass whose status patch
was lost recomputes the same decision from the same status, and creating a pod that exists is a
no-op, so killing the operator anywhere leaves no duplicates and no orphans.

What each failure does (docs/operator.md has the why):
- application failure (exit 1-127) or hang: restart the group; counts against maxRestarts, and
  a run of failures with no step completed in between fails the job early (crash loop);
- infrastructure failure of a pod other than index 0 (deleted, evicted, OOMKilled, signal, node
  failure past nodeFailureGraceSeconds): replace that pod alone; torchrun's elastic rendezvous
  carries on with the others (>= nodes.min) and takes the new pod in, not counted;
- infrastructure failure of pod 0: it hosts the c10d store (manifests.py), so the survivors
  cannot re-rendezvous: restart the group, not counted (judged before anyone's exit code: the
  survivors' exit 1 is the store's loss);
- fewer than nodes.min pods schedulable (a full pool): phase Waiting, PodsScheduled=False
  (InsufficientCapacity); the survivors' exits after the rendezvous timeout restart the group,
  not counted; pod 0 is always created first and the others once it has a node; past
  capacityTimeoutSeconds the job releases its pods and retries later (capacity.py);
- failed node: cordon it (cordonFailedNodes) and annotate it with the job and reason at once;
  keep new pods off it (node anti-affinity); after the grace, force-delete the job's pods there;
- a straggler the trainer reports (status, event); with stragglers.replaceAfterMinutes, one slow
  that long is handled as a failed node (quarantine, replace its pod; pod 0: restart the group),
  not counted;
- pods Terminating past their grace + terminatingTimeoutSeconds: force-delete;
- pods Pending past pendingTimeoutSeconds: image/config errors fail the job, unschedulable
  pods are reported with the scheduler's reason;
- a spec change that reaches the pods: restart the group, not counted.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import replace

from pydantic import ValidationError

from crucible.api.progress import format_time, parse_time
from crucible.api.spec import PretrainJobSpec, explain
from crucible.operator import capacity
from crucible.operator import conditions as c
from crucible.operator import failures as f
from crucible.operator import failure_policy as policy
from crucible.operator import manifests as m
from crucible.operator import progress, queueing, references, stragglers, tenant_limits
from crucible.operator.cluster_policy import ClusterPolicy
from crucible.operator.observed import JobView, Observed, PodView
from crucible.operator.outcome import (FAILED, PENDING, RESTARTING, RUNNING, SUCCEEDED, SUSPENDED,
                                       TERMINAL, WAITING, Action, Event, Outcome, Pass)

__all__ = ["decide", "Outcome", "Action", "Event", "PENDING", "RUNNING", "RESTARTING", "WAITING",
           "SUSPENDED", "SUCCEEDED", "FAILED"]


# --- the pass -------------------------------------------------------------------------------------
def decide(job: JobView, obs: Observed, now: dt.datetime,
           cluster_policy: ClusterPolicy = ClusterPolicy()) -> Outcome:
    # Only what this job controls is its own: a pod or child carrying its labels but another
    # owner (a deleted namesake's, held by a finalizer; someone else's) is never judged,
    # counted, adopted or deleted.
    foreign = tuple(pod for pod in obs.pods if pod.owner_uid != job.uid)
    p = Pass(job, replace(obs, pods=tuple(pod for pod in obs.pods if pod.owner_uid == job.uid)),
             now, cluster_policy)
    if job.deleting:
        return Outcome(status=dict(job.status))  # kopf stops us; garbage collection does the rest
    try:
        p.spec = PretrainJobSpec.model_validate(job.spec)
    except ValidationError as err:
        if p.phase not in TERMINAL:
            p.fail("InvalidSpec", explain(err).replace("\n", "; "))
        return p.outcome()
    if p.phase in TERMINAL:
        _finished(p)
        return p.outcome()
    if not _within_limits(p):
        queueing.finished(p)
        return p.outcome()
    if _name_conflict(p, foreign):
        return p.outcome()
    _ensure_children(p)
    if p.spec.suspend:
        _suspend(p)
    elif p.phase == SUSPENDED:
        _resume(p)
    elif queueing.admitted(p):
        _run(p)
    if p.status.get("phase") in TERMINAL:
        queueing.finished(p)   # in the pass that ends the job: the quota is free at once
    return p.outcome()


def _within_limits(p: Pass) -> bool:
    """The administrator's limits (tenant_limits.py): no pod carries what they refuse. Judged
    when the job is new and whenever what they read changes (`tenant_limits.asked`); a job they
    allowed is not stopped because they were tightened later (a job already running when the
    operator first judges it counts as allowed)."""
    asked = tenant_limits.asked(p.spec, p.job.labels)
    if p.track.get("allowed") == asked:
        return True
    if "allowed" in p.track or p.phase not in (RUNNING, RESTARTING):
        refused = p.cluster_policy.limits.violations(p.spec, p.job.labels)
        if refused:
            p.fail("NotAllowed", "; ".join(refused))
            return False
    p.track["allowed"] = asked
    return True


def _run(p: Pass):
    p.status.update(progress.report(p.obs.lease, p.status))
    progress.note_step(p.track, p.obs.lease, p.now)
    p.track["goodput"] = progress.advance(p.track.get("goodput", {}), p.obs.lease)
    current = {pod.index: pod for pod in p.obs.pods if pod.generation == p.gen}
    _stale(p)
    policy.recount_peer_loss(p)
    if _succeeded(p, current) or capacity.held(p) or capacity.queue_behind(p):
        return
    if stragglers.act(p, current):
        return
    if policy.restart_needed(p, current):
        policy.infrastructure_loop(p)
        return
    if capacity.release_due(p, current):
        return
    if not references.check(p, current):
        policy.replace_and_create(p, current)
    if policy.infrastructure_loop(p) or policy.pending(p, current):
        return
    _phase(p, current)


def _finished(p: Pass):
    p.delete_active(p.obs.pods)
    queueing.finished(p)      # again, should the pass that ended the job have lost its patch
    ttl, done = p.spec.ttl_seconds_after_finished, parse_time(p.status.get("completionTime"))
    if ttl is not None and done is not None:
        left = ttl - (p.now - done).total_seconds()
        if left <= 0:
            p.act("delete_job", "PretrainJob", p.job.name, reason="TTLExpired")
        else:
            p.wake(left)


def _name_conflict(p: Pass, foreign: tuple[PodView, ...]) -> bool:
    """An object this job would create exists under another owner. One on its way out (a
    deleted namesake's, say) is waited for; one that stays is a `NameConflict`, never adopted.
    Either way the pass stops here and looks again in a while: never a hot loop."""
    mine = {m.pod_name(p.job.name, p.gen, i) for i in range(p.spec.nodes.max)}
    clashes = [("Pod", pod.name, pod.deleting) for pod in foreign if pod.name in mine]
    for pod in foreign:
        if pod.name in mine and f.stuck_terminating(pod, p.spec.fault_tolerance, p.now):
            # A deleted namesake's pod that no kubelet will ever end (its node is dead): it
            # would hold this job's names forever.
            p.act("force_delete", "Pod", pod.name, reason="StuckTerminating")
    for child in p.static_children:
        kind, name = child["kind"], child["metadata"]["name"]
        owner = p.obs.child_owner(kind, name)
        if p.obs.has_child(kind, name) and owner != p.job.uid:
            clashes.append((kind, name, False))
        elif (kind, name) in p.obs.conflicts:
            clashes.append((kind, name, False))
            p.act("create", kind, name, child)  # again: succeeds, or meets the conflict again
    if not clashes:
        if c.get(p.conds, c.NAME_CONFLICT):
            p.cond(c.NAME_CONFLICT, False, "Resolved", "no object of this job's names has "
                   "another owner")
        return False
    staying = [(kind, name) for kind, name, leaving in clashes if not leaving]
    if staying:
        kind, name = staying[0]
        message = (f"{kind} {name} exists and belongs to another owner: delete or rename it "
                   "(it is never adopted)")
        was = c.get(p.conds, c.NAME_CONFLICT)
        if not was or was.get("status") != "True":
            p.event("Warning", "NameConflict", message)
        p.cond(c.NAME_CONFLICT, True, "NameConflict", message)
        p.wake(10)
    else:
        p.cond(c.NAME_CONFLICT, False, "WaitingForNamesake", f"{len(clashes)} object(s) of a "
               "deleted namesake still terminating; waiting for them to go")
        p.wake(2)
    return True


def _ensure_children(p: Pass):
    """Create what is missing, replace a drifted ConfigMap or NetworkPolicy."""
    for child in p.static_children:
        kind, name = child["kind"], child["metadata"]["name"]
        if not p.obs.has_child(kind, name):
            p.act("create", kind, name, child)
        elif (kind in ("ConfigMap", "NetworkPolicy")
              and p.obs.child_digest(kind, name) != m.child_digest(child)):
            p.act("replace", kind, name, child, reason="SpecChanged")


def _suspend(p: Pass):
    capacity.forget(p)
    for pod in p.obs.pods:
        p.delete(pod)
    queueing.withdraw(p, "Suspended")
    if p.phase != SUSPENDED:
        p.track["suspendedSince"] = format_time(p.now)
        p.event("Normal", "Suspended", f"suspended: deleting {len(p.obs.pods)} pod(s); the job, "
                "its Lease and its checkpoints stay")
    p.status["phase"] = SUSPENDED
    p.cond(c.SUSPENDED, True, "Suspended", "spec.suspend is true")
    p.cond(c.RUNNING, False, "Suspended", "spec.suspend is true")
    p.status["message"] = f"suspended; {len(p.obs.pods)} pod(s) left to delete"


def _resume(p: Pass):
    since = parse_time(p.track.pop("suspendedSince", None))
    if since is not None:
        p.track["suspendedSeconds"] = round(float(p.track.get("suspendedSeconds", 0.0))
                                            + (p.now - since).total_seconds(), 3)
    p.cond(c.SUSPENDED, False, "Resumed", "spec.suspend is false")
    p.bump("Resumed", "resumed after suspension")
    p.status["phase"] = PENDING


def _stale(p: Pass):
    """Pods of older generations go; the previous generation's finished pods stay for logs."""
    ft = p.spec.fault_tolerance
    for pod in p.obs.pods:
        if pod.generation is None or pod.generation == p.gen:
            continue
        if pod.generation > p.gen:   # from a decision this body does not show yet: wait for it
            p.wake(1)                # (soon, never at once: a stale body must not spin the loop)
            continue
        if pod.terminated and pod.generation == p.gen - 1 and not pod.deleting:
            continue
        dead = p.node_broken(pod.node)
        if dead and dead.age_s(p.now) >= ft.node_failure_grace_seconds:
            p.act("force_delete", "Pod", pod.name, reason=dead.reason)
        else:
            p.delete(pod)


def _succeeded(p: Pass, current: dict[int, PodView]) -> bool:
    done = [pod for pod in current.values() if pod.phase == "Succeeded"]
    if not done:
        return False
    p.status["phase"] = SUCCEEDED
    p.status["completionTime"] = format_time(p.now)
    step = p.status.get("step")
    message = f"pod {done[0].name} exited 0: training complete"
    message += f" at step {step}" if step else ""
    p.cond(c.SUCCEEDED, True, "TrainingComplete", message)
    p.cond(c.RUNNING, False, "TrainingComplete", message)
    p.cond(c.RESTARTING, False, "TrainingComplete", message)
    p.event("Normal", "Succeeded", message)
    p.status["message"] = message
    p.delete_active(current.values())
    return True


def _phase(p: Pass, current: dict[int, PodView]):
    ft, spec, lease = p.spec.fault_tolerance, p.spec, p.obs.lease
    healthy = [pod for pod in current.values() if pod.phase == "Running" and not pod.deleting
               and not p.node_broken(pod.node)]
    pending = sum(1 for pod in current.values() if pod.phase == "Pending")
    counts = {"desired": p.width, "running": len(healthy), "pending": pending,
              "failed": sum(1 for pod in current.values() if pod.phase == "Failed"),
              "lost": sum(1 for pod in current.values()
                          if pod.phase == "Running" and p.node_broken(pod.node))}
    p.status["pods"] = counts
    summary = f"{len(healthy)}/{p.width} pods running (min {spec.nodes.min})"
    if len(healthy) >= spec.nodes.min:
        if p.phase != RUNNING:
            p.event("Normal", "Running", f"{summary}, generation {p.gen}")
        p.status["phase"] = RUNNING
        p.track["everRunning"] = True
        p.cond(c.RUNNING, True, "PodsRunning", summary)
        p.cond(c.RESTARTING, False, "PodsRunning", summary)
    elif capacity.short_of_capacity(p, current):
        p.status["phase"] = WAITING
        p.cond(c.RUNNING, False, "InsufficientCapacity", summary)
    else:
        p.status["phase"] = RESTARTING if p.track.get("everRunning") else PENDING
        p.cond(c.RUNNING, False, "NotEnoughPods", summary)
    if not p.degraded:  # a node failure in its grace period already said why
        running = p.status["phase"] == RUNNING
        fewer = running and len(healthy) < p.width
        p.cond(c.DEGRADED, fewer, "FewerPods" if fewer else
               ("AllPodsHealthy" if running else p.status["phase"]), summary)
    stepped = parse_time(p.track.get("stepSeenAt"))
    if lease is not None and lease.step_time is not None and stepped is not None:
        age = (p.now - stepped).total_seconds()  # the operator's clock, as the hang check's
        ok = age < ft.hang_timeout_seconds
        p.cond(c.PROGRESSING, ok, "StepAdvancing" if ok else "NoProgress",
               f"step {lease.step} at {format_time(lease.step_time)}")
    elif not c.get(p.conds, c.PROGRESSING):
        p.cond(c.PROGRESSING, None, "NoProgressReport", "the trainer has not reported a step yet")
    step = p.status.get("step")
    p.status["message"] = f"{p.status['phase']}: {summary}" + (f", step {step}" if step else "")
