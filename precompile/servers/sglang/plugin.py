"""The sglang plugin: drain the device and meet the TP ranks between the last capture warmup and the graph.

sglang's CUDA-graph backends end each warmup with ``post_warmup_hook()`` and then capture, with nothing draining
or meeting the ranks in between, so a compile still in flight lands inside capture (sglang #33356; the fix,
#33795 / #34286, is not in the room's ``VERSION``). :func:`register` wraps that hook. See ``docs/sglang.md``.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
import os
import sys
from collections.abc import Iterator
from typing import Any

from jitwarm.cache import settings
from jitwarm.precompile.servers import plugins
from jitwarm.precompile.servers.sglang import NAME
from jitwarm.precompile.servers.sglang.fields import SGLANG_NAMES

log = logging.getLogger(__name__)

ENABLE_ENV = "JITWARM_SGLANG_PLUGIN"
ENABLED = settings.flag_setting(ENABLE_ENV, "0 makes the sglang plugin inert (default on)", default=True)

#: Every CUDA-graph backend of sglang whose ``capture_one`` is wrapped (``full_cuda_graph_backend.py:159-182``,
#: ``breakable_cuda_graph_backend.py:121-127``, ``tc_piecewise_cuda_graph_backend.py:241-245``).
CAPTURE_BACKENDS = tuple(f"sglang.srt.model_executor.runner_backend.{module}.{cls}" for module, cls in (
    ("full_cuda_graph_backend", "FullCudaGraphBackend"),
    ("breakable_cuda_graph_backend", "BreakableCudaGraphBackend"),
    ("tc_piecewise_cuda_graph_backend", "TcPiecewiseCudaGraphBackend")))
#: Where the warm starts: the first thing a scheduler's model runner does, with ``server_args`` in hand and
#: before ``initialize()`` loads the weights (model_runner.py:344, :499), so compiles overlap weight loading.
MODEL_RUNNER = "sglang.srt.model_executor.model_runner.ModelRunner"
#: sglang's CPU graph runner (``--device cpu --enable-torch-compile``): one ``torch.compile`` per decode batch
#: size, compiled at capture (cpu_graph_runner.py:95-133, :817): the CPU form of the ladder.
CPU_RUNNER = "sglang.srt.model_executor.cpu_graph_runner.CPUGraphRunner"
_WHY = "the restore did not cover this graph: the node compiles it now"


class _Plan(plugins.PlanMode):
    """sglang's plan mode: the device drained and the TP ranks met through the current backend's own objects."""

    log = log
    server_keys = frozenset(SGLANG_NAMES) | {"ragged_verify_mode"}
    decides = "the server's own arguments (and SGLANG_RAGGED_VERIFY_MODE) decide"
    backend: Any = None

    def synchronize(self) -> None:
        """Drain through the backend's ``_device_module`` (``torch.cuda`` in a CUDA server)."""
        self.backend._device_module.synchronize()

    def barrier(self) -> None:
        """Meet the other TP ranks at the backend's ``_tp_group.barrier()``."""
        self.backend._tp_group.barrier()


_plan = _Plan()
_recorder: Any = None


def register() -> None:
    """The ``sglang.srt.plugins`` entry point: install the capture drain, and plan mode with ``JITWARM_CONFIG``.

    Logs one line: what it installed, or that it is inert. Raises only under ``JITWARM_STRICT=1`` (sglang logs it
    and runs on); an unusable ``JITWARM_CONFIG`` is then raised at model-runner start, which stops the server.
    """
    global _plan
    if not plugins.setting(log, ENABLED, True):
        log.info("jitwarm: sglang plugin inert (%s=0): nothing installed", ENABLE_ENV)
        return
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        hooked = [path for path in CAPTURE_BACKENDS if _hookable(path)]
        if not hooked:
            log.info("jitwarm: sglang plugin inert: no CUDA-graph backend of this sglang has capture_one("
                     "post_warmup_hook=...): nothing installed")
            return
        for path in hooked:
            HookRegistry.register(f"{path}.capture_one", _around_capture_one, HookType.AROUND)
        if _has(CPU_RUNNER, "capture_one_batch_size"):
            HookRegistry.register(f"{CPU_RUNNER}.capture_one_batch_size", _around_cpu_capture, HookType.AROUND)
        _record_and_serve()
        plugins.begin_ledger(log, _loader_calls)
        HookRegistry.register(f"{MODEL_RUNNER}.init_cuda_graphs", _around_init_cuda_graphs, HookType.AROUND)
        _plan = _Plan.from_settings()
        if _plan.active:  # the model-runner hook also raises a bad file under JITWARM_STRICT=1
            HookRegistry.register(f"{MODEL_RUNNER}.__init__", _around_model_runner_init, HookType.AROUND)
        what = "capture hook" if _plan.active and _plan.error is None else "drain (device synchronize + TP barrier)"
        log.info("jitwarm: sglang plugin installed: %s after every capture warmup of %s; %s; %s", what,
                 ", ".join(path.rsplit(".", 1)[1] for path in hooked), _plan.describe(), plugins.seal_line(NAME))
    except Exception as exc:
        plugins.failed(log, "installing the sglang plugin", exc)


def _loader_calls() -> dict[str, Any]:
    """The ledger's ``load_jit`` watcher (:class:`.loader.LoaderCalls`)."""
    from jitwarm.precompile.servers.sglang.loader import LoaderCalls

    return {"load_jit": LoaderCalls().install()}


def _record_and_serve() -> None:
    """``JITWARM_RECORD`` and ``TRITON_CACHE_MANAGER`` (:func:`.plugins.record_and_serve`)."""
    global _recorder
    _recorder = plugins.record_and_serve(log, _recorder, "Triton and load_jit kernel")


def _around_init_cuda_graphs(original: Any, runner: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook of ``ModelRunner.init_cuda_graphs`` (model_runner.py:1170): its last graph captured, the ledger.

    The target runner's, then the draft's (scheduler.py:1122-1126): the last report covers every graph.
    """
    graphs = original(runner, *args, **kwargs)
    plugins.report_ledger(log)
    return graphs


def _around_capture_one(original: Any, backend: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook of ``capture_one``, sealed: the server's ``post_warmup_hook`` (given or not), then the drain."""
    bound = inspect.signature(original).bind(backend, *args, **kwargs)  # positional, keyword or absent alike
    server_hook = bound.arguments.get("post_warmup_hook")
    if _plan.plan is not None and _plan.hook is None:
        _drain(backend)  # the hook's first call before the first warmup too, as capture_ladder does (hook.py)

    def post_warmup_hook() -> None:
        # sglang's runner chooses this hook (attn_backend.on_after_cuda_graph_warmup,
        # decode_cuda_graph_runner.py:1487-1504): it resets state the warmup mutated, so it runs, first.
        if server_hook is not None:
            server_hook()
        # After EVERY warmup, however many a backend runs; in tc-piecewise the second forward is the capture.
        _drain(backend)

    bound.arguments["post_warmup_hook"] = post_warmup_hook
    with plugins.sealed(log):
        graph = original(*bound.args, **bound.kwargs)
    if _recorder is not None:  # JITWARM_RECORD: store the JIT cache units compiled so far now; a server is
        _recorder.capture()    # stopped by a signal, so its recorder's stop and atexit never run
    return graph


def _around_cpu_capture(original: Any, runner: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook of ``CPUGraphRunner.capture_one_batch_size``: the guard armed; on a restored node, compiles named.

    Compiling is what a CPU graph's capture does (``torch.compile``), so only a node the restore filled (its
    receipt in the jitwarm cache root) should compile nothing: there each new C++ kernel is a warning, refused
    under ``JITWARM_STRICT=1`` (the start stops at that kernel, naming it).
    """
    from jitwarm.precompile import guard

    named: list[str] = []
    strict = settings.is_strict()
    with guard.capture_guard(), _restored_seal(named, strict) as sealed, _errors_raised(sealed and strict):
        graph = original(runner, *args, **kwargs)
    if named and strict:  # refused in the compile; a refusal something swallowed all the same stops the start here
        raise _refusal(named)
    if _recorder is not None:  # as after a CUDA graph: a stopped server runs no atexit
        _recorder.capture()
    return graph


def _refusal(named: list[str]) -> Exception:
    """The error that stops a restored node's strict start: the first kernel named, and how many so far."""
    from jitwarm.kernels.dispatch import CompileDuringCaptureError

    return CompileDuringCaptureError(named[0], f" (sglang's CPU graph capture on a restored node: {_WHY}; "
                                     f"{len(named)} such)", hint="Capture the server's line with this ladder "
                                     "(the same --torch-compile-max-bs) and restore that bundle.")


@contextlib.contextmanager
def _errors_raised(refusing: bool) -> Iterator[None]:
    """Where the seal refuses: torch._dynamo's ``suppress_errors`` off for the block.

    sglang sets it with --enable-torch-compile (srt/layers/attention/flashinfer_backend.py:71-73), which turns an
    error inside a compile into a silent eager fallback: a refusal raised inside the compile then came back only
    after the whole batch size had compiled (12 graphs of the test model, 37 s on a 2-core box). Off, the refusal
    stops the start at the first kernel the restore lacks.
    """
    config = sys.modules.get("torch._dynamo.config")
    if not refusing or config is None:
        yield
        return
    with config.patch(suppress_errors=False):
        yield


def _restored() -> bool:
    """True where a restore filled this node: its receipt is in the jitwarm cache root."""
    from jitwarm.kernels.libraries.jit_caches import receipt

    return receipt.read(settings.cache_dir()) is not None


@contextlib.contextmanager
def _restored_seal(named: list[str], strict: bool) -> Iterator[bool]:
    """On a restored node, each new Inductor C++ kernel written in the block is named (``named``): warned, or refused.

    Refused under ``strict``, before it is written. Yields whether the seal is armed.

    Not each Inductor lowering: sglang's CPU runner freezes the weights into its graphs (``freezing=True``,
    cpu_graph_runner.py:125), and Inductor lowers such a graph again at every start, warm or restored, writing a
    new Python wrapper (it names the weights' addresses); its C++ kernels are found in the cache, nothing is
    compiled. A kernel source the cache lacks (``codecache.write`` of a ``.cpp`` not there) is a compile.
    """
    if "torch" not in sys.modules or not _restored():
        yield False
        return
    # torch.compile imports Inductor at the first compile, inside the first (largest) graph's capture: the
    # module the compile will import, imported now, so that graph is watched too.
    try:
        codecache = importlib.import_module("torch._inductor.codecache")
    except Exception as exc:  # the seal only watches: a failure to arm it never takes the capture away
        plugins.failed(log, "arming the CPU capture seal", exc)
        codecache = None
    if not callable(getattr(codecache, "write", None)):
        yield False
        return
    from jitwarm.kernels.tap import replace

    original = codecache.write

    def write(content: Any, extension: str, extra: str = "", hash_type: str = "code", specified_dir: str = "",
              key: str | None = None) -> Any:
        if extension.endswith("cpp"):
            digest = key or codecache.get_hash(content.strip(), extra, hash_type)
            path = codecache.get_path(digest, extension, specified_dir)[2]
            if not os.path.exists(path):  # noqa: PTH110 - Inductor's own test (codecache.write)
                what = f"Inductor C++ kernel {os.path.basename(path)}"  # noqa: PTH119
                named.append(what)
                if strict:
                    raise _refusal(named)
                log.warning("jitwarm: %s compiled during sglang's CPU graph capture on a restored node: %s; "
                            "JITWARM_STRICT=1 refuses it", what, _WHY)
        return original(content, extension, extra, hash_type, specified_dir, key)

    write.__wrapped__ = original  # type: ignore[attr-defined]
    try:
        undo = replace(codecache, "write", write)
    except Exception as exc:  # the seal only watches: a failure to arm it never takes the capture away
        plugins.failed(log, "arming the CPU capture seal", exc)
        undo = None
    try:
        yield undo is not None
    finally:
        if undo is not None:
            undo()


def _drain(backend: Any) -> None:
    """The capture hook or the plain drain, through ``backend``.

    sglang configures logging after load_plugins (scheduler.py:6323,6336), so the first drain says it is active.
    """
    _plan.backend = backend
    _plan.drain(type(backend).__name__, "after every warmup")


def _around_model_runner_init(original: Any, runner: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook of ``ModelRunner.__init__``: start the plan's warm (families from its ``model_config``)."""
    try:
        arguments = inspect.signature(original).bind_partial(runner, *args, **kwargs).arguments
        names = getattr(getattr(arguments.get("model_config"), "hf_config", None), "architectures", None)
        architecture = names[0] if isinstance(names, (list, tuple)) and names and isinstance(names[0], str) else None
        server_args = arguments["server_args"]
        _plan.start(lambda: _server_fields(server_args, architecture), _local_ranks(server_args))
    except Exception as exc:
        plugins.failed(log, "starting the warm at model-runner start", exc)
    return original(runner, *args, **kwargs)


def _has(path: str, method: str) -> bool:
    """True when the class at ``path`` imports here and has ``method``."""
    import pkgutil

    try:
        return callable(getattr(pkgutil.resolve_name(path), method, None))
    except Exception as exc:  # noqa: BLE001 - absent or broken: not hooked
        log.debug("jitwarm: %s not hooked (%s: %s)", path, type(exc).__name__, exc)
        return False


def _hookable(path: str) -> bool:
    """True when the class at ``path`` exists here and its ``capture_one`` takes ``post_warmup_hook``."""
    import pkgutil

    try:
        capture_one = getattr(pkgutil.resolve_name(path), "capture_one", None)
    except (ImportError, AttributeError) as exc:
        log.debug("jitwarm: %s not in this sglang (%s): skipped", path, exc)
        return False
    except Exception as exc:  # present but broken: say so, and hook the others
        log.warning("jitwarm: importing %s failed (%s: %s): not hooked", path, type(exc).__name__, exc)
        return False
    if capture_one is None or "post_warmup_hook" not in inspect.signature(capture_one).parameters:
        log.debug("jitwarm: %s has no capture_one(post_warmup_hook=...): skipped", path)
        return False
    return True


def _server_fields(server_args: Any, architecture: str | None) -> dict[str, Any]:
    """The ServingConfig fields of ``server_args`` (its raw capture settings, as given) and the architecture."""
    given = {name: getattr(server_args, sglang, None) for name, sglang in SGLANG_NAMES.items()}
    if not isinstance(given["model_path"], str):
        given["model_path"] = None
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in given.items() if v is not None}
    return {**fields, "model_architecture": architecture} if architecture else fields


def _local_ranks(server_args: Any) -> int:
    """The scheduler ranks of this node: TP x PP x DP replicas (DP attention runs inside TP) / nodes."""
    def arg(name: str) -> int:
        value = getattr(server_args, name, 1)
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 1

    replicas = 1 if getattr(server_args, "enable_dp_attention", False) else arg("dp_size")
    return max(1, arg("tp_size") * arg("pp_size") * replicas // arg("nnodes"))
