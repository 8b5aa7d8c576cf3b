"""The sglang_jit backend against the real sglang 0.5.23 wheel: record a load_jit module, replay it for sm_90 on
this CPU-only box, and serve it to sglang's own loader with ``SGLANG_CRASH_ON_JIT_COMPILE=1``.

The module is sglang's ``clamp_position`` for int32 (``kernels/ops/attention/clamp_position.py:15-25``: one
54-line header, ``jit/csrc/elementwise/clamp_position.cuh``), the smallest CUDA module in the wheel: about 7 s of
nvcc here against 13 s for the DSV4 compress plan. Every sglang call runs in a subprocess with the wheel's
environment (``sglang_env``); one build is shared by the module's tests. No sglang function is replaced: the
loader that finds the leaf is sglang's, unmodified.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CUDA_HOME = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
MODULE = "sgl_kernel_jit_clamp_position_int32_t"

# Recording: the kernel module is imported first, as the scheduler imports sglang's kernels before load_plugins()
# starts a recording (clamp_position.py:8 binds load_jit at import; the recorder sees the call inside the loader
# anyway), and SGLANG_CRASH_ON_JIT_COMPILE stops load_jit after the record is written (loader.py:150-156), so
# recording compiles nothing.
RECORD = """
import sys, torch
from jitwarm.precompile import record
from sglang.kernels.jit.utils import override_jit_cuda_arch
from sglang.kernels.ops.attention import clamp_position
with record(sys.argv[1]), override_jit_cuda_arch(9, 0):
    try:
        clamp_position._jit_clamp_position_module(torch.int32)
    except RuntimeError as exc:
        assert "SGLANG_CRASH_ON_JIT_COMPILE" in str(exc), exc
    else:
        raise SystemExit("load_jit compiled while recording")
"""

# Describing needs sglang to accept the call and the toolchain to be where sglang looks for it.
DESCRIBE_ERRORS = """
import json
from jitwarm.kernels import KernelSpec, SpecError, ToolchainError
from jitwarm.kernels.libraries.sglang_jit import backend as sglang_jit
good = {"args": ["clamp_position", "int32_t"], "cuda_files": ["elementwise/clamp_position.cuh"],
        "cuda_wrappers": [["clamp_position", "ClampPosition<int32_t>::run"]]}
errors = {}
for name, call in (("unknown dependency", {**good, "extra_dependencies": ["no-such-dependency"]}), ("no nvcc", good)):
    params = {"call": json.dumps(call, sort_keys=True), "sglang": sglang_jit.installed_sglang(), "arch": "9.0a"}
    try:
        sglang_jit.description(KernelSpec("sgl_kernel_jit_clamp_position_int32_t", "sglang_jit", "sm_90", params))
        errors[name] = None
    except (SpecError, ToolchainError) as exc:
        errors[name] = [type(exc).__name__, str(exc)]
print(json.dumps(errors))
"""

# Replay through the one path, check, materialize twice, load into sglang's default dir ($SGLANG_JIT_CACHE_DIR).
REPLAY = """
import json, os, sys, time
from jitwarm.cache import KernelCache
from jitwarm.kernels.libraries.sglang_jit import backend as sglang_jit
from jitwarm.kernels.artifacts import artifact
from jitwarm.precompile.manifest import read_manifest, spec_of
manifest, root, served = sys.argv[1:]
[record] = read_manifest(manifest)
spec = spec_of(record)
cache = KernelCache(root)
start = time.perf_counter()
art = artifact(spec, cache)
described = time.perf_counter()
first = art.get_or_build(cache)
built = time.perf_counter()
again = art.get_or_build(cache)
entry = first.entry
sglang_jit.check(spec, entry.path)
library = sglang_jit.materialize(spec, entry, cache_dir=served)
inode = library.stat().st_ino
assert sglang_jit.materialize(spec, entry, cache_dir=served) == library and library.stat().st_ino == inode
kernel = sglang_jit.load(spec, entry)
try:
    kernel.run()
    run_error = None
except TypeError as exc:
    run_error = str(exc)
print(json.dumps({"key": art.key, "description": art.description, "outcomes": [first.outcome, again.outcome],
                  "files": list(entry.files), "entry": str(entry.path),
                  "sha256": {r.path: r.sha256 for r in entry.records}, "library": str(library),
                  "loaded": str(kernel.library), "preload": kernel.preload(), "run_error": run_error,
                  "describe_s": described - start, "build_s": built - described,
                  "manifest": json.loads((entry.path / "sglang_jit.json").read_text())}))
"""

# sglang's own loader, as a server with SGLANG_CRASH_ON_JIT_COMPILE=1 runs it: first on an empty cache dir (it
# must refuse, or the flag proves nothing), then on the materialized one. tvm-ffi dlopens the module
# (loader.py:270-273) with no GPU here: the CUDA runtime loads the driver lazily, and this module does not link
# -lcuda, so the whole load runs on this box, not just the cache decision.
SERVE = """
import json, os, sys, torch
from sglang.kernels.jit.utils import override_jit_cuda_arch
from sglang.kernels.jit.utils.compile import cache
with override_jit_cuda_arch(9, 0):
    from sglang.kernels.ops.attention import clamp_position
    try:
        clamp_position._jit_clamp_position_module(torch.int32)
        refused = None
    except RuntimeError as exc:
        refused = str(exc)
    os.environ["SGLANG_JIT_CACHE_DIR"] = sys.argv[1]
    module = clamp_position._jit_clamp_position_module(torch.int32)
    scopes = list(cache.cache_root().glob("*/*/build-*"))
    found = [str(cache.find_prebuilt(scope=s, module_name=s.parent.name)) for s in scopes]
    print(json.dumps({"refused": refused, "module": type(module).__name__, "export": str(module.clamp_position),
                      "found": found}))
"""


def _start(script: str, env: dict[str, str], *args: str | Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", script, *map(str, args)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _result(proc: subprocess.Popen, timeout: float = 300) -> dict:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-8000:]
    lines = out.strip().splitlines()
    return json.loads(lines[-1]) if lines else {}


def _run(script: str, env: dict[str, str], *args: str | Path, timeout: float = 300) -> dict:
    return _result(_start(script, env, *args), timeout)


@pytest.fixture(scope="module")
def base_env(sglang_env, tmp_path_factory) -> dict[str, str]:
    """The wheel's environment, without a developer's JITWARM_*/SGLANG_* knobs, with CUDA_HOME set.

    The scripts that stand in for the server import sglang and torch, which make Inductor's directory: a
    temporary one here, not ``~/.cache/sglang/inductor`` of whoever runs the tests.
    """
    kept = {k: v for k, v in os.environ.items() if not k.startswith(("JITWARM_", "SGLANG_"))}
    return {**kept, **sglang_env, "CUDA_HOME": CUDA_HOME, "PYTHONWARNINGS": "ignore",
            "TORCHINDUCTOR_CACHE_DIR": str(tmp_path_factory.mktemp("inductor")),
            "JITWARM_RECORD_CACHES": "none"}  # load_jit records only (the JIT cache units: test_jit_caches_*.py)


@pytest.fixture(scope="module")
def replay(base_env, tmp_path_factory) -> dict:
    """One record, one replay and one serving run, shared by the tests below."""
    if not (Path(CUDA_HOME) / "bin" / "nvcc").is_file():
        pytest.skip(f"no nvcc at {CUDA_HOME}/bin/nvcc: sglang's JIT builds with $CUDA_HOME/bin/nvcc (set CUDA_HOME)")
    tmp = tmp_path_factory.mktemp("sglang-jit")
    # Beside the recording, on the other core: describing with no nvcc under $CUDA_HOME (its own sglang import).
    describe_errors = _start(DESCRIBE_ERRORS, {**base_env, "CUDA_HOME": str(tmp / "no-cuda")})
    try:
        manifest, recording_dir = tmp / "manifest.jsonl", tmp / "recording-jit"
        _run(RECORD, {**base_env, "SGLANG_CRASH_ON_JIT_COMPILE": "1", "SGLANG_JIT_CACHE_DIR": str(recording_dir)},
             manifest)
        served, default, cache = tmp / "served-jit", tmp / "server-default-jit", tmp / "cache"
        replayed = _run(REPLAY, {**base_env, "SGLANG_JIT_CACHE_DIR": str(default)}, manifest, cache, served,
                        timeout=900)
        # The build box exports a bundle; a node's prestart imports it into its own root (nothing to compile)
        # and hands the module to sglang: the node's SGLANG_JIT_CACHE_DIR is what the server then loads from.
        bundle, node, node_jit = tmp / "kernels.tar.gz", tmp / "node", tmp / "node-jit"
        cli_env = {**base_env, "SGLANG_JIT_CACHE_DIR": str(node_jit)}
        for args in (("export", "--cache-dir", cache, bundle),
                     ("prestart", "--cache-dir", node, "--bundle", bundle, "--json")):
            proc = subprocess.run([sys.executable, "-m", "jitwarm", args[0], "--manifest", str(manifest), "--target",
                                   "sm_90", *map(str, args[1:])], env=cli_env, capture_output=True, text=True,
                                  timeout=300)
            assert proc.returncode == 0, proc.stderr[-4000:]
        prestart = json.loads(proc.stdout.strip().splitlines()[-1])
        serving = _run(SERVE, {**base_env, "SGLANG_CRASH_ON_JIT_COMPILE": "1",
                               "SGLANG_JIT_CACHE_DIR": str(tmp / "empty")}, node_jit)
    finally:
        errors = _result(describe_errors)
    records = [json.loads(line) for line in manifest.read_text().splitlines()]
    return {**replayed, "tmp": tmp, "wheel": base_env["PYTHONPATH"], "manifest_path": manifest, "records": records,
            "recording_dir": recording_dir, "served": served, "default": default, "cache": cache,
            "node_jit": node_jit, "prestart": prestart, "serving": serving, "describe_errors": errors}


@pytest.mark.nvcc
def test_the_record_is_sglangs_call_and_recording_compiles_nothing(replay):
    [record] = replay["records"]
    assert (record["kind"], record["module"], record["target"]) == ("sglang_jit", MODULE, "sm_90")
    assert record["arch"] == {"major": 9, "minor": 0, "suffix": "a"}
    assert record["call"] == {"args": ["clamp_position", "int32_t"], "cuda_files": ["elementwise/clamp_position.cuh"],
                              "cuda_wrappers": [["clamp_position", "ClampPosition<int32_t>::run"]]}
    assert not replay["recording_dir"].exists()


@pytest.mark.nvcc
def test_replay_builds_once_what_sglang_keys(replay):
    description = replay["description"]
    key = description["sglang_key"]
    assert (description["format"], description["module"], description["arch"]) == (
        "jitwarm-sglang-jit/1", MODULE, "9.0a")
    assert key["target_tag"] == "sm90a" and len(key["build_key"]) == 16
    assert key["sources"][0][:2] == ["kernels", "csrc/elementwise/clamp_position.cuh"]
    assert "-DSGL_CUDA_ARCH=900" in key["flags"]["cuda_cflags"]
    text = json.dumps(description)  # no paths: sglang's anchors (cache.py:113-136) replace the roots
    for root in (replay["tmp"], Path(CUDA_HOME).resolve(), replay["wheel"], sys.prefix):
        assert str(root) not in text
    assert replay["outcomes"] == ["built", "hit"]
    leaf = replay["manifest"]["leaf"]
    assert leaf.startswith(f"sm90a/{MODULE}/build-{key['build_key']}/deps-")
    assert {f"{leaf}/{MODULE}.so", f"{leaf}/sgl_deps.json", "sglang_jit.json"} <= set(replay["files"])
    assert replay["manifest"]["driver"] in ("present", "stub", "absent")
    print(f"describe {replay['describe_s']:.1f} s, build {replay['build_s']:.1f} s "
          f"(load_jit child {replay['manifest']['build_seconds']:.1f} s)")


@pytest.mark.nvcc
def test_a_node_prestarted_from_the_bundle_serves_sglangs_loader_without_compiling(replay):
    prestart = replay["prestart"]
    assert prestart["ready"] and prestart["bundle"]["supplied"] == 1 and prestart["handed_over"] == 1
    assert prestart["totals"]["built"] == 0  # the node compiled nothing: the bundle had it
    serving = replay["serving"]
    assert "SGLANG_CRASH_ON_JIT_COMPILE forbids compiling" in serving["refused"]  # the flag is in force
    assert (serving["module"], serving["export"]) == ("Module", "ffi.Function")  # loaded from the leaf, no compile
    leaf = replay["manifest"]["leaf"]
    served = replay["node_jit"] / leaf
    assert serving["found"] == [str(served / f"{MODULE}.so")]
    for rel in (f"{MODULE}.so", "sgl_deps.json"):
        assert hashlib.sha256((served / rel).read_bytes()).hexdigest() == replay["sha256"][f"{leaf}/{rel}"]
    assert not list(served.parent.glob(".staging-*"))  # the copy was renamed into place


@pytest.mark.nvcc
def test_warm_with_the_manifest_hands_the_module_over_to_sglangs_cache_as_prestart_does(replay, base_env):
    """``warm --manifest`` in the server's image leaves the module where ``load_jit`` finds it (issue #21), and
    makes nothing outside the caches it was given: its sglang children, which import sglang and torch, made
    ``~/.cache/sglang/inductor`` (sglang's redirect of Inductor's directory) before they were given a scratch one."""
    warm_jit, home = replay["tmp"] / "warm-jit", replay["tmp"] / "home"
    home.mkdir()
    env = {k: v for k, v in base_env.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "XDG_CACHE_HOME")}
    proc = subprocess.run([sys.executable, "-m", "jitwarm", "warm", "--manifest", str(replay["manifest_path"]),
                           "--target", "sm_90", "--cache-dir", str(replay["cache"])], capture_output=True, text=True,
                          env={**env, "SGLANG_JIT_CACHE_DIR": str(warm_jit), "HOME": str(home)}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert sorted(home.rglob("*")) == []
    serving = _run(SERVE, {**base_env, "SGLANG_CRASH_ON_JIT_COMPILE": "1",
                           "SGLANG_JIT_CACHE_DIR": str(replay["tmp"] / "empty")}, warm_jit)
    assert "SGLANG_CRASH_ON_JIT_COMPILE forbids compiling" in serving["refused"]  # the flag is in force
    assert serving["found"] == [str(warm_jit / replay["manifest"]["leaf"] / f"{MODULE}.so")]  # loaded, no compile


@pytest.mark.nvcc
def test_load_materializes_into_sglangs_cache_dir_and_leaves_launching_to_the_server(replay):
    assert Path(replay["loaded"]) == replay["default"] / replay["manifest"]["leaf"] / f"{MODULE}.so"
    assert replay["preload"] == 0  # no CUDA device here
    assert "launched by the server" in replay["run_error"]


# Materializing needs no sglang import: the entry and a cache dir.
MATERIALIZE = """
import json, sys
from jitwarm.cache import KernelCache
from jitwarm.kernels.libraries.sglang_jit import backend as sglang_jit
from jitwarm.precompile.manifest import read_manifest, spec_of
manifest, root, key, served = sys.argv[1:]
[record] = read_manifest(manifest)
print(json.dumps({"library": str(sglang_jit.materialize(spec_of(record), KernelCache(root).lookup(key), served))}))
"""


@pytest.mark.nvcc
def test_concurrent_materializes_publish_one_leaf(replay, base_env):
    served = replay["tmp"] / "raced-jit"
    workers = [_start(MATERIALIZE, base_env, replay["manifest_path"], replay["cache"], replay["key"], served)
               for _ in range(4)]
    libraries = {_result(w, timeout=60)["library"] for w in workers}
    leaf = served / replay["manifest"]["leaf"]
    assert libraries == {str(leaf / f"{MODULE}.so")}
    assert sorted(p.name for p in leaf.parent.iterdir()) == sorted([".lock", leaf.name])  # no staging left
    assert hashlib.sha256((leaf / f"{MODULE}.so").read_bytes()).hexdigest() == replay["sha256"][
        f"{replay['manifest']['leaf']}/{MODULE}.so"]


@pytest.mark.nvcc
def test_materialize_refuses_a_changed_entry_and_names_a_cache_dir_it_cannot_write(replay, tmp_path):
    from jitwarm.cache import KernelCache
    from jitwarm.kernels import LoadError
    from jitwarm.kernels.libraries.sglang_jit import backend as sglang_jit
    from jitwarm.precompile.manifest import spec_of

    spec, entry = spec_of(replay["records"][0]), KernelCache(replay["cache"]).lookup(replay["key"])
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    with pytest.raises(sglang_jit.SglangCacheDirError, match=f"cannot write sglang's JIT cache {blocked}/jit: "):
        sglang_jit.materialize(spec, entry, blocked / "jit")
    changed = tmp_path / "entry"
    shutil.copytree(entry.path, changed)
    library = changed / replay["manifest"]["leaf"] / f"{MODULE}.so"
    library.chmod(0o755)
    data = bytearray(library.read_bytes())
    data[-1] ^= 0xFF
    library.write_bytes(bytes(data))
    with pytest.raises(LoadError, match=r"\.so does not match its cache entry \(sha256 differs\)$"):
        sglang_jit.materialize(spec, dataclasses.replace(entry, path=changed), tmp_path / "jit")
    assert not list((tmp_path / "jit").rglob("*.so"))  # nothing was left where sglang looks


@pytest.mark.nvcc
def test_a_prune_while_a_leaf_is_copied_into_sglangs_cache_keeps_the_entry(replay, tmp_path, monkeypatch):
    """The hand-over into sglang's cache reads the entry under its claim: a prune meanwhile skips it."""
    from jitwarm.cache import KernelCache
    from jitwarm.kernels.artifacts import Artifact
    from jitwarm.kernels.libraries.sglang_jit import backend as sglang_jit
    from jitwarm.precompile.manifest import spec_of

    shutil.copytree(replay["cache"], tmp_path / "cache")  # this test prunes: not the module's shared build
    cache = KernelCache(root=tmp_path / "cache", layers=())
    entry = cache.lookup(replay["key"])
    art = Artifact(spec_of(replay["records"][0]), entry.description, replay["key"])
    monkeypatch.setenv("SGLANG_JIT_CACHE_DIR", str(tmp_path / "jit"))
    real_copy, pruned = sglang_jit._copy_leaf, []

    def prune_then_copy(*args):  # the race made certain: a full prune while the leaf's files are read
        pruned.append(cache.prune(max_bytes=0))
        return real_copy(*args)

    monkeypatch.setattr(sglang_jit, "_copy_leaf", prune_then_copy)
    kernel = art.load(cache, entry)
    assert list(pruned[0].skipped_locked) == [replay["key"]] and not pruned[0].removed
    assert kernel.library.read_bytes()[:4] == b"\x7fELF" and cache.lookup(replay["key"]) is not None


SPEC_ERROR = """
import json, sys
from jitwarm.kernels import KernelSpec, SpecError
from jitwarm.kernels.libraries.sglang_jit import backend as sglang_jit
call = json.dumps({"args": ["clamp_position", "int32_t"]}, sort_keys=True, separators=(",", ":"))
spec = KernelSpec("sgl_kernel_jit_clamp_position_int32_t", "sglang_jit", "sm_90", {"call": call, "sglang": sys.argv[1]})
try:
    sglang_jit.description(spec)
except SpecError as exc:
    print(json.dumps({"error": str(exc)}))
"""


@pytest.mark.parametrize("where", ["wheel", "no sglang"])
def test_a_spec_needs_the_sglang_that_recorded_it(where, base_env):
    env = dict(base_env)
    if where == "no sglang":
        env.pop("PYTHONPATH")
    [message] = _run(SPEC_ERROR, env, "0.5.22", timeout=60).values()
    assert "\n" not in message
    if where == "wheel":
        assert message == (f"{MODULE}: recorded with sglang 0.5.22, but sglang 0.5.23 is installed here; record the "
                           "manifest again with this sglang")
    else:
        assert message.startswith("sglang is not importable here: the sglang_jit backend builds with the server's")


@pytest.mark.nvcc
def test_describing_needs_sglang_to_accept_the_call_and_nvcc_under_cuda_home(replay):
    errors = replay["describe_errors"]
    no_cuda = replay["tmp"] / "no-cuda"
    assert errors["unknown dependency"] == ["SpecError", "load_jit('clamp_position', 'int32_t'): ValueError: "
                                                         "Dependency no-such-dependency is not registered."]
    assert errors["no nvcc"] == [
        "ToolchainError", f"nvcc not found at {no_cuda}/bin/nvcc: sglang's JIT runs $CUDA_HOME/bin/nvcc "
        "(toolchain.py:42-88); set CUDA_HOME to the CUDA toolkit root"]


# A load_jit module reached inside capture: the guard's seal names it, whether sglang would compile it (an empty
# cache dir) or load it (the node's): either is a driver call inside the graph (loader.py:158, :270).
GUARDED = """
import json, torch
import sglang.kernels.jit.utils.compile.loader  # what the seal patches: the loader every load_jit call goes through
from jitwarm.precompile import CompileDuringCaptureError, capture_guard
from sglang.kernels.jit.utils import override_jit_cuda_arch
with override_jit_cuda_arch(9, 0):
    from sglang.kernels.ops.attention import clamp_position
    try:
        with capture_guard(seal_third_party=True):
            clamp_position._jit_clamp_position_module(torch.int32)
        print(json.dumps({"outcome": "ran"}))
    except CompileDuringCaptureError as exc:
        print(json.dumps({"outcome": "refused", "message": str(exc)}))
"""


@pytest.mark.nvcc
def test_the_guard_names_a_load_jit_compile_or_load_inside_capture(replay, base_env):
    empty, node = (_start(GUARDED, {**base_env, "SGLANG_JIT_CACHE_DIR": str(d)})
                   for d in (replay["tmp"] / "guarded-empty", replay["node_jit"]))
    for proc, what in ((empty, "compile"), (node, "load")):
        result = _result(proc, timeout=120)
        assert result["outcome"] == "refused", result
        assert result["message"].startswith(f"sglang load_jit module {MODULE} ({what} of "), result["message"]
