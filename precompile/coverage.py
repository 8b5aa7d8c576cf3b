"""A plan in the cache: the cache the flags describe, each spec's key, what is present, and whether it is ready.

``warm``, ``status``, ``verify``, ``export`` and ``prestart`` share it; it calls nothing of theirs.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from types import SimpleNamespace
from typing import Any

from jitwarm.cache import KernelCache
from jitwarm.cache.errors import EXIT_BUILD_FAILED, EXIT_CORRUPT, EXIT_NOT_READY, EXIT_OK, EXIT_TIMEOUT, UsageError
from jitwarm.cache.files import check_trusted_dir
from jitwarm.kernels import KernelSpec, SpecError, ToolchainError
from jitwarm.kernels.artifacts import artifact
from jitwarm.precompile.plan import WarmPlan

REMOTE_FROM_ENV = "$JITWARM_REMOTE"  # `--remote` given without a URL


def open_cache(args: argparse.Namespace, *, writes: bool = False) -> Any:
    """The ``KernelCache`` the flags describe (``writes``: its root made ready); UsageError for a bad one."""
    remote = getattr(args, "remote", None)
    from_env = remote == REMOTE_FROM_ENV
    try:
        cache = KernelCache(root=args.cache_dir or None, remote=None if from_env else remote,
                            remote_prefix=getattr(args, "remote_prefix", None),
                            remote_required=True if getattr(args, "remote_required", False) else None)
    except ValueError as exc:
        raise UsageError(str(exc).replace("remote:", "--remote:", 1)) from None
    if from_env and cache.remote is None:
        raise UsageError("--remote without a URL needs JITWARM_REMOTE (e.g. redis://cache-host:6379/0)")
    for path, what in ((cache.root, "cache root"), (cache.lock_dir, "lock directory")):
        if path.is_dir():
            # Refused once, here, as one line and exit 2 (a root or lock dir another user owns): else each build
            # worker refuses it, and warm says exit 1 with a failure per spec and status "missing".
            check_trusted_dir(path, what, allow_shared=cache.allow_shared)
    if writes:
        cache.prepare_root()
    return cache


def keys_of(plan: WarmPlan, cache: Any, *, look_only: bool = False) -> dict[KernelSpec, str]:
    """Each spec's key (``look_only``: toolchain facts never written); one unkeyable is said and left out."""
    facts = SimpleNamespace(read_fact=cache.read_fact, write_fact=lambda name, value: None) if look_only else cache
    keys = {}
    for spec in plan.specs:
        try:
            keys[spec] = artifact(spec, facts).key
        except (SpecError, ToolchainError) as exc:
            print(f"jitwarm: cannot key {spec.id}: {str(exc).splitlines()[0]}", file=sys.stderr)
    return keys


def print_warm(args: argparse.Namespace, report: Any, doc: dict[str, Any] | None = None) -> None:
    """The warm summary: each failure with its whole text, then the totals; ``--json``: ``doc`` or the report's."""
    if args.json:
        print(json.dumps(doc if doc is not None else report.to_json()))
        return
    failed = [r for r in report.results if r.outcome == "failed"]
    unavailable = next((r for r in failed if r.error_kind == "remote_unavailable"), None)
    for r in failed:
        if r.error_kind != "remote_unavailable":
            detail = r.detail if r.detail and r.detail != r.error else ""
            print(f"jitwarm: failed: {r.spec.id}: {r.error}" + (f"\n{detail.rstrip()}" if detail else ""),
                  file=sys.stderr)
    if unavailable is not None:  # one message for every spec it stopped
        print(f"jitwarm: error: the remote cache {report.remote} is unavailable and --remote-required is set: "
              f"{report.remote_error or unavailable.error}", file=sys.stderr)
    elif report.remote_error:
        print(f"jitwarm: remote cache {report.remote} unavailable ({report.remote_error}): warmed with the local "
              "cache only", file=sys.stderr)
    downloaded = f"{report.downloaded} downloaded, " if report.remote else ""
    print(f"jitwarm: plan {report.plan_id}: {len(report.results)} specs: {report.built} built, {downloaded}"
          f"{report.hits} hit, {report.waited} waited, {report.failed} failed in {report.seconds:.1f}s")


def warm_exit(report: Any) -> int:
    """0 when every spec is there; 4 when a remote entry failed the fleet key; 3 when all failures are waits; else 1."""
    failed = [r for r in report.results if r.outcome == "failed"]
    if not failed:
        return EXIT_OK
    if any(r.error_type == "UntrustedEntry" for r in failed):
        return EXIT_CORRUPT
    return EXIT_TIMEOUT if all(r.timed_out for r in failed) else EXIT_BUILD_FAILED


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
    """Sort the plan's specs into present, missing and corrupt, with ``why`` and (``repair``) ``quarantined``."""
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


def where_looked(plan: WarmPlan, coverage: dict[str, Any]) -> dict[str, list[str]]:
    """Move each present captured unit that is missing or changed where its library looks to ``missing``.

    The store holding a unit is not the server finding it: the library reads its own directory, resolved as
    prestart's hand-over resolves it (the unit's server room, this environment). Returns spec id -> why.
    """
    import functools

    from jitwarm.kernels import kinds
    from jitwarm.kernels.libraries.jit_caches.placement import problems
    from jitwarm.kernels.libraries.jit_caches.units import placed_by
    from jitwarm.precompile import servers

    present, off = set(coverage["present"]), {}
    with placed_by(functools.cache(servers.cache_dirs)):
        for spec in plan.recorded:
            library = kinds.kind(spec.backend).library() if spec.backend in kinds.names() else None
            if spec.id in present and library is not None:
                why = problems(library, spec)
                if why:
                    off[spec.id] = why
    coverage["present"] = [s for s in coverage["present"] if s not in off]
    coverage["missing"] = [*coverage["missing"], *off]
    coverage["not_where_looked"] = off
    return off


def readiness(coverage: dict[str, list[str]]) -> int:
    """Exit 4 when an entry of the plan is corrupt, 5 when one is missing, 0 only when every one is there."""
    if coverage["corrupt"]:
        return EXIT_CORRUPT
    return EXIT_NOT_READY if coverage["missing"] else EXIT_OK
