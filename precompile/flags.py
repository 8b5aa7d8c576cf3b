"""jitwarm's serving flags (sglang's names): their parser, their values' types, and where the server's line starts."""

from __future__ import annotations

import argparse
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
    """The --cuda-graph-config flag's value: the parser the server's own --cuda-graph-config goes through."""
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


#: The title of the group :func:`add_serving_flags` adds (the usage line names it instead of listing its flags).
SERVING_GROUP = "sglang settings as flags"


def add_serving_flags(parser: argparse.ArgumentParser) -> None:
    """Add the server line's description, the serving, model and build-target flags to ``parser`` (unset: None)."""
    version = f"{servers.DEFAULT} {servers.adapter(servers.DEFAULT).VERSION}"
    launchers = "; ".join(f"{name} {servers.adapter(name).VERSION}: {servers.adapter(name).LAUNCHERS}"
                          for name in servers.ROOMS)
    parser.add_argument_group("-- SERVER LINE", f"the server's own command line, last, as the server runs it: "
                                                f"{launchers}")
    g = parser.add_argument_group(
        f"{SERVING_GROUP} ({version}'s names; without a server line, or --config; vLLM's come from its line only)")
    g.add_argument("--config", type=path_flag, metavar="FILE.toml", help="read these settings from a TOML file first")
    g.add_argument("--cuda-graph-max-bs-decode", "--cuda-graph-max-bs", dest="cuda_graph_max_bs_decode",
                   type=_finite_int, metavar="N",
                   help="largest decode batch captured (default: sglang's, from GPU memory and TP size); the "
                        f"--cuda-graph-max-bs alias is jitwarm's only: {version} refuses it after --")
    g.add_argument("--cuda-graph-bs-decode", "--cuda-graph-bs", dest="cuda_graph_bs_decode", type=_finite_int,
                   nargs="+", metavar="BS", help="explicit decode capture batch sizes")
    g.add_argument("--cuda-graph-config", type=_json_object, metavar="JSON",
                   help="sglang's per-phase JSON, e.g. '{\"decode\": {\"max_bs\": 64}}' (wins over the flags)")
    for name in ("--disable-cuda-graph", "--disable-decode-cuda-graph"):
        g.add_argument(name, action="store_true", default=None)
    g.add_argument("--disable-cuda-graph-padding", action="store_true", default=None,
                   help="capture every batch size up to the max")
    g.add_argument("--speculative-algorithm", metavar="NAME",
                   help="the server's algorithm, e.g. DSPARK, EAGLE, NGRAM (the speculative ladder needs one)")
    g.add_argument("--speculative-num-draft-tokens", type=_finite_int, metavar="N", help="tokens verified per request")
    g.add_argument("--speculative-num-steps", type=_finite_int, metavar="N",
                   help="EAGLE draft steps (with top-k 1, steps + 1 tokens are verified)")
    g.add_argument("--speculative-eagle-topk", type=_finite_int, metavar="K")
    g.add_argument("--max-running-requests", type=_finite_int, metavar="N",
                   help="request pool size (speculative default 48); cuts the ladder")
    g.add_argument("--tp-size", "--tp", "--tensor-parallel-size", dest="tp_size", type=_finite_int, metavar="N")
    g.add_argument("--dp-size", "--data-parallel-size", dest="dp_size", type=_finite_int, metavar="N")
    g.add_argument("--attn-dp-size", type=_finite_int, metavar="N", help="attention data-parallel size")
    g.add_argument("--enable-dp-attention", action="store_true", default=None,
                   help="with --dp-size N: the deprecated spelling of --attn-dp-size N")
    g.add_argument("--gpu-memory-mb", type=_finite_int, metavar="MIB",
                   help="device memory for sglang's default max batch on a box without the GPU "
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
