"""A job's pods never outrun what fences and serves them, through the real adapter.

A new job's first pass creates its children and its pods together (operator/kube.py,
`Kube.apply`: children, then RoleBindings, then pods). Pod 0 hosts torch's c10d store, which
unpickles what it is sent: a pod may exist only behind the job's own NetworkPolicy, as the job
renders it now. Each case runs `decide` on a real PretrainJob (no operator running) and the
adapter against the stack's apiserver, then looks at what exists.
"""

from __future__ import annotations

import datetime as dt

import pytest
from kubernetes import client

from crucible.operator import manifests as m
from crucible.operator.decision import decide
from crucible.operator.observed import Observed, job_view
from tests.operator import builders as b
from tests.operator.passes import pass_memo

pytestmark = pytest.mark.stack


@pytest.fixture
def fresh(cluster):
    """A real PretrainJob (its UID owns what the adapter creates) and an adapter."""
    cluster.create_job("gpt", nodes={"min": 2, "max": 2})
    job = job_view(cluster.job("gpt"))
    memo = pass_memo(cluster.api)
    try:
        yield cluster, job, memo.kube
    finally:
        memo.executor.shutdown(wait=False)
        memo.kube.events.shutdown(wait=False)


def first_pass(job):
    """The first pass's decision: nothing of the job's exists yet."""
    return decide(job, Observed(pods=(), nodes=b.healthy_nodes(), children=frozenset()),
                  dt.datetime.now(dt.timezone.utc))




def test_the_first_pass_creates_the_pods_behind_their_policy(fresh):
    cluster, job, kube = fresh
    applied = kube.apply(job, first_pass(job))
    assert applied.created_pods == ["gpt-0-0"] and not applied.held, applied
    assert client.NetworkingV1Api(cluster.api).read_namespaced_network_policy(
        "gpt", cluster.namespace)
    assert [p.metadata.name for p in cluster.pods("gpt")] == ["gpt-0-0"]


def test_a_strangers_role_binding_of_the_jobs_name_keeps_every_pod_back(fresh):
    cluster, job, kube = fresh
    client.RbacAuthorizationV1Api(cluster.api).create_namespaced_role_binding(
        cluster.namespace, client.V1RoleBinding(
            metadata=client.V1ObjectMeta(name="gpt-trainer"),
            role_ref=client.V1RoleRef(api_group="rbac.authorization.k8s.io", kind="ClusterRole",
                                      name="view"),
            subjects=[client.RbacV1Subject(kind="ServiceAccount", name="default",
                                           namespace=cluster.namespace)]))
    applied = kube.apply(job, first_pass(job))
    assert applied.conflicts == [("RoleBinding", "gpt-trainer")]
    assert applied.held == ["create Pod/gpt-0-0: RoleBinding/gpt-trainer is someone else's"]
    assert applied.created_pods == [] and cluster.pods("gpt") == []


def test_an_own_policy_rendered_from_older_settings_is_replaced_before_the_pods(fresh):
    cluster, job, kube = fresh
    outcome = first_pass(job)
    wanted = next(a.body for a in outcome.actions if a.kind == "NetworkPolicy")
    old = {**wanted, "metadata": {**wanted["metadata"], "annotations": {
        **wanted["metadata"]["annotations"], m.ANNOTATION_POLICY_DIGEST: "0123456789abcdef"}},
           "spec": {**wanted["spec"], "ingress": [{}]}}         # open to everyone
    net = client.NetworkingV1Api(cluster.api)
    net.create_namespaced_network_policy(cluster.namespace, old)   # the index has not shown it
    applied = kube.apply(job, outcome)
    assert applied.created_pods == ["gpt-0-0"] and not applied.held, applied
    now = net.read_namespaced_network_policy("gpt", cluster.namespace)
    assert now.metadata.annotations[m.ANNOTATION_POLICY_DIGEST] == \
        wanted["metadata"]["annotations"][m.ANNOTATION_POLICY_DIGEST]
    assert now.spec.ingress[0]._from, "the open policy was left in place"


def test_an_own_policy_being_deleted_keeps_the_pods_back(fresh):
    cluster, job, kube = fresh
    outcome = first_pass(job)
    wanted = next(a.body for a in outcome.actions if a.kind == "NetworkPolicy")
    held = {**wanted, "metadata": {**wanted["metadata"], "finalizers": ["example.com/hold"]}}
    net = client.NetworkingV1Api(cluster.api)
    net.create_namespaced_network_policy(cluster.namespace, held)
    net.delete_namespaced_network_policy("gpt", cluster.namespace)    # Terminating
    try:
        applied = kube.apply(job, outcome)
        assert any("being deleted" in line for line in applied.transient), applied
        assert applied.held and applied.created_pods == [] and cluster.pods("gpt") == []
    finally:
        net.patch_namespaced_network_policy("gpt", cluster.namespace,
                                            {"metadata": {"finalizers": None}})


def test_a_policy_create_only_awaited_from_an_earlier_pass_does_not_count(fresh):
    cluster, job, kube = fresh
    # An earlier pass's create of the policy, not shown by the watch yet: the policy may have
    # gone since (deleted, or a namesake job's), so it fences nothing this pass can see.
    kube.expected.expect((job.namespace, job.name), "NetworkPolicy", "gpt")
    in_flight = kube.expected.pending((job.namespace, job.name))
    applied = kube.apply(job, first_pass(job), in_flight)
    assert applied.held and applied.created_pods == [] and cluster.pods("gpt") == []
    with pytest.raises(client.exceptions.ApiException) as missing:
        client.NetworkingV1Api(cluster.api).read_namespaced_network_policy(
            "gpt", cluster.namespace)
    assert missing.value.status == 404
