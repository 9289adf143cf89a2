"""Pipeline bubble, tensor-parallel traffic and layout choice (Narayanan et al. 2021,
arXiv 2104.04473: bubble (p−1)/m over ideal time, (p−1)/(m+p−1) of the total, (1/v)(p−1)/m
interleaved, §2.2; TP moves 8·b·s·h·(t−1)/t per layer per micro-batch, §3.2)."""

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
