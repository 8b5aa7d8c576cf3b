"""The backend every cache family shares: a captured unit as a spec, stored through the one path, restored by load.

A unit's spec: ``family`` the unit's path in the library's cache, ``backend`` the library's kind, ``target`` its
arch; params: its files' sha256s, the fingerprint the recording process saw, and the server it ran ``under``.
The description is content-addressed; ``build`` never happens (units are captured, :func:`store`); ``check``
refuses staged files that are not exactly the unit's digests; ``load`` restores (:func:`~.restore.place`).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jitwarm.kernels.backend import CompileError, LoadError, SpecError
from jitwarm.kernels.libraries.jit_caches.units import (
    Files,
    Library,
    canonical,
    dirs_under,
    files_problem,
    unit_folders,
)
from jitwarm.kernels.spec import KernelSpec

if TYPE_CHECKING:
    from jitwarm.kernels.libraries.jit_caches.restore import Placed

#: Layout of a captured unit's entry; part of every description.
FORMAT = "jitwarm-jit-cache/1"


def unit_spec(library: Library, unit: str, files: Files, fingerprint: Mapping[str, str], target: str,
              under: str = "") -> KernelSpec:
    """The spec of ``unit`` of ``library`` with these files (as stored) and this fingerprint."""
    return KernelSpec(unit, library.kind, target, {"files": canonical(files), "fingerprint": canonical(fingerprint),
                                                   "under": under})


def unit_of(library: Library, spec: KernelSpec) -> tuple[Files, dict[str, str], str]:
    """``(files, fingerprint, under)`` of a spec of ``library``; SpecError when its params are not a unit's."""
    params = spec.params_dict
    try:
        files = json.loads(str(params["files"]))
        fingerprint = json.loads(str(params["fingerprint"]))
    except (KeyError, ValueError) as exc:
        raise SpecError(f"{spec.id}: a {library.kind} spec carries its files and fingerprint as JSON: {exc}") from None
    under = str(params.get("under", ""))
    problem = files_problem(library, spec.family, files)
    if problem is None and not (isinstance(fingerprint, dict)
                                and all(isinstance(v, str) for v in fingerprint.values())):
        problem = "its fingerprint is not a {item: value} object of strings"
    if problem is None and under and not under.isidentifier():
        problem = f"it is restored under {under!r}, not a server room's name"
    if problem is not None:
        raise SpecError(f"{library.name} unit {spec.family}: {problem}")
    return files, fingerprint, under


def record_problem(kind: Any, record: Mapping[str, Any]) -> str | None:
    """Why ``record`` is not a well-formed ``jit_cache`` record of ``kind``'s library, or None."""
    missing = next((f for f in ("library", "unit", "target", "files", "fingerprint") if f not in record), None)
    if missing is not None:
        return f"a jit_cache record needs {missing!r}"
    problem = files_problem(kind.library(), record["unit"], record["files"])
    fingerprint = record["fingerprint"]
    if problem is None and not (isinstance(fingerprint, dict) and all(isinstance(k, str) and isinstance(v, str)
                                                                      for k, v in fingerprint.items())):
        problem = "its fingerprint is not an object of strings"
    return None if problem is None else f"jit_cache record of {record['library']} {record['unit']!r}: {problem}"


def spec_of(kind: Any, record: Mapping[str, Any]) -> KernelSpec:
    """The spec of a captured unit's record."""
    return unit_spec(kind.library(), record["unit"], record["files"], record["fingerprint"], record["target"],
                     str(record.get("under", "")))


def record_of(kind: Any, spec: KernelSpec) -> dict[str, Any]:
    """The ``jit_cache`` record body of a captured unit's spec."""
    params = spec.params_dict
    return {"kind": "jit_cache", "library": kind.family, "unit": spec.family, "target": spec.target,
            "files": json.loads(str(params["files"])), "fingerprint": json.loads(str(params["fingerprint"])),
            "under": str(params.get("under", ""))}


def description(library: Library, spec: KernelSpec) -> dict[str, Any]:
    """The cache description of a unit (see the module docstring)."""
    files, fingerprint, _ = unit_of(library, spec)
    return {"format": FORMAT, "library": library.name, "unit": spec.family, "files": files,
            "fingerprint": fingerprint}


def build(library: Library, spec: KernelSpec) -> None:
    """Refuse: a unit is captured from the run that compiled it, or imported in a bundle."""
    raise CompileError(f"{library.name} unit {spec.family}: captured from a run (jitwarm.precompile.record), never "
                       "built by jitwarm: import the bundle or cache it was stored in")


def check(library: Library, spec: KernelSpec, staging: Path) -> None:
    """The staged files are the unit's, each hashing to its digest; LoadError if not."""
    files, _, _ = unit_of(library, spec)
    found = sorted(p.relative_to(staging).as_posix() for p in staging.rglob("*") if p.is_file())
    if found != sorted(files):
        raise LoadError(f"{library.name} unit {spec.family}: the captured files are {found}, not {sorted(files)}")
    for rel, digest in files.items():
        if hashlib.sha256((staging / rel).read_bytes()).hexdigest() != digest:
            raise LoadError(f"{library.name} unit {spec.family}: {rel} changed while it was captured")


def load(library: Library, spec: KernelSpec, entry: Any) -> RestoredUnit:
    """Restore the unit of ``entry`` where this process's environment puts the library's cache under its server."""
    from jitwarm.kernels.libraries.jit_caches.restore import Placed, place

    files, _, under = unit_of(library, spec)
    root = library.root(None, dirs_under(under))
    placed = (Placed("disabled", Path()) if root is None
              else place(library.part(spec.family), spec.family, files, Path(entry.path), root))
    return RestoredUnit(spec, placed)


def mismatch(library: Library, spec: KernelSpec, target: str | None = None) -> tuple[str, str, str] | None:
    """The first fingerprint item of ``spec`` that differs on this node: ``(item, recorded, node)``, or None."""
    from jitwarm.kernels.libraries.jit_caches import fingerprint as fp

    _, recorded, _ = unit_of(library, spec)
    here = fp.node([item for item in recorded if item in fp.ITEMS], target)
    own = [item for item in recorded if item not in fp.ITEMS]
    if own and library.node_factors is not None:
        here.update(library.node_factors(own))
    return fp.differing(recorded, here)


def store(library: Library, root: Path, unit: str, files: tuple[str, ...], cache: Any, target: str | None = None,
          under: str = "") -> KernelSpec:
    """Store one complete unit of ``root`` as a jitwarm entry through the one path; return its spec.

    The files are hashed, then copied under the key's lock, where :func:`check` hashes them again: a unit that
    changed meanwhile is refused, never half-stored.

    Raises
    ------
    OSError
        A file of the unit vanished before it was hashed.
    jitwarm.cache.UntrustedPath
        A file or folder of the unit is another user's, writable by others, or a file has other hard links.
    jitwarm.cache.BuildError, jitwarm.cache.CacheError
        As ``Artifact.get_or_build`` raises them (the check refused the copy, a full disk).

    """
    from jitwarm.kernels.artifacts import artifact
    from jitwarm.kernels.libraries.jit_caches import fingerprint as fp

    check_source(root, files)
    rules = library.part(unit)  # vLLM's tree holds Inductor's and Triton's units: theirs are keyed by their rules
    digests = rules.digests(root, files)
    arch = (rules.arch_of(root, files) if rules.arch_of is not None else None) or fp.value("arch", target)
    values = {item: (arch if item == "arch" else fp.value(item, target)) for item in rules.items}
    if rules.factors_of is not None:
        values.update(rules.factors_of(root, files))
    spec = unit_spec(library, unit, digests, values, arch, under)

    def capture(staging: Path) -> None:
        for rel in files:
            dest = staging / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            if rules.normalize is None:
                shutil.copyfile(root / rel, dest)
            else:
                dest.write_bytes(rules.stored_bytes(root, rel))
            # who may read and run it, as the library left it: the seal keeps a private file private
            dest.chmod((root / rel).stat().st_mode & 0o555 | 0o600)

    artifact(spec, cache).get_or_build(cache, capture=capture)
    return spec


def check_source(root: Path, files: tuple[str, ...]) -> None:
    """UntrustedPath unless every file of a unit, and every folder from ``root`` down, is the server's own.

    Owned by this user or root, not writable by others, a file regular with no other hard link; unless
    ``JITWARM_ALLOW_SHARED=1`` (a unit another user planted would be restored on every node).
    """
    import stat

    from jitwarm.cache import settings
    from jitwarm.cache.errors import UntrustedPath
    from jitwarm.cache.files import HOW_TO_ALLOW, untrusted_reason

    if settings.allow_shared():
        return
    for path in [root, *(root / folder for folder in unit_folders(files)), *(root / rel for rel in files)]:
        st = path.lstat()
        reason = untrusted_reason(st)
        if reason is None and not stat.S_ISDIR(st.st_mode):
            reason = ("it is not a regular file" if not stat.S_ISREG(st.st_mode) else
                      f"it has {st.st_nlink - 1} other hard link(s), through which it can change" if st.st_nlink > 1
                      else None)
        if reason is not None:
            raise UntrustedPath(f"{path}: {reason}: not the server's own", HOW_TO_ALLOW)


@dataclass
class RestoredUnit:
    """A unit put where its library looks (a :class:`~jitwarm.kernels.backend.LoadedKernel`); the library loads it."""

    spec: KernelSpec
    placed: Placed

    def preload(self) -> int:
        """Nothing to put on a device: the library loads its own cache."""
        return 0

    def run(self, *args: Any) -> None:
        """The library runs its own kernels."""
        raise TypeError(f"{self.spec.family}: a restored {self.spec.backend} unit is run by its library, not jitwarm")
