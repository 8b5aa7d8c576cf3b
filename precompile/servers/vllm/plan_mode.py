"""The vLLM plugin's plan mode: the plan of the server's own capture settings, its background warm, its hook.

``JITWARM_CONFIG=FILE.toml`` names the model dims, kernel backends and build targets (the keys of ``jitwarm
--config``); the capture settings come from the ``vllm_config`` the model runner is built with, so nothing is
said twice. ``JITWARM_MANIFEST`` adds the server's recorded kernels (alone, it is the whole plan). At model-runner
start (:func:`start`) each worker builds the plan and starts its warm, so compiles overlap weight loading; at the
first capture (:func:`run_hook`) the :class:`~jitwarm.precompile.hook.CaptureHook` joins the warm, loads every
kernel, puts it on the device, synchronizes, meets the TP ranks and arms the guard; later captures only
synchronize and meet. A failure is logged and the plain drain runs instead (fatal under ``JITWARM_STRICT=1``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from jitwarm.cache import settings

log = logging.getLogger("jitwarm.precompile.servers.vllm.plugin")

CONFIG_ENV, MANIFEST_ENV = (settings.ENV_VARS[name] for name in ("config", "manifest"))
#: The capture settings of a ``vllm_config`` a plan reads (config file keys naming them are ignored).
_SERVER_KEYS = frozenset({"max_running_requests", "tp_size", "gpu_memory_mb", "server", "server_options",
                          "model_path", "model_architecture"})


class _Device:
    """The capture hook's device: this worker's build target, drained and met as the plugin's plain drain does."""

    def __init__(self) -> None:
        import torch

        from jitwarm.kernels import dispatch

        self.target = dispatch.target_of(torch.device("cuda", torch.cuda.current_device())
                                         if torch.cuda.is_available() else "cpu")

    def synchronize(self) -> None:
        from jitwarm.precompile.servers.vllm import plugin

        plugin.synchronize()

    def barrier(self) -> None:
        from jitwarm.precompile.servers.vllm import plugin

        plugin.barrier()


class _State:
    config: str | None = None
    manifest: str | None = None
    fields: dict[str, Any] | None = None
    error: Exception | None = None
    plan: Any = None
    warm: Any = None
    hook: Any = None
    jobs: int = 1
    said: bool = False


_state = _State()


def configure() -> None:
    """Read ``JITWARM_CONFIG`` and ``JITWARM_MANIFEST`` (each through jitwarm.cache.settings) at plugin load."""
    _state.config = str(setting(settings.config, None) or "") or None
    _state.manifest = str(setting(settings.manifest, None) or "") or None
    if _state.config:
        try:
            from jitwarm.precompile.config_sources import read_config_file

            fields = read_config_file(_state.config)
            ignored = sorted(set(fields) & _SERVER_KEYS)
            if ignored:
                log.warning("jitwarm: %s sets %s: ignored, the server's own vllm_config decides what is captured",
                            _state.config, ", ".join(ignored))
            _state.fields = {k: v for k, v in fields.items() if k not in _SERVER_KEYS}
        except Exception as exc:
            _state.error = failed(f"reading {CONFIG_ENV}={_state.config}", exc, fatal_later=True)


def describe() -> str:
    """How the plugin was configured, for its one log line."""
    if _state.config is None and _state.manifest is None:
        return f"no plan ({CONFIG_ENV} unset)"
    if _state.error is not None:
        return f"no plan ({CONFIG_ENV} unusable, see above)"
    return (f"capture hook for the plan from {CONFIG_ENV}={_state.config or '(unset)'} and {MANIFEST_ENV}="
            f"{_state.manifest or '(unset)'} with the server's capture settings, warmed from model-runner start")


def active() -> bool:
    """True when plan mode is configured in this process (its warm starts at model-runner start)."""
    return _state.config is not None or _state.manifest is not None


def server_config(vllm_config: Any, runner: type) -> dict[str, Any]:
    """The ServingConfig fields of a ``vllm_config``: its final capture sizes, mode, limits and model."""
    compilation, scheduler = vllm_config.compilation_config, vllm_config.scheduler_config
    spec = getattr(vllm_config, "speculative_config", None)
    model = getattr(vllm_config, "model_config", None)
    architectures = getattr(model, "architectures", None) or []
    options = {"max_num_batched_tokens": scheduler.max_num_batched_tokens,
               "cudagraph_capture_sizes": list(compilation.cudagraph_capture_sizes or []) or None,
               "max_cudagraph_capture_size": compilation.max_cudagraph_capture_size or None,
               "cudagraph_mode": getattr(compilation.cudagraph_mode, "name", "NONE"),
               "num_speculative_tokens": int(getattr(spec, "num_speculative_tokens", 0) or 0),
               "model_runner": "v2" if runner.__module__.startswith("vllm.v1.worker.gpu.") else "v1"}
    if not options["cudagraph_capture_sizes"]:
        options.update(cudagraph_mode="NONE", cudagraph_capture_sizes=None, max_cudagraph_capture_size=None)
    return {"server": "vllm", "ladder_source": "builtin", "max_running_requests": scheduler.max_num_seqs,
            "tp_size": getattr(vllm_config.parallel_config, "tensor_parallel_size", 1), "server_options": options,
            "model_architecture": architectures[0] if architectures else None}


def start(vllm_config: Any, runner: type) -> None:
    """Build the plan from ``vllm_config`` plus the file and start its warm (once per process)."""
    if _state.error is not None and strict():
        raise _state.error  # JITWARM_STRICT=1: a bad config file stops the worker here
    if _state.plan is not None or _state.error is not None or vllm_config is None:
        return
    from jitwarm.precompile.config import ServingConfig
    from jitwarm.precompile.plan import WarmPlan
    from jitwarm.precompile.warming import start_warm

    if _state.fields is not None:
        plan = WarmPlan.build(ServingConfig(**{**server_config(vllm_config, runner), **_state.fields}))
        targets = plan.config.targets
    else:  # JITWARM_MANIFEST alone: the server's recorded kernels for this worker's target
        plan, targets = WarmPlan.empty(), (_Device().target,)
    if _state.manifest:
        plan = plan.with_manifests([_state.manifest], targets)
    ranks = max(1, int(getattr(vllm_config.parallel_config, "world_size", 1) or 1))
    cores = os.cpu_count() or 1
    _state.jobs = settings.jobs() if settings.jobs_set() else max(1, cores // ranks)
    _state.warm, _state.plan = start_warm(plan, jobs=_state.jobs), plan
    log.info("jitwarm: plan %s: %d specs (%d recorded) for %s; warming in the background with %d jobs (%d cores "
             "/ %d local ranks)", plan.plan_id, len(plan.specs), len(plan.recorded), ", ".join(targets),
             _state.jobs, cores, ranks)


def run_hook() -> bool:
    """Run the capture hook; False when plan mode is off (or failed) in this process: the caller drains."""
    if _state.plan is None:
        return False
    from jitwarm.precompile.hook import CaptureHook

    try:
        if _state.hook is None:
            device = _Device()
            _state.hook = CaptureHook(_state.plan, device=device, barrier=device.barrier, warm=_state.warm,
                                      jobs=_state.jobs)
        report = _state.hook()
        if report.first:
            log.info("jitwarm: capture hook ready: plan %s, %d specs loaded on %s after %.2fs; guard armed",
                     _state.plan.plan_id, report.loaded, report.target, report.seconds)
    except Exception as exc:
        failed(f"capture hook for plan {_state.plan.plan_id}", exc)
        _state.plan = None  # every rank still drains and meets (the caller), so the barrier counts stay equal
        return False
    return True


def say_once(message: str) -> None:
    """Log ``message`` the first time only (the drain runs before every capture)."""
    if not _state.said:
        _state.said = True
        log.info("%s", message)


def strict() -> bool:
    """JITWARM_STRICT, read now (a value that does not parse counts as strict: the user asked for something)."""
    try:
        return settings.strict()
    except settings.SettingError:
        return True


def setting(accessor: Callable[[], Any], fallback: Any) -> Any:
    """A setting read through its accessor; one that does not parse is logged (raised under strict).

    Then ``fallback`` is taken: a typo in one variable must not take the drain away.
    """
    try:
        return accessor()
    except settings.SettingError as exc:
        failed("reading a setting", exc)
        return fallback


def failed(what: str, exc: Exception, fatal_later: bool = False) -> Exception:
    """Log a failure of the plugin's own setup; re-raise it under JITWARM_STRICT=1 unless that comes later."""
    if strict() and not fatal_later:
        raise exc
    log.error("jitwarm: %s failed: %s: %s; the capture drain stays installed (JITWARM_STRICT=1 makes this fatal)",
              what, type(exc).__name__, exc)
    return exc
