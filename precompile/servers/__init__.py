"""The servers jitwarm plans for, one room each: the adapter contract, the registry, and what every room shares.

A room (``servers/sglang/``, ``servers/vllm/``) holds everything jitwarm knows about one server, for the one
release its ``VERSION`` names; the core reaches it only through the names :class:`ServerAdapter` lists, so a new
server is a new folder plus one name in :data:`ROOMS`. A ServingConfig's capture fields carry sglang's names,
which each room gives its server's meaning; settings no field holds go in ``server_options``.
"""

from __future__ import annotations

import errno
import importlib
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence, Set
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any, Protocol, cast

from jitwarm.cache import files
from jitwarm.cache.errors import UsageError

__all__ = ["DEFAULT", "ROOMS", "ModelFamilies", "ResolutionError", "ServerAdapter", "ServerArgvError", "adapter",
           "adapter_for", "cache_dirs", "differs_by_memory", "json_object", "model_families", "recognised",
           "refusals", "running"]

#: Every server room, by the name of its subpackage.
ROOMS = ("sglang", "vllm")
#: The room that reads a server command line given without its launcher (bare flags such as ``--tp 4``).
DEFAULT = "sglang"
#: Largest config.json read (a real one is a few KiB; one with a quantization table some hundred KiB).
MAX_CONFIG_BYTES = 4 << 20
#: A hub id or path whose name says DeepSeek-V4 (deepseek-ai/DeepSeek-V4-Flash, org/deepseek_v4-base, /models/dsv4).
_DSV4_NAME = re.compile(r"deepseek[-_ .]?v4|(?<![a-z0-9])dsv4", re.IGNORECASE)
_UNKNOWN = "architecture unknown, every family planned (--model-architecture NAME decides)"
#: A shell's leading ``NAME=value`` word: the environment of the command.
ENV_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=.*")
#: The longest JSON-object flag value read (a real one is a few dozen bytes), and how deep it may nest.
MAX_JSON_BYTES, MAX_JSON_DEPTH = 1 << 16, 8


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


def model_families(families: tuple[str, ...], model_path: str | None, architecture: str | None,
                   dsv4: Set[str]) -> ModelFamilies:
    """Decide which of ``families`` a server of this model runs: every one for DeepSeek-V4 (``dsv4``), none else.

    ``architecture`` wins; else a local checkpoint's config.json decides, then a hub id whose name says DeepSeek-V4.
    Raises a UsageError for a local config.json that is unreadable, too large, not a JSON object, or whose
    ``architectures`` is not a list of names.
    """
    if architecture is not None:
        return _decided(families, architecture, dsv4, f"architecture {architecture} (--model-architecture, or "
                                                      "the server's own model config)")
    if model_path is None:
        return ModelFamilies(families, (), None, "no model given: every family planned")
    local = Path(model_path)
    if local.is_dir():
        names = _local_architectures(local / "config.json")
        if not names:
            what = "has no config.json" if names is None else "has a config.json that names no architectures"
            return ModelFamilies(families, (), None, f"{model_path} {what}: {_UNKNOWN}")
        found = next((n for n in names if n in dsv4), names[0])
        return _decided(families, found, dsv4, f"architectures {names} in {model_path}/config.json")
    if local.exists():
        return ModelFamilies(families, (), None, f"{model_path} is a file, not a checkpoint directory: {_UNKNOWN}")
    if _DSV4_NAME.search(model_path):
        return ModelFamilies(families, (), "DeepseekV4ForCausalLM",
                             f"{model_path} is not a local path; its name says DeepSeek-V4: every family planned "
                             "(--model-architecture NAME says otherwise)")
    return ModelFamilies(families, (), None, f"{model_path} is not a local path and its name does not say "
                                             f"DeepSeek-V4: {_UNKNOWN}")


def _decided(families: tuple[str, ...], architecture: str, dsv4: Set[str], where: str) -> ModelFamilies:
    """Every family for a DeepSeek-V4 architecture, none for any other."""
    if architecture in dsv4:
        return ModelFamilies(families, (), architecture, f"{where}: DeepSeek-V4, every family planned")
    return ModelFamilies((), families, architecture,
                         f"{where}: not DeepSeek-V4, which alone runs {', '.join(families)}: skipped")


def _local_architectures(path: Path) -> list[str] | None:
    """The ``architectures`` of a local config.json ([] when it names none); None when there is no such file."""
    try:
        doc = files.read_json(path, MAX_CONFIG_BYTES)
    except FileNotFoundError:
        return None
    except OSError as exc:
        why = "it is not a regular file" if exc.errno in (errno.EINVAL, errno.ELOOP) else exc.strerror or str(exc)
        raise UsageError(f"cannot read the model's {path}: {why}") from None
    except ValueError as exc:
        raise UsageError(f"the model's {path} is not valid JSON: {str(exc).splitlines()[0][:200]}") from None
    if not isinstance(doc, dict):
        raise UsageError(f"the model's {path} is not a JSON object")
    names = doc.get("architectures", [])
    if names is None:
        return []
    if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
        raise UsageError(f"the model's {path}: \"architectures\" must be a list of names, got {names!r:.200}")
    return names


class ServerAdapter(Protocol):
    """What the package of a server room provides (module-level names)."""

    NAME: str  #: the room's name, as in :data:`ROOMS`
    VERSION: str  #: the server release the room mirrors; every other mention of it reads this constant
    LAUNCHERS: str  #: how the server's command line starts, for messages
    PLUGIN: str  #: the ``module:function`` the server loads as jitwarm's plugin (setup.py's entry point)
    PLUGINS_ENV: str  #: the variable that names the plugins the server loads (every installed one when unset)
    DEFAULT_PORT: int  #: the port the server listens on without ``--port``
    HEALTH: str  #: the path that answers 200 once the server serves
    LADDER_SOURCES: tuple[str, ...]  #: ``--ladder-source`` values: ``auto``, ``builtin`` and the server's own
    OPTIONS: Mapping[str, str]  #: room-only settings (``server_options`` keys) -> their flag, for messages

    def recognises(self, argv: Sequence[str]) -> bool:
        """True when ``argv`` starts (after any ``NAME=value`` words) with this server's launcher; never raises."""

    def parse_argv(self, argv: Sequence[str]) -> dict[str, Any]:
        """The ServingConfig fields a command line (launcher optional) sets; UsageError for one the server refuses."""

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
        "compact", "max_running_requests", "disabled"}``.
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

    def unloadable(self, units: Mapping[str, list[str]]) -> list[str]:
        """Why this node's server will not load restored units (library name -> units) although they are there."""


class ResolutionError(UsageError, ValueError):
    """Settings the server itself rejects, or that its room's rules do not mirror; the message says which (exit 2)."""


class ServerArgvError(UsageError, ValueError):
    """A server command line that does not parse as the server would read it: exit 2."""


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


# -- the words of a server command line, read alike by every room ---------------------------------------

def split_env(argv: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """The leading ``NAME=value`` words of a command line (its environment), and the words after them."""
    args, env = list(argv), {}
    while args and ENV_ASSIGNMENT.fullmatch(args[0]):
        name, _, value = args.pop(0).partition("=")
        env[name] = value
    return env, args


def strip_launcher(args: Sequence[str], modules: Sequence[str], program: str) -> tuple[list[str], bool] | None:
    """The words after ``python [-u -X dev ...] -m MODULE`` or ``PROGRAM serve`` (True), or None for another program.

    A line that starts with a flag has no launcher.
    """
    if not args or args[0].startswith("-"):
        return list(args), False
    name, rest = PurePath(args[0]).name, list(args[1:])
    if name.startswith("python"):
        while rest and rest[0].startswith("-") and rest[0] != "-m":
            rest = rest[2:] if rest[0] in ("-X", "-W") else rest[1:]
        if len(rest) >= 2 and rest[0] == "-m" and rest[1] in modules:
            return rest[2:], False
    elif name == program and rest[:1] == ["serve"]:
        return rest[1:], True
    return None


def launched_by(argv: Sequence[str], modules: Sequence[str], program: str) -> bool:
    """True when ``argv`` starts (after any ``NAME=value`` words) with one of the :func:`strip_launcher` launchers."""
    args = split_env(argv)[1]
    return bool(args) and not args[0].startswith("-") and strip_launcher(args, modules, program) is not None


def is_flag(token: str) -> bool:
    """Argparse's test: a token starting with '-' is an option unless it reads as a negative number."""
    if not token.startswith("-") or token == "-":
        return False
    try:
        float(token)
    except ValueError:
        return True
    return False


def values_after(args: Sequence[str], i: int, *, many: bool) -> tuple[list[str], int]:
    """The values a flag takes from ``args[i:]`` (one, or with ``many`` all up to the next flag), and the next i."""
    start = i
    while i < len(args) and not is_flag(args[i]) and (many or i == start):
        i += 1
    return list(args[start:i]), i


def converted(option: str, kind: str | Callable[[str], Any], given: Sequence[str]) -> Any:
    """``given`` as ``option``'s value of ``kind`` (``int``, ``int_list``, ``json``, ``str`` or a function of the last).

    :class:`ServerArgvError` when they do not convert.
    """
    try:
        if kind == "int_list":
            return [int(v) for v in given]
        last = given[-1]
        if callable(kind):
            return kind(last)
        if kind == "int":
            return int(last)
        return json_object(last) if kind == "json" else last
    except (ValueError, IndexError) as exc:
        shown = " ".join(given)
        shown = shown if len(shown) <= 80 else f"{shown[:60]}... ({len(shown)} characters)"
        raise ServerArgvError(f"argument {option}: invalid value {shown!r} ({exc})") from None


def json_object(text: str) -> dict[str, Any]:
    """Parse a JSON-object flag value (``--cuda-graph-config``), bounded in size and nesting; ValueError else.

    Bounded because 30,000 nested ``[`` made ``json.loads`` raise ``RecursionError``: a traceback, not one line.
    """
    if len(text) > MAX_JSON_BYTES:
        raise ValueError(f"longer than {MAX_JSON_BYTES} characters")
    value = files.loads(text, max_depth=MAX_JSON_DEPTH)
    if not isinstance(value, dict):
        raise ValueError("not a JSON object")
    return value
