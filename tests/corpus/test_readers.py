"""Readers: every format, malformed records counted under their own reason, and s3:// inputs on
the stack's real S3 server."""

from __future__ import annotations

import gzip
import io
import json
import secrets
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from crucible.trainer import storage
from crucible.trainer.corpus.document import Document, Malformed
from crucible.trainer.corpus.readers import Reader
from crucible.trainer.corpus.shards import InputFile, Shard, detect_format
from tests.corpus import realtext

COOKIES = [t for t in realtext.fortunes("en") if realtext.is_prose(t)][:5]


def read(path, fmt=None, index=0):
    uri = str(path)
    return list(Reader().read(InputFile("src", uri, str(path.parent), fmt or detect_format(uri),
                                        index)))


def jsonl_bytes() -> bytes:
    return "".join(json.dumps({"id": f"c{i}", "text": t, "lang": "en"}) + "\n"
                   for i, t in enumerate(COOKIES)).encode()


@pytest.mark.parametrize("name,pack", [("a.jsonl", lambda b: b), ("a.jsonl.gz", gzip.compress),
                                       ("a.jsonl.zst", zstandard.compress)])
def test_jsonl_plain_gzip_zstd(tmp_path, name, pack):
    (tmp_path / name).write_bytes(pack(jsonl_bytes()))
    records = read(tmp_path / name, index=3)
    assert [r.text for r in records] == COOKIES
    assert records[1].id == "c1" and records[1].metadata == {"lang": "en"}
    assert records[1].key == (3 << 32) | 1 and records[1].source == "src"


def test_malformed_jsonl_records_are_counted_not_lost(tmp_path):
    lines = [json.dumps({"text": COOKIES[0]}).encode(), b"{not json", b"\xff\xfe broken",
             json.dumps({"text": "   "}).encode(), json.dumps({"id": 7}).encode(), b"",
             json.dumps([COOKIES[1]]).encode()]
    (tmp_path / "m.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    records = read(tmp_path / "m.jsonl")
    assert isinstance(records[0], Document) and records[0].id == "m.jsonl#1"
    assert [r.reason for r in records[1:]] == ["bad_json", "bad_utf8", "empty_text",
                                               "missing_text", "blank_line", "bad_json"]
    assert records[2].raw.startswith("\ufffd") and records[1].size_bytes == 10


def test_parquet_rows(tmp_path):
    topics = list(realtext.pydoc_topics().items())[:4]
    pq.write_table(pa.table({"id": [k for k, _ in topics], "text": [v for _, v in topics[:3]] + [None]}),
                   tmp_path / "t.parquet")
    records = read(tmp_path / "t.parquet")
    assert [r.id for r in records] == [k for k, _ in topics]
    assert records[0].text == topics[0][1] and isinstance(records[3], Malformed)
    assert records[3].reason == "missing_text"


def test_text_tree_html_and_bad_utf8(tmp_path):
    html = realtext.html_manuals()[0]
    shutil.copy(html, tmp_path / "page.html")
    (tmp_path / "cookie.txt").write_text(COOKIES[0])
    (tmp_path / "latin1.txt").write_bytes("Straße, Größe".encode("latin-1"))
    by_id = {r.id: r for f in sorted(tmp_path.iterdir()) for r in read(f)}
    assert by_id["page.html"].metadata["format"] == "html"
    assert by_id["cookie.txt"].text == COOKIES[0]
    assert by_id["latin1.txt"].reason == "bad_utf8"


def test_warc_html_responses(tmp_path):
    from warcio.statusandheaders import StatusAndHeaders
    from warcio.warcwriter import WARCWriter

    pages = [p.read_bytes() for p in realtext.html_manuals()[:2]]
    with open(tmp_path / "crawl.warc.gz", "wb") as out:
        writer = WARCWriter(out, gzip=True)
        for i, body in enumerate(pages):
            headers = StatusAndHeaders("200 OK", [("Content-Type", "text/html; charset=utf-8")],
                                       protocol="HTTP/1.0")
            writer.write_record(writer.create_warc_record(f"http://docs.example/{i}", "response",
                                                          payload=io.BytesIO(body),
                                                          http_headers=headers))
        writer.write_record(writer.create_warc_record("http://docs.example/", "request",
                                                      payload=io.BytesIO(b"GET / HTTP/1.0\r\n\r\n")))
    records = read(tmp_path / "crawl.warc.gz")
    assert [r.metadata["url"] for r in records] == ["http://docs.example/0", "http://docs.example/1"]
    assert records[0].text == pages[0].decode() and records[0].metadata["format"] == "html"


def test_shard_spec():
    assert Shard.parse("2/5") == Shard(2, 5)
    assert Shard.parse("auto/4", {"JOB_COMPLETION_INDEX": "3"}) == Shard(3, 4)
    for bad in ("5/5", "x", "auto/4"):
        with pytest.raises(ValueError):
            Shard.parse(bad, {})


@pytest.mark.stack
def test_s3_inputs_and_outputs(s3_storage):
    s3 = s3_storage
    prefix = f"s3://{s3.bucket}/corpus-test/{secrets.token_hex(4)}"
    storage.write_bytes(f"{prefix}/raw/a.jsonl.zst", zstandard.compress(jsonl_bytes()))
    storage.write_bytes(f"{prefix}/raw/b.txt", COOKIES[0].encode())
    storage.write_bytes(f"{prefix}/rawer/c.txt", b"must not be listed under raw/")
    files = storage.list_files(f"{prefix}/raw")
    assert files == [f"{prefix}/raw/a.jsonl.zst", f"{prefix}/raw/b.txt"]
    records = [r for i, f in enumerate(files) for r in
               Reader().read(InputFile("s3src", f, f"{prefix}/raw", detect_format(f), i))]
    assert [r.text for r in records] == COOKIES + COOKIES[:1]
    assert records[-1].id == "b.txt"
    assert storage.exists(f"{prefix}/raw/b.txt") and not storage.exists(f"{prefix}/raw/zz")
