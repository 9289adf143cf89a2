"""Per-step cost of the stability guard, and false alarms on long healthy curves.

Times `check_update` + `observe` (what the training loop adds per step) over a synthetic healthy
run with the default window (128), and counts non-ok verdicts on 3 x 10,000 healthy steps.

  python bench/guard_overhead.py [--steps 10000]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from crucible.api.spec import SpikeGuardSpec
from crucible.trainer.guard import Guard, replay


def healthy(steps: int, seed: int) -> list[tuple[int, float, float]]:
    rng = np.random.default_rng(seed)
    t = np.arange(1, steps + 1)
    loss = (2.0 + 9.0 * (t + 20.0) ** -0.35) * np.exp(rng.normal(0, 0.02, steps))
    grad = (0.4 + 2.0 * (t + 50.0) ** -0.5) * np.exp(rng.normal(0, 0.15, steps))
    return list(zip(t.tolist(), loss.tolist(), grad.tolist()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10_000)
    a = p.parse_args()
    cfg = SpikeGuardSpec()
    guard = Guard(cfg)
    per_step = []
    for step, loss, grad in healthy(a.steps, 0):
        start = time.perf_counter()
        pre = guard.check_update(step, loss, grad)
        guard.observe(step, loss, grad, applied=pre.ok)
        per_step.append(time.perf_counter() - start)
    print(f"guard cost per step (window {cfg.window}): median {1e6 * statistics.median(per_step):.0f} us, "
          f"p99 {1e6 * sorted(per_step)[int(0.99 * len(per_step))]:.0f} us")
    alarms = sum(len(replay([{"step": s, "loss": l, "grad_norm": g} for s, l, g in healthy(a.steps, seed)], cfg))
                 for seed in range(3))
    print(f"false alarms on 3 x {a.steps} healthy steps: {alarms}")


if __name__ == "__main__":
    main()
