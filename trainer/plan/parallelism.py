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
  ZeRO's 3Ψ is per forward and backward: FSDP2 (`fully_shard`, reshard_after_forward) gathers
  and reduce-scatters once per micro-batch when gradients sync every micro-batch (Crucible's
  `gradientSync: everyMicroBatch`, torchtitan's default), so a step of m micro-batches moves
  m times as much (`dp_bytes_per_step`). Under a pipeline, torch.distributed.pipelining keeps
  the gradients unsynchronised and the parameters gathered after each backward until the last
  (pipelining/stage.py): one reduce-scatter a step, about one gather a micro-batch. ZeRO-2
  reduce-scatters each micro-batch's gradients too (it keeps only its shard of them), ZeRO-1
  and DDP accumulate whole gradients and reduce once a step.
- HSDP (`Layout.shard_group`; Zhao et al. 2023, "PyTorch FSDP", §3.2.2, hybrid sharding):
  ZeRO-3 within shard groups, whose gathers and reduce-scatters stay inside a node when a
  group does, plus an all-reduce of each rank's gradient shard across the replicas (2·(r−1)/r
  of it a ring), over the inter-node link. Ranks are laid out as api/layout.py does:
  (pp, dp_replicate, dp_shard, tp), so a data-parallel group of one stage is dp·t consecutive
  ranks, inside a node when that is at most a node's GPUs.
- The layouts Crucible's trainer runs (`runnable`): FSDP (ZeRO-3) over the data-parallel
  ranks, or HSDP with a node's data-parallel ranks a shard group (`training.sharding: auto`
  on more than one node), tensor parallelism inside a node over whole heads and key/value
  heads, a 1F1B or GPipe pipeline fed at least one micro-batch per stage, or interleaved 1F1B
  (v stages a rank, rounds of about p micro-batches that divide the step's), recomputation
  none or full.
- Korthikanti et al. 2022 §5: selective recomputation costs ≈2.7% extra FLOPs for GPT-3
  (recomputing attention scores, 4·b·s²·h FLOPs per layer forward); full recomputation adds a
  forward pass, ≈ +1/3 of the 6N training FLOPs (2N of forward on top of 6N).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

from crucible.api import layout as api_layout
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


def dp_bytes_per_step(stage: int, precision: mem.Precision, microbatches: int = 1,
                      pipelined: bool = False) -> float:
    """Bytes a parameter puts on the data-parallel wire in a step of `microbatches` micro-batches
    a rank (module docstring): ZeRO-3 gathers twice and reduces once per micro-batch, or under
    a pipeline gathers once and reduces once a step (the stage stays gathered through the
    step: torch's stages reduce after the last micro-batch, and Crucible, as torchtitan, does
    not reshard a pipelined block after forward; an interleaved schedule with more than 3
    stages a rank frees and gathers some again mid-step, not counted); ZeRO-2 reduces once per
    micro-batch and gathers the updated parameters once; DDP and ZeRO-1 reduce once a step
    (no_sync while accumulating)."""
    if stage == 3 and pipelined:
        return precision.param_bytes + precision.reduce_bytes
    if stage == 3:
        return microbatches * dp_bytes_per_param(3, precision)
    if stage == 2:
        return microbatches * precision.reduce_bytes + precision.param_bytes
    return dp_bytes_per_param(stage, precision)


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
    # HSDP: ZeRO-3 within groups of this many dp ranks, replicated across the groups.
    shard_group: int | None = None

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def hybrid(self) -> bool:
        return self.stage == 3 and self.shard_group is not None and self.shard_group < self.dp

    def describe(self) -> str:
        parts = [(f"HSDP dp={self.dp} ({self.dp // self.shard_group} replicas x shard groups "
                  f"of {self.shard_group})") if self.hybrid
                 else f"{mem.STAGE_NAMES[self.stage]} dp={self.dp}"]
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
    pp_s: float = 0.0  # the point-to-point sends, on the critical path (not overlapped)

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
                flash_attention: bool = False, compiled: bool = False,
                schedule: str = "1F1B", virtual_stages: int = 1) -> LayoutCost:
    """Memory, traffic and step time for one layout (all estimates, see module docstring);
    a pipeline runs `schedule` over the step's micro-batches (the bubble is the same for 1F1B
    and GPipe, the memory is not; interleaved 1F1B with `virtual_stages` stages a rank cuts
    the bubble v-fold for v times the point-to-point traffic and more activations held)."""
    n = param_count(cfg)
    s, h, b = cfg.seq_len, cfg.dim, micro_batch
    micro = max(1, round(global_batch_tokens / (s * b * layout.dp)))
    # Compiled blocks come with a compiled loss only without tensor parallelism: Crucible's
    # trainer leaves the vocabulary-parallel loss eager (`loss_parallel` swaps DTensor's kernels
    # at run time, which a traced graph would skip; trainer/parallel.py `compile_model`).
    group = layout.shard_group if layout.hybrid else layout.dp
    est = mem.estimate(cfg, micro_batch=b, capacity_bytes=gpu.memory_bytes, stage=layout.stage,
                       dp=group, tp=layout.tp, pp=layout.pp, recompute=layout.recompute,
                       precision=precision, flash_attention=flash_attention, compiled=compiled,
                       compiled_loss=compiled and layout.tp == 1, microbatches=micro,
                       schedule=schedule, virtual_stages=virtual_stages)
    flops = flops_per_token(cfg) * global_batch_tokens * (1 + recompute_overhead(cfg, layout.recompute))
    compute_s = flops / (layout.gpus * gpu.peak_bf16_flops * mfu)
    bubble = bubble_fraction(layout.pp, micro, virtual_stages)
    # Data parallel: ring collectives move (d−1)/d of each collective's payload per GPU, within
    # the shard group (every dp rank, but under HSDP), on NVLink if the group's ranks are one
    # node's.
    shard = n / (layout.tp * layout.pp)
    internode = gpu.internode_bytes_per_s or 1e9
    dp_bytes = (shard * dp_bytes_per_step(layout.stage, precision, micro, layout.pp > 1)
                * (group - 1) / group)
    intra = group * layout.tp <= gpu.gpus_per_node
    dp_s = dp_bytes / (gpu.nvlink_one_way_bytes_per_s if intra else internode)
    if layout.hybrid:
        # Each gradient reduction also all-reduces the rank's shard across the replicas: once
        # a step under a pipeline, else once a micro-batch.
        replicas = layout.dp // group
        across = ((1 if layout.pp > 1 else micro) * 2 * precision.reduce_bytes * shard / group
                  * (replicas - 1) / replicas)
        dp_bytes += across
        dp_s += across / internode
    dp_exposed = max(0.0, dp_s - compute_s * 2 / 3)  # overlap with the backward pass
    # Tensor parallel: 8·b·s·h·(t−1)/t values per layer per micro-batch, over NVLink, half of
    # them in the forward: full recomputation runs the forward's collectives again.
    again = 1.5 if layout.recompute == "full" else 1.0
    tp_bytes = (8 * b * s * h * (layout.tp - 1) / layout.tp * BYTES_PER_COMM_VALUE
                * cfg.layers / layout.pp * micro * again)
    tp_s = tp_bytes / gpu.nvlink_one_way_bytes_per_s if layout.tp > 1 else 0.0
    # Pipeline: b·s·h values forward and back per micro-batch per stage boundary, each rank its
    # 1/t slice of the sequence under sequence parallelism; a rank of an interleaved pipeline
    # sends from each of its v stages.
    pp_bytes = (2 * b * s * h * BYTES_PER_COMM_VALUE * micro / layout.tp * virtual_stages
                if layout.pp > 1 else 0.0)
    # The sends stay on NVLink only when the whole pipeline is one node's (the pipeline is
    # the outermost mesh dimension: stages are consecutive blocks of dp·tp ranks).
    pp_link = (gpu.nvlink_one_way_bytes_per_s if layout.gpus <= gpu.gpus_per_node
               else internode)
    pp_s = pp_bytes / pp_link
    step = (compute_s + tp_s + pp_s) / (1 - bubble) + dp_exposed
    return LayoutCost(layout, est, micro, compute_s, dp_bytes, dp_s, dp_exposed, tp_bytes, tp_s,
                      pp_bytes, bubble, step, global_batch_tokens, pp_s)


def candidate_layouts(cfg: GPTConfig, gpus: int, gpus_per_node: int) -> list[Layout]:
    """Every dp·tp·pp = gpus with tp a power of two within a node dividing the heads and the
    key/value heads (each rank computes whole heads), pp dividing the layers, each ZeRO stage
    and recomputation mode."""
    out = []
    tps = [t for t in (1, 2, 4, 8, 16) if t <= min(gpus_per_node, gpus) and cfg.heads % t == 0
           and cfg.n_kv_heads % t == 0]
    for tp in tps:
        for pp in range(1, min(cfg.layers, gpus // tp) + 1):
            if (gpus % (tp * pp)) or cfg.layers % pp:
                continue
            dp = gpus // (tp * pp)
            for stage in (0, 1, 2, 3):
                # DeepSpeed forbids PP with ZeRO-2/3 (Transformer Math 101); FSDP2 under
                # torch.distributed.pipelining (torchtitan, Crucible) runs ZeRO-3 with it.
                if pp > 1 and stage == 2:
                    continue
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


# The schedules the planner picks from for Crucible's trainer (api/spec.py `ParallelismSpec`):
# 1F1B, or interleaved 1F1B with two stages a rank (torchtitan's default split) where the
# layers and the step's micro-batches allow it. GPipe is never picked over 1F1B: the same
# bubble, with all m micro-batches' activations held instead of at most p.
TRAINER_SCHEDULES = (("1F1B", 1), ("interleaved1F1B", 2))


@dataclass(frozen=True)
class JobLayout:
    """The layout a job on Crucible's trainer runs (`runnable`): its cost, the model (untied
    under a pipeline), the schedule, `training.sharding` (auto: HSDP across nodes where the
    layout is hybrid; fsdp: over every data-parallel rank) and what differs from the
    recommendation, one sentence each."""

    cost: LayoutCost
    model: GPTConfig
    schedule: str
    sharding: str
    notes: tuple[str, ...]
    virtual_stages: int = 1

    def describe(self) -> str:
        lay = self.cost.layout
        if lay.pp == 1:
            return lay.describe()
        stages = f", {self.virtual_stages} stages a rank" if self.virtual_stages > 1 else ""
        return f"{lay.describe()}, {self.schedule}{stages}"


def runnable_problem(cfg: GPTConfig, layout: Layout, microbatches: int,
                     procs_per_node: int, schedule: str = "1F1B",
                     virtual_stages: int = 1) -> str | None:
    """Why Crucible's trainer cannot run `layout` as is (None: it can). It shards with FSDP
    over the data-parallel ranks, recomputes all of a block or none of it (with fused
    attention, Korthikanti's selective recomputation keeps what none keeps), keeps tensor
    parallelism inside a node over whole heads, and feeds a pipeline at least one micro-batch
    per stage, equal whole layers per stage, and, interleaved, rounds that divide the step's
    micro-batches (api/layout.py `schedule_problem`)."""
    if layout.stage != 3:
        return (f"{mem.STAGE_NAMES[layout.stage]} over the data-parallel ranks, where the "
                "trainer shards with FSDP (ZeRO-3)")
    if layout.recompute not in ("none", "full"):
        return f"recompute={layout.recompute}: the trainer recomputes whole blocks or none"
    if procs_per_node % layout.tp or cfg.heads % layout.tp or cfg.n_kv_heads % layout.tp:
        return (f"tp={layout.tp} must divide the {procs_per_node} GPUs a node, the {cfg.heads} "
                f"heads and the {cfg.n_kv_heads} key/value heads")
    if layout.pp > 1:
        if cfg.layers % (layout.pp * virtual_stages):
            return (f"pp={layout.pp} x {virtual_stages} stages a rank do not divide the "
                    f"{cfg.layers} layers")
        problem = api_layout.schedule_problem(schedule, layout.pp, microbatches)
        if problem:
            return f"pp={layout.pp}: {problem}"
    return None


def _trainer_variants(lay: Layout, gpus: int, procs_per_node: int) -> list[tuple[Layout, str]]:
    """`lay` as the trainer shards it: with `training.sharding: auto` (HSDP with a node's
    data-parallel ranks a shard group, api/layout.py, when that is hybrid) and with `fsdp`."""
    out = [(lay, "fsdp")]
    if gpus % procs_per_node == 0:
        mesh = api_layout.layout("auto", None, world_size=gpus, local_world_size=procs_per_node,
                                 tensor=lay.tp, pipeline=lay.pp).dp
        if mesh.hybrid:
            out.append((dataclasses.replace(lay, shard_group=mesh.shard), "auto"))
        else:
            out = [(lay, "auto")]   # auto is FSDP here: no need to say fsdp
    return out


def runnable(cfg: GPTConfig, gpu: Accelerator, gpus: int, rec: Recommendation, *,
             global_batch_tokens: float, micro_batch: int, mfu: float,
             precision: mem.Precision = mem.PRECISIONS["bf16"], flash_attention: bool = False,
             compiled: bool = False) -> JobLayout | None:
    """The nearest layout to `rec.best` that Crucible's trainer runs and that fits: the one
    with the shortest estimated step, ties to `rec.best`'s tensor and pipeline degrees, then
    to less model parallelism and to `sharding: auto`; None if none fits.

    A pipeline needs an untied head (the first stage holds the embedding, the last the head),
    so a tied model is costed, and emitted, untied: V·h more parameters."""
    if rec.best is None:
        return None
    procs = min(gpus, gpu.gpus_per_node)
    pick = rec.best.layout
    options = []
    for base in candidate_layouts(cfg, gpus, gpu.gpus_per_node):
        if base.stage != 3 or base.recompute == "selective":
            continue
        model = dataclasses.replace(cfg, tied_embeddings=False) if base.pp > 1 else cfg
        schedules = TRAINER_SCHEDULES if base.pp > 1 else TRAINER_SCHEDULES[:1]
        for (lay, sharding), (schedule, virtual) in itertools.product(
                _trainer_variants(base, gpus, procs), schedules):
            cost = cost_layout(model, lay, gpu, global_batch_tokens=global_batch_tokens,
                               micro_batch=micro_batch, mfu=mfu, precision=precision,
                               flash_attention=flash_attention, compiled=compiled,
                               schedule=schedule, virtual_stages=virtual)
            if cost.memory.fits and runnable_problem(model, lay, cost.microbatches, procs,
                                                     schedule, virtual) is None:
                options.append((model, cost, sharding, schedule, virtual))
    if not options:
        return None
    model, cost, sharding, schedule, virtual = min(options, key=lambda o: (
        round(o[1].step_s, 6), (o[1].layout.tp, o[1].layout.pp) != (pick.tp, pick.pp),
        o[1].layout.tp * o[1].layout.pp, mem.RECOMPUTE_MODES.index(o[1].layout.recompute),
        o[2] != "auto", o[4]))
    lay, notes = cost.layout, []
    if (lay.tp, lay.pp, lay.stage, lay.recompute, lay.hybrid) != (
            pick.tp, pick.pp, pick.stage, pick.recompute, False):
        problem = runnable_problem(cfg, pick, rec.best.microbatches, procs)
        why = problem or "it is slower or does not fit under FSDP"
        notes.append(f"The recommended {pick.describe()} is not what Crucible's trainer runs "
                     f"({why}); the job runs the nearest runnable layout, {lay.describe()}"
                     + (f", {schedule} schedule" if lay.pp > 1 else "")
                     + (f" with {virtual} stages a rank" if virtual > 1 else "")
                     + f", estimated {cost.step_s:.3g} s a step against {rec.best.step_s:.3g} s.")
    if lay.pp > 1 and cfg.tied_embeddings:
        notes.append(f"A pipeline needs an untied head: the job unties the embeddings "
                     f"({cfg.vocab_size * cfg.dim / 1e6:.0f}M more parameters).")
    return JobLayout(cost, model, schedule, sharding, tuple(notes), virtual)
