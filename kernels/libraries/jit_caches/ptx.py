"""The CUDA driver's PTX JIT cache (``CUDA_CACHE_PATH``): PTX the driver compiled to SASS for this GPU.

Where (CUDA's environment variables): ``CUDA_CACHE_PATH``, else ``~/.nv/ComputeCache``; under sglang
``<SGLANG_CACHE_DIR>/nv`` (srt/environ.py:2308-2320). The driver keys its entries by the PTX, the options,
the GPU and its own version: a driver upgrade invalidates the cache, so the driver version is in the
fingerprint.

The driver keeps one ``index`` file naming every entry of the tree, so the tree is one unit (``.``): complete
when its index is there, new when any file was added. Restored whole into an empty cache, or file by file
beside the node's own entries with the index last; an index the node's driver wrote itself is kept.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from jitwarm.kernels.libraries.jit_caches.backend import bind
from jitwarm.kernels.libraries.jit_caches.units import Library, sglang_base, tree_files

INDEX = "index"


def resolve(environ: Mapping[str, str], under_sglang: bool) -> Path:
    """The driver's ``CUDA_CACHE_PATH`` in ``environ``."""
    if environ.get("CUDA_CACHE_PATH"):
        return Path(environ["CUDA_CACHE_PATH"])
    if under_sglang:
        return Path(sglang_base(environ)) / "nv"
    return Path("~").expanduser() / ".nv" / "ComputeCache"


def units(root: Path) -> dict[str, tuple[str, ...]]:
    """The whole tree as one unit, once the driver has written its index."""
    files = tree_files(root)
    return {".": tuple(files)} if INDEX in files else {}


def _index_last(files: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(sorted(files, key=lambda rel: (rel == INDEX, rel)))


LIBRARY = Library("ptx", "cuda_ptx_cache", resolve, units, ("driver", "arch"), commit_last=_index_last)
name, description, build, check, load = bind(LIBRARY)
