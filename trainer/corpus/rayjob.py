"""The KubeRay RayJob that runs a corpus config on a Ray cluster of N worker pods, as pure data.

Owns: `render_rayjob(...)` (the ConfigMap holding the corpus config, and a ray.io/v1 RayJob).
Must not: talk to the API server, or repeat what indexed_job.py owns (the S3 environment from a
Secret, the pod user, YAML output): it reuses those.

Design: the KubeRay operator (github.com/ray-project/kuberay, ray-operator/apis/ray/v1/
rayjob_types.go) creates a RayCluster from `rayClusterSpec`, a submitter Job runs `ray job submit`
with `entrypoint` once the cluster is up, and `shutdownAfterJobFinishes` deletes the cluster when
the entrypoint exits. The entrypoint, `crucible corpus run --ray auto`, runs on the head (Ray's job
supervisor starts it there, RAY_ADDRESS set) and hands every pipeline task to the workers
(ray_runner.run_ray). The head is started with zero CPUs so that no task lands on it: it holds the
GCS, the dashboard that accepts the job and the driver. A worker pod lost mid-stage costs a Ray task
retry (`--ray-retries`); a lost head fails the job, and submitting it again resumes from the
completion markers. `backoffLimit` stays 0 because a RayJob retry cannot tell a bad config (exit 2,
which retrying cannot fix) from a crash. manifests/corpus/rayjob.yaml is this function's output
for the example config; tests/corpus/test_rayjob.py re-renders it and parses the entrypoint with
the real CLI parser.

Security posture as indexed_job.py's pods (Pod Security Standards "restricted"): UID 1000, the
runtime's seccomp profile, no privilege escalation, no capabilities, no service-account token, a
read-only root filesystem. Ray needs more writable places than the Indexed Job's one:
  - /tmp/ray (RAY_TMPDIR=/tmp): Ray's session folder with its logs, sockets and spilled objects.
    Ray would otherwise follow TMPDIR (_common/utils.py::get_default_system_temp_dir) and mix its
    files into the pipeline's scratch space.
  - /dev/shm: the object store. KubeRay mounts a memory-backed emptyDir there on its own
    (ray-operator/controllers/ray/common/pod.go, "shared-mem"); our tasks put only the config and
    one float per task in it, hence the small `object-store-memory`.
  - /scratch: HOME and TMPDIR, as in the Indexed Job (S3 upload and Parquet spools).
KubeRay's default probes for Ray >= 2.53 are HTTP gets, so the image needs no wget. Ray's job API
(the head's dashboard, port 8265) runs whatever it is sent; `authOptions: {mode: token}` (KubeRay
1.5.1+, ray-operator/apis/ray/v1/raycluster_types.go::AuthOptions) has KubeRay generate a token
Secret per cluster and hand it to the Ray containers and the submitter, so only they can.
"""

from __future__ import annotations

import shlex
from typing import Any

from crucible.trainer.corpus.indexed_job import (CONFIG_MOUNT, RUN_UID, SCRATCH_DIR, config_map_of,
                                                  corpus_labels, network_policy, pod_env)
from crucible.trainer.corpus.ray_runner import TASKS_PER_CPU

RAY_VERSION = "2.60.0"           # the pinned `ray` of the trainer extra (pyproject.toml)
RAY_TMP_DIR = "/tmp/ray"          # RAY_TMPDIR=/tmp: Ray appends "ray"
OBJECT_STORE_BYTES = 256 * 2**20  # config + results only; Ray's floor is 75 MiB
DASHBOARD_PORT = 8265            # the head's job API, which KubeRay and the submitter call


def _security() -> tuple[dict[str, Any], dict[str, Any]]:
    """(pod, container) securityContexts, as the Indexed Job's pods."""
    pod = {"runAsNonRoot": True, "runAsUser": RUN_UID, "runAsGroup": RUN_UID,
           "seccompProfile": {"type": "RuntimeDefault"}}
    container = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                 "capabilities": {"drop": ["ALL"]}}
    return pod, container


def _pod(container: dict[str, Any], volumes: list[dict[str, Any]],
         labels: dict[str, str]) -> dict[str, Any]:
    pod_security, container_security = _security()
    return {"metadata": {"labels": labels},
            "spec": {"automountServiceAccountToken": False,
                     "enableServiceLinks": False,
                     "securityContext": pod_security,
                     "containers": [{**container, "securityContext": container_security}],
                     "volumes": volumes}}


def entrypoint_args(workers: int, cpus_per_worker: int, ray_resources: list[str]) -> list[str]:
    """The entrypoint's argv: the shard count is written out (4 per worker CPU) so that a
    resubmitted job resumes the same run whatever the cluster's size then."""
    args = ["crucible", "corpus", "run", "--config", f"{CONFIG_MOUNT}/corpus.yaml",
            "--ray", "auto", "--shards", str(TASKS_PER_CPU * workers * cpus_per_worker)]
    for spec in ray_resources:
        args += ["--ray-resources", spec]
    return args


def render_rayjob(name: str, image: str, config_yaml: str, workers: int, *,
                  namespace: str = "default", s3_secret: str | None = "s3-creds",
                  s3_keys: dict[str, str] | None = None, cpus_per_worker: int = 1,
                  memory: str = "4Gi", head_cpu: str = "1", head_memory: str = "4Gi",
                  scratch: str = "32Gi", ray_tmp: str = "8Gi",
                  ray_resources: list[str] | None = None,
                  instance_metadata: bool = False) -> list[dict[str, Any]]:
    """[ConfigMap, NetworkPolicy, RayJob] for running `config_yaml` on `workers` worker pods of
    `cpus_per_worker` CPUs each (the same CPUs and memory per worker as the Indexed Job by
    default). `ray_tmp` bounds Ray's logs and spilled objects per pod. The NetworkPolicy lets
    the cluster's pods reach each other on every port (the GCS, the object store and the
    workers pick theirs), and the dashboard's job API (token-authenticated) from any namespace:
    the KubeRay operator follows the job there."""
    if workers < 1 or cpus_per_worker < 1:
        raise ValueError("workers and cpus per worker must be >= 1")
    labels = corpus_labels(name)
    config_map = config_map_of(name, namespace, config_yaml)
    env = pod_env(s3_secret, s3_keys, instance_metadata) + [{"name": "RAY_TMPDIR",
                                                             "value": "/tmp"}]
    writable = [{"name": "scratch", "mountPath": SCRATCH_DIR},
                {"name": "ray-tmp", "mountPath": RAY_TMP_DIR}]
    writable_volumes = [{"name": "scratch", "emptyDir": {"sizeLimit": scratch}},
                        {"name": "ray-tmp", "emptyDir": {"sizeLimit": ray_tmp}}]

    def ray_container(cpu: str, mem: str, mounts: list[dict[str, Any]]) -> dict[str, Any]:
        # No command: KubeRay writes `ray start ...` from rayStartParams and the resources.
        return {"name": "ray", "image": image, "workingDir": SCRATCH_DIR, "env": env,
                "resources": {"requests": {"cpu": cpu, "memory": mem},
                              "limits": {"cpu": cpu, "memory": mem}},
                "volumeMounts": mounts}

    config_mount = {"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True}
    config_volume = {"name": "config", "configMap": {"name": f"{name}-config"}}
    start = {"object-store-memory": str(OBJECT_STORE_BYTES)}
    head = {
        # The entrypoint (the driver) runs here and reads the config; workers get it from Ray.
        # dashboard-host: the submitter pod reaches the job API through the head's Service.
        "rayStartParams": {**start, "num-cpus": "0", "dashboard-host": "0.0.0.0"},
        "template": _pod(ray_container(head_cpu, head_memory, [config_mount, *writable]),
                         [config_volume, *writable_volumes], labels),
    }
    worker_group = {
        "groupName": "workers",
        "replicas": workers, "minReplicas": workers, "maxReplicas": workers,
        "rayStartParams": start,   # num-cpus comes from the container's CPU limit
        "template": _pod(ray_container(str(cpus_per_worker), memory, writable),
                         writable_volumes, labels),
    }
    # The submitter only runs `ray job submit` (KubeRay fills in the command) and follows the
    # logs: the same hardening, HOME on a small emptyDir for the Ray CLI.
    submitter = _pod({"name": "submitter", "image": image,
                      "env": [{"name": "HOME", "value": SCRATCH_DIR}],
                      "resources": {"requests": {"cpu": "100m", "memory": "256Mi"},
                                    "limits": {"cpu": "500m", "memory": "1Gi"}},
                      "volumeMounts": [{"name": "scratch", "mountPath": SCRATCH_DIR}]},
                     [{"name": "scratch", "emptyDir": {"sizeLimit": "64Mi"}}], labels)
    submitter["spec"]["restartPolicy"] = "Never"
    rayjob = {
        "apiVersion": "ray.io/v1", "kind": "RayJob",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {
            "entrypoint": shlex.join(entrypoint_args(workers, cpus_per_worker,
                                                     ray_resources or [])),
            "shutdownAfterJobFinishes": True,
            "backoffLimit": 0,
            "submitterPodTemplate": submitter,
            "rayClusterSpec": {"rayVersion": RAY_VERSION,
                               "authOptions": {"mode": "token"},
                               "headGroupSpec": head,
                               "workerGroupSpecs": [worker_group]},
        },
    }
    own = {"podSelector": {"matchLabels": labels}}
    policy = network_policy(name, namespace, instance_metadata, ingress=[
        {"from": [own]},
        {"from": [{"namespaceSelector": {}}],
         "ports": [{"protocol": "TCP", "port": DASHBOARD_PORT}]}])
    return [config_map, policy, rayjob]
