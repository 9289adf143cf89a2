"""Reading the next micro-batch, and copying it to the GPU, while the current one computes.

Owns the training loader's one-batch-ahead pipeline. After handing out micro-batch (step,
micro), a background thread reads the next one from the shards (memory-mapped reads and the
sampler's permutation, host work), pins it and, on CUDA, starts its host-to-device copy on a
side stream; the compute stream waits for that copy with an event, never the host. On CPU there
is nothing to pin or copy: the thread only reads. This is the pattern of PyTorch's DataLoader
with `pin_memory=True` plus nanoGPT's "prefetch the next batch while the GPU works", one batch
deep because a step's reads are small next to its compute.

It must not change what is trained on, or what a checkpoint records. The sampler is a pure
function of (seed, sample offset, tokens trained on before the step, micro-batch), the step's
size follows from those tokens (the batch ramp, crucible.api.batch_ramp), and the sampler's
state is only {seed, offset}: a prefetch reads from a copy of it and advances nothing, so a
checkpoint taken with a batch in flight records the position of the batch consumed. A
prefetched batch is used only when its key (tokens before its step, micro-batch, seed, offset)
is the one asked for; after a rollback or a restore the key differs, the batch is dropped, and
the asked-for one is read at once.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

import numpy as np
import torch

from crucible.api.batch_ramp import BatchRamp
from crucible.trainer.data import Sampler


@dataclass(frozen=True)
class BatchKey:
    """Everything a micro-batch's tokens depend on."""

    tokens_before: int   # trained on before the micro-batch's step
    micro: int
    seed: int
    sample_offset: int


def following(tokens_before: int, micro: int, ramp: BatchRamp) -> tuple[int, int]:
    """The (tokens before its step, micro-batch) read after this one. Pure."""
    micro_steps = ramp.micro_steps(tokens_before)
    if micro + 1 < micro_steps:
        return tokens_before, micro + 1
    return tokens_before + micro_steps * ramp.unit_tokens, 0


class Prefetcher:
    """`get(tokens_before, micro)` returns micro-batch `micro` of the step that starts after
    `tokens_before` training tokens, (inputs, targets) on `device`, each (micro_batch, seq_len)
    int64, and starts reading the next. The step's size is `ramp`'s; `micro_batch`, `rank` and
    `world_size` are this rank's place among the data-parallel ranks."""

    def __init__(self, sampler: Sampler, device: torch.device, ramp: BatchRamp, *,
                 micro_batch: int, rank: int, world_size: int):
        self.sampler, self.device, self.ramp = sampler, device, ramp
        self.micro_batch, self.rank, self.world_size = micro_batch, rank, world_size
        self._cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if self._cuda else None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefetch")
        self._pending: tuple[BatchKey, Future] | None = None

    def _key(self, tokens_before: int, micro: int) -> BatchKey:
        return BatchKey(tokens_before, micro, self.sampler.seed, self.sampler.sample_offset)

    def _load(self, sampler: Sampler, key: BatchKey):
        """Read one micro-batch, (2, B, T) on the device: pinned and copied on the side
        stream on CUDA (with the event that marks the copy done), as read on CPU."""
        global_batch = self.ramp.micro_steps(key.tokens_before) * self.micro_batch * self.world_size
        x, y = sampler.batch(key.tokens_before // sampler.seq_len, key.micro,
                             global_batch=global_batch, micro_batch=self.micro_batch,
                             rank=self.rank, world_size=self.world_size)
        pair = torch.from_numpy(np.stack([x, y]))  # (2, B, T): one copy instead of two
        if not self._cuda:
            return pair, None
        with torch.cuda.stream(self._stream):
            # Pinned memory makes the copy asynchronous; the caching host allocator keeps the
            # pinned buffer alive until the copy has run.
            on_device = pair.pin_memory().to(self.device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        return on_device, done

    def get(self, tokens_before: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = self._key(tokens_before, micro)
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] == key:
            pair, done = pending[1].result()  # re-raises a read error (a DataError) here
        else:
            if pending is not None:
                pending[1].cancel()  # a rollback or restore moved the data: not this batch
            pair, done = self._load(self.sampler, key)
        nxt = self._key(*following(tokens_before, micro, self.ramp))
        # A copy of the sampler: the thread must read the offset it was keyed with, whatever
        # the loop does to the sampler meanwhile (Sampler is a small dataclass over the shards).
        self._pending = (nxt, self._pool.submit(self._load, replace(self.sampler), nxt))
        if done is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(done)  # the compute stream waits for the copy; the host does not
            pair.record_stream(stream)  # allocated on the side stream, used on this one
        return pair[0], pair[1]

    def close(self) -> None:
        self._pending = None
        self._pool.shutdown(wait=True, cancel_futures=True)
