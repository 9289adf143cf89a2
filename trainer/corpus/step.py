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

import contextlib
import dataclasses
import importlib.util
import logging
import signal
import threading
import time
from typing import Any, ClassVar, Iterable, Iterator

from crucible.trainer.corpus.document import Document
from crucible.trainer.corpus.stats import StepStats

FilterResult = bool | tuple[bool, str]

log = logging.getLogger(__name__)
_LOGGED: set[str] = set()   # steps whose first error was logged (one traceback each)


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


class RecordTimeout(BaseException):
    """A document took longer than the run's time limit in the steps.

    A BaseException, like KeyboardInterrupt, because extractors guard their fallbacks with
    `except Exception` (trafilatura's recall retry and justext rescue do): an Exception raised
    there would be swallowed and the extractor would go on, unbounded."""


# Once the limit has passed the alarm repeats at this interval until the step returns, so a
# bare `except:` that swallows one RecordTimeout meets the next one a moment later.
_REPEAT_S = 0.05


@contextlib.contextmanager
def _time_limit(seconds: float | None):
    """Raise RecordTimeout in this thread once `seconds` of wall time have passed.

    SIGALRM, the one way Python has to stop a call it cannot otherwise interrupt (datatrove
    bounds its extractors' time per document the same way): the handler runs at the next
    bytecode, so pure-C work (a parser call) ends first, then the document is dropped. A step
    that swallowed every alarm and returned anyway still raises here: its result came after the
    limit. Signals reach the main thread only; elsewhere (or with no limit) this does nothing."""
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return
    armed, fired = True, False

    def expired(signum, frame):
        nonlocal fired
        if armed:   # an alarm already on its way while the finally runs is ignored
            fired = True
            raise RecordTimeout

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds, _REPEAT_S)
    try:
        yield
    finally:
        # First, and with no call before it (CPython runs handlers at calls and loops), so no
        # alarm can cut the cleanup short and leave the repeating timer behind.
        armed = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    if fired:
        raise RecordTimeout


def run_steps(docs: Iterable[Document], steps: list[Step], stats: list[StepStats],
              time_limit_s: float | None = None) -> Iterator[Document]:
    """Pass each document through `steps` in order, counting into `stats` (one per step).

    One document cannot end the run: one that a step takes more than `time_limit_s` over is
    dropped as `<step>_timeout`, one that makes a step raise as `<step>_error` (the first
    traceback of each step logged), both counted like any reason.

    Invariant the report relies on: for every step and source, docs_in = docs_out + dropped.
    """
    clock = time.perf_counter
    for doc in docs:
        if _through(doc, doc.view().size_bytes, steps, stats, clock, time_limit_s):
            yield doc
    for step, step_stats in zip(steps, stats):
        for counter, n in step.counters.items():
            step_stats.count(counter, n)
        step.counters.clear()


def _through(doc: Document, size_bytes: int, steps: list[Step], stats: list[StepStats],
             clock, time_limit_s: float | None) -> bool:
    """One document through the steps; whether it is kept. The limit is armed around each
    step's own work only, so it never fires in the counting."""
    for step, step_stats in zip(steps, stats):
        step_stats.record_in(doc.source, size_bytes)
        started = clock()
        text_before = doc.text
        try:
            with _time_limit(time_limit_s):
                outcome = step.process(doc)
        except RecordTimeout:
            outcome = f"{step.name}_timeout"
        except Exception:   # noqa: BLE001 -- a hostile record or a step's bug: counted, not fatal
            if step.name not in _LOGGED:
                _LOGGED.add(step.name)
                log.exception("step %s raised on document %s (counted as %s_error; later "
                              "errors of this step are counted only)", step.name, doc.id,
                              step.name)
            outcome = f"{step.name}_error"
        step_stats.time_s += clock() - started
        if isinstance(outcome, str):
            step_stats.record_drop(doc.source, size_bytes, outcome, doc.key, doc.id, text_before)
            return False
        if doc.text is not text_before:
            size_bytes = doc.view().size_bytes
        step_stats.record_out(doc.source, size_bytes)
    return True


def _jsonable(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return repr(value)
