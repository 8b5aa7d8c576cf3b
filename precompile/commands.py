"""The plan the flags describe, and the commands that read the cache: ``plan``, ``status``, ``verify``, ``prune``."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from jitwarm.cache.errors import EXIT_OK, UsageError
from jitwarm.kernels import KernelSpec, Target, TargetError
from jitwarm.precompile.config import from_namespace, serving_flags_given
from jitwarm.precompile.coverage import keys_of, open_cache, plan_coverage, readiness, verify_reported, where_looked
from jitwarm.precompile.plan import WarmPlan

#: Flags that tune a plan but do not ask for jitwarm's own families (with ``--manifest`` alone: manifest-only).
PLAN_MODIFIERS = ("targets", "backends", "ladder_source", "gpu_memory_mb", "ragged_verify_mode")


def asks_for_families(args: argparse.Namespace, server_argv: list[str] | None) -> bool:
    """Whether a server line, a config file or a serving flag (no PLAN_MODIFIERS) asks for jitwarm's families."""
    asked = argparse.Namespace(**{**vars(args), **dict.fromkeys(PLAN_MODIFIERS)})
    return serving_flags_given(asked, server_argv)


def build_plan(args: argparse.Namespace, server_argv: list[str] | None) -> WarmPlan:
    """The config's plan plus each ``--manifest``'s kernels on its targets (a manifest or bundle alone: only those)."""
    manifests = getattr(args, "manifest", None) or []
    if not (manifests or getattr(args, "bundle", None)) or asks_for_families(args, server_argv):
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
    """An empty plan is success, said once (an init container must not block the pod); ``export`` refuses."""
    why = plan.ladder.disabled if plan.ladder and plan.ladder.disabled else "no capture shapes"
    what = "the server captures no decode CUDA graphs"
    if plan.shapes and plan.families is not None and not plan.families.planned:  # e.g. a Llama server
        why, what = plan.families.why, "the model runs none of jitwarm's kernel families"
    if args.command == "export":
        raise UsageError(f"the plan is empty ({why}): {what}, nothing to export")
    still = ""
    if args.command == "plan":  # the graphs' kernels are not all a start compiles
        still = ("; its start still fills its own JIT caches (Inductor, Triton, ...): `jitwarm capture -- SERVER "
                 "LINE` records them" + (f" ({installed(plan.config.server)})" if plan.config else ""))
    print(f"jitwarm: nothing to warm: the plan is empty ({why}): {what}{still}", file=sys.stderr)
    if args.json:
        doc = plan.to_json() if args.command == "plan" else {"plan_id": plan.plan_id, "ok": True, "ready": True,
                                                             "specs": 0, "empty": why}
        print(json.dumps(doc))
    return EXIT_OK


def installed(server: str) -> str:
    """Which release of ``server`` is installed here (what the plan's rules were checked against)."""
    from importlib.metadata import PackageNotFoundError, version

    for name in (server, f"{server}-cpu"):
        try:
            return f"installed here: {name} {version(name)}"
        except PackageNotFoundError:
            continue
    return f"{server} is not installed here"


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
        # A server whose graphs carry a mode (vLLM: PIECEWISE, FULL) gets a column for it: one row per graph.
        mode = any(sh.key for sh in plan.shapes)
        rows = [("mode",) * mode + ("bs", "graph key", "tokens", "slots", "verify_lens", "uniform", "new specs")]
        for sh in plan.shapes:
            new = " ".join(labels[s] for s in plan.introduced[sh]) or "-"
            rows.append(((sh.key or "-").split()[0],) * mode + (
                str(sh.bs), str(sh.graph_key), str(sh.num_tokens), str(sh.layout.slots), sh.layout.run_length(),
                "yes" if sh.layout.uniform else "no", new))
        last = len(rows[0]) - 1
        widths = [max(len(r[i]) for r in rows) for i in range(last)]
        lines = ["  ".join([c.rjust(w) if mode <= i < mode + 4 else c.ljust(w)
                            for i, (c, w) in enumerate(zip(r, widths, strict=False))] + [r[last]]).rstrip()
                 for r in rows]
        fams = ", ".join(f"{name} {n}" for name, n in plan.by_family().items())
        targets = ", ".join(f"{b}:{t}" for b in plan.config.backends for t in plan.config.targets)
        lines += ["", f"{len(plan.specs) - len(plan.recorded)} specs for {len(plan.shapes)} shapes ({fams}) on "
                  f"{targets}", f"ladder: {plan.ladder.source}; {installed(plan.config.server)}"]
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



def cmd_prune(args: argparse.Namespace, plan: None) -> int:
    """Remove least recently used entries down to ``--max-bytes`` and entries unused for ``--older-than``."""
    if args.max_bytes is None and args.older_than is None:
        raise UsageError("prune needs --max-bytes SIZE and/or --older-than AGE")
    report = open_cache(args).prune(max_bytes=args.max_bytes, older_than_s=args.older_than, grace_s=args.grace)
    if args.json:
        print(json.dumps(report.to_json()))
    else:
        kept = f"; kept {len(report.skipped_locked)} in use (locked)" if report.skipped_locked else ""
        kept += f"; kept {len(report.skipped_recent)} used within the grace period" if report.skipped_recent else ""
        print(f"jitwarm: pruned {len(report.removed)} entries ({report.freed_bytes / 2**20:.1f} MiB) and "
              f"{len(report.staging_removed)} abandoned builds; {report.remaining_bytes / 2**20:.1f} MiB left{kept}")
    return EXIT_OK



def cmd_status(args: argparse.Namespace, plan: WarmPlan) -> int:
    """Show how much of the plan the cache (and the remote) holds, and its size; never changes it."""
    cache = open_cache(args)
    keys = keys_of(plan, cache, look_only=True)  # once: a spec that cannot be keyed is said once
    coverage = plan_coverage(plan, cache, keys=keys)
    off = where_looked(plan, coverage)
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
            print(f"  {state}: {spec_id}" + (f": in jitwarm's cache, but {'; '.join(off[spec_id])}"
                                             if spec_id in off else ""))
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
        off: dict[str, list[str]] = {}  # --all verifies the store's entries, not where the libraries look
    else:
        coverage = plan_coverage(plan, cache, repair=args.repair)
        off = where_looked(plan, coverage)
        ok, corrupt, missing = coverage["present"], coverage["corrupt"], coverage["missing"]
        why, moved = coverage["why"], set(coverage["quarantined"])
    if args.json:
        print(json.dumps({"ok": len(ok), "corrupt": corrupt, "missing": missing, "repaired": bool(args.repair),
                          **({} if args.all else {"not_where_looked": off})}))
    else:
        for item in corrupt:
            state = "quarantined" if item in moved else "left as it is; --repair moves it aside" if not args.repair \
                else "not moved"
            print(f"jitwarm: corrupt ({state}): {item}: {why.get(item, '?')}", file=sys.stderr)
        for item in missing:
            where = f": in jitwarm's cache, but {'; '.join(off[item])}" if item in off else ""
            print(f"jitwarm: missing: {item}{where}", file=sys.stderr)
        print(f"jitwarm: verified {len(ok)} entries, {len(corrupt)} corrupt, {len(missing)} missing")
    return readiness({"corrupt": corrupt, "missing": missing})
