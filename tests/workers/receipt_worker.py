"""A server process's plugin start and ledger report, as each room's plugin makes them, around a restore receipt.

Usage: ``receipt_worker.py``, with ``JITWARM_CACHE_DIR`` (the receipt's root), ``JITWARM_LEDGER`` and the
libraries' variables set by the caller. Runs ``plugins.begin_ledger`` (what the sglang and vLLM plugins call
when the server loads them), then ``plugins.report_ledger``. Prints one JSON line: ``{"ledger": <the ledger's
JSON or null>, "error": [type, message] or null}``; the plugin's log lines go to stderr.
"""

import json
import logging
import os
import sys

logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(levelname)s %(message)s")
log = logging.getLogger("jitwarm.test_plugin")


def main() -> None:
    from jitwarm.precompile.servers import plugins

    try:
        plugins.begin_ledger(log)
    except Exception as exc:  # JITWARM_STRICT=1: the server's start stops here
        print(json.dumps({"ledger": None, "error": [type(exc).__name__, str(exc)]}))
        return
    plugins.report_ledger(log)
    with open(os.environ["JITWARM_LEDGER"]) as f:
        print(json.dumps({"ledger": json.load(f), "error": None}))


if __name__ == "__main__":
    main()
