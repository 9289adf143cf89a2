"""The S3-compatible store is real: boto3 round-trips bytes exactly, multipart included."""

from __future__ import annotations

import hashlib
import io
import os
import secrets

import pytest
from boto3.s3.transfer import TransferConfig

pytestmark = pytest.mark.stack


def test_put_get_list_delete_round_trip(s3):
    c = s3.client()
    prefix = f"stacktest/{secrets.token_hex(4)}/"
    payloads = {f"{prefix}a.bin": os.urandom(1000), f"{prefix}dir/b.txt": "ünïcödé\n".encode()}
    for key, data in payloads.items():
        c.put_object(Bucket=s3.bucket, Key=key, Body=data)
    for key, data in payloads.items():
        assert c.get_object(Bucket=s3.bucket, Key=key)["Body"].read() == data
    listed = c.list_objects_v2(Bucket=s3.bucket, Prefix=prefix)
    assert sorted(o["Key"] for o in listed["Contents"]) == sorted(payloads)
    assert {o["Key"]: o["Size"] for o in listed["Contents"]} == {k: len(v) for k, v in payloads.items()}
    for key in payloads:
        c.delete_object(Bucket=s3.bucket, Key=key)
    assert c.list_objects_v2(Bucket=s3.bucket, Prefix=prefix).get("KeyCount") == 0


def test_multipart_upload_of_20_mib_round_trips_exactly(s3):
    c = s3.client()
    key = f"stacktest/{secrets.token_hex(4)}/big.bin"
    data = os.urandom(20 * 1024 * 1024)
    config = TransferConfig(multipart_threshold=5 * 1024 * 1024, multipart_chunksize=5 * 1024 * 1024)
    c.upload_fileobj(io.BytesIO(data), s3.bucket, key, Config=config)
    head = c.head_object(Bucket=s3.bucket, Key=key)
    assert head["ContentLength"] == len(data)
    # A multipart object's ETag is "<md5 of part md5s>-<parts>": proves 4 parts were sent.
    assert head["ETag"].strip('"').endswith("-4")
    out = io.BytesIO()
    c.download_fileobj(s3.bucket, key, out, Config=config)
    assert hashlib.sha256(out.getvalue()).digest() == hashlib.sha256(data).digest()
    c.delete_object(Bucket=s3.bucket, Key=key)


def test_wrong_secret_is_refused(s3):
    from botocore.exceptions import ClientError

    from tests.support.services import S3

    bad = S3(s3.endpoint, s3.bucket, s3.access_key, "not-the-secret", s3.region).client()
    with pytest.raises(ClientError) as refused:
        bad.list_objects_v2(Bucket=s3.bucket)
    assert refused.value.response["Error"]["Code"] in ("SignatureDoesNotMatch", "AccessDenied")
