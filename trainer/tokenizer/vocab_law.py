"""Tao et al. 2024, "Scaling Laws with Vocabulary" (arXiv 2407.13623, NeurIPS 2024): the
reference the sweep's measurements are compared with.

Owns: their predictors of the compute-optimal vocabulary for a model with N_nv non-vocabulary
parameters, and their fitted tokens-per-character curve. Must not: measure anything (`sweep`).

Coefficients are those of the authors' released code (sail-sg/scaling-with-vocab, read at
optimal_Nv_predict.py @ 8a59af1a, approach2_derivative.py and utils.py @ 3502222b):
- Approach 2, derivative-based (`optimal_Nv_predict.py::approach2_derivative`; the README's
  "fast calculation method"): N_v^opt = 3,145,728 · (N_nv / 33M)^0.8353974, where N_v = V·d counts one
  V×d table. The anchor is the best vocabulary of their 33M model in IsoFLOPs runs; the exponent
  comes from minimising training FLOPs over V at fixed characters (`approach2_derivative.py`).
- Approach 1, IsoFLOPs (`approach1_isoflops`): C = (N_nv / e^-2.4846510)², then
  N_v = e^-1.5890313 · C^0.4163623.
- Tokens per character (`utils.py::D_to_H`): 0.00639222·ln²V − 0.15811069·ln V + 1.20470122,
  V capped at 200K; fitted on their corpus, SlimPajama-627B (experiments/README.md), by
  `fit_tokenization_func.py`.
They fitted on models of 33M to 3B parameters (N_nv of 33M to 2.87B in `approach2_derivative.py`);
outside that range the predictions are extrapolations and `in_fitted_range` says so.
Check values (from running their code; tests/tokenizer/test_sweep.py asserts them): N_nv = 7B,
d = 4096 gives V ≈ 67K by Approach 2; the abstract's "Llama2-70B should have been at least
216K".
"""

from __future__ import annotations

import math

N_NV_ANCHOR = 33_000_000  # their smallest model's non-vocabulary parameters
N_V_ANCHOR = 3_145_728  # its best vocabulary parameters in IsoFLOPs runs (6144 × d=512)
GAMMA = 0.8353974035228025  # N_v ∝ N_nv^γ, from the derivative-based solutions
APPROACH1_LOG_K_NNV = -2.4846510161625193  # N_nv = e^k · C^0.5
APPROACH1_LOG_K_NV, APPROACH1_ALPHA_NV = -1.589031299255507, 0.4163622634135234
TPC_A, TPC_B, TPC_C = 0.00639222, -0.15811069, 1.20470122  # tokens/char = a·ln²V + b·lnV + c
TPC_V_CAP = 200_000
FITTED_N_NV = (33e6, 2.87e9)


def optimal_vocab_params(n_nv: float) -> float:
    """Approach 2: compute-optimal vocabulary parameters N_v = V·d for N_nv."""
    if n_nv <= 0:
        raise ValueError(f"non-vocabulary parameters must be positive, got {n_nv}")
    return N_V_ANCHOR * (n_nv / N_NV_ANCHOR) ** GAMMA


def optimal_vocab_size(n_nv: float, dim: int) -> float:
    """Approach 2's vocabulary size V = N_v / d for a model of width `dim`."""
    return optimal_vocab_params(n_nv) / dim


def approach1_vocab_size(n_nv: float, dim: int) -> float:
    """Approach 1 (IsoFLOPs): V at the compute budget for which N_nv is compute-optimal."""
    flops = (n_nv / math.exp(APPROACH1_LOG_K_NNV)) ** 2
    return math.exp(APPROACH1_LOG_K_NV) * flops ** APPROACH1_ALPHA_NV / dim


def tokens_per_char(vocab_size: float) -> float:
    """Their fitted tokens per character at vocabulary size V (SlimPajama, BPE)."""
    log_v = math.log(min(vocab_size, TPC_V_CAP))
    return TPC_A * log_v**2 + TPC_B * log_v + TPC_C


def in_fitted_range(n_nv: float) -> bool:
    return FITTED_N_NV[0] <= n_nv <= FITTED_N_NV[1]
