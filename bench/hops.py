"""Hops and back-and-forth: how a reader walks from a main path's entry to the step that does the work.

Each path runs once, in this process, on a small plan (``--target cpu``) in a scratch cache, and a profile hook
notes jitwarm's frames on the stack when the path's step is first called: warm handing a miss to a build worker,
export writing the entries, prestart publishing a bundle's entry, verify hashing one, and the capture hook
claiming a warm entry to load it. Three numbers per path: ``hops``, jitwarm's frames on that stack (functions a
reader steps through); ``rooms``, the modules the stack passes through, consecutive frames of one module counted
once; ``back``, how often the stack comes back into a module it had left for another (``shipping > commands >
shipping`` is one): a walk that reads top to bottom has none. Last, the walk of ``prestart``: the module of each
function ``cmd_prestart`` calls, in order (each returns to prestart; none calls a command module).
A build worker runs in its own interpreter: its side is ``builders.main`` to the backend's build, not counted.
usage: python bench/hops.py
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness import ROOT

FLAGS = ["--cuda-graph-bs", "1", "--compress-ratios", "4", "--head-dim", "64", "--rope-dim", "32",
         "--num-q-heads", "2", "--num-kv-heads", "1", "--target", "cpu"]


def chain(module: str, function: str, run: Callable[[], Any]) -> list[str]:
    """jitwarm's frames (``module.function``) on the stack when ``module.function`` is first called in ``run()``."""
    seen: list[list[str]] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        code = frame.f_code
        if seen or event != "call" or code.co_name != function or Path(code.co_filename).stem != module:
            return
        names = []
        while frame is not None:
            path = Path(frame.f_code.co_filename)
            if path.is_relative_to(ROOT) and path.parts[len(ROOT.parts)] in ("precompile", "kernels", "cache"):
                names.append(f"{path.stem}.{frame.f_code.co_name}")
            frame = frame.f_back
        seen.append(names[::-1])

    _profiled(profile, run)
    return seen[0] if seen else []


def _profiled(profile: Callable[[Any, str, Any], None], run: Callable[[], Any]) -> None:
    """``run()`` under ``profile`` (``sys.setprofile``), its output swallowed."""
    sys.setprofile(profile)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            run()
    finally:
        sys.setprofile(None)


def rooms(frames: list[str]) -> list[str]:
    """The modules of ``frames`` (``module.function``), consecutive repeats collapsed."""
    found: list[str] = []
    for frame in frames:
        module = frame.partition(".")[0]
        if not found or found[-1] != module:
            found.append(module)
    return found


def back(frames: list[str]) -> int:
    """How often the stack comes back into a module it had left for another one."""
    chain_of_rooms = rooms(frames)
    return sum(1 for i, module in enumerate(chain_of_rooms) if module in chain_of_rooms[:i])


def callees(module: str, function: str, run: Callable[[], Any]) -> list[str]:
    """``module.function`` of each jitwarm function that ``module.function`` calls itself, in order."""
    seen: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        caller = frame.f_back
        if event != "call" or caller is None or caller.f_code.co_name != function \
                or Path(caller.f_code.co_filename).stem != module:
            return
        path = Path(frame.f_code.co_filename)
        if path.is_relative_to(ROOT) and path.parts[len(ROOT.parts)] in ("precompile", "kernels", "cache") \
                and not frame.f_code.co_name.startswith("<"):
            seen.append(f"{path.stem}.{frame.f_code.co_name}")

    _profiled(profile, run)
    return seen


def main() -> int:
    from jitwarm.cache import KernelCache
    from jitwarm.precompile import CaptureHook, ServingConfig, WarmPlan
    from jitwarm.precompile.cli import main as cli

    scratch = Path(tempfile.mkdtemp(prefix="jitwarm-hops-"))
    root, bundle = str(scratch / "a"), str(scratch / "k.tar")
    os.environ["JITWARM_JOBS"] = "1"
    plan = WarmPlan.build(ServingConfig.from_args(FLAGS))
    paths = [
        ("warm: a miss to a build worker", "builders", "_spawn",
         lambda: cli(["warm", *FLAGS, "--cache-dir", root, "--json"])),
        ("export: the entries written", "bundle_export", "write_members",
         lambda: cli(["export", bundle, *FLAGS, "--cache-dir", root, "--json"])),
        ("prestart --bundle: an entry published", "protocol", "_publish",
         lambda: cli(["prestart", *FLAGS, "--bundle", bundle, "--cache-dir", str(scratch / "b"), "--offline"])),
        ("verify: an entry hashed", "entry", "verify_entry",
         lambda: cli(["verify", *FLAGS, "--cache-dir", str(scratch / "b")])),
        ("capture hook: a warm entry claimed to load", "artifacts", "read",
         lambda: CaptureHook(plan, cache=KernelCache(root), policy="strict")()),
    ]
    print(f"{'path':<44} {'hops':>4} {'rooms':>5} {'back':>4}  frames")
    for label, module, function, run in paths:
        frames = chain(module, function, run)
        print(f"{label:<44} {len(frames):>4} {len(rooms(frames)):>5} {back(frames):>4}  {' > '.join(frames)}")
    walk = callees("prestart", "cmd_prestart", lambda: cli(["prestart", *FLAGS, "--bundle", bundle, "--cache-dir",
                                                            str(scratch / "c"), "--offline"]))
    print(f"prestart's walk: {' > '.join(walk)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
