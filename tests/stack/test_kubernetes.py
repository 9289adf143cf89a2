"""The local control plane is real: apiserver validation, scheduler binding, node lifecycle."""

from __future__ import annotations

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tests.support.services import eventually

pytestmark = pytest.mark.stack

GROUP = "stacktest.crucible.dev"


def _crd() -> dict:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"widgets.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
            "versions": [{
                "name": "v1", "served": True, "storage": True,
                "schema": {"openAPIV3Schema": {
                    "type": "object",
                    "properties": {"spec": {
                        "type": "object",
                        "required": ["size"],
                        "properties": {"size": {"type": "integer", "minimum": 1, "maximum": 8},
                                       "color": {"type": "string"}},
                    }},
                }},
            }],
        },
    }


def test_crd_established_and_custom_objects_round_trip(kube, namespace):
    api = kube.client()
    ext = client.ApiextensionsV1Api(api)
    try:
        ext.create_custom_resource_definition(_crd())
    except ApiException as err:
        assert err.status == 409, err  # left by an earlier run: same definition
    eventually(lambda: any(c.type == "Established" and c.status == "True"
                           for c in ext.read_custom_resource_definition(
                               f"widgets.{GROUP}").status.conditions or []),
               30, "CRD Established")

    objs = client.CustomObjectsApi(api)
    body = {"apiVersion": f"{GROUP}/v1", "kind": "Widget", "metadata": {"name": "w1"},
            "spec": {"size": 3, "color": "red"}}
    # Discovery of a just-established CRD can lag by a moment: retry the first create.
    eventually(lambda: objs.create_namespaced_custom_object(GROUP, "v1", namespace, "widgets", body),
               15, "first custom object created")
    got = objs.get_namespaced_custom_object(GROUP, "v1", namespace, "widgets", "w1")
    assert got["spec"] == {"size": 3, "color": "red"}

    objs.patch_namespaced_custom_object(GROUP, "v1", namespace, "widgets", "w1",
                                        {"spec": {"size": 5}})
    got = objs.get_namespaced_custom_object(GROUP, "v1", namespace, "widgets", "w1")
    assert got["spec"] == {"size": 5, "color": "red"}

    bad = {"apiVersion": f"{GROUP}/v1", "kind": "Widget", "metadata": {"name": "w2"},
           "spec": {"size": 99}}
    with pytest.raises(ApiException) as rejected:
        objs.create_namespaced_custom_object(GROUP, "v1", namespace, "widgets", bad)
    assert rejected.value.status == 422
    assert "spec.size" in rejected.value.body and "less than or equal to 8" in rejected.value.body

    objs.delete_namespaced_custom_object(GROUP, "v1", namespace, "widgets", "w1")
    listed = objs.list_namespaced_custom_object(GROUP, "v1", namespace, "widgets")
    assert listed["items"] == []


def _pod(name: str, node: str | None = None, tolerate_unreachable_s: int | None = None):
    spec = client.V1PodSpec(
        containers=[client.V1Container(
            name="main", image="registry.invalid/crucible-trainer:test",
            resources=client.V1ResourceRequirements(limits={"nvidia.com/gpu": "1"}))],
        node_selector={"kubernetes.io/hostname": node} if node else {"crucible.dev/pool": "gpu"},
    )
    if tolerate_unreachable_s is not None:
        spec.tolerations = [client.V1Toleration(key="node.kubernetes.io/unreachable",
                                                operator="Exists", effect="NoExecute",
                                                toleration_seconds=tolerate_unreachable_s)]
    return client.V1Pod(metadata=client.V1ObjectMeta(name=name), spec=spec)


def test_scheduler_binds_pod_to_kwok_node_and_it_runs(kube, namespace):
    core = kube.core()
    core.create_namespaced_pod(namespace, _pod("gpu-pod"))

    def running():
        pod = core.read_namespaced_pod("gpu-pod", namespace)
        return pod if pod.status.phase == "Running" else None

    pod = eventually(running, 60, "pod Running")
    assert pod.spec.node_name in kube.nodes
    scheduled = [c for c in pod.status.conditions if c.type == "PodScheduled"]
    assert scheduled and scheduled[0].status == "True"
    events = core.list_namespaced_event(namespace, field_selector="involvedObject.name=gpu-pod")
    assert any(e.reason == "Scheduled" and e.source.component == "default-scheduler"
               for e in events.items) or any(
        e.reason == "Scheduled" and (e.reporting_component or "") == "default-scheduler"
        for e in events.items)


def test_node_losing_heartbeat_is_tainted_and_its_pod_evicted(kube, namespace):
    core = kube.core()
    victim = kube.nodes[-1]
    # An earlier test may have stopped this node's heartbeat: while it is still tainted
    # unreachable, the pod below (tolerating 2 s) would be evicted before it ever ran.
    kube.set_node_alive(victim, True)
    kube.wait_nodes_healthy([victim])
    core.create_namespaced_pod(namespace, _pod("victim-pod", node=victim, tolerate_unreachable_s=2))
    eventually(lambda: core.read_namespaced_pod("victim-pod", namespace).status.phase == "Running",
               120, "victim pod Running")
    kube.set_node_alive(victim, False)
    try:
        def unreachable():
            node = core.read_node(victim)
            ready = next(c for c in node.status.conditions if c.type == "Ready")
            taints = {(t.key, t.effect) for t in node.spec.taints or []}
            return ready.status == "Unknown" and (
                "node.kubernetes.io/unreachable", "NoExecute") in taints

        eventually(unreachable, 45, f"{victim} Ready=Unknown with the unreachable taint")

        # tolerationSeconds=2 has run out: the taint-eviction controller deletes the pod. With
        # no kubelet on the dead node the pod stays Terminating, as on a real cluster.
        def evicted():
            pod = core.read_namespaced_pod("victim-pod", namespace)
            return pod if pod.metadata.deletion_timestamp else None

        pod = eventually(evicted, 30, "victim pod marked for deletion")
        disruption = [c for c in pod.status.conditions or [] if c.type == "DisruptionTarget"]
        assert disruption and disruption[0].reason == "DeletionByTaintManager"
    finally:
        kube.set_node_alive(victim, True)
    kube.wait_nodes_healthy([victim])
