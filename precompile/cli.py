"""The ``jitwarm`` command line: plan, warm, status, verify, prestart, prune, export, import.

Exit codes (DESIGN.md): 0 ok; 1 a build failed (or a required remote tier is down); 2 bad usage or
config; 3 timed out waiting; 4 verification found corrupt entries; 5 not ready (specs of the plan missing).
User errors print one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence

from jitwarm.kernels import KernelSpec
from jitwarm.precompile.config import ConfigError, _FlagParser, add_serving_flags, from_namespace
from jitwarm.precompile.plan import WarmPlan

EXIT_OK, EXIT_BUILD_FAILED, EXIT_USAGE, EXIT_TIMEOUT, EXIT_CORRUPT, EXIT_NOT_READY = 0, 1, 2, 3, 4, 5


class UsageError(Exception):
    """A user error that is not about the serving config (a missing file, a bad option value)."""


def spec_labels(specs: Sequence[KernelSpec]) -> dict[KernelSpec, str]:
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
    """Render the plan as a readable table with totals per family."""
    labels = spec_labels(plan.specs)
    rows = [("bs", "graph key", "tokens", "slots", "verify_lens", "uniform", "new specs")]
    for sh in plan.shapes:
        new = " ".join(labels[s] for s in plan.introduced[sh.bs]) or "-"
        rows.append((str(sh.bs), str(sh.graph_key), str(sh.num_tokens), str(sh.layout.slots), sh.layout.run_length(),
                     "yes" if sh.layout.uniform else "no", new))
    widths = [max(len(r[i]) for r in rows) for i in range(6)]
    lines = ["  ".join([c.rjust(w) if i < 4 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=False))]
                       + [r[6]]).rstrip() for r in rows]
    fams = ", ".join(f"{name} {n}" for name, n in plan.by_family().items())
    targets = ", ".join(f"{b}:{t}" for b in plan.config.backends for t in plan.config.targets)
    lines.append("")
    lines.append(f"{len(plan.specs)} specs for {len(plan.shapes)} shapes ({fams}) on {targets}; "
                 f"plan id {plan.plan_id}")
    lines.append(f"ladder: {plan.ladder.source}")
    return "\n".join(lines)


def cmd_plan(args: argparse.Namespace, plan: WarmPlan) -> int:
    """Print the plan: a table, or one JSON object with ``--json``."""
    print(json.dumps(plan.to_json()) if args.json else render_plan(plan))
    return EXIT_OK


_REMOTE_FROM_ENV = "$JITWARM_REMOTE"  # `--remote` given without a URL


def _cache(args: argparse.Namespace):
    from jitwarm.cache import KernelCache

    remote = getattr(args, "remote", None)
    from_env = remote == _REMOTE_FROM_ENV
    try:
        cache = KernelCache(root=args.cache_dir or None, remote=None if from_env else remote,
                            remote_prefix=getattr(args, "remote_prefix", None),
                            remote_required=True if getattr(args, "remote_required", False) else None)
    except ValueError as exc:
        raise UsageError(str(exc).replace("remote:", "--remote:", 1)) from None
    if from_env and cache.remote is None:
        raise UsageError("--remote without a URL needs JITWARM_REMOTE (e.g. redis://cache-host:6379/0)")
    return cache


def _print_warm(args: argparse.Namespace, report) -> None:
    """The warm summary: each failure with its whole text (a compiler's full diagnostic), then the totals."""
    if args.json:
        print(json.dumps(report.to_json()))
        return
    failed = [r for r in report.results if r.outcome == "failed"]
    unavailable = next((r for r in failed if r.error_kind == "remote_unavailable"), None)
    for r in failed:
        if r.error_kind != "remote_unavailable":
            detail = r.detail if r.detail and r.detail != r.error else ""
            print(f"jitwarm: failed: {r.spec.id}: {r.error}" + (f"\n{detail.rstrip()}" if detail else ""),
                  file=sys.stderr)
    if unavailable is not None:  # one message for every spec it stopped
        print(f"jitwarm: error: {unavailable.error}; --remote-required (or JITWARM_REMOTE_REQUIRED=1) makes that "
              "fatal", file=sys.stderr)
    elif report.remote_error:
        print(f"jitwarm: remote cache {report.remote} unavailable ({report.remote_error}): warmed with the local "
              "cache only", file=sys.stderr)
    downloaded = f"{report.downloaded} downloaded, " if report.remote else ""
    print(f"jitwarm: plan {report.plan_id}: {len(report.results)} specs: {report.built} built, {downloaded}"
          f"{report.hits} hit, {report.waited} waited, {report.failed} failed in {report.seconds:.1f}s")


def _warm_exit(report) -> int:
    failed = [r for r in report.results if r.outcome == "failed"]
    if not failed:
        return EXIT_OK
    return EXIT_TIMEOUT if all(r.timed_out for r in failed) else EXIT_BUILD_FAILED


def cmd_warm(args: argparse.Namespace, plan: WarmPlan) -> int:
    """Build every missing spec of the plan in parallel and write the plan's completion record."""
    from jitwarm.precompile.warming import warm

    progress = False if args.json else None
    report = warm(plan, cache=_cache(args), jobs=args.jobs, progress=progress, timeout_s=args.timeout)
    _print_warm(args, report)
    return _warm_exit(report)


def plan_coverage(plan: WarmPlan, cache) -> dict[str, list[str]]:
    """Sort the plan's specs into present, missing and corrupt (corrupt entries are quarantined)."""
    from jitwarm.kernels.artifacts import artifact

    keys = {spec.id: artifact(spec, cache).key for spec in plan.specs}
    report = cache.verify(list(keys.values()))
    state = {k: "present" for k in report.ok} | {k: "corrupt" for k in report.corrupt} | {
        k: "missing" for k in report.missing}
    coverage: dict[str, list[str]] = {"present": [], "missing": [], "corrupt": []}
    for spec_id, key in keys.items():
        coverage[state.get(key, "missing")].append(spec_id)
    return coverage


def cmd_status(args: argparse.Namespace, plan: WarmPlan) -> int:
    """Show how much of the plan the cache holds (and, with a remote, what the remote holds) and its size."""
    cache = _cache(args)
    coverage = plan_coverage(plan, cache)
    record = cache.read_plan_record(plan.plan_id)
    data = {"plan_id": plan.plan_id, "root": str(cache.root), "size_bytes": cache.size_bytes(),
            "complete": bool(record and record.get("complete")) and not coverage["missing"],
            **{k: len(v) for k, v in coverage.items()}, "specs": coverage}
    if cache.remote:
        data["remote"] = remote_coverage(plan, cache)
    if args.json:
        print(json.dumps(data))
    else:
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
    return _readiness(coverage)


def _readiness(coverage: dict[str, list[str]]) -> int:
    """Exit 4 when an entry of the plan is corrupt, 5 when one is missing, 0 only when every one is there."""
    if coverage["corrupt"]:
        return EXIT_CORRUPT
    return EXIT_NOT_READY if coverage["missing"] else EXIT_OK


def remote_coverage(plan: WarmPlan, cache) -> dict:
    """Sort the plan's specs into present on the remote tier and missing there (nothing is downloaded)."""
    from jitwarm.kernels.artifacts import artifact

    keys = {spec.id: artifact(spec, cache).key for spec in plan.specs}
    report = cache.remote_report(keys.values())
    present = set(report.present)
    specs = {"present": [s for s, k in keys.items() if k in present],
             "missing": [s for s, k in keys.items() if k not in present]} if report.available else {}
    return {"url": report.url, "prefix": report.prefix, "available": report.available, "error": report.error,
            "present": len(specs.get("present", ())), "missing": len(specs.get("missing", ())), "specs": specs}


def cmd_verify(args: argparse.Namespace, plan: WarmPlan) -> int:
    """Check every file of the plan's entries (``--all``: every entry); exit 4 on any corrupt one."""
    cache = _cache(args)
    if args.all:
        report = cache.verify(None)
        corrupt, ok = list(report.corrupt), list(report.ok)
        missing: list[str] = []
    else:
        coverage = plan_coverage(plan, cache)
        ok, corrupt, missing = coverage["present"], coverage["corrupt"], coverage["missing"]
    if args.json:
        print(json.dumps({"ok": len(ok), "corrupt": corrupt, "missing": missing}))
    else:
        for item in corrupt:
            print(f"jitwarm: corrupt (quarantined): {item}", file=sys.stderr)
        print(f"jitwarm: verified {len(ok)} entries, {len(corrupt)} corrupt, {len(missing)} missing")
    return _readiness({"corrupt": corrupt, "missing": missing})


def cmd_prestart(args: argparse.Namespace, plan: WarmPlan) -> int:
    """Import a bundle (``--bundle``), warm, verify the plan's entries, and print the ready line."""
    import time

    from jitwarm.precompile.warming import warm

    start = time.perf_counter()
    cache = _cache(args)
    if args.bundle:
        _import_bundle(cache, args.bundle)
    report = warm(plan, cache=cache, jobs=args.jobs, progress=False if args.json else None,
                  timeout_s=args.timeout)
    if not report.ok:
        _print_warm(args, report)
        return _warm_exit(report)
    coverage = plan_coverage(plan, cache)
    if coverage["corrupt"] or coverage["missing"]:
        print(f"jitwarm: error: after warm, {len(coverage['corrupt'])} corrupt and {len(coverage['missing'])} "
              "missing entries", file=sys.stderr)
        return EXIT_CORRUPT
    seconds = time.perf_counter() - start
    if args.json:
        print(json.dumps({**report.to_json(), "ready": True, "seconds": round(seconds, 3)}))
    else:
        print(f"jitwarm: ready: plan {plan.plan_id}: {len(plan.specs)}/{len(plan.specs)} specs present and "
              f"verified in {seconds:.1f}s ({report.built} built, {report.hits} hit, {report.waited} waited)")
    return EXIT_OK


def _import_bundle(cache, path: str):
    from pathlib import Path

    if not Path(path).is_file():
        raise UsageError(f"bundle {path} does not exist or is not a file")
    return cache.import_bundle(path)


def cmd_prune(args: argparse.Namespace, plan: WarmPlan | None) -> int:
    """Remove least recently used entries down to ``--max-bytes`` and entries unused for ``--older-than``."""
    cache = _cache(args)
    if args.max_bytes is None and args.older_than is None:
        raise UsageError("prune needs --max-bytes SIZE and/or --older-than AGE")
    report = cache.prune(max_bytes=args.max_bytes, older_than_s=args.older_than)
    if args.json:
        print(json.dumps(report.to_json()))
    else:
        kept = f"; kept {len(report.skipped_locked)} in use (locked)" if report.skipped_locked else ""
        print(f"jitwarm: pruned {len(report.removed)} entries ({report.freed_bytes / 2**20:.1f} MiB) and "
              f"{len(report.staging_removed)} abandoned builds; {report.remaining_bytes / 2**20:.1f} MiB left{kept}")
    return EXIT_OK


def cmd_export(args: argparse.Namespace, plan: WarmPlan) -> int:
    """Write the plan's entries to one relocatable bundle."""
    from jitwarm.kernels.artifacts import artifact

    cache = _cache(args)
    coverage = plan_coverage(plan, cache)
    if coverage["missing"] or coverage["corrupt"]:
        raise UsageError(f"plan {plan.plan_id} is not complete in {cache.root} ({len(coverage['missing'])} missing, "
                         f"{len(coverage['corrupt'])} corrupt): run `jitwarm warm` with the same flags first")
    keys = [artifact(spec, cache).key for spec in plan.specs]
    cache.export_bundle(keys, args.path)
    print(f"jitwarm: exported {len(keys)} entries of plan {plan.plan_id} to {args.path}")
    return EXIT_OK


def cmd_import(args: argparse.Namespace, plan: WarmPlan | None) -> int:
    """Import a bundle: every member checked, every file verified, each entry published atomically."""
    cache = _cache(args)
    report = _import_bundle(cache, args.path)
    if args.json:
        print(json.dumps(report.to_json()))
    else:
        print(f"jitwarm: imported {len(report.imported)} entries from {args.path} into {cache.root} "
              f"({len(report.present)} already present)")
    return EXIT_OK


def _size(text: str) -> int:
    units = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    unit = t[-1] if t and t[-1] in units else ""
    try:
        return int(float(t[: len(t) - len(unit)]) * units[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid size {text!r} (e.g. 500M, 20G)") from None


def _duration(text: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    t = text.strip().lower()
    unit = t[-1] if t and t[-1] in units else "s"
    try:
        return float(t.rstrip("smhd")) * units[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid duration {text!r} (e.g. 90s, 30m, 7d)") from None


Command = Callable[[argparse.Namespace, WarmPlan | None], int]
#: Commands that act on the cache as a whole: they take no serving flags and build no plan.
PLANLESS = ("prune", "import")
COMMANDS: dict[str, tuple[str, Command]] = {
    "plan": ("list the capture shapes and the kernel specs they need (no compiling)", cmd_plan),
    "warm": ("build every missing kernel of the plan into the cache, in parallel", cmd_warm),
    "status": ("show the plan's coverage in the cache (present, missing, corrupt) and the cache size", cmd_status),
    "verify": ("check sizes and sha256 of the plan's entries; exit 4 on a corrupt one", cmd_verify),
    "prestart": ("import a bundle, warm, verify: the init-container step", cmd_prestart),
    "prune": ("remove least recently used entries by size or age", cmd_prune),
    "export": ("write the plan's entries to one relocatable bundle", cmd_export),
    "import": ("import a bundle into the cache, verifying every file", cmd_import),
}


def build_parser() -> argparse.ArgumentParser:
    """Return the top-level parser with one subcommand per entry of :data:`COMMANDS`."""
    parser = _FlagParser(prog="jitwarm", description="Warm JIT kernels before CUDA-graph capture.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_FlagParser)
    for name, (help_text, _) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name not in PLANLESS:
            add_serving_flags(p)
        p.add_argument("--json", action="store_true", help="print one JSON object")
        if name == "plan":
            continue
        c = p.add_argument_group("cache")
        c.add_argument("--cache-dir", metavar="DIR", help="writable cache root (env JITWARM_CACHE_DIR)")
        c.add_argument("--jobs", type=int, metavar="N", help="parallel builds (env JITWARM_JOBS; default: cores)")
        c.add_argument("--timeout", type=float, default=900.0, metavar="S",
                       help="deadline for waiting on another process's build (default 900)")
        r = p.add_argument_group("remote tier (one compile per spec across a fleet)")
        r.add_argument("--remote", nargs="?", const=_REMOTE_FROM_ENV, metavar="URL",
                       help="the fleet's shared Redis, redis://[:PASSWORD@]HOST:PORT/DB or rediss://... "
                            "(env JITWARM_REMOTE; alone: use JITWARM_REMOTE)")
        r.add_argument("--remote-prefix", metavar="PREFIX",
                       help="key namespace on that server (env JITWARM_REMOTE_PREFIX; default jitwarm)")
        r.add_argument("--remote-required", action="store_true",
                       help="fail (exit 1) instead of continuing locally when the remote is down "
                            "(env JITWARM_REMOTE_REQUIRED=1)")
        if name == "prestart":
            c.add_argument("--bundle", metavar="FILE", help="import this bundle first")
        elif name == "verify":
            c.add_argument("--all", action="store_true", help="verify every entry of the cache, not only the plan's")
        elif name == "prune":
            c.add_argument("--max-bytes", type=_size, metavar="SIZE", help="shrink the cache to this size (500M, 20G)")
            c.add_argument("--older-than", type=_duration, metavar="AGE", help="remove entries unused this long (7d)")
        elif name in ("export", "import"):
            p.add_argument("path", metavar="BUNDLE", help="bundle file (.tar or .tar.gz)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI and return its exit code (also the console script's entry point)."""
    from jitwarm.cache import CacheError, LockTimeout, RemoteUnavailable

    parser = build_parser()
    try:
        argv = list(sys.argv[1:] if argv is None else argv)
        # The server's own command line comes after `--`; argparse would take it for positionals.
        own, server_argv = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, None)
        args = parser.parse_args(own)
        if args.command is None:
            parser.print_help()
            return EXIT_USAGE
        if getattr(args, "jobs", None) is not None and args.jobs < 1:
            raise UsageError(f"--jobs must be a positive integer, got {args.jobs}")
        if args.command in PLANLESS:
            if server_argv is not None:
                raise UsageError(f"{args.command} takes no server command line")
            return COMMANDS[args.command][1](args, None)
        plan = WarmPlan.build(from_namespace(args, server_argv))
        return COMMANDS[args.command][1](args, plan)
    except (ConfigError, UsageError) as exc:
        return _fail(exc, EXIT_USAGE)
    except LockTimeout as exc:
        return _fail(exc, EXIT_TIMEOUT)
    except RemoteUnavailable as exc:
        return _fail(exc, EXIT_BUILD_FAILED)
    except CacheError as exc:
        return _fail(exc, EXIT_CORRUPT if args.command in ("import", "prestart", "verify") else EXIT_BUILD_FAILED)
    except ValueError as exc:  # a bad JITWARM_* value from the environment
        return _fail(exc, EXIT_USAGE)
    except KeyboardInterrupt:
        return _fail("interrupted", 130)


def _fail(exc: object, code: int) -> int:
    print(f"jitwarm: error: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}", file=sys.stderr)
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
