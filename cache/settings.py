"""Every ``JITWARM_*`` environment variable, each read by its own accessor when it is used, with one parser.

No accessor reads more than its own variable (a bad ``JITWARM_JOBS`` fails a ``warm``, never a lookup); a
value that does not parse raises :class:`SettingError` (exit 2). :func:`override` scopes changes for tests.
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

from jitwarm.cache.errors import UsageError

#: Accessor (and :func:`override` field) name -> the environment variable it reads, ``JITWARM_<NAME>``.
ENV_VARS: Mapping[str, str] = {name: f"JITWARM_{name.upper()}" for name in (
    "cache_dir", "cache_path", "lock_dir", "allow_shared", "remote", "remote_prefix", "remote_required",
    "remote_lease_s", "remote_max_bytes", "remote_min_rate", "bundle_max_file_bytes", "bundle_max_bytes",
    "prune_grace_s", "jobs", "strict", "record_caches", "trust_key", "trust_key_file", "ledger")}

REMOTE_SCHEMES = ("redis://", "rediss://", "unix://", "s3://")
_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
DEFAULT_REMOTE_PREFIX = "jitwarm"
#: More parallel builds than this is a typo, not a machine (a 20,000-process pool would take the host down).
MAX_JOBS = 1024
_PREFIX_RE = re.compile(r"[A-Za-z0-9._:{}-]{1,64}")
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
T = TypeVar("T")


class SettingError(UsageError, ValueError):
    """A setting (an environment variable, or the same value given to the API) does not parse; exit 2."""


def declare(var: str, doc: str, read: Callable[[], T]) -> Callable[[], T]:
    """Name and document ``read`` as the accessor of ``var``."""
    read.__name__ = read.__qualname__ = var.removeprefix("JITWARM_").lower()
    read.__doc__ = f"``{var}``: {doc}."
    return read


def flag_setting(var: str, doc: str, default: bool = False) -> Callable[[], bool]:
    """The accessor of a boolean (:func:`flag`); the plugins declare theirs with it too."""
    return declare(var, doc, lambda: flag(var, default))


def _number(var: str, kind: type, default: float, minimum: float, doc: str) -> Callable[[], Any]:
    """The accessor of a number (:func:`number`)."""
    return declare(var, f"{doc} (default {default}, at least {minimum})",
                   lambda: number(var, kind, default, minimum=minimum))


def path_setting(var: str, doc: str) -> Callable[[], Path | None]:
    """The accessor of a file path (absolute; None when unset or blank); the plugins declare theirs with it too."""

    def read() -> Path | None:
        text = _text(var)
        return absolute_path(text) if text else None

    return declare(var, doc, read)


# The plain settings, one accessor each (``settings.strict()``); the others are functions below.
allow_shared = flag_setting("JITWARM_ALLOW_SHARED", "accept roots, lock directories and entries other users can write")
remote_required = flag_setting("JITWARM_REMOTE_REQUIRED", "fail instead of continuing locally when the remote is down")
strict = flag_setting("JITWARM_STRICT", "the capture hook never compiles; a missing kernel is an error")

remote_lease_s = _number("JITWARM_REMOTE_LEASE_S", float, 30.0, 0.5, "lifetime of a fleet build lease not renewed")
remote_max_bytes = _number("JITWARM_REMOTE_MAX_BYTES", int, 256 << 20, 0, "larger entries are neither sent nor fetched")
remote_min_rate = _number("JITWARM_REMOTE_MIN_RATE", int, 1 << 20, 0, "bytes per second below which a download or "
                          "bundle read is a remote fault (0: no overall deadline)")
bundle_max_file_bytes = _number("JITWARM_BUNDLE_MAX_FILE_BYTES", int, 2 << 30, 0, "a larger bundle member is refused")
bundle_max_bytes = _number("JITWARM_BUNDLE_MAX_BYTES", int, 32 << 30, 0, "a bundle whose files total more is refused")
prune_grace_s = _number("JITWARM_PRUNE_GRACE_S", float, 600.0, 0.0, "prune keeps an entry used this recently (0: off)")

ledger = path_setting("JITWARM_LEDGER", "a served start writes what it compiled per family here (JSON) after its last "
                      "capture")


def cache_dir() -> Path:
    """``JITWARM_CACHE_DIR``: the writable root; else ``$XDG_CACHE_HOME/jitwarm``, else ``~/.cache/jitwarm``."""
    for var, tail in (("JITWARM_CACHE_DIR", ()), ("XDG_CACHE_HOME", ("jitwarm",))):
        text = _text(var)
        if text:
            return directory(absolute_path(text).joinpath(*tail), var)
    try:
        return absolute_path("~/.cache/jitwarm")
    except SettingError:  # no HOME and no passwd entry: a container under an arbitrary uid
        raise SettingError("no home directory for the default cache ~/.cache/jitwarm: set JITWARM_CACHE_DIR") from None


def cache_path() -> tuple[Path, ...]:
    """``JITWARM_CACHE_PATH``: read-only layers searched after the root, colon-separated (a missing one is empty)."""
    parts = (p.strip() for p in os.environ.get("JITWARM_CACHE_PATH", "").split(":"))
    return tuple(directory(absolute_path(p), "JITWARM_CACHE_PATH") for p in parts if p)


def lock_dir() -> Path | None:
    """``JITWARM_LOCK_DIR``: where per-key lock files live (``/dev/shm`` under an NFS root); None: the root's."""
    text = _text("JITWARM_LOCK_DIR")
    return directory(absolute_path(text), "JITWARM_LOCK_DIR") if text else None


def remote() -> str | None:
    """``JITWARM_REMOTE``: the fleet's shared Redis (``redis://[:password@]host:port/db``) or ``s3://`` bucket."""
    text = _text("JITWARM_REMOTE")
    return check_remote_url(text, "JITWARM_REMOTE") if text else None


def remote_prefix() -> str:
    """``JITWARM_REMOTE_PREFIX``: this fleet's key namespace on the remote (default ``jitwarm``)."""
    text = _text("JITWARM_REMOTE_PREFIX")
    return check_remote_prefix(text, "JITWARM_REMOTE_PREFIX") if text else DEFAULT_REMOTE_PREFIX


#: The largest fleet key file read (a key is a few dozen bytes; /dev/zero is not one).
MAX_KEY_BYTES = 4096


def trust_key() -> bytes | None:
    """``JITWARM_TRUST_KEY`` or ``JITWARM_TRUST_KEY_FILE``: the fleet key (at least 16 bytes), or None.

    The file is held as ssh holds a private key: regular (a link is followed), this user's or
    root's, private. Both set, or a file that is none of that, is a SettingError.
    """
    text, path = _text("JITWARM_TRUST_KEY"), _text("JITWARM_TRUST_KEY_FILE")
    if text and path:
        raise SettingError("JITWARM_TRUST_KEY and JITWARM_TRUST_KEY_FILE are both set: set one")
    key = text.encode() if text else None
    if path:
        key = _key_file(path)
    if key is not None and len(key) < 16:
        raise SettingError(f"JITWARM_TRUST_KEY{'_FILE' if path else ''}: the key is shorter than 16 bytes")
    return key


def _key_file(path: str) -> bytes:
    """The key in the file ``path``, checked as :func:`trust_key` says; SettingError."""
    from jitwarm.cache.files import read_file_stat

    try:
        data, st = read_file_stat(os.path.realpath(path), MAX_KEY_BYTES)
    except OSError as exc:  # a FIFO or a device (EINVAL), a file too large, none
        raise SettingError(f"JITWARM_TRUST_KEY_FILE: cannot read {path}: {exc.strerror or exc}") from None
    if st.st_uid not in (os.getuid(), 0):
        raise SettingError(f"JITWARM_TRUST_KEY_FILE: {path} is owned by uid {st.st_uid}: the fleet key must be "
                           "this user's or root's")
    if st.st_mode & 0o077:
        raise SettingError(f"JITWARM_TRUST_KEY_FILE: {path} is readable or writable by others (mode "
                           f"{st.st_mode & 0o777:04o}): chmod 600 it (a Kubernetes Secret: defaultMode: 0400)")
    return data.rstrip(b"\r\n")


def is_strict() -> bool:
    """``JITWARM_STRICT``, read now; a value that does not parse counts as strict (the user asked for something)."""
    try:
        return strict()
    except SettingError:
        return True


def jobs() -> int:
    """``JITWARM_JOBS``: parallel builds of a warm (1 to 1024); default the number of CPUs."""
    return number("JITWARM_JOBS", int, os.cpu_count() or 1, minimum=1, maximum=MAX_JOBS)


def jobs_set() -> bool:
    """Whether ``JITWARM_JOBS`` is set (the sglang plugin divides the cores between ranks otherwise)."""
    return _text("JITWARM_JOBS") is not None


def record_caches() -> tuple[str, ...] | None:
    """``JITWARM_RECORD_CACHES``: the JIT cache families a recording captures (comma-separated); None: all."""
    text = _text("JITWARM_RECORD_CACHES")
    if text is None or text.lower() == "all":
        return None
    return () if text.lower() in ("none", "0") else tuple(p.strip() for p in text.split(",") if p.strip())


def flag(var: str, default: bool = False) -> bool:
    """The one boolean parser: 1/0, true/false, yes/no, on/off (any case); unset or blank is ``default``."""
    raw = os.environ.get(var, "")
    text = raw.strip().lower()
    if not text:
        return default
    if text in _TRUE or text in _FALSE:
        return text in _TRUE
    raise SettingError(f"{var}={raw!r} is not a boolean (use 1/0, true/false, yes/no or on/off)")


def number(var: str, kind: type, default: Any, *, minimum: float, maximum: float | None = None) -> Any:
    """The one number parser: an ``int`` or ``float`` within bounds; unset or blank gives ``default``."""
    text = _text(var)
    if text is None:
        return default
    try:
        if not text.isascii() or (kind is int and not text.lstrip("+-").isdigit()):
            raise ValueError(text)  # int() and float() also take "٣"; int() takes "1_000"
        value = kind(text)
    except ValueError:
        raise SettingError(f"{var}={text!r} is not {'an integer' if kind is int else 'a number'}") from None
    if not value >= minimum or (maximum is not None and not value <= maximum):  # also rejects nan
        bound = f"from {minimum} to {maximum}" if maximum is not None else f"at least {minimum}"
        raise SettingError(f"{var}={text!r} must be {bound}")
    return value


def check_remote_url(url: str, what: str = "remote") -> str:
    """Return ``url`` if redis-py can connect with it, else SettingError naming ``what`` (never the URL: a password)."""
    if not isinstance(url, str) or not url.startswith(REMOTE_SCHEMES) or len(url) <= len("unix://"):
        scheme = url.split("://", 1)[0] + "://" if isinstance(url, str) and "://" in url else "no scheme"
        raise SettingError(f"{what}: expected a Redis URL ({', '.join(REMOTE_SCHEMES[:-1])}...) or "
                           f"s3://BUCKET/PREFIX, got {scheme}")
    if url.startswith("unix://"):
        return url
    parts = urlsplit(url)
    if parts.scheme == "s3":
        if _BUCKET_RE.fullmatch(parts.netloc) is None or parts.query or parts.fragment:
            raise SettingError(f"{what}: expected s3://BUCKET/PREFIX with a bucket name of 3-63 characters "
                               "from [a-z0-9.-]")
        return url
    try:
        port = parts.port  # ValueError for "notaport" and for 99999
    except ValueError:
        raise SettingError(f"{what}: the port is not a number from 1 to 65535") from None
    if not parts.hostname:
        raise SettingError(f"{what}: the URL names no host")
    if port == 0:
        raise SettingError(f"{what}: the port is not a number from 1 to 65535")
    db = parts.path.strip("/")
    if db and not (db.isascii() and db.isdigit()):
        raise SettingError(f"{what}: the database (after the last /) is not a number")
    return url


def check_remote_prefix(prefix: str, what: str = "remote prefix") -> str:
    """Return ``prefix`` if it is a safe key namespace (1-64 of ``[A-Za-z0-9._:{}-]``), else SettingError."""
    if not isinstance(prefix, str) or _PREFIX_RE.fullmatch(prefix) is None:
        raise SettingError(f"{what}={prefix!r}: use 1-64 characters from [A-Za-z0-9._:{{}}-]")
    return prefix


def directory(path: Path, what: str) -> Path:
    """Return ``path`` unless it exists and is not a directory, or no system call can use it (SettingError)."""
    try:
        path.stat()
    except OSError as exc:
        # A name too long or a link loop is a usage error here, not exit 1 "File name too long" at the first open;
        # missing stays for later.
        if exc.errno in (errno.ENAMETOOLONG, errno.ELOOP):
            raise SettingError(f"{what}: {path}: {exc.strerror}") from None
    if os.path.lexists(path) and not path.is_dir():
        raise SettingError(f"{what}: {path} is not a directory")
    return path


def absolute_path(path: str | os.PathLike[str]) -> Path:
    """Expand ``~`` and make ``path`` absolute and normalized; SettingError where ``~`` cannot be expanded."""
    text = os.fspath(path)
    expanded = os.path.expanduser(text)  # noqa: PTH111 - os.path leaves what it cannot expand, Path raises
    if expanded.startswith("~"):
        raise SettingError(f"cannot expand {text!r}: no such user or home directory (give an absolute path)")
    return Path(os.path.normpath(Path(expanded).absolute()))


@contextmanager
def override(**values: object) -> Iterator[None]:
    """Set settings by accessor name for a ``with`` block (``None`` unsets); TypeError. Not thread-safe."""
    unknown = sorted(set(values) - set(ENV_VARS))
    if unknown:
        raise TypeError(f"unknown setting(s) {unknown}; known: {sorted(ENV_VARS)}")
    with scoped_env({ENV_VARS[name]: None if value is None else _format(value) for name, value in values.items()}):
        yield


@contextmanager
def scoped_env(values: Mapping[str, str | None]) -> Iterator[None]:
    """Set (None: unset) environment variables for a ``with`` block, restoring them even when it raises."""
    saved = {var: os.environ.get(var) for var in values}
    try:
        _apply(values)
        yield
    finally:
        _apply(saved)


def _apply(values: Mapping[str, str | None]) -> None:
    """Set (None: unset) each variable of ``values``."""
    for var, text in values.items():
        if text is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = text


def _text(var: str) -> str | None:
    """The stripped value of ``var``; None when it is unset or blank."""
    text = os.environ.get(var, "").strip()
    return text or None


def _format(value: object) -> str:
    """Render an override value the way the accessor reads it back."""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, (str, int, float)):
        return str(value)
    if isinstance(value, (list, tuple)):
        return ":".join(_format(v) for v in value)
    raise TypeError(f"cannot put {type(value).__name__} into an environment variable")
