"""CPU training throughput: Crucible's trainer against nanoGPT's train.py, side by side.

Same model shape (layers, heads, width, context, vocabulary), same micro-batch, accumulation and
fp32 on the CPU, same tokens (Python's documentation, tokenized once by our BPE and written in
both formats), one process each, torch.compile off on both sides (nanoGPT's default would
compile), run alternately in this script (--rounds pairs) so a busy neighbour on the machine
slows both sides alike. nanoGPT is a reference checkout outside the
repository (default ~/.cache/crucible/ref/nanoGPT, or --nanogpt); none of its code is copied.

Prints tokens/s (median step time over the timed steps) for each and the ratio ours/nanoGPT.
The architectures differ in the details the projects chose: nanoGPT learns position embeddings,
Crucible rotates queries and keys (RoPE); the FLOPs per token are the same to within 0.1%.

  python bench/cpu_vs_nanogpt.py [--steps 30] [--layers 6 --dim 384 --heads 6 --seq 256]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import yaml

REPO = Path(__file__).resolve().parents[1]
DEFAULT_NANOGPT = Path.home() / ".cache" / "crucible" / "ref" / "nanoGPT"


def build_tokens(work: Path, vocab: int) -> tuple[Path, Path]:
    import pydoc_data.topics as topics

    from crucible.trainer.tokenizer.bpe import train_bpe
    from crucible.trainer.tokenizer.encode import encode_to_shards

    docs = [topics.topics[k] for k in sorted(topics.topics)]
    tok = train_bpe(docs, vocab, work / "tokenizer.json")
    encode_to_shards(tok, docs, work / "shards", val_fraction=0.05)
    return tok, work / "shards"


def nanogpt_dataset(shards: Path, vocab: int, root: Path) -> str:
    """nanoGPT reads data/<name>/{train,val}.bin (uint16) and meta.pkl from its working dir."""
    from crucible.trainer.data import ShardSet

    folder = root / "data" / "crucible"
    folder.mkdir(parents=True)
    for split in ("train", "val"):
        s = ShardSet(shards / split)
        s.read(0, s.num_tokens).astype(np.uint16).tofile(folder / f"{split}.bin")
    with open(folder / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": vocab}, f)
    return "crucible"


def run_nanogpt(nanogpt: Path, root: Path, a) -> list[float]:
    os.symlink(nanogpt / "configurator.py", root / "configurator.py")  # it execs ./configurator.py
    args = [f"--dataset=crucible", "--device=cpu", "--dtype=float32", "--compile=False",
            f"--n_layer={a.layers}", f"--n_head={a.heads}", f"--n_embd={a.dim}",
            f"--block_size={a.seq}", f"--batch_size={a.micro_batch}",
            f"--gradient_accumulation_steps={a.accum}", f"--max_iters={a.steps}",
            "--eval_interval=100000", "--eval_iters=1", "--log_interval=1",
            "--always_save_checkpoint=False", f"--warmup_iters=5", f"--lr_decay_iters={a.steps}",
            f"--out_dir={root / 'out'}", "--bias=False"]
    out = subprocess.run([sys.executable, str(nanogpt / "train.py"), *args], cwd=root,
                         capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(a.threads)})
    if out.returncode != 0:
        raise SystemExit(f"nanoGPT failed:\n{out.stderr[-2000:]}")
    return [float(ms) / 1e3 for ms in re.findall(r"iter \d+: loss [\d.]+, time ([\d.]+)ms", out.stdout)]


def run_crucible(tok: Path, shards: Path, root: Path, a) -> list[float]:
    tokens_per_step = a.micro_batch * a.accum * a.seq
    cfg = {"name": "bench", "outputDir": str(root / "crucible"),
           "model": {"preset": "tiny", "layers": a.layers, "heads": a.heads, "dim": a.dim,
                     "seqLen": a.seq, "vocabSize": a.vocab},
           "data": {"train": str(shards / "train"), "tokenizer": str(tok)},
           "training": {"tokens": a.steps * tokens_per_step, "globalBatchTokens": tokens_per_step,
                        "microBatch": a.micro_batch, "precision": "fp32", "warmupSteps": 5},
           "metrics": {"port": 0}}
    (root / "job.yaml").write_text(yaml.safe_dump(cfg))
    out = subprocess.run([sys.executable, "-m", "crucible.trainer", "train", "--config",
                          str(root / "job.yaml")], cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": str(a.threads)})
    if out.returncode != 0:
        raise SystemExit(f"crucible failed:\n{out.stderr[-2000:]}")
    records = [json.loads(l) for l in (root / "crucible" / "metrics.jsonl").read_text().splitlines()]
    return [r["step_seconds"] for r in records if r["kind"] == "train"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nanogpt", type=Path, default=DEFAULT_NANOGPT)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--rounds", type=int, default=2, help="alternating (crucible, nanoGPT) pairs")
    p.add_argument("--skip", type=int, default=3, help="first steps of a run not timed (warm-up)")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    a = p.parse_args()
    if not (a.nanogpt / "train.py").exists():
        raise SystemExit(f"no nanoGPT checkout at {a.nanogpt}: git clone "
                         "https://github.com/karpathy/nanoGPT there (or pass --nanogpt)")
    tokens_per_step = a.micro_batch * a.accum * a.seq
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tok, shards = build_tokens(root, a.vocab)
        nanogpt_dataset(shards, a.vocab, root)
        results = {"crucible": [], "nanoGPT": []}
        for r in range(a.rounds):
            run_dir = root / f"round{r}"
            run_dir.mkdir()
            (run_dir / "data").symlink_to(root / "data")
            results["crucible"] += run_crucible(tok, shards, run_dir, a)[a.skip:]
            results["nanoGPT"] += run_nanogpt(a.nanogpt, run_dir, a)[a.skip:]
    print(f"model {a.layers}L/{a.heads}H/{a.dim}d, context {a.seq}, vocab {a.vocab}; "
          f"{tokens_per_step} tokens/step ({a.micro_batch} x {a.accum} x {a.seq}); fp32 on CPU, "
          f"{a.threads} threads, compile off; median of steps {a.skip + 1}..{a.steps} over "
          f"{a.rounds} alternating rounds")
    tps = {}
    for name, timed in results.items():
        tps[name] = tokens_per_step / statistics.median(timed)
        print(f"  {name:<9} {tps[name]:>10,.0f} tokens/s   (step {1e3 * statistics.median(timed):.1f} ms,"
              f" min {1e3 * min(timed):.1f}, max {1e3 * max(timed):.1f})")
    print(f"  ratio crucible / nanoGPT: {tps['crucible'] / tps['nanoGPT']:.2f}x")


if __name__ == "__main__":
    main()
