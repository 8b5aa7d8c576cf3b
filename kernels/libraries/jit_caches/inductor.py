"""PyTorch Inductor's cache (``TORCHINDUCTOR_CACHE_DIR``, else ``$TMPDIR/torchinductor_<user>``).

Units, each named by Inductor's hash: every file under ``fxgraph/`` and ``aotautograd/`` (written whole by
``write_atomic``); in each code directory, the files that share a stem, a ``.cpp`` complete only with its ``.so``
while no build holds ``locks/<hash>.lock`` and no ``*_CxxBuild`` directory is left (cpp_builder.py); in
``precompiled_headers/``, a ``.h`` with its ``.h.gch`` (codecache.py:3548; 6 s of a 47 s vLLM CPU start).
``triton/`` is the ``triton`` family's.
"""

from __future__ import annotations

import itertools
import os
import sys
import tempfile
import weakref
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from jitwarm.kernels.kinds import named
from jitwarm.kernels.libraries.jit_caches.census import bind
from jitwarm.kernels.libraries.jit_caches.units import (
    FamilyCount,
    Library,
    lock_held,
    regular_files,
    subdirs,
    tree_files,
)

#: Top-level directories that hold no units of this family.
_NOT_UNITS = ("locks", "triton")
_HEADERS = "precompiled_headers"
_WHOLE_FILES = ("fxgraph", "aotautograd")
_BUILD_DIR = "_CxxBuild"  # cpp_builder.py: _BUILD_TEMP_DIR


def resolve(environ: Mapping[str, str]) -> Path:
    """Inductor's ``cache_dir()`` in ``environ``."""
    if environ.get("TORCHINDUCTOR_CACHE_DIR") is not None:
        return Path(environ["TORCHINDUCTOR_CACHE_DIR"])
    try:
        import getpass

        user = getpass.getuser()
    except (KeyError, ImportError, OSError):
        user = f"uid_{os.getuid()}"
    tmp = environ.get("TMPDIR") or tempfile.gettempdir()  # the process's: prestart runs with the server's
    return Path(tmp) / f"torchinductor_{user}"


def units(root: Path) -> dict[str, tuple[str, ...]]:
    """The complete units of one Inductor cache directory (see the module docstring)."""
    found: dict[str, tuple[str, ...]] = {}
    for top in subdirs(root):
        if top.name in _NOT_UNITS:
            continue
        if top.name in _WHOLE_FILES:
            for rel in tree_files(top):
                found[f"{top.name}/{rel}"] = (f"{top.name}/{rel}",)
            continue
        found.update(_code_units(root, top))
    return found


def _code_units(root: Path, top: Path) -> dict[str, tuple[str, ...]]:
    """The complete units of one code directory (or ``precompiled_headers/``) of ``root``."""
    found: dict[str, tuple[str, ...]] = {}
    groups: dict[str, list[str]] = {}
    names = list(regular_files(top))
    building = {p.name for p in subdirs(top) if p.name.endswith(_BUILD_DIR)}
    locks = top / "locks" if top.name == _HEADERS else root / "locks"
    for name in names:
        groups.setdefault(name.split(".", 1)[0], []).append(name)
    for stem, members in groups.items():
        for source, built in ((".cpp", ".so"), (".h", ".h.gch")):
            if any(m.endswith(source) for m in members) and not any(m.endswith(built) for m in members):
                break  # what is built from its source is not (yet)
        else:
            if not (any(b.startswith(stem) for b in building) or lock_held(locks / f"{stem}.lock")):
                found[f"{top.name}/{stem}"] = tuple(sorted(f"{top.name}/{m}" for m in members))
    return found


def headers(environ: Mapping[str, str]) -> tuple[Path, Any]:
    """Where Inductor keeps its precompiled headers whatever ``TORCHINDUCTOR_CACHE_DIR`` says, and their units.

    codecache.py ``_HEADER_DIR`` is ``default_cache_dir()/precompiled_headers``: ``$TMPDIR/torchinductor_<user>``.
    """
    default = resolve({k: v for k, v in environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"})

    def header_units(folder: Path) -> dict[str, tuple[str, ...]]:
        top = folder / _HEADERS
        return _code_units(folder, top) if top.is_dir() else {}

    return default, header_units


def graph_keys(units: Iterable[str]) -> list[str]:
    """The FX graph keys of ``units``: an FX graph unit is ``[<vLLM dir>/]fxgraph/<2 chars>/<key>/<entry>``."""
    keys = set()
    for unit in units:
        parts = unit.split("/")
        if "fxgraph" in parts:
            rest = parts[parts.index("fxgraph") + 1:]
            if len(rest) >= 3:
                keys.add(rest[1])  # codecache.py: the graph's key directory
    return sorted(keys)


def _counters() -> dict[str, int]:
    """``counters["inductor"]`` when torch._dynamo is imported here (else nothing has compiled through it)."""
    counters = getattr(sys.modules.get("torch._dynamo.utils"), "counters", None)
    return dict(counters["inductor"]) if counters is not None else {}


class Counters:
    """Inductor's own hit signal: its FX graph cache's counters, noted at the ledger's start.

    A miss compiled a graph. A bypass lowered one the cache does not take (codecache.py ``BypassFxGraphCache``:
    "mkldnn tensors unpickleable" for sglang's CPU graphs, whose frozen weights Inductor packs for oneDNN): done
    again at every start, warm or restored, it is counted apart (``uncached``), and its kernels' own witnesses (a
    ``.so`` written, a compiler run) still count.
    """

    def __init__(self) -> None:
        self.start = _counters()

    def count(self, before: Mapping[str, Any], after: Mapping[str, Any],
              new: Mapping[str, Mapping[str, tuple[str, ...]]]) -> FamilyCount:
        """Hits served, misses compiled, bypasses not cacheable; named by the new units' graph keys and code units.

        The graph keys are vLLM's tree's too. The code units and precompiled headers written are named: a hit whose
        ``.so`` or header is gone builds it again, which the counters do not count.
        """
        now = _counters()
        hits, misses, bypassed = (now.get(k, 0) - self.start.get(k, 0)
                                  for k in ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass"))
        root = after["inductor"].root
        written = {**new.get("inductor", {}), **new.get("vllm_compile", {})}  # Inductor writes into vLLM's tree too
        code = sorted(u for u in new.get("inductor", {}) if u.split("/", 1)[0] not in _WHOLE_FILES)
        return FamilyCount("inductor", "Inductor's fxgraph_cache_hit/miss/bypass counters", hits, misses,
                           (*(f"fxgraph {k}" for k in graph_keys(written)), *code), len(before["inductor"].units),
                           str(root) if root else None, uncached=bypassed)


def seal(refuse: Callable[..., None]) -> tuple[str, Callable[[], bool]] | None:
    """Hand each Inductor compile to ``refuse``, where torch has imported it; (name, undo), or None."""
    from jitwarm.kernels.tap import replace

    compile_fx = sys.modules.get("torch._inductor.compile_fx")
    original = getattr(compile_fx, "fx_codegen_and_compile", None)
    if original is None:
        return None

    # A graph's own number, not its id(): a freed graph's id went to the next, whose compile went unlogged.
    numbers: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
    counter = itertools.count()

    def fx_codegen_and_compile(gm: Any, *args: Any, **kwargs: Any) -> Any:
        region = kwargs.get("compile_region_name") or "an FX graph"
        try:
            number = numbers.setdefault(gm, next(counter))
        except TypeError:  # not weakly referable: each compile is its own
            number = next(counter)
        refuse(f"Inductor compile of {region} ({len(getattr(getattr(gm, 'graph', None), 'nodes', ()))} nodes)",
               number)
        return original(gm, *args, **kwargs)

    fx_codegen_and_compile.__wrapped__ = original  # type: ignore[attr-defined]
    return "Inductor compile", replace(compile_fx, "fx_codegen_and_compile", fx_codegen_and_compile)


def wrapper(files: tuple[str, ...]) -> bool:
    """True for a unit of Python alone: a graph's wrapper, named by its text's hash.

    Inductor writes it without compiling where the text is new: for a graph its FX cache serves (output_code.py
    ``write_to_disk``) and for one its cache does not take, lowered again (sglang's CPU graphs name their weights'
    addresses in it, new at every start); a compile writes the graph's kernels beside it.
    """
    return bool(files) and all(f.endswith(".py") for f in files)


# The .so (.gch) last: Inductor builds a group's .cpp (.h) only while it is absent.
LIBRARY = Library(*named("inductor"), resolve, units, ("torch", "triton", "cxx", "arch"),
                  unit_is_dir=False, is_commit=lambda rel: rel.endswith((".so", ".gch")), signal=Counters,
                  beside=headers, rewrites=wrapper)
name, description, build, check, load = bind(LIBRARY)
