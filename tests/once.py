"""A session's costly builds, made once per pytest run by whichever process asks first (tests/conftest.py's
``built_once``, and tests/prebuild.py in the run's background).

A build lives in the run's base temp: ``<base>/<name>`` and its JSON record ``<base>/<name>.json``, made under the
file lock ``<base>/<name>.lock``. The first process to ask builds while the others wait on the lock, then each
reads the record. A build that raises records nothing: the next process to ask builds again from an empty folder.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock
from wheels import WheelUnavailable


def once(base: Path, name: str, build: Callable[[Path], dict]) -> tuple[Path, dict]:
    """``build(directory)`` once per run under ``base``; return the directory and the JSON record it returned."""
    path, record = base / name, base / f"{name}.json"
    with FileLock(str(base / f"{name}.lock")):
        if not record.exists():
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir()
            record.write_text(json.dumps(build(path)), encoding="utf-8")
    return path, json.loads(record.read_text(encoding="utf-8"))


def or_skip(prepare: Callable[[Path], dict]) -> Callable[[Path], dict]:
    """``prepare`` as a build whose set cannot be installed records ``{"skip": why}``: every asker reads the skip
    rather than trying the same install again."""
    def build(path: Path) -> dict:
        try:
            return prepare(path)
        except WheelUnavailable as exc:
            return {"skip": str(exc)}
    return build
