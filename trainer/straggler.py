"""Straggler detection: a rank persistently slower than the others, from numbers the step
already exchanges.

In synchronous training every rank's step takes as long as the slowest rank's (the others wait
for it in the collectives), so step times say nothing about who is slow. The time a rank spends
on its own work does. MegaScale (Jiang et al., NSDI'24) finds stragglers from per-rank
compute-kernel times in the same spirit, and replaces their machines.

`SegmentTimer` measures that work without a sync of its own: on a GPU each micro-batch's forward
and backward and the optimizer step, by CUDA events on the compute stream (where a throttled
GPU's matmuls run) read after a later step's one host sync; on CPU the thread's CPU time over the
whole step, which a thread waiting in a collective does not use. Each rank puts its last time into its slot of a vector that rides in the
step's one all-reduce (`parallel.launch_sums`), so every rank holds every rank's time with no
collective added. `StragglerDetector` (pure; fed by rank 0) divides each rank's time by the
median of the other ranks', takes the median of that ratio over a window of steps (one noisy step
decides nothing), and reports a rank whose windowed ratio stays above `factor` for `patience`
steps in a row; it clears once the ratio is back half-way to 1.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class StragglerEvent:
    step: int
    rank: int
    ratio: float      # windowed local time / the other ranks' median
    flagged: bool     # True: became a straggler; False: recovered


class StragglerDetector:
    def __init__(self, world_size: int, *, factor: float = 1.2, window: int = 30,
                 patience: int = 10):
        if factor <= 1 or window < 1 or patience < 1:
            raise ValueError("straggler detection needs factor > 1, window >= 1, patience >= 1")
        self.world_size, self.factor, self.window, self.patience = (world_size, factor, window,
                                                                    patience)
        self.ratios: deque[np.ndarray] = deque(maxlen=window)
        self.over = np.zeros(world_size, dtype=int)   # consecutive steps above the factor
        self.flagged: set[int] = set()
        self.last_windowed = np.ones(world_size)

    def observe(self, step: int, seconds) -> list[StragglerEvent]:
        """Fold in one step's local work times (seconds, by rank); the events it causes."""
        busy = np.asarray(seconds, dtype=float)
        if self.world_size < 2 or busy.shape != (self.world_size,) or not np.all(busy > 0):
            return []  # one rank has nobody to be slower than; a missing time decides nothing
        self.ratios.append(busy / _median_of_others(busy))
        if len(self.ratios) < self.window:
            return []
        windowed = np.median(np.stack(self.ratios), axis=0)
        self.last_windowed = windowed
        above = windowed > self.factor
        self.over = np.where(above, self.over + 1, 0)
        events = []
        for rank in np.flatnonzero(self.over >= self.patience):
            if int(rank) in self.flagged:
                continue
            self.flagged.add(int(rank))
            events.append(StragglerEvent(step, int(rank), float(windowed[rank]), True))
        # Cleared only half-way back to 1 (1.1x for a factor of 1.2): a rank hovering at the
        # threshold is reported once, not once per wobble.
        for rank in sorted(self.flagged):
            if windowed[rank] < 1 + (self.factor - 1) / 2:
                self.flagged.discard(rank)
                events.append(StragglerEvent(step, rank, float(windowed[rank]), False))
        return events


def _median_of_others(values: np.ndarray) -> np.ndarray:
    """For each i, the median of `values` without values[i], from one sort: removing one element
    of a sorted list shifts each remaining position past it down by one."""
    order = np.sort(values)
    removed = np.searchsorted(order, values, side="left")  # a position holding values[i]
    m = len(values) - 1

    def at(k: int) -> np.ndarray:  # the k-th smallest of the others, for every i at once
        return order[np.where(k < removed, k, k + 1)]

    return at(m // 2) if m % 2 else 0.5 * (at(m // 2 - 1) + at(m // 2))


class SegmentTimer:
    """This rank's own work per step. On a GPU: the step's segments (each micro-batch's forward
    and backward, then the optimizer step), each by two CUDA events recorded on the compute
    stream, summed per step and read by `collect` once the step's last event has completed
    (`query`: no sync of its own; the loop reads a step's numbers while the next step runs, so
    the newest step may not have completed yet). FSDP's collectives run on side streams; the
    compute stream waits for an all-gather only when its prefetch is late, so the segments are
    mostly the rank's own kernels, which a throttled GPU slows. On CPU: the thread's CPU time
    from the start of forward/backward to the end of the optimizer step. A thread blocked in a
    gloo collective, or descheduled on a shared CPU, uses no CPU time, so what remains is the
    rank's own compute. `seconds` is the last complete time (None before one).

    `event` makes the timing events (CUDA's by default; a test gives its own)."""

    def __init__(self, device: torch.device, event=None):
        self.cuda = device.type == "cuda"
        self._event = event or (lambda: torch.cuda.Event(enable_timing=True))
        self._steps: deque[list[tuple]] = deque()  # finished steps' (start, end) event pairs
        self._open: list[tuple] | None = None      # the step being recorded
        self._started = 0.0
        self._excluded = 0.0
        self._last: float | None = None

    def start_step(self) -> None:
        """A step begins; one that began before and never stopped (its update was dropped)
        is forgotten."""
        if self.cuda:
            self._open = []
        else:
            self._started = time.thread_time()
            self._excluded = 0.0

    def exclude(self, seconds: float) -> None:
        """CPU time inside the step that is not its own work (the loop acting on the previous
        step's numbers: rank 0 alone writes the metrics, a save blocks): left out."""
        self._excluded += seconds

    def start_segment(self) -> None:
        """Own work begins on the compute stream (a micro-batch, the optimizer step)."""
        if self.cuda and self._open is not None:
            pair = (self._event(), self._event())
            pair[0].record()
            self._open.append(pair)

    def end_segment(self) -> None:
        if self.cuda and self._open:
            self._open[-1][1].record()

    def stop(self) -> None:
        """The step's own work is all queued (CUDA) or done (CPU)."""
        if not self.cuda:
            self._last = time.thread_time() - self._started - self._excluded
        elif self._open:
            self._steps.append(self._open)
            self._open = None

    def collect(self) -> None:
        """Sum the segments of the steps whose work has completed on the GPU (never waits;
        events complete in stream order, so the step's last end event is the one to ask)."""
        while self._steps and self._steps[0][-1][1].query():
            pairs = self._steps.popleft()
            self._last = sum(start.elapsed_time(end) for start, end in pairs) / 1000

    def seconds(self) -> float | None:
        return self._last
