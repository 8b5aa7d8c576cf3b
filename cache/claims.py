"""Readers' claims: a SHARED flock on a key's lock file, which keeps prune and quarantine off an entry being loaded.

``prune`` running while a process started loading made the load fail (20 of 20 trials): an entry a lookup
returned could be deleted before it was loaded. flock's shared and exclusive locks conflict across file
descriptors and processes, so while a claim is held the exclusive try-lock of prune and quarantine fails
(they keep the entry) and a builder, import or ``discard`` of the key waits; claims do not exclude each
other, and the kernel drops one whose holder dies.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from pathlib import Path

from jitwarm.cache.durable import make_dirs
from jitwarm.cache.locks import KeyLock, claims_held_here, key_lock_path, lock_error, lock_file_mode, wait_until

log = logging.getLogger("jitwarm.cache")


def release_claims_here(lock_path: Path) -> None:
    """Release every claim this thread holds on ``lock_path`` (its owner is about to discard the entry)."""
    for claim in list(claims_held_here().get(lock_path, ())):
        claim.release()


class SharedClaim:
    """A reader's claim on a key: a SHARED ``flock`` on the very lock file :class:`KeyLock` locks exclusively.

    flock's shared and exclusive locks conflict across file descriptors (and processes), so while a claim
    is held, prune's and quarantine's non-blocking exclusive try-lock fails (they keep the entry), and a
    builder, a ``discard`` or an import of the key waits. Claims do not exclude each other. The kernel
    drops the lock when its holder dies. A thread that holds a claim must not take the key's exclusive
    lock (it would wait for itself): :meth:`KeyLock.acquire` raises ``CacheError`` then, and ``discard``
    releases the thread's claims first.

    Parameters
    ----------
    lock_dir : Path
        The cache's lock directory.
    key : str
        The cache key.
    create : bool
        Create the lock dir and file when missing; without it (a read-only cache) a missing or unopenable
        lock file means no claim (:meth:`acquire` returns False): nothing of this cache can remove the entry.

    """

    def __init__(self, lock_dir: Path, key: str, *, create: bool) -> None:
        self.key = key
        self.lock_path = key_lock_path(lock_dir, key)
        self.lock_dir = lock_dir
        self.create = create
        #: What its holder checked while holding it (an entry's path and signature): a claim of that very
        #: entry nested inside this one needs no lock and no check of its own.
        self.verified: tuple[object, ...] | None = None
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        """Whether the shared lock is held now."""
        return self._fd is not None

    def acquire(self, timeout_s: float) -> bool:
        """Take the shared lock, waiting at most ``timeout_s`` while an exclusive holder has it.

        Returns
        -------
        bool
            True when held; False when there is no lock file to lock (best effort: a read-only volume).

        Raises
        ------
        LockTimeout
            An exclusive holder kept the lock past ``timeout_s``.
        CacheError
            The lock file cannot be locked (e.g. no flock on this filesystem).

        """
        fd = self._open()
        if fd is None:
            return False
        try:
            if not self._try(fd):
                holder = KeyLock(self.lock_dir, self.key).read_holder
                wait_until(lambda: True if self._try(fd) else None, timeout_s, key=self.key, holder=holder,
                           backoff=(0.005, 1.5, 0.1))
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        claims_held_here().setdefault(self.lock_path, []).append(self)
        return True

    def release(self) -> None:
        """Drop the shared lock (idempotent)."""
        fd, self._fd = self._fd, None
        self.verified = None
        if fd is None:
            return
        claims = claims_held_here().get(self.lock_path, [])
        if self in claims:
            claims.remove(self)
        if not claims:
            claims_held_here().pop(self.lock_path, None)
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)

    def _open(self) -> int | None:
        """Open the lock file without blocking or following a link; None when it cannot be had read-only."""
        flags = os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
        if self.create:
            try:
                try:  # the builder left the lock file: no mkdir and no mode to work out (the hook's hot path)
                    return os.open(self.lock_path, flags | os.O_RDWR)
                except FileNotFoundError:
                    make_dirs(self.lock_dir)
                    return os.open(self.lock_path, flags | os.O_RDWR | os.O_CREAT, lock_file_mode(self.lock_dir))
            except OSError as exc:
                log.debug("claim of %s: cannot create %s (%s); reading it unlocked", self.key, self.lock_path, exc)
        try:
            return os.open(self.lock_path, flags | os.O_RDONLY)  # a shared flock needs no write access
        except OSError:
            return None

    def _try(self, fd: int) -> bool:
        """One non-blocking attempt at the shared lock."""
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        except OSError as exc:
            raise lock_error(self.lock_path, exc) from exc
        return True
