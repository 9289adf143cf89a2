"""What tests measure of a step on CPU: what autograd keeps for backward (the stand-in for
`torch.cuda.max_memory_allocated` that the planner's activation estimates are held against),
and what reads a tensor back to the host (what would wait for the device on a GPU)."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def saved_for_backward(model: torch.nn.Module):
    """Within the block, every tensor autograd saves is recorded by storage (each counted once),
    the module's parameters and buffers left out; yields the {storage: bytes} it fills."""
    owned = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in owned:
            kept[storage._cdata] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield kept


def record_host_reads(monkeypatch) -> list[str]:
    """Record every read of a tensor's value back to the host (what waits for the device on a
    GPU): the list the reads' names are appended to while the patch lasts."""
    reads: list[str] = []
    for name in ("item", "tolist", "__float__", "__int__", "__bool__"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name,
                            lambda self, *a, _real=real, _name=name: reads.append(_name)
                            or _real(self, *a))
    return reads
