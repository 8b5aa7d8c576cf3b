"""CaptureHook: returns only when every kernel of the plan is built, loaded, on the device, and all ranks met.

The order is the point (sglang PR #33795, #34286): all of it after the last warmup, before the graph.
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jitwarm.cache import KernelCache, LockTimeout, settings
from jitwarm.cache.errors import JitwarmError, NotReady, TimedOut
from jitwarm.kernels import KernelSpec, Target, dispatch
from jitwarm.kernels.artifacts import KernelLoadError, artifact
from jitwarm.precompile import guard
from jitwarm.precompile import ledger as start_ledger
from jitwarm.precompile.plan import WarmPlan
from jitwarm.precompile.warming import WarmHandle, WarmReport, warm_specs

POLICIES = ("build", "wait", "strict")


class KernelsNotReady(NotReady, RuntimeError):
    """The hook could not make every kernel ready (a build failed, strict found a miss): exit 5.

    A RuntimeError too: a server that does not know jitwarm's errors fails its start on it all the same.
    """


class WarmTimeout(TimedOut, KernelsNotReady):
    """The hook's deadline passed while waiting for kernels (exit 3)."""


class KernelLoadFailed(JitwarmError, RuntimeError):
    """A spec's entry does not load, and neither did its rebuild (strict: none); ``spec`` names it (exit 1)."""

    def __init__(self, spec: KernelSpec, reason: str) -> None:
        self.spec = spec
        self.load_reason = reason
        super().__init__(f"{spec.id} cannot be loaded: {reason}")


class TorchDevice:
    """A torch device: ``cuda`` (the current one) when available, else ``cpu``."""

    def __init__(self, device: Any = None) -> None:
        import torch

        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.target = Target.of_device(self.device).name

    def synchronize(self) -> None:
        """``torch.cuda.synchronize`` on CUDA; nothing to drain on the CPU."""
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)


@dataclass
class HookReport:
    """What a hook call did (``first``: False for the cheap repeat calls); ``steps`` times each step."""

    target: str
    first: bool
    built: int = 0
    waited: int = 0
    downloaded: int = 0
    hits: int = 0
    loaded: int = 0
    seconds: float = 0.0
    steps: dict[str, float] = field(default_factory=dict)


class CaptureHook:
    """The capture-time hook: call it after the last warmup and before ``torch.cuda.CUDAGraph()``.

    The first call makes every spec for this device's target present within ``timeout_s`` (``policy``: build, wait
    for another process, or strict: fail; ``JITWARM_STRICT=1`` forces strict), loads each onto the device,
    synchronizes, meets the ranks at ``barrier`` and arms the guard. Later calls only synchronize and meet.
    """

    def __init__(self, plan: WarmPlan, cache: KernelCache | None = None, barrier: Callable[[], Any] | None = None,
                 device: Any = None, timeout_s: float = 900.0, policy: str = "build",
                 warm: WarmHandle | None = None, jobs: int | None = None, seal_third_party: bool = False,
                 manifest: str | Path | Sequence[str | Path] | None = None, serve_triton: bool = False,
                 ledger: Any = None) -> None:
        if settings.strict():
            policy = "strict"
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.plan, self.policy, self.timeout_s, self.jobs = plan, policy, timeout_s, jobs
        self.cache = cache or KernelCache()
        self.device = device if hasattr(device, "synchronize") and hasattr(device, "target") else TorchDevice(device)
        if barrier is None and (torch := sys.modules.get("torch")) is not None:  # torch.distributed's, if initialised
            dist = torch.distributed
            barrier = dist.barrier if dist.is_available() and dist.is_initialized() else None
        self.barrier = barrier
        self.warm_handle = warm
        self.seal = guard.ThirdPartySeal() if seal_third_party else None
        self.ready = False
        if manifest is not None:
            paths = [manifest] if isinstance(manifest, (str, Path)) else list(manifest)
            self.plan = plan = plan.with_manifests(paths, [self.device.target])
        if serve_triton or any(s.backend == "triton_jit" for s in plan.specs):
            from jitwarm.kernels.libraries.triton import cache as triton_cache

            triton_cache.serve(self.cache)
        guard.install()  # a dispatch miss while any stream captures raises, even before the first call
        if ledger is None:  # its snapshot taken now, unless the server's plugin took it at start
            ledger = start_ledger.begin()
        self.ledger = ledger

    def specs(self) -> list[KernelSpec]:
        """The plan's specs for this device's target."""
        return [s for s in self.plan.specs if s.target == self.device.target]

    def __call__(self) -> HookReport:
        """Run the steps (all five the first time, sync and barrier after); see the class docstring."""
        start = time.perf_counter()
        report = HookReport(self.device.target, first=not self.ready)
        if report.first:
            specs = self.specs()
            if not specs:
                targets = sorted({s.target for s in self.plan.specs})
                raise KernelsNotReady(f"plan {self.plan.plan_id} has no specs for this device's target "
                                      f"{self.device.target} (its targets: {', '.join(targets)}); "
                                      f"warm with --target {self.device.target}")
            deadline = start + self.timeout_s
            entries = self._step(report, "present", lambda: self._make_present(specs, deadline, report))
            loaded = self._step(report, "load", lambda: self._load(specs, entries))  # each load claims its entry
            report.loaded = len(loaded)
            self._step(report, "preload", lambda: [kernel.preload() for kernel in loaded])
        self._step(report, "synchronize", self.device.synchronize)
        if self.barrier is not None:
            self._step(report, "barrier", self.barrier)
        if report.first:
            guard.arm()
            if self.seal:
                self.seal.install()
            self.ready = True
        report.seconds = time.perf_counter() - start
        return report

    def ledger_report(self) -> Any:
        """The :class:`~jitwarm.precompile.ledger.LedgerReport` since the ledger's snapshot: call it after capture."""
        return self.ledger.report()

    def close(self) -> None:
        """Disarm the guard (and remove third-party seals) armed by the first call."""
        if self.ready:
            if self.seal:
                self.seal.remove()
            guard.disarm()
            self.ready = False

    def _step(self, report: HookReport, name: str, fn: Callable[[], Any]) -> Any:
        """Run one step, timed in ``report.steps``."""
        t0 = time.perf_counter()
        result = fn()
        report.steps[name] = time.perf_counter() - t0
        return result

    def _make_present(self, specs: list[KernelSpec], deadline: float, report: HookReport) -> dict[KernelSpec, Any]:
        """Step (1): each spec's verified entry: the warm's, a lookup's, a waited-for or a worker's one."""
        entries: dict[KernelSpec, Any] = {}
        if self.warm_handle is not None:
            try:
                warmed: WarmReport = self.warm_handle.join(max(0.0, deadline - time.perf_counter()))
            except TimeoutError as exc:
                raise WarmTimeout(str(exc)) from None
            entries.update(warmed.entries())  # verified by the warm in this process: no second lookup
        keys = {spec: artifact(spec, self.cache).key for spec in specs if entries.get(spec) is None}
        # Not claimed here (prune's grace keeps them until each load claims its own): a claim held here made the
        # discard of an entry that fails to load wait for this very hook.
        found = {key: self.cache.lookup(key) for key in keys.values()}
        entries.update((spec, found[key]) for spec, key in keys.items())
        missing = [s for s in specs if entries[s] is None]
        report.hits = len(specs) - len(missing)
        if not missing:
            return entries
        names = ", ".join(s.id for s in missing[:5]) + (" ..." if len(missing) > 5 else "")
        if self.policy == "strict":
            raise KernelsNotReady(f"strict policy: {len(missing)} spec(s) of plan {self.plan.plan_id} are not "
                                  f"in the cache: {names}; run `jitwarm warm` with the same flags first")
        if self.policy == "wait":
            for spec in missing:
                try:
                    entries[spec] = self.cache.wait_for(keys[spec], max(0.0, deadline - time.perf_counter()))
                except LockTimeout as exc:
                    raise WarmTimeout(f"timed out after {self.timeout_s:.0f}s waiting for {spec.id}: {exc}") from None
            report.waited = len(missing)
            return entries
        result = warm_specs(missing, self.plan.plan_id, self.cache, self.jobs, progress=False,
                            timeout_s=max(1.0, deadline - time.perf_counter()), missed=True)
        failed = [r for r in result.results if r.outcome == "failed"]
        if failed:
            detail = "; ".join(f"{r.spec.id}: {r.error}" for r in failed[:3])
            timed_out = all(r.timed_out for r in failed)
            raise (WarmTimeout if timed_out else KernelsNotReady)(
                f"{len(failed)} spec(s) of plan {self.plan.plan_id} failed to build: {detail}")
        report.built, report.waited, report.downloaded = result.built, result.waited, result.downloaded
        report.hits += result.hits
        entries.update(result.entries())
        return entries

    def _load(self, specs: list[KernelSpec], entries: dict[KernelSpec, Any]) -> list[Any]:
        """Step (2): load every spec, each entry claimed while it loads."""
        try:
            build = self.policy != "strict"  # strict builds nothing, not even an entry that fails to load
            return [dispatch.ensure_loaded(spec, cache=self.cache, entry=entries.get(spec), build=build)
                    for spec in specs]
        except KernelLoadError as exc:
            raise KernelLoadFailed(exc.spec, str(exc)) from exc


def capture_ladder(plan: WarmPlan, forward: Callable[[Any], Any], hook: CaptureHook | None = None, *,
                   warmups: int = 2, graph_factory: Callable[[], Any] | None = None,
                   capture: Callable[[Any], Any] | None = None) -> dict[int, tuple[Any, Any]]:
    """Capture one graph per shape, largest first, after ``warmups`` warmup rounds each: ``{bs: (graph, outputs)}``."""
    hook = hook or CaptureHook(plan)
    if graph_factory is None or capture is None:
        import torch

        pool = torch.cuda.graph_pool_handle()  # one memory pool for the whole ladder, as sglang shares
        graph_factory = graph_factory or torch.cuda.CUDAGraph
        capture = capture or functools.partial(torch.cuda.graph, pool=pool)
    hook()
    graphs: dict[int, tuple[Any, Any]] = {}
    for shape in plan.shapes:
        if shape.bs in graphs:
            continue
        for _ in range(warmups):
            hook.device.synchronize()
            if hook.barrier is not None:
                hook.barrier()
            forward(shape)
            hook()
        graph = graph_factory()
        with capture(graph):
            outputs = forward(shape)
        graphs[shape.bs] = (graph, outputs)
    return graphs
