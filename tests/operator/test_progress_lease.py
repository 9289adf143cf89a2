"""The progress Lease, end to end: the trainer's own writer (trainer/lease.py) under the trainer
pods' own ServiceAccount token, read back by the operator.

Chaos survived: the training loop stops advancing while the Lease keeps being renewed (a hang,
e.g. a stuck NCCL collective): the operator restarts the group after hangTimeoutSeconds.
"""

from __future__ import annotations

import datetime as dt
import time

import pytest
from kubernetes import client

from crucible.api.progress import CommitRef
from crucible.trainer.lease import ProgressLease
from tests.support.kubeconfigs import write_kubeconfig
from tests.support.operator_run import assert_clean_exit
from tests.support.services import eventually

pytestmark = pytest.mark.stack

COMMITTED = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)


def trainer_kubeconfig(cluster, job: str, path) -> str:
    token = cluster.core.create_namespaced_service_account_token(
        f"{job}-trainer", cluster.namespace, client.AuthenticationV1TokenRequest(
            spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=3600))).status.token
    return str(write_kubeconfig(cluster.kube.kubeconfig, token, path))


def test_lease_advancing_updates_status_and_a_stalled_lease_restarts_the_group(
        cluster, run_operator, monkeypatch, tmp_path):
    with run_operator(cluster.namespace) as runner:
        cluster.create_job("gpt", nodes={"min": 1, "max": 1},
                           faultTolerance={"hangTimeoutSeconds": 30})
        cluster.wait_running("gpt", 1, generation=0)
        cluster.wait_phase("gpt", "Running")
        kubeconfig = eventually(lambda: trainer_kubeconfig(cluster, "gpt", tmp_path / "kc"), 20,
                                "the trainer's ServiceAccount")
        with monkeypatch.context() as env:  # trainer/lease.py reads KUBECONFIG when it starts
            env.setenv("KUBECONFIG", kubeconfig)
            lease = ProgressLease(cluster.namespace, "gpt", holder="gpt-0-0", interval_s=0.5)
        try:
            for step in range(1, 7):
                lease.update(step=step, tokens=step * 4096, loss=6.0 / step, world_size=1,
                             checkpoint=CommitRef(4, "s3://crucible/runs/gpt/step_4", COMMITTED)
                             if step >= 4 else None)
                time.sleep(1.0)
            status = eventually(lambda: (s := cluster.status("gpt")).get("step") == 6 and s, 20,
                                "status.step from the Lease")
            assert status["loss"] == 1.0 and status["tokensSeen"] == 6 * 4096
            assert status["lastCheckpoint"] == {"step": 4, "uri": "s3://crucible/runs/gpt/step_4",
                                                "time": "2026-01-01T00:00:00Z"}
            assert status["worldSize"] == 1
            assert 0 < status["goodput"] <= 1
            progressing = next(c for c in status["conditions"] if c["type"] == "Progressing")
            assert progressing["status"] == "True" and progressing["reason"] == "StepAdvancing"

            # The loop is stuck; the Lease's renewal thread carries on (renewTime moves).
            renewed = cluster.coordination.read_namespaced_lease("gpt-progress",
                                                                 cluster.namespace).spec.renew_time
            status = eventually(lambda: (s := cluster.status("gpt"))["podGeneration"] == 1 and s,
                                45, "hang restart")
            assert cluster.coordination.read_namespaced_lease(
                "gpt-progress", cluster.namespace).spec.renew_time > renewed
            assert status["restarts"]["byCause"] == {"Hang": 1}
            assert status["restarts"]["application"] == 1
            cluster.wait_running("gpt", 1, generation=1)
            cluster.wait_event("gpt", "Hang")
        finally:
            lease.close()
        cluster.delete_job("gpt")
    assert_clean_exit(runner, "Hang: no training step for 30s (stuck after step 6)")
