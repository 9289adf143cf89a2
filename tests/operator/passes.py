"""One operator pass run by hand (`handlers._one_pass`), outside kopf: the memo its startup
handler would build and the indexes kopf would hold, empty unless a test fills them."""

from __future__ import annotations

import concurrent.futures
from types import SimpleNamespace

from crucible.operator.handlers import CHILD_KINDS, OperatorConfig, init_state
from crucible.operator.kube import Kube


def pass_memo(api) -> SimpleNamespace:
    """What `handlers.configure` puts in kopf's memo, for one API client; shut its `executor`
    and `kube.events` down after."""
    cfg = OperatorConfig()
    memo = SimpleNamespace(config=cfg, cluster_policy=cfg.cluster_policy, kube=Kube(api),
                           executor=concurrent.futures.ThreadPoolExecutor(2))
    init_state(memo)
    return memo


def empty_indexes(**filled) -> dict:
    """kopf's indexes with nothing in them (pods, nodes, leases, children), as for a job with
    nothing left, and `filled` on top."""
    return {"pods_by_job": {}, "nodes_by_name": {}, "leases_by_job": {}, "priority_classes": {},
            **{f"children_{plural}": {} for _, (_, plural) in CHILD_KINDS}, **filled}
