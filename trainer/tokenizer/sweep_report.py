"""How a sweep is shown: a table with the recommendation and its reasons, a PNG plot, JSON.

Owns: rendering a `SweepResult`. Must not: compute anything the sweep did not (the numbers come
from `sweep`; Tao et al.'s curves from `vocab_law`).

The plot has four panels against vocabulary size (log scale): held-out bytes per token with Tao
et al.'s fitted characters-per-token curve as a reference line (their corpus, not ours: the
shape is the comparison); training compute per byte for the planned model, with the minimum,
the recommendation and Tao et al.'s predicted optimum marked; the embedding + output share of
parameters; and the share of held-out documents that fit in one context window.
"""

from __future__ import annotations

import json
from pathlib import Path

from crucible.trainer.tokenizer import vocab_law
from crucible.trainer.tokenizer.sweep import SweepResult


def to_dict(result: SweepResult) -> dict:
    return {
        "kind": result.kind,
        "model": {"name": result.model_name, **result.model.to_dict()},
        "corpus": result.corpus,
        "points": [{"requested": p.requested, "vocab": p.vocab, "tokenizer": p.tokenizer,
                    "train_s": round(p.train_s, 3), "compression": p.compression.to_dict(),
                    "cost": p.cost.__dict__} for p in result.points],
        "reference_tao2024": result.reference.__dict__,
        "recommendation": {"vocab_size": result.recommendation.vocab_size,
                           "tokenizer": result.recommendation.tokenizer,
                           "band": list(result.recommendation.band),
                           "reasons": list(result.recommendation.reasons)},
    }


def write_json(result: SweepResult, path: str | Path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(to_dict(result), indent=2) + "\n")
    return path


def print_table(result: SweepResult, console=None) -> None:
    """The sweep as a rich table, then the recommendation and its reasons."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=max(132, Console().width))  # 11 columns need the room
    m, ref = result.model, result.reference
    title = (f"vocabulary sweep ({result.kind}) for {result.model_name or 'the model'}: "
             f"d={m.dim}, L={m.layers}, T={m.seq_len}, "
             f"{'tied' if m.tied_embeddings else 'untied'} embeddings; held-out "
             f"{result.corpus.get('held_out_documents', 0):,} docs, "
             f"{result.corpus.get('held_out_bytes', 0) / 1e6:.2f} MB")
    table = Table(title=title, title_justify="left")
    for name in ("asked", "vocab", "train s", "bytes/tok", "± se", "tok/doc",
                 f"fit {m.seq_len}", "emb+out", "emb share", "GFLOP/byte", "vs best"):
        table.add_column(name, justify="right")
    best = min(p.cost.flops_per_byte for p in result.points)
    for p in result.points:
        c, cost = p.compression, p.cost
        mark = " *" if p.vocab_size == result.recommendation.vocab_size else ""
        short = " (short)" if p.stopped_short else ""
        table.add_row(f"{p.requested:,}", f"{p.vocab_size:,}{short}",
                      f"{p.train_s:.1f}", f"{c.bytes_per_token:.3f}", f"{c.bytes_per_token_se:.3f}",
                      f"{c.tokens_per_doc_mean:,.0f}", f"{100 * c.coverage:.1f}%",
                      f"{cost.embedding_params / 1e6:,.1f}M", f"{100 * cost.embedding_share:.1f}%",
                      f"{cost.flops_per_byte / 1e9:.3f}",
                      f"{100 * (cost.flops_per_byte / best - 1):+.1f}%" + mark)
    console.print(table)
    rng = "" if ref.in_fitted_range else " (outside their fitted 33M-2.87B: an extrapolation)"
    console.print(f"Tao et al. 2024 for N_nv = {ref.non_vocab_params / 1e6:,.1f}M, d = "
                  f"{ref.dim}: V ~ {ref.approach2_vocab:,.0f} (Approach 2), "
                  f"{ref.approach1_vocab:,.0f} (Approach 1){rng}")
    rec = result.recommendation
    console.print(f"[bold]recommended vocabulary: {rec.vocab_size:,}[/bold]  ({rec.tokenizer})")
    for reason in rec.reasons:
        console.print(f"  - {reason}")


def plot(result: SweepResult, path: str | Path) -> Path:
    """Write the four-panel PNG; returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = result.points
    v = [p.vocab_size for p in points]
    rec, ref = result.recommendation, result.reference
    fig, axes = plt.subplots(2, 2, figsize=(11, 8), constrained_layout=True)
    (bpt_ax, flops_ax), (emb_ax, cov_ax) = axes

    bpt = [p.compression.bytes_per_token for p in points]
    err = [2 * p.compression.bytes_per_token_se for p in points]
    bpt_ax.errorbar(v, bpt, yerr=err, marker="o", capsize=3, label="measured, held-out (±2 se)")
    grid = _log_grid(min(v), max(v))
    bpt_ax.plot(grid, [1 / vocab_law.tokens_per_char(x) for x in grid], "--", color="grey",
                label="Tao et al. 2024 fit, chars/token (SlimPajama)")
    bpt_ax.set_ylabel("bytes per token")
    bpt_ax.set_title("compression on held-out text")

    gflops = [p.cost.flops_per_byte / 1e9 for p in points]
    flops_ax.plot(v, gflops, marker="o", label="measured compression x model FLOPs")
    flops_ax.axvline(ref.approach2_vocab, color="grey", linestyle="--",
                     label=f"Tao et al. 2024 optimum ~{ref.approach2_vocab:,.0f}")
    chosen = next(p for p in points if p.vocab_size == rec.vocab_size)
    flops_ax.plot([rec.vocab_size], [chosen.cost.flops_per_byte / 1e9], "r*", markersize=14,
                  label=f"recommended {rec.vocab_size:,}")
    flops_ax.set_ylabel("training GFLOP per byte of text")
    flops_ax.set_title(f"compute per byte, {result.model_name or 'planned model'}")

    emb_ax.plot(v, [100 * p.cost.embedding_share for p in points], marker="o")
    emb_ax.set_ylabel("embedding + output share of params (%)")
    emb_ax.set_title(f"vocabulary parameters (d = {result.model.dim})")

    cov_ax.plot(v, [100 * p.compression.coverage for p in points], marker="o",
                label=f"docs that fit in {result.model.seq_len} tokens")
    cov_ax.set_ylabel("held-out documents that fit (%)")
    cov_ax.set_title("coverage at the planned context length")

    for ax in axes.flat:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("vocabulary size")
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(f"Vocabulary sweep ({result.kind}): recommended {rec.vocab_size:,}")
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _log_grid(lo: float, hi: float, n: int = 50) -> list[float]:
    import math

    return [math.exp(math.log(lo) + (math.log(hi) - math.log(lo)) * i / (n - 1)) for i in range(n)]
