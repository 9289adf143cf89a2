"""The run report as data: per step and per source, what came in, what went out, and why the rest
was removed; the input files that could not be read to their end; duplicate-cluster sizes;
mixture epochs; and a check that the numbers add up.

Owns: `build_report` (merged stats of every stage -> one JSON-able dict), `check_totals` (in -
removed = out at every step and source, and each step's output is the next one's input) and
`write_report` (report.json plus report.html from report_html). Must not: run steps.

Follows datatrove's merged `stats.json` (src/datatrove/utils/stats.py) in content, and FineWeb's
per-filter exclusion folders (examples/fineweb.py: removed/1_url, 2_non_english, ...) in spirit:
instead of whole removed datasets, each reason keeps the few removed samples with the smallest
keys, which is enough to defend or question a rule and does not depend on sharding.
"""

from __future__ import annotations

import json
from typing import Any

from crucible.trainer import storage
from crucible.trainer.corpus import dedup
from crucible.trainer.corpus.config import describe
from crucible.trainer.corpus.stats import SourceCounts, StepStats

TOP_REASONS = 10


def _counts(c: SourceCounts) -> dict[str, Any]:
    removed_docs = sum(c.dropped_docs.values())
    return {"docs_in": c.docs_in, "docs_out": c.docs_out, "bytes_in": c.bytes_in,
            "bytes_out": c.bytes_out, "removed_docs": removed_docs,
            "removed_bytes": sum(c.dropped_bytes.values()),
            "removed_share": round(removed_docs / c.docs_in, 6) if c.docs_in else 0.0}


def step_entry(stats: StepStats, stage: str) -> dict[str, Any]:
    totals = stats.totals()
    reasons = sorted(totals.dropped_docs.items(), key=lambda item: (-item[1], item[0]))
    return {
        "step": stats.step, "stage": stage, "why": stats.why, "params": stats.params,
        "totals": _counts(totals),
        "sources": {name: {**_counts(c), "reasons": dict(sorted(c.dropped_docs.items()))}
                    for name, c in sorted(stats.sources.items())},
        "reasons": [{"reason": r, "docs": n, "bytes": totals.dropped_bytes.get(r, 0),
                     "share_of_in": round(n / totals.docs_in, 6) if totals.docs_in else 0.0}
                    for r, n in reasons[:TOP_REASONS]],
        "other_reasons": [{"reason": r, "docs": n} for r, n in reasons[TOP_REASONS:]],
        "samples": {r: [{"key": s[0], "source": s[1], "id": s[2], "text": s[3]} for s in samples]
                    for r, samples in sorted(stats.samples.items())},
        "counters": stats.counters,
        "problem_files": [{"key": p[0], "source": p[1], "file": p[2], "reason": p[3],
                           "detail": p[4]} for p in stats.problem_files],
        "time_s": round(stats.time_s, 3),
        "docs_per_s": round(totals.docs_in / stats.time_s, 1) if stats.time_s > 0 else None,
    }


def check_totals(steps: list[dict[str, Any]]) -> list[str]:
    """Problems with the arithmetic, as sentences; empty when everything adds up."""
    problems = []
    previous: dict[str, Any] | None = None
    for step in steps:
        for source, c in step["sources"].items():
            extra_copies = step["counters"].get(f"extra_copies.{source}", 0)
            if c["docs_in"] - c["removed_docs"] + extra_copies != c["docs_out"]:
                problems.append(f"{step['step']}/{source}: {c['docs_in']} in - "
                                f"{c['removed_docs']} removed != {c['docs_out']} out")
        if previous is not None:
            for source in set(previous["sources"]) | set(step["sources"]):
                out = previous["sources"].get(source, {}).get("docs_out", 0)
                into = step["sources"].get(source, {}).get("docs_in", 0)
                if out != into:
                    problems.append(f"{previous['step']} -> {step['step']}/{source}: "
                                    f"{out} out but {into} in")
        previous = step
    return problems


def build_report(job) -> dict[str, Any]:
    """Merge every stage's stats of a finished `pipeline.Job` into the report dict."""
    steps: list[dict[str, Any]] = []
    for stage in job.stages():
        if stage.name in ("filter", "dedup", "mix"):
            for stats in job.merged_stats(stage.name, stage.tasks):
                steps.append(step_entry(stats, stage.name))
    clusters = None
    if storage.exists(dedup.clusters_uri(job.output)):
        clusters = json.loads(storage.read_bytes(dedup.clusters_uri(job.output)))
    first, last = steps[0]["totals"], steps[-1]["totals"]
    problems = check_totals(steps)
    return {
        "run": {"output": job.output, "shards": job.shard_count,
                "fingerprint": job.config.fingerprint(),
                "final_output": storage.join(job.output, job.final_folder(),
                                             "shard-*.jsonl.zst")},
        "config": describe(job.config),
        "summary": {"docs_in": first["docs_in"], "bytes_in": first["bytes_in"],
                    "docs_out": last["docs_out"], "bytes_out": last["bytes_out"],
                    "docs_kept_share": round(last["docs_out"] / first["docs_in"], 6)
                    if first["docs_in"] else 0.0,
                    "problem_files": sum(len(step["problem_files"]) for step in steps)},
        "steps": steps,
        "dedup": clusters,
        "checks": {"adds_up": not problems, "problems": problems},
    }


def write_report(output: str, report: dict[str, Any]) -> None:
    from crucible.trainer.corpus.report_html import render_html

    storage.write_bytes(storage.join(output, "report.json"),
                        json.dumps(report, indent=1, ensure_ascii=False).encode())
    storage.write_bytes(storage.join(output, "report.html"), render_html(report).encode())
