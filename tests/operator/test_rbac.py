"""Least privilege, checked with real ServiceAccount tokens against the RBAC-enabled apiserver.

The operator's identity is manifests/rbac/operator.yaml as committed (every cluster test runs the
operator under it, so "enough" is proven there); here: what it must NOT be able to do, and that
the trainer pods' per-job identity can touch its own progress Lease and nothing else.
"""

from __future__ import annotations

import json

import pytest
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from tests.operator.test_progress_lease import trainer_kubeconfig
from tests.support.operator_run import assert_clean_exit
from tests.support.services import eventually

pytestmark = pytest.mark.stack


def _status(call) -> int:
    try:
        call()
    except ApiException as err:
        return err.status
    return 200


def test_operator_identity_cannot_read_secrets_or_delete_nodes(operator_kubeconfig, kube,
                                                               namespace):
    api = config.new_client_from_config(config_file=str(operator_kubeconfig))
    core = client.CoreV1Api(api)
    assert _status(lambda: core.list_namespaced_secret(namespace)) == 403
    assert _status(lambda: core.delete_node(kube.nodes[0])) == 403
    assert _status(lambda: client.AppsV1Api(api).list_namespaced_deployment(namespace)) == 403
    assert _status(lambda: core.list_node()) == 200


def test_the_operators_writes_are_fenced_to_what_its_code_does(operator_kubeconfig, kube,
                                                               namespace):
    """A stolen operator token cannot edit the cluster's Services, run a pod as another account
    or as root, or relabel and taint nodes; it can still cordon and annotate (crucible.dev/*)."""
    api = config.new_client_from_config(config_file=str(operator_kubeconfig))
    core = client.CoreV1Api(api)
    admin = client.CoreV1Api(kube.client())
    assert _status(lambda: core.patch_namespaced_service(
        "kubernetes", "default", {"metadata": {"labels": {"x": "y"}}})) == 403
    pod = {"metadata": {"name": "not-a-trainer"}, "spec": {
        "serviceAccountName": "default",
        "containers": [{"name": "c", "image": "registry.invalid/x:1"}]}}
    # The policies apply a moment after they are created (the admission plugin loads them).
    eventually(lambda: _status(lambda: core.create_namespaced_pod(namespace, pod,
                                                                  dry_run="All")) in (403, 422),
               15, "a pod as another ServiceAccount refused")
    node = kube.nodes[0]
    assert _status(lambda: core.patch_node(node, {"metadata": {"labels": {"evil": "1"}}})) != 200
    assert _status(lambda: core.patch_node(node, {"spec": {"taints": [
        {"key": "evil", "effect": "NoSchedule"}]}})) != 200
    assert _status(lambda: core.patch_node(node, {"metadata": {"annotations": {
        "other.io/x": "1"}}})) != 200
    try:
        assert _status(lambda: core.patch_node(node, {"spec": {"unschedulable": True},
                                                      "metadata": {"annotations": {
                                                          "crucible.dev/failure-reason": "Test"}}})
                       ) == 200
        assert admin.read_node(node).spec.unschedulable is True
    finally:
        admin.patch_node(node, {"spec": {"unschedulable": None}, "metadata": {
            "annotations": {"crucible.dev/failure-reason": None}}})
    assert "evil" not in (admin.read_node(node).metadata.labels or {})


def test_trainer_identity_may_patch_only_its_own_lease(cluster, run_operator, tmp_path):
    with run_operator(cluster.namespace) as runner:
        cluster.create_job("gpt", nodes={"min": 1, "max": 1})
        cluster.create_job("other", nodes={"min": 1, "max": 1})
        cluster.wait_running("gpt", 1)
        cluster.wait_running("other", 1)
        kubeconfig = eventually(lambda: trainer_kubeconfig(cluster, "gpt", tmp_path / "kc"), 20,
                                "the trainer's ServiceAccount")
        api = config.new_client_from_config(config_file=kubeconfig)
        coordination, core = client.CoordinationV1Api(api), client.CoreV1Api(api)
        ns = cluster.namespace
        patch = {"metadata": {"annotations": {"crucible.dev/step": "1"}}}
        # RBAC is eventually consistent: the binding may reach the authorizer a moment after the
        # ServiceAccount exists.
        eventually(lambda: _status(lambda: coordination.patch_namespaced_lease(
            "gpt-progress", ns, patch)) == 200, 20, "the trainer's Role to take effect")
        assert _status(lambda: coordination.read_namespaced_lease("gpt-progress", ns)) == 200
        assert _status(lambda: coordination.patch_namespaced_lease("other-progress", ns, patch)) == 403
        assert _status(lambda: coordination.delete_namespaced_lease("gpt-progress", ns)) == 403
        assert _status(lambda: coordination.list_namespaced_lease(ns)) == 403
        assert _status(lambda: core.list_namespaced_pod(ns)) == 403
        assert _status(lambda: core.list_namespaced_secret(ns)) == 403
        for name in ("gpt", "other"):
            cluster.delete_job(name)
    assert_clean_exit(runner)


def test_a_repeated_event_is_one_object_with_a_count(kube, namespace, operator_kubeconfig):
    """Through the operator's own credentials: a repeat raises the count of the first Event,
    also after the operator restarts (a new adapter, no memory of it)."""
    from crucible.operator.decision import Event
    from crucible.operator.kube import Kube as Adapter
    from crucible.operator.observed import JobView

    job = JobView(name="gpt", namespace=namespace, uid="0d9d3b5e-0000-4000-8000-000000000001",
                  generation=1, spec={}, status={}, deleting=False)
    refused = Event("Warning", "ApiRejected", "pods \"gpt-0-1\" is forbidden: exceeded quota")

    def adapter() -> Adapter:
        return Adapter(config.new_client_from_config(config_file=str(operator_kubeconfig)))

    first = adapter()
    assert first.post_events(job, [refused, refused]) == []
    assert adapter().post_events(job, [refused]) == []  # restarted: carries on from the count
    assert adapter().post_events(job, [Event("Normal", "Running", "4/4 pods running")]) == []
    events = kube.core().list_namespaced_event(namespace).items
    counts = sorted((e.reason, e.count) for e in events if e.involved_object.name == "gpt")
    assert counts == [("ApiRejected", 3), ("Running", 1)]


def test_children_owned_with_block_owner_deletion_pass_the_owner_references_plugin(
        operator_kubeconfig, kube, namespace, crd, tmp_path):
    """The stack's apiserver runs OwnerReferencesPermissionEnforcement (as OpenShift does): an
    ownerReference with blockOwnerDeletion needs update on the owner's finalizers. The operator
    holds it, so its children (this one as the manifests render every child's reference) are
    created; an identity with create rights alone is refused, which shows the plugin is on."""
    from crucible.operator import crd as crd_module
    from crucible.operator import manifests as m
    from tests.operator.cluster import job_body
    from tests.support.kubeconfigs import write_kubeconfig

    admin = kube.client()
    job = client.CustomObjectsApi(admin).create_namespaced_custom_object(
        crd_module.GROUP, crd_module.VERSION, namespace, crd_module.PLURAL, job_body("owner"))
    child = {"metadata": {"name": "owner-config", "ownerReferences": [   # as the fence wants
        m.owner_reference("owner", job["metadata"]["uid"])]}, "data": {}}
    assert child["metadata"]["ownerReferences"][0]["blockOwnerDeletion"] is True
    operator = client.CoreV1Api(config.new_client_from_config(str(operator_kubeconfig)))
    assert _status(lambda: operator.create_namespaced_config_map(namespace, child)) == 200

    core = client.CoreV1Api(admin)
    core.create_namespaced_service_account(namespace, {"metadata": {"name": "maker"}})
    rbac = client.RbacAuthorizationV1Api(admin)
    rbac.create_namespaced_role(namespace, {"metadata": {"name": "maker"}, "rules": [
        {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["create"]}]})
    rbac.create_namespaced_role_binding(namespace, {
        "metadata": {"name": "maker"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "maker"},
        "subjects": [{"kind": "ServiceAccount", "name": "maker", "namespace": namespace}]})
    token = core.create_namespaced_service_account_token("maker", namespace, {
        "spec": {"audiences": [], "expirationSeconds": 600}}).status.token
    maker = client.CoreV1Api(config.new_client_from_config(str(write_kubeconfig(
        kube.kubeconfig, token, tmp_path / "maker.kc"))))
    other = {**child, "metadata": {**child["metadata"], "name": "owned-by-maker"}}

    def refusal() -> str | None:
        try:
            maker.create_namespaced_config_map(namespace, other)
        except ApiException as err:
            return err.body if err.status == 403 else None
        raise AssertionError("created without rights on the owner's finalizers")

    # The maker's Role may take a moment to reach the authorizer: until then the refusal is
    # RBAC's own; then it is the plugin's.
    body = eventually(lambda: (b := refusal()) and "blockOwnerDeletion" in b and b, 10,
                      "the plugin refusing blockOwnerDeletion")
    assert "finalizers" in body


def _refused(call, says: str) -> bool:
    """The call is refused by the fence with `says` in the message (False while the admission
    plugin has not loaded the policies yet: retried by `eventually`)."""
    try:
        call()
    except ApiException as err:
        try:
            message = json.loads(err.body)["message"]   # Go's JSON writes < as \u003c
        except (TypeError, ValueError, KeyError):
            message = err.body or ""
        return err.status in (403, 422) and says in message
    return False


def test_a_stolen_operator_token_cannot_delegate_shape_pods_or_write_what_is_not_a_jobs(
        operator_kubeconfig, kube, namespace):
    """The operator may create Roles, RoleBindings, ServiceAccounts, pods, ConfigMaps, Leases,
    Services and NetworkPolicies anywhere, and patch nodes: the admission fence pins each to
    the shape and names the operator renders for a PretrainJob, while everything it renders
    passes (server-side dry runs as the operator's own ServiceAccount)."""
    from crucible.operator import manifests as m
    from tests.operator import builders as b

    api = config.new_client_from_config(config_file=str(operator_kubeconfig))
    core, rbac_api = client.CoreV1Api(api), client.RbacAuthorizationV1Api(api)
    net, coordination = client.NetworkingV1Api(api), client.CoordinationV1Api(api)
    admin = client.CoreV1Api(kube.client())
    uid = "00000000-0000-0000-0000-0000000000aa"
    owner = [m.owner_reference("gpt", uid)]

    # Delegation: binding the operator's own ClusterRole to someone else, in any namespace.
    escalate = {"metadata": {"name": "gpt-trainer", "ownerReferences": owner},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                            "name": "crucible-operator"},
                "subjects": [{"kind": "User", "name": "mallory",
                              "apiGroup": "rbac.authorization.k8s.io"}]}
    eventually(lambda: _refused(lambda: rbac_api.create_namespaced_role_binding(
        "kube-system", escalate, dry_run="All"), "RoleBindings named <job>-trainer"),
        20, "a delegating RoleBinding refused")
    role = m.role("gpt", namespace, uid)
    # A right the operator holds (RBAC's escalation check would refuse any other): handing it
    # to a trainer is still delegation.
    role["rules"].append({"apiGroups": [""], "resources": ["pods"], "verbs": ["delete"]})
    assert _refused(lambda: rbac_api.create_namespaced_role(namespace, role, dry_run="All"),
                    "granting get and patch on that job's")
    assert _refused(lambda: core.create_namespaced_service_account(namespace, {
        "metadata": {"name": "admin-ish", "ownerReferences": owner}}, dry_run="All"),
        "ServiceAccounts named <job>-trainer")

    # Pods: what the operator renders passes; each hardening taken away is refused.
    account = m.service_account("gpt", namespace, uid, b.spec())
    admin.create_namespaced_service_account(namespace, {**account, "metadata": {
        k: v for k, v in account["metadata"].items() if k != "ownerReferences"}})
    good = m.pod("gpt", namespace, uid, b.spec(), 0, 0)
    eventually(lambda: _status(lambda: core.create_namespaced_pod(namespace, good,
                                                                  dry_run="All")) == 200,
               20, "the operator's own pod admitted")

    def pod_with(change) -> dict:
        doc = m.pod("gpt", namespace, uid, b.spec(), 0, 0)
        change(doc["spec"])
        return doc

    container = {"name": "root", "image": "registry.invalid/x:1",
                 "securityContext": {"privileged": True, "runAsUser": 0}}
    attacks = {
        "init": lambda s: s.update(initContainers=[container]),
        "caps": lambda s: s["containers"][0]["securityContext"]["capabilities"].update(
            add=["SYS_ADMIN"]),
        "hostPort": lambda s: s["containers"][0]["ports"].append(
            {"containerPort": 22, "hostPort": 22}),
        "seccomp": lambda s: s["containers"][0]["securityContext"].update(
            seccompProfile={"type": "Unconfined"}),
        "root": lambda s: s["containers"][0]["securityContext"].update(runAsUser=0),
        "secret": lambda s: s["volumes"].append({"name": "s", "secret": {"secretName": "x"}}),
        "pvc": lambda s: s["volumes"].append(
            {"name": "p", "persistentVolumeClaim": {"claimName": "x"}}),
        "config": lambda s: s["volumes"][0]["configMap"].update(name="kube-root-ca.crt"),
    }
    for name, change in attacks.items():
        assert _status(lambda: core.create_namespaced_pod(namespace, pod_with(change),
                                                          dry_run="All")) in (403, 422), name

    # Nodes: no ownerReference (the garbage collector would delete the node), no finalizer,
    # and no lifting of a cordon the operator did not set.
    node = kube.nodes[1]
    assert _status(lambda: core.patch_node(node, {"metadata": {"ownerReferences": owner}},
                                           dry_run="All")) in (403, 422)
    assert _status(lambda: core.patch_node(node, {"metadata": {"finalizers": ["x.io/hold"]}},
                                           dry_run="All")) in (403, 422)
    admin.patch_node(node, {"spec": {"unschedulable": True}})
    try:
        assert _refused(lambda: core.patch_node(node, {"spec": {"unschedulable": False}},
                                                dry_run="All"), "lift only its own cordons")
        admin.patch_node(node, {"metadata": {"annotations": {
            "crucible.dev/cordoned-by": f"{namespace}/gpt"}}})
        assert _status(lambda: core.patch_node(node, {"spec": {"unschedulable": False}},
                                               dry_run="All")) == 200
    finally:
        admin.patch_node(node, {"spec": {"unschedulable": None}, "metadata": {
            "annotations": {"crucible.dev/cordoned-by": None}}})

    # Objects that are not a job's: deleted, patched or made to look like one.
    admin.create_namespaced_pod(namespace, {"metadata": {"name": "bystander"}, "spec": {
        "containers": [{"name": "c", "image": "registry.invalid/x:1"}]}})
    assert _refused(lambda: core.delete_namespaced_pod("bystander", namespace, dry_run="All"),
                    "deletes only pods controlled by a PretrainJob")
    admin.create_namespaced_config_map(namespace, {"metadata": {"name": "coredns"},
                                                   "data": {"Corefile": "."}})
    assert _refused(lambda: core.patch_namespaced_config_map(
        "coredns", namespace, {"data": {"Corefile": "evil"}}, dry_run="All"),
        "ConfigMaps named <job>-config")
    client.CoordinationV1Api(kube.client()).create_namespaced_lease(
        namespace, {"metadata": {"name": "kube-scheduler"}, "spec": {}})
    assert _refused(lambda: coordination.patch_namespaced_lease(
        "kube-scheduler", namespace, {"spec": {"holderIdentity": "mallory"}}, dry_run="All"),
        "Leases named <job>-progress")
    service = m.service("gpt", namespace, uid)
    service["spec"] = {"type": "ClusterIP", "externalIPs": ["203.0.113.7"],
                       "ports": [{"port": 443}]}
    assert _refused(lambda: core.create_namespaced_service(namespace, service, dry_run="All"),
                    "without external IPs")
    policy = m.network_policy("gpt", namespace, uid)
    policy["spec"]["podSelector"] = {}
    assert _refused(lambda: net.create_namespaced_network_policy(namespace, policy,
                                                                 dry_run="All"),
                    "selecting that job's pods")
    # ... while every child the operator renders for a job passes.
    for doc in m.static_children("gpt", namespace, uid, b.spec()):
        if doc["kind"] == "ServiceAccount":
            continue   # made above, as the pod needs it
        kind = doc["kind"]
        create = {"Role": lambda d: rbac_api.create_namespaced_role(namespace, d,
                                                                    dry_run="All"),
                  "RoleBinding": lambda d: rbac_api.create_namespaced_role_binding(
                      namespace, d, dry_run="All"),
                  "Lease": lambda d: coordination.create_namespaced_lease(namespace, d,
                                                                          dry_run="All"),
                  "ConfigMap": lambda d: core.create_namespaced_config_map(namespace, d,
                                                                           dry_run="All"),
                  "Service": lambda d: core.create_namespaced_service(namespace, d,
                                                                      dry_run="All"),
                  "NetworkPolicy": lambda d: net.create_namespaced_network_policy(
                      namespace, d, dry_run="All")}[kind]
        assert _status(lambda: create(doc)) == 200, kind
        if kind == "Role":
            # The RoleBinding's escalation check reads the Role, so one must exist: made by the
            # admin without the owner reference, which names no real PretrainJob here and the
            # garbage collector would act on (it deleted the Role before the binding's check).
            client.RbacAuthorizationV1Api(kube.client()).create_namespaced_role(namespace, {
                **doc, "metadata": {k: v for k, v in doc["metadata"].items()
                                    if k != "ownerReferences"}})


def test_a_stolen_operator_token_cannot_touch_a_workload_or_a_pod_that_is_not_a_jobs(
        operator_kubeconfig, kube, namespace):
    """Kueue Workloads and their status, and a running pod's ephemeral containers (a debug
    shell in someone else's pod): the operator may write Workloads anywhere, but the fence
    passes only a PretrainJob's; ephemeral containers are outside its RBAC altogether."""
    from crucible.operator import manifests as m
    from crucible.operator import queueing as q
    from tests.operator import builders as b

    api = config.new_client_from_config(config_file=str(operator_kubeconfig))
    objs, core = client.CustomObjectsApi(api), client.CoreV1Api(api)
    admin_objs, admin = client.CustomObjectsApi(kube.client()), client.CoreV1Api(kube.client())
    uid = "00000000-0000-0000-0000-0000000000ab"
    theirs = q.workload("gpt", namespace, uid, b.spec(), "nowhere", None)
    theirs["metadata"] = {"name": "someone-elses", "namespace": namespace}   # no job owns it
    admin_objs.create_namespaced_custom_object(q.GROUP, q.VERSION, namespace, "workloads",
                                               theirs)
    says = "the operator writes only Kueue Workloads"
    eventually(lambda: _refused(lambda: objs.patch_namespaced_custom_object_status(
        q.GROUP, q.VERSION, namespace, "workloads", "someone-elses",
        {"status": {"conditions": [{"type": "QuotaReserved", "status": "True",
                                    "reason": "Forged", "message": "forged",
                                    "lastTransitionTime": "2026-01-01T00:00:00Z"}]}},
        dry_run="All"), says), 20, "a foreign Workload's status refused")
    assert _refused(lambda: objs.patch_namespaced_custom_object(
        q.GROUP, q.VERSION, namespace, "workloads", "someone-elses",
        {"metadata": {"labels": {"x": "y"}}}, dry_run="All"), says)
    assert _refused(lambda: objs.delete_namespaced_custom_object(
        q.GROUP, q.VERSION, namespace, "workloads", "someone-elses", dry_run="All"), says)
    # Taking it over (adding a job as its owner) is a move between owners, refused too.
    assert _refused(lambda: objs.patch_namespaced_custom_object(
        q.GROUP, q.VERSION, namespace, "workloads", "someone-elses",
        {"metadata": {"ownerReferences": [m.owner_reference("gpt", uid)]}}, dry_run="All"), says)
    # ... while the job's own Workload passes.
    ours = q.workload("gpt", namespace, uid, b.spec(), "nowhere", None)
    assert _status(lambda: objs.create_namespaced_custom_object(
        q.GROUP, q.VERSION, namespace, "workloads", ours, dry_run="All")) == 200

    admin.create_namespaced_pod(namespace, {"metadata": {"name": "debuggee"}, "spec": {
        "containers": [{"name": "c", "image": "registry.invalid/x:1"}]}})
    shell = {"spec": {"ephemeralContainers": [{
        "name": "shell", "image": "registry.invalid/x:1", "targetContainerName": "c",
        "securityContext": {"privileged": True}}]}}
    assert _status(lambda: core.patch_namespaced_pod_ephemeralcontainers(
        "debuggee", namespace, shell, dry_run="All")) == 403
