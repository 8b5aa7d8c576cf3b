"""Bounded reads of what another process may have planted: files that never block or follow a link, bounded JSON.

Every file the cache reads may have been replaced since it was listed: by a concurrent prune or quarantine,
or, in a shared sticky directory (a lock dir in ``/tmp``), by another user. So every open goes through
:func:`open_regular`: ``O_NONBLOCK`` (a FIFO planted where a holder record was made a waiter block in
``open`` past its deadline), ``O_NOFOLLOW`` (a planted symlink), then ``fstat`` must show a regular file, and
a size cap applies before anything is read. Every JSON document goes through :func:`loads`, whose size and
nesting are bounded (100,000 nested ``[`` made ``json.loads`` raise ``RecursionError`` out of lookups).
"""

from __future__ import annotations

import errno
import json
import os
import stat
from typing import Any

#: JSON documents the cache reads nest at most this deep (a manifest holds a description inside a preimage).
MAX_JSON_DEPTH = 72
_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def open_regular(path: str | os.PathLike[str]) -> tuple[int, os.stat_result]:
    """Open ``path`` for reading without blocking or following a final symlink; return ``(fd, fstat)``.

    Raises
    ------
    OSError
        It cannot be opened (``ELOOP`` for a symlink), or it is not a regular file (``EINVAL``, "not a
        regular file"); the descriptor is closed then.

    """
    fd = os.open(path, _FLAGS)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", os.fspath(path))
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_file(path: str | os.PathLike[str], max_bytes: int) -> bytes:
    """Return the bytes of the regular file ``path``, at most ``max_bytes`` of them.

    Raises
    ------
    OSError
        As :func:`open_regular`, or the file is (or grows while read) larger than ``max_bytes`` (``EFBIG``).

    """
    return read_file_stat(path, max_bytes)[0]


def read_file_stat(path: str | os.PathLike[str], max_bytes: int) -> tuple[bytes, os.stat_result]:
    """:func:`read_file`, also returning the ``fstat`` of what was read (to judge its owner and mode)."""
    fd, st = open_regular(path)
    try:
        if st.st_size > max_bytes:
            raise OSError(errno.EFBIG, f"larger than {max_bytes} bytes", os.fspath(path))
        chunks, left = [], max_bytes + 1
        want = min(left, st.st_size + 1)  # the size as stat'ed, plus one to see a file that grew
        while left > 0 and (chunk := os.read(fd, want)):
            chunks.append(chunk)
            left -= len(chunk)
            want = min(left, 1 << 20)
        if left <= 0:
            raise OSError(errno.EFBIG, f"larger than {max_bytes} bytes", os.fspath(path))
        return b"".join(chunks), st
    finally:
        os.close(fd)


def loads(data: bytes | str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Parse JSON that nests at most ``max_depth`` deep.

    Raises
    ------
    ValueError
        Not JSON, or nested deeper than ``max_depth`` (never ``RecursionError``).

    """
    try:
        doc = json.loads(data)
    except RecursionError:
        raise ValueError(f"JSON nested deeper than {max_depth} levels") from None
    level, depth = [doc], 0
    while level:  # one nesting level at a time, iteratively: the depth check must not recurse either
        depth += 1
        if depth > max_depth:
            raise ValueError(f"JSON nested deeper than {max_depth} levels")
        inner: list[Any] = []
        for value in level:
            children = value.values() if type(value) is dict else value if type(value) is list else ()
            inner.extend(child for child in children if type(child) is dict or type(child) is list)
        level = inner
    return doc


def read_json(path: str | os.PathLike[str], max_bytes: int, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """:func:`read_file` then :func:`loads`; raises OSError or ValueError."""
    return loads(read_file(path, max_bytes), max_depth)
