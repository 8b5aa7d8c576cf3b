"""Per-key build locks (flock via filelock) with a holder record, readers' shared claims, and the one wait loop."""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import functools
import json
import logging
import os
import re
import shutil
import socket
import stat
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypeVar

from filelock import FileLock, Timeout

from jitwarm.cache.errors import CacheError, CacheWriteError, LockTimeout, UntrustedPath
from jitwarm.cache.files import HOW_TO_ALLOW, check_trusted_dir, make_dirs, read_json, untrusted_reason, write_atomic

log = logging.getLogger("jitwarm.cache")

T = TypeVar("T")

WAIT_LOG_AFTER_S = 3.0
#: While blocked on a key's lock, try it every 20 ms (filelock's default) and ask ``give_up`` every 50 ms.
_POLL_S, LOOK_EVERY_S = 0.02, 0.05
#: A holder record is a few dozen bytes; anything larger was not written by a holder.
_MAX_HOLDER_BYTES = 4096


def this_host() -> str:
    """Return this host's name, reduced to characters that are safe in a file name."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname()) or "localhost"


def left_by_dead_process(host: str, pid: str) -> bool:
    """Whether a temporary named for ``host`` and ``pid`` is of a dead process of this host (never another host's)."""
    return host == this_host() and pid.isdigit() and not pid_alive(int(pid))


def process_scratch(prefix: str) -> Path:
    """A new directory in $TMPDIR named for this host and process, removed when the process exits.

    The first call for ``prefix`` removes those of this user's dead processes (a crash loop filled $TMPDIR).
    """
    if prefix not in _swept:
        _swept.add(prefix)
        with contextlib.suppress(OSError), os.scandir(tempfile.gettempdir()) as found:
            for item in found:
                host, _, rest = item.name.removeprefix(prefix).partition("~")
                if (item.name.startswith(prefix) and left_by_dead_process(host, rest.partition("~")[0])
                        and item.is_dir(follow_symlinks=False)
                        and item.stat(follow_symlinks=False).st_uid == os.getuid()):
                    shutil.rmtree(item.path, ignore_errors=True)
    path = tempfile.mkdtemp(prefix=f"{prefix}{this_host()}~{os.getpid()}~")
    atexit.register(shutil.rmtree, path, True)
    return Path(path)


_swept: set[str] = set()


def pid_alive(pid: int) -> bool:
    """Return True if ``pid`` is a live process on this host (a zombie counts as dead)."""
    if pid == os.getpid():
        return True
    if pid <= 0:
        return False
    try:
        # A SIGKILLed child stays a zombie until reaped, but it holds no locks any more.
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except FileNotFoundError:
        return False
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive: another user's
    return True


@dataclass(frozen=True)
class LockHolder:
    """Who holds a key's lock (or fleet lease) since when (``time.time()``)."""

    host: str
    pid: int
    since: float

    @classmethod
    def from_record(cls, data: object) -> LockHolder:
        """Read a record another process wrote (maybe planted); KeyError, TypeError, ValueError, OverflowError."""
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


def wait_until(poll: Callable[[], T | None], timeout_s: float, *, key: str,
               holder: Callable[[], LockHolder | None], where: str = "",
               backoff: tuple[float, float, float] = (0.02, 1.5, 0.5)) -> T:
    """Call ``poll`` with a backoff ``(first, factor, cap)`` until it returns non-None; ``LockTimeout``.

    After :data:`WAIT_LOG_AFTER_S`, log once who holds ``key``.
    """
    start, logged = time.monotonic(), False
    delay, factor, cap = backoff
    while True:
        elapsed = time.monotonic() - start
        if not logged and elapsed >= WAIT_LOG_AFTER_S:
            logged, who = True, holder()
            log.info("still waiting for cache key %s%s: %s", key, where,
                     who.describe() if who else "no holder recorded")
        if elapsed >= timeout_s:
            raise LockTimeout(key, holder(), timeout_s)
        time.sleep(min(delay, timeout_s - elapsed))
        delay = min(delay * factor, cap)
        found = poll()
        if found is not None:
            return found


class KeyLock:
    """The build lock of one key: ``<lock_dir>/<key>.lock`` (flock, one descriptor per instance) and ``.holder``.

    One descriptor per instance, so two threads exclude each other as two processes do; the kernel drops a
    flock when its holder dies. Lock files are never deleted: unlinking one while others wait on it splits
    them across inodes (two builders at once).
    """

    def __init__(self, lock_dir: Path, key: str, *, shared: bool = False) -> None:
        self.key = key
        self.lock_dir = lock_dir
        self.shared = shared
        self.lock_path, self.holder_path = _lock_paths(lock_dir, key)
        self._lock: FileLock | None = None

    def try_acquire(self) -> bool:
        """Take the lock if it is free right now; never waits. CacheError if it cannot be locked at all."""
        try:
            if self._lock is None:  # its mode depends on the lock dir
                mode = _ready_lock_file(self.lock_dir, self.lock_path, shared=self.shared)
                # preserve_lock_file also turns off filelock's soft-lock fallback: it outlives a SIGKILLed holder.
                self._lock = FileLock(self.lock_path, thread_local=False, preserve_lock_file=True, mode=mode)
            self._lock.acquire(blocking=False)
        except Timeout:  # a TimeoutError, hence an OSError: catch it first
            return False
        except OSError as exc:
            raise _lock_error(self.lock_path, exc) from exc
        record = LockHolder(host=this_host(), pid=os.getpid(), since=time.time())
        try:  # a failure only costs waiters the name of the holder
            write_atomic(self.holder_path, json.dumps(record.to_json()).encode(), durable=False)
        except OSError as exc:
            log.debug("could not write holder record %s: %s", self.holder_path, exc)
        return True

    def acquire(self, timeout_s: float, *, on_wait: OnWait | None = None,
                give_up: Callable[[], bool] | None = None) -> bool:
        """Take the lock, waiting at most ``timeout_s``; ``LockTimeout``, ``CacheError`` (cannot lock).

        ``on_wait(holder)`` is called once when the lock is busy; ``give_up()``, asked every
        :data:`LOOK_EVERY_S` and at the deadline, ends the wait without the lock when True: the only False.
        """
        if self.try_acquire():
            return True
        if on_wait is not None:
            on_wait(self._current_holder())
        next_look = time.monotonic() + LOOK_EVERY_S

        def poll() -> bool | None:
            nonlocal next_look
            if self.try_acquire():
                return True
            if give_up is not None and time.monotonic() >= next_look:
                next_look = time.monotonic() + LOOK_EVERY_S
                if give_up():
                    return False
            return None

        try:
            return wait_until(poll, timeout_s, key=self.key, holder=self.read_holder, backoff=(_POLL_S, 1, _POLL_S))
        except LockTimeout:
            if give_up is not None and give_up():
                return False
            raise

    def release(self) -> None:
        """Drop the holder record, then the lock (so a new holder's record survives)."""
        if self._lock is None or not self._lock.is_locked:
            return
        with contextlib.suppress(OSError):
            self.holder_path.unlink()
        self._lock.release()

    def read_holder(self) -> LockHolder | None:
        """The holder record, or None: none, unreadable, or of a dead process of this host (SIGKILLed)."""
        try:
            # Non-blocking: a FIFO planted here blocked every waiter past its deadline.
            data = read_json(self.holder_path, _MAX_HOLDER_BYTES)
            holder = LockHolder.from_record(data)
        except (OSError, ValueError, KeyError, TypeError, OverflowError):
            return None
        return None if holder.host == this_host() and not pid_alive(holder.pid) else holder

    def _current_holder(self) -> LockHolder | None:
        """Read the holder record, allowing a new holder a moment to write it."""
        for _ in range(5):
            holder = self.read_holder()
            if holder is not None:
                return holder
            time.sleep(0.01)
        return None

    def __enter__(self) -> KeyLock:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


_READY: dict[tuple[Path, bool], int] = {}  # lock dirs created and trust-checked by this process -> file mode
_PRIVATE: set[Path] = set()  # lock files found private (or made so) by this process


def ready_lock_dir(lock_dir: Path, *, shared: bool) -> int:
    """Create and trust-check ``lock_dir``; return its lock files' mode. ``UntrustedPath``, CacheError, OSError."""
    mode = _READY.get((lock_dir, shared))
    if mode is not None:
        return mode
    make_dirs(lock_dir, 0o777 if shared else 0o755)  # as the root: the umask decides a shared one
    check_trusted_dir(lock_dir, "lock directory", allow_shared=shared)
    # Private (0600): a 0644 one let any user flock it (root's warm timed out); a shared one: the group's too.
    mode = (0o664 if lock_dir.stat().st_mode & stat.S_IWGRP else 0o644) if shared else 0o600
    _READY[(lock_dir, shared)] = mode
    return mode


def _ready_lock_file(lock_dir: Path, lock_path: Path, *, shared: bool) -> int:
    """:func:`ready_lock_dir`, then make ``lock_path`` private or refuse another user's."""
    mode = ready_lock_dir(lock_dir, shared=shared)
    if shared or lock_path in _PRIVATE:
        return mode
    try:
        st = os.lstat(lock_path)
    except FileNotFoundError:
        return mode  # created with ``mode`` by its first locker
    if st.st_uid == os.geteuid() and stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) != mode:
        lock_path.chmod(mode)  # made 0644 by an older jitwarm: any user could flock it
    elif (why := untrusted_reason(st)) is not None:
        raise UntrustedPath(f"refusing lock file {lock_path}: {why}", HOW_TO_ALLOW)
    _PRIVATE.add(lock_path)
    return mode


def _lock_error(lock_path: Path, exc: OSError) -> CacheError:
    """A lock file that cannot be opened or locked, in one line."""
    if exc.errno in (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP):
        return CacheError(f"cannot lock {lock_path}: this filesystem does not support flock",
                          "set JITWARM_LOCK_DIR to node-local storage such as /dev/shm/jitwarm-locks")
    if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT):
        return CacheWriteError("create the lock file", str(lock_path), exc.strerror or str(exc),
                               "set JITWARM_LOCK_DIR to a writable directory, or use KernelCache(read_only=True) "
                               "for lookups")
    return CacheError(f"cannot lock {lock_path}: {exc.strerror or exc}")


@functools.lru_cache(maxsize=1 << 14)
def _lock_paths(lock_dir: Path, key: str) -> tuple[Path, Path]:
    """``<key>.lock`` and ``<key>.holder`` (memoized: the capture hook claims every kernel)."""
    return lock_dir / f"{key}.lock", lock_dir / f"{key}.holder"


class SharedClaim:
    """A reader's claim: a SHARED flock on the lock file :class:`KeyLock` locks exclusively.

    Its holder must not lock the key exclusively inside it (``LockTimeout``). With ``create=False`` (a
    read-only cache) a lock file that cannot be opened means no claim.
    """

    def __init__(self, lock_dir: Path, key: str, *, create: bool, shared: bool = False) -> None:
        self.lock = KeyLock(lock_dir, key, shared=shared)  # its lock file and holder record; never locked
        self.create = create
        self._fd: int | None = None

    def acquire(self, timeout_s: float) -> bool:
        """Take the shared lock within ``timeout_s``; False without a lock file. ``LockTimeout``, ``CacheError``."""
        fd = self._open()
        if fd is None:
            return False
        try:
            if not self._try(fd):
                wait_until(lambda: True if self._try(fd) else None, timeout_s, key=self.lock.key,
                           holder=self.lock.read_holder, backoff=(0.005, 1.5, 0.1))
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return True

    def release(self) -> None:
        """Drop the shared lock (idempotent)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)

    def _open(self) -> int | None:
        """Open the lock file without blocking or following a link; None when it cannot be."""
        flags, path = os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, self.lock.lock_path
        if self.create:
            try:
                mode = _ready_lock_file(self.lock.lock_dir, path, shared=self.lock.shared)
                return os.open(path, flags | os.O_RDWR | os.O_CREAT, mode)
            except OSError as exc:  # (an untrusted one is a CacheError: it raises)
                log.debug("claim of %s: cannot create %s (%s); reading it unlocked", self.lock.key, path, exc)
        try:
            return os.open(path, flags | os.O_RDONLY)  # a shared flock needs no write access
        except OSError:
            return None

    def _try(self, fd: int) -> bool:
        """One non-blocking attempt at the shared lock."""
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        except OSError as exc:
            raise _lock_error(self.lock.lock_path, exc) from exc
        return True
