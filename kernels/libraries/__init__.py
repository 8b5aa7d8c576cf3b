"""The server's JIT libraries, one room each: how each library's cache is keyed, served and replayed.

A room is a subpackage whose ``__init__`` declares ``KINDS = {kind: (backend module, abilities)}`` (``build``,
``replay`` from a record, ``capture`` from a run; :func:`jitwarm.kernels.backend.refusal`) and imports nothing
of its library. Each kind's backend implements :class:`jitwarm.kernels.backend.Backend` with the library's own
key and goes through :class:`jitwarm.kernels.artifacts.Artifact`: captured files are sealed with
``get_or_build(capture=...)`` and checked as a build is; what a consumer reads is read under the entry's claim.
Nothing outside a room imports its library's private names. A new room: a subpackage, listed in :data:`ROOMS`
(docs/kernels.md).
"""

from __future__ import annotations

from jitwarm.kernels.libraries import jit_caches, sglang_jit, triton

#: The rooms, in the order their kinds are listed.
ROOMS = (triton, sglang_jit, jit_caches)

#: Every library kind: name -> (backend module, abilities).
LIBRARY_KINDS: dict[str, tuple[str, tuple[str, ...]]] = {k: v for room in ROOMS for k, v in room.KINDS.items()}
