"""sglang's CuTe DSL AOT cache (kernels/jit/cute_aot_cache.py): a unit is one ``.o``, ``os.replace``d whole."""

from __future__ import annotations

from pathlib import Path

from jitwarm.kernels.kinds import named
from jitwarm.kernels.libraries.jit_caches.census import bind
from jitwarm.kernels.libraries.jit_caches.units import Library, server_own, tree_files


def units(root: Path) -> dict[str, tuple[str, ...]]:
    """Every object file under ``root``."""
    return {rel: (rel,) for rel in tree_files(root) if rel.endswith(".o")}


LIBRARY = Library(*named("cute_dsl"), server_own, units, ("cutlass-dsl", "sglang", "arch"), unit_is_dir=False)
name, description, build, check, load = bind(LIBRARY)
