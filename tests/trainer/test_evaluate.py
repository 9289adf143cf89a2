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
