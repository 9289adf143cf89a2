"""Inputs: a real `crucible corpus run` output, JSONL with bad lines, text trees; the split."""

from __future__ import annotations

import json

import pytest

from crucible.trainer.corpus import config as corpus_config
from crucible.trainer.corpus import pipeline
from crucible.trainer.tokenizer.documents import (DocumentError, DocumentSource, is_held_out,
                                                  split_documents, split_stream)
from tests.corpus import realtext
from tests.support.text import pydoc_docs


def test_reads_the_output_of_a_corpus_run(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    topics = realtext.pydoc_topics()
    for name, text in topics.items():
        (raw / f"{name}.txt").write_text(text)
    (raw / "copy.txt").write_text(topics["assert"])  # an exact duplicate the run removes
    cfg = corpus_config.from_dict({"output": str(tmp_path / "run"),
                                   "sources": [{"name": "pydoc", "paths": [str(raw)]}],
                                   "steps": ["normalise"], "dedup": {"exact": True, "near": False}})
    pipeline.run_local(cfg, 2, 1)
    source = DocumentSource([str(tmp_path / "run")])
    assert source.paths == (str(tmp_path / "run" / "deduped"),)
    texts = list(source)
    kept = [doc.text for path in sorted((tmp_path / "run" / "deduped").glob("shard-*"))
            for doc in pipeline.read_docs(str(path))]
    assert texts == kept  # the run's own reader sees the same documents in the same order
    assert len(texts) < len(topics) + 1  # the planted copy is gone
    assert source.documents == len(texts) and not source.malformed


def test_jsonl_malformed_lines_are_counted_not_fatal(tmp_path):
    docs = pydoc_docs()[:5]
    lines = [json.dumps({"text": t}) for t in docs] + ["{not json", json.dumps({"body": "x"}), ""]
    (tmp_path / "a.jsonl").write_text("\n".join(lines) + "\n")
    source = DocumentSource([str(tmp_path / "a.jsonl")])
    assert list(source) == docs
    assert source.malformed == {"bad_json": 1, "missing_text": 1, "blank_line": 1}
    assert list(DocumentSource([str(tmp_path / "a.jsonl")], text_field="body")) == ["x"]


def test_text_trees_and_a_byte_cap(tmp_path):
    for i, text in enumerate(pydoc_docs()[:6]):
        (tmp_path / "docs" / f"d{i}").mkdir(parents=True)
        (tmp_path / "docs" / f"d{i}" / "page.txt").write_text(text)
    source = DocumentSource([str(tmp_path / "docs")])
    assert list(source) == pydoc_docs()[:6]  # sorted paths: d0 .. d5
    capped = DocumentSource([str(tmp_path / "docs")], max_bytes=1)
    assert len(list(capped)) == 1
    with pytest.raises(DocumentError, match="no input files"):
        DocumentSource([str(tmp_path / "nowhere")])


def test_split_is_a_partition_and_matches_the_stream():
    docs = pydoc_docs()
    train, held = split_documents(docs, 0.3, seed=4)
    assert sorted(train + held) == sorted(docs)
    assert list(split_stream(docs, 0.3, seed=4)) == train
    assert list(split_stream(docs, 0.3, seed=4, keep="held_out")) == held
    assert held == [t for i, t in enumerate(docs) if is_held_out(i, t, 0.3, 4)]
    assert split_documents(docs, 0.3, seed=5) != (train, held)  # the seed matters
    assert split_documents(docs, 0.0)[1] == []
