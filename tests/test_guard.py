"""The capture guard and the third-party seals (Triton's JIT, tvm-ffi's build and load): no GPU needed."""

import json
import os
import subprocess
import sys

import pytest
import tvm_ffi
import tvm_ffi.cpp
from precompile_fixtures import WORKERS

from jitwarm.precompile import CompileDuringCaptureError, capture_guard
from jitwarm.precompile import guard as guard_module

# CI's floor pass reruns the ones marked floor on the lowest apache-tvm-ffi setup.py allows (0.1.11: sglang's and
# vLLM's pin).
pytestmark = pytest.mark.tvm_ffi


def test_guard_arms_only_inside_the_block():
    assert not guard_module.is_armed()
    with capture_guard():
        assert guard_module.is_armed()
        with capture_guard():
            assert guard_module.is_armed()
        assert guard_module.is_armed()
    assert not guard_module.is_armed()


def test_guard_disarms_when_the_block_raises():
    with pytest.raises(KeyError), capture_guard():
        raise KeyError("boom")
    assert not guard_module.is_armed()


@pytest.mark.floor  # CI's floor pass: the seal patches tvm-ffi's own functions
@pytest.mark.parametrize("owner, name", [(tvm_ffi.cpp, "load_inline"), (tvm_ffi.cpp, "build_inline"),
                                         (tvm_ffi, "load_module")])
def test_tvm_ffi_seal_raises_inside_and_restores_after(owner, name, tmp_path):
    original = getattr(owner, name)
    with capture_guard(seal_third_party=True), pytest.raises(CompileDuringCaptureError) as info:
        getattr(owner, name)("late_kernel", cpp_sources="void f() {}") if name != "load_module" else \
            getattr(owner, name)(str(tmp_path / "late_kernel.so"))
    assert "late_kernel" in str(info.value) and f"{name}(" in str(info.value)
    assert "jitwarm warm --manifest" in str(info.value) and "run this kernel once for this shape" in str(info.value)
    assert getattr(owner, name) is original


@pytest.mark.floor
def test_tvm_ffi_seal_lets_calls_through_outside_capture(tmp_path):
    seal = guard_module.ThirdPartySeal()
    seal.install()
    try:
        with pytest.raises(RuntimeError, match="cannot open shared object file"):
            tvm_ffi.load_module(str(tmp_path / "missing.so"))  # reaches tvm-ffi itself: not our error
    finally:
        seal.remove()


def test_triton_seal_stops_a_jit_compile_and_is_removed_after(tmp_path):
    proc = subprocess.run([sys.executable, str(WORKERS / "triton_seal.py")], capture_output=True, text=True,
                          timeout=300, env={"TRITON_DEFAULT_FP_FUSION": "1", **os.environ,
                                            "TRITON_CACHE_DIR": str(tmp_path / "triton")})  # the compile after: here
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["outcome"] == "CompileDuringCaptureError"
    assert result["message"].startswith("Triton kernel __main__:add_one add_one[")  # module:qualname, then spec
    assert result["hook_restored"] and result["after"] == "compiled"


def test_dispatch_refuses_a_miss_while_capturing_even_without_the_guard(monkeypatch):
    """Mocked GPU (the only mock): CUDA 'available' and the current stream 'capturing'.

    A spec that is already loaded still runs; a miss raises before anything is built or loaded. The dispatcher
    starts empty (conftest resets it after every test) and builds into this test's own default cache.
    """
    import torch

    from jitwarm.kernels import VerifyLayout, dispatch, ops

    layout = VerifyLayout((1, 1))
    lens = torch.ones(2, dtype=torch.int32)
    ops.plan(layout, lens, torch.zeros(2, dtype=torch.int32), ratio=4)  # loaded before capture
    before = dispatch.counters()
    assert before["loads"] == 1
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # the GPU, mocked: a stream is capturing
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert not guard_module.is_armed()
    p = ops.plan(layout, lens, torch.zeros(2, dtype=torch.int32), ratio=4)  # a hit runs inside capture
    assert p.token_pos.tolist() == [0, 0]
    with pytest.raises(CompileDuringCaptureError,
                       match=r"kernel plan \[tvm_ffi, cpu\] \(ratio=128, threads=32\)"):
        ops.plan(layout, lens, torch.zeros(2, dtype=torch.int32), ratio=128)
    after = dispatch.counters()
    assert after["builds"] == before["builds"] and after["loads"] == before["loads"]


def test_each_server_room_seals_its_own_jit(monkeypatch, tmp_path, caplog):
    """The sglang room's seal (servers/sglang/loader.py, through its loader tap) on a stand-in of sglang's loader
    module: a look-up that finds a build (a load follows) or none (a compile follows) raises inside the guard, is
    logged once in ``warn`` mode, passes outside, and the loader's own functions are back after. The real loader
    is sealed in test_sglang_jit.py and inside the real capture path in test_sglang_plugin.py, against the wheel."""
    import logging
    import types

    from jitwarm.precompile.servers.sglang.loader import LOADER

    loader = types.ModuleType(LOADER)
    leaf = tmp_path / "sm90a" / "sgl_kernel_jit_clamp" / "build-k" / "deps-d" / "sgl_kernel_jit_clamp.so"
    loader.BuildSpec = lambda **kwargs: kwargs
    loader.load_jit = lambda *args, cuda_files=None: None
    loader._find_prebuilt = lambda *, spec, scope: leaf if scope.name == "hit" else None
    loader._build_lock = lambda scope: "built"
    originals = (loader.BuildSpec, loader._find_prebuilt, loader._build_lock)
    monkeypatch.setitem(sys.modules, "sglang", types.ModuleType("sglang"))
    monkeypatch.setitem(sys.modules, LOADER, loader)
    miss = types.SimpleNamespace(module_name="sgl_kernel_jit_late")
    with capture_guard(seal_third_party=True):
        with pytest.raises(CompileDuringCaptureError, match=r"sglang load_jit module sgl_kernel_jit_clamp \(load of"):
            loader._find_prebuilt(spec=None, scope=tmp_path / "hit")
        with pytest.raises(CompileDuringCaptureError, match=r"sglang load_jit module sgl_kernel_jit_late \(compile of"):
            loader._find_prebuilt(spec=miss, scope=tmp_path / "miss")
    assert (loader.BuildSpec, loader._find_prebuilt, loader._build_lock) == originals
    assert loader._find_prebuilt(spec=None, scope=tmp_path / "hit") == leaf
    seal = guard_module.ThirdPartySeal(mode="warn", when=lambda: True, log=logging.getLogger("seal-test"))
    assert "sglang load_jit" in seal.install()
    try:  # warn: logged once per kernel, and the call goes on
        with caplog.at_level(logging.WARNING, logger="seal-test"):
            assert [loader._find_prebuilt(spec=miss, scope=tmp_path / "miss") for _ in range(2)] == [None, None]
    finally:
        seal.remove()
    assert [r.getMessage().split(" is compiled")[0] for r in caplog.records] == [
        f"jitwarm: sglang load_jit module sgl_kernel_jit_late (compile of {tmp_path / 'miss'})"]
    seal = guard_module.ThirdPartySeal()
    seal.install()
    try:  # installed but not armed: calls go through
        assert loader._find_prebuilt(spec=miss, scope=tmp_path / "miss") is None
    finally:
        seal.remove()
    assert (loader.BuildSpec, loader._find_prebuilt, loader._build_lock) == originals


def test_inductor_seal_logs_each_graph_once_even_where_a_freed_graphs_address_is_reused(monkeypatch, caplog):
    """In ``warn`` mode each Inductor compile inside capture is logged once per graph. A graph was known by its
    id(), which the next graph takes once the first is freed: a second compile inside capture went unlogged (the
    real vLLM plugin test saw 2 warnings of 3, by chance). Here the reuse is made certain, on a stand-in of
    ``torch._inductor.compile_fx`` whose compile does nothing; real Inductor compiles inside vLLM's real capture
    path are test_vllm_plugin.py's."""
    import logging
    import types

    compile_fx = types.ModuleType("torch._inductor.compile_fx")
    compile_fx.fx_codegen_and_compile = lambda gm, *args, **kwargs: "compiled"
    monkeypatch.setitem(sys.modules, "torch._inductor.compile_fx", compile_fx)

    class Graph:  # what the seal reads of an FX GraphModule
        # Over pymalloc's 512 bytes, so malloc hands a freed graph's block straight back: within pymalloc the
        # block could wait behind other pools past the loop's bound on a busy heap (a flake under xdist).
        __slots__ = ("graph", "__weakref__", *(f"_pad{i}" for i in range(72)))

        def __init__(self) -> None:
            self.graph = types.SimpleNamespace(nodes=[1, 2, 3])

    seal = guard_module.ThirdPartySeal(mode="warn", when=lambda: True, log=logging.getLogger("seal-test"))
    assert "Inductor compile" in seal.install()
    try:
        with caplog.at_level(logging.WARNING, logger="seal-test"):
            first = Graph()
            assert compile_fx.fx_codegen_and_compile(first) == "compiled"
            address, kept = id(first), []
            del first
            second = Graph()
            while id(second) != address and len(kept) < 10_000:  # CPython hands the freed block out again
                kept.append(second)
                second = Graph()
            assert id(second) == address, "no new graph took the freed one's address"
            for _ in range(2):  # the second graph: logged once, however often it is compiled
                assert compile_fx.fx_codegen_and_compile(second) == "compiled"
    finally:
        seal.remove()
    assert [r.getMessage().split(" is compiled")[0] for r in caplog.records] == [
        "jitwarm: Inductor compile of an FX graph (3 nodes)"] * 2
