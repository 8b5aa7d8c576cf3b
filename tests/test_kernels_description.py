"""The tvm-ffi cache description: what is in the key, what is not, and what changes it."""

from __future__ import annotations

import json
import shutil

import pytest

from jitwarm.cache import KernelCache
from jitwarm.kernels import KernelSpec, tvm_backend

# CI's floor pass (-m floor) reruns these on the lowest apache-tvm-ffi setup.py allows (0.1.11: sglang's and vLLM's
# pin): the description names tvm-ffi's version and headers.
pytestmark = [pytest.mark.tvm_ffi, pytest.mark.floor]

PLAN = KernelSpec("plan", "tvm_ffi", "cpu", {"ratio": 4, "threads": 128})
ROPE = KernelSpec("norm_rope", "tvm_ffi", "cpu", {"head_dim": 128, "rope_dim": 64, "num_q_heads": 16,
                                                  "num_kv_heads": 1, "dtype": "bfloat16", "uniform": 0,
                                                  "max_len": 3})


def test_description_fields_and_no_paths():
    desc = tvm_backend.description(ROPE)
    assert desc["family"] == "norm_rope" and desc["backend"] == "tvm_ffi" and desc["target"] == "cpu"
    assert desc["params"] == ROPE.params_dict
    assert len(desc["sources"]) == 64
    tc = desc["toolchain"]
    assert {"compiler", "host_compiler", "tvm_ffi", "flags", "arch", "link"} <= set(tc)
    assert tc["tvm_ffi"].startswith("0.")
    assert "-O2" in tc["flags"] and "-std=c++17" in tc["flags"]
    assert not any(f.startswith(("-I", "-L", "/")) for f in tc["flags"] + tc["link"])
    text = json.dumps(desc)
    assert "/work" not in text and "/tmp" not in text and "/usr" not in text
    KernelCache.key(KernelCache(layers=()), desc)  # plain JSON


def test_every_param_and_target_changes_the_key():
    base = tvm_backend.description(PLAN)
    for other in (KernelSpec("plan", "tvm_ffi", "cpu", {"ratio": 128, "threads": 128}),
                  KernelSpec("plan", "tvm_ffi", "cpu", {"ratio": 4, "threads": 64})):
        assert tvm_backend.description(other) != base


def test_source_digest_is_of_contents_not_paths(tmp_path, monkeypatch):
    before = tvm_backend.source_digest(ROPE)
    copy = tmp_path / "csrc"
    shutil.copytree(tvm_backend.CSRC, copy)
    monkeypatch.setattr(tvm_backend, "CSRC", copy)
    tvm_backend.forget_sources()
    try:
        assert tvm_backend.source_digest(ROPE) == before  # same bytes elsewhere: same digest
        with (copy / "common.cuh").open("a") as f:
            f.write("\n// an edit\n")
        tvm_backend.forget_sources()
        assert tvm_backend.source_digest(ROPE) != before
        assert tvm_backend.source_digest(PLAN) != before
    finally:
        tvm_backend.forget_sources()


@pytest.mark.parametrize("params", [
    {"ratio": 4},
    {"ratio": 4, "threads": 128, "extra": 1},
    {"ratio": 0, "threads": 128},
])
def test_specs_that_are_not_the_family_params_are_refused(params):
    with pytest.raises(ValueError):
        tvm_backend.description(KernelSpec("plan", "tvm_ffi", "cpu", params))


def test_unknown_family_backend_and_target_are_refused():
    with pytest.raises(ValueError, match="family"):
        tvm_backend.description(KernelSpec("softmax", "tvm_ffi", "cpu", {}))
    with pytest.raises(ValueError, match="tvm_ffi"):
        tvm_backend.description(KernelSpec("plan", "triton", "cpu", PLAN.params_dict))
    with pytest.raises(ValueError, match="target"):
        tvm_backend.description(KernelSpec("plan", "tvm_ffi", "sm_70", PLAN.params_dict))


def test_missing_compiler_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-jitwarm")
    with pytest.raises(RuntimeError, match="no-such-compiler-jitwarm"):
        tvm_backend.description(PLAN)


def test_translation_unit_instantiates_exactly_the_spec_params():
    unit = tvm_backend.translation_unit(ROPE)
    assert "jitwarm::norm_rope::Kernel<128, 64, 16, 1, jitwarm::bf16, false, 3>" in unit
    assert '#include "norm_rope.cuh"' in unit and ROPE.id in unit
