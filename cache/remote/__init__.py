"""The remote tier: a second cache level the fleet shares, so each key is built once per fleet.

A *store* moves whole entries (:mod:`.redis`); the *fleet protocol* (:mod:`.fleet`) decides when to download,
lease, wait, build and upload. A second backend (an S3 bucket) is a new module here whose store offers what
``fleet`` calls on :class:`~jitwarm.cache.remote.redis.RemoteStore`: ``usable``, ``failed``, ``fetch(key,
dest)``, ``upload(entry)``, ``report(keys)``, ``check()``, ``display`` and a lease (an object store needs a
conditional put). What it returns goes through :func:`jitwarm.cache.entry.unpack_entry`: a remote is never
trusted (docs/cache.md, "Remote tier").
"""

from __future__ import annotations

from jitwarm.cache.remote.fleet import Fleet, FleetLease, LocalSteps
from jitwarm.cache.remote.redis import RemoteFailure, RemoteReport, RemoteStore, redact, reset_remote_health

__all__ = ["Fleet", "FleetLease", "LocalSteps", "RemoteFailure", "RemoteReport", "RemoteStore", "redact",
           "reset_remote_health"]
