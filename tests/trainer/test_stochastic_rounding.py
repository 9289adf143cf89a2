"""bf16 parameters with stochastic rounding (`training.optimizer.bf16StochasticRounding`).

First the rounding itself (unbiased, on a neighbour, reproducible), then the optimizer against
torch's AdamW on fp32 parameters, its state through a save and load, its skip and its update
norm; then the trainer: an exact resume on two FSDP2 processes, and the acceptance run, 200
steps of `tiny` three ways (fp32 master weights, bf16 with and without stochastic rounding).
The foreign-device tier (test_foreign_device.py) checks where its random bits are drawn.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from crucible.api import arch
from crucible.api.spec import TrainingSpec
from crucible.trainer import optim
from crucible.trainer.model import GPT
from crucible.trainer.stochastic_rounding import (StochasticRoundingAdamW, rounding_seed,
                                                  shard_index, stochastic_round,
                                                  store_params_in_bf16)
from tests.support.repo import REPO
from tests.support.measure import record_host_reads
from tests.support.training import job_config, write_config
from tests.trainer.chaos import TrainProcess, curve, stop_and_resume, train_records

BF16 = torch.bfloat16


def _toward_zero(x: torch.Tensor) -> torch.Tensor:
    """fp32 `x` truncated to bf16 (its bf16 neighbour nearer zero), as fp32."""
    return (x.view(torch.int32) & -(1 << 16)).view(torch.float32)


def _neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two bf16 values around fp32 `x` (equal when `x` is one), as fp32."""
    low = _toward_zero(x)
    away = torch.where(x >= 0, float("inf"), float("-inf")).to(BF16)
    high = torch.where(low == x, low, torch.nextafter(low.to(BF16), away).float())
    return low, high


# --- the rounding ---------------------------------------------------------------------------------
@pytest.mark.parametrize("base", [1.0, -3.5, 0.02, -1e-3, 6e4])
@pytest.mark.parametrize("fraction", [0.1, 0.25, 0.5, 0.9])
def test_rounding_lands_on_a_neighbour_and_is_unbiased_where_nearest_is_not(base, fraction):
    low = torch.tensor(base, dtype=BF16)
    high = torch.nextafter(low, torch.tensor(float("inf") if base > 0 else float("-inf"),
                                             dtype=BF16))
    step = (high.float() - low.float()).abs()
    value = low.float() + fraction * (high.float() - low.float())  # strictly between the two
    samples = 100_000
    rounded = stochastic_round(value.expand(samples).contiguous(),
                               torch.Generator().manual_seed(0)).float()
    assert set(rounded.unique().tolist()) == {low.item(), high.item()}
    # Rounding away from zero is a Bernoulli(fraction): the mean's standard error is at most
    # step / (2 sqrt(n)) = 0.0016 steps; 0.01 steps is six of them.
    bias = float((rounded.mean() - value).abs() / step)
    assert bias < 0.01, bias
    # Round-to-nearest moves every sample the same way, at least 0.1 of a step here.
    assert float((value.to(BF16).float() - value).abs() / step) >= 0.1 - 1e-6


def test_rounding_is_reproducible_from_its_seed():
    value = torch.randn(10_000) * 0.02
    first = stochastic_round(value, torch.Generator().manual_seed(5))
    assert torch.equal(first, stochastic_round(value, torch.Generator().manual_seed(5)))
    assert not torch.equal(first, stochastic_round(value, torch.Generator().manual_seed(6)))


def test_bf16_values_infinities_and_nan_come_through_as_they_are():
    exact = torch.randn(1000).to(BF16)
    assert torch.equal(stochastic_round(exact.float(), torch.Generator().manual_seed(0)), exact)
    # NaN patterns whose carry would reach infinity, or wrap to -0.0.
    special = torch.tensor([0x7F800001, 0x7FFFFFFF, -1, 0x7F800000, -(1 << 23), 0],
                           dtype=torch.int32).view(torch.float32)
    out = stochastic_round(special, torch.Generator().manual_seed(0)).float()
    assert out[:3].isnan().all()
    assert out[3] == float("inf") and out[4] == float("-inf") and out[5] == 0


def test_the_seed_is_a_pure_function_of_its_four_parts():
    base = rounding_seed(1337, 10, 3, 0)
    assert base == rounding_seed(1337, 10, 3, 0) and 0 <= base < 2**63
    assert len({base, rounding_seed(1336, 10, 3, 0), rounding_seed(1337, 11, 3, 0),
                rounding_seed(1337, 10, 4, 0), rounding_seed(1337, 10, 3, 1)}) == 5


def test_replicas_of_a_shard_share_its_index_and_shards_do_not():
    """HSDP's replicas hold the same shard and must round it alike, or they drift apart."""
    def held(coordinate, placements, shape=(2, 4)):
        mesh = SimpleNamespace(get_coordinate=lambda: list(coordinate), shape=shape)
        return shard_index(SimpleNamespace(device_mesh=mesh, placements=placements))

    hsdp = (Replicate(), Shard(0))
    assert held((0, 3), hsdp) == held((1, 3), hsdp) == 3
    assert len({held((0, i), hsdp) for i in range(4)}) == 4
    assert held((1, 2), (Shard(0), Shard(1))) == 6       # row-major over sharded dimensions
    assert shard_index(torch.zeros(3)) == 0              # a plain tensor: the whole of it


# --- the optimizer -------------------------------------------------------------------------------
def _bf16_model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    model = GPT(arch.preset("tiny", vocab_size=97))
    model.init_weights()
    return store_params_in_bf16(model)


def _optimizer(model, rounding="stochastic") -> StochasticRoundingAdamW:
    return StochasticRoundingAdamW(optim.param_groups(model, 0.1), seed=7, rounding=rounding,
                                   lr=1e-3, betas=(0.9, 0.95), eps=1e-8)


def _set_grads(model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = (torch.randn(p.shape, generator=gen) * 1e-2).to(BF16)


def _reference(model, optimizer) -> tuple[list[torch.Tensor], torch.optim.AdamW]:
    """torch's fused AdamW on fp32 copies of the model's parameters, gradients and the
    optimizer's state, in the same groups."""
    copies = {p: p.detach().float().requires_grad_() for p in model.parameters()}
    for p, c in copies.items():
        c.grad = p.grad.float()
    ref = torch.optim.AdamW([{**{k: v for k, v in g.items() if k not in ("params",
                                                                          "rounding_step")},
                              "params": [copies[p] for p in g["params"]]}
                             for g in optimizer.param_groups])
    for p, c in copies.items():
        if optimizer.state.get(p):
            ref.state[c] = {k: v.clone() for k, v in optimizer.state[p].items()}
    return [copies[p] for p in model.parameters()], ref


def test_each_step_is_torch_adamw_in_fp32_rounded_to_a_neighbour_without_bias():
    model = _bf16_model()
    optimizer = _optimizer(model)
    assert {p.dtype for p in model.parameters()} == {BF16}
    offsets = []
    for step in range(4):
        _set_grads(model, step)
        fp32, ref = _reference(model, optimizer)
        ref.step()
        optimizer.step()
        for p, r in zip(model.parameters(), fp32):
            low, high = _neighbours(r.detach())
            got = p.detach().float()
            assert torch.all((got == low) | (got == high)), "not one of the two neighbours"
            state, ref_state = optimizer.state[p], ref.state[r]
            for key in ("step", "exp_avg", "exp_avg_sq"):   # fp32 moments, as AdamW's
                assert state[key].dtype == torch.float32
                assert torch.equal(state[key], ref_state[key]), key
            moved = (high - low) != 0
            offsets.append(((got - r.detach()) / (high - low))[moved])
    # Over ~1M roundings the mean offset in steps is zero (the standard error is ~0.0005).
    mean = float(torch.cat(offsets).mean())
    assert abs(mean) < 0.005, mean


def test_nearest_is_the_baseline_that_rounds_every_update_to_nearest():
    model = _bf16_model()
    optimizer = _optimizer(model, rounding="nearest")
    _set_grads(model, 0)
    fp32, ref = _reference(model, optimizer)
    ref.step()
    optimizer.step()
    assert all(torch.equal(p.detach(), r.detach().to(BF16))
               for p, r in zip(model.parameters(), fp32))


def test_fp32_parameters_are_refused():
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="bf16 parameters"):
        StochasticRoundingAdamW(model.parameters(), seed=0)


def test_the_spec_builds_it_and_the_parameters_go_bf16_but_not_the_rope_tables():
    spec = TrainingSpec(tokens=1e6, optimizer={"bf16StochasticRounding": True})
    model = _bf16_model()
    assert model.rope_cos.dtype == torch.float32 and model.rope_sin.dtype == torch.float32
    assert isinstance(optim.build_optimizer(model, spec), StochasticRoundingAdamW)
    assert type(optim.build_optimizer(GPT(arch.preset("tiny")), TrainingSpec(tokens=1e6))) \
        is torch.optim.AdamW


def test_a_restored_state_replays_the_same_rounding_with_fp32_moments():
    """Save after two steps, take a third; a fresh model and optimizer loaded from the save take
    the same third step bit for bit. torch's loader alone would round the moments to bf16, and a
    step count not saved would draw other bits."""
    model = _bf16_model()
    optimizer = _optimizer(model)
    for step in range(2):
        _set_grads(model, step)
        optimizer.step()
    saved_state = copy.deepcopy(optimizer.state_dict())
    saved_params = [p.detach().clone() for p in model.parameters()]
    _set_grads(model, 2)
    optimizer.step()

    again = _bf16_model(seed=1)
    with torch.no_grad():
        for p, v in zip(again.parameters(), saved_params):
            p.copy_(v)
    restored = _optimizer(again)
    restored.load_state_dict(saved_state)
    assert {v.dtype for s in restored.state.values() for k, v in s.items()} == {torch.float32}
    assert [g["rounding_step"] for g in restored.param_groups] == [2, 2]
    _set_grads(again, 2)
    restored.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))


@pytest.mark.parametrize("flag, skipped", [(0.0, False), (1.0, True)])
def test_a_step_the_guard_skips_changes_nothing(flag, skipped):
    """The loop hands the guard's verdict to the optimizer as `found_inf`, decided on the
    device: a skipped step changes no parameter, moment or step count."""
    model = _bf16_model()
    optimizer = _optimizer(model)
    _set_grads(model, 0)
    optimizer.step()
    before = {p: (p.detach().clone(), {k: v.clone() for k, v in optimizer.state[p].items()})
              for p in model.parameters()}
    _set_grads(model, 1)
    optimizer.found_inf = torch.tensor(flag)
    optimizer.step()
    unchanged = all(torch.equal(p, value) and all(torch.equal(state[k], optimizer.state[p][k])
                                                   for k in state)
                    for p, (value, state) in before.items())
    assert unchanged == skipped


def test_the_update_norm_is_the_fp32_adamw_update_and_reads_nothing(monkeypatch):
    model = _bf16_model()
    optimizer = _optimizer(model)
    _set_grads(model, 0)
    optimizer.step()
    _set_grads(model, 1)
    fp32, ref = _reference(model, optimizer)
    reads = record_host_reads(monkeypatch)
    predicted = optim.next_update_sq(optimizer)
    before = [p.detach().float() for p in model.parameters()]
    optimizer.step()
    monkeypatch.undo()
    assert reads == [], "the update norm or the step read a device value on the host"
    assert float(predicted) == pytest.approx(float(optim.next_update_sq(ref)), rel=1e-6)
    # The bf16 parameters moved by that much, give or take the rounding's noise.
    moved = sum(float((p.detach().float() - b).square().sum())
                for p, b in zip(model.parameters(), before))
    assert moved ** 0.5 == pytest.approx(float(predicted) ** 0.5, rel=0.05)


# --- the trainer ---------------------------------------------------------------------------------
def _config(corpus, tmp_path, name: str, steps: int):
    cfg = job_config(corpus, tmp_path / name, name="rounding", steps=steps, evalTokens=4096,
                     precision="bf16", optimizer={"bf16StochasticRounding": True})
    cfg["checkpoint"] = {"uri": str(tmp_path / name / "ckpt"), "everySteps": steps // 2,
                         "everyMinutes": 0, "keep": 3}
    return write_config(cfg, tmp_path / f"{name}.yaml")


def test_two_fsdp_processes_resume_a_rounded_run_bit_for_bit(corpus, tmp_path):
    """16 steps straight vs 8, a restart from the checkpoint, and 8 more: the same losses,
    gradient norms and LRs bit for bit. The rounding's bits come from the saved step count and
    each rank's own shard, the moments come back in fp32."""
    straight = TrainProcess(_config(corpus, tmp_path, "straight", 16), tmp_path / "straight.log")
    assert straight.finish() == 0, straight.text()[-3000:]
    assert "parameters: bf16, no fp32 master copy" in straight.text()
    second = stop_and_resume(_config(corpus, tmp_path, "resumed", 16), tmp_path, 8)
    assert "(step 8," in second, second[-3000:]
    a, b = (tmp_path / name / "metrics.jsonl" for name in ("straight", "resumed"))
    assert [r["step"] for r in train_records(b)] == list(range(1, 17))
    assert curve(a) == curve(b)
    losses = [loss for loss, _, _ in curve(a)]
    assert losses[-1] < losses[0] - 1.0, losses   # and it learns


def test_bf16_with_stochastic_rounding_ends_where_fp32_master_weights_do(corpus):
    """200 steps of `tiny` at the spec's defaults (peak LR 6e-4 as GPT-3 small, cosine to 10%,
    weight decay 0.1), three ways on the same batches. Late in the decay most AdamW updates are
    below half a bf16 step of their weight: rounding to nearest drops them, stochastic rounding
    keeps them in expectation. Measured on this corpus (held-out loss, seeds 1337, 1 and 2):
    master 5.793 / 5.801 / 5.823, stochastic +0.002 at most, nearest +0.038 to +0.049."""
    run = subprocess.run([sys.executable, "-m", "tests.trainer.rounding_probe",
                          str(corpus.train), str(corpus.val), "200", "6e-4"],
                         capture_output=True, text=True, timeout=600, cwd=REPO,
                         # One math thread: 45-80 s on a shared 2-core machine, where two
                         # threads spin-waited on each other for 70-200 s.
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    results = {r["variant"]: r for r in map(json.loads, run.stdout.splitlines())}
    master, rounded, nearest = (results[v]["eval_loss"] for v in
                                ("fp32-master", "bf16-stochastic", "bf16-nearest"))
    print(f"held-out loss after 200 steps: fp32 master {master:.4f}, bf16 stochastic "
          f"{rounded:.4f}, bf16 nearest {nearest:.4f} "
          f"({sum(r['seconds'] for r in results.values()):.0f} s of training)")
    assert results["bf16-stochastic"]["dtypes"] == ["torch.bfloat16"]
    assert "torch.float32" in results["fp32-master"]["dtypes"]
    assert abs(rounded - master) <= 0.02 * master
    assert nearest - master > 0.02, "round-to-nearest was expected to lose updates"
    assert abs(rounded - master) < (nearest - master) / 4


def test_a_checkpoint_with_or_without_rounding_loads_only_into_the_same_kind():
    # The rounding counter lives in the optimizer's groups and the weights are bf16: a resume
    # that turns the option on or off is refused by the model hash with a message naming it,
    # not by DCP's missing key (on) or a silent widening of the weights (off).
    from crucible.api.spec import TrainJobConfig
    from crucible.trainer.checkpoint import job_hashes

    def config(rounding: bool) -> TrainJobConfig:
        return TrainJobConfig.model_validate({
            "model": {"preset": "tiny"}, "data": {"train": "d"},
            "training": {"tokens": 1e6, "optimizer": {"bf16StochasticRounding": rounding}}})

    assert job_hashes(config(True))[0] != job_hashes(config(False))[0]
    assert job_hashes(config(True))[0] == job_hashes(config(True))[0]
