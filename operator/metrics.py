"""The operator's own Prometheus metrics (kopf exports none; docs/operator.md lists them).

Owns the metric names and labels; `handlers.py` and `kube.py` record into them. Names follow
Kubeflow's `training_operator_jobs_restarted_total` style with our prefix, and carry units
(`_seconds`). Jobs by phase are read from the operator's last view at scrape time, so a deleted
job stops counting without bookkeeping.

Per-job series (`JobStatus`) are read the same way, from the status each job's last pass
computed: phase, goodput, restarts, checkpoint and progress times. They carry `namespace` and
`job` (the PretrainJob's name), the labels of the trainer's own series, so a dashboard or an
alert rule can join the two planes; scrape with honor_labels (the chart's ServiceMonitor sets
honorLabels) so Prometheus keeps them. Status counters never decrease, so the restart counts are
exposed as counters; both kinds are always present (zero until a restart happens), as
Prometheus' instrumentation guide asks of series known in advance.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from crucible.api.progress import parse_time
from crucible.api.spec import CheckpointSpec
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
UNCORDONS = Counter("crucible_operator_uncordons_total", "Operator cordons lifted once their "
                    "quarantine ended with the node healthy (--quarantine-minutes).",
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


@dataclass(frozen=True)
class JobRecord:
    """What one job's last pass left for the scrape: its name and the status it computed."""

    namespace: str
    name: str
    status: Mapping
    checkpoint_interval_s: float  # checkpoint.everyMinutes in seconds; 0: no time-based saves


def checkpoint_interval_s(spec: Mapping) -> float:
    """The job's time-based checkpoint interval (0 without a checkpoint URI or with everyMinutes 0)."""
    ckpt = spec.get("checkpoint") or {}
    if not ckpt.get("uri"):
        return 0.0
    return 60.0 * float(ckpt.get("everyMinutes", CheckpointSpec.model_fields["every_minutes"].default))


def _timestamp(value) -> float | None:
    parsed = parse_time(value)
    return None if parsed is None else parsed.timestamp()


class JobStatus:
    """`crucible_operator_job_*{namespace,job}`: each job's last status, read at scrape time."""

    def __init__(self, jobs: Callable[[], Mapping[str, JobRecord]]):
        self._jobs = jobs

    def describe(self):
        return []

    def collect(self):
        labels = ["namespace", "job"]
        phase = GaugeMetricFamily("crucible_operator_job_phase", "1 for the job's phase, 0 for "
                                  "the others.", labels=labels + ["phase"])
        goodput = GaugeMetricFamily("crucible_operator_job_goodput", "Share of wall time that "
                                    "produced progress still kept (status.goodput), 0..1.",
                                    labels=labels)
        restarts = CounterMetricFamily("crucible_operator_job_restarts", "Restarts by kind "
                                       "(application counts against maxRestarts).",
                                       labels=labels + ["kind"])
        by_cause = CounterMetricFamily("crucible_operator_job_restarts_by_cause", "Restarts by "
                                       "cause (status.restarts.byCause).", labels=labels + ["cause"])
        progress = GaugeMetricFamily("crucible_operator_job_last_progress_timestamp_seconds",
                                     "When the step last advanced (Unix time); the job's start "
                                     "until its first step.", labels=labels)
        checkpoint = GaugeMetricFamily("crucible_operator_job_last_checkpoint_timestamp_seconds",
                                       "When the newest checkpoint was committed (Unix time); "
                                       "the job's start until its first.", labels=labels)
        interval = GaugeMetricFamily("crucible_operator_job_checkpoint_interval_seconds",
                                     "checkpoint.everyMinutes in seconds (0: no time-based "
                                     "saves).", labels=labels)
        for job in self._jobs().values():
            key, status = [job.namespace, job.name], job.status
            current = status.get("phase", "Pending")
            for name in PHASES:
                phase.add_metric(key + [name], 1 if name == current else 0)
            if status.get("goodput") is not None:
                goodput.add_metric(key, float(status["goodput"]))
            counts = status.get("restarts") or {}
            for kind in ("application", "infrastructure"):
                restarts.add_metric(key + [kind], float(counts.get(kind, 0)))
            for cause, count in sorted((counts.get("byCause") or {}).items()):
                by_cause.add_metric(key + [cause], float(count))
            start = _timestamp(status.get("startTime"))
            last = _timestamp(status.get("lastProgressTime")) or start
            if last is not None:
                progress.add_metric(key, last)
            committed = _timestamp((status.get("lastCheckpoint") or {}).get("time")) or start
            if committed is not None:
                checkpoint.add_metric(key, committed)
            interval.add_metric(key, job.checkpoint_interval_s)
        yield from (phase, goodput, restarts, by_cause, progress, checkpoint, interval)


def serve(port: int, phases: Callable[[], Mapping[str, str]], address: str = "0.0.0.0",
          jobs: Callable[[], Mapping[str, JobRecord]] = dict):
    """Start the /metrics endpoint; returns (server, thread, collectors) so tests can shut it
    down and unregister the collectors."""
    collectors = (JobsByPhase(phases), JobStatus(jobs))
    for collector in collectors:
        REGISTRY.register(collector)
    server, thread = start_http_server(port, addr=address, registry=REGISTRY)
    return server, thread, collectors
