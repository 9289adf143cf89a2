"""Where a pod may connect to: the egress rule every Crucible pod gets (trainer and corpus).

The clouds' instance-metadata endpoints hand out the node's identity, not the job's: a pod that
reaches one can act with the node's cloud role. AWS, GCP, Azure, OCI serve it on
169.254.169.254; Alibaba on 100.100.100.200; Tencent on 169.254.0.23; Azure's WireServer
168.63.129.16 holds node bootstrap secrets; IPv6: AWS fd00:ec2::254, GCP fd20:ce::254, OCI
fd00:c1::a9fe:a9fe. Must not import torch.
"""

from __future__ import annotations

INSTANCE_METADATA = {"0.0.0.0/0": ["169.254.169.254/32", "100.100.100.200/32", "169.254.0.23/32",
                                   "168.63.129.16/32"],
                     "::/0": ["fd00:ec2::254/128", "fd20:ce::254/128", "fd00:c1::a9fe:a9fe/128"]}


def egress_but_instance_metadata() -> list[dict]:
    """NetworkPolicy egress: every pod of the cluster (an ipBlock need not match pod
    addresses), and every address but the instance-metadata ones."""
    return [{"to": [{"namespaceSelector": {}}] + [
        {"ipBlock": {"cidr": cidr, "except": list(addresses)}}
        for cidr, addresses in INSTANCE_METADATA.items()]}]
