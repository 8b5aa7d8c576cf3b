"""Plan completion records: ``<root>/v1/plans/<plan_id>.json``, written atomically, read from any root."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from jitwarm.cache.durable import write_atomic
from jitwarm.cache.layout import RootLayout

log = logging.getLogger("jitwarm.cache")


def write_plan_record(layout: RootLayout, plan_id: str, record: Mapping[str, Any]) -> Path:
    """Write ``record`` as the plan record ``plan_id`` of ``layout`` and return its path.

    Raises
    ------
    ValueError
        ``plan_id`` is not a safe file name.
    TypeError
        ``record`` is not JSON-able.

    """
    target = layout.plan_path(plan_id)
    data = json.dumps(dict(record), indent=1, sort_keys=True, allow_nan=False).encode("utf-8")
    layout.ensure(layout.plans)
    write_atomic(target, data)
    return target


def read_plan_record(layouts: Sequence[RootLayout], plan_id: str) -> dict[str, Any] | None:
    """Return the record ``plan_id`` from the first of ``layouts`` that has a readable one, else None.

    A record that does not parse as a JSON object is logged and skipped.

    Raises
    ------
    ValueError
        ``plan_id`` is not a safe file name.

    """
    for layout in layouts:
        path = layout.plan_path(plan_id)
        try:
            data = json.loads(path.read_bytes())
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as exc:
            log.warning("ignoring unreadable plan record %s: %s", path, exc)
            continue
        if isinstance(data, dict):
            return data
        log.warning("ignoring plan record %s: not a JSON object", path)
    return None
