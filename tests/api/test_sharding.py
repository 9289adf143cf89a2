"""The sharding decision (pure) and the spec rules that keep a shard group fitting the job."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from crucible.api.sharding import MeshShape, ShardingError, group_fits_every_size, mesh_shape
from crucible.api.spec import PretrainJobSpec, TrainingSpec


def shape(sharding, group=None, *, world, local):
    return mesh_shape(sharding, group, world_size=world, local_world_size=local)


@pytest.mark.parametrize("sharding, group, world, local, expected", [
    # auto: one node shards over all of it; several nodes get one shard group per node.
    ("auto", None, 8, 8, MeshShape(1, 8, hybrid=False)),
    ("auto", None, 16, 8, MeshShape(2, 8, hybrid=True)),
    ("auto", None, 64, 8, MeshShape(8, 8, hybrid=True)),
    # auto with one process per node: a one-rank group would hold the whole state per GPU.
    ("auto", None, 4, 1, MeshShape(1, 4, hybrid=False)),
    # auto with an explicit group: HSDP once the job spans nodes, whatever the group's size.
    ("auto", 4, 16, 8, MeshShape(4, 4, hybrid=True)),
    ("auto", 16, 32, 8, MeshShape(2, 16, hybrid=True)),
    ("auto", 1, 4, 1, MeshShape(4, 1, hybrid=True)),
    ("auto", 4, 8, 8, MeshShape(1, 8, hybrid=False)),   # one node: FSDP all the same
    ("auto", 16, 16, 8, MeshShape(1, 16, hybrid=False)),  # one group of everyone is FSDP
    # fsdp: every rank, always.
    ("fsdp", None, 16, 8, MeshShape(1, 16, hybrid=False)),
    # hsdp: as asked, even on one node (the CPU tests' 2 x 2 on 4 local processes).
    ("hsdp", None, 16, 8, MeshShape(2, 8, hybrid=True)),
    ("hsdp", 2, 4, 4, MeshShape(2, 2, hybrid=True)),
    ("hsdp", None, 8, 8, MeshShape(1, 8, hybrid=True)),
])
def test_mesh_shape(sharding, group, world, local, expected):
    got = shape(sharding, group, world=world, local=local)
    assert got == expected
    assert got.dp_size == world  # pure data parallelism: every rank reads its own slice


def test_a_group_that_does_not_divide_the_world_is_refused_naming_both():
    with pytest.raises(ShardingError, match="shardGroupSize 3 does not divide the 8 ranks"):
        shape("hsdp", 3, world=8, local=4)
    with pytest.raises(ShardingError, match="does not divide"):
        shape("auto", 3, world=8, local=4)


def test_mesh_dims_and_description():
    assert MeshShape(2, 4, hybrid=True).dims == (2, 4)
    assert MeshShape(1, 8, hybrid=False).dims == (8,)
    assert MeshShape(2, 4, hybrid=True).describe() == \
        "HSDP: 2 replica(s) x shard groups of 4 rank(s)"


@pytest.mark.parametrize("group, procs, nodes, fits", [
    (4, 8, (1, 4), True),    # a divisor of a node's processes fits every node count
    (8, 8, (1, 4), True),
    (16, 8, (2, 2), True),   # two nodes per group: only at a fixed node count
    (16, 8, (2, 3), False),  # 24 ranks at 3 nodes
    (16, 8, (3, 3), False),
    (3, 8, (1, 1), False),
])
def test_group_fits_every_size_matches_trying_every_node_count(group, procs, nodes, fits):
    assert group_fits_every_size(group, procs, *nodes) is fits
    assert fits == all(procs * n % group == 0 for n in range(nodes[0], nodes[1] + 1))


def _job(**training):
    return {"image": "x", "model": {"preset": "tiny"}, "data": {"train": "d"},
            "training": {"tokens": 1e6, **training}}


def test_the_spec_defaults_to_auto_and_takes_a_group_size():
    assert TrainingSpec(tokens=1).sharding == "auto"
    spec = PretrainJobSpec.model_validate({**_job(sharding="hsdp", shardGroupSize=4),
                                           "procsPerNode": 8, "nodes": {"min": 1, "max": 4}})
    assert spec.training.shard_group_size == 4


def test_the_spec_refuses_a_group_size_with_fsdp():
    with pytest.raises(ValidationError, match="shardGroupSize applies to sharding hsdp or auto"):
        TrainingSpec(tokens=1, sharding="fsdp", shard_group_size=2)


def test_the_spec_refuses_a_group_that_misfits_a_node_count():
    with pytest.raises(ValidationError, match="got 16, procsPerNode 8, nodes 2-3"):
        PretrainJobSpec.model_validate({**_job(shardGroupSize=16), "procsPerNode": 8,
                                        "nodes": {"min": 2, "max": 3}})
