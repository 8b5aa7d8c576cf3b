"""The README, docs/deployment.md and docs/vllm.md agree on the server's environment.

An operator who captures with the README's line and restores with the deployment docs' pod must end with one
environment: vLLM hashes its variables, ``VLLM_PLUGINS`` included, into the compile key
(``vllm/envs.py`` ``compile_factors``), so a value that differs between two documents is a restore refused (exit 4)
or a start that compiles again. Two checks, from the documents' own code blocks:

- across the three documents, a server variable (``VLLM_*``, ``SGLANG_*``) that is not a path has one value
  wherever it is set, in a shell line or in a pod;
- inside each pod, the init container and the server set every variable they both need to the same value: the
  server's variables and every root a library keeps its cache under (``HOME``, ``TMPDIR``, ...), so that what the
  init container restores is where the server looks.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/deployment.md", "docs/vllm.md")
#: Variables whose value is a node's path: they may differ between two documents' examples (not inside a pod).
PATHS = re.compile(r"(_DIR|_ROOT|_BASE|_PATH|_HOME|_FILE)$|^(HOME|TMPDIR)$")
#: Where a library keeps its cache, by the variables the rooms read: the init container and the server must agree.
ROOTS = ("HOME", "TMPDIR", "XDG_CACHE_HOME", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "VLLM_CACHE_ROOT",
         "SGLANG_CACHE_DIR", "FLASHINFER_WORKSPACE_BASE", "TILELANG_CACHE_DIR", "DG_JIT_CACHE_DIR",
         "CUDA_CACHE_PATH", "JITWARM_CACHE_DIR")
#: Only the server sets these: where its ledger goes, its plan-mode config.
SERVER_ONLY = ("JITWARM_LEDGER", "JITWARM_CONFIG", "JITWARM_STRICT")
_ASSIGNMENT = re.compile(r"^([A-Z][A-Z0-9_]*)=(.*)$")


def _blocks(doc: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", (ROOT / doc).read_text(encoding="utf-8"), re.S)


def shell_settings(doc: str) -> list[tuple[str, str]]:
    """``NAME=value`` words that lead a command or follow ``export`` in the document's bash blocks."""
    found = []
    for block in _blocks(doc, "bash"):
        for line in block.splitlines():
            line = line.split("  #")[0].strip()
            if not line or line.startswith("#"):
                continue
            try:
                words = shlex.split(line, comments=True)
            except ValueError:
                continue
            if words[:1] == ["export"]:
                words = words[1:]
            for word in words:
                match = _ASSIGNMENT.match(word)
                if match is None:
                    break
                found.append((match[1], match[2]))
    return found


def pods(doc: str) -> list[dict]:
    """The Pods of the document's YAML blocks."""
    return [d for block in _blocks(doc, "yaml") for d in yaml.safe_load_all(block)
            if isinstance(d, dict) and d.get("kind") == "Pod"]


def container_env(container: dict) -> dict[str, str]:
    return {e["name"]: str(e.get("value")) for e in container.get("env", [])}


def pod_settings(doc: str) -> list[tuple[str, str]]:
    return [item for pod in pods(doc)
            for c in [*pod["spec"].get("initContainers", []), *pod["spec"]["containers"]]
            for item in container_env(c).items()]


def test_the_documents_set_the_servers_variables():
    everywhere = [name for doc in DOCS for name, _ in shell_settings(doc) + pod_settings(doc)]
    assert "VLLM_PLUGINS" in everywhere and "SGLANG_PLUGINS" in everywhere


def test_a_server_variable_has_one_value_in_every_document():
    values: dict[str, dict[str, set[str]]] = {}
    for doc in DOCS:
        for name, value in shell_settings(doc) + pod_settings(doc):
            if name.startswith(("VLLM_", "SGLANG_")) and not PATHS.search(name):
                values.setdefault(name, {}).setdefault(value, set()).add(doc)
    differing = {name: seen for name, seen in values.items() if len(seen) > 1}
    assert not differing, f"set differently across the documents: {differing}"


@pytest.mark.parametrize("doc", [d for d in DOCS if pods(d)])
def test_the_init_container_and_the_server_agree_in_each_pod(doc):
    for pod in pods(doc):
        inits = pod["spec"].get("initContainers", [])
        for init in (i for i in inits if (i.get("command") or [""])[0] == "jitwarm"):
            restores = container_env(init)
            for server in pod["spec"]["containers"]:
                serves = container_env(server)
                shared = {n for n in {*restores, *serves}
                          if n.startswith(("VLLM_", "SGLANG_")) or n in ROOTS or n.startswith("JITWARM_")}
                differing = {n: (restores.get(n), serves.get(n)) for n in sorted(shared - set(SERVER_ONLY))
                             if restores.get(n) != serves.get(n)}
                assert not differing, (f"{doc}: pod {pod['metadata']['name']}: {init['name']} and "
                                       f"{server['name']} differ (init, server): {differing}")
