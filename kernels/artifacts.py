"""The one path from a spec to a cache entry and to a loaded kernel: description, key, lookup, build, load.

A build is checked before it is sealed; an entry that still fails to load is quarantined and rebuilt once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from jitwarm.cache import CacheResult, Entry, KernelCache, Reservation, key_of
from jitwarm.kernels.backend import Facts, LoadedKernel, LoadError, backend
from jitwarm.kernels.spec import KernelSpec

log = logging.getLogger("jitwarm.kernels")
T = TypeVar("T")

#: Lookups whose entry vanished before it was claimed, before :meth:`Artifact.load` gives up.
_MAX_VANISHED = 8


class KernelLoadError(LoadError):
    """A spec's entry failed to load, was quarantined and rebuilt, and its rebuild failed to load too (``.spec``)."""

    def __init__(self, spec: KernelSpec, reason: str) -> None:
        self.spec = spec
        self.why = reason
        super().__init__(f"{spec.id}: cannot be loaded, even after rebuilding it: {reason}")


@dataclass(frozen=True)
class Artifact:
    """One spec as the cache knows it: its backend's description and that description's key (:func:`artifact`)."""

    spec: KernelSpec
    description: dict[str, Any]
    key: str

    def lookup(self, cache: KernelCache) -> Entry | None:
        """The verified entry in ``cache`` (root or layers), or None; never builds (see ``KernelCache.lookup``)."""
        return cache.lookup(self.key)

    def get_or_build(self, cache: KernelCache, timeout_s: float = 600.0,
                     on_wait: Callable[[Any], None] | None = None, *,
                     capture: Callable[[Path], None] | None = None, missed: bool = False) -> CacheResult:
        """Return the entry and how it was got: hit, built here, waited for, or downloaded.

        Under the key's lock the backend builds, or ``capture(staging)`` writes the files a run produced; then
        ``check`` loads them before the cache seals them. ``missed``: the caller just found nothing.

        Raises
        ------
        jitwarm.cache.BuildError
            The compile or the check failed; its cause is the backend's ``CompileError`` or ``LoadError``.
        jitwarm.cache.LockTimeout, jitwarm.cache.CacheError
            As ``KernelCache.get_or_build_ex`` raises them.

        """
        be = backend(self.spec.backend)

        def build(staging: Path) -> None:
            if capture is None:
                be.build(self.spec, staging, self.description)
            else:
                capture(staging)
            be.check(self.spec, staging)

        return cache.get_or_build_ex(self.description, build, timeout_s, on_wait, key=self.key, missed=missed)

    def reserve(self, cache: KernelCache, timeout_s: float = 600.0, *, missed: bool = False) -> Reservation:
        """The spec's entry (``result``), else its build reserved for files a run writes, then :meth:`publish`."""
        return cache.reserve(self.description, timeout_s, key=self.key, missed=missed)

    def publish(self, reservation: Reservation) -> Entry:
        """Check the files written into ``reservation.staging``, then seal and publish them; else ``BuildError``."""
        try:
            backend(self.spec.backend).check(self.spec, reservation.staging)
        except BaseException as exc:
            reservation.fail(exc)
        return reservation.publish()[0]

    def read(self, cache: KernelCache, entry: Entry, reader: Callable[[Entry], T], timeout_s: float = 600.0
             ) -> T | None:
        """Return ``reader(entry)`` run under the entry's claim (no prune deletes it meanwhile); None if it vanished."""
        with cache.claim(entry, timeout_s=timeout_s) as claimed:
            return None if claimed is None else reader(claimed)

    def load(self, cache: KernelCache, entry: Entry | None = None, timeout_s: float = 600.0, *,
             build: bool = True) -> LoadedKernel:
        """Load the spec's kernel from ``entry`` (or from the cache, building it if needed), under its claim.

        Unclaimed, a ``prune`` beside a starting hook removes the entry under the load. An entry that vanished
        is got again; one that fails to load is discarded and built again, once. ``build=False`` (strict) builds
        nothing.

        Raises
        ------
        KernelLoadError
            The rebuilt entry fails to load too (without ``build``: the entry fails to load, or is not there),
            or the entry kept vanishing before it could be claimed.

        """
        be = backend(self.spec.backend)
        rebuilt = False
        for _ in range(_MAX_VANISHED):
            if entry is None:
                entry = self.get_or_build(cache, timeout_s).entry if build else cache.lookup(self.key)
                if entry is None:
                    raise KernelLoadError(self.spec, "its entry is not in the cache, and strict mode builds nothing")
            try:
                kernel = self.read(cache, entry, lambda claimed: be.load(self.spec, claimed), timeout_s)
            except LoadError as exc:
                if rebuilt:
                    raise KernelLoadError(self.spec, f"its entry was quarantined and rebuilt once, and the rebuild "
                                                     f"does not load either: {exc}") from exc
                cache.discard(entry, f"{type(exc).__name__}: {exc}", timeout_s=timeout_s)
                if not build:
                    raise KernelLoadError(self.spec, f"its entry does not load ({exc}): quarantined; strict mode "
                                                     "builds nothing") from exc
                log.warning("jitwarm: %s: its cache entry does not load (%s): quarantined, rebuilding it",
                            self.spec.id, exc)
                kernel, rebuilt = None, True
            if kernel is not None:
                if rebuilt:
                    log.warning("jitwarm: %s: rebuilt; the rebuild loads", self.spec.id)
                return kernel
            entry = None  # discarded, or pruned, quarantined or replaced since it was looked up: get it again
        raise KernelLoadError(self.spec, f"its entry was removed {_MAX_VANISHED} times before it could be loaded "
                                         "(is a prune running in a loop?)")

    def to_json(self) -> dict[str, Any]:
        """What a build worker needs: the spec, its description and its key."""
        return {"spec": self.spec.to_json(), "description": self.description, "key": self.key}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Artifact:
        """Rebuild from :meth:`to_json` (the description and key as the parent computed them)."""
        return cls(KernelSpec.from_json(data["spec"]), data["description"], data["key"])


_lock = threading.Lock()
_memo: dict[KernelSpec, Artifact] = {}


def artifact(spec: KernelSpec, facts: Facts | None = None) -> Artifact:
    """Return ``spec``'s artifact, its description and key computed once per process (SpecError, ToolchainError).

    ``facts`` (the cache about to be used) keeps the backend's toolchain probes between processes.
    """
    found = _memo.get(spec)  # lock-free hit: a dict read is atomic under the GIL
    if found is not None:
        return found
    description = backend(spec.backend).description(spec, facts)
    made = Artifact(spec, description, key_of(description))
    with _lock:
        return _memo.setdefault(spec, made)

