"""What every room's plugin does alike around its capture hooks: settings, recording, the ledger, plan mode.

A setting that does not parse is logged and the plugin's default taken (raised under ``JITWARM_STRICT=1``): a
typo in one variable must not take the drain away. Plan mode: docs/sglang.md and docs/vllm.md.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

from jitwarm.cache import settings

TRITON_MANAGER = "jitwarm.kernels.libraries.triton.cache:CacheManager"

# The plugins' own settings (each plugin declares its on/off switch, ``ENABLED``).
CONFIG_ENV, MANIFEST_ENV, RECORD_ENV, TRITON_CACHE_ENV = (
    "JITWARM_CONFIG", "JITWARM_MANIFEST", "JITWARM_RECORD", "JITWARM_TRITON_CACHE")
config_file = settings.path_setting(CONFIG_ENV, "the TOML file of model dims and targets: a plugin plans from it")
manifest_file = settings.path_setting(MANIFEST_ENV, "recorded kernels a plugin warms and loads before capture too")
record_file = settings.path_setting(RECORD_ENV, "append every kernel and JIT cache unit this process compiles to "
                                    "this manifest")
serve_triton = settings.flag_setting(TRITON_CACHE_ENV, "0 leaves Triton's own cache manager in place (default on)",
                                     default=True)


def failed(log: logging.Logger, what: str, exc: Exception, fatal_later: bool = False) -> Exception:
    """Log a failure of the plugin's own setup; re-raise it under JITWARM_STRICT=1 unless that comes later."""
    if settings.is_strict() and not fatal_later:
        raise exc
    log.error("jitwarm: %s failed: %s: %s; the capture drain stays installed (JITWARM_STRICT=1 makes this fatal)",
              what, type(exc).__name__, exc)
    return exc


def setting(log: logging.Logger, accessor: Callable[[], Any], fallback: Any) -> Any:
    """A setting read through its accessor; ``fallback`` when it does not parse (logged, raised under strict)."""
    try:
        return accessor()
    except settings.SettingError as exc:
        failed(log, "reading a setting", exc)
        return fallback


def record_and_serve(log: logging.Logger, recorder: Any, what: str) -> Any:
    """``JITWARM_RECORD``: start recording (unless ``recorder`` runs); route Triton through jitwarm's cache.

    ``TRITON_CACHE_MANAGER`` is set unless the user chose one (or ``JITWARM_TRITON_CACHE=0``). Returns the recorder.
    """
    path = setting(log, record_file, None)
    if path and recorder is None:
        from jitwarm.precompile.recorder import record

        recorder = record(path)
        log.info("jitwarm: recording every %s this process compiles into %s", what, path)
    if setting(log, serve_triton, True) and not os.environ.get("TRITON_CACHE_MANAGER"):
        os.environ["TRITON_CACHE_MANAGER"] = TRITON_MANAGER
    return recorder


def begin_ledger(log: logging.Logger, watchers: Callable[[], dict[str, Any]] = dict) -> None:
    """Take the start-up ledger's snapshot now (before the model loads), with the room's ``watchers()``.

    Then check the restore's receipt (:func:`check_restore`): raises under ``JITWARM_STRICT=1``.
    """
    _ledger(log, "off", lambda ledger: ledger.begin(watchers()))
    check_restore(log)


def check_restore(log: logging.Logger) -> None:
    """Name both paths of each family the restore placed where this server's library does not look.

    The receipt is read from the jitwarm cache root; each such family is a warning here and in the ledger, and
    ``RestoredElsewhere`` (exit 5) under ``JITWARM_STRICT=1``: the start would compile what was restored.
    """
    from jitwarm.kernels.libraries.jit_caches import receipt
    from jitwarm.precompile import servers

    try:
        root = settings.cache_dir()
        found = receipt.read(root)
        server = servers.running()
        elsewhere = [] if found is None else receipt.elsewhere(found, servers.cache_dirs(server), server)
    except Exception as exc:  # the check only reports
        log.warning("jitwarm: restore receipt not checked: %s: %s", type(exc).__name__, exc)
        return
    lines = [gone.line(receipt.receipt_path(root)) for gone in elsewhere]
    for line in lines if not _said["receipt"] else ():
        log.warning("%s", line)
    _said["receipt"] = True
    _ledger(log, "off", lambda ledger: ledger.begin().note_elsewhere(elsewhere, lines))
    if lines and settings.is_strict():
        raise receipt.RestoredElsewhere(lines[0].removeprefix("jitwarm: "), "JITWARM_STRICT=1 refuses a start that "
                                        "would compile what was restored")


def report_ledger(log: logging.Logger) -> None:
    """Report the start-up ledger after a runner's last capture."""
    _ledger(log, "failed", lambda ledger: ledger.report_after_capture())


def _ledger(log: logging.Logger, failure: str, step: Callable[[Any], None]) -> None:
    """Run ``step(ledger)``; a failure is logged, never raised (the ledger only reports)."""
    try:
        from jitwarm.precompile import ledger

        step(ledger)
    except Exception as exc:
        log.warning("jitwarm: start-up ledger %s: %s: %s", failure, type(exc).__name__, exc)


def seal_line(server: str) -> str:
    """The plugin line's part about the seals (:func:`sealed`): every kind's that seals, then ``server``'s own."""
    from jitwarm.kernels import kinds
    from jitwarm.precompile import servers

    names = [k.sealed for k in kinds.seals()] + [name for name in (servers.adapter(server).SEALED,) if name]
    return f"seals inside each capture: {', '.join(names)}, " + (
        "refused (JITWARM_STRICT=1)" if settings.is_strict() else "logged (JITWARM_STRICT=1 refuses them)")


@contextlib.contextmanager
def sealed(log: logging.Logger) -> Iterator[None]:
    """Around one capture: a JIT compile or module load while the stream captures is logged, refused under strict.

    It watches the stream, not the guard (a later graph's warmup may still compile, outside any capture); the guard
    alone lets a Triton compile inside a real server's capture pass unseen.
    """
    from jitwarm.kernels.dispatch import stream_is_capturing
    from jitwarm.precompile.guard import ThirdPartySeal

    seal = ThirdPartySeal(mode="error" if settings.is_strict() else "warn", when=stream_is_capturing, log=log)
    try:
        armed = seal.install()
    except Exception as exc:  # the seals only watch: a failure to arm them never takes the capture away
        failed(log, "arming the capture seals", exc)
        armed = None
    if armed is not None and not _said["seals"]:
        _said["seals"] = True
        log.info("jitwarm: capture seals armed: %s (%s)", ", ".join(armed) or "none: no JIT library imported",
                 "refused" if seal.mode == "error" else "logged; JITWARM_STRICT=1 refuses them")
    try:
        yield
    finally:
        seal.remove()


_said = {"seals": False, "receipt": False}


class PlanMode:
    """Plan mode of one server process: the file's fields, then the plan, its background warm and its capture hook.

    It is the hook's device too (:attr:`target`). A room's subclass sets :attr:`log`, :attr:`server_keys` (file keys
    the server decides: ignored) and :attr:`decides`, and implements ``synchronize`` and ``barrier``.
    """

    log: logging.Logger
    server_keys: frozenset[str] = frozenset()
    decides = "the server's own settings decide"

    def __init__(self, config: str | None = None, manifest: str | None = None) -> None:
        self.config, self.manifest = config, manifest
        self.fields: dict[str, Any] | None = None
        self.error: Exception | None = None
        self.plan = self.warm = self.hook = None
        self.jobs, self.said = 1, False
        if config:
            try:
                from jitwarm.precompile.config import read_config_file

                fields = read_config_file(config)
                ignored = sorted(set(fields) & self.server_keys)
                if ignored:
                    self.log.warning("jitwarm: %s sets %s: ignored, %s what is captured", config,
                                     ", ".join(ignored), self.decides)
                self.fields = {k: v for k, v in fields.items() if k not in ignored}
            except Exception as exc:
                self.error = failed(self.log, f"reading {CONFIG_ENV}={config}", exc, fatal_later=True)

    @classmethod
    def from_settings(cls) -> PlanMode:
        """Plan mode as ``JITWARM_CONFIG`` and ``JITWARM_MANIFEST``, read now, configure it."""
        return cls(*(str(setting(cls.log, read, None) or "") or None for read in (config_file, manifest_file)))

    @property
    def active(self) -> bool:
        """True when plan mode is configured (its warm starts at model-runner start)."""
        return bool(self.config or self.manifest)

    def describe(self) -> str:
        """How plan mode was configured, for the plugin's one log line."""
        if not self.active:
            return f"no plan ({CONFIG_ENV} unset)"
        if self.error is not None:
            return f"no plan ({CONFIG_ENV} unusable, see above)"
        return (f"plan from {CONFIG_ENV}={self.config or '(unset)'} with the server's capture settings and "
                f"{MANIFEST_ENV}={self.manifest or '(unset)'}, warmed from model-runner start")

    @functools.cached_property
    def target(self) -> str:
        """The build target of this process (the host's, ``cpu``, when this torch has no CUDA)."""
        import torch

        from jitwarm.kernels import dispatch

        return dispatch.target_of(torch.device("cuda", torch.cuda.current_device())
                                  if torch.cuda.is_available() else "cpu")

    def start(self, server_fields: Callable[[], dict[str, Any]], ranks: int) -> None:
        """Build the plan of ``server_fields()`` plus the file's and start its warm (once per process).

        Each of the node's ``ranks`` warms with ``cores // ranks`` builders, or JITWARM_JOBS. Raises the file's
        error under JITWARM_STRICT=1: the server stops.
        """
        if self.error is not None and settings.is_strict():
            raise self.error
        if self.plan is not None or self.error is not None or not self.active:
            return
        from jitwarm.precompile.config import ServingConfig
        from jitwarm.precompile.plan import WarmPlan
        from jitwarm.precompile.warming import start_warm

        if self.fields is not None:
            plan = WarmPlan.build(ServingConfig(**{**server_fields(), **self.fields}))
            targets = plan.config.targets
        else:  # JITWARM_MANIFEST alone: the server's recorded kernels only, for this process's target
            plan, targets = WarmPlan.empty(), (self.target,)
        if self.manifest:
            plan = plan.with_manifests([self.manifest], targets)
        cores = os.cpu_count() or 1
        self.jobs = settings.jobs() if settings.jobs_set() else max(1, cores // max(1, ranks))
        self.warm, self.plan = start_warm(plan, jobs=self.jobs), plan
        self.log.info("jitwarm: plan %s: %d specs (%d recorded) for %s; warming in the background with %d jobs (%d "
                      "cores / %d local ranks); model: %s", plan.plan_id, len(plan.specs), len(plan.recorded),
                      ", ".join(targets), self.jobs, cores, ranks,
                      plan.families.why if plan.families else "none (recorded kernels only)")

    def drain(self, owner: str, when: str) -> None:
        """The capture hook in plan mode, else (or if it failed) the server's synchronize and TP barrier."""
        if self.plan is not None:
            from jitwarm.precompile.hook import CaptureHook

            try:
                if self.hook is None:
                    self.hook = CaptureHook(self.plan, device=self, barrier=self.barrier, warm=self.warm,
                                            jobs=self.jobs)
                report = self.hook()
                if report.first:
                    warm = self.warm.join(0)  # the hook joined it: done
                    self.log.info("jitwarm: capture hook ready: plan %s, %d specs loaded on %s after %.2fs "
                                  "(background warm: built %d, waited %d, hits %d); guard armed", self.plan.plan_id,
                                  report.loaded, report.target, report.seconds, warm.built, warm.waited, warm.hits)
                return
            except Exception as exc:
                failed(self.log, f"capture hook for plan {self.plan.plan_id}", exc)
                self.plan = None  # each rank still drains and meets (below), so the barrier counts stay equal
        self.synchronize()
        self.barrier()
        if not self.said:  # the drain runs at every capture: say it once
            self.said = True
            self.log.info("jitwarm: capture drain active in %s: device synchronize + TP barrier %s", owner, when)

    def synchronize(self) -> None:
        """Drain the device as the server's capture code does."""
        raise NotImplementedError

    def barrier(self) -> None:
        """Meet the other TP ranks at the server's TP group."""
        raise NotImplementedError
