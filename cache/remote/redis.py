"""RemoteStore and FleetLease: the fleet's shared second cache level in Redis, one hash per entry.

An upload replaces the whole hash in one MULTI/EXEC and a download sizes it, then reads it in one atomic
script, so a reader sees a complete entry or none. A key's lease is a string taken with ``SET NX PX``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from jitwarm.cache.entry import MAX_MANIFEST_BYTES, Entry, FileRecord, unpack_entry
from jitwarm.cache.errors import CorruptEntry
from jitwarm.cache.files import loads
from jitwarm.cache.keys import FORMAT_VERSION
from jitwarm.cache.remote.base import StoreBase, deadline, strings
from jitwarm.cache.remote.fleet import MAX_TOKEN_BYTES, LeaseWithoutExpiry, RenewedLease
from jitwarm.cache.signing import check

log = logging.getLogger("jitwarm.cache")

MAX_FIELDS = 100_000
MAX_META_BYTES = 1 << 20
#: Deadlines unless the URL sets ``socket_connect_timeout`` / ``socket_timeout`` (redis-py query args).
CONNECT_TIMEOUT_S = 2.0
READ_TIMEOUT_S = 10.0

# Sizes the entry hash on the server before anything is sent (HGETALL of a planted 1 GiB blob downloaded it all).
# With ARGV[6] "": {4, bytes, sha1 of the manifest}, to size the download's deadline; with ARGV[6]
# that sha1: {5, HGETALL} if it is still that entry, else {0}. Other replies: {0} (no entry), {1, what, n, sha1}
# (malformed), {2} (rejected before), {3, n} (over the cap). ARGV: caps (file, manifest, meta, fields), the
# sha1 of a rejected manifest or "", the sha1 sized.
_FETCH = """
local mlen = redis.call('hstrlen', KEYS[1], 'manifest')
if mlen == 0 then return {0} end
local sha1 = redis.sha1hex(redis.call('hget', KEYS[1], 'manifest'))
if sha1 == ARGV[5] then return {2} end
if ARGV[6] ~= '' then
  if sha1 ~= ARGV[6] then return {0} end
  return {5, redis.call('hgetall', KEYS[1])}
end
if mlen > tonumber(ARGV[2]) then return {1, 'manifest', mlen, sha1} end
local n = redis.call('hlen', KEYS[1])
if n > tonumber(ARGV[4]) then return {1, 'fields', n, sha1} end
local files, other, framing = 0, 0, 0
for _, f in ipairs(redis.call('hkeys', KEYS[1])) do
  local len = redis.call('hstrlen', KEYS[1], f)
  framing = framing + string.len(f) + 32
  if string.sub(f, 1, 5) == 'file:' then files = files + len elseif f ~= 'manifest' then other = other + len end
end
if files > tonumber(ARGV[1]) then return {3, files} end
if other > tonumber(ARGV[3]) then return {1, 'meta', other, sha1} end
return {4, files + other + mlen + framing, sha1}
"""
# Compare-and-extend and compare-and-delete: only the holder's token may touch the lease, so a holder that
# stalled past its expiry cannot extend or delete the lease a new holder took meanwhile.
_EXTEND = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end return 0"
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
# A lease without a TTL (set by hand) would keep every node waiting: give it one, and say it had none.
_ADD_EXPIRY = "if redis.call('pttl', KEYS[1]) == -1 then redis.call('pexpire', KEYS[1], ARGV[1]) return 1 end return 0"


class FleetLease(RenewedLease):
    """The fleet build lease of one key in Redis: it expires (``PX``) unless its holder extends it."""

    def __init__(self, store: StoreBase, key: str, ttl_s: float) -> None:
        super().__init__(store, key, ttl_s)
        self.ttl_ms = int(self.ttl_s * 1000)

    def _take(self) -> bytes | None:
        token = self._token()
        return token if self.store.call("lease", lambda c: c.set(self.name, token, nx=True, px=self.ttl_ms)) else None

    def _read(self) -> bytes | None:
        return self.store.call("lease", lambda c: c.getrange(self.name, 0, MAX_TOKEN_BYTES - 1))

    def check_expiry(self) -> None:
        """Raise LeaseWithoutExpiry when the lease (held by someone else) has no TTL, after giving it one."""
        if self.store.call("lease", lambda c: c.eval(_ADD_EXPIRY, 1, self.name, self.ttl_ms)) == 1:
            raise LeaseWithoutExpiry(f"fleet lease {self.name} on {self.store.display} had no expiry")

    def _renew(self) -> bool:
        token = self._held
        return bool(self.store.call("lease", lambda c: c.eval(_EXTEND, 1, self.name, token, self.ttl_ms)))

    def _delete(self, held: bytes) -> None:
        self.store.call("lease", lambda c: c.eval(_RELEASE, 1, self.name, held))


class RemoteStore(StoreBase):
    """Entries of one cache format in one Redis namespace (a redis or socket error is a RemoteFailure)."""

    lease_class = FleetLease

    def entry_name(self, key: str) -> str:
        """Return the Redis key of the entry hash of ``key``."""
        return f"{self.prefix}:v{FORMAT_VERSION}:entry:{key}"

    def lease_name(self, key: str) -> str:
        """Return the Redis key of the fleet build lease of ``key``."""
        return f"{self.prefix}:v{FORMAT_VERSION}:lease:{key}"

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
        self.call("ping", lambda c: c.ping())

    def fetch(self, key: str, dest: Path) -> Entry | None:
        """Download ``key``'s entry as :meth:`StoreBase.fetch` says, sized on the server first (the _FETCH script)."""
        args = (self.max_bytes, MAX_MANIFEST_BYTES, MAX_META_BYTES, MAX_FIELDS, self._rejected.get(key, ""))
        reply = self._fetch(key, args, "", 0)
        status = reply[0] if isinstance(reply, list) and reply else None
        if status in (0, 2):
            return None  # nothing there, or the entry we rejected before: not worth a download
        if status == 3:
            self._too_large(key, reply[1])
            return None
        if status == 4 and len(reply) == 3 and isinstance(reply[1], int):
            reply = self._fetch(key, args, _text(reply[2]), reply[1])
            status = reply[0] if isinstance(reply, list) and reply else None
            if status == 0:
                return None  # replaced since it was sized: the next start downloads the new one
        if status != 5 or not isinstance(reply[1], list):
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
        executable, private = strings(meta.get("executable")), strings(meta.get("private"))
        if self.trust_key is not None:  # before anything is written: UntrustedEntry (exit 4)
            check(self.trust_key, key, manifest, executable, private, meta.get("signature"), self.display)
        try:
            return unpack_entry(dest, key, manifest, files, executable, private, shared=self.shared)
        except CorruptEntry as exc:
            self._reject(key, str(exc), hashlib.sha1(manifest, usedforsecurity=False).hexdigest(), meta)
            return None

    def _fetch(self, key: str, args: tuple[object, ...], sha1: str, size: int) -> Any:
        """One _FETCH call on a connection of its own, cut at the deadline ``size`` bytes earn.

        Cutting the pool's sockets instead failed other threads' reads (a lease's heartbeat) with EBADF.
        """
        own: list[Any] = []  # its client, made inside the call: redis-py 5.0 connects as it makes one

        def fetch(pooled: Any) -> Any:
            own.append(type(pooled)(connection_pool=pooled.connection_pool, single_connection_client=True))
            return own[0].eval(_FETCH, 1, self.entry_name(key), *args, sha1)

        def cut() -> None:
            connection = own[0].connection if own else None
            if connection is not None:
                connection.disconnect()

        grace = self._client().connection_pool.connection_kwargs.get("socket_timeout") or READ_TIMEOUT_S
        try:
            with deadline(f"download: {self.entry_name(key)}", size, grace, self.min_rate, cut):
                return self.call("download", fetch)
        finally:
            for client in own:
                client.close()  # its connection goes back to the pool (a cut one reconnects when next used)

    def _put_entry(self, key: str, manifest: bytes, files: list[tuple[FileRecord, bytes]],
                   signed: dict[str, Any], uploader: dict[str, Any]) -> None:
        """Replace the entry hash in one transaction (DEL + HSET in MULTI/EXEC)."""
        fields = {"manifest": manifest, **{f"file:{rec.path}": data for rec, data in files},
                  "meta": json.dumps({**uploader, **signed}).encode()}
        name = self.entry_name(key)

        def replace(client: Any) -> None:
            pipe = client.pipeline(transaction=True)
            pipe.delete(name)
            pipe.hset(name, mapping=fields)
            pipe.execute()

        self.call("upload", replace)

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
    """Parse the ``meta`` field; anything malformed reads as empty."""
    with contextlib.suppress(ValueError, TypeError):
        doc = loads(data or b"{}")
        if isinstance(doc, dict):
            return doc
    return {}
