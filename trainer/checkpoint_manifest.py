"""What a checkpoint commit is on storage, and how it is vouched for (pure: no storage I/O).

A commit of step N is the folder `step_<N>/` with DCP's shard files, `.metadata`, one marker per
rank and, written last, `manifest.json`: step, tokens, world size, every file's size and xxh3-128
checksum, the model and config hashes. `manifest_problem` says what makes a parsed manifest
unusable (fields, step, file names that are shard names and nothing else), `verify` checks files
against it. With a signing key the manifest and the rank markers carry an HMAC-SHA256 `signature`
over a canonical encoding of everything else (`sign`, `signature_problem`); the key itself is
never written anywhere, only its key id (docs/checkpoints.md, "Signed manifests").
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
from pathlib import Path

from crucible.trainer.checkpoint_fetch import METADATA

MANIFEST = "manifest.json"
QUARANTINE = "quarantine.json"   # written beside a commit that cannot be loaded: never used again
INCARNATION = "incarnation.json"  # the run that owns the checkpoints under the URI (newest start)
FORMAT_VERSION = 1
# The only file names a commit manifest may list: DCP's shards and its metadata. Anything else
# (a path, `..`) is refused before it is joined onto a folder.
SHARD_FILE = re.compile(r"^(__\d+_\d+\.distcp|\.metadata)$")
_MANIFEST_FIELDS = {"step": int, "tokens": int, "world_size": int, "time": (int, float),
                    "files": dict, "model_hash": str, "config_hash": str}
# The HMAC key that signs manifests (and rank markers) and that a load demands a valid signature
# from: set by the operator from a Secret the job names. Never logged; its key id is.
SIGNING_KEY_ENV = "CRUCIBLE_CHECKPOINT_SIGNING_KEY"
SIGNATURE_ALG = "hmac-sha256"
# What is signed is prefixed with what it is, so a rank marker's signature is never a manifest's.
_SIGNING_CONTEXT = {"manifest": b"crucible checkpoint manifest v1\n",
                    "marker": b"crucible checkpoint rank marker v1\n",
                    "quarantine": b"crucible checkpoint quarantine marker v1\n",
                    "incarnation": b"crucible checkpoint owner token v1\n"}


def step_name(step: int) -> str:
    return f"step_{step}"


_STEP_NAME = re.compile(r"step_([0-9]{1,18})")


def parse_step(name: str) -> int | None:
    """The step of a `step_<N>` folder name, or None (ASCII digits only: str.isdigit() takes
    "²", which int() refuses)."""
    match = _STEP_NAME.fullmatch(name)
    return int(match.group(1)) if match else None


def file_digest(path: Path) -> dict:
    import xxhash

    h, size = xxhash.xxh3_128(), 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
            size += len(chunk)
    return {"size": size, "xxh3": h.hexdigest()}


def manifest_problem(manifest, step: int) -> str | None:
    """What makes a parsed commit manifest unusable, or None (pure: no storage is read)."""
    if not isinstance(manifest, dict):
        return f"the manifest is a {type(manifest).__name__}, not an object"
    for key, kind in _MANIFEST_FIELDS.items():
        if not isinstance(manifest.get(key), kind):
            return f"the manifest's {key!r} is missing or malformed"
    if manifest["step"] != step:
        return f"the manifest says step {manifest['step']}"
    if not manifest["files"]:
        return "the manifest lists no files"
    for name, entry in manifest["files"].items():
        if not SHARD_FILE.match(name):
            return f"the manifest lists {name!r}, which is not a checkpoint file name"
        if not (isinstance(entry, dict) and isinstance(entry.get("size"), int)
                and isinstance(entry.get("xxh3"), str)):
            return f"the manifest's entry for {name} is malformed"
    if METADATA not in manifest["files"]:
        return f"the manifest does not list DCP's {METADATA}"
    return None


def signing_key_from_env(environ=os.environ) -> bytes | None:
    """The signing key (UTF-8 bytes of the variable, surrounding whitespace such as a Secret
    file's trailing newline dropped), or None when unset or empty."""
    key = environ.get(SIGNING_KEY_ENV, "").strip()
    return key.encode() if key else None


def key_id(key: bytes) -> str:
    """Names a key without revealing it: the first 8 hex digits of its SHA-256, so the log can say
    which key signed a commit and which key a run holds (a rotated key is recognisable)."""
    return hashlib.sha256(key).hexdigest()[:8]


def signed_bytes(doc: dict, kind: str = "manifest") -> bytes:
    """The canonical encoding a signature covers: every field of `doc` but `signature` (so step,
    tokens, world size, hashes, batch, and every file's name, size and checksum, `.metadata`'s
    included), as JSON with sorted keys, no whitespace and ASCII only, after a context prefix."""
    body = {k: v for k, v in doc.items() if k != "signature"}
    return _SIGNING_CONTEXT[kind] + json.dumps(body, sort_keys=True, separators=(",", ":"),
                                               ensure_ascii=True, allow_nan=False).encode()


def _mac(doc: dict, key: bytes, kind: str) -> str:
    return hmac.new(key, signed_bytes(doc, kind), hashlib.sha256).hexdigest()


def sign(doc: dict, key: bytes, kind: str = "manifest") -> dict:
    """`doc` with a `signature` field: {"alg": "hmac-sha256", "key_id": ..., "value": hex}."""
    return {**doc, "signature": {"alg": SIGNATURE_ALG, "key_id": key_id(key),
                                 "value": _mac(doc, key, kind)}}


def signature_problem(doc: dict, key: bytes, kind: str = "manifest") -> str | None:
    """Why `doc` is not validly signed with `key` (a sentence saying what to do), or None (pure).
    An unsigned document, a signature by another key and a wrong value are all refused."""
    mine = key_id(key)
    sig = doc.get("signature")
    if sig is None:
        return (f"the {kind} is not signed, and this run holds signing key id {mine} "
                f"({SIGNING_KEY_ENV}): it was written without the key (before signing was enabled, "
                "or by someone who does not hold it); only a run without the key loads it")
    if not (isinstance(sig, dict) and isinstance(sig.get("value"), str)
            and isinstance(sig.get("key_id"), str)):
        return f"the {kind}'s signature is malformed (this run holds key id {mine})"
    if sig.get("alg") != SIGNATURE_ALG:
        return (f"the {kind} is signed with {sig.get('alg')!r}, not {SIGNATURE_ALG} (this run "
                f"holds key id {mine})")
    if sig["key_id"] != mine:
        return (f"the {kind} is signed with key id {sig['key_id']!r}, this run holds key id "
                f"{mine}: give the job the key it was written with ({SIGNING_KEY_ENV}), or the "
                "commit was not written by this job")
    try:
        expected = _mac(doc, key, kind)
    except (ValueError, TypeError, RecursionError) as err:  # NaN, say: nothing signs that
        return f"the {kind} cannot be encoded to check its signature ({err})"
    if not hmac.compare_digest(sig["value"].encode(), expected.encode()):
        return (f"the {kind}'s signature (key id {mine}) does not match its contents: it was "
                "changed after it was signed")
    return None


def describe_problems(problems: list[str | None]) -> str:
    """One line saying what each rank (list index) found wrong with a commit: for the log and the
    quarantine marker, which rank 0 writes though another rank may be the one that saw it (each
    rank fetches only its own files). A problem every rank shares, such as the manifest's, which
    rank 0 reads for all, is named once, without ranks."""
    seen: dict[str, list[int]] = {}
    for rank, problem in enumerate(problems):
        if problem:
            seen.setdefault(problem, []).append(rank)
    return "; ".join(
        problem if len(ranks) == len(problems)
        else f"{problem} (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})"
        for problem, ranks in seen.items()) or "no rank said what was wrong"


def verify(folder: Path, files: dict[str, dict]) -> str | None:
    """None if every file matches its recorded size and checksum, else what is wrong."""
    for name, want in sorted(files.items()):
        path = folder / name
        if not path.exists():
            return f"{name} is missing"
        got = file_digest(path)
        if got != want:
            return f"{name}: size/checksum {got} != manifest {want}"
    return None
