"""S3 storage through boto3 (AWS, MinIO, or any S3 API server), with the guarantees of eyas.storage.

Writes: objects below `multipart_threshold_bytes` go up in one PUT carrying their SHA-256
(`ChecksumSHA256`, which AWS and MinIO check before they store anything); larger ones as a multipart
upload with a SHA-256 per part, completed only when every part is in, aborted on failure, so no
reader ever sees a partial object. The ETag the server computed from what it received (the MD5 of
the body, per part for multipart uploads) is compared with the local MD5 as well, so a body damaged
on the way is sent again even by servers that ignore the checksum header; after
`num_write_attempts` the object is deleted and the write refused. Servers whose ETag is not an MD5
(SSE-KMS) are checked by their SHA-256 only. The object's checksum (eyas.checksum) is kept in the
`eyas-checksum` metadata.
Reads: the body's checksum must equal the expected one (the manifest's, else the metadata's); a
mismatch or a broken stream is retried `num_read_attempts` times, then refused. `download_to` (the shard
cache's fetch) streams an object into a file by ranged GETs, `num_fetch_streams` at once, parts of
`fetch_part_bytes`, each tied to the ETag it began with (eyas.storage.s3_fetch).
Transient failures (throttling, 5xx, connection errors, timeouts) are retried by botocore's
`standard` mode with exponential backoff and jitter, `max_attempts` tries per request.

Why the multipart upload is written here rather than boto3's managed transfer (`upload_fileobj` with a
`TransferConfig`): managed transfer sends a SHA-256 per part but never compares the ETag a server
returns with the MD5 of what was sent, and treats a part the server refuses as damaged (400 BadDigest)
as a failed upload, not as a part to send again. The guarantees tests/test_storage.py asserts (a part
damaged on the way is re-sent, even by servers that ignore checksum headers; after `num_write_attempts`
the write is refused and nothing is visible) need both, per part.
"""

from __future__ import annotations

import base64
import hashlib
import time
from pathlib import Path

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError, ResponseStreamingError

from eyas.checksum import checksum_bytes
from eyas.storage.base import ChecksumMismatchError, check_checksum
from eyas.storage.s3_fetch import RangedFetch

CHECKSUM_META_KEY = "eyas-checksum"
MIN_PART_BYTES = 5 << 20  # S3's minimum for every part but the last


def _b64_sha256(data: bytes | memoryview) -> str:
    return base64.b64encode(hashlib.sha256(data).digest()).decode()


def _etag_matches(etag: str, md5s: list[bytes]) -> bool:
    """Whether a server ETag is the MD5 ETag of a body (one digest) or of a multipart upload (several);
    an ETag that is not MD5-based (SSE-KMS, some gateways) cannot be compared and counts as a match."""
    etag = etag.strip('"')
    if len(md5s) == 1 and "-" not in etag:
        expected = md5s[0].hex()
    else:
        expected = f"{hashlib.md5(b''.join(md5s)).hexdigest()}-{len(md5s)}"
    looks_md5 = len(etag.split("-")[0]) == 32 and all(c in "0123456789abcdef" for c in etag.split("-")[0])
    return etag == expected or not looks_md5


class S3Storage:
    def __init__(
        self,
        url: str,
        *,
        endpoint_url: str = "",
        multipart_threshold_bytes: int = 64 << 20,
        part_bytes: int = 64 << 20,
        max_attempts: int = 8,
        num_read_attempts: int = 3,
        num_write_attempts: int = 3,
        connect_timeout_s: float = 10.0,
        read_timeout_s: float = 120.0,
        retry_backoff_s: float = 0.5,
        fetch_part_bytes: int = 16 << 20,
        num_fetch_streams: int = 16,
    ):
        if not url.startswith("s3://") or len(url) <= len("s3://"):
            raise ValueError(f"storage {url!r}: expected s3://bucket/prefix")
        bucket, _, prefix = url[len("s3://") :].partition("/")
        if part_bytes < MIN_PART_BYTES:
            raise ValueError(f"storage {url}: part_bytes={part_bytes}, S3 requires at least {MIN_PART_BYTES}")
        if fetch_part_bytes < 1 or num_fetch_streams < 1:
            raise ValueError(
                f"storage {url}: fetch_part_bytes={fetch_part_bytes}, num_fetch_streams={num_fetch_streams}; expected "
                f"both >= 1 (defaults {16 << 20} and 16)"
            )
        self.fetch_part_bytes, self.num_fetch_streams = fetch_part_bytes, num_fetch_streams
        self.url, self.bucket = url.rstrip("/"), bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.multipart_threshold_bytes, self.part_bytes = multipart_threshold_bytes, part_bytes
        self.num_read_attempts, self.retry_backoff_s = num_read_attempts, retry_backoff_s
        self.num_write_attempts = num_write_attempts
        config = Config(
            retries={"mode": "standard", "max_attempts": max_attempts},
            connect_timeout=connect_timeout_s,
            read_timeout=read_timeout_s,
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            max_pool_connections=max(10, num_fetch_streams),  # one kept-alive connection per fetch stream
        )
        self.client = boto3.client("s3", endpoint_url=endpoint_url or None, config=config)

    def _key(self, name: str) -> str:
        return self.prefix + name

    def put_bytes(self, name: str, data: bytes) -> str:
        digest = checksum_bytes(data)
        if len(data) >= self.multipart_threshold_bytes:
            self._put_multipart(name, memoryview(data), digest)
            return digest
        md5 = hashlib.md5(data).digest()
        for attempt in range(1, self.num_write_attempts + 1):
            answer = self.client.put_object(
                Bucket=self.bucket,
                Key=self._key(name),
                Body=data,
                ChecksumSHA256=_b64_sha256(data),
                Metadata={CHECKSUM_META_KEY: digest},
            )
            if _etag_matches(answer["ETag"], [md5]):
                return digest
            self._backoff(attempt)
        self.delete(name)
        raise self._stored_other_bytes(name, answer["ETag"], md5.hex())

    def _stored_other_bytes(self, name: str, etag: str, expected: str) -> ChecksumMismatchError:
        return ChecksumMismatchError(
            f"{self.url}/{name}: the server stored other bytes than were sent (ETag {etag}), expected ETag "
            f"{expected} after {self.num_write_attempts} attempts; the network or a proxy damages uploads: "
            f"the object was deleted, nothing refers to it; fix the path to the server and run again"
        )

    def _backoff(self, attempt: int) -> None:
        time.sleep(self.retry_backoff_s * 2 ** (attempt - 1))

    def _put_part(self, key: str, upload_id: str, number: int, chunk: memoryview) -> dict:
        checksum, md5 = _b64_sha256(chunk), hashlib.md5(chunk).digest()
        for attempt in range(1, self.num_write_attempts + 1):
            answer = self.client.upload_part(
                Bucket=self.bucket,
                Key=key,
                UploadId=upload_id,
                PartNumber=number,
                Body=bytes(chunk),
                ChecksumSHA256=checksum,
            )
            if _etag_matches(answer["ETag"], [md5]):
                return {"PartNumber": number, "ETag": answer["ETag"], "ChecksumSHA256": checksum, "md5": md5}
            self._backoff(attempt)
        raise self._stored_other_bytes(f"{key} part {number}", answer["ETag"], md5.hex())

    def _put_multipart(self, name: str, data: memoryview, digest: str) -> None:
        key = self._key(name)
        upload = self.client.create_multipart_upload(
            Bucket=self.bucket, Key=key, ChecksumAlgorithm="SHA256", Metadata={CHECKSUM_META_KEY: digest}
        )
        upload_id = upload["UploadId"]
        try:
            parts = [
                self._put_part(key, upload_id, number, data[start : start + self.part_bytes])
                for number, start in enumerate(range(0, len(data), self.part_bytes), start=1)
            ]
            md5s = [p.pop("md5") for p in parts]
            answer = self.client.complete_multipart_upload(
                Bucket=self.bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}
            )
        except BaseException:
            # Nothing became visible; drop the parts so they do not linger (and cost) on the server.
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
            raise
        if not _etag_matches(answer["ETag"], md5s):
            self.delete(name)
            raise self._stored_other_bytes(
                name, answer["ETag"], f"{hashlib.md5(b''.join(md5s)).hexdigest()}-{len(md5s)}"
            )

    def get_bytes(self, name: str, *, checksum: str | None = None) -> bytes:
        source = f"{self.url}/{name}"
        for attempt in range(1, self.num_read_attempts + 1):
            try:
                answer = self.client.get_object(Bucket=self.bucket, Key=self._key(name))
                data = answer["Body"].read()
                expected = checksum or answer.get("Metadata", {}).get(CHECKSUM_META_KEY)
                if expected is None:
                    raise ChecksumMismatchError(
                        f"{source}: no expected checksum (none given, no {CHECKSUM_META_KEY} metadata); the object was "
                        f"not written by eyas.storage"
                    )
                check_checksum(data, expected, source=source)
                return data
            except (ChecksumMismatchError, ResponseStreamingError):
                if attempt == self.num_read_attempts:
                    raise
                self._backoff(attempt)
        raise AssertionError("unreachable")

    def get_range(self, name: str, start: int, end: int) -> bytes:
        answer = self.client.get_object(Bucket=self.bucket, Key=self._key(name), Range=f"bytes={start}-{end - 1}")
        return answer["Body"].read()

    def download_to(self, name: str, path: str | Path, *, checksum: str | None = None) -> None:
        fetch = RangedFetch(
            client=self.client,
            bucket=self.bucket,
            key=self._key(name),
            source=f"{self.url}/{name}",
            part_bytes=self.fetch_part_bytes,
            num_streams=self.num_fetch_streams,
            num_read_attempts=self.num_read_attempts,
            backoff=self._backoff,
        )
        for attempt in range(1, self.num_read_attempts + 1):
            try:
                fetch.run(path, checksum)
                return
            except ChecksumMismatchError:
                if attempt == self.num_read_attempts:
                    raise
                self._backoff(attempt)

    def list(self, prefix: str = "") -> dict[str, int]:
        return {name: obj["Size"] for name, obj in self._objects(prefix).items()}

    def versions(self, prefix: str = "") -> dict[str, str]:
        return {
            name: f"{obj['Size']}:{obj['ETag']}:{obj['LastModified'].isoformat()}"
            for name, obj in self._objects(prefix).items()
        }

    def _objects(self, prefix: str) -> dict[str, dict]:
        out = {}
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self._key(prefix), Delimiter="/"
        )
        for page in pages:
            for obj in page.get("Contents", []):
                out[obj["Key"][len(self.prefix) :]] = obj
        return out

    def exists(self, name: str) -> bool:
        try:
            self.client.head_object(Bucket=self.bucket, Key=self._key(name))
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return False
            raise
        return True

    def delete(self, name: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._key(name))

    def move(self, name: str, to: str) -> None:
        # a managed copy: one CopyObject, or a multipart copy above 5 GB; the metadata (checksum) comes along
        self.client.copy({"Bucket": self.bucket, "Key": self._key(name)}, self.bucket, self._key(to))
        self.delete(name)

    def remove_partial(self) -> list[str]:
        removed = []
        pages = self.client.get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket, Prefix=self.prefix)
        for page in pages:
            for up in page.get("Uploads", []):
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=up["Key"], UploadId=up["UploadId"])
                removed.append(up["Key"][len(self.prefix) :])
        return removed

    def local_path(self) -> Path | None:
        return None
