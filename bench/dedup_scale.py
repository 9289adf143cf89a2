"""Dedup at scale: peak memory and time per task of the exact, buckets, links, components and
clusters stages on synthetic signatures with planted clusters, from 1M to 20M documents.

    python bench/dedup_scale.py [--docs 1000000 5000000 20000000] [--out FILE.json]
                                [--check-docs 1000000] [--work DIR]

For each size, stage 1's files are written straight from tests/corpus/synthetic.py (no text:
signature computation is per shard and already bounded by its shard), one shard per
--docs-per-shard documents and one hash-range partition per --docs-per-partition documents (1M
each by default: a task's slice stays the same size as the corpus grows, as a user sizing a run
for 2 GB tasks would keep it). Then every task of these five stages runs in its own forked
process, as a pod or Ray task would (components in as many steps as it takes to converge), the
sizes side by side: each stage's passes are taken for every size in turn, so the machine's other
work weighs on all sizes alike. The process's peak RSS is read back from the kernel
(os.wait4's rusage, the figure `/usr/bin/time -v` prints), with what the task added to the RSS
it began with (the interpreter and imports, shared by every task). Printed per size: the largest
peak RSS of any task of each stage, the seconds of all its tasks added up (each task's fastest of
--repeat runs, added over the steps of components), and both per document of the
task's input (a partition's slice: every task reads one hash range of keys, digests or band
keys); then the growth of each per-document figure from the smallest to the largest size (the
goal: within +-20%). The growth of the stages together is also printed from the fastest whole
pass of each stage (what earlier versions of this bench reported): with 14 tasks a pass at 1M
documents has more luck in its fastest total than one of 280 tasks at 20M, so that figure leans
upwards.

Reference: at --check-docs documents, the removal set must equal the in-memory path's
(dedup.removal_in_memory: whole-corpus arrays, one sort per band, pure-Python union-find), whose
own peak RSS and time are printed beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

STAGES = ("exact", "buckets", "links", "components", "clusters")


def current_rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def in_child(work, *args) -> tuple[float, int, int, object]:
    """Run work(*args) in a forked process: (seconds, peak RSS bytes, RSS bytes the work added to
    what the process held when it began, its JSON-able result)."""
    read_end, write_end = os.pipe()
    started = time.perf_counter()
    pid = os.fork()
    if pid == 0:                                   # the child: run, report, exit at once
        os.close(read_end)
        try:
            start_rss = current_rss()
            result = work(*args)
            payload = json.dumps({"ok": result, "start_rss": start_rss}).encode()
        except BaseException as err:               # noqa: BLE001 - reported to the parent
            payload = json.dumps({"error": f"{type(err).__name__}: {err}"}).encode()
        with os.fdopen(write_end, "wb") as out:
            out.write(payload)
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as source:
        payload = json.loads(source.read() or b'{"error": "no result"}')
    _, status, usage = os.wait4(pid, 0)
    seconds = time.perf_counter() - started
    if "error" in payload or status != 0:
        raise RuntimeError(f"task failed: {payload.get('error', status)}")
    peak = usage.ru_maxrss * 1024
    return seconds, peak, peak - payload["start_rss"], payload["ok"]


def make_job(work: Path, shards: int, partitions: int):
    from crucible.trainer.corpus import config as corpus_config
    from crucible.trainer.corpus import pipeline

    config = corpus_config.from_dict({
        "output": str(work), "steps": [], "sources": [{"name": "synthetic", "paths": [str(work)]}],
        "dedup": {"exact": True, "near": {}, "partitions": partitions}})
    return pipeline.Job(config, shards)


def write_stage1(work: Path, shards: int, partitions: int, docs: int) -> None:
    from crucible.trainer.corpus import dedup
    from tests.corpus import synthetic

    job = make_job(work, shards, partitions)
    for shard in range(shards):
        dedup.write_signatures(job.output, shard, synthetic.shard_signatures(shard, shards, docs),
                               partitions, job.families)


def run_task(work: str, shards: int, partitions: int, stage: str, task: int) -> None:
    job = make_job(Path(work), shards, partitions)
    job.stage_named(stage).body(job, task)


def removal(work: str, shards: int, partitions: int) -> dict:
    import numpy as np

    from crucible.trainer.corpus import dedup

    exact = np.concatenate([dedup.exact_removal_of_shard(work, "exact", partitions, s)[0]
                            for s in range(shards)])
    near = np.concatenate([dedup.near_removal_of_shard(work, partitions, s)
                           for s in range(shards)])
    return {"exact": np.sort(exact).tolist(), "near": np.sort(near).tolist()}


def in_memory_removal(shards: int, docs: int) -> dict:
    from crucible.trainer.corpus import dedup
    from tests.corpus import synthetic

    corpus = synthetic.whole_corpus(shards, docs)
    found = dedup.removal_in_memory(corpus["keys"], corpus["digests"], corpus["bands"])
    return {"exact": found.exact.tolist(), "near": found.near.tolist()}


class Size:
    """One corpus size's files, job and figures while the sizes are measured side by side."""

    def __init__(self, docs: int, args: argparse.Namespace, root: Path):
        self.docs = docs
        self.shards = max(1, -(-docs // args.docs_per_shard))
        self.partitions = max(1, -(-docs // args.docs_per_partition))
        self.work = root / f"docs-{docs}"
        shutil.rmtree(self.work, ignore_errors=True)
        started = time.perf_counter()
        # In a child: the parent must stay as small as every task's starting point, or a task
        # reuses heap the generator freed and its RSS hides what it allocated.
        in_child(write_stage1, self.work, self.shards, self.partitions, docs)
        print(f"{docs:>11,} docs: {self.shards} shards, {self.partitions} partitions; stage 1 "
              f"files written in {time.perf_counter() - started:.0f}s", flush=True)
        job = make_job(self.work, self.shards, self.partitions)
        self.order = (stage for stage in job.run_order() if stage.kind in STAGES)
        self.stages: dict[str, dict] = {}

    def run_tasks(self, stage) -> tuple[list[float], list[int], list[int]]:
        """Every task of `stage` once: (seconds, peak RSS, RSS added) per task."""
        runs = [in_child(run_task, str(self.work), self.shards, self.partitions, stage.name, task)
                for task in range(stage.tasks)]
        return [r[0] for r in runs], [r[1] for r in runs], [r[2] for r in runs]

    def record(self, stage, passes: list[list[float]], peaks: list[int], added: list[int]) -> None:
        entry = self.stages.setdefault(stage.kind, {
            "tasks": 0, "steps": 0, "task_seconds": 0.0, "fastest_pass_seconds": 0.0,
            "task_seconds_each_pass": [], "peak_rss_bytes": 0, "added_rss_bytes": 0,
            "slice_docs": int(self.docs / self.partitions)})
        entry["tasks"] += stage.tasks
        entry["steps"] += 1
        # Each task's fastest run, added up: a pass over 14 tasks (1M documents) has more luck
        # in its fastest total than a pass over 280 (20M), which would bias the growth upwards.
        entry["task_seconds"] = round(entry["task_seconds"] + sum(map(min, zip(*passes))), 2)
        entry["fastest_pass_seconds"] = round(entry["fastest_pass_seconds"] +
                                              min(map(sum, passes)), 2)
        entry["task_seconds_each_pass"].append([round(sum(x), 2) for x in passes])
        entry["peak_rss_bytes"] = max(entry["peak_rss_bytes"], *peaks)
        entry["added_rss_bytes"] = max(entry["added_rss_bytes"], *added)

    def report(self, args: argparse.Namespace) -> dict:
        print(f"{self.docs:>11,} docs:", flush=True)
        for kind, entry in self.stages.items():
            entry["seconds_per_mdoc"] = round(entry["task_seconds"] / self.docs * 1e6, 3)
            entry["rss_bytes_per_slice_doc"] = round(entry["added_rss_bytes"] /
                                                     entry["slice_docs"], 2)
            steps = f" in {entry['steps']} steps" if entry["steps"] > 1 else ""
            print(f"   {kind:<10} {entry['tasks']:>4} tasks{steps} {entry['task_seconds']:8.1f}s  "
                  f"peak RSS {entry['peak_rss_bytes'] / 2**30:5.2f} GiB (the task's own: "
                  f"{entry['added_rss_bytes'] / 2**20:6.0f} MiB, "
                  f"{entry['rss_bytes_per_slice_doc']:5.1f} B per document of its input)",
                  flush=True)
        result = {"docs": self.docs, "shards": self.shards, "partitions": self.partitions,
                  "stages": self.stages}
        if self.docs == args.check_docs:
            _, _, _, found = in_child(removal, str(self.work), self.shards, self.partitions)
            ref_s, ref_peak, _, expected = in_child(in_memory_removal, self.shards, self.docs)
            result["reference"] = {
                "identical": found == expected, "exact_removed": len(expected["exact"]),
                "near_removed": len(expected["near"]), "seconds": round(ref_s, 1),
                "peak_rss_bytes": ref_peak}
            print(f"   in-memory path: {ref_s:.0f}s, peak RSS {ref_peak / 2**30:.2f} GiB; removal "
                  f"set {'identical' if found == expected else 'DIFFERENT'} "
                  f"({len(expected['exact']):,} exact, {len(expected['near']):,} near)",
                  flush=True)
        shutil.rmtree(self.work, ignore_errors=True)
        return result


def measure(sizes: list[int], args: argparse.Namespace, root: Path) -> list[dict]:
    """Every size's stages in lockstep, and each pass over a stage's tasks taken for every size
    in turn, so that a spell of the machine's other work weighs on every size rather than on
    the one running then (measured one size after another, the same code gave ratios from
    1.01x to 1.26x in runs minutes apart). Within a pass the 1M tasks still take seconds and
    the 20M ones a minute, so noise is reduced, not removed."""
    every_size = [Size(docs, args, root) for docs in sizes]
    pending = list(every_size)
    while pending:
        turn = [(size, stage) for size in pending
                if (stage := next(size.order, None)) is not None]
        pending = [size for size, _ in turn]
        figures = {id(size): ([], [], []) for size, _ in turn}
        for _ in range(args.repeat):       # tasks rewrite their outputs whole: a rerun is the same
            for size, stage in turn:
                seconds, peaks, added = size.run_tasks(stage)
                passes, all_peaks, all_added = figures[id(size)]
                passes.append(seconds)
                all_peaks.extend(peaks)
                all_added.extend(added)
        for size, stage in turn:
            size.record(stage, *figures[id(size)])
    return [size.report(args) for size in every_size]


def growth(results: list[dict]) -> dict:
    """Per-document figures at the largest size over those at the smallest, per stage."""
    first, last = results[0], results[-1]

    def per_doc(result: dict, figure: str) -> float:
        return sum(s[figure] for s in result["stages"].values()) / result["docs"]

    total = {"seconds_per_doc": round(per_doc(last, "task_seconds") /
                                      per_doc(first, "task_seconds"), 3),
             "fastest_pass_seconds_per_doc": round(per_doc(last, "fastest_pass_seconds") /
                                                   per_doc(first, "fastest_pass_seconds"), 3)}
    first, last = first["stages"], last["stages"]
    return {"all stages": total} | {stage: {"seconds_per_doc": round(last[stage]["seconds_per_mdoc"] /
                                             first[stage]["seconds_per_mdoc"], 3),
                    "rss_per_slice_doc": round(last[stage]["rss_bytes_per_slice_doc"] /
                                               first[stage]["rss_bytes_per_slice_doc"], 3)}
            for stage in first}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, nargs="+", default=[1_000_000, 5_000_000, 20_000_000])
    parser.add_argument("--docs-per-shard", type=int, default=1_000_000)
    parser.add_argument("--docs-per-partition", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=3,
                        help="run each stage's tasks this many times; a task's seconds are its "
                             "fastest run (a 2-core machine's other work only ever adds time)")
    parser.add_argument("--check-docs", type=int, default=1_000_000,
                        help="size at which the removal set is compared with the in-memory path")
    parser.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temp)")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    args = parser.parse_args()

    # Loaded once here, as a long-lived worker process has them: the baseline every task starts
    # from, and no import time counted in a task's seconds.
    import numpy  # noqa: F401

    from crucible.trainer.corpus import pipeline  # noqa: F401
    root = args.work or Path(tempfile.mkdtemp(prefix="dedup-scale-"))
    results = measure(sorted(args.docs), args, root)
    summary = {"results": results}
    if len(results) > 1:
        summary["growth"] = growth(results)
        print("growth of per-document cost, largest size over smallest (goal: 0.8-1.2):")
        for stage, figures in summary["growth"].items():
            memory = figures.get("rss_per_slice_doc")
            passes = figures.get("fastest_pass_seconds_per_doc")
            print(f"   {stage:<9} time x{figures['seconds_per_doc']:.2f}"
                  + (f"   memory x{memory:.2f}" if memory is not None else "")
                  + (f"   (fastest whole passes: x{passes:.2f})" if passes is not None else ""))
    if args.out:
        args.out.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
