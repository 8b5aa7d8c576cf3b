"""What ServingConfig's fields mean to vLLM: the command line into fields, their checks, the ladder's inputs.

``max_requests`` is ``--max-num-seqs``, ``tp`` ``--tensor-parallel-size``; every other vLLM setting is a
``server_options`` key (:data:`.OPTIONS`), among them stand-ins for what vLLM reads from the device and the model:
``device_capability`` (90 Hopper, 100 data-center Blackwell; else from a single ``--target sm_XY``) and
``attention_cudagraph_support`` (``AttentionCGSupport``, default ``ALWAYS``).
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from jitwarm.precompile.servers import differs_by_memory, json_object, refusals
from jitwarm.precompile.servers.vllm import rules
from jitwarm.precompile.servers.vllm.argv import parse_server_argv

#: ServingConfig fields no vLLM setting means: set, they are a problem, not silently dropped. (vLLM's capture sizes
#: and speculative tokens count tokens, not requests or verified tokens: ``server_options``, not graph_* or draft_*.)
NOT_VLLM = ("graph_max_bs", "graph_bs", "graph_config", "no_graphs", "no_decode_graphs", "no_graph_padding",
            "draft_algorithm", "draft_tokens", "draft_steps", "draft_topk", "ragged_verify_mode")
#: The flag a vLLM user types for each field (messages name it); :func:`parse_argv` maps each onto its field.
FIELD_FLAGS = {"max_requests": "--max-num-seqs", "tp": "--tensor-parallel-size", "model_path": "--model"}
_FIELD_OF = {"max_num_seqs": "max_requests", "tensor_parallel_size": "tp", "model_path": "model_path"}
_SM = re.compile(r"sm_(\d+)(\d)[af]?")
#: Device memory samples (MiB) per capability, to tell whether the graphs depend on the memory.
_MEMORY_SAMPLES = (40 * 1024, 80 * 1024, 141 * 1024, 180 * 1024)


def parse_argv(argv: Sequence[str]) -> dict[str, Any]:
    """The ServingConfig fields a vLLM command line sets; its other capture settings as ``server_options``."""
    values = parse_server_argv(argv)
    out: dict[str, Any] = {_FIELD_OF[k]: values.pop(k) for k in list(values) if k in _FIELD_OF}
    if values:
        out["server_options"] = values
    return out


def defaults(config: Any) -> dict[str, Any]:
    """``server_options.platform`` ``cpu`` when vLLM would run on its CPU platform and nothing says which it is.

    What says it: ``server_options.platform``, then jitwarm's ``--target`` as given (``cpu`` alone: the CPU
    platform), else vLLM's own inference (:func:`on_cpu_platform`). Inside a vLLM process nothing is inferred.
    """
    options = config.server_options
    try:
        options = json_object(options) if isinstance(options, str) else options or {}
    except ValueError:
        return {}  # the config reports it
    if not isinstance(options, Mapping) or "platform" in options or "vllm" in sys.modules:
        return {}
    targets = config.targets  # None unless given: the config defaults it after this
    if isinstance(targets, (list, tuple)) and targets:
        cpu = all(t == "cpu" for t in targets)
    else:
        cpu = on_cpu_platform()
    return {"server_options": {**options, "platform": "cpu"}} if cpu else {}


def on_cpu_platform() -> bool:
    """Whether vLLM infers its CPU platform here (:func:`.caches.cpu_platform`, which vLLM's own follows)."""
    from jitwarm.precompile.servers.vllm.caches import cpu_platform

    return cpu_platform()


def check(config: Any, *, resolve: bool) -> list[str]:
    """Problems vLLM would find in ``config``: a setting it has not (:data:`NOT_VLLM`), what its rules refuse."""
    problems = [f"{config.flag_of(name)} is not a vLLM setting; a vLLM server line does not take it"
                for name in NOT_VLLM if getattr(config, name, None) not in (None, False)]
    if resolve and not problems:  # the config has checked server_options' keys against OPTIONS
        problems += refusals(rules.resolve, ladder_inputs(config), rules.reads_device)
    return problems


def ladder_inputs(config: Any) -> dict[str, Any]:
    """The raw settings :func:`.rules.resolve` takes: the options, the fields, the capability from the target."""
    options = json.loads(config.server_options) if config.server_options else {}
    if not isinstance(options, dict):  # the config reports a server_options that is not an object
        options = {}
    inputs = {**rules.INPUT_KEYS, **{k: v for k, v in options.items() if k in rules.INPUT_KEYS},
              "max_num_seqs": config.max_requests, "gpu_memory_mb": config.gpu_memory_mb}
    if inputs["device_capability"] is None:
        inputs["device_capability"] = target_capability(config.targets or ())
    return inputs


def target_capability(targets: Sequence[str]) -> int | None:
    """The compute capability a single CUDA build target names (``sm_90a`` -> 90, ``sm_100`` -> 100), else None."""
    found = {int(m.group(1) + m.group(2)) for t in targets if (m := _SM.fullmatch(str(t)))}
    return found.pop() if len(found) == 1 else None


def needs_memory(inputs: Mapping[str, Any]) -> bool:
    """True when the graphs differ between device-memory sizes on the inputs' device (a Hopper when unknown)."""
    on_device = {**inputs, "device_capability": inputs.get("device_capability") or 90}
    return rules.reads_device(inputs) and differs_by_memory(
        rules.resolve, on_device, _MEMORY_SAMPLES, lambda r: tuple((s["mode"], s["num_tokens"]) for s in r["shapes"]))
