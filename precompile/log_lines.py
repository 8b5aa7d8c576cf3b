"""jitwarm's log lines as the operator reads them, ``jitwarm: <message>``: the CLI's and its build workers'."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator


class LogLines(logging.Formatter):
    """``jitwarm: <message>``, the prefix once (many messages carry it already, for a server's own log)."""

    def format(self, record: logging.LogRecord) -> str:
        """``jitwarm: <message>`` (no traceback: one line)."""
        return "jitwarm: " + record.getMessage().removeprefix("jitwarm: ")


@contextlib.contextmanager
def log_lines() -> Iterator[None]:
    """While the block runs, the jitwarm loggers' warnings and errors go to stderr as :class:`LogLines` lines."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(LogLines())
    logger = logging.getLogger("jitwarm")
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
