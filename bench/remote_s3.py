"""Object-store tier: a node's warm from an S3 bucket vs a local build vs the Redis tier; one large entry.

Plan section: each variant is a real `jitwarm warm` process on a fresh, empty cache root:
  compile (no remote)   builds every spec locally
  download (redis)      every spec downloaded from a Redis prefix filled once before the rounds
  download (s3)         every spec downloaded from a bucket filled once before the rounds
  compile + upload (s3) builds every spec and uploads it to a fresh bucket prefix (the fleet's first node)
Large-entry section (``--big-mib``): one entry holding one file of that size, uploaded and downloaded through
each store's own API in this process (upload, then a download into a fresh root), with the bytes each
moved (the store's objects for S3; the entry's hash for Redis). The order rotates every round; medians.
Bundle section (``--bundle-mib``): four entries of a quarter of that size each, exported to a file and to
``s3://`` and imported from each, every step a process of its own (export: ``KernelCache.export_bundle*``,
import: the ``jitwarm import`` CLI), with its wall time, peak RSS and the bundle's bytes.

usage: python bench/remote_s3.py [--plan dspark|tiny] [--target cpu] [--rounds 3] [--big-mib 1024]
                                 [--bundle-mib 1024] [--out DIR]
Starts its own redis-server and moto_server on free loopback ports (moto keeps objects in Python memory: a
lower bound on what a real S3 endpoint moves per second, not a measure of one). Needs the test extra.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from harness import DSPARK, alternate, jitwarm_cmd, report, run, summarize
from remote_download import TINY, start_redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from remote_fixtures import Bucket, MotoServer, s3_env  # noqa: E402

from jitwarm.cache import KernelCache, reset_remote_health  # noqa: E402


def plan_section(flags: list[str], redis_url: str, bucket: Bucket, scratch: Path, rounds: int) -> tuple[dict, dict]:
    """Wall seconds of `jitwarm warm` per variant, and the plan's size."""
    counter = iter(range(10**6))
    seeded_redis, seeded_s3 = f"bench-{uuid.uuid4().hex[:8]}", f"bench-{uuid.uuid4().hex[:8]}"

    def warm(remote: list[str]) -> tuple[float, dict, Path]:
        root = scratch / f"root{next(counter)}"
        wall, out = run(jitwarm_cmd("warm", *flags, "--json", "--cache-dir", str(root), *remote))
        return wall, json.loads(out.strip().splitlines()[-1]), root

    def timed(remote_of_round, expect: str):
        def variant(_round: int) -> float:
            wall, data, root = warm(remote_of_round())
            assert data["ok"] and data["totals"][expect] == len(data["specs"]), data["totals"]
            shutil.rmtree(root)
            return wall
        return variant

    _, seed, seed_root = warm(["--remote", redis_url, "--remote-prefix", seeded_redis])
    warm(["--remote", bucket.url, "--remote-prefix", seeded_s3])
    specs, size = len(seed["specs"]), KernelCache(root=seed_root, layers=()).size_bytes()
    samples = alternate({
        "compile (no remote)": timed(lambda: [], "built"),
        "download (redis)": timed(lambda: ["--remote", redis_url, "--remote-prefix", seeded_redis], "downloaded"),
        "download (s3)": timed(lambda: ["--remote", bucket.url, "--remote-prefix", seeded_s3], "downloaded"),
        "compile + upload (s3)": timed(lambda: ["--remote", bucket.url, "--remote-prefix",
                                                f"bench-{uuid.uuid4().hex[:8]}"], "built"),
    }, rounds)
    return samples, {"specs": specs, "entry_bytes": size}


def big_entry_section(mib: int, redis_url: str, bucket: Bucket, scratch: Path, rounds: int) -> list[dict]:
    """Upload and download one entry of one ``mib`` MiB file through each store; seconds and bytes moved."""
    payload = os.urandom(1 << 20) * mib  # incompressible per MiB; the stores do not compress anyway
    os.environ["JITWARM_REMOTE_MAX_BYTES"] = str(len(payload) + (1 << 20))
    rows = []
    # A Redis value holds at most 512 MB (proto-max-bulk-len): a larger entry is not uploaded there at all.
    stores = (("redis", redis_url), ("s3", bucket.url)) if mib <= 448 else (("s3", bucket.url),)
    for name, url in stores:
        ups, downs, moved = [], [], len(payload)
        for r in range(rounds):
            reset_remote_health()
            prefix = f"big-{uuid.uuid4().hex[:8]}"
            desc = {"kind": "bench-big", "mib": mib, "round": r}
            up = KernelCache(root=scratch / f"{name}-up{r}", layers=(), remote=url, remote_prefix=prefix)
            start = time.perf_counter()
            up.get_or_build(desc, lambda d: (d / "kernel.bin").write_bytes(payload))
            ups.append(time.perf_counter() - start)
            down = KernelCache(root=scratch / f"{name}-down{r}", layers=(), remote=url, remote_prefix=prefix)
            start = time.perf_counter()
            outcome = down.get_or_build_ex(desc, lambda d: (d / "kernel.bin").write_bytes(payload)).outcome
            downs.append(time.perf_counter() - start)
            assert outcome == "downloaded", outcome
            if name == "s3":  # every object of the entry: its blob and its record
                listed = bucket.client.list_objects_v2(Bucket=bucket.name, Prefix=f"fleet/{prefix}/v1/")
                moved = sum(o["Size"] for o in listed.get("Contents", []) if "/leases/" not in o["Key"])
            shutil.rmtree(scratch / f"{name}-up{r}")
            shutil.rmtree(scratch / f"{name}-down{r}")
            print(f"  round {r + 1}/{rounds} {name}: up {ups[-1]:.2f}s down {downs[-1]:.2f}s", file=sys.stderr)
        for what, xs in (("build + publish + upload", ups), ("download + verify + publish", downs)):
            median = statistics.median(xs)
            rows.append({"store": name, "step": what, "median_s": median, "MiB_per_s": mib / median,
                         "bytes_moved": moved})
    return rows


#: A child step that reports its own peak RSS (KiB, Linux) on its last stderr line.
_CHILD = """
import resource, runpy, sys
step, args = sys.argv[1], sys.argv[2:]
try:
    if step == "import":
        sys.argv = ["jitwarm", "import", *args]
        runpy.run_module("jitwarm.precompile", run_name="__main__")
    else:
        from jitwarm.cache import KernelCache
        root, dest, *keys = args
        cache = KernelCache(root=root, layers=())
        print(cache.export_bundle_to_store(keys, dest) if dest.startswith("s3://") else cache.export_bundle(keys, dest))
except SystemExit as exc:
    if exc.code:
        raise
finally:
    print("maxrss_kib", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)
"""


def _child(*args: str) -> tuple[float, float]:
    """Run one bundle step in a process of its own: (wall seconds, peak RSS MiB)."""
    import subprocess

    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _CHILD, *args], capture_output=True, text=True, cwd="/")
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"bundle step {args[:2]} exited {proc.returncode}: {proc.stderr[-2000:]}")
    rss = int(proc.stderr.strip().splitlines()[-1].split()[-1])
    return wall, rss / 1024


def bundle_section(mib: int, bucket: Bucket, scratch: Path, rounds: int) -> list[dict]:
    """A ``mib`` MiB bundle (four entries) exported to a file and to s3://, imported from each; per-step rows."""
    origin = KernelCache(root=scratch / "bundle-origin", layers=())
    chunk, quarter = os.urandom(1 << 20), max(1, mib // 4)  # incompressible per MiB; tar does not compress

    def build(staging: Path) -> None:
        with open(staging / "kernel.bin", "wb") as f:
            for _ in range(quarter):
                f.write(chunk)

    keys = [origin.get_or_build({"kind": "bench-bundle", "mib": mib, "i": i}, build).key for i in range(4)]
    url, path = f"s3://{bucket.name}/bundles/bench.tar", scratch / "bench.tar"
    samples: dict[str, list[tuple[float, float]]] = {k: [] for k in ("export file", "import file", "export s3://",
                                                                     "import s3://")}
    moved: dict[str, int] = {}
    for r in range(rounds):
        for where, target in (("file", str(path)), ("s3://", url)):
            samples[f"export {where}"].append(_child("export", str(origin.root), target, *keys))
            moved[where] = (path.stat().st_size if where == "file" else
                            bucket.client.head_object(Bucket=bucket.name, Key="bundles/bench.tar")["ContentLength"])
            dest = scratch / f"bundle-dest-{r}-{where[:4]}"
            samples[f"import {where}"].append(_child("import", "--cache-dir", str(dest), target))
            assert len(list(dest.glob("v1/entries/*/*"))) == 4
            shutil.rmtree(dest)
            print(f"  round {r + 1}/{rounds} {where}: export {samples[f'export {where}'][-1][0]:.1f}s, import "
                  f"{samples[f'import {where}'][-1][0]:.1f}s", file=sys.stderr, flush=True)
        path.unlink()
        bucket.client.delete_object(Bucket=bucket.name, Key="bundles/bench.tar")  # moto holds it in memory
    return [{"step": name, "median_s": statistics.median(w for w, _ in xs),
             "MiB_per_s": moved[name.split()[1]] / 2**20 / statistics.median(w for w, _ in xs),
             "peak_rss_MiB": max(m for _, m in xs), "bundle_bytes": moved[name.split()[1]]}
            for name, xs in samples.items()]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plan", choices=["dspark", "tiny"], default="dspark")
    ap.add_argument("--target", default="cpu")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--big-mib", type=int, default=1024, help="size of the large entry (0: skip)")
    ap.add_argument("--bundle-mib", type=int, default=1024, help="size of the bundle (0: skip)")
    ap.add_argument("--skip-plan", action="store_true", help="leave the plan section out")
    ap.add_argument("--out")
    args = ap.parse_args()
    flags = [*(DSPARK if args.plan == "dspark" else TINY), "--target", args.target]
    scratch = Path(tempfile.mkdtemp(prefix="jitwarm-bench-s3-"))
    redis, redis_url = start_redis(scratch)
    moto = MotoServer(scratch / "moto")
    os.environ.update(s3_env(moto.url))
    try:
        bucket = Bucket(moto.url)
        samples, facts = ({}, {"specs": 0, "entry_bytes": 0}) if args.skip_plan else plan_section(
            flags, redis_url, bucket, scratch, args.rounds)
        big = big_entry_section(args.big_mib, redis_url, bucket, scratch, args.rounds) if args.big_mib else []
        bundled = bundle_section(args.bundle_mib, bucket, scratch, args.rounds) if args.bundle_mib else []
    finally:
        redis.kill()
        redis.wait()
        moto.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    sections = {} if args.skip_plan else {
        f"warm {args.plan} plan ({facts['specs']} specs, {facts['entry_bytes'] / 2**20:.1f} MiB) on {args.target}, "
        f"wall seconds of `jitwarm warm`, {args.rounds} rounds": summarize(samples, "compile (no remote)")}
    if big:
        sections[f"one entry of {args.big_mib} MiB through each store, {args.rounds} rounds"] = big
    if bundled:
        sections[f"a {args.bundle_mib} MiB bundle (4 entries) to a file and to s3://, {args.rounds} rounds"] = bundled
    report("remote_s3", sections, extra={"plan": args.plan, "target": args.target, **facts, "samples": samples},
           out=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
