"""A start whose ledger is read back: Inductor, Triton through jitwarm's manager, or the sglang plugin's.

Usage: ``ledger_worker.py inductor record MANIFEST CACHE_DIR | inductor serve | inductor hit | triton | sglang``.
Each prints one JSON line: ``{"ledger": <LedgerReport.as_json()>, "lines": [...], ...}``.

- ``inductor``: ``torch.compile`` on the CPU (``TORCHINDUCTOR_CACHE_DIR`` set by the caller) of ``f``
  (``record``: inside jitwarm's recorder), and in ``serve`` also of ``g``, a different function; ``hit``: ``f``
  alone, as a restored start runs it.
- ``triton``: Triton's real JIT for sm_90 on a driver that only reports that target (the mock,
  ``gpu_stub.py``), through jitwarm's cache manager: ``server_kernels.warm_up()`` (``"cold"``: the ledger then),
  and again with the module reloaded, whose new kernels Triton compiles again: the manager finds each.
- ``sglang``: sglang's own ``load_plugins()``; ``ModelRunner.init_cuda_graphs`` is a stand-in (sglang's body
  needs a loaded model) that captures one graph per backend with the fakes of ``sglang_plugin_worker.py``
  (the device module and the TP group) and, as a TileLang compile would, writes a kernel directory into
  ``TILELANG_CACHE_DIR`` in TileLang's layout (``tests/jit_cache_trees.py``) and calls sglang's loader as two
  ``load_jit`` calls would (:func:`load_jit_twice`); the plugin's hook around it reports the ledger
  (``JITWARM_LEDGER``, and its lines on stderr). Prints the capture orders.
"""

import json
import logging
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: jit_cache_trees


def report(extra: dict) -> None:
    from jitwarm.precompile import ledger

    got = ledger.report_after_capture()
    print(json.dumps({"ledger": got.as_json(), "lines": got.lines(), **extra}))


def inductor(mode: str) -> None:
    from jitwarm.precompile import ledger

    ledger.begin()
    import torch

    def f(x):
        return torch.sin(x) * 2 + x.cos()

    def g(x):
        return torch.tanh(x) - x * 3

    if mode == "record":
        from jitwarm.cache import KernelCache
        from jitwarm.precompile import record

        with record(sys.argv[3], KernelCache(sys.argv[4])):
            torch.compile(f)(torch.randn(8))
    else:
        torch.compile(f)(torch.randn(8))
        if mode == "serve":
            torch.compile(g)(torch.randn(8))
    report({})


def triton() -> None:
    import atexit
    import shutil
    import tempfile

    import gpu_stub

    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="own-triton-")
    atexit.register(shutil.rmtree, os.environ["TRITON_CACHE_DIR"], True)  # nothing of ours left in /tmp
    gpu_stub.install()
    from jitwarm.kernels.libraries.triton import cache as triton_cache
    from jitwarm.precompile import ledger

    started = ledger.begin()
    triton_cache.serve()
    import importlib

    import server_kernels

    server_kernels.warm_up()
    cold = started.report().as_json()
    importlib.reload(server_kernels).warm_up()  # new JITFunctions: Triton compiles again, the manager answers
    report({"cold": cold})


def sglang() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="LOG %(name)s %(levelname)s %(message)s")
    import jit_cache_trees
    import sglang_plugin_worker as fakes
    import torch
    from sglang.srt.model_executor.model_runner import ModelRunner

    captured = []

    def init_cuda_graphs(self, capture_decode_cuda_graph=True):
        for name, backend in fakes.make_backends().items():
            captured.append((name, fakes.capture(backend, "keyword", size=2)))
        jit_cache_trees.tilelang(Path(os.environ["TILELANG_CACHE_DIR"]), key="compiled-in-capture")
        load_jit_twice(jit)

    jit = Path(os.environ["SGLANG_JIT_CACHE_DIR"])
    publish_a_build(jit)  # as prestart would have left it
    ModelRunner.init_cuda_graphs = init_cuda_graphs  # before load_plugins: the plugin's hook wraps it
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.runtime_context import get_parallel

    torch.cuda.CUDAGraph = fakes.RecordedCUDAGraph
    with get_parallel().override(tp_group=fakes.FakeTPGroup()):
        ModelRunner.init_cuda_graphs(object.__new__(ModelRunner))
    print(json.dumps({"captured": captured}))


def publish_a_build(root: Path) -> None:
    """One module's build published by sglang's own ``cache.commit_build`` (its bytes made up: never loaded)."""
    import types

    from sglang.kernels.jit.utils.compile import cache

    source = root / "kernel.cu"
    source.parent.mkdir(parents=True, exist_ok=True)
    source.write_text("// a JIT kernel's source")
    staging = root / "sm90" / "sgl_kernel_jit_restored" / "build-0123" / ".staging-0"
    staging.mkdir(parents=True)
    (staging / "sgl_kernel_jit_restored.so").write_bytes(b"\x7fELF")
    spec = types.SimpleNamespace(module_name="sgl_kernel_jit_restored", sources=(str(source),))
    cache.commit_build(spec, scope=staging.parent, staging=staging, dependencies=[source])


def load_jit_twice(root: Path) -> None:
    """sglang's loader as ``load_jit`` calls it (loader.py:135-160), its own functions on real directories.

    The published build is found (served); a module with no build is looked up again behind ``_build_lock``
    and not found, so load_jit would compile it (compiled). The compile itself (nvcc for sm_90) is left out:
    the loader's lookups are the signal.
    """
    import types

    from sglang.kernels.jit.utils.compile import loader

    served = root / "sm90" / "sgl_kernel_jit_restored" / "build-0123"
    spec = types.SimpleNamespace(module_name="sgl_kernel_jit_restored", sources=(str(root / "kernel.cu"),))
    assert loader._find_prebuilt(spec=spec, scope=served) is not None
    missing = root / "sm90" / "sgl_kernel_jit_new" / "build-4567"
    spec = types.SimpleNamespace(module_name="sgl_kernel_jit_new", sources=(str(root / "kernel.cu"),))
    assert loader._find_prebuilt(spec=spec, scope=missing) is None
    with loader._build_lock(missing):
        assert loader._find_prebuilt(spec=spec, scope=missing) is None


if __name__ == "__main__":
    {"inductor": lambda: inductor(sys.argv[2]), "triton": triton, "sglang": sglang}[sys.argv[1]]()
