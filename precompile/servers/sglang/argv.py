"""sglang's command line: read the settings that shape CUDA-graph capture, ignore the rest.

It parses exactly as the release's argparse parser does, from a table of every option that parser knows
(``flags.json``, generated from the wheel by ``bench/gen_sglang_flags.py``, checked in
``tests/test_sglang_oracle.py``): values by arity, ``--flag=value``, unique prefixes. Only the settings in
:data:`CAPTURE_DESTS` are kept.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from importlib import resources
from typing import Any

from jitwarm.cache import files
from jitwarm.precompile.servers import command_line
from jitwarm.precompile.servers.command_line import ServerArgvError, converted, values_after
from jitwarm.precompile.servers.sglang import LAUNCHERS, VERSION
from jitwarm.precompile.servers.sglang.rules import INPUT_KEYS, OPTION_KEYS, VERIFY_MODE_ENV

#: dest -> how its value is converted; every other option is parsed (so its values are skipped) and dropped.
CAPTURE_DESTS = {
    "cuda_graph_max_bs_decode": "int", "cuda_graph_bs_decode": "int_list", "cuda_graph_config": "json",
    "disable_cuda_graph": "flag", "disable_decode_cuda_graph": "flag", "disable_cuda_graph_padding": "flag",
    "speculative_algorithm": "str", "speculative_num_draft_tokens": "int", "speculative_num_steps": "int",
    "speculative_eagle_topk": "int", "speculative_dspark_block_size": "int", "max_running_requests": "int",
    "tp_size": "int", "dp_size": "int", "attn_dp_size": "int", "enable_dp_attention": "flag",
    "config": "str", "model_path": "str",
    "device": "str", "enable_torch_compile": "flag", "torch_compile_max_bs": "int",
}

# `python -m sglang.launch_server ...`, `sglang serve ...`: the program and module or subcommand come first.
_LAUNCHER = (("sglang.launch_server",), "sglang")


@functools.cache
def flag_table() -> dict[str, Any]:
    """The option table of sglang's server parser (``flags.json``, shipped with jitwarm)."""
    text = resources.files(__package__).joinpath("flags.json").read_text(encoding="utf-8")
    return files.loads(text)


def recognises(argv: Sequence[str]) -> bool:
    """True when ``argv`` starts (after any ``NAME=value`` words) with an sglang launcher."""
    return command_line.recognises(argv, *_LAUNCHER)


def parse_server_argv(argv: Sequence[str]) -> dict[str, Any]:
    """Return the capture settings of a server command line (launcher optional) as raw :mod:`.rules` inputs.

    The :data:`.rules.INPUT_KEYS` the line sets (``SGLANG_RAGGED_VERIFY_MODE=...`` first too) and ``model_path``.
    :class:`ServerArgvError` for a flag sglang does not know, an ambiguous prefix, a missing or malformed value, a
    positional argument, or a server ``--config`` file (its contents are not read).
    """
    table = flag_table()
    options: dict[str, dict[str, Any]] = table["options"]
    values: dict[str, Any] = {}
    env, args = command_line.split_env(argv)
    if VERIFY_MODE_ENV in env:  # `SGLANG_RAGGED_VERIFY_MODE=compact python -m sglang.launch_server ...`
        values["ragged_verify_mode"] = env[VERIFY_MODE_ENV]
    args = _strip_launcher(args)
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
        else:
            given, i = values_after(args, i, many=nargs not in (1, "?"))  # "+", "*": up to the next flag
            if not given and nargs in (1, "+"):
                raise ServerArgvError(f"argument {option}: expected {'one' if nargs == 1 else 'at least one'} "
                                      "argument")
        dest = spec["dest"]
        kind = CAPTURE_DESTS.get(dest)
        if kind == "flag":
            values[dest] = bool(spec.get("const", True))
        elif kind is not None:
            values[dest] = converted(option, kind, given)
    return _to_inputs(values)


def _strip_launcher(args: list[str]) -> list[str]:
    """Drop the launcher; ``sglang serve MODEL`` takes the model path as its first positional argument.

    ``--model-type`` is the serve command's own (sglang/cli/serve.py:30-60, 184-187): dropped.
    """
    stripped = command_line.strip_launcher(args, *_LAUNCHER)
    if stripped is None:
        raise ServerArgvError(f"not an sglang server command line: {' '.join(args[:4])} ... (expected {LAUNCHERS})")
    rest, serve = stripped
    if serve:
        kept, i = [], 0
        while i < len(rest):
            if rest[i] == "--model-type":
                i += 2
                continue
            if not rest[i].startswith("--model-type="):
                kept.append(rest[i])
            i += 1
        rest = ["--model-path", kept[0], *kept[1:]] if kept and not kept[0].startswith("-") else kept
    return rest


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


def _to_inputs(values: dict[str, Any]) -> dict[str, Any]:
    """Map parsed capture flags to rule inputs (``--speculative-dspark-block-size G``: ``G + 1`` draft tokens)."""
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
    options = {k: values.pop(k) for k in OPTION_KEYS if k in values}  # the room's own settings
    inputs = {k: v for k, v in values.items() if k in INPUT_KEYS or k == "model_path"}
    return {**inputs, "server_options": options} if options else inputs
