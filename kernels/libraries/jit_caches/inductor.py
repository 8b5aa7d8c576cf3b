"""PyTorch Inductor's cache (``TORCHINDUCTOR_CACHE_DIR``): FX graphs, AOTAutograd entries, generated code.

Where (torch/_inductor/runtime/cache_dir_utils.py, ``cache_dir``): ``TORCHINDUCTOR_CACHE_DIR``, else
``$TMPDIR/torchinductor_<user>``; under sglang, ``<SGLANG_CACHE_DIR>/inductor`` (``redirect_third_party_caches``,
srt/environ.py:2308-2320). Under vLLM, whose compile cache sets ``TORCHINDUCTOR_CACHE_DIR`` whatever it was
(``compilation/compiler_interface.py:29-35``, ``decorators.py:585-589``) to an ``inductor_cache/`` per hash
directory of its compile tree, the root is that tree (``VLLM_CACHE_ROOT/torch_compile_cache``) and the units
are those of each ``inductor_cache/`` in it, named by their path in the tree (:mod:`.vllm_compile`); with
``VLLM_DISABLE_COMPILE_CACHE=1`` vLLM leaves Inductor's own directory as it is.

Units, each named by Inductor's own hash:

- every file under ``fxgraph/`` and ``aotautograd/`` (one cached graph or candidate entry, written whole by
  ``write_atomic``: a dot-file renamed into place, codecache.py);
- in each code directory (``<2 chars>/``), the files that share a stem (``<hash>.py``; ``<hash>.main.cpp``
  with the ``.so`` built from it). A group with a ``.cpp`` is complete only with its ``.so``, while no build
  holds ``locks/<hash>.lock`` and no ``<name>_CxxBuild`` directory of a build cut short is left beside it:
  the C++ compiler writes the ``.so`` in place under that lock (``_worker_compile_cpp``, cpp_builder.py).

``triton/`` is Triton's own cache (Inductor points ``TRITON_CACHE_DIR`` there): the ``triton`` family's.
Fingerprint: torch (``torch_key``), triton (``triton_key``), the C++ compiler, the arch.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

from jitwarm.kernels.libraries.jit_caches import vllm_compile
from jitwarm.kernels.libraries.jit_caches.backend import bind
from jitwarm.kernels.libraries.jit_caches.units import (
    SGLANG,
    VLLM,
    Library,
    lock_held,
    regular_files,
    sglang_dir,
    subdirs,
    tree_files,
)

#: Top-level directories that hold no units of this family.
_NOT_UNITS = ("locks", "triton")
_WHOLE_FILES = ("fxgraph", "aotautograd")
_BUILD_DIR = "_CxxBuild"  # cpp_builder.py: _BUILD_TEMP_DIR


def resolve(environ: Mapping[str, str], server: str) -> Path:
    """Inductor's ``cache_dir()`` in ``environ`` under ``server`` (vLLM's: its whole compile tree)."""
    tree = vllm_compile.resolve(environ) if server == VLLM else None
    if tree is not None:
        return tree
    if environ.get("TORCHINDUCTOR_CACHE_DIR") is not None:
        return Path(environ["TORCHINDUCTOR_CACHE_DIR"])
    if server == SGLANG:
        return sglang_dir(environ, "inductor")
    try:
        import getpass

        user = getpass.getuser()
    except (KeyError, ImportError, OSError):
        user = f"uid_{os.getuid()}"
    return Path(tempfile.gettempdir()) / f"torchinductor_{user}"


def _units(root: Path) -> dict[str, tuple[str, ...]]:
    """The complete units of one Inductor cache directory (see the module docstring)."""
    found: dict[str, tuple[str, ...]] = {}
    for top in subdirs(root):
        if top.name in _NOT_UNITS:
            continue
        if top.name in _WHOLE_FILES:
            for rel in tree_files(top):
                found[f"{top.name}/{rel}"] = (f"{top.name}/{rel}",)
            continue
        groups: dict[str, list[str]] = {}
        names = list(regular_files(top))
        building = {p.name for p in subdirs(top) if p.name.endswith(_BUILD_DIR)}
        for name in names:
            groups.setdefault(name.split(".", 1)[0], []).append(name)
        for stem, members in groups.items():
            if any(m.endswith(".cpp") for m in members) and not any(m.endswith(".so") for m in members):
                continue  # its .so is not built (yet)
            if any(b.startswith(stem) for b in building) or lock_held(root / "locks" / f"{stem}.lock"):
                continue  # a build of it is running, or was cut short and its .so may be torn
            found[f"{top.name}/{stem}"] = tuple(sorted(f"{top.name}/{m}" for m in members))
    return found


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


# The .so last: Inductor builds a group's .cpp only while the .so is absent.
LIBRARY = Library("inductor", "inductor_cache", resolve, vllm_compile.in_tree(_units, vllm_compile.inductor_dirs),
                  ("torch", "triton", "cxx", "arch"), unit_is_dir=False, is_commit=lambda rel: rel.endswith(".so"))
name, description, build, check, load = bind(LIBRARY)
