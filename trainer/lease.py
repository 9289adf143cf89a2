"""Rank 0's progress report to the operator: patches the job's `<job>-progress` Lease.

The report's fields, annotation keys and time format are `crucible.api.progress.ProgressReport`;
this module only carries it: the operator creates the Lease (owned by the PretrainJob, so it is
garbage-collected with it) and the trainer only patches it, which keeps the trainer's RBAC to
get/patch on one named Lease. Every `interval_s` seconds a background thread writes the newest
report as annotations and sets `spec.renewTime`/`holderIdentity` (the pod). The thread keeps
renewing while the loop is stuck, so hang detection must look at `step-time`, not `renewTime`.

Outside Kubernetes (no POD_NAMESPACE, or CRUCIBLE_PROGRESS_LEASE=off) there is no Lease and
`progress_lease` returns None. A failed patch is logged and retried at the next interval; it
never stops training.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import os
import threading

from crucible.api import launch
from crucible.api.names import progress_lease_name
from crucible.api.progress import CommitRef, ProgressReport, RestoreRef, Straggler

log = logging.getLogger(__name__)
REQUEST_TIMEOUT_S = (5.0, 10.0)    # (connect, read) of one patch


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def _api():
    from kubernetes import client, config

    if os.environ.get("KUBECONFIG"):
        return client.CoordinationV1Api(config.new_client_from_config(os.environ["KUBECONFIG"]))
    config.load_incluster_config()
    return client.CoordinationV1Api()


class ProgressLease:
    def __init__(self, namespace: str, job: str, holder: str, interval_s: float = 5.0):
        self.namespace, self.name, self.holder = namespace, progress_lease_name(job), holder
        self.interval_s = interval_s
        self._report = ProgressReport()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._api = _api()
        self._thread = threading.Thread(target=self._run, name="progress-lease", daemon=True)
        self._thread.start()

    def update(self, *, step: int, tokens: int, loss: float | None = None,
               checkpoint: CommitRef | None = None, world_size: int | None = None,
               restore: RestoreRef | None = None,
               stragglers: tuple[Straggler, ...] | None = None) -> None:
        """Record the newest progress; cheap, called every step from the training loop."""
        with self._lock:
            report = self._report
            changes: dict = {"step": step, "tokens": tokens}
            if step != report.step:
                changes["step_time"] = _now()
            # Fields not given keep their last value (a checkpoint commit reports no loss).
            if world_size is not None:
                changes["world_size"] = world_size
            if loss is not None:
                changes["loss"] = loss
            if checkpoint is not None:
                changes.update(checkpoint_step=checkpoint.step, checkpoint_uri=checkpoint.uri,
                               checkpoint_time=checkpoint.time)
            if restore is not None:
                changes.update(restore_source=restore.source, restore_step=restore.step,
                               restore_seconds=restore.seconds, restore_time=restore.time)
            if stragglers is not None:
                changes["stragglers"] = stragglers
            self._report = dataclasses.replace(report, **changes)

    def flush(self) -> None:
        import urllib3
        from kubernetes.client.exceptions import ApiException

        with self._lock:
            annotations = self._report.to_annotations()
        if not annotations:
            return
        body = {"metadata": {"annotations": annotations},
                # A MicroTime: the API wants exactly six fractional digits.
                "spec": {"holderIdentity": self.holder,
                         "renewTime": _now().strftime("%Y-%m-%dT%H:%M:%S.%fZ")}}
        try:
            # A deadline: without one urllib3 waits on a half-open connection for as long as
            # the socket does, and the reports stop.
            self._api.patch_namespaced_lease(self.name, self.namespace, body,
                                             _request_timeout=REQUEST_TIMEOUT_S)
        # urllib3's own errors (a refused connection is its MaxRetryError, a read timeout its
        # ReadTimeoutError) are not OSErrors: without them one apiserver blip ended the thread,
        # and the operator then saw no progress and restarted the group as hung.
        except (ApiException, OSError, urllib3.exceptions.HTTPError) as err:
            log.warning("progress Lease %s/%s not updated: %s", self.namespace, self.name,
                        getattr(err, "reason", err))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.flush()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.interval_s + 5)
        self.flush()


def progress_lease(job: str, interval_s: float = 5.0) -> ProgressLease | None:
    namespace = os.environ.get(launch.ENV_POD_NAMESPACE)
    if not namespace or os.environ.get("CRUCIBLE_PROGRESS_LEASE", "on") == "off":
        return None
    holder = os.environ.get(launch.ENV_POD_NAME) or os.environ.get("HOSTNAME", "unknown")
    return ProgressLease(namespace, job, holder, interval_s)
