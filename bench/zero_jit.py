"""A node's first start with a cold JIT cache against one restored by ``jitwarm prestart`` (issue #21).

For the families that run on this box:

- **Inductor**: ``torch.compile`` of a small function on the CPU (tests/workers/inductor_compile.py) on an
  empty ``TORCHINDUCTOR_CACHE_DIR``, against ``prestart`` restoring the recorded units into an empty one and the
  same process on it (Inductor then reports ``fxgraph_cache_hit``).
- **Triton's own directory**: the Triton test server's warmup (tests/workers/triton_server.py: four
  specializations compiled for sm_90 with the target-only driver) on an empty ``TRITON_CACHE_DIR``, against
  ``prestart`` restoring its key directories and the same warmup on them.

Each side is timed from process start to the end of its first call, in fresh processes, alternating the order
each round. Then the restore time per GiB (one DeepGEMM-layout unit of ``--restore-mib`` MiB of random bytes,
captured and restored into an empty directory) and each family's bundle size (``jitwarm export`` of its
units). Usage: ``python bench/zero_jit.py [--rounds N] [--restore-mib M] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import ROOT, alternate, jitwarm_cmd, report, run, summarize  # noqa: E402

WORKERS = ROOT / "tests" / "workers"
INDUCTOR = {"TORCHINDUCTOR_COMPILE_THREADS": "1", "JITWARM_RECORD_CACHES": "inductor"}
TRITON = {"PYTHONPATH": os.pathsep.join([str(WORKERS), os.environ.get("PYTHONPATH", "")]),
          "TRITON_DEFAULT_FP_FUSION": "1", "JITWARM_RECORD_CACHES": "triton"}


def worker(name: str, *args: str, env: dict[str, str]) -> tuple[float, dict]:
    wall, out = run([sys.executable, str(WORKERS / name), *args], env=env)
    return wall, json.loads(out.strip().splitlines()[-1])


def units_only(manifest: Path, out: Path) -> Path:
    lines = [line for line in manifest.read_text().splitlines() if '"kind": "jit_cache"' in line]
    out.write_text("".join(line + "\n" for line in lines))
    return out


def restore(manifest: Path, cache: Path, env: dict[str, str], *extra: str) -> float:
    wall, _ = run(jitwarm_cmd("prestart", "--manifest", str(manifest), "--cache-dir", str(cache), "--offline",
                              *extra), env=env)
    return wall


def family_case(tmp: Path, family: str, rounds: int) -> tuple[list[dict], dict]:
    """Record once, then alternate cold starts and restored starts; return the summary rows and extras."""
    cache, manifest = tmp / f"{family}-cache", tmp / f"{family}.jsonl"
    if family == "inductor":
        env, var, script, mode = INDUCTOR, "TORCHINDUCTOR_CACHE_DIR", "inductor_compile.py", ("run",)
        worker(script, "record", str(manifest), str(cache), env={**env, var: str(tmp / "inductor-rec")})
        extra_flags: tuple[str, ...] = ()
    else:
        env, var, script, mode = TRITON, "TRITON_CACHE_DIR", "triton_server.py", ("serve",)
        worker(script, "record", str(tmp / "triton-kernels.jsonl"), env={
            **env, "SERVER_TRITON_CACHE_DIR": str(tmp / "triton-rec"), "JITWARM_CACHE_DIR": str(cache)})
        units_only(tmp / "triton-kernels.jsonl", manifest)
        extra_flags = ("--target", "sm_90")
    own = "SERVER_TRITON_CACHE_DIR" if family == "triton" else var
    restores: list[float] = []
    inside: dict[str, list[float]] = {"cold": [], "restored": []}  # the compile and first call, in the process

    def cold(r: int) -> float:
        wall, result = worker(script, *mode, env={**env, own: tempfile.mkdtemp(dir=tmp)})
        inside["cold"].append(result["seconds"])
        return wall

    def restored(r: int) -> float:
        dest = tempfile.mkdtemp(dir=tmp)
        restores.append(restore(manifest, cache, {**env, var: dest}, *extra_flags))
        wall, result = worker(script, *mode, env={**env, own: dest})
        if family == "inductor" and result["inductor"].get("fxgraph_cache_miss"):
            raise RuntimeError(f"the restored Inductor cache missed: {result}")
        inside["restored"].append(result["seconds"])
        return restores[-1] + wall

    samples = alternate({f"{family}: cold first start": cold, f"{family}: prestart + restored start": restored},
                        rounds)
    rows = summarize(samples, f"{family}: cold first start")
    rows.append({"variant": f"{family}: of which prestart", "median_s": statistics.median(restores),
                 "min_s": min(restores), "max_s": max(restores), "n": len(restores)})
    for side, xs in inside.items():
        rows.append({"variant": f"{family}: {side}, compile + first call in the process",
                     "median_s": statistics.median(xs), "min_s": min(xs), "max_s": max(xs), "n": len(xs)})
    return rows, {"restore_s": restores, "inside_s": inside, "units": len(manifest.read_text().splitlines())}


def restore_per_gib(tmp: Path, mib: int) -> dict:
    """Time restoring one DeepGEMM-layout unit of ``mib`` MiB into an empty directory, less a 1 KiB unit's time.

    The difference takes out what every ``prestart`` costs whatever it restores (its start, reading the
    manifest, opening the cache).
    """
    small = _restore_seconds(tmp / "small", 0)
    big = _restore_seconds(tmp / "big", mib)
    return {"unit_mib": mib, "restore_s": big, "restore_1kib_s": small,
            "s_per_gib": (min(big) - min(small)) * 1024 / mib}


def _restore_seconds(tmp: Path, mib: int) -> list[float]:
    tmp.mkdir()
    src, cache, manifest = tmp / "dg-src", tmp / "dg-cache", tmp / "dg.jsonl"
    script = (
        "import os, sys\nfrom pathlib import Path\nfrom jitwarm.cache import KernelCache\n"
        "from jitwarm.precompile import record\n"
        "with record(sys.argv[1], KernelCache(sys.argv[2])):\n"
        "    d = Path(os.environ['DG_JIT_CACHE_DIR']) / 'cache' / 'kernel.big.0'\n"
        "    d.mkdir(parents=True)\n"
        "    (d / 'kernel.cu').write_text('//')\n"
        f"    (d / 'kernel.cubin').write_bytes(os.urandom(({mib} << 20) or 1024))\n")
    env = {"DG_JIT_CACHE_DIR": str(src), "JITWARM_RECORD_CACHES": "deep_gemm"}
    run([sys.executable, "-c", script, str(manifest), str(cache)], env=env)
    return [restore(manifest, cache, {"DG_JIT_CACHE_DIR": tempfile.mkdtemp(dir=tmp)}) for _ in range(3)]


def bundle_sizes(tmp: Path, families: list[str]) -> list[dict]:
    rows = []
    for family in families:
        bundle = tmp / f"{family}.tar.gz"
        run(jitwarm_cmd("export", "--manifest", str(tmp / f"{family}.jsonl"), "--cache-dir",
                        str(tmp / f"{family}-cache"), str(bundle)))
        units = len((tmp / f"{family}.jsonl").read_text().splitlines())
        rows.append({"family": family, "units": units, "bundle_kib": bundle.stat().st_size / 1024})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--restore-mib", type=int, default=256)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="zero-jit-") as name:
        tmp = Path(name)
        sections, extra = {}, {}
        for family in ("inductor", "triton"):
            rows, extra[family] = family_case(tmp, family, args.rounds)
            sections[f"{family}: a node's first start (s)"] = rows
        per_gib = restore_per_gib(tmp, args.restore_mib)
        sections["restore time per GiB"] = [per_gib]
        sections["bundle size per family"] = bundle_sizes(tmp, ["inductor", "triton"])
    report("zero_jit", sections, {**extra, "seconds": time.perf_counter() - start}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
