"""Per-step counters that add up across shards: what came in, what went out, what was dropped why.

Owns: `StepStats` (one step's documents and bytes in/out per source, drops by reason, a few
removed samples per reason, free-form counters, the files a reader could not read to their end)
and `merge_stats`. Must not: read or write files (pipeline does) or render anything (report
does).

Follows datatrove's per-block `Stats` (total / forwarded / dropped / dropped_<reason>, merged
across ranks by `merge_stats`, src/datatrove/utils/stats.py). Two choices make a sharded run's
merged stats equal a single run's, which a test checks: every field is a sum, and the samples kept
per reason (like the list of problem files) are ordered by global document key, which is
independent of sharding.
Timing is the one field that is not reproducible; it is kept apart (`time_s`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

SAMPLES_PER_REASON = 3     # removed examples the report shows per reason
SAMPLE_CHARS = 400         # each truncated to this many characters


@dataclass
class SourceCounts:
    """Documents and UTF-8 bytes into and out of one step for one source, drops by reason."""

    docs_in: int = 0
    bytes_in: int = 0
    docs_out: int = 0
    bytes_out: int = 0
    dropped_docs: dict[str, int] = field(default_factory=dict)
    dropped_bytes: dict[str, int] = field(default_factory=dict)

    def add(self, other: "SourceCounts") -> None:
        self.docs_in += other.docs_in
        self.bytes_in += other.bytes_in
        self.docs_out += other.docs_out
        self.bytes_out += other.bytes_out
        for reason, n in other.dropped_docs.items():
            self.dropped_docs[reason] = self.dropped_docs.get(reason, 0) + n
        for reason, n in other.dropped_bytes.items():
            self.dropped_bytes[reason] = self.dropped_bytes.get(reason, 0) + n


@dataclass
class StepStats:
    """Everything one step did on one shard (or, once merged, on the whole corpus)."""

    step: str
    why: str = ""
    params: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, SourceCounts] = field(default_factory=dict)
    # reason -> [[key, source, id, excerpt], ...], the SAMPLES_PER_REASON smallest keys.
    samples: dict[str, list[list[Any]]] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=dict)
    # [[key, source, file, reason, detail], ...] for every file not read to its end, by key. All
    # of them, not samples: they are few (one per file) and each may be worth fetching again.
    problem_files: list[list[Any]] = field(default_factory=list)
    time_s: float = 0.0

    def source(self, name: str) -> SourceCounts:
        counts = self.sources.get(name)
        if counts is None:
            counts = self.sources[name] = SourceCounts()
        return counts

    def record_in(self, source: str, size_bytes: int) -> None:
        counts = self.source(source)
        counts.docs_in += 1
        counts.bytes_in += size_bytes

    def record_out(self, source: str, size_bytes: int, copies: int = 1) -> None:
        counts = self.source(source)
        counts.docs_out += copies
        counts.bytes_out += size_bytes * copies

    def record_drop(self, source: str, size_bytes: int, reason: str, key: int, doc_id: str,
                    excerpt: str) -> None:
        counts = self.source(source)
        counts.dropped_docs[reason] = counts.dropped_docs.get(reason, 0) + 1
        counts.dropped_bytes[reason] = counts.dropped_bytes.get(reason, 0) + size_bytes
        kept = self.samples.setdefault(reason, [])
        if len(kept) < SAMPLES_PER_REASON or key < kept[-1][0]:
            kept.append([key, source, doc_id, excerpt[:SAMPLE_CHARS]])
            kept.sort(key=lambda sample: sample[0])
            del kept[SAMPLES_PER_REASON:]

    def record_problem_file(self, key: int, source: str, file: str, reason: str,
                            detail: str) -> None:
        self.problem_files.append([key, source, file, reason, detail])
        self.problem_files.sort(key=lambda entry: entry[0])

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    def totals(self) -> SourceCounts:
        total = SourceCounts()
        for counts in self.sources.values():
            total.add(counts)
        return total

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "why": self.why, "params": self.params,
                "sources": {name: vars(c) for name, c in sorted(self.sources.items())},
                "samples": self.samples, "counters": dict(sorted(self.counters.items())),
                "problem_files": self.problem_files, "time_s": self.time_s}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "StepStats":
        return cls(step=data["step"], why=data.get("why", ""), params=data.get("params", {}),
                   sources={k: SourceCounts(**v) for k, v in data.get("sources", {}).items()},
                   samples={k: [list(s) for s in v] for k, v in data.get("samples", {}).items()},
                   counters=dict(data.get("counters", {})),
                   problem_files=[list(p) for p in data.get("problem_files", [])],
                   time_s=data.get("time_s", 0.0))


def merge_stats(parts: Iterable[StepStats]) -> StepStats:
    """Sum the stats of one step over shards. Order of `parts` does not matter."""
    parts = list(parts)
    if not parts:
        raise ValueError("nothing to merge")
    merged = StepStats(step=parts[0].step, why=parts[0].why, params=parts[0].params)
    for part in parts:
        if part.step != merged.step:
            raise ValueError(f"cannot merge stats of {part.step!r} into {merged.step!r}")
        for name, counts in part.sources.items():
            merged.source(name).add(counts)
        for reason, samples in part.samples.items():
            kept = merged.samples.setdefault(reason, [])
            kept.extend(samples)
            kept.sort(key=lambda sample: sample[0])
            del kept[SAMPLES_PER_REASON:]
        for name, n in part.counters.items():
            merged.count(name, n)
        merged.problem_files.extend(part.problem_files)
        merged.time_s += part.time_s
    merged.problem_files.sort(key=lambda entry: entry[0])
    return merged


def merge_step_lists(shards: Iterable[list[StepStats]]) -> list[StepStats]:
    """Merge per-shard lists of step stats (each in pipeline order) step by step."""
    by_step: dict[str, list[StepStats]] = {}
    for shard in shards:
        for stats in shard:
            by_step.setdefault(stats.step, []).append(stats)
    return [merge_stats(parts) for parts in by_step.values()]
