"""Capacity: a generation that cannot gather nodes.min pods, and a job that waits for GPUs.

Owns the one question a full pool asks: is this generation short of capacity (fewer than
nodes.min pods can be scheduled), and if it stays so, when does the job let go of what it holds?

A gang that holds some GPUs while it waits for the rest blocks every other job that could use
them, and two such jobs can wait on each other forever (the partial-gang deadlock that Volcano's
and Kueue's all-or-nothing admission exist to prevent). So a generation short of capacity for
`capacityTimeoutSeconds` releases its pods: phase Waiting, no pods, a retry after
`capacityRetrySeconds`, doubled after each retry that is still short (up to `RETRY_CAP_S`), or
as soon as the operator grants it room (waitlist.py: the job waiting longest first, and only as
many as the room holds; a job it sees no room for waits up to RETRY_CAP_S, not its backoff, so
that it does not gather part of a gang to let go of it again). A retry that is short again releases
after `capacityRetrySeconds`. The timeout is long by default because a Pending pod is also what
asks a cluster autoscaler for a node: releasing too early withdraws the request. None of this
counts as a restart of either kind. State lives in `status.tracking`; pure.
"""

from __future__ import annotations

import datetime as dt
import zlib

from crucible.api.progress import format_time, parse_time
from crucible.operator import conditions as c
from crucible.operator.observed import PodView
from crucible.operator.outcome import WAITING, Pass

RETRY_CAP_S = 3600       # the longest wait between retries
QUEUED = "QueuedForCapacity"   # a new job's hold: it never had pods to release
IN_LINE_SINCE = "capacityQueuedSince"   # tracking: when the job first joined the waitlist
JITTER = 0.25            # up to +25%, fixed per job: jobs released together retry apart
# tracking: the wait for capacity, which ends with the run it was for (`forget`)
WAIT_KEYS = ("capacityShort", "capacityWaitSince", "capacityRetries", IN_LINE_SINCE,
             "capacityHold")


def short_of_capacity(p: Pass, current: dict[int, PodView]) -> str | None:
    """Why this generation has not been able to gather nodes.min pods, or None; remembered in
    `tracking` from the first pass that sees the shortage until nodes.min pods are bound to
    healthy nodes at once (none of them ended). Remembered, not just observed: when the
    survivors exit, their nodes free up and the pod that waited for one is scheduled at once,
    so the pass that sees the exits may see no unschedulable pod any more. Forgotten as soon as
    nodes.min pods hold a node together: the rendezvous can complete from then on, and a crash
    after it is the program's (remembered longer, a crash loop in a pool that was short once
    would read as a capacity wait forever, and a capacity wait never counts)."""
    bound = sum(1 for pod in current.values() if pod.node and not pod.terminated
                and not pod.deleting and not p.node_broken(pod.node))
    if bound >= p.spec.nodes.min:
        forget(p)
        return None
    now = capacity_shortage(p, current)
    if now:
        p.track["capacityShort"] = {"generation": p.gen, "reason": now}
        p.track.setdefault("capacityWaitSince", format_time(p.now))
        return now
    remembered = p.track.get("capacityShort") or {}
    if remembered.get("generation") != p.gen:
        p.track.pop("capacityShort", None)
        return None
    return remembered.get("reason")


def forget(p: Pass) -> None:
    """The job stops waiting for capacity: it has its pods, or it is suspended. A resumed job
    that is short again waits its own timeout and joins the line at its end: a place kept from
    a day ago would put it ahead of jobs that have been waiting since. (A restart does not end
    the wait: survivors giving up on a rendezvous that cannot complete restart the group, and
    the wait must go on across those restarts to its release.)"""
    for key in WAIT_KEYS:
        p.track.pop(key, None)


def capacity_shortage(p: Pass, current: dict[int, PodView]) -> str | None:
    """Why the generation cannot gather nodes.min pods right now, or None: some pod of it is
    unschedulable and fewer than nodes.min of them have a node (pod 0 not yet bound counts as
    no capacity at all, since the others are created only once it is)."""
    unschedulable = [pod for pod in current.values() if pod.unschedulable and not pod.node
                     and not pod.deleting]
    placed = sum(1 for pod in current.values() if pod.node)
    if not unschedulable or placed >= p.spec.nodes.min:
        return None
    return (f"only {placed} of nodes.min={p.spec.nodes.min} pods can be scheduled "
            f"({unschedulable[0].name}: {unschedulable[0].unschedulable})")


def retry_delay_s(base_s: float, releases: int, uid: str) -> float:
    """The wait after the `releases`-th release (1, 2, ...): base, doubled each time, capped,
    plus a jitter fixed by the job's UID (deterministic, so a replayed pass decides the same)."""
    spread = 1 + JITTER * (zlib.crc32(uid.encode()) % 1000) / 1000
    return min(base_s * 2 ** (releases - 1), RETRY_CAP_S) * spread


def release_due(p: Pass, current: dict[int, PodView]) -> bool:
    """Release the generation's pods when it has been short of capacity for its window: the
    first time `capacityTimeoutSeconds`, on a retry `capacityRetrySeconds`. True if it did."""
    short = short_of_capacity(p, current)
    since = parse_time(p.track.get("capacityWaitSince"))
    if not short or since is None:
        return False
    ft = p.spec.fault_tolerance
    releases = int(p.track.get("capacityRetries", 0))
    window = ft.capacity_retry_seconds if releases else ft.capacity_timeout_seconds
    waited = (p.now - since).total_seconds()
    if waited < window:
        p.wake(window - waited)
        return False
    releases += 1
    until = p.now + dt.timedelta(seconds=retry_delay_s(ft.capacity_retry_seconds, releases,
                                                       p.job.uid))
    # Its place in line is where it first joined it: a grant that lost the race for the room
    # (to pods the operator does not see, or a replacement it could not foresee) must not
    # send it to the back, or it can be passed over for ever.
    since = p.track.setdefault(IN_LINE_SINCE, format_time(p.now))
    held = sum(1 for pod in current.values() if not pod.terminated)
    message = (f"{short} for {waited:.0f}s: released the {held} pod(s) it held; trying again "
               f"once there is room for it (oldest waiting job first), or at {format_time(until)}")
    p.new_generation()  # the old pods are stale now: the next pass deletes them
    p.track["capacityRetries"] = releases
    p.track["capacityHold"] = {"since": since, "released": format_time(p.now),
                               "until": format_time(until), "reason": short}
    p.track.pop("capacityWaitSince", None)
    p.event("Warning", "CapacityReleased", message)
    _waiting(p, message)
    p.requeue = True
    return True


def queue_behind(p: Pass) -> bool:
    """A new job (no pod yet) that jobs on the waitlist are ahead of (`obs.queued_behind`) joins
    the list's end instead of creating pods: it waits as a released job does, and is granted
    room in its turn (or tries at its retry time, as they do). True if it waits."""
    ahead = p.obs.queued_behind
    if (not ahead or p.gen != 0 or p.obs.pods or "startTime" in p.status
            or p.track.get("capacityHold")):
        return False
    until = p.now + dt.timedelta(seconds=retry_delay_s(
        p.spec.fault_tolerance.capacity_retry_seconds, 1, p.job.uid))
    p.track[IN_LINE_SINCE] = format_time(p.now)
    p.track["capacityHold"] = {"since": format_time(p.now), "released": format_time(p.now),
                               "until": format_time(until), "reason": ahead, "queued": True}
    message = (f"{ahead}: it makes no pod and waits its turn for room (higher priority, then "
               "longer waiting, first)")
    p.event("Normal", "CapacityQueued", message)
    _waiting(p, message, reason=QUEUED)
    p.requeue = True
    return True


def held(p: Pass) -> bool:
    """While the job has released its pods: True (the pass creates nothing) until the operator
    grants it room (`obs.capacity_granted`, waitlist.py: oldest first, as many as fit), or,
    for a job the operator cannot account, until its retry is due. A job the operator sees no
    room for is not sent after the timer alone (it would gather part of a gang and let go
    again) unless it has waited RETRY_CAP_S since this release: the operator does not see
    every pod. (`since`, the place in line, may be older: a job keeps it across releases.)"""
    hold = p.track.get("capacityHold")
    if not hold:
        return False
    until = parse_time(hold.get("until"))
    since = parse_time(hold.get("released") or hold.get("since"))
    granted = p.obs.capacity_granted
    due = until is None or p.now >= until
    waited = (p.now - since).total_seconds() if since is not None else float("inf")
    if granted is False and due and waited < RETRY_CAP_S:
        due = False
    if granted or due:
        p.track.pop("capacityHold")
        p.track["capacityWaitSince"] = format_time(p.now)  # the retry's own window starts
        p.event("Normal", "CapacityRetry", "trying again for capacity: " + (
            "there is room for it now, and no job waiting longer needs it first" if granted
            else "the wait is over"))
        return False
    latest = (since + dt.timedelta(seconds=RETRY_CAP_S) if granted is False and since is not None
              else until)
    what = (f"queued for room ({hold.get('reason')})" if hold.get("queued")
            else f"released its pods ({hold.get('reason')})")
    _waiting(p, f"{what}; trying again once there is room for it, at the latest at "
             f"{format_time(latest)}", reason=QUEUED if hold.get("queued") else "CapacityReleased")
    p.wake(max((latest - p.now).total_seconds(), 1.0))
    return True


def _waiting(p: Pass, message: str, reason: str = "CapacityReleased") -> None:
    p.status["phase"] = WAITING
    p.status["pods"] = {"desired": p.spec.nodes.max, "running": 0, "pending": 0, "failed": 0,
                        "lost": 0}
    p.cond(c.PODS_SCHEDULED, False, "InsufficientCapacity", message)
    p.cond(c.RUNNING, False, reason, message)
    p.cond(c.RESTARTING, False, reason, message)
    p.status["message"] = f"{WAITING}: {message}"
