"""The words of a server command line that read alike for every room: environment, interpreter, flags, values.

Each room's ``argv`` module reads its server's own flags; what comes before them (``NAME=value`` words, then
``python [-u ...] -m MODULE``) and argparse's test of whether a word is a flag are the same for every server.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

#: A shell's leading ``NAME=value`` word: the environment of the command.
ENV_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=.*")


def after_interpreter(args: Sequence[str], modules: Sequence[str]) -> list[str] | None:
    """The words after ``python [-u ...] -m MODULE`` when ``args[1:]`` run one of ``modules``, else None.

    ``args[0]`` is the interpreter (the caller checked it); its own options (``-u``, ``-X dev``) are skipped.
    """
    rest = list(args[1:])
    while rest and rest[0].startswith("-") and rest[0] != "-m":  # interpreter options such as -u, -X dev
        rest = rest[2:] if rest[0] in ("-X", "-W") else rest[1:]
    if len(rest) >= 2 and rest[0] == "-m" and rest[1] in modules:
        return rest[2:]
    return None


def is_flag(token: str) -> bool:
    """Argparse's test: a token starting with '-' is an option unless it reads as a negative number."""
    if not token.startswith("-") or token == "-":
        return False
    try:
        float(token)
    except ValueError:
        return True
    return False


def shown_value(given: Sequence[str]) -> str:
    """The strings given to a flag as one readable line for a message (a long value is cut, its length said)."""
    shown = " ".join(given)
    return shown if len(shown) <= 80 else f"{shown[:60]}... ({len(shown)} characters)"
