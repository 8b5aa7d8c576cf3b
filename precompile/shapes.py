"""Capture shapes: the decode graphs a config's server captures, each with its graph key and verify_lens."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from jitwarm.cache.errors import UsageError
from jitwarm.kernels import VerifyLayout
from jitwarm.precompile.config import ConfigError, ServingConfig, local_gpu_memory_mb


@dataclass(frozen=True)
class CaptureShape:
    """One CUDA graph the server captures: its batch size, verify layout and key (token count for compact graphs)."""

    bs: int
    layout: VerifyLayout
    graph_key: int
    key: str | None = None  # how the server dispatches the graph, in its own terms (vLLM: mode and batch descriptor)

    @property
    def num_tokens(self) -> int:
        """Tokens in the captured batch."""
        return self.layout.num_tokens


@dataclass(frozen=True)
class Ladder:
    """The resolved decode capture of a config: ``shapes`` largest first (none: ``disabled`` says why)."""

    source: str
    shapes: tuple[CaptureShape, ...]
    capture_bs: tuple[int, ...]
    width: int  # tokens per request (1, or a speculative verify's draft tokens)
    compact: bool
    max_running_requests: int | None
    gpu_memory_mb: int | None  # the memory the default max batch was taken from, when it mattered
    disabled: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The resolution as ``jitwarm plan --json`` reports it."""
        return {"source": self.source, "capture_bs": list(self.capture_bs), "width": self.width,
                "compact": self.compact, "max_running_requests": self.max_running_requests,
                "gpu_memory_mb": self.gpu_memory_mb, "disabled": self.disabled}


@functools.lru_cache(maxsize=64)
def resolve_ladder(config: ServingConfig) -> Ladder:
    """Resolve the decode graphs ``config``'s server captures, once per config; ConfigError when it cannot."""
    room = config.room
    assert room is not None  # a ServingConfig names a room: construction checks it
    inputs = room.ladder_inputs(config)
    if inputs["gpu_memory_mb"] is None and room.needs_memory(inputs):
        inputs["gpu_memory_mb"] = local_gpu_memory_mb()
        if inputs["gpu_memory_mb"] is None:
            raise ConfigError(["the capture ladder depends on the GPU's memory (the server's default max batch) "
                               "and there is no GPU here: give --gpu-memory-mb N (an H200 has 143771) or "
                               "--cuda-graph-max-bs-decode N"])
    try:
        result = room.resolve_ladder(inputs, config.ladder_source)
    except UsageError as exc:
        raise ConfigError([str(exc)]) from None
    shapes = tuple(CaptureShape(s["bs"], VerifyLayout(tuple(s["verify_lens"])), s["graph_key"], s.get("key"))
                   for s in result["shapes"])
    return Ladder(source=result["source"], shapes=shapes, capture_bs=tuple(result.get("capture_bs", ())),
                  width=result.get("width", 1), compact=result.get("compact", False),
                  max_running_requests=result.get("max_running_requests"), gpu_memory_mb=inputs["gpu_memory_mb"],
                  disabled=result.get("disabled"))


def capture_shapes(config: ServingConfig) -> list[CaptureShape]:
    """Return every shape the server captures, in capture order (largest batch first)."""
    return list(resolve_ladder(config).shapes)


def capture_batch_sizes(config: ServingConfig) -> list[int]:
    """Return the batch sizes the server captures, ascending."""
    return list(resolve_ladder(config).capture_bs)


def verify_lens_for(config: ServingConfig, bs: int) -> tuple[int, ...]:
    """Return the ``verify_lens`` the captured batch of ``bs`` requests carries (KeyError: not captured)."""
    for shape in resolve_ladder(config).shapes:
        if shape.bs == bs:
            return shape.layout.verify_lens
    raise KeyError(f"bs={bs} is not captured for this config")
