"""Training strategy: pretrain vs continued pretraining vs fine-tuning, costed side by side, a
recommendation, and what would flip it (`crucible decide`).

Owns the recommendation rule and its thresholds; FLOP and money arithmetic come from `scaling`
and `cost`. Pure: `recommend(Task) -> Recommendation`. Sources for the rule:
- cost of each option is 6·N·D (Kaplan et al. 2020 §2.1; Hoffmann et al. 2022 §2) with D that
  option's tokens; LoRA skips weight gradients of the frozen matrices, ≈4·N·D (forward 2N +
  activation gradients 2N); Hu et al. 2021 (arXiv 2106.09685) §4.2 report 25% faster training
  than full fine-tuning on GPT-3 175B and 3× less GPU memory;
- pretraining from scratch at Chinchilla's ≈20 tokens/parameter (Hoffmann et al. 2022 Table 3);
  open web text is not the limit up to ~15T tokens (FineWeb, Penedo et al. 2024);
- continued pretraining with LR re-warming, re-decaying and replay of earlier data matches
  retraining from scratch on all data at a fraction of the compute (Ibrahim et al. 2024, arXiv
  2403.08763); domain-adaptive pretraining on a few billion in-domain tokens helps in both high-
  and low-resource tasks (Gururangan et al. 2020, "Don't Stop Pretraining", §3);
- a small, clean instruction set is enough to adapt behaviour (LIMA, Zhou et al. 2023: 1,000
  examples), so small data means fine-tuning.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from crucible.trainer.plan import scaling

Distance = Literal["near", "mid", "far"]
DISTANCES: tuple[Distance, ...] = ("near", "mid", "far")
Option = Literal["pretrain", "continued-pretraining", "fine-tune", "lora"]

# Below this many in-domain tokens, continued pretraining has too little to learn from: DAPT
# corpora are billions of tokens (Gururangan et al. 2020 Table 1); instruction sets are millions.
CPT_MIN_TOKENS = 1e8
# Share of earlier (general) data replayed during continued pretraining. A stated assumption in
# the range Ibrahim et al. 2024 study (they find small replay shares suffice for weak shifts and
# larger ones are needed for stronger shifts such as English→German).
REPLAY_SHARE = {"near": 0.05, "mid": 0.05, "far": 0.25}
FINE_TUNE_EPOCHS = 2  # stated assumption: a few passes over a small task set
LORA_FLOPS_PER_PARAM_TOKEN = 4.0  # forward 2N + activation gradients 2N, no weight gradients


@dataclass(frozen=True)
class Task:
    task_tokens: float  # in-domain tokens available
    distance: Distance  # how far the domain is from what open base models saw
    base_params: float = 0.0  # best base model whose licence allows this use; 0: none
    base_license_ok: bool = True
    target_params: float | None = None  # model size if pretraining (default: the base's)
    budget_flops: float | None = None  # None: unconstrained

    def __post_init__(self):
        if not (self.task_tokens > 0 and math.isfinite(self.task_tokens)):
            raise ValueError(f"in-domain tokens must be > 0, got {self.task_tokens!r}")
        if self.distance not in DISTANCES:
            raise ValueError(f"domain distance must be one of {DISTANCES}, got {self.distance!r}")
        if self.base_params < 0:
            raise ValueError(f"base model parameters must be >= 0, got {self.base_params:g}")
        if self.budget_flops is not None and self.budget_flops <= 0:
            raise ValueError(f"budget must be > 0 FLOP, got {self.budget_flops:g}")
        if self.target_params is not None and self.target_params <= 0:
            raise ValueError(f"target parameters must be > 0, got {self.target_params:g}")
        if not self.base_params and not self.target_params and not self.budget_flops:
            raise ValueError("with no usable base model, give --target-params or a budget to "
                             "size a model to pretrain")

    @property
    def usable_base(self) -> bool:
        return self.base_params > 0 and self.base_license_ok


@dataclass(frozen=True)
class Costed:
    option: Option
    params: float
    tokens: float
    compute_flops: float
    formula: str
    affordable: bool


@dataclass(frozen=True)
class Recommendation:
    choice: Option
    reasons: tuple[str, ...]
    options: tuple[Costed, ...]
    flips: tuple[str, ...]


def _pretrain_size(task: Task) -> float:
    if task.target_params:
        return task.target_params
    if task.base_params:
        return task.base_params  # the size the (possibly unusable) base shows is wanted
    return scaling.chinchilla_rule(task.budget_flops).params


def cost_options(task: Task) -> tuple[Costed, ...]:
    budget = task.budget_flops or math.inf
    n_pre = _pretrain_size(task)
    d_pre = scaling.CHINCHILLA_TOKENS_PER_PARAM * n_pre
    six = scaling.FLOPS_PER_PARAM_TOKEN
    out = [Costed("pretrain", n_pre, d_pre, six * n_pre * d_pre,
                  "6·N·20N (Chinchilla Table 3), in-domain tokens mixed in",
                  six * n_pre * d_pre <= budget)]
    if task.usable_base:
        n = task.base_params
        d_cpt = task.task_tokens * (1 + REPLAY_SHARE[task.distance])
        d_ft = task.task_tokens * FINE_TUNE_EPOCHS
        out += [
            Costed("continued-pretraining", n, d_cpt, six * n * d_cpt,
                   f"6·N·D_task·(1 + {REPLAY_SHARE[task.distance]:.0%} replay)",
                   six * n * d_cpt <= budget),
            Costed("fine-tune", n, d_ft, six * n * d_ft, f"6·N·D_task·{FINE_TUNE_EPOCHS} epochs",
                   six * n * d_ft <= budget),
            Costed("lora", n, d_ft, LORA_FLOPS_PER_PARAM_TOKEN * n * d_ft,
                   f"4·N·D_task·{FINE_TUNE_EPOCHS} epochs (no weight gradients)",
                   LORA_FLOPS_PER_PARAM_TOKEN * n * d_ft <= budget),
        ]
    return tuple(out)


def recommend(task: Task) -> Recommendation:
    options = cost_options(task)
    by = {c.option: c for c in options}
    pre = by["pretrain"]
    flips: list[str] = []
    if not task.usable_base:
        why = ("no base model is available" if task.base_params == 0 else
               "the base model's licence does not allow this use")
        reasons = [f"{why}, so the model must be pretrained",
                   f"pretraining {pre.params:.3g} parameters on {pre.tokens:.3g} tokens costs "
                   f"{pre.compute_flops:.3g} FLOP"]
        if not pre.affordable:
            fit = scaling.chinchilla_rule(task.budget_flops)
            reasons.append(f"that exceeds the budget; the budget trains {fit.params:.3g} "
                           f"parameters on {fit.tokens:.3g} tokens compute-optimally")
        flips.append("a base model with a licence that allows this use makes continued "
                     "pretraining or fine-tuning far cheaper")
        return Recommendation("pretrain", tuple(reasons), options, tuple(flips))

    n, d = task.base_params, task.task_tokens
    cpt, ft, lora = by["continued-pretraining"], by["fine-tune"], by["lora"]
    enough_for_scratch = d >= scaling.CHINCHILLA_TOKENS_PER_PARAM * pre.params
    reasons: list[str] = []
    if task.distance == "far" and enough_for_scratch and pre.affordable:
        choice: Option = "pretrain"
        reasons += [f"{d:.3g} in-domain tokens are enough to train {pre.params:.3g} parameters "
                    "compute-optimally (≥20 tokens/parameter) on the domain alone",
                    "the domain is far from the base model's data, so little of it transfers"]
    elif d >= CPT_MIN_TOKENS and task.distance in ("mid", "far") and cpt.affordable:
        choice = "continued-pretraining"
        reasons += [f"{d:.3g} in-domain tokens is corpus-scale (≥{CPT_MIN_TOKENS:.0e}), enough to "
                    "shift the base model's distribution (Gururangan et al. 2020)",
                    "re-warm and re-decay the LR and replay some general data to avoid forgetting "
                    "(Ibrahim et al. 2024); follow with a short fine-tune for the task format",
                    f"costs {cpt.compute_flops / pre.compute_flops:.1%} of pretraining a model "
                    "this size"]
    elif ft.affordable:
        choice = "fine-tune"
        reasons.append("the domain is close to the base model's data or the data is small: "
                       "fine-tuning adapts behaviour without re-learning the language (LIMA)"
                       if task.distance == "near" or d < CPT_MIN_TOKENS else
                       "continued pretraining does not fit the budget; full fine-tuning does")
        reasons.append(f"costs {ft.compute_flops:.3g} FLOP")
    elif lora.affordable:
        choice = "lora"
        reasons += ["full fine-tuning does not fit the budget; LoRA trains adapters only",
                    "≈2/3 of the FLOPs and ≈1/3 of the memory of full fine-tuning (Hu et al. 2021)"]
    else:
        choice = "lora"
        reasons += ["no option fits the budget; LoRA on a subset of the data is the cheapest start",
                    f"LoRA on all the data needs {lora.compute_flops:.3g} FLOP"]

    # What would flip it.
    scratch_tokens = scaling.CHINCHILLA_TOKENS_PER_PARAM * pre.params
    if choice != "pretrain":
        flips.append(f"with a far domain, ≥{scratch_tokens:.3g} in-domain tokens and a budget of "
                     f"≥{pre.compute_flops:.3g} FLOP, pretraining from scratch wins")
        flips.append("if the base model's licence does not allow this use, pretraining is the "
                     "only option")
    if choice in ("fine-tune", "lora") and task.distance != "near":
        flips.append(f"with ≥{CPT_MIN_TOKENS:.0e} in-domain tokens and ≥{cpt.compute_flops:.3g} "
                     "FLOP, continued pretraining wins")
    if choice in ("continued-pretraining", "pretrain"):
        flips.append(f"with fewer than {CPT_MIN_TOKENS:.0e} in-domain tokens, or a domain close "
                     "to the base's, fine-tuning is enough")
    if choice == "continued-pretraining":
        flips.append(f"with a budget below {cpt.compute_flops:.3g} FLOP, fine-tune instead "
                     f"({ft.compute_flops:.3g} FLOP; LoRA {lora.compute_flops:.3g})")
    if choice == "fine-tune":
        flips.append(f"with a budget below {ft.compute_flops:.3g} FLOP, use LoRA "
                     f"({lora.compute_flops:.3g} FLOP)")
    return Recommendation(choice, tuple(reasons), options, tuple(flips))
