"""`crucible plan`'s core: from any two of N, D, C (or a model) to a full, explained plan.

Owns resolving the inputs (which of N, D, C were given, GPU-hours → FLOPs) and assembling the
sections from `scaling`, `memory`, `parallelism`, `cost` and `reliability`; computes nothing of
its own beyond glue. Pure: `make_plan(PlanInputs) -> Plan`; raises ValueError with a message a
person can act on. Assumptions that are not from a paper are named as such where they are set.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from crucible.api import layout, sharding
from crucible.api.arch import GPTConfig, flops_per_token, non_embedding_params, param_count
from crucible.trainer.hardware import Accelerator, accelerator
from crucible.trainer.plan import cost as costs
from crucible.trainer.plan import memory as mem
from crucible.trainer.plan import parallelism as par
from crucible.trainer.plan import recipes, reliability, scaling
from crucible.trainer.plan.report import Section

# Stated assumptions (not from a paper), used only when --save-seconds/--restart-seconds are absent:
ASSUMED_D2H_BYTES_PER_S = 5e9  # async save blocks for the device-to-host copy of each shard
ASSUMED_RESTART_S = 300.0  # reschedule pods, rendezvous, load the newest checkpoint
# Crucible's model, nanoGPT and torchtitan all run attention through fused SDPA kernels, which
# never store the s×s scores: "no recomputation" then holds what Korthikanti's selective does.
FLASH_ATTENTION = True
# An HGX/DGX node: what `training.sharding: auto` makes a shard group of on a multi-node job.
CHINCHILLA = "Hoffmann et al. 2022"
BESIROGLU = "Besiroglu et al. 2024, Table 1"


@dataclass(frozen=True)
class PlanInputs:
    params: float | None = None
    tokens: float | None = None
    compute_flops: float | None = None
    gpu_hours: float | None = None
    model: GPTConfig | None = None
    preset: str | None = None
    gpu: str = "h100"
    gpus: int = 8
    mfu: float = costs.DEFAULT_MFU
    seq_len: int = 2048
    micro_batch: int = 4
    global_batch_tokens: float | None = None
    mtbf_hours: float | None = None
    save_seconds: float | None = None
    restart_seconds: float | None = None
    price_usd_per_gpu_hour: float | None = None
    inference_tokens: float = 0.0
    precision: str = "bf16"
    compiled: bool = True   # blocks and loss compiled (training.compile's default on CUDA)


@dataclass
class Plan:
    params: float
    tokens: float
    compute_flops: float
    model: GPTConfig
    model_is_derived: bool
    gpu: Accelerator
    recommendation: par.Recommendation
    fsdp: par.LayoutCost | None  # the layout Crucible's trainer runs (ZeRO-3 over all GPUs)
    checkpoint: reliability.CheckpointPlan
    # With tensor or pipeline parallelism recommended: what `--emit-job` runs instead of `fsdp`.
    job: par.JobLayout | None = None
    # training.sharding for --emit-job: what `job` runs, else auto where its HSDP fits and fsdp
    # (what `fsdp` counts) where it does not.
    sharding: str = "auto"
    sections: list[Section] = field(default_factory=list)


def resolve_budget(inp: PlanInputs, gpu: Accelerator) -> tuple[float, float, float, str]:
    """(N, D, C, how) from any two of N, D, C, or one of them plus the compute-optimal rule."""
    params = inp.params
    if inp.model is not None:
        counted = param_count(inp.model)
        if params is not None and abs(params / counted - 1) > 0.1:
            raise ValueError(f"--params {params:.3g} disagrees with the model's {counted:.3g} "
                             "parameters; give one or the other")
        params = float(counted)
    compute = inp.compute_flops
    if inp.gpu_hours is not None:
        if compute is not None:
            raise ValueError("give --compute or --gpu-hours, not both")
        compute = costs.compute_from_gpu_hours(inp.gpu_hours, gpu, inp.mfu)
    given = {k: v for k, v in (("N", params), ("D", inp.tokens), ("C", compute)) if v is not None}
    for name, value in given.items():
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"{name} must be a positive number, got {value!r}")
    fit = scaling.BESIROGLU
    if len(given) == 3:
        raise ValueError("give any two of parameters, tokens and compute, not all three "
                         "(the third follows from C = 6ND)")
    if not given:
        raise ValueError("give at least one of --params/--model, --tokens, --compute/--gpu-hours")
    six = scaling.FLOPS_PER_PARAM_TOKEN
    if "N" in given and "D" in given:
        return params, inp.tokens, six * params * inp.tokens, "C = 6ND"
    if "N" in given and "C" in given:
        return params, compute / (six * params), compute, "D = C/(6N)"
    if "D" in given and "C" in given:
        return compute / (six * inp.tokens), inp.tokens, compute, "N = C/(6D)"
    if "C" in given:
        opt = fit.optimum(compute)
        return opt.params, opt.tokens, compute, "compute-optimal N, D for C (Besiroglu refit)"
    if "N" in given:
        c = fit.compute_for_params(params)
        return params, c / (six * params), c, "compute-optimal D for N (Besiroglu refit)"
    c = fit.compute_for_tokens(inp.tokens)
    return c / (six * inp.tokens), inp.tokens, c, "compute-optimal N for D (Besiroglu refit)"


def make_plan(inp: PlanInputs) -> Plan:
    gpu = accelerator(inp.gpu)
    if inp.gpus < 1:
        raise ValueError(f"--gpus must be >= 1, got {inp.gpus}")
    if not 0 < inp.mfu <= 1:
        raise ValueError(f"--mfu must be in (0, 1], got {inp.mfu}")
    if inp.micro_batch < 1 or inp.seq_len < 8:
        raise ValueError("--micro-batch must be >= 1 and --seq-len >= 8")
    if inp.precision not in mem.PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(mem.PRECISIONS)}")
    n, d, c, how = resolve_budget(inp, gpu)
    derived = inp.model is None
    cfg = inp.model or recipes.shape_for_params(n, inp.seq_len)
    precision = mem.PRECISIONS[inp.precision]
    batch = inp.global_batch_tokens or recipes.gpt3_row(n).batch_tokens
    rec = par.recommend(cfg, gpu, inp.gpus, global_batch_tokens=batch,
                        micro_batch=inp.micro_batch, mfu=inp.mfu, precision=precision,
                        flash_attention=FLASH_ATTENTION, compiled=inp.compiled)
    fsdp = _crucible_layout(cfg, gpu, inp, batch, crucible_precision(precision))
    job = None
    if rec.best is not None and rec.best.layout.tp * rec.best.layout.pp > 1:
        job = par.runnable(cfg, gpu, inp.gpus, rec, global_batch_tokens=batch,
                           micro_batch=inp.micro_batch, mfu=inp.mfu,
                           precision=crucible_precision(precision),
                           flash_attention=FLASH_ATTENTION, compiled=inp.compiled)
    train_flops = flops_per_token(cfg) * d
    price = inp.price_usd_per_gpu_hour
    money = costs.training_cost(train_flops, gpu, inp.gpus, inp.mfu, price)
    mtbf_s = inp.mtbf_hours * 3600 if inp.mtbf_hours else reliability.job_mtbf_s(inp.gpus)
    # What DCP saves of FSDP's state: the most precise copy of each weight and Adam's m and v
    # (12 bytes a parameter with an fp32 master, 10 rounding stochastically into bf16).
    save_s = inp.save_seconds if inp.save_seconds else (
        crucible_precision(precision).checkpoint_bytes * n / inp.gpus / ASSUMED_D2H_BYTES_PER_S)
    restart_s = ASSUMED_RESTART_S if inp.restart_seconds is None else inp.restart_seconds
    ckpt = reliability.plan_checkpoints(money.wall_s, save_s, mtbf_s, restart_s)
    if job is not None:
        sharding_mode = job.sharding
    else:
        sharding_mode = (_sharding(cfg, gpu, inp, fsdp, crucible_precision(precision))
                         if fsdp else "auto")
    plan = Plan(n, d, c, cfg, derived, gpu, rec, fsdp, ckpt, job, sharding_mode)
    plan.sections = [
        _budget_section(plan, inp, how),
        _scaling_section(plan, inp),
        _memory_section(plan, inp, precision),
        _parallel_section(plan, inp, batch),
        _cost_section(plan, inp, money, train_flops),
        _checkpoint_section(plan, inp),
    ]
    return plan


# What Crucible's trainer runs: bf16 with an fp32 master, fp32, or bf16 rounded stochastically
# (training.optimizer.bf16StochasticRounding); never all-bf16 AdamW moments.
CRUCIBLE_PRECISIONS = ("bf16", "fp32", "bf16-sr")


def crucible_precision(precision: mem.Precision) -> mem.Precision:
    """What Crucible's trainer keeps for a plan at `precision`: the same, if it runs it, else
    mixed precision with its fp32 master."""
    return precision if precision.name in CRUCIBLE_PRECISIONS else mem.PRECISIONS["bf16"]


def _crucible_layout(cfg, gpu, inp, batch, precision) -> par.LayoutCost | None:
    """Crucible trains with FSDP (ZeRO-3) over every GPU; activation checkpointing is on/off."""
    for rc in ("none", "full"):
        lay = par.Layout(inp.gpus, 1, 1, 3, rc)
        c = par.cost_layout(cfg, lay, gpu, global_batch_tokens=batch, micro_batch=inp.micro_batch,
                            mfu=inp.mfu, precision=precision, flash_attention=FLASH_ATTENTION,
                            compiled=inp.compiled)
        if c.memory.fits:
            return c
    return None


def _sharding(cfg: GPTConfig, gpu: Accelerator, inp: PlanInputs, planned: par.LayoutCost,
              precision: mem.Precision) -> str:
    """`auto` if what it runs fits (HSDP with a node's data-parallel ranks a shard group, on
    more than one node: api/layout.py), else `fsdp`, the sharding over every data-parallel rank
    that the plan's memory counts."""
    lay = planned.layout
    per_node = min(inp.gpus, gpu.gpus_per_node)
    if inp.gpus % per_node:
        return "auto"
    mesh = layout.layout("auto", None, world_size=inp.gpus, local_world_size=per_node,
                         tensor=lay.tp, pipeline=lay.pp).dp
    if not mesh.hybrid:
        return "auto"
    hsdp = mem.estimate(cfg, micro_batch=inp.micro_batch, capacity_bytes=gpu.memory_bytes,
                        stage=3, dp=mesh.shard, tp=lay.tp, pp=lay.pp, recompute=lay.recompute,
                        precision=precision, flash_attention=FLASH_ATTENTION,
                        compiled=inp.compiled, compiled_loss=inp.compiled and lay.tp == 1,
                        microbatches=planned.microbatches)
    return "auto" if hsdp.fits else "fsdp"


def _budget_section(plan: Plan, inp: PlanInputs, how: str) -> Section:
    s = Section("Budget")
    s.add("params", "parameters N", plan.params, "param", "given" if inp.params or inp.model else how)
    s.add("tokens", "training tokens D", plan.tokens, "token", "given" if inp.tokens else how)
    s.add("compute", "compute C", plan.compute_flops, "FLOP",
          "given" if inp.compute_flops else ("GPU-hours·3600·peak·MFU" if inp.gpu_hours else how),
          "C ≈ 6ND, Hoffmann et al. 2022 §2")
    s.add("tokens_per_param", "tokens per parameter", plan.tokens / plan.params, "1", "D/N",
          "≈20 is compute-optimal (Chinchilla Table 3)")
    cfg = plan.model
    kv = f" kv_heads={cfg.n_kv_heads}" if cfg.n_kv_heads != cfg.heads else ""
    s.add("shape", "model shape", f"L={cfg.layers} d={cfg.dim} heads={cfg.heads}{kv} "
          f"f={cfg.ffn_dim} {cfg.mlp} seq={cfg.seq_len} V={cfg.vocab_size}", "1",
          "derived: 12·L·d²+V·d ≈ N, d/L≈128 (GPT-3 Table 2.1)" if plan.model_is_derived else "given")
    if plan.model_is_derived:
        s.notes.append("No --model given: the shape above is derived from N for memory and "
                       "parallelism estimates; pass --model PRESET for exact figures.")
    return s


def _scaling_section(plan: Plan, inp: PlanInputs) -> Section:
    s = Section("Compute-optimal split of C")
    c, fit = plan.compute_flops, scaling.BESIROGLU
    rows = [
        fit.optimum(c),
        scaling.chinchilla_rule(c),
        scaling.kaplan_allocation(c),
        scaling.HOFFMANN_ROUNDED.optimum(c),
        scaling.Allocation("this plan", plan.params, plan.tokens, c,
                           fit.loss(plan.params, plan.tokens), "given"),
    ]
    keys = ["besiroglu", "rule_20", "kaplan", "hoffmann_rounded", "plan"]
    sources = [BESIROGLU, f"{CHINCHILLA} Table 3", "Kaplan et al. 2020 §6.1 Fig. 14",
               f"{CHINCHILLA} eq. 10 as printed", ""]
    for key, alloc, src in zip(keys, rows, sources):
        s.add(f"{key}.params", f"{alloc.name}: N", alloc.params, "param", alloc.formula, src)
        s.add(f"{key}.tokens", f"{alloc.name}: D", alloc.tokens, "token", alloc.formula, src)
        loss = fit.loss(alloc.params, alloc.tokens)
        s.add(f"{key}.loss", f"{alloc.name}: predicted loss", loss, "1",
              "L = E + A/N^α + B/D^β (refit constants)", BESIROGLU)
        if key in ("kaplan", "plan", "rule_20"):
            w = scaling.waste(alloc, fit)
            s.add(f"{key}.wasted_compute", f"{alloc.name}: compute wasted vs optimum",
                  w.wasted_flops, "FLOP", "6ND − C*(same loss)", BESIROGLU)
            s.add(f"{key}.wasted_fraction", f"{alloc.name}: share wasted", w.wasted_fraction, "1",
                  "(6ND − C*)/6ND", BESIROGLU, percent=True)
    s.notes.append(scaling.ROUNDING_NOTE)
    s.notes.append("Kaplan's N counts non-embedding parameters and its loss is on WebText2; all "
                   "allocations here are judged by the same refit loss for comparability.")
    if inp.inference_tokens > 0:
        target = fit.loss(plan.params, plan.tokens)
        ia = scaling.inference_aware(fit, target, inp.inference_tokens)
        base = (scaling.FLOPS_PER_PARAM_TOKEN * plan.params * plan.tokens
                + scaling.INFERENCE_FLOPS_PER_PARAM_TOKEN * plan.params * inp.inference_tokens)
        src = "Sardana et al. 2024 §3"
        s.add("inference.params", "inference-aware N (same loss)", ia.params, "param",
              "argmin 6ND + 2N·D_inf s.t. L(N,D)=L", src)
        s.add("inference.tokens", "inference-aware D", ia.tokens, "token", "D(N) solving L(N,D)=L", src)
        s.add("inference.total", "inference-aware train+serve FLOPs", ia.total_flops, "FLOP",
              "6ND + 2N·D_inf", src)
        s.add("inference.saved", "saved vs this plan", base - ia.total_flops, "FLOP",
              "(6ND + 2N·D_inf)[plan] − [inference-aware]", src)
    else:
        s.notes.append("Serving many tokens favours a smaller model trained longer (Sardana et al. "
                       "2024); pass --inference-tokens to size for it.")
    return s


def _memory_section(plan: Plan, inp: PlanInputs, precision: mem.Precision) -> Section:
    s = Section(f"Memory per GPU ({inp.gpus} × {plan.gpu.name}, micro-batch {inp.micro_batch})")
    cfg, src = plan.model, "Rajbhandari et al. 2020 §3.1, Fig. 1"
    p = precision
    s.add("state_bytes_per_param", f"bytes a parameter keeps ({p.name})", p.state_bytes, "B",
          f"params {p.param_bytes:g} + grads {p.grad_bytes:g} + AdamW m, v {p.moment_bytes:g} "
          f"+ fp32 master {p.master_bytes:g}; reduced in {p.reduce_bytes * 8:g}-bit",
          "trainer/plan/precision.py")
    for stage, name in mem.STAGE_NAMES.items():
        st = mem.model_states(plan.params, stage, inp.gpus, precision)
        s.add(f"states.zero{stage}", f"{name} params+grads+optimizer", st.total_bytes, "B",
              ["(2+2+K)Ψ", "4Ψ + KΨ/N_d", "2Ψ + (2+K)Ψ/N_d", "(2+2+K)Ψ/N_d"][stage] + f", K={precision.optimizer_bytes:g}",
              src)
    src_acts = "Crucible's block, op by op (trainer/plan/memory.py); Korthikanti et al. 2022"
    kind = "compiled" if inp.compiled else "eager"
    per_block = mem.block_activation_values(cfg, inp.compiled)
    block = (f"{kind}: norms {per_block['norms']:g} + attention {per_block['attention']:g} + "
             f"MLP {per_block['mlp']:g} values/token")
    for rc, formula in (("none", f"L·sb({block} + h + 2.5as), scores and a transposed output "
                                 "copy stored (no fused attention)"),
                        ("selective", f"L·sb({block} + h), the attention output's transposed "
                                      "copy (none with FlashAttention/SDPA, which writes no "
                                      "copy, is this less L·sbh)"),
                        ("full", "L·sbh (each block's input)")):
        acts = cfg.layers * mem.block_activation_bytes(
            cfg, cfg.seq_len, inp.micro_batch, recompute=rc,
            bytes_per_value=precision.activation_bytes, flash_attention=False,
            compiled=inp.compiled)
        s.add(f"activations.{rc}", f"activations, recompute={rc}", acts, "B", formula, src_acts)
    if inp.compiled:
        s.add("logits", f"logits kept by the compiled loss ({precision.name})",
              mem.logits_bytes(cfg.seq_len, inp.micro_batch, cfg.vocab_size, compiled=True,
                               bytes_per_value=precision.activation_bytes),
              "B", f"{precision.activation_bytes}·s·b·V + 8·s·b", "measured: inductor's saved set")
    else:
        s.add("logits", "fp32 logits", mem.logits_bytes(cfg.seq_len, inp.micro_batch,
                                                         cfg.vocab_size),
              "B", "4·s·b·V", "Megatron theoretical_memory_usage.py")
    s.add("loss_transient", f"the loss at its fullest, beyond what it keeps ({kind})",
          mem.loss_transient_bytes(cfg.seq_len, inp.micro_batch, cfg.vocab_size,
                                   compiled=inp.compiled,
                                   bytes_per_value=precision.activation_bytes),
          "B", f"{precision.activation_bytes}·s·b·V (the logits' gradient)" if inp.compiled
          else "8·s·b·V (two fp32 gradients at the backward's start)",
          "measured: the CPU allocator's events (trainer/plan/memory.py)")
    s.add("fsdp_working", "FSDP gathered root + 2 blocks, whole root gradient (reduce dtype)",
          mem.fsdp_working_bytes(cfg, precision), "B",
          f"{precision.param_bytes:g}·(root + 2·block) + {precision.reduce_bytes:g}·root (ZeRO-3)",
          "trainer/parallel.py's wrapping (torchtitan's)")
    s.add("eval_forward", f"held-out eval, the forward at its fullest ({kind})",
          mem.eval_forward_bytes(cfg, cfg.seq_len, inp.micro_batch, compiled=inp.compiled,
                                 bytes_per_value=precision.activation_bytes),
          "B", "s·b·max(one block, head + logits), no autograd",
          "measured: the CPU allocator's events (trainer/plan/memory.py)")
    s.add("accumulated_grads", "gradients kept whole in the reduce dtype (gradientSync: "
          "lastMicroBatch)", mem.accumulated_grad_bytes(plan.params, 1, precision.reduce_bytes),
          "B", f"{precision.reduce_bytes:g}Ψ, only with several micro-batches",
          "FSDP2 set_requires_gradient_sync(False)")
    s.notes.append(
        "Activations are counted as compiled blocks and loss keep them (training.compile, on by "
        "default on CUDA: RMSNorm's normalised input and SwiGLU's silu(gate) are recomputed, "
        "the logits stay bf16); --eager counts them as eager PyTorch keeps them."
        if inp.compiled else
        "Activations are counted as eager PyTorch keeps them (--eager, training.compile: "
        "false); compiled blocks and loss, the default on CUDA, keep fewer.")
    s.add("capacity", f"{plan.gpu.name} memory (usable {mem.USABLE_FRACTION:.0%})",
          plan.gpu.memory_bytes, "B", "datasheet", "trainer/hardware.py")
    if crucible_precision(precision) is not precision:
        s.notes.append(f"Crucible's trainer keeps an fp32 master; its FSDP lines below count "
                       f"that (16 bytes a parameter), not {precision.name}'s states.")
    if plan.fsdp is not None:
        s.add("crucible_fsdp", "Crucible FSDP total", plan.fsdp.memory.total_bytes, "B",
              f"ZeRO-3 + activation checkpointing {'on' if plan.fsdp.layout.recompute == 'full' else 'off'}",
              "states + activations + logits and the loss's transient + FSDP working set")
        s.add("crucible_fsdp_eval", "Crucible FSDP total during eval", plan.fsdp.memory.eval_bytes,
              "B", "model states + gathered root and blocks + eval forward",
              "the eval runs before the next step's update; never above the step's at one "
              "micro-batch")
    else:
        s.notes.append("Crucible's FSDP layout does not fit even with activation checkpointing: "
                       "add GPUs, or lower --micro-batch / --seq-len.")
    per_node = plan.gpu.gpus_per_node
    if plan.fsdp is not None and inp.gpus > per_node and inp.gpus % per_node == 0:
        # What `training.sharding: auto` runs on more than one node: the model state sharded
        # within each node and held once per node; activations and logits as under FSDP.
        mesh = sharding.mesh_shape("auto", None, world_size=inp.gpus,
                                   local_world_size=per_node)
        hsdp = mem.estimate(cfg, micro_batch=inp.micro_batch, capacity_bytes=plan.gpu.memory_bytes,
                            stage=3, dp=mesh.shard, recompute=plan.fsdp.layout.recompute,
                            precision=crucible_precision(precision),
                            flash_attention=FLASH_ATTENTION,
                            compiled=inp.compiled)
        s.add("crucible_hsdp", "Crucible HSDP total (sharding: auto)", hsdp.total_bytes, "B",
              f"{mesh.describe()}: ZeRO-3 within a node"
              + ("" if hsdp.fits else " — does not fit: set training.sharding: fsdp"),
              "states/shard group + activations + logits")
    return s


def _parallel_section(plan: Plan, inp: PlanInputs, batch: float) -> Section:
    s = Section("Parallelism")
    rec, gpu = plan.recommendation, plan.gpu
    s.add("nvlink", "assumed NVLink, one direction", gpu.nvlink_one_way_bytes_per_s, "B/s",
          "datasheet/2", "trainer/hardware.py")
    s.add("internode", "assumed inter-node, per GPU", gpu.internode_bytes_per_s, "B/s",
          "DGX datasheets", "trainer/hardware.py")
    s.add("global_batch", "global batch", batch, "token",
          "given" if inp.global_batch_tokens else "GPT-3 Table 2.1, nearest size", "Brown et al. 2020")
    s.notes.extend(rec.reasons)
    best = rec.best
    if best is None:
        return s
    lay = best.layout
    s.add("layout", "recommended layout", lay.describe(), "1", "least estimated step time that fits",
          "Narayanan et al. 2021 §3")
    if rec.smallest_sharding is not None:
        s.add("smallest_sharding", "smallest data-parallel sharding that fits",
              rec.smallest_sharding.layout.describe(), "1", "DDP < ZeRO-1 < ZeRO-2 < ZeRO-3", "ZeRO §5")
    s.add("per_gpu_memory", "memory per GPU", best.memory.total_bytes, "B", "states+activations+logits",
          "ZeRO; Korthikanti")
    s.add("microbatches", "micro-batches per step", best.microbatches, "1", "B/(s·b·dp)", "")
    s.add("step_time", "estimated step time", best.step_s, "s",
          "(compute + TP + PP comm)/(1 − bubble) + exposed DP comm", "Narayanan et al. 2021")
    s.add("dp_comm", "data-parallel traffic per GPU per step", best.dp_bytes, "B",
          f"{par.dp_bytes_per_param(lay.stage, mem.PRECISIONS[inp.precision]):g} B·Ψ × (d−1)/d: gradients in the "
          "reduce dtype, parameters in theirs", "ZeRO §7")
    s.add("dp_comm_s", "data-parallel comm time", best.dp_s, "s", "bytes / bandwidth", "")
    s.add("tp_comm", "tensor-parallel traffic per GPU per step", best.tp_bytes, "B",
          "8·b·s·h·(t−1)/t per layer per micro-batch", "Narayanan §3.2")
    s.add("pp_comm", "pipeline traffic per stage boundary per step", best.pp_bytes, "B",
          "2·b·s·h per micro-batch", "Narayanan §4.1")
    s.add("bubble", "pipeline bubble", best.bubble, "1", "(p−1)/(m+p−1)", "Narayanan §2.2",
          percent=True)
    job = plan.job
    if job is not None:
        s.add("job_layout", "what --emit-job runs", job.describe(), "1",
              "FSDP or HSDP (training.sharding) over the data-parallel ranks, tensor x "
              "pipeline inside",
              "trainer/plan/parallelism.py `runnable`")
        s.add("job_memory", "memory per GPU of the job", job.cost.memory.total_bytes, "B",
              "states+activations+logits+FSDP working set", "ZeRO; Korthikanti")
        s.add("job_microbatches", "micro-batches per step of the job", job.cost.microbatches,
              "1", "B/(s·b·dp), at least p", "trainer/pipeline.py")
        s.add("job_step_time", "estimated step time of the job", job.cost.step_s, "s",
              "(compute + TP + PP comm)/(1 − bubble) + exposed DP comm", "Narayanan et al. 2021")
        s.notes.extend(job.notes)
    return s


def _cost_section(plan: Plan, inp: PlanInputs, money: costs.Cost, train_flops: float) -> Section:
    s = Section("Time and cost")
    s.add("flops_per_token", "training FLOPs per token", flops_per_token(plan.model), "FLOP",
          "6·N_matmul + 12·L·d·T", "PaLM App. B (api/arch.py)")
    s.add("train_flops", "training FLOPs (model)", train_flops, "FLOP", "FLOPs/token × D", "PaLM App. B")
    s.add("mfu", "assumed MFU", inp.mfu, "1", "given" if inp.mfu != costs.DEFAULT_MFU else "default",
          "38–52% reported: Megatron Table 1, Llama 3 Table 4", percent=True)
    s.add("wall", "wall-clock (no failures)", money.wall_s, "s", "C/(GPUs·peak·MFU)", "")
    s.add("gpu_hours", "GPU-hours", money.gpu_hours, "1", "wall·GPUs/3600", "")
    s.add("usd", f"cost at ${money.usd_per_gpu_hour:.2f}/GPU-hour", money.usd, "USD",
          "GPU-hours × price", "given" if inp.price_usd_per_gpu_hour is not None
          else "assumed price (trainer/hardware.py), pass --price")
    s.add("non_embedding_params", "non-embedding parameters (Kaplan's N)",
          non_embedding_params(plan.model), "param", "param_count − embeddings", "Kaplan §2.1")
    return s


def _checkpoint_section(plan: Plan, inp: PlanInputs) -> Section:
    s = Section("Checkpointing")
    ck = plan.checkpoint
    src_mtbf = "given" if inp.mtbf_hours else "Llama 3 §3.3.4: 1 failure per 50.7k GPU-hours"
    s.add("mtbf", "job MTBF", ck.mtbf_s, "s", "given" if inp.mtbf_hours else "50,700 GPU-h / GPUs",
          src_mtbf)
    s.add("save", "blocking save time", ck.save_s, "s",
          "given (measured)" if inp.save_seconds else
          f"{crucible_precision(mem.PRECISIONS[inp.precision]).checkpoint_bytes:g} B/param / GPUs / 5 GB/s "
          "(assumed async copy)")
    s.add("young", "Young interval", ck.young_s, "s", "sqrt(2·δ·M)", "Young 1974")
    s.add("daly", "Daly interval (used)", ck.daly_s, "s",
          "sqrt(2δM)(1 + √(δ/2M)/3 + δ/(18M)) − δ", "Daly 2006")
    s.add("expected_failures", "expected failures", ck.expected_failures, "1", "T_w / M", "")
    s.add("lost_per_failure", "lost work per failure", ck.lost_work_per_failure_s, "s",
          "(τ+δ)/2 + R", "Young 1974")
    s.add("wall_with_failures", "expected wall time with failures", ck.wall_s, "s",
          "M·e^(R/M)·(e^((τ+δ)/M) − 1)·T_s/τ", "Daly 2006")
    s.add("goodput", "goodput", ck.goodput, "1", "T_s / T_w", "Daly 2006", percent=True)
    if not inp.save_seconds:
        s.notes.append("Save time is estimated (async staging at an assumed 5 GB/s per GPU); "
                       "measure it and pass --save-seconds.")
    return s
