"""Cache keys: the sha256 of the canonical JSON of a format version and a JSON-able description."""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping
from typing import Any

#: Version of the on-disk format and of the key preimage; bump it to orphan every old entry.
FORMAT_VERSION = 1

_KEY_RE = re.compile(r"[0-9a-f]{64}")


def canonical_json(value: Any) -> str:
    """Serialize ``value`` the one way keys are computed: sorted keys, no spaces, ASCII, no NaN.

    Raises
    ------
    TypeError
        ``value`` is not plain JSON (see :func:`key_preimage`).

    """
    _check_json(value)
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def key_preimage(description: Mapping[str, Any]) -> dict[str, Any]:
    """Return the exact object whose canonical JSON is hashed into the key.

    Parameters
    ----------
    description : Mapping
        What the artifact is: dicts with str keys, lists or tuples, str, int, finite float, bool, None.

    Returns
    -------
    dict
        ``{"format": FORMAT_VERSION, "description": <description as plain JSON>}``; tuples become
        lists, exactly as they are stored in ``entry.json``.

    Raises
    ------
    TypeError
        ``description`` is not a mapping, or holds a value that is not plain JSON (the message gives
        its path, e.g. ``description['flags'][2]``).

    """
    if not isinstance(description, Mapping):
        raise TypeError(f"a cache description must be a dict, not {type(description).__name__}")
    text = canonical_json(dict(description))
    return {"format": FORMAT_VERSION, "description": json.loads(text)}


def key_of(description: Mapping[str, Any]) -> str:
    """Return the 64-hex-digit sha256 key of ``description`` (see :func:`key_preimage`).

    Equal to ``hash_preimage(key_preimage(description))`` (tuples and lists serialize alike), with one
    check and one serialization instead of two.
    """
    if not isinstance(description, Mapping):
        raise TypeError(f"a cache description must be a dict, not {type(description).__name__}")
    _check_json(description)
    text = json.dumps({"format": FORMAT_VERSION, "description": description}, sort_keys=True,
                      separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def hash_preimage(preimage: Mapping[str, Any]) -> str:
    """Return the key of an already-built preimage (as read back from ``entry.json``)."""
    return hashlib.sha256(canonical_json(preimage).encode("ascii")).hexdigest()


def is_key(text: object) -> bool:
    """Return True when ``text`` has the shape of a key (64 lowercase hex digits)."""
    return isinstance(text, str) and _KEY_RE.fullmatch(text) is not None


def check_key(key: object) -> str:
    """Return ``key`` unchanged, or raise ValueError when it is not a key (it becomes a path)."""
    if not is_key(key):
        raise ValueError(f"not a cache key (want 64 lowercase hex digits): {key!r}")
    return key  # type: ignore[return-value]


def _check_json(value: Any, path: tuple[Any, ...] = ()) -> None:
    """Reject anything json.dumps would coerce or mangle, naming where it sits (formatted only on error)."""
    if value is None or isinstance(value, (str, bool, int)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise TypeError(f"{_where(path)} is {value!r}: NaN and infinities are not JSON")
        return
    if isinstance(value, Mapping):
        for k, v in value.items():
            # json.dumps turns 1 into "1", so {1: x} and {"1": x} would share a key.
            if not isinstance(k, str):
                raise TypeError(f"{_where(path)} has a non-str dict key {k!r}")
            _check_json(v, (*path, k))
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_json(v, (*path, i))
        return
    raise TypeError(f"{_where(path)} is a {type(value).__name__}, which is not JSON-able")


def _where(path: tuple[Any, ...]) -> str:
    return "description" + "".join(f"[{p!r}]" for p in path)
