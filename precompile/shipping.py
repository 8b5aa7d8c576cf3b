"""Kernels between boxes: ``warm`` (then the hand-over, :mod:`.handover`), ``export`` and ``import`` of bundles."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from jitwarm.cache.bundle import file_sha256
from jitwarm.cache.errors import EXIT_OK, NotReady, UsageError
from jitwarm.cache.remote.s3_bundle import is_bundle_url, split_url
from jitwarm.precompile.coverage import keys_of, open_cache, plan_coverage, print_warm, warm_exit
from jitwarm.precompile.handover import check_fingerprints, hand_over, import_bundle, without_absent_units
from jitwarm.precompile.plan import WarmPlan
from jitwarm.precompile.warming import warm


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
    if coverage["missing"] or coverage["corrupt"]:  # not ready, as status says it (exit 5)
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
