"""Keys (canonical JSON), settings (each knob read when used), messages, and side-effect-free import."""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from workers.cache_harness import cache_for

import jitwarm.cache
from jitwarm.cache import FORMAT_VERSION, CacheError, KernelCache, RemoteUnavailable, settings
from jitwarm.cache.errors import UsageError
from jitwarm.cache.settings import ENV_VARS, override


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


def _local_settings():
    return (settings.cache_dir(), settings.cache_path(), settings.lock_dir(), settings.allow_shared())


def test_settings_defaults_and_precedence(monkeypatch, tmp_path):
    for var in (*ENV_VARS.values(), "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert _local_settings() == (tmp_path / "home" / ".cache" / "jitwarm", (), None, False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert settings.cache_dir() == tmp_path / "xdg" / "jitwarm"
    monkeypatch.setenv("JITWARM_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("JITWARM_CACHE_PATH", f"{tmp_path}/l1::{tmp_path}/l2")
    monkeypatch.setenv("JITWARM_LOCK_DIR", "/dev/shm/jitwarm-locks")
    monkeypatch.setenv("JITWARM_ALLOW_SHARED", "yes")
    assert _local_settings() == (tmp_path / "explicit", (tmp_path / "l1", tmp_path / "l2"),
                                 Path("/dev/shm/jitwarm-locks"), True)
    cache = KernelCache()
    assert (cache.root, cache.layers, cache.lock_dir) == _local_settings()[:3]
    assert cache.allow_shared


@pytest.mark.parametrize(("var", "value"), [("JITWARM_ALLOW_SHARED", "2"), ("JITWARM_ALLOW_SHARED", "maybe")])
def test_bad_values_name_the_variable(monkeypatch, tmp_path, var, value):
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=f"^{var}=") as info:
        settings.allow_shared()
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match=f"^{var}="):
        KernelCache(root=tmp_path)
    assert KernelCache(root=tmp_path, allow_shared=True).allow_shared  # the variable is not read then


@pytest.mark.parametrize(("var", "value"), [("JITWARM_JOBS", "abc"), ("JITWARM_STRICT", "maybe")])
def test_upper_layer_settings_are_not_read_by_the_cache(monkeypatch, tmp_path, var, value):
    """JITWARM_JOBS and JITWARM_STRICT are read by warm and the hook only: a bad one never fails a cache lookup."""
    monkeypatch.setenv(var, value)
    cache = KernelCache(root=tmp_path / "root", layers=())
    assert cache.get_or_build_ex({"n": 1}, lambda d: (d / "f").write_text("x")).outcome == "built"


@pytest.mark.parametrize("value", ["2", "maybe", "tru", "-1"])
def test_one_boolean_parser_refuses_what_is_not_a_boolean(monkeypatch, value):
    monkeypatch.setenv("JITWARM_STRICT", value)
    with pytest.raises(settings.SettingError, match="^JITWARM_STRICT=") as info:
        settings.strict()
    assert isinstance(info.value, UsageError) and info.value.exit_code == 2 and "\n" not in str(info.value)


@pytest.mark.parametrize(("value", "want"), [("1", True), ("yes", True), ("On", True), ("TRUE", True),
                                             ("0", False), ("no", False), ("off", False), ("False", False)])
def test_one_boolean_parser_accepts_the_four_spellings(monkeypatch, value, want):
    from jitwarm.precompile.servers import plugins
    from jitwarm.precompile.servers.sglang import plugin as sglang_plugin

    for var, accessor in (("JITWARM_STRICT", settings.strict), ("JITWARM_SGLANG_PLUGIN", sglang_plugin.ENABLED),
                          ("JITWARM_TRITON_CACHE", plugins.serve_triton)):
        monkeypatch.setenv(var, value)
        assert accessor() is want
    monkeypatch.delenv("JITWARM_SGLANG_PLUGIN")
    assert sglang_plugin.ENABLED() is True  # default on


@pytest.mark.parametrize("value", ["0", "1025", "many", "٣", "1.5"])
def test_jobs_is_an_integer_from_1_to_1024(monkeypatch, value):
    monkeypatch.setenv("JITWARM_JOBS", value)
    with pytest.raises(settings.SettingError, match="^JITWARM_JOBS="):
        settings.jobs()


@pytest.mark.parametrize(("var", "flag"), [("JITWARM_CACHE_DIR", None), ("JITWARM_CACHE_PATH", None),
                                         (None, "--cache-dir")])
def test_a_cache_dir_or_layer_that_is_a_file_is_one_line_exit_2(tmp_path, monkeypatch, capsys, var, flag):
    """JITWARM_CACHE_DIR naming a file ended in six lines and exit 1; JITWARM_CACHE_PATH naming one was ignored."""
    from precompile_fixtures import TINY

    from jitwarm.precompile.cli import main

    afile = tmp_path / "not-a-dir"
    afile.write_text("x")
    layers = var == "JITWARM_CACHE_PATH"
    argv = ["status", *TINY, *(["--cache-dir", str(tmp_path / "root")] if layers else [])]
    if var is not None:
        monkeypatch.setenv(var, f"{tmp_path / 'missing-is-fine'}:{afile}" if layers else str(afile))
        with pytest.raises(settings.SettingError, match=f"^{var}: {afile} is not a directory$"):
            KernelCache()
    else:
        argv += [flag, str(afile)]
        with pytest.raises(settings.SettingError, match="^cache root: .* is not a directory$"):
            KernelCache(root=afile)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("jitwarm: error: ") and str(afile) in err


@pytest.mark.parametrize("var", ["JITWARM_CACHE_DIR", "JITWARM_CACHE_PATH", "JITWARM_LOCK_DIR"])
def test_a_path_setting_no_system_call_can_use_is_one_line_exit_2(tmp_path, monkeypatch, capsys, var):
    """A 5,000-character JITWARM_CACHE_PATH was exit 1 "File name too long" (attack round 2); a link loop too."""
    from precompile_fixtures import TINY

    from jitwarm.precompile.cli import main

    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    for bad in (tmp_path / ("x" * 5000), loop / "c"):
        monkeypatch.setenv(var, str(bad))
        assert main(["status", *TINY, *(["--cache-dir", str(tmp_path / "root")] if var != "JITWARM_CACHE_DIR"
                                        else [])]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"jitwarm: error: {var}: "), err


@pytest.mark.parametrize("value", ["٣", "２.5", "1e٣"])
def test_a_float_setting_in_another_scripts_digits_is_refused(monkeypatch, value):
    """float() reads '٣' as 3: JITWARM_REMOTE_LEASE_S='٣' was taken (attack round 2); the integers refused it."""
    for var, read in (("JITWARM_REMOTE_LEASE_S", settings.remote_lease_s),
                      ("JITWARM_PRUNE_GRACE_S", settings.prune_grace_s)):
        monkeypatch.setenv(var, value)
        with pytest.raises(settings.SettingError, match=f"^{var}=.* is not a number$"):
            read()


def test_override_scopes_and_restores(monkeypatch, tmp_path):
    monkeypatch.setenv("JITWARM_REMOTE_LEASE_S", "3")
    monkeypatch.delenv("JITWARM_ALLOW_SHARED", raising=False)
    with override(remote_lease_s=5, allow_shared=True, cache_path=[tmp_path / "a", tmp_path / "b"]):
        assert (settings.remote_lease_s(), settings.allow_shared()) == (5.0, True)
        assert settings.cache_path() == (tmp_path / "a", tmp_path / "b")
        assert os.environ["JITWARM_REMOTE_LEASE_S"] == "5"
        with override(remote_lease_s=None):
            assert settings.remote_lease_s() == 30.0
    assert os.environ["JITWARM_REMOTE_LEASE_S"] == "3" and "JITWARM_ALLOW_SHARED" not in os.environ
    for unknown in ({"lease": 1}, {"job": 2}):
        with pytest.raises(TypeError, match="unknown setting"):
            with override(**unknown):
                pass
    with override(remote_lease_s=-1):  # nothing is parsed until an accessor is called
        with pytest.raises(ValueError, match="^JITWARM_REMOTE_LEASE_S='-1' must be at least 0.5$"):
            settings.remote_lease_s()
    assert os.environ["JITWARM_REMOTE_LEASE_S"] == "3"


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


# A CLI flag (--remote-required) or a jitwarm subcommand ("jitwarm warm"): the CLI adds those hints itself.
CLI_HINT = re.compile(r"(?<![\w-])--[a-z]|\bjitwarm (plan|warm|status|verify|prestart|prune|export|import)\b")


def _message_strings(path: Path):
    """Every string literal of a module except docstrings (f-string parts included)."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            yield node.lineno, node.value


def test_cache_messages_name_no_cli_flags_or_commands(tmp_path):
    package = Path(jitwarm.cache.__file__).parent
    found = [f"{path.name}:{line}: {text!r}" for path in sorted(package.glob("*.py"))
             for line, text in _message_strings(path) if CLI_HINT.search(text)]
    assert found == [], found
    required = str(RemoteUnavailable("redis://host:6379/0", "ConnectionError: refused"))
    assert "JITWARM_REMOTE_REQUIRED=1" in required and "KernelCache(remote_required=True)" in required
    with pytest.raises(CacheError, match="read-only") as info:
        KernelCache(root=tmp_path, layers=(), read_only=True).get_or_build({"n": 1}, lambda d: None)
    for message in (required, str(info.value)):
        assert not CLI_HINT.search(message), message
