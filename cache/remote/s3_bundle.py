"""Bundles in the object store, streamed both ways: a multipart upload, and the object's body into the unpacker.

The object appears only when its upload completes. A store fault is :class:`BundleStoreError` (exit 1); a bad
bundle stays the unpacker's ``CacheError``.
"""

from __future__ import annotations

import contextlib
import hashlib
import tarfile
from collections.abc import Iterator, Mapping
from typing import Any
from urllib.parse import urlsplit

from jitwarm.cache.bundle_export import is_gzip_name, write_members
from jitwarm.cache.entry import Entry
from jitwarm.cache.errors import CacheError, UsageError
from jitwarm.cache.remote import s3
from jitwarm.cache.remote.base import TooSlow, deadline, interrupt
from jitwarm.cache.remote.s3 import MULTIPART_BYTES, client_errors, describe, new_client
from jitwarm.cache.settings import SettingError, remote_min_rate

#: Size of each uploaded part (S3: 5 MiB at least but the last, 10,000 parts at most: 640 GiB at 64 MiB).
PART_BYTES = MULTIPART_BYTES
#: The read deadline of CompleteMultipartUpload, which "could take several minutes" (S3 API reference): under
#: the tier's 10 s, a 1 GiB bundle's completion on moto timed out, was retried and failed with 500.
COMPLETE_TIMEOUT_S = 600.0


class BundleStoreError(CacheError):
    """The object store failed while a bundle was written to it or read from it (exit 1): nothing is published."""


def is_bundle_url(path: object) -> bool:
    """Whether a bundle argument names an object (``s3://BUCKET/KEY``) rather than a file."""
    return isinstance(path, str) and path.startswith("s3://")


def split_url(url: str) -> tuple[str, str]:
    """``(bucket, key)`` of ``s3://BUCKET/KEY``; ``UsageError`` (exit 2) when either is missing."""
    parts = urlsplit(url)
    key = parts.path.lstrip("/")
    if not parts.netloc or not key or key.endswith("/"):
        raise UsageError(f"bundle {url}: give the object as s3://BUCKET/KEY.tar")
    return parts.netloc, key


def upload_bundle(url: str, entries: list[Entry], *, trust_key: bytes | None = None,
                  about: Mapping[str, Any] | None = None) -> str:
    """Stream ``entries`` (``about`` in ``bundle.json``) as one tar to the object ``url``; return its sha256.

    ``BundleStoreError``, ``CacheError``.
    """
    out = _MultipartWriter(url)
    try:
        with tarfile.open(fileobj=out, mode="w|gz" if is_gzip_name(url) else "w|", format=tarfile.PAX_FORMAT) as tar:
            write_members(tar, entries, trust_key, about)
        out.complete()
    except BaseException:
        out.abort()
        raise
    return out.sha256.hexdigest()


@contextlib.contextmanager
def open_bundle(url: str) -> Iterator[Any]:
    """Yield the body of the object ``url`` as a stream; ``UsageError`` (no such object), ``BundleStoreError``."""
    bucket, key = split_url(url)
    client = _client(url)
    try:
        reply = client.get_object(Bucket=bucket, Key=key)
    except client.exceptions.NoSuchKey:
        raise UsageError(f"bundle {url} does not exist") from None
    except client_errors() as exc:
        raise BundleStoreError(f"cannot read bundle {url}: {describe(exc)}") from exc
    size = int(reply.get("ContentLength") or 0)
    body = _Body(reply["Body"], size, url)
    try:  # the whole read has its deadline (JITWARM_REMOTE_MIN_RATE), not only each socket read
        with deadline(f"cannot read bundle {url}", size, s3.READ_TIMEOUT_S, remote_min_rate(),
                      lambda: interrupt(reply["Body"])):
            yield body
    except TooSlow as exc:
        raise BundleStoreError(f"{exc} (read {body.read_bytes})") from exc
    finally:
        with contextlib.suppress(Exception):
            reply["Body"].close()


def _client(url: str, read_timeout_s: float | None = None) -> Any:
    """A new S3 client for bundle ``url``; SettingError without boto3, BundleStoreError."""
    try:
        return new_client(read_timeout_s)
    except ImportError:
        raise SettingError(f"bundle {url} needs boto3, which is not installed: pip install 'jitwarm[s3]'") from None
    except client_errors() as exc:  # no region, a bad profile: boto3 fails here, before any request
        raise BundleStoreError(f"bundle {url}: {describe(exc)}") from exc


class _Body:
    """An object's body read by the unpacker: store errors and a short body are BundleStoreError."""

    def __init__(self, raw: Any, size: int, url: str) -> None:
        self._raw, self._size, self._url, self.read_bytes = raw, size, url, 0

    def read(self, n: int = -1) -> bytes:
        try:
            data = self._raw.read(n if n >= 0 else None)
        except client_errors() as exc:
            raise BundleStoreError(f"cannot read bundle {self._url}: {describe(exc)} after {self.read_bytes} of "
                                   f"{self._size} bytes") from exc
        self.read_bytes += len(data)
        if not data and n != 0 and self.read_bytes < self._size:
            raise BundleStoreError(f"cannot read bundle {self._url}: body cut short at {self.read_bytes} of "
                                   f"{self._size} bytes")
        return data


class _MultipartWriter:
    """What ``tarfile`` writes to (``w|``): each :data:`PART_BYTES` goes up as one part, hashed as it passes."""

    def __init__(self, url: str) -> None:
        self._bucket, self._key = split_url(url)
        self._client, self._url = _client(url), url
        self._buf = bytearray()
        self._parts: list[dict[str, Any]] = []
        self._upload_id: str | None = None
        self.sha256 = hashlib.sha256()

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        self._buf += data
        while len(self._buf) >= PART_BYTES:
            self._send(bytes(self._buf[:PART_BYTES]))
            del self._buf[:PART_BYTES]
        return len(data)

    def _call(self, what: str, fn: Any, **kwargs: Any) -> Any:
        try:
            return fn(Bucket=self._bucket, Key=self._key, **kwargs)
        except client_errors() as exc:
            raise BundleStoreError(f"cannot write bundle {self._url}: {what}: {describe(exc)}") from exc

    def _send(self, part: bytes) -> None:
        if self._upload_id is None:
            self._upload_id = self._call("start the upload", self._client.create_multipart_upload)["UploadId"]
        number = len(self._parts) + 1
        reply = self._call(f"part {number}", self._client.upload_part, UploadId=self._upload_id, PartNumber=number,
                           Body=part)
        self._parts.append({"PartNumber": number, "ETag": reply["ETag"]})

    def complete(self) -> None:
        """Send the last part and complete the upload: only now does the object appear."""
        if self._buf or not self._parts:
            self._send(bytes(self._buf))
            self._buf.clear()
        patient = _client(self._url, COMPLETE_TIMEOUT_S)
        self._call("complete the upload", patient.complete_multipart_upload, UploadId=self._upload_id,
                   MultipartUpload={"Parts": self._parts})
        self._upload_id = None

    def abort(self) -> None:
        """Abort an upload begun and not completed (best effort)."""
        if self._upload_id is not None:
            with contextlib.suppress(Exception):
                self._client.abort_multipart_upload(Bucket=self._bucket, Key=self._key, UploadId=self._upload_id)
            self._upload_id = None
