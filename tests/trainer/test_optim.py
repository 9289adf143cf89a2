"""The LR schedule's cases and the optimizer's parameter groups."""

from __future__ import annotations

import math

import pytest
import torch

from crucible.api import arch
from crucible.api.spec import TrainingSpec
from crucible.trainer.model import GPT
from crucible.trainer.optim import lr_at, param_groups
from tests.support.measure import record_host_reads


def spec(**kw) -> TrainingSpec:
    return TrainingSpec(tokens=1e6, **{"lr": 1e-3, "minLrRatio": 0.1, "warmupSteps": 10, **kw})


def test_warmup_is_linear_and_starts_above_zero():
    s = spec()
    assert lr_at(0, s, 100) == pytest.approx(1e-4)
    assert lr_at(4, s, 100) == pytest.approx(5e-4)
    assert lr_at(9, s, 100) == pytest.approx(1e-3)


def test_cosine_goes_from_peak_to_floor():
    s = spec(schedule="cosine")
    assert lr_at(10, s, 110) == pytest.approx(1e-3)
    assert lr_at(60, s, 110) == pytest.approx(1e-4 + 0.5 * 9e-4)  # half-way: mean of the two
    assert lr_at(110, s, 110) == pytest.approx(1e-4)
    values = [lr_at(i, s, 110) for i in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_wsd_is_flat_then_one_minus_sqrt_cooldown():
    s = spec(schedule="wsd", decayFraction=0.2)
    assert lr_at(50, s, 100) == pytest.approx(1e-3)
    assert lr_at(79, s, 100) == pytest.approx(1e-3)
    assert lr_at(80, s, 100) == pytest.approx(1e-3)
    assert lr_at(85, s, 100) == pytest.approx(1e-4 + (1 - math.sqrt(0.25)) * 9e-4)
    assert lr_at(99, s, 100) < 2e-4


def test_constant_schedule_and_beyond_the_plan():
    assert lr_at(500, spec(schedule="constant"), 100) == pytest.approx(1e-3)
    assert lr_at(500, spec(schedule="cosine"), 100) == pytest.approx(1e-4)


def test_weight_decay_only_on_matrices_not_embeddings_norms_or_biases():
    cfg = arch.preset("tiny", bias=True, position="learned", tied_embeddings=False)
    model = GPT(cfg)
    decay, no_decay = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    plain = {names[id(p)] for p in no_decay["params"]}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert "h.0.attn.c_attn.weight" in decayed and "lm_head.weight" in decayed
    assert {"wte.weight", "wpe.weight", "ln_f.weight", "h.0.attn.c_attn.bias"} <= plain
    assert not any(".ln_" in n or n.endswith(".bias") for n in decayed)
    assert len(decayed) + len(plain) == len(list(model.parameters()))


def test_update_norm_predicted_before_the_step_equals_the_real_parameter_change():
    import torch

    from crucible.trainer.optim import next_update_sq

    torch.manual_seed(0)
    model = GPT(arch.preset("tiny", vocab_size=97))
    model.init_weights()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    x = torch.randint(0, 97, (2, 4, 32))
    for _ in range(3):  # the first step (no state yet) and two more: bias correction and moments
        before = [p.detach().clone() for p in model.parameters()]
        model(x[0], x[1]).backward()
        predicted = next_update_sq(opt)
        opt.step()
        opt.zero_grad()
        moved = sum(float((p.detach() - b).square().sum()) for p, b in zip(model.parameters(), before))
        assert math.sqrt(predicted) == pytest.approx(math.sqrt(moved), rel=1e-3)


def test_update_norm_reads_nothing_back_to_the_host(monkeypatch):
    """A host read per parameter per step (~150 at 124M) would stall a GPU every step: the
    update norm stays on the device until the step's one all-reduce reads it."""
    import torch

    from crucible.trainer.optim import next_update_sq

    model = GPT(arch.preset("tiny", vocab_size=97))
    model.init_weights()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 97, (2, 4, 32))
    model(x[0], x[1]).backward()
    opt.step()
    model(x[0], x[1]).backward()
    reads = record_host_reads(monkeypatch)
    total = next_update_sq(opt)
    monkeypatch.undo()
    assert reads == [] and isinstance(total, torch.Tensor) and total.ndim == 0
    assert float(total) > 0


@pytest.mark.parametrize("loss_sum, grad_norm, skipped", [
    (6.0, 1.0, False),                  # loss 3.0 per rank, within the limits
    (6.0, 2.5, True),                   # gradient norm above its limit
    (9.0, 1.0, True),                   # loss 4.5 above its limit
    (float("nan"), 1.0, True), (6.0, float("inf"), True), (0.0, 1.0, True),
])
def test_the_skip_is_decided_on_the_device_and_a_skipped_step_changes_nothing(
        loss_sum, grad_norm, skipped):
    """The loop never reads a step's numbers before its update: the device compares them with
    the guard's limits (`skip_flag`) and fused AdamW takes the flag as `found_inf`."""
    import torch

    from crucible.trainer.guard import SkipLimits, skips
    from crucible.trainer.optim import skip_flag

    limits = SkipLimits(loss=4.0, grad_norm=2.0)
    sums = torch.tensor([loss_sum, grad_norm], dtype=torch.float64)
    flag = skip_flag(sums, 2, limits.loss, limits.grad_norm)
    assert flag.dtype == torch.float32 and flag.dim() == 0
    assert bool(flag) == skipped == skips(loss_sum / 2, grad_norm, limits)

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    before = {k: v.clone() for k, v in opt.state[model.weight].items()}
    weight = model.weight.detach().clone()
    model(torch.ones(2, 4)).sum().backward()
    opt.found_inf = flag
    opt.step()
    after = opt.state[model.weight]
    unchanged = torch.equal(weight, model.weight) and all(
        torch.equal(before[k], after[k]) for k in before)
    assert unchanged == skipped
