"""What the cluster's administrator lets jobs do to nodes: operator settings, never a tenant's.

A PretrainJob's author chooses which node conditions mean "failed" for their job and whether
failed nodes are cordoned; both act on nodes every tenant shares. So the operator's own settings
bound them (`crucible-operator run --node-failure-conditions`, `--max-cordons-per-minute`, the
chart's values): a condition the administrator did not allow is ignored, and with cordoning off
a failed node is only annotated and avoided by the job. The per-minute cap itself is counted in
the adapter (kube.CordonLimit), across jobs. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NodePolicy:
    allowed_conditions: frozenset[str] | None = None   # None: any the job names
    cordon: bool = True                                 # False: never cordon, annotate only

    @classmethod
    def from_settings(cls, conditions: str, max_cordons_per_minute: int) -> "NodePolicy":
        """`conditions`: comma-separated condition types, or "*" for any."""
        names = frozenset(c.strip() for c in conditions.split(",") if c.strip())
        return cls(None if "*" in names else names, max_cordons_per_minute > 0)
