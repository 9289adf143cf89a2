"""The vocabulary-size sweep: train several sizes, measure them on held-out text, cost them for
the planned model, and recommend one with its reasons.

Owns: `run_sweep` (training and measuring each size), `model_cost` and `recommend` (pure).
Must not: print or plot (`sweep_report`), read inputs (`documents`).

What a size costs the planned model (api/arch.py, the same counts the trainer and planner use):
- embedding + output parameters: V·d for tied embeddings (×2 untied), and their share of all
  parameters;
- training compute per byte of text = FLOPs per token / bytes per token, with FLOPs per token
  6·(N_blocks + V·d) + 12·L·d·T (PaLM App. B): a larger V makes every token dearer (output
  layer) but needs fewer tokens per byte.

The rule (`recommend`). Among sizes the trainer fully realised (one that stopped short has run
out of text to learn from), take the one with the least compute per byte: that is the criterion
of Tao et al. 2024's Approach 2 (minimise FLOPs over V at a fixed amount of text;
sail-sg/scaling-with-vocab approach2_derivative.py) evaluated with this corpus's measured
compression and this model's exact FLOPs instead of their fitted curve. Sizes within two paired
standard errors of that minimum (`compression.paired_ratio_se`; 2 ≈ the 95% normal quantile)
cannot be told apart by this held-out set; among those, take the one nearest (in log V) to Tao
et al.'s predicted loss-optimal size, since at equal compute they find loss improves toward it.
"""

from __future__ import annotations

import math
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Sequence

from crucible.api.arch import (GPTConfig, embedding_params, flops_per_token, non_embedding_params,
                               param_count)
from crucible.trainer.tokenizer import trainers, vocab_law
from crucible.trainer.tokenizer.codec import open_codec
from crucible.trainer.tokenizer.compression import Compression, measure, paired_ratio_se
from crucible.trainer.tokenizer.metadata import read_metadata

# 4K…128K in powers of two (each a multiple of 128): a small model's size up to Llama 3's 128,256.
DEFAULT_SIZES = (4096, 8192, 16384, 32768, 65536, 131072)
Z_BAND = 2.0  # two standard errors: ≈ the 95% two-sided normal quantile (1.96)


@dataclass(frozen=True)
class ModelCost:
    """The planned model at one vocabulary size."""

    vocab_size: int
    params: int
    embedding_params: int
    embedding_share: float
    flops_per_token: float
    flops_per_byte: float


def model_cost(cfg: GPTConfig, vocab_size: int, bytes_per_token: float) -> ModelCost:
    """Parameters, embedding share and training FLOPs per byte of text at `vocab_size`."""
    sized = replace(cfg, vocab_size=vocab_size)
    params, emb = param_count(sized), embedding_params(sized)
    fpt = flops_per_token(sized)
    return ModelCost(vocab_size, params, emb, emb / params, fpt, fpt / bytes_per_token)


@dataclass(frozen=True)
class SweepPoint:
    requested: int
    vocab: dict  # VocabSize.to_dict(): target, learned, reserved, realised, stopped_short
    tokenizer: str
    train_s: float
    compression: Compression
    cost: ModelCost

    @property
    def vocab_size(self) -> int:
        return self.vocab["realised"]

    @property
    def stopped_short(self) -> bool:
        return bool(self.vocab["stopped_short"])


@dataclass(frozen=True)
class Recommendation:
    vocab_size: int
    tokenizer: str
    band: tuple[int, ...]  # sizes indistinguishable from the compute-per-byte minimum
    reasons: tuple[str, ...]


@dataclass(frozen=True)
class Reference:
    """Tao et al. 2024's predictions for the planned model."""

    non_vocab_params: int
    dim: int
    approach2_vocab: float
    approach1_vocab: float
    in_fitted_range: bool


@dataclass
class SweepResult:
    kind: str
    model_name: str
    model: GPTConfig
    points: list[SweepPoint]
    reference: Reference
    recommendation: Recommendation
    corpus: dict = field(default_factory=dict)


def reference_for(cfg: GPTConfig) -> Reference:
    n_nv = non_embedding_params(cfg)
    return Reference(n_nv, cfg.dim, vocab_law.optimal_vocab_size(n_nv, cfg.dim),
                     vocab_law.approach1_vocab_size(n_nv, cfg.dim),
                     vocab_law.in_fitted_range(n_nv))


def recommend(points: Sequence[SweepPoint], reference_vocab: float,
              z: float = Z_BAND) -> Recommendation:
    """Pick a size by the rule in the module docstring; the reasons carry the numbers."""
    if not points:
        raise ValueError("no sweep points to recommend from")
    reasons: list[str] = []
    full = [p for p in points if not p.stopped_short]
    short = [p for p in points if p.stopped_short]
    if short:
        reasons.append("left out, the trainer stopped short (too little text for that many "
                       "tokens): " + ", ".join(f"{p.requested:,} -> {p.vocab_size:,}"
                                               for p in short))
    candidates = full or list(points)
    if not full:
        reasons.append("every size stopped short; comparing them anyway: give the sweep more text")
    best = min(candidates, key=lambda p: p.cost.flops_per_byte)
    reasons.append(f"least training compute per byte: V = {best.vocab_size:,} at "
                   f"{best.cost.flops_per_byte / 1e9:.3f} GFLOP/byte "
                   f"({best.compression.bytes_per_token:.3f} bytes/token)")
    band = []
    for p in candidates:
        ratio = p.cost.flops_per_byte / best.cost.flops_per_byte
        se = (p.cost.flops_per_token / best.cost.flops_per_token) * paired_ratio_se(
            p.compression.doc_tokens, best.compression.doc_tokens)
        if p is best or (math.isfinite(se) and ratio - 1 <= z * se):
            band.append(p)
    chosen = min(band, key=lambda p: abs(math.log(p.vocab_size / reference_vocab)))

    def above(p: SweepPoint, ref: SweepPoint) -> float:
        return 100 * (p.cost.flops_per_byte / ref.cost.flops_per_byte - 1)

    if len(band) > 1:
        reasons.append(f"within {z:.0f} paired standard errors of that minimum (not "
                       "distinguishable on this held-out text): "
                       + ", ".join(f"{p.vocab_size:,} (+{above(p, best):.2f}%)" for p in band))
        reasons.append(f"of those, nearest Tao et al. 2024's loss-optimal size for this model "
                       f"(~{reference_vocab:,.0f}): V = {chosen.vocab_size:,}")
    else:
        reasons.append(f"no other size is within {z:.0f} paired standard errors of it")
    others = sorted(candidates, key=lambda p: p.vocab_size)
    deltas = [f"{p.vocab_size:,}: {above(p, chosen):+.1f}%" for p in others if p is not chosen]
    if deltas:
        reasons.append("compute per byte of the others relative to it: " + ", ".join(deltas))
    reasons.append(f"embedding + output parameters: {chosen.cost.embedding_params / 1e6:,.1f}M = "
                   f"{100 * chosen.cost.embedding_share:.1f}% of the model's "
                   f"{chosen.cost.params / 1e6:,.1f}M")
    return Recommendation(chosen.vocab_size, chosen.tokenizer, tuple(p.vocab_size for p in band),
                          tuple(reasons))


def run_sweep(train_docs: Sequence[str], held_docs: Sequence[str], sizes: Sequence[int],
              model: GPTConfig, *, model_name: str = "", kind: str = trainers.DEFAULT_KIND,
              out_dir: str | Path | None = None, min_frequency: int | None = None,
              on_point: Callable[[SweepPoint], None] | None = None) -> SweepResult:
    """Train one tokenizer per size on `train_docs` into out_dir/v<size>/, measure each on
    `held_docs` at the model's context length, cost it, and recommend a size."""
    if not sizes:
        raise ValueError("give at least one vocabulary size")
    if not train_docs or not held_docs:
        raise ValueError("the sweep needs training and held-out documents; got "
                         f"{len(train_docs)} and {len(held_docs)}")
    out = Path(out_dir) if out_dir else Path(tempfile.mkdtemp(prefix="crucible-sweep-"))
    points = []
    for size in sorted(set(sizes)):
        start = time.perf_counter()
        path = trainers.train(kind, train_docs, size, out / f"v{size}",
                              min_frequency=min_frequency)
        train_s = time.perf_counter() - start
        vocab = read_metadata(path)["vocab"]
        compression = measure(open_codec(path), held_docs, model.seq_len)
        point = SweepPoint(size, vocab, str(path), train_s, compression,
                           model_cost(model, vocab["realised"], compression.bytes_per_token))
        points.append(point)
        if on_point:
            on_point(point)
    reference = reference_for(model)
    corpus = {"train_documents": len(train_docs),
              "train_bytes": sum(len(t.encode("utf-8", "surrogatepass")) for t in train_docs),
              "held_out_documents": len(held_docs),
              "held_out_bytes": sum(len(t.encode("utf-8", "surrogatepass")) for t in held_docs)}
    return SweepResult(kind, model_name, model, points, reference,
                       recommend(points, reference.approach2_vocab), corpus)
