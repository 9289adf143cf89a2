"""The vocabulary sweep behind docs/tokenizer.md: the package-text corpus of
bench/tokenizer_bench.py, byte-level BPE at 4K…128K, recommendations for every model preset.

    ~/.cache/crucible/venv/bin/python bench/tokenizer_sweep.py [--mb 100] [--out bench/results]

Runs `crucible tokenizer sweep`'s code once for gpt2-124m (the default planned model), writing
tokenizer_sweep.json and tokenizer_sweep.png, then re-costs the same measured compression for
every preset in api/arch.py (costing is a pure function of the model and bytes per token,
so no tokenizer is retrained) and prints each preset's recommendation beside Tao et al. 2024's.
The held-out set is `encode`'s validation split (fraction 0.05, seed 0).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=100.0)
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    parser.add_argument("--work", default=str(Path.home() / ".cache" / "crucible" / "sweep"),
                        help="where the swept tokenizers are kept")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO / "bench"))
    from tokenizer_bench import build_corpus

    from crucible.api.arch import PRESETS, preset
    from crucible.trainer.tokenizer import sweep_report
    from crucible.trainer.tokenizer.documents import split_documents
    from crucible.trainer.tokenizer.sweep import (DEFAULT_SIZES, model_cost, recommend,
                                                  reference_for, run_sweep)

    docs = build_corpus(args.mb)
    train, held = split_documents(docs, 0.05, seed=0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def progress(p):
        print(f"  {p.requested:>7,}: realised {p.vocab_size:,} in {p.train_s:.0f} s, "
              f"{p.compression.bytes_per_token:.3f} bytes/token", file=sys.stderr)

    result = run_sweep(train, held, DEFAULT_SIZES, preset("gpt2-124m"), model_name="gpt2-124m",
                       out_dir=args.work, on_point=progress)
    sweep_report.write_json(result, out / "tokenizer_sweep.json")
    sweep_report.plot(result, out / "tokenizer_sweep.png")
    sweep_report.print_table(result)

    presets = {}
    for name in PRESETS:
        cfg = preset(name)
        points = [replace(p, cost=model_cost(cfg, p.vocab_size, p.compression.bytes_per_token))
                  for p in result.points]
        ref = reference_for(cfg)
        rec = recommend(points, ref.approach2_vocab)
        best = min(points, key=lambda p: p.cost.flops_per_byte)
        presets[name] = {
            "dim": cfg.dim, "layers": cfg.layers, "seq_len": cfg.seq_len,
            "non_vocab_params": ref.non_vocab_params, "tao_approach2": round(ref.approach2_vocab),
            "tao_approach1": round(ref.approach1_vocab), "tao_in_range": ref.in_fitted_range,
            "least_compute_per_byte": best.vocab_size, "recommended": rec.vocab_size,
            "band": list(rec.band),
            "gflop_per_byte": {p.vocab_size: round(p.cost.flops_per_byte / 1e9, 4) for p in points},
            "embedding_share": {p.vocab_size: round(p.cost.embedding_share, 4) for p in points}}
        print(f"{name:>10}: recommended {rec.vocab_size:>7,} (least compute/byte "
              f"{best.vocab_size:,}; band {list(rec.band)}); Tao et al. ~{ref.approach2_vocab:,.0f}"
              f"{'' if ref.in_fitted_range else ' (extrapolated)'}")
    (out / "tokenizer_sweep_presets.json").write_text(json.dumps(presets, indent=2) + "\n")
    print(f"wrote {out / 'tokenizer_sweep.json'}, tokenizer_sweep.png and "
          "tokenizer_sweep_presets.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
