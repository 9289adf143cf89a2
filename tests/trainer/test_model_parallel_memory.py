"""The planner's activation memory under tensor and pipeline parallelism against what autograd
and the pipeline schedule really keep, on CPU (as test_activation_memory.py holds it for one GPU).

Tensor parallelism: two gloo ranks under torchrun (tests/trainer/tensor_parallel_memory_probe.py)
split each preset's model with the trainer's own plan (`tensor_parallel.apply`, sequence parallel,
vocabulary-parallel loss) and count what one rank saves for backward during a forward with
targets: its shards, the sequence slices its norms keep and the gathered norm outputs its
projections keep. Against the planner's per-GPU estimate for t = 2 with sequence parallelism.

Pipeline parallelism: one stage of the model as the trainer builds it (`pipeline.keep_stage`),
forwarded alone in this process, the first on token ids, the others on a hidden state, as
torch.distributed.pipelining feeds them. Per micro-batch in flight a stage holds what autograd
saves plus its output, which the schedule keeps until it starts that micro-batch's backward from
it (the logits, on the last stage). Against the planner's per-stage, per-micro-batch estimate;
how many micro-batches each stage holds (1F1B: p on the first, GPipe: all m) is the schedule's
arithmetic, held in tests/plan/test_memory.py.

fp32, as the single-GPU test counts eager blocks (CPU's bf16 RMSNorm upcasts in composed ops
that a GPU's fused kernel does not keep); bf16 where only the dtype of the kept logits differs.
The bar is 5%; the counts are exact to a few hundredths of a percent.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from crucible.api import arch
from crucible.trainer import pipeline
from crucible.trainer.model import GPT
from crucible.trainer.plan import memory as mem
from tests.trainer.tensor_parallel_memory_probe import LAYERS, LOSS_ROWS, LOSS_VOCAB
from tests.support.measure import saved_for_backward
from tests.trainer.test_activation_memory import BATCH, SEQ, VOCAB
from tests.support.training import run_probe

TOLERANCE = 0.05
FP32 = mem.PRECISIONS["fp32"]


@pytest.fixture(scope="module")
def tensor_parallel_ranks(tmp_path_factory) -> list[dict]:
    """Each rank's counts from tests/trainer/tensor_parallel_memory_probe.py on two ranks."""
    work = tmp_path_factory.mktemp("tp-memory")
    run_probe("tests.trainer.tensor_parallel_memory_probe", work)
    return [json.loads((work / f"tp.{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.parametrize("name", sorted(arch.PRESETS))
def test_tensor_parallel_estimate_is_within_5_percent_of_what_a_rank_saves(
        tensor_parallel_ranks, name):
    cfg = dataclasses.replace(arch.PRESETS[name], layers=LAYERS, seq_len=SEQ, vocab_size=VOCAB)
    est = mem.estimate(cfg, micro_batch=BATCH, capacity_bytes=1e12, stage=3, dp=1, tp=2,
                       sequence_parallel=True, precision=FP32, flash_attention=True)
    ranks = [rank["saved"][name] for rank in tensor_parallel_ranks]
    assert ranks[0] == ranks[1]   # whole heads and equal sequence slices: the ranks are alike
    estimated = est.activations_bytes + est.logits_bytes
    print(f"{name}, t=2: saved {ranks[0]:,} bytes a rank, estimated {estimated:,.0f} "
          f"({estimated / ranks[0] - 1:+.2%})")
    assert abs(estimated - ranks[0]) / ranks[0] < TOLERANCE
    # Well under one GPU's: everything but the gathered norm outputs is split.
    whole = mem.estimate(cfg, micro_batch=BATCH, capacity_bytes=1e12, stage=3, dp=1,
                         precision=FP32, flash_attention=True)
    assert estimated < 0.8 * (whole.activations_bytes + whole.logits_bytes)


def test_the_vocabulary_parallel_loss_peaks_at_16_bytes_a_logit(tensor_parallel_ranks):
    """DTensor's loss backward holds three fp32 tensors of the logits' size beside the kept
    log-softmax (`loss_transient_bytes`, loss_parallel): 16 bytes a local logit at its fullest."""
    est = (mem.logits_bytes(LOSS_ROWS, 1, LOSS_VOCAB, tp=2)
           + mem.loss_transient_bytes(LOSS_ROWS, 1, LOSS_VOCAB, tp=2, loss_parallel=True))
    for rank in tensor_parallel_ranks:
        peak = rank["loss_peak"]
        print(f"vocabulary-parallel loss, t=2: peak {peak:,} bytes, estimated {est:,.0f}")
        assert abs(est - peak) / peak < TOLERANCE


def stage_kept_bytes(cfg: arch.GPTConfig, stage: int, stages: int,
                     dtype: torch.dtype = torch.float32) -> int:
    """What one micro-batch keeps on pipeline stage `stage` of `stages` until its backward:
    autograd's saved tensors (each storage once, parameters and buffers left out) and the
    stage's output, which the schedule holds (pipelining's forward-chunk state), unless
    autograd saved it already. The last stage runs the loss on its output, the logits."""
    with torch.device("meta"):
        model = GPT(cfg)
    pipeline.keep_stage(model, stage, stages)
    model.to_empty(device="cpu")
    model.to(dtype)
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=gen)
    # What pipelining hands a later stage: the previous stage's output, needing a gradient.
    inputs = idx if stage == 0 else torch.randn(BATCH, SEQ, cfg.dim, generator=gen, dtype=dtype,
                                                requires_grad=True)
    with saved_for_backward(model) as kept:
        out = model(inputs)
        if stage == stages - 1:
            model.loss_fn(out, idx)
    kept.setdefault(out.untyped_storage()._cdata, out.untyped_storage().nbytes())
    return sum(kept.values())


# One preset per block family (LayerNorm, GELU, learned positions; RMSNorm, SwiGLU, grouped-
# query attention, RoPE) and a tied preset, untied as a pipeline needs it; stages: the first,
# a middle one and the last.
PIPELINED = [(name, stage, stages) for name in ("gpt2-124m", "llama-150m", "llama-1b")
             for stage, stages in ((0, 2), (1, 3), (1, 2))]


@pytest.mark.parametrize("name, stage, stages", PIPELINED)
def test_pipeline_stage_estimate_is_within_5_percent_of_what_a_micro_batch_keeps(
        name, stage, stages):
    cfg = dataclasses.replace(arch.PRESETS[name], layers=2 * stages, seq_len=SEQ,
                              vocab_size=VOCAB, tied_embeddings=False)
    measured = stage_kept_bytes(cfg, stage, stages)
    est = mem.stage_activation_bytes(cfg, SEQ, BATCH, stage, stages, bytes_per_value=4)
    print(f"{name}, stage {stage} of {stages}: keeps {measured:,} bytes a micro-batch, "
          f"estimated {est:,.0f} ({est / measured - 1:+.2%})")
    assert abs(est - measured) / measured < TOLERANCE


def test_the_last_stage_keeps_its_logits_in_their_own_dtype_beside_the_fp32_loss():
    """bf16, where the eager loss's kept log-softmax is fp32 and the logits the schedule holds
    are bf16: 6 bytes a logit (GPT-2's LayerNorm and GELU keep the same in bf16 on CPU)."""
    cfg = dataclasses.replace(arch.PRESETS["gpt2-124m"], layers=4, seq_len=SEQ,
                              vocab_size=8192, tied_embeddings=False)
    measured = stage_kept_bytes(cfg, 1, 2, torch.bfloat16)
    est = mem.stage_activation_bytes(cfg, SEQ, BATCH, 1, 2, bytes_per_value=2)
    assert abs(est - measured) / measured < TOLERANCE, (est, measured)
    logits = SEQ * BATCH * cfg.vocab_size
    assert mem.last_stage_logits_bytes(SEQ, BATCH, cfg.vocab_size) == 6 * logits
