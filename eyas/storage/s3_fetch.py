"""Ranged, parallel GETs of one S3 object into a local file: how S3Storage.download_to fetches.

One HEAD learns the object's size and ETag. The object is cut into `part_bytes` ranges, fetched by up to
`num_streams` GETs at once (a rank's fetch rate is then bounded by the link, not by one stream), each GET
carrying `If-Match: <ETag>`: an object written again while it is fetched is refused by the server (412) on
its next part, so no file ever mixes two versions. Each part is written at its offset into a temporary beside
the destination; as parts complete, in order, their bytes are hashed back from the file (eyas.checksum,
streaming, so there is no second pass over the whole file), and the temporary is fsynced and renamed only when
every part is in and the checksum is the expected one. A part whose stream breaks (cut, short, read timeout) is
fetched again, up to `num_read_attempts` times; request-level failures (throttling, 5xx, connection errors)
are retried by botocore before a body streams. On any failure the temporary is removed.

Why this rather than boto3's managed transfer (`download_file` with a TransferConfig, which also sends ranged
GETs with If-Match): it cannot hash the parts in order as they land (the checksum would be a second read of the
whole file), it renames its temporary without an fsync (a crash may leave a named, empty file that looks
whole), and its failures name neither the part nor the eyas fix; the cache's guarantees need all three.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from botocore.exceptions import ClientError, IncompleteReadError, ReadTimeoutError, ResponseStreamingError

from eyas.checksum import format_digest, new_hasher, short
from eyas.fsio import commit_temp, temp_path
from eyas.storage.base import ChecksumMismatchError

CHUNK_BYTES = 1 << 20  # one write into the file, and how often a part looks whether the fetch was aborted
STREAM_ERRORS = (ResponseStreamingError, IncompleteReadError, ReadTimeoutError)


class ObjectChangedError(OSError):
    """The object was written again while its parts were fetched (its ETag changed)."""


class PartFetchError(OSError):
    """One part of a ranged fetch could not be read whole after every attempt."""


class _Aborted(Exception):
    """Another part failed; this one stopped early."""


@dataclass(frozen=True)
class Part:
    number: int  # 1-based
    start: int
    end: int  # exclusive

    def describe(self, num_parts: int) -> str:
        return f"part {self.number} of {num_parts} (bytes {self.start}-{self.end - 1})"


def split_parts(size: int, part_bytes: int) -> list[Part]:
    return [Part(i + 1, start, min(start + part_bytes, size)) for i, start in enumerate(range(0, size, part_bytes))]


@dataclass
class RangedFetch:
    """Fetch `key` of `bucket` into `path`; `source` names the object in messages; `checksum` None = unchecked."""

    client: object
    bucket: str
    key: str
    source: str
    part_bytes: int
    num_streams: int
    num_read_attempts: int
    backoff: object  # backoff(attempt): sleeps before attempt + 1

    def run(self, path: str | Path, checksum: str | None) -> None:
        head = self._head()
        size, etag = head["ContentLength"], head["ETag"]
        tmp = temp_path(Path(path))
        try:
            self._fetch_into(tmp, size, etag, checksum)
            commit_temp(tmp, Path(path))
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def _head(self) -> dict:
        try:
            return self.client.head_object(Bucket=self.bucket, Key=self.key)
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                raise FileNotFoundError(f"{self.source}: no such object on the server") from e
            raise

    def _fetch_into(self, tmp: Path, size: int, etag: str, checksum: str | None) -> None:
        parts = split_parts(size, self.part_bytes)
        hasher, abort = new_hasher(), threading.Event()
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, size)
            with ThreadPoolExecutor(max_workers=max(1, min(self.num_streams, len(parts)))) as pool:
                futures = [pool.submit(self._part, fd, part, len(parts), etag, abort) for part in parts]
                try:
                    for part, future in zip(parts, futures, strict=True):
                        future.result()
                        if checksum is not None:
                            hasher.update(os.pread(fd, part.end - part.start, part.start))
                except BaseException as e:
                    abort.set()
                    pool.shutdown(wait=True, cancel_futures=True)
                    raise _first_failure(futures, e) from None
        finally:
            os.close(fd)
        found = format_digest(hasher)
        if checksum is not None and found != checksum:
            raise ChecksumMismatchError(
                f"{self.source}: checksum {short(found)} of {size} bytes read ({len(parts)} ranged parts of ETag "
                f"{etag}), expected {short(checksum)}; the object is corrupt or was replaced; verification "
                f"quarantines it and extraction rewrites it"
            )

    def _part(self, fd: int, part: Part, num_parts: int, etag: str, abort: threading.Event) -> None:
        """Fetch one range into the file at its offset, its broken streams fetched again."""
        for attempt in range(1, self.num_read_attempts + 1):
            if abort.is_set():
                raise _Aborted
            try:
                self._get_part(fd, part, etag, abort)
                return
            except ClientError as e:
                status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
                if status == 412 or e.response.get("Error", {}).get("Code") == "PreconditionFailed":
                    raise ObjectChangedError(
                        f"{self.source}: the object changed while it was fetched: the server refused "
                        f"{part.describe(num_parts)} because its ETag is no longer {etag} (412 PreconditionFailed); "
                        f"it was written again mid-fetch; nothing was kept: fetch it again once its writer is done, "
                        f"against a manifest that describes it"
                    ) from e
                raise PartFetchError(f"{self.source}: {part.describe(num_parts)}: {e}") from e
            except STREAM_ERRORS as e:
                if attempt == self.num_read_attempts:
                    raise PartFetchError(
                        f"{self.source}: {part.describe(num_parts)}: its stream broke in each of "
                        f"{self.num_read_attempts} attempts (last: {e}); the network or the server drops transfers: "
                        f"fix the path to the server, or raise num_read_attempts"
                    ) from e
                self.backoff(attempt)
        raise AssertionError("unreachable")

    def _get_part(self, fd: int, part: Part, etag: str, abort: threading.Event) -> None:
        answer = self.client.get_object(
            Bucket=self.bucket, Key=self.key, Range=f"bytes={part.start}-{part.end - 1}", IfMatch=etag
        )
        body, offset = answer["Body"], part.start
        try:
            for chunk in body.iter_chunks(CHUNK_BYTES):
                if offset + len(chunk) > part.end:
                    raise IncompleteReadError(
                        actual_bytes=offset + len(chunk) - part.start, expected_bytes=part.end - part.start
                    )
                os.pwrite(fd, chunk, offset)
                offset += len(chunk)
                if abort.is_set():
                    raise _Aborted
        finally:
            body.close()
        if offset != part.end:  # a server that sends fewer bytes than it announced
            raise IncompleteReadError(actual_bytes=offset - part.start, expected_bytes=part.end - part.start)


def _first_failure(futures: list, seen: BaseException) -> BaseException:
    """The error of the part that failed first in part order, not the early stop of the others it caused."""
    if not isinstance(seen, Exception):  # an interrupt of the waiting thread itself
        return seen
    for future in futures:
        if future.done() and not future.cancelled():
            error = future.exception()
            if error is not None and not isinstance(error, _Aborted):
                return error
    return seen
