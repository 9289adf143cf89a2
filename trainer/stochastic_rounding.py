"""bf16 parameters with no fp32 master copy, updated by AdamW and rounded stochastically
(`training.optimizer.bf16StochasticRounding`).

Owns the mode's two parts: `store_params_in_bf16`, which turns a built (sharded, materialised)
model's parameters into bf16, and `StochasticRoundingAdamW`, which keeps AdamW's moments in fp32
and writes each step's result into the bf16 parameters with `stochastic_round`. It does not
choose the mode (`optim.build_optimizer` reads the spec) and does not shard (`parallel.py`).

Why it works: an update smaller than half a bf16 step (1/512 to 1/256 of the weight, so 6e-5 on
a weight of 0.02) is lost entirely by round-to-nearest, which is what late, low-LR training and
decoupled weight decay mostly consist of. Rounding up with probability equal to the distance to
the lower neighbour makes every update land in expectation (Gupta et al. 2015, "Deep Learning
with Limited Numerical Precision"; Zamirai et al. 2020, "Revisiting BFloat16 Training").
The bit trick is torchao's (`pytorch/ao`, `torchao/optim/quant_utils.py::_fp32_to_bf16_sr`):
bf16 is the upper half of an fp32 bit pattern, so adding 16 uniform random bits to the lower
half and truncating carries into the upper half with exactly that probability.

The update itself is torch's fused AdamW (`torch.optim.adamw.adamw`, fused) run on an fp32
copy of each parameter: the same arithmetic, the same `found_inf` skip the stability guard uses,
the same state keys (`step`, `exp_avg`, `exp_avg_sq`) for DCP and `optim.next_update_sq`.

Randomness is stateless: the bits for parameter i at step s come from a generator on the
parameter's own device, seeded by (training seed, s, i, the shard this rank holds), so a run
restarted from a checkpoint (which holds s) replays the same rounding, and the replicas of a
shard under HSDP round alike and stay identical.
"""

from __future__ import annotations

import hashlib
from typing import Literal

import torch
from torch.optim.adamw import adamw

from crucible.trainer.parallel import apply_to_tensors, chunks_with_grads
from crucible.trainer.parallel import local as _local

ROUNDINGS = ("stochastic", "nearest")

# Elements of parameters one fused AdamW call takes at a time: the fp32 copies of their values
# and gradients (8 bytes an element) stay near 0.5 GB whatever the model's size.
STEP_CHUNK = 1 << 26

# The upper 16 bits of an fp32 pattern (0xFFFF0000 as a signed 32-bit integer): a bf16 value.
_BF16_BITS = -(1 << 16)


def stochastic_round(value: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """`value` (fp32) rounded to bf16, up or down at random: to the neighbour above its
    magnitude with probability equal to how far towards it the value lies, so the expected
    result is `value` itself. Exactly representable values stay as they are; NaN stays NaN.
    `generator` must be on `value`'s device. One int32 temporary the size of `value`."""
    noise = torch.randint(0, 1 << 16, value.shape, dtype=torch.int32, device=value.device,
                          generator=generator)
    # Sign and magnitude: adding to the pattern rounds the magnitude, so negatives are unbiased
    # too. Finite values cannot overflow (at most 0x7F7FFFFF + 0xFFFF); infinity stays infinity.
    rounded = noise.add_(value.view(torch.int32)).bitwise_and_(_BF16_BITS).view(torch.float32)
    # A NaN's pattern could carry into infinity (or wrap to -0.0): keep NaN a NaN.
    return torch.where(value.isnan(), value, rounded).to(torch.bfloat16)


def rounding_seed(seed: int, step: int, index: int | str, shard: int) -> int:
    """The generator seed for parameter `index` (its name, or its place in the optimizer's
    groups) on the shard numbered `shard`, at optimizer step `step` (counted from 0). Pure."""
    key = f"{seed}/{step}/{index}/{shard}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def shard_index(param: torch.Tensor) -> int:
    """Which shard of `param` this rank holds: its coordinate over the mesh dimensions the
    parameter is sharded on (FSDP2's DTensor), row-major; 0 for a plain tensor. A replicated
    dimension (HSDP's replicas) does not count: replicas hold, and must round, the same values."""
    if not hasattr(param, "device_mesh"):
        return 0
    index = 0
    for coordinate, size, placement in zip(param.device_mesh.get_coordinate(),
                                           param.device_mesh.shape, param.placements):
        if placement.is_shard():
            index = index * size + coordinate
    return index


def store_params_in_bf16(model: torch.nn.Module) -> torch.nn.Module:
    """Cast the model's floating-point parameters (not its buffers) to bf16 in place, before its
    first forward. Through `Module._apply`, which FSDP2 overrides to re-register its sharded
    parameters (it reads the parameters' dtype at its lazy init, for exactly this), through
    every root of a pipeline rank's stages (`parallel.apply_to_tensors`); not
    `.to(torch.bfloat16)`, which would also cast the fp32 RoPE tables."""
    params = {id(p) for p in model.parameters() if p.is_floating_point()}
    return apply_to_tensors(model, lambda t: t.to(torch.bfloat16) if id(t) in params else t)


class StochasticRoundingAdamW(torch.optim.AdamW):
    """AdamW (decoupled weight decay, torch's fused kernel) on bf16 parameters, with fp32
    moments, rounding each new parameter value into bf16 stochastically.

    `rounding="nearest"` rounds to nearest instead: the plain bf16 baseline that loses small
    updates, for comparison. The step counter that seeds the rounding (`rounding_step`) is in
    every parameter group, so DCP saves and restores it with the groups' hyperparameters."""

    def __init__(self, params, *, seed: int,
                 rounding: Literal["stochastic", "nearest"] = "stochastic",
                 names: dict | None = None, **adamw):
        if rounding not in ROUNDINGS:
            raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
        super().__init__(params, fused=True, **adamw)
        for group in self.param_groups:
            group["rounding_step"] = 0
            for p in group["params"]:
                if p.dtype != torch.bfloat16:
                    raise ValueError(f"stochastic rounding updates bf16 parameters; got one of "
                                     f"{p.dtype} (store_params_in_bf16 casts a model's)")
        self.seed, self.rounding = seed, rounding
        params = [p for group in self.param_groups for p in group["params"]]
        # (name or index, shard) per parameter, fixed for the optimizer's life: the seed's pure
        # part. By name when given (`names`, the model's own): a pipeline stage's optimizer
        # numbers only its own parameters, and two stages' i-th would draw the same bits.
        names = names or {}
        self._identity = {p: (names.get(p, i), shard_index(p)) for i, p in enumerate(params)}
        self._generators: dict[torch.device, torch.Generator] = {}

    def _state(self, param: torch.Tensor) -> dict:
        state = self.state[param]
        if not state:
            # As fused AdamW: the count on the parameter's device (no host read to use it); the
            # moments fp32 whatever the parameter's dtype (zeros_like would give bf16 ones).
            state["step"] = torch.zeros((), dtype=torch.float32, device=_local(param).device)
            state["exp_avg"] = torch.zeros_like(param, dtype=torch.float32)
            state["exp_avg_sq"] = torch.zeros_like(param, dtype=torch.float32)
        return state

    def _generator(self, device: torch.device) -> torch.Generator:
        # One per device, re-seeded for every parameter: made where the bits are drawn (a host
        # generator cannot fill a CUDA tensor).
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device)
        return self._generators[device]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for chunk in chunks_with_grads(group["params"], STEP_CHUNK):
                self._update(group, chunk)
            group["rounding_step"] = group.get("rounding_step", 0) + 1
        return loss

    def _update(self, group: dict, params: list[torch.Tensor]) -> None:
        """One fused AdamW call over fp32 copies of `params`, then each copy rounded back."""
        states = [self._state(p) for p in params]
        work = [_local(p).float() for p in params]            # new fp32 tensors: p is bf16
        grads = [_local(p.grad).float() for p in params]
        beta1, beta2 = group["betas"]
        adamw(
            work, grads, [_local(s["exp_avg"]) for s in states],
            [_local(s["exp_avg_sq"]) for s in states], [], [s["step"] for s in states],
            fused=True, found_inf=getattr(self, "found_inf", None),
            grad_scale=getattr(self, "grad_scale", None), amsgrad=False, beta1=beta1,
            beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
            maximize=group["maximize"])
        step = group.get("rounding_step", 0)
        for param, value in zip(params, work):
            local = _local(param)
            if self.rounding == "nearest":
                local.copy_(value)
                continue
            index, shard = self._identity[param]
            generator = self._generator(value.device)
            generator.manual_seed(rounding_seed(self.seed, step, index, shard))
            local.copy_(stochastic_round(value, generator))

    def load_state_dict(self, state_dict: dict) -> None:
        """As AdamW's, but the moments stay fp32: torch's loader casts every floating-point
        state to its parameter's dtype, which here would round them to bf16."""
        saved = [pid for group in state_dict["param_groups"] for pid in group["params"]]
        mine = [p for group in self.param_groups for p in group["params"]]
        moments = {param: {k: v for k, v in state_dict["state"].get(pid, {}).items()
                           if k in ("exp_avg", "exp_avg_sq")}
                   for pid, param in zip(saved, mine)}
        super().load_state_dict(state_dict)
        for param, kept in moments.items():
            for key, value in kept.items():
                self.state[param][key] = value.to(device=_local(param).device,
                                                  dtype=torch.float32)
