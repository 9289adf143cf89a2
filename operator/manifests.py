"""Everything a PretrainJob owns, as pure functions from the spec to plain manifest dicts.

Owns the shape of each child: worker pods `<job>-<generation>-<index>`, the headless Service their
c10d rendezvous resolves through, the ConfigMap holding the trainer's job config, the progress
Lease, and the trainer's ServiceAccount with a Role that may only get and patch that one Lease.
Names, labels, the launch command and its environment come from `crucible.api` (`names`,
`launch`), the ConfigMap's content from `TrainJobConfig.from_job`, so the two planes share one
definition of each. Builders never mutate their inputs and never talk to the API (dask-
kubernetes' `build_*_spec` functions are the model); `kube.py` applies them.
tests/operator/test_contract.py runs exactly the rendered command and environment as a local
process; `crucible.api.launch` says where the c10d store lives and what its loss means.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Mapping

import yaml

from crucible.api import launch
from crucible.api.launch import CONFIG_DIR, CONFIG_FILE, CONTAINER, METRICS_PORT, RDZV_PORT
from crucible.api.network import egress_but_instance_metadata
from crucible.api.names import (ANNOTATION_SPEC_HASH, API_VERSION, KIND, LABEL_GENERATION,
                                LABEL_INDEX, LABEL_JOB, LABEL_MANAGED_BY, MANAGER, config_map_name,
                                network_policy_name, pod_name, progress_lease_name, service_name,
                                trainer_account_name)
from crucible.api.spec import PretrainJobSpec, TrainJobConfig, pod_facing

# What the operator's watches select server-side: only objects it made.
CHILD_SELECTOR = f"{LABEL_MANAGED_BY}={MANAGER},{LABEL_JOB}"
SCRATCH_DIR = "/scratch"     # writable emptyDir: HOME, TMPDIR and the run's output folder
RUN_UID = 1000               # non-root; the trainer image's user
HOSTNAME_LABEL = "kubernetes.io/hostname"


# --- metadata ---------------------------------------------------------------------------------
def labels(job: str, **extra: str) -> dict[str, str]:
    return {LABEL_MANAGED_BY: MANAGER, LABEL_JOB: job, **extra}


def owner_reference(job: str, uid: str) -> dict:
    """The PretrainJob as controller: deleting it garbage-collects every child."""
    return {"apiVersion": API_VERSION, "kind": KIND, "name": job, "uid": uid,
            "controller": True, "blockOwnerDeletion": True}


def metadata(job: str, uid: str, name: str, namespace: str, **label_extra: str) -> dict:
    """A child's name, namespace, the job's labels and the job as its controller."""
    return {"name": name, "namespace": namespace, "labels": labels(job, **label_extra),
            "ownerReferences": [owner_reference(job, uid)]}


# --- the trainer's config ---------------------------------------------------------------------
def train_config(job: str, spec: PretrainJobSpec) -> dict:
    """The `crucible train --config` document for this job: `TrainJobConfig.from_job`, as YAML
    would hold it."""
    return TrainJobConfig.from_job(spec, job).model_dump(by_alias=True, exclude_none=True,
                                                         mode="json")


def spec_hash(spec: PretrainJobSpec) -> str:
    """Digest of what the user asked of the pods (`pod_facing`: the spec less its operator-only
    fields, and less every value left at its default); a running generation with another hash
    restarts. Defaults stay out so that an operator upgrade, which may add a defaulted field or
    move a default, restarts no running job: its pods pick the new ones up at their next start."""
    global _last_hashed
    last = _last_hashed   # one read: another pass's thread may replace it meanwhile
    if last is not None and last[0] is spec:
        return last[1]
    doc = json.dumps(_without_empty(pod_facing(spec, exclude_defaults=True)), sort_keys=True)
    digest = hashlib.sha256(doc.encode()).hexdigest()[:16]
    _last_hashed = (spec, digest)
    return digest


# The spec last hashed and its digest. A pass asks for the same parsed spec's hash once per pod
# it writes and once more to compare; a dump of the whole spec each time was about a tenth of
# the operator's CPU in a start-up burst. Keyed on identity, and the reference held keeps that
# identity from being reused (a spec is not changed once parsed: the models are frozen).
_last_hashed: tuple[PretrainJobSpec, str] | None = None


def _without_empty(doc: dict) -> dict:
    """`doc` less the sections left empty: a section edited only in operator-only fields dumps
    as {} (it differs from its default as a whole), one never edited not at all."""
    out = {}
    for key, value in doc.items():
        if isinstance(value, dict):
            value = _without_empty(value)
            if not value:
                continue
        out[key] = value
    return out


def data_digest(data) -> str:
    """Digest of a mapping (a ConfigMap's data, a NetworkPolicy's spec), kept in an annotation."""
    return hashlib.sha256(json.dumps(dict(data or {}), sort_keys=True).encode()).hexdigest()[:16]


# The digest of what a child was rendered with, in its own annotation, compared instead of the
# content: the operator watches children's metadata only (metadata_watch.py), and the apiserver
# may default a NetworkPolicy's spec. A child rendered by an older operator, or under other
# settings (--allow-instance-metadata), has another digest (or none) and is replaced.
ANNOTATION_DATA_DIGEST = "crucible.dev/data-digest"
ANNOTATION_POLICY_DIGEST = "crucible.dev/policy-digest"
_DIGEST_ANNOTATIONS = {"ConfigMap": ANNOTATION_DATA_DIGEST,
                       "NetworkPolicy": ANNOTATION_POLICY_DIGEST}


_DIGEST = re.compile(r"[0-9a-f]{16}")
EDITED = "edited"       # the observed digest of a ConfigMap whose data someone else changed
# The field manager the operator's writes carried before they named one (the kubernetes
# client's default): a ConfigMap's data owned by neither it nor FIELD_MANAGER was changed by
# someone else (`kubectl edit`, an apply).
FIELD_MANAGER = "crucible-operator"     # the operator's writes name it (managedFields)
LEGACY_MANAGER = "OpenAPI-Generator"


def child_digest(doc: dict) -> str | None:
    """What drifts of a rendered child (None: a kind that is never replaced)."""
    annotation = _DIGEST_ANNOTATIONS.get(doc["kind"])
    if annotation is None:
        return None
    return (doc["metadata"].get("annotations") or {}).get(annotation)


def observed_digest(kind: str, meta: dict) -> str | None:
    """The same of an observed child, from its metadata alone: its digest annotation (kept only
    if it is one: a tenant's annotation is not held whatever its size), or EDITED where the
    managedFields say another manager owns a key of a ConfigMap's data."""
    annotation = _DIGEST_ANNOTATIONS.get(kind)
    if annotation is None:
        return None
    if kind == "ConfigMap" and _data_edited(meta):
        return EDITED
    value = (meta.get("annotations") or {}).get(annotation)
    return value if isinstance(value, str) and _DIGEST.fullmatch(value) else None


def _data_edited(meta: dict) -> bool:
    for entry in meta.get("managedFields") or ():
        if not isinstance(entry, dict) or entry.get("manager") in (FIELD_MANAGER,
                                                                   LEGACY_MANAGER):
            continue
        fields = entry.get("fieldsV1")
        data = fields.get("f:data") if isinstance(fields, dict) else None
        if isinstance(data, dict) and any(key != "." for key in data):
            return True
    return False


# --- children ---------------------------------------------------------------------------------
def config_map(job: str, namespace: str, uid: str, spec: PretrainJobSpec) -> dict:
    data = {CONFIG_FILE: config_text(job, spec)}
    meta = metadata(job, uid, config_map_name(job), namespace)
    meta["annotations"] = {ANNOTATION_DATA_DIGEST: data_digest(data)}
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data}


def config_text(job: str, spec: PretrainJobSpec) -> str:
    """The ConfigMap's job.yaml. YAML emitting is the one costly render of a pass and every pass
    checks the ConfigMap for drift, so the text is remembered per (job, pod-facing spec)."""
    config = TrainJobConfig.from_job(spec, job)
    # Defaults left out: a trainer image older than the operator (pods still running when it is
    # upgraded) reads this file too, and must meet no field it does not know.
    return _yaml_text(config.model_dump_json(by_alias=True, exclude_none=True,
                                             exclude_defaults=True))


@functools.lru_cache(maxsize=4096)
def _yaml_text(config_json: str) -> str:
    return yaml.dump(json.loads(config_json), Dumper=_DUMPER, sort_keys=False)


_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)   # libyaml when PyYAML has it


def service(job: str, namespace: str, uid: str) -> dict:
    """Headless: no virtual IP, just DNS records `<pod-hostname>.<job>` for the rendezvous.

    publishNotReadyAddresses, because the rendezvous happens before any pod could be Ready (as
    JobSet does for its pod DNS).
    """
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": metadata(job, uid, service_name(job), namespace),
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                     "selector": {LABEL_JOB: job, LABEL_MANAGED_BY: MANAGER},
                     "ports": [{"name": "c10d", "port": RDZV_PORT, "targetPort": RDZV_PORT}]}}


# Who may scrape the metrics port when the operator is not told: every pod in the cluster
# (metrics are read-only, and Prometheus lives in a namespace of its own).
ANY_NAMESPACE: tuple[dict, ...] = ({"namespaceSelector": {}},)


def network_policy(job: str, namespace: str, uid: str,
                   metrics_from: tuple[dict, ...] = ANY_NAMESPACE,
                   instance_metadata: bool = False) -> dict:
    """Ingress to the job's pods from its own pods only, on every port: pod 0's c10d store
    unpickles what it is sent, so whoever reaches it could run code in every agent (which hold
    the storage credentials), and NCCL and gloo pick their ports at random. The metrics port
    is open to `metrics_from` (NetworkPolicy peers; the cluster admin's `--metrics-scrapers`).
    Egress is open (the store, DNS, the apiserver, S3) but for the instance-metadata address,
    unless the administrator lets jobs use the node's role (`instance_metadata`). Enforced
    where the CNI implements NetworkPolicy (most do; kindnet since Kubernetes 1.31 via
    kube-network-policies)."""
    pods = {"matchLabels": {LABEL_JOB: job, LABEL_MANAGED_BY: MANAGER}}
    ingress = [{"from": [{"podSelector": pods}]},
               {"from": [dict(peer) for peer in metrics_from],
                "ports": [{"protocol": "TCP", "port": METRICS_PORT}]}]
    spec = {"podSelector": pods, "policyTypes": ["Ingress"], "ingress": ingress}
    if not instance_metadata:
        spec["policyTypes"] = ["Ingress", "Egress"]
        spec["egress"] = egress_but_instance_metadata()
    meta = metadata(job, uid, network_policy_name(job), namespace)
    meta["annotations"] = {ANNOTATION_POLICY_DIGEST: data_digest(spec)}
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": meta,
            "spec": spec}


def lease(job: str, namespace: str, uid: str) -> dict:
    """Created empty; trainer rank 0 patches its annotations (`crucible.api.progress`)."""
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": metadata(job, uid, progress_lease_name(job), namespace), "spec": {}}


def service_account(job: str, namespace: str, uid: str, spec: PretrainJobSpec) -> dict:
    """The trainer's identity; `serviceAccount.annotations` bind it to a cloud role (workload
    identity), so storage needs no static keys."""
    meta = metadata(job, uid, trainer_account_name(job), namespace)
    if spec.service_account.annotations:
        meta["annotations"] = dict(spec.service_account.annotations)
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta}


def role(job: str, namespace: str, uid: str) -> dict:
    """The trainer may read and patch its own job's progress Lease, and nothing else."""
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": metadata(job, uid, trainer_account_name(job), namespace),
            "rules": [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                       "resourceNames": [progress_lease_name(job)], "verbs": ["get", "patch"]}]}


def role_binding(job: str, namespace: str, uid: str) -> dict:
    name = trainer_account_name(job)
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": metadata(job, uid, name, namespace),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}]}


def static_children(job: str, namespace: str, uid: str, spec: PretrainJobSpec,
                    metrics_from: tuple[dict, ...] = ANY_NAMESPACE,
                    instance_metadata: bool = False) -> list[dict]:
    """What exists once per job, in creation order (the Role before the binding that names it)."""
    return [service_account(job, namespace, uid, spec), role(job, namespace, uid),
            role_binding(job, namespace, uid), lease(job, namespace, uid),
            config_map(job, namespace, uid, spec), service(job, namespace, uid),
            network_policy(job, namespace, uid, metrics_from, instance_metadata)]


# --- worker pods ------------------------------------------------------------------------------
def _field_env(name: str, path: str) -> dict:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def _secret_env(name: str, secret: str, optional: bool) -> dict:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": name,
                                                         "optional": optional}}}


def torchrun_env(job: str, spec: PretrainJobSpec, generation: int, index: int) -> list[dict]:
    """PET_* flags for torchrun (`crucible.api.launch.torchrun_env`) as container env."""
    flags = launch.torchrun_env(job, generation, index, nodes_min=spec.nodes.min,
                                nodes_max=spec.nodes.max, procs_per_node=spec.procs_per_node,
                                max_restarts=spec.fault_tolerance.torchrun_max_restarts,
                                rendezvous_timeout_s=spec.fault_tolerance.rendezvous_timeout_seconds)
    return [{"name": k, "value": v} for k, v in flags.items()]


def container_env(job: str, spec: PretrainJobSpec, generation: int, index: int,
                  instance_metadata: bool = False) -> list[dict]:
    """`instance_metadata`: the administrator lets jobs use the node's cloud role; otherwise
    the AWS SDK is told not to look for it (the NetworkPolicy also blocks the address)."""
    env = torchrun_env(job, spec, generation, index) + [
        {"name": launch.ENV_CONFIG, "value": launch.CONFIG_PATH},
        {"name": launch.ENV_JOB, "value": job},
        {"name": launch.ENV_GENERATION, "value": str(generation)},
        _field_env(launch.ENV_POD_NAME, "metadata.name"),
        _field_env(launch.ENV_POD_NAMESPACE, "metadata.namespace"),
        _field_env(launch.ENV_NODE_NAME, "spec.nodeName"),
        {"name": "PYTHONUNBUFFERED", "value": "1"},
        {"name": "HOME", "value": SCRATCH_DIR},
        {"name": "TMPDIR", "value": SCRATCH_DIR},
    ]
    if not instance_metadata:
        env.append({"name": "AWS_EC2_METADATA_DISABLED", "value": "true"})
    secret = spec.checkpoint.credentials_secret
    if secret:
        env += [_secret_env("AWS_ACCESS_KEY_ID", secret, False),
                _secret_env("AWS_SECRET_ACCESS_KEY", secret, False),
                _secret_env("AWS_ENDPOINT_URL", secret, True),
                _secret_env("AWS_DEFAULT_REGION", secret, True)]
    if spec.checkpoint.signing_key_secret:
        env.append(_secret_env(launch.ENV_SIGNING_KEY, spec.checkpoint.signing_key_secret, False))
    return env


def _affinity(avoid_nodes: list[str]) -> dict | None:
    if not avoid_nodes:
        return None
    term = {"matchExpressions": [{"key": HOSTNAME_LABEL, "operator": "NotIn",
                                  "values": sorted(avoid_nodes)}]}
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [term]}}}


def avoided_nodes(pod_spec: Mapping) -> tuple[str, ...]:
    """The nodes a pod rendered by `pod` keeps off (`_affinity` read back): its affinity is
    fixed at creation, so a pod still Pending when one of them is trusted again must be
    recreated to use it."""
    required = ((pod_spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution") or {}
    return tuple(sorted({value for term in required.get("nodeSelectorTerms") or []
                         for expr in term.get("matchExpressions") or []
                         if expr.get("key") == HOSTNAME_LABEL and expr.get("operator") == "NotIn"
                         for value in expr.get("values") or []}))


def container_resources(spec: PretrainJobSpec) -> dict:
    return {kind: {name: str(amount) for name, amount in amounts.items()}
            for kind, amounts in spec.resources.items()}


def tolerations(spec: PretrainJobSpec) -> list[dict]:
    return [t.model_dump(by_alias=True, exclude_none=True) for t in spec.scheduling.tolerations]


def pod(job: str, namespace: str, uid: str, spec: PretrainJobSpec, generation: int, index: int,
        avoid_nodes: list[str] = (), instance_metadata: bool = False) -> dict:
    """Worker pod `index` of `generation`. `avoid_nodes`: nodes that failed under this job."""
    name = pod_name(job, generation, index)
    cmd, args = launch.command()
    meta = metadata(job, uid, name, namespace, **{LABEL_GENERATION: str(generation),
                                               LABEL_INDEX: str(index)})
    meta["annotations"] = {ANNOTATION_SPEC_HASH: spec_hash(spec)}
    container = {
        "name": CONTAINER, "image": spec.image, "command": cmd, "args": args,
        "workingDir": SCRATCH_DIR,
        "env": container_env(job, spec, generation, index, instance_metadata),
        "ports": [{"name": "c10d", "containerPort": RDZV_PORT},
                  {"name": "metrics", "containerPort": METRICS_PORT}],
        "resources": container_resources(spec),
        "volumeMounts": [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
                         {"name": "scratch", "mountPath": SCRATCH_DIR},
                         {"name": "dshm", "mountPath": "/dev/shm"}],
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "capabilities": {"drop": ["ALL"]}},
    }
    sched = spec.scheduling
    pod_spec = {
        "restartPolicy": "Never",  # the operator decides about every restart (docs/operator.md)
        "hostname": name, "subdomain": service_name(job),
        "serviceAccountName": trainer_account_name(job),
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": spec.termination_grace_period_seconds,
        "securityContext": {"runAsNonRoot": True, "runAsUser": RUN_UID, "runAsGroup": RUN_UID,
                            "fsGroup": RUN_UID, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container],
        "volumes": [{"name": "config", "configMap": {"name": config_map_name(job)}},
                    # Bounded, so one job cannot fill the node's disk or memory: past the
                    # limit the kubelet evicts the pod (an infrastructure failure, replaced).
                    {"name": "scratch", "emptyDir": {"sizeLimit": spec.scratch_size_limit}},
                    # NCCL and DataLoader workers use shared memory; the runtime's 64 MiB is small.
                    {"name": "dshm", "emptyDir": {"medium": "Memory",
                                                  "sizeLimit": spec.shm_size_limit}}],
    }
    if sched.node_selector:
        pod_spec["nodeSelector"] = dict(sched.node_selector)
    if sched.tolerations:
        pod_spec["tolerations"] = tolerations(spec)
    if sched.priority_class_name:
        pod_spec["priorityClassName"] = sched.priority_class_name
    affinity = _affinity(list(avoid_nodes))
    if affinity:
        pod_spec["affinity"] = affinity
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod_spec}
