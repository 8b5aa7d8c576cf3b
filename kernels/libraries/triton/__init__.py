"""The server's Triton kernels (docs/triton.md): ``backend`` (kind triton_jit), ``cache``, ``driver``."""

from __future__ import annotations

KINDS = {"triton_jit": ("jitwarm.kernels.libraries.triton.backend", ("replay", "capture"))}
