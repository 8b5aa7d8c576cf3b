"""sglang's CuTe DSL AOT cache (``SGLANG_CUTE_AOT_CACHE_DIR``): compiled objects loaded into the process.

Where (srt/environ.py:1387; kernels/jit/cute_aot_cache.py, ``get_jit_cache``): ``SGLANG_CUTE_AOT_CACHE_DIR``,
default ``<SGLANG_CACHE_DIR>/cute_aot``, under sglang or not; empty turns the persistent cache off. Objects are
namespaced under a source-fingerprint directory (CuTe's version, CUDA version, arch, the sources' hash).

A unit is one object ``<sha256 of the compile key>.o``, exported to a dot-file and ``os.replace``d into place
under the key's ``.lock`` (``_export_to_disk``), so always whole. sglang loads these objects as code: the
directory must be trusted, as jitwarm's cache is.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from jitwarm.kernels.libraries.jit_caches.census import bind
from jitwarm.kernels.libraries.jit_caches.units import Library, sglang_dir, tree_files


def resolve(environ: Mapping[str, str], server: str) -> Path | None:
    """The ``SGLANG_CUTE_AOT_CACHE_DIR`` sglang reads in ``environ`` (None: turned off)."""
    value = environ.get("SGLANG_CUTE_AOT_CACHE_DIR")
    if value is not None:
        return Path(value) if value else None
    return sglang_dir(environ, "cute_aot")


def units(root: Path) -> dict[str, tuple[str, ...]]:
    """Every object file under ``root``."""
    return {rel: (rel,) for rel in tree_files(root) if rel.endswith(".o")}


LIBRARY = Library("cute_dsl", "cute_dsl_cache", resolve, units, ("cutlass-dsl", "sglang", "arch"), unit_is_dir=False)
name, description, build, check, load = bind(LIBRARY)
