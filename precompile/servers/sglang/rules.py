"""sglang's decode CUDA-graph resolution, mirrored in plain Python: which graphs a server captures.

Every rule cites the file and line of the sglang wheel it mirrors (the room's ``VERSION``);
``tests/test_sglang_oracle.py`` checks the mirror against sglang's own functions (:mod:`.native`).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from typing import Any

from jitwarm.precompile.servers import ResolutionError, differs_by_memory
from jitwarm.precompile.servers.sglang import VERSION

SOURCE = f"built-in rules of sglang {VERSION}"

#: Raw server settings the resolution reads, with their defaults (sglang's own field names).
INPUT_KEYS: Mapping[str, Any] = {
    "cuda_graph_max_bs_decode": None, "cuda_graph_bs_decode": None, "cuda_graph_config": None,
    "disable_cuda_graph": False, "disable_decode_cuda_graph": False, "disable_cuda_graph_padding": False,
    "speculative_algorithm": None, "speculative_num_draft_tokens": None, "speculative_num_steps": None,
    "speculative_eagle_topk": None, "max_running_requests": None,
    "tp_size": 1, "dp_size": 1, "attn_dp_size": 1, "enable_dp_attention": False,
    "gpu_memory_mb": None, "ragged_verify_mode": "static", "kv_capacity": None,
    "device": None, "enable_torch_compile": False, "torch_compile_max_bs": None,
}
#: ServerArgs fields no ServingConfig field holds: the room's own settings (``server_options``, :data:`.OPTIONS`).
#: ``--device cpu --enable-torch-compile`` is sglang's CPU graph runner (cpu_graph_runner.py), whose ladder
#: ``--torch-compile-max-bs`` caps (default 32: srt/arg_groups/fields/exec_.py:698-701).
OPTION_KEYS = ("device", "enable_torch_compile", "torch_compile_max_bs")
TORCH_COMPILE_MAX_BS = 32

#: Inputs that are not ServerArgs fields: the device memory, the environment, the KV pool a server profiles at
#: start-up; and the room's own settings, which :mod:`.native` passes apart.
NOT_FIELDS = ("gpu_memory_mb", "ragged_verify_mode", "kv_capacity", *OPTION_KEYS)
#: The variable sglang reads the verify mode from, and its values (srt/speculative/ragged_verify.py:19-27).
VERIFY_MODE_ENV = "SGLANG_RAGGED_VERIFY_MODE"
VERIFY_MODES = ("static", "cap-accept", "compact")

#: The built-in algorithms (srt/speculative/spec_info.py:39-47; :109-110: NEXTN is EAGLE) -> the handler each
#: dispatches to (:235-271) and the line of srt/arg_groups/speculative_hook.py where it defaults
#: max_running_requests to 48 (None: it sets none). They run after handle_gpu_memory_settings (pipeline.py:218,
#: :306), so the 48 cuts the runner's pool, not the default max batch.
HANDLERS = {"DFLASH": ("_handle_dflash", 442), "UNO": ("_handle_uno", None), "DSPARK": ("_handle_dspark", 856),
            "EAGLE": ("_handle_eagle_family", 1090), "EAGLE3": ("_handle_eagle_family", 1090),
            "FROZEN_KV_MTP": ("_handle_frozen_kv_mtp", 996), "STANDALONE": ("_handle_eagle_family", 1090),
            "NGRAM": ("_handle_ngram", 1298)}
ALIASES = {"NEXTN": "EAGLE"}
SPECULATIVE_MAX_RUNNING_REQUESTS = 48

# (below MiB, max_bs below tp 4, max_bs from tp 4): srt/arg_groups/memory_hook.py:86-171.
_MEMORY_TIERS = ((20 * 1024, 8, 8), (35 * 1024, 48, 160), (60 * 1024, 32, 160), (90 * 1024, 256, 512),
                 (160 * 1024, 256, 512))
_LARGEST_TIER = 512  # B200, MI300 (:163-171)
_UNKNOWN_MEMORY_MAX_BS = 160  # gpu_mem is None (:172-180)
#: One device memory per tier (MiB), to tell whether a config's ladder depends on the memory at all.
MEMORY_TIER_SAMPLES = (16 * 1024, 24 * 1024, 40 * 1024, 80 * 1024, 141 * 1024, 180 * 1024)


def normalize_algorithm(name: str | None) -> str | None:
    """Upper-case ``name`` and resolve aliases (``NEXTN`` is ``EAGLE``); ResolutionError for an unknown one."""
    if name is None:
        return None
    upper = ALIASES.get(name.upper(), name.upper())
    if upper not in HANDLERS:
        raise ResolutionError(f"unknown speculative algorithm {name!r}; sglang {VERSION} knows "
                              f"{', '.join((*HANDLERS, *ALIASES))}")
    return upper


def resolve(inputs: Mapping[str, Any]) -> dict[str, Any]:
    """Return the decode graphs sglang ``VERSION`` captures for these raw settings (:data:`INPUT_KEYS`).

    The answer: ``source``, ``max_requests`` (the resolved ``max_running_requests``), ``decode_max_bs`` and
    ``decode_bs`` (the resolved ``cuda_graph_config.decode``), ``capture_bs`` (after the runner's cut), ``width``
    (tokens per request), ``compact`` and ``shapes`` (``{"bs", "graph_key", "verify_lens"}`` per graph, largest
    first); with decode graphs disabled ``{"source", "disabled": <why>, "shapes": []}``. :class:`ResolutionError`
    for a combination sglang rejects.
    """
    cfg = {**INPUT_KEYS, **inputs}
    algorithm = normalize_algorithm(cfg["speculative_algorithm"])
    attn_dp = _checked_attention_dp(cfg)
    if cfg["device"] == "cpu":
        return _resolve_cpu(cfg, algorithm, attn_dp)
    decode = decode_graph_config(cfg)
    if decode.get("backend") == "disabled":
        return {"source": SOURCE, "disabled": decode["why"], "shapes": []}

    max_running = cfg["max_running_requests"]
    max_bs = decode.get("max_bs")
    if max_bs is None:
        max_bs = default_max_bs(cfg["gpu_memory_mb"], cfg["tp_size"])
        # The default is capped by --max-running-requests; an explicit max is not (memory_hook.py:182-188).
        if max_running is not None and max_bs > max_running:
            max_bs = max_running
    if algorithm is not None:
        _verify_mode(cfg)  # every algorithm validates it at start-up (spec_info.py:249-253)
    if algorithm is not None and HANDLERS[algorithm][1] is not None and max_running is None:
        max_running = SPECULATIVE_MAX_RUNNING_REQUESTS
    bs_list = decode.get("bs")
    if bs_list is None:
        bs_list = decode_batch_sizes(max_bs, speculative=algorithm is not None,
                                     no_padding=cfg["disable_cuda_graph_padding"])
    else:
        bs_list = list(bs_list)
        max_bs = max(bs_list)  # memory_hook.py:199-207

    width = _draft_tokens(cfg, algorithm) if algorithm is not None else 1
    capture_bs = runner_batch_sizes(bs_list, width, pool_size=_pool_size(max_running, attn_dp, cfg["kv_capacity"]),
                                    alignment=cfg["tp_size"] // attn_dp if attn_dp > 1 else 1)
    compact = algorithm == "DSPARK" and _verify_mode(cfg) == "compact"
    if compact and cfg["disable_cuda_graph_padding"]:
        # decode_cuda_graph_runner.py:408-418
        raise ResolutionError("compact ragged verify (SGLANG_RAGGED_VERIFY_MODE=compact) cannot be used with "
                              "--disable-cuda-graph-padding: sglang rejects it")
    return {"source": SOURCE, "max_requests": max_running, "decode_max_bs": max_bs,
            "decode_bs": bs_list, "capture_bs": capture_bs, "width": width, "compact": compact,
            "shapes": graph_shapes(capture_bs, width, compact)}


def _resolve_cpu(cfg: Mapping[str, Any], algorithm: str | None, attn_dp: int) -> dict[str, Any]:
    """:func:`resolve` for ``--device cpu``: the CPU graph runner's ladder, one ``torch.compile`` graph per size.

    The runner exists only with ``--enable-torch-compile``; ``--disable-cuda-graph`` does not stop it
    (srt/model_executor/model_runner_components/cuda_graph_setup.py:731-736). A given decode list is the ladder
    and sets ``torch_compile_max_bs`` to its max; else :func:`cpu_graph_batch_sizes` up to
    ``--torch-compile-max-bs`` (srt/arg_groups/memory_hook.py:208-231). The runner drops sizes above the request
    pool, appending nothing (cpu_graph_runner.py:135-150). The device memory is never read.
    """
    if not cfg["enable_torch_compile"]:
        return {"source": SOURCE, "disabled": "--device cpu without --enable-torch-compile (sglang's CPU graph "
                                              "runner is its torch.compile)", "shapes": []}
    given = decode_graph_config({**cfg, "disable_cuda_graph": False, "disable_decode_cuda_graph": False})
    max_running = cfg["max_running_requests"]
    if algorithm is not None and HANDLERS[algorithm][1] is not None and max_running is None:
        max_running = SPECULATIVE_MAX_RUNNING_REQUESTS
    if given.get("bs") is not None:
        bs_list = list(given["bs"])  # as given; the runner sorts its own copy (cpu_graph_runner.py:146)
    else:
        bs_list = cpu_graph_batch_sizes(cfg["torch_compile_max_bs"] or TORCH_COMPILE_MAX_BS,
                                        no_padding=cfg["disable_cuda_graph_padding"])
    pool = _pool_size(max_running, attn_dp, cfg["kv_capacity"])
    capture_bs = sorted({bs for bs in bs_list if pool is None or bs <= pool})
    if not capture_bs:
        raise ResolutionError(f"no CPU graph batch size is within the request pool of {pool} (sglang asserts on "
                              "an empty ladder: cpu_graph_runner.py:148)")
    width = _draft_tokens(cfg, algorithm) if algorithm is not None else 1
    return {"source": SOURCE, "max_requests": max_running, "decode_max_bs": max(bs_list),
            "decode_bs": bs_list, "capture_bs": capture_bs, "width": width, "compact": False,
            "shapes": graph_shapes(capture_bs, width, False)}


def cpu_graph_batch_sizes(max_bs: int, *, no_padding: bool) -> list[int]:
    """The CPU graph ladder up to ``max_bs`` (cuda_graph_hook.py:535-553 ``generate_cpu_graph_batch_sizes``).

    Every size to 16, then steps of 2 to 30, of 4 from 32 to 80, of 8 from 84, and the max; with
    ``--disable-cuda-graph-padding`` every size to the max.
    """
    if no_padding:
        return list(range(1, max_bs + 1))
    sizes = {*range(1, 17), *range(18, 31, 2), *range(32, 81, 4), *range(84, max_bs + 1, 8), max_bs}
    return sorted(bs for bs in sizes if bs <= max_bs)


def builtin(inputs: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`resolve`, computed once per process for each distinct ``inputs`` (the config's check, then the plan)."""
    return _builtin(json.dumps(dict(inputs), sort_keys=True))


@functools.lru_cache(maxsize=64)
def _builtin(inputs: str) -> dict[str, Any]:
    """:func:`resolve` of JSON-encoded inputs, cached."""
    return resolve(json.loads(inputs))


def decode_graph_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The decode phase of ``cuda_graph_config``, ``why`` naming what disabled it (cuda_graph_hook.py:32-101)."""
    decode: dict[str, Any] = {}
    if cfg["disable_cuda_graph"]:
        decode.update(backend="disabled", why="--disable-cuda-graph")
    if cfg["disable_decode_cuda_graph"]:
        decode.update(backend="disabled", why="--disable-decode-cuda-graph")
    if cfg["cuda_graph_max_bs_decode"] is not None:
        decode["max_bs"] = cfg["cuda_graph_max_bs_decode"]
    if cfg["cuda_graph_bs_decode"] is not None:
        decode["bs"] = list(cfg["cuda_graph_bs_decode"])
    explicit = cfg["cuda_graph_config"] or {}
    for key, value in (explicit.get("decode") or {}).items() if isinstance(explicit, Mapping) else ():
        decode[key] = value
        if key == "backend":
            decode["why"] = f"--cuda-graph-config decode backend {value!r}"
    if decode.get("backend") not in (None, "disabled"):
        decode.pop("backend")  # full, breakable, ...: the ladder is the same for every capturing backend
    return decode


def default_max_bs(gpu_memory_mb: int | None, tp_size: int) -> int:
    """Return sglang's default decode max batch for this device memory (MiB) and TP size (memory_hook.py:86-180)."""
    if gpu_memory_mb is None:
        return _UNKNOWN_MEMORY_MAX_BS
    for below, small_tp, large_tp in _MEMORY_TIERS:
        if gpu_memory_mb < below:
            return small_tp if tp_size < 4 else large_tp
    return _LARGEST_TIER


def decode_batch_sizes(max_bs: int, *, speculative: bool, no_padding: bool) -> list[int]:
    """Return sglang's decode capture ladder for ``max_bs``, appended if off the tiers (cuda_graph_hook.py:500-532)."""
    if no_padding:
        sizes = list(range(1, max_bs + 1))
    elif not speculative:
        sizes = [1, 2, 4, 8, 12, *range(16, 257, 8), *range(272, 512, 16), *range(512, max_bs + 1, 32)]
    else:
        sizes = [*range(1, 9), *range(10, 33, 2), *range(40, 65, 4), *range(72, 257, 8),
                 *range(272, max_bs + 1, 16)]
    sizes = [bs for bs in sizes if bs <= max_bs]
    if max_bs not in sizes:
        sizes.append(max_bs)
    return sizes


def _checked_attention_dp(cfg: Mapping[str, Any]) -> int:
    """The attention-DP size, after sglang's two start-up checks of the layout.

    ``--attn-dp-size``, or ``--dp-size N --enable-dp-attention`` (srt/arg_groups/fields/parallel.py:192-194);
    srt/arg_groups/parallel_hook.py:285-292 refuses replicas with it, :326 asserts ``tp_size % attn_dp_size == 0``.
    """
    if cfg["attn_dp_size"] and cfg["attn_dp_size"] > 1:
        attn_dp = int(cfg["attn_dp_size"])
    elif cfg["enable_dp_attention"] and cfg["dp_size"] > 1:
        attn_dp = int(cfg["dp_size"])
    else:
        attn_dp = 1
    replicas = 1 if cfg["enable_dp_attention"] and cfg["attn_dp_size"] == 1 else cfg["dp_size"]
    if attn_dp > 1 and replicas > 1:
        raise ResolutionError(f"--dp-size {replicas} with --attn-dp-size {attn_dp}: data-parallel replicas combined "
                              "with attention data parallelism are not supported (sglang refuses it)")
    if attn_dp > 1 and cfg["tp_size"] % attn_dp:
        raise ResolutionError(f"--tp-size {cfg['tp_size']} is not a multiple of the attention-DP size {attn_dp}: "
                              "sglang asserts tp_size % attn_dp_size == 0 at start-up")
    return attn_dp


def _pool_size(max_running: int | None, attn_dp: int, kv_capacity: int | None) -> int | None:
    """The request pool of one attention-DP rank (kv_cache_configurator.py:3119); None when nothing bounds it."""
    if max_running is not None:
        pool = max(1, max_running // attn_dp)  # kv_cache_configurator.py:3128
        return pool if kv_capacity is None else min(pool, kv_capacity // 2)
    if kv_capacity is None:
        return None
    # The server's estimate is 2048 to 4096 requests, from the model's context length (:3122-3123): the ceiling.
    return min(4096, kv_capacity // 2)


def runner_batch_sizes(bs_list: list[int], width: int, *, pool_size: int | None, alignment: int) -> list[int]:
    """Return the sizes the decode runner captures: ``cuda_graph_config.decode.bs`` cut at the pool size.

    srt/model_executor/runner/base_cuda_graph_runner.py:65-110: the pool size (padded to the alignment) replaces
    larger sizes; sizes whose ``bs * width`` tokens do not divide by the alignment are dropped
    (srt/utils/common.py:4168-4181).
    """
    sizes = list(bs_list)
    if pool_size is not None:
        pool = -(-pool_size // alignment) * alignment
        if max(sizes) > pool:
            sizes.append(pool)
        sizes = [bs for bs in sizes if bs <= pool]
    sizes = [bs for bs in sizes if bs * width % alignment == 0]
    if not sizes:
        raise ResolutionError(f"no decode batch size survives the request-pool cut and the attention-TP "
                              f"alignment of {alignment} (sglang asserts on an empty ladder)")
    return sorted(set(sizes))


def capture_verify_lens(num_tokens: int, num_slots: int) -> list[int]:
    """Spread ``num_tokens`` over ``num_slots`` rows that hold them, longest first (ragged_verify.py:198-216)."""
    base = num_tokens // num_slots
    rem = num_tokens - base * num_slots
    return [base + 1] * rem + [base] * (num_slots - rem)


def graph_shapes(capture_bs: list[int], width: int, compact: bool) -> list[dict[str, Any]]:
    """One entry per captured graph, largest first: its bs, the key sglang stores it under, its verify_lens.

    Compact graphs are keyed by ``bs * width`` tokens over ``min(tokens, max(capture_bs))`` rows
    (srt/model_executor/runner/decode_cuda_graph_runner.py:699-702, 737-738, 791-794); others by bs.
    """
    top, shapes = max(capture_bs), []
    for bs in sorted(capture_bs, reverse=True):
        tokens = bs * width
        lens = capture_verify_lens(tokens, min(tokens, top)) if compact else [width] * bs
        shapes.append({"bs": bs, "graph_key": tokens if compact else bs, "verify_lens": lens})
    return shapes


def _draft_tokens(cfg: Mapping[str, Any], algorithm: str) -> int:
    """Tokens per request a speculative target-verify graph captures (``captured_req_width``)."""
    draft = cfg["speculative_num_draft_tokens"]
    if HANDLERS[algorithm][0] == "_handle_eagle_family":
        steps, topk = cfg["speculative_num_steps"], cfg["speculative_eagle_topk"]
        if steps is None:
            # speculative_hook.py:1159-1174: without steps sglang chooses steps, top-k and draft tokens from
            # the model (and asserts that neither of the others was given).
            raise ResolutionError(f"--speculative-algorithm {algorithm} needs --speculative-num-steps (and "
                                  "--speculative-eagle-topk): sglang otherwise picks them from the model")
        if topk is None:
            raise ResolutionError(f"--speculative-algorithm {algorithm} with --speculative-num-steps needs "
                                  "--speculative-eagle-topk")
        if topk == 1:
            return int(steps) + 1  # speculative_hook.py:1255-1266: a linear chain verifies steps + 1 tokens
    if draft is None:
        # sglang derives it from the draft model (DSpark's gamma, EAGLE's steps and top-k): unknown here.
        raise ResolutionError(f"--speculative-algorithm {algorithm} needs --speculative-num-draft-tokens: sglang "
                              "derives the default from the draft model, which a plan cannot read")
    return int(draft)


def _verify_mode(cfg: Mapping[str, Any]) -> str:
    """SGLANG_RAGGED_VERIFY_MODE, matched exactly as srt/speculative/ragged_verify.py:19-27 does."""
    mode = cfg["ragged_verify_mode"]
    if mode not in VERIFY_MODES:
        raise ResolutionError(f"invalid SGLANG_RAGGED_VERIFY_MODE={mode!r}; expected one of "
                              f"{', '.join(VERIFY_MODES)}")
    return mode


def reads_memory(inputs: Mapping[str, Any]) -> bool:
    """True when the device memory enters the resolution: no decode max or list is given (memory_hook.py:86-188)."""
    cfg = {**INPUT_KEYS, **inputs}
    if cfg["device"] == "cpu":
        return False  # the CPU ladder is capped by --torch-compile-max-bs (memory_hook.py:208-231)
    decode = decode_graph_config(cfg)
    return decode.get("backend") != "disabled" and decode.get("max_bs") is None and decode.get("bs") is None


def depends_on_memory(inputs: Mapping[str, Any]) -> bool:
    """True when the captured graphs differ between device-memory tiers (so the memory must be known)."""
    return reads_memory(inputs) and differs_by_memory(resolve, inputs, MEMORY_TIER_SAMPLES,
                                                      lambda r: tuple(s["graph_key"] for s in r["shapes"]))
