"""How the data-parallel ranks share the model: FSDP over every rank, or HSDP (hybrid sharding).

Owns one decision, `mesh_shape`: from the job's `training.sharding` and `shardGroupSize` and the
shape torchrun gives it (world size, processes per node), the data-parallel device mesh as plain
numbers. It must not import torch: the spec checks `shardGroupSize` against every node count an
elastic job may run at with it (so the operator can, at apply time), and `trainer/parallel.py`
builds the device mesh from what it returns.

FSDP (ZeRO-3) shards parameters, gradients and optimizer state over every rank, so each layer's
parameters are all-gathered from every rank in forward and backward: across nodes once the job
spans more than one. HSDP ("hybrid sharding", Zhao et al. 2023, "PyTorch FSDP", VLDB, §3.2.2)
shards within a group of ranks and replicates across the groups: the all-gathers and the
reduce-scatter stay inside a group (one node: NVLink), and only one all-reduce of each group's
gradient shard per step crosses the network, at the cost of holding the model state once per
group instead of once per job. The mesh is torchtitan's (`distributed/parallel_dims.py`):
(dp_replicate, dp_shard), shard groups made of consecutive ranks, which torchrun puts on one node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Sharding = Literal["auto", "fsdp", "hsdp"]


class ShardingError(ValueError):
    """The shard group does not fit the job's shape."""


@dataclass(frozen=True)
class MeshShape:
    """The data-parallel mesh: `replicate` shard groups of `shard` ranks each, row-major (rank
    r is in group r // shard). `hybrid`: a 2-D mesh (HSDP); otherwise 1-D over every rank."""

    replicate: int
    shard: int
    hybrid: bool

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: each reads its own slice of the global batch."""
        return self.replicate * self.shard

    @property
    def dims(self) -> tuple[int, ...]:
        return (self.replicate, self.shard) if self.hybrid else (self.shard,)

    def describe(self) -> str:
        if not self.hybrid:
            return f"FSDP over {self.shard} rank(s)"
        return (f"HSDP: {self.replicate} replica(s) x shard groups of {self.shard} rank(s)")


def fsdp(world_size: int) -> MeshShape:
    return MeshShape(1, world_size, hybrid=False)


def mesh_shape(sharding: Sharding, shard_group_size: int | None, *, world_size: int,
               local_world_size: int) -> MeshShape:
    """The data-parallel mesh for `sharding` on `world_size` ranks, `local_world_size` per node
    (torchrun's LOCAL_WORLD_SIZE). Pure.

    1. `fsdp`: one shard group of every rank.
    2. `hsdp`: shard groups of `shard_group_size` ranks (default: one node's), which must divide
       the world size.
    3. `auto`: HSDP with that group when the job spans more than one node, FSDP otherwise (on
       one node FSDP's all-gathers never leave it, and it holds the state once, not per group).
       Without an explicit size, a node of one process gives FSDP too: a one-rank shard group
       holds the whole model state on every GPU (DDP's memory), which auto never picks unasked.
    """
    if sharding == "fsdp":
        return fsdp(world_size)
    group = shard_group_size or local_world_size
    if world_size % group:
        raise ShardingError(f"training.shardGroupSize {group} does not divide the {world_size} "
                            f"ranks ({local_world_size} per node): choose a divisor of the "
                            "processes per node, or a whole number of nodes")
    if sharding == "hsdp":
        return MeshShape(world_size // group, group, hybrid=True)
    spans_nodes = world_size > local_world_size
    if spans_nodes and group < world_size and (shard_group_size is not None or group > 1):
        return MeshShape(world_size // group, group, hybrid=True)
    return fsdp(world_size)


def group_fits_every_size(shard_group_size: int, procs_per_node: int, min_nodes: int,
                          max_nodes: int) -> bool:
    """Whether a shard group of `shard_group_size` ranks divides the world size at every node
    count from `min_nodes` to `max_nodes` (an elastic job may run at any of them). For two or
    more consecutive counts n, n+1 that holds exactly when it divides `procs_per_node` (it then
    divides their difference); for one count, when it divides that world size. Pure; the spec's
    CEL rule says the same."""
    if procs_per_node % shard_group_size == 0:
        return True
    return min_nodes == max_nodes and (procs_per_node * min_nodes) % shard_group_size == 0
