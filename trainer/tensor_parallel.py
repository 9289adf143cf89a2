"""Tensor parallelism (Megatron-LM's, Shoeybi et al. 2019, with sequence parallelism, Korthikanti
et al. 2022): the plan that splits each block's matmuls over the `tp` ranks of the mesh.

Follows torchtitan's `apply_tp` (`models/llama3/infra/parallelize.py`), written with torch's own
parallel styles (`torch.distributed.tensor.parallel`):
- The fused input projections (`c_attn`, `c_fc`) are column-wise: each rank computes whole heads
  and whole hidden units, because model.py orders their rows so that a row block is exactly
  that. The output projections (`c_proj`) are row-wise, and their partial sums are
  reduce-scattered along the sequence (one collective per projection, the same volume as
  Megatron's all-reduce).
- Between them the residual stream stays sharded along the sequence: the norms run on a slice
  of the tokens (sequence parallel) and are all-gathered where a projection needs every token.
- The embedding is row-wise (a vocabulary slice each) and the head column-wise with its logits
  left sharded over the vocabulary, so the loss is computed vocabulary-parallel
  (`loss_parallel`): no rank holds the whole b·s·V logits. A tied head shares the embedding's
  vocabulary slice, which is the same rows.

Applied first, on the meta-device model (torchtitan's order: TP, activation checkpointing,
compile, then FSDP over the data-parallel dimensions of the same mesh).
"""

from __future__ import annotations

import contextlib

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                               RowwiseParallel, SequenceParallel,
                                               loss_parallel, parallelize_module)

from crucible.trainer.model import GPT
from crucible.trainer.pipeline import holds_parameters


def block_plan(qk_norm: bool) -> dict:
    """Each block's styles, by submodule name. The attention and MLP inputs arrive sequence-
    sharded and are gathered whole (the projections need every token); the rope tables, the
    attention's second argument, are the same on every rank and stay as they are."""
    plan = {
        "ln_1": SequenceParallel(),
        "attn": PrepareModuleInput(input_layouts=(Shard(1), None),
                                   desired_input_layouts=(Replicate(), None)),
        "attn.c_attn": ColwiseParallel(),
        "attn.c_proj": RowwiseParallel(output_layouts=Shard(1)),
        "ln_2": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "mlp.c_fc": ColwiseParallel(),
        "mlp.c_proj": RowwiseParallel(output_layouts=Shard(1)),
    }
    if qk_norm:
        # Per-head norms see this rank's head groups, dimension 2 of (B, T, groups, heads, hd):
        # replicated weights whose gradients are summed over the ranks by DTensor.
        plan["attn.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan["attn.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return plan


def root_plan(learned_positions: bool) -> dict:
    """The embeddings, the final norm and the head. Embedding lookups are row-wise: each rank
    looks up what its rows hold and the sum is reduce-scattered along the sequence."""
    plan = {
        "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "ln_f": SequenceParallel(),
        # Logits stay sharded over the vocabulary, as DTensors, for `loss_parallel`.
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                                   use_local_output=False),
    }
    if learned_positions:
        # Its output is (T, C), the positions of the sequence: sharded along dimension 0 the
        # same way the tokens' embeddings are along dimension 1, so the two add up slice-wise.
        plan["wpe"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0))
    return plan


def apply(model: GPT, tp_mesh: DeviceMesh) -> GPT:
    """Split `model`'s layers over `tp_mesh`, in place. The model must still be on the meta
    device: its parameters are replaced by DTensors, and tied weights tied again."""
    cfg = model.cfg
    # A pipeline stage holds some of the root's parts (pipeline.keep_stage): plan those.
    plan = {name: style for name, style in root_plan(cfg.position == "learned").items()
            if getattr(model, name) is not None}
    parallelize_module(model, tp_mesh, plan)
    if cfg.tied_embeddings and model.lm_head is not None:
        # Each style registers a new parameter; the head's column block and the embedding's
        # row block are the same rows of the one tensor, so tying them again is exact.
        model.lm_head.weight = model.wte.weight
    for block in model.h:
        if holds_parameters(block):  # not another pipeline stage's place
            parallelize_module(block, tp_mesh, block_plan(cfg.qk_norm))
    model.loss_fn = _local_loss(model.loss_fn)
    return model


def _local_loss(loss_fn):
    """`loss_fn` on vocabulary-sharded logits, its result as a plain tensor (the mean loss, the
    same on every tensor-parallel rank): the loop sums it with other plain tensors."""
    def loss(logits, targets):
        return loss_fn(logits, targets).to_local()
    return loss


def loss_context(tensor_parallel: bool):
    """The context forward and backward of the loss run in: vocabulary-parallel cross-entropy
    when the logits are sharded over the vocabulary (`root_plan`), else nothing."""
    return loss_parallel() if tensor_parallel else contextlib.nullcontext()

