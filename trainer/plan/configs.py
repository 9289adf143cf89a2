"""Read someone else's training config into one `Setup` the reviewer can judge.

Owns parsing of four formats, and nothing about what is good or bad (that is `review`):
- a PretrainJob manifest (crucible.dev/v1alpha1), validated by `spec.PretrainJobSpec`;
- Crucible's job config (`spec.TrainJobConfig`, what `crucible train --config` reads);
- a torchtitan TOML job config (sections job/model/optimizer/lr_scheduler/training/parallelism/
  checkpoint/activation_checkpoint, as in torchtitan/models/llama3/train_configs/llama3_8b.toml);
- a nanoGPT config (`config/train_gpt2.py` style: plain assignments over train.py's defaults).
  It is parsed with `ast`, never executed; only literals and arithmetic are evaluated.
Unknown values stay None and the reviewer says what it could not check.
"""

from __future__ import annotations

import ast
import operator as op
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path

import yaml
from pydantic import ValidationError

from crucible.api.arch import GPTConfig, param_count
from crucible.api.batch_ramp import BatchRamp, BatchSchedule
from crucible.api.spec import PretrainJobSpec, TrainJobConfig, explain
from crucible.trainer.plan import recipes
from crucible.trainer.plan.precision import REDUCE_DTYPES


class ConfigReadError(ValueError):
    """The file cannot be read as any supported config; the message says which part failed."""


# The extended resources GPUs are advertised as (NVIDIA's and AMD's device plugins).
GPU_RESOURCES = ("nvidia.com/gpu", "amd.com/gpu")


@dataclass(frozen=True)
class Setup:
    source: str
    path: str
    model: GPTConfig | None = None
    tokens: float | None = None
    global_batch_tokens: float | None = None
    micro_batch: int | None = None
    lr: float | None = None
    warmup_steps: int | None = None
    total_steps: int | None = None
    # The run's tokens in steps of the full global batch; differs from total_steps with a batch
    # ramp, whose smaller steps take less time each (None: the same).
    full_batch_steps: float | None = None
    schedule: str | None = None
    min_lr_ratio: float | None = None
    weight_decay: float | None = None
    beta2: float | None = None
    grad_clip: float | None = None
    # bf16 (fp32 master), bf16-sr (bf16 rounded stochastically, fp32 moments), bf16-pure (no
    # master, bf16 moments), fp16 or fp32: plan/precision.py counts each.
    precision: str | None = None
    reduce_dtype: str = "float32"  # FSDP's gradient reduce dtype (mixed_precision_reduce)
    step_in_backward: bool = False  # the optimizer steps each gradient as it is made
    unfused_linears: bool = False   # torchtitan's block: q, k, v, gate and up separate matmuls
    gpus: int | None = None
    nodes_min: int | None = None
    nodes_max: int | None = None
    procs_per_node: int | None = None
    gpu_limit: int | None = None  # nvidia.com/gpu per pod
    dp: int | None = None   # data-parallel ranks (FSDP shards over dp × cp)
    tp: int = 1
    pp: int = 1
    cp: int = 1             # context parallel: ranks a sequence is split over
    pp_schedule: str = "1F1B"   # 1F1B, interleaved1F1B or GPipe
    virtual_stages: int = 1     # pipeline stages a rank holds (interleaved)
    pp_microbatches: int | None = None  # a pipeline's micro-batches a step (None: derived)
    pp_outputs_kept: str = "none"   # what its pipeline schedule keeps to the step's end
    # Micro-batches a rank takes in the steps of a batch ramp, up to the full step's (empty: every
    # step is full). Interleaved 1F1B holds more in flight at some of the smaller counts.
    ramp_microbatches: tuple[int, ...] = ()
    zero_stage: int | None = None
    recompute: str | None = None  # none, selective, full, selective-op
    gradient_sync: str | None = None  # Crucible's training.gradientSync
    # Fused attention (SDPA/FlashAttention) stores no s×s scores. Crucible's model, nanoGPT
    # (model.py uses F.scaled_dot_product_attention when present) and torchtitan all use it.
    flash_attention: bool = True
    # Blocks and loss through torch.compile, which keeps fewer activations (plan/memory.py).
    # Unknown: eager, which errs towards not fitting. `compiled_loss` None: as the blocks.
    compiled: bool = False
    compiled_loss: bool | None = None
    # The loss over vocabulary-sharded logits (torch's loss_parallel); None: with tensor parallel.
    loss_parallel: bool | None = None
    checkpoint_enabled: bool = True
    checkpoint_uri: str | None = None
    checkpoint_every_s: float | None = None
    checkpoint_every_steps: int | None = None
    checkpoint_async: bool | None = None
    eval_every_steps: int | None = None
    eval_tokens: float | None = None
    data_train: str | None = None
    data_val: str | None = None
    tokenizer: str | None = None
    max_restarts: int | None = None
    hang_timeout_s: float | None = None
    spike_guard: bool | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def params(self) -> float | None:
        return float(param_count(self.model)) if self.model else None


def load(path: str | Path, *, gpus: int | None = None) -> Setup:
    """Read `path` in whichever supported format it is; `gpus` fills in a world size the file
    leaves open (torchtitan's data_parallel_shard_degree = -1, nanoGPT's torchrun launch)."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigReadError(f"{path} does not exist") from None
    except (IsADirectoryError, UnicodeDecodeError) as err:
        raise ConfigReadError(f"{path} cannot be read as text: {err}") from None
    if path.suffix == ".toml":
        return _torchtitan(path, text, gpus)
    if path.suffix == ".py":
        return _nanogpt(path, text, gpus)
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigReadError(f"{path} is not valid YAML: {err}") from None
    if not isinstance(doc, dict):
        raise ConfigReadError(f"{path} must hold a mapping (a PretrainJob or a job config)")
    if doc.get("kind") == "PretrainJob":
        return _pretrain_job(path, doc.get("spec") or {})
    if {"model", "training"} <= doc.keys():
        return _job_config(path, doc, gpus)
    raise ConfigReadError(f"{path}: not a PretrainJob (kind: PretrainJob), a Crucible job config "
                          "(model/data/training), a torchtitan .toml or a nanoGPT .py config")


# The memory model's recompute for each activationCheckpointing mode, erring towards more
# memory: every-k-layers keeps every block's but the k-th's.
_RECOMPUTE = {"none": "none", "full": "full", "selective-op": "selective-op",
              "every-k-layers": "none"}


def _common(path: Path, spec, source: str) -> Setup:
    """What a PretrainJob spec and a job config share. The operator's restart policy exists
    only in a PretrainJob, so a job config leaves it unset."""
    t, ck, ft = spec.training, spec.checkpoint, spec.fault_tolerance
    par = t.parallelism
    # training.compile unset: on for CUDA (parallel.wants_compile), where jobs run.
    compiled = t.compile is not False
    return Setup(
        source=source, path=str(path), model=spec.model.to_arch(), tokens=t.tokens,
        global_batch_tokens=t.global_batch_tokens, micro_batch=t.micro_batch, lr=t.lr,
        warmup_steps=t.warmup_steps, total_steps=t.total_steps_hint, schedule=t.schedule,
        min_lr_ratio=t.min_lr_ratio, weight_decay=t.weight_decay, beta2=t.beta2,
        grad_clip=t.grad_clip, zero_stage=3,
        precision="bf16-sr" if t.optimizer.bf16_stochastic_rounding else t.precision,
        tp=par.tensor, pp=par.pipeline, pp_schedule=par.schedule,
        virtual_stages=getattr(par, "virtual_stages", 1),
        # The vocabulary-parallel loss stays eager under tensor parallelism
        # (parallel.compile_model: a traced graph would skip loss_parallel's kernels).
        compiled=compiled, compiled_loss=compiled and par.tensor == 1,
        recompute=_RECOMPUTE[t.activation_checkpointing_mode], gradient_sync=t.gradient_sync,
        checkpoint_enabled=ck.uri is not None, checkpoint_uri=ck.uri,
        checkpoint_every_s=ck.every_minutes * 60 if ck.every_minutes else None,
        checkpoint_every_steps=ck.every_steps or None, checkpoint_async=ck.async_,
        eval_every_steps=t.eval_every, eval_tokens=t.eval_tokens, data_train=spec.data.train,
        data_val=spec.data.val, tokenizer=spec.data.tokenizer,
        max_restarts=getattr(ft, "max_restarts", None),
        hang_timeout_s=getattr(ft, "hang_timeout_seconds", None), spike_guard=ft.spike_guard.enabled)


def _pretrain_job(path: Path, spec_doc: dict) -> Setup:
    try:
        spec = PretrainJobSpec.model_validate(spec_doc)
    except ValidationError as err:
        raise ConfigReadError(f"{path}: spec has {err.error_count()} problem(s):\n{explain(err)}") \
            from None
    limits = spec.resources.get("limits") or {}
    limit = next((limits[name] for name in GPU_RESOURCES if name in limits), None)
    setup = _common(path, spec, "PretrainJob")
    world = spec.nodes.max * spec.procs_per_node
    dp = world // spec.training.parallelism.model_parallel
    return _ramped(replace(setup, gpus=world, dp=dp, nodes_min=spec.nodes.min,
                           nodes_max=spec.nodes.max, procs_per_node=spec.procs_per_node,
                           gpu_limit=int(limit) if limit is not None else None), spec.training)


def _job_config(path: Path, doc: dict, gpus: int | None) -> Setup:
    try:
        cfg = TrainJobConfig.model_validate(doc)
    except ValidationError as err:
        raise ConfigReadError(f"{path}: {err.error_count()} problem(s):\n{explain(err)}") from None
    notes = () if gpus else ("world size is not in a job config; pass --gpus",)
    dp = gpus // cfg.training.parallelism.model_parallel if gpus else None
    return _ramped(replace(_common(path, cfg, "Crucible job config"), gpus=gpus, dp=dp,
                           notes=notes), cfg.training)


def _ramped(setup: Setup, training) -> Setup:
    """With training.batchRamp, the steps the trainer takes (the ramp's are smaller, so there
    are more; warmup and decay count them), what they are worth in full-batch steps, and the
    micro-batches a rank takes in them (a pipeline's memory depends on it). The ramp rounds to
    whole micro-batches on every data-parallel rank: an unknown world size counts as one rank."""
    ramp = training.batch_ramp
    unit = setup.model.seq_len * training.micro_batch * (setup.dp or 1) if setup.model else 0
    if ramp is None or not unit or training.global_batch_tokens % unit:
        return setup   # no ramp, or no whole steps to count (the review says why)
    steps = BatchRamp.of(training.global_batch_tokens, unit, ramp.start_tokens, ramp.ramp_tokens)
    schedule = BatchSchedule(steps, training.tokens)
    trained = schedule.at(schedule.total_steps).tokens_before
    return replace(setup, total_steps=schedule.total_steps,
                   full_batch_steps=trained / training.global_batch_tokens,
                   ramp_microbatches=tuple(steps.counts()))


_DTYPES = {"bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16",
           "float32": "fp32", "fp32": "fp32"}


def _first(key: str, default, *sections: dict):
    """`key` from the first section that has it: torchtitan moved its fields between sections
    (degrees from [training] and [experimental] to [parallelism] in March 2025)."""
    return next((section[key] for section in sections if key in section), default)


def _torchtitan_compile(doc: dict, train: dict) -> tuple[bool, bool]:
    """(blocks compiled, loss compiled). [compile] (August 2025 on) names its components;
    before it, `training.compile` compiled each block, and the loss too only from April 2025
    (torchtitan's `build_loss_fn`). `local_batch_size` (June 2025) dates a config after that;
    one with `batch_size` may be older and is counted with an eager loss, erring towards
    more memory."""
    section = doc.get("compile")
    if section is not None:
        on = bool(section.get("enable", False))
        parts = section.get("components", ["model", "loss"])
        return on and "model" in parts, on and "loss" in parts
    on = bool(train.get("compile", False))
    return on, on and "local_batch_size" in train


def _torchtitan_pipeline(pp: int, local: int, par: dict, exp: dict,
                         notes: list[str]) -> tuple[str, int, int]:
    """(schedule, stages a rank, micro-batches a step) of torchtitan's pipeline. Multi-stage
    schedules are counted with two stages a rank, torchtitan's split when it is not given;
    micro-batches are `pipeline_parallel_microbatches` (before April 2025, default the
    pipeline degree), else local batch / `pipeline_parallel_microbatch_size` (default 1)."""
    name = str(_first("pipeline_parallel_schedule", "1F1B", par, exp))
    if name == "GPipe":
        schedule, stages = "GPipe", 1
    elif name == "1F1B":
        schedule, stages = "1F1B", 1
    else:
        schedule, stages = "interleaved1F1B", 2
        if name != "Interleaved1F1B":
            notes.append(f"pipeline schedule {name} is counted as interleaved 1F1B with two "
                         "stages a rank")
    if "pipeline_parallel_microbatches" in exp or "pipeline_parallel_microbatches" in par:
        m = _first("pipeline_parallel_microbatches", None, par, exp)
        micro = int(m) if m else pp
    elif par:
        micro = max(1, local // int(par.get("pipeline_parallel_microbatch_size", 1)))
    else:
        micro = pp
    return schedule, stages, micro


def _torchtitan(path: Path, text: str, gpus: int | None) -> Setup:
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigReadError(f"{path} is not valid TOML: {err}") from None
    model, opt = doc.get("model", {}), doc.get("optimizer", {})
    sched, train = doc.get("lr_scheduler", {}), doc.get("training", {})
    par, ck = doc.get("parallelism", {}), doc.get("checkpoint", {})
    exp = doc.get("experimental", {})
    ac, val = doc.get("activation_checkpoint", {}), doc.get("validation", {})
    notes = []
    seq = int(train.get("seq_len", 2048))
    flavor = recipes.LLAMA3_FLAVORS.get(str(model.get("flavor", "")))
    cfg = flavor.to_gpt(seq) if flavor and model.get("name", "llama3").startswith("llama3") else None
    if cfg is None:
        notes.append(f"model {model.get('name')}/{model.get('flavor')} is not a known Llama 3 "
                     "flavour (8B, 70B, 405B): model-size checks skipped")
    tp = int(_first("tensor_parallel_degree", 1, par, train))
    pp = int(_first("pipeline_parallel_degree", 1, par, exp))
    shard = int(_first("data_parallel_shard_degree", -1, par, train))
    replicate = int(_first("data_parallel_replicate_degree", 1, par, train))
    cp = int(_first("context_parallel_degree", 1, par, exp))
    if shard == -1:
        dp = gpus // (tp * pp * cp * replicate) * replicate if gpus else None
        if not gpus:
            notes.append("data_parallel_shard_degree = -1 (all GPUs): pass --gpus for the world size")
    else:
        dp = shard * replicate
    # The world asked for, where given: review says when the degrees do not form it.
    world = gpus or (dp * tp * pp * cp if dp else None)
    local = int(train.get("local_batch_size", train.get("batch_size", 8)))
    global_seqs = int(train.get("global_batch_size", -1))
    batch = (global_seqs if global_seqs > 0 else local * dp) * seq if dp else None
    steps = int(train.get("steps", 10000))
    floor = sched.get("min_lr_factor", sched.get("lr_min", 0.0))
    blocks_compiled, loss_compiled = _torchtitan_compile(doc, train)
    schedule, stages, microbatches = (_torchtitan_pipeline(pp, local, par, exp, notes)
                                      if pp > 1 else ("1F1B", 1, None))
    reduce = str(train.get("mixed_precision_reduce", "float32"))
    if reduce not in REDUCE_DTYPES:
        notes.append(f"mixed_precision_reduce {reduce!r} is not a dtype: counted as float32")
        reduce = "float32"
    elif REDUCE_DTYPES[reduce] != 4:
        notes.append(f"mixed_precision_reduce = {reduce!r}: torchtitan's own config accepts "
                     "only float32; counted as asked")
    quantize = doc.get("quantize", {}).get("linear", {}).get("float8")
    if (doc.get("float8", {}).get("enable_float8_linear") or quantize is not None
            or any("float8" in str(c) for c in model.get("converters", []))):
        # torchtitan's own tables measure the same memory with Float8 linears as without
        # (77.0 and 76.8 GiB, 62.0 and 61.8: benchmarks/llama3_h100_202412_torchtitan.md).
        notes.append("Float8 linears are counted as bf16 ones: their saved activations and "
                     "gathered weights differ by little")
    return Setup(
        source="torchtitan", path=str(path), model=cfg, tokens=batch * steps if batch else None,
        global_batch_tokens=batch, micro_batch=max(1, local // (microbatches or 1)),
        lr=float(opt.get("lr", 8e-4)),
        warmup_steps=int(_first("warmup_steps", 200, sched, train)), total_steps=steps,
        schedule=str(sched.get("decay_type", "linear")), min_lr_ratio=float(floor),
        weight_decay=float(opt.get("weight_decay", 0.1)), beta2=opt.get("beta2"),
        grad_clip=float(train.get("max_norm", 1.0)),
        # training.dtype "bfloat16": parameters, gradients and optimizer states all bf16, no
        # fp32 master (torchtitan's config docs); otherwise mixed precision over fp32 weights.
        precision=("bf16-pure" if str(train.get("dtype", "float32")) == "bfloat16" else
                   _DTYPES.get(str(train.get("mixed_precision_param", "bfloat16")), "bf16")),
        reduce_dtype=reduce,
        step_in_backward=bool(opt.get("early_step_in_backward", False)),
        unfused_linears=True,
        gpus=world, dp=dp, tp=tp, pp=pp, cp=cp, pp_schedule=schedule, virtual_stages=stages,
        pp_microbatches=microbatches,
        # torchtitan's TOML configs predate `step(return_outputs=False)` (October 2025; the
        # TOML files went in February 2026): the last stage keeps every micro-batch's logits
        # to the step's end, erring towards more memory for the last few months' configs. The
        # 2024 layout ([experimental]) ran torch 2.6's stages, which kept every stage's outputs.
        pp_outputs_kept=("none" if pp == 1 else "all" if "pipeline_parallel_degree" in exp
                         else "last"),
        # FSDP shards over the data-parallel and context-parallel ranks together.
        zero_stage=3 if dp and (shard != 1 or cp > 1) else 0,
        loss_parallel=tp > 1 and not _first("disable_loss_parallel", False, par, train),
        # selective with selective_ac_option "op": the per-op policy; a number k (selective
        # layer AC, every k-th block in full) is counted as keeping every block's (Korthikanti's
        # selective, which under fused attention keeps what no AC keeps): errs towards more.
        recompute=("selective-op" if str(ac.get("mode", "selective")) == "selective"
                   and str(ac.get("selective_ac_option", "2")) == "op"
                   else str(ac.get("mode", "selective"))),
        compiled=blocks_compiled, compiled_loss=loss_compiled,
        checkpoint_enabled=bool(ck.get("enable_checkpoint", ck.get("enable", False))),
        checkpoint_uri=ck.get("folder"), checkpoint_every_steps=int(ck.get("interval", 500)),
        checkpoint_async=str(ck.get("async_mode", "disabled")) != "disabled",
        eval_every_steps=int(val.get("freq", 0)) if val.get("enabled", val.get("enable")) else 0,
        data_train=train.get("dataset"), data_val=val.get("dataset"),
        tokenizer=model.get("tokenizer_path") or model.get("hf_assets_path"), notes=tuple(notes))


# nanoGPT's train.py defaults (karpathy/nanoGPT train.py), which its config files override.
NANOGPT_DEFAULTS = {
    "batch_size": 12, "block_size": 1024, "gradient_accumulation_steps": 40, "max_iters": 600000,
    "learning_rate": 6e-4, "warmup_iters": 2000, "lr_decay_iters": 600000, "min_lr": 6e-5,
    "decay_lr": True, "weight_decay": 0.1, "beta2": 0.95, "grad_clip": 1.0, "n_layer": 12,
    "n_head": 12, "n_embd": 768, "bias": False, "dtype": "bfloat16", "eval_interval": 2000,
    "eval_iters": 200, "always_save_checkpoint": True, "vocab_size": 50304, "out_dir": "out",
    "dataset": "openwebtext",
}
_OPS = {ast.Add: op.add, ast.Sub: op.sub, ast.Mult: op.mul, ast.Div: op.truediv,
        ast.FloorDiv: op.floordiv, ast.Pow: op.pow, ast.Mod: op.mod}


def _literal(node: ast.AST):
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, str, bool)):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_literal(node.left), _literal(node.right))
    raise ValueError("not a literal")


def _nanogpt(path: Path, text: str, gpus: int | None) -> Setup:
    try:
        tree = ast.parse(text, filename=str(path))
    except SyntaxError as err:
        raise ConfigReadError(f"{path} is not valid Python: {err}") from None
    values, skipped = dict(NANOGPT_DEFAULTS), []
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            try:
                values[stmt.targets[0].id] = _literal(stmt.value)
            except (ValueError, TypeError, ZeroDivisionError):
                skipped.append(stmt.targets[0].id)
    notes = [f"not literal, ignored: {', '.join(skipped)}"] if skipped else []
    v = values
    cfg = GPTConfig(layers=int(v["n_layer"]), heads=int(v["n_head"]), dim=int(v["n_embd"]),
                    seq_len=int(v["block_size"]), vocab_size=int(v["vocab_size"]),
                    position="learned", bias=bool(v["bias"]))
    # train.py divides gradient_accumulation_steps by the world size, so tokens per iteration
    # are gradient_accumulation_steps × batch_size × block_size whatever the GPU count.
    batch = int(v["gradient_accumulation_steps"]) * int(v["batch_size"]) * int(v["block_size"])
    steps = int(v["max_iters"])
    lr = float(v["learning_rate"])
    if not gpus:
        notes.append("GPU count is set by the torchrun launch, not the config: pass --gpus")
    return Setup(
        source="nanoGPT", path=str(path), model=cfg, tokens=float(batch * steps),
        global_batch_tokens=batch, micro_batch=int(v["batch_size"]), lr=lr,
        warmup_steps=int(v["warmup_iters"]), total_steps=steps,
        schedule="cosine" if v["decay_lr"] else "constant",
        min_lr_ratio=float(v["min_lr"]) / lr if lr else None,
        weight_decay=float(v["weight_decay"]), beta2=float(v["beta2"]),
        grad_clip=float(v["grad_clip"]), precision=_DTYPES.get(str(v["dtype"]), "fp32"),
        gpus=gpus, dp=gpus, zero_stage=0, recompute="none",
        checkpoint_enabled=True, checkpoint_uri=str(v["out_dir"]),
        checkpoint_every_steps=int(v["eval_interval"]), checkpoint_async=False,
        eval_every_steps=int(v["eval_interval"]),
        eval_tokens=float(v["eval_iters"]) * int(v["batch_size"]) * int(v["block_size"]),
        data_train=str(v["dataset"]), data_val=str(v["dataset"]),
        compiled=bool(v.get("compile", True)),  # train.py's default: compile = True
        notes=tuple(notes))
