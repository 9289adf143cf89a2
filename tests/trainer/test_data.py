"""Shard format, shard-set checks, and the sampler's determinism across world sizes."""

from __future__ import annotations

import numpy as np
import pytest

from crucible.trainer.data import (DataError, Sampler, ShardSet, feistel_permute, read_header,
                                   write_shard)


def _write(folder, name, tokens, *, vocab=1000, tok_hash="abc"):
    folder.mkdir(parents=True, exist_ok=True)
    return write_shard(folder / name, np.asarray(tokens), vocab_size=vocab, num_docs=1,
                       num_bytes=4 * len(tokens), eot_id=0, tokenizer_hash=tok_hash)


def test_round_trip_and_header(tmp_path):
    tokens = np.arange(5000) % 1000
    _write(tmp_path, "a.bin", tokens)
    header = read_header(tmp_path / "a.bin")
    assert (header.dtype, header.num_tokens, header.vocab_size) == ("uint16", 5000, 1000)
    shards = ShardSet(tmp_path)
    assert np.array_equal(shards.read(0, 5000), tokens)
    assert shards.bytes_per_token == 4.0


def test_large_vocab_uses_uint32(tmp_path):
    _write(tmp_path, "a.bin", [0, 70000, 99999], vocab=100000)
    assert read_header(tmp_path / "a.bin").dtype == "uint32"
    assert ShardSet(tmp_path).read(0, 3).tolist() == [0, 70000, 99999]


def test_reads_span_shard_boundaries(tmp_path):
    _write(tmp_path, "0.bin", [1, 2, 3])
    _write(tmp_path, "1.bin", [4, 5])
    _write(tmp_path, "2.bin", [6, 7, 8, 9])
    assert ShardSet(tmp_path).read(2, 6).tolist() == [3, 4, 5, 6, 7, 8]


def test_out_of_range_token_is_refused(tmp_path):
    with pytest.raises(DataError, match=r"token ids must be in \[0, 1000\)"):
        _write(tmp_path, "a.bin", [5, 1000])


def test_bad_magic_truncation_and_missing_folder_are_clear(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "junk.bin").write_bytes(b"not a shard at all")
    with pytest.raises(DataError, match="not a Crucible token shard"):
        ShardSet(tmp_path / "x")
    _write(tmp_path / "y", "a.bin", range(100))
    path = tmp_path / "y" / "a.bin"
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(DataError, match="truncated"):
        ShardSet(tmp_path / "y")
    with pytest.raises(DataError, match="does not exist"):
        ShardSet(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no \\*.bin shards"):
        ShardSet(tmp_path / "empty")


def test_mixed_tokenizers_and_vocab_mismatch_are_refused(tmp_path):
    _write(tmp_path / "m", "a.bin", range(10), tok_hash="aaa")
    _write(tmp_path / "m", "b.bin", range(10), tok_hash="bbb")
    with pytest.raises(DataError, match="different tokenizer"):
        ShardSet(tmp_path / "m")
    _write(tmp_path / "v", "a.bin", range(10), vocab=5000, tok_hash="aaa")
    shards = ShardSet(tmp_path / "v")
    with pytest.raises(DataError, match="model.vocabSize is 4096"):
        shards.check_compatible(4096)
    with pytest.raises(DataError, match="re-encode the corpus"):
        shards.check_compatible(8192, tokenizer_hash="ccc")
    shards.check_compatible(8192, tokenizer_hash="aaa")


@pytest.mark.parametrize("n", [1, 2, 3, 17, 1000, 4097, 65536])
def test_feistel_is_a_permutation(n):
    out = feistel_permute(np.arange(n), n, key=42)
    assert sorted(out.tolist()) == list(range(n))
    if n > 16:
        assert not np.array_equal(out, np.arange(n))  # it does shuffle
        assert not np.array_equal(out, feistel_permute(np.arange(n), n, key=43))


def _sampler(tmp_path, **kw) -> Sampler:
    _write(tmp_path, "a.bin", np.arange(20_000) % 1000)
    return Sampler(ShardSet(tmp_path), seq_len=16, seed=7, **kw)


def test_a_step_sees_the_same_data_at_any_world_size(tmp_path):
    s = _sampler(tmp_path)
    global_batch = 8
    one = s.batch(3 * 8, 0, global_batch=8, micro_batch=8, rank=0, world_size=1)[0]
    two = np.concatenate([s.batch(3 * 8, m, global_batch=global_batch, micro_batch=2, rank=r,
                                  world_size=2)[0] for r in range(2) for m in range(2)])
    assert np.array_equal(one, two)
    x, y = s.batch(0, 0, global_batch=8, micro_batch=4, rank=0, world_size=2)
    assert x.shape == (4, 16) and np.array_equal(x[:, 1:], y[:, :-1])  # targets are shifted inputs


def test_sampler_state_round_trips_and_skip_moves_past_data(tmp_path):
    s = _sampler(tmp_path)
    before = s.batch(5 * 4, 0, global_batch=4, micro_batch=4, rank=0, world_size=1)[0]
    s.skip(4)
    after_skip = s.batch(4 * 4, 0, global_batch=4, micro_batch=4, rank=0, world_size=1)[0]
    assert np.array_equal(before, after_skip)  # step 4 after skipping one batch = old step 5
    restored = _sampler(tmp_path / "again")
    restored.load_state_dict(s.state_dict())
    assert restored.sample_offset == 4
    assert np.array_equal(restored.batch(4 * 4, 0, global_batch=4, micro_batch=4, rank=0,
                                         world_size=1)[0], after_skip)


def test_resume_refuses_another_shard_set_naming_both_sizes(tmp_path):
    from crucible.trainer.restore import TrainState, plan_resume

    saved = _sampler(tmp_path / "a").state_dict()
    other = _sampler(tmp_path / "b")
    other.load_state_dict(saved)
    assert other.restored_num_tokens == 20_000
    args = dict(saved_batch_tokens=4096, batch_tokens=4096, seq_len=16, sample_offset=0,
                total_tokens=20 * 4096, accept_batch=False)
    state = TrainState(step=8, tokens_seen=8 * 4096)
    same = plan_resume(state, saved_data_tokens=20_000, data_tokens=20_000, accept_data=False,
                       **args)
    assert same.problem is None and same.sample_offset == 0 and same.total_steps == 20
    refused = plan_resume(state, saved_data_tokens=20_000, data_tokens=30_000, accept_data=False,
                          **args)
    assert "hold 30,000 tokens" in refused.problem and "shard set of 20,000" in refused.problem
    assert "checkpoint.acceptChangedData" in refused.problem
    # Accepted: step 8 reads sample 0 of the new shards' order.
    accepted = plan_resume(state, saved_data_tokens=20_000, data_tokens=30_000,
                           accept_data=True, **args)
    assert accepted.problem is None and 8 * 4096 // 16 + accepted.sample_offset == 0
    assert "accepted" in accepted.notes[0]


def test_resume_with_another_global_batch_is_refused_or_continues_at_the_next_unseen_sample(
        tmp_path):
    from crucible.trainer.restore import TrainState, plan_resume

    args = dict(seq_len=16, saved_data_tokens=None, data_tokens=20_000, total_tokens=20 * 64,
                accept_data=False)
    state = TrainState(step=8, tokens_seen=8 * 64)   # 8 steps of 4 sequences of 16 tokens
    fresh = plan_resume(TrainState(), saved_batch_tokens=None, batch_tokens=128, sample_offset=0,
                        accept_batch=False, **args)
    assert fresh.problem is None and fresh.total_steps == 10  # a fresh start: nothing to check
    refused = plan_resume(state, saved_batch_tokens=64, batch_tokens=128, sample_offset=0,
                          accept_batch=False, **args)
    assert "globalBatchTokens is 128" in refused.problem and "trained with 64" in refused.problem
    assert "checkpoint.acceptChangedBatch" in refused.problem
    # An old manifest without the batch: the state's tokens per step stand in for it.
    legacy = plan_resume(state, saved_batch_tokens=None, batch_tokens=128, sample_offset=0,
                         accept_batch=False, **args)
    assert "trained with 64" in legacy.problem
    # Accepted, from a sampler that had also skipped 3 samples (a rollback): the next step reads
    # exactly the samples a run that kept the old batch would have read next, and onwards.
    old = _sampler(tmp_path / "old")
    old.skip(3)
    resumed = plan_resume(state, saved_batch_tokens=64, batch_tokens=128, sample_offset=3,
                          accept_batch=True, **args)
    assert resumed.problem is None
    new = _sampler(tmp_path / "new")
    new.sample_offset = resumed.sample_offset
    kept = np.concatenate([old.batch(s * 4, 0, global_batch=4, micro_batch=4, rank=0,
                                     world_size=1)[0] for s in (8, 9)])
    doubled = new.batch(state.tokens_seen // 16, 0, global_batch=8, micro_batch=8, rank=0,
                        world_size=1)[0]
    assert np.array_equal(doubled, kept)
    # The tokens left (20 x 64 - 8 x 64) at 128 a step: 6 more steps.
    assert resumed.total_steps == 8 + 6
    # A checkpoint that already went through a change records its batch: no average is used.
    again = plan_resume(TrainState(step=10, tokens_seen=8 * 64 + 2 * 128),
                        saved_batch_tokens=128, batch_tokens=128, sample_offset=0,
                        accept_batch=False, **args)
    assert again.problem is None and again.total_steps == 10 + 4  # (1280 - 768) / 128


def test_epochs_cover_every_window_once(tmp_path):
    s = _sampler(tmp_path)
    n = s.windows_per_epoch
    starts = s.window_starts(np.arange(n))
    assert sorted((starts // 16).tolist()) == list(range(n))
    second = s.window_starts(np.arange(n, 2 * n))
    assert not np.array_equal(starts, second)  # each epoch is shuffled differently


def test_resume_with_another_batch_ramp_is_refused_or_continues_from_the_tokens_seen():
    from crucible.api.batch_ramp import BatchRamp, BatchSchedule
    from crucible.trainer.restore import TrainState, plan_resume

    ramp_spec = {"startTokens": 64, "rampTokens": 2048.0}
    ramp = BatchRamp.of(256, 64, 64, 2048)   # 1 -> 4 micro-batches of 4 sequences of 16
    schedule = BatchSchedule(ramp, 100 * 256)
    state = TrainState(step=10, tokens_seen=schedule.at(10).tokens_before)
    args = dict(saved_batch_tokens=256, batch_tokens=256, seq_len=16, saved_data_tokens=None,
                data_tokens=20_000, sample_offset=5, total_tokens=100 * 256, accept_data=False,
                saved_offset_from="tokens")
    same = plan_resume(state, saved_ramp=ramp_spec, ramp_spec=ramp_spec, ramp=ramp,
                       accept_batch=False, **args)
    # The same ramp: the schedule of the run that never stopped, the offset untouched.
    assert same.problem is None and same.notes == ()
    assert same.total_steps == schedule.total_steps and same.sample_offset == 5
    for saved, now in ((None, ramp_spec), (ramp_spec, None),
                       (ramp_spec, {"startTokens": 128, "rampTokens": 2048.0})):
        refused = plan_resume(state, saved_ramp=saved, ramp_spec=now, ramp=ramp,
                              accept_batch=False, **args)
        assert "training.batchRamp is" in refused.problem, refused
        assert "checkpoint.acceptChangedBatch" in refused.problem
    # Accepted, the ramp dropped: the tokens left at the full batch, the next unseen sample.
    dropped = plan_resume(state, saved_ramp=ramp_spec, ramp_spec=None,
                          ramp=BatchRamp.of(256, 64), accept_batch=True, **args)
    assert dropped.problem is None and "batch ramp" in dropped.notes[0]
    assert dropped.sample_offset == 5
    left = 100 * 256 - state.tokens_seen
    assert dropped.total_steps == 10 + -(-left // 256)


def test_an_offset_saved_before_tokens_addressing_moves_onto_the_tokens_seen(tmp_path):
    """A checkpoint that went through an accepted batch change recorded an offset counted from
    step x its batch; read from tokens seen it lands on the same next sample."""
    from crucible.trainer.restore import TrainState, plan_resume

    # 8 steps of 64 tokens, then 2 of 128 after an accepted change that moved the offset by
    # 8 x (4 - 8) samples: the next sample was 10 x 8 - 32 = 48, the 48 trained on.
    state = TrainState(step=10, tokens_seen=8 * 64 + 2 * 128)
    args = dict(saved_batch_tokens=128, batch_tokens=128, seq_len=16, saved_data_tokens=None,
                data_tokens=20_000, total_tokens=20 * 128, accept_batch=False,
                accept_data=False)
    old = plan_resume(state, sample_offset=-32, **args)
    assert old.problem is None and state.tokens_seen // 16 + old.sample_offset == 48
    new = plan_resume(state, sample_offset=0, saved_offset_from="tokens", **args)
    assert new.sample_offset == 0


def test_a_resume_on_another_ramp_cut_spreads_the_rest_of_the_lr_schedule_over_its_steps():
    from crucible.api.batch_ramp import BatchRamp, BatchSchedule
    from crucible.trainer.optim import LRClock
    from crucible.trainer.restore import TrainState, plan_resume

    # A ramp from 256 to 1024 tokens over 4096, 8192 tokens in all: at 256 tokens a micro-step
    # (one rank's rounding) 15 steps; from step 4 at 512 (two ranks') 14.
    ramp_spec = {"startTokens": 256, "rampTokens": 4096}
    fine, coarse = BatchRamp.of(1024, 256, 256, 4096), BatchRamp.of(1024, 512, 256, 4096)
    assert BatchSchedule(fine, 8192).total_steps == 15
    state = TrainState(step=4, tokens_seen=4 * 256)
    args = dict(saved_batch_tokens=1024, batch_tokens=1024, seq_len=16, saved_data_tokens=None,
                data_tokens=10**6, sample_offset=0, total_tokens=8192, accept_batch=False,
                accept_data=False, saved_ramp=ramp_spec, ramp_spec=ramp_spec,
                saved_offset_from="tokens")
    note = {**LRClock(15).note(), "tokens": 8192}
    same = plan_resume(state, ramp=fine, saved_lr_schedule=note, **args)
    assert same.lr_clock == LRClock(15) and same.lr_clock.position(7) == 7   # untouched
    resized = plan_resume(state, ramp=coarse, saved_lr_schedule=note, **args)
    clock = resized.lr_clock
    assert resized.total_steps == 14 and clock.run_steps == 14
    # No jump at the resume, the schedule's end at the run's end, evenly in between.
    assert clock.position(4) == 4 and clock.position(13) == pytest.approx(14)
    assert clock.position(9) == pytest.approx(4 + 5 * 10 / 9)
    assert any("end at step 14, not 15" in n for n in resized.notes), resized.notes
    # Resumed again at the new size: the same clock (a restart changes nothing).
    at_9 = BatchSchedule(coarse, 8192, step=4, tokens=state.tokens_seen).at(9).tokens_before
    again = plan_resume(TrainState(step=9, tokens_seen=at_9), ramp=coarse,
                        saved_lr_schedule={**clock.note(), "tokens": 8192}, **args)
    assert again.lr_clock == clock
    # A checkpoint without the note, with a malformed one, or from a run of other tokens: the
    # schedule is counted again at this size.
    for bad in (None, {"total_steps": "x", "tokens": 8192}, {"tokens": 8192},
                {**note, "tokens": 4096}, {**note, "anchor_position": 99.0, "run_steps": 20}):
        assert plan_resume(state, ramp=coarse, saved_lr_schedule=bad, **args).lr_clock == \
            LRClock(14), bad
