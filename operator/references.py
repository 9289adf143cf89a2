"""Objects a job names but does not own: the Secrets its pods read, its PriorityClass.

A name that resolves to nothing would leave the job Pending with no word of why: the apiserver
refuses every pod create naming a missing PriorityClass, and the kubelet holds a pod whose env
names a missing Secret in CreateContainerConfigError. Each gets a condition naming the object and
how to fix it, and one event when it appears. The operator sees PriorityClasses itself (an
index; they are cluster-wide and not secret) but holds no right on Secrets, so a missing Secret
is what a pod's kubelet reports (`failures.missing_secret`). Pure.
"""

from __future__ import annotations

from crucible.operator import conditions as c
from crucible.operator import failures as f
from crucible.operator.observed import PodView
from crucible.operator.outcome import Pass


def check(p: Pass, current: dict[int, PodView]) -> bool:
    """Set both conditions; True when no pod can be created now (its PriorityClass is missing)."""
    secrets = sorted({name for pod in current.values() if (name := f.missing_secret(pod))})
    # Resolved only once a pod got past its container's configuration: a pod just created
    # (or none at all, between generations) says nothing either way.
    started = any(pod.phase in ("Running", "Succeeded", "Failed") for pod in current.values())
    if secrets or started:
        _report(p, c.CREDENTIALS_MISSING, "SecretNotFound",
                f"Secret {', '.join(secrets)} named by checkpoint.credentialsSecret or "
                "checkpoint.signingKeySecret does not exist in this namespace: create it (the "
                "pods start once it exists)" if secrets else None, "SecretsFound")
    wanted = p.spec.scheduling.priority_class_name
    missing = (wanted is not None and p.obs.priority_classes is not None
               and wanted not in p.obs.priority_classes)
    _report(p, c.PRIORITY_CLASS_MISSING, "NotFound",
            f"PriorityClass {wanted} named by scheduling.priorityClassName does not exist: "
            "create it or change the field (no pod is created until then)" if missing else None,
            "Found")
    return missing


def _report(p: Pass, type_: str, reason: str, problem: str | None, fine: str) -> None:
    was = c.get(p.conds, type_)
    if problem is not None:
        if not was or was.get("status") != "True":
            p.event("Warning", type_, problem)
        p.cond(type_, True, reason, problem)
    elif was is not None and was.get("status") == "True":
        p.cond(type_, False, fine, "resolved")
