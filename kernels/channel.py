"""The JSON-lines channel between jitwarm and a child process: one JSON document per line, each way.

The build workers and sglang's describe child speak it. The child answers on a private copy of its stdout and
points stdout itself at stderr (:func:`answers`): whatever the code it imports prints never enters the answers.
A child that imports a server or torch runs in :func:`scratch_env`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any, BinaryIO


def scratch_env(scratch: str | os.PathLike[str]) -> dict[str, str]:
    """The variables of a child that imports torch (or a server that does), so it makes nothing outside ``scratch``.

    Importing ``torch._dynamo`` makes Inductor's cache directory (torch/_inductor/runtime/cache_dir_utils.py):
    ``$TMPDIR/torchinductor_$USER``, or ``~/.cache/sglang/inductor`` once sglang is imported (its redirect). A jitwarm
    command made them on the node, outside the cache it was given (issue #31). None of jitwarm's children compiles
    through Inductor, so nothing of theirs is lost with ``scratch``, which the caller removes after.
    """
    return {"TMPDIR": os.fspath(scratch), "TORCHINDUCTOR_CACHE_DIR": os.path.join(scratch, "inductor")}  # noqa: PTH118


def encode(message: Any) -> bytes:
    """``message`` as one line of JSON, newline included."""
    return json.dumps(message).encode() + b"\n"


def decode(line: bytes | str) -> Any:
    """The message of one line; ValueError when the line is not JSON."""
    return json.loads(line)


def send(stream: BinaryIO, message: Any) -> None:
    """Write one message and flush it (the other side waits for whole lines)."""
    stream.write(encode(message))
    stream.flush()


def answers() -> BinaryIO:
    """In the child: the stream its answers go to, a copy of stdout; stdout itself goes to stderr from now on.

    Call it before importing anything that might print.
    """
    stream = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    return stream


class LineReader:
    """Cut what a child writes, read in chunks of any size, into whole lines."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> None:
        """Add what was read."""
        self._buffer += chunk

    def next_line(self) -> bytes | None:
        """The next whole line (without its newline), or None until one has arrived."""
        if b"\n" not in self._buffer:
            return None
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    def lines(self) -> Iterator[bytes]:
        """Every whole line that has arrived."""
        while (line := self.next_line()) is not None:
            yield line

    @property
    def pending(self) -> bool:
        """True when part of a line is waiting for its end."""
        return bool(self._buffer)
