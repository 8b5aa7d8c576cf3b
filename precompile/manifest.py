"""Manifests: the server's own JIT kernels as a run compiled them, one JSON record per line, as KernelSpecs.

A record says enough to build its kernel again elsewhere and to name it to a person:

``{"v": 1, "kind": "triton", "kernel": "pkg.mod:qualname", "target": "sm_90", "triton": "3.8.0",
"specialization": <Triton's own specialization data, a JSON string>, "name": <Triton's repr>}``

``{"v": 1, "kind": "sglang_jit", "module": <load_jit's module name>, "target": "sm_90", "sglang": "0.5.23",
"call": {"args": [...], "cpp_files": [...], ...}}``

Appends are safe with many ranks writing one manifest: each append takes an exclusive ``flock`` on the file,
reads what is there and adds only records it lacks, so a manifest holds each record once. Reading bounds the
file's size and each line's, and a malformed line is an error naming its line number. Pure Python.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import stat
from collections.abc import Iterable, Mapping
from typing import Any

from jitwarm.kernels import KernelSpec

VERSION = 1
KINDS = {"triton": "triton_jit", "sglang_jit": "sglang_jit"}  # record kind -> kernel backend
MAX_MANIFEST_BYTES = 64 << 20
MAX_LINE_BYTES = 4 << 20


class ManifestError(ValueError):
    """A manifest that cannot be read or holds a record that is not one; the message names file and line."""


def record_id(record: Mapping[str, Any]) -> str:
    """A record's identity: the sha256 of its canonical JSON (what dedupe compares)."""
    return hashlib.sha256(json.dumps(record, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def check_record(record: Any, where: str = "record") -> dict[str, Any]:
    """Return ``record`` if it is a well-formed record of a known kind, else raise ManifestError naming ``where``."""
    if not isinstance(record, dict) or record.get("v") != VERSION or record.get("kind") not in KINDS:
        raise ManifestError(f"{where}: not a jitwarm manifest record (v {VERSION}, kind triton or sglang_jit)")
    need = {"triton": ("kernel", "target", "specialization"), "sglang_jit": ("module", "target", "call")}
    for field in need[record["kind"]]:
        if field not in record:
            raise ManifestError(f"{where}: a {record['kind']} record needs {field!r}")
    if not isinstance(record["target"], str):
        raise ManifestError(f"{where}: target must be a string such as 'sm_90'")
    if record["kind"] == "triton" and not (isinstance(record["kernel"], str) and ":" in record["kernel"]
                                           and isinstance(record["specialization"], str)):
        raise ManifestError(f"{where}: a triton record names its kernel as 'module:qualname' and carries Triton's "
                            "specialization data as a string")
    if record["kind"] == "sglang_jit" and not (isinstance(record["module"], str) and isinstance(record["call"], dict)):
        raise ManifestError(f"{where}: an sglang_jit record names its module and carries the load_jit call")
    return record


def read_manifest(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Return the records of a manifest file, each once, in first-seen order.

    Raises
    ------
    ManifestError
        The file is missing, not a regular file, too large, not UTF-8 JSON lines, or holds a bad record.

    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO must not make a reader wait for a writer
    except OSError as exc:
        raise ManifestError(f"cannot read manifest {path}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ManifestError(f"manifest {path} is not a regular file")
        if st.st_size > MAX_MANIFEST_BYTES:
            raise ManifestError(f"manifest {path} is larger than {MAX_MANIFEST_BYTES >> 20} MiB")
        return _parse(f.read(MAX_MANIFEST_BYTES + 1), str(path))


def _parse(data: bytes, where: str) -> list[dict[str, Any]]:
    records: dict[str, dict[str, Any]] = {}
    for number, line in enumerate(data.splitlines(), 1):
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
    return list(records.values())


def append_records(path: str | os.PathLike[str], records: Iterable[Mapping[str, Any]]) -> int:
    """Add the records the manifest at ``path`` lacks (creating it); return how many were added.

    Safe with many processes appending at once: the read and the write happen under an exclusive flock of
    the file, and the lines are written with one ``write`` in append mode.
    """
    new = [check_record(dict(r)) for r in records]
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    with os.fdopen(fd, "r+b") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ManifestError(f"manifest {path} is not a regular file")
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            f.seek(0)
            known = {record_id(r) for r in _parse(f.read(MAX_MANIFEST_BYTES + 1), str(path))}
            lines = []
            for record in new:
                rid = record_id(record)
                if rid not in known:
                    known.add(rid)
                    lines.append(json.dumps(record, sort_keys=True) + "\n")
            if lines:
                os.write(fd, "".join(lines).encode())
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    return len(lines)


def spec_of(record: Mapping[str, Any]) -> KernelSpec:
    """The KernelSpec that builds a record's kernel (its backend reads everything it needs from the params)."""
    if record["kind"] == "triton":
        return KernelSpec(record["kernel"], "triton_jit", record["target"],
                          {"specialization": record["specialization"]})
    call = json.dumps(record["call"], sort_keys=True, separators=(",", ":"))
    params = {"call": call, "sglang": str(record.get("sglang", ""))}
    arch = record.get("arch")
    if isinstance(arch, dict):  # sglang's full target with its suffix, "9.0a" (ArchInfo.target_name, utils/arch.py:33)
        params["arch"] = f"{arch.get('major')}.{arch.get('minor')}{arch.get('suffix') or ''}"
    return KernelSpec(record["module"], "sglang_jit", record["target"], params)


def specs_of(records: Iterable[Mapping[str, Any]], targets: Iterable[str] | None = None
             ) -> tuple[tuple[KernelSpec, ...], int]:
    """The specs of manifest records, each once, and how many records ``targets`` left out.

    A record is planned for the target it was recorded on: Triton's specialization data and load_jit's build
    are the arch's own, so ``--target`` selects records (an H200's records are ``sm_90``), it does not
    retarget them.
    """
    wanted = set(targets) if targets is not None else None
    specs: dict[KernelSpec, None] = {}
    skipped = 0
    for record in records:
        if wanted is not None and record["target"] not in wanted:
            skipped += 1
            continue
        specs.setdefault(spec_of(record), None)
    return tuple(specs), skipped

