"""The sglang plugin: drain the device and meet the TP ranks between the last capture warmup and the graph.

The CUDA-graph backends of sglang (the room's ``VERSION``; the lines cited are its) run, per shape, two
iterations of {synchronize, TP barrier, forward, ``post_warmup_hook()``} and then create the graph
(``full_cuda_graph_backend.py:159-182``, ``breakable_cuda_graph_backend.py:121-127``; in
``tc_piecewise_cuda_graph_backend.py:241-245`` the second forward is the capture). Nothing drains the device
or meets the other ranks after the last warmup, so a compile or module load still in flight lands inside
capture (sglang #33356; the fix, #33795 / #34286, is not in that release). Loaded through the
``sglang.srt.plugins`` entry point ``jitwarm`` (``SGLANG_PLUGINS=jitwarm``), :func:`register` wraps every
backend's ``post_warmup_hook``: the server's own hook, then the drain. With ``JITWARM_CONFIG=FILE.toml`` the
drain is a :class:`~jitwarm.precompile.hook.CaptureHook` for the plan of the server's own capture settings,
warmed in the background from model-runner start. After each model runner's ``init_cuda_graphs`` (its last
graph captured) the start-up ledger (:mod:`jitwarm.precompile.ledger`) says per family what was served from
cache and what still compiled, and writes it to ``JITWARM_LEDGER``. See ``docs/sglang.md``.
"""

from __future__ import annotations

import inspect
import logging
import os
from typing import Any

from jitwarm.cache import settings

log = logging.getLogger(__name__)

# The variables the plugin reads, each through its accessor in jitwarm.cache.settings (named here for messages):
# JITWARM_SGLANG_PLUGIN (0: inert), JITWARM_CONFIG (plan mode), JITWARM_MANIFEST (recorded kernels loaded before
# capture too), JITWARM_RECORD (record every kernel compiled), JITWARM_TRITON_CACHE (0: Triton's own manager),
# JITWARM_LEDGER (the start-up ledger's JSON, read by jitwarm.precompile.ledger).
ENABLE_ENV, CONFIG_ENV, MANIFEST_ENV = (settings.ENV_VARS[name] for name in ("sglang_plugin", "config", "manifest"))
TRITON_MANAGER = "jitwarm.kernels.libraries.triton.cache:CacheManager"

#: Every CUDA-graph backend of sglang whose ``capture_one`` is wrapped (runner_backend/, lines above).
CAPTURE_BACKENDS = tuple(f"sglang.srt.model_executor.runner_backend.{module}.{cls}" for module, cls in (
    ("full_cuda_graph_backend", "FullCudaGraphBackend"),
    ("breakable_cuda_graph_backend", "BreakableCudaGraphBackend"),
    ("tc_piecewise_cuda_graph_backend", "TcPiecewiseCudaGraphBackend")))
#: Where the warm starts: the first thing a scheduler's model runner does, with ``server_args`` in hand and
#: before ``initialize()`` loads the weights (model_runner.py:344, :499), so compiles overlap weight loading.
MODEL_RUNNER = "sglang.srt.model_executor.model_runner.ModelRunner"


class _BackendDevice:
    """The capture hook's device: this process's build target, drained through the current backend's own objects."""

    def __init__(self) -> None:
        import torch

        from jitwarm.kernels import dispatch

        # No CUDA in this torch (a CPU box, the tests): the host build target, "cpu".
        self.target = dispatch.target_of(torch.device("cuda", torch.cuda.current_device())
                                         if torch.cuda.is_available() else "cpu")
        self.backend: Any = None

    def synchronize(self) -> None:
        """Drain through the backend's ``_device_module`` (``torch.cuda`` in a CUDA server)."""
        self.backend._device_module.synchronize()

    def barrier(self) -> None:
        """Meet the other TP ranks at the backend's ``_tp_group.barrier()``."""
        self.backend._tp_group.barrier()


class _Plan:
    """Plan mode of one process: the file's fields, then the plan, its background warm and its capture hook."""

    def __init__(self, path: str | None, manifest: str | None = None) -> None:
        self.fields = self.error = self.plan = self.warm = self.hook = self.device = None
        self.manifest = manifest
        self.jobs = 1
        try:
            self.fields = _file_fields(path) if path else None
        except Exception as exc:
            self.error = _failed(f"reading {CONFIG_ENV}={path}", exc, fatal_later=True)

    def start(self, server_args: Any, architecture: str | None = None) -> None:
        """Build the plan from ``server_args`` plus the file and start its warm (once per process).

        ``architecture`` is the model's, as the runner's ``model_config`` has read it from the checkpoint: it
        decides which of jitwarm's kernel families the plan holds (:mod:`.model`).
        """
        if self.error is not None and _strict():
            raise self.error  # JITWARM_STRICT=1: a bad config file stops the scheduler here
        if self.plan is not None or (self.fields is None and self.manifest is None) or self.error is not None:
            return
        from jitwarm.precompile.plan import WarmPlan
        from jitwarm.precompile.warming import start_warm

        if self.fields is not None:
            fields = {"model_architecture": architecture, **self.fields} if architecture else self.fields
            plan = WarmPlan.build(_config(server_args, fields))
            targets = plan.config.targets
        else:  # JITWARM_MANIFEST alone: the server's recorded kernels only, for this process's target
            plan, targets = WarmPlan.empty(), (_BackendDevice().target,)
        if self.manifest:
            plan = plan.with_manifests([self.manifest], targets)
        self.jobs, cores, ranks = _jobs(server_args)
        self.warm, self.plan = start_warm(plan, jobs=self.jobs), plan
        log.info("jitwarm: plan %s: %d specs (%d recorded) for %s; warming in the background with %d jobs (%d cores "
                 "/ %d local ranks); model: %s", plan.plan_id, len(plan.specs), len(plan.recorded), ", ".join(targets),
                 self.jobs, cores, ranks, plan.families.why if plan.families else "none (recorded kernels only)")

    def drain(self, backend: Any) -> bool:
        """Run the capture hook through ``backend``; False when plan mode is off (or failed) in this process."""
        if self.plan is None:
            return False
        from jitwarm.precompile.hook import CaptureHook

        try:
            if self.hook is None:
                self.device = _BackendDevice()
                self.hook = CaptureHook(self.plan, device=self.device, barrier=self.device.barrier,
                                        warm=self.warm, jobs=self.jobs)
            self.device.backend = backend
            report = self.hook()
            if report.first:
                warm = self.warm.join(0)  # the hook joined it: done
                log.info("jitwarm: capture hook ready: plan %s, %d specs loaded on %s after %.2fs (background "
                         "warm: built %d, waited %d, hits %d); guard armed", self.plan.plan_id, report.loaded,
                         report.target, report.seconds, warm.built, warm.waited, warm.hits)
        except Exception as exc:
            _failed(f"capture hook for plan {self.plan.plan_id}", exc)
            self.plan = None  # each rank still drains and meets (the caller), so the barrier counts stay equal
            return False
        return True


_plan: _Plan | None = None
_drained = False


def register() -> None:
    """The ``sglang.srt.plugins`` entry point: install the capture drain, and plan mode with ``JITWARM_CONFIG``.

    sglang's ``load_plugins()`` calls it in every process that loads plugins; only a scheduler starts a model
    runner and captures, so only there does anything run. Logs one line: what it installed, or that it is inert.
    Raises only under ``JITWARM_STRICT=1`` (sglang logs it and runs on); an unusable ``JITWARM_CONFIG`` is then
    raised when the scheduler starts its model runner, which stops the server.
    """
    global _plan
    if not _setting(settings.sglang_plugin, True):
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
        names = ", ".join(path.rsplit(".", 1)[1] for path in hooked)
        _record_and_serve()
        _begin_ledger()
        HookRegistry.register(f"{MODEL_RUNNER}.init_cuda_graphs", _around_init_cuda_graphs, HookType.AROUND)
        config = str(_setting(settings.config, None) or "")
        manifest = str(_setting(settings.manifest, None) or "")
        if config or manifest:  # the model-runner hook also raises a bad file under JITWARM_STRICT=1
            _plan = _Plan(config or None, manifest or None)
            HookRegistry.register(f"{MODEL_RUNNER}.__init__", _around_model_runner_init, HookType.AROUND)
        if _plan is not None and _plan.error is None:
            log.info("jitwarm: sglang plugin installed: capture hook after every capture warmup of %s; plan from "
                     "%s=%s with the server's capture settings and %s=%s, warmed from model-runner start", names,
                     CONFIG_ENV, config or "(unset)", MANIFEST_ENV, manifest or "(unset)")
        else:
            log.info("jitwarm: sglang plugin installed: drain (device synchronize + TP barrier) after every capture "
                     "warmup of %s; no plan (%s %s)", names, CONFIG_ENV, "unusable, see above" if config else "unset")
    except Exception as exc:
        _failed("installing the sglang plugin", exc)


_recorder: Any = None


def _record_and_serve() -> None:
    """``JITWARM_RECORD``: start recording; and make Triton's compiles go through jitwarm's cache (one per fleet).

    ``TRITON_CACHE_MANAGER`` is set only when the user has not chosen a manager (``JITWARM_TRITON_CACHE=0``
    keeps Triton's own); Triton reads it at each compile, and the scheduler's children inherit it.
    """
    global _recorder
    path = _setting(settings.record, None)
    if path and _recorder is None:
        from jitwarm.precompile.recording import record

        _recorder = record(path)
        log.info("jitwarm: recording every Triton and load_jit kernel this process compiles into %s", path)
    if _setting(settings.triton_cache, True) and not os.environ.get("TRITON_CACHE_MANAGER"):
        os.environ["TRITON_CACHE_MANAGER"] = TRITON_MANAGER


def _begin_ledger() -> None:
    """Take the start-up ledger's snapshot now: before the model loads, so every compile of the start counts."""
    try:
        from jitwarm.precompile import ledger
        from jitwarm.precompile.servers.sglang.loader_calls import LoaderCalls

        ledger.begin({"load_jit": LoaderCalls().install()})
    except Exception as exc:  # the ledger only reports: it never takes the drain away
        log.warning("jitwarm: start-up ledger off: %s: %s", type(exc).__name__, exc)


def _around_init_cuda_graphs(original: Any, runner: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook of ``ModelRunner.init_cuda_graphs`` (model_runner.py:1170): its last graph captured, the ledger.

    sglang's scheduler calls it for the target runner, then the draft's (scheduler.py:1122-1126): each reports
    everything since the start, so the last report, and ``JITWARM_LEDGER``, covers every graph.
    """
    graphs = original(runner, *args, **kwargs)
    try:
        from jitwarm.precompile import ledger

        ledger.report_after_capture()
    except Exception as exc:  # the server has its graphs: a ledger that fails is said, never fatal
        log.warning("jitwarm: start-up ledger failed: %s: %s", type(exc).__name__, exc)
    return graphs


def _around_capture_one(original: Any, backend: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook of ``capture_one``: the server's ``post_warmup_hook`` (given or not) followed by the drain."""
    bound = inspect.signature(original).bind(backend, *args, **kwargs)  # positional, keyword or absent alike
    server_hook = bound.arguments.get("post_warmup_hook")
    if _plan is not None and _plan.plan is not None and _plan.hook is None:
        _drain(backend)  # the hook's first call before the first warmup too, as capture_ladder does (hook.py)

    def post_warmup_hook() -> None:
        # sglang's runner chooses this hook (attn_backend.on_after_cuda_graph_warmup,
        # decode_cuda_graph_runner.py:1487-1504): it resets state the warmup mutated, so it runs, first.
        if server_hook is not None:
            server_hook()
        # Drain after EVERY warmup, not only the last: then the last warmup's work is drained and all ranks have
        # met before capture starts, however many warmups a backend runs (two in VERSION). In tc-piecewise the
        # second forward is the capture: the drain (the hook, in plan mode) after the first is the one before it.
        _drain(backend)

    bound.arguments["post_warmup_hook"] = post_warmup_hook
    graph = original(*bound.args, **bound.kwargs)
    if _recorder is not None:  # JITWARM_RECORD: store the JIT cache units compiled so far now; a server is
        _recorder.capture()    # stopped by a signal, so its recorder's stop and atexit never run
    return graph


def _drain(backend: Any) -> None:
    """The capture hook in plan mode, else (or if it failed) the backend's own synchronize and TP barrier."""
    global _drained
    if _plan is not None and _plan.drain(backend):
        return
    backend._device_module.synchronize()
    backend._tp_group.barrier()
    if not _drained:  # sglang configures logging after load_plugins (scheduler.py:6323,6336): say it here too
        _drained = True
        log.info("jitwarm: capture drain active in %s: device synchronize + TP barrier after every warmup",
                 type(backend).__name__)


def _around_model_runner_init(original: Any, runner: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook of ``ModelRunner.__init__``: start the plan's warm, then construct the runner."""
    if _plan is not None:
        try:
            arguments = inspect.signature(original).bind_partial(runner, *args, **kwargs).arguments
            hf_config = getattr(arguments.get("model_config"), "hf_config", None)
            names = getattr(hf_config, "architectures", None)
            known = isinstance(names, (list, tuple)) and names and isinstance(names[0], str)
            architecture = names[0] if known else None
            _plan.start(arguments["server_args"], architecture)
        except Exception as exc:
            _failed("starting the warm at model-runner start", exc)
    return original(runner, *args, **kwargs)


def _hookable(path: str) -> bool:
    """True when the class at ``path`` exists here and its ``capture_one`` takes ``post_warmup_hook``."""
    import pkgutil

    try:
        cls = pkgutil.resolve_name(path)
    except (ImportError, AttributeError) as exc:
        log.debug("jitwarm: %s not in this sglang (%s): skipped", path, exc)
        return False
    except Exception as exc:  # present but broken: say so, and hook the others
        log.warning("jitwarm: importing %s failed (%s: %s): not hooked", path, type(exc).__name__, exc)
        return False
    capture_one = getattr(cls, "capture_one", None)
    if capture_one is None or "post_warmup_hook" not in inspect.signature(capture_one).parameters:
        log.debug("jitwarm: %s has no capture_one(post_warmup_hook=...): skipped", path)
        return False
    return True


def _config(server_args: Any, fields: dict[str, Any]) -> Any:
    """The ServingConfig of ``server_args`` (its raw capture settings, as given) and the file's ``fields``.

    The verify mode is read from the environment, as sglang does.
    """
    from jitwarm.precompile.config import ServingConfig
    from jitwarm.precompile.servers.sglang.fields import SERVER_ARGS_FIELDS

    given = {name: getattr(server_args, name, None) for name in SERVER_ARGS_FIELDS}
    if not isinstance(given["model_path"], str):
        given["model_path"] = None
    given = {k: tuple(v) if isinstance(v, list) else v for k, v in given.items() if v is not None}
    return ServingConfig(**{**given, **fields})


def _file_fields(path: str) -> dict[str, Any]:
    """The JITWARM_CONFIG file's fields (model dims, backends, targets); capture settings are the server's."""
    from jitwarm.precompile.config_sources import read_config_file
    from jitwarm.precompile.servers.sglang.fields import SERVER_ARGS_FIELDS

    fields = read_config_file(path)
    server = sorted(set(fields) & (SERVER_ARGS_FIELDS | {"ragged_verify_mode"}))
    if server:
        log.warning("jitwarm: %s sets %s: ignored, the server's own arguments (and SGLANG_RAGGED_VERIFY_MODE) "
                    "decide what is captured", path, ", ".join(server))
    return {k: v for k, v in fields.items() if k not in server}


def _jobs(server_args: Any) -> tuple[int, int, int]:
    """``(jobs, cores, local ranks)``: JITWARM_JOBS if set, else the cores shared by this node's scheduler ranks.

    Every local rank starts the same warm (the cache builds each spec once per host, the other ranks wait), so
    each gets ``cores // local ranks`` builders, at least 1: together they never oversubscribe the host.
    """
    def arg(name: str) -> int:
        value = getattr(server_args, name, 1)
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 1

    replicas = 1 if getattr(server_args, "enable_dp_attention", False) else arg("dp_size")  # DP attention: in TP
    ranks, cores = max(1, arg("tp_size") * arg("pp_size") * replicas // arg("nnodes")), os.cpu_count() or 1
    jobs = settings.jobs() if settings.jobs_set() else max(1, cores // ranks)
    return jobs, cores, ranks


def _strict() -> bool:
    """JITWARM_STRICT, read now (a value that does not parse counts as strict: the user asked for something)."""
    try:
        return settings.strict()
    except settings.SettingError:
        return True


def _setting(accessor: Any, fallback: Any) -> Any:
    """A setting read through its accessor; one that does not parse is logged (raised under strict).

    Then ``fallback``, the plugin's default, is taken: a typo in one variable must not take the drain away.
    """
    try:
        return accessor()
    except settings.SettingError as exc:
        _failed("reading a setting", exc)
        return fallback


def _failed(what: str, exc: Exception, fatal_later: bool = False) -> Exception:
    """Log a failure of the plugin's own setup; re-raise it under JITWARM_STRICT=1 unless that comes later."""
    if _strict() and not fatal_later:
        raise exc
    log.error("jitwarm: %s failed: %s: %s; the capture drain stays installed (JITWARM_STRICT=1 makes this fatal)",
              what, type(exc).__name__, exc)
    return exc
