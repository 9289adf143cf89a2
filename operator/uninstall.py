"""Leaving a cluster cleanly: stop the operator, then take its finalizer off every PretrainJob.

kopf puts a finalizer (`crucible.dev/operator`) on each PretrainJob so that a job's loop ends
before the job goes. Uninstall the operator first and that finalizer stays: deleting a job
later waits forever for someone to remove it (and so does deleting its namespace). Removing it
while the operator still runs is no better: kopf puts it back at the job's next event. So, in
that order (the chart's pre-delete hook, `crucible-operator release-finalizers`):
1. scale the operator's Deployment to 0 and wait until no replica is left;
2. remove the finalizer from every PretrainJob (in the given namespaces): a JSON patch that
   first tests the list entry is still ours, so a concurrent edit of the list fails the patch
   (retried) instead of removing someone else's finalizer.
The jobs and their pods stay, unmanaged. Thin adapter over the `kubernetes` client; its rights
are the uninstall hook's (the chart's `uninstallHook`), not the running operator's.
"""

from __future__ import annotations

import time

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from crucible.operator import crd

FINALIZER = "crucible.dev/operator"      # kopf's, as handlers.configure sets it


def stop_deployment(api: client.ApiClient, namespace: str, name: str,
                    timeout_s: float = 120.0, poll_s: float = 1.0) -> bool:
    """Scale the Deployment to 0 and wait until no pod of it is left, Terminating ones included
    (the Deployment's status stops counting a pod once it is Terminating, while its process may
    still act); False if it does not exist (nothing to stop). TimeoutError past `timeout_s`."""
    apps, core = client.AppsV1Api(api), client.CoreV1Api(api)
    try:
        apps.patch_namespaced_deployment_scale(name, namespace, {"spec": {"replicas": 0}})
    except ApiException as err:
        if err.status == 404:
            return False
        raise
    selector = apps.read_namespaced_deployment(name, namespace).spec.selector.match_labels or {}
    labels = ",".join(f"{k}={v}" for k, v in sorted(selector.items()))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = apps.read_namespaced_deployment(name, namespace).status
        if not (status.replicas or 0) and not core.list_namespaced_pod(
                namespace, label_selector=labels).items:
            return True
        time.sleep(poll_s)
    raise TimeoutError(f"deployment {namespace}/{name} still has replicas after {timeout_s:.0f}s")


def release_finalizers(api: client.ApiClient, namespaces: list[str] | None = None,
                       attempts: int = 5) -> list[str]:
    """Remove the operator's finalizer from every PretrainJob (all namespaces when None); the
    `namespace/name` of each job it was removed from."""
    custom = client.CustomObjectsApi(api)
    if namespaces:
        items = [item for ns in namespaces for item in custom.list_namespaced_custom_object(
            crd.GROUP, crd.VERSION, ns, crd.PLURAL)["items"]]
    else:
        items = custom.list_cluster_custom_object(crd.GROUP, crd.VERSION, crd.PLURAL)["items"]
    released = []
    for item in items:
        meta = item["metadata"]
        for _ in range(attempts):
            finalizers = meta.get("finalizers") or []
            if FINALIZER not in finalizers:
                break
            at = finalizers.index(FINALIZER)
            try:
                custom.patch_namespaced_custom_object(
                    crd.GROUP, crd.VERSION, meta["namespace"], crd.PLURAL, meta["name"],
                    [{"op": "test", "path": f"/metadata/finalizers/{at}", "value": FINALIZER},
                     {"op": "remove", "path": f"/metadata/finalizers/{at}"}],
                    _content_type="application/json-patch+json")   # a list: a JSON patch
                released.append(f"{meta['namespace']}/{meta['name']}")
                break
            except ApiException as err:
                if err.status == 404:
                    break
                if err.status not in (409, 422):    # 422: the test op failed: read again
                    raise
                meta = custom.get_namespaced_custom_object(
                    crd.GROUP, crd.VERSION, meta["namespace"], crd.PLURAL,
                    meta["name"])["metadata"]
    return released
