"""The remote tier: a second cache level the fleet shares, so each key is built once per fleet.

Two parts. A *store* moves whole entries and nothing else (:mod:`.redis`: one Redis hash per entry, read and
written in one atomic step, sized on the server before a download, every byte checked against the entry's
manifest before anything is written; health per URL, so a dead server costs one warning and a minute of
local-only work). The *fleet protocol* (:mod:`.fleet`) decides when to download, lease a build, wait for
another node's lease, build and upload; it talks to the local root only through
:class:`~jitwarm.cache.remote.fleet.LocalSteps` (three callables), never by importing the protocol module.

A second backend (an S3 bucket) is a new module here with a store offering what ``fleet`` calls on
:class:`~jitwarm.cache.remote.redis.RemoteStore`: ``usable``, ``failed``, ``fetch(key, dest)``,
``upload(entry)``, ``report(keys)``, ``check()``, and a lease (an object store needs a conditional put);
entries it returns are checked by :func:`jitwarm.cache.entry.unpack_entry` like Redis's, so what a remote
may hold is never trusted (docs/cache.md, "Remote tier").
"""

from __future__ import annotations

from jitwarm.cache.remote.fleet import Fleet, FleetLease, LocalSteps
from jitwarm.cache.remote.redis import RemoteFailure, RemoteReport, RemoteStore, redact, reset_remote_health

__all__ = ["Fleet", "FleetLease", "LocalSteps", "RemoteFailure", "RemoteReport", "RemoteStore", "redact",
           "reset_remote_health"]
