"""The batch ramp's step table against a step-by-step walk of its rule, and the spec's checks."""

from __future__ import annotations

import time

import pytest
from pydantic import ValidationError

from crucible.api.batch_ramp import BatchRamp, BatchSchedule
from crucible.api.spec import TrainingSpec


def _walk(ramp: BatchRamp, total_tokens: int) -> list[tuple[int, int]]:
    """Every step's (micro-batches, tokens before it), one step at a time, until the tokens
    trained on reach `total_tokens`: the slow, obvious form of the schedule."""
    steps, tokens = [], 0
    while tokens < total_tokens:
        m = ramp.micro_steps(tokens)
        steps.append((m, tokens))
        tokens += m * ramp.unit_tokens
    return steps


def _line(ramp: BatchRamp, tokens_before: int) -> float:
    """b(c): the linear ramp, in tokens, before rounding."""
    share = min(1.0, tokens_before / ramp.ramp_tokens)
    return ramp.start_tokens + (ramp.full_tokens - ramp.start_tokens) * share


RAMPS = [
    # (unit tokens, full micro-batches, start tokens, ramp tokens, total tokens)
    (1024, 4, 1024, 20_000, 80 * 4096),      # the training test's: 1 -> 4 micro-batches
    (512, 16, 700, 100_000, 400_000),        # a start between micro-batches
    (256, 64, 1, 50_000, 50_000),            # from the least batch; ramp = the whole run
    (1000, 8, 7999, 10_000, 31_000),         # a start just below full
    (64, 32, 64, 10, 5_000),                 # a ramp shorter than one step: full at step 1
    (4096, 3, 4096, 1e6, 3_333_333),         # total not a multiple of anything
]


@pytest.mark.parametrize("unit, full, start, ramp_tokens, total", RAMPS)
def test_steps_follow_the_linear_ramp_in_whole_micro_batches(unit, full, start, ramp_tokens,
                                                             total):
    ramp = BatchRamp.of(unit * full, unit, start, ramp_tokens)
    walked = _walk(ramp, total)
    for m, before in walked:
        assert 1 <= m <= full
        # The most whole micro-batches the line allows (at least one): one more would cross it.
        assert m * unit <= max(unit, _line(ramp, before)) + 1e-6
        assert m == full or (m + 1) * unit > _line(ramp, before)
        # Full from the first step that starts at or past rampTokens, and not before.
        assert (m == full) == (before >= ramp.ramp_tokens)
    ms = [m for m, _ in walked]
    assert ms == sorted(ms)   # the batch never shrinks
    assert ms[0] == max(1, min(full, start // unit))


@pytest.mark.parametrize("unit, full, start, ramp_tokens, total", RAMPS)
def test_the_table_is_the_walk_and_its_tokens_add_up(unit, full, start, ramp_tokens, total):
    ramp = BatchRamp.of(unit * full, unit, start, ramp_tokens)
    schedule = BatchSchedule(ramp, total)
    walked = _walk(ramp, total)
    assert schedule.total_steps == len(walked)
    for step, (m, before) in enumerate(walked):
        got = schedule.at(step)
        assert (got.micro_steps, got.tokens, got.tokens_before) == (m, m * unit, before)
        # step -> consumed is consistent: each step starts where the last one ended.
        if step:
            previous = schedule.at(step - 1)
            assert got.tokens_before == previous.tokens_before + previous.tokens
    # The steps' tokens sum to what the run trains on: `total` reached by the last step, not
    # by the one before (the last step is whole, as without a ramp).
    end = schedule.at(schedule.total_steps)
    assert end.tokens_before == sum(m * unit for m, _ in walked)
    assert end.tokens_before >= total > end.tokens_before - schedule.at(len(walked) - 1).tokens
    assert schedule.ramp_steps == next(i for i, (m, _) in enumerate(walked + [(full, 0)])
                                       if m == full)


def test_tokens_sum_exactly_to_a_budget_the_steps_fill():
    ramp = BatchRamp.of(4096, 1024, 1024, 20_000)
    total = BatchSchedule(ramp, 1e6).at(50).tokens_before   # a budget that ends on a step
    schedule = BatchSchedule(ramp, total)
    assert schedule.total_steps == 50
    assert sum(schedule.at(s).tokens for s in range(50)) == total


def test_without_a_ramp_it_is_the_constant_batch():
    ramp = BatchRamp.of(4096, 1024)
    schedule = BatchSchedule(ramp, 10 * 4096 + 1)
    assert schedule.total_steps == 11 and schedule.ramp_steps == 0
    assert schedule.at(7) == schedule.at(7).__class__(4, 4096, 7 * 4096)


def test_from_an_anchor_it_continues_the_same_schedule():
    """A resume at (step, tokens seen) of the same run lands on the same steps."""
    ramp = BatchRamp.of(512 * 16, 512, 700, 100_000)
    whole = BatchSchedule(ramp, 400_000)
    for anchor in (0, 1, 5, whole.ramp_steps - 1, whole.ramp_steps, whole.ramp_steps + 3):
        resumed = BatchSchedule(ramp, 400_000, step=anchor,
                                tokens=whole.at(anchor).tokens_before)
        assert resumed.total_steps == whole.total_steps
        assert all(resumed.at(s) == whole.at(s) for s in range(anchor, whole.total_steps + 2))
    with pytest.raises(ValueError, match="before this schedule's first"):
        BatchSchedule(ramp, 400_000, step=5, tokens=whole.at(5).tokens_before).at(4)


def test_a_million_steps_in_is_a_lookup_not_a_walk():
    # A GPT-3-sized ramp: 32k tokens to 3.1M over 12B, micro-batches of 4 x 2048 on 64 ranks.
    ramp = BatchRamp.of(6 * 524_288, 4 * 2048 * 64, 32_768, 12e9)
    started = time.perf_counter()
    schedule = BatchSchedule(ramp, 300e9 * 10)
    far = schedule.at(1_000_000)
    elapsed = time.perf_counter() - started
    assert elapsed < 0.05, elapsed
    past_ramp = schedule.at(schedule.ramp_steps)
    assert far.micro_steps == ramp.full_units and past_ramp.micro_steps == ramp.full_units
    assert far.tokens_before == (past_ramp.tokens_before
                                 + (1_000_000 - schedule.ramp_steps) * ramp.full_tokens)
    assert schedule.at(schedule.ramp_steps - 1).micro_steps < ramp.full_units
    started = time.perf_counter()
    for step in range(0, 10**9, 10**6):
        schedule.at(step)
    assert time.perf_counter() - started < 0.5


def _training(**kw) -> TrainingSpec:
    return TrainingSpec.model_validate({"tokens": 1e6, "globalBatchTokens": 4096, **kw})


def test_the_spec_takes_a_ramp_below_the_batch_and_within_the_run():
    spec = _training(batchRamp={"startTokens": 1024, "rampTokens": 1e5})
    assert spec.batch_ramp.start_tokens == 1024 and spec.batch_ramp.ramp_tokens == 1e5
    assert _training(batchRamp={"startTokens": 4095, "rampTokens": 1e6}).batch_ramp


@pytest.mark.parametrize("ramp, words", [
    ({"startTokens": 4096, "rampTokens": 1e5}, "startTokens must be below"),
    ({"startTokens": 8192, "rampTokens": 1e5}, "startTokens must be below"),
    ({"startTokens": 1024, "rampTokens": 2e6}, "rampTokens must not exceed training.tokens"),
])
def test_the_spec_refuses_a_ramp_that_does_not_ramp_up_within_the_run(ramp, words):
    with pytest.raises(ValidationError, match=words):
        _training(batchRamp=ramp)


@pytest.mark.parametrize("start, ramp, unit", [(1024, 16384, 512), (1024, 1024, 256),
                                               (256, 4096, 256), (1024, 16384, 1024)])
def test_the_counts_hold_every_step_from_anywhere_on_the_ramp(start, ramp, unit):
    """What a run keeping this size takes, and what one resized mid-ramp takes from the tokens
    trained on at the other size (steps starting where this size's never start)."""
    r = BatchRamp.of(4096 if unit != 256 else 1536, unit, start, ramp)
    schedule = BatchSchedule(r, 10**6)
    assert {schedule.at(s).micro_steps for s in range(schedule.total_steps)} <= set(r.counts())
    for tokens in range(0, ramp + unit, 96):   # 96: off this unit's multiples
        rest = BatchSchedule(r, 10**6, step=0, tokens=tokens)
        taken = {rest.at(s).micro_steps for s in range(rest.total_steps)}
        assert taken <= set(r.counts(tokens)) <= set(r.counts()), tokens
    assert list(r.counts()) == list(range(r.micro_steps(0), r.full_units + 1))
