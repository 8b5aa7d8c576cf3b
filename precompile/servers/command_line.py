"""The words of a server command line that read alike for every room: environment, launcher, flags, values."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from pathlib import PurePath
from typing import Any

from jitwarm.cache import files
from jitwarm.cache.errors import UsageError

#: A shell's leading ``NAME=value`` word: the environment of the command.
ENV_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=.*")
#: The longest JSON-object flag value read (a real one is a few dozen bytes), and how deep it may nest.
MAX_JSON_BYTES, MAX_JSON_DEPTH = 1 << 16, 8


class ServerArgvError(UsageError, ValueError):
    """A server command line that does not parse as the server would read it: exit 2."""


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


def recognises(argv: Sequence[str], modules: Sequence[str], program: str) -> bool:
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
