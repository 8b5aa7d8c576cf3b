"""A real sglang server on this CPU box: sglang 0.5.23's CPU engine, run by this interpreter (torch 2.13 CPU).

No venv of its own: the server runs on three folders on ``PYTHONPATH`` in front of this interpreter's packages.

1. The sglang wheel set the oracle tests already install (``sglang_wheel.py``, once per machine; it stubs
   torchvision, which cannot be installed beside torch 2.13 CPU and which ``http_server`` imports through
   ``internvl_utils``, only to build image transforms).
2. :data:`SERVE_PACKAGES`: what a server start imports beyond that set (the HTTP server, the metrics, the grammar
   backend, the audio reader), pinned, without dependencies, into a set of its own (``wheels.install_once``, once
   per machine, seconds: ``install_seconds`` in the record says how many).
3. The stand-ins (``sglang_cpu_stand_ins/``, copied per session, so an edit counts at once), each saying what it
   replaces: the ``sgl_kernel`` import-only shim, and ``jitwarm_sglang_amx_gate``, the test-only sglang plugin that
   opens the CPU graph runner (the CPU form of the capture ladder) on a CPU without AMX, with the entry point
   (``sglang.srt.plugins``) sglang loads it through beside jitwarm's.

jitwarm is this interpreter's own (its entry point in this environment). The model is the vLLM tests' tiny Llama
(``workers/tiny_model.py``), made with the set's transformers: nothing comes from a hub. Started and stopped by
``vllm_cpu.serving`` (a process group, loopback only), as the vLLM server is.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import sglang_wheel
from wheels import install_once, run_step

TESTS = Path(__file__).resolve().parent
STAND_INS = TESTS / "sglang_cpu_stand_ins"
#: What a server start imports beyond the oracle's set (found by starting one), and what those import that this
#: interpreter's environment need not have: jsonschema's referencing, soundfile's cffi.
SERVE_PACKAGES = (
    "uvloop==0.23.0", "python-multipart==0.0.34", "prometheus-client==0.26.0", "interegular==0.3.3",
    "jsonschema==4.26.0", "jsonschema-specifications==2025.9.1", "referencing==0.37.0", "rpds-py==2026.9.1",
    "xgrammar==0.2.9", "soundfile==0.14.0", "cffi==2.1.1", "pycparser==3.12", "charset-normalizer==3.5.3",
)
#: The plugin's entry point: sglang's plugin group, the name ``SGLANG_PLUGINS`` lists (``srt/plugins/__init__.py``).
GATE = "amx_gate"
GATE_DIST = "jitwarm_sglang_amx_gate-0.0.0.dist-info"
#: The ladder the tests capture: sizes 1 and 2 (``--torch-compile-max-bs``, cuda_graph_hook.py:535-553).
MAX_BS = 2
#: The server's flags every test uses: the CPU engine's graph runner (``intel_amx``, opened by the gate; Inductor
#: graphs per decode batch size), a small KV pool, loopback.
SERVE_FLAGS = ("--device", "cpu", "--attention-backend", "intel_amx", "--max-total-tokens", "8192",
               "--host", "127.0.0.1")


@dataclass(frozen=True)
class SglangCpu:
    """The installed server set: the sglang wheel set, the serving set, the session's stand-ins, the tiny model."""

    sglang: Path
    serving: Path
    overlay: Path
    model: Path
    #: What preparing the set spent installing (the serving set and, first, the wheel set), in seconds.
    install_seconds: float = 0.0

    @property
    def python(self) -> Path:
        return Path(sys.executable)

    def env(self, node: Path, **extra: str) -> dict[str, str]:
        """The environment of a server (and of jitwarm beside it) on a node whose caches all live in ``node``.

        Nothing of the caller's JITWARM_*, SGLANG_*, Inductor, Triton, Hugging Face or Python path settings leaks
        in; ``HOME``, ``TMPDIR`` (Inductor's precompiled header) and ``SGLANG_CACHE_DIR`` are the node's.
        """
        keep = {k: v for k, v in os.environ.items()
                if not k.startswith(("JITWARM_", "VLLM_", "TORCHINDUCTOR_", "TRITON_", "PYTHON", "HF_", "SGLANG_"))}
        (node / "tmp").mkdir(parents=True, exist_ok=True)
        path = os.pathsep.join(str(p) for p in (self.overlay, self.serving, self.sglang))
        return {**keep, "PATH": f"{self.python.parent}{os.pathsep}{os.environ.get('PATH', '')}",
                "PYTHONPATH": path, "PYTHONDONTWRITEBYTECODE": "", "HOME": str(node / "home"),
                "XDG_CACHE_HOME": str(node / "xdg"), "TMPDIR": str(node / "tmp"),
                "SGLANG_CACHE_DIR": str(node / "sglang"), "JITWARM_CACHE_DIR": str(node / "jitwarm"),
                "HF_HOME": str(node / "hf"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                # the CPU engine (srt/utils/common.py:221-224); the gate beside jitwarm, as capture keeps it
                "SGLANG_USE_CPU_ENGINE": "1", "SGLANG_PLUGINS": f"{GATE},jitwarm", **extra}

    def serve(self, port: int) -> list[str]:
        """``python -m sglang.launch_server`` of the tiny model on loopback ``port``, ladder 1..:data:`MAX_BS`."""
        return ["python", "-m", "sglang.launch_server", "--model-path", str(self.model), "--port", str(port),
                *SERVE_FLAGS, "--enable-torch-compile", "--torch-compile-max-bs", str(MAX_BS)]

    def jitwarm(self, *args: str, env: Mapping[str, str], timeout: float = 1200) -> subprocess.CompletedProcess:
        """``jitwarm ARGS`` run as an operator runs it beside the server (its python, its environment)."""
        return subprocess.run([str(self.python), "-m", "jitwarm", *args], env=dict(env), capture_output=True,
                              text=True, timeout=timeout, check=False)


def install_overlay(folder: Path) -> Path:
    """The stand-ins and the gate's entry point (a metadata-only dist-info) in ``folder``."""
    shutil.copytree(STAND_INS, folder, ignore=shutil.ignore_patterns("__pycache__"))
    dist = folder / GATE_DIST
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: jitwarm-sglang-amx-gate\nVersion: 0.0.0\n")
    (dist / "entry_points.txt").write_text(f"[sglang.srt.plugins]\n{GATE} = jitwarm_sglang_amx_gate:register\n")
    return folder


def install_serving() -> Path:
    """The serving set (:data:`SERVE_PACKAGES`), installed once per machine (tests/wheels.py)."""
    return install_once("sglang-serve", SERVE_PACKAGES, "uvloop/__init__.py")


def prepare(folder: Path) -> dict[str, str]:
    """The sets installed once per machine, then the stand-ins and the model into ``folder``.

    A :class:`SglangCpu`'s fields and ``install_seconds`` (what this call spent installing; near 0 once the
    sets are there). WheelUnavailable where a set cannot be installed: the tests skip, saying so.
    """
    start = time.monotonic()
    sglang = Path(sglang_wheel.install()["PYTHONPATH"])
    serving = install_serving()
    installed = time.monotonic() - start
    model = folder / "model"
    run_step([sys.executable, str(TESTS / "workers" / "tiny_model.py"), str(model)], "making the model",
             env={**os.environ, "PYTHONPATH": str(sglang), "HF_HUB_OFFLINE": "1"})
    return {"sglang": str(sglang), "serving": str(serving), "overlay": str(install_overlay(folder / "overlay")),
            "model": str(model), "install_seconds": round(installed, 1)}


def capture_defaults(server: SglangCpu, folder: Path) -> dict[str, str | int]:
    """One ``jitwarm capture --export`` of the real sglang (CPU graphs of sizes 1..:data:`MAX_BS`) on a node in
    ``folder``: the node (``first``), the ``manifest``, the ``bundle``, the server ``log``, and the capture's
    ``stdout``, ``stderr`` and ``returncode`` (the record of conftest's ``sglang_captured``, which
    tests/prebuild.py may make first)."""
    import vllm_cpu
    from first_answers import write_requests

    manifest, bundle = folder / "server.jsonl", folder / "kernels.tar"
    requests = write_requests(folder / "requests.jsonl", GREEDY)
    proc = server.jitwarm("capture", "--manifest", str(manifest), "--export", str(bundle), "--timeout", "1200",
                          "--warm-requests", str(requests), "--json", "--", *server.serve(vllm_cpu.free_port()),
                          env=server.env(folder / "capture-node"))
    return {"first": str(folder / "capture-node"), "manifest": str(manifest), "bundle": str(bundle),
            "log": str(folder / "server.log"), "requests": str(requests), "stdout": proc.stdout,
            "stderr": proc.stderr, "returncode": proc.returncode, "max_bs": MAX_BS}


#: The greedy requests capture sends after its default first requests, whose answers a restored start repeats
#: (tests/first_answers.py): one prompt alone (the size-1 graph), then two in one batch (the size-2 graph), 8
#: tokens each in sglang's own ``/generate``.
GREEDY = tuple(("/generate", {"text": texts, "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                                                 "ignore_eos": True}})
               for texts in (["Hello, my name is"], ["Hello, my name is", "Once upon a time a server"]))


def from_record(record: Mapping[str, object]) -> SglangCpu:
    """The :class:`SglangCpu` of :func:`prepare`'s record."""
    fields = {name: Path(str(value)) for name, value in record.items() if name != "install_seconds"}
    return SglangCpu(**fields, install_seconds=float(record.get("install_seconds", 0.0)))  # type: ignore[arg-type]


def graph_sizes(log: str) -> list[list[int]]:
    """Each ``Capture cpu graph bs [...]`` the server logged (``cpu_graph_runner.py``), as a list of sizes."""
    return [json.loads(line.split("Capture cpu graph bs ", 1)[1].strip()) for line in log.splitlines()
            if "Capture cpu graph bs " in line]


def capture_seconds(log: str) -> list[float]:
    """The ``elapsed=S s`` of each ``Capture target decode CPU graph end`` line: the graph capture's seconds."""
    return [float(line.split("elapsed=", 1)[1].split(" s", 1)[0]) for line in log.splitlines()
            if "CPU graph end" in line and "elapsed=" in line]
