"""Where the local stack keeps things, and which loopback ports it uses.

Binaries are built once into the cache (`~/.cache/crucible/bin`, never into the repository);
runtime state (certificates, etcd data, logs, pid files, kubeconfig, env file) lives in the
state folder. Both can be moved with environment variables so that two checkouts, or CI and a
developer, do not collide:

  CRUCIBLE_CACHE        cache root            (default ~/.cache/crucible)
  CRUCIBLE_STACK_DIR    runtime state folder  (default $CRUCIBLE_CACHE/stack)
  CRUCIBLE_PORT_OFFSET  added to every port   (default 0)
  CRUCIBLE_KWOK_NODES   simulated GPU nodes   (default 4; the env file also names them in
                        CRUCIBLE_KWOK_NODE_NAMES)
  CRUCIBLE_KWOK_LEASE_SECONDS  node Lease duration (default 4: a dead node is NotReady in ~8 s;
                        hundreds of nodes renewing every second swamp a small machine, so a
                        large stack takes a longer lease and a proportionally longer grace)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GOBUILD = REPO / "e2e" / "gobuild"


class StackError(Exception):
    """A problem the user can fix; printed as one line by the command, never as a traceback."""


def _int_env(name: str, default: int) -> int:
    raw = os.environ.get(name, str(default))
    try:
        return int(raw)
    except ValueError:
        raise StackError(f"{name}={raw!r} is not an integer") from None


@dataclass(frozen=True)
class Layout:
    cache: Path
    state: Path
    port_offset: int
    kwok_nodes: int
    kwok_lease_s: int = 4

    @classmethod
    def from_env(cls) -> "Layout":
        cache = Path(os.environ.get("CRUCIBLE_CACHE", Path.home() / ".cache" / "crucible"))
        state = Path(os.environ.get("CRUCIBLE_STACK_DIR", cache / "stack"))
        nodes = _int_env("CRUCIBLE_KWOK_NODES", 4)
        if nodes < 2:
            # The node controller stops all evictions when every node is NotReady ("master
            # disruption mode"), so a node-failure test needs at least one healthy node left.
            raise StackError("CRUCIBLE_KWOK_NODES must be at least 2 (one to kill, one healthy)")
        lease = _int_env("CRUCIBLE_KWOK_LEASE_SECONDS", 4)
        if lease < 1:
            raise StackError("CRUCIBLE_KWOK_LEASE_SECONDS must be at least 1")
        return cls(cache, state, _int_env("CRUCIBLE_PORT_OFFSET", 0), nodes, lease)

    @property
    def bin(self) -> Path:
        return self.cache / "bin"

    def port(self, name: str) -> int:
        return PORTS[name] + self.port_offset

    # Runtime files -------------------------------------------------------------------------
    @property
    def certs(self) -> Path:
        return self.state / "certs"

    @property
    def logs(self) -> Path:
        return self.state / "logs"

    @property
    def pids(self) -> Path:
        return self.state / "pids"

    @property
    def kubeconfig(self) -> Path:
        return self.state / "kubeconfig"

    @property
    def env_file(self) -> Path:
        return self.state / "env"

    @property
    def prometheus_targets(self) -> Path:
        return self.state / "prometheus" / "targets"

    @property
    def prometheus_rules(self) -> Path:
        return self.state / "prometheus" / "rules"

    @property
    def node_names(self) -> list[str]:
        return [f"gpu-node-{i}" for i in range(self.kwok_nodes)]


# Uncommon loopback ports, so a developer's own cluster or MinIO on the defaults does not clash.
# All stay below 32768, where Linux's ephemeral range (net.ipv4.ip_local_port_range, 32768-60999 by
# default) starts: a port in that range can be taken as the local end of any outgoing connection
# (even one to itself while a server is down), so a server restarted there may find it in use.
PORTS = {
    "etcd": 22379,
    "etcd-peer": 22380,
    "kube-apiserver": 26443,
    "kube-controller-manager": 20257,
    "kube-scheduler": 20259,
    "kwok": 20247,
    "seaweedfs-master": 19333,
    "seaweedfs-master-grpc": 29333,
    "seaweedfs-volume": 18080,
    "seaweedfs-volume-grpc": 28080,
    "seaweedfs-filer": 18888,
    "seaweedfs-filer-grpc": 28888,
    "s3": 18333,
    "s3-grpc": 28333,  # SeaweedFS's gRPC ports are its HTTP ports + 10000 unless set, as here
    "prometheus": 19090,
    "kueue-webhook": 29443,  # also its /convert (CRD conversion) endpoint
    "kueue-health": 29081,   # /healthz, /readyz
}

# Label the KWOK controller selects its nodes by. A node relabelled away from "managed" gets no
# more heartbeats or lease renewals, which is how a test makes a node "die" (see `node-down`).
KWOK_LABEL = "crucible.dev/kwok"
KWOK_MANAGED = "managed"
KWOK_DEAD = "dead"
S3_BUCKET = "crucible"
