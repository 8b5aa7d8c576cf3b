"""The capture ladder a config's server resolves, and WarmPlan: every kernel spec it needs, in first-needed order."""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from jitwarm.cache.errors import UsageError
from jitwarm.kernels import FAMILIES, KernelSpec, VerifyLayout
from jitwarm.precompile.config import ConfigError, ServingConfig, local_gpu_memory_mb
from jitwarm.precompile.servers import ModelFamilies


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
    max_requests: int | None  # the request pool the server resolved
    gpu_memory_mb: int | None  # the memory the default max batch was taken from, when it mattered
    disabled: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The resolution as ``jitwarm plan --json`` reports it."""
        return {"source": self.source, "capture_bs": list(self.capture_bs), "width": self.width,
                "compact": self.compact, "max_requests": self.max_requests,
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
            largest = f" or {room.FIELD_FLAGS['graph_max_bs']} N" if "graph_max_bs" in room.FIELD_FLAGS else ""
            raise ConfigError(["the capture ladder depends on the GPU's memory (the server's default max batch) "
                               f"and there is no GPU here: give --gpu-memory-mb N (an H200 has 143771){largest}"])
    try:
        result = room.resolve_ladder(inputs, config.ladder_source)
    except UsageError as exc:
        raise ConfigError([str(exc)]) from None
    shapes = tuple(CaptureShape(s["bs"], VerifyLayout(tuple(s["verify_lens"])), s["graph_key"], s.get("key"))
                   for s in result["shapes"])
    return Ladder(source=result["source"], shapes=shapes, capture_bs=tuple(result.get("capture_bs", ())),
                  width=result.get("width", 1), compact=result.get("compact", False),
                  max_requests=result.get("max_requests"), gpu_memory_mb=inputs["gpu_memory_mb"],
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


@dataclass(frozen=True)
class WarmPlan:
    """The unique kernel specs of a capture ladder, in the order capture first needs them, and which shapes need each.

    ``plan_id`` hashes the sorted spec set: two configs that need the same kernels share a plan id and record.
    """

    config: ServingConfig | None
    shapes: tuple[CaptureShape, ...]
    specs: tuple[KernelSpec, ...]
    needed_by: dict[KernelSpec, tuple[int, ...]]
    introduced: dict[CaptureShape, tuple[KernelSpec, ...]]
    ladder: Ladder | None = None
    #: the recorded kernels' source: {"path", "records", "other_targets", "captured_env"}
    manifest: dict[str, Any] | None = None
    families: ModelFamilies | None = None

    @classmethod
    def empty(cls) -> WarmPlan:
        """A plan of no capture shapes (``--manifest`` alone starts from it)."""
        return cls(None, (), (), {}, {})

    def with_manifests(self, paths: Iterable[str | os.PathLike[str]],
                       targets: Iterable[str] | None = None) -> WarmPlan:
        """Return the plan plus the kernels recorded in ``paths`` (``targets``: those made there; None: all)."""
        from jitwarm.precompile.manifest import read_manifest, specs_of

        paths = [str(p) for p in paths]
        records = [r for path in paths for r in read_manifest(path)]
        specs, other = specs_of(records, targets)
        new = tuple(s for s in specs if s not in self.needed_by)
        return replace(self, specs=self.specs + new, needed_by={**self.needed_by, **{s: () for s in new}},
                       manifest={"path": ", ".join(paths), "records": len(records), "other_targets": other,
                                 "captured_env": captured_env(records)})

    @property
    def recorded(self) -> tuple[KernelSpec, ...]:
        """The specs that came from a manifest (the server's own kernels)."""
        return tuple(s for s in self.specs if s.family not in FAMILIES)

    @classmethod
    def build(cls, config: ServingConfig) -> WarmPlan:
        """Map every capture shape to the specs of the families the model runs; ConfigError, UsageError."""
        ladder = resolve_ladder(config)
        assert config.room is not None  # a ServingConfig names a room: construction checks it
        families = config.room.model_families(tuple(FAMILIES), config.model_path, config.model_architecture)
        needed: dict[KernelSpec, list[int]] = {}
        # Per graph, not per batch size: vLLM captures a PIECEWISE and a FULL graph of one size, and the second
        # would overwrite the first's new specs (the table would list none, or one spec on many rows).
        introduced: dict[CaptureShape, tuple[KernelSpec, ...]] = {}
        for shape in ladder.shapes:
            specs = [spec for backend in config.backends for target in config.targets for name in families.planned
                     for spec in FAMILIES[name].specs_for(shape.layout, config.model, backend, target)]
            introduced[shape] = tuple(dict.fromkeys(s for s in specs if s not in needed))
            for spec in specs:
                needed.setdefault(spec, []).append(shape.bs)
        return cls(config, ladder.shapes, tuple(needed), {s: tuple(b) for s, b in needed.items()}, introduced,
                   ladder, families=families)

    @property
    def plan_id(self) -> str:
        """Stable id: the first 16 hex digits of sha256 over the sorted spec ids."""
        text = "\n".join(sorted(s.id for s in self.specs))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def by_family(self) -> dict[str, int]:
        """Spec count per family, in :data:`FAMILIES` order."""
        return {name: sum(1 for s in self.specs if s.family == name) for name in FAMILIES}

    def to_json(self) -> dict[str, Any]:
        """Return the plan as ``jitwarm plan --json`` prints it."""
        return {
            "plan_id": self.plan_id,
            "ladder": self.ladder.to_json() if self.ladder else None,
            "shapes": [{"bs": sh.bs, "graph_key": sh.graph_key, "num_tokens": sh.num_tokens, "slots": sh.layout.slots,
                        "verify_lens": list(sh.layout.verify_lens), "uniform": sh.layout.uniform,
                        "new_specs": [s.id for s in self.introduced[sh]], **({"key": sh.key} if sh.key else {})}
                       for sh in self.shapes],
            "specs": [dict(id=s.id, **s.to_json(), needed_by_bs=list(self.needed_by[s])) for s in self.specs],
            "manifest": self.manifest,
            "families": self.families.to_json() if self.families else None,
            "totals": {"shapes": len(self.shapes), "specs": len(self.specs), "by_family": self.by_family(),
                       "recorded": len(self.recorded)},
        }


def captured_env(records: Iterable[Mapping[str, Any]]) -> dict[str, str] | None:
    """The environment ``jitwarm capture`` ran the server with (its capture record's), None without one."""
    return next((dict(r["environment"]) for r in records if r.get("kind") == "capture"), None)
