"""The ``jitwarm`` command line: plan, warm, status, verify, prestart, prune, export, import.

Exit codes (DESIGN.md): 0 ok; 1 a build failed; 2 bad usage or config; 3 timed out waiting;
4 verification found corrupt entries. User errors print one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence

from jitwarm.kernels import KernelSpec
from jitwarm.precompile.config import ConfigError, _FlagParser, add_serving_flags, from_namespace
from jitwarm.precompile.plan import WarmPlan

EXIT_OK, EXIT_BUILD_FAILED, EXIT_USAGE, EXIT_TIMEOUT, EXIT_CORRUPT = 0, 1, 2, 3, 4


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
    rows = [("bs", "tokens", "slots", "verify_lens", "uniform", "new specs")]
    for sh in plan.shapes:
        new = " ".join(labels[s] for s in plan.introduced[sh.bs]) or "-"
        rows.append((str(sh.bs), str(sh.num_tokens), str(sh.layout.slots), sh.layout.run_length(),
                     "yes" if sh.layout.uniform else "no", new))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = ["  ".join([c.rjust(w) if i < 3 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
                       + [r[5]]).rstrip() for r in rows]
    fams = ", ".join(f"{name} {n}" for name, n in plan.by_family().items())
    targets = ", ".join(f"{b}:{t}" for b in plan.config.backends for t in plan.config.targets)
    lines.append("")
    lines.append(f"{len(plan.specs)} specs for {len(plan.shapes)} shapes ({fams}) on {targets}; "
                 f"plan id {plan.plan_id}")
    return "\n".join(lines)


def cmd_plan(args: argparse.Namespace, plan: WarmPlan) -> int:
    """Print the plan: a table, or one JSON object with ``--json``."""
    print(json.dumps(plan.to_json()) if args.json else render_plan(plan))
    return EXIT_OK


Command = Callable[[argparse.Namespace, WarmPlan], int]
COMMANDS: dict[str, tuple[str, Command]] = {
    "plan": ("list the capture shapes and the kernel specs they need (no compiling)", cmd_plan),
}


def build_parser() -> argparse.ArgumentParser:
    """Return the top-level parser with one subcommand per entry of :data:`COMMANDS`."""
    parser = _FlagParser(prog="jitwarm", description="Warm JIT kernels before CUDA-graph capture.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_FlagParser)
    for name, (help_text, _) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_serving_flags(p)
        p.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI and return its exit code (also the console script's entry point)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help()
            return EXIT_USAGE
        plan = WarmPlan.build(from_namespace(args))
        return COMMANDS[args.command][1](args, plan)
    except (ConfigError, UsageError) as exc:
        print(f"jitwarm: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
