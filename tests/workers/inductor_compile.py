"""torch.compile of one small function on the CPU, optionally inside jitwarm's recorder.

Usage: inductor_compile.py record MANIFEST CACHE_DIR | run

Inductor's cache is ``TORCHINDUCTOR_CACHE_DIR`` (the caller sets it). Prints one JSON line:
{"inductor": <torch._dynamo.utils.counters["inductor"]>, "captured": <Recorder.captured, when recording>,
 "seconds": <the compile and first call>}.
"""

import json
import sys
import time


def main() -> int:
    import torch

    def f(x):
        return torch.sin(x) * 2 + x.cos()

    start = time.perf_counter()
    result = {}
    if sys.argv[1] == "record":
        from jitwarm.cache import KernelCache
        from jitwarm.precompile import record

        with record(sys.argv[2], KernelCache(sys.argv[3])) as recorder:
            torch.compile(f)(torch.randn(8))
        result["captured"] = recorder.captured
    else:
        torch.compile(f)(torch.randn(8))
    from torch._dynamo.utils import counters

    result.update(inductor=dict(counters["inductor"]), seconds=time.perf_counter() - start)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
