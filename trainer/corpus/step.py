"""What a corpus step is, and the one loop that runs steps over documents and counts everything.

Owns: `Step` (a named unit with parameters and a one-line why), its two kinds `Filter` (keeps or
drops a document, with a reason) and `Formatter` (rewrites the text), the dependency check at
construction, and `run_steps`, the loop that counts every document in, out and dropped by reason.
Must not: know any rule (the rule modules do) or touch files (pipeline does).

Follows datatrove's `PipelineStep` / `BaseFilter` split (src/datatrove/pipeline/base.py,
pipeline/filters/base_filter.py): a filter subclass writes only `filter(doc) -> True | (False,
reason)`, and the base counts total, forwarded and dropped per reason, so rule code stays pure and
each reason is testable on its own. Missing optional dependencies fail when a step is built, not
halfway through a shard.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import time
from typing import Any, ClassVar, Iterable, Iterator

from crucible.trainer.corpus.document import Document
from crucible.trainer.corpus.stats import StepStats

FilterResult = bool | tuple[bool, str]


class MissingDependency(RuntimeError):
    """A step needs a package that is not installed (raised when the step is built)."""


class Step:
    """A named unit of the pipeline. Subclasses are dataclasses whose fields are the parameters.

    `process` returns the (possibly rewritten) document to keep it, or a reason string to drop it.
    `counters` collects side counts a step wants in the report (e.g. C4's removed lines); the
    runner moves them into the step's stats.
    """

    name: ClassVar[str] = "step"
    why: ClassVar[str] = ""
    requires: ClassVar[tuple[str, ...]] = ()   # import names checked when the step is built

    def __post_init__(self) -> None:
        missing = [m for m in self.requires if importlib.util.find_spec(m) is None]
        if missing:
            raise MissingDependency(
                f"step {self.name!r} needs {', '.join(missing)}: "
                f"pip install 'crucible[trainer]'")
        self.counters: dict[str, int] = {}

    def count(self, counter: str, n: int = 1) -> None:
        self.counters[counter] = self.counters.get(counter, 0) + n

    def params(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # type: ignore[arg-type]

    def process(self, doc: Document) -> Document | str:
        raise NotImplementedError

    def new_stats(self) -> StepStats:
        return StepStats(step=self.name, why=self.why, params=_jsonable(self.params()))


class Filter(Step):
    """Keeps or drops whole documents. Subclasses write only `filter`."""

    def filter(self, doc: Document) -> FilterResult:
        raise NotImplementedError

    def process(self, doc: Document) -> Document | str:
        result = self.filter(doc)
        if result is True:
            return doc
        if isinstance(result, tuple) and not result[0]:
            return result[1]
        if result is False:
            return self.name
        raise TypeError(f"{self.name}.filter returned {result!r}; want True or (False, reason)")


class Formatter(Step):
    """Rewrites the text. A document whose text becomes blank is dropped as `empty_after_<name>`."""

    def format(self, text: str) -> str:
        raise NotImplementedError

    def process(self, doc: Document) -> Document | str:
        doc.text = self.format(doc.text)
        return doc if doc.text.strip() else f"empty_after_{self.name}"


def run_steps(docs: Iterable[Document], steps: list[Step],
              stats: list[StepStats]) -> Iterator[Document]:
    """Pass each document through `steps` in order, counting into `stats` (one per step).

    Invariant the report relies on: for every step and source, docs_in = docs_out + dropped.
    """
    clock = time.perf_counter
    for doc in docs:
        size_bytes = doc.view().size_bytes
        for step, step_stats in zip(steps, stats):
            step_stats.record_in(doc.source, size_bytes)
            started = clock()
            text_before = doc.text
            outcome = step.process(doc)
            step_stats.time_s += clock() - started
            if isinstance(outcome, str):
                step_stats.record_drop(doc.source, size_bytes, outcome, doc.key, doc.id,
                                       text_before)
                break
            if doc.text is not text_before:
                size_bytes = doc.view().size_bytes
            step_stats.record_out(doc.source, size_bytes)
        else:
            yield doc
    for step, step_stats in zip(steps, stats):
        for counter, n in step.counters.items():
            step_stats.count(counter, n)
        step.counters.clear()


def _jsonable(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return repr(value)
