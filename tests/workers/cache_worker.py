"""Worker process for the cache tests: one get_or_build / wait_for against a shared root, result as JSON.

Usage: cache_worker.py ROOT MODE N [options]

Modes:
  get    get_or_build_ex(desc(N), build) and print {"key", "path", "outcome", "files", "pid"}
  hang   get_or_build(desc(N)) with a build that writes a partial file, touches --in-build, then
         sleeps until killed (holds the key's lock meanwhile)
  wait   wait_for(key(N), --timeout) and print the same JSON (or {"error": ...} on LockTimeout)
  load   get_or_build_ex(desc(N), build), then "load" the entry: a kernel.bin that starts with REJECTED is
         refused (as dlopen refuses a bad library), the entry discarded and got again; the JSON adds
         "discarded" (bool) and "first" (the first call's outcome)

The build appends "N PID" to --counter (O_APPEND, so concurrent appends never interleave), waits for
--rendezvous builds if given, sleeps --sleep seconds, then writes kernel.bin and meta/info.json. With --go
the worker first touches <--ready-dir>/<pid> and waits for the --go file, so all workers start at once.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from jitwarm.cache import KernelCache, LockTimeout


def desc(n: int) -> dict:
    """Return the description of test artifact ``n`` (shared with the tests through cache_harness)."""
    return {"family": "test", "n": n, "flags": ["-O2"]}


def artifact_bytes(n: int) -> bytes:
    """Return the deterministic content of test artifact ``n``."""
    return (f"kernel {n}\n" * 200).encode()


#: A kernel.bin starting with this is one the "loader" of the load mode (and the discard tests) refuses.
REJECTED = b"REJECTED"


def _count(counter: str | None, n: int) -> None:
    if counter:
        fd = os.open(counter, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{n} {os.getpid()}\n".encode())
        finally:
            os.close(fd)


def wait_for_go(go: str, ready_dir: str, timeout_s: float = 60.0) -> bool:
    """Say this process is ready (a file named by its pid), then wait for the GO file: a common start line."""
    Path(ready_dir, str(os.getpid())).touch()
    deadline = time.monotonic() + timeout_s
    while not Path(go).exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def loads(entry) -> bool:
    """The load mode's "loader": refuses a kernel.bin that starts with REJECTED, or that is gone.

    Gone: another process discarded (quarantined) the entry between our lookup and our load, as a real
    loader's dlopen would then fail too.
    """
    try:
        return not entry.file("kernel.bin").read_bytes().startswith(REJECTED)
    except OSError:
        return False


def _touch(path: str | None) -> None:
    if path:
        Path(path).write_text(str(os.getpid()))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("mode", choices=["get", "hang", "wait", "load"])
    ap.add_argument("n", type=int)
    ap.add_argument("--counter")
    ap.add_argument("--sleep", type=float, default=0.0)
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--lock-dir")
    ap.add_argument("--go")
    ap.add_argument("--ready-dir")
    ap.add_argument("--in-build", help="file touched once the build has started")
    ap.add_argument("--on-wait", help="file touched when this call starts waiting on another holder")
    ap.add_argument("--rendezvous", type=int, default=0,
                    help="inside the build, wait until the counter file records this many builds")
    args = ap.parse_args()

    cache = KernelCache(root=args.root, layers=(), lock_dir=args.lock_dir)
    if args.go and not wait_for_go(args.go, args.ready_dir):
        return 3

    def build(staging: Path) -> None:
        _count(args.counter, args.n)
        if args.mode == "hang":
            (staging / "kernel.bin").write_bytes(artifact_bytes(args.n)[:100])  # a partial artifact
            _touch(args.in_build)
            while True:
                time.sleep(1)
        deadline = time.monotonic() + 30
        while args.rendezvous and len(Path(args.counter).read_text().splitlines()) < args.rendezvous:
            if time.monotonic() > deadline:
                raise TimeoutError("rendezvous")
            time.sleep(0.01)
        time.sleep(args.sleep)
        (staging / "kernel.bin").write_bytes(artifact_bytes(args.n))
        (staging / "meta").mkdir()
        (staging / "meta" / "info.json").write_text(json.dumps({"n": args.n}))

    def on_wait(holder: object) -> None:
        _touch(args.on_wait)

    extra: dict[str, object] = {}
    if args.mode == "wait":
        try:
            entry, outcome = cache.wait_for(cache.key(desc(args.n)), args.timeout), "waited"
        except LockTimeout as exc:
            print(json.dumps({"error": str(exc)}))
            return 2
    else:
        entry, outcome = cache.get_or_build_ex(desc(args.n), build, timeout_s=args.timeout, on_wait=on_wait)
    if args.mode == "load":
        extra = {"first": outcome, "discarded": False}
        if not loads(entry):
            cache.discard(entry, "OSError: kernel.bin: invalid ELF header", timeout_s=args.timeout)
            entry, outcome = cache.get_or_build_ex(desc(args.n), build, timeout_s=args.timeout)
            extra["discarded"] = True
            if not loads(entry):
                print(json.dumps({"error": "the entry got after discard does not load either"}))
                return 2
    print(json.dumps({"key": entry.key, "path": str(entry.path), "outcome": outcome,
                      "files": list(entry.files), "pid": os.getpid(), **extra}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
