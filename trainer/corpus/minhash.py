"""MinHash signatures and LSH band keys of one document, and the LSH candidate probability.

Owns: `MinhashConfig` (n-gram size, bands x rows, seed), `MinHasher` (text -> shingles ->
signature -> one key per band) and `candidate_probability`, the S-curve P(s) = 1 - (1 - s^r)^b
that tests compare measured recall against. Must not: read or write files (dedup.py does).

Defaults are FineWeb's (paper §3.4; datatrove src/datatrove/pipeline/dedup/minhash.py and
examples/fineweb.py): word 5-grams of the simplified text, 112 hashes as 14 bands of 8 rows, which
puts the 50%-detection point near (1/14)^(1/8) ~ 0.72 Jaccard and detects pairs at 0.8 with
probability 1 - (1 - 0.8^8)^14 ~ 0.924 (datatrove's code comment; paper: "targeting documents that
are at least 75% similar").

Hashing is datatrove's, so both pick the same candidate pairs (bench/corpus_bench.py measures
it): the words are datatrove's (`split_words` of the simplified text, spaCy's English rules), each
n-gram is its words joined by one space and hashed with xxh64, and the permutations are
(a*x + b) mod (2^61 - 1) with a, b drawn by numpy's RandomState(seed) as datatrove draws them (the
product wraps at 2^64 before the modulus, as in datatrove's numpy code). Only the n-gram hashing
is a Python loop; the permutations and minimum are vectorised. One difference: a text shorter
than n words is one shingle of all its words here, while datatrove writes no signature for it (so
it is never a near duplicate there). Signatures estimate the Jaccard similarity of the two n-gram
*sets*, which is what the S-curve assumes; tests/corpus/test_near_dedup.py checks measured
detection rates against it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import xxhash

from crucible.trainer.corpus.words import simplify, split_words

_MERSENNE_PRIME = np.uint64((1 << 61) - 1)     # datatrove's permutation modulus


@dataclass(frozen=True)
class MinhashConfig:
    n_grams: int = 5     # FineWeb §3.4: word 5-grams
    bands: int = 14      # FineWeb §3.4 / datatrove MinhashConfig.num_buckets
    rows: int = 8        # FineWeb §3.4 / datatrove MinhashConfig.hashes_per_bucket
    seed: int = 1        # datatrove MinhashConfig.seed

    def __post_init__(self) -> None:
        if min(self.n_grams, self.bands, self.rows) < 1:
            raise ValueError("n_grams, bands and rows must all be >= 1")

    @property
    def num_hashes(self) -> int:
        return self.bands * self.rows

    @property
    def threshold(self) -> float:
        """Jaccard similarity near the S-curve's steepest point: (1/b)^(1/r)."""
        return (1 / self.bands) ** (1 / self.rows)

    def __str__(self) -> str:
        return f"{self.n_grams}g_{self.bands}b_{self.rows}r_s{self.seed}"


def candidate_probability(similarity: float | np.ndarray, bands: int, rows: int):
    """P(two documents with Jaccard `similarity` share at least one band) = 1 - (1 - s^r)^b."""
    return 1 - (1 - np.asarray(similarity, dtype=float) ** rows) ** bands


class MinHasher:
    def __init__(self, config: MinhashConfig = MinhashConfig()):
        self.config = config
        draw = np.random.RandomState(config.seed)     # datatrove MinhashDedupSignature.parameters
        self._a = draw.randint(1, _MERSENNE_PRIME, dtype=np.uint64, size=config.num_hashes)
        self._b = draw.randint(0, _MERSENNE_PRIME, dtype=np.uint64, size=config.num_hashes)

    def shingles(self, text: str) -> np.ndarray:
        """uint64 hashes (xxh64 of the words joined by spaces) of the word n-grams of the
        simplified text, shape (n_shingles,). A text shorter than n words is one shingle of all
        its words."""
        words = split_words(simplify(text))     # datatrove: word_tokenize(simplify_text(text))
        if not words:
            return np.zeros(0, dtype=np.uint64)
        n = min(self.config.n_grams, len(words))
        count = len(words) - n + 1
        hash64 = xxhash.xxh64_intdigest
        return np.fromiter((hash64(" ".join(words[i:i + n]).encode()) for i in range(count)),
                           dtype=np.uint64, count=count)

    def signature(self, shingles: np.ndarray) -> np.ndarray:
        """Minimum of each of the num_hashes permutations over the shingles, shape (num_hashes,).
        An empty text gets all-max values (it matches nothing but other empty texts)."""
        if shingles.size == 0:
            return np.full(self.config.num_hashes, np.iinfo(np.uint64).max, dtype=np.uint64)
        with np.errstate(over="ignore"):       # the product wraps at 2^64, as in datatrove
            permuted = (shingles[:, None] * self._a + self._b) % _MERSENNE_PRIME
        return permuted.min(axis=0)             # (num_hashes,)

    def band_keys(self, signature: np.ndarray) -> np.ndarray:
        """One uint64 key per band (xxh3-64 of its rows), shape (bands,)."""
        rows = self.config.rows
        return np.fromiter((xxhash.xxh3_64_intdigest(signature[b * rows:(b + 1) * rows].tobytes())
                            for b in range(self.config.bands)), dtype=np.uint64,
                           count=self.config.bands)

    def keys_of(self, text: str) -> np.ndarray:
        return self.band_keys(self.signature(self.shingles(text)))


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """Exact Jaccard similarity of two shingle sets (tests and the benchmark measure with it)."""
    set_a, set_b = set(a.tolist()), set(b.tolist())
    union = len(set_a | set_b)
    return len(set_a & set_b) / union if union else 1.0
