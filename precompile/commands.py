"""What each ``jitwarm`` command does: plan, warm, status, verify, prestart, prune, export, import.

Each ``cmd_*`` takes the parsed arguments and the plan (None for the commands that act on the whole cache) and
returns its exit code (:mod:`jitwarm.precompile.cli` has the table). Output goes to stdout (one JSON object with
``--json``), problems to stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

from jitwarm.cache.errors import (
    EXIT_BUILD_FAILED,
    EXIT_CORRUPT,
    EXIT_NOT_READY,
    EXIT_OK,
    EXIT_TIMEOUT,
    CacheError,
    JitwarmError,
    UsageError,
)
from jitwarm.kernels import KernelSpec
from jitwarm.precompile.plan import WarmPlan

REMOTE_FROM_ENV = "$JITWARM_REMOTE"  # `--remote` given without a URL
#: Flags that tune how a plan is made but do not ask for jitwarm's own families: with ``--manifest`` alone they
#: leave the plan manifest-only.
PLAN_MODIFIERS = ("targets", "backends", "ladder_source", "gpu_memory_mb", "ragged_verify_mode")


class CorruptBundle(JitwarmError):
    """A bundle that cannot be imported: a member refused, a file that does not verify, a bad manifest (exit 4)."""

    exit_code = EXIT_CORRUPT


class HandOverFailed(JitwarmError):
    """``prestart`` could not put a recorded kernel where its server's loader finds it (exit 1)."""


class NotReady(JitwarmError):
    """``prestart --offline`` found specs of the plan that neither the bundle nor the cache holds (exit 5)."""

    exit_code = EXIT_NOT_READY


class _LookOnly:
    """The cache's facts, read but never written: ``status`` and ``verify`` only look (issue #13)."""

    def __init__(self, cache: Any) -> None:
        self._cache = cache

    def read_fact(self, name: str) -> str | None:
        return self._cache.read_fact(name)

    def write_fact(self, name: str, value: str) -> None:
        pass


def open_cache(args: argparse.Namespace) -> Any:
    """The ``KernelCache`` the flags describe (``--cache-dir``, ``--remote``...); UsageError on a bad value."""
    from jitwarm.cache import KernelCache

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
    return cache


def keys_of(plan: WarmPlan, cache: Any, *, look_only: bool = False) -> dict[KernelSpec, str]:
    """Each spec's cache key (the one path: ``artifact(spec, facts)``).

    A spec that cannot be keyed here (a recorded kernel whose module does not import in this environment,
    a missing toolchain) is left out, with one line on stderr saying why: it counts as missing.
    """
    from jitwarm.kernels import SpecError, ToolchainError
    from jitwarm.kernels.artifacts import artifact

    facts = _LookOnly(cache) if look_only else cache
    keys = {}
    for spec in plan.specs:
        try:
            keys[spec] = artifact(spec, facts).key
        except (SpecError, ToolchainError) as exc:
            print(f"jitwarm: cannot key {spec.id}: {str(exc).splitlines()[0]}", file=sys.stderr)
    return keys


def plan_asked(args: argparse.Namespace, server_argv: list[str] | None) -> bool:
    """Whether the command line asks for a plan: a manifest, or a server (:func:`asks_for_families`)."""
    return bool(getattr(args, "manifest", None)) or asks_for_families(args, server_argv)


def asks_for_families(args: argparse.Namespace, server_argv: list[str] | None) -> bool:
    """Whether a server command line, a config file or a serving flag asks for jitwarm's own families.

    The :data:`PLAN_MODIFIERS` (``--target``, ``--ladder-source``, ``--gpu-memory-mb``...) do not: they only
    tune a plan that something else asks for.
    """
    from jitwarm.precompile.config import serving_flags_given

    asked = argparse.Namespace(**{**vars(args), **dict.fromkeys(PLAN_MODIFIERS)})
    return serving_flags_given(asked, server_argv)


def build_plan(args: argparse.Namespace, server_argv: list[str] | None) -> WarmPlan:
    """The plan the flags describe: the serving config's, plus the recorded kernels of each ``--manifest``.

    ``--manifest`` alone (no server command line, config file or serving flag that asks for jitwarm's own
    families, :func:`asks_for_families`) plans only the recorded kernels. The plan's targets (``--target``;
    with serving flags, the config's default too) select the records made on them: each record is built for
    the target it was recorded on.
    """
    from jitwarm.kernels import Target, TargetError
    from jitwarm.precompile.config import from_namespace

    manifests = getattr(args, "manifest", None) or []
    if not manifests or asks_for_families(args, server_argv):
        plan = WarmPlan.build(from_namespace(args, server_argv))
    else:
        plan = WarmPlan.empty()
    targets = plan.config.targets if plan.config is not None else None
    if targets is None and args.targets:
        try:
            targets = [str(Target.parse(t)) for t in args.targets]
        except TargetError as exc:
            raise UsageError(f"--target: {exc}") from None
    return plan.with_manifests(manifests, targets) if manifests else plan  # ManifestError: exit 2


def nothing_to_warm(args: argparse.Namespace, plan: WarmPlan) -> int:
    """An empty plan is success, said once: a server that captures no decode graphs needs no kernels warmed.

    An init container that shares the server's template (``--disable-cuda-graph``) must not block the pod; only
    ``export`` refuses, as there is no bundle to write. (A manifest none of whose records is for the targets
    asked for is a usage error, raised by the caller: there, something was asked for and nothing matched.)
    """
    why = plan.ladder.disabled if plan.ladder and plan.ladder.disabled else "no capture shapes"
    what = "the server captures no decode CUDA graphs"
    if plan.shapes and plan.families is not None and not plan.families.planned:  # e.g. a Llama server
        why, what = plan.families.why, "the model runs none of jitwarm's kernel families"
    if args.command == "export":
        raise UsageError(f"the plan is empty ({why}): {what}, nothing to export")
    print(f"jitwarm: nothing to warm: the plan is empty ({why}): {what}", file=sys.stderr)
    if args.json:
        doc = plan.to_json() if args.command == "plan" else {"plan_id": plan.plan_id, "ok": True, "ready": True,
                                                             "specs": 0, "empty": why}
        print(json.dumps(doc))
    return EXIT_OK


# -- plan ---------------------------------------------------------------------------------------------------


def spec_labels(specs: Any) -> dict[KernelSpec, str]:
    """Short labels that show only the params that vary within each family of ``specs``."""
    varying: dict[str, set[str]] = {}
    for fam in {s.family for s in specs}:
        group = [s for s in specs if s.family == fam]
        keys = {k for s in group for k, _ in s.params}
        varying[fam] = {k for k in keys if len({s.params_dict.get(k) for s in group}) > 1}
    multi = len({(s.backend, s.target) for s in specs}) > 1
    labels = {}
    for s in specs:
        args = ",".join(f"{k}={v}" for k, v in s.params if k in varying[s.family])
        where = f"@{s.backend}:{s.target}" if multi else ""
        labels[s] = f"{s.family}({args}){where}"
    return labels


def render_plan(plan: WarmPlan) -> str:
    """Render the plan as a readable table with totals per family, then the recorded kernels of a manifest."""
    lines = []
    if plan.config is not None:
        labels = spec_labels([s for s in plan.specs if s not in plan.recorded])
        rows = [("bs", "graph key", "tokens", "slots", "verify_lens", "uniform", "new specs")]
        for sh in plan.shapes:
            new = " ".join(labels[s] for s in plan.introduced[sh.bs]) or "-"
            rows.append((str(sh.bs), str(sh.graph_key), str(sh.num_tokens), str(sh.layout.slots),
                         sh.layout.run_length(), "yes" if sh.layout.uniform else "no", new))
        widths = [max(len(r[i]) for r in rows) for i in range(6)]
        lines = ["  ".join([c.rjust(w) if i < 4 else c.ljust(w)
                            for i, (c, w) in enumerate(zip(r, widths, strict=False))] + [r[6]]).rstrip() for r in rows]
        fams = ", ".join(f"{name} {n}" for name, n in plan.by_family().items())
        targets = ", ".join(f"{b}:{t}" for b in plan.config.backends for t in plan.config.targets)
        lines += ["", f"{len(plan.specs) - len(plan.recorded)} specs for {len(plan.shapes)} shapes ({fams}) on "
                  f"{targets}", f"ladder: {plan.ladder.source}"]
        if plan.families is not None:
            lines.append(f"model: {plan.families.why}")
    if plan.manifest is not None:
        m = plan.manifest
        other = f", {m['other_targets']} for other targets left out" if m["other_targets"] else ""
        if lines:
            lines.append("")
        lines.append(f"{len(plan.recorded)} recorded kernels from {m['path']} ({m['records']} records{other}):")
        lines += [f"  {s.backend:<10} {s.target:<7} {s.family}" for s in plan.recorded]
    lines.append(f"plan id {plan.plan_id}: {len(plan.specs)} specs")
    return "\n".join(lines)


def cmd_plan(args: argparse.Namespace, plan: WarmPlan) -> int:
    """Print the plan: a table, or one JSON object with ``--json``."""
    print(json.dumps(plan.to_json()) if args.json else render_plan(plan))
    return EXIT_OK


# -- warm and prestart --------------------------------------------------------------------------------------


def print_warm(args: argparse.Namespace, report: Any, doc: dict[str, Any] | None = None) -> None:
    """The warm summary: each failure with its whole text (a compiler's full diagnostic), then the totals.

    With ``--json``, one JSON document on stdout instead: ``doc`` when given, else the report's.
    """
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
    """0 when every spec is there; 3 when the only failures are waits past the deadline; else 1."""
    failed = [r for r in report.results if r.outcome == "failed"]
    if not failed:
        return EXIT_OK
    return EXIT_TIMEOUT if all(r.timed_out for r in failed) else EXIT_BUILD_FAILED


def cmd_warm(args: argparse.Namespace, plan: WarmPlan) -> int:
    """Build every missing spec of the plan in parallel and write the plan's completion record."""
    from jitwarm.precompile.warming import warm

    report = warm(plan, cache=open_cache(args), jobs=args.jobs, progress=False if args.json else None,
                  timeout_s=args.timeout)
    print_warm(args, report)
    return warm_exit(report)


def cmd_prestart(args: argparse.Namespace, plan: WarmPlan) -> int:
    """Import a bundle (``--bundle``), warm (``--offline``: build nothing), verify the plan's entries, hand over.

    With ``--json`` stdout holds one JSON document whatever the outcome (a readiness probe reads ``ready``);
    progress, warnings and errors go to stderr.
    """
    from jitwarm.precompile.warming import warm

    start = time.perf_counter()
    cache = open_cache(args)
    keys = keys_of(plan, cache)
    supplied = import_for_plan(cache, args.bundle, plan, keys, offline=args.offline) if args.bundle else None
    summary: dict[str, Any] = {"plan_id": plan.plan_id, "offline": args.offline, "bundle": supplied}
    if not args.offline:
        report = warm(plan, cache=cache, jobs=args.jobs, progress=False if args.json else None,
                      timeout_s=args.timeout)
        summary.update(report.to_json())
        if not report.ok:
            print_warm(args, report, {**summary, "ready": False, "seconds": round(time.perf_counter() - start, 3)})
            return warm_exit(report)
    coverage = plan_coverage(plan, cache, repair=True, keys=keys)
    if coverage["corrupt"] or coverage["missing"]:
        shown = ", ".join((coverage["missing"] + coverage["corrupt"])[:5])
        why = "--offline builds nothing" if args.offline else "after warm"
        print(f"jitwarm: error: {why}: {len(coverage['missing'])} of the plan's {len(plan.specs)} specs missing, "
              f"{len(coverage['corrupt'])} corrupt: {shown}", file=sys.stderr)
        if args.json:
            print(json.dumps({**summary, "ready": False, "seconds": round(time.perf_counter() - start, 3),
                              "missing": coverage["missing"], "corrupt": coverage["corrupt"]}))
        return readiness(coverage)
    handed = hand_over(plan, cache)
    seconds = time.perf_counter() - start
    if args.json:
        print(json.dumps({**summary, "ready": True, "seconds": round(seconds, 3), "handed_over": handed}))
    elif args.offline:
        print(f"jitwarm: ready: plan {plan.plan_id}: {len(plan.specs)}/{len(plan.specs)} specs present and "
              f"verified in {seconds:.1f}s (offline: nothing built)")
    else:
        print(f"jitwarm: ready: plan {plan.plan_id}: {len(plan.specs)}/{len(plan.specs)} specs present and "
              f"verified in {seconds:.1f}s ({report.built} built, {report.hits} hit, {report.waited} waited)")
    return EXIT_OK


def hand_over(plan: WarmPlan, cache: Any) -> int:
    """Load each recorded server kernel the way its server will find it; return how many were handed over.

    For a ``load_jit`` module that puts the build where sglang's loader looks (``SGLANG_JIT_CACHE_DIR``),
    verified; a Triton compile needs nothing more (the server's Triton asks jitwarm's cache manager for it).
    A failure is a ``CacheError``, a :class:`HandOverFailed` (the backend's ``LoadError``, naming the spec), or
    an ``OSError`` for a cache dir of the server that cannot be written (``SglangCacheDirError``): exit 1 each.
    """
    from jitwarm.kernels import LoadError
    from jitwarm.kernels.artifacts import artifact

    for spec in plan.recorded:
        try:
            artifact(spec, cache).load(cache)
        except LoadError as exc:
            if isinstance(exc, JitwarmError):
                raise
            raise HandOverFailed(f"cannot hand {spec.id} over to its server: {str(exc).splitlines()[0]}") from exc
    return len(plan.recorded)


def import_for_plan(cache: Any, path: str, plan: WarmPlan, keys: dict[KernelSpec, str], *,
                    offline: bool = False) -> dict[str, Any]:
    """Import a bundle and say how many of the plan's entries it supplied.

    One that supplies none (exported for another target, backend or toolchain?) is a warning when the warm
    will build them, and ``NotReady`` (exit 5) under ``offline``, which builds nothing.
    """
    report = import_bundle(cache, path)
    supplied = sorted(set(keys.values()) & set(report.keys))
    targets = sorted({str(e.description.get("target")) for k in report.keys if (e := cache.lookup(k)) is not None})
    info = {"path": path, "entries": len(report.keys), "imported": len(report.imported),
            "supplied": len(supplied), "targets": targets}
    plan_targets = ", ".join(plan.config.targets) if plan.config else "?"
    print(f"jitwarm: bundle {path}: {len(report.keys)} entries ({len(report.imported)} new) for "
          f"{', '.join(targets) or 'no target'}; {len(supplied)} of the plan's {len(plan.specs)} specs",
          file=sys.stderr)
    if not supplied:
        why = (f"bundle {path} supplies none of the plan's specs (the plan is for {plan_targets}; was it exported "
               "for another target, backend or toolchain?)")
        if offline:
            raise NotReady(why, "--offline builds nothing")
        print(f"jitwarm: warning: {why}: building them all", file=sys.stderr)
    return info


# -- status and verify --------------------------------------------------------------------------------------


def verify_reported(cache: Any, keys: list[str] | None, *, repair: bool) -> Any:
    """``cache.verify``, with the cache's own warning per corrupt entry muted: the command reports each one.

    Its report carries every corrupt entry's reason and whether it was quarantined, so the command's line is
    the only one (the cache's logger line, then the ``jitwarm:`` line, said it twice).
    """
    logger = logging.getLogger("jitwarm.cache")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        return cache.verify(keys, repair=repair)
    finally:
        logger.setLevel(level)


def plan_coverage(plan: WarmPlan, cache: Any, *, repair: bool = False,
                  keys: dict[KernelSpec, str] | None = None) -> dict[str, Any]:
    """Sort the plan's specs into present, missing and corrupt; corrupt ones are moved aside only with ``repair``.

    ``keys`` are the plan's keys when the caller has them already (:func:`keys_of`). Also returns ``why``
    (each corrupt spec's reason) and ``quarantined`` (those moved aside).
    """
    if keys is None:
        keys = keys_of(plan, cache, look_only=not repair)
    keys = {spec.id: key for spec, key in keys.items()}
    report = verify_reported(cache, list(keys.values()), repair=repair)
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
    """Show how much of the plan the cache holds (and what the remote holds) and its size; never changes it."""
    cache = open_cache(args)
    coverage = plan_coverage(plan, cache)
    record = cache.read_plan_record(plan.plan_id)
    data = {"plan_id": plan.plan_id, "root": str(cache.root), "size_bytes": cache.size_bytes(),
            "complete": bool(record and record.get("complete")) and not coverage["missing"],
            **{k: len(coverage[k]) for k in ("present", "missing", "corrupt")}, "specs": coverage}
    if cache.remote:
        data["remote"] = remote_coverage(plan, cache)
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


def remote_coverage(plan: WarmPlan, cache: Any) -> dict[str, Any]:
    """Sort the plan's specs into present on the remote tier and missing there (nothing is downloaded)."""
    keys = {spec.id: key for spec, key in keys_of(plan, cache, look_only=True).items()}
    report = cache.remote_report(keys.values())
    present = set(report.present)
    specs = {"present": [s for s, k in keys.items() if k in present],
             "missing": [s for s, k in keys.items() if k not in present]} if report.available else {}
    return {"url": report.url, "prefix": report.prefix, "available": report.available, "error": report.error,
            "present": len(specs.get("present", ())), "missing": len(specs.get("missing", ())), "specs": specs}


def cmd_verify(args: argparse.Namespace, plan: WarmPlan | None) -> int:
    """Hash every file of the plan's entries; ``--repair`` moves corrupt ones aside.

    ``--all`` hashes every entry of the cache and needs no plan; given one (a server command line, serving
    flags, a manifest), the plan's specs without an entry are reported as missing too (exit 5).
    """
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


# -- the whole cache: prune, export, import -----------------------------------------------------------------


def cmd_prune(args: argparse.Namespace, plan: None) -> int:
    """Remove least recently used entries down to ``--max-bytes`` and entries unused for ``--older-than``."""
    if args.max_bytes is None and args.older_than is None:
        raise UsageError("prune needs --max-bytes SIZE and/or --older-than AGE")
    report = open_cache(args).prune(max_bytes=args.max_bytes, older_than_s=args.older_than)
    if args.json:
        print(json.dumps(report.to_json()))
    else:
        kept = f"; kept {len(report.skipped_locked)} in use (locked)" if report.skipped_locked else ""
        print(f"jitwarm: pruned {len(report.removed)} entries ({report.freed_bytes / 2**20:.1f} MiB) and "
              f"{len(report.staging_removed)} abandoned builds; {report.remaining_bytes / 2**20:.1f} MiB left{kept}")
    return EXIT_OK


def cmd_export(args: argparse.Namespace, plan: WarmPlan) -> int:
    """Write the plan's entries to one relocatable bundle (only when every one is there)."""
    cache = open_cache(args)
    target = Path(args.path)
    if target.is_dir():
        raise UsageError(f"export: {args.path} is a directory; give the bundle's file name (kernels.tar)")
    if not target.absolute().parent.is_dir():
        raise UsageError(f"export: the directory of {args.path} does not exist")
    keys = keys_of(plan, cache, look_only=True)
    coverage = plan_coverage(plan, cache, keys=keys)
    if coverage["missing"] or coverage["corrupt"]:
        raise UsageError(f"plan {plan.plan_id} is not complete in {cache.root} ({len(coverage['missing'])} missing, "
                         f"{len(coverage['corrupt'])} corrupt): run `jitwarm warm` with the same flags first")
    cache.export_bundle(list(keys.values()), args.path)
    print(f"jitwarm: exported {len(keys)} entries of plan {plan.plan_id} to {args.path}")
    return EXIT_OK


def import_bundle(cache: Any, path: str) -> Any:
    """Import a bundle file: UsageError when there is none at ``path``, CorruptBundle when it does not import.

    A failed write (``CacheWriteError``: a full disk) and the cache's own refusals (an untrusted root, a lock
    timeout) keep their types and exit codes: only what is wrong with the bundle itself is exit 4.
    """
    if not Path(path).is_file():
        raise UsageError(f"bundle {path} does not exist or is not a file")
    try:
        return cache.import_bundle(path)
    except CacheError as exc:
        if type(exc) is not CacheError:  # a subclass: a write, a lock, a trust problem, not the bundle's content
            raise
        raise CorruptBundle(exc.reason, exc.hint) from exc


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
