"""Checkpoint interval: Young 1974 (T = sqrt(2·δ·M)), Daly 2006 (higher-order optimum and the
expected wall time T_w = M·e^(R/M)·(e^((τ+δ)/M) − 1)·T_s/τ), Llama 3's failure rate
(Dubey et al. 2024 §3.3.4: 419 unexpected interruptions in 54 days on 16,384 GPUs)."""

import math

import pytest

from crucible.trainer.plan import reliability as rel


@pytest.mark.parametrize("save_s, mtbf_s", [(60, 3 * 3600), (300, 24 * 3600), (5, 3600)])
def test_young_interval(save_s, mtbf_s):
    assert rel.young_interval_s(save_s, mtbf_s) == pytest.approx(math.sqrt(2 * save_s * mtbf_s))


def test_young_example_one_minute_save_three_hour_mtbf():
    assert rel.young_interval_s(60, 3 * 3600) == pytest.approx(1138.4, abs=0.1)  # ≈19 min


def test_daly_approaches_young_for_small_saves():
    assert rel.daly_interval_s(1, 1e6) == pytest.approx(rel.young_interval_s(1, 1e6), rel=1e-3)


@pytest.mark.parametrize("save_s, mtbf_s", [(60, 3 * 3600), (600, 4 * 3600), (1800, 3 * 3600)])
def test_daly_optimum_minimises_expected_wall_time(save_s, mtbf_s):
    tau = rel.daly_interval_s(save_s, mtbf_s)
    best = min((rel.daly_wall_time_s(1e6, t, save_s, mtbf_s), t)
               for t in (x * 10 for x in range(1, 5000)))
    assert rel.daly_wall_time_s(1e6, tau, save_s, mtbf_s) == pytest.approx(best[0], rel=2e-3)


def test_daly_caps_at_mtbf_when_saves_are_slow():
    assert rel.daly_interval_s(3 * 3600, 3600) == 3600


def test_llama3_failure_rate():
    assert rel.LLAMA3_GPU_HOURS_PER_FAILURE == pytest.approx(54 * 24 * 16384 / 419)
    assert rel.job_mtbf_s(16384) / 3600 == pytest.approx(54 * 24 / 419)  # ≈3.1 h at 16k GPUs


def test_plan_goodput_and_lost_work():
    plan = rel.plan_checkpoints(solve_s=30 * 86400, save_s=60, mtbf_s=3 * 3600, restart_s=300)
    assert 0.8 < plan.goodput < 1
    assert plan.lost_work_per_failure_s == pytest.approx((plan.interval_s + 60) / 2 + 300)
    assert plan.expected_failures == pytest.approx(plan.wall_s / (3 * 3600))
    worse = rel.plan_checkpoints(30 * 86400, 60, 3 * 3600, 300, interval_s=6 * 3600)
    assert worse.goodput < plan.goodput


@pytest.mark.parametrize("call", [
    lambda: rel.young_interval_s(-1, 10), lambda: rel.daly_interval_s(1, 0),
    lambda: rel.job_mtbf_s(0),
])
def test_bad_input(call):
    with pytest.raises(ValueError):
        call()
