"""The fleet key: HMAC-SHA256 over an entry's key, manifest, executable and private files, checked before use.

Content hashes prove integrity, not origin: whoever can write the store can write a matching manifest too.
Bundles and shared layers keep signatures in ``v1/signatures/<kk>/<key>.json``, beside the entries.

A signature of ``"version": 2`` signs which files are private (kept ``0600``): emptying ``private`` in Redis's
``meta`` or widening a signed tar's modes was accepted, and the file restored ``0644``. One without a version
(made before) signs the executable files only: it still verifies, and its private flags are as unsigned as they
were until the entry is published or exported again.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
from collections.abc import Collection
from pathlib import Path
from typing import Any

from jitwarm.cache.entry import MANIFEST, MAX_MANIFEST_BYTES, Entry, is_private, unchanged
from jitwarm.cache.errors import CacheError, Refused
from jitwarm.cache.files import loads, read_file_stat

_DOMAIN = b"jitwarm-entry-signature-v1\0"
_DOMAIN_V2 = b"jitwarm-entry-signature-v2\0"
#: The signature format :func:`sign` writes.
VERSION = 2
SIGNATURES_DIR = "signatures"
MAX_SIGNATURE_BYTES = 4096
_HINT = "sign it: publish or export it from a node that has JITWARM_TRUST_KEY (or _FILE), or remove it"


class UntrustedEntry(CacheError, Refused):
    """An entry from a remote tier is unsigned or its signature does not verify under the fleet key: exit 4."""


def key_id(key: bytes) -> str:
    """The public name of ``key``: the first 16 hex digits of its sha256."""
    return hashlib.sha256(key).hexdigest()[:16]


def sign(key: bytes, entry_key: str, manifest: bytes, executable: Collection[str],
         private: Collection[str]) -> dict[str, Any]:
    """Return the signature of one entry: ``{"key_id", "hmac", "version"}``."""
    return {"key_id": key_id(key), "hmac": _mac(key, entry_key, manifest, executable, private), "version": VERSION}


def check(key: bytes, entry_key: str, manifest: bytes, executable: Collection[str], private: Collection[str],
          signature: Any, where: str, *, subject: str | None = None) -> None:
    """UntrustedEntry unless ``signature`` signs this entry under ``key``; ``subject`` (or store ``where``) names it."""
    name = subject or f"remote entry {entry_key} on {where}"
    if not isinstance(signature, dict) or not isinstance(signature.get("hmac"), str):
        raise UntrustedEntry(f"{name} is not signed, and a fleet key is configured", _HINT)
    if signature.get("key_id") != key_id(key):
        raise UntrustedEntry(f"{name} is signed with another key "
                             f"({str(signature.get('key_id'))[:16]!r}, ours is {key_id(key)!r})")
    version = signature.get("version", 1)
    if version not in (1, VERSION) or type(version) is not int:
        raise UntrustedEntry(f"{name} is signed in format {str(version)[:16]!r}, which this jitwarm does not read")
    mac = (_mac(key, entry_key, manifest, executable, private) if version == VERSION
           else _mac_v1(key, entry_key, manifest, executable))
    if not hmac.compare_digest(signature["hmac"], mac):
        raise UntrustedEntry(f"{name}: its signature does not verify (altered after it was signed)")


def signature_path(base: Path, entry_key: str) -> Path:
    """Where the signature of ``entry_key`` is under ``base`` (a ``v1``-level folder)."""
    return base / SIGNATURES_DIR / entry_key[:2] / f"{entry_key}.json"


def signature_file(key: bytes, entry_key: str, manifest: bytes, executable: Collection[str],
                   private: Collection[str]) -> bytes:
    """The bytes of the signature file of one entry."""
    return json.dumps(sign(key, entry_key, manifest, executable, private), sort_keys=True).encode()


def check_local(key: bytes, entry: Entry, signature: Path, subject: str,
                private: Collection[str] | None = None) -> None:
    """Raise UntrustedEntry unless the file ``signature`` (missing: unsigned) signs the local ``entry``.

    Its executable files are read from their modes, and so are its ``private`` ones unless given (a bundle
    imported into a shared root: its modes were widened after the tar's were checked).
    """
    doc = None
    with contextlib.suppress(OSError, ValueError):
        doc = loads(read_file_stat(signature, MAX_SIGNATURE_BYTES)[0])
    try:
        manifest, _st = read_file_stat(entry.path / MANIFEST, MAX_MANIFEST_BYTES)
    except OSError as exc:
        raise UntrustedEntry(f"{subject}: cannot read its {MANIFEST}: {exc.strerror or exc}") from None
    modes = {rec.path: os.lstat(entry.path / rec.path).st_mode for rec in entry.records}
    executable = [rel for rel, mode in modes.items() if mode & 0o111]
    if private is None:
        private = [rel for rel, mode in modes.items() if is_private(mode)]
    check(key, entry.key, manifest, executable, private, doc, "", subject=subject)
    if not unchanged(entry):
        raise UntrustedEntry(f"{subject}: its files changed while its signature was checked")


def _mac(key: bytes, entry_key: str, manifest: bytes, executable: Collection[str], private: Collection[str]) -> str:
    """HMAC-SHA256 under ``key`` of the entry's key, its executable and private files and its manifest bytes."""
    # JSON lists: a file name may hold a newline, which joined names would let two lists read alike.
    lists = json.dumps([sorted(set(executable)), sorted(set(private))]).encode()
    message = b"\0".join([_DOMAIN_V2, entry_key.encode(), lists, manifest])
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def _mac_v1(key: bytes, entry_key: str, manifest: bytes, executable: Collection[str]) -> str:
    """The MAC of a signature made before private files were signed (no ``version``)."""
    message = b"\0".join([_DOMAIN, entry_key.encode(), "\n".join(sorted(executable)).encode(), manifest])
    return hmac.new(key, message, hashlib.sha256).hexdigest()
