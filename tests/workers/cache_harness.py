"""Helpers shared by the cache tests: run cache_worker.py processes, start them together, count builds."""

from __future__ import annotations

import collections
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from jitwarm.cache import KernelCache

WORKER = Path(__file__).with_name("cache_worker.py")
sys.path.insert(0, str(WORKER.parent))

from cache_worker import REJECTED, artifact_bytes, desc  # noqa: E402

__all__ = ["FILES_PER_ENTRY", "OTHER_USER", "REJECTED", "WORKER", "Sha256Counter", "Workers", "artifact_bytes",
           "as_user", "build_counts", "cache_for", "desc", "make_builder", "other_user", "shared_dir",
           "wait_for_file"]

#: Files :func:`make_builder` writes: kernel.bin and meta/info.json.
FILES_PER_ENTRY = 2


class Sha256Counter:
    """Stands in for the hashlib module of one cache module and counts sha256() calls."""

    def __init__(self) -> None:
        self.calls = 0

    def sha256(self, *args):
        self.calls += 1
        return hashlib.sha256(*args)


def make_builder(counter: Path, n: int, *, sleep: float = 0.0, extra: dict[str, bytes] | None = None):
    """Return an in-process build callable for artifact ``n`` that logs each call to ``counter``."""

    def build(staging: Path) -> None:
        fd = os.open(counter, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{n} {os.getpid()}\n".encode())
        finally:
            os.close(fd)
        time.sleep(sleep)
        (staging / "kernel.bin").write_bytes(artifact_bytes(n))
        (staging / "meta").mkdir()
        (staging / "meta" / "info.json").write_text(json.dumps({"n": n}))
        for name, data in (extra or {}).items():
            (staging / name).write_bytes(data)

    return build


def build_counts(counter: Path) -> collections.Counter:
    """Return how many builds of each artifact number the counter file records."""
    if not counter.exists():
        return collections.Counter()
    return collections.Counter(int(line.split()[0]) for line in counter.read_text().splitlines() if line)


def wait_for_file(path: Path, timeout: float = 30.0) -> None:
    """Block until ``path`` exists."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout} s")
        time.sleep(0.01)


class Workers:
    """A set of cache_worker.py processes against one root, optionally started at the same instant."""

    def __init__(self, tmp: Path, root: Path, *, lock_dir: Path | None = None) -> None:
        self.tmp, self.root, self.lock_dir = tmp, root, lock_dir
        self.counter = tmp / "builds.log"
        self.go = tmp / "go"
        self.ready = tmp / "ready"
        self.ready.mkdir(exist_ok=True)
        self.procs: list[subprocess.Popen] = []

    def spawn(self, mode: str, n: int, *, sleep: float = 0.0, timeout: float = 60.0, together: bool = False,
              lock_dir: Path | None = None, **flags: object) -> subprocess.Popen:
        """Start one worker; ``flags`` become ``--name value`` options (in_build, on_wait, rendezvous)."""
        cmd = [sys.executable, str(WORKER), str(self.root), mode, str(n), "--counter", str(self.counter),
               "--sleep", str(sleep), "--timeout", str(timeout)]
        if (lock_dir or self.lock_dir) is not None:
            cmd += ["--lock-dir", str(lock_dir or self.lock_dir)]
        if together:
            cmd += ["--go", str(self.go), "--ready-dir", str(self.ready)]
        for name, value in flags.items():
            cmd += [f"--{name.replace('_', '-')}", str(value)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.procs.append(proc)
        return proc

    def start_together(self, count: int, timeout: float = 30.0) -> None:
        """Wait until ``count`` workers spawned with ``together`` are ready, then let them all go."""
        deadline = time.monotonic() + timeout
        while len(list(self.ready.iterdir())) < count:
            if time.monotonic() > deadline:
                raise TimeoutError("workers did not get ready")
            time.sleep(0.01)
        self.go.touch()

    def results(self, procs: list[subprocess.Popen] | None = None, timeout: float = 60.0) -> list[dict]:
        """Wait for ``procs`` (default: all) and return their JSON results; fail on a non-zero exit."""
        out = []
        for proc in procs if procs is not None else self.procs:
            stdout, stderr = proc.communicate(timeout=timeout)
            assert proc.returncode == 0, f"worker failed ({proc.returncode}):\n{stdout}\n{stderr}"
            out.append(json.loads(stdout.strip().splitlines()[-1]))
        return out

    def kill_all(self) -> None:
        """SIGKILL and reap every worker still running (test cleanup)."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()


def cache_for(root: Path, **kwargs) -> KernelCache:
    """Return a KernelCache on ``root`` that ignores any layers set in the environment."""
    kwargs.setdefault("layers", ())
    return KernelCache(root=root, **kwargs)


# -- another user ---------------------------------------------------------------------------------------------

#: The unprivileged account the permission tests run as (created by the environment; skipped without it).
OTHER_USER = "jwtest"


def other_user():
    """Return ``pwd`` record of :data:`OTHER_USER`, or None when it does not exist or we cannot switch to it."""
    import pwd

    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam(OTHER_USER)
    except KeyError:
        pass
    import shutil
    import subprocess

    # As root, make the account once (a system user without a home): the other-user attacks then run, not skip.
    if shutil.which("useradd") is None or subprocess.run(["useradd", "--system", "--no-create-home", OTHER_USER],
                                                         capture_output=True, check=False).returncode not in (0, 9):
        return None
    try:
        return pwd.getpwnam(OTHER_USER)
    except KeyError:
        return None


def as_user(user, fn, *args, timeout: float = 60.0):
    """Run ``fn(*args)`` in a forked child switched to ``user`` (a pwd record); return its result or raise.

    The child has this process's modules already imported (the venv under /root is not readable by that
    user). An exception in the child comes back as ``RuntimeError("<Type>: <message>")``, so a test can tell
    a clean ``CacheError`` from a raw ``PermissionError``.
    """
    import pickle
    import signal

    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        code = 0
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(user.pw_gid)
            os.setuid(user.pw_uid)
            try:
                payload = ("ok", fn(*args))
            except BaseException as exc:  # noqa: BLE001 - reported to the parent
                payload = ("raised", f"{type(exc).__name__}: {exc}")
            data = pickle.dumps(payload)
            with os.fdopen(write_end, "wb") as f:
                f.write(data)
        except BaseException:  # noqa: BLE001
            code = 1
        os._exit(code)
    os.close(write_end)
    deadline = time.monotonic() + timeout
    with os.fdopen(read_end, "rb") as f:
        data = f.read()
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise TimeoutError(f"child as {user.pw_name} did not finish within {timeout} s")
        time.sleep(0.01)
    if not data:
        raise RuntimeError(f"child as {user.pw_name} died (status {status})")
    kind, value = pickle.loads(data)
    if kind == "raised":
        raise RuntimeError(value)
    return value


def shared_dir(owner=None) -> Path:
    """A fresh directory under /tmp that another user can reach (pytest's tmp_path is 0700), owned by ``owner``."""
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="jitwarm-test-", dir="/tmp"))
    path.chmod(0o755)
    if owner is not None:
        os.chown(path, owner.pw_uid, owner.pw_gid)
    return path
