"""vLLM's CUDA graphs by the installed vLLM's own functions: a plan source and the rules' oracle.

The device is a stand-in ``Platform``; each graph's dummy batch comes from the rules' helper (the oracle checks
keys, modes and order). Outside a server it runs in a child process (:meth:`.OwnFunctions.main`).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Mapping
from types import SimpleNamespace
from typing import Any

from jitwarm.precompile.servers import ResolutionError
from jitwarm.precompile.servers.own_functions import OwnFunctions, checked_inputs
from jitwarm.precompile.servers.vllm import rules
from jitwarm.precompile.servers.vllm.rules import INPUT_KEYS

#: A model length that never binds (the rules' assumption when ``max_model_len`` is unknown).
_LONG_MODEL_LEN = 1 << 30


def resolve_ladder(inputs: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The graphs vLLM captures for ``inputs``, from ``source`` (:meth:`.OwnFunctions.resolve_from`).

    The CPU platform's are the rules' answer (none) from any source: the functions below stand in a CUDA device.
    """
    if inputs.get("platform") == "cpu":
        return rules.resolve(inputs)
    return OWN.resolve_from(inputs, source, defaults=INPUT_KEYS, builtin=lambda: rules.resolve(inputs))


def resolve(inputs: Mapping[str, Any]) -> dict[str, Any]:
    """Return what :func:`.rules.resolve` returns for every key of :data:`INPUT_KEYS`, by the installed vLLM.

    ValueError for malformed inputs, or settings vLLM itself rejects (its own exception's message and type).
    """
    cfg = checked_inputs(inputs, INPUT_KEYS)
    if cfg["cudagraph_mode"] is not None:
        cfg["cudagraph_mode"] = str(cfg["cudagraph_mode"]).upper()
    try:
        with _device(cfg["gpu_memory_mb"], cfg["device_capability"]):
            return _resolve(cfg)
    except (ValueError, AssertionError, TypeError, KeyError) as exc:
        raise ValueError(f"vLLM rejects these settings ({type(exc).__name__}): {exc}") from exc


@contextlib.contextmanager
def _device(memory_mb: int | None, capability: int | None) -> Iterator[None]:
    """VLLM's ``current_platform`` replaced by one reporting this device (its memory, capability and name).

    Capability 8.0 is named an A100 (engine/arg_utils.py:2985-2988); unknown memory makes the query raise (:2964).
    """
    import vllm.platforms as platforms
    from vllm.engine import arg_utils
    from vllm.platforms.interface import DeviceCapability, UnspecifiedPlatform

    class StandInDevice(UnspecifiedPlatform):
        device_name = device_type = "cuda"  # DeviceConfig's default reads the type (config/device.py:55)

        @classmethod
        def get_device_capability(cls, device_id: int = 0) -> DeviceCapability | None:
            return None if capability is None else DeviceCapability(capability // 10, capability % 10)

        @classmethod
        def get_device_total_memory(cls, device_id: int = 0) -> int:
            if memory_mb is None:
                raise RuntimeError("no device")
            return memory_mb << 20

        @classmethod
        def get_device_name(cls, device_id: int = 0) -> str:
            return "NVIDIA A100-SXM4-80GB" if capability == 80 else "NVIDIA stand-in"

    saved = (platforms._current_platform, getattr(arg_utils, "current_platform", None))
    platforms._current_platform = arg_utils.current_platform = StandInDevice()
    try:
        yield
    finally:
        platforms._current_platform, arg_utils.current_platform = saved


def _resolve(cfg: dict[str, Any]) -> dict[str, Any]:
    """The resolution itself, inside the stand-in device."""
    from vllm.config.compilation import CompilationConfig, CompilationMode, CUDAGraphMode
    from vllm.config.vllm import OPTIMIZATION_LEVEL_TO_CONFIG, VllmConfig
    from vllm.v1.attention.backend import AttentionCGSupport

    seqs, tokens = _scheduler_limits(cfg)
    spec = cfg["num_speculative_tokens"]
    q = 1 + spec  # VllmConfig.uniform_decode_query_len (config/vllm.py:695-713)
    level = cfg["optimization_level"]
    mode = cfg["cudagraph_mode"] or OPTIMIZATION_LEVEL_TO_CONFIG[level]["compilation_config"]["cudagraph_mode"].name
    if cfg["enforce_eager"]:
        mode = "NONE"  # config/vllm.py:1766-1768
    given = {k: cfg[k] for k in ("cudagraph_capture_sizes", "max_cudagraph_capture_size") if cfg[k] is not None}
    compilation = CompilationConfig(mode=CompilationMode.VLLM_COMPILE if level >= 1 else CompilationMode.NONE,
                                    cudagraph_mode=CUDAGraphMode[mode], **given)
    compilation.set_splitting_ops_for_v1(all2all_backend="allgather_reducescatter", data_parallel_size=1)
    speculative = SimpleNamespace(num_speculative_tokens=spec, uses_dynamic_speculative_decoding=lambda: False)
    config = SimpleNamespace(
        model_config=SimpleNamespace(enforce_eager=cfg["enforce_eager"]), compilation_config=compilation,
        scheduler_config=SimpleNamespace(max_num_seqs=seqs, max_num_batched_tokens=tokens),
        speculative_config=speculative if spec else None, uniform_decode_query_len=q, num_speculative_tokens=spec,
        performance_mode=cfg["performance_mode"], lora_config=None,
        cache_config=SimpleNamespace(use_kda_recoverssm=False))
    base = rules.answer(OWN.source(), seqs, tokens, q)
    VllmConfig._set_cudagraph_sizes(config)
    if compilation.cudagraph_mode == CUDAGraphMode.NONE:
        return {**base, "disabled": "--enforce-eager" if cfg["enforce_eager"] else "cudagraph_mode NONE"}
    v2 = cfg["model_runner"] == "v2"
    resolved = compilation.resolve_cudagraph_mode_and_sizes(
        AttentionCGSupport[cfg["attention_cudagraph_support"]], "jitwarm stand-in", q, use_v2_model_runner=v2,
        max_num_reqs=seqs, piecewise_capture_available=level >= 1)
    sizes, top = list(compilation.cudagraph_capture_sizes), compilation.max_cudagraph_capture_size
    if resolved == CUDAGraphMode.NONE:
        return {**base, "capture_sizes": sizes, "max_capture_size": top, "disabled": "cudagraph_mode NONE"}
    graphs = _v2_graphs(config, resolved, q) if v2 else _v1_graphs(config, resolved, q)
    shapes = [rules._graph(mode_name, n, reqs, q, uniform=uniform, runner=cfg["model_runner"], max_num_seqs=seqs)
              for mode_name, n, reqs, uniform in graphs]
    return {**base, "cudagraph_mode": resolved.name, "capture_sizes": sizes, "max_capture_size": top,
            "shapes": shapes, "capture_bs": sorted({s["bs"] for s in shapes})}


def _scheduler_limits(cfg: Mapping[str, Any]) -> tuple[int, int]:
    """``EngineArgs._set_default_max_num_seqs_and_batched_tokens_args``, then SchedulerConfig's check by hand."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    model_len = cfg["max_model_len"]
    args = SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=1, performance_mode=cfg["performance_mode"],
                           max_num_batched_tokens=cfg["max_num_batched_tokens"], max_num_seqs=cfg["max_num_seqs"],
                           enable_chunked_prefill=True if model_len is None else cfg["enable_chunked_prefill"] is not
                           False, get_batch_defaults=EngineArgs.get_batch_defaults)
    model = SimpleNamespace(max_model_len=model_len or _LONG_MODEL_LEN, is_multimodal_model=False,
                            is_mm_prefix_lm=False, model="jitwarm-stand-in")
    EngineArgs._set_default_max_num_seqs_and_batched_tokens_args(args, UsageContext.OPENAI_API_SERVER, model,
                                                                  SimpleNamespace(use_batched_dp_moe=False))
    if args.max_num_batched_tokens < args.max_num_seqs:
        raise ValueError(f"max_num_batched_tokens ({args.max_num_batched_tokens}) must be greater than or equal "
                         f"to max_num_seqs ({args.max_num_seqs}).")
    return args.max_num_seqs, args.max_num_batched_tokens


def _v2_graphs(config: Any, mode: Any, q: int) -> list[tuple[str, int, int | None, bool]]:
    """``CudaGraphManager._init_candidates`` on a manager holding what it reads (its __init__ needs the PP group)."""
    from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager

    manager = object.__new__(CudaGraphManager)
    manager.__dict__.update(vllm_config=config, compilation_config=config.compilation_config, cudagraph_mode=mode,
                            max_num_reqs=config.scheduler_config.max_num_seqs, decode_query_len=q,
                            varlen_decode=False, lora_capture_cases=[0], ubatch_runner=None, _candidates={},
                            _capture_descs={})
    manager._init_candidates()
    descs = {mode.name: found for mode, found in manager._capture_descs.items()}
    return [(name, d.num_tokens, d.num_reqs, d.uniform_token_count is not None)
            for name in ("PIECEWISE", "FULL") for d in descs.get(name, ())]


def _v1_graphs(config: Any, mode: Any, q: int) -> list[tuple[str, int, int | None, bool]]:
    """``CudagraphDispatcher.initialize_cudagraph_keys`` then ``get_capture_descs`` (v1/cudagraph_dispatcher.py)."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher

    dispatcher = object.__new__(CudagraphDispatcher)  # its __init__ checks the compiled model's splitting ops
    dispatcher.__dict__.update(vllm_config=config, compilation_config=config.compilation_config,
                               uniform_decode_query_len=q, keys_initialized=False, specialize_lora_count=False,
                               cudagraph_mode=CUDAGraphMode.NONE,
                               cudagraph_keys={CUDAGraphMode.PIECEWISE: set(), CUDAGraphMode.FULL: set()})
    dispatcher.initialize_cudagraph_keys(mode, q)
    return [(runtime.name, d.num_tokens, d.num_reqs, d.uniform)
            for runtime, descs in dispatcher.get_capture_descs() for d in descs]


#: vLLM's own capture functions as a ladder source: chosen, run (in a child outside a server) and memoised.
OWN = OwnFunctions("vllm", "vLLM", ResolutionError, resolve)
installed_version, main = OWN.installed_version, OWN.main


if __name__ == "__main__":
    sys.exit(main())
