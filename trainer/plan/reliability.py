"""Checkpoint interval from the failure rate: Young's and Daly's optima, lost work, goodput.

Owns the failure model only (exponential inter-failure times, as both papers assume); it knows
nothing of storage or Kubernetes. Sources:
- Young 1974, "A first order approximation to the optimum checkpoint interval", CACM 17(9):
  T_opt = sqrt(2·δ·M) for save time δ and mean time between failures M.
- Daly 2006, "A higher order estimate of the optimum checkpoint interval for restart dumps",
  Future Generation Computer Systems 22(3): wall time of a job of solve time T_s with compute
  interval τ, save time δ and restart time R: T_w = M·e^(R/M)·(e^((τ+δ)/M) − 1)·T_s/τ, and the
  optimum τ = sqrt(2δM)·[1 + (1/3)·sqrt(δ/(2M)) + (1/9)·(δ/(2M))] − δ for δ < 2M, else τ = M.
- Default failure rate when the cluster's MTBF is unknown: Llama 3 (Dubey et al. 2024, §3.3.4,
  Table 5) saw 419 unexpected interruptions in a 54-day snapshot on 16,384 H100 GPUs, i.e. one
  per 54·24·16384/419 ≈ 50,700 GPU-hours; a job on G GPUs fails every ≈ 50,700/G hours.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Llama 3 §3.3.4 / Table 5: 419 unexpected interruptions, 54 days, 16,384 GPUs.
LLAMA3_GPU_HOURS_PER_FAILURE = 54 * 24 * 16384 / 419


def job_mtbf_s(gpus: int, gpu_hours_per_failure: float = LLAMA3_GPU_HOURS_PER_FAILURE) -> float:
    """Mean time between job-stopping failures for `gpus` GPUs, assuming independent failures."""
    if gpus < 1:
        raise ValueError(f"gpus must be >= 1, got {gpus}")
    return gpu_hours_per_failure * 3600 / gpus


def young_interval_s(save_s: float, mtbf_s: float) -> float:
    """Young 1974: T_opt = sqrt(2·δ·M)."""
    _check(save_s=save_s, mtbf_s=mtbf_s)
    return math.sqrt(2 * save_s * mtbf_s)


def daly_interval_s(save_s: float, mtbf_s: float) -> float:
    """Daly 2006 higher-order optimum (compute time between saves, excluding the save)."""
    _check(save_s=save_s, mtbf_s=mtbf_s)
    if save_s >= 2 * mtbf_s:
        return mtbf_s
    x = save_s / (2 * mtbf_s)
    return math.sqrt(2 * save_s * mtbf_s) * (1 + math.sqrt(x) / 3 + x / 9) - save_s


def daly_wall_time_s(solve_s: float, interval_s: float, save_s: float, mtbf_s: float,
                     restart_s: float = 0.0) -> float:
    """Daly 2006: expected wall time T_w = M·e^(R/M)·(e^((τ+δ)/M) − 1)·T_s/τ."""
    _check(solve_s=solve_s, interval_s=interval_s, mtbf_s=mtbf_s)
    if save_s < 0 or restart_s < 0:
        raise ValueError("save and restart times must be >= 0")
    m = mtbf_s
    return m * math.exp(restart_s / m) * math.expm1((interval_s + save_s) / m) * solve_s / interval_s


@dataclass(frozen=True)
class CheckpointPlan:
    """Interval and what it costs: saves, expected failures, lost work and goodput."""

    save_s: float
    restart_s: float
    mtbf_s: float
    solve_s: float
    young_s: float
    daly_s: float
    interval_s: float  # the one judged below (Daly's optimum unless one was given)
    wall_s: float
    expected_failures: float
    lost_work_per_failure_s: float

    @property
    def goodput(self) -> float:
        """Share of wall time that produced kept progress: T_s / T_w."""
        return self.solve_s / self.wall_s

    @property
    def save_overhead_fraction(self) -> float:
        return self.save_s / (self.interval_s + self.save_s)


def plan_checkpoints(solve_s: float, save_s: float, mtbf_s: float, restart_s: float = 0.0,
                     interval_s: float | None = None) -> CheckpointPlan:
    """Judge `interval_s` (default: Daly's optimum) for a job of `solve_s` failure-free seconds.

    Lost work per failure is, to first order, half an interval plus the save in flight
    ((τ+δ)/2, Young 1974 §2) plus the restart.
    """
    young = young_interval_s(save_s, mtbf_s)
    daly = daly_interval_s(save_s, mtbf_s)
    tau = daly if interval_s is None else interval_s
    wall = daly_wall_time_s(solve_s, tau, save_s, mtbf_s, restart_s)
    return CheckpointPlan(save_s, restart_s, mtbf_s, solve_s, young, daly, tau, wall,
                          wall / mtbf_s, (tau + save_s) / 2 + restart_s)


def _check(**values: float) -> None:
    for name, value in values.items():
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"{name} must be a positive finite number, got {value!r}")
