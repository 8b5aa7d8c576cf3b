"""Kernels between boxes: ``warm``, the hand-over to the server's caches, ``export`` and ``import`` of bundles."""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

from jitwarm.cache.bundle import file_sha256
from jitwarm.cache.errors import EXIT_OK, CacheError, JitwarmError, NotReady, Refused, UsageError
from jitwarm.cache.remote.s3_bundle import is_bundle_url, split_url
from jitwarm.kernels import KernelSpec, LoadError
from jitwarm.kernels.artifacts import artifact
from jitwarm.kernels.libraries.jit_caches import KIND_OF, receipt
from jitwarm.kernels.libraries.jit_caches import fingerprint as fp
from jitwarm.kernels.libraries.jit_caches.backend import mismatch, unit_of
from jitwarm.kernels.libraries.jit_caches.census import library
from jitwarm.kernels.libraries.jit_caches.receipt import FamilyRestore, same_path
from jitwarm.kernels.libraries.jit_caches.units import placed_by
from jitwarm.precompile import servers
from jitwarm.precompile.commands import keys_of, open_cache, plan_coverage, print_warm, warm_exit
from jitwarm.precompile.plan import WarmPlan
from jitwarm.precompile.warming import warm


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
    for spec in plan.recorded:
        lib = _jit_cache_library(spec.backend)
        if lib is not None:
            units.setdefault(str(spec.params_dict.get("under", "")), {}).setdefault(lib.name, []).append(spec.family)
    for server, by_library in sorted(units.items()):
        for room in (server,) if server else servers.ROOMS:  # "": a script that ran the server's code itself
            for why in servers.adapter(room).unloadable(by_library):
                print(f"jitwarm: warning: {why}", file=sys.stderr)


def _jit_cache_library(kind: str) -> Any:
    """The JIT cache library (``Library``) of a captured unit's kind, None for a kernel's kind."""
    return library(kind) if kind in KIND_OF.values() else None


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
    absent = {s for s in plan.recorded if s.backend in KIND_OF.values() and artifact(s, cache).lookup(cache) is None}
    if not absent:
        return plan
    if not quiet:
        print(f"jitwarm: warning: {len(absent)} captured JIT cache units of the manifest are not in {cache.root} "
              "(captured by the recording run into its own cache: import its bundle, `jitwarm export --manifest` "
              "there): left out", file=sys.stderr)
    return replace(plan, specs=tuple(s for s in plan.specs if s not in absent),
                   needed_by={s: b for s, b in plan.needed_by.items() if s not in absent})


def cmd_warm(args: argparse.Namespace, plan: WarmPlan) -> int:
    """Build every missing spec of the plan in parallel; with every one there, hand the recorded ones over."""
    check_fingerprints(args, plan)  # a captured unit keyed on another toolchain: exit 4 before any build
    cache = open_cache(args, writes=True)
    plan = without_absent_units(plan, cache, quiet=args.json)  # captured units are never built: absent, left out
    report = warm(plan, cache=cache, jobs=args.jobs, progress=False if args.json else None,
                  timeout_s=args.timeout)
    print_warm(args, report)
    code = warm_exit(report)
    if code == EXIT_OK and plan.recorded:
        hand_over(plan, cache, quiet=args.json)
    return code


def cmd_export(args: argparse.Namespace, plan: WarmPlan) -> int:
    """Write the plan's entries to one relocatable bundle, a file or ``s3://BUCKET/KEY`` (only when all are there)."""
    cache = open_cache(args)
    check_export_target(args.path)
    plan = without_absent_units(plan, cache)
    keys = keys_of(plan, cache, look_only=True)
    coverage = plan_coverage(plan, cache, keys=keys)
    if coverage["missing"] or coverage["corrupt"]:  # not ready, as status says it (exit 5: issue #31)
        raise NotReady(f"plan {plan.plan_id} is not complete in {cache.root} ({len(coverage['missing'])} missing, "
                       f"{len(coverage['corrupt'])} corrupt): run `jitwarm warm` with the same flags first")
    digest = export_keys(cache, list(keys.values()), args.path, manifest=getattr(args, "manifest", None) or (),
                         specs=[s for s in plan.specs if s not in plan.recorded])
    if args.json:
        print(json.dumps({"plan_id": plan.plan_id, "entries": len(keys), "path": args.path, "sha256": digest}))
    else:
        print(f"jitwarm: exported {len(keys)} entries of plan {plan.plan_id} to {args.path} (sha256 {digest})")
    return EXIT_OK


def check_export_target(path: str) -> None:
    """UsageError, before any lookup, for a path that cannot be a bundle file (a directory, a FIFO) or bad URL."""
    target = Path(path)
    if is_bundle_url(path):
        split_url(path)
    elif target.is_dir():
        raise UsageError(f"export: {path} is a directory; give the bundle's file name (kernels.tar)")
    elif target.exists() and not target.is_file():
        raise UsageError(f"export: {path} is not a regular file; give the bundle's file name (kernels.tar)")
    elif not target.absolute().parent.is_dir():
        raise UsageError(f"export: the directory of {path} does not exist")


def export_keys(cache: Any, keys: list[str], path: str, *, manifest: Any = (), specs: Any = ()) -> str:
    """Write the entries ``keys`` to the bundle ``path`` (a file, or an object streamed up); return its sha256.

    The bundle describes itself (``bundle.json``'s ``about``, :func:`~jitwarm.precompile.contents.about`): the
    records of ``manifest`` (a path or paths) and the ``specs`` among ``keys``, and this process's server,
    release and cache variables. ``jitwarm capture --export`` calls it with its manifest.
    """
    from jitwarm.precompile import contents

    paths = [manifest] if isinstance(manifest, (str, os.PathLike)) else list(manifest)
    described = contents.about(cache, keys, paths, specs)
    if is_bundle_url(path):
        return cache.export_bundle_to_store(keys, path, about=described)
    with open(cache.export_bundle(keys, path, about=described), "rb") as f:  # what --sha256 pins
        return file_sha256(f)


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


def cmd_import(args: argparse.Namespace, plan: None) -> int:
    """Import a bundle: every member checked, every file verified, each entry published atomically."""
    cache = open_cache(args)
    report = import_bundle(cache, args.path)
    if args.json:
        print(json.dumps(report.to_json()))
    else:
        print(f"jitwarm: imported {len(report.imported)} entries from {args.path} into {cache.root} "
              f"({len(report.present)} already present)")
    return EXIT_OK
