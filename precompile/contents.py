"""What a bundle says it holds (its manifest, jitwarm's specs, what its exporter saw), and ``jitwarm inspect``.

``about`` holds the manifest of the bundle's recorded kernels and captured units, jitwarm's own specs, and what
the exporting run saw: the server, its release, the variables that place the caches.

The cache carries this object unread in ``bundle.json`` (``about``); a bundle without it (an older jitwarm's)
still imports, and then only ``--manifest`` or a server line says what it should restore.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from jitwarm.cache.errors import EXIT_OK, CacheError, Refused, UsageError
from jitwarm.kernels import KernelSpec, SpecError, ToolchainError
from jitwarm.kernels.artifacts import artifact
from jitwarm.precompile import servers
from jitwarm.precompile.plan import WarmPlan

VERSION = 1
#: The variables that decide where a server's libraries keep their caches (the rooms' and the libraries' own),
#: and the plugins' switches: what the exporting run had is kept beside its manifest.
PLACING = ("HOME", "TMPDIR", "XDG_CACHE_HOME", "VLLM_CACHE_ROOT", "VLLM_DISABLE_COMPILE_CACHE", "VLLM_USE_AOT_COMPILE",
           "VLLM_PLUGINS", "SGLANG_CACHE_DIR", "SGLANG_JIT_CACHE_DIR", "SGLANG_DG_CACHE_DIR",
           "SGLANG_CUTE_AOT_CACHE_DIR", "SGLANG_PLUGINS", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TRITON_HOME",
           "CUDA_CACHE_PATH", "TILELANG_CACHE_DIR", "DG_JIT_CACHE_DIR", "FLASHINFER_WORKSPACE_BASE")


def about(cache: Any, keys: Iterable[str], manifests: Iterable[str | os.PathLike[str]] = (),
          specs: Iterable[KernelSpec] = (), environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The ``about`` object of a bundle of ``keys``: the records of ``manifests`` and the ``specs`` it holds."""
    from jitwarm.precompile.manifest import read_manifest, record_id, spec_of
    from jitwarm.precompile.plan import captured_env

    env = os.environ if environ is None else environ
    wanted = set(keys)
    records: dict[str, dict[str, Any]] = {}
    for path in manifests:
        for record in read_manifest(path):
            # the capture record (how `jitwarm capture` ran the server) names no kernel: it travels with its manifest
            if record["kind"] == "capture" or _key(spec_of(record), cache) in wanted:
                records.setdefault(record_id(record), record)
    own = [s.to_json() for s in dict.fromkeys(specs) if _key(s, cache) in wanted]
    under = sorted({str(r.get("under") or r.get("server") or "") for r in records.values()} - {""})
    release = ", ".join(_release(room) for room in under) or None
    return {"v": VERSION, "manifest": list(records.values()), "specs": own,
            "made": {"server": ", ".join(under) or None, "release": release,
                     # the cache variables here, and the plugin variable as capture set it in the server's
                     "environment": {**{name: env[name] for name in PLACING if name in env},
                                     **(captured_env(records.values()) or {})},
                     "roots": _roots(records.values(), env)}}


def _key(spec: KernelSpec, cache: Any) -> str | None:
    """``spec``'s key, its toolchain facts read and never written; None when it cannot be keyed here."""
    facts = SimpleNamespace(read_fact=cache.read_fact, write_fact=lambda name, value: None)
    try:
        return artifact(spec, facts).key
    except (SpecError, ToolchainError):
        return None


def _release(room: str) -> str:
    from jitwarm.kernels.libraries.jit_caches import fingerprint as fp

    return fp.package_version((room,))


def _roots(records: Iterable[Mapping[str, Any]], environ: Mapping[str, str]) -> dict[str, str | None]:
    """Each captured library's cache directory in ``environ``, under the server its units were recorded under."""
    from jitwarm.kernels.libraries.jit_caches.census import library

    roots = {}
    for record in records:
        if record.get("kind") == "jit_cache" and record["library"] not in roots:
            root = library(record["library"]).root(environ, servers.cache_dirs(str(record.get("under", "")), environ))
            roots[record["library"]] = None if root is None else str(root)
    return roots


def with_bundle(plan: WarmPlan, made: Mapping[str, Any] | None, where: str,
                targets: Iterable[str] | None) -> WarmPlan:
    """``plan`` plus what the bundle's ``about`` says it holds (``targets``: the records made there; None: all).

    jitwarm's own specs join only a plan without a config: a server line's plan says which of them the server
    needs (a bundle exported for another plan supplies none of them, and prestart says so). ManifestError (exit 2)
    for an ``about`` whose records are not records; nothing added without one.
    """
    from jitwarm.precompile.manifest import ManifestError, check_record, specs_of
    from jitwarm.precompile.plan import captured_env

    if made is None:
        return plan
    records, own = made.get("manifest", []), made.get("specs", [])
    if not isinstance(records, list) or not isinstance(own, list):
        raise ManifestError(f"bundle {where}: its bundle.json's about is not jitwarm's (manifest, specs)")
    records = [check_record(r, f"bundle {where}: manifest record {i + 1}") for i, r in enumerate(records)]
    recorded, other = specs_of(records, targets)
    try:
        planned = [KernelSpec.from_json(s) for s in own]
    except (KeyError, TypeError, ValueError, AttributeError):
        raise ManifestError(f"bundle {where}: a spec of its bundle.json is not a kernel spec") from None
    wanted = set(targets) if targets is not None else None
    planned = [s for s in planned if (wanted is None or s.target in wanted) and plan.config is None]
    new = tuple(s for s in dict.fromkeys([*planned, *recorded]) if s not in plan.needed_by)
    before = plan.manifest or {"path": "", "records": 0, "other_targets": 0}
    manifest = {"path": ", ".join(p for p in (before["path"], f"bundle {where}") if p),
                "records": before["records"] + len(records), "other_targets": before["other_targets"] + other,
                "captured_env": before.get("captured_env") or captured_env(records)}
    return replace(plan, specs=plan.specs + new, needed_by={**plan.needed_by, **{s: () for s in new}},
                   manifest=manifest)


def cmd_inspect(args: argparse.Namespace, plan: None) -> int:
    """List each entry of a bundle file: family, size, fingerprint and where it would be restored here."""
    from jitwarm.cache.bundle_index import read_index
    from jitwarm.cache.remote.s3_bundle import is_bundle_url

    if is_bundle_url(args.path):
        raise UsageError("inspect reads a bundle file: download the object first (aws s3 cp s3://... kernels.tar)")
    if not Path(args.path).is_file():
        raise UsageError(f"bundle {args.path} does not exist or is not a file")
    try:
        index = read_index(args.path)
    except CacheError as exc:
        raise Refused(exc.reason, exc.hint) from exc
    units = _units(index)
    made = (index.about or {}).get("made")
    if args.json:
        print(json.dumps({"path": args.path, "entries": len(index.sizes), "bytes": sum(index.sizes.values()),
                          "about": index.about is not None, "made": made, "units": units}))
        return EXIT_OK
    print(f"bundle {args.path}: {len(index.sizes)} entries, {sum(index.sizes.values()) / 2**20:.1f} MiB; "
          + ("no manifest (an older jitwarm's bundle, or exported without one)" if index.about is None else
             f"its manifest names {_kernel_records(index.about)} records, {len(index.about.get('specs', []))}"
             " of jitwarm's specs"))
    if made:
        env = " ".join(f"{k}={v}" for k, v in sorted(made.get("environment", {}).items()))
        print(f"  made under {_made_under(made)}; environment: {env or '(none of the cache variables set)'}")
    for unit in units:
        fp = ", ".join(f"{k}={v}" for k, v in sorted(unit["fingerprint"].items())[:6])
        more = len(unit["fingerprint"]) - 6
        print(f"  {unit['family']:<14} {unit['size']:>12,} B  {unit['unit']}\n"
              f"      fingerprint: {fp or '-'}{f' and {more} more' if more > 0 else ''}\n"
              f"      here: {unit['here'] or unit['why_not_here']}")
    return EXIT_OK


def _units(index: Any) -> list[dict[str, Any]]:
    """Each entry as ``inspect`` shows it, its destination resolved in this process's environment."""
    from jitwarm.kernels.libraries.jit_caches.census import library

    under = {}
    for record in (index.about or {}).get("manifest", []):
        if isinstance(record, dict) and record.get("kind") == "jit_cache":
            under[(record.get("library"), record.get("unit"))] = str(record.get("under", ""))
    found = []
    for key, described in sorted(index.descriptions.items()):
        family = str(described.get("library") or described.get("family") or "?")
        unit = str(described.get("unit") or described.get("kernel") or described.get("module") or key[:16])
        here, why = None, None
        if "unit" in described and "library" in described:
            try:
                lib = library(family)
                root = lib.root(None, servers.cache_dirs(under.get((family, unit), "")))
            except KeyError:
                root, why = None, f"no JIT cache family {family} in this jitwarm"
            else:
                here = None if root is None else str(root if unit == "." else root / unit)
                why = why or (None if root is not None else "its cache is turned off here")
        else:
            why = "jitwarm's cache only (loaded from there)"
        fingerprint = described.get("fingerprint")
        found.append({"key": key, "family": family, "unit": unit, "size": index.sizes.get(key, 0),
                      "target": described.get("target"),
                      "fingerprint": fingerprint if isinstance(fingerprint, dict) else {},
                      "here": here, "why_not_here": why})
    return found


def say_bundle(report: Any, where: str, file: Any = sys.stderr) -> None:
    """One line on what an imported bundle carries about itself (nothing for an older bundle)."""
    made = (report.about or {}).get("made") if report.about else None
    if made:
        print(f"jitwarm: bundle {where} was made under {_made_under(made)}, holding {_kernel_records(report.about)} "
              f"recorded kernels and cache units and {len(report.about.get('specs', []))} of jitwarm's specs",
              file=file)


def _made_under(made: Mapping[str, Any]) -> str:
    """``vllm 0.32.0+cpu``: the server and release a bundle was made under, or ``no server``."""
    return " ".join(str(w) for w in (made.get("server"), made.get("release")) if w) or "no server"


def _kernel_records(about: Mapping[str, Any]) -> int:
    """How many of a bundle's manifest records name a kernel or a cache unit (not how capture ran the server)."""
    return sum(1 for r in about.get("manifest", []) if isinstance(r, dict) and r.get("kind") != "capture")
