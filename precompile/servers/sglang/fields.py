"""What ServingConfig's capture fields mean to sglang: its flags onto them, their defaults, checks, the ladder's inputs.

The room's rules, native functions, flag table and plugin speak sglang's own names (``ServerArgs`` fields);
:data:`SGLANG_NAMES` translates, here only.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from jitwarm.precompile.servers import json_object, refusals
from jitwarm.precompile.servers.sglang import rules
from jitwarm.precompile.servers.sglang.argv import parse_server_argv

#: Largest batch size a --cuda-graph-config may name (as the --cuda-graph-* flags).
MAX_BATCH_SIZE = 4096
#: ServingConfig field -> the sglang ServerArgs field (and ``--flag``) that sets it: the server's capture settings.
SGLANG_NAMES = {
    "graph_max_bs": "cuda_graph_max_bs_decode", "graph_bs": "cuda_graph_bs_decode", "graph_config": "cuda_graph_config",
    "no_graphs": "disable_cuda_graph", "no_decode_graphs": "disable_decode_cuda_graph",
    "no_graph_padding": "disable_cuda_graph_padding", "draft_algorithm": "speculative_algorithm",
    "draft_tokens": "speculative_num_draft_tokens", "draft_steps": "speculative_num_steps",
    "draft_topk": "speculative_eagle_topk", "max_requests": "max_running_requests", "tp": "tp_size", "dp": "dp_size",
    "attn_dp": "attn_dp_size", "dp_attention": "enable_dp_attention", "model_path": "model_path"}
_FIELD_OF = {sglang: name for name, sglang in SGLANG_NAMES.items()}
#: The flag an sglang user types for each field (messages name it).
FIELD_FLAGS = {name: "--" + sglang.replace("_", "-") for name, sglang in SGLANG_NAMES.items()}
#: Fields the rules read under jitwarm's own name: what sglang takes from the device and the environment.
_OWN_INPUTS = ("gpu_memory_mb", "ragged_verify_mode")


def parse_argv(argv: Sequence[str]) -> dict[str, Any]:
    """The ServingConfig fields an sglang command line sets (:func:`.argv.parse_server_argv`, translated)."""
    return {_FIELD_OF.get(key, key): value for key, value in parse_server_argv(argv).items()}


def defaults(config: Any) -> dict[str, Any]:
    """The verify mode sglang reads from ``SGLANG_RAGGED_VERIFY_MODE`` when none is given (else ``static``)."""
    if config.ragged_verify_mode is not None:
        return {}
    env = os.environ.get(rules.VERIFY_MODE_ENV)
    return {"ragged_verify_mode": env if env is not None else "static", "mode_from_env": env is not None}


def check(config: Any, *, resolve: bool) -> list[str]:
    """Problems sglang would find in ``config``: its --cuda-graph-config, its verify mode, what its rules refuse."""
    problems = [] if config.graph_config is None else _graph_config_problems(config.graph_config)
    mode = config.ragged_verify_mode
    # sglang reads the variable only where an algorithm could use it (ragged_verify.py:19-27).
    if isinstance(mode, str) and mode not in rules.VERIFY_MODES and not (
            config.mode_from_env and config.draft_algorithm is None):
        source = f" (from {rules.VERIFY_MODE_ENV})" if config.mode_from_env else ""
        problems.append(f"unknown ragged verify mode {mode!r}{source}; choose from {', '.join(rules.VERIFY_MODES)}")
    if resolve and not problems and isinstance(mode, str):
        problems += refusals(rules.builtin, ladder_inputs(config), rules.reads_memory)
    return problems


def ladder_inputs(config: Any) -> dict[str, Any]:
    """The raw settings :func:`.rules.resolve` takes (the KV capacity unknown: a plan assumes it cuts nothing)."""
    inputs = {SGLANG_NAMES[name]: getattr(config, name) for name in SGLANG_NAMES if name != "model_path"}
    inputs.update({name: getattr(config, name) for name in _OWN_INPUTS})
    options = json.loads(config.server_options) if config.server_options else {}
    inputs.update({k: v for k, v in options.items() if k in rules.OPTION_KEYS} if isinstance(options, dict) else {})
    inputs.update(kv_capacity=None, cuda_graph_bs_decode=list(config.graph_bs or ()) or None,
                  cuda_graph_config=json.loads(config.graph_config) if config.graph_config else None)
    if inputs["ragged_verify_mode"] not in rules.VERIFY_MODES:
        inputs["ragged_verify_mode"] = "static"  # an env value sglang ignores (check() let it pass)
    return inputs


def _graph_config_problems(value: Any) -> list[str]:
    """Problems of a --cuda-graph-config value (a JSON object, or its text)."""
    if isinstance(value, str):
        try:
            value = json_object(value)
        except ValueError as exc:
            return [f"--cuda-graph-config is not a JSON object: {str(exc).splitlines()[0]}"]
    if not isinstance(value, Mapping):
        return [f"--cuda-graph-config must be a JSON object, got {type(value).__name__}"]
    decode = value.get("decode", {})
    if not isinstance(decode, Mapping):
        return ["--cuda-graph-config: decode must be an object"]
    problems = []
    if "max_bs" in decode and not _is_batch(decode["max_bs"]):
        problems.append(f"--cuda-graph-config decode.max_bs must be a batch size up to {MAX_BATCH_SIZE}")
    bs = decode.get("bs", [1])
    if not isinstance(bs, list) or not bs or len(bs) > MAX_BATCH_SIZE or not all(map(_is_batch, bs)):
        problems.append(f"--cuda-graph-config decode.bs must be a list of batch sizes up to {MAX_BATCH_SIZE}")
    return problems


def _is_batch(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_BATCH_SIZE
