"""warm: build every missing spec of a plan in parallel, each exactly once, through the shared cache."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

from jitwarm.cache import CacheError, KernelCache, settings
from jitwarm.kernels import KernelSpec
from jitwarm.kernels.artifacts import Artifact, artifact
from jitwarm.precompile.builders import BuildPool, Failure, SpecResult
from jitwarm.precompile.plan import WarmPlan


@dataclass
class WarmReport:
    """The result of :func:`warm`: one :class:`SpecResult` per spec of the plan, and totals."""

    plan_id: str
    results: list[SpecResult] = field(default_factory=list)
    seconds: float = 0.0
    remote: str | None = None  # the remote tier's URL (no password), when one is set
    remote_error: str | None = None  # why the warm ran (partly) without it

    def count(self, outcome: str) -> int:
        """Number of specs with this outcome."""
        return sum(1 for r in self.results if r.outcome == outcome)

    built = property(lambda self: self.count("built"), doc="Specs compiled by this run.")
    hits = property(lambda self: self.count("hit"), doc="Specs already in the cache.")
    waited = property(lambda self: self.count("waited"), doc="Specs another process built while we waited.")
    failed = property(lambda self: self.count("failed"), doc="Specs that could not be built.")
    downloaded = property(lambda self: self.count("downloaded"), doc="Specs fetched from the remote tier.")

    @property
    def ok(self) -> bool:
        """True when every spec of the plan is in the cache."""
        return self.failed == 0

    def entries(self) -> dict[KernelSpec, Any]:
        """Each spec's verified entry, where this process holds it."""
        return {r.spec: r.entry for r in self.results if r.entry is not None}

    def to_json(self) -> dict[str, Any]:
        """Return the report as ``jitwarm warm --json`` prints it (``downloaded`` and ``remote`` with a remote)."""
        outcomes = ("built", "hit", "waited", "failed") + (("downloaded",) if self.remote else ())
        data = {"plan_id": self.plan_id, "ok": self.ok, "seconds": round(self.seconds, 3),
                "totals": {o: self.count(o) for o in outcomes}, "specs": [r.to_json() for r in self.results]}
        if self.remote:
            data["remote"] = {"url": self.remote, "available": self.remote_error is None, "error": self.remote_error}
        return data


class Progress:
    """Progress on a stream: a redrawn bar on a terminal, one line per build otherwise, with elapsed time and eta."""

    def __init__(self, total: int, stream: TextIO | None = None, bar: bool | None = None) -> None:
        self.total, self.done = total, 0
        self.stream = stream or sys.stderr
        self.bar = self.stream.isatty() if bar is None else bar
        self.counts: dict[str, int] = {}
        self.start_time = time.perf_counter()

    def start(self, plan_id: str, specs: int, hits: int, jobs: int) -> None:
        """The line before the first build: how many specs, how many already there, how many to build."""
        self.total = specs - hits
        self.start_time = time.perf_counter()
        self.stream.write(f"jitwarm: plan {plan_id}: {specs} specs, {hits} already in the cache"
                          + (f"; getting {self.total} with {jobs} jobs\n" if self.total else "\n"))
        self.stream.flush()

    def timing(self) -> str:
        """``elapsed 1m05s, eta 2m10s`` (the eta is the mean per spec so far times the specs left)."""
        elapsed = time.perf_counter() - self.start_time
        left = max(0, self.total - self.done)
        eta = f", eta {_clock(elapsed / self.done * left)}" if self.done and left else ""
        return f"elapsed {_clock(elapsed)}{eta}"

    def update(self, result: SpecResult) -> None:
        """Report one finished build (or wait, download, failure)."""
        self.done += 1
        self.counts[result.outcome] = self.counts.get(result.outcome, 0) + 1
        if self.bar:
            width = 30
            filled = width * self.done // max(1, self.total)
            counts = "  ".join(f"{k} {v}" for k, v in sorted(self.counts.items()))
            self.stream.write(f"\rjitwarm: [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total}"
                              f"  {counts}  {self.timing()}\x1b[K")  # erase what a longer line left
            if self.done >= self.total:
                self.stream.write("\n")
        else:
            error = f"  {result.error}" if result.error else ""
            self.stream.write(f"jitwarm: [{self.done}/{self.total}] {result.outcome:<6} {result.spec.id}"
                              f"  {result.seconds:.2f}s  ({self.timing()}){error}\n")
        self.stream.flush()


def _clock(seconds: float) -> str:
    """``42s``, ``6m05s``, ``1h02m``."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def warm(plan: WarmPlan, cache: KernelCache | None = None, jobs: int | None = None,
         progress: bool | None = None, timeout_s: float = 900.0,
         on_result: Callable[[SpecResult], None] | None = None) -> WarmReport:
    """Build every spec the cache lacks, each once per host (failures in the report); record the plan when complete."""
    cache = cache or KernelCache()
    report = warm_specs(plan.specs, plan.plan_id, cache, jobs, progress, timeout_s, on_result)
    if report.ok and len(report.entries()) == len(report.results) and not cache.read_only:
        with contextlib.suppress(CacheError, OSError):  # the record is a convenience; the entries are the truth
            cache.write_plan_record(plan.plan_id, {
                "plan_id": plan.plan_id, "complete": True, "keys": [r.key for r in report.results],
                "specs": [r.spec.id for r in report.results], "finished": time.time()})
    return report


def warm_specs(specs: Sequence[KernelSpec], plan_id: str, cache: KernelCache, jobs: int | None = None,
               progress: bool | None = None, timeout_s: float = 900.0,
               on_result: Callable[[SpecResult], None] | None = None, *, missed: bool = False) -> WarmReport:
    """Get or build ``specs`` (see :func:`warm`) in their order; each is looked up once here (not with ``missed``)."""
    jobs = max(1, jobs or settings.jobs())
    start = time.perf_counter()
    report = WarmReport(plan_id, remote=cache.remote_display)
    show = Progress(len(specs)) if progress is not False else None  # a bar on a terminal, else lines

    def record(result: SpecResult) -> None:
        report.results.append(result)
        if on_result:
            on_result(result)

    missing: list[Artifact] = []
    for spec in specs:  # lock-free lookups first: a warm cache costs no worker process
        t0 = time.perf_counter()
        try:
            art = artifact(spec, cache)
            entry = None if missed else art.lookup(cache)
        except Exception as exc:
            record(SpecResult.failed(spec, Failure.of(exc), time.perf_counter() - t0))
            continue
        if entry is not None:
            record(SpecResult(spec, "hit", time.perf_counter() - t0, art.key, entry=entry))
        else:
            missing.append(art)
    if missing and cache.remote:  # before any output: a required remote that is down is one error, alone
        report.remote_error = cache.check_remote()
    if show:
        show.start(plan_id, len(specs), report.hits, min(jobs, len(missing)) if missing else 0)
        for result in report.results:
            if result.outcome == "failed":
                show.update(result)
    remote = (cache.remote or "") if report.remote_error is None else ""  # down: the workers run local-only
    cache_args = {"root": str(cache.root), "layers": [str(p) for p in cache.layers], "lock_dir": str(cache.lock_dir),
                  "read_only": cache.read_only, "allow_shared": cache.allow_shared, "remote": remote,
                  "remote_prefix": cache.remote_prefix, "remote_required": cache.remote_required}
    pool = BuildPool(min(jobs, len(missing)), cache_args, timeout_s)
    for result in pool.run(missing) if missing else ():  # each with the entry its worker verified: no lookup
        report.remote_error = report.remote_error or result.remote_error
        record(result)
        if show:
            show.update(result)
    order = {s: i for i, s in enumerate(specs)}
    report.results.sort(key=lambda r: order[r.spec])
    report.seconds = time.perf_counter() - start
    return report


class WarmHandle:
    """A warm running in a background thread (builds still run in worker processes): see :func:`start_warm`."""

    def __init__(self, plan: WarmPlan, **kwargs: Any) -> None:
        self.plan = plan
        self._report: WarmReport | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, kwargs=kwargs, name="jitwarm-warm", daemon=True)
        self._thread.start()

    def _run(self, **kwargs: Any) -> None:
        """Run :func:`warm`, keeping its report or its error for :meth:`join`."""
        try:
            self._report = warm(self.plan, **kwargs)
        except BaseException as exc:  # re-raised in the joiner's thread
            self._error = exc

    def done(self) -> bool:
        """True once the warm has finished."""
        return not self._thread.is_alive()

    def join(self, timeout_s: float | None = None) -> WarmReport:
        """Wait for the warm and return its report; raise TimeoutError past ``timeout_s``."""
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"background warm of plan {self.plan.plan_id} still running after {timeout_s}s")
        if self._error is not None:
            raise self._error
        assert self._report is not None
        return self._report


def start_warm(plan: WarmPlan, **kwargs: Any) -> WarmHandle:
    """Start :func:`warm` in the background (so compiles overlap model loading); the hook joins it."""
    kwargs.setdefault("progress", False)
    return WarmHandle(plan, **kwargs)
