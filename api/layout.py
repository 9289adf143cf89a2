"""The model-parallel layout: how a job's ranks split into (dp_replicate, dp_shard, pp, tp).

Owns the arithmetic of `training.parallelism` against the job's shape and model, as plain
numbers: which sizes fit (the spec checks them at apply time, for every node count an elastic
job may run at), and which rank holds which coordinate (the trainer builds its device mesh from
it). Torch-free, like `sharding`, whose data-parallel decision it wraps.

The mesh is torchtitan's (`distributed/parallel_dims.py`): dimensions in the order
(pp, dp_replicate, dp_shard, tp), row-major over the global ranks. The tensor-parallel ranks
are consecutive, and torchrun puts consecutive ranks on one node: tensor parallelism's per-layer
all-reduces stay on NVLink (Narayanan et al. 2021, takeaway #1). The pipeline is outermost, so
its stages are the furthest apart, across nodes, where only one activation per micro-batch
travels.
"""

from __future__ import annotations

from dataclasses import dataclass

from crucible.api import sharding


class LayoutError(ValueError):
    """The parallelism asked for does not fit the job's ranks or its model."""


@dataclass(frozen=True)
class Layout:
    """A world of `pp * dp.dp_size * tp` ranks: `pp` pipeline stages, each held by `dp`
    data-parallel (FSDP/HSDP) groups of `tp` tensor-parallel ranks."""

    dp: sharding.MeshShape
    pp: int = 1
    tp: int = 1

    @property
    def world_size(self) -> int:
        return self.dp.dp_size * self.pp * self.tp

    @property
    def dims(self) -> tuple[tuple[str, int], ...]:
        """The device mesh's named dimensions, outermost first; a dimension of size 1 is left
        out except dp_shard (FSDP always shards over it, if only over one rank)."""
        out = [("pp", self.pp)] if self.pp > 1 else []
        if self.dp.hybrid:
            out.append(("dp_replicate", self.dp.replicate))
        out.append(("dp_shard", self.dp.shard))
        if self.tp > 1:
            out.append(("tp", self.tp))
        return tuple(out)

    def coordinates(self, rank: int) -> dict[str, int]:
        """Rank `rank`'s coordinate along each dimension of `dims` (row-major)."""
        out = {}
        for name, size in reversed(self.dims):
            out[name] = rank % size
            rank //= size
        return out

    def describe(self) -> str:
        parts = [self.dp.describe()]
        if self.pp > 1:
            parts.append(f"{self.pp} pipeline stages")
        if self.tp > 1:
            parts.append(f"tensor parallel over {self.tp}")
        return " x ".join(parts)


def fits_every_size(model_parallel: int, procs_per_node: int, min_nodes: int,
                    max_nodes: int) -> bool:
    """Whether groups of `model_parallel` (tensor x pipeline) ranks divide the world at every
    node count from `min_nodes` to `max_nodes`: the shard group's rule, for the same reason."""
    return sharding.group_fits_every_size(model_parallel, procs_per_node, min_nodes, max_nodes)


def model_problems(tensor: int, pipeline: int, *, layers: int, heads: int, kv_heads: int,
                   seq_len: int, ffn_dim: int, tied_embeddings: bool = False,
                   virtual_stages: int = 1) -> list[str]:
    """What in the model forbids this parallelism, one sentence each (empty: it fits). Pure.

    Tensor parallelism gives each rank whole attention heads, and whole key/value heads (so a
    query head's key/value head is on its own rank), whole MLP units (a SwiGLU unit's gate and up
    rows together), and an equal slice of the sequence between the blocks (sequence
    parallelism: DTensor's slices are equal); a pipeline gives each of its stages the
    same number of whole layers. A tied head is the
    embedding itself, which a pipeline holds on its first stage and the head on its last."""
    out = []
    if heads % tensor:
        out.append(f"parallelism.tensor {tensor} must divide the model's {heads} heads")
    if kv_heads % tensor:
        out.append(f"parallelism.tensor {tensor} must divide the model's {kv_heads} key/value "
                   "heads")
    if seq_len % tensor:
        out.append(f"parallelism.tensor {tensor} must divide the model's seqLen {seq_len}")
    if ffn_dim % tensor:
        out.append(f"parallelism.tensor {tensor} must divide the model's MLP width {ffn_dim}")
    if layers % (pipeline * virtual_stages):
        stages = f"{pipeline} x virtualStages {virtual_stages}" if virtual_stages > 1 else pipeline
        out.append(f"parallelism.pipeline {stages} stages must divide the model's {layers} "
                   "layers")
    if pipeline > 1 and tied_embeddings:
        out.append("parallelism.pipeline needs an untied head (model.tiedEmbeddings: false): the "
                   "first stage holds the embedding and the last the head")
    return out


def schedule_problem(schedule: str, pipeline: int, micro_batches: int) -> str | None:
    """Why a pipeline schedule cannot run a step of `micro_batches` micro-batches per
    data-parallel rank (None: it can). Pure.

    Every stage needs one. Interleaved 1F1B runs them in rounds of about `pipeline` (torch's
    `ScheduleInterleaved1F1B`: max(1, m // pipeline) rounds, which must divide m)."""
    if micro_batches < pipeline:
        return (f"a step of {micro_batches} micro-batch(es) per data-parallel rank cannot fill "
                f"{pipeline} pipeline ranks")
    rounds = max(1, micro_batches // pipeline)
    if schedule == "interleaved1F1B" and micro_batches % rounds:
        return (f"interleaved1F1B runs a step's micro-batches in rounds of equal size; "
                f"{micro_batches} micro-batches on {pipeline} pipeline ranks make {rounds} "
                f"rounds, which do not divide them")
    return None


def counts_to_check(schedule: str, counts: range) -> range:
    """Which of a run's micro-batch counts (ascending) `schedule_problem` must see: the
    smallest for 1F1B and GPipe (it only asks for one per rank), all for interleaved 1F1B. A
    caller stops at the first problem: past 2 x pipeline only multiples of pipeline make whole
    rounds, so a long range is refused within a few counts, never walked to its end."""
    return counts if schedule == "interleaved1F1B" else counts[:1]


def layout(sharding_mode: sharding.Sharding, shard_group_size: int | None, *, world_size: int,
           local_world_size: int, tensor: int = 1, pipeline: int = 1) -> Layout:
    """The layout of `world_size` ranks (`local_world_size` per node). Pure.

    Tensor and pipeline ranks are taken first; the data-parallel mesh (FSDP or HSDP,
    `sharding.mesh_shape`) is made of the rest. HSDP's shard groups count data-parallel ranks,
    so its default group is one node's share of them."""
    model_parallel = tensor * pipeline
    if world_size % model_parallel:
        raise LayoutError(f"training.parallelism tensor x pipeline = {model_parallel} does not "
                          f"divide the {world_size} ranks")
    if local_world_size % tensor:
        raise LayoutError(f"training.parallelism.tensor {tensor} must divide the "
                          f"{local_world_size} processes per node (tensor parallelism stays "
                          "inside a node)")
    # A node's data-parallel ranks of one stage: its share of the ranks, unless the node holds
    # more than one stage (the pipeline is outermost), when a stage is all on it.
    local_dp = max(1, min(local_world_size // tensor, world_size // model_parallel))
    dp_world = world_size // model_parallel
    if sharding_mode == "auto" and shard_group_size is None and dp_world % local_dp:
        # A pipeline stage that ends inside a node (3 nodes of 8, 2 stages: 12 ranks each)
        # leaves no whole-node group to replicate over; auto then shards over the stage.
        return Layout(sharding.fsdp(dp_world), pipeline, tensor)
    dp = sharding.mesh_shape(sharding_mode, shard_group_size, world_size=dp_world,
                             local_world_size=local_dp)
    return Layout(dp, pipeline, tensor)
