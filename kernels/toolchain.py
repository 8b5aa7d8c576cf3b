"""The one ``--version`` probe of a compiler or assembler, for every backend's toolchain fingerprint."""

from __future__ import annotations

import subprocess

from jitwarm.kernels.backend import ToolchainError


def version_lines(exe: str, name: str | None = None, timeout_s: float = 60.0) -> list[str]:
    """The non-empty lines ``exe --version`` prints, stripped.

    Raises
    ------
    ToolchainError
        ``exe`` cannot be run, times out, exits non-zero or prints nothing; the message names ``name``
        (default ``exe``) and the start of its stderr.

    """
    try:
        proc = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        raise ToolchainError(f"{name or exe} --version cannot run: {exc}") from None
    lines = [line.strip() for line in proc.stdout.splitlines() if line.strip()]
    if proc.returncode != 0 or not lines:
        raise ToolchainError(f"{name or exe} --version failed: {proc.stderr.strip()[:500]}")
    return lines
