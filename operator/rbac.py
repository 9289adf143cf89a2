"""Least-privilege RBAC for the operator, generated as YAML for `manifests/rbac/`.

Owns the operator's permissions, each rule with the reason it exists (JobSet keeps its RBAC
markers beside `Reconcile` for the same reason, kubernetes-sigs/jobset
pkg/controllers/jobset_controller.go). The trainer pods' rights are not here: the operator
renders them per job (`manifests.role`), a Role that may only get and patch that job's own
progress Lease. To grant that, Kubernetes' escalation check requires the operator
to hold get/patch on Leases itself, which it does.

tests/operator/test_rbac.py checks the committed YAML equals `render()` and exercises both
identities with real ServiceAccount tokens against the local apiserver;
tests/operator/test_rbac_matches_code.py checks RULES grant exactly the calls the code makes
(and that `kubectl auth can-i --list` for the operator says the same).
"""

from __future__ import annotations

from dataclasses import dataclass

import yaml

from crucible.operator import crd

NAMESPACE = "crucible-system"
NAME = "crucible-operator"

# (apiGroups, resources, verbs, why)
RULES: list[tuple[list[str], list[str], list[str], str]] = [
    ([crd.GROUP], [crd.PLURAL], ["get", "list", "watch", "patch", "delete"],
     "watch jobs; read one when the watch lags or a pass meets a 404 (get); kopf's finalizer "
     "(patch); ttlSecondsAfterFinished (delete)"),
    ([crd.GROUP], [f"{crd.PLURAL}/status"], ["patch"], "one status patch per pass"),
    ([crd.GROUP], [f"{crd.PLURAL}/finalizers"], ["update"],
     "every child's ownerReference sets blockOwnerDeletion, which the "
     "OwnerReferencesPermissionEnforcement admission plugin (on in OpenShift and OKD) allows "
     "only to who may update the owner's finalizers: without it no child could be created"),
    ([""], ["pods"], ["list", "watch", "create", "delete"],
     "worker pods: create, replace, force-delete (never read one by one, never edited; what "
     "a created pod may be is fenced by the admission policy below)"),
    ([""], ["services", "serviceaccounts"], ["get", "list", "watch", "create"],
     "headless Service, trainer ServiceAccount (get: whose is it, after a 409)"),
    ([""], ["configmaps"], ["get", "list", "watch", "create", "patch"],
     "the job config (patch: after a spec edit)"),
    (["coordination.k8s.io"], ["leases"], ["get", "list", "watch", "create", "patch"],
     "the progress Lease; get/patch also because the trainer's Role grants them"),
    (["rbac.authorization.k8s.io"], ["roles", "rolebindings"], ["get", "list", "watch", "create"],
     "the trainer's Role on its own Lease, bound to its ServiceAccount"),
    (["networking.k8s.io"], ["networkpolicies"], ["get", "list", "watch", "create", "update"],
     "one per job: its pods take ingress only from each other (and metrics scrapes); update: "
     "one rendered by an older operator or under other settings is replaced"),
    ([""], ["events"], ["get", "create", "patch"],
     "events on PretrainJobs; a repeat raises the count of the first (get: after a restart)"),
    ([""], ["nodes"], ["list", "watch", "patch"],
     "node health; cordon and annotate failed nodes"),
    (["scheduling.k8s.io"], ["priorityclasses"], ["list", "watch"],
     "a job naming a PriorityClass that does not exist is told so"),
    (["kueue.x-k8s.io"], ["workloads"], ["get", "list", "watch", "create", "patch", "delete"],
     "a queued job's Kueue Workload (get: whose is it, after a 409; patch: its priority, when "
     "the job's priority-class label changes; delete: on suspension or a spec change)"),
    (["kueue.x-k8s.io"], ["workloads/status"], ["patch"],
     "release an evicted Workload's quota once its pods are gone; mark it Finished"),
    (["kueue.x-k8s.io"], ["localqueues"], ["list", "watch"],
     "name the ClusterQueue a queued job waits in"),
    (["kueue.x-k8s.io"], ["resourceflavors"], ["list", "watch"],
     "put a queued job's pods on the nodes of the flavors Kueue admitted it on"),
    (["kueue.x-k8s.io"], ["workloadpriorityclasses"], ["list", "watch"],
     "the value of the class a job's kueue.x-k8s.io/priority-class label names"),
    ([""], ["namespaces"], ["list", "watch"], "kopf: which namespaces to serve"),
    (["apiextensions.k8s.io"], ["customresourcedefinitions"], ["list", "watch"],
     "kopf: resource discovery"),
]


# Resources of RULES that are cluster-scoped (a rule holds resources of one scope only): a
# namespaced install (the chart's watchNamespaces) grants these cluster-wide and the rest only
# in the watched namespaces. The ClusterRole carries the list (CLUSTER_SCOPED_ANNOTATION), so
# the chart splits by it.
CLUSTER_SCOPED = ("nodes", "priorityclasses", "resourceflavors", "workloadpriorityclasses",
                  "namespaces", "customresourcedefinitions")
CLUSTER_SCOPED_ANNOTATION = "crucible.dev/cluster-scoped-resources"

OPERATOR_USER = f"system:serviceaccount:{NAMESPACE}:{NAME}"
FENCE = f"{NAME}-fence"


def _unchanged(path: str, empty: str) -> str:
    """CEL: a field of the node is what it was (absent counts as `empty`)."""
    return (f"(has(object.{path}) ? object.{path} : {empty}) == "
            f"(has(oldObject.{path}) ? oldObject.{path} : {empty})")


def _owner(obj: str) -> str:
    """CEL: the name of the PretrainJob that controls `obj` (object or oldObject), '' if none.
    The apiserver does not check that an ownerReference points at anything, so a name alone
    proves nothing; what the rules below pin is that each object is shaped, and named, as the
    operator renders it for that job."""
    controller = (f"r, has(r.controller) && r.controller && r.kind == 'PretrainJob' && "
                  f"r.apiVersion == '{crd.API_VERSION}'")
    return (f"has({obj}.metadata.ownerReferences) && {obj}.metadata.ownerReferences.exists("
            f"{controller}) ? {obj}.metadata.ownerReferences.filter({controller})[0].name : ''")


_OLD_OWNED = ("variables.oldOwner != ''", "")
# An update must not move an object from one job (or none) to another.
_KEEPS_OWNER = "(request.operation != 'UPDATE' || variables.oldOwner == variables.owner)"


def _named(suffix: str) -> tuple[str, str]:
    return (f"variables.owner != '' && object.metadata.name == variables.owner + '{suffix}'", "")


# What the operator's own writes may be, checked by the apiserver whoever holds its token: RBAC
# can say "create pods" but not "only as the job's trainer, only non-root", nor "patch nodes" but
# not "only spec.unschedulable and crucible.dev/* annotations", nor "create RoleBindings" but not
# "only the trainer's, to its own Lease". (expression, message) per rule; "" takes the policy's.
POD_RULES: list[tuple[str, str]] = [
    ("variables.owner != '' && has(object.spec.serviceAccountName) && "
     "object.spec.serviceAccountName == variables.owner + '-trainer'",
     "the operator creates only pods controlled by a PretrainJob, running as that job's "
     "<job>-trainer ServiceAccount"),
    ("has(object.spec.securityContext) && has(object.spec.securityContext.runAsNonRoot) && "
     "object.spec.securityContext.runAsNonRoot && "
     "!(has(object.spec.securityContext.runAsUser) && object.spec.securityContext.runAsUser "
     "== 0) && "
     "!(has(object.spec.hostNetwork) && object.spec.hostNetwork) && "
     "!(has(object.spec.hostPID) && object.spec.hostPID) && "
     "!(has(object.spec.hostIPC) && object.spec.hostIPC) && "
     "(!has(object.spec.volumes) || object.spec.volumes.all(v, !has(v.hostPath))) && "
     "object.spec.containers.all(c, has(c.securityContext) && "
     "has(c.securityContext.allowPrivilegeEscalation) && "
     "!c.securityContext.allowPrivilegeEscalation && "
     "!(has(c.securityContext.privileged) && c.securityContext.privileged) && "
     "!(has(c.securityContext.runAsNonRoot) && !c.securityContext.runAsNonRoot) && "
     "!(has(c.securityContext.runAsUser) && c.securityContext.runAsUser == 0))",
     "the operator creates only non-root pods without host namespaces, hostPath volumes, "
     "privilege or privilege escalation"),
    ("(!has(object.spec.initContainers) || size(object.spec.initContainers) == 0) && "
     "(!has(object.spec.ephemeralContainers) || size(object.spec.ephemeralContainers) == 0) && "
     "has(object.spec.securityContext.seccompProfile) && "
     "object.spec.securityContext.seccompProfile.type == 'RuntimeDefault' && "
     "object.spec.containers.all(c, has(c.securityContext.capabilities) && "
     "has(c.securityContext.capabilities.drop) && 'ALL' in c.securityContext.capabilities.drop "
     "&& (!has(c.securityContext.capabilities.add) || "
     "size(c.securityContext.capabilities.add) == 0) && "
     "(!has(c.securityContext.seccompProfile) || "
     "c.securityContext.seccompProfile.type == 'RuntimeDefault') && "
     "(!has(c.ports) || c.ports.all(p, !has(p.hostPort) || p.hostPort == 0)))",
     "the operator creates only pods without init or ephemeral containers, with every "
     "capability dropped, none added, the RuntimeDefault seccomp profile and no host ports"),
    # Its own config, scratch and shared memory; the projected token volume the ServiceAccount
    # admission plugin adds (before validation). No Secret, PVC or other volume.
    ("!has(object.spec.volumes) || object.spec.volumes.all(v, has(v.emptyDir) || "
     "(has(v.configMap) && v.configMap.name == variables.owner + '-config') || "
     "(has(v.projected) && v.projected.sources.all(s, has(s.serviceAccountToken) || "
     "has(s.downwardAPI) || (has(s.configMap) && s.configMap.name == 'kube-root-ca.crt'))))",
     "the operator mounts only its job's ConfigMap, emptyDir volumes and the ServiceAccount "
     "token: no Secret, PersistentVolumeClaim or other volume"),
]
_NODE_MESSAGE = ("the operator may change only a node's spec.unschedulable and crucible.dev/* "
                 "annotations, and lift only its own cordons")
NODE_RULES: list[tuple[str, str]] = [
    (" && ".join([_unchanged("metadata.labels", "{}"), _unchanged("spec.taints", "[]"),
                  _unchanged("spec.providerID", "''"), _unchanged("spec.podCIDRs", "[]"),
                  # A dangling ownerReference would have the garbage collector delete the node.
                  _unchanged("metadata.ownerReferences", "[]"),
                  _unchanged("metadata.finalizers", "[]")]),
     _NODE_MESSAGE),
    ("(!has(object.metadata.annotations) || object.metadata.annotations.all(k, "
     "k.startsWith('crucible.dev/') || (has(oldObject.metadata.annotations) && "
     "k in oldObject.metadata.annotations && "
     "oldObject.metadata.annotations[k] == object.metadata.annotations[k]))) && "
     "(!has(oldObject.metadata.annotations) || oldObject.metadata.annotations.all(k, "
     "k.startsWith('crucible.dev/') || (has(object.metadata.annotations) && "
     "k in object.metadata.annotations)))", _NODE_MESSAGE),
    # Uncordoning: only a cordon the operator set (it marks them crucible.dev/cordoned-by).
    ("!(has(oldObject.spec.unschedulable) && oldObject.spec.unschedulable) || "
     "(has(object.spec.unschedulable) && object.spec.unschedulable) || "
     "(has(oldObject.metadata.annotations) && "
     "'crucible.dev/cordoned-by' in oldObject.metadata.annotations)", _NODE_MESSAGE),
]


@dataclass(frozen=True)
class Fence:
    """One ValidatingAdmissionPolicy: `operations` on `resources` of `group`, when made by the
    operator, must pass every rule."""

    kind: str                  # the policy's name suffix
    group: str
    resources: tuple[str, ...]
    operations: tuple[str, ...]
    message: str
    rules: tuple[tuple[str, str], ...]


_JOB_OWNED = "controlled by a PretrainJob"
FENCES: tuple[Fence, ...] = (
    Fence("pods", "", ("pods",), ("CREATE",), "", tuple(POD_RULES)),
    Fence("pod-deletes", "", ("pods",), ("DELETE",),
          f"the operator deletes only pods {_JOB_OWNED}", (_OLD_OWNED,)),
    Fence("nodes", "", ("nodes",), ("UPDATE",), _NODE_MESSAGE, tuple(NODE_RULES)),
    Fence("serviceaccounts", "", ("serviceaccounts",), ("CREATE",),
          f"the operator creates only ServiceAccounts named <job>-trainer, {_JOB_OWNED}",
          (_named("-trainer"),)),
    Fence("roles", "rbac.authorization.k8s.io", ("roles",), ("CREATE",),
          f"the operator creates only Roles named <job>-trainer, {_JOB_OWNED}, granting get and "
          "patch on that job's <job>-progress Lease and nothing else",
          (_named("-trainer"),
           ("size(object.rules) == 1 && object.rules[0].apiGroups == ['coordination.k8s.io'] && "
            "object.rules[0].resources == ['leases'] && "
            "object.rules[0].verbs == ['get', 'patch'] && "
            "has(object.rules[0].resourceNames) && "
            "object.rules[0].resourceNames == [variables.owner + '-progress'] && "
            "!has(object.rules[0].nonResourceURLs)", ""))),
    Fence("rolebindings", "rbac.authorization.k8s.io", ("rolebindings",), ("CREATE",),
          f"the operator creates only RoleBindings named <job>-trainer, {_JOB_OWNED}, of the "
          "Role <job>-trainer to the ServiceAccount <job>-trainer of the same namespace",
          (_named("-trainer"),
           ("object.roleRef.apiGroup == 'rbac.authorization.k8s.io' && "
            "object.roleRef.kind == 'Role' && "
            "object.roleRef.name == variables.owner + '-trainer' && "
            "size(object.subjects) == 1 && object.subjects[0].kind == 'ServiceAccount' && "
            "object.subjects[0].name == variables.owner + '-trainer' && "
            "has(object.subjects[0].namespace) && "
            "object.subjects[0].namespace == object.metadata.namespace", ""))),
    Fence("configmaps", "", ("configmaps",), ("CREATE", "UPDATE"),
          f"the operator writes only ConfigMaps named <job>-config, {_JOB_OWNED}",
          (_named("-config"),
           (_KEEPS_OWNER, ""))),
    Fence("leases", "coordination.k8s.io", ("leases",), ("CREATE", "UPDATE"),
          f"the operator writes only Leases named <job>-progress, {_JOB_OWNED}, and its own "
          "leader-election Lease",
          ((f"object.metadata.name == '{NAME}-leader' || "
            "(variables.owner != '' && object.metadata.name == variables.owner + '-progress' "
            f"&& {_KEEPS_OWNER})",
            ""),)),
    Fence("services", "", ("services",), ("CREATE",),
          f"the operator creates only headless Services named after their job, {_JOB_OWNED}, "
          "without external IPs",
          (("variables.owner != '' && object.metadata.name == variables.owner", ""),
           ("has(object.spec.clusterIP) && object.spec.clusterIP == 'None' && "
            "(!has(object.spec.type) || object.spec.type == 'ClusterIP') && "
            "(!has(object.spec.externalIPs) || size(object.spec.externalIPs) == 0)", ""))),
    Fence("networkpolicies", "networking.k8s.io", ("networkpolicies",), ("CREATE", "UPDATE"),
          f"the operator writes only NetworkPolicies named after their job, {_JOB_OWNED}, "
          "selecting that job's pods",
          (("variables.owner != '' && object.metadata.name == variables.owner && "
            "has(object.spec.podSelector.matchLabels) && "
            "'crucible.dev/job' in object.spec.podSelector.matchLabels && "
            "object.spec.podSelector.matchLabels['crucible.dev/job'] == variables.owner && "
            f"{_KEEPS_OWNER}", ""),)),
    Fence("workloads", "kueue.x-k8s.io", ("workloads", "workloads/status"),
          ("CREATE", "UPDATE", "DELETE"),
          f"the operator writes only Kueue Workloads {_JOB_OWNED}",
          (("request.operation == 'DELETE' ? variables.oldOwner != '' : "
            f"variables.owner != '' && {_KEEPS_OWNER}", ""),)),
)


def _variables(f: Fence) -> list[dict]:
    """`owner` (of the object written) and `oldOwner` (of the object as it was), for the
    operations that have them (CREATE has no old object, DELETE no new one)."""
    out = []
    if f.operations != ("DELETE",):
        out.append({"name": "owner", "expression": f"object == null ? '' : ({_owner('object')})"})
    if set(f.operations) & {"UPDATE", "DELETE"}:
        out.append({"name": "oldOwner",
                    "expression": f"oldObject == null ? '' : ({_owner('oldObject')})"})
    return out


def fence(labels: dict, user: str = OPERATOR_USER) -> list[dict]:
    """ValidatingAdmissionPolicies (and bindings) on the operator's writes, one per kind (each
    typed against its own schema); they match only requests made as the operator's
    ServiceAccount."""
    docs = []
    for f in FENCES:
        name = f"{FENCE}-{f.kind}"
        spec = {"failurePolicy": "Fail",
                "matchConstraints": {"resourceRules": [
                    {"apiGroups": [f.group], "apiVersions": ["*"],
                     "operations": list(f.operations), "resources": list(f.resources)}]},
                "matchConditions": [{"name": "as-the-operator", "expression":
                                     f"request.userInfo.username == '{user}'"}],
                "variables": _variables(f),
                "validations": [{"expression": rule, "message": message or f.message}
                                for rule, message in f.rules]}
        docs.append({
            "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
            "metadata": {"name": name, "labels": labels}, "spec": spec})
        docs.append({"apiVersion": "admissionregistration.k8s.io/v1",
                     "kind": "ValidatingAdmissionPolicyBinding",
                     "metadata": {"name": name, "labels": labels},
                     "spec": {"policyName": name, "validationActions": ["Deny"]}})
    return docs


def documents() -> list[dict]:
    labels = {"app.kubernetes.io/name": NAME, "app.kubernetes.io/part-of": "crucible"}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount",
         "metadata": {"name": NAME, "namespace": NAMESPACE, "labels": labels}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
         "metadata": {"name": NAME, "labels": labels,
                      "annotations": {CLUSTER_SCOPED_ANNOTATION: ",".join(CLUSTER_SCOPED)}},
         "rules": [{"apiGroups": groups, "resources": resources, "verbs": verbs}
                   for groups, resources, verbs, _ in RULES]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": NAME, "labels": labels},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": NAME},
         "subjects": [{"kind": "ServiceAccount", "name": NAME, "namespace": NAMESPACE}]},
        *fence(labels),
    ]


def render() -> str:
    why = "\n".join(f"#   {', '.join(r)}: {reason}" for _, r, _, reason in RULES)
    header = ("# Generated by `crucible-operator rbac` from crucible/operator/rbac.py; do not "
              "edit.\n# The operator's ServiceAccount and least-privilege ClusterRole. Why each "
              "rule:\n" + why + "\n# Trainer pods get a per-job ServiceAccount and Role made by "
              "the operator: get/patch on\n# their own job's Lease <job>-progress, nothing "
              "else (crucible/operator/manifests.py).\n# The ValidatingAdmissionPolicies "
              "crucible-operator-fence-* bound what the operator's\n# own writes may be, "
              "whoever holds its token (Kubernetes >= 1.30).\n")
    return header + "---\n".join(yaml.safe_dump(doc, sort_keys=False) for doc in documents())
