"""A JIT library's cache as a directory of units: where it lives, which file groups are complete, their digests.

Every library here keeps a cache directory of its own and writes each compile into it as a group of files
that belong together (Triton's key directory and its ``__grp__`` file, DeepGEMM's ``kernel.<name>.<hash>/``
directory, Inductor's generated module or its ``.cpp`` with the ``.so`` built from it). jitwarm never reads
those files' meaning: a :class:`Library` says where the cache is (resolved from the environment exactly as the
library resolves it, and as sglang redirects it), which groups are *complete* (the library finished writing
them: never half a group), how a group is ordered when it is restored (the file whose presence makes the
library use the group goes last) and which facts about the node the library's key depends on
(:mod:`.fingerprint`). A unit is named by its path relative to the cache root, which is the library's own key
(a hash it computed), so the same compile on two boxes is the same unit.

``units(root)`` is the seam a start-up ledger uses too: what is present now, minus what was present before,
is what the run compiled.
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
from dataclasses import dataclass, field
from pathlib import Path

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
        ``resolve(environ, server) -> Path | None``: the cache directory the library uses in a process with
        that environment, run by ``server`` (:data:`SERVERS`: ``"sglang"``, whose ``redirect_third_party_caches``
        ran first; ``"vllm"``, which points some caches into its own compile tree; ``""``: none); None when the
        library's persistent cache is turned off there.
    units : callable
        ``units(root) -> {unit: files}``: the complete units present under ``root``, each with its files
        relative to ``root``.
    items : tuple of str
        The fingerprint items the library's key depends on (:mod:`.fingerprint`).
    unit_is_dir : bool
        The unit is a directory of its own (``root/unit/``): restored by one rename when it is absent there.
    commit_last : callable
        Orders a unit's files so that the one the library looks for first (its commit record) comes last.
    normalize, localize : callable or None
        A file rewritten when it is captured (absolute paths made relative) and again when it is restored
        (made absolute under the destination): Triton's group files.
    arch_of : callable or None
        The arch a unit was compiled for, read from the unit itself (Triton's metadata), else the node's.
    settle : callable or None
        ``settle(root, unit, files)``, called once a restore placed the unit's files: what the library's build
        tool reads beside their bytes (FlashInfer's ninja: the modification times it logged).
    factors_of : callable or None
        ``factors_of(root, files) -> {item: value}``: fingerprint items of the library's own (beyond
        :mod:`.fingerprint`'s), as the unit or the recording process records them (vLLM's cache key factors).
    node_factors : callable or None
        ``node_factors(items) -> {item: value}``: this node's values of those items, for the ones it can compute
        (an item it leaves out is not compared).

    """

    name: str
    kind: str
    resolve: Callable[[Mapping[str, str], bool], Path | None]
    units: Callable[[Path], dict[str, tuple[str, ...]]]
    items: tuple[str, ...]
    unit_is_dir: bool = True
    commit_last: Callable[[tuple[str, ...]], tuple[str, ...]] = field(default=lambda files: tuple(sorted(files)))
    normalize: Callable[[str, bytes], bytes] | None = None
    localize: Callable[[str, bytes, Path], bytes] | None = None
    arch_of: Callable[[Path, tuple[str, ...]], str | None] | None = None
    settle: Callable[[Path, str, tuple[str, ...]], None] | None = None
    factors_of: Callable[[Path, tuple[str, ...]], dict[str, str]] | None = None
    node_factors: Callable[[Iterable[str]], dict[str, str]] | None = None

    def root(self, environ: Mapping[str, str] | None = None, server: str | bool = "") -> Path | None:
        """The cache directory in ``environ`` (default: this process's) under ``server``, absolute; None: off.

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

    def stored_bytes(self, root: Path, rel: str) -> bytes:
        """The bytes of ``root/rel`` as a unit stores them (:attr:`normalize` applied)."""
        data = (root / rel).read_bytes()
        return self.normalize(rel, data) if self.normalize is not None else data

    def digests(self, root: Path, files: tuple[str, ...]) -> Files:
        """Each file's stored bytes' sha256 (OSError when one vanished meanwhile)."""
        return {rel: hashlib.sha256(self.stored_bytes(root, rel)).hexdigest() for rel in sorted(files)}


# -- listing helpers the libraries share -----------------------------------------------------------------------


def regular_files(folder: Path, *, skip: Callable[[str], bool] = lambda name: False) -> Iterator[str]:
    """Names of the regular files directly in ``folder`` (no links, no dot-files: writers' temporaries)."""
    with os.scandir(folder) as it:
        for item in it:
            if item.name.startswith(".") or skip(item.name):
                continue
            if stat.S_ISREG(item.stat(follow_symlinks=False).st_mode):
                yield item.name


def subdirs(folder: Path) -> Iterator[Path]:
    """The real directories directly in ``folder`` (no links, no dot-directories)."""
    with os.scandir(folder) as it:
        for item in it:
            if not item.name.startswith(".") and item.is_dir(follow_symlinks=False):
                yield Path(item.path)


def tree_files(folder: Path) -> list[str]:
    """Every regular file under ``folder``, relative to it (dot-files and dot-directories left out)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and not Path(dirpath, d).is_symlink()]
        base = Path(dirpath).relative_to(folder)
        for name in filenames:
            path = Path(dirpath, name)
            if not name.startswith(".") and stat.S_ISREG(path.lstat().st_mode):
                found.append((base / name).as_posix())
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
    import sys

    return next((name for name in SERVERS if name in sys.modules), "")


def vllm_root(environ: Mapping[str, str]) -> Path:
    """``VLLM_CACHE_ROOT`` as vLLM reads it: default ``$XDG_CACHE_HOME/vllm``, else ``~/.cache/vllm``.

    vLLM's own expression (envs.py:340-344, :714-719), ``os.getenv`` with a default: a variable set empty counts.
    """
    base = environ.get("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache"))  # noqa: PTH111, PTH118
    return Path(os.path.expanduser(environ.get("VLLM_CACHE_ROOT", os.path.join(base, "vllm"))))  # noqa: PTH111, PTH118


def sglang_base(environ: Mapping[str, str]) -> str:
    """``SGLANG_CACHE_DIR`` as sglang reads it: default ``~/.cache/sglang``, user-expanded (environ.py:1383, 2309)."""
    return str(Path(environ.get("SGLANG_CACHE_DIR") or "~/.cache/sglang").expanduser())


# -- what a spec of a unit carries, checked ---------------------------------------------------------------------


def canonical(value: Mapping[str, str]) -> str:
    """A mapping as one canonical JSON string (a spec param)."""
    return json.dumps(dict(value), sort_keys=True, separators=(",", ":"))


def safe_relpath(rel: object) -> bool:
    """A normalized relative POSIX path without ``..`` or empty parts (a file name a unit may hold)."""
    return (isinstance(rel, str) and bool(rel) and not rel.startswith("/") and "\\" not in rel and "\0" not in rel
            and all(p not in ("", ".", "..") for p in rel.split("/")))


def files_problem(library: Library, unit: object, files: object) -> str | None:
    """Why ``files`` cannot be ``unit``'s (a record's or a spec's), or None when they can."""
    if unit != "." and not safe_relpath(unit):  # ".": the whole cache is one unit (the driver's PTX cache)
        return f"unit {unit!r} is not a relative path inside the cache"
    if not isinstance(files, dict) or not files:
        return "its files are not a non-empty {path: sha256} object"
    for rel, digest in files.items():
        if not safe_relpath(rel):
            return f"file {rel!r} is not a relative path inside the cache"
        if library.unit_is_dir and unit != "." and not rel.startswith(f"{unit}/"):
            return f"file {rel!r} is outside its unit's directory {unit}/"
        if not isinstance(digest, str) or not _SHA.fullmatch(digest):
            return f"file {rel!r} has no sha256 digest"
    return None
