"""The environment knobs of the warm service, the hook and the sglang plugin, each read when it is used.

The cache's own knobs (root, layers, locks, remote tier) are ``jitwarm.cache``'s. These are the upper layer's:
a bad ``JITWARM_JOBS`` fails a ``warm``, never a run-time kernel lookup that does not read it. Nothing here
runs at import.
"""

from __future__ import annotations

import os
from pathlib import Path

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})
#: More parallel builds than this is a typo, not a machine (a 20,000-process pool would take the host down).
MAX_JOBS = 1024


class SettingError(ValueError):
    """An environment variable has a value that does not parse; the message names it."""


def jobs() -> int:
    """``JITWARM_JOBS``: parallel builds of a warm (1 to 1024); default the number of CPUs."""
    text = os.environ.get("JITWARM_JOBS", "").strip()
    if not text:
        return os.cpu_count() or 1
    if not text.isascii() or not text.isdigit() or not 1 <= int(text) <= MAX_JOBS:
        raise SettingError(f"JITWARM_JOBS={text!r} must be an integer from 1 to {MAX_JOBS}")
    return int(text)


def strict() -> bool:
    """``JITWARM_STRICT``: the capture hook never compiles; a missing kernel is an error."""
    return _bool("JITWARM_STRICT")


def plugin_enabled() -> bool:
    """``JITWARM_SGLANG_PLUGIN``: 0 makes the sglang plugin inert (default on)."""
    return _bool("JITWARM_SGLANG_PLUGIN", default=True)


def plugin_config() -> Path | None:
    """``JITWARM_CONFIG``: the TOML file of model dims and targets that puts the sglang plugin in plan mode."""
    text = os.environ.get("JITWARM_CONFIG", "").strip()
    return Path(text) if text else None


def _bool(var: str, default: bool = False) -> bool:
    """Parse a boolean variable (1/0, true/false, yes/no, on/off; unset is ``default``)."""
    raw = os.environ.get(var)
    if raw is None or not raw.strip():
        return default
    text = raw.strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise SettingError(f"{var}={raw!r} is not a boolean (use 1 or 0)")
