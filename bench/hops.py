"""Hop counts: how many of jitwarm's own functions stand between a main path's entry and the step that does the work.

A reader follows a path through these frames; fewer is easier (issue #32). Each path runs once, in this process,
on a small plan (``--target cpu``) in a scratch cache, and a profile hook notes jitwarm's frames on the stack
when the path's step is first called: warm handing a miss to a build worker, export writing the entries,
prestart publishing a bundle's entry, verify hashing one, and the capture hook claiming a warm entry to load it.
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

    sys.setprofile(profile)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            run()
    finally:
        sys.setprofile(None)
    return seen[0] if seen else []


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
    print(f"{'path':<44} {'hops':>4}  frames")
    for label, module, function, run in paths:
        frames = chain(module, function, run)
        print(f"{label:<44} {len(frames):>4}  {' > '.join(frames)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
