"""Quarantine: how long the operator's own cordon of a failed node lasts, and when it ends.

Owns the life of a cordon the operator set (failure_policy.quarantine sets it; this module says
for how long, and lifts it). A cordon that never ends loses the node for good after any blip
longer than a job's grace (a kubelet restarting for ~100 s, a switch reboot), and on a cluster
that runs for months the pool shrinks to nothing unless a person sweeps it. So, with
`--quarantine-minutes` (the administrator's, chart value `operator.quarantineMinutes`):
- a cordon lasts the quarantine period from the failure (annotation `quarantine-until`);
- once it has passed and the node is healthy (Ready, and the condition that failed it, if any,
  no longer True), the operator uncordons it and puts it on probation for one more period
  (`probation-until`);
- a node that fails again while on probation is cordoned for twice its last period (and so on,
  up to `MAX_PERIOD_S`): a node that keeps failing spends ever longer out of the pool;
- a cordon is lifted only if the operator is still the one that set `spec.unschedulable`
  (the node's managedFields name the field manager of the last write that set it): a person's
  `kubectl cordon`, before or after the operator's, is never undone. An operator cordon that
  someone lifted or took over loses the operator's annotations that claimed it.
Pure: node views and times in, a merge patch out; `handlers.py` runs the check on a timer.
"""

from __future__ import annotations

import datetime as dt

from crucible.api.names import PREFIX
from crucible.api.progress import format_time, parse_time
from crucible.operator.observed import NodeView

FIELD_MANAGER = "crucible-operator"     # the operator's node writes name it (managedFields)
CORDONED_BY = f"{PREFIX}cordoned-by"
UNTIL = f"{PREFIX}quarantine-until"
PROBATION = f"{PREFIX}probation-until"
COUNT = f"{PREFIX}quarantines"          # cordons in a row, each within the last one's probation
FAILURE_REASON = f"{PREFIX}failure-reason"
MAX_PERIOD_S = 7 * 24 * 3600
CHECK_INTERVAL_S = 30.0                 # how often the operator looks for cordons due to end


def cordon_annotations(node: NodeView | None, now: dt.datetime, period_s: float) -> dict:
    """The annotations a new operator cordon carries: until when it lasts (none when the
    period is 0: cordons never expire), and how many it is in a row (doubled per cordon
    within the last release's probation)."""
    if period_s <= 0:
        return {}
    count = 1
    probation = parse_time(node.annotation(PROBATION)) if node is not None else None
    if probation is not None and now < probation:
        count = int(node.annotation(COUNT) or 1) + 1
    length_s = min(period_s * 2 ** (count - 1), MAX_PERIOD_S)
    return {UNTIL: format_time(now + dt.timedelta(seconds=length_s)), COUNT: str(count)}


def healthy(node: NodeView) -> bool:
    """Ready, and the condition that failed it (a `Node<Condition>` failure reason) not True."""
    ready = node.condition("Ready")
    if ready is None or ready.status != "True":
        return False
    reason = node.annotation(FAILURE_REASON) or ""
    if reason.startswith("Node") and reason not in ("NodeNotReady", "NodeUnreachable",
                                                    "NodeDeleted"):
        failed = node.condition(reason[len("Node"):])
        if failed is not None and failed.status == "True":
            return False
    return True


def release(node: NodeView, now: dt.datetime, period_s: float) -> tuple[dict | None, float | None]:
    """The merge patch that ends (or disowns) the operator's cordon of `node`, or None; and in
    how many seconds to look again (None: nothing pending)."""
    if not node.annotation(CORDONED_BY):
        return None, None
    ours = node.unschedulable and node.cordon_manager == FIELD_MANAGER
    if not ours:
        # Lifted by someone (a repair), or the cordon is theirs now: never touch it, and stop
        # claiming it, so that a later cordon of theirs is never taken for ours.
        return {"metadata": {"annotations": {CORDONED_BY: None, UNTIL: None}}}, None
    until = parse_time(node.annotation(UNTIL))
    if until is None or period_s <= 0:
        return None, None                       # cordoned when cordons did not expire
    if now < until:
        return None, (until - now).total_seconds()
    if not healthy(node):
        return None, CHECK_INTERVAL_S           # still broken: stays cordoned, asked again
    count = int(node.annotation(COUNT) or 1)
    probation_s = min(period_s * 2 ** (count - 1), MAX_PERIOD_S)
    return {"spec": {"unschedulable": False},
            "metadata": {"annotations": {
                CORDONED_BY: None, UNTIL: None,
                PROBATION: format_time(now + dt.timedelta(seconds=probation_s))}}}, None
