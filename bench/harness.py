"""What every benchmark here shares: subprocess timing, alternating rounds, medians, ratio tables, JSON."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# The DSpark-128 profile: 35 graphs, 30 specs (README.md).
DSPARK = ["--cuda-graph-max-bs-decode", "128", "--max-running-requests", "128", "--speculative-algorithm", "DSPARK",
          "--speculative-num-draft-tokens", "6", "--ragged-verify-mode", "compact"]


def machine() -> dict[str, Any]:
    """Where the numbers were taken."""
    return {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()}


def run(cmd: Sequence[str], env: dict[str, str] | None = None, timeout: float = 3600) -> tuple[float, str]:
    """Run ``cmd``; return (wall seconds, stdout). Raises on a non-zero exit with its stderr."""
    environ = {**os.environ, **(env or {})}
    environ.pop("PYTHONDONTWRITEBYTECODE", None)  # measure imports as an installed package runs them
    start = time.perf_counter()
    proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, env=environ, cwd=ROOT)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[:4]}... exited {proc.returncode}: {proc.stderr[-2000:]}")
    return wall, proc.stdout


def jitwarm_cmd(*args: str) -> list[str]:
    """The CLI, run with this interpreter."""
    return [sys.executable, "-m", "jitwarm.precompile", *args]


def alternate(variants: dict[str, Callable[[int], float]], rounds: int) -> dict[str, list[float]]:
    """Run every variant once per round, rotating the order each round; return each variant's samples."""
    names = list(variants)
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            samples[name].append(variants[name](r))
            print(f"  round {r + 1}/{rounds} {name}: {samples[name][-1]:.3f}s", file=sys.stderr, flush=True)
    return samples


def summarize(samples: dict[str, list[float]], baseline: str) -> list[dict[str, Any]]:
    """Median, min, max per variant and the ratio of the baseline's median to each variant's."""
    base = statistics.median(samples[baseline])
    return [{"variant": name, "median_s": statistics.median(xs), "min_s": min(xs), "max_s": max(xs),
             "n": len(xs), "speedup_vs_" + baseline.split()[0]: base / statistics.median(xs)}
            for name, xs in samples.items()]


def table(rows: list[dict[str, Any]]) -> str:
    """A plain text table of dict rows (floats to 3 significant digits)."""
    if not rows:
        return "(no rows)"
    cols = list(rows[0])
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)  # noqa: E731
    cells = [cols] + [[fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def report(name: str, sections: dict[str, list[dict[str, Any]]], extra: dict[str, Any] | None = None,
           out: str | None = None) -> None:
    """Print each section as a table and write everything to ``<out>/<name>.json``."""
    for title, rows in sections.items():
        print(f"\n## {title}\n{table(rows)}")
    path = Path(out or ROOT / "bench" / "results") / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": machine(), **(extra or {}), "sections": sections}, indent=1))
    print(f"\nwrote {path}")
