"""jitwarm's serving flags (sglang's as aliases): their parser, their values' types, where the server's line starts."""

from __future__ import annotations

import argparse
import functools
import math
from collections.abc import Sequence
from typing import Any

from jitwarm.cache.errors import UsageError
from jitwarm.kernels import BUILDABLE, DTYPES
from jitwarm.precompile import servers


class ConfigError(UsageError, ValueError):
    """A serving config or flag is invalid (exit 2); ``problems`` holds one message per problem."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        super().__init__("; ".join(self.problems))


def split_server_argv(argv: Sequence[str]) -> tuple[list[str], list[str] | None]:
    """Split ``argv`` into jitwarm's own flags and the server's command line (None when there is none)."""
    argv = list(argv)
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    model = any(a in ("--model-path", "--model") or a.startswith(("--model-path=", "--model=")) for a in argv)
    if model or servers.recognised(argv):
        return [], argv
    return argv, None


class FlagParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors raise ConfigError instead of printing usage and exiting."""

    def error(self, message: str) -> None:  # type: ignore[override]
        """Raise the message as a ConfigError (exit 2, one line)."""
        raise ConfigError([message])


def _json_object(text: str) -> dict[str, Any]:
    """The --graph-config flag's value: the parser sglang's own --cuda-graph-config goes through here."""
    try:
        return servers.json_object(text)
    except ValueError as exc:
        if str(exc) == "not a JSON object":
            raise argparse.ArgumentTypeError("must be a JSON object such as '{\"decode\": {\"max_bs\": 64}}'") from None
        raise argparse.ArgumentTypeError(f"not JSON: {str(exc).splitlines()[0]}") from None


def _finite_int(text: str) -> int:
    """An int flag's value: ASCII digits (``int("٩٠")`` is 90), or a whole number written as a float (``1e3``)."""
    try:
        value = float(text) if "." in text or "e" in text.lower() else int(text)
        if text.isascii() and math.isfinite(value) and value == int(value):
            return int(value)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"invalid int value: {text!r}")


#: The longest path and path component a Linux filesystem takes (PATH_MAX, NAME_MAX).
MAX_PATH, MAX_NAME = 4096, 255


def path_flag(text: str) -> str:
    """A path flag's value; an empty one (an unset variable) and one no filesystem takes are refused."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path (an unset shell variable?)")
    if len(text.encode()) > MAX_PATH or any(len(part.encode()) > MAX_NAME for part in text.split("/")):
        raise argparse.ArgumentTypeError(f"a path longer than a filesystem takes ({len(text)} characters: "
                                         f"{text[:40]}...)")
    return text


#: Names a flag or a TOML key may use besides a field's own and sglang's: short forms and long parallel sizes.
_MORE_ALIASES = {"cuda_graph_max_bs": "graph_max_bs", "cuda_graph_bs": "graph_bs", "tensor_parallel_size": "tp",
                 "data_parallel_size": "dp", "attention_data_parallel_size": "attn_dp", "backend": "backends",
                 "target": "targets"}


@functools.cache
def aliases() -> dict[str, str]:
    """Other name -> field, underscores for dashes: sglang's flags and :data:`_MORE_ALIASES`.

    sglang's are its room's ``FIELD_FLAGS``: a config or a script written with sglang's names reads as it is.
    """
    own = servers.adapter("sglang").FIELD_FLAGS
    sglang = {flag.lstrip("-").replace("-", "_"): name for name, flag in own.items()}
    return {alias: name for alias, name in {**sglang, **_MORE_ALIASES}.items() if alias != name}


#: Where :class:`_Setting` keeps the flag that set each setting, on the parsed namespace.
GIVEN_AS = "_given_as"


class _Setting(argparse.Action):
    """Store a serving setting; one given under two of its names (``--tp`` and ``--tp-size``) is a usage error."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        given = vars(namespace).setdefault(GIVEN_AS, {})
        if given.setdefault(self.dest, option_string) != option_string:
            raise ConfigError([f"{given[self.dest]} and {option_string} are one setting ({self.dest}); give one"])
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)


_SWITCH = {"nargs": 0, "const": True}
#: jitwarm's serving flags: field -> how its flag reads (each also takes the field's :func:`aliases`, unlisted).
_SETTINGS: dict[str, dict[str, Any]] = {
    "graph_max_bs": {"type": _finite_int, "metavar": "N", "help": "largest decode batch captured (default: the "
                     "server's, from GPU memory and TP size)"},
    "graph_bs": {"type": _finite_int, "nargs": "+", "metavar": "BS", "help": "explicit decode capture batch sizes"},
    "graph_config": {"type": _json_object, "metavar": "JSON", "help": "per-phase JSON as sglang's "
                     "--cuda-graph-config, e.g. '{\"decode\": {\"max_bs\": 64}}' (wins over the flags)"},
    "no_graphs": _SWITCH, "no_decode_graphs": _SWITCH,
    "no_graph_padding": {**_SWITCH, "help": "capture every batch size up to the max"},
    "draft_algorithm": {"metavar": "NAME", "help": "speculative decoding's algorithm, e.g. DSPARK, EAGLE, NGRAM "
                        "(the speculative ladder needs one)"},
    "draft_tokens": {"type": _finite_int, "metavar": "N", "help": "tokens verified per request"},
    "draft_steps": {"type": _finite_int, "metavar": "N",
                    "help": "EAGLE draft steps (with top-k 1, steps + 1 tokens are verified)"},
    "draft_topk": {"type": _finite_int, "metavar": "K"},
    "max_requests": {"type": _finite_int, "metavar": "N",
                     "help": "request pool size (speculative default 48); cuts the ladder"},
    "tp": {"type": _finite_int, "metavar": "N", "help": "tensor-parallel size"},
    "dp": {"type": _finite_int, "metavar": "N", "help": "data-parallel size"},
    "attn_dp": {"type": _finite_int, "metavar": "N", "help": "attention data-parallel size"},
    "dp_attention": {**_SWITCH, "help": "with --dp N: the deprecated spelling of --attn-dp N"},
}


#: The title of the group :func:`add_serving_flags` adds (the usage line names it instead of listing its flags).
SERVING_GROUP = "serving settings as flags"


def add_serving_flags(parser: argparse.ArgumentParser) -> None:
    """Add the server line's description, the serving, model and build-target flags to ``parser`` (unset: None)."""
    version = f"{servers.DEFAULT} {servers.adapter(servers.DEFAULT).VERSION}"
    launchers = "; ".join(f"{name} {servers.adapter(name).VERSION}: {servers.adapter(name).LAUNCHERS}"
                          for name in servers.ROOMS)
    parser.add_argument_group("-- SERVER LINE", f"the server's own command line, last, as the server runs it: "
                                                f"{launchers}")
    g = parser.add_argument_group(
        f"{SERVING_GROUP} (without a server line, or --config; vLLM's come from its line only)",
        "sglang's flag names are aliases: --cuda-graph-max-bs-decode (and --cuda-graph-max-bs) for --graph-max-bs, "
        "--speculative-num-draft-tokens for --draft-tokens, --max-running-requests, --tp-size, ... (docs/sglang.md)")
    g.add_argument("--config", type=path_flag, metavar="FILE.toml", help="read these settings from a TOML file first")
    for name, how in _SETTINGS.items():
        g.add_argument("--" + name.replace("_", "-"), dest=name, action=_Setting, default=None, **how)
        for alias in (alias for alias, field in aliases().items() if field == name):
            g.add_argument("--" + alias.replace("_", "-"), dest=name, action=_Setting, default=None,
                           **{**how, "help": argparse.SUPPRESS})
    g.add_argument("--gpu-memory-mb", type=_finite_int, metavar="MIB",
                   help="device memory the server's default max batch is taken from, on a box without the GPU "
                        "(default: read from the GPU; an H200 has 143771)")
    g.add_argument("--ragged-verify-mode", metavar="MODE",
                   help="static | cap-accept | compact: what SGLANG_RAGGED_VERIFY_MODE would say (default: that "
                        "variable, else static)")
    g.add_argument("--ladder-source", metavar="SOURCE",
                   help=f"auto (the built-in rules, unless the installed server is not {version}: then its own "
                        f"functions, remembered per version and command line) | builtin (rules mirroring "
                        f"{version}) | {servers.DEFAULT} (its own functions, every time)")
    m = parser.add_argument_group("model (which of jitwarm's kernel families it runs, and their dims)")
    m.add_argument("--model-architecture", metavar="NAME",
                   help="the model's architecture as its config.json names it (DeepseekV4ForCausalLM runs jitwarm's "
                        "families); default: read from a local --model-path, else judged from its name")
    for name in ("--head-dim", "--rope-dim", "--num-q-heads", "--num-kv-heads"):
        m.add_argument(name, type=_finite_int)
    m.add_argument("--compress-ratios", type=_finite_int, nargs="+", metavar="R")
    m.add_argument("--dtype", metavar="DTYPE", help=" | ".join(DTYPES))
    b = parser.add_argument_group("build")
    b.add_argument("--backend", dest="backends", action="append", metavar="NAME",
                   help=f"{' | '.join(BUILDABLE)}; repeat for several (default tvm_ffi)")
    b.add_argument("--target", dest="targets", action="append", metavar="ARCH",
                   help="cpu | sm_90 | sm_100 | ...; repeat for several (default: the local GPU, else cpu)")
