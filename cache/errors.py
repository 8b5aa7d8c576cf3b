"""Exceptions raised by the kernel cache."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jitwarm.cache.locks import LockHolder


class CacheError(Exception):
    """Base class of every error the cache raises on purpose.

    Raised for misuse of a read-only cache, an untrusted root or entry, an invalid bundle, a lock
    directory without working ``flock``, and (as subclasses) lock timeouts, failed builds and a required
    remote that is down. Messages name environment variables and the Python API only; a command line adds
    its own hints.
    """


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

    """

    def __init__(self, key: str, reason: str) -> None:
        self.key = key
        self.reason = reason
        super().__init__(f"build of cache key {key} failed: {reason}")

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
        super().__init__(f"remote cache {url} is unavailable ({reason}) and it is required "
                         "(JITWARM_REMOTE_REQUIRED=1 or KernelCache(remote_required=True))")

    def __reduce__(self) -> tuple[type[RemoteUnavailable], tuple[str, str]]:
        return (type(self), (self.url, self.reason))


class CorruptEntry(CacheError):
    """An entry failed verification (internal: lookups turn it into a miss, and quarantine it when they can)."""
