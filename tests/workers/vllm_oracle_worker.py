"""Answer the vLLM oracle's whole grid in one process: vLLM's own functions (``servers.vllm.native``) per config.

Usage: ``python vllm_oracle_worker.py OUT.json`` with ``{"grid": [inputs, ...]}`` on stdin; writes
``{"version", "seconds", "grid": [{"ok": resolution} | {"error": message}, ...]}``. The wheel must be importable
(``tests/vllm_wheel.py``); vLLM is imported once, by the first config.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> int:
    from jitwarm.precompile.servers.vllm import native

    request = json.loads(sys.stdin.read())
    started = time.monotonic()
    answers = []
    for inputs in request["grid"]:
        try:
            answers.append({"ok": native.resolve(inputs)})
        except ValueError as exc:
            answers.append({"error": str(exc)})
    with open(sys.argv[1], "w", encoding="utf-8") as out:
        json.dump({"version": native.installed_version(), "seconds": time.monotonic() - started, "grid": answers},
                  out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
