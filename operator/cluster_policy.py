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
operator's cordons last (`--quarantine-minutes`, quarantine.py).

A straggler report is different in kind: the trainer writes it, and the trainer image and its
ServiceAccount are the tenant's, so a forged report could name any node its pod was scheduled
on (a hostname nodeSelector picks the node). Such a report never cordons or annotates a node
unless the administrator names the nodes it may (`--straggler-cordon-selector`, labels the node
must carry); otherwise the job only avoids the node and replaces its pod. Whether the pods may
reach the cloud's instance-metadata endpoint, and with it the node's IAM role, is the
administrator's too (`--allow-instance-metadata`; off: the job's NetworkPolicy blocks the
address and the AWS SDK is told not to try). What a job's scheduling and sizes may ask for
(priority classes, tolerations, nodeSelector keys, scratch and /dev/shm) is bounded by the
administrator's limits (tenant_limits.py). Pure.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from crucible.operator.manifests import ANY_NAMESPACE
from crucible.operator.tenant_limits import TenantLimits

# What a job may call "failed" unless the administrator says otherwise: node-problem-detector's
# default problem conditions and the GPU health checkers' usual name. Not "*": a tenant naming a
# condition that is True on healthy nodes (EKS' node monitoring agent sets
# AcceleratedHardwareReady=True, say) would have every healthy node cordoned.
DEFAULT_FAILURE_CONDITIONS = ("GPUUnhealthy,KernelDeadlock,ReadonlyFilesystem,FrequentKubeletRestart,FrequentContainerdRestart,FrequentDockerRestart,CorruptDockerOverlay2")

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
    # Labels a node must carry for a straggler report (the tenant's code) to cordon it; None:
    # straggler reports never touch a node.
    straggler_cordon: tuple[tuple[str, str], ...] | None = None
    # Pods may reach the cloud's instance-metadata endpoint (and so the node's IAM role).
    instance_metadata: bool = False
    # What a job's scheduling and sizes may ask for (tenant_limits.py).
    limits: TenantLimits = TenantLimits()

    def straggler_may_cordon(self, node) -> bool:
        """Whether a straggler report may quarantine `node` (a NodeView) like a failed node."""
        return (self.straggler_cordon is not None and node is not None
                and node.has_labels(self.straggler_cordon))

    @classmethod
    def from_settings(cls, conditions: str, max_cordons_per_minute: int,
                      metrics_scrapers: str = "", kueue: bool = True,
                      quarantine_minutes: float = 60.0,
                      kueue_manage_all: bool = False,
                      straggler_cordon_selector: str = "",
                      instance_metadata: bool = False,
                      limits: TenantLimits = TenantLimits()) -> "ClusterPolicy":
        """`conditions`: comma-separated condition types, or "*" for any. `metrics_scrapers`:
        a JSON list of NetworkPolicy peers; empty: any namespace. `straggler_cordon_selector`:
        `key=value,...`; empty: straggler reports never cordon."""
        names = frozenset(c.strip() for c in conditions.split(",") if c.strip())
        return cls(None if "*" in names else names, max_cordons_per_minute > 0,
                   parse_peers(metrics_scrapers) if metrics_scrapers.strip() else ANY_NAMESPACE,
                   kueue, quarantine_minutes * 60.0, kueue_manage_all,
                   parse_label_selector(straggler_cordon_selector)
                   if straggler_cordon_selector.strip() else None, instance_metadata, limits)


# A label key: an optional DNS-subdomain prefix and a name (Kubernetes' own rule); a value:
# up to 63 of the same characters, possibly empty.
_LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?"
                        r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")


def parse_label_selector(text: str) -> tuple[tuple[str, str], ...]:
    """`key=value,...` (matchLabels, as `kubectl get -l` writes equality) as sorted pairs.
    ValueError says what is wrong: a selector that matched nothing by a typo would silently
    turn the feature off, one that matched too much would not be noticed either."""
    pairs = {}
    for item in text.split(","):
        key, eq, value = (part.strip() for part in item.partition("="))
        if not eq or not _LABEL_KEY.match(key) or not _LABEL_VALUE.match(value):
            raise ValueError(f"--straggler-cordon-selector: {item.strip()!r} is not key=value "
                             "(e.g. crucible.dev/straggler-cordon=allowed,pool=gpu)")
        if pairs.get(key, value) != value:
            raise ValueError(f"--straggler-cordon-selector: {key} is given two values; a node "
                             "carries one (e.g. crucible.dev/straggler-cordon=allowed,pool=gpu)")
        pairs[key] = value
    return tuple(sorted(pairs.items()))


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
