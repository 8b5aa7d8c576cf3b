"""The CUDA driver's PTX JIT cache (``CUDA_CACHE_PATH``), keyed by the driver's version among others.

The driver's ``index`` names every entry, so the whole tree is one unit (``.``), complete with its index, which
goes last. The driver rewrites the index in place while it runs: every file is read settled
(:func:`settled_bytes`), and the entry's check refuses a unit whose two reads differ. A torn index is never stored.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Mapping
from pathlib import Path

from jitwarm.kernels.kinds import named
from jitwarm.kernels.libraries.jit_caches.census import bind
from jitwarm.kernels.libraries.jit_caches.units import Library, expand, tree_files

INDEX = "index"
#: Seconds a file must have been left alone before it is read as a whole version of itself.
QUIET_S = 0.25
#: Seconds a capture waits for a quiet moment before it gives the unit up (to the next capture).
SETTLE_TIMEOUT_S = 10.0


def resolve(environ: Mapping[str, str]) -> Path:
    """The driver's ``CUDA_CACHE_PATH`` in ``environ``."""
    if environ.get("CUDA_CACHE_PATH"):
        return Path(environ["CUDA_CACHE_PATH"])
    return expand("~/.nv/ComputeCache")


def units(root: Path) -> dict[str, tuple[str, ...]]:
    """The whole tree as one unit, once the driver has written its index."""
    files = tree_files(root)
    return {".": tuple(files)} if INDEX in files else {}


def settled_bytes(path: Path, quiet_s: float = QUIET_S, timeout_s: float = SETTLE_TIMEOUT_S,
                  empty_ok: bool = True) -> bytes:
    """The bytes of ``path`` as one version: unchanged for ``quiet_s`` before and during the read.

    An empty file is not one unless ``empty_ok``. OSError when the file vanished, or ``EAGAIN`` when it kept
    changing (or stayed empty) for ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        with open(path, "rb") as f:
            before = os.fstat(f.fileno())
            age = time.time() - max(before.st_mtime, before.st_ctime)
            if age >= quiet_s:
                data = f.read()
                after = os.fstat(f.fileno())
                if _same(before, after) and len(data) == after.st_size and (data or empty_ok):
                    return data
        left = deadline - time.monotonic()
        if left <= 0:
            raise OSError(errno.EAGAIN, f"{path.name} kept changing for {timeout_s:g} s (the driver is writing it)")
        time.sleep(min(left, max(quiet_s - max(age, 0.0), 0.01)))


def _same(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_ino, a.st_size, a.st_mtime_ns, a.st_ctime_ns) == (b.st_ino, b.st_size, b.st_mtime_ns, b.st_ctime_ns)


class _DriverCache(Library):
    """The PTX cache's library: its files are read settled (a subclass, not a dataclass: cheaper to import)."""

    def stored_bytes(self, root: Path, rel: str) -> bytes:
        """The settled bytes of ``root/rel`` (:func:`settled_bytes`); an empty index is the driver mid-rewrite."""
        # The driver truncates the index before it writes it, and ext4 shows a truncate's size before its mtime:
        # for that instant the file is empty yet looks quiet, and a second look shortly after is not enough on a
        # loaded box (tests/test_jit_caches_ptx.py); a write's data never shows before its mtime.
        return settled_bytes(root / rel, empty_ok=rel != INDEX)


# normalize: the identity, so that a capture copies the settled bytes (jit_caches.backend.store), not the file.
LIBRARY = _DriverCache(*named("ptx"), resolve, units, ("driver", "arch"), is_commit=lambda rel: rel == INDEX,
                       normalize=lambda rel, data: data)
name, description, build, check, load = bind(LIBRARY)
