"""The operator's own Prometheus metrics (kopf exports none: research/operator.md section 5).

Owns the metric names and labels; `handlers.py` and `kube.py` record into them. Names follow
Kubeflow's `training_operator_jobs_restarted_total` style with our prefix, and carry units
(`_seconds`). Jobs by phase are read from the operator's last view at scrape time, so a deleted
job stops counting without bookkeeping.
"""

from __future__ import annotations

from typing import Callable, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily

from crucible.operator.crd import PHASES

REGISTRY = CollectorRegistry(auto_describe=True)

RECONCILES = Counter("crucible_operator_reconciles_total", "Reconcile passes, by result "
                     "(ok, error: an API call failed and the pass will be retried).",
                     ["result"], registry=REGISTRY)
_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30)
# As controller-runtime splits them: the pass itself (its controller_runtime_reconcile_time_
# seconds) and the wait for a free worker (its workqueue_queue_duration_seconds).
RECONCILE_SECONDS = Histogram(
    "crucible_operator_reconcile_seconds", "Duration of one pass once a worker runs it: decide, "
    "apply, status patch.", registry=REGISTRY, buckets=_BUCKETS)
RECONCILE_QUEUE_SECONDS = Histogram(
    "crucible_operator_reconcile_queue_seconds", "Wait of a pass for a free worker (all "
    "workers busy on other jobs' API calls).", registry=REGISTRY, buckets=_BUCKETS)
RESTARTS = Counter("crucible_operator_restarts_total", "Restarts (whole group or one pod) by "
                   "cause and kind (application counts against maxRestarts).",
                   ["cause", "kind"], registry=REGISTRY)
CORDONS = Counter("crucible_operator_cordons_total", "Nodes cordoned after failing under a job.",
                  registry=REGISTRY)
POD_OPERATIONS = Counter("crucible_operator_pod_operations_total", "Pod API calls that took "
                         "effect, by verb (create, delete, force_delete).", ["verb"],
                         registry=REGISTRY)


class JobsByPhase:
    """`crucible_operator_jobs{phase}`: counts the operator's last seen phase of each job."""

    def __init__(self, phases: Callable[[], Mapping[str, str]]):
        self._phases = phases

    def describe(self):
        return []

    def collect(self):
        family = GaugeMetricFamily("crucible_operator_jobs", "PretrainJobs by phase.",
                                   labels=["phase"])
        counts = {phase: 0 for phase in PHASES}
        for phase in self._phases().values():
            counts[phase] = counts.get(phase, 0) + 1
        for phase, count in sorted(counts.items()):
            family.add_metric([phase], count)
        yield family


def serve(port: int, phases: Callable[[], Mapping[str, str]], address: str = "0.0.0.0"):
    """Start the /metrics endpoint; returns (server, thread) so tests can shut it down."""
    collector = JobsByPhase(phases)
    REGISTRY.register(collector)
    server, thread = start_http_server(port, addr=address, registry=REGISTRY)
    return server, thread, collector
