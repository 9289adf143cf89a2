"""Everything a PretrainJob owns, as pure functions from the spec to plain manifest dicts.

Owns names, labels and the shape of each child: worker pods `<job>-<generation>-<index>`, the
headless Service their c10d rendezvous resolves through, the ConfigMap holding the trainer's job
config, the progress Lease, and the trainer's ServiceAccount with a Role that may only get and
patch that one Lease. Builders never mutate their inputs and never talk to the API (dask-
kubernetes' `build_*_spec` functions are the model, STYLE.md section 3); `kube.py` applies them.

The launch contract (DESIGN.md, "Contracts between the planes"): each pod runs plain
`torchrun --module crucible.trainer train --config $(CRUCIBLE_CONFIG)` and torchrun reads every
other flag from `PET_*` environment variables, as Kubeflow's PyTorchJob does (torchrun's argparse
`env` action takes `PET_<FLAG>` as the flag's default). tests/operator/test_contract.py runs
exactly this command and environment as a local process.

Where the c10d store lives, and what its death means: with `--rdzv-backend=c10d` the rendezvous
state is a TCPStore served by ONE torchrun agent, the one whose rendezvous endpoint is its own
address. Here that is always pod index 0 (`PET_RDZV_ENDPOINT=<job>-<gen>-0.<job>:29400`, and its
`PET_RDZV_CONF` says `is_host=1` so the choice does not rest on a DNS heuristic). When another
pod dies, the surviving agents re-rendezvous on pod 0's store and keep training with fewer nodes
(>= nodes.min) while the operator replaces the lost pod, which then joins. When pod 0 dies, the
store dies with it: the survivors cannot re-rendezvous (they time out talking to a dead store),
so the operator restarts the whole group under a new generation, whose pod 0 brings up a fresh
store; see `decision.py`.
"""

from __future__ import annotations

import functools
import hashlib
import json

import yaml

from crucible.operator.crd import API_VERSION, KIND
from crucible.trainer.launch import TORCHRUN_ENV
from crucible.trainer.jobspec import PretrainJobSpec, TrainJobConfig
from crucible.trainer.lease import lease_name

LABEL_JOB = "crucible.dev/job"
LABEL_GENERATION = "crucible.dev/generation"
LABEL_INDEX = "crucible.dev/index"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGER = "crucible-operator"
ANNOTATION_SPEC_HASH = "crucible.dev/spec-hash"
# What the operator's watches select server-side: only objects it made.
CHILD_SELECTOR = f"{LABEL_MANAGED_BY}={MANAGER},{LABEL_JOB}"

RDZV_PORT = 29400            # torchrun's own default c10d port (torch.distributed.run --standalone)
METRICS_PORT = 9400          # MetricsSpec.port's default: rank 0's Prometheus exporter
CONTAINER = "trainer"
CONFIG_DIR = "/etc/crucible"
CONFIG_FILE = "job.yaml"
SCRATCH_DIR = "/scratch"     # writable emptyDir: HOME, TMPDIR and the run's output folder
RUN_UID = 1000               # non-root; the trainer image's user

# Operator-only knobs: changing them must not restart running pods (they are not in the hash).
_OPERATOR_ONLY = {"maxRestarts", "cordonFailedNodes", "hangTimeoutSeconds", "retryableExitCodes",
                  "maxRestartsWithoutProgress", "nodeFailureGraceSeconds",
                  "nodeFailureConditions", "pendingTimeoutSeconds", "terminatingTimeoutSeconds"}


# --- names ------------------------------------------------------------------------------------
def pod_name(job: str, generation: int, index: int) -> str:
    return f"{job}-{generation}-{index}"


def service_name(job: str) -> str:
    return job


def config_map_name(job: str) -> str:
    return f"{job}-config"


def trainer_account_name(job: str) -> str:
    return f"{job}-trainer"


def progress_lease_name(job: str) -> str:
    return lease_name(job)


def rendezvous_endpoint(job: str, generation: int) -> str:
    """Pod 0's stable DNS name (hostname.subdomain, resolved via the headless Service)."""
    return f"{pod_name(job, generation, 0)}.{service_name(job)}:{RDZV_PORT}"


# --- metadata ---------------------------------------------------------------------------------
def labels(job: str, **extra: str) -> dict[str, str]:
    return {LABEL_MANAGED_BY: MANAGER, LABEL_JOB: job, **extra}


def owner_reference(job: str, uid: str) -> dict:
    """The PretrainJob as controller: deleting it garbage-collects every child."""
    return {"apiVersion": API_VERSION, "kind": KIND, "name": job, "uid": uid,
            "controller": True, "blockOwnerDeletion": True}


def _meta(job: str, uid: str, name: str, namespace: str, **label_extra: str) -> dict:
    return {"name": name, "namespace": namespace, "labels": labels(job, **label_extra),
            "ownerReferences": [owner_reference(job, uid)]}


# --- the trainer's config ---------------------------------------------------------------------
def train_config(job: str, spec: PretrainJobSpec) -> dict:
    """The `crucible train --config` document for this job (validated by the trainer's model)."""
    doc = {
        "name": job,
        "outputDir": "run",  # relative to the container's workingDir, SCRATCH_DIR
        **spec.model_dump(by_alias=True, exclude_none=True, mode="json",
                          include={"model", "data", "training", "checkpoint", "fault_tolerance"}),
        "metrics": {"port": METRICS_PORT},
    }
    return TrainJobConfig.model_validate(doc).model_dump(by_alias=True, exclude_none=True,
                                                         mode="json")


def spec_hash(spec: PretrainJobSpec) -> str:
    """Digest of everything that reaches a pod; a running generation with another hash restarts."""
    return _spec_hash(spec.model_dump_json(by_alias=True))


@functools.lru_cache(maxsize=4096)
def _spec_hash(spec_json: str) -> str:
    doc = json.loads(spec_json)
    for key in ("suspend", "ttlSecondsAfterFinished"):
        doc.pop(key, None)
    doc["faultTolerance"] = {k: v for k, v in doc["faultTolerance"].items()
                             if k not in _OPERATOR_ONLY}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


def data_digest(data) -> str:
    """Digest of a ConfigMap's data: the index records it, the decision compares it."""
    return hashlib.sha256(json.dumps(dict(data or {}), sort_keys=True).encode()).hexdigest()[:16]


# --- children ---------------------------------------------------------------------------------
def config_map(job: str, namespace: str, uid: str, spec: PretrainJobSpec) -> dict:
    text = _config_text(job, spec.model_dump_json(by_alias=True))
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": _meta(job, uid, config_map_name(job), namespace),
            "data": {CONFIG_FILE: text}}


@functools.lru_cache(maxsize=4096)
def _config_text(job: str, spec_json: str) -> str:
    """Pure, and the one costly render of a pass (YAML emitting): every pass checks the
    ConfigMap for drift, so the text is remembered per (job, spec)."""
    spec = PretrainJobSpec.model_validate_json(spec_json)
    return yaml.dump(train_config(job, spec), Dumper=_DUMPER, sort_keys=False)


_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)   # libyaml when PyYAML has it


def service(job: str, namespace: str, uid: str) -> dict:
    """Headless: no virtual IP, just DNS records `<pod-hostname>.<job>` for the rendezvous.

    publishNotReadyAddresses, because the rendezvous happens before any pod could be Ready (as
    JobSet does for its pod DNS).
    """
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": _meta(job, uid, service_name(job), namespace),
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                     "selector": {LABEL_JOB: job, LABEL_MANAGED_BY: MANAGER},
                     "ports": [{"name": "c10d", "port": RDZV_PORT, "targetPort": RDZV_PORT}]}}


def lease(job: str, namespace: str, uid: str) -> dict:
    """Created empty; trainer rank 0 patches its annotations (trainer/lease.py)."""
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": _meta(job, uid, progress_lease_name(job), namespace), "spec": {}}


def service_account(job: str, namespace: str, uid: str) -> dict:
    return {"apiVersion": "v1", "kind": "ServiceAccount",
            "metadata": _meta(job, uid, trainer_account_name(job), namespace)}


def role(job: str, namespace: str, uid: str) -> dict:
    """The trainer may read and patch its own job's progress Lease, and nothing else."""
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": _meta(job, uid, trainer_account_name(job), namespace),
            "rules": [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                       "resourceNames": [progress_lease_name(job)], "verbs": ["get", "patch"]}]}


def role_binding(job: str, namespace: str, uid: str) -> dict:
    name = trainer_account_name(job)
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": _meta(job, uid, name, namespace),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}]}


def static_children(job: str, namespace: str, uid: str, spec: PretrainJobSpec) -> list[dict]:
    """What exists once per job, in creation order (the Role before the binding that names it)."""
    return [service_account(job, namespace, uid), role(job, namespace, uid),
            role_binding(job, namespace, uid), lease(job, namespace, uid),
            config_map(job, namespace, uid, spec), service(job, namespace, uid)]


# --- worker pods ------------------------------------------------------------------------------
def _field_env(name: str, path: str) -> dict:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def _secret_env(name: str, secret: str, optional: bool) -> dict:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": name,
                                                         "optional": optional}}}


def torchrun_env(job: str, spec: PretrainJobSpec, generation: int, index: int) -> list[dict]:
    """PET_* flags for torchrun (names as Kubeflow's PyTorchJob sets them)."""
    ft = spec.fault_tolerance
    return [
        {"name": "PET_NNODES", "value": f"{spec.nodes.min}:{spec.nodes.max}"},
        {"name": "PET_NPROC_PER_NODE", "value": str(spec.procs_per_node)},
        {"name": "PET_RDZV_BACKEND", "value": "c10d"},
        {"name": "PET_RDZV_ENDPOINT", "value": rendezvous_endpoint(job, generation)},
        {"name": "PET_RDZV_ID", "value": f"{job}-{generation}"},
        # Pod 0 serves the c10d store (see the module docstring); say so rather than let torch
        # guess from DNS whether the endpoint is "this machine".
        {"name": "PET_RDZV_CONF", "value": f"is_host={1 if index == 0 else 0}"},
        {"name": "PET_MAX_RESTARTS", "value": str(ft.torchrun_max_restarts)},
    ] + [{"name": k, "value": v} for k, v in TORCHRUN_ENV.items()]  # trainer/launch.py


def container_env(job: str, spec: PretrainJobSpec, generation: int, index: int) -> list[dict]:
    env = torchrun_env(job, spec, generation, index) + [
        {"name": "CRUCIBLE_CONFIG", "value": f"{CONFIG_DIR}/{CONFIG_FILE}"},
        {"name": "CRUCIBLE_JOB", "value": job},
        {"name": "CRUCIBLE_GENERATION", "value": str(generation)},
        _field_env("POD_NAME", "metadata.name"),          # the progress Lease's holder
        _field_env("POD_NAMESPACE", "metadata.namespace"),  # where the progress Lease lives
        _field_env("NODE_NAME", "spec.nodeName"),
        {"name": "PYTHONUNBUFFERED", "value": "1"},
        {"name": "HOME", "value": SCRATCH_DIR},
        {"name": "TMPDIR", "value": SCRATCH_DIR},
    ]
    secret = spec.checkpoint.credentials_secret
    if secret:
        env += [_secret_env("AWS_ACCESS_KEY_ID", secret, False),
                _secret_env("AWS_SECRET_ACCESS_KEY", secret, False),
                _secret_env("AWS_ENDPOINT_URL", secret, True),
                _secret_env("AWS_DEFAULT_REGION", secret, True)]
    return env


def command() -> tuple[list[str], list[str]]:
    """(command, args): `$(CRUCIBLE_CONFIG)` is expanded by Kubernetes from the container env."""
    return ["torchrun"], ["--module", "crucible.trainer", "train", "--config", "$(CRUCIBLE_CONFIG)"]


def _affinity(avoid_nodes: list[str]) -> dict | None:
    if not avoid_nodes:
        return None
    term = {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "NotIn",
                                  "values": sorted(avoid_nodes)}]}
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [term]}}}


def _resources(spec: PretrainJobSpec) -> dict:
    return {kind: {name: str(amount) for name, amount in amounts.items()}
            for kind, amounts in spec.resources.items()}


def pod(job: str, namespace: str, uid: str, spec: PretrainJobSpec, generation: int, index: int,
        avoid_nodes: list[str] = ()) -> dict:
    """Worker pod `index` of `generation`. `avoid_nodes`: nodes that failed under this job."""
    name = pod_name(job, generation, index)
    cmd, args = command()
    meta = _meta(job, uid, name, namespace, **{LABEL_GENERATION: str(generation),
                                               LABEL_INDEX: str(index)})
    meta["annotations"] = {ANNOTATION_SPEC_HASH: spec_hash(spec)}
    container = {
        "name": CONTAINER, "image": spec.image, "command": cmd, "args": args,
        "workingDir": SCRATCH_DIR,
        "env": container_env(job, spec, generation, index),
        "ports": [{"name": "c10d", "containerPort": RDZV_PORT},
                  {"name": "metrics", "containerPort": METRICS_PORT}],
        "resources": _resources(spec),
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
                    {"name": "scratch", "emptyDir": {}},
                    # NCCL and DataLoader workers use shared memory; the runtime's 64 MiB is small.
                    {"name": "dshm", "emptyDir": {"medium": "Memory"}}],
    }
    if sched.node_selector:
        pod_spec["nodeSelector"] = dict(sched.node_selector)
    if sched.tolerations:
        pod_spec["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True)
                                   for t in sched.tolerations]
    if sched.priority_class_name:
        pod_spec["priorityClassName"] = sched.priority_class_name
    affinity = _affinity(list(avoid_nodes))
    if affinity:
        pod_spec["affinity"] = affinity
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod_spec}
