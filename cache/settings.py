"""The cache's ``JITWARM_*`` environment knobs, each parsed by its own accessor when it is used.

Nothing here runs at import, and no accessor reads more than its own variable: a bad
``JITWARM_REMOTE_LEASE_S`` fails a cache that has a remote tier, never one without. The knobs of the layers
above (``JITWARM_JOBS``, ``JITWARM_STRICT``) are theirs (:mod:`jitwarm.precompile.settings`).
:func:`override` scopes changes for tests (and for child processes, which inherit them).

Examples
--------
>>> from jitwarm.cache import settings
>>> with settings.override(remote_lease_s=2.5, remote_prefix="fleet-a"):
...     (settings.remote_lease_s(), settings.remote_prefix())
(2.5, 'fleet-a')

"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

#: Accessor (and :func:`override` field) name -> the environment variable it reads.
ENV_VARS: Mapping[str, str] = {
    "cache_dir": "JITWARM_CACHE_DIR",
    "cache_path": "JITWARM_CACHE_PATH",
    "lock_dir": "JITWARM_LOCK_DIR",
    "allow_shared": "JITWARM_ALLOW_SHARED",
    "remote": "JITWARM_REMOTE",
    "remote_prefix": "JITWARM_REMOTE_PREFIX",
    "remote_required": "JITWARM_REMOTE_REQUIRED",
    "remote_lease_s": "JITWARM_REMOTE_LEASE_S",
    "remote_max_bytes": "JITWARM_REMOTE_MAX_BYTES",
    "bundle_max_file_bytes": "JITWARM_BUNDLE_MAX_FILE_BYTES",
    "bundle_max_bytes": "JITWARM_BUNDLE_MAX_BYTES",
}

#: URL schemes the remote tier accepts (redis-py's own URL forms).
REMOTE_SCHEMES = ("redis://", "rediss://", "unix://")
#: Key namespace on the remote when none is set.
DEFAULT_REMOTE_PREFIX = "jitwarm"
_PREFIX_RE = re.compile(r"[A-Za-z0-9._:{}-]{1,64}")

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})


def cache_dir() -> Path:
    """``JITWARM_CACHE_DIR``: the writable root; else ``$XDG_CACHE_HOME/jitwarm``, else ``~/.cache/jitwarm``."""
    for var, tail in (("JITWARM_CACHE_DIR", ()), ("XDG_CACHE_HOME", ("jitwarm",))):
        text = os.environ.get(var, "").strip()
        if text:
            return absolute_path(text).joinpath(*tail)
    return Path("~").expanduser() / ".cache" / "jitwarm"


def cache_path() -> tuple[Path, ...]:
    """``JITWARM_CACHE_PATH``: read-only layers searched after the root, colon-separated; default none."""
    return tuple(absolute_path(p.strip()) for p in os.environ.get("JITWARM_CACHE_PATH", "").split(":") if p.strip())


def lock_dir() -> Path | None:
    """``JITWARM_LOCK_DIR``: where per-key lock files live; None means ``<root>/v1/locks``.

    Put it on node-local storage such as ``/dev/shm`` when the root is on NFS.
    """
    text = os.environ.get("JITWARM_LOCK_DIR", "").strip()
    return absolute_path(text) if text else None


def allow_shared() -> bool:
    """``JITWARM_ALLOW_SHARED``: accept roots and entries other users can write.

    Raises
    ------
    ValueError
        Not a boolean; the one-line message names the variable.

    """
    return _bool("JITWARM_ALLOW_SHARED")


def remote() -> str | None:
    """``JITWARM_REMOTE``: the fleet's shared Redis (``redis://[:password@]host:port/db``); None means none.

    Raises
    ------
    ValueError
        Not a Redis URL (the message names the variable, never the URL: it may hold a password).

    """
    text = os.environ.get("JITWARM_REMOTE", "").strip()
    return check_remote_url(text, "JITWARM_REMOTE") if text else None


def remote_prefix() -> str:
    """``JITWARM_REMOTE_PREFIX``: this fleet's key namespace on the remote (default ``jitwarm``); ValueError if bad."""
    text = os.environ.get("JITWARM_REMOTE_PREFIX", "").strip()
    return check_remote_prefix(text, "JITWARM_REMOTE_PREFIX") if text else DEFAULT_REMOTE_PREFIX


def remote_required() -> bool:
    """``JITWARM_REMOTE_REQUIRED``: fail instead of continuing locally when the remote is down; ValueError if bad."""
    return _bool("JITWARM_REMOTE_REQUIRED")


def remote_lease_s() -> float:
    """``JITWARM_REMOTE_LEASE_S``: lifetime of a fleet build lease that is not renewed (default 30, at least 0.5).

    Raises
    ------
    ValueError
        Not a number of at least 0.5; the one-line message names the variable.

    """
    return _number("JITWARM_REMOTE_LEASE_S", float, 30.0, minimum=0.5)


def remote_max_bytes() -> int:
    """``JITWARM_REMOTE_MAX_BYTES``: larger entries are neither uploaded nor downloaded (default 256 MiB).

    Raises ValueError if it is not a non-negative integer.
    """
    return _number("JITWARM_REMOTE_MAX_BYTES", int, 256 << 20, minimum=0)


def bundle_max_file_bytes() -> int:
    """``JITWARM_BUNDLE_MAX_FILE_BYTES``: a bundle member larger than this is refused (default 2 GiB).

    Raises ValueError if it is not a non-negative integer.
    """
    return _number("JITWARM_BUNDLE_MAX_FILE_BYTES", int, 2 << 30, minimum=0)


def bundle_max_bytes() -> int:
    """``JITWARM_BUNDLE_MAX_BYTES``: a bundle whose files total more than this is refused (default 32 GiB).

    Raises ValueError if it is not a non-negative integer.
    """
    return _number("JITWARM_BUNDLE_MAX_BYTES", int, 32 << 30, minimum=0)


def check_remote_url(url: str, what: str = "remote") -> str:
    """Return ``url`` if it is a Redis URL redis-py understands, else raise ValueError naming ``what``.

    The message never repeats the URL itself: it may hold a password.
    """
    if not isinstance(url, str) or not url.startswith(REMOTE_SCHEMES) or len(url) <= len("unix://"):
        scheme = url.split("://", 1)[0] + "://" if isinstance(url, str) and "://" in url else "no scheme"
        raise ValueError(f"{what}: expected a Redis URL ({', '.join(REMOTE_SCHEMES)}...), got {scheme}")
    return url


def check_remote_prefix(prefix: str, what: str = "remote prefix") -> str:
    """Return ``prefix`` if it is a safe key namespace (1-64 of ``[A-Za-z0-9._:{}-]``), else ValueError."""
    if not isinstance(prefix, str) or _PREFIX_RE.fullmatch(prefix) is None:
        raise ValueError(f"{what}={prefix!r}: use 1-64 characters from [A-Za-z0-9._:{{}}-]")
    return prefix


def absolute_path(path: str | os.PathLike[str]) -> Path:
    """Expand ``~`` and make ``path`` absolute and normalized, without touching the filesystem."""
    return Path(os.path.normpath(Path(path).expanduser().absolute()))


@contextmanager
def override(**values: object) -> Iterator[None]:
    """Set some knobs for the duration of a ``with`` block, then restore the environment.

    Values are written to ``os.environ`` (so subprocesses see them too); ``None`` unsets a variable.
    Nothing is parsed here: the accessors parse when they are called. Not thread-safe: it changes the
    process environment.

    Parameters
    ----------
    **values
        Names of :data:`ENV_VARS` and their values (paths, a sequence of paths for ``cache_path``, bools,
        numbers, strings).

    Raises
    ------
    TypeError
        An unknown name, or a value that cannot be put into an environment variable (nothing is changed).

    """
    unknown = sorted(set(values) - set(ENV_VARS))
    if unknown:
        raise TypeError(f"unknown cache setting(s) {unknown}; known: {sorted(ENV_VARS)}")
    rendered = {ENV_VARS[name]: None if value is None else _format(value) for name, value in values.items()}
    saved = {var: os.environ.get(var) for var in rendered}
    try:
        for var, text in rendered.items():
            if text is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = text
        yield
    finally:
        for var, old in saved.items():
            if old is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = old


def _bool(var: str) -> bool:
    """Parse a boolean variable (1/0, true/false, yes/no, on/off; unset is False)."""
    raw = os.environ.get(var, "")
    text = raw.strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError(f"{var}={raw!r} is not a boolean (use 1 or 0)")


def _number(var: str, kind: type, default: float, *, minimum: float) -> Any:
    """Parse an int or float variable with a lower bound; unset or blank gives ``default``."""
    text = os.environ.get(var, "").strip()
    if not text:
        return default
    try:
        value = kind(text)
    except ValueError:
        raise ValueError(f"{var}={text!r} is not {'an integer' if kind is int else 'a number'}") from None
    if not value >= minimum:  # also rejects nan
        raise ValueError(f"{var}={text!r} must be at least {minimum}")
    return value


def _format(value: object) -> str:
    """Render an override value the way the accessor reads it back."""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, (str, int, float, os.PathLike)):
        return os.fspath(value) if isinstance(value, os.PathLike) else str(value)
    if isinstance(value, (list, tuple)):
        return ":".join(_format(v) for v in value)
    raise TypeError(f"cannot put {type(value).__name__} into an environment variable")
