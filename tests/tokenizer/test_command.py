"""`crucible tokenizer train | sweep | encode` end to end, and user errors as one clear line."""

from __future__ import annotations

import json

import pytest

from crucible.trainer.cli import main
from crucible.trainer.data import ShardSet
from crucible.trainer.tokenizer.codec import open_codec
from crucible.trainer.tokenizer.documents import split_documents
from crucible.trainer.tokenizer.metadata import read_metadata
from tests.support.text import fortunes_mixed, pydoc_docs


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory):
    path = tmp_path_factory.mktemp("inputs") / "docs.jsonl"
    docs = pydoc_docs() + fortunes_mixed(150)
    path.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(docs)))
    return path, docs


def test_train_then_encode_holds_out_the_same_documents(jsonl, tmp_path, capsys):
    path, docs = jsonl
    assert main(["tokenizer", "train", str(path), "--out", str(tmp_path / "tok"),
                 "--vocab-size", "1000", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "vocabulary: 1,024 tokens (requested 1,000, rounded up to a multiple of 128)" in out
    assert "special ids: <|endoftext|>=0, <|pad|>=1" in out
    train, held = split_documents(docs, 0.05, seed=0)
    meta = read_metadata(tmp_path / "tok" / "tokenizer.json")
    assert meta["corpus"]["documents"] == len(train)  # trained on the train split only
    assert meta["corpus"]["sources"] == [str(path)]

    assert main(["tokenizer", "encode", str(path), "--tokenizer",
                 str(tmp_path / "tok" / "tokenizer.json"), "--out", str(tmp_path / "shards"),
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert f"val: {len(held):,} documents" in out and "recorded in every shard header" in out
    val = ShardSet(tmp_path / "shards" / "val")
    assert val.headers[0].num_docs == len(held)
    assert val.tokenizer_hash == meta["hash"]


def test_sentencepiece_kind(jsonl, tmp_path, capsys):
    path, _ = jsonl
    assert main(["tokenizer", "train", str(path), "--out", str(tmp_path), "--kind", "spm-bpe",
                 "--vocab-size", "1024", "--no-progress"]) == 0
    assert "(spm-bpe)" in capsys.readouterr().out
    assert open_codec(tmp_path / "tokenizer.model").vocab_size == 1024


def test_sweep_prints_a_table_and_writes_json_and_png(jsonl, tmp_path, capsys):
    path, _ = jsonl
    assert main(["tokenizer", "sweep", str(path), "--out", str(tmp_path), "--sizes",
                 "512,1024,2048", "--model", "tiny", "--val-fraction", "0.2",
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "recommended vocabulary" in out and "outside their fitted" in out
    doc = json.loads((tmp_path / "sweep.json").read_text())
    assert [p["requested"] for p in doc["points"]] == [512, 1024, 2048]
    assert doc["model"]["name"] == "tiny" and doc["model"]["dim"] == 128
    assert (tmp_path / "sweep.png").stat().st_size > 10_000
    assert (tmp_path / f"v{doc['recommendation']['vocab_size']}" / "tokenizer.json").is_file()


@pytest.mark.parametrize("argv, message", [
    (["train", "/nonexistent/input", "--out", "x"], "no input files at /nonexistent/input"),
    (["train", "{jsonl}", "--out", "{tmp}", "--vocab-size", "100"], "cannot hold the 256 byte"),
    (["sweep", "{jsonl}", "--out", "{tmp}", "--sizes", "4k"], "must be whole numbers"),
    (["sweep", "{jsonl}", "--out", "{tmp}", "--model", "gpt9"], "neither a preset"),
    (["encode", "{jsonl}", "--out", "{tmp}", "--tokenizer", "{jsonl}"], "not a HF tokenizer.json"),
    (["encode", "{jsonl}", "--out", "{tmp}", "--tokenizer", "{this}"], "not a SentencePiece model"),
    (["encode", "{jsonl}", "--out", "{tmp}", "--tokenizer", "/no/tok.json"], "does not exist"),
    (["train", "{jsonl}", "--out", "{tmp}", "--val-fraction", "1.5"], "--val-fraction"),
])
def test_user_errors_are_one_line_with_exit_code_2(jsonl, tmp_path, capsys, argv, message):
    argv = [a.format(jsonl=jsonl[0], tmp=tmp_path, this=__file__) for a in argv]
    assert main(["tokenizer", *argv, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("crucible tokenizer: error:") and message in err
    assert "Traceback" not in err


def test_cli_module_imports_nothing_heavy():
    import subprocess
    import sys

    code = ("import sys; import crucible.trainer.commands.tokenizer; "
            "heavy = {'numpy', 'tokenizers', 'sentencepiece', 'matplotlib', 'torch'} "
            "& set(sys.modules); "
            "print(sorted(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
