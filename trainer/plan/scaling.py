"""Scaling laws: how to split a compute budget C between parameters N and tokens D, and the loss
each split predicts.

Owns the fitted constants and closed forms; no I/O, no hardware. Sources:
- Hoffmann et al. 2022, "Training Compute-Optimal Large Language Models" (arXiv 2203.15556):
  C ≈ 6ND (§2); the parametric loss L(N, D) = E + A/N^α + B/D^β (§3.3, eq. 2) and its
  compute-optimal closed form N_opt = G·(C/6)^a, D_opt = G⁻¹·(C/6)^b with
  G = (αA/(βB))^(1/(α+β)), a = β/(α+β), b = α/(α+β) (eq. 4); Table 3 (≈20 tokens/parameter).
- Besiroglu et al. 2024, "Chinchilla Scaling: A replication attempt" (arXiv 2404.10102): the
  refit E = 1.82, A = 482.01, B = 2085.43, α = 0.3478, β = 0.3658 (their Table 1; full-precision
  values from epoch-research/analyzing-chinchilla, data_analysis.ipynb).
- Kaplan et al. 2020, "Scaling Laws for Neural Language Models" (arXiv 2001.08361): exponents
  (§1.2, eqs. 1.1–1.3), compute-efficient size N ∝ C_min^0.73 with N = 1.3e9·C_min^0.73,
  C_min in PF-days (§6.1, Fig. 14).
- Sardana et al. 2024, "Beyond Chinchilla-Optimal" (arXiv 2401.00448): minimise training plus
  inference FLOPs (6N per training token, 2N per inference token) at a fixed loss (§3).

Why the rounded Hoffmann constants mislead (ROUNDING_NOTE below): the body of the Chinchilla
paper prints α = 0.34, β = 0.28, A = 406.4, B = 410.7, E = 1.69. With those, the closed form puts
the optimum at 50–120 tokens per parameter, not the ≈20 that Approaches 1 and 2 (and Chinchilla
itself: 70B on 1.4T) found; the TeX source's unrounded values are less biased but still off, and
Besiroglu et al. show the fit itself had not converged. Their refit reproduces ≈20 tokens/param.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

FLOPS_PER_PARAM_TOKEN = 6.0  # C ≈ 6ND: 2 forward + 4 backward (Kaplan §2.1; Hoffmann §2)
INFERENCE_FLOPS_PER_PARAM_TOKEN = 2.0  # forward only (Sardana et al. 2024, §3)
CHINCHILLA_TOKENS_PER_PARAM = 20.0  # Hoffmann et al. 2022 Table 3 (20.0–21.6) and §4.1 (70B/1.4T)
PF_DAY_FLOP = 1e15 * 86400  # Kaplan's compute unit: 8.64e19 FLOP

ROUNDING_NOTE = (
    "Hoffmann et al. print their parametric fit rounded (α=0.34, β=0.28, A=406.4, B=410.7, "
    "E=1.69). Plugged into the closed form, those give ~50–120 tokens/parameter instead of "
    "the ~20 their other two methods and Chinchilla itself (70B on 1.4T) show. Besiroglu et "
    "al. 2024 (arXiv 2404.10102) found the original fit stopped before converging and refit "
    "it (E=1.82, A=482.01, B=2085.43, α=0.3478, β=0.3658), which agrees with ~20 tokens/param; "
    "the plan uses the refit.")


@dataclass(frozen=True)
class LossFit:
    """L(N, D) = E + A/N^α + B/D^β (Hoffmann et al. 2022, eq. 2); loss in nats/token."""

    name: str
    E: float
    A: float
    B: float
    alpha: float
    beta: float
    source: str

    def loss(self, params: float, tokens: float) -> float:
        _positive(params=params, tokens=tokens)
        return self.E + self.A / params**self.alpha + self.B / tokens**self.beta

    @property
    def a(self) -> float:
        """Exponent of N_opt ∝ C^a (Hoffmann eq. 4)."""
        return self.beta / (self.alpha + self.beta)

    @property
    def b(self) -> float:
        """Exponent of D_opt ∝ C^b."""
        return self.alpha / (self.alpha + self.beta)

    @property
    def G(self) -> float:
        return (self.alpha * self.A / (self.beta * self.B)) ** (1 / (self.alpha + self.beta))

    def optimum(self, compute_flops: float) -> "Allocation":
        """Compute-optimal N and D for C under C = 6ND (Hoffmann eq. 4)."""
        _positive(compute=compute_flops)
        n = self.G * (compute_flops / FLOPS_PER_PARAM_TOKEN) ** self.a
        d = compute_flops / (FLOPS_PER_PARAM_TOKEN * n)  # = G⁻¹·(C/6)^b exactly
        return Allocation(f"{self.name} optimum", n, d, compute_flops, self.loss(n, d),
                          f"hoffmann-eq4-closed-form[{self.name}]")

    def compute_for_params(self, params: float) -> float:
        """The budget C whose optimum is a model of `params` parameters (eq. 4 inverted)."""
        _positive(params=params)
        return FLOPS_PER_PARAM_TOKEN * (params / self.G) ** (1 / self.a)

    def compute_for_tokens(self, tokens: float) -> float:
        """The budget C whose optimum trains on `tokens` tokens (eq. 4 inverted)."""
        _positive(tokens=tokens)
        return FLOPS_PER_PARAM_TOKEN * (tokens * self.G) ** (1 / self.b)

    def compute_for_loss(self, loss: float) -> float:
        """Least C whose compute-optimal run reaches `loss` (bisection on log C; the optimal
        loss falls monotonically with C). Infinite if the loss is at or below E."""
        if loss <= self.E:
            return math.inf
        lo, hi = 1.0, 1e40
        if self.optimum(hi).loss > loss:
            return math.inf
        for _ in range(200):
            mid = math.sqrt(lo * hi)
            if self.optimum(mid).loss > loss:
                lo = mid
            else:
                hi = mid
        return hi


# Hoffmann et al. 2022 §3.3 / App. D.2 as printed in the paper body (rounded).
HOFFMANN_ROUNDED = LossFit("hoffmann-rounded", 1.69, 406.4, 410.7, 0.34, 0.28,
                           "Hoffmann et al. 2022, eq. 10 as printed (rounded)")
# The same fit unrounded, from the paper's TeX source (ln A, ln B, ln E = 6.0073404, 6.0179186,
# 0.5267228), as read by epoch-research/analyzing-chinchilla, data_analysis.ipynb.
HOFFMANN_UNROUNDED = LossFit("hoffmann-unrounded", math.exp(0.5267228), math.exp(6.0073404),
                             math.exp(6.0179186), 0.33917084, 0.2849083,
                             "Hoffmann et al. 2022, TeX source values")
# Besiroglu et al. 2024 Table 1 refit; full precision from their notebook's best fit
# (ln A, ln B, ln E = 6.17795598, 7.64273236, 0.59711196).
BESIROGLU = LossFit("besiroglu-2024", math.exp(0.59711196), math.exp(6.17795598),
                    math.exp(7.64273236), 0.34781303, 0.36585412,
                    "Besiroglu et al. 2024, Table 1 (refit of Hoffmann Approach 3)")
FITS = {fit.name: fit for fit in (BESIROGLU, HOFFMANN_UNROUNDED, HOFFMANN_ROUNDED)}


@dataclass(frozen=True)
class Allocation:
    """One way to spend a budget: N parameters on D tokens, and the loss the fit predicts."""

    name: str
    params: float
    tokens: float
    compute_flops: float
    loss: float
    formula: str

    @property
    def tokens_per_param(self) -> float:
        return self.tokens / self.params


def chinchilla_rule(compute_flops: float, fit: LossFit = BESIROGLU,
                    tokens_per_param: float = CHINCHILLA_TOKENS_PER_PARAM) -> Allocation:
    """D = 20·N with C = 6ND, so N = sqrt(C / (6·20)) (Hoffmann et al. 2022, Table 3)."""
    _positive(compute=compute_flops)
    n = math.sqrt(compute_flops / (FLOPS_PER_PARAM_TOKEN * tokens_per_param))
    d = tokens_per_param * n
    return Allocation(f"{tokens_per_param:g} tokens/param", n, d, compute_flops, fit.loss(n, d),
                      "chinchilla-20-tokens-per-param")


# Kaplan et al. 2020, §1.2 eqs. 1.1–1.3 (Table 5 in the appendix repeats them).
KAPLAN_ALPHA_N = 0.076  # L(N) = (N_c/N)^α_N, N non-embedding
KAPLAN_N_C = 8.8e13
KAPLAN_ALPHA_D = 0.095  # L(D) = (D_c/D)^α_D
KAPLAN_D_C = 5.4e13
KAPLAN_ALPHA_C_MIN = 0.050  # L(C_min) = (C_c^min/C_min)^α_C^min, C_min in PF-days
KAPLAN_C_C_MIN_PF_DAYS = 3.1e8
# §6.1, Fig. 14: N(C_min) = 1.3e9 · C_min^0.73 (C_min in PF-days; N non-embedding).
KAPLAN_N_COEF = 1.3e9
KAPLAN_N_EXP = 0.73


def kaplan_allocation(compute_flops: float, fit: LossFit = BESIROGLU) -> Allocation:
    """Kaplan's compute-efficient size N = 1.3e9·(C/PF-day)^0.73 (§6.1, Fig. 14), D = C/(6N).

    Kaplan's own D_opt = 2e10·C^0.27 does not satisfy 6ND = C (their C_min is defined at the
    critical batch; training at it costs 2·C_min, §6.3), so the budget is spent as D = C/(6N).
    Kaplan's N excludes embeddings; it is used here as the total, which flatters Kaplan a little.
    The loss is the Chinchilla-form fit's, so all allocations are judged by the same yardstick.
    """
    _positive(compute=compute_flops)
    n = KAPLAN_N_COEF * (compute_flops / PF_DAY_FLOP) ** KAPLAN_N_EXP
    d = compute_flops / (FLOPS_PER_PARAM_TOKEN * n)
    return Allocation("Kaplan 2020", n, d, compute_flops, fit.loss(n, d), "kaplan-2020-eq6.1")


def kaplan_loss_from_params(non_embedding_params: float) -> float:
    """L(N) = (N_c/N)^α_N in nats on WebText2 (Kaplan eq. 1.1); not comparable with Chinchilla."""
    _positive(params=non_embedding_params)
    return (KAPLAN_N_C / non_embedding_params) ** KAPLAN_ALPHA_N


@dataclass(frozen=True)
class Waste:
    """Compute an allocation spends beyond what the optimal split needs for the same loss."""

    used_flops: float
    needed_flops: float

    @property
    def wasted_flops(self) -> float:
        return max(0.0, self.used_flops - self.needed_flops)

    @property
    def wasted_fraction(self) -> float:
        return self.wasted_flops / self.used_flops


def waste(allocation: Allocation, fit: LossFit = BESIROGLU) -> Waste:
    """How much less compute the fit's optimum needs to reach the allocation's loss."""
    needed = fit.compute_for_loss(fit.loss(allocation.params, allocation.tokens))
    used = FLOPS_PER_PARAM_TOKEN * allocation.params * allocation.tokens
    if needed > used * (1 - 1e-9):  # the allocation is the optimum, up to bisection rounding
        needed = used
    return Waste(used, needed)


@dataclass(frozen=True)
class InferenceAware:
    """Sardana et al. 2024: the N, D that reach `loss` with the least training + inference FLOPs."""

    params: float
    tokens: float
    loss: float
    inference_tokens: float
    training_flops: float
    inference_flops: float

    @property
    def total_flops(self) -> float:
        return self.training_flops + self.inference_flops

    @property
    def tokens_per_param(self) -> float:
        return self.tokens / self.params


def tokens_for_loss(fit: LossFit, params: float, loss: float) -> float:
    """D that brings a model of N parameters to `loss`: solve the fit for D (inf if unreachable)."""
    gap = loss - fit.E - fit.A / params**fit.alpha
    if gap <= 0:
        return math.inf
    return (fit.B / gap) ** (1 / fit.beta)


def inference_aware(fit: LossFit, loss: float, inference_tokens: float) -> InferenceAware:
    """Minimise 6·N·D(N) + 2·N·D_inf over N with L(N, D(N)) = loss (Sardana et al. 2024, §3).

    The objective goes to infinity at the smallest N that can reach the loss (D → ∞) and grows
    linearly in N for large N, with one minimum between; ternary search on log N finds it.
    """
    if inference_tokens < 0:
        raise ValueError(f"inference tokens must be >= 0, got {inference_tokens:g}")
    if loss <= fit.E:
        raise ValueError(f"loss {loss:.3f} is at or below the fit's irreducible loss E={fit.E:.3f}")
    n_min = (fit.A / (loss - fit.E)) ** (1 / fit.alpha)

    def total(log_n: float) -> float:
        n = math.exp(log_n)
        d = tokens_for_loss(fit, n, loss)
        return FLOPS_PER_PARAM_TOKEN * n * d + INFERENCE_FLOPS_PER_PARAM_TOKEN * n * inference_tokens

    lo, hi = math.log(n_min) + 1e-9, math.log(n_min) + 25.0
    for _ in range(300):
        m1, m2 = lo + (hi - lo) / 3, hi - (hi - lo) / 3
        if total(m1) < total(m2):
            hi = m2
        else:
            lo = m1
    n = math.exp((lo + hi) / 2)
    d = tokens_for_loss(fit, n, loss)
    return InferenceAware(n, d, loss, inference_tokens, FLOPS_PER_PARAM_TOKEN * n * d,
                          INFERENCE_FLOPS_PER_PARAM_TOKEN * n * inference_tokens)


def _positive(**values: float) -> None:
    for name, value in values.items():
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"{name} must be a positive finite number, got {value!r}")
