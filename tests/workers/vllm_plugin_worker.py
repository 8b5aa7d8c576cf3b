"""Drive vLLM 0.33.0's real capture code after vLLM's own ``load_general_plugins()``, recording the call order.

Usage: ``python vllm_plugin_worker.py OUT.json [--plan] [--probe]``. The environment decides the plugin
(``VLLM_PLUGINS``, ``JITWARM_VLLM_PLUGIN``, ``JITWARM_CONFIG``). The code run is vLLM's: the V2 runner's
``CudaGraphManager.capture`` over two PIECEWISE and two FULL descriptors, and the V1 runner's
``GPUModelRunner._capture_cudagraphs`` (which calls ``_warmup_and_capture``) over two FULL descriptors. The ONLY
fakes are what a CPU box lacks: the device (``torch.accelerator.synchronize``, ``torch.cuda.Stream``,
``torch.cuda.CUDAGraph``, ``torch.cuda.graph``, the current stream) and the parallel groups (TP, PP and DP:
``barrier`` and ``graph_capture``). Every call to them is recorded, tagged ``[vllm]`` or ``[jitwarm]`` by caller,
with each model forward. Not faked but not fully built: the manager and the V1 runner are vLLM's classes made
without their ``__init__`` (which needs a loaded model), holding what capture reads; the model forward is the
factory the V2 runner hands to ``capture`` and, for V1, the runner's ``_dummy_run`` replaced by a recorder before
the plugins load (the plugin wraps whatever is there). ``--plan`` first calls the V2 runner's ``__init__`` (the
plugin starts the warm there, then vLLM's own body fails on this CPU box) with a ``vllm_config`` namespace holding
the capture fields. ``--probe`` compiles a new Triton kernel and a new Inductor graph outside any capture, then
inside the first capture of each path (``capture_probes.py``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from types import SimpleNamespace

CALLS: list[str] = []
PROBES: list = []  # --probe: the capture_probes module


def probe_inside(where: str) -> None:
    """--probe: compile a new kernel of each JIT library inside the first capture of each path (``where``)."""
    if PROBES and where not in {o["where"] for o in PROBES[0].OUTCOMES}:
        with PROBES[0].capturing():  # the device, faked: the stream captures (as inside vLLM's graph wrapper)
            PROBES[0].probe(where, load_jit=False)


def _who() -> str:
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__") == __name__:
        frame = frame.f_back
    name = frame.f_globals.get("__name__", "?") if frame is not None else "?"
    return "jitwarm" if name.startswith("jitwarm") else "vllm" if name.startswith("vllm") else name


class FakeGroup:
    """Fake: a parallel group (a GroupCoordinator in a server), one rank."""

    def __init__(self, name: str) -> None:
        self.name, self.world_size, self.rank_in_group = name, 1, 0
        self.is_first_rank = self.is_last_rank = True

    def barrier(self) -> None:
        CALLS.append(f"barrier[{_who()}]" if self.name == "tp" else f"{self.name}.barrier[{_who()}]")

    @contextlib.contextmanager
    def graph_capture(self, context=None):
        yield context


class RecordedCUDAGraph:
    def __init__(self, *args, **kwargs) -> None:
        CALLS.append("CUDAGraph()")
        driver_jit()


def driver_jit() -> None:
    """The device's driver JIT-compiling PTX at the first capture: its cache (``CUDA_CACHE_PATH``) gains an entry
    and its index, as the CUDA driver writes them (the ``ptx`` family's unit)."""
    import os
    from pathlib import Path

    root = os.environ.get("CUDA_CACHE_PATH")
    if root and not (Path(root) / "index").exists():
        (Path(root) / "sm90").mkdir(parents=True, exist_ok=True)
        (Path(root) / "sm90" / "0a1b2c3d").write_bytes(b"SASS for the captured graph")
        (Path(root) / "index").write_bytes(b"driver index")


@contextlib.contextmanager
def recorded_graph(graph, pool=None, stream=None, **kwargs):
    CALLS.append("graph.enter")
    IN_GRAPH.append(True)
    yield
    IN_GRAPH.pop()
    CALLS.append("graph.exit")


IN_GRAPH: list[bool] = []


def v2_forward(mode) -> None:
    CALLS.append(f"forward({mode.name})")
    if IN_GRAPH:  # a FULL graph: the forward runs inside torch.cuda.graph
        probe_inside("v2 FULL capture")
    elif mode.name != "NONE":  # PIECEWISE: vLLM's piecewise backend captures this forward's pieces
        probe_inside(f"v2 {mode.name} capture")


def install_fakes() -> None:
    import torch
    from vllm.distributed import parallel_state

    torch.accelerator.synchronize = lambda *a, **k: CALLS.append(f"synchronize[{_who()}]")
    torch.cuda.Stream = lambda *a, **k: SimpleNamespace(name="stream")
    torch.cuda.CUDAGraph = RecordedCUDAGraph
    torch.cuda.graph = recorded_graph
    torch.cuda.current_stream = lambda *a, **k: SimpleNamespace(name="stream")
    parallel_state._TP, parallel_state._PP, parallel_state._DP = FakeGroup("tp"), FakeGroup("pp"), FakeGroup("dp")


def v2_capture() -> list[str]:
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu import cudagraph_utils
    from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor, CudaGraphManager

    cudagraph_utils.current_stream = lambda: SimpleNamespace(name="stream")  # the device's current stream
    manager = object.__new__(CudaGraphManager)
    descs = {CUDAGraphMode.PIECEWISE: [BatchExecutionDescriptor(CUDAGraphMode.PIECEWISE, n, None) for n in (16, 8)],
             CUDAGraphMode.FULL: [BatchExecutionDescriptor(CUDAGraphMode.FULL, n, n, 1) for n in (16, 8)]}
    manager.__dict__.update(device="cpu", ubatch_runner=None, _capture_descs=descs, _max_full_descs_to_capture=None,
                            use_breakable_cg=False, graphs={}, pool=(0, 1), _capture_mem_samples=None,
                            vllm_config=SimpleNamespace(use_cumem_cudagraph_pool=False), _graphs_captured=False)

    def create_forward_fn(desc, warmup):
        CALLS.append(f"prepare({desc.cg_mode.name} {desc.num_tokens}{' warmup' if warmup else ''})")
        return v2_forward

    CALLS.clear()
    with contextlib.redirect_stderr(sys.stdout):  # tqdm's bar
        manager.capture(create_forward_fn)
    return list(CALLS)


def v1_capture(runner_cls) -> list[str]:
    from vllm.config.compilation import CUDAGraphMode
    from vllm.forward_context import BatchDescriptor

    runner = object.__new__(runner_cls)
    runner.__dict__.update(compilation_config=SimpleNamespace(cudagraph_num_of_warmups=1),
                           load_config=SimpleNamespace(use_tqdm_on_load=False),
                           parallel_config=SimpleNamespace(use_ubatching=False), lora_config=None)
    CALLS.clear()
    runner._capture_cudagraphs([BatchDescriptor(num_tokens=n, num_reqs=n, uniform=True) for n in (16, 8)],
                               CUDAGraphMode.FULL)
    return list(CALLS)


def fake_dummy_run(self, num_tokens, cudagraph_runtime_mode=None, *args, is_graph_capturing=False, **kwargs):
    """Stands in for the model forward of V1's dummy run (it needs a loaded model)."""
    CALLS.append(f"forward({cudagraph_runtime_mode.name} {num_tokens}{' capture' if is_graph_capturing else ''})")
    if is_graph_capturing:
        probe_inside(f"v1 {cudagraph_runtime_mode.name} capture")


def start_runner(tp_size: int) -> str:
    """Call the real (wrapped) V2 runner __init__ with a vllm_config namespace; vLLM's body then fails here."""
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    config = SimpleNamespace(
        compilation_config=SimpleNamespace(cudagraph_capture_sizes=[1, 2, 4, 8], max_cudagraph_capture_size=8,
                                           cudagraph_mode=SimpleNamespace(name="FULL_AND_PIECEWISE")),
        scheduler_config=SimpleNamespace(max_num_seqs=8, max_num_batched_tokens=64), speculative_config=None,
        model_config=SimpleNamespace(architectures=["DeepseekV4ForCausalLM"]),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp_size, world_size=tp_size))
    try:
        GPUModelRunner(config, "cpu")
    except Exception as exc:  # vLLM's own __init__ body needs a GPU and a model
        return type(exc).__name__
    return "constructed"


def main() -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="LOG %(name)s %(message)s")
    out, plan = sys.argv[1], "--plan" in sys.argv
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner as V1Runner

    V1Runner._dummy_run = fake_dummy_run  # before the plugins load: the plugin wraps what is there
    import vllm.plugins

    vllm.plugins.load_general_plugins()
    install_fakes()
    if "--probe" in sys.argv:
        import capture_probes

        capture_probes.install()
        PROBES.append(capture_probes)
        capture_probes.probe("outside", load_jit=False)
    result = {"manager": "TRITON_CACHE_MANAGER" in __import__("os").environ}
    if plan:
        result["runner_init"] = start_runner(2)
    result["v2"] = v2_capture()
    result["v1"] = v1_capture(V1Runner)
    from jitwarm.precompile.servers.vllm import plugin

    result["probes"] = PROBES[0].OUTCOMES if PROBES else None
    result["captured"] = dict(plugin._recorder.captured) if plugin._recorder is not None else None
    if plan:
        result["plan_specs"] = len(plugin._plan.plan.specs) if plugin._plan.plan is not None else None
    with open(out, "w", encoding="utf-8") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
