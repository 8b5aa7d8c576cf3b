"""The fleet key: entries a node publishes to a remote tier are signed over their manifest, and checked on read.

Content hashes prove integrity, not origin: whoever can write the store can write a matching manifest too.
With a key (``JITWARM_TRUST_KEY`` holding it, or ``JITWARM_TRUST_KEY_FILE``), each upload carries
``{"key_id", "hmac"}``: HMAC-SHA256 under the key over the entry's key, its ``entry.json`` bytes and its
executable files. A download whose signature is missing or does not verify raises :class:`UntrustedEntry`
(exit 4, naming the entry) before anything is written; one signed with another key says so (``key_id``).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Collection
from typing import Any

from jitwarm.cache.errors import EXIT_CORRUPT, CacheError

_DOMAIN = b"jitwarm-entry-signature-v1\0"


class UntrustedEntry(CacheError):
    """An entry from a remote tier is unsigned or its signature does not verify under the fleet key: exit 4."""

    exit_code = EXIT_CORRUPT


def key_id(key: bytes) -> str:
    """The public name of ``key``: the first 16 hex digits of its sha256 (tells two keys apart, reveals neither)."""
    return hashlib.sha256(key).hexdigest()[:16]


def sign(key: bytes, entry_key: str, manifest: bytes, executable: Collection[str]) -> dict[str, str]:
    """Return the signature of one entry: ``{"key_id", "hmac"}``."""
    return {"key_id": key_id(key), "hmac": _mac(key, entry_key, manifest, executable)}


def check(key: bytes, entry_key: str, manifest: bytes, executable: Collection[str], signature: Any,
          where: str) -> None:
    """Raise UntrustedEntry unless ``signature`` is this entry's under ``key``; ``where`` names the store."""
    if not isinstance(signature, dict) or not isinstance(signature.get("hmac"), str):
        raise UntrustedEntry(f"remote entry {entry_key} on {where} is not signed, and a fleet key is configured",
                             "publish it from a node that has JITWARM_TRUST_KEY (or _FILE), or remove it")
    if signature.get("key_id") != key_id(key):
        raise UntrustedEntry(f"remote entry {entry_key} on {where} is signed with another key "
                             f"({str(signature.get('key_id'))[:16]!r}, ours is {key_id(key)!r})")
    if not hmac.compare_digest(signature["hmac"], _mac(key, entry_key, manifest, executable)):
        raise UntrustedEntry(f"remote entry {entry_key} on {where}: its signature does not verify "
                             "(altered after it was signed)")


def _mac(key: bytes, entry_key: str, manifest: bytes, executable: Collection[str]) -> str:
    message = b"\0".join([_DOMAIN, entry_key.encode(), "\n".join(sorted(executable)).encode(), manifest])
    return hmac.new(key, message, hashlib.sha256).hexdigest()
