"""A JIT library's cache as a directory of units: where it lives, which file groups are complete, their digests.

A unit is a group of files one compile writes (Triton's key directory, DeepGEMM's ``kernel.<name>.<hash>/``),
named by its path under the cache root, the library's own key: what ``units(root)`` lists after a run, minus
what it listed before, is what the run compiled. jitwarm never reads the files' meaning.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import stat
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from jitwarm.cache.entry import is_safe_relpath

#: A unit's files: paths relative to the cache root -> their stored bytes' sha256.
Files = dict[str, str]
_SHA = re.compile(r"[0-9a-f]{64}")
#: Where a server keeps the libraries' caches (library -> directory, None: off); one left out is where the
#: library's own variables put it. The kernels layer names no server: a redirect reaches it only as this.
Dirs = Mapping[str, Path | None]
#: A directory's complete units: unit -> its files, relative to the directory.
Units = dict[str, tuple[str, ...]]


@dataclass(frozen=True)
class Library:
    """One JIT library's cache directory: the contract each family's module fills.

    ``resolve(environ)`` is the directory the library's own variables give (None: off, or only a server keeps
    it); ``units(root)`` the complete units, ``{unit: files relative to root}``; ``items`` the fingerprint items
    its key depends on. ``unit_is_dir``: a unit is ``root/unit/``, restored by one rename. ``is_commit(rel)``:
    the commit record, restored last. ``normalize``/``localize`` rewrite a file when captured and restored
    (Triton's group files' paths). ``arch_of`` reads the arch from the unit; ``settle`` runs after a restore
    (FlashInfer's ninja times); ``factors_of``/``node_factors`` give the library's own key factors (vLLM's);
    ``parts(unit)`` the library whose rules a unit follows (vLLM's tree holds Inductor's); ``signal()`` its own
    hit signal for the ledger (None: new units count); ``bypassed()``: its compiles go elsewhere here;
    ``beside(environ)``: ``(directory, its units)`` the library fills outside ``root`` whatever its variables say,
    named as under ``root``, which the ledger counts (Inductor's precompiled headers: codecache.py ``_HEADER_DIR``);
    ``rewrites(files)``: a unit the library writes again at a start that compiles nothing, so that a unit written
    is no compile where a hit or a graph its cache does not take accounts for it (Inductor's Python wrapper).

    Failure semantics: ``resolve``, ``is_commit``, ``arch_of``, ``factors_of``, ``node_factors``, ``signal``,
    ``bypassed``, ``beside`` and ``rewrites`` never raise; ``units`` and ``settle`` may raise ``OSError``;
    ``normalize`` and ``localize`` may raise ``ValueError``, ``KeyError``, ``TypeError`` or ``AttributeError`` for
    a file not in the library's format (a restore turns that into ``LoadError``, which quarantines the entry). None
    runs under a jitwarm lock; a restore calls ``localize`` and ``settle`` under the entry's claim.
    """

    name: str
    kind: str
    resolve: Callable[[Mapping[str, str]], Path | None]
    units: Callable[[Path], dict[str, tuple[str, ...]]]
    items: tuple[str, ...]
    unit_is_dir: bool = True
    is_commit: Callable[[str], bool] = lambda rel: False
    normalize: Callable[[str, bytes], bytes] | None = None
    localize: Callable[[str, bytes, Path], bytes] | None = None
    arch_of: Callable[[Path, tuple[str, ...]], str | None] | None = None
    settle: Callable[[Path, str, tuple[str, ...]], None] | None = None
    factors_of: Callable[[Path, tuple[str, ...]], dict[str, str]] | None = None
    node_factors: Callable[[Iterable[str]], dict[str, str]] | None = None
    parts: Callable[[str], Library] | None = None
    signal: Callable[[], Signal] | None = None
    bypassed: Callable[[], bool] = lambda: False
    beside: Callable[[Mapping[str, str]], tuple[Path, Callable[[Path], Units]] | None] | None = None
    rewrites: Callable[[tuple[str, ...]], bool] = lambda files: False

    def part(self, unit: str) -> Library:
        """The library whose rules ``unit`` follows (:attr:`parts`): how it is listed, stored and restored."""
        return self if self.parts is None else self.parts(unit)

    def root(self, environ: Mapping[str, str] | None = None, dirs: Dirs | None = None) -> Path | None:
        """The absolute cache directory, from a server's ``dirs``, else ``environ``'s (default: this process's)."""
        found = dirs[self.name] if dirs and self.name in dirs else self.resolve(
            os.environ if environ is None else environ)
        return None if found is None else Path(os.path.abspath(expand(found)))  # noqa: PTH100 - no symlinks resolved

    def present(self, root: Path | None) -> dict[str, tuple[str, ...]]:
        """The complete units under ``root`` (nothing when it is None or not a directory; never raises OSError)."""
        if root is None or not root.is_dir():
            return {}
        try:
            return self.units(root)
        except OSError:  # the library removed a directory while it was listed: what is left is listed next time
            return {}

    def commit_last(self, files: Iterable[str]) -> tuple[str, ...]:
        """``files`` sorted, the commit record (:attr:`is_commit`) last."""
        return tuple(sorted(files, key=lambda rel: (self.is_commit(rel), rel)))

    def stored_bytes(self, root: Path, rel: str) -> bytes:
        """The bytes of ``root/rel`` as a unit stores them (:attr:`normalize` applied)."""
        data = (root / rel).read_bytes()
        return self.normalize(rel, data) if self.normalize is not None else data

    def digests(self, root: Path, files: tuple[str, ...]) -> Files:
        """Each file's stored bytes' sha256 (OSError when one vanished meanwhile)."""
        return {rel: hashlib.sha256(self.stored_bytes(root, rel)).hexdigest() for rel in sorted(files)}


def regular_files(folder: Path) -> Iterator[str]:
    """Names of the regular files directly in ``folder`` (no links, no dot-files: writers' temporaries)."""
    with os.scandir(folder) as it:
        yield from (e.name for e in it if not e.name.startswith(".") and e.is_file(follow_symlinks=False))


def subdirs(folder: Path) -> Iterator[Path]:
    """The real directories directly in ``folder`` (no links, no dot-directories)."""
    with os.scandir(folder) as it:
        yield from (Path(e.path) for e in it if not e.name.startswith(".") and e.is_dir(follow_symlinks=False))


def tree_files(folder: Path) -> list[str]:
    """Every regular file under ``folder``, relative to it (dot-files and dot-directories left out)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and not Path(dirpath, d).is_symlink()]
        base = Path(dirpath).relative_to(folder)
        found += [(base / n).as_posix() for n in filenames
                  if not n.startswith(".") and stat.S_ISREG(Path(dirpath, n).lstat().st_mode)]
    return sorted(found)


def lock_held(path: Path) -> bool:
    """Whether another process holds an flock on ``path`` (filelock's build lock); a shared try-lock tells."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        return exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def expand(path: str | os.PathLike[str]) -> Path:
    """``~`` expanded as ``os.path.expanduser`` does, never raising (``Path.expanduser`` raised without a home)."""
    return Path(os.path.expanduser(path))  # noqa: PTH111


def server_own(environ: Mapping[str, str]) -> None:
    """The ``resolve`` of a cache only a server keeps: none outside it (its room's :data:`Dirs` place it)."""
    del environ


_PLACED_BY: ContextVar[Callable[[str], Dirs] | None] = ContextVar("jitwarm_placed_by", default=None)


@contextmanager
def placed_by(dirs_of: Callable[[str], Dirs]) -> Iterator[None]:
    """Inside the block, a unit recorded under a server is restored where ``dirs_of(server)`` puts its library."""
    token = _PLACED_BY.set(dirs_of)
    try:
        yield
    finally:
        _PLACED_BY.reset(token)


def dirs_under(server: str) -> Dirs:
    """The :data:`Dirs` of ``server`` (``""``: none) for this restore; RuntimeError outside :func:`placed_by`."""
    dirs_of = _PLACED_BY.get()
    if dirs_of is None and not server:
        return {}
    if dirs_of is None:
        raise RuntimeError(f"a unit recorded under {server} is restored only inside placed_by(...): its server's "
                           "room says where the server keeps each library's cache")
    return dirs_of(server)


def unit_folders(files: Iterable[str]) -> list[Path]:
    """Every folder between a cache's root and a unit's files, relative to the root, parents first."""
    return sorted({part for rel in files for part in (Path(rel).parent, *Path(rel).parent.parents)} - {Path()})


def canonical(value: Mapping[str, str]) -> str:
    """A mapping as one canonical JSON string (a spec param)."""
    return json.dumps(dict(value), sort_keys=True, separators=(",", ":"))


def files_problem(library: Library, unit: object, files: object) -> str | None:
    """Why ``files`` cannot be ``unit``'s (a record's or a spec's), or None when they can."""
    library = library.part(str(unit))
    if unit != "." and not is_safe_relpath(unit):  # ".": the whole cache is one unit (the driver's PTX cache)
        return f"unit {unit!r} is not a relative path inside the cache"
    if not isinstance(files, dict) or not files:
        return "its files are not a non-empty {path: sha256} object"
    for rel, digest in files.items():
        if not is_safe_relpath(rel):
            return f"file {rel!r} is not a relative path inside the cache"
        if library.unit_is_dir and unit != "." and not rel.startswith(f"{unit}/"):
            return f"file {rel!r} is outside its unit's directory {unit}/"
        if not isinstance(digest, str) or not _SHA.fullmatch(digest):
            return f"file {rel!r} has no sha256 digest"
    return None


#: A ledger line names at most this many of a family's compiled keys.
SHOWN_KEYS = 3
#: How a family without a hit signal of its own is counted.
NO_SIGNAL = "new units in its cache directory"


@dataclass(frozen=True)
class FamilyCount:
    """One family's ledger line: ``served`` (None: no hit signal), ``compiled``, keys, units ``present`` at start.

    The witnesses beside the library's own signal (:meth:`witnessed`): ``written``, the units the start wrote
    into the library's caches (None: not listed here); ``runs``, the compiler processes it started that compiled;
    ``probes``, those that only answered a question or preprocessed; ``outputs``, what the runs wrote (``-o``).
    ``uncached``: what the library did again because its cache does not take it (Inductor's FX graph cache bypasses
    a graph holding mkldnn tensors: sglang's CPU graphs), at every start, warm or restored: nothing a restore could
    serve, so not counted in ``compiled``. ``rewritten``: the units written that such work or a hit writes again
    (``Library.rewrites``).
    """

    family: str
    signal: str
    served: int | None
    compiled: int
    keys: tuple[str, ...] = ()
    present: int | None = None
    root: str | None = None
    written: int | None = None
    runs: int = 0
    probes: int = 0
    outputs: tuple[str, ...] = ()
    uncached: int = 0
    rewritten: int = 0

    def witnessed(self, written: Iterable[str] | None, runs: int, probes: int, outputs: Iterable[str],
                  rewritten: int = 0) -> FamilyCount:
        """The count with the files' and the processes' witnesses: ``compiled`` is at least each of them.

        Each witness is a lower bound of what compiled: a miss the library counted, a unit it wrote that nothing
        else accounts for, a compiler it ran. A restored Inductor start hit its FX graph cache and ran g++ for a
        missing ``.so``: no miss, one unit, one run (the reason this exists). ``rewritten`` of the units ``written``
        are ones a start writes without compiling: Inductor writes a graph's Python wrapper where its text is new,
        for a hit (output_code.py ``write_to_disk``) and for a graph its cache does not take (sglang's CPU graphs name
        their weights' addresses in it), so up to :attr:`served` plus :attr:`uncached` of them compiled nothing.
        """
        units = None if written is None else sorted(written)
        keys = self.keys or tuple(units or ())
        excused = min(rewritten, (self.served or 0) + self.uncached)
        compiled = max(self.compiled, len(units or ()) - excused, runs)
        return replace(self, compiled=compiled, keys=keys, written=None if units is None else len(units), runs=runs,
                       probes=probes, outputs=tuple(outputs), rewritten=rewritten)

    def line(self) -> str:
        """``jitwarm: ledger: <family>: served from cache N, compiled now M (<how it was counted>)[: <keys>]``."""
        if self.served is None:
            counts = f"compiled now {self.compiled}, served from cache unknown"
            how = (f"no hit signal: counted from the new units in {self.root}" if self.root
                   else "no hit signal, and no cache directory here")
        else:
            counts = f"served from cache {self.served}, compiled now {self.compiled}" + (
                f", not cacheable {self.uncached} (its cache does not take them: done again at every start, warm or "
                "restored)" if self.uncached else "")
            how = self.signal + (f"; cache {self.root}" if self.root else "")
        if self.present is not None:
            how += f", {self.present} unit(s) there at start"
        if self.written and self.signal != NO_SIGNAL:  # a family without a signal is counted by them already
            how += f"; {self.written} unit(s) written" + (f", {self.rewritten} of them written again without a "
                                                          "compile" if self.rewritten else "")
        if self.runs or self.probes:
            how += f"; {self.runs} compiler run(s)" + (f" ({self.probes} probe(s) not counted)" if self.probes else "")
        return f"jitwarm: ledger: {self.family}: {counts} ({how})" + (f": {shown(self.keys)}" if self.keys else "")

    def after_restore(self) -> str | None:
        """The warning for a compile although units of the family were present at start, else None."""
        if not self.compiled or not self.present:
            return None
        keys = shown(self.keys) if self.keys else (
            f"(compiler output(s) {shown(self.outputs)})" if self.outputs
            else "(keys not known: no new unit was written)")
        return (f"jitwarm: ledger: {self.family} compiled {self.compiled} although {self.present} unit(s) of "
                f"{self.family} were present at start in {self.root}: {keys}; none of them has that key (a flag, "
                "a version or a shape differs: record in the server's image, docs/deployment.md), or one of them "
                "is gone from there")

    def as_json(self) -> dict[str, Any]:
        """The family's JSON object."""
        return {"signal": self.signal, "served": self.served, "compiled": self.compiled, "keys": list(self.keys),
                "present_at_start": self.present, "root": self.root, "written": self.written,
                "uncached": self.uncached, "rewritten": self.rewritten, "compiler_runs": self.runs,
                "compiler_probes": self.probes, "compiler_outputs": list(self.outputs)}


class Signal(Protocol):
    """A library's own hit signal, noted when the ledger starts; :meth:`count` never raises."""

    def count(self, before: Mapping[str, Any], after: Mapping[str, Any],
              new: Mapping[str, Mapping[str, tuple[str, ...]]]) -> FamilyCount | None:
        """The count from the census at start, now and the new units; None where there is no signal here."""


def shown(keys: tuple[str, ...]) -> str:
    """The first keys, and how many more."""
    return ", ".join(keys[:SHOWN_KEYS]) + (f" and {len(keys) - SHOWN_KEYS} more" if len(keys) > SHOWN_KEYS else "")
