"""Every server room keeps the adapter contract (``precompile/servers/__init__.py`` ``ServerAdapter``).

The test walks :data:`servers.ROOMS`: each room provides every name the contract lists, and each function answers
on a real command line of its server, as the core calls it (``config``, ``plan``, the recorder, the ledger, the
restore, the seal). A new room that misses a name, or answers with the wrong shape, fails here, not in a pod.
"""

from __future__ import annotations

import inspect
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


@pytest.mark.parametrize("name", servers.ROOMS)
def test_each_adapter_function_answers_on_a_real_command_line(name, tmp_path):
    from jitwarm.kernels import FAMILIES
    from jitwarm.precompile.config import ServingConfig

    room, argv = servers.adapter(name), ARGV[name]
    others = [ARGV[other] for other in servers.ROOMS if other != name]
    assert room.recognises(argv) and not any(room.recognises(line) for line in others)
    assert servers.adapter_for(argv) is room
    fields = room.parse_argv(argv)
    assert isinstance(fields, dict) and fields.get("tp_size") == 2, fields
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
