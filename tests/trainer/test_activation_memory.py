"""The planner's activation memory against what autograd really keeps, for every preset's block.

The CPU stand-in for `torch.cuda.max_memory_allocated`: every tensor autograd saves for backward
during one forward pass of the real module (a saved-tensors hook, each storage counted once,
parameters and buffers left out), on CPU in fp32 where SDPA runs its fused (flash) kernel as it
does on a GPU. Each preset's own block shape (width, heads, key/value heads, MLP) with one layer,
a short sequence and a small vocabulary: the count is per block and per token, so the layer
count, the sequence length and the vocabulary only multiply it (the logits term is in the sum).
The module is allocated uninitialised: which tensors are kept does not depend on their values.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from crucible.api import arch
from crucible.trainer.model import GPT
from crucible.trainer.parallel import compile_model
from crucible.trainer.plan import memory as mem

SEQ, BATCH, VOCAB = 48, 2, 512


def saved_for_backward_bytes(cfg: arch.GPTConfig, dtype: torch.dtype = torch.float32,
                             compiled: bool = False) -> int:
    with torch.device("meta"):
        model = GPT(cfg)
    model.to_empty(device="cpu")
    model.to(dtype)   # bf16: as FSDP's mixed precision computes, on parameters cast to bf16
    if compiled:
        compile_model(model)   # what training.compile does (trainer/parallel.py)
    owned = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in owned:
            kept[storage._cdata] = storage.nbytes()
        return t

    idx = torch.randint(0, cfg.vocab_size, (BATCH, SEQ))
    if compiled:
        model(idx, idx).backward()   # compiles; counted on the next pass
        kept.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(idx, idx)
    return sum(kept.values())


@pytest.mark.parametrize("name", sorted(arch.PRESETS))
def test_estimate_is_within_10_percent_of_what_autograd_saves(name):
    cfg = dataclasses.replace(arch.PRESETS[name], layers=1, seq_len=SEQ, vocab_size=VOCAB)
    est = mem.estimate(cfg, micro_batch=BATCH, capacity_bytes=1e12, stage=3, dp=1,
                       precision=mem.PRECISIONS["fp32"], flash_attention=True)
    measured = saved_for_backward_bytes(cfg)
    # The acceptance bar is 10%; the count is exact to a few hundredths of a percent here.
    assert est.activations_bytes + est.logits_bytes == pytest.approx(measured, rel=0.02)


# One preset per block family (LayerNorm + GELU; RMSNorm + SwiGLU + GQA), with two layers: the
# final norm runs eagerly (only blocks and loss are compiled), and one layer would let it weigh
# more than it does in a real model.
COMPILED = ["gpt2-124m", "llama-150m"]


@pytest.mark.parametrize("name", COMPILED)
def test_compiled_estimate_is_within_15_percent_of_what_inductor_saves(name):
    """Inductor on CPU: its partitioner decides what to keep, as it does on a GPU. bf16, as
    training computes; the final norm's eager bf16 intermediates on CPU (RMSNorm's fp32 upcast
    copies, composed ops here) are the remaining error."""
    cfg = dataclasses.replace(arch.PRESETS[name], layers=2, seq_len=SEQ, vocab_size=VOCAB)
    est = mem.estimate(cfg, micro_batch=BATCH, capacity_bytes=1e12, stage=3, dp=1,
                       precision=mem.PRECISIONS["bf16"], flash_attention=True, compiled=True)
    compiled = saved_for_backward_bytes(cfg, torch.bfloat16, compiled=True)
    assert est.activations_bytes + est.logits_bytes == pytest.approx(compiled, rel=0.15)
    eager = mem.estimate(cfg, micro_batch=BATCH, capacity_bytes=1e12, stage=3, dp=1,
                         precision=mem.PRECISIONS["bf16"], flash_attention=True)
    if cfg.mlp == "swiglu":   # what compiling saves is counted, not assumed
        assert est.activations_bytes < eager.activations_bytes
    assert est.logits_bytes < eager.logits_bytes   # the compiled loss keeps bf16 logits
