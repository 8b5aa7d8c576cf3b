"""The server's JIT libraries, one room each: how each library's cache is keyed, served and replayed.

A room is a subpackage whose ``__init__`` declares ``KINDS = {kind: (backend module, abilities)}`` and imports
nothing of its library; a new room is listed in :data:`jitwarm.kernels.backend.ROOMS` (docs/kernels.md).
"""
