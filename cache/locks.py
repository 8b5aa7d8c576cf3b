"""Per-key build locks (flock via filelock) with a holder record, and the one wait loop of the cache.

Every wait of the cache has a deadline and says, once, who it is waiting for: :meth:`KeyLock.acquire`
blocks in filelock's own acquire (``cancel_check`` ends it early), and :func:`wait_until` polls with a
backoff (``wait_for``, a claim, a fleet lease). Both log through :class:`WaitLog` and raise ``LockTimeout``.
Nothing else is waited on: the holder record is read without blocking (see :mod:`jitwarm.cache.bounded`).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import math
import os
import re
import socket
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypeVar

from filelock import FileLock, Timeout

from jitwarm.cache.bounded import read_json
from jitwarm.cache.durable import make_dirs, write_atomic
from jitwarm.cache.errors import CacheError, CacheWriteError, LockTimeout

log = logging.getLogger("jitwarm.cache")

T = TypeVar("T")

#: A waiter that has waited this long logs, once, who holds what it waits for.
WAIT_LOG_AFTER_S = 3.0
#: While blocked on a key's lock, look this often whether the holder has published (then stop waiting).
LOOK_EVERY_S = 0.05
_POLL_S = 0.02
#: A holder record is a few dozen bytes; anything larger was not written by a holder.
_MAX_HOLDER_BYTES = 4096
_NO_FLOCK = (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP)
_NO_FLOCK_HINT = "set JITWARM_LOCK_DIR to node-local storage such as /dev/shm/jitwarm-locks"


def this_host() -> str:
    """Return this host's name, reduced to characters that are safe in a file name."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname()) or "localhost"


def pid_alive(pid: int) -> bool:
    """Return True if ``pid`` is a live process on this host (a zombie counts as dead)."""
    if pid == os.getpid():
        return True
    if pid <= 0:
        return False
    try:
        # A SIGKILLed child stays a zombie until its parent reaps it, but it holds no locks any more.
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except FileNotFoundError:
        return False
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(frozen=True)
class LockHolder:
    """Who holds a key's build lock (or fleet lease): written by the holder right after it takes it.

    Attributes
    ----------
    host : str
        Host name of the holder.
    pid : int
        Its process id (on ``host``).
    since : float
        When it took the lock (``time.time()``).

    """

    host: str
    pid: int
    since: float

    @classmethod
    def from_record(cls, data: object) -> LockHolder:
        """Read a holder record or lease token another process wrote (maybe planted): its host made safe to print.

        Raises KeyError, TypeError, ValueError or OverflowError for a record that is not one.
        """
        if not isinstance(data, dict):
            raise TypeError("a holder record is a JSON object")
        host = re.sub(r"[^A-Za-z0-9._-]", "_", str(data["host"]))[:255]  # it ends up in one-line messages
        return cls(host=host, pid=int(data["pid"]), since=float(data["since"]))

    def describe(self) -> str:
        """Return e.g. ``"held by pid 4242 on node-3 since 12:00:01 (7.5 s ago)"``."""
        when = time.strftime("%H:%M:%S", time.localtime(self.since))
        return f"held by pid {self.pid} on {self.host} since {when} ({time.time() - self.since:.1f} s ago)"

    def to_json(self) -> dict[str, object]:
        """Return the record as a JSON-able dict."""
        return asdict(self)


#: ``on_wait(holder)``: called once when a call has to wait for another process (holder None if unknown).
OnWait = Callable[[LockHolder | None], None]


class WaitLog:
    """The clock of one wait: after :data:`WAIT_LOG_AFTER_S`, log once who holds what we wait for."""

    def __init__(self, key: str, holder: Callable[[], LockHolder | None], where: str = "") -> None:
        self.key, self.holder, self.where = key, holder, where
        self.start = time.monotonic()
        self._logged = False

    def elapsed(self) -> float:
        """Seconds since the wait began."""
        return time.monotonic() - self.start

    def tick(self) -> None:
        """Log ``still waiting for cache key K (where): held by ...`` the first time it is due."""
        if not self._logged and self.elapsed() >= WAIT_LOG_AFTER_S:
            self._logged = True
            holder = self.holder()
            log.info("still waiting for cache key %s%s: %s", self.key, self.where,
                     holder.describe() if holder else "no holder recorded")


def wait_until(poll: Callable[[], T | None], timeout_s: float, *, key: str,
               holder: Callable[[], LockHolder | None], where: str = "",
               backoff: tuple[float, float, float] = (0.02, 1.5, 0.5)) -> T:
    """Call ``poll`` with a backoff until it returns something other than None, and return that.

    Parameters
    ----------
    poll : callable
        Looks once; None means not yet. Its exceptions propagate.
    timeout_s : float
        Deadline; ``poll`` runs a last time at the deadline.
    key, holder, where
        For the single "still waiting" log line and for ``LockTimeout``: the key, a callable reading who
        holds it, and where it is held (e.g. ``" (fleet lease on redis://...)"``).
    backoff : (first, factor, cap)
        Sleep ``first`` seconds before the first poll, then ``factor`` times longer each time, at most ``cap``.

    Raises
    ------
    LockTimeout
        Nothing turned up within ``timeout_s``; names the key and the holder at that moment.

    """
    clock = WaitLog(key, holder, where)
    delay, factor, cap = backoff
    while True:
        elapsed = clock.elapsed()
        clock.tick()
        if elapsed >= timeout_s:
            raise LockTimeout(key, holder(), timeout_s)
        time.sleep(min(delay, timeout_s - elapsed))
        delay = min(delay * factor, cap)
        found = poll()
        if found is not None:
            return found


class KeyLock:
    """The build lock of one cache key: ``<lock_dir>/<key>.lock`` plus ``<key>.holder``.

    A fresh ``FileLock`` (and so a fresh file descriptor) is used for each instance, so two threads of
    one process exclude each other just as two processes do. The kernel drops a flock when its holder
    dies, even by SIGKILL, so there is no stale-lock breaking.

    Lock files are never deleted: unlinking a lock file while others wait on it splits them across
    inodes and two builders could run at once (filelock's "keep Unix lock files after release").

    The holder record is a separate file because the lock file belongs to the lock implementation;
    it is replaced atomically, so a waiter never reads half a record.
    """

    def __init__(self, lock_dir: Path, key: str) -> None:
        self.key = key
        self.lock_dir = lock_dir
        self.lock_path = key_lock_path(lock_dir, key)
        self.holder_path = lock_dir / f"{key}.holder"
        self._lock: FileLock | None = None  # made on first acquire: its mode depends on the lock dir

    @property
    def is_locked(self) -> bool:
        """Whether this instance holds the lock."""
        return self._lock is not None and self._lock.is_locked

    def try_acquire(self) -> bool:
        """Take the lock if it is free right now; never waits. CacheError if it cannot be locked at all."""
        try:
            self._file_lock().acquire(blocking=False)
        except Timeout:  # a TimeoutError, hence an OSError: catch it first
            return False
        except OSError as exc:
            raise self._open_error(exc) from exc
        self._write_holder()
        return True

    def acquire(self, timeout_s: float, *, on_wait: OnWait | None = None,
                give_up: Callable[[], bool] | None = None) -> bool:
        """Take the lock, waiting at most ``timeout_s`` seconds for another holder.

        Parameters
        ----------
        timeout_s : float
            Deadline for the wait (``math.inf`` waits for ever).
        on_wait : callable, optional
            Called once with the holder record (or None if none is written yet) when the lock is busy.
        give_up : callable, optional
            Checked every :data:`LOOK_EVERY_S` while blocked (from filelock's own poll loop, as its
            ``cancel_check``), and at the deadline; when it returns True the wait ends without the lock
            (the caller found what it was waiting for).

        Returns
        -------
        bool
            True when the lock is now held; False only when ``give_up`` ended the wait.

        Raises
        ------
        LockTimeout
            The deadline passed; names the key and the holder.
        CacheError
            The lock file cannot be opened or locked (e.g. no flock on this filesystem).

        """
        if self.try_acquire():
            return True
        if claimed_here(self.lock_path):
            # flock SH and EX conflict across descriptors of one process too: waiting would never end.
            raise CacheError(f"cannot lock cache key {self.key}: this thread holds a claim on it "
                             "(KernelCache.claim)", "leave the claim's with block before building or discarding it")
        clock = WaitLog(self.key, self.read_holder)
        if on_wait is not None:
            on_wait(self._current_holder())
        gave_up, next_look = False, clock.start + LOOK_EVERY_S

        def cancel() -> bool:
            nonlocal gave_up, next_look
            clock.tick()
            if give_up is not None and time.monotonic() >= next_look:
                gave_up = give_up()
                next_look = time.monotonic() + LOOK_EVERY_S
            return gave_up

        # -1 is filelock's "for ever" (math.inf is read as -1 by 4.x but not by 3.30).
        left = -1 if math.isinf(timeout_s) else max(0.0, timeout_s - clock.elapsed())
        try:
            self._file_lock().acquire(timeout=left, poll_interval=_POLL_S, cancel_check=cancel)
        except Timeout:
            if gave_up or (give_up is not None and give_up()):
                return False
            raise LockTimeout(self.key, self.read_holder(), timeout_s) from None
        except OSError as exc:
            raise self._open_error(exc) from exc
        self._write_holder()
        return True

    def release(self) -> None:
        """Drop the holder record, then the lock (in that order, so a new holder's record survives)."""
        if self._lock is None or not self._lock.is_locked:
            return
        with contextlib.suppress(OSError):
            self.holder_path.unlink()
        self._lock.release()

    def read_holder(self) -> LockHolder | None:
        """Return the holder record, or None if there is none, it is unreadable, or it is stale.

        A record is stale when it names a dead process of this host (a SIGKILLed holder cannot remove
        its record). Records of other hosts cannot be checked and are returned as they are.
        """
        try:
            # Bounded, non-blocking, no link followed: in a shared sticky lock dir another user can plant a FIFO
            # here, and a plain open() of it blocked every waiter past its deadline.
            data = read_json(self.holder_path, _MAX_HOLDER_BYTES)
            holder = LockHolder.from_record(data)
        except (OSError, ValueError, KeyError, TypeError, OverflowError):
            return None
        if holder.host == this_host() and not pid_alive(holder.pid):
            return None
        return holder

    def _file_lock(self) -> FileLock:
        """Make this instance's FileLock on first use (creating the lock dir)."""
        if self._lock is None:
            make_dirs(self.lock_dir)
            # preserve_lock_file also turns off filelock's soft-lock fallback on filesystems without flock:
            # a soft marker outlives a SIGKILLed holder (see _open_error).
            mode = lock_file_mode(self.lock_dir)
            self._lock = FileLock(self.lock_path, thread_local=False, preserve_lock_file=True,
                                  **({"mode": mode} if mode != 0o644 else {}))
        return self._lock

    def _current_holder(self) -> LockHolder | None:
        """Read the holder record, allowing a new holder a moment to write it after taking the lock."""
        for _ in range(5):
            holder = self.read_holder()
            if holder is not None:
                return holder
            time.sleep(0.01)
        return None

    def _write_holder(self) -> None:
        """Record who holds the lock now; a failure only costs waiters the name of the holder."""
        record = LockHolder(host=this_host(), pid=os.getpid(), since=time.time())
        try:
            write_atomic(self.holder_path, json.dumps(record.to_json()).encode(), durable=False)
        except OSError as exc:
            log.debug("could not write holder record %s: %s", self.holder_path, exc)

    def _open_error(self, exc: OSError) -> CacheError:
        """Explain a lock failure, with the NFS advice when flock itself is missing."""
        return lock_error(self.lock_path, exc)

    def __enter__(self) -> KeyLock:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def lock_file_mode(lock_dir: Path) -> int:
    """Mode of new lock files: in a group-writable lock dir (a team's shared cache) the group must open them too."""
    return 0o664 if lock_dir.stat().st_mode & stat.S_IWGRP else 0o644


def lock_error(lock_path: Path, exc: OSError) -> CacheError:
    """A lock file that cannot be opened or locked, in one line; the NFS advice when flock itself is missing."""
    if exc.errno in _NO_FLOCK:
        return CacheError(f"cannot lock {lock_path}: this filesystem does not support flock", _NO_FLOCK_HINT)
    if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT):
        return CacheWriteError("create the lock file", str(lock_path), exc.strerror or str(exc),
                               "set JITWARM_LOCK_DIR to a writable directory, or use KernelCache(read_only=True) "
                               "for lookups")
    return CacheError(f"cannot lock {lock_path}: {exc.strerror or exc}")


# Claims (jitwarm.cache.claims) this thread holds, by lock path: a blocking KeyLock.acquire of one of them
# would wait for ever, since flock SH and EX conflict across descriptors of one process too.
_CLAIMS = threading.local()


@functools.lru_cache(maxsize=1 << 14)
def key_lock_path(lock_dir: Path, key: str) -> Path:
    """The lock file of ``key`` in ``lock_dir`` (memoized: the capture hook builds it for every claim)."""
    return lock_dir / f"{key}.lock"


def claims_held_here() -> dict[Path, list]:
    """Return the held claims of this thread, by lock path (kept by :class:`~jitwarm.cache.claims.SharedClaim`)."""
    held = getattr(_CLAIMS, "held", None)
    if held is None:
        held = _CLAIMS.held = {}
    return held


def claimed_here(lock_path: Path) -> bool:
    """Whether this thread holds a claim (:class:`~jitwarm.cache.claims.SharedClaim`) on ``lock_path``."""
    return bool(claims_held_here().get(lock_path))
