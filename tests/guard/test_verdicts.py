"""Guard verdicts on curves of known shape (synthetic, seeded), each verdict with its reason."""

from __future__ import annotations

import math

import numpy as np
import pytest

from crucible.api.spec import SpikeGuardSpec
from crucible.trainer.guard import MAD_TO_SIGMA, Baseline, Guard, replay

CFG = SpikeGuardSpec()


def healthy(steps: int, seed: int = 0, noise: float = 0.02) -> list[dict]:
    """A power-law loss curve with multiplicative noise and a noisy, slowly falling grad norm."""
    rng = np.random.default_rng(seed)
    t = np.arange(1, steps + 1)
    loss = (2.0 + 9.0 * (t + 20.0) ** -0.35) * np.exp(rng.normal(0, noise, steps))
    grad = (0.4 + 2.0 * (t + 50.0) ** -0.5) * np.exp(rng.normal(0, 0.15, steps))
    return [{"step": int(s), "loss": float(l), "grad_norm": float(g)} for s, l, g in zip(t, loss, grad)]


def kinds(verdicts) -> list[tuple[str, int]]:
    return [(v.kind, v.step) for v in verdicts]


def test_baseline_follows_a_trend_and_outliers_do_not_widen_it():
    rng = np.random.default_rng(0)
    b = Baseline(window=128)
    for i in range(200):  # log loss falling fast, 1% noise, and a few outliers
        b.append(-0.01 * i + rng.normal(0, 0.01) + (0.5 if i % 50 == 49 else 0.0))
    assert abs(b.z(-0.01 * 200)) < 3           # the next on-trend value is ordinary
    assert b.z(-0.01 * 200 + 0.1) > 6           # a 10% jump is far out despite the trend
    resid = np.fromiter(b.residuals, float)
    spread = MAD_TO_SIGMA * np.median(np.abs(resid - np.median(resid)))
    assert spread < 0.02                        # the outliers did not inflate the scale


def test_no_false_alarm_over_10k_healthy_steps():
    for seed in range(3):
        assert replay(healthy(10_000, seed), CFG) == []


def test_short_spike_that_recovers_is_transient():
    # A guard told not to skip, so the episode logic is seen alone: a 3-step bump, then normal.
    cfg = SpikeGuardSpec(zSkip=1000)
    run = healthy(600)
    for i, bump in zip(range(400, 403), (1.3, 1.25, 1.1)):
        run[i]["loss"] *= bump
    verdicts = replay(run, cfg)
    assert kinds(verdicts) == [("transient", 403)] or kinds(verdicts) == [("transient", 404)]
    assert verdicts[0].onset == 401 and "back to normal" in verdicts[0].reason


def test_one_extreme_step_is_skipped_then_judged_transient():
    run = healthy(600)
    run[300]["loss"] *= 1.8  # a garbage batch
    verdicts = replay(run, CFG)
    assert kinds(verdicts) == [("skip", 301), ("transient", 302)]
    assert "MADs above the recent median" in verdicts[0].reason
    assert verdicts[1].onset == 301


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_loss_or_grad_is_skipped(bad):
    run = healthy(200)
    run[100]["loss"] = bad
    run[150]["grad_norm"] = bad
    verdicts = replay(run, CFG)
    assert kinds(verdicts) == [("skip", 101), ("transient", 102), ("skip", 151), ("transient", 152)]
    assert verdicts[0].reason.startswith("non-finite loss")
    assert verdicts[2].reason.startswith("non-finite gradient norm")


def test_spike_preceded_by_growing_gradient_norm_rolls_back():
    run = healthy(600)
    for k, i in enumerate(range(400, 416)):
        run[i]["grad_norm"] *= 1.25 ** (k + 1)   # grad norm climbs for 16 steps...
    for i in range(416, 430):
        run[i]["loss"] *= 1.5                      # ...then the loss blows up
    verdicts = replay(run, CFG)
    rollback = next(v for v in verdicts if v.kind == "rollback")
    assert rollback.step < 417, kinds(verdicts)  # caught before the loss blew up
    assert rollback.onset <= 406
    assert "gradient norm" in rollback.reason or "skipped" in rollback.reason


def test_slow_divergence_rolls_back():
    run = healthy(800)
    for i in range(500, 800):
        run[i]["loss"] *= 1.004 ** (i - 499)       # +0.4% per step, compounding
    verdicts = replay(run, CFG)
    assert verdicts and verdicts[0].kind == "rollback", kinds(verdicts)
    assert "slow divergence" in verdicts[0].reason and 480 < verdicts[0].onset < 530


def test_many_skips_in_a_window_roll_back():
    run = healthy(400)
    for i in range(200, 260, 10):
        run[i]["loss"] = float("nan")
    verdicts = replay(run, CFG)
    assert kinds(verdicts)[:8] == [("skip", 201), ("transient", 202), ("skip", 211),
                                   ("transient", 212), ("skip", 221), ("transient", 222),
                                   ("skip", 231), ("rollback", 231)]
    assert "4 updates skipped within 100 steps" in verdicts[7].reason
    assert verdicts[7].onset == 231  # the episode that tipped it over


def test_repeated_rollbacks_without_progress_abort():
    g = Guard(CFG)
    for r in healthy(100):
        g.observe(r["step"], r["loss"], r["grad_norm"], applied=True)
    verdicts = []
    for attempt in range(CFG.max_rollbacks + 1):
        for step in range(101, 200):   # the same region diverges every time it is retried
            pre = g.check_update(step, 50.0, 1.0)
            post = g.observe(step, 50.0, 1.0, applied=pre.ok)
            if post.kind in ("rollback", "abort"):
                verdicts.append(post)
                g.rolled_back(post)
                break
    assert [v.kind for v in verdicts] == ["rollback"] * CFG.max_rollbacks + ["abort"]
    assert "did not get past step" in verdicts[-1].reason


def test_progress_past_the_spike_resets_the_rollback_budget():
    g = Guard(CFG)
    run = healthy(400)
    for r in run[:100]:
        g.observe(r["step"], r["loss"], r["grad_norm"], applied=True)
    from crucible.trainer.guard import Verdict

    g.rolled_back(Verdict("rollback", 100, "test", 90))
    assert g.rollbacks_in_a_row == 1
    for r in run[100:300]:
        g.observe(r["step"], r["loss"], r["grad_norm"], applied=True)
    assert g.rollbacks_in_a_row == 0


def test_state_round_trips_exactly():
    g = Guard(CFG)
    for r in healthy(300):
        g.observe(r["step"], r["loss"], r["grad_norm"], applied=True)
    h = Guard(CFG)
    h.load_state_dict(g.state_dict())
    assert h.state_dict() == g.state_dict()
    assert h.check_update(301, 3.0, 0.5) == g.check_update(301, 3.0, 0.5)


def test_the_skip_limits_decide_exactly_as_check_update():
    """The loop hands `skip_limits` to the device, which skips a step without the host reading
    its numbers first: the same rule, whatever the history and the numbers."""
    from crucible.trainer.guard import skips

    rng = np.random.default_rng(3)
    g = Guard(CFG)
    assert g.skip_limits().loss == math.inf              # no history yet: only bad numbers skip
    for r in healthy(400, seed=3):
        limits = g.skip_limits()
        for loss, grad in [(r["loss"], r["grad_norm"]), (limits.loss, limits.grad_norm),
                           (limits.loss * (1 + 1e-12), r["grad_norm"]),
                           (r["loss"], limits.grad_norm * (1 + 1e-12)),
                           (float(rng.uniform(0, 20)), float(rng.uniform(0, 20))),
                           (float("nan"), 1.0), (3.0, float("inf")), (0.0, 1.0)]:
            want = g.check_update(r["step"], loss, grad).kind == "skip"
            assert skips(loss, grad, limits) == want, (r["step"], loss, grad, limits)
        g.observe(r["step"], r["loss"], r["grad_norm"], applied=True)
    assert g.ready and math.isfinite(g.skip_limits().loss)
