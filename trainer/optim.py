"""AdamW with decay only on matrices, the learning-rate schedule, and gradient clipping.

- Parameter groups follow nanoGPT's `configure_optimizers` and OLMo 2 (`decay_embeddings:
  false`): weight decay on 2-D weights of linear layers; none on norms, biases and embeddings
  (with tied embeddings that includes the output layer).
- `lr_at` is a pure function of the step (nanoGPT's `get_lr`, cases numbered): linear warmup,
  then cosine decay to min_lr (Loshchilov & Hutter 2017; Chinchilla decays to 10%), or
  warmup-stable-decay with a "1-sqrt" cooldown over the last `decay_fraction` of steps, the best
  cooldown shape in Hägele et al. 2024 ("Scaling Laws and Compute-Optimal Training Beyond Fixed
  Training Durations", §3), or constant.
- With `optimizer.bf16StochasticRounding`, `build_optimizer` returns the bf16-parameter AdamW
  of `stochastic_rounding.py` (fp32 moments, no master copy), over the same groups.
- `LRScale` is a multiplier the stability guard may lower after a rollback (OPT-175B logbook),
  saved in checkpoints; `LRClock` is where a step is on the schedule, the step itself unless an
  elastic resize mid batch-ramp changed how many steps the run has left (recorded in
  checkpoints' notes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from crucible.api.spec import TrainingSpec
from crucible.trainer.parallel import canonical_name, chunks_with_grads
from crucible.trainer.parallel import local as _local
from crucible.trainer.stochastic_rounding import StochasticRoundingAdamW


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        is_embedding = name.startswith(("wte.", "wpe."))
        (decay if param.dim() >= 2 and not is_embedding else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: torch.nn.Module, spec: TrainingSpec) -> torch.optim.AdamW:
    """AdamW over `param_groups`; with `optimizer.bf16StochasticRounding`, the bf16 variant
    (`stochastic_rounding.py`: the model's parameters must already be bf16), seeded by the
    run's seed."""
    groups = param_groups(model, spec.weight_decay)
    hyper = dict(lr=spec.lr, betas=(spec.beta1, spec.beta2), eps=spec.eps)
    if spec.optimizer.bf16_stochastic_rounding:
        names = {param: canonical_name(name) for name, param in model.named_parameters()}
        return StochasticRoundingAdamW(groups, seed=spec.seed, names=names, **hyper)
    # Fused, on every device: one kernel a step, the step counts stay where the parameters
    # are (no host read), and it takes `found_inf`, so the stability guard's skip is decided on
    # the device (`skip_flag`) without the host waiting for the step's numbers. (The CPU ran
    # foreach for a while, while a rare abort at process exit was chased; it was not the
    # optimizer's: see commands/train.py.)
    return torch.optim.AdamW(groups, fused=True, **hyper)


def skip_flag(sums: torch.Tensor, world_size: int, loss_limit: float,
              grad_limit: float) -> torch.Tensor:
    """1.0 (skip the update) or 0.0, on the device, from the step's all-reduced sums (the loss
    summed over ranks, then the global gradient norm): the guard's rule (`guard.skips`) in
    float64 on the same numbers the host later reads, so both always agree. Given to fused
    AdamW as `found_inf`: a skipped step changes no parameter, moment or step count."""
    # Divided by a tensor: true division, as the host's. (By a Python number CUDA multiplies by
    # its reciprocal, which can differ in the last bit, and a loss at the limit would be
    # skipped on one side only.)
    loss = sums[0] / torch.full((), world_size, dtype=sums.dtype, device=sums.device)
    grad_norm = sums[1]
    bad = (~(torch.isfinite(loss) & torch.isfinite(grad_norm)) | (loss <= 0)
           | (loss > loss_limit) | (grad_norm > grad_limit))
    return bad.to(torch.float32)


def lr_at(step: int, spec: TrainingSpec, total_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based) of a run of `total_steps`. By step, not
    by token: with a batch ramp its smaller steps count as whole steps of warmup and decay, and
    `total_steps` is the ramp's count (batch_ramp.BatchSchedule), as a restart recomputes it."""
    peak, floor = spec.lr, spec.lr * spec.min_lr_ratio
    warmup = min(spec.warmup_steps, max(total_steps - 1, 0))
    # 1) linear warmup; (step+1) so the very first update is not taken at LR 0
    if step < warmup:
        return peak * (step + 1) / warmup
    # 2) constant after warmup
    if spec.schedule == "constant":
        return peak
    # 3) past the end (a run extended beyond its plan): stay at the floor
    if step >= total_steps:
        return floor
    if spec.schedule == "cosine":
        # 4) cosine from peak at the end of warmup to floor at the last step
        progress = (step - warmup) / max(1, total_steps - warmup)
        return floor + 0.5 * (1.0 + math.cos(math.pi * progress)) * (peak - floor)
    # 5) WSD: stable at peak, then 1-sqrt cooldown over the last decay_fraction of the run
    decay_steps = max(1, round(spec.decay_fraction * total_steps))
    decay_start = total_steps - decay_steps
    if step < decay_start:
        return peak
    progress = (step - decay_start) / decay_steps
    return floor + (1.0 - math.sqrt(progress)) * (peak - floor)


@dataclass(frozen=True)
class LRClock:
    """Where step `step` is on an LR schedule of `total_steps`: the step itself, or, after a
    resume that cut the rest of a batch ramp into another number of steps (an elastic resize:
    a ramp's steps are whole micro-batches per data-parallel rank), the steps from
    `anchor_step` to the run's last (of `run_steps`) spread evenly over what is left of the
    schedule from `anchor_position` to its last step. The LR neither jumps at the resume nor
    ends before or after the run does. `run_steps` 0: no such resume."""

    total_steps: int
    anchor_step: int = 0
    anchor_position: float = 0.0
    run_steps: int = 0

    def position(self, step: int) -> float:
        if not self.run_steps:
            return step
        left = self.run_steps - 1 - self.anchor_step
        if left <= 0:
            return self.anchor_position
        span = (self.total_steps - 1 - self.anchor_position) / left
        return self.anchor_position + (step - self.anchor_step) * span

    def resumed(self, step: int, run_steps: int) -> "LRClock":
        """This clock, continued from `step` by a run whose last step is `run_steps`: itself
        when that is where it ends already (a restart at the same size), or past the end."""
        position = self.position(step)
        if run_steps == (self.run_steps or self.total_steps) or step >= run_steps - 1 \
                or position >= self.total_steps - 1:
            return self
        return LRClock(self.total_steps, step, position, run_steps)

    def note(self) -> dict:
        return {"total_steps": self.total_steps, "anchor_step": self.anchor_step,
                "anchor_position": self.anchor_position, "run_steps": self.run_steps}

    @classmethod
    def from_note(cls, note) -> "LRClock | None":
        """The clock a checkpoint recorded (`note`); None when it is not one."""
        if not isinstance(note, dict):
            return None
        try:
            clock = cls(int(note["total_steps"]), int(note.get("anchor_step", 0)),
                        float(note.get("anchor_position", 0.0)), int(note.get("run_steps", 0)))
        except (KeyError, TypeError, ValueError):
            return None
        valid = clock.total_steps > 0 and (not clock.run_steps or (
            clock.run_steps - 1 > clock.anchor_step >= 0
            and 0 <= clock.anchor_position < clock.total_steps - 1))
        return clock if valid else None


@dataclass
class LRScale:
    """A multiplier on the schedule: 1.0 unless the stability guard lowered it after a rollback,
    in which case it holds `value` until step `until_step` (OPT-175B lowered the LR for a while
    after restarting from an earlier checkpoint)."""

    value: float = 1.0
    until_step: int = 0

    def at(self, step: int) -> float:
        return self.value if step < self.until_step else 1.0

    def lower(self, factor: float, until_step: int) -> None:
        self.value, self.until_step = factor, until_step

    def state_dict(self) -> dict:
        return {"value": self.value, "until_step": self.until_step}

    def load_state_dict(self, state: dict) -> None:
        self.value, self.until_step = float(state["value"]), int(state.get("until_step", 0))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def clip_grad_norm(model: torch.nn.Module, max_norm: float,
                   pipeline_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Global gradient norm before clipping (over all shards, and over every pipeline stage's
    gradients when `pipeline_group` joins the stages), as a 0-dim tensor on the gradients'
    device; clips in place if max_norm > 0. Not read here: the step's one host read is the
    loop's packed all-reduce."""
    params = [p for p in model.parameters() if p.grad is not None]
    if pipeline_group is None:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"),
                                              foreach=True)
        if hasattr(norm, "full_tensor"):  # a DTensor under FSDP2: the norm of the whole model
            norm = norm.full_tensor()  # a device collective, no host read
        return norm
    # A stage holds some of the parameters: the squares of the stages' norms add up (as
    # torchtitan's `clip_grad_norm_` does), then every stage clips by the same whole norm.
    norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    square = norm.double().square()
    dist.all_reduce(square, group=pipeline_group)
    norm = square.sqrt().to(norm.dtype)
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
    return norm


# Elements of optimizer state one foreach pass of `next_update_sq` takes at a time: its
# temporaries (two per element) stay near 0.5 GB in fp32 whatever the model's size.
UPDATE_NORM_CHUNK = 1 << 26


@torch.no_grad()
def next_update_sq(optimizer: torch.optim.AdamW) -> torch.Tensor:
    """This rank's share of ||Δθ||² for the AdamW step about to be taken with the gradients now
    held (lr·m̂/(√v̂+ε) per parameter with the moments and step count the step will produce;
    decoupled weight decay left out), as a 0-dim float64 tensor on the parameters' device.
    Summed over ranks, its root is the update norm the stability guard logs: Adam instability
    (Molybog et al. 2023) shows up as a large update that no longer follows the gradient.

    Computed before the step, not read from the state after it, so it rides in the same
    all-reduce as the loss and gradient norm: no host read of its own. Only for logging steps
    (the loop asks then): it is a metric, and it costs a pass over the optimizer state. Local
    shards only, with `torch._foreach_*` ops over chunks of each parameter group (a few dozen
    launches a chunk, not a dozen a parameter), two temporaries per element of a chunk. The step
    counts stay tensors (fused AdamW keeps them on the device)."""
    parts = [_update_sq(optimizer, group, chunk) for group in optimizer.param_groups
             for chunk in chunks_with_grads(group["params"], UPDATE_NORM_CHUNK)]
    if not parts:
        param = next(p for group in optimizer.param_groups for p in group["params"])
        return torch.zeros((), dtype=torch.float64, device=param.device)
    return torch.stack(parts).sum()


def _update_sq(optimizer: torch.optim.AdamW, group: dict, params: list) -> torch.Tensor:
    """||Δθ||² of the next step over `params` (one group's, all with gradients)."""
    beta1, beta2 = group["betas"]
    states = [optimizer.state.get(p) or {} for p in params]
    # In fp32, as the moments are: bf16 gradients (bf16 parameters, stochastic rounding) are
    # upcast, a third temporary per element; fp32 ones are taken as they are (`float()`).
    fresh = [_local(p.grad).float() for p, state in zip(params, states) if "exp_avg" not in state]
    seen = [(_local(p.grad).float(), state) for p, state in zip(params, states)
            if "exp_avg" in state]
    # This rank's share of each parameter's square (`_holders`), in the two lists' orders.
    shares = [1.0 / _holders(p) for p, state in zip(params, states) if "exp_avg" not in state]
    seen_shares = [1.0 / _holders(p) for p, state in zip(params, states) if "exp_avg" in state]
    squares = []
    if fresh:   # their first step: AdamW starts both moments and the count at zero
        m = torch._foreach_mul(fresh, 1.0)    # m̂ = (1-β1)g / (1-β1): g (a copy, overwritten)
        v = torch._foreach_mul(fresh, fresh)  # v̂ = (1-β2)g² / (1-β2)
        squares.append(_adam_direction_sq(m, v, group["eps"], shares))
    if seen:
        g = [grad for grad, _ in seen]
        m = torch._foreach_lerp([_local(state["exp_avg"]) for _, state in seen], g, 1 - beta1)
        v = torch._foreach_mul([_local(state["exp_avg_sq"]) for _, state in seen], beta2)
        torch._foreach_addcmul_(v, g, g, value=1 - beta2)
        counts = torch._foreach_add([state["step"] for _, state in seen], 1)
        # 1 - β^t per parameter, on the step counts' device: no host read of the count.
        for moments, beta in ((m, beta1), (v, beta2)):
            bias = torch._foreach_pow(beta, counts)
            torch._foreach_neg_(bias)
            torch._foreach_add_(bias, 1)
            torch._foreach_div_(moments, bias)
        squares.append(_adam_direction_sq(m, v, group["eps"], seen_shares))
    return torch.stack(squares).sum() * group["lr"] ** 2


def _adam_direction_sq(m_hat: list, v_hat: list, eps: float, shares: list[float]) -> torch.Tensor:
    """||m̂/(√v̂+ε)||² summed over the tensors, each weighted by this rank's share of it
    (`_holders`), in float64; `m_hat` and `v_hat` are overwritten."""
    torch._foreach_sqrt_(v_hat)
    torch._foreach_add_(v_hat, eps)
    torch._foreach_div_(m_hat, v_hat)
    norms = torch._foreach_norm(m_hat, 2, dtype=torch.float32)
    # Scaling the norms by √share squares to the share; a list of numbers rides in the kernel's
    # arguments (no tensor copied from the host, which on CUDA would wait for the device).
    torch._foreach_mul_(norms, [math.sqrt(share) for share in shares])
    return torch.stack(norms).double().square().sum()


def _holders(param: torch.Tensor) -> int:
    """How many ranks hold the same local values of `param`: the sizes of the mesh dimensions
    it is replicated over (HSDP's replicas; under tensor parallelism, the tp ranks for a norm's
    weight). A sum over every rank counts each such value that many times."""
    if not hasattr(param, "placements"):
        return 1
    return math.prod(param.device_mesh.size(dim) for dim, placement in
                     enumerate(param.placements) if placement.is_replicate())
