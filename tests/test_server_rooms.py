"""Every server room keeps the adapter contract (``precompile/servers/__init__.py`` ``ServerAdapter``).

The test walks :data:`servers.ROOMS`: each room provides every name the contract lists, and each function answers
on a real command line of its server, as the core calls it (``config``, ``plan``, the recorder, the ledger, the
restore, the seal). A new room that misses a name, or answers with the wrong shape, fails here, not in a pod.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import json
import sys
from pathlib import Path

import pytest

from jitwarm.precompile import servers

#: A real command line of each room's server (its launcher first), as an operator writes it.
ARGV = {"sglang": ["python", "-m", "sglang.launch_server", "--model-path", "org/model",
                   "--cuda-graph-max-bs-decode", "16", "--tp-size", "2"],
        "vllm": ["vllm", "serve", "org/model", "--max-num-seqs", "16", "--tensor-parallel-size", "2"]}


def contract() -> tuple[set[str], set[str]]:
    """The contract's constants (annotated) and functions (defined on the Protocol)."""
    constants = set(servers.ServerAdapter.__annotations__)
    functions = {name for name, value in vars(servers.ServerAdapter).items()
                 if inspect.isfunction(value) and not name.startswith("_")}
    return constants, functions


def test_every_room_is_tested_and_the_contract_is_read():
    constants, functions = contract()
    assert set(servers.ROOMS) == set(ARGV)
    assert {"NAME", "VERSION", "PLUGIN", "CACHE_VARIABLES", "SEALED"} <= constants
    assert {"recognises", "parse_argv", "resolve_ladder", "seal", "cache_dirs", "unloadable"} <= functions


@pytest.mark.parametrize("name", servers.ROOMS)
def test_a_room_provides_every_adapter_name(name):
    constants, functions = contract()
    room = servers.adapter(name)
    missing = sorted(n for n in constants | functions if not hasattr(room, n))
    assert missing == [], f"room {name} lacks {missing}"
    assert room.NAME == name and isinstance(room.VERSION, str) and room.VERSION[0].isdigit()
    assert all(callable(getattr(room, n)) for n in functions)
    assert isinstance(room.DEFAULT_PORT, int) and room.HEALTH.startswith("/")
    assert room.LADDER_SOURCES[:2] == ("auto", "builtin")
    module, _, function = room.PLUGIN.partition(":")
    assert module.startswith(f"jitwarm.precompile.servers.{name}.") and function
    assert room.CACHE_VARIABLES and all(v.isupper() for v in room.CACHE_VARIABLES)
    assert room.SEALED is None or isinstance(room.SEALED, str)
    if name in ("sglang", "vllm"):  # installed: setup.py read the room's entry point
        from importlib.metadata import entry_points

        assert [e.value for e in entry_points(group=room.PLUGIN_GROUP) if e.name == "jitwarm"] == [room.PLUGIN]


@pytest.mark.parametrize("name", servers.ROOMS)
def test_each_adapter_function_answers_on_a_real_command_line(name, tmp_path):
    from jitwarm.kernels import FAMILIES
    from jitwarm.precompile.config import ServingConfig

    room, argv = servers.adapter(name), ARGV[name]
    others = [ARGV[other] for other in servers.ROOMS if other != name]
    assert room.recognises(argv) and not any(room.recognises(line) for line in others)
    assert servers.adapter_for(argv) is room
    fields = room.parse_argv(argv)
    assert isinstance(fields, dict) and fields.get("tp") == 2, fields
    # jitwarm's own names: every key a ServingConfig field, and each field's flag the server's own
    settings = {f.name for f in dataclasses.fields(ServingConfig)} - {"mode_from_env", "given_as"}
    assert set(fields) <= settings, sorted(set(fields) - settings)
    assert set(room.FIELD_FLAGS) <= settings and all(flag.startswith("-") for flag in room.FIELD_FLAGS.values())
    assert {"tp", "model_path"} <= set(fields) and room.FIELD_FLAGS["tp"] in argv
    config = ServingConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}, server=name,
                           gpu_memory_mb=80 * 1024)
    assert isinstance(room.defaults(config), dict)
    assert room.check(config, resolve=True) == []
    inputs = room.ladder_inputs(config)
    assert isinstance(room.needs_memory(inputs), bool)
    ladder = room.resolve_ladder(inputs, "builtin")
    sizes = [shape["bs"] for shape in ladder["shapes"]]
    assert sizes and sizes[0] == max(sizes) == 16, ladder
    chosen = room.model_families(tuple(FAMILIES), None, "DeepseekV4ForCausalLM")
    assert set(chosen.planned) | set(chosen.skipped) == set(FAMILIES)
    assert isinstance(room.start_warnings({}), list)
    env = {"HOME": str(tmp_path), **{var: str(tmp_path / var.lower()) for var in room.CACHE_VARIABLES}}
    dirs = room.cache_dirs(env)
    assert dirs and all(path is None or isinstance(path, Path) for path in dirs.values())
    assert set(room.cache_dirs(env, own_only=True)) <= set(dirs)
    assert room.unloadable({}) == []
    sealed = room.seal(lambda what, key=None: None)
    if sealed is not None:  # the server's JIT is importable here: sealed, then undone
        assert sealed[0] == room.SEALED
        sealed[1]()


FAKE_SERVER = '''
"""A fake server, ``fakeserve --max-batch N --tp N``: a room of its own, one module."""

from __future__ import annotations

import functools
from pathlib import Path

from jitwarm.cache.errors import UsageError
from jitwarm.precompile.servers import model

NAME, VERSION, LAUNCHERS = "fakeserve", "1.0", "`fakeserve ...`"
PLUGIN, PLUGIN_GROUP = "jitwarm.precompile.servers.fakeserve.plugin:register", "fakeserve.plugins"
PLUGINS_ENV, DEFAULT_PORT, HEALTH = "FAKESERVE_PLUGINS", 9000, "/ready"
LADDER_SOURCES = ("auto", "builtin")
OPTIONS = {}
FIELD_FLAGS = {"graph_max_bs": "--max-batch", "tp": "--tp", "model_path": "--model"}
CACHE_VARIABLES = ("FAKESERVE_CACHE",)
SEALED = TAP = None
CAPTURE_ENV: dict = {}
ANSWERS_STOP_REQUEST = False
model_families = functools.partial(model.model_families, dsv4=frozenset({"DeepseekV4ForCausalLM"}))


def recognises(argv):
    return bool(argv) and argv[0] == "fakeserve"


def parse_argv(argv):
    words, fields = list(argv[1:] if recognises(argv) else argv), {}
    flags = {flag: name for name, flag in FIELD_FLAGS.items()}
    while words:
        flag = words.pop(0)
        if flag not in flags or not words:
            raise UsageError(f"fakeserve refuses {flag}")
        value = words.pop(0)
        fields[flags[flag]] = value if flag == "--model" else int(value)
    return fields


def defaults(config):
    return {}


def check(config, *, resolve):
    return []


def ladder_inputs(config):
    return {"max_bs": config.graph_max_bs or 4, "gpu_memory_mb": config.gpu_memory_mb}


def needs_memory(inputs):
    return False


def resolve_ladder(inputs, source):
    sizes = [bs for bs in (1, 2, 4, 8, 16, 32) if bs <= inputs["max_bs"]][::-1]
    return {"source": "fakeserve's rules", "shapes": [{"bs": bs, "graph_key": bs, "verify_lens": [1] * bs}
                                                      for bs in sizes], "capture_bs": sizes[::-1], "width": 1}


def start_warnings(environ):
    return []


def seal(refuse):
    return None


def cache_dirs(environ, *, own_only=False):
    return {} if own_only else {"inductor": Path(environ.get("FAKESERVE_CACHE", "/nonexistent")) / "inductor"}


def unloadable(units, captured=None):
    return []
'''


@pytest.fixture
def fake_server(tmp_path, monkeypatch):
    """The fake server's room (one module) and its one line in ``servers.ROOMS``."""
    path = tmp_path / "fakeserve.py"
    path.write_text(FAKE_SERVER)
    name = "jitwarm.precompile.servers.fakeserve"
    module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(name, path))
    monkeypatch.setitem(sys.modules, name, module)
    module.__spec__.loader.exec_module(module)
    monkeypatch.setattr(servers, "ROOMS", (*servers.ROOMS, "fakeserve"))  # the one registry line
    ARGV["fakeserve"] = ["fakeserve", "--model", "org/model", "--max-batch", "16", "--tp", "2"]
    yield module
    del ARGV["fakeserve"]


def test_a_fake_server_is_one_room_and_one_line(fake_server, tmp_path, capsys):
    """The fake room passes the conformance walk, plans from its own command line, and a capture of it gets its
    own cache variable private."""
    from jitwarm.precompile import capture_node
    from jitwarm.precompile.cli import main

    test_every_room_is_tested_and_the_contract_is_read()
    test_a_room_provides_every_adapter_name("fakeserve")
    test_each_adapter_function_answers_on_a_real_command_line("fakeserve", tmp_path)
    assert main(["plan", "--json", "--", "fakeserve", "--max-batch", "8"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["ladder"]["capture_bs"] == [1, 2, 4, 8], plan["ladder"]
    assert main(["plan", "--", "fakeserve", "--bad", "1"]) == 2
    assert "fakeserve refuses --bad" in capsys.readouterr().err
    # its flags land on jitwarm's names, which jitwarm's own flags set too; a message names the flag it was given as
    from jitwarm.precompile.servers.sglang.fields import SGLANG_NAMES

    assert not set(fake_server.parse_argv(ARGV["fakeserve"])) & set(SGLANG_NAMES.values()) - {"model_path"}
    assert not any(name in FAKE_SERVER for name in set(SGLANG_NAMES.values()) - {"model_path"})
    assert main(["plan", "--json", "--graph-max-bs", "4", "--", "fakeserve", "--max-batch", "8"]) == 0
    assert json.loads(capsys.readouterr().out)["ladder"]["capture_bs"] == [1, 2, 4]
    assert main(["plan", "--", "fakeserve", "--max-batch", "0"]) == 2
    assert "--max-batch must be a positive integer, got 0" in capsys.readouterr().err
    root = tmp_path / "private"
    root.mkdir()
    env, _ = capture_node.private_env(fake_server, {"FAKESERVE_CACHE": str(tmp_path / "callers")}, root)
    assert env["FAKESERVE_CACHE"] == str(root / "fakeserve_cache")
