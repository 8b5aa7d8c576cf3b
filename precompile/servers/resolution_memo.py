"""The ladder a server's own functions resolved, kept on disk so that the next plan of the same line skips them.

Importing the server costs 21 to 67 s; the answer depends only on its release and the raw inputs, so it is kept
under ``<cache root>/ladders/<key>.json``. A memo is a hint: one that cannot be written is skipped, and one that
is unreadable, damaged, not a regular file or not this user's is ignored and resolved again.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from jitwarm.cache import files, settings

#: Format of a memo file, its result's keys among it (the pool is ``max_requests``); another format is ignored.
FORMAT = 2
#: Largest memo read or written (a 4096-graph ladder without padding is about 1 MiB).
MAX_BYTES = 4 << 20


def key(server: str, version: str | None, inputs: Mapping[str, Any]) -> str:
    """The memo key of a resolution: sha256 over the server, its release and the raw inputs (canonical JSON)."""
    text = json.dumps({"format": FORMAT, "server": server, "version": version, "inputs": dict(inputs)},
                      sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def directory() -> Path:
    """Where memos live: ``<cache root>/ladders``."""
    return settings.cache_dir() / "ladders"


def load(memo_key: str) -> dict[str, Any] | None:
    """Return the resolution kept under ``memo_key``, or None when there is none usable (never raises)."""
    path = directory() / f"{memo_key}.json"
    try:
        data, st = files.read_file_stat(path, MAX_BYTES)
        if st.st_uid != os.geteuid():  # another user's file: not ours to trust
            return None
        doc = files.loads(data)
    except (OSError, ValueError, settings.SettingError):
        return None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("key") != memo_key:
        return None
    result = doc.get("result")
    return result if _is_resolution(result) else None


def store(memo_key: str, result: Mapping[str, Any]) -> None:
    """Keep ``result`` under ``memo_key``, atomically (a reader sees no memo or a whole one); failures are skipped."""
    text = json.dumps({"format": FORMAT, "key": memo_key, "result": dict(result)}, sort_keys=True)
    if len(text) > MAX_BYTES or not _is_resolution(result):
        return
    try:
        folder = directory()
        files.make_dirs(folder, mode=0o700)
        files.write_atomic(folder / f"{memo_key}.json", text.encode(), durable=False, mode=0o600)
    except (OSError, settings.SettingError):
        pass  # a read-only or full cache root: the next plan resolves again


def _is_resolution(result: Any) -> bool:
    """True for a resolution as :func:`jitwarm.precompile.servers.sglang.rules.resolve` returns it."""
    if not isinstance(result, dict) or not isinstance(result.get("source"), str):
        return False
    shapes = result.get("shapes")
    if not isinstance(shapes, list):
        return False
    for shape in shapes:
        if not isinstance(shape, dict) or not all(_is_count(shape.get(k)) for k in ("bs", "graph_key")):
            return False
        lens = shape.get("verify_lens")
        if not isinstance(lens, list) or not lens or not all(_is_count(n) for n in lens):
            return False
    bs = result.get("capture_bs", [])
    return isinstance(bs, list) and all(_is_count(b) for b in bs) and _is_count(result.get("width", 1))


def _is_count(value: Any) -> bool:
    """A positive int (not a bool)."""
    return type(value) is int and value >= 1
