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
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from jitwarm.cache.entry import MAX_MANIFEST_BYTES, Entry, unpack_entry
from jitwarm.cache.errors import CorruptEntry
from jitwarm.cache.files import loads
from jitwarm.cache.keys import FORMAT_VERSION
from jitwarm.cache.locks import this_host
from jitwarm.cache.remote.base import StoreBase
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


class RemoteStore(StoreBase):
    """Entries of one cache format in one Redis namespace, and the health of that server.

    The calls of :class:`~jitwarm.cache.remote.base.StoreBase`; a redis or socket error is a RemoteFailure.
    """

    def __init__(self, url: str, prefix: str = "jitwarm", *, required: bool = False, max_bytes: int = 256 << 20,
                 shared: bool = False, count: Callable[..., None] | None = None,
                 trust_key: bytes | None = None) -> None:
        super().__init__(url, redact(url), prefix, required=required, max_bytes=max_bytes, shared=shared,
                         count=count, trust_key=trust_key)

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

    def _connect(self) -> Any:
        import redis  # imported on first use: importing jitwarm.cache must not cost a redis import
        from redis.backoff import ExponentialBackoff
        from redis.retry import Retry

        # One quick retry, not redis-py's default backoff: a startup must not hang on a dead server.
        return redis.Redis.from_url(self.url, socket_connect_timeout=CONNECT_TIMEOUT_S, socket_timeout=READ_TIMEOUT_S,
                                    retry=Retry(ExponentialBackoff(cap=0.2, base=0.05), 1))

    def _errors(self) -> tuple[type[BaseException], ...]:
        from redis.exceptions import RedisError

        return (RedisError, OSError)

    def _probe(self) -> None:
        """PING the server."""
        self.call("ping", lambda c: c.ping())

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

    def upload(self, entry: Entry) -> bool:
        """Upload a verified local entry, replacing the remote one in one transaction; ``RemoteFailure``.

        Read, not hashed again (its signature is compared after the read). False for an entry over
        ``max_bytes`` or changed since it was hashed.
        """
        read = self._read_entry(entry)
        if read is None:
            return False
        manifest, files, executable = read
        fields = {"manifest": manifest, **{f"file:{rec.path}": data for rec, data in files}}
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

    def _present(self, keys: list[str]) -> list[bool]:
        def ask(client: Any) -> list[bool]:
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.hexists(self.entry_name(key), "manifest")
            return [bool(x) for x in pipe.execute()]

        return self.call("status", ask)


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
