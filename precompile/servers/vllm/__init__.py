"""The vLLM room: everything jitwarm knows about the vLLM server, for the release :data:`VERSION`.

Its modules: :mod:`.argv` (the server's command line: ``vllm serve MODEL ...``), :mod:`.fields` (what
ServingConfig's fields and ``server_options`` mean to vLLM), :mod:`.rules` (the capture sizes, modes and graphs,
mirrored in plain Python), :mod:`.native` (the same by the installed vLLM's own functions, for a release the
rules do not mirror), :mod:`.model` (which of jitwarm's kernel families the served model runs), :mod:`.plugin`
(the ``vllm.general_plugins`` entry point) and :mod:`.seals` (nothing of vLLM's own to seal yet). This package is
the room's adapter (:class:`jitwarm.precompile.servers.ServerAdapter`); it imports a module on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

#: The vLLM release this room mirrors: its flags, its resolution rules, the line numbers cited here.
#: Defined before anything else: the room's modules import it from here.
VERSION = "0.33.0"
NAME = "vllm"
LAUNCHERS = "`vllm serve MODEL ...` or `python -m vllm.entrypoints.openai.api_server ...`"
PLUGIN = "jitwarm.precompile.servers.vllm.plugin:register"
LADDER_SOURCES = ("auto", "builtin", "vllm")
#: The room's own settings (``server_options`` keys) that no ServingConfig field holds -> how they are given.
OPTIONS: dict[str, str] = {
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "cudagraph_capture_sizes": "--cudagraph-capture-sizes",
    "max_cudagraph_capture_size": "--max-cudagraph-capture-size",
    "cudagraph_mode": "-cc.cudagraph_mode",
    "optimization_level": "-O",
    "enforce_eager": "--enforce-eager",
    "num_speculative_tokens": "--speculative-config num_speculative_tokens",
    "performance_mode": "--performance-mode",
    "max_model_len": "--max-model-len",
    "enable_chunked_prefill": "--enable-chunked-prefill",
    "model_runner": "VLLM_USE_V2_MODEL_RUNNER",
    "attention_cudagraph_support": "server_options.attention_cudagraph_support",
    "device_capability": "server_options.device_capability",
}

# The adapter's functions, by the module that defines each.
_FUNCTIONS = {"recognises": "argv", "parse_argv": "fields", "defaults": "fields", "check": "fields",
              "ladder_inputs": "fields", "needs_memory": "fields", "resolve_ladder": "native",
              "model_families": "model", "seal": "seals"}


def __getattr__(name: str) -> Any:
    if name in _FUNCTIONS:
        module = importlib.import_module(f"{__name__}.{_FUNCTIONS[name]}")
        return getattr(module, "is_server_command" if name == "recognises" else name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
