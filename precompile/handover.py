"""What a node receives: a bundle imported, captured units checked against this node, and the hand-over.

The hand-over loads each recorded kernel where its server will look (a captured unit: into its library's cache,
resolved as the unit's server room resolves it here) and writes the restore's receipt. ``warm --manifest`` and
``prestart`` share it; ``import`` uses its :func:`import_bundle`.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

from jitwarm.cache.errors import CacheError, JitwarmError, Refused, UsageError
from jitwarm.cache.remote.s3_bundle import is_bundle_url, split_url
from jitwarm.kernels import KernelSpec, LoadError, kinds
from jitwarm.kernels.artifacts import artifact
from jitwarm.kernels.libraries.jit_caches import fingerprint as fp
from jitwarm.kernels.libraries.jit_caches import receipt
from jitwarm.kernels.libraries.jit_caches.backend import mismatch, unit_of
from jitwarm.kernels.libraries.jit_caches.census import library
from jitwarm.kernels.libraries.jit_caches.receipt import FamilyRestore, same_path
from jitwarm.kernels.libraries.jit_caches.units import placed_by
from jitwarm.precompile import servers
from jitwarm.precompile.plan import WarmPlan


def check_fingerprints(args: argparse.Namespace, plan: WarmPlan) -> None:
    """Refuse (exit 4) captured units keyed on another node (``--allow-fingerprint-mismatch``: a warning each)."""
    target = (args.targets or [None])[0]
    for spec, lib in ((s, lib) for s in plan.recorded if (lib := _jit_cache_library(s.backend)) is not None):
        found = mismatch(lib, spec, target)
        if found is None:
            continue
        item, recorded, here = found
        why = f"{lib.name} unit {spec.family}: recorded with {item} {recorded!r}, this node has {here!r}"
        if not args.allow_fingerprint_mismatch:
            raise Refused(f"{why}: its library would not use it: {fp.remedy(item, recorded, here)}",
                          "--allow-fingerprint-mismatch restores it anyway")
        print(f"jitwarm: warning: {why}: restoring it anyway (--allow-fingerprint-mismatch)", file=sys.stderr)
    say_unloadable(plan)


def say_unloadable(plan: WarmPlan) -> None:
    """Warn where the node's server will not load units the plan restores (its room says when)."""
    units: dict[str, dict[str, list[str]]] = {}  # server -> library -> units recorded under it
    captured = (plan.manifest or {}).get("captured_env")  # how capture ran the server, where a record says
    for spec in plan.recorded:
        lib = _jit_cache_library(spec.backend)
        if lib is not None:
            units.setdefault(str(spec.params_dict.get("under", "")), {}).setdefault(lib.name, []).append(spec.family)
    for server, by_library in sorted(units.items()):
        for room in (server,) if server else servers.ROOMS:  # "": a script that ran the server's code itself
            for why in servers.adapter(room).unloadable(by_library, captured):
                print(f"jitwarm: warning: {why}", file=sys.stderr)


def _jit_cache_library(kind: str) -> Any:
    """The JIT cache library (``Library``) of a captured unit's kind, None for a kernel's kind."""
    return kinds.kind(kind).library() if kind in kinds.names() else None


def hand_over(plan: WarmPlan, cache: Any, *, quiet: bool = False) -> dict[str, FamilyRestore]:
    """Load each recorded kernel where its server will look (units: its library's cache); failures: exit 1.

    Returns each family's restore (its destination root, counts, one file a unit), also written as the receipt in
    the cache root (:mod:`~jitwarm.kernels.libraries.jit_caches.receipt`) and said, a line a family.
    """
    outcomes: dict[str, Counter[str]] = {}
    families: dict[str, FamilyRestore] = {}
    with placed_by(functools.cache(servers.cache_dirs)):  # each room reads this environment once
        for spec in plan.recorded:
            try:
                loaded = artifact(spec, cache).load(cache)
            except LoadError as exc:
                if isinstance(exc, JitwarmError):
                    raise
                raise JitwarmError(f"cannot hand {spec.id} over to its server: {str(exc).splitlines()[0]}") from exc
            placed = getattr(loaded, "placed", None)
            if placed is not None:
                outcomes.setdefault(placed.outcome, Counter())[spec.backend] += 1
                _note_restore(families, spec, placed)
                if placed.outcome == "kept":
                    print(f"jitwarm: warning: {spec.backend} unit {spec.family}: {placed.dest} holds the library's own "
                          f"{placed.differing}, different from the recorded one: kept, the unit not restored",
                          file=sys.stderr)
    if outcomes and not quiet:
        said = "; ".join(f"{outcome} {c.total()} (" + ", ".join(f"{k} {n}" for k, n in sorted(c.items())) + ")"
                         for outcome, c in sorted(outcomes.items()))
        print(f"jitwarm: JIT cache units: {said}", file=sys.stderr)
    if families:
        for name, fam in sorted(families.items()):  # on stderr with --json too: where each family went
            print(f"jitwarm: {name}: {fam.placed + fam.present} unit(s) in {fam.root} (placed {fam.placed}, "
                  f"present {fam.present}, kept {fam.kept})", file=sys.stderr)
        try:
            where = receipt.write(cache.root, families, plan.plan_id)
        except OSError as exc:  # the restore stands; only the server's check of it is lost
            print(f"jitwarm: warning: restore receipt not written in {cache.root}: {exc.strerror or exc}",
                  file=sys.stderr)
        else:
            if not quiet:
                print(f"jitwarm: restore receipt: {where}", file=sys.stderr)
    return families


def _note_restore(families: dict[str, FamilyRestore], spec: KernelSpec, placed: Any) -> None:
    """Count one restored unit into its family's :class:`FamilyRestore` (a disabled cache has no root)."""
    if placed.outcome == "disabled":
        return
    lib = library(spec.backend)
    files, _, under = unit_of(lib, spec)
    depth = 0 if spec.family == "." else len(Path(spec.family).parts)
    root = placed.dest if depth == 0 else placed.dest.parents[depth - 1]
    fam = families.get(lib.name)
    if fam is None or (under and not fam.under and not same_path(fam.root, str(root))):
        # A family restored both under its server and beside it (Inductor's precompiled header in its own default
        # $TMPDIR/torchinductor_<user>, its units in $SGLANG_CACHE_DIR/inductor): the receipt names the root the
        # server's own check reads, the server's.
        fam = families[lib.name] = FamilyRestore(str(root), under)
    elif not same_path(fam.root, str(root)):
        return  # beside the root the receipt names (above)
    fam.note(placed.outcome, lib.part(spec.family).commit_last(files)[-1])


def without_absent_units(plan: WarmPlan, cache: Any, *, quiet: bool = False) -> WarmPlan:
    """The plan without the captured units ``cache`` lacks (said once), unless a remote tier may hold them."""
    if cache.remote is not None:
        return plan
    absent = {s for s in plan.recorded
              if _jit_cache_library(s.backend) is not None and artifact(s, cache).lookup(cache) is None}
    if not absent:
        return plan
    if not quiet:
        print(f"jitwarm: warning: {len(absent)} captured JIT cache units of the manifest are not in {cache.root} "
              "(captured by the recording run into its own cache: import its bundle, `jitwarm export --manifest` "
              "there): left out", file=sys.stderr)
    return replace(plan, specs=tuple(s for s in plan.specs if s not in absent),
                   needed_by={s: b for s, b in plan.needed_by.items() if s not in absent})


def import_bundle(cache: Any, path: str, sha256: str | None = None) -> Any:
    """Import a bundle (a file or ``s3://``): UsageError when there is none, Refused when it is bad (not the cache)."""
    if is_bundle_url(path):
        split_url(path)
    elif not Path(path).is_file():
        raise UsageError(f"bundle {path} does not exist or is not a file")
    elif Path(os.path.realpath(path)).parts[1:2] in (("proc",), ("sys",), ("dev",)):
        raise UsageError(f"bundle {path} is a kernel interface, not a file")  # /proc/self/mem read as a tar: exit 4
    try:
        return cache.import_bundle(path, sha256=sha256)
    except CacheError as exc:
        if type(exc) is not CacheError:  # a subclass: not the bundle's content
            raise
        raise Refused(exc.reason, exc.hint) from exc
