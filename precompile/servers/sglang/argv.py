"""The server's own command line: read the settings that shape CUDA-graph capture, ignore the rest.

``jitwarm plan -- python -m sglang.launch_server --model-path X --tp 4 ...`` (or ``sglang serve X ...``)
hands the server's argv to :func:`parse_server_argv`. It parses exactly as the argparse parser of the sglang
release this room mirrors does, from a table of every option that parser knows (``flags.json``, generated from
the wheel by ``bench/gen_sglang_flags.py`` and checked against it in ``tests/test_sglang_oracle.py``): option
values are consumed by their arity, ``--flag=value`` works, unique prefixes are accepted and ambiguous ones
refused, as argparse does. Only the settings in :data:`CAPTURE_DESTS` (and the model path) are kept. Pure Python.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from importlib import resources
from pathlib import PurePath
from typing import Any

from jitwarm.cache import files
from jitwarm.cache.errors import UsageError
from jitwarm.precompile.servers import json_object
from jitwarm.precompile.servers.command_line import ENV_ASSIGNMENT, after_interpreter, is_flag, shown_value
from jitwarm.precompile.servers.sglang import VERSION
from jitwarm.precompile.servers.sglang.rules import INPUT_KEYS


class ServerArgvError(UsageError, ValueError):
    """The server command line does not parse (as sglang's own parser would refuse it): exit 2."""


#: dest -> how its value is converted; every other option is parsed (so its values are skipped) and dropped.
CAPTURE_DESTS = {
    "cuda_graph_max_bs_decode": "int",
    "cuda_graph_bs_decode": "int_list",
    "cuda_graph_config": "json",
    "disable_cuda_graph": "flag",
    "disable_decode_cuda_graph": "flag",
    "disable_cuda_graph_padding": "flag",
    "speculative_algorithm": "str",
    "speculative_num_draft_tokens": "int",
    "speculative_num_steps": "int",
    "speculative_eagle_topk": "int",
    "speculative_dspark_block_size": "int",
    "max_running_requests": "int",
    "tp_size": "int",
    "dp_size": "int",
    "attn_dp_size": "int",
    "enable_dp_attention": "flag",
    "config": "str",
    "model_path": "str",
}

# `python -m sglang.launch_server ...`, `sglang serve ...`: the program and module or subcommand come first.
_SERVER_MODULES = ("sglang.launch_server",)
_VERIFY_MODE_ENV = "SGLANG_RAGGED_VERIFY_MODE"


@functools.cache
def flag_table() -> dict[str, Any]:
    """The option table of sglang's server parser (``flags.json``, shipped with jitwarm)."""
    text = resources.files(__package__).joinpath("flags.json").read_text(encoding="utf-8")
    return files.loads(text)


def strip_launcher(argv: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """Split the launcher (``python -m sglang.launch_server``, ``sglang serve``) and leading ``NAME=value`` words off.

    ``sglang serve MODEL`` takes the model path as its first positional argument and ``--model-type`` is the
    serve command's own (sglang/cli/serve.py:30-60, 184-187): the first becomes ``--model-path MODEL``, the
    second is dropped. :class:`ServerArgvError` for a program that is not an sglang launcher.
    """
    args = list(argv)
    env = {}
    while args and ENV_ASSIGNMENT.fullmatch(args[0]):
        name, _, value = args.pop(0).partition("=")
        env[name] = value
    return _strip_program(args), env


def _strip_program(args: list[str]) -> list[str]:
    """Drop ``python [-u ...] -m sglang.launch_server`` or ``sglang serve [--model-type T] [MODEL]``."""
    if not args or args[0].startswith("-"):
        return args
    program = PurePath(args[0]).name
    if program.startswith("python"):
        rest = after_interpreter(args, _SERVER_MODULES)
        if rest is not None:
            return rest
    elif program == "sglang" and len(args) >= 2 and args[1] == "serve":
        rest, i = [], 2
        while i < len(args):
            if args[i] == "--model-type":
                i += 2
                continue
            if not args[i].startswith("--model-type="):
                rest.append(args[i])
            i += 1
        if rest and not rest[0].startswith("-"):
            rest = ["--model-path", rest[0], *rest[1:]]
        return rest
    raise ServerArgvError(f"not an sglang server command line: {' '.join(args[:4])} ... (expected "
                          "`python -m sglang.launch_server ...` or `sglang serve ...`)")


def recognises(argv: Sequence[str]) -> bool:
    """True when ``argv`` starts (after any ``NAME=value`` words) with an sglang launcher."""
    words = [a for a in argv if not ENV_ASSIGNMENT.fullmatch(a)][:1]
    try:
        return bool(words) and not words[0].startswith("-") and strip_launcher(argv) is not None
    except ServerArgvError:
        return False


def parse_server_argv(argv: Sequence[str]) -> dict[str, Any]:
    """Return the capture settings of a server command line (launcher optional) as raw :mod:`.rules` inputs.

    The keys of :data:`.rules.INPUT_KEYS` the line sets (the verify mode when it starts with
    ``SGLANG_RAGGED_VERIFY_MODE=...``), and ``model_path``; DSpark's ``--speculative-dspark-block-size G`` becomes
    ``speculative_num_draft_tokens = G + 1`` (speculative_hook.py:807-835). :class:`ServerArgvError` for a flag
    sglang does not know, an ambiguous prefix, a missing or malformed value, a positional argument, or a server
    ``--config`` file (its contents are not read).
    """
    table = flag_table()
    options: dict[str, dict[str, Any]] = table["options"]
    values: dict[str, Any] = {}
    args, env = strip_launcher(argv)
    if _VERIFY_MODE_ENV in env:  # `SGLANG_RAGGED_VERIFY_MODE=compact python -m sglang.launch_server ...`
        values["ragged_verify_mode"] = env[_VERIFY_MODE_ENV]
    i = 0
    while i < len(args):
        token = args[i]
        i += 1
        if not token.startswith("-") or token in ("-", "--"):
            raise ServerArgvError(f"unexpected argument {token!r} in the server command line (sglang "
                                  f"{VERSION} takes no positional arguments there)")
        name, eq, inline = token.partition("=")
        option = _match_option(name, options, allow_abbrev=table.get("allow_abbrev", True))
        spec = options[option]
        nargs = spec["nargs"]
        if eq:
            if nargs == 0:
                raise ServerArgvError(f"argument {option}: ignored explicit argument {inline!r}")
            given = [inline]
        elif nargs == 0:
            given = []
        elif nargs in (1, "?"):
            if i < len(args) and not is_flag(args[i]):
                given, i = [args[i]], i + 1
            elif nargs == 1:
                raise ServerArgvError(f"argument {option}: expected one argument")
            else:
                given = []
        else:  # "+" or "*": every following token up to the next flag
            start = i
            while i < len(args) and not is_flag(args[i]):
                i += 1
            given = list(args[start:i])
            if nargs == "+" and not given:
                raise ServerArgvError(f"argument {option}: expected at least one argument")
        dest = spec["dest"]
        if dest in CAPTURE_DESTS:
            values[dest] = _convert(option, CAPTURE_DESTS[dest], given, spec)
    return _to_inputs(values)


def _match_option(name: str, options: dict[str, Any], *, allow_abbrev: bool) -> str:
    """Resolve an option string as argparse does: exact match, else a unique prefix."""
    if name in options:
        return name
    if allow_abbrev and name.startswith("--"):
        candidates = sorted(o for o in options if o.startswith(name))
        if len(candidates) == 1:
            return candidates[0]
        if candidates:
            shown = ", ".join(candidates[:6]) + (" ..." if len(candidates) > 6 else "")
            raise ServerArgvError(f"ambiguous option: {name} could match {shown} (sglang {VERSION} refuses it)")
    raise ServerArgvError(f"unrecognized server argument {name} (not a flag of sglang {VERSION})")


def _convert(option: str, kind: str, given: list[str], spec: dict[str, Any]) -> Any:
    """Turn the strings given to a capture flag into its value."""
    try:
        if kind == "flag":
            return bool(spec.get("const", True))
        if kind == "int":
            return int(given[-1])
        if kind == "int_list":
            return [int(v) for v in given]
        if kind == "json":
            return json_object(given[-1])
        return given[-1]
    except (ValueError, IndexError) as exc:
        shown = shown_value(given)
        raise ServerArgvError(f"argument {option}: invalid value {shown!r} ({exc})") from None


def _to_inputs(values: dict[str, Any]) -> dict[str, Any]:
    """Map parsed capture flags to rule inputs."""
    if "config" in values:
        raise ServerArgvError(f"the server command line reads --config {values['config']}: jitwarm does not "
                              "read server config files; put the capture flags on the command line")
    block = values.pop("speculative_dspark_block_size", None)
    if block is not None and str(values.get("speculative_algorithm", "")).upper() == "DSPARK":
        draft = values.get("speculative_num_draft_tokens")
        if draft is not None and draft != block + 1:
            # srt/arg_groups/speculative_hook.py:823-835
            raise ServerArgvError(f"--speculative-num-draft-tokens {draft} must equal "
                                  f"--speculative-dspark-block-size + 1 = {block + 1} (sglang rejects it)")
        values["speculative_num_draft_tokens"] = block + 1
    return {k: v for k, v in values.items() if k in INPUT_KEYS or k == "model_path"}


parse_argv = parse_server_argv  # the adapter's name (ServerAdapter.parse_argv)
