"""The Kubernetes Indexed Job that runs a corpus config on N workers, as a pure function.

Owns: `render_job(...)` (the ConfigMap holding the corpus config, and a batch/v1 Job) and
`to_yaml`. Must not: talk to the API server (whoever applies the YAML does).

Design: one Indexed Job (completionMode: Indexed, completions = parallelism = N). Pod i runs
`crucible corpus run --shard auto/N`, which reads JOB_COMPLETION_INDEX (set by the Job controller,
Kubernetes docs "Job: Completion mode") and does the tasks it owns in every stage, waiting at each
stage boundary for the others' completion markers in the shared output (pipeline.run_worker). A pod
that dies is recreated with the same index (backoffLimitPerIndex, Kubernetes 1.29+ beta / 1.33 GA)
and skips the tasks its predecessor finished. Credentials for s3:// come from a Secret via envFrom,
never from the manifest. manifests/corpus/indexed-job.yaml is this function's output for the
example config; tests/corpus/test_indexed_job.py re-renders it and parses its container command with
the real CLI parser, so the two cannot drift apart.
"""

from __future__ import annotations

from typing import Any

from crucible.api.launch import EXIT_USER_ERROR

CONFIG_MOUNT = "/etc/crucible/corpus"


def render_job(name: str, image: str, config_yaml: str, workers: int, *,
               namespace: str = "default", s3_secret: str | None = "s3-creds",
               cpu: str = "1", memory: str = "4Gi", retries_per_index: int = 3,
               wait_timeout_s: int = 24 * 3600) -> list[dict[str, Any]]:
    """[ConfigMap, Job] for running `config_yaml` on `workers` pods."""
    if workers < 1:
        raise ValueError("workers must be >= 1")
    labels = {"app.kubernetes.io/name": "crucible-corpus", "crucible.dev/corpus": name}
    config_map = {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": f"{name}-config", "namespace": namespace, "labels": labels},
        "data": {"corpus.yaml": config_yaml},
    }
    container: dict[str, Any] = {
        "name": "corpus",
        "image": image,
        "command": ["crucible"],
        "args": ["corpus", "run", "--config", f"{CONFIG_MOUNT}/corpus.yaml",
                 "--shard", f"auto/{workers}", "--wait-timeout-s", str(wait_timeout_s)],
        "resources": {"requests": {"cpu": cpu, "memory": memory},
                      "limits": {"cpu": cpu, "memory": memory}},
        "volumeMounts": [{"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True}],
    }
    if s3_secret:
        # AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and, for S3-compatible stores, AWS_ENDPOINT_URL.
        container["envFrom"] = [{"secretRef": {"name": s3_secret}}]
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
                "spec": {"restartPolicy": "Never", "containers": [container],
                         "volumes": [{"name": "config",
                                      "configMap": {"name": f"{name}-config"}}]},
            },
        },
    }
    return [config_map, job]


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
