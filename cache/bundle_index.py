"""What a bundle holds, read without importing it: ``bundle.json`` and each entry's description and size.

Every member header is checked as an import checks it (the same caps and refusals); only ``bundle.json`` and the
entries' ``entry.json`` are read, each bounded, and nothing is written.
"""

from __future__ import annotations

import os
import tarfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jitwarm.cache import settings
from jitwarm.cache.bundle import _READ_ERRORS, BUNDLE_MANIFEST, BundleHead, _checked_members, _read_problem, read_head
from jitwarm.cache.bundle_headers import BoundedTar, HeaderRefused
from jitwarm.cache.entry import MANIFEST, MAX_MANIFEST_BYTES, parse_manifest
from jitwarm.cache.errors import CacheError, CorruptEntry
from jitwarm.cache.files import open_regular


@dataclass(frozen=True)
class BundleIndex:
    """A bundle's ``head`` (None: no ``bundle.json``), and per key its ``descriptions`` and stored ``sizes``."""

    head: BundleHead | None
    descriptions: Mapping[str, dict[str, Any]] = field(default_factory=dict)
    sizes: Mapping[str, int] = field(default_factory=dict)

    @property
    def about(self) -> dict[str, Any] | None:
        """The exporter's ``about`` object, or None."""
        return None if self.head is None else self.head.about


def read_index(path: str | os.PathLike[str]) -> BundleIndex:
    """Read the index of the bundle file at ``path``; CacheError for one an import would refuse."""
    where = Path(path)
    try:
        fd, _st = open_regular(where)
    except OSError as exc:
        raise CacheError(f"cannot read bundle {path}: {exc.strerror or exc}") from exc
    head, descriptions, sizes = None, {}, {}
    with os.fdopen(fd, "rb") as raw:
        try:
            with BoundedTar.open(fileobj=raw, mode="r|*") as tar:  # headers bounded as an import bounds them
                members = _checked_members(path, tar, settings.bundle_max_file_bytes(), settings.bundle_max_bytes())
                for member, rel in members:
                    parts = rel.split("/")
                    if rel == BUNDLE_MANIFEST:
                        head = read_head(path, _read(tar, member))
                    elif parts[0] == "entries":
                        key = parts[2]
                        sizes[key] = sizes.get(key, 0) + member.size
                        if parts[3:] == [MANIFEST]:
                            descriptions[key] = _description(path, key, _read(tar, member))
        except HeaderRefused as exc:
            raise CacheError(f"refusing bundle {path}: {exc}") from None
        except _READ_ERRORS as exc:
            raise CacheError(f"cannot read bundle {path}: {_read_problem(exc)}") from exc
    if not sizes:
        raise CacheError(f"bundle {path} holds no entries")
    return BundleIndex(head, descriptions, sizes)


def _read(tar: tarfile.TarFile, member: tarfile.TarInfo) -> bytes:
    """The bytes of a small member (``bundle.json``, an ``entry.json``): at most the manifest cap."""
    if member.size > MAX_MANIFEST_BYTES:
        raise CacheError(f"bundle member {member.name[:200]!r} is larger than {MAX_MANIFEST_BYTES} bytes")
    src = tar.extractfile(member)
    if src is None:
        raise CacheError(f"cannot read bundle member {member.name[:200]!r}")
    with src:
        return src.read(member.size)


def _description(where: Any, key: str, data: bytes) -> dict[str, Any]:
    """An entry's description from its ``entry.json``; CacheError for one that does not parse."""
    try:
        doc, _records = parse_manifest(data, key, f"entry {key} of bundle {where}")
    except CorruptEntry as exc:
        raise CacheError(str(exc)) from None
    return dict(doc["preimage"]["description"])
