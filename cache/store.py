"""KernelCache: lookup, exactly-once get-or-build, wait, verify and plan records over a root and layers."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, NamedTuple

from jitwarm.cache import bundle, plans, prune
from jitwarm.cache.durable import directory_size, make_dirs, remove_tree
from jitwarm.cache.entry import Entry
from jitwarm.cache.errors import CacheError
from jitwarm.cache.fleet import FleetBuilder
from jitwarm.cache.index import EntryIndex
from jitwarm.cache.keys import check_key, hash_preimage, key_of, key_preimage
from jitwarm.cache.layout import BUNDLE_TAG, RootLayout
from jitwarm.cache.locks import OnWait
from jitwarm.cache.publish import BuildFn, Publisher
from jitwarm.cache.remote import RemoteStore, redact
from jitwarm.cache.reports import CacheStats, ImportReport, PruneReport, RemoteReport, StatsCounter, VerifyReport
from jitwarm.cache.settings import absolute_path, check_remote_prefix, check_remote_url, settings

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
        The writable root; ``$JITWARM_CACHE_DIR``, else ``$XDG_CACHE_HOME/jitwarm``, else
        ``~/.cache/jitwarm``.
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
        ``rediss://``, with password and db); None means ``$JITWARM_REMOTE``, ``""`` none. See
        docs/cache.md, "Remote tier".
    remote_prefix : str, optional
        Key namespace on that server; ``$JITWARM_REMOTE_PREFIX``, else ``"jitwarm"``.
    remote_required : bool, optional
        Raise ``RemoteUnavailable`` instead of continuing locally when the remote fails;
        ``$JITWARM_REMOTE_REQUIRED`` when None.

    Raises
    ------
    ValueError
        A ``JITWARM_*`` variable, ``remote`` or ``remote_prefix`` does not parse (see
        :mod:`jitwarm.cache.settings`).

    Notes
    -----
    Contract. Construction reads the environment and touches no file. ``lookup`` and ``wait_for`` never
    build; ``lookup`` returns None for a missing or corrupt entry and raises only for an untrusted
    root or entry (``CacheError``). ``get_or_build`` runs ``build`` only while holding the key's lock,
    at most once per key per host (lock dir) while entries stay valid; it raises ``LockTimeout`` when
    another holder outlasts ``timeout_s``, ``BuildError`` when ``build`` fails, ``CacheError`` on a miss
    in a read-only cache. Every returned entry was verified (size and sha256 of every file) the first
    time this instance saw it, and its files' stat signature is re-checked on every later lookup.
    Instances are thread-safe; two threads of one process exclude each other like two processes.
    With a remote, a ``get_or_build`` miss asks it next (under the key's lock), and ``build`` runs at
    most once per key per fleet; a remote failure is logged once and the call goes on locally, or
    raises ``RemoteUnavailable`` with ``remote_required``. ``lookup`` and ``wait_for`` stay local.

    """

    def __init__(self, root: str | os.PathLike[str] | None = None,
                 layers: Sequence[str | os.PathLike[str]] | None = None,
                 lock_dir: str | os.PathLike[str] | None = None,
                 read_only: bool = False, allow_shared: bool = False, remote: str | None = None,
                 remote_prefix: str | None = None, remote_required: bool | None = None) -> None:
        env = settings()
        self.root = absolute_path(root) if root is not None else env.cache_dir
        self.layers = tuple(absolute_path(p) for p in (env.cache_path if layers is None else layers))
        self.read_only = bool(read_only)
        self.allow_shared = bool(allow_shared) or env.allow_shared
        self._layout = RootLayout(self.root, shared=self.allow_shared)
        if lock_dir is not None:
            self.lock_dir = absolute_path(lock_dir)
        else:
            self.lock_dir = env.lock_dir or self._layout.locks
        self._stats = StatsCounter()
        self._index = EntryIndex(self._layout, [RootLayout(p) for p in self.layers], self.lock_dir,
                                 root_read_only=self.read_only, allow_shared=self.allow_shared,
                                 stats=self._stats)
        self._publisher = Publisher(self._layout, self._index, self.lock_dir, allow_shared=self.allow_shared,
                                    stats=self._stats)
        self.remote = env.remote if remote is None else (check_remote_url(remote) if remote else None)
        self.remote_prefix = check_remote_prefix(remote_prefix) if remote_prefix else env.remote_prefix
        self.remote_required = env.remote_required if remote_required is None else bool(remote_required)
        self._remote = self._fleet = None
        if self.remote is not None:
            self._remote = RemoteStore(self.remote, prefix=self.remote_prefix, required=self.remote_required,
                                       max_bytes=env.remote_max_bytes, shared=self.allow_shared, stats=self._stats)
            self._fleet = FleetBuilder(self._remote, self._publisher, lease_s=env.remote_lease_s, stats=self._stats)

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
            ``description`` is not a dict of plain JSON values.

        """
        return key_of(description)

    def key_preimage(self, description: Mapping[str, Any]) -> dict[str, Any]:
        """Return the exact object hashed into the key (kept in ``entry.json`` to explain misses)."""
        return key_preimage(description)

    # -- lookup -----------------------------------------------------------------------------------

    def lookup(self, key: str) -> Entry | None:
        """Return the verified entry of ``key`` from the root or a layer, or None.

        Never waits and never builds. A corrupt entry counts as a miss: in the writable root it is moved to
        quarantine (when its lock is free), in a read-only layer it is skipped.

        Raises
        ------
        ValueError
            ``key`` is not 64 hex digits.
        CacheError
            A root, layer or entry that other users can write (see ``allow_shared``).

        """
        return self._index.find(check_key(key))

    # -- get or build -----------------------------------------------------------------------------

    def get_or_build(self, description: Mapping[str, Any], build: BuildFn, timeout_s: float = 600.0,
                     on_wait: OnWait | None = None) -> Entry:
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

        Returns
        -------
        Entry
            The verified entry. Use :meth:`get_or_build_ex` to also learn whether it was hit, built or waited.

        Raises
        ------
        CacheError
            Miss in a read-only cache; untrusted root or entry; unusable lock dir; ``RemoteUnavailable``
            when a required remote fails.
        LockTimeout
            Another holder kept the lock past ``timeout_s`` (names the key and the holder).
        BuildError
            ``build`` raised (chained) or wrote nothing usable; nothing is published, the lock is released.

        """
        return self.get_or_build_ex(description, build, timeout_s, on_wait).entry

    def get_or_build_ex(self, description: Mapping[str, Any], build: BuildFn, timeout_s: float = 600.0,
                        on_wait: OnWait | None = None) -> CacheResult:
        """Like :meth:`get_or_build`, returning ``CacheResult(entry, outcome)``.

        ``outcome`` is ``"hit"``, ``"built"``, ``"waited"`` or ``"downloaded"`` (see :class:`CacheResult`),
        e.g. for a warm report that counts compiled versus waited kernels.
        """
        preimage = key_preimage(description)
        key = hash_preimage(preimage)
        entry = self._index.find(key)
        if entry is not None:
            self._stats.add("hits")
            return CacheResult(entry, "hit")
        if self.read_only:
            raise CacheError(f"cache miss for key {key} in a read-only cache ({self.root}); build it with a "
                             "writable cache (jitwarm warm) or import a bundle")
        self._stats.add("misses")
        self._prepare_root()
        return CacheResult(*self._publisher.get_or_build(key, preimage, build, timeout_s, on_wait, self._fleet))

    def _prepare_root(self) -> None:
        """Create the root's top directories (nothing is created before the first write) and check them."""
        try:
            self._layout.ensure(self._layout.entries)
            make_dirs(self.lock_dir, self._layout.dir_mode)
        except OSError as exc:
            raise CacheError(f"cannot create the cache root {self.root}: {exc}; set JITWARM_CACHE_DIR to "
                             "a writable directory, or use KernelCache(read_only=True) for lookups") from exc
        self._index.check_root(self._layout)

    # -- waiting ----------------------------------------------------------------------------------

    def wait_for(self, key: str, timeout_s: float) -> Entry:
        """Wait until another process publishes ``key`` and return its entry; never builds.

        Polls :meth:`lookup` with a backoff from 20 ms to 0.5 s and logs once, after a few seconds, who
        holds the key's lock.

        Raises
        ------
        LockTimeout
            Nothing was published within ``timeout_s``; names the key and the lock holder, if any.
        CacheError, ValueError
            As for :meth:`lookup`.

        """
        entry = self.lookup(key)
        if entry is not None:
            self._stats.add("hits")
            return entry
        self._stats.add("misses")
        self._stats.add("waits")
        return self._publisher.wait_published(key, timeout_s)

    # -- maintenance ------------------------------------------------------------------------------

    def verify(self, keys: Iterable[str] | None = None) -> VerifyReport:
        """Re-hash every copy of ``keys`` (default: every entry in the root and layers).

        Corrupt copies in the writable root are quarantined (when their lock is free); corrupt copies in
        layers are reported only. Never raises for corrupt content.

        Raises
        ------
        CacheError
            An untrusted root or entry.

        """
        return self._index.verify(None if keys is None else sorted({check_key(k) for k in keys}))

    def prune(self, max_bytes: int | None = None, older_than_s: float | None = None) -> PruneReport:
        """Remove entries of the writable root, least recently used first, and abandoned staging dirs.

        Parameters
        ----------
        max_bytes : int, optional
            Remove least recently used entries until the root's entries total at most this many bytes.
        older_than_s : float, optional
            Remove entries not used for this long (and quarantined copies older than this).

        Returns
        -------
        PruneReport
            What was removed, and what was kept because its lock is held. An entry whose key lock is held
            is never removed; layers are never touched.

        Raises
        ------
        CacheError
            The cache is read-only.

        """
        self._require_writable("prune")
        report = prune.prune_root(self._layout, self.lock_dir, max_bytes=max_bytes, older_than_s=older_than_s)
        for key in report.removed:
            self._index.forget(self._layout.entry_dir(key))
        return report

    def size_bytes(self) -> int:
        """Return the total size of the entries in the writable root (0 if it does not exist)."""
        return sum(directory_size(path) for _key, path in self._layout.iter_entry_dirs())

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

    # -- bundles ----------------------------------------------------------------------------------

    def export_bundle(self, keys: Iterable[str], path: str | os.PathLike[str]) -> Path:
        """Write the entries of ``keys`` to one relocatable tar (gzip'd if ``path`` ends in .gz/.tgz).

        Raises
        ------
        CacheError
            A key is missing or corrupt (nothing is written).

        """
        keys = sorted({check_key(k) for k in keys})
        entries = [self.lookup(k) for k in keys]
        missing = [k for k, e in zip(keys, entries, strict=True) if e is None]
        if missing:
            raise CacheError(f"cannot export: {len(missing)} key(s) not in the cache: {missing}")
        return bundle.write_bundle([e for e in entries if e is not None], absolute_path(path))

    def import_bundle(self, path: str | os.PathLike[str], timeout_s: float = 600.0) -> ImportReport:
        """Import a bundle made by :meth:`export_bundle` into the writable root.

        Every member is checked (no absolute paths, ``..``, links or devices) and every entry fully
        verified before anything is published; then each key is published through the normal locked
        atomic path.

        Raises
        ------
        CacheError
            A bad archive or entry (nothing imported), or a read-only cache.
        LockTimeout
            A key's lock stayed busy past ``timeout_s`` (keys published before it stay imported).

        """
        self._require_writable("import a bundle")
        self._prepare_root()
        staging = self._layout.new_staging_dir(BUNDLE_TAG)
        self._layout.ensure(self._layout.staging)
        try:
            staged = bundle.unpack_bundle(absolute_path(path), staging, dir_mode=self._layout.dir_mode)
            return self._publisher.import_staged(staged, timeout_s)
        finally:
            remove_tree(staging)

    # -- plan records -----------------------------------------------------------------------------

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

        """
        self._require_writable("write a plan record")
        self._layout.plan_path(plan_id)  # validate before creating anything
        self._prepare_root()
        return plans.write_plan_record(self._layout, plan_id, record)

    def read_plan_record(self, plan_id: str) -> dict[str, Any] | None:
        """Return the plan record from the root, else the first layer that has it, else None.

        A record that does not parse as a JSON object is logged and skipped (returns None if no other).
        """
        return plans.read_plan_record([layout for layout, _ in self._index.search_order()], plan_id)

    def _require_writable(self, what: str) -> None:
        if self.read_only:
            raise CacheError(f"cannot {what}: the cache at {self.root} is read-only")
