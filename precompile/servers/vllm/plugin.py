"""The vLLM plugin: drain the device and meet the TP ranks between each graph's last warmup and its capture.

vLLM (the room's ``VERSION``; the lines cited are its) captures each graph after one eager warmup. The V2 model
runner, the default of the release (``config/vllm.py:731-766``), runs ``CudaGraphManager.capture``
(``v1/worker/gpu/cudagraph_utils.py:424-515``): per graph a warmup forward, then the capture, with neither a
device synchronize nor a TP barrier between them. The V1 runner (``VLLM_USE_V2_MODEL_RUNNER=0``) runs
``_warmup_and_capture`` (``v1/worker/gpu_model_runner.py:6523-6575``): the warmup, a synchronize (:6550), the
capturing ``_dummy_run``, and no barrier. A compile or module load still in flight on one rank (vLLM #40742,
#42241) lands inside that rank's capture. Loaded through the ``vllm.general_plugins`` entry point ``jitwarm``
in every vLLM process (``plugins/__init__.py:16-40``; ``VLLM_PLUGINS`` filters), :func:`register` wraps, once
either module is imported, the V2 manager's ``capture`` and the V1 runner's ``_dummy_run``: vLLM's own code runs
as before, and right before each capture the device is drained and the TP group meets. With
``JITWARM_CONFIG=FILE.toml`` (or ``JITWARM_MANIFEST``) that point runs jitwarm's
:class:`~jitwarm.precompile.hook.CaptureHook` for the plan of the server's own capture settings, warmed in the
background from model-runner start. The start-up ledger (:mod:`jitwarm.precompile.ledger`) takes its snapshot
when the plugin loads and reports after each runner's ``capture_model`` (the worker's last capture,
``v1/worker/gpu_worker.py:992-994``); with ``JITWARM_RECORD`` the JIT cache units compiled so far are stored
after each graph and after ``capture_model``. See ``docs/vllm.md``.
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
from jitwarm.precompile.servers.vllm import plan_mode

log = logging.getLogger(__name__)

ENABLE_ENV = settings.ENV_VARS["vllm_plugin"]  # 0: inert
TRITON_MANAGER = "jitwarm.kernels.libraries.triton.cache:CacheManager"
V2_GRAPHS = ("vllm.v1.worker.gpu.cudagraph_utils", "CudaGraphManager")
V1_RUNNER = ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner")
V2_RUNNER = ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner")
_WRAPPED = "__jitwarm_wrapped__"


def register() -> None:
    """The ``vllm.general_plugins`` entry point: install the capture drain (and plan mode) where vLLM captures.

    vLLM calls it in every process that loads plugins (the API server, the engine core, every worker, before
    the model loads: ``v1/worker/worker_base.py:287-289``). Nothing is imported here: the wraps are applied when
    vLLM imports its runner modules, which only a worker does. Logs one line: what it installed, or that it is
    inert. A failure of its own setup is logged (raised under ``JITWARM_STRICT=1``).
    """
    if not plan_mode.setting(settings.vllm_plugin, True):
        log.info("jitwarm: vllm plugin inert (%s=0): nothing installed", ENABLE_ENV)
        return
    try:
        _record_and_serve()
        _begin_ledger()
        plan_mode.configure()
        for module, cls, attribute, wrap in _TARGETS:
            after_import(module, lambda m, c=cls, a=attribute, w=wrap: _wrap(getattr(m, c, None), a, w))
        log.info("jitwarm: vllm plugin installed: device synchronize + TP barrier before every CUDA-graph capture "
                 "(%s.%s.capture, %s.%s._dummy_run); %s", *V2_GRAPHS, *V1_RUNNER, plan_mode.describe())
    except Exception as exc:
        plan_mode.failed("installing the vllm plugin", exc)


_recorder: Any = None


def _record_and_serve() -> None:
    """``JITWARM_RECORD``: start recording; and route Triton's compiles through jitwarm's cache (one per fleet).

    ``TRITON_CACHE_MANAGER`` is set only when the user has not chosen a manager (``JITWARM_TRITON_CACHE=0`` keeps
    Triton's own); vLLM's workers inherit it from the engine process that loaded the plugin first.
    """
    global _recorder
    path = plan_mode.setting(settings.record, None)
    if path and _recorder is None:
        from jitwarm.precompile.recording import record

        _recorder = record(path)
        log.info("jitwarm: recording every Triton kernel and JIT cache unit this process compiles into %s", path)
    if plan_mode.setting(settings.triton_cache, True) and not os.environ.get("TRITON_CACHE_MANAGER"):
        os.environ["TRITON_CACHE_MANAGER"] = TRITON_MANAGER


def _begin_ledger() -> None:
    """Take the start-up ledger's snapshot now: before the model loads, so every compile of the start counts."""
    try:
        from jitwarm.precompile import ledger

        ledger.begin()
    except Exception as exc:  # the ledger only reports: it never takes the drain away
        log.warning("jitwarm: start-up ledger off: %s: %s", type(exc).__name__, exc)


def _store_units() -> None:
    """``JITWARM_RECORD``: store the JIT cache units compiled so far, after each capture.

    A vLLM worker is stopped by a signal, so its recorder's stop and atexit may never run (as in sglang).
    """
    if _recorder is not None:
        _recorder.capture()


def before_capture(owner: Any) -> None:
    """Right before a capture: the plan's capture hook in plan mode, else drain the device and meet the TP group.

    vLLM's own device call (``torch.accelerator.synchronize()``, as its capture code uses) and its own TP group
    (``vllm.distributed.parallel_state.get_tp_group()``, whose ``barrier`` meets on the CPU group).
    """
    if plan_mode.run_hook():
        return
    synchronize()
    barrier()
    plan_mode.say_once(f"jitwarm: capture drain active in {type(owner).__name__}: device synchronize + TP "
                       "barrier before every capture")


def synchronize() -> None:
    """Drain the device as vLLM's capture code does."""
    import torch

    torch.accelerator.synchronize()


def barrier() -> None:
    """Meet the other TP ranks at vLLM's TP group."""
    from vllm.distributed.parallel_state import get_tp_group

    get_tp_group().barrier()


def _capture(original: Callable[..., Any]) -> Callable[..., Any]:
    """``CudaGraphManager.capture``: its forward factory wrapped so each capture is preceded by :func:`before_capture`.

    Per graph vLLM calls ``create_forward_fn(desc, warmup=True)`` and runs the warmup (``forward_fn(NONE)``);
    then a non-breakable PIECEWISE graph is captured by ``forward_fn(PIECEWISE)`` of that same function, every
    other one by a fresh ``create_forward_fn(desc, warmup=False)`` whose inputs are prepared before
    ``torch.cuda.CUDAGraph()`` (cudagraph_utils.py:462-512). So the drain runs after the fresh factory returns,
    or when the warmup's function is called with a capturing mode.
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

        graphs = original(self, create, *args, **kwargs)
        _store_units()
        return graphs
    return capture


def _dummy_run(original: Callable[..., Any]) -> Callable[..., Any]:
    """V1 ``GPUModelRunner._dummy_run``: :func:`before_capture` before the capturing call (``is_graph_capturing``).

    ``_warmup_and_capture`` makes it after the warmups and vLLM's own synchronize (gpu_model_runner.py:6550-6567);
    every other dummy run (profiling, kernel warmup) passes through untouched.
    """
    signature = inspect.signature(original)

    def dummy_run(self: Any, *args: Any, **kwargs: Any) -> Any:
        capturing = signature.bind(self, *args, **kwargs).arguments.get("is_graph_capturing")
        if capturing:
            before_capture(self)
        out = original(self, *args, **kwargs)
        if capturing:
            _store_units()
        return out
    return dummy_run


def _capture_model(original: Callable[..., Any]) -> Callable[..., Any]:
    """A runner's ``capture_model``: vLLM's own, then the units it compiled stored and the start-up ledger reported.

    The worker calls it once, after the kernel warmup (``v1/worker/gpu_worker.py:982-994``); the V2 runner's
    memory profiling calls it with ``profile_only=True`` first (``v1/worker/gpu/cudagraph_utils.py:1000``), which
    captures graphs it throws away: that call reports nothing.
    """
    def capture_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        if kwargs.get("profile_only"):
            return out
        _store_units()
        try:
            from jitwarm.precompile import ledger

            ledger.report_after_capture()
        except Exception as exc:  # the worker has its graphs: a ledger that fails is said, never fatal
            log.warning("jitwarm: start-up ledger failed: %s: %s", type(exc).__name__, exc)
        return out
    return capture_model


def _runner_init(original: Callable[..., Any]) -> Callable[..., Any]:
    """A model runner's ``__init__``: plan mode starts its warm from the runner's ``vllm_config`` first."""
    signature = inspect.signature(original)

    def init(self: Any, *args: Any, **kwargs: Any) -> Any:
        if plan_mode.active():
            try:
                plan_mode.start(signature.bind(self, *args, **kwargs).arguments.get("vllm_config"), type(self))
            except Exception as exc:
                plan_mode.failed("starting the warm at model-runner start", exc)
        return original(self, *args, **kwargs)
    return init


_TARGETS = ((*V2_GRAPHS, "capture", _capture), (*V1_RUNNER, "_dummy_run", _dummy_run),
            (*V2_RUNNER, "__init__", _runner_init), (*V1_RUNNER, "__init__", _runner_init),
            (*V2_RUNNER, "capture_model", _capture_model), (*V1_RUNNER, "capture_model", _capture_model))


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
    """Finds nothing itself: a module with pending wraps is found by the other finders, wrapped once executed.

    So no runner module is imported before vLLM imports it.
    """

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
                    plan_mode.failed(f"wrapping {fullname}", exc)

        loader.exec_module = exec_and_wrap  # type: ignore[method-assign]
        return spec
