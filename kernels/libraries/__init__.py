"""The server's JIT libraries, one room each: how each library's cache is keyed, served and replayed.

A room is a subpackage whose ``__init__`` declares ``KINDS = {kind: (backend module, abilities)}`` and imports
nothing of its library; a new room is listed in :data:`ROOMS` (docs/kernels.md).
"""

from __future__ import annotations

from jitwarm.kernels.libraries import jit_caches, sglang_jit, triton

#: The rooms, in the order their kinds are listed.
ROOMS = (triton, sglang_jit, jit_caches)

#: Every library kind: name -> (backend module, abilities).
LIBRARY_KINDS: dict[str, tuple[str, tuple[str, ...]]] = {k: v for room in ROOMS for k, v in room.KINDS.items()}
