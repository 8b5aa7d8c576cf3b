"""The start-up ledger of a real sglang 0.5.23 start with ``--disable-cuda-graph`` (issue #30: with or without capture).

jitwarm's sglang plugin reports the ledger in an AROUND hook of ``ModelRunner.init_cuda_graphs``. This checks, with
the real wheel, that sglang reaches that method when CUDA graphs are off: the scheduler calls
``init_all_cuda_graphs`` unconditionally (scheduler.py:1146), the TP worker calls the runner's ``init_cuda_graphs``
(tp_worker.py:435), and its body runs whole, since ``capture_cuda_graphs`` always builds the eager runner
(cuda_graph_setup.py:410-416) and only skips the captures (:495-505 prefill, :731-734 decode). So the ledger is
written there, once, after sglang's body has run.

One real process (``workers/sglang_ready_worker.py``): sglang's own ``load_plugins()`` registers jitwarm's entry
point (``SGLANG_PLUGINS=jitwarm``), a real ``ServerArgs(disable_cuda_graph=True)`` is published for the scheduler
role, and sglang's own ``Scheduler.init_all_cuda_graphs`` runs. Faked, because a CPU box has neither: the GPU
(tensors asked for on ``cuda`` are made on the host; no forward stream) and the TP group (one rank). The scheduler,
TP worker and model runner are sglang's classes made without their ``__init__`` (which loads a model onto a GPU),
given the attributes this path reads; the model is an empty module. A spy that calls through
``jitwarm.precompile.ledger.report_after_capture`` notes the stack and the runner's state when the plugin reports.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).resolve().parent / "workers" / "sglang_ready_worker.py"
HOOKED = "sglang.srt.model_executor.model_runner.ModelRunner.init_cuda_graphs"
#: The calls from the scheduler's ready point down to the ledger, outermost first (the spy's own frame excluded).
CHAIN = ["sglang.srt.managers.scheduler.Scheduler.init_all_cuda_graphs",
         "sglang.srt.managers.tp_worker.TpModelWorker.init_cuda_graphs",
         "jitwarm.precompile.servers.sglang.plugin._around_init_cuda_graphs",
         "jitwarm.precompile.servers.plugins.report_ledger"]


def test_disable_cuda_graph_still_reaches_init_cuda_graphs_and_writes_the_ledger_after_its_body(sglang_env, tmp_path):
    ledger = tmp_path / "ledger.json"
    base = {k: v for k, v in os.environ.items() if not k.startswith(("JITWARM_", "SGLANG_"))}
    env = {**base, **sglang_env, "PYTHONWARNINGS": "ignore", "SGLANG_PLUGINS": "jitwarm",
           "JITWARM_LEDGER": str(ledger), "JITWARM_CACHE_DIR": str(tmp_path / "cache")}
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, str(WORKER), str(out)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    result = json.loads(out.read_text())
    log = [line for line in proc.stderr.splitlines() if line.startswith("LOG ")]

    # the plugin came in through sglang's own loader and hooked the method
    assert any("Loaded plugin jitwarm from group sglang.srt.plugins" in line for line in log), log
    assert any(f"Applied 1 hook(s) to {HOOKED} (from: plugin=jitwarm, dist=jitwarm)" in line for line in log), log
    # --disable-cuda-graph, as sglang resolves it: both phases off (cuda_graph_hook.py:55-57)
    assert result["cuda_graph_config"] == {"decode": "disabled", "prefill": "disabled"}
    assert any("Disable prefill CUDA graph because cuda_graph_config resolved prefill.backend='disabled'" in line
               for line in log), log

    # nothing before the call; exactly one report, from the hook, reached from the scheduler's ready point
    assert result["before"]["ledger_existed"] is False
    assert result["before"]["runner"]["eager_runner"] is None
    assert len(result["reports"]) == 1, result["reports"]
    report = result["reports"][0]
    stack = list(reversed(report["stack"]))  # outermost first
    assert [frame for frame in stack if frame in CHAIN] == CHAIN, stack
    # sglang's init_cuda_graphs body had run to its end when the plugin reported (model_runner.py:1200-1209), and
    # the file was not there yet: this report wrote it
    assert report["ledger_existed"] is False
    state = report["runner"]
    assert state["eager_runner"] == "EagerRunner" and state["prefill_runner_is_eager_runner"] is True
    assert state["decode_cuda_graph_runner"] == "None" and state["decode_cuda_graph_captured"] == "False"
    assert state["graph_time_usage"] is not None and state["graph_memory_usage"] is not None
    assert result["after"]["runner"] == state  # nothing of sglang's ran after the report

    # the ledger, written by that report in the worker's process
    assert result["after"]["ledger_existed"] is True
    written = json.loads(ledger.read_text())
    assert written["v"] == 1 and written["pid"] == result["pid"]
    assert {"inductor", "triton", "load_jit"} <= set(written["families"])
    assert any(" INFO jitwarm: ledger: load_jit: " in line for line in log), log
