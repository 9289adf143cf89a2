"""The progress report's wire format: one set of keys, one time format, read back unchanged.

The trainer writes the report (`ProgressLease.update`, with the commit time from
`Commit.for_lease`) and the operator reads it (`observed.lease_view`); both go through
`ProgressReport`. Annotations -> report -> annotations is the identity for everything a writer
produces, times from both writers included, and the operator reads exactly what was written.
"""

from __future__ import annotations

import datetime as dt
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crucible.api.names import PREFIX
from crucible.api.progress import CommitRef, ProgressReport, format_time, parse_time
from crucible.operator.observed import lease_view
from crucible.trainer.checkpoint import Commit
from crucible.trainer.lease import ProgressLease

UTC = dt.timezone.utc
TIMES = st.datetimes(min_value=dt.datetime(2000, 1, 1), max_value=dt.datetime(2100, 1, 1),
                     timezones=st.just(UTC))


def trainer_lease() -> ProgressLease:
    """A ProgressLease without its API client and thread: only what `update` keeps."""
    lease = ProgressLease.__new__(ProgressLease)
    lease._report, lease._lock = ProgressReport(), threading.Lock()
    return lease


def test_the_trainers_report_reads_back_unchanged_through_the_operator():
    lease = trainer_lease()
    commit = Commit(step=100, tokens=52428800, uri="s3://bucket/runs/gpt/step_100",
                    time=1_764_500_000.25, bytes=1 << 30)
    lease.update(step=120, tokens=62914560, loss=3.14159265, world_size=16,
                 checkpoint=commit.for_lease())
    annotations = lease._report.to_annotations()
    assert set(annotations) == {PREFIX + k for k in (
        "step", "step-time", "tokens", "loss", "world-size", "checkpoint-step", "checkpoint-uri",
        "checkpoint-time")}
    # One time format: RFC 3339, UTC, "Z".
    for key in ("step-time", "checkpoint-time"):
        text = annotations[PREFIX + key]
        assert text.endswith("Z") and "+00:00" not in text and parse_time(text).tzinfo
    assert annotations[PREFIX + "checkpoint-time"] == "2025-11-30T10:53:20.250000Z"
    read = lease_view({"metadata": {"annotations": annotations}, "spec": {}})
    assert read.to_annotations() == annotations
    assert (read.step, read.tokens, read.world_size, read.checkpoint_step) == (120, 62914560, 16,
                                                                             100)
    assert read.loss == 3.14159 and read.checkpoint_time == commit.for_lease().time


def test_a_restore_is_reported_and_read_back():
    from crucible.api.progress import RestoreRef

    lease = trainer_lease()
    when = dt.datetime(2026, 12, 1, 10, 0, 0, 500000, tzinfo=UTC)
    lease.update(step=38, tokens=100, restore=RestoreRef("memory", 38, 0.125, when))
    annotations = lease._report.to_annotations()
    assert annotations[PREFIX + "restore-source"] == "memory"
    assert annotations[PREFIX + "restore-time"] == "2026-12-01T10:00:00.500000Z"
    read = lease_view({"metadata": {"annotations": annotations}, "spec": {}})
    assert (read.restore_source, read.restore_step, read.restore_seconds, read.restore_time) == \
        ("memory", 38, 0.125, when)
    lease.update(step=39, tokens=200)  # a later step keeps the last restore
    assert lease._report.restore_step == 38


def test_a_checkpoint_commit_keeps_the_last_loss_and_moves_step_time_only_on_a_new_step():
    lease = trainer_lease()
    lease.update(step=5, tokens=50, loss=2.5)
    first = lease._report.step_time
    lease.update(step=5, tokens=50, checkpoint=CommitRef(5, "/ckpt/step_5", dt.datetime.now(UTC)))
    assert lease._report.loss == 2.5 and lease._report.step_time == first
    lease.update(step=6, tokens=60)
    assert lease._report.step_time >= first and lease._report.checkpoint_step == 5


@given(step=st.integers(0, 10**9), tokens=st.integers(0, 10**15),
       loss=st.floats(0, 100, allow_nan=False), world=st.integers(1, 65536),
       step_time=TIMES, ckpt_time=TIMES, ckpt_step=st.integers(0, 10**9),
       uri=st.from_regex(r"s3://[a-z0-9-]{3,20}/[a-z0-9/_]{1,30}", fullmatch=True))
def test_annotations_to_report_to_annotations_is_the_identity(step, tokens, loss, world,
                                                              step_time, ckpt_time, ckpt_step,
                                                              uri):
    written = ProgressReport(step, step_time, tokens, loss, world, ckpt_step, uri,
                             ckpt_time).to_annotations()
    report = ProgressReport.from_annotations(written)
    assert report.to_annotations() == written
    assert report.step_time == step_time and report.checkpoint_time == ckpt_time


def test_missing_and_unreadable_values_read_as_none():
    report = ProgressReport.from_annotations({PREFIX + "step": "many", PREFIX + "loss": "",
                                              PREFIX + "step-time": "yesterday"})
    assert report == ProgressReport()
    assert ProgressReport.from_annotations(None).to_annotations() == {}


def test_format_time_refuses_a_naive_time():
    with pytest.raises(ValueError, match="aware"):
        format_time(dt.datetime(2026, 1, 1))


@pytest.mark.parametrize("annotations", [
    {PREFIX + "loss": "nan"}, {PREFIX + "loss": "inf"}, {PREFIX + "restore-seconds": "-inf"},
    {PREFIX + "step-time": "0001-01-01T00:00:00+01:00"},
    {PREFIX + "checkpoint-time": "9999-12-31T23:59:59-01:00"},
])
def test_what_the_status_cannot_hold_reads_as_absent(annotations):
    """Whatever the Lease's writer (the tenant's trainer) puts there, the report must be
    writable back as annotations and as JSON status: a diverged loss or a time outside years
    1..9999 in UTC reads as absent instead of wedging the job's reconcile loop."""
    import json

    report = ProgressReport.from_annotations(annotations)
    assert report == ProgressReport()
    json.dumps(report.to_annotations(), allow_nan=False)
