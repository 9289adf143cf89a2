"""Helpers for the operator's cluster tests: PretrainJobs, pods and KWOK chaos via the real API.

Every wait has a deadline (`eventually`). Chaos is what docs/operator.md's failure table lists:
KWOK's pod-container-running-failed stage fails a pod's container with a chosen exit code,
deleting pods, stopping a node's heartbeat (the node controller does the rest), killing the
operator.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from crucible.operator import crd
from crucible.operator import manifests as m
from tests.support.services import Kube, eventually

REPO = Path(__file__).resolve().parents[2]
KWOK_FAIL = "pod-container-running-failed.stage.kwok.x-k8s.io"
IMAGE = "registry.invalid/crucible-trainer:test"   # KWOK never pulls it


def job_body(name: str, **spec) -> dict:
    doc = {"image": IMAGE, "nodes": {"min": 1, "max": 2}, "model": {"preset": "tiny"},
           "data": {"train": "s3://crucible/tokens/train"}, "training": {"tokens": 1e6},
           # No trainer runs on KWOK: keep hang detection out of the way unless a test wants it.
           "faultTolerance": {"hangTimeoutSeconds": 3600, "nodeFailureGraceSeconds": 2}}
    for key, value in spec.items():
        doc[key] = {**doc[key], **value} if isinstance(value, dict) and key in doc else value
    return {"apiVersion": crd.API_VERSION, "kind": crd.KIND, "metadata": {"name": name},
            "spec": doc}


@dataclass
class Cluster:
    kube: Kube
    namespace: str

    def __post_init__(self):
        api = self.kube.client()
        self.api = api
        self.core = client.CoreV1Api(api)
        self.objs = client.CustomObjectsApi(api)
        self.coordination = client.CoordinationV1Api(api)

    # -- nodes --------------------------------------------------------------------------------
    def forget_failure(self, node: str) -> None:
        """What whoever repairs a node does: uncordon it and drop the operator's reports."""
        current = self.core.read_node(node).metadata.annotations or {}
        self.core.patch_node(node, {"spec": {"unschedulable": None}, "metadata": {"annotations": {
            k: None for k in current if k.startswith("crucible.dev/")}}})

    def revive(self, node: str) -> None:
        """A KWOK node killed by a test, heartbeating again and repaired, and the next test not
        started before it can take pods again."""
        self.kube.set_node_alive(node, True)
        self.forget_failure(node)
        self.kube.wait_nodes_healthy([node])

    # -- jobs ---------------------------------------------------------------------------------
    def create_job(self, name: str, **spec) -> dict:
        return self.objs.create_namespaced_custom_object(crd.GROUP, crd.VERSION, self.namespace,
                                                         crd.PLURAL, job_body(name, **spec))

    def job(self, name: str) -> dict:
        return self.objs.get_namespaced_custom_object(crd.GROUP, crd.VERSION, self.namespace,
                                                      crd.PLURAL, name)

    def status(self, name: str) -> dict:
        return self.job(name).get("status") or {}

    def rejection(self, doc: dict) -> str | None:
        """Why the apiserver refuses `doc` as `kubectl apply` sends it (a create with field
        validation Strict, dry run: nothing is stored); None when it accepts it."""
        try:
            self.objs.create_namespaced_custom_object(crd.GROUP, crd.VERSION, self.namespace,
                                                      crd.PLURAL, doc, dry_run="All",
                                                      field_validation="Strict")
        except ApiException as err:
            assert err.status in (400, 422), err
            return err.body
        return None

    def printed_row(self, name: str, wide: bool = False) -> dict:
        """What `kubectl get ptj` (`-o wide`) prints for the job: the server-side Table, by
        column name."""
        path = f"/apis/{crd.API_VERSION}/namespaces/{self.namespace}/{crd.PLURAL}/{name}"
        resp = self.api.call_api(
            path, "GET", header_params={"Accept": "application/json;as=Table;v=v1;g=meta.k8s.io"},
            auth_settings=["BearerToken"], _preload_content=False, _return_http_data_only=True)
        data = json.loads(resp.data)
        columns = [c["name"] for c in data["columnDefinitions"] if wide or c["priority"] == 0]
        return dict(zip(columns, data["rows"][0]["cells"]))

    def patch_spec(self, name: str, spec: dict) -> None:
        self.objs.patch_namespaced_custom_object(crd.GROUP, crd.VERSION, self.namespace,
                                                 crd.PLURAL, name, {"spec": spec})

    def delete_job(self, name: str) -> None:
        self.objs.delete_namespaced_custom_object(crd.GROUP, crd.VERSION, self.namespace,
                                                  crd.PLURAL, name)

    def wait_phase(self, name: str, phase: str, timeout_s: float = 60) -> dict:
        return eventually(lambda: (s := self.status(name)).get("phase") == phase and s,
                          timeout_s, f"{name} phase {phase} (now {self.status(name).get('phase')})")

    def strip_finalizers(self) -> None:
        """After the operator stopped: let the namespace go (kopf's finalizer would hold it)."""
        try:
            items = self.objs.list_namespaced_custom_object(crd.GROUP, crd.VERSION, self.namespace,
                                                            crd.PLURAL)["items"]
        except ApiException:
            return
        for item in items:
            if item["metadata"].get("finalizers"):
                try:
                    self.objs.patch_namespaced_custom_object(
                        crd.GROUP, crd.VERSION, self.namespace, crd.PLURAL,
                        item["metadata"]["name"], {"metadata": {"finalizers": None}})
                except ApiException as err:
                    if err.status != 404:    # gone since the list: nothing holds it
                        raise

    # -- pods ---------------------------------------------------------------------------------
    def pods(self, job: str) -> list:
        return self.core.list_namespaced_pod(self.namespace,
                                             label_selector=f"{m.LABEL_JOB}={job}").items

    def running(self, job: str, generation: int | None = None) -> list:
        return [p for p in self.pods(job) if p.status.phase == "Running"
                and not p.metadata.deletion_timestamp
                and (generation is None
                     or p.metadata.labels[m.LABEL_GENERATION] == str(generation))]

    def wait_running(self, job: str, count: int, generation: int | None = None,
                     timeout_s: float = 60) -> list:
        return eventually(lambda: (ps := self.running(job, generation)) and len(ps) == count and ps,
                          timeout_s, f"{count} running pods of {job} generation {generation}")

    def fail_pod(self, name: str, exit_code: int, reason: str = "Error") -> None:
        """KWOK's chaos stage terminates the container with this exit code (pod phase Failed)."""
        self.core.patch_namespaced_pod(name, self.namespace, {"metadata": {
            "labels": {KWOK_FAIL: "true"},
            "annotations": {f"{KWOK_FAIL}/exit-code": str(exit_code),
                            f"{KWOK_FAIL}/reason": reason, f"{KWOK_FAIL}/delay": "0ms",
                            f"{KWOK_FAIL}/jitter-delay": "0ms"}}})

    def succeed_pod(self, name: str) -> None:
        """What a kubelet reports when the trainer exits 0 (KWOK has no stage for our pods)."""
        now = "2026-01-01T00:00:00Z"
        self.core.patch_namespaced_pod_status(name, self.namespace, {"status": {
            "phase": "Succeeded", "containerStatuses": [{
                "name": m.CONTAINER, "image": IMAGE, "imageID": "", "ready": False,
                "restartCount": 0, "state": {"terminated": {
                    "exitCode": 0, "reason": "Completed", "startedAt": now, "finishedAt": now}}}]}})

    def config_error_pod(self, name: str, message: str) -> None:
        """What a kubelet reports when it cannot build a container's env (a Secret missing):
        the pod stays Pending, its container waiting in CreateContainerConfigError."""
        self.core.patch_namespaced_pod_status(name, self.namespace, {"status": {
            "phase": "Pending", "containerStatuses": [{
                "name": m.CONTAINER, "image": IMAGE, "imageID": "", "ready": False,
                "restartCount": 0, "state": {"waiting": {
                    "reason": "CreateContainerConfigError", "message": message}}}]}})

    def events(self, job: str) -> list:
        return [e for e in self.core.list_namespaced_event(
            self.namespace, field_selector=f"involvedObject.name={job}").items
            if e.involved_object.kind == crd.KIND]

    def event_reasons(self, job: str) -> list[str]:
        return [e.reason for e in self.events(job)]

    def wait_event(self, job: str, reason: str, count: int | None = None,
                   timeout_s: float = 30) -> list[str]:
        """The job's event reasons once `reason` is among them (exactly `count` times, if given).
        kopf posts events from a background queue, so one can land after the status a test has
        just waited for."""
        def seen() -> list[str] | None:
            reasons = self.event_reasons(job)
            found = reasons.count(reason) == count if count is not None else reason in reasons
            return reasons if found else None
        return eventually(seen, timeout_s, f"{reason} event" + (f" x{count}" if count else ""))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def operator_env(kubeconfig: Path, metrics_port: int | str = "off") -> dict:
    return {"KUBECONFIG": str(kubeconfig), "CRUCIBLE_OPERATOR_INTERVAL": "2",
            "CRUCIBLE_OPERATOR_WORKERS": "8", "CRUCIBLE_OPERATOR_METRICS_PORT": str(metrics_port),
            "CRUCIBLE_OPERATOR_METRICS_ADDRESS": "127.0.0.1"}


def operator_process(kubeconfig: Path, namespace: str, log: Path,
                     *extra_args: str) -> subprocess.Popen:
    """`crucible-operator run` as a real process (so it can be SIGKILLed mid-pass)."""
    env = {**os.environ, **operator_env(kubeconfig)}
    env.pop("PYTHONPATH", None)
    out = open(log, "ab")
    return subprocess.Popen([sys.executable, "-m", "crucible.operator.main", "run", "--namespace",
                             namespace, "--interval", "2", "--metrics-port", "off", *extra_args],
                            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
