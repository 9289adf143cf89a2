"""A trained tokenizer opened for encoding and decoding, whichever library made it.

Owns: `open_codec(path)`, which reads a tokenizer.json (HF `tokenizers`) or a `.model`
(SentencePiece) and returns a `Codec` with one interface: `encode_batch`, `decode`, the vocabulary
size, the special ids and the file's hash. `encode`, `sweep` and the benchmark go through it.
Must not: train tokenizers.

Batch encoding uses every core: HF's `encode_batch_fast` runs on its Rayon pool (size from
RAYON_NUM_THREADS, else all cores; it skips the character offsets `encode_batch` computes, which
shards do not need) and SentencePiece's `encode` takes `num_threads`.

Special tokens written in the text. HF extracts added tokens from input text by default, so a
document quoting "<|endoftext|>" would inject a document boundary. The codec sets
`encode_special_tokens`, which makes HF encode such text as ordinary bytes (tiktoken refuses it
by default for the same reason); the separator is only ever appended by `encode` as an id.
SentencePiece never matches control symbols in text.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from crucible.trainer.tokenizer.metadata import tokenizer_hash
from crucible.trainer.tokenizer.vocabulary import EOT, PAD


class CodecError(ValueError):
    """A file that is not a tokenizer Crucible can use; the message says why."""


class Codec:
    """Common interface; `HFCodec` and `SPMCodec` implement it."""

    family: str
    path: Path
    hash: str
    vocab_size: int
    eot_id: int
    pad_id: int | None

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        raise NotImplementedError

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError


class HFCodec(Codec):
    family = "hf"

    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        try:
            self.tok = Tokenizer.from_file(str(path))
        except Exception as err:  # the Rust side raises a bare Exception for a bad file
            raise CodecError(f"{path} is not a HF tokenizer.json: {err}") from None
        self.tok.encode_special_tokens = True  # see the module docstring
        self.path, self.hash = path, tokenizer_hash(path)
        self.vocab_size = self.tok.get_vocab_size()
        eot = self.tok.token_to_id(EOT)
        if eot is None:
            raise CodecError(f"{path} has no {EOT} token; Crucible separates documents with it. "
                             "Train one with `crucible tokenizer train`")
        self.eot_id, self.pad_id = eot, self.tok.token_to_id(PAD)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch_fast(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)


class SPMCodec(Codec):
    family = "spm"

    def __init__(self, path: Path, threads: int | None = None):
        import sentencepiece as spm

        try:
            self.sp = spm.SentencePieceProcessor(model_file=str(path))
        except (RuntimeError, OSError) as err:
            raise CodecError(f"{path} is not a SentencePiece model: {err}") from None
        self.path, self.hash = path, tokenizer_hash(path)
        self.threads = threads or os.cpu_count() or 1
        self.vocab_size = self.sp.get_piece_size()
        if self.sp.eos_id() < 0:
            raise CodecError(f"{path} has no end-of-sequence piece; Crucible separates documents "
                             "with it. Train one with `crucible tokenizer train --kind spm-bpe`")
        self.eot_id = self.sp.eos_id()
        self.pad_id = self.sp.pad_id() if self.sp.pad_id() >= 0 else None

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self.sp.encode(list(texts), num_threads=self.threads)

    def decode(self, ids: Sequence[int]) -> str:
        return self.sp.decode(list(ids))


def open_codec(path: str | Path, *, threads: int | None = None) -> Codec:
    """A codec for tokenizer.json (HF) or a SentencePiece .model, told apart by content."""
    path = Path(path)
    if not path.is_file():
        raise CodecError(f"tokenizer file {path} does not exist")
    with open(path, "rb") as f:
        head = f.read(64).lstrip()
    # Foreign tokenizers with other special ids are usable: the shard header records eot_id.
    return HFCodec(path) if head.startswith(b"{") else SPMCodec(path, threads)
