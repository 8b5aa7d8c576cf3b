"""``prestart``, the init container's step: import the bundle, add what it says it holds, warm, verify, restore.

The bundle describes itself (:mod:`~jitwarm.precompile.contents`): ``prestart --bundle B --offline`` alone
restores everything it holds, and a server line adds its plan's specs; ``--manifest`` names the recorded kernels
itself (the bundle's own manifest is then left out). A prestart that would restore
nothing that was expected is exit 5, never "ready".
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from jitwarm.cache.errors import EXIT_OK, NotReady
from jitwarm.cache.remote.base import redact
from jitwarm.kernels.libraries.jit_caches import receipt
from jitwarm.precompile import contents
from jitwarm.precompile.coverage import keys_of, open_cache, plan_coverage, print_warm, readiness, warm_exit
from jitwarm.precompile.handover import check_fingerprints, hand_over, import_bundle, without_absent_units
from jitwarm.precompile.plan import WarmPlan
from jitwarm.precompile.warming import warm


def cmd_prestart(args: argparse.Namespace, plan: WarmPlan) -> int:
    """Import ``--bundle``, warm (``--offline``: build nothing), verify, hand over; ``--json``: one document always."""
    start = time.perf_counter()
    if not args.bundle:
        check_fingerprints(args, plan)  # before anything is written
    cache = open_cache(args, writes=True)
    if args.offline and cache.remote is not None:  # said, not silently skipped
        print(f"jitwarm: --offline: the remote tier {redact(cache.remote)} is not consulted; only the bundle and "
              f"{cache.root} count", file=sys.stderr)
    supplied = None
    if args.bundle:
        report = import_bundle(cache, args.bundle, sha256=args.sha256)
        if not args.manifest:  # a --manifest of the operator's own says which recorded kernels to restore
            plan = contents.with_bundle(plan, report.about, args.bundle, args.targets or None)
        if not plan.specs:
            raise NotReady(*nothing_expected(args.bundle, report))
        check_fingerprints(args, plan)
    keys = keys_of(plan, cache)
    if args.bundle:
        supplied = bundle_summary(args, report, plan, keys)
    summary: dict[str, Any] = {"plan_id": plan.plan_id, "offline": args.offline, "bundle": supplied}

    def outcome(ready: bool, **more: Any) -> dict[str, Any]:
        """The probe's document: the summary so far, ``ready``, the seconds and ``more``."""
        return {**summary, "ready": ready, "seconds": round(time.perf_counter() - start, 3), **more}

    if not args.offline:  # a captured unit cannot be built: one the bundle lacks stays missing, exit 5 below
        built = warm(without_absent_units(plan, cache), cache=cache, jobs=args.jobs,
                     progress=False if args.json else None, timeout_s=args.timeout)
        summary.update(built.to_json())
        if not built.ok:
            print_warm(args, built, outcome(False))
            return warm_exit(built)
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
    restored = hand_over(plan, cache, quiet=args.json)
    if args.json:
        print(json.dumps(outcome(True, handed_over=len(plan.recorded),
                                 restored={name: fam.as_json() | {"files": len(fam.files)}
                                           for name, fam in restored.items()},
                                 receipt=str(receipt.receipt_path(cache.root)) if restored else None)))
    else:
        how = ("offline: nothing built" if args.offline
               else f"{built.built} built, {built.hits} hit, {built.waited} waited")
        print(f"jitwarm: ready: plan {plan.plan_id}: {len(plan.specs)}/{len(plan.specs)} specs present and "
              f"verified in {time.perf_counter() - start:.1f}s ({how})")
    return EXIT_OK


def nothing_expected(path: str, report: Any) -> tuple[str, str]:
    """Why a prestart of the bundle at ``path`` would restore nothing that was expected, and what to give."""
    records = sum(1 for r in report.about.get("manifest", []) if isinstance(r, dict) and r.get("kind") != "capture") \
        + len(report.about.get("specs", [])) if report.about else 0  # how capture ran the server is no spec
    if not records:
        return (f"bundle {path} carries no manifest of what it holds (an older jitwarm's, or exported without "
                "one), and the plan is empty: nothing it holds would be restored",
                "give --manifest or the server's command line after --, or export the bundle again (jitwarm export "
                "--manifest, jitwarm capture --export)")
    return (f"bundle {path} would restore nothing: its manifest names {records} specs, none of them for the "
            "targets asked for", "give --target as the bundle was made (jitwarm inspect lists each entry's target)")


def bundle_summary(args: argparse.Namespace, report: Any, plan: WarmPlan, keys: dict[Any, str]) -> dict[str, Any]:
    """Say what the bundle supplied of the plan; ``NotReady`` under ``--offline`` when it supplied none of it."""
    path = args.bundle
    supplied = sorted(set(keys.values()) & set(report.keys))
    # a kernel's target, or a captured unit's fingerprinted arch
    targets = sorted({str(d.get("target") or (d.get("fingerprint") or {}).get("arch") or "unknown")
                      for d in report.descriptions.values()})
    print(f"jitwarm: bundle {path}: {len(report.keys)} entries ({len(report.imported)} new) for "
          f"{', '.join(targets) or 'no target'}; {len(supplied)} of the plan's {len(plan.specs)} specs",
          file=sys.stderr)
    contents.say_bundle(report, path)
    if not supplied:
        plan_targets = ", ".join(plan.config.targets) if plan.config else "?"
        why = (f"bundle {path} supplies none of the plan's specs (the plan is for {plan_targets}; was it exported "
               "for another target, backend or toolchain?)")
        if args.offline:
            raise NotReady(why, "--offline builds nothing")
        print(f"jitwarm: warning: {why}: building them all", file=sys.stderr)
    return {"path": path, "entries": len(report.keys), "imported": len(report.imported), "supplied": len(supplied),
            "targets": targets, "manifest": report.about is not None}
