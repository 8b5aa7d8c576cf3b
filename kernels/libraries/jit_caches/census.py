"""The units of every family present now, and what a run added: the recorder's and the start-up ledger's view.

A unit is added when its name is new, its files changed or one changed size (FlashInfer's ninja rebuilds in
place). Sizes, not times: DeepGEMM touches ``.committed`` at every hit (deep_jit ``try_update_mtime``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

from jitwarm.kernels import kinds
from jitwarm.kernels.libraries.jit_caches.units import Dirs, Library


def bind(library: Library) -> tuple[Any, ...]:
    """The backend module attributes of ``library``'s kind: ``name, description, build, check, load``.

    Each imports :mod:`.backend` on its first call: the ledger lists units inside the hook, where an import costs.
    """
    def unit_backend() -> Any:
        from jitwarm.kernels.libraries.jit_caches import backend

        return backend

    return (library.kind,
            lambda spec, facts=None: unit_backend().description(library, spec),
            lambda spec, staging, described=None: unit_backend().build(library, spec),
            lambda spec, staging: unit_backend().check(library, spec, staging),
            lambda spec, entry: unit_backend().load(library, spec, entry))


def library(name: str) -> Library:
    """The :class:`Library` of the JIT cache family ``name`` or of its kind (``inductor_cache``); KeyError."""
    found = next((k for k in kinds.caches() if name in (k.family, k.name)), None)
    if found is None:
        raise KeyError(f"no JIT cache family {name!r}; known: {', '.join(k.family for k in kinds.caches())}")
    return found.library()


def _families() -> list[str]:
    return [k.family for k in kinds.caches()]


class Snapshot(NamedTuple):
    """One library's cache directory (None: off) and its complete units at one moment (a NamedTuple: cheap)."""

    library: Library
    root: Path | None
    units: Mapping[str, tuple[str, ...]]
    #: unit -> its files' sizes, in the order of :attr:`units` (-1: gone meanwhile); empty: not taken.
    sizes: Mapping[str, tuple[int, ...]]


def snapshot(names: Iterable[str] | None = None, environ: Mapping[str, str] | None = None,
             dirs: Dirs | None = None) -> dict[str, Snapshot]:
    """Each library's (default: all) directory, from ``dirs`` or ``environ``, and its complete units now."""
    env = os.environ if environ is None else environ
    every = _families()
    wanted = set(every if names is None else names)
    taken = {}
    for lib in (library(name) for name in every if name in wanted):
        root = lib.root(env, dirs)
        units = lib.present(root)
        sizes = {unit: tuple(_size(root / rel) for rel in files) for unit, files in units.items()} if root else {}
        taken[lib.name] = Snapshot(lib, root, units, sizes)
    return taken


def beside(names: Iterable[str] | None = None, environ: Mapping[str, str] | None = None,
           dirs: Dirs | None = None) -> dict[str, Snapshot]:
    """Each library's units outside its root (:attr:`Library.beside`), where that directory is not inside the root.

    Inductor writes its precompiled headers under ``$TMPDIR/torchinductor_<user>`` whatever
    ``TORCHINDUCTOR_CACHE_DIR`` says: a start that built one again wrote nothing the root's census saw.
    """
    env = os.environ if environ is None else environ
    every = _families()
    wanted = set(every if names is None else names)
    taken = {}
    for lib in (library(name) for name in every if name in wanted):
        found = lib.beside(env) if lib.beside is not None else None
        root = lib.root(env, dirs)
        if found is None or (root is not None and _inside(found[0], root)):
            continue
        folder, units_of = found
        units = _listed(units_of, folder)
        taken[lib.name] = Snapshot(lib, folder, units,
                                   {unit: tuple(_size(folder / rel) for rel in files) for unit, files in units.items()})
    return taken


def _inside(path: Path, root: Path) -> bool:
    return os.path.abspath(path).startswith(os.path.join(os.path.abspath(root), ""))  # noqa: PTH100, PTH118


def _listed(units_of: Any, folder: Path) -> dict[str, tuple[str, ...]]:
    try:
        return units_of(folder) if folder.is_dir() else {}
    except OSError:
        return {}


def _size(path: Path) -> int:
    try:
        return path.lstat().st_size
    except OSError:
        return -1


def added(before: Mapping[str, Snapshot], after: Mapping[str, Snapshot]) -> dict[str, dict[str, tuple[str, ...]]]:
    """Per library, the units of ``after`` that ``before`` lacked (or held with other files or sizes)."""
    new: dict[str, dict[str, tuple[str, ...]]] = {}
    for name, now in after.items():
        then = before.get(name)
        old, sizes = (then.units, then.sizes) if then is not None and then.root == now.root else ({}, {})
        fresh = {unit: files for unit, files in now.units.items()
                 if old.get(unit) != files or (unit in sizes and unit in now.sizes and sizes[unit] != now.sizes[unit])}
        if fresh:
            new[name] = fresh
    return new
