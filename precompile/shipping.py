"""Kernels between boxes: ``warm``, ``prestart`` (the init container's step), ``export`` and ``import`` of bundles."""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

from jitwarm.cache.bundle import file_sha256
from jitwarm.cache.errors import EXIT_OK, CacheError, JitwarmError, NotReady, Refused, UsageError
from jitwarm.cache.remote.base import redact
from jitwarm.cache.remote.s3_bundle import is_bundle_url, split_url
from jitwarm.kernels import KernelSpec, LoadError
from jitwarm.kernels.artifacts import artifact
from jitwarm.kernels.libraries.jit_caches import KIND_OF
from jitwarm.kernels.libraries.jit_caches.backend import mismatch
from jitwarm.kernels.libraries.jit_caches.census import library
from jitwarm.kernels.libraries.jit_caches.units import placed_by
from jitwarm.precompile import servers
from jitwarm.precompile.commands import keys_of, open_cache, plan_coverage, print_warm, readiness, warm_exit
from jitwarm.precompile.plan import WarmPlan
from jitwarm.precompile.warming import warm


def cmd_prestart(args: argparse.Namespace, plan: WarmPlan) -> int:
    """Import ``--bundle``, warm (``--offline``: build nothing), verify, hand over; ``--json``: one document always."""
    start = time.perf_counter()
    check_fingerprints(args, plan)
    cache = open_cache(args, writes=True)
    if args.offline and cache.remote is not None:  # said, not silently skipped (issue #31)
        print(f"jitwarm: --offline: the remote tier {redact(cache.remote)} is not consulted; only the bundle and "
              f"{cache.root} count", file=sys.stderr)
    keys = keys_of(plan, cache)
    supplied = import_for_plan(cache, args.bundle, plan, keys, offline=args.offline,
                               sha256=args.sha256) if args.bundle else None
    summary: dict[str, Any] = {"plan_id": plan.plan_id, "offline": args.offline, "bundle": supplied}

    def outcome(ready: bool, **more: Any) -> dict[str, Any]:
        """The probe's document: the summary so far, ``ready``, the seconds and ``more``."""
        return {**summary, "ready": ready, "seconds": round(time.perf_counter() - start, 3), **more}

    if not args.offline:  # a captured unit cannot be built: one the bundle lacks stays missing, exit 5 below
        report = warm(without_absent_units(plan, cache), cache=cache, jobs=args.jobs,
                      progress=False if args.json else None, timeout_s=args.timeout)
        summary.update(report.to_json())
        if not report.ok:
            print_warm(args, report, outcome(False))
            return warm_exit(report)
    # Hashed at import, build or download by this host and stamped: unchanged since, not hashed again.
    coverage = plan_coverage(plan, cache, repair=True, keys=keys, stamped=True)
    missing, corrupt = coverage["missing"], coverage["corrupt"]
    if missing or corrupt:
        why = "--offline builds nothing" if args.offline else "after warm"
        print(f"jitwarm: error: {why}: {len(missing)} of the plan's {len(plan.specs)} specs missing, "
              f"{len(corrupt)} corrupt: {', '.join((missing + corrupt)[:5])}", file=sys.stderr)
        if args.json:
            print(json.dumps(outcome(False, missing=missing, corrupt=corrupt)))
        return readiness(coverage)
    handed = hand_over(plan, cache, quiet=args.json)
    if args.json:
        print(json.dumps(outcome(True, handed_over=handed)))
    else:
        how = ("offline: nothing built" if args.offline
               else f"{report.built} built, {report.hits} hit, {report.waited} waited")
        print(f"jitwarm: ready: plan {plan.plan_id}: {len(plan.specs)}/{len(plan.specs)} specs present and "
              f"verified in {time.perf_counter() - start:.1f}s ({how})")
    return EXIT_OK


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
            raise Refused(f"{why}: its library would not use it (build in the server's image)",
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


def hand_over(plan: WarmPlan, cache: Any, *, quiet: bool = False) -> int:
    """Load each recorded kernel where its server will look (units: its library's cache); how many; failures: exit 1."""
    outcomes: dict[str, Counter[str]] = {}
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
                if placed.outcome == "kept":
                    print(f"jitwarm: warning: {spec.backend} unit {spec.family}: {placed.dest} holds the library's own "
                          f"{placed.differing}, different from the recorded one: kept, the unit not restored",
                          file=sys.stderr)
    if outcomes and not quiet:
        said = "; ".join(f"{outcome} {c.total()} (" + ", ".join(f"{k} {n}" for k, n in sorted(c.items())) + ")"
                         for outcome, c in sorted(outcomes.items()))
        print(f"jitwarm: JIT cache units: {said}", file=sys.stderr)
    return len(plan.recorded)


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


def import_for_plan(cache: Any, path: str, plan: WarmPlan, keys: dict[KernelSpec, str], *,
                    offline: bool = False, sha256: str | None = None) -> dict[str, Any]:
    """Import a bundle and say how many of the plan's entries it supplied (none: ``NotReady`` under ``offline``)."""
    report = import_bundle(cache, path, sha256=sha256)
    supplied = sorted(set(keys.values()) & set(report.keys))
    # a kernel's target, or a captured unit's fingerprinted arch
    targets = sorted({str(d.get("target") or (d.get("fingerprint") or {}).get("arch") or "unknown")
                      for d in report.descriptions.values()})
    print(f"jitwarm: bundle {path}: {len(report.keys)} entries ({len(report.imported)} new) for "
          f"{', '.join(targets) or 'no target'}; {len(supplied)} of the plan's {len(plan.specs)} specs",
          file=sys.stderr)
    if not supplied:
        plan_targets = ", ".join(plan.config.targets) if plan.config else "?"
        why = (f"bundle {path} supplies none of the plan's specs (the plan is for {plan_targets}; was it exported "
               "for another target, backend or toolchain?)")
        if offline:
            raise NotReady(why, "--offline builds nothing")
        print(f"jitwarm: warning: {why}: building them all", file=sys.stderr)
    return {"path": path, "entries": len(report.keys), "imported": len(report.imported), "supplied": len(supplied),
            "targets": targets}


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
    digest = export_keys(cache, list(keys.values()), args.path)
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


def export_keys(cache: Any, keys: list[str], path: str) -> str:
    """Write the entries ``keys`` to the bundle ``path`` (a file, or an object streamed up); return its sha256."""
    if is_bundle_url(path):
        return cache.export_bundle_to_store(keys, path)
    with open(cache.export_bundle(keys, path), "rb") as f:  # what --sha256 pins
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
