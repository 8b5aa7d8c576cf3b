"""The servers jitwarm plans for, one room each, and the registry that picks a room from a server command line.

A room is a subpackage of this one (``servers/sglang/`` now; vLLM 0.33.0 is the next, ``servers/vllm/``) that
holds everything jitwarm knows about one server: its command line, its flag table, the rules that turn its
settings into the CUDA graphs it captures, the plugin that loads into it, the seals that refuse its JIT inside
capture, and the one constant naming the release all of that mirrors. Nothing outside a room names the
server's own modules or private functions; a new server is a new folder plus one line in :data:`ROOMS`.

The package of a room is its adapter: it provides, at module level, what :class:`ServerAdapter` lists.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, cast

from jitwarm.cache.errors import UsageError

__all__ = ["DEFAULT", "ROOMS", "ServerAdapter", "UnknownServer", "adapter", "adapter_for", "recognised"]

#: Every server room, by the name of its subpackage.
ROOMS = ("sglang",)
#: The room that reads a server command line given without its launcher (bare flags such as ``--tp 4``).
DEFAULT = "sglang"


class ServerAdapter(Protocol):
    """What the package of a server room provides (module-level names).

    Attributes
    ----------
    NAME : str
        The room's name, as in :data:`ROOMS`.
    VERSION : str
        The server release the room mirrors: its flag table, its resolution rules, the line numbers its
        comments cite. Every other mention of that version in jitwarm reads this constant.
    LAUNCHERS : str
        How the server's command line starts, for messages (``python -m sglang.launch_server ... or sglang
        serve ...``).
    PLUGIN : str
        The ``module:function`` the server loads as jitwarm's plugin (setup.py's entry point names it).

    """

    NAME: str
    VERSION: str
    LAUNCHERS: str
    PLUGIN: str

    def recognises(self, argv: Sequence[str]) -> bool:
        """True when ``argv`` starts (after any ``NAME=value`` words) with this server's launcher; never raises."""

    def parse_argv(self, argv: Sequence[str]) -> dict[str, Any]:
        """The capture settings of a command line (launcher optional), as raw ladder inputs.

        Raises a :class:`~jitwarm.cache.errors.UsageError` subclass for a line the server would refuse.
        """

    def resolve_ladder(self, inputs: Mapping[str, Any], source: str,
                       builtin: dict[str, Any] | None = None) -> dict[str, Any]:
        """The decode graphs the server captures for ``inputs``, from ``source``.

        ``source`` is ``auto``, ``builtin`` or the server's own functions (named after the server); ``builtin``
        is the built-in rules' answer for these inputs when the caller has it. Raises a UsageError subclass for
        settings the server rejects.
        """

    def seal(self, undo: list[Any]) -> None:
        """Make the server's own JIT refuse to compile or load while capture is guarded; append the undo calls."""


class UnknownServer(UsageError):
    """A server command line that no room recognises (exit 2)."""


def adapter(name: str) -> ServerAdapter:
    """Return the room called ``name`` (one of :data:`ROOMS`).

    Raises
    ------
    UnknownServer
        No room has that name.

    """
    if name not in ROOMS:
        raise UnknownServer(f"unknown server {name!r}; jitwarm knows {', '.join(ROOMS)}")
    return cast(ServerAdapter, importlib.import_module(f"{__name__}.{name}"))


def adapter_for(argv: Sequence[str]) -> ServerAdapter:
    """Return the room whose launcher starts ``argv``; :data:`DEFAULT` for bare flags (the line starts with ``-``).

    Raises
    ------
    UnknownServer
        ``argv`` starts with a program that no room recognises; the message lists the launchers known.

    """
    rooms = [adapter(name) for name in ROOMS]
    for room in rooms:
        if room.recognises(argv):
            return room
    words = [a for a in argv if not _is_assignment(a)]
    if not words or words[0].startswith("-"):
        return adapter(DEFAULT)
    raise UnknownServer(f"not a server command line jitwarm knows: {' '.join(words[:4])} ... (expected "
                        f"{'; or '.join(room.LAUNCHERS for room in rooms)})")


def recognised(argv: Sequence[str]) -> bool:
    """True when some room recognises ``argv`` as its server's command line (launcher first)."""
    return any(adapter(name).recognises(argv) for name in ROOMS)


def _is_assignment(word: str) -> bool:
    """A shell's leading ``NAME=value`` word (the environment of the command)."""
    name, eq, _ = word.partition("=")
    return bool(eq) and name.isidentifier() and name.isascii()
