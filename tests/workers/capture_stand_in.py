"""A stand-in server for ``jitwarm capture`` (tests/test_capture.py): what capture sees of a start, nothing more.

Run as ``vllm serve MODEL --port P`` (a ``vllm`` script on PATH that execs this file) or as
``python -m sglang.launch_server --port P`` (a ``sglang`` package on PYTHONPATH whose ``launch_server`` runs
:func:`main`). It does what jitwarm's plugin does in a real server, in the same order: with ``JITWARM_RECORD``
set it starts the recorder and the ledger's snapshot, "compiles" by writing one complete Inductor unit
(``STAND_IN_UNIT`` under ``TORCHINDUCTOR_CACHE_DIR``), stores it (the recorder's ``capture()``) and writes the
ledger (``JITWARM_LEDGER``); then ``/health`` answers 200 on 127.0.0.1 at the line's ``--port`` until SIGINT or
SIGTERM. A forked "worker" sleeps in the same process group, as a server's scheduler or engine core does.
``/v1/models`` lists ``stand-in/model``; each POST under ``/v1/`` is answered ``{}`` and noted; with
``STAND_IN_FIRST_USE=1`` the first that asks for ``logprobs`` "compiles" a second unit (:data:`FIRST_USE_UNIT`), as
vLLM's logprobs op does at first use; at the
stopping signal the plugin's part runs again: the units stored, the ledger at stop written.

``STAND_IN_DIR`` (required) receives what the test reads back: ``pids.json`` (the server's and its worker's),
``env.json`` (the plugin variables it was started with), ``signals`` (one line per signal received, in order),
``serving`` (written once /health answers), ``requests.jsonl`` (each POST: its path and body).
``STAND_IN_MODE`` picks the behaviour:

- ``ok``: as above.
- ``die``: prints :data:`DYING` and exits 3 before doing anything else.
- ``never_ready``: records and stores, but never serves /health.
- ``no_ledger``: serves /health but never writes the ledger (jitwarm's plugin did not load).
- ``ignore_sigint``: as ``ok``, but SIGINT stops neither it (it only notes the signal) nor its worker
  (ignored); SIGTERM does.
- ``orphan_worker``: as ``ok``, but on a signal it exits at once, and its worker half a second later: an
  orphan, as a server's engine process outlives its API process.
- ``unrecordable``: as ``ok``, but the file ``JITWARM_RECORD`` names is replaced by a link first, so the plugin's
  recorder cannot append (it logs ``jitwarm: cannot record``, as on a read-only volume).
- ``error_after_warning``: logs a WARNING line holding ``OSError:``, then :data:`FIRST_ERROR`, then 40 lines, and
  exits 3.

``STAND_IN_LOAD_JIT=MAJOR.MINOR``: once recording, the stand-in imports the real sglang wheel's kernels (a plain
process until then, as a script that starts ``record()`` first is) and calls ``load_jit`` for that arch: sglang's
``clamp_position`` module for int32, built with nvcc or found in ``SGLANG_JIT_CACHE_DIR``; its Inductor unit is
then written where sglang's import put ``TORCHINDUCTOR_CACHE_DIR``.

``STAND_IN_DELAY`` (seconds, default 0) delays /health, as a model load would. ``STAND_IN_NOISY_STOP=1``: on a
signal it logs a traceback and 40 lines before it stops, as a server's Ctrl-C does.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

#: The last line the ``die`` mode prints: capture must show it among the server's last log lines.
DYING = "stand-in: out of memory loading the model, exiting 3"
#: The unit written by default: one FX graph entry, a complete Inductor unit (tests/jit_cache_trees.py).
DEFAULT_UNIT = "fxgraph/ab/fabc123/entry"
FIRST_USE_UNIT = "fxgraph/cd/fcde456/entry"
#: The worker: asleep until a signal of its group ends it (SIGINT's KeyboardInterrupt, or SIGTERM), then it
#: takes ``argv[1]`` seconds to exit.
#: The ``error_after_warning`` mode's error line, as vLLM logs one (its level first).
FIRST_ERROR = "ERROR 12-05 02:00:00 [core.py:42] EngineCore failed to start: out of memory"
WARNED = "WARNING 12-05 02:00:00 [utils.py:7] could not read /sys/x: OSError: [Errno 2] No such file or directory"
WORKER = "import sys, time\ntry:\n    time.sleep(600)\nexcept KeyboardInterrupt:\n    time.sleep(float(sys.argv[1]))\n"


class _Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # http.server's name for it
        if self.path == "/v1/models":
            self._answer(200, {"data": [{"id": "stand-in/model"}]})
            return
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self) -> None:  # http.server's name for it
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        with open(Path(os.environ["STAND_IN_DIR"]) / "requests.jsonl", "a") as f:
            f.write(json.dumps({"path": self.path, "body": body}) + "\n")
        if "logprobs" in body and os.environ.get("STAND_IN_FIRST_USE") == "1":
            unit = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]) / FIRST_USE_UNIT
            unit.parent.mkdir(parents=True, exist_ok=True)
            unit.write_bytes(b"the logprobs op's FX graph")
        # an answer of the request's own, with an id of this answer's (as a server's differs per start)
        said = {"id": f"{os.getpid()}-{time.monotonic_ns()}",
                "choices": [{"text": json.dumps(body.get("prompt", body.get("messages"))), "finish_reason": "length"}]}
        self._answer(200 if self.path.startswith("/v1/") else 404, said)

    def _answer(self, status: int, data: object) -> None:
        raw = json.dumps(data).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, format: str, *args: object) -> None:  # http.server's signature
        """Quiet: capture polls twice a second, and the log's last lines are for the server's own words."""


def port_of(argv: list[str]) -> int:
    """The ``--port`` of the command line (``--port P`` or ``--port=P``)."""
    for i, word in enumerate(argv):
        if word == "--port" and i + 1 < len(argv):
            return int(argv[i + 1])
        if word.startswith("--port="):
            return int(word.split("=", 1)[1])
    raise SystemExit("stand-in: no --port on the command line")


def load_jit(major: int, minor: int) -> None:
    """sglang's ``load_jit`` of ``clamp_position`` for int32 (kernels/ops/attention/clamp_position.py:15-25)."""
    import torch
    from sglang.kernels.jit.utils import override_jit_cuda_arch
    from sglang.kernels.ops.attention import clamp_position

    with override_jit_cuda_arch(major, minor):
        clamp_position._jit_clamp_position_module(torch.int32)
    print("stand-in: load_jit done", flush=True)


def main() -> None:
    """Run the stand-in server as ``STAND_IN_MODE`` says (see the module docstring)."""
    mode, out = os.environ.get("STAND_IN_MODE", "ok"), Path(os.environ["STAND_IN_DIR"])
    if mode == "die":
        print(DYING, flush=True)
        sys.exit(3)
    if mode == "error_after_warning":
        print(WARNED, FIRST_ERROR, *(f"stand-in: after the error, line {i}" for i in range(40)), sep="\n", flush=True)
        sys.exit(3)
    if mode == "ignore_sigint":
        # Before the worker starts: an ignored signal stays ignored across fork and exec (Python keeps it).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    worker = subprocess.Popen([sys.executable, "-c", WORKER, "0.5" if mode == "orphan_worker" else "0"])
    stopping = threading.Event()
    at_stop: list = []

    def on_signal(signum: int, frame: object) -> None:
        with open(out / "signals", "a") as f:
            f.write(f"{signal.Signals(signum).name}\n")
        while at_stop:  # the plugin's part at the stopping signal (precompile/servers/vllm/plugin.py)
            at_stop.pop()()
        if os.environ.get("STAND_IN_NOISY_STOP") == "1":
            print("Traceback (most recent call last):\nKeyboardInterrupt", *(f"stand-in: stopping, line {i}"
                                                                              for i in range(40)), sep="\n", flush=True)
        if not (mode == "ignore_sigint" and signum == signal.SIGINT):
            stopping.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    (out / "pids.json").write_text(json.dumps({"server": os.getpid(), "worker": worker.pid}))
    (out / "env.json").write_text(json.dumps({name: os.environ.get(name) for name in
                                              ("VLLM_PLUGINS", "SGLANG_PLUGINS", "JITWARM_RECORD", "JITWARM_LEDGER",
                                               "JITWARM_CACHE_DIR", "TMPDIR", "HOME", "XDG_CACHE_HOME",
                                               "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "VLLM_CACHE_ROOT",
                                               "SGLANG_CACHE_DIR", "CUDA_CACHE_PATH")}))
    print(f"stand-in: {mode} server starting, pid {os.getpid()}", flush=True)
    if os.environ.get("JITWARM_RECORD"):
        from jitwarm.precompile import ledger
        from jitwarm.precompile.recorder import record

        if mode == "unrecordable":
            target = Path(os.environ["JITWARM_RECORD"])
            target.unlink()
            target.symlink_to(out / "elsewhere.jsonl")
        recorder = record(os.environ["JITWARM_RECORD"])
        ledger.begin()
        if os.environ.get("STAND_IN_LOAD_JIT"):
            load_jit(*map(int, os.environ["STAND_IN_LOAD_JIT"].split(".")))
        unit = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]) / os.environ.get("STAND_IN_UNIT", DEFAULT_UNIT)
        unit.parent.mkdir(parents=True, exist_ok=True)
        unit.write_bytes(b"a pickled FX graph, as Inductor writes it")
        print(f"stand-in: stored {recorder.capture()} unit(s)", flush=True)
        if mode != "no_ledger":
            ledger.report_after_capture()
            at_stop.extend([ledger.write_stop, recorder.capture])  # popped: the units first
            ledger.answer_stop_request(recorder.capture)  # what the vLLM plugin does under capture
    time.sleep(float(os.environ.get("STAND_IN_DELAY", "0")))
    if mode != "never_ready":
        server = ThreadingHTTPServer(("127.0.0.1", port_of(sys.argv)), _Health)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        (out / "serving").write_text("")
        print("stand-in: serving /health", flush=True)
    while not stopping.wait(0.1):  # a short wait: the signal handler runs between two
        pass
    print("stand-in: stopping", flush=True)
    if mode != "orphan_worker":
        worker.terminate()
        worker.wait()


if __name__ == "__main__":
    main()
