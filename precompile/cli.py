"""The ``jitwarm`` command line: its parser, its flags' checks, and every error as one line and its exit code."""

from __future__ import annotations

import argparse
import json
import math
import signal
import sys
import threading
from collections.abc import Callable, Sequence

from jitwarm.cache.errors import (
    EXIT_BUILD_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    JitwarmError,
    RemoteUnavailable,
    RootNotWritable,
    UntrustedPath,
    UsageError,
)
from jitwarm.cache.settings import MAX_JOBS
from jitwarm.precompile import capture, commands, contents, ledger, prestart, shipping
from jitwarm.precompile.builders import log_lines
from jitwarm.precompile.commands import asks_for_families, build_plan
from jitwarm.precompile.coverage import REMOTE_FROM_ENV
from jitwarm.precompile.flags import FlagParser, add_serving_flags, path_flag, split_server_argv
from jitwarm.precompile.plan import WarmPlan

Command = Callable[[argparse.Namespace, WarmPlan | None], int]
COMMANDS: dict[str, tuple[str, Command]] = {
    "plan": ("list the capture shapes and the kernel specs they need (no compiling)", commands.cmd_plan),
    "warm": ("build every missing kernel of the plan into the cache, in parallel", shipping.cmd_warm),
    "status": ("show the plan's coverage in the cache (exit 0 only when every spec is there)", commands.cmd_status),
    "verify": ("hash every file of the plan's entries (--all: of every entry); exit 4 on a corrupt one, 5 on a "
               "missing one", commands.cmd_verify),
    "prestart": ("import a bundle, warm, verify: the init-container step", prestart.cmd_prestart),
    "prune": ("remove least recently used entries by size or age", commands.cmd_prune),
    "export": ("write the plan's entries to one relocatable bundle", shipping.cmd_export),
    "import": ("import a bundle into the cache, verifying every file", shipping.cmd_import),
    "inspect": ("list a bundle's entries: family, size, fingerprint, and where each would be restored here",
                contents.cmd_inspect),
    "capture": ("run the server once on private, empty JIT caches with jitwarm recording until its start is over, "
                "stop it, store and verify every JIT cache unit it compiled (--export: bundle them), then write the "
                "manifest", capture.cmd_capture),
    "ledger": ("print the ledger a start wrote (JITWARM_LEDGER), one line per family; --require-zero: exit 1 when "
               "it compiled anything", ledger.cmd_ledger),
}
#: Commands that take no serving flags and build no plan.
PLANLESS = ("prune", "import", "capture", "inspect", "ledger")

_MAX_BYTES = 1 << 60  # an exabyte: more is a typo
_MAX_SECONDS = 10 * 365 * 86400.0


class _Help(argparse.HelpFormatter):
    """Help that shows each option's default, where it has one worth showing."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default not in (None, False, argparse.SUPPRESS) and "default" not in text and action.option_strings:
            text += f" (default: {action.default})"
        return text


def _number(text: str, what: str, example: str) -> float:
    """A finite number >= 0 in ASCII digits (float() reads any script's: '٣')."""
    try:
        value = float(text) if text.isascii() else float("x")
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid {what} {text!r} ({example})") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"invalid {what} {text!r}: must be a finite number >= 0 ({example})")
    return value


def _size(text: str) -> int:
    """A size such as ``500M`` or ``20G`` (powers of 1024), from 0 to an exabyte."""
    units = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40, "p": 2**50}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    unit = t[-1] if t and t[-1] in units else ""
    value = _number(t[: len(t) - len(unit)], "size", "e.g. 500M, 20G") * units[unit]
    if value > _MAX_BYTES:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: larger than any disk")
    return int(value)


def _duration(text: str) -> float:
    """An age such as ``90s``, ``30m``, ``12h`` or ``7d``, from 0 to ten years."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    t = text.strip().lower()
    unit = t[-1] if t and t[-1] in units else "s"
    value = _number(t.removesuffix(unit), "duration", "e.g. 90s, 30m, 7d") * units[unit]
    if value > _MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"invalid duration {text!r}: more than ten years")
    return value


def _timeout(text: str) -> float:
    value = _number(text, "timeout", "seconds, e.g. 900")
    if value == 0 or value > _MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"invalid timeout {text!r}: must be more than 0 and at most ten years")
    return value


def _sha256(text: str) -> str:
    t = text.strip().lower()
    if len(t) != 64 or not all(c in "0123456789abcdef" for c in t):
        raise argparse.ArgumentTypeError(f"invalid --sha256 {text[:80]!r}: 64 hex digits, as sha256sum prints them")
    return t


def _jobs(text: str) -> int:
    if not text.strip().isascii() or not text.strip().isdigit() or not 1 <= int(text) <= MAX_JOBS:
        raise argparse.ArgumentTypeError(f"invalid --jobs {text!r}: an integer from 1 to {MAX_JOBS}")
    return int(text)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("jitwarm")
    except PackageNotFoundError:  # run from a checkout
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    """Return the top-level parser with one subcommand per entry of :data:`COMMANDS`."""
    parser = FlagParser(prog="jitwarm", description="Warm JIT kernels before CUDA-graph capture.",
                        epilog="Commands that plan take the server's own command line after --.")
    parser.add_argument("--version", action="version", version=f"jitwarm {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=FlagParser)
    for name, (help_text, _) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, formatter_class=_Help)
        if name not in PLANLESS:
            add_serving_flags(p)
            p.add_argument("--manifest", action="append", type=path_flag, metavar="PATH",
                           help="also plan the server kernels recorded in this manifest (jitwarm.precompile.record; "
                                "JITWARM_RECORD); alone, plan only those")
        p.add_argument("--json", action="store_true", help="print one JSON object")
        if name == "ledger":
            p.add_argument("path", metavar="FILE", type=path_flag, help="the ledger file (JITWARM_LEDGER)")
            p.add_argument("--require-zero", action="store_true", help="exit 1 when anything compiled (a CI gate)")
        if name in ("plan", "ledger"):
            continue
        c = p.add_argument_group("cache")
        c.add_argument("--cache-dir", type=path_flag, metavar="DIR", help="writable cache root (env JITWARM_CACHE_DIR)")
        if name not in PLANLESS:
            c.add_argument("--jobs", type=_jobs, metavar="N", help="parallel builds (env JITWARM_JOBS; default: cores)")
        if name == "capture":
            p.add_argument("--manifest", type=path_flag, metavar="PATH", default="server.jsonl",
                           help="the manifest to write: this start's records, replacing the file whole once the "
                                "capture is complete (the server's log is kept beside it, NAME.log)")
            p.add_argument("--export", metavar="BUNDLE",
                           help="then write the captured entries to this bundle (a file, or s3://BUCKET/KEY.tar), "
                                "before the manifest")
            c.add_argument("--timeout", type=_timeout, default=1800.0, metavar="S",
                           help="deadline for the server's start (its health endpoint and jitwarm's ledger)")
            p.add_argument("--warm-requests", type=path_flag, metavar="FILE",
                           help="after ready, send these requests (JSON lines: {\"path\": ..., \"body\": ...}) "
                                "instead of the built-in first requests, so what they compile is captured too")
        else:
            c.add_argument("--timeout", type=_timeout, default=900.0, metavar="S",
                           help="deadline for waiting on another process's build")
        r = p.add_argument_group("remote tier (one compile per spec across a fleet)")
        r.add_argument("--remote", nargs="?", const=REMOTE_FROM_ENV, metavar="URL",
                       help="the fleet's shared Redis, redis://[:PASSWORD@]HOST:PORT/DB or rediss://..., or "
                            "bucket, s3://BUCKET/PREFIX (the s3 extra; env JITWARM_REMOTE; alone: use JITWARM_REMOTE)")
        r.add_argument("--remote-prefix", metavar="PREFIX",
                       help="key namespace on that server (env JITWARM_REMOTE_PREFIX; default jitwarm)")
        r.add_argument("--remote-required", action="store_true",
                       help="fail (exit 1) instead of continuing locally when the remote is down "
                            "(env JITWARM_REMOTE_REQUIRED=1)")
        if name in ("warm", "prestart"):
            c.add_argument("--allow-fingerprint-mismatch", action="store_true",
                           help="restore a captured JIT cache unit even when a package, compiler, driver or arch "
                                "its library keyed it on differs here (a warning each; default: exit 4)")
        if name == "prestart":
            c.add_argument("--bundle", type=path_flag, metavar="FILE",
                           help="import this bundle first (a file, or an object s3://BUCKET/KEY.tar, streamed)")
            c.add_argument("--sha256", type=_sha256, metavar="DIGEST",
                           help="refuse a --bundle whose sha256 (as sha256sum prints it, and export reports it) is "
                                "not DIGEST, before importing anything (exit 4)")
            c.add_argument("--offline", action="store_true",
                           help="build nothing: a spec the bundle and the cache lack is exit 5, and so is a "
                                "bundle that holds none of the plan's specs")
        elif name == "verify":
            c.add_argument("--all", action="store_true",
                           help="verify every entry of the cache (no plan needed; with one, its missing specs "
                                "are reported too)")
            c.add_argument("--repair", action="store_true",
                           help="move corrupt entries to quarantine (they are rebuilt)")
        elif name == "prune":
            c.add_argument("--max-bytes", type=_size, metavar="SIZE", help="shrink the cache to this size (500M, 20G)")
            c.add_argument("--older-than", type=_duration, metavar="AGE", help="remove entries unused this long (7d)")
            c.add_argument("--grace", type=_duration, metavar="SECONDS",
                           help="keep entries used this recently (env JITWARM_PRUNE_GRACE_S; default 600; 0: off)")
        elif name in ("export", "import", "inspect"):
            p.add_argument("path", metavar="BUNDLE", type=path_flag,
                           help="bundle file (.tar or .tar.gz), or an object s3://BUCKET/KEY.tar (streamed; boto3)")
    for name, p in sub.choices.items():
        p.usage = _usage(p, name)
    return parser


def _usage(p: argparse.ArgumentParser, name: str) -> str:
    """The command's usage: its own flags, the server flags as one word, and ``-- SERVER LINE`` where it takes one."""
    grouped = [a for g in p._action_groups if g.title and not g.title.startswith(("options", "cache", "remote"))
               and name not in PLANLESS for a in g._group_actions if a.dest != "manifest"]
    formatter = p._get_formatter()
    formatter.add_usage(None, [a for a in p._actions if a not in grouped], [], prefix="usage: ")
    own = formatter.format_help().strip().removeprefix("usage: ")  # argparse puts it back: the lines stay aligned
    if name == "capture":
        return f"{own} -- SERVER LINE"
    return own if name in PLANLESS else f"{own} [SERVER FLAGS] [-- SERVER LINE]"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI and return its exit code (also the console script's entry point)."""
    with log_lines():
        return _run(argv)


def _run(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args: argparse.Namespace | None = None
    try:
        argv = list(sys.argv[1:] if argv is None else argv)
        # The server's own command line comes after `--`; argparse would take it for positionals.
        own, server_argv = split_server_argv(argv) if "--" in argv else (argv, None)
        args = _parse(parser, own)
        if args.command is None:
            parser.print_help()
            return EXIT_USAGE
        _check_combinations(args, server_argv)
        if args.command == "capture":
            return capture.cmd_capture(args, server_argv)
        if args.command in PLANLESS or (args.command == "verify" and args.all
                                        and not (args.manifest or asks_for_families(args, server_argv))):
            if server_argv is not None:
                raise UsageError(f"{args.command} takes no server command line")
            return COMMANDS[args.command][1](args, None)
        plan = build_plan(args, server_argv)
        bundled = args.command == "prestart" and args.bundle  # the bundle's own manifest joins the plan
        if not plan.specs and plan.manifest is not None and plan.config is None and not bundled:
            raise UsageError(f"the plan is empty: {plan.manifest['path']} has no records for the targets asked for "
                             f"({plan.manifest['records']} records, {plan.manifest['other_targets']} for other "
                             "targets): nothing to warm")
        if not plan.specs and not (args.command == "verify" and args.all) and not bundled:  # --all: every entry
            return commands.nothing_to_warm(args, plan)
        return COMMANDS[args.command][1](args, plan)
    except JitwarmError as exc:
        return _fail(args, _cli_message(exc), exc.exit_code)
    except capture.Interrupted as exc:  # capture stopped its server first; the shell's code for the signal
        return _fail(args, f"interrupted ({exc}): the server's process group is stopped", 128 + exc.signum)
    except KeyboardInterrupt:
        # A second Ctrl-C during finalization (which restores SIG_DFL, but keeps SIG_IGN) killed us by signal
        # instead of exit 130 (test_one_ctrl_c_stops_warm_and_its_compilers_quickly, under load).
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        return _fail(args, "interrupted", EXIT_INTERRUPTED)
    except BrokenPipeError:  # `jitwarm plan | head`
        return EXIT_OK
    except OSError as exc:  # a write the commands did not expect to fail: a full disk, a read-only volume
        where = f": {exc.filename}" if exc.filename else ""
        return _fail(args, f"{exc.strerror or exc}{where}", EXIT_BUILD_FAILED)


def _parse(parser: argparse.ArgumentParser, own: list[str]) -> argparse.Namespace:
    """Parse jitwarm's own flags; a server line given without ``--`` before it is told so."""
    try:
        return parser.parse_args(own)
    except UsageError as exc:
        if "unrecognized arguments" in str(exc) and any(w in own for w in ("serve", "-m", "python", "python3")):
            raise UsageError(f"{str(exc).splitlines()[0]}: put the server's command line after -- "
                             "(jitwarm plan -- vllm serve MODEL ...)") from None
        raise


def _check_combinations(args: argparse.Namespace, server_argv: list[str] | None) -> None:
    """Flags that mean nothing together, and a ``--`` with nothing after it: one line each, exit 2."""
    if server_argv == []:  # `jitwarm prestart -- $SERVER` with SERVER unset
        raise UsageError("no server command line after -- (is the variable that holds it empty?)")
    if getattr(args, "sha256", None) and not getattr(args, "bundle", None):
        raise UsageError("--sha256 pins the bundle given with --bundle: give --bundle FILE too")
    if getattr(args, "remote_prefix", None) is not None and not args.remote_prefix.strip():
        raise UsageError("--remote-prefix is empty: give the key namespace (default jitwarm), or leave it out")


#: The command line's own hint for the errors whose hint names the Python API, by type (the first match wins).
_CLI_HINTS: tuple[tuple[type[JitwarmError], str], ...] = (
    (UntrustedPath, "set JITWARM_ALLOW_SHARED=1 to accept it"),
    (RootNotWritable, "pass --cache-dir DIR (or set JITWARM_CACHE_DIR) to a writable directory"),
)


def _cli_message(exc: JitwarmError) -> str:
    """The error's one line, with the command line's hint where the error's own names the Python API."""
    if isinstance(exc, RemoteUnavailable):
        return (f"the remote cache {exc.url} is unavailable ({exc.reason}) and it is required "
                "(--remote-required or JITWARM_REMOTE_REQUIRED=1)")
    # No hint of its own: no setting changes the outcome (JITWARM_ALLOW_SHARED never accepts a planted link).
    hint = next((ours for kind, ours in _CLI_HINTS if isinstance(exc, kind)), None) if exc.hint else None
    return f"{exc.reason}; {hint}" if hint else str(exc)


def _fail(args: argparse.Namespace | None, message: str, code: int) -> int:
    line = message.splitlines()[0] if message else "failed"
    print(f"jitwarm: error: {line}", file=sys.stderr)
    if args is not None and args.command == "prestart" and getattr(args, "json", False):
        print(json.dumps({"ready": False, "exit_code": code, "error": line}))  # the probe's one document
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

