"""Memory per GPU: model states under DDP and ZeRO-1/2/3 (FSDP), plus activations and logits.

Owns byte arithmetic only; which layout to pick is `parallelism`'s job, what each precision
keeps a parameter is `precision`'s. Longer than 400 lines because every term of one step's
peak is here, next to the others it is weighed against in `estimate`. Sources:
- Rajbhandari et al. 2020, "ZeRO" (arXiv 1910.02054), §3.1 and Fig. 1: mixed-precision Adam holds
  2Ψ (fp16/bf16 parameters) + 2Ψ (gradients) + KΨ optimizer states with K = 12 (fp32 master
  copy, momentum, variance); per GPU with N_d data-parallel ranks: DDP (4+K)Ψ, ZeRO-1
  4Ψ + KΨ/N_d, ZeRO-2 2Ψ + (2+K)Ψ/N_d, ZeRO-3 (4+K)Ψ/N_d. Fig. 1's example: Ψ = 7.5B,
  N_d = 64 → 120 GB, 31.4 GB, 16.6 GB, 1.9 GB. FSDP FULL_SHARD = ZeRO-3, SHARD_GRAD_OP ≈ ZeRO-2.
- Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
  (arXiv 2205.05198), §4 and Table 2: activation bytes per layer with 16-bit activations,
  s = sequence, b = micro-batch, h = hidden, a = heads, t = tensor-parallel degree:
  no parallelism sbh(34 + 5as/h); TP sbh(10 + 24/t + 5as/(ht)); TP+SP sbh(34/t + 5as/(ht));
  selective recomputation drops the 5as/h term; full recomputation keeps the layer input, 2sbh
  (/t with SP). With 1F1B pipelining the first stage holds p micro-batches of its L/p layers,
  i.e. L layers' worth (§4.2.3), so the total is L × per-layer either way.
  The 34 counts a 4h MLP (19sbh of it: 2 input + 8 GeLU input + 8 GeLU output + 1 dropout mask);
  for other MLP widths f it is generalised here to 18 + 4f/h (exactly 34 at f = 4h).
- Logits: s·b·V values kept in fp32 for the loss, 4 bytes each, divided by t (vocab-parallel
  output layer) — the term Megatron's theoretical_memory_usage.py adds for the output layer.
  That is what the loss keeps; at its fullest, the backward's first step, eager PyTorch also
  holds two fp32 gradients of that size (`loss_transient_bytes`): 12 bytes a logit in all, while
  every block's activations are still kept. At a 128K vocabulary that is most of the step's
  peak, and what compiling the loss saves most.
- Crucible's own blocks (`block_activation_bytes`, what `estimate` uses): Korthikanti's table
  counts Megatron's GPT (dropout masks, no RoPE, GELU, one key/value head per query head). The
  count here is of the tensors Crucible's module keeps for backward, op by op, with fused
  attention: per token, each norm its input and output (RMSNorm also its normalised input),
  attention 3h + 3·kv (rotated q and k, the fused q|k|v output, the attention output; kv =
  key/value width, h under MHA, less under GQA; fused attention kernels write their output
  (b, s, heads, head_dim) in memory, so the output projection's input is that same tensor, where
  unfused attention makes a transposed copy, h more), the MLP 2f (GELU: its
  input and output) or 4f (SwiGLU: gate|up, silu(gate), their product). A test holds it against
  the bytes autograd actually saves for every preset's block shape.
- Compiled blocks and loss (`compiled=True`; `training.compile`, on by default on CUDA):
  inductor's partitioner (min-cut rematerialisation) recomputes cheap elementwise results in
  the backward instead of keeping them. Measured on Crucible's blocks (tests: the saved tensors
  of the compiled block, inductor on CPU): RMSNorm keeps its input and output but not its
  normalised input (2h), SwiGLU keeps gate|up and the product but not silu(gate) (3f); LayerNorm,
  GELU and attention keep what they keep eagerly. The compiled loss fuses the fp32 upcast into
  the cross-entropy and keeps the logits in their own dtype (2 bytes at bf16, not 4) plus two
  fp32 values per row. At llama-1b that is 0.78x the eager activations; GPT-2's blocks are
  unchanged.
- FSDP's working set beyond the sharded states (ZeRO-3; `fsdp_working_bytes`), as Crucible
  wraps the model (trainer/parallel.py, torchtitan's layout): the root unit (embeddings, final
  norm, output layer) stays gathered from its forward to the end of backward, and its gradient
  exists whole in the reduce dtype (fp32 unless set otherwise) before it is reduce-scattered;
  two blocks are gathered at a time (the one computing and the one prefetched) and one block's
  whole gradient waits for its reduce-scatter. With `gradientSync: lastMicroBatch` and more
  than one micro-batch a step, every rank also keeps the whole model's gradients in the reduce
  dtype across the micro-batches (`accumulated_grad_bytes`): 4 bytes a parameter, 32 GB at 8B.
  Under a pipeline a rank keeps its whole stage gathered, with its whole gradients
  (`pipeline_stage_bytes`).
- Full recomputation keeps each block's input, and while one block is recomputed for its
  backward, everything that block keeps (`recomputed_block_bytes`); that never coincides with
  the loss's fullest point, so the step's peak takes the larger of the two.
- Tensor parallelism as torch's parallel styles run it (Crucible's and torchtitan's plans):
  the norms' outputs gathered whole for the projections, and the vocabulary-parallel loss's
  eager backward, 16 bytes a logit (`block_activation_bytes`, `loss_transient_bytes`).
- A pipeline stage as torch.distributed.pipelining runs it (`stage_activation_bytes`): per
  micro-batch in flight, what autograd saves for the stage's blocks, plus the stage's output,
  which the schedule keeps to start that micro-batch's backward from (b·s·h values, or the
  logits on the last stage). Each rank is followed through its schedule's own order of
  forwards and backwards (`pipeline_rank_ops`: 1F1B's first rank holds p micro-batches and the
  last one; GPipe every m), and under ZeRO-3 a stage's whole gradients exist from its first
  backward, when some of its micro-batches' activations are already gone
  (`pipeline_rank_fullest`). Measured per stage against autograd's saved tensors on CPU
  (tests/trainer/test_model_parallel_memory.py), as the tensor-parallel block is on two
  processes; older schedules kept more to the step's end (`OutputsKept`).
- A whole step of the trainer's own, per layout, against the allocator on two CPU ranks
  (tests/trainer/test_step_memory.py): 7% under to 10% over at four-block models.
- Checked against torchtitan's own published runs (tests/plan/test_published_configs.py):
  Llama 3.1 8B under FSDP with and without torch.compile, with context parallelism up to
  256K tokens, and 405B under interleaved 1F1B (with torch 2.6's kept outputs), within 10% of
  the memory they report.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from crucible.api.arch import GPTConfig, block_params, param_count
# Callers read the precisions through this module too (`mem.PRECISIONS`), beside the bytes.
from crucible.trainer.plan.precision import PRECISIONS, Precision, with_reduce_dtype  # noqa: F401

ZeroStage = Literal[0, 1, 2, 3]
Recompute = Literal["none", "selective", "full", "selective-op"]
# What a pipeline schedule keeps to the step's end beyond autograd's needs: nothing (torch's
# stages with `step(return_outputs=False)`, as Crucible runs them); the last stage's outputs,
# the logits of every micro-batch (`return_outputs=True`, the default, which torchtitan passed
# until October 2025); or every stage's outputs, with its per-micro-batch receive buffers and
# its inputs' gradients (torch 2.6's stage.py, December 2024).
OutputsKept = Literal["none", "last", "all"]
# What the planner chooses among (Korthikanti's); "selective-op" is what Crucible's
# activationCheckpointing: selective-op and torchtitan's per-op policy keep, counted for jobs
# and configs that ask for it.
RECOMPUTE_MODES: tuple[Recompute, ...] = ("none", "selective", "full")
ALL_RECOMPUTE: tuple[Recompute, ...] = RECOMPUTE_MODES + ("selective-op",)
STAGE_NAMES = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3/FSDP"}


@dataclass(frozen=True)
class ModelStates:
    """Parameters, gradients and optimizer states held by one GPU, in bytes."""

    stage: int
    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float

    @property
    def total_bytes(self) -> float:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes


def model_states(params: float, stage: int, dp: int, precision: Precision = PRECISIONS["bf16"],
                 model_parallel: int = 1) -> ModelStates:
    """ZeRO §3.1 / Fig. 1: bytes per GPU at `stage` over `dp` data-parallel ranks.

    `model_parallel` = t·p divides everything first (each GPU owns 1/(t·p) of the layers'
    weights; embeddings are spread the same way as an approximation).
    """
    if stage not in STAGE_NAMES:
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
    if params <= 0 or dp < 1 or model_parallel < 1:
        raise ValueError("params must be > 0 and dp, model_parallel >= 1")
    psi = params / model_parallel
    p, g, k = precision.param_bytes * psi, precision.grad_bytes * psi, precision.optimizer_bytes * psi
    if stage >= 1:
        k /= dp
    if stage >= 2:
        g /= dp
    if stage >= 3:
        p /= dp
    return ModelStates(stage, p, g, k)


def layer_activation_bytes(seq_len: int, micro_batch: int, hidden: int, heads: int,
                           ffn: int | None = None, tp: int = 1, sequence_parallel: bool = True,
                           recompute: Recompute = "none", bytes_per_value: int = 2) -> float:
    """Korthikanti et al. 2022 Table 2: activation bytes of one transformer layer on one GPU."""
    s, b, h, a, t = seq_len, micro_batch, hidden, heads, tp
    if min(s, b, h, a, t) < 1:
        raise ValueError("seq_len, micro_batch, hidden, heads and tp must be >= 1")
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
    f = ffn or 4 * h
    scale = bytes_per_value / 2  # the paper's constants count 2-byte activations
    if recompute == "full":
        return scale * 2 * s * b * h / (t if sequence_parallel else 1)
    per_token = 18 + 4 * f / h  # = 34 for f = 4h (§4.1: attention 11, MLP 19 → 3 + 4f/h, norms 4)
    split = per_token - 10  # the part tensor parallelism splits (24 at f = 4h)
    scores = 0.0 if recompute == "selective" else 5 * a * s / h
    if t == 1 or sequence_parallel:
        per_layer = per_token / t + scores / t
    else:
        per_layer = 10 + split / t + scores / t
    return scale * s * b * h * per_layer


def _norm_values(cfg: GPTConfig, compiled: bool = False) -> int:
    """Per-token values a norm keeps: its input and output, and eager RMSNorm its normalised
    input (torch's RMSNorm is composed of ops, which a compiled block recomputes; LayerNorm is
    one kernel that keeps its statistics)."""
    return 3 * cfg.dim if cfg.norm == "rmsnorm" and not compiled else 2 * cfg.dim


def block_activation_values(cfg: GPTConfig, compiled: bool = False) -> dict[str, float]:
    """Per-token values one of Crucible's blocks keeps for backward with fused attention, by
    part, eager or compiled (module docstring); the fp32 statistics (norms, the attention's
    log-sum-exp) are a few values per token and counted too."""
    h, kv, f = cfg.dim, cfg.kv_dim, cfg.ffn_dim
    stats = 1 if cfg.norm == "rmsnorm" else 2  # RMSNorm: 1/rms; LayerNorm: mean and 1/std
    # Learned positions: q and k stay views of the fused output, no rotated copies.
    rotated = h + kv if cfg.position == "rope" else 0
    swiglu = 3 * f if compiled else 4 * f  # compiled: silu(gate) recomputed in the backward
    return {"norms": 2 * (_norm_values(cfg, compiled) + stats),
            "attention": rotated + (h + 2 * kv) + h + cfg.heads,
            "mlp": swiglu if cfg.mlp == "swiglu" else 2 * f}


def selective_op_values(cfg: GPTConfig, unfused: bool = False) -> float:
    """Per-token values a block keeps under the per-op policy (trainer/parallel.py
    `_op_sac_context`, the policy of torchtitan's per-op selective AC): the block's input, the
    attention kernel's output and log-sum-exp, and every other matmul's output in the
    forward's order (the 1st, 3rd, ...); everything else is recomputed in the backward.
    Crucible's block has four matmuls: q|k|v fused, the attention's projection, the MLP's up
    (gate|up for SwiGLU) and down. `unfused`: torchtitan's Llama block, which runs q, k, v,
    the projection, gate, up and down as separate matmuls (so it keeps q, v, gate and down).
    Both measured on CPU against the policy itself (tests/trainer/test_activation_memory.py)."""
    h, kv, f = cfg.dim, cfg.kv_dim, cfg.ffn_dim
    if unfused:
        matmuls = [h, kv, kv, h] + ([f, f, h] if cfg.mlp == "swiglu" else [f, h])
    else:
        matmuls = [h + 2 * kv, h, 2 * f if cfg.mlp == "swiglu" else f, h]
    return h + h + cfg.heads + sum(matmuls[0::2])


def block_activation_bytes(cfg: GPTConfig, seq_len: int, micro_batch: int, tp: int = 1,
                           sequence_parallel: bool = True, recompute: Recompute = "none",
                           bytes_per_value: int = 2, flash_attention: bool = True,
                           compiled: bool = False, unfused_linears: bool = False) -> float:
    """Activation bytes of one of Crucible's blocks on one GPU (see the module docstring;
    `unfused_linears`: torchtitan's block, which differs under selective-op only).

    Tensor parallelism splits what Korthikanti's §4.1 splits (all but the norms' part without
    sequence parallelism); without fused attention the s×s scores come back as his 5as/h term;
    full recomputation keeps the block's input.

    With sequence parallelism the two norms' outputs are kept whole, not a 1/t slice: torch's
    `SequenceParallel` and `PrepareModuleInput` (Crucible's trainer/tensor_parallel.py and
    torchtitan's TP plan) all-gather a norm's output before the column-parallel projections,
    and autograd keeps the gathered tensor, every token, for their weight gradients.
    Megatron-LM keeps the slice and gathers it again in the backward (Korthikanti §4.2.2),
    which is what his Table 2 counts."""
    if min(seq_len, micro_batch, tp) < 1:
        raise ValueError("seq_len, micro_batch and tp must be >= 1")
    if recompute not in ALL_RECOMPUTE:
        raise ValueError(f"recompute must be one of {ALL_RECOMPUTE}, got {recompute!r}")
    tokens, t = seq_len * micro_batch, tp
    if recompute == "full":
        return bytes_per_value * tokens * cfg.dim / (t if sequence_parallel else 1)
    if recompute == "selective-op":   # sequence parallel assumed: torchtitan's TP always is
        return bytes_per_value * tokens * selective_op_values(cfg, unfused_linears) / t
    parts = block_activation_values(cfg, compiled)
    rest = parts["attention"] + parts["mlp"]
    per_token = (parts["norms"] + rest) / t if sequence_parallel else parts["norms"] + rest / t
    if sequence_parallel and t > 1:
        per_token += 2 * cfg.dim * (1 - 1 / t)  # the gathered norm outputs (docstring)
    if recompute == "none" and not flash_attention:
        per_token += 2.5 * cfg.heads * seq_len / t  # 5as/h bytes per sbh, at 2 bytes a value
    if not flash_attention:
        per_token += cfg.dim / t  # the attention output's transposed copy
    return bytes_per_value * tokens * per_token


def head_activation_bytes(cfg: GPTConfig, seq_len: int, micro_batch: int,
                          bytes_per_value: int = 2, tp: int = 1) -> float:
    """The final norm's kept tensors (the logits are `logits_bytes`). The final norm runs
    eagerly even in a compiled model (blocks and loss are compiled, as torchtitan does).
    Under tensor parallelism it runs sequence-parallel on 1/t of the tokens, and its output,
    the output layer's input, is kept gathered whole (as the blocks' norms'; see
    `block_activation_bytes`)."""
    per_token = _norm_values(cfg) / tp + cfg.dim * (1 - 1 / tp)
    return bytes_per_value * seq_len * micro_batch * per_token


def logits_bytes(seq_len: int, micro_batch: int, vocab: int, tp: int = 1,
                 compiled: bool = False, bytes_per_value: int = 2) -> float:
    """The logits the loss keeps: fp32 eagerly, 4·s·b·V/t bytes; a compiled loss keeps them in
    the activations' dtype (`bytes_per_value`) and two fp32 values a row."""
    rows = seq_len * micro_batch
    if not compiled:
        return 4.0 * rows * vocab / tp
    return (bytes_per_value * rows * vocab + 8.0 * rows) / tp


def _root_and_block(cfg: GPTConfig, model_parallel: int) -> tuple[float, float]:
    block = block_params(cfg) / model_parallel
    return (param_count(cfg) / model_parallel) - cfg.layers * block, block


def loss_transient_bytes(seq_len: int, micro_batch: int, vocab: int, tp: int = 1,
                         compiled: bool = False, bytes_per_value: int = 2,
                         loss_parallel: bool = False) -> float:
    """What the loss holds at its fullest beyond what it keeps (`logits_bytes`), while every
    block's activations are still kept (the loss is the forward's end and the backward's
    start). Eagerly the backward's start: the gradient of the log-softmax and its input's, fp32,
    beside the kept log-softmax, 8·s·b·V bytes (the forward's fp32 copy of the logits and the
    logits themselves, 6 bytes a logit at bf16, are less). Compiled: the logits' gradient in
    their own dtype beside the kept logits. Measured on CPU, the allocator's events: 12 bytes a
    logit eagerly in all, 2 beyond the kept logits compiled (tests/trainer/test_activation_memory.py).

    `loss_parallel` (the logits sharded over the vocabulary under tensor parallelism, torch's
    `loss_parallel`, eager): DTensor's backward of the loss
    (torch/distributed/tensor/parallel/loss.py, `_nll_loss_and_log_softmax_backward`) builds
    `(zeros_like(x) + exp(x)) * grad`, three fp32 tensors of the logits' size beside the kept
    log-softmax where aten's fused kernel has two: 12 bytes a logit beyond it, 16 in all."""
    rows = seq_len * micro_batch
    if compiled:
        return bytes_per_value * rows * vocab / tp
    return (12.0 if loss_parallel else 8.0) * rows * vocab / tp


def recomputed_block_bytes(cfg: GPTConfig, seq_len: int, micro_batch: int, tp: int = 1,
                           sequence_parallel: bool = True, bytes_per_value: int = 2,
                           flash_attention: bool = True, compiled: bool = False) -> float:
    """Full recomputation's fullest point beyond the blocks' kept inputs: the block being
    recomputed holds everything it would keep without recomputation until its backward is
    done, one block at a time (Chen et al. 2016, "Training Deep Nets with Sublinear Memory
    Cost", arXiv 1604.06174, §3: the checkpoints plus the largest recomputed segment). It
    never meets the loss's fullest point, which comes before any block's backward."""
    return block_activation_bytes(cfg, seq_len, micro_batch, tp, sequence_parallel, "none",
                                  bytes_per_value, flash_attention, compiled)


def fsdp_gathered_bytes(cfg: GPTConfig, precision: Precision, model_parallel: int = 1) -> float:
    """ZeRO-3's gathered parameters on top of the shards: the root and two blocks."""
    root, block = _root_and_block(cfg, model_parallel)
    return precision.param_bytes * (root + 2 * block)


def fsdp_working_bytes(cfg: GPTConfig, precision: Precision, model_parallel: int = 1) -> float:
    """ZeRO-3's gathered parameters and whole gradients on top of the shards (module
    docstring): the root gathered and its gradient whole in the reduce dtype, two blocks
    gathered, one block's gradient whole in the reduce dtype."""
    root, block = _root_and_block(cfg, model_parallel)
    return (fsdp_gathered_bytes(cfg, precision, model_parallel)
            + precision.reduce_bytes * max(root, block))


def pipeline_stage_bytes(params: float, precision: Precision, model_parallel: int) -> float:
    """ZeRO-3 under a pipeline: every rank keeps its stage's parameters gathered and its whole
    gradients, accumulated in the reduce dtype, for the whole step. torch.distributed.pipelining
    runs every micro-batch's backward but the last with `set_requires_gradient_sync(False)` and
    `set_reshard_after_backward(False)` (pipelining/stage.py), and torchtitan shards pipelined
    stages with `reshard_after_forward=False` so as not to gather them once a micro-batch."""
    return (precision.param_bytes + precision.reduce_bytes) * params / model_parallel


def pipeline_rank_ops(pp: int, microbatches: int, rank: int, virtual_stages: int = 1,
                      schedule: str = "1F1B") -> list[tuple[str, int]]:
    """The forwards ("F") and backwards ("B") pipeline rank `rank` of `pp` runs in a step of
    `microbatches` micro-batches, in order, each with the local stage (0 … v−1) it runs, as
    torch.distributed.pipelining orders them. GPipe: every forward, then every backward. 1F1B
    (`Schedule1F1B`): min(m, p − rank) forwards, then a backward and a forward in turn while
    forwards remain, then the other backwards. Interleaved 1F1B (`ScheduleInterleaved1F1B`,
    `_get_1f1b_rank_ops`): the warm-up of `_get_warmup_ops`, (v − 1)·r + 2(p − 1 − rank)
    forwards capped at all m·v, then forward-backward pairs, then the other backwards; the
    rank's stages taken in turn for r micro-batches at a time, r = m // max(1, m // p)."""
    m, v = microbatches, virtual_stages
    if schedule == "GPipe":
        return [("F", 0)] * m + [("B", 0)] * m
    if v <= 1:
        warm = min(m, pp - rank)
        return [("F", 0)] * warm + [("B", 0), ("F", 0)] * (m - warm) + [("B", 0)] * warm
    r, total = _per_round(pp, m), m * v
    warm = min((v - 1) * r + 2 * (pp - 1 - rank), total)

    def forward(k: int) -> tuple[str, int]:
        return "F", (k // r) % v

    def backward(k: int) -> tuple[str, int]:
        return "B", v - 1 - ((k - warm) // r) % v

    return ([forward(k) for k in range(warm)]
            + [op for k in range(warm, total) for op in (forward(k), backward(k))]
            + [backward(k) for k in range(total, total + warm)])


@dataclass(frozen=True)
class RankFullest:
    """What a pipeline rank holds at its fullest point in a step (`pipeline_rank_fullest`)."""

    activations: float       # what its micro-batches keep: those in flight, and what stays
    gradients: float         # its stages' whole gradients made by then
    transient: float         # the backward's own working memory at that point
    in_flight: tuple[int, ...]   # micro-batches in flight, per local stage
    forwarded: tuple[int, ...]   # micro-batches forwarded so far this step, per local stage

    @property
    def total(self) -> float:
        return self.activations + self.gradients + self.transient


def pipeline_rank_fullest(ops: list[tuple[str, int]], held: list[float], grads: list[float],
                          transient: list[tuple[float, float]],
                          stays: list[tuple[float, float]] | None = None) -> RankFullest:
    """The fullest point of a rank running `ops` (`pipeline_rank_ops`): a forward of local stage
    s keeps held[s] until that micro-batch's backward frees it; the stage's first backward makes
    its whole gradients, grads[s], which stay to the step's end; a backward of stage s needs
    transient[s] more at its start and at its end (the loss's backward comes first; a block
    recomputed under full recomputation, in every block's). Within a backward the activations
    go and the gradients come block by block, from the last, so its fullest point is its start
    or its end. `stays[s]`: what each forward and each backward of stage s leaves to the step's
    end (older schedules' kept outputs and input gradients; `estimate`'s `outputs_kept`)."""
    stays = stays or [(0.0, 0.0)] * len(held)
    flight, forwarded = [0] * len(held), [0] * len(held)
    live = made = 0.0
    made_for: set[int] = set()
    best = RankFullest(0.0, 0.0, 0.0, tuple(flight), tuple(forwarded))

    def consider(extra: float) -> None:
        nonlocal best
        if live + made + extra > best.total:
            best = RankFullest(live, made, extra, tuple(flight), tuple(forwarded))

    for kind, stage in ops:
        if kind == "F":
            live += held[stage] + stays[stage][0]
            flight[stage] += 1
            forwarded[stage] += 1
            consider(0.0)
            continue
        at_start, at_end = transient[stage]
        consider(at_start)
        live += stays[stage][1] - held[stage]
        flight[stage] -= 1
        if stage not in made_for:
            made_for.add(stage)
            made += grads[stage]
        consider(at_end)   # its last block: the micro-batch's own activations nearly gone
    return best


def _per_round(pp: int, microbatches: int) -> int:
    """Micro-batches per round of torch's interleaved schedules: m // max(1, m // p)."""
    return microbatches // max(1, microbatches // pp)


def stage_output_bytes(seq_len: int, micro_batch: int, dim: int, tp: int = 1,
                       bytes_per_value: int = 2) -> float:
    """What a non-last pipeline stage keeps per micro-batch in flight beyond autograd's saved
    tensors: its output, which torch.distributed.pipelining holds (`_forward_chunk_states`)
    until that micro-batch's backward starts from it; b·s·h values, this rank's 1/t slice of
    the sequence under sequence parallelism. Nothing saves it for backward (the residual add
    that makes it saves nothing), so it is counted apart."""
    return bytes_per_value * seq_len * micro_batch * dim / tp


def last_stage_logits_bytes(seq_len: int, micro_batch: int, vocab: int, tp: int = 1,
                            compiled_loss: bool = False, bytes_per_value: int = 2) -> float:
    """What the last pipeline stage's loss keeps per micro-batch in flight: `logits_bytes`,
    and, for an eager loss, the logits themselves in their own dtype, the stage's output that
    the schedule holds until the backward (unpipelined, nothing holds them past the loss's
    fp32 upcast). A compiled loss already keeps the logits: nothing more."""
    kept = logits_bytes(seq_len, micro_batch, vocab, tp, compiled_loss, bytes_per_value)
    if compiled_loss:
        return kept
    return kept + bytes_per_value * seq_len * micro_batch * vocab / tp


def stage_activation_bytes(cfg: GPTConfig, seq_len: int, micro_batch: int, stage: int,
                           stages: int, *, tp: int = 1, sequence_parallel: bool = True,
                           recompute: Recompute = "none", bytes_per_value: int = 2,
                           flash_attention: bool = True, compiled: bool = False,
                           compiled_loss: bool | None = None,
                           unfused_linears: bool = False) -> float:
    """Bytes one micro-batch in flight keeps on pipeline stage `stage` (0-based) of `stages`
    until its backward, on one GPU: its L/p blocks' saved tensors (`block_activation_bytes`),
    and the stage's output (`stage_output_bytes`), or, on the last stage, the final norm's
    and the loss's kept tensors (`head_activation_bytes`, `last_stage_logits_bytes`; with one
    stage, `logits_bytes`: nothing holds the logits). The embeddings keep only the token ids."""
    if not 0 <= stage < stages or cfg.layers % stages:
        raise ValueError(f"stage {stage} of {stages} must be one of an equal split of the "
                         f"{cfg.layers} layers")
    compiled_loss = compiled if compiled_loss is None else compiled_loss
    blocks = cfg.layers // stages * block_activation_bytes(
        cfg, seq_len, micro_batch, tp, sequence_parallel, recompute, bytes_per_value,
        flash_attention, compiled, unfused_linears)
    if stage < stages - 1:
        return blocks + stage_output_bytes(seq_len, micro_batch, cfg.dim, tp, bytes_per_value)
    head = head_activation_bytes(cfg, seq_len, micro_batch, bytes_per_value, tp)
    if stages == 1:
        return blocks + head + logits_bytes(seq_len, micro_batch, cfg.vocab_size, tp,
                                            compiled_loss, bytes_per_value)
    return blocks + head + last_stage_logits_bytes(seq_len, micro_batch, cfg.vocab_size, tp,
                                                   compiled_loss, bytes_per_value)


def eval_forward_bytes(cfg: GPTConfig, seq_len: int, micro_batch: int, tp: int = 1,
                       compiled: bool = False, bytes_per_value: int = 2) -> float:
    """The held-out eval's fullest point beyond the weights: a forward without autograd keeps
    nothing from one block to the next, so it is the larger of one block's and the head's live
    tensors at a time (the module docstring's letters; b bytes a value).

    Eager, per token: attention 6h + 5·kv (the block's input, the norm's output, q|k|v, and the
    rotation's three temporaries), the MLP 3h + 2f (GELU) or 3h + 4f (SwiGLU: gate|up, silu and
    the product); the head h plus the logits, their fp32 copy and its log-softmax, b·V + 8·V
    bytes (fp32: the copy is the logits themselves). Compiled, inductor frees each buffer after
    its last use and fuses the elementwise ops: attention 5h + 3·kv (the norm's output lives
    until the rotation), the MLP 3h + f (GELU written in place over its input) or 2h + 3f, the
    head 2h plus the logits in their own dtype and two fp32 values a row. Measured on CPU
    (tests/trainer/test_activation_memory.py, the allocator's own events)."""
    h, kv, f, vocab = cfg.dim, cfg.kv_dim, cfg.ffn_dim, cfg.vocab_size
    b = bytes_per_value
    swiglu = cfg.mlp == "swiglu"
    if compiled:
        block = max(5 * h + 3 * kv, 2 * h + 3 * f if swiglu else 3 * h + f) * b
        logits = 2 * h * b + b * vocab + 8
    else:
        block = max(6 * h + 5 * kv, 3 * h + (4 * f if swiglu else 2 * f)) * b
        logits = h * b + b * vocab + (4 * vocab if b != 4 else 0) + 4 * vocab
    return seq_len * micro_batch * max(block, logits) / tp


def accumulated_grad_bytes(params: float, model_parallel: int = 1,
                           reduce_bytes: float = 4.0) -> float:
    """`gradientSync: lastMicroBatch`: the whole model's gradients, on every rank (FSDP
    accumulates unsynchronised gradients in its reduce dtype, fp32 unless set otherwise,
    whatever the parameters')."""
    return reduce_bytes * params / model_parallel


@dataclass(frozen=True)
class MemoryEstimate:
    """What one GPU holds, in bytes, against its capacity."""

    states: ModelStates
    activations_bytes: float
    logits_bytes: float
    capacity_bytes: float
    usable_fraction: float
    working_bytes: float = 0.0       # FSDP's gathered parameters and whole gradients (ZeRO-3)
    accumulated_grad_bytes: float = 0.0   # gradientSync: lastMicroBatch
    loss_transient_bytes: float = 0.0     # the loss's fullest point beyond what it keeps
    # The held-out eval's peak, all of it: the same micro-batch through a forward without
    # autograd, beside the model states (the next step's gradients included).
    eval_bytes: float = 0.0
    recompute_bytes: float = 0.0     # full recomputation: the block being recomputed
    # A pipeline's micro-batches a step this was counted at (None: unpipelined, or unknown).
    microbatches: int | None = None

    @property
    def total_bytes(self) -> float:
        # The loss's fullest point and a recomputed block's come at different times: the
        # larger of the two on top of what is kept throughout.
        return (self.states.total_bytes + self.activations_bytes + self.working_bytes
                + self.accumulated_grad_bytes
                + max(self.logits_bytes + self.loss_transient_bytes, self.recompute_bytes))

    @property
    def usable_bytes(self) -> float:
        return self.capacity_bytes * self.usable_fraction

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.usable_bytes


# Keep 10% for the CUDA context, NCCL buffers and allocator fragmentation (rules of thumb add
# 10–20% plus a few GiB to a ZeRO-style estimate): the low end, because the estimate already
# counts logits.
USABLE_FRACTION = 0.90


def estimate(cfg: GPTConfig, *, micro_batch: int, capacity_bytes: float, stage: int, dp: int,
             tp: int = 1, pp: int = 1, recompute: Recompute = "none",
             precision: Precision = PRECISIONS["bf16"], sequence_parallel: bool = True,
             params: float | None = None, flash_attention: bool = False,
             accumulate_unsharded: bool = False, compiled: bool = False,
             step_in_backward: bool = False, unfused_linears: bool = False,
             compiled_loss: bool | None = None, loss_parallel: bool | None = None, cp: int = 1,
             microbatches: int | None = None, virtual_stages: int = 1,
             schedule: str = "1F1B", outputs_kept: OutputsKept = "none") -> MemoryEstimate:
    """Per-GPU memory of `cfg` trained with this layout (pipelined: the fuller of the first
    stage, with `first_stage_in_flight` micro-batches, and the last, with the output layer and
    loss; `microbatches` a step, unknown: at least p).

    `compiled`: blocks run through torch.compile (module docstring); `compiled_loss` (unset:
    as the blocks) the loss too, which torchtitan did not do before April 2025.

    `loss_parallel` (unset: with tensor parallelism, as Crucible and torchtitan run it): the
    loss over vocabulary-sharded logits (`loss_transient_bytes`).

    `cp`: context parallelism splits every sequence over cp ranks, so a rank's activations
    and logits are those of seq_len/cp tokens; FSDP shards over the data-parallel and context
    ranks together (torchtitan's dp_shard_cp mesh), which the caller counts in `dp`.

    `step_in_backward`: the optimizer steps each parameter as soon as its gradient is ready
    and frees that gradient (torchtitan's `optimizer.early_step_in_backward`; LOMO, Lv et al.
    2023, arXiv 2306.09782): no gradient of the whole model is kept, only the working set's.

    `outputs_kept`: what older pipeline schedules keep to the step's end (`OutputsKept`).

    `accumulate_unsharded`: gradients are reduced once a step, after the last of several
    micro-batches (`gradientSync: lastMicroBatch`), so each rank holds them all whole.

    `flash_attention`: fused attention (FlashAttention, Dao et al. 2022 §3.1, and PyTorch's
    SDPA kernels) does not store the s×s scores and softmax for backward but recomputes them
    blockwise, so without recomputation a layer holds what Korthikanti's selective
    recomputation holds; nanoGPT, torchtitan and Crucible's model all use SDPA.
    """
    if cp < 1 or cfg.seq_len % cp:
        raise ValueError(f"context parallel degree {cp} must divide seq_len {cfg.seq_len}")
    n = params if params is not None else param_count(cfg)
    local = dataclasses.replace(cfg, seq_len=cfg.seq_len // cp) if cp > 1 else cfg
    seq, vocab, value = local.seq_len, cfg.vocab_size, precision.activation_bytes
    compiled_loss = compiled if compiled_loss is None else compiled_loss
    loss_parallel = tp > 1 if loss_parallel is None else loss_parallel
    mp = tp * pp
    states = model_states(n, stage, dp, precision, model_parallel=mp)
    if step_in_backward:
        states = dataclasses.replace(states, grads_bytes=0.0)
    per_layer = block_activation_bytes(local, seq, micro_batch, tp, sequence_parallel, recompute,
                                       value, flash_attention, compiled, unfused_linears)
    head = head_activation_bytes(local, seq, micro_batch, value, tp)
    logits = logits_bytes(seq, micro_batch, vocab, tp, compiled_loss, value)
    transient = loss_transient_bytes(seq, micro_batch, vocab, tp, compiled_loss, value,
                                     loss_parallel)
    recomputed = (recomputed_block_bytes(local, seq, micro_batch, tp, sequence_parallel, value,
                                         flash_attention, compiled)
                  if recompute == "full" else 0.0)
    pipelined_fsdp = stage == 3 and pp > 1
    if pipelined_fsdp:
        working = pipeline_stage_bytes(n, precision, mp)
    else:
        working = fsdp_working_bytes(local, precision, mp) if stage == 3 else 0.0
    acts = cfg.layers * per_layer
    if pp == 1:
        acts += head
    else:
        # Every rank through its schedule's order (`pipeline_rank_fullest`); the fullest
        # wins. Per micro-batch in flight a stage keeps its blocks' activations and its output
        # (Korthikanti §4.2.3 counts the first 1F1B stage's p micro-batches); the last stage
        # keeps the head's and, beside them, the logits the loss keeps. Under ZeRO-3 a stage's
        # whole gradients (in `working`) exist from its first backward on.
        stages = pp * virtual_stages
        blocks = cfg.layers / stages * per_layer
        output = stage_output_bytes(seq, micro_batch, cfg.dim, tp, value)
        kept = last_stage_logits_bytes(seq, micro_batch, vocab, tp, compiled_loss, value)
        grads = precision.reduce_bytes * n / mp / virtual_stages if pipelined_fsdp else 0.0
        m = microbatches or pp
        own_logits = value * seq * micro_batch * vocab / tp   # the last stage's output
        fullest = None
        for rank in range(pp):
            held = [blocks + output] * virtual_stages
            during = [(recomputed, recomputed)] * virtual_stages
            stays = [(0.0, 0.0)] * virtual_stages
            buffers = 0.0
            if outputs_kept == "all":
                # Each stage's output kept, and each received input's gradient, to the step's
                # end; a receive buffer a micro-batch for every stage's input and its
                # gradient, made once and kept (torch 2.6's stage.py).
                stays = [(output, 0.0 if rank == 0 and local == 0 else output)
                         for local in range(virtual_stages)]
                held = [blocks] * virtual_stages
                receiving = virtual_stages - (rank == 0) + virtual_stages - (rank == pp - 1)
                buffers = m * output * receiving
            if rank == pp - 1:   # it holds the model's last stage, its last local one
                held[-1] = blocks + head + kept
                during[-1] = (max(recomputed, transient), recomputed)
                if outputs_kept != "none":   # the logits themselves stay to the step's end
                    held[-1] -= own_logits
                    stays[-1] = (own_logits, stays[-1][1])
            at = pipeline_rank_fullest(pipeline_rank_ops(pp, m, rank, virtual_stages, schedule),
                                       held, [grads] * virtual_stages, during, stays)
            at = dataclasses.replace(at, activations=at.activations + buffers)
            if fullest is None or at.total > fullest[1].total:
                fullest = (rank, at)
        rank, at = fullest
        if rank == pp - 1 and at.transient == transient > recomputed:
            # The loss's backward: its kept logits and transient, as unpipelined.
            logits = at.in_flight[-1] * kept
            if outputs_kept != "none":
                logits += (at.forwarded[-1] - at.in_flight[-1]) * own_logits
            acts = at.activations - logits
        else:   # a block's backward (recomputed, under full recomputation), or none
            logits, acts, transient, recomputed = 0.0, at.activations, 0.0, at.transient
        if pipelined_fsdp:   # only the gradients made by then are there
            working -= grads * virtual_stages - at.gradients
    accumulated = (accumulated_grad_bytes(n, mp, precision.reduce_bytes)
                   if accumulate_unsharded and not pipelined_fsdp else 0.0)
    gathered = (precision.param_bytes * n / mp if pipelined_fsdp
                else fsdp_gathered_bytes(local, precision, mp) if stage == 3 else 0.0)
    # The eval runs between a step's backward and its update (the loop evaluates when it
    # finishes a step, with the next one's gradients already made): every state is there.
    evaluation = (states.total_bytes + accumulated + gathered
                  + eval_forward_bytes(local, seq, micro_batch, tp, compiled, value))
    return MemoryEstimate(states, acts, logits, capacity_bytes, USABLE_FRACTION, working,
                          accumulated, transient, evaluation, recomputed,
                          microbatches if pp > 1 else None)
