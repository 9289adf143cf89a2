"""A batch ramp end to end on CPU: 2 gloo ranks take the ramp's steps, and a restart mid-ramp
trains exactly as a run that never stopped.

The job: `tiny` (sequences of 128 tokens), micro-batches of 2 sequences on 2 ranks (512 tokens),
a global batch of 4096 (8 micro-batches a rank), ramped from 1024 tokens over the first 16,384:
2, 2, 2, 3, 3, 4, 5, 5, 6, then 8 micro-batches a rank, 17 steps for 12 full batches of tokens.
The schedule the runs must follow is `crucible.api.batch_ramp`'s, checked against a step-by-step
walk of the same rule in tests/api/test_batch_ramp.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from crucible.api.batch_ramp import BatchRamp, BatchSchedule
from tests.support.training import job_config, run_crucible, write_config
from tests.trainer.chaos import curve, stop_and_resume, train_records

BATCH, UNIT, START, RAMP, TOKENS = 4096, 2 * 2 * 128, 1024, 16384, 12 * 4096
STOP_AT = 6   # mid-ramp: the step after it is the first at 5 micro-batches a rank


def _config(corpus, tmp_path, name: str, micro_batch: int = 2):
    cfg = job_config(corpus, tmp_path / name, name=name, steps=TOKENS // BATCH,
                     batch_tokens=BATCH, microBatch=micro_batch, evalTokens=4096,
                     warmupSteps=3, batchRamp={"startTokens": START, "rampTokens": RAMP})
    cfg["checkpoint"] = {"uri": str(tmp_path / name / "ckpt"), "everySteps": 100,
                         "everyMinutes": 0}
    return write_config(cfg, tmp_path / f"{name}.yaml")


@pytest.fixture(scope="module")
def straight(corpus, tmp_path_factory):
    """The ramped job trained to its end on 2 ranks without stopping: its step records."""
    tmp = tmp_path_factory.mktemp("ramp")
    run = run_crucible("train", "--config", str(_config(corpus, tmp, "straight")), nproc=2)
    assert run.returncode == 0, run.stderr[-3000:]
    return {"records": train_records(tmp / "straight" / "metrics.jsonl"),
            "jsonl": tmp / "straight" / "metrics.jsonl", "log": run.stdout + run.stderr}


def test_two_ranks_take_the_ramps_steps_and_count_their_tokens(straight):
    schedule = BatchSchedule(BatchRamp.of(BATCH, UNIT, START, RAMP), TOKENS)
    records = straight["records"]
    assert schedule.total_steps == 17 and [r["step"] for r in records] == list(range(1, 18))
    tokens = [r["tokens"] for r in records]
    per_step = np.diff([0, *tokens]).tolist()
    micro = [n // UNIT for n in per_step]
    assert micro == [2, 2, 2, 3, 3, 4, 5, 5, 6] + [8] * 8, micro
    assert per_step == [schedule.at(s).tokens for s in range(17)]
    assert tokens[-1] == schedule.at(17).tokens_before >= TOKENS
    # Loss is the mean over the step's tokens whatever the accumulation: the first step, at 2
    # micro-batches of 8, is an untrained model's, about ln(vocabulary).
    assert abs(records[0]["loss"] - math.log(2048)) < 0.5, records[0]
    # The LR schedule counts steps: warmup is 3 of them, the decay ends at step 17.
    lrs = [r["lr"] for r in records]
    assert lrs[:3] == pytest.approx([1e-3, 2e-3, 3e-3]) and lrs[-1] < lrs[3]
    assert "batch ramp: 1024 tokens/step (2 accumulation) growing to 4096" in straight["log"]
    assert "17 steps" in straight["log"]


def test_a_restart_mid_ramp_trains_exactly_as_the_straight_run(straight, corpus, tmp_path):
    second = stop_and_resume(_config(corpus, tmp_path, "resumed"), tmp_path, STOP_AT)
    assert f"(step {STOP_AT}," in second, second[-3000:]
    resumed = train_records(tmp_path / "resumed" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == list(range(1, 18))
    assert [r["tokens"] for r in resumed] == [r["tokens"] for r in straight["records"]]
    # Bit for bit: the same data order, batch sizes, LR and optimizer state after the restart.
    assert curve(tmp_path / "resumed" / "metrics.jsonl") == curve(straight["jsonl"])


def test_one_rank_follows_the_two_rank_ramp(straight, corpus, tmp_path):
    """One rank with micro-batches of 4 has the same 512-token micro-step, so the same ramp and
    data per step: only float summation order differs (as in test_training.py)."""
    steps = 10
    cfg = _config(corpus, tmp_path, "one", micro_batch=4)
    run = run_crucible("train", "--config", str(cfg), "--max-steps", str(steps))
    assert run.returncode == 0, run.stderr[-3000:]
    one = train_records(tmp_path / "one" / "metrics.jsonl")
    two = straight["records"][:steps]
    assert [r["tokens"] for r in one] == [r["tokens"] for r in two]
    np.testing.assert_allclose([r["loss"] for r in one], [r["loss"] for r in two], rtol=0,
                               atol=2e-3)


def test_a_restart_with_coarser_micro_steps_mid_ramp_spreads_the_lr_schedule(straight, corpus,
                                                                              tmp_path):
    """Stopped at step 6 and resumed with micro-batches of 4: 1024-token micro-steps (as on 4
    ranks of 2) cut the rest of the ramp into 12 steps where 512-token ones made 11. The LR
    does not jump at the resume, keeps falling, and the run's last step is where the straight
    run's last one is on the schedule (the rest of it spread over the 12 steps)."""
    first = run_crucible("train", "--config", str(_config(corpus, tmp_path, "resized")),
                         "--max-steps", str(STOP_AT), nproc=2)
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_crucible("train", "--config",
                          str(_config(corpus, tmp_path, "resized", micro_batch=4)), nproc=2)
    assert second.returncode == 0, second.stderr[-3000:]
    log = second.stdout + second.stderr
    assert f"(step {STOP_AT}, saved by 2 ranks, now 2)" in log, log[-3000:]
    assert "steps at this size end at step 18, not 17" in log, log[-3000:]
    resumed = train_records(tmp_path / "resized" / "metrics.jsonl")
    straight_lr = [r["lr"] for r in straight["records"]]
    lrs = [r["lr"] for r in resumed]
    assert [r["step"] for r in resumed] == list(range(1, 19)) and resumed[-1]["tokens"] >= TOKENS
    assert lrs[:STOP_AT + 1] == pytest.approx(straight_lr[:STOP_AT + 1], rel=1e-12)
    assert all(a > b for a, b in zip(lrs[STOP_AT:], lrs[STOP_AT + 1:]))   # decaying
    assert lrs[-1] == pytest.approx(straight_lr[-1], rel=1e-12)
