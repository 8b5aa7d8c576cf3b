"""The server's Triton kernels (docs/triton.md): ``backend`` (kind triton_jit), ``cache``, ``driver``."""

from __future__ import annotations

#: The kind of the room's specs, and the target of a spec captured from the server's Triton (its real target is
#: in Triton's key).
NAME, SERVED = "triton_jit", "served"
