"""A long run's worth of node losses on the real control plane: the budget stays whole.

Chaos survived: twenty node losses in a row under a 4-pod job (`maxRestarts: 3`), one pod per
node (8 GPUs each) on the stack's nodes plus two spares; after every third loss the survivors
exit 1 at once, as torchrun's agents do once its in-pod restarts (3) are spent on lost peers.
Expected: the job ends Running with 20 infrastructure restarts (NodeFailure) and no
application restart: the survivors' exits are the losses' (PeerLost, a new generation whose
pods start with torchrun's budget whole), and twenty different node failures are no
infrastructure loop. Every node killed is revived, uncordoned and un-annotated, whatever happens.
"""

from __future__ import annotations

import sys
import time

import pytest

from tests.support.operator_run import assert_clean_exit
from tests.support.repo import REPO
from tests.support.services import eventually

sys.path.insert(0, str(REPO / "e2e"))
from stack.services import node_manifest  # noqa: E402

pytestmark = pytest.mark.stack

LOSSES = 20


def _unready(cluster, node: str) -> bool:
    ready = next(c for c in cluster.core.read_node(node).status.conditions if c.type == "Ready")
    return ready.status != "True"


def test_twenty_node_losses_leave_the_restart_budget_whole(cluster, kube, run_operator):
    spares = [f"spare-{int(time.time())}-{i}" for i in range(2)]
    killed: set[str] = set()
    try:
        for name in spares:
            cluster.core.create_node(node_manifest(name))
        kube.wait_nodes_healthy(spares)
        with run_operator(cluster.namespace) as runner:
            cluster.create_job("marathon", nodes={"min": 4, "max": 4},
                               resources={"limits": {"nvidia.com/gpu": 8}},
                               faultTolerance={"maxRestarts": 3, "nodeFailureGraceSeconds": 2,
                                               "maxRestartsWithoutProgress": 1})
            gen = 0
            cluster.wait_running("marathon", 4, generation=gen, timeout_s=60)
            for loss in range(LOSSES):
                pod = f"marathon-{gen}-{1 + loss % 3}"
                victim = cluster.core.read_namespaced_pod(pod, cluster.namespace).spec.node_name
                uid = cluster.core.read_namespaced_pod(pod, cluster.namespace).metadata.uid
                kube.set_node_alive(victim, False)
                killed.add(victim)
                # The node controller's grace is 8 s; on two shared cores under load (a cold
                # run with other work beside it) it once took over 45 s to say so.
                eventually(lambda: _unready(cluster, victim), 90, f"{victim} NotReady")
                eventually(lambda: any(p.metadata.name == pod and p.metadata.uid != uid
                                       and p.spec.node_name and p.spec.node_name != victim
                                       for p in cluster.running("marathon", gen)),
                           60, f"{pod} replaced off {victim} (loss {loss + 1})")
                # Repaired and back for the next losses: a person uncordons it.
                cluster.revive(victim)
                killed.discard(victim)
                if loss % 3 == 2:
                    # torchrun's in-pod budget spent: every survivor's agent exits 1.
                    for p in cluster.running("marathon", gen):
                        cluster.fail_pod(p.metadata.name, 1)
                    gen += 1
                    cluster.wait_running("marathon", 4, generation=gen, timeout_s=60)
                status = cluster.status("marathon")
                assert status["phase"] != "Failed", status.get("message")
            status = cluster.wait_phase("marathon", "Running", timeout_s=60)
            restarts = status["restarts"]
            print(f"after {LOSSES} node losses: {restarts}")
            assert restarts["application"] == 0, restarts
            assert restarts["infrastructure"] == LOSSES, restarts
            assert restarts["byCause"] == {"NodeFailure": LOSSES}, restarts
            assert status["podGeneration"] == gen
            cluster.wait_event("marathon", "PeerLost")
            cluster.delete_job("marathon")
    finally:
        for node in killed:
            cluster.revive(node)
        for name in spares:
            cluster.core.delete_node(name)
    assert_clean_exit(runner)
