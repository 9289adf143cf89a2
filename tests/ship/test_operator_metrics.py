"""The operator's per-job series (operator/metrics.py `JobStatus`), which the dashboard and the
alert rules join with the trainer's on `namespace` and `job`; read from a status as decide()
writes it. test_live.py scrapes them from a real operator."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from crucible.operator import metrics


def _samples(status: dict, spec: dict) -> dict:
    registry = CollectorRegistry()
    record = metrics.JobRecord("team-a", "gpt", status, metrics.checkpoint_interval_s(spec))
    registry.register(metrics.JobStatus(lambda: {"uid": record}))
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items()
                                  if k not in ("namespace", "job")))): s.value
            for family in text_string_to_metric_families(generate_latest(registry).decode())
            for s in family.samples if s.labels.get("job") == "gpt"}


def test_a_running_job_with_progress_checkpoints_and_restarts():
    status = {"phase": "Running", "goodput": 0.93, "startTime": "2026-01-01T00:00:00Z",
              "lastProgressTime": "2026-01-01T01:00:00Z",
              "lastCheckpoint": {"step": 100, "time": "2026-01-01T00:50:00Z"},
              "restarts": {"total": 3, "application": 1, "infrastructure": 2,
                           "byCause": {"NodeFailure": 2, "ApplicationError": 1}}}
    got = _samples(status, {"checkpoint": {"uri": "s3://bucket/run", "everyMinutes": 5}})
    assert got[("crucible_operator_job_phase", (("phase", "Running"),))] == 1
    assert sum(v for (n, _), v in got.items() if n == "crucible_operator_job_phase") == 1
    assert got[("crucible_operator_job_goodput", ())] == 0.93
    assert got[("crucible_operator_job_restarts_total", (("kind", "application"),))] == 1
    assert got[("crucible_operator_job_restarts_total", (("kind", "infrastructure"),))] == 2
    assert got[("crucible_operator_job_restarts_by_cause_total", (("cause", "NodeFailure"),))] == 2
    assert got[("crucible_operator_job_last_progress_timestamp_seconds", ())] == 1767229200
    assert got[("crucible_operator_job_last_checkpoint_timestamp_seconds", ())] == 1767228600
    assert got[("crucible_operator_job_checkpoint_interval_seconds", ())] == 300


def test_a_new_job_counts_from_its_start_and_zero_restarts():
    got = _samples({"phase": "Pending", "startTime": "2026-01-01T00:00:00Z"},
                   {"checkpoint": {"uri": "s3://bucket/run"}})
    start = 1767225600
    assert got[("crucible_operator_job_last_progress_timestamp_seconds", ())] == start
    assert got[("crucible_operator_job_last_checkpoint_timestamp_seconds", ())] == start
    assert got[("crucible_operator_job_checkpoint_interval_seconds", ())] == 600  # the default
    assert got[("crucible_operator_job_restarts_total", (("kind", "application"),))] == 0
    assert ("crucible_operator_job_goodput", ()) not in got


def test_no_checkpoint_uri_means_no_time_based_interval():
    got = _samples({"phase": "Running"}, {"checkpoint": {"everyMinutes": 5}})
    assert got[("crucible_operator_job_checkpoint_interval_seconds", ())] == 0
    assert not [k for k in got if "timestamp" in k[0]]
