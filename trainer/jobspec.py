"""The PretrainJob spec and the trainer's job config: one set of pydantic models for both planes.

This module is the single source of truth for
- the `PretrainJob` custom resource's `spec` (the operator generates the CRD's OpenAPI schema,
  descriptions included, from `PretrainJobSpec`), and
- `crucible train --config job.yaml` (`TrainJobConfig`: the model/data/training/checkpoint parts
  of the spec plus the job's name and where to put metrics), which is what the operator mounts.

Field names are camelCase, as in every Kubernetes resource; unknown fields are rejected so a typo
never silently falls back to a default. Torch-free: the operator imports it.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel

from crucible.trainer import arch


class Spec(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid",
                              frozen=True)


_ARCH_TO_SPEC = {"n_layer": "layers", "n_head": "heads", "d_model": "dim", "seq_len": "seqLen",
                 "vocab_size": "vocabSize"}


class ModelSpec(Spec):
    """The GPT to train: a preset, optionally with some fields overridden, or explicit sizes."""

    preset: str | None = Field(None, description=f"One of {sorted(arch.PRESETS)}; explicit "
                               "fields below override the preset's values.")
    layers: int | None = Field(None, ge=1, le=256, description="Transformer blocks.")
    heads: int | None = Field(None, ge=1, le=256, description="Attention heads per block.")
    dim: int | None = Field(None, ge=8, le=65536, description="Model width d_model.")
    seq_len: int | None = Field(None, ge=8, le=1 << 20, description="Context length in tokens.")
    vocab_size: int | None = Field(None, ge=2, le=1 << 22, description="Embedding rows; must be "
                                   ">= the tokenizer's vocabulary (pad to a multiple of 64).")
    tied_embeddings: bool | None = Field(None, description="Share input embedding and output layer.")
    qk_norm: bool | None = Field(None, description="LayerNorm on queries and keys (stability).")

    @model_validator(mode="after")
    def _complete(self) -> "ModelSpec":
        if self.preset is None and None in (self.layers, self.heads, self.dim, self.seq_len,
                                            self.vocab_size):
            raise ValueError("give model.preset, or all of model.layers, heads, dim, seqLen and "
                             "vocabSize")
        try:
            self.to_arch()  # surfaces divisibility errors now, in the spec's own field names
        except ValueError as err:
            message = str(err)
            for arch_name, spec_name in _ARCH_TO_SPEC.items():
                message = message.replace(arch_name, f"model.{spec_name}")
            raise ValueError(message) from None
        return self

    def to_arch(self) -> arch.GPTConfig:
        overrides = {k: v for k, v in {
            "n_layer": self.layers, "n_head": self.heads, "d_model": self.dim,
            "seq_len": self.seq_len, "vocab_size": self.vocab_size,
            "tied_embeddings": self.tied_embeddings, "qk_norm": self.qk_norm}.items()
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


class TrainingSpec(Spec):
    """Optimisation settings. Defaults follow GPT-3 small / nanoGPT's GPT-2 reproduction."""

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
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1, description="0.95 as GPT-3 and LLaMA (not 0.999).")
    eps: float = Field(1e-8, gt=0)
    grad_clip: float = Field(1.0, ge=0, description="Global gradient-norm clip; 0 disables.")
    precision: Literal["bf16", "fp32"] = Field("bf16", description="Parameter/compute dtype for "
                                               "matmuls; gradients are reduced in fp32.")
    seed: int = Field(1337, ge=0)
    eval_every: int = Field(0, ge=0, description="Steps between held-out evals (0: at the end).")
    eval_tokens: int = Field(1 << 20, ge=1, description="Held-out tokens per eval.")
    log_every: int = Field(1, ge=1, description="Steps between log lines.")
    compile: bool = Field(False, description="torch.compile each block (GPU).")
    activation_checkpointing: bool = Field(False, description="Recompute each block in backward.")

    @property
    def total_steps_hint(self) -> int:
        return max(1, math.ceil(self.tokens / self.global_batch_tokens))


class CheckpointSpec(Spec):
    """Sharded checkpoints (DCP) under `uri`, committed by a manifest written last."""

    uri: str | None = Field(None, description="s3://bucket/prefix or a local folder; none: no "
                            "checkpoints (not recommended).")
    every_minutes: float = Field(10.0, ge=0, description="Wall-clock interval between saves "
                                 "(see `crucible plan` for the Young/Daly optimum).")
    every_steps: int = Field(0, ge=0, description="Step interval between saves (0: time only).")
    keep: int = Field(3, ge=2, description="Newest checkpoints kept; at least 2, because the "
                      "newest may still be uploading (torchtitan refuses 1 for the same reason).")
    keep_every: int = Field(0, ge=0, description="Also keep every step multiple of this forever "
                            "(spike rollbacks need older checkpoints); 0: off.")
    async_: bool = Field(True, alias="async", description="Stage in memory, upload in the "
                         "background: training blocks only for the copy.")
    credentials_secret: str | None = Field(None, description="Secret with AWS_ACCESS_KEY_ID, "
                                           "AWS_SECRET_ACCESS_KEY (and optionally AWS_ENDPOINT_URL).")


class SpikeGuardSpec(Spec):
    enabled: bool = Field(True, description="Detect loss spikes and divergence and act on them.")


class FaultToleranceSpec(Spec):
    max_restarts: int = Field(20, ge=0, description="Application failures tolerated before the "
                              "job fails; infrastructure failures do not count.")
    cordon_failed_nodes: bool = Field(True, description="Cordon and annotate nodes that failed.")
    hang_timeout_seconds: int = Field(600, ge=30, description="Restart when the progress Lease "
                                      "has not advanced for this long.")
    spike_guard: SpikeGuardSpec = Field(default_factory=SpikeGuardSpec)


class MetricsSpec(Spec):
    port: int = Field(9400, ge=0, le=65535, description="Rank 0's Prometheus exporter port "
                      "(0: pick a free one).")
    jsonl: str | None = Field(None, description="Per-step metrics file (default: "
                              "<outputDir>/metrics.jsonl).")


class TrainJobConfig(Spec):
    """What `crucible train --config` reads (the operator writes it into a ConfigMap)."""

    name: str = Field("local", min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
                      description="Job name: metric label and Lease name.")
    output_dir: str = Field("runs/local", description="Local folder for logs, metrics and plots.")
    model: ModelSpec
    data: DataSpec
    training: TrainingSpec
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    fault_tolerance: FaultToleranceSpec = Field(default_factory=FaultToleranceSpec)
    metrics: MetricsSpec = Field(default_factory=MetricsSpec)


class NodesSpec(Spec):
    """Elastic range: torchrun --nnodes=min:max."""

    min: int = Field(1, ge=1, le=4096, description="Fewest nodes training continues with.")
    max: int = Field(1, ge=1, le=4096, description="Most nodes training uses.")

    @model_validator(mode="after")
    def _ordered(self) -> "NodesSpec":
        if self.min > self.max:
            raise ValueError(f"nodes.min ({self.min}) must be <= nodes.max ({self.max})")
        return self


class PretrainJobSpec(Spec):
    """The `spec` of a PretrainJob (crucible.dev/v1alpha1)."""

    image: str = Field(..., min_length=1, description="Trainer image (has torch and crucible).")
    nodes: NodesSpec = Field(default_factory=NodesSpec)
    procs_per_node: int = Field(1, ge=1, le=64, description="torchrun --nproc-per-node "
                                "(usually GPUs per node).")
    resources: dict[str, dict[str, str | int]] = Field(default_factory=dict, description="Pod "
                                                       "container resources (requests/limits).")
    model: ModelSpec
    data: DataSpec
    training: TrainingSpec
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    fault_tolerance: FaultToleranceSpec = Field(default_factory=FaultToleranceSpec)
    suspend: bool = Field(False, description="Delete the pods but keep the job and checkpoints.")


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
    """Read a job config, or a whole PretrainJob manifest (its spec), and validate it."""
    path = Path(path)
    try:
        doc = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path} is not valid YAML: {err}") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{path} must hold a mapping of fields, not {type(doc).__name__}")
    if doc.get("kind") == "PretrainJob":
        spec = doc.get("spec") or {}
        name = (doc.get("metadata") or {}).get("name", "local")
        doc = {key: spec[key] for key in ("model", "data", "training", "checkpoint",
                                          "faultTolerance") if key in spec}
        doc["name"] = name
    try:
        return TrainJobConfig.model_validate(doc)
    except ValidationError as err:
        raise ConfigError(f"{path} has {err.error_count()} problem(s):\n{explain(err)}") from None
