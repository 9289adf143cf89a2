"""A ready PretrainJob manifest from a plan (`crucible plan --emit-job`).

Owns the mapping from planned numbers to spec fields; it checks the name with the CRD's own rule
(`names.job_name_problem`) and validates the spec against `PretrainJobSpec`, so what it returns
is what the CRD accepts. A tensor or pipeline layout goes into `training.parallelism` with what
must agree with it: whole micro-batches on every data-parallel rank, at least one per pipeline
stage a step (trainer/pipeline.py), and an untied head under a pipeline (api/layout.py).
Recipe defaults come from GPT-3 (Brown et al. 2020, Table 2.1 and App. B) via `recipes`; the
checkpoint interval from `reliability` (Daly 2006). Pure: returns a dict; the CLI prints it as
YAML.
"""

from __future__ import annotations

import math

from pydantic import ValidationError

from crucible.api.arch import PRESETS, GPTConfig
from crucible.api.names import API_VERSION, KIND, job_name_problem
from crucible.api.spec import ModelSpec, PretrainJobSpec, explain
from crucible.trainer.plan import recipes


# ModelSpec's fields by the architecture field each sets (api/spec.py `ModelSpec.to_arch`).
SPEC_FIELDS = {"layers": "layers", "heads": "heads", "dim": "dim", "seq_len": "seqLen",
               "vocab_size": "vocabSize", "tied_embeddings": "tiedEmbeddings",
               "qk_norm": "qkNorm", "kv_heads": "kvHeads", "d_ff": "ffnDim", "norm": "norm",
               "mlp": "mlp", "position": "position", "bias": "bias",
               "rope_theta": "ropeTheta"}
SIZES = ("layers", "heads", "dim", "seq_len", "vocab_size")


def model_fields(cfg: GPTConfig, preset: str | None) -> dict:
    """`{preset: name}` plus the fields `cfg` changes (seqLen, tiedEmbeddings: false under a
    pipeline, ...) when it starts from a preset, else all sizes plus every field away from its
    default; raises ValueError if the spec cannot say `cfg` (a field it has no name for)."""
    if preset in PRESETS:
        base, out = PRESETS[preset], {"preset": preset}
    else:
        out = {SPEC_FIELDS[name]: getattr(cfg, name) for name in SIZES}
        base = GPTConfig(**{name: getattr(cfg, name) for name in SIZES})
    out.update({key: getattr(cfg, name) for name, key in SPEC_FIELDS.items()
                if getattr(cfg, name) != getattr(base, name)})
    if ModelSpec.model_validate(out).to_arch() != cfg:
        raise ValueError(f"the model {cfg} cannot be written as PretrainJob model fields")
    return out


def pretrain_job(*, name: str, image: str, cfg: GPTConfig, preset: str | None, params: float,
                 tokens: float, gpus: int, gpus_per_node: int, micro_batch: int,
                 checkpoint_minutes: float, activation_checkpointing: bool,
                 global_batch_tokens: float | None = None, data_train: str, data_val: str | None,
                 checkpoint_uri: str, lr: float | None = None,
                 tokenizer: str | None = None, gpu_resource: str = "nvidia.com/gpu",
                 precision: str = "bf16", tensor: int = 1, pipeline: int = 1,
                 schedule: str = "1F1B", virtual_stages: int = 1,
                 sharding: str = "auto") -> dict:
    """The manifest as a dict; raises ValueError (with the spec's own words) if it is invalid.
    `precision` is one Crucible's trainer runs: bf16, fp32, or bf16-sr (bf16 with
    training.optimizer.bf16StochasticRounding). `tensor` x `pipeline` > 1 writes
    `training.parallelism` (with `schedule` and, above 1, `virtual_stages`); `cfg` must already
    be untied under a pipeline.
    `sharding` other than auto is written as training.sharding."""
    problem = job_name_problem(name)
    if problem:
        raise ValueError(problem)
    row = recipes.gpt3_row(params)
    per_node = min(gpus, gpus_per_node)
    nodes = math.ceil(gpus / per_node)
    batch = global_batch_tokens or row.batch_tokens
    world = nodes * per_node
    if world % (tensor * pipeline):
        raise ValueError(f"tensor x pipeline = {tensor * pipeline} does not divide the {world} "
                         "ranks")
    # Whole micro-batches on every data-parallel rank (the tensor and pipeline ranks of one
    # replica read the same ones): round the batch to a multiple of seq·micro·dp, and give a
    # pipeline at least one micro-batch per stage a step.
    unit = cfg.seq_len * micro_batch * world // (tensor * pipeline)
    batch_tokens = max(pipeline * unit, round(batch / unit) * unit)
    steps = max(1, math.ceil(tokens / batch_tokens))
    warmup = min(math.ceil(recipes.GPT3_WARMUP_TOKENS / batch_tokens), max(1, steps // 10))
    spec = {
        "image": image,
        "nodes": {"min": nodes, "max": nodes},
        "procsPerNode": per_node,
        "resources": {"limits": {gpu_resource: per_node}},
        "model": model_fields(cfg, preset),
        "data": {"train": data_train, **({"val": data_val} if data_val else {}),
                 **({"tokenizer": tokenizer} if tokenizer else {})},
        "training": {
            "tokens": float(f"{tokens:.6g}"),
            "globalBatchTokens": int(batch_tokens),
            "microBatch": micro_batch,
            "lr": lr if lr is not None else row.lr,  # GPT-3 Table 2.1, nearest size
            "minLrRatio": recipes.GPT3_MIN_LR_RATIO,  # GPT-3 App. B: cosine to 10%
            "warmupSteps": warmup,  # GPT-3 App. B: 375M tokens, capped at 10% of the steps
            "schedule": "cosine",
            "weightDecay": 0.1,
            "beta2": 0.95,
            "gradClip": 1.0,
            "precision": "fp32" if precision == "fp32" else "bf16",
            **({"optimizer": {"bf16StochasticRounding": True}} if precision == "bf16-sr" else {}),
            "evalEvery": max(1, steps // 50),
            "activationCheckpointing": activation_checkpointing,
            **({"sharding": sharding} if sharding != "auto" else {}),
            **({"parallelism": {"tensor": tensor, "pipeline": pipeline, "schedule": schedule,
                                **({"virtualStages": virtual_stages}
                                   if virtual_stages > 1 else {})}}
               if tensor * pipeline > 1 else {}),
        },
        "checkpoint": {"uri": checkpoint_uri, "everyMinutes": round(checkpoint_minutes, 1),
                       "keep": 3, "async": True},
        "faultTolerance": {"maxRestarts": 20, "cordonFailedNodes": True},
    }
    try:
        PretrainJobSpec.model_validate(spec)
    except ValidationError as err:
        raise ValueError(f"the planned job does not validate:\n{explain(err)}") from None
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name}, "spec": spec}
