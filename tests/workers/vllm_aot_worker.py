"""vLLM's own AOT loader on an artifact a torch backend compiled: before the plugin's ``finalize_loading``, and after.

Run by tests/test_vllm_caches.py with vLLM's CPU build (its venv, this tree's jitwarm beside it):
``python vllm_aot_worker.py OUT.json WORKDIR``. torch compiles a small function with the AOTAutograd backend
``aot_eager`` (torch wraps it in ``BundledAOTAutogradSerializableCallable``, as it does for vLLM's CPU platform's
``"inductor"``, without a C++ compile) and saves the artifact; vLLM's ``_try_load_aot_compiled_fn``
(``compilation/decorators.py:285``) loads it. The model object holds what that function reads of vLLM's compiled
model; the config is vLLM's own ``VllmConfig``. What each step saw goes to OUT.json.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import torch


def forward(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(x) * 2 + 1


class Model:
    """What vLLM's AOT loader reads of its compiled model (``decorators.py:285-320``)."""

    _is_encoder = False
    _compile_tag = "backbone"

    def __init__(self, config) -> None:
        self.vllm_config, self.compilation_config = config, config.compilation_config
        self.forward = forward


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def config(mode: str, backend: str):
    from vllm.config import CompilationMode, VllmConfig

    made = VllmConfig()
    made.compilation_config.mode = CompilationMode[mode]
    made.compilation_config.backend = backend
    return made


def main(out: Path, work: Path) -> None:
    from torch._dynamo import aot_compile_types
    from vllm.compilation import decorators
    from vllm.compilation.counter import compilation_counter

    from jitwarm.precompile.servers.vllm import plugin

    lines = Lines()
    for name in ("vllm", "jitwarm"):
        logging.getLogger(name).addHandler(lines)
        logging.getLogger(name).setLevel(logging.INFO)
    path = work / "rank_0_0" / "model"
    path.parent.mkdir(parents=True)
    x = torch.randn(8)
    torch.compile(forward, fullgraph=True, backend="aot_eager").aot_compile(((x,), {})).save_compiled_function(
        str(path))
    wrapper = aot_compile_types.BundledAOTAutogradSerializableCallable
    traced = config("DYNAMO_TRACE_ONCE", "aot_eager")
    seen: dict = {"needed": {f"{mode} {backend}": plugin.aot_load_needed(config(mode, backend))
                             for mode, backend in (("VLLM_COMPILE", "inductor"), ("DYNAMO_TRACE_ONCE", "eager"),
                                                   ("DYNAMO_TRACE_ONCE", "aot_eager"))}}
    seen["before"] = decorators._try_load_aot_compiled_fn(Model(traced), str(path)) is not None
    seen["before_lines"], lines.lines = lines.lines, []

    # A torch whose wrapper defines the method handles it: nothing is applied.
    def finalize_loading(self, vllm_config) -> None:  # noqa: ARG001
        return None

    wrapper.finalize_loading = finalize_loading
    seen["torch_handles_it"] = plugin.aot_load_needed(traced), plugin.load_aot_artifacts(traced)
    del wrapper.finalize_loading

    seen["applied"] = [plugin.load_aot_artifacts(traced) for _ in range(2)]
    loaded = decorators._try_load_aot_compiled_fn(Model(traced), str(path))
    seen["after"] = loaded is not None
    seen["loads_counted"] = compilation_counter.num_aot_artifacts_loaded
    seen["same_output"] = loaded is not None and torch.equal(loaded(x), forward(x))
    seen["after_lines"] = lines.lines
    out.write_text(json.dumps(seen, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
