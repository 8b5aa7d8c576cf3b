"""The server's Triton kernels: replayed from records, captured from its compiles, served through its cache manager.

- :mod:`.backend`: the ``triton_jit`` kind, keyed by Triton's own cache key (docs/triton.md).
- :mod:`.cache`: ``TRITON_CACHE_MANAGER=jitwarm.kernels.libraries.triton.cache:CacheManager``.
- :mod:`.driver`: every use of Triton's driver and backend internals, also by jitwarm's own Triton backend.

Importing this package imports nothing of Triton.
"""

from __future__ import annotations

KINDS = {"triton_jit": ("jitwarm.kernels.libraries.triton.backend", ("replay", "capture"))}
