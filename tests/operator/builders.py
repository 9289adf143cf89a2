"""Raw API objects (as the apiserver and KWOK write them) for the operator's unit tests.

The tests feed these through the same parsers the operator's indexes use (operator/observed.py), so
parsing is under test too. Field shapes follow what this repository's stack produces: KWOK's
pod-ready and pod-container-running-failed stages, the node lifecycle controller's conditions and
taints, the apiserver's DisruptionTarget condition.
"""

from __future__ import annotations

import dataclasses
import datetime as dt

from crucible.api.progress import ProgressReport
from crucible.api.spec import PretrainJobSpec
from crucible.operator import manifests as m
from crucible.operator.observed import (ChildView, JobView, Observed, job_view, lease_view,
                                        node_view, pod_view, workload_view)

T0 = dt.datetime(2026, 3, 1, 12, 0, 0, tzinfo=dt.timezone.utc)
JOB, NS, UID = "gpt", "team-a", "uid-job-1"


def at(seconds: float) -> dt.datetime:
    return T0 + dt.timedelta(seconds=seconds)


def ts(seconds: float) -> str:
    return at(seconds).isoformat().replace("+00:00", "Z")


def spec_doc(**overrides) -> dict:
    doc = {"image": "registry.example/crucible-trainer:0.1", "nodes": {"min": 2, "max": 4},
           "procsPerNode": 8, "resources": {"limits": {"nvidia.com/gpu": 8}},
           "model": {"preset": "tiny"}, "data": {"train": "s3://bucket/tokens/train"},
           "training": {"tokens": 1e9},
           "checkpoint": {"uri": "s3://bucket/runs/gpt", "credentialsSecret": "s3-creds"},
           "faultTolerance": {"maxRestarts": 3, "hangTimeoutSeconds": 600,
                              "nodeFailureGraceSeconds": 60}}
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(doc.get(key), dict):
            doc[key] = {**doc[key], **value}
        else:
            doc[key] = value
    return doc


def spec(**overrides) -> PretrainJobSpec:
    return PretrainJobSpec.model_validate(spec_doc(**overrides))


def job(status: dict | None = None, generation: int = 1, deleting: bool = False,
        labels: dict | None = None, **spec_overrides) -> JobView:
    body = {"metadata": {"name": JOB, "namespace": NS, "uid": UID, "generation": generation,
                         "labels": labels or {}},
            "spec": spec_doc(**spec_overrides), "status": status or {}}
    if deleting:
        body["metadata"]["deletionTimestamp"] = ts(0)
    return job_view(body)


def pod_body(gen: int, index: int, *, phase: str = "Running", node: str | None = "gpu-node-0",
             uid: str | None = None, exit_code: int | None = None, reason: str | None = None,
             terminated_reason: str | None = None, deletion: float | None = None,
             disruption: str | None = None, unschedulable: str | None = None,
             waiting: str | None = None, waiting_message: str | None = None,
             created: float = 0, spec_hash: str | None = "same",
             owner: str | None = UID, finished: float | None = None, grace: int | None = None,
             terminated_message: str | None = None):
    name = m.pod_name(JOB, gen, index)
    body = {"metadata": {"name": name, "namespace": NS, "uid": uid or f"uid-{name}",
                         "creationTimestamp": ts(created),
                         "ownerReferences": [m.owner_reference(JOB, owner)] if owner else [],
                         "labels": m.labels(JOB, **{m.LABEL_GENERATION: str(gen),
                                                    m.LABEL_INDEX: str(index)}),
                         "annotations": {m.ANNOTATION_SPEC_HASH: spec_hash} if spec_hash else {}},
            "spec": {"nodeName": node} if node else {},
            "status": {"phase": phase, "conditions": []}}
    if deletion is not None:
        body["metadata"]["deletionTimestamp"] = ts(deletion)
        if grace is not None:
            body["metadata"]["deletionGracePeriodSeconds"] = grace
    status = body["status"]
    if reason:
        status["reason"] = reason
    if disruption:
        status["conditions"].append({"type": "DisruptionTarget", "status": "True",
                                     "reason": disruption})
    if unschedulable:
        status["conditions"].append({"type": "PodScheduled", "status": "False",
                                     "reason": "Unschedulable", "message": unschedulable})
    if exit_code is not None:
        status["containerStatuses"] = [{"name": m.CONTAINER, "state": {"terminated": {
            "exitCode": exit_code, "reason": terminated_reason or "Error",
            **({"finishedAt": ts(finished)} if finished is not None else {}),
            **({"message": terminated_message} if terminated_message else {})}}}]
    elif waiting:
        status["containerStatuses"] = [{"name": m.CONTAINER, "state": {"waiting": {
            "reason": waiting, "message": waiting_message or f"{waiting} for the image"}}}]
    return body


def pod(gen: int, index: int, **kw):
    return pod_view(pod_body(gen, index, **kw))


def running(gen: int, count: int, spec_hash: str, **kw) -> list:
    return [pod(gen, i, node=f"gpu-node-{i}", spec_hash=spec_hash, **kw) for i in range(count)]


def node(name: str, *, ready: str = "True", since: float = 0, unschedulable: bool = False,
         taints: list[tuple[str, str, float]] = (), conditions: dict[str, str] | None = None,
         annotations: dict[str, str] | None = None, cordoned_by_manager: str = "kubectl-cordon"):
    """`cordoned_by_manager`: the field manager managedFields name for spec.unschedulable."""
    conds = [{"type": "Ready", "status": ready, "lastTransitionTime": ts(since),
              "reason": "NodeStatusUnknown" if ready == "Unknown" else "KubeletReady",
              "message": "Kubelet stopped posting node status." if ready == "Unknown" else ""}]
    for type_, status in (conditions or {}).items():
        conds.append({"type": type_, "status": status, "lastTransitionTime": ts(since),
                      "reason": f"{type_}Detected", "message": "XID 79 on GPU 3"})
    managed = [{"manager": "kubelet", "operation": "Update",
                "fieldsV1": {"f:status": {"f:conditions": {}}}}]
    if unschedulable:
        managed.append({"manager": cordoned_by_manager, "operation": "Update",
                        "fieldsV1": {"f:spec": {"f:unschedulable": {}}}})
    body = {"metadata": {"name": name, "annotations": annotations or {},
                         "managedFields": managed},
            "spec": {"unschedulable": unschedulable,
                     "taints": [{"key": k, "effect": e, "timeAdded": ts(t)} for k, e, t in taints]},
            "status": {"conditions": conds}}
    return node_view(body)


def healthy_nodes(count: int = 4) -> dict:
    return {f"gpu-node-{i}": node(f"gpu-node-{i}") for i in range(count)}


def lease(step: int | None = None, step_time: float | None = None, *, loss: float = 3.2,
          tokens: int | None = None, checkpoint_step: int | None = None):
    """The progress Lease as the trainer writes it (`ProgressReport.to_annotations`)."""
    report = ProgressReport()
    if step is not None:
        report = dataclasses.replace(report, step=step, loss=loss, world_size=32,
                                     tokens=tokens if tokens is not None else step * 524288)
    if step_time is not None:
        report = dataclasses.replace(report, step_time=at(step_time))
    if checkpoint_step is not None:
        report = dataclasses.replace(
            report, checkpoint_step=checkpoint_step,
            checkpoint_uri=f"s3://bucket/runs/gpt/step_{checkpoint_step}",
            checkpoint_time=at(step_time or 0))
    return lease_view({"metadata": {"annotations": report.to_annotations()}, "spec": {}})


def observed(pods=(), nodes=None, lease_view_=None, children=None,
             capacity_granted: bool | None = None,
             priority_classes: frozenset[str] | None = None, **queueing) -> Observed:
    """`queueing`: Kueue's side (workload, cluster_queue, flavors, priority_values)."""
    if children is None:
        s = spec()
        children = frozenset(
            ChildView(c["kind"], c["metadata"]["name"],
                      m.child_digest(c), UID)
            for c in m.static_children(JOB, NS, UID, s))
    return Observed(pods=tuple(pods), nodes=nodes if nodes is not None else healthy_nodes(),
                    children=children, lease=lease_view_, capacity_granted=capacity_granted,
                    priority_classes=priority_classes, **queueing)


def workload_body(body: dict, *, conditions: dict[str, tuple[str, str, str]] | None = None,
                  cluster_queue: str | None = None, count: int | None = None,
                  flavor: str = "gpu", owner: str | None = UID, resource_version: str = "7"):
    """A Workload as Kueue leaves it: `body` as the operator created it (queueing.workload),
    with `conditions` {type: (status, reason, message)} and, when admitted, the admission."""
    body = {**body, "metadata": {**body["metadata"], "resourceVersion": resource_version}}
    if owner != UID:
        body["metadata"]["ownerReferences"] = [m.owner_reference("other", owner)] if owner else []
    status = {"conditions": [{"type": t, "status": st, "reason": r, "message": msg,
                              "lastTransitionTime": ts(0)}
                             for t, (st, r, msg) in (conditions or {}).items()]}
    if cluster_queue is not None:
        status["admission"] = {"clusterQueue": cluster_queue, "podSetAssignments": [
            {"name": "workers", "flavors": {"nvidia.com/gpu": flavor}, "count": count}]}
    return {**body, "status": status}


def workload(body: dict, **kw):
    return workload_view(workload_body(body, **kw))
