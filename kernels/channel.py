"""The JSON-lines channel between jitwarm and a child process (build workers, sglang's describer): a message a line."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any, BinaryIO


def scratch_env(scratch: str | os.PathLike[str]) -> dict[str, str]:
    """The variables of a child that imports torch, so it makes nothing outside ``scratch``.

    Importing ``torch._dynamo`` makes Inductor's cache directory, which a jitwarm command would leave on the
    node; no child of jitwarm compiles through Inductor, so nothing is lost with ``scratch``.
    """
    return {"TMPDIR": os.fspath(scratch), "TORCHINDUCTOR_CACHE_DIR": os.path.join(scratch, "inductor")}  # noqa: PTH118


def decode(line: bytes | str) -> Any:
    """The message of one line; ValueError when the line is not JSON."""
    return json.loads(line)


def send(stream: BinaryIO, message: Any) -> None:
    """Write one message and flush it (the other side waits for whole lines)."""
    stream.write(json.dumps(message).encode() + b"\n")
    stream.flush()


def answers() -> BinaryIO:
    """In the child, before importing anything that prints: a copy of stdout for answers; stdout goes to stderr."""
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
