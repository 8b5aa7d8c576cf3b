"""A real ``jitwarm capture`` of vLLM's CPU build, interrupted while the server compiles: nothing is left behind.

One start (tests/vllm_cpu.py): capture runs ``vllm serve`` on private caches; once its progress line counts units in
them (Inductor is compiling), the operator's Ctrl-C reaches capture. The server's whole group (the API server, the
engine core, its workers) must be gone, and no manifest, no record file and no private cache may be left: a capture
cut short is never taken for a whole one.
"""

from __future__ import annotations

import queue
import re
import signal
import subprocess
import threading
from pathlib import Path

import vllm_cpu as server

from jitwarm.precompile.server_process import group_members

#: Seconds until the server compiles (a cold start reaches Inductor in 60-120 s on a loaded 2-core box).
COMPILING_TIMEOUT_S = 900


def test_an_interrupted_real_capture_stops_the_server_group_and_leaves_nothing(vllm_cpu, tmp_path):
    node, manifest = tmp_path / "node", tmp_path / "server.jsonl"
    proc = subprocess.Popen([str(vllm_cpu.python), "-m", "jitwarm", "capture", "--manifest", str(manifest), "--",
                             *vllm_cpu.serve(server.free_port())], env=vllm_cpu.env(node), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr], daemon=True).start()
    said, pgid, private = [], None, None
    try:
        while True:  # each line within the bound: capture says its progress every 10 s
            line = lines.get(timeout=COMPILING_TIMEOUT_S)
            said.append(line)
            started = re.search(r"started \(pid (\d+)\).* under (\S+); its log", line)
            if started:
                pgid, private = int(started.group(1)), started.group(2)
            units = re.search(r"waiting for .*; (\d+) JIT cache units so far", line)
            if units and int(units.group(1)) > 0:
                break
            assert proc.poll() is None, "".join(said)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=300)  # vLLM stops on SIGINT in seconds; capture's grace before SIGTERM is 60 s
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if pgid is not None and group_members(pgid):
            subprocess.run(["kill", "-9", f"-{pgid}"], check=False)

    assert proc.returncode == 130, "".join(said)
    assert pgid is not None and group_members(pgid) == [], "".join(said)
    assert not manifest.exists() and not list(tmp_path.glob(".server.jsonl.*"))
    assert private is not None and not Path(private).exists()
    assert (tmp_path / "server.log").is_file()  # the log stays, to read what the start was doing
