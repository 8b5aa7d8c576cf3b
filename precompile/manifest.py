"""Manifests: the server's own JIT kernels as a run compiled them, one JSON record per line, and their recorder.

Kinds: ``triton`` (``kernel``, ``specialization``), ``sglang_jit`` (``module``, ``call``) and ``jit_cache``
(a JIT library's cache unit: ``library``, ``unit``, ``files``, ``fingerprint``, ``under``), each with ``target``;
and one ``capture`` record (``server``, ``environment``: the plugin variable as ``jitwarm capture`` set it), no kernel.
Ranks append under the file's own flock, each record once. A manifest is code (replay imports it): trusted only
from this user or root. A torn last line is ignored, said once, and cut off by the next append. A
:class:`Recorder` appends what a run compiles (Triton, load_jit) and stores the JIT cache units it adds.
"""

from __future__ import annotations

import atexit
import errno
import hashlib
import importlib
import json
import logging
import os
import stat
import threading
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from filelock import FileLock

from jitwarm.cache import KernelCache, settings
from jitwarm.cache.errors import UntrustedPath, UsageError
from jitwarm.cache.files import read_file_stat, untrusted_reason
from jitwarm.kernels import KernelSpec, kinds
from jitwarm.kernels.libraries.jit_caches.backend import store
from jitwarm.kernels.libraries.jit_caches.census import added, snapshot
from jitwarm.precompile import servers

if TYPE_CHECKING:
    from jitwarm.kernels.libraries.jit_caches.units import Dirs

log = logging.getLogger("jitwarm.manifest")
_record_log = logging.getLogger("jitwarm.record")

VERSION = 1
#: The record kind naming how ``jitwarm capture`` ran the server: no kernel. Every other record kind is a kind's
#: (:func:`jitwarm.kernels.kinds.record_kinds`: ``triton``, ``sglang_jit``, ``jit_cache``).
CAPTURE = "capture"
MAX_MANIFEST_BYTES = 64 << 20
MAX_LINE_BYTES = 4 << 20
#: How long an append waits for another one holding the manifest's lock (an append takes milliseconds).
LOCK_TIMEOUT_S = 60.0


class ManifestError(UsageError, ValueError):
    """A manifest that cannot be read, is not trusted, or holds a record that is not one (exit 2, naming the line)."""


_said_torn: set[tuple[str, int]] = set()  # (path, size) of each torn manifest already reported in this process


def record_id(record: Mapping[str, Any]) -> str:
    """A record's identity: the sha256 of its canonical JSON (what dedupe compares)."""
    return hashlib.sha256(json.dumps(record, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def check_record(record: Any, where: str = "record") -> dict[str, Any]:
    """Return ``record`` if it is a well-formed record of a known kind, else raise ManifestError naming ``where``."""
    known = (*kinds.record_kinds(), CAPTURE)
    # type() is int, not ==: True == 1 and 1.0 == 1, and a bool is not a version.
    if not isinstance(record, dict) or type(record.get("v")) is not int or record["v"] != VERSION \
            or not isinstance(record.get("kind"), str) or record["kind"] not in known:  # a list is unhashable
        raise ManifestError(f"{where}: not a jitwarm manifest record (v {VERSION}, kind {', '.join(known)})")
    if record["kind"] == CAPTURE:
        for field in ("server", "environment"):
            if field not in record:
                raise ManifestError(f"{where}: a capture record needs {field!r}")
        environment = record["environment"]
        if record["server"] not in servers.ROOMS or not (isinstance(environment, dict) and all(
                isinstance(k, str) and isinstance(v, str) for k, v in environment.items())):
            raise ManifestError(f"{where}: a capture record names its server ({', '.join(servers.ROOMS)}) and "
                                "its environment as an object of strings")
        return record
    if "target" in record and not isinstance(record["target"], str):
        raise ManifestError(f"{where}: target must be a string such as 'sm_90'")
    kind = kind_of(record, where)
    problem = kind.record_problem(record)
    if problem is None and record.get("under", "") not in ("", *servers.ROOMS):
        problem = (f"{record['kind']} record of {record.get('library')} {record.get('unit')!r}: its 'under' is none "
                   f"of '', {', '.join(repr(room) for room in servers.ROOMS)}")
    if problem is not None:
        raise ManifestError(f"{where}: {problem}")
    return record


def kind_of(record: Mapping[str, Any], where: str = "record") -> kinds.Kind:
    """The kind a record names: the one of its record kind, or (``jit_cache``) its ``library``'s; ManifestError."""
    named = kinds.recorded_as(record["kind"])
    if len(named) == 1:
        return named[0]
    found = next((k for k in named if k.family == record.get("library")), None)
    if found is None:
        raise ManifestError(f"{where}: a {record['kind']} record names its library, one of "
                            f"{', '.join(k.family for k in named)}")
    return found


def unit_record(spec: KernelSpec) -> dict[str, Any]:
    """The manifest record of a recorded spec (a captured unit's: :func:`jit_caches.backend.store`)."""
    return {"v": VERSION, **kinds.kind(spec.backend).record_of(spec)}


def read_manifest(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Return a manifest's records, each once, in order (a torn last line left out); ManifestError when it cannot."""
    try:
        # a link the operator gave is followed (a ConfigMap is one); a directory or /proc/self/mem is one line
        data, st = read_file_stat(os.path.realpath(path), MAX_MANIFEST_BYTES)
    except OSError as exc:
        raise ManifestError(f"cannot read manifest {path}: {exc.strerror or exc}") from None
    check_trusted(path, st)
    records, torn = _parse(data, str(path))
    if torn and not records:  # nothing to warn past: one line, not a warning and then "the plan is empty"
        raise ManifestError(f"manifest {path} holds no complete record: its only line is torn (an append cut "
                            "short) or not a record")
    if torn and (str(path), len(data)) not in _said_torn:
        _said_torn.add((str(path), len(data)))
        log.warning("jitwarm: warning: manifest %s: its last line is torn (an append cut short by a full disk or a "
                    "kill): ignored; the next append removes it", path)
    return records


def check_trusted(path: str | os.PathLike[str], st: os.stat_result) -> None:
    """Refuse a manifest another user owns or can write (its records name modules that replay imports)."""
    reason = untrusted_reason(st)
    if reason is not None and not settings.allow_shared():
        raise ManifestError(f"refusing manifest {path}: {reason} (replaying it imports the modules it names)",
                            "set JITWARM_ALLOW_SHARED=1 to accept it")


def _parse(data: bytes, where: str) -> tuple[list[dict[str, Any]], bool]:
    """The records of ``data``, and whether its last line was torn (no newline, not a record: ignored)."""
    lines = data.split(b"\n")
    torn = False  # the tail after the last newline is b"" unless an append was cut short
    if lines[-1].strip():
        try:
            check_record(json.loads(lines[-1]))  # a whole record without its newline (written by hand): kept
        except (ValueError, RecursionError):
            lines.pop()
            torn = True
    records: dict[str, dict[str, Any]] = {}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if len(line) > MAX_LINE_BYTES:
            raise ManifestError(f"{where}:{number}: a line of more than {MAX_LINE_BYTES >> 20} MiB")
        try:
            record = json.loads(line)
        except (ValueError, RecursionError) as exc:
            raise ManifestError(f"{where}:{number}: not JSON ({str(exc).splitlines()[0]})") from None
        record = check_record(record, f"{where}:{number}")
        records.setdefault(record_id(record), record)
    return list(records.values()), torn


def append_records(path: str | os.PathLike[str], records: Iterable[Mapping[str, Any]]) -> int:
    """Add the records the manifest at ``path`` lacks (creating it), under the file's own lock; return how many.

    A torn last line is cut off first; a failed write is undone and raised (OSError). ManifestError: not a regular
    file, not trusted, a bad record, or replaced while opened; ``filelock.Timeout`` past :data:`LOCK_TIMEOUT_S`.
    """
    new = [check_record(dict(r)) for r in records]
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ManifestError(f"manifest {path} is not a regular file")
        check_trusted(path, st)
        # The manifest is its own lock file, never removed (preserve_lock_file); filelock opens the path again,
        # so the file it locked must be the one ``fd`` holds.
        lock = FileLock(os.fspath(path), thread_local=False, preserve_lock_file=True)
        with lock.acquire(timeout=LOCK_TIMEOUT_S):
            locked = os.lstat(path)
            if (locked.st_dev, locked.st_ino) != (st.st_dev, st.st_ino):
                raise ManifestError(f"manifest {path} was replaced while it was opened")
            data = os.pread(fd, min(os.fstat(fd).st_size, MAX_MANIFEST_BYTES) + 1, 0)  # a regular file: all of it
            if len(data) > MAX_MANIFEST_BYTES:
                raise ManifestError(f"manifest {path} is larger than {MAX_MANIFEST_BYTES >> 20} MiB")
            known, torn = _parse(data, str(path))
            end = data.rindex(b"\n") + 1 if torn and b"\n" in data else 0 if torn else len(data)
            if torn:
                os.ftruncate(fd, end)  # the torn line goes; O_APPEND then writes from the new end
            known_ids = {record_id(r) for r in known}
            fresh = {rid: r for r in new if (rid := record_id(r)) not in known_ids}  # each once, first-seen order
            lines = [json.dumps(r, sort_keys=True) + "\n" for r in fresh.values()]
            if lines:
                lead = "\n" if data[:end] and not data[:end].endswith(b"\n") else ""  # a last record without "\n"
                _write_all(fd, (lead + "".join(lines)).encode(), end)
            return len(lines)
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes, end: int) -> None:
    """Write all of ``data`` at the end of the file; on failure cut the file back to ``end`` and raise."""
    view = memoryview(data)
    try:
        while view:
            written = os.write(fd, view)  # short on a full disk: the rest then fails with ENOSPC
            if written <= 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            view = view[written:]
    except OSError:
        os.ftruncate(fd, end)  # shrinking needs no space: no torn line is left behind
        raise


def capture_record(server: str, environment: Mapping[str, str]) -> dict[str, Any]:
    """The record ``jitwarm capture`` adds last: the server it ran and the plugin variable as it set it."""
    return check_record({"v": VERSION, "kind": CAPTURE, "server": server, "environment": dict(environment)})


def capture_of(records: Iterable[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The ``capture`` record of a manifest's records (how its start ran), or None for a recording made otherwise."""
    return next((r for r in records if r["kind"] == CAPTURE), None)


def spec_of(record: Mapping[str, Any]) -> KernelSpec:
    """The KernelSpec that builds a record's kernel (its backend reads everything it needs from the params)."""
    return kind_of(record).spec_of(record)


def specs_of(records: Iterable[Mapping[str, Any]], targets: Iterable[str] | None = None
             ) -> tuple[tuple[KernelSpec, ...], int]:
    """The specs of manifest records, each once, and how many records ``targets`` left out (it never retargets)."""
    records, wanted = [r for r in records if r["kind"] != CAPTURE], None if targets is None else set(targets)
    kept = [r for r in records if wanted is None or r["target"] in wanted]
    return tuple(dict.fromkeys(spec_of(r) for r in kept)), len(records) - len(kept)


# -- the recorder ---------------------------------------------------------------------------------------

def recorded_taps() -> tuple[str, ...]:
    """The modules whose ``TAP`` and ``recording(add)`` a recording subscribes to: each kind's, each server's own.

    Triton's (the ``triton_jit`` kind's records module) and sglang's loader (its room's ``TAP``).
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
            what = record.get("kernel") or record.get("module") or f"{record.get('library')} unit {record.get('unit')}"
            _record_log.warning("jitwarm: cannot record %s into %s: %s", what, self.path, exc)
            return
        with self._lock:
            self._seen.add(rid)
            if kernel:
                self.recorded += added

    def start(self) -> Recorder:
        """Subscribe to the taps of :func:`recorded_taps`, list the JIT caches (the server is taken first)."""
        self.under = servers.running()
        self._dirs = servers.cache_dirs(self.under)  # where this server keeps each library's cache
        for name in recorded_taps():  # each tap's room turns what it sees into records
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
                    try:
                        if self._cache is None:  # opened on first use; a bad setting is this unit's failure
                            self._cache = KernelCache()
                        spec = store(snap.library, snap.root, unit, files, self._cache, under=under)
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
        for rec in records:
            self.add(rec, kernel=False)
        return len(records)

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


def record(path: str | Path, cache: Any = None) -> Recorder:
    """Start recording every JIT kernel this process compiles into ``path``; units are stored in ``cache`` at stop."""
    return Recorder(path, cache).start()
