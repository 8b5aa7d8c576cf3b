"""Drive real sglang 0.5.23 CUDA-graph backends' ``capture_one`` after sglang's own ``load_plugins()``.

Usage: ``python sglang_plugin_worker.py OUT.json [--plan [--tp N] [--then-strict]] [--probe]``. The environment
decides the plugin (``SGLANG_PLUGINS``, ``JITWARM_SGLANG_PLUGIN``, ``JITWARM_CONFIG``). The backends are
sglang's own classes; the only fakes are the two things a CPU box lacks: the GPU device module
(``synchronize``, ``graph(...)``) and the TP group (``barrier``), plus a recorder for ``torch.cuda.CUDAGraph``
(the CPU torch build raises on it). Every call to them is recorded, tagged with who made it (``sglang`` or
``jitwarm``), with the server's own post_warmup_hook and each forward, and the whole order is written to
OUT.json per backend and per way of passing ``post_warmup_hook`` (keyword, positional, absent).

``--plan`` first calls sglang's ``ModelRunner.__init__`` (patched by the plugin in plan mode) with a faked
``server_args`` holding the capture fields (``tp_size=N``); sglang's own body then stops at its first line
that needs a published config (``assert_published``), after the plugin's hook has started the warm;
``--then-strict`` calls it once more under ``JITWARM_STRICT=1``. At each ``CUDAGraph()`` the recorder also
notes how many plan specs are loaded and whether the guard is armed. ``--probe`` compiles a new Triton kernel, a
new Inductor graph and an sglang ``load_jit`` module outside any capture, then inside each backend's capture
(``capture_probes.py``; the faked device's graph context is what says "capturing").
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import types

CALLS: list[str] = []
PLAN_SPECS: list = []
PROBES: list = []  # --probe: the capture_probes module


def _capturing(on: bool) -> None:
    """The faked device's capture state (read by the probes' faked ``is_current_stream_capturing``)."""
    if PROBES:
        PROBES[0].CAPTURING[0] = on


def _who() -> str:
    """Which code made the recorded call: the nearest caller frame outside this file."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__") == __name__:
        frame = frame.f_back
    name = frame.f_globals.get("__name__", "?") if frame is not None else "?"
    return "jitwarm" if name.startswith("jitwarm") else "sglang" if name.startswith("sglang") else name


class FakeDeviceModule:
    """Fake #1: the GPU device module (``torch.cuda`` in a server)."""

    def synchronize(self) -> None:
        CALLS.append(f"synchronize[{_who()}]")

    @contextlib.contextmanager
    def graph(self, cuda_graph=None, pool=None, stream=None):
        CALLS.append("graph.enter")
        _capturing(True)
        try:
            yield
        finally:
            _capturing(False)
        CALLS.append("graph.exit")


class FakeTPGroup:
    """Fake #2: the TP group (a GroupCoordinator in a server); one rank."""

    world_size = 1

    def barrier(self) -> None:
        CALLS.append(f"barrier[{_who()}]")


class RecordedCUDAGraph:
    """Stands in for ``torch.cuda.CUDAGraph``, which the CPU build of torch cannot create."""

    def __init__(self, *args, **kwargs) -> None:
        entry = "CUDAGraph()"
        if PLAN_SPECS:
            from jitwarm.kernels import dispatch
            from jitwarm.precompile import guard

            loaded = sum(dispatch.is_loaded(s) for s in PLAN_SPECS)
            entry += f" loaded={loaded}/{len(PLAN_SPECS)} armed={guard.is_armed()}"
        CALLS.append(entry)

    def capture_begin(self, *args, **kwargs) -> None:
        CALLS.append("capture_begin")
        _capturing(True)

    def capture_end(self) -> None:
        _capturing(False)
        CALLS.append("capture_end")

    def instantiate(self) -> None:
        pass

    def replay(self) -> None:
        pass

    def reset(self) -> None:
        pass


def runner():
    """sglang's decode runner class without its __init__ (that needs a model and a GPU): the backends read
    only ``device_module`` and ``model_runner`` from it, and call its output-row methods."""
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner

    r = object.__new__(DecodeCudaGraphRunner)
    r.device_module = FakeDeviceModule()
    r.model_runner = None
    return r


def forward_fn(size: int, backend: str = ""):
    import torch

    calls = []

    def forward():
        CALLS.append("forward")
        calls.append(1)
        if PROBES:  # --probe: compile one new kernel of each JIT library inside the capture
            probes = PROBES[0]
            if backend == "tc_piecewise" and len(calls) == 2:  # sglang's FX backend captures this forward's pieces
                with probes.capturing():
                    probes.probe(f"{backend} capture", load_jit=True)
            elif probes.CAPTURING[0]:
                probes.probe(f"{backend} capture", load_jit=True)
        return torch.zeros(size, 4)
    return forward


def server_hook() -> None:
    CALLS.append("server_post_warmup_hook")


def make_backends() -> dict:
    from sglang.srt.model_executor.runner_backend.breakable_cuda_graph_backend import BreakableCudaGraphBackend
    from sglang.srt.model_executor.runner_backend.full_cuda_graph_backend import FullCudaGraphBackend
    from sglang.srt.model_executor.runner_backend.tc_piecewise_cuda_graph_backend import (
        TcPiecewiseCudaGraphBackend,
    )
    from sglang.srt.runtime_context import get_parallel

    backends = {"full": FullCudaGraphBackend(runner()), "breakable": BreakableCudaGraphBackend(runner())}
    # TcPiecewiseCudaGraphBackend.__init__ builds a CompilationConfig from the published server config, runs
    # the runner's dummy forwards over every capture size and installs torch.compile on the model
    # (tc_piecewise_cuda_graph_backend.py:94-111,154-220): it needs a loaded model. Its capture_one reads only
    # the two attributes set here (the same ones __init__ sets, :97-98).
    tc = object.__new__(TcPiecewiseCudaGraphBackend)
    tc._device_module, tc._tp_group = FakeDeviceModule(), get_parallel().tp_group
    backends["tc_piecewise"] = tc
    return backends


def capture(backend, how: str, size: int, name: str = "") -> list[str]:
    from sglang.srt.model_executor.runner.shape_key import ShapeKey

    CALLS.clear()
    key = ShapeKey(size=size)
    if how == "keyword":
        backend.capture_one(key, forward_fn(size, name), post_warmup_hook=server_hook)
    elif how == "positional":
        backend.capture_one(key, forward_fn(size, name), None, server_hook)
    else:
        backend.capture_one(key, forward_fn(size, name))
    return list(CALLS)


def start_model_runner(tp_size: int) -> str | None:
    """Call the real (patched) ModelRunner.__init__ with a faked server_args carrying the capture fields."""
    from sglang.srt.model_executor.model_runner import ModelRunner

    server_args = types.SimpleNamespace(cuda_graph_bs_decode=[1], cuda_graph_max_bs_decode=None,
                                        disable_cuda_graph=False, disable_cuda_graph_padding=False,
                                        speculative_algorithm=None, tp_size=tp_size, pp_size=1, dp_size=1, nnodes=1,
                                        enable_dp_attention=False)
    try:
        ModelRunner.__init__(object.__new__(ModelRunner), model_config=None, mem_fraction_static=0.8, gpu_id=0,
                             nccl_port=0, server_args=server_args)
    except Exception as exc:  # sglang's own body needs a published config and a model
        return f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    return None


def start_plan(tp_size: int, then_strict: bool) -> dict:
    """Start the model runner (again under JITWARM_STRICT=1 with ``then_strict``); report the plugin's plan."""
    import os

    from jitwarm.precompile.servers.sglang import plugin as sglang_plugin

    stopped = [start_model_runner(tp_size)]
    if then_strict:
        os.environ["JITWARM_STRICT"] = "1"  # read at each call, as JITWARM_* settings are
        stopped.append(start_model_runner(tp_size))
        del os.environ["JITWARM_STRICT"]
    from jitwarm.kernels import dispatch
    from jitwarm.precompile import guard

    plan = sglang_plugin._plan.plan if sglang_plugin._plan is not None else None
    PLAN_SPECS.extend(plan.specs if plan is not None else ())
    return {"model_runner_stopped_at": stopped, "plan_id": plan.plan_id if plan else None,
            "specs": [s.id for s in PLAN_SPECS], "jobs": sglang_plugin._plan.jobs if plan else None,
            "warm_started": bool(plan and sglang_plugin._plan.warm is not None),
            "loaded_before_capture": sum(dispatch.is_loaded(s) for s in PLAN_SPECS),
            "armed_before_capture": guard.is_armed()}


def main() -> None:
    # Everything runs in main(): the warm's builders are spawned processes, which re-import this file.
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="LOG %(name)s %(levelname)s %(message)s")
    import torch
    from sglang.srt.plugins import load_plugins

    load_plugins()  # discovers the jitwarm entry point from the installed metadata, then applies the hooks
    from sglang.srt.runtime_context import get_parallel

    out_path, flags = sys.argv[1], sys.argv[2:]
    plan_mode = "--plan" in flags
    tp_size = int(flags[flags.index("--tp") + 1]) if "--tp" in flags else 1
    result: dict = {"plan": start_plan(tp_size, "--then-strict" in flags) if plan_mode else None, "orders": {}}
    torch.cuda.CUDAGraph = RecordedCUDAGraph
    if "--probe" in flags:
        import capture_probes

        capture_probes.install()
        PROBES.append(capture_probes)
        capture_probes.probe("outside", load_jit=True)
    with get_parallel().override(tp_group=FakeTPGroup()):  # sglang's own override of the process's TP group
        backends = make_backends()
        for name, backend in backends.items():
            hows = ("keyword",) if PROBES else ("keyword", "positional", "absent")
            result["orders"][name] = {how: capture(backend, how, size=2, name=name) for how in hows}
    result["probes"] = PROBES[0].OUTCOMES if PROBES else None
    if plan_mode:
        from jitwarm.precompile.servers.sglang import plugin as sglang_plugin

        hook = sglang_plugin._plan.hook
        result["plan"]["device_target"] = hook.device.target if hook is not None else None
    with open(out_path, "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
