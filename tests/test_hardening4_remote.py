"""A remote entry deeper than the cache allows is a miss built locally, and its private flags are signed: each
with its must-still-work twin, against a real Redis (``JITWARM_TEST_REDIS_URL``, else a redis-server of our own)."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import pytest

from jitwarm.cache.entry import MAX_PATH_DEPTH
from jitwarm.cache.signing import UntrustedEntry

KEY = "fleet-key-0123456789abcdef"


def _build(staging: Path) -> None:
    (staging / "kernel.so").write_bytes(b"\x7fELF kernel " * 64)
    (staging / "secret.bin").write_bytes(b"private compile")
    (staging / "secret.bin").chmod(0o600)


def _deepen(client, name: str, depth: int) -> None:
    """An unsigned entry whose manifest lists one more file ``depth`` folders deep, its blob beside the others."""
    doc = json.loads(client.hget(name, "manifest"))
    rel = "/".join(["d"] * depth) + "/evil.so"
    data = b"\x7fELF planted"
    doc["files"].append({"path": rel, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    client.hset(name, mapping={"manifest": json.dumps(doc, indent=1, sort_keys=True), f"file:{rel}": data})


def test_an_entry_1200_folders_deep_is_a_miss_built_locally(remote, tmp_path, caplog):
    """It made every warm and prestart fail (``RecursionError``, exit 1); now it is rejected and built here."""
    desc = {"kind": "hardening4-deep", "n": 1}
    key = remote.cache(tmp_path / "a").get_or_build(desc, _build).key
    _deepen(remote.client(), remote.entry_name(key), 1200)
    reader = remote.cache(tmp_path / "b")
    with caplog.at_level(logging.WARNING, logger="jitwarm.cache"):
        result = reader.get_or_build_ex(desc, _build)
    assert result.outcome == "built"
    assert any(f"rejected remote entry {key}" in m for m in caplog.messages)
    assert not (tmp_path / "b" / "v1" / "staging").exists() or not any((tmp_path / "b" / "v1" / "staging").iterdir())


def test_an_entry_as_deep_as_allowed_still_downloads(remote, tmp_path):
    desc = {"kind": "hardening4-deep", "n": 2}
    key = remote.cache(tmp_path / "a").get_or_build(desc, _build).key
    _deepen(remote.client(), remote.entry_name(key), MAX_PATH_DEPTH - 1)
    result = remote.cache(tmp_path / "b").get_or_build_ex(desc, _build)
    assert result.outcome == "downloaded" and len(result.entry.files) == 3


def test_emptying_private_in_meta_does_not_verify_under_a_key(remote, tmp_path, monkeypatch):
    """The file would have been restored 0644: under the fleet key the altered entry is refused before a write."""
    monkeypatch.setenv("JITWARM_TRUST_KEY", KEY)
    desc = {"kind": "hardening4-private", "n": 1}
    key = remote.cache(tmp_path / "a").get_or_build(desc, _build).key
    client, name = remote.client(), remote.entry_name(key)
    meta = json.loads(client.hget(name, "meta"))
    assert meta["private"] == ["secret.bin"]
    client.hset(name, "meta", json.dumps({**meta, "private": []}))
    with pytest.raises(UntrustedEntry, match="does not verify"):
        remote.cache(tmp_path / "b").get_or_build_ex(desc, _build)


def test_a_signed_private_file_downloads_private(remote, tmp_path, monkeypatch):
    monkeypatch.setenv("JITWARM_TRUST_KEY", KEY)
    desc = {"kind": "hardening4-private", "n": 2}
    remote.cache(tmp_path / "a").get_or_build(desc, _build)
    result = remote.cache(tmp_path / "b").get_or_build_ex(desc, _build)
    assert result.outcome == "downloaded"
    assert result.entry.file("secret.bin").stat().st_mode & 0o777 == 0o400
    assert result.entry.file("kernel.so").stat().st_mode & 0o777 == 0o444
