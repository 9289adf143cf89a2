"""MinHash-LSH near dedup on real text with planted near-duplicates, against the LSH theory.

Base documents are passages of Python's pydoc topics. Each gets edited copies: k of its words are
replaced by words from elsewhere in the docs, and the exact Jaccard similarity s of the two 5-gram
sets is measured. LSH theory says the pair becomes a candidate with P(s) = 1 - (1 - s^r)^b
(b = 14 bands, r = 8 rows: FineWeb's setting). We check the measured detection rate per
similarity bin, and recall and precision at the ~0.75 target, against that formula.
"""

from __future__ import annotations

import numpy as np
import pytest

from crucible.trainer.corpus.clusters import UnionFind, clusters_from_pairs, exact_duplicates
from crucible.trainer.corpus.dedup import bucket_pairs
from crucible.trainer.corpus.minhash import MinHasher, MinhashConfig, candidate_probability, jaccard
from tests.corpus import realtext

CONFIG = MinhashConfig()             # 5-grams, 14 bands x 8 rows, as FineWeb
BASES = 80
EDITS_PER_BASE = 6
TARGET = 0.75                        # FineWeb §3.4: "at least 75% similar"


@pytest.fixture(scope="module")
def planted():
    """(base texts, [(base index, copy text, jaccard)]) with edits at many similarity levels."""
    words = list(realtext.prose_words())
    passages = [" ".join(words[i * 300:(i + 1) * 300]) for i in range(BASES)]
    replacements = words[BASES * 300:]
    rng = np.random.default_rng(7)
    hasher = MinHasher(CONFIG)
    copies = []
    for b, passage in enumerate(passages):
        tokens = passage.split()
        for edit in range(EDITS_PER_BASE):
            k = int(rng.integers(1, 30))          # 1..29 of 300 words -> s from ~0.97 to ~0.4
            edited = list(tokens)
            for position in rng.choice(len(tokens), size=k, replace=False):
                edited[position] = replacements[int(rng.integers(len(replacements)))]
            text = " ".join(edited)
            s = jaccard(hasher.shingles(passage), hasher.shingles(text))
            copies.append((b, text, s))
    return passages, copies


def is_candidate(hasher: MinHasher, a: str, b: str) -> bool:
    return bool((hasher.keys_of(a) == hasher.keys_of(b)).any())


def test_threshold_and_probabilities_match_the_papers_numbers():
    assert CONFIG.num_hashes == 112
    assert CONFIG.threshold == pytest.approx(0.719, abs=1e-3)                 # (1/14)^(1/8)
    assert candidate_probability(0.8, 14, 8) == pytest.approx(0.924, abs=1e-3)  # datatrove comment
    assert str(CONFIG) == "5g_14b_8r_s1"


def test_detection_rate_follows_the_s_curve(planted):
    passages, copies = planted
    hasher = MinHasher(CONFIG)
    s = np.array([c[2] for c in copies])
    hit = np.array([is_candidate(hasher, passages[b], text) for b, text, _ in copies])
    p = candidate_probability(s, CONFIG.bands, CONFIG.rows)
    assert s.min() < 0.55 and s.max() > 0.95          # the edits span the S-curve
    for low, high in [(0.0, 0.6), (0.6, 0.7), (0.7, 0.8), (0.8, 0.9), (0.9, 1.01)]:
        in_bin = (s >= low) & (s < high)
        if in_bin.sum() < 10:
            continue
        expected, measured = p[in_bin].mean(), hit[in_bin].mean()
        sigma = np.sqrt((p[in_bin] * (1 - p[in_bin])).sum()) / in_bin.sum()
        assert abs(measured - expected) <= 4 * sigma + 0.02, (low, high, measured, expected)


def test_recall_and_precision_at_the_target(planted):
    passages, copies = planted
    hasher = MinHasher(CONFIG)
    s = np.array([c[2] for c in copies])
    hit = np.array([is_candidate(hasher, passages[b], text) for b, text, _ in copies])
    p = candidate_probability(s, CONFIG.bands, CONFIG.rows)
    similar = s >= TARGET
    recall, expected_recall = hit[similar].mean(), p[similar].mean()
    precision, expected_precision = similar[hit].mean(), (p * similar).sum() / p.sum()
    n_similar, n_hit = similar.sum(), hit.sum()
    assert abs(recall - expected_recall) <= 4 * np.sqrt(expected_recall * (1 - expected_recall)
                                                        / n_similar) + 0.02
    assert abs(precision - expected_precision) <= 4 * np.sqrt(
        expected_precision * (1 - expected_precision) / n_hit) + 0.02
    assert recall > 0.9


def test_unrelated_documents_are_not_candidates(planted):
    passages, _ = planted
    hasher = MinHasher(CONFIG)
    keys = np.stack([hasher.keys_of(p) for p in passages])
    for band in range(CONFIG.bands):
        assert len(np.unique(keys[:, band])) == len(passages)


def test_buckets_and_clusters_keep_the_earliest_copy(planted):
    passages, copies = planted
    hasher = MinHasher(CONFIG)
    # keys: base b is 1000*b, its close copies 1000*b + 1.. (later in input order)
    close = [(b, text) for b, text, s in copies if s > 0.9]
    texts = {1000 * b: p for b, p in enumerate(passages)}
    for i, (b, text) in enumerate(close):
        texts[1000 * b + 1 + i] = text
    doc_keys = np.array(sorted(texts), dtype=np.uint64)
    bands = np.stack([hasher.keys_of(texts[int(k)]) for k in doc_keys])
    pairs = np.concatenate([bucket_pairs(doc_keys, bands[:, band]) for band in range(CONFIG.bands)])
    result = clusters_from_pairs(pairs)
    removed = set(result.remove.tolist())
    assert not removed & {1000 * b for b in range(BASES)}          # no base (earliest) removed
    found = sum(1 for i, (b, _) in enumerate(close) if 1000 * b + 1 + i in removed)
    assert found / len(close) > 0.97                               # P(0.9) = 0.9996


def test_union_find_is_transitive_and_roots_at_the_smallest():
    sets = UnionFind(6)
    for a, b in [(4, 5), (2, 4), (1, 3)]:
        sets.union(a, b)
    assert [sets.find(i) for i in range(6)] == [0, 1, 2, 1, 2, 2]
    chain = np.array([[30, 20], [20, 10], [40, 50]], dtype=np.uint64)
    result = clusters_from_pairs(chain)
    assert result.remove.tolist() == [20, 30, 50] and sorted(result.sizes.tolist()) == [2, 3]


def test_exact_duplicates_keep_the_smallest_key():
    keys = np.array([5, 3, 9, 1], dtype=np.uint64)
    digests = np.array([b"a", b"b", b"a", b"a"], dtype="S16")
    result = exact_duplicates(keys, digests)
    assert result.remove.tolist() == [5, 9] and result.sizes.tolist() == [3]
