"""What ServingConfig's capture fields mean to sglang: their defaults, their checks, and the ladder's inputs."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from jitwarm.precompile.servers import json_object, refusals
from jitwarm.precompile.servers.sglang import rules

#: Largest batch size a --cuda-graph-config may name (as the --cuda-graph-* flags).
MAX_BATCH_SIZE = 4096
#: The ServingConfig fields that are sglang ServerArgs fields of the same name (the server's capture settings).
SERVER_ARGS_FIELDS = frozenset(rules.INPUT_KEYS) - set(rules.NOT_FIELDS) | {"model_path"}


def defaults(config: Any) -> dict[str, Any]:
    """The verify mode sglang reads from ``SGLANG_RAGGED_VERIFY_MODE`` when none is given (else ``static``)."""
    if config.ragged_verify_mode is not None:
        return {}
    env = os.environ.get(rules.VERIFY_MODE_ENV)
    return {"ragged_verify_mode": env if env is not None else "static", "mode_from_env": env is not None}


def check(config: Any, *, resolve: bool) -> list[str]:
    """Problems sglang would find in ``config``: its --cuda-graph-config, its verify mode, what its rules refuse."""
    problems = [] if config.cuda_graph_config is None else _graph_config_problems(config.cuda_graph_config)
    mode = config.ragged_verify_mode
    # sglang reads the variable only where an algorithm could use it (ragged_verify.py:19-27).
    if isinstance(mode, str) and mode not in rules.VERIFY_MODES and not (
            config.mode_from_env and config.speculative_algorithm is None):
        source = f" (from {rules.VERIFY_MODE_ENV})" if config.mode_from_env else ""
        problems.append(f"unknown ragged verify mode {mode!r}{source}; choose from {', '.join(rules.VERIFY_MODES)}")
    if resolve and not problems and isinstance(mode, str):
        problems += refusals(rules.builtin, ladder_inputs(config), rules.reads_memory)
    return problems


def ladder_inputs(config: Any) -> dict[str, Any]:
    """The raw settings :func:`.rules.resolve` takes (the KV capacity unknown: a plan assumes it cuts nothing)."""
    inputs = {name: getattr(config, name) for name in rules.INPUT_KEYS
              if name != "kv_capacity" and name not in rules.OPTION_KEYS}
    options = json.loads(config.server_options) if config.server_options else {}
    inputs.update({k: v for k, v in options.items() if k in rules.OPTION_KEYS} if isinstance(options, dict) else {})
    inputs.update(kv_capacity=None, cuda_graph_bs_decode=list(config.cuda_graph_bs_decode or ()) or None,
                  cuda_graph_config=json.loads(config.cuda_graph_config) if config.cuda_graph_config else None)
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
