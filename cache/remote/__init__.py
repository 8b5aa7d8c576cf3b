"""The remote tier: a second cache level the fleet shares, so each key is built once per fleet.

A store (:mod:`.redis`, :mod:`.s3`) moves whole entries and makes a key's build lease; the fleet protocol
(:mod:`.fleet`) decides when to download, lease, wait, build and upload. A remote is never trusted.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

from jitwarm.cache.remote.base import RemoteReport, redact, reset_remote_health
from jitwarm.cache.remote.fleet import Fleet, LocalSteps
from jitwarm.cache.remote.redis import FleetLease, RemoteStore
from jitwarm.cache.remote.s3 import ObjectStore
from jitwarm.cache.settings import SettingError, trust_key

__all__ = ["Fleet", "FleetLease", "LocalSteps", "ObjectStore", "RemoteReport", "RemoteStore",
           "open_store", "redact", "reset_remote_health"]


def open_store(url: str, prefix: str, *, required: bool, max_bytes: int, shared: bool,
               count: Callable[..., None], min_rate: int = 1 << 20) -> RemoteStore | ObjectStore:
    """The store of ``url`` (``s3://``: :class:`ObjectStore`, else Redis) with the fleet key; connects to nothing.

    Raises ``SettingError`` (exit 2) for a bad key setting, or ``s3://`` without boto3 (the ``s3`` extra).
    """
    key, store = trust_key(), RemoteStore
    if url.startswith("s3://"):
        try:  # found without importing it: ``jitwarm plan`` stays light
            missing = importlib.util.find_spec("boto3") is None
        except (ImportError, ValueError):  # ValueError: set to None in sys.modules (how a test hides it)
            missing = True
        if missing:
            raise SettingError(f"remote {redact(url)} needs boto3, which is not installed: pip install 'jitwarm[s3]'")
        store = ObjectStore
    return store(url, prefix, required=required, max_bytes=max_bytes, shared=shared, count=count, trust_key=key,
                 min_rate=min_rate)
