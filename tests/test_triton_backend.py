"""Triton backend contract: descriptions, signatures, argument checks and isolation (no compiles)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from jitwarm.cache.keys import key_of
from jitwarm.kernels import FAMILIES, KernelSpec, LoadError, ModelDims, VerifyLayout, specs_for, triton_kernels
from jitwarm.kernels import triton_backend as backend
from jitwarm.kernels.triton_launch import RUN_ARGS, bind, kernel_signature

WORKERS = Path(__file__).parent / "workers"
PLAN = KernelSpec("plan", "triton", "sm_90", {"ratio": 4, "threads": 128})
COMPRESSOR = KernelSpec("compressor", "triton", "cpu", {"ratio": 4, "head_dim": 64, "dtype": "float32",
                                                        "uniform": 0, "max_len": 3})
NORM_ROPE = KernelSpec("norm_rope", "triton", "cpu", {"head_dim": 64, "rope_dim": 32, "num_q_heads": 3,
                                                      "num_kv_heads": 1, "dtype": "bfloat16", "uniform": 1,
                                                      "max_len": 2})


def _absolute_paths(value):
    if isinstance(value, dict):
        return [p for v in value.values() for p in _absolute_paths(v)]
    if isinstance(value, list):
        return [p for v in value for p in _absolute_paths(v)]
    return [value] if isinstance(value, str) and value.startswith("/") else []


@pytest.mark.parametrize("target", ["sm_90", "sm_100", "sm_80", "cpu"])
def test_description_is_plain_json_without_paths(target):
    for spec in specs_for(VerifyLayout((3,) * 104 + (2,) * 24), ModelDims(), "triton", target):
        desc = backend.description(spec)
        assert json.loads(json.dumps(desc)) == desc
        assert _absolute_paths(desc) == []
        assert (desc["family"], desc["backend"], desc["target"]) == (spec.family, "triton", target)
        assert desc["params"] == spec.params_dict
        assert desc["source"]["triton_kernels.py"] == backend._source_digest()
        assert desc == backend.description(spec)  # deterministic


@pytest.mark.parametrize(("target", "cubin_arch"), [("sm_90", "sm_90a"), ("sm_100", "sm_100a"),
                                                   ("sm_80", "sm_80")])
def test_description_names_the_ptxas_triton_uses(target, cubin_arch):
    import triton
    from triton.backends.nvidia.compiler import get_ptxas

    tool = backend.description(KernelSpec("plan", "triton", target, {"ratio": 4, "threads": 32}))["toolchain"]
    assert tool["triton"] == triton.__version__
    assert len(tool["triton_key"]) == 64
    arch = int(target[3:])
    # Triton 3.9 assembles arch >= 90 with the wheel's ptxas-blackwell (CUDA 13.x), older arches and
    # older Tritons with its ptxas (CUDA 12.x): the description must name the one actually used.
    assert tool["ptxas"] == Path(get_ptxas(arch).path).name
    if triton.__version__.startswith("3.9"):
        assert tool["ptxas"] == ("ptxas-blackwell" if arch >= 90 else "ptxas")
    assert "release" in tool["ptxas_version"]
    assert tool["cubin_arch"] == cubin_arch


def test_cpu_description_is_interpreter_mode():
    tool = backend.description(COMPRESSOR)["toolchain"]
    assert tool["mode"] == "interpreter" and "ptxas" not in tool


def test_description_follows_kernel_source(tmp_path, monkeypatch):
    before = key_of(backend.description(PLAN))
    copy = tmp_path / "triton_kernels.py"
    copy.write_text(Path(triton_kernels.__file__).read_text() + "\n# an edit\n")
    monkeypatch.setattr(backend, "_KERNELS_PY", copy)
    assert key_of(backend.description(PLAN)) != before


def test_mixed_backends_never_share_a_key():
    pytest.importorskip("tvm_ffi", reason="apache-tvm-ffi is not installed")
    tvm_backend = pytest.importorskip("jitwarm.kernels.tvm_backend", reason="tvm_ffi backend unavailable")
    layout = VerifyLayout((3,) * 104 + (2,) * 24)
    keys = {}
    for name, module in (("triton", backend), ("tvm_ffi", tvm_backend)):
        for target in ("cpu", "sm_90"):
            for spec in specs_for(layout, ModelDims(), name, target):
                keys.setdefault(key_of(module.description(spec)), []).append(spec.id)
    assert all(len(ids) == 1 for ids in keys.values()), [ids for ids in keys.values() if len(ids) > 1]
    assert len(keys) == 2 * 2 * 5


@pytest.mark.parametrize("bad", [
    KernelSpec("plan", "tvm_ffi", "sm_90", {"ratio": 4, "threads": 32}),
    KernelSpec("plan", "triton", "gfx942", {"ratio": 4, "threads": 32}),
    KernelSpec("norm_rope", "triton", "cpu", {**NORM_ROPE.params_dict, "dtype": "float16"}),
    KernelSpec("sampler", "triton", "cpu", {})])
def test_unsupported_specs_raise_value_error(bad):
    with pytest.raises(ValueError):
        backend.description(bad)


@pytest.mark.parametrize("family", ["plan", "compressor", "norm_rope"])
def test_signature_matches_kernel_and_pins_runtime_ints(family):
    spec = {"plan": PLAN, "compressor": COMPRESSOR, "norm_rope": NORM_ROPE}[family]
    sig = kernel_signature(spec)
    fn = getattr(triton_kernels, FAMILIES[family].triton_kernel)
    assert tuple(fn.arg_names) == sig.arg_names
    assert tuple(n for n in sig.arg_names if n in RUN_ARGS[family]) == RUN_ARGS[family]
    constexpr = {name for name, ty in sig.types.items() if ty == "constexpr"}
    assert constexpr == set(sig.constexprs)
    assert {p.name for p in fn.params if p.is_constexpr} == constexpr
    # Run-time ints are never specialized, so Triton's JIT would compile exactly the planned variants.
    runtime_ints = {name for name, ty in sig.types.items() if ty == "i32"}
    assert runtime_ints == {p.name for p in fn.params if p.do_not_specialize}
    attrs = sig.attrs()
    for i, name in enumerate(sig.arg_names):
        want = [["tt.divisibility", 16]] if sig.types[name].startswith("*") else []
        assert attrs[(i,)] == want


def _norm_rope_args(n=4, dtype=torch.bfloat16):
    return [torch.zeros(n, 3, 64, dtype=dtype), torch.zeros(n, 1, 64, dtype=dtype),
            torch.zeros(n, dtype=torch.int32), torch.ones(64, dtype=dtype), torch.ones(64, dtype=dtype),
            1e-6, 10000.0]


def test_bind_orders_every_kernel_parameter():
    grid, args = bind(NORM_ROPE, _norm_rope_args())
    assert grid == (2, 1, 1)
    sig = kernel_signature(NORM_ROPE)
    assert len(args) == len(sig.arg_names)
    assert args[5:8] == (4, 1e-6, 10000.0)
    assert dict(zip(sig.arg_names[8:], args[8:], strict=True)) == sig.constexprs


@pytest.mark.parametrize(("index", "value", "match"), [
    (0, torch.zeros(5 * 3 * 64 + 1, dtype=torch.bfloat16)[1:].view(5, 3, 64)[:4], "16-byte aligned"),
    (0, torch.zeros(4, 3, 64, dtype=torch.float32), "must be torch.bfloat16"),
    (0, torch.zeros(4, 64, 3, dtype=torch.bfloat16).transpose(1, 2), "contiguous"),
    (1, torch.zeros(4, 2, 64, dtype=torch.bfloat16), "shape"),
    (2, torch.zeros(4, dtype=torch.int64), "torch.int32"),
    (4, torch.ones(32, dtype=torch.bfloat16), "k_weight must have shape"),
])
def test_bad_arguments_raise_value_error(index, value, match):
    args = _norm_rope_args()
    args[index] = value
    with pytest.raises(ValueError, match=match):
        bind(NORM_ROPE, args)


def test_uniform_spec_needs_whole_requests():
    with pytest.raises(ValueError, match="multiple of max_len"):
        bind(NORM_ROPE, _norm_rope_args(n=3))


def test_plan_refuses_more_requests_than_lanes():
    spec = KernelSpec("plan", "triton", "cpu", {"ratio": 4, "threads": 32})
    args = [torch.ones(33, dtype=torch.int32)] * 2 + [torch.zeros(34, dtype=torch.int32)] + \
        [torch.zeros(33, dtype=torch.int32)] * 3 + [torch.zeros(1, dtype=torch.int32)] * 2
    with pytest.raises(ValueError, match="33 requests exceed"):
        bind(spec, args)
    with pytest.raises(ValueError, match="takes 8 arguments"):
        bind(spec, args[:7])


def test_load_rejects_an_entry_of_another_spec(tmp_path):
    backend.build(COMPRESSOR, tmp_path)
    entry = SimpleNamespace(path=tmp_path, files=("launch.json",))
    assert backend.load(COMPRESSOR, entry).spec == COMPRESSOR
    other = KernelSpec("compressor", "triton", "cpu", {**COMPRESSOR.params_dict, "max_len": 4})
    with pytest.raises(LoadError, match="was built for"):
        backend.load(other, entry)
    with pytest.raises(LoadError, match="no launch.json"):
        backend.load(COMPRESSOR, SimpleNamespace(path=tmp_path, files=("x.so",)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_preload_without_cuda_says_so(tmp_path):
    launch = {"format": backend.FORMAT, "spec": PLAN.to_json(), "target": {"arch": 90}}
    (tmp_path / "launch.json").write_text(json.dumps(launch))
    kernel = backend.load(PLAN, SimpleNamespace(path=tmp_path, files=("launch.json",)))
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        kernel.preload()


def test_importing_kernels_does_not_import_triton():
    code = ("import sys, jitwarm.kernels, jitwarm.kernels.triton_launch; "
            "print('triton' in sys.modules, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_interpreter_copy_does_not_leak():
    """The cpu target's interpreter copy leaves the compiled kernels and Triton's flag untouched."""
    proc = subprocess.run([sys.executable, str(WORKERS / "triton_isolation.py")], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.splitlines()[-1])
    assert report == {"interpreted": "InterpretedFunction", "compiled": "JITFunction", "env": None,
                      "knob": False, "aot_after": True, "plan_ok": True}
