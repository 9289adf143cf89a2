"""Files on local disk or in an S3-compatible store, behind the same few functions.

Owns: listing, reading, atomic writing, existence checks, whole-file upload/download, deletion
and path joining for local paths and `s3://bucket/key` URIs, and turning storage failures into
messages a person can act on (`explain`). Must not: know file formats (readers, pipeline,
checkpoint) or hold state besides one cached S3 client per process. Shared by the corpus
pipeline, the tokenizer and checkpoints.

S3 access uses boto3's standard configuration: credentials from the usual AWS variables or files,
and the endpoint of an S3-compatible server from AWS_ENDPOINT_URL (boto3 reads it itself since
1.28; "Configuring endpoints", AWS SDKs and Tools Reference Guide). Path-style addressing is used
because self-hosted servers (SeaweedFS, Ceph RGW) rarely have wildcard DNS for bucket hostnames.
Writes are atomic in both places: a local file is written beside its target and renamed; an S3
object appears whole when its upload completes. That is what makes a shard's outputs safe to find
half-way through a crash: the completion marker is written last (trainer/corpus/pipeline.py).
"""

from __future__ import annotations

import contextlib
import fnmatch
import io
import os
import tempfile
from functools import cache
from pathlib import Path
from typing import IO, Iterator


def is_s3(uri: str) -> bool:
    return uri.startswith("s3://")


def join(base: str, *parts: str) -> str:
    if is_s3(base):
        return "/".join([base.rstrip("/"), *(p.strip("/") for p in parts)])
    return str(Path(base, *parts))


def _split_s3(uri: str) -> tuple[str, str]:
    bucket, _, key = uri[len("s3://"):].partition("/")
    return bucket, key


# Metadata calls (listings, existence checks, small documents such as manifests and markers) get
# short timeouts and fewer attempts, so a frozen store (connections accepted, nothing answered)
# fails one within about a minute. A checkpoint load's listing and manifest reads run on rank 0,
# retried around that (Checkpointer), while every other rank waits in a collective the process
# group's timeout bounds (600 s): with botocore's defaults (60 s read timeout) and 6 attempts
# one call could take 6 minutes, and the retries around it over half an hour. (botocore's
# `max_attempts` counts retries: 2 is 3 attempts in all.)
METADATA_CONFIG = {"connect_timeout": 5, "read_timeout": 20,
                   "retries": {"max_attempts": 2, "mode": "standard"}}
# Bulk transfers keep botocore's timeouts: the read timeout is per socket read, not per object.
TRANSFER_CONFIG = {"retries": {"max_attempts": 5, "mode": "standard"}}


def s3_client(metadata: bool = False):
    """The process's S3 client: the metadata one (short timeouts) or the transfer one."""
    return _client(bool(metadata))


@cache
def _client(metadata: bool):
    import boto3
    from botocore.config import Config

    return boto3.client("s3", config=Config(s3={"addressing_style": "path"},
                                            **(METADATA_CONFIG if metadata else TRANSFER_CONFIG)))


s3_client.cache_clear = _client.cache_clear   # a test's new endpoint needs new clients


def list_files(uri: str) -> list[str]:
    """Files under `uri` (a file, a folder, or a pattern with * ? [ in its last part), sorted.
    Hidden files (a part starting with ".") are skipped."""
    base, pattern = uri, None
    if any(c in uri.rsplit("/", 1)[-1] for c in "*?["):
        base, pattern = uri.rsplit("/", 1)
    found = _list_s3(base) if is_s3(base) else _list_local(base)
    if pattern is not None:
        found = [f for f in found if fnmatch.fnmatch(f.rsplit("/", 1)[-1], pattern)]
    return sorted(found)


def _list_local(path: str) -> list[str]:
    root = Path(path)
    if root.is_file():
        return [str(root)]
    if not root.is_dir():
        return []
    return [str(p) for p in root.rglob("*")
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)]


def _list_s3(uri: str) -> list[str]:
    bucket, key_prefix = _split_s3(uri)
    folder = key_prefix.rstrip("/") + "/" if key_prefix else ""
    found = []
    for page in s3_client().get_paginator("list_objects_v2").paginate(Bucket=bucket,
                                                                        Prefix=key_prefix):
        for obj in page.get("Contents", []):
            key = obj["Key"]
            # The URI names one object, or a folder: "a/b" must not match "a/bc".
            if key != key_prefix and not key.startswith(folder):
                continue
            rest = key[len(folder):] if key.startswith(folder) else key.rsplit("/", 1)[-1]
            if not any(part.startswith(".") for part in rest.split("/")):
                found.append(f"s3://{bucket}/{key}")
    return found


class _RawStream(io.RawIOBase):
    """Any object with read(n) as a raw stream, so io.BufferedReader gives it readline and line
    iteration (botocore's StreamingBody iterates in 1 KiB chunks, not lines)."""

    def __init__(self, body):
        self._body = body

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        data = self._body.read(len(buffer))
        buffer[:len(data)] = data
        return len(data)

    def close(self) -> None:
        self._body.close()
        super().close()


def buffered(body) -> IO[bytes]:
    """A line-iterable buffered stream over an object with read(n)."""
    return io.BufferedReader(_RawStream(body), buffer_size=1 << 20)


def open_read(uri: str, metadata: bool = False) -> IO[bytes]:
    """A buffered binary stream of the file's bytes (S3 objects stream; not seekable).
    `metadata`: a small document, read with the metadata client's short timeouts."""
    if is_s3(uri):
        bucket, key = _split_s3(uri)
        return buffered(s3_client(metadata).get_object(Bucket=bucket, Key=key)["Body"])
    return open(uri, "rb")


def read_bytes(uri: str, metadata: bool = False) -> bytes:
    with contextlib.closing(open_read(uri, metadata)) as stream:
        return stream.read()


def read_range(uri: str, start: int, stop: int) -> bytes:
    """Bytes [start, stop) of a file: one ranged GET on S3, so a task reading its slice of many
    files does not download the rest of them."""
    if stop <= start:
        return b""
    if is_s3(uri):
        bucket, key = _split_s3(uri)
        body = s3_client().get_object(Bucket=bucket, Key=key,
                                      Range=f"bytes={start}-{stop - 1}")["Body"]
        return body.read()
    with open(uri, "rb") as source:
        source.seek(start)
        return source.read(stop - start)


def not_found(err: BaseException) -> bool:
    """Whether `err` says the object or file is not there (no retry will make it appear)."""
    if isinstance(err, FileNotFoundError):
        return True
    response = getattr(err, "response", None) or {}
    return response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound")


def exists(uri: str, metadata: bool = False) -> bool:
    """Whether the file is there (`metadata`: with the short-timeout client, as `read_bytes`)."""
    if is_s3(uri):
        bucket, key = _split_s3(uri)
        from botocore.exceptions import ClientError

        try:
            s3_client(metadata).head_object(Bucket=bucket, Key=key)
        except ClientError as err:
            if not_found(err):
                return False
            raise
        return True
    return os.path.exists(uri)


@contextlib.contextmanager
def open_write(uri: str, metadata: bool = False) -> Iterator[IO[bytes]]:
    """Write `uri` atomically: readers see the old file (or none) until the block succeeds."""
    if is_s3(uri):
        with tempfile.TemporaryFile() as spool:
            yield spool
            spool.seek(0)
            bucket, key = _split_s3(uri)
            s3_client(metadata).upload_fileobj(spool, bucket, key)
        return
    target = Path(uri)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "wb") as out:
            yield out
            # On disk before the rename, and the rename itself on disk after it: a crash never
            # leaves a renamed but empty file (a commit manifest, a marker) behind.
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, target)
        _fsync_dir(target.parent)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes(uri: str, data: bytes, metadata: bool = False) -> None:
    """Write a whole file atomically (`metadata`: a small document, short-timeout client)."""
    with open_write(uri, metadata) as out:
        out.write(data)


def seekable_copy(uri: str) -> IO[bytes]:
    """A seekable stream (Parquet needs one): the local file itself, or an S3 object in memory."""
    if is_s3(uri):
        return io.BytesIO(read_bytes(uri))
    return open(uri, "rb")


def upload_file(local: str | Path, uri: str) -> None:
    """Copy a local file to `uri` (S3: multipart for large files; local: atomic rename)."""
    if is_s3(uri):
        bucket, key = _split_s3(uri)
        s3_client().upload_file(str(local), bucket, key)
        return
    with open(local, "rb") as src, open_write(uri) as out:
        while chunk := src.read(1 << 24):
            out.write(chunk)


def download_file(uri: str, local: str | Path) -> None:
    local = Path(local)
    local.parent.mkdir(parents=True, exist_ok=True)
    if is_s3(uri):
        bucket, key = _split_s3(uri)
        s3_client().download_file(bucket, key, str(local))
        return
    with open(uri, "rb") as src, open(local, "wb") as out:
        while chunk := src.read(1 << 24):
            out.write(chunk)


def delete_file(uri: str, metadata: bool = False) -> None:
    if is_s3(uri):
        bucket, key = _split_s3(uri)
        s3_client(metadata).delete_object(Bucket=bucket, Key=key)
    else:
        Path(uri).unlink(missing_ok=True)


def delete_tree(uri: str) -> int:
    """Delete `uri` and everything under it, hidden files included; returns objects deleted."""
    if is_s3(uri):
        bucket, prefix = _split_s3(uri)
        prefix = prefix.rstrip("/") + "/"
        keys = [obj["Key"] for page in s3_client().get_paginator("list_objects_v2").paginate(
            Bucket=bucket, Prefix=prefix) for obj in page.get("Contents", [])]
        for start in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
            s3_client().delete_objects(Bucket=bucket, Delete={
                "Objects": [{"Key": k} for k in keys[start:start + 1000]], "Quiet": True})
        return len(keys)
    root = Path(uri)
    if not root.exists():
        return 0
    count = sum(1 for p in root.rglob("*") if p.is_file())
    import shutil

    shutil.rmtree(root)
    return count


def list_dirs(uri: str, metadata: bool = False) -> list[str]:
    """Immediate sub-folder names under `uri` (S3: common prefixes), sorted (`metadata`: with
    the short-timeout client)."""
    if is_s3(uri):
        bucket, prefix = _split_s3(uri)
        prefix = prefix.rstrip("/") + "/" if prefix else ""
        names = []
        for page in s3_client(metadata).get_paginator("list_objects_v2").paginate(
                Bucket=bucket, Prefix=prefix, Delimiter="/"):
            names += [p["Prefix"][len(prefix):].rstrip("/") for p in page.get("CommonPrefixes", [])]
        return sorted(names)
    root = Path(uri)
    return sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []


# botocore's errors for a store that did not answer: unreachable, refused, cut off, or too slow.
_UNREACHABLE = frozenset({"EndpointConnectionError", "ConnectTimeoutError", "ConnectionClosedError",
                          "ReadTimeoutError", "ConnectionError", "ProxyConnectionError",
                          # a body cut off or stalled mid-read (raised from the stream)
                          "IncompleteReadError", "ResponseStreamingError", "ProtocolError",
                          "IncompleteRead"})
# What a store answers while it is overloaded or restarting (S3's documented 5xx codes).
_UNAVAILABLE_CODES = frozenset({"500", "502", "503", "504", "InternalError", "ServiceUnavailable",
                                "SlowDown", "RequestTimeout"})



def unavailable(err: BaseException) -> bool:
    """Whether a storage failure is the store's absence rather than a problem a person must fix
    (credentials, a missing bucket or object, a bad URI): a later try may succeed as it is."""
    err = _cause(err)
    name = type(err).__name__
    if name in _UNREACHABLE or isinstance(err, (ConnectionError, TimeoutError)):
        return True
    response = getattr(err, "response", None) or {}
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
    code = str(response.get("Error", {}).get("Code", ""))
    # Any 5xx or 429 (throttled), whatever the server names it (S3, MinIO, Ceph RGW differ).
    return code in _UNAVAILABLE_CODES or status >= 500 or status == 429


def _cause(err: BaseException) -> BaseException:
    """The error behind boto3's and s3transfer's RetriesExceededError (a download whose body was
    cut off or stalled on every try), which carries it as `last_exception`."""
    for _ in range(5):
        inner = getattr(err, "last_exception", None)
        if not isinstance(inner, BaseException):
            return err
        err = inner
    return err


def explain(err: BaseException, uri: str) -> str:
    """A one-line description of a storage failure with what to check, never the secret."""
    err = _cause(err)
    name = type(err).__name__
    # botocore's HTTPClientError family (ReadTimeoutError, ConnectionClosedError: a store frozen
    # or restarting) has `response = None`.
    code = (getattr(err, "response", None) or {}).get("Error", {}).get("Code", "")
    if name in ("NoCredentialsError", "PartialCredentialsError"):
        return (f"no S3 credentials for {uri}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                "(in a PretrainJob: checkpoint.credentialsSecret), or give the pods a workload "
                "identity (serviceAccount.annotations, e.g. eks.amazonaws.com/role-arn)")
    if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403"):
        return (f"S3 refused the credentials for {uri} ({code}): check AWS_ACCESS_KEY_ID / "
                "AWS_SECRET_ACCESS_KEY and the key's permissions on the bucket")
    if code == "NoSuchBucket" or name == "NoSuchBucket":
        return f"bucket of {uri} does not exist ({code or name}): create it or fix the URI"
    if code in ("404", "NoSuchKey", "NotFound"):
        # A HEAD (boto3's download_file starts with one) has no body to say which is missing.
        bucket = ", or no such bucket" if code == "404" else ""
        return f"{uri} is not there ({code}: no such object{bucket})"
    if name in _UNREACHABLE:
        endpoint = os.environ.get("AWS_ENDPOINT_URL", "the default AWS endpoint")
        return f"cannot reach the S3 endpoint for {uri} ({endpoint}): {name}"
    if isinstance(err, PermissionError):
        return f"no permission to write {uri}: {err.strerror}"
    return f"{uri}: {name}: {err}"
