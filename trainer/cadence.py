"""Work done beside training on a step schedule: garbage collection, profiler traces, CUDA
memory snapshots. The loop calls `Cadence.before(step)` and `Cadence.after(step)` around each
optimizer step (1-based, the step being computed) and `close()` at the end; which step does
what is decided by pure functions, so the schedule is tested without training.

Follows torchtitan: `tools/utils.py::GarbageCollection` (automatic collection off, a
generation-1 collection every `gc_freq` steps: collections then happen at the same step on every
rank instead of stalling one rank at a time), `tools/profiling.py` (`torch.profiler` with a
warm-up step, one Chrome trace per rank) and its memory snapshots
(`torch.cuda.memory._record_memory_history` from start-up, `_dump_snapshot` at a step). Must not
read the device outside the steps it was asked to trace or dump.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import Callable

import torch

from crucible.api.spec import ProfileSpec, TrainingSpec

# Allocations the memory history keeps (torchtitan's default): enough for a few steps of a
# large model; older entries are dropped first.
MEMORY_HISTORY_ENTRIES = 100_000


def gc_due(step: int, every: int) -> bool:
    """Whether the periodic collection runs after `step` (never when `every` is 0). Pure."""
    return every > 0 and step % every == 0


def profile_range(spec: ProfileSpec) -> tuple[int, int, int]:
    """(first step profiled, first step traced, last step traced). The profiler starts a step
    early to warm up (its start-up costs land in that step), except at step 1. Pure."""
    warmup_from = max(1, spec.start_step - 1)
    return warmup_from, spec.start_step, spec.start_step + spec.steps - 1


class GarbageCollection:
    """Python's automatic collection off; a generation-1 collection every `every` steps."""

    def __init__(self, every: int, log, collect: Callable[[int], int] = gc.collect):
        self.every, self.log, self.collect = every, log, collect
        self.was_enabled = gc.isenabled()
        if every:
            gc.disable()
            self.collect(1)

    def after(self, step: int) -> None:
        if gc_due(step, self.every):
            started = time.perf_counter()
            self.collect(1)
            self.log(f"gc: generation-1 collection after step {step} took "
                     f"{time.perf_counter() - started:.3f}s")

    def close(self) -> None:
        if self.every and self.was_enabled:
            gc.enable()


class Profiling:
    """torch.profiler over `spec`'s steps; each rank writes
    <out>/profile/step<first>-<last>/rank<r>.json (open it in Perfetto or chrome://tracing)."""

    def __init__(self, spec: ProfileSpec | None, out: Path, rank: int, device: torch.device, log):
        self.spec, self.rank, self.log = spec, rank, log
        self.activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            self.activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler: torch.profiler.profile | None = None
        if spec is not None:
            warmup_from, first, last = profile_range(spec)
            self.first_step, self.traced = warmup_from, f"{first}-{last}"
            self.folder = out / "profile" / f"step{self.traced}"
            self.schedule = torch.profiler.schedule(wait=0, warmup=first - warmup_from,
                                                    active=spec.steps, repeat=1)

    def before(self, step: int) -> None:
        if self.spec is None or step != self.first_step or self.profiler is not None:
            return
        self.profiler = torch.profiler.profile(activities=self.activities,
                                               schedule=self.schedule,
                                               on_trace_ready=self._write)
        self.profiler.start()

    def after(self, step: int) -> None:
        if self.profiler is not None:
            self.profiler.step()

    def _write(self, profiler: torch.profiler.profile) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"rank{self.rank}.json"
        profiler.export_chrome_trace(str(path))
        self.log(f"profile: trace of steps {self.traced} written to {path.parent}")
        self.spec = None  # one range per run: done

    def close(self) -> None:
        if self.profiler is not None:
            self.profiler.stop()  # the last active step exported already, or the run ended early
            self.profiler = None


class MemorySnapshot:
    """CUDA allocations recorded from start-up and dumped after `step` to
    <out>/memory_snapshot/rank<r>_step<step>.pickle (view it at pytorch.org/memory_viz)."""

    def __init__(self, step: int | None, out: Path, rank: int, device: torch.device, log):
        self.step, self.log = step, log
        self.path = out / "memory_snapshot" / f"rank{rank}_step{step}.pickle"
        if step is not None and device.type != "cuda":
            log(f"memory snapshot: training.memorySnapshotStep needs a CUDA device; this run is "
                f"on {device.type}, so nothing is recorded")
            self.step = None
        if self.step is not None:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)

    def after(self, step: int) -> None:
        if step != self.step:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(self.path))
        self.close()
        self.log(f"memory snapshot: after step {step} written to {self.path}")

    def close(self) -> None:
        if self.step is not None:
            torch.cuda.memory._record_memory_history(enabled=None)
            self.step = None


class Cadence:
    """The three, built from the training spec before the model (the memory history must see
    its allocations)."""

    def __init__(self, spec: TrainingSpec, out: Path, rank: int, device: torch.device, log):
        self.gc = GarbageCollection(spec.gc_every_steps, log)
        self.profiling = Profiling(spec.profile, out, rank, device, log)
        self.memory = MemorySnapshot(spec.memory_snapshot_step, out, rank, device, log)

    def before(self, step: int) -> None:
        self.profiling.before(step)

    def after(self, step: int) -> None:
        self.profiling.after(step)
        self.memory.after(step)
        self.gc.after(step)

    def close(self) -> None:
        self.profiling.close()
        self.memory.close()
        self.gc.close()
