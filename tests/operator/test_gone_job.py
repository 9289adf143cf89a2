"""A reconcile loop whose job is gone ends instead of retrying forever.

Seen on kind: a job's namespace was deleted while the operator was being replaced, and the new
operator's loop for it kept failing with 404 every two seconds (81% of a core). Here a pass runs
against the real apiserver for a job that does not exist (its status patch meets a 404): the
pass must say the job is gone, which ends the loop, rather than retry."""

from __future__ import annotations

import asyncio
import logging

import pytest
from kubernetes import config

from crucible.operator.handlers import After, _one_pass
from tests.operator import builders as b
from tests.operator.passes import empty_indexes, pass_memo

pytestmark = pytest.mark.stack


def test_a_pass_for_a_job_that_no_longer_exists_ends_its_loop(operator_kubeconfig, caplog):
    memo = pass_memo(config.new_client_from_config(str(operator_kubeconfig)))
    body = {"metadata": {"name": "gone", "namespace": "no-such-namespace-for-crucible",
                         "uid": "uid-gone", "generation": 1},
            "spec": b.spec_doc(), "status": {}}
    # Empty indexes, as kopf's are for a job with nothing left: no pods, nodes or children.
    indexes = empty_indexes()
    logger = logging.getLogger("test-gone")
    with caplog.at_level(logging.INFO, "test-gone"):
        nxt = asyncio.run(_one_pass(("no-such-namespace-for-crucible", "gone"), body, memo,
                                    indexes, logger))
    memo.executor.shutdown()
    assert nxt.after is After.GONE, nxt
    assert "no longer exists" in caplog.text and "retrying" not in caplog.text
