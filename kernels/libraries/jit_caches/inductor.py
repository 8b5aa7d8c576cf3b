"""PyTorch Inductor's cache (``TORCHINDUCTOR_CACHE_DIR``): FX graphs, AOTAutograd entries, generated code.

Where (torch/_inductor/runtime/cache_dir_utils.py, ``cache_dir``): ``TORCHINDUCTOR_CACHE_DIR``, else
``$TMPDIR/torchinductor_<user>``; under sglang, ``<SGLANG_CACHE_DIR>/inductor`` (``redirect_third_party_caches``,
srt/environ.py:2308-2320).

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
from collections.abc import Mapping
from pathlib import Path

from jitwarm.kernels.libraries.jit_caches.backend import bind
from jitwarm.kernels.libraries.jit_caches.units import (
    Library,
    lock_held,
    regular_files,
    sglang_base,
    subdirs,
    tree_files,
)

#: Top-level directories that hold no units of this family.
_NOT_UNITS = ("locks", "triton")
_WHOLE_FILES = ("fxgraph", "aotautograd")
_BUILD_DIR = "_CxxBuild"  # cpp_builder.py: _BUILD_TEMP_DIR


def resolve(environ: Mapping[str, str], under_sglang: bool) -> Path:
    """Inductor's ``cache_dir()`` in ``environ``."""
    if environ.get("TORCHINDUCTOR_CACHE_DIR") is not None:
        return Path(environ["TORCHINDUCTOR_CACHE_DIR"])
    if under_sglang:
        return Path(sglang_base(environ)) / "inductor"
    try:
        import getpass

        user = getpass.getuser()
    except (KeyError, ImportError, OSError):
        user = f"uid_{os.getuid()}"
    return Path(tempfile.gettempdir()) / f"torchinductor_{user}"


def units(root: Path) -> dict[str, tuple[str, ...]]:
    """The complete units under ``root`` (see the module docstring)."""
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


def _so_last(files: tuple[str, ...]) -> tuple[str, ...]:
    """The ``.so`` last: Inductor builds a group's ``.cpp`` only while the ``.so`` is absent."""
    return tuple(sorted(files, key=lambda rel: (rel.endswith(".so"), rel)))


LIBRARY = Library("inductor", "inductor_cache", resolve, units, ("torch", "triton", "cxx", "arch"),
                  unit_is_dir=False, commit_last=_so_last)
name, description, build, check, load = bind(LIBRARY)
