"""The progress report: what trainer rank 0 tells the operator, as annotations on a Lease.

The operator creates a `coordination.k8s.io/v1` Lease `<job>-progress` (owned by the
PretrainJob) and the trainer only patches it, every few seconds, with a `ProgressReport`:

  crucible.dev/step             optimizer steps completed
  crucible.dev/step-time        when the step counter last advanced (hang detection)
  crucible.dev/tokens           tokens trained on
  crucible.dev/loss             training loss of the last logged step
  crucible.dev/world-size       ranks in the current rendezvous
  crucible.dev/checkpoint-step  newest committed checkpoint: its step, URI and commit time
  crucible.dev/checkpoint-uri
  crucible.dev/checkpoint-time
  crucible.dev/restore-source   the last restore: where from (memory, peer, s3, disk), its step,
  crucible.dev/restore-step     how long it took and when it ended
  crucible.dev/restore-seconds
  crucible.dev/restore-time
  crucible.dev/stragglers       ranks reported slow now, "rank@host:ratio,..." ("" once none is)

`to_annotations` and `from_annotations` are the only writer and reader of these keys, and
`format_time` is the only way a time is written: RFC 3339 in UTC with a "Z" suffix, as the
Kubernetes API writes its own times. Pure: no clock, no I/O.
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass, fields
from typing import Mapping, NamedTuple

from crucible.api.names import PREFIX


def format_time(t: dt.datetime) -> str:
    """RFC 3339, UTC, "Z" suffix; microseconds only when there are some (as `isoformat`)."""
    if t.tzinfo is None:
        raise ValueError("format_time needs an aware datetime (a naive one has no zone to say)")
    return t.astimezone(dt.timezone.utc).isoformat().replace("+00:00", "Z")


def parse_time(value) -> dt.datetime | None:
    """RFC 3339 text (ours or the API's) -> aware datetime; None when absent or unreadable."""
    if value is None or value == "":
        return None
    if isinstance(value, dt.datetime):
        return value if value.tzinfo else value.replace(tzinfo=dt.timezone.utc)
    try:
        parsed = dt.datetime.fromisoformat(str(value).replace("Z", "+00:00"))
        parsed = parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.timezone.utc)
        parsed.astimezone(dt.timezone.utc)   # one `format_time` can write back (year 1..9999)
    except (ValueError, OverflowError):
        return None
    return parsed


def _int(value) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _float(value) -> float | None:
    """A finite number, or None: NaN and infinity (a diverged loss, or anything the Lease's
    writer put there) have no JSON form, and the job's status must stay writable."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _loss_text(loss: float) -> str:
    return f"{loss:.6g}"  # six significant digits: what status and `kubectl get ptj` show


class CommitRef(NamedTuple):
    """The newest committed checkpoint, as the report tells it."""

    step: int
    uri: str
    time: dt.datetime


class RestoreRef(NamedTuple):
    """The last restore, as the report tells it."""

    source: str
    step: int
    seconds: float
    time: dt.datetime


class Straggler(NamedTuple):
    """A rank the trainer reports slower than the others (trainer/straggler.py)."""

    rank: int
    host: str
    ratio: float


def _stragglers_text(stragglers: tuple[Straggler, ...]) -> str:
    return ",".join(f"{s.rank}@{s.host}:{s.ratio:g}" for s in stragglers)


def _stragglers(text) -> tuple[Straggler, ...] | None:
    """Read `_stragglers_text`; None when absent, malformed entries skipped."""
    if text is None:
        return None
    out = []
    for item in filter(None, str(text).split(",")):
        rank, _, rest = item.partition("@")
        host, _, ratio = rest.rpartition(":")
        if _int(rank) is not None and host and _float(ratio) is not None:
            out.append(Straggler(int(rank), host, float(ratio)))
    return tuple(out)


# Per field: (annotation key, text -> value, value -> text).
_CODECS = {
    "step": ("step", _int, str),
    "step_time": ("step-time", parse_time, format_time),
    "tokens": ("tokens", _int, str),
    "loss": ("loss", _float, _loss_text),
    "world_size": ("world-size", _int, str),
    "checkpoint_step": ("checkpoint-step", _int, str),
    "checkpoint_uri": ("checkpoint-uri", lambda text: text or None, str),
    "checkpoint_time": ("checkpoint-time", parse_time, format_time),
    "restore_source": ("restore-source", lambda text: text or None, str),
    "restore_step": ("restore-step", _int, str),
    "restore_seconds": ("restore-seconds", _float, lambda v: f"{v:.3f}"),
    "restore_time": ("restore-time", parse_time, format_time),
    "stragglers": ("stragglers", _stragglers, _stragglers_text),
}


@dataclass(frozen=True)
class ProgressReport:
    """One reading of the trainer's progress; a field is None when it was never reported."""

    step: int | None = None
    step_time: dt.datetime | None = None
    tokens: int | None = None
    loss: float | None = None
    world_size: int | None = None
    checkpoint_step: int | None = None
    checkpoint_uri: str | None = None
    checkpoint_time: dt.datetime | None = None
    restore_source: str | None = None
    restore_step: int | None = None
    restore_seconds: float | None = None
    restore_time: dt.datetime | None = None
    stragglers: tuple[Straggler, ...] | None = None

    def to_annotations(self) -> dict[str, str]:
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                key, _, write = _CODECS[f.name]
                out[PREFIX + key] = write(value)
        return out

    @classmethod
    def from_annotations(cls, annotations: Mapping[str, str] | None) -> "ProgressReport":
        """Read what `to_annotations` wrote; unreadable or foreign values read as None."""
        annotations = annotations or {}
        return cls(**{name: read(annotations.get(PREFIX + key))
                      for name, (key, read, _) in _CODECS.items()})
