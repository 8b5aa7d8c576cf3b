"""A Triton ``CacheManager`` over jitwarm's cache: every compile of the server's Triton found or built exactly once.

A miss reserves the key (its lock held while Triton compiles) and publishes what ``put_group`` hands over; a hit
hands Triton copies made under the entry's claim (docs/triton.md, "Serving").
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import threading
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from triton.runtime.cache import CacheManager as _TritonCacheManager
from triton.runtime.cache import FileCacheManager

from jitwarm.cache import CacheError, Entry, KernelCache, Reservation
from jitwarm.cache.locks import process_scratch
from jitwarm.kernels.artifacts import Artifact, artifact
from jitwarm.kernels.backend import LoadError
from jitwarm.kernels.libraries.triton import NAME, SERVED
from jitwarm.kernels.libraries.triton.driver import GROUP_PREFIX, read_group, write_group
from jitwarm.kernels.spec import KernelSpec

log = logging.getLogger("jitwarm.triton")

#: How long a miss waits for another process's compile of the same key before compiling itself.
WAIT_S = 600.0

_state_lock = threading.Lock()
_state: dict[str, Any] = {"cache": None, "failed": None}
#: Each compile this process's managers answered: ``("<kernel> <Triton key>", "served" or "compiled")``.
_served: list[tuple[str, str]] = []
_SCRATCH = "jitwarm-triton-"


def served_group(triton_key: str, group: str) -> KernelSpec:
    """The spec of the compile keyed ``triton_key`` the server's Triton asks for: the entry its replay names too."""
    return KernelSpec(group, NAME, SERVED, {"served": "group", "triton_key": triton_key})


def served_file(triton_key: str, filename: str) -> KernelSpec:
    """The spec of one file the server's Triton keeps outside a group (a launcher module, autotune results)."""
    return KernelSpec(filename, NAME, SERVED, {"served": "file", "triton_key": triton_key})


def served() -> list[tuple[str, str]]:
    """A copy of what this process's managers did, compile by compile (see ``_served``)."""
    with _state_lock:
        return list(_served)


def use_cache(cache: KernelCache | None) -> None:
    """Make ``cache`` the one the managers of this process use (None: ``KernelCache()`` on first use)."""
    with _state_lock:
        _state.update(cache=cache, failed=None)


def _cache() -> KernelCache | None:
    """The process's cache, opened on first use; None (logged once) when it cannot be opened."""
    with _state_lock:
        if _state["cache"] is None and _state["failed"] is None:
            try:
                _state["cache"] = KernelCache()
            except (CacheError, ValueError, OSError) as exc:
                _state["failed"] = str(exc)
                log.warning("jitwarm: Triton compiles use Triton's own cache: jitwarm's cannot be opened (%s)", exc)
        return _state["cache"]


def serve(cache: KernelCache | None = None) -> None:
    """Make every later Triton compile of this process find and store its result in ``cache`` (None: the default)."""
    from triton import knobs

    if cache is not None:
        use_cache(cache)
    knobs.cache.manager_class = CacheManager


@contextlib.contextmanager
def serving() -> Iterator[None]:
    """Run the block with Triton storing and finding its compiles through this module's :class:`CacheManager`."""
    from triton import knobs

    with knobs.cache.scope():
        knobs.cache.manager_class = CacheManager
        yield


class CacheManager(_TritonCacheManager):
    """Triton's cache manager interface over jitwarm's cache, for Triton's key of one compile."""

    def __new__(cls, key: str, override: bool = False, dump: bool = False) -> Any:
        """Triton's own ``FileCacheManager`` for its IR ``override`` and ``dump`` directories, or with no cache here."""
        if override or dump or _cache() is None:
            return FileCacheManager(key, override=override, dump=dump)
        return super().__new__(cls)

    def __init__(self, key: str, override: bool = False, dump: bool = False) -> None:
        self.key = key
        self._cache = _cache()
        self._reservation: Reservation | None = None
        self._compiling = False  # get_group said None: the files Triton puts next belong to that compile
        self._scratch: Path | None = None

    def get_group(self, filename: str) -> dict[str, str] | None:
        """The files of the compile ``filename`` names, from the cache; None when Triton is to compile it."""
        art = artifact(served_group(self.key, filename))
        group = self._find_group(art)
        self._compiling = group is None
        with _state_lock:
            _served.append((f"{Path(filename).stem} {self.key}", "compiled" if group is None else "served"))
        return group

    def _find_group(self, art: Artifact) -> dict[str, str] | None:
        """A hit's files, copied; None after reserving the key (or when the cache fails: compile unshared)."""
        try:
            entry = art.lookup(self._cache)
            if entry is None:
                reservation = art.reserve(self._cache, WAIT_S, missed=True)
                if reservation.staging is not None:  # this process builds it: Triton compiles, put()s, put_group()s
                    self._reservation = reservation
                    weakref.finalize(self, reservation.abandon)  # a compile that never finished frees the key
                    return None
                entry = reservation.result[0]  # another process's, got while waiting for its lock
        except (CacheError, OSError) as exc:
            log.warning("jitwarm: cannot look up Triton's %s in the cache (%s): compiling it", art.spec.family, exc)
            return None
        return self._hand_over(art, entry, self._copy_group)

    def put_group(self, filename: str, group: dict[str, str]) -> str:
        """Publish the compile whose files Triton ``put`` (the key's lock was held since ``get_group``)."""
        grp = write_group(self._scratch_dir(), filename, [Path(child).name for child in group])
        reservation, self._reservation, self._compiling = self._reservation, None, False
        art = artifact(served_group(self.key, filename))
        try:
            if reservation is None:  # put_group without a get_group miss: publish it as it is
                reservation = art.reserve(self._cache, WAIT_S)
            if reservation.staging is not None:
                mine = GROUP_PREFIX + art.spec.family
                for path in grp.parent.iterdir():  # the compile's files and its group, not another group's
                    if path.is_file() and (path.name == mine or not path.name.startswith(GROUP_PREFIX)):
                        shutil.copy2(path, reservation.staging / path.name)
                art.publish(reservation)
        except (CacheError, OSError) as exc:  # the server's compile goes on unshared, whatever the cache said
            log.warning("jitwarm: Triton's compile %s is not in the cache: %s", art.spec.family, exc)
        finally:
            if reservation is not None:
                reservation.abandon()  # a copy that failed: nothing published, the key's lock released
        return str(grp)  # Triton keeps these paths (CompiledKernel.metadata_group): its own files, never pruned

    def put(self, data: Any, filename: str, binary: bool = True) -> str:
        """Store one file: into the pending compile's files, or as an entry of its own."""
        path = self._scratch_dir() / Path(filename).name
        if isinstance(data, bytes):
            path.write_bytes(data)
        else:
            path.write_text(str(data))
        if self._compiling:  # part of a compile: published (or not) by put_group
            return str(path)
        try:
            artifact(served_file(self.key, path.name)).get_or_build(
                self._cache, WAIT_S, capture=lambda staging: shutil.copy2(path, staging / path.name))
        except (CacheError, OSError) as exc:
            log.warning("jitwarm: cannot store Triton's %s in the cache: %s", filename, exc)
        return str(path)  # Triton reads (dlopens) its own copy, never the entry's file

    def get_file(self, filename: str) -> str | None:
        """A file put in this compile, or a single-file entry; None when there is none."""
        name = Path(filename).name
        if self._scratch is not None and (self._scratch / name).is_file():
            return str(self._scratch / name)
        art = artifact(served_file(self.key, name))
        try:
            entry = art.lookup(self._cache)
        except (CacheError, OSError) as exc:
            log.warning("jitwarm: cannot look up Triton's %s in the cache (%s)", filename, exc)
            return None
        copied = self._hand_over(art, entry, lambda e: {name: self._copy(e.file(name))}) if entry else None
        return copied[name] if copied else None

    def _hand_over(self, art: Artifact, entry: Entry,
                   copy: Callable[[Entry], dict[str, str]]) -> dict[str, str] | None:
        """``copy(entry)`` under the entry's claim; None (Triton compiles) if it vanished or is unusable."""
        try:
            return art.read(self._cache, entry, copy, timeout_s=WAIT_S)
        except (LoadError, OSError) as exc:  # a broken entry is a miss for Triton, never a crash
            log.warning("jitwarm: Triton entry %s is unusable (%s): compiling it again", entry.path, exc)
            with contextlib.suppress(CacheError, OSError):  # set it aside, so this compile's result replaces it
                self._cache.discard(entry, f"Triton entry unusable: {exc}", timeout_s=10.0)
        except CacheError as exc:
            log.warning("jitwarm: cannot claim Triton's entry %s (%s): compiling it", entry.path, exc)
        return None

    def _copy_group(self, entry: Entry) -> dict[str, str]:
        group = entry.description["group"]
        return {child: self._copy(path) for child, path in read_group(Path(entry.path), group).items()}

    def _copy(self, path: Path) -> str:
        dest = self._scratch_dir() / path.name
        shutil.copyfile(path, dest)
        return str(dest)

    def _scratch_dir(self) -> Path:
        """Where this manager's files wait for Triton to read them back (a :func:`.process_scratch` directory)."""
        if self._scratch is None:
            self._scratch = process_scratch(_SCRATCH)
        return self._scratch
