"""The committed CRD and operator RBAC manifests, and applying documents like them to a cluster."""

from __future__ import annotations

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tests.support.repo import REPO

CRD_FILE = REPO / "manifests" / "crd" / "pretrainjobs.crucible.dev.yaml"
RBAC_FILE = REPO / "manifests" / "rbac" / "operator.yaml"


def apply(api: client.ApiClient, doc: dict) -> None:
    """Create, or replace what an earlier run left (the same generated documents)."""
    kind, name, ns = doc["kind"], doc["metadata"]["name"], doc["metadata"].get("namespace")
    rbac_api, core = client.RbacAuthorizationV1Api(api), client.CoreV1Api(api)
    ext = client.ApiextensionsV1Api(api)
    admission = client.AdmissionregistrationV1Api(api)
    create, replace, read = {
        "CustomResourceDefinition": (lambda: ext.create_custom_resource_definition(doc),
                                     lambda rv: ext.replace_custom_resource_definition(name, doc),
                                     lambda: ext.read_custom_resource_definition(name)),
        "ClusterRole": (lambda: rbac_api.create_cluster_role(doc),
                        lambda rv: rbac_api.replace_cluster_role(name, doc), None),
        "ClusterRoleBinding": (lambda: rbac_api.create_cluster_role_binding(doc),
                               lambda rv: rbac_api.replace_cluster_role_binding(name, doc), None),
        "ServiceAccount": (lambda: core.create_namespaced_service_account(ns, doc),
                           None, None),
        "ValidatingAdmissionPolicy": (
            lambda: admission.create_validating_admission_policy(doc),
            lambda rv: admission.replace_validating_admission_policy(name, doc),
            lambda: admission.read_validating_admission_policy(name)),
        "ValidatingAdmissionPolicyBinding": (
            lambda: admission.create_validating_admission_policy_binding(doc),
            lambda rv: admission.replace_validating_admission_policy_binding(name, doc),
            lambda: admission.read_validating_admission_policy_binding(name)),
    }[kind]
    try:
        create()
    except ApiException as err:
        if err.status != 409:
            raise
        if replace is not None:
            doc.setdefault("metadata", {})
            if read is not None:
                doc["metadata"]["resourceVersion"] = read().metadata.resource_version
            replace(None)


def strict_dry_run(api: client.ApiClient, docs: list[dict], namespace: str | None = None
                   ) -> list[str]:
    """Server-side apply with dryRun=All and fieldValidation=Strict (nothing is stored, an
    unknown field is an error); the apiserver's refusals, one line per document."""
    from kubernetes import dynamic

    resources = dynamic.DynamicClient(api).resources
    refused = []
    for doc in docs:
        resource = resources.get(api_version=doc["apiVersion"], kind=doc["kind"])
        try:
            resources.client.server_side_apply(
                resource, body=doc, namespace=doc["metadata"].get("namespace", namespace),
                field_manager="crucible-test", dry_run="All", force_conflicts=True,
                query_params=[("fieldValidation", "Strict")])
        except ApiException as err:
            refused.append(f"{doc['kind']}/{doc['metadata']['name']}: {err.status} {err.body}")
    return refused
