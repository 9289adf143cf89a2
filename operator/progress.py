"""Training progress from the trainer's Lease: status fields, goodput, and hang detection.

Owns three pure computations over `ProgressReport` and the job's status:

- `report`: step, tokensSeen, loss, worldSize, lastProgressTime, lastCheckpoint and lastRestore
  for status;
- goodput, the share of wall time that produced kept progress (docs/operator.md, "Status").
  Time counts as productive when the step counter advanced across it: between two Lease readings
  with steps s1 < s2 at step-times t1 < t2, the t2 - t1 seconds were spent on kept work. When the
  group restarts, the steps after the last committed checkpoint are lost (the trainer resumes from
  the checkpoint, docs/checkpoints.md "Loading"), so their share of productive time is taken
  back. Wall time runs from the job's start, minus time spent suspended by request. The
  accumulators live in `status.tracking.goodput` so an operator restart loses nothing. This is
  the goodput notion of Google's ML Goodput ("productive training time / total time") with
  lost-work subtraction, as the AI-Hypercomputer/resiliency goodput calculator does;
- `note_step`: when the operator first saw the reported step change, on its own clock; hang
  and crash-loop checks time from it. They read the step, never `renewTime`: the trainer's
  renewal thread keeps running while the training loop is stuck (trainer/lease.py).
"""

from __future__ import annotations

import datetime as dt

from crucible.api.progress import ProgressReport, format_time, parse_time


def report(lease: ProgressReport | None, status: dict) -> dict:
    """Status fields from the Lease (values the Lease lacks keep their previous value)."""
    out = {}
    if lease is None:
        return out
    if lease.step is not None:
        out["step"] = lease.step
    if lease.tokens is not None:
        out["tokensSeen"] = lease.tokens
    if lease.loss is not None:
        out["loss"] = round(lease.loss, 6)
    if lease.world_size is not None:
        out["worldSize"] = lease.world_size
    if lease.step_time is not None:
        out["lastProgressTime"] = format_time(lease.step_time)
    if lease.checkpoint_step is not None:
        out["lastCheckpoint"] = {k: v for k, v in {
            "step": lease.checkpoint_step, "uri": lease.checkpoint_uri,
            "time": lease.checkpoint_time and format_time(lease.checkpoint_time)}.items()
            if v is not None}
    if lease.restore_source is not None:
        out["lastRestore"] = {k: v for k, v in {
            "source": lease.restore_source, "step": lease.restore_step,
            "seconds": lease.restore_seconds,
            "time": lease.restore_time and format_time(lease.restore_time)}.items()
            if v is not None}
    return out


def advance(acc: dict, lease: ProgressReport | None) -> dict:
    """Fold one Lease reading into the goodput accumulators (returns a new dict).

    Only steps above the highest step already counted are productive: after a restore the
    operator did not order (torchrun restarting its workers, a pod replaced while the others
    kept training) the trainer redoes steps it had done, and redone work is not new progress.
    `lose_uncheckpointed` lowers that mark to the checkpoint, as it takes those steps back."""
    acc = dict(acc)
    if lease is None or lease.step is None or lease.step_time is None:
        return acc
    last_step, last_time = acc.get("lastStep"), parse_time(acc.get("lastStepTime"))
    if (last_step is not None and last_time is not None and lease.step > last_step
            and lease.step_time > last_time):
        high = acc.get("highStep")
        new_steps = lease.step - max(last_step, high if high is not None else last_step)
        if new_steps > 0:
            share = new_steps / (lease.step - last_step)
            acc["productiveSeconds"] = round(acc.get("productiveSeconds", 0.0) + share * (
                lease.step_time - last_time).total_seconds(), 3)
            acc["steps"] = acc.get("steps", 0) + new_steps
    if last_step is None or lease.step != last_step:
        acc["lastStep"], acc["lastStepTime"] = lease.step, format_time(lease.step_time)
    acc["highStep"] = max(lease.step, acc.get("highStep") or 0)
    return acc


def lose_uncheckpointed(acc: dict, checkpoint_step: int | None) -> tuple[dict, int]:
    """A restart: the work after the last committed checkpoint is lost. Returns (acc, lost steps).

    The next reading only sets a new baseline, so the restart's own downtime never counts.
    """
    acc = dict(acc)
    last = acc.get("lastStep")
    lost = max(0, (last or 0) - (checkpoint_step or 0)) if last is not None else 0
    lost = min(lost, acc.get("steps", 0))
    if lost and acc.get("steps"):
        per_step = acc.get("productiveSeconds", 0.0) / acc["steps"]
        acc["productiveSeconds"] = round(max(0.0, acc.get("productiveSeconds", 0.0)
                                             - lost * per_step), 3)
        acc["steps"] -= lost
    acc["lostSteps"] = acc.get("lostSteps", 0) + lost
    acc["lastStepTime"] = None  # a fresh baseline after the restart
    acc["lastStep"] = None
    if checkpoint_step is not None:
        acc["highStep"] = min(acc.get("highStep") or 0, checkpoint_step)  # redone: counted again
    else:
        acc.pop("highStep", None)
    return acc, lost


def goodput(acc: dict, start: dt.datetime | None, suspended_s: float,
            now: dt.datetime) -> float | None:
    if start is None:
        return None
    wall = (now - start).total_seconds() - suspended_s
    if wall <= 0:
        return None
    return round(min(1.0, acc.get("productiveSeconds", 0.0) / wall), 4)


def note_step(track: dict, lease: ProgressReport | None, now: dt.datetime) -> dt.datetime | None:
    """When the operator last saw the reported step change, on its own clock (kept in
    `tracking`): hang and crash-loop decisions compare it with the operator's `now`, never the
    trainer node's `step-time`, so a skewed node clock can neither fake nor hide a hang."""
    if lease is not None and lease.step is not None and lease.step != track.get("stepSeen"):
        track["stepSeen"], track["stepSeenAt"] = lease.step, format_time(now)
    return parse_time(track.get("stepSeenAt"))
