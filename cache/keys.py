"""Cache keys: the sha256 of the canonical JSON of ``{"format": 1, "description": ...}``, made by one path."""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping
from typing import Any

from jitwarm.cache.files import MAX_JSON_DEPTH

#: Version of the on-disk format and of the key preimage; bump it to orphan every old entry.
FORMAT_VERSION = 1

_KEY_RE = re.compile(r"[0-9a-f]{64}")
#: A description nests at most this deep: its manifest (two levels more) stays within what the cache parses.
MAX_DESCRIPTION_DEPTH = MAX_JSON_DEPTH - 8


def key_of(description: Mapping[str, Any]) -> str:
    """Return the 64-hex-digit sha256 key of ``description`` (plain JSON; tuples hash as lists).

    Raises TypeError for a value that is not plain JSON, naming its path (``description['flags'][2]``).
    """
    return _digest(_preimage_text(description))


def key_preimage(description: Mapping[str, Any]) -> dict[str, Any]:
    """Return the exact object whose canonical JSON is hashed into the key; TypeError."""
    return json.loads(_preimage_text(description))


def keyed(description: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """Return ``(key_of(description), key_preimage(description))`` with one serialization."""
    text = _preimage_text(description)
    return _digest(text), json.loads(text)


def stored_preimage_key(preimage: object) -> str | None:
    """Return the key of a preimage read back from ``entry.json``; None unless exactly ``{format, description}``."""
    if not isinstance(preimage, dict) or set(preimage) != {"format", "description"}:
        return None
    if type(preimage["format"]) is not int or preimage["format"] != FORMAT_VERSION:  # not True, not 1.0
        return None
    try:
        return key_of(preimage["description"])
    except TypeError:
        return None


def is_key(text: object) -> bool:
    """Return True when ``text`` has the shape of a key (64 lowercase hex digits)."""
    return isinstance(text, str) and _KEY_RE.fullmatch(text) is not None


def check_key(key: object) -> str:
    """Return ``key`` unchanged, or raise ValueError when it is not a key (it becomes a path)."""
    if not is_key(key):
        raise ValueError(f"not a cache key (want 64 lowercase hex digits): {key!r}")
    return key  # type: ignore[return-value]


def _preimage_text(description: Mapping[str, Any]) -> str:
    """Check ``description`` and return the canonical JSON of its preimage."""
    if not isinstance(description, Mapping):
        raise TypeError(f"a cache description must be a dict, not {type(description).__name__}")
    _check_json(description)
    return json.dumps({"format": FORMAT_VERSION, "description": dict(description)}, sort_keys=True,
                      separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def _digest(text: str) -> str:
    """The key of a canonical preimage text."""
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def _check_json(value: Any, path: tuple[Any, ...] = ()) -> None:
    """Reject anything json.dumps would coerce or mangle, naming where it sits."""
    if value is None or isinstance(value, (str, bool, int)):
        return
    if len(path) >= MAX_DESCRIPTION_DEPTH:
        raise TypeError(f"{_where(path[:3])}... nests deeper than {MAX_DESCRIPTION_DEPTH} levels")
    if isinstance(value, Mapping):
        for k, v in value.items():
            # json.dumps turns 1 into "1", so {1: x} and {"1": x} would share a key.
            if not isinstance(k, str):
                raise TypeError(f"{_where(path)} has a non-str dict key {k!r}")
            _check_json(v, (*path, k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_json(v, (*path, i))
    elif not isinstance(value, float):
        raise TypeError(f"{_where(path)} is a {type(value).__name__}, which is not JSON-able")
    elif not math.isfinite(value):
        raise TypeError(f"{_where(path)} is {value!r}: NaN and infinities are not JSON")


def _where(path: tuple[Any, ...]) -> str:
    """Render where a value sits in the description, e.g. ``description['flags'][2]``."""
    return "description" + "".join(f"[{p!r}]" for p in path)
