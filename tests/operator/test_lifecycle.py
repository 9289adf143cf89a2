"""A PretrainJob's life on the real control plane: apply, run, suspend, resume, delete.

Chaos survived: none on purpose; these pin down the happy path the chaos tests depart from.
"""

from __future__ import annotations

import re
import urllib.request

import pytest
from kubernetes import client

from crucible.operator import manifests as m
from tests.operator.cluster import free_port
from tests.support.operator_run import assert_clean_exit
from tests.support.services import eventually

pytestmark = pytest.mark.stack


def test_apply_gives_running_pods_owned_children_and_printer_columns(cluster, run_operator):
    port = free_port()
    with run_operator(cluster.namespace, metrics_port=port) as runner:
        cluster.create_job("gpt", nodes={"min": 2, "max": 3}, procsPerNode=8,
                           resources={"limits": {"nvidia.com/gpu": 8}})
        pods = cluster.wait_running("gpt", 3, generation=0)
        status = cluster.wait_phase("gpt", "Running")
        assert sorted(p.metadata.name for p in pods) == ["gpt-0-0", "gpt-0-1", "gpt-0-2"]
        assert len({p.spec.node_name for p in pods}) == 3   # 8 GPUs each: a node per pod
        assert status["pods"]["running"] == 3 and status["observedGeneration"] == 1
        row = eventually(lambda: (r := cluster.printed_row("gpt"))["Phase"] == "Running" and r, 10,
                         "printer columns")
        assert list(row)[:6] == ["Name", "Phase", "Step", "Loss", "Restarts", "Last-Ckpt"]
        assert row["Restarts"] == 0

        uid = cluster.job("gpt")["metadata"]["uid"]
        owned = [cluster.core.read_namespaced_service("gpt", cluster.namespace),
                 cluster.core.read_namespaced_config_map("gpt-config", cluster.namespace),
                 cluster.core.read_namespaced_service_account("gpt-trainer", cluster.namespace),
                 cluster.coordination.read_namespaced_lease("gpt-progress", cluster.namespace),
                 *pods]
        fence = client.NetworkingV1Api(cluster.api).read_namespaced_network_policy(
            "gpt", cluster.namespace)
        owned.append(fence)
        assert all(o.metadata.owner_references[0].uid == uid for o in owned)
        assert owned[0].spec.cluster_ip == "None"
        # The NetworkPolicy selects exactly this job's pods, and takes ingress only from them
        # (every port) and to the metrics port from anywhere.
        selector = ",".join(f"{k}={v}" for k, v in fence.spec.pod_selector.match_labels.items())
        assert {p.metadata.name for p in cluster.core.list_namespaced_pod(
            cluster.namespace, label_selector=selector).items} == {p.metadata.name for p in pods}
        peer, scrape = fence.spec.ingress
        assert peer.ports is None and peer._from[0].pod_selector == fence.spec.pod_selector
        assert [p.port for p in scrape.ports] == [9400]

        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        assert b'crucible_operator_jobs{phase="Running"} 1.0' in metrics
        # Counters live as long as the process (other tests' operators ran in this one too).
        created = re.search(rb'crucible_operator_pod_operations_total\{verb="create"\} (\S+)',
                            metrics)
        assert created and float(created.group(1)) >= 3
        assert b"crucible_operator_reconcile_seconds_count" in metrics

        cluster.delete_job("gpt")
        core, rbac = cluster.core, client.RbacAuthorizationV1Api(cluster.api)
        ns = cluster.namespace
        eventually(lambda: not cluster.pods("gpt") and not [
            x for x in (core.list_namespaced_service(ns).items + core.list_namespaced_config_map(
                ns, label_selector=m.LABEL_JOB).items + rbac.list_namespaced_role(ns).items
                + cluster.coordination.list_namespaced_lease(ns).items)], 60,
            "everything the job owned garbage-collected")
    assert_clean_exit(runner, "Running: 3/3 pods running (min 2), generation 0")


def test_no_pod_is_created_while_a_quota_refuses_the_network_policy(cluster, run_operator):
    """A new job's first pass creates its pods right after its NetworkPolicy, in the same pass,
    and only if that create lands: the policy is all that keeps strangers off pod 0's store."""
    quota = client.V1ResourceQuota(
        metadata=client.V1ObjectMeta(name="no-policies"),
        spec=client.V1ResourceQuotaSpec(hard={"count/networkpolicies.networking.k8s.io": "0"}))
    cluster.core.create_namespaced_resource_quota(cluster.namespace, quota)
    eventually(lambda: cluster.core.read_namespaced_resource_quota(
        "no-policies", cluster.namespace).status.hard, 30, "the quota in force")
    with run_operator(cluster.namespace) as runner:
        cluster.create_job("gpt", nodes={"min": 2, "max": 2})
        cluster.wait_event("gpt", "ApiRejected")
        rejected = " ".join(e.message for e in cluster.events("gpt")
                            if e.reason == "ApiRejected")
        assert "create NetworkPolicy/gpt: HTTP 403" in rejected and "Pod/" not in rejected
        # Retried with a backoff (2, 4, 8 s): several passes, and never a pod.
        eventually(lambda: max(e.count or 1 for e in cluster.events("gpt")
                               if e.reason == "ApiRejected") >= 2, 30, "a second refusal")
        assert cluster.pods("gpt") == []
        held = cluster.status("gpt")
        # Not started: no start time (goodput, the checkpoint-age alert and the waitlist
        # count from it), and no room kept for pods that were never made.
        assert held["phase"] == "Pending" and "startTime" not in held
        cluster.core.delete_namespaced_resource_quota("no-policies", cluster.namespace)
        cluster.wait_running("gpt", 2, generation=0)
        assert client.NetworkingV1Api(cluster.api).read_namespaced_network_policy(
            "gpt", cluster.namespace)
        cluster.delete_job("gpt")
    assert_clean_exit(runner, "held for a later pass: create Pod/gpt-0-0: NetworkPolicy/gpt did "
                      "not land")


def test_suspend_deletes_pods_and_resume_starts_a_new_generation(cluster, run_operator):
    with run_operator(cluster.namespace) as runner:
        cluster.create_job("gpt", nodes={"min": 2, "max": 2})
        cluster.wait_running("gpt", 2, generation=0)
        cluster.patch_spec("gpt", {"suspend": True})
        cluster.wait_phase("gpt", "Suspended")
        eventually(lambda: not cluster.pods("gpt"), 30, "pods gone while suspended")
        assert cluster.coordination.read_namespaced_lease("gpt-progress", cluster.namespace)
        cluster.patch_spec("gpt", {"suspend": False})
        cluster.wait_running("gpt", 2, generation=1)
        status = cluster.wait_phase("gpt", "Running")
        assert status["podGeneration"] == 1 and status["restarts"]["total"] == 0
        conditions = {c["type"]: c for c in status["conditions"]}
        assert conditions["Suspended"]["status"] == "False"
        cluster.wait_event("gpt", "Suspended")
        cluster.wait_event("gpt", "Running")
        cluster.delete_job("gpt")
        eventually(lambda: not cluster.pods("gpt"), 30, "pods gone after delete")
    assert_clean_exit(runner, "Suspended: suspended", "Resumed: resumed after suspension")


def test_a_pod_exiting_0_completes_the_job_and_ttl_deletes_it(cluster, run_operator):
    with run_operator(cluster.namespace) as runner:
        cluster.create_job("gpt", nodes={"min": 2, "max": 2}, ttlSecondsAfterFinished=3)
        cluster.wait_running("gpt", 2, generation=0)
        cluster.succeed_pod("gpt-0-1")
        status = cluster.wait_phase("gpt", "Succeeded", 30)
        assert status["completionTime"]
        eventually(lambda: not cluster.objs.list_namespaced_custom_object(
            "crucible.dev", "v1alpha1", cluster.namespace, "pretrainjobs")["items"], 30,
            "job deleted by its TTL")
    assert_clean_exit(runner, "Succeeded: pod gpt-0-1 exited 0: training complete")


def test_unschedulable_pods_are_reported_with_the_schedulers_reason(cluster, run_operator):
    with run_operator(cluster.namespace) as runner:
        cluster.create_job("gpt", nodes={"min": 1, "max": 1},
                           scheduling={"nodeSelector": {"crucible.dev/pool": "tpu"}})
        status = eventually(lambda: (s := cluster.status("gpt")) and any(
            c["type"] == "PodsScheduled" and c["reason"] == "InsufficientCapacity"
            for c in s.get("conditions", [])) and s, 30, "PodsScheduled=False, InsufficientCapacity")
        scheduled = next(c for c in status["conditions"] if c["type"] == "PodsScheduled")
        assert scheduled["status"] == "False"
        assert "node(s) didn't match Pod's node affinity/selector" in scheduled["message"]
        assert status["phase"] == "Waiting"      # for a node that fits: never Failed for it
        cluster.wait_event("gpt", "InsufficientCapacity")
        cluster.delete_job("gpt")
    assert_clean_exit(runner, "InsufficientCapacity: waiting for capacity: only 0 of nodes.min=1")
