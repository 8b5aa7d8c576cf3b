"""sglang's own server parser, called: the oracle for jitwarm's argv parser and the source of its flag table.

The half of sglang's functions that only the tests (and ``bench/gen_sglang_flags.py``) call: a server command
line parsed by sglang's own ``ArgumentParser`` (:func:`parse_argv`), and every option that parser knows
(:func:`flag_table`, committed as ``precompile/servers/sglang/flags.json``). The product half, the ladder by
sglang's own functions, is :mod:`jitwarm.precompile.servers.sglang.native`. Imports sglang only inside functions.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Mapping
from typing import Any

from jitwarm.cache.settings import scoped_env
from jitwarm.precompile.servers.sglang.native import installed_version
from jitwarm.precompile.servers.sglang.rules import INPUT_KEYS, NOT_FIELDS, VERIFY_MODE_ENV

_LAUNCHER = re.compile(r"(.*/)?python[0-9.]*")
_ENV_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=.*")


class _RaisingParser(argparse.ArgumentParser):
    """sglang's parser with errors raised as ValueError instead of printed with a SystemExit."""

    def error(self, message: str) -> None:  # noqa: D102
        raise ValueError(message)

    def print_help(self, file: Any = None) -> None:  # noqa: D102
        pass  # --help would print the server's help on stdout, where the answer goes

    def exit(self, status: int = 0, message: str | None = None) -> None:  # noqa: D102
        raise ValueError(message or "the command line asks for --help: it has no settings to read")


def server_parser(parser_class: type[argparse.ArgumentParser] = argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Return the argument parser ``sglang serve`` and ``python -m sglang.launch_server`` parse with.

    srt/server_args.py:679-680 (``prepare_server_args``): ``ArgumentParser(prog="sglang serve")`` filled by
    ``ServerArgs.add_cli_args``; ``parser_class`` only changes how errors are reported.
    """
    from sglang.srt.server_args import ServerArgs

    parser = parser_class(prog="sglang serve")
    ServerArgs.add_cli_args(parser)
    return parser


def parse_argv(argv: list[str]) -> dict[str, Any]:
    """Parse a server command line with sglang's own parser and return its raw capture settings.

    Parameters
    ----------
    argv
        ``python -m sglang.launch_server ARGS``, ``python3 -m ...``, ``sglang serve [MODEL] ARGS`` or bare
        ``ARGS``, optionally after ``NAME=value`` environment assignments (``SGLANG_RAGGED_VERIFY_MODE`` is
        read from them, else from this process's environment, as the server would read it).

    Returns
    -------
    dict
        The :data:`INPUT_KEYS` values; ``--dp-size N --enable-dp-attention`` comes back as sglang maps it
        (``attn_dp_size=N``, ``dp_size=1``, ``enable_dp_attention=False``). ``gpu_memory_mb`` and
        ``kv_capacity`` are None: a command line does not say them.

    Raises
    ------
    ValueError
        sglang's parser rejects the command line (unknown or ambiguous option, bad value); the message is
        argparse's.

    Examples
    --------
    >>> parse_argv(["sglang", "serve", "m", "--tp", "4"])["tp_size"]  # doctest: +SKIP
    4

    """
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.arg_groups.parallel_hook import handle_deprecated_dp_attention
    from sglang.srt.server_args import ServerArgs

    args, env = _strip_launcher(list(argv))
    parser = server_parser(_RaisingParser)
    if "--config" in args:  # srt/server_args.py:683-689
        from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger

        args = ConfigArgumentMerger(parser).merge_config_with_args(args)
    record = ServerArgs.from_cli_args(parser.parse_args(args))
    handle_deprecated_dp_attention(record)  # srt/arg_groups/parallel_hook.py:39-61
    cfg = resolving_view(record)
    inputs: dict[str, Any] = {key: getattr(cfg, key) for key in INPUT_KEYS if key not in NOT_FIELDS}
    if isinstance(inputs["cuda_graph_config"], Mapping):
        inputs["cuda_graph_config"] = {phase: dict(v) for phase, v in inputs["cuda_graph_config"].items()}
    with scoped_env({VERIFY_MODE_ENV: env[VERIFY_MODE_ENV]} if VERIFY_MODE_ENV in env else {}):
        from sglang.srt.environ import envs

        mode = envs.SGLANG_RAGGED_VERIFY_MODE.get()
    inputs.update(gpu_memory_mb=None, ragged_verify_mode=mode, kv_capacity=None)
    return inputs


def _strip_launcher(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """Split off leading ``NAME=value`` words and the launcher; return the server's own args and the env."""
    env = {}
    while argv and _ENV_ASSIGNMENT.fullmatch(argv[0]):
        name, _, value = argv.pop(0).partition("=")
        env[name] = value
    if argv and _LAUNCHER.fullmatch(argv[0]):
        rest = argv[1:]
        while rest and rest[0].startswith("-") and rest[0] != "-m":  # interpreter options: -u, -X dev, -W x
            rest = rest[2:] if rest[0] in ("-X", "-W") else rest[1:]
        if rest[:2] == ["-m", "sglang.launch_server"]:
            return rest[2:], env  # launch_server.py:81: prepare_server_args(sys.argv[1:])
        raise ValueError(f"not an sglang server command line: {' '.join(argv[:4])}")
    if len(argv) >= 2 and (argv[0] == "sglang" or argv[0].endswith("/sglang")) and argv[1] == "serve":
        # cli/serve.py:184-187: the serve command takes --model-type off and a positional model path.
        from sglang.cli.serve import _extract_model_type_override, _normalize_positional_model_path

        _, args = _extract_model_type_override(argv[2:])
        return _normalize_positional_model_path(args)[0], env
    return argv, env


def flag_table() -> dict[str, Any]:
    """Return every option string sglang's server parser accepts, with its value count and destination.

    Returns
    -------
    dict
        ``{"sglang": version, "prog", "allow_abbrev", "options": {option: {"nargs", "dest"[, "const"]}}}``:
        ``nargs`` is 0 for flags (``const`` is then the value they store, where it is JSON), 1 for one
        value, or argparse's ``"?"``, ``"*"``, ``"+"``.

    """
    parser = server_parser()
    options = {}
    for action in parser._actions:  # argparse keeps no public list of its actions
        nargs = 1 if action.nargs is None else action.nargs
        for option in action.option_strings:
            entry: dict[str, Any] = {"nargs": nargs, "dest": action.dest}
            if nargs == 0:
                const = action.const
                if isinstance(action, argparse.BooleanOptionalAction):
                    const = not option.startswith("--no-")
                if const is None or isinstance(const, (bool, int, float, str)):
                    entry["const"] = const
            options[option] = entry
    return {"sglang": installed_version(), "prog": parser.prog, "allow_abbrev": parser.allow_abbrev,
            "options": dict(sorted(options.items()))}
