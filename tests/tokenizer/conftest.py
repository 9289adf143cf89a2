"""Real text for the tokenizer tests, and tokenizers trained on it once per session.

Nothing here is written by us: Python's own reference documentation, the standard library's
source code, fortune cookies in four languages and man pages in Russian, Japanese and Chinese
(tests/support/text.py reads them; `make test-data` installs them). A missing package fails
loudly.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.text import fortunes_mixed, man_pages_non_latin, pydoc_docs, stdlib_sources


@dataclass(frozen=True)
class Trained:
    docs: tuple[str, ...]
    bpe: Path
    spm_bpe: Path
    spm_unigram: Path


@pytest.fixture(scope="session")
def corpus_docs() -> tuple[str, ...]:
    """~1.2 MB of mixed real text: prose, code, four Latin-script languages, three others."""
    return tuple(pydoc_docs() + stdlib_sources() + fortunes_mixed() + man_pages_non_latin())


@pytest.fixture(scope="session")
def trained(tmp_path_factory, corpus_docs) -> Trained:
    """One tokenizer of each kind, 2,048 tokens, trained on the mixed corpus."""
    from crucible.trainer.tokenizer import trainers

    root = tmp_path_factory.mktemp("tokenizers")
    paths = {kind: trainers.train(kind, corpus_docs, 2048, root / kind)
             for kind in trainers.KINDS}
    return Trained(corpus_docs, paths["bpe"], paths["spm-bpe"], paths["spm-unigram"])
