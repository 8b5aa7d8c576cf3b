"""A JIT library's cache as a directory of units: where it lives, which file groups are complete, their digests.

Each library writes every compile into its own cache directory as a group of files that belong together
(Triton's key directory and its ``__grp__`` file, DeepGEMM's ``kernel.<name>.<hash>/``, Inductor's module or its
``.cpp`` with the ``.so`` built from it). jitwarm never reads their meaning: a :class:`Library` says where the
cache is (resolved as the library, and sglang's redirect, resolve it), which groups are *complete* (never half a
group), which file goes last when one is restored, and which node facts the library's key depends on
(:mod:`.fingerprint`). A unit is named by its path under the cache root, the library's own key, so the same
compile on two boxes is the same unit; what ``units(root)`` lists after a run, minus what it listed before, is
what the run compiled.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import stat
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from jitwarm.cache.entry import is_safe_relpath

#: A unit's files: paths relative to the cache root -> their bytes' sha256 (as stored, :attr:`Library.normalize`).
Files = dict[str, str]
_SHA = re.compile(r"[0-9a-f]{64}")
#: The servers whose redirects the libraries' ``resolve`` knows ("": a process that is neither).
SGLANG, VLLM = "sglang", "vllm"
SERVERS = (SGLANG, VLLM)


@dataclass(frozen=True)
class Library:
    """One JIT library's cache directory (see the module docstring).

    Attributes
    ----------
    name, kind : str
        ``inductor`` and its backend kind ``inductor_cache``.
    resolve : callable
        ``resolve(environ, server) -> Path | None``: the cache directory in a process with that environment, run
        by ``server`` (:data:`SERVERS`, or ``""``); None when the persistent cache is off there.
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
    unloadable : callable or None
        ``unloadable(units)``: why this node's server will not load these restored units although they are
        there (a warning for ``prestart``), or None.

    """

    name: str
    kind: str
    resolve: Callable[[Mapping[str, str], str], Path | None]
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
    unloadable: Callable[[Iterable[str]], str | None] | None = None

    def part(self, unit: str) -> Library:
        """The library whose rules ``unit`` follows (:attr:`parts`): how it is listed, stored and restored."""
        return self if self.parts is None else self.parts(unit)

    def root(self, environ: Mapping[str, str] | None = None, server: str | bool = "") -> Path | None:
        """The absolute cache directory in ``environ`` (default: this process's) under ``server``; None: off.

        ``server`` True / False stand for ``"sglang"`` / ``""`` (the form of the sglang-only releases).
        """
        name = SGLANG if server is True else "" if server is False else server
        found = self.resolve(os.environ if environ is None else environ, name)
        return None if found is None else Path(os.path.abspath(Path(found).expanduser()))  # noqa: PTH100 - no symlinks resolved

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


def running_server() -> str:
    """The server this process runs in, by what it has imported: ``"sglang"``, ``"vllm"`` or ``""``."""
    return next((name for name in SERVERS if name in sys.modules), "")


def vllm_root(environ: Mapping[str, str]) -> Path:
    """``VLLM_CACHE_ROOT`` as vLLM reads it (envs.py:340-344, :714-719: ``os.getenv``, a variable set empty counts)."""
    base = environ.get("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache"))  # noqa: PTH111, PTH118
    return Path(os.path.expanduser(environ.get("VLLM_CACHE_ROOT", os.path.join(base, "vllm"))))  # noqa: PTH111, PTH118


def vllm_tree(environ: Mapping[str, str]) -> Path | None:
    """The compile tree of vLLM, ``VLLM_CACHE_ROOT/torch_compile_cache``; None under ``VLLM_DISABLE_COMPILE_CACHE``.

    Off: ``disable_compile_cache()`` (vLLM 0.33.0 ``envs.py:375-376``); a value vLLM cannot parse counts as on.
    """
    try:
        off = int(environ.get("VLLM_DISABLE_COMPILE_CACHE", "0"))
    except ValueError:
        off = 0
    return None if off else vllm_root(environ) / "torch_compile_cache"


def own_dir(environ: Mapping[str, str], variable: str, server: str) -> str | None:
    """A library's cache variable as its library reads it, unless vLLM set it into its compile tree.

    vLLM points ``TORCHINDUCTOR_CACHE_DIR`` (and ``TRITON_CACHE_DIR``, unless the user chose one) at a directory
    of its tree while it compiles (``compilation/compiler_interface.py:29-42``, ``decorators.py:580-589``): those
    units are the tree's (:mod:`.vllm_compile`), and the library's own directory is where it writes otherwise
    (vLLM's CPU platform compiles with ``DYNAMO_TRACE_ONCE``; without AOT compile Inductor keeps its default).
    """
    given = environ.get(variable)
    if given is None or server != VLLM:
        return given
    tree = vllm_tree(environ)
    inside = tree is not None and Path(os.path.abspath(given)).is_relative_to(os.path.abspath(tree))  # noqa: PTH100
    return None if inside else given


def sglang_dir(environ: Mapping[str, str], sub: str = "") -> Path:
    """``SGLANG_CACHE_DIR``/``sub`` as sglang reads it: default ``~/.cache/sglang`` (environ.py:1383, 2309)."""
    return Path(environ.get("SGLANG_CACHE_DIR") or "~/.cache/sglang").expanduser() / sub


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
