"""The model-parallel layout (crucible.api.layout) and the spec's parallelism rules."""

from __future__ import annotations

import time

import pytest
from pydantic import ValidationError

from crucible.api.layout import LayoutError, layout, model_problems
from crucible.api.spec import ParallelismSpec, PretrainJobSpec, TrainJobConfig


def test_the_mesh_is_torchtitans_order_with_tensor_ranks_consecutive():
    lay = layout("fsdp", None, world_size=16, local_world_size=8, tensor=2, pipeline=2)
    assert lay.dims == (("pp", 2), ("dp_shard", 4), ("tp", 2))
    assert lay.world_size == 16
    # Consecutive ranks are one tensor-parallel group; a pipeline stage is half the world.
    assert [lay.coordinates(r)["tp"] for r in range(4)] == [0, 1, 0, 1]
    assert [lay.coordinates(r)["pp"] for r in (0, 7, 8, 15)] == [0, 0, 1, 1]
    assert lay.coordinates(5) == {"pp": 0, "dp_shard": 2, "tp": 1}


def test_without_model_parallelism_the_mesh_is_the_data_parallel_one():
    assert layout("fsdp", None, world_size=8, local_world_size=8).dims == (("dp_shard", 8),)
    hybrid = layout("hsdp", 4, world_size=8, local_world_size=4)
    assert hybrid.dims == (("dp_replicate", 2), ("dp_shard", 4))


def test_auto_sharding_counts_a_nodes_data_parallel_ranks_not_its_processes():
    # 2 nodes of 8, tensor 2: each node holds 4 data-parallel ranks, so auto's HSDP groups are 4.
    lay = layout("auto", None, world_size=16, local_world_size=8, tensor=2)
    assert lay.dims == (("dp_replicate", 2), ("dp_shard", 4), ("tp", 2))
    # One node holding both pipeline stages: a stage's data-parallel ranks are all on it.
    one_node = layout("auto", None, world_size=4, local_world_size=4, pipeline=2)
    assert one_node.dims == (("pp", 2), ("dp_shard", 2))
    # 3 nodes of 8, 2 stages: a stage's 12 ranks end inside a node, so no whole-node group
    # divides them; auto shards over the stage instead of refusing a field nobody set.
    straddling = layout("auto", None, world_size=24, local_world_size=8, pipeline=2)
    assert straddling.dims == (("pp", 2), ("dp_shard", 12))


def test_layouts_that_do_not_fit_are_refused_with_the_field_named():
    with pytest.raises(LayoutError, match="tensor x pipeline = 6 does not divide the 8 ranks"):
        layout("fsdp", None, world_size=8, local_world_size=8, tensor=2, pipeline=3)
    with pytest.raises(LayoutError, match="tensor 4 must divide the 2 processes per node"):
        layout("fsdp", None, world_size=8, local_world_size=2, tensor=4)


def test_model_problems_name_heads_layers_and_a_tied_head():
    assert model_problems(2, 2, layers=4, heads=8, kv_heads=2, seq_len=128, ffn_dim=344) == []
    problems = model_problems(4, 3, layers=4, heads=6, kv_heads=2, seq_len=126, ffn_dim=342,
                              tied_embeddings=True)
    assert len(problems) == 6
    assert "6 heads" in problems[0] and "2 key/value heads" in problems[1]
    assert "seqLen 126" in problems[2] and "MLP width 342" in problems[3]
    assert "pipeline 3 stages must divide the model's 4 layers" in problems[4]
    assert "untied head" in problems[5]


def _job(parallelism: dict, procs: int = 4, nodes: dict | None = None, model: dict | None = None):
    return {"image": "x", "model": model or {"preset": "llama-tiny"}, "data": {"train": "d"},
            "procsPerNode": procs, "nodes": nodes or {"min": 1, "max": 1},
            "training": {"tokens": 1e6, "parallelism": parallelism}}


def test_the_spec_takes_a_fitting_layout_and_refuses_each_misfit():
    spec = PretrainJobSpec.model_validate(_job({"tensor": 2, "pipeline": 2}))
    assert spec.training.parallelism.model_parallel == 4
    with pytest.raises(ValidationError, match="tensor must divide procsPerNode"):
        PretrainJobSpec.model_validate(_job({"tensor": 3}, procs=4))
    # An elastic range: 8 stages fit 2 nodes of 4 ranks but not 1.
    with pytest.raises(ValidationError, match="must divide the ranks at every node count"):
        PretrainJobSpec.model_validate(_job({"pipeline": 8}, procs=4, nodes={"min": 1, "max": 2}))
    with pytest.raises(ValidationError, match="must divide the model's 4 heads"):
        PretrainJobSpec.model_validate(_job({"tensor": 8}, procs=8))
    with pytest.raises(ValidationError, match="untied head"):
        PretrainJobSpec.model_validate(_job({"pipeline": 2}, model={"preset": "tiny"}))
    with pytest.raises(ValidationError, match="seqLen 127"):
        PretrainJobSpec.model_validate(_job({"tensor": 2}, model={"preset": "llama-tiny",
                                                                 "seqLen": 127}))
    with pytest.raises(ValidationError, match="MLP width 343"):
        PretrainJobSpec.model_validate(_job({"tensor": 2}, model={"preset": "llama-tiny",
                                                                 "ffnDim": 343}))
    # A shard group of data-parallel ranks: 8 processes, tensor 4 leave 2 a node, not 8.
    with pytest.raises(ValidationError, match="shardGroupSize counts data-parallel ranks"):
        PretrainJobSpec.model_validate({**_job({"tensor": 4}, procs=8, nodes={"min": 1, "max": 4}),
                                        "training": {"tokens": 1e6, "sharding": "hsdp",
                                                     "shardGroupSize": 8,
                                                     "parallelism": {"tensor": 4}}})


def test_the_trainers_own_config_checks_the_model_too():
    with pytest.raises(ValidationError, match="4 stages must divide the model's 2 layers"):
        TrainJobConfig.model_validate({"model": {"preset": "llama-tiny"}, "data": {"train": "d"},
                                       "training": {"tokens": 1e6,
                                                    "parallelism": {"pipeline": 4}}})


def test_the_schedule_is_one_torch_runs():
    assert ParallelismSpec().schedule == "1F1B"
    with pytest.raises(ValidationError, match="1F1B"):
        ParallelismSpec(schedule="zeroBubble")


def test_virtual_stages_go_with_the_interleaved_schedule_only():
    spec = ParallelismSpec(pipeline=2, schedule="interleaved1F1B", virtualStages=2)
    assert spec.stages == 4 and spec.model_parallel == 2
    with pytest.raises(ValidationError, match="virtualStages is at least 2 with schedule "
                                              "interleaved1F1B"):
        ParallelismSpec(pipeline=2, schedule="interleaved1F1B")
    with pytest.raises(ValidationError, match="1 .or unset. with 1F1B or GPipe"):
        ParallelismSpec(pipeline=2, virtualStages=2)
    with pytest.raises(ValidationError, match="needs pipeline of at least 2"):
        ParallelismSpec(schedule="interleaved1F1B", virtualStages=2)
    # Every stage is an equal share of the layers: llama-tiny's 2 layers make 2 stages, not 4.
    with pytest.raises(ValidationError, match="pipeline 2 x virtualStages 2 stages must divide "
                                              "the model's 2 layers"):
        TrainJobConfig.model_validate({
            "model": {"preset": "llama-tiny"}, "data": {"train": "d"},
            "training": {"tokens": 1e6, "parallelism": {"pipeline": 2, "virtualStages": 2,
                                                        "schedule": "interleaved1F1B"}}})


def test_the_spec_refuses_interleaved_rounds_that_do_not_divide_a_steps_micro_batches():
    def job(global_batch: int, nodes_min: int = 2, **training):
        return {"image": "x", "model": {"preset": "llama-tiny", "layers": 4},
                "data": {"train": "d"}, "procsPerNode": 2,
                "nodes": {"min": nodes_min, "max": 2},
                "training": {"tokens": 1e7, "microBatch": 1, "globalBatchTokens": global_batch,
                             "parallelism": {"pipeline": 2, "schedule": "interleaved1F1B",
                                             "virtualStages": 2}, **training}}
    # 2 data-parallel ranks of 128-token micro-batches: 256 tokens each.
    for micro_batches in (2, 3, 4, 6, 8):   # 1, 1, 2, 3, 4 rounds: each divides its count
        PretrainJobSpec.model_validate(job(256 * micro_batches))
    with pytest.raises(ValidationError, match="5 micro-batches on 2 pipeline ranks make 2 "
                                              "rounds, which do not divide them"):
        PretrainJobSpec.model_validate(job(256 * 5))
    # An elastic range is checked at every size: 6 a step at 2 nodes (3 rounds), 12 at 1 (6).
    PretrainJobSpec.model_validate(job(256 * 6, nodes_min=1))
    # 7 a step at 2 nodes is refused; a ramp through 5 is refused even when the full batch fits.
    with pytest.raises(ValidationError, match="at 2 node.s., interleaved1F1B"):
        PretrainJobSpec.model_validate(job(256 * 7, nodes_min=1))
    with pytest.raises(ValidationError, match=r"make 2 rounds.*\(a step of the batch ramp\)"):
        PretrainJobSpec.model_validate(job(256 * 6, batchRamp={"startTokens": 256 * 4,
                                                               "rampTokens": 1e5}))
    # Every count a step can have, also one a run keeping its size never takes: this short
    # ramp goes from 4 a step straight to 6 at 2 nodes, but a run resized from another size
    # mid-ramp can start a step where it takes 5.
    ramp = {"startTokens": 256 * 4, "rampTokens": 1024}
    with pytest.raises(ValidationError, match="5 micro-batches on 2 pipeline ranks"):
        PretrainJobSpec.model_validate(job(256 * 6, batchRamp=ramp))
    # A hostile full batch, a million micro-batches a step on every rank, over an elastic
    # range: refused or accepted at once, not walked count by count.
    huge = job(256 * 10**6, batchRamp={"startTokens": 256 * 10**5, "rampTokens": 1e9})
    huge = {**huge, "nodes": {"min": 1, "max": 64},
            "training": {**huge["training"], "tokens": 1e12}}
    started = time.perf_counter()
    with pytest.raises(ValidationError, match="rounds"):
        PretrainJobSpec.model_validate(huge)
    one_f_one_b = {**huge, "training": {**huge["training"], "parallelism": {"pipeline": 2}}}
    PretrainJobSpec.model_validate(one_f_one_b)
    assert time.perf_counter() - started < 5


def test_the_spec_refuses_a_pipeline_its_steps_cannot_fill_at_the_most_nodes():
    def job(nodes_max: int, **training):
        return {"image": "x", "model": {"preset": "llama-tiny"}, "data": {"train": "d"},
                "procsPerNode": 4, "nodes": {"min": 1, "max": nodes_max},
                "training": {"tokens": 1e7, "microBatch": 8, "parallelism": {"pipeline": 2},
                             **training}}
    # 8192 tokens = 2 micro-batches of 8 x 128 on each of 4 data-parallel ranks at 2 nodes.
    PretrainJobSpec.model_validate(job(2, globalBatchTokens=8192))
    with pytest.raises(ValidationError, match="at 4 node.s., a step of 1 micro-batch.es. per "
                                              "data-parallel rank cannot fill 2"):
        PretrainJobSpec.model_validate(job(4, globalBatchTokens=8192))
    with pytest.raises(ValidationError, match=r"cannot fill 2 pipeline ranks \(a step of the "
                                              r"batch ramp\): raise globalBatchTokens or "
                                              "batchRamp.startTokens"):
        PretrainJobSpec.model_validate(job(2, globalBatchTokens=8192,
                                           batchRamp={"startTokens": 4096, "rampTokens": 1e6}))
