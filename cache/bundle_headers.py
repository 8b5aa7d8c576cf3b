"""A bundle's tar headers, bounded before ``tarfile`` reads them: sizes of names and extended headers, their count.

``tarfile`` reads a GNU long name or a PAX header whole, at the size its header claims, before any member is
returned: a 3 MB ``.tar.gz`` whose first header claimed a 3 GiB long name ended in ``MemoryError`` under a 4 GB
limit (a 1 GiB one cost 2.1 GB, or 3.1 GB as PAX), and each extended header made ``tarfile`` recurse once for the
header after it. :class:`BoundedTar` refuses such a header from its 512 bytes, before its data is read.
"""

from __future__ import annotations

import tarfile
from typing import Any

from jitwarm.cache.entry import MAX_PATH_DEPTH

#: A member's name (a GNU long name or link, a PAX ``path``) longer than this is refused: Linux's ``PATH_MAX``.
MAX_NAME_BYTES = 4096
#: One file or folder name of a member at most (Linux's ``NAME_MAX``).
MAX_PART_BYTES = 255
#: A member's name deeper than this many folders is refused: ``v1/entries/<kk>/<key>/`` and an entry's file.
MAX_DEPTH = MAX_PATH_DEPTH + 4
#: One PAX extended header's records at most (a path, a size, times: well under 1 KiB from any tar writer).
MAX_PAX_BYTES = 64 << 10
#: Every header of a bundle together, their 512-byte blocks and the extended headers' data.
MAX_HEADER_BYTES = 64 << 20
#: Members at most: each header costs about 50 us and 0.5 KiB to check on a loaded 2-core box, so refusing
#: the one past the cap takes a few seconds and about 30 MB (a 400,000-member bundle took 213 s and 730 MB).
MAX_MEMBERS = 50_000
#: Extended headers in a row before a member's own (``tarfile`` recurses once for each).
MAX_CHAIN = 4

_LONG = (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK)
_PAX = (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE)


class HeaderRefused(tarfile.TarError):
    """A header over a bound: the reason, without the bundle's name (not a ``ReadError``: ``r:*`` stops at it)."""


class _BoundedInfo(tarfile.TarInfo):
    """A header checked against the bounds before ``tarfile`` reads what follows it."""

    def _proc_member(self, tar: Any) -> tarfile.TarInfo:  # tarfile's documented hook for a subclass
        extended = self.type in _LONG or self.type in _PAX
        tar.header_bytes += tarfile.BLOCKSIZE + (self._block(self.size) if extended else 0)
        tar.chain = tar.chain + 1 if extended else 0
        if not extended:
            tar.member_count += 1
        why = None
        if self.type == tarfile.GNUTYPE_SPARSE:
            why = "is a sparse file"
        elif self.type in _LONG and self.size > MAX_NAME_BYTES:
            why = f"claims a GNU long name of {self.size} bytes, over {MAX_NAME_BYTES}"
        elif self.type in _PAX and self.size > MAX_PAX_BYTES:
            why = f"claims a PAX header of {self.size} bytes, over {MAX_PAX_BYTES}"
        elif tar.chain > MAX_CHAIN:
            why = f"is the {tar.chain}th extended header in a row, over {MAX_CHAIN}"
        elif tar.header_bytes > MAX_HEADER_BYTES:
            why = f"takes the headers over {MAX_HEADER_BYTES} bytes in all"
        elif tar.member_count > MAX_MEMBERS:
            why = f"is beyond {MAX_MEMBERS} members"
        if why is not None:
            raise HeaderRefused(f"the header at byte {self.offset} {why}")
        return super()._proc_member(tar)

    # GNU sparse maps in PAX records read further blocks, as many as the records claim: no sparse member here.
    def _proc_gnusparse_00(self, *args: Any) -> None:
        raise HeaderRefused(f"the header at byte {self.offset} is a sparse file")

    _proc_gnusparse_01 = _proc_gnusparse_10 = _proc_gnusparse_00


class BoundedTar(tarfile.TarFile):
    """``tarfile.TarFile`` whose headers are bounded (:data:`MAX_NAME_BYTES` ...); :exc:`HeaderRefused` past one.

    Open it as ``BoundedTar.open(fileobj=f, mode="r:*")`` (or ``"r|*"``); read members with :func:`members`.
    """

    tarinfo = _BoundedInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.header_bytes = self.chain = self.member_count = 0  # the first header is read by __init__ itself
        super().__init__(*args, **kwargs)


def members(tar: tarfile.TarFile) -> Any:
    """Yield each member once, keeping none in ``tar.members`` (its list grew with every header)."""
    while (member := tar.next()) is not None:
        tar.members.clear()
        yield member


def name_problem(name: str) -> str | None:
    """Why a member's name is too long or too deep, or None."""
    if len(name.encode("utf-8", "surrogateescape")) > MAX_NAME_BYTES:
        return f"is a name over {MAX_NAME_BYTES} bytes"
    if name.count("/") > MAX_DEPTH:
        return f"lies deeper than {MAX_DEPTH} folders"
    if any(len(part.encode("utf-8", "surrogateescape")) > MAX_PART_BYTES for part in name.split("/")):
        return f"has a file or folder name over {MAX_PART_BYTES} bytes"
    return None


class Layout:
    """The files and folders a bundle's members make so far: a file where a folder goes, or the reverse, clashes."""

    def __init__(self) -> None:
        self._files: set[str] = set()
        self._folders: set[str] = set()

    def clash(self, rel: str) -> str | None:
        """Add the file ``rel``; return why it cannot be placed with those before it, or None."""
        parents = [rel[:at] for at, char in enumerate(rel) if char == "/"]
        if rel in self._folders:
            return "is a file where earlier members put a folder"
        if any(p in self._files for p in parents):
            return "lies under a file of an earlier member"
        self._files.add(rel)
        self._folders.update(parents)
        return None
