"""What every Crucible vocabulary looks like: special tokens, their ids, and the size rule.

Owns: the special tokens and their fixed ids (the same for HF BPE and SentencePiece, so shards,
the trainer and the demo never look them up by family), the rule that a vocabulary's size is a
multiple of 128, and the reserved tokens that pad a vocabulary whose trainer stopped short.
Must not: train or load tokenizers (`bpe`, `spm`, `codec` do).

Size rule. A requested size is rounded up to a multiple of 128, Megatron-LM's default
`--make-vocab-size-divisible-by` ("for computational efficiency", megatron/training/
arguments.py): the embedding and output matmuls then tile evenly. Trainers can stop short of
the target: HF's BPE trainer runs out of pairs seen `min_frequency` times on a small corpus
(one small corpus gave 45,851 learned tokens for a requested 64,000). Crucible then pads
the learned vocabulary up to the next multiple of 128 with reserved special tokens, as Llama 3
reserves 256 (meta-llama/llama3 llama/tokenizer.py, `num_reserved_special_tokens`), and reports
both numbers; it never pretends the target was reached.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

EOT = "<|endoftext|>"  # document separator; GPT-2's name for it (tiktoken's gpt2 encoding)
PAD = "<|pad|>"
UNK = "<unk>"  # SentencePiece requires one; byte fallback means it is never produced
SPECIAL_TOKENS = (EOT, PAD)
EOT_ID, PAD_ID, SPM_UNK_ID = 0, 1, 2  # special tokens come first: stable ids whatever the corpus
RESERVED = "<|reserved_{}|>"
VOCAB_MULTIPLE = 128  # Megatron-LM's --make-vocab-size-divisible-by default (see docstring)
BYTE_ALPHABET = 256  # byte-level BPE and SentencePiece byte fallback: one token per byte value


class VocabError(ValueError):
    """A vocabulary size that cannot be honoured, or a trained vocabulary that breaks the rules."""


def round_vocab(requested: int, multiple: int = VOCAB_MULTIPLE) -> int:
    """`requested` rounded up to a multiple of `multiple` (never below the smallest vocabulary)."""
    if multiple < 1:
        raise VocabError(f"the vocabulary multiple must be positive, got {multiple}")
    if requested < min_vocab(multiple):
        raise VocabError(f"a vocabulary of {requested} cannot hold the {BYTE_ALPHABET} byte tokens "
                         f"and {len(SPECIAL_TOKENS)} special tokens; ask for at least "
                         f"{min_vocab(multiple)}")
    return -(-requested // multiple) * multiple


def min_vocab(multiple: int = VOCAB_MULTIPLE) -> int:
    """The smallest vocabulary: every byte, the special tokens and SentencePiece's unknown."""
    need = BYTE_ALPHABET + len(SPECIAL_TOKENS) + 1
    return -(-need // multiple) * multiple


def reserved_tokens(learned: int, multiple: int = VOCAB_MULTIPLE) -> list[str]:
    """Names of the reserved tokens that pad `learned` up to the next multiple of `multiple`."""
    padded = -(-learned // multiple) * multiple
    return [RESERVED.format(i) for i in range(padded - learned)]


@dataclass(frozen=True)
class VocabSize:
    """How a vocabulary's size came about; written to the metadata file and printed."""

    requested: int  # what the user asked for
    target: int  # requested rounded up to a multiple of 128: what the trainer was asked for
    learned: int  # what the trainer produced (specials, bytes and merges or pieces)
    reserved: int  # reserved tokens added to reach a multiple of 128 when it stopped short
    multiple: int = VOCAB_MULTIPLE

    @property
    def realised(self) -> int:
        return self.learned + self.reserved

    @property
    def stopped_short(self) -> bool:
        return self.learned < self.target

    def check(self, actual: int) -> None:
        """Assert the saved tokenizer's size is the one reported and follows the size rule."""
        if actual != self.realised:
            raise VocabError(f"the saved tokenizer has {actual} tokens, expected {self.realised}")
        if actual % self.multiple:
            raise VocabError(f"the vocabulary has {actual} tokens, not a multiple of "
                             f"{self.multiple}")
        if actual > self.target:
            raise VocabError(f"the vocabulary has {actual} tokens, more than the target "
                             f"{self.target}")

    def describe(self) -> str:
        if not self.stopped_short:
            note = f"{self.realised:,} tokens"
            if self.requested == self.target:
                return note
            return (f"{note} (requested {self.requested:,}, rounded up to a multiple of "
                    f"{self.multiple})")
        return (f"{self.realised:,} tokens: the trainer stopped at {self.learned:,} of the target "
                f"{self.target:,} (the corpus has no more mergeable pairs at this frequency), "
                f"padded with {self.reserved} reserved tokens to a multiple of {self.multiple}")

    def to_dict(self) -> dict:
        return {**asdict(self), "realised": self.realised, "stopped_short": self.stopped_short}
