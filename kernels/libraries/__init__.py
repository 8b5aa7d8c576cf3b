"""The server's JIT libraries, one room each: how each library's cache is keyed, served and replayed.

jitwarm's own kernel families and their two backends (``tvm_ffi``, ``triton``) are the kernels layer's core.
The server's kernels come from JIT libraries with caches of their own; jitwarm fills those caches ahead of
time and hands them over at start. Each library is one subpackage here, and nothing outside it imports the
library's private names:

- ``triton``: the server's ``@triton.jit`` kernels (kind ``triton_jit``), replayed from records and
  captured from the server's compiles through Triton's ``TRITON_CACHE_MANAGER``; every use of Triton's
  driver internals is in its ``driver`` module.
- ``sglang_jit``: sglang's ``load_jit`` modules (kind ``sglang_jit``), replayed from records in child
  processes and handed over into sglang's JIT cache.

The contract of a room (TileLang, DeepGEMM, Inductor and FlashInfer caches are the next ones):

1. Its ``__init__`` declares ``KINDS``: ``{kind: (module, abilities)}``, the backend module of each kind it
   adds and what that kind can do (``build``, ``replay`` from a record, ``capture`` from a run; see
   :func:`jitwarm.kernels.backend.refusal`). It imports nothing of the library.
2. Each backend module implements :class:`jitwarm.kernels.backend.Backend`: ``description`` computed with
   the library's own key (so jitwarm's key changes exactly when the library's does), ``build`` (a replay
   run by the library itself), ``check`` before an entry is sealed, and ``load``, which hands the entry to
   the library's cache. Every spec goes through :class:`jitwarm.kernels.artifacts.Artifact`: files
   captured from a run are sealed with ``Artifact.get_or_build(capture=...)``, so they are checked as a
   build is, and whatever a consumer reads is read under the entry's claim (``Artifact.load`` /
   ``Artifact.read``), so a prune never deletes it underneath.
3. A record kind for it in :mod:`jitwarm.precompile.manifest` and, when the server's run is recorded, a
   recorder in :mod:`jitwarm.precompile.recording`.

Adding a room: a new subpackage, its ``KINDS`` listed in :data:`ROOMS` below.
"""

from __future__ import annotations

from jitwarm.kernels.libraries import jit_caches, sglang_jit, triton

#: The rooms, in the order their kinds are listed.
ROOMS = (triton, sglang_jit, jit_caches)

#: Every library kind: name -> (backend module, abilities).
LIBRARY_KINDS: dict[str, tuple[str, tuple[str, ...]]] = {k: v for room in ROOMS for k, v in room.KINDS.items()}
