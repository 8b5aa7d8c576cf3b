"""KernelCache: the cache's one public face, the protocol (:mod:`.protocol`) with its settings, remote and bundles."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from jitwarm.cache import bundle, bundle_export, settings
from jitwarm.cache.bundle import ImportReport
from jitwarm.cache.entry import Entry
from jitwarm.cache.errors import CacheError
from jitwarm.cache.files import directory_size
from jitwarm.cache.keys import check_key
from jitwarm.cache.layout import BUNDLE_TAG, RootLayout, read_fact, read_plan_record, write_fact, write_plan_record
from jitwarm.cache.maintenance import PruneReport, prune_root
from jitwarm.cache.remote import Fleet, RemoteReport, open_store, redact
from jitwarm.cache.remote.s3_bundle import is_bundle_url, open_bundle
from jitwarm.cache.store.protocol import LocalCache


class KernelCache(LocalCache):
    """The shared, content-addressed kernel cache (docs/cache.md).

    Each argument left None is read from its ``JITWARM_*`` setting (``remote=""``: no remote); ``read_only``:
    lookups only; ``allow_shared``: accept what other users can write. ``SettingError`` when a setting does
    not parse. Construction touches no file and connects to nothing; instances are thread-safe.
    """

    def __init__(self, root: str | os.PathLike[str] | None = None,
                 layers: Sequence[str | os.PathLike[str]] | None = None,
                 lock_dir: str | os.PathLike[str] | None = None,
                 read_only: bool = False, allow_shared: bool = False, remote: str | None = None,
                 remote_prefix: str | None = None, remote_required: bool | None = None) -> None:
        root_dir = (settings.directory(settings.absolute_path(root), "cache root") if root is not None
                    else settings.cache_dir())
        self.layers = settings.cache_path() if layers is None else tuple(
            settings.directory(settings.absolute_path(p), "cache layer") for p in layers)
        shared = bool(allow_shared) or settings.allow_shared()
        layout = RootLayout(root_dir, shared=shared)
        super().__init__(layout, [RootLayout(p) for p in self.layers],
                         settings.absolute_path(lock_dir) if lock_dir is not None
                         else settings.lock_dir() or layout.locks, read_only=bool(read_only), allow_shared=shared)
        self.remote = settings.remote() if remote is None else (settings.check_remote_url(remote) if remote else None)
        self.remote_prefix = settings.check_remote_prefix(remote_prefix) if remote_prefix else (
            settings.remote_prefix() if self.remote else settings.DEFAULT_REMOTE_PREFIX)
        self.remote_required = bool(remote_required) if remote_required is not None else (
            bool(self.remote) and settings.remote_required())
        self._remote = None if self.remote is None else open_store(
            self.remote, self.remote_prefix, required=self.remote_required, max_bytes=settings.remote_max_bytes(),
            min_rate=settings.remote_min_rate(), shared=self.allow_shared, count=self._count)
        self._fleet = None if self._remote is None else Fleet(self._remote, lease_s=settings.remote_lease_s(),
                                                              count=self._count)

    @property
    def remote_display(self) -> str | None:
        """The remote tier's URL without its password, or None without one."""
        return redact(self.remote) if self.remote else None

    def __repr__(self) -> str:
        mode = ", read_only=True" if self.read_only else ""
        mode += f", remote={self.remote_display!r}" if self.remote else ""
        return f"KernelCache(root={str(self.root)!r}, layers={[str(p) for p in self.layers]}{mode})"

    def prune(self, max_bytes: int | None = None, older_than_s: float | None = None, *,
              grace_s: float | None = None) -> PruneReport:
        """Remove root entries least recently used first (to ``max_bytes``, or unused ``older_than_s``).

        Keeps an entry locked, claimed or used within ``grace_s`` (``JITWARM_PRUNE_GRACE_S``). ``CacheError`` (a
        read-only cache), ``UntrustedPath`` (the lock dir).
        """
        self._require_writable("prune")
        grace = settings.prune_grace_s() if grace_s is None else max(0.0, float(grace_s))
        report = prune_root(self.layout, self.lock_dir, max_bytes=max_bytes, older_than_s=older_than_s,
                            grace_s=grace, shared=self.allow_shared)
        for key in report.removed:
            self.forget(self.layout.entry_dir(key))
        return report

    def size_bytes(self) -> int:
        """Return the total size of the entries in the writable root (0 if it does not exist)."""
        return sum(directory_size(path) for _key, path in self.layout.iter_entry_dirs())

    def check_remote(self) -> str | None:
        """None if the remote answers (or none is set), else why not (logged once; raises if required)."""
        return None if self._remote is None else self._remote.check()

    @property
    def remote_error(self) -> str | None:
        """Why this process is running without the remote tier right now (None: it is fine, or unset)."""
        return None if self._remote is None else self._remote.error

    def remote_report(self, keys: Iterable[str]) -> RemoteReport | None:
        """Which of ``keys`` the remote holds, nothing downloaded (None without a remote)."""
        return None if self._remote is None else self._remote.report(sorted({check_key(k) for k in keys}))

    def export_bundle(self, keys: Iterable[str], path: str | os.PathLike[str], *,
                      about: Mapping[str, Any] | None = None) -> Path:
        """Write the entries of ``keys`` to one relocatable tar; ``CacheError`` (a missing key), ``CacheWriteError``.

        ``about``: a JSON object the bundle carries unread in ``bundle.json`` (the import's ``ImportReport.about``).
        """
        return bundle_export.write_bundle(self._entries(keys, path), settings.absolute_path(path),
                                          trust_key=self.trust_key(), about=about)

    def export_bundle_to_store(self, keys: Iterable[str], url: str, *, about: Mapping[str, Any] | None = None) -> str:
        """Stream the entries of ``keys`` to the object ``s3://BUCKET/KEY.tar``; return its sha256.

        ``CacheError`` for a missing key, ``BundleStoreError`` (a store fault: no object is left).
        """
        from jitwarm.cache.remote.s3_bundle import upload_bundle

        return upload_bundle(url, self._entries(keys, url), trust_key=self.trust_key(), about=about)

    def _entries(self, keys: Iterable[str], dest: object) -> list[Entry]:
        """The entries of ``keys`` in key order; CacheError naming missing ones."""
        found = {k: self.lookup(k) for k in sorted({check_key(k) for k in keys})}
        missing = [k for k, e in found.items() if e is None]
        if missing:
            shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
            raise CacheError(f"cannot export to {dest}: {len(missing)} key(s) not in the cache {self.root}: {shown}")
        return [e for e in found.values() if e is not None]

    def import_bundle(self, path: str | os.PathLike[str], timeout_s: float = 600.0, *,
                      sha256: str | None = None) -> ImportReport:
        """Import a bundle (a file, or an object ``s3://BUCKET/KEY.tar``): nothing published before all verified.

        ``sha256``: the pin the bundle must hash to. Raises ``CacheError`` (a bad bundle, a read-only cache),
        ``CacheWriteError``, ``LockTimeout``, ``UntrustedEntry`` (exit 4: unsigned under a fleet key); from the
        object store, ``BundleStoreError`` for a fault and ``UsageError`` for no such object.
        """
        self._require_writable("import a bundle")
        caps = {"max_file_bytes": settings.bundle_max_file_bytes(), "max_bytes": settings.bundle_max_bytes(),
                "shared": self.allow_shared, "sha256": sha256, "trust_key": self.trust_key()}
        self._prepare_root()
        staging = self.new_staging(BUNDLE_TAG)
        try:
            if is_bundle_url(path):  # read as a stream, hashed as read: nothing published before the pin is met
                with open_bundle(str(path)) as body:
                    staged = bundle.unpack_stream(body, str(path), staging, **caps)
            else:
                staged = bundle.unpack_bundle(settings.absolute_path(path), staging, **caps)
            done = {key: self.publish_new(entry, timeout_s) for key, entry in sorted(staged.entries.items())}
            return ImportReport(imported=tuple(k for k, new in done.items() if new),
                                present=tuple(k for k, new in done.items() if not new),
                                descriptions={k: entry.description for k, entry in staged.entries.items()},
                                about=staged.about)
        finally:
            self.layout.drop_staging(staging)

    def write_plan_record(self, plan_id: str, record: Mapping[str, Any]) -> Path:
        """Atomically write ``<root>/v1/plans/<plan_id>.json``; ValueError for a bad id, TypeError, CacheError."""
        self._require_writable("write a plan record")
        self.layout.plan_path(plan_id)  # a bad id raises before anything is created
        self._prepare_root()
        return write_plan_record(self.layout, plan_id, record)

    def prepare_root(self) -> None:
        """Create and trust-check the root's top folders now: RootNotWritable (exit 2) if it cannot be."""
        self._require_writable("write entries")
        self._prepare_root()

    def read_fact(self, name: str) -> str | None:
        """A fact kept by :meth:`write_fact`, or None; ValueError for a bad name."""
        return read_fact(self.layout, name, allow_shared=self.allow_shared)

    def write_fact(self, name: str, value: str) -> None:
        """Keep ``value`` as the fact ``name``: best effort (a read-only or unwritable root keeps nothing)."""
        if self.read_only:
            return
        with contextlib.suppress(OSError, CacheError):
            self._prepare_root()
            write_fact(self.layout, name, value)

    def read_plan_record(self, plan_id: str) -> dict[str, Any] | None:
        """The plan record from the root, else the first layer that has it, else None."""
        return read_plan_record([layout for layout, _ in self.search_order], plan_id)

    def _require_writable(self, what: str) -> None:
        """Raise CacheError for a write on a read-only cache."""
        if self.read_only:
            raise CacheError(f"cannot {what}: the cache at {self.root} is read-only")
