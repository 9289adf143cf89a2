"""A straggler, end to end on the real control plane: the trainer's own Lease writer (under the
trainer pods' ServiceAccount, the tenant's identity) reports rank 1 slow; the operator shows it,
and with replaceAfterMinutes replaces its pod off the node. The node itself is cordoned only
where the operator's --straggler-cordon-selector lets a report cordon it (the administrator
labelled it); by default a report, which the tenant's code could forge, leaves every node as it
was. The node is repaired after."""

from __future__ import annotations

import time

import pytest

from crucible.api.progress import Straggler
from crucible.trainer.lease import ProgressLease
from tests.operator.test_progress_lease import trainer_kubeconfig
from tests.support.operator_run import assert_clean_exit
from tests.support.services import eventually

pytestmark = pytest.mark.stack


ALLOW_LABEL = ("crucible.dev/straggler-cordon", "allowed")


@pytest.mark.parametrize("cordon_allowed", [False, True], ids=["default", "admin-labelled-node"])
def test_a_straggler_is_reported_then_its_pod_replaced_off_its_node(cluster, run_operator,
                                                                    monkeypatch, tmp_path,
                                                                    cordon_allowed):
    slow_node = None
    if cordon_allowed:
        monkeypatch.setenv("CRUCIBLE_OPERATOR_STRAGGLER_CORDON_SELECTOR", "=".join(ALLOW_LABEL))
    try:
        with run_operator(cluster.namespace) as runner:
            cluster.create_job("gpt", nodes={"min": 1, "max": 2},
                               resources={"limits": {"nvidia.com/gpu": 8}},
                               faultTolerance={"stragglers": {"replaceAfterMinutes": 1}})
            pods = cluster.wait_running("gpt", 2, generation=0)
            cluster.wait_phase("gpt", "Running")
            slow = next(p for p in pods if p.metadata.name == "gpt-0-1")
            slow_node, slow_uid = slow.spec.node_name, slow.metadata.uid
            if cordon_allowed:
                cluster.core.patch_node(slow_node, {"metadata": {"labels": dict([ALLOW_LABEL])}})
            kubeconfig = eventually(lambda: trainer_kubeconfig(cluster, "gpt", tmp_path / "kc"),
                                    20, "the trainer's ServiceAccount")
            with monkeypatch.context() as env:
                env.setenv("KUBECONFIG", kubeconfig)
                lease = ProgressLease(cluster.namespace, "gpt", holder="gpt-0-0", interval_s=0.5)
            try:
                lease.update(step=40, tokens=40 * 4096, loss=5.0, world_size=16,
                             stragglers=(Straggler(9, "gpt-0-1", 1.34),))
                reported_at = time.monotonic()
                status = eventually(lambda: (s := cluster.status("gpt")).get("stragglers") and s,
                                    20, "status.stragglers")
                assert status["stragglers"] == [{"rank": 9, "pod": "gpt-0-1", "ratio": 1.34,
                                                 "node": slow_node}]
                cluster.wait_event("gpt", "Straggler")
                # Still slow a minute later: the pod moves off the node, and the node is
                # quarantined only where the administrator allowed it.
                moved = eventually(lambda: (p := [x for x in cluster.running("gpt", 0)
                                                  if x.metadata.name == "gpt-0-1"])
                                   and p[0].metadata.uid != slow_uid and p[0], 120,
                                   "gpt-0-1 recreated and Running")
                assert time.monotonic() - reported_at >= 55
                assert moved.spec.node_name != slow_node
                node = cluster.core.read_node(slow_node)
                reported = (node.metadata.annotations or {}).get("crucible.dev/failure-reason")
                if cordon_allowed:
                    assert node.spec.unschedulable and reported == "Straggler"
                else:
                    assert not node.spec.unschedulable and reported is None
                status = cluster.status("gpt")
                assert status["restarts"]["byCause"] == {"Straggler": 1}
                assert status["restarts"]["application"] == 0 and status["podGeneration"] == 0
                # The restarted trainer judges no one yet: it clears the report.
                lease.update(step=41, tokens=41 * 4096, stragglers=())
                eventually(lambda: cluster.status("gpt").get("stragglers") == [], 20,
                           "status.stragglers cleared")
                # The report read again after the replacement was about the old pod: the node
                # the replacement landed on was never quarantined for it.
                quarantined = [n.metadata.name for n in cluster.core.list_node().items
                               if (n.metadata.annotations or {}).get("crucible.dev/failure-job")
                               == f"{cluster.namespace}/gpt"]
                assert quarantined == ([slow_node] if cordon_allowed else [])
            finally:
                lease.close()
            cluster.delete_job("gpt")
    finally:
        if slow_node:
            if cordon_allowed:
                cluster.core.patch_node(slow_node, {"metadata": {"labels": {ALLOW_LABEL[0]: None}}})
            cluster.revive(slow_node)
    assert_clean_exit(runner, "took 1.34x the other ranks' median for over 1 min")
