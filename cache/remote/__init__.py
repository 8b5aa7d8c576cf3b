"""The remote tier: a second cache level the fleet shares, so each key is built once per fleet.

A *store* moves whole entries: :mod:`.redis` (``redis://``) or :mod:`.s3` (``s3://``, an object store, with
its lease in :mod:`.s3_lease`); the *fleet protocol* (:mod:`.fleet`) decides when to download, lease, wait,
build and upload. :func:`open_store` picks the store from the URL's scheme. A store offers ``usable``,
``failed``, ``fetch(key, dest)``, ``upload(entry)``, ``report(keys)``, ``check()``, ``display``, ``error`` and
``new_lease(key, ttl_s)``; what both do alike (health, failures, reports, reading an entry to upload) is
:class:`~jitwarm.cache.remote.base.StoreBase`. What it returns goes through
:func:`jitwarm.cache.entry.unpack_entry`: a remote is never trusted (docs/cache.md, "Remote tier").
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

from jitwarm.cache.remote.base import RemoteFailure, RemoteReport, reset_health
from jitwarm.cache.remote.fleet import Fleet, FleetLease, LocalSteps
from jitwarm.cache.remote.redis import RemoteStore, redact
from jitwarm.cache.remote.s3 import ObjectStore
from jitwarm.cache.settings import SettingError, trust_key

__all__ = ["Fleet", "FleetLease", "LocalSteps", "ObjectStore", "RemoteFailure", "RemoteReport", "RemoteStore",
           "open_store", "redact", "reset_remote_health"]


def open_store(url: str, prefix: str, *, required: bool, max_bytes: int, shared: bool,
               count: Callable[..., None]) -> RemoteStore | ObjectStore:
    """Return the store of ``url`` (``s3://``: :class:`ObjectStore`, else Redis); connects to nothing.

    The fleet key (``JITWARM_TRUST_KEY`` or ``_FILE``, :mod:`jitwarm.cache.signing`) is read here: entries
    are signed on upload and checked on download with it. Raises ``SettingError`` (exit 2) for ``s3://``
    without boto3 installed (the ``s3`` extra), or a bad key setting.
    """
    key = trust_key()
    if url.startswith("s3://"):
        if _missing("boto3"):
            raise SettingError(f"remote {redact(url)} needs boto3, which is not installed: "
                               "pip install 'jitwarm[s3]'")
        return ObjectStore(url, prefix, required=required, max_bytes=max_bytes, shared=shared, count=count,
                           trust_key=key)
    return RemoteStore(url, prefix, required=required, max_bytes=max_bytes, shared=shared, count=count,
                       trust_key=key)


def reset_remote_health() -> None:
    """Close this process's pooled clients and forget each remote's health (for tests)."""
    reset_health()


def _missing(module: str) -> bool:
    """Whether ``module`` cannot be imported (found without importing it: ``jitwarm plan`` stays light)."""
    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):  # ValueError: set to None in sys.modules (how a test hides it)
        return True
