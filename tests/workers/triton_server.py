"""A server process for the record/replay/serve tests: its Triton JIT on a GPU that is only a target (mocked).

Usage: triton_server.py record MANIFEST | serve | serve-after FILE (touches FILE.ready-PID, waits for FILE)

``SERVER_TRITON_CACHE_DIR`` (benchmarks) makes Triton's own cache that directory instead of a private one.

There is no GPU here: a driver that reports device 0 and target sm_90 stands in for it (the one mock), so
Triton's real JIT runs up to and including its compile, and the cubins it would load. Triton's own cache is
a private directory per process (TRITON_CACHE_DIR), so a compile it skipped was found elsewhere: in jitwarm's
cache, when TRITON_CACHE_MANAGER names it. Every compile Triton starts is seen by its compilation listener,
which says whether Triton's stages ran (cache_hit False) or a cache answered. Prints one JSON line:
{"compiles": [{"name", "cache_hit"}], "recorded": N, "seconds": <the warmup, until every kernel is ready>}.
"""

import atexit
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import gpu_stub
from triton import knobs


def main() -> int:
    mode = sys.argv[1]
    if not os.environ.get("SERVER_TRITON_CACHE_DIR"):  # a directory of our own, removed when we exit
        own = tempfile.mkdtemp(prefix="own-triton-")
        atexit.register(shutil.rmtree, own, True)
    os.environ["TRITON_CACHE_DIR"] = os.environ.get("SERVER_TRITON_CACHE_DIR") or own
    knobs.cache.dir = os.environ["TRITON_CACHE_DIR"]
    gpu_stub.install()
    compiles = []

    def listener(*, src, metadata, metadata_group, times, cache_hit):
        compiles.append({"name": src.name, "cache_hit": cache_hit})

    knobs.compilation.listener = listener
    if mode == "serve-after":  # start together with the others: say it is ready, wait for the start signal
        signal = Path(sys.argv[2])
        Path(f"{signal}.ready-{os.getpid()}").touch()
        while not signal.exists():
            time.sleep(0.005)
    import server_kernels

    result = {}
    start = time.perf_counter()
    if mode == "record":
        from jitwarm.precompile import record

        with record(sys.argv[2]) as recorder:
            server_kernels.warm_up()
            server_kernels.warm_up()  # the second pass hits Triton's in-memory cache: nothing new to record
        result["recorded"] = recorder.recorded
    else:
        server_kernels.warm_up()
    result["seconds"] = time.perf_counter() - start
    result["compiles"] = compiles
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
