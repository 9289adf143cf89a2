"""Kueue on the local stack is real: it admits Workloads against quota, and its webhooks run.

The stack registers only Kueue's own admission webhooks (kueue.x-k8s.io) and enables no job
integration, so these tests create Workloads directly, as an operator that owns them would.
"""

from __future__ import annotations

import json
import secrets

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tests.support.services import eventually

pytestmark = pytest.mark.stack

GROUP, VERSION = "kueue.x-k8s.io", "v1beta2"


def _condition(obj: dict, kind: str) -> dict | None:
    return next((c for c in obj.get("status", {}).get("conditions", []) if c["type"] == kind),
                None)


def _refusal(err: ApiException) -> str:
    assert err.status == 403, err  # a webhook's denial, not the schema's 422
    return json.loads(err.body)["message"]


def _workload(name: str, queue: str, cpu: str, gpus: str, count: int = 2,
              extra_requests: dict | None = None) -> dict:
    requests = {"cpu": cpu, "nvidia.com/gpu": gpus, **(extra_requests or {})}
    return {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "Workload",
        "metadata": {"name": name},
        "spec": {
            "queueName": queue,
            "podSets": [{
                "name": "workers", "count": count,
                "template": {"spec": {
                    "restartPolicy": "Never",
                    "containers": [{"name": "trainer", "image": "crucible-trainer:test",
                                    "resources": {"requests": requests,
                                                  "limits": {"nvidia.com/gpu": gpus}}}],
                }},
            }],
        },
    }


class Queues:
    """A ResourceFlavor, a ClusterQueue (cpu 4, nvidia.com/gpu 32) and a LocalQueue, for one
    test namespace; deleted afterwards in the order Kueue's in-use finalizers allow."""

    def __init__(self, api, namespace: str):
        self.objs = client.CustomObjectsApi(api)
        self.namespace = namespace
        self.flavor = f"t-kueue-{secrets.token_hex(3)}"
        self.cluster_queue = self.flavor
        self.local_queue = "lq"
        self.cluster_scoped: list[tuple[str, str]] = []  # (plural, name), creation order

    def create_cluster(self, plural: str, body: dict) -> dict:
        created = self.objs.create_cluster_custom_object(GROUP, VERSION, plural, body)
        self.cluster_scoped.append((plural, body["metadata"]["name"]))
        return created

    def create(self, plural: str, body: dict) -> dict:
        return self.objs.create_namespaced_custom_object(GROUP, VERSION, self.namespace, plural,
                                                         body)

    def get(self, plural: str, name: str, version: str = VERSION) -> dict:
        return self.objs.get_namespaced_custom_object(GROUP, version, self.namespace, plural, name)

    def set_up(self) -> None:
        self.create_cluster("resourceflavors", {
            "apiVersion": f"{GROUP}/{VERSION}", "kind": "ResourceFlavor",
            "metadata": {"name": self.flavor}, "spec": {}})
        self.create_cluster("clusterqueues", {
            "apiVersion": f"{GROUP}/{VERSION}", "kind": "ClusterQueue",
            "metadata": {"name": self.cluster_queue},
            "spec": {
                # Only this test's namespace: queues of tests running beside it stay apart.
                "namespaceSelector": {"matchLabels": {
                    "kubernetes.io/metadata.name": self.namespace}},
                "resourceGroups": [{
                    "coveredResources": ["cpu", "nvidia.com/gpu"],
                    "flavors": [{"name": self.flavor, "resources": [
                        {"name": "cpu", "nominalQuota": "4"},
                        {"name": "nvidia.com/gpu", "nominalQuota": "32"}]}],
                }],
            }})
        self.create("localqueues", {
            "apiVersion": f"{GROUP}/{VERSION}", "kind": "LocalQueue",
            "metadata": {"name": self.local_queue},
            "spec": {"clusterQueue": self.cluster_queue}})
        eventually(lambda: (_condition(self.objs.get_cluster_custom_object(
            GROUP, VERSION, "clusterqueues", self.cluster_queue), "Active") or {}).get(
            "status") == "True", 30, f"ClusterQueue {self.cluster_queue} Active")

    def tear_down(self) -> None:
        # Workloads first (an admitted one holds the ClusterQueue's finalizer), then the queues;
        # a ResourceFlavor is released once no ClusterQueue names it.
        for plural in ("workloads", "localqueues"):
            self.objs.delete_collection_namespaced_custom_object(GROUP, VERSION, self.namespace,
                                                                 plural)
            eventually(lambda: not self.objs.list_namespaced_custom_object(
                GROUP, VERSION, self.namespace, plural)["items"], 30, f"{plural} deleted")
        for plural, name in reversed(self.cluster_scoped):
            try:
                self.objs.delete_cluster_custom_object(GROUP, VERSION, plural, name)
            except ApiException as err:
                if err.status != 404:
                    raise
            eventually(lambda: not self._exists(plural, name), 30, f"{plural}/{name} deleted")

    def _exists(self, plural: str, name: str) -> bool:
        try:
            self.objs.get_cluster_custom_object(GROUP, VERSION, plural, name)
        except ApiException as err:
            if err.status == 404:
                return False
            raise
        return True


@pytest.fixture
def queues(stack_env, kube, namespace):
    if "CRUCIBLE_KUEUE_READYZ_URL" not in stack_env:
        pytest.fail("this stack runs no Kueue (its env has no CRUCIBLE_KUEUE_READYZ_URL)",
                    pytrace=False)
    q = Queues(kube.client(), namespace)
    try:
        q.set_up()
        yield q
    finally:
        q.tear_down()


def test_workloads_are_admitted_within_quota_and_queue_beyond_it(queues):
    # 2 pods x (1 cpu, 8 GPUs) fits the 4 cpu / 32 GPU quota.
    queues.create("workloads", _workload("fits", queues.local_queue, cpu="1", gpus="8"))

    def admitted() -> dict | None:
        wl = queues.get("workloads", "fits")
        cond = _condition(wl, "Admitted")
        return wl if cond and cond["status"] == "True" else None

    wl = eventually(admitted, 30, "Workload fits Admitted")
    admission = wl["status"]["admission"]
    assert admission["clusterQueue"] == queues.cluster_queue
    [assignment] = admission["podSetAssignments"]
    assert assignment["name"] == "workers" and assignment["count"] == 2
    assert assignment["flavors"] == {"cpu": queues.flavor, "nvidia.com/gpu": queues.flavor}
    assert assignment["resourceUsage"] == {"cpu": "2", "nvidia.com/gpu": "16"}
    assert _condition(wl, "QuotaReserved")["status"] == "True"

    # 2 x 1.5 cpu is more than the 2 cpu left: it waits, and says why.
    queues.create("workloads", _workload("waits", queues.local_queue, cpu="1500m", gpus="8"))

    def pending() -> dict | None:
        cond = _condition(queues.get("workloads", "waits"), "QuotaReserved")
        return cond if cond and cond["status"] == "False" and cond.get("message") else None

    cond = eventually(pending, 30, "Workload waits reported as pending")
    assert cond["reason"] == "Pending", cond
    assert "insufficient unused quota for cpu" in cond["message"], cond
    waiting = queues.get("workloads", "waits")
    assert "admission" not in waiting.get("status", {})
    assert (_condition(waiting, "Admitted") or {}).get("status") != "True"

    # The stored v1beta2 object reads back as v1beta1 through Kueue's conversion webhook.
    old = queues.get("workloads", "fits", version="v1beta1")
    assert old["apiVersion"] == f"{GROUP}/v1beta1"
    assert old["spec"]["podSets"][0]["count"] == 2


def test_kueue_validating_webhooks_refuse_what_only_go_code_checks(queues):
    # lendingLimit > nominalQuota passes the CRD schema (no CEL rule covers it); only the
    # ClusterQueue webhook's Go validation refuses it.
    cq = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ClusterQueue",
          "metadata": {"name": f"{queues.cluster_queue}-bad"},
          "spec": {"cohortName": "t-kueue-cohort", "resourceGroups": [{
              "coveredResources": ["cpu"],
              "flavors": [{"name": queues.flavor, "resources": [
                  {"name": "cpu", "nominalQuota": "4", "lendingLimit": "8"}]}]}]}}
    with pytest.raises(ApiException) as refused:
        queues.create_cluster("clusterqueues", cq)
    message = _refusal(refused.value)
    assert message.startswith('admission webhook "vclusterqueue.kb.io" denied the request'), message
    assert 'lendingLimit: Invalid value: "8": must be less than or equal to the nominalQuota' \
        in message, message

    # A Workload that requests the "pods" resource: reserved for Kueue, refused by its webhook.
    bad = _workload("bad", queues.local_queue, cpu="1", gpus="1", extra_requests={"pods": "1"})
    with pytest.raises(ApiException) as refused:
        queues.create("workloads", bad)
    message = _refusal(refused.value)
    assert message.startswith('admission webhook "vworkload.kb.io" denied the request'), message
    assert "the key is reserved for internal kueue use" in message, message
