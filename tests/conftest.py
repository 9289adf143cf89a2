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

In parallel (`make test` runs pytest-xdist with `--dist loadgroup`), every test that uses the
cluster runs in one worker, one after the other, as the serial suite does: they share one
apiserver-wide pool of KWOK nodes (a test kills, cordons and fills them), the CRD, cluster roles
and Kueue's cluster queues. The other tests (training under torchrun, the corpus, the planner)
share nothing but the S3 and Prometheus servers, where each uses its own bucket prefix or scrape
job; they go to whichever worker is free a module at a time, so a module's fixtures (a training
run several tests read) are made once.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.services import Kube, Prometheus, S3, read_env_file
from tests.support.text import pydoc_docs
from tests.support.training import VOCAB, Corpus

REPO = Path(__file__).resolve().parents[1]
CLUSTER_GROUP = "cluster"


def math_threads_per_worker(cpus: int, workers: int) -> int | None:
    """Math threads for each of `workers` parallel pytest processes on `cpus` cores (None: a
    serial run keeps the default). Two workers with two OpenMP threads each on two cores
    spin-wait on one another: a 100-step CPU training measured 1.9x slower that way than with
    one thread each, and a run under its 300 s timeout ran out of it."""
    return max(1, cpus // workers) if workers > 1 else None


def pytest_configure(config):
    # Each worker, and every training process it starts (they inherit OMP_NUM_THREADS), gets its
    # share of the cores, unless the caller chose a thread count.
    threads = math_threads_per_worker(os.cpu_count() or 1,
                                      int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0")))
    if threads and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(threads)
        if "torch" in sys.modules:   # torch read the variable when imported: tell it too
            sys.modules["torch"].set_num_threads(threads)


@pytest.hookimpl(tryfirst=True)   # before xdist reads the marks (its own modifyitems hook)
def pytest_collection_modifyitems(items):
    for item in items:
        uses_cluster = "kube" in getattr(item, "fixturenames", ())
        item.add_marker(pytest.mark.xdist_group(
            CLUSTER_GROUP if uses_cluster else item.nodeid.split("::")[0]))


@pytest.fixture(scope="session")
def stack_env(tmp_path_factory) -> dict[str, str]:
    external = os.environ.get("CRUCIBLE_STACK_ENV")
    if external:
        return read_env_file(Path(external))
    # One `stack.sh up` for the whole run: in parallel every worker asks, and a second `up` would
    # rewrite the env file and the kubeconfig while the first worker's tests read them. The
    # first worker to take the lock starts (or checks) the stack and leaves its env in the run's
    # shared temp folder (each worker's is below it); the others read that. Serially there is
    # only this process, and its own folder is the run's.
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if "PYTEST_XDIST_WORKER" in os.environ else base
    with open(shared / "stack-up.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        env_file = shared / "stack.env"
        if not env_file.exists():
            proc = subprocess.run([str(REPO / "e2e" / "stack.sh"), "up"], capture_output=True,
                                  text=True)
            if proc.returncode != 0:
                pytest.fail(f"local stack did not come up: {proc.stderr.strip()}", pytrace=False)
            env = subprocess.run([str(REPO / "e2e" / "stack.sh"), "env"], capture_output=True,
                                 text=True, check=True)
            env_file.write_text(env.stdout)
        return read_env_file(text=env_file.read_text())


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
