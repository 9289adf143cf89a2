"""`snapshot`: one pass's view, read from the kopf indexes (plain mappings here, as kopf's are:
key -> a store of values).

The view holds the nodes of the job's pods and of the nodes it avoids (so a repaired node can be
trusted again: it has no pod of the job on it), and a node the index lacks as deleted only when
its deletion was seen.
"""

from __future__ import annotations

from crucible.operator.handlers import CHILD_KINDS, snapshot
from tests.operator import builders as b

KEY = (b.NS, b.JOB)


def _indexes(pods, nodes, priority_classes=(), default: str | None = None) -> dict:
    """`priority_classes`: names, each with the value 1000 (as the index stores it: value and
    whether it is the globalDefault one)."""
    indexes = {"pods_by_job": {KEY: list(pods)}, "leases_by_job": {},
               "nodes_by_name": {node.name: [node] for node in nodes},
               "priority_classes": {name: [(1000, name == default)]
                                    for name in priority_classes}}
    for _, (_, plural) in CHILD_KINDS:
        indexes[f"children_{plural}"] = {}
    return indexes


def test_the_view_holds_the_pods_nodes_and_the_avoided_ones():
    nodes = [b.node("gpu-node-0"), b.node("gpu-node-1"),
             b.node("gpu-node-2", unschedulable=True), b.node("gpu-node-3", ready="False")]
    pods = [b.pod(0, 0, node="gpu-node-0")]
    obs = snapshot(KEY, _indexes(pods, nodes), also_nodes=("gpu-node-2", "gpu-node-9"),
                   deleted_nodes={"gpu-node-9"})
    assert set(obs.nodes) == {"gpu-node-0", "gpu-node-2", "gpu-node-9"}
    assert obs.nodes["gpu-node-2"].unschedulable and obs.nodes["gpu-node-9"] is None  # deleted


def test_a_node_the_index_lacks_is_deleted_only_if_its_deletion_was_seen():
    """A pod bound to a node that joined a moment ago can come before the node's own event: the
    node is unknown (judged by nobody), not deleted (which would fail the pod at once)."""
    pods = [b.pod(0, 0, node="gpu-node-new")]
    obs = snapshot(KEY, _indexes(pods, [b.node("gpu-node-0")]))
    assert "gpu-node-new" not in obs.nodes
    obs = snapshot(KEY, _indexes(pods, [b.node("gpu-node-0")]), deleted_nodes={"gpu-node-new"})
    assert obs.nodes["gpu-node-new"] is None


def test_an_empty_node_index_knows_nothing():
    obs = snapshot(KEY, _indexes([b.pod(0, 0, node="gpu-node-0")], []),
                   also_nodes=("gpu-node-2",))
    assert obs.nodes == {}


def test_priority_classes_are_known_once_the_index_has_any():
    assert snapshot(KEY, _indexes([], [])).priority_classes is None     # still filling
    obs = snapshot(KEY, _indexes([], [], ("system-node-critical", "training-high")))
    assert obs.priority_classes == {"system-node-critical", "training-high"}


def test_the_view_holds_the_priority_values_and_the_default_class():
    obs = snapshot(KEY, _indexes([], [], ("normal", "training-high"), default="normal"))
    assert obs.priority_values == {"normal": 1000, "training-high": 1000}
    assert obs.default_priority_class == "normal"
    assert snapshot(KEY, _indexes([], [], ("normal",))).default_priority_class is None


def test_a_queued_job_sees_its_workload_its_cluster_queue_and_the_flavors():
    from crucible.operator.observed import flavor_view
    from crucible.operator.queueing import workload

    wl = b.workload(workload(b.JOB, b.NS, b.UID, b.spec(), "gpus", None))
    flavor = flavor_view({"metadata": {"name": "gpu"}, "spec": {"nodeLabels": {"pool": "a"}}})
    indexes = {**_indexes([], []), "workloads_by_job": {KEY: [wl]},
               "local_queues": {(b.NS, "gpus"): ["cq"]}, "resource_flavors": {"gpu": [flavor]},
               "workload_priority_classes": {"prod": [5000]}}
    obs = snapshot(KEY, indexes, queue="gpus")
    assert (obs.workload, obs.cluster_queue, dict(obs.flavors)) == (wl, "cq", {"gpu": flavor})
    assert obs.workload_priorities == {"prod": 5000}
    # Out of the queue, the job still sees its Workload (to delete it), nothing else.
    unqueued = snapshot(KEY, indexes)
    assert unqueued.workload == wl and unqueued.cluster_queue is None and not unqueued.flavors
    # With Kueue off the indexes do not exist.
    assert snapshot(KEY, _indexes([], []), queue="gpus").workload is None
