"""A real sglang start (sglang 0.5.23's CPU engine and graph runner, tests/sglang_cpu.py): graph capture and ready.

Three starts per round, ready when ``/health`` answers 200, each with ``--enable-torch-compile
--torch-compile-max-bs N`` (one Inductor graph per decode batch size, compiled at capture):

- ``cold``: a node with empty caches (``SGLANG_CACHE_DIR``, ``TMPDIR``): what every new node pays;
- ``sglang warm``: the same node started again: its own caches from the cold start (a pod that kept its disk);
- ``jitwarm restored``: a fresh node after ``jitwarm prestart --offline`` of the bundle one ``jitwarm capture``
  of the same line made (the capture runs once, before the rounds; prestart's own time is shown apart).

Per start: the graph capture's seconds (sglang's own ``Capture target decode CPU graph end ... elapsed``) and the
seconds to ``/health`` 200.

usage: python bench/real_server_sglang.py [--rounds 1] [--max-bs 4] [--out DIR]
       (or python bench/real_server.py sglang ...)
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from harness import ROOT, report

sys.path.insert(0, str(ROOT / "tests"))
import sglang_cpu  # noqa: E402  (the tests' server set: one install, one way to start and stop a server)
import vllm_cpu  # noqa: E402  (serving(): start, wait for /health, stop by process group)

VARIANTS = ("cold", "sglang warm", "jitwarm restored")


def start(server: sglang_cpu.SglangCpu, node: Path, max_bs: int) -> dict[str, float]:
    """One start on ``node``: its graph capture and ``/health`` seconds."""
    with vllm_cpu.serving(server, node, timeout=1800, args=("--torch-compile-max-bs", str(max_bs))) as (_, ready):
        pass
    seconds = sglang_cpu.capture_seconds((node / "server.log").read_text(errors="replace"))
    return {"capture": seconds[-1] if seconds else float("nan"), "health": ready}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--max-bs", type=int, default=4)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    scratch = Path(tempfile.mkdtemp(prefix="jitwarm-real-sglang-"))
    try:
        record = sglang_cpu.prepare(scratch / "set")
        installed = record.pop("install_seconds")
        server = sglang_cpu.SglangCpu(**{k: Path(v) for k, v in record.items()})
        line = [*server.serve(vllm_cpu.free_port()), "--torch-compile-max-bs", str(args.max_bs)]
        manifest, bundle = scratch / "server.jsonl", scratch / "kernels.tar"
        began = time.monotonic()
        captured = server.jitwarm("capture", "--manifest", str(manifest), "--export", str(bundle), "--timeout",
                                  "1800", "--", *line, env=server.env(scratch / "capture-node"))
        assert captured.returncode == 0, captured.stderr[-3000:]
        capture_s = time.monotonic() - began
        samples: dict[str, list[dict[str, float]]] = {name: [] for name in VARIANTS}
        prestart_s = []
        for r in range(args.rounds):
            node = scratch / f"node-{r}"
            samples["cold"].append(start(server, node, args.max_bs))
            samples["sglang warm"].append(start(server, node, args.max_bs))
            fresh = scratch / f"restored-{r}"
            began = time.monotonic()
            done = server.jitwarm("prestart", "--manifest", str(manifest), "--bundle", str(bundle), "--offline",
                                  env=server.env(fresh))
            assert done.returncode == 0, done.stderr
            prestart_s.append(time.monotonic() - began)
            samples["jitwarm restored"].append(start(server, fresh, args.max_bs))
            for name in VARIANTS:
                print(f"  round {r + 1}/{args.rounds} {name}: {samples[name][-1]}", file=sys.stderr, flush=True)
        rows = [{"start": name, "graph capture (s)": round(statistics.median(s["capture"] for s in got), 1),
                 "/health 200 (s)": round(statistics.median(s["health"] for s in got), 1), "n": len(got)}
                for name, got in samples.items()]
        extra = {"max_bs": args.max_bs, "install_s": installed, "capture_s": round(capture_s, 1),
                 "prestart_s": [round(s, 1) for s in prestart_s], "samples": samples}
        report("real_server_sglang", {f"sglang CPU graphs 1..{args.max_bs}: capture and ready (s)": rows}, extra,
               args.out)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
