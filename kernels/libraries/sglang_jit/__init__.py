"""sglang's ``load_jit`` modules: ``backend`` (kind sglang_jit) and ``child`` (its loader in child processes)."""

from __future__ import annotations

