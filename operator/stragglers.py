"""Stragglers the trainer reports: status, an event, and (when the job asks) the slow pod replaced.

The trainer finds a rank persistently slower than the others (trainer/straggler.py) and lists it
on the progress Lease as rank, host (the pod's name, its hostname) and ratio. Here, pure:
`status.stragglers` shows each with its pod and node; a Warning event `Straggler` marks each one
that appears; with `faultTolerance.stragglers.replaceAfterMinutes` set, one still reported after
that long has its pod force-deleted to be recreated elsewhere (for pod 0, the c10d store host,
the group restarted) and its node avoided by the job (anti-affinity). The node itself is
quarantined like a failed node (cordon, annotate; failure_policy.py) only when the operator's
administrator lets straggler reports cordon it (cluster_policy.py): the report comes from the
tenant's own code, which could name any node its pod was placed on. MegaScale replaces a straggler's machine the same way. It
counts as an infrastructure restart: a slow machine is not the program's fault.
"""

from __future__ import annotations

from crucible.api.progress import format_time, parse_time
from crucible.operator import failures as f
from crucible.operator.failure_policy import avoid, quarantine, replaced
from crucible.operator.observed import PodView
from crucible.operator.outcome import Pass

REASON = "Straggler"


def act(p: Pass, current: dict[int, PodView]) -> bool:
    """Report the stragglers on the Lease; replace those slow too long. True when the group was
    restarted (pod 0 was the straggler)."""
    lease = p.obs.lease
    if lease is None or lease.stragglers is None:
        return False
    by_name = {pod.name: pod for pod in current.values()}

    def about_its_predecessor(host: str) -> bool:
        # A replaced pod keeps its name, and the Lease keeps the old report until the restarted
        # trainer writes one: a report older than the pod is about the pod it replaced. Acting
        # on it would quarantine the healthy node the replacement landed on, and the next one.
        pod = by_name.get(host)
        return (pod is not None and pod.created is not None and lease.step_time is not None
                and lease.step_time < pod.created)

    slow = [{"rank": s.rank, "pod": s.host, "ratio": s.ratio,
             **({"node": by_name[s.host].node} if s.host in by_name and by_name[s.host].node
                else {})} for s in lease.stragglers if not about_its_predecessor(s.host)]
    p.status["stragglers"] = slow
    # Timed per pod UID, not name, for the same reason: a replacement starts its own clock.
    slow_pods = [by_name[e["pod"]] for e in slow if e["pod"] in by_name]
    seen = dict(p.track.get("stragglerSince") or {})
    for entry in slow:
        pod = by_name.get(entry["pod"])
        if pod is not None and pod.uid not in seen:
            seen[pod.uid] = format_time(p.now)
            p.event("Warning", REASON, f"rank {entry['rank']} (pod {entry['pod']}"
                    + (f" on node {entry['node']}" if "node" in entry else "")
                    + f") takes {entry['ratio']:g}x the other ranks' median for its own work")
    p.track["stragglerSince"] = {uid: t for uid, t in seen.items()
                                 if uid in {pod.uid for pod in slow_pods}}
    limit_s = p.spec.fault_tolerance.stragglers.replace_after_minutes * 60
    if not limit_s:
        return False
    for entry in slow:
        pod = by_name.get(entry["pod"])
        if pod is None or not pod.node or pod.terminated or pod.uid in p.handled:
            continue
        since = parse_time(p.track["stragglerSince"][pod.uid])
        left_s = limit_s - (p.now - since).total_seconds()
        if left_s > 0:
            p.wake(left_s)
            continue
        message = (f"rank {entry['rank']} on node {pod.node} took {entry['ratio']:g}x the other "
                   f"ranks' median for over {limit_s / 60:g} min (stragglers.replaceAfterMinutes)")
        node = p.obs.nodes.get(pod.node)
        slow_node = f.NodeFailure(pod.node, REASON, message, since)
        if p.cluster_policy.straggler_may_cordon(node):
            quarantine(p, slow_node, node, event_reason=REASON)
        else:
            # The report is the tenant's code speaking (cluster_policy.py): the job keeps off
            # the node, the node itself is not touched.
            avoid(p, slow_node, node)
            p.event("Warning", REASON, f"{message}: the job avoids node {pod.node} from now on "
                    "(a straggler report cordons only nodes the operator's "
                    "--straggler-cordon-selector names)")
        p.mark_handled(pod.uid)
        failure = f.Failure(REASON, f.INFRASTRUCTURE, f"{message}, under pod {pod.name}",
                            pod.node)
        if pod.index == 0:
            p.bump(REASON, failure.message + "; it hosted the c10d store", failure)
            return True
        replaced(p, failure, pod.index)
        p.act("force_delete", "Pod", pod.name, reason=REASON)
        p.event("Warning", REASON, f"{failure.message}: force-deleted it to recreate it "
                "elsewhere")
    return False
