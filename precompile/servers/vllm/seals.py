"""vLLM's own JIT inside a guarded capture: nothing of vLLM's to seal beyond what jitwarm seals for every server.

vLLM 0.33.0 compiles through Triton, torch.compile (Inductor) and FlashInfer / DeepGEMM; the Triton compiles are
refused inside capture by jitwarm's Triton seal, which the capture guard arms for every server. vLLM's own JIT
monitor only starts after capture (``utils/jit_monitor.py:15-20``, started at ``v1/worker/gpu_worker.py:1110``),
so there is no vLLM loader of its own to seal here.
"""

from __future__ import annotations

from typing import Any


def seal(undo: list[Any]) -> None:
    """Nothing to seal (see the module docstring); ``undo`` is left as it is."""
    del undo
