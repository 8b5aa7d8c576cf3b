"""StoreBase: what every remote store does alike, and each remote URL's health in this process."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

from jitwarm.cache.entry import MANIFEST, MAX_MANIFEST_BYTES, Entry, is_private, unchanged
from jitwarm.cache.errors import RemoteUnavailable
from jitwarm.cache.files import open_regular
from jitwarm.cache.locks import this_host
from jitwarm.cache.signing import sign

log = logging.getLogger("jitwarm.cache")

T = TypeVar("T")

#: After a failure the remote is skipped for this long by every cache of this process, then tried again.
RETRY_AFTER_S = 60.0


class RemoteFailure(Exception):
    """A call to the remote failed: control flow inside the remote tier, never raised past it.

    :meth:`StoreBase.failed` turns it into a local build or :class:`~jitwarm.cache.errors.RemoteUnavailable`;
    not exported from :mod:`jitwarm.cache.remote`.
    """


class TooSlow(RemoteFailure):
    """A transfer ran past its overall deadline (:func:`deadline`)."""


@contextlib.contextmanager
def deadline(what: str, size: int, grace_s: float, rate: int, abort: Callable[[], object]) -> Iterator[None]:
    """Bound one transfer of ``size`` bytes to ``grace_s`` plus ``size`` at ``rate`` bytes/s (0: no bound).

    A per-read timeout alone lets a trickling store hold a download and the key's lock without end.
    Past the deadline a timer thread calls ``abort()`` to wake the read, and the block raises :class:`TooSlow`.
    """
    if rate <= 0:
        yield
        return
    limit = grace_s + size / rate
    fired, done = threading.Event(), threading.Event()

    def expire() -> None:
        if done.wait(limit):
            return
        fired.set()
        # Until the block exits: a client that retries a dropped read (redis-py's Retry) reconnects.
        while True:
            with contextlib.suppress(Exception):  # a transfer that ended meanwhile: nothing left to shut
                abort()
            if done.wait(0.2):
                return

    timer = threading.Thread(target=expire, name="jitwarm-deadline", daemon=True)
    timer.start()
    slow = (f"{what}: slower than JITWARM_REMOTE_MIN_RATE={rate} bytes/s: {size} bytes not in within "
            f"{limit:.1f} s")
    try:
        yield
    except Exception as exc:
        if fired.is_set():
            raise TooSlow(slow) from exc
        raise
    finally:
        done.set()
    if fired.is_set():
        raise TooSlow(slow)


def interrupt(stream: Any) -> None:
    """Shut the socket under an HTTP body so a read blocked on it returns (closing does not wake a ``recv``).

    urllib3 2.3 and later have ``HTTPResponse.shutdown``; before, the connection's socket is shut directly.
    """
    raw = getattr(stream, "_raw_stream", stream)
    shutdown = getattr(raw, "shutdown", None)
    if shutdown is not None:
        shutdown()
        return
    sock = getattr(getattr(raw, "_connection", None), "sock", None)
    if sock is not None:
        sock.shutdown(socket.SHUT_RDWR)


@dataclass(frozen=True)
class RemoteReport:
    """Which keys the remote holds (``available`` False: it could not be asked, ``error`` says why)."""

    url: str
    prefix: str
    available: bool
    error: str | None = None
    present: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """Return the report as a JSON-able dict."""
        return asdict(self)


@dataclass
class _Health:
    """One remote URL in this process: its pooled client, and whether (and why) it is down."""

    client: Any = None
    down_until: float = 0.0
    error: str | None = None
    warned: bool = False


#: Per URL, shared by every cache of this process: a failure one of them sees turns the remote off for all.
_HEALTH: dict[str, _Health] = {}
_HEALTH_LOCK = threading.Lock()


def _health(url: str) -> _Health:
    with _HEALTH_LOCK:
        return _HEALTH.setdefault(url, _Health())


def reset_remote_health() -> None:
    """Close this process's pooled clients and forget each remote's health (for tests)."""
    with _HEALTH_LOCK:
        records = list(_HEALTH.values())
        _HEALTH.clear()
    for record in records:
        if record.client is not None:
            with contextlib.suppress(Exception):
                record.client.close()


def redact(url: str) -> str:
    """Return ``url`` without its password and query, for messages (``redis://:***@host:6379/0``)."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, hostport = netloc.rsplit("@", 1)
        user = userinfo.split(":", 1)[0]
        netloc = f"{user}:***@{hostport}" if ":" in userinfo else f"{user}@{hostport}"
    return f"{parts.scheme}://{netloc}{parts.path}"


class StoreBase:
    """Entries of one cache format on one remote; every call goes through :meth:`call` (``RemoteFailure``).

    A store (:mod:`.redis`, :mod:`.s3`) defines ``lease_class``, ``_connect()``, ``_errors()``, ``_probe()``,
    ``_present(keys)``, ``_put_entry(...)`` and ``fetch(key, dest) -> Entry | None``: the entry downloaded into
    ``dest`` after every byte is checked; None for none, one over ``max_bytes`` or a rejected one. Raises
    ``RemoteFailure`` or ``CacheWriteError``; the caller removes ``dest``.
    """

    def __init__(self, url: str, prefix: str = "jitwarm", *, required: bool = False, max_bytes: int = 256 << 20,
                 shared: bool = False, count: Callable[..., None] | None = None,
                 trust_key: bytes | None = None, min_rate: int = 1 << 20) -> None:
        self.trust_key = trust_key
        self.min_rate = min_rate
        self.url = url
        self.display = redact(url)
        self.prefix = prefix
        self.required = required
        self.max_bytes = max_bytes
        self.shared = shared
        self._count = count or (lambda name, amount=1: None)
        self._rejected: dict[str, str] = {}  # key -> what identifies an entry already rejected (sha1, ETag)

    def _describe(self, exc: BaseException) -> str:
        """One line for a client error, after ``<what>: `` in its RemoteFailure."""
        return f"{type(exc).__name__}: {exc}"

    def _client(self) -> Any:
        """The pooled client of this URL, made on first use."""
        health = _health(self.url)
        with _HEALTH_LOCK:
            if health.client is None:
                health.client = self._connect()
            return health.client

    @property
    def usable(self) -> bool:
        """False while this process considers the remote down (a required remote is always tried)."""
        return self.required or time.monotonic() >= _health(self.url).down_until

    @property
    def error(self) -> str | None:
        """Why the remote is considered down now, or None."""
        health = _health(self.url)
        return health.error if time.monotonic() < health.down_until else None

    def call(self, what: str, fn: Callable[[Any], T]) -> T:
        """Run ``fn(client)``; a client or socket error becomes RemoteFailure("<what>: <error>")."""
        errors = self._errors()
        try:
            return fn(self._client())
        except errors as exc:
            raise RemoteFailure(f"{what}: {self._describe(exc)}") from exc

    def failed(self, exc: RemoteFailure) -> None:
        """Record a failure: ``RemoteUnavailable`` if required, else log once and go local-only for a while."""
        self._count("remote_errors")
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if self.required:
            raise RemoteUnavailable(self.display, reason) from exc
        health = _health(self.url)
        with _HEALTH_LOCK:
            health.down_until = time.monotonic() + RETRY_AFTER_S
            health.error = reason
            warn, health.warned = not health.warned, True
        # A fleet start-up must never fail because the shared cache is down: say so once, then go on.
        (log.warning if warn else log.debug)("remote cache %s unavailable (%s): continuing with the local "
                                             "cache only", self.display, reason)

    def check(self) -> str | None:
        """Probe the remote: None when it answers, else why not (after :meth:`failed`, which may raise)."""
        try:
            self._probe()
        except RemoteFailure as exc:
            self.failed(exc)
            return str(exc)
        return None

    def report(self, keys: Iterable[str]) -> RemoteReport:
        """Return which of ``keys`` the remote holds; ``RemoteUnavailable`` if a required one cannot be asked."""
        keys = list(keys)
        try:
            found = self._present(keys)
        except RemoteFailure as exc:
            self.failed(exc)
            return RemoteReport(self.display, self.prefix, available=False, error=str(exc))
        return RemoteReport(self.display, self.prefix, available=True,
                            present=tuple(k for k, f in zip(keys, found, strict=True) if f),
                            missing=tuple(k for k, f in zip(keys, found, strict=True) if not f))

    def upload(self, entry: Entry) -> bool:
        """Upload a verified local entry (signed); False (logged) if it changed or is too large. ``RemoteFailure``."""
        if entry.size_bytes > self.max_bytes:
            log.info("not uploading cache key %s to %s: %d bytes is over the remote size cap of %d bytes "
                     "(JITWARM_REMOTE_MAX_BYTES)", entry.key, self.display, entry.size_bytes, self.max_bytes)
            return False
        manifest, _mode = _read(entry.path / MANIFEST, MAX_MANIFEST_BYTES)
        files, executable, private = [], [], []
        for rec in entry.records:
            data, mode = _read(entry.path / rec.path, rec.size)
            files.append((rec, data))
            if mode & 0o111:
                executable.append(rec.path)
            if is_private(mode):
                private.append(rec.path)
        if not unchanged(entry):  # checked after reading: what was read is what was hashed
            log.warning("not uploading cache key %s: its files changed since they were verified", entry.key)
            return False
        signed: dict[str, Any] = {"executable": executable}
        if self.trust_key is not None:
            signed["signature"] = sign(self.trust_key, entry.key, manifest, executable, private)
        self._put_entry(entry.key, manifest, files, signed,
                        {"host": this_host(), "pid": os.getpid(), "uploaded": time.time(), "private": private})
        self._rejected.pop(entry.key, None)
        self._count("remote_uploads")
        return True

    def _too_large(self, key: str, total: object) -> None:
        """Log that ``key``'s remote entry is over the size cap (it is built here)."""
        log.info("not downloading cache key %s from %s: its files total %s bytes, over the remote size cap of "
                 "%d bytes (JITWARM_REMOTE_MAX_BYTES); building it locally", key, self.display, total,
                 self.max_bytes)

    def _reject(self, key: str, why: str, seen: str | None, uploader: dict[str, Any]) -> None:
        """Report a remote entry that failed the check; ``seen`` (that entry) is not downloaded again here."""
        if seen is not None:
            self._rejected[key] = seen
        self._count("remote_rejected")
        origin = f"pid {uploader.get('pid')} on {uploader.get('host')}" if uploader.get("host") else \
            "unknown uploader"
        log.warning("rejected remote entry %s on %s (uploaded by %s): %s; it is not used and will be "
                    "replaced by the next build", key, self.display, str(origin)[:200], why)


def strings(value: object) -> list[str]:
    """The strings of a list read from the remote (the ``executable`` files): anything else is dropped."""
    return [p for p in value if isinstance(p, str)] if isinstance(value, list) else []


def _read(path: Path, size: int) -> tuple[bytes, int]:
    """Read a file of a local entry to upload it, and its mode."""
    fd, st = open_regular(path)
    with os.fdopen(fd, "rb") as f:
        return f.read(size + 1), st.st_mode
