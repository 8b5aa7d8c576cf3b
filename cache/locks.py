"""Per-key build locks (flock via filelock) with a holder record that waiters can read."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import socket
import stat
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from filelock import FileLock, Timeout

from jitwarm.cache.durable import make_dirs, write_atomic
from jitwarm.cache.errors import CacheError, LockTimeout

log = logging.getLogger("jitwarm.cache")

#: A waiter that has waited this long logs, once, who holds the lock.
WAIT_LOG_AFTER_S = 3.0
#: Longest single blocking slice; between slices the caller's ``give_up`` check runs.
_SLICE_S = 0.25
_POLL_S = 0.02


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
    """Who holds a key's build lock: written by the holder right after it acquires the lock.

    Attributes
    ----------
    host : str
        Host name of the holder.
    pid : int
        Its process id (on ``host``).
    since : float
        When it acquired the lock (``time.time()``).

    """

    host: str
    pid: int
    since: float

    def describe(self) -> str:
        """Return e.g. ``"held by pid 4242 on node-3 since 12:00:01 (7.5 s ago)"``."""
        when = time.strftime("%H:%M:%S", time.localtime(self.since))
        return f"held by pid {self.pid} on {self.host} since {when} ({time.time() - self.since:.1f} s ago)"

    def to_json(self) -> dict[str, object]:
        """Return the record as a JSON-able dict."""
        return asdict(self)


#: ``on_wait(holder)``: called once when a call has to wait for another process (holder None if unknown).
OnWait = Callable[[LockHolder | None], None]


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
        self.lock_path = lock_dir / f"{key}.lock"
        self.holder_path = lock_dir / f"{key}.holder"
        self._lock: FileLock | None = None  # made on first acquire: its mode depends on the lock dir

    @property
    def is_locked(self) -> bool:
        """Whether this instance holds the lock."""
        return self._lock is not None and self._lock.is_locked

    def try_acquire(self) -> bool:
        """Take the lock if it is free right now; never waits."""
        try:
            if self._lock is None:
                make_dirs(self.lock_dir)
                # In a group-writable lock dir (a team's shared cache) the group must be able to open the
                # lock files too. preserve_lock_file also turns off filelock's soft-lock fallback on
                # filesystems without flock: a soft marker outlives a SIGKILLed holder (see _open_error).
                shared = self.lock_dir.stat().st_mode & stat.S_IWGRP
                self._lock = FileLock(self.lock_path, thread_local=False, preserve_lock_file=True,
                                      **({"mode": 0o664} if shared else {}))
            self._lock.acquire(blocking=False)
        except Timeout:  # a TimeoutError, hence an OSError: catch it first
            return False
        except OSError as exc:
            raise self._open_error(exc) from exc
        self._write_holder()
        return True

    def acquire(
        self,
        timeout_s: float,
        *,
        on_wait: Callable[[LockHolder | None], None] | None = None,
        give_up: Callable[[], bool] | None = None,
    ) -> bool:
        """Take the lock, waiting at most ``timeout_s`` seconds for another holder.

        Parameters
        ----------
        timeout_s : float
            Deadline for the wait (``math.inf`` waits for ever).
        on_wait : callable, optional
            Called once with the holder record (or None if none is written yet) when the lock is busy.
        give_up : callable, optional
            Checked between waiting slices; when it returns True the wait ends without the lock (the
            caller found what it was waiting for).

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
        start = time.monotonic()
        deadline = start + timeout_s
        if on_wait is not None:
            on_wait(self._current_holder())
        logged = False
        while True:
            now = time.monotonic()
            if not logged and now - start >= WAIT_LOG_AFTER_S:
                logged = self.log_wait()
            if now >= deadline:
                if give_up is not None and give_up():
                    return False
                raise LockTimeout(self.key, self.read_holder(), timeout_s)
            try:
                self._lock.acquire(timeout=min(deadline - now, _SLICE_S), poll_interval=_POLL_S)
            except Timeout:
                if give_up is not None and give_up():
                    return False
                continue
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
            data = json.loads(self.holder_path.read_text(encoding="utf-8"))
            holder = LockHolder(host=str(data["host"]), pid=int(data["pid"]), since=float(data["since"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if holder.host == this_host() and not pid_alive(holder.pid):
            return None
        return holder

    def log_wait(self) -> bool:
        """Log (at INFO) that we are waiting for this key and who holds its lock; return True."""
        holder = self.read_holder()
        log.info("waiting for cache key %s: %s", self.key, holder.describe() if holder else "no lock holder recorded")
        return True

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
        hint = ""
        if exc.errno in (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP):
            hint = ("; this filesystem does not support flock: set JITWARM_LOCK_DIR to node-local storage "
                    "such as /dev/shm/jitwarm-locks")
        return CacheError(f"cannot lock {self.lock_path}: {exc}{hint}")

    def __enter__(self) -> KeyLock:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()
