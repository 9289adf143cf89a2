"""A Llama-style model (RMSNorm, SwiGLU, grouped-query attention, untied embeddings) trains
under FSDP2 as the GPT does: sharded over two processes it follows the one-process loss curve,
and it learns."""

from __future__ import annotations

import json

import numpy as np

from tests.support.training import job_config, run_crucible, write_config

STEPS = 12


def _losses(corpus, out, nproc: int) -> list[float]:
    cfg = job_config(corpus, out, name=f"llama-{nproc}", steps=STEPS)
    cfg["model"] = {"preset": "llama-tiny", "vocabSize": corpus.vocab_size}
    run = run_crucible("train", "--config", str(write_config(cfg, out.parent / f"{nproc}.yaml")),
                       nproc=nproc)
    assert run.returncode == 0, run.stderr[-3000:]
    return [r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if r["kind"] == "train"]


def test_llama_tiny_sharded_follows_one_process_and_learns(corpus, tmp_path):
    one = _losses(corpus, tmp_path / "one", 1)
    two = _losses(corpus, tmp_path / "two", 2)
    assert len(one) == len(two) == STEPS
    np.testing.assert_allclose(one, two, rtol=0, atol=2e-3)
    assert one[-1] < one[0] - 0.5
