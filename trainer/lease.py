"""Rank 0's progress report to the operator: a `coordination.k8s.io/v1` Lease `<job>-progress`.

Contract with the operator (DESIGN.md, "Progress"): the operator creates the Lease (owned by the
PretrainJob, so it is garbage-collected with it) and the trainer only patches it, which keeps
the trainer's RBAC to get/patch on one named Lease. Every `interval_s` seconds a background thread
writes the newest values as annotations:

  crucible.dev/step             optimizer steps completed
  crucible.dev/step-time        RFC 3339 time the step counter last advanced (hang detection)
  crucible.dev/tokens           tokens trained on
  crucible.dev/loss             training loss of the last step
  crucible.dev/checkpoint-step  newest committed checkpoint: step, URI and commit time
  crucible.dev/checkpoint-uri
  crucible.dev/checkpoint-time
  crucible.dev/world-size       ranks in the current rendezvous

and sets `spec.renewTime`/`holderIdentity` (the pod). The thread keeps renewing while the loop is
stuck, so hang detection must look at `step-time`, not at `renewTime`.

Outside Kubernetes (no POD_NAMESPACE, or CRUCIBLE_PROGRESS_LEASE=off) there is no Lease and
`progress_lease` returns None. A failed patch is logged and retried at the next interval; it
never stops training.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import threading

log = logging.getLogger(__name__)

PREFIX = "crucible.dev/"


def lease_name(job: str) -> str:
    return f"{job}-progress"


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def annotations(values: dict) -> dict[str, str]:
    """The Lease annotations for a progress snapshot (pure; the operator parses the same keys)."""
    return {PREFIX + key.replace("_", "-"): str(value) for key, value in values.items()
            if value is not None}


def _api():
    from kubernetes import client, config

    if os.environ.get("KUBECONFIG"):
        return client.CoordinationV1Api(config.new_client_from_config(os.environ["KUBECONFIG"]))
    config.load_incluster_config()
    return client.CoordinationV1Api()


class ProgressLease:
    def __init__(self, namespace: str, job: str, holder: str, interval_s: float = 5.0):
        self.namespace, self.name, self.holder = namespace, lease_name(job), holder
        self.interval_s = interval_s
        self._values: dict = {}
        self._last_step: int | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._api = _api()
        self._thread = threading.Thread(target=self._run, name="progress-lease", daemon=True)
        self._thread.start()

    def update(self, *, step: int, tokens: int, loss: float | None = None,
               checkpoint: dict | None = None, world_size: int | None = None) -> None:
        """Record the newest progress; cheap, called every step from the training loop."""
        with self._lock:
            if step != self._last_step:
                self._values["step_time"] = _now().isoformat()
                self._last_step = step
            self._values.update(step=step, tokens=tokens)
            # Fields not given keep their last value (a checkpoint commit reports no loss).
            if world_size is not None:
                self._values["world_size"] = world_size
            if loss is not None:
                self._values["loss"] = f"{loss:.6g}"
            if checkpoint:
                self._values.update(checkpoint_step=checkpoint.get("step"),
                                    checkpoint_uri=checkpoint.get("uri"),
                                    checkpoint_time=checkpoint.get("time"))

    def flush(self) -> None:
        from kubernetes.client.exceptions import ApiException

        with self._lock:
            values = dict(self._values)
        if not values:
            return
        body = {"metadata": {"annotations": annotations(values)},
                "spec": {"holderIdentity": self.holder, "renewTime": _now().isoformat()}}
        try:
            self._api.patch_namespaced_lease(self.name, self.namespace, body)
        except (ApiException, OSError) as err:
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
    namespace = os.environ.get("POD_NAMESPACE")
    if not namespace or os.environ.get("CRUCIBLE_PROGRESS_LEASE", "on") == "off":
        return None
    holder = os.environ.get("POD_NAME") or os.environ.get("HOSTNAME", "unknown")
    return ProgressLease(namespace, job, holder, interval_s)
