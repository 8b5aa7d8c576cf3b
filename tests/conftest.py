"""Shared pytest setup: every test runs with its own empty cache root and no inherited JITWARM_* env."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))  # fixture modules beside the tests (kernel_fixtures, precompile_fixtures)

import precompile_fixtures  # noqa: E402
import remote_fixtures  # noqa: E402

# Read before any test runs: _isolated_env drops every JITWARM_* variable from each test's environment.
TEST_REDIS_URL = os.environ.get("JITWARM_TEST_REDIS_URL", "").strip() or None


@pytest.fixture(scope="session")
def prestarted(tmp_path_factory):
    """A cache root filled by `jitwarm prestart` with the SMALL plan (built once per session)."""
    root = tmp_path_factory.mktemp("prestarted") / "cache"
    proc = precompile_fixtures.jitwarm("prestart", *precompile_fixtures.SMALL, "--cache-dir", str(root),
                                       "--jobs", "2")
    assert proc.returncode == 0, proc.stderr
    return root, proc


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch, tmp_path_factory):
    """Point the default cache at a fresh directory and drop env knobs a developer may have set."""
    for name in list(os.environ):
        if name.startswith("JITWARM_") or name == "SGLANG_RAGGED_VERIFY_MODE":
            monkeypatch.delenv(name)
    monkeypatch.setenv("JITWARM_CACHE_DIR", str(tmp_path_factory.mktemp("default-cache")))


@pytest.fixture(scope="session")
def sglang_env(tmp_path_factory):
    """Environment (PYTHONPATH) under which a subprocess of this interpreter imports the real sglang 0.5.23 wheel."""
    import sglang_wheel

    return sglang_wheel.sglang_env(tmp_path_factory)


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
