"""KernelCache: the facade over the local tier, the remote tier, bundles and prune; and CacheResult."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Literal, NamedTuple

from jitwarm.cache import bundle, prune, settings
from jitwarm.cache.bundle import ImportReport
from jitwarm.cache.entry import Entry
from jitwarm.cache.errors import CacheError
from jitwarm.cache.files import directory_size, remove_tree
from jitwarm.cache.fleet import Fleet
from jitwarm.cache.keys import check_key, key_of, key_preimage
from jitwarm.cache.layout import BUNDLE_TAG, RootLayout, read_fact, read_plan_record, write_fact, write_plan_record
from jitwarm.cache.local import BuildFn, LocalCache
from jitwarm.cache.locks import OnWait
from jitwarm.cache.prune import PruneReport
from jitwarm.cache.remote import RemoteReport, RemoteStore
from jitwarm.cache.remote_health import redact
from jitwarm.cache.stats import CacheStats, StatsCounter
from jitwarm.cache.verify import VerifyReport, verify_copies

Outcome = Literal["hit", "built", "waited", "downloaded"]


class CacheResult(NamedTuple):
    """What :meth:`KernelCache.get_or_build_ex` returns: the entry and how this call got it.

    ``outcome`` is ``"hit"`` (already published, no wait), ``"built"`` (this call ran ``build``),
    ``"waited"`` (another process of this host held the key's lock and this call used its result) or
    ``"downloaded"`` (the remote tier had it: checked and published into the local root).
    """

    entry: Entry
    outcome: Outcome


class KernelCache:
    """The shared, content-addressed kernel cache (see docs/cache.md).

    Parameters
    ----------
    root : path, optional
        The writable root; ``$JITWARM_CACHE_DIR``, else ``$XDG_CACHE_HOME/jitwarm``, else ``~/.cache/jitwarm``.
    layers : sequence of paths, optional
        Read-only roots searched after ``root``; None means ``$JITWARM_CACHE_PATH`` (pass ``()`` for none).
    lock_dir : path, optional
        Directory of the per-key lock files; ``$JITWARM_LOCK_DIR``, else ``<root>/v1/locks``.
    read_only : bool
        Never write: lookups only, corrupt entries are skipped rather than quarantined, and
        ``get_or_build`` raises on a miss.
    allow_shared : bool
        Accept roots and entries other users can write (also ``JITWARM_ALLOW_SHARED=1``).
    remote : str, optional
        The fleet's shared Redis, the second level after the local root and layers (``redis://``,
        ``rediss://``, with password and db); None means ``$JITWARM_REMOTE``, ``""`` none.
    remote_prefix : str, optional
        Key namespace on that server; ``$JITWARM_REMOTE_PREFIX``, else ``"jitwarm"``.
    remote_required : bool, optional
        Raise ``RemoteUnavailable`` instead of continuing locally when the remote fails;
        ``$JITWARM_REMOTE_REQUIRED`` when None.

    Raises
    ------
    ValueError
        A knob that is read does not parse (one line naming the variable). A ``JITWARM_*`` variable is read
        only when its argument leaves it open (None; ``allow_shared=False``), the ``JITWARM_REMOTE_*`` ones
        only with a remote.

    Notes
    -----
    Contract. Construction reads the environment and touches no file. ``lookup`` and ``wait_for`` never
    build; ``lookup`` returns None for a missing, corrupt (unparsable, unreadable, not a directory, in a
    shard that is no directory) or discarded entry and raises only for an untrusted root or entry
    (``CacheError``); nothing it reads can make it block or recurse without bound. ``verify`` changes
    nothing unless ``repair=True``. An entry held in ``claim`` is never pruned or quarantined.
    ``get_or_build`` runs ``build`` only while holding the key's lock, at most once per key per host (lock
    dir) while entries stay valid. Every returned entry's files
    were hashed by this instance (verified, or sealed and published by it), and their stat signature is
    re-checked on every later lookup. Instances are thread-safe; two threads of one process exclude each
    other like two processes. With a remote, a ``get_or_build`` miss asks it next (under the key's lock)
    and ``build`` runs at most once per key per fleet; a remote failure is logged once and the call goes
    on locally, or raises ``RemoteUnavailable`` with ``remote_required``. Everything else stays local.

    """

    def __init__(self, root: str | os.PathLike[str] | None = None,
                 layers: Sequence[str | os.PathLike[str]] | None = None,
                 lock_dir: str | os.PathLike[str] | None = None,
                 read_only: bool = False, allow_shared: bool = False, remote: str | None = None,
                 remote_prefix: str | None = None, remote_required: bool | None = None) -> None:
        self.root = (settings.directory(settings.absolute_path(root), "cache root") if root is not None
                     else settings.cache_dir())
        self.layers = settings.cache_path() if layers is None else tuple(
            settings.directory(settings.absolute_path(p), "cache layer") for p in layers)
        self.read_only = bool(read_only)
        self.allow_shared = bool(allow_shared) or settings.allow_shared()
        layout = RootLayout(self.root, shared=self.allow_shared)
        self.lock_dir = (settings.absolute_path(lock_dir) if lock_dir is not None
                         else settings.lock_dir() or layout.locks)
        self._stats = StatsCounter()
        self._local = LocalCache(layout, [RootLayout(p) for p in self.layers], self.lock_dir, read_only=self.read_only,
                                 allow_shared=self.allow_shared, count=self._stats.add)
        self.remote = settings.remote() if remote is None else (settings.check_remote_url(remote) if remote else None)
        self.remote_prefix = settings.check_remote_prefix(remote_prefix) if remote_prefix else (
            settings.remote_prefix() if self.remote else settings.DEFAULT_REMOTE_PREFIX)
        self.remote_required = bool(remote_required) if remote_required is not None else (
            bool(self.remote) and settings.remote_required())
        self._remote: RemoteStore | None = None
        self._fleet: Fleet | None = None
        if self.remote is not None:
            self._remote = RemoteStore(self.remote, self.remote_prefix, required=self.remote_required,
                                       max_bytes=settings.remote_max_bytes(), shared=self.allow_shared,
                                       count=self._stats.add)
            self._fleet = Fleet(self._remote, lease_s=settings.remote_lease_s(), count=self._stats.add)

    @property
    def remote_display(self) -> str | None:
        """The remote tier's URL without its password (for messages and reports), or None without one."""
        return redact(self.remote) if self.remote else None

    def __repr__(self) -> str:
        mode = ", read_only=True" if self.read_only else ""
        mode += f", remote={redact(self.remote)!r}" if self.remote else ""
        return f"KernelCache(root={str(self.root)!r}, layers={[str(p) for p in self.layers]}{mode})"

    # -- keys -------------------------------------------------------------------------------------

    def key(self, description: Mapping[str, Any]) -> str:
        """Return the key of ``description``: sha256 hex of the canonical JSON of its preimage.

        Raises
        ------
        TypeError
            ``description`` is not a dict of plain JSON values (the message says where).

        """
        return key_of(description)

    def key_preimage(self, description: Mapping[str, Any]) -> dict[str, Any]:
        """Return the exact object hashed into the key (kept in ``entry.json`` to explain misses); TypeError."""
        return key_preimage(description)

    # -- lookup, get or build, discard, wait --------------------------------------------------------

    def lookup(self, key: str) -> Entry | None:
        """Return the verified entry of ``key`` from the root or a layer, or None.

        Never waits and never builds; takes no lock, except that a corrupt copy in the writable root is
        moved to quarantine when its lock is free (a corrupt layer copy is skipped). Returns None for a
        missing, corrupt or discarded entry.

        Raises
        ------
        ValueError
            ``key`` is not 64 hex digits.
        CacheError
            A root, layer or entry that other users can write (see ``allow_shared``).

        """
        return self._local.lookup(check_key(key))

    def get_or_build(self, description: Mapping[str, Any], build: BuildFn, timeout_s: float = 600.0,
                     on_wait: OnWait | None = None, *, key: str | None = None) -> Entry:
        """Return the entry for ``description``, building it here if no process has.

        Parameters
        ----------
        description : Mapping
            JSON-able description of the artifact; its key is :meth:`key`.
        build : callable
            ``build(staging_dir: Path) -> None`` writes the artifact files (regular files, any subfolders;
            no symlinks, no ``entry.json``). Called under the key's lock, at most once per key per host
            (per fleet with a remote, under the key's fleet lease too).
        timeout_s : float
            How long to wait for another process that holds the key's lock (or another node its fleet
            lease). Our own build is not bounded.
        on_wait : callable, optional
            Called once, with the holder's :class:`LockHolder` (None if not yet recorded), when this call
            has to wait for another holder.
        key : str, optional
            ``cache.key(description)``, already computed by the caller, so that a description is hashed once
            per process: lookups use it as given; before a build it is checked against ``description``.

        Returns
        -------
        Entry
            The verified entry. Use :meth:`get_or_build_ex` to also learn whether it was hit, built or waited.

        Raises
        ------
        CacheError
            Miss in a read-only cache; untrusted root or entry; unusable lock dir; ``RemoteUnavailable``
            when a required remote fails; ``CacheWriteError`` when the root, a lock file, staging or the
            published entry cannot be written (a full disk, a read-only volume).
        LockTimeout
            Another holder kept the lock past ``timeout_s`` (names the key and the holder).
        BuildError
            ``build`` raised (chained) or wrote nothing usable; nothing is published, the lock is released.
        TypeError, ValueError
            ``description`` is not plain JSON; ``key`` is not a key, or not the key of ``description``.

        """
        return self.get_or_build_ex(description, build, timeout_s, on_wait, key=key).entry

    def get_or_build_ex(self, description: Mapping[str, Any], build: BuildFn, timeout_s: float = 600.0,
                        on_wait: OnWait | None = None, *, key: str | None = None) -> CacheResult:
        """Like :meth:`get_or_build`, returning ``CacheResult(entry, outcome)``.

        ``outcome`` is ``"hit"``, ``"built"``, ``"waited"`` or ``"downloaded"`` (see :class:`CacheResult`),
        e.g. for a warm report that counts compiled versus waited kernels.

        Examples
        --------
        >>> key = cache.key(description)           # once per process
        >>> cache.get_or_build_ex(description, build, key=key).outcome
        'hit'

        """
        key = key_of(description) if key is None else check_key(key)
        entry = self._local.lookup(key)                                              # 1. lock-free lookup
        if entry is not None:
            self._stats.add("hits")
            return CacheResult(entry, "hit")
        if self.read_only:
            raise CacheError(f"cache miss for key {key} in a read-only cache ({self.root})", "build it with a "
                             "writable KernelCache, or import a bundle (KernelCache.import_bundle)")
        self._stats.add("misses")
        return CacheResult(*self._local.get_or_build(key, description, build, timeout_s, on_wait, self._fleet))

    def discard(self, entry: Entry, reason: str, *, timeout_s: float = 600.0) -> None:
        """Set aside an entry this cache returned that its caller cannot use (e.g. a library dlopen rejects).

        The cache knows nothing of loading: ``reason`` is the caller's. An entry of the writable root is
        quarantined under its key's lock, with ``reason`` beside it, if it is still the same entry on disk
        (same stat signature; a rebuild another process published meanwhile is left alone). An entry of a
        read-only layer (or of a read-only cache) cannot be moved: this instance remembers it as rejected
        and its lookups skip it from now on, so :meth:`get_or_build` builds the key into the writable root.
        Either way the next ``get_or_build`` of the key builds it again, once under its lock across processes.

        Raises
        ------
        LockTimeout
            The key's lock stayed held past ``timeout_s`` (the entry is still skipped by this instance).
        CacheError
            The lock dir is unusable.

        """
        self._local.discard(entry, reason, timeout_s)

    def claim(self, entry: Entry, *, timeout_s: float = 600.0) -> AbstractContextManager[Entry | None]:
        """Keep ``entry`` from being pruned or quarantined while the caller reads (loads) it.

        ``with cache.claim(entry) as claimed:`` takes a shared ``flock`` on the key's lock file (the one that
        builds, prune, quarantine, import and ``discard`` lock exclusively), then yields the entry if it is
        still there with the very files that were hashed, else None (pruned, quarantined, rebuilt or
        discarded meanwhile; nothing is held then): the caller gets it again and claims that. While held,
        ``prune`` keeps the entry (``skipped_locked``), a lookup does not quarantine it, and a builder, import
        or ``discard`` of the key in another thread or process waits. Released when the block ends.

        Leave the block before discarding or rebuilding the key: inside it, those wait for the block's own
        claim until their deadline (``LockTimeout``). Layer entries are only re-checked (nothing here removes
        them); a root whose lock file cannot be opened (a read-only volume) is read unlocked.

        Raises
        ------
        LockTimeout
            An exclusive holder (a removal, a quarantine, a publish) kept the lock past ``timeout_s``.
        CacheError
            The lock file cannot be locked (no flock on this filesystem).

        Examples
        --------
        >>> with cache.claim(entry) as claimed:
        ...     lib = load(claimed.file("lib.so")) if claimed is not None else None
        >>> if lib is None:                        # it vanished before the claim: get it again
        ...     entry = cache.get_or_build(description, build, key=key)

        """
        return self._local.claim(entry, timeout_s)

    def wait_for(self, key: str, timeout_s: float) -> Entry:
        """Wait until another process publishes ``key`` and return its entry; never builds, takes no lock.

        Polls :meth:`lookup` with a backoff from 20 ms to 0.5 s and logs once, after a few seconds, who
        holds the key's lock.

        Raises
        ------
        LockTimeout
            Nothing was published within ``timeout_s``; names the key and the lock holder, if any.
        CacheError, ValueError
            As for :meth:`lookup`.

        """
        return self._local.wait_for(check_key(key), timeout_s)

    # -- maintenance ------------------------------------------------------------------------------

    def verify(self, keys: Iterable[str] | None = None, *, repair: bool = False) -> VerifyReport:
        """Re-hash every copy of ``keys`` (default: every entry, and every shard path, in the root and layers).

        Looking never changes the cache unless asked. With ``repair=False`` (the default: ``status``, a
        ``verify`` that only looks) a corrupt copy is reported and left in place, and no verification stamp
        is written. With ``repair=True`` corrupt copies in the writable root, and shard paths of it that are
        no directory, are moved to quarantine (when their lock is free), so the next ``get_or_build``
        rebuilds them. Corrupt copies in layers are only ever reported. Never raises for corrupt content.

        Raises
        ------
        CacheError
            An untrusted root or entry.

        """
        return verify_copies(self._local, None if keys is None else sorted({check_key(k) for k in keys}),
                             repair=repair)

    def prune(self, max_bytes: int | None = None, older_than_s: float | None = None, *,
              grace_s: float | None = None) -> PruneReport:
        """Remove entries of the writable root, least recently used first, and abandoned staging dirs.

        Parameters
        ----------
        max_bytes : int, optional
            Remove least recently used entries until the root's entries total at most this many bytes.
        older_than_s : float, optional
            Remove entries not used for this long (and quarantined copies older than this).
        grace_s : float, optional
            Never remove an entry used this recently (default ``JITWARM_PRUNE_GRACE_S``, 600 s): an entry a
            lookup or ``get_or_build`` returned stays at least this long minus a minute, so a caller that
            reads it without a claim does not lose it to a concurrent prune.

        Returns
        -------
        PruneReport
            What was removed, and what was kept because its lock is held. Each removal try-locks its key
            and never waits: an entry whose key lock is held is never removed; layers are never touched.

        Raises
        ------
        CacheError
            The cache is read-only.

        """
        self._require_writable("prune")
        grace = settings.prune_grace_s() if grace_s is None else max(0.0, float(grace_s))
        report = prune.prune_root(self._local.root, self.lock_dir, max_bytes=max_bytes, older_than_s=older_than_s,
                                  grace_s=grace, shared=self.allow_shared)
        for key in report.removed:
            self._local.forget(self._local.root.entry_dir(key))
        return report

    def size_bytes(self) -> int:
        """Return the total size of the entries in the writable root (0 if it does not exist)."""
        return sum(directory_size(path) for _key, path in self._local.root.iter_entry_dirs())

    def stats(self) -> CacheStats:
        """Return this instance's counters: hits, misses, builds, waits, lock-wait seconds, corrupt, remote."""
        return self._stats.snapshot()

    # -- remote tier ------------------------------------------------------------------------------

    def check_remote(self) -> str | None:
        """Ask the remote tier whether it answers: None if it does (or none is set), else why not.

        A failure counts as in ``get_or_build``: logged once, the remote is skipped for a while, and with
        ``remote_required`` it raises ``RemoteUnavailable`` instead.
        """
        return None if self._remote is None else self._remote.check()

    @property
    def remote_error(self) -> str | None:
        """Why this process is running without the remote tier right now (None: it is fine, or unset)."""
        return None if self._remote is None else self._remote.error

    def remote_report(self, keys: Iterable[str]) -> RemoteReport | None:
        """Return which of ``keys`` the remote holds (None without a remote); nothing is downloaded.

        An unreachable remote gives ``available=False``, or raises ``RemoteUnavailable`` when required.
        """
        return None if self._remote is None else self._remote.report(sorted({check_key(k) for k in keys}))

    # -- bundles and plan records -----------------------------------------------------------------

    def export_bundle(self, keys: Iterable[str], path: str | os.PathLike[str]) -> Path:
        """Write the entries of ``keys`` to one relocatable tar (gzip'd if ``path`` ends in .gz/.tgz).

        Members are ``bundle.json``, then ``v1/entries/<kk>/<key>/...``: extracted with ``tar`` into a
        directory, the bundle is a layer (``JITWARM_CACHE_PATH``).

        Raises
        ------
        CacheError
            A key is missing or corrupt (nothing is written).
        CacheWriteError
            ``path`` is a directory, its directory is missing or unwritable, or the disk is full (no
            partial file is left).

        """
        keys = sorted({check_key(k) for k in keys})
        entries = [self.lookup(k) for k in keys]
        missing = [k for k, e in zip(keys, entries, strict=True) if e is None]
        if missing:
            shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
            raise CacheError(f"cannot export to {path}: {len(missing)} key(s) not in the cache {self.root}: {shown}")
        return bundle.write_bundle([e for e in entries if e is not None], settings.absolute_path(path))

    def import_bundle(self, path: str | os.PathLike[str], timeout_s: float = 600.0) -> ImportReport:
        """Import a bundle made by :meth:`export_bundle` into the writable root.

        Every member is checked (no absolute paths, ``..``, links or devices) and every entry fully
        verified (each file hashed once) before anything is published; then each key is published by a
        rename under its key's lock, unless the root or a layer already has it.

        Sizes are capped while the headers are read, before anything is written: a member over
        ``JITWARM_BUNDLE_MAX_FILE_BYTES`` (default 2 GiB) or a bundle over ``JITWARM_BUNDLE_MAX_BYTES``
        (default 32 GiB) is refused. Both the ``v1/entries/...`` layout and the older ``entries/...`` one
        are read.

        Raises
        ------
        CacheError
            A bad archive or entry (nothing imported), or a read-only cache.
        CacheWriteError
            Writing the unpacked entries failed (a full disk): nothing was published, the staging
            directory is gone, and the message names the file and the reason.
        LockTimeout
            A key's lock stayed busy past ``timeout_s`` (keys published before it stay imported).
        ValueError
            A bad ``JITWARM_BUNDLE_MAX_*`` value.

        """
        self._require_writable("import a bundle")
        caps = {"max_file_bytes": settings.bundle_max_file_bytes(), "max_bytes": settings.bundle_max_bytes()}
        self._local.prepare_root()
        staging = self._local.new_staging(BUNDLE_TAG)
        try:
            staged = bundle.unpack_bundle(settings.absolute_path(path), staging, shared=self.allow_shared, **caps)
            done = {key: self._local.publish_new(entry, timeout_s) for key, entry in sorted(staged.items())}
            return ImportReport(imported=tuple(k for k, new in done.items() if new),
                                present=tuple(k for k, new in done.items() if not new))
        finally:
            self._local.root.drop_staging(staging)

    def write_plan_record(self, plan_id: str, record: Mapping[str, Any]) -> Path:
        """Atomically write ``<root>/v1/plans/<plan_id>.json`` and return its path.

        Raises
        ------
        ValueError
            ``plan_id`` is not a safe file name (``[A-Za-z0-9._-]``, 1-128 characters).
        TypeError
            ``record`` is not JSON-able.
        CacheError
            The cache is read-only.
        CacheWriteError
            The record cannot be written (a full disk, a read-only volume).

        """
        self._require_writable("write a plan record")
        self._local.root.plan_path(plan_id)  # a bad id raises before anything is created
        self._local.prepare_root()
        return write_plan_record(self._local.root, plan_id, record)

    # -- facts -------------------------------------------------------------------------------------------

    def read_fact(self, name: str) -> str | None:
        """Return a fact a caller kept in the writable root with :meth:`write_fact`, or None.

        Facts are small strings a caller derived from this host's state and keys by it (jitwarm.kernels keeps
        a compiler's ``--version`` under a name made from the compiler binary's inode, size and times), so a
        later process need not derive them again. The cache knows nothing of their meaning; an unreadable or
        untrusted fact is None. ValueError for a name outside ``[A-Za-z0-9._-]{1,128}``.
        """
        return read_fact(self._local.root, name, allow_shared=self.allow_shared)

    def write_fact(self, name: str, value: str) -> None:
        """Keep ``value`` as the fact ``name``: best effort (a read-only or unwritable root keeps nothing)."""
        if self.read_only:
            return
        with contextlib.suppress(OSError, CacheError):
            self._local.prepare_root()
            write_fact(self._local.root, name, value)

    def read_plan_record(self, plan_id: str) -> dict[str, Any] | None:
        """Return the plan record from the root, else the first layer that has it, else None.

        A record that does not parse as a JSON object is logged and skipped. ValueError for a bad ``plan_id``.
        """
        return read_plan_record([layout for layout, _ in self._local.search_order()], plan_id)

    def _require_writable(self, what: str) -> None:
        """Raise CacheError for a write on a read-only cache."""
        if self.read_only:
            raise CacheError(f"cannot {what}: the cache at {self.root} is read-only")

