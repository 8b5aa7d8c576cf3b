"""The server's JIT libraries, one room each: how each library's cache is keyed, served and replayed.

A room is a subpackage that imports nothing of its library until used; each of its kinds is one line of
:data:`jitwarm.kernels.kinds.KINDS` (docs/kernels.md).
"""
