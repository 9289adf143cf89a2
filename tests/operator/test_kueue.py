"""Queueing through a real Kueue (built from the Go module proxy and run by the local stack).

Every job here carries the `kueue.x-k8s.io/queue-name` label; each test makes its own
ResourceFlavor, ClusterQueue and LocalQueue (and KWOK nodes where it needs racks), and removes
them. The pool is the stack's four 8-GPU nodes unless a test says otherwise.
- two 4x8-GPU jobs on a 32-GPU ClusterQueue: one runs, the other waits Queued with no pod at all,
  and is admitted when the first finishes;
- a high-priority job preempts a running low-priority one as a unit within 30 s; the low one
  counts no application restart, and comes back in a new generation, its checkpoint record kept,
  when the high one is deleted;
- a job asking for one rack gets all its pods on one rack's nodes, even when admitted with fewer
  than nodes.max pods; a job no rack can hold stays Queued, saying why;
- on a cluster that does not serve the Workload API, a queued job says to install Kueue.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
import uuid

import pytest
import yaml
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from crucible.api.progress import ProgressReport
from crucible.operator import crd, rbac
from crucible.operator import queueing as q
from crucible.operator.handlers import _one_pass
from tests.operator import builders as b
from tests.operator.cluster import job_body
from tests.operator.passes import empty_indexes, pass_memo
from tests.support.apply import strict_dry_run
from tests.support.operator_run import assert_clean_exit
from tests.support.repo import REPO
from tests.support.services import eventually

sys.path.insert(0, str(REPO / "e2e"))
from stack.services import KUEUE_PODS_READY_TIMEOUT_S, node_manifest  # noqa: E402

pytestmark = pytest.mark.stack

GPUS = {"limits": {"nvidia.com/gpu": 8}}
RACK = "crucible.dev/test-rack"


class Kueue:
    """Cluster-scoped Kueue objects a test makes, removed at the end whatever happens."""

    def __init__(self, cluster):
        self.cluster, self.objs = cluster, cluster.objs
        self.suffix = uuid.uuid4().hex[:6]
        self.made: list[tuple[str, str, str | None]] = []    # (plural, name, namespace)
        self.nodes: list[str] = []
        self.priority_classes: list[str] = []

    def _create(self, plural: str, body: dict, namespace: str | None = None) -> dict:
        name = body["metadata"]["name"]
        if namespace:
            out = self.objs.create_namespaced_custom_object(q.GROUP, q.VERSION, namespace, plural,
                                                            body)
        else:
            out = self.objs.create_cluster_custom_object(q.GROUP, q.VERSION, plural, body)
        self.made.append((plural, name, namespace))
        return out

    def pool(self, gpus: int, *, node_labels: dict | None = None, topology: list[str] = (),
             local_queue: str = "gpus") -> str:
        """A flavor, a ClusterQueue of `gpus` GPUs that preempts lower priorities within itself,
        and a LocalQueue in the test's namespace; returns the LocalQueue's name."""
        flavor = {"apiVersion": q.API_VERSION, "kind": "ResourceFlavor",
                  "metadata": {"name": f"gpu-{self.suffix}"}, "spec": {}}
        if node_labels:
            flavor["spec"]["nodeLabels"] = node_labels
        if topology:
            self._create("topologies", {
                "apiVersion": q.API_VERSION, "kind": "Topology",
                "metadata": {"name": f"racks-{self.suffix}"},
                "spec": {"levels": [{"nodeLabel": level} for level in topology]}})
            flavor["spec"]["topologyName"] = f"racks-{self.suffix}"
        self._create("resourceflavors", flavor)
        self._create("clusterqueues", {
            "apiVersion": q.API_VERSION, "kind": "ClusterQueue",
            "metadata": {"name": f"gpus-{self.suffix}"},
            "spec": {"namespaceSelector": {},
                     "preemption": {"withinClusterQueue": "LowerPriority"},
                     "resourceGroups": [{"coveredResources": ["nvidia.com/gpu"], "flavors": [
                         {"name": f"gpu-{self.suffix}", "resources": [
                             {"name": "nvidia.com/gpu", "nominalQuota": gpus}]}]}]}})
        self._create("localqueues", {
            "apiVersion": q.API_VERSION, "kind": "LocalQueue",
            "metadata": {"name": local_queue, "namespace": self.cluster.namespace},
            "spec": {"clusterQueue": f"gpus-{self.suffix}"}}, self.cluster.namespace)
        return local_queue

    @property
    def cluster_queue(self) -> str:
        return f"gpus-{self.suffix}"

    def priority_class(self, name: str, value: int) -> str:
        name = f"{name}-{self.suffix}"
        client.SchedulingV1Api(self.cluster.api).create_priority_class(
            {"metadata": {"name": name}, "value": value})
        self.priority_classes.append(name)
        return name

    def node(self, name: str, labels: dict) -> None:
        body = node_manifest(name)
        body["metadata"]["labels"].update(labels)
        self.cluster.core.create_node(body)
        self.nodes.append(name)

    def cleanup(self) -> None:
        for plural, name, namespace in reversed(self.made):
            try:
                if namespace:
                    self.objs.delete_namespaced_custom_object(q.GROUP, q.VERSION, namespace,
                                                              plural, name)
                else:
                    self.objs.delete_cluster_custom_object(q.GROUP, q.VERSION, plural, name)
            except ApiException as err:
                if err.status != 404:
                    raise
        for name in self.nodes:
            self.cluster.core.delete_node(name)
        for name in self.priority_classes:
            client.SchedulingV1Api(self.cluster.api).delete_priority_class(name)


@pytest.fixture
def kueue(cluster):
    k = Kueue(cluster)
    yield k
    k.cleanup()


def submit(cluster, name: str, queue: str, **spec) -> dict:
    body = job_body(name, resources=GPUS, procsPerNode=8, **spec)
    body["metadata"]["labels"] = {q.QUEUE_LABEL: queue}
    return cluster.objs.create_namespaced_custom_object(crd.GROUP, crd.VERSION, cluster.namespace,
                                                        crd.PLURAL, body)


def condition(status: dict, type_: str) -> dict:
    return next((c for c in status.get("conditions") or [] if c["type"] == type_), {})


def live_pods(cluster, job: str) -> list:
    return [p for p in cluster.pods(job) if not p.metadata.deletion_timestamp]


def test_two_jobs_that_each_need_the_whole_queue_run_one_after_the_other(cluster, kueue,
                                                                           run_operator):
    queue = kueue.pool(32)
    with run_operator(cluster.namespace) as runner:
        for name in ("first", "second"):
            submit(cluster, name, queue, nodes={"min": 4, "max": 4})

        def one_runs():
            phases = {n: cluster.status(n).get("phase") for n in ("first", "second")}
            return sorted(phases.values()) == ["Queued", "Running"] and phases
        phases = eventually(one_runs, 60, "one job Running, the other Queued")
        running = next(n for n, phase in phases.items() if phase == "Running")
        waiting = next(n for n, phase in phases.items() if phase == "Queued")
        assert len(cluster.wait_running(running, 4, generation=0)) == 4
        # The waiting job holds nothing: no pod at all, so none Pending for GPUs.
        time.sleep(2)
        assert cluster.pods(waiting) == []
        status = cluster.status(waiting)
        admitted = condition(status, "Admitted")
        assert admitted["status"] == "False"
        assert kueue.cluster_queue in admitted["message"], admitted
        assert "Queued" in cluster.event_reasons(waiting)
        ran = cluster.status(running)
        assert ran["admission"] == {"clusterQueue": kueue.cluster_queue, "localQueue": queue,
                                    "pods": 4}
        assert condition(ran, "Admitted")["status"] == "True"
        cluster.wait_event(running, "Admitted")
        row = cluster.printed_row(waiting, wide=True)
        assert (row["Phase"], row["Admitted"], row["Queue"]) == ("Queued", "False", None)
        row = cluster.printed_row(running, wide=True)
        assert (row["Phase"], row["Admitted"], row["Queue"]) == ("Running", "True",
                                                                 kueue.cluster_queue)

        cluster.succeed_pod(f"{running}-0-0")
        cluster.wait_phase(running, "Succeeded")

        def finished():
            workload = cluster.objs.get_namespaced_custom_object(
                q.GROUP, q.VERSION, cluster.namespace, q.PLURAL, f"pretrainjob-{running}")
            return any(c["type"] == "Finished" and c["status"] == "True"
                       for c in workload["status"]["conditions"])
        eventually(finished, 10, "the finished job's Workload marked Finished")
        assert len(cluster.wait_running(waiting, 4, generation=0, timeout_s=60)) == 4
        assert cluster.wait_phase(waiting, "Running")["restarts"]["total"] == 0
    assert_clean_exit(runner)


def _commit(cluster, job: str, step: int) -> None:
    """What the trainer's rank 0 writes after a checkpoint commits (no trainer runs on KWOK)."""
    report = ProgressReport(step=step, loss=3.0, tokens=step * 1000, world_size=32,
                            checkpoint_step=step, checkpoint_uri=f"s3://crucible/{job}/step_{step}")
    cluster.coordination.patch_namespaced_lease(f"{job}-progress", cluster.namespace, {
        "metadata": {"annotations": report.to_annotations()}})


def test_a_high_priority_job_preempts_a_low_one_as_a_unit_and_the_low_one_comes_back(
        cluster, kueue, run_operator):
    queue = kueue.pool(32)
    low_pc, high_pc = kueue.priority_class("low", 100), kueue.priority_class("high", 1000)
    with run_operator(cluster.namespace) as runner:
        submit(cluster, "low", queue, nodes={"min": 4, "max": 4},
               scheduling={"priorityClassName": low_pc})
        cluster.wait_running("low", 4, generation=0)
        cluster.wait_phase("low", "Running")
        _commit(cluster, "low", 40)
        eventually(lambda: (cluster.status("low").get("lastCheckpoint") or {}).get("step") == 40,
                   30, "the commit reported")

        started = time.monotonic()
        submit(cluster, "high", queue, nodes={"min": 4, "max": 4},
               scheduling={"priorityClassName": high_pc})
        cluster.wait_running("high", 4, generation=0, timeout_s=30)
        took = time.monotonic() - started
        assert took <= 30, took
        assert live_pods(cluster, "low") == []                  # as a unit: every pod went
        low = cluster.wait_phase("low", "Queued", timeout_s=10)
        assert low["restarts"]["application"] == 0
        assert low["restarts"]["byCause"] == {"Preempted": 1}
        assert condition(low, "Admitted")["reason"] == "Preempted"
        cluster.wait_event("low", "Preempted")

        cluster.delete_job("high")
        pods = cluster.wait_running("low", 4, generation=1, timeout_s=60)
        assert sorted(p.metadata.name for p in pods) == [f"low-1-{i}" for i in range(4)]
        back = cluster.wait_phase("low", "Running")
        assert back["podGeneration"] == 1
        assert back["restarts"]["application"] == 0 and back["restarts"]["infrastructure"] == 1
        # The trainer resumes from the newest commit under checkpoint.uri, which the job keeps.
        assert back["lastCheckpoint"]["step"] == 40
    assert_clean_exit(runner)


def test_a_job_asking_for_one_rack_lands_on_one_rack_or_stays_queued_saying_why(
        cluster, kueue, run_operator):
    pool = {"crucible.dev/test-pool": f"tas-{kueue.suffix}"}
    for rack, count in (("rack-a", 2), ("rack-b", 3)):
        for i in range(count):
            kueue.node(f"{rack}-{kueue.suffix}-{i}", {**pool, RACK: rack})
    cluster.kube.wait_nodes_healthy(kueue.nodes)
    queue = kueue.pool(64, node_labels=pool, topology=[RACK, "kubernetes.io/hostname"])
    one_rack = {"topology": {"required": RACK}}
    with run_operator(cluster.namespace) as runner:
        # nodes.max = 4 fits no rack; Kueue admits 3 (partial admission) on the rack that has 3.
        submit(cluster, "racked", queue, nodes={"min": 2, "max": 4}, scheduling=one_rack)
        pods = cluster.wait_running("racked", 3, generation=0, timeout_s=60)
        racks = {cluster.core.read_node(p.spec.node_name).metadata.labels[RACK] for p in pods}
        assert racks == {"rack-b"}, racks
        status = cluster.wait_phase("racked", "Running")
        assert status["admission"]["pods"] == 3

        # Five pods at least: no rack holds them, so it waits, and says so.
        submit(cluster, "too-big", queue, nodes={"min": 5, "max": 5}, scheduling=one_rack)
        waiting = cluster.wait_phase("too-big", "Queued", timeout_s=30)
        admitted = eventually(lambda: (a := condition(cluster.status("too-big"), "Admitted"))
                              .get("reason") not in (None, "Created") and a, 30,
                              "Kueue's reason on the job")
        assert admitted["status"] == "False" and admitted["message"], waiting
        time.sleep(2)
        assert cluster.pods("too-big") == []
    assert_clean_exit(runner)


def _workload(cluster, job: str) -> dict:
    return cluster.objs.get_namespaced_custom_object(q.GROUP, q.VERSION, cluster.namespace,
                                                     q.PLURAL, f"pretrainjob-{job}")


def test_under_wait_for_pods_ready_a_running_job_is_never_evicted(cluster, kueue, run_operator):
    """The stack's Kueue runs waitForPodsReady (timeout KUEUE_PODS_READY_TIMEOUT_S): the
    operator says PodsReady=True once the admitted pods are Ready, so a job outlives the
    timeout twice over without an eviction (nobody writing it: evicted after one).
    CRUCIBLE_KUEUE_SOAK_S runs it longer (a soak: 600 for ten minutes)."""
    timeout_s = KUEUE_PODS_READY_TIMEOUT_S
    soak_s = float(os.environ.get("CRUCIBLE_KUEUE_SOAK_S", 2 * timeout_s + 10))
    queue = kueue.pool(32)
    with run_operator(cluster.namespace) as runner:
        submit(cluster, "steady", queue, nodes={"min": 2, "max": 2})
        cluster.wait_running("steady", 2, generation=0)
        uid = _workload(cluster, "steady")["metadata"]["uid"]
        ready = eventually(lambda: (c := condition(_workload(cluster, "steady")["status"],
                                                   "PodsReady")).get("status") == "True" and c,
                           30, "PodsReady=True on the Workload")
        assert ready["reason"] == "Started"
        time.sleep(soak_s)
        wl = _workload(cluster, "steady")
        assert wl["metadata"]["uid"] == uid
        assert condition(wl["status"], "Evicted").get("status") != "True", wl["status"]
        status = cluster.status("steady")
        assert status["phase"] == "Running" and status["podGeneration"] == 0
        assert status["restarts"]["total"] == 0
    assert_clean_exit(runner)


def test_in_a_tas_only_queue_every_pod_is_gated_and_placed_by_kueue(cluster, kueue,
                                                                    run_operator):
    """Every flavor of the ClusterQueue names a Topology: Kueue assigns the pod set a topology
    though the job asks for none (implicit TAS), and its ungater places each pod, giving it
    its node's hostname selector; the operator must create them gated for that."""
    pool = {"crucible.dev/test-pool": f"implicit-{kueue.suffix}"}
    for i in range(3):
        kueue.node(f"tas-{kueue.suffix}-{i}", {**pool, RACK: "rack-a"})
    cluster.kube.wait_nodes_healthy(kueue.nodes)
    queue = kueue.pool(24, node_labels=pool, topology=[RACK, "kubernetes.io/hostname"])
    with run_operator(cluster.namespace) as runner:
        submit(cluster, "implied", queue, nodes={"min": 3, "max": 3})
        pods = cluster.wait_running("implied", 3, generation=0, timeout_s=60)
        for pod in pods:
            assert pod.metadata.annotations.get(q.UNCONSTRAINED_ANNOTATION) == "true"
            assert not pod.spec.scheduling_gates, "the ungater lifted the gate"
            # The ungater's node selector: the domain Kueue assigned, here down to the host.
            assert (pod.spec.node_selector or {}).get("kubernetes.io/hostname") == \
                pod.spec.node_name, pod.spec.node_selector
        assert _workload(cluster, "implied")["status"]["admission"]["podSetAssignments"][0][
            "topologyAssignment"]
    assert_clean_exit(runner)


def test_a_new_global_default_priority_class_restarts_no_admitted_job(cluster, kueue,
                                                                     run_operator):
    queue = kueue.pool(32)
    with run_operator(cluster.namespace) as runner:
        submit(cluster, "settled", queue, nodes={"min": 2, "max": 2})
        cluster.wait_running("settled", 2, generation=0)
        uid = _workload(cluster, "settled")["metadata"]["uid"]
        name = f"new-default-{kueue.suffix}"
        client.SchedulingV1Api(cluster.api).create_priority_class(
            {"metadata": {"name": name}, "value": 777, "globalDefault": True})
        kueue.priority_classes.append(name)
        time.sleep(8)                      # several passes see the new class (resync 2 s)
        assert _workload(cluster, "settled")["metadata"]["uid"] == uid
        status = cluster.status("settled")
        assert status["podGeneration"] == 0 and status["phase"] == "Running"
        assert len(live_pods(cluster, "settled")) == 2
    assert_clean_exit(runner)


def test_with_every_job_managed_an_unlabelled_job_queues_in_the_default_local_queue(
        cluster, kueue, run_operator, monkeypatch):
    """The administrator's --manage-jobs-without-queue-name (as Kueue's setting): a job with
    no queue label is admitted through the namespace's LocalQueue "default", within quota, and
    never runs outside it."""
    monkeypatch.setenv("CRUCIBLE_OPERATOR_KUEUE_MANAGE_ALL", "on")
    with run_operator(cluster.namespace) as runner:
        cluster.create_job("unqueued", nodes={"min": 1, "max": 1}, resources=GPUS)
        held = cluster.wait_phase("unqueued", "Queued", timeout_s=30)
        assert condition(held, "Admitted")["reason"] == "NoQueue"
        time.sleep(2)
        assert cluster.pods("unqueued") == []
        kueue.pool(8, local_queue=q.DEFAULT_QUEUE)
        cluster.wait_running("unqueued", 1, generation=0, timeout_s=60)
        assert _workload(cluster, "unqueued")["spec"]["queueName"] == q.DEFAULT_QUEUE
        assert cluster.wait_phase("unqueued", "Running")["admission"]["localQueue"] == \
            q.DEFAULT_QUEUE
    assert_clean_exit(runner)


def test_the_example_queues_are_what_kueue_accepts(cluster):
    """manifests/kueue/: a server-side dry run through the CRDs' schemas and Kueue's webhooks."""
    docs = list(yaml.safe_load_all((REPO / "manifests" / "kueue" / "gpu-queues.yaml").read_text()))
    assert {d["kind"] for d in docs} == {"Topology", "ResourceFlavor", "ClusterQueue",
                                         "LocalQueue", "PriorityClass"}
    for doc in docs:
        if "namespace" in doc["metadata"]:
            doc["metadata"]["namespace"] = cluster.namespace
    assert strict_dry_run(cluster.api, docs) == []


def test_on_a_cluster_that_does_not_serve_workloads_a_queued_job_says_install_kueue(
        kube, operator_kubeconfig, monkeypatch):
    """Two passes of the operator's own code against the real apiserver, with its credentials,
    for a queued job whose Workload API version no CRD serves (as on a cluster without Kueue):
    the first pass's create meets a 404, and the second says so in the job's status, rather
    than "Workload created" beside a rejection event every pass."""
    monkeypatch.setattr(q, "VERSION", "v1nope")              # what no CRD serves
    name = f"no-kueue-{uuid.uuid4().hex[:6]}"
    jobs = client.CustomObjectsApi(kube.client())
    body = jobs.create_namespaced_custom_object(
        crd.GROUP, crd.VERSION, rbac.NAMESPACE, crd.PLURAL, {
            "apiVersion": f"{crd.GROUP}/{crd.VERSION}", "kind": crd.KIND,
            "metadata": {"name": name, "labels": {q.QUEUE_LABEL: "team-a-gpus"}},
            "spec": b.spec_doc()})
    memo = pass_memo(config.new_client_from_config(str(operator_kubeconfig)))
    indexes = empty_indexes(priority_classes={"default": {(100, True)}}, workloads_by_job={},
                            local_queues={}, resource_flavors={}, workload_priority_classes={})
    try:
        for _ in range(2):
            asyncio.run(_one_pass((rbac.NAMESPACE, name), body, memo, indexes,
                                  logging.getLogger("test-no-kueue"), fenced=False))
            body = jobs.get_namespaced_custom_object(crd.GROUP, crd.VERSION, rbac.NAMESPACE,
                                                     crd.PLURAL, name)
        assert memo.unserved[body["metadata"]["uid"]] == {"Workload"}
        admitted = next(c for c in body["status"]["conditions"] if c["type"] == "Admitted")
        assert body["status"]["phase"] == "Queued"
        assert admitted["reason"] == "KueueNotInstalled", admitted
        assert "install Kueue" in admitted["message"] and q.GROUP in admitted["message"]
    finally:
        memo.executor.shutdown()
        memo.kube.events.shutdown(wait=False)
        jobs.delete_namespaced_custom_object(crd.GROUP, crd.VERSION, rbac.NAMESPACE, crd.PLURAL,
                                             name)


def test_an_admitted_jobs_queue_label_cannot_be_taken_away_while_it_runs(cluster):
    """The chart's queue-label policy, by the real apiserver: removing or changing the label of
    a job Kueue admitted is refused unless the job is suspended (Kueue's own rule for its Jobs);
    a job not admitted may change it."""
    from tests.support.chart import by_kind, render

    docs = render(release=f"ql-{cluster.namespace}"[:40])
    [policy], [binding] = ([d for d in by_kind(docs, kind) if d["metadata"]["name"].endswith(
        "-queue-label")] for kind in ("ValidatingAdmissionPolicy",
                                      "ValidatingAdmissionPolicyBinding"))
    binding["spec"]["matchResources"] = {"namespaceSelector": {"matchLabels": {
        "kubernetes.io/metadata.name": cluster.namespace}}}
    admission = client.AdmissionregistrationV1Api(cluster.api)
    admission.create_validating_admission_policy(policy)
    admission.create_validating_admission_policy_binding(binding)
    objs, ns = cluster.objs, cluster.namespace

    def relabel(name: str, labels: dict, suspend: bool | None = None) -> str | None:
        """Why the apiserver refuses the change (a dry run: nothing changes); None: allowed."""
        patch = {"metadata": {"labels": labels}}
        if suspend is not None:
            patch["spec"] = {"suspend": suspend}
        try:
            objs.patch_namespaced_custom_object(crd.GROUP, crd.VERSION, ns, crd.PLURAL, name,
                                                patch, dry_run="All")
        except ApiException as err:
            return err.body if err.status in (403, 422) else f"unexpected {err.status}"
        return None

    try:
        body = job_body("admitted")
        body["metadata"]["labels"] = {q.QUEUE_LABEL: "team-a"}
        objs.create_namespaced_custom_object(crd.GROUP, crd.VERSION, ns, crd.PLURAL, body)
        objs.patch_namespaced_custom_object_status(
            crd.GROUP, crd.VERSION, ns, crd.PLURAL, "admitted",
            {"status": {"phase": "Running", "admission": {"clusterQueue": "gpus"}}})
        # The policy takes effect once the apiserver has loaded it.
        refusal = eventually(lambda: relabel("admitted", {q.QUEUE_LABEL: None}), 30,
                             "the queue-label policy")
        assert "cannot change" in refusal and "team-a" in refusal, refusal
        assert "cannot change" in relabel("admitted", {q.QUEUE_LABEL: "team-b"})
        assert relabel("admitted", {"owner": "me"}) is None        # other labels are free
        # Suspended (in the same update, as Kueue allows): the label may go.
        assert relabel("admitted", {q.QUEUE_LABEL: None}, suspend=True) is None
        # Queued but not admitted: no quota held, the label may change.
        waiting = job_body("waiting")
        waiting["metadata"]["labels"] = {q.QUEUE_LABEL: "team-a"}
        objs.create_namespaced_custom_object(crd.GROUP, crd.VERSION, ns, crd.PLURAL, waiting)
        assert relabel("waiting", {q.QUEUE_LABEL: "team-b"}) is None
    finally:
        admission.delete_validating_admission_policy_binding(binding["metadata"]["name"])
        admission.delete_validating_admission_policy(policy["metadata"]["name"])
