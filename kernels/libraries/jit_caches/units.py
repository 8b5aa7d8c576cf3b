"""A JIT library's cache as a directory of units: where it lives, which file groups are complete, their digests.

Each library writes every compile into its own cache directory as a group of files that belong together
(Triton's key directory and its ``__grp__`` file, DeepGEMM's ``kernel.<name>.<hash>/``, Inductor's module or its
``.cpp`` with the ``.so`` built from it). jitwarm never reads their meaning: a :class:`Library` says where the
cache is (as the library resolves its own variables; a server that moves it says so in its room, :data:`Dirs`),
which groups are *complete* (never half a group), which file goes last when one is restored, and which node
facts the library's key depends on (:mod:`.fingerprint`). A unit is named by its path under the cache root, the
library's own key, so the same compile on two boxes is the same unit; what ``units(root)`` lists after a run,
minus what it listed before, is what the run compiled.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from jitwarm.cache.entry import is_safe_relpath

#: A unit's files: paths relative to the cache root -> their bytes' sha256 (as stored, :attr:`Library.normalize`).
Files = dict[str, str]
_SHA = re.compile(r"[0-9a-f]{64}")
#: Where a server keeps the libraries' caches, as its room (``jitwarm.precompile.servers``) reads its environment:
#: library name -> directory, None where the server turns it off. A library it leaves out is where the library's
#: own variables put it. The kernels layer names no server: a server's redirect reaches it only as this.
Dirs = Mapping[str, Path | None]


@dataclass(frozen=True)
class Library:
    """One JIT library's cache directory (see the module docstring), the contract each family's module fills.

    Failure semantics, as a reader needs them without the implementation: ``resolve``, ``is_commit``,
    ``arch_of``, ``factors_of``, ``node_factors``, ``signal`` and ``bypassed`` never raise (a value they cannot
    read is None, absent or left out); ``units`` and ``settle`` may raise ``OSError`` (a directory removed while
    it is listed: :meth:`present` answers nothing then, and a restore names the unit); ``normalize`` and
    ``localize`` may raise ``ValueError``, ``KeyError``, ``TypeError`` or ``AttributeError`` for a file that is
    not in the library's format (the capture of that unit fails, named; a restore raises ``LoadError``, which
    quarantines the entry). None of them runs under a lock of jitwarm's; a restore calls ``localize`` and
    ``settle`` under the entry's claim.

    Attributes
    ----------
    name, kind : str
        ``inductor`` and its backend kind ``inductor_cache``.
    resolve : callable
        ``resolve(environ) -> Path | None``: the cache directory the library's own variables give in a process
        with that environment; None when the persistent cache is off there, or when only a server keeps this
        cache (sglang's CuTe DSL objects, vLLM's compile tree: its room's :data:`Dirs` place it).
    units : callable
        ``units(root) -> {unit: files}``: the complete units under ``root``, files relative to ``root``.
    items : tuple of str
        The fingerprint items the library's key depends on (:mod:`.fingerprint`).
    unit_is_dir : bool
        The unit is a directory of its own (``root/unit/``): restored by one rename when it is absent there.
    is_commit : callable
        ``is_commit(rel)``: the file the library looks for first (its commit record), restored last.
    normalize, localize : callable or None
        A file rewritten when captured (absolute paths made relative) and when restored (made absolute under the
        destination): Triton's group files.
    arch_of : callable or None
        ``arch_of(root, files)``: the arch read from the unit itself (Triton's metadata), else the node's.
    settle : callable or None
        ``settle(root, unit, files)`` once a restore placed the files: what the library's build tool reads beside
        their bytes (FlashInfer's ninja: the times it logged).
    factors_of, node_factors : callable or None
        ``factors_of(root, files)``: fingerprint items of the library's own, as the unit or the recording process
        has them (vLLM's cache key factors); ``node_factors(items)``: this node's values of those it can compute
        (one left out is not compared).
    parts : callable or None
        ``parts(unit)``: the library whose file rules a unit of this cache follows, where the cache holds another
        library's units (vLLM's compile tree holds Inductor's and Triton's); None: every unit follows this one's.
    signal : callable or None
        ``signal()``: the library's own hit signal, noted now (:class:`Signal`), for the start-up ledger; None:
        it has none, and the units new in its directory count what compiled.
    bypassed : callable
        ``bypassed()``: the library's compiles go elsewhere in this process (Triton's, through jitwarm's cache
        manager), so its directory holds none of them to capture.

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

    def part(self, unit: str) -> Library:
        """The library whose rules ``unit`` follows (:attr:`parts`): how it is listed, stored and restored."""
        return self if self.parts is None else self.parts(unit)

    def root(self, environ: Mapping[str, str] | None = None, dirs: Dirs | None = None) -> Path | None:
        """The absolute cache directory; None: off.

        Where a server's ``dirs`` put it, else where the library resolves ``environ`` (default: this process's).
        """
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


# -- listing helpers the libraries share -----------------------------------------------------------------------


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
    """Whether another process holds an flock on ``path`` (a library's per-key build lock); False if none exists.

    A shared try-lock fails exactly while a writer holds the exclusive lock that filelock (Inductor's, FlashInfer's)
    takes around a build; it is released at once.
    """
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
    """``~`` expanded as the libraries expand it (``os.path.expanduser``), never raising.

    A ``~name`` of no user, or a home that cannot be found (no ``HOME``, no passwd entry: a container's arbitrary
    uid), is left as it is; ``Path.expanduser`` raises RuntimeError there, which stopped the start-up ledger
    inside a server.
    """
    return Path(os.path.expanduser(path))  # noqa: PTH111


def server_own(environ: Mapping[str, str]) -> None:
    """The ``resolve`` of a cache only a server keeps: none outside it (its room's :data:`Dirs` place it)."""
    del environ


#: The server rooms' :data:`Dirs` while a restore runs: ``dirs_of(server)`` (:func:`placed_by`).
_PLACED_BY: ContextVar[Callable[[str], Dirs] | None] = ContextVar("jitwarm_placed_by", default=None)


@contextmanager
def placed_by(dirs_of: Callable[[str], Dirs]) -> Iterator[None]:
    """Inside the block, a unit recorded under a server is restored where ``dirs_of(server)`` puts its library.

    The restore runs through the generic ``Artifact.load`` (its claim, its quarantine of a corrupt entry), whose
    backend contract carries no environment: the caller, which knows the server rooms, sets this around it.
    """
    token = _PLACED_BY.set(dirs_of)
    try:
        yield
    finally:
        _PLACED_BY.reset(token)


def dirs_under(server: str) -> Dirs:
    """The :data:`Dirs` of ``server`` (``""``: a process that ran none) for this restore.

    RuntimeError outside :func:`placed_by` for a server's unit: restoring it where its library alone would look puts
    it where that server never looks (a caller's bug, never a corrupt entry, so not a LoadError that quarantines it).
    """
    dirs_of = _PLACED_BY.get()
    if dirs_of is None and not server:
        return {}
    if dirs_of is None:
        raise RuntimeError(f"a unit recorded under {server} is restored only inside placed_by(...): its server's "
                           "room says where the server keeps each library's cache")
    return dirs_of(server)


def unit_folders(files: Iterable[str]) -> list[Path]:
    """Every folder between a cache's root and the files of a unit, relative to the root, parents first (not the root).

    What the trust checks of a capture (the unit's source) and of a restore (its destination) walk.
    """
    return sorted({part for rel in files for part in (Path(rel).parent, *Path(rel).parent.parents)} - {Path()})


# -- what a spec of a unit carries, checked ---------------------------------------------------------------------


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


# -- the start-up ledger's count of a family (jitwarm.precompile.ledger) ------------------------------------

#: A ledger line names at most this many of a family's compiled keys.
SHOWN_KEYS = 3
#: How a family without a hit signal of its own is counted.
NO_SIGNAL = "new units in its cache directory"


@dataclass(frozen=True)
class FamilyCount:
    """One family's line: ``served`` from its cache (None: the library gives no hit signal), ``compiled`` now.

    ``keys`` are the library's keys of what compiled; ``present`` the complete units in its cache directory
    ``root`` at start (None where the family has no such directory here).
    """

    family: str
    signal: str
    served: int | None
    compiled: int
    keys: tuple[str, ...] = ()
    present: int | None = None
    root: str | None = None

    def line(self) -> str:
        """``jitwarm: ledger: <family>: served from cache N, compiled now M (<how it was counted>)[: <keys>]``."""
        if self.served is None:
            counts = f"compiled now {self.compiled}, served from cache unknown"
            how = (f"no hit signal: counted from the new units in {self.root}" if self.root
                   else "no hit signal, and no cache directory here")
        else:
            counts = f"served from cache {self.served}, compiled now {self.compiled}"
            how = self.signal + (f"; cache {self.root}" if self.root else "")
        if self.present is not None:
            how += f", {self.present} unit(s) there at start"
        return f"jitwarm: ledger: {self.family}: {counts} ({how})" + (f": {shown(self.keys)}" if self.keys else "")

    def after_restore(self) -> str | None:
        """The warning for a compile although units of the family were present at start, else None."""
        if not self.compiled or not self.present:
            return None
        keys = shown(self.keys) if self.keys else "(keys not known: no new unit was written)"
        return (f"jitwarm: ledger: {self.family} compiled {self.compiled} although {self.present} unit(s) of "
                f"{self.family} were present at start in {self.root}: {keys}; none of them has that key (a flag, "
                "a version or a shape differs: record in the server's image, docs/deployment.md)")

    def as_json(self) -> dict[str, Any]:
        """The family's JSON object."""
        return {"signal": self.signal, "served": self.served, "compiled": self.compiled, "keys": list(self.keys),
                "present_at_start": self.present, "root": self.root}


class Signal(Protocol):
    """A library's own hit signal, noted when the ledger starts (:attr:`Library.signal` makes one then).

    :meth:`count` gets the census of the start (``before``) and now (``after``, :func:`.census.snapshot`) and
    the units new since (:func:`.census.added`); it returns None where the library gives no signal in this
    process (its new units count then). It never raises.
    """

    def count(self, before: Mapping[str, Any], after: Mapping[str, Any],
              new: Mapping[str, Mapping[str, tuple[str, ...]]]) -> FamilyCount | None:
        """The family's count since the signal was noted, or None."""


def shown(keys: tuple[str, ...]) -> str:
    """The first keys, and how many more."""
    return ", ".join(keys[:SHOWN_KEYS]) + (f" and {len(keys) - SHOWN_KEYS} more" if len(keys) > SHOWN_KEYS else "")
