"""What the cluster's administrator lets jobs do: operator settings, never a tenant's.

A PretrainJob's author chooses which node conditions mean "failed" for their job and whether
failed nodes are cordoned; both act on nodes every tenant shares. So the operator's own settings
bound them (`crucible-operator run --node-failure-conditions`, `--max-cordons-per-minute`, the
chart's values): a condition the administrator did not allow is ignored, and with cordoning off
a failed node is only annotated and avoided by the job. The per-minute cap itself is counted in
the adapter (kube.CordonLimit), across jobs. Who may scrape a job's metrics port through its
NetworkPolicy (`--metrics-scrapers`) is the administrator's too: they know where Prometheus
runs. Whether jobs may queue through Kueue (`--no-kueue` turns it off where Kueue is not
installed, or not for this operator) is the administrator's too, and so is how long the
operator's cordons last (`--quarantine-minutes`, quarantine.py). Pure.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from crucible.operator.manifests import ANY_NAMESPACE

# The keys of a NetworkPolicyPeer (networking.k8s.io/v1).
PEER_KEYS = frozenset({"podSelector", "namespaceSelector", "ipBlock"})


@dataclass(frozen=True)
class ClusterPolicy:
    allowed_conditions: frozenset[str] | None = None   # None: any the job names
    cordon: bool = True                                 # False: never cordon, annotate only
    metrics_from: tuple[dict, ...] = ANY_NAMESPACE      # NetworkPolicy peers for the metrics port
    kueue: bool = True                                  # False: the operator ignores Kueue
    quarantine_s: float = 3600.0                        # how long its cordons last; 0: forever
    kueue_manage_all: bool = False                      # unlabelled jobs queue too (Kueue's
    #                                                     manageJobsWithoutQueueName)

    @classmethod
    def from_settings(cls, conditions: str, max_cordons_per_minute: int,
                      metrics_scrapers: str = "", kueue: bool = True,
                      quarantine_minutes: float = 60.0,
                      kueue_manage_all: bool = False) -> "ClusterPolicy":
        """`conditions`: comma-separated condition types, or "*" for any. `metrics_scrapers`:
        a JSON list of NetworkPolicy peers; empty: any namespace."""
        names = frozenset(c.strip() for c in conditions.split(",") if c.strip())
        return cls(None if "*" in names else names, max_cordons_per_minute > 0,
                   parse_peers(metrics_scrapers) if metrics_scrapers.strip() else ANY_NAMESPACE,
                   kueue, quarantine_minutes * 60.0, kueue_manage_all)


def parse_peers(text: str) -> tuple[dict, ...]:
    """NetworkPolicy peers from JSON, checked enough that a typo fails at start-up rather than
    in every job's NetworkPolicy create. ValueError says what is wrong."""
    try:
        peers = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"--metrics-scrapers is not JSON ({err.msg} at character {err.pos}): "
                         'give a list of NetworkPolicy peers, e.g. [{"namespaceSelector": '
                         '{"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]'
                         ) from None
    if not isinstance(peers, list) or not peers:
        raise ValueError("--metrics-scrapers must be a non-empty JSON list of NetworkPolicy peers")
    for peer in peers:
        if not isinstance(peer, dict) or not peer or not set(peer) <= PEER_KEYS:
            raise ValueError(f"--metrics-scrapers: {json.dumps(peer)} is not a NetworkPolicy peer "
                             f"(keys: {', '.join(sorted(PEER_KEYS))})")
    return tuple(peers)
