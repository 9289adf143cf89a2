"""Pipeline bubble, tensor-parallel traffic and layout choice (Narayanan et al. 2021,
arXiv 2104.04473: bubble (p−1)/m over ideal time, (p−1)/(m+p−1) of the total, (1/v)(p−1)/m
interleaved, §2.2; TP moves 8·b·s·h·(t−1)/t per layer per micro-batch, §3.2)."""

import dataclasses

import pytest

from crucible.api import arch
from crucible.trainer.hardware import accelerator
from crucible.trainer.plan import parallelism as par


@pytest.mark.parametrize("p, m", [(4, 8), (8, 32), (2, 1), (16, 64)])
def test_bubble_fraction(p, m):
    share = par.bubble_fraction(p, m)
    assert share == pytest.approx((p - 1) / (m + p - 1))
    assert share / (1 - share) == pytest.approx((p - 1) / m)  # bubble over ideal time


def test_interleaving_divides_the_bubble_by_v():
    share = par.bubble_fraction(8, 16, interleave=4)
    assert share / (1 - share) == pytest.approx((1 / 4) * 7 / 16)


def test_no_pipeline_no_bubble():
    assert par.bubble_fraction(1, 7) == 0


def test_bubble_rejects_nonsense():
    with pytest.raises(ValueError):
        par.bubble_fraction(0, 4)


H100 = accelerator("h100")


def test_tensor_parallel_traffic_formula():
    cfg = arch.GPTConfig(layers=24, heads=16, dim=2048, seq_len=2048)
    cost = par.cost_layout(cfg, par.Layout(dp=2, tp=4, pp=1, stage=1, recompute="selective"), H100,
                           global_batch_tokens=2048 * 2 * 2, micro_batch=2, mfu=0.4)
    per_layer = 8 * 2 * 2048 * 2048 * (4 - 1) / 4 * par.BYTES_PER_COMM_VALUE
    assert cost.microbatches == 1
    assert cost.tp_bytes == pytest.approx(per_layer * 24)


def test_small_model_gets_pure_data_parallelism():
    rec = par.recommend(arch.preset("gpt2-124m"), H100, 8, global_batch_tokens=2**19,
                        micro_batch=8, mfu=0.4)
    assert rec.best.layout.tp == rec.best.layout.pp == 1
    assert rec.smallest_sharding.layout.stage == 0  # DDP fits: no sharding needed


def test_large_model_needs_sharding_or_model_parallelism():
    cfg = arch.GPTConfig(layers=80, heads=64, dim=8192, seq_len=4096)  # ~65B
    rec = par.recommend(cfg, H100, 64, global_batch_tokens=4 * 2**20, micro_batch=1, mfu=0.4)
    lay = rec.best.layout
    assert rec.best.memory.fits
    assert lay.stage == 3 or lay.tp * lay.pp > 1
    assert lay.tp <= H100.gpus_per_node  # TP stays inside an NVLink node (takeaway #1)


def test_nothing_fits_says_so():
    cfg = arch.GPTConfig(layers=96, heads=96, dim=12288, seq_len=2048)  # GPT-3 175B
    rec = par.recommend(cfg, H100, 1, global_batch_tokens=2048, micro_batch=1, mfu=0.4)
    assert rec.best is None and "no layout" in rec.reasons[0]


BF16 = par.mem.PRECISIONS["bf16"]


@pytest.mark.parametrize("stage, pipelined, per_param", [
    (3, False, 4 * 8),       # FSDP: gather twice (bf16) and reduce (fp32) every micro-batch
    (3, True, 2 + 4),        # pipelined: the stage gathered and reduced once a step
    (2, False, 4 * 4 + 2),   # ZeRO-2: reduce every micro-batch, gather the update once
    (1, False, 4 + 2),       # ZeRO-1: reduce and gather once a step
    (0, False, 2 * 4),       # DDP: all-reduce once a step
])
def test_data_parallel_traffic_of_a_step_of_four_micro_batches(stage, pipelined, per_param):
    assert par.dp_bytes_per_step(stage, BF16, 4, pipelined) == per_param


def test_hsdp_keeps_its_gathers_in_a_node_and_all_reduces_across_nodes():
    cfg = arch.preset("gpt2-124m")
    kw = dict(global_batch_tokens=2**19, micro_batch=4, mfu=0.4, flash_attention=True)
    fsdp = par.cost_layout(cfg, par.Layout(64, 1, 1, 3, "none"), H100, **kw)
    hsdp = par.cost_layout(cfg, par.Layout(64, 1, 1, 3, "none", shard_group=8), H100, **kw)
    assert "8 replicas x shard groups of 8" in hsdp.layout.describe()
    # The states are sharded 8 ways, not 64 ...
    assert hsdp.memory.states.total_bytes == pytest.approx(8 * fsdp.memory.states.total_bytes)
    # ... and the gathers run on NVLink: a shorter step for a small model across nodes.
    m, n = fsdp.microbatches, arch.param_count(cfg)
    shard = n / 8
    assert hsdp.dp_bytes == pytest.approx(n * m * 8 * 7 / 8 + m * 2 * 4 * shard * 7 / 8)
    assert hsdp.step_s < fsdp.step_s


def test_the_job_runs_the_nearest_layout_crucibles_trainer_offers():
    """llama-8b on 64 H100s: the plan picks data parallelism without sharding beside 8-way
    tensor parallelism, which the trainer does not run (it shards with FSDP); the job runs
    the fastest layout it does run, and says why."""
    cfg = arch.preset("llama-8b")
    kw = dict(global_batch_tokens=2**21, micro_batch=1, mfu=0.4, flash_attention=True,
              compiled=True)
    rec = par.recommend(cfg, H100, 64, **kw)
    job = par.runnable(cfg, H100, 64, rec, **kw)
    lay = job.cost.layout
    assert rec.best.layout.stage != 3 and lay.stage == 3 and job.cost.memory.fits
    assert par.runnable_problem(cfg, rec.best.layout, rec.best.microbatches, 8) is not None
    assert par.runnable_problem(job.model, lay, job.cost.microbatches, 8) is None
    assert "not what Crucible's trainer runs" in job.notes[0]
    assert job.schedule == "1F1B" and job.sharding in ("auto", "fsdp")


def test_a_pipeline_needs_a_micro_batch_per_stage_and_whole_heads_per_tensor_rank():
    cfg = arch.preset("llama-8b")   # 32 heads, 8 key/value heads
    assert "cannot fill" in par.runnable_problem(cfg, par.Layout(8, 1, 4, 3, "none"), 2, 8)
    assert par.runnable_problem(cfg, par.Layout(8, 1, 4, 3, "none"), 4, 8) is None
    assert "key/value heads" in par.runnable_problem(cfg, par.Layout(4, 16, 1, 3, "none"), 1, 16)
    assert "ZeRO-1" in par.runnable_problem(cfg, par.Layout(8, 8, 1, 1, "none"), 1, 8)
    # Tensor parallelism never splits a key/value head: 16 does not divide 8.
    assert all(lay.tp <= 8 for lay in par.candidate_layouts(cfg, 256, 16))


def test_a_tied_model_is_costed_untied_under_a_pipeline():
    """The 70B shape the planner derives from a bare parameter count (GPT-2's tied head) on 512
    H100s: the job pipelines it, so it unties the head, V·h more parameters, and says so."""
    from crucible.trainer.plan import recipes

    cfg = recipes.shape_for_params(70e9, 2048)
    kw = dict(global_batch_tokens=3.2e6, micro_batch=4, mfu=0.4, flash_attention=True,
              compiled=True)
    job = par.runnable(cfg, H100, 512, par.recommend(cfg, H100, 512, **kw), **kw)
    assert cfg.tied_embeddings and cfg.heads % 8 == 0
    assert job.cost.layout.tp == 8 and job.cost.layout.pp == 2
    assert job.model == dataclasses.replace(cfg, tied_embeddings=False)
    assert "untied head" in " ".join(job.notes)
    assert job.cost.microbatches >= job.cost.layout.pp


@pytest.mark.parametrize("params", [1.3e9, 7e9, 13e9, 70e9, 175e9, 405e9])
def test_a_derived_shape_splits_into_whole_heads_over_a_node(params):
    from crucible.trainer.plan import recipes

    cfg = recipes.shape_for_params(params, 2048)
    assert cfg.heads % 8 == 0 and cfg.head_dim == 128
    assert arch.param_count(cfg) == pytest.approx(params, rel=0.05)


def test_interleaving_halves_the_bubble_and_pays_twice_the_point_to_point_traffic():
    cfg = arch.preset("llama-8b")
    lay = par.Layout(8, 1, 4, 3, "none")   # a stage is 8 GPUs: its boundaries cross nodes
    kw = dict(global_batch_tokens=2**21, micro_batch=1, mfu=0.4)
    one = par.cost_layout(cfg, lay, H100, **kw)
    two = par.cost_layout(cfg, lay, H100, schedule="interleaved1F1B", virtual_stages=2, **kw)
    assert two.pp_bytes == 2 * one.pp_bytes and two.pp_s == pytest.approx(2 * one.pp_s)
    assert one.pp_s == pytest.approx(one.pp_bytes / H100.internode_bytes_per_s)
    assert two.bubble < one.bubble and two.step_s < one.step_s
    # On a slow link between nodes the doubled sends cost more than the bubble saves.
    slow = dataclasses.replace(H100, internode_bytes_per_s=1e8)
    assert par.cost_layout(cfg, lay, slow, schedule="interleaved1F1B", virtual_stages=2,
                           **kw).step_s > par.cost_layout(cfg, lay, slow, **kw).step_s
