"""What one tensor-parallel rank keeps for backward, on two gloo ranks: run under torchrun by
test_model_parallel_memory.py, each rank writes one JSON object of byte counts.

    torchrun --nproc-per-node=2 -m tests.trainer.tensor_parallel_memory_probe <work folder>

For every preset's block shape: the bytes autograd saves during one forward with targets of the
model split by `tensor_parallel.apply` over a 1-D mesh of the two ranks (each storage once, this
rank's shards: a DTensor counts its local tensor; parameters and buffers left out), as
test_activation_memory.py counts them for one GPU. And the vocabulary-parallel loss alone: the
allocator's peak during its forward and backward on this rank's slice of the logits.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from crucible.api import arch
from crucible.trainer import tensor_parallel
from crucible.trainer.model import GPT, cross_entropy_loss
from tests.trainer.test_activation_memory import BATCH, SEQ, VOCAB, allocator_peak

LAYERS = 2   # two blocks, so that the blocks weigh more than the head, as in a real model
LOSS_ROWS, LOSS_VOCAB = 96, 8192


def _storage(t: torch.Tensor):
    return (t._local_tensor if isinstance(t, DTensor) else t).untyped_storage()


def saved_for_backward_bytes(cfg: arch.GPTConfig, mesh) -> int:
    with torch.device("meta"):
        model = GPT(cfg)
    tensor_parallel.apply(model, mesh)
    model.to_empty(device="cpu")
    owned = {_storage(t)._cdata for t in [*model.parameters(), *model.buffers()]}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = _storage(t)
        if storage._cdata not in owned:
            kept[storage._cdata] = storage.nbytes()
        return t

    # The same tokens on both ranks: tensor-parallel ranks read the same batch.
    idx = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    with tensor_parallel.loss_context(True), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(idx, idx)
    return sum(kept.values())


def loss_peak_bytes(mesh) -> int:
    """The allocator's peak beyond the logits during the vocabulary-parallel loss's forward
    and backward on bf16 logits (B=1, LOSS_ROWS, LOSS_VOCAB) sharded over the vocabulary."""
    gen = torch.Generator().manual_seed(1)
    full = torch.randn(1, LOSS_ROWS, LOSS_VOCAB, generator=gen, dtype=torch.bfloat16)
    logits = distribute_tensor(full, mesh, [Shard(-1)]).detach().requires_grad_()
    targets = torch.randint(0, LOSS_VOCAB, (1, LOSS_ROWS), generator=gen)

    def step():
        with tensor_parallel.loss_context(True):
            cross_entropy_loss(logits, targets).backward()
        logits.grad = None

    step()   # warms the allocator and the collectives
    return allocator_peak(step)


def main(work: Path) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    out = {"saved": {}, "loss_peak": loss_peak_bytes(mesh)}
    for name in sorted(arch.PRESETS):
        cfg = dataclasses.replace(arch.PRESETS[name], layers=LAYERS, seq_len=SEQ,
                                  vocab_size=VOCAB)
        out["saved"][name] = saved_for_backward_bytes(cfg, mesh)
    (work / f"tp.{dist.get_rank()}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
