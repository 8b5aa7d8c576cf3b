"""sglang's ``load_jit`` calls as manifest records (``sglang_jit``: ``module``, ``call``, ``target``) and back.

Light on purpose: reading a manifest (``jitwarm plan --manifest``) imports this, never sglang's loader.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from jitwarm.kernels.spec import KernelSpec

FIELDS = ("module", "target", "call")
#: sglang's target name, ``<major>.<minor><suffix>`` (``9.0a``).
_ARCH = re.compile(r"(\d+)\.(\d+)(\w*)")


def record_problem(kind: Any, record: Mapping[str, Any]) -> str | None:
    """Why ``record`` is not an ``sglang_jit`` record, or None."""
    del kind
    missing = next((f for f in FIELDS if f not in record), None)
    if missing is not None:
        return f"an sglang_jit record needs {missing!r}"
    if not (isinstance(record["module"], str) and isinstance(record["call"], dict)):
        return "an sglang_jit record names its module and carries the load_jit call"
    return None


def spec_of(kind: Any, record: Mapping[str, Any]) -> KernelSpec:
    """The spec that replays a ``load_jit`` call (its backend reads everything it needs from the params)."""
    call = json.dumps(record["call"], sort_keys=True, separators=(",", ":"))
    params = {"call": call, "sglang": str(record.get("sglang", ""))}
    arch = record.get("arch")
    if isinstance(arch, dict):  # sglang's full target with its suffix, "9.0a" (ArchInfo.target_name, utils/arch.py:33)
        params["arch"] = f"{arch.get('major')}.{arch.get('minor')}{arch.get('suffix') or ''}"
    return KernelSpec(record["module"], kind.name, record["target"], params)


def record_of(kind: Any, spec: KernelSpec) -> dict[str, Any]:
    """The ``sglang_jit`` record body of a replayed spec (the arch as its params carry it)."""
    del kind
    params = spec.params_dict
    body = {"kind": "sglang_jit", "module": spec.family, "target": spec.target, "call": json.loads(str(params["call"])),
            "sglang": str(params.get("sglang", ""))}
    arch = _ARCH.fullmatch(str(params.get("arch", "")))
    if arch:
        body["arch"] = {"major": int(arch[1]), "minor": int(arch[2]), "suffix": arch[3]}
    return body
