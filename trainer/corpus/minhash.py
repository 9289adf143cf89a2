"""MinHash signatures and LSH band keys of one document, and the LSH candidate probability.

Owns: `MinhashConfig` (n-gram size, bands x rows, seed), `MinHasher` (text -> shingles ->
signature -> one key per band) and `candidate_probability`, the S-curve P(s) = 1 - (1 - s^r)^b
that tests compare measured recall against. Must not: read or write files (dedup.py does).

Defaults are FineWeb's (paper §3.4; datatrove src/datatrove/pipeline/dedup/minhash.py and
examples/fineweb.py): word 5-grams of the simplified text, 112 hashes as 14 bands of 8 rows, which
puts the 50%-detection point near (1/14)^(1/8) ~ 0.72 Jaccard and detects pairs at 0.8 with
probability 1 - (1 - 0.8^8)^14 ~ 0.924 (datatrove's code comment; paper: "targeting documents that
are at least 75% similar").

How it differs from datatrove, for speed: datatrove hashes every n-gram string with xxhash/sha1 in
Python and permutes with (a*x + b) mod (2^61 - 1). We hash each distinct word once (xxh3-64),
combine word hashes into n-gram hashes with a 64-bit rolling polynomial in numpy, and permute with
x -> a*x + b (mod 2^64, a odd: a bijection) followed by an xor-shift, all vectorised. Signatures
estimate the Jaccard similarity of the two n-gram *sets*, which is what the S-curve assumes;
tests/corpus/test_near_dedup.py checks measured detection rates against it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import xxhash

from crucible.trainer.corpus.words import simplify

_ROLL = np.uint64(0x9E3779B97F4A7C15)   # odd multiplier of the rolling n-gram hash
_SHIFT = np.uint64(31)


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
        rng = np.random.default_rng(config.seed)
        high = np.iinfo(np.uint64).max
        self._a = rng.integers(1, high, size=config.num_hashes, dtype=np.uint64, endpoint=True) \
            | np.uint64(1)                        # odd: x -> a*x + b is a bijection mod 2^64
        self._b = rng.integers(0, high, size=config.num_hashes, dtype=np.uint64, endpoint=True)

    def shingles(self, text: str) -> np.ndarray:
        """uint64 hashes of the word n-grams of the simplified text, shape (n_shingles,).
        A text shorter than n words is one shingle of all its words."""
        words = simplify(text).split()
        if not words:
            return np.zeros(0, dtype=np.uint64)
        vocab: dict[str, int] = {}
        ids = [vocab.setdefault(w, len(vocab)) for w in words]       # hash each distinct word once
        word_hashes = np.fromiter((xxhash.xxh3_64_intdigest(w.encode()) for w in vocab),
                                  dtype=np.uint64, count=len(vocab))
        hashes = word_hashes[np.asarray(ids)]
        n = min(self.config.n_grams, len(words))
        count = len(words) - n + 1
        grams = hashes[:count].copy()
        with np.errstate(over="ignore"):         # uint64 wrap-around is the hash
            for offset in range(1, n):
                grams = grams * _ROLL + hashes[offset:offset + count]
        return grams

    def signature(self, shingles: np.ndarray) -> np.ndarray:
        """Minimum of each of the num_hashes permutations over the shingles, shape (num_hashes,).
        An empty text gets all-max values (it matches nothing but other empty texts)."""
        if shingles.size == 0:
            return np.full(self.config.num_hashes, np.iinfo(np.uint64).max, dtype=np.uint64)
        with np.errstate(over="ignore"):
            permuted = shingles[:, None] * self._a + self._b   # (n_shingles, num_hashes)
        permuted ^= permuted >> _SHIFT
        return permuted.min(axis=0)

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
