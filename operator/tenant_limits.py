"""What a job may ask of the nodes it shares, as the cluster's administrator bounds it.

A PretrainJob's `scheduling` and sizes reach every tenant: a priority class decides whom the
scheduler preempts (`system-node-critical` outranks everything), a toleration lets pods onto
nodes tainted for someone else (the control plane, a reserved pool), a nodeSelector aims them
at chosen nodes, and scratch and /dev/shm sizes are node disk and memory. The operator's
settings bound each (`crucible-operator run --allowed-priority-classes`,
`--allowed-toleration-keys`, `--allowed-node-selector-keys`, `--max-scratch-size`,
`--max-shm-size`; the chart's `operator.tenantLimits`); unset, anything goes, as before.

A job that asks for more fails (`NotAllowed`, the message says what and what is allowed)
before any pod is made; one edited past the limits while running fails too, since its next pods
would carry the edit. A job the limits allowed is not judged again until what they read
changes (`asked`: its scheduling, sizes and Kueue priority label): an administrator tightening
them stops no running job (the chart's admission policy, too, checks only creates and such
changes). Pure: the spec in, the violations out.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal

from kubernetes.utils.quantity import parse_quantity

from crucible.api.spec import PretrainJobSpec

# Kueue's label naming a WorkloadPriorityClass: it sets the job's Workload's priority (queue
# order and preemption within a cohort) as priorityClassName sets the pods', so it is bounded
# by the same list.
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"


@dataclass(frozen=True)
class TenantLimits:
    """None everywhere: no limit (the default)."""

    priority_classes: frozenset[str] | None = None
    toleration_keys: frozenset[str] | None = None
    node_selector_keys: frozenset[str] | None = None
    max_scratch: str | None = None     # a Kubernetes quantity, e.g. 200Gi
    max_shm: str | None = None

    @classmethod
    def from_settings(cls, priority_classes: str = "", toleration_keys: str = "",
                      node_selector_keys: str = "", max_scratch: str = "",
                      max_shm: str = "") -> "TenantLimits":
        """Comma-separated names ("" or "*": any); sizes as quantities ("": no limit).
        ValueError says which setting is wrong."""
        for flag, size in (("--max-scratch-size", max_scratch), ("--max-shm-size", max_shm)):
            if size.strip() and _bytes(size.strip(), flag) <= 0:
                raise ValueError(f"{flag}: {size.strip()!r} allows nothing; give a size above "
                                 "0 (e.g. 200Gi), or leave it out for no limit")
        return cls(_names(priority_classes), _names(toleration_keys),
                   _names(node_selector_keys), max_scratch.strip() or None,
                   max_shm.strip() or None)

    def violations(self, spec: PretrainJobSpec,
                   labels: Mapping[str, str] | None = None) -> list[str]:
        """What `spec` (and the job's `labels`) ask for beyond these limits, one sentence
        each."""
        s, out, labels = spec.scheduling, [], labels or {}
        for what, name in (("scheduling.priorityClassName", s.priority_class_name),
                           (f"label {PRIORITY_LABEL}", labels.get(PRIORITY_LABEL))):
            # An empty label names no class (Kueue reads it so).
            if self.priority_classes is not None and name and name not in self.priority_classes:
                out.append(f"{what} {name!r} is not allowed here; allowed: "
                           f"{_listed(self.priority_classes)}")
        if self.toleration_keys is not None:
            for t in s.tolerations:
                # An empty key with operator Exists tolerates every taint: never within a list.
                if not t.key or t.key not in self.toleration_keys:
                    what = repr(t.key) if t.key else "every taint (no key)"
                    out.append(f"scheduling.tolerations: {what} may not be tolerated here; "
                               f"allowed keys: {_listed(self.toleration_keys)}")
        if self.node_selector_keys is not None:
            for key in sorted(s.node_selector):
                if key not in self.node_selector_keys:
                    out.append(f"scheduling.nodeSelector: {key!r} may not be selected on here; "
                               f"allowed keys: {_listed(self.node_selector_keys)}")
        for field, size, limit in (("scratchSizeLimit", spec.scratch_size_limit, self.max_scratch),
                                   ("shmSizeLimit", spec.shm_size_limit, self.max_shm)):
            if limit is not None and _bytes(size, field) > _bytes(limit, field):
                out.append(f"{field} {size} is more than the {limit} allowed here")
        return out


def asked(spec: PretrainJobSpec, labels: Mapping[str, str]) -> str:
    """A digest of what the limits read, and only that: a job is judged again when it changes
    (an operator upgrade that moves an unrelated default changes nothing here)."""
    doc = {"scheduling": spec.scheduling.model_dump(mode="json", by_alias=True,
                                                    exclude_none=True),
           "scratch": spec.scratch_size_limit, "shm": spec.shm_size_limit,
           "priority": labels.get(PRIORITY_LABEL, "")}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


def _names(text: str) -> frozenset[str] | None:
    names = frozenset(n.strip() for n in text.split(",") if n.strip())
    return None if not names or "*" in names else names


def _listed(names: frozenset[str]) -> str:
    return ", ".join(sorted(names))


def _bytes(quantity: str, what: str) -> Decimal:
    try:
        return parse_quantity(quantity)
    except ValueError:
        raise ValueError(f"{what}: {quantity!r} is not a Kubernetes quantity "
                         "(e.g. 200Gi, 64G)") from None
