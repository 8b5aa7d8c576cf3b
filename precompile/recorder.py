"""The recorder: what a run compiles (Triton, ``load_jit``) appended to a manifest, the JIT cache units it adds stored.

:func:`record` starts one; :meth:`Recorder.stop` (or leaving its ``with`` block) ends it. The records and their
file are :mod:`jitwarm.precompile.manifest`'s.
"""

from __future__ import annotations

import atexit
import importlib
import logging
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jitwarm.cache import KernelCache, settings
from jitwarm.cache.errors import UntrustedPath
from jitwarm.kernels import KernelSpec, kinds
from jitwarm.kernels.libraries.jit_caches.backend import store as store_unit
from jitwarm.kernels.libraries.jit_caches.census import added, snapshot
from jitwarm.precompile import servers
from jitwarm.precompile.manifest import VERSION, append_records, record_id, spec_of, unit_record

if TYPE_CHECKING:
    from jitwarm.kernels.libraries.jit_caches.units import Dirs

_record_log = logging.getLogger("jitwarm.record")


def recorded_taps() -> tuple[str, ...]:
    """The modules whose ``TAP`` and ``recording(add)`` a recording subscribes to: each kind's, each server's own.

    Triton's (the ``triton_jit`` kind's records module) and sglang's loader (its room's ``TAP``). A tap module's
    ``LOADER``, where it has one, is the module whose import makes its tap live (subscribed then).
    """
    rooms = (servers.adapter(name).TAP for name in servers.ROOMS)
    return tuple(k.records for k in kinds.KINDS if k.tap) + tuple(tap for tap in rooms if tap)


class Recorder:
    """An active recording into one manifest; :meth:`stop` (or leaving the ``with`` block) ends it."""

    def __init__(self, path: str | Path, cache: Any = None) -> None:
        self.path = Path(path)
        self.recorded = 0
        #: Units stored from the JIT libraries' caches, per library name.
        self.captured: dict[str, int] = {}
        self._cache = cache
        self._seen: set[str] = set()
        self._lock = threading.Lock()
        self._undo: list[Callable[[], None]] = []
        self._before: dict[str, Any] = {}
        self._capturing = threading.Lock()
        #: The server this process runs in (``servers.running()``), taken again at each :meth:`capture`.
        self.under = ""
        self._dirs: Dirs = {}  # where the server this runs in keeps each library's cache (:meth:`start`)
        self._ahead: dict[str, dict[str, Any]] = {}  # each server's caches at start, should it be imported later
        self._stored: set[str] = set()  # the records whose build is stored

    def add(self, record: Mapping[str, Any], *, kernel: bool = True,
            store: Callable[[Any, KernelSpec], None] | None = None) -> None:
        """Append ``record`` unless recorded already (one refused is tried again); never raises (but see below).

        ``store(cache, spec)``: the library's build of the record is there to store now (once per record); a
        failure is said, and raised only for a file another user planted, under ``JITWARM_STRICT=1``.
        """
        rid = record_id(record)
        with self._lock:
            seen = rid in self._seen
        if not seen:
            try:
                added = append_records(self.path, [record])
            except (OSError, ValueError) as exc:  # ManifestError is a ValueError: an untrusted or bad manifest
                _record_log.warning("jitwarm: cannot record %s into %s: %s", _named(record), self.path, exc)
                return
            with self._lock:
                self._seen.add(rid)
                if kernel:
                    self.recorded += added
        if store is not None and rid not in self._stored:
            self._store_build(rid, record, store)

    def _store_build(self, rid: str, record: Mapping[str, Any], store: Callable[[Any, KernelSpec], None]) -> None:
        """Store the build a library published for ``record``, as capture's check wants every record stored."""
        try:
            if self._cache is None:  # opened on first use; a bad setting is this build's failure
                self._cache = KernelCache()
            store(self._cache, spec_of(record))
        except Exception as exc:  # noqa: BLE001 - a recording is a side job: the run goes on
            _record_log.warning("jitwarm: cannot capture the build of %s: %s", _named(record),
                                str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            if isinstance(exc, UntrustedPath) and settings.is_strict():
                raise  # a file another user planted, under JITWARM_STRICT=1: the start stops
            return
        with self._lock:
            self._stored.add(rid)

    def start(self) -> Recorder:
        """Subscribe to the taps of :func:`recorded_taps` (a library not imported yet: when it is); list the JIT caches.

        The server this runs in is taken now and again at each :meth:`capture`: one imported after the start
        (sglang redirects the caches under ``SGLANG_CACHE_DIR``, srt/environ.py:2308-2336) is found there.
        """
        self.under = servers.running()
        self._dirs = servers.cache_dirs(self.under)  # where this server keeps each library's cache
        for name in recorded_taps():  # each tap's room turns what it sees into records
            room = importlib.import_module(name)
            subscriber = room.recording(lambda body, **more: self.add({"v": VERSION, **body}, **more))
            module = getattr(room, "LOADER", None)
            undo = room.TAP.attach(subscriber) if module is None else room.TAP.attach_when_imported(subscriber, module)
            if undo is not None:
                self._undo.append(undo)
        families = _families()
        self._before = snapshot(families, dirs=self._dirs)
        if not self.under:  # where each server would keep them: a baseline, should it be imported later
            self._ahead = {room: snapshot(families, dirs=servers.cache_dirs(room)) for room in servers.ROOMS}
        atexit.register(self.capture)
        self._undo.append(lambda: atexit.unregister(self.capture))
        return self

    def stop(self) -> None:
        """Capture the JIT caches' new units (:meth:`capture`), then remove what :meth:`start` installed."""
        self.capture()
        while self._undo:
            self._undo.pop()()

    def capture(self) -> int:
        """Store the units the JIT caches gained since the last capture; return how many; never raises."""
        with self._capturing:
            if not self._before:
                return 0
            under = servers.running()
            if under == self.under:
                records = self._capture_new(self._dirs)
            else:  # the server was imported since: first what went where the caches were, then where it moved them
                records = self._capture_new({name: taken.root for name, taken in self._before.items()})
                self.under, self._dirs = under, servers.cache_dirs(under)
                for name, taken in self._ahead.get(under, {}).items():
                    if taken.root != self._before[name].root:
                        self._before[name] = taken  # its units at start, where this server keeps them
                records += self._capture_new(self._dirs)
        for rec in records:
            self.add(rec, kernel=False)
        return len(records)

    def _capture_new(self, dirs: Dirs) -> list[dict[str, Any]]:
        """Store the units the caches (in ``dirs``) gained since :attr:`_before`, the new baseline; their records."""
        # a library whose compiles go elsewhere here (Triton's, through jitwarm's manager) has none to capture
        names = [n for n, taken in self._before.items() if not taken.library.bypassed()]
        after = snapshot(names, dirs=dirs)
        under = self.under  # where the restore resolves each cache: as this server does
        records, failed = [], set()
        for name, units in added(self._before, after).items():
            snap = after[name]
            for unit, files in units.items():
                try:
                    if self._cache is None:  # opened on first use; a bad setting is this unit's failure
                        self._cache = KernelCache()
                    spec = store_unit(snap.library, snap.root, unit, files, self._cache, under=under)
                except Exception as exc:  # noqa: BLE001 - a recording is a side job: the run goes on
                    _record_log.warning("jitwarm: cannot capture %s unit %s from %s: %s", name, unit, snap.root,
                                        str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
                    if isinstance(exc, UntrustedPath) and settings.is_strict():
                        raise  # a file another user planted, under JITWARM_STRICT=1: the start stops
                    failed.add((name, unit))
                    continue
                records.append(unit_record(spec))
                self.captured[name] = self.captured.get(name, 0) + 1
        for name, snap in after.items():  # what was stored is the new baseline; a failed unit stays new
            self._before[name] = snap._replace(units={u: f for u, f in snap.units.items()
                                                      if (name, u) not in failed})
        return records

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _families() -> list[str]:
    """The cache families ``JITWARM_RECORD_CACHES`` asks for (all by default); an unknown name is said, skipped."""
    every = [k.family for k in kinds.caches()]
    try:
        asked = settings.record_caches()
    except settings.SettingError as exc:
        _record_log.warning("jitwarm: %s: capturing every JIT cache family", exc)
        return every
    for name in (n for n in asked or () if n not in every):
        _record_log.warning("jitwarm: JITWARM_RECORD_CACHES names %r, not a JIT cache family (%s): skipped", name,
                            ", ".join(every))
    return every if asked is None else [name for name in every if name in asked]


def _named(record: Mapping[str, Any]) -> str:
    return record.get("kernel") or record.get("module") or f"{record.get('library')} unit {record.get('unit')}"


def record(path: str | Path, cache: Any = None) -> Recorder:
    """Start recording every JIT kernel this process compiles into ``path``, until :meth:`Recorder.stop`.

    Every Triton specialization and sglang ``load_jit`` call, whether its library is imported before or after
    this call (a ``load_jit`` build is stored in ``cache`` as it is published or found); the JIT cache units
    the process adds are stored at each :meth:`Recorder.capture` and at stop, under the server imported by then.
    """
    return Recorder(path, cache).start()
