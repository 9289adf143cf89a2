"""Stragglers the trainer reports: status, an event, and (when the job asks) the slow pod replaced.

The trainer finds a rank persistently slower than the others (trainer/straggler.py) and lists it
on the progress Lease as rank, host (the pod's name, its hostname) and ratio. Here, pure:
`status.stragglers` shows each with its pod and node; a Warning event `Straggler` marks each one
that appears; with `faultTolerance.stragglers.replaceAfterMinutes` set, one still reported after
that long has its node quarantined as a failed node is (cordon, annotate, anti-affinity;
failure_policy.py) and its pod force-deleted to be recreated elsewhere, or, for pod 0 (the c10d
store host), the group restarted. MegaScale replaces a straggler's machine the same way. It
counts as an infrastructure restart: a slow machine is not the program's fault.
"""

from __future__ import annotations

from crucible.api.progress import format_time, parse_time
from crucible.operator import failures as f
from crucible.operator.failure_policy import quarantine
from crucible.operator.observed import PodView
from crucible.operator.outcome import Pass

REASON = "Straggler"


def act(p: Pass, current: dict[int, PodView]) -> bool:
    """Report the stragglers on the Lease; replace those slow too long. True when the group was
    restarted (pod 0 was the straggler)."""
    reported = p.obs.lease.stragglers if p.obs.lease else None
    if reported is None:
        return False
    by_name = {pod.name: pod for pod in current.values()}
    slow = [{"rank": s.rank, "pod": s.host, "ratio": s.ratio,
             **({"node": by_name[s.host].node} if s.host in by_name and by_name[s.host].node
                else {})} for s in reported]
    p.status["stragglers"] = slow
    seen = dict(p.track.get("stragglerSince") or {})
    for entry in slow:
        if entry["pod"] not in seen:
            seen[entry["pod"]] = format_time(p.now)
            p.event("Warning", REASON, f"rank {entry['rank']} (pod {entry['pod']}"
                    + (f" on node {entry['node']}" if "node" in entry else "")
                    + f") takes {entry['ratio']:g}x the other ranks' median for its own work")
    p.track["stragglerSince"] = {pod: t for pod, t in seen.items()
                                 if pod in {e["pod"] for e in slow}}
    limit_s = p.spec.fault_tolerance.stragglers.replace_after_minutes * 60
    if not limit_s:
        return False
    for entry in slow:
        pod = by_name.get(entry["pod"])
        if pod is None or not pod.node or pod.terminated or pod.uid in p.handled:
            continue
        since = parse_time(p.track["stragglerSince"][entry["pod"]])
        left_s = limit_s - (p.now - since).total_seconds()
        if left_s > 0:
            p.wake(left_s)
            continue
        message = (f"rank {entry['rank']} on node {pod.node} took {entry['ratio']:g}x the other "
                   f"ranks' median for over {limit_s / 60:g} min (stragglers.replaceAfterMinutes)")
        quarantine(p, f.NodeFailure(pod.node, REASON, message, since),
                   p.obs.nodes.get(pod.node), event_reason=REASON)
        p.mark_handled(pod.uid)
        failure = f.Failure(REASON, f.INFRASTRUCTURE, f"{message}, under pod {pod.name}")
        if pod.index == 0:
            p.bump(REASON, failure.message + "; it hosted the c10d store", failure)
            return True
        p.count(failure)
        p.act("force_delete", "Pod", pod.name, reason=REASON)
        p.event("Warning", REASON, f"{failure.message}: force-deleted it to recreate it "
                "elsewhere")
    return False
