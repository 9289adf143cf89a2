"""The PretrainJob spec and the trainer's job config: one set of pydantic models for both planes.

This module is the single source of truth for
- the `PretrainJob` custom resource's `spec` (the operator generates the CRD's OpenAPI schema,
  descriptions included, from `PretrainJobSpec`), and
- `crucible train --config job.yaml` (`TrainJobConfig`), and the one projection from the first
  to the second, `TrainJobConfig.from_job`: what the operator writes into the job's ConfigMap and
  what `crucible train` reads from a whole PretrainJob manifest.

Which spec fields reach the pods is declared here, on the fields: those only the operator reads
carry `OPERATOR_ONLY`, and `pod_facing(spec)` is everything else. The operator's drift hash is
computed from `pod_facing` alone, so changing an operator-only knob never restarts a run.

Field names are camelCase, as in every Kubernetes resource; unknown fields are rejected so a typo
never silently falls back to a default. Torch-free: the operator imports it. It is longer than
the house's ~400 lines because every field carries the description `kubectl explain` shows:
splitting the spec across modules would scatter one resource's documentation.

Rules that span fields are written twice on purpose, once for each enforcer: a pydantic validator
(for `crucible train` and the operator) and a CEL rule (`x-kubernetes-validations`, attached with
`json_schema_extra`) that the apiserver runs at `kubectl apply`. Both live here, next to each other,
so the CRD that `crucible.operator.crd` generates from these models never drifts from them.
"""

from __future__ import annotations

import functools
import math
import re
import typing
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import (BaseModel, ConfigDict, Field, StrictBool, ValidationError, WithJsonSchema,
                      field_validator, model_validator)
from pydantic.alias_generators import to_camel

from crucible.api import arch, batch_ramp, launch, layout, sharding
from crucible.api.names import JOB_NAME_PATTERN, KIND, MAX_JOB_NAME_LENGTH


class Spec(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid",
                              frozen=True)


class OperatorOnly:
    """Marks a spec field that only the operator reads (`Annotated[int, OPERATOR_ONLY]`): it never
    reaches a pod, so changing it on a running job restarts nothing."""

    def __repr__(self) -> str:
        return "OPERATOR_ONLY"


OPERATOR_ONLY = OperatorOnly()


def model_type(annotation) -> type[BaseModel] | None:
    """The pydantic model inside a field's annotation (`X`, `X | None`, `list[X]`), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = model_type(arg)
        if found is not None:
            return found
    return None


@functools.cache   # a pure function of the class, asked for at every pod manifest
def _operator_only(model: type[BaseModel]) -> dict:
    """model_dump's `exclude` for every OPERATOR_ONLY field, at any depth (shared: callers
    must not change it)."""
    out: dict = {}
    for name, field in model.model_fields.items():
        if any(isinstance(meta, OperatorOnly) for meta in field.metadata):
            out[name] = True
        elif (sub := model_type(field.annotation)) is not None and (nested := _operator_only(sub)):
            out[name] = nested
    return out


def pod_facing(spec: BaseModel, *, exclude_defaults: bool = False) -> dict:
    """The fields of a spec (or part of one) that reach the pods, as the API spells them
    (`exclude_defaults`: only those not at their default)."""
    return spec.model_dump(by_alias=True, mode="json", exclude=_operator_only(type(spec)),
                           exclude_defaults=exclude_defaults)


def cel(rule: str, message: str) -> dict:
    """One `x-kubernetes-validations` entry: a CEL rule the apiserver checks, and what it says."""
    return {"rule": rule, "message": message}


def _preset_lookup(field: str, spec_field: str, on: str = "self") -> str:
    """CEL for a model field's effective value: the explicit one, else the preset's (`on`: the
    CEL path of the model spec)."""
    table = ", ".join(f"'{name}': {str(getattr(cfg, field)).lower()}"
                      for name, cfg in sorted(arch.PRESETS.items()))
    return f"(has({on}.{spec_field}) ? {on}.{spec_field} : {{{table}}}[{on}.preset])"


def _known_model(*spec_fields: str, on: str = "self") -> str:
    """CEL guard: every named field is explicit, or comes from a known preset."""
    presets = "[" + ", ".join(f"'{name}'" for name in sorted(arch.PRESETS)) + "]"
    known_preset = f"(has({on}.preset) && {on}.preset in {presets})"
    return " && ".join(f"(has({on}.{f}) || {known_preset})" for f in spec_fields)


# Kubernetes resource quantity (k8s.io/apimachinery/pkg/api/resource: quantity.go's grammar).
QUANTITY = (r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|"
            r"([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$")

# A volume's size limit: a quantity above zero. The kubelet reads a sizeLimit of 0 as none at
# all (no eviction for disk; /dev/shm sized by the pod's or the node's memory), so "0" would
# be a way around every limit.
SIZE_LIMIT = (r"^\+?([0-9]*[1-9][0-9]*(\.[0-9]*)?|[0-9]*\.[0-9]*[1-9][0-9]*)"
              r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$")

# GPTConfig's field names are the spec's, in snake_case: an arch error names the spec field.
_ARCH_FIELD = re.compile(r"\b(layers|heads|dim|seq_len|vocab_size|kv_heads)\b")


_DIM, _HEADS = _preset_lookup("dim", "dim"), _preset_lookup("heads", "heads")


class ModelSpec(Spec):
    """The GPT to train: a preset, optionally with some fields overridden, or explicit sizes."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        cel("has(self.preset) || (has(self.layers) && has(self.heads) && has(self.dim) && "
            "has(self.seqLen) && has(self.vocabSize))",
            "give model.preset, or all of model.layers, heads, dim, seqLen and vocabSize"),
        cel(f"!({_known_model('dim', 'heads')}) || {_DIM} % {_HEADS} == 0",
            "model.dim must be divisible by model.heads"),
        cel(f"!({_known_model('dim', 'heads')}) || {_DIM} % {_HEADS} != 0 || "
            f"({_DIM} / {_HEADS}) % 2 == 0",
            "RoPE needs an even head dimension: model.dim / model.heads must be even"),
    ]})

    preset: str | None = Field(None, description=f"One of {sorted(arch.PRESETS)}; explicit "
                               "fields below override the preset's values.",
                               json_schema_extra={"enum": sorted(arch.PRESETS)})
    layers: int | None = Field(None, ge=1, le=256, description="Transformer blocks.")
    heads: int | None = Field(None, ge=1, le=256, description="Attention heads per block.")
    dim: int | None = Field(None, ge=8, le=65536,
                            description="Model width (d_model in the GPT papers).")
    seq_len: int | None = Field(None, ge=8, le=1 << 20, description="Context length in tokens.")
    vocab_size: int | None = Field(None, ge=2, le=1 << 22, description="Embedding rows; must be "
                                   ">= the tokenizer's vocabulary (pad to a multiple of 64).")
    tied_embeddings: bool | None = Field(None, description="Share input embedding and output layer.")
    qk_norm: bool | None = Field(None, description="LayerNorm on queries and keys (stability).")
    kv_heads: int | None = Field(None, ge=0, le=256, description="Key/value heads: fewer than "
                                 "heads (dividing it) is grouped-query attention; 0 = heads.")
    ffn_dim: int | None = Field(None, ge=0, le=1 << 20, description="MLP inner width (0: 4 x "
                                "dim, GPT-2's).")
    norm: Literal["layernorm", "rmsnorm"] | None = Field(None, description="Normalisation layer.")
    mlp: Literal["gelu", "swiglu"] | None = Field(None, description="MLP: GPT-2's GELU or "
                                                  "Llama's SwiGLU.")
    position: Literal["rope", "learned"] | None = Field(None, description="Rotary or learned "
                                                        "(GPT-2's) position embeddings.")
    bias: bool | None = Field(None, description="Biases in linear layers and LayerNorms (GPT-2).")
    rope_theta: float | None = Field(None, gt=0, description="RoPE base (10,000 in RoFormer, "
                                     "500,000 in Llama 3).")

    @model_validator(mode="after")
    def _complete(self) -> "ModelSpec":
        if self.preset is None and None in (self.layers, self.heads, self.dim, self.seq_len,
                                            self.vocab_size):
            raise ValueError("give model.preset, or all of model.layers, heads, dim, seqLen and "
                             "vocabSize")
        try:
            self.to_arch()  # surfaces divisibility errors now, in the spec's own field names
        except ValueError as err:
            message = _ARCH_FIELD.sub(lambda m: "model." + to_camel(m.group(1)), str(err))
            raise ValueError(message) from None
        return self

    def to_arch(self) -> arch.GPTConfig:
        overrides = {k: v for k, v in {
            "layers": self.layers, "heads": self.heads, "dim": self.dim,
            "seq_len": self.seq_len, "vocab_size": self.vocab_size,
            "tied_embeddings": self.tied_embeddings, "qk_norm": self.qk_norm,
            "kv_heads": self.kv_heads, "d_ff": self.ffn_dim, "norm": self.norm, "mlp": self.mlp,
            "position": self.position, "bias": self.bias, "rope_theta": self.rope_theta}.items()
            if v is not None}
        if self.preset is not None:
            return arch.preset(self.preset, **overrides)
        return arch.GPTConfig(**overrides)


class DataSpec(Spec):
    """Tokenized shards written by `crucible tokenizer encode` (local paths or s3:// URIs)."""

    train: str = Field(..., min_length=1, description="Folder or URI prefix of the training shards.")
    val: str | None = Field(None, description="Folder or URI prefix of the held-out shards.")
    tokenizer: str | None = Field(None, description="tokenizer.json the shards were encoded with; "
                                  "checked against the hash in the shard headers.")


_GROUP_WITH_FSDP = ("training.shardGroupSize applies to sharding hsdp or auto: fsdp shards over "
                    "every rank")


# Activation checkpointing (torchtitan's `activation_checkpoint` modes): recompute nothing, every
# block, every k-th block, or inside every block all but the saved ops (matmuls, attention).
AC_MODES = ("none", "full", "every-k-layers", "selective-op")
_AC_DESCRIPTION = (
    "What backward recomputes instead of keeping: none; full (every block); every-k-layers "
    "(every activationCheckpointingEvery-th block); selective-op (every block, but matmul and "
    "attention outputs are kept: torchtitan's per-op policy). true and false, the older form, "
    "mean full and none.")


class ProfileSpec(Spec):
    """torch.profiler traces of a few steps (docs/training.md, "Step speed")."""

    start_step: int = Field(..., ge=1, description="First step traced (1-based; the step "
                            "before it warms the profiler up).")
    steps: int = Field(3, ge=1, le=100, description="Steps traced; each rank writes one "
                       "Chrome trace of them under <outputDir>/profile/.")


_INTERLEAVED = "has(self.schedule) && self.schedule == 'interleaved1F1B'"
_VIRTUAL_MISFIT = ("training.parallelism.virtualStages is at least 2 with schedule "
                   "interleaved1F1B and 1 (or unset) with 1F1B or GPipe")
_INTERLEAVED_NEEDS_STAGES = ("training.parallelism.schedule interleaved1F1B needs pipeline of at "
                             "least 2")


class ParallelismSpec(Spec):
    """Model parallelism inside the data-parallel ranks (torchtitan's mesh: dp_replicate,
    dp_shard, pp, tp): `tensor` ranks split each block's matmuls, `pipeline` stages split the
    layers; FSDP/HSDP shards over what is left of the world."""

    tensor: int = Field(1, ge=1, le=64, description="Tensor-parallel degree: ranks that split "
                        "each block's matmuls (column-wise in, row-wise out, sequence parallel "
                        "on the norms). It must divide procsPerNode (it stays inside a node, on "
                        "NVLink), the heads and the key/value heads.")
    pipeline: int = Field(1, ge=1, le=256, description="Pipeline stages, each an equal share of "
                          "the layers (it must divide them), fed the step's micro-batches "
                          "(the gradient accumulation's, at least one per stage) by `schedule`.")
    schedule: Literal["1F1B", "GPipe", "interleaved1F1B"] = Field(
        "1F1B", description="Pipeline schedule (torch.distributed.pipelining): 1F1B (one "
        "forward, one backward: activations of at most `pipeline` micro-batches held) or GPipe "
        "(every forward, then every backward: activations of all of them), both idle "
        "(p-1)/(m+p-1) of the step for m micro-batches; or interleaved1F1B, where each rank "
        "holds `virtualStages` stages spread along the model, which cuts the idle share to "
        "(p-1)/(v·m+p-1) for more point-to-point traffic and somewhat more activations.")
    virtual_stages: int = Field(1, ge=1, le=16, description="Stages per pipeline rank, for "
                                "interleaved1F1B (at least 2 there, 1 otherwise): the layers "
                                "split into pipeline x virtualStages equal stages, rank r "
                                "holding stages r, r+pipeline, ...")

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        cel(f"({_INTERLEAVED}) == (has(self.virtualStages) && self.virtualStages > 1)",
            _VIRTUAL_MISFIT),
        cel(f"!({_INTERLEAVED}) || (has(self.pipeline) && self.pipeline > 1)",
            _INTERLEAVED_NEEDS_STAGES)]})

    @model_validator(mode="after")
    def _virtual_stages_fit_schedule(self) -> "ParallelismSpec":
        interleaved = self.schedule == "interleaved1F1B"
        if interleaved != (self.virtual_stages > 1):
            raise ValueError(f"{_VIRTUAL_MISFIT} (got schedule {self.schedule}, virtualStages "
                             f"{self.virtual_stages})")
        if interleaved and self.pipeline == 1:
            raise ValueError(_INTERLEAVED_NEEDS_STAGES)
        return self

    @property
    def model_parallel(self) -> int:
        """Ranks that hold one copy of the model between them (tensor x pipeline)."""
        return self.tensor * self.pipeline

    @property
    def stages(self) -> int:
        """Pipeline stages in all: `pipeline` ranks, each holding `virtual_stages` of them."""
        return self.pipeline * self.virtual_stages


class BatchRampSpec(Spec):
    """A global batch that grows linearly over the first tokens of the run (GPT-3's batch size
    ramp, Brown et al. 2020, appendix B)."""

    start_tokens: int = Field(..., ge=1, description="Global batch at step 0, in tokens, below "
                              "globalBatchTokens; every batch of the ramp is rounded down to "
                              "whole micro-batches per data-parallel rank (at least one).")
    ramp_tokens: float = Field(..., gt=0, description="Training tokens over which the batch "
                               "grows linearly to globalBatchTokens (at most training.tokens).")


class OptimizerSpec(Spec):
    """How parameters are stored and updated."""

    bf16_stochastic_rounding: bool = Field(
        False, description="Keep the parameters in bf16 with no fp32 master copy, and round "
        "each AdamW update into them stochastically (unbiased in expectation), so small updates "
        "are not lost to round-to-nearest; saves 4 bytes per parameter. Needs precision bf16.")


_SR_NEEDS_BF16 = ("training.optimizer.bf16StochasticRounding keeps the parameters in bf16: it "
                  "needs training.precision bf16")
_RAMP_START = ("training.batchRamp.startTokens must be below training.globalBatchTokens: the "
               "batch ramps up to the global batch")
_RAMP_LENGTH = ("training.batchRamp.rampTokens must not exceed training.tokens: the run would "
                "end before its batch is full")


class TrainingSpec(Spec):
    """Optimisation settings. Defaults follow GPT-3 small / nanoGPT's GPT-2 reproduction."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        cel("!has(self.shardGroupSize) || !has(self.sharding) || self.sharding != 'fsdp'",
            _GROUP_WITH_FSDP),
        cel("!has(self.optimizer) || !has(self.optimizer.bf16StochasticRounding) || "
            "!self.optimizer.bf16StochasticRounding || !has(self.precision) || "
            "self.precision == 'bf16'", _SR_NEEDS_BF16),
        # 524288: globalBatchTokens' default, for a spec given without it.
        cel("!has(self.batchRamp) || self.batchRamp.startTokens < "
            "(has(self.globalBatchTokens) ? self.globalBatchTokens : 524288)", _RAMP_START),
        cel("!has(self.batchRamp) || self.batchRamp.rampTokens <= self.tokens", _RAMP_LENGTH)]})

    tokens: float = Field(..., gt=0, description="Total training tokens (e.g. 2.5e9).")
    global_batch_tokens: int = Field(524288, ge=1, description="Tokens per optimizer step, "
                                     "summed over all ranks and accumulation micro-steps "
                                     "(GPT-3 small: 0.5M).")
    micro_batch: int = Field(8, ge=1, description="Sequences per rank per forward/backward.")
    lr: float = Field(6e-4, gt=0, le=1, description="Peak learning rate (GPT-3 small: 6e-4).")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Final LR as a share of the peak "
                                "(Chinchilla decays to 10%).")
    warmup_steps: int = Field(700, ge=0, description="Linear warmup steps.")
    schedule: Literal["cosine", "wsd", "constant"] = Field("cosine", description="Decay after "
                                                          "warmup: cosine, warmup-stable-decay, "
                                                          "or constant.")
    decay_fraction: float = Field(0.2, gt=0, le=1, description="WSD: share of steps spent "
                                  "decaying at the end (Hägele et al. 2024 use 20%).")
    weight_decay: float = Field(0.1, ge=0, description="AdamW decoupled weight decay on matrices.")
    beta1: float = Field(0.9, ge=0, lt=1, description="AdamW first-moment decay.")
    beta2: float = Field(0.95, ge=0, lt=1, description="0.95 as GPT-3 and LLaMA (not 0.999).")
    eps: float = Field(1e-8, gt=0, description="AdamW denominator epsilon.")
    grad_clip: float = Field(1.0, ge=0, description="Global gradient-norm clip; 0 disables.")
    precision: Literal["bf16", "fp32"] = Field("bf16", description="Parameter/compute dtype for "
                                               "matmuls; gradients are reduced in fp32.")
    seed: int = Field(1337, ge=0, description="Seed of the weight init and the data order.")
    eval_every: int = Field(0, ge=0, description="Steps between held-out evals (0: at the end).")
    eval_tokens: int = Field(1 << 20, ge=1, description="Held-out tokens per eval.")
    log_every: int = Field(1, ge=1, description="Steps between log lines; the AdamW update norm "
                           "is measured on those steps only.")
    compile: bool | None = Field(None, description="torch.compile each block and the loss. "
                                 "Unset: on when training on CUDA GPUs, off on CPU (inductor's "
                                 "CPU kernels need a C++ compiler and rarely repay the compile "
                                 "time); true or false forces it.")
    # Old job YAML says true/false, so the value is a boolean or a mode; the CRD cannot type a
    # field as either, so it leaves it untyped and `activation_checkpointing_mode` validates it
    # (the operator refuses a bad value as InvalidSpec). False stays the default so jobs written
    # before the modes keep their drift hash.
    activation_checkpointing: Annotated[
        StrictBool | Literal[AC_MODES],
        WithJsonSchema({"x-kubernetes-preserve-unknown-fields": True})] = Field(
        False, description=_AC_DESCRIPTION)
    activation_checkpointing_every: int = Field(2, ge=1, le=256, description="k of "
                                                "every-k-layers: blocks k, 2k, ... (1-based) are "
                                                "recomputed (torchtitan's selective layer AC).")
    gc_every_steps: int = Field(50, ge=0, description="Python's automatic garbage collection is "
                                "turned off and a generation-1 collection runs every this many "
                                "steps, so that no rank pauses at a random step and stalls the "
                                "others (torchtitan's gc_freq, default 50); 0: automatic.")
    profile: ProfileSpec | None = Field(None, description="torch.profiler traces of a step range "
                                        "(unset: none).")
    memory_snapshot_step: int | None = Field(None, ge=1, description="Record CUDA allocations "
                                             "from start-up and dump a memory snapshot after "
                                             "this step to <outputDir>/memory_snapshot/ (view it "
                                             "at pytorch.org/memory_viz); CUDA only.")
    gradient_sync: Literal["everyMicroBatch", "lastMicroBatch"] = Field(
        "everyMicroBatch", description="When FSDP reduce-scatters gradients during accumulation: "
        "after every micro-batch (only sharded gradients are held; torchtitan's default), or "
        "only after the last (1/accumulation of the gradient traffic, but every GPU holds the "
        "full unsharded fp32 gradients, 4 bytes x parameters, while accumulating).")
    sharding: Literal["auto", "fsdp", "hsdp"] = Field(
        "auto", description="How the ranks share parameters, gradients and optimizer state: "
        "fsdp shards them over every rank (each layer is all-gathered from every node); hsdp "
        "shards them within groups of shardGroupSize ranks and keeps one copy per group "
        "(all-gathers stay inside a group; only a gradient all-reduce crosses groups); auto: "
        "hsdp with one node per group when the job spans more than one node, fsdp otherwise "
        "(docs/defaults.md, \"Sharding: FSDP or HSDP\").")
    shard_group_size: int | None = Field(
        None, ge=1, le=4096, description="hsdp and auto: ranks per shard group (default: the "
        "processes per node). It must divide the world size at every node count the job may "
        "run at: a divisor of procsPerNode, or, with nodes.min = nodes.max, of the ranks.")
    parallelism: ParallelismSpec = Field(default_factory=ParallelismSpec, description="Tensor "
                                         "and pipeline parallelism (unset: data parallel only).")
    batch_ramp: BatchRampSpec | None = Field(None, description="Grow the global batch linearly "
                                             "from startTokens to globalBatchTokens over the "
                                             "first rampTokens (unset: constant). The ramp's "
                                             "steps are smaller, so the run takes more of them; "
                                             "warmupSteps and the decay count steps.")
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec,
                                     description="Parameter storage and update.")

    @model_validator(mode="after")
    def _group_needs_hybrid(self) -> "TrainingSpec":
        if self.shard_group_size is not None and self.sharding == "fsdp":
            raise ValueError(_GROUP_WITH_FSDP)
        return self

    @model_validator(mode="after")
    def _rounding_needs_bf16(self) -> "TrainingSpec":
        if self.optimizer.bf16_stochastic_rounding and self.precision != "bf16":
            raise ValueError(_SR_NEEDS_BF16)
        return self

    @model_validator(mode="after")
    def _ramp_fits(self) -> "TrainingSpec":
        if self.batch_ramp is not None and self.batch_ramp.start_tokens >= self.global_batch_tokens:
            raise ValueError(f"{_RAMP_START} (startTokens {self.batch_ramp.start_tokens}, "
                             f"globalBatchTokens {self.global_batch_tokens})")
        if self.batch_ramp is not None and self.batch_ramp.ramp_tokens > self.tokens:
            raise ValueError(f"{_RAMP_LENGTH} (rampTokens {self.batch_ramp.ramp_tokens:g}, "
                             f"tokens {self.tokens:g})")
        return self

    @property
    def total_steps_hint(self) -> int:
        return max(1, math.ceil(self.tokens / self.global_batch_tokens))

    @field_validator("activation_checkpointing", mode="before")
    @classmethod
    def _ac_mode(cls, value):
        if not isinstance(value, bool) and value not in AC_MODES:
            raise ValueError(f"activationCheckpointing must be one of {', '.join(AC_MODES)} (or "
                             f"true/false, meaning full/none), got {value!r}")
        return value

    @property
    def activation_checkpointing_mode(self) -> str:
        """One of AC_MODES, whichever form the job used."""
        value = self.activation_checkpointing
        if isinstance(value, bool):
            return "full" if value else "none"
        return value


# An object name (Secret, PriorityClass): RFC 1123 subdomain, as the apiserver requires.
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
S3_URI = re.compile(r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/.*)?$")  # S3 bucket naming rules


class CheckpointSpec(Spec):
    """Sharded checkpoints (DCP) under `uri`, committed by a manifest written last."""

    # Apiserver only (a transition rule needs the old object): the job resumes from `uri`, so
    # changing it mid-run would silently start over; set it once.
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        cel("!has(oldSelf.uri) || (has(self.uri) && self.uri == oldSelf.uri)",
            "checkpoint.uri cannot change once set: the job resumes from the checkpoints under "
            "it (create a new job to start elsewhere)"),
        # The same rule as _storage_uri below.
        cel(f"!has(self.uri) || !self.uri.contains('://') || self.uri.matches('{S3_URI.pattern}')",
            "checkpoint.uri must be s3://bucket/prefix with a valid bucket name (3-63 characters: "
            "lowercase letters, digits, '.', '-') or a local folder")]})

    uri: str | None = Field(None, description="s3://bucket/prefix or a local folder; none: no "
                            "checkpoints (not recommended).")
    every_minutes: float = Field(10.0, ge=0, description="Wall-clock interval between saves "
                                 "(see `crucible plan` for the Young/Daly optimum).")
    every_steps: int = Field(0, ge=0, description="Step interval between saves (0: time only).")
    keep: int = Field(3, ge=2, description="Newest checkpoints kept; at least 2, because the "
                      "newest may still be uploading (torchtitan refuses 1 for the same reason).")
    keep_every: int = Field(0, ge=0, description="Also keep every step multiple of this forever "
                            "(spike rollbacks need older checkpoints; when that step has no "
                            "commit, the first one after it); 0: off.")
    async_: bool = Field(True, alias="async", description="Stage in memory, upload in the "
                         "background: training blocks only for the copy.")
    in_memory_every_steps: int = Field(0, ge=0, description="Steps between in-memory "
                                       "snapshots: each rank keeps its shard in host memory "
                                       "(the pod's /dev/shm) and a copy on the next node, and a "
                                       "restart at the same world size restores from them in "
                                       "seconds, reading S3 only when both copies of a shard "
                                       "are gone. 0: off. Each node needs 2 x inMemoryKeep x its "
                                       "shards' size in spec.shmSizeLimit.")
    in_memory_keep: int = Field(2, ge=1, le=16, description="In-memory snapshots kept per node "
                                "(a guard rollback may restore an older one).")
    accept_changed_batch: bool = Field(False, description="Resume even though "
                                       "training.globalBatchTokens changed since the checkpoint: "
                                       "training continues at the first sample not yet trained "
                                       "on, and the steps left are the tokens left over the new "
                                       "batch. Otherwise such a resume is refused.")
    accept_changed_data: bool = Field(False, description="Resume even though the training "
                                      "shards changed since the checkpoint (another token "
                                      "count): the new shards' order starts from its beginning. "
                                      "Otherwise such a resume is refused.")
    credentials_secret: str | None = Field(None, max_length=253, pattern=DNS_SUBDOMAIN,
                                           description="Secret with AWS_ACCESS_KEY_ID, "
                                           "AWS_SECRET_ACCESS_KEY (and optionally "
                                           "AWS_ENDPOINT_URL, AWS_DEFAULT_REGION). None: the "
                                           "storage SDK's default chain (workload identity via "
                                           "serviceAccount.annotations, or the node's role).")
    signing_key_secret: str | None = Field(None, max_length=253, pattern=DNS_SUBDOMAIN,
                                           description="Secret whose key "
                                           f"{launch.ENV_SIGNING_KEY} holds an HMAC key: every "
                                           "commit's manifest is signed with it, and a commit "
                                           "without a valid signature is never loaded (someone "
                                           "who can write the bucket but lacks the key cannot "
                                           "plant a checkpoint).")

    @field_validator("uri")
    @classmethod
    def _storage_uri(cls, uri: str | None) -> str | None:
        if uri is None:
            return uri
        if "://" in uri and not uri.startswith("s3://"):
            raise ValueError(f"unsupported scheme in {uri!r}: use s3://bucket/prefix or a local folder")
        if uri.startswith("s3://") and not S3_URI.match(uri):
            raise ValueError(f"{uri!r} is not s3://bucket/prefix with a valid bucket name "
                             "(3-63 characters: lowercase letters, digits, '.', '-')")
        return uri


class SpikeGuardSpec(Spec):
    """Loss-spike and divergence detection in the training loop (docs/defaults.md, "Spike
    policy"). Thresholds are robust z-scores of log loss and log gradient norm against a
    detrended baseline of recent healthy steps."""

    enabled: bool = Field(True, description="Detect loss spikes and divergence and act on them.")
    window: int = Field(128, ge=8, le=100000, description="Healthy steps the statistics use "
                        "(llm.c's outlier detector: 128).")
    min_history: int = Field(32, ge=4, description="Steps of history before any spike verdict.")
    z_skip: float = Field(7.0, gt=0, description="Do not apply an update whose loss or gradient "
                          "norm is this far out (llm.c skips at z > 7; OLMo 2 counts 7-sigma "
                          "spikes).")
    z_spike: float = Field(6.0, gt=0, description="An applied step this far out opens a spike "
                           "episode, judged transient or not by what follows.")
    z_normal: float = Field(3.0, gt=0, description="Back within this many MADs = recovered.")
    recover_steps: int = Field(20, ge=1, description="K: an episode not recovered within K steps "
                               "means rollback.")
    growth_steps: int = Field(10, ge=2, description="Gradient norm above normal and higher "
                              "than where it started for this many consecutive steps means "
                              "rollback.")
    divergence: float = Field(0.05, gt=0, description="Smoothed loss (median of 16 steps) this "
                              "share above its best level means rollback (slow divergence).")
    max_skips: int = Field(3, ge=1, description="More skipped updates than this within skipWindow "
                           "steps means rollback.")
    skip_window: int = Field(100, ge=1, description="Steps over which skipped updates are "
                             "counted (maxSkips).")
    rollback_margin_steps: int = Field(100, ge=0, description="R: roll back to a commit at least "
                                       "this many steps before the spike began (PaLM restarted "
                                       "~100 steps before).")
    data_skip_steps: int | None = Field(None, ge=0, description="Batches to skip after a "
                                        "rollback, counted from the restored step; default: the "
                                        "whole window from the restored step to the spike (PaLM "
                                        "skipped 200-500 batches).")
    lr_factor: float = Field(0.5, gt=0, le=1, description="LR multiplier after a rollback (the "
                             "OPT-175B logbook lowered LR when restarting).")
    cooldown_steps: int = Field(200, ge=0, description="Steps the lowered LR lasts after the "
                                "restored step.")
    max_rollbacks: int = Field(3, ge=1, description="Rollbacks without getting past the spike "
                               "before the run aborts.")


class TrainerStragglerSpec(Spec):
    """Detection of a rank persistently slower than the others, by the trainer
    (docs/checkpoints.md, "Stragglers"), from each rank's time for its own work per step."""

    enabled: bool = Field(True, description="Compare ranks' busy times every step (no extra "
                          "collective) and report stragglers.")
    factor: float = Field(1.2, gt=1, le=10, description="A rank is slow when its busy time is "
                          "this many times the other ranks' median.")
    window_steps: int = Field(30, ge=1, le=10000, description="Steps whose median ratio is "
                              "judged (one noisy step decides nothing).")
    patience_steps: int = Field(10, ge=1, le=100000, description="Steps in a row the windowed "
                                "ratio must stay above the factor before the rank is reported.")


class StragglerSpec(TrainerStragglerSpec):
    """Straggler detection (the trainer's part) and what the operator does about one."""

    replace_after_minutes: Annotated[int, OPERATOR_ONLY] = Field(
        0, ge=0, le=10080, description="A rank still reported slow after this long has its "
        "pod replaced elsewhere and its node avoided by the job; the node is cordoned too "
        "(cordonFailedNodes applies) only where the operator's --straggler-cordon-selector "
        "allows; 0: report only (status, event, metric).")


# The kubelet's own node conditions: the operator already reads Ready (NotReady, unreachable),
# and the pressure conditions are the kubelet's to act on (eviction). As a job's failure
# condition "Ready" would make every healthy node under it "failed": a tenant could cordon the pool.
KUBELET_CONDITIONS = ("Ready", "MemoryPressure", "DiskPressure", "PIDPressure",
                      "NetworkUnavailable")
_KUBELET_CONDITIONS_MESSAGE = ("faultTolerance.nodeFailureConditions cannot name the kubelet's "
                               "own conditions (Ready, MemoryPressure, DiskPressure, PIDPressure, "
                               "NetworkUnavailable): list those a node-problem-detector or GPU "
                               "health checker sets, e.g. GPUUnhealthy")


class FaultToleranceSpec(Spec):
    """What the operator does when pods, nodes or the training itself fail (docs/operator.md)."""

    max_restarts: Annotated[int, OPERATOR_ONLY] = Field(
        20, ge=0, description="Application failures tolerated before the job fails; "
        "infrastructure failures do not count.")
    cordon_failed_nodes: Annotated[bool, OPERATOR_ONLY] = Field(
        True, description="Cordon and annotate nodes that failed.")
    hang_timeout_seconds: Annotated[int, OPERATOR_ONLY] = Field(
        600, ge=30, description="Restart when the progress Lease's step has not changed for this "
        "long (timed on the operator's clock) once the group has stepped.")
    startup_timeout_seconds: Annotated[int, OPERATOR_ONLY] = Field(
        1800, ge=60, le=86400, description="Restart when a group has not completed its first "
        "step this long after starting (rendezvous, restoring a checkpoint, the first compile).")
    spike_guard: SpikeGuardSpec = Field(default_factory=SpikeGuardSpec,
                                        description="Loss-spike and divergence detection.")
    stragglers: StragglerSpec = Field(default_factory=StragglerSpec,
                                      description="Straggler detection (reported in status, "
                                      "events and metrics).")
    # Exit codes follow Kubeflow's ExitCode policy: 1-127 come from the program (application),
    # 128+n means killed by signal n (infrastructure).
    retryable_exit_codes: Annotated[list[int], OPERATOR_ONLY] = Field(
        default_factory=list, max_length=64,
        json_schema_extra={"items": {"type": "integer", "minimum": 1, "maximum": 255},
                           "x-kubernetes-list-type": "set"},
        description="Exit codes in 1-127 to treat as infrastructure failures (retried without "
        "counting against maxRestarts), e.g. a code your launcher uses for NCCL timeouts.")
    max_restarts_without_progress: Annotated[int, OPERATOR_ONLY] = Field(
        3, ge=1, le=1000, description="Fail fast: application failures in a row with no training "
        "step completed between them (a crash loop, e.g. a bad config) before the job fails.")
    node_failure_grace_seconds: Annotated[int, OPERATOR_ONLY] = Field(
        60, ge=0, le=3600, description="How long a node may stay failed (NotReady, unreachable "
        "or a failure condition) before this job's pods on it are force-deleted and recreated "
        "elsewhere. The node controller has already waited its own grace period (40-50 s) by "
        "then; Kubernetes's default toleration would wait 300 s more with the whole job idle.")
    node_failure_conditions: Annotated[list[str], OPERATOR_ONLY] = Field(
        default_factory=list, max_length=32,
        json_schema_extra={"items": {"type": "string", "minLength": 1, "maxLength": 316},
                           "x-kubernetes-list-type": "set",
                           "x-kubernetes-validations": [cel(
                               f"self.all(c, !(c in {list(KUBELET_CONDITIONS)}))",
                               _KUBELET_CONDITIONS_MESSAGE)]},
        description="Node condition types that mean the node is broken when True (set by "
        "node-problem-detector or a GPU health checker, e.g. GPUUnhealthy). The kubelet's own "
        "(Ready, MemoryPressure, DiskPressure, PIDPressure, NetworkUnavailable) are refused; the "
        "operator acts only on those its administrator allows (--node-failure-conditions).")
    pending_timeout_seconds: Annotated[int, OPERATOR_ONLY] = Field(
        600, ge=10, le=86400, description="Pods Pending longer than this before the job's first "
        "run: an image pull or container config error fails the job (once it has run, the same "
        "errors are reported as Degraded and retried); an unschedulable pod is reported with "
        "the scheduler's reason (multi-GB trainer images can take minutes to pull).")
    max_infrastructure_restarts: Annotated[int, OPERATOR_ONLY] = Field(
        10, ge=1, le=10000, description="Restarts of one infrastructure cause (OOMKilled, "
        "Signal, NodeFailure, ...) within infrastructureRestartWindowMinutes that fail the job "
        "(InfrastructureLoop): a loop, not bad luck. Waiting for capacity never counts.")
    infrastructure_restart_window_minutes: Annotated[int, OPERATOR_ONLY] = Field(
        10, ge=1, le=10080, description="The window of maxInfrastructureRestarts.")
    terminating_timeout_seconds: Annotated[int, OPERATOR_ONLY] = Field(
        120, ge=0, le=86400, description="Pods still Terminating this long after their grace "
        "period ended are force-deleted (their node is usually gone).")
    rendezvous_timeout_seconds: int = Field(
        600, ge=30, le=86400, description="torchrun's rendezvous join timeout: how long pods wait "
        "for nodes.min of them to gather. When fewer than nodes.min pods can be scheduled the "
        "survivors exit after it, and the operator restarts the group without counting it "
        "(InsufficientCapacity) until capacity returns.")
    capacity_timeout_seconds: Annotated[int, OPERATOR_ONLY] = Field(
        1800, ge=30, le=604800, description="How long a generation may stay short of capacity "
        "(fewer than nodes.min pods schedulable) while holding the pods it did get. Then it "
        "releases them, so that no other job waits on GPUs this one cannot use, and waits in "
        "phase Waiting (never counted as a restart). Long by default: a Pending pod is what asks "
        "a cluster autoscaler for a node.")
    capacity_retry_seconds: Annotated[int, OPERATOR_ONLY] = Field(
        300, ge=10, le=86400, description="After releasing its pods, how long the job waits "
        "before trying again (doubled after each retry that is still short, up to 1 h; at once "
        "when a schedulable node joins the cluster), and how long a retry may stay short before "
        "it releases again.")
    avoid_failed_nodes_minutes: Annotated[int, OPERATOR_ONLY] = Field(
        10, ge=0, le=10080, description="How long this job keeps its pods off a node that "
        "failed under it once the node is healthy again. A node the operator cordoned is "
        "avoided until someone uncordons it, and trusted again at once when they do.")
    torchrun_max_restarts: int = Field(
        3, ge=0, le=1000, description="torchrun --max-restarts: worker failures torchrun restarts "
        "in place, inside the pod, before the pod fails and the operator steps in.")

    @field_validator("node_failure_conditions")
    @classmethod
    def _not_kubelet_conditions(cls, conditions: list[str]) -> list[str]:
        if any(c in KUBELET_CONDITIONS for c in conditions):
            raise ValueError(_KUBELET_CONDITIONS_MESSAGE)
        return conditions

    @field_validator("retryable_exit_codes")
    @classmethod
    def _exit_codes(cls, codes: list[int]) -> list[int]:
        bad = [code for code in codes if not 1 <= code <= 255]
        if bad:
            raise ValueError(f"exit codes are 1-255, got {bad}")
        if len(set(codes)) != len(codes):
            raise ValueError("exit codes must be unique")
        return codes


class TolerationSpec(Spec):
    """A pod toleration (same fields as core/v1 Toleration)."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        cel("self.operator != 'Exists' || !has(self.value) || self.value == ''",
            "a toleration with operator Exists takes no value"),
        cel("has(self.key) || self.operator == 'Exists'",
            "a toleration without a key must use operator Exists"),
        cel("!has(self.tolerationSeconds) || (has(self.effect) && self.effect == 'NoExecute')",
            "tolerationSeconds applies only to effect NoExecute"),
    ]})

    key: str | None = Field(None, max_length=316, description="Taint key; empty with operator "
                            "Exists tolerates every taint.")
    operator: Literal["Exists", "Equal"] = Field("Equal", description="Equal: the taint's value "
                                                 "must match; Exists: any value.")
    value: str | None = Field(None, max_length=63, description="Taint value (operator Equal).")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        None, description="Taint effect to tolerate; empty: all effects.")
    toleration_seconds: int | None = Field(None, ge=0, description="NoExecute only: how long "
                                           "the pod stays bound after the taint appears.")

    @model_validator(mode="after")
    def _consistent(self) -> "TolerationSpec":
        if self.operator == "Exists" and self.value:
            raise ValueError("a toleration with operator Exists takes no value")
        if self.key is None and self.operator != "Exists":
            raise ValueError("a toleration without a key must use operator Exists")
        if self.toleration_seconds is not None and self.effect != "NoExecute":
            raise ValueError("tolerationSeconds applies only to effect NoExecute")
        return self


# A label key: an optional DNS-subdomain prefix and "/", then a name of <= 63 characters.
LABEL_KEY = (r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
             r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


class TopologySpec(Spec):
    """One topology domain for all the pods, through Kueue's topology-aware scheduling."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        cel("has(self.required) != has(self.preferred)",
            "scheduling.topology takes exactly one of required and preferred")]})

    required: str | None = Field(None, max_length=63, pattern=LABEL_KEY, description="Node label "
                                 "of the topology level (e.g. a rack or block label) whose one "
                                 "domain must hold every pod; the job stays Queued until one "
                                 "has room. Needs the kueue.x-k8s.io/queue-name label.")
    preferred: str | None = Field(None, max_length=63, pattern=LABEL_KEY, description="As "
                                  "required, but Kueue may spread the pods over several domains "
                                  "when no single one has room.")

    @model_validator(mode="after")
    def _one(self) -> "TopologySpec":
        if (self.required is None) == (self.preferred is None):
            raise ValueError("scheduling.topology takes exactly one of required and preferred")
        return self

    @property
    def level(self) -> str:
        return self.required or self.preferred


class SchedulingSpec(Spec):
    """Where the worker pods may run (copied into each pod's spec)."""

    node_selector: dict[str, str] = Field(default_factory=dict, description="Node labels every "
                                          "worker pod's node must have.")
    tolerations: list[TolerationSpec] = Field(default_factory=list, max_length=64,
                                              description="Taints the worker pods tolerate.")
    priority_class_name: str | None = Field(None, max_length=253, pattern=DNS_SUBDOMAIN,
                                            description="PriorityClass of "
                                            "the worker pods (preemption order; with Kueue, "
                                            "also the priority of the job's Workload).")
    topology: TopologySpec | None = Field(None, description="Topology-aware placement by Kueue "
                                          "(only for a job with the kueue.x-k8s.io/queue-name "
                                          "label).")


class MetricsSpec(Spec):
    """Rank 0's metrics: a Prometheus exporter and a JSONL file."""

    port: int = Field(9400, ge=0, le=65535, description="Rank 0's Prometheus exporter port "
                      "(0: pick a free one).")
    jsonl: str | None = Field(None, description="Per-step metrics file (default: "
                              "<outputDir>/metrics.jsonl).")


class NodesSpec(Spec):
    """Elastic range: torchrun --nnodes=min:max."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        cel("self.min <= self.max", "nodes.min must be <= nodes.max")]})

    min: int = Field(1, ge=1, le=4096, description="Fewest nodes training continues with.")
    max: int = Field(1, ge=1, le=4096, description="Most nodes training uses.")

    @model_validator(mode="after")
    def _ordered(self) -> "NodesSpec":
        if self.min > self.max:
            raise ValueError(f"nodes.min ({self.min}) must be <= nodes.max ({self.max})")
        return self


class ServiceAccountSpec(Spec):
    """The job's own trainer ServiceAccount (`<job>-trainer`, made by the operator)."""

    annotations: dict[str, str] = Field(
        default_factory=dict, max_length=32, description="Annotations of the trainer "
        "ServiceAccount, for workload identity: eks.amazonaws.com/role-arn (IRSA), "
        "iam.gke.io/gcp-service-account, azure.workload.identity/client-id. The cloud's trust "
        "policy names this namespace and ServiceAccount, so a job can only assume what was "
        "granted to it. Set at creation; change it with a new job.")


_PROCS = "(has(self.procsPerNode) ? self.procsPerNode : 1)"
_NODES_MIN = "(has(self.nodes) && has(self.nodes.min) ? self.nodes.min : 1)"
_NODES_MAX = "(has(self.nodes) && has(self.nodes.max) ? self.nodes.max : 1)"
_GROUP_MISFIT = ("training.shardGroupSize must divide the ranks at every node count from "
                 "nodes.min to nodes.max: a divisor of procsPerNode, or, with nodes.min = "
                 "nodes.max, of procsPerNode x nodes")


_PARALLELISM = "(has(self.training.parallelism) && has(self.training.parallelism.{0}) ? " \
    "self.training.parallelism.{0} : 1)"
_TENSOR, _PIPELINE = _PARALLELISM.format("tensor"), _PARALLELISM.format("pipeline")
_VIRTUAL = _PARALLELISM.format("virtualStages")
_M = "self.model"


def _job_model(field: str, spec_field: str) -> str:
    return _preset_lookup(field, spec_field, on=_M)


_M_HEADS, _M_LAYERS = _job_model("heads", "heads"), _job_model("layers", "layers")
_M_SEQ, _M_DIM = _job_model("seq_len", "seqLen"), _job_model("dim", "dim")
_M_KV = f"({_job_model('kv_heads', 'kvHeads')} == 0 ? {_M_HEADS} : {_job_model('kv_heads', 'kvHeads')})"
_M_FFN = f"({_job_model('d_ff', 'ffnDim')} == 0 ? 4 * {_M_DIM} : {_job_model('d_ff', 'ffnDim')})"
_M_TIED = _job_model("tied_embeddings", "tiedEmbeddings")


def _model_rule(rule: str, *fields: str, when: str) -> str:
    """CEL: `rule` holds whenever `when` does and the model fields it reads are known (explicit,
    or from a known preset; an unknown preset is refused by the model's own rule)."""
    return f"!({when}) || !({_known_model(*fields, on=_M)}) || ({rule})"


_TENSOR_MISFIT = ("training.parallelism.tensor must divide procsPerNode: tensor parallelism "
                  "stays inside a node")
_GROUP_MP_MISFIT = ("training.shardGroupSize counts data-parallel ranks: it must divide "
                    "procsPerNode x nodes / (tensor x pipeline) at every node count from "
                    "nodes.min to nodes.max")
_MODEL_PARALLEL_MISFIT = ("training.parallelism tensor x pipeline must divide the ranks at every "
                          "node count from nodes.min to nodes.max: a divisor of procsPerNode, "
                          "or, with nodes.min = nodes.max, of procsPerNode x nodes")


class PretrainJobSpec(Spec):
    """The `spec` of a PretrainJob (crucible.dev/v1alpha1)."""

    # Apiserver only (a transition rule needs the old object): the operator creates the trainer
    # ServiceAccount once and may not edit it (least privilege), so an edit would be ignored.
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        cel(" == ".join(f"((has({o}.serviceAccount) && has({o}.serviceAccount.annotations)) ? "
                        f"{o}.serviceAccount.annotations : {{}})" for o in ("self", "oldSelf")),
            "serviceAccount cannot change once the job exists: create a new job to use another "
            "workload identity"),
        # The same rule as _shard_group_fits below (sharding.group_fits_every_size).
        cel(f"!has(self.training.shardGroupSize) || {_PROCS} % self.training.shardGroupSize == 0 "
            f"|| ({_NODES_MIN} == {_NODES_MAX} && "
            f"({_PROCS} * {_NODES_MIN}) % self.training.shardGroupSize == 0)",
            _GROUP_MISFIT),
        # The same rules as _parallelism_fits below (layout.layout, layout.fits_every_size).
        cel(f"{_PROCS} % {_TENSOR} == 0", _TENSOR_MISFIT),
        cel(f"{_PROCS} % ({_TENSOR} * {_PIPELINE}) == 0 || ({_NODES_MIN} == {_NODES_MAX} && "
            f"({_PROCS} * {_NODES_MIN}) % ({_TENSOR} * {_PIPELINE}) == 0)", _MODEL_PARALLEL_MISFIT),
        # A shard group counts data-parallel ranks: procsPerNode x nodes / (tensor x pipeline).
        cel(f"!has(self.training.shardGroupSize) || {_TENSOR} * {_PIPELINE} == 1 || "
            f"{_PROCS} % ({_TENSOR} * {_PIPELINE} * self.training.shardGroupSize) == 0 || "
            f"({_NODES_MIN} == {_NODES_MAX} && ({_PROCS} * {_NODES_MIN}) % "
            f"({_TENSOR} * {_PIPELINE} * self.training.shardGroupSize) == 0)", _GROUP_MP_MISFIT),
        # The model's own rules (layout.model_problems, _model_fits_parallelism below).
        cel(_model_rule(f"{_M_HEADS} % {_TENSOR} == 0 && {_M_KV} % {_TENSOR} == 0 && "
                        f"{_M_SEQ} % {_TENSOR} == 0 && {_M_FFN} % {_TENSOR} == 0",
                        "heads", "kvHeads", "seqLen", "dim", "ffnDim", when=f"{_TENSOR} > 1"),
            "training.parallelism.tensor must divide the model's heads, key/value heads, seqLen "
            "and MLP width"),
        cel(_model_rule(f"{_M_LAYERS} % ({_PIPELINE} * {_VIRTUAL}) == 0 && !{_M_TIED}",
                        "layers", "tiedEmbeddings", when=f"{_PIPELINE} > 1"),
            "training.parallelism pipeline x virtualStages must divide the model's layers, and "
            "a pipeline needs an untied head (model.tiedEmbeddings: false)")]})

    image: str = Field(..., min_length=1, description="Trainer image (has torch and crucible).")
    nodes: NodesSpec = Field(default_factory=NodesSpec)
    procs_per_node: int = Field(1, ge=1, le=64, description="torchrun --nproc-per-node "
                                "(usually GPUs per node).")
    resources: dict[str, dict[str, str | int]] = Field(
        default_factory=dict, description="Pod container resources (requests/limits).",
        json_schema_extra={
            "additionalProperties": {"type": "object", "additionalProperties": {
                "anyOf": [{"type": "integer"}, {"type": "string", "pattern": QUANTITY}]}},
            "x-kubernetes-validations": [cel("self.all(k, k == 'requests' || k == 'limits')",
                                             "resources takes only requests and limits")]})
    model: ModelSpec
    data: DataSpec
    training: TrainingSpec
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    fault_tolerance: FaultToleranceSpec = Field(default_factory=FaultToleranceSpec)
    suspend: Annotated[bool, OPERATOR_ONLY] = Field(
        False, description="Delete the pods but keep the job and checkpoints.")
    scheduling: SchedulingSpec = Field(default_factory=SchedulingSpec,
                                       description="Node selector, tolerations and priority of "
                                       "the worker pods.")
    ttl_seconds_after_finished: Annotated[int | None, OPERATOR_ONLY] = Field(
        None, ge=0, description="Delete the job (and everything it owns) this long after it "
        "Succeeded or Failed; unset: keep it.")
    termination_grace_period_seconds: int = Field(60, ge=0, le=3600, description="SIGTERM to "
                                                  "SIGKILL, for pods the operator deletes (time "
                                                  "for the trainer to finish a checkpoint).")
    service_account: ServiceAccountSpec = Field(default_factory=ServiceAccountSpec,
                                                description="The trainer ServiceAccount's "
                                                "annotations (workload identity).")
    scratch_size_limit: str = Field("100Gi", pattern=SIZE_LIMIT, description="Size limit of "
                                    "each pod's writable scratch folder (HOME, TMPDIR, logs, "
                                    "compile caches), above 0; past it the kubelet evicts the pod.")
    shm_size_limit: str = Field("16Gi", pattern=SIZE_LIMIT, description="Size limit of each "
                                "pod's /dev/shm, above 0 (memory-backed: counts toward the "
                                "pod's memory), used by NCCL and DataLoader workers.")

    @model_validator(mode="after")
    def _shard_group_fits(self) -> "PretrainJobSpec":
        group = self.training.shard_group_size
        if group is not None and not sharding.group_fits_every_size(
                group, self.procs_per_node, self.nodes.min, self.nodes.max):
            raise ValueError(f"{_GROUP_MISFIT} (got {group}, procsPerNode {self.procs_per_node}, "
                             f"nodes {self.nodes.min}-{self.nodes.max})")
        return self

    @model_validator(mode="after")
    def _parallelism_fits(self) -> "PretrainJobSpec":
        par = self.training.parallelism
        if self.procs_per_node % par.tensor:
            raise ValueError(f"{_TENSOR_MISFIT} (got tensor {par.tensor}, procsPerNode "
                             f"{self.procs_per_node})")
        if not layout.fits_every_size(par.model_parallel, self.procs_per_node, self.nodes.min,
                                      self.nodes.max):
            raise ValueError(f"{_MODEL_PARALLEL_MISFIT} (got {par.tensor} x {par.pipeline}, "
                             f"procsPerNode {self.procs_per_node}, nodes "
                             f"{self.nodes.min}-{self.nodes.max})")
        group = self.training.shard_group_size
        if group is not None and par.model_parallel > 1 and not layout.fits_every_size(
                par.model_parallel * group, self.procs_per_node, self.nodes.min, self.nodes.max):
            raise ValueError(f"{_GROUP_MP_MISFIT} (got {group}, tensor x pipeline "
                             f"{par.model_parallel}, procsPerNode {self.procs_per_node}, nodes "
                             f"{self.nodes.min}-{self.nodes.max})")
        _model_fits_parallelism(self.model, self.training)
        self._pipeline_fills_at_every_size()
        return self

    def _pipeline_fills_at_every_size(self) -> None:
        """A pipeline step needs a micro-batch per stage on every data-parallel rank; the
        fewest are at the most nodes (and at the batch ramp's start). Interleaved 1F1B also
        needs its rounds to divide every count a step can have, at every node count. Pydantic
        only (the operator refuses it as InvalidSpec): CEL would need the ramp's arithmetic."""
        t = self.training
        par, seq = t.parallelism, self.model.to_arch().seq_len
        if par.pipeline == 1:
            return
        nodes = range(self.nodes.min, self.nodes.max + 1) \
            if par.schedule == "interleaved1F1B" else [self.nodes.max]
        for count in reversed(nodes):
            dp = self.procs_per_node * count // par.model_parallel
            unit = seq * t.micro_batch * dp
            if dp == 0 or (self.procs_per_node * count) % par.model_parallel \
                    or t.global_batch_tokens % unit:
                continue  # the layout's rules and the trainer's batch check name these
            ramp = batch_ramp.BatchRamp.of(t.global_batch_tokens, unit,
                                           *((t.batch_ramp.start_tokens, t.batch_ramp.ramp_tokens)
                                             if t.batch_ramp is not None else ()))
            for m in layout.counts_to_check(par.schedule, ramp.counts()):
                problem = layout.schedule_problem(par.schedule, par.pipeline, m)
                if problem is None:
                    continue
                fix = (f"raise globalBatchTokens{' or batchRamp.startTokens' if t.batch_ramp else ''}"
                       ", or lower microBatch" if m < par.pipeline else
                       "use schedule 1F1B, or a globalBatchTokens and microBatch "
                       f"{'(and a batch ramp) ' if t.batch_ramp else ''}whose steps' "
                       "micro-batch counts the rounds divide (multiples of pipeline do)")
                raise ValueError(f"training.parallelism: at {count} node(s), {problem}"
                                 f"{' (a step of the batch ramp)' if m < ramp.full_units else ''}: "
                                 f"{fix}")

    @field_validator("resources")
    @classmethod
    def _resources(cls, value: dict) -> dict:
        unknown = sorted(set(value) - {"requests", "limits"})
        if unknown:
            raise ValueError(f"resources takes only requests and limits, not {unknown}")
        for kind, amounts in value.items():
            for name, amount in amounts.items():
                if isinstance(amount, str) and not re.fullmatch(QUANTITY, amount):
                    raise ValueError(f"resources.{kind}.{name}: {amount!r} is not a quantity")
        return value


def _model_fits_parallelism(model: ModelSpec, training: TrainingSpec) -> None:
    """Raise what in the model forbids training.parallelism (whole heads per tensor rank,
    whole layers per pipeline stage)."""
    par = training.parallelism
    if par.model_parallel == 1:
        return
    cfg = model.to_arch()
    problems = layout.model_problems(par.tensor, par.pipeline, virtual_stages=par.virtual_stages,
                                     layers=cfg.layers, heads=cfg.heads, kv_heads=cfg.n_kv_heads,
                                     seq_len=cfg.seq_len, ffn_dim=cfg.ffn_dim,
                                     tied_embeddings=cfg.tied_embeddings)
    if problems:
        raise ValueError("; ".join(problems))


class TrainerFaultToleranceSpec(Spec):
    """The part of faultTolerance the trainer itself acts on (the rest is the operator's)."""

    spike_guard: SpikeGuardSpec = Field(default_factory=SpikeGuardSpec,
                                        description="Loss-spike and divergence detection.")
    stragglers: TrainerStragglerSpec = Field(default_factory=TrainerStragglerSpec,
                                             description="Straggler detection.")


class TrainJobConfig(Spec):
    """What `crucible train --config` reads; `from_job` makes it from a PretrainJob's spec (the
    operator writes that into the job's ConfigMap)."""

    name: str = Field("local", min_length=1, max_length=MAX_JOB_NAME_LENGTH,
                      pattern=JOB_NAME_PATTERN, description="Job name: metric label and Lease "
                      "name (the PretrainJob's name rule).")
    output_dir: str = Field("runs/local", description="Local folder for logs, metrics and plots.")
    model: ModelSpec
    data: DataSpec
    training: TrainingSpec
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    fault_tolerance: TrainerFaultToleranceSpec = Field(default_factory=TrainerFaultToleranceSpec)
    metrics: MetricsSpec = Field(default_factory=MetricsSpec)

    @model_validator(mode="after")
    def _parallelism_fits_model(self) -> "TrainJobConfig":
        _model_fits_parallelism(self.model, self.training)
        return self

    @classmethod
    def from_job(cls, spec: PretrainJobSpec, name: str) -> "TrainJobConfig":
        """The one projection of a PretrainJob onto the trainer's config. Every field it reads
        reaches the pods (`pod_facing`); the sub-models are reused, not parsed again."""
        return cls(name=name, output_dir=launch.output_dir(name), model=spec.model,
                   data=spec.data, training=spec.training, checkpoint=spec.checkpoint,
                   fault_tolerance=TrainerFaultToleranceSpec(
                       spike_guard=spec.fault_tolerance.spike_guard,
                       stragglers=TrainerStragglerSpec.model_validate(
                           spec.fault_tolerance.stragglers.model_dump(
                               include=set(TrainerStragglerSpec.model_fields)))),
                   metrics=MetricsSpec(port=launch.METRICS_PORT))


class ConfigError(ValueError):
    """A config the user must fix; the message names each bad field."""


def explain(err: ValidationError) -> str:
    """One line per problem: `field.path: what is wrong (got value)`."""
    lines = []
    for problem in err.errors():
        where = ".".join(str(part) for part in problem["loc"]) or "(top level)"
        msg = problem["msg"].removeprefix("Value error, ")
        if problem["type"] == "extra_forbidden":
            msg = "unknown field (check the spelling; fields are camelCase)"
        got = problem.get("input")
        shown = "" if problem["type"] in ("missing", "extra_forbidden") or isinstance(got, dict) \
            else f" (got {got!r})"
        lines.append(f"{where}: {msg}{shown}")
    return "\n".join(lines)


def load_train_config(path: str | Path) -> TrainJobConfig:
    """Read a job config, or a whole PretrainJob manifest (projected by `from_job`)."""
    path = Path(path)
    try:
        doc = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path} is not valid YAML: {err}") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{path} must hold a mapping of fields, not {type(doc).__name__}")
    try:
        if doc.get("kind") == KIND:
            name = (doc.get("metadata") or {}).get("name") or "local"
            return TrainJobConfig.from_job(PretrainJobSpec.model_validate(doc.get("spec") or {}),
                                           name)
        return TrainJobConfig.model_validate(doc)
    except ValidationError as err:
        raise ConfigError(f"{path} has {err.error_count()} problem(s):\n{explain(err)}") from None
