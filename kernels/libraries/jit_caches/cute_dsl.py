"""sglang's CuTe DSL AOT cache: compiled objects loaded into the process.

Where: only sglang keeps it (kernels/jit/cute_aot_cache.py, ``get_jit_cache``), so the sglang room says where
(``jitwarm.precompile.servers.sglang.caches``); outside sglang there is none. Objects are
namespaced under a source-fingerprint directory (CuTe's version, CUDA version, arch, the sources' hash).

A unit is one object ``<sha256 of the compile key>.o``, exported to a dot-file and ``os.replace``d into place
under the key's ``.lock`` (``_export_to_disk``), so always whole. sglang loads these objects as code: the
directory must be trusted, as jitwarm's cache is.
"""

from __future__ import annotations

from pathlib import Path

from jitwarm.kernels.libraries.jit_caches.census import bind
from jitwarm.kernels.libraries.jit_caches.units import Library, server_own, tree_files


def units(root: Path) -> dict[str, tuple[str, ...]]:
    """Every object file under ``root``."""
    return {rel: (rel,) for rel in tree_files(root) if rel.endswith(".o")}


LIBRARY = Library("cute_dsl", "cute_dsl_cache", server_own, units, ("cutlass-dsl", "sglang", "arch"), unit_is_dir=False)
name, description, build, check, load = bind(LIBRARY)
