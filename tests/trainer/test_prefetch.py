"""The one-ahead prefetch hands out exactly the sampler's batches and never moves its position.

Unit tests on a small shard set, on the CPU (where the prefetch only reads; pinning and the
side-stream copy are CUDA's). The end-to-end check that a run stopped and resumed with the
prefetch on trains exactly as a straight run is `test_memory_checkpoint.py`'s resume test.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from crucible.api.batch_ramp import BatchRamp
from crucible.trainer.data import DataError, Sampler, ShardSet, write_shard
from crucible.trainer.prefetch import Prefetcher, following

ARGS = {"micro_batch": 2, "rank": 1, "world_size": 2}
ACCUM = 2
STEP = ACCUM * 2 * 2 * 16   # tokens a step: 2 micro-batches of 2 sequences of 16 on 2 ranks
FULL = BatchRamp(unit_tokens=STEP // ACCUM, full_units=ACCUM)   # no ramp


def _sampler(folder, tokens: int = 20_000) -> Sampler:
    folder.mkdir(parents=True, exist_ok=True)
    write_shard(folder / "a.bin", np.arange(tokens) % 1000, vocab_size=1000, num_docs=1,
                num_bytes=tokens, eot_id=0, tokenizer_hash="h")
    return Sampler(ShardSet(folder), seq_len=16, seed=7)


def _direct(sampler: Sampler, step: int, micro: int) -> list[np.ndarray]:
    return list(sampler.batch(step * STEP // 16, micro, global_batch=8, **ARGS))


def _same(got: tuple[torch.Tensor, torch.Tensor], want: list[np.ndarray]) -> bool:
    return all(np.array_equal(g.numpy(), w) for g, w in zip(got, want))


@pytest.fixture
def prefetch(tmp_path):
    batches = Prefetcher(_sampler(tmp_path), torch.device("cpu"), FULL, **ARGS)
    yield batches
    batches.close()


def test_next_batch_runs_through_micro_batches_then_steps():
    four = BatchRamp(unit_tokens=10, full_units=4)
    assert following(30, 0, four) == (30, 1)
    assert following(30, 3, four) == (70, 0)
    assert following(0, 0, BatchRamp(unit_tokens=10, full_units=1)) == (10, 0)
    # On a ramp from 1 to 4 micro-batches over 40 tokens: 1 micro-batch at first, then 2.
    ramp = BatchRamp(unit_tokens=10, full_units=4, start_tokens=10, ramp_tokens=40)
    assert following(0, 0, ramp) == (10, 0) and following(10, 0, ramp) == (20, 0)
    assert following(20, 0, ramp) == (20, 1) and following(20, 1, ramp) == (40, 0)


def test_prefetched_batches_are_the_samplers_own(prefetch):
    for step in range(3):
        for micro in range(ACCUM):
            got = prefetch.get(step * STEP, micro)
            assert got[0].shape == (2, 16) and got[0].dtype == torch.int64
            assert _same(got, _direct(prefetch.sampler, step, micro))


def test_on_a_ramp_each_step_reads_its_own_number_of_micro_batches(tmp_path):
    unit = STEP // ACCUM
    ramp = BatchRamp(unit_tokens=unit, full_units=4, start_tokens=unit, ramp_tokens=4 * unit)
    batches = Prefetcher(_sampler(tmp_path), torch.device("cpu"), ramp, **ARGS)
    try:
        tokens = 0
        for _ in range(6):
            m = ramp.micro_steps(tokens)
            for micro in range(m):
                want = batches.sampler.batch(tokens // 16, micro, global_batch=m * 2 * 2, **ARGS)
                assert _same(batches.get(tokens, micro), list(want))
            tokens += m * unit
    finally:
        batches.close()


def test_a_checkpoint_records_the_consumed_position_and_resumes_to_the_same_batches(
        prefetch, tmp_path):
    before = prefetch.sampler.state_dict()
    prefetch.get(4 * STEP, 1)  # step 5's first micro-batch is now being read ahead
    assert prefetch.sampler.state_dict() == before  # reading ahead moved nothing
    resumed = _sampler(tmp_path / "resumed")
    resumed.load_state_dict(prefetch.sampler.state_dict())
    again = Prefetcher(resumed, torch.device("cpu"), FULL, **ARGS)
    try:
        for step, micro in ((5, 0), (5, 1), (6, 0)):
            assert _same(again.get(step * STEP, micro),
                         [t.numpy() for t in prefetch.get(step * STEP, micro)])
    finally:
        again.close()


def test_a_batch_read_ahead_is_dropped_when_the_data_moves(prefetch):
    prefetch.get(2 * STEP, 1)  # reads (3, 0) ahead at the current offset
    prefetch.sampler.skip(24)  # a guard rollback skips the spike's data
    assert _same(prefetch.get(3 * STEP, 0), _direct(prefetch.sampler, 3, 0))
    # ... and a rollback to an earlier step asks for another key: read at once, not stale.
    assert _same(prefetch.get(1 * STEP, 0), _direct(prefetch.sampler, 1, 0))


def test_a_read_error_in_the_thread_surfaces_at_the_batch_that_needed_it(tmp_path):
    sampler = _sampler(tmp_path)
    batches = Prefetcher(sampler, torch.device("cpu"), FULL, **ARGS)

    def broken(*args, **kwargs):
        raise DataError("shard went away")

    try:
        batches.get(0, 0)  # (0, 1) is read ahead with the working sampler
        batches._pending[1].result()  # ... and has been read before the shards break
        sampler.shards.read = broken  # the shards every copy of the sampler reads from
        batches.get(0, 1)  # (0, 1) was read already; (1, 0) is read ahead and fails
        with pytest.raises(DataError, match="shard went away"):
            batches.get(STEP, 0)
    finally:
        batches.close()
