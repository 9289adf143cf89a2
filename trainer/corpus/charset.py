"""The charset of a web page's bytes, chosen the way browsers choose it, and the page's text.

Owns: `WEB_CODECS` (the charsets a body may be decoded with), `web_codec` (a charset label -> its
Python codec, or None), `meta_charset` (the HTML prescan) and `decode_page`, the fallback chain
that turns a body into text or says why it cannot. Must not: read files or archives (readers and
warc.py do) or count anything (the reader counts what this returns).

The chain, in the order browsers consult the same sources, each step tried only when the ones
before it gave nothing that decodes:
1. "bom": a UTF-8 or UTF-16 byte order mark (the Encoding Standard's BOM sniff, which overrides
   every label: https://encoding.spec.whatwg.org/#decode).
   "utf8": a body with non-ASCII bytes that is valid UTF-8 is UTF-8, whatever a label says (as
   trafilatura's decoder and Chromium's detector assume; see `_candidates`).
2. "http": the charset of the HTTP Content-Type.
3. "meta": a `<meta charset>` or `<meta http-equiv="Content-Type" content="...; charset=...">` in
   the first 1,024 bytes (HTML's "prescan a byte stream to determine its encoding",
   https://html.spec.whatwg.org/multipage/parsing.html#prescan-a-byte-stream-to-determine-its-encoding,
   simplified: comments are skipped, other tags are not parsed, so a "<meta" inside an attribute
   value would count; the spec reads 1,024 bytes too).
4. "default": UTF-8, what almost all of the web is now and what this reader assumed before. A
   browser would use its locale's legacy encoding or its own detector here; a crawl has no locale.
5. "detected": charset-normalizer on the first DETECT_BYTES of the body, restricted to WEB_CODECS
   but UTF-16; its candidates are tried in its order of confidence on the whole body.
One difference from a browser, on purpose: a browser decodes with the first label it finds and
shows U+FFFD for bytes that do not fit; here a label that does not decode is taken as wrong and the
next source is tried, because crawls hold pages declared UTF-8 and written in windows-1251 (a UTF-8
server configuration in front of old files), and the page decoded right is better training text
than one full of replacement characters. A legacy-charset body that a wrong legacy label decodes
without error (windows-1251 declared ISO-8859-1) is mojibake here as in a browser.

Every decode is strict except for a multi-byte character cut off at the very end of the body:
Common Crawl truncates captures at 1 MiB mid-character, and a strict decoder would otherwise send
such a UTF-8 page down to the detector, which can only find a wrong single-byte charset for it.

Charsets: a label may name any Python codec. `punycode` raises UnicodeError (and decodes in
quadratic time), `hex` and `rot13` raise LookupError, `unicode_escape` is Python syntax, not a
charset. Bodies are decoded only with the Encoding Standard's encodings (what browsers decode;
https://encoding.spec.whatwg.org/#names-and-labels) and Python's names for them; an unknown label
is skipped, as browsers skip it.
"""

from __future__ import annotations

import codecs
import re
from dataclasses import dataclass
from typing import Iterator

WEB_CODECS = frozenset({
    "utf-8", "utf-8-sig", "utf-16", "utf-16-be", "utf-16-le", "ascii", "cp866",
    "iso8859-1", "iso8859-2", "iso8859-3", "iso8859-4", "iso8859-5", "iso8859-6", "iso8859-7",
    "iso8859-8", "iso8859-9", "iso8859-10", "iso8859-11", "iso8859-13", "iso8859-14",
    "iso8859-15", "iso8859-16", "tis-620", "koi8-r", "koi8-u", "mac-roman", "mac-cyrillic",
    "cp874", "cp1250", "cp1251", "cp1252", "cp1253", "cp1254", "cp1255", "cp1256", "cp1257",
    "cp1258", "gbk", "gb2312", "gb18030", "big5", "big5hkscs", "euc_jp", "iso2022_jp",
    "shift_jis", "cp932", "euc_kr", "cp949"})
# The standard's names that Python does not know, as the Python codec that decodes them.
_WHATWG_ONLY = {"windows-874": "cp874", "x-mac-cyrillic": "mac-cyrillic",
                "iso-8859-8-i": "iso8859-8", "x-sjis": "shift_jis", "x-gbk": "gbk"}
_BOMS = ((codecs.BOM_UTF8, "utf-8"), (codecs.BOM_UTF16_LE, "utf-16-le"),
         (codecs.BOM_UTF16_BE, "utf-16-be"))

# The detector's candidates. UTF-16 is left out, as browsers' detectors leave it out (a page is
# UTF-16 by its BOM or its label): any even-length binary body decodes as UTF-16 into a run of
# CJK-looking characters, and charset-normalizer took 20 bytes of zlib output for UTF-16BE.
_DETECTABLE = sorted(WEB_CODECS - {"utf-16", "utf-16-be", "utf-16-le", "utf-8-sig"})

PRESCAN_BYTES = 1024        # the HTML spec's prescan reads at most this many bytes
# The detector may decode its whole input once per candidate that survives its sampling, each a
# full copy as str. 64 KiB is a few hundred lines of text, plenty to tell charsets apart; the bound
# keeps its time and copies independent of the record cap. Measured on this machine: 1-14 ms for
# 64 KiB of random bytes, Latin-1 noise or Cyrillic text; 10-60 ms for the same at 8 MiB.
DETECT_BYTES = 64 * 1024

_COMMENT = re.compile(rb"<!--.*?(?:-->|$)", re.DOTALL)
_META_TAG = re.compile(rb"<meta[\s/]([^>]*)", re.IGNORECASE)
_ATTRIBUTE = re.compile(rb"""([^\s=/>]+)(?:\s*=\s*("[^"]*"|'[^']*'|[^\s>]*))?""")
_CONTENT_CHARSET = re.compile(rb"""charset\s*=\s*(?:"([^"]*)"|'([^']*)'|([^\s;"']+))""",
                              re.IGNORECASE)
# Bytes below 0x40 are never the second byte of a Shift_JIS, GBK or Big5 pair, nor inside a UTF-8
# or EUC sequence: cutting the detector's prefix after one never splits a character.
_SAFE_CUT = re.compile(rb"[\x00-\x3f][^\x00-\x3f]*\Z")


@dataclass(frozen=True)
class Decoded:
    text: str
    codec: str        # the Python codec that decoded the body (one of WEB_CODECS)
    source: str       # which step of the chain found it: bom, http, meta, default, detected


def web_codec(label: str) -> str | None:
    """Python's codec for a charset label, or None when it names no web encoding."""
    label = label.strip().strip("\"'").strip()
    try:
        name = codecs.lookup(_WHATWG_ONLY.get(label.lower(), label)).name
    except (LookupError, ValueError):    # an unknown name; ValueError: a NUL in the name
        return None
    return name if name in WEB_CODECS else None


def _charset_label(content_type: str) -> str | None:
    """The charset named in an HTTP Content-Type, None when none is named."""
    for part in content_type.split(";")[1:]:
        name, _, value = part.strip().partition("=")
        if name.lower() == "charset" and value.strip("\"' "):
            return value.strip("\"' ")
    return None


def meta_charset(raw: bytes) -> str | None:
    """The Python codec a `<meta>` in the first PRESCAN_BYTES declares, or None."""
    head = _COMMENT.sub(b"", raw[:PRESCAN_BYTES])
    for tag in _META_TAG.finditer(head):
        attributes = {name.lower(): value.strip(b"\"'") for name, value in
                      _ATTRIBUTE.findall(tag.group(1))}
        label = attributes.get(b"charset")
        if not label and attributes.get(b"http-equiv", b"").lower() == b"content-type":
            found = _CONTENT_CHARSET.search(attributes.get(b"content", b""))
            label = found and next(g for g in found.groups() if g is not None)
        if label:
            # The prescan's own rules (HTML spec, its "<meta" step): x-user-defined is
            # bytes as windows-1252 shows them, and a page whose <meta> could be read as ASCII is
            # not UTF-16 whatever it says.
            label_text = label.decode("ascii", "replace").strip().lower()
            codec = web_codec("cp1252" if label_text == "x-user-defined" else label_text)
            if codec is not None:
                return "utf-8" if codec.startswith("utf-16") else codec
    return None


def _decode(raw: bytes, codec: str) -> str | None:
    """`raw` in `codec`, strictly but for a character cut off at the end; None if it fails."""
    try:
        return codecs.getincrementaldecoder(codec)("strict").decode(raw, final=False)
    except UnicodeError:
        return None


def _detected(raw: bytes) -> list[str]:
    """charset-normalizer's candidates for the body's first DETECT_BYTES, best first."""
    from charset_normalizer import from_bytes

    prefix = raw
    if len(raw) > DETECT_BYTES:
        prefix = raw[:DETECT_BYTES]
        cut = _SAFE_CUT.search(prefix)
        prefix = prefix[:cut.start() + 1] if cut else prefix
    # preemptive_behaviour off: the declared charsets were tried before and did not decode.
    matches = from_bytes(prefix, cp_isolation=_DETECTABLE, preemptive_behaviour=False)
    return [name for name in (web_codec(m.encoding) for m in matches) if name is not None]


def decode_page(raw: bytes, content_type: str | None) -> Decoded | str:
    """The page's text and how its charset was found, or the reason it cannot be decoded:
    `unknown_charset` when the Content-Type named no web encoding and nothing else decoded it,
    else `bad_encoding`. `content_type` None: no HTTP header (a file on disk)."""
    for bom, codec in _BOMS:
        if raw.startswith(bom):
            text = _decode(raw[len(bom):], codec)
            if text is not None:
                return Decoded(text, codec, "bom")
    label = _charset_label(content_type or "")
    http = None if label is None else web_codec(label)
    tried = set()
    for source, codec in _candidates(raw, http):
        if codec is not None and codec not in tried:
            tried.add(codec)
            text = _decode(raw, codec)
            if text is not None:
                return Decoded(text, codec, source)
    return "unknown_charset" if label is not None and http is None else "bad_encoding"


def _candidates(raw: bytes, http: str | None) -> Iterator[tuple[str, str | None]]:
    """(source, codec) in the chain's order, each computed only when the ones before failed."""
    if http != "utf-8" and not raw.isascii() and _decode(raw, "utf-8") is not None:
        # Non-ASCII bytes that form valid UTF-8 are almost never text in a legacy charset (its
        # letters above 0x7F rarely fall into UTF-8's lead/continuation patterns), while servers
        # label UTF-8 pages ISO-8859-1 by default and copied templates keep an old <meta>. Those
        # labels decode without error, into mojibake, so they cannot be caught as failures.
        yield "utf8", "utf-8"
    yield "http", http
    yield "meta", meta_charset(raw)
    yield "default", "utf-8"
    for codec in _detected(raw):
        yield "detected", codec
