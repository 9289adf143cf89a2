"""Mixture: sample sources to target weights, up (repeat) or down (subsample), reporting epochs.

Owns: `MixtureConfig`, `repeat_factors` (source sizes and target weights -> how many times each
source's text is seen, i.e. its epochs) and `copies` (how many copies of one document go out).
Must not: read files (pipeline does).

Weights are shares of output bytes. A source with factor f = weight * total / size is repeated
floor(f) times plus once more with probability f - floor(f) (f < 1 subsamples), the practice of
GPT-3 §2.2 / Table 2.2 ("epochs elapsed when training for 300B tokens") and Gopher's MassiveText
sampling proportions (Rae et al. 2021, Table 2). The extra copy is decided by a hash of
(seed, document key), not by a random stream, so the result is the same for any sharding and any
document order, and reruns with the same seed write the same bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import xxhash


@dataclass(frozen=True)
class MixtureConfig:
    weights: dict[str, float] = field(default_factory=dict)   # source -> share of output bytes
    # Output size in bytes; None keeps the input size (sum of the weighted sources' bytes).
    total_bytes: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.weights:
            raise ValueError("mixture: give at least one source weight")
        if any(w < 0 for w in self.weights.values()) or sum(self.weights.values()) <= 0:
            raise ValueError("mixture: weights must be >= 0 and not all zero")


def repeat_factors(source_bytes: dict[str, int], config: MixtureConfig) -> dict[str, float]:
    """Epochs per source: how many times its (deduplicated) bytes appear in the output.

    A weighted source with no text left (everything filtered or deduplicated away) gets 0 and the
    others share its weight: the report shows the 0, which is the finding to act on.
    """
    live = {s: w for s, w in config.weights.items() if w > 0 and source_bytes.get(s, 0) > 0}
    if not live:
        raise ValueError("mixture: no weighted source has any text left")
    weight_sum = sum(live.values())
    total = config.total_bytes if config.total_bytes is not None else \
        sum(source_bytes[s] for s in live)
    return {source: (live[source] / weight_sum) * total / source_bytes[source]
            if source in live else 0.0 for source in config.weights}


def copies(key: int, factor: float, seed: int) -> int:
    """Copies of the document with this key: floor(factor), plus one with prob. frac(factor)."""
    whole = math.floor(factor)
    fraction = factor - whole
    if fraction == 0:
        return whole
    draw = xxhash.xxh3_64_intdigest(key.to_bytes(8, "little"), seed=seed) / 2.0**64
    return whole + (draw < fraction)
