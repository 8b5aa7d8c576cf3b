"""Keys (canonical JSON), settings (the one place JITWARM_* is read), and side-effect-free import."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from workers.cache_harness import cache_for

from jitwarm.cache import FORMAT_VERSION, KernelCache
from jitwarm.cache.settings import ENV_VARS, override, settings


def test_key_is_sha256_of_canonical_preimage(tmp_path):
    cache = cache_for(tmp_path)
    text = json.dumps({"description": {"a": 1, "b": [1, "x"]}, "format": FORMAT_VERSION},
                      sort_keys=True, separators=(",", ":"))
    assert cache.key({"b": (1, "x"), "a": 1}) == hashlib.sha256(text.encode()).hexdigest()
    assert cache.key({"a": 1, "b": [1, "x"]}) == cache.key({"b": [1, "x"], "a": 1})
    assert cache.key({"a": 1}) != cache.key({"a": 2}) != cache.key({"a": "2"})
    assert cache.key({"s": "é"}) != cache.key({"s": "e"})
    assert cache.key_preimage({"a": (1,)}) == {"format": FORMAT_VERSION, "description": {"a": [1]}}


@pytest.mark.parametrize(("description", "where"), [
    ({"path": Path("/x")}, "description['path']"),
    ({"flags": ["-O2", {1, 2}]}, "description['flags'][1]"),
    ({"eps": float("nan")}, "NaN"),
    ({1: "int key"}, "non-str dict key"),
    (["not", "a", "dict"], "must be a dict"),
])
def test_non_json_description_raises_type_error(tmp_path, description, where):
    with pytest.raises(TypeError, match=re.escape(where)):
        cache_for(tmp_path).key(description)


def test_lookup_rejects_malformed_keys(tmp_path):
    for bad in ("../../etc", "ABC", "a" * 63, "g" * 64):
        with pytest.raises(ValueError, match="not a cache key"):
            cache_for(tmp_path).lookup(bad)


def test_settings_defaults_and_precedence(monkeypatch, tmp_path):
    for var in (*ENV_VARS.values(), "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    s = settings()
    assert s.cache_dir == tmp_path / "home" / ".cache" / "jitwarm"
    assert (s.cache_path, s.lock_dir, s.allow_shared, s.strict) == ((), None, False, False)
    assert s.jobs == (os.cpu_count() or 1)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert settings().cache_dir == tmp_path / "xdg" / "jitwarm"
    monkeypatch.setenv("JITWARM_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("JITWARM_CACHE_PATH", f"{tmp_path}/l1::{tmp_path}/l2")
    monkeypatch.setenv("JITWARM_LOCK_DIR", "/dev/shm/jitwarm-locks")
    monkeypatch.setenv("JITWARM_ALLOW_SHARED", "yes")
    monkeypatch.setenv("JITWARM_JOBS", "7")
    monkeypatch.setenv("JITWARM_STRICT", "1")
    s = settings()
    assert s.cache_dir == tmp_path / "explicit"
    assert s.cache_path == (tmp_path / "l1", tmp_path / "l2")
    assert s.lock_dir == Path("/dev/shm/jitwarm-locks")
    assert (s.allow_shared, s.jobs, s.strict) == (True, 7, True)
    cache = KernelCache()
    assert (cache.root, cache.layers, cache.lock_dir) == (s.cache_dir, s.cache_path, s.lock_dir)
    assert cache.allow_shared


@pytest.mark.parametrize(("var", "value"), [("JITWARM_JOBS", "abc"), ("JITWARM_JOBS", "0"),
                                            ("JITWARM_STRICT", "maybe"), ("JITWARM_ALLOW_SHARED", "2")])
def test_bad_values_name_the_variable(monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=f"^{var}=") as info:
        settings()
    assert "\n" not in str(info.value)


def test_override_scopes_and_restores(monkeypatch, tmp_path):
    monkeypatch.setenv("JITWARM_JOBS", "3")
    monkeypatch.delenv("JITWARM_STRICT", raising=False)
    with override(jobs=5, strict=True, cache_path=[tmp_path / "a", tmp_path / "b"]) as s:
        assert (s.jobs, s.strict, s.cache_path) == (5, True, (tmp_path / "a", tmp_path / "b"))
        assert os.environ["JITWARM_JOBS"] == "5"
        with override(jobs=None):
            assert settings().jobs == (os.cpu_count() or 1)
    assert os.environ["JITWARM_JOBS"] == "3" and "JITWARM_STRICT" not in os.environ
    with pytest.raises(TypeError, match="unknown setting"):
        with override(job=1):
            pass
    with pytest.raises(ValueError, match="JITWARM_JOBS"):
        with override(jobs=-1):
            pass
    assert os.environ["JITWARM_JOBS"] == "3"


def test_import_and_construction_write_nothing_and_import_no_heavy_modules(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("JITWARM_") and k != "XDG_CACHE_HOME"}
    env["HOME"] = str(home)
    code = (
        "import sys, jitwarm.cache as c\n"
        "c.KernelCache(); ro = c.KernelCache(read_only=True)\n"
        "assert ro.lookup('0' * 64) is None and c.KernelCache().lookup('0' * 64) is None\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'triton', 'tvm_ffi', 'numpy')\n"
        "       or m.startswith(('jitwarm.kernels', 'jitwarm.precompile'))]\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
    assert list(home.iterdir()) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["home"]
