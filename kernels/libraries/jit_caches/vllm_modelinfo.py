"""vLLM's model inspection cache (``modelinfos``, registry.py:966-1031): one ``<module>-<class>.json`` a unit.

It spares about 20 s of a cold start on vLLM's CPU build; a stale one is inspected again, never trusted.
"""

from __future__ import annotations

from pathlib import Path

from jitwarm.kernels.kinds import named
from jitwarm.kernels.libraries.jit_caches.census import bind
from jitwarm.kernels.libraries.jit_caches.units import Library, regular_files, server_own

DIR = "modelinfos"


def units(root: Path) -> dict[str, tuple[str, ...]]:
    """Each inspection result ``<module>-<class>.json`` (dot-files are vLLM's writes in progress)."""
    return {name: (name,) for name in regular_files(root) if name.endswith(".json")}


LIBRARY = Library(*named("vllm_modelinfo"), server_own, units, ("vllm",), unit_is_dir=False)
name, description, build, check, load = bind(LIBRARY)
