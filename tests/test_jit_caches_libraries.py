"""The cache families that cannot compile here, against the libraries' own code: the wheels sglang 0.5.23 pins.

Which is which (tests/jit_cache_trees.py and tests/workers/jit_library_trees.py say what is stood in for, why):

- FlashInfer 0.7.2: its own JitSpec generates the module's source and ``build.ninja``, the real ninja builds it
  (a stand-in compiler: no libcuda to link, 40 s of nvcc), its own functions say where the cache is, where the
  module, its ``.so`` and its lock are, and whether it is compiled. A restored module is fresh to the real ninja
  and FlashInfer's own ``build()`` compiles nothing.
- TileLang 0.1.12: its own cache class keys a real TIR function and saves it (a stand-in for the compiled
  kernel); each backend cache class's own ``_is_complete_cache_dir`` is the oracle for which units are complete,
  before and after a restore.
- CuTe DSL: sglang 0.5.23's own ``JITPersistentCache`` exports the objects (a stand-in compiled function).
- DeepGEMM (sgl-deep-gemm 0.2.3.post2): cannot run here (``import deep_gemm`` needs ``libnvrtc.so.13`` and a
  CUDA torch; deep_jit's C++20 cache code does not build with GCC 12); the hand-laid tree is checked against the
  cache code its wheel ships (``include/deep_jit/cache/disk.hpp``).

The wheels are installed once per machine (tests/jit_cache_wheels.py); without the index the tests skip.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import jit_cache_trees as trees
import jit_cache_wheels as wheels
import pytest
from precompile_fixtures import jitwarm

from jitwarm.cache import KernelCache
from jitwarm.kernels.libraries.jit_caches import census, cute_dsl, deep_gemm, flashinfer, tilelang
from jitwarm.precompile import record
from jitwarm.precompile.servers import cache_dirs

WORKER = Path(__file__).parent / "workers" / "jit_library_trees.py"


@pytest.fixture(scope="session")
def flashinfer_wheel():
    return wheels.installed("flashinfer")


@pytest.fixture(scope="session")
def tilelang_wheel():
    return wheels.installed("tilelang")


@pytest.fixture(scope="session")
def deep_gemm_wheel():
    return wheels.installed("deep_gemm")


def run_worker(env: dict[str, str], *args: str) -> dict:
    proc = subprocess.run([sys.executable, str(WORKER), *args], env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def flashinfer_env(wheel: Path, tmp_path: Path) -> tuple[dict[str, str], Path]:
    """FlashInfer's environment for a build under ``tmp_path/ws`` (sm_90a), its compiler stood in for."""
    cc, log = trees.stand_in_compiler(tmp_path / "cc", wheel / "flashinfer" / "data" / "include" / "flashinfer" /
                                      "activation.cuh")
    env = {"PYTHONPATH": str(wheel), "PATH": f"{wheel / 'bin'}{os.pathsep}{os.environ['PATH']}",
           "FLASHINFER_WORKSPACE_BASE": str(tmp_path / "ws"), "FLASHINFER_CUDA_ARCH_LIST": "9.0",
           "FLASHINFER_NVCC": str(cc), "CXX": str(cc)}
    return env, log


def ninja_plan(wheel: Path, build_dir: Path) -> str:
    """What the real ninja would do for the module (``-n``: nothing is run), with its reasons."""
    proc = subprocess.run([str(wheel / "bin" / "ninja"), "-n", "-d", "explain", "-C", str(build_dir), "-f",
                           str(build_dir / "build.ninja")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


def test_a_flashinfer_module_restored_is_where_flashinfer_looks_and_ninja_has_no_work(flashinfer_wheel, tmp_path,
                                                                                         monkeypatch):
    env, compiled = flashinfer_env(flashinfer_wheel, tmp_path)
    for var in ("FLASHINFER_WORKSPACE_BASE", "FLASHINFER_CUDA_ARCH_LIST"):
        monkeypatch.setenv(var, env[var])
    monkeypatch.setenv("JITWARM_RECORD_CACHES", "flashinfer")
    manifest, cache_dir = tmp_path / "m.jsonl", tmp_path / "cache"
    with record(manifest, KernelCache(cache_dir)) as recorder:
        built = run_worker(env, "flashinfer", "build")
    modules = built["modules"]
    assert all(m["is_compiled"] for m in modules) and len(compiled.read_text().splitlines()) == 6  # 4 objects, 2 .so
    root = flashinfer.LIBRARY.root({"FLASHINFER_WORKSPACE_BASE": env["FLASHINFER_WORKSPACE_BASE"]})
    assert str(root) == built["cache_dir"]  # where FlashInfer's jit/env.py puts its cache
    listed = flashinfer.LIBRARY.present(root)

    def unit_of(module: dict) -> str:
        return Path(module["build_dir"]).relative_to(root).as_posix()

    assert set(listed) == {unit_of(m) for m in modules}
    assert recorder.captured == {"flashinfer": 2}
    for m in modules:
        unit = unit_of(m)
        names = {Path(m["library"]).relative_to(root).as_posix(), f"{unit}/build.ninja", f"{unit}/.ninja_log",
                 f"{unit}/.ninja_deps", *(Path(s).relative_to(root).as_posix() for s in m["sources"])}
        assert names <= set(listed[unit]), listed[unit]
    decode = next(m for m in modules if m["name"].startswith("batch_decode"))
    config = Path(decode["sources"][0]).with_name("batch_decode_config.inc")  # included, named by no build line
    assert config.is_file() and config.relative_to(root).as_posix() in listed[unit_of(decode)]
    fd = os.open(decode["lock"], os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # FlashInfer's own build lock held: the module is being built
        assert set(flashinfer.LIBRARY.present(root)) == set(listed) - {unit_of(decode)}
    finally:
        os.close(fd)

    (tmp_path / "ws").rename(tmp_path / "ws.recorded")  # a fresh node: nothing at FlashInfer's cache
    time.sleep(0.05)  # the restore's own writes would be visibly later than the build's, were they kept
    proc = jitwarm("prestart", "--manifest", str(manifest), "--cache-dir", str(cache_dir), "--offline",
                   env={"FLASHINFER_WORKSPACE_BASE": env["FLASHINFER_WORKSPACE_BASE"]})
    assert proc.returncode == 0 and "placed 2" in proc.stderr, proc.stderr
    for m in modules:
        assert "no work to do" in ninja_plan(flashinfer_wheel, Path(m["build_dir"]))
    again = run_worker(env, "flashinfer", "build")  # FlashInfer's own build(): ninja runs, compiles nothing
    assert all(m["is_compiled"] for m in again["modules"]) and len(compiled.read_text().splitlines()) == 6

    build_dir = Path(decode["build_dir"])
    obj = next(build_dir.glob("*.cuda.o"))
    os.utime(obj)  # as a restore that wrote the object now and kept no time would leave it
    assert "no work to do" not in ninja_plan(flashinfer_wheel, build_dir)
    # ...and the ledger's census sees the rebuild FlashInfer's ninja then does in place (the same file names)
    where = {"FLASHINFER_WORKSPACE_BASE": env["FLASHINFER_WORKSPACE_BASE"]}
    before = census.snapshot(["flashinfer"], environ=where)
    ninja = [str(flashinfer_wheel / "bin" / "ninja"), "-C", str(build_dir), "-f", str(build_dir / "build.ninja")]
    subprocess.run(ninja, check=True, capture_output=True, env={**os.environ, **env}, timeout=60)
    assert len(compiled.read_text().splitlines()) == 8  # the object and the .so again
    assert set(census.added(before, census.snapshot(["flashinfer"], environ=where))
               .get("flashinfer", {})) == {unit_of(decode)}


def test_tilelang_units_are_the_kernel_directories_its_own_cache_classes_call_complete(tilelang_wheel, tmp_path,
                                                                                         monkeypatch):
    env = {"PYTHONPATH": str(tilelang_wheel), "TILELANG_CACHE_DIR": str(tmp_path / "tl")}
    monkeypatch.setenv("TILELANG_CACHE_DIR", env["TILELANG_CACHE_DIR"])
    monkeypatch.setenv("JITWARM_RECORD_CACHES", "tilelang")
    manifest, cache_dir = tmp_path / "m.jsonl", tmp_path / "cache"
    worker = None
    try:
        with record(manifest, KernelCache(cache_dir)) as recorder:
            worker = subprocess.Popen([sys.executable, str(WORKER), "tilelang", "write", "k1", "k2", "k3"],
                                      env={**os.environ, **env}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      text=True)
            out = json.loads(worker.stdout.readline())  # TileLang has saved its kernels (and waits)
        root = tilelang.LIBRARY.root({"TILELANG_CACHE_DIR": env["TILELANG_CACHE_DIR"]})
        assert str(root) == out["cache_dir"] and out["namespace"] == "0.1.12/linux-x86_64"
        written = {Path(p).relative_to(root).as_posix(): p for p in out["written"].values()}
        units = tilelang.LIBRARY.present(root)
        assert set(units) == set(written) and recorder.captured == {"tilelang": 3}
        for unit, files in units.items():
            assert set(files) == {f"{unit}/{p.name}" for p in Path(written[unit]).iterdir()}

        dst = tmp_path / "restored"
        proc = jitwarm("prestart", "--manifest", str(manifest), "--cache-dir", str(cache_dir), "--offline",
                       env={"TILELANG_CACHE_DIR": str(dst)})
        assert proc.returncode == 0 and "placed 3" in proc.stderr, proc.stderr
        k1, k2, _ = (dst / Path(p).relative_to(root) for p in out["written"].values())
        (k1 / "executable.so").unlink()  # torn by hand: TileLang must call these incomplete, and jitwarm too
        (k2 / "params.pkl").unlink()
        second = json.loads(worker.communicate(f"{dst}\n", timeout=120)[0].splitlines()[-1])
        assert worker.returncode == 0
        assert str(tilelang.LIBRARY.root({})) == second["default_cache_dir"]  # TILELANG_CACHE_DIR unset
        verdicts = second["verdicts"]
        listed = tilelang.LIBRARY.present(dst)
        assert len(verdicts) == 3
        for path, by_backend in verdicts.items():
            assert by_backend["tvm_ffi"] == (Path(path).relative_to(dst).as_posix() in listed), (path, by_backend)
        assert len(listed) == 1
    finally:
        if worker is not None and worker.poll() is None:  # a failed assertion: the worker still waits
            worker.kill()
            worker.communicate()


def test_cute_dsl_objects_are_the_ones_sglang_s_own_cache_exported(sglang_env, tmp_path):
    fingerprint_dir = tmp_path / "cute_aot" / ("5e" * 32)
    out = run_worker(sglang_env, "cute", str(fingerprint_dir), "rmsnorm", "fp8_gemm")
    where = {"SGLANG_CUTE_AOT_CACHE_DIR": str(tmp_path / "cute_aot")}
    root = cute_dsl.LIBRARY.root(where, cache_dirs("sglang", where))
    units = cute_dsl.LIBRARY.present(root)
    assert set(units) == {Path(p).relative_to(root).as_posix() for p in out["objects"].values()}
    assert list(fingerprint_dir.glob("*.lock")) and all(not u.endswith(".lock") for u in units)  # locks: no unit


def test_deep_gemm_units_follow_the_cache_code_its_wheel_ships(deep_gemm_wheel, tmp_path):
    disk = (deep_gemm_wheel / wheels.MARKER["deep_gemm"]).read_text()
    marker = re.search(r'kCommitFileName = "([^"]+)"', disk)
    assert marker and marker.group(1) == deep_gemm.COMMITTED
    assert 'get<std::string>("JIT_CACHE_DIR")' in disk and "find(':', begin)" in disk  # DG_ / DJ_ prefixes, a list
    assert 'paths.emplace_back(std::filesystem::path(home) / ".dj")' in disk
    assert 'dir / "cache" / entry_name' in disk and 'std::format("{}.{}", tag, digest)' in disk
    assert 'paths[0] / "tmp" / get_uuid()' in disk
    assert deep_gemm.LIBRARY.root({"HOME": str(tmp_path)}) == tmp_path / ".dj"
    assert deep_gemm.LIBRARY.root({"DJ_JIT_CACHE_DIR": f"{tmp_path}/w:/ro"}) == tmp_path / "w"
    trees.deep_gemm(tmp_path / "dg")
    [(unit, files)] = deep_gemm.LIBRARY.present(tmp_path / "dg").items()
    assert unit == "cache/sm90_fp8_gemm_1d2d.9f2c4e0a1b2c3d4e" and files[-1] != f"{unit}/.committed"
    assert deep_gemm.LIBRARY.commit_last(files)[-1] == f"{unit}/.committed"  # the marker is restored last
