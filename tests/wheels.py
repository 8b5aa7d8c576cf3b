"""Real wheels installed without their dependencies, once per machine, for the tests that use them as oracles.

A set of pinned packages lives under ``$JITWARM_TEST_WHEELS`` (default ``~/.cache/jitwarm-test-wheels``) in a
directory named by the hash of its packages: pip installs it into a staging directory beside that one, which is
renamed into place whole, one pip at a time per set (a file lock). A second session, or the other pytest-xdist
worker, finds a complete install or none; a failed install leaves nothing behind. tests/vllm_wheel.py and
tests/jit_cache_wheels.py say what each set is and why.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from filelock import FileLock

#: Seconds pip may take before the tests give up on a set (vLLM's first install downloads 336 MB).
PIP_TIMEOUT = 900


class WheelUnavailable(RuntimeError):
    """pip could not install the set; the message says why (the tests skip with it)."""


def set_root() -> Path:
    """Where the sets live: ``$JITWARM_TEST_WHEELS``, or ``~/.cache/jitwarm-test-wheels``."""
    return Path(os.environ.get("JITWARM_TEST_WHEELS") or Path.home() / ".cache" / "jitwarm-test-wheels")


def set_dir(name: str, packages: Sequence[str]) -> Path:
    """Where set ``name`` lives: ``$JITWARM_TEST_WHEELS/<name>-<hash of its packages>``."""
    return set_root() / f"{name}-{hashlib.sha256(chr(10).join(packages).encode()).hexdigest()[:12]}"


def install_once(name: str, packages: Sequence[str], marker: str,
                 finish: Callable[[Path], None] | None = None) -> Path:
    """Install ``packages`` as set ``name`` unless it is there (``marker``, a file of the complete install).

    ``finish(staging)`` adds what the set needs beside the packages before the install is renamed into place.

    Raises
    ------
    WheelUnavailable
        pip cannot reach the index, times out or fails; the message carries pip's last error line.

    """
    target = set_dir(name, packages)
    if (target / marker).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target.parent / f"{target.name}.lock")):
        if (target / marker).is_file():
            return target
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            pip_install(packages, staging)
            if finish is not None:
                finish(staging)
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def pip_install(packages: Sequence[str], target: Path) -> None:
    """``pip install --no-deps --target target packages``, or :class:`WheelUnavailable` saying why not."""
    run_step([sys.executable, "-m", "pip", "install", "--no-deps", "--no-compile", "--disable-pip-version-check",
              "--no-input", "--quiet", "--target", str(target), *packages], f"pip install {packages[0]} (--no-deps)")


def run_step(command: Sequence[str], what: str, env: Mapping[str, str] | None = None) -> None:
    """Run one install step, or :class:`WheelUnavailable` saying ``what`` failed, with the tool's last error line."""
    try:
        proc = subprocess.run(list(command), capture_output=True, text=True, timeout=PIP_TIMEOUT,
                              env=None if env is None else dict(env))
    except subprocess.TimeoutExpired:
        raise WheelUnavailable(f"{what} did not finish within {PIP_TIMEOUT} s") from None
    if proc.returncode != 0:
        errors = [line for line in proc.stderr.splitlines() if line.startswith("ERROR")] or proc.stderr.splitlines()
        raise WheelUnavailable(f"{what} failed with exit {proc.returncode}: {errors[-1] if errors else 'no output'}")


def import_env(target: Path) -> dict[str, str]:
    """The variables a subprocess needs to import from ``target`` (on top of the caller's environment).

    Bytecode is written on first import: the sets are installed without it (``--no-compile``: most of a server's
    tree is never imported), and where the environment sets ``PYTHONDONTWRITEBYTECODE`` (this project's CI box
    does) every later subprocess would compile each module it imports again (vLLM's config: 12 s of CPU, 10 s
    with bytecode).
    """
    return {"PYTHONPATH": str(target), "PYTHONDONTWRITEBYTECODE": ""}
