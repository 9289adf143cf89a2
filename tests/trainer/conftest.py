"""A small real-text corpus, tokenized once per test session, and a helper that runs training.

The text is Python's own documentation (the `pydoc_data.topics` module that ships with every
CPython: ~460 kB of reference prose and examples written by the Python documentation authors),
so it is present on every machine without a download.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
VOCAB = 2048


def python_docs() -> list[str]:
    import pydoc_data.topics as topics

    return [topics.topics[key] for key in sorted(topics.topics)]


@dataclass(frozen=True)
class Corpus:
    tokenizer: Path
    train: Path
    val: Path
    vocab_size: int


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Corpus:
    from crucible.trainer.tokenizer.bpe import train_bpe
    from crucible.trainer.tokenizer.encode import encode_to_shards

    root = tmp_path_factory.mktemp("corpus")
    docs = python_docs()
    tok = train_bpe(docs, VOCAB, root / "tokenizer.json")
    encode_to_shards(tok, docs, root / "shards", val_fraction=0.1, seed=0)
    return Corpus(tok, root / "shards" / "train", root / "shards" / "val", VOCAB)


def job_config(corpus: Corpus, out: Path, *, name: str = "t", steps: int = 20,
               batch_tokens: int = 4096, **training) -> dict:
    return {
        "name": name,
        "outputDir": str(out),
        "model": {"preset": "tiny", "vocabSize": corpus.vocab_size},
        "data": {"train": str(corpus.train), "val": str(corpus.val),
                 "tokenizer": str(corpus.tokenizer)},
        "training": {"tokens": steps * batch_tokens, "globalBatchTokens": batch_tokens,
                     "microBatch": 8, "warmupSteps": 5, "lr": 3e-3, "precision": "fp32",
                     "evalTokens": 16384, **training},
        "metrics": {"port": 0},
    }


def write_config(cfg: dict, path: Path) -> Path:
    path.write_text(yaml.safe_dump(cfg))
    return path


def crucible_cmd(*args: str, nproc: int = 1) -> list[str]:
    """The command line: torchrun for several processes, the plain CLI for one."""
    if nproc == 1:
        return [sys.executable, "-m", "crucible.trainer", *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", "-m", "crucible.trainer", *args]


def run_crucible(*args: str, nproc: int = 1, timeout: float = 300, env: dict | None = None,
                 **kw) -> subprocess.CompletedProcess:
    from crucible.api.launch import TORCHRUN_ENV

    threads = "1" if nproc > 1 else os.environ.get("OMP_NUM_THREADS", "2")
    env = {**os.environ, "OMP_NUM_THREADS": threads, **TORCHRUN_ENV, **(env or {})}
    return subprocess.run(crucible_cmd(*args, nproc=nproc), capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=env, **kw)
