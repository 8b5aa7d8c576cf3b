"""Every ``JITWARM_*`` environment variable of jitwarm, read lazily through one typed place.

Nothing here runs at import. :func:`settings` reads ``os.environ`` on every call, so a changed environment
is seen at once; :func:`override` scopes changes for tests (and for child processes, which inherit them).

Examples
--------
>>> from jitwarm.cache.settings import override, settings
>>> with override(jobs=3, strict=True):
...     (settings().jobs, settings().strict)
(3, True)

"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

#: Field of :class:`Settings` -> the environment variable it is read from.
ENV_VARS: Mapping[str, str] = {
    "cache_dir": "JITWARM_CACHE_DIR",
    "cache_path": "JITWARM_CACHE_PATH",
    "lock_dir": "JITWARM_LOCK_DIR",
    "allow_shared": "JITWARM_ALLOW_SHARED",
    "jobs": "JITWARM_JOBS",
    "strict": "JITWARM_STRICT",
    "remote": "JITWARM_REMOTE",
    "remote_prefix": "JITWARM_REMOTE_PREFIX",
    "remote_required": "JITWARM_REMOTE_REQUIRED",
    "remote_lease_s": "JITWARM_REMOTE_LEASE_S",
    "remote_max_bytes": "JITWARM_REMOTE_MAX_BYTES",
}

#: URL schemes the remote tier accepts (redis-py's own URL forms).
REMOTE_SCHEMES = ("redis://", "rediss://", "unix://")
_PREFIX_RE = re.compile(r"[A-Za-z0-9._:{}-]{1,64}")

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})


@dataclass(frozen=True)
class Settings:
    """A snapshot of jitwarm's environment knobs, already parsed and defaulted.

    Attributes
    ----------
    cache_dir : Path
        Writable cache root: ``$JITWARM_CACHE_DIR``, else ``$XDG_CACHE_HOME/jitwarm``, else
        ``~/.cache/jitwarm``.
    cache_path : tuple of Path
        Read-only layers searched after the root: ``$JITWARM_CACHE_PATH``, colon-separated.
    lock_dir : Path or None
        Where per-key lock files live (``$JITWARM_LOCK_DIR``); None means ``<cache_dir>/v1/locks``.
        Put it on node-local storage such as ``/dev/shm`` when the root is on NFS.
    allow_shared : bool
        ``$JITWARM_ALLOW_SHARED``: accept roots and entries other users can write.
    jobs : int
        ``$JITWARM_JOBS``: parallel builds for ``warm``; defaults to the number of CPUs.
    strict : bool
        ``$JITWARM_STRICT``: never compile at run time; a cache miss is an error.
    remote : str or None
        ``$JITWARM_REMOTE``: the fleet's shared Redis (``redis://[:password@]host:port/db``,
        ``rediss://`` for TLS, ``unix://``); None means no remote tier.
    remote_prefix : str
        ``$JITWARM_REMOTE_PREFIX``: namespace of this fleet's keys on that server (default ``jitwarm``).
    remote_required : bool
        ``$JITWARM_REMOTE_REQUIRED``: fail instead of continuing locally when the remote is down.
    remote_lease_s : float
        ``$JITWARM_REMOTE_LEASE_S``: lifetime of a fleet build lease that is not renewed (default 30);
        a dead builder's lease runs out after this long.
    remote_max_bytes : int
        ``$JITWARM_REMOTE_MAX_BYTES``: larger entries are not uploaded (default 256 MiB).

    """

    cache_dir: Path
    cache_path: tuple[Path, ...]
    lock_dir: Path | None
    allow_shared: bool
    jobs: int
    strict: bool
    remote: str | None = None
    remote_prefix: str = "jitwarm"
    remote_required: bool = False
    remote_lease_s: float = 30.0
    remote_max_bytes: int = 256 << 20


def settings(environ: Mapping[str, str] | None = None) -> Settings:
    """Read and parse every ``JITWARM_*`` variable now.

    Parameters
    ----------
    environ : Mapping, optional
        The environment to read; ``os.environ`` by default.

    Returns
    -------
    Settings
        The parsed values, defaults filled in.

    Raises
    ------
    ValueError
        A variable has a value that does not parse; the one-line message names the variable.

    """
    env = os.environ if environ is None else environ
    return Settings(
        cache_dir=_cache_dir(env),
        cache_path=tuple(_path(p) for p in env.get("JITWARM_CACHE_PATH", "").split(":") if p.strip()),
        lock_dir=_path(env["JITWARM_LOCK_DIR"]) if env.get("JITWARM_LOCK_DIR", "").strip() else None,
        allow_shared=_bool(env, "JITWARM_ALLOW_SHARED"),
        jobs=_jobs(env),
        strict=_bool(env, "JITWARM_STRICT"),
        remote=check_remote_url(env["JITWARM_REMOTE"].strip(), "JITWARM_REMOTE")
        if env.get("JITWARM_REMOTE", "").strip() else None,
        remote_prefix=check_remote_prefix(env.get("JITWARM_REMOTE_PREFIX", "").strip() or "jitwarm",
                                          "JITWARM_REMOTE_PREFIX"),
        remote_required=_bool(env, "JITWARM_REMOTE_REQUIRED"),
        remote_lease_s=_number(env, "JITWARM_REMOTE_LEASE_S", float, 30.0, minimum=0.5),
        remote_max_bytes=_number(env, "JITWARM_REMOTE_MAX_BYTES", int, 256 << 20, minimum=0),
    )


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


@contextmanager
def override(**values: object) -> Iterator[Settings]:
    """Set some knobs for the duration of a ``with`` block, then restore the environment.

    Values are written to ``os.environ`` (so subprocesses see them too); ``None`` unsets a variable.
    Not thread-safe: it changes the process environment.

    Parameters
    ----------
    **values
        :class:`Settings` field names and their values (paths, a sequence of paths for ``cache_path``,
        bools, ints).

    Yields
    ------
    Settings
        The settings in force inside the block.

    Raises
    ------
    TypeError
        An unknown field name.
    ValueError
        A value that the parser rejects (the environment is restored first).

    """
    known = {f.name for f in fields(Settings)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise TypeError(f"unknown setting(s) {unknown}; known: {sorted(known)}")
    saved = {ENV_VARS[name]: os.environ.get(ENV_VARS[name]) for name in values}
    try:
        for name, value in values.items():
            if value is None:
                os.environ.pop(ENV_VARS[name], None)
            else:
                os.environ[ENV_VARS[name]] = _format(value)
        yield settings()
    finally:
        for var, old in saved.items():
            if old is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = old


def _cache_dir(env: Mapping[str, str]) -> Path:
    """Resolve the writable root: JITWARM_CACHE_DIR, then XDG_CACHE_HOME, then ~/.cache."""
    if env.get("JITWARM_CACHE_DIR", "").strip():
        return _path(env["JITWARM_CACHE_DIR"])
    if env.get("XDG_CACHE_HOME", "").strip():
        return _path(env["XDG_CACHE_HOME"]) / "jitwarm"
    return Path("~").expanduser() / ".cache" / "jitwarm"


def _path(text: str) -> Path:
    """Parse a path variable: strip blanks, then as :func:`absolute_path`."""
    return absolute_path(text.strip())


def absolute_path(path: str | os.PathLike[str]) -> Path:
    """Expand ``~`` and make ``path`` absolute and normalized, without touching the filesystem."""
    return Path(os.path.normpath(Path(path).expanduser().absolute()))


def _bool(env: Mapping[str, str], var: str) -> bool:
    """Parse a boolean variable (1/0, true/false, yes/no, on/off; unset is False)."""
    text = env.get(var, "").strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError(f"{var}={env[var]!r} is not a boolean (use 1 or 0)")


def _jobs(env: Mapping[str, str]) -> int:
    """Parse JITWARM_JOBS, a positive int defaulting to the CPU count."""
    text = env.get("JITWARM_JOBS", "").strip()
    if not text:
        return os.cpu_count() or 1
    try:
        jobs = int(text)
    except ValueError:
        raise ValueError(f"JITWARM_JOBS={text!r} is not an integer") from None
    if jobs < 1:
        raise ValueError(f"JITWARM_JOBS={text!r} must be at least 1")
    return jobs


def _number(env: Mapping[str, str], var: str, kind: type, default: float, *, minimum: float) -> Any:
    """Parse an int or float variable with a lower bound; unset or blank gives ``default``."""
    text = env.get(var, "").strip()
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
    """Render an override value the way the parser reads it back."""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, (str, int, float, os.PathLike)):
        return os.fspath(value) if isinstance(value, os.PathLike) else str(value)
    if isinstance(value, (list, tuple)):
        return ":".join(_format(v) for v in value)
    raise TypeError(f"cannot put {type(value).__name__} into an environment variable")
