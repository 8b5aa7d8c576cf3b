"""The remote tier's health in this process: one pooled client and one up/down record per URL, and redact.

A failure seen by any cache of the process turns the remote off for :data:`RETRY_AFTER_S` for all of them,
and its warning is logged once per URL (see :meth:`jitwarm.cache.remote.RemoteStore.failed`).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any
from urllib.parse import urlsplit

#: After a failure the remote is skipped for this long by every cache of this process, then tried again.
RETRY_AFTER_S = 60.0
#: Deadlines unless the URL sets ``socket_connect_timeout`` / ``socket_timeout`` (redis-py query args).
CONNECT_TIMEOUT_S = 2.0
READ_TIMEOUT_S = 10.0


def redact(url: str) -> str:
    """Return ``url`` without its password and query, for messages (``redis://:***@host:6379/0``)."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, hostport = netloc.rsplit("@", 1)
        user = userinfo.split(":", 1)[0]
        netloc = f"{user}:***@{hostport}" if ":" in userinfo else f"{user}@{hostport}"
    return f"{parts.scheme}://{netloc}{parts.path}"


class _Health:
    """Whether one remote URL is usable in this process."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.down_until = 0.0
        self.error: str | None = None
        self.warned = False


class RemoteHealth:
    """Per-process registry of each remote URL's health and pooled client, shared by every cache using it.

    A failure seen by one cache turns the remote off for :data:`RETRY_AFTER_S` for all of them, and the
    "unavailable" warning is logged once per URL per process. :meth:`reset` forgets everything (tests).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._health: dict[str, _Health] = {}
        self._clients: dict[str, Any] = {}

    def get(self, url: str) -> tuple[_Health, Any]:
        """Return the health record and (lazily made, pooled) redis client of ``url``."""
        with self._lock:
            if url not in self._clients:
                import redis  # imported on first use: importing jitwarm.cache must not cost a redis import
                from redis.backoff import ExponentialBackoff
                from redis.retry import Retry

                # One quick retry, not redis-py's default backoff: a startup must not hang on a dead server.
                self._clients[url] = redis.Redis.from_url(url, socket_connect_timeout=CONNECT_TIMEOUT_S,
                                                          socket_timeout=READ_TIMEOUT_S,
                                                          retry=Retry(ExponentialBackoff(cap=0.2, base=0.05), 1))
                self._health[url] = _Health()
            return self._health[url], self._clients[url]

    def reset(self) -> None:
        """Close every pooled client and forget every URL's health (each remote is tried afresh)."""
        with self._lock:
            clients, self._clients, self._health = list(self._clients.values()), {}, {}
        for client in clients:
            with contextlib.suppress(Exception):
                client.close()


#: The registry of this process.
HEALTH = RemoteHealth()


def reset_remote_health() -> None:
    """Forget this process's remote health and close its pooled clients (for tests; see :class:`RemoteHealth`)."""
    HEALTH.reset()
