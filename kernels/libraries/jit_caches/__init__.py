"""The JIT caches a server's libraries fill at start, one module a family (docs/kernels.md): capture only.

This package names no server: where a server moves a cache, its room says so (``ServerAdapter.cache_dirs``).
Each family is a kind of :data:`jitwarm.kernels.kinds.KINDS` (``kinds.cache``); the names below are derived
from that registry when this package is imported.
"""

from __future__ import annotations

from jitwarm.kernels import kinds

#: library name -> its kind (the backend name of its units' specs), in the order they are captured and reported.
KIND_OF = {k.family: k.name for k in kinds.caches()}
#: library name -> the module that implements it.
MODULES = {k.family: k.module.rpartition(".")[2] for k in kinds.caches()}
