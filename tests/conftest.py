"""Session fixtures for the real services the tests run against: `kube`, `s3`, `prometheus`.

They come from the local stack (`e2e/stack.sh up`, idempotent: a no-op when it is already
healthy) unless CRUCIBLE_STACK_ENV names the env file of another stack, e.g. a kind cluster's
(see e2e/kind/). A service that cannot be started fails the test that needs it, with the stack's
own one-line reason; nothing is skipped.

`corpus`, shared by the trainer, guard and ship tests, is a small real-text corpus tokenized once
per session: Python's own documentation (the `pydoc_data.topics` module that ships with every
CPython: ~460 kB of reference prose and examples written by the Python documentation authors),
so it is present on every machine without a download (tests/support/training.py runs training
on it).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.support.services import Kube, Prometheus, S3, read_env_file
from tests.support.text import pydoc_docs
from tests.support.training import VOCAB, Corpus

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def stack_env() -> dict[str, str]:
    external = os.environ.get("CRUCIBLE_STACK_ENV")
    if external:
        return read_env_file(Path(external))
    proc = subprocess.run([str(REPO / "e2e" / "stack.sh"), "up"], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.fail(f"local stack did not come up: {proc.stderr.strip()}", pytrace=False)
    env = subprocess.run([str(REPO / "e2e" / "stack.sh"), "env"], capture_output=True, text=True,
                         check=True)
    return read_env_file(text=env.stdout)


@pytest.fixture(scope="session")
def kube(stack_env) -> Kube:
    kube = Kube.from_env(stack_env)
    kube.delete_stale_test_namespaces()
    return kube


@pytest.fixture
def namespace(kube: Kube, request):
    """A fresh namespace per test, deleted afterwards (DASK-operator style isolation)."""
    name = kube.create_namespace(request.node.name)
    yield name
    kube.delete_namespace(name)


@pytest.fixture(scope="session")
def s3(stack_env) -> S3:
    return S3.from_env(stack_env)


@pytest.fixture(scope="session")
def prometheus(stack_env) -> Prometheus:
    return Prometheus.from_env(stack_env)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Corpus:
    from crucible.trainer.tokenizer.bpe import train_bpe
    from crucible.trainer.tokenizer.encode import encode_to_shards

    root = tmp_path_factory.mktemp("corpus")
    docs = pydoc_docs()
    tok = train_bpe(docs, VOCAB, root / "tokenizer.json")
    encode_to_shards(tok, docs, root / "shards", val_fraction=0.1, seed=0)
    return Corpus(tok, root / "shards" / "train", root / "shards" / "val", VOCAB)
