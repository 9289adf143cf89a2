"""Kubernetes-style status conditions (type, status, reason, message, lastTransitionTime).

Owns the one rule that makes conditions useful: `lastTransitionTime` changes only when `status`
does (k8s.io/apimachinery `meta.SetStatusCondition` behaves the same), so "Running since" and
"Restarting since" can be read off the object. Pure; the time is passed in.
"""

from __future__ import annotations

import datetime as dt

from crucible.api.progress import format_time, parse_time

RUNNING = "Running"
RESTARTING = "Restarting"
SUSPENDED = "Suspended"
SUCCEEDED = "Succeeded"
FAILED = "Failed"
PROGRESSING = "Progressing"
PODS_SCHEDULED = "PodsScheduled"
DEGRADED = "Degraded"
NAME_CONFLICT = "NameConflict"
CREDENTIALS_MISSING = "CredentialsMissing"
PRIORITY_CLASS_MISSING = "PriorityClassMissing"
ADMITTED = "Admitted"   # by Kueue: only on jobs with the kueue.x-k8s.io/queue-name label
ORDER = [ADMITTED, RUNNING, RESTARTING, SUSPENDED, SUCCEEDED, FAILED, PROGRESSING, PODS_SCHEDULED,
         DEGRADED, NAME_CONFLICT, CREDENTIALS_MISSING, PRIORITY_CLASS_MISSING]


def set_condition(conditions: list[dict], type_: str, status: bool | None, reason: str,
                  message: str, now: dt.datetime, generation: int) -> list[dict]:
    """A new list with `type_` set; status None means Unknown."""
    value = "Unknown" if status is None else ("True" if status else "False")
    old = next((c for c in conditions if c.get("type") == type_), None)
    unchanged = old and old.get("status") == value
    since = old.get("lastTransitionTime") if unchanged else format_time(now)
    new = {"type": type_, "status": value, "reason": reason, "message": message[:1024],
           "lastTransitionTime": since, "observedGeneration": generation}
    rest = [c for c in conditions if c.get("type") != type_]
    return sorted(rest + [new], key=lambda c: ORDER.index(c["type"]) if c["type"] in ORDER else 99)


def get(conditions: list[dict], type_: str) -> dict | None:
    return next((c for c in conditions if c.get("type") == type_), None)


def is_true(conditions: list[dict], type_: str) -> bool:
    found = get(conditions, type_)
    return bool(found and found.get("status") == "True")


def true_since(conditions: list[dict], type_: str):
    """When `type_` last became True (None unless it is True now)."""
    found = get(conditions, type_)
    if not found or found.get("status") != "True":
        return None
    return parse_time(found.get("lastTransitionTime"))
