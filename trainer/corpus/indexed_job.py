"""The Kubernetes Indexed Job that runs a corpus config on N workers, as a pure function.

Owns: `render_job(...)` (the ConfigMap holding the corpus config, the pods' NetworkPolicy and a
batch/v1 Job) and `to_yaml`. Must not: talk to the API server (whoever applies the YAML does).

Design: one Indexed Job (completionMode: Indexed, completions = parallelism = N). Pod i runs
`crucible corpus run --shard auto/N`, which reads JOB_COMPLETION_INDEX (set by the Job controller,
Kubernetes docs "Job: Completion mode") and does the tasks it owns in every stage, waiting at each
stage boundary for the others' completion markers in the shared output (pipeline.run_worker). A pod
that dies is recreated with the same index (backoffLimitPerIndex, Kubernetes 1.29+ beta / 1.33 GA)
and skips the tasks its predecessor finished. manifests/corpus/indexed-job.yaml is this function's
output for the example config; tests/corpus/test_indexed_job.py re-renders it and parses its
container command with the real CLI parser, so the two cannot drift apart.

The pods parse untrusted web data, so they run as the Pod Security Standards' "restricted" profile
requires (a test has a restricted namespace admit them): as the image's numeric non-root user with
the runtime's seccomp profile, no privilege escalation, no capabilities, a read-only root
filesystem and no service-account token (they never call the API server). The one writable place
is an emptyDir with a size limit at /scratch, which is HOME, TMPDIR and the working directory (as
in the operator's training pods): the pipeline writes only temporary files there, the S3 upload
spool of each output shard and the spool of a Parquet input from S3 (Python's tempfile). S3
credentials come from a Secret key by key, never from the manifest; a whole-Secret envFrom would
hand the pods whatever else someone later puts in that Secret.
"""

from __future__ import annotations

from typing import Any

from crucible.api.launch import EXIT_USER_ERROR
from crucible.api.network import egress_but_instance_metadata

CONFIG_MOUNT = "/etc/crucible/corpus"
SCRATCH_DIR = "/scratch"     # the image's HOME and working directory (trainer/Dockerfile)
RUN_UID = 1000               # the image's numeric user, so runAsNonRoot can be verified
# S3 variables read from the Secret, and whether a pod may start without them.
S3_ENV = {"AWS_ACCESS_KEY_ID": True, "AWS_SECRET_ACCESS_KEY": True,
          "AWS_ENDPOINT_URL": False,      # S3-compatible stores only
          "AWS_DEFAULT_REGION": False}


def s3_env(secret: str, keys: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Container env for S3 from `secret`; `keys` maps a variable to its key in the Secret where
    the two differ (default: the key is the variable's name)."""
    keys = keys or {}
    unknown = set(keys) - set(S3_ENV)
    if unknown:
        raise ValueError(f"s3 keys: unknown variables {sorted(unknown)}; known: {list(S3_ENV)}")
    return [{"name": name, "valueFrom": {"secretKeyRef": {"name": secret,
                                                          "key": keys.get(name, name),
                                                          "optional": not required}}}
            for name, required in S3_ENV.items()]


def corpus_labels(name: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "crucible-corpus", "crucible.dev/corpus": name}


def config_map_of(name: str, namespace: str, config_yaml: str) -> dict[str, Any]:
    """The ConfigMap `<name>-config` the pods mount the corpus config from."""
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": f"{name}-config", "namespace": namespace,
                         "labels": corpus_labels(name)},
            "data": {"corpus.yaml": config_yaml}}


def pod_env(s3_secret: str | None, s3_keys: dict[str, str] | None,
            instance_metadata: bool = False) -> list[dict[str, Any]]:
    """HOME and TMPDIR on the scratch volume, S3 credentials from `s3_secret` if given, and the
    AWS SDK told not to ask the instance metadata for the node's role unless allowed."""
    env = [{"name": "HOME", "value": SCRATCH_DIR}, {"name": "TMPDIR", "value": SCRATCH_DIR}]
    if not instance_metadata:
        env.append({"name": "AWS_EC2_METADATA_DISABLED", "value": "true"})
    return env + s3_env(s3_secret, s3_keys) if s3_secret else env


def network_policy(name: str, namespace: str, instance_metadata: bool = False,
                   ingress: list[dict] | None = None) -> dict[str, Any]:
    """The corpus pods' NetworkPolicy: no ingress but `ingress` (an Indexed Job's workers meet
    only through S3), egress anywhere but the instance metadata (the node's cloud role) unless
    `instance_metadata`. Listed before the pods' owner, so `kubectl apply` makes it first."""
    spec: dict[str, Any] = {"podSelector": {"matchLabels": corpus_labels(name)},
                            "policyTypes": ["Ingress"], "ingress": ingress or []}
    if not instance_metadata:
        spec["policyTypes"].append("Egress")
        spec["egress"] = egress_but_instance_metadata()
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": name, "namespace": namespace, "labels": corpus_labels(name)},
            "spec": spec}


def render_job(name: str, image: str, config_yaml: str, workers: int, *,
               namespace: str = "default", s3_secret: str | None = "s3-creds",
               s3_keys: dict[str, str] | None = None, cpu: str = "1", memory: str = "4Gi",
               scratch: str = "32Gi", retries_per_index: int = 3,
               wait_timeout_s: int = 24 * 3600, shards: int | None = None,
               instance_metadata: bool = False) -> list[dict[str, Any]]:
    """[ConfigMap, NetworkPolicy, Job] for running `config_yaml` on `workers` pods. `scratch` is the emptyDir's
    size limit: room for one output shard and one Parquet input from S3 (at most the config's
    limits.max_file_bytes) at a time. `shards` (default: one per pod) splits the corpus finer
    than the pods: pod i runs tasks i, i+N, ..., so a pod lost mid-stage redoes one shard."""
    if workers < 1:
        raise ValueError("workers must be >= 1")
    if shards is not None and shards < 1:
        raise ValueError("shards must be >= 1")
    labels = corpus_labels(name)
    config_map = config_map_of(name, namespace, config_yaml)
    env = pod_env(s3_secret, s3_keys, instance_metadata)
    container: dict[str, Any] = {
        "name": "corpus",
        "image": image,
        "command": ["crucible"],
        "args": ["corpus", "run", "--config", f"{CONFIG_MOUNT}/corpus.yaml",
                 "--shard", f"auto/{workers}", "--wait-timeout-s", str(wait_timeout_s),
                 *(["--shards", str(shards)] if shards else [])],
        "workingDir": SCRATCH_DIR,
        "env": env,
        "resources": {"requests": {"cpu": cpu, "memory": memory},
                      "limits": {"cpu": cpu, "memory": memory}},
        "volumeMounts": [{"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True},
                         {"name": "scratch", "mountPath": SCRATCH_DIR}],
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "capabilities": {"drop": ["ALL"]}},
    }
    job = {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {
            "completionMode": "Indexed",
            "completions": workers,
            "parallelism": workers,   # all at once: stage barriers wait for every index
            "backoffLimitPerIndex": retries_per_index,
            # One index that keeps failing fails the job: no partial corpus.
            "maxFailedIndexes": 0,
            "podFailurePolicy": {"rules": [
                # A user error (bad config): retrying cannot fix it.
                {"action": "FailJob", "onExitCodes": {"containerName": "corpus", "operator": "In",
                                                      "values": [EXIT_USER_ERROR]}}]},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"restartPolicy": "Never",
                         "automountServiceAccountToken": False,
                         "enableServiceLinks": False,
                         "securityContext": {"runAsNonRoot": True, "runAsUser": RUN_UID,
                                             "runAsGroup": RUN_UID,
                                             "seccompProfile": {"type": "RuntimeDefault"}},
                         "containers": [container],
                         "volumes": [{"name": "config",
                                      "configMap": {"name": f"{name}-config"}},
                                     {"name": "scratch", "emptyDir": {"sizeLimit": scratch}}]},
            },
        },
    }
    return [config_map, network_policy(name, namespace, instance_metadata), job]


def to_yaml(objects: list[dict[str, Any]]) -> str:
    """YAML a person can read: no anchors, multi-line strings (the config) as literal blocks."""
    import yaml

    class Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:
            return True

    def text(dumper: yaml.SafeDumper, value: str):
        style = "|" if "\n" in value else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)

    Dumper.add_representer(str, text)
    return yaml.dump_all(objects, Dumper=Dumper, sort_keys=False, width=100)
