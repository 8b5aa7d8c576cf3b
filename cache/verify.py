"""``KernelCache.verify``: the full check of every copy of some keys (or of everything), and VerifyReport.

Looking never changes the cache unless asked: without ``repair`` a corrupt copy is reported and left where it
is, and no stamp is written; with it, corrupt copies of the writable root (and bad shard paths) are moved to
quarantine as a lookup would move them. Layers are only ever reported.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jitwarm.cache.local import LocalCache


@dataclass(frozen=True)
class VerifyReport:
    """Result of :meth:`KernelCache.verify`.

    Attributes
    ----------
    ok : tuple of str
        Keys with at least one copy (root or layer) that verified.
    corrupt : dict of str to str
        Keys with a copy that failed, and why (with its path). A shard path of ``entries/`` that is no
        directory (a file, a symlink, unreadable) holds no key: it is listed under its own path.
    missing : tuple of str
        Requested keys with no copy anywhere.
    quarantined : tuple of str
        Those of ``corrupt`` whose bad copy was moved to ``<root>/v1/quarantine`` (only with ``repair``;
        layer copies never are).

    """

    ok: tuple[str, ...] = ()
    corrupt: dict[str, str] = field(default_factory=dict)
    missing: tuple[str, ...] = ()
    quarantined: tuple[str, ...] = ()

    @property
    def clean(self) -> bool:
        """True when nothing was corrupt or missing."""
        return not self.corrupt and not self.missing

    def to_json(self) -> dict[str, Any]:
        """Return the report as a JSON-able dict."""
        return {"ok": list(self.ok), "corrupt": dict(self.corrupt), "missing": list(self.missing),
                "quarantined": list(self.quarantined)}


def verify_copies(local: LocalCache, keys: Sequence[str] | None, *, repair: bool) -> VerifyReport:
    """Hash every copy of ``keys`` in the root and each layer (every entry and shard when None).

    Raises ``CacheError`` only for an untrusted root or entry; corrupt content is reported.
    """
    ok, corrupt, quarantined = set(), {}, set()
    for layout, read_only in local.search_order():
        if keys is None:
            found = list(layout.iter_entry_names())
        else:
            found = [(k, layout.entry_dir(k)) for k in keys if _lexists(layout.entry_dir(k))]
        for key, path in found:
            if key is None:
                local.check_root(layout)
                _entry, why = local.bad_shard(layout, path, read_only=read_only, repair=repair)
            else:
                entry, why = local.check_copy(layout, key, read_only=read_only, locked=False, repair=repair)
                if entry is not None:
                    ok.add(key)
            if why is not None:
                name = key or str(path)
                corrupt[name] = "; ".join(filter(None, (corrupt.get(name), why)))
                if repair and not read_only and not _lexists(path):
                    quarantined.add(name)
    missing = tuple(k for k in keys or () if k not in ok and k not in corrupt)
    return VerifyReport(ok=tuple(sorted(ok)), corrupt=corrupt, missing=missing, quarantined=tuple(sorted(quarantined)))


def _lexists(path: Path) -> bool:
    """Whether something is at ``path``; True also when a shard in the way is not a directory (it is the fault)."""
    try:
        os.lstat(path)
    except FileNotFoundError:
        return False
    except OSError as exc:
        return exc.errno != errno.ENOTDIR or os.path.lexists(path.parent)
    return True
