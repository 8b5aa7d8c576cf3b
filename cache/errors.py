"""The one error root of jitwarm (:class:`JitwarmError`: exit code and hint by type) and the cache's errors.

The exit codes, one class each; an error elsewhere takes its code by deriving from one:

====  ======================  ==================================================================================
code  class                   meaning
====  ======================  ==================================================================================
0                             done (ready)
1     :class:`JitwarmError`   a build, load or restore failed
2     :class:`UsageError`     bad flags, config, settings or manifest; a path another user could change
3     :class:`TimedOut`       waited past the deadline for another process's build
4     :class:`Refused`        what this node was handed is refused: corrupt, unsigned, keyed on another node
5     :class:`NotReady`       specs of the plan are missing (offline, strict)
130                           interrupted (Ctrl-C)
====  ======================  ==================================================================================
"""

from __future__ import annotations

import copyreg
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from jitwarm.cache.locks import LockHolder

#: The exit codes of every ``jitwarm`` command (docs/deployment.md, "Exit codes").
EXIT_OK, EXIT_BUILD_FAILED, EXIT_USAGE, EXIT_TIMEOUT, EXIT_CORRUPT, EXIT_NOT_READY = 0, 1, 2, 3, 4, 5
EXIT_INTERRUPTED = 130


class JitwarmError(Exception):
    """Base of every error jitwarm raises on purpose; ``str(exc)`` is ``"<reason>; <hint>"``; every subclass pickles."""

    exit_code: ClassVar[int] = EXIT_BUILD_FAILED

    def __init__(self, reason: str, hint: str | None = None) -> None:
        self.reason = reason
        self.hint = hint
        super().__init__(f"{reason}; {hint}" if hint else reason)

    def __reduce__(self) -> tuple[object, ...]:
        # Not __init__ (subclasses take other arguments): a bare instance, then its message and attributes.
        return (copyreg.__newobj__, (type(self),), {**self.__dict__, "args": self.args})


class UsageError(JitwarmError):
    """Bad usage, configuration or input: exit 2 with one line."""

    exit_code = EXIT_USAGE


class TimedOut(JitwarmError):
    """A wait passed its deadline: exit 3."""

    exit_code = EXIT_TIMEOUT


class Refused(JitwarmError):
    """What this node was handed is refused: a corrupt bundle, an unsigned entry, a unit of another toolchain (4)."""

    exit_code = EXIT_CORRUPT


class NotReady(JitwarmError):
    """Specs of the plan are missing where they must already be (``--offline``, the strict hook): exit 5."""

    exit_code = EXIT_NOT_READY


class CacheError(JitwarmError):
    """Base of the cache's errors: one line, the path and the reason; a hint never names a flag (the CLI's own)."""


class CacheWriteError(CacheError):
    """The cache could not write ``path`` for ``os_reason`` (``"No space left on device"``); nothing half-written."""

    def __init__(self, action: str, path: str, os_reason: str, hint: str | None = None) -> None:
        self.action = action
        self.path = path
        self.os_reason = os_reason
        super().__init__(f"cannot {action} {path}: {os_reason}", hint)

    @classmethod
    def of(cls, action: str, exc: OSError, path: object = None, hint: str | None = None) -> CacheWriteError:
        """Describe ``exc`` (an OSError from a write) as ``cannot <action> <path>: <strerror>``."""
        where = path if path is not None else (exc.filename if exc.filename is not None else "?")
        return cls(action, str(where), exc.strerror or type(exc).__name__, hint)


class UntrustedPath(CacheError, UsageError):
    """A root, layer, entry or link another user could change (refused unless ``allow_shared``): exit 2."""


class RootNotWritable(CacheWriteError, UsageError):
    """The cache root (or one of its top directories) cannot be created or written: a setting to fix (exit 2)."""


class LockTimeout(CacheError, TimedOut):
    """Waiting for another process's build of ``key`` passed ``timeout_s``; ``holder`` is who held it, if known."""

    def __init__(self, key: str, holder: LockHolder | None, timeout_s: float) -> None:
        self.key = key
        self.holder = holder
        self.timeout_s = timeout_s
        who = holder.describe() if holder is not None else "no holder recorded"
        super().__init__(f"timed out after {timeout_s:.1f} s waiting for cache key {key}: {who}")


class BuildError(CacheError):
    """The build of ``key`` raised (its ``__cause__``) or made no usable artifact; nothing was published."""

    def __init__(self, key: str, reason: str) -> None:
        self.key = key
        super().__init__(f"build of cache key {key} failed: {reason}")
        self.reason = reason


class RemoteUnavailable(CacheError):
    """The remote tier at ``url`` (no password) failed for ``reason`` and it is required (else: logged once)."""

    def __init__(self, url: str, reason: str) -> None:
        self.url = url
        self.reason = reason
        self.hint = "JITWARM_REMOTE_REQUIRED=1 or KernelCache(remote_required=True)"
        # Not CacheError's "<reason>; <hint>": this message predates it and callers match it.
        Exception.__init__(self, f"remote cache {url} is unavailable ({reason}) and it is required ({self.hint})")


class CorruptEntry(CacheError):
    """An entry failed verification (internal: lookups turn it into a miss, and quarantine it when they can)."""
