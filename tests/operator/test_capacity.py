"""A full GPU pool on the real control plane: a job waits for capacity instead of failing.

Chaos survived: in a pool exactly as large as the job (nodes.min == nodes.max), a node dies for
good, so the replacement pod cannot be scheduled; the pods that did get a node then exit 1 again
and again, as torchrun's survivors do when their rendezvous times out. Expected: phase Waiting,
PodsScheduled=False (InsufficientCapacity), the restarts not charged to the application budget;
when a node is added the job runs again at once. Past capacityTimeoutSeconds the job lets go
of the nodes it holds (every pod deleted, none created) and waits, then runs again at once when
a node joins. Also: pod 0, the rendezvous host, is the pod that gets a node when the pool is one
node short, every time.
"""

from __future__ import annotations

import sys
import time

import pytest
from kubernetes.client.exceptions import ApiException

from tests.support.operator_run import assert_clean_exit
from tests.support.repo import REPO
from tests.support.services import eventually

sys.path.insert(0, str(REPO / "e2e"))
from stack.services import node_manifest  # noqa: E402

pytestmark = pytest.mark.stack

GPUS = {"limits": {"nvidia.com/gpu": 8}}   # a whole simulated node each


def _schedulable_nodes(cluster) -> list[str]:
    return [n.metadata.name for n in cluster.core.list_node(label_selector="type=kwok").items
            if not n.spec.unschedulable and next(
                c.status for c in n.status.conditions if c.type == "Ready") == "True"]


def _restore_pool(cluster, victim: str | None, added: str) -> None:
    """The pool as it was: the killed node back, the added one gone (if it was ever made)."""
    if victim is not None:
        cluster.revive(victim)
    try:
        cluster.core.delete_node(added)
    except ApiException as err:
        if err.status != 404:
            raise


def _placed(cluster, job: str, generation: int) -> list:
    return [p for p in cluster.pods(job) if p.spec.node_name and not p.metadata.deletion_timestamp
            and p.metadata.labels["crucible.dev/generation"] == str(generation)]


def test_a_lost_node_in_a_full_pool_waits_for_capacity_and_resumes_when_a_node_is_added(
        cluster, kube, run_operator):
    nodes = _schedulable_nodes(cluster)
    size = len(nodes)
    assert size >= 2, nodes
    victim, added = None, f"gpu-node-added-{int(time.time())}"
    try:
        with run_operator(cluster.namespace) as runner:
            cluster.create_job("gpt", nodes={"min": size, "max": size}, resources=GPUS,
                               faultTolerance={"nodeFailureGraceSeconds": 2})
            cluster.wait_running("gpt", size, generation=0, timeout_s=90)
            cluster.wait_phase("gpt", "Running")

            victim = cluster.core.read_namespaced_pod(f"gpt-0-{size - 1}",
                                                      cluster.namespace).spec.node_name
            kube.set_node_alive(victim, False)   # for good: it is revived only after the test
            status = cluster.wait_phase("gpt", "Waiting", timeout_s=60)
            scheduled = next(c for c in status["conditions"] if c["type"] == "PodsScheduled")
            assert scheduled["status"] == "False" and scheduled["reason"] == "InsufficientCapacity"

            # The pods that have a node give up on the rendezvous, five times over.
            for round_ in range(5):
                generation = cluster.status("gpt")["podGeneration"]
                placed = eventually(lambda: (ps := _placed(cluster, "gpt", generation))
                                    and len(ps) == size - 1 and ps, 60,
                                    f"{size - 1} pods of generation {generation} placed")
                # As in a real pool, where the survivors wait out the rendezvous timeout: by the
                # time they exit, the operator has long seen the last pod without a node.
                eventually(lambda: (cluster.status("gpt")["tracking"].get("capacityShort") or {})
                           .get("generation") == generation, 30,
                           f"the operator saw generation {generation} short of capacity")
                for pod in placed:
                    cluster.fail_pod(pod.metadata.name, exit_code=1)
                eventually(lambda: cluster.status("gpt")["podGeneration"] > generation, 30,
                           f"round {round_}: a new generation after the exits")
            status = cluster.wait_phase("gpt", "Waiting", timeout_s=60)
            assert status["restarts"]["application"] == 0, status["restarts"]
            assert status["restarts"]["byCause"].get("InsufficientCapacity") == 5, status["restarts"]
            cluster.wait_event("gpt", "InsufficientCapacity")

            # Capacity returns: a new node joins the pool, and the job runs again at once.
            cluster.core.create_node(node_manifest(added))
            added_at = time.monotonic()
            generation = cluster.status("gpt")["podGeneration"]
            cluster.wait_running("gpt", size, generation=generation, timeout_s=30)
            status = cluster.wait_phase("gpt", "Running", timeout_s=30)
            assert time.monotonic() - added_at < 30
            assert status["restarts"]["application"] == 0
            cluster.delete_job("gpt")
    finally:
        _restore_pool(cluster, victim, added)
    assert_clean_exit(runner, "InsufficientCapacity")


def test_pod_0_gets_a_node_when_the_pool_is_one_short(cluster, run_operator):
    """On size-1 free nodes a job of min=size-1, max=size: whichever pod stays Pending, it is
    never pod 0, the rendezvous host."""
    nodes = _schedulable_nodes(cluster)
    size = len(nodes)
    blocker = None
    with run_operator(cluster.namespace) as runner:
        # Fill one node so the pool is one short of nodes.max.
        cluster.create_job("blocker", nodes={"min": 1, "max": 1}, resources=GPUS)
        blocker = cluster.wait_running("blocker", 1, generation=0)[0].spec.node_name
        for attempt in range(20):
            name = f"gpt{attempt}"
            cluster.create_job(name, nodes={"min": size - 1, "max": size}, resources=GPUS)
            pod0 = eventually(lambda: (ps := [p for p in cluster.running(name, 0)
                                              if p.metadata.name == f"{name}-0-0"]) and ps[0],
                              45, f"{name}-0-0 Running")
            assert pod0.spec.node_name != blocker
            eventually(lambda: len(_placed(cluster, name, 0)) == size - 1, 45,
                       f"{size - 1} pods of {name} placed")
            cluster.delete_job(name)
            for pod in cluster.pods(name):   # no need to wait out their grace here
                try:
                    cluster.core.delete_namespaced_pod(pod.metadata.name, cluster.namespace,
                                                       grace_period_seconds=0)
                except ApiException as err:
                    if err.status != 404:
                        raise
            eventually(lambda: not cluster.pods(name), 45, f"{name}'s pods gone")
        cluster.delete_job("blocker")
    assert_clean_exit(runner)


def test_a_job_short_of_capacity_past_its_timeout_releases_its_nodes_and_resumes_when_one_joins(
        cluster, kube, run_operator):
    nodes = _schedulable_nodes(cluster)
    size = len(nodes)
    victim, added = None, f"gpu-node-joined-{int(time.time())}"
    try:
        with run_operator(cluster.namespace) as runner:
            cluster.create_job("gpt", nodes={"min": size, "max": size}, resources=GPUS,
                               faultTolerance={"nodeFailureGraceSeconds": 2,
                                               "capacityTimeoutSeconds": 30,
                                               "capacityRetrySeconds": 600})
            cluster.wait_running("gpt", size, generation=0, timeout_s=90)
            victim = cluster.core.read_namespaced_pod(f"gpt-0-{size - 1}",
                                                      cluster.namespace).spec.node_name
            kube.set_node_alive(victim, False)
            short_at = time.monotonic()
            cluster.wait_phase("gpt", "Waiting", timeout_s=60)
            # Released: a new generation with no pods at all, the old pods gone, the nodes free.
            status = eventually(lambda: (s := cluster.status("gpt"))["tracking"].get(
                "capacityHold") and s, 90, "the job released its pods")
            assert time.monotonic() - short_at >= 30 - 2
            eventually(lambda: not [p for p in cluster.pods("gpt")
                                    if not p.metadata.deletion_timestamp], 60,
                       "every pod of the job deleted")
            assert status["phase"] == "Waiting"
            assert status["restarts"]["application"] == 0
            assert "CapacityTimeout" not in status["restarts"]["byCause"]
            cluster.wait_event("gpt", "CapacityReleased")
            time.sleep(5)   # still nothing created: the retry is 10 min away
            assert not [p for p in cluster.pods("gpt") if not p.metadata.deletion_timestamp]

            # A node joins: the job tries again at once, not after its 10 min backoff.
            cluster.core.create_node(node_manifest(added))
            added_at = time.monotonic()
            generation = cluster.status("gpt")["podGeneration"]
            cluster.wait_running("gpt", size, generation=generation, timeout_s=45)
            status = cluster.wait_phase("gpt", "Running", timeout_s=30)
            assert time.monotonic() - added_at < 45
            cluster.wait_event("gpt", "CapacityRetry")
            assert status["restarts"]["application"] == 0
            assert "capacityHold" not in status["tracking"]
            cluster.delete_job("gpt")
    finally:
        _restore_pool(cluster, victim, added)
    assert_clean_exit(runner, "CapacityReleased", "CapacityRetry")
