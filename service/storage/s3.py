"""The store in an S3-compatible bucket (AWS S3, MinIO, Cloudflare R2, GCS's S3 interface), through boto3.

Why boto3: it is AWS's own client and the one every S3-compatible server tests against; it reads the standard
credential chain as is (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, instance and pod roles) and
AWS_ENDPOINT_URL for MinIO and the like; its transfer manager does multipart uploads and downloads with
retries and threads. obstore is younger and s3fs pins aiobotocore's exact botocore, which fights other packages.
Imported only where a store is configured, so the CLI and a plain `trainjobs up` never load it.
"""

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from service.storage.store import CHUNK, ObjectInfo, Store, StoreUnavailable, disposition

MISSING = ("404", "NoSuchKey", "NotFound")
# Checkpoint shards are large: 16 MiB parts, 8 at a time (boto3's own default is 8 MiB and 10 threads).
TRANSFER = TransferConfig(multipart_threshold=16 * 2**20, multipart_chunksize=16 * 2**20, max_concurrency=8)


class S3Store(Store):
    def __init__(self, *, bucket: str, prefix: str, timeout_s: float):
        if not bucket:
            raise ValueError("TRAINJOBS_STORAGE_URL names no bucket: expected s3://bucket/prefix")
        self.bucket, self.prefix = bucket, f"{prefix}/" if prefix else ""
        self.url = f"s3://{bucket}/{prefix}".rstrip("/")
        # AWS_REGION is what most tools set; botocore itself reads only AWS_DEFAULT_REGION.
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        self.client = boto3.session.Session().client("s3", region_name=region, config=Config(
            signature_version="s3v4",  # presigned URLs too: SigV2 is gone from newer regions, R2 and GCS
            connect_timeout=timeout_s, read_timeout=timeout_s, retries={"mode": "standard", "max_attempts": 3}))

    @contextmanager
    def _answer(self, what: str):
        """boto3's errors as StoreUnavailable naming the store; a missing object is FileNotFoundError."""
        try:
            yield
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if code in MISSING and what != "check":
                raise FileNotFoundError(what) from None
            why = {"404": f"there is no bucket {self.bucket!r}", "NoSuchBucket": f"there is no bucket {self.bucket!r}",
                   "403": "the credentials were refused (AWS_ACCESS_KEY_ID, AWS_PROFILE, the instance role)",
                   }.get(code, "it refused")
            raise StoreUnavailable(f"the store {self.url} refused {what}: {why}: {code} ({exc})") from None
        except BotoCoreError as exc:  # no connection, a timeout, no credentials
            raise StoreUnavailable(f"the store {self.url} is unreachable ({what}): {exc}") from None

    def check(self) -> None:
        with self._answer("check"):
            self.client.head_bucket(Bucket=self.bucket)
            self.client.list_objects_v2(Bucket=self.bucket, Prefix=self.prefix, MaxKeys=1)

    def put_file(self, key: str, file: BinaryIO) -> None:
        with self._answer(f"upload {key}"):
            self.client.upload_fileobj(file, self.bucket, self.prefix + self._check_key(key), Config=TRANSFER)

    def get_file(self, key: str, dest: Path) -> None:
        with self._answer(f"download {key}"):
            self.client.download_file(self.bucket, self.prefix + self._check_key(key), str(dest), Config=TRANSFER)

    def list(self, prefix: str) -> list[ObjectInfo]:
        self._check_key(prefix.rstrip("/"))
        found = []
        with self._answer(f"list {prefix}"):
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket,
                                                                              Prefix=self.prefix + prefix):
                for item in page.get("Contents", []):
                    found.append(ObjectInfo(item["Key"][len(self.prefix):], item["Size"], item["LastModified"]))
        return found

    def delete(self, keys: Sequence[str]) -> None:
        for i in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
            batch = [{"Key": self.prefix + self._check_key(k)} for k in keys[i:i + 1000]]
            with self._answer("delete"):
                self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})

    def head(self, key: str) -> ObjectInfo | None:
        try:
            with self._answer(f"read {key}"):
                got = self.client.head_object(Bucket=self.bucket, Key=self.prefix + self._check_key(key))
        except FileNotFoundError:
            return None
        return ObjectInfo(key, got["ContentLength"], got["LastModified"])

    def presign(self, key: str, *, ttl_s: int, filename: str) -> str | None:
        # Signed locally (no request): the store checks the signature, and its expiry, when the client comes.
        with self._answer(f"presign {key}"):
            return self.client.generate_presigned_url("get_object", ExpiresIn=ttl_s, Params={
                "Bucket": self.bucket, "Key": self.prefix + self._check_key(key),
                "ResponseContentDisposition": disposition(filename)})

    def read(self, key: str, start: int = 0, end: int | None = None) -> Iterator[bytes]:
        extra = {"Range": f"bytes={start}-{'' if end is None else end}"} if start or end is not None else {}
        with self._answer(f"read {key}"):
            body = self.client.get_object(Bucket=self.bucket, Key=self.prefix + self._check_key(key), **extra)["Body"]
        return self._stream(body, key)

    def _stream(self, body, key: str) -> Iterator[bytes]:
        with self._answer(f"read {key}"):
            try:
                yield from body.iter_chunks(CHUNK)
            finally:
                body.close()
