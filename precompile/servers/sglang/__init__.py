"""The sglang room, for the release :data:`VERSION`: its adapter (:class:`~jitwarm.precompile.servers.ServerAdapter`).

:mod:`.loader` taps sglang's JIT loader once (recorded, counted for the ledger, sealed in capture).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

from jitwarm.precompile.servers import lazy_functions, model

#: The sglang release this room mirrors: its flag table, its resolution rules, the line numbers cited here.
#: Defined before anything else: the room's modules import it from here.
VERSION = "0.5.23"
NAME = "sglang"
LAUNCHERS = "`python -m sglang.launch_server ...` or `sglang serve ...`"
PLUGIN = "jitwarm.precompile.servers.sglang.plugin:register"
#: The entry-point group sglang loads plugins from (setup.py reads it).
PLUGIN_GROUP = "sglang.srt.plugins"
#: The variable naming the plugins sglang loads (all when unset: docs/sglang.md), the port it listens on without
#: ``--port`` (``srt/server_args.py``: 30000) and its readiness endpoint.
PLUGINS_ENV, DEFAULT_PORT, HEALTH = "SGLANG_PLUGINS", 30000, "/health"
LADDER_SOURCES = ("auto", "builtin", "sglang")
#: What :func:`seal` seals (the plugin's line names it): sglang's own JIT loader.
SEALED = "sglang load_jit"
#: The module whose ``TAP`` and ``recording(add)`` record sglang's ``load_jit`` calls (the recorder subscribes).
TAP = "jitwarm.precompile.servers.sglang.loader"
#: Nothing set for capture: Inductor's precompiled header is captured and restored beside sglang's root
#: (``capture_node.store_beside``); the stop ledger is written by the plugin at exit, as capture reads it.
CAPTURE_ENV: dict[str, str] = {}
ANSWERS_STOP_REQUEST = False
#: The room's own settings (``server_options`` keys) that no ServingConfig field holds -> how they are given: the
#: CPU graph runner's (rules.OPTION_KEYS).
OPTIONS: dict[str, str] = {"device": "--device after --", "enable_torch_compile": "--enable-torch-compile after --",
                           "torch_compile_max_bs": "--torch-compile-max-bs after --"}
#: sglang's model classes that run jitwarm's families: the DSV4 target (srt/models/deepseek_v4.py:4633), its
#: MTP draft (deepseek_v4_nextn.py:243) and its DSpark draft (deepseek_v4_dspark.py:685).
DSV4_ARCHITECTURES = frozenset({"DeepseekV4ForCausalLM", "DeepseekV4ForCausalLMNextN", "DeepseekV4ForCausalLMDSpark"})

model_families = functools.partial(model.model_families, dsv4=DSV4_ARCHITECTURES)
__getattr__ = lazy_functions(__name__, {
    "recognises": "argv", "parse_argv": "fields", "FIELD_FLAGS": "fields", "defaults": "fields", "check": "fields",
    "ladder_inputs": "fields", "needs_memory": "rules:depends_on_memory", "resolve_ladder": "native",
    "seal": "loader", "cache_dirs": "caches", "CACHE_VARIABLES": "caches", "unloadable": "caches"})


def start_warnings(environ: Mapping[str, str]) -> list[str]:
    """Why a start of this server in ``environ`` could not be restored to compile nothing: none known."""
    return []
