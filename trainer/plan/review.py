"""Review a training setup stage by stage and say what is wrong, why, and who says so.

Owns the rules; reading files is `configs`', the arithmetic is `scaling`, `memory`,
`parallelism`, `reliability`'s. `review(setup, ...) -> list[Finding]` is pure. Each rule cites
the paper, table or code that settles a dispute about it; thresholds are set where the rule is.
Stages, in the order a run meets them: data, tokenizer/vocab, token budget, batch and LR
schedule, precision, memory fit, parallelism, checkpoint interval, eval cadence, restart policy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from crucible.api.arch import embedding_params, flops_per_token, param_count
from crucible.trainer.hardware import Accelerator
from crucible.trainer.plan import memory as mem
from crucible.trainer.plan import parallelism as par
from crucible.trainer.plan import recipes, reliability, scaling
from crucible.trainer.plan.configs import Setup
from crucible.trainer.plan.cost import DEFAULT_MFU

Severity = Literal["error", "warning", "note"]
SEVERITY_ORDER = {"error": 0, "warning": 1, "note": 2}

CHINCHILLA = "Hoffmann et al. 2022, Table 3 (≈20 tokens/parameter); Besiroglu et al. 2024 refit"
GPT3 = "Brown et al. 2020 (GPT-3), Table 2.1 and App. B"
YOUNG_DALY = "Young 1974; Daly 2006 (optimum interval sqrt(2·δ·M) and its higher-order form)"


@dataclass(frozen=True)
class Finding:
    severity: Severity
    stage: str
    code: str
    message: str
    reason: str
    source: str


@dataclass(frozen=True)
class Context:
    """What the reviewer assumes beyond the file: the GPU, the failure rate, the MFU."""

    gpu: Accelerator
    mtbf_s: float | None = None  # None: Llama 3's failure rate scaled to the GPU count
    mfu: float = DEFAULT_MFU
    save_s: float | None = None  # measured blocking save time, if known


def review(setup: Setup, ctx: Context) -> list[Finding]:
    out: list[Finding] = []
    for rule in (_data, _vocab, _budget, _schedule, _precision, _memory, _parallelism,
                 _checkpoint, _eval, _restarts):
        out.extend(rule(setup, ctx))
    out.extend(Finding("note", "input", "assumed", note, "the file leaves this open",
                       "configs.py") for note in setup.notes)
    return sorted(out, key=lambda f: SEVERITY_ORDER[f.severity])


def _f(sev: Severity, stage: str, code: str, message: str, reason: str, source: str) -> Finding:
    return Finding(sev, stage, code, message, reason, source)


def _step_s(s: Setup, ctx: Context) -> float | None:
    """Failure-free seconds per optimizer step: FLOPs/token × batch / (GPUs × peak × MFU)."""
    if not (s.model and s.global_batch_tokens and s.gpus):
        return None
    return flops_per_token(s.model) * s.global_batch_tokens / (s.gpus * ctx.gpu.peak_bf16_flops * ctx.mfu)


def _run_s(s: Setup, ctx: Context) -> float | None:
    step = _step_s(s, ctx)
    # A batch ramp's steps are smaller: the run is worth fewer full-batch steps than it takes.
    return step * (s.full_batch_steps or s.total_steps) if step and s.total_steps else None


def _data(s: Setup, ctx: Context) -> list[Finding]:
    out = []
    if not s.data_train:
        out.append(_f("error", "data", "no-train-data", "no training data is named",
                      "a run needs tokenized training shards", "spec.DataSpec.train"))
    if not s.data_val:
        out.append(_f("warning", "data", "no-val-data", "no held-out data: eval loss cannot be "
                      "measured", "overfitting, data bugs and regressions show only in held-out "
                      "loss; scaling fits are made on it", "Hoffmann et al. 2022 §3; Kaplan et al. 2020 §4"))
    if s.source in ("PretrainJob", "Crucible job config") and not s.tokenizer:
        out.append(_f("note", "data", "no-tokenizer", "data.tokenizer is not set, so the shards' "
                      "tokenizer hash and vocabulary cannot be checked against the model",
                      "a model whose vocabSize is below the tokenizer's reads out-of-range ids",
                      "spec.DataSpec.tokenizer"))
    return out


def _vocab(s: Setup, ctx: Context) -> list[Finding]:
    if not s.model:
        return []
    out, v = [], s.model.vocab_size
    if v % 64:
        padded = math.ceil(v / 64) * 64
        out.append(_f("warning", "tokenizer/vocab", "vocab-not-64", f"vocabSize {v} is not a "
                      f"multiple of 64; pad it to {padded}", "embedding and output matmuls "
                      "with dimensions off multiples of 64 miss the fast tensor-core tiles; "
                      "GPT-2's 50257 is padded to 50304 for this", "nanoGPT model.py (GPTConfig."
                      "vocab_size); NVIDIA Matrix Multiplication Background guide"))
    share = embedding_params(s.model) / param_count(s.model)
    if share > 0.3:
        out.append(_f("note", "tokenizer/vocab", "embedding-heavy", f"embeddings are {share:.0%} "
                      "of the parameters", "vocabulary parameters should grow slower than the "
                      "rest; Kaplan's laws count non-embedding parameters only",
                      "Tao et al. 2024 (arXiv 2407.13623); Kaplan et al. 2020 §2.1"))
    return out


def _budget(s: Setup, ctx: Context) -> list[Finding]:
    if not (s.model and s.tokens):
        return []
    n, d = s.params, s.tokens
    ratio = d / n
    fit = scaling.BESIROGLU
    alloc = scaling.Allocation("config", n, d, 6 * n * d, fit.loss(n, d), "config")
    w = scaling.waste(alloc, fit)
    msg = (f"{d:.3g} tokens for {n:.3g} parameters is {ratio:.1f} tokens/parameter; the same "
           f"compute spent optimally reaches this loss with {w.wasted_fraction:.0%} less")
    if ratio < scaling.CHINCHILLA_TOKENS_PER_PARAM / 5:
        return [_f("error", "token budget", "under-trained", msg + f" ({20 / ratio:.0f}× below "
                   "compute-optimal)", "a smaller model on these tokens, or more tokens, would "
                   "be better for the same compute", CHINCHILLA)]
    if ratio < scaling.CHINCHILLA_TOKENS_PER_PARAM / 2:
        return [_f("warning", "token budget", "under-trained", msg, "well below ≈20 tokens/"
                   "parameter", CHINCHILLA)]
    if ratio > 10000:
        return [_f("note", "token budget", "over-trained", msg, "past the 10,000 tokens/parameter "
                   "Sardana et al. tested; gains per token are small", "Sardana et al. 2024 §5")]
    return []


def _schedule(s: Setup, ctx: Context) -> list[Finding]:
    out = []
    if s.model and s.global_batch_tokens and s.micro_batch and s.dp:
        unit = s.model.seq_len * s.micro_batch * s.dp
        if s.global_batch_tokens % unit:
            out.append(_f("error", "batch and LR", "batch-not-divisible", f"global batch "
                          f"{s.global_batch_tokens:.0f} tokens is not a multiple of seqLen × "
                          f"microBatch × data-parallel ranks = {unit}", "every optimizer step "
                          "must be a whole number of micro-batches on every rank",
                          "spec.TrainingSpec.globalBatchTokens"))
    if s.warmup_steps is not None and s.lr:
        if s.warmup_steps == 0 and s.lr >= 1e-5:
            out.append(_f("error", "batch and LR", "no-warmup", f"peak LR {s.lr:g} from step 0 "
                          "with no warmup", "Adam's second-moment estimate is noise in the first "
                          "steps; a full-size LR then diverges or spikes. GPT-3 warms up over "
                          "375M tokens", f"{GPT3}; Liu et al. 2020 (RAdam) §3"))
        elif s.total_steps and s.warmup_steps >= s.total_steps:
            out.append(_f("error", "batch and LR", "warmup-too-long", f"warmup ({s.warmup_steps} "
                          f"steps) is not shorter than the run ({s.total_steps} steps)",
                          "the LR never reaches its peak or decays", GPT3))
        elif s.total_steps and s.warmup_steps > 0.25 * s.total_steps:
            out.append(_f("warning", "batch and LR", "warmup-long", f"warmup is "
                          f"{s.warmup_steps / s.total_steps:.0%} of the run", "GPT-3 warms up for "
                          "375M of 300B tokens (0.1%); Llama 2 for 2000 steps", GPT3))
    if s.model and s.lr:
        row = recipes.gpt3_row(s.params)
        if s.lr > 3 * row.lr:
            out.append(_f("warning", "batch and LR", "lr-high", f"peak LR {s.lr:g} is "
                          f"{s.lr / row.lr:.1f}× {row.name}'s {row.lr:g} for a model this size",
                          "larger models need smaller peak LRs; too high risks loss spikes", GPT3))
        elif s.lr < row.lr / 10:
            out.append(_f("note", "batch and LR", "lr-low", f"peak LR {s.lr:g} is a tenth of "
                          f"{row.name}'s {row.lr:g} or less", "training will be slow to converge",
                          GPT3))
    if s.schedule == "constant":
        out.append(_f("warning", "batch and LR", "no-decay", "the LR is never decayed",
                      "most of the final-loss gain comes from decaying the LR (cosine to 10% in "
                      "Chinchilla and GPT-3; the cooldown in WSD)",
                      "Hoffmann et al. 2022 App. A (Fig. A1); Hägele et al. 2024 §3"))
    if s.grad_clip == 0:
        out.append(_f("warning", "batch and LR", "no-clip", "gradient clipping is off",
                      "one bad batch can blow the weights up; GPT-3 and Llama 2 clip at 1.0", GPT3))
    if s.beta2 is not None and s.beta2 >= 0.999 and s.params and s.params >= 1e8:
        out.append(_f("note", "batch and LR", "beta2", f"Adam β2 = {s.beta2}", "β2 = 0.95 reacts "
                      "faster to gradient-scale shifts and is what GPT-3 and Llama use", GPT3))
    if s.weight_decay == 0:
        out.append(_f("note", "batch and LR", "no-weight-decay", "weight decay is 0",
                      "GPT-3 and Llama 2 use 0.1 (decoupled, AdamW)", GPT3))
    return out


def _precision(s: Setup, ctx: Context) -> list[Finding]:
    if s.precision == "fp16":
        return [_f("warning", "precision", "fp16", "fp16 mixed precision", "fp16's 5-bit exponent "
                   "needs loss scaling and overflows on spikes; bf16 keeps fp32's range at the same "
                   "speed", "Kalamkar et al. 2019 (arXiv 1905.12322); Gopher App. C (Rae et al. 2021)")]
    if s.precision == "bf16-pure":
        return [_f("warning", "precision", "bf16-pure", "bf16 weights without an fp32 master "
                   "(training.dtype = bfloat16)", "an update smaller than about 1/256 of its "
                   "weight rounds away to nothing in bf16's 8 significant bits, so late in a run, at a "
                   "small learning rate, most of them do and the loss stalls above a mixed-"
                   "precision run's; it halves the states (8 bytes a parameter, not 16). Keep the "
                   "fp32 master unless memory forces it, or round stochastically",
                   "Zamirai et al. 2020, \"Revisiting BFloat16 Training\" (arXiv 2010.06192)")]
    if s.precision == "fp32":
        return [_f("warning", "precision", "fp32", "fp32 compute", f"{ctx.gpu.name} peaks at "
                   f"{ctx.gpu.peak_bf16_flops / 1e12:.0f} TFLOP/s only in bf16 tensor-core "
                   "matmuls; fp32 runs several times slower and doubles weight/activation memory",
                   "NVIDIA A100/H100 datasheets; Micikevicius et al. 2018")]
    return []


def _layout(s: Setup, ctx: Context) -> par.Layout:
    dp = s.dp or 1
    return par.Layout(dp, s.tp, s.pp, s.zero_stage if s.zero_stage is not None else 0,
                      s.recompute if s.recompute in mem.ALL_RECOMPUTE else "none")


def _accumulates_unsharded(s: Setup, lay: par.Layout) -> bool:
    """`gradientSync: lastMicroBatch` with more than one micro-batch a step (unknown batch
    arithmetic counts as more than one: the estimate errs towards not fitting)."""
    if s.gradient_sync != "lastMicroBatch":
        return False
    if not (s.global_batch_tokens and s.model and s.micro_batch):
        return True
    return s.global_batch_tokens / (s.model.seq_len * s.micro_batch * lay.dp) > 1


def precision_of(s: Setup) -> mem.Precision:
    """The bytes `s` keeps a parameter: its precision (fp16 counts as bf16, the same sizes)
    with its reduce dtype."""
    name = s.precision if s.precision in mem.PRECISIONS else "bf16"
    return mem.with_reduce_dtype(mem.PRECISIONS[name], s.reduce_dtype)


def _pipeline_microbatches(s: Setup, lay: par.Layout) -> int | None:
    """A pipeline's micro-batches a step: as the file says, else the gradient accumulation's
    (Crucible feeds the pipeline every micro-batch of the step); None when unknown."""
    if s.pp_microbatches or lay.pp == 1:
        return s.pp_microbatches
    if s.global_batch_tokens and s.model and s.micro_batch:
        return max(1, round(s.global_batch_tokens / (s.model.seq_len * s.micro_batch * lay.dp)))
    return None


def layout_misfit(s: Setup) -> str | None:
    """Why the ranks cannot take the setup's layout, or None: the degrees must multiply to the
    world (torch's DeviceMesh takes one rank per place), and a pipeline needs a layer a stage."""
    if s.gpus and s.dp is not None and s.dp * s.tp * s.pp * s.cp != s.gpus:
        return (f"{s.gpus} GPUs do not form data parallel {s.dp} × tensor {s.tp} × pipeline "
                f"{s.pp} × context {s.cp} ({s.dp * s.tp * s.pp * s.cp} ranks)")
    stages = s.pp * s.virtual_stages
    if s.model and stages > s.model.layers:
        return (f"{stages} pipeline stages ({s.pp} ranks × {s.virtual_stages}) for "
                f"{s.model.layers} layers: a stage needs at least one")
    return None


def memory_estimate(s: Setup, ctx: Context) -> mem.MemoryEstimate | None:
    """What one GPU of `s` holds at its fullest, as the setup runs it; None without a model
    shape and a micro-batch, or when the ranks cannot take its layout. Pipelined with a batch ramp, the fullest of the ramp's steps:
    interleaved 1F1B keeps more micro-batches in flight at some counts below the full step's
    (one round of m forwards for m < 2p; `memory.pipeline_rank_ops`)."""
    if not (s.model and s.micro_batch) or layout_misfit(s):
        return None
    lay = _layout(s, ctx)

    def at(microbatches: int | None) -> mem.MemoryEstimate:
        return mem.estimate(s.model, micro_batch=s.micro_batch,
                            capacity_bytes=ctx.gpu.memory_bytes, stage=lay.stage,
                            dp=lay.dp * s.cp, tp=lay.tp, pp=lay.pp, recompute=lay.recompute,
                            precision=precision_of(s), flash_attention=s.flash_attention,
                            accumulate_unsharded=_accumulates_unsharded(s, lay),
                            compiled=s.compiled, compiled_loss=s.compiled_loss,
                            loss_parallel=s.loss_parallel, cp=s.cp,
                            step_in_backward=s.step_in_backward,
                            unfused_linears=s.unfused_linears, microbatches=microbatches,
                            virtual_stages=s.virtual_stages, schedule=s.pp_schedule,
                            outputs_kept=s.pp_outputs_kept)

    full = at(_pipeline_microbatches(s, lay))
    if lay.pp == 1:
        return full
    # max keeps the first of equals: the full step, unless a ramp step holds more.
    return max([full, *(at(m) for m in s.ramp_microbatches)], key=lambda e: e.total_bytes)


def _memory(s: Setup, ctx: Context) -> list[Finding]:
    est = memory_estimate(s, ctx)
    if est is None or est.fits:
        return []
    lay = _layout(s, ctx)
    prec = precision_of(s)
    gib = 2**30
    hint = ""
    if s.gpus:
        rec = par.recommend(s.model, ctx.gpu, s.gpus, global_batch_tokens=s.global_batch_tokens
                            or s.model.seq_len * s.micro_batch * s.gpus,
                            micro_batch=s.micro_batch, mfu=ctx.mfu, precision=prec,
                            flash_attention=s.flash_attention, compiled=s.compiled)
        hint = (f"; on {s.gpus} GPUs this fits: {rec.best.layout.describe()}" if rec.best
                else f"; no layout of {s.gpus} {ctx.gpu.name} GPUs fits at this micro-batch")
    parts = [f"states {est.states.total_bytes / gib:.1f} ({prec.name}, "
             f"{prec.state_bytes:g} bytes a parameter)",
             f"activations {est.activations_bytes / gib:.1f}",
             f"logits {est.logits_bytes / gib:.1f} and the loss's transient "
             f"{est.loss_transient_bytes / gib:.1f}"]
    if est.recompute_bytes:
        parts.append(f"or the block being recomputed {est.recompute_bytes / gib:.1f}")
    if est.working_bytes:
        parts.append("FSDP's gathered parameters and whole gradients "
                     f"{est.working_bytes / gib:.1f}")
    if est.accumulated_grad_bytes:
        parts.append(f"gradients kept whole across micro-batches (gradientSync: lastMicroBatch) "
                     f"{est.accumulated_grad_bytes / gib:.1f}")
    full_m = _pipeline_microbatches(s, lay)
    when = (f" in the batch ramp's steps of {est.microbatches} micro-batches (the full step "
            f"has {full_m})" if est.microbatches not in (None, full_m) else "")
    return [_f("error", "memory fit", "does-not-fit", f"{lay.describe()} needs "
               f"{est.total_bytes / gib:.1f} GiB per GPU{when} ({', '.join(parts)}) "
               f"> {est.usable_bytes / gib:.1f} GiB usable on {ctx.gpu.name}{hint}",
               "the run would stop with CUDA out-of-memory at the first such step" if when
               else "the run would stop with CUDA out-of-memory at the first step",
               f"Rajbhandari et al. 2020 §3.1 ({prec.state_bytes:g} B/param at {prec.name}); "
               "Korthikanti et al. 2022 Table 2")]


def _parallelism(s: Setup, ctx: Context) -> list[Finding]:
    out, g = [], ctx.gpu
    if misfit := layout_misfit(s):
        out.append(_f("error", "parallelism", "layout-misfit", misfit, "the run would not start "
                      "(and its memory is not counted): set the degrees so that they multiply to "
                      "the GPUs, with no more pipeline stages than layers",
                      "torch.distributed.device_mesh.init_device_mesh"))
    if s.gpu_limit is not None and s.procs_per_node is not None and s.gpu_limit != s.procs_per_node:
        sev: Severity = "error" if s.gpu_limit < s.procs_per_node else "warning"
        out.append(_f(sev, "parallelism", "procs-vs-gpus", f"procsPerNode {s.procs_per_node} but "
                      f"nvidia.com/gpu {s.gpu_limit} per pod", "one rank per GPU: more ranks than "
                      "GPUs share devices and run out of memory; fewer leave GPUs idle",
                      "torchrun --nproc-per-node; PyTorch DDP/FSDP one-device-per-process"))
    if s.procs_per_node and s.procs_per_node > g.gpus_per_node:
        out.append(_f("warning", "parallelism", "procs-per-node", f"{s.procs_per_node} processes per "
                      f"node, but a {g.name} node has {g.gpus_per_node} GPUs", "pods will not "
                      "schedule on standard nodes", "trainer/hardware.py (DGX datasheets)"))
    if s.tp > g.link_domain:
        out.append(_f("warning", "parallelism", "tp-across-nodes", f"tensor parallel degree {s.tp} "
                      f"spans nodes ({g.link_domain} GPUs share NVLink)", "TP all-reduces every layer; "
                      "over the network instead of NVLink it stalls compute",
                      "Narayanan et al. 2021 §3, takeaway #1"))
    if s.model and s.model.heads % s.tp:
        out.append(_f("error", "parallelism", "tp-heads", f"{s.model.heads} heads do not split "
                      f"over tensor parallel degree {s.tp}", "each rank must own whole heads",
                      "Narayanan et al. 2021 §2.3"))
    if s.pp > 1 and s.global_batch_tokens and s.model and s.micro_batch and s.dp:
        m = max(1, round(s.global_batch_tokens / (s.model.seq_len * s.micro_batch * s.dp)))
        bubble = par.bubble_fraction(s.pp, m)
        if bubble > 0.2:
            out.append(_f("warning", "parallelism", "bubble", f"pipeline of {s.pp} stages with {m} "
                          f"micro-batches idles {bubble:.0%} of each step", "the bubble is "
                          "(p−1)/(m+p−1); use m ≫ p", "Narayanan et al. 2021 §2.2"))
    if (s.nodes_min and s.nodes_max and s.nodes_min < s.nodes_max and s.model and s.micro_batch
            and s.procs_per_node and s.global_batch_tokens):
        unit = s.model.seq_len * s.micro_batch * s.nodes_min * s.procs_per_node
        if s.global_batch_tokens % unit:
            out.append(_f("warning", "parallelism", "elastic-batch", f"at nodes.min={s.nodes_min} "
                          f"the global batch is not a multiple of {unit} tokens", "after a "
                          "scale-down the step can no longer keep the same batch", "spec.NodesSpec"))
    return out


def _checkpoint(s: Setup, ctx: Context) -> list[Finding]:
    gpus = s.gpus or 1
    mtbf = ctx.mtbf_s or reliability.job_mtbf_s(gpus)
    mtbf_src = "given" if ctx.mtbf_s else f"Llama 3 §3.3.4 rate for {gpus} GPUs"
    run = _run_s(s, ctx)
    if not s.checkpoint_enabled:
        failures = run / mtbf if run else None
        sev: Severity = "error" if failures is not None and failures >= 0.5 else "warning"
        return [_f(sev, "checkpoint", "no-checkpoints", "checkpointing is off" + (
            f"; {failures:.1f} failures are expected over the run" if failures else ""),
            "every failure restarts training from step 0", YOUNG_DALY)]
    interval = s.checkpoint_every_s
    step = _step_s(s, ctx)
    if interval is None and s.checkpoint_every_steps and step:
        interval = s.checkpoint_every_steps * step
    if interval is None:
        return [_f("note", "checkpoint", "interval-unknown", "the checkpoint interval in seconds "
                   "is unknown (given in steps; pass --gpus to estimate step time)",
                   "it is judged against the MTBF in wall-clock time", YOUNG_DALY)]
    out = []
    if interval >= mtbf:
        out.append(_f("error", "checkpoint", "interval-vs-mtbf", f"checkpoints every "
                      f"{interval / 3600:.2g} h but the job fails every {mtbf / 3600:.2g} h on "
                      f"average ({mtbf_src})", "most intervals end in a failure before the save, "
                      "so the run barely advances", YOUNG_DALY))
        return out
    if s.params:
        # What a checkpoint holds a parameter: the most precise weights and both moments (12
        # bytes with an fp32 master, 10 rounding stochastically, 6 in an all-bf16 run).
        per_param = precision_of(s).checkpoint_bytes
        save = ctx.save_s or per_param * s.params / gpus / 5e9  # async staging, as planned
        if not s.checkpoint_async and not ctx.save_s:
            per_node = s.procs_per_node or ctx.gpu.gpus_per_node
            # synchronous upload, ~1 GB/s per node
            save = per_param * s.params / max(1, gpus // per_node) / 1e9
        best = reliability.daly_interval_s(save, mtbf)
        if interval > 3 * best:
            got = reliability.plan_checkpoints(3600.0, save, mtbf, interval_s=interval).goodput
            opt = reliability.plan_checkpoints(3600.0, save, mtbf).goodput
            out.append(_f("warning", "checkpoint", "interval-long", f"checkpoints every "
                          f"{interval / 60:.0f} min; the optimum for a {save:.0f} s save and "
                          f"{mtbf / 3600:.1f} h MTBF is {best / 60:.0f} min (goodput {got:.1%} vs "
                          f"{opt:.1%})", "each failure loses half an interval on average",
                          YOUNG_DALY))
        elif interval < best / 3:
            out.append(_f("note", "checkpoint", "interval-short", f"checkpoints every "
                          f"{interval / 60:.1f} min; the optimum is {best / 60:.0f} min",
                          "saving more often than needed costs throughput and storage", YOUNG_DALY))
    return out


def _eval(s: Setup, ctx: Context) -> list[Finding]:
    if s.eval_every_steps is None or not s.data_val:
        return []
    if s.eval_every_steps == 0 and (s.total_steps or 0) > 1000:
        return [_f("warning", "eval", "eval-only-at-end", f"held-out loss is measured only after "
                   f"all {s.total_steps} steps", "divergence, data or tokenizer bugs show up only "
                   "when the budget is spent", "nanoGPT train.py (eval_interval); torchtitan validation.freq")]
    if s.eval_every_steps and s.eval_tokens and s.global_batch_tokens:
        share = s.eval_tokens / (s.eval_every_steps * s.global_batch_tokens * 3)  # fwd = 1/3 of train
        if share > 0.05:
            return [_f("warning", "eval", "eval-too-often", f"evaluation takes ≈{share:.0%} of "
                       "training compute", "an eval forward pass costs a third of a training step "
                       "per token (2N vs 6N FLOPs)", "Kaplan et al. 2020 §2.1 (C ≈ 6N per token)")]
    return []


def _restarts(s: Setup, ctx: Context) -> list[Finding]:
    if s.max_restarts is None:
        return []
    out = []
    run = _run_s(s, ctx)
    mtbf = ctx.mtbf_s or reliability.job_mtbf_s(s.gpus or 1)
    expected = run / mtbf if run else None
    if s.max_restarts == 0:
        out.append(_f("warning", "restart policy", "no-restarts", "maxRestarts is 0: the first "
                      "application failure ends the job", "large runs fail routinely; Llama 3 "
                      "saw 419 unexpected interruptions in 54 days", "Dubey et al. 2024 §3.3.4"))
    elif expected is not None and expected > s.max_restarts:
        out.append(_f("note", "restart policy", "restarts-low", f"about {expected:.0f} failures are "
                      f"expected but maxRestarts is {s.max_restarts}", "only application failures "
                      "count against it, but a flaky job may exhaust it", "Dubey et al. 2024 §3.3.4"))
    if s.spike_guard is False:
        out.append(_f("note", "restart policy", "no-spike-guard", "loss-spike guard is off",
                      "spikes that are not rolled back can derail a run", "Chowdhery et al. 2022 "
                      "(PaLM) §5.1: restart ~100 steps before a spike, skip 200–500 batches"))
    return out
