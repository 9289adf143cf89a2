"""A job naming a Secret or PriorityClass that does not exist says so, on the real control plane.

The PriorityClass is the apiserver's own check (its Priority admission refuses the pod); the
Secret is the kubelet's, and KWOK runs no kubelet that resolves env, so the test writes the pod
status a kubelet writes then (`Cluster.config_error_pod`) and says so here.
"""

from __future__ import annotations

import time

import pytest
from kubernetes import client

from tests.support.operator_run import assert_clean_exit
from tests.support.services import eventually

pytestmark = pytest.mark.stack


def _condition(cluster, job: str, type_: str) -> dict | None:
    return next((c for c in cluster.status(job).get("conditions") or []
                 if c["type"] == type_), None)


def test_a_missing_secret_is_a_condition_within_one_pass_and_one_event(cluster, run_operator):
    with run_operator(cluster.namespace) as runner:
        cluster.create_job("gpt", nodes={"min": 1, "max": 1},
                           checkpoint={"uri": "s3://crucible/runs/gpt",
                                       "credentialsSecret": "team-s3"})
        cluster.wait_running("gpt", 1, generation=0)
        cluster.config_error_pod("gpt-0-0", 'secret "team-s3" not found')
        missing = eventually(lambda: (c := _condition(cluster, "gpt", "CredentialsMissing"))
                             and c["status"] == "True" and c, 15, "CredentialsMissing")
        assert "Secret team-s3" in missing["message"]
        time.sleep(3)   # more passes: still one event
        events = [e for e in cluster.events("gpt") if e.reason == "CredentialsMissing"]
        assert len(events) == 1 and (events[0].count or 1) == 1, events
        assert "team-s3" in events[0].message
        cluster.delete_job("gpt")
    assert_clean_exit(runner, "CredentialsMissing")


def test_a_missing_priority_class_holds_the_pods_until_it_exists(cluster, run_operator):
    scheduling = client.SchedulingV1Api(cluster.api)
    name = f"crucible-test-{cluster.namespace}"[:63]
    try:
        with run_operator(cluster.namespace) as runner:
            cluster.create_job("gpt", nodes={"min": 1, "max": 1},
                               scheduling={"priorityClassName": name})
            missing = eventually(lambda: (c := _condition(cluster, "gpt", "PriorityClassMissing"))
                                 and c["status"] == "True" and c, 15, "PriorityClassMissing")
            assert f"PriorityClass {name}" in missing["message"]
            assert cluster.pods("gpt") == []
            cluster.wait_event("gpt", "PriorityClassMissing", count=1)
            scheduling.create_priority_class(client.V1PriorityClass(
                metadata=client.V1ObjectMeta(name=name), value=1000))
            [pod] = cluster.wait_running("gpt", 1, generation=0)
            assert pod.spec.priority_class_name == name and pod.spec.priority == 1000
            eventually(lambda: _condition(cluster, "gpt", "PriorityClassMissing")["status"]
                       == "False", 15, "PriorityClassMissing resolved")
            cluster.delete_job("gpt")
        assert_clean_exit(runner, "PriorityClassMissing")
    finally:
        try:
            scheduling.delete_priority_class(name)
        except client.exceptions.ApiException:
            pass


def test_every_child_the_operator_renders_passes_a_strict_server_side_dry_run(cluster):
    """Each object a job owns, as the operator would create it (metrics scrapers set, workload
    identity and bounded volumes on), is exactly what the apiserver's schema accepts."""
    from crucible.operator import manifests as m
    from crucible.operator.cluster_policy import ClusterPolicy
    from tests.operator import builders as b
    from tests.support.apply import strict_dry_run

    scrapers = ClusterPolicy.from_settings("*", 6, '[{"namespaceSelector": {"matchLabels": '
                                           '{"kubernetes.io/metadata.name": "monitoring"}}}]')
    spec = b.spec(serviceAccount={"annotations": {"eks.amazonaws.com/role-arn": "arn:aws:iam::1:role/x"}},
                  checkpoint={"signingKeySecret": "ckpt-hmac"}, shmSizeLimit="2Gi")
    ns, uid = cluster.namespace, "00000000-0000-0000-0000-000000000001"
    docs = m.static_children("gpt", ns, uid, spec, scrapers.metrics_from)
    docs.append(m.pod("gpt", ns, uid, spec, 0, 0, avoid_nodes=["gpu-node-9"]))
    for doc in docs:   # the owner does not exist: dry run would still check the reference
        doc["metadata"].pop("ownerReferences")
    # Pod admission reads the ServiceAccount, which a dry run does not create.
    [account] = [d for d in docs if d["kind"] == "ServiceAccount"]
    cluster.core.create_namespaced_service_account(ns, account)
    assert strict_dry_run(cluster.api, docs, ns) == []
    # Not a rubber stamp: a misspelt field is refused.
    docs[-1]["spec"]["containers"][0]["volumeMount"] = []
    assert strict_dry_run(cluster.api, docs[-1:], ns)
