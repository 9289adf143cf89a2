"""Parallel layouts: data (DDP/ZeRO), tensor and pipeline degrees; bubble, traffic, and a pick.

Owns layout enumeration, the pipeline bubble, communication volumes per step and a simple step
time model that says when tensor or pipeline parallelism earns its communication. Memory comes
from `memory`. Sources:
- Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM" (arXiv 2104.04473): bubble time over ideal time (p−1)/m (§2.2.1), i.e. a share
  (p−1)/(m+p−1) of the total; interleaved schedule (1/v)·(p−1)/m (§2.2.2); tensor parallelism
  all-reduces 8·b·s·h·(t−1)/t values per layer per micro-batch per GPU (§3.2); pipeline
  point-to-point moves b·s·h values per micro-batch between stages (§4.1); takeaway #1: tensor
  parallelism up to the GPUs in a node (NVLink), pipeline across nodes; #2: choose t·p just large
  enough to fit, then scale with data parallelism (§3).
- Rajbhandari et al. 2020 (ZeRO, §7): DDP and ZeRO-1/2 move 2Ψ per step (reduce-scatter +
  all-gather, or all-reduce); ZeRO-3 moves 3Ψ (parameters gathered in forward and backward).
  Each value is priced in the dtype it travels in (`precision`): gradients are reduced in the
  reduce dtype (fp32 under FSDP2 as Crucible and torchtitan set it up), parameters gathered in
  their compute dtype. So ZeRO-3 moves Ψ·(2·2 + 4) bytes in mixed precision, not 3Ψ·2.
- Korthikanti et al. 2022 §5: selective recomputation costs ≈2.7% extra FLOPs for GPT-3
  (recomputing attention scores, 4·b·s²·h FLOPs per layer forward); full recomputation adds a
  forward pass, ≈ +1/3 of the 6N training FLOPs (2N of forward on top of 6N).
"""

from __future__ import annotations

from dataclasses import dataclass

from crucible.api.arch import GPTConfig, flops_per_token, param_count
from crucible.trainer.hardware import Accelerator
from crucible.trainer.plan import memory as mem

BYTES_PER_COMM_VALUE = 2  # bf16 activations on the wire (tensor and pipeline parallelism)


def dp_bytes_per_param(stage: int, precision: mem.Precision) -> float:
    """Bytes a parameter puts on the data-parallel wire each step, before the ring's
    (d−1)/d (ZeRO §7, module docstring): DDP all-reduces gradients (a reduce-scatter and an
    all-gather, both in the reduce dtype); ZeRO-1/2 reduce-scatter the gradients and
    all-gather the updated parameters; ZeRO-3 gathers the parameters twice (forward and
    backward) and reduce-scatters the gradients."""
    if stage == 3:
        return 2 * precision.param_bytes + precision.reduce_bytes
    if stage in (1, 2):
        return precision.param_bytes + precision.reduce_bytes
    return 2 * precision.reduce_bytes


def bubble_fraction(pp: int, microbatches: int, interleave: int = 1) -> float:
    """Share of a step's time the pipeline idles: (p−1)/(v·m + p−1) (Narayanan §2.2).

    Equals (p−1)/(m+p−1) for 1F1B/GPipe (v = 1); bubble over ideal time is (p−1)/(v·m).
    """
    if pp < 1 or microbatches < 1 or interleave < 1:
        raise ValueError("pipeline stages, micro-batches and interleave must be >= 1")
    ideal_ratio = (pp - 1) / (interleave * microbatches)
    return ideal_ratio / (1 + ideal_ratio)


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int
    pp: int
    stage: int  # ZeRO stage over the dp ranks
    recompute: mem.Recompute

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp

    def describe(self) -> str:
        parts = [f"{mem.STAGE_NAMES[self.stage]} dp={self.dp}"]
        if self.tp > 1:
            parts.append(f"tp={self.tp} (+sequence parallel)")
        if self.pp > 1:
            parts.append(f"pp={self.pp}")
        parts.append(f"recompute={self.recompute}")
        return ", ".join(parts)


@dataclass(frozen=True)
class LayoutCost:
    """A layout with its memory, traffic and estimated step time."""

    layout: Layout
    memory: mem.MemoryEstimate
    microbatches: int  # per data-parallel rank per optimizer step (accumulation × pipeline)
    compute_s: float  # at the given MFU, recomputation included
    dp_bytes: float  # per GPU per step
    dp_s: float
    dp_exposed_s: float  # not hidden behind the backward pass
    tp_bytes: float
    tp_s: float  # on the critical path (Megatron TP all-reduces are not overlapped)
    pp_bytes: float
    bubble: float
    step_s: float
    batch_tokens: float

    @property
    def tokens_per_s(self) -> float:
        return self.batch_tokens / self.step_s


def recompute_overhead(cfg: GPTConfig, recompute: mem.Recompute) -> float:
    """Extra FLOPs as a share of the training FLOPs per token."""
    if recompute == "none":
        return 0.0
    train = flops_per_token(cfg)
    if recompute == "full":
        return (train / 3) / train  # one more forward: 2N of the 6N
    if recompute == "selective-op":
        # The forward of the matmuls it does not keep (the attention's projection, the MLP's
        # down), 2·(h² + h·f) FLOPs per token per layer; the pointwise ops are noise.
        return 2 * (cfg.dim ** 2 + cfg.dim * cfg.ffn_dim) * cfg.layers / train
    # selective: QKᵀ and attention·V again, 4·s·h FLOPs per token per layer (forward)
    return 4 * cfg.seq_len * cfg.dim * cfg.layers / train


def cost_layout(cfg: GPTConfig, layout: Layout, gpu: Accelerator, *, global_batch_tokens: float,
                micro_batch: int, mfu: float, precision: mem.Precision = mem.PRECISIONS["bf16"],
                flash_attention: bool = False, compiled: bool = False) -> LayoutCost:
    """Memory, traffic and step time for one layout (all estimates, see module docstring)."""
    n = param_count(cfg)
    s, h, b = cfg.seq_len, cfg.dim, micro_batch
    est = mem.estimate(cfg, micro_batch=b, capacity_bytes=gpu.memory_bytes, stage=layout.stage,
                       dp=layout.dp, tp=layout.tp, pp=layout.pp, recompute=layout.recompute,
                       precision=precision, flash_attention=flash_attention, compiled=compiled)
    micro = max(1, round(global_batch_tokens / (s * b * layout.dp)))
    flops = flops_per_token(cfg) * global_batch_tokens * (1 + recompute_overhead(cfg, layout.recompute))
    compute_s = flops / (layout.gpus * gpu.peak_bf16_flops * mfu)
    bubble = bubble_fraction(layout.pp, micro)
    # Data parallel: ring collectives move (d−1)/d of each collective's payload per GPU.
    shard = n / (layout.tp * layout.pp)
    dp_bytes = shard * dp_bytes_per_param(layout.stage, precision) * (layout.dp - 1) / layout.dp
    intra = layout.gpus <= gpu.gpus_per_node
    dp_bw = gpu.nvlink_one_way_bytes_per_s if intra else (gpu.internode_bytes_per_s or 1e9)
    dp_s = dp_bytes / dp_bw
    dp_exposed = max(0.0, dp_s - compute_s * 2 / 3)  # overlap with the backward pass
    # Tensor parallel: 8·b·s·h·(t−1)/t values per layer per micro-batch, over NVLink.
    tp_bytes = (8 * b * s * h * (layout.tp - 1) / layout.tp * BYTES_PER_COMM_VALUE
                * cfg.layers / layout.pp * micro)
    tp_s = tp_bytes / gpu.nvlink_one_way_bytes_per_s if layout.tp > 1 else 0.0
    # Pipeline: b·s·h values forward and back per micro-batch per stage boundary.
    pp_bytes = 2 * b * s * h * BYTES_PER_COMM_VALUE * micro if layout.pp > 1 else 0.0
    step = (compute_s + tp_s) / (1 - bubble) + dp_exposed
    return LayoutCost(layout, est, micro, compute_s, dp_bytes, dp_s, dp_exposed, tp_bytes, tp_s,
                      pp_bytes, bubble, step, global_batch_tokens)


def candidate_layouts(cfg: GPTConfig, gpus: int, gpus_per_node: int) -> list[Layout]:
    """Every dp·tp·pp = gpus with tp a power of two within a node dividing the heads, pp
    dividing the layers, each ZeRO stage and recomputation mode."""
    out = []
    tps = [t for t in (1, 2, 4, 8, 16) if t <= min(gpus_per_node, gpus) and cfg.heads % t == 0]
    for tp in tps:
        for pp in range(1, min(cfg.layers, gpus // tp) + 1):
            if (gpus % (tp * pp)) or cfg.layers % pp:
                continue
            dp = gpus // (tp * pp)
            for stage in (0, 1, 2, 3):
                if pp > 1 and stage >= 2:
                    continue  # DeepSpeed forbids PP with ZeRO-2/3 (Transformer Math 101)
                for rc in mem.RECOMPUTE_MODES:
                    out.append(Layout(dp, tp, pp, stage, rc))
    return out


@dataclass(frozen=True)
class Recommendation:
    best: LayoutCost | None
    smallest_sharding: LayoutCost | None  # the least sharded data-parallel layout that fits
    considered: int
    reasons: tuple[str, ...]


def recommend(cfg: GPTConfig, gpu: Accelerator, gpus: int, *, global_batch_tokens: float,
              micro_batch: int, mfu: float, precision: mem.Precision = mem.PRECISIONS["bf16"],
              flash_attention: bool = False, compiled: bool = False) -> Recommendation:
    """The fitting layout with the shortest estimated step; ties go to less model parallelism."""
    costs = [cost_layout(cfg, lay, gpu, global_batch_tokens=global_batch_tokens,
                         micro_batch=micro_batch, mfu=mfu, precision=precision,
                         flash_attention=flash_attention, compiled=compiled)
             for lay in candidate_layouts(cfg, gpus, gpu.gpus_per_node)]
    fitting = [c for c in costs if c.memory.fits]
    pure_dp = [c for c in fitting if c.layout.tp == c.layout.pp == 1]
    smallest = min(pure_dp, key=lambda c: (c.layout.stage, mem.RECOMPUTE_MODES.index(c.layout.recompute)),
                   default=None)
    if not fitting:
        return Recommendation(None, None, len(costs), (
            f"no layout of {gpus} × {gpu.name} fits: even the most sharded needs more than "
            f"{mem.USABLE_FRACTION:.0%} of {gpu.memory_bytes / 1e9:.0f} GB per GPU; add GPUs, "
            "shorten the sequence or lower the micro-batch",))
    best = min(fitting, key=lambda c: (round(c.step_s, 6), c.layout.tp * c.layout.pp,
                                       c.layout.stage, mem.RECOMPUTE_MODES.index(c.layout.recompute)))
    reasons = []
    lay = best.layout
    if lay.tp == lay.pp == 1:
        reasons.append("data parallelism alone fits, so tensor/pipeline parallelism would only add "
                       "communication (Narayanan et al. 2021, takeaway #2)")
    if lay.tp > 1:
        reasons.append(f"tensor parallelism t={lay.tp} stays inside one {gpu.gpus_per_node}-GPU "
                       f"NVLink node; it moves {best.tp_bytes / 1e9:.2f} GB per GPU per step "
                       "(8·b·s·h·(t−1)/t per layer per micro-batch, Narayanan §3.2)")
    if lay.pp > 1:
        reasons.append(f"pipeline p={lay.pp} with m={best.microbatches} micro-batches idles "
                       f"{best.bubble:.1%} of the step ((p−1)/(m+p−1), Narayanan §2.2)")
    if lay.stage == 3:
        reasons.append("ZeRO-3/FSDP shards parameters too: it gathers them twice a step on top "
                       f"of reducing the gradients, {dp_bytes_per_param(3, precision):g} bytes a "
                       "parameter on the wire (ZeRO §7), needed for the states to fit")
    if lay.recompute != "none":
        reasons.append(f"{lay.recompute} recomputation costs "
                       f"{recompute_overhead(cfg, lay.recompute):.1%} extra FLOPs but is what fits "
                       "(Korthikanti et al. 2022)")
    return Recommendation(best, smallest, len(costs), tuple(reasons))
