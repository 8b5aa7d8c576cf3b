"""RemoteStore: the fleet's shared second cache level in Redis: entries as hashes, health, presence.

This module only moves entries; the protocol that decides when to download, lease and upload is
:mod:`jitwarm.cache.fleet`.

One Redis hash per entry, ``<prefix>:v1:entry:<key>``, with the fields ``manifest`` (the bytes of the
entry's ``entry.json``: every file with size and sha256), ``meta`` (who uploaded it, which files are
executable) and ``file:<relative path>`` (each file's bytes). An upload replaces the whole hash in one
MULTI/EXEC transaction and a download reads it with one HGETALL, so a reader sees a complete entry or
none: an uploader that dies mid-way leaves nothing behind, and a replacement is never mixed with the entry
it replaces. Under ``maxmemory-policy allkeys-lru`` an entry is evicted as a whole, too.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

from jitwarm.cache.durable import remove_tree
from jitwarm.cache.entry import MANIFEST, Entry, unchanged, unpack_entry
from jitwarm.cache.errors import CorruptEntry, RemoteUnavailable
from jitwarm.cache.keys import FORMAT_VERSION
from jitwarm.cache.locks import this_host

log = logging.getLogger("jitwarm.cache")

#: After a failure the remote is skipped for this long by every cache of this process, then tried again.
RETRY_AFTER_S = 60.0
#: Deadlines unless the URL sets ``socket_connect_timeout`` / ``socket_timeout`` (redis-py query args).
CONNECT_TIMEOUT_S = 2.0
READ_TIMEOUT_S = 10.0

T = TypeVar("T")


class RemoteFailure(Exception):
    """A Redis call failed (internal: :meth:`RemoteStore.failed` logs it, or raises RemoteUnavailable)."""


def redact(url: str) -> str:
    """Return ``url`` without its password and query, for messages (``redis://:***@host:6379/0``)."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, hostport = netloc.rsplit("@", 1)
        user = userinfo.split(":", 1)[0]
        netloc = f"{user}:***@{hostport}" if ":" in userinfo else f"{user}@{hostport}"
    return f"{parts.scheme}://{netloc}{parts.path}"


@dataclass(frozen=True)
class RemoteReport:
    """Result of :meth:`KernelCache.remote_report`: which keys the remote tier holds.

    Attributes
    ----------
    url : str
        The remote's URL, password removed.
    prefix : str
        The key namespace on that server.
    available : bool
        False when the remote could not be asked; ``present`` and ``missing`` are then empty.
    error : str or None
        Why it is not available.
    present : tuple of str
        Keys whose entry (manifest and files) is on the remote.
    missing : tuple of str
        Keys the remote does not hold.

    """

    url: str
    prefix: str
    available: bool
    error: str | None = None
    present: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """Return the report as a JSON-able dict."""
        return asdict(self)


class _Health:
    """Whether one remote URL is usable in this process."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.down_until = 0.0
        self.error: str | None = None
        self.warned = False


class RemoteHealth:
    """Per-process registry of each remote URL's health and pooled client, shared by every cache using it.

    A failure seen by one cache turns the remote off for :data:`RETRY_AFTER_S` for all of them, and the
    "unavailable" warning is logged once per URL per process. :meth:`reset` forgets everything (tests).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._health: dict[str, _Health] = {}
        self._clients: dict[str, Any] = {}

    def get(self, url: str) -> tuple[_Health, Any]:
        """Return the health record and (lazily made, pooled) redis client of ``url``."""
        with self._lock:
            if url not in self._clients:
                import redis  # imported on first use: importing jitwarm.cache must not cost a redis import
                from redis.backoff import ExponentialBackoff
                from redis.retry import Retry

                # One quick retry, not redis-py's default backoff: a startup must not hang on a dead server.
                self._clients[url] = redis.Redis.from_url(url, socket_connect_timeout=CONNECT_TIMEOUT_S,
                                                          socket_timeout=READ_TIMEOUT_S,
                                                          retry=Retry(ExponentialBackoff(cap=0.2, base=0.05), 1))
                self._health[url] = _Health()
            return self._health[url], self._clients[url]

    def reset(self) -> None:
        """Close every pooled client and forget every URL's health (each remote is tried afresh)."""
        with self._lock:
            clients, self._clients, self._health = list(self._clients.values()), {}, {}
        for client in clients:
            with contextlib.suppress(Exception):
                client.close()


#: The registry of this process.
HEALTH = RemoteHealth()


def reset_remote_health() -> None:
    """Forget this process's remote health and close its pooled clients (for tests; see :class:`RemoteHealth`)."""
    HEALTH.reset()


class RemoteStore:
    """Entries of one cache format in one Redis namespace, and the health of that server.

    Contract: every method that talks to Redis raises :class:`RemoteFailure` (never a redis exception);
    the caller passes it to :meth:`failed`, which logs it once and turns the remote off for
    :data:`RETRY_AFTER_S` (or raises :class:`~jitwarm.cache.errors.RemoteUnavailable` when the remote is
    required). :meth:`fetch` writes an entry only after every byte matched its manifest; a remote entry
    that does not is reported, counted in ``remote_rejected`` and never written. Nothing here takes a
    lock: the caller holds the key's host lock around :meth:`fetch` and :meth:`upload`.

    Parameters
    ----------
    url : str
        A Redis URL (``redis://``, ``rediss://``, ``unix://``; password and db as redis-py reads them).
    prefix : str
        Key namespace, so that fleets can share a server.
    required : bool
        Raise instead of continuing locally when the remote fails.
    max_bytes : int
        Entries larger than this are not uploaded.
    shared : bool
        The local root's ``allow_shared`` (decides the modes of downloaded directories).
    count : callable, optional
        ``count(name, amount=1)`` adds to a ``remote_*`` counter of :class:`~jitwarm.cache.CacheStats`.

    """

    def __init__(self, url: str, prefix: str = "jitwarm", *, required: bool = False, max_bytes: int = 256 << 20,
                 shared: bool = False, count: Callable[..., None] | None = None) -> None:
        self.url = url
        self.display = redact(url)
        self.prefix = prefix
        self.required = required
        self.max_bytes = max_bytes
        self.shared = shared
        self._count = count or (lambda name, amount=1: None)
        self._rejected: dict[str, str] = {}  # key -> sha256 of a manifest already rejected by this instance

    def entry_name(self, key: str) -> str:
        """Return the Redis key of the entry hash of ``key``."""
        return f"{self.prefix}:v{FORMAT_VERSION}:entry:{key}"

    def lease_name(self, key: str) -> str:
        """Return the Redis key of the fleet build lease of ``key``."""
        return f"{self.prefix}:v{FORMAT_VERSION}:lease:{key}"

    # -- health -----------------------------------------------------------------------------------

    @property
    def usable(self) -> bool:
        """False while this process considers the remote down (a required remote is always tried)."""
        health, _ = HEALTH.get(self.url)
        return self.required or time.monotonic() >= health.down_until

    @property
    def error(self) -> str | None:
        """Why the remote is considered down now, or None."""
        health, _ = HEALTH.get(self.url)
        return health.error if time.monotonic() < health.down_until else None

    def call(self, what: str, fn: Callable[[Any], T]) -> T:
        """Run ``fn(client)``; a redis or socket error becomes RemoteFailure("<what>: <error>")."""
        from redis.exceptions import RedisError

        _, client = HEALTH.get(self.url)
        try:
            return fn(client)
        except (RedisError, OSError) as exc:
            raise RemoteFailure(f"{what}: {type(exc).__name__}: {exc}") from exc

    def failed(self, exc: RemoteFailure) -> None:
        """Record a failure: raise RemoteUnavailable if required, else log once and go local-only for a while.

        Raises
        ------
        RemoteUnavailable
            The remote is required.

        """
        self._count("remote_errors")
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if self.required:
            raise RemoteUnavailable(self.display, reason) from exc
        health, _ = HEALTH.get(self.url)
        with health.lock:
            health.down_until = time.monotonic() + RETRY_AFTER_S
            health.error = reason
            warn, health.warned = not health.warned, True
        # A fleet start-up must never fail because the shared cache is down: say so once, then go on.
        (log.warning if warn else log.debug)("remote cache %s unavailable (%s): continuing with the local "
                                             "cache only", self.display, reason)

    def check(self) -> str | None:
        """PING the server: None when it answers, else why not (after :meth:`failed`, which may raise)."""
        try:
            self.call("ping", lambda c: c.ping())
        except RemoteFailure as exc:
            self.failed(exc)
            return str(exc)
        return None

    # -- entries ----------------------------------------------------------------------------------

    def fetch(self, key: str, dest: Path) -> Entry | None:
        """Download the entry of ``key`` into the new directory ``dest``, checked against its manifest.

        Returns
        -------
        Entry or None
            The complete entry at ``dest`` (sealed like a build, hashed once, not yet published); None when
            the remote has no entry, or has one that failed the check (reported, counted in
            ``remote_rejected``; ``dest`` is not left behind).

        Raises
        ------
        RemoteFailure
            Redis failed.

        """
        name = self.entry_name(key)
        probe = self.call("read", lambda c: c.hget(name, "manifest"))
        rejected = self._rejected.get(key)
        if probe is None or (rejected is not None and rejected == _digest(probe)):
            return None  # nothing there, or the entry we rejected before: not worth a download
        raw: dict[bytes, bytes] = self.call("download", lambda c: c.hgetall(name))
        manifest = raw.get(b"manifest")
        if manifest is None:
            return None
        meta = _loads(raw.get(b"meta"))
        files = {k[5:].decode("utf-8", "replace"): v for k, v in raw.items() if k.startswith(b"file:")}
        executable = meta.get("executable") if isinstance(meta.get("executable"), list) else []
        try:
            return unpack_entry(dest, key, manifest, files, executable, shared=self.shared)
        except CorruptEntry as exc:
            remove_tree(dest)
            self._rejected[key] = _digest(manifest)
            self._count("remote_rejected")
            origin = f"pid {meta.get('pid')} on {meta.get('host')}" if meta.get("host") else "unknown uploader"
            log.warning("rejected remote entry %s on %s (uploaded by %s): %s; it is not used and will be "
                        "replaced by the next build", key, self.display, origin, exc)
            return None
        except BaseException:
            remove_tree(dest)
            raise

    def upload(self, entry: Entry) -> bool:
        """Upload a verified local entry, replacing any remote one of its key in one transaction.

        The files are not hashed again: they are read, then their stat signature is compared with the one
        taken when they were hashed (every downloader checks each sha256 anyway).

        Returns
        -------
        bool
            False when the entry is larger than ``max_bytes`` or its files changed since they were hashed
            (logged; nothing uploaded).

        Raises
        ------
        RemoteFailure
            Redis failed; the transaction did not apply, so the remote is as it was.

        """
        if entry.size_bytes > self.max_bytes:
            log.info("not uploading cache key %s to %s: %d bytes is over the remote size cap of %d bytes "
                     "(JITWARM_REMOTE_MAX_BYTES)", entry.key, self.display, entry.size_bytes, self.max_bytes)
            return False
        fields: dict[str, bytes] = {"manifest": (entry.path / MANIFEST).read_bytes()}
        executable = []
        for rec in entry.records:
            path = entry.path / rec.path
            fields[f"file:{rec.path}"] = path.read_bytes()
            if os.lstat(path).st_mode & 0o111:
                executable.append(rec.path)
        if not unchanged(entry):  # checked after reading: what was read is what was hashed
            log.warning("not uploading cache key %s: its files changed since they were verified", entry.key)
            return False
        fields["meta"] = json.dumps({"host": this_host(), "pid": os.getpid(), "uploaded": time.time(),
                                     "executable": executable}).encode()
        name = self.entry_name(entry.key)

        def replace(client: Any) -> None:
            pipe = client.pipeline(transaction=True)
            pipe.delete(name)
            pipe.hset(name, mapping=fields)
            pipe.execute()

        self.call("upload", replace)
        self._rejected.pop(entry.key, None)
        self._count("remote_uploads")
        return True

    def report(self, keys: Iterable[str]) -> RemoteReport:
        """Return which of ``keys`` the remote holds; an unavailable remote gives ``available=False``.

        Raises
        ------
        RemoteUnavailable
            The remote is required and could not be asked.

        """
        keys = list(keys)

        def ask(client: Any) -> list[bool]:
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.hexists(self.entry_name(key), "manifest")
            return [bool(x) for x in pipe.execute()]

        try:
            found = self.call("status", ask)
        except RemoteFailure as exc:
            self.failed(exc)
            return RemoteReport(self.display, self.prefix, available=False, error=str(exc))
        return RemoteReport(self.display, self.prefix, available=True,
                            present=tuple(k for k, f in zip(keys, found, strict=True) if f),
                            missing=tuple(k for k, f in zip(keys, found, strict=True) if not f))


def _digest(data: bytes) -> str:
    """sha256 hex of ``data``."""
    return hashlib.sha256(data).hexdigest()


def _loads(data: bytes | None) -> dict[str, Any]:
    """Parse the ``meta`` field; it is informational, so anything malformed reads as empty."""
    with contextlib.suppress(ValueError, TypeError):
        doc = json.loads(data or b"{}")
        if isinstance(doc, dict):
            return doc
    return {}
