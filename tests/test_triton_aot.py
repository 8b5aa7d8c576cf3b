"""Ahead-of-time Triton builds on a GPU-less box: the DSpark-128 plan for sm_90 through the real cache.

Every cubin is checked with the ``cuobjdump`` shipped in the Triton wheel (architecture and kernel name);
a second warm of the same plan, in this process and in another one, builds nothing.
"""

from __future__ import annotations

import collections
import hashlib
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kernel_checks import dspark_config

from jitwarm.cache import KernelCache
from jitwarm.kernels import KernelSpec, ModelDims, VerifyLayout, specs_for
from jitwarm.kernels import triton_backend as backend
from jitwarm.kernels.triton_launch import kernel_signature
from jitwarm.precompile.plan import WarmPlan

triton = pytest.importorskip("triton")

WORKERS = Path(__file__).parent / "workers"
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
SPECS = WarmPlan.build(dspark_config("triton", "sm_90")).specs


def _layout_specs(lens: tuple[int, ...]) -> tuple[KernelSpec, ...]:
    return specs_for(VerifyLayout(lens), ModelDims(), "triton", "sm_90")


class Warmed:
    """One cold warm of the plan: the cache, entries, build outcomes and seconds per spec."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.cache = KernelCache(root, layers=(), lock_dir=root / "locks")
        self.entries, self.outcomes, self.seconds = {}, collections.Counter(), {}
        for spec in SPECS:
            start = time.perf_counter()
            result = self.cache.get_or_build_ex(backend.description(spec),
                                                lambda staging, spec=spec: backend.build(spec, staging))
            self.seconds[spec] = time.perf_counter() - start
            self.entries[spec] = result.entry
            self.outcomes[result.outcome] += 1


@pytest.fixture(scope="session")
def warmed(tmp_path_factory) -> Warmed:
    return Warmed(tmp_path_factory.mktemp("triton-aot-cache"))


def test_plan_is_the_30_specs_of_the_design():
    counts = collections.Counter(s.family for s in SPECS)
    assert (len(SPECS), counts) == (30, {"norm_rope": 8, "compressor": 16, "plan": 6})
    # The same set, computed from the compact layouts directly (docs/sglang.md).
    ladder = [*range(1, 9), *range(10, 33, 2), *range(40, 65, 4), *range(72, 129, 8)]
    direct = set()
    for bs in ladder:
        slots = min(bs * 6, 128)
        base, rem = divmod(bs * 6, slots)
        direct.update(_layout_specs((base + 1,) * rem + (base,) * (slots - rem)))
    assert direct == set(SPECS)


def test_cold_warm_builds_every_spec_once(warmed):
    assert warmed.outcomes == {"built": 30}
    assert len({e.key for e in warmed.entries.values()}) == 30
    print("AOT seconds:", {f: round(sum(t for s, t in warmed.seconds.items() if s.family == f), 2)
                           for f in ("plan", "compressor", "norm_rope")})


def test_entries_hold_cubin_metadata_and_launch_json(warmed):
    for spec, entry in warmed.entries.items():
        name = f"{spec.family}_kernel"
        assert set(entry.files) == {f"{name}.cubin", f"{name}.json", "launch.json"}
        launch = json.loads(entry.file("launch.json").read_text())
        meta = json.loads(entry.file(f"{name}.json").read_text())
        sig = kernel_signature(spec)
        assert launch["name"] == meta["name"] == name
        assert launch["num_warps"] == meta["num_warps"] == sig.num_warps
        assert launch["shared"] == meta["shared"] and launch["hash"] == meta["hash"]
        assert launch["target"] == {"backend": "cuda", "arch": 90, "warp_size": 32}
        assert KernelSpec.from_json(launch["spec"]) == spec
        for text in (entry.file("launch.json").read_text(), entry.file(f"{name}.json").read_text()):
            assert '"/' not in text, f"absolute path in {spec.id}: {text}"
        assert str(Path(backend.__file__).parent).encode() not in entry.file(f"{name}.cubin").read_bytes()


def _cuobjdump(cubin: Path) -> tuple[str, set[str]]:
    """Return the ELF's ``sm=`` arch and its kernel functions, as the wheel's cuobjdump reads them."""
    out = subprocess.run([str(CUOBJDUMP), "-elf", "-res-usage", str(cubin)], capture_output=True, text=True,
                         check=True).stdout
    arch = re.search(r"\bsm=(\w+)", out).group(1)  # "64-bit ELF: ... sm=90a" or "64bit elf: ... sm=80"
    functions = {line.split("Function", 1)[1].strip(" :") for line in out.splitlines()
                 if line.strip().startswith("Function ")}
    return arch, functions


@pytest.mark.skipif(not CUOBJDUMP.exists(), reason="the Triton wheel ships no cuobjdump")
def test_cubins_are_sm90_with_the_expected_kernel(warmed):
    for spec, entry in warmed.entries.items():
        arch, functions = _cuobjdump(entry.file(f"{spec.family}_kernel.cubin"))
        assert (arch, functions) == ("90a", {f"{spec.family}_kernel"}), spec.id


def test_second_warm_builds_nothing(warmed):
    again = KernelCache(warmed.root, layers=(), lock_dir=warmed.root / "locks")

    def must_not_build(staging):
        raise AssertionError("a warm cache rebuilt a spec")

    for spec, entry in warmed.entries.items():
        result = again.get_or_build_ex(backend.description(spec), must_not_build)
        assert (result.outcome, result.entry.key) == ("hit", entry.key)


def test_second_warm_in_another_process_builds_nothing(warmed):
    proc = subprocess.run([sys.executable, str(WORKERS / "triton_warm.py"), str(warmed.root), "sm_90"],
                          capture_output=True, text=True, timeout=300, cwd=WORKERS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.splitlines()[-1]) == {"outcomes": {"hit": 30}, "builds": 0}


def test_builds_are_byte_identical(tmp_path):
    spec = KernelSpec("compressor", "triton", "sm_90", {"ratio": 4, "head_dim": 128, "dtype": "bfloat16",
                                                        "uniform": 0, "max_len": 3})
    digests = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        backend.build(spec, tmp_path / name)
        digests.append({p.name: hashlib.sha256(p.read_bytes()).hexdigest()
                        for p in (tmp_path / name).iterdir()})
    assert digests[0] == digests[1]


@pytest.mark.parametrize(("target", "elf_arch"), [("sm_100", "100a"), ("sm_80", "80")])
@pytest.mark.skipif(not CUOBJDUMP.exists(), reason="the Triton wheel ships no cuobjdump")
def test_other_archs(tmp_path, target, elf_arch):
    for i, spec in enumerate(specs_for(VerifyLayout((3,) * 104 + (2,) * 24), ModelDims(), "triton", target)):
        (tmp_path / str(i)).mkdir()
        backend.build(spec, tmp_path / str(i))
        cubin = tmp_path / str(i) / f"{spec.family}_kernel.cubin"
        assert _cuobjdump(cubin) == (elf_arch, {f"{spec.family}_kernel"})
