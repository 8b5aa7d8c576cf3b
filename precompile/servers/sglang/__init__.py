"""The sglang room: everything jitwarm knows about the sglang server, for the release :data:`VERSION`.

Its modules: :mod:`.argv` (the server's command line, from ``flags.json``: every option of the release's
parser), :mod:`.rules` (the decode CUDA-graph resolution, mirrored in plain Python), :mod:`.native` (the same
resolution by the installed sglang's own functions, for a release the rules do not mirror), :mod:`.model`
(which of jitwarm's kernel families the served model runs), :mod:`.plugin` (the ``sglang.srt.plugins`` entry
point) and :mod:`.seals` (``load_jit`` refused inside capture). This package is the room's adapter
(:class:`jitwarm.precompile.servers.ServerAdapter`); it imports its modules only when they are used.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

#: The sglang release this room mirrors: its flag table, its resolution rules, the line numbers cited here.
#: Defined before anything else: the room's modules import it from here.
VERSION = "0.5.23"
NAME = "sglang"
LAUNCHERS = "`python -m sglang.launch_server ...` or `sglang serve ...`"
PLUGIN = "jitwarm.precompile.servers.sglang.plugin:register"


def recognises(argv: Sequence[str]) -> bool:
    """True when ``argv`` starts (after any ``NAME=value`` words) with an sglang launcher."""
    from jitwarm.precompile.servers.sglang.argv import is_server_command

    return is_server_command(argv)


def parse_argv(argv: Sequence[str]) -> dict[str, Any]:
    """The capture settings and model path of an sglang command line (:func:`.argv.parse_server_argv`)."""
    from jitwarm.precompile.servers.sglang.argv import parse_server_argv

    return parse_server_argv(argv)


def resolve_ladder(inputs: Mapping[str, Any], source: str, builtin: dict[str, Any] | None = None) -> dict[str, Any]:
    """The decode graphs sglang captures for ``inputs``, from ``source`` (:func:`.native.resolve_from`)."""
    from jitwarm.precompile.servers.sglang.native import resolve_from

    return resolve_from(inputs, source, builtin)


def seal(undo: list[Any]) -> None:
    """Refuse ``load_jit`` compiles and loads while capture is guarded (:func:`.seals.seal_load_jit`)."""
    from jitwarm.precompile.servers.sglang.seals import seal_load_jit

    seal_load_jit(undo)
