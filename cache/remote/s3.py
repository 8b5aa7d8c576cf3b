"""ObjectStore and ObjectLease: the fleet's shared second cache level in an S3 bucket (docs/cache.md).

Under ``s3://BUCKET/PATH/<prefix>/v1/``: ``blobs/<sha256>``, ``entries/<key>.json`` (the entry's record) and
``leases/<key>.json``. An upload puts the blobs first and the record last with ``If-None-Match: *``, so a
reader sees a complete entry or none and two publishers of one key cannot both win. A lease is taken with
``If-None-Match: *`` and renewed with ``If-Match: <our ETag>``; it expires by the store's clock (its
Last-Modified against the ``Date`` header), and an expired one is taken over with ``If-Match: <its ETag>``.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import logging
import os
import time
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import urlsplit

from jitwarm.cache.entry import MANIFEST, MAX_MANIFEST_BYTES, Entry, FileRecord, parse_manifest, unpack_entry
from jitwarm.cache.errors import CorruptEntry
from jitwarm.cache.files import loads
from jitwarm.cache.keys import FORMAT_VERSION
from jitwarm.cache.remote.base import RemoteFailure, StoreBase, deadline, interrupt, strings
from jitwarm.cache.remote.fleet import MAX_TOKEN_BYTES, RenewedLease, holder_of
from jitwarm.cache.signing import check

log = logging.getLogger("jitwarm.cache")

#: An entry record is its manifest as a JSON string (escaping at most doubles it) plus a small part.
MAX_RECORD_BYTES = 4 * MAX_MANIFEST_BYTES + (1 << 20)
#: Blobs this large or larger go up in parts of this size (S3 caps a single PUT at 5 GiB; parts retry alone).
MULTIPART_BYTES = 64 << 20
#: Deadlines and attempts of every request: a fleet start-up must not hang on a dead store.
CONNECT_TIMEOUT_S = 2.0
READ_TIMEOUT_S = 10.0
MAX_ATTEMPTS = 3
#: Last-Modified and Date have whole-second resolution: a lease is expired only this long after its lifetime.
CLOCK_RESOLUTION_S = 1.0
#: A lease naming a longer lifetime than this (planted, or garbled) is held to it: the fleet heals.
MAX_TTL_S = 3600.0


class Got(NamedTuple):
    """One object read: its bytes, ETag, and its age (seconds since Last-Modified, by the store's clock)."""

    body: bytes
    etag: str
    age_s: float


def new_client(read_timeout_s: float | None = None) -> Any:
    """An S3 client from boto3's own configuration chain; ``read_timeout_s``: instead of :data:`READ_TIMEOUT_S`."""
    import boto3  # imported on first use: importing jitwarm.cache must not cost a boto3 import
    from botocore.config import Config

    config = Config(connect_timeout=CONNECT_TIMEOUT_S, read_timeout=read_timeout_s or READ_TIMEOUT_S,
                    retries={"total_max_attempts": MAX_ATTEMPTS, "mode": "standard"})
    return boto3.session.Session().client("s3", config=config)


def client_errors() -> tuple[type[BaseException], ...]:
    """The exceptions of an S3 call that are a fault of the store (a body read mid-stream included)."""
    from botocore.exceptions import BotoCoreError, ClientError
    from urllib3.exceptions import HTTPError

    return (ClientError, BotoCoreError, HTTPError, OSError)


def describe(exc: BaseException) -> str:
    """A store error in one line: ``HTTP 403 AccessDenied: Access Denied`` for an error reply."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return f"{type(exc).__name__}: {exc}"
    error = response.get("Error", {})
    return f"HTTP {_status(exc)} {error.get('Code', '?')}: {error.get('Message', '')}".rstrip(": ")


def _status(exc: Any) -> int:
    return int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)


class ObjectLease(RenewedLease):
    """The fleet build lease of one key in an object store."""

    store: ObjectStore

    def _take(self) -> str | None:
        etag = self._put(IfNoneMatch="*")
        if etag is None:
            current = self._get()
            if current is None:  # released between our put and our read: one more try
                etag = self._put(IfNoneMatch="*")
            elif self._expired(current):
                etag = self._put(IfMatch=current.etag)
                if etag is not None:
                    log.info("took over the expired fleet lease of cache key %s on %s (%s)", self.key,
                             self.store.display, holder_of(current.body) or "unreadable lease")
        return etag

    def _read(self) -> bytes | None:
        current = self._get()
        return None if current is None else current.body

    def _renew(self) -> bool:
        """Put the lease again with ``If-Match: <our ETag>``: False (412) once another node took it over."""
        etag = self._put(IfMatch=self._held or "")
        if etag is None:
            return False
        self._held = etag
        return True

    def _delete(self, held: str) -> None:
        current = self._get()
        # Compare, then delete: a node can take the lease over only once it expired, a lifetime after our
        # last renewal, so it is still ours between the two calls.
        if current is not None and current.etag == held and not self.lost:
            self.store.call("lease", lambda c: c.delete_object(Bucket=self.store.bucket, Key=self.name))

    def _get(self) -> Got | None:
        return self.store.get(self.name, MAX_TOKEN_BYTES, "lease", clip=True)

    def _put(self, **condition: str) -> str | None:
        return self.store.put(self.name, self._token(ttl_s=self.ttl_s), "lease", **condition)

    def _expired(self, current: Got) -> bool:
        """Whether ``current`` outlived its holder's lifetime (ours when it names none), by the store's clock."""
        ttl = self.ttl_s
        try:
            named = float(loads(current.body)["ttl_s"])
            if 0 < named:
                ttl = min(named, MAX_TTL_S)
        except (TypeError, ValueError, KeyError, OverflowError):
            pass
        return current.age_s > ttl + CLOCK_RESOLUTION_S


class ObjectStore(StoreBase):
    """Entries of one cache format under one bucket prefix (a botocore, urllib3 or socket error: RemoteFailure)."""

    lease_class = ObjectLease

    def __init__(self, url: str, prefix: str = "jitwarm", **options: Any) -> None:
        super().__init__(url, prefix, **options)
        parts = urlsplit(url)
        self.bucket = parts.netloc
        self.base = "/".join(p for p in (parts.path.strip("/"), prefix, f"v{FORMAT_VERSION}") if p)

    def entry_name(self, key: str) -> str:
        """Return the object key of ``key``'s entry record."""
        return f"{self.base}/entries/{key}.json"

    def blob_name(self, sha256: str) -> str:
        """Return the object key of the blob whose bytes hash to ``sha256``."""
        return f"{self.base}/blobs/{sha256}"

    def lease_name(self, key: str) -> str:
        """Return the object key of the fleet build lease of ``key``."""
        return f"{self.base}/leases/{key}.json"

    _connect = staticmethod(new_client)
    _errors = staticmethod(client_errors)
    _describe = staticmethod(describe)

    def _probe(self) -> None:
        self.call("check", lambda c: c.head_bucket(Bucket=self.bucket))

    def get(self, name: str, limit: int, what: str, *, clip: bool = False) -> Got | None:
        """Read object ``name`` (None if absent); RemoteFailure. Over ``limit``: ``CorruptEntry``, or ``clip``ped."""
        def read(client: Any) -> Got | None:
            try:
                reply = client.get_object(Bucket=self.bucket, Key=name)
            except client.exceptions.NoSuchKey:
                return None
            size = reply.get("ContentLength", 0)
            if size > limit and not clip:
                reply["Body"].close()
                raise CorruptEntry(f"object {name} is {size} bytes, over its cap of {limit}")
            with deadline(f"{what}: {name}", min(size, limit), READ_TIMEOUT_S, self.min_rate,
                          lambda: interrupt(reply["Body"])):
                body = reply["Body"].read(min(size, limit))
            reply["Body"].close()
            if len(body) < min(size, limit):  # the connection dropped mid-body: a fault, not a bad object
                raise RemoteFailure(f"{what}: {name}: body cut short at {len(body)} of {size} bytes")
            headers = reply.get("ResponseMetadata", {}).get("HTTPHeaders", {})
            modified = reply["LastModified"].timestamp() if reply.get("LastModified") else time.time()
            return Got(body, reply.get("ETag", ""), _server_time(headers.get("date")) - modified)

        return self.call(what, read)

    def put(self, name: str, body: bytes, what: str, **condition: str) -> str | None:
        """PUT ``body`` at ``name`` under ``condition``; its new ETag, or None when the condition failed (409, 412)."""
        checksum = base64.b64encode(hashlib.sha256(body).digest()).decode()

        def write(client: Any) -> str | None:
            try:
                return client.put_object(Bucket=self.bucket, Key=name, Body=body, ChecksumSHA256=checksum,
                                         **condition)["ETag"]
            except client.exceptions.ClientError as exc:
                if condition and _status(exc) in (409, 412):
                    return None
                raise

        return self.call(what, write)

    def fetch(self, key: str, dest: Path) -> Entry | None:
        """Download ``key``'s entry (:meth:`StoreBase.fetch`); a rejected one is ``RemoteFailure`` if required."""
        got = self.get(self.entry_name(key), MAX_RECORD_BYTES, "download", clip=True)
        if got is None or self._rejected.get(key) == got.etag:
            return None  # nothing there, or the record we rejected before: not worth a download
        uploader: dict[str, Any] = {}
        try:
            manifest, executable, uploader, signature = _parse_record(got.body, key)
            _doc, records = parse_manifest(manifest, key, f"remote entry {key} {MANIFEST}")
            private = strings(uploader.get("private"))
            if self.trust_key is not None:  # before any blob is read: UntrustedEntry (exit 4)
                check(self.trust_key, key, manifest, executable, private, signature, self.display)
            total = sum(rec.size for rec in records)
            if total > self.max_bytes:
                self._too_large(key, total)
                return None
            files = {rec.path: self._blob(key, rec.path, rec.size, rec.sha256) for rec in records}
            return unpack_entry(dest, key, manifest, files, executable, private, shared=self.shared)
        except CorruptEntry as exc:
            self._reject(key, str(exc), got.etag, uploader)
            if self.required:
                raise RemoteFailure(f"download: rejected entry {key}: {exc}") from exc
            return None

    def _blob(self, key: str, rel: str, size: int, sha256: str) -> bytes:
        """Read the blob of ``rel``: CorruptEntry unless it is exactly ``size`` bytes hashing to ``sha256``."""
        got = self.get(self.blob_name(sha256), size, "download")
        where = f"remote entry {key}: {rel} (object {self.blob_name(sha256)})"
        if got is None:
            raise CorruptEntry(f"{where} is missing")
        if len(got.body) != size:
            raise CorruptEntry(f"{where} has {len(got.body)} bytes, {MANIFEST} says {size}")
        if hashlib.sha256(got.body).hexdigest() != sha256:
            raise CorruptEntry(f"{where}: sha256 does not match {MANIFEST}")
        return got.body

    def _put_entry(self, key: str, manifest: bytes, files: list[tuple[FileRecord, bytes]],
                   signed: dict[str, Any], uploader: dict[str, Any]) -> None:
        """Blobs first, the record last and only if absent; a record rejected here is replaced (``If-Match``)."""
        replacing = self._rejected.get(key)
        for sha256, data in {rec.sha256: data for rec, data in files}.items():
            self._put_blob(sha256, data, overwrite=replacing is not None)
        record = json.dumps({"manifest": manifest.decode("utf-8"), **signed,
                             "uploader": {**uploader, "nonce": os.urandom(8).hex()}}).encode()
        condition = {"IfMatch": replacing} if replacing else {"IfNoneMatch": "*"}
        if self.put(self.entry_name(key), record, "upload", **condition) is None:
            log.info("cache key %s was published on %s by another node first; keeping theirs", key, self.display)

    def _put_blob(self, sha256: str, data: bytes, *, overwrite: bool) -> None:
        """Put one blob, unless it is there with the right size (``overwrite``: a reader found it bad)."""
        name = self.blob_name(sha256)
        if not overwrite and self._size(name, "upload") == len(data):
            return
        if len(data) < MULTIPART_BYTES:
            self.put(name, data, "upload")
            return
        import io

        from boto3.s3.transfer import TransferConfig

        config = TransferConfig(multipart_threshold=MULTIPART_BYTES, multipart_chunksize=MULTIPART_BYTES)
        self.call("upload", lambda c: c.upload_fileobj(io.BytesIO(data), self.bucket, name, Config=config,
                                                       ExtraArgs={"ChecksumAlgorithm": "SHA256"}))

    def _size(self, name: str, what: str) -> int | None:
        """The size of object ``name``, None if absent; RemoteFailure."""
        def head(client: Any) -> int | None:
            try:
                return client.head_object(Bucket=self.bucket, Key=name)["ContentLength"]
            except client.exceptions.ClientError as exc:
                if _status(exc) == 404:
                    return None
                raise

        return self.call(what, head)

    def _present(self, keys: list[str]) -> list[bool]:
        return [self._size(self.entry_name(key), "status") is not None for key in keys]


def _server_time(date: str | None) -> float:
    """The store's clock from its ``Date`` header (leases expire by the store's clock, not a node's)."""
    with contextlib.suppress(TypeError, ValueError, IndexError):
        return parsedate_to_datetime(date).timestamp()
    return time.time()


def _parse_record(body: bytes, key: str) -> tuple[bytes, list[str], dict[str, Any], Any]:
    """Split an entry record into (manifest bytes, executable files, uploader, signature); CorruptEntry."""
    try:
        doc = loads(body)
        manifest = doc["manifest"].encode("utf-8")
        executable = strings(doc.get("executable", []))
        uploader = doc.get("uploader") if isinstance(doc.get("uploader"), dict) else {}
    except (TypeError, ValueError, KeyError, AttributeError, UnicodeError) as exc:
        raise CorruptEntry(f"remote entry {key}: its record does not parse ({type(exc).__name__})") from None
    return manifest, executable, uploader, doc.get("signature")
