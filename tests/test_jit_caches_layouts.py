"""The JIT cache families on trees in each library's own layout (tests/jit_cache_trees.py): which units are
complete, where each cache is resolved, capture into jitwarm's cache and restore through the real CLI, and the
hostile cases (a torn unit, a differing file the library wrote, several recorders at once, a full disk).

No library runs here: the trees are written in the library's layout and naming, with made-up bytes (the real
Inductor and Triton runs are in test_jit_caches_real.py).
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jit_cache_trees as trees
import pytest
from precompile_fixtures import jitwarm
from test_cache_write_errors import needs_mount, small_tmpfs

from jitwarm.cache import KernelCache
from jitwarm.kernels.libraries.jit_caches import MODULES, fingerprint
from jitwarm.kernels.libraries.jit_caches.census import added, library, snapshot
from jitwarm.precompile import record
from jitwarm.precompile.manifest import read_manifest
from jitwarm.precompile.servers import cache_dirs

#: Units each writer of tests/jit_cache_trees.py lays out (Inductor: a graph, an AOT entry, a module, a C++ kernel).
UNITS = {family: 4 if family == "inductor" else 1 for family in MODULES}


env_for = trees.env_for


@pytest.fixture
def point(monkeypatch):
    def at(base: Path) -> dict[str, str]:
        env = env_for(base)
        for var, value in env.items():
            monkeypatch.setenv(var, value)
        return env
    return at


@pytest.mark.parametrize("family", list(MODULES))
def test_each_family_lists_the_unit_its_library_wrote_whole(family, tmp_path):
    root = trees.cache_root(family, tmp_path)
    trees.WRITERS[family](root)
    units = library(family).present(root)
    assert len(units) == UNITS[family], units
    files = [rel for unit_files in units.values() for rel in unit_files]
    own = {".committed", ".ninja_log", ".ninja_deps"}  # the dot-files a library reads (DeepGEMM's marker, ninja's)
    assert all((Path(rel).name in own or not Path(rel).name.startswith(".")) and "tmp" not in rel.split("/")[:-1]
               for rel in files)
    assert all((root / rel).is_file() for rel in files)


def test_a_unit_the_library_has_not_finished_is_not_listed(tmp_path):
    t = tmp_path / "triton"
    trees.triton(t, group=False)  # the stages are there, the group (written last) is not
    assert library("triton").present(t) == {}
    d = tmp_path / "dg"
    trees.deep_gemm(d)
    next(d.glob("cache/*/.committed")).unlink()  # deep_jit's marker, written last: a lookup there is a miss
    assert library("deep_gemm").present(d) == {}
    tl = tmp_path / "tl"
    trees.tilelang(tl)
    next(tl.glob("*/*/kernels/*/executable.so")).unlink()
    assert library("tilelang").present(tl) == {}
    ind = tmp_path / "ind"
    trees.inductor(ind)
    (ind / "ha" / "cha2vxhltf3ggcv4o6ch3.main.so").unlink()  # the .cpp is written, its .so not built yet
    assert "ha/cha2vxhltf3ggcv4o6ch3" not in library("inductor").present(ind)


def test_a_unit_whose_build_lock_is_held_is_not_listed(tmp_path):
    ind, fi = tmp_path / "ind", tmp_path / "fi"
    trees.inductor(ind)
    trees.flashinfer(fi)
    locks = [ind / "locks" / "cha2vxhltf3ggcv4o6ch3.lock", fi / "0.7.2" / "90a" / "cached_ops" / "tmp" /
             "silu_and_mul.lock"]
    fds = [os.open(p, os.O_RDWR) for p in locks]
    try:
        for fd in fds:
            fcntl.flock(fd, fcntl.LOCK_EX)  # as filelock holds it while the compiler writes the .so in place
        assert "ha/cha2vxhltf3ggcv4o6ch3" not in library("inductor").present(ind)
        assert library("flashinfer").present(fi) == {}
    finally:
        for fd in fds:
            os.close(fd)
    assert "ha/cha2vxhltf3ggcv4o6ch3" in library("inductor").present(ind)
    assert len(library("flashinfer").present(fi)) == 1


def test_each_cache_is_resolved_as_its_library_and_sglang_resolve_it(tmp_path):
    home = str(Path("~").expanduser())
    base = {"SGLANG_CACHE_DIR": str(tmp_path / "sg")}
    expect_sglang = {"inductor": "sg/inductor", "triton": "sg/triton", "tilelang": "sg/tilelang",
                     "deep_gemm": "sg/deep_gemm", "cute_dsl": "sg/cute_aot", "flashinfer": "sg/.cache/flashinfer",
                     "ptx": "sg/nv"}
    for family, rel in expect_sglang.items():
        assert library(family).root(base, cache_dirs("sglang", base)) == tmp_path / rel, family
    plain = {"triton": f"{home}/.triton/cache", "tilelang": f"{home}/.tilelang/cache",
             "deep_gemm": f"{home}/.dj", "flashinfer": f"{home}/.cache/flashinfer",
             "ptx": f"{home}/.nv/ComputeCache"}
    for family, path in plain.items():
        assert str(library(family).root({})) == path, family
    # sglang's own variable wins over DeepGEMM's under sglang (compile_utils.py:51 overwrites DG_JIT_CACHE_DIR)
    both = {"SGLANG_DG_CACHE_DIR": str(tmp_path / "dg"), "DG_JIT_CACHE_DIR": str(tmp_path / "other")}
    assert library("deep_gemm").root(both, cache_dirs("sglang", both)) == tmp_path / "dg"
    assert library("deep_gemm").root(both) == tmp_path / "other"
    assert cache_dirs("sglang", {"SGLANG_CUTE_AOT_CACHE_DIR": ""})["cute_dsl"] is None  # an empty value: turned off
    assert library("triton").root({"TRITON_HOME": str(tmp_path)}) == tmp_path / ".triton" / "cache"



def test_a_tilde_that_cannot_be_expanded_is_left_as_the_libraries_leave_it_never_raised(tmp_path, monkeypatch):
    """``~name`` of no user (or no home at all): os.path.expanduser, which the libraries and sglang use, leaves it;
    Path.expanduser raised RuntimeError, which stopped the start-up ledger inside the server."""
    from jitwarm.precompile.ledger import Ledger

    odd = "~jitwarm-no-such-user/c"
    monkeypatch.chdir(tmp_path)
    assert library("triton").root({"TRITON_CACHE_DIR": odd}) == tmp_path / odd  # relative, as Triton reads it
    assert cache_dirs("sglang", {"SGLANG_CACHE_DIR": odd})["inductor"] == tmp_path / odd / "inductor"
    for var in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "SGLANG_CACHE_DIR", "VLLM_CACHE_ROOT", "TRITON_HOME"):
        monkeypatch.setenv(var, odd)
    assert Ledger().report() is not None


def test_a_census_diff_is_what_the_run_added(tmp_path):
    env = env_for(tmp_path)
    trees.inductor(Path(env["TORCHINDUCTOR_CACHE_DIR"]))
    before = snapshot(environ=env)
    trees.ptx(Path(env["CUDA_CACHE_PATH"]))
    trees.write(Path(env["TORCHINDUCTOR_CACHE_DIR"]) / "zz" / "czznew.py", "# a new module")
    new = added(before, snapshot(environ=env))
    assert new == {"inductor": {"zz/czznew": ("zz/czznew.py",)}, "ptx": {".": ("5/c/5c7e1a0f3b2d9e84", "index")}}
    trees.write(Path(env["CUDA_CACHE_PATH"]) / "7" / "1" / "71aa", b"another entry")  # the PTX unit grew
    assert set(added(before, snapshot(environ=env))["ptx"]) == {"."}


@pytest.fixture
def captured(tmp_path, point, monkeypatch):
    """A recording during which every family's library writes one unit: (manifest, cache dir, source trees)."""
    monkeypatch.setenv("JITWARM_RECORD_CACHES", "all")
    src = tmp_path / "src"
    point(src)
    manifest, cache_dir = tmp_path / "m.jsonl", tmp_path / "cache"
    with record(manifest, KernelCache(cache_dir)) as recorder:
        for family, writer in trees.WRITERS.items():
            writer(trees.cache_root(family, trees.home(src, family)))
    assert recorder.captured == UNITS
    assert recorder.recorded == 0  # kernel records (Triton, load_jit) only: units are counted in captured
    return manifest, cache_dir, src


def test_capture_stores_each_unit_and_names_it_in_the_manifest(captured):
    manifest, cache_dir, _ = captured
    records = read_manifest(manifest)
    assert sorted(r["library"] for r in records) == sorted(f for f, n in UNITS.items() for _ in range(n))
    by = {r["library"]: r for r in records}
    assert by["triton"]["target"] == "sm_90"  # read from the compile's own metadata
    assert set(by["inductor"]["fingerprint"]) == {"torch", "triton", "cxx", "arch"}
    assert by["ptx"]["fingerprint"].keys() == {"driver", "arch"}
    status = jitwarm("status", "--manifest", str(manifest), "--cache-dir", str(cache_dir))
    assert status.returncode == 0, status.stderr


def test_restore_puts_every_unit_where_the_library_looks_and_a_second_restore_finds_it(captured, tmp_path):
    manifest, cache_dir, src = captured
    dst = tmp_path / "dst"
    proc = jitwarm("prestart", "--manifest", str(manifest), "--cache-dir", str(cache_dir), "--offline",
                   "--allow-fingerprint-mismatch", env=env_for(dst))
    assert proc.returncode == 0, proc.stderr
    assert f"placed {sum(UNITS.values())}" in proc.stderr
    assert "triton unit" in proc.stderr and "arch 'sm_90'" in proc.stderr  # restored anyway, said
    for family in MODULES:
        a = trees.cache_root(family, trees.home(src, family))
        b = trees.cache_root(family, trees.home(dst, family))
        units = library(family).present(b)
        assert units.keys() == library(family).present(a).keys(), family
        for files in units.values():
            for rel in files:
                if "__grp__" in rel:  # Triton's group file names the destination's own paths
                    paths = json.loads((b / rel).read_text())["child_paths"].values()
                    assert all(Path(p).parent == (b / rel).parent and Path(p).is_file() for p in paths)
                else:
                    assert (b / rel).read_bytes() == (a / rel).read_bytes(), rel
    again = jitwarm("warm", "--manifest", str(manifest), "--cache-dir", str(cache_dir),
                    "--allow-fingerprint-mismatch", env=env_for(dst))
    assert again.returncode == 0 and f"present {sum(UNITS.values())}" in again.stderr, again.stderr


def test_a_fingerprint_that_differs_from_the_node_is_exit_4_naming_the_family_and_item(captured, tmp_path):
    manifest, cache_dir, _ = captured
    proc = jitwarm("prestart", "--manifest", str(manifest), "--cache-dir", str(cache_dir), "--offline",
                   env=env_for(tmp_path / "dst"))
    assert proc.returncode == 4
    assert proc.stderr.startswith("jitwarm: error: triton unit ") and "recorded with arch 'sm_90'" in proc.stderr
    assert "--allow-fingerprint-mismatch" in proc.stderr and proc.stderr.count("\n") == 1
    assert not (tmp_path / "dst").exists()  # refused before anything was restored
    assert fingerprint.differing({"torch": "2.13.0", "arch": "cpu"}, {"torch": "2.14.1", "arch": "cpu"}) == \
        ("torch", "2.13.0", "2.14.1")


def test_a_differing_file_the_library_wrote_is_kept_and_the_unit_not_restored(captured, tmp_path):
    manifest, cache_dir, src = captured
    dst = tmp_path / "dst"
    theirs = trees.write(dst / "inductor" / "nu" / "cnuzvpm3hgka6oqixh2.py", "# the node's own compile")
    cu = trees.write(dst / "deep_gemm" / "cache" / "sm90_fp8_gemm_1d2d.9f2c4e0a1b2c3d4e" / "kernel.cu",
                     "// the node's own")
    proc = jitwarm("prestart", "--manifest", str(manifest), "--cache-dir", str(cache_dir), "--offline",
                   "--allow-fingerprint-mismatch", env=env_for(dst))
    assert proc.returncode == 0, proc.stderr
    assert theirs.read_text() == "# the node's own compile" and cu.read_text() == "// the node's own"
    assert "kept 2" in proc.stderr and "the library's own" in proc.stderr
    assert not (cu.parent / "kernel.cubin").exists()  # never half a unit: the rest of it is not put beside theirs


RECORDER = """
import sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import jit_cache_trees as trees
from jitwarm.cache import KernelCache
from jitwarm.precompile import record
tmp, index, size = Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
with record(tmp / "m.jsonl", KernelCache(tmp / "cache")) as r:
    (tmp / f"ready-{index}").touch()
    while not (tmp / "go").exists():
        time.sleep(0.01)
    if index == 0:  # one library process compiles; every recorder sees the unit appear
        trees.deep_gemm(tmp / "dg")
        if size:
            trees.write(next((tmp / "dg").glob("cache/*.*")) / "kernel.cubin", bytes(size))
        (tmp / "written").touch()
    while not (tmp / "written").exists():
        time.sleep(0.01)
print(r.captured, flush=True)
"""


def recorders(tmp_path: Path, count: int, size: int = 0) -> list[subprocess.Popen]:
    """``count`` recording processes, each past its start snapshot; one of them then writes a DeepGEMM unit."""
    env = {**os.environ, "DG_JIT_CACHE_DIR": str(tmp_path / "dg"), "JITWARM_RECORD_CACHES": "deep_gemm"}
    procs = [subprocess.Popen([sys.executable, "-c", RECORDER, str(Path(__file__).parent), str(tmp_path), str(i),
                               str(size)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(count)]
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("ready-*"))) < count and time.monotonic() < deadline:
        time.sleep(0.02)
    (tmp_path / "go").touch()
    return procs


def test_several_recorders_capturing_one_unit_publish_one_entry(tmp_path):
    procs = recorders(tmp_path, 3)
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert all("'deep_gemm': 1" in out for out, _ in outs), outs  # each captured it
    assert len(read_manifest(tmp_path / "m.jsonl")) == 1  # the manifest names it once
    assert len(list((tmp_path / "cache").rglob("entry.json"))) == 1  # content-addressed: published once


def test_a_recorder_killed_while_it_captures_leaves_no_torn_entry_or_record(tmp_path):
    from jitwarm.kernels.artifacts import artifact
    from jitwarm.precompile.manifest import spec_of

    proc, = recorders(tmp_path, 1, size=48 << 20)  # hashing and copying 48 MiB takes a while
    deadline = time.monotonic() + 120
    while not (tmp_path / "written").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    cache = KernelCache(tmp_path / "cache")
    assert not cache.verify().corrupt
    records = read_manifest(tmp_path / "m.jsonl") if (tmp_path / "m.jsonl").exists() else []
    for rec in records:  # a record is appended only once its entry is sealed
        assert artifact(spec_of(rec)).lookup(cache) is not None


@needs_mount
def test_a_full_disk_restores_no_half_unit_and_stores_no_half_entry(tmp_path, point, monkeypatch):
    from jitwarm.precompile.manifest import append_records

    monkeypatch.setenv("JITWARM_RECORD_CACHES", "deep_gemm,inductor")
    src = point(tmp_path / "src")
    with record(tmp_path / "m.jsonl", KernelCache(tmp_path / "cache")):
        trees.deep_gemm(Path(src["DG_JIT_CACHE_DIR"]))
        trees.write(next(Path(src["DG_JIT_CACHE_DIR"]).glob("cache/*.*")) / "kernel.cubin", os.urandom(200 << 10))
        trees.write(Path(src["TORCHINDUCTOR_CACHE_DIR"]) / "ha" / "cbig.main.cpp", "// small, placed first")
        trees.write(Path(src["TORCHINDUCTOR_CACHE_DIR"]) / "ha" / "cbig.main.so", os.urandom(200 << 10))
    records = read_manifest(tmp_path / "m.jsonl")
    assert sorted(r["library"] for r in records) == ["deep_gemm", "inductor"]
    with small_tmpfs(tmp_path / "disk", size="64k") as disk:
        for rec in records:  # a directory staged and renamed (DeepGEMM), files linked one by one (Inductor)
            one = tmp_path / f"{rec['library']}.jsonl"
            append_records(one, [rec])
            proc = jitwarm("prestart", "--manifest", str(one), "--cache-dir", str(tmp_path / "cache"), "--offline",
                           env=env_for(disk))
            assert proc.returncode == 1 and "cannot restore" in proc.stderr, proc.stderr
            assert proc.stderr.count("\n") == 1
        assert [p for p in disk.rglob("*") if p.is_file()] == []  # no half unit, no staging or temp file
    with small_tmpfs(tmp_path / "full", size="64k") as full:
        monkeypatch.setenv("JITWARM_RECORD_CACHES", "deep_gemm")
        env = point(tmp_path / "src2")
        with record(tmp_path / "m2.jsonl", KernelCache(full / "cache")) as recorder:
            trees.deep_gemm(Path(env["DG_JIT_CACHE_DIR"]))
            trees.write(next(Path(env["DG_JIT_CACHE_DIR"]).glob("cache/*.*")) / "kernel.cubin",
                        os.urandom(96 << 10))
        assert recorder.captured == {} and not (tmp_path / "m2.jsonl").exists()
        assert not list((full / "cache").rglob("entry.json"))


def test_the_sglang_plugin_stores_what_each_graph_compiled_before_the_server_is_killed(tmp_path, point, monkeypatch):
    """The plugin's capture_one hook captures after each graph: a server ends by a signal, not by stop()."""
    from types import SimpleNamespace

    from jitwarm.precompile.servers.sglang import plugin

    monkeypatch.setenv("JITWARM_RECORD_CACHES", "tilelang")
    env = point(tmp_path / "src")
    recorder = record(tmp_path / "m.jsonl", KernelCache(tmp_path / "cache"))
    monkeypatch.setattr(plugin, "_recorder", recorder)
    calls = []
    # The one mock: the CUDA-graph backend's device and TP group, whose drain the hook runs after the warmup.
    backend = SimpleNamespace(_device_module=SimpleNamespace(synchronize=lambda: calls.append("sync")),
                              _tp_group=SimpleNamespace(barrier=lambda: calls.append("barrier")))

    def capture_one(backend, post_warmup_hook=None):
        trees.tilelang(Path(env["TILELANG_CACHE_DIR"]))  # the warmup compiles a TileLang kernel
        post_warmup_hook()
        return "graph"

    try:
        assert plugin._around_capture_one(capture_one, backend) == "graph"
        assert calls == ["sync", "barrier"]
        [rec] = read_manifest(tmp_path / "m.jsonl")  # stored when the graph was captured, not at the exit
        assert rec["library"] == "tilelang" and rec["unit"].endswith("/kernels/6f1b3c")
    finally:
        recorder.stop()


def test_a_recorded_group_file_not_in_tritons_format_is_one_line_and_the_entry_quarantined(tmp_path):
    """An entry whose Triton group file hashes to its record but is not a group (only a crafted manifest and
    entry can be that) is refused by the restore as a LoadError (quarantined, exit 1, one line), never a KeyError
    traceback from rewriting its paths; nothing is left at the destination."""
    import hashlib

    from jitwarm.kernels.artifacts import artifact
    from jitwarm.kernels.libraries.jit_caches.backend import unit_spec
    from jitwarm.precompile.manifest import append_records, unit_record

    data, rel = b'{"not": "a group"}', "ABCDEF/__grp__kernel.json"
    spec = unit_spec(library("triton"), "ABCDEF", {rel: hashlib.sha256(data).hexdigest()}, {"arch": "sm_90"},
                     "sm_90")
    cache = KernelCache(tmp_path / "cache")

    def capture(staging: Path) -> None:
        trees.write(staging / rel, data)

    key = artifact(spec, cache).get_or_build(cache, capture=capture).entry.key
    manifest = tmp_path / "m.jsonl"
    append_records(manifest, [unit_record(spec)])
    dest = tmp_path / "triton"
    proc = jitwarm("prestart", "--manifest", str(manifest), "--cache-dir", str(cache.root), "--offline",
                   "--allow-fingerprint-mismatch", env={"TRITON_CACHE_DIR": str(dest)})
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "is not a file triton wrote" in proc.stderr, proc.stderr
    assert cache.lookup(key) is None and list((cache.root / "v1" / "quarantine").iterdir())
    assert not dest.exists() or not any(p.is_file() for p in dest.rglob("*"))
