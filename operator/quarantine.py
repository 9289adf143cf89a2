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
  (the node's managedFields name the field manager of the last write that set it, and the
  node still carries the operator's `cordoned-by`): a person's `kubectl cordon` of a node the
  operator had not cordoned is never undone, nor one made after someone lifted the operator's.
  An operator cordon that someone lifted or took over loses the operator's annotations.
  One case the API cannot show: `kubectl cordon` (and `drain`) of a node the operator has
  already cordoned sends nothing, so the cordon stays the operator's and ends with its
  quarantine. To keep such a node out, remove the claim: `kubectl annotate node NAME
  crucible.dev/cordoned-by-` (the cordon is then the person's, and the operator leaves it).
- cordons an earlier version made carry the `kubernetes` client's default field manager
  (`OpenAPI-Generator`) and no `quarantine-until`: with the operator's `cordoned-by` on the
  node they are the operator's too, and last one period from their `failure-time`.
Pure: node views and times in, a merge patch out; `handlers.py` runs the check on a timer.
"""

from __future__ import annotations

import datetime as dt

from crucible.api.names import PREFIX
from crucible.api.progress import format_time, parse_time
from crucible.operator.manifests import FIELD_MANAGER
from crucible.operator.observed import NodeView

# The manager an earlier version's cordons carry: the python client's user agent, unnamed.
LEGACY_MANAGER = "OpenAPI-Generator"
FAILURE_TIME = f"{PREFIX}failure-time"
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
        count = _count(node) + 1
    length_s = min(period_s * 2 ** (count - 1), MAX_PERIOD_S)
    return {UNTIL: format_time(now + dt.timedelta(seconds=length_s)), COUNT: str(count)}


def _count(node: NodeView) -> int:
    """The `quarantines` annotation (1 when absent, or not a number: anyone may write it)."""
    try:
        return max(1, min(int(node.annotation(COUNT) or 1), 64))
    except ValueError:
        return 1


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
    legacy = node.cordon_manager == LEGACY_MANAGER and not node.annotation(UNTIL)
    ours = node.unschedulable and (node.cordon_manager == FIELD_MANAGER or legacy)
    version = {"resourceVersion": node.resource_version} if node.resource_version else {}
    if not ours:
        # Lifted by someone (a repair), or the cordon is theirs now: never touch it, and stop
        # claiming it, so that a later cordon of theirs is never taken for ours.
        return {"metadata": {**version, "annotations": {CORDONED_BY: None, UNTIL: None}}}, None
    if period_s <= 0:
        return None, None                       # cordons do not expire
    until = parse_time(node.annotation(UNTIL))
    if until is None:
        failed = parse_time(node.annotation(FAILURE_TIME))
        if failed is None:
            return None, None
        until = failed + dt.timedelta(seconds=period_s)
    if now < until:
        return None, (until - now).total_seconds()
    if not healthy(node):
        return None, CHECK_INTERVAL_S           # still broken: stays cordoned, asked again
    probation_s = min(period_s * 2 ** (_count(node) - 1), MAX_PERIOD_S)
    return {"spec": {"unschedulable": False},
            "metadata": {**version, "annotations": {
                CORDONED_BY: None, UNTIL: None,
                PROBATION: format_time(now + dt.timedelta(seconds=probation_s))}}}, None
