"""How well a tokenizer compresses held-out text, and how sure the measurement is.

Owns: `measure` (bytes per token, tokens per document, coverage at a context length) and the
standard error of a ratio of sums over documents. Must not: train tokenizers or cost models.

Definitions (docs/tokenizer.md reports them for the sweep):
- bytes per token = UTF-8 bytes / tokens over all held-out documents (tiktoken's README: "about 4"
  for English with GPT-2's vocabulary); bytes, not characters, so every language and code count
  alike. The end-of-text separator is not counted: it carries no text.
- tokens per document: mean, median and 90th percentile.
- coverage at the context length T: the share of documents whose tokens plus their separator fit
  in one context window of T tokens, i.e. that a model can read whole.
- Standard error of bytes per token: documents are the sampling unit, so it is the ratio
  estimator's, SE(R) ≈ sqrt(Σ(y_i − R·x_i)² / (n(n−1))) / x̄ with y = bytes, x = tokens
  (Cochran, "Sampling Techniques", 3rd ed. 1977, ch. 6). `paired_ratio_se` applies the same
  formula to two tokenizers' token counts on the same documents, which is how the sweep tells
  real differences from noise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from crucible.trainer.tokenizer.codec import Codec

BATCH_DOCS = 512


def ratio_se(y: np.ndarray, x: np.ndarray) -> float:
    """Standard error of R = Σy/Σx over n sampled units (Cochran 1977, ch. 6)."""
    y, x = np.asarray(y, dtype=np.float64), np.asarray(x, dtype=np.float64)
    n = len(x)
    if n < 2 or x.sum() == 0:
        return float("nan")
    r = y.sum() / x.sum()
    return float(np.sqrt(np.sum((y - r * x) ** 2) / (n * (n - 1))) / x.mean())


def paired_ratio_se(tokens_a: np.ndarray, tokens_b: np.ndarray) -> float:
    """SE of Σtokens_a / Σtokens_b when both tokenizers encoded the same documents."""
    return ratio_se(tokens_a, tokens_b)


@dataclass(frozen=True)
class Compression:
    """One tokenizer on one held-out set."""

    documents: int
    bytes: int
    tokens: int
    bytes_per_token: float
    bytes_per_token_se: float
    tokens_per_doc_mean: float
    tokens_per_doc_median: float
    tokens_per_doc_p90: float
    seq_len: int
    coverage: float  # share of documents that fit, with their separator, in seq_len tokens
    context_bytes: float  # text one context window holds on average: seq_len · bytes/token
    doc_tokens: np.ndarray = field(repr=False, compare=False)  # per document, for paired SEs

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "doc_tokens"}


def measure(codec: Codec, docs: Sequence[str], seq_len: int) -> Compression:
    """Encode `docs` with `codec` and measure compression and coverage at `seq_len`."""
    if not docs:
        raise ValueError("no held-out documents to measure on")
    if seq_len < 1:
        raise ValueError(f"the context length must be positive, got {seq_len}")
    doc_bytes = np.fromiter((len(t.encode("utf-8", "surrogatepass")) for t in docs),
                            dtype=np.int64, count=len(docs))
    doc_tokens = np.empty(len(docs), dtype=np.int64)
    for start in range(0, len(docs), BATCH_DOCS):
        batch = docs[start:start + BATCH_DOCS]
        doc_tokens[start:start + len(batch)] = [len(ids) for ids in codec.encode_batch(batch)]
    tokens, total_bytes = int(doc_tokens.sum()), int(doc_bytes.sum())
    bpt = total_bytes / max(1, tokens)
    return Compression(
        documents=len(docs), bytes=total_bytes, tokens=tokens, bytes_per_token=bpt,
        bytes_per_token_se=ratio_se(doc_bytes, doc_tokens),
        tokens_per_doc_mean=float(doc_tokens.mean()),
        tokens_per_doc_median=float(np.median(doc_tokens)),
        tokens_per_doc_p90=float(np.percentile(doc_tokens, 90)),
        seq_len=seq_len, coverage=float(np.mean(doc_tokens + 1 <= seq_len)),
        context_bytes=seq_len * bpt, doc_tokens=doc_tokens)
