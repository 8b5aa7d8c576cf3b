"""What the cache holds of a plan: ``status`` and ``verify`` (``--repair`` moves corrupt entries aside)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from jitwarm.cache.errors import EXIT_CORRUPT, EXIT_NOT_READY, EXIT_OK
from jitwarm.kernels import KernelSpec
from jitwarm.precompile.commands import keys_of, open_cache
from jitwarm.precompile.plan import WarmPlan


def verify_reported(cache: Any, keys: list[str] | None, *, repair: bool, stamped: bool = False) -> Any:
    """``cache.verify``, its own warning per corrupt entry muted: the command reports each one, once."""
    logger = logging.getLogger("jitwarm.cache")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        return cache.verify(keys, repair=repair, stamped=stamped)
    finally:
        logger.setLevel(level)


def plan_coverage(plan: WarmPlan, cache: Any, *, repair: bool = False,
                  keys: dict[KernelSpec, str] | None = None, stamped: bool = False) -> dict[str, Any]:
    """Sort the plan's specs into present, missing and corrupt, with ``why`` and (``repair``) ``quarantined``.

    ``keys``: the caller's, else computed; ``stamped``: trust this host's stamps as a lookup does.
    """
    keys = keys_of(plan, cache, look_only=not repair) if keys is None else keys
    keys = {spec.id: key for spec, key in keys.items()}
    report = verify_reported(cache, list(keys.values()), repair=repair, stamped=stamped)
    state = {k: "present" for k in report.ok} | {k: "corrupt" for k in report.corrupt} | {
        k: "missing" for k in report.missing}
    coverage: dict[str, Any] = {"present": [], "missing": [], "corrupt": []}
    for spec in plan.specs:  # a spec that could not be keyed (keys_of said why) is missing
        coverage[state.get(keys.get(spec.id, ""), "missing")].append(spec.id)
    coverage["why"] = {s: report.corrupt[keys[s]] for s in coverage["corrupt"]}
    coverage["quarantined"] = [s for s in coverage["corrupt"] if keys[s] in report.quarantined]
    return coverage


def readiness(coverage: dict[str, list[str]]) -> int:
    """Exit 4 when an entry of the plan is corrupt, 5 when one is missing, 0 only when every one is there."""
    if coverage["corrupt"]:
        return EXIT_CORRUPT
    return EXIT_NOT_READY if coverage["missing"] else EXIT_OK


def cmd_status(args: argparse.Namespace, plan: WarmPlan) -> int:
    """Show how much of the plan the cache (and the remote) holds, and its size; never changes it."""
    cache = open_cache(args)
    keys = keys_of(plan, cache, look_only=True)  # once: a spec that cannot be keyed is said once
    coverage = plan_coverage(plan, cache, keys=keys)
    record = cache.read_plan_record(plan.plan_id)
    data = {"plan_id": plan.plan_id, "root": str(cache.root), "size_bytes": cache.size_bytes(),
            "complete": bool(record and record.get("complete")) and not coverage["missing"],
            **{k: len(coverage[k]) for k in ("present", "missing", "corrupt")}, "specs": coverage}
    if cache.remote:
        data["remote"] = remote_coverage(cache, {spec.id: key for spec, key in keys.items()})
    if args.json:
        print(json.dumps(data))
        return readiness(coverage)
    print(f"plan {plan.plan_id}: {data['present']}/{len(plan.specs)} present, {data['missing']} missing, "
          f"{data['corrupt']} corrupt; cache {cache.root} holds {data['size_bytes'] / 2**20:.1f} MiB")
    for state in ("missing", "corrupt"):
        for spec_id in coverage[state]:
            print(f"  {state}: {spec_id}")
    if cache.remote:
        remote = data["remote"]
        if not remote["available"]:
            print(f"remote {remote['url']} (prefix {remote['prefix']}): unavailable ({remote['error']})")
        else:
            print(f"remote {remote['url']} (prefix {remote['prefix']}): {remote['present']}/{len(plan.specs)} "
                  f"present on remote, {remote['missing']} missing")
            for spec_id in remote["specs"]["missing"]:
                print(f"  missing on remote: {spec_id}")
    return readiness(coverage)


def remote_coverage(cache: Any, keys: dict[str, str]) -> dict[str, Any]:
    """Sort the specs (id -> key) into present on the remote tier and missing there (nothing is downloaded)."""
    report = cache.remote_report(keys.values())
    present = set(report.present)
    specs = {"present": [s for s, k in keys.items() if k in present],
             "missing": [s for s, k in keys.items() if k not in present]} if report.available else {}
    return {"url": report.url, "prefix": report.prefix, "available": report.available, "error": report.error,
            "present": len(specs.get("present", ())), "missing": len(specs.get("missing", ())), "specs": specs}


def cmd_verify(args: argparse.Namespace, plan: WarmPlan | None) -> int:
    """Hash every file of the plan's entries (``--all``: of every entry, the plan's missing ones reported too)."""
    cache = open_cache(args)
    if args.all:
        keys = keys_of(plan, cache, look_only=not args.repair) if plan is not None else {}
        report = verify_reported(cache, None, repair=args.repair)
        ok, corrupt, why, moved = list(report.ok), list(report.corrupt), report.corrupt, set(report.quarantined)
        have = set(ok) | set(corrupt)
        missing = [spec.id for spec in plan.specs if keys.get(spec) not in have] if plan is not None else []
    else:
        coverage = plan_coverage(plan, cache, repair=args.repair)
        ok, corrupt, missing = coverage["present"], coverage["corrupt"], coverage["missing"]
        why, moved = coverage["why"], set(coverage["quarantined"])
    if args.json:
        print(json.dumps({"ok": len(ok), "corrupt": corrupt, "missing": missing, "repaired": bool(args.repair)}))
    else:
        for item in corrupt:
            state = "quarantined" if item in moved else "left as it is; --repair moves it aside" if not args.repair \
                else "not moved"
            print(f"jitwarm: corrupt ({state}): {item}: {why.get(item, '?')}", file=sys.stderr)
        for item in missing:
            print(f"jitwarm: missing: {item}", file=sys.stderr)
        print(f"jitwarm: verified {len(ok)} entries, {len(corrupt)} corrupt, {len(missing)} missing")
    return readiness({"corrupt": corrupt, "missing": missing})
