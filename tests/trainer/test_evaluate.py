"""Held-out eval scores exactly the windows it says it does, as a direct cross-entropy would."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from crucible.api import arch
from crucible.trainer.data import ShardSet
from crucible.trainer.evaluate import evaluate
from crucible.trainer.model import GPT


def test_eval_equals_a_direct_cross_entropy_over_the_first_windows(corpus):
    torch.manual_seed(0)
    model = GPT(arch.preset("tiny", vocab_size=corpus.vocab_size))
    model.init_weights()
    val = ShardSet(str(corpus.val))
    seq_len, windows = 32, 6
    result = evaluate(model, val, seq_len=seq_len, micro_batch=2, tokens=windows * seq_len,
                      rank=0, world_size=1, device=torch.device("cpu"))
    rows = torch.from_numpy(np.stack([val.read(w * seq_len, seq_len + 1)
                                      for w in range(windows)])).long()
    with torch.no_grad():
        logits = model(rows[:, :-1])
    direct = F.cross_entropy(logits.float().flatten(0, 1), rows[:, 1:].flatten()).item()
    assert result.tokens == windows * seq_len
    assert result.loss == pytest.approx(direct, rel=1e-5)
    assert result.bits_per_byte == pytest.approx(direct / math.log(2) / val.bytes_per_token,
                                                 rel=1e-5)
    assert model.training  # put back as it was


def test_an_eval_between_steps_changes_no_training_step(corpus, tmp_path):
    """Two FSDP ranks, 6 steps, with a held-out eval after every second step and with none
    until the end: the same losses bit for bit. The eval's forward gathers the root's
    parameters (embedding, final norm, head), which FSDP leaves gathered after a forward
    (`reshard_after_forward=False`); the loop evaluates between a step's backward and its
    update, so a gathered copy left in place would be the next step's, older than the update."""
    from tests.support.training import job_config, run_crucible, write_config
    from tests.trainer.chaos import train_records

    losses = {}
    for every in (2, 100):
        cfg = job_config(corpus, tmp_path / str(every), steps=6, batch_tokens=4096,
                         evalEvery=every, evalTokens=2048)
        run = run_crucible("train", "--config", str(write_config(cfg, tmp_path / f"{every}.yaml")),
                           nproc=2)
        assert run.returncode == 0, run.stderr[-3000:]
        losses[every] = [r["loss"] for r in train_records(tmp_path / str(every) / "metrics.jsonl")]
    assert len(losses[2]) == 6 and losses[2] == losses[100], losses
