"""WarmPlan: every kernel spec a serving config's capture ladder needs, in first-needed order."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from jitwarm.kernels import FAMILIES, KernelSpec
from jitwarm.precompile.config import ServingConfig
from jitwarm.precompile.servers import ModelFamilies
from jitwarm.precompile.shapes import CaptureShape, Ladder, resolve_ladder


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
    manifest: dict[str, Any] | None = None  # the recorded kernels' source: {"path", "records", "other_targets"}
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
                       manifest={"path": ", ".join(paths), "records": len(records), "other_targets": other})

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
        # overwrote the first's new specs (issue #31: the table listed none, or one spec on many rows).
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

