"""vLLM's command line: read the settings that shape CUDA-graph capture, skip the rest.

The capture flags are read as vLLM's ``FlexibleArgumentParser`` does (utils/argparse_utils.py:313-470): dashes
and underscores alike, ``--flag=value``, ``-O3``, the JSON of ``-cc`` / ``-sc`` and their dotted form
(``-cc.cudagraph_mode=FULL``). Every other flag is skipped with its value: vLLM itself refuses a line it does not
know.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from jitwarm.precompile.servers import command_line
from jitwarm.precompile.servers.command_line import ServerArgvError, converted, is_flag, json_object, values_after
from jitwarm.precompile.servers.vllm import LAUNCHERS, VERSION

# `python -m vllm.entrypoints.openai.api_server ...`; `vllm serve ...` (vllm/entrypoints/cli/serve.py).
_LAUNCHER = (("vllm.entrypoints.openai.api_server",), "vllm")
#: flag -> (setting, kind) for the flags that shape capture (engine/arg_utils.py:1824-1913 and the groups above).
FLAGS: dict[str, tuple[str, str]] = {
    "--max-num-seqs": ("max_num_seqs", "int"), "--max-num-batched-tokens": ("max_num_batched_tokens", "int"),
    "--max-model-len": ("max_model_len", "human_int"),
    "--cudagraph-capture-sizes": ("cudagraph_capture_sizes", "int_list"),
    "--max-cudagraph-capture-size": ("max_cudagraph_capture_size", "int"),
    "--optimization-level": ("optimization_level", "int"), "--performance-mode": ("performance_mode", "str"),
    "--enforce-eager": ("enforce_eager", "true"), "--no-enforce-eager": ("enforce_eager", "false"),
    "--enable-chunked-prefill": ("enable_chunked_prefill", "true"),
    "--no-enable-chunked-prefill": ("enable_chunked_prefill", "false"),
    "--spec-tokens": ("num_speculative_tokens", "int"), "--model": ("model_path", "str"),
    "--tensor-parallel-size": ("tensor_parallel_size", "int"), "-tp": ("tensor_parallel_size", "int"),
    "--compilation-config": ("compilation_config", "json"), "-cc": ("compilation_config", "json"),
    "--speculative-config": ("speculative_config", "json"), "-sc": ("speculative_config", "json"),
}
#: Flags whose graphs the rules do not mirror (LoRA adds a graph per adapter count; DBO microbatches them).
UNMIRRORED = {"--enable-lora": "LoRA graphs", "--enable-dbo": "dual-batch-overlap graphs",
              "--config": "a server config file (jitwarm does not read it; put the capture flags on the line)"}
#: Flags of vLLM's serve parser that take no value, so the word after them is not skipped as theirs.
NO_VALUE = frozenset({
    "--trust-remote-code", "--disable-log-stats", "--disable-log-requests", "--enable-log-requests",
    "--enable-prefix-caching", "--no-enable-prefix-caching", "--enable-auto-tool-choice", "--headless",
    "--disable-custom-all-reduce", "--enable-expert-parallel", "--async-scheduling", "--no-async-scheduling",
    "--disable-frontend-multiprocessing", "--enable-sleep-mode", "--disable-uvicorn-access-log",
    "--enable-prompt-tokens-details", "--enable-force-include-usage", "--enable-server-load-tracking",
    "--skip-tokenizer-init", "--enable-eplb", "--no-enable-eplb", "--disable-cascade-attn", "--allow-credentials",
    "--return-tokens-as-token-ids", "--enable-request-id-headers", "--enable-tokenizer-info-endpoint",
    "--disable-fastapi-docs", "--enable-log-outputs", "--disable-hybrid-kv-cache-manager",
})
#: Compilation-config keys read (config/compilation.py: cudagraph_mode :610, capture sizes, the max).
_COMPILATION_KEYS = ("cudagraph_mode", "cudagraph_capture_sizes", "max_cudagraph_capture_size")
_MODEL_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"
#: vLLM's first test of its CPU platform, lower-cased (platforms/__init__.py:176, envs.py:623).
TARGET_DEVICE_ENV = "VLLM_TARGET_DEVICE"


def is_server_command(argv: Sequence[str]) -> bool:
    """True when ``argv`` starts (after any ``NAME=value`` words) with a vLLM launcher."""
    return command_line.recognises(argv, *_LAUNCHER)


def parse_server_argv(argv: Sequence[str]) -> dict[str, Any]:
    """Return the capture settings of a vLLM command line (launcher optional) as raw inputs for :mod:`.rules`.

    The :data:`.rules.INPUT_KEYS` the line sets (a leading ``VLLM_USE_V2_MODEL_RUNNER=0`` the V1 runner, a leading
    ``VLLM_TARGET_DEVICE=cpu`` the CPU platform), ``model_path`` and ``tensor_parallel_size``.
    :class:`ServerArgvError` for a launcher that is not vLLM's, a capture flag without its value or with a bad one,
    a second positional argument, or a setting the rules do not mirror (LoRA, DBO, a ``--config`` file).
    """
    values: dict[str, Any] = {}
    env, args = command_line.split_env(argv)
    if _MODEL_RUNNER_ENV in env:
        values["model_runner"] = "v1" if env[_MODEL_RUNNER_ENV].strip().lower() in ("0", "false") else "v2"
    if env.get(TARGET_DEVICE_ENV, "").lower() == "cpu":  # any other value leaves vLLM to its next test
        values["platform"] = "cpu"
    stripped = command_line.strip_launcher(args, *_LAUNCHER)
    if stripped is None:
        raise ServerArgvError(f"not a vLLM server command line: {' '.join(args[:4])} ... (expected {LAUNCHERS})")
    args, serve = stripped
    i = 0
    while i < len(args):
        token = args[i]
        i += 1
        if not token.startswith("-") or token == "-":
            if serve and "model_path" not in values:
                values["model_path"] = token  # `vllm serve MODEL` (utils/argparse_utils.py:324-356)
                continue
            raise ServerArgvError(f"unexpected argument {token!r} in the vLLM command line")
        name, eq, inline = _normalised(token).partition("=")
        if name.startswith("-O") and name not in ("-O",) and not name.startswith("-O."):
            name, eq, inline = "--optimization-level", "=", (inline if eq else name[2:])  # -O3 / -O=3
        elif name == "-O":
            name = "--optimization-level"
        base, dot, path = name.partition(".")
        if base in UNMIRRORED:
            raise ServerArgvError(f"{base}: {UNMIRRORED[base]} are not mirrored by jitwarm's vLLM {VERSION} rules")
        if base not in FLAGS:
            if not eq and base not in NO_VALUE and not base.startswith("--no-") and i < len(args) \
                    and not is_flag(args[i]):
                i += 1  # its value
            continue
        dest, kind = FLAGS[base]
        if kind in ("true", "false"):
            values[dest] = kind == "true"
            continue
        if eq:
            given = [inline]
        else:
            given, i = values_after(args, i, many=kind == "int_list")
        if not given:
            raise ServerArgvError(f"argument {name}: expected {'at least ' if kind == 'int_list' else ''}one "
                                  "argument")
        if dot and kind == "json":  # -cc.cudagraph_mode=FULL: a nested key of the JSON flag
            _merge(values.setdefault(dest, {}), path.split("."), given[-1])
            continue
        value = converted(name, human_int if kind == "human_int" else kind, given)
        values[dest] = {**(values.get(dest) or {}), **value} if kind == "json" else value  # over dotted keys
    return _to_inputs(values)


def _normalised(token: str) -> str:
    """Dashes for underscores in a long flag's name, up to its first ``.`` (utils/argparse_utils.py:378-394)."""
    if not token.startswith("--"):
        return token
    name, eq, value = token.partition("=")
    head, dot, tail = name[2:].partition(".")
    return f"--{head.replace('_', '-')}{dot}{tail}{eq}{value}"


def human_int(text: str) -> int:
    """``--max-model-len`` as vLLM reads it: ``32768``, ``32k`` (x1000), ``32K`` (x1024); not -1 (the model's)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT]?)", text.strip())
    if not match:
        raise ValueError("expected a token count such as 32768, 32k or 32K")
    number, suffix = match.groups()
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
             "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[suffix]
    if "." in number and suffix.isupper():
        raise ValueError("a binary suffix (K, M, G, T) takes a whole number")
    return int(float(number) * scale) if "." in number else int(number) * scale


def _merge(target: dict[str, Any], keys: list[str], raw: str) -> None:
    """``-cc.a.b=value``: set ``target[a][b]``, the value read as JSON where it parses (else the string)."""
    try:
        value: Any = json_object(f'{{"v": {raw}}}')["v"]
    except ValueError:
        value = raw
    for key in keys[:-1]:
        target = target.setdefault(key, {})
    target[keys[-1]] = value


def _to_inputs(values: dict[str, Any]) -> dict[str, Any]:
    """Map the parsed flags to rule inputs: the JSON configs' capture keys, the speculative token count."""
    out = {k: v for k, v in values.items() if k not in ("compilation_config", "speculative_config")}
    compilation = values.get("compilation_config") or {}
    for key in _COMPILATION_KEYS:
        if key in compilation and key in out:  # engine/arg_utils.py:2834-2849
            raise ServerArgvError(f"{key} and compilation_config.{key} are mutually exclusive (vLLM refuses both)")
        if key in compilation:
            out[key] = compilation[key]
    if isinstance(out.get("cudagraph_capture_sizes"), list):
        sizes = out["cudagraph_capture_sizes"]
        if not all(isinstance(s, int) and not isinstance(s, bool) for s in sizes):
            raise ServerArgvError("cudagraph_capture_sizes must be a list of integers")
    if "mode" in compilation and compilation["mode"] in (0, "NONE", "none") and "cudagraph_mode" not in out:
        out["optimization_level"] = 0  # no compilation: nothing to capture piecewise
    speculative = values.get("speculative_config") or {}
    if "num_speculative_tokens_per_batch_size" in speculative:
        raise ServerArgvError("--speculative-config num_speculative_tokens_per_batch_size: dynamic speculative "
                              f"decoding is not mirrored by jitwarm's vLLM {VERSION} rules")
    if "num_speculative_tokens" in speculative:
        if "num_speculative_tokens" in out:  # engine/arg_utils.py:2108-2119
            raise ServerArgvError("--spec-tokens and --speculative-config['num_speculative_tokens'] are mutually "
                                  "exclusive (vLLM refuses both)")
        out["num_speculative_tokens"] = speculative["num_speculative_tokens"]
    if str(speculative.get("method", "")).lower() in ("suffix", "custom_class") and "model_runner" not in out:
        out["model_runner"] = "v1"  # the V2 runner does not support them (config/vllm.py:3066-3068)
    spec = out.get("num_speculative_tokens")
    if spec is not None and (type(spec) is not int or spec < 0):
        raise ServerArgvError(f"num_speculative_tokens must be a count, got {spec!r}")
    return out
