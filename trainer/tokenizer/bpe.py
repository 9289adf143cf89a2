"""Byte-level BPE training with HF `tokenizers`, saved as a standard tokenizer.json.

Byte-level (GPT-2, Radford et al. 2019 §2.2): the base alphabet is the 256 byte values, so any
input round-trips and nothing maps to an unknown token. Special tokens come first, so their ids
are stable whatever the corpus: 0 = `<|endoftext|>` (document separator, GPT-2's name),
1 = `<|pad|>`. The tokenizer's identity is the SHA-256 of its tokenizer.json; shards record it,
and the trainer refuses shards made by another tokenizer.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Iterable, Iterator

EOT = "<|endoftext|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = [EOT, PAD]


def train_bpe(texts: Iterable[str], vocab_size: int, out_path: str | Path, *,
              min_frequency: int = 2, length: int | None = None) -> Path:
    """Train on `texts`, write tokenizer.json to `out_path`, return the path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer, length=length)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_path))
    return out_path


def tokenizer_hash(path: str | Path) -> str:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except FileNotFoundError:
        raise FileNotFoundError(f"tokenizer file {path} does not exist") from None


def load(path: str | Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


def batched(items: Iterable[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def vocab_info(path: str | Path) -> dict:
    tok = load(path)
    return {"vocab_size": tok.get_vocab_size(), "eot_id": tok.token_to_id(EOT),
            "pad_id": tok.token_to_id(PAD), "hash": tokenizer_hash(path),
            "model": json.loads(Path(path).read_text())["model"]["type"]}
