"""Hostile and broken inputs: every one is counted under its own reason, none reads more than the
caps allow into memory, the records before a file's problem are kept, and a run over a folder of
them completes with the good records of every file.

The big inputs cost little disk or time: the 2 GB JSONL line is a sparse file, the bombs are
zeros compressed as they are generated (4 GiB of zeros are ~130 kB of zstd)."""

from __future__ import annotations

import codecs
import functools
import gzip
import io
import json
import time
import tracemalloc
import zlib
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from crucible.api.spec import ConfigError
from crucible.trainer.corpus import config as corpus_config
from crucible.trainer.corpus import pipeline
from crucible.trainer.corpus.bounded import MiB, ReadLimits
from crucible.trainer.corpus.charset import PRESCAN_BYTES, WEB_CODECS, meta_charset, web_codec
from crucible.trainer.corpus.document import Document, Malformed
from crucible.trainer.corpus.readers import Reader
from crucible.trainer.corpus.shards import InputFile, detect_format
from tests.corpus import realtext

COOKIES = [t for t in realtext.fortunes("en") if realtext.is_prose(t)][:4]
GiB = 1 << 30


def read(path: Path, limits: ReadLimits = ReadLimits()) -> list:
    uri = str(path)
    return list(Reader(limits=limits).read(InputFile("src", uri, str(path.parent),
                                                     detect_format(uri), 0)))


def summary(records: list) -> list[str]:
    """Each record as "doc" or its reason ("reason!" for a file's problem)."""
    return ["doc" if isinstance(r, Document) else r.reason + "!" * r.file_problem for r in records]


def jsonl(texts: list[str]) -> bytes:
    return "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()


def warc(responses: list[tuple[str, bytes]], compress: bool = True) -> bytes:
    """A WARC of HTTP responses, each (Content-Type, body)."""
    from warcio.statusandheaders import StatusAndHeaders
    from warcio.warcwriter import WARCWriter

    out = io.BytesIO()
    writer = WARCWriter(out, gzip=compress)
    for i, (content_type, body) in enumerate(responses):
        headers = StatusAndHeaders("200 OK", [("Content-Type", content_type)], protocol="HTTP/1.1")
        writer.write_record(writer.create_warc_record(f"http://site.example/{i}", "response",
                                                      payload=io.BytesIO(body),
                                                      http_headers=headers))
    return out.getvalue()


def page(text: str) -> str:
    return f"<html><body><p>{text}</p></body></html>"


def zeros_compressed(pack: str, size: int, prefix: bytes) -> bytes:
    """`prefix` then `size` zero bytes, compressed as a stream: the output stays small."""
    out = io.BytesIO()
    writer = (gzip.GzipFile(fileobj=out, mode="wb", compresslevel=1) if pack == "gz" else
              zstandard.ZstdCompressor(level=1).stream_writer(out, closefd=False))
    writer.write(prefix)
    chunk = bytes(4 * MiB)
    for _ in range(size // len(chunk)):
        writer.write(chunk)
    writer.close()
    return out.getvalue()


def peak_memory(fn):
    """fn()'s result and the most memory Python held at once while it ran."""
    tracemalloc.start()
    try:
        result = fn()
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


# ---- decoding ------------------------------------------------------------------------------------
# A body no charset decodes to text: compressed bytes served as HTML (deterministic, unlike random).
BINARY = zlib.compress(page(" ".join(COOKIES)).encode())


@functools.cache
def man_text(lang: str, chars: int = 1500) -> str:
    """The start of man-db's apropos(1) page in `lang`, rendered: real Russian or Japanese text."""
    return realtext.man_page(realtext.MAN / lang / "man1/apropos.1.gz")[:chars]


def test_warc_charsets_that_are_no_web_encoding_are_skipped_not_raised(tmp_path):
    html = page(COOKIES[0])
    (tmp_path / "crawl.warc.gz").write_bytes(warc([
        ("text/html; charset=utf-8", html.encode()),
        ("text/html; charset=punycode", b"caf\xc3\xa9-bombe"),   # raised UnicodeError once
        ("text/html; charset=hex", b"<p>not hex</p>"),             # LookupError
        ("text/html; charset=x-no-such-charset", html.encode()),
        ("text/html; charset=unicode_escape", b"\\N{BULLET} Python syntax, not a charset"),
        ("text/html; charset=punycode", BINARY),
        ("text/html; charset=shift_jis", BINARY),
        ("text/html; charset=ISO-8859-1", page("Stra\xdfe").encode("latin-1")),
        ("text/html; charset=windows-874",
         page("\u0e2a\u0e27\u0e31\u0e2a\u0e14\u0e35").encode("cp874")),
    ]))
    records = read(tmp_path / "crawl.warc.gz")
    # An unknown label is skipped as browsers skip it: UTF-8 reads the next four.
    assert summary(records) == ["doc"] * 5 + ["unknown_charset", "bad_encoding", "doc", "doc"]
    assert [r.metadata["charset_source"] for r in records if isinstance(r, Document)] == [
        "http", "utf8", "default", "default", "default", "http", "http"]
    assert records[1].text == "caf\xe9-bombe"
    assert records[4].text == "\\N{BULLET} Python syntax, not a charset"   # not interpreted
    assert records[5].raw == "text/html; charset=punycode"
    assert "Stra\xdfe" in records[7].text and "\u0e2a" in records[8].text


def test_web_codecs_are_python_codec_names():
    assert all(codecs.lookup(name).name == name for name in WEB_CODECS)
    assert web_codec("UTF8") == web_codec('"utf-8"') == "utf-8"
    assert web_codec("windows-874") == "cp874" and web_codec("Windows-1251") == "cp1251"
    assert web_codec("utf\x00-8") is None and web_codec("punycode") is None


def test_a_windows_1251_page_declared_utf8_is_decoded_not_dropped(tmp_path):
    body = page(man_text("ru")).encode("cp1251", "replace")
    (tmp_path / "crawl.warc.gz").write_bytes(warc([("text/html; charset=utf-8", body)]))
    [record] = read(tmp_path / "crawl.warc.gz")
    assert isinstance(record, Document), record
    assert record.text == body.decode("cp1251") and "справочных" in record.text
    assert (record.metadata["charset"], record.metadata["charset_source"]) == ("cp1251", "detected")


def test_a_utf8_page_with_legacy_labels_is_read_as_utf8_not_mojibake(tmp_path):
    text = man_text("ru")
    body = (f'<html><head><meta charset="windows-1251"></head><body><p>{text}</p></body>'
            '</html>').encode()
    (tmp_path / "crawl.warc.gz").write_bytes(warc([("text/html; charset=ISO-8859-1", body)]))
    [record] = read(tmp_path / "crawl.warc.gz")
    assert record.text == body.decode() and "справочных" in record.text
    assert (record.metadata["charset"], record.metadata["charset_source"]) == ("utf-8", "utf8")


@pytest.mark.parametrize("codec, head", [
    ("koi8-r", '<meta charset="KOI8-R">'),
    ("shift_jis", '<!-- <meta charset="utf-8"> is a comment -->'
                  '<meta http-equiv="Content-Type" content="text/html; charset=Shift_JIS">'),
])
def test_a_page_without_an_http_charset_is_read_by_its_meta(tmp_path, codec, head):
    text = man_text("ru" if codec == "koi8-r" else "ja")
    body = f"<html><head>{head}</head><body><p>{text}</p></body></html>".encode(codec, "replace")
    (tmp_path / "crawl.warc.gz").write_bytes(warc([("text/html", body)]))
    [record] = read(tmp_path / "crawl.warc.gz")
    assert record.text == body.decode(codec)
    assert (record.metadata["charset"], record.metadata["charset_source"]) == (codec, "meta")


def test_meta_prescan_follows_the_html_spec():
    assert meta_charset(b"<html><head><meta charset='windows-1251'>") == "cp1251"
    assert meta_charset(b"<META HTTP-EQUIV=content-type CONTENT='text/html;charset=euc-jp'>") \
        == "euc_jp"
    assert meta_charset(b'<meta charset="UTF-16LE">') == "utf-8"      # read as ASCII: not UTF-16
    assert meta_charset(b'<meta charset="x-user-defined">') == "cp1252"
    assert meta_charset(b"<meta charset=punycode><meta charset=koi8-r>") == "koi8-r"
    assert meta_charset(b"<!-- <meta charset=koi8-r> -->") is None
    assert meta_charset(b" " * PRESCAN_BYTES + b"<meta charset=koi8-r>") is None  # past the scan


def test_a_utf8_page_cut_inside_a_character_keeps_its_label(tmp_path):
    body = page(man_text("ru")).encode()
    cut = body[:body.index("справочных".encode()) + 1]          # half of the "с"
    (tmp_path / "crawl.warc.gz").write_bytes(warc([("text/html; charset=utf-8", cut)]))
    [record] = read(tmp_path / "crawl.warc.gz")
    assert record.text == cut[:-1].decode() and record.metadata["charset_source"] == "http"


def test_pages_are_counted_by_how_they_were_decoded(tmp_path):
    ru = page(man_text("ru"))
    (tmp_path / "crawl.warc.gz").write_bytes(warc([
        ("text/html; charset=utf-8", ru.encode()),
        ("text/html; charset=utf-8", ru.encode("cp1251", "replace")),
        ("text/html", BINARY),
        ("text/html", codecs.BOM_UTF16_LE + ru.encode("utf-16-le")),
    ]))
    reader = Reader()
    uri = str(tmp_path / "crawl.warc.gz")
    records = list(reader.read(InputFile("src", uri, str(tmp_path), "warc", 0)))
    assert summary(records) == ["doc", "doc", "bad_encoding", "doc"]
    assert records[2].raw                                      # an excerpt for the report
    assert reader.counters == {"charset_http": 1, "charset_detected": 1, "charset_bom": 1}


def test_html_files_get_the_same_fallback(tmp_path):
    ru = man_text("ru")
    (tmp_path / "meta.html").write_bytes(
        f'<html><head><meta charset="koi8-r"></head><body>{ru}</body></html>'.encode("koi8-r",
                                                                                    "replace"))
    (tmp_path / "bare.html").write_bytes(page(ru).encode("cp1251", "replace"))
    (tmp_path / "binary.html").write_bytes(BINARY)
    (tmp_path / "cp1251.txt").write_bytes(ru.encode("cp1251", "replace"))
    by_name = {p.name: read(p)[0] for p in tmp_path.iterdir()}
    assert by_name["meta.html"].metadata["charset_source"] == "meta"
    assert by_name["bare.html"].metadata["charset"] == "cp1251" and "справочных" in \
        by_name["bare.html"].text
    assert by_name["binary.html"].reason == "bad_encoding"
    assert by_name["cp1251.txt"].reason == "bad_utf8"      # text files are UTF-8 by contract


def test_json_lines_that_crash_parsers_are_counted(tmp_path):
    lines = [json.dumps({"text": COOKIES[0]}).encode(),
             b"[" * 100_000,                                        # RecursionError
             b'{"text": "big", "n": ' + b"9" * 5000 + b"}",         # over Python's int digits
             b'{"text": "lone \\ud800 surrogate"}',                  # cannot be written as UTF-8
             b'{"text": "a pair is fine: \\ud83d\\ude00"}']
    (tmp_path / "j.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    records = read(tmp_path / "j.jsonl")
    assert summary(records) == ["doc", "bad_json", "bad_json", "lone_surrogate", "doc"]
    assert records[4].text == "a pair is fine: \U0001f600"


# ---- truncated and corrupt files -----------------------------------------------------------------
@pytest.mark.parametrize("pack", ["gz", "zst"])
def test_truncated_file_keeps_the_records_before_the_cut(tmp_path, pack):
    texts = [f"{COOKIES[i % 4]} ({i})" for i in range(2000)]
    packed = gzip.compress(jsonl(texts)) if pack == "gz" else zstandard.compress(jsonl(texts))
    path = tmp_path / f"cut.jsonl.{pack}"
    path.write_bytes(packed[:len(packed) // 2])
    records = read(path)
    *docs, problem = records
    assert docs and all(isinstance(d, Document) for d in docs)
    assert [d.text for d in docs] == texts[:len(docs)] and len(docs) < len(texts)
    assert (problem.reason, problem.file_problem, problem.id) == ("truncated_file", True, path.name)
    assert problem.key == docs[-1].key + 1


def test_multi_frame_zstd_is_read_to_the_end(tmp_path):
    (tmp_path / "frames.jsonl.zst").write_bytes(zstandard.compress(jsonl(COOKIES[:2]))
                                                + zstandard.compress(jsonl(COOKIES[2:])))
    assert [r.text for r in read(tmp_path / "frames.jsonl.zst")] == COOKIES


@pytest.mark.parametrize("name,content,reason", [
    ("fake.jsonl.gz", b"plain text, not gzip\n", "bad_compression"),
    ("fake.jsonl.zst", b"plain text, not zstd\n", "bad_compression"),
    ("junk.parquet", b"PAR1" + b"\x00" * 64 + b"PAR1", "bad_parquet"),
    ("junk.warc", b"this is not a WARC record\r\n\r\n", "bad_warc"),   # nor parsed as ARC
])
def test_a_file_that_cannot_be_parsed_is_one_counted_problem(tmp_path, name, content, reason):
    (tmp_path / name).write_bytes(content)
    [problem] = read(tmp_path / name)
    assert (problem.reason, problem.file_problem, problem.id) == (reason, True, name)
    assert problem.raw                     # says what was wrong, for the report


@pytest.mark.parametrize("tail", [
    b"\x00garbage where a record should start\r\n",
    # A response without WARC-Target-URI: warcio raises AttributeError on it.
    b"WARC/1.0\r\nWARC-Type: response\r\nContent-Length: 20\r\n\r\nHTTP/1.1 200\r\n\r\n",
])
def test_bad_warc_record_keeps_the_responses_before_it(tmp_path, tail):
    good = warc([("text/html", page(COOKIES[0]).encode())], compress=False)
    (tmp_path / "mixed.warc").write_bytes(good + tail)
    records = read(tmp_path / "mixed.warc")
    assert summary(records) == ["doc", "bad_warc!"]
    assert records[0].text == page(COOKIES[0])


def test_warc_header_bomb_stops_at_the_record_cap(tmp_path):
    # One 64 MiB header line, gzipped to ~64 kB: warcio alone would read all of it into memory.
    good = warc([("text/html", page(COOKIES[0]).encode())], compress=False)
    header = b"WARC/1.0\r\nWARC-Type: response\r\nX-Bomb: " + b"a" * (64 * MiB) + b"\r\n\r\n"
    (tmp_path / "bomb.warc.gz").write_bytes(gzip.compress(good + header, compresslevel=1))
    records, peak = peak_memory(lambda: read(tmp_path / "bomb.warc.gz",
                                             ReadLimits(max_record_bytes=1 * MiB)))
    assert summary(records) == ["doc", "bad_warc!"]
    assert peak < 16 * MiB


def test_parquet_values_are_checked_per_record(tmp_path):
    text = pa.array([COOKIES[0].encode(), b"\xff\xfe not UTF-8", b"x" * (2 * MiB), None],
                    type=pa.binary()).view(pa.string())   # Arrow writes what it is given
    pq.write_table(pa.table({"id": ["a", "b", "c", "d"], "text": text}), tmp_path / "t.parquet")
    records = read(tmp_path / "t.parquet", ReadLimits(max_record_bytes=1 * MiB))
    assert summary(records) == ["doc", "bad_utf8", "record_too_large", "missing_text"]
    assert [r.id for r in records] == ["a", "b", "c", "d"]
    assert records[2].size_bytes == 2 * MiB


# ---- size caps -----------------------------------------------------------------------------------
def test_a_2_gb_json_line_is_skipped_with_bounded_memory(tmp_path):
    path = tmp_path / "huge.jsonl"
    with open(path, "wb") as out:       # sparse: 2 GiB of NULs without a newline, then a record
        out.write(b'{"text": "')
        out.seek(2 * GiB)
        out.write(b'"}\n' + jsonl(COOKIES[:1]))
    assert path.stat().st_blocks * 512 < 1 * MiB
    started = time.perf_counter()
    records, peak = peak_memory(lambda: read(path))
    assert summary(records) == ["record_too_large", "doc"]
    assert records[0].size_bytes == 2 * GiB + 3 and records[1].text == COOKIES[0]
    # The default cap is 8 MiB: at most the cap, a read-ahead buffer and a skip step at once.
    assert peak < 32 * MiB
    assert time.perf_counter() - started < 60


@pytest.mark.parametrize("pack,size", [("zst", 4 * GiB), ("gz", 1 * GiB)])
def test_decompression_bomb_stops_at_the_file_cap(tmp_path, pack, size):
    path = tmp_path / f"bomb.jsonl.{pack}"
    path.write_bytes(zeros_compressed(pack, size, prefix=jsonl(COOKIES)))
    assert path.stat().st_size < size / 200       # gzip tops out near 1000:1, zstd far above
    limits = ReadLimits(max_file_bytes=64 * MiB)
    records, peak = peak_memory(lambda: read(path, limits))
    assert summary(records) == ["doc"] * 4 + ["file_too_large!"]
    assert [r.text for r in records[:4]] == COOKIES
    assert peak < 48 * MiB           # the 8 MiB record cap, buffers and an 8 MiB zstd step


def test_whole_files_over_the_record_cap_are_not_read(tmp_path):
    (tmp_path / "big.txt").write_bytes(b"word " * (1 * MiB))
    (tmp_path / "small.html").write_text(page(COOKIES[0]))
    limits = ReadLimits(max_record_bytes=1 * MiB)
    [big] = read(tmp_path / "big.txt", limits)
    assert (big.reason, big.size_bytes) == ("record_too_large", MiB + 1)
    assert summary(read(tmp_path / "small.html", limits)) == ["doc"]


def test_limits_in_the_config():
    base = {"output": "/tmp/x", "sources": [{"name": "a", "paths": ["/tmp/a"]}]}
    assert corpus_config.from_dict(base).limits == ReadLimits(8 * MiB, 16 * GiB)
    cfg = corpus_config.from_dict({**base, "limits": {"max_record_bytes": 1024}})
    assert cfg.limits == ReadLimits(1024, 16 * GiB)
    assert corpus_config.describe(cfg)["limits"] == {"max_record_bytes": 1024,
                                                     "max_file_bytes": 16 * GiB,
                                                     "max_row_group_bytes": 1 * GiB,
                                                     "max_step_seconds": 10.0}
    for bad in ({"max_record_bytes": 0}, {"max_file_bytes": "1G"}, {"max_line": 1}):
        with pytest.raises(ConfigError):
            corpus_config.from_dict({**base, "limits": bad})


# ---- a whole run ---------------------------------------------------------------------------------
def test_a_run_over_hostile_files_completes_and_keeps_every_good_record(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "a-good.jsonl").write_bytes(jsonl(COOKIES[:2]))
    (raw / "b-punycode.warc.gz").write_bytes(warc([
        ("text/html; charset=punycode", BINARY), ("text/html", page(COOKIES[2]).encode())]))
    cut = gzip.compress(jsonl([f"{COOKIES[3]} ({i})" for i in range(2000)]))
    (raw / "c-cut.jsonl.gz").write_bytes(cut[:len(cut) // 2])
    (raw / "d-bomb.jsonl.zst").write_bytes(zeros_compressed("zst", 1 * GiB,
                                                            prefix=jsonl(COOKIES[:1])))
    with open(raw / "e-huge-line.jsonl", "wb") as out:
        out.write(b'{"text": "')
        out.seek(4 * MiB)
        out.write(b'"}\n' + jsonl(COOKIES[1:2]))
    (raw / "f-junk.parquet").write_bytes(b"PAR1 not really PAR1")
    output = tmp_path / "out"
    cfg = corpus_config.from_dict({
        "output": str(output), "sources": [{"name": "web", "paths": [str(raw)]}],
        "steps": [], "dedup": {"exact": False, "near": False},
        "limits": {"max_record_bytes": 1 * MiB, "max_file_bytes": 32 * MiB}})
    pipeline.run_local(cfg, 2)

    report = json.loads((output / "report.json").read_text())
    assert report["checks"]["adds_up"]
    [read_step] = report["steps"]
    reasons = {r["reason"]: r["docs"] for r in read_step["reasons"]}
    assert reasons == {"unknown_charset": 1, "truncated_file": 1, "file_too_large": 1,
                       "record_too_large": 1, "bad_parquet": 1}
    assert [(p["file"], p["reason"]) for p in read_step["problem_files"]] == [
        ("c-cut.jsonl.gz", "truncated_file"), ("d-bomb.jsonl.zst", "file_too_large"),
        ("f-junk.parquet", "bad_parquet")]
    assert report["summary"]["problem_files"] == 3
    assert "f-junk.parquet" in (output / "report.html").read_text()
    kept = [doc.text for shard in sorted((output / "filtered").glob("shard-*.jsonl.zst"))
            for doc in pipeline.read_docs(str(shard))]
    cut_kept = [t for t in kept if t.startswith(COOKIES[3])]
    assert len(cut_kept) > 100                                     # the cut file's first half
    # a-good's two, the WARC's good page (no extract step here), the bomb's and the huge line's
    # neighbour.
    assert sorted(t for t in kept if t not in cut_kept) == sorted(
        [COOKIES[0], COOKIES[1], page(COOKIES[2]), COOKIES[0], COOKIES[1]])


@pytest.mark.stack
def test_s3_parquet_is_spooled_within_the_file_cap(s3_storage, tmp_path):
    from crucible.trainer import storage

    s3 = s3_storage
    pq.write_table(pa.table({"text": COOKIES}), tmp_path / "t.parquet")
    uri = f"s3://{s3.bucket}/corpus-test/{time.time_ns()}/t.parquet"
    storage.upload_file(tmp_path / "t.parquet", uri)
    file = InputFile("s3src", uri, uri.rsplit("/", 1)[0], "parquet", 0)
    assert [r.text for r in Reader().read(file)] == COOKIES
    size = (tmp_path / "t.parquet").stat().st_size
    [problem] = Reader(limits=ReadLimits(max_file_bytes=size - 1)).read(file)
    assert (problem.reason, problem.file_problem) == ("file_too_large", True)


# ---- HTTP bodies inside WARC records ----------------------------------------------------------
def http_warc(responses: list[tuple[list[tuple[str, str]], bytes]]) -> bytes:
    """An uncompressed WARC of HTML responses, each (extra HTTP headers, body as sent)."""
    from warcio.statusandheaders import StatusAndHeaders
    from warcio.warcwriter import WARCWriter

    out = io.BytesIO()
    writer = WARCWriter(out, gzip=False)
    for i, (extra, body) in enumerate(responses):
        headers = StatusAndHeaders("200 OK", [("Content-Type", "text/html"), *extra],
                                   protocol="HTTP/1.1")
        writer.write_record(writer.create_warc_record(f"http://site.example/{i}", "response",
                                                      payload=io.BytesIO(body),
                                                      http_headers=headers))
    return out.getvalue()


def chunked(body: bytes, size: int) -> bytes:
    parts = [b"%x\r\n%s\r\n" % (len(body[i:i + size]), body[i:i + size])
             for i in range(0, len(body), size)]
    return b"".join(parts) + b"0\r\n\r\n"


def deflated(body: bytes, wbits: int) -> bytes:
    packer = zlib.compressobj(9, zlib.DEFLATED, wbits)
    return packer.compress(body) + packer.flush()


GOOD = page(COOKIES[1]).encode()
ZEROS = bytes(256 * MiB)


@pytest.mark.parametrize("extra, body", [
    ([("Transfer-Encoding", "chunked")], chunked(ZEROS[:64 * MiB], 64 * MiB)),     # one chunk
    ([("Content-Encoding", "gzip")], gzip.compress(ZEROS, compresslevel=9)),
    ([("Transfer-Encoding", "chunked"), ("Content-Encoding", "gzip")],
     chunked(gzip.compress(ZEROS, compresslevel=9), 1 * MiB)),
    ([("Content-Encoding", "deflate")], deflated(ZEROS, -zlib.MAX_WBITS)),
], ids=["chunked", "gzip", "chunked+gzip", "raw-deflate"])
def test_an_http_body_bomb_in_a_warc_stops_at_the_record_cap(tmp_path, extra, body):
    """Bodies that inflate to 64-256 MiB from kilobytes of archive (the archive itself is
    gzipped: the repeated compressed zeros compress again) are record_too_large, read no
    further than the cap, and the records after them are kept."""
    archive = http_warc([(extra, body), ([], GOOD)])
    (tmp_path / "bomb.warc.gz").write_bytes(gzip.compress(archive, compresslevel=9))
    records, peak = peak_memory(lambda: read(tmp_path / "bomb.warc.gz",
                                             ReadLimits(max_record_bytes=1 * MiB)))
    assert summary(records) == ["record_too_large", "doc"]
    assert records[1].text == GOOD.decode()    # an HTML record: extraction is a later step
    assert peak < 16 * MiB   # the 1 MiB cap, a piece, the 64 KiB reads and the archive's buffers


# mtime=0: gzip stamps the current second into its header, and the bytes are part of the test
# ids, which every pytest-xdist worker must collect alike.
@pytest.mark.parametrize("extra, body", [
    ([("Transfer-Encoding", "chunked")], chunked(GOOD, 7)),
    ([("Content-Encoding", "gzip")], gzip.compress(GOOD, mtime=0)),
    ([("Transfer-Encoding", "chunked"), ("Content-Encoding", "GZIP")],
     chunked(gzip.compress(GOOD, mtime=0), 5)),
    ([("Content-Encoding", "deflate")], deflated(GOOD, zlib.MAX_WBITS)),     # zlib-wrapped
    ([("Content-Encoding", "deflate")], deflated(GOOD, -zlib.MAX_WBITS)),    # raw
    ([("Content-Encoding", "identity")], GOOD),
    ([("Content-Encoding", "gzip")], gzip.compress(GOOD, mtime=0)[:-20]),   # cut short
    ([("Transfer-Encoding", "chunked")], GOOD),                     # mislabelled: taken as sent
])
def test_http_bodies_are_decoded_as_sent(tmp_path, extra, body):
    (tmp_path / "ok.warc").write_bytes(http_warc([(extra, body)]))
    [record] = read(tmp_path / "ok.warc")
    assert isinstance(record, Document), record
    assert COOKIES[1][:40] in record.text


@pytest.mark.parametrize("extra, body, says", [
    ([("Content-Encoding", "gzip")], b"\x1f\x8b\x08\x00" + b"\xff" * 40, "gzip"),
    ([("Content-Encoding", "br")], b"\x0b\x02\x80hello\x03", "'br' is not gzip"),
])
def test_an_undecodable_http_body_is_counted_and_the_archive_goes_on(tmp_path, extra, body, says):
    (tmp_path / "bad.warc").write_bytes(http_warc([(extra, body), ([], GOOD)]))
    records = read(tmp_path / "bad.warc")
    assert summary(records) == ["bad_content_encoding", "doc"]
    assert says in records[0].raw


# ---- Parquet amplification ---------------------------------------------------------------------
def _proc_status(field: str) -> int:
    """A memory figure of this process from /proc/self/status, in bytes."""
    return int(Path("/proc/self/status").read_text().split(f"{field}:")[1].split()[0]) * 1024


def test_a_dictionary_parquet_bomb_is_never_expanded(tmp_path):
    """1,024 rows referring to one 1 MiB dictionary entry (a few KB of file, 1 MiB by the
    footer): each row is record_too_large, and neither Arrow nor Python ever holds the
    expansion (a gigabyte before)."""
    value = b"a" * (1 * MiB)
    text = pa.DictionaryArray.from_arrays(pa.array([0] * 1024, pa.int32()),
                                          pa.array([value.decode()]))   # made small, too
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(1024)], "text": text}),
                   tmp_path / "bomb.parquet", compression="zstd")
    assert (tmp_path / "bomb.parquet").stat().st_size < 64 * 1024
    # A pool of its own, so its high-water mark is this read's (Arrow takes the default pool
    # when a reader is made), and the process's peak RSS reset (Linux: clear_refs 5).
    previous, pool = pa.default_memory_pool(), pa.proxy_memory_pool(pa.system_memory_pool())
    pa.set_memory_pool(pool)
    Path("/proc/self/clear_refs").write_text("5")
    rss_before = _proc_status("VmRSS")
    try:
        records, peak = peak_memory(lambda: read(tmp_path / "bomb.parquet",
                                                 ReadLimits(max_record_bytes=512 * 1024)))
    finally:
        pa.set_memory_pool(previous)
    rss_growth = _proc_status("VmHWM") - rss_before
    assert summary(records) == ["record_too_large"] * 1024
    assert [r.id for r in records[:2]] == ["r0", "r1"] and records[0].size_bytes == MiB
    assert peak < 16 * MiB                                  # Python's
    assert pool.max_memory() < 64 * MiB                     # Arrow's
    assert rss_growth < 128 * MiB                           # the process's, all of it
    # Under the cap the values are made a slice at a time, in order, each one right.
    records = read(tmp_path / "bomb.parquet", ReadLimits(max_record_bytes=2 * MiB))
    assert summary(records) == ["doc"] * 1024 and records[-1].text == value.decode()


def test_a_row_group_over_the_cap_is_counted_and_the_next_is_read(tmp_path):
    texts = [COOKIES[0] * 40, COOKIES[1]]
    with pq.ParquetWriter(tmp_path / "g.parquet", pa.schema([("text", pa.string())]),
                          compression="zstd") as writer:
        writer.write_table(pa.table({"text": [f"{i} {texts[0]}" for i in range(64)]}))  # ~300 KB
        writer.write_table(pa.table({"text": [texts[1]]}))          # the next
    records = read(tmp_path / "g.parquet", ReadLimits(max_row_group_bytes=64 * 1024))
    assert summary(records) == ["row_group_too_large", "doc"]
    assert records[0].id.endswith("#1") and records[1].id.endswith("#65")
    assert records[1].text == texts[1]


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n >> 7 else 0))
        n >>= 7
        if not n:
            return bytes(out)


def test_a_footer_that_understates_its_row_group_is_caught_by_the_page_headers(tmp_path):
    """The footer's sizes are the file's word; Arrow allocates what each page's header declares.
    A footer patched to say 20 KB of a ~300 KB row group passes a footer-only cap (64 KiB here)
    and Arrow decodes the 300 KB; the page headers tell the truth and the group is skipped."""
    from types import SimpleNamespace

    from crucible.trainer.corpus.parquet_pages import declared_bytes

    path = tmp_path / "liar.parquet"
    rows = [f"{i} {COOKIES[0] * 40}" for i in range(64)]
    pq.write_table(pa.table({"text": rows}), path, compression="zstd", data_page_size=32 * 1024)
    column = pq.ParquetFile(path).metadata.row_group(0).column(0)
    honest = column.total_uncompressed_size
    with open(path, "rb") as f:
        pages = declared_bytes(f, column)
    # The headers' sum is the footer's count less the headers' own bytes.
    assert 0.95 * honest < pages <= honest and honest > 128 * 1024
    # Understate: every copy of the count (chunk and row group) in the footer, same length.
    data = path.read_bytes()
    footer_len = int.from_bytes(data[-8:-4], "little")
    footer = data[-8 - footer_len:-8]
    lie = 20_000
    truth_bytes, lie_bytes = _varint(honest << 1), _varint(lie << 1)
    assert len(truth_bytes) == len(lie_bytes) and footer.count(truth_bytes) >= 1
    path.write_bytes(data[:-8 - footer_len] + footer.replace(truth_bytes, lie_bytes) + data[-8:])
    assert pq.ParquetFile(path).metadata.row_group(0).column(0).total_uncompressed_size == lie
    records = read(path, ReadLimits(max_row_group_bytes=64 * 1024))
    assert summary(records) == ["row_group_too_large"]
    # Under a cap that holds it, the same file reads whole: the check refuses only the lie.
    assert summary(read(path, ReadLimits(max_row_group_bytes=1 << 20))) == ["doc"] * 64

    # A chunk whose pages are not page headers is a bad file, not a crash.
    garbage = tmp_path / "garbage.bin"
    garbage.write_bytes(bytes(range(256)) * 64)
    fake = SimpleNamespace(data_page_offset=7, has_dictionary_page=False,
                           dictionary_page_offset=None, total_compressed_size=10_000)
    from crucible.trainer.corpus.bounded import FileProblem
    with open(garbage, "rb") as f, pytest.raises(FileProblem, match="page header"):
        declared_bytes(f, fake)


@pytest.mark.parametrize("dictionary", [True, False])
def test_parquet_rows_keep_their_order_ids_and_nulls_by_either_reader(tmp_path, dictionary):
    texts = [COOKIES[i % 4] for i in range(3000)]
    texts[5] = None
    pq.write_table(pa.table({"id": list(range(3000)), "text": texts}), tmp_path / "o.parquet",
                   use_dictionary=dictionary)
    records = read(tmp_path / "o.parquet")
    assert [r.id for r in records] == [str(i) for i in range(3000)]
    assert records[5].reason == "missing_text"
    assert [r.text for r in records if isinstance(r, Document)] == [t for t in texts if t]


def test_nested_duplicate_and_missing_parquet_columns_are_counted_not_crashed(tmp_path):
    """A nested id column of one 1 MiB dictionary string (its to_pylist was uncapped), a
    nested text column, a text column twice, and a file with neither column (every column
    was read then): each is counted, none takes the shard down."""
    big = pa.DictionaryArray.from_arrays(pa.array([0] * 256, pa.int32()), pa.array(["a" * MiB]))
    nested_id = pa.ListArray.from_arrays(pa.array(range(0, 257), pa.int32()), big)
    pq.write_table(pa.table({"id": nested_id, "text": [COOKIES[0]] * 256}),
                   tmp_path / "nested-id.parquet", compression="zstd")
    records, peak = peak_memory(lambda: read(tmp_path / "nested-id.parquet"))
    assert summary(records) == ["doc"] * 256 and records[0].id.endswith("#1")
    assert peak < 32 * MiB
    pq.write_table(pa.table({"text": pa.array([[COOKIES[0]]])}), tmp_path / "nested.parquet")
    assert summary(read(tmp_path / "nested.parquet")) == ["bad_parquet!"]
    twice = pa.Table.from_arrays([pa.array([COOKIES[0]]), pa.array([COOKIES[1]])],
                                 names=["text", "text"])
    pq.write_table(twice, tmp_path / "twice.parquet")
    assert summary(read(tmp_path / "twice.parquet")) == ["bad_parquet!"]
    pq.write_table(pa.table({"blob": pa.array([b"x" * MiB] * 4)}), tmp_path / "other.parquet")
    assert summary(read(tmp_path / "other.parquet")) == ["missing_text"] * 4


def test_a_body_of_tiny_chunks_costs_its_size_not_an_object_a_chunk(tmp_path):
    """2 bytes a chunk: ~5 bytes of archive per 2 of body (552 MiB of RSS for a 29 MB record
    when every chunk was its own object)."""
    body = GOOD * (512 * 1024 // len(GOOD))
    (tmp_path / "tiny.warc").write_bytes(http_warc([([("Transfer-Encoding", "chunked")],
                                                     chunked(body, 2))]))
    records, peak = peak_memory(lambda: read(tmp_path / "tiny.warc"))
    assert summary(records) == ["doc"] and records[0].text == body.decode()
    assert peak < 8 * MiB


def test_deflate_is_told_from_raw_deflate_even_when_it_arrives_a_byte_at_a_time(tmp_path):
    (tmp_path / "d.warc").write_bytes(http_warc([(
        [("Transfer-Encoding", "chunked"), ("Content-Encoding", "deflate")],
        chunked(deflated(GOOD, zlib.MAX_WBITS), 1))]))
    [record] = read(tmp_path / "d.warc")
    assert isinstance(record, Document) and record.text == GOOD.decode()


# --- one document cannot end a run: time and errors per record --------------------------------------
def test_a_slow_or_raising_step_drops_that_document_and_the_run_goes_on():
    from dataclasses import dataclass
    from typing import ClassVar

    from crucible.trainer.corpus.step import Formatter, run_steps

    @dataclass
    class Hostile(Formatter):
        name: ClassVar[str] = "hostile"

        def format(self, text: str) -> str:
            if text == "slow":
                while True:   # pure Python: the time limit stops it
                    pass
            if text == "boom":
                raise ValueError("a step's parser choked")
            return text.upper()

    docs = [Document(text=t, id=str(i), source="web", key=i) for i, t in
            enumerate(["one", "slow", "two", "boom", "three"])]
    step = Hostile()
    stats = [step.new_stats()]
    started = time.perf_counter()
    kept = [d.text for d in run_steps(docs, [step], stats, time_limit_s=0.3)]
    assert time.perf_counter() - started < 5
    assert kept == ["ONE", "TWO", "THREE"]
    [s] = stats
    totals = s.totals()
    assert totals.dropped_docs == {"hostile_timeout": 1, "hostile_error": 1}
    assert (totals.docs_in, totals.docs_out) == (5, 3)


def test_a_step_that_swallows_exceptions_is_still_stopped_and_no_alarm_outlives_it():
    """Extractors guard their fallbacks with `except Exception` (trafilatura's recall retry and
    justext rescue), and some with a bare `except:`: the limit must stop both, and the alarm
    must be gone once the step returns."""
    import signal
    from dataclasses import dataclass
    from typing import ClassVar

    from crucible.trainer.corpus.step import Formatter, run_steps

    @dataclass
    class Guarded(Formatter):
        name: ClassVar[str] = "guarded"

        def format(self, text: str) -> str:
            if text == "fallbacks":   # each fallback swallows what its predecessor raised
                for _ in range(1_000):
                    try:
                        busy(0.1)
                    except Exception:   # noqa: BLE001 -- what the extractors do
                        pass
            if text == "bare":   # swallows one alarm of any kind, then returns a result
                try:
                    busy(5)
                except:  # noqa: E722
                    pass
                return "late"
            return text.upper()

    def busy(seconds: float) -> None:
        until = time.perf_counter() + seconds
        while time.perf_counter() < until:
            pass

    docs = [Document(text=t, id=str(i), source="web", key=i) for i, t in
            enumerate(["one", "fallbacks", "two", "bare", "three"])]
    step = Guarded()
    stats = [step.new_stats()]
    handler = signal.getsignal(signal.SIGALRM)
    started = time.perf_counter()
    kept = [d.text for d in run_steps(docs, [step], stats, time_limit_s=0.3)]
    assert time.perf_counter() - started < 10
    assert kept == ["ONE", "TWO", "THREE"]
    assert stats[0].totals().dropped_docs == {"guarded_timeout": 2}
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert signal.getsignal(signal.SIGALRM) is handler
    busy(0.2)   # an alarm left behind would raise here


# Nested tags past libxml2's depth limit (nothing extracted), and 200,000 paragraphs (4 MB;
# 17.6 s and 416 MiB for trafilatura unbounded).
NESTED_HTML = ("<html><body>" + "<div>" * 100_000 + "deep" + "</div>" * 100_000
               + "</body></html>").encode()
WIDE_HTML = ("<html><body>" + "<p>word word word</p>" * 200_000 + "</body></html>").encode()


def test_html_bombs_are_counted_and_bounded_in_a_run(tmp_path):
    """Nested tags (libxml2 stops at its depth limit: nothing extracted) and a page of 200,000
    paragraphs (4 MB; 17.6 s and 416 MiB for trafilatura unbounded) stopped by the step time
    limit; the good page beside them is kept."""
    import resource

    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "pages.warc.gz").write_bytes(warc([
        ("text/html", NESTED_HTML), ("text/html", WIDE_HTML),
        ("text/html", page(COOKIES[0]).encode())]))
    output = tmp_path / "out"
    cfg = corpus_config.from_dict({
        "output": str(output), "sources": [{"name": "web", "paths": [str(raw)]}],
        "steps": ["extract"], "dedup": {"exact": False, "near": False},
        "limits": {"max_step_seconds": 1}})
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    pipeline.run_local(cfg, 1)
    assert time.perf_counter() - started < 60
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    report = json.loads((output / "report.json").read_text())
    assert report["checks"]["adds_up"]
    extract = next(s for s in report["steps"] if s["step"] == "extract")
    reasons = {r["reason"]: r["docs"] for r in extract["reasons"]}
    assert reasons == {"empty_after_extract": 1, "extract_timeout": 1}, reasons
    kept = [doc.text for shard in sorted((output / "filtered").glob("shard-*.jsonl.zst"))
            for doc in pipeline.read_docs(str(shard))]
    assert len(kept) == 1 and COOKIES[0][:40] in kept[0]
    assert grown_mib < 256, grown_mib


def test_a_tag_of_100000_attributes_is_stopped_inside_the_parser(tmp_path, monkeypatch):
    """libxml2's HTML parser is quadratic in one tag's attributes and a C call outlives the
    limit's signal (100,000 here: about 15 s a parse, several parses in trafilatura); the
    extracting process is killed at the limit, and the next page gets a fresh one. A process
    that dies is `extract_error`, and the run goes on."""
    import os

    from crucible.trainer.corpus import extract
    from crucible.trainer.corpus.step import run_steps

    attrs = " ".join(f'a{i}="v"' for i in range(100_000))
    bomb = f"<html><body><p {attrs}>x</p></body></html>"
    good = page(COOKIES[0])
    original = extract._extract

    def dying(text, options):     # runs in the forked child
        if text == "die":
            os._exit(3)
        return original(text, options)

    monkeypatch.setattr(extract, "_extract", dying)
    docs = [Document(text=t, id=str(i), source="web", key=i, metadata={"format": "html"})
            for i, t in enumerate([good, bomb, good, "die", good])]
    step = extract.ExtractHtml()
    stats = [step.new_stats()]
    started = time.perf_counter()
    kept = list(run_steps(docs, [step], stats, time_limit_s=2))
    assert time.perf_counter() - started < 20
    assert [d.id for d in kept] == ["0", "2", "4"]
    assert COOKIES[0][:40] in kept[-1].text
    assert stats[0].totals().dropped_docs == {"extract_timeout": 1, "extract_error": 1}
    step._stop()


def test_the_step_time_limit_is_checked_in_the_config():
    with pytest.raises(ConfigError, match="max_step_seconds: want a positive number of seconds"):
        corpus_config.from_dict({"output": "x", "sources": [{"name": "a", "paths": ["y"]}],
                                 "limits": {"max_step_seconds": 0}})


def test_every_bomb_class_in_one_run_keeps_the_good_records_within_512_mib(tmp_path):
    """One corpus run, as a user starts it, over every bomb class at once: a chunked+gzip WARC
    body, nested and wide HTML, a dictionary Parquet, zstd and gzip zeros. Each is counted,
    every good record beside them is kept, and the run's peak RSS, its extraction processes
    included, stays under 512 MiB (the largest process of the run, as the kernel counts it)."""
    import subprocess
    import sys

    import yaml

    raw = tmp_path / "raw"
    raw.mkdir()
    body = chunked(gzip.compress(ZEROS, compresslevel=9), 1 * MiB)
    archive = http_warc([([("Transfer-Encoding", "chunked"), ("Content-Encoding", "gzip")],
                          body), ([], GOOD)])
    (raw / "a-body-bomb.warc.gz").write_bytes(gzip.compress(archive, compresslevel=9))
    (raw / "b-html-bombs.warc.gz").write_bytes(warc([
        ("text/html", NESTED_HTML), ("text/html", WIDE_HTML),
        ("text/html", page(COOKIES[0]).encode())]))
    text = pa.DictionaryArray.from_arrays(pa.array([0] * 1024, pa.int32()),
                                          pa.array(["a" * (8 * MiB)]))   # 8 GiB expanded
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(1024)], "text": text}),
                   raw / "c-dictionary.parquet", compression="zstd")
    (raw / "d-zeros.jsonl.zst").write_bytes(zeros_compressed("zst", 1 * GiB,
                                                             prefix=jsonl(COOKIES[2:3])))
    (raw / "e-zeros.jsonl.gz").write_bytes(zeros_compressed("gz", 256 * MiB,
                                                            prefix=jsonl(COOKIES[3:4])))
    output = tmp_path / "out"
    path = tmp_path / "corpus.yaml"
    path.write_text(yaml.safe_dump({
        "output": str(output), "sources": [{"name": "web", "paths": [str(raw)]}],
        "steps": ["extract"], "dedup": {"exact": False, "near": False},
        # Records up to 6 MiB: the HTML bombs (1.1 and 4.2 MB) reach the extraction.
        "limits": {"max_record_bytes": 6 * MiB, "max_file_bytes": 32 * MiB,
                   "max_step_seconds": 1}}))
    # A parent of its own, so the largest child it waited for is the run (or one of its
    # extraction processes), not anything else this test session started.
    measure = ("import resource, subprocess, sys; "
               "rc = subprocess.run(sys.argv[1:]).returncode; "
               "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(rc)")
    crucible = str(Path(sys.executable).with_name("crucible"))   # the installed command
    done = subprocess.run([sys.executable, "-c", measure, crucible, "corpus", "run",
                           "--config", str(path), "--workers", "1", "--no-progress"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    peak_mib = int(done.stdout.split()[-1]) / 1024
    report = json.loads((output / "report.json").read_text())
    assert report["checks"]["adds_up"]
    by_step = {s["step"]: {r["reason"]: r["docs"] for r in s["reasons"]}
               for s in report["steps"]}
    assert by_step["read"] == {"record_too_large": 1 + 1024, "file_too_large": 2}, by_step
    assert by_step["extract"] == {"empty_after_extract": 1, "extract_timeout": 1}, by_step
    kept = [doc.text for shard in sorted((output / "filtered").glob("shard-*.jsonl.zst"))
            for doc in pipeline.read_docs(str(shard))]
    for good in (COOKIES[1], COOKIES[0], COOKIES[2], COOKIES[3]):
        assert sum(good[:40] in t for t in kept) == 1, (good[:40], kept)
    assert len(kept) == 4
    print(f"corpus run over every bomb class: peak RSS {peak_mib:.0f} MiB")
    assert peak_mib < 512, peak_mib
