"""``jitwarm ARGS...`` with capture's long waits shortened, for tests/test_capture.py.

``CAPTURE_LEDGER_GRACE_S`` replaces ``LEDGER_GRACE_S`` (30 s: how long the ledger may lag /health),
``CAPTURE_PROGRESS_S`` ``PROGRESS_S`` (10 s between progress lines), ``CAPTURE_STOP_GRACE_S`` and
``CAPTURE_TERM_GRACE_S`` the SIGINT and SIGTERM graces of ``ServerProcess.stop`` (``STOP_GRACE_S``, 60 s;
``TERM_GRACE_S``, 10 s): capture reads none of them from the environment, and a test cannot wait that long.
``CAPTURE_SUBREAPER=1`` makes the process a child subreaper (Linux), as PID 1 of a container is: a server's orphaned
workers become its children. Everything else is the real command line.
"""

from __future__ import annotations

import ctypes
import os
import sys

from jitwarm.precompile import capture, server_process
from jitwarm.precompile.cli import main

if "CAPTURE_LEDGER_GRACE_S" in os.environ:
    capture.LEDGER_GRACE_S = float(os.environ["CAPTURE_LEDGER_GRACE_S"])  # read by wait_ready at each call
if "CAPTURE_PROGRESS_S" in os.environ:
    capture.PROGRESS_S = float(os.environ["CAPTURE_PROGRESS_S"])  # read by Progress.tick
server_process.STOP_GRACE_S = float(os.environ.get("CAPTURE_STOP_GRACE_S", server_process.STOP_GRACE_S))
server_process.TERM_GRACE_S = float(os.environ.get("CAPTURE_TERM_GRACE_S", server_process.TERM_GRACE_S))
if os.environ.get("CAPTURE_SUBREAPER") == "1":
    PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")

sys.exit(main(sys.argv[1:]))
