"""sglang's decode CUDA-graph ladder by the installed sglang's own functions: a plan source and the rules' oracle.

Stand-ins replace what needs a GPU or a model (each cites its lines); patches are process-wide during a call.
Outside a server it runs in a child process: ``{"inputs": {...}}`` on stdin (:meth:`.OwnFunctions.main`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

from jitwarm.cache.settings import scoped_env
from jitwarm.precompile.servers import ResolutionError
from jitwarm.precompile.servers.own_functions import OwnFunctions, checked_inputs
from jitwarm.precompile.servers.sglang import rules
from jitwarm.precompile.servers.sglang.rules import INPUT_KEYS, NOT_FIELDS, VERIFY_MODE_ENV

# A test knob of sglang's (srt/environ.py:1573) that makes compact capture uniform
# (decode_cuda_graph_runner.py:791-794); the inputs describe a real server, so it is held unset.
_FORCE_UNIFORM_ENV = "SGLANG_TEST_RAGGED_VERIFY_FORCE_UNIFORM_CAPTURE"
# The speculative handlers, and those that declare max_running_requests=48 with the line (:data:`.rules.HANDLERS`).
_SPEC_HANDLERS = tuple(dict.fromkeys(handler for handler, _ in rules.HANDLERS.values()))
_DEFAULTS_48_RUNNING = {handler: line for handler, line in rules.HANDLERS.values() if line is not None}


def resolve_ladder(inputs: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The decode graphs sglang captures for ``inputs``, from ``source`` (:meth:`.OwnFunctions.resolve_from`)."""
    return OWN.resolve_from(inputs, source, defaults=INPUT_KEYS, builtin=lambda: rules.builtin(inputs))


def resolve(inputs: Mapping[str, Any]) -> dict[str, Any]:
    """Return what :func:`.rules.resolve` returns for every key of :data:`INPUT_KEYS`, by the installed sglang.

    ValueError for malformed inputs, or settings sglang itself rejects (its own exception's message and type).
    """
    cfg = checked_inputs(inputs, INPUT_KEYS)
    try:
        with scoped_env({VERIFY_MODE_ENV: cfg["ragged_verify_mode"], _FORCE_UNIFORM_ENV: None}):
            return _resolve(cfg)
    except (ValueError, AssertionError, TypeError, argparse.ArgumentTypeError) as exc:
        raise ValueError(f"sglang rejects these settings ({type(exc).__name__}): {exc}") from exc


def _resolve(cfg: dict[str, Any]) -> dict[str, Any]:
    """The resolution itself; the caller holds the environment scope."""
    from unittest import mock

    from sglang.srt.arg_groups import memory_hook
    from sglang.srt.arg_groups.cuda_graph_hook import handle_cuda_graph_config
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
    from sglang.srt.model_executor.cuda_graph_config import Backend
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.model_executor.runner.base_cuda_graph_runner import get_batch_sizes_to_capture
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import (
        DecodeCudaGraphRunner,
        ragged_verify_compact_graphs_enabled,
    )
    from sglang.srt.runtime_context import create_context, get_exec, get_parallel, get_schedule, get_spec, use_context
    from sglang.srt.speculative.ragged_verify import build_capture_verify_lens
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    record = _server_args(cfg)
    # srt/arg_groups/pipeline.py:20-109: with no model the pipeline runs its model-independent head and stops;
    # the steps that follow it are called one by one, in pipeline order (:191, :218, :306).
    record.resolve_once()
    handle_cuda_graph_config(record)
    with mock.patch.object(memory_hook, "get_device_memory_capacity", lambda device=None: cfg["gpu_memory_mb"]):
        memory_hook.handle_gpu_memory_settings(record)  # the GPU, faked: its memory size in MiB
    _speculative_defaults(record)

    # sglang's scoped context (runtime_context.py:1518-1540) carries this config to the runner code's reads.
    with use_context(create_context(record, role="scheduler")):
        if cfg["device"] == "cpu":
            return _resolve_cpu(cfg)
        decode = get_exec().graph.cuda_graph_config.decode
        if decode.backend == Backend.DISABLED:
            return {"source": OWN.source(), "shapes": [], "disabled": rules.decode_graph_config(cfg).get("why")}
        algorithm = SpeculativeAlgorithm.from_string(get_spec().speculative_algorithm)
        # The attributes of a target ModelRunner the ladder code reads; the pool size is set below.
        runner = SimpleNamespace(server_args=record, spec_algorithm=algorithm, is_draft_worker=False,
                                 model_config=None, req_to_token_pool=SimpleNamespace(size=None))
        # decode_cuda_graph_runner.py:359-361: captured_req_width, from the model runner's own method.
        width = ModelRunner.decode_num_tokens_per_req(runner, num_draft_tokens=get_spec().speculative_num_draft_tokens)
        if width is None:
            raise ValueError(f"--speculative-algorithm {algorithm.name} without --speculative-num-draft-tokens: "
                             "sglang derives the count from the draft model, which is not read here")
        max_running = get_schedule().max_running_requests
        runner.req_to_token_pool.size = _pool_size(KVCacheConfigurator, max_running, get_parallel().attn_dp_size,
                                                   cfg["kv_capacity"], decode.bs)
        # decode_cuda_graph_runner.py:305-313,388-392: the alignment follows the runner's gather needs.
        mlp_gather, attn_gather = DecodeCudaGraphRunner.decode_graph_gather_requirements(runner)
        capture_bs, _ = get_batch_sizes_to_capture(runner, width, gathered_buffer_required=mlp_gather or attn_gather)
        # By hand, as the runner's __init__ (it needs a model) does (decode_cuda_graph_runner.py:362-367, 397-401).
        compact = (ragged_verify_compact_graphs_enabled(algorithm) and algorithm.is_speculative()
                   and not runner.is_draft_worker)
        if compact and get_exec().graph.disable_cuda_graph_padding:
            # decode_cuda_graph_runner.py:411-422, raised in the runner's __init__.
            raise ValueError("Compact ragged verify does not support two-batch-overlap, LoRA, or "
                             "disable-cuda-graph-padding (bs pads to the captured tier); disable "
                             "SGLANG_RAGGED_VERIFY_MODE or the conflicting feature.")
        graphs = SimpleNamespace(capture_bs=capture_bs, captured_req_width=width, max_bs=max(capture_bs),
                                 ragged_verify_mode=compact)
        shapes = []
        for size in reversed(capture_bs):  # capture order, largest first (decode_cuda_graph_runner.py:1324-1332)
            # capture_one_shape (:1376-1377, key at :1481-1482; compact layout :796-813).
            num_tokens = size * width
            bs = DecodeCudaGraphRunner._ragged_capture_slots(graphs, num_tokens) if compact else size
            key = DecodeCudaGraphRunner._capture_graph_size(graphs, bs=bs, num_tokens=num_tokens)
            if compact:
                lens = build_capture_verify_lens(num_tokens=num_tokens, num_slots=bs, num_draft_tokens=width)
            else:
                lens = [width] * bs  # a uniform batch: every request verifies `width` tokens
            shapes.append({"bs": size, "graph_key": key, "verify_lens": lens})
        if compact:  # the keys are the runner's token buckets (:402-406, :699-702)
            assert sorted(s["graph_key"] for s in shapes) == DecodeCudaGraphRunner._build_ragged_verify_token_buckets(
                graphs)
        return {"source": OWN.source(), "max_requests": max_running, "decode_max_bs": decode.max_bs,
                "decode_bs": list(decode.bs), "capture_bs": capture_bs, "width": width, "compact": compact,
                "shapes": shapes}


def _resolve_cpu(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The CPU graph runner's ladder (``--device cpu``), inside the caller's sglang context.

    cuda_graph_setup.py:731-736 makes the runner only with ``--enable-torch-compile``; its sizes are
    cpu_graph_runner.py:135-150 ``get_batch_sizes_to_capture`` over the request pool.
    """
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
    from sglang.srt.model_executor.cpu_graph_runner import get_batch_sizes_to_capture
    from sglang.srt.runtime_context import get_exec, get_flags, get_parallel, get_schedule

    if not get_flags().capture.enable_torch_compile:
        return {"source": OWN.source(), "shapes": [], "disabled": rules.resolve(cfg).get("disabled")}
    decode = get_exec().graph.cuda_graph_config.decode
    max_running = get_schedule().max_running_requests
    pool = _pool_size(KVCacheConfigurator, max_running, get_parallel().attn_dp_size, cfg["kv_capacity"], decode.bs)
    capture_bs = get_batch_sizes_to_capture(SimpleNamespace(req_to_token_pool=SimpleNamespace(size=pool)))
    return {"source": OWN.source(), "max_requests": max_running, "decode_max_bs": max(decode.bs),
            "decode_bs": list(decode.bs), "capture_bs": capture_bs, "width": 1, "compact": False,
            "shapes": [{"bs": bs, "graph_key": bs, "verify_lens": [1] * bs} for bs in reversed(capture_bs)]}


def _server_args(cfg: Mapping[str, Any]) -> Any:
    """A ServerArgs record of these flags, with no model and no prefill graphs (they do not shape decode)."""
    from sglang.srt.model_executor.cuda_graph_config import parse_cuda_graph_config_arg
    from sglang.srt.server_args import ServerArgs

    fields = {key: cfg[key] for key in INPUT_KEYS if key not in NOT_FIELDS}
    if cfg["cuda_graph_config"] is not None:
        # The CLI's own parser for --cuda-graph-config (exec_.py:606-612). Its prefill phase is dropped: a
        # prefill backend needs the model to resolve (cuda_graph_hook.py:136-167) and never reaches decode.
        parsed = parse_cuda_graph_config_arg(json.dumps(cfg["cuda_graph_config"]))
        fields["cuda_graph_config"] = {phase: v for phase, v in parsed.items() if phase != "prefill"} or None
    # "dummy" is sglang's no-model path (pipeline.py:105-109). An explicit mem_fraction_static and prefill
    # max_bs keep handle_gpu_memory_settings from sizing memory by the model (memory_hook.py:233-343).
    cpu = {key: cfg[key] for key in ("enable_torch_compile", "torch_compile_max_bs") if cfg[key] is not None}
    return ServerArgs(model_path="dummy", device=cfg["device"] or "cuda", mem_fraction_static=0.9,
                      disable_prefill_cuda_graph=True, cuda_graph_max_bs_prefill=4096, **cpu, **fields)


def _speculative_defaults(record: Any) -> None:
    """Declare what handle_speculative_decoding decides about the algorithm name and max_running_requests.

    The handler needs the checkpoints (speculative_hook.py:121-284); the alias (:81-118) and the per-algorithm
    dispatch (spec_info.py:235-271) run for real, the handlers swapped for a recorder.
    """
    from unittest import mock

    from sglang.srt.arg_groups import speculative_hook
    from sglang.srt.arg_groups.overrides import declare_resolution, resolving_view
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    cfg = resolving_view(record)
    if cfg.speculative_algorithm is None:
        return
    name = speculative_hook._resolve_speculative_algorithm_alias(cfg.speculative_algorithm.upper(), None)
    declare_resolution(record, "handle_speculative_decoding", speculative_algorithm=name)
    called: list[str] = []
    with contextlib.ExitStack() as stack:
        for handler in _SPEC_HANDLERS:
            stack.enter_context(mock.patch.object(speculative_hook, handler,
                                                  lambda _args, _name=handler: called.append(_name)))
        SpeculativeAlgorithm.from_string(name).handle_server_args(record)
    if cfg.max_running_requests is None and any(h in _DEFAULTS_48_RUNNING for h in called):
        declare_resolution(record, called[0], max_running_requests=48)
    if "_handle_eagle_family" in called:
        # By hand, as _handle_eagle_family needs the model (speculative_hook.py:1159-1174, :1255-1266).
        if cfg.speculative_num_steps is None:
            raise ValueError("_handle_eagle_family picks --speculative-num-steps from the model "
                             "(_auto_choose_speculative_params): give it")
        if cfg.speculative_eagle_topk is None:
            raise ValueError("--speculative-eagle-topk is unset with --speculative-num-steps given")
        if cfg.speculative_eagle_topk == 1:
            declare_resolution(record, "_handle_eagle_family",
                               speculative_num_draft_tokens=cfg.speculative_num_steps + 1)


def _pool_size(configurator: type, max_running: int | None, attn_dp: int, kv_capacity: int | None,
               decode_bs: list[int]) -> int:
    """The request pool of one attention-DP rank: KVCacheConfigurator.resolve_max_num_reqs (:3119-3171).

    An unknown ``kv_capacity`` never binds; with no running limit either, the largest ladder size (cuts nothing).
    """
    if max_running is None and kv_capacity is None:
        return max(decode_bs)
    kv_configurator = SimpleNamespace(attn_dp_size=attn_dp, mambaish_config=None,
                                      model_config=SimpleNamespace(context_len=1))
    capacity = kv_capacity if kv_capacity is not None else 2**62
    return configurator.resolve_max_num_reqs(kv_configurator, capacity)


#: sglang's own ladder functions as a ladder source: chosen, run (in a child outside a server) and memoised.
OWN = OwnFunctions("sglang", "sglang", ResolutionError, resolve)
installed_version, main = OWN.installed_version, OWN.main


if __name__ == "__main__":
    sys.exit(main())
