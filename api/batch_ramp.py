"""The global batch of every step: constant, or ramped up over the first tokens of the run.

Owns one rule and its step table. GPT-3 (Brown et al. 2020, appendix B) "gradually increase[s]
the batch size linearly from a small value (32k tokens) to the full value over the first 4-12
billion tokens of training". Here the batch a step trains on is a function of the tokens trained
on before it, c:

    b(c) = startTokens + (globalBatchTokens - startTokens) x min(1, c / rampTokens)

taken in whole micro-batches per data-parallel rank: a step runs

    m(c) = clamp(floor(b(c) / u), 1, A)    micro-batches on every rank,

where u = microBatch x dataParallelRanks x seqLen is one micro-batch on every rank and
A = globalBatchTokens / u the accumulation steps of a full batch. So the batch never exceeds the
line, is full from the first step that starts at or past rampTokens, and (floor in integers) is
the same on every machine. Without a ramp m(c) = A.

Because m depends on c alone, the step table needs no loop over steps: m only grows, so the
steps fall into at most A runs of equal m, and within a run the tokens before step s are a
multiple of s. `BatchSchedule` holds those runs (O(A) to build, a bisection per lookup) from an
anchor (step, tokens): step 0 at a fresh start; a checkpoint's (step, tokens seen) on a resume,
so a run resumed on another number of ranks (another u) continues the ramp from the tokens it
has trained on.

Pure and torch-free: the trainer (loop, data order, resume), and the planner and reviewer all
use it. It must not read a spec: callers pass plain numbers.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class BatchRamp:
    """m(c): the micro-batches per data-parallel rank of a step that starts after `c` tokens."""

    unit_tokens: int          # u: one micro-batch on every data-parallel rank, in tokens
    full_units: int           # A: micro-batches per rank at the full global batch
    start_tokens: int = 0     # the batch at c = 0 (before rounding); unused without a ramp
    ramp_tokens: int = 0      # tokens over which the batch grows; 0: no ramp

    def __post_init__(self):
        if self.unit_tokens < 1 or self.full_units < 1 or self.ramp_tokens < 0:
            raise ValueError(f"a batch of {self.full_units} x {self.unit_tokens} tokens with a "
                             f"ramp over {self.ramp_tokens} tokens is not a batch schedule")

    @classmethod
    def of(cls, global_batch_tokens: int, unit_tokens: int, start_tokens: int | None = None,
           ramp_tokens: float = 0) -> "BatchRamp":
        """From the job's numbers (globalBatchTokens a multiple of `unit_tokens`); no ramp when
        `start_tokens` is None."""
        if start_tokens is None:
            return cls(unit_tokens, global_batch_tokens // unit_tokens)
        return cls(unit_tokens, global_batch_tokens // unit_tokens, start_tokens,
                   round(ramp_tokens))

    @property
    def full_tokens(self) -> int:
        return self.unit_tokens * self.full_units

    def micro_steps(self, tokens_before: int) -> int:
        """m(c), in integers: floor((S·R + (F − S)·c) / (R·u)) clamped to [1, A]."""
        if not self.ramp_tokens or tokens_before >= self.ramp_tokens:
            return self.full_units
        start, ramp = self.start_tokens, self.ramp_tokens
        units = (start * ramp + (self.full_tokens - start) * tokens_before) // (ramp * self.unit_tokens)
        return min(self.full_units, max(1, units))

    def counts(self, from_tokens: int = 0) -> range:
        """Every micro-batch count a step starting at or after `from_tokens` can have at this
        unit: from m(from_tokens) to the full batch. All of them, not only those a run that
        keeps this size takes: after an elastic resize mid-ramp the steps continue from the
        tokens trained on at the other size, which can fall where this size's steps never
        start, and m(c) takes every value in between as c grows."""
        return range(self.micro_steps(from_tokens), self.full_units + 1)

    def tokens_reaching(self, units: int) -> int:
        """The fewest tokens before a step at which m >= `units` (for units <= A on a ramp that
        starts below the full batch)."""
        start, ramp = self.start_tokens, self.ramp_tokens
        return max(0, _ceil_div(units * ramp * self.unit_tokens - start * ramp,
                                self.full_tokens - start))


@dataclass(frozen=True)
class StepBatch:
    """One step's batch: micro-batches per data-parallel rank, its tokens (all ranks), and the
    tokens trained on before it."""

    micro_steps: int
    tokens: int
    tokens_before: int


class BatchSchedule:
    """Every step's batch from an anchor (`step`, `tokens` trained on before it) on, and the
    step at which the tokens trained on reach `total_tokens` (`total_steps`)."""

    def __init__(self, ramp: BatchRamp, total_tokens: float, *, step: int = 0, tokens: int = 0):
        self.ramp, self.anchor = ramp, (step, tokens)
        # Runs of equal m: (first step, tokens before it, m). m grows from run to run (a step
        # may cross more than one threshold); the last run, at m = A, never ends.
        runs: list[tuple[int, int, int]] = []
        s, c = step, tokens
        while True:
            m = ramp.micro_steps(c)
            runs.append((s, c, m))
            if m == ramp.full_units:
                break
            # Steps at m until the tokens before one reach the next threshold: >= 1, as m(c) < m + 1.
            n = _ceil_div(ramp.tokens_reaching(m + 1) - c, m * ramp.unit_tokens)
            s, c = s + n, c + n * m * ramp.unit_tokens
        self._runs = runs
        self._firsts = [first for first, _, _ in runs]
        self.total_tokens = math.ceil(total_tokens)
        self.total_steps = self._step_reaching(self.total_tokens)

    @property
    def ramp_steps(self) -> int:
        """Steps from the anchor before the batch is full."""
        return self._firsts[-1] - self.anchor[0]

    def at(self, step: int) -> StepBatch:
        """Step `step`'s batch (0-based, at or after the anchor)."""
        if step < self.anchor[0]:
            raise ValueError(f"step {step} is before this schedule's first, {self.anchor[0]}")
        first, before, m = self._runs[bisect.bisect_right(self._firsts, step) - 1]
        per_step = m * self.ramp.unit_tokens
        return StepBatch(m, per_step, before + (step - first) * per_step)

    def _step_reaching(self, tokens: int) -> int:
        """The first step (at or after the anchor) before which `tokens` have been trained on."""
        for i, (first, before, m) in enumerate(self._runs):
            if tokens <= before:
                return first
            if i + 1 == len(self._runs) or tokens <= self._runs[i + 1][1]:
                return first + _ceil_div(tokens - before, m * self.ramp.unit_tokens)
        raise AssertionError("the last run never ends")
