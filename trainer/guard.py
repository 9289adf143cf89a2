"""The stability guard: per-step verdicts on loss and gradient norm, each with a readable reason.

Pure and deterministic: it sees only numbers every rank agrees on (the all-reduced loss, the
global gradient norm), so every rank reaches the same verdict without talking, and an offline
replay of a run's metrics (`crucible diagnose`) gives the verdicts the run gave. No torch here.

Statistics are robust z-scores of log loss and log gradient norm against a detrended baseline
of healthy steps (`Baseline`: the level is a short rolling median, the spread the MAD of
residuals over `window` steps); steps inside a spike episode are kept out (unlike llm.c, whose
window also swallows its outliers). Logs make a spike's size relative to the loss level.

Verdicts (defaults in spec.SpikeGuardSpec, with their sources):
  skip       before the update: a non-finite loss or gradient norm, or either beyond z_skip
             (llm.c's outlier detector skips at z > 7): the update is not applied at all;
  transient  a spike (a skipped step, or an applied one beyond z_spike) after which the loss and
             gradient norm were back to normal within `recover_steps`: continue. Most spikes in
             OPT-175B's logbook and in PaLM recovered on their own;
  rollback   the loss stayed elevated for `recover_steps`; the gradient norm stayed above normal
             and kept above where it started for `growth_steps`; the smoothed loss rose
             `divergence` above its best level (slow divergence); or more than `max_skips`
             updates were skipped within `skip_window` steps. The loop reloads a commit at least
             `rollback_margin_steps` before the onset, skips the data seen since (PaLM §5.1:
             ~100 steps back, 200-500 batches skipped) and lowers the LR for a while (OPT-175B);
  abort      `max_rollbacks` rollbacks in a row without getting past the spike's region.
"""

from __future__ import annotations

import json
import math
from collections import deque
from dataclasses import dataclass

import numpy as np

MAD_TO_SIGMA = 1.4826  # the MAD of a normal distribution is 0.6745 sigma
SMOOTH_STEPS = 16      # the divergence rule's smoothing: median of this many applied steps


@dataclass(frozen=True)
class Verdict:
    kind: str  # ok | skip | transient | rollback | abort
    step: int
    reason: str = ""
    onset: int | None = None  # first step of the episode the verdict is about

    @property
    def ok(self) -> bool:
        return self.kind == "ok"


LOG_TINY = math.log(1e-12)   # gradient norms are floored here before their log


@dataclass(frozen=True)
class SkipLimits:
    """A step is skipped when its loss or gradient norm is above these, or either is not
    finite, or the loss is not positive (`skips`)."""

    loss: float
    grad_norm: float


def skips(loss: float, grad_norm: float, limits: SkipLimits) -> bool:
    """The skip rule on plain numbers; the loop computes the same on the device."""
    return (not (math.isfinite(loss) and math.isfinite(grad_norm)) or loss <= 0
            or loss > limits.loss or grad_norm > limits.grad_norm)


def _exp(x: float) -> float:
    return math.exp(x) if x < 709 else math.inf   # past float64's largest exp: no limit


class Baseline:
    """A detrended robust baseline for one signal (log loss or log grad norm) of healthy steps.

    The level is the median of the last `SMOOTH_STEPS` values, so it follows the loss down
    while it falls fast early in training; the spread is the MAD of each value's residual from
    the level at the time, over the last `window` values, so the trend does not widen it (a
    plain rolling median/MAD would let early spikes through)."""

    def __init__(self, window: int, values=(), residuals=()):
        self.values: deque[float] = deque(values, maxlen=SMOOTH_STEPS)
        self.residuals: deque[float] = deque(residuals, maxlen=window)
        self._refresh()

    def __len__(self) -> int:
        return len(self.residuals)

    def _refresh(self) -> None:
        """Recompute the level and spread once per appended value, not once per question."""
        self._level = float(np.median(np.fromiter(self.values, float))) if self.values else 0.0
        resid = np.fromiter(self.residuals, float)
        # `typical` is the level's lag behind a trend, learned from history.
        self._typical = float(np.median(resid)) if len(resid) else 0.0
        spread = float(np.median(np.abs(resid - self._typical))) if len(resid) else 0.0
        # A floor on the spread: a perfectly flat history would make any wiggle infinitely far out.
        self._scale = max(MAD_TO_SIGMA * spread, 1e-3)

    def level(self) -> float:
        return self._level

    def z(self, value: float) -> float:
        return (value - self._level - self._typical) / self._scale

    def bound(self, z: float) -> float:
        """The value whose z-score is `z` (the inverse of `z`)."""
        return self._level + self._typical + z * self._scale

    def append(self, value: float) -> None:
        if len(self.values) >= 4:
            self.residuals.append(value - self._level)
        self.values.append(value)
        self._refresh()


class Guard:
    def __init__(self, cfg):
        """`cfg`: a spec.SpikeGuardSpec (or anything with the same attributes)."""
        self.cfg = cfg
        self.loss = Baseline(cfg.window)     # log loss of healthy steps
        self.grad = Baseline(cfg.window)     # log gradient norm of healthy steps
        self.recent: deque[float] = deque(maxlen=SMOOTH_STEPS)    # log loss, every applied step
        self.best = (math.inf, 0)            # (lowest smoothed log loss, its step)
        self.skips: deque[int] = deque()
        self.episode: dict | None = None     # open spike: onset, peak z, peak loss
        self.grad_streak: tuple[int, float] | None = None  # (first step, log grad) above normal
        self.rollbacks_in_a_row = 0
        self.spike_region_end = -1           # a step past which counts as "got past the spike"

    @property
    def ready(self) -> bool:
        return len(self.loss) >= self.cfg.min_history

    def z_scores(self, loss: float, grad_norm: float) -> tuple[float, float]:
        if not self.ready:
            return 0.0, 0.0
        return self.loss.z(math.log(loss)), self.grad.z(math.log(max(grad_norm, 1e-12)))

    # -- before the update ----------------------------------------------------------------------
    def skip_limits(self) -> SkipLimits:
        """The largest loss and gradient norm the next `check_update` accepts, as plain
        numbers: the training loop hands them to the device, which decides the skip there
        (`skips`) without the host waiting for the step's numbers."""
        if not self.ready:
            return SkipLimits(math.inf, math.inf)
        z = self.cfg.z_skip
        grad_bound = self.grad.bound(z)
        # log(max(g, 1e-12)): below 1e-12 every norm reads as 1e-12, so a bound under that
        # log skips every norm.
        return SkipLimits(_exp(self.loss.bound(z)),
                          _exp(grad_bound) if grad_bound >= LOG_TINY else -math.inf)

    def check_update(self, step: int, loss: float, grad_norm: float) -> Verdict:
        """ok, or skip (do not apply this update), judged before the optimizer step: exactly
        when `skips(loss, grad_norm, self.skip_limits())` is true."""
        if not math.isfinite(loss):
            return Verdict("skip", step, f"non-finite loss ({loss})")
        if not math.isfinite(grad_norm):
            return Verdict("skip", step, f"non-finite gradient norm ({grad_norm})")
        if loss <= 0:
            return Verdict("skip", step, f"loss {loss} is not positive")
        limits = self.skip_limits()
        z_loss, z_grad = self.z_scores(loss, grad_norm)
        if loss > limits.loss:
            return Verdict("skip", step, f"loss {loss:.4g} is {z_loss:.1f} MADs above the recent "
                           f"median (skip beyond {self.cfg.z_skip:g})")
        if grad_norm > limits.grad_norm:
            return Verdict("skip", step, f"gradient norm {grad_norm:.4g} is {z_grad:.1f} MADs "
                           f"above the recent median (skip beyond {self.cfg.z_skip:g})")
        return Verdict("ok", step)

    # -- after the update (or the skip) ---------------------------------------------------------
    def observe(self, step: int, loss: float, grad_norm: float, applied: bool) -> Verdict:
        """Fold in the step's numbers; returns ok or a transient/rollback/abort verdict."""
        cfg = self.cfg
        if not applied:
            self.skips.append(step)
            while self.skips and self.skips[0] <= step - cfg.skip_window:
                self.skips.popleft()
            if self.episode is None:
                self.episode = {"onset": step, "peak": math.inf, "peak_loss": loss}
            if len(self.skips) > cfg.max_skips:
                return self._rollback(step, self.episode["onset"], f"{len(self.skips)} updates "
                                      f"skipped within {cfg.skip_window} steps (more than "
                                      f"{cfg.max_skips})")
            return self._episode_timeout(step, loss)

        z_loss, z_grad = self.z_scores(loss, grad_norm)
        log_loss, log_grad = math.log(loss), math.log(max(grad_norm, 1e-12))
        verdict = self._slow_divergence(step, log_loss) or self._grad_growth(step, z_grad, log_grad)
        if verdict is not None:
            return verdict
        if self.episode is None and self.ready and z_loss > cfg.z_spike:
            self.episode = {"onset": step, "peak": z_loss, "peak_loss": loss}
        if self.episode is not None:
            ep = self.episode
            ep["peak"], ep["peak_loss"] = max(ep["peak"], z_loss), max(ep["peak_loss"], loss)
            if z_loss <= cfg.z_normal and z_grad <= cfg.z_normal:
                self.episode = None
                peak = "" if math.isinf(ep["peak"]) else f" ({ep['peak']:.1f} MADs)"
                return Verdict("transient", step, f"spike at step {ep['onset']} (loss "
                               f"{ep['peak_loss']:.4g}{peak}) was back to normal "
                               f"{step - ep['onset']} step(s) later", ep["onset"])
            return self._episode_timeout(step, loss)
        self.loss.append(log_loss)
        self.grad.append(log_grad)
        if step > self.spike_region_end:
            self.rollbacks_in_a_row = 0
        return Verdict("ok", step)

    def _episode_timeout(self, step: int, loss: float) -> Verdict:
        ep = self.episode
        if ep is not None and step - ep["onset"] >= self.cfg.recover_steps:
            return self._rollback(step, ep["onset"], f"loss still elevated ({loss:.4g}) "
                                  f"{step - ep['onset']} steps after the spike at step "
                                  f"{ep['onset']} (peak {ep['peak_loss']:.4g})")
        return Verdict("ok", step)

    def _slow_divergence(self, step: int, log_loss: float) -> Verdict | None:
        self.recent.append(log_loss)
        if not self.ready or len(self.recent) < SMOOTH_STEPS:
            return None
        smoothed = float(np.median(np.fromiter(self.recent, float)))
        if smoothed < self.best[0]:
            self.best = (smoothed, step)
        rise = math.exp(smoothed - self.best[0]) - 1
        if rise > self.cfg.divergence:
            return self._rollback(step, self.best[1], f"smoothed loss {math.exp(smoothed):.4g} "
                                  f"is {100 * rise:.1f}% above its best ({math.exp(self.best[0]):.4g} "
                                  f"at step {self.best[1]}): slow divergence")
        return None

    def _grad_growth(self, step: int, z_grad: float, log_grad: float) -> Verdict | None:
        if not self.ready or z_grad <= self.cfg.z_normal:
            self.grad_streak = None
            return None
        if self.grad_streak is None:
            self.grad_streak = (step, log_grad)
        first, start = self.grad_streak
        if step - first + 1 >= self.cfg.growth_steps and log_grad > start:
            return self._rollback(step, first, f"gradient norm above normal and growing for "
                                  f"{step - first + 1} steps (now {math.exp(log_grad):.4g}, "
                                  f"{z_grad:.1f} MADs, from {math.exp(start):.4g})")
        return None

    def _rollback(self, step: int, onset: int, reason: str) -> Verdict:
        if self.rollbacks_in_a_row >= self.cfg.max_rollbacks:
            return Verdict("abort", step, f"{reason}; {self.rollbacks_in_a_row} rollback(s) in a "
                           f"row did not get past step {self.spike_region_end} (budget "
                           f"{self.cfg.max_rollbacks})", onset)
        return Verdict("rollback", step, reason, onset)

    def rolled_back(self, verdict: Verdict) -> None:
        """The loop restored an earlier commit because of `verdict`: reset the episode state
        (the healthy history stays: it describes the model the run went back to)."""
        self.rollbacks_in_a_row += 1
        self.spike_region_end = max(self.spike_region_end, verdict.step + self.cfg.recover_steps)
        self.episode, self.grad_streak = None, None
        self.skips.clear()
        self.recent.clear()

    # -- Stateful -------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        # One JSON string: checkpoint loaders (DCP) need the same nested keys at save and load
        # time, and `episode`/`grad_streak` come and go.
        return {"json": json.dumps({
            "loss": [list(self.loss.values), list(self.loss.residuals)],
            "grad": [list(self.grad.values), list(self.grad.residuals)],
            "recent": list(self.recent), "best": list(self.best), "skips": list(self.skips),
            "episode": self.episode, "grad_streak": self.grad_streak,
            "rollbacks_in_a_row": self.rollbacks_in_a_row, "spike_region_end": self.spike_region_end})}

    def load_state_dict(self, state: dict) -> None:
        state = json.loads(state["json"])
        self.loss = Baseline(self.cfg.window, *state["loss"])
        self.grad = Baseline(self.cfg.window, *state["grad"])
        self.recent = deque(state["recent"], maxlen=SMOOTH_STEPS)
        self.best = (float(state["best"][0]), int(state["best"][1]))
        self.skips = deque(int(s) for s in state["skips"])
        self.episode = state["episode"]
        streak = state["grad_streak"]
        self.grad_streak = None if streak is None else (int(streak[0]), float(streak[1]))
        self.rollbacks_in_a_row = int(state["rollbacks_in_a_row"])
        self.spike_region_end = int(state["spike_region_end"])


def replay(records: list[dict], cfg) -> list[Verdict]:
    """The verdicts a run's (step, loss, grad_norm) history gets, as `crucible diagnose` shows
    them. After a rollback verdict the recorded run (which had no guard, or rolled back itself)
    is followed without further verdicts until its numbers are back to normal, so one incident
    gets one verdict."""
    guard = Guard(cfg)
    verdicts: list[Verdict] = []
    incident = False
    for r in records:
        step, loss, grad = int(r["step"]), float(r["loss"]), float(r["grad_norm"])
        if incident:
            finite = math.isfinite(loss) and math.isfinite(grad) and loss > 0
            z_loss, z_grad = guard.z_scores(loss, grad) if finite else (math.inf, math.inf)
            if z_loss > cfg.z_normal or z_grad > cfg.z_normal:
                continue
            incident = False
        pre = guard.check_update(step, loss, grad)
        if not pre.ok:
            verdicts.append(pre)
        post = guard.observe(step, loss, grad, applied=pre.ok)
        if not post.ok:
            verdicts.append(post)
            if post.kind in ("rollback", "abort"):
                guard.rolled_back(post)
                incident = True
    return verdicts
