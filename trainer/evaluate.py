"""Held-out evaluation: mean loss in nats/token and bits per UTF-8 byte.

The eval set is the first `tokens` tokens of the validation shards read in order (no sampling),
cut into windows that are split evenly across ranks, so every eval of a run, at any world size,
scores exactly the same tokens. Bits per byte (as in The Pile and GPT-2 papers' BPB) divides the
summed loss by ln 2 and by the UTF-8 bytes those tokens encode, taken from the shard headers'
bytes/token ratio, which makes models with different tokenizers comparable.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from crucible.trainer import parallel
from crucible.trainer.data import DataError, ShardSet


@dataclass(frozen=True)
class EvalResult:
    loss: float  # nats per token
    bits_per_byte: float
    tokens: int


@torch.no_grad()
def evaluate(model: torch.nn.Module, val: ShardSet, *, seq_len: int, micro_batch: int, tokens: int,
             rank: int, world_size: int, device: torch.device, loss_of=None) -> EvalResult:
    """The mean held-out loss over `tokens` of `val`, each of the `world_size` data-parallel
    ranks scoring its own windows. `loss_of(inputs, targets)` computes a batch's loss where the
    model alone cannot (a pipeline stage: `Pipeline.forward_loss`, whose losses are shares
    that the all-reduce adds up to the same mean)."""
    loss_of = loss_of or model
    available = (val.num_tokens - 1) // seq_len
    # A small validation set still gets scored: shrink the batch so every rank has a window.
    micro_batch = max(1, min(micro_batch, available // world_size))
    per_step = micro_batch * world_size
    windows = min(available, max(1, tokens // seq_len))
    windows = windows // per_step * per_step  # equal work on every rank
    if windows == 0:
        raise DataError(f"validation shards hold {val.num_tokens} tokens, fewer than one "
                         f"sequence of {seq_len + 1} per rank ({world_size} ranks)")
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    count = torch.zeros((), dtype=torch.float64, device=device)
    for first in range(rank * micro_batch, windows, per_step):
        rows = [val.read(w * seq_len, seq_len + 1) for w in range(first, first + micro_batch)]
        batch = torch.from_numpy(np.stack(rows)).to(device)  # (B, T+1)
        # Through the model's own loss, as training computes it (compiled with the blocks on
        # CUDA: the fp32 upcast fused into the softmax), not from its logits: an fp32 copy of
        # them and its log-softmax, 8·B·T·V bytes beside the logits' own 2·B·T·V, are ~84 GB
        # at a 128K vocabulary and micro-batch 8 x 8,192, more than the training step holds.
        n = batch[:, 1:].numel()
        loss_sum += loss_of(batch[:, :-1], batch[:, 1:]).double() * n
        count += n
    # Over every rank, not the data-parallel ones only: under a pipeline the loss is on the
    # last stage's ranks (the others add zeros and the same counts; `loss_of`).
    # Every rank counted its data-parallel rank's tokens: tensor-parallel and pipeline ranks
    # count the same ones again, `copies` times in all.
    copies = 1
    if dist.is_initialized() and dist.get_world_size() > 1:
        totals = torch.stack([loss_sum, count])
        dist.all_reduce(totals)
        loss_sum, count = totals[0], totals[1]
        copies = dist.get_world_size() // world_size
    model.train(was_training)
    parallel.reshard_all(model)
    mean = float(loss_sum / count)
    bpb = mean / math.log(2) / val.bytes_per_token
    return EvalResult(loss=mean, bits_per_byte=bpb, tokens=int(count) // copies)
