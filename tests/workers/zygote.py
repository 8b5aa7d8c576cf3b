"""Run one worker script several times, each in a process forked after a single import of the server.

Usage: ``python zygote.py JOBS.json``, in the environment the jobs share (each job's own variables are set after
its fork, so no import sees one scenario's values); JOBS.json is ``{"preload": [module, ...], "worker": path,
"jobs": [{"argv": [...], "env": {...}, "stderr": path}, ...]}``. Prints ``[returncode, ...]`` as one JSON line.

Why: importing sglang or vLLM with torch costs 7 to 12 s of CPU, and the plugin tests run one worker per
scenario (with or without the plugin, inert, in plan mode), which is otherwise that import once per scenario.
The servers read the variables that tell the scenarios apart (``SGLANG_PLUGINS``, ``VLLM_PLUGINS``, every
``JITWARM_*``) when they are called, not at import, so a child whose environment is replaced after the fork
runs its scenario as a fresh process would. Each child runs the worker as ``__main__`` and then leaves the
interpreter the normal way, so its atexit handlers (a recording written at exit) and thread joins run.
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import sys


def run_job(worker: str, job: dict) -> int:
    """In the forked child: take the job's environment, argv and stderr, and run the worker.

    The worker's ``SystemExit`` (and any other exception) is not caught: it leaves through the interpreter's top
    level, which reports and exits as it would for the worker run as a script. A worker that returns exits 0.
    """
    os.environ.clear()
    os.environ.update(job["env"])
    with open(os.devnull, "wb") as null, open(job["stderr"], "wb") as err:
        os.dup2(null.fileno(), 1)
        os.dup2(err.fileno(), 2)
    sys.argv = [worker, *job["argv"]]
    runpy.run_path(worker, run_name="__main__")
    return 0


def main() -> int:
    with open(sys.argv[1], encoding="utf-8") as f:
        spec = json.load(f)
    for module in spec["preload"]:
        importlib.import_module(module)
    children = []
    for job in spec["jobs"]:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            return run_job(spec["worker"], job)
        children.append(pid)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children]
    print(json.dumps(codes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
