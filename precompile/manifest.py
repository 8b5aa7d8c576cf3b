"""Manifests: the server's own JIT kernels as a run compiled them, one JSON record per line.

Kinds: ``triton`` (``kernel``, ``specialization``), ``sglang_jit`` (``module``, ``call``) and ``jit_cache``
(a JIT library's cache unit: ``library``, ``unit``, ``files``, ``fingerprint``, ``under``), each with ``target``;
and one ``capture`` record (``server``, ``environment``: the plugin variable as ``jitwarm capture`` set it), no kernel.
Ranks append under the file's own flock, each record once. A manifest is code (replay imports it): trusted only
from this user or root. A torn last line is ignored, said once, and cut off by the next append. The recorder
(:mod:`jitwarm.precompile.recorder`) appends what a run compiles and stores the JIT cache units it adds.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import stat
from collections.abc import Iterable, Mapping
from typing import Any

from filelock import FileLock

from jitwarm.cache import settings
from jitwarm.cache.errors import UsageError
from jitwarm.cache.files import read_file_stat, untrusted_reason
from jitwarm.kernels import KernelSpec, kinds
from jitwarm.precompile import servers

log = logging.getLogger("jitwarm.manifest")

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
