"""Time and money: wall-clock and GPU-hours for a FLOP budget at an assumed MFU, and back.

Owns the conversions only. MFU (model FLOPs utilisation) is achieved model FLOP/s over peak
(PaLM, Chowdhery et al. 2022, App. B); peaks come from `crucible.trainer.hardware`. Reference
points for a plausible MFU: Megatron-LM reached 44–52% of A100 peak at scale (Narayanan et al.
2021, Table 1); Llama 2 7B's 184,320 A100-hours for 6·7e9·2e12 FLOPs imply ≈41% (Llama 2 model
card); Llama 3 405B reports 38–43% on H100 (Dubey et al. 2024, Table 4).
"""

from __future__ import annotations

from dataclasses import dataclass

from crucible.trainer.hardware import Accelerator

DEFAULT_MFU = 0.40  # middle of the 38–52% range reported above; a first run rarely beats it


@dataclass(frozen=True)
class Cost:
    compute_flops: float
    gpus: int
    mfu: float
    peak_flops_per_gpu: float
    usd_per_gpu_hour: float

    @property
    def cluster_flops_per_s(self) -> float:
        return self.gpus * self.peak_flops_per_gpu * self.mfu

    @property
    def wall_s(self) -> float:
        """Failure-free wall-clock: C / (GPUs · peak · MFU)."""
        return self.compute_flops / self.cluster_flops_per_s

    @property
    def gpu_hours(self) -> float:
        return self.wall_s * self.gpus / 3600

    @property
    def usd(self) -> float:
        return self.gpu_hours * self.usd_per_gpu_hour


def training_cost(compute_flops: float, gpu: Accelerator, gpus: int, mfu: float = DEFAULT_MFU,
                  usd_per_gpu_hour: float | None = None) -> Cost:
    if compute_flops <= 0:
        raise ValueError(f"compute must be > 0 FLOP, got {compute_flops:g}")
    if gpus < 1:
        raise ValueError(f"gpus must be >= 1, got {gpus}")
    if not 0 < mfu <= 1:
        raise ValueError(f"MFU must be in (0, 1], got {mfu:g}")
    price = gpu.usd_per_gpu_hour if usd_per_gpu_hour is None else usd_per_gpu_hour
    return Cost(compute_flops, gpus, mfu, gpu.peak_bf16_flops, price)


def compute_from_gpu_hours(gpu_hours: float, gpu: Accelerator, mfu: float = DEFAULT_MFU) -> float:
    """C = GPU-hours × 3600 × peak × MFU: what a GPU-hour budget buys in model FLOPs."""
    if gpu_hours <= 0:
        raise ValueError(f"GPU-hours must be > 0, got {gpu_hours:g}")
    if not 0 < mfu <= 1:
        raise ValueError(f"MFU must be in (0, 1], got {mfu:g}")
    return gpu_hours * 3600 * gpu.peak_bf16_flops * mfu


def implied_mfu(compute_flops: float, gpu_hours: float, gpu: Accelerator) -> float:
    """MFU a reported run must have had: C / (GPU-hours · 3600 · peak)."""
    return compute_flops / (gpu_hours * 3600 * gpu.peak_bf16_flops)
