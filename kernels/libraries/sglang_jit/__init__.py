"""sglang's ``load_jit`` modules: replayed from records by sglang itself, handed over into sglang's JIT cache.

- :mod:`.backend`: the ``sglang_jit`` kind (docs/kernels.md).
- :mod:`.child`: sglang's ``load_jit`` run in child processes, both sides of that boundary.

Importing this package imports nothing of sglang.
"""

from __future__ import annotations

KINDS = {"sglang_jit": ("jitwarm.kernels.libraries.sglang_jit.backend", ("replay",))}
