"""vLLM's CUDA-graph capture sizes and modes, mirrored in plain Python: which graphs a server captures.

Every rule cites the file and line of the vLLM wheel it mirrors (the room's ``VERSION``);
``tests/test_vllm_oracle.py`` checks the mirror against vLLM's own functions (:mod:`.native`). The chain, in
vLLM's order: the scheduler defaults, the mode from the optimization level, the sizes, the mode once the attention
backend's support is known, and the graphs the V2 runner (the default, ``config/vllm.py:731-766``) or the V1
runner captures: PIECEWISE first, then FULL, largest first (``cudagraph_utils.py:440-452``,
``cudagraph_dispatcher.py:324-348``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jitwarm.precompile.servers import ResolutionError
from jitwarm.precompile.servers.vllm import VERSION

SOURCE = f"built-in rules of vLLM {VERSION}"

#: Raw settings the resolution reads, with their defaults (vLLM's own names; the flag of each: ``vllm.OPTIONS``).
#: Stand-ins for what vLLM reads at start: the attention backend's ``AttentionCGSupport``, the device's memory
#: (None: vLLM's query failed) and compute capability (major*10+minor: 90, 100, 121), the platform (cuda, cpu).
#: ``max_model_len`` None never binds; ``enable_chunked_prefill`` None is the model's default, on.
INPUT_KEYS: Mapping[str, Any] = {
    "max_num_seqs": None, "max_num_batched_tokens": None, "cudagraph_capture_sizes": None,
    "max_cudagraph_capture_size": None, "cudagraph_mode": None, "optimization_level": 2, "enforce_eager": False,
    "num_speculative_tokens": 0, "performance_mode": "balanced", "max_model_len": None,
    "enable_chunked_prefill": None, "model_runner": "v2", "attention_cudagraph_support": "ALWAYS",
    "gpu_memory_mb": None, "device_capability": None, "platform": "cuda",
}

MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
# CUDAGraphMode (config/compilation.py:53-63): (decode mode, mixed mode) of each; a plain mode is both.
_ROUTINES = {"NONE": ("NONE", "NONE"), "PIECEWISE": ("PIECEWISE", "PIECEWISE"), "FULL": ("FULL", "FULL"),
             "FULL_DECODE_ONLY": ("FULL", "NONE"), "FULL_AND_PIECEWISE": ("FULL", "PIECEWISE")}
#: AttentionCGSupport (v1/attention/backend.py:557-569), weakest first.
SUPPORT = ("NEVER", "UNIFORM_SINGLE_TOKEN_DECODE", "UNIFORM_BATCH", "ALWAYS")
PERFORMANCE_MODES = ("balanced", "interactivity", "throughput")
RUNNERS = ("v1", "v2")
PLATFORMS = ("cuda", "cpu")
#: Why a CPU server plans no graphs: ``CpuPlatform.check_and_update_config`` empties the capture sizes
#: (platforms/cpu.py:370; 0.32.0: :353) and the CPU runner never captures (v1/worker/cpu_model_runner.py:34).
CPU_PLATFORM = "vLLM's CPU platform"
# The mode each optimization level sets (config/vllm.py:255-340: OPTIMIZATION_LEVEL_00 .. _03).
_LEVEL_MODES = {0: "NONE", 1: "PIECEWISE", 2: "FULL_AND_PIECEWISE", 3: "FULL_AND_PIECEWISE"}
_GIB_MB = 1024


def resolve(inputs: Mapping[str, Any]) -> dict[str, Any]:
    """Return the CUDA graphs vLLM ``VERSION`` captures for these raw settings (:data:`INPUT_KEYS`, defaulted).

    The fields of :func:`answer`, final, and ``shapes`` in capture order, ``{"mode", "num_tokens", "num_reqs",
    "uniform", "bs", "graph_key", "verify_lens", "key"}`` (``key``: the dispatch key in words; ``bs``,
    ``verify_lens``: its dummy batch); ``disabled`` says why graphs are off. ResolutionError for refused settings.
    """
    cfg = _checked({**INPUT_KEYS, **inputs})
    q = 1 + cfg["num_speculative_tokens"]  # uniform_decode_query_len (config/vllm.py:695-713)
    if cfg["platform"] == "cpu":  # nothing is captured, so nothing of the device is read (not even its defaults)
        return {**answer(SOURCE, cfg["max_num_seqs"], cfg["max_num_batched_tokens"], q), "disabled": CPU_PLATFORM}
    max_num_seqs, max_num_tokens = scheduler_limits(cfg)
    # The mode before the backend is known: given, else the level's; NONE for --enforce-eager (config/vllm.py:
    # 1766-1768, :2003-2008).
    mode = "NONE" if cfg["enforce_eager"] else cfg["cudagraph_mode"] or _LEVEL_MODES[cfg["optimization_level"]]
    base = answer(SOURCE, max_num_seqs, max_num_tokens, q)
    if mode == "NONE":
        why = "--enforce-eager" if cfg["enforce_eager"] else f"cudagraph_mode NONE (-O{cfg['optimization_level']})" \
            if cfg["cudagraph_mode"] is None else "cudagraph_mode NONE"
        return {**base, "disabled": why}
    sizes, top = capture_sizes(cfg, max_num_seqs, max_num_tokens, q)
    mode = resolved_mode(mode, cfg, q)
    if cfg["model_runner"] == "v1" and _ROUTINES[mode][0] == "FULL" and q > 1:
        sizes, top = round_for_spec_decode(sizes, top, q)
    if mode == "NONE":
        return {**base, "capture_sizes": sizes, "max_capture_size": top,
                "disabled": f"cudagraph_mode NONE: the attention backend supports {cfg['attention_cudagraph_support']}"}
    if cfg["model_runner"] == "v2":
        shapes = v2_graphs(mode, sizes, top, max_num_seqs, q)
    else:
        shapes = v1_graphs(mode, sizes, max_num_seqs, q)
    return {**base, "cudagraph_mode": mode, "capture_sizes": sizes, "max_capture_size": top, "shapes": shapes,
            "capture_bs": sorted({s["bs"] for s in shapes})}


def answer(source: str, max_num_seqs: int | None, max_num_tokens: int | None, q: int) -> dict[str, Any]:
    """A resolution that captures no graph yet, for these limits (the fields every answer has)."""
    return {"source": source, "max_num_seqs": max_num_seqs, "max_requests": max_num_seqs,
            "max_num_batched_tokens": max_num_tokens, "width": q, "compact": False, "cudagraph_mode": "NONE",
            "capture_sizes": [], "max_capture_size": 0, "shapes": [], "capture_bs": []}


def _checked(cfg: dict[str, Any]) -> dict[str, Any]:
    """Refuse values vLLM's parser or config classes refuse, and settings the rules do not mirror."""
    if cfg["cudagraph_mode"] is not None:
        cfg["cudagraph_mode"] = str(cfg["cudagraph_mode"]).upper()
        if cfg["cudagraph_mode"] not in MODES:
            raise ResolutionError(f"unknown cudagraph_mode {cfg['cudagraph_mode']!r}; vLLM {VERSION} knows "
                                  f"{', '.join(MODES)}")
    for key, what, allowed in (("performance_mode", "--performance-mode", PERFORMANCE_MODES),
                               ("model_runner", "model runner", RUNNERS),
                               ("attention_cudagraph_support", "attention CUDA-graph support", SUPPORT),
                               ("platform", "platform", PLATFORMS)):
        if cfg[key] not in allowed:
            raise ResolutionError(f"{what} {cfg[key]!r}: choose from {', '.join(allowed)}")
    if cfg["optimization_level"] not in _LEVEL_MODES:
        raise ResolutionError(f"-O{cfg['optimization_level']}: vLLM {VERSION} knows -O0 to -O3")
    spec = cfg["num_speculative_tokens"]
    if type(spec) is not int or spec < 0:
        raise ResolutionError(f"num_speculative_tokens must be a count, got {spec!r}")
    sizes = cfg["cudagraph_capture_sizes"]
    if sizes is not None and (not isinstance(sizes, list) or not all(type(s) is int and s > 0 for s in sizes)):
        raise ResolutionError("cudagraph_capture_sizes must be a list of positive token counts")
    return cfg


def scheduler_limits(cfg: Mapping[str, Any]) -> tuple[int, int]:
    """``(max_num_seqs, max_num_batched_tokens)`` after vLLM's defaults for ``vllm serve``.

    ``EngineArgs.get_batch_defaults`` (engine/arg_utils.py:2940-3034, unknown memory :2964-2968), throughput mode
    (:3184-3189), the model length (:3191-3220), the budget cut (:3230-3234), ``config/scheduler.py:331-336``.
    """
    memory, capability = cfg["gpu_memory_mb"], cfg["device_capability"]
    if memory is not None and memory >= 160 * _GIB_MB:
        tokens, seqs = 16384, 1024
    elif memory is not None and memory >= 70 * _GIB_MB and capability not in (80, 121):
        tokens, seqs = 8192, 1024
    else:
        tokens, seqs = 2048, 256
    max_seqs = cfg["max_num_seqs"]
    if max_seqs is None:
        max_seqs = seqs * (2 if cfg["performance_mode"] == "throughput" else 1)
    max_tokens = cfg["max_num_batched_tokens"]
    if max_tokens is None:
        max_tokens = tokens * (2 if cfg["performance_mode"] == "throughput" else 1)
        model_len = cfg["max_model_len"]
        if model_len is not None:
            if cfg["enable_chunked_prefill"] is False:
                max_tokens = max(model_len, max_tokens)
            max_tokens = min(max_seqs * model_len, max_tokens)
    if cfg["max_num_seqs"] is None:
        max_seqs = min(max_seqs, max_tokens)  # :3232-3234
    if max_tokens < max_seqs:
        raise ResolutionError(f"max_num_batched_tokens ({max_tokens}) must be greater than or equal to "
                              f"max_num_seqs ({max_seqs}) (vLLM refuses it)")
    return max_seqs, max_tokens


def capture_sizes(cfg: Mapping[str, Any], max_num_seqs: int, max_num_tokens: int, q: int) -> tuple[list[int], int]:
    """``VllmConfig._set_cudagraph_sizes`` (config/vllm.py:2398-2656): the sizes, ascending, and their max."""
    explicit_max = cfg["max_cudagraph_capture_size"]
    max_size = explicit_max
    decode_sizes: list[int] = []
    if max_size is None:
        # 1024 on a data-center Blackwell (capability 10.x, config/vllm.py:2464-2469), else 512.
        ceiling = 1024 if (cfg["device_capability"] or 0) // 10 == 10 else 512
        max_size = min(max_num_seqs * q * 2, ceiling)  # :2466-2473
        if q > 1:
            # :2487-2548 (a single tier: dynamic speculative decoding is not mirrored): request counts scaled by q
            reqs = min(max_num_seqs, ceiling)
            counts = sorted({*(n for n in (1, 2, 4) if n <= reqs), *range(8, min(reqs + 1, 256), 8),
                             *range(256, reqs + 1, 16), reqs})
            decode_sizes = sorted({n * q for n in counts if n * q <= max_size})
        elif max_num_seqs <= max_size:
            decode_sizes = [max_num_seqs]  # :2549-2550
    max_size = min(max_num_tokens, max_size)  # :2551-2552
    if max_size < 1:
        raise ResolutionError("the maximum CUDA-graph size is below 1 (vLLM asserts it)")
    explicit = cfg["cudagraph_capture_sizes"]
    if explicit is not None:
        if not explicit:
            raise ResolutionError("cudagraph_capture_sizes is empty (vLLM asserts at least one size)")
        sizes = sorted(s for s in set(explicit) if s <= max_num_tokens)  # :2560-2571
    else:
        if cfg["performance_mode"] == "interactivity":
            sizes = list(range(1, min(max_size, 32) + 1))  # :2573-2577
        else:
            sizes = [n for n in (1, 2, 4) if n <= max_size]
        if max_size >= 8:
            sizes += list(range(8, min(max_size + 1, 256), 8))
        if max_size >= 256:
            sizes += list(range(256, max_size + 1, 16))
        if max_num_tokens <= max_size and max_num_tokens not in sizes:
            sizes.append(max_num_tokens)  # :2592-2597
        sizes += [s for s in decode_sizes if s <= max_num_tokens]  # :2601-2603
        sizes = sorted(set(sizes))
    top = sizes[-1] if sizes else 0
    if explicit_max is not None and explicit_max != top and explicit is not None:
        raise ResolutionError(f"customized max_cudagraph_capture_size(={explicit_max}) should be consistent "
                              f"with the max value of cudagraph_capture_sizes(={top}) (vLLM refuses it)")
    return sizes, top


def resolved_mode(mode: str, cfg: Mapping[str, Any], q: int) -> str:
    """``resolve_cudagraph_mode_and_sizes`` (config/compilation.py:1376-1535), given the backend's support.

    Under VLLM_COMPILE (``-O1`` and up) attention is a splitting op, so FULL-for-mixed downgrades to
    FULL_AND_PIECEWISE and FULL-for-decode to PIECEWISE; at ``-O0`` there is no piecewise graph to fall back on.
    """
    support = SUPPORT.index(cfg["attention_cudagraph_support"])
    never, batch, always = 0, SUPPORT.index("UNIFORM_BATCH"), SUPPORT.index("ALWAYS")
    split = cfg["optimization_level"] >= 1
    name = cfg["attention_cudagraph_support"]
    if _ROUTINES[mode][1] == "FULL" and support != always:  # :1394-1418
        if support == never:
            raise ResolutionError(f"CUDAGraphMode.{mode} is not supported with an attention backend of support "
                                  f"{name}; use cudagraph_mode PIECEWISE (vLLM refuses it)")
        mode = "FULL_AND_PIECEWISE" if split else "FULL_DECODE_ONLY"
    if _ROUTINES[mode][0] == "FULL" and support == never:  # :1421-1446
        mode = "PIECEWISE" if split else "NONE"
    if _ROUTINES[mode][0] == "FULL" and q > 1 and support < batch:  # :1449-1466
        mode = "PIECEWISE" if split else "NONE"
    if not split:  # :1468-1480: no compiled submodule to capture piecewise (without_piecewise, :75-80)
        mode = {"PIECEWISE": "NONE", "FULL_AND_PIECEWISE": "FULL_DECODE_ONLY"}.get(mode, mode)
    return mode


def round_for_spec_decode(sizes: list[int], top: int, q: int) -> tuple[list[int], int]:
    """``adjust_cudagraph_sizes_for_spec_decode`` (config/compilation.py:1537-1565), V1 runner only (:1504-1510).

    For ``q > 1`` only, as vLLM calls it: with one token per request the sizes stay as given.
    """
    if not sizes:
        return sizes, top
    rounded = sorted({-(-s // q) * q for s in sizes if -(-s // q) * q <= top})
    if not rounded and q <= top:
        rounded = [q]
    if not rounded:
        raise ResolutionError(f"No valid cudagraph sizes after rounding to multiple of {q} (num_speculative_tokens "
                              f"+ 1): lower num_speculative_tokens or raise max_cudagraph_capture_size ({top})")
    return rounded, rounded[-1]


def v2_graphs(mode: str, sizes: list[int], top: int, max_num_seqs: int, q: int) -> list[dict[str, Any]]:
    """The V2 runner's graphs: ``CudaGraphManager._init_candidates`` (v1/worker/gpu/cudagraph_utils.py:256-375)."""
    decode, mixed = _ROUTINES[mode]
    separate = mode in ("FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
    by_mode: dict[str, list[dict[str, Any]]] = {"PIECEWISE": [], "FULL": []}
    for n in sorted(sizes):
        if separate and decode != "NONE":
            rounded = -(-n // q) * q
            reqs = rounded // q
            desc = _graph(decode, rounded, reqs, q, uniform=True, runner="v2")
            if rounded <= max_num_seqs * q and rounded <= top and reqs <= max_num_seqs and desc not in by_mode[decode]:
                by_mode[decode].append(desc)
        if mixed != "NONE":
            reqs = min(n, max_num_seqs) if mixed == "FULL" else None
            by_mode[mixed].append(_graph(mixed, n, reqs, q, uniform=False, runner="v2", max_num_seqs=max_num_seqs))
    return _capture_order(by_mode)


def v1_graphs(mode: str, sizes: list[int], max_num_seqs: int, q: int) -> list[dict[str, Any]]:
    """The V1 runner's graphs: ``CudagraphDispatcher.initialize_cudagraph_keys`` (cudagraph_dispatcher.py:159-226)."""
    decode, mixed = _ROUTINES[mode]
    separate = mode in ("FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
    by_mode: dict[str, list[dict[str, Any]]] = {"PIECEWISE": [], "FULL": []}
    if mixed != "NONE":
        for n in sizes:
            reqs = None if mixed == "PIECEWISE" else min(n, max_num_seqs)
            by_mode[mixed].append(_graph(mixed, n, reqs, q, uniform=False, runner="v1", max_num_seqs=max_num_seqs))
    if decode == "FULL" and separate:
        for n in sizes:
            if q <= n <= q * max_num_seqs:
                if n % q:
                    raise ResolutionError(f"capture size {n} is not a multiple of the decode query length {q} "
                                          "(vLLM asserts it)")
                desc = _graph("FULL", n, min(n // q, max_num_seqs), q, uniform=True, runner="v1")
                if desc not in by_mode["FULL"]:
                    by_mode["FULL"].append(desc)
    return _capture_order(by_mode)


def _graph(mode: str, num_tokens: int, num_reqs: int | None, q: int, *, uniform: bool, runner: str,
           max_num_seqs: int = 0) -> dict[str, Any]:
    """One graph: its dispatch key and the dummy batch vLLM captures it with (requests, tokens per request).

    V2 gives the remainder one token each to the last requests (v1/worker/gpu/input_batch.py:152-162); V1 gives
    uniform batches ``q`` each, the rest to the last request (gpu_model_runner.py:5535-5547).
    """
    slots = num_reqs if num_reqs is not None else min(num_tokens, max_num_seqs)
    if uniform:
        lens = [q] * slots
        if runner == "v1" and num_tokens % q:
            lens[-1] = num_tokens % q
    elif runner == "v2":
        base, extra = divmod(num_tokens, slots)
        lens = [base] * (slots - extra) + [base + 1] * extra
    else:
        base, extra = divmod(num_tokens, slots)
        lens = [base] * slots
        lens[-1] += extra
    key = f"{mode} num_tokens={num_tokens} num_reqs={num_reqs}" + (f" uniform={q}" if uniform else "")
    return {"mode": mode, "num_tokens": num_tokens, "num_reqs": num_reqs, "uniform": uniform, "bs": slots,
            "graph_key": num_tokens, "verify_lens": lens, "key": key}


def _capture_order(by_mode: Mapping[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """PIECEWISE first, then FULL; within a mode, most tokens first (stable for equal counts)."""
    return [g for mode in ("PIECEWISE", "FULL") for g in sorted(by_mode[mode], key=lambda g: -g["num_tokens"])]


def reads_device(inputs: Mapping[str, Any]) -> bool:
    """True when the device could change the graphs (some limit left to vLLM's defaults); never on the CPU platform."""
    cfg = {**INPUT_KEYS, **inputs}
    return cfg["platform"] != "cpu" and (cfg["max_num_seqs"] is None or cfg["max_num_batched_tokens"] is None or (
        cfg["max_cudagraph_capture_size"] is None and cfg["cudagraph_capture_sizes"] is None))

