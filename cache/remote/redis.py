"""RemoteStore: the fleet's shared second cache level in Redis: entries as hashes, health, presence.

One hash per entry, ``<prefix>:v1:entry:<key>``: ``manifest`` (the entry's ``entry.json``), ``meta`` (uploader,
executable files) and ``file:<path>`` per file. An upload replaces the whole hash in one MULTI/EXEC and a
download reads it in one atomic script, so a reader sees a complete entry or none (an LRU evicts it whole).
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

from jitwarm.cache.entry import MANIFEST, MAX_MANIFEST_BYTES, Entry, unchanged, unpack_entry
from jitwarm.cache.errors import CorruptEntry, RemoteUnavailable
from jitwarm.cache.files import loads, open_regular
from jitwarm.cache.keys import FORMAT_VERSION
from jitwarm.cache.locks import this_host
from jitwarm.cache.signing import check, sign

log = logging.getLogger("jitwarm.cache")

#: An entry hash has a manifest, a meta field and one field per file; more fields than this is not ours.
MAX_FIELDS = 100_000
#: The ``meta`` field (uploader, executable files) is at most this large.
MAX_META_BYTES = 1 << 20

# One atomic step that sizes the entry hash before sending it: HGETALL of an entry over the size cap (or of a
# planted 1 GiB blob) downloaded all of it first. Returns {0} (no entry), {1, what, n, sha1} (malformed: rejected),
# {2} (the manifest this store rejected before), {3, n} (files total n bytes, over the cap), {4, HGETALL}.
# ARGV: max file bytes, max manifest bytes, max meta bytes, max fields, sha1 of a rejected manifest or "".
_FETCH = """
local mlen = redis.call('hstrlen', KEYS[1], 'manifest')
if mlen == 0 then return {0} end
local sha1 = redis.sha1hex(redis.call('hget', KEYS[1], 'manifest'))
if sha1 == ARGV[5] then return {2} end
if mlen > tonumber(ARGV[2]) then return {1, 'manifest', mlen, sha1} end
local n = redis.call('hlen', KEYS[1])
if n > tonumber(ARGV[4]) then return {1, 'fields', n, sha1} end
local files, other = 0, 0
for _, f in ipairs(redis.call('hkeys', KEYS[1])) do
  local len = redis.call('hstrlen', KEYS[1], f)
  if string.sub(f, 1, 5) == 'file:' then files = files + len elseif f ~= 'manifest' then other = other + len end
end
if files > tonumber(ARGV[1]) then return {3, files} end
if other > tonumber(ARGV[3]) then return {1, 'meta', other, sha1} end
return {4, redis.call('hgetall', KEYS[1])}
"""

T = TypeVar("T")


#: After a failure the remote is skipped for this long by every cache of this process, then tried again.
RETRY_AFTER_S = 60.0
#: Deadlines unless the URL sets ``socket_connect_timeout`` / ``socket_timeout`` (redis-py query args).
CONNECT_TIMEOUT_S = 2.0
READ_TIMEOUT_S = 10.0


def redact(url: str) -> str:
    """Return ``url`` without its password and query, for messages (``redis://:***@host:6379/0``)."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, hostport = netloc.rsplit("@", 1)
        user = userinfo.split(":", 1)[0]
        netloc = f"{user}:***@{hostport}" if ":" in userinfo else f"{user}@{hostport}"
    return f"{parts.scheme}://{netloc}{parts.path}"


class _Health:
    """One remote URL in this process: its pooled client, and whether (and why) it is down."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.down_until = 0.0
        self.error: str | None = None
        self.warned = False


#: Per URL, shared by every cache of this process: a failure one of them sees turns the remote off for all.
_HEALTH: dict[str, _Health] = {}
_HEALTH_LOCK = threading.Lock()


def _health(url: str) -> _Health:
    """The health record of ``url``, with its redis client (made on first use)."""
    with _HEALTH_LOCK:
        if url not in _HEALTH:
            import redis  # imported on first use: importing jitwarm.cache must not cost a redis import
            from redis.backoff import ExponentialBackoff
            from redis.retry import Retry

            # One quick retry, not redis-py's default backoff: a startup must not hang on a dead server.
            _HEALTH[url] = _Health(redis.Redis.from_url(url, socket_connect_timeout=CONNECT_TIMEOUT_S,
                                                        socket_timeout=READ_TIMEOUT_S,
                                                        retry=Retry(ExponentialBackoff(cap=0.2, base=0.05), 1)))
        return _HEALTH[url]


def reset_remote_health() -> None:
    """Close this process's pooled clients and forget each remote's health (for tests)."""
    with _HEALTH_LOCK:
        records = list(_HEALTH.values())
        _HEALTH.clear()
    for record in records:
        with contextlib.suppress(Exception):
            record.client.close()


class RemoteFailure(Exception):
    """A Redis call failed (internal: :meth:`RemoteStore.failed` logs it, or raises RemoteUnavailable)."""


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


class RemoteStore:
    """Entries of one cache format in one Redis namespace, and the health of that server.

    Every call to Redis raises :class:`RemoteFailure` (never a redis exception), which the caller hands to
    :meth:`failed`. Nothing here locks: the caller holds the key's host lock. ``max_bytes`` caps what is
    uploaded or downloaded; ``shared`` is the local root's ``allow_shared``; ``count`` adds to a counter.
    """

    def __init__(self, url: str, prefix: str = "jitwarm", *, required: bool = False, max_bytes: int = 256 << 20,
                 shared: bool = False, count: Callable[..., None] | None = None,
                 trust_key: bytes | None = None) -> None:
        self.trust_key = trust_key  # the fleet key (jitwarm.cache.signing): sign uploads, check downloads
        self.url = url
        self.display = redact(url)
        self.prefix = prefix
        self.required = required
        self.max_bytes = max_bytes
        self.shared = shared
        self._count = count or (lambda name, amount=1: None)
        self._rejected: dict[str, str] = {}  # key -> sha1 of a manifest already rejected (as Lua's sha1hex)

    def entry_name(self, key: str) -> str:
        """Return the Redis key of the entry hash of ``key``."""
        return f"{self.prefix}:v{FORMAT_VERSION}:entry:{key}"

    def lease_name(self, key: str) -> str:
        """Return the Redis key of the fleet build lease of ``key``."""
        return f"{self.prefix}:v{FORMAT_VERSION}:lease:{key}"

    def new_lease(self, key: str, ttl_s: float) -> Any:
        """Return the fleet build lease of ``key`` (a :class:`~jitwarm.cache.remote.fleet.FleetLease`)."""
        from jitwarm.cache.remote.fleet import FleetLease  # fleet builds on this module

        return FleetLease(self, key, ttl_s)

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
        """Run ``fn(client)``; a redis or socket error becomes RemoteFailure("<what>: <error>")."""
        from redis.exceptions import RedisError

        try:
            return fn(_health(self.url).client)
        except (RedisError, OSError) as exc:
            raise RemoteFailure(f"{what}: {type(exc).__name__}: {exc}") from exc

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
        """PING the server: None when it answers, else why not (after :meth:`failed`, which may raise)."""
        try:
            self.call("ping", lambda c: c.ping())
        except RemoteFailure as exc:
            self.failed(exc)
            return str(exc)
        return None

    def fetch(self, key: str, dest: Path) -> Entry | None:
        """Download ``key``'s entry into the empty staging dir ``dest``, sized on the server and checked.

        None for no entry, one over ``max_bytes``, or one that failed the check (reported, not kept).
        Raises ``RemoteFailure`` (Redis) or ``CacheWriteError`` (a full disk). The caller removes ``dest``.
        """
        name = self.entry_name(key)
        args = (self.max_bytes, MAX_MANIFEST_BYTES, MAX_META_BYTES, MAX_FIELDS, self._rejected.get(key, ""))
        reply = self.call("download", lambda c: c.eval(_FETCH, 1, name, *args))
        status = reply[0] if isinstance(reply, list) and reply else None
        if status in (0, 2):
            return None  # nothing there, or the entry we rejected before: not worth a download
        if status == 3:
            log.info("not downloading cache key %s from %s: its files total %s bytes, over the remote size cap of "
                     "%d bytes (JITWARM_REMOTE_MAX_BYTES); building it locally", key, self.display, reply[1],
                     self.max_bytes)
            return None
        if status != 4 or not isinstance(reply[1], list):
            malformed = status == 1 and len(reply) == 4
            what = f"{_text(reply[1])} too large ({reply[2]})" if malformed else "an unexpected reply"
            self._reject(key, f"the entry hash is malformed: {what}", _text(reply[3]) if malformed else None, {})
            return None
        raw = dict(zip(reply[1][::2], reply[1][1::2], strict=False))
        manifest = raw.get(b"manifest")
        if not isinstance(manifest, bytes):
            return None
        meta = _loads(raw.get(b"meta"))
        files = {k[5:].decode("utf-8", "replace"): v for k, v in raw.items() if k.startswith(b"file:")}
        executable = [p for p in meta.get("executable", ()) if isinstance(p, str)] \
            if isinstance(meta.get("executable"), list) else []
        if self.trust_key is not None:  # before anything is written: UntrustedEntry (exit 4)
            check(self.trust_key, key, manifest, executable, meta.get("signature"), self.display)
        try:
            return unpack_entry(dest, key, manifest, files, executable, shared=self.shared)
        except CorruptEntry as exc:
            self._reject(key, str(exc), hashlib.sha1(manifest, usedforsecurity=False).hexdigest(), meta)
            return None

    def _reject(self, key: str, why: str, manifest_sha1: str | None, meta: dict[str, Any]) -> None:
        """Report a remote entry that failed the check; the same manifest is not downloaded again by this store."""
        if manifest_sha1 is not None:
            self._rejected[key] = manifest_sha1
        self._count("remote_rejected")
        origin = f"pid {meta.get('pid')} on {meta.get('host')}" if meta.get("host") else "unknown uploader"
        log.warning("rejected remote entry %s on %s (uploaded by %s): %s; it is not used and will be "
                    "replaced by the next build", key, self.display, str(origin)[:200], why)

    def upload(self, entry: Entry) -> bool:
        """Upload a verified local entry, replacing the remote one in one transaction; ``RemoteFailure``.

        Read, not hashed again (its signature is compared after the read). False for an entry over
        ``max_bytes`` or changed since it was hashed.
        """
        if entry.size_bytes > self.max_bytes:
            log.info("not uploading cache key %s to %s: %d bytes is over the remote size cap of %d bytes "
                     "(JITWARM_REMOTE_MAX_BYTES)", entry.key, self.display, entry.size_bytes, self.max_bytes)
            return False
        fields: dict[str, bytes] = {"manifest": _read(entry.path / MANIFEST, MAX_MANIFEST_BYTES)}
        executable = []
        for rec in entry.records:
            path = entry.path / rec.path
            fields[f"file:{rec.path}"] = _read(path, rec.size)
            if os.lstat(path).st_mode & 0o111:
                executable.append(rec.path)
        if not unchanged(entry):  # checked after reading: what was read is what was hashed
            log.warning("not uploading cache key %s: its files changed since they were verified", entry.key)
            return False
        meta: dict[str, Any] = {"host": this_host(), "pid": os.getpid(), "uploaded": time.time(),
                                "executable": executable}
        if self.trust_key is not None:
            meta["signature"] = sign(self.trust_key, entry.key, fields["manifest"], executable)
        fields["meta"] = json.dumps(meta).encode()
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
        """Return which of ``keys`` the remote holds; ``RemoteUnavailable`` if a required one cannot be asked."""
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


def _read(path: Path, size: int) -> bytes:
    """Read a file of a local entry to upload it (a replaced or grown file fails the signature check after)."""
    fd, _st = open_regular(path)
    with os.fdopen(fd, "rb") as f:
        return f.read(size + 1)


def _text(value: object) -> str:
    """A reply item as text, for a message."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _loads(data: bytes | None) -> dict[str, Any]:
    """Parse the ``meta`` field; it is informational, so anything malformed (or nested too deep) reads as empty."""
    with contextlib.suppress(ValueError, TypeError):
        doc = loads(data or b"{}")
        if isinstance(doc, dict):
            return doc
    return {}
