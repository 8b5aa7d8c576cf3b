"""Record the server's own JIT kernels as a run compiles them (Triton, load_jit) and the cache units it adds."""

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
from jitwarm.cache.settings import SettingError
from jitwarm.kernels.libraries.jit_caches import MODULES
from jitwarm.kernels.libraries.jit_caches.backend import store
from jitwarm.kernels.libraries.jit_caches.census import added, snapshot
from jitwarm.precompile import servers
from jitwarm.precompile.manifest import VERSION, append_records, record_id, unit_record

if TYPE_CHECKING:
    from jitwarm.kernels.libraries.jit_caches.units import Dirs

log = logging.getLogger("jitwarm.record")

#: The taps a recording subscribes to, each room's ``TAP`` and ``recording(add)``: Triton's, sglang's loader.
RECORDED = ("jitwarm.kernels.libraries.triton.tap", "jitwarm.precompile.servers.sglang.loader")


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
        #: The server this process runs in, decided before the recorder imports anything of sglang's itself.
        self.under = ""
        self._dirs: Dirs = {}  # where the server this runs in keeps each library's cache (:meth:`start`)

    def add(self, record: Mapping[str, Any], *, kernel: bool = True) -> None:
        """Append ``record`` unless recorded already (one refused is tried again); never raises."""
        rid = record_id(record)
        with self._lock:
            if rid in self._seen:
                return
        try:
            added = append_records(self.path, [record])
        except (OSError, ValueError) as exc:  # ManifestError is a ValueError: an untrusted or bad manifest
            log.warning("jitwarm: cannot record %s into %s: %s", record.get("kernel") or record.get("module"),
                        self.path, exc)
            return
        with self._lock:
            self._seen.add(rid)
            if kernel:
                self.recorded += added

    def start(self) -> Recorder:
        """Subscribe to the taps of :data:`RECORDED`, list the JIT caches (the server is taken first)."""
        self.under = servers.running()
        self._dirs = servers.cache_dirs(self.under)  # where this server keeps each library's cache
        for name in RECORDED:  # each tap's room turns what it sees into records
            room = importlib.import_module(name)
            undo = room.TAP.attach(room.recording(lambda body: self.add({"v": VERSION, **body})))
            if undo is not None:
                self._undo.append(undo)
        self._before = snapshot(_families(), dirs=self._dirs)
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
            # a library whose compiles go elsewhere here (Triton's, through jitwarm's manager) has none to capture
            names = [n for n, taken in self._before.items() if not taken.library.bypassed()]
            after = snapshot(names, dirs=self._dirs)
            under = self.under  # where the restore resolves each cache: as this server does
            records, failed = [], set()
            for name, units in added(self._before, after).items():
                snap = after[name]
                for unit, files in units.items():
                    self._cache = self._cache or KernelCache()  # opened on first use
                    try:
                        spec = store(snap.library, snap.root, unit, files, self._cache, under=under)
                    except Exception as exc:  # noqa: BLE001 - a recording is a side job: the run goes on
                        log.warning("jitwarm: cannot capture %s unit %s from %s: %s", name, unit, snap.root,
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
        for rec in records:
            self.add(rec, kernel=False)
        return len(records)

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _families() -> list[str]:
    """The cache families ``JITWARM_RECORD_CACHES`` asks for (all by default); an unknown name is said, skipped."""
    try:
        asked = settings.record_caches()
    except SettingError as exc:
        log.warning("jitwarm: %s: capturing every JIT cache family", exc)
        return list(MODULES)
    for name in (n for n in asked or () if n not in MODULES):
        log.warning("jitwarm: JITWARM_RECORD_CACHES names %r, not a JIT cache family (%s): skipped", name,
                    ", ".join(MODULES))
    return list(MODULES) if asked is None else [name for name in MODULES if name in asked]


def record(path: str | Path, cache: Any = None) -> Recorder:
    """Start recording every JIT kernel this process compiles into ``path``; units are stored in ``cache`` at stop."""
    return Recorder(path, cache).start()
