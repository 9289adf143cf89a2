"""The one-ahead prefetch hands out exactly the sampler's batches and never moves its position.

Unit tests on a small shard set, on the CPU (where the prefetch only reads; pinning and the
side-stream copy are CUDA's). The end-to-end check that a run stopped and resumed with the
prefetch on trains exactly as a straight run is `test_memory_checkpoint.py`'s resume test.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from crucible.trainer.data import DataError, Sampler, ShardSet, write_shard
from crucible.trainer.prefetch import Prefetcher, following

ARGS = {"global_batch": 8, "micro_batch": 2, "rank": 1, "world_size": 2}  # 2 micro-batches
ACCUM = 2


def _sampler(folder, tokens: int = 20_000) -> Sampler:
    folder.mkdir(parents=True, exist_ok=True)
    write_shard(folder / "a.bin", np.arange(tokens) % 1000, vocab_size=1000, num_docs=1,
                num_bytes=tokens, eot_id=0, tokenizer_hash="h")
    return Sampler(ShardSet(folder), seq_len=16, seed=7)


def _direct(sampler: Sampler, step: int, micro: int) -> list[np.ndarray]:
    return list(sampler.batch(step, micro, **ARGS))


def _same(got: tuple[torch.Tensor, torch.Tensor], want: list[np.ndarray]) -> bool:
    return all(np.array_equal(g.numpy(), w) for g, w in zip(got, want))


@pytest.fixture
def prefetch(tmp_path):
    batches = Prefetcher(_sampler(tmp_path), torch.device("cpu"), ACCUM, **ARGS)
    yield batches
    batches.close()


def test_next_batch_runs_through_micro_batches_then_steps():
    assert following(3, 0, 4) == (3, 1)
    assert following(3, 3, 4) == (4, 0)
    assert following(0, 0, 1) == (1, 0)


def test_prefetched_batches_are_the_samplers_own(prefetch):
    for step in range(3):
        for micro in range(ACCUM):
            got = prefetch.get(step, micro)
            assert got[0].shape == (2, 16) and got[0].dtype == torch.int64
            assert _same(got, _direct(prefetch.sampler, step, micro))


def test_a_checkpoint_records_the_consumed_position_and_resumes_to_the_same_batches(
        prefetch, tmp_path):
    before = prefetch.sampler.state_dict()
    prefetch.get(4, 1)  # step 5's first micro-batch is now being read ahead
    assert prefetch.sampler.state_dict() == before  # reading ahead moved nothing
    resumed = _sampler(tmp_path / "resumed")
    resumed.load_state_dict(prefetch.sampler.state_dict())
    again = Prefetcher(resumed, torch.device("cpu"), ACCUM, **ARGS)
    try:
        for key in ((5, 0), (5, 1), (6, 0)):
            assert _same(again.get(*key), [t.numpy() for t in prefetch.get(*key)])
    finally:
        again.close()


def test_a_batch_read_ahead_is_dropped_when_the_data_moves(prefetch):
    prefetch.get(2, 1)  # reads (3, 0) ahead at the current offset
    prefetch.sampler.skip(24)  # a guard rollback skips the spike's data
    assert _same(prefetch.get(3, 0), _direct(prefetch.sampler, 3, 0))
    # ... and a rollback to an earlier step asks for another key: read at once, not stale.
    assert _same(prefetch.get(1, 0), _direct(prefetch.sampler, 1, 0))


def test_a_read_error_in_the_thread_surfaces_at_the_batch_that_needed_it(tmp_path):
    sampler = _sampler(tmp_path)
    batches = Prefetcher(sampler, torch.device("cpu"), ACCUM, **ARGS)

    def broken(*args, **kwargs):
        raise DataError("shard went away")

    try:
        batches.get(0, 0)  # (0, 1) is read ahead with the working sampler
        batches._pending[1].result()  # ... and has been read before the shards break
        sampler.shards.read = broken  # the shards every copy of the sampler reads from
        batches.get(0, 1)  # (0, 1) was read already; (1, 0) is read ahead and fails
        with pytest.raises(DataError, match="shard went away"):
            batches.get(1, 0)
    finally:
        batches.close()
