"""The one error root of jitwarm, and the exceptions the kernel cache raises.

Every error jitwarm raises on purpose is a :class:`JitwarmError`: it carries the exit code a command line ends
with and a hint for the operator, so the CLI maps errors by type alone. It lives in the lowest layer so that
``cache``, ``kernels`` and ``precompile`` can all derive from it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from jitwarm.cache.locks import LockHolder

#: The exit codes of every ``jitwarm`` command (docs/deployment.md, "Exit codes").
EXIT_OK, EXIT_BUILD_FAILED, EXIT_USAGE, EXIT_TIMEOUT, EXIT_CORRUPT, EXIT_NOT_READY = 0, 1, 2, 3, 4, 5
EXIT_INTERRUPTED = 130


class JitwarmError(Exception):
    """Base of every error jitwarm raises on purpose.

    Attributes
    ----------
    exit_code : int
        What a ``jitwarm`` command exits with when this error ends it (a class attribute; subclasses set it).
    reason : str
        The message without the hint.
    hint : str or None
        What the operator can do about it; ``str(exc)`` is ``"<reason>; <hint>"`` (or just the reason).

    """

    exit_code: ClassVar[int] = EXIT_BUILD_FAILED

    def __init__(self, reason: str, hint: str | None = None) -> None:
        self.reason = reason
        self.hint = hint
        super().__init__(f"{reason}; {hint}" if hint else reason)

    def __reduce__(self) -> tuple[type, tuple[object, ...]]:
        return (type(self), (self.reason, self.hint))


class UsageError(JitwarmError):
    """Bad usage, configuration or input: exit 2 with one line."""

    exit_code = EXIT_USAGE


class CacheError(JitwarmError):
    """Base class of every error the cache raises on purpose.

    Raised for misuse of a read-only cache, an untrusted root or entry, an invalid bundle, a lock
    directory without working ``flock``, and (as subclasses) lock timeouts, failed builds, failed writes and
    a required remote that is down. Each message is one line that names the path and the reason; it names
    environment variables and the Python API only, never a command-line flag.

    Attributes
    ----------
    reason : str
        The message without the hint, e.g. ``"refusing cache root /shared/jw: it is writable by every user
        and has no sticky bit"``. (``BuildError.reason`` and ``RemoteUnavailable.reason`` keep their own,
        older meaning: what failed.)
    hint : str or None
        What to do about it in terms of the Python API and environment variables, e.g. ``"pass
        KernelCache(allow_shared=True) or set JITWARM_ALLOW_SHARED=1 to accept it"``; a command line prints
        ``reason`` with its own hint instead. ``str(exc)`` is ``"<reason>; <hint>"`` (or just the reason).

    """


class CacheWriteError(CacheError):
    """The cache could not write where it had to (a full disk, a missing or read-only directory).

    Nothing half-written is left behind: no entry is published from a write that failed, staging
    directories and temporary files are removed. Distinct from a corrupt bundle or entry (``CacheError``).

    Attributes
    ----------
    path : str
        What could not be written (a staging file, the bundle being exported, a cache directory).
    os_reason : str
        The operating system's reason, e.g. ``"No space left on device"``.

    """

    def __init__(self, action: str, path: str, os_reason: str, hint: str | None = None) -> None:
        self.action = action
        self.path = path
        self.os_reason = os_reason
        super().__init__(f"cannot {action} {path}: {os_reason}", hint)

    def __reduce__(self) -> tuple[type, tuple[object, ...]]:
        return (type(self), (self.action, self.path, self.os_reason, self.hint))

    @classmethod
    def of(cls, action: str, exc: OSError, path: object = None, hint: str | None = None) -> CacheWriteError:
        """Describe ``exc`` (an OSError from a write) as ``cannot <action> <path>: <strerror>``."""
        where = path if path is not None else (exc.filename if exc.filename is not None else "?")
        return cls(action, str(where), exc.strerror or type(exc).__name__, hint)


class UntrustedPath(CacheError):
    """A root, layer, entry or link another user could change (refused unless ``allow_shared``): exit 2."""

    exit_code = EXIT_USAGE


class RootNotWritable(CacheWriteError):
    """The cache root (or one of its top directories) cannot be created or written."""


class LockTimeout(CacheError):
    """Waiting for another process's build of a key passed its deadline.

    Attributes
    ----------
    key : str
        The cache key whose lock (or entry) was awaited.
    holder : LockHolder or None
        Who held the lock at the deadline, when it wrote its holder record.
    timeout_s : float
        The deadline that passed, in seconds.

    """

    def __init__(self, key: str, holder: LockHolder | None, timeout_s: float) -> None:
        self.key = key
        self.holder = holder
        self.timeout_s = timeout_s
        who = holder.describe() if holder is not None else "no holder recorded"
        super().__init__(f"timed out after {timeout_s:.1f} s waiting for cache key {key}: {who}")

    def __reduce__(self) -> tuple[type[LockTimeout], tuple[str, LockHolder | None, float]]:
        return (type(self), (self.key, self.holder, self.timeout_s))


class BuildError(CacheError):
    """The build callable raised, or produced no usable artifact.

    The original exception is chained as ``__cause__``. Nothing was published for the key, its staging
    directory is gone and its lock is released, so a later call may retry.

    Attributes
    ----------
    key : str
        The cache key that failed to build.
    reason : str
        What failed, e.g. ``"RuntimeError: nvcc exploded"`` (the message is ``build of cache key K failed:
        <reason>``).

    """

    def __init__(self, key: str, reason: str) -> None:
        self.key = key
        super().__init__(f"build of cache key {key} failed: {reason}")
        self.reason = reason

    def __reduce__(self) -> tuple[type[BuildError], tuple[str, str]]:
        return (type(self), (self.key, self.reason))


class RemoteUnavailable(CacheError):
    """The remote tier failed (unreachable, or an error mid-way) and it is required.

    Raised only with ``KernelCache(remote_required=True)`` or ``JITWARM_REMOTE_REQUIRED=1``; without it
    the cache logs the failure once and continues with the local tier.

    Attributes
    ----------
    url : str
        The remote's URL, password removed.
    reason : str
        What failed, e.g. ``"ConnectionError: Error 111 connecting to 127.0.0.1:6390"``.

    """

    def __init__(self, url: str, reason: str) -> None:
        self.url = url
        self.reason = reason
        self.hint = "JITWARM_REMOTE_REQUIRED=1 or KernelCache(remote_required=True)"
        # Not CacheError's "<reason>; <hint>": this message predates it and callers match it.
        Exception.__init__(self, f"remote cache {url} is unavailable ({reason}) and it is required ({self.hint})")

    def __reduce__(self) -> tuple[type[RemoteUnavailable], tuple[str, str]]:
        return (type(self), (self.url, self.reason))


class CorruptEntry(CacheError):
    """An entry failed verification (internal: lookups turn it into a miss, and quarantine it when they can)."""
