"""The child kinds watched by metadata alone, on the real apiserver.

Attack: a tenant fills its namespace with objects carrying the job label: 600 ConfigMaps of
900 KiB (an operator that lists them whole reached 2.2 GiB, past its 512 MiB limit, and every
tenant's jobs stopped with it), or the same bulk moved into metadata (annotations, one
managedFields entry per data key).
Expected: the operator's peak RSS stays under its limit and jobs in both namespaces it serves
run within 30 s; the index follows adds, edits, label removal and deletes, lists again after a
gap and in smaller pages past the page cap; a ConfigMap whose data someone else edits is put
back, once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import threading
import time

import pytest
from kubernetes import client

from crucible.operator import manifests as m
from crucible.operator import metadata_watch
from crucible.operator.handlers import child_view
from tests.operator.cluster import Cluster, operator_process
from tests.support.services import eventually

pytestmark = pytest.mark.stack

OPERATOR_LIMIT_MIB = 512       # the chart's operator memory limit (values.yaml)


def _config_map(name: str, job: str | None, data: dict | None = None,
                **annotations) -> client.V1ConfigMap:
    return client.V1ConfigMap(
        metadata=client.V1ObjectMeta(name=name, labels={m.LABEL_JOB: job} if job else None,
                                     annotations=annotations or None), data=data or {"a": ""})


class _Loop:
    """An event loop in a thread, as the operator's: the watch posts onto it."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def read(self, fn):
        async def call():
            return fn()
        return asyncio.run_coroutine_threadsafe(call(), self.loop).result(10)

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def _views(kind, meta):
    job = (meta.get("labels") or {}).get(m.LABEL_JOB)
    return ((meta["namespace"], job), (meta["name"], (meta.get("annotations") or {}).get("d"))) \
        if job else None


@contextlib.contextmanager
def _watching(cluster):
    """(loop, index, listed, the watch) of the namespace's labelled ConfigMaps, listed once."""
    loop = _Loop()
    index = metadata_watch.MetadataIndex("ConfigMap")
    listed = threading.Event()
    watches = [_watch(cluster, index, loop, listed.set)]
    try:
        assert listed.wait(30)
        yield loop, index, listed, watches
    finally:
        for watch in watches:
            _stopped(watch)
        loop.close()


def _watch(cluster, index, loop, listed=None, scopes=None):
    scopes = scopes or metadata_watch.Scopes((cluster.namespace,))
    [scope] = scopes.watched
    watch = metadata_watch.MetadataWatch(cluster.api, "", "v1", "configmaps", scope,
                                         m.LABEL_JOB, index, _views, loop.loop, scopes.serves,
                                         listed or (lambda: None))
    watch.start()
    return watch


def _stopped(watch) -> None:
    watch.stop()
    watch.join(10)
    assert not watch.is_alive()


def test_the_index_follows_adds_edits_label_removal_and_deletes(cluster):
    core, ns = cluster.core, cluster.namespace
    core.create_namespaced_config_map(ns, _config_map("before", "a", {"a": "x" * 1000}, d="1"))
    core.create_namespaced_config_map(ns, _config_map("unlabelled", None))
    with _watching(cluster) as (loop, index, listed, watches):
        watch = watches[0]
        assert loop.read(lambda: index.get((ns, "a"), ())) == (("before", "1"),)
        assert loop.read(lambda: index.covers(ns) and not index.covers("elsewhere"))
        # What the apiserver sends is the labelled objects' metadata alone, listed or watched.
        page = json.loads(watch._request(metadata_watch.ACCEPT_LIST).read())
        assert page["kind"] == "PartialObjectMetadataList"
        assert [(set(i), i["metadata"]["name"]) for i in page["items"]] == [
            ({"kind", "apiVersion", "metadata"}, "before")]
        stream = watch._request(metadata_watch.ACCEPT_WATCH, watch="true", timeoutSeconds=5,
                                resourceVersion=page["metadata"]["resourceVersion"])
        core.create_namespaced_config_map(ns, _config_map("b1", "b", {"a": "y" * 1000}, d="x"))
        event = json.loads(next(iter(stream.stream(amt=None))).splitlines()[0])
        stream.close()
        assert event["type"] == "ADDED" and event["object"]["kind"] == "PartialObjectMetadata"
        assert "data" not in event["object"]

        eventually(lambda: loop.read(lambda: index.get((ns, "b"), ())) == (("b1", "x"),),
                   10, "an added ConfigMap indexed")
        core.patch_namespaced_config_map("b1", ns, {"metadata": {"annotations": {"d": "y"}}})
        eventually(lambda: loop.read(lambda: index.get((ns, "b"), ())) == (("b1", "y"),),
                   10, "an edit seen")
        core.patch_namespaced_config_map("before", ns,
                                         {"metadata": {"labels": {m.LABEL_JOB: None}}})
        eventually(lambda: loop.read(lambda: (ns, "a") not in index), 10,
                   "a ConfigMap whose label went is dropped")
        core.delete_namespaced_config_map("b1", ns)
        eventually(lambda: loop.read(lambda: len(index)) == 0, 10, "a deleted one dropped")
        started = time.monotonic()
        _stopped(watches.pop())          # a watch blocked on a quiet stream stops at once
        assert time.monotonic() - started < 5

        # A gap: what went while no watch ran is gone after the next list; what came is there.
        core.create_namespaced_config_map(ns, _config_map("c1", "c"))
        core.create_namespaced_config_map(ns, _config_map("c2", "c"))
        listed.clear()
        watches.append(_watch(cluster, index, loop, listed.set))
        assert listed.wait(30)
        assert {v[0] for v in loop.read(lambda: index.get((ns, "c"), ()))} == {"c1", "c2"}
        _stopped(watches.pop())
        core.delete_namespaced_config_map("c1", ns)
        listed.clear()
        watches.append(_watch(cluster, index, loop, listed.set))
        assert listed.wait(30)
        assert {v[0] for v in loop.read(lambda: index.get((ns, "c"), ()))} == {"c2"}
        # A version the server no longer has: list again at once (not an error's backoff).
        probe = metadata_watch.MetadataWatch(cluster.api, "", "v1", "configmaps", ns,
                                             m.LABEL_JOB, index, _views, loop.loop)
        assert probe._watch("1") == (None, True)


def test_a_page_over_the_cap_is_asked_again_in_fewer_objects(cluster, monkeypatch):
    """Metadata can be large (256 KiB of annotations each): a page is read only up to the cap,
    and the same page asked again smaller, so the whole list still arrives."""
    core, ns = cluster.core, cluster.namespace
    for i in range(12):
        core.create_namespaced_config_map(ns, _config_map(f"big-{i}", f"j{i}", d="z" * 4096))
    monkeypatch.setattr(metadata_watch, "MAX_PAGE_BYTES", 16 * 1024)
    asked = []
    page = metadata_watch.MetadataWatch._page
    monkeypatch.setattr(metadata_watch.MetadataWatch, "_page",
                        lambda self, query: asked.append(query["limit"]) or page(self, query))
    with _watching(cluster) as (loop, index, _, _):
        assert loop.read(lambda: len(index)) == 12
        assert asked[0] == metadata_watch.PAGE and min(asked) < 4


def test_namespace_patterns_are_kopfs():
    plain = metadata_watch.Scopes(("a", "b", "a"))
    assert plain.watched == ["a", "b"] and plain.serves("a") and not plain.serves("c")
    assert metadata_watch.Scopes(()).watched == [None]
    mixed = metadata_watch.Scopes(("team-*", "ml"))
    assert mixed.watched == [None]
    assert [ns for ns in ("team-x", "ml", "other") if mixed.serves(ns)] == ["team-x", "ml"]
    excluding = metadata_watch.Scopes(("!kube-*, !*-pr-*",))
    assert excluding.watched == [None]
    assert [ns for ns in ("kube-system", "app-pr-1", "app") if excluding.serves(ns)] == ["app"]
    assert metadata_watch.path("", "v1", "configmaps", "n") == "/api/v1/namespaces/n/configmaps"
    assert (metadata_watch.path("rbac.authorization.k8s.io", "v1", "roles", None)
            == "/apis/rbac.authorization.k8s.io/v1/roles")


def test_the_view_keeps_nothing_a_tenant_can_grow():
    """The index keeps names and digests: a digest annotation that is not one is not kept, and
    a ConfigMap's data owned by another field manager reads as edited."""
    meta = {"namespace": "n", "name": "gpt-config", "labels": {m.LABEL_JOB: "gpt"},
            "annotations": {m.ANNOTATION_DATA_DIGEST: "x" * 200_000},
            "managedFields": [{"manager": m.FIELD_MANAGER, "fieldsV1": {"f:data": {"f:a": {}}}},
                              {"manager": "OpenAPI-Generator", "fieldsV1": {"f:data": {}}}]}
    key, view = child_view("ConfigMap", meta)
    assert key == ("n", "gpt") and view.digest is None
    meta["annotations"][m.ANNOTATION_DATA_DIGEST] = "0123456789abcdef"
    assert child_view("ConfigMap", meta)[1].digest == "0123456789abcdef"
    meta["managedFields"].append({"manager": "kubectl-edit", "fieldsV1": {"f:data": {"f:a": {}}}})
    assert child_view("ConfigMap", meta)[1].digest == m.EDITED
    # A NetworkPolicy's digest comes from its own annotation, whoever edits it.
    meta["annotations"] = {m.ANNOTATION_POLICY_DIGEST: "0123456789abcdef"}
    assert child_view("NetworkPolicy", meta)[1].digest == "0123456789abcdef"
    assert child_view("ConfigMap", {"name": "x", "labels": {}}) is None


def test_a_configmap_someone_else_edits_is_put_back_once(cluster, run_operator):
    with run_operator(cluster.namespace):
        cluster.create_job("gpt", nodes={"min": 1, "max": 1})
        cluster.wait_running("gpt", 1, generation=0)
        core, ns = cluster.core, cluster.namespace
        rendered = core.read_namespaced_config_map("gpt-config", ns)
        core.patch_namespaced_config_map("gpt-config", ns, {"data": {
            m.CONFIG_FILE: "# edited by hand\n", "extra": "x"}}, field_manager="kubectl-edit")
        restored = eventually(
            lambda: (cm := core.read_namespaced_config_map("gpt-config", ns)).data
            == rendered.data and cm, 30, "the ConfigMap's data put back")
        time.sleep(6)                    # passes every 2 s: none may write it again
        assert core.read_namespaced_config_map(
            "gpt-config", ns).metadata.resource_version == restored.metadata.resource_version


def _peak_rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        line = next(x for x in status if x.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def test_a_tenants_labelled_configmap_flood_leaves_the_operator_small_and_jobs_served(
        cluster, kube, operator_kubeconfig, tmp_path):
    core = cluster.core
    flood = kube.create_namespace("configmap-flood")
    tenant = Cluster(kube, flood)
    blob = "x" * (900 * 1024)
    keys = {f"k{i}": "" for i in range(20_000)}     # managedFields: an entry per key

    def plant(i: int) -> None:
        bulky_metadata = i >= 600
        core.create_namespaced_config_map(flood, _config_map(
            f"bomb-{i}", f"job-{i}", keys if bulky_metadata else {"a": blob},
            **({"note": "n" * 200_000} if bulky_metadata else {})))

    proc = None
    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(plant, range(600)))
        log = tmp_path / "operator.log"
        proc = operator_process(operator_kubeconfig, cluster.namespace, log, "--namespace", flood)
        started = time.monotonic()
        cluster.create_job("gpt", nodes={"min": 2, "max": 2})
        tenant.create_job("own", nodes={"min": 1, "max": 1})   # its namespace was listed
        cluster.wait_running("gpt", 2, generation=0, timeout_s=30)
        tenant.wait_running("own", 1, generation=0, timeout_s=30)
        assert time.monotonic() - started < 30
        # More while it runs, the bulk in metadata now: the watch's events, not the list.
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(plant, range(600, 700)))
        cluster.wait_phase("gpt", "Running")
        peak = _peak_rss_mib(proc.pid)
        assert proc.poll() is None, log.read_text()[-3000:]
        assert peak < OPERATOR_LIMIT_MIB, f"peak RSS {peak:.0f} MiB"
        print(f"operator peak RSS with 600 x 900 KiB + 100 metadata-heavy labelled "
              f"ConfigMaps: {peak:.0f} MiB")
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
        tenant.strip_finalizers()
        kube.delete_namespace(flood)
