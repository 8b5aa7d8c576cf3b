"""The servers jitwarm plans for, one room each, and the registry that picks a room from a server command line.

A room (``servers/sglang/``, ``servers/vllm/``) holds everything jitwarm knows about one server, for the one
release its ``VERSION`` names; the core reaches it only through the names :class:`ServerAdapter` lists, so a new
server is a new folder plus one name in :data:`ROOMS` (``setup.py`` reads its plugin's entry point);
``tests/test_server_rooms.py`` walks every room against the contract. A ServingConfig's capture fields carry
sglang's names, which each room gives its server's meaning; settings no field holds go in ``server_options``.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast

from jitwarm.cache.errors import UsageError
from jitwarm.precompile.servers.command_line import json_object, split_env

__all__ = ["DEFAULT", "ROOMS", "ModelFamilies", "ResolutionError", "ServerAdapter", "adapter", "adapter_for",
           "cache_dirs", "differs_by_memory", "json_object", "recognised", "refusals", "running"]

#: Every server room, by the name of its subpackage.
ROOMS = ("sglang", "vllm")
#: The room that reads a server command line given without its launcher (bare flags such as ``--tp 4``).
DEFAULT = "sglang"


@dataclass(frozen=True)
class ModelFamilies:
    """Which of jitwarm's families a plan holds for the served model (``planned``, ``skipped``), and ``why``."""

    planned: tuple[str, ...]
    skipped: tuple[str, ...]
    architecture: str | None
    why: str

    def to_json(self) -> dict[str, Any]:
        """As ``jitwarm plan --json`` reports it."""
        return {"architecture": self.architecture, "planned": list(self.planned), "skipped": list(self.skipped),
                "why": self.why}


class ServerAdapter(Protocol):
    """What the package of a server room provides (module-level names)."""

    NAME: str  #: the room's name, as in :data:`ROOMS`
    VERSION: str  #: the server release the room mirrors; every other mention of it reads this constant
    LAUNCHERS: str  #: how the server's command line starts, for messages
    PLUGIN: str  #: the ``module:function`` the server loads as jitwarm's plugin (setup.py's entry point)
    PLUGIN_GROUP: str  #: the entry-point group the server loads plugins from (``setup.py`` reads it)
    PLUGINS_ENV: str  #: the variable that names the plugins the server loads (every installed one when unset)
    DEFAULT_PORT: int  #: the port the server listens on without ``--port``
    HEALTH: str  #: the path that answers 200 once the server serves
    LADDER_SOURCES: tuple[str, ...]  #: ``--ladder-source`` values: ``auto``, ``builtin`` and the server's own
    OPTIONS: Mapping[str, str]  #: room-only settings (``server_options`` keys) -> their flag, for messages
    #: the ServingConfig fields :meth:`parse_argv` sets -> the server's own flag for each, for messages
    FIELD_FLAGS: Mapping[str, str]
    #: the server's own cache root variable first, then those beside it it reads for the caches it moves or owns
    CACHE_VARIABLES: tuple[str, ...]
    SEALED: str | None  #: what :meth:`seal` seals, as the plugin's line names it (None: nothing of its own)
    TAP: str | None  #: the module whose ``TAP`` and ``recording(add)`` record the server's own JIT (None: none)
    #: what ``jitwarm capture`` sets in the server's environment unless the command line sets it (and records)
    CAPTURE_ENV: Mapping[str, str]
    #: True where the plugin stores the first requests' units and writes the ledger at stop when capture asks
    #: (``ledger.stop_request_path``), because the server kills its workers at stop before they could
    ANSWERS_STOP_REQUEST: bool

    def recognises(self, argv: Sequence[str]) -> bool:
        """True when ``argv`` starts (after any ``NAME=value`` words) with this server's launcher; never raises."""

    def parse_argv(self, argv: Sequence[str]) -> dict[str, Any]:
        """The ServingConfig fields a command line (launcher optional) sets; UsageError for one the server refuses.

        Its keys are ServingConfig's field names (jitwarm's own, never another server's flags), ``server_options``
        holding the room's own settings (:attr:`OPTIONS`).
        """

    def defaults(self, config: Any) -> dict[str, Any]:
        """Values for the fields ``config`` left unset that the server takes from elsewhere (its environment)."""

    def check(self, config: Any, *, resolve: bool) -> list[str]:
        """Problems of ``config``'s server settings, one message each; ``resolve``: also try the built-in rules."""

    def ladder_inputs(self, config: Any) -> dict[str, Any]:
        """The raw inputs :meth:`resolve_ladder` takes for ``config`` (JSON-able; ``gpu_memory_mb`` among them)."""

    def needs_memory(self, inputs: Mapping[str, Any]) -> bool:
        """True when the captured graphs differ between device-memory sizes (so the memory must be known)."""

    def resolve_ladder(self, inputs: Mapping[str, Any], source: str) -> dict[str, Any]:
        """The graphs the server captures for ``inputs``, from ``source``; UsageError for refused settings.

        ``{"source", "shapes": [{"bs", "graph_key", "verify_lens"}, ...] largest first, "capture_bs", "width",
        "compact", "max_requests", "disabled"}``.
        """

    def model_families(self, families: tuple[str, ...], model_path: str | None,
                       architecture: str | None) -> ModelFamilies:
        """Which of ``families`` a server of this model runs; UsageError for an unreadable local checkpoint."""

    def start_warnings(self, environ: Mapping[str, str]) -> list[str]:
        """Why a start of the server in ``environ`` could not be restored to compile nothing (``capture`` says it)."""

    def seal(self, refuse: Callable[[str], None]) -> tuple[str, Callable[[], None]] | None:
        """Hand each compile or load of the server's own JIT to ``refuse(what)``: (name, undo), or None if none."""

    def cache_dirs(self, environ: Mapping[str, str], *, own_only: bool = False) -> dict[str, Path | None]:
        """Where a server process started with ``environ`` keeps each JIT library's cache it moves or owns.

        Library name -> directory (None: turned off there); a library left out is where its own variables put
        it. ``own_only``: only the caches the server's code writes in any process that runs it. Never raises.
        """

    def unloadable(self, units: Mapping[str, list[str]], captured: Mapping[str, str] | None = None) -> list[str]:
        """Why this node's server will not load restored units (library name -> units) although they are there.

        ``captured``: the environment ``jitwarm capture`` ran the server with (None: no capture record says).
        """


class ResolutionError(UsageError, ValueError):
    """Settings the server itself rejects, or that its room's rules do not mirror; the message says which (exit 2)."""


def adapter(name: str) -> ServerAdapter:
    """Return the room called ``name`` (one of :data:`ROOMS`); UsageError for any other."""
    if name not in ROOMS:
        raise UsageError(f"unknown server {name!r}; jitwarm knows {', '.join(ROOMS)}")
    return cast(ServerAdapter, importlib.import_module(f"{__name__}.{name}"))


def lazy_functions(package: str, functions: Mapping[str, str]) -> Callable[[str], Any]:
    """A room package's ``__getattr__``: each adapter function imported on first use from ``module[:name]``."""
    def __getattr__(name: str) -> Any:
        if name in functions:
            module, _, attribute = functions[name].partition(":")
            return getattr(importlib.import_module(f"{package}.{module}"), attribute or name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    return __getattr__


def running() -> str:
    """The room whose server this process runs, by what it has imported; ``""`` for neither."""
    return next((name for name in ROOMS if name in sys.modules), "")


def cache_dirs(server: str, environ: Mapping[str, str] | None = None) -> Mapping[str, Path | None]:
    """``server``'s room's :meth:`ServerAdapter.cache_dirs`; for ``""`` (no server here yet) every room's own."""
    env = os.environ if environ is None else environ
    if server:
        return adapter(server).cache_dirs(env)
    return {name: path for room in ROOMS for name, path in adapter(room).cache_dirs(env, own_only=True).items()}


def adapter_for(argv: Sequence[str]) -> ServerAdapter:
    """Return the room whose launcher starts ``argv``; :data:`DEFAULT` for bare flags; UsageError for others."""
    rooms = [adapter(name) for name in ROOMS]
    for room in rooms:
        if room.recognises(argv):
            return room
    words = split_env(argv)[1]
    if not words or words[0].startswith("-"):
        return adapter(DEFAULT)
    raise UsageError(f"not a server command line jitwarm knows: {' '.join(words[:4])} ... (expected "
                     f"{'; or '.join(room.LAUNCHERS for room in rooms)})")


def recognised(argv: Sequence[str]) -> bool:
    """True when some room recognises ``argv`` as its server's command line (launcher first)."""
    return any(adapter(name).recognises(argv) for name in ROOMS)


def refusals(resolve: Callable[[dict[str, Any]], Any], inputs: dict[str, Any],
             reads_memory: Callable[[dict[str, Any]], bool]) -> list[str]:
    """What a room's rules refuse in ``inputs``, as one message, an unknown memory taken as 80 GiB; [] when nothing."""
    if inputs["gpu_memory_mb"] is None and reads_memory(inputs):
        inputs = {**inputs, "gpu_memory_mb": 80 * 1024}
    try:
        resolve(inputs)
    except UsageError as exc:  # a ResolutionError
        return [str(exc)]
    return []


def differs_by_memory(resolve: Callable[[dict[str, Any]], dict[str, Any]], inputs: Mapping[str, Any],
                      samples: Sequence[int], graphs: Callable[[dict[str, Any]], Any]) -> bool:
    """True when the ``graphs`` of the resolution differ between the device memories ``samples`` (MiB).

    False when the rules refuse the settings: the plan reports that with the memory given.
    """
    found = set()
    for memory in samples:
        try:
            found.add(graphs(resolve({**inputs, "gpu_memory_mb": memory})))
        except UsageError:
            return False
    return len(found) > 1
