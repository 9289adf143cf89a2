"""Running a corpus job: stages, tasks, shard files, completion markers and stats on storage.

Owns: the stage list (filter -> signatures -> exact -> buckets -> links -> components (in steps)
-> clusters -> dedup -> mix -> report), what each task reads and writes under the output folder,
skipping tasks whose completion marker exists (resume), barriers between stages (and between the
steps of a stage run in steps, whose count is known only as they finish) for N workers, and the
local runner (all tasks, a process pool).
Must not: contain rules (steps), dedup math (dedup, clusters) or rendering (report).

Follows datatrove's executor (src/datatrove/executor/base.py::_run_for_rank): a task writes its
outputs, then `stats/<stage>/<task>.json`, then its marker `done/<stage>/<task>` last, so a marker
means the outputs are whole and a rerun skips exactly the finished tasks. `run.json` pins the config
fingerprint and shard count: resuming under different ones would mix two corpora, so it is refused.

Layout under `output`:
    run.json                          config fingerprint, shard count, config
    filtered/shard-NNNNN.jsonl.zst    documents that passed the per-document steps
    dedup/...                         see dedup.py
    deduped/shard-NNNNN.jsonl.zst     after exact/near dedup and PII scrubbing
    mixed/shard-NNNNN.jsonl.zst       after the mixture (when configured)
    stats/<stage>/<task>.json         per-task step stats, merged by the report
    done/<stage>/<task>               completion markers
    report.json, report.html
"""

from __future__ import annotations

import contextlib
import json
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from typing import Callable, Iterable, Iterator

from crucible.trainer import storage
from crucible.trainer.corpus import dedup
from crucible.trainer.corpus.config import CorpusConfig, describe
from crucible.trainer.corpus.document import Document, Malformed
from crucible.trainer.corpus.mixture import copies, repeat_factors
from crucible.trainer.corpus.readers import Reader
from crucible.trainer.corpus.shards import Shard, files_of, list_inputs
from crucible.trainer.corpus.stats import StepStats, merge_step_lists
from crucible.trainer.corpus.step import run_steps


class RunMismatch(ValueError):
    """The output folder holds a run with another config or shard count."""


class BarrierTimeout(TimeoutError):
    """Other workers did not finish a stage before the deadline."""


@dataclass(frozen=True)
class Stage:
    name: str                # unique in a run: markers and stats go under it
    tasks: int               # how many tasks (shards, bands, or 1)
    body: Callable[..., None]  # (job, task), or (job, step, task) for a stage run in steps
    kind: str = ""           # what per-stage settings apply to: the name, or for one step of a
                             # stage run in steps, that stage's name
    # A stage run in steps: after each step's barrier, (job, step) -> whether it was the last.
    finished: Callable[["Job", int], bool] | None = None

    def __post_init__(self):
        if not self.kind:
            object.__setattr__(self, "kind", self.name)

    def step(self, number: int) -> "Stage":
        def body(job: "Job", task: int) -> None:
            self.body(job, number, task)
        return Stage(f"{self.name}.{number}", self.tasks, body, kind=self.name)


def shard_uri(output: str, folder: str, shard: int) -> str:
    return storage.join(output, folder, f"shard-{shard:05d}.jsonl.zst")


def write_docs(uri: str, docs: Iterable[Document]) -> int:
    import zstandard

    count = 0
    with storage.open_write(uri) as raw:
        with zstandard.ZstdCompressor(level=3).stream_writer(raw, closefd=False) as out:
            for doc in docs:
                out.write(json.dumps(doc.to_record(), ensure_ascii=False).encode() + b"\n")
                count += 1
    return count


def read_docs(uri: str) -> Iterator[Document]:
    import zstandard

    with contextlib.closing(storage.open_read(uri)) as raw:
        with zstandard.ZstdDecompressor().stream_reader(raw) as stream:
            for line in storage.buffered(stream):
                yield Document.from_record(json.loads(line))


def _progress(docs: Iterable, label: str, enabled: bool) -> Iterable:
    if not enabled:
        return docs
    from tqdm import tqdm

    return tqdm(docs, desc=label, unit="doc", mininterval=1.0, smoothing=0.1)


class Job:
    """One corpus run: its config, shard count and the stage bodies that read and write it."""

    def __init__(self, config: CorpusConfig, shard_count: int, progress: bool = False):
        self.config = config
        self.shard_count = shard_count
        self.progress = progress
        self.output = config.output
        self.dedup_on = config.dedup.on
        self.partitions = config.dedup.partitions_for(shard_count)
        # Digest families with a partitioned exact stage: content copies, then URL copies.
        self.families = [family for family, on in (("exact", config.dedup.exact),
                                                   ("url", config.dedup.url)) if on]
        self._files = None

    # ---- bookkeeping -------------------------------------------------------------------------
    def marker(self, stage: str, task: int) -> str:
        return storage.join(self.output, "done", stage, f"{task:05d}")

    def stats_uri(self, stage: str, task: int) -> str:
        return storage.join(self.output, "stats", stage, f"{task:05d}.json")

    def files(self):
        if self._files is None:
            self._files = list_inputs(self.config.sources)
        return self._files

    def check_run_file(self) -> None:
        """Write run.json, or refuse if it describes another run."""
        uri = storage.join(self.output, "run.json")
        mine = {"fingerprint": self.config.fingerprint(), "shards": self.shard_count}
        if storage.exists(uri):
            theirs = json.loads(storage.read_bytes(uri))
            if {k: theirs.get(k) for k in mine} != mine:
                raise RunMismatch(
                    f"{self.output} holds a run with fingerprint {theirs.get('fingerprint')} and "
                    f"{theirs.get('shards')} shards; this one is {mine['fingerprint']} with "
                    f"{self.shard_count}. Use a new output folder, or the same config and shards.")
            return
        storage.write_bytes(uri, json.dumps({**mine, "config": describe(self.config)},
                                            indent=1).encode())
        self._freeze_index_runs()

    # ---- the persistent exact-dedup index ----------------------------------------------------
    def _index_runs_uri(self) -> str:
        return storage.join(self.output, "dedup", "index-runs.json")

    def _freeze_index_runs(self) -> None:
        """Which committed earlier runs this run dedups against, fixed at its start: a resumed
        task must see the same set, even if another run commits in between."""
        index = self.config.dedup.index
        if index is None or storage.exists(self._index_runs_uri()):
            return
        mine = dedup.run_id(self.output, self.config.fingerprint())
        runs = [run for run in dedup.committed_runs(index) if run != mine]
        storage.write_bytes(self._index_runs_uri(), json.dumps(runs).encode())

    def index_runs(self) -> list[str]:
        if self.config.dedup.index is None:
            return []
        return json.loads(storage.read_bytes(self._index_runs_uri()))

    def _finish(self, stage: str, task: int, stats: list[StepStats]) -> None:
        storage.write_bytes(self.stats_uri(stage, task),
                            json.dumps([s.to_json() for s in stats]).encode())
        storage.write_bytes(self.marker(stage, task), b"")

    def merged_stats(self, stage: str, tasks: int) -> list[StepStats]:
        shards = [[StepStats.from_json(s) for s in json.loads(storage.read_bytes(
            self.stats_uri(stage, t)))] for t in range(tasks)]
        return merge_step_lists(shards)

    # ---- stages -----------------------------------------------------------------------------
    def stages(self) -> list[Stage]:
        n = self.shard_count
        dedup_config = self.config.dedup
        stages = [Stage("filter", n, Job.filter_task)]
        if self.dedup_on:
            stages.append(Stage("signatures", n, Job.signatures_task))
            if self.families:
                stages.append(Stage("exact", self.partitions * len(self.families), Job.exact_task))
            if dedup_config.near is not None:
                stages.append(Stage("buckets", dedup_config.near.bands * self.partitions,
                                    Job.buckets_task))
                stages.append(Stage("links", self.partitions, Job.links_task))
                stages.append(Stage("components", self.partitions, Job.components_task,
                                    finished=Job.components_converged))
                stages.append(Stage("clusters", self.partitions, Job.clusters_task))
        if self.dedup_on or self.config.pii is not None:
            stages.append(Stage("dedup", n, Job.dedup_task))
        if self.config.mixture is not None:
            stages.append(Stage("mix", n, Job.mix_task))
        stages.append(Stage("report", 1, Job.report_task))
        return stages

    def run_order(self) -> Iterator[Stage]:
        """The stages in order, a stage run in steps as one stage per step. Lazy: whether another
        step is needed is read from storage, so a caller finishes every task of a stage (its
        barrier) before asking for the next."""
        for stage in self.stages():
            if stage.finished is None:
                yield stage
                continue
            number = 0
            while True:
                yield stage.step(number)
                if stage.finished(self, number):
                    break
                number += 1

    def stage_named(self, name: str) -> Stage:
        """A stage of `run_order` by its name (`components.3`: step 3 of `components`)."""
        base, _, number = name.partition(".")
        stage = next(s for s in self.stages() if s.name == base)
        return stage.step(int(number)) if stage.finished is not None else stage

    def final_folder(self) -> str:
        if self.config.mixture is not None:
            return "mixed"
        return "deduped" if self.dedup_on or self.config.pii is not None else "filtered"

    def filter_task(self, shard: int) -> None:
        reader_for = {s.name: Reader(s.text_field, s.id_field, self.config.limits)
                      for s in self.config.sources}
        steps = self.config.build_steps()
        read_stats = StepStats(step="read", why="parse records; malformed ones are counted, not lost")
        stats = [read_stats] + [step.new_stats() for step in steps]

        def documents() -> Iterator[Document]:
            for file in files_of(self.files(), Shard(shard, self.shard_count)):
                for record in reader_for[file.source].read(file):
                    if isinstance(record, Malformed):
                        read_stats.record_in(record.source, record.size_bytes)
                        read_stats.record_drop(record.source, record.size_bytes, record.reason,
                                               record.key, record.id, record.raw)
                        if record.file_problem:
                            read_stats.record_problem_file(record.key, record.source, record.id,
                                                           record.reason, record.raw)
                        continue
                    size_bytes = record.size_bytes
                    read_stats.record_in(record.source, size_bytes)
                    read_stats.record_out(record.source, size_bytes)
                    yield record
            for reader in reader_for.values():   # how web pages' charsets were found
                for name, count in reader.counters.items():
                    read_stats.count(name, count)

        kept = run_steps(_progress(documents(), f"filter {shard}/{self.shard_count}",
                                   self.progress), steps, stats[1:],
                         self.config.limits.max_step_seconds)
        write_docs(shard_uri(self.output, "filtered", shard), kept)
        self._finish("filter", shard, stats)

    def signatures_task(self, shard: int) -> None:
        docs = read_docs(shard_uri(self.output, "filtered", shard))
        arrays = dedup.signatures(_progress(docs, f"signatures {shard}", self.progress),
                                  self.config.dedup.near, urls=self.config.dedup.url)
        dedup.write_signatures(self.output, shard, arrays, self.partitions, self.families)
        self._finish("signatures", shard, [])

    def exact_task(self, task: int) -> None:
        family, part = self.families[task // self.partitions], task % self.partitions
        index = self.config.dedup.index
        earlier = dedup.earlier_digests(index, self.index_runs(), family, self.partitions,
                                        part) if index else ()
        dedup.run_exact(self.output, family, part, self.shard_count, self.partitions, earlier)
        if index:
            dedup.publish_part(index, dedup.run_id(self.output, self.config.fingerprint()),
                               self.output, family, part, self.shard_count)
        self._finish("exact", task, [])

    def buckets_task(self, task: int) -> None:
        dedup.run_buckets(self.output, task // self.partitions, task % self.partitions,
                          self.shard_count, self.partitions)
        self._finish("buckets", task, [])

    def links_task(self, part: int) -> None:
        dedup.run_links(self.output, self.config.dedup.near.bands, self.partitions, part,
                        dedup.removed_in_partition(self.output, self.families, self.partitions,
                                                   part))
        self._finish("links", part, [])

    def components_task(self, step: int, part: int) -> None:
        removed = dedup.removed_in_partition(self.output, self.families, self.partitions,
                                             part) if step == 0 else None
        dedup.run_star_step(self.output, step, self.partitions, part, removed)
        self._finish(f"components.{step}", part, [])

    def components_converged(self, step: int) -> bool:
        return dedup.star_converged(self.output, step, self.partitions)

    def clusters_task(self, part: int) -> None:
        dedup.run_near_removal(self.output, self.partitions, part, self.shard_count)
        self._finish("clusters", part, [])

    def dedup_task(self, shard: int) -> None:
        dedup_config = self.config.dedup
        steps = []
        for family, step_type in (("exact", dedup.ExactDuplicate), ("url", dedup.UrlDuplicate)):
            if family in self.families:
                removed, earlier = dedup.exact_removal_of_shard(self.output, family,
                                                                self.partitions, shard)
                steps.append(step_type(removed=removed, earlier=earlier))
        if dedup_config.near is not None:
            steps.append(dedup.NearDuplicate(
                removed=dedup.near_removal_of_shard(self.output, self.partitions, shard),
                config=dedup_config.near))
        pii = self.config.build_pii()
        if pii is not None:
            steps.append(pii)
        stats = [step.new_stats() for step in steps]
        docs = read_docs(shard_uri(self.output, "filtered", shard))
        kept = run_steps(_progress(docs, f"dedup {shard}", self.progress), steps, stats,
                         self.config.limits.max_step_seconds)
        write_docs(shard_uri(self.output, "deduped", shard), kept)
        self._finish("dedup", shard, stats)

    def mix_task(self, shard: int) -> None:
        mixture = self.config.mixture
        before = "dedup" if self.dedup_on or self.config.pii is not None else "filter"
        last_step = self.merged_stats(before, self.shard_count)[-1]
        source_bytes = {name: c.bytes_out for name, c in last_step.sources.items()}
        factors = repeat_factors(source_bytes, mixture)
        stats = StepStats(step="mixture", why="sample sources to target weights (epochs per source)",
                          params={"weights": mixture.weights, "total_bytes": mixture.total_bytes,
                                  "seed": mixture.seed,
                                  "epochs": {s: round(f, 6) for s, f in factors.items()}})

        def emitted() -> Iterator[Document]:
            folder = "deduped" if before == "dedup" else "filtered"
            for doc in read_docs(shard_uri(self.output, folder, shard)):
                size_bytes = doc.size_bytes
                stats.record_in(doc.source, size_bytes)
                if doc.source not in factors:
                    stats.record_drop(doc.source, size_bytes, "source_not_in_mixture", doc.key,
                                      doc.id, doc.text)
                    continue
                n = copies(doc.key, factors[doc.source], mixture.seed)
                if n == 0:
                    stats.record_drop(doc.source, size_bytes, "downsampled", doc.key, doc.id,
                                      doc.text)
                    continue
                stats.record_out(doc.source, size_bytes, copies=n)
                if n > 1:   # the report's in - removed = out check adds these back
                    stats.count(f"extra_copies.{doc.source}", n - 1)
                for copy in range(n):
                    yield Document(doc.text, doc.id, doc.source, doc.key,
                                   {**doc.metadata, "copy": copy})

        write_docs(shard_uri(self.output, "mixed", shard), emitted())
        self._finish("mix", shard, [stats])

    def report_task(self, _task: int) -> None:
        from crucible.trainer.corpus.report import build_report, write_report

        if self.dedup_on:
            dedup.write_summary(self.output, self.partitions, self.families,
                                self.config.dedup.near)
        write_report(self.output, build_report(self))
        if self.config.dedup.index:   # every part is published: later runs may now see this one
            dedup.commit_run(self.config.dedup.index,
                             dedup.run_id(self.output, self.config.fingerprint()))
        storage.write_bytes(self.marker("report", 0), b"")


# ---- executors ------------------------------------------------------------------------------
def _run_task(config: CorpusConfig, shard_count: int, progress: bool, stage_name: str,
              task: int) -> float:
    job = Job(config, shard_count, progress)
    stage = job.stage_named(stage_name)
    started = time.perf_counter()
    stage.body(job, task)
    return time.perf_counter() - started


def run_local(config: CorpusConfig, shard_count: int, workers: int = 1,
              progress: bool = False) -> dict[str, float]:
    """Every task of every stage on this machine, `workers` processes at a time. Finished tasks
    (marker present) are skipped. Returns wall seconds per stage."""
    job = Job(config, shard_count, progress)
    job.check_run_file()
    wall_s: dict[str, float] = {}
    pool = ProcessPoolExecutor(workers, mp_context=get_context("fork")) if workers > 1 else None
    try:
        for stage in job.run_order():
            todo = [t for t in range(stage.tasks) if not storage.exists(job.marker(stage.name, t))]
            started = time.perf_counter()
            if pool is None:
                for task in todo:
                    _run_task(config, shard_count, progress, stage.name, task)
            else:
                for future in [pool.submit(_run_task, config, shard_count, progress, stage.name, t)
                               for t in todo]:
                    future.result()
            wall_s[stage.name] = time.perf_counter() - started
    finally:
        if pool is not None:
            pool.shutdown()
    return wall_s


def run_worker(config: CorpusConfig, worker: Shard, progress: bool = False,
               wait_timeout_s: float = 24 * 3600, poll_s: float = 5.0,
               clock: Callable[[], float] = time.monotonic,
               sleep: Callable[[float], None] = time.sleep,
               shard_count: int | None = None) -> None:
    """Worker `worker.index` of `worker.count` (an Indexed Job pod): run the tasks it owns in each
    stage (task t belongs to worker t mod N), then wait until every task of the stage is done.
    Restarted pods skip what they finished; a task done by a predecessor pod is not redone.
    `shard_count` (default: one shard per worker) may be a multiple of the workers: a pod that is
    lost mid-stage then redoes only the shard it was in, not its whole share of the corpus."""
    job = Job(config, shard_count or worker.count, progress)
    job.check_run_file()
    for stage in job.run_order():
        for task in range(stage.tasks):
            if task % worker.count == worker.index and \
                    not storage.exists(job.marker(stage.name, task)):
                stage.body(job, task)
        deadline = clock() + wait_timeout_s
        for task in range(stage.tasks):
            while not storage.exists(job.marker(stage.name, task)):
                if clock() > deadline:
                    raise BarrierTimeout(f"stage {stage.name}: task {task} not done after "
                                         f"{wait_timeout_s:.0f}s (worker {task % worker.count})")
                sleep(poll_s)
