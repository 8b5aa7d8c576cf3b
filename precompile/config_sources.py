"""Where a ServingConfig's values come from: jitwarm's own flags, a TOML file and the server's command line.

The flags carry sglang's names and a TOML file the same keys; the server's command line (after ``--``) is read
by the room that recognises its launcher. :func:`from_namespace` merges them: file, server's line, flags.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

from jitwarm.cache.errors import UsageError
from jitwarm.cache.files import read_file_stat
from jitwarm.kernels import BUILDABLE, DTYPES
from jitwarm.precompile import servers
from jitwarm.precompile.config import ConfigError, ServingConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

#: Largest TOML config file read (a real one is a few hundred bytes; /dev/zero is not one).
MAX_CONFIG_BYTES = 1 << 20

# Older jitwarm names that stay as documented aliases of sglang's, and sglang's own aliases.
ALIASES = {"cuda_graph_max_bs": "cuda_graph_max_bs_decode", "cuda_graph_bs": "cuda_graph_bs_decode", "tp": "tp_size",
           "tensor_parallel_size": "tp_size", "data_parallel_size": "dp_size",
           "attention_data_parallel_size": "attn_dp_size", "backend": "backends", "target": "targets"}


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


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Return the ServingConfig fields a TOML file sets; ConfigError for an unreadable file or an unknown key.

    The keys are the top level's, or the ``[jitwarm]`` table's when there is one.
    """
    try:
        # Follow a link the operator gave (a ConfigMap is one); then no blocking (a FIFO planted where the file
        # should be), a regular file of bounded size (/dev/zero is not a config).
        raw, _ = read_file_stat(os.path.realpath(path), MAX_CONFIG_BYTES)
    except OSError as exc:
        raise ConfigError([f"cannot read --config {path}: {exc.strerror or exc}"]) from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise ConfigError([f"--config {path} is not valid TOML: {str(exc).splitlines()[0]}"]) from None
    table = data.get("jitwarm", data)
    if not isinstance(table, dict):
        raise ConfigError([f"--config {path}: [jitwarm] must be a table, got {type(table).__name__}"])
    return fields_of(table, source=str(path))


def fields_of(data: Mapping[str, Any], source: str) -> dict[str, Any]:
    """Map config keys (dashes or underscores, aliases) to field names; unknown keys are an error."""
    known = {f.name for f in fields(ServingConfig)} - {"mode_from_env"}
    values, unknown = {}, []
    for raw_key, value in data.items():
        key = str(raw_key).replace("-", "_")
        key = ALIASES.get(key, key)
        if key not in known:
            unknown.append(raw_key)
            continue
        if key in ("backends", "targets") and isinstance(value, str):
            value = [value]
        values[key] = tuple(value) if isinstance(value, list) else value
    if unknown:
        raise ConfigError([f"{source}: unknown key {k!r}" for k in unknown])
    return values


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
    """A path flag's value; an empty one is refused, and one no filesystem takes.

    ``--cache-dir "$DIR"`` with ``DIR`` unset would be no flag; a path too long failed later as a write error,
    exit 1 (issue #31, N10).
    """
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path (an unset shell variable?)")
    if len(text.encode()) > MAX_PATH or any(len(part.encode()) > MAX_NAME for part in text.split("/")):
        raise argparse.ArgumentTypeError(f"a path longer than a filesystem takes ({len(text)} characters: "
                                         f"{text[:40]}...)")
    return text


def add_serving_flags(parser: argparse.ArgumentParser) -> None:
    """Add the serving, model and build-target flags to ``parser`` (all default to None: unset)."""
    version = f"{servers.DEFAULT} {servers.adapter(servers.DEFAULT).VERSION}"
    g = parser.add_argument_group(f"serving ({version}'s flag names; or the server's command line after --)")
    g.add_argument("--config", type=path_flag, metavar="FILE.toml",
                   help="read these settings from a TOML file first")
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
    g.add_argument("--speculative-num-draft-tokens", type=_finite_int, metavar="N",
                   help="tokens verified per request")
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


#: The fields jitwarm's own flags set (every one but the model path, the room and its options).
_FLAG_FIELDS = tuple(f.name for f in fields(ServingConfig)
                     if f.name not in ("model_path", "server", "server_options", "mode_from_env"))


def serving_flags_given(ns: argparse.Namespace, server_argv: Sequence[str] | None = None) -> bool:
    """Whether anything describes a server: its command line, a config file, or a flag beyond --target/--backend."""
    return server_argv is not None or bool(getattr(ns, "config", None)) or any(
        getattr(ns, name, None) is not None for name in _FLAG_FIELDS if name not in ("targets", "backends"))


def from_namespace(ns: argparse.Namespace, server_argv: Sequence[str] | None = None) -> ServingConfig:
    """Build a config from parsed flags: the TOML file (if any), then the server's command line, then flags."""
    values: dict[str, Any] = {}
    if getattr(ns, "config", None):
        values.update(read_config_file(ns.config))
    if server_argv is not None:
        try:
            room = servers.adapter_for(server_argv)
            values.update(_fields(room.parse_argv(server_argv)), server=room.NAME)
        except UsageError as exc:
            raise ConfigError([str(exc)]) from None
    values.update(_fields({name: getattr(ns, name, None) for name in _FLAG_FIELDS}))
    return ServingConfig(**values)


def _fields(values: Mapping[str, Any]) -> dict[str, Any]:
    """The values that are set (not None), lists as tuples."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in values.items() if v is not None}

