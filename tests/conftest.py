"""Shared pytest setup: every test runs with its own empty cache root and no inherited JITWARM_* env."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))  # fixture modules beside the tests (kernel_fixtures, precompile_fixtures)

import precompile_fixtures  # noqa: E402


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
